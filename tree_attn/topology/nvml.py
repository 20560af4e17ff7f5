"""Live probe of NVIDIA GPUs through NVML (``pynvml``, package nvidia-ml-py).

NVML answers differently per product: GeForce cards answer NotSupported to many calls (NVLink,
P2P on some drivers, MIG), older drivers lack newer functions, VMs hide affinities. Every such
answer becomes "unknown" (``None``) for that one field; the probe never fails for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..errors import TopologyError
from .bandwidth import estimate
from .model import Device, Link, LinkKind, P2PStatus, Topology, format_ranges
from .visible import ENV_VAR, NoVisibleDevice, restrict_to_visible


class BackendUnavailable(TopologyError):
    """The backend's library or driver is missing, or it sees no device (auto-probe moves on)."""


# nvmlGpuTopologyLevel_t -> link class (the same mapping nvidia-smi topo -m prints).
# INTERNAL = two GPUs on one board (e.g. K80): at most one bridge between them.
_ANCESTOR_KIND = {0: LinkKind.PIX, 10: LinkKind.PIX, 20: LinkKind.PXB, 30: LinkKind.PHB, 40: LinkKind.NODE,
                  50: LinkKind.SYS}

# nvmlGpuP2PStatus_t -> (status, reason); the codes nvidia-smi topo -p2p prints.
_P2P_CODES = {
    0: (P2PStatus.OK, None),
    1: (P2PStatus.UNSUPPORTED, "CNS: chipset not supported"),
    2: (P2PStatus.UNSUPPORTED, "GNS: GPU not supported"),
    3: (P2PStatus.UNSUPPORTED, "TNS: topology not supported"),
    4: (P2PStatus.UNSUPPORTED, "DR: disabled by regkey"),
    5: (P2PStatus.UNSUPPORTED, "NS: not supported"),
    6: (P2PStatus.UNKNOWN, "U: unknown"),
}

_ARCH_NAMES = {2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
               9: "hopper", 10: "blackwell", 13: "rubin"}

# Errors that mean "this GPU/driver cannot tell": the field becomes unknown, silently.
_SOFT_ERRORS = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_FUNCTION_NOT_FOUND",
                "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_NOT_FOUND")


def _import_pynvml() -> ModuleType:
    try:
        import pynvml  # vendor library imported lazily on purpose
    except ImportError as exc:
        raise BackendUnavailable(f"the pynvml module is not installed ({exc}); pip install nvidia-ml-py") from None
    return pynvml


def normalize_bus_id(bus: Any) -> str | None:
    """``b'00000000:18:00.0'`` -> ``'0000:18:00.0'`` (NVML pads the domain to 8 digits;
    lspci and AMD tools use 4)."""
    if bus is None:
        return None
    if isinstance(bus, bytes):
        bus = bus.decode(errors="replace")
    bus = str(bus).strip().lower()
    if not bus:
        return None
    parts = bus.split(":")
    if len(parts) == 3 and len(parts[0]) > 4:
        parts[0] = parts[0][-4:]
    elif len(parts) == 2:
        parts.insert(0, "0000")
    return ":".join(parts)


def _text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        v = v.decode(errors="replace")
    v = str(v).strip()
    return v or None


def _int_index(v: Any) -> int:
    # pynvml defines NVML_P2P_CAPS_INDEX_READ = 0, (a stray comma makes it a one-element
    # tuple); passing the tuple to the C function fails, so unwrap it to the integer.
    while isinstance(v, (tuple, list)):
        v = v[0]
    return int(v)


def _bits(words: Any, word_bits: int = 64) -> list[int]:
    out = []
    for k, w in enumerate(list(words or [])):
        w = int(w)
        j = 0
        while w:
            if w & 1:
                out.append(k * word_bits + j)
            w >>= 1
            j += 1
    return out


