"""Built-in cluster presets: parameters from datasheets and NCCL's own latency model, not measured
here. Each value cites its source; "assumed" marks a figure no source pins down, which
``benchmarks/calibrate_costmodel.py`` replaces with a measurement when run on the real machine.
The links' figures and their sources are the link-class table's (:mod:`tree_attn.cost.links`), a
card's name, bandwidth, memory and launch gap the device catalogue's (:mod:`tree_attn.cost.devices`).

Sources:
- [H100] NVIDIA H100 Tensor Core GPU datasheet: H100 SXM5 80 GB HBM3 at 3.35 TB/s.
- [MI300X] AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s.
- [4090] NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X at 1,008 GB/s.
- [NCCL] NCCL's cost model, src/graph/tuning.cc: ``baseLat``, a collective's fixed latency (LL
  protocol: 3.6-6.8 us across versions).
- [perf] ``cost.devices.DeviceSpec``: datasheet bandwidth is a peak copies reach ~90% of; launch
  gap ~2.5 us per kernel (4 us on AMD); DESIGN.md: on an H100 the decode kernel alone runs at the
  card's copy bandwidth.
"""

from __future__ import annotations

from ..errors import ConfigError
from .devices import CPU_INTERPRETER, KNOWN_DEVICES
from .links import ETH_100G, IB_NDR_400G, LINK_COSTS, ROCE_400G, LinkParams
from .params import ClusterSpec, DeviceParams

# -- devices ---------------------------------------------------------------------------------
# The local attention's fixed cost is the split-KV kernel's two launches ([perf] launch gap).
H100_SXM = DeviceParams.from_spec(
    KNOWN_DEVICES["h100-sxm"], kernel_fraction=0.85, merge_us=8.0, collective_us=5.0,
    source="[H100] 3.35 TB/s; [perf] kernel at ~copy bandwidth (~85-90% of peak), 2 kernels x 2.5 us; "
           "merge = a few small kernels; [NCCL] baseLat ~5 us per all-reduce; memory: the 81,559 MiB "
           "nvidia-smi reports for an H100 80GB",
)
MI300X = DeviceParams.from_spec(
    KNOWN_DEVICES["mi300x"], kernel_fraction=0.75, merge_us=12.0, collective_us=6.0,
    source="[MI300X] 5.3 TB/s, 192 GB (binary: 8 stacks of 24 GiB); kernel fraction assumed (not measured on "
           "MI300X); [perf] launch gap 4 us on AMD: 2 kernels for the attention, ~3 for the merge; RCCL's "
           "all-reduce base latency assumed [NCCL]'s + 20%",
)
RTX_4090 = DeviceParams.from_spec(
    KNOWN_DEVICES["rtx4090"], kernel_fraction=0.85, merge_us=8.0, collective_us=8.0,
    source="[4090] 1,008 GB/s; kernel fraction and launches as [perf] for H100 (assumed); memory: the "
           "24,564 MiB nvidia-smi reports for a 24 GB card",
)
# CPU ranks priced before anything was calibrated (a CPU topology's merge plans): the merge is a
# few torch ops on a CPU (assumed ~20 us). The local attention is not priced from this: simulate
# wants measured CPU parameters (benchmarks/calibrate_costmodel.py).
CPU_RANK = DeviceParams.from_spec(
    CPU_INTERPRETER, name="cpu rank", kernel_fraction=1.0, kernel_fixed_us=0.0, merge_us=20.0, collective_us=0.0,
    overlap=False, source="assumed: the merge ~20 us of torch ops; no calibration (for pricing merges only)",
)

# A decode step replayed as one CUDA graph: one graph launch (assumed ~5 us of host time that
# the device waits for at batch 1).
GRAPH_STEP_US = 5.0


def _node8(name: str, device: DeviceParams, intra: LinkParams, network: LinkParams, note: str) -> ClusterSpec:
    return ClusterSpec(name, device, ranks_per_node=8, nodes=1, intra=intra, network=network,
                       step_overhead_us=GRAPH_STEP_US, notes=(note,))


PRESETS: dict[str, ClusterSpec] = {
    "h100-sxm": _node8("h100-sxm", H100_SXM, LINK_COSTS["nvlink"], IB_NDR_400G,
                       "8x H100 SXM5 per node on NVSwitch, one 400G InfiniBand NIC per GPU"),
    "mi300x": _node8("mi300x", MI300X, LINK_COSTS["xgmi"], ROCE_400G,
                     "8x MI300X per node, all-to-all xGMI, one 400G RoCE NIC per GPU (assumed)"),
    "rtx4090-pcie": _node8("rtx4090-pcie", RTX_4090, LINK_COSTS["pcie_host"], ETH_100G,
                           "8x RTX 4090 on PCIe without peer-to-peer, 100 GbE between nodes (assumed)"),
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
