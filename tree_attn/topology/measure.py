"""Measured link numbers (``tree-attn probe --measure``).

- GPUs: per-pair copy bandwidth and small-message latency with ``dst.copy_(src)`` between
  devices, timed with CUDA events (median of the iterations, after warm-up), both directions
  (the slower one is kept: a collective waits for it); then the all-reduce latency at the decode
  message size over NCCL/RCCL ranks.
- CPU ranks: the same through gloo: ping-pong send/recv per pair (half the round trip), then the
  all-reduce.

Under torchrun (``join_torchrun``; a job over several nodes): every pair of the job's ranks is
measured through the job's own process group (gloo or NCCL send/recv), both on one node and
across nodes, each pair in turn while the others wait at a barrier; the result comes back on rank
0 (None on the others).

The decode message: one rank's partial state for batch 1 is 32 heads x (128 output values + 1
log-sum-exp) float32 = 32 x 129 x 4 B = 16,512 B. torch is imported inside the functions.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ..errors import TopologyError
from .model import Measurement, Topology

DECODE_MESSAGE_BYTES = 32 * 129 * 4
GPU_COPY_BYTES = 64 * 1024 * 1024  # large enough to reach link bandwidth on NVLink
CPU_COPY_BYTES = 4 * 1024 * 1024
# Across nodes: 1 MiB, about 84 ms at 100 Mbit/s one way, and still mostly the link's rate at
# 10 Gbit/s (0.8 ms, against milliseconds of jitter for small messages on a busy host).
NET_COPY_BYTES = 1024 * 1024
LATENCY_BYTES = 8
WARMUP = 3
# Timed iterations per measurement, after the warm-up (the median is kept): the default of
# measure_topology, of probe and check --iterations and of the cost-model calibration.
MEASURE_ITERATIONS = 20


def measure_topology(
    topo: Topology,
    *,
    iterations: int = MEASURE_ITERATIONS,
    copy_bytes: int | None = None,
    latency_bytes: int = LATENCY_BYTES,
    allreduce_bytes: int = DECODE_MESSAGE_BYTES,
    timeout_s: float = 120.0,
    join_torchrun: bool = False,
) -> Topology | None:
    """A copy of ``topo`` with measured bandwidth (``bandwidth_source="measured"``) and latency on
    every link, and a :class:`Measurement` record of how. GPU topologies need as many visible GPUs
    as the topology has; CPU-rank topologies spawn that many gloo ranks. With ``join_torchrun``
    this process is one rank of a torchrun job of ``len(topo)`` ranks: every pair is measured over
    the job's group, and only rank 0 gets the topology (the others None)."""
    if iterations < 1:
        raise TopologyError(f"iterations: expected >= 1, got {iterations}")
    gpu = any(d.vendor in ("nvidia", "amd") for d in topo.devices)
    n = len(topo)
    pairs = [(l.a, l.b) for l in topo.links]
    if join_torchrun:
        copy_bytes = copy_bytes or NET_COPY_BYTES
        device_kind = "cuda" if gpu else "cpu"
        res = _launch(n, pairs, iterations, copy_bytes, latency_bytes, allreduce_bytes, "auto", device_kind,
                      timeout_s, join_torchrun=True)
        if res is None:
            return None
        per_pair, ar = res["pairs"], res
        method = f"{res['backend']}-sendrecv+{res['backend']}-allreduce across the torchrun job"
        device = res["device"]
    elif gpu:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < n:
            raise TopologyError(
                f"cannot measure a {n}-GPU topology: torch sees {have} GPU(s) here "
                "(measure on the machine itself, with all GPUs visible)"
            )
        copy_bytes = copy_bytes or GPU_COPY_BYTES
        per_pair = {p: _cuda_pair(torch, p[0], p[1], copy_bytes, latency_bytes, iterations) for p in pairs}
        # One GPU has no pair and nothing to all-reduce with: no all-reduce latency is reported.
        ar = _launch(n, [], iterations, copy_bytes, latency_bytes, allreduce_bytes, "nccl", "cuda",
                     timeout_s) if n > 1 else {}
        method, device = "cuda-copy+nccl-allreduce", torch.cuda.get_device_name(0)
    else:
        copy_bytes = copy_bytes or CPU_COPY_BYTES
        res = _launch(n, pairs, iterations, copy_bytes, latency_bytes, allreduce_bytes, "gloo", "cpu", timeout_s)
        per_pair, ar = res["pairs"], res
        method, device = "gloo-sendrecv+gloo-allreduce", "cpu"
    links = []
    for l in topo.links:
        bw, lat = per_pair[(l.a, l.b)]
        links.append(_replace_link(l, bandwidth_gbps=bw, bandwidth_source="measured", latency_us=lat))
    meas = Measurement(method=method, iterations=iterations, copy_bytes=copy_bytes, latency_bytes=latency_bytes,
                       allreduce_bytes=allreduce_bytes, allreduce_latency_us=ar.get("allreduce_us"), device=device)
    return topo.replace(links=links, measurement=meas)