class _Nvml:
    """Calls into the NVML module, turning "cannot tell" answers into None."""

    def __init__(self, nv: ModuleType) -> None:
        self.nv = nv
        self.err = getattr(nv, "NVMLError", None)
        self.soft = {getattr(nv, name) for name in _SOFT_ERRORS if hasattr(nv, name)}
        self.notes: list[str] = []

    def call(self, name: str, *args: Any) -> Any:
        fn: Callable | None = getattr(self.nv, name, None)
        if fn is None:
            return None  # this pynvml release does not have the function
        try:
            return fn(*args)
        except Exception as exc:  # filtered just below
            if self.err is None or not isinstance(exc, self.err):
                raise
            if getattr(exc, "value", None) not in self.soft:
                msg = f"NVML {name} failed: {exc}; that field is reported as unknown"
                if msg not in self.notes:
                    self.notes.append(msg)
            return None

    def const(self, name: str, default: int) -> int:
        return _int_index(getattr(self.nv, name, default))


def probe_nvml(module: ModuleType | None = None, *, visible_devices: str | None = None) -> Topology:
    """Probe the NVIDIA GPUs this process can use. ``module`` replaces ``pynvml`` (tests pass a fake).

    NVML lists every GPU of the machine; the result keeps those ``CUDA_VISIBLE_DEVICES`` leaves
    visible, numbered as CUDA numbers them (:mod:`.visible`). ``visible_devices`` is that value
    (default: the environment's when probing the real NVML; a fake shows all its GPUs unless given one).

    Raises :class:`BackendUnavailable` when pynvml, the driver or any (visible) GPU is missing.
    """
    nv = module if module is not None else _import_pynvml()
    try:
        nv.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise BackendUnavailable(f"NVML could not start: {exc}") from None
    try:
        topo = _probe(_Nvml(nv))
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001, S110 - shutting down a library that works is best effort
            pass
    if visible_devices is None and module is None:
        visible_devices = os.environ.get(ENV_VAR)
    try:
        return restrict_to_visible(topo, visible_devices)
    except NoVisibleDevice as exc:
        raise BackendUnavailable(str(exc)) from None


