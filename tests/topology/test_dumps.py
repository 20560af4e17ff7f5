"""Every recorded dump in tests/fixtures/topology/ parses to the right devices and classes;
broken dumps fail with the line named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tree_attn.errors import TopologyError
from tree_attn.topology import LinkKind, P2PStatus, detect_format, load_dump, load_dumps, parse_dump

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"


# fixture file name -> its checks, registered by @fixture beside them; the GPU count is the name's.
EXPECTED = {}


def fixture(name):
    """Register the decorated function as the checks of the recorded dump ``name``."""

    def register(check):
        EXPECTED[name] = check
        return check

    return register


def gpu_count(name):
    """The GPUs a fixture's file name says it holds (``..._8gpu_...``)."""
    return int(re.search(r"(\d+)gpu", name).group(1))


def groups(topo):
    return [(h.kind, h.groups) for h in topo.hierarchy]


def kinds(topo):
    return {(l.a, l.b): l.label for l in topo.links}


def test_every_fixture_is_covered_and_starts_with_a_source_line():
    files = sorted(p.name for p in FIX.iterdir())
    assert len(files) == 12
    for name in files:
        assert (FIX / name).read_text().startswith("# source:"), name
        assert name in EXPECTED, f"{name} has no per-fixture assertions"


@fixture("a100_dgx_8gpu_12nic_nvidia-smi_topo_m.txt")
def _a100(t):
    assert t.source == "dump:nvidia-smi-topo-m"
    assert all(l.kind is LinkKind.NVLINK and l.nvlinks == 12 for l in t.links)
    assert [d.numa_node for d in t.devices] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert t.devices[4].cpu_affinity == "112-127,240-255"
    assert groups(t) == [("nvlink", [list(range(8))])]
    assert t.link(0, 7).bandwidth_gbps == 300.0 and t.link(0, 7).bandwidth_source == "estimated"
    assert any("mlx5_11" in n for n in t.notes)  # 12 NICs recognised, not taken as GPUs


