"""Fake ``pynvml`` and ``amdsmi`` modules that answer like the vendor modules.

They mirror the real modules' shapes: NVML constants (including pynvml's one-element-tuple
``NVML_P2P_CAPS_INDEX_READ``), ``NVMLError`` with per-code subclasses (``NVMLError_NotSupported``
...), bytes from string getters, ctypes-like structs with ``busId``; AMD SMI's exception classes,
its two link-type enums and dict-returning queries. Three machines are modelled after the
recorded dumps in tests/fixtures/topology/.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

# -- pynvml -----------------------------------------------------------------------------------------

_NVML_ERRORS = {
    "UNINITIALIZED": 1, "INVALID_ARGUMENT": 2, "NOT_SUPPORTED": 3, "NO_PERMISSION": 4, "NOT_FOUND": 6,
    "DRIVER_NOT_LOADED": 9, "LIBRARY_NOT_FOUND": 12, "FUNCTION_NOT_FOUND": 13, "GPU_IS_LOST": 15, "UNKNOWN": 999,
}


@dataclass
class FakeGpu:
    name: str
    bus: str  # NVML style, 8-digit domain
    uuid: str
    memory: int
    sms: int | None
    arch: int
    numa: int | None
    cpus: list[int]
    pcie: tuple[int, int]
    # One entry per NVLink: (remote device type, remote NVML bus id, active); None = NotSupported.
    nvlinks: list[tuple[int, str, bool]] | None = None
    nvlink_version: int | None = None
    mig: list[int] | None = None
    cc: tuple[int, int] = (9, 0)  # CUDA compute capability
    unsupported: set[str] = field(default_factory=set)  # functions answering NotSupported


class _Struct:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def make_pynvml(
    gpus: list[FakeGpu],
    ancestor: Callable[[int, int], int],
    p2p: Callable[[int, int, int], int],
    *,
    missing: tuple[str, ...] = (),
    max_links: int = 36,
) -> types.ModuleType:
    """A module object answering like pynvml for ``gpus``.

    ``ancestor(a, b)`` gives the NVML_TOPOLOGY_* level, ``p2p(a, b, caps_index)`` the
    NVML_P2P_STATUS_*; functions named in ``missing`` do not exist (an older pynvml).
    """
    m = types.ModuleType("pynvml")
    for name, code in _NVML_ERRORS.items():
        setattr(m, f"NVML_ERROR_{name}", code)

    class NVMLError(Exception):
        _valClassMapping: ClassVar[dict[int, type]] = {}

        def __new__(cls, value):
            # As pynvml does: NVMLError(code) makes the subclass registered for that code.
            made = NVMLError._valClassMapping.get(value, cls) if cls is NVMLError else cls
            obj = Exception.__new__(made)
            obj.value = value
            return obj

        def __str__(self):
            names = {v: k.replace("_", " ").title() for k, v in _NVML_ERRORS.items()}
            return names.get(self.value, f"NVML error {self.value}")

    m.NVMLError = NVMLError
    for name, code in _NVML_ERRORS.items():
        cls_name = "NVMLError_" + "".join(p.capitalize() for p in name.split("_"))

        def _new(cls, *args, _code=code):
            return NVMLError.__new__(cls, _code)

        sub = type(cls_name, (NVMLError,), {"__new__": _new})
        NVMLError._valClassMapping[code] = sub
        setattr(m, cls_name, sub)

    m.NVML_TOPOLOGY_INTERNAL, m.NVML_TOPOLOGY_SINGLE, m.NVML_TOPOLOGY_MULTIPLE = 0, 10, 20
    m.NVML_TOPOLOGY_HOSTBRIDGE, m.NVML_TOPOLOGY_NODE, m.NVML_TOPOLOGY_SYSTEM = 30, 40, 50
    m.NVML_P2P_CAPS_INDEX_READ = (0,)  # the real pynvml has `= 0,` (a one-element tuple)
    m.NVML_P2P_CAPS_INDEX_WRITE = 1
    m.NVML_P2P_STATUS_OK, m.NVML_P2P_STATUS_GPU_NOT_SUPPORTED = 0, 2
    m.NVML_NVLINK_MAX_LINKS = max_links
    m.NVML_FEATURE_DISABLED, m.NVML_FEATURE_ENABLED = 0, 1
    m.NVML_NVLINK_DEVICE_TYPE_GPU, m.NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0, 1
    m.NVML_NVLINK_DEVICE_TYPE_SWITCH, m.NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 2, 0xFF
    m.NVML_AFFINITY_SCOPE_NODE = 0
    m.NVML_DEVICE_MIG_DISABLE, m.NVML_DEVICE_MIG_ENABLE = 0, 1
    m.calls = []
    state = {"init": False}

    def need_init():
        if not state["init"]:
            raise NVMLError(1)

    def handle(h):
        need_init()
        if not isinstance(h, int) or not 0 <= h < len(gpus):
            raise NVMLError(2)
        return gpus[h]

    def gpu_fn(fname):
        def deco(fn):
            def wrapped(h, *args):
                g = handle(h)
                m.calls.append(fname)
                if fname in g.unsupported:
                    raise m.NVMLError_NotSupported()
                return fn(g, *args)
            wrapped.__name__ = fname
            return wrapped
        return deco

    def nvmlInit():
        state["init"] = True

    def nvmlShutdown():
        need_init()
        state["init"] = False

    def nvmlDeviceGetCount():
        need_init()
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(i):
        need_init()
        if not 0 <= i < len(gpus):
            raise NVMLError(2)
        return i

    def nvmlDeviceGetHandleByUUID(uuid):
        need_init()
        for i, g in enumerate(gpus):
            if g.uuid == uuid:
                return i
        raise NVMLError(6)

    fns = {
        "nvmlDeviceGetHandleByUUID": nvmlDeviceGetHandleByUUID,
        "nvmlInit": nvmlInit,
        "nvmlShutdown": nvmlShutdown,
        "nvmlDeviceGetCount": nvmlDeviceGetCount,
        "nvmlDeviceGetHandleByIndex": nvmlDeviceGetHandleByIndex,
    }

    def reg(fname, fn):
        fns[fname] = gpu_fn(fname)(fn)

    reg("nvmlDeviceGetName", lambda g: g.name)  # recent pynvml returns str
    reg("nvmlDeviceGetUUID", lambda g: g.uuid)
    reg("nvmlDeviceGetPciInfo", lambda g: _Struct(busId=g.bus.encode(), busIdLegacy=g.bus.encode()))
    reg("nvmlDeviceGetMemoryInfo", lambda g: _Struct(total=g.memory, free=g.memory, used=0))

    def attrs(g):
        if g.sms is None:
            raise m.NVMLError_NotSupported()
        return _Struct(multiprocessorCount=g.sms)

    reg("nvmlDeviceGetAttributes", attrs)
    reg("nvmlDeviceGetArchitecture", lambda g: g.arch)
    reg("nvmlDeviceGetCudaComputeCapability", lambda g: g.cc)

    def mem_aff(g, size, scope):
        words = [0] * size
        if g.numa is None:
            raise m.NVMLError_NotSupported()
        words[g.numa // 64] |= 1 << (g.numa % 64)
        return words

    def cpu_aff(g, size):
        words = [0] * size
        for c in g.cpus:
            words[c // 64] |= 1 << (c % 64)
        return words

    reg("nvmlDeviceGetMemoryAffinity", mem_aff)
    reg("nvmlDeviceGetCpuAffinity", cpu_aff)

    def numa_id(g):
        raise m.NVMLError_NotSupported()  # x86 hosts: GPU memory is not a NUMA node

    reg("nvmlDeviceGetNumaNodeId", numa_id)
    reg("nvmlDeviceGetMaxPcieLinkGeneration", lambda g: g.pcie[0])
    reg("nvmlDeviceGetMaxPcieLinkWidth", lambda g: g.pcie[1])

    def mig(g):
        if g.mig is None:
            raise m.NVMLError_NotSupported()
        return list(g.mig)

    reg("nvmlDeviceGetMigMode", mig)

    def link(g, i):
        if g.nvlinks is None:
            raise m.NVMLError_NotSupported()
        if not isinstance(i, int) or not 0 <= i < max_links:
            raise m.NVMLError_InvalidArgument()
        if i >= len(g.nvlinks):
            raise m.NVMLError_NotSupported()
        return g.nvlinks[i]

    reg("nvmlDeviceGetNvLinkState", lambda g, i: 1 if link(g, i)[2] else 0)
    reg("nvmlDeviceGetNvLinkRemoteDeviceType", lambda g, i: link(g, i)[0])
    reg("nvmlDeviceGetNvLinkRemotePciInfo", lambda g, i: _Struct(busId=link(g, i)[1].encode()))

    def nvl_version(g, i):
        link(g, i)
        if g.nvlink_version is None:
            raise m.NVMLError_NotSupported()
        return g.nvlink_version

    reg("nvmlDeviceGetNvLinkVersion", nvl_version)

    def common_ancestor(h1, h2):
        handle(h1), handle(h2)
        return ancestor(h1, h2)

    def p2p_status(h1, h2, idx):
        handle(h1), handle(h2)
        if not isinstance(idx, int):
            # ctypes cannot pass a tuple as a C enum: this is what the real call raises.
            raise TypeError("argument 3: wrong type")
        return p2p(h1, h2, idx)

    fns["nvmlDeviceGetTopologyCommonAncestor"] = common_ancestor
    fns["nvmlDeviceGetP2PStatus"] = p2p_status
    for fname, fn in fns.items():
        if fname not in missing:
            setattr(m, fname, fn)
    return m


def _cpus(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


H100_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]  # the PCI bus of each GPU of the HGX board


def h100_nvswitch_pynvml(*, down: dict[int, int] | None = None) -> types.ModuleType:
    """8x H100 SXM5 on an HGX board: 18 NVLink4 links per GPU, all to NVSwitches; P2P OK.
    Placement as in h100_8gpu_nonic_nvidia-smi_topo_m_thunderkittens167.txt. ``down`` maps a GPU
    to the number of its links that are inactive."""
    down = down or {}
    gpus = []
    for i in range(8):
        links = [(2, f"00000000:{0x05 + k % 4:02X}:00.0", k >= down.get(i, 0)) for k in range(18)]
        gpus.append(FakeGpu(
            name="NVIDIA H100 80GB HBM3", bus=f"00000000:{H100_BUSES[i]:02X}:00.0",
            uuid=f"GPU-h100-{i:04d}", memory=85520809984, sms=132, arch=9, numa=0 if i < 4 else 1,
            cpus=_cpus("0-47,96-143" if i < 4 else "48-95,144-191"), pcie=(5, 16), nvlinks=links, nvlink_version=4,
            mig=[0, 0],
        ))
    return make_pynvml(gpus, ancestor=lambda a, b: 40 if (a < 4) == (b < 4) else 50, p2p=lambda a, b, idx: 0)


RTX4090_NUMA = [3, 2, 1, 0, 7, 6, 5, 4]
RTX4090_CPUS = ["24-31,88-95", "16-23,80-87", "8-15,72-79", "0-7,64-71", "56-63,120-127", "48-55,112-119",
                "40-47,104-111", "32-39,96-103"]


def rtx4090_pcie_pynvml() -> types.ModuleType:
    """8x GeForce RTX 4090 on 2x EPYC 7542, one GPU per NUMA node, no PCIe switch (SYS between
    every pair), stock driver: no NVLink (NotSupported), P2P refused (GPU not supported), MIG and
    several other queries NotSupported, and an older pynvml without nvmlDeviceGetNvLinkRemoteDeviceType.
    Placement as in rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt."""
    gpus = [
        FakeGpu(name="NVIDIA GeForce RTX 4090", bus=f"00000000:{0x01 + 0x20 * i:02X}:00.0", uuid=f"GPU-4090-{i:04d}",
                memory=25757220864, sms=None, arch=8, numa=RTX4090_NUMA[i], cpus=_cpus(RTX4090_CPUS[i]), pcie=(4, 16),
                nvlinks=None, mig=None, cc=(8, 9), unsupported={"nvmlDeviceGetNvLinkVersion"})
        for i in range(8)
    ]
    return make_pynvml(gpus, ancestor=lambda a, b: 50, p2p=lambda a, b, idx: 2,
                       missing=("nvmlDeviceGetNvLinkRemoteDeviceType",))


# -- amdsmi -----------------------------------------------------------------------------------------

MI300X_BDFS = ["0000:0c:00.0", "0000:22:00.0", "0000:38:00.0", "0000:5c:00.0",
               "0000:9f:00.0", "0000:af:00.0", "0000:bf:00.0", "0000:df:00.0"]


def mi300x_amdsmi(*, link_type_as_enum: bool = False, p2p_off: set[tuple[int, int]] | None = None) -> types.ModuleType:
    """8x MI300X OAM, every GPU xGMI-connected to every other (one hop, weight 15), NUMA 0 for
    GPUs 0-3 and 1 for 4-7 (as rocm-smi --showtopo reports), min/max bandwidth 50000 MB/s
    (as amd-smi topology reports). ``link_type_as_enum``: return the link type as an
    AmdSmiLinkType member (XGMI = 1) instead of the io-link integer (XGMI = 2)."""
    p2p_off = p2p_off or set()
    m = types.ModuleType("amdsmi")

    class AmdSmiException(Exception):
        pass

    class AmdSmiLibraryException(AmdSmiException):
        def __init__(self, err_code):
            super().__init__(f"AMD SMI error {err_code}")
            self.err_code = err_code

    class AmdSmiParameterException(AmdSmiException):
        pass

    # amdsmi's enums, with its values (the functional form: each is a name-to-value table).
    AmdSmiIoLinkType = enum.IntEnum("AmdSmiIoLinkType", {"UNDEFINED": 0, "PCIEXPRESS": 1, "XGMI": 2})
    AmdSmiLinkType = enum.IntEnum("AmdSmiLinkType", {
        "AMDSMI_LINK_TYPE_INTERNAL": 0, "AMDSMI_LINK_TYPE_XGMI": 1, "AMDSMI_LINK_TYPE_PCIE": 2,
        "AMDSMI_LINK_TYPE_NOT_APPLICABLE": 3, "AMDSMI_LINK_TYPE_UNKNOWN": 4,
    })
    AmdSmiMemoryType = enum.IntEnum("AmdSmiMemoryType", {"VRAM": 0, "VIS_VRAM": 1, "GTT": 2})
    AmdSmiInitFlags = enum.IntEnum("AmdSmiInitFlags", {"INIT_ALL_PROCESSORS": 0, "INIT_AMD_GPUS": 2})

    class Handle:
        def __init__(self, i):
            self.i = i

    m.AmdSmiException, m.AmdSmiLibraryException, m.AmdSmiParameterException = (
        AmdSmiException, AmdSmiLibraryException, AmdSmiParameterException)
    m.AmdSmiIoLinkType, m.AmdSmiLinkType, m.AmdSmiMemoryType, m.AmdSmiInitFlags = (
        AmdSmiIoLinkType, AmdSmiLinkType, AmdSmiMemoryType, AmdSmiInitFlags)
    handles = [Handle(i) for i in range(8)]
    state = {"init": False}

    def h(x):
        if not state["init"]:
            raise AmdSmiLibraryException(32)  # AMDSMI_STATUS_NOT_INIT
        if not isinstance(x, Handle):
            raise AmdSmiParameterException("processor_handle")
        return x.i

    def amdsmi_init(flags=AmdSmiInitFlags.INIT_AMD_GPUS):
        state["init"] = True

    def amdsmi_shut_down():
        state["init"] = False

    m.amdsmi_init, m.amdsmi_shut_down = amdsmi_init, amdsmi_shut_down
    m.amdsmi_get_processor_handles = (
        lambda: list(handles) if state["init"] else (_ for _ in ()).throw(AmdSmiLibraryException(32)))
    m.amdsmi_get_gpu_device_bdf = lambda x: MI300X_BDFS[h(x)]
    m.amdsmi_get_gpu_device_uuid = lambda x: f"a1ff74a1-0000-1000-80{h(x):02d}-000000000000"
    m.amdsmi_get_gpu_asic_info = lambda x: {
        "market_name": "AMD Instinct MI300X", "vendor_id": "0x1002", "device_id": "0x74a1", "rev_id": "0x00",
        "asic_serial": f"0x{h(x):016X}", "num_of_compute_units": 304, "target_graphics_version": "gfx942"}

    def mem_total(x, kind):
        h(x)
        if kind != AmdSmiMemoryType.VRAM:
            raise AmdSmiLibraryException(2)  # AMDSMI_STATUS_NOT_SUPPORTED
        return 192 * 1024**3

    m.amdsmi_get_gpu_memory_total = mem_total
    m.amdsmi_topo_get_numa_node_number = lambda x: 0 if h(x) < 4 else 1

    def link_type(a, b):
        ia, ib = h(a), h(b)
        if ia == ib:
            return {"hops": 0, "type": AmdSmiLinkType.AMDSMI_LINK_TYPE_INTERNAL if link_type_as_enum else 0}
        return {"hops": 1,
                "type": AmdSmiLinkType.AMDSMI_LINK_TYPE_XGMI if link_type_as_enum else int(AmdSmiIoLinkType.XGMI)}

    m.amdsmi_topo_get_link_type = link_type
    m.amdsmi_topo_get_link_weight = lambda a, b: 0 if h(a) == h(b) else 15
    m.amdsmi_is_P2P_accessible = lambda a, b: (h(a), h(b)) not in p2p_off and (h(b), h(a)) not in p2p_off
    m.amdsmi_get_minmax_bandwidth_between_processors = lambda a, b: (
        h(a), h(b), {"min_bandwidth": 50000, "max_bandwidth": 50000})[-1]
    return m

