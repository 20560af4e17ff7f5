"""The plans a job runs: the profile they come from (``--profile``, the one saved for this
machine, a built-in one, or none), or, for a torchrun job over several nodes, the node layout; the
strategies asked for; and the profile's kernel config for the job's shape.

Used by :func:`tree_attn.launch.setup.resolve_launch` only; nothing is printed (the choice comes
back as a :class:`ProfileChoice` and warnings). No torch import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ProfileError

if TYPE_CHECKING:  # pragma: no cover
    from ..kernels.config import DecodeConfig
    from ..profiles import Profile
    from ..topology import Topology
    from .env import NodeLayout

STRATEGY_NAMES = ("tree", "allreduce", "ring")
# The tree's shape (``--plan``): ``auto`` the profile's plan (one machine) or the hierarchical tree
# of the node layout (a torchrun job over several nodes); ``hier`` the hierarchical tree of the
# topology (the node layout across nodes); ``flat`` a k-ary tree over the ranks in rank order,
# whatever the topology (the comparison a hierarchical plan is measured against).
PLAN_SHAPES = ("auto", "hier", "flat")

# How a ProfileChoice was made.
CHOSEN_EXPLICIT = "explicit"  # --profile NAME|PATH
CHOSEN_SAVED = "saved"  # the profile saved for this machine's fingerprint
CHOSEN_BUILTIN = "builtin"  # a built-in profile matching this machine
CHOSEN_DEFAULT = "default"  # no profile: built-in defaults


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
        return {"name": self.name, "origin": self.origin, "path": self.path, "chosen_by": self.chosen_by,
                "text": self.text}


def parse_strategies(text: str) -> list[str]:
    """``"tree,ring"`` -> ``["tree", "ring"]``; ``auto`` is the profile's (or default) plan and ring.
    An empty list is refused: a job decodes with at least one strategy."""
    if text == "auto":
        return ["tree", "ring"]
    names = [t.strip() for t in text.split(",") if t.strip()]
    for n in names:
        if n not in STRATEGY_NAMES:
            raise ConfigError(f"unknown strategy {n!r}; choose from {', '.join(STRATEGY_NAMES)} (comma-separated) "
                              "or auto")
    if len(set(names)) != len(names):
        raise ConfigError(f"strategy listed twice in {text!r}")
    if not names:
        raise ConfigError("at least one strategy is needed")
    return names


def build_plans(names: list[str], fanout: int | None, world_size: int, profile: Profile | None) -> tuple:
    """``(strategy, ReductionPlan | None)`` pairs of a job: ``tree`` without a fan-out
    takes the profile's plan (else the default plan), ``ring`` has no plan."""
    from ..reduce.plan import ReductionPlan, default_plan

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
    if fanout is not None and fanout > world_size > 1:
        raise ConfigError(f"--fanout {fanout} is larger than the world size {world_size}; use 2..{world_size}")
    return tuple(plans)


