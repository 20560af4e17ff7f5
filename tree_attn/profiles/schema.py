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
from collections.abc import Callable, Mapping
from dataclasses import MISSING, InitVar, dataclass, field, fields
from functools import partial
from typing import Any

from .. import dtypes as _dtypes
from .. import validate
from ..errors import ConfigError, ProfileError, TopologyError
from ..kernels.config import DecodeConfig
from ..reduce.plan import STRATEGIES, ReductionPlan
from ..topology.model import LinkKind, P2PStatus, Topology, format_ranges
from ..validate import join


class FieldError(ProfileError):
    """A ProfileError about one field; ``path`` is its dotted path, ``detail`` what is wrong."""

    takes_path = True  # tree_attn.validate builds it as FieldError(path, detail)

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")


# The validation vocabulary (tree_attn.validate), raising FieldError.
check_int = partial(validate.check_int, error=FieldError)
check_number = partial(validate.check_number, error=FieldError)
check_str = partial(validate.check_str, error=FieldError)
check_bool = partial(validate.check_bool, error=FieldError)
check_list = partial(validate.check_list, error=FieldError)
check_str_list = partial(validate.check_str_list, error=FieldError)
check_mapping = partial(validate.check_mapping, error=FieldError, what="profile")

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
            raise FieldError(path,
                             f"expected an ISO 8601 UTC time such as '2025-01-31T12:00:00Z', got {value!r}") from None
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


# -- sections: frozen dataclasses whose fields are the file's keys ------------------------------
#
# A section's fields, in declaration order, are its keys in file order: ``to_dict`` and
# ``from_dict`` are derived from them (:class:`_Section`). A field without a default is a required
# key; any key that is not a field is refused, named by its path. A field's ``read`` (metadata)
# builds its value from the file's data and the field's path (a nested section, a plan, a kernel
# config); a null for a field whose default is null or a factory's (a list, a mapping, a section)
# reads as that default. Writing turns every value with a ``to_dict`` into its dict and copies
# lists and mappings.


def _read(read: Callable[[Any, str], Any]) -> dict[str, Any]:
    """Field metadata: ``read(data, path)`` builds the field's value from the file's data."""
    return {"read": read}


def _items(read: Callable[[Any, str], Any]) -> Callable[[Any, str], list]:
    """A reader of a list whose items ``read`` builds, each with its index in its path."""
    return lambda data, path: [read(x, f"{path}[{i}]") for i, x in enumerate(check_list(data, path))]


def _plain(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(x) for x in value]
    if isinstance(value, dict):
        return {k: _plain(x) for k, x in value.items()}
    return value


def _set(obj: Any, name: str, value: Any) -> None:
    """Normalise a field of a frozen section in ``__post_init__``."""
    object.__setattr__(obj, name, value)


