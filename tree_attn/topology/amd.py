"""Live probe of AMD GPUs through AMD SMI (``amdsmi``, optional: ``pip install ".[rocm]"`` in a checkout).

Two traps of the library, handled here:

- ``import amdsmi`` can fail with KeyError (not ImportError) when the ROCm install it finds is
  incomplete; both mean "not available".
- ``amdsmi_topo_get_link_type`` returns ``type`` as an ``amdsmi_io_link_type_t``
  (UNDEFINED=0, PCIEXPRESS=1, XGMI=2), while the nearest-link query
  ``amdsmi_get_link_topology_nearest`` uses ``amdsmi_link_type_t`` (INTERNAL=0, XGMI=1, PCIE=2):
  the same integer means different links. A plain integer from the link-type query is read with
  the io-link enum; an enum member is read by its name, whichever enum it belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from .bandwidth import estimate
from .dumps import amd_pcie_kind
from .model import Device, Link, LinkKind, P2PStatus, Topology
from .nvml import BackendUnavailable, normalize_bus_id
from .visible import NoVisibleDevice, restrict_amd_to_visible

# amdsmi_io_link_type_t, the enum of amdsmi_topo_get_link_type (values from amdsmi.h).
_IOLINK_PCIE = 1
_IOLINK_XGMI = 2


def _import_amdsmi() -> ModuleType:
    try:
        import amdsmi  # optional vendor library imported lazily on purpose
    except (ImportError, KeyError, OSError) as exc:
        raise BackendUnavailable(f"the amdsmi module is not available ({type(exc).__name__}: {exc})") from None
    return amdsmi


class _Amd:
    def __init__(self, am: ModuleType) -> None:
        self.am = am
        self.err = getattr(am, "AmdSmiException", None)
        self.notes: list[str] = []

    def call(self, names: str | tuple[str, ...], *args: Any) -> Any:
        """Call the first function of ``names`` the module has; an AMD SMI error gives None."""
        for name in (names,) if isinstance(names, str) else names:
            fn = getattr(self.am, name, None)
            if fn is None:
                continue
            try:
                return fn(*args)
            except Exception as exc:  # filtered just below
                if self.err is not None and isinstance(exc, self.err):
                    return None  # not supported on this GPU/driver: the field is unknown
                raise
        return None


def link_kind_from_amdsmi(value: Any, module: ModuleType | None = None) -> LinkKind | None:
    """Map the ``type`` of ``amdsmi_topo_get_link_type`` to a link class (None for PCIe, whose
    class depends on NUMA placement, or unknown)."""
    if value is None:
        return LinkKind.UNKNOWN
    name = getattr(value, "name", None)
    if isinstance(name, str):  # an enum member: trust its name, not its number
        up = name.upper()
        if "XGMI" in up:
            return LinkKind.XGMI
        if "PCI" in up:
            return None
        return LinkKind.UNKNOWN
    io_enum = getattr(module, "AmdSmiIoLinkType", None) if module is not None else None
    xgmi = int(getattr(io_enum, "XGMI", _IOLINK_XGMI)) if io_enum is not None else _IOLINK_XGMI
    pcie = int(getattr(io_enum, "PCIEXPRESS", _IOLINK_PCIE)) if io_enum is not None else _IOLINK_PCIE
    v = int(value)
    if v == xgmi:
        return LinkKind.XGMI
    if v == pcie:
        return None
    return LinkKind.UNKNOWN


def probe_amdsmi(module: ModuleType | None = None, *, environ: Mapping[str, str] | None = None) -> Topology:
    """Probe the AMD GPUs this process can use. ``module`` replaces ``amdsmi`` (tests pass a fake).

    AMD SMI lists every GPU of the machine; the result keeps those ``ROCR_VISIBLE_DEVICES`` and
    ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``) leave visible (:mod:`.visible`), read from
    ``environ`` (default: this process's environment with the real amdsmi; none with a fake).

    Raises :class:`BackendUnavailable` when amdsmi, the driver or any (visible) GPU is missing.
    """
    topo = _probe_all(module)
    if environ is None:
        environ = os.environ if module is None else {}
    try:
        return restrict_amd_to_visible(topo, environ)
    except NoVisibleDevice as exc:
        raise BackendUnavailable(str(exc)) from None


def _probe_all(module: ModuleType | None) -> Topology:
    am = module if module is not None else _import_amdsmi()
    flags = getattr(getattr(am, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
    try:
        am.amdsmi_init(flags) if flags is not None else am.amdsmi_init()
    except Exception as exc:  # noqa: BLE001 - AmdSmiLibraryException when the driver is absent
        raise BackendUnavailable(f"AMD SMI could not start: {exc}") from None
    try:
        api = _Amd(am)
        handles = list(api.call("amdsmi_get_processor_handles") or [])
        if not handles:
            raise BackendUnavailable("AMD SMI sees no GPU")
        devices = [_device(api, i, h) for i, h in enumerate(handles)]
        links = []
        n = len(handles)
        for a in range(n):
            for b in range(a + 1, n):
                ha, hb = handles[a], handles[b]
                lt = api.call("amdsmi_topo_get_link_type", ha, hb) or {}
                kind = link_kind_from_amdsmi(lt.get("type"), am)
                if kind is None:
                    kind = amd_pcie_kind(devices[a], devices[b])
                acc = api.call("amdsmi_is_P2P_accessible", ha, hb)
                p2p = P2PStatus.UNKNOWN if acc is None else (P2PStatus.OK if acc else P2PStatus.UNSUPPORTED)
                reason = "amdsmi: P2P access not available" if p2p is P2PStatus.UNSUPPORTED else None
                weight = api.call("amdsmi_topo_get_link_weight", ha, hb)
                mm = api.call(("amdsmi_get_minmax_bandwidth_between_processors", "amdsmi_get_minmax_bandwidth"), ha, hb)
                bw, src = None, "unknown"
                if mm and mm.get("max_bandwidth"):
                    bw, src = int(mm["max_bandwidth"]) / 1000.0, "reported"  # MB/s -> GB/s
                else:
                    bw = estimate(kind, devices[a], devices[b])
                    src = "estimated" if bw is not None else "unknown"
                hops = lt.get("hops")
                links.append(Link(a, b, kind, p2p=p2p, p2p_reason=reason, bandwidth_gbps=bw, bandwidth_source=src,
                                  hops=int(hops) if hops is not None else None,
                                  weight=int(weight) if weight is not None else None))
        return Topology(devices=devices, links=links, source="amdsmi", notes=api.notes)
    finally:
        try:
            am.amdsmi_shut_down()
        except Exception:  # noqa: BLE001, S110 - shutting down a library that works is best effort
            pass


def _device(api: _Amd, i: int, h: Any) -> Device:
    asic = api.call("amdsmi_get_gpu_asic_info", h) or {}
    vram_type = getattr(getattr(api.am, "AmdSmiMemoryType", None), "VRAM", None)
    mem = api.call("amdsmi_get_gpu_memory_total", h, vram_type) if vram_type is not None else None
    numa = api.call("amdsmi_topo_get_numa_node_number", h)
    cus = asic.get("num_of_compute_units")
    name = str(asic.get("market_name") or "").strip() or "unknown"
    return Device(
        index=i,
        vendor="amd",
        name=name,
        uuid=str(api.call("amdsmi_get_gpu_device_uuid", h) or "") or None,
        pci_bus_id=normalize_bus_id(api.call("amdsmi_get_gpu_device_bdf", h)),
        memory_bytes=int(mem) if mem else None,
        sm_count=int(cus) if isinstance(cus, int) and cus > 0 else None,
        arch=str(asic.get("target_graphics_version") or "") or None,
        numa_node=int(numa) if isinstance(numa, int) and numa >= 0 else None,
    )
