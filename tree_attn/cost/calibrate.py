"""Calibrate the cost model's parameters on this machine by micro-measurements, never by timing
the decode runs the model is checked against. torch is imported inside the functions.

What is measured, and what it sets:

- the link: ``probe --measure`` over 2 ranks (``topology.measure``): point-to-point alpha (half a
  ping-pong of 8 bytes), beta (4 MiB on CPU ranks, 64 MiB on GPUs), and the all-reduce of the
  decode message, which gives the all-reduce's per-step alpha. On CPU ranks the ping-pongs and
  the all-reduce are timed again, each started right after a barrier as a step's messages are
  (back to back, gloo's small messages on loopback wait a bimodal ~0.6-3.6 ms wake-up);
- the local attention: ``decode_attention`` over the Llama-3.1-8B shape at two shard lengths,
  timed on as many ranks at once as the device is shared by in a run (on CPU ranks: one per
  core, so the cores' shared memory bandwidth is in the number); a line through the two points
  gives the fixed cost and the achieved bandwidth;
- the ring's KV exchange (CPU ranks): one round's exchange at two block sizes (a line), and the
  part of it its rank spends on a core (process CPU time);
- the merge: ``merge_states`` of three packed states (a binary-tree node);
- the step overhead (CPU ranks): the barrier that starts every timed step of ``tree-attn run``,
  priced as the barrier-started all-reduce above (a gloo barrier is a small all-reduce).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from ..dtypes import itemsize
from ..topology.measure import MEASURE_ITERATIONS
from .links import LinkParams
from .params import ClusterSpec, DeviceParams
from .step import decode_message_bytes

# The calibration shape: Llama-3.1-8B attention (32 query heads, 8 KV heads, D 128), batch 1.
SHAPE = dict(batch=1, q_heads=32, kv_heads=8, head_dim=128)
# Two shard lengths for the line, spanning the shards a run of 16K-256K tokens over 2-8 ranks
# gives (64 MiB and 512 MiB of fp32 K and V: far beyond the caches); a few seconds in all.
SHORT_TOKENS, LONG_TOKENS = 8192, 65536
REPEATS = 9


def _time_local(env, tokens: tuple[int, ...], dtype_name: str, repeats: int) -> dict[str, Any]:
    """In each rank: median seconds of decode_attention at each shard length, a merge, a barrier."""
    import torch
    import torch.distributed as dist

    from ..dtypes import torch_dtype
    from ..reduce.collectives import TreeDecodeStep
    from ..reduce.state import merge_states

    dev = torch.device(env.device)
    dt = torch_dtype(dtype_name)
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    g = torch.Generator().manual_seed(1234 + env.rank)
    b, hq, hkv, d = SHAPE["batch"], SHAPE["q_heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    q = torch.randn(b, hq, d, generator=g).to(dt).to(dev)
    out: dict[str, Any] = {"local": {}}
    # The local part of a run's tree step: a TreeDecodeStep over a group of this rank alone (its
    # prepared kernel writing the packed state; on GPUs replayed as a CUDA graph, as `run` does).
    alone = [dist.new_group([r]) for r in range(env.world_size)][env.rank] if env.world_size > 1 else None
    for n in tokens:
        k = torch.randn(b, n, hkv, d, generator=g).to(dt).to(dev)
        v = torch.randn(b, n, hkv, d, generator=g).to(dt).to(dev)
        step = TreeDecodeStep(q, k, v, group=alone, cuda_graph=cuda)
        # after a barrier: the ranks stream at once, as in a run
        out["local"][n] = _median_seconds(step, sync, warmup=2, samples=repeats, env=env)
        step.close()  # free its graph before the next one (and before the group's teardown)
        del k, v, step
    out["bulk"] = _ring_exchange(env, sync, dev, dt, repeats) if env.world_size > 1 else None
    states = torch.randn(3, b, hq, d, generator=g).to(dev)
    lses = torch.randn(3, b, hq, generator=g).to(dev)
    out["merge"] = _median_seconds(lambda: merge_states(states, lses), sync, warmup=3, samples=5 * repeats)
    out["p2p"] = _ping_pong(env, sync, dev, repeats) if env.world_size > 1 else {}
    out["allreduce"] = _allreduce_after_barrier(env, sync, dev, repeats) if env.world_size > 1 else None
    return out


# The decode message all-reduced: a packed state of the calibration shape, float32 [B, Hq, D + 1].
ALLREDUCE_BYTES = decode_message_bytes(SHAPE["batch"], SHAPE["q_heads"], SHAPE["head_dim"])


def _allreduce_after_barrier(env, sync, dev, repeats: int) -> float:
    """Median seconds of an all-reduce of the decode message, each started right after a barrier
    as a step's collectives start after its local attention. (Back to back, as ``probe --measure``
    times them, gloo's small all-reduces on loopback land on a bimodal ~0.6-3.6 ms: a wake-up
    that a step's all-reduce does not see in the same way.)"""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(ALLREDUCE_BYTES // 4, dtype=torch.float32, device=dev)
    return _median_seconds(lambda: dist.all_reduce(buf), sync, warmup=3, samples=3 * repeats, env=env)


