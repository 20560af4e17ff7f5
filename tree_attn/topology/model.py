"""The topology data model: devices, pairwise links, the hierarchy of islands, a fingerprint.

Everything here is plain Python (no torch, no vendor library) so that a topology can be built,
saved, loaded and compared on any machine, from a live probe or from a recorded text dump.

Conventions:

- Devices are numbered ``0..n-1`` in the order the backend (or the dump) lists them.
- There is exactly one :class:`Link` per unordered pair ``a < b``; ``Topology.link(a, b)``
  accepts either order.
- A fact the source could not tell is ``None`` (numbers, strings) or ``"unknown"`` (device
  names, link kinds, peer-to-peer status); it is never guessed silently.
- Bandwidths are GB/s (10**9 bytes per second) in one direction, the unit NVIDIA and AMD quote
  per link; latencies are microseconds.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import TopologyError
from ..validate import check_int, check_number

SCHEMA_VERSION = 1
UNKNOWN = "unknown"


class LinkKind(str, enum.Enum):
    """Class of the path between two devices, fastest first (the ``nvidia-smi topo -m`` classes).

    ``UNKNOWN`` is a path inside one host whose class the source did not say (for example a
    ``nvidia-smi topo -p2p`` matrix, which only gives peer-to-peer status); it is ranked after
    ``SYS`` so that planning treats it as the slowest intra-host path. ``NET`` joins ranks on
    different hosts.
    """

    NVLINK = "nvlink"  # bonded NVLinks, directly or through NVSwitch
    XGMI = "xgmi"  # AMD Infinity Fabric links between GPUs of one hive
    PIX = "pix"  # at most one PCIe bridge
    PXB = "pxb"  # several PCIe bridges, no host bridge
    PHB = "phb"  # through a PCIe host bridge (the CPU)
    NODE = "node"  # between host bridges inside one NUMA node
    SYS = "sys"  # across the SMP interconnect between NUMA nodes (QPI/UPI/xGMI-socket)
    UNKNOWN = "unknown"
    NET = "net"  # another host, through the network

    @property
    def rank(self) -> int:
        """Position in the fastest-to-slowest order (0 = fastest)."""
        return _KIND_ORDER.index(self)

    @property
    def is_pcie(self) -> bool:
        return self in (LinkKind.PIX, LinkKind.PXB, LinkKind.PHB, LinkKind.NODE, LinkKind.SYS)

    @classmethod
    def parse(cls, value: Any, *, what: str = "kind") -> LinkKind:
        """Accept a LinkKind or its name in any case (``"NV"``-prefixed cells are not kinds)."""
        return _parse_enum(cls, value, f"{what}: unknown link class {value!r}; expected one of "
                           + ", ".join(k.value for k in _KIND_ORDER))


_KIND_ORDER = list(LinkKind)


class P2PStatus(str, enum.Enum):
    """Whether the two GPUs can read/write each other's memory directly (CUDA/HIP peer access)."""

    OK = "ok"
    UNSUPPORTED = "unsupported"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, value: Any, *, what: str = "p2p") -> P2PStatus:
        return _parse_enum(cls, value,
                           f"{what}: bad peer-to-peer status {value!r}; expected ok, unsupported or unknown")