def _probe(api: _Nvml) -> Topology:
    nv = api.nv
    n = api.call("nvmlDeviceGetCount")
    if not n:
        raise BackendUnavailable("NVML sees no GPU")
    handles = []
    for i in range(n):
        try:
            handles.append(nv.nvmlDeviceGetHandleByIndex(i))
        except Exception as exc:  # NVMLError_GpuIsLost, NoPermission, ...
            if api.err is None or not isinstance(exc, api.err):
                raise
            raise TopologyError(f"NVML cannot open GPU {i}: {exc}; "
                                "check `nvidia-smi` and the permissions of /dev/nvidia*") from None
    devices = [_device(api, i, h) for i, h in enumerate(handles)]
    bus_to_index = {d.pci_bus_id: d.index for d in devices if d.pci_bus_id}

    # NVLinks: count per GPU pair (direct links) and per GPU to NVSwitches. On NVSwitch systems
    # (DGX/HGX A100, H100, H200) the far end of every link is a switch, and every GPU reaches
    # every other over all its links, which nvidia-smi shows as NV<links per GPU>.
    max_links = api.const("NVML_NVLINK_MAX_LINKS", 18)
    enabled = api.const("NVML_FEATURE_ENABLED", 1)
    t_gpu = api.const("NVML_NVLINK_DEVICE_TYPE_GPU", 0)
    t_switch = api.const("NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    direct: dict[tuple[int, int], int] = {}
    to_switch = [0] * n
    for i, h in enumerate(handles):
        versions = set()
        for link in range(max_links):
            state = api.call("nvmlDeviceGetNvLinkState", h, link)
            if state is None or state != enabled:
                continue  # no such link on this GPU, unsupported (GeForce), or the link is down
            rtype = api.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            rpci = api.call("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            rbus = normalize_bus_id(getattr(rpci, "busId", None)) if rpci is not None else None
            version = api.call("nvmlDeviceGetNvLinkVersion", h, link)
            if version:
                versions.add(int(version))
            peer = bus_to_index.get(rbus)
            if rtype == t_switch or (rtype is None and peer is None and rbus is not None):
                to_switch[i] += 1
            elif peer is not None and peer != i and (rtype is None or rtype == t_gpu):
                direct[(i, peer)] = direct.get((i, peer), 0) + 1
            # Anything else (an IBM NPU, a CPU on NVLink-C2C) is not a GPU-GPU path.
        if versions:
            devices[i].nvlink_version = max(versions)

    read_idx = api.const("NVML_P2P_CAPS_INDEX_READ", 0)
    write_idx = api.const("NVML_P2P_CAPS_INDEX_WRITE", 1)
    links = []
    for a in range(n):
        for b in range(a + 1, n):
            nvl = min(direct.get((a, b), 0), direct.get((b, a), 0)) or max(direct.get((a, b), 0), direct.get((b, a), 0))
            if to_switch[a] and to_switch[b]:
                nvl += min(to_switch[a], to_switch[b])
            if nvl:
                kind: LinkKind = LinkKind.NVLINK
            else:
                level = api.call("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b])
                kind = _ANCESTOR_KIND.get(int(level), LinkKind.UNKNOWN) if level is not None else LinkKind.UNKNOWN
            codes = [
                api.call("nvmlDeviceGetP2PStatus", handles[x], handles[y], idx)
                for (x, y) in ((a, b), (b, a))
                for idx in (read_idx, write_idx)
            ]
            p2p, reason = _combine_p2p(codes)
            bw = estimate(kind, devices[a], devices[b], nvlinks=nvl or None)
            links.append(Link(a, b, kind, nvlinks=nvl or None, p2p=p2p, p2p_reason=reason, bandwidth_gbps=bw,
                              bandwidth_source="estimated" if bw is not None else "unknown"))
    return Topology(devices=devices, links=links, source="nvml", notes=list(api.notes))


def _combine_p2p(codes: list[Any]) -> tuple[P2PStatus, str | None]:
    """Read and write, both directions: OK only if all four are OK; the first refusal names why."""
    for c in codes:
        if c is not None and _P2P_CODES.get(int(c), (P2PStatus.UNKNOWN,))[0] is P2PStatus.UNSUPPORTED:
            return _P2P_CODES[int(c)]
    if codes and all(c is not None and int(c) == 0 for c in codes):
        return P2PStatus.OK, None
    return P2PStatus.UNKNOWN, None


def _device(api: _Nvml, i: int, h: Any) -> Device:
    name = _text(api.call("nvmlDeviceGetName", h)) or "unknown"
    pci = api.call("nvmlDeviceGetPciInfo", h)
    mem = api.call("nvmlDeviceGetMemoryInfo", h)
    attrs = api.call("nvmlDeviceGetAttributes", h)
    arch = api.call("nvmlDeviceGetArchitecture", h)
    # Host NUMA node and CPUs nearest the GPU (nvidia-smi's "NUMA Affinity" / "CPU Affinity").
    scope = api.const("NVML_AFFINITY_SCOPE_NODE", 0)
    nodes = _bits(api.call("nvmlDeviceGetMemoryAffinity", h, 4, scope))
    cpus = _bits(api.call("nvmlDeviceGetCpuAffinity", h, 16))
    gpu_numa = api.call("nvmlDeviceGetNumaNodeId", h)
    mig = api.call("nvmlDeviceGetMigMode", h)
    sms = getattr(attrs, "multiprocessorCount", None) if attrs is not None else None
    return Device(
        index=i,
        vendor="nvidia",
        name=name,
        uuid=_text(api.call("nvmlDeviceGetUUID", h)),
        pci_bus_id=normalize_bus_id(getattr(pci, "busId", None)) if pci is not None else None,
        memory_bytes=int(mem.total) if mem is not None and getattr(mem, "total", None) is not None else None,
        # With MIG enabled the attributes describe one instance; a whole-GPU count is what we want.
        sm_count=int(sms) if sms else None,
        arch=_ARCH_NAMES.get(int(arch)) if arch is not None else None,
        numa_node=nodes[0] if nodes else None,
        cpu_affinity=format_ranges(cpus) if cpus else None,
        gpu_numa_id=int(gpu_numa) if gpu_numa is not None and int(gpu_numa) >= 0 else None,
        pcie_gen=_pos_int(api.call("nvmlDeviceGetMaxPcieLinkGeneration", h)),
        pcie_width=_pos_int(api.call("nvmlDeviceGetMaxPcieLinkWidth", h)),
        mig_enabled=bool(mig[0]) if mig is not None else None,
    )


def _pos_int(v: Any) -> int | None:
    try:
        v = int(v)
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None
