"""``tree-attn probe``: discover the GPU fabric (or read a recorded dump), print it, save it."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from ..topology.measure import MEASURE_ITERATIONS
from .common import (
    check_output,
    check_plot,
    err_console,
    line,
    notice,
    out_console,
    print_json,
    print_table,
    report,
    styled,
    warn,
)
from .options import CPU_RANKS_HELP, Iterations

# Colours by link class, fastest (green) to slowest (red), like a heat map of the fabric.
KIND_STYLE = {
    "nvlink": "bold green", "xgmi": "bold green", "pix": "cyan", "pxb": "cyan", "phb": "yellow",
    "node": "magenta", "sys": "red", "unknown": "dim", "net": "bold red",
}


HELP = "Discover the GPU fabric (NVLink, PCIe, xGMI) and print its matrix and hierarchy."


def probe_command(
    from_: list[Path] | None = typer.Option(
        None, "--from", metavar="DUMP", help="Build from recorded dump(s) instead of this machine: nvidia-smi topo "
        "-m / -p2p, nvidia-smi -L, amd-smi topology / xgmi, rocm-smi --showtopo / --showproductname. Repeat to "
        "combine dumps of one machine."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the topology as YAML (atomically); "
                                                                    "an existing file is refused unless --force."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing --output file."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    measure: bool = typer.Option(False, "--measure", help=(
        "Measure per-pair bandwidth and latency and the decode all-reduce. Under torchrun (one probe per node) "
        "every pair of the job's ranks is measured across the nodes, and the hierarchy follows the measured costs "
        "where they disagree with the node layout (--json: hierarchy_source).")),
    backend: str = typer.Option("auto", "--backend", help="auto, nvml, amdsmi or host (CPU ranks)."),
    cpu_ranks: int | None = typer.Option(None, "--cpu-ranks", help=CPU_RANKS_HELP),
    iterations: Iterations = MEASURE_ITERATIONS,
    plot: str | None = typer.Option(None, "--plot", help=(
        "Draw the topology to FILE.png: devices as nodes, links coloured by class, islands grouped "
        "(needs matplotlib).")),
) -> None:
    from ..errors import TopologyError
    from ..topology import load_dumps, probe_topology, save_topology, topology_warnings
    from ..validate import check_int

    if measure:
        check_int(iterations, "--iterations", minimum=1, must=True)
    if cpu_ranks is not None:  # before a topology of that many ranks is built
        from ..launch.env import check_cpu_ranks

        check_cpu_ranks(cpu_ranks, "--cpu-ranks")
    if output is not None:  # before probing or measuring, not after
        check_output(output, "--output")
        if output.exists() and not force:
            raise TopologyError(f"{output} already exists; pass --force to overwrite it "
                                "(or write elsewhere with --output FILE)")
    check_plot(plot)
    import os

    torchrun = measure and not from_ and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if from_:
        if measure:
            raise TopologyError("--measure needs the machine itself: it cannot measure a recorded dump")
        topo = load_dumps(from_)
    elif torchrun:
        topo = _torchrun_topology(backend)
    else:
        topo = probe_topology(backend, cpu_ranks=cpu_ranks)
    if measure:
        from ..topology.measure import measure_topology

        if not torchrun or os.environ.get("RANK") == "0":
            err_console.print(f"measuring {len(topo)} device(s) ({len(topo.links)} pairs, {iterations} iterations)...",
                              markup=False)
        topo = measure_topology(topo, iterations=iterations, join_torchrun=torchrun)
        if topo is None:  # another rank of the torchrun job: rank 0 reports
            return
        if torchrun:
            from ..topology.islands import with_measured_hierarchy

            topo = with_measured_hierarchy(topo, topo.measurement.copy_bytes)
            notice(f"hierarchy from {topo.hierarchy_source}: "
                   + ("the measured pair costs disagree with the node layout; plans follow the measurement"
                      if topo.hierarchy_source == "measured" else "the measured pair costs agree with the node layout"))
    for n in topo.notes:
        notice(n)
    for w in topology_warnings(topo):
        warn(w)
    if output is not None:
        save_topology(topo, output, force=force)
        notice(f"wrote {output} (fingerprint {topo.fingerprint})")
    from ..plots import plot_topology

    if json_out:  # which source the hierarchy (and so the plans) came from, always said here
        print_json({**topo.to_dict(), "hierarchy_source": topo.hierarchy_source})
        if plot:
            plot_topology(topo, plot)
            notice(f"wrote {plot}")
        return
    report(topo, render_topology, json_out, plot, plot_topology)


def _torchrun_topology(backend: str):
    """The topology of the torchrun job this process is a rank of, from its node layout (each
    node's devices, the network between nodes), to be measured pair by pair."""
    from ..launch.env import torchrun_env, torchrun_layout
    from ..launch.plans import layout_topology

    device_kind = "cpu" if backend in ("host", "auto") and not _gpus() else "cuda"
    env = torchrun_env(device_kind)
    return layout_topology(torchrun_layout(env), device_kind)


def _gpus() -> bool:
    from ..launch.env import gpu_count

    return gpu_count() > 0


def kind_style(kind: str) -> str:
    """The colour of a link class or hierarchy level kind; plain ("") for one without a colour
    (the single level of a one-device machine is of kind ``self``)."""
    return KIND_STYLE.get(kind, "")


def render_topology(topo) -> None:
    """The nvidia-smi-like matrix coloured by class, the devices, the hierarchy.

    Every cell and line is a Text (see cli/common.py): names, paths and labels are never markup.
    """
    from ..topology import format_ranges

    n = len(topo)
    gpu = any(d.vendor != "cpu" for d in topo.devices)
    prefix = "GPU" if gpu else "rank"
    out_console.print(line((f"{n} {'GPU' if gpu else 'CPU rank'}{'s' if n != 1 else ''}", "bold"),
                           f" from {topo.source}, fingerprint {topo.fingerprint}"))
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
                cells.append(styled(" X "))
                continue
            l = topo.link(i, j)
            cells.append(styled(l.label, kind_style(l.kind.value)))
        t.add_row(styled(f"{prefix}{i}"), *cells, styled(d.cpu_affinity or ""),
                  styled("" if d.numa_node is None else d.numa_node))
    print_table(t)
    out_console.print()
    from ..topology import UNKNOWN

    known = 0
    for d in topo.devices:
        facts = [d.name] if d.name != UNKNOWN else []
        if d.pci_bus_id:
            facts.append(d.pci_bus_id)
        if d.memory_bytes:
            facts.append(f"{d.memory_bytes / 2**30:.0f} GiB")
        if d.pcie_gen and d.pcie_width:
            facts.append(f"PCIe {d.pcie_gen}.0 x{d.pcie_width}")
        if facts:  # a dump that names nothing (topo -m) gets no "GPU0: unknown" lines
            out_console.print(styled(f"  {prefix}{d.index}: " + ", ".join(facts)))
            known += 1
    if known:
        out_console.print()
    out_console.print(line(("hierarchy", "bold"), f" (fastest first; from {topo.hierarchy_source}):"))
    for k, lv in enumerate(topo.hierarchy, 1):
        groups = "  ".join(f"[{format_ranges(g)}]" for g in lv.groups)
        out_console.print(line(f"  {k}. ", (lv.kind, kind_style(lv.kind)), f": {groups}"))
    bws = [l for l in topo.links if l.bandwidth_gbps is not None]
    if bws:
        lo = min(bws, key=lambda l: l.bandwidth_gbps)
        hi = max(bws, key=lambda l: l.bandwidth_gbps)
        src = "/".join(sorted({l.bandwidth_source for l in bws}))
        text = f"\nbandwidth ({src}, one direction): {lo.bandwidth_gbps:.1f} GB/s ({prefix}{lo.a}-{prefix}{lo.b})"
        if hi is not lo and hi.bandwidth_gbps != lo.bandwidth_gbps:
            text += f" to {hi.bandwidth_gbps:.1f} GB/s ({prefix}{hi.a}-{prefix}{hi.b})"
        out_console.print(styled(text))
    if topo.measurement and len(topo) == 1 and topo.measurement.allreduce_latency_us is None:
        out_console.print(styled(f"\nmeasured nothing: one device ({topo.measurement.device}) has no link to another "
                                 "and nothing to all-reduce with"))
    if topo.measurement and topo.measurement.allreduce_latency_us is not None:
        m = topo.measurement
        out_console.print(styled(f"all-reduce of {m.allreduce_bytes} B (decode message): "
                                 f"{m.allreduce_latency_us:.1f} us median over {m.iterations} iterations "
                                 f"({m.method}, {m.device})"))
    legend = [(k.upper() if k != "nvlink" else "NV#", s) for k, s in KIND_STYLE.items() if k not in ("xgmi", "net")]
    parts: list = ["\nlegend: "]
    for i, piece in enumerate(legend):
        parts.extend(["  "] if i else [])
        parts.append(piece)
    out_console.print(line(*parts))