def _parse_enum(cls: type[enum.Enum], value: Any, problem: str) -> Any:
    """``value`` as a member of ``cls``: a member, or its value in any case and spacing; else a
    TopologyError saying ``problem``."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value.strip().lower())
        except ValueError:
            pass
    raise TopologyError(problem)


BANDWIDTH_SOURCES = ("estimated", "reported", "measured", "unknown")
VENDORS = ("nvidia", "amd", "cpu", UNKNOWN)


def _check_opt_int(name: str, value: Any, *, minimum: int = 0) -> None:
    check_int(value, name, minimum=minimum, optional=True, error=TopologyError)


def _check_opt_float(name: str, value: Any) -> None:
    check_number(value, name, optional=True, finite=False, error=TopologyError)


def _check_opt_str(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise TopologyError(f"{name}: expected a string or null, got {value!r}")


@dataclass
class Device:
    """One GPU (or one CPU rank of the host fallback).

    ``cpu_affinity`` is the CPU list as ``nvidia-smi`` prints it (``"0-47,96-143"``);
    ``numa_node`` the host NUMA node nearest the device (``NUMA Affinity``); ``gpu_numa_id``
    the NUMA node of the GPU's own memory on platforms that expose it (Grace Hopper).
    """

    index: int
    vendor: str = UNKNOWN
    name: str = UNKNOWN
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_bytes: int | None = None
    sm_count: int | None = None  # SMs (NVIDIA) or compute units (AMD)
    arch: str | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    gpu_numa_id: int | None = None
    pcie_gen: int | None = None  # maximum link generation (current drops at idle)
    pcie_width: int | None = None  # maximum link width in lanes
    nvlink_version: int | None = None
    mig_enabled: bool | None = None

    def __post_init__(self) -> None:
        _check_opt_int("device.index", self.index)
        if self.index is None:
            raise TopologyError("device.index: required")
        if self.vendor not in VENDORS:
            raise TopologyError(f"device {self.index}: vendor: expected one of {VENDORS}, got {self.vendor!r}")
        if not isinstance(self.name, str) or not self.name.strip():
            raise TopologyError(f"device {self.index}: name: expected a non-empty string, got {self.name!r}")
        for f in ("uuid", "pci_bus_id", "arch", "cpu_affinity"):
            _check_opt_str(f"device {self.index}: {f}", getattr(self, f))
        for f in ("memory_bytes", "sm_count", "numa_node", "gpu_numa_id", "pcie_gen", "pcie_width", "nvlink_version"):
            _check_opt_int(f"device {self.index}: {f}", getattr(self, f))
        if self.mig_enabled is not None and not isinstance(self.mig_enabled, bool):
            raise TopologyError(f"device {self.index}: mig_enabled: expected true, false or null, "
                                f"got {self.mig_enabled!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Device:
        return cls(**_fields_of(cls, d, "device"))


@dataclass
class Link:
    """The path between devices ``a < b``.

    ``nvlinks`` is the number of bonded NVLinks for NVLink pairs (``NV18`` = 18), ``None``
    otherwise. ``bandwidth_gbps`` is one direction, GB/s; ``bandwidth_source`` says where it came
    from: ``estimated`` (from link facts: NVLink count x per-link rate, PCIe gen x width),
    ``reported`` (by the vendor tool), ``measured`` (by ``tree-attn probe --measure``).
    """

    a: int
    b: int
    kind: LinkKind
    nvlinks: int | None = None
    p2p: P2PStatus = P2PStatus.UNKNOWN
    p2p_reason: str | None = None
    bandwidth_gbps: float | None = None
    bandwidth_source: str = "unknown"
    latency_us: float | None = None
    hops: int | None = None  # AMD: hops between the two GPUs
    weight: int | None = None  # AMD: KFD link weight (lower is closer)

    def __post_init__(self) -> None:
        _check_opt_int("link.a", self.a)
        _check_opt_int("link.b", self.b)
        where = f"link {self.a}-{self.b}"
        if self.a is None or self.b is None or self.a >= self.b:
            raise TopologyError(f"{where}: expected device indices a < b, got a={self.a!r}, b={self.b!r}")
        self.kind = LinkKind.parse(self.kind, what=f"{where}: kind")
        self.p2p = P2PStatus.parse(self.p2p, what=f"{where}: p2p")
        _check_opt_int(f"{where}: nvlinks", self.nvlinks, minimum=1)
        if self.nvlinks is not None and self.kind is not LinkKind.NVLINK:
            raise TopologyError(f"{where}: nvlinks: {self.nvlinks} given for a {self.kind.value} link "
                                "(only NVLink pairs have a count)")
        _check_opt_str(f"{where}: p2p_reason", self.p2p_reason)
        _check_opt_float(f"{where}: bandwidth_gbps", self.bandwidth_gbps)
        _check_opt_float(f"{where}: latency_us", self.latency_us)
        if self.bandwidth_gbps is not None and not isinstance(self.bandwidth_gbps, float):
            self.bandwidth_gbps = float(self.bandwidth_gbps)
        if self.latency_us is not None and not isinstance(self.latency_us, float):
            self.latency_us = float(self.latency_us)
        if self.bandwidth_source not in BANDWIDTH_SOURCES:
            raise TopologyError(f"{where}: bandwidth_source: expected one of {BANDWIDTH_SOURCES}, "
                                f"got {self.bandwidth_source!r}")
        if self.bandwidth_gbps is None and self.bandwidth_source in ("estimated", "reported", "measured"):
            raise TopologyError(f"{where}: bandwidth_source is {self.bandwidth_source!r} but bandwidth_gbps is null")
        _check_opt_int(f"{where}: hops", self.hops)
        _check_opt_int(f"{where}: weight", self.weight)

    @property
    def label(self) -> str:
        """The ``nvidia-smi topo -m`` cell: ``NV18``, ``SYS``, ``XGMI``, ... (``?`` if unknown)."""
        if self.kind is LinkKind.NVLINK:
            return f"NV{self.nvlinks}" if self.nvlinks else "NV?"
        if self.kind is LinkKind.UNKNOWN:
            return "?"
        return self.kind.value.upper()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind.value
        d["p2p"] = self.p2p.value
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Link:
        return cls(**_fields_of(cls, d, "link"))


@dataclass
class HierarchyLevel:
    """One level of the hierarchy: a partition of the devices into groups (sorted lists of
    indices, groups sorted by their first member) joined by links of ``kind`` or faster.
    ``kind`` is a :class:`LinkKind` value, or ``"self"`` for the single level of a one-device
    topology."""

    kind: str
    groups: list[list[int]]

    def __post_init__(self) -> None:
        if self.kind != "self":
            self.kind = LinkKind.parse(self.kind, what="hierarchy level kind").value
        if not isinstance(self.groups, list) or not all(isinstance(g, list) and g for g in self.groups):
            raise TopologyError(f"hierarchy level {self.kind}: groups: expected a list of non-empty lists, "
                                f"got {self.groups!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "groups": [list(g) for g in self.groups]}


@dataclass
class Measurement:
    """How the measured numbers in a topology were obtained.

    ``method``: for example ``"cuda-copy+nccl"`` or ``"gloo"``; ``copy_bytes``: the message size
    of the bandwidth copies; ``latency_bytes``: the small-message size of the latency test;
    ``allreduce_bytes``/``allreduce_latency_us``: the all-reduce at the decode message size.
    """

    method: str
    iterations: int
    copy_bytes: int
    latency_bytes: int
    allreduce_bytes: int
    allreduce_latency_us: float | None
    device: str

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise TopologyError(f"measurement.method: expected a non-empty string, got {self.method!r}")
        for f in ("iterations", "copy_bytes", "latency_bytes", "allreduce_bytes"):
            _check_opt_int(f"measurement.{f}", getattr(self, f), minimum=1)
            if getattr(self, f) is None:
                raise TopologyError(f"measurement.{f}: required")
        _check_opt_float("measurement.allreduce_latency_us", self.allreduce_latency_us)
        _check_opt_str("measurement.device", self.device)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> Measurement:
        return cls(**_fields_of(cls, d, "measurement"))


def _fields_of(cls: type, d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise TopologyError(f"{what}: expected a mapping, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise TopologyError(f"{what}: unknown key(s) {', '.join(map(str, unknown))}; "
                            f"expected some of {', '.join(sorted(names))}")
    return dict(d)


def connected_groups(n: int, pairs) -> list[list[int]]:
    """The connected components of ``0 .. n-1`` joined by ``pairs`` (i, j), each sorted, ordered
    by their smallest member (union-find, the smaller root kept)."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j in pairs:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    comps: dict[int, list[int]] = {}
    for i in range(n):
        comps.setdefault(find(i), []).append(i)
    return sorted(comps.values(), key=lambda g: g[0])


