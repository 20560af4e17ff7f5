"""Sharded (context-parallel) prefill of ``tree-attn generate`` on CPU ranks: wall time against
one process, balance, each rank's peak memory against its estimate, the launching process's.

One ``generate`` job per context: the prompt prefilled on ``--world`` spawned ranks (one thread
each on this machine's cores: a spawned rank gets ``cores // world`` threads), then the one-rank
row, the same rank code at world size 1, in one process with all the cores (its sharded prefill is
a plain causal prefill). Both decode ``--new-tokens`` tokens, which must be equal (exit 1 if not);
transformers' reference is off (its one-process prefill is another code path, not the one timed).

Goals (issue 24): sharded wall <= 1.15x one process; each rank's prefill compute (wall minus the
time it waited for blocks) within 1.25x of the mean; each rank's peak <= weights + 1.2 x its KV
share + activations (+ the process's fixed part, which RSS includes); the launching process holds
no KV. Beside the measurement, the cost model's prefill prediction (``tree_attn.cost.prefill``) for
the same model and context on 1, 4 and 8 GPUs. Nothing here asserts a time.

    python benchmarks/bench_prefill.py --ctx 16384
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch

from tree_attn.commands.generate.decode import ONE_RANK, GenerateSpec, run_generate
from tree_attn.commands.generate.memory import (
    JobShape,
    RowChoice,
    estimate_generate,
    read_budget,
)
from tree_attn.commands.generate.models import PRESETS, ModelSource, check_source
from tree_attn.cost import links
from tree_attn.cost.capacity import GiB, ModelDims
from tree_attn.cost.devices import KNOWN_DEVICES
from tree_attn.cost.prefill import EFFICIENCY, predict_prefill
from tree_attn.files import atomic_write_text, exit_if_unwritable
from tree_attn.launch.setup import LaunchSetup
from tree_attn.reduce.plan import ReductionPlan

GOAL_WALL = 1.15
GOAL_BALANCE = 1.25
GOAL_KV = 1.2
GPUS = (("h100-sxm", links.NVSWITCH_H100), ("rtx4090", links.PCIE_HOST_4090))


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def _gib(b: float) -> str:
    return f"{b / GiB:,.2f}"


def run_one(ctx: int, world: int, layers: int, preset: str, new_tokens: int) -> dict:
    source = ModelSource(preset=preset, layers=layers)
    config = check_source(source)
    vocab = PRESETS[preset]["vocab_size"]
    prompt = tuple(torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist())
    launch = LaunchSetup(world_size=world, device_kind="cpu", backend="gloo", dtype="float32", timeout_s=3600.0,
                         plans=(("tree", ReductionPlan("tree", 2)),))
    dims = ModelDims.from_config(config)
    job = JobShape(dims, new_tokens, "float32", "float32", "cpu", 16, preset=True, ring_decode=False)
    est = estimate_generate(job, ctx, world, read_budget("cpu"), world, spawned=True)
    spec = GenerateSpec(source, prompt, launch, new_tokens=new_tokens, reference=RowChoice(False, "skipped: off"),
                        one_rank=RowChoice(), estimate=est)
    result = run_generate(spec, _say)
    one = result.one_rank_report
    ranks = result.ranks
    sharded_wall = max(r.prefill.wall_s for r in ranks)
    computes = [r.prefill.wall_s - r.prefill.timing.wait_s for r in ranks]
    mean = statistics.mean(computes)
    per_rank = []
    for r in ranks:
        e = est.ranks[r.rank]
        bound = e.weights + GOAL_KV * e.kv + e.activations + e.overhead
        per_rank.append(dict(
            rank=r.rank, tokens=r.prefill.tokens, prefill_wall_s=r.prefill.wall_s, wait_s=r.prefill.timing.wait_s,
            compute_s=r.prefill.wall_s - r.prefill.timing.wait_s, compute_over_mean=(r.prefill.wall_s -
                                                                                 r.prefill.timing.wait_s) / mean,
            ring_bytes_sent=r.prefill.timing.stats.bytes_sent, ring_messages=r.prefill.timing.stats.messages,
            peak_bytes=r.peak_bytes, load_peak_bytes=r.load_peak_bytes, prefill_peak_bytes=r.prefill_peak_bytes,
            decode_peak_bytes=r.decode_peak_bytes, peak_method=r.peak_method, kv_pool_bytes=r.kv_bytes,
            estimate=e.to_dict(), goal_bound_bytes=bound, within_goal=r.peak_bytes <= bound,
            peak_over_estimate=r.peak_bytes / e.total))
    rows = {row.name: row for row in result.rows if row.ran}
    sharded_tokens = [row.tokens for name, row in rows.items() if name != ONE_RANK]
    same = all(t == rows[ONE_RANK].tokens for t in sharded_tokens) and result.all_match
    predictions = []
    for gpu, link in GPUS:
        base = predict_prefill(dims, ctx - 1, 1, KNOWN_DEVICES[gpu], None)
        for p in (1, 4, 8):
            pred = predict_prefill(dims, ctx - 1, p, KNOWN_DEVICES[gpu], link if p > 1 else None)
            predictions.append(dict(gpu=gpu, link=link.kind, **pred.to_dict(), speedup=base.total_s / pred.total_s))
    return dict(
        context=ctx, prefill_tokens=ctx - 1, world=world, preset=preset, layers=layers, new_tokens=new_tokens,
        sharded_wall_s=sharded_wall, one_process_wall_s=one.prefill.wall_s, ratio=sharded_wall / one.prefill.wall_s,
        balance_max_over_mean=max(computes) / mean, ranks=per_rank,
        one_process=dict(peak_bytes=one.peak_bytes, prefill_peak_bytes=one.prefill_peak_bytes,
                         estimate=est.one_rank.to_dict(), peak_over_estimate=one.peak_bytes / est.one_rank.total),
        launcher_peak_bytes=result.launcher_peak_bytes, same_tokens=same, predictions=predictions,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, action="append", help="prompt tokens (repeat; default 16384)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=1, help="layers of the preset (default 1)")
    ap.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--new-tokens", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/out/prefill-<preset>.json)")
    args = ap.parse_args()
    out = Path(args.out) if args.out else _ROOT / "benchmarks" / "out" / f"prefill-{args.preset}.json"
    exit_if_unwritable(ap, {"--out": out})
    records = []
    for ctx in args.ctx or [16384]:
        print(f"[{args.preset} x{args.layers}] {ctx:,} tokens on {args.world} ranks and on one", file=sys.stderr,
              flush=True)
        records.append(run_one(ctx, args.world, args.layers, args.preset, args.new_tokens))
    cores = os.cpu_count()
    print(f"\nsharded prefill, {args.preset} with {args.layers} layer(s), float32, {args.world} CPU ranks "
          f"({max(1, cores // args.world)} thread(s) each) vs one process ({cores} threads)")
    print(f"{'context':>8} {'sharded s':>10} {'one proc s':>10} {'ratio':>6} {'goal':>5} {'balance':>8} "
          f"{'goal':>5} {'same':>5} {'launcher peak':>14}")
    for rec in records:
        print(f"{rec['context']:>8,} {rec['sharded_wall_s']:>10.1f} {rec['one_process_wall_s']:>10.1f} "
              f"{rec['ratio']:>5.2f}x {'ok' if rec['ratio'] <= GOAL_WALL else 'MISS':>5} "
              f"{rec['balance_max_over_mean']:>7.3f}x "
              f"{'ok' if rec['balance_max_over_mean'] <= GOAL_BALANCE else 'MISS':>5} "
              f"{'yes' if rec['same_tokens'] else 'NO':>5} {_gib(rec['launcher_peak_bytes']):>10} GiB")
    print(f"\nmemory per rank, GiB (peak: RSS high-water; bound: weights + {GOAL_KV} x KV + activations + process)")
    print(f"{'context':>8} {'rank':>4} {'tokens':>7} {'peak':>6} {'load':>6} {'prefill':>7} {'estimate':>8} "
          f"{'bound':>6} {'goal':>5} {'wait s':>7} {'ring sent':>10}")
    for rec in records:
        for r in rec["ranks"]:
            print(f"{rec['context']:>8,} {r['rank']:>4} {r['tokens']:>7,} {_gib(r['peak_bytes']):>6} "
                  f"{_gib(r['load_peak_bytes']):>6} {_gib(r['prefill_peak_bytes']):>7} "
                  f"{_gib(r['estimate']['total']):>8} {_gib(r['goal_bound_bytes']):>6} "
                  f"{'ok' if r['within_goal'] else 'MISS':>5} {r['wait_s']:>7.1f} {_gib(r['ring_bytes_sent']):>6} GiB")
        o = rec["one_process"]
        print(f"{rec['context']:>8,} {'one':>4} {rec['prefill_tokens']:>7,} {_gib(o['peak_bytes']):>6} {'':>6} "
              f"{_gib(o['prefill_peak_bytes']):>7} {_gib(o['estimate']['total']):>8}")
    print(f"\npredicted prefill on GPUs (cost.prefill: datasheet bf16 peak x {EFFICIENCY} assumed, ring blocks over "
          "the link, overlapped; bf16 weights and KV)")
    print(f"{'context':>8} {'gpu':>9} {'GPUs':>4} {'predicted ms':>13} {'exposed comm ms':>16} {'speedup':>8}")
    for rec in records:
        for p in rec["predictions"]:
            print(f"{rec['context']:>8,} {p['gpu']:>9} {p['world']:>4} {1e3 * p['total_s']:>13.2f} "
                  f"{1e3 * p['exposed_comm_s']:>16.2f} {p['speedup']:>7.2f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(dict(machine=platform.machine(), cpus=cores, torch=torch.__version__,
                                   when=time.strftime("%Y-%m-%d %H:%M"), records=records), indent=2))
    print(f"wrote {out}")
    return 0 if all(rec["same_tokens"] for rec in records) else 1


if __name__ == "__main__":
    sys.exit(main())
