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

Strategies: ``tree`` (the hierarchical tree of the node layout: one message per node across the
link each way), ``flat`` (``run --plan flat``: a binary tree in rank order, which crosses the link
more often), ``allreduce`` and ``ring``.

With ``--tune``, ``tree-attn tune --quick`` runs in the fabric at each rate first (the candidate
plans timed across the nodes at the decode message size) and each row gets ``tune_plan`` (the
plan it chose and every candidate's median). With ``--model``, the cost model predicts each row:
the host's CPU ranks calibrated once (``tree_attn.cost.calibrate.calibrate_cpu``: local attention,
merge, loopback), the network class calibrated at each rate from ``tree-attn probe --measure``
run across the fabric's nodes (``tree_attn.cost.fit.network_from_topology``), every rank of the
job sharing the host's cores (``fabric_cluster``); never from the decode runs it is checked
against. ``model_step_ms`` and ``model_error`` (predicted / measured median - 1) join the row, with
the model's bytes per rank against the ranks' own count (``bytes_exact``). ``--plot FILE.png``
draws step time against link rate per strategy (measured points, the model's lines over
``--model-rates``).

Needs root (network namespaces, tc). Run it on a quiet machine (the repository's convention:
under the exclusive CPU lock).
"""

from __future__ import annotations

import argparse
import json
import math
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
from tree_attn.files import exit_if_unwritable

SCHEMA = 1
STRATEGIES = ("tree", "flat", "allreduce", "ring")
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
        parents = plan.get("parents")
        if parents is None:  # a k-ary tree in rank order (--plan flat)
            from tree_attn.reduce.plan import ReductionPlan

            parents = ReductionPlan("tree", plan["fanout"]).tree(p).parent
        for r, parent in enumerate(parents):
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
    run_strategy = "tree" if strategy == "flat" else strategy
    base = ["run", "--device", "cpu", "-n", str(seq_len), "--heads", str(opts.heads), "--kv-heads",
            str(opts.kv_heads), "--head-dim", str(opts.head_dim), "-s", run_strategy, "--timeout", str(opts.timeout),
            "--json"] + (["--plan", "flat"] if strategy == "flat" else [])
    if opts.no_wire:  # no short job: the links' counters are not differenced (saves a job per row)
        d_short = None
    else:
        _short, d_short = run_job(fab, base + ["--warmup", "0", "--steps", "1"], opts.ranks_per_node,
                                  opts.job_timeout)
    data, d_long = run_job(fab, base + ["--warmup", str(warmup), "--steps", str(steps)], opts.ranks_per_node,
                           opts.job_timeout)
    extra = warmup + steps - 1  # steps the measured job ran beyond the short one
    row = data["results"][0]
    cross = crossing_payload(data["config"], run_strategy, row, opts.ranks_per_node)
    if d_short is None:
        extra = 0  # nothing to difference against: no wire figures
        d_short = d_long
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
        "plan_parents": next((st["plan"] or {}).get("parents") for st in data["config"]["strategies"]),
        "bytes_sent_per_step_ranks": row["bytes_sent_per_step"],
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
    head = (f"{'rate':>8} {'tokens':>7} {'strategy':<26} {'median ms':>10} {'p95 ms':>10} {'model ms':>9} "
            f"{'error':>6} {'counted B/step':>15} {'wire B/step':>12} {'overhead':>9} {'pkts/step':>9} {'max err':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['rate']:>8} {r['seq_len']:>7} {r['strategy']:<18} skipped: {r['skipped']}")
            continue
        c = r["crossing"]
        over = f"{100 * c['overhead']:.1f}%" if c["overhead"] is not None else "-"
        label = r["strategy"] if r["plan"] == r["strategy"] else f"{r['strategy']} ({r['plan']})"
        model = f"{r['model_step_ms']:.2f}" if r.get("model_step_ms") is not None else "-"
        err = r.get("model_error")
        err_s = "-" if err is None else f"{100 * err:+.0f}%" + ("*" if abs(err) > 0.30 else "")
        print(f"{r['rate']:>8} {r['seq_len']:>7} {label:<26} {r['step_ms_median']:>10.2f} {r['step_ms_p95']:>10.2f} "
              f"{model:>9} {err_s:>6} "
              f"{_fmt_b(c['counted_bytes_per_step']):>15} {_fmt_b(c['wire_tx_bytes_per_step']):>12} {over:>9} "
              f"{_fmt_n(c['wire_packets_per_step']):>9} {r['max_abs_err']:>8.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rate", default="100mbit",
                    help="tc rate of every node's link (e.g. 100mbit, 1gbit; 'none': unshaped)")
    ap.add_argument("--rates", help="comma list of rates to sweep instead of --rate (e.g. 10mbit,100mbit,1gbit,10gbit)")
    ap.add_argument("--burst", default="nic",
                    help="tbf bucket: 'nic' (default: about 100 us of the rate, at least 3,000 B, so each message "
                         "leaves at the link's rate as from a NIC), 'tbf' (max(64 KiB, 5 ms of the rate): a decode "
                         "message leaves an idle link at the veth's speed) or a number of bytes")
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
    ap.add_argument("--tune", action="store_true", help="run tune --quick in the fabric at each rate (tune_plan)")
    ap.add_argument("--model", action="store_true",
                    help="predict each row: calibrate the host's CPU ranks once and the network at each rate "
                         "(probe --measure across the nodes)")
    ap.add_argument("--probe-iterations", type=int, default=3, help="probe --measure iterations per pair (--model)")
    ap.add_argument("--model-rates", default="10mbit,30mbit,100mbit,300mbit,1gbit,3gbit,10gbit",
                    help="rates the plot's model lines are drawn over (the network's latency as measured; its "
                         "bandwidth the rate)")
    ap.add_argument("--plot", help="write step time against link rate per strategy to this PNG (needs matplotlib)")
    ap.add_argument("--plot-from", help="comma list of JSON files this script wrote (same nodes): draw --plot from "
                                        "their rows together (the model's lines of the first), and run nothing")
    ap.add_argument("--no-wire", action="store_true",
                    help="skip the 1-step job per row whose counters the measured job's are differenced against "
                         "(no wire bytes; half the jobs)")
    ap.add_argument("--json", dest="json_out", help="write the results here")
    opts = ap.parse_args()

    if opts.plot_from:
        if not opts.plot:
            ap.error("--plot-from needs --plot FILE.png")
        exit_if_unwritable(ap, {"--plot": opts.plot})
        parts = [json.loads(Path(f).read_text()) for f in opts.plot_from.split(",") if f.strip()]
        # The model's lines of the first file (each run draws them over every rate from its own
        # calibrations: one set, not several on top of each other).
        merged = dict(parts[0], rows=[r for p in parts for r in p["rows"]])
        plot_rates(merged, opts.plot)
        print(f"wrote {opts.plot}", file=sys.stderr)
        return 0
    exit_if_unwritable(ap, {"--json": opts.json_out, "--plot": opts.plot})
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
    host = None
    if opts.model:
        from tree_attn.cost.calibrate import calibrate_cpu

        print("calibrating the host's CPU ranks (local attention, merge, loopback)...", file=sys.stderr, flush=True)
        host = calibrate_cpu(dtype="float32")
        print(f"  {host.notes[0]}", file=sys.stderr, flush=True)
    networks: dict[str, dict] = {}
    tunes: dict[str, dict] = {}
    burst = {"nic": "nic", "tbf": None}.get(opts.burst)
    if burst is None and opts.burst != "tbf":
        if not opts.burst.isdigit():
            ap.error(f"--burst: nic, tbf or a number of bytes; got {opts.burst!r}")
        burst = int(opts.burst)
    with Fabric(opts.nodes, rate=None, burst_bytes=burst) as fab:
        for rate in rates:
            for i in range(opts.nodes):
                if rate != "none":
                    fab.set_rate(i, rate)
                elif fab.rates[i] is not None:
                    fab.set_rate(i, None)
            if opts.model:
                networks[rate] = probe_network(fab, opts, host)
            if opts.tune:
                tunes[rate] = tune_in_fabric(fab, opts)
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
                    if opts.tune:
                        rows[-1]["tune_plan"] = tunes[rate]
                    if opts.model:
                        rows[-1].update(predict_row(rows[-1], host, networks[rate]["params"], opts))
                    print_progress(rows[-1])
    print()
    print_table(rows)
    out = {
        "schema": SCHEMA,
        "bench": "bench_fabric",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join(sys.argv),
        "fabric": {"nodes": opts.nodes, "ranks_per_node": opts.ranks_per_node,
                   "link": "veth to a bridge, tbf both ways",
                   "tbf": {"nic": "burst max(3000 B, 100 us of the rate)",
                           "tbf": "burst max(64 KiB, 5 ms of the rate)"}.get(opts.burst, f"burst {opts.burst} B")
                   + ", latency 50 ms"},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "host_calibration": host.to_dict() if host is not None else None,
        "networks": {r: {k: v for k, v in d.items() if k != "params"} | {"params": d["params"].to_dict()}
                     for r, d in networks.items()},
        "tune": tunes,
        "rows": rows,
    }
    if opts.model:
        out["model_lines"] = model_lines(rows, host, networks, opts)
    if opts.json_out:
        from tree_attn.files import atomic_write_text

        Path(opts.json_out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(opts.json_out, json.dumps(out, indent=2) + "\n")
        print(f"wrote {opts.json_out}", file=sys.stderr)
    if opts.plot:
        plot_rates(out, opts.plot)
        print(f"wrote {opts.plot}", file=sys.stderr)
    return 0


def _job_json(fab: Fabric, args: list[str], opts) -> dict:
    results = fab.torchrun(args, ranks_per_node=opts.ranks_per_node, join_timeout_s=120).wait(timeout=opts.job_timeout)
    for r in results:
        if r.returncode != 0:
            tail = "\n".join(r.stderr.splitlines()[-15:])
            raise FabricError(f"{args[0]}: node {r.node} exited {r.returncode} (killed: {r.killed}):\n{tail}")
    reports = [r.stdout for r in results if r.stdout.strip()]
    if len(reports) != 1:
        raise FabricError(f"{args[0]}: expected one node to report, got {len(reports)}")
    return json.loads(reports[0])


def probe_network(fab: Fabric, opts, host) -> dict:
    """``probe --measure`` across the fabric's nodes; the network class the model takes from it."""
    from tree_attn.cost.fit import network_from_topology
    from tree_attn.topology.model import Topology

    print("  probe --measure across the nodes...", file=sys.stderr, flush=True)
    data = _job_json(fab, ["probe", "--measure", "--iterations", str(opts.probe_iterations), "--json"], opts)
    topo = Topology.from_dict(data)
    params = network_from_topology(topo, host_link=host.intra if host is not None else None)
    net = [lk for lk in topo.links if lk.kind.value == "net"]
    print(f"  network: {params.p2p_latency_us:.0f} us + bytes / {params.p2p_gbps * 8:.3f} Gbit/s; all-reduce step "
          f"{params.ar_step_us:.0f} us", file=sys.stderr, flush=True)
    return {"params": params, "hierarchy_source": data["hierarchy_source"],
            "hierarchy": data["hierarchy"], "allreduce_us": topo.measurement.allreduce_latency_us,
            "cross_pairs_gbit": sorted(round(lk.bandwidth_gbps * 8, 4) for lk in net),
            "cross_pairs_latency_us": sorted(round(lk.latency_us) for lk in net)}


