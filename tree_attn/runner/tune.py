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
from ..ranks.launch import RankEnv


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
    """Time the Triton kernel for each ranked config on one device; median of ``iterations``.

    On a GPU: CUDA events around each launch, and several KV buffers rotated when they fit so the
    L2 cache does not serve repeated reads of one buffer (a 128K-token bf16 shard is 512 MiB, far
    above any L2; small shards are not). On CPU (Triton's interpreter, for tests) a host clock.
    """
    from ..kernels.perf_model import kv_bytes
    from ..kernels.triton_launch import decode_attention_triton

    dev = torch.device(device)
    nbytes = kv_bytes(shape, dtype)
    copies = 1
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        copies = max(1, min(4, int(0.4 * free // max(1, nbytes))))
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=dev, dtype=dtype)
    kv_shape = (shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim)
    kvs = [(torch.randn(kv_shape, device=dev, dtype=dtype), torch.randn(kv_shape, device=dev, dtype=dtype)) for _ in range(copies)]

    def timed(cfg, k, v) -> float:
        if dev.type != "cuda":
            t0 = time.perf_counter()
            decode_attention_triton(q, k, v, config=cfg)
            return (time.perf_counter() - t0) * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decode_attention_triton(q, k, v, config=cfg)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    out = []
    for ranked in configs_ranked:
        cfg = ranked.config
        for i in range(warmup):
            decode_attention_triton(q, *kvs[i % copies], config=cfg)
        med = statistics.median(timed(cfg, *kvs[i % copies]) for i in range(iterations))
        out.append(KernelTiming(config=cfg, predicted_us=ranked.predicted_us, median_us=med, gbps=nbytes / med / 1e3))
    del kvs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


@dataclass(frozen=True)
class TuneOptions:
    """What ``tune`` searches. Shapes default to Llama-3.1-8B attention."""

    world_size: int
    device_kind: str  # "cpu" | "cuda"
    backend: str
    batch: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    quick: bool = False
    timeout_s: float = 120.0
    buckets: tuple[int, ...] | None = None  # override of the shard buckets (tests: tiny shapes)

    @property
    def plan_iterations(self) -> tuple[int, int]:
        """(timed, warm-up) iterations per candidate plan."""
        return (20, 3) if self.quick else (200, 20)

    @property
    def shard_buckets(self) -> list[int]:
        """Shard lengths (tokens per rank) whose kernel configs are tuned, upper bounds of buckets."""
        if self.buckets is not None:
            return list(self.buckets)
        return [16384, 65536] if self.quick else [4096, 16384, 65536, 262144, 1048576]

    @property
    def kernel_survivors(self) -> int:
        """Configs timed per bucket after the napkin model's pruning."""
        return 3 if self.quick else 8


@dataclass(frozen=True)
class BucketResult:
    """Kernel tuning of one shape bucket: the timed candidates (model's order) and the winner."""

    dtype: str
    head_dim: int
    group: int
    max_shard_len: int
    timings: list[KernelTiming]
    chosen: KernelTiming


def tune_plans(options: TuneOptions, candidates: list[ReductionPlan]) -> PlanTuneResult:
    """Time every candidate plan on ``options.world_size`` spawned ranks; rank 0's choice wins."""
    from ..ranks.launch import launch_ranks

    iters, warm = options.plan_iterations
    results = launch_ranks(
        time_plans_rank,
        options.world_size,
        args=(candidates, options.batch, options.q_heads, options.head_dim, iters, warm),
        backend=options.backend,
        device_kind=options.device_kind,
        timeout_s=options.timeout_s,
    )
    if len({r.chosen for r in results}) != 1:
        from ..errors import DistributedError

        raise DistributedError("ranks ended the plan search with different plans; rank 0's broadcast did not arrive")
    return results[0]


def tune_kernels(options: TuneOptions, progress=None, device: str | None = None) -> list[BucketResult]:
    """For each shard bucket, rank the config space with the napkin model, keep the best few,
    time them on one device, keep the fastest.

    ``device``: default GPU 0 on GPU ranks; CPU ranks use the torch path, so nothing is tuned
    there unless ``device="cpu"`` is asked for explicitly (Triton's interpreter, in tests).
    """
    if device is None:
        if options.device_kind != "cuda":
            return []
        device = "cuda:0"
    from ..kernels.perf_model import CPU_INTERPRETER, DeviceSpec, candidate_configs, rank_candidates
    from ..kernels.shapes import DecodeShape
    from ..dtypes import torch_dtype

    dtype = torch_dtype(options.dtype)
    spec = DeviceSpec.from_torch_device(device) if device.startswith("cuda") else CPU_INTERPRETER
    out = []
    iters, warm = (10, 3) if options.quick else (50, 10)
    for n in options.shard_buckets:
        shape = DecodeShape(options.batch, options.q_heads, options.kv_heads, options.head_dim, n)
        need = 2 * n * options.batch * options.kv_heads * options.head_dim * dtype.itemsize
        if device.startswith("cuda") and need > 0.5 * torch.cuda.mem_get_info(torch.device(device))[0]:
            if progress:
                progress(f"kernel bucket {n} tokens: skipped (KV of {need / 2**30:.1f} GiB does not fit comfortably)")
            continue
        ranked = rank_candidates(candidate_configs(shape, dtype, spec), shape, dtype, spec, top_k=options.kernel_survivors)
        timings = time_kernel_configs(shape, dtype, ranked, device, iters, warm)
        best = min(timings, key=lambda t: t.median_us)
        if progress:
            progress(f"kernel bucket {n} tokens: best {best.config.describe()} {best.median_us:.1f} us, {best.gbps:.0f} GB/s")
        out.append(BucketResult(options.dtype, options.head_dim, options.q_heads // options.kv_heads, n, timings, best))
    return out
