"""``tree-attn generate``: greedy decoding of a real model with its KV cache sharded over ranks."""

from __future__ import annotations

from typing import Annotated

import typer

from ..commands.generate.setup import GenerateOptions
from ..commands.generate.ties import TIE_ULPS_PER_ROOT_LAYER
from .common import (
    announce_setup,
    err_console,
    error,
    fmt_bytes,
    line,
    out_console,
    plan_name,
    print_table,
    ranks,
    report,
    styled,
)
from .options import Backend, Device, Fanout, Json, Plan, Profile, Strategy, Timeout, WorldSize, count_option

DEFAULTS = GenerateOptions()

HELP = (
    "Greedy decoding of a Llama-family model (Llama, Qwen2, Mistral) with its KV cache paged and "
    "sharded over ranks, every layer's attention by tree attention.\n\n"
    "--model loads a local checkpoint folder (config.json, *.safetensors, a tokenizer if it has one), "
    "or a hub id (org/name) already in the local Hugging Face cache; nothing is downloaded. Without "
    "--model a small Llama is built from a config with --seed: random "
    "weights, so the output is token ids, not text, and the prompt is --prompt-len random ids (or ids "
    "given as --prompt 1,2,3).\n\n"
    "No process holds the whole KV cache. Each rank loads the model and prefills only its part of the "
    "prompt (zig-zag: rank r holds chunks r and 2p-1-r of 2p, which balances the causal work), each "
    "layer's attention exchanged around the ring of ranks, straight into its paged pool; then each "
    "strategy decodes the same tokens, the new tokens' KV going to the last rank. The launching process "
    "loads no model and no KV.\n\n"
    "Before anything loads, the memory each rank needs (weights, its KV share, activations, the process) "
    "is checked against the GPUs' free memory (NVML) or the host's: a prompt that cannot fit is refused, "
    "naming the largest that would (see also tree-attn fit). --reference auto (the default) also runs "
    "transformers alone and tree-attn on one rank where the whole context fits in one process, and every "
    "row must give the reference's tokens (without it, the rows are checked against each other): exit 1 "
    "if one does not. Needs the \\[models] extra (Hugging Face transformers).\n\n"
    "Under torchrun (one node or several) it joins the job instead of spawning: the same ranks, only the "
    "ring's and the decode's messages between nodes, rank 0 reports; across nodes the tree is planned from "
    "the node layout, as in run."
)


