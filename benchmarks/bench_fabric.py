"""Decoding across a fabric of "nodes" with a shaped link between them: step time per strategy, and
the bytes that cross the slow link per step, counted from the plan and checked against the links'
interface counters.

Each node is a network namespace (tests/fabric.py) whose ranks talk over its loopback; the nodes
reach each other only through a veth link to a bridge, shaped by tbf to ``--rate`` in both
directions. ``torchrun`` runs ``python -m tree_attn run --json`` in every node (gloo CPU ranks).

    python benchmarks/bench_fabric.py --nodes 2 --ranks-per-node 2 --rate 100mbit --seq-len 65536 --json OUT
    python benchmarks/bench_fabric.py --seq-len 16K,64K --rates 10mbit,100mbit,1gbit,10gbit --json OUT

For each rate, length and strategy, two jobs run (one strategy each): a short one (no warm-up, one
step) and the measured one (``--warmup`` + ``--steps``). Both do the same setup (rendezvous,
process group, shape exchange, reports gathered to rank 0), so the difference of the links'
counters between them, over the difference in steps, is what the decode steps themselves put on
the wire; the table's times are the measured job's (``run --json``: median and p95 of the slowest
rank's step, a step running from a barrier to its result).

Columns:
- ``counted B/step``: payload bytes that cross between nodes per step, all directions together,
  from the plan: tree, one packed state ``[B, Hq, D + 1]`` float32 up and one down per tree edge
  whose ends are on different nodes; allreduce, gloo's ring (rank r sends to r - 1) moves
  ``2 (p - 1) / p`` of the payload per rank, and the ranks whose ring neighbour is on another
  node cross; ring, every rank passes ``p - 1`` KV blocks (and their lengths) to r + 1. The sum over
  ranks is checked against what the ranks counted themselves (run's CommStats).
- ``wire B/step``: the nodes' ``fab0`` tx bytes (``/sys/class/net/fab0/statistics``), summed
  over nodes (every crossing frame leaves exactly one node; rx, the same frames arriving, is in
  the JSON). Whole Ethernet frames: 14 B Ethernet + 20 B IP + 32 B TCP (with timestamps) per
  segment, the receiver's ACKs, gloo's own header per message, and the barrier that starts each
  timed step (its messages between the nodes); ``overhead`` is wire / counted - 1.

Not here yet: the plan ``tune`` picks in the fabric and the cost model's prediction (both come
with the tune/cost work); each row is a dict, so they join as ``tune_plan`` and
``model_step_ms`` keys.

Needs root (network namespaces, tc). Run it on a quiet machine (the repository's convention:
under the exclusive CPU lock).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.fabric import Fabric, FabricError, parse_rate, run_report, unavailable_reason
from tree_attn.commands.defaults import parse_tokens

SCHEMA = 1
STRATEGIES = ("tree", "allreduce", "ring")
_ELT = {"float32": 4, "float16": 2, "bfloat16": 2}


def crossing_payload(config: dict, strategy: str, result: dict, ranks_per_node: int) -> dict:
    """Payload bytes and messages per step that cross between nodes under ``strategy``'s plan,
    from the run's config; and the sum over ranks of what the plan sends, against the ranks' own
    count (``bytes_sent_per_step_mean`` x world size) as a check of the mapping."""
    p = config["world_size"]
    b, hq, hkv, d = config["batch"], config["q_heads"], config["kv_heads"], config["head_dim"]
    node = [r // ranks_per_node for r in range(p)]  # torchrun numbers ranks node by node
    state = b * hq * (d + 1) * 4
    sent = [0] * p  # per rank, all messages
    cross_bytes = cross_msgs = 0
    if strategy == "tree":
        plan = next(s["plan"] for s in config["strategies"] if s["strategy"] == "tree")
        for r, parent in enumerate(plan["parents"]):
            if parent < 0:
                continue
            sent[r] += state
            sent[parent] += state
            if node[r] != node[parent]:
                cross_bytes += 2 * state
                cross_msgs += 2
    elif strategy == "allreduce":
        # AllReduceMerge: a max all-reduce of lse [B, Hq] and a sum all-reduce of the packed
        # [B, Hq, D + 1]. gloo's ring (gloo/allreduce.cc) sends to rank r - 1: in reduce-scatter
        # and again in all-gather, p - 1 of its p chunks, each chunk cut into at least 2
        # segments (one in flight while the other is reduced): 2 (p - 1) / p of the payload per
        # rank, in 2 (2p - 2) messages per all-reduce at these sizes.
        per_rank = (2 * (p - 1) * (b * hq * 4 + state)) // p if p > 1 else 0
        for r in range(p):
            sent[r] = per_rank
            if node[r] != node[(r - 1) % p]:
                cross_bytes += per_rank
                cross_msgs += 2 * 2 * (2 * p - 2)
    elif strategy == "ring":
        lengths = config["shard_sizes"]
        kv = b * hkv * d * _ELT[config["dtype"]] * 2  # K and V per token
        for r in range(p):
            for step in range(p - 1):
                n = lengths[(r - step) % p]
                nbytes = b * 4 + (n * kv if n > 0 else 0)  # the block's lengths, then K and V
                msgs = 1 + (2 if n > 0 else 0)
                sent[r] += nbytes
                if node[r] != node[(r + 1) % p]:
                    cross_bytes += nbytes
                    cross_msgs += msgs
    else:
        raise ValueError(strategy)
    return {
        "counted_bytes_per_step": cross_bytes,
        "counted_messages_per_step": cross_msgs,
        "plan_bytes_all_ranks": sum(sent),
        "ranks_counted_bytes_all_ranks": result["bytes_sent_per_step_mean"] * p,
    }


def run_job(fab: Fabric, args: list[str], ranks_per_node: int, timeout_s: float) -> tuple[dict, list]:
    """One torchrun job across the fabric; its run report and each node's link counter delta."""
    before = [fab.counters(i) for i in range(len(fab.nodes))]
    results = fab.torchrun(args, ranks_per_node=ranks_per_node, join_timeout_s=120).wait(timeout=timeout_s)
    after = [fab.counters(i) for i in range(len(fab.nodes))]
    for r in results:
        if r.returncode != 0:
            tail = "\n".join(r.stderr.splitlines()[-15:])
            raise FabricError(f"node {r.node} exited {r.returncode} (killed: {r.killed}):\n{tail}")
    return run_report(results), [a - b for a, b in zip(after, before)]


