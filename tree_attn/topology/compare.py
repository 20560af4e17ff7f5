"""Compare a machine's topology with an expected one (``tree-attn check``), and JUnit output.

Each check is one category (device model, device count, link classes, NVLink counts,
peer-to-peer, bandwidth); its differences are listed in plain words. A fact one side does not know (a dump
without names, a probe that could not read P2P) is not a difference: it is reported as not
checked.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .dumps import FORMAT_COMMANDS
from .io import atomic_write_text
from .model import UNKNOWN, Link, LinkKind, P2PStatus, Topology, format_ranges


@dataclass
class CheckResult:
    """One check: ``status`` is ``passed``, ``failed`` or ``skipped``; ``differences`` the plain
    words for each difference; ``detail`` a one-line summary."""

    name: str
    status: str
    detail: str
    differences: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "differences": list(self.differences)}


@dataclass
class CheckReport:
    expected_fingerprint: str
    actual_fingerprint: str
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(r.status != "failed" for r in self.results)

    @property
    def model_compared(self) -> bool:
        """False when the device models could not be compared (a dump that names no GPU)."""
        return all(r.status != "skipped" for r in self.results if r.name == "device model")

    @property
    def differences(self) -> list[str]:
        return [d for r in self.results for d in r.differences]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "expected_fingerprint": self.expected_fingerprint,
            "actual_fingerprint": self.actual_fingerprint,
            "checks": [r.to_dict() for r in self.results],
            "differences": self.differences,
        }


def _describe(l: Link) -> str:
    if l.kind is LinkKind.NVLINK:
        return l.label
    if l.kind is LinkKind.XGMI:
        return "xGMI"
    if l.kind.is_pcie:
        return f"PCIe {l.label}"
    return l.label


def _result(name: str, diffs: list[str], checked: int, skipped_why: str | None = None) -> CheckResult:
    if diffs:
        return CheckResult(name, "failed", f"{len(diffs)} difference(s)", diffs)
    if checked == 0:
        return CheckResult(name, "skipped", skipped_why or "nothing to compare")
    return CheckResult(name, "passed", f"{checked} compared, all as expected")


# Full NVLink counts of a GPU model between two GPUs (through NVSwitch, or bridged pairs), for
# reading a dump that names no GPU: a count that is the same on every pair and is one of these is
# a model's whole set of links, not links down. Sources: NVIDIA datasheets (V100 SXM3 6 links
# per GPU on DGX-2's NVSwitch; A100 12; H100/H200 SXM and B200 18; bridged PCIe pairs: A100 PCIe
# and H100 NVL 12 with three bridges, RTX A6000 / A40 / RTX 3090 4).
FULL_NVLINK_SETS = {
    4: "RTX A6000, A40, RTX 3090 bridged pairs",
    6: "V100 SXM3 (DGX-2)",
    12: "A100, H100 NVL pairs",
    18: "H100, H200, B200 SXM",
}
# Where a machine's GPU names come from, for a dump that has none: the listing of its vendor.
NAME_LISTINGS = {"nvidia": "nvidia-smi -L", "amd": "rocm-smi --showproductname"}


def no_names_hint(*topologies: Topology) -> str:
    """What to add so that the names can be compared: the listing of the GPUs' vendor (an AMD
    dump is not helped by ``nvidia-smi -L``)."""
    vendors = {d.vendor for t in topologies for d in t.devices} & set(NAME_LISTINGS)
    listings = " or ".join(f"`{NAME_LISTINGS[v]}`" for v in sorted(vendors, reverse=True)) or "`nvidia-smi -L`"
    return f"add {listings} output as another --from to compare the names"


def _no_names_dump(topo: Topology) -> str:
    """The dump's own words: ``a `nvidia-smi topo -m` dump`` (its source ``dump:nvidia-smi-topo-m``)."""
    kind = topo.source.removeprefix("dump:") if topo.source.startswith("dump:") else ""
    command = FORMAT_COMMANDS.get(kind)
    return f"a `{command}` dump names none" if command else "a topology dump names none"


