"""The profile schema: what ``tree-attn tune`` writes and ``tree-attn run`` reads.

A profile records, for one machine (identified by its topology fingerprint), the kernel launch
config per shape bucket and the reduction plan, and for every value *how it was chosen*:
``measured`` (timed on this machine), ``model`` (the napkin model's pick, not timed) or
``default`` (the built-in heuristic, neither modelled nor timed). The layout, in file order::

    schema_version: 1
    name: h100-8x-nvswitch
    origin: measured | model | builtin-model
    created: '2025-01-01T00:00:00Z'        # ISO 8601, UTC
    description: ...                        # optional, free text
    versions: {tree_attn, torch, triton, driver}            # strings or null
    machine: {device_kind, device_name, world_size, fingerprint, source,
              hierarchy: ['nvlink:[0-7]'], link_classes: {nvlink: 28}, p2p: {ok: 28}}
    kernel:
      device_spec: h100-sxm                 # the perf-model device the configs were ranked for
      buckets:                              # one per (dtype, head_dim, group, max_shard_len)
      - {dtype, head_dim, group, max_shard_len, config: {DecodeConfig fields},
         chosen_by, time_us, gbps, predicted_us, candidates_tried}
    reduction:
      plan: {ReductionPlan fields}
      chosen_by: measured | model | default
      message_bytes: 16512                  # the decode message the candidates were priced at
      candidates:                           # every plan tried, the chosen one selected: true
      - {label, plan, chosen_by, median_us, p95_us, predicted_us, selected}
    notes: [...]
    topology: {Topology.to_dict()} | null   # the full fabric the profile was made for

Nothing here imports torch: profiles are read by ``tree-attn profiles`` and by rank launchers
before any GPU library is loaded.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import InitVar, dataclass, field
from typing import Any, Mapping

from .. import dtypes as _dtypes
from ..errors import ConfigError, TopologyError
from ..kernels.config import DecodeConfig
from ..reduce.plan import STRATEGIES, ReductionPlan
from ..topology.model import LinkKind, P2PStatus, Topology, format_ranges
from ..validate import (
    FieldError,
    as_float,
    check_bool,
    check_int,
    check_list,
    check_mapping,
    check_number,
    check_str,
    check_str_list,
    join,
)

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
ORIGINS = ("measured", "model", "builtin-model")
CHOSEN_BY = ("measured", "model", "default")
# A plan candidate's latency is either timed or predicted; "default" does not apply to a number.
CANDIDATE_CHOSEN_BY = ("measured", "model")
DEVICE_KINDS = ("cpu", "cuda", "rocm")
# How a measured time was taken (tree_attn.timing).
TIMING_METHODS = ("cuda-graph", "cuda-events", "host-clock")
DTYPES = _dtypes.NAMES
_FINGERPRINT_RE = re.compile(r"^[0-9a-f]{16}$")
_VENDOR_KIND = {"nvidia": "cuda", "amd": "rocm", "cpu": "cpu"}


def normalize_dtype(dtype: Any, path: str = "dtype") -> str:
    """Canonical dtype name (``float16``, ``bfloat16``, ``float32``) of a torch dtype or a name
    such as ``bf16``; anything else raises a ProfileError naming ``path``."""
    name = _dtypes.canonical(dtype)
    if name is None:
        raise FieldError(path, f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return name


def normalize_created(value: Any, path: str = "created") -> str:
    """``created`` as ``YYYY-MM-DDTHH:MM:SSZ``. Accepts an ISO 8601 string with a UTC offset of
    zero (``Z`` or ``+00:00``) or a datetime (YAML turns an unquoted timestamp into one)."""
    if isinstance(value, _dt.datetime):
        stamp = value
    elif isinstance(value, str):
        try:
            stamp = _dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise FieldError(path, f"expected an ISO 8601 UTC time such as '2025-01-31T12:00:00Z', got {value!r}") from None
    else:
        raise FieldError(path, f"expected an ISO 8601 UTC time string, got {type(value).__name__} {value!r}")
    if stamp.tzinfo is None:
        # PyYAML returns naive datetimes already converted to UTC; an offset-less string is ambiguous.
        if isinstance(value, str):
            raise FieldError(path, f"expected a UTC time ending in 'Z', got {value!r} (no time zone)")
        stamp = stamp.replace(tzinfo=_dt.timezone.utc)
    if stamp.utcoffset() != _dt.timedelta(0):
        raise FieldError(path, f"expected a UTC time (offset Z or +00:00), got {value!r}")
    return stamp.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_now() -> str:
    """The current time as a profile ``created`` value (UTC, whole seconds)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- plans and kernel configs (existing dataclasses, validated here with field paths) ------------


