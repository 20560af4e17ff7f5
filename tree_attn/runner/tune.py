"""Measurements behind ``tree-attn tune``: time every candidate reduction plan across the ranks,
and (on GPUs) the surviving kernel configs of each shape bucket.

Plans are timed at the decode message size (one ``[B, Hq, D+1]`` float32 state per rank), each
iteration started together (barrier) and lasting as long as its slowest rank. Rank 0 decides and
broadcasts its choice, so every rank runs the same plan even if timings were noisy.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..reduce.plan import ReductionPlan
from .decode_run import percentile
from .launch import RankEnv


@dataclass(frozen=True)
class PlanTiming:
    """Measured latency of one plan's merge (both directions), microseconds, slowest rank."""

    plan: ReductionPlan
    median_us: float
    p95_us: float
    iterations: int


@dataclass(frozen=True)
class PlanTuneResult:
    timings: list[PlanTiming]
    chosen: ReductionPlan


def time_plans_rank(
    env: RankEnv,
    candidates: list[ReductionPlan],
    batch: int,
    q_heads: int,
    head_dim: int,
    iterations: int,
    warmup: int,
) -> PlanTuneResult:
    """Run inside every rank: time each candidate's merge; every rank returns rank 0's decision."""
    import torch.distributed as dist

    from ..reduce.collectives import merge_allreduce, merge_tree

    device = torch.device(env.device)
    g = torch.Generator().manual_seed(1234 + env.rank)
    o = torch.randn(batch, q_heads, head_dim, generator=g).to(device)
    lse = torch.randn(batch, q_heads, generator=g).to(device)
    timings = []
    for plan in candidates:
        tree = plan.tree(env.world_size) if plan.strategy == "tree" else None

        def merge() -> None:
            if tree is None:
                merge_allreduce(o, lse, None)
            else:
                merge_tree(o, lse, tree, None)

        for _ in range(warmup):
            merge()
        mine = []
        for _ in range(iterations):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            merge()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            mine.append(time.perf_counter() - t0)
        # Each iteration lasts as long as its slowest rank: gather everyone's times.
        local = torch.tensor(mine, dtype=torch.float64, device=device if env.backend == "nccl" else "cpu")
        every = [torch.empty_like(local) for _ in range(env.world_size)]
        dist.all_gather(every, local)
        slowest = torch.stack(every).amax(dim=0).cpu().tolist()
        timings.append(
            PlanTiming(
                plan=plan,
                median_us=1e6 * statistics.median(slowest),
                p95_us=1e6 * percentile(slowest, 0.95),
                iterations=iterations,
            )
        )
    # Rank 0 decides; the broadcast makes the choice identical everywhere by construction.
    choice = [min(range(len(timings)), key=lambda i: timings[i].median_us) if env.rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return PlanTuneResult(timings=timings, chosen=candidates[choice[0]])


@dataclass(frozen=True)
class KernelTiming:
    config: object  # DecodeConfig
    predicted_us: float
    median_us: float | None
    gbps: float | None


def time_kernel_configs(shape, dtype: torch.dtype, configs_ranked, device: str, iterations: int, warmup: int) -> list[KernelTiming]:
    """Time the Triton kernel for each ranked config on one GPU (CUDA events, median).

    Several KV buffers are rotated when they fit, so the L2 cache does not serve repeated reads
    of one buffer (a 128K-token shard is 512 MiB in bf16, far above any L2; small shards are not).
    """
    from ..kernels.perf_model import kv_bytes
    from ..kernels.triton_launch import decode_attention_triton

    dev = torch.device(device)
    nbytes = kv_bytes(shape, dtype)
    free, _ = torch.cuda.mem_get_info(dev)
    copies = max(1, min(4, int(0.4 * free // max(1, nbytes))))
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=dev, dtype=dtype)
    kvs = [
        (
            torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim, device=dev, dtype=dtype),
            torch.randn(shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim, device=dev, dtype=dtype),
        )
        for _ in range(copies)
    ]
    out = []
    for ranked in configs_ranked:
        cfg = ranked.config
        for i in range(warmup):
            k, v = kvs[i % copies]
            decode_attention_triton(q, k, v, config=cfg)
        times = []
        for i in range(iterations):
            k, v = kvs[i % copies]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            decode_attention_triton(q, k, v, config=cfg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        med = statistics.median(times)
        out.append(KernelTiming(config=cfg, predicted_us=ranked.predicted_us, median_us=med, gbps=nbytes / med / 1e3))
    del kvs
    torch.cuda.empty_cache()
    return out