class _FieldNames:
    def __get__(self, obj: Any, cls: type) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class _Section:
    """The dict conversion of a section, derived from its dataclass fields (see above)."""

    FIELDS = _FieldNames()  # the section's keys, in file order

    def to_dict(self) -> dict[str, Any]:
        """Plain data, keys in the stable file order (the fields' order)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def _values(cls, data: Any, where: str) -> dict[str, Any]:
        fs = fields(cls)
        required = [f.name for f in fs if f.default is MISSING and f.default_factory is MISSING]
        d = check_mapping(data, where, required=required, optional=[f.name for f in fs])
        values = {}
        for f in fs:
            if f.name not in d or (d[f.name] is None and (f.default is None or f.default_factory is not MISSING)):
                continue  # absent, or a null where the default is null or a factory's: the default
            read = f.metadata.get("read")
            values[f.name] = read(d[f.name], join(where, f.name)) if read else d[f.name]
        return values

    @classmethod
    def from_dict(cls, data: Any, where: str | None = None):
        """Validate and build from loaded YAML/JSON; every error names the field's dotted path
        (``where``: this section's, default its own name)."""
        where = cls.where if where is None else where  # the InitVar's default: the section's own path
        return cls(**cls._values(data, where), where=where)


@dataclass(frozen=True)
class Versions(_Section):
    """Software the profile was made with (strings, or null when unknown / not installed).

    A profile made under other versions still applies (the fabric did not change), with a warning:
    a new driver or Triton can move the kernel's best config.
    """

    tree_attn: str | None = None
    torch: str | None = None
    triton: str | None = None
    driver: str | None = None
    where: InitVar[str] = "versions"

    def __post_init__(self, where: str) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not isinstance(value, str):
                raise FieldError(join(where, f.name), "expected a version string or null "
                                                      f"(quote numbers such as '2.5'), got {value!r}")


@dataclass(frozen=True)
class Machine(_Section):
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

    def __post_init__(self, where: str) -> None:
        check_str(self.device_kind, join(where, "device_kind"), choices=DEVICE_KINDS)
        check_str(self.device_name, join(where, "device_name"))
        check_int(self.world_size, join(where, "world_size"), minimum=1)
        check_str(self.fingerprint, join(where, "fingerprint"))
        if not _FINGERPRINT_RE.match(self.fingerprint):
            raise FieldError(join(where, "fingerprint"), "expected 16 lowercase hex digits (Topology.fingerprint), "
                                                         f"got {self.fingerprint!r}")
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
                raise FieldError(path, f"counts add up to {sum(counts.values())} pairs, "
                                       f"but {self.world_size} devices have {pairs}")

    @classmethod
    def from_topology(cls, topology: Topology) -> Machine:
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


@dataclass(frozen=True)
class KernelBucket(_Section):
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
    config: DecodeConfig = field(metadata=_read(config_from_dict))
    chosen_by: str
    time_us: float | None = None
    gbps: float | None = None
    predicted_us: float | None = None
    candidates_tried: int | None = None
    copy_fraction: float | None = None
    host_us: float | None = None
    timing: str | None = None
    where: InitVar[str] = "kernel.buckets[]"

    def __post_init__(self, where: str) -> None:
        _set(self, "dtype", normalize_dtype(self.dtype, join(where, "dtype")))
        check_int(self.head_dim, join(where, "head_dim"), minimum=1, maximum=1024)
        check_int(self.group, join(where, "group"), minimum=1)
        check_int(self.max_shard_len, join(where, "max_shard_len"), minimum=1)
        if self.max_shard_len & (self.max_shard_len - 1):
            raise FieldError(join(where, "max_shard_len"), f"expected a power of two, got {self.max_shard_len}")
        if not isinstance(self.config, DecodeConfig):
            raise FieldError(join(where, "config"), f"expected a DecodeConfig, got {type(self.config).__name__}")
        check_str(self.chosen_by, join(where, "chosen_by"), choices=CHOSEN_BY)
        for name in ("time_us", "gbps", "predicted_us", "copy_fraction", "host_us"):
            _set(self, name, check_number(getattr(self, name), join(where, name), optional=True))
        check_int(self.candidates_tried, join(where, "candidates_tried"), minimum=0, optional=True)
        check_str(self.timing, join(where, "timing"), choices=TIMING_METHODS, optional=True)
        if self.chosen_by == "measured" and self.time_us is None:
            raise FieldError(join(where, "time_us"), "chosen_by is 'measured' but no measured time is given")
        if self.chosen_by != "measured" and (self.time_us is not None or self.gbps is not None):
            raise FieldError(join(where, "chosen_by"), "a measured time_us/gbps is given but chosen_by is "
                                                       f"{self.chosen_by!r}; use 'measured'")

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.dtype, self.head_dim, self.group, self.max_shard_len)