def _model_words(topo: Topology) -> str:
    """``8x NVIDIA H100 80GB HBM3``, ``8 NVIDIA GPUs`` (names unknown), ``4 CPU ranks``."""
    n = len(topo)
    names = sorted({d.name for d in topo.devices})
    vendors = sorted({d.vendor for d in topo.devices})
    if vendors == ["cpu"]:
        return f"{n} CPU rank{'s' if n != 1 else ''}"
    if len(names) == 1 and names[0] != UNKNOWN:
        return f"{n}x {names[0]}"
    if len(names) > 1 and UNKNOWN not in names:
        return f"{n} GPUs ({', '.join(names)})"
    vendor = {"nvidia": "NVIDIA ", "amd": "AMD "}.get(vendors[0], "") if len(vendors) == 1 else ""
    return f"{n} {vendor}GPU{'s' if n != 1 else ''}"


def _uniform_nvlinks(topo: Topology) -> int | None:
    """The NVLink count every NVLink pair shares, when every pair is NVLink and they all agree."""
    counts = {l.nvlinks if l.kind is LinkKind.NVLINK else None for l in topo.links}
    return counts.pop() if len(counts) == 1 and None not in counts else None


def _compare_models(expected: Topology, actual: Topology) -> CheckResult:
    """The first check: the same kind of device (GPU or CPU rank), vendor and model.

    Names are compared where both sides know them; where one side names nothing (a ``topo -m``
    dump), a uniform NVLink count that is another model's full set still tells the models apart."""
    name = "device model"
    e_gpu = any(d.vendor != "cpu" for d in expected.devices)
    a_gpu = any(d.vendor != "cpu" for d in actual.devices)
    if e_gpu and not a_gpu:
        where = ("this machine has no GPU (no NVIDIA or AMD GPU could be read; its CPU ranks are not GPUs): run the "
                 "check on the GPU machine, or check a recorded dump with --from" if actual.source == "host" else
                 "the checked topology has no GPU")
        return CheckResult(name, "failed", "this machine has no GPU" if actual.source == "host" else "no GPU",
                           [f"expected {_model_words(expected)}; {where}"])
    if a_gpu and not e_gpu:
        return CheckResult(name, "failed", "different device model",
                           [f"different device model: expected {_model_words(expected)}, found {_model_words(actual)}"])
    if not e_gpu:
        return CheckResult(name, "passed", "CPU ranks on both sides")
    e_vendors = {d.vendor for d in expected.devices} - {UNKNOWN}
    a_vendors = {d.vendor for d in actual.devices} - {UNKNOWN}
    if e_vendors and a_vendors and e_vendors != a_vendors:
        return CheckResult(name, "failed", "different GPU model",
                           [f"different GPU model: expected {_model_words(expected)}, found {_model_words(actual)}"])
    pairs = [(i, e.name, a.name) for i, (e, a) in enumerate(zip(expected.devices, actual.devices))
             if UNKNOWN not in (e.name, a.name)]
    if pairs:
        wrong = [(i, e, a) for i, e, a in pairs if e != a]
        if not wrong:
            names = {e for _, e, _ in pairs}
            return CheckResult(name, "passed", f"{len(pairs)} compared, all {names.pop()}" if len(names) == 1
                               else f"{len(pairs)} compared, all as expected")
        kinds = {(e, a) for _, e, a in wrong}
        if len(kinds) == 1 and len(wrong) == len(pairs):
            e, a = kinds.pop()
            diffs = [f"different GPU model: expected {e}, found {a}"
                     + (f" (all {len(pairs)} GPUs)" if len(pairs) > 1 else "")]
        else:
            diffs = [f"GPU{i}: different GPU model: expected {e}, found {a}" for i, e, a in wrong]
        return CheckResult(name, "failed", "different GPU model", diffs)
    # Names unknown on one side at least: the NVLink counts may still tell.
    e_nv, a_nv = _uniform_nvlinks(expected), _uniform_nvlinks(actual)
    if e_nv and a_nv and e_nv != a_nv and a_nv in FULL_NVLINK_SETS and e_nv in FULL_NVLINK_SETS:
        return CheckResult(name, "failed", "different GPU model (by its NVLinks)", [
            (f"different GPU model: every GPU pair has NV{a_nv} where NV{e_nv} was expected; a count the same on every "
             f"pair is a model's full set of NVLinks (NV{a_nv}: {FULL_NVLINK_SETS[a_nv]}; NV{e_nv}: "
             f"{FULL_NVLINK_SETS[e_nv]}), not NVLinks down. The names are unknown: {no_names_hint(expected, actual)}")])
    unnamed = [t for t in (actual, expected) if all(d.name == UNKNOWN for d in t.devices)]
    side = ("neither side names its GPUs" if len(unnamed) == 2
            else "the expected topology names no GPU" if unnamed[0] is expected
            else "the checked topology names no GPU")
    return CheckResult(name, "skipped", f"not compared: {side} ({_no_names_dump(unnamed[0])}); "
                                        f"{no_names_hint(expected, actual)}")


