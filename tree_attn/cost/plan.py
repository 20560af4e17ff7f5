"""A napkin model of one all-ranks merge under a reduction plan, from the topology's links.

Used where nothing can be timed: the built-in profiles (derived from recorded topology dumps) and
``tune`` from a topology file. Its numbers are rough order-of-magnitude figures, not measurements;
only its ordering of plans is used, and a profile says ``chosen_by: model`` wherever it decided.

The model is LogP-like. A message over a link costs a per-message software overhead ``o`` at the
sender and the receiver (posting the send/recv: a NCCL/RCCL launch on GPUs, a gloo TCP write on
CPU ranks), a wire latency ``L``, and ``bytes / bw`` on the link. A tree node receives its children
concurrently (``reduce.merges.TreeMerge`` posts all receives as one batch, then merges once) and
posts its downward sends as one batch. The all-reduce form is two ring all-reduces (max of lse, then sum of the
packed state), ``2 (p-1)`` steps each at the slowest link's per-step latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..reduce.plan import ReductionPlan
from ..topology.model import Link, LinkKind, P2PStatus, Topology


@dataclass(frozen=True)
class LinkCost:
    """Per-message overhead ``o_us``, wire latency ``latency_us``, bandwidth ``gbps`` (GB/s),
    and ``step_us``: the latency of one step of a ring all-reduce over this link class."""

    o_us: float
    latency_us: float
    gbps: float
    step_us: float


# Rough figures (not measured here): NCCL send/recv and LL-protocol all-reduce steps on NVLink
# take a few microseconds; RCCL over xGMI a little more; PCIe without peer-to-peer stages every
# message through host memory (a device-to-host and a host-to-device copy plus a host-side
# handshake, NCCL's SHM transport), tens of microseconds; gloo over loopback TCP pays a syscall
# and a wake-up per message. Bandwidths are used only for the (small) per-message byte term.
NVLINK = LinkCost(o_us=6.0, latency_us=3.0, gbps=300.0, step_us=1.0)
XGMI = LinkCost(o_us=8.0, latency_us=5.0, gbps=48.0, step_us=2.0)
PCIE_P2P = LinkCost(o_us=6.0, latency_us=6.0, gbps=22.0, step_us=2.5)
PCIE_HOST_STAGED = LinkCost(o_us=6.0, latency_us=15.0, gbps=10.0, step_us=6.0)
GLOO_CPU = LinkCost(o_us=15.0, latency_us=25.0, gbps=3.0, step_us=25.0)
NETWORK = LinkCost(o_us=8.0, latency_us=10.0, gbps=25.0, step_us=8.0)
# One exact merge of a handful of [B, H, D+1] states: a few small kernels on a GPU, a few torch
# ops on a CPU.
MERGE_US = {"cuda": 8.0, "rocm": 10.0, "cpu": 20.0}


def link_cost(link: Link, cpu: bool) -> LinkCost:
    """The cost figures of one link (CPU ranks always talk through gloo)."""
    if cpu:
        return GLOO_CPU
    if link.kind is LinkKind.NVLINK:
        base = NVLINK
    elif link.kind is LinkKind.XGMI:
        base = XGMI
    elif link.kind is LinkKind.NET:
        base = NETWORK
    elif link.p2p is P2PStatus.OK:
        base = PCIE_P2P
    else:
        # Unknown peer-to-peer status is priced as unsupported: the slower case is the safe guess.
        base = PCIE_HOST_STAGED
    if link.bandwidth_gbps:
        # A reported or estimated link bandwidth beats the class default (bytes term only).
        base = LinkCost(base.o_us, base.latency_us, float(link.bandwidth_gbps), base.step_us)
    return base


def predict_plan_us(plan: ReductionPlan, topology: Topology, message_bytes: int) -> float:
    """Predicted microseconds for every rank to hold the merged state under ``plan``
    (rank r on device r; ``message_bytes`` per packed partial state)."""
    n = len(topology)
    cpu = all(d.vendor == "cpu" for d in topology.devices)
    merge_us = MERGE_US["cpu" if cpu else ("rocm" if any(d.vendor == "amd" for d in topology.devices) else "cuda")]
    if n == 1:
        return 0.0

    def cost(a: int, b: int) -> LinkCost:
        return link_cost(topology.link(a, b), cpu)

    def xfer(c: LinkCost) -> float:
        return message_bytes / (c.gbps * 1e3)  # GB/s -> bytes per microsecond

    if plan.strategy == "allreduce":
        worst = max((link_cost(l, cpu) for l in topology.links), key=lambda c: (c.step_us, -c.gbps))
        ring_bytes = 2 * (n - 1) / n * xfer(worst)
        # lse max (4 bytes per head: the byte term is negligible) + packed sum, then the local rescale.
        return 2 * (worst.o_us + 2 * (n - 1) * worst.step_us) + ring_bytes + merge_us

    tree = plan.tree(n)
    up: dict[int, float] = {}

    def ready(node: int) -> float:
        kids = tree.children[node]
        if not kids:
            up[node] = 0.0
            return 0.0
        arrivals = []
        for c in kids:
            lc = cost(c, node)
            arrivals.append(ready(c) + lc.o_us + lc.latency_us + xfer(lc))
        posting = len(kids) * max(cost(c, node).o_us for c in kids)
        ingress = sum(xfer(cost(c, node)) for c in kids[1:])
        up[node] = max(max(arrivals), posting) + ingress + merge_us
        return up[node]

    root = tree.root
    t_root = ready(root)
    finish = 0.0
    stack = [(root, t_root)]
    while stack:
        node, t = stack.pop()
        finish = max(finish, t)
        sent = t
        for c in tree.children[node]:
            lc = cost(node, c)
            sent += lc.o_us
            stack.append((c, sent + lc.latency_us + xfer(lc) + lc.o_us))
    return finish


def decode_message_bytes(batch: int, q_heads: int, head_dim: int) -> int:
    """Bytes of one packed partial state: float32 ``[B, Hq, D + 1]`` (``reduce.merges``)."""
    return 4 * batch * q_heads * (head_dim + 1)