def plan_from_dict(data: Any, where: str) -> ReductionPlan:
    """A ReductionPlan from its ``to_dict`` form, with errors naming ``where.<field>``."""
    d = check_mapping(data, where, required=("strategy",), optional=("fanout", "rank_order", "parents", "label"))
    check_str(d["strategy"], join(where, "strategy"), choices=STRATEGIES)
    if "fanout" in d:
        check_int(d["fanout"], join(where, "fanout"), minimum=2)
    for key in ("rank_order", "parents"):
        if d.get(key) is not None:
            items = check_list(d[key], join(where, key))
            for i, r in enumerate(items):
                check_int(r, f"{join(where, key)}[{i}]", minimum=-1 if key == "parents" else 0)
    if "label" in d:
        check_str(d["label"], join(where, "label"))
    try:
        return ReductionPlan.from_dict(dict(d))
    except ConfigError as exc:
        raise FieldError(where, str(exc)) from None


def _check_plan(plan: Any, where: str, world_size: int | None) -> None:
    if not isinstance(plan, ReductionPlan):
        raise FieldError(where, f"expected a ReductionPlan, got {type(plan).__name__}")
    if world_size is not None:
        try:
            plan.check(world_size)
        except ConfigError as exc:
            raise FieldError(where, f"{exc} (the machine has {world_size} ranks)") from None


def config_from_dict(data: Any, where: str) -> DecodeConfig:
    """A DecodeConfig from a mapping, with errors naming ``where.<field>``."""
    d = check_mapping(data, where, optional=("block_n", "num_warps", "num_stages", "num_splits", "waves_per_eu"))
    for key, value in d.items():
        check_int(value, join(where, key), optional=key in ("num_splits", "waves_per_eu"))
    try:
        return DecodeConfig.from_dict(dict(d))
    except ConfigError as exc:
        # DecodeConfig names its field as "DecodeConfig.<name>"; translate to the profile's path.
        msg = str(exc)
        m = re.match(r"DecodeConfig\.(\w+) (.*)", msg)
        if m:
            raise FieldError(join(where, m.group(1)), m.group(2)) from None
        raise FieldError(where, msg) from None


# -- sections ----------------------------------------------------------------------------------


@dataclass
class Versions:
    """Software the profile was made with (strings, or null when unknown / not installed).

    A profile made under other versions still applies (the fabric did not change), with a warning:
    a new driver or Triton can move the kernel's best config.
    """

    tree_attn: str | None = None
    torch: str | None = None
    triton: str | None = None
    driver: str | None = None
    where: InitVar[str] = "versions"

    FIELDS = ("tree_attn", "torch", "triton", "driver")

    def __post_init__(self, where: str) -> None:
        for name in self.FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise FieldError(join(where, name), f"expected a version string or null (quote numbers such as '2.5'), got {value!r}")

    def to_dict(self) -> dict[str, str | None]:
        return {k: getattr(self, k) for k in self.FIELDS}

    @classmethod
    def from_dict(cls, data: Any, where: str = "versions") -> "Versions":
        d = check_mapping(data, where, optional=cls.FIELDS)
        return cls(**{k: d.get(k) for k in cls.FIELDS}, where=where)


