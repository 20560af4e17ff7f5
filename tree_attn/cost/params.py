"""Parameters of the decode-step cost model: link classes, devices, a cluster. Pure data.

A cluster is ``nodes`` x ``ranks_per_node`` ranks, rank r on node ``r // ranks_per_node``. Ranks
of one node talk over the node's link class (or, for a node described by a probed topology, over
each pair's own class); ranks of different nodes over the network. Units: microseconds, GB/s
(10**9 B/s) in one direction, bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import ConfigError

# The link classes of the model, fastest first. ``host_loopback`` is CPU ranks on one host
# talking gloo over loopback TCP (this project's CI machines); the others are GPU fabrics.
LINK_CLASSES = (
    "nvlink",  # NVLink, directly or through NVSwitch
    "xgmi",  # AMD Infinity Fabric between the GPUs of one hive
    "pcie_p2p",  # PCIe with GPU peer-to-peer (a switch, or the host bridge)
    "pcie_host",  # PCIe without peer-to-peer: every message staged through host memory (GeForce)
    "cross_socket",  # PCIe paths crossing the SMP interconnect between CPU sockets (SYS)
    "host_loopback",  # CPU ranks on one host: gloo over loopback TCP
    "network",  # another node: InfiniBand / RoCE, one NIC per GPU
)


def _positive(where: str, value: Any, *, zero_ok: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and value != float("inf") and (value > 0 or (zero_ok and value == 0)):
        return float(value)
    want = "a number >= 0" if zero_ok else "a positive number"
    raise ConfigError(f"{where}: expected {want}, got {value!r}")


@dataclass(frozen=True)
class LinkParams:
    """One link class.

    Attributes:
        kind: one of :data:`LINK_CLASSES`.
        p2p_latency_us: alpha of one point-to-point message (posting it, the wire, the wake-up at
            the receiver), microseconds.
        p2p_gbps: beta of point-to-point messages, GB/s one direction (what one rank's link
            sustains: a GPU's NVLink ports, its NIC).
        ar_step_us: alpha of one step of an all-reduce over this class (NCCL's per-hop latency
            of the LL protocol; gloo's per-step round trip on CPU ranks).
        ar_gbps: all-reduce bus bandwidth over this class, GB/s.
        bulk_gbps: bandwidth of a ring round's KV-block exchange (every rank sends and receives a
            whole block at once, into buffers allocated for the round), GB/s; None = ``p2p_gbps``.
        bulk_latency_us: the fixed cost of that exchange, microseconds; None = ``p2p_latency_us``.
        bulk_cpu_fraction: CPU ranks only: the part of the exchange's time its rank spends on a
            core (gloo's copies, its socket calls); the rest is waiting, which other ranks' work
            can fill when ranks outnumber cores. None = 1 (all of it).
        source: where the numbers come from, in words (a datasheet, a measurement...).
    """

    kind: str
    p2p_latency_us: float
    p2p_gbps: float
    ar_step_us: float
    ar_gbps: float
    bulk_gbps: float | None = None
    bulk_latency_us: float | None = None
    bulk_cpu_fraction: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.bulk_gbps is not None:
            object.__setattr__(self, "bulk_gbps", _positive(f"{self.kind}.bulk_gbps", self.bulk_gbps))
        if self.bulk_latency_us is not None:
            object.__setattr__(self, "bulk_latency_us",
                               _positive(f"{self.kind}.bulk_latency_us", self.bulk_latency_us, zero_ok=True))
        if self.bulk_cpu_fraction is not None:
            f = _positive(f"{self.kind}.bulk_cpu_fraction", self.bulk_cpu_fraction)
            if f > 1:
                raise ConfigError(f"{self.kind}.bulk_cpu_fraction: expected a number in (0, 1], got {f!r}")
            object.__setattr__(self, "bulk_cpu_fraction", f)
        if self.kind not in LINK_CLASSES:
            raise ConfigError(f"link class {self.kind!r}: expected one of {', '.join(LINK_CLASSES)}")
        for name in ("p2p_latency_us", "ar_step_us"):
            object.__setattr__(self, name, _positive(f"{self.kind}.{name}", getattr(self, name), zero_ok=True))
        for name in ("p2p_gbps", "ar_gbps"):
            object.__setattr__(self, name, _positive(f"{self.kind}.{name}", getattr(self, name)))

    def p2p_us(self, nbytes: float) -> float:
        """Time of one point-to-point message of ``nbytes``: alpha + bytes / beta."""
        return self.p2p_latency_us + nbytes / (self.p2p_gbps * 1e3)

    def bulk_us(self, nbytes: float) -> float:
        """Time of a ring round's exchange of ``nbytes`` each way: alpha + bytes / bulk beta."""
        alpha = self.p2p_latency_us if self.bulk_latency_us is None else self.bulk_latency_us
        return alpha + nbytes / ((self.bulk_gbps or self.p2p_gbps) * 1e3)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DeviceParams:
    """One rank's device: the local attention and the merge.

    Attributes:
        name: what it is ("NVIDIA H100 SXM5 80GB", "cpu rank").
        mem_gbps: memory bandwidth the local attention streams the KV shard from (HBM), GB/s.
        kernel_fraction: the fraction of ``mem_gbps`` the decode kernel achieves (0..1].
        kernel_fixed_us: the local attention's time that does not grow with the shard (launches,
            the split-KV merge kernel, a CPU path's Python), microseconds.
        merge_us: one exact merge of a node's states (the tree's merge, ring's merge_two, the
            all-reduce form's rescale), microseconds.
        collective_us: fixed cost of launching one all-reduce (NCCL's base latency), microseconds.
        memory_bytes: the device's memory, for the "does the shard fit" note (None: unknown).
        shared_cores: CPU ranks only: the host's cores, which all ranks of a node share (a rank's
            compute and communication slow by ranks per node / cores when they outnumber the
            cores); None on GPUs.
        overlap: whether communication runs beside the compute (GPUs: copy engines and NICs
            beside the SMs) or takes the same cores (CPU ranks: the TCP copies of gloo run on the
            cores that compute, so a ring round costs compute + transfer, not the max).
        source: where the numbers come from.
    """

    name: str
    mem_gbps: float
    kernel_fraction: float
    kernel_fixed_us: float
    merge_us: float
    collective_us: float = 0.0
    memory_bytes: int | None = None
    shared_cores: int | None = None
    overlap: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        _positive("device.mem_gbps", self.mem_gbps)
        frac = _positive("device.kernel_fraction", self.kernel_fraction)
        if frac > 1:
            raise ConfigError(f"device.kernel_fraction: expected a fraction in (0, 1], got {self.kernel_fraction!r}")
        for name in ("kernel_fixed_us", "merge_us", "collective_us"):
            _positive(f"device.{name}", getattr(self, name), zero_ok=True)
        if self.shared_cores is not None and (isinstance(self.shared_cores, bool) or not isinstance(self.shared_cores, int)
                                              or self.shared_cores < 1):
            raise ConfigError(f"device.shared_cores: expected an integer >= 1 or null, got {self.shared_cores!r}")

    @property
    def kernel_gbps(self) -> float:
        """Bandwidth the local attention achieves, GB/s."""
        return self.mem_gbps * self.kernel_fraction

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``ranks_per_node`` ranks and the parameters of everything between them.

    Attributes:
        name: a label ("h100-sxm", "this machine (cpu ranks)").
        device: every rank's device (the model assumes one kind of device).
        ranks_per_node: ranks (GPUs) per node.
        nodes: nodes.
        intra: the node's link class (every pair of one node), unless ``pair_links`` says better.
        network: the class between nodes (None is only valid for one node).
        step_overhead_us: what a decode step costs besides attention and its communication (a
            CUDA-graph launch; on CPU ranks the barrier and the Python around the step).
        pair_links: per pair of local ranks ``(a, b)``, a < b, the link of that pair inside a node,
            for nodes probed as a topology with several classes (PCIe switches and sockets).
        hierarchy: the node's hierarchy as ``[(kind, groups)]`` of local ranks, fastest first
            (None: one level, one group).
    """

    name: str
    device: DeviceParams
    ranks_per_node: int
    nodes: int = 1
    intra: LinkParams | None = None
    network: LinkParams | None = None
    step_overhead_us: float = 0.0
    pair_links: dict = field(default_factory=dict)
    hierarchy: tuple | None = None
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "nodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}: expected an integer >= 1, got {v!r}")
        if self.intra is None and self.ranks_per_node > 1 and not self.pair_links:
            raise ConfigError(f"cluster {self.name}: {self.ranks_per_node} ranks per node need an intra-node link class")
        if self.network is None and self.nodes > 1:
            raise ConfigError(f"cluster {self.name}: {self.nodes} nodes need a network link class (--network)")
        _positive("step_overhead_us", self.step_overhead_us, zero_ok=True)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, a: int, b: int) -> LinkParams:
        """The link class between ranks ``a`` and ``b``."""
        if self.node_of(a) != self.node_of(b):
            return self.network
        la, lb = sorted((a % self.ranks_per_node, b % self.ranks_per_node))
        return self.pair_links.get((la, lb), self.intra)

    def with_shape(self, nodes: int, ranks_per_node: int) -> "ClusterSpec":
        """The same parameters for another number of nodes and ranks per node. A node described by
        per-pair links keeps them at its own size; with fewer ranks per node, the sub-node of its
        local ranks ``0 .. ranks_per_node - 1`` (their pairs' links and their part of the
        hierarchy); with more, every pair takes the slowest class."""
        if ranks_per_node == self.ranks_per_node:
            pairs, hierarchy = self.pair_links, self.hierarchy
        elif ranks_per_node < self.ranks_per_node and self.pair_links:
            pairs = {(a, b): l for (a, b), l in self.pair_links.items() if b < ranks_per_node}
            hierarchy = _sub_hierarchy(self.hierarchy, ranks_per_node)
        else:
            pairs, hierarchy = {}, None
        return replace(self, nodes=nodes, ranks_per_node=ranks_per_node, pair_links=pairs, hierarchy=hierarchy,
                       intra=self.intra or _slowest(pairs) or _slowest(self.pair_links))

    def link_classes(self) -> list[LinkParams]:
        """Every distinct link class in use, fastest (by latency) first."""
        seen: dict[str, LinkParams] = {}
        if self.ranks_per_node > 1:
            for l in ([self.intra] if self.intra is not None and not self.pair_links else list(self.pair_links.values())):
                seen.setdefault(l.kind + l.source, l)
        if self.nodes > 1:
            seen.setdefault("network" + self.network.source, self.network)
        return sorted(seen.values(), key=lambda l: LINK_CLASSES.index(l.kind))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
            "device": self.device.to_dict(),
            "intra": self.intra.to_dict() if self.intra else None,
            "network": self.network.to_dict() if self.network else None,
            "step_overhead_us": self.step_overhead_us,
            "pair_links": [{"a": a, "b": b, **l.to_dict()} for (a, b), l in sorted(self.pair_links.items())],
            "hierarchy": [{"kind": kind, "groups": [list(g) for g in groups]} for kind, groups in self.hierarchy]
            if self.hierarchy else None,
            "notes": list(self.notes),
        }


def _sub_hierarchy(hierarchy: tuple | None, n: int) -> tuple | None:
    """The levels of ``hierarchy`` restricted to ranks ``0 .. n - 1``: empty groups dropped, and a
    level that groups them as the one before it does dropped too (it joins nothing new)."""
    if not hierarchy or n < 2:
        return None
    levels: list = []
    for kind, groups in hierarchy:
        kept = [[r for r in g if r < n] for g in groups]
        kept = [g for g in kept if g]
        if levels and sorted(map(sorted, kept)) == sorted(map(sorted, levels[-1][1])):
            continue
        levels.append((kind, kept))
    return tuple(levels)


def _slowest(pair_links: dict) -> LinkParams | None:
    if not pair_links:
        return None
    return max(pair_links.values(), key=lambda l: LINK_CLASSES.index(l.kind))
