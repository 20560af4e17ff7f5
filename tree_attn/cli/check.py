"""``tree-attn check``: compare this machine (or a dump) with an expected topology, for CI."""

from __future__ import annotations

from pathlib import Path

import typer

from ..topology.measure import MEASURE_ITERATIONS
from .common import check_output, err_console, esc, notice, out_console, print_json
from .options import CPU_RANKS_HELP, Iterations

# Default floor for measured bandwidth when --measure is given without --min-bandwidth-ratio:
# a healthy link reaches well over half its nominal rate in a large device-to-device copy.
DEFAULT_MIN_RATIO = 0.5

_MARK = {"passed": "[green]ok  [/green]", "failed": "[bold red]FAIL[/bold red]", "skipped": "[dim]skip[/dim]"}


HELP = "Compare the GPU fabric with an expected topology, device model first; exit 1 on any difference."


def check_command(
    expect: Path = typer.Option(..., "--expect", help="Expected topology: a YAML from `tree-attn probe --output`, "
                                "a profile YAML with a topology section, or a recorded dump."),
    from_: list[Path] | None = typer.Option(None, "--from", metavar="DUMP",
                                                help="Check recorded dump(s) instead of this machine (repeat to "
                                                "combine dumps of one machine)."),
    measure: bool = typer.Option(False, "--measure",
                                 help="Measure bandwidths and check them against the expected ones."),
    min_bandwidth_ratio: float | None = typer.Option(
        None, "--min-bandwidth-ratio",
        help=f"Measured bandwidth must reach R x expected (default {DEFAULT_MIN_RATIO} with --measure)."),
    junit: Path | None = typer.Option(None, "--junit", help="Write a JUnit XML report (one testcase per check)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the report."),
    backend: str = typer.Option("auto", "--backend", help="auto, nvml, amdsmi or host."),
    cpu_ranks: int | None = typer.Option(None, "--cpu-ranks", help=CPU_RANKS_HELP),
    iterations: Iterations = MEASURE_ITERATIONS,
) -> None:
    from ..errors import ConfigError, TopologyError
    from ..topology import compare_topologies, load_dumps, load_expected, probe_topology, write_junit
    from ..topology.compare import no_names_hint, summarize_differences

    if measure:
        from ..validate import check_int

        check_int(iterations, "--iterations", minimum=1, must=True)
    if cpu_ranks is not None:  # before a topology of that many ranks is built
        from ..launch.env import check_cpu_ranks

        check_cpu_ranks(cpu_ranks, "--cpu-ranks")
    if min_bandwidth_ratio is not None and not 0 < min_bandwidth_ratio <= 10:
        raise ConfigError(f"--min-bandwidth-ratio: expected a number in (0, 10], got {min_bandwidth_ratio}")
    if junit is not None:  # before probing or measuring, not after
        check_output(junit, "--junit")
    expected = load_expected(expect)
    if from_:
        if measure:
            raise TopologyError("--measure needs the machine itself: it cannot measure a recorded dump")
        actual = load_dumps(from_)
    else:
        actual = probe_topology(backend, cpu_ranks=cpu_ranks if cpu_ranks is not None else
                                (len(expected) if expected.source == "host" else None))
        for n in actual.notes:
            notice(n)
    ratio = min_bandwidth_ratio
    if measure:
        from ..topology.measure import measure_topology

        err_console.print(f"measuring {len(actual)} device(s)...", markup=False)
        actual = measure_topology(actual, iterations=iterations)
        ratio = ratio if ratio is not None else DEFAULT_MIN_RATIO
    report = compare_topologies(expected, actual, min_bandwidth_ratio=ratio)
    if junit is not None:
        write_junit(report, str(junit))
        notice(f"wrote JUnit report {junit}")
    if json_out:
        print_json(report.to_dict())
    else:
        out_console.print(f"checking {actual.source} ({len(actual)} devices, fingerprint {actual.fingerprint}) "
                          f"against {expect} ({len(expected)} devices, fingerprint {expected.fingerprint})",
                          markup=False, soft_wrap=True)
        for r in report.results:
            out_console.print(f"  {_MARK[r.status]} {esc(r.name)}: {esc(r.detail)}", highlight=False, soft_wrap=True)
            # Identical differences on many pairs (an A100 box against an H100 expectation) read as one line.
            for d in summarize_differences(r.differences, len(actual) * (len(actual) - 1) // 2):
                out_console.print(f"         {d}", markup=False, highlight=False, soft_wrap=True)
        if report.ok and report.model_compared:
            out_console.print("[green]the fabric is as expected[/green]")
        elif report.ok:
            # A topo -m dump names no GPU: an H200 box reads as an H100's fabric. Say what was not seen.
            out_console.print("[yellow]the links are as expected; the GPU model was not compared[/yellow] "
                              f"(a dump without names: {esc(no_names_hint(expected, actual))})")
        else:
            count = len(report.differences)
            out_console.print(f"[bold red]{count} difference(s) from the expected topology[/bold red]")
    if not report.ok:
        raise typer.Exit(code=1)