def tune_in_fabric(fab: Fabric, opts) -> dict:
    """``tune --quick`` across the fabric: the plan it chose and every candidate's median."""
    print("  tune --quick across the nodes...", file=sys.stderr, flush=True)
    data = _job_json(fab, ["tune", "--device", "cpu", "--quick", "--batch", "1", "--heads", str(opts.heads),
                           "--head-dim", str(opts.head_dim), "--kv-heads", str(opts.kv_heads),
                           "-o", os.path.join(fab._tmp, f"tuned-{fab._jobs}.yaml"), "--json"], opts)
    red = data["profile"]["reduction"]
    cands = {c["label"]: round(c["median_us"], 1) for c in red["candidates"]}
    print(f"  tune chose {red['plan']['label']}: " + ", ".join(f"{k} {v:.0f} us" for k, v in cands.items()),
          file=sys.stderr, flush=True)
    return {"chosen": red["plan"]["label"], "parents": red["plan"].get("parents"), "candidates_median_us": cands}


def _plan_of(row: dict):
    from tree_attn.reduce.plan import ReductionPlan

    if row["strategy"] in ("tree", "flat"):
        parents = row.get("plan_parents")
        return ReductionPlan("tree", 2, parents=tuple(parents), label=row["plan"]) if parents else \
            ReductionPlan("tree", 2)
    return None


