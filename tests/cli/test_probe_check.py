"""`tree-attn probe` and `tree-attn check` end to end (dumps, fakes, YAML, JSON, JUnit)."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from tests.topology import fakes
from tree_attn.cli.app import main
from tree_attn.topology import load_dump, load_topology, probe_nvml, save_topology

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
H100 = FIX / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"
RTX = FIX / "rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt"


def test_probe_json_from_dump(capsys):
    assert main(["probe", "--from", str(H100), "--json"]) == 0
    out = capsys.readouterr()
    d = json.loads(out.out)
    assert d["schema_version"] == 1 and len(d["fingerprint"]) == 16
    assert [x["index"] for x in d["devices"]] == list(range(8)) and all("name" in x for x in d["devices"])
    l01 = d["links"][0]
    assert ((l01["a"], l01["b"], l01["kind"], l01["nvlinks"], l01["p2p"], l01["bandwidth_gbps"])
            == (0, 1, "nvlink", 18, "ok", 450.0))
    assert d["hierarchy"] == [{"kind": "nvlink", "groups": [list(range(8))]}]
    assert "NIC0" in out.err  # notices on stderr, stdout is pure JSON


def test_probe_report_and_warnings(capsys):
    assert main(["probe", "--from", str(RTX)]) == 0
    out = capsys.readouterr()
    assert "GPU7" in out.out and "SYS" in out.out and "hierarchy" in out.out and "sys: [0-7]" in out.out
    assert "cross the CPU socket" in out.err


def _probe_dump(tmp_path, capsys, text: str) -> tuple[int, str]:
    """``probe --from`` a dump holding ``text``: (exit code, stderr)."""
    dump = tmp_path / "dump.txt"
    dump.write_text(text)
    code = main(["probe", "--from", str(dump)])
    return code, capsys.readouterr().err


def test_probe_warns_when_p2p_is_refused(tmp_path, capsys):
    code, err = _probe_dump(tmp_path, capsys, " \tGPU0\tGPU1\n GPU0\tX\tGNS\n GPU1\tGNS\tX\n")
    assert code == 0
    assert "GPUs 0-1 cannot use peer-to-peer" in err and "host" in err


def test_probe_output_yaml_round_trips(tmp_path, capsys):
    out = tmp_path / "sub" / "topo.yaml"
    assert main(["probe", "--from", str(H100), "--output", str(out)]) == 0
    t = load_topology(out)
    assert t.fingerprint == load_dump(H100).fingerprint
    assert yaml.safe_load(out.read_text())["fingerprint"] == t.fingerprint
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".tmp-")]  # atomic write left no temp file


def test_probe_host_fallback(capsys):
    assert main(["probe", "--backend", "host", "--cpu-ranks", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["source"] == "host" and len(d["devices"]) == 3
    assert d["hierarchy"] == [{"kind": "sys", "groups": [[0, 1, 2]]}]


def test_probe_errors_are_one_line(tmp_path, capsys):
    code, err = _probe_dump(tmp_path, capsys, "\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tBOGUS\t X \n")
    assert code == 1
    assert "line 3" in err and "BOGUS" in err
    assert main(["probe", "--from", str(H100), "--measure"]) == 1


# -- check -----------------------------------------------------------------------------------------

def _altered(topo, **pair_changes):
    links = []
    for l in topo.links:
        ch = pair_changes.get(f"{l.a}-{l.b}")
        links.append(dataclasses.replace(l, **ch) if ch else dataclasses.replace(l))
    return topo.replace(links=links)


@pytest.fixture
def h100_expected(tmp_path):
    p = tmp_path / "expected.yaml"
    save_topology(probe_nvml(fakes.h100_nvswitch_pynvml()), p)
    return p


def _write(tmp_path, topo, name="actual.yaml"):
    p = tmp_path / name
    save_topology(topo, p)
    return p


def test_check_identical_passes(tmp_path, h100_expected, capsys):
    junit = tmp_path / "report.xml"
    # a saved topology checked against a dump of the same machine model (names unknown: not compared)
    assert main(["check", "--expect", str(h100_expected), "--from", str(H100), "--junit", str(junit)]) == 0
    out = capsys.readouterr().out
    assert "as expected" in out
    root = ET.parse(junit).getroot()
    suite = root.find("testsuite")
    assert suite.get("failures") == "0" and len(suite.findall("testcase")) >= 5


def test_check_lost_nvlink_fails_with_plain_words(tmp_path, h100_expected, capsys):
    actual = _write(tmp_path, probe_nvml(fakes.h100_nvswitch_pynvml(down={5: 1})))
    junit = tmp_path / "r.xml"
    code = main(["check", "--expect", str(h100_expected), "--from", str(actual), "--junit", str(junit)])
    assert code == 1
    out = capsys.readouterr().out
    # the 7 identical pair differences of one GPU read as one line (the JUnit report keeps each)
    assert "GPU5 with GPUs 0-4,6-7 (7 pairs): expected NV18, found NV17 (an NVLink is down)" in out
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "1"
    failed = [tc for tc in suite.findall("testcase") if tc.find("failure") is not None]
    assert [tc.get("name") for tc in failed] == ["nvlink counts"]
    assert "GPU0-GPU5" in failed[0].find("failure").text


def test_check_missing_gpu(tmp_path, h100_expected, capsys):
    seven = tmp_path / "seven.txt"
    lines = H100.read_text().splitlines()
    # drop GPU7's column and row from the dump: a 7-GPU machine
    keep = []
    for ln in lines[1:]:
        if ln.startswith("GPU7") or not ln.strip():
            continue
        cells = ln.split("\t")
        if len(cells) > 8:
            del cells[8 if not ln.startswith("GPU0\tGPU1") else 7]
        keep.append("\t".join(cells))
        if ln.startswith("NIC0"):
            break
    seven.write_text("\n".join(keep) + "\n")
    assert len(load_dump(seven)) == 7
    assert main(["check", "--expect", str(h100_expected), "--from", str(seven), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False
    assert any("expected 8 GPUs, found 7" in x for x in d["differences"])


def test_check_p2p_gone_and_class_changed(tmp_path, h100_expected, capsys):
    base = probe_nvml(fakes.h100_nvswitch_pynvml())
    actual = _write(tmp_path, _altered(base, **{"0-1": {"p2p": "unsupported", "p2p_reason": "DR: disabled by regkey"},
                                               "2-6": {"kind": "sys", "nvlinks": None}}))
    assert main(["check", "--expect", str(h100_expected), "--from", str(actual)]) == 1
    out = capsys.readouterr().out
    assert "GPU0-GPU1: expected peer-to-peer, found it unavailable (DR: disabled by regkey)" in out
    assert "GPU2-GPU6: expected NV18, found PCIe SYS" in out


def test_check_against_profile_section_and_dump(tmp_path, capsys):
    prof = tmp_path / "profile.yaml"
    prof.write_text(yaml.safe_dump({"topology": load_dump(RTX).to_dict()}))
    assert main(["check", "--expect", str(prof), "--from", str(RTX)]) == 0
    assert main(["check", "--expect", str(RTX), "--from", str(RTX), "--json"]) == 0
    capsys.readouterr()
    assert main(["check", "--expect", str(H100), "--from", str(RTX)]) == 1
    assert "expected NV18, found PCIe SYS" in capsys.readouterr().out


def test_check_bad_expected_file_is_one_line_error(tmp_path, capsys):
    p = tmp_path / "e.yaml"
    d = load_dump(H100).to_dict()
    d["colour"] = "blue"
    p.write_text(yaml.safe_dump(d))
    assert main(["check", "--expect", str(p), "--from", str(H100)]) == 1
    assert "unknown key(s) colour" in capsys.readouterr().err


# -- rendering: nothing a machine, a file or a user names is read as rich markup ----------------

def test_probe_of_one_device_renders_its_self_level(capsys):
    # One device: the hierarchy's single level is of kind "self", which has no colour.
    assert main(["probe", "--backend", "host", "--cpu-ranks", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 CPU rank" in out and "self: [0]" in out


def test_one_gpu_topology_renders(capsys):
    from tree_attn.cli.probe import render_topology

    links = [(2, f"00000000:{0x05 + k % 4:02X}:00.0", True) for k in range(18)]
    gpu = fakes.FakeGpu(name="NVIDIA H100 80GB HBM3", bus="00000000:18:00.0", uuid="GPU-h100-0000", memory=85520809984,
                        sms=132, arch=9, numa=0, cpus=list(range(48)), pcie=(5, 16), nvlinks=links, nvlink_version=4,
                        mig=[0, 0])
    topo = probe_nvml(fakes.make_pynvml([gpu], ancestor=lambda a, b: 40, p2p=lambda a, b, idx: 0))
    assert [lv.kind for lv in topo.hierarchy] == ["self"]
    render_topology(topo)
    out = capsys.readouterr().out
    assert "1 GPU from" in out and "GPU0: NVIDIA H100 80GB HBM3" in out and "self: [0]" in out


def test_markup_in_a_path_is_printed_as_is_in_one_error_line(capsys):
    code = main(["probe", "--from", "nope[/bold]"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err and "MarkupError" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "nope[/bold]" in lines[0]


def test_markup_in_paths_is_printed_as_is(tmp_path, capsys):
    # Dumps and outputs in a folder whose path contains "[/x]", an output file named "[/bold]".
    folder = tmp_path / "dumps[" / "x]"
    folder.mkdir(parents=True)
    dump = folder / "topo.txt"
    dump.write_text(H100.read_text())
    out = folder / "topo[/bold].yaml"
    assert main(["probe", "--from", str(dump), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.err and "NV18" in captured.out
    assert main(["check", "--expect", str(out), "--from", str(dump)]) == 0
    captured = capsys.readouterr()
    assert f"against {out}" in captured.out.replace("\n", "") and "as expected" in captured.out


def test_errors_from_ranks_with_bracketed_paths_are_one_line(monkeypatch, capsys):
    # gloo's messages name source files like [/__w/pytorch/pytorch/third_party/gloo/...]
    from tree_attn.cli import probe
    from tree_attn.errors import DistributedError

    def fail(*args, **kwargs):
        raise DistributedError("rank 1 failed: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                               "Connection closed by peer")

    monkeypatch.setattr(probe, "render_topology", fail)
    code = main(["probe", "--backend", "host", "--cpu-ranks", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed" in err


@pytest.mark.gpu
def test_probe_this_gpu_machine(capsys):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    assert main(["probe"]) == 0
    out = capsys.readouterr().out
    assert "hierarchy" in out and "GPU0" in out
    assert main(["probe", "--measure", "--iterations", "3"]) == 0
    measured = capsys.readouterr().out
    if torch.cuda.device_count() > 1:
        assert "all-reduce of" in measured and "bandwidth (measured" in measured
    else:  # one GPU: no pair, no all-reduce, and the output says so
        assert "measured nothing: one device (" in measured and "all-reduce of" not in measured


def test_measure_on_one_gpu_says_it_measured_nothing(monkeypatch, capsys):
    """``probe --measure`` on a one-GPU machine: no pair and no all-reduce, said in one line (the
    GPU run printed nothing about the measurement on an H200). CPU test: the probe and the
    measurement are stand-ins returning what they return on one GPU."""
    from tree_attn import topology as topology_pkg
    from tree_attn.topology import measure as measure_mod
    from tree_attn.topology.model import Device, Topology

    gpu = Topology(devices=[Device(index=0, vendor="nvidia", name="NVIDIA H200")], links=[], source="nvml")
    measured = dataclasses.replace(gpu, measurement=measure_mod.Measurement(
        method="cuda-copy+nccl-allreduce", iterations=3, copy_bytes=1 << 20, latency_bytes=8, allreduce_bytes=16512,
        allreduce_latency_us=None, device="NVIDIA H200"))
    monkeypatch.setattr(topology_pkg, "probe_topology", lambda *a, **k: gpu)
    monkeypatch.setattr(measure_mod, "measure_topology", lambda topo, **k: measured)
    assert main(["probe", "--measure", "--iterations", "3"]) == 0
    captured = capsys.readouterr()
    assert "measuring 1 device(s) (0 pairs, 3 iterations)" in captured.err
    assert "measured nothing: one device (NVIDIA H200) has no link to another and nothing to all-reduce with" in \
        captured.out.replace("\n", " ")
    assert "all-reduce of" not in captured.out