def measure(fab: Fabric, opts, rate: str, seq_len: int, strategy: str) -> dict:
    ring = strategy == "ring"
    warmup, steps = (opts.ring_warmup, opts.ring_steps) if ring else (opts.warmup, opts.steps)
    base = ["run", "--device", "cpu", "-n", str(seq_len), "--heads", str(opts.heads), "--kv-heads",
            str(opts.kv_heads), "--head-dim", str(opts.head_dim), "-s", strategy, "--timeout", str(opts.timeout),
            "--json"]
    _short, d_short = run_job(fab, base + ["--warmup", "0", "--steps", "1"], opts.ranks_per_node, opts.job_timeout)
    data, d_long = run_job(fab, base + ["--warmup", str(warmup), "--steps", str(steps)], opts.ranks_per_node,
                           opts.job_timeout)
    extra = warmup + steps - 1  # steps the measured job ran beyond the short one
    row = data["results"][0]
    cross = crossing_payload(data["config"], strategy, row, opts.ranks_per_node)
    tx = sum(d.tx_bytes for d in d_long) - sum(d.tx_bytes for d in d_short)
    rx = sum(d.rx_bytes for d in d_long) - sum(d.rx_bytes for d in d_short)
    pk = sum(d.tx_packets for d in d_long) - sum(d.tx_packets for d in d_short)
    wire = tx / extra if extra else None
    counted = cross["counted_bytes_per_step"]
    return {
        "rate": rate,
        "rate_bps": parse_rate(rate) if rate != "none" else None,
        "seq_len": seq_len,
        "strategy": strategy,
        "plan": row["plan"],
        "warmup": warmup,
        "steps": steps,
        "step_ms_median": row["step_ms_median"],
        "step_ms_p95": row["step_ms_p95"],
        "max_abs_err": row["max_abs_err"],
        "max_lse_err": row["max_lse_err"],
        "bytes_sent_per_step_max_rank": row["bytes_sent_per_step"],
        "crossing": {
            **cross,
            "wire_tx_bytes_per_step": wire,
            "wire_rx_bytes_per_step": rx / extra if extra else None,
            "wire_packets_per_step": pk / extra if extra else None,
            "overhead": (wire / counted - 1) if wire is not None and counted else None,
            "short_job_wire_tx_bytes": sum(d.tx_bytes for d in d_short),
            "steps_differenced": extra,
        },
        "config": {k: data["config"][k] for k in ("world_size", "nodes", "batch", "q_heads", "kv_heads", "head_dim",
                                                  "dtype", "shard_sizes")},
    }


