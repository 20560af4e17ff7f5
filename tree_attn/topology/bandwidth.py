"""Bandwidth estimates from link facts, one direction, GB/s (10**9 B/s).

These are nominal link rates, the ceiling a copy can reach; ``tree-attn probe --measure`` replaces
them with measured numbers. Sources:

- NVLink: NVLink 1 (P100) 20 GB/s per link per direction; NVLink 2 (V100), 3 (A100) and
  4 (H100/H200) 25 GB/s per link per direction (A100: 12 links = 300 GB/s, H100 SXM: 18 links =
  450 GB/s per direction); NVLink 5 (B200) 50 GB/s per link per direction (18 links = 900 GB/s).
- PCIe per lane per direction after line coding: gen1 0.25, gen2 0.5, gen3 0.985 (128b/130b),
  gen4 1.969, gen5 3.938, gen6 7.563 GB/s.
- xGMI (AMD Infinity Fabric): MI300X has 7 x16 links at 32 Gb/s per lane = 64 GB/s per link per
  direction, one link to each of the 7 peers of the hive (``amd-smi xgmi`` reports 512 Gb/s).
"""

from __future__ import annotations

from .model import Device, LinkKind

NVLINK_GBPS_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
# When the NVLink generation is not known (a recorded dump), NVLink 2-4 all run 25 GB/s per link.
NVLINK_DEFAULT_GBPS = 25.0
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
XGMI_GBPS_PER_LINK = 64.0

# NVIDIA architecture -> NVLink generation, for when nvmlDeviceGetNvLinkVersion is unsupported.
NVLINK_VERSION_BY_ARCH = {"pascal": 1, "volta": 2, "ampere": 3, "hopper": 4, "blackwell": 5}


def nvlink_gbps(count: int, version: int | None = None) -> float:
    """Aggregate one-direction rate of ``count`` bonded NVLinks of generation ``version``."""
    return count * NVLINK_GBPS_PER_LINK.get(version or 0, NVLINK_DEFAULT_GBPS)


def pcie_gbps(gen: int | None, width: int | None) -> float | None:
    """One-direction rate of a PCIe link, or None when generation or width is unknown."""
    if not gen or not width or gen not in PCIE_GBPS_PER_LANE:
        return None
    return round(PCIE_GBPS_PER_LANE[gen] * width, 2)


def estimate(kind: LinkKind, a: Device, b: Device, *, nvlinks: int | None = None) -> float | None:
    """Nominal one-direction bandwidth between two devices over a link of ``kind``.

    A PCIe path runs at the slower of the two endpoints' links (the switch or host bridge in
    between is assumed not to be the bottleneck); None when either end's PCIe facts are unknown.
    """
    if kind is LinkKind.NVLINK:
        if not nvlinks:
            return None
        version = a.nvlink_version or b.nvlink_version or NVLINK_VERSION_BY_ARCH.get((a.arch or "").lower())
        return nvlink_gbps(nvlinks, version)
    if kind is LinkKind.XGMI:
        return XGMI_GBPS_PER_LINK
    if kind.is_pcie:
        ra, rb = pcie_gbps(a.pcie_gen, a.pcie_width), pcie_gbps(b.pcie_gen, b.pcie_width)
        if ra is None or rb is None:
            return None
        return min(ra, rb)
    return None
