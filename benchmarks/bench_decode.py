"""Tree vs Ring decoding on CPU ranks (gloo): sweep sequence length and world size.

For each (world size, total tokens) it runs ``tree-attn run``'s machinery with the Llama-3.1-8B
attention shape (32 query heads, 8 KV heads, head dim 128, batch 1, fp32 on CPU) and records the
median / p95 step time, bytes each rank sends per step, peak memory per rank and the error
against the single-process reference. It also prints the volumes the paper's analysis predicts:
the tree's messages are one ``B x Hq x (D+1)`` float32 state per edge, independent of the length;
Ring forwards ``p - 1`` KV shards per step, linear in it.

    python benchmarks/bench_decode.py                     # full sweep (several minutes on 2 cores)
    python benchmarks/bench_decode.py --quick             # 2 sizes, 2 world sizes
    python benchmarks/bench_decode.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

# Run from a checkout without installing: make the repository root importable.
_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "tree_attn").is_dir() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tree_attn.commands.run.decode import RunSpec, run_decode
from tree_attn.files import atomic_write_text, exit_if_unwritable
from tree_attn.launch.setup import LaunchSetup
from tree_attn.reduce.plan import ReductionPlan


def predicted_bytes(strategy: str, world: int, seq_len: int, spec: RunSpec, fanout: int = 2) -> float:
    """Bytes the busiest rank sends per step by the analysis (payload only)."""
    state = spec.batch * spec.q_heads * (spec.head_dim + 1) * 4
    if world == 1:
        return 0.0
    if strategy == "tree":
        # The busiest rank sends one state per tree edge it touches: one up, one down per child.
        tree = ReductionPlan("tree", fanout).tree(world)
        return max((tree.parent[r] >= 0) + len(tree.children[r]) for r in range(world)) * state
    if strategy == "allreduce":
        lse = spec.batch * spec.q_heads * 4
        return 2 * (world - 1) / world * (lse + state)
    shard = -(-seq_len // world)  # ceil: the largest shard
    return (world - 1) * 2 * spec.batch * shard * spec.kv_heads * spec.head_dim * 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="16384,32768,65536,131072,262144")
    ap.add_argument("--world-sizes", default="2,4,8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="16K and 64K tokens on 2 and 4 ranks")
    ap.add_argument("--out", default="benchmarks/out/bench_decode.json")
    ap.add_argument("--table-from", help="reprint the table of an earlier run's JSON instead of measuring")
    args = ap.parse_args()
    if args.table_from:
        import pathlib

        data = json.loads(pathlib.Path(args.table_from).read_text())
        for r in data["rows"]:
            spec = RunSpec(LaunchSetup(world_size=r["world_size"], plans=(("ring", None),)), seq_len=r["seq_len"])
            r["predicted_bytes"] = predicted_bytes(r["strategy"], r["world_size"], r["seq_len"], spec)
        print(f"machine: {data['machine']}")
        print_table(data["rows"])
        return 0
    exit_if_unwritable(ap, {"--out": args.out})
    seq_lens = [16384, 65536] if args.quick else [int(x) for x in args.seq_lens.split(",")]
    worlds = [2, 4] if args.quick else [int(x) for x in args.world_sizes.split(",")]
    plans = (("tree", ReductionPlan("tree", 2)), ("allreduce", ReductionPlan("allreduce")), ("ring", None))
    rows = []
    for world in worlds:
        for n in seq_lens:
            spec = RunSpec(LaunchSetup(world_size=world, plans=plans), seq_len=n, steps=args.steps, warmup=args.warmup)
            t0 = time.time()
            print(f"world {world}, {n} tokens ...", file=sys.stderr, flush=True)
            result = run_decode(spec)
            for r in result.results:
                row = r.to_dict()
                row.update(world_size=world, seq_len=n, predicted_bytes=predicted_bytes(r.strategy, world, n, spec))
                rows.append(row)
            print(f"  done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print_table(rows)
    machine = f"{platform.machine()} {platform.processor()}".strip() + f", {__import__('os').cpu_count()} cores"
    import pathlib

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps({"machine": machine, "rows": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def print_table(rows: list[dict]) -> None:
    by = {(r["world_size"], r["seq_len"], r["strategy"]): r for r in rows}
    header = (
        f"{'p':>2} {'tokens':>7} {'strategy':>9} {'median ms':>10} {'p95 ms':>9} {'sent/rank':>11} "
        f"{'predicted':>11} {'peak MiB':>9} {'+MiB':>7} {'max err':>8} {'ring/x':>7}"
    )
    print(header)
    for r in rows:
        ring = by.get((r["world_size"], r["seq_len"], "ring"))
        speed = ring["step_ms_median"] / r["step_ms_median"] if ring else float("nan")
        print(
            f"{r['world_size']:>2} {r['seq_len']:>7} {r['strategy']:>9} {r['step_ms_median']:>10.2f} "
            f"{r['step_ms_p95']:>9.2f} {r['bytes_sent_per_step']:>11,} {int(r['predicted_bytes']):>11,} "
            f"{r['peak_mem_bytes'] / 2**20:>9.0f} {r['peak_mem_above_start_bytes'] / 2**20:>7.0f} "
            f"{r['max_abs_err']:>8.1e} {speed:>7.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
