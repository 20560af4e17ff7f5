"""``tree-attn run``: tree-attention decoding across ranks, against the Ring baseline."""

from __future__ import annotations

from typing import Annotated

import typer

from ..commands.run.setup import RunOptions
from .common import (
    announce_setup,
    check_plot,
    err_console,
    error,
    fmt_bytes,
    line,
    notice,
    out_console,
    plan_name,
    print_json,
    print_table,
    ranks,
    report,
    styled,
)
from .options import (
    Backend,
    Batch,
    Device,
    Fanout,
    HeadDim,
    Heads,
    Json,
    KvHeads,
    Plan,
    Profile,
    Strategy,
    Timeout,
    WorldSize,
    count_list_option,
    count_option,
)

DEFAULTS = RunOptions()

HELP = (
    "Decode with a long KV cache sharded over ranks, with tree attention and the Ring baseline.\n\n"
    "Without a GPU (or with --device cpu) it spawns CPU ranks (gloo); with GPUs one rank per GPU (NCCL, RCCL "
    "on ROCm). Under torchrun it joins the job instead of spawning. Each strategy runs warm-up and timed "
    "decode steps; the table shows per-step latency (median, p95; a step lasts as long as its slowest rank), "
    "bytes each rank sends per step, peak memory per rank, and the max abs error against a float64 "
    "reference. Defaults: Llama-3.1-8B attention (32 query heads, 8 KV heads, head dim 128), batch 1, "
    "65,536 tokens, 4 ranks on CPU.\n\n"
    "Sizes are checked before anything is allocated: at most 4 CPU ranks per core (at least 8, at most 64 in "
    "all), and a KV cache that fits in memory. --timeout bounds how long a rank may wait for a peer (or stay "
    "silent), not how long the run takes."
)


