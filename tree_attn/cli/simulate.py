"""``tree-attn simulate``: predicted decode steps for tree, allreduce and ring on clusters."""

from __future__ import annotations

import typer

from .common import count_list_option, count_option, int_list_option, out_console, print_json, styled

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


def register(app: typer.Typer) -> None:
    app.command("simulate", help=HELP)(simulate_command)


def simulate_command(
    preset: str = typer.Option(None, "--preset", help="Built-in cluster: h100-sxm, mi300x or rtx4090-pcie (default: the one of the device a --topology/--profile names, else h100-sxm)."),
    topology: str = typer.Option(None, "--topology", "-t", help="A node's topology: probe YAML (measured numbers used) or a recorded dump."),
    profile: str = typer.Option(None, "--profile", "-p", help="A profile (path or name): topology, kernel bandwidth, plan timings."),
    params: str = typer.Option(None, "--params", help="A parameters file written by benchmarks/calibrate_costmodel.py."),
    world_sizes: str = int_list_option("8,16,32,64,128", "--world-sizes", "-w", help="Comma list of GPU counts (multiples of --gpus-per-node above one node)."),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", "-g", help="GPUs per node (default: the preset's or topology's)."),
    seq_lens: str = count_list_option("32K,128K,512K,1M,5.12M", "--seq-lens", "-n", help="Comma list of total tokens (1 to 100M)."),
    batch: int = count_option(1, "--batch", "-b", help="Sequences decoded together."),
    heads: int = typer.Option(32, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(8, "--kv-heads", help="KV heads."),
    head_dim: int = typer.Option(128, "--head-dim", help="Head dimension."),
    dtype: str = typer.Option("bf16", "--dtype", help="KV cache dtype: fp32, fp16 or bf16."),
    fanout: int = typer.Option(2, "--fanout", "-k", help="Fan-out of the topology-aware tree."),
    step_overhead_us: float = typer.Option(None, "--step-overhead-us", help="Fixed time per decode step besides attention and its communication (a framework's Python, a graph launch), in microseconds; replaces the parameters' own."),
    plot: str = typer.Option(None, "--plot", help="Write latency vs sequence length and speedup vs world size to FILE.png (needs matplotlib)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
) -> None:
    from ..commands.simulate import SimulateOptions, simulate

    if plot:
        from ..plots import check_png_path, require_matplotlib

        check_png_path(plot)
        require_matplotlib()
    result = simulate(SimulateOptions(
        preset=preset, topology=topology, profile=profile, params=params, world_sizes=world_sizes,
        gpus_per_node=gpus_per_node, seq_lens=seq_lens, batch=batch, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype, fanout=fanout, step_overhead_us=step_overhead_us,
    ))
    if json_out:
        print_json(result.to_dict())
    else:
        render(result)
    if plot:
        from ..plots import plot_simulation
        from .common import err_console

        plot_simulation(result, plot)
        err_console.print(f"wrote {plot}", markup=False)


def _ms(us: float) -> str:
    ms = us / 1e3
    return f"{ms:,.3f}" if ms < 10 else f"{ms:,.1f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(result) -> None:
    from rich import box
    from rich.table import Table

    w = result.workload
    table = Table(
        title=styled(f"tree-attn simulate: {result.cluster_name}, B={w.batch} Hq={w.q_heads} Hkv={w.kv_heads} "
                     f"D={w.head_dim} {w.dtype}, predicted ms per step"),
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
    )
    # Fits 80 columns: ring's peak memory per rank is in --json (and in the notes when it overflows).
    for col in ("GPUs", "tokens", "tree", "allred", "ring", "ring/tree", "tree sent", "ring sent"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in result.rows:
        table.add_row(f"{r.world_size}={r.nodes}x{r.ranks_per_node}", f"{r.seq_len:,}", _ms(r.tree.time_us),
                      _ms(r.allreduce.time_us), _ms(r.ring.time_us), f"{r.speedup:,.1f}x",
                      _bytes(r.tree.bytes_per_rank), _bytes(r.ring.bytes_per_rank))
    out_console.print(table)
    plans = sorted({r.tree.plan for r in result.rows})
    # The source (it may name a file) and the plan labels on lines of their own, never wrapped.
    out_console.print(f"parameters: {result.source}", style="dim", markup=False, soft_wrap=True)
    out_console.print(f"tree plans: {', '.join(plans)}", style="dim", markup=False, soft_wrap=True)
    out_console.print(
        "sent = bytes per rank per step (busiest rank); peak memory per rank in --json. Predictions of the cost "
        "model, not measurements (its check against measured runs: benchmarks/RESULTS.md).", style="dim")
    for note in result.notes:
        out_console.print(f"note: {note}", style="dim", markup=False)
