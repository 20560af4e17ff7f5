"""Measurements behind ``tree-attn tune``: time every candidate reduction plan across the ranks,
and (on GPUs) the surviving kernel configs of each shape bucket.

Plans are timed at the decode message size (one ``[B, Hq, D+1]`` float32 state per rank), in
batches of back-to-back iterations between barriers (see :func:`time_plans_rank` for why), each
batch lasting as long as its slowest rank. Rank 0 decides and broadcasts its choice, so every rank
runs the same plan even if timings were noisy.

Kernel configs are timed on GPU 0 by a child process (:func:`tune_kernels_in_child`), never by
the launching process, which thus makes no CUDA context on the GPU rank 0 uses.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch

from ...launch.env import DEFAULT_TIMEOUT_S, RankEnv
from ...launch.job import percentile
from ...launch.setup import LaunchSetup, OnLaunch
from ...reduce.plan import ReductionPlan
from ..defaults import BATCH, HEAD_DIM, HEADS, KV_HEADS


@dataclass(frozen=True)
class PlanTiming:
    """Measured latency of one plan's merge (both directions), microseconds per iteration.

    Each sample is one batch of ``per_batch`` back-to-back iterations, timed on every rank and
    divided by ``per_batch``; the batch's time is its slowest rank's. ``median_us`` and ``p95_us``
    are over the batches (``iterations`` = batches x ``per_batch``).
    """

    plan: ReductionPlan
    median_us: float
    p95_us: float
    iterations: int
    method: str = "host-clock"  # cuda-graph (replays between events), cuda-events, host-clock
    per_batch: int = 1


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
    batches: int,
    per_batch: int,
    warmup: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PlanTuneResult:
    """Run inside every rank: time each candidate's merge; every rank returns rank 0's decision.

    Each candidate is the prepared merge ``run`` decodes with (static buffers, peers resolved
    once), replayed as a CUDA graph on GPUs, eager on CPU ranks.

    Why batches: ranks leave a barrier at different moments (the skew is the barrier's own
    latency, some microseconds to tens of them), and each rank can only start its clock at its
    own exit. A rank that starts early waits for its peers inside the merge, so one timed
    iteration per barrier adds the skew to the slowest rank's time, as much as the 10-40 us
    plans being compared. So every rank times ``per_batch`` back-to-back iterations after the
    barrier (CUDA events around the replays, queued behind a short spin so that their launches
    are not timed; the host clock on CPU ranks) and divides: the skew lands on the first
    iteration only and counts 1/``per_batch`` of it. A merge ends with every rank holding the
    result, so a rank starts an iteration only once the previous one has reached it: back-to-back
    iterations overlap only where one's last messages are still arriving at some ranks while
    others begin the next (per-iteration latency as nccl-tests reports it, not pipelined
    throughput). The batch lasts as long as its slowest rank; ``batches`` such samples give the
    median and p95. On GPUs each batch's wait is bounded by ``timeout_s`` (a replayed NCCL receive
    whose peer stalls has no other bound: see ``graphs.wait_for``).
    """
    import torch.distributed as dist

    from ...graphs import CapturedStep
    from ...launch.group import barrier
    from ...reduce.collectives import abort_group
    from ...reduce.exchange import build_merge
    from ...timing import hold_stream

    device = torch.device(env.device)
    g = torch.Generator().manual_seed(1234 + env.rank)
    o = torch.randn(batch, q_heads, head_dim, generator=g).to(device)
    lse = torch.randn(batch, q_heads, generator=g).to(device)
    cuda = device.type == "cuda"
    timings = []
    for plan in candidates:
        merge = build_merge(plan, None, batch, q_heads, head_dim, device)
        merge.local[..., :head_dim].copy_(o)
        merge.local[..., head_dim].copy_(lse)
        # Collective: every rank builds it here. One rank has nothing to merge: an empty graph
        # (torch warns of one) would time nothing, so that merge runs eagerly.
        alone = env.world_size == 1
        step = CapturedStep(merge, device, enabled=not alone, warmup=max(1, warmup), communicates=not alone,
                            timeout_s=timeout_s, abort=abort_group, rank=env.rank, name=f"{plan.label} merge")
        for _ in range(warmup):
            step()
        mine = []
        for b in range(batches):
            barrier(env)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                hold_stream(device)  # the replays queue behind it: their launch latency is not timed
                start.record()
                for _ in range(per_batch):
                    step()
                end.record()
                step.wait(f"{plan.label} timing batch {b + 1} of {batches}", done=end)
                mine.append(start.elapsed_time(end) * 1e-3 / per_batch)
            else:
                t0 = time.perf_counter()
                for _ in range(per_batch):
                    step()
                mine.append((time.perf_counter() - t0) / per_batch)
        method = "cuda-graph" if step.captured else ("cuda-events" if cuda else "host-clock")
        step.close()  # a graph alive at destroy_process_group would hang NCCL's teardown
        # Each batch lasts as long as its slowest rank: gather everyone's times.
        local = torch.tensor(mine, dtype=torch.float64, device=device if env.backend == "nccl" else "cpu")
        every = [torch.empty_like(local) for _ in range(env.world_size)]
        dist.all_gather(every, local)
        slowest = torch.stack(every).amax(dim=0).cpu().tolist()
        timings.append(
            PlanTiming(
                plan=plan,
                median_us=1e6 * statistics.median(slowest),
                p95_us=1e6 * percentile(slowest, 0.95),
                iterations=batches * per_batch,
                method=method,
                per_batch=per_batch,
            )
        )
    # Rank 0 decides; the broadcast makes the choice identical everywhere by construction.
    choice = [min(range(len(timings)), key=lambda i: timings[i].median_us) if env.rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return PlanTuneResult(timings=timings, chosen=candidates[choice[0]])


@dataclass(frozen=True)
class KernelTiming:
    """One kernel config's timing at a bucket's shape.

    ``median_us``: device time of one launch (see :mod:`tree_attn.timing`); ``gbps``: KV bytes
    over that time; ``host_us``: host time to issue one launch of the prepared launch;
    ``copy_fraction``: ``gbps`` over the measured device-to-device copy bandwidth (GPUs);
    ``method``: how the time was taken; ``host_bound``: the timing measured the host (rejected);
    ``error``: why the config could not run here (e.g. it needs more shared memory than the
    device has), with no time.
    """

    config: object  # DecodeConfig
    predicted_us: float
    median_us: float | None
    gbps: float | None
    host_us: float | None = None
    copy_fraction: float | None = None
    method: str = "host-clock"
    host_bound: bool = False
    error: str | None = None


def time_kernel_configs(
    shape, dtype: torch.dtype, configs_ranked, device: str, iterations: int, warmup: int,
    copy_gbps: float | None = None,
    *, kv_dtype: torch.dtype | None = None,
) -> list[KernelTiming]:
    """Time the Triton kernel for each ranked config on one device.

    ``dtype`` is the query's, ``kv_dtype`` the cache's (None: the same); an fp8 cache gets random
    finite values and float32 scales per KV head, and its bandwidth counts its 1-byte elements.

    On a GPU every config is captured as a CUDA graph of back-to-back launches over rotated KV
    buffers (together at least 3x the L2 cache, within 40% of free memory) and replayed between
    CUDA events, ``iterations`` times; the median per launch is its device time. On CPU (Triton's
    interpreter, for tests) a host clock.
    """
    from ...cost.kernel import kv_bytes
    from ...errors import ConfigError
    from ...kernels.triton_launch import TritonDecodeLaunch
    from ...timing import rotation_count, time_calls

    dev = torch.device(device)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    nbytes = kv_bytes(shape, kv_dtype)
    copies = 1
    if dev.type == "cuda":
        from ...kernels.device_info import device_spec_for

        free, _ = torch.cuda.mem_get_info(dev)
        copies = rotation_count(nbytes, device_spec_for(dev).l2_bytes, free)
    q = torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=dev, dtype=dtype)
    kv_shape = (shape.batch, shape.kv_len, shape.kv_heads, shape.head_dim)
    scales = {}
    if kv_dtype.itemsize == 1:  # fp8: values spread over the format, scaled to about [-1, 1]
        kvs = [(_random_fp8(kv_shape, kv_dtype, dev), _random_fp8(kv_shape, kv_dtype, dev)) for _ in range(copies)]
        one = torch.full((shape.kv_heads,), 1.0 / torch.finfo(kv_dtype).max, device=dev)
        scales = dict(k_scale=one, v_scale=one)
    else:
        kvs = [(torch.randn(kv_shape, device=dev, dtype=kv_dtype), torch.randn(kv_shape, device=dev, dtype=kv_dtype))
               for _ in range(copies)]

    out = []
    for ranked in configs_ranked:
        cfg = ranked.config
        try:
            launch = TritonDecodeLaunch(q, *kvs[0], None, config=cfg, **scales)
            o, lse = launch.new_outputs()
            calls = [functools.partial(launch, q, k, v, None, o, lse, **scales) for k, v in kvs]
            t = time_calls(calls, dev, repeats=iterations, warmup=warmup)
        except ConfigError as exc:  # e.g. Triton's out-of-resources: this config cannot run here
            out.append(KernelTiming(config=cfg, predicted_us=ranked.predicted_us, median_us=None, gbps=None,
                                    error=str(exc)))
            continue
        gbps = nbytes / t.device_us / 1e3
        out.append(KernelTiming(
            config=cfg, predicted_us=ranked.predicted_us, median_us=t.device_us, gbps=gbps, host_us=t.host_us,
            copy_fraction=gbps / copy_gbps if copy_gbps else None, method=t.method, host_bound=t.host_bound,
        ))
    del kvs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _random_fp8(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random finite values of an fp8 ``dtype``: uniform random floats over its range, converted."""
    top = torch.finfo(dtype).max
    return (torch.rand(shape, device=device) * 2 - 1).mul_(top).to(dtype)