@dataclass
class Machine:
    """What identifies the machine a profile is for, plus a short human summary of its fabric.

    ``device_kind``: ``cpu`` (CPU ranks over gloo), ``cuda`` or ``rocm``. ``device_name``: the
    device model as the driver names it (``"A + B"`` for a mixed box). ``world_size``: ranks (one
    per GPU). ``fingerprint``: :attr:`Topology.fingerprint`. ``hierarchy``: one text per level,
    fastest first, e.g. ``"pix:[0-1] [2-3]"``. ``link_classes`` / ``p2p``: pair counts per link
    class / peer-to-peer status. ``source``: where the topology came from (``nvml``, ``dump:...``).
    """

    device_kind: str
    device_name: str
    world_size: int
    fingerprint: str
    source: str = "unknown"
    hierarchy: list[str] = field(default_factory=list)
    link_classes: dict[str, int] = field(default_factory=dict)
    p2p: dict[str, int] = field(default_factory=dict)
    where: InitVar[str] = "machine"

    FIELDS = ("device_kind", "device_name", "world_size", "fingerprint", "source", "hierarchy", "link_classes", "p2p")

    def __post_init__(self, where: str) -> None:
        check_str(self.device_kind, join(where, "device_kind"), choices=DEVICE_KINDS)
        check_str(self.device_name, join(where, "device_name"))
        check_int(self.world_size, join(where, "world_size"), minimum=1)
        check_str(self.fingerprint, join(where, "fingerprint"))
        if not _FINGERPRINT_RE.match(self.fingerprint):
            raise FieldError(join(where, "fingerprint"), f"expected 16 lowercase hex digits (Topology.fingerprint), got {self.fingerprint!r}")
        check_str(self.source, join(where, "source"))
        check_str_list(self.hierarchy, join(where, "hierarchy"))
        kinds = [k.value for k in LinkKind]
        for name, allowed in (("link_classes", kinds), ("p2p", [s.value for s in P2PStatus])):
            counts = getattr(self, name)
            path = join(where, name)
            if not isinstance(counts, dict):
                raise FieldError(path, f"expected a mapping of counts, got {type(counts).__name__} {counts!r}")
            for key, n in counts.items():
                if key not in allowed:
                    raise FieldError(join(path, str(key)), f"unknown key; expected one of {', '.join(allowed)}")
                check_int(n, join(path, key), minimum=0)
            pairs = self.world_size * (self.world_size - 1) // 2
            if counts and sum(counts.values()) != pairs:
                raise FieldError(path, f"counts add up to {sum(counts.values())} pairs, but {self.world_size} devices have {pairs}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_kind": self.device_kind,
            "device_name": self.device_name,
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "source": self.source,
            "hierarchy": list(self.hierarchy),
            "link_classes": dict(self.link_classes),
            "p2p": dict(self.p2p),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "machine") -> "Machine":
        d = check_mapping(data, where, required=("device_kind", "device_name", "world_size", "fingerprint"), optional=cls.FIELDS)
        values = {k: d[k] for k in cls.FIELDS if k in d}
        for key in ("hierarchy",):
            if key in values and values[key] is None:
                values[key] = []
        for key in ("link_classes", "p2p"):
            if key in values and values[key] is None:
                values[key] = {}
        return cls(**values, where=where)

    @classmethod
    def from_topology(cls, topology: Topology) -> "Machine":
        """The machine section describing ``topology``."""
        return cls(
            device_kind=device_kind_of(topology),
            device_name=device_name_of(topology),
            world_size=len(topology),
            fingerprint=topology.fingerprint,
            source=topology.source,
            hierarchy=hierarchy_text(topology),
            link_classes=_count_ordered([l.kind.value for l in topology.links], [k.value for k in LinkKind]),
            p2p=_count_ordered([l.p2p.value for l in topology.links], [s.value for s in P2PStatus]),
        )


def _count_ordered(values: list[str], order: list[str]) -> dict[str, int]:
    counts = {k: values.count(k) for k in order}
    return {k: n for k, n in counts.items() if n}


def device_kind_of(topology: Topology) -> str:
    """``cpu``, ``cuda`` or ``rocm`` from the devices' vendor."""
    vendors = sorted({d.vendor for d in topology.devices})
    kinds = {_VENDOR_KIND.get(v) for v in vendors}
    if len(kinds) != 1 or None in kinds:
        raise FieldError(
            "machine.device_kind",
            f"cannot tell the device kind of a topology whose devices have vendor(s) {', '.join(vendors)}; "
            "probe the machine (`tree-attn probe`) or give a dump with device names",
        )
    return kinds.pop()  # type: ignore[return-value]


def device_name_of(topology: Topology) -> str:
    """The device model: the one name, or ``"A + B"`` (sorted, distinct) for a mixed box."""
    names = sorted({d.name for d in topology.devices})
    return " + ".join(names)


def hierarchy_text(topology: Topology) -> list[str]:
    """``["pix:[0-1] [2-3]", "sys:[0-3]"]``: each level's link class and its groups."""
    return [f"{h.kind}:" + " ".join(f"[{format_ranges(g)}]" for g in h.groups) for h in topology.hierarchy]