def compare_topologies(
    expected: Topology,
    actual: Topology,
    *,
    min_bandwidth_ratio: float | None = None,
) -> CheckReport:
    """Compare ``actual`` with ``expected``. With ``min_bandwidth_ratio`` R, each pair whose
    bandwidth was measured in ``actual`` must reach R x the expected bandwidth.

    The device model comes first: on another model (or without a GPU) the links differ because
    the machine is another one, so they are not compared pair by pair (an A100's NV12 read as
    "6 NVLinks down" against an H100's NV18 would send someone to reseat healthy cards)."""
    link_checks = ["link classes", "nvlink counts", "peer-to-peer"]
    if min_bandwidth_ratio is not None:
        link_checks.append("bandwidth")
    model = _compare_models(expected, actual)
    results: list[CheckResult] = [model]
    ne, na = len(expected), len(actual)
    if model.status == "failed" and not any(d.vendor != "cpu" for d in actual.devices):
        for name in ["device count"] + link_checks:
            results.append(CheckResult(name, "skipped", "no GPU to compare"))
        return CheckReport(expected.fingerprint, actual.fingerprint, results)
    if ne != na:
        what = ("missing (not visible: check nvidia-smi / amd-smi and CUDA_VISIBLE_DEVICES)" if na < ne
                else "more than expected")
        results.append(CheckResult("device count", "failed", f"expected {ne}, found {na}",
                                   [f"expected {ne} GPUs, found {na}: {abs(ne - na)} {what}"]))
    else:
        results.append(CheckResult("device count", "passed", f"{na} devices, as expected"))
    n = min(ne, na)

    if model.status == "failed":
        for name in link_checks:
            results.append(CheckResult(name, "skipped",
                                       "another device model: its links are not compared pair by pair"))
        return CheckReport(expected.fingerprint, actual.fingerprint, results)
    if ne != na:
        # Indices shift when a GPU is missing: pair-by-pair comparisons would mislead.
        for name in link_checks:
            results.append(CheckResult(name, "skipped", "device counts differ; pairs cannot be matched"))
        return CheckReport(expected.fingerprint, actual.fingerprint, results)

    pairs = [(expected.link(a, b), actual.link(a, b)) for a in range(n) for b in range(a + 1, n)]
    results.append(_pairwise("link classes", pairs, _class_difference, "link classes unknown on one side"))
    results.append(_pairwise("nvlink counts", pairs, _nvlink_difference, "no NVLink pairs on both sides"))
    results.append(_pairwise("peer-to-peer", pairs, _p2p_difference, "peer-to-peer status unknown on one side"))
    if min_bandwidth_ratio is not None:
        results.append(_pairwise("bandwidth", pairs, partial(_bandwidth_difference, min_bandwidth_ratio),
                                 "no measured bandwidth to compare (run with --measure)"))
    return CheckReport(expected.fingerprint, actual.fingerprint, results)


# A pair check: ``difference(expected link, actual link)`` is None where the pair cannot be
# compared (unknown on one side), "" where it matches, else what differs.
PairCheck = Callable[[Link, Link], "str | None"]


def _pairwise(name: str, pairs: list[tuple[Link, Link]], difference: PairCheck, none_checked: str) -> CheckResult:
    """One check over every GPU pair: the differences, each named by its pair."""
    diffs, checked = [], 0
    for e, a in pairs:
        d = difference(e, a)
        if d is None:
            continue
        checked += 1
        if d:
            diffs.append(f"GPU{e.a}-GPU{e.b}: {d}")
    return _result(name, diffs, checked, none_checked)


def _class_difference(e: Link, a: Link) -> str | None:
    if LinkKind.UNKNOWN in (e.kind, a.kind):
        return None
    if e.kind is a.kind:
        return ""
    why = ""
    if e.kind is LinkKind.NVLINK:
        why = " (no NVLink between them: a bridge, an NVSwitch path or all their links are down)"
    elif e.kind.rank < a.kind.rank:
        why = " (a slower path than expected: a GPU may sit in another slot or socket)"
    return f"expected {_describe(e)}, found {_describe(a)}{why}"