def generate_command(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A local checkpoint folder of a Llama, Qwen2 or Mistral model, or a hub id "
        "(org/name) already in the local Hugging Face cache.")] = DEFAULTS.model,
    preset: Annotated[str, typer.Option(
        "--preset", help="Without --model: small (a small Llama) or llama-3.1-8b (the 8B's layer shapes with a "
        "32,000-token vocabulary); random weights.")] = DEFAULTS.preset,
    layers: Annotated[int | None, typer.Option(
        "--layers", help="Layers of the preset (small: 4, llama-3.1-8b: 2).")] = DEFAULTS.layers,
    seed: Annotated[int, typer.Option(
        "--seed", help="Seed of a preset's weights, the random prompt and the page tables.")] = DEFAULTS.seed,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", help="Text (with a checkpoint's tokenizer) or comma-separated token ids.")] = DEFAULTS.prompt,
    prompt_len: Annotated[int, count_option(
        "--prompt-len", help="Without --prompt: this many random token ids.")] = DEFAULTS.prompt_len,
    new_tokens: Annotated[int, count_option(
        "--new-tokens", help="Tokens to generate (one decode step each).")] = DEFAULTS.new_tokens,
    max_len: Annotated[int | None, count_option(
        "--max-len", help="Longest sequence (prompt + new tokens) allowed; default: the model's max "
        "positions.")] = DEFAULTS.max_len,
    world_size: WorldSize = DEFAULTS.world_size,
    strategy: Strategy = DEFAULTS.strategy,
    fanout: Fanout = DEFAULTS.fanout,
    plan: Plan = DEFAULTS.plan,
    device: Device = DEFAULTS.device,
    backend: Backend = DEFAULTS.backend,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="Weights and KV cache: auto (bf16 on GPUs, float32 on CPU ranks), float32 (fp32), fp16 or "
        "bf16; in 16 bits rounding may flip a near-tie of the reference's logits: such a row "
        f"passes as 'tie at N' (within {TIE_ULPS_PER_ROOT_LAYER} x sqrt(layers) ulps), any other difference "
        "exits 1.")] = DEFAULTS.dtype,
    kv_dtype: Annotated[str | None, typer.Option(
        "--kv-dtype", help="KV cache dtype (default: the --dtype): float32, fp16, bf16 or fp8 (float8_e4m3fn: "
        "each rank quantizes K and V as they are written, the prefill and every new token, with per-layer, "
        "per-KV-head scales that the ranks take together from the whole prompt; 1 byte per element in the capacity "
        "check; the ring sends each rank's scales with its pool). The reference then reads its cache quantized the "
        "same way, so the rows are checked token for token, as in 16 bits.")] = DEFAULTS.kv_dtype,
    page_size: Annotated[int, count_option("--page-size", help="Tokens per KV page (1..256).")] = DEFAULTS.page_size,
    cuda_graph: Annotated[bool, typer.Option(
        "--cuda-graph/--no-cuda-graph", help="GPU ranks: capture each generated token (the model's forward, every "
        "layer's attention kernel, merge and NCCL traffic, the KV write and the argmax) as one CUDA graph and replay "
        "it; if it cannot be captured, eager with the reason in the output. --no-cuda-graph runs every token "
        "eagerly.")] = DEFAULTS.cuda_graph,
    reference: Annotated[str, typer.Option(
        "--reference", help="The rows computed in one process (transformers alone, and tree-attn on one rank): "
        "auto runs each where the whole context fits in one process, on refuses the job where one cannot, "
        "off skips both.")] = DEFAULTS.reference,
    timeout: Timeout = DEFAULTS.timeout_s,
    profile_ref: Profile = DEFAULTS.profile,
    json_out: Json = False,
) -> None:
    from ..commands.generate.decode import run_generate
    from ..commands.generate.setup import plan_generate

    setup = plan_generate(GenerateOptions(
        model=model, preset=preset, layers=layers, seed=seed, prompt=prompt, prompt_len=prompt_len,
        new_tokens=new_tokens, max_len=max_len, world_size=world_size, strategy=strategy, fanout=fanout,
        plan=plan, device=device, backend=backend, dtype=dtype, kv_dtype=kv_dtype, page_size=page_size,
        reference=reference,
        timeout_s=timeout, profile=profile_ref, cuda_graph=cuda_graph,
    ))
    spec = setup.spec
    announce_setup(setup, (  # under torchrun every rank runs this: rank 0 speaks
        f"generating {spec.new_tokens} tokens after a {len(spec.prompt_ids):,}-token prompt over "
        f"{ranks(spec.world_size)} ({spec.backend}, {spec.dtype}"
        + (f", KV {spec.kv_dtype}: scales per layer and KV head fixed by the prefill" if spec.kv_dtype != spec.dtype
           else "") + "); strategies: "
        f"{', '.join(plan_name(p.label, spec.world_size) if p else 'ring' for _, p in spec.plans)}"))
    say = lambda text: err_console.print(text, markup=False, style="dim")
    result = run_generate(spec, progress=say, tokenizer=setup.tokenizer)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return
    result.profile = setup.profile
    result.prompt_text = setup.prompt_text
    report(result, render_generate, json_out)
    if not result.all_match:
        bad = [r.name for r in result.rows if r.ran and not r.ok]
        against = "the reference's" if result.checked_against == "reference" else \
            f"the {result.checked_against} row's" if result.checked_against == "one rank" else "each other's"
        error(f"{', '.join(bad)}: generated tokens differ from {against} (or between ranks)")
        from ..commands.generate.ties import parting
        from ..dtypes import torch_dtype

        yard = result.yardstick
        for r in result.rows:
            if r.ran and not r.ranks_agree:
                err_console.print(f"{r.name}: its ranks generated different tokens", markup=False)
            elif r.ran and not r.ok and yard is not None and r is not yard and not r.matches:
                where = parting(r.tokens, yard.tokens, yard.top, torch_dtype(result.dtype), layers=result.layers,
                                against=yard.name, own_top=r.top)
                err_console.print(f"{r.name}: parts from the {yard.name} at {where}", markup=False)
        raise typer.Exit(1)