@dataclass
class KernelBucket:
    """The kernel config for one shape bucket.

    A bucket covers calls with this ``dtype``, ``head_dim`` and ``group`` (Hq / Hkv) and a per-rank
    KV shard of at most ``max_shard_len`` positions (a power of two). ``time_us`` / ``gbps``: the
    measured median device time of one launch at ``max_shard_len`` and the KV bandwidth it reached
    (null when not measured); ``copy_fraction``: ``gbps`` over the device-to-device copy bandwidth
    measured on the same card (the practical ceiling of a streaming kernel); ``host_us``: the host
    time to issue one launch; ``timing``: how ``time_us`` was taken (``cuda-graph``: CUDA events
    around graph replays of back-to-back launches over rotated buffers; ``cuda-events``: the same
    around eager launches; ``host-clock``: CPU); ``predicted_us``: the napkin model's estimate;
    ``candidates_tried``: how many configs were considered (ranked by the model, timed when
    ``chosen_by`` is measured).
    """

    dtype: str
    head_dim: int
    group: int
    max_shard_len: int
    config: DecodeConfig
    chosen_by: str
    time_us: float | None = None
    gbps: float | None = None
    predicted_us: float | None = None
    candidates_tried: int | None = None
    copy_fraction: float | None = None
    host_us: float | None = None
    timing: str | None = None
    where: InitVar[str] = "kernel.buckets[]"

    FIELDS = ("dtype", "head_dim", "group", "max_shard_len", "config", "chosen_by", "time_us", "gbps", "predicted_us",
              "candidates_tried", "copy_fraction", "host_us", "timing")

    def __post_init__(self, where: str) -> None:
        self.dtype = normalize_dtype(self.dtype, join(where, "dtype"))
        check_int(self.head_dim, join(where, "head_dim"), minimum=1, maximum=1024)
        check_int(self.group, join(where, "group"), minimum=1)
        check_int(self.max_shard_len, join(where, "max_shard_len"), minimum=1)
        if self.max_shard_len & (self.max_shard_len - 1):
            raise FieldError(join(where, "max_shard_len"), f"expected a power of two, got {self.max_shard_len}")
        if not isinstance(self.config, DecodeConfig):
            raise FieldError(join(where, "config"), f"expected a DecodeConfig, got {type(self.config).__name__}")
        check_str(self.chosen_by, join(where, "chosen_by"), choices=CHOSEN_BY)
        for name in ("time_us", "gbps", "predicted_us", "copy_fraction", "host_us"):
            check_number(getattr(self, name), join(where, name), optional=True)
            setattr(self, name, as_float(getattr(self, name)))
        check_int(self.candidates_tried, join(where, "candidates_tried"), minimum=0, optional=True)
        check_str(self.timing, join(where, "timing"), choices=TIMING_METHODS, optional=True)
        if self.chosen_by == "measured" and self.time_us is None:
            raise FieldError(join(where, "time_us"), "chosen_by is 'measured' but no measured time is given")
        if self.chosen_by != "measured" and (self.time_us is not None or self.gbps is not None):
            raise FieldError(join(where, "chosen_by"), f"a measured time_us/gbps is given but chosen_by is {self.chosen_by!r}; use 'measured'")

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.dtype, self.head_dim, self.group, self.max_shard_len)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "head_dim": self.head_dim,
            "group": self.group,
            "max_shard_len": self.max_shard_len,
            "config": self.config.to_dict(),
            "chosen_by": self.chosen_by,
            "time_us": self.time_us,
            "gbps": self.gbps,
            "predicted_us": self.predicted_us,
            "candidates_tried": self.candidates_tried,
            "copy_fraction": self.copy_fraction,
            "host_us": self.host_us,
            "timing": self.timing,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "KernelBucket":
        d = check_mapping(data, where, required=("dtype", "head_dim", "group", "max_shard_len", "config", "chosen_by"), optional=cls.FIELDS)
        values = {k: d[k] for k in cls.FIELDS if k in d}
        values["config"] = config_from_dict(d["config"], join(where, "config"))
        return cls(**values, where=where)


