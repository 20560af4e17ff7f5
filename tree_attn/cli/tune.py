"""``tree-attn tune``: measure this machine, choose the reduction plan and kernel configs, write a profile."""

from __future__ import annotations

import typer

from .common import err_console, notice, out_console, print_json, warn

HELP = """Tune tree attention for this machine and write a profile that `tree-attn run` uses.

Probes the fabric (or reads --topology FILE), then (a) on GPUs searches the Triton kernel's config
space per shape bucket, pruned by the napkin performance model, timing each survivor (warm-up,
CUDA events, median); (b) times every candidate reduction plan (all-reduce, trees of fan-out
2/4/8/world, the topology's hierarchical trees) at the decode message size across all ranks,
each iteration as slow as its slowest rank; rank 0 decides and broadcasts the choice. The
profile goes to the user's cache folder, named by the fabric fingerprint, or to --output.
With a --topology of another machine, nothing can be timed here: the profile is model-derived.
"""


def register(app: typer.Typer) -> None:
    app.command("tune", help=HELP)(tune_command)


def tune_command(
    topology_file: str = typer.Option(None, "--topology", help="A topology YAML or a recorded dump (nvidia-smi topo -m, amd-smi topology...) instead of probing."),
    world_size: int = typer.Option(None, "--world-size", "-w", help="Ranks (default: the GPUs, else 4 CPU ranks)."),
    output: str = typer.Option(None, "--output", "-o", help="Profile path (default: the cache folder, named by fingerprint)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing profile."),
    quick: bool = typer.Option(False, "--quick", help="A small budget: few iterations, two shard buckets (under a minute on CPU ranks)."),
    batch: int = typer.Option(1, "--batch", "-b", help="Batch of the decode message size."),
    heads: int = typer.Option(32, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(8, "--kv-heads", help="KV heads."),
    head_dim: int = typer.Option(128, "--head-dim", help="Head dimension."),
    dtype: str = typer.Option("bf16", "--dtype", help="KV dtype the kernel is tuned for (GPUs)."),
    backend: str = typer.Option("auto", "--backend", help="auto, gloo or nccl."),
    timeout: float = typer.Option(120.0, "--timeout", help="Seconds a collective may wait for a peer."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (the profile and where it went)."),
) -> None:
    from ..errors import ConfigError
    from ..dtypes import parse_dtype
    from ..ranks.launch import gpu_count, resolve_backend

    if heads % kv_heads:
        raise ConfigError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    n_gpus = gpu_count()
    device_kind = "cuda" if n_gpus > 0 else "cpu"
    topo = _topology(topology_file, world_size, device_kind, n_gpus)
    world = len(topo)
    if world_size is not None and world_size != world:
        raise ConfigError(f"--world-size {world_size} does not match the topology's {world} devices")
    local_kind = _kind_of(topo)
    measurable = local_kind == device_kind and (device_kind == "cpu" or world <= n_gpus)
    from ..runner.tune import TuneOptions

    options = TuneOptions(
        world_size=world,
        device_kind=device_kind,
        backend=resolve_backend(backend, device_kind),
        batch=batch,
        q_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=parse_dtype(dtype),
        quick=quick,
        timeout_s=timeout,
    )
    if measurable:
        profile = _measure(topo, options)
    else:
        notice(f"the topology ({world} x {topo.devices[0].name}) is not this machine: nothing can be timed here, "
               "so the profile is model-derived (origin: model)")
        profile = _model_only(topo, options)
    from ..profiles import profile_path_for, save_profile

    path = output or str(profile_path_for(topo.fingerprint))
    save_profile(profile, path, force=force)
    if json_out:
        print_json({"profile_path": path, "profile": profile.to_dict()})
    else:
        _render(profile, path)


def _kind_of(topo) -> str:
    from ..profiles.schema import device_kind_of

    kind = device_kind_of(topo)
    return "cuda" if kind in ("cuda", "rocm") else "cpu"


def _topology(topology_file, world_size, device_kind, n_gpus):
    from ..topology import host_topology, load_expected, probe_topology

    if topology_file:
        return load_expected(topology_file)
    if device_kind == "cpu":
        n = world_size or 4
        notice(f"no GPU: tuning for {n} CPU ranks (gloo)")
        return host_topology(n)
    topo = probe_topology("auto")
    for note in topo.notes:
        notice(note)
    return topo


def _measure(topo, options):
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..profiles import (
        KernelBucket,
        KernelSection,
        Machine,
        PlanCandidate,
        Profile,
        Reduction,
        current_versions,
        utc_now,
    )
    from ..profiles.plan_model import decode_message_bytes
    from ..reduce.hier_plan import candidate_plans
    from ..runner.tune import tune_kernels, tune_plans

    candidates = candidate_plans(options.world_size, topo.hierarchy)
    buckets = []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console, transient=False) as bar:
        if options.device_kind == "cuda":
            t = bar.add_task(f"kernel configs: {len(options.shard_buckets)} shard buckets", total=None)
            buckets = tune_kernels(options, progress=lambda m: bar.console.print(f"  {m}"))
            bar.update(t, description=f"kernel configs: {len(buckets)} buckets tuned", completed=1, total=1)
        t = bar.add_task(f"reduction plans: timing {len(candidates)} candidates on {options.world_size} ranks", total=None)
        plans = tune_plans(options, candidates)
        bar.update(t, description=f"reduction plans: {plans.chosen.label} chosen", completed=1, total=1)
    reduction = Reduction(
        plan=plans.chosen,
        chosen_by="measured",
        message_bytes=decode_message_bytes(options.batch, options.q_heads, options.head_dim),
        candidates=[
            PlanCandidate(label=t.plan.label, plan=t.plan, chosen_by="measured", median_us=t.median_us,
                          p95_us=t.p95_us, selected=t.plan == plans.chosen)
            for t in plans.timings
        ],
    )
    kernel = KernelSection(
        device_spec=topo.devices[0].name if buckets else None,
        buckets=[
            KernelBucket(dtype=b.dtype, head_dim=b.head_dim, group=b.group, max_shard_len=b.max_shard_len,
                         config=b.chosen.config, chosen_by="measured", time_us=b.chosen.median_us, gbps=b.chosen.gbps,
                         predicted_us=b.chosen.predicted_us, candidates_tried=len(b.timings))
            for b in buckets
        ],
    )
    notes = [] if buckets else ["CPU ranks run the torch reference path: no kernel configs to tune"]
    return Profile(
        name=f"tuned-{topo.fingerprint}",
        created=utc_now(),
        origin="measured",
        machine=Machine.from_topology(topo),
        reduction=reduction,
        kernel=kernel,
        versions=current_versions(),
        description=f"tuned on {options.world_size} x {topo.devices[0].name}" + (" (--quick)" if options.quick else ""),
        notes=notes,
        topology=topo,
    )


def _model_only(topo, options):
    from ..profiles import KernelSection, Machine, PlanCandidate, Profile, Reduction, current_versions, utc_now
    from ..profiles.plan_model import decode_message_bytes, predict_plan_us
    from ..reduce.hier_plan import candidate_plans

    msg = decode_message_bytes(options.batch, options.q_heads, options.head_dim)
    cands = candidate_plans(len(topo), topo.hierarchy)
    predicted = [predict_plan_us(p, topo, msg) for p in cands]
    best = min(range(len(cands)), key=lambda i: predicted[i])
    reduction = Reduction(
        plan=cands[best],
        chosen_by="model",
        message_bytes=msg,
        candidates=[PlanCandidate(label=p.label, plan=p, chosen_by="model", predicted_us=us, selected=i == best)
                    for i, (p, us) in enumerate(zip(cands, predicted))],
    )
    return Profile(
        name=f"model-{topo.fingerprint}",
        created=utc_now(),
        origin="model",
        machine=Machine.from_topology(topo),
        reduction=reduction,
        kernel=KernelSection(),
        versions=current_versions(driver=None),
        description=f"model-derived for {len(topo)} x {topo.devices[0].name} from {topo.source}",
        notes=["not measured: derived from the topology and the plan cost model; tune on the machine itself to measure"],
        topology=topo,
    )


def _render(profile, path: str) -> None:
    from rich.table import Table

    red = profile.reduction
    table = Table(title=f"reduction plans ({red.chosen_by}), message {red.message_bytes} B per rank", title_justify="left")
    for col in ("", "plan", "median", "p95", "predicted"):
        table.add_column(col, justify="left" if col in ("", "plan") else "right")

    def us(x):
        return "-" if x is None else f"{x:,.0f} us"

    for c in sorted(red.candidates, key=lambda c: (c.median_us if c.median_us is not None else c.predicted_us or 0)):
        table.add_row("[bold green]*[/]" if c.selected else "", c.label, us(c.median_us), us(c.p95_us), us(c.predicted_us))
    out_console.print(table)
    if profile.kernel.buckets:
        kt = Table(title="kernel configs per shard bucket (measured)", title_justify="left")
        for col in ("bucket", "config", "time", "GB/s", "tried"):
            kt.add_column(col)
        for b in profile.kernel.buckets:
            kt.add_row(f"{b.dtype} D={b.head_dim} G={b.group} N<={b.max_shard_len:,}", b.config.describe(),
                       us(b.time_us), f"{b.gbps:,.0f}" if b.gbps else "-", str(b.candidates_tried))
        out_console.print(kt)
    for note in profile.notes:
        if "not measured" in note:
            warn(note)
    out_console.print(f"profile written to [bold]{path}[/] (plan: {red.plan.label})")
