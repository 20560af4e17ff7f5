"""Built-in cluster presets: parameters from datasheets and NCCL's own latency model, not measured
here. Each value cites its source; "assumed" marks a figure no source pins down, which
``benchmarks/calibrate_costmodel.py`` replaces with a measurement when run on the real machine.

Sources:
- [H100] NVIDIA H100 Tensor Core GPU datasheet: H100 SXM5 80 GB HBM3 at 3.35 TB/s; NVLink 4 at
  900 GB/s per GPU, i.e. 18 links x 25 GB/s = 450 GB/s per direction (``topology.bandwidth``).
- [MI300X] AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s; 7 x16 Infinity Fabric (xGMI)
  links per GPU, one to each peer of the hive, 64 GB/s per link per direction (``topology.bandwidth``).
- [4090] NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X at 1,008 GB/s; PCIe 4.0 x16 =
  16 x 1.969 = 31.5 GB/s per direction (``topology.bandwidth``); no GPU peer-to-peer on GeForce
  drivers, so NCCL stages every message through host memory (its SHM transport: a device-to-host
  and a host-to-device copy, about half the link rate, and a host-side handshake).
- [NDR] NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s per port = 50 GB/s per direction;
  DGX H100 has one 400 Gb/s NIC per GPU (NVIDIA DGX H100 user guide: 8 x ConnectX-7 for compute).
- [NCCL] NCCL's cost model, src/graph/tuning.cc: ``baseLat`` (a collective's fixed latency, LL
  protocol: 3.6-6.8 us across versions) and ``hwLat`` per hop (LL protocol, ring / tree):
  NVLink ~0.5 us, PCIe ~1.0 us, network 2.7 / 5.0 us.
- [perf] ``kernels.perf_model.DeviceSpec``: datasheet bandwidth is a peak copies reach ~90% of;
  launch gap ~2.5 us per kernel; DESIGN.md: on an H100 the decode kernel alone runs at the
  card's copy bandwidth.
"""

from __future__ import annotations

from ..errors import ConfigError
from .params import ClusterSpec, DeviceParams, LinkParams

# -- links -----------------------------------------------------------------------------------
NVSWITCH_H100 = LinkParams(
    "nvlink", p2p_latency_us=5.0, p2p_gbps=450.0, ar_step_us=0.5, ar_gbps=360.0,
    source="[H100] 450 GB/s per direction; [NCCL] baseLat ~4.4 us + NVLink hop ~0.5 us per message; "
           "all-reduce bus bandwidth assumed 80% of the link rate",
)
IB_NDR_400G = LinkParams(
    "network", p2p_latency_us=7.1, p2p_gbps=50.0, ar_step_us=5.0, ar_gbps=45.0,
    source="[NDR] 50 GB/s per GPU; [NCCL] baseLat ~4.4 us + network hop 2.7 us (ring LL) per message, "
           "5.0 us per tree hop; all-reduce bandwidth assumed 90% of line rate",
)
XGMI_MI300X = LinkParams(
    "xgmi", p2p_latency_us=7.0, p2p_gbps=64.0, ar_step_us=2.5, ar_gbps=48.0,
    source="[MI300X] one 64 GB/s link per peer; latencies assumed: [NCCL] NVLink figures + 2 us for RCCL; "
           "all-reduce bandwidth assumed 75% of a link",
)
ROCE_400G = LinkParams(
    "network", p2p_latency_us=8.1, p2p_gbps=50.0, ar_step_us=6.0, ar_gbps=45.0,
    source="assumed: 400 GbE RoCE per GPU (as the H100 preset's NICs), the InfiniBand figures + 1 us for RoCE",
)
PCIE_HOST_4090 = LinkParams(
    "pcie_host", p2p_latency_us=15.0, p2p_gbps=12.0, ar_step_us=6.0, ar_gbps=10.0,
    source="[4090] PCIe 4.0 x16 31.5 GB/s staged through host memory: assumed ~40% of it; latencies assumed "
           "(two copies and a host handshake per message, tens of us)",
)
ETH_100G = LinkParams(
    "network", p2p_latency_us=15.0, p2p_gbps=12.5, ar_step_us=10.0, ar_gbps=11.0,
    source="assumed: one 100 GbE NIC per node (12.5 GB/s), TCP/RoCE latencies of ~10-15 us",
)

