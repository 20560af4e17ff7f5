"""The decode benchmark behind ``tree-attn run``: shard a KV cache over ranks, decode with each
strategy, time the steps, count the bytes, measure memory, check against a single-process reference.

Inputs are generated on CPU from a seed (the query per step, the KV shard per rank), so the parent
process (or rank 0 under torchrun) can rebuild the whole cache and compute the reference.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from ..dtypes import parse_dtype, torch_dtype
from ..errors import ConfigError
from ..reduce.plan import ReductionPlan
from ..ranks.launch import RankEnv, barrier

if TYPE_CHECKING:  # pragma: no cover
    from .run_setup import ProfileChoice

STRATEGY_NAMES = ("tree", "allreduce", "ring")



@dataclass(frozen=True)
class RunSpec:
    """What to decode and how. ``seq_len`` is the total KV length, split over ``world_size`` ranks."""

    world_size: int = 4
    seq_len: int = 65536
    batch: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float32"
    steps: int = 8
    warmup: int = 2
    plans: tuple[tuple[str, ReductionPlan | None], ...] = (("tree", ReductionPlan("tree", 2)), ("ring", None))
    device_kind: str = "cpu"
    backend: str = "gloo"
    impl: str = "auto"
    kernel_config: dict | None = None
    seed: int = 0
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("world_size", "batch", "q_heads", "kv_heads", "head_dim", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive integer; got {value!r}")
        if self.seq_len < 0:
            raise ConfigError(f"sequence length must be >= 0; got {self.seq_len}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0; got {self.warmup}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(
                f"query heads ({self.q_heads}) must be a multiple of KV heads ({self.kv_heads}) for grouped-query attention"
            )
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if not self.plans:
            raise ConfigError("at least one strategy is needed")
        for name, plan in self.plans:
            if name not in STRATEGY_NAMES:
                raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGY_NAMES)}")
            if plan is not None:
                plan.check(self.world_size)

    def shard_sizes(self) -> list[int]:
        """Tokens per rank: as even as possible, the first ``seq_len % p`` ranks one more."""
        base, extra = divmod(self.seq_len, self.world_size)
        return [base + (1 if r < extra else 0) for r in range(self.world_size)]


def make_query(spec: RunSpec, step: int) -> torch.Tensor:
    """The query of decode step ``step``: ``[B, Hq, D]`` on CPU in the spec's dtype."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + 7919 * (step + 1))
    return torch.randn(spec.batch, spec.q_heads, spec.head_dim, generator=g).to(torch_dtype(spec.dtype))


def make_shard(spec: RunSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s KV shard ``k, v [B, N_r, Hkv, D]`` on CPU in the spec's dtype."""
    n = spec.shard_sizes()[rank]
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + 104729 * (rank + 1) + 1)
    shape = (spec.batch, n, spec.kv_heads, spec.head_dim)
    dt = torch_dtype(spec.dtype)
    k = torch.randn(shape, generator=g).to(dt)
    v = torch.randn(shape, generator=g).to(dt)
    return k, v


@dataclass
class RankReport:
    """What one rank measured for one strategy."""

    step_s: list[float]
    bytes_sent_per_step: int
    messages_per_step: int
    peak_mem_bytes: int
    peak_mem_above_start_bytes: int
    out: torch.Tensor  # last step, CPU
    lse: torch.Tensor


def _progress(env: RankEnv, text: str) -> None:
    if env.rank == 0:
        print(f"[rank 0] {text}", file=sys.stderr, flush=True)