def render_generate(result) -> None:
    from rich import box
    from rich.table import Table

    table = Table(
        title=styled(f"tree-attn generate: {result.model}, {result.prompt_tokens:,}-token prompt, "
                     f"{ranks(result.world_size)}, {result.device} ({result.backend})"),
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
    )
    for col, just in (("decode", "left"), ("ranks", "right"), ("step", "left"), ("median", "right"),
                      ("p95", "right"), ("tokens/s", "right"), ("sent/rank", "right"), ("msgs", "right"),
                      ("tokens", "left")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in result.rows:
        if not r.ran:
            table.add_row(styled(r.name), str(r.ranks), "-", "-", "-", "-", "-", "-", styled("skipped", "dim"))
            continue
        if r.name == result.checked_against:
            same = "yardstick" if r.name != "reference" else "reference"
        else:
            same = "DIFFER" if not r.ok else f"tie at {r.near_tie.step + 1}" if r.near_tie is not None else "same"
        table.add_row(styled(r.name), str(r.ranks), "graph" if r.execution == "cuda graph" else "eager",
                      f"{1e3 * r.median_s:.2f} ms", f"{1e3 * r.p95_s:.2f} ms",
                      f"{r.tokens_per_s:.1f}", fmt_bytes(r.bytes_per_token), str(r.messages_per_token),
                      styled(same, None if same != "DIFFER" else "bold red"))
    print_table(table)
    for r in result.rows:
        if not r.ran:
            out_console.print(line((r.name, "bold"), f": {r.skipped}"))
        elif r.near_tie is not None and r.ok:
            out_console.print(line((r.name, "bold"), f": {r.near_tie.describe()}"), style="yellow")
    if result.backend == "nccl":  # GPU ranks: say why a row that could have been a graph was not
        for r in result.rows:
            if r.ran and r.name != "reference" and r.execution != "cuda graph" and r.why_eager:
                out_console.print(f"{r.name}: eager: {r.why_eager}", style="dim")
    sizes = result.shard_sizes
    prefill_bytes = max((rep.prefill.timing.stats.bytes_sent for rep in result.ranks), default=0)
    ref_cache = f"cache, read as {result.kv_dtype}" if any(r.quantized for r in result.rows) else "cache"
    out_console.print(
        "step: graph = each token one CUDA graph replay (the model, every layer's attention, merge and NCCL "
        "traffic), eager = issued op by op; "
        f"per generated token (one decode step through all layers): latency on rank 0, bytes and messages each rank "
        f"sends (max over ranks); reference = transformers alone (its sdpa attention and {ref_cache}) in one "
        f"process, one "
        f"rank = tree-attn's paged kernel in one process. Prefill {result.prefill_s:.1f} s sharded: "
        f"{min(sizes):,}-{max(sizes):,} tokens per rank (zig-zag), each layer's K/V around the ring "
        f"({fmt_bytes(prefill_bytes)} sent by the busiest rank); the new tokens' KV on rank {result.world_size - 1}",
        style="dim",
    )
    est = result.estimate
    if est is not None and result.ranks:
        peak = max(result.ranks, key=lambda rep: rep.peak_bytes)
        out_console.print(
            f"memory per rank: estimated {fmt_bytes(max(r.total for r in est.ranks))}, measured peak "
            f"{fmt_bytes(peak.peak_bytes)} (rank {peak.rank}, {peak.peak_method})"
            + (f"; launching process peak {fmt_bytes(result.launcher_peak_bytes)} (no KV)"
               if result.launcher_peak_bytes else ""), style="dim")
    yard = result.yardstick or next((r for r in result.rows if r.ran), None)
    if yard is not None:
        out_console.print(line("ids: ", styled(", ".join(map(str, yard.tokens)))))
        if yard.text is not None:
            out_console.print(line("text: ", styled(repr(yard.text))))
        elif result.random_weights:
            out_console.print("(random weights: the ids are not text)", style="dim")
    if result.checked_against == "nothing":
        out_console.print("one row ran: its tokens are not checked against anything (--reference off, or it did "
                          "not fit)", style="yellow")
    elif result.all_match and any(r.near_tie is not None for r in result.rows):
        ties = sum(r.near_tie is not None for r in result.rows)
        name = result.yardstick.name
        out_console.print(line((f"every row generated the {name}'s tokens", "bold green"),
                               f" or parted from them only at a near-tie of the {name}'s own logits ({ties} "
                               f"row{'s' if ties > 1 else ''}, above: consistent with rounding of {result.dtype})"))
    elif result.all_match:
        what = {"reference": "the reference's tokens", "one rank": "the one-rank row's tokens (no reference)"}.get(
            result.checked_against, "the same tokens (no reference: rows checked against each other)")
        out_console.print(line((f"all rows generated {what}", "bold green"),
                               f" ({result.new_tokens} of {result.new_tokens})"))
