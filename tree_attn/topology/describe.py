"""Plain-words warnings about a topology: what will be slow and why."""

from __future__ import annotations

from .model import LinkKind, P2PStatus, Topology, format_ranges


def topology_warnings(topo: Topology) -> list[str]:
    """Warnings a user should read before tuning or running on this fabric."""
    out: list[str] = []
    gpus = [d for d in topo.devices if d.vendor != "cpu"]
    if not gpus:
        return out
    n = len(topo)
    no_p2p = [l for l in topo.links if l.p2p is P2PStatus.UNSUPPORTED]
    if no_p2p:
        devs = sorted({l.a for l in no_p2p} | {l.b for l in no_p2p})
        reasons = sorted({(l.p2p_reason or "no reason given") for l in no_p2p})
        scope = (f"GPUs {format_ranges(devs)}" if len(no_p2p) == n * (n - 1) // 2
                 else f"{len(no_p2p)} GPU pair(s) among GPUs {format_ranges(devs)}")
        out.append(
            f"{scope} cannot use peer-to-peer ({'; '.join(reasons)}): traffic between them goes through host "
            "memory, a copy to the CPU and another to the other GPU, which roughly halves the PCIe bandwidth and "
            "adds tens of microseconds per message. Tree reduction (few, small messages) suffers far less from "
            "this than Ring Attention, which moves whole KV blocks."
        )
    if any(l.kind is LinkKind.SYS for l in topo.links):
        sys_pairs = [l for l in topo.links if l.kind is LinkKind.SYS]
        devs = sorted({l.a for l in sys_pairs} | {l.b for l in sys_pairs})
        out.append(
            f"GPUs {format_ranges(devs)} have pairs that cross the CPU socket interconnect (SYS): those messages "
            "also cross QPI/UPI or Infinity Fabric between NUMA nodes; keep the first reduction levels inside "
            "a NUMA node."
        )
    nv = [l.nvlinks for l in topo.links if l.kind is LinkKind.NVLINK and l.nvlinks]
    if nv and len(set(nv)) > 1:
        top = max(nv)
        weak = [l for l in topo.links if l.kind is LinkKind.NVLINK and l.nvlinks and l.nvlinks < top]
        pairs = ", ".join(f"GPU{l.a}-GPU{l.b} NV{l.nvlinks}" for l in weak[:6])
        out.append(f"NVLink counts differ (most pairs NV{top}; {pairs}{' ...' if len(weak) > 6 else ''}): "
                   "an NVLink may be down or a GPU may sit in the wrong slot; check `nvidia-smi nvlink -s`.")
    unknown = [l for l in topo.links if l.kind is LinkKind.UNKNOWN]
    if unknown:
        out.append(f"the class of {len(unknown)} link(s) is unknown: plans treat them as the slowest intra-host path.")
    if any(d.mig_enabled for d in gpus):
        out.append(f"MIG is enabled on GPUs {format_ranges(d.index for d in gpus if d.mig_enabled)}: "
                   "a MIG instance cannot use NVLink or peer-to-peer; disable MIG for multi-GPU decoding.")
    return out
