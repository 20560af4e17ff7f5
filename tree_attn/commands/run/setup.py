"""Resolve the options of ``tree-attn run`` into a :class:`RunSpec`: where the ranks compute, how
many there are, the dtype, the strategies and their plans, the profile and its kernel config.

The CLI parses arguments and renders; everything that looks at the machine (GPUs visible to
torch, torchrun's environment, the topology, saved and built-in profiles) happens here. Nothing is
printed: what a user should read comes back as ``notices`` and ``warnings`` of the
:class:`RunSetup`, and which profile was chosen as a :class:`ProfileChoice`. No torch import at
module level (``tree-attn --help`` imports this package's CLI without torch).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError, ProfileError

if TYPE_CHECKING:  # pragma: no cover
    from ...profiles import Profile
    from ...topology import Topology
    from .decode import RunResult, RunSpec

DEVICES = ("auto", "cpu", "cuda")

# How a ProfileChoice was made.
CHOSEN_EXPLICIT = "explicit"  # --profile NAME|PATH
CHOSEN_SAVED = "saved"  # the profile saved for this machine's fingerprint
CHOSEN_BUILTIN = "builtin"  # a built-in profile matching this machine
CHOSEN_DEFAULT = "default"  # no profile: built-in defaults

# Max abs error of a run's output against the single-process fp32 reference. Inputs are
# unit-variance; the fp32 reference and the distributed result differ only by rounding order.
# Low-precision outputs are rounded once to their dtype (bf16: 2^-8 relative).
ERROR_LIMITS = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


@dataclass(frozen=True)
class ProfileChoice:
    """Which profile a run uses and why.

    ``name``/``origin``: the profile's (None when running on built-in defaults); ``path``: the
    file it came from (a built-in's path inside the package; None for defaults); ``chosen_by``:
    ``explicit``, ``saved``, ``builtin`` or ``default``; ``text``: one line for humans.
    """

    name: str | None
    origin: str | None
    path: str | None
    chosen_by: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "origin": self.origin, "path": self.path, "chosen_by": self.chosen_by, "text": self.text}


@dataclass(frozen=True)
class RunOptions:
    """What the user asked ``run`` for; ``None`` and ``"auto"`` mean "decide from the machine"."""

    world_size: int | None = None
    seq_len: int = 65536
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "auto"
    steps: int = 8
    warmup: int = 2
    strategy: str = "auto"
    fanout: int | None = None
    backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    timeout_s: float = 120.0
    profile: str | None = None
    cuda_graph: bool = True


@dataclass(frozen=True)
class RunSetup:
    """A resolved run: the spec to decode, the profile it came from, what to tell the user."""

    spec: "RunSpec"
    profile: ProfileChoice
    under_torchrun: bool = False
    notices: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    rank: int = 0  # this process's rank under torchrun (only rank 0 prints), else 0


# Per CPU process: the interpreter and torch (the peak-memory caption measures about 240 MiB).
PROCESS_BYTES = 300 * 2**20


def host_bytes_needed(world_size: int, seq_len: int, batch: int, kv_heads: int, head_dim: int, dtype: str,
                      ring: bool, q_heads: int = 0) -> int:
    """Host memory a run of CPU ranks needs, roughly: per rank its K and V shard (made in
    float32, then cast), ring's shards in flight (two more), the query and a few float32 states of
    ``[B, Hq, D + 1]`` (output, messages, merges: counted as 8), and a process; the parent's
    reference holds one shard (float32) at a time and the same states."""
    from ...dtypes import torch_dtype

    elem = torch_dtype(dtype).itemsize
    shard = batch * -(-seq_len // world_size) * kv_heads * head_dim  # elements of K (or V) on one rank
    states = batch * q_heads * (head_dim * elem + 8 * 4 * (head_dim + 1))
    per_rank = 2 * shard * (4 + elem * (3 if ring else 1)) + states + PROCESS_BYTES
    parent = 2 * shard * 4 + states + PROCESS_BYTES
    return world_size * per_rank + parent


def check_host_memory(world_size: int, seq_len: int, batch: int, kv_heads: int, head_dim: int, dtype: str,
                      ring: bool, q_heads: int = 0) -> None:
    """Refuse a run of CPU ranks whose KV cache cannot fit in this machine's available memory,
    before any rank allocates it."""
    from ...launch.memory import available_host_bytes

    need = host_bytes_needed(world_size, seq_len, batch, kv_heads, head_dim, dtype, ring, q_heads)
    have = available_host_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"--seq-len {seq_len:,} (batch {batch}, {q_heads or '?'}/{kv_heads} heads, head dim {head_dim}, {dtype}) over "
            f"{world_size} CPU ranks needs about {need / 2**30:,.1f} GiB (K and V shards, "
            f"{'ring shards in flight, ' if ring else ''}query and states, one process each); this machine has "
            f"{have / 2**30:,.1f} GiB available: use a smaller --seq-len, --batch or --heads"
        )


def resolve_device_kind(device: str) -> tuple[str, int]:
    """``(device kind, visible GPUs)`` for ``device`` = auto | cpu | cuda.

    ``auto`` is ``cuda`` when torch sees a GPU (CUDA or ROCm), else ``cpu``. ``cuda`` without a
    visible GPU is a :class:`ConfigError`.
    """
    from ...launch import spawn as launch

    if device not in DEVICES:
        raise ConfigError(f"--device must be auto, cpu or cuda; got {device!r}")
    n_gpus = launch.gpu_count()
    kind = ("cuda" if n_gpus > 0 else "cpu") if device == "auto" else device
    if kind == "cuda" and n_gpus == 0:
        raise ConfigError("--device cuda asked for, but no GPU is visible to torch")
    return kind, n_gpus


def parse_strategies(text: str) -> list[str]:
    """``"tree,ring"`` -> ``["tree", "ring"]``; ``auto`` is the profile's (or default) plan and ring."""
    from .decode import STRATEGY_NAMES

    if text == "auto":
        return ["tree", "ring"]
    names = [t.strip() for t in text.split(",") if t.strip()]
    for n in names:
        if n not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {n!r}; choose from {', '.join(STRATEGY_NAMES)} (comma-separated) or auto")
    if len(set(names)) != len(names):
        raise ConfigError(f"strategy listed twice in {text!r}")
    return names


def build_plans(names: list[str], fanout: int | None, world_size: int, profile: "Profile | None") -> tuple:
    """``(strategy, ReductionPlan | None)`` pairs for :class:`RunSpec`: ``tree`` without a fan-out
    takes the profile's plan (else the default plan), ``ring`` has no plan."""
    from ...reduce.plan import ReductionPlan, default_plan

    plans: list[tuple[str, ReductionPlan | None]] = []
    for name in names:
        if name == "ring":
            plans.append(("ring", None))
        elif name == "allreduce":
            plans.append(("allreduce", ReductionPlan("allreduce")))
        elif fanout is not None:
            plans.append(("tree", ReductionPlan("tree", fanout)))
        else:
            plan = profile.plan if profile is not None else default_plan(world_size)
            plans.append((plan.strategy, plan))
    if fanout is not None and fanout > world_size and world_size > 1:
        raise ConfigError(f"--fanout {fanout} is larger than the world size {world_size}; use 2..{world_size}")
    return tuple(plans)


def kernel_config_for(profile: "Profile | None", dtype: str, heads: int, kv_heads: int, head_dim: int,
                      seq_len: int, world_size: int) -> dict | None:
    """The profile's kernel config for this shape (the largest shard's bucket), as a dict, or None."""
    if profile is None:
        return None
    found = profile.kernel_config_for(dtype, head_dim, heads // kv_heads, -(-seq_len // world_size))
    return found[0].to_dict() if found else None


def _run_topology(world_size: int, device_kind: str) -> tuple["Topology | None", str | None]:
    """The topology the run's ranks form, or ``(None, why)`` when no whole-machine profile applies."""
    from ...topology import host_topology, probe_topology

    if device_kind == "cpu":
        return host_topology(world_size), None
    topo = probe_topology("auto")
    if topo.source == "host":
        return None, "the GPUs could not be probed (NVML / AMD SMI unavailable)"
    if len(topo) != world_size:
        return None, f"the run uses {world_size} of the {len(topo)} GPUs"
    return topo, None


def _where(ref: str) -> str | None:
    """The file a ``--profile`` reference names (as :func:`profiles.open_profile` resolves it)."""
    from ...profiles import find_saved_profile, list_builtin_profiles, list_saved_profiles
    from ...profiles.builtin import builtin_path

    if os.path.exists(ref):
        return ref
    name = ref.removeprefix("builtin:")
    if name in list_builtin_profiles():
        return builtin_path(name)
    try:
        saved = find_saved_profile(ref)
    except ProfileError:
        saved = None
    if saved is not None:
        return str(saved)
    for entry in list_saved_profiles():
        if entry.profile is not None and entry.profile.name == ref:
            return entry.path
    return ref


def _saved_for_other_sizes(topo: "Topology", device_kind: str) -> str:
    """`` ; the saved profile X is for N ranks ...`` when profiles saved for this kind of device
    exist, but for another number of ranks (a tune for 4 ranks does not serve a run of 2)."""
    from ...profiles import list_saved_profiles

    n = len(topo)
    others = [e for e in list_saved_profiles()
              if e.profile is not None and e.profile.machine.world_size != n
              and e.profile.machine.device_kind == ("cpu" if device_kind == "cpu" else e.profile.machine.device_kind)
              and e.profile.machine.device_name == topo.devices[0].name]
    if not others:
        return ""
    sizes = ", ".join(sorted({str(e.profile.machine.world_size) for e in others}, key=int))
    names = ", ".join(e.profile.name for e in others[:3])
    device = " --device cpu" if device_kind == "cpu" else ""
    return (f"; the saved profile{'s' if len(others) > 1 else ''} {names} {'are' if len(others) > 1 else 'is'} for "
            f"{sizes} ranks, not {n}: `tree-attn tune{device} -w {n}` writes one for {n}")


def select_profile(ref: str | None, world_size: int, device_kind: str) -> tuple["Profile | None", ProfileChoice, list[str]]:
    """The profile to run under, how it was chosen, and warnings (versions that differ).

    ``--profile`` first (a ProfileError when it is for another machine), then the profile saved
    for this machine's fingerprint, then a matching built-in profile, else none (defaults).
    """
    from ...profiles import builtin_profile_for, check_profile_for, find_saved_profile, load_profile, open_profile
    from ...profiles.builtin import builtin_path

    topo, why_none = _run_topology(world_size, device_kind)
    if ref is not None:
        profile = open_profile(ref)
        if topo is None:
            raise ProfileError(
                f"profile {profile.name!r} is for {profile.machine.world_size} devices; this run cannot use it: {why_none}"
            )
        warnings = check_profile_for(profile, topo)
        return profile, ProfileChoice(
            profile.name, profile.origin, _where(ref), CHOSEN_EXPLICIT,
            f"using profile {profile.name} ({profile.origin}) from {ref}",
        ), warnings
    if topo is None:
        return None, ProfileChoice(None, None, None, CHOSEN_DEFAULT, f"no profile: {why_none}; built-in defaults"), []
    saved = find_saved_profile(topo.fingerprint)
    if saved is not None:
        profile = load_profile(saved)
        warnings = check_profile_for(profile, topo)
        return profile, ProfileChoice(
            profile.name, profile.origin, str(saved), CHOSEN_SAVED,
            f"using the profile saved for this machine ({profile.name}, {profile.origin}) from {saved}",
        ), warnings
    builtin = builtin_profile_for(topo)
    if builtin is not None:
        return builtin, ProfileChoice(
            builtin.name, builtin.origin, builtin_path(builtin.name), CHOSEN_BUILTIN,
            f"using built-in profile {builtin.name} (model-derived, not measured); `tree-attn tune` measures this machine",
        ), []
    other = _saved_for_other_sizes(topo, device_kind)
    return None, ProfileChoice(
        None, None, None, CHOSEN_DEFAULT,
        f"no profile for this machine (fingerprint {topo.fingerprint}): built-in defaults"
        + (other or "; `tree-attn tune` writes one"),
    ), []


def multinode_plan(layout, device_kind: str, fanout: int | None) -> tuple:
    """``(plan, text)``: the hierarchical tree of a job over ``layout.nodes`` alike nodes: each
    node's own hierarchy (its probed GPUs, or CPU ranks), then the network joining the nodes, the
    slowest link class, so one message per node crosses it each way."""
    from ...reduce.hier_plan import hierarchical_plan
    from ...topology import host_topology, probe_topology
    from ...topology.nodes import multinode_topology

    g = layout.ranks_per_node
    node = host_topology(g) if device_kind == "cpu" else probe_topology("auto")
    if len(node) != g:
        # This node's probe does not show one device per local rank: plan its ranks as one group.
        node = host_topology(g, note=f"{len(node)} devices probed for {g} local ranks")
    topo = multinode_topology(node, layout.nodes)
    plan = hierarchical_plan(topo.hierarchy, fanout or 2)
    text = (f"no profile: {layout.nodes} nodes x {g} ranks (torchrun); tree {plan.label} planned from the nodes, "
            "the network as the slowest link class")
    return plan, text


def choose_plans(profile_ref: str | None, names: list[str], fanout: int | None, world_size: int, device_kind: str,
                 layout=None) -> tuple:
    """``(profile, ProfileChoice, warnings, plans)`` for the strategies ``names``.

    One machine: the profile (``--profile``, saved, built-in or none) gives the tree's plan and the
    kernel configs. A torchrun job over several nodes (``layout.nodes > 1``): a profile describes
    one machine, so ``--profile`` is refused and the tree is planned from the node layout.
    """
    if layout is not None and layout.nodes > 1:
        if profile_ref is not None:
            raise ConfigError(f"--profile describes one machine; this torchrun job spans {layout.nodes} nodes: omit "
                              "--profile (the tree is planned from the nodes, the network as the slowest link)")
        plan, text = multinode_plan(layout, device_kind, fanout)
        plans = tuple((n, plan if n == "tree" else p) for n, p in build_plans(names, None, world_size, None))
        return None, ProfileChoice(None, None, None, CHOSEN_DEFAULT, text), [], plans
    profile, choice, warnings = select_profile(profile_ref, world_size, device_kind)
    return profile, choice, warnings, build_plans(names, fanout, world_size, profile)


def plan_run(options: RunOptions) -> RunSetup:
    """Resolve ``options`` against this machine into a :class:`RunSetup`.

    Raises ConfigError for bad options (naming the option), ProfileError for a profile that does
    not apply. Nothing is launched.
    """
    from ...dtypes import parse_dtype
    from ...launch.spawn import (
        check_cpu_ranks, check_timeout, oversubscription_warning, resolve_backend, torchrun_env, torchrun_layout,
        torchrun_rendezvous,
    )
    from ...topology.host import default_cpu_ranks
    from .decode import RunSpec

    # Sizes first: nothing below may build anything in proportion to a bad number.
    check_timeout(options.timeout_s)
    device_kind, n_gpus = resolve_device_kind(options.device)
    trun = torchrun_env(device_kind, options.backend)
    if trun is not None:
        torchrun_rendezvous(trun)  # MASTER_ADDR / MASTER_PORT, before anything is printed
    world_size = options.world_size
    if world_size is None:
        world_size = trun.world_size if trun else (n_gpus if device_kind == "cuda" else default_cpu_ranks())
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"--world-size must be an integer >= 1; got {world_size!r}")
    if device_kind == "cuda" and trun is None and world_size > n_gpus:
        raise ConfigError(f"world size {world_size} is larger than the {n_gpus} GPUs of this machine")
    if device_kind == "cpu" and trun is None:
        check_cpu_ranks(world_size)
    dtype = options.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device_kind == "cuda" else "float32"
    dtype = parse_dtype(dtype)
    backend = resolve_backend(options.backend, device_kind)
    names = parse_strategies(options.strategy)
    notices: list[str] = []
    run_warnings: list[str] = []
    if device_kind == "cpu" and trun is None:
        why = "no GPU in use" if options.device == "auto" else "--device cpu"
        notices.append(f"{why}: spawning {world_size} CPU rank{'s' if world_size != 1 else ''} (gloo)")
        crowded = oversubscription_warning(world_size)
        if crowded:
            run_warnings.append(crowded)

    layout = torchrun_layout(trun) if trun is not None else None
    profile, choice, warnings, plans = choose_plans(options.profile, names, options.fanout, world_size, device_kind, layout)
    warnings = run_warnings + list(warnings)
    spec = RunSpec(
        world_size=world_size,
        seq_len=options.seq_len,
        batch=options.batch,
        q_heads=options.heads,
        kv_heads=options.kv_heads,
        head_dim=options.head_dim,
        dtype=dtype,
        steps=options.steps,
        warmup=options.warmup,
        plans=plans,
        device_kind=device_kind,
        backend=backend,
        seed=options.seed,
        timeout_s=options.timeout_s,
        cuda_graph=options.cuda_graph,
        nodes=layout.nodes if layout is not None else 1,
    )  # validates the sizes (positive heads, ...) before anything computes with them
    if device_kind == "cpu" and trun is None:
        check_host_memory(world_size, spec.seq_len, spec.batch, spec.kv_heads, spec.head_dim, dtype, "ring" in names,
                          spec.q_heads)
    spec = dataclasses.replace(spec, kernel_config=kernel_config_for(
        profile, dtype, options.heads, options.kv_heads, options.head_dim, options.seq_len, world_size))
    return RunSetup(spec=spec, profile=choice, under_torchrun=trun is not None,
                    notices=tuple(notices), warnings=tuple(warnings), rank=trun.rank if trun else 0)


def error_limit(dtype: str) -> float:
    """Max abs error of a run's output against the reference, by the run's dtype."""
    from ...dtypes import parse_dtype

    return ERROR_LIMITS[parse_dtype(dtype)]


def strategies_beyond_tolerance(result: "RunResult", dtype: str) -> list[str]:
    """Labels of the strategies whose output differs from the reference beyond :func:`error_limit`
    (NaN included)."""
    limit = error_limit(dtype)
    return [r.plan for r in result.results if not r.max_abs_err <= limit]


__all__ = [
    "DEVICES", "ERROR_LIMITS", "ProfileChoice", "RunOptions", "RunSetup",
    "resolve_device_kind", "parse_strategies", "build_plans", "kernel_config_for", "select_profile",
    "plan_run", "error_limit", "strategies_beyond_tolerance",
]