@dataclass(frozen=True)
class KernelSection(_Section):
    """Kernel configs per shape bucket; ``device_spec`` names the cost model's device spec
    (``tree_attn.cost.devices.KNOWN_DEVICES`` key or a spec name) they were ranked for.
    An empty bucket list means the launch heuristic decides every shape (CPU ranks run the torch
    reference, where no config applies)."""

    device_spec: str | None = None
    buckets: list[KernelBucket] = field(default_factory=list, metadata=_read(_items(KernelBucket.from_dict)))
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


@dataclass(frozen=True)
class PlanCandidate(_Section):
    """One reduction plan that was tried, with its latency for one all-ranks merge.

    ``chosen_by`` says where the numbers come from: ``measured`` (``median_us`` and ``p95_us``
    timed across all ranks at the decode message size) or ``model`` (``predicted_us`` only).
    ``selected`` marks the winner (exactly one candidate, equal to ``reduction.plan``).
    """

    label: str
    plan: ReductionPlan = field(metadata=_read(plan_from_dict))
    chosen_by: str
    median_us: float | None = None
    p95_us: float | None = None
    predicted_us: float | None = None
    selected: bool = False
    timing: str | None = None
    where: InitVar[str] = "reduction.candidates[]"

    def __post_init__(self, where: str) -> None:
        check_str(self.label, join(where, "label"))
        _check_plan(self.plan, join(where, "plan"), None)
        check_str(self.chosen_by, join(where, "chosen_by"), choices=CANDIDATE_CHOSEN_BY)
        for name in ("median_us", "p95_us", "predicted_us"):
            _set(self, name, check_number(getattr(self, name), join(where, name), optional=True))
        check_bool(self.selected, join(where, "selected"))
        check_str(self.timing, join(where, "timing"), choices=TIMING_METHODS, optional=True)
        if self.chosen_by == "measured" and self.median_us is None:
            raise FieldError(join(where, "median_us"), "chosen_by is 'measured' but no measured median is given")
        if self.chosen_by == "model" and self.predicted_us is None:
            raise FieldError(join(where, "predicted_us"), "chosen_by is 'model' but no predicted time is given")
        if self.median_us is not None and self.p95_us is not None and self.p95_us < self.median_us:
            raise FieldError(join(where, "p95_us"), f"the 95th percentile ({self.p95_us}) is below the median "
                                                    f"({self.median_us})")


@dataclass(frozen=True)
class Reduction(_Section):
    """The reduction plan ``run`` uses, how it was chosen, and every candidate tried.

    ``message_bytes``: the size of one rank's packed partial state (float32 ``[B, Hq, D + 1]``)
    the candidates were timed or priced at.
    """

    plan: ReductionPlan = field(metadata=_read(plan_from_dict))
    chosen_by: str
    message_bytes: int | None = None
    candidates: list[PlanCandidate] = field(default_factory=list, metadata=_read(_items(PlanCandidate.from_dict)))
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
                raise FieldError(join(where, "candidates"),
                                 f"exactly one candidate must have selected: true, got {len(selected)}")
            winner = self.candidates[selected[0]]
            if winner.plan != self.plan:
                raise FieldError(
                    f"{join(where, 'candidates')}[{selected[0]}].plan",
                    f"the selected candidate {winner.plan.to_dict()} differs from {join(where, 'plan')} "
                    f"{self.plan.to_dict()}",
                )
            if self.chosen_by == "measured" and winner.chosen_by != "measured":
                raise FieldError(join(where, "chosen_by"), "is 'measured' but the selected candidate was not measured")


def check_schema_version(value: Any) -> int:
    """The one check of ``schema_version`` (a profile is refused before anything else is read
    when this tree-attn cannot read its schema: a newer one may have keys this one lacks)."""
    check_int(value, "schema_version")
    if value not in SUPPORTED_SCHEMA_VERSIONS:
        raise FieldError(
            "schema_version",
            f"this tree-attn reads profile schema {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}, got {value}; "
            "re-tune with this version (`tree-attn tune --force`)",
        )
    return value