def build_hierarchy(n: int, links: Iterable[Link]) -> list[HierarchyLevel]:
    """Levels from the fastest link class present to the slowest.

    Level ``k`` partitions the devices into the connected components of the graph whose edges are
    the links of class ``k`` or faster. A class whose partition equals the previous level's adds
    nothing and is skipped; the last level is one group of all devices (every pair has a link).
    """
    links = list(links)
    if n == 1:
        return [HierarchyLevel("self", [[0]])]
    levels: list[HierarchyLevel] = []
    present = sorted({l.kind for l in links}, key=lambda k: k.rank)
    prev: list[list[int]] | None = None
    for kind in present:
        groups = connected_groups(n, [(l.a, l.b) for l in links if l.kind.rank <= kind.rank])
        if groups != prev:
            levels.append(HierarchyLevel(kind.value, groups))
            prev = groups
    return levels


@dataclass
class Topology:
    """Devices, one link per pair, and the hierarchy derived from the links.

    ``source`` says where it came from (``nvml``, ``amdsmi``, ``host``,
    ``dump:nvidia-smi-topo-m``, ...). ``notes`` holds plain-words remarks from the probe (why a
    fallback was taken, what a dump could not tell). ``hierarchy`` and ``fingerprint`` are
    derived, never stored independently.
    """

    devices: list[Device]
    links: list[Link]
    source: str = UNKNOWN
    notes: list[str] = field(default_factory=list)
    measurement: Measurement | None = None
    schema_version: int = SCHEMA_VERSION
    # Levels clustered from measured pair costs (``probe --measure`` across nodes,
    # :mod:`tree_attn.topology.islands`) where they disagree with the link classes; None: the
    # hierarchy follows the link classes.
    measured_hierarchy: list[HierarchyLevel] | None = None

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise TopologyError(
                f"schema_version: this tree-attn reads topology schema {SCHEMA_VERSION}, got {self.schema_version!r}; "
                "probe the machine again with this version"
            )
        if not isinstance(self.devices, list) or not self.devices:
            raise TopologyError("devices: expected a non-empty list of devices")
        for i, d in enumerate(self.devices):
            if not isinstance(d, Device):
                raise TopologyError(f"devices[{i}]: expected a Device, got {type(d).__name__}")
            if d.index != i:
                raise TopologyError(f"devices[{i}]: index: expected {i} (devices are numbered 0..n-1 in order), "
                                    f"got {d.index}")
        n = len(self.devices)
        seen: dict[tuple[int, int], Link] = {}
        for l in self.links:
            if not isinstance(l, Link):
                raise TopologyError(f"links: expected Link objects, got {type(l).__name__}")
            if l.b >= n:
                raise TopologyError(f"link {l.a}-{l.b}: b: device {l.b} does not exist (there are {n} devices)")
            if (l.a, l.b) in seen:
                raise TopologyError(f"link {l.a}-{l.b}: listed twice")
            seen[(l.a, l.b)] = l
        missing = [(a, b) for a in range(n) for b in range(a + 1, n) if (a, b) not in seen]
        if missing:
            a, b = missing[0]
            raise TopologyError(f"links: no link for the pair {a}-{b} ({len(missing)} pair(s) missing); "
                                "every pair needs one")
        self.links = [seen[k] for k in sorted(seen)]
        self._index = seen
        if not isinstance(self.source, str) or not self.source:
            raise TopologyError(f"source: expected a non-empty string, got {self.source!r}")
        if not isinstance(self.notes, list) or not all(isinstance(x, str) for x in self.notes):
            raise TopologyError(f"notes: expected a list of strings, got {self.notes!r}")
        if self.measurement is not None and not isinstance(self.measurement, Measurement):
            raise TopologyError(f"measurement: expected a Measurement, got {type(self.measurement).__name__}")
        if self.measured_hierarchy is not None:
            _check_levels(self.measured_hierarchy, n)

    # -- access -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def link(self, a: int, b: int) -> Link:
        """The link between ``a`` and ``b`` in either order."""
        if a == b:
            raise TopologyError(f"link({a}, {b}): a device has no link to itself")
        key = (a, b) if a < b else (b, a)
        try:
            return self._index[key]
        except KeyError:
            raise TopologyError(f"link({a}, {b}): no such pair in a topology of {len(self)} devices") from None

    @property
    def hierarchy(self) -> list[HierarchyLevel]:
        """Levels fastest first; the last is one group of all devices: the measured levels where
        a measurement set them, else those the link classes give."""
        if self.measured_hierarchy is not None:
            return [HierarchyLevel(h.kind, [list(g) for g in h.groups]) for h in self.measured_hierarchy]
        return build_hierarchy(len(self.devices), self.links)

    @property
    def hierarchy_source(self) -> str:
        """Where :attr:`hierarchy` comes from: ``measured`` (clustered from measured pair costs),
        ``layout`` (the node layout of a job over several nodes: each node, then the network) or
        ``probe`` (the link classes of the probed or recorded fabric)."""
        if self.measured_hierarchy is not None:
            return "measured"
        return "layout" if any(l.kind is LinkKind.NET for l in self.links) else "probe"

    @property
    def fingerprint(self) -> str:
        """Stable 16-hex-digit hash of what identifies the fabric: device count and names, link
        classes, NVLink counts and peer-to-peer status. Measured numbers, bandwidth estimates,
        UUIDs, bus ids, NUMA placement and notes are left out, so that the same machine model
        gives the same fingerprint on every node and on every probe."""
        ident = {
            "n": len(self.devices),
            "names": [d.name for d in self.devices],
            "links": [[l.a, l.b, l.kind.value, l.nvlinks, l.p2p.value] for l in self.links],
        }
        blob = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # -- derived helpers ----------------------------------------------------------------------
    def replace(self, **changes: Any) -> Topology:
        """A copy with some fields replaced (devices and links are copied, never shared)."""
        base = {
            "devices": [dataclasses.replace(d) for d in self.devices],
            "links": [dataclasses.replace(l) for l in self.links],
            "source": self.source,
            "notes": list(self.notes),
            "measurement": self.measurement,
            "measured_hierarchy": self.measured_hierarchy,
        }
        base.update(changes)
        return Topology(**base)

    def completed_with(self, other: Topology) -> Topology:
        """Fill the facts this topology does not know from ``other`` (same devices, same order).

        Used to combine several recorded dumps of one machine (``nvidia-smi topo -m`` for link
        classes, ``nvidia-smi topo -p2p`` for peer-to-peer status, ``nvidia-smi -L`` for names).
        Known facts are kept; a fact known on both sides with different values is an error.
        """
        if len(other) != len(self):
            raise TopologyError(
                f"cannot combine {self.source} ({len(self)} devices) with {other.source} ({len(other)} devices): "
                "the dumps are not of the same machine"
            )
        devices = []
        for d, o in zip(self.devices, other.devices):
            vals = {}
            for f in dataclasses.fields(Device):
                mine, theirs = getattr(d, f.name), getattr(o, f.name)
                vals[f.name] = theirs if mine in (None, UNKNOWN) else mine
            devices.append(Device(**vals))
        links = []
        for l in self.links:
            o = other.link(l.a, l.b)
            vals = dataclasses.asdict(l)
            vals["kind"], vals["p2p"] = l.kind, l.p2p
            if l.kind is LinkKind.UNKNOWN:
                vals["kind"], vals["nvlinks"] = o.kind, o.nvlinks
            elif o.kind not in (LinkKind.UNKNOWN, l.kind):
                raise TopologyError(
                    f"GPU{l.a}-GPU{l.b}: {self.source} says {l.label}, {other.source} says {o.label}: "
                    "the dumps disagree (are they of the same machine?)"
                )
            if ((l.p2p is P2PStatus.UNKNOWN or (l.p2p_reason or "").startswith("inferred"))
                    and o.p2p is not P2PStatus.UNKNOWN):
                vals["p2p"], vals["p2p_reason"] = o.p2p, o.p2p_reason
            if l.bandwidth_gbps is None and o.bandwidth_gbps is not None:
                vals["bandwidth_gbps"], vals["bandwidth_source"] = o.bandwidth_gbps, o.bandwidth_source
            for f in ("hops", "weight", "latency_us"):
                if vals[f] is None:
                    vals[f] = getattr(o, f)
            links.append(Link(**vals))
        return Topology(
            devices=devices,
            links=links,
            source=f"{self.source}+{other.source}",
            notes=self.notes + [n for n in other.notes if n not in self.notes],
            measurement=self.measurement or other.measurement,
        )

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON/YAML-ready) in a stable key order. ``hierarchy_source`` is written
        where it is not ``probe`` (the link classes of one machine: every file before it existed),
        ``measured_hierarchy`` where a measurement set it."""
        d = {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "source": self.source,
            "world_size": len(self.devices),
            "devices": [d.to_dict() for d in self.devices],
            "links": [l.to_dict() for l in self.links],
            "hierarchy": [h.to_dict() for h in self.hierarchy],
        }
        if self.hierarchy_source != "probe":
            d["hierarchy_source"] = self.hierarchy_source
        if self.measured_hierarchy is not None:
            d["measured_hierarchy"] = [h.to_dict() for h in self.measured_hierarchy]
        d["measurement"] = self.measurement.to_dict() if self.measurement else None
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Topology:
        """Validate and build from :meth:`to_dict` output. Unknown keys are rejected; the derived
        ``fingerprint``, ``world_size`` and ``hierarchy``, when present, must match the content."""
        if not isinstance(d, dict):
            raise TopologyError(f"topology: expected a mapping, got {type(d).__name__}")
        allowed = {"schema_version", "fingerprint", "source", "world_size", "devices", "links", "hierarchy",
                   "hierarchy_source", "measured_hierarchy", "measurement", "notes"}
        unknown = sorted(map(str, set(d) - allowed))
        if unknown:
            raise TopologyError(f"topology: unknown key(s) {', '.join(unknown)}; "
                                f"expected some of {', '.join(sorted(allowed))}")
        if "schema_version" not in d:
            raise TopologyError("topology: schema_version: required")
        for key in ("devices", "links"):
            if not isinstance(d.get(key), list):
                raise TopologyError(f"topology: {key}: expected a list, got {type(d.get(key)).__name__}")
        meas = d.get("measurement")
        mh = d.get("measured_hierarchy")
        if mh is not None and not isinstance(mh, list):
            raise TopologyError(f"topology: measured_hierarchy: expected a list of levels, got {type(mh).__name__}")
        topo = cls(
            devices=[Device.from_dict(x) for x in d["devices"]],
            links=[Link.from_dict(x) for x in d["links"]],
            source=d.get("source", UNKNOWN),
            notes=list(d.get("notes") or []),
            measurement=Measurement.from_dict(meas) if meas is not None else None,
            schema_version=d["schema_version"],
            measured_hierarchy=[HierarchyLevel(**_fields_of(HierarchyLevel, x, "measured_hierarchy level"))
                                for x in mh] if mh is not None else None,
        )
        if "hierarchy_source" in d and d["hierarchy_source"] != topo.hierarchy_source:
            raise TopologyError(f"topology: hierarchy_source: says {d['hierarchy_source']!r} but the content gives "
                                f"{topo.hierarchy_source!r}")
        if "world_size" in d and d["world_size"] != len(topo):
            raise TopologyError(f"topology: world_size: says {d['world_size']!r} but {len(topo)} devices are listed")
        if "fingerprint" in d and d["fingerprint"] != topo.fingerprint:
            raise TopologyError(
                f"topology: fingerprint: stored {d['fingerprint']!r} does not match the content ({topo.fingerprint}); "
                "the file was edited by hand: delete the fingerprint line to accept the edit"
            )
        if "hierarchy" in d:
            given = d["hierarchy"]
            derived = [h.to_dict() for h in topo.hierarchy]
            if given != derived:
                raise TopologyError(
                    "topology: hierarchy: the stored hierarchy does not follow from the links; "
                    "delete the hierarchy key to derive it again"
                )
        return topo


def _check_levels(levels: list[HierarchyLevel], n: int) -> None:
    """Measured levels: each a partition of ``0..n-1`` nesting in the next, the last one group."""
    if not isinstance(levels, list) or not levels or not all(isinstance(h, HierarchyLevel) for h in levels):
        raise TopologyError("measured_hierarchy: expected a non-empty list of hierarchy levels")
    prev: list[set[int]] | None = None
    for h in levels:
        members = sorted(r for g in h.groups for r in g)
        if members != list(range(n)):
            raise TopologyError(f"measured_hierarchy: level {h.kind} {h.groups} is not a partition of devices "
                                f"0..{n - 1}")
        groups = [set(g) for g in h.groups]
        if prev is not None and not all(any(p <= g for g in groups) for p in prev):
            raise TopologyError(f"measured_hierarchy: level {h.kind} {h.groups} splits a group of a faster level")
        prev = groups
    if len(levels[-1].groups) != 1:
        raise TopologyError("measured_hierarchy: the last level must be one group of all devices")


def format_ranges(indices: Iterable[int]) -> str:
    """``[0,1,2,3,5]`` -> ``"0-3,5"`` (how nvidia-smi and humans write device sets)."""
    xs = sorted(set(indices))
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