def _median_seconds(op, sync, *, warmup: int, samples: int, env=None) -> float:
    """Median seconds of ``op()`` over ``samples`` timed runs after ``warmup`` untimed ones, the
    device drained (``sync``) before and after each; with ``env``, each run starts right after a
    barrier of its ranks."""
    from ..launch.group import barrier

    ts = []
    for it in range(warmup + samples):
        if env is not None:
            barrier(env)
        sync()
        t0 = time.perf_counter()
        op()
        sync()
        if it >= warmup:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# The ring's KV-block exchange measured at two block lengths (K and V of 2,048 and 16,384 tokens
# each way: 8 and 64 MiB per tensor in fp32), for a line: a fixed cost and a bandwidth.
BULK_TOKENS = (2048, 16384)


def _ring_exchange(env, sync, dev, dt, repeats: int) -> dict[int, tuple[float, float]]:
    """``{bytes: (seconds, cpu seconds)}`` of one ring round's exchange as ``reduce.ring`` does it,
    at each of :data:`BULK_TOKENS`: every rank sends its K and V block to its successor and receives
    its predecessor's into buffers allocated for the round (on CPU ranks the fresh pages are faulted
    in by the receive, which costs about as much as the copy itself), all ranks at once. The cpu
    seconds are this process's (``time.process_time``, gloo's threads included): the part of the
    exchange that needs a core."""
    import torch
    import torch.distributed as dist

    from ..launch.group import barrier

    p = env.world_size
    succ, pred = (env.rank + 1) % p, (env.rank - 1) % p
    out = {}
    for tokens in BULK_TOKENS:
        shape = (SHAPE["batch"], tokens, SHAPE["kv_heads"], SHAPE["head_dim"])
        k, v = torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)
        ts, cpu = [], []
        for it in range(2 + repeats):
            barrier(env)
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            nk, nv = torch.empty_like(k), torch.empty_like(v)
            ops = [dist.P2POp(dist.isend, k, succ), dist.P2POp(dist.isend, v, succ),
                   dist.P2POp(dist.irecv, nk, pred), dist.P2POp(dist.irecv, nv, pred)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()
            sync()
            if it >= 2:
                ts.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            del nk, nv
        out[2 * k.numel() * k.element_size()] = (statistics.median(ts), statistics.median(cpu))
        del k, v
    return out


def _ping_pong(env, sync, dev, repeats: int) -> dict[int, float]:
    """Ranks 0 and 1: one-way seconds (half a ping-pong) of an 8-byte and a 4 MiB message, each
    started right after a barrier, as a decode step's messages are. (``probe --measure`` times
    ping-pongs back to back; on gloo over loopback those medians are ~2 ms for 8 bytes, a
    bimodal wait whose minimum is ~40 us, while a barrier-started one takes ~0.1 ms.)"""
    import torch
    import torch.distributed as dist

    def ping_pong(buf):
        if env.rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif env.rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    out = {}
    for nbytes in (8, 4 * 2**20):
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
        out[nbytes] = _median_seconds(lambda buf=buf: ping_pong(buf), sync, warmup=3, samples=3 * repeats, env=env) / 2
    return out


def line_through(points: dict[int, float], bytes_per_token: int) -> tuple[float, float]:
    """(fixed us, GB/s) of the line through the two (bytes, seconds) points."""
    (n1, t1), (n2, t2) = sorted(points.items())
    b1, b2 = n1 * bytes_per_token, n2 * bytes_per_token
    slope = (t2 - t1) / (b2 - b1)  # seconds per byte
    if slope <= 0:  # noise swamped the difference: take the long point's average rate
        return 0.0, b2 / t2 / 1e9
    fixed = max(0.0, t1 - slope * b1)
    return fixed * 1e6, 1.0 / slope / 1e9


def calibrate_cpu(*, ranks: int | None = None, dtype: str = "float32", repeats: int = REPEATS,
                  iterations: int = MEASURE_ITERATIONS) -> ClusterSpec:
    """Parameters of CPU ranks on this host (one node), from micro-measurements (module doc).

    ``ranks`` is how many measure the local attention at once (default: one per usable core).
    The returned cluster has one rank per core; ``with_shape`` gives other rank counts, and the
    model then slows each rank's compute by ranks / cores (``DeviceParams.shared_cores``).
    """
    from ..launch.env import usable_cores
    from ..launch.spawn import launch_ranks
    from ..topology.host import host_topology
    from ..topology.measure import measure_topology

    cores = usable_cores()
    n = ranks or cores
    topo = measure_topology(host_topology(2), iterations=iterations)
    link = topo.links[0]
    meas = topo.measurement
    res = launch_ranks(_time_local, n, args=((SHORT_TOKENS, LONG_TOKENS), dtype, repeats), backend="gloo",
                       device_kind="cpu")
    per_token = 2 * SHAPE["kv_heads"] * SHAPE["head_dim"] * itemsize(dtype)
    local = {tok: max(r["local"][tok] for r in res) for tok in (SHORT_TOKENS, LONG_TOKENS)}
    fixed_us, gbps = line_through(local, per_token)
    merge_us = max(r["merge"] for r in res) * 1e6
    # A run's step starts at a barrier, and a gloo barrier is a small all-reduce: its latency is
    # the step overhead (the ranks leave it at different times). Measured as a step sees it, right
    # after a barrier (see _allreduce_after_barrier); probe --measure's back-to-back figure where
    # there is one rank only.
    ar_s = max(r["allreduce"] for r in res) if n > 1 else None
    ar_us = ar_s * 1e6 if ar_s is not None else meas.allreduce_latency_us
    barrier_us = ar_us
    # One all-reduce of the decode message over n ranks is 2 (n - 1) steps (reduce-scatter + gather).
    ar_step = ar_us / (2 * (n - 1)) if n > 1 else meas.allreduce_latency_us / 2
    pp = res[0]["p2p"] if n > 1 else {}
    if pp:  # barrier-started ping-pongs (see _ping_pong): alpha from 8 B, beta from 4 MiB
        alpha_us = pp[8] * 1e6
        beta = 4 * 2**20 / max(1e-9, pp[4 * 2**20] - pp[8]) / 1e9
        how = f"barrier-started ping-pong and all-reduce over {n} CPU ranks (gloo, loopback)"
    else:
        alpha_us, beta = link.latency_us, link.bandwidth_gbps
        how = f"probe --measure over 2 CPU ranks (gloo, loopback), {iterations} iterations"
    bulk = bulk_fixed_us = bulk_cpu = None
    if n > 1:  # the slowest rank's exchange at each length, a line through the two
        sizes = sorted(res[0]["bulk"])
        wall = {nb: max(r["bulk"][nb][0] for r in res) for nb in sizes}
        bulk_fixed_us, bulk = line_through(wall, 1)
        # The part of the long exchange spent on a core, over the ranks (clamped to (0, 1]).
        long = sizes[-1]
        bulk_cpu = min(1.0, max(0.01, sum(r["bulk"][long][1] for r in res) / sum(r["bulk"][long][0] for r in res)))
    lp = LinkParams("host_loopback", p2p_latency_us=alpha_us, p2p_gbps=beta, ar_step_us=ar_step, ar_gbps=beta,
                    bulk_gbps=bulk, bulk_latency_us=bulk_fixed_us, bulk_cpu_fraction=bulk_cpu,
                    source=f"measured: {how}; bulk = a ring round's KV exchange on {n} ranks at two block sizes")
    dev = DeviceParams(
        "cpu rank", mem_gbps=gbps, kernel_fraction=1.0, kernel_fixed_us=fixed_us, merge_us=merge_us,
        collective_us=0.0, shared_cores=cores, overlap=False,
        source=(f"measured: decode_attention at {SHORT_TOKENS} and {LONG_TOKENS} tokens ({dtype}, Llama-3.1-8B shape) "
                f"on {n} ranks at once, {repeats} repeats; merge_states of 3 states"),
    )
    return ClusterSpec(
        "cpu ranks (calibrated)", dev, ranks_per_node=cores, nodes=1, intra=lp, network=None,
        step_overhead_us=barrier_us,
        notes=((f"calibrated on {cores} cores: local line {fixed_us:.0f} us + bytes / {gbps:.2f} GB/s, "
                f"merge {merge_us:.0f} us, barrier {barrier_us:.0f} us, p2p {alpha_us:.0f} us + bytes / "
                f"{beta:.2f} GB/s, ring exchange {bulk_fixed_us or 0:.0f} us + bytes / {bulk or 0:.2f} GB/s "
                f"({100 * (bulk_cpu or 0):.0f}% of it on a core), all-reduce of {ALLREDUCE_BYTES} B {ar_us:.0f} us "
                f"(back to back, probe --measure: {meas.allreduce_latency_us:.0f} us)"),),
    )


def calibrate_gpu(*, dtype: str = "bfloat16", repeats: int = REPEATS, iterations: int = MEASURE_ITERATIONS,
                  long_tokens: int = 262144) -> ClusterSpec:
    """Parameters of this GPU node: its probed topology with ``probe --measure`` numbers, the
    local kernel's fixed cost and achieved bandwidth on GPU 0 (two shard lengths; the fraction of
    the datasheet bandwidth), the merge, and the measured all-reduce. Needs the GPUs visible."""
    import torch

    from ..launch.spawn import launch_ranks
    from ..topology.measure import measure_topology
    from ..topology.probe import probe_topology
    from .fit import device_for

    if not torch.cuda.is_available():
        from ..errors import ConfigError

        raise ConfigError("calibrate_gpu needs a GPU visible to torch; on CPU ranks use calibrate_cpu")
    topo = probe_topology("auto")
    if len(topo) > 1:
        topo = measure_topology(topo, iterations=iterations)
    base = device_for(topo.devices[0].name) or device_for(torch.cuda.get_device_name(0))
    tokens = (long_tokens // 8, long_tokens)
    res = launch_ranks(_time_local, 1, args=(tokens, dtype, repeats), backend="nccl", device_kind="cuda")[0]
    per_token = 2 * SHAPE["kv_heads"] * SHAPE["head_dim"] * itemsize(dtype)
    fixed_us, gbps = line_through(res["local"], per_token)
    mem = base.mem_gbps if base is not None else gbps
    dev = DeviceParams(
        torch.cuda.get_device_name(0), mem_gbps=mem, kernel_fraction=min(1.0, gbps / mem), kernel_fixed_us=fixed_us,
        merge_us=res["merge"] * 1e6, collective_us=base.collective_us if base is not None else 5.0,
        memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        source=(f"measured on GPU 0: the local step at {tokens[0]} and {tokens[1]} tokens ({dtype}), a CUDA graph "
                f"replay timed by the host clock to its end (launch included); memory bandwidth "
                f"{'datasheet' if base is not None else 'measured'}"),
    )
    return gpu_cluster(topo, dev, fixed_us=fixed_us, gbps=gbps)


def gpu_cluster(topo, dev: DeviceParams, *, fixed_us: float, gbps: float) -> ClusterSpec:
    """The cluster a GPU calibration describes: ``dev`` (the measured single-GPU terms) on the
    probed node ``topo``. What one node cannot measure comes from the built-in cluster of this
    kind of GPU (:func:`presets.preset_for_device`): the network between nodes always, and on a
    one-GPU machine the node's links too. The measured fixed cost already holds a graph launch, so
    no step overhead is added on top."""
    from .fit import cluster_from_topology
    from .presets import preset, preset_for_device

    like = preset(preset_for_device(dev.name))
    measured = f"kernel {gbps:.0f} GB/s, fixed {fixed_us:.1f} us (measured)"
    if len(topo) == 1:
        return dataclasses.replace(
            like, name=f"{dev.name} (calibrated on one GPU; {like.name} links)", device=dev, step_overhead_us=0.0,
            notes=like.notes + (measured, (f"one GPU here: no link was measured; the node's links and the "
                                           f"network are the {like.name} preset's")),
        )
    cluster = cluster_from_topology(topo, device=dev, network=like.network,
                                    name=f"{len(topo)}x {dev.name} (calibrated)")
    return dataclasses.replace(cluster, step_overhead_us=0.0, notes=cluster.notes + (
        measured, f"the network between nodes is the {like.name} preset's (not measured)"))
