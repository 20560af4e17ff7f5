"""``tree-attn tune``: measure this machine, choose the reduction plan and kernel configs, write a profile.

Parsing and rendering only: ``commands.tune`` resolves the topology and the ranks, checks the
output path, times (or models) and builds the profile.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..commands.tune.setup import TuneRequest
from .common import err_console, line, notice, out_console, print_json, print_table, styled, warn
from .options import Backend, Batch, Device, HeadDim, Heads, KvHeads, Timeout

DEFAULTS = TuneRequest()

HELP = (
    "Tune tree attention for this machine and write a profile that `tree-attn run` uses.\n\n"
    "Probes the fabric (or reads --topology FILE), then (a) on GPUs searches the Triton kernel's config space "
    "per shape bucket, pruned by the napkin performance model, timing each survivor (warm-up, CUDA events, "
    "median); (b) times every candidate reduction plan (all-reduce, trees of fan-out 2/4/8/world, the "
    "topology's hierarchical trees) at the decode message size across all ranks, each iteration as slow as "
    "its slowest rank; rank 0 decides and broadcasts the choice. The profile goes to the user's cache "
    "folder, named by the fabric fingerprint, or to --output (an existing file is refused before anything "
    "is timed, unless --force, and so is a path that cannot be written).\n\n"
    "With a --topology of another machine, nothing can be timed here: the profile is model-derived.\n\n"
    "Under torchrun (one tune per node) the job's ranks time the plans across the nodes; the topology is "
    "--topology FILE (what `probe --measure -o FILE` measured in such a job: its hierarchy follows the "
    "measurement) or the node layout. `run --profile FILE` in the same job then decodes with the chosen plan."
)


def tune_command(
    topology_file: Annotated[str | None, typer.Option(
        "--topology", help="A topology YAML or a recorded dump (nvidia-smi topo -m, amd-smi topology...) instead of "
        "probing.")] = DEFAULTS.topology_file,
    world_size: Annotated[int | None, typer.Option(
        "--world-size", "-w", help="Ranks (default: the GPUs, else 4 CPU ranks).")] = DEFAULTS.world_size,
    device: Device = DEFAULTS.device,
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="Profile path (default: the cache folder, named by fingerprint).")] = DEFAULTS.output,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing profile.")] = DEFAULTS.force,
    quick: Annotated[bool, typer.Option(
        "--quick", help="A small budget: few iterations, two shard buckets (under a minute on CPU "
        "ranks).")] = DEFAULTS.quick,
    batch: Batch = DEFAULTS.batch,
    heads: Heads = DEFAULTS.heads,
    kv_heads: KvHeads = DEFAULTS.kv_heads,
    head_dim: HeadDim = DEFAULTS.head_dim,
    dtype: Annotated[str, typer.Option("--dtype", help="Query (and, without --kv-dtype, KV) dtype the kernel is tuned "
                                       "for (GPUs): fp32, fp16 or bf16.")] = DEFAULTS.dtype,
    kv_dtype: Annotated[str | None, typer.Option(
        "--kv-dtype", help="KV cache dtype the kernel is tuned for (GPUs): fp32, fp16, bf16 or fp8 (float8_e4m3fn, "
        "with scales; its own kernel configs). Default: --dtype.")] = DEFAULTS.kv_dtype,
    backend: Backend = DEFAULTS.backend,
    timeout: Timeout = DEFAULTS.timeout_s,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object (the profile and where it went).")] = False,
) -> None:
    from ..commands.tune.profile import build_profile, write_profile
    from ..commands.tune.setup import plan_tune

    setup = plan_tune(TuneRequest(
        topology_file=topology_file, world_size=world_size, device=device, output=output, force=force, quick=quick,
        batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype, backend=backend,
        timeout_s=timeout,
    ))
    rank0 = setup.options.launch.rank == 0
    if rank0:
        for n in setup.notices:
            notice(n)
    if setup.measurable and rank0:
        with _TuneProgress() as on_event:
            profile = build_profile(setup, progress=on_event)
    else:
        profile = build_profile(setup)
    if profile is None:  # a torchrun rank other than 0: rank 0 writes and reports
        return
    path = write_profile(setup, profile)
    if json_out:
        print_json({"profile_path": path, "profile": profile.to_dict()})
    else:
        _render(profile, path)


class _TuneProgress:
    """A rich progress display on stderr fed by ``commands.tune.profile.TuneEvent``s: one spinner
    line per stage, the stage's details printed above it."""

    def __enter__(self):
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        # markup=False: descriptions carry plan labels and device names, which are not markup.
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                            console=err_console, transient=False)
        self.bar.__enter__()
        self.tasks: dict[str, int] = {}
        return self.on_event

    def on_event(self, event) -> None:
        if event.kind == "start":
            self.tasks[event.stage] = self.bar.add_task(event.text, total=None)
        elif event.kind == "detail":
            self.bar.console.print(styled(f"  {event.text}"))
        elif event.stage in self.tasks:
            self.bar.update(self.tasks[event.stage], description=event.text, completed=1, total=1)

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


def _render(profile, path: str) -> None:
    from rich.table import Table

    red = profile.reduction
    # The heading as a line of its own: a table's title wraps at the table's (narrow) width.
    out_console.print(styled(f"reduction plans ({red.chosen_by}), message {red.message_bytes:,} B per rank"),
                      soft_wrap=True)
    table = Table()
    # Plan labels and configs stay whole (no_wrap): the numbers' columns give way first.
    for col in ("", "plan", "median", "p95", "predicted"):
        table.add_column(col, justify="left" if col in ("", "plan") else "right", no_wrap=col == "plan")

    def us(x):
        return "-" if x is None else f"{x:,.0f} us"

    for c in sorted(red.candidates, key=lambda c: (c.median_us if c.median_us is not None else c.predicted_us or 0)):
        table.add_row(styled("*", "bold green") if c.selected else "", styled(c.label), us(c.median_us), us(c.p95_us),
                      us(c.predicted_us))
    print_table(table)
    if profile.kernel.buckets:
        kt = Table(title="kernel configs per shard bucket (measured)", title_justify="left")
        for col in ("bucket", "config", "time", "GB/s", "tried"):
            kt.add_column(col, no_wrap=col in ("bucket", "config"))
        for b in profile.kernel.buckets:
            kt.add_row(styled(f"{b.dtype} D={b.head_dim} G={b.group} N<={b.max_shard_len:,}"),
                       styled(b.config.describe()),
                       us(b.time_us), f"{b.gbps:,.0f}" if b.gbps else "-", str(b.candidates_tried))
        print_table(kt)
    for note in profile.notes:
        if "not measured" in note:
            warn(note)
    # One line, never wrapped by the console: the path and the label are copied from it.
    out_console.print(line("profile written to ", (path, "bold"), f" (plan: {red.plan.label})"), soft_wrap=True)
