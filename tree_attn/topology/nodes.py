"""Several nodes as one topology: each node's devices and links repeated, and a ``net`` link
between every pair of devices on different nodes. The hierarchy then ends with the network, the
slowest class, so a hierarchical plan merges inside each node first and sends one message per
node across the network. Plain Python, no torch."""

from __future__ import annotations

import dataclasses

from ..errors import TopologyError
from ..validate import check_int
from .model import Link, LinkKind, P2PStatus, Topology


def multinode_topology(node: Topology, nodes: int) -> Topology:
    """``nodes`` copies of ``node`` (devices renumbered node by node) joined by network links."""
    check_int(nodes, "nodes", minimum=1, error=TopologyError)
    if nodes == 1:
        return node
    g = len(node)
    devices, links = [], []
    for n in range(nodes):
        for d in node.devices:
            devices.append(dataclasses.replace(d, index=n * g + d.index))
        for l in node.links:
            links.append(dataclasses.replace(l, a=n * g + l.a, b=n * g + l.b))
    for a in range(nodes * g):
        for b in range(a + 1, nodes * g):
            if a // g != b // g:
                links.append(Link(a, b, LinkKind.NET, p2p=P2PStatus.UNSUPPORTED, p2p_reason="another node"))
    notes = list(node.notes) + [f"{nodes} nodes x {g} devices, joined by the network"]
    return Topology(devices=devices, links=links, source=f"{node.source} x{nodes} nodes", notes=notes)
