"""``tree-attn run``: tree-attention decoding across ranks, against the Ring baseline."""

from __future__ import annotations

import typer

from .common import err_console, notice, out_console, print_json

HELP = """Decode with a long KV cache sharded over ranks, with tree attention and the Ring baseline.

Without a GPU it spawns CPU ranks (gloo); with GPUs one rank per GPU (NCCL, RCCL on ROCm).
Under torchrun it joins the job instead of spawning. Each strategy runs warm-up and timed decode
steps; the table shows per-step latency (median, p95; a step lasts as long as its slowest rank),
bytes each rank sends per step, peak memory per rank, and the max abs error against a
single-process reference. Defaults: Llama-3.1-8B attention (32 query heads, 8 KV heads, head dim
128), batch 1, 65,536 tokens, 4 ranks on CPU.
"""


def register(app: typer.Typer) -> None:
    app.command("run", help=HELP)(run_command)


def run_command(
    world_size: int = typer.Option(None, "--world-size", "-w", help="Ranks (default: GPUs present, else 4 CPU ranks; torchrun's WORLD_SIZE under torchrun)."),
    seq_len: int = typer.Option(65536, "--seq-len", "-n", help="Total KV tokens, split over the ranks."),
    batch: int = typer.Option(1, "--batch", "-b", help="Sequences decoded together."),
    heads: int = typer.Option(32, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(8, "--kv-heads", help="KV heads (heads must be a multiple)."),
    head_dim: int = typer.Option(128, "--head-dim", help="Head dimension."),
    dtype: str = typer.Option("auto", "--dtype", help="fp32, fp16 or bf16 (auto: bf16 on GPUs, fp32 on CPU ranks)."),
    steps: int = typer.Option(8, "--steps", help="Timed decode steps per strategy."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed warm-up steps per strategy."),
    strategy: str = typer.Option("auto", "--strategy", "-s", help="Comma list of tree, allreduce, ring; auto = the profile's (or default) plan and ring."),
    fanout: int = typer.Option(None, "--fanout", "-k", help="Fan-out of the tree strategy (2..world size)."),
    backend: str = typer.Option("auto", "--backend", help="auto, gloo or nccl (auto: nccl on GPUs, gloo on CPU)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda: where the ranks compute."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random query and KV cache."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds a collective may wait for a peer before the run fails."),
    profile_ref: str = typer.Option(None, "--profile", "-p", help="A profile (path or built-in name) to take the plan and kernel configs from; default: the one saved for this machine's fingerprint, else built-in defaults."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
) -> None:
    from ..errors import ConfigError
    from ..reduce.plan import ReductionPlan, default_plan
    from ..runner.decode_run import RunSpec, run_decode
    from ..ranks.launch import gpu_count, torchrun_env

    trun = torchrun_env()
    n_gpus = gpu_count()
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda; got {device!r}")
    device_kind = ("cuda" if n_gpus > 0 else "cpu") if device == "auto" else device
    if device_kind == "cuda" and n_gpus == 0:
        raise ConfigError("--device cuda asked for, but no GPU is visible to torch")
    if world_size is None:
        world_size = trun.world_size if trun else (n_gpus if device_kind == "cuda" else 4)
    if device_kind == "cuda" and trun is None and world_size > n_gpus:
        raise ConfigError(f"world size {world_size} is larger than the {n_gpus} GPUs of this machine")
    if dtype == "auto":
        dtype = "bfloat16" if device_kind == "cuda" else "float32"
    from ..dtypes import parse_dtype

    dtype = parse_dtype(dtype)
    if device_kind == "cpu" and trun is None:
        notice(f"no GPU in use: spawning {world_size} CPU ranks (gloo)")

    names = _parse_strategies(strategy)
    profile, profile_text = _select_profile(profile_ref, world_size, device_kind)
    err_console.print(profile_text)
    plans = []
    for name in names:
        if name == "ring":
            plans.append(("ring", None))
        elif name == "allreduce":
            plans.append(("allreduce", ReductionPlan("allreduce")))
        elif name == "tree" and fanout is not None:
            plans.append(("tree", ReductionPlan("tree", fanout)))
        else:  # "tree" without a fan-out: the profile's plan, else the default
            plan = profile.plan if profile is not None else default_plan(world_size)
            plans.append((plan.strategy, plan))
    if fanout is not None and fanout > world_size and world_size > 1:
        raise ConfigError(f"--fanout {fanout} is larger than the world size {world_size}; use 2..{world_size}")
    from ..ranks.launch import resolve_backend

    spec = RunSpec(
        world_size=world_size,
        seq_len=seq_len,
        batch=batch,
        q_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        steps=steps,
        warmup=warmup,
        plans=tuple(plans),
        device_kind=device_kind,
        backend=resolve_backend(backend, device_kind),
        seed=seed,
        timeout_s=timeout,
        kernel_config=_kernel_config(profile, dtype, heads, kv_heads, head_dim, seq_len, world_size),
    )
    err_console.print(
        f"decoding B={batch} Hq={heads} Hkv={kv_heads} D={head_dim} {spec.dtype}, {seq_len:,} tokens over "
        f"{world_size} ranks ({spec.backend}); strategies: {', '.join(p.label if p else 'ring' for _, p in plans)}"
    )
    result = run_decode(spec)
    if result is None:  # a non-zero torchrun rank: rank 0 reports
        return
    result.profile = profile_text
    if json_out:
        print_json(result.to_dict())
    else:
        render_run(result)
    if any(r.max_abs_err != r.max_abs_err or r.max_abs_err > _error_limit(spec.dtype) for r in result.results):
        err_console.print("[bold red]error:[/bold red] a strategy's result differs from the reference beyond tolerance")
        raise typer.Exit(1)


def _select_profile(ref: str | None, world_size: int, device_kind: str):
    """The profile to run under and a line saying which (and why). Raises ProfileError when an
    explicitly given profile is for another machine."""
    from ..errors import ProfileError
    from ..profiles import builtin_profile_for, check_profile_for, find_saved_profile, load_profile, open_profile
    from ..topology import host_topology, probe_topology
    from .common import warn

    if device_kind == "cpu":
        topo = host_topology(world_size)
    else:
        topo = probe_topology("auto")
        if len(topo) != world_size:
            topo = None  # a subset of the GPUs: no whole-machine profile applies
    if ref is not None:
        profile = open_profile(ref)
        if topo is None:
            raise ProfileError(f"profile {profile.name!r} is for {profile.machine.world_size} devices; this run uses {world_size}")
        for w in check_profile_for(profile, topo):
            warn(w)
        return profile, f"using profile {profile.name} ({profile.origin}) from {ref}"
    if topo is None:
        return None, f"no profile: the run uses {world_size} of the GPUs; built-in defaults"
    saved = find_saved_profile(topo.fingerprint)
    if saved is not None:
        profile = load_profile(saved)
        for w in check_profile_for(profile, topo):
            warn(w)
        return profile, f"using the profile saved for this machine ({profile.name}, {profile.origin}) from {saved}"
    builtin = builtin_profile_for(topo)
    if builtin is not None:
        return builtin, f"using built-in profile {builtin.name} (model-derived, not measured); `tree-attn tune` measures this machine"
    return None, (f"no profile for this machine (fingerprint {topo.fingerprint}): built-in defaults; "
                  "`tree-attn tune` writes one")


def _kernel_config(profile, dtype: str, heads: int, kv_heads: int, head_dim: int, seq_len: int, world_size: int):
    """The profile's kernel config for this shape (largest shard), as a dict, or None."""
    if profile is None:
        return None
    found = profile.kernel_config_for(dtype, head_dim, heads // kv_heads, -(-seq_len // world_size))
    return found[0].to_dict() if found else None


def _error_limit(dtype: str) -> float:
    # Inputs are unit-variance; the fp32 reference and the distributed result differ only by
    # rounding order. Low-precision outputs are rounded once to their dtype (bf16: 2^-8 relative).
    return {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}[dtype]


def _parse_strategies(text: str) -> list[str]:
    from ..errors import ConfigError
    from ..runner.decode_run import STRATEGY_NAMES

    if text == "auto":
        return ["tree", "ring"]
    names = [t.strip() for t in text.split(",") if t.strip()]
    for n in names:
        if n not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {n!r}; choose from {', '.join(STRATEGY_NAMES)} (comma-separated) or auto")
    if len(set(names)) != len(names):
        raise ConfigError(f"strategy listed twice in {text!r}")
    return names


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render_run(result) -> None:
    from rich.table import Table

    cfg = result.config if hasattr(result, "config") else result.spec
    table = Table(
        title=f"tree-attn run: {cfg['seq_len']:,} tokens over {cfg['world_size']} ranks, {result.device} ({result.backend})",
        title_justify="left",
    )
    for col, just in (
        ("strategy", "left"),
        ("median", "right"),
        ("p95", "right"),
        ("sent/rank", "right"),
        ("msgs", "right"),
        ("peak mem", "right"),
        ("max err", "right"),
    ):
        table.add_column(col, justify=just)
    for r in result.results:
        table.add_row(
            r.plan,
            f"{r.step_ms_median:.2f} ms",
            f"{r.step_ms_p95:.2f} ms",
            _fmt_bytes(r.bytes_sent_per_step),
            str(r.messages_per_step),
            _fmt_bytes(r.peak_mem_bytes),
            f"{r.max_abs_err:.2e}",
        )
    out_console.print(table)
    out_console.print(
        "per decode step: median / p95 latency (slowest rank), bytes and messages each rank sends (max over ranks), "
        "peak memory of a rank (max), max abs error against the single-process reference",
        style="dim",
    )
    if result.speedup_vs_ring is not None:
        out_console.print(f"tree attention is [bold]{result.speedup_vs_ring:.1f}x[/bold] faster per decode step than ring")