@dataclass(frozen=True)
class TuneOptions(OnLaunch):
    """What ``tune`` searches, on the ranks of ``launch`` (its dtype is the kernel's). Shapes
    default to Llama-3.1-8B attention."""

    launch: LaunchSetup
    batch: int = BATCH
    q_heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    kv_dtype: str | None = None  # the KV cache's dtype (e.g. float8_e4m3fn); None: the launch's dtype
    quick: bool = False
    buckets: tuple[int, ...] | None = None  # override of the shard buckets (tests: tiny shapes)
    tune_kernels: bool = True  # False under torchrun: only the plans are timed across the job

    @property
    def plan_batches(self) -> tuple[int, int, int]:
        """(timed batches, iterations per batch, warm-up iterations) per candidate plan: 50
        iterations a batch leave 1/50 of the ranks' start skew in each (25 with --quick)."""
        return (8, 25, 3) if self.quick else (25, 50, 20)

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
    """Kernel tuning of one shape bucket: the timed candidates (model's order) and the winner.
    ``dtype`` is the KV cache's (canonical name, e.g. ``bfloat16`` or ``float8_e4m3fn``)."""

    dtype: str
    head_dim: int
    group: int
    max_shard_len: int
    timings: list[KernelTiming]
    chosen: KernelTiming
    chosen_by: str = "measured"  # "model" when every timing was host-bound
    copy_gbps: float | None = None  # measured device-to-device copy bandwidth (GPUs)


