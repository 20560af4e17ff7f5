"""``tree-attn probe``: discover the GPU fabric (or read a recorded dump), print it, save it."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .common import err_console, notice, out_console, print_json, warn

# Colours by link class, fastest (green) to slowest (red), like a heat map of the fabric.
KIND_STYLE = {
    "nvlink": "bold green", "xgmi": "bold green", "pix": "cyan", "pxb": "cyan", "phb": "yellow",
    "node": "magenta", "sys": "red", "unknown": "dim", "net": "bold red",
}


def register(app: typer.Typer) -> None:
    app.command("probe", help="Discover the GPU fabric (NVLink, PCIe, xGMI) and print its matrix and hierarchy.")(probe_command)


def probe_command(
    from_: Optional[list[Path]] = typer.Option(
        None, "--from", help="Build from recorded dump(s) instead of this machine: nvidia-smi topo -m / -p2p, "
        "nvidia-smi -L, amd-smi topology / xgmi, rocm-smi --showtopo. Repeat to combine dumps of one machine."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the topology as YAML (atomically)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    measure: bool = typer.Option(False, "--measure", help="Measure per-pair bandwidth and latency and the decode all-reduce."),
    backend: str = typer.Option("auto", "--backend", help="auto, nvml, amdsmi or host (CPU ranks)."),
    cpu_ranks: Optional[int] = typer.Option(None, "--cpu-ranks", help="Number of CPU ranks of the host fallback."),
    iterations: int = typer.Option(20, "--iterations", help="Timed iterations per measurement (median reported)."),
) -> None:
    from ..errors import TopologyError
    from ..topology import load_dumps, probe_topology, save_topology, topology_warnings

    if from_:
        if measure:
            raise TopologyError("--measure needs the machine itself: it cannot measure a recorded dump")
        topo = load_dumps(from_)
    else:
        topo = probe_topology(backend, cpu_ranks=cpu_ranks)
    if measure:
        from ..topology.measure import measure_topology

        err_console.print(f"measuring {len(topo)} device(s) ({len(topo.links)} pairs, {iterations} iterations)...")
        topo = measure_topology(topo, iterations=iterations)
    for n in topo.notes:
        notice(n)
    for w in topology_warnings(topo):
        warn(w)
    if output is not None:
        save_topology(topo, output)
        notice(f"wrote {output} (fingerprint {topo.fingerprint})")
    if json_out:
        print_json(topo.to_dict())
    else:
        render_topology(topo)


def render_topology(topo) -> None:
    """The nvidia-smi-like matrix coloured by class, the devices, the hierarchy."""
    from ..topology import format_ranges

    n = len(topo)
    gpu = any(d.vendor != "cpu" for d in topo.devices)
    prefix = "GPU" if gpu else "rank"
    out_console.print(f"[bold]{n} {'GPU' if gpu else 'CPU rank'}{'s' if n != 1 else ''}[/bold] "
                      f"from {topo.source}, fingerprint {topo.fingerprint}")
    t = Table(show_edge=False, box=None, pad_edge=False, header_style="bold")
    t.add_column("")
    for i in range(n):
        t.add_column(f"{prefix}{i}", justify="center")
    t.add_column("CPU Affinity")
    t.add_column("NUMA")
    for i, d in enumerate(topo.devices):
        cells = []
        for j in range(n):
            if i == j:
                cells.append(" X ")
                continue
            l = topo.link(i, j)
            cells.append(f"[{KIND_STYLE.get(l.kind.value, '')}]{l.label}[/]")
        t.add_row(f"{prefix}{i}", *cells, d.cpu_affinity or "", "" if d.numa_node is None else str(d.numa_node))
    out_console.print(t)
    out_console.print()
    for d in topo.devices:
        facts = [d.name]
        if d.pci_bus_id:
            facts.append(d.pci_bus_id)
        if d.memory_bytes:
            facts.append(f"{d.memory_bytes / 2**30:.0f} GiB")
        if d.pcie_gen and d.pcie_width:
            facts.append(f"PCIe {d.pcie_gen}.0 x{d.pcie_width}")
        out_console.print(f"  {prefix}{d.index}: " + ", ".join(facts))
    out_console.print()
    out_console.print("[bold]hierarchy[/bold] (fastest first):")
    for k, lv in enumerate(topo.hierarchy, 1):
        groups = "  ".join(f"[{format_ranges(g)}]" for g in lv.groups)
        out_console.print(f"  {k}. [{KIND_STYLE.get(lv.kind, '')}]{lv.kind}[/]: {groups}")
    bws = [l for l in topo.links if l.bandwidth_gbps is not None]
    if bws:
        lo = min(bws, key=lambda l: l.bandwidth_gbps)
        hi = max(bws, key=lambda l: l.bandwidth_gbps)
        src = "/".join(sorted({l.bandwidth_source for l in bws}))
        text = f"\nbandwidth ({src}, one direction): {lo.bandwidth_gbps:.1f} GB/s ({prefix}{lo.a}-{prefix}{lo.b})"
        if hi is not lo and hi.bandwidth_gbps != lo.bandwidth_gbps:
            text += f" to {hi.bandwidth_gbps:.1f} GB/s ({prefix}{hi.a}-{prefix}{hi.b})"
        out_console.print(text)
    if topo.measurement and topo.measurement.allreduce_latency_us is not None:
        m = topo.measurement
        out_console.print(f"all-reduce of {m.allreduce_bytes} B (decode message): {m.allreduce_latency_us:.1f} us "
                          f"median over {m.iterations} iterations ({m.method}, {m.device})")
    out_console.print("\nlegend: " + "  ".join(f"[{s}]{k.upper() if k not in ('nvlink',) else 'NV#'}[/]"
                                                for k, s in KIND_STYLE.items() if k not in ("xgmi", "net")))