def _fmt_b(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_n(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_table(rows: list[dict]) -> None:
    head = (f"{'rate':>8} {'tokens':>7} {'strategy':<18} {'median ms':>10} {'p95 ms':>10} {'counted B/step':>15} "
            f"{'wire B/step':>12} {'overhead':>9} {'pkts/step':>9} {'max err':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['rate']:>8} {r['seq_len']:>7} {r['strategy']:<18} skipped: {r['skipped']}")
            continue
        c = r["crossing"]
        over = f"{100 * c['overhead']:.1f}%" if c["overhead"] is not None else "-"
        label = r["strategy"] if r["plan"] == r["strategy"] else f"{r['strategy']} ({r['plan']})"
        print(f"{r['rate']:>8} {r['seq_len']:>7} {label:<18} {r['step_ms_median']:>10.2f} {r['step_ms_p95']:>10.2f} "
              f"{_fmt_b(c['counted_bytes_per_step']):>15} {_fmt_b(c['wire_tx_bytes_per_step']):>12} {over:>9} "
              f"{_fmt_n(c['wire_packets_per_step']):>9} {r['max_abs_err']:>8.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate", default="100mbit",
                    help="tc rate of every node's link (e.g. 100mbit, 1gbit; 'none': unshaped)")
    ap.add_argument("--rates", help="comma list of rates to sweep instead of --rate (e.g. 10mbit,100mbit,1gbit,10gbit)")
    ap.add_argument("--burst", type=int, help="tbf bucket in bytes (default: max(64 KiB, 5 ms of the rate))")
    ap.add_argument("--seq-len", default="65536", help="total KV tokens, or a comma list (16K,64K)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of tree and allreduce")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ring-steps", type=int, default=3, help="timed steps of ring (whole KV blocks cross: slow)")
    ap.add_argument("--ring-warmup", type=int, default=1)
    ap.add_argument("--ring-max-s", type=float, default=60.0,
                    help="skip ring where its crossing bytes at the rate alone would take longer per step")
    ap.add_argument("--timeout", type=float, default=600.0, help="run's collective timeout")
    ap.add_argument("--job-timeout", type=float, default=1800.0, help="seconds one torchrun job may take")
    ap.add_argument("--json", dest="json_out", help="write the results here")
    opts = ap.parse_args()

    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_fabric: {reason}", file=sys.stderr)
        return 2
    rates = [r.strip() for r in (opts.rates or opts.rate).split(",") if r.strip()]
    for r in rates:
        if r != "none":
            parse_rate(r)
    lengths = [parse_tokens(t) for t in opts.seq_len.split(",") if t.strip()]
    strategies = [s.strip() for s in opts.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}")
    rows: list[dict] = []
    started = time.time()
    with Fabric(opts.nodes, rate=None, burst_bytes=opts.burst) as fab:
        for rate in rates:
            for i in range(opts.nodes):
                if rate != "none":
                    fab.set_rate(i, rate)
                elif fab.rates[i] is not None:
                    fab.set_rate(i, None)
            for n in lengths:
                for s in strategies:
                    if s == "ring" and rate != "none":
                        # Ring's crossing bytes per step at the link rate, a lower bound on its step.
                        est = _ring_estimate_s(opts, n, parse_rate(rate))
                        if est > opts.ring_max_s:
                            rows.append({"rate": rate, "seq_len": n, "strategy": s,
                                         "skipped": f"ring would move its blocks across for >= {est:.0f} s per step "
                                                    f"(--ring-max-s {opts.ring_max_s:g})"})
                            print_progress(rows[-1])
                            continue
                    rows.append(measure(fab, opts, rate, n, s))
                    print_progress(rows[-1])
    print()
    print_table(rows)
    out = {
        "schema": SCHEMA,
        "bench": "bench_fabric",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "fabric": {"nodes": opts.nodes, "ranks_per_node": opts.ranks_per_node,
                   "link": "veth to a bridge, tbf both ways",
                   "tbf": (f"burst {opts.burst} B" if opts.burst else "burst max(64 KiB, 5 ms of the rate)")
                   + ", latency 50 ms"},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "rows": rows,
    }
    if opts.json_out:
        from tree_attn.files import atomic_write_text

        Path(opts.json_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(opts.json_out, json.dumps(out, indent=2) + "\n")
        print(f"wrote {opts.json_out}", file=sys.stderr)
    return 0


def _ring_estimate_s(opts, seq_len: int, rate_bps: float) -> float:
    """Seconds per ring step from the link alone: each of the p - 1 passes moves a whole KV block
    over every node's link, both ways at once (a lower bound: compute and latency come on top)."""
    p = opts.nodes * opts.ranks_per_node
    block = -(-seq_len // p) * opts.kv_heads * opts.head_dim * 4 * 2
    return (p - 1) * block * 8 / rate_bps


def print_progress(row: dict) -> None:
    if "skipped" in row:
        print(f"[{row['rate']} {row['seq_len']} {row['strategy']}] skipped: {row['skipped']}", file=sys.stderr,
              flush=True)
        return
    c = row["crossing"]
    print(f"[{row['rate']} {row['seq_len']} {row['strategy']}] median {row['step_ms_median']:.2f} ms, "
          f"p95 {row['step_ms_p95']:.2f} ms, counted {c['counted_bytes_per_step']} B/step, wire "
          f"{_fmt_b(c['wire_tx_bytes_per_step'])}/step", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