def kernel_config_for(profile: Profile | None, dtype: str, heads: int, kv_heads: int, head_dim: int,
                      seq_len: int, world_size: int) -> DecodeConfig | None:
    """The profile's kernel config for this shape (the bucket of the largest shard), or None."""
    if profile is None:
        return None
    found = profile.kernel_config_for(dtype, head_dim, heads // kv_heads, -(-seq_len // world_size))
    return found[0] if found else None


def _run_topology(world_size: int, device_kind: str) -> tuple[Topology | None, str | None]:
    """The topology the run's ranks form, or ``(None, why)`` when no whole-machine profile applies."""
    from ..topology import host_topology, probe_topology

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
    from ..profiles import find_saved_profile, list_builtin_profiles, list_saved_profiles
    from ..profiles.builtin import builtin_path

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


def _saved_for_other_sizes(topo: Topology, device_kind: str) -> str:
    """`` ; the saved profile X is for N ranks ...`` when profiles saved for this kind of device
    exist, but for another number of ranks (a tune for 4 ranks does not serve a run of 2)."""
    from ..profiles import list_saved_profiles

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


def select_profile(ref: str | None, world_size: int,
                   device_kind: str) -> tuple[Profile | None, ProfileChoice, list[str]]:
    """The profile to run under, how it was chosen, and warnings (versions that differ).

    ``--profile`` first (a ProfileError when it is for another machine), then the profile saved
    for this machine's fingerprint, then a matching built-in profile, else none (defaults).
    """
    from ..profiles import builtin_profile_for, check_profile_for, find_saved_profile, load_profile, open_profile
    from ..profiles.builtin import builtin_path

    topo, why_none = _run_topology(world_size, device_kind)
    if ref is not None:
        profile = open_profile(ref)
        if topo is None:
            raise ProfileError(
                f"profile {profile.name!r} is for {profile.machine.world_size} devices; this run cannot use it: "
                f"{why_none}"
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
            f"using built-in profile {builtin.name} (model-derived, not measured); `tree-attn tune` measures this "
            "machine",
        ), []
    other = _saved_for_other_sizes(topo, device_kind)
    return None, ProfileChoice(
        None, None, None, CHOSEN_DEFAULT,
        f"no profile for this machine (fingerprint {topo.fingerprint}): built-in defaults"
        + (other or "; `tree-attn tune` writes one"),
    ), []


def layout_topology(layout: NodeLayout, device_kind: str) -> Topology:
    """The topology of a torchrun job's ranks from its node layout: each node's own (its probed
    GPUs, or CPU ranks) repeated, the nodes joined by ``net`` links (nothing measured)."""
    from ..topology import host_topology, probe_topology
    from ..topology.nodes import multinode_topology

    g = layout.ranks_per_node
    node = host_topology(g) if device_kind == "cpu" else probe_topology("auto")
    if len(node) != g:
        # This node's probe does not show one device per local rank: plan its ranks as one group.
        node = host_topology(g, note=f"{len(node)} devices probed for {g} local ranks")
    return multinode_topology(node, layout.nodes)


def multinode_plan(layout: NodeLayout, device_kind: str, fanout: int | None) -> tuple:
    """``(plan, text)``: the hierarchical tree of a job over ``layout.nodes`` alike nodes: each
    node's own hierarchy (its probed GPUs, or CPU ranks), then the network joining the nodes, the
    slowest link class, so one message per node crosses it each way."""
    from ..reduce.hier_plan import hierarchical_plan

    g = layout.ranks_per_node
    topo = layout_topology(layout, device_kind)
    plan = hierarchical_plan(topo.hierarchy, fanout or 2)
    text = (f"no profile: {layout.nodes} nodes x {g} ranks (torchrun); tree {plan.label} planned from the nodes, "
            "the network as the slowest link class")
    return plan, text


def check_plan_shape(shape: str) -> str:
    """``--plan``: one of :data:`PLAN_SHAPES` (a ConfigError naming the choices otherwise)."""
    if shape not in PLAN_SHAPES:
        raise ConfigError(f"--plan must be one of {', '.join(PLAN_SHAPES)}; got {shape!r}")
    return shape


def _with_tree(plans: tuple, tree) -> tuple:
    return tuple((n, tree if n == "tree" else p) for n, p in plans)


def _tuned_multinode_profile(profile_ref: str, world_size: int, nodes: int) -> Profile:
    """A profile ``tune`` wrote under a torchrun job of the same size (its topology spans the
    job's nodes); a profile of one machine is refused."""
    from ..profiles import open_profile

    profile = open_profile(profile_ref)
    topo = profile.topology
    if profile.machine.world_size != world_size or topo is None or topo.hierarchy_source == "probe":
        raise ConfigError(f"profile {profile.name!r} describes {profile.machine.world_size} devices of one machine; "
                          f"this torchrun job spans {nodes} nodes: give a profile `tree-attn tune` wrote under a "
                          "torchrun job of the same nodes, or omit --profile (the tree is then planned from the "
                          "nodes, the network as the slowest link)")
    return profile


def choose_plans(profile_ref: str | None, names: list[str], fanout: int | None, world_size: int, device_kind: str,
                 layout: NodeLayout | None = None, shape: str = "auto") -> tuple:
    """``(profile, ProfileChoice, warnings, plans)`` for the strategies ``names``.

    One machine: the profile (``--profile``, saved, built-in or none) gives the tree's plan and the
    kernel configs. A torchrun job over several nodes (``layout.nodes > 1``): the tree is planned
    from the node layout, or taken from ``--profile`` when ``tune`` wrote it under a torchrun job
    of the same size (a profile of one machine is refused). ``shape`` (``--plan``) overrides the
    tree's shape: ``flat`` a k-ary tree in rank order (fan-out ``fanout``, default 2), ``hier`` the
    hierarchical tree of the topology (the node layout across nodes).
    """
    from ..reduce.plan import ReductionPlan

    check_plan_shape(shape)
    if shape == "flat":
        flat = ReductionPlan("tree", fanout or 2)
        if layout is not None and layout.nodes > 1:
            if profile_ref is not None:
                raise ConfigError("--plan flat takes no --profile (the flat tree ignores the profile's plan)")
            text = (f"--plan flat: a flat tree {flat.label} over the {world_size} ranks of {layout.nodes} nodes, "
                    "ignoring the node layout")
            plans = _with_tree(build_plans(names, None, world_size, None), flat)
            return None, ProfileChoice(None, None, None, CHOSEN_DEFAULT, text), [], plans
        profile, choice, warnings = select_profile(profile_ref, world_size, device_kind)
        return profile, choice, warnings, _with_tree(build_plans(names, None, world_size, profile), flat)
    if layout is not None and layout.nodes > 1:
        if profile_ref is not None and shape == "auto":
            profile = _tuned_multinode_profile(profile_ref, world_size, layout.nodes)
            text = (f"using profile {profile.name} ({profile.origin}) from {profile_ref}: tree {profile.plan.label}, "
                    f"hierarchy from {profile.topology.hierarchy_source}")
            plans = _with_tree(build_plans(names, None, world_size, None), profile.plan)
            return profile, ProfileChoice(profile.name, profile.origin, _where(profile_ref), CHOSEN_EXPLICIT,
                                          text), [], plans
        if profile_ref is not None:
            raise ConfigError("--plan hier plans the tree from the node layout: omit --profile (or give --plan auto "
                              "to take the profile's plan)")
        plan, text = multinode_plan(layout, device_kind, fanout)
        plans = _with_tree(build_plans(names, None, world_size, None), plan)
        return None, ProfileChoice(None, None, None, CHOSEN_DEFAULT, text), [], plans
    profile, choice, warnings = select_profile(profile_ref, world_size, device_kind)
    if shape == "hier":
        from ..reduce.hier_plan import hierarchical_plan

        topo = profile.topology if profile is not None and profile.topology is not None else \
            _run_topology(world_size, device_kind)[0]
        if topo is None:
            raise ConfigError("--plan hier needs this machine's topology, which could not be probed; use --plan auto")
        return profile, choice, warnings, _with_tree(build_plans(names, None, world_size, profile),
                                                     hierarchical_plan(topo.hierarchy, fanout or 2))
    return profile, choice, warnings, build_plans(names, fanout, world_size, profile)

