"""The decode benchmark behind ``tree-attn run``: shard a KV cache over ranks, decode with each
strategy, time the steps, count the bytes, measure memory, check against a single-process reference.

Inputs are generated on CPU from a seed (the query per step, the KV shard per rank), so the parent
process (or rank 0 under torchrun) can rebuild the whole cache and compute the reference.

An fp8 cache (``--kv-dtype fp8``): each rank makes its shard in ``--dtype`` as for any run (the
unquantized cache) and quantizes it with ``tree_attn.quantize_kv`` (its own scales per KV head, as
ranks that quantize their shards apart would). ``max_abs_err`` is then against float64 on the
dequantized cache (what the ranks attend over: the kernels' error), and
``max_abs_err_unquantized`` against float64 on the unquantized cache (the quantization's error,
for the user to judge).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from ...dtypes import ITEMSIZE, is_fp8, torch_dtype
from ...errors import ConfigError
from ...launch.env import RankEnv
from ...launch.group import barrier
from ...launch.job import percentile, say_on_rank_0
from ...launch.setup import LaunchSetup, OnLaunch
from ..defaults import check_seed
from .setup import RunOptions

if TYPE_CHECKING:  # pragma: no cover
    from ...launch.plans import ProfileChoice

DEFAULTS = RunOptions()
PROGRESS_S = 10.0  # the longest a run's timed steps go without a progress line on stderr

# Why ring's ranks may disagree in the last bits while tree's and allreduce's never do.
RING_ORDER_NOTE = ("ring ranks merge the KV blocks in different orders (each starts from its own), so "
                   "their results may differ in the last bits, within rounding")



@dataclass(frozen=True)
class RunSpec(OnLaunch):
    """What to decode and how. ``seq_len`` is the total KV length, split over the launch's ranks;
    ``launch`` says where they compute, with which plans and kernel config. Defaults are
    :class:`~.setup.RunOptions`'."""

    launch: LaunchSetup
    seq_len: int = DEFAULTS.seq_len
    batch: int = DEFAULTS.batch
    q_heads: int = DEFAULTS.heads
    kv_heads: int = DEFAULTS.kv_heads
    head_dim: int = DEFAULTS.head_dim
    steps: int = DEFAULTS.steps
    warmup: int = DEFAULTS.warmup
    impl: str = "auto"
    seed: int = DEFAULTS.seed
    cuda_graph: bool = DEFAULTS.cuda_graph  # GPU ranks: replay the tree/allreduce step as a CUDA graph

    def __post_init__(self) -> None:
        from ...launch.setup import KernelShape

        for name in ("batch", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name.replace('_', ' ')} must be a positive integer; got {value!r}")
        KernelShape(self.q_heads, self.kv_heads, self.head_dim, self.seq_len)  # heads, head dim, length
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0; got {self.warmup}")
        # make_query/make_shard derive generator seeds from it: they must stay within 64 bits
        check_seed(self.seed, "seed")
        if not self.launch.plans:
            raise ConfigError("at least one strategy is needed")

    def shard_sizes(self) -> list[int]:
        """Tokens per rank: as even as possible, the first ``seq_len % p`` ranks one more."""
        return self.launch.shard_sizes(self.seq_len)

    @property
    def fp8(self) -> bool:
        """Whether the KV cache is fp8 (quantized from a cache in ``dtype``)."""
        return is_fp8(self.kv_dtype)

    @property
    def made_dtype(self) -> str:
        """The dtype the shards are made in: the KV dtype, or for an fp8 cache the query's (the
        unquantized cache)."""
        return self.dtype if self.fp8 else self.kv_dtype

    def kv_bytes_per_rank(self) -> int:
        """Bytes of the largest rank's K and V shard (and an fp8 shard's float32 scales)."""
        n = max(self.shard_sizes())
        scales = 2 * self.kv_heads * 4 if self.fp8 else 0
        return 2 * self.batch * n * self.kv_heads * self.head_dim * ITEMSIZE[self.kv_dtype] + scales


