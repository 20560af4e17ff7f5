"""``tree-attn fit``: the longest context a box can hold for a model (no box needed)."""

from __future__ import annotations

from typing import Annotated

import typer

from ..commands.fit import MODEL_CONFIGS, FitOptions
from .common import out_console, print_table, report, styled
from .options import Json, count_option

DEFAULTS = FitOptions()

HELP = (
    "The longest prompt a machine can hold for a model under tree-attn generate, without the machine: "
    "per rank the model's weights (every rank holds them), its share of the KV cache (zig-zag, the last rank "
    "also the new tokens'), the prefill's activations and the process (CUDA context, allocator slack), "
    "against each GPU's memory, for -g ranks and for 2x and 4x as many. The same arithmetic generate checks "
    "before it loads anything.\n\n"
    f"Model: --preset ({', '.join(MODEL_CONFIGS)}: the real configs, every layer) or --config (a "
    "config.json, or a checkpoint folder holding one). Machine: --gpu NAME from the device catalogue (its "
    "memory as the driver reports it) or --memory per GPU; --device cpu: CPU ranks sharing one host's "
    "--memory. Estimates, not measurements (their check against measured peaks: benchmarks/RESULTS.md)."
)


def fit_command(
    preset: Annotated[str | None, typer.Option(
        "--preset", help=f"A model: {', '.join(MODEL_CONFIGS)}.")] = DEFAULTS.preset,
    config: Annotated[str | None, typer.Option(
        "--config", help="A model's config.json (or a checkpoint folder with one, or a hub id already in the "
        "local Hugging Face cache).")] = DEFAULTS.config,
    gpu: Annotated[str | None, typer.Option(
        "--gpu", help="A GPU of the device catalogue: rtx4090, h100-sxm, h100-pcie, h100-nvl, h200, a100-sxm-80gb, "
        "a100-40gb, mi300x (case, spaces, - and _ aside: 'RTX 4090' is rtx4090).")] = DEFAULTS.gpu,
    gpus: Annotated[int, typer.Option("--gpus", "-g", help="Ranks (GPUs, or CPU ranks on the host).")] = DEFAULTS.gpus,
    memory: Annotated[str | None, typer.Option(
        "--memory", help="Memory per GPU (or the host's, with --device cpu): 24GiB, 80GB, 512MiB; replaces "
        "the catalogue's.")] = DEFAULTS.memory,
    device: Annotated[str, typer.Option("--device", help="cuda (GPUs) or cpu (CPU ranks).")] = DEFAULTS.device,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Weights and activations: bf16, fp16 or fp32.")] = DEFAULTS.dtype,
    kv_dtype: Annotated[str | None, typer.Option(
        "--kv-dtype", help="The KV cache's dtype (default: --dtype).")] = DEFAULTS.kv_dtype,
    new_tokens: Annotated[int, count_option(
        "--new-tokens", help="Tokens generated after the prompt.")] = DEFAULTS.new_tokens,
    json_out: Json = False,
) -> None:
    from ..commands.fit import fit

    result = fit(FitOptions(preset=preset, config=config, gpu=gpu, memory=memory, gpus=gpus, device=device,
                            dtype=dtype, kv_dtype=kv_dtype, new_tokens=new_tokens))
    report(result, render, json_out)


def _gib(b: int) -> str:
    return f"{b / 2**30:,.1f}"


def render(result) -> None:
    from rich import box
    from rich.table import Table

    d = result.dims
    kind = "GPU" if result.device_kind == "cuda" else "host"
    table = Table(
        title=styled(f"tree-attn fit: {result.model} on {result.device}, {_gib(result.memory_bytes)} GiB per {kind}"),
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
    )
    for col in ("ranks", "longest prompt", "per rank: weights", "KV", "activations", "process", "total GiB"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in result.rows:
        m = r.rank
        if m is None:
            table.add_row(str(r.ranks), "none", "-", "-", "-", "-", "-")
            continue
        tokens = f"{r.tokens:,}" + ("*" if r.capped else "")
        table.add_row(str(r.ranks), tokens, _gib(m.weights), _gib(m.kv), _gib(m.activations), _gib(m.overhead),
                      _gib(m.total))
    print_table(table)
    out_console.print(f"{d.layers} layers, {d.params() / 1e9:,.2f}B params in {result.dtype}; KV in {result.kv_dtype}: "
                      f"{d.kv_bytes_per_token(result.kv_dtype):,} bytes per token", style="dim")
    out_console.print(f"per rank: the busiest rank at that prompt (GiB); {result.new_tokens} new tokens on the last "
                      "rank.", style="dim")
    out_console.print(f"transformers alone in one process (generate's reference row): {result.one_process:,} tokens.",
                      style="dim")
    for note in result.notes:
        out_console.print(f"* {note}" if "max_position" in note else f"note: {note}", style="dim", markup=False)
    out_console.print(f"memory: {result.memory_source}. Estimates from the model's config, not measurements.",
                      style="dim")