# -- devices ---------------------------------------------------------------------------------
H100_SXM = DeviceParams(
    "NVIDIA H100 SXM5 80GB", mem_gbps=3350.0, kernel_fraction=0.85, kernel_fixed_us=5.0, merge_us=8.0,
    collective_us=5.0, memory_bytes=81_559 * 2**20,
    source="[H100] 3.35 TB/s; [perf] kernel at ~copy bandwidth (~85-90% of peak), 2 kernels x 2.5 us; "
           "merge = a few small kernels; [NCCL] baseLat ~5 us per all-reduce; memory: the 81,559 MiB "
           "nvidia-smi reports for an H100 80GB",
)
MI300X = DeviceParams(
    "AMD Instinct MI300X", mem_gbps=5300.0, kernel_fraction=0.75, kernel_fixed_us=8.0, merge_us=12.0,
    collective_us=6.0, memory_bytes=192 * 2**30,
    source="[MI300X] 5.3 TB/s, 192 GB (binary: 8 stacks of 24 GiB); kernel fraction assumed (not measured on "
           "MI300X); [perf] launch gap 4 us on AMD: 2 kernels for the attention, ~3 for the merge; RCCL's "
           "all-reduce base latency assumed [NCCL]'s + 20%",
)
RTX_4090 = DeviceParams(
    "NVIDIA GeForce RTX 4090", mem_gbps=1008.0, kernel_fraction=0.85, kernel_fixed_us=5.0, merge_us=8.0,
    collective_us=8.0, memory_bytes=24_564 * 2**20,
    source="[4090] 1,008 GB/s; kernel fraction and launches as [perf] for H100 (assumed); memory: the "
           "24,564 MiB nvidia-smi reports for a 24 GB card",
)

# A decode step replayed as one CUDA graph: one graph launch (assumed ~5 us of host time that
# the device waits for at batch 1).
GRAPH_STEP_US = 5.0

PRESETS: dict[str, ClusterSpec] = {
    "h100-sxm": ClusterSpec("h100-sxm", H100_SXM, ranks_per_node=8, nodes=1, intra=NVSWITCH_H100,
                            network=IB_NDR_400G, step_overhead_us=GRAPH_STEP_US,
                            notes=("8x H100 SXM5 per node on NVSwitch, one 400G InfiniBand NIC per GPU",)),
    "mi300x": ClusterSpec("mi300x", MI300X, ranks_per_node=8, nodes=1, intra=XGMI_MI300X,
                          network=ROCE_400G, step_overhead_us=GRAPH_STEP_US,
                          notes=("8x MI300X per node, all-to-all xGMI, one 400G RoCE NIC per GPU (assumed)",)),
    "rtx4090-pcie": ClusterSpec("rtx4090-pcie", RTX_4090, ranks_per_node=8, nodes=1, intra=PCIE_HOST_4090,
                                network=ETH_100G, step_overhead_us=GRAPH_STEP_US,
                                notes=("8x RTX 4090 on PCIe without peer-to-peer, 100 GbE between nodes (assumed)",)),
}


def preset_for_device(device_name: str) -> str:
    """The name of the built-in cluster whose GPUs are most like ``device_name``: the one to borrow
    links and a network from where a machine cannot measure them (AMD Instinct: ``mi300x``;
    GeForce: ``rtx4090-pcie``; any other: ``h100-sxm``)."""
    low = device_name.lower()
    if "instinct" in low or "mi3" in low or "amd" in low:
        return "mi300x"
    if "geforce" in low or "rtx" in low:
        return "rtx4090-pcie"
    return "h100-sxm"


def preset(name: str) -> ClusterSpec:
    """A built-in cluster preset by name."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown cluster preset {name!r}; choose one of {', '.join(PRESETS)}") from None