def tune_plans(options: TuneOptions, candidates: list[ReductionPlan]) -> PlanTuneResult | None:
    """Time every candidate plan on the launch's ranks (spawned, or this torchrun job's); rank 0's
    choice wins. None on the torchrun ranks other than 0."""
    from ...launch.job import run_ranks

    batches, per_batch, warm = options.plan_batches
    job = run_ranks(
        time_plans_rank, options.launch,
        args=(candidates, options.batch, options.q_heads, options.head_dim, batches, per_batch, warm,
              options.timeout_s),
    )
    if job is None:
        return None
    results = job.values
    if len({r.chosen for r in results}) != 1:
        from ...errors import DistributedError

        raise DistributedError("ranks ended the plan search with different plans; rank 0's broadcast did not arrive")
    return results[0]


@dataclass(frozen=True)
class KernelTuneReport:
    """The kernel buckets :func:`tune_kernels_in_child` tuned, and the process that timed them."""

    buckets: list[BucketResult]
    pid: int


def _tune_kernels_work(options: TuneOptions, device: str | None, say) -> list[BucketResult]:
    return tune_kernels(options, progress=say, device=device)


def tune_kernels_in_child(options: TuneOptions, progress=None, device: str | None = None) -> KernelTuneReport:
    """:func:`tune_kernels` in a spawned child process (see :mod:`tree_attn.launch.child`): the
    same timings and choices, while this process makes no CUDA context. ``progress`` receives the
    child's lines as they come."""
    from ...launch.child import run_in_child

    done = run_in_child(_tune_kernels_work, (options, device), what="kernel tuning", timeout_s=options.timeout_s,
                        progress=progress)
    return KernelTuneReport(done.value, done.pid)


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
    from ...cost.devices import CPU_INTERPRETER, DeviceSpec
    from ...cost.kernel import RankedConfig, candidate_configs, predict_time_us, rank_candidates, tuning_survivors
    from ...dtypes import parse_kv_dtype, torch_dtype
    from ...kernels.config import resolve_config
    from ...kernels.shapes import DecodeShape

    dtype = torch_dtype(options.dtype)  # the query's
    kv_name = parse_kv_dtype(options.kv_dtype or options.dtype)  # the cache's: the buckets' dtype
    kv_dtype = torch_dtype(kv_name)
    spec = DeviceSpec.from_torch_device(device) if device.startswith("cuda") else CPU_INTERPRETER
    copy_gbps = None
    if device.startswith("cuda"):
        from ...timing import measure_copy_bandwidth

        copy_gbps = measure_copy_bandwidth(device)
        if progress:
            progress(f"device-to-device copy: {copy_gbps:,.0f} GB/s (read + write), the ceiling for a streaming kernel")
    out = []
    iters, warm = (10, 3) if options.quick else (50, 10)
    for n in options.shard_buckets:
        shape = DecodeShape(options.batch, options.q_heads, options.kv_heads, options.head_dim, n)
        need = 2 * n * options.batch * options.kv_heads * options.head_dim * kv_dtype.itemsize
        if device.startswith("cuda") and need > 0.5 * torch.cuda.mem_get_info(torch.device(device))[0]:
            if progress:
                progress(f"kernel bucket {n} tokens: skipped (KV of {need / 2**30:.1f} GiB does not fit comfortably)")
            continue
        ranked = rank_candidates(candidate_configs(shape, kv_dtype, spec), shape, kv_dtype, spec)
        default = resolve_config(None, shape, kv_dtype, spec, q_dtype=dtype)  # what runs without a profile
        ranked = tuning_survivors(ranked, options.kernel_survivors,
                                  include=RankedConfig(default, predict_time_us(default, shape, kv_dtype, spec)))
        timings = time_kernel_configs(shape, dtype, ranked, device, iters, warm, copy_gbps=copy_gbps, kv_dtype=kv_dtype)
        failed = [t for t in timings if t.error is not None]
        if len(failed) == len(timings):
            from ...errors import ConfigError

            raise ConfigError(f"kernel bucket {n} tokens: none of the {len(timings)} candidate configs could run on "
                              f"{device}; the first said: {failed[0].error}")
        if failed and progress:
            progress(f"kernel bucket {n} tokens: {len(failed)} config(s) could not run here and were skipped: "
                     + "; ".join(t.config.describe() for t in failed))
        # A host-bound timing measured Python, not the kernel: it cannot rank configs.
        trusted = [t for t in timings if t.error is None and not t.host_bound]
        if trusted:
            best, chosen_by = min(trusted, key=lambda t: t.median_us), "measured"
        else:
            best, chosen_by = next(t for t in timings if t.error is None), "model"
        if progress:
            if chosen_by == "measured":
                frac = f", {100 * best.copy_fraction:.0f}% of copy bandwidth" if best.copy_fraction else ""
                progress(f"kernel bucket {n} tokens: best {best.config.describe()} {best.median_us:.1f} us "
                         f"({best.method}), {best.gbps:.0f} GB/s{frac}")
            else:
                progress(f"kernel bucket {n} tokens: every timing was host-bound (issue time near the measured time); "
                         f"keeping the model's choice {best.config.describe()}")
        out.append(BucketResult(kv_name, options.head_dim, options.q_heads // options.kv_heads, n, timings, best,
                                chosen_by=chosen_by, copy_gbps=copy_gbps))
    return out
