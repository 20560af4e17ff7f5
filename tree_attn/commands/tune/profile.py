"""Resolve the options of ``tree-attn tune`` and build the profile it writes.

:func:`plan_tune` decides what is tuned (the topology: a file, CPU ranks, or this machine's GPUs;
the ranks' device kind and backend; the shapes) and where the profile goes, and refuses an
existing output file (without ``force``) before anything is timed. :func:`build_profile` then
measures on this machine's ranks (:func:`measured_profile`, through the timing functions of
:mod:`tree_attn.commands.tune.timing`) or, for a topology that is not this machine, derives the profile
from the plan cost model alone (:func:`model_profile`). Progress goes to an optional callback
(the CLI draws it); nothing here prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ...errors import ConfigError, ProfileError, TopologyError
from ...launch.spawn import check_cpu_ranks, check_timeout, oversubscription_warning
from ...topology.host import DEFAULT_CPU_RANKS

if TYPE_CHECKING:  # pragma: no cover
    from ...profiles import Profile
    from ...topology import Topology
    from .timing import TuneOptions


@dataclass(frozen=True)
class TuneRequest:
    """What the user asked ``tune`` for; ``None`` and ``"auto"`` mean "decide from the machine"."""

    topology_file: str | None = None
    world_size: int | None = None
    device: str = "auto"
    output: str | None = None
    force: bool = False
    quick: bool = False
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    backend: str = "auto"
    timeout_s: float = 120.0


@dataclass(frozen=True)
class TuneSetup:
    """A resolved tune: the topology, the timing options, whether this machine can time it, where
    the profile goes, and notices for the user."""

    topology: "Topology"
    options: "TuneOptions"
    measurable: bool
    output: str
    force: bool = False
    notices: tuple[str, ...] = ()
    model_reason: str | None = None  # why nothing can be timed here (when not measurable)


@dataclass(frozen=True)
class TuneEvent:
    """One progress report: ``stage`` is ``kernels`` or ``plans``; ``kind`` is ``start``,
    ``detail`` (one finished step inside the stage) or ``done`` (``text`` says the outcome)."""

    stage: str
    kind: str
    text: str


ProgressFn = Callable[[TuneEvent], None]


def _kind_of(topo: "Topology") -> str:
    from ...profiles.schema import device_kind_of

    return "cuda" if device_kind_of(topo) in ("cuda", "rocm") else "cpu"


def _topology(request: TuneRequest, device_kind: str, notices: list[str]) -> "Topology":
    from ...topology import host_topology, load_expected, probe_topology

    if request.topology_file:
        return load_expected(request.topology_file)
    if device_kind == "cpu":
        n = request.world_size if request.world_size is not None else DEFAULT_CPU_RANKS
        check_cpu_ranks(n)
        why = "no GPU" if request.device == "auto" else "--device cpu"
        notices.append(f"{why}: tuning for {n} CPU rank{'s' if n != 1 else ''} (gloo)")
        crowded = oversubscription_warning(n)
        if crowded and not request.topology_file:
            notices.append(crowded.replace("step times", "plan timings"))
        return host_topology(n)
    topo = probe_topology("auto")
    notices.extend(topo.notes)
    if topo.source == "host":
        raise TopologyError(
            "torch sees GPUs but their fabric could not be probed (NVML / AMD SMI unavailable, see the note above); "
            "install nvidia-ml-py (or amdsmi), give the fabric with --topology FILE, or tune CPU ranks with --device cpu"
        )
    return topo


def check_output_free(path: str, force: bool) -> None:
    """Refuse to tune into an existing file without ``force`` (before any timing, not after)."""
    if os.path.isdir(path):
        raise ProfileError(f"{path} is a folder; give a file name with --output FILE")
    if os.path.exists(path) and not force:
        raise ProfileError(f"{path} already exists; pass --force to overwrite it (or write elsewhere with --output FILE)")


def plan_tune(request: TuneRequest) -> TuneSetup:
    """Resolve ``request`` against this machine. Raises ConfigError for bad options, TopologyError
    for an unreadable topology, ProfileError when the output exists (without ``force``)."""
    from ...dtypes import parse_dtype
    from ...profiles import profile_path_for
    from ...launch.spawn import resolve_backend
    from ..run.setup import resolve_device_kind
    from .timing import TuneOptions

    check_timeout(request.timeout_s)
    for option, value in (("--batch", request.batch), ("--heads", request.heads), ("--kv-heads", request.kv_heads),
                          ("--head-dim", request.head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{option} must be an integer >= 1; got {value!r}")
    if request.heads % request.kv_heads:
        raise ConfigError(f"query heads ({request.heads}) must be a multiple of KV heads ({request.kv_heads})")
    dtype = parse_dtype(request.dtype)
    device_kind, n_gpus = resolve_device_kind(request.device)
    backend = resolve_backend(request.backend, device_kind)
    notices: list[str] = []
    topo = _topology(request, device_kind, notices)
    world = len(topo)
    if request.world_size is not None and request.world_size != world:
        raise ConfigError(f"--world-size {request.world_size} does not match the topology's {world} devices")
    output = request.output or str(profile_path_for(topo.fingerprint))
    check_output_free(output, request.force)

    local_kind = _kind_of(topo)
    reason = None
    if local_kind != device_kind:
        reason = f"its devices are {'GPUs' if local_kind == 'cuda' else 'CPU ranks'}, the ranks here would be " \
                 f"{'GPUs' if device_kind == 'cuda' else 'CPU ranks'}"
    elif device_kind == "cuda" and world > n_gpus:
        reason = f"it has {world} GPUs, torch sees {n_gpus} here"
    if reason is not None:
        notices.append(f"the topology ({world} x {topo.devices[0].name}) is not this machine ({reason}): nothing can "
                       "be timed here, so the profile is model-derived (origin: model)")
    if reason is None and device_kind == "cpu":  # the plans' messages, before any rank allocates them
        from ..run.setup import check_host_memory

        check_host_memory(world, 0, request.batch, request.kv_heads, request.head_dim, dtype, False,
                          request.heads)
    options = TuneOptions(
        world_size=world,
        device_kind=device_kind,
        backend=backend,
        batch=request.batch,
        q_heads=request.heads,
        kv_heads=request.kv_heads,
        head_dim=request.head_dim,
        dtype=dtype,
        quick=request.quick,
        timeout_s=request.timeout_s,
    )
    return TuneSetup(topology=topo, options=options, measurable=reason is None, output=output,
                     force=request.force, notices=tuple(notices), model_reason=reason)


def build_profile(setup: TuneSetup, progress: ProgressFn | None = None) -> "Profile":
    """The profile of ``setup``: measured when this machine can time it, else model-derived."""
    if setup.measurable:
        return measured_profile(setup.topology, setup.options, progress)
    return model_profile(setup.topology, setup.options)


def write_profile(setup: TuneSetup, profile: "Profile") -> str:
    """Save ``profile`` (atomically) where ``setup`` says; returns the path as given."""
    from ...profiles import save_profile

    save_profile(profile, setup.output, force=setup.force)
    return setup.output


def measured_profile(topo: "Topology", options: "TuneOptions", progress: ProgressFn | None = None) -> "Profile":
    """Time the kernel configs (GPU ranks) and every candidate reduction plan on this machine."""
    from ...profiles import KernelSection, Machine, PlanCandidate, Profile, Reduction, current_versions, utc_now
    from ...profiles.plan_model import decode_message_bytes
    from ...reduce.hier_plan import candidate_plans
    from .timing import tune_kernels_in_child, tune_plans

    def emit(stage: str, kind: str, text: str) -> None:
        if progress is not None:
            progress(TuneEvent(stage, kind, text))

    candidates = candidate_plans(options.world_size, topo.hierarchy)
    buckets = []
    if options.device_kind == "cuda":
        emit("kernels", "start", f"kernel configs: {len(options.shard_buckets)} shard buckets")
        # In a child process: this one makes no CUDA context on the GPU rank 0 uses next.
        buckets = tune_kernels_in_child(options, progress=lambda m: emit("kernels", "detail", m)).buckets
        emit("kernels", "done", f"kernel configs: {len(buckets)} buckets tuned")
    emit("plans", "start", f"reduction plans: timing {len(candidates)} candidates on {options.world_size} ranks")
    plans = tune_plans(options, candidates)
    emit("plans", "done", f"reduction plans: {plans.chosen.label} chosen")
    reduction = Reduction(
        plan=plans.chosen,
        chosen_by="measured",
        message_bytes=decode_message_bytes(options.batch, options.q_heads, options.head_dim),
        candidates=[
            PlanCandidate(label=t.plan.label, plan=t.plan, chosen_by="measured", median_us=t.median_us,
                          p95_us=t.p95_us, selected=t.plan == plans.chosen, timing=t.method)
            for t in plans.timings
        ],
    )
    kernel = KernelSection(device_spec=topo.devices[0].name if buckets else None,
                           buckets=[_kernel_bucket(b) for b in buckets])
    notes = [] if buckets else ["CPU ranks: no Triton kernel configs to tune (the CPU path has none)"]
    return Profile(
        name=f"tuned-{topo.fingerprint}",
        created=utc_now(),
        origin="measured",
        machine=Machine.from_topology(topo),
        reduction=reduction,
        kernel=kernel,
        versions=current_versions(),
        description=f"tuned on {options.world_size} x {topo.devices[0].name}" + (" (--quick)" if options.quick else ""),
        notes=notes,
        topology=topo,
    )


def _kernel_bucket(b):
    """A profile's bucket from a ``commands.tune.timing.BucketResult``. Where every timing of the bucket
    measured the host rather than the kernel, tune_kernels keeps the model's choice
    (``chosen_by == "model"``), and the profile records no time for it."""
    from ...profiles import KernelBucket

    measured = b.chosen_by == "measured"
    t = b.chosen
    return KernelBucket(dtype=b.dtype, head_dim=b.head_dim, group=b.group, max_shard_len=b.max_shard_len,
                        config=t.config, chosen_by=b.chosen_by,
                        time_us=t.median_us if measured else None, gbps=t.gbps if measured else None,
                        predicted_us=t.predicted_us, candidates_tried=len(b.timings),
                        copy_fraction=t.copy_fraction if measured else None, host_us=t.host_us,
                        timing=t.method if measured else None)


def model_profile(topo: "Topology", options: "TuneOptions") -> "Profile":
    """A profile derived from the topology and the plan cost model alone (nothing timed)."""
    from ...profiles import KernelSection, Machine, PlanCandidate, Profile, Reduction, current_versions, utc_now
    from ...profiles.plan_model import decode_message_bytes, predict_plan_us
    from ...reduce.hier_plan import candidate_plans

    msg = decode_message_bytes(options.batch, options.q_heads, options.head_dim)
    cands = candidate_plans(len(topo), topo.hierarchy)
    predicted = [predict_plan_us(p, topo, msg) for p in cands]
    best = min(range(len(cands)), key=lambda i: predicted[i])
    reduction = Reduction(
        plan=cands[best],
        chosen_by="model",
        message_bytes=msg,
        candidates=[PlanCandidate(label=p.label, plan=p, chosen_by="model", predicted_us=us, selected=i == best)
                    for i, (p, us) in enumerate(zip(cands, predicted))],
    )
    return Profile(
        name=f"model-{topo.fingerprint}",
        created=utc_now(),
        origin="model",
        machine=Machine.from_topology(topo),
        reduction=reduction,
        kernel=KernelSection(),
        versions=current_versions(driver=None),
        description=f"model-derived for {len(topo)} x {topo.devices[0].name} from {topo.source}",
        notes=["not measured: derived from the topology and the plan cost model; tune on the machine itself to measure"],
        topology=topo,
    )


__all__ = [
    "TuneRequest", "TuneSetup", "TuneEvent", "plan_tune", "build_profile", "write_profile", "check_output_free",
    "measured_profile", "model_profile",
]
