"""The host fallback: N CPU ranks on this machine, talking through gloo.

Used when no GPU or no vendor library is available, so that the rest of the tool (plans, the
decode loop, tests) still runs. Ranks on one host exchange messages through host memory (gloo
over loopback TCP); there is no device peer-to-peer, and all pairs are alike.
"""

from __future__ import annotations

from ..errors import TopologyError
from ..validate import check_int
from .model import Device, Link, LinkKind, P2PStatus, Topology

# The one default number of CPU ranks, for probe, check, tune and run alike: their topologies,
# hence their fingerprints and the profile a run finds, must agree (the built-in CPU profile is
# for 4 ranks). On fewer cores `run` warns that the ranks share them.
DEFAULT_CPU_RANKS = 4


def default_cpu_ranks() -> int:
    """The default number of CPU ranks: :data:`DEFAULT_CPU_RANKS`, whatever the core count."""
    return DEFAULT_CPU_RANKS


def host_topology(n: int | None = None, *, note: str | None = None) -> Topology:
    """A topology of ``n`` CPU ranks (default :func:`default_cpu_ranks`).

    Every pair is a ``sys`` link (through host memory) with peer-to-peer not applicable; the
    hierarchy is one level, one group. Bandwidths are unknown until measured.
    """
    if n is None:
        n = default_cpu_ranks()
    check_int(n, "cpu ranks", minimum=1, error=TopologyError)
    from ..launch.env import check_cpu_ranks

    check_cpu_ranks(n, "CPU ranks")  # before n (n - 1) / 2 links are built
    devices = [Device(index=i, vendor="cpu", name="cpu rank") for i in range(n)]
    links = [
        Link(a, b, LinkKind.SYS, p2p=P2PStatus.UNSUPPORTED,
             p2p_reason="CPU ranks: messages go through host memory (gloo)")
        for a in range(n)
        for b in range(a + 1, n)
    ]
    notes = [note] if note else []
    return Topology(devices=devices, links=links, source="host", notes=notes)