def _topology_from_dict(data: Any, path: str) -> Topology:
    try:
        return Topology.from_dict(data)
    except TopologyError as exc:
        raise FieldError(path, str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class Profile(_Section):
    """A tuned (or model-derived) profile for one machine. See the module docstring for the layout
    (the fields below, in file order).

    ``origin``: ``measured`` (``tune`` timed things on the machine), ``model`` (``tune`` without
    timing, e.g. from a topology file) or ``builtin-model`` (shipped with tree-attn, derived from
    recorded topology dumps and the perf model). ``topology``: the full fabric, when known; its
    fingerprint and size must agree with ``machine``.
    """

    schema_version: int = SCHEMA_VERSION
    name: str
    origin: str
    created: str
    description: str | None = None
    versions: Versions = field(default_factory=Versions, metadata=_read(Versions.from_dict))
    machine: Machine = field(metadata=_read(Machine.from_dict))
    kernel: KernelSection = field(default_factory=KernelSection, metadata=_read(KernelSection.from_dict))
    reduction: Reduction = field(metadata=_read(Reduction.from_dict))
    notes: list[str] = field(default_factory=list)
    topology: Topology | None = field(default=None, metadata=_read(_topology_from_dict))

    def __post_init__(self) -> None:
        check_schema_version(self.schema_version)
        check_str(self.name, "name")
        _set(self, "created", normalize_created(self.created))
        check_str(self.origin, "origin", choices=ORIGINS)
        check_str(self.description, "description", optional=True, nonempty=False)
        check_str_list(self.notes, "notes")
        for name, cls in (("machine", Machine), ("reduction", Reduction), ("kernel", KernelSection),
                          ("versions", Versions)):
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
                    raise FieldError(f"kernel.buckets[{i}].chosen_by",
                                     f"is 'measured' in a profile of origin {self.origin!r}")
        if self.topology is not None:
            if not isinstance(self.topology, Topology):
                raise FieldError("topology", f"expected a Topology, got {type(self.topology).__name__}")
            if len(self.topology) != n:
                raise FieldError("machine.world_size", f"is {n} but the topology has {len(self.topology)} devices")
            if self.topology.fingerprint != self.machine.fingerprint:
                raise FieldError(
                    "machine.fingerprint",
                    f"{self.machine.fingerprint!r} does not match the topology's fingerprint "
                    f"{self.topology.fingerprint!r}",
                )

    # -- lookups ----------------------------------------------------------------------------
    @property
    def plan(self) -> ReductionPlan:
        """The reduction plan ``run`` should use."""
        return self.reduction.plan

    def kernel_config_for(self, dtype: Any, head_dim: int, group: int,
                          shard_len: int) -> tuple[DecodeConfig, str] | None:
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
    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """Validate and build from loaded YAML/JSON; every error names the dotted field path."""
        check_mapping(data, "", optional=set(data) if isinstance(data, Mapping) else ())
        # The version first: a newer schema may legitimately have keys this one does not know.
        if "schema_version" not in data:
            raise FieldError("schema_version", "required key is missing (is this a tree-attn profile?)")
        check_schema_version(data["schema_version"])
        return cls(**cls._values(data, ""))


def shard_bucket(shard_len: int) -> int:
    """The bucket bound for a shard length: the next power of two (at least 1)."""
    check_int(shard_len, "shard_len", minimum=0)
    return 1 << max(0, (max(shard_len, 1) - 1).bit_length())


__all__ = [
    "CHOSEN_BY", "DEVICE_KINDS", "DTYPES", "ORIGINS", "SCHEMA_VERSION", "KernelBucket", "KernelSection", "Machine",
    "PlanCandidate", "Profile", "Reduction", "Versions", "config_from_dict", "device_kind_of", "device_name_of",
    "hierarchy_text", "normalize_created", "normalize_dtype", "plan_from_dict", "shard_bucket", "utc_now",
]
