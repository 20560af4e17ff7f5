"""The GPUs a process can use: NVML lists every GPU of the machine, ``CUDA_VISIBLE_DEVICES`` narrows
what CUDA (and so torch, and every rank) sees. A topology for a run must describe the second set,
in CUDA's order: with ``CUDA_VISIBLE_DEVICES=2,3`` rank 0's ``cuda:0`` is NVML's GPU 2.

CUDA's rules, followed here: entries are GPU indices or ``GPU-<uuid>`` prefixes, comma-separated;
parsing stops at the first entry that names no GPU (or one already named), and the GPUs before
it are visible; an empty value hides every GPU. Indices are taken in PCI bus order, NVML's (CUDA's
default "fastest first" order is the same on a machine of one GPU model; set
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` to make it so on mixed machines). ``MIG-`` entries name MIG
instances, which the topology does not describe: the whole machine is kept, with a note.

AMD GPUs (ROCm): ``ROCR_VISIBLE_DEVICES`` narrows first, then ``HIP_VISIBLE_DEVICES`` (or, when it
is unset, ``CUDA_VISIBLE_DEVICES``, which HIP also reads) indexes into what is left. Only indices
are matched there (ROCm's UUIDs are not AMD SMI's); a value naming GPUs otherwise keeps the whole
machine, with a note.
"""

from __future__ import annotations

import dataclasses

from .model import Topology

ENV_VAR = "CUDA_VISIBLE_DEVICES"


class NoVisibleDevice(Exception):
    """``CUDA_VISIBLE_DEVICES`` leaves no GPU of the topology visible."""


def visible_indices(topo: Topology, value: str, var: str = ENV_VAR, *, indices_only: bool = False) -> list[int] | None:
    """The topology's device indices ``value`` (of variable ``var``) makes visible, in CUDA's
    order; None when it names what the topology cannot match (MIG instances; with
    ``indices_only``, anything but indices). Raises :class:`NoVisibleDevice` for none."""
    chosen: list[int] = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.upper().startswith("MIG-") or (indices_only and entry and not entry.lstrip("-").isdigit()):
            return None
        index = _lookup(topo, entry)
        if index is None or index in chosen:
            break  # CUDA ignores this entry and everything after it
        chosen.append(index)
    if not chosen:
        raise NoVisibleDevice(
            f"{var}={value!r} leaves none of this machine's {len(topo)} GPU(s) visible; unset it or name GPUs "
            f"0..{len(topo) - 1} (or their GPU-<uuid>)"
        )
    return chosen


def _lookup(topo: Topology, entry: str) -> int | None:
    if entry.isdigit():
        i = int(entry)
        return i if i < len(topo) else None
    if entry.upper().startswith("GPU-"):
        hits = [d.index for d in topo.devices if d.uuid and d.uuid.lower().startswith(entry.lower())]
        return hits[0] if len(hits) == 1 else None
    return None


def restrict_to_visible(topo: Topology, value: str | None, var: str = ENV_VAR, *,
                        indices_only: bool = False) -> Topology:
    """``topo`` narrowed to the GPUs ``value`` (the value of ``var``, e.g. ``CUDA_VISIBLE_DEVICES``;
    None: unset) makes visible, renumbered 0..k-1 in CUDA's order, with a note saying which they are."""
    if value is None:
        return topo
    chosen = visible_indices(topo, value, var, indices_only=indices_only)
    if chosen is None:
        what = "MIG instances" if "MIG-" in value.upper() else "GPUs by something other than their index"
        return topo.replace(notes=topo.notes + [(f"{var}={value!r} names {what}; the topology lists the machine's "
                                                 f"whole GPUs")])
    if chosen == list(range(len(topo))):
        return topo
    new_of = {old: new for new, old in enumerate(chosen)}
    devices = [dataclasses.replace(topo.devices[old], index=new) for new, old in enumerate(chosen)]
    links = []
    for l in topo.links:
        if l.a in new_of and l.b in new_of:
            a, b = sorted((new_of[l.a], new_of[l.b]))
            links.append(dataclasses.replace(l, a=a, b=b))
    note = (f"{var}={value!r}: {len(chosen)} of the machine's {len(topo)} GPUs, numbered as CUDA numbers them "
            f"(machine GPU {', '.join(str(i) for i in chosen)} are "
            f"cuda:{', '.join(str(i) for i in range(len(chosen)))})")
    return Topology(devices=devices, links=links, source=topo.source, notes=topo.notes + [note],
                    measurement=None)


def restrict_amd_to_visible(topo: Topology, environ) -> Topology:
    """``topo`` (AMD SMI's GPUs) narrowed as a ROCm process sees them: ``ROCR_VISIBLE_DEVICES``,
    then ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``) on what is left; indices only."""
    topo = restrict_to_visible(topo, environ.get("ROCR_VISIBLE_DEVICES"), "ROCR_VISIBLE_DEVICES", indices_only=True)
    var = "HIP_VISIBLE_DEVICES" if environ.get("HIP_VISIBLE_DEVICES") is not None else ENV_VAR
    return restrict_to_visible(topo, environ.get(var), var, indices_only=True)


__all__ = ["ENV_VAR", "NoVisibleDevice", "restrict_amd_to_visible", "restrict_to_visible", "visible_indices"]
