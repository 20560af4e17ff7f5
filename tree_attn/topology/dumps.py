"""Topologies from recorded text dumps: plan for a remote machine, reproduce a report.

Formats (auto-detected by :func:`parse_dump`):

- ``nvidia-smi topo -m`` (and ``-mp``, which shows PCIe classes only): tabs or spaces, runs of
  spaces collapsed, older ``mlx5_N`` NIC columns or ``NIC#`` columns with a NIC legend (NIC rows
  are not GPUs), empty cells, a header row without its leading tab or prefixed with ``| ``,
  a ``$ nvidia-smi topo -m`` prompt line, a legend cut short.
- ``nvidia-smi topo -p2p r|w|rw|n|a``: the peer-to-peer status matrix (OK, CNS, GNS, TNS, NS, DR, U).
- ``nvidia-smi -L`` and ``rocm-smi --showproductname``: device names (and UUIDs) only.
- ``amd-smi topology`` (ACCESS / WEIGHT / HOPS / LINK TYPE / NUMA BW tables, devices named by BDF)
  and ``amd-smi xgmi`` (the LINK METRIC table).
- ``rocm-smi --showtopo`` (weight, hops, link type matrices and NUMA nodes).

A dump usually tells only part of the story (``topo -m`` has no names and no peer-to-peer
status); :func:`load_dumps` combines several dumps of one machine. Lines starting with ``#``
(such as a ``# source:`` header) are skipped. A malformed dump raises :class:`TopologyError`
naming the line number and its content.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import TopologyError
from .bandwidth import estimate
from .model import UNKNOWN, Device, Link, LinkKind, P2PStatus, Topology


@dataclass
class _Line:
    no: int  # 1-based line number in the original text
    text: str

    def tokens(self) -> list[str]:
        t = self.text.strip()
        t = t.removeprefix("|")
        return t.split()


def _lines(text: str) -> list[_Line]:
    """Non-blank lines, without comments (``# source: ...``) and shell prompts (``$ nvidia-smi``)."""
    out = []
    for i, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if not s or s.startswith(("#", "$ ")):
            continue
        out.append(_Line(i, raw.rstrip("\n")))
    return out


def _err(line: _Line, what: str) -> TopologyError:
    return TopologyError(f"line {line.no}: {what}: {line.text.strip()!r}")


_GPU_RE = re.compile(r"^GPU(\d+)$")
_NV_RE = re.compile(r"^NV(\d+)$")
_PCIE_CELLS = {"PIX", "PXB", "PHB", "NODE", "SYS"}
_P2P_CELLS = {
    # nvidia-smi topo -p2p legend; the codes mirror NVML's nvmlGpuP2PStatus_t.
    "OK": (P2PStatus.OK, None),
    "CNS": (P2PStatus.UNSUPPORTED, "CNS: chipset not supported"),
    "GNS": (P2PStatus.UNSUPPORTED, "GNS: GPU not supported"),
    "TNS": (P2PStatus.UNSUPPORTED, "TNS: topology not supported"),
    "NS": (P2PStatus.UNSUPPORTED, "NS: not supported"),
    "DR": (P2PStatus.UNSUPPORTED, "DR: disabled by regkey"),
    "U": (P2PStatus.UNKNOWN, "U: unknown"),
}
_EXTRA_COLUMNS = {"CPU Affinity": "cpu_affinity", "NUMA Affinity": "numa_node", "GPU NUMA ID": "gpu_numa_id"}
_INFERRED_P2P = "inferred: {} pairs can use peer-to-peer over the link"


def _opt_int(s: str | None) -> int | None:
    return int(s) if s is not None and re.fullmatch(r"-?\d+", s) and int(s) >= 0 else None


def _header_columns(line: _Line) -> list[str]:
    """Column names of a ``topo -m`` header, multi-word names kept whole even when spaces collapsed."""
    t = line.text.strip().lstrip("|")
    for name in _EXTRA_COLUMNS:
        t = re.sub(r"\s+".join(map(re.escape, name.split())), name.replace(" ", "\x00"), t)
    return [c.replace("\x00", " ") for c in t.split()]


def _find_gpu_header(lines: list[_Line]) -> int:
    for i, ln in enumerate(lines):
        toks = ln.tokens()
        if toks and toks[0] == "GPU0":
            return i
    raise TopologyError("no header row starting with GPU0 was found: is this an nvidia-smi topo dump?")


def _check_gpu_columns(cols: list[str], line: _Line) -> int:
    n = 0
    while n < len(cols) and _GPU_RE.match(cols[n]):
        if cols[n] != f"GPU{n}":
            raise _err(line, f"GPU columns out of order: expected GPU{n}, found {cols[n]}")
        n += 1
    return n


def _read_matrix(
    lines: list[_Line], start: int, labels: list[str], row_labels: set[str], *, stop: Callable[[_Line], bool]
) -> tuple[dict[str, tuple[_Line, list[str]]], int]:
    """Rows after the header at ``start``: label -> (line, cells). Stops at ``stop(line)``."""
    rows: dict[str, tuple[_Line, list[str]]] = {}
    i = start + 1
    while i < len(lines) and not stop(lines[i]):
        ln = lines[i]
        toks = ln.tokens()
        label = toks[0]
        if label not in row_labels:
            raise _err(ln, f"unexpected row {label!r}; expected one of the header's devices")
        if label in rows:
            raise _err(ln, f"row {label} appears twice")
        if len(toks) - 1 < len(labels):
            raise _err(ln, f"row {label} has {len(toks) - 1} cells, expected {len(labels)} (truncated or not square)")
        rows[label] = (ln, toks[1:])
        i += 1
    return rows, i


# -- nvidia-smi topo -m ---------------------------------------------------------------------------

def parse_nvidia_topo_m(text: str) -> Topology:
    """``nvidia-smi topo -m`` (or ``-mp``) -> Topology of the GPUs (NICs are left out)."""
    lines = _lines(text)
    h = _find_gpu_header(lines)
    header = lines[h]
    cols = _header_columns(header)
    n = _check_gpu_columns(cols, header)
    dev_cols = [c for c in cols if c not in _EXTRA_COLUMNS]
    extra_cols = [c for c in cols if c in _EXTRA_COLUMNS]
    if cols[: len(dev_cols)] != dev_cols:
        raise _err(header, "device columns must come before CPU Affinity / NUMA Affinity / GPU NUMA ID")
    nics = dev_cols[n:]
    rows, end = _read_matrix(
        lines, h, dev_cols, set(dev_cols),
        stop=lambda ln: ln.text.strip().rstrip(":").endswith("Legend") or ln.text.strip().startswith("NIC Legend"),
    )
    last = lines[end - 1] if end - 1 > h else header
    missing = [f"GPU{i}" for i in range(n) if f"GPU{i}" not in rows]
    if missing:
        raise _err(last, f"the matrix ends before the row(s) of {', '.join(missing)} (truncated dump); last line read")

    cell: dict[tuple[int, int], tuple[str, _Line]] = {}
    devices = []
    for i in range(n):
        ln, toks = rows[f"GPU{i}"]
        for j, c in enumerate(toks[: len(dev_cols)]):
            ok = c == "X" or c in _PCIE_CELLS or _NV_RE.match(c)
            if not ok:
                raise _err(ln, f"unknown link class {c!r} in row GPU{i}, column {dev_cols[j]}")
            if j < n:
                if (c == "X") != (i == j):
                    raise _err(ln,
                               f"row GPU{i}, column GPU{j}: 'X' must be on the diagonal and only there, found {c!r}")
                cell[(i, j)] = (c, ln)
        extra = toks[len(dev_cols):]
        if len(extra) > len(extra_cols):
            raise _err(ln, f"row GPU{i} has {len(dev_cols) + len(extra)} cells, "
                           f"more than the {len(cols)} columns of the header (not square)")
        facts = {_EXTRA_COLUMNS[name]: val for name, val in zip(extra_cols, extra)}
        cpu = facts.get("cpu_affinity")
        devices.append(
            Device(
                index=i,
                vendor="nvidia",
                cpu_affinity=cpu if cpu and cpu != "N/A" else None,
                numa_node=_opt_int(facts.get("numa_node")),
                gpu_numa_id=_opt_int(facts.get("gpu_numa_id")),
            )
        )
    # NIC rows must be complete too (a cut row is a sign of a damaged dump), but are not GPUs.
    for nic in nics:
        if nic in rows:
            ln, toks = rows[nic]
            for c in toks[: len(dev_cols)]:
                if not (c == "X" or c in _PCIE_CELLS or _NV_RE.match(c)):
                    raise _err(ln, f"unknown link class {c!r} in row {nic}")

    links = []
    for a in range(n):
        for b in range(a + 1, n):
            c, ln_a = cell[(a, b)]
            c2, ln_b = cell[(b, a)]
            if c != c2:
                raise _err(ln_b, f"GPU{b}-GPU{a} is {c2} but GPU{a}-GPU{b} is {c} (line {ln_a.no}): "
                                 "the matrix is not symmetric")
            links.append(_nv_link(a, b, c, devices))
    notes = [TOPO_M_GAPS]
    if nics:
        notes.append(f"{len(nics)} NIC(s) in the dump ({', '.join(nics)}) are not GPUs and are left out")
    if _is_topo_mp(text, lines, [c for c, _ in cell.values()]):
        notes.append("this is the `nvidia-smi topo -mp` form (its legend has no NV# entry): PCIe paths only, so "
                     "NVLinks, if the GPUs have any, are not shown; record `nvidia-smi topo -m` to plan over them")
    return Topology(devices=devices, links=links, source="dump:nvidia-smi-topo-m", notes=notes)


def _is_topo_mp(text: str, lines: list[_Line], cells: list[str]) -> bool:
    """Whether a PCIe matrix is ``nvidia-smi topo -mp`` rather than ``-m``: a prompt line says so,
    or the legend is there (through its PIX entry) without the NV# entry ``-m`` always prints
    and no cell is an NVLink (a ``-m`` legend cut short still shows its NV# cells)."""
    if re.search(r"^\s*\$\s*nvidia-smi\s+topo\s+-mp\b", text, re.MULTILINE):
        return True
    if any(_NV_RE.match(c) for c in cells):
        return False
    body = [ln.text.strip() for ln in lines]
    has_legend = any(t.rstrip(":").endswith("Legend") for t in body)
    return (has_legend and any(t.startswith("PIX") and "=" in t for t in body)
            and not any(t.startswith("NV#") for t in body))


def _nv_link(a: int, b: int, c: str, devices: list[Device]) -> Link:
    m = _NV_RE.match(c)
    if m:
        count = int(m.group(1))
        if count < 1:
            raise TopologyError(f"GPU{a}-GPU{b}: NV{count} is not a valid NVLink count")
        bw = estimate(LinkKind.NVLINK, devices[a], devices[b], nvlinks=count)
        return Link(a, b, LinkKind.NVLINK, nvlinks=count, p2p=P2PStatus.OK,
                    p2p_reason=_INFERRED_P2P.format("NVLink"), bandwidth_gbps=bw,
                    bandwidth_source="estimated" if bw is not None else "unknown")
    kind = LinkKind.parse(c)
    bw = estimate(kind, devices[a], devices[b])
    return Link(a, b, kind, bandwidth_gbps=bw, bandwidth_source="estimated" if bw is not None else "unknown")


# -- nvidia-smi topo -p2p -------------------------------------------------------------------------

def parse_nvidia_topo_p2p(text: str) -> Topology:
    """``nvidia-smi topo -p2p <caps>`` -> Topology with peer-to-peer status and unknown link classes."""
    lines = _lines(text)
    h = _find_gpu_header(lines)
    header = lines[h]
    cols = header.tokens()
    n = _check_gpu_columns(cols, header)
    if n != len(cols):
        raise _err(header, "a topo -p2p header lists only GPU columns")
    rows, end = _read_matrix(lines, h, cols, set(cols), stop=lambda ln: ln.text.strip().startswith("Legend"))
    missing = [c for c in cols if c not in rows]
    if missing:
        raise _err(lines[end - 1], f"the matrix ends before the row(s) of {', '.join(missing)} (truncated dump); "
                                   "last line read")
    status: dict[tuple[int, int], tuple[P2PStatus, str | None]] = {}
    for i in range(n):
        ln, toks = rows[f"GPU{i}"]
        if len(toks) != n:
            raise _err(ln, f"row GPU{i} has {len(toks)} cells, expected {n} (not square)")
        for j, c in enumerate(toks):
            if i == j:
                if c != "X":
                    raise _err(ln, f"row GPU{i}: expected X on the diagonal, found {c!r}")
                continue
            if c not in _P2P_CELLS:
                raise _err(ln, f"unknown peer-to-peer status {c!r} in row GPU{i}, column GPU{j}; "
                               f"expected one of {', '.join(_P2P_CELLS)}")
            status[(i, j)] = _P2P_CELLS[c]
    links = []
    for a in range(n):
        for b in range(a + 1, n):
            s1, s2 = status[(a, b)], status[(b, a)]
            # Peer access must work both ways for a collective; report the worse direction.
            worst = s1 if s1[0] is not P2PStatus.OK else s2
            links.append(Link(a, b, LinkKind.UNKNOWN, p2p=worst[0], p2p_reason=worst[1]))
    devices = [Device(index=i, vendor="nvidia") for i in range(n)]
    return Topology(devices=devices, links=links, source="dump:nvidia-smi-topo-p2p",
                    notes=[("nvidia-smi topo -p2p gives peer-to-peer status only, no link classes "
                            "(add the output of `nvidia-smi topo -m` to --from)")])


# -- device listings: nvidia-smi -L, rocm-smi --showproductname ----------------------------------

_NV_LIST_RE = re.compile(r"^GPU (\d+): (.+?)(?: \(UUID: ([^)]+)\))?$")
_ROCM_FIELD_RE = re.compile(r"^GPU\[(\d+)\]\s*:\s*([^:]+?)\s*:\s*(.*?)\s*$")


def parse_device_list(text: str) -> Topology:
    """``nvidia-smi -L`` or ``rocm-smi --showproductname`` -> devices with names, links unknown."""
    lines = _lines(text)
    found: dict[int, dict] = {}
    vendor = "nvidia"
    for ln in lines:
        s = ln.text.strip()
        m = _NV_LIST_RE.match(s)
        if m and s.startswith("GPU "):
            found.setdefault(int(m.group(1)), {})
            found[int(m.group(1))].update(name=m.group(2).strip(), uuid=m.group(3))
            continue
        m = _ROCM_FIELD_RE.match(s)
        if m:
            vendor = "amd"
            key, val = m.group(2).lower(), m.group(3)
            d = found.setdefault(int(m.group(1)), {})
            if key in ("card series", "device name", "card model name") and val and "name" not in d:
                d["name"] = val
            elif key == "gfx version" and val:
                d["arch"] = val
            continue
        if s.startswith(("MIG ", "=", "Card")):
            continue  # MIG instance lines of nvidia-smi -L; rocm-smi banners
    if not found:
        raise TopologyError("no device lines found "
                            "(expected 'GPU 0: <name> (UUID: ...)' or 'GPU[0] : Card Series: <name>')")
    n = max(found) + 1
    if sorted(found) != list(range(n)):
        raise TopologyError(f"device list skips indices: found GPUs {sorted(found)}")
    devices = [Device(index=i, vendor=vendor, name=found[i].get("name") or UNKNOWN, uuid=found[i].get("uuid"),
                      arch=found[i].get("arch")) for i in range(n)]
    links = [Link(a, b, LinkKind.UNKNOWN) for a in range(n) for b in range(a + 1, n)]
    return Topology(devices=devices, links=links, source="dump:device-list")


# -- amd-smi topology / rocm-smi --showtopo ------------------------------------------------------

_AMD_SECTIONS = ("ACCESS", "WEIGHT", "HOPS", "LINK TYPE", "NUMA BW")
_ROCM_TITLES = {
    "weight between two gpus": "WEIGHT",
    "hops between two gpus": "HOPS",
    "link type between two gpus": "LINK TYPE",
    "numa nodes": "NUMA",
}


def _amd_tables(lines: list[_Line], headers: dict[int, str]) -> tuple[list[str], dict[str, dict]]:
    """Read the square tables that follow each section header line index -> section name."""
    labels: list[str] | None = None
    tables: dict[str, dict] = {}
    for start, name in sorted(headers.items()):
        if name == "NUMA":
            continue
        hdr = lines[start + 1] if start + 1 < len(lines) else None
        if hdr is None:
            raise _err(lines[start], f"{name} table has no header row (truncated dump)")
        cols = hdr.tokens()
        if labels is None:
            labels = cols
        elif cols != labels:
            raise _err(hdr, f"{name} table lists other devices than the first table ({' '.join(labels)})")
        rows, _ = _read_matrix(lines, start + 1, cols, set(cols),
                               stop=lambda ln: bool(_section_name(ln)))
        missing = [c for c in cols if c not in rows]
        if missing:
            last = max((ln for ln, _ in rows.values()), key=lambda l: l.no, default=hdr)
            raise _err(last, f"{name} table ends before the row(s) of {', '.join(missing)} (truncated dump); "
                             "last line read")
        for label, (ln, toks) in rows.items():
            if len(toks) != len(cols):
                raise _err(ln, f"row {label} of the {name} table has {len(toks)} cells, "
                               f"expected {len(cols)} (not square)")
        tables[name] = {label: (ln, toks) for label, (ln, toks) in rows.items()}
    if labels is None:
        raise TopologyError("no topology tables found")
    return labels, tables


def _section_name(ln: _Line) -> str | None:
    s = ln.text.strip()
    m = re.fullmatch(r"([A-Z ]+) TABLE:", s)
    if m and m.group(1) in _AMD_SECTIONS:
        return m.group(1)
    m = re.fullmatch(r"=+\s*(.*?)\s*=+", s)
    if m:
        return _ROCM_TITLES.get(m.group(1).lower(), "OTHER")
    return None


def _amd_links(labels: list[str], tables: dict[str, dict], devices: list[Device]) -> list[Link]:
    n = len(labels)
    links = []
    for a in range(n):
        for b in range(a + 1, n):
            la, lb = labels[a], labels[b]

            def cell(name: str, r: str = la, c: int = b) -> tuple[_Line, str] | None:
                t = tables.get(name)
                if t is None:
                    return None
                ln, toks = t[r]
                return ln, toks[c]

            kind = LinkKind.UNKNOWN
            lt = cell("LINK TYPE")
            if lt is not None:
                ln, v = lt
                ln2, v2 = cell("LINK TYPE", lb, a)
                for line, val, x, y in ((ln, v, la, lb), (ln2, v2, lb, la)):
                    if val.upper() not in ("XGMI", "PCIE", "PCIEXPRESS", "N/A", "UNKNOWN"):
                        raise _err(line, f"unknown link type {val!r} between {x} and {y}; expected XGMI or PCIE")
                if v2.upper() != v.upper():
                    raise _err(ln2, f"link type {lb}-{la} is {v2!r} but {la}-{lb} is {v!r} (line {ln.no}): "
                                    "not symmetric")
                v = v.upper()
                if v == "XGMI":
                    kind = LinkKind.XGMI
                elif v in ("PCIE", "PCIEXPRESS"):
                    kind = amd_pcie_kind(devices[a], devices[b])
            p2p, reason = ((P2PStatus.OK, _INFERRED_P2P.format("xGMI")) if kind is LinkKind.XGMI
                           else (P2PStatus.UNKNOWN, None))
            acc = cell("ACCESS")
            if acc is not None:
                ln, v = acc
                if v.upper() == "ENABLED":
                    p2p, reason = P2PStatus.OK, None
                elif v.upper() == "DISABLED":
                    p2p, reason = P2PStatus.UNSUPPORTED, "amd-smi: P2P access disabled"
                else:
                    raise _err(ln, f"unknown ACCESS value {v!r}; expected ENABLED or DISABLED")
            hops = _int_cell(cell("HOPS"), "HOPS")
            weight = _int_cell(cell("WEIGHT"), "WEIGHT")
            bw, src = estimate(kind, devices[a], devices[b]), "estimated"
            nb = cell("NUMA BW")
            if nb is not None and nb[1].upper() != "N/A":
                m = re.fullmatch(r"(\d+)-(\d+)", nb[1])
                if not m:
                    raise _err(nb[0], f"bad NUMA BW cell {nb[1]!r}; expected MIN-MAX in MB/s")
                bw, src = int(m.group(2)) / 1000.0, "reported"  # MB/s -> GB/s
            links.append(Link(a, b, kind, p2p=p2p, p2p_reason=reason, hops=hops, weight=weight,
                              bandwidth_gbps=bw, bandwidth_source=src if bw is not None else "unknown"))
    return links


def amd_pcie_kind(a: Device, b: Device) -> LinkKind:
    """AMD tools say only "PCIE": within one NUMA node the most conservative PCIe class is NODE,
    across nodes SYS; unknown placement stays unknown rather than guessed."""
    if a.numa_node is None or b.numa_node is None:
        return LinkKind.UNKNOWN
    return LinkKind.NODE if a.numa_node == b.numa_node else LinkKind.SYS


def _int_cell(c: tuple[_Line, str] | None, name: str) -> int | None:
    if c is None:
        return None
    ln, v = c
    if v.upper() == "N/A":
        return None
    if not re.fullmatch(r"\d+", v):
        raise _err(ln, f"bad {name} value {v!r}; expected an integer")
    return int(v)


def parse_amd_smi_topology(text: str) -> Topology:
    """``amd-smi topology`` -> Topology (devices named by PCI BDF, in header order)."""
    lines = _lines(text)
    headers = {i: _section_name(ln) for i, ln in enumerate(lines) if _section_name(ln)}
    headers = {i: s for i, s in headers.items() if s in _AMD_SECTIONS and lines[i].text.strip().endswith("TABLE:")}
    labels, tables = _amd_tables(lines, headers)
    devices = [Device(index=i, vendor="amd", pci_bus_id=lab.lower() if ":" in lab else None)
               for i, lab in enumerate(labels)]
    links = _amd_links(labels, tables, devices)
    return Topology(devices=devices, links=links, source="dump:amd-smi-topology",
                    notes=["amd-smi topology gives no device names and no NUMA nodes"])


def parse_rocm_smi_showtopo(text: str) -> Topology:
    """``rocm-smi --showtopo`` -> Topology (weights, hops, link types, NUMA nodes)."""
    lines = _lines(text)
    headers = {i: _section_name(ln) for i, ln in enumerate(lines) if _section_name(ln)}
    headers = {i: s for i, s in headers.items() if s in ("WEIGHT", "HOPS", "LINK TYPE", "NUMA")}
    numa: dict[int, int] = {}
    for ln in lines:
        m = re.match(r"^GPU\[(\d+)\]\s*:\s*\(Topology\)\s*Numa Node:\s*(-?\d+)", ln.text.strip())
        if m:
            numa[int(m.group(1))] = int(m.group(2))
    # Diagonal cells of the link type matrix are "0"; treat them as self.
    labels, tables = _amd_tables(lines, headers)
    for i, lab in enumerate(labels):
        if lab != f"GPU{i}":
            raise TopologyError(f"rocm-smi --showtopo: expected column GPU{i}, found {lab!r}")
    devices = [Device(index=i, vendor="amd", numa_node=numa.get(i) if numa.get(i, -1) >= 0 else None)
               for i in range(len(labels))]
    links = _amd_links(labels, tables, devices)
    return Topology(devices=devices, links=links, source="dump:rocm-smi-showtopo",
                    notes=["rocm-smi --showtopo gives no device names and no peer-to-peer status"])


_XGMI_ROW_RE = re.compile(
    r"^GPU(\d+)\s+(\S+)\s+(N/A|\d+(?:\.\d+)?\s*Gb/s)\s+(N/A|\d+(?:\.\d+)?\s*Gb/s)\s+(\S+)"
)


def parse_amd_smi_xgmi(text: str) -> Topology:
    """``amd-smi xgmi`` LINK METRIC table -> Topology: per-GPU link type and rate; the Read/Write
    rows are traffic counters and are not part of the topology."""
    lines = _lines(text)
    start = next((i for i, ln in enumerate(lines) if ln.text.strip().startswith("LINK METRIC TABLE")), None)
    if start is None or start + 1 >= len(lines):
        raise TopologyError("no LINK METRIC TABLE with a header row found")
    hdr = lines[start + 1]
    toks = hdr.tokens()
    if toks[:4] != ["bdf", "bit_rate", "max_bandwidth", "link_type"]:
        raise _err(hdr, "expected the header 'bdf bit_rate max_bandwidth link_type <BDF>...'")
    bdfs = toks[4:]
    gpus: dict[int, tuple[str, float | None, str]] = {}
    for ln in lines[start + 2:]:
        s = ln.text.strip()
        if s.startswith(("Read", "Write")):
            cells = s.split()
            if len(cells) < 1 + len(bdfs):
                raise _err(ln, f"traffic row has fewer cells than the {len(bdfs)} devices (truncated)")
            continue
        m = _XGMI_ROW_RE.match(s)
        if not m:
            raise _err(ln, "expected a row 'GPU<n> <BDF> <bit_rate> <max_bandwidth> <link_type>'")
        i = int(m.group(1))
        maxbw = None if m.group(4) == "N/A" else float(m.group(4).split()[0].replace("Gb/s", "")) / 8.0
        gpus[i] = (m.group(2).lower(), maxbw, m.group(5).upper())
    n = len(bdfs)
    if sorted(gpus) != list(range(n)):
        raise TopologyError(f"amd-smi xgmi: expected rows GPU0..GPU{n - 1} for the {n} header devices, "
                            f"found {sorted(gpus)} (truncated?)")
    devices = [Device(index=i, vendor="amd", pci_bus_id=gpus[i][0]) for i in range(n)]
    links = []
    for a in range(n):
        for b in range(a + 1, n):
            if gpus[a][2] == "XGMI" and gpus[b][2] == "XGMI":
                rates = [r for r in (gpus[a][1], gpus[b][1]) if r is not None]
                bw = min(rates) if rates else estimate(LinkKind.XGMI, devices[a], devices[b])
                links.append(Link(a, b, LinkKind.XGMI, p2p=P2PStatus.OK, p2p_reason=_INFERRED_P2P.format("xGMI"),
                                  bandwidth_gbps=bw, bandwidth_source="reported" if rates else "estimated"))
            else:
                links.append(Link(a, b, LinkKind.UNKNOWN))
    return Topology(devices=devices, links=links, source="dump:amd-smi-xgmi",
                    notes=[("amd-smi xgmi gives the link type and rate per GPU; pairs of xGMI GPUs are taken as "
                            "one hive (the MI300X platform connects every GPU to every other)")])


# -- detection -----------------------------------------------------------------------------------

FORMATS: dict[str, Callable[[str], Topology]] = {
    "nvidia-smi-topo-m": parse_nvidia_topo_m,
    "nvidia-smi-topo-p2p": parse_nvidia_topo_p2p,
    "device-list": parse_device_list,
    "amd-smi-topology": parse_amd_smi_topology,
    "amd-smi-xgmi": parse_amd_smi_xgmi,
    "rocm-smi-showtopo": parse_rocm_smi_showtopo,
}

# The command whose output each format is (for messages).
FORMAT_COMMANDS: dict[str, str] = {
    "nvidia-smi-topo-m": "nvidia-smi topo -m",
    "nvidia-smi-topo-p2p": "nvidia-smi topo -p2p",
    "device-list": "nvidia-smi -L",
    "amd-smi-topology": "amd-smi topology",
    "amd-smi-xgmi": "amd-smi xgmi",
    "rocm-smi-showtopo": "rocm-smi --showtopo",
}


def detect_format(text: str) -> str:
    """Name of the dump format (a key of :data:`FORMATS`)."""
    lines = _lines(text)
    body = "\n".join(ln.text for ln in lines)
    if "LINK METRIC TABLE" in body:
        return "amd-smi-xgmi"
    if any(re.fullmatch(r"(ACCESS|WEIGHT|HOPS|LINK TYPE|NUMA BW) TABLE:", ln.text.strip()) for ln in lines):
        return "amd-smi-topology"
    if re.search(r"between two GPUs|\(Topology\) Numa Node", body):
        return "rocm-smi-showtopo"
    if (re.search(r"^\s*GPU \d+: .+", body, re.MULTILINE)
            or re.search(r"^\s*GPU\[\d+\]\s*:\s*(Card Series|Device Name)", body, re.MULTILINE)):
        return "device-list"
    try:
        h = _find_gpu_header(lines)
    except TopologyError:
        raise TopologyError(
            "unrecognised topology dump: expected the output of `nvidia-smi topo -m`, `nvidia-smi topo -p2p rw`, "
            "`nvidia-smi -L`, `amd-smi topology`, `amd-smi xgmi`, `rocm-smi --showtopo` or `rocm-smi --showproductname`"
        ) from None
    # A p2p matrix holds status codes (OK, GNS, ...) where topo -m holds classes (NV#, SYS, ...);
    # its legend, when present, defines "OK = Status Ok".
    cells = {c for ln in lines[h + 1:] if _GPU_RE.match((ln.tokens() or [""])[0]) for c in ln.tokens()[1:]}
    if cells & set(_P2P_CELLS) or re.search(r"^\s*OK\s+=\s+Status Ok", body, re.MULTILINE):
        return "nvidia-smi-topo-p2p"
    return "nvidia-smi-topo-m"


def parse_dump(text: str, fmt: str | None = None) -> Topology:
    """Parse a dump's text (format auto-detected unless ``fmt`` names one of :data:`FORMATS`)."""
    fmt = fmt or detect_format(text)
    if fmt not in FORMATS:
        raise TopologyError(f"unknown dump format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt](text)


def load_dump(path: str | os.PathLike) -> Topology:
    """Read and parse one dump file; errors name the file and the line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as exc:
        raise TopologyError(f"cannot read topology dump {os.fspath(path)!r}: {exc.strerror or exc}") from None
    saved = _saved_topology(text, os.fspath(path))
    if saved is not None:
        return saved
    try:
        return parse_dump(text)
    except TopologyError as exc:
        raise TopologyError(f"{os.fspath(path)}: {exc}") from None


def _saved_topology(text: str, where: str) -> Topology | None:
    """A topology saved by ``tree-attn probe --output`` (or a YAML with a ``topology`` section),
    accepted wherever a dump is, so that a machine probed elsewhere can be checked or combined."""
    if not re.search(r"^(schema_version|topology):", text, re.MULTILINE):
        return None
    import yaml

    from ..files import load_yaml, yaml_problem
    from .io import topology_from_obj

    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{where}: not valid YAML ({yaml_problem(exc)})") from None
    return topology_from_obj(data, where=where)


TOPO_M_GAPS = ("nvidia-smi topo -m gives no device names and no peer-to-peer status for PCIe pairs "
               "(add the output of `nvidia-smi -L` and `nvidia-smi topo -p2p rw` to --from to fill them in)")


def _topo_m_gaps_left(topo: Topology) -> str | None:
    """The topo -m note for what is still missing once other dumps filled in names or P2P."""
    names = any(d.name in (None, UNKNOWN) for d in topo.devices)
    p2p = any(l.p2p is P2PStatus.UNKNOWN for l in topo.links)
    if names and p2p:
        return TOPO_M_GAPS
    if names:
        return "nvidia-smi topo -m gives no device names (add the output of `nvidia-smi -L` to --from to fill them in)"
    if p2p:
        return ("nvidia-smi topo -m gives no peer-to-peer status for PCIe pairs (add the output of "
                "`nvidia-smi topo -p2p rw` to --from to fill it in)")
    return None


def load_dumps(paths: Iterable[str | os.PathLike]) -> Topology:
    """Parse several dumps of one machine and combine them: the first dump that gives link
    classes is the base; the others fill in what it does not say (names, peer-to-peer status)."""
    topos = [load_dump(p) for p in paths]
    if not topos:
        raise TopologyError("no dump given")
    # Put a dump with link classes first so that its classes and source lead.
    topos.sort(key=lambda t: all(l.kind is LinkKind.UNKNOWN for l in t.links))
    out = topos[0]
    for t in topos[1:]:
        out = out.completed_with(t)
    if len(topos) > 1 and TOPO_M_GAPS in out.notes:  # say only what the other dumps left missing
        left = _topo_m_gaps_left(out)
        notes = [left if n == TOPO_M_GAPS else n for n in out.notes]
        out = out.replace(notes=[n for n in notes if n])
    return out