@dataclass
class KernelSection:
    """Kernel configs per shape bucket; ``device_spec`` names the perf-model device spec
    (``tree_attn.kernels.perf_model.KNOWN_DEVICES`` key or a spec name) they were ranked for.
    An empty bucket list means the launch heuristic decides every shape (CPU ranks run the torch
    reference, where no config applies)."""

    device_spec: str | None = None
    buckets: list[KernelBucket] = field(default_factory=list)
    where: InitVar[str] = "kernel"

    def __post_init__(self, where: str) -> None:
        check_str(self.device_spec, join(where, "device_spec"), optional=True)
        check_list(self.buckets, join(where, "buckets"))
        seen: dict[tuple, int] = {}
        for i, b in enumerate(self.buckets):
            path = f"{join(where, 'buckets')}[{i}]"
            if not isinstance(b, KernelBucket):
                raise FieldError(path, f"expected a KernelBucket, got {type(b).__name__}")
            if b.key in seen:
                raise FieldError(path, f"duplicate bucket {b.key} (same as buckets[{seen[b.key]}])")
            seen[b.key] = i

    def to_dict(self) -> dict[str, Any]:
        return {"device_spec": self.device_spec, "buckets": [b.to_dict() for b in self.buckets]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "kernel") -> "KernelSection":
        d = check_mapping(data, where, optional=("device_spec", "buckets"))
        buckets = check_list(d.get("buckets") if d.get("buckets") is not None else [], join(where, "buckets"))
        return cls(
            device_spec=d.get("device_spec"),
            buckets=[KernelBucket.from_dict(b, f"{join(where, 'buckets')}[{i}]") for i, b in enumerate(buckets)],
            where=where,
        )


@dataclass
class PlanCandidate:
    """One reduction plan that was tried, with its latency for one all-ranks merge.

    ``chosen_by`` says where the numbers come from: ``measured`` (``median_us`` and ``p95_us``
    timed across all ranks at the decode message size) or ``model`` (``predicted_us`` only).
    ``selected`` marks the winner (exactly one candidate, equal to ``reduction.plan``).
    """

    label: str
    plan: ReductionPlan
    chosen_by: str
    median_us: float | None = None
    p95_us: float | None = None
    predicted_us: float | None = None
    selected: bool = False
    timing: str | None = None
    where: InitVar[str] = "reduction.candidates[]"

    FIELDS = ("label", "plan", "chosen_by", "median_us", "p95_us", "predicted_us", "selected", "timing")

    def __post_init__(self, where: str) -> None:
        check_str(self.label, join(where, "label"))
        _check_plan(self.plan, join(where, "plan"), None)
        check_str(self.chosen_by, join(where, "chosen_by"), choices=CANDIDATE_CHOSEN_BY)
        for name in ("median_us", "p95_us", "predicted_us"):
            check_number(getattr(self, name), join(where, name), optional=True)
            setattr(self, name, as_float(getattr(self, name)))
        check_bool(self.selected, join(where, "selected"))
        check_str(self.timing, join(where, "timing"), choices=TIMING_METHODS, optional=True)
        if self.chosen_by == "measured" and self.median_us is None:
            raise FieldError(join(where, "median_us"), "chosen_by is 'measured' but no measured median is given")
        if self.chosen_by == "model" and self.predicted_us is None:
            raise FieldError(join(where, "predicted_us"), "chosen_by is 'model' but no predicted time is given")
        if self.median_us is not None and self.p95_us is not None and self.p95_us < self.median_us:
            raise FieldError(join(where, "p95_us"), f"the 95th percentile ({self.p95_us}) is below the median ({self.median_us})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "plan": self.plan.to_dict(),
            "chosen_by": self.chosen_by,
            "median_us": self.median_us,
            "p95_us": self.p95_us,
            "predicted_us": self.predicted_us,
            "selected": self.selected,
            "timing": self.timing,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "PlanCandidate":
        d = check_mapping(data, where, required=("label", "plan", "chosen_by"), optional=cls.FIELDS)
        values = {k: d[k] for k in cls.FIELDS if k in d}
        values["plan"] = plan_from_dict(d["plan"], join(where, "plan"))
        return cls(**values, where=where)


@dataclass
class Reduction:
    """The reduction plan ``run`` uses, how it was chosen, and every candidate tried.

    ``message_bytes``: the size of one rank's packed partial state (float32 ``[B, Hq, D + 1]``)
    the candidates were timed or priced at.
    """

    plan: ReductionPlan
    chosen_by: str
    message_bytes: int | None = None
    candidates: list[PlanCandidate] = field(default_factory=list)
    where: InitVar[str] = "reduction"

    def __post_init__(self, where: str) -> None:
        _check_plan(self.plan, join(where, "plan"), None)
        check_str(self.chosen_by, join(where, "chosen_by"), choices=CHOSEN_BY)
        check_int(self.message_bytes, join(where, "message_bytes"), minimum=1, optional=True)
        check_list(self.candidates, join(where, "candidates"))
        selected = []
        for i, c in enumerate(self.candidates):
            path = f"{join(where, 'candidates')}[{i}]"
            if not isinstance(c, PlanCandidate):
                raise FieldError(path, f"expected a PlanCandidate, got {type(c).__name__}")
            if c.selected:
                selected.append(i)
        if self.candidates:
            if len(selected) != 1:
                raise FieldError(join(where, "candidates"), f"exactly one candidate must have selected: true, got {len(selected)}")
            winner = self.candidates[selected[0]]
            if winner.plan != self.plan:
                raise FieldError(
                    f"{join(where, 'candidates')}[{selected[0]}].plan",
                    f"the selected candidate {winner.plan.to_dict()} differs from {join(where, 'plan')} {self.plan.to_dict()}",
                )
            if self.chosen_by == "measured" and winner.chosen_by != "measured":
                raise FieldError(join(where, "chosen_by"), "is 'measured' but the selected candidate was not measured")

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "chosen_by": self.chosen_by,
            "message_bytes": self.message_bytes,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "reduction") -> "Reduction":
        d = check_mapping(data, where, required=("plan", "chosen_by"), optional=("plan", "chosen_by", "message_bytes", "candidates"))
        cands = check_list(d.get("candidates") if d.get("candidates") is not None else [], join(where, "candidates"))
        return cls(
            plan=plan_from_dict(d["plan"], join(where, "plan")),
            chosen_by=d["chosen_by"],
            message_bytes=d.get("message_bytes"),
            candidates=[PlanCandidate.from_dict(c, f"{join(where, 'candidates')}[{i}]") for i, c in enumerate(cands)],
            where=where,
        )