def run_command(
    ctx: typer.Context,
    world_size: WorldSize = DEFAULTS.world_size,
    seq_len: Annotated[int, count_option(
        "--seq-len", "-n", help="Total KV tokens, split over the ranks (at least 1).")] = DEFAULTS.seq_len,
    batch: Batch = DEFAULTS.batch,
    heads: Heads = DEFAULTS.heads,
    kv_heads: KvHeads = DEFAULTS.kv_heads,
    head_dim: HeadDim = DEFAULTS.head_dim,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="fp32, fp16 or bf16 (auto: bf16 on GPUs, fp32 on CPU ranks).")] = DEFAULTS.dtype,
    kv_dtype: Annotated[str | None, typer.Option(
        "--kv-dtype", help="KV cache dtype: fp32, fp16, bf16, or fp8 (float8_e4m3fn: each rank quantizes its "
        "--dtype shard per KV head, scale amax/448). Default: --dtype. With fp8, 'max err' is against float64 on "
        "the dequantized cache and 'quant err' against float64 on the unquantized one.")] = DEFAULTS.kv_dtype,
    steps: Annotated[int, typer.Option("--steps", help="Timed decode steps per strategy.")] = DEFAULTS.steps,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up steps per strategy.")] = DEFAULTS.warmup,
    strategy: Strategy = DEFAULTS.strategy,
    fanout: Fanout = DEFAULTS.fanout,
    plan: Plan = DEFAULTS.plan,
    backend: Backend = DEFAULTS.backend,
    device: Device = DEFAULTS.device,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random query and KV cache.")] = DEFAULTS.seed,
    timeout: Timeout = DEFAULTS.timeout_s,
    profile_ref: Profile = DEFAULTS.profile,
    cuda_graph: Annotated[bool, typer.Option(
        "--cuda-graph/--no-cuda-graph", help="GPU ranks: capture each tree/allreduce step (local kernel, merge, NCCL "
        "messages) as a CUDA graph and replay it (default), or run it eagerly. The ring baseline always runs "
        "eagerly.")] = DEFAULTS.cuda_graph,
    sweep: Annotated[str | None, count_list_option(
        "--sweep", help="Comma list of sequence lengths to run one after the other instead of --seq-len; one table "
        "row per length and strategy.")] = None,
    plot: Annotated[str | None, typer.Option(
        "--plot", help="With --sweep: write median step time and bytes per rank vs sequence length, per strategy, to "
        "FILE.png (log axes; needs matplotlib).")] = None,
    json_out: Json = False,
) -> None:
    from ..commands.run.decode import run_decode
    from ..commands.run.setup import plan_run, strategies_beyond_tolerance
    from ..errors import ConfigError

    if sweep is not None and _given(ctx, "seq_len"):
        # The sweep's lengths replace --seq-len: a -n given beside it would be dropped unseen.
        raise ConfigError(f"--seq-len {seq_len:,} and --sweep both give the lengths: drop one (--sweep runs each of "
                          "its lengths in turn; add this one to its list)")
    if sweep is None and seq_len < 1:
        # The library takes an empty shard, but a benchmark of an empty cache times nothing and
        # compares nothing ("max err 0.0e+00" of no keys).
        raise ConfigError(f"--seq-len must be at least 1 token; got {seq_len}"
                          + (" (an empty cache: nothing to time or check)" if seq_len == 0 else ""))
    options = RunOptions(
        world_size=world_size, seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype, kv_dtype=kv_dtype, steps=steps, warmup=warmup, strategy=strategy, fanout=fanout, plan=plan,
        backend=backend, device=device, seed=seed, timeout_s=timeout, profile=profile_ref, cuda_graph=cuda_graph,
    )
    if plot:
        if sweep is None:
            # A picture of step time against sequence length needs lengths; a one-point sweep made
            # silently of --seq-len would plot nothing worth a file.
            raise ConfigError("--plot draws step time against sequence length: give the lengths with --sweep "
                              "(e.g. --sweep 16K,64K,256K --plot FILE.png)")
        check_plot(plot)
    if sweep is not None:
        _run_sweep(options, sweep, plot, json_out)
        return
    setup = plan_run(options)
    spec = setup.spec
    announce_setup(setup, (  # under torchrun every rank runs this: rank 0 speaks
        f"decoding B={spec.batch} Hq={spec.q_heads} Hkv={spec.kv_heads} D={spec.head_dim} {spec.dtype}"
        + (f" (KV {spec.kv_dtype}: {fmt_bytes(spec.kv_bytes_per_rank())} per rank)" if spec.kv_dtype != spec.dtype
           else "") + ", "
        f"{spec.seq_len:,} tokens {_over(spec.world_size)} ({spec.backend}); "
        f"strategies: {', '.join(plan_name(p.label, spec.world_size) if p else 'ring' for _, p in spec.plans)}"
        + ("; one rank sends and merges nothing: every strategy runs the local kernel alone"
           if spec.world_size == 1 else "")))
    result = run_decode(spec)
    if result is None:  # a non-zero torchrun rank: rank 0 reports
        return
    result.profile = setup.profile
    report(result, render_run, json_out)
    if strategies_beyond_tolerance(result, spec.dtype, spec.kv_dtype):
        error("a strategy's result differs from the reference beyond tolerance")
        raise typer.Exit(1)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not left at its default)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _run_sweep(options, sweep: str | None, plot: str | None, json_out: bool) -> None:
    """``--sweep`` (and ``--plot``): one run per sequence length, one table, one picture."""
    from ..commands.run.setup import strategies_beyond_tolerance
    from ..commands.run.sweep import run_sweep

    results = run_sweep(options, sweep, progress=lambda text: err_console.print(text, markup=False))
    # The measurements first: a picture that cannot be written must not take them with it.
    if json_out:
        print_json({"sweep": [r.to_dict() for r in results]})
    else:
        render_sweep(results)
    if plot:
        from ..plots import plot_sweep

        first = results[0]
        plot_sweep([r.to_dict() for r in results], plot,
                   f"tree-attn run: {ranks(first.spec['world_size'])}, {first.device} ({first.backend}); measured")
        notice(f"wrote {plot}")
    bad = [r for r in results if strategies_beyond_tolerance(r, r.spec["dtype"], r.spec.get("kv_dtype"))]
    if bad:
        error("a strategy's result differs from the reference beyond tolerance")
        raise typer.Exit(1)


