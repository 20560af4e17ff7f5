"""``tree-attn generate`` at long contexts: per-token latency of tree vs ring vs one process, on
CPU ranks (or GPUs with ``--device cuda``).

For each context length the prompt (random ids) is prefilled once, in a child process, which also
decodes the reference (transformers' sdpa attention and cache) and the one-rank row (tree-attn's
paged kernel); then the prefill KV is split over 2 and over 4 spawned ranks and each strategy
decodes the same tokens. ``--dtype auto`` (the default) is generate's: bf16 on GPUs, float32 on CPU
ranks. Every row's tokens are checked against the reference's; a row that differs is marked and
the script exits 1. Nothing here asserts a time.

Cases:

- ``small``: the default ``small`` preset (4 layers, 8 query / 2 KV heads, head dim 64);
- ``8b-2layers``: the ``llama-3.1-8b`` preset (Llama-3.1-8B's layer shapes, 32 / 8 heads x 128)
  with 2 layers.

    python benchmarks/bench_generate.py --case small --ctx 8192 --ctx 16384 --ctx 32768 --ctx 65536
    python benchmarks/bench_generate.py --case 8b-2layers --ctx 65536 --worlds 2 --worlds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch

from tree_attn.commands.generate.decode import GenerateSpec, decode_in_one_process, decode_on_ranks
from tree_attn.commands.generate.models import PRESETS, ModelSource
from tree_attn.dtypes import parse_dtype
from tree_attn.launch.setup import LaunchSetup, default_dtype
from tree_attn.reduce.plan import ReductionPlan

CASES = {"small": ModelSource(preset="small"), "8b-2layers": ModelSource(preset="llama-3.1-8b", layers=2)}


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), default="small")
    ap.add_argument("--ctx", type=int, action="append", help="prompt tokens (repeat; default 8192)")
    ap.add_argument("--worlds", type=int, action="append", help="rank counts (repeat; default 2 and 4)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 on GPUs, float32 on CPU), float32, fp16 or bf16")
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/out/generate-<case>.json)")
    args = ap.parse_args()
    contexts = args.ctx or [8192]
    worlds = args.worlds or [2, 4]
    source = CASES[args.case]
    vocab = PRESETS[source.preset]["vocab_size"]
    backend = "nccl" if args.device == "cuda" else "gloo"
    dtype = parse_dtype(default_dtype(args.device) if args.dtype == "auto" else args.dtype)
    device = None  # named by the child that decodes the one-process rows (this process touches no GPU)
    records = []
    failed = False
    for ctx in contexts:
        prompt = tuple(torch.randint(0, vocab, (ctx,), generator=torch.Generator().manual_seed(ctx)).tolist())
        launch = LaunchSetup(world_size=worlds[0], device_kind=args.device, backend=backend, dtype=dtype,
                             timeout_s=600.0, plans=(("tree", ReductionPlan("tree", 2)), ("ring", None)))
        spec = GenerateSpec(source, prompt, launch, new_tokens=args.new_tokens)
        print(f"[{args.case}] {ctx:,} tokens: prefill and one-process rows", file=sys.stderr, flush=True)
        folder = tempfile.mkdtemp(prefix="tree-attn-bench-generate-")
        try:
            local = decode_in_one_process(spec, folder, _say)
            device = local.device
            rows = [(1, r) for r in local.rows]
            for world in worlds:
                print(f"[{args.case}] {ctx:,} tokens: {world} ranks", file=sys.stderr, flush=True)
                spec_w = dataclasses.replace(spec, launch=dataclasses.replace(launch, world_size=world))
                rows += [(world, r) for r in decode_on_ranks(spec_w, folder, local.reference, _say)]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        ring = {w: r.median_s for w, r in rows if r.name == "ring"}
        for world, r in rows:
            same = r.matches_reference and r.ranks_agree
            failed |= not same
            records.append(dict(case=args.case, context=ctx, ranks=world, name=r.name, median_ms=1e3 * r.median_s,
                                p95_ms=1e3 * r.p95_s, tokens_per_s=r.tokens_per_s,
                                bytes_per_rank_per_token=r.bytes_per_token,
                                messages_per_rank_per_token=r.messages_per_token, same_tokens=same,
                                ring_over_this=(ring[world] / r.median_s) if world in ring else None,
                                prefill_s=local.prefill_s))
        del local
    print(f"\n{args.case}: {args.new_tokens} tokens per row, {device}, {backend}, {dtype}; per-token latency on rank 0")
    print(f"{'context':>8} {'ranks':>5} {'decode':<10} {'median ms':>10} {'p95 ms':>9} {'tok/s':>7} "
          f"{'sent/rank/token':>16} {'ring/this':>9} {'same':>5}")
    for rec in records:
        ratio = f"{rec['ring_over_this']:.2f}x" if rec["ring_over_this"] is not None else "-"
        print(f"{rec['context']:>8} {rec['ranks']:>5} {rec['name']:<10} {rec['median_ms']:>10.2f} "
              f"{rec['p95_ms']:>9.2f} {rec['tokens_per_s']:>7.1f} {rec['bytes_per_rank_per_token']:>16,} {ratio:>9} "
              f"{'yes' if rec['same_tokens'] else 'NO':>5}")
    out = Path(args.out) if args.out else _ROOT / "benchmarks" / "out" / f"generate-{args.case}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(device=device, backend=backend, dtype=dtype, torch=torch.__version__,
                                   when=time.strftime("%Y-%m-%d %H:%M"), records=records), indent=2))
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
