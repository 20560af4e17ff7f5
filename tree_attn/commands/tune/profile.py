"""Build the profile ``tree-attn tune`` writes, for a :class:`~.setup.TuneSetup`.

:func:`build_profile` measures on this machine's ranks (:func:`measured_profile`, through the
timing functions of :mod:`.timing`) or, for a topology that is not this machine, derives the
profile from the plan cost model alone (:func:`model_profile`). Progress goes to an optional
callback (the CLI draws it); nothing here prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ...profiles import Profile
    from ...topology import Topology
    from .setup import TuneSetup
    from .timing import TuneOptions


@dataclass(frozen=True)
class TuneEvent:
    """One progress report: ``stage`` is ``kernels`` or ``plans``; ``kind`` is ``start``,
    ``detail`` (one finished step inside the stage) or ``done`` (``text`` says the outcome)."""

    stage: str
    kind: str
    text: str


ProgressFn = Callable[[TuneEvent], None]


def build_profile(setup: TuneSetup, progress: ProgressFn | None = None) -> Profile | None:
    """The profile of ``setup``: measured when this machine can time it, else model-derived
    (None on a torchrun job's ranks other than 0)."""
    if setup.measurable:
        return measured_profile(setup.topology, setup.options, progress)
    return model_profile(setup.topology, setup.options)


def write_profile(setup: TuneSetup, profile: Profile) -> str:
    """Save ``profile`` (atomically) where ``setup`` says; returns the path as given."""
    from ...profiles import save_profile

    save_profile(profile, setup.output, force=setup.force)
    return setup.output


def measured_profile(topo: Topology, options: TuneOptions, progress: ProgressFn | None = None) -> Profile | None:
    """Time the kernel configs (GPU ranks) and every candidate reduction plan on this machine (or
    across a torchrun job's nodes: None on its ranks other than 0)."""
    from ...cost.plan import decode_message_bytes
    from ...profiles import KernelSection, PlanCandidate, Reduction, current_versions
    from ...reduce.hier_plan import candidate_plans
    from .timing import tune_kernels_in_child, tune_plans

    def emit(stage: str, kind: str, text: str) -> None:
        if progress is not None:
            progress(TuneEvent(stage, kind, text))

    candidates = candidate_plans(options.world_size, topo.hierarchy)
    buckets = []
    if options.device_kind == "cuda" and options.tune_kernels:
        emit("kernels", "start", f"kernel configs: {len(options.shard_buckets)} shard buckets")
        # In a child process: this one makes no CUDA context on the GPU rank 0 uses next.
        buckets = tune_kernels_in_child(options, progress=lambda m: emit("kernels", "detail", m)).buckets
        emit("kernels", "done", f"kernel configs: {len(buckets)} buckets tuned")
    emit("plans", "start", f"reduction plans: timing {len(candidates)} candidates on {options.world_size} ranks")
    plans = tune_plans(options, candidates)
    if plans is None:  # a torchrun rank other than 0: rank 0 writes the profile
        return None
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
                           buckets=[kernel_bucket(b) for b in buckets])
    notes = [] if buckets else ["CPU ranks: no Triton kernel configs to tune (the CPU path has none)"]
    quick = " (--quick)" if options.quick else ""
    return _profile(topo, "tuned", "measured", reduction, kernel, current_versions(),
                    f"tuned on {options.world_size} x {topo.devices[0].name}{quick}", notes)


def _profile(topo: Topology, prefix: str, origin: str, reduction, kernel, versions, description: str,
             notes: list[str]) -> Profile:
    """The profile of ``topo`` (its machine and topology inside), named ``<prefix>-<fingerprint>``."""
    from ...profiles import Machine, Profile, utc_now

    return Profile(name=f"{prefix}-{topo.fingerprint}", created=utc_now(), origin=origin,
                   machine=Machine.from_topology(topo), reduction=reduction, kernel=kernel, versions=versions,
                   description=description, notes=notes, topology=topo)


def kernel_bucket(b):
    """A profile's bucket from a :class:`~.timing.BucketResult`. Where every timing of the bucket
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


def model_profile(topo: Topology, options: TuneOptions) -> Profile:
    """A profile derived from the topology and the plan cost model alone (nothing timed)."""
    from ...cost.plan import decode_lse_bytes, decode_message_bytes, predict_plan_us
    from ...profiles import KernelSection, PlanCandidate, Reduction, current_versions
    from ...reduce.hier_plan import candidate_plans

    msg = decode_message_bytes(options.batch, options.q_heads, options.head_dim)
    lse = decode_lse_bytes(options.batch, options.q_heads)  # the all-reduce form's lse, priced as simulate does
    cands = candidate_plans(len(topo), topo.hierarchy)
    predicted = [predict_plan_us(p, topo, msg, lse) for p in cands]
    best = min(range(len(cands)), key=lambda i: predicted[i])
    reduction = Reduction(
        plan=cands[best],
        chosen_by="model",
        message_bytes=msg,
        candidates=[PlanCandidate(label=p.label, plan=p, chosen_by="model", predicted_us=us, selected=i == best)
                    for i, (p, us) in enumerate(zip(cands, predicted))],
    )
    return _profile(topo, "model", "model", reduction, KernelSection(), current_versions(driver=None),
                    f"model-derived for {len(topo)} x {topo.devices[0].name} from {topo.source}",
                    [("not measured: derived from the topology and the plan cost model; tune on the machine itself "
                      "to measure")])


__all__ = ["TuneEvent", "build_profile", "kernel_bucket", "measured_profile", "model_profile", "write_profile"]
