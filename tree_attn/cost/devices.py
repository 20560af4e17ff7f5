"""The device catalogue: what the cost models know about an accelerator, from datasheets and
published microbenchmarks (each field says which). Pure data, no torch: a live device's properties
are read by :mod:`tree_attn.cost.probe`.

A :class:`DeviceSpec` is what the kernel's napkin model (:mod:`tree_attn.cost.kernel`) needs; the
step model's :class:`~tree_attn.cost.params.DeviceParams` of a catalogued card take its name,
bandwidth, memory and launch gap from here (``DeviceParams.from_spec``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from ..validate import check_int, check_number, check_str

VENDORS = ("nvidia", "amd", "cpu")
BANDWIDTH_SOURCES = ("datasheet", "measured", "assumed")


@dataclass(frozen=True)
class DeviceSpec:
    """What the cost models need to know about one accelerator.

    Attributes:
        name: marketing name (as the driver reports it when read from a device).
        vendor: "nvidia", "amd" or "cpu" (the Triton interpreter).
        sm_count: streaming multiprocessors (NVIDIA) or compute units (AMD).
        mem_bandwidth_gbps: DRAM bandwidth in GB/s (1e9 bytes/s).
        bandwidth_source: "datasheet" (peak, not reachable: copies reach ~90%), "measured" (a
            device-to-device copy on this card) or "assumed" (unknown device: a guess, measure it).
        l2_bytes: last-level on-chip cache (L2; on MI300X the L2 of all XCDs, Infinity Cache not counted).
        smem_per_sm_bytes: shared memory (NVIDIA) or LDS (AMD) per SM/CU.
        max_warps_per_sm: resident warps (wavefronts on AMD) per SM/CU.
        warp_size: 32 on NVIDIA, 64 on AMD CDNA.
        regs_per_sm: 32-bit registers per SM (VGPR file per CU on AMD, in 32-bit lanes).
        mem_latency_ns: loaded DRAM latency, from microbenchmarks (rough).
        tensor_tflops: dense bf16 tensor-core peak with fp32 accumulation (datasheet).
        launch_gap_us: GPU time between back-to-back kernels plus a small kernel's fixed cost.
        per_sm_bandwidth_gbps: DRAM bandwidth one SM/CU can pull on its own (rough; ``None`` =
            twice its fair share, i.e. half the SMs saturate DRAM). This is why a batch-1 decode
            with one program per KV head (8 SMs busy) reaches a small fraction of the card's bandwidth.
        memory_bytes: the device's memory as the driver reports it (None: not catalogued).
    """

    name: str
    vendor: str
    sm_count: int
    mem_bandwidth_gbps: float
    bandwidth_source: str = "datasheet"
    l2_bytes: int = 0
    smem_per_sm_bytes: int = 228 * 1024
    max_warps_per_sm: int = 64
    warp_size: int = 32
    regs_per_sm: int = 65536
    mem_latency_ns: float = 650.0
    tensor_tflops: float = 300.0
    launch_gap_us: float = 2.5
    per_sm_bandwidth_gbps: float | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        check_str(self.name, "DeviceSpec.name", must=True)
        check_str(self.vendor, "DeviceSpec.vendor", choices=VENDORS, must=True)
        check_str(self.bandwidth_source, "DeviceSpec.bandwidth_source", choices=BANDWIDTH_SOURCES, must=True)
        for name in ("sm_count", "max_warps_per_sm", "warp_size", "regs_per_sm", "smem_per_sm_bytes"):
            check_int(getattr(self, name), f"DeviceSpec.{name}", positive=True, must=True)
        check_int(self.l2_bytes, "DeviceSpec.l2_bytes", minimum=0, must=True)
        check_int(self.memory_bytes, "DeviceSpec.memory_bytes", positive=True, optional=True, must=True)
        for name in ("mem_bandwidth_gbps", "mem_latency_ns", "tensor_tflops"):
            check_number(getattr(self, name), f"DeviceSpec.{name}", positive=True, must=True)
        check_number(self.launch_gap_us, "DeviceSpec.launch_gap_us", must=True)
        check_number(self.per_sm_bandwidth_gbps, "DeviceSpec.per_sm_bandwidth_gbps", positive=True, optional=True,
                     must=True)

    @property
    def sm_bandwidth_gbps(self) -> float:
        """What one SM/CU can stream from DRAM by itself (see ``per_sm_bandwidth_gbps``)."""
        if self.per_sm_bandwidth_gbps is not None:
            return float(self.per_sm_bandwidth_gbps)
        return 2.0 * self.mem_bandwidth_gbps / self.sm_count

    @property
    def achievable_bandwidth_gbps(self) -> float:
        """Bandwidth a perfect streaming kernel reaches: the measured copy rate, or ~90% of a datasheet peak."""
        return self.mem_bandwidth_gbps * (1.0 if self.bandwidth_source == "measured" else 0.9)

    def with_measured_bandwidth(self, gbps: float) -> DeviceSpec:
        """A copy whose bandwidth is ``gbps`` measured on this card (e.g. by a device-to-device copy)."""
        return replace(self, mem_bandwidth_gbps=float(gbps), bandwidth_source="measured")

    @classmethod
    def from_torch_device(cls, device: Any = None) -> DeviceSpec:
        """The spec of a live torch device (:func:`tree_attn.cost.probe.probe_device_spec`, which
        imports torch)."""
        from .probe import probe_device_spec

        return probe_device_spec(device)


MiB = 1024 * 1024
KiB = 1024

# Datasheet numbers (bandwidth, SMs, L2, shared memory, dense bf16 tensor peak). DRAM latencies are
# rounded figures from microbenchmark papers (Hopper/Ampere ~500-700 ns loaded, GDDR6X similar,
# MI300X ~800+ ns); launch gaps are typical back-to-back gaps seen in profiles; per-SM bandwidths
# are order-of-magnitude figures (one SM's load path and outstanding-miss limits let it stream a
# few tens of GB/s, so roughly half the SMs must be busy to saturate HBM). All "rough". Memory: the
# 81,559 MiB nvidia-smi reports for an H100 80GB, the 24,564 MiB it reports for a 24 GB RTX 4090,
# MI300X's 192 GB (binary: 8 stacks of 24 GiB); H100 PCIe 81,559, H100 NVL 95,830, H200 143,771,
# A100 80GB 81,920 and A100 40GB 40,960 MiB (nvidia-smi's totals).
# What every card of one NVIDIA architecture shares (L2, shared memory, resident warps, DRAM latency,
# launch gap); each row below gives what differs.
_HOPPER = dict(vendor="nvidia", l2_bytes=50 * MiB, smem_per_sm_bytes=228 * KiB, max_warps_per_sm=64,
               mem_latency_ns=650.0, launch_gap_us=2.5)
_ADA = dict(vendor="nvidia", l2_bytes=72 * MiB, smem_per_sm_bytes=100 * KiB, max_warps_per_sm=48,
            mem_latency_ns=550.0, launch_gap_us=2.5)
_AMPERE = dict(vendor="nvidia", l2_bytes=40 * MiB, smem_per_sm_bytes=164 * KiB, max_warps_per_sm=64,
               mem_latency_ns=600.0, launch_gap_us=2.5)


def _nvidia(arch: dict, name: str, sms: int, gbps: float, tflops: float, sm_gbps: float, mib: int) -> DeviceSpec:
    return DeviceSpec(**arch, name=name, sm_count=sms, mem_bandwidth_gbps=gbps, tensor_tflops=tflops,
                      per_sm_bandwidth_gbps=sm_gbps, memory_bytes=mib * MiB)


# key: (architecture, name, SMs, DRAM GB/s, dense bf16 TFLOPS, GB/s one SM pulls, MiB the driver reports)
_NVIDIA_CARDS = {
    "h100-sxm": (_HOPPER, "NVIDIA H100 SXM5 80GB", 132, 3350.0, 989.0, 55.0, 81_559),
    "h100-pcie": (_HOPPER, "NVIDIA H100 PCIe 80GB", 114, 2000.0, 756.0, 40.0, 81_559),
    "h100-nvl": (_HOPPER, "NVIDIA H100 NVL 94GB", 132, 3900.0, 835.0, 60.0, 95_830),
    "h200": (_HOPPER, "NVIDIA H200 SXM 141GB", 132, 4800.0, 989.0, 60.0, 143_771),
    "rtx4090": (_ADA, "NVIDIA GeForce RTX 4090", 128, 1008.0, 165.0, 40.0, 24_564),
    "a100-sxm-80gb": (_AMPERE, "NVIDIA A100-SXM4-80GB", 108, 2039.0, 312.0, 40.0, 81_920),
    "a100-40gb": (_AMPERE, "NVIDIA A100-SXM4-40GB", 108, 1555.0, 312.0, 35.0, 40_960),
}
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    **{key: _nvidia(*card) for key, card in _NVIDIA_CARDS.items()},
    "mi300x": DeviceSpec(
        name="AMD Instinct MI300X", vendor="amd", sm_count=304, mem_bandwidth_gbps=5300.0,
        l2_bytes=32 * MiB, smem_per_sm_bytes=64 * KiB, max_warps_per_sm=32, warp_size=64,
        regs_per_sm=4 * 512 * 64, tensor_tflops=1307.0, mem_latency_ns=850.0, launch_gap_us=4.0,
        per_sm_bandwidth_gbps=35.0, memory_bytes=192 * 1024 * MiB,
    ),
}

# The Triton interpreter on CPU: only so that heuristics produce small, valid grids in tests.
CPU_INTERPRETER = DeviceSpec(
    name="cpu (Triton interpreter)", vendor="cpu", sm_count=max(1, os.cpu_count() or 1),
    mem_bandwidth_gbps=20.0, bandwidth_source="assumed", l2_bytes=0, smem_per_sm_bytes=1 << 20,
    max_warps_per_sm=64, mem_latency_ns=100.0, tensor_tflops=0.1, launch_gap_us=50.0,
)


def lookup_known_device(name: str, arch: str = "") -> DeviceSpec | None:
    """The datasheet spec whose card the driver's ``name`` (and AMD ``gcnArchName``) denotes, or None."""
    n = name.lower()
    if "h200" in n:
        return KNOWN_DEVICES["h200"]
    if "h100" in n:
        if "pcie" in n:
            return KNOWN_DEVICES["h100-pcie"]
        if "nvl" in n:
            return KNOWN_DEVICES["h100-nvl"]
        return KNOWN_DEVICES["h100-sxm"]
    if "4090" in n:
        return KNOWN_DEVICES["rtx4090"]
    if "a100" in n:
        return KNOWN_DEVICES["a100-40gb"] if "40gb" in n else KNOWN_DEVICES["a100-sxm-80gb"]
    if "mi300x" in n or ("gfx942" in (arch or "").lower() and "mi300a" not in n and "mi325" not in n):
        return KNOWN_DEVICES["mi300x"]
    return None


__all__ = ["BANDWIDTH_SOURCES", "CPU_INTERPRETER", "KNOWN_DEVICES", "VENDORS", "DeviceSpec", "lookup_known_device"]
