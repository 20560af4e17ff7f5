"""Islands from measured pair costs: the hierarchy a measurement gives (``probe --measure``).

The link classes say how devices are joined as far as a probe can tell; across nodes every pair
is ``net``, however the nodes are cabled. A measurement can tell more: two nodes joined by a
faster link than the others form an island of their own. :func:`measured_levels` clusters the
devices by the measured cost of each pair (single linkage: a level joins every pair whose cost is
at most a threshold, the thresholds being the gaps of at least :data:`GAP` between consecutive
sorted costs), so each level's groups nest in the next and the last is one group of all. Across
nodes the nodes are clustered whole (see :func:`measured_levels`).

The cost of a pair is the measured time of one ``message_bytes`` message at its measured
bandwidth, ``bytes / bandwidth`` (``probe --measure`` takes the bandwidth from a large copy, whose
time is mostly the link's rate: small messages on a busy host jitter by milliseconds, which would
blur a loopback with a gigabit link). Pure Python, no torch.
"""

from __future__ import annotations

import itertools
import statistics

from .model import HierarchyLevel, LinkKind, Topology, build_hierarchy, connected_groups

# Two measured costs closer than this factor are the same class of link (gloo on a busy host
# jitters by tens of percent, at times 2x; a 100 Mbit/s link against 1 Gbit/s is 10x).
GAP = 3.0


def pair_cost_us(link, message_bytes: int) -> float | None:
    """Microseconds of ``message_bytes`` at a link's measured bandwidth, None if unmeasured."""
    if link.bandwidth_source != "measured" or not link.bandwidth_gbps:
        return None
    return message_bytes / (link.bandwidth_gbps * 1e3)


def _single_linkage(members: list[list[int]], cost, gap: float) -> list[list[list[int]]]:
    """Partitions of ``members`` (groups of devices, merged whole) joined at each gap of the
    sorted pair costs ``cost(i, j)`` between members, finest first, the last one group."""
    m = len(members)
    costs = {(i, j): cost(i, j) for i in range(m) for j in range(i + 1, m)}
    ordered = sorted(set(costs.values()))
    cuts = [lo for lo, hi in itertools.pairwise(ordered) if hi > gap * lo] + ordered[-1:]
    out: list[list[list[int]]] = []
    for cut in cuts:
        joined = connected_groups(m, [pair for pair, c in costs.items() if c <= cut])
        groups = sorted((sorted(d for i in comp for d in members[i]) for comp in joined), key=lambda g: g[0])
        if not out or groups != out[-1]:
            out.append(groups)
    return out


def measured_levels(topo: Topology, message_bytes: int, gap: float = GAP) -> list[HierarchyLevel] | None:
    """The hierarchy the measured pair costs of ``topo`` give (fastest first), or None when a
    pair is unmeasured.

    Across nodes (``net`` links present), the nodes are what is clustered: a node's own levels are
    its link classes' (its ranks share a host: loopback, however a busy host jitters), and the
    cost between two nodes is the median of their ranks' pair costs; the levels joining nodes are
    ``net`` levels, the faster islands of nodes first. Without ``net`` links, the devices
    themselves are clustered, each level's kind the slowest link class it joins across."""
    n = len(topo)
    if n == 1:
        return None
    costs: dict[tuple[int, int], float] = {}
    for link in topo.links:
        c = pair_cost_us(link, message_bytes)
        if c is None:
            return None
        costs[(link.a, link.b)] = c
    by_class = build_hierarchy(n, topo.links)
    if by_class[-1].kind == LinkKind.NET.value:
        inner = [h for h in by_class if h.kind != LinkKind.NET.value]
        nodes = inner[-1].groups if inner else [[r] for r in range(n)]

        def node_cost(i: int, j: int) -> float:
            return statistics.median(costs[(min(a, b), max(a, b))] for a in nodes[i] for b in nodes[j])

        joined = _single_linkage([list(g) for g in nodes], node_cost, gap)
        levels = [HierarchyLevel(h.kind, [list(g) for g in h.groups]) for h in inner]
        levels += [HierarchyLevel(LinkKind.NET.value, groups) for groups in joined if len(groups) < len(nodes)
                   or len(nodes) == 1]
        if not levels or len(levels[-1].groups) != 1:
            levels.append(HierarchyLevel(LinkKind.NET.value, [list(range(n))]))
        return levels
    levels = []
    for groups in _single_linkage([[r] for r in range(n)], lambda i, j: costs[(i, j)], gap):
        gid = {r: k for k, g in enumerate(groups) for r in g}
        kinds = [topo.link(a, b).kind for (a, b) in costs if gid[a] == gid[b]]
        kind = max(kinds, key=lambda k: k.rank) if kinds else LinkKind.UNKNOWN
        levels.append(HierarchyLevel(kind.value, groups))
    return levels


def with_measured_hierarchy(topo: Topology, message_bytes: int, gap: float = GAP) -> Topology:
    """``topo`` with :attr:`Topology.measured_hierarchy` set where the measured levels differ
    from those of the link classes (else unchanged: the classes already say it)."""
    levels = measured_levels(topo, message_bytes, gap)
    if levels is None:
        return topo
    by_class = [h.groups for h in topo.replace(measured_hierarchy=None).hierarchy]
    if [h.groups for h in levels] == by_class:
        return topo.replace(measured_hierarchy=None)
    return topo.replace(measured_hierarchy=levels)


__all__ = ["GAP", "measured_levels", "pair_cost_us", "with_measured_hierarchy"]
