"""The data model: validation, hierarchy, fingerprint, serialisation."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from tree_attn.errors import TopologyError
from tree_attn.topology import (
    Device,
    HierarchyLevel,
    Link,
    LinkKind,
    P2PStatus,
    Topology,
    build_hierarchy,
    compare_topologies,
    format_ranges,
    host_topology,
    load_topology,
    probe_nvml,
    save_topology,
    topology_warnings,
)
from tree_attn.topology.bandwidth import estimate, pcie_gbps

from . import fakes


def topo(n, kind_of, **kw):
    devs = [Device(index=i, vendor="nvidia", name="GPU") for i in range(n)]
    links = [Link(a, b, kind_of(a, b), nvlinks=kw.get("nv")) for a in range(n) for b in range(a + 1, n)]
    return Topology(devices=devs, links=links, source="test")


def test_kind_order_fastest_first():
    order = [k.value for k in sorted(LinkKind, key=lambda k: k.rank)]
    assert order == ["nvlink", "xgmi", "pix", "pxb", "phb", "node", "sys", "unknown", "net"]
    assert LinkKind.parse("PHB") is LinkKind.PHB


def test_hierarchy_levels_partition_and_end_in_one_group():
    # two PCIe switches per socket, two sockets
    def kind(a, b):
        if a // 2 == b // 2:
            return LinkKind.PIX
        return LinkKind.NODE if a // 4 == b // 4 else LinkKind.SYS

    levels = topo(8, kind).hierarchy
    assert [(h.kind, h.groups) for h in levels] == [
        ("pix", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("node", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("sys", [list(range(8))]),
    ]
    assert build_hierarchy(1, []) == [HierarchyLevel("self", [[0]])]
    assert host_topology(1).hierarchy[-1].groups == [[0]]


def test_hierarchy_skips_classes_that_join_nothing_new():
    # PHB only inside groups already joined by NVLink: the PHB level would repeat the NVLink one.
    def kind(a, b):
        if a // 2 == b // 2:
            return LinkKind.NVLINK
        return LinkKind.SYS

    t = Topology(devices=[Device(index=i) for i in range(4)],
                 links=[Link(a, b, kind(a, b), nvlinks=4 if kind(a, b) is LinkKind.NVLINK else None)
                        for a in range(4) for b in range(a + 1, 4)])
    assert [h.kind for h in t.hierarchy] == ["nvlink", "sys"]


def test_validation_names_field_and_value():
    with pytest.raises(TopologyError, match=r"link 0-1: kind: unknown link class 'warp'"):
        Link(0, 1, "warp")
    with pytest.raises(TopologyError, match=r"nvlinks: 4 given for a sys link"):
        Link(0, 1, LinkKind.SYS, nvlinks=4)
    with pytest.raises(TopologyError, match=r"a < b"):
        Link(1, 1, LinkKind.SYS)
    with pytest.raises(TopologyError, match=r"device 0: vendor"):
        Device(index=0, vendor="intel")
    with pytest.raises(TopologyError, match=r"bandwidth_gbps: expected a number >= 0"):
        Link(0, 1, LinkKind.SYS, bandwidth_gbps=-1.0)
    with pytest.raises(TopologyError, match=r"no link for the pair 1-2"):
        Topology(devices=[Device(index=i) for i in range(3)], links=[Link(0, 1, "sys"), Link(0, 2, "sys")])
    with pytest.raises(TopologyError, match=r"devices\[1\]: index: expected 1"):
        Topology(devices=[Device(index=0), Device(index=2)], links=[Link(0, 1, "sys")])
    with pytest.raises(TopologyError, match=r"schema_version"):
        Topology(devices=[Device(index=0)], links=[], schema_version=99)


def test_round_trip_yaml_and_rejects_unknown_keys(tmp_path):
    t = probe_nvml(fakes.h100_nvswitch_pynvml())
    p = tmp_path / "t.yaml"
    save_topology(t, p)
    back = load_topology(p)
    assert back.to_dict() == t.to_dict() and back.fingerprint == t.fingerprint
    d = yaml.safe_load(p.read_text())
    d["links"][0]["speed"] = 1
    with pytest.raises(TopologyError, match=r"link: unknown key\(s\) speed"):
        Topology.from_dict(d)
    d = yaml.safe_load(p.read_text())
    d["links"][0]["nvlinks"] = 17
    with pytest.raises(TopologyError, match="fingerprint"):
        Topology.from_dict(d)
    del d["fingerprint"]
    assert Topology.from_dict(d).link(0, 1).nvlinks == 17


def test_fingerprint_ignores_measurements_and_ids_but_not_fabric():
    t = probe_nvml(fakes.h100_nvswitch_pynvml())
    same = t.replace(links=[dataclasses.replace(l, bandwidth_gbps=123.0, bandwidth_source="measured", latency_us=3.0)
                            for l in t.links],
                     devices=[dataclasses.replace(d, uuid="other", pci_bus_id=None) for d in t.devices])
    assert same.fingerprint == t.fingerprint
    lost = t.replace(links=[dataclasses.replace(l, p2p=P2PStatus.UNSUPPORTED) if l.a == 0 and l.b == 1
                            else dataclasses.replace(l) for l in t.links])
    assert lost.fingerprint != t.fingerprint
    renamed = t.replace(devices=[dataclasses.replace(d, name="NVIDIA H200") for d in t.devices])
    assert renamed.fingerprint != t.fingerprint


def test_bandwidth_estimates():
    a = Device(index=0, pcie_gen=4, pcie_width=16)
    b = Device(index=1, pcie_gen=3, pcie_width=16)
    assert pcie_gbps(4, 16) == pytest.approx(31.5, abs=0.01)
    assert estimate(LinkKind.PHB, a, b) == pytest.approx(15.76, abs=0.01)  # the slower end
    assert estimate(LinkKind.PHB, a, Device(index=1)) is None
    assert estimate(LinkKind.NVLINK, Device(index=0, arch="ampere"), Device(index=1), nvlinks=12) == 300.0
    assert estimate(LinkKind.NVLINK, Device(index=0, nvlink_version=5), Device(index=1), nvlinks=18) == 900.0
    assert estimate(LinkKind.XGMI, a, b) == 64.0


def test_warnings_and_ranges():
    t = probe_nvml(fakes.rtx4090_pcie_pynvml())
    ws = topology_warnings(t)
    assert any(w.startswith("GPUs 0-7 cannot use peer-to-peer (GNS: GPU not supported)") for w in ws)
    assert format_ranges([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7-8"
    assert topology_warnings(host_topology(2)) == []
    down = probe_nvml(fakes.h100_nvswitch_pynvml(down={2: 2}))
    assert any("NVLink counts differ" in w and "GPU0-GPU2 NV16" in w for w in topology_warnings(down))


def test_compare_bandwidth_floor():
    e = probe_nvml(fakes.h100_nvswitch_pynvml())
    a = e.replace(links=[dataclasses.replace(l, bandwidth_gbps=100.0 if (l.a, l.b) == (0, 1) else 400.0,
                                             bandwidth_source="measured") for l in e.links])
    r = compare_topologies(e, a, min_bandwidth_ratio=0.8)
    assert not r.ok
    assert r.differences == ["GPU0-GPU1: measured 100.0 GB/s, below 0.8 x the expected 450.0 GB/s (estimated)"]
    assert compare_topologies(e, a, min_bandwidth_ratio=0.2).ok
    # without measured numbers the bandwidth check is skipped, not failed
    r = compare_topologies(e, e, min_bandwidth_ratio=0.8)
    assert r.ok and r.results[-1].status == "skipped"