def make_query(spec: RunSpec, step: int) -> torch.Tensor:
    """The query of decode step ``step``: ``[B, Hq, D]`` on CPU in the spec's dtype."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + 7919 * (step + 1))
    return torch.randn(spec.batch, spec.q_heads, spec.head_dim, generator=g).to(torch_dtype(spec.dtype))


def make_shard(spec: RunSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s KV shard ``k, v [B, N_r, Hkv, D]`` on CPU in :attr:`RunSpec.made_dtype`
    (for an fp8 cache: the unquantized shard)."""
    n = spec.shard_sizes()[rank]
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + 104729 * (rank + 1) + 1)
    shape = (spec.batch, n, spec.kv_heads, spec.head_dim)
    dt = torch_dtype(spec.made_dtype)
    k = torch.randn(shape, generator=g).to(dt)
    v = torch.randn(shape, generator=g).to(dt)
    return k, v


@dataclass
class KVShard:
    """A rank's cache as the ranks attend over it: ``k, v`` in the KV dtype, and an fp8 cache's
    float32 ``[Hkv]`` scales (else None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def scales(self) -> dict:
        """The scales as the decode functions' keywords (empty for a cache that is not fp8)."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def to(self, device) -> KVShard:
        return KVShard(*(None if t is None else t.to(device) for t in (self.k, self.v, self.k_scale, self.v_scale)))


def make_kv_shard(spec: RunSpec, rank: int) -> KVShard:
    """Rank ``rank``'s cache: :func:`make_shard`'s, quantized per KV head for an fp8 cache."""
    k, v = make_shard(spec, rank)
    if not spec.fp8:
        return KVShard(k, v)
    from ...kernels.fp8 import quantize_kv

    return KVShard(*quantize_kv(k, v, dtype=torch_dtype(spec.kv_dtype)))


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
    device_step_s: list[float] = field(default_factory=list)  # GPUs: each step's device time (see device_time)
    execution: str = "eager"  # "cuda graph" or "eager"
    why_eager: str | None = None
    device_time: str | None = None  # GPUs: how device_step_s was taken, or why it was not (then empty)


# Why the ring baseline stays eager: each of its steps passes whole KV shards around and allocates
# their receive buffers per step; capturing it would pin p - 1 shards of graph memory per rank for a
# baseline whose time is dominated by moving those bytes, not by Python.
RING_EAGER = "the ring baseline runs eagerly (whole KV shards travel each step)"

# How a row's device time was taken. Events around a graph replay bracket device work (the
# replay issues the whole step at once). Events around an eager step would bracket the host's
# pace instead: the GPU runs each launch as it arrives, and waits for the next one. So eager
# steps are timed again, each queued behind a spin kernel that outlasts its issuing.
DEVICE_TIME_GRAPH = "CUDA events around each graph replay"
DEVICE_TIME_HELD = ("CUDA events around each eager step, its launches queued behind a spin kernel that outlasted "
                    "their issuing (extra steps after the timed ones)")
DEVICE_TIME_NO_HOLD = ("not measured: this torch has no torch.cuda._sleep to queue an eager step's launches behind, "
                       "and events around launches as they come time the host")
DEVICE_TIME_HOST_BOUND = ("not measured: the GPU reached an eager step before the host had issued all of it, even "
                          "behind a spin kernel, so events around it would time the host")