def _workload(opts, seq_len: int):
    from tree_attn.cost.step import Workload

    return Workload(seq_len, 1, opts.heads, opts.kv_heads, opts.head_dim, "float32")


def predict_row(row: dict, host, network, opts) -> dict:
    """The model's step for a measured row (the same plan, shape and fabric)."""
    from tree_attn.cost.fit import fabric_cluster
    from tree_attn.cost.step import predict_step

    cluster = fabric_cluster(host, network, opts.nodes, opts.ranks_per_node)
    strategy = "tree" if row["strategy"] == "flat" else row["strategy"]
    pred = predict_step(cluster, _workload(opts, row["seq_len"]), strategy, _plan_of(row))
    ms = pred.time_us / 1e3
    return {"model_step_ms": ms, "model_error": ms / row["step_ms_median"] - 1,
            "model": {"local_ms": pred.local_us / 1e3, "comm_ms": pred.comm_us / 1e3,
                      "overhead_ms": pred.overhead_us / 1e3, "bytes_per_rank": pred.bytes_per_rank,
                      "messages": pred.messages},
            "bytes_exact": pred.bytes_per_rank == row["bytes_sent_per_step_ranks"]}


def model_lines(rows: list[dict], host, networks: dict, opts) -> list[dict]:
    """The model's step against the link rate, per strategy and length, for the plot: the network
    measured at the calibrated rate nearest each rate, its bandwidth scaled to the rate (the
    fraction of the nominal rate it reached there kept), its latencies as measured."""
    import dataclasses

    from tree_attn.cost.fit import fabric_cluster
    from tree_attn.cost.step import predict_step

    cal = {parse_rate(r): d["params"] for r, d in networks.items() if r != "none"}
    if not cal:
        return []
    plans = {}
    for row in rows:
        if "skipped" not in row:
            plans.setdefault(row["strategy"], row)
    out = []
    for rate in [r.strip() for r in opts.model_rates.split(",") if r.strip()]:
        bps = parse_rate(rate)
        near = min(cal, key=lambda c: abs(math.log(c / bps)))
        base = cal[near]
        frac = base.p2p_gbps * 8e9 / near
        gbps = frac * bps / 8e9
        net = dataclasses.replace(base, p2p_gbps=gbps, ar_gbps=gbps, bulk_gbps=gbps,
                                  source=base.source + f"; bandwidth scaled from {near / 1e6:g} Mbit/s to {rate}")
        cluster = fabric_cluster(host, net, opts.nodes, opts.ranks_per_node)
        for n in sorted({r["seq_len"] for r in rows}):
            for strategy, row in plans.items():
                st = "tree" if strategy == "flat" else strategy
                pred = predict_step(cluster, _workload(opts, n), st, _plan_of(row))
                out.append({"rate": rate, "rate_bps": bps, "seq_len": n, "strategy": strategy,
                            "model_step_ms": pred.time_us / 1e3})
    return out


