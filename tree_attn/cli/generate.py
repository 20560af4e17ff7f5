"""``tree-attn generate``: greedy decoding of a real model with its KV cache sharded over ranks."""

from __future__ import annotations

from typing import Annotated

import typer

from ..commands.generate.setup import GenerateOptions
from .common import announce_setup, err_console, error, fmt_bytes, line, out_console, plan_name, ranks, report, styled
from .options import Backend, Device, Fanout, Json, Plan, Profile, Strategy, Timeout, WorldSize, count_option

DEFAULTS = GenerateOptions()

HELP = (
    "Greedy decoding of a Llama-family model (Llama, Qwen2, Mistral) with its KV cache paged and "
    "sharded over ranks, every layer's attention by tree attention.\n\n"
    "--model loads a local checkpoint folder (config.json, *.safetensors, a tokenizer if it has one; "
    "nothing is downloaded). Without --model a small Llama is built from a config with --seed: random "
    "weights, so the output is token ids, not text, and the prompt is --prompt-len random ids (or ids "
    "given as --prompt 1,2,3).\n\n"
    "One process (a child: the launching process computes nothing on a GPU) prefills the prompt, decodes "
    "the reference (transformers' own sdpa attention and cache) and the one-rank row (tree-attn's paged "
    "kernel); then the prefill KV is split over the ranks (rank r a contiguous slice, 16-token pages) and "
    "each strategy decodes the same "
    "tokens, the new tokens' KV going to the last rank. Every row must give the reference's tokens: "
    "exit 1 if one does not. Needs the \\[models] extra (Hugging Face transformers).\n\n"
    "Under torchrun (one node or several) it joins the job instead of spawning: every rank loads the model "
    "and prefills the prompt itself, keeps its slice, and rank 0 reports; across nodes the tree is planned "
    "from the node layout, as in run."
)


def generate_command(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", help="A local checkpoint folder of a Llama, Qwen2 or Mistral model.")] = DEFAULTS.model,
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
        "bf16; in 16 bits rounding may flip a near-tie between the reference and the ranks.")] = DEFAULTS.dtype,
    page_size: Annotated[int, count_option("--page-size", help="Tokens per KV page (1..256).")] = DEFAULTS.page_size,
    timeout: Timeout = DEFAULTS.timeout_s,
    profile_ref: Profile = DEFAULTS.profile,
    json_out: Json = False,
) -> None:
    from ..commands.generate.decode import run_generate
    from ..commands.generate.setup import plan_generate

    setup = plan_generate(GenerateOptions(
        model=model, preset=preset, layers=layers, seed=seed, prompt=prompt, prompt_len=prompt_len,
        new_tokens=new_tokens, max_len=max_len, world_size=world_size, strategy=strategy, fanout=fanout,
        plan=plan, device=device, backend=backend, dtype=dtype, page_size=page_size, timeout_s=timeout,
        profile=profile_ref,
    ))
    spec = setup.spec
    announce_setup(setup, (  # under torchrun every rank runs this: rank 0 speaks
        f"generating {spec.new_tokens} tokens after a {len(spec.prompt_ids):,}-token prompt over "
        f"{ranks(spec.world_size)} ({spec.backend}, {spec.dtype}); strategies: "
        f"{', '.join(plan_name(p.label, spec.world_size) if p else 'ring' for _, p in spec.plans)}"))
    say = lambda text: err_console.print(text, markup=False, style="dim")
    result = run_generate(spec, progress=say, tokenizer=setup.tokenizer)
    if result is None:  # a torchrun rank other than 0: rank 0 reports
        return
    result.profile = setup.profile
    result.prompt_text = setup.prompt_text
    report(result, render_generate, json_out)
    if not result.all_match:
        bad = [r.name for r in result.rows if not (r.matches_reference and r.ranks_agree)]
        error(f"{', '.join(bad)}: generated tokens differ from the reference's (or between ranks)")
        raise typer.Exit(1)


def render_generate(result) -> None:
    from rich import box
    from rich.table import Table

    table = Table(
        title=styled(f"tree-attn generate: {result.model}, {result.prompt_tokens:,}-token prompt, "
                     f"{ranks(result.world_size)}, {result.device} ({result.backend})"),
        title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
    )
    for col, just in (("decode", "left"), ("ranks", "right"), ("median", "right"), ("p95", "right"),
                      ("tokens/s", "right"), ("sent/rank", "right"), ("msgs", "right"), ("tokens", "left")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in result.rows:
        same = "reference" if r.name == "reference" else ("same" if r.matches_reference and r.ranks_agree else "DIFFER")
        table.add_row(styled(r.name), str(r.ranks), f"{1e3 * r.median_s:.2f} ms", f"{1e3 * r.p95_s:.2f} ms",
                      f"{r.tokens_per_s:.1f}", fmt_bytes(r.bytes_per_token), str(r.messages_per_token),
                      styled(same, None if same != "DIFFER" else "bold red"))
    out_console.print(table)
    out_console.print(
        f"per generated token (one decode step through all layers): latency on rank 0, bytes and messages each rank "
        f"sends (max over ranks); reference = transformers' sdpa attention and cache in one process, one rank = "
        f"tree-attn's paged kernel in one process; prefill {result.prefill_s:.1f} s in one process, its KV then split "
        f"{result.shard_sizes} tokens over the ranks, the new tokens' KV on rank {result.world_size - 1}",
        style="dim",
    )
    ref = result.rows[0]
    out_console.print(line("ids: ", styled(", ".join(map(str, ref.tokens)))))
    if ref.text is not None:
        out_console.print(line("text: ", styled(repr(ref.text))))
    elif result.random_weights:
        out_console.print("(random weights: the ids are not text)", style="dim")
    if result.all_match:
        out_console.print(line(("all rows generated the reference's tokens", "bold green"),
                               f" ({result.new_tokens} of {result.new_tokens})"))