@fixture("dgx1_v100_8gpu_nvidia-smi_topo_mp.txt")
def _dgx1(t):
    # topo -mp: PCIe classes only (the NVLinks of a DGX-1 are not shown by -mp).
    assert t.link(0, 1).kind is LinkKind.PIX and t.link(2, 3).kind is LinkKind.PIX
    assert t.link(0, 2).kind is LinkKind.PHB and t.link(5, 7).kind is LinkKind.PHB
    assert t.link(0, 4).kind is LinkKind.SYS and t.link(3, 7).kind is LinkKind.SYS
    assert not any(l.kind is LinkKind.NVLINK for l in t.links)
    assert [d.numa_node for d in t.devices] == [0] * 4 + [1] * 4
    assert groups(t) == [
        ("pix", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("phb", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("sys", [list(range(8))]),
    ]
    assert all(l.p2p is P2PStatus.UNKNOWN for l in t.links)


@fixture("geforce_rtx4090_mixed_4gpu_phb_nvidia-smi_topo_m_aikitoria1.txt")
def _aikitoria(t):
    assert all(l.kind is LinkKind.PHB for l in t.links)
    assert [d.numa_node for d in t.devices] == [0] * 4
    assert [d.gpu_numa_id for d in t.devices] == [None] * 4
    assert t.devices[0].cpu_affinity == "0-15"
    assert groups(t) == [("phb", [[0, 1, 2, 3]])]


@fixture("geforce_rtx4090_rtx5090_mixed_5gpu_nvidia-smi_topo_m_club3090_46.txt")
def _club46(t):
    k = kinds(t)
    assert k[(0, 1)] == "SYS" and k[(1, 2)] == "PHB" and k[(1, 3)] == "NODE" and k[(3, 4)] == "PHB"
    assert [d.numa_node for d in t.devices] == [1, 0, 0, 0, 0]
    assert t.devices[0].cpu_affinity == "8-15,24-31"
    assert groups(t) == [("phb", [[0], [1, 2], [3, 4]]), ("node", [[0], [1, 2, 3, 4]]), ("sys", [[0, 1, 2, 3, 4]])]


@fixture("geforce_rtx5090_2gpu_nvidia-smi_topo_p2p_rw_gns.txt")
def _p2p_gns(t):
    assert t.source == "dump:nvidia-smi-topo-p2p"
    l = t.link(0, 1)
    assert l.kind is LinkKind.UNKNOWN
    assert l.p2p is P2PStatus.UNSUPPORTED and l.p2p_reason.startswith("GNS")
    assert groups(t) == [("unknown", [[0, 1]])]


def _h100_nvswitch(t):
    assert all(l.kind is LinkKind.NVLINK and l.nvlinks == 18 for l in t.links)
    assert all(l.p2p is P2PStatus.OK for l in t.links)  # inferred from NVLink
    assert [d.numa_node for d in t.devices] == [0] * 4 + [1] * 4
    assert groups(t) == [("nvlink", [list(range(8))])]
    assert t.link(3, 4).bandwidth_gbps == 450.0


@fixture("h100_8gpu_nonic_nvidia-smi_topo_m_thunderkittens167.txt")
def _tk167(t):
    _h100_nvswitch(t)
    assert t.devices[0].cpu_affinity == "0-47,96-143" and t.devices[7].cpu_affinity == "48-95,144-191"


@fixture("h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt")
def _vm(t):
    _h100_nvswitch(t)
    assert t.devices[0].cpu_affinity == "0-103" and t.devices[4].cpu_affinity == "104-207"
    assert any("NIC0" in n for n in t.notes)


@fixture("h200_hgx_8gpu_12nic_nvidia-smi_topo_m.txt")
def _h200(t):
    _h100_nvswitch(t)
    assert t.devices[5].cpu_affinity == "56-111,168-223"
    assert any("NIC11" in n for n in t.notes)


@fixture("mi300x_8gpu_amd-smi_topology.txt")
def _mi300x_topology(t):
    assert t.source == "dump:amd-smi-topology"
    assert [d.pci_bus_id for d in t.devices][:2] == ["0000:0c:00.0", "0000:22:00.0"]
    assert all(l.kind is LinkKind.XGMI and l.hops == 1 and l.weight == 15 for l in t.links)
    assert all(l.p2p is P2PStatus.OK and l.p2p_reason is None for l in t.links)  # ACCESS: ENABLED
    assert all(l.bandwidth_gbps == 50.0 and l.bandwidth_source == "reported" for l in t.links)
    assert groups(t) == [("xgmi", [list(range(8))])]


@fixture("mi300x_8gpu_amd-smi_xgmi.txt")
def _mi300x_xgmi(t):
    assert t.source == "dump:amd-smi-xgmi"
    assert t.devices[7].pci_bus_id == "0000:df:00.0"
    assert all(l.kind is LinkKind.XGMI and l.bandwidth_gbps == 64.0 for l in t.links)  # 512 Gb/s
    assert groups(t) == [("xgmi", [list(range(8))])]


@fixture("mi300x_8gpu_rocm-smi_showtopo.txt")
def _mi300x_rocm(t):
    assert t.source == "dump:rocm-smi-showtopo"
    assert all(l.kind is LinkKind.XGMI and l.weight == 15 and l.hops == 1 for l in t.links)
    assert [d.numa_node for d in t.devices] == [0] * 4 + [1] * 4
    assert groups(t) == [("xgmi", [list(range(8))])]


@fixture("rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt")
def _rtx4090_8(t):
    assert len(t) == 8  # NIC0-NIC2 rows and the cut NIC3 row are not GPUs
    assert all(l.kind is LinkKind.SYS for l in t.links)
    assert [d.numa_node for d in t.devices] == [3, 2, 1, 0, 7, 6, 5, 4]  # one GPU per NUMA node
    assert t.devices[6].cpu_affinity == "40-47,104-111"
    assert groups(t) == [("sys", [list(range(8))])]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses(name):
    n, check = gpu_count(name), EXPECTED[name]
    t = load_dump(FIX / name)
    assert len(t) == n == t.world_size
    assert len(t.links) == n * (n - 1) // 2
    check(t)
    levels = t.hierarchy
    assert levels[-1].groups == [list(range(n))]
    # each level is a partition of all devices
    for lv in levels:
        assert sorted(i for g in lv.groups for i in g) == list(range(n))


def test_same_machine_model_gives_same_fingerprint():
    fps = {load_dump(FIX / n).fingerprint for n in (
        "h100_8gpu_nonic_nvidia-smi_topo_m_thunderkittens167.txt",
        "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt",
        "h200_hgx_8gpu_12nic_nvidia-smi_topo_m.txt")}
    assert len(fps) == 1  # names unknown in topo -m: the fabric is the same
    assert load_dump(FIX / "a100_dgx_8gpu_12nic_nvidia-smi_topo_m.txt").fingerprint not in fps


TOPO_M = """\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV4\tSYS\t0-7\t0
GPU1\tNV4\t X \tSYS\t0-7\t0
GPU2\tSYS\tSYS\t X \t8-15\t1
"""


def test_spaces_tabs_and_pipe_header_parse_alike():
    a = parse_dump(TOPO_M)
    b = parse_dump("| " + TOPO_M.replace("\t", "   ").lstrip())
    c = parse_dump("$ nvidia-smi topo -m\n" + TOPO_M.replace("\t", " "))
    assert a.to_dict()["links"] == b.to_dict()["links"] == c.to_dict()["links"]
    assert a.link(0, 1).nvlinks == 4 and a.link(1, 2).kind is LinkKind.SYS
    assert [h.kind for h in a.hierarchy] == ["nvlink", "sys"]


@pytest.mark.parametrize(
    "text, line, words",
    [
        # truncated: the file stops inside GPU2's row
        (TOPO_M.rsplit("\n", 2)[0] + "\nGPU2\tSYS\tSYS", 4, "GPU2 has 2 cells"),
        # truncated: GPU2's row is missing altogether
        ("\n".join(TOPO_M.splitlines()[:3]) + "\n", 3, "GPU2"),
        # unknown class name
        (TOPO_M.replace("GPU1\tNV4\t X \tSYS", "GPU1\tNV4\t X \tFOO"), 3, "unknown link class 'FOO'"),
        # not square: more cells than the header has columns
        (TOPO_M.replace("8-15\t1", "8-15\t1\tN/A\textra"), 4, "not square"),
        # asymmetric
        (TOPO_M.replace("GPU2\tSYS\tSYS", "GPU2\tPIX\tSYS"), 4, "not symmetric"),
    ],
)
def test_broken_topo_m_names_the_line(text, line, words):
    with pytest.raises(TopologyError) as ei:
        parse_dump("# source: test\n" + text)
    msg = str(ei.value)
    assert f"line {line + 1}:" in msg and words in msg


def test_broken_p2p_and_amd_dumps_name_the_line():
    with pytest.raises(TopologyError, match=r"line 2: unknown peer-to-peer status 'MAYBE'"):
        parse_dump(" \tGPU0\tGPU1\n GPU0\tX\tMAYBE\n GPU1\tOK\tX\n")
    text = (FIX / "mi300x_8gpu_amd-smi_topology.txt").read_text()
    row38 = "0000:38:00.0 XGMI         XGMI         SELF"
    with pytest.raises(TopologyError, match=r"line 39: unknown link type 'WARP'"):
        parse_dump(text.replace(row38, "0000:38:00.0 XGMI         WARP         SELF", 1))
    with pytest.raises(TopologyError, match=r"line 39: link type .*'PCIE'.*not symmetric"):
        parse_dump(text.replace(row38, "0000:38:00.0 XGMI         PCIE         SELF", 1))
    cut = "\n".join((FIX / "mi300x_8gpu_rocm-smi_showtopo.txt").read_text().splitlines()[:8])
    with pytest.raises(TopologyError, match=r"line 8: .*truncated"):
        parse_dump(cut)


def test_unrecognised_text_is_a_clear_error(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_text("hello\nworld\n")
    with pytest.raises(TopologyError, match="unrecognised topology dump"):
        load_dump(p)
    with pytest.raises(TopologyError, match="cannot read"):
        load_dump(tmp_path / "missing.txt")


def test_detect_format_of_each_fixture():
    got = {n: detect_format((FIX / n).read_text()) for n in EXPECTED}
    assert got["mi300x_8gpu_rocm-smi_showtopo.txt"] == "rocm-smi-showtopo"
    assert got["mi300x_8gpu_amd-smi_xgmi.txt"] == "amd-smi-xgmi"
    assert got["geforce_rtx5090_2gpu_nvidia-smi_topo_p2p_rw_gns.txt"] == "nvidia-smi-topo-p2p"
    assert got["dgx1_v100_8gpu_nvidia-smi_topo_mp.txt"] == "nvidia-smi-topo-m"


def test_combining_dumps_fills_names_and_p2p(tmp_path):
    names = tmp_path / "L.txt"
    names.write_text("GPU 0: NVIDIA GeForce RTX 5090 (UUID: GPU-aaaa)\n"
                     "GPU 1: NVIDIA GeForce RTX 5090 (UUID: GPU-bbbb)\n")
    m = tmp_path / "m.txt"
    m.write_text("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tPHB\t0-15\t0\nGPU1\tPHB\t X \t0-15\t0\n")
    t = load_dumps([FIX / "geforce_rtx5090_2gpu_nvidia-smi_topo_p2p_rw_gns.txt", names, m])
    assert t.link(0, 1).kind is LinkKind.PHB  # classes from topo -m
    assert t.link(0, 1).p2p is P2PStatus.UNSUPPORTED  # P2P from topo -p2p
    assert [d.name for d in t.devices] == ["NVIDIA GeForce RTX 5090"] * 2
    assert t.devices[1].uuid == "GPU-bbbb" and t.devices[0].numa_node == 0
    assert not any("gives no" in n for n in t.notes), t.notes  # nothing left to ask for
    only_names = load_dumps([m, names])
    assert any(n.startswith("nvidia-smi topo -m gives no peer-to-peer status") for n in only_names.notes)
    assert not any("no device names" in n for n in only_names.notes), only_names.notes
    assert any("no device names and no peer-to-peer" in n for n in load_dump(m).notes)
    other = tmp_path / "other.txt"
    other.write_text("\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n")
    with pytest.raises(TopologyError, match="disagree"):
        load_dumps([m, other])