def plot_rates(out: dict, path: str) -> None:
    """Step time against link rate, per strategy: measured medians (markers) and the model
    (lines), one panel per length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in out["rows"] if "skipped" not in r and r["rate_bps"]]
    lengths = sorted({r["seq_len"] for r in out["rows"]})
    colours = {"tree": "tab:green", "flat": "tab:olive", "allreduce": "tab:blue", "ring": "tab:red"}
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4.6), squeeze=False)
    fab = out["fabric"]
    for ax, n in zip(axes[0], lengths):
        for strategy, colour in colours.items():
            pts = sorted((r["rate_bps"], r["step_ms_median"]) for r in rows if r["seq_len"] == n
                         and r["strategy"] == strategy)
            label = next((r["plan"] for r in rows if r["strategy"] == strategy), strategy)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o", color=colour, label=f"{label} (measured)")
            line = sorted((m["rate_bps"], m["model_step_ms"]) for m in out.get("model_lines", [])
                          if m["seq_len"] == n and m["strategy"] == strategy)
            if line:
                ax.plot([x for x, _ in line], [y for _, y in line], "-", color=colour, alpha=0.6,
                        label=f"{strategy} (model)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("inter-node link rate (bit/s, tbf)")
        ax.set_ylabel("decode step, median (ms)")
        ax.set_title(f"{fab['nodes']} nodes x {fab['ranks_per_node']} CPU ranks, {n:,} tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Decode step vs link rate; nodes are network namespaces of one {out['machine']['cores']}-core "
                 f"host\ntbf {fab['tbf']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    model = f", model {row['model_step_ms']:.2f} ms" if row.get("model_step_ms") is not None else ""
    print(f"[{row['rate']} {row['seq_len']} {row['strategy']}] median {row['step_ms_median']:.2f} ms, "
          f"p95 {row['step_ms_p95']:.2f} ms{model}, counted {c['counted_bytes_per_step']} B/step, wire "
          f"{_fmt_b(c['wire_tx_bytes_per_step'])}/step", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