def render_sweep(results) -> None:
    from rich import box
    from rich.table import Table

    first = results[0]
    table = Table(
        title=styled(f"tree-attn run --sweep: {ranks(first.spec['world_size'])}, {first.device} ({first.backend})"),
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
    )
    # Fits 80 columns: units in the headers.
    for col in ("tokens", "strategy", "median ms", "p95 ms", "sent/rank", "peak mem", "max err", "ring/x"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for res in results:
        ring = next((r.step_ms_median for r in res.results if r.strategy == "ring"), None)
        for r in res.results:
            table.add_row(f"{res.spec['seq_len']:,}", styled(plan_name(r.plan, res.spec["world_size"])),
                          f"{r.step_ms_median:.1f}", f"{r.step_ms_p95:.1f}",
                          fmt_bytes(r.bytes_sent_per_step), fmt_bytes(r.peak_mem_bytes), f"{r.max_abs_err:.1e}",
                          f"{ring / r.step_ms_median:.1f}" if ring else "-")
    print_table(table)
    out_console.print("per decode step, as `tree-attn run` (median / p95 of the slowest rank; bytes each rank sends; "
                      "peak memory of a rank); ring/x = ring's median step divided by this row's median step, at the "
                      "same length (above 1: this row is faster than ring)", style="dim")


def _over(world_size: int) -> str:
    """``over 4 ranks``; ``on 1 rank`` (one rank holds the whole cache: nothing is split)."""
    return f"on {ranks(1)}" if world_size == 1 else f"over {ranks(world_size)}"


def render_run(result) -> None:
    from rich import box
    from rich.table import Table

    cfg = result.config if hasattr(result, "config") else result.spec
    # Fits 80 columns: no vertical rules, units in the headers.
    table = Table(
        title=styled(f"tree-attn run: {cfg['seq_len']:,} tokens {_over(cfg['world_size'])}, "
                     f"{result.device} ({result.backend})"),
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
    )
    gpu = any(r.device_ms_median is not None for r in result.results)
    quant = any(r.max_abs_err_unquantized is not None for r in result.results)
    # 80 columns hold one more column than the plain table: an fp8 run's quant err takes the step
    # column's place where every row is eager (CPU ranks), and the caption says so.
    show_step = not quant or any(r.execution == "cuda graph" for r in result.results)
    # Eager rows' device time comes from extra steps, each queued behind a spin kernel (a graph
    # row's from its timed replays): the footnote says so where such a row is shown.
    eager_timed = any(r.device_ms_median is not None and r.execution != "cuda graph" for r in result.results)
    columns = [("strategy", "left"), *([("step", "left")] if show_step else []), ("median", "right"), ("p95", "right"),
               ("sent/rank", "right"), ("msgs", "right"), ("peak mem", "right"), ("max err", "right")]
    if quant:
        columns.append(("quant err", "right"))
    if gpu:
        columns.append(("device", "right"))
    for col, just in columns:
        table.add_column(col, justify=just, no_wrap=True)
    for r in result.results:
        cells = [
            styled(plan_name(r.plan, cfg["world_size"])),
            *(["graph" if r.execution == "cuda graph" else "eager"] if show_step else []),
            f"{r.step_ms_median:.2f} ms",
            f"{r.step_ms_p95:.2f} ms",
            fmt_bytes(r.bytes_sent_per_step),
            str(r.messages_per_step),
            fmt_bytes(r.peak_mem_bytes),
            f"{r.max_abs_err:.1e}",
        ]
        if quant:
            cells.append(f"{r.max_abs_err_unquantized:.1e}")
        if gpu:
            cells.append(f"{r.device_ms_median:.3f} ms" if r.device_ms_median is not None else "-")
        table.add_row(*cells)
    print_table(table)
    out_console.print(
        ("per decode step: graph = the step replayed as one CUDA graph, eager = issued op by op; " if show_step
         else "per decode step (every step eager: issued op by op); ") + "median / p95 "
        "latency from a barrier to the end of the step's device work (slowest rank); bytes and messages each rank "
        "sends (max over ranks); peak memory of a rank (max; on CPU ranks the whole process, interpreter and torch "
        "included); max abs error against a float64 computation of the whole cache"
        + (f" (the dequantized {cfg.get('kv_dtype')} cache the ranks attend over; quant err = against float64 on the "
           f"unquantized {cfg.get('dtype')} cache, the quantization's error; K and V: "
           f"{fmt_bytes(cfg.get('kv_bytes_per_rank', 0))} per rank)" if quant else "")
        + ("; device = CUDA-event time of the step (slowest rank)" if gpu else "")
        + ("; eager rows: extra steps queued behind a spin kernel (JSON device_time)" if eager_timed else ""),
        style="dim",
    )
    if result.speedup_vs_ring is not None:
        x = result.speedup_vs_ring
        verdict = ((f"{x:.1f}x", "bold"), " faster") if x >= 1 else ((f"{1 / x:.1f}x", "bold"), " slower")
        out_console.print(line(f"{result.compared}: ", *verdict,
                               " per decode step than ring (median step, slowest rank)"))