_TOP_FIELDS = (
    "schema_version", "name", "origin", "created", "description", "versions", "machine", "kernel",
    "reduction", "notes", "topology",
)


@dataclass
class Profile:
    """A tuned (or model-derived) profile for one machine. See the module docstring for the layout.

    ``origin``: ``measured`` (``tune`` timed things on the machine), ``model`` (``tune`` without
    timing, e.g. from a topology file) or ``builtin-model`` (shipped with tree-attn, derived from
    recorded topology dumps and the perf model). ``topology``: the full fabric, when known; its
    fingerprint and size must agree with ``machine``.
    """

    name: str
    created: str
    origin: str
    machine: Machine
    reduction: Reduction
    kernel: KernelSection = field(default_factory=KernelSection)
    versions: Versions = field(default_factory=Versions)
    description: str | None = None
    notes: list[str] = field(default_factory=list)
    topology: Topology | None = None
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_int(self.schema_version, "schema_version")
        if self.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
            raise FieldError(
                "schema_version",
                f"this tree-attn reads profile schema {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}, got {self.schema_version}; "
                "re-tune with this version (`tree-attn tune --force`)",
            )
        check_str(self.name, "name")
        self.created = normalize_created(self.created)
        check_str(self.origin, "origin", choices=ORIGINS)
        check_str(self.description, "description", optional=True, nonempty=False)
        check_str_list(self.notes, "notes")
        for name, cls in (("machine", Machine), ("reduction", Reduction), ("kernel", KernelSection), ("versions", Versions)):
            if not isinstance(getattr(self, name), cls):
                raise FieldError(name, f"expected a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        n = self.machine.world_size
        _check_plan(self.reduction.plan, "reduction.plan", n)
        for i, c in enumerate(self.reduction.candidates):
            _check_plan(c.plan, f"reduction.candidates[{i}].plan", n)
        if self.origin != "measured":
            # A model-derived profile cannot claim measured values: say how each was really chosen.
            if self.reduction.chosen_by == "measured":
                raise FieldError("reduction.chosen_by", f"is 'measured' in a profile of origin {self.origin!r}")
            for i, b in enumerate(self.kernel.buckets):
                if b.chosen_by == "measured":
                    raise FieldError(f"kernel.buckets[{i}].chosen_by", f"is 'measured' in a profile of origin {self.origin!r}")
        if self.topology is not None:
            if not isinstance(self.topology, Topology):
                raise FieldError("topology", f"expected a Topology, got {type(self.topology).__name__}")
            if len(self.topology) != n:
                raise FieldError("machine.world_size", f"is {n} but the topology has {len(self.topology)} devices")
            if self.topology.fingerprint != self.machine.fingerprint:
                raise FieldError(
                    "machine.fingerprint",
                    f"{self.machine.fingerprint!r} does not match the topology's fingerprint {self.topology.fingerprint!r}",
                )

    # -- lookups ----------------------------------------------------------------------------
    @property
    def plan(self) -> ReductionPlan:
        """The reduction plan ``run`` should use."""
        return self.reduction.plan

    def kernel_config_for(self, dtype: Any, head_dim: int, group: int, shard_len: int) -> tuple[DecodeConfig, str] | None:
        """The config for a call with this dtype, head dim, GQA group and per-rank shard length,
        with how it was chosen; ``None`` if no bucket has this dtype, head dim and group.

        Among the matching buckets: the smallest ``max_shard_len >= shard_len``, else the largest
        (a shard longer than every bucket behaves like the longest one: bandwidth-bound).
        """
        dt = normalize_dtype(dtype)
        matching = [b for b in self.kernel.buckets if b.dtype == dt and b.head_dim == head_dim and b.group == group]
        if not matching:
            return None
        fits = [b for b in matching if b.max_shard_len >= shard_len]
        best = min(fits, key=lambda b: b.max_shard_len) if fits else max(matching, key=lambda b: b.max_shard_len)
        return best.config, best.chosen_by

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data in the stable file order."""
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "origin": self.origin,
            "created": self.created,
            "description": self.description,
            "versions": self.versions.to_dict(),
            "machine": self.machine.to_dict(),
            "kernel": self.kernel.to_dict(),
            "reduction": self.reduction.to_dict(),
            "notes": list(self.notes),
            "topology": self.topology.to_dict() if self.topology is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Any) -> "Profile":
        """Validate and build from loaded YAML/JSON; every error names the dotted field path."""
        check_mapping(data, "", optional=set(data) if isinstance(data, Mapping) else ())
        # The version first: a newer schema may legitimately have keys this one does not know.
        if "schema_version" not in data:
            raise FieldError("schema_version", "required key is missing (is this a tree-attn profile?)")
        check_int(data["schema_version"], "schema_version")
        if data["schema_version"] not in SUPPORTED_SCHEMA_VERSIONS:
            raise FieldError(
                "schema_version",
                f"this tree-attn reads profile schema {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}, got {data['schema_version']}; "
                "re-tune with this version (`tree-attn tune --force`)",
            )
        d = check_mapping(data, "", required=("schema_version", "name", "origin", "created", "machine", "reduction"), optional=_TOP_FIELDS)
        topology = None
        if d.get("topology") is not None:
            try:
                topology = Topology.from_dict(d["topology"])
            except TopologyError as exc:
                raise FieldError("topology", str(exc)) from None
        notes = d.get("notes")
        return cls(
            schema_version=d["schema_version"],
            name=d["name"],
            origin=d["origin"],
            created=d["created"],
            description=d.get("description"),
            versions=Versions.from_dict(d["versions"]) if d.get("versions") is not None else Versions(),
            machine=Machine.from_dict(d["machine"]),
            kernel=KernelSection.from_dict(d["kernel"]) if d.get("kernel") is not None else KernelSection(),
            reduction=Reduction.from_dict(d["reduction"]),
            notes=list(notes) if isinstance(notes, list) else ([] if notes is None else notes),
            topology=topology,
        )


def shard_bucket(shard_len: int) -> int:
    """The bucket bound for a shard length: the next power of two (at least 1)."""
    if isinstance(shard_len, bool) or not isinstance(shard_len, int) or shard_len < 0:
        raise FieldError("shard_len", f"expected an integer >= 0, got {shard_len!r}")
    return 1 << max(0, (max(shard_len, 1) - 1).bit_length())


__all__ = [
    "SCHEMA_VERSION", "ORIGINS", "CHOSEN_BY", "DEVICE_KINDS", "DTYPES",
    "Versions", "Machine", "KernelBucket", "KernelSection", "PlanCandidate", "Reduction", "Profile",
    "normalize_dtype", "normalize_created", "utc_now", "plan_from_dict", "config_from_dict",
    "device_kind_of", "device_name_of", "hierarchy_text", "shard_bucket",
]