def decode_rank(env: RankEnv, spec: RunSpec) -> dict[str, RankReport]:
    """Run every strategy of ``spec`` on this rank; returns one report per strategy label."""
    import torch.distributed as dist

    from ..reduce.collectives import tree_decode
    from ..reduce.comm import CommStats
    from ..reduce.ring import ring_decode
    from .memory import MemoryMonitor

    device = torch.device(env.device)
    k, v = (t.to(device) for t in make_shard(spec, env.rank))
    queries = [make_query(spec, s).to(device) for s in range(spec.steps)]
    config = None
    if spec.kernel_config:
        from ..kernels.config import DecodeConfig

        config = DecodeConfig.from_dict(spec.kernel_config)
    reports: dict[str, RankReport] = {}
    for name, plan in spec.plans:
        label = plan.label if plan is not None else "ring"
        stats = CommStats()

        def step(q: torch.Tensor, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
            # Shapes are checked (and the ring's shard lengths learned) on the first warm-up step
            # only: every rank runs the same loop, so timed steps carry no extra collective.
            if name == "ring":
                lengths = None if first else spec.shard_sizes()
                return ring_decode(q, k, v, impl=spec.impl, config=config, lengths=lengths, stats=stats)
            return tree_decode(q, k, v, plan=plan, impl=spec.impl, config=config, check_shapes=first, stats=stats)

        _progress(env, f"{label}: {spec.warmup} warm-up + {spec.steps} timed steps")
        for w in range(spec.warmup):
            step(queries[w % len(queries)], first=(w == 0))
        if spec.warmup == 0:
            step(queries[0], first=True)  # the shape check must still happen once
        times: list[float] = []
        per_step_bytes: list[int] = []
        per_step_msgs: list[int] = []
        with MemoryMonitor(env.device) as mem:
            for s in range(spec.steps):
                stats.reset()
                barrier(env)
                t0 = time.perf_counter()
                out, lse = step(queries[s], first=False)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
                per_step_bytes.append(stats.bytes_sent)
                per_step_msgs.append(stats.messages)
        reports[label] = RankReport(
            step_s=times,
            bytes_sent_per_step=max(per_step_bytes),
            messages_per_step=max(per_step_msgs),
            peak_mem_bytes=mem.result.peak_bytes,
            peak_mem_above_start_bytes=mem.result.above_start_bytes,
            out=out.cpu(),
            lse=lse.cpu(),
        )
        _progress(env, f"{label}: median step {1e3 * statistics.median(times):.2f} ms")
    return reports


@dataclass
class StrategyResult:
    """One row of the run table (per-rank figures are the maximum over ranks)."""

    strategy: str
    plan: str
    step_ms_median: float
    step_ms_p95: float
    bytes_sent_per_step: int
    bytes_sent_per_step_mean: float
    messages_per_step: int
    peak_mem_bytes: int
    peak_mem_above_start_bytes: int
    max_abs_err: float
    max_lse_err: float
    ranks_agree: bool

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunResult:
    spec: dict
    device: str
    backend: str
    results: list[StrategyResult] = field(default_factory=list)
    speedup_vs_ring: float | None = None
    profile: "ProfileChoice | None" = None  # which profile the run used (runner.run_setup.ProfileChoice)

    def to_dict(self) -> dict:
        return {
            "config": self.spec,
            "device": self.device,
            "backend": self.backend,
            "results": [r.to_dict() for r in self.results],
            "speedup_vs_ring": self.speedup_vs_ring,
            "profile": self.profile.to_dict() if self.profile is not None else None,
        }


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def reference_last_step(spec: RunSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process reference for the last step: the whole cache on CPU, torch reference."""
    from ..kernels.reference import decode_attention_torch

    shards = [make_shard(spec, r) for r in range(spec.world_size)]
    k = torch.cat([s[0] for s in shards], dim=1)
    v = torch.cat([s[1] for s in shards], dim=1)
    del shards
    return decode_attention_torch(make_query(spec, spec.steps - 1), k, v)


def summarize(spec: RunSpec, per_rank: list[dict[str, RankReport]], device: str, backend: str) -> RunResult:
    """Combine the ranks' reports with the reference into the run's table rows."""
    ref_out, ref_lse = reference_last_step(spec)
    ref_out = ref_out.float()
    rows: list[StrategyResult] = []
    for name, plan in spec.plans:
        label = plan.label if plan is not None else "ring"
        reps = [r[label] for r in per_rank]
        # A step takes as long as its slowest rank.
        step_s = [max(rep.step_s[i] for rep in reps) for i in range(spec.steps)]
        errs = [float((rep.out.float() - ref_out).abs().max()) if rep.out.numel() else 0.0 for rep in reps]
        lse_errs = [_lse_err(rep.lse, ref_lse) for rep in reps]
        first = reps[0]
        agree = all(torch.equal(rep.out, first.out) and torch.equal(rep.lse, first.lse) for rep in reps)
        rows.append(
            StrategyResult(
                strategy=name,
                plan=label,
                step_ms_median=1e3 * statistics.median(step_s),
                step_ms_p95=1e3 * percentile(step_s, 0.95),
                bytes_sent_per_step=max(rep.bytes_sent_per_step for rep in reps),
                bytes_sent_per_step_mean=sum(rep.bytes_sent_per_step for rep in reps) / len(reps),
                messages_per_step=max(rep.messages_per_step for rep in reps),
                peak_mem_bytes=max(rep.peak_mem_bytes for rep in reps),
                peak_mem_above_start_bytes=max(rep.peak_mem_above_start_bytes for rep in reps),
                max_abs_err=max(errs),
                max_lse_err=max(lse_errs),
                ranks_agree=agree,
            )
        )
    result = RunResult(spec=_spec_dict(spec), device=device, backend=backend, results=rows)
    ring = [r for r in rows if r.strategy == "ring"]
    trees = [r for r in rows if r.strategy != "ring"]
    if ring and trees:
        result.speedup_vs_ring = ring[0].step_ms_median / min(r.step_ms_median for r in trees)
    return result


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    both_inf = torch.isneginf(lse) & torch.isneginf(ref)
    if bool(both_inf.all()):
        return 0.0
    if bool((torch.isneginf(lse) != torch.isneginf(ref)).any()):
        return float("inf")
    return float((lse[~both_inf] - ref[~both_inf]).abs().max())


def _spec_dict(spec: RunSpec) -> dict:
    d = {k: v for k, v in asdict(spec).items() if k != "plans"}
    d["strategies"] = [{"strategy": n, "plan": p.to_dict() if p else None} for n, p in spec.plans]
    d["shard_sizes"] = spec.shard_sizes()
    return d


def run_decode(spec: RunSpec) -> RunResult:
    """Run the decode benchmark: spawn ``spec.world_size`` ranks (or join torchrun) and summarise."""
    from ..ranks.launch import init_torchrun, launch_ranks, torchrun_env

    env = torchrun_env(spec.device_kind, spec.backend)
    if env is None:
        per_rank = launch_ranks(
            decode_rank,
            spec.world_size,
            args=(spec,),
            backend=spec.backend,
            device_kind=spec.device_kind,
            timeout_s=spec.timeout_s,
        )
        return summarize(spec, per_rank, _device_name(spec.device_kind), spec.backend)
    return _run_under_torchrun(spec, env, init_torchrun)


def _run_under_torchrun(spec: RunSpec, env: RankEnv, init_torchrun) -> RunResult | None:
    """Under torchrun this process is one rank: decode, gather reports to rank 0, summarise there."""
    import torch.distributed as dist

    if env.world_size != spec.world_size:
        raise ConfigError(
            f"torchrun started {env.world_size} ranks but --world-size is {spec.world_size}; omit --world-size under torchrun"
        )
    init_torchrun(env, spec.timeout_s)
    try:
        reports = decode_rank(env, spec)
        gathered: list | None = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(reports, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if env.rank != 0:
        return None
    return summarize(spec, gathered, _device_name(spec.device_kind), env.backend)


def _device_name(device_kind: str) -> str:
    if device_kind == "cuda":
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores)"