def _replace_link(l, **kw):
    import dataclasses

    return dataclasses.replace(l, **kw)


def _cuda_pair(torch: Any, a: int, b: int, nbytes: int, small: int, iters: int) -> tuple[float, float]:
    """(GB/s, us) for copies a->b and b->a; the slower direction is kept."""
    bws, lats = [], []
    for src, dst in ((a, b), (b, a)):
        x = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}")
        y = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
        xs = torch.empty(max(1, small), dtype=torch.uint8, device=f"cuda:{src}")
        ys = torch.empty(max(1, small), dtype=torch.uint8, device=f"cuda:{dst}")
        t_big = _cuda_time(torch, src, lambda x=x, y=y: y.copy_(x, non_blocking=True), iters)
        t_small = _cuda_time(torch, src, lambda x=xs, y=ys: y.copy_(x, non_blocking=True), iters)
        bws.append(nbytes / t_big / 1e9)
        lats.append(t_small * 1e6)
    return min(bws), max(lats)


def _cuda_time(torch: Any, dev: int, op, iters: int) -> float:
    """Median seconds of ``op`` timed with CUDA events on the source device's stream."""
    with torch.cuda.device(dev):
        for _ in range(WARMUP):
            op()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _launch(n, pairs, iterations, copy_bytes, latency_bytes, allreduce_bytes, backend, device_kind, timeout_s,
            join_torchrun=False):
    from ..launch.job import run_ranks
    from ..launch.setup import LaunchRequest, resolve_launch

    launch = resolve_launch(LaunchRequest(device=device_kind, world_size=None if join_torchrun else n,
                                          backend=backend, timeout_s=timeout_s, join_torchrun=join_torchrun,
                                          activity="measuring"))
    if launch.world_size != n:
        raise TopologyError(f"the torchrun job has {launch.world_size} ranks, the topology {n} devices")
    job = run_ranks(_rank_measure, launch, args=(pairs, iterations, copy_bytes, latency_bytes, allreduce_bytes,
                                                 join_torchrun))
    if job is None:  # a torchrun rank other than 0
        return None
    results = job.values
    merged: dict[str, Any] = {"pairs": {}, "backend": launch.backend, "device": job.device}
    for r in results:
        merged["pairs"].update(r["pairs"])
    merged["allreduce_us"] = results[0]["allreduce_us"]
    return merged


def _rank_measure(env, pairs, iterations, copy_bytes, latency_bytes, allreduce_bytes,
                  barrier_started=False) -> dict[str, Any]:
    """Runs in each rank: ping-pong per pair (the other ranks wait at a barrier), then all-reduce:
    back to back, or (``barrier_started``, across a torchrun job's nodes) each one right after a
    barrier, as a decode step's all-reduce starts (back to back, consecutive all-reduces overlap
    their steps across the ranks and each looks cheaper than one a step runs)."""
    import torch
    import torch.distributed as dist

    from ..launch.group import barrier

    dev = torch.device(env.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    big = torch.zeros(max(1, copy_bytes // 4), dtype=torch.float32, device=dev)
    small = torch.zeros(max(1, latency_bytes // 4), dtype=torch.float32, device=dev)
    out: dict[str, Any] = {"pairs": {}}
    for a, b in pairs:
        barrier(env)
        if env.rank not in (a, b):
            continue
        peer = b if env.rank == a else a
        times: dict[int, list[float]] = {0: [], 1: []}
        for it in range(WARMUP + iterations):
            for k, buf in enumerate((big, small)):
                sync()
                t0 = time.perf_counter()
                if env.rank == a:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                sync()
                if it >= WARMUP:
                    times[k].append((time.perf_counter() - t0) / 2)  # one way = half the round trip
        if env.rank == a:
            out["pairs"][(a, b)] = (big.numel() * 4 / statistics.median(times[0]) / 1e9,
                                    statistics.median(times[1]) * 1e6)
    barrier(env)
    msg = torch.ones(max(1, allreduce_bytes // 4), dtype=torch.float32, device=dev)
    ts = []
    for it in range(WARMUP + iterations):
        if barrier_started:
            barrier(env)
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(msg)
        sync()
        if it >= WARMUP:
            ts.append(time.perf_counter() - t0)
    # Every rank waits for the slowest: report the max of the ranks' medians.
    med = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    out["allreduce_us"] = float(med.item()) * 1e6
    return out
