"""Live probes through fake vendor modules: equal to the parse of the matching real dump."""

from __future__ import annotations

import builtins
import sys
import types
from pathlib import Path

import pytest

from tree_attn.errors import TopologyError
from tree_attn.topology import (
    LinkKind,
    P2PStatus,
    load_dumps,
    probe_amdsmi,
    probe_nvml,
    probe_topology,
)
from tree_attn.topology.amd import link_kind_from_amdsmi

from . import fakes

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def assert_same_fabric(probed, dumped):
    assert len(probed) == len(dumped)
    for lp, ld in zip(probed.links, dumped.links):
        assert (lp.a, lp.b, lp.kind, lp.nvlinks, lp.p2p) == (ld.a, ld.b, ld.kind, ld.nvlinks, ld.p2p)
    assert [h.to_dict() for h in probed.hierarchy] == [h.to_dict() for h in dumped.hierarchy]
    assert [d.numa_node for d in probed.devices] == [d.numa_node for d in dumped.devices]
    assert probed.fingerprint == dumped.fingerprint


def _device_list(tmp_path, lines):
    p = tmp_path / "names.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_h100_nvswitch_probe_equals_topo_m_dump(tmp_path):
    probed = probe_nvml(fakes.h100_nvswitch_pynvml())
    assert probed.source == "nvml"
    assert all(l.kind is LinkKind.NVLINK and l.nvlinks == 18 for l in probed.links)  # NVSwitch: NV18 everywhere
    assert probed.link(0, 7).bandwidth_gbps == 450.0  # 18 x 25 GB/s (NVLink 4)
    d = probed.devices[0]
    assert (d.name, d.pci_bus_id, d.sm_count, d.arch, d.pcie_gen, d.pcie_width) == (
        "NVIDIA H100 80GB HBM3", "0000:18:00.0", 132, "hopper", 5, 16)
    assert d.cpu_affinity == "0-47,96-143" and probed.devices[4].cpu_affinity == "48-95,144-191"
    assert d.mig_enabled is False and d.gpu_numa_id is None
    names = _device_list(tmp_path, [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-h100-{i:04d})" for i in range(8)])
    dumped = load_dumps([FIX / "h100_8gpu_nonic_nvidia-smi_topo_m_thunderkittens167.txt", names])
    assert_same_fabric(probed, dumped)
    assert [d.cpu_affinity for d in probed.devices] == [d.cpu_affinity for d in dumped.devices]
    assert [d.uuid for d in probed.devices] == [d.uuid for d in dumped.devices]


def test_rtx4090_probe_equals_topo_m_plus_p2p_dump(tmp_path):
    nv = fakes.rtx4090_pcie_pynvml()
    probed = probe_nvml(nv)
    assert all(l.kind is LinkKind.SYS and l.nvlinks is None for l in probed.links)
    assert all(l.p2p is P2PStatus.UNSUPPORTED and l.p2p_reason.startswith("GNS") for l in probed.links)
    assert probed.link(0, 1).bandwidth_gbps == pytest.approx(31.5, abs=0.1)  # PCIe 4.0 x16
    assert [d.numa_node for d in probed.devices] == fakes.RTX4090_NUMA
    assert probed.devices[0].sm_count is None  # NotSupported -> unknown, not a crash
    assert probed.devices[0].mig_enabled is None
    assert "nvmlDeviceGetNvLinkState" in nv.calls  # asked, answered NotSupported
    assert probed.notes == []
    p2p = tmp_path / "p2p.txt"
    p2p.write_text(" \t" + "\t".join(f"GPU{i}" for i in range(8)) + "\t\n" + "".join(
        f" GPU{i}\t" + "\t".join("X" if i == j else "GNS" for j in range(8)) + "\t\n" for i in range(8)))
    names = _device_list(tmp_path, [f"GPU {i}: NVIDIA GeForce RTX 4090 (UUID: GPU-4090-{i:04d})" for i in range(8)])
    dumped = load_dumps([FIX / "rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt", p2p, names])
    assert_same_fabric(probed, dumped)


@pytest.mark.parametrize("as_enum", [False, True])
def test_mi300x_probe_equals_amd_smi_and_rocm_smi_dumps(tmp_path, as_enum):
    probed = probe_amdsmi(fakes.mi300x_amdsmi(link_type_as_enum=as_enum))
    assert probed.source == "amdsmi"
    assert all(l.kind is LinkKind.XGMI and l.hops == 1 and l.weight == 15 for l in probed.links)
    assert all(l.bandwidth_gbps == 50.0 and l.bandwidth_source == "reported" for l in probed.links)
    d = probed.devices[7]
    assert (d.name, d.pci_bus_id, d.sm_count, d.arch, d.memory_bytes) == (
        "AMD Instinct MI300X", "0000:df:00.0", 304, "gfx942", 192 * 1024**3)
    names = _device_list(tmp_path, [f"GPU[{i}]\t\t: Card Series: \t\tAMD Instinct MI300X" for i in range(8)])
    dumped = load_dumps([FIX / "mi300x_8gpu_amd-smi_topology.txt", FIX / "mi300x_8gpu_rocm-smi_showtopo.txt", names])
    assert_same_fabric(probed, dumped)
    assert [d.pci_bus_id for d in probed.devices] == [d.pci_bus_id for d in dumped.devices]


def test_amd_link_type_enums_are_not_confused():
    am = fakes.mi300x_amdsmi()
    # amdsmi_topo_get_link_type integers are amdsmi_io_link_type_t: 2 = XGMI, 1 = PCIe
    assert link_kind_from_amdsmi(2, am) is LinkKind.XGMI
    assert link_kind_from_amdsmi(1, am) is None  # PCIe: class decided from NUMA placement
    # an AmdSmiLinkType member (nearest-link enum) has XGMI = 1: read by name, not by number
    assert link_kind_from_amdsmi(am.AmdSmiLinkType.AMDSMI_LINK_TYPE_XGMI, am) is LinkKind.XGMI
    assert link_kind_from_amdsmi(am.AmdSmiLinkType.AMDSMI_LINK_TYPE_PCIE, am) is None
    assert link_kind_from_amdsmi(0, am) is LinkKind.UNKNOWN


def test_mi300x_p2p_off_and_pcie_placement():
    t = probe_amdsmi(fakes.mi300x_amdsmi(p2p_off={(0, 1)}))
    assert t.link(0, 1).p2p is P2PStatus.UNSUPPORTED and t.link(0, 2).p2p is P2PStatus.OK


def test_nvlink_down_shows_as_lower_count():
    t = probe_nvml(fakes.h100_nvswitch_pynvml(down={5: 1}))
    assert t.link(3, 5).nvlinks == 17 and t.link(3, 4).nvlinks == 18
    assert t.fingerprint != probe_nvml(fakes.h100_nvswitch_pynvml()).fingerprint


def test_direct_nvlink_pairs_and_missing_functions():
    # Two GPUs bridged by 4 direct NVLinks (no switch), PCIe PHB otherwise; an older pynvml
    # without P2P and NUMA functions: those fields become unknown.
    g = [fakes.FakeGpu(name="NVIDIA RTX A6000", bus=f"00000000:{b}:00.0", uuid=f"GPU-{i}", memory=1, sms=84, arch=7,
                       numa=0, cpus=[0, 1], pcie=(4, 16), nvlink_version=3,
                       nvlinks=[(0, f"00000000:{o}:00.0", True)] * 4)
         for i, (b, o) in enumerate([("21", "41"), ("41", "21")])]
    nv = fakes.make_pynvml(g, ancestor=lambda a, b: 30, p2p=lambda a, b, i: 0,
                           missing=("nvmlDeviceGetP2PStatus", "nvmlDeviceGetMemoryAffinity"))
    t = probe_nvml(nv)
    l = t.link(0, 1)
    assert (l.kind, l.nvlinks, l.p2p, l.bandwidth_gbps) == (LinkKind.NVLINK, 4, P2PStatus.UNKNOWN, 100.0)
    assert t.devices[0].numa_node is None and t.devices[0].nvlink_version == 3


def test_unexpected_nvml_error_becomes_unknown_with_a_note():
    nv = fakes.h100_nvswitch_pynvml()
    real = nv.nvmlDeviceGetMaxPcieLinkWidth

    def lost(h):
        raise nv.NVMLError_GpuIsLost()

    nv.nvmlDeviceGetMaxPcieLinkWidth = lost
    t = probe_nvml(nv)
    assert t.devices[0].pcie_width is None
    assert any("nvmlDeviceGetMaxPcieLinkWidth" in n for n in t.notes)
    nv.nvmlDeviceGetMaxPcieLinkWidth = real


def test_auto_backend_order_and_host_fallback(monkeypatch):
    h = probe_topology(nvml_module=fakes.h100_nvswitch_pynvml(), amdsmi_module=fakes.mi300x_amdsmi())
    assert h.source == "nvml"

    nv = fakes.h100_nvswitch_pynvml()

    def no_driver():
        raise nv.NVMLError_DriverNotLoaded()

    nv.nvmlInit = no_driver
    a = probe_topology(nvml_module=nv, amdsmi_module=fakes.mi300x_amdsmi())
    assert a.source == "amdsmi"

    # Neither library: a failed `import amdsmi` may raise KeyError, not ImportError.
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "amdsmi":
            raise KeyError("ROCM_PATH")
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    t = probe_topology(cpu_ranks=3)
    assert t.source == "host" and len(t) == 3
    assert "KeyError" in t.notes[0] and "3 CPU rank" in t.notes[0]
    with pytest.raises(TopologyError, match="NVML backend unavailable"):
        probe_topology("nvml")
    with pytest.raises(TopologyError, match="AMD SMI backend unavailable"):
        probe_topology("amdsmi")
    with pytest.raises(TopologyError, match="backend: expected one of"):
        probe_topology("cuda")


def test_no_gpu_is_unavailable():
    nv = fakes.make_pynvml([], ancestor=lambda a, b: 0, p2p=lambda a, b, i: 0)
    t = probe_topology(nvml_module=nv, amdsmi_module=types.ModuleType("amdsmi"), cpu_ranks=2)
    assert t.source == "host" and "NVML sees no GPU" in t.notes[0]


def test_gpu_that_cannot_be_opened_is_a_clear_error():
    nv = fakes.h100_nvswitch_pynvml()

    def lost(i):
        raise nv.NVMLError_GpuIsLost()

    nv.nvmlDeviceGetHandleByIndex = lost
    with pytest.raises(TopologyError, match="NVML cannot open GPU 0"):
        probe_nvml(nv)


def test_nvml_keeps_the_gpus_cuda_visible_devices_leaves_in_cudas_order(monkeypatch):
    """NVML lists the whole machine; a run sees CUDA_VISIBLE_DEVICES's GPUs, numbered from 0 in
    its order. The topology must describe those (rank 0's cuda:0 is the machine's GPU 5 below)."""
    from tree_attn.topology.nvml import BackendUnavailable

    whole = probe_nvml(fakes.rtx4090_pcie_pynvml())
    some = probe_nvml(fakes.rtx4090_pcie_pynvml(), visible_devices="5, 1,GPU-4090-0002")
    assert [d.uuid for d in some.devices] == ["GPU-4090-0005", "GPU-4090-0001", "GPU-4090-0002"]
    assert [d.index for d in some.devices] == [0, 1, 2]
    # each pair keeps the machine's link between those two GPUs
    for (a, b), (wa, wb) in {(0, 1): (1, 5), (0, 2): (2, 5), (1, 2): (1, 2)}.items():
        got, want = some.link(a, b), whole.link(wa, wb)
        assert (got.kind, got.p2p, got.bandwidth_gbps) == (want.kind, want.p2p, want.bandwidth_gbps)
    assert "machine GPU 5, 1, 2 are cuda:0, 1, 2" in some.notes[-1]
    # CUDA's parsing: stop at the first entry naming no GPU (or one named already)
    assert [d.uuid for d in probe_nvml(fakes.rtx4090_pcie_pynvml(),
                                       visible_devices="3,99,0").devices] == ["GPU-4090-0003"]
    assert len(probe_nvml(fakes.rtx4090_pcie_pynvml(), visible_devices="2,2,0")) == 1
    assert len(probe_nvml(fakes.rtx4090_pcie_pynvml(), visible_devices="0,1,2,3,4,5,6,7")) == 8
    # MIG instances are not in the topology: the whole machine, with a note
    mig = probe_nvml(fakes.rtx4090_pcie_pynvml(), visible_devices="MIG-1234")
    assert len(mig) == 8 and "MIG" in mig.notes[-1]
    # none visible: NVML is no use to this process (auto probing falls back to CPU ranks)
    for value in ("", "-1", "GPU-nope"):
        with pytest.raises(BackendUnavailable, match="leaves none of this machine's 8 GPU"):
            probe_nvml(fakes.rtx4090_pcie_pynvml(), visible_devices=value)
    # the environment applies to the real NVML only; a fake module shows all its GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert len(probe_nvml(fakes.rtx4090_pcie_pynvml())) == 8


def test_amd_smi_keeps_the_gpus_rocm_leaves_visible():
    """ROCR_VISIBLE_DEVICES narrows first, HIP_VISIBLE_DEVICES (else CUDA_VISIBLE_DEVICES) indexes
    what is left; only indices are matched (ROCm's UUIDs are not AMD SMI's)."""
    from tree_attn.topology.nvml import BackendUnavailable

    whole = probe_amdsmi(fakes.mi300x_amdsmi())
    uuids = [d.uuid for d in whole.devices]
    some = probe_amdsmi(fakes.mi300x_amdsmi(),
                        environ={"ROCR_VISIBLE_DEVICES": "1,3,5,7", "HIP_VISIBLE_DEVICES": "2,0"})
    assert [d.uuid for d in some.devices] == [uuids[5], uuids[1]]
    assert [n for n in some.notes if "VISIBLE" in n][-1].startswith("HIP_VISIBLE_DEVICES='2,0'")
    assert [d.uuid for d in probe_amdsmi(fakes.mi300x_amdsmi(),
                                         environ={"CUDA_VISIBLE_DEVICES": "6"}).devices] == [uuids[6]]
    by_uuid = probe_amdsmi(fakes.mi300x_amdsmi(), environ={"ROCR_VISIBLE_DEVICES": "GPU-1234abcd"})
    assert len(by_uuid) == 8 and "other than their index" in by_uuid.notes[-1]
    with pytest.raises(BackendUnavailable, match="HIP_VISIBLE_DEVICES='-1' leaves none"):
        probe_amdsmi(fakes.mi300x_amdsmi(), environ={"HIP_VISIBLE_DEVICES": "-1"})
