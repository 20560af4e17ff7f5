"""The link classes of the cost models and their one cost table. Pure data.

Units: microseconds, GB/s (10**9 B/s) in one direction, bytes. :data:`LINK_COSTS` gives every
class's figures where nothing was measured; the step model (``simulate``: :mod:`tree_attn.cost.step`)
and the plan pricing (``tune`` from a topology, the built-in profiles: :mod:`tree_attn.cost.plan`)
both read it, so they agree by construction. Each value cites its source; "assumed" marks a figure
no source pins down, which ``benchmarks/calibrate_costmodel.py`` replaces with a measurement when
run on the real machine.

Sources:
- [H100] NVIDIA H100 Tensor Core GPU datasheet: NVLink 4 at 900 GB/s per GPU, i.e. 18 links x
  25 GB/s = 450 GB/s per direction (``topology.bandwidth``).
- [MI300X] AMD Instinct MI300X datasheet: 7 x16 Infinity Fabric (xGMI) links per GPU, one to each
  peer of the hive, 64 GB/s per link per direction (``topology.bandwidth``).
- [4090] NVIDIA GeForce RTX 4090 specifications: PCIe 4.0 x16 = 16 x 1.969 = 31.5 GB/s per
  direction (``topology.bandwidth``); no GPU peer-to-peer on GeForce drivers, so NCCL stages every
  message through host memory (its SHM transport: a device-to-host and a host-to-device copy,
  about half the link rate, and a host-side handshake).
- [NDR] NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s per port = 50 GB/s per direction;
  DGX H100 has one 400 Gb/s NIC per GPU (NVIDIA DGX H100 user guide: 8 x ConnectX-7 for compute).
- [NCCL] NCCL's cost model, src/graph/tuning.cc: ``baseLat`` (a collective's fixed latency, LL
  protocol: 3.6-6.8 us across versions) and ``hwLat`` per hop (LL protocol, ring / tree):
  NVLink ~0.5 us, PCIe ~1.0 us, network 2.7 / 5.0 us.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from ..validate import check_number

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
        def number(name: str, **kw) -> None:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_number(value, f"{self.kind}.{name}", **kw))

        number("bulk_gbps", positive=True)
        number("bulk_latency_us")
        number("bulk_cpu_fraction", positive=True, maximum=1.0)
        if self.kind not in LINK_CLASSES:
            raise ConfigError(f"link class {self.kind!r}: expected one of {', '.join(LINK_CLASSES)}")
        for name in ("p2p_latency_us", "ar_step_us"):
            number(name)
        for name in ("p2p_gbps", "ar_gbps"):
            number(name, positive=True)

    def p2p_us(self, nbytes: float) -> float:
        """Time of one point-to-point message of ``nbytes``: alpha + bytes / beta."""
        return self.p2p_latency_us + nbytes / (self.p2p_gbps * 1e3)

    def bulk_us(self, nbytes: float) -> float:
        """Time of a ring round's exchange of ``nbytes`` each way: alpha + bytes / bulk beta."""
        alpha = self.p2p_latency_us if self.bulk_latency_us is None else self.bulk_latency_us
        return alpha + nbytes / ((self.bulk_gbps or self.p2p_gbps) * 1e3)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the classes' figures --------------------------------------------------------------------
NVSWITCH_H100 = LinkParams(
    "nvlink", p2p_latency_us=5.0, p2p_gbps=450.0, ar_step_us=0.5, ar_gbps=360.0,
    source="[H100] 450 GB/s per direction; [NCCL] baseLat ~4.4 us + NVLink hop ~0.5 us per message; "
           "all-reduce bus bandwidth assumed 80% of the link rate",
)
XGMI_MI300X = LinkParams(
    "xgmi", p2p_latency_us=7.0, p2p_gbps=64.0, ar_step_us=2.5, ar_gbps=48.0,
    source="[MI300X] one 64 GB/s link per peer; latencies assumed: [NCCL] NVLink figures + 2 us for RCCL; "
           "all-reduce bandwidth assumed 75% of a link",
)
# PCIe with P2P and the cross-socket path: NCCL's PCI hop latency ([NCCL]) and PCIe 4.0 x16 rates.
PCIE_P2P = LinkParams("pcie_p2p", 6.0, 22.0, 1.0, 20.0, source="assumed: PCIe 4.0 x16 with P2P, ~70% of 31.5 GB/s")
PCIE_HOST_4090 = LinkParams(
    "pcie_host", p2p_latency_us=15.0, p2p_gbps=12.0, ar_step_us=6.0, ar_gbps=10.0,
    source="[4090] PCIe 4.0 x16 31.5 GB/s staged through host memory: assumed ~40% of it; latencies assumed "
           "(two copies and a host handshake per message, tens of us)",
)
CROSS_SOCKET = LinkParams("cross_socket", 10.0, 10.0, 3.0, 8.0,
                          source="assumed: PCIe across the CPU sockets' interconnect, staged")
HOST_LOOPBACK = LinkParams("host_loopback", 50.0, 2.0, 50.0, 2.0,
                           source="assumed: gloo over loopback TCP (measure with probe --measure)")
IB_NDR_400G = LinkParams(
    "network", p2p_latency_us=7.1, p2p_gbps=50.0, ar_step_us=5.0, ar_gbps=45.0,
    source="[NDR] 50 GB/s per GPU; [NCCL] baseLat ~4.4 us + network hop 2.7 us (ring LL) per message, "
           "5.0 us per tree hop; all-reduce bandwidth assumed 90% of line rate",
)
ROCE_400G = LinkParams(
    "network", p2p_latency_us=8.1, p2p_gbps=50.0, ar_step_us=6.0, ar_gbps=45.0,
    source="assumed: 400 GbE RoCE per GPU (as the H100 preset's NICs), the InfiniBand figures + 1 us for RoCE",
)
ETH_100G = LinkParams(
    "network", p2p_latency_us=15.0, p2p_gbps=12.5, ar_step_us=10.0, ar_gbps=11.0,
    source="assumed: one 100 GbE NIC per node (12.5 GB/s), TCP/RoCE latencies of ~10-15 us",
)

# The one link-class cost table: each class's figures where nothing was measured.
LINK_COSTS: dict[str, LinkParams] = {
    "nvlink": NVSWITCH_H100,
    "xgmi": XGMI_MI300X,
    "pcie_p2p": PCIE_P2P,
    "pcie_host": PCIE_HOST_4090,
    "cross_socket": CROSS_SOCKET,
    "host_loopback": HOST_LOOPBACK,
    "network": IB_NDR_400G,
}

# Networks a simulated cluster's nodes can be joined by (``simulate --network``).
NETWORKS: dict[str, LinkParams] = {"ib-400g": IB_NDR_400G, "eth-100g": ETH_100G}


def link_class(link, cpu: bool) -> str:
    """The cost-model class of a topology :class:`~tree_attn.topology.model.Link` (CPU ranks
    always talk through gloo over loopback)."""
    from ..topology.model import LinkKind, P2PStatus

    if cpu:
        return "host_loopback"
    kind = link.kind
    if kind is LinkKind.NVLINK:
        return "nvlink"
    if kind is LinkKind.XGMI:
        return "xgmi"
    if kind is LinkKind.NET:
        return "network"
    if kind is LinkKind.SYS:
        return "cross_socket"
    # Unknown peer-to-peer status is priced as unsupported: the slower case is the safe guess.
    return "pcie_p2p" if link.p2p is P2PStatus.OK else "pcie_host"


__all__ = ["LINK_CLASSES", "LINK_COSTS", "NETWORKS", "LinkParams", "link_class"]
