"""Parameters of the decode-step cost model: a rank's device and a cluster (the link classes are
in :mod:`tree_attn.cost.links`). Pure data.

A cluster is ``nodes`` x ``ranks_per_node`` ranks, rank r on node ``r // ranks_per_node``. Ranks
of one node talk over the node's link class (or, for a node described by a probed topology, over
each pair's own class); ranks of different nodes over the network. Units: microseconds, GB/s
(10**9 B/s) in one direction, bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import ConfigError
from ..validate import check_int, check_number
from .devices import DeviceSpec
from .links import LINK_CLASSES, LinkParams


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
        check_number(self.mem_gbps, "device.mem_gbps", positive=True)
        check_number(self.kernel_fraction, "device.kernel_fraction", positive=True, maximum=1.0)
        for name in ("kernel_fixed_us", "merge_us", "collective_us"):
            check_number(getattr(self, name), f"device.{name}")
        check_int(self.shared_cores, "device.shared_cores", minimum=1, optional=True)

    @classmethod
    def from_spec(cls, spec: DeviceSpec, *, kernel_fraction: float, merge_us: float, collective_us: float,
                  kernel_fixed_us: float | None = None, name: str | None = None, **kw: Any) -> DeviceParams:
        """A catalogued card's parameters: its name, memory bandwidth and memory from ``spec`` (the
        catalogue, :mod:`tree_attn.cost.devices`), the local attention's fixed cost by default the
        two launches of the split-KV kernel (2 x ``spec.launch_gap_us``)."""
        fixed = 2 * spec.launch_gap_us if kernel_fixed_us is None else kernel_fixed_us
        return cls(name or spec.name, mem_gbps=spec.mem_bandwidth_gbps, kernel_fraction=kernel_fraction,
                   kernel_fixed_us=fixed, merge_us=merge_us, collective_us=collective_us,
                   memory_bytes=spec.memory_bytes, **kw)

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
        ranks_per_host: CPU ranks: how many ranks share one host's cores (None: a node's,
            ``ranks_per_node``). A fabric of "nodes" that are network namespaces of one machine
            shares its cores among every rank of the job.
        shared_nic: a node's ranks share one network link (a host with one NIC; the fabric's
            nodes), so their messages between nodes queue on it; False: one NIC per rank (GPU
            nodes: one NIC per GPU).
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
    ranks_per_host: int | None = None
    shared_nic: bool = False

    def __post_init__(self) -> None:
        for name in ("ranks_per_node", "nodes"):
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.ranks_per_host, "ranks_per_host", minimum=1, optional=True)
        if self.intra is None and self.ranks_per_node > 1 and not self.pair_links:
            raise ConfigError(f"cluster {self.name}: {self.ranks_per_node} ranks per node "
                              "need an intra-node link class")
        if self.network is None and self.nodes > 1:
            raise ConfigError(f"cluster {self.name}: {self.nodes} nodes need a network link class (--network)")
        check_number(self.step_overhead_us, "step_overhead_us")

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

    def with_shape(self, nodes: int, ranks_per_node: int) -> ClusterSpec:
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
            node_links = [self.intra] if self.intra is not None and not self.pair_links else self.pair_links.values()
            for l in node_links:
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
            **({"ranks_per_host": self.ranks_per_host} if self.ranks_per_host is not None else {}),
            **({"shared_nic": True} if self.shared_nic else {}),
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