def decode_rank(env: RankEnv, spec: RunSpec) -> dict[str, RankReport]:
    """Run every strategy of ``spec`` on this rank; returns one report per strategy label.

    tree / allreduce: one :class:`reduce.collectives.TreeDecodeStep` per strategy, built once on
    static buffers (the shape check and the merge's peers resolved there), replayed as a CUDA
    graph on GPUs unless ``spec.cuda_graph`` is off; each step writes the new query into the
    static query buffer and runs. ring: the eager baseline. A step's time runs from a barrier to
    the end of its device work. On GPUs every wait for a step is bounded by ``spec.timeout_s``
    (a replayed NCCL receive whose peer stalls has no other bound: see ``graphs.wait_for``),
    and the device time of a step is taken from CUDA events: around each timed replay, or for
    eager steps around extra steps queued behind a spin kernel (``device_time`` says which).
    """
    from ...graphs import wait_for
    from ...launch.memory import MemoryMonitor
    from ...reduce.collectives import TreeDecodeStep, abort_group
    from ...reduce.comm import CommStats
    from ...reduce.ring import ring_decode

    device = torch.device(env.device)
    cuda = device.type == "cuda"
    shard = make_kv_shard(spec, env.rank).to(device)
    k, v, scales = shard.k, shard.v, shard.scales
    config = spec.kernel_config
    reports: dict[str, RankReport] = {}
    for name, plan in spec.plans:
        label = plan.label if plan is not None else "ring"
        stats = CommStats()
        q_static = make_query(spec, 0).to(device)
        prepared = None
        try:
            why_eager = RING_EAGER
            if name == "ring":
                # The first call checks shapes and learns the shard lengths; timed calls are given them.
                ring_decode(q_static, k, v, impl=spec.impl, config=config, **scales)

                # step and finish are called only in this iteration; the defaults bind its values.
                def step(*, q_static=q_static, stats=stats) -> tuple[torch.Tensor, torch.Tensor]:
                    return ring_decode(q_static, k, v, impl=spec.impl, config=config, lengths=spec.shard_sizes(),
                                       stats=stats, **scales)
            else:
                # Collective: every rank builds its step here (shape check, warm-up, capture).
                prepared = TreeDecodeStep(q_static, k, v, plan=plan, impl=spec.impl, config=config,
                                          cuda_graph=spec.cuda_graph, timeout_s=spec.timeout_s, **scales)
                why_eager = prepared.why_eager

                def step(*, prepared=prepared, stats=stats) -> tuple[torch.Tensor, torch.Tensor]:
                    return prepared(stats)

            def finish(what: str, done=None, *, prepared=prepared) -> None:
                """Wait for the step just issued (``done``: an event recorded after it), at most the
                job's timeout; on expiry the group is aborted and the error names rank and step."""
                if not cuda:
                    return  # CPU ranks: the step has finished when it returns
                if done is None:
                    done = torch.cuda.Event()
                    done.record()
                if prepared is not None:
                    prepared.wait(what, done=done)
                else:
                    wait_for(done, spec.timeout_s, what=what, rank=env.rank, abort=abort_group)

            say_on_rank_0(env, f"{label}: {spec.warmup} warm-up + {spec.steps} timed steps"
                           + ("" if why_eager is None else f" ({why_eager})"))
            for w in range(spec.warmup):
                q_static.copy_(make_query(spec, w).to(device))
                step()
                finish(f"{label} warm-up step {w + 1} of {spec.warmup}")
            times: list[float] = []
            issue_times: list[float] = []
            device_times: list[float] = []
            per_step_bytes: list[int] = []
            per_step_msgs: list[int] = []
            last_note = time.monotonic()
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
            with MemoryMonitor(env.device) as mem:
                for s in range(spec.steps):
                    q_next = make_query(spec, s).to(device)  # made before the step: a real loop has it on the device
                    stats.reset()
                    barrier(env)
                    if cuda:
                        torch.cuda.synchronize(device)
                        events[0].record()
                    t0 = time.perf_counter()
                    q_static.copy_(q_next)
                    out, lse = step()
                    issue_times.append(time.perf_counter() - t0)
                    if cuda:
                        events[1].record()
                        finish(f"{label} step {s + 1} of {spec.steps}", events[1])
                    times.append(time.perf_counter() - t0)
                    if cuda and why_eager is None:
                        device_times.append(events[0].elapsed_time(events[1]) * 1e-3)
                    per_step_bytes.append(stats.bytes_sent)
                    per_step_msgs.append(stats.messages)
                    # A progress line every tenth of the steps, and at least every PROGRESS_S seconds;
                    # it counts steps done (s + 1) and always shows the last ("8/8").
                    done = s + 1
                    if (done == spec.steps or done % max(1, spec.steps // 10) == 0
                            or time.monotonic() - last_note > PROGRESS_S):
                        say_on_rank_0(env, f"{label}: step {done}/{spec.steps}")
                        last_note = time.monotonic()
            out, lse = out.cpu(), lse.cpu()  # before any further step overwrites the static outputs
            device_time = None
            if cuda and why_eager is None:
                device_time = DEVICE_TIME_GRAPH
            elif cuda:
                device_times, device_time = held_device_times(env, spec, label, step, q_static,
                                                               max(issue_times), finish)
            reports[label] = RankReport(
                step_s=times,
                bytes_sent_per_step=max(per_step_bytes),
                messages_per_step=max(per_step_msgs),
                peak_mem_bytes=mem.result.peak_bytes,
                peak_mem_above_start_bytes=mem.result.above_start_bytes,
                out=out,
                lse=lse,
                device_step_s=device_times,
                execution="eager" if why_eager is not None else "cuda graph",
                why_eager=why_eager,
                device_time=device_time,
            )
            # Rank 0's own times: the table's median takes each step's slowest rank, so it can be higher.
            say_on_rank_0(env, f"{label}: rank 0's median step {1e3 * statistics.median(times):.2f} ms "
                           "(the table's median takes each step's slowest rank)")
        finally:
            if prepared is not None:
                # Free its graph now: NCCL's teardown waits for every graph holding its kernels, so
                # one kept alive (by an error's traceback, say) would hang destroy_process_group.
                # While an error propagates, that error is the one to report, not the close's.
                failing = sys.exc_info()[1] is not None
                try:
                    prepared.close()
                except Exception:  # see above
                    if not failing:
                        raise
    return reports


def held_device_times(env: RankEnv, spec: RunSpec, label: str, step, q_static: torch.Tensor, issue_s: float,
                       finish) -> tuple[list[float], str]:
    """Device time of eager steps, taken as the graph path takes it from its replays.

    Each of ``spec.steps`` more steps (the timed steps' queries, in order) is queued behind a spin
    kernel (``timing.hold_stream``) of 1.5x the longest time the host took to issue a timed step
    (``issue_s``), so the GPU starts the step only once all of it is queued, and the events
    around it bracket device work, not the host's pace. If the GPU reached the step's start event
    before the host had finished issuing it, the times are dropped and the reason returned
    instead. Returns ``(seconds per step, how they were taken)``.
    """
    from ...timing import HOLD_US, hold_stream

    device = q_static.device
    hold_us = HOLD_US + 1.5 * issue_s * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    say_on_rank_0(env, f"{label}: {spec.steps} more steps for the device time (each queued behind a spin kernel)")
    times: list[float] = []
    reason = None
    for s in range(spec.steps):
        q_next = make_query(spec, s).to(device)  # before the hold: a pageable copy would wait behind it
        barrier(env)
        torch.cuda.synchronize(device)
        if not hold_stream(device, hold_us):
            reason = DEVICE_TIME_NO_HOLD
        start.record()
        q_static.copy_(q_next)
        step()
        if start.query() and reason is None:  # the GPU began before the host had issued it all
            reason = DEVICE_TIME_HOST_BOUND
        end.record()
        finish(f"{label} device-time step {s + 1} of {spec.steps}", end)
        times.append(start.elapsed_time(end) * 1e-3)
    return ([], reason) if reason is not None else (times, DEVICE_TIME_HELD)


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
    # fp8 caches: max abs error of out against float64 on the unquantized cache (the quantization's
    # error; max_abs_err is against the dequantized cache the ranks attend over); None otherwise.
    max_abs_err_unquantized: float | None = None
    execution: str = "eager"  # "cuda graph" (the step replayed as one graph) or "eager"
    ranks_agree_note: str | None = None  # why ranks_agree may be false (ring), else None
    why_eager: str | None = None
    device_ms_median: float | None = None  # GPUs: CUDA-event time of a step (slowest rank), see device_time
    # GPUs: how device_ms_median was taken (events around graph replays, or around eager steps
    # queued behind a spin kernel), or why there is none; None on CPU ranks.
    device_time: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunResult:
    spec: dict
    device: str
    backend: str
    results: list[StrategyResult] = field(default_factory=list)
    speedup_vs_ring: float | None = None  # ring's median step over ``compared``'s
    compared: str | None = None  # the plan label compared with ring (the tree strategy's row)
    profile: ProfileChoice | None = None  # which profile the run used (commands.run.setup.ProfileChoice)
    # CPU ranks: which local attention ran ("C kernel: <library and flags>" or "torch ops: <why>");
    # None on GPUs (the Triton kernel or torch, per --impl).
    local_kernel: str | None = None

    def to_dict(self) -> dict:
        return {
            "config": self.spec,
            "device": self.device,
            "backend": self.backend,
            "local_kernel": self.local_kernel,
            "results": [r.to_dict() for r in self.results],
            "speedup_vs_ring": self.speedup_vs_ring,
            "compared": self.compared,
            "profile": self.profile.to_dict() if self.profile is not None else None,
        }


# Tokens of one shard the reference takes at a time (their float64 copy is what it holds beyond
# the shard itself): 8192 tokens of Llama-3.1-8B attention are 16 MiB of K and V in float64.
REFERENCE_CHUNK = 8192


def reference_last_step(spec: RunSpec, unquantized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The last step's attention over the whole cache, in float64 on CPU: the exact state of each
    chunk of :data:`REFERENCE_CHUNK` tokens of each shard in turn, merged in float64, so the parent
    holds one shard and the float64 copy of one chunk at a time (a rank holds its shard too).
    An fp8 cache: over the dequantized cache (the stored values times their scales, exactly), or
    with ``unquantized`` over the shards before quantization.
    Returns ``out [B, Hq, D]`` and ``lse [B, Hq]`` float64."""
    from ...kernels.reference import decode_attention_float64
    from ...reduce.state import merge_states

    q = make_query(spec, spec.steps - 1)
    out = torch.zeros(spec.batch, spec.q_heads, spec.head_dim, dtype=torch.float64)
    lse = torch.full((spec.batch, spec.q_heads), float("-inf"), dtype=torch.float64)
    for rank in range(spec.world_size):
        shard = KVShard(*make_shard(spec, rank)) if unquantized else make_kv_shard(spec, rank)
        k, v = shard.k, shard.v
        for start in range(0, k.shape[1], REFERENCE_CHUNK):
            chunk = slice(start, start + REFERENCE_CHUNK)
            o_r, l_r = decode_attention_float64(q, k[:, chunk], v[:, chunk], **shard.scales)
            out, lse = merge_states(torch.stack([out, o_r]), torch.stack([lse, l_r]), dtype=torch.float64)
        del k, v, shard
    return out, lse


def summarize(spec: RunSpec, per_rank: list[dict[str, RankReport]], device: str, backend: str) -> RunResult:
    """Combine the ranks' reports with the reference into the run's table rows."""
    ref_out, ref_lse = reference_last_step(spec)
    raw_out = reference_last_step(spec, unquantized=True)[0] if spec.fp8 else None
    rows: list[StrategyResult] = []
    for name, plan in spec.plans:
        label = plan.label if plan is not None else "ring"
        reps = [r[label] for r in per_rank]
        # A step takes as long as its slowest rank.
        step_s = [max(rep.step_s[i] for rep in reps) for i in range(spec.steps)]
        errs = [float((rep.out.double() - ref_out).abs().max()) if rep.out.numel() else 0.0 for rep in reps]
        lse_errs = [_lse_err(rep.lse, ref_lse) for rep in reps]
        raw_errs = None if raw_out is None else [float((rep.out.double() - raw_out).abs().max()) if rep.out.numel()
                                                 else 0.0 for rep in reps]
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
                max_abs_err_unquantized=None if raw_errs is None else max(raw_errs),
                ranks_agree_note=RING_ORDER_NOTE if name == "ring" and not agree else None,
                execution=first.execution,
                why_eager=first.why_eager,
                **device_summary(reps, spec.steps),
            )
        )
    result = RunResult(spec=_spec_dict(spec), device=device, backend=backend, results=rows)
    if spec.device_kind == "cpu" and spec.impl in ("auto", "torch"):
        from ...kernels.cpu_native import native_status  # the ranks' environment is this process's

        result.local_kernel = native_status().describe()
    # Tree vs ring, named: the tree row (else allreduce's), and only where something was sent.
    ring = [r for r in rows if r.strategy == "ring"]
    other = [r for r in rows if r.strategy == "tree"] or [r for r in rows if r.strategy == "allreduce"]
    if ring and other and spec.world_size > 1 and spec.seq_len > 0:
        result.speedup_vs_ring = ring[0].step_ms_median / other[0].step_ms_median
        result.compared = other[0].plan
    return result


def device_summary(reps: list[RankReport], steps: int) -> dict:
    """``device_ms_median`` (the median over steps of the slowest rank's device time) and
    ``device_time`` (how it was taken) of one row; None and the reason when a rank has no device
    times (then the first such rank's reason), both None on CPU ranks."""
    missing = [rep for rep in reps if not rep.device_step_s]
    if missing:
        return {"device_ms_median": None, "device_time": missing[0].device_time}
    slowest = [max(rep.device_step_s[i] for rep in reps) for i in range(steps)]
    return {"device_ms_median": 1e3 * statistics.median(slowest), "device_time": reps[0].device_time}


def _lse_err(lse: torch.Tensor, ref: torch.Tensor) -> float:
    both_inf = torch.isneginf(lse) & torch.isneginf(ref)
    if bool(both_inf.all()):
        return 0.0
    if bool((torch.isneginf(lse) != torch.isneginf(ref)).any()):
        return float("inf")
    return float((lse[~both_inf] - ref[~both_inf]).abs().max())


def _spec_dict(spec: RunSpec) -> dict:
    """The run's ``config`` in JSON: every setting, the strategies' plans and the shard sizes."""
    d = {
        "world_size": spec.world_size, "seq_len": spec.seq_len, "batch": spec.batch, "q_heads": spec.q_heads,
        "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "dtype": spec.dtype, "kv_dtype": spec.kv_dtype,
        "kv_bytes_per_rank": spec.kv_bytes_per_rank(), "steps": spec.steps,
        "warmup": spec.warmup, "device_kind": spec.device_kind, "backend": spec.backend, "impl": spec.impl,
        "kernel_config": spec.kernel_config.to_dict() if spec.kernel_config is not None else None,
        "seed": spec.seed, "timeout_s": spec.timeout_s, "cuda_graph": spec.cuda_graph, "nodes": spec.launch.nodes,
    }
    d["strategies"] = [{"strategy": n, "plan": p.to_dict() if p else None} for n, p in spec.plans]
    d["shard_sizes"] = spec.shard_sizes()
    return d


def run_decode(spec: RunSpec) -> RunResult | None:
    """Run the decode benchmark on the ranks of ``spec.launch`` (spawned, or this process as one
    rank of a torchrun job) and summarise it. Returns the result in the launching process (on rank
    0 under torchrun), None on the other torchrun ranks."""
    from ...launch.job import run_ranks

    job = run_ranks(decode_rank, spec.launch, args=(spec,))
    if job is None:
        return None
    return summarize(spec, job.values, job.device, spec.backend)
