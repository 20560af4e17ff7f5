"""``tree-attn simulate``: predicted decode steps for tree, allreduce and ring on clusters."""

from __future__ import annotations

from typing import Annotated

import typer

from ..commands.simulate import SimulateOptions
from .common import check_plot, fmt_bytes, out_console, print_table, report, styled
from .options import Batch, HeadDim, Heads, Json, KvHeads, count_list_option, int_list_option

DEFAULTS = SimulateOptions()

HELP = (
    "Predict one decode step of tree attention, the all-reduce form and Ring on a cluster you cannot "
    "run here (up to 4096 GPUs as nodes x GPUs per node, up to 100M tokens), from a cost model: per link "
    "class a latency and a bandwidth for messages and for all-reduce, per device the memory bandwidth "
    "and the kernel's achieved fraction, a fixed step overhead.\n\n"
    "Parameters, from one of: --params (a calibration file, benchmarks/calibrate_costmodel.py), "
    "--profile (a tuned profile: its topology, kernel bandwidth, plan timings), --topology (a probe YAML, "
    "with --measure numbers, or a recorded nvidia-smi/amd-smi dump), else the --preset: h100-sxm "
    "(NVSwitch + 400G InfiniBand per GPU), mi300x (xGMI + 400G RoCE), rtx4090-pcie (PCIe without P2P + "
    "100 GbE). The preset also gives what a topology or profile lacks (device, network); without --preset, "
    "the one of the topology's kind of GPU.\n\n"
    "Counts take K = 1,024 and M = 1,000,000 (the paper's 5.12M tokens), as in every command. The numbers are "
    "predictions, checked against measured runs in benchmarks/RESULTS.md, not measurements."
)


def simulate_command(
    preset: Annotated[str | None, typer.Option(
        "--preset", help="Built-in cluster: h100-sxm, mi300x or rtx4090-pcie (default: the one of the device a "
        "--topology/--profile names, else h100-sxm).")] = DEFAULTS.preset,
    topology: Annotated[str | None, typer.Option(
        "--topology", "-t", help="A node's topology: probe YAML (measured numbers used) or a recorded "
        "dump.")] = DEFAULTS.topology,
    profile: Annotated[str | None, typer.Option(
        "--profile", "-p", help="A profile (path or name): topology, kernel bandwidth, plan "
        "timings.")] = DEFAULTS.profile,
    params: Annotated[str | None, typer.Option(
        "--params", help="A parameters file written by benchmarks/calibrate_costmodel.py.")] = DEFAULTS.params,
    world_sizes: Annotated[str, int_list_option(
        "--world-sizes", "-w", help="Comma list of GPU counts (multiples of --gpus-per-node above one "
        "node).")] = DEFAULTS.world_sizes,
    gpus_per_node: Annotated[int | None, typer.Option(
        "--gpus-per-node", "-g", help="GPUs per node (default: the preset's or topology's).")] = DEFAULTS.gpus_per_node,
    seq_lens: Annotated[str, count_list_option(
        "--seq-lens", "-n", help="Comma list of total tokens (1 to 100M).")] = DEFAULTS.seq_lens,
    batch: Batch = DEFAULTS.batch,
    heads: Heads = DEFAULTS.heads,
    kv_heads: KvHeads = DEFAULTS.kv_heads,
    head_dim: HeadDim = DEFAULTS.head_dim,
    dtype: Annotated[str, typer.Option("--dtype", help="Query dtype, and the KV cache's without --kv-dtype: fp32, "
                                       "fp16 or bf16.")] = DEFAULTS.dtype,
    kv_dtype: Annotated[str | None, typer.Option(
        "--kv-dtype", help="KV cache dtype: fp32, fp16, bf16 or fp8 (1 byte per element; ring blocks carry their "
        "scales). Default: --dtype.")] = DEFAULTS.kv_dtype,
    fanout: Annotated[int, typer.Option(
        "--fanout", "-k", help="Fan-out of the topology-aware tree.")] = DEFAULTS.fanout,
    step_overhead_us: Annotated[float | None, typer.Option(
        "--step-overhead-us", help="Fixed time per decode step besides attention and its communication (a "
        "framework's Python, a graph launch), in microseconds; replaces the parameters' "
        "own.")] = DEFAULTS.step_overhead_us,
    plot: Annotated[str | None, typer.Option(
        "--plot", help="Write latency vs sequence length and speedup vs world size to FILE.png (needs "
        "matplotlib).")] = None,
    json_out: Json = False,
) -> None:
    from ..commands.simulate import simulate

    check_plot(plot)
    result = simulate(SimulateOptions(
        preset=preset, topology=topology, profile=profile, params=params, world_sizes=world_sizes,
        gpus_per_node=gpus_per_node, seq_lens=seq_lens, batch=batch, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype, fanout=fanout, step_overhead_us=step_overhead_us,
    ))
    from ..plots import plot_simulation

    report(result, render, json_out, plot, plot_simulation)


def _ms(us: float) -> str:
    ms = us / 1e3
    return f"{ms:,.3f}" if ms < 10 else f"{ms:,.1f}"


def render(result) -> None:
    from rich import box
    from rich.table import Table

    from ..dtypes import SHORT

    w = result.workload
    table = Table(
        title=styled(f"tree-attn simulate: {result.cluster_name}, B={w.batch} Hq={w.q_heads} Hkv={w.kv_heads} "
                     f"D={w.head_dim} {w.dtype}" + (f", KV {SHORT[w.kv_name]}" if w.kv_dtype is not None else "")
                     + ", predicted ms per step"),
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
    )
    # Fits 80 columns: ring's peak memory per rank is in --json (and in the notes when it overflows).
    for col in ("GPUs", "tokens", "tree", "allred", "ring", "ring/tree", "tree sent", "ring sent"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in result.rows:
        table.add_row(f"{r.world_size}={r.nodes}x{r.ranks_per_node}", f"{r.seq_len:,}", _ms(r.tree.time_us),
                      _ms(r.allreduce.time_us), _ms(r.ring.time_us), f"{r.speedup:,.1f}x",
                      fmt_bytes(r.tree.bytes_per_rank), fmt_bytes(r.ring.bytes_per_rank))
    print_table(table)
    plans = sorted({r.tree.plan for r in result.rows})
    # The source (it may name a file) and the plan labels on lines of their own, never wrapped.
    out_console.print(f"parameters: {result.source}", style="dim", markup=False, soft_wrap=True)
    out_console.print(f"tree plans: {', '.join(plans)}", style="dim", markup=False, soft_wrap=True)
    out_console.print(
        "sent = bytes per rank per step (busiest rank); peak memory per rank in --json. Predictions of the cost "
        "model, not measurements (its check against measured runs: benchmarks/RESULTS.md).", style="dim")
    for note in result.notes:
        out_console.print(f"note: {note}", style="dim", markup=False)