def _nvlink_difference(e: Link, a: Link) -> str | None:
    if not (e.kind is LinkKind.NVLINK and a.kind is LinkKind.NVLINK and e.nvlinks and a.nvlinks):
        return None
    if a.nvlinks < e.nvlinks:
        k = e.nvlinks - a.nvlinks
        return f"expected NV{e.nvlinks}, found NV{a.nvlinks} ({'an NVLink is' if k == 1 else f'{k} NVLinks are'} down)"
    if a.nvlinks > e.nvlinks:
        return f"expected NV{e.nvlinks}, found NV{a.nvlinks} (more links than expected)"
    return ""


def _p2p_difference(e: Link, a: Link) -> str | None:
    if P2PStatus.UNKNOWN in (e.p2p, a.p2p):
        return None
    if e.p2p is a.p2p:
        return ""
    if a.p2p is P2PStatus.UNSUPPORTED:
        return (f"expected peer-to-peer, found it unavailable{f' ({a.p2p_reason})' if a.p2p_reason else ''}: "
                "traffic will go through host memory")
    return "expected no peer-to-peer, found it available"


def _bandwidth_difference(ratio: float, e: Link, a: Link) -> str | None:
    if e.bandwidth_gbps is None or a.bandwidth_gbps is None or a.bandwidth_source != "measured":
        return None
    if a.bandwidth_gbps >= ratio * e.bandwidth_gbps:
        return ""
    return (f"measured {a.bandwidth_gbps:.1f} GB/s, below {ratio:g} x the expected {e.bandwidth_gbps:.1f} GB/s "
            f"({e.bandwidth_source})")


def summarize_differences(differences: list[str], pairs: int | None = None, *, shown: int = 3) -> list[str]:
    """Differences for people: pair lines that say the same thing (``GPU0-GPU1: expected NV18,
    found NV12``, 28 times) become one line naming how many pairs and the first few; others stay
    as they are, in their order. ``pairs``: the machine's pair count (to say "all N pairs")."""
    groups: dict[str, list[str]] = {}
    order: list[tuple[str, str]] = []  # ("pair", what) or ("line", text)
    for d in differences:
        m = re.match(r"^(GPU\d+-GPU\d+): (.*)$", d)
        if m is None:
            order.append(("line", d))
            continue
        what = m.group(2)
        if what not in groups:
            groups[what] = []
            order.append(("pair", what))
        groups[what].append(m.group(1))
    out = []
    for kind, text in order:
        if kind == "line":
            out.append(text)
            continue
        names = groups[text]
        ends = [tuple(int(x) for x in re.findall(r"\d+", n)) for n in names]
        common = set(ends[0]).intersection(*map(set, ends[1:]))
        if len(names) <= shown + 1:
            out.extend(f"{n}: {text}" for n in names)
        elif pairs is not None and len(names) == pairs:
            out.append(f"all {pairs} GPU pairs: {text}")
        elif len(common) == 1:  # one GPU's links (a GPU with NVLinks down)
            g = common.pop()
            others = sorted(x for e in ends for x in e if x != g)
            out.append(f"GPU{g} with GPUs {format_ranges(others)} ({len(names)} pairs): {text}")
        else:
            out.append(f"{len(names)} GPU pairs ({', '.join(names[:shown])} and {len(names) - shown} more): {text}")
    return out


def junit_xml(report: CheckReport, *, suite: str = "tree-attn check") -> str:
    """JUnit XML text: one testsuite, one testcase per check, failures with their messages."""
    failures = sum(r.status == "failed" for r in report.results)
    skipped = sum(r.status == "skipped" for r in report.results)
    root = ET.Element("testsuites", name=suite, tests=str(len(report.results)), failures=str(failures))
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(report.results)),
                       failures=str(failures), errors="0", skipped=str(skipped))
    props = ET.SubElement(ts, "properties")
    ET.SubElement(props, "property", name="expected_fingerprint", value=report.expected_fingerprint)
    ET.SubElement(props, "property", name="actual_fingerprint", value=report.actual_fingerprint)
    for r in report.results:
        tc = ET.SubElement(ts, "testcase", classname="tree_attn.check", name=r.name, time="0")
        if r.status == "failed":
            f = ET.SubElement(tc, "failure", message=r.differences[0] if len(r.differences) == 1 else r.detail,
                              type="TopologyMismatch")
            f.text = "\n".join(r.differences)
        elif r.status == "skipped":
            ET.SubElement(tc, "skipped", message=r.detail)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(report: CheckReport, path: str) -> None:
    """Write :func:`junit_xml` to ``path`` atomically."""
    atomic_write_text(path, junit_xml(report))
