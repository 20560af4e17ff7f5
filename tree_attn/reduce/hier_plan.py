"""Topology-aware reduction plans, from the topology's hierarchy. Pure functions.

The hierarchy lists, fastest link class first, partitions of the devices into groups joined by
links of that class or faster (an NVLink clique, the GPUs under one PCIe switch, one NUMA node...),
the last level one group of all. The plan merges inside the fastest groups first (a k-ary tree per
group, rooted at the group's leader, its lowest rank), then among the leaders of the groups that
the next level joins, level by level; the result travels back down the same edges. Every tree edge
of level i joins two ranks in one group of level i, so it uses links of that class or faster, and
the slow links carry one message per group instead of one per rank.

Rank r is assumed to run on device r of the probe (the launcher puts rank r on ``cuda:r``, and the
CLI numbers CUDA devices in PCI bus order, as NVML does). With ``CUDA_VISIBLE_DEVICES`` naming a
subset or another order, that no longer holds: the result stays exact, but tree edges may land on
slower links than planned.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from ..validate import check_int
from .plan import ReductionPlan, ReductionTree


def _levels(hierarchy) -> list[tuple[str, list[list[int]]]]:
    out = []
    for level in hierarchy:
        if hasattr(level, "groups"):
            out.append((str(level.kind), [sorted(g) for g in level.groups]))
        else:
            kind, groups = level
            out.append((str(kind), [sorted(g) for g in groups]))
    return out


def hierarchical_parents(hierarchy, fanout: int | Sequence[int] = 2) -> tuple[int, ...]:
    """Parent array of the level-by-level tree (see module doc).

    Args:
        hierarchy: levels fastest first, each a ``HierarchyLevel`` or ``(kind, groups)``; each
            level's groups must be unions of the previous level's groups.
        fanout: children per node, one value or one per level.

    Returns:
        ``parents[r]`` for every rank, -1 for the root (rank of the last level's leader).
    """
    levels = _levels(hierarchy)
    if not levels:
        raise ConfigError("the hierarchy has no levels")
    members = sorted(r for g in levels[-1][1] for r in g)
    n = len(members)
    if members != list(range(n)):
        raise ConfigError(f"the hierarchy's last level must cover ranks 0..n-1 exactly; got {members}")
    if len(levels[-1][1]) != 1:
        raise ConfigError("the hierarchy's last level must be one group of all ranks")
    fanouts = [fanout] * len(levels) if isinstance(fanout, int) else list(fanout)
    if len(fanouts) != len(levels):
        raise ConfigError(f"{len(fanouts)} fan-outs given for {len(levels)} hierarchy levels")
    for k in fanouts:
        check_int(k, "fan-out", minimum=2, must=True)
    parents = [-1] * n
    # leader[r] = the representative of the current group containing r (its lowest rank)
    leader = list(range(n))
    for (kind, groups), k in zip(levels, fanouts):
        covered = sorted(r for g in groups for r in g)
        if covered != list(range(n)):
            raise ConfigError(f"hierarchy level {kind!r} is not a partition of ranks 0..{n - 1}")
        for group in groups:
            # Leaders of the previous level's groups inside this group, in rank order.
            subleaders = sorted({leader[r] for r in group})
            # The subgroups must nest: every member's previous leader lies inside this group.
            if not set(subleaders) <= set(group):
                raise ConfigError(f"hierarchy level {kind!r}: group {group} splits a group of a faster level")
            for pos in range(1, len(subleaders)):
                parents[subleaders[pos]] = subleaders[(pos - 1) // k]
            for r in group:
                leader[r] = subleaders[0]
    return tuple(parents)


def hierarchical_plan(hierarchy, fanout: int | Sequence[int] = 2) -> ReductionPlan:
    """A :class:`ReductionPlan` of strategy "tree" with the hierarchical parents."""
    levels = _levels(hierarchy)
    parents = hierarchical_parents(levels, fanout)
    kinds = ">".join(kind for kind, groups in levels if len(groups) < len(parents) or len(levels) == 1)
    k = fanout if isinstance(fanout, int) else "/".join(map(str, fanout))
    return ReductionPlan("tree", fanout if isinstance(fanout, int) else max(fanout), parents=parents,
                         label=f"hier {kinds or 'flat'} k={k}")


def is_flat(hierarchy) -> bool:
    """True when the hierarchy has one non-trivial level (all ranks joined at the fastest class)."""
    levels = _levels(hierarchy)
    n = sum(len(g) for g in levels[-1][1])
    nontrivial = [groups for _, groups in levels if len(groups) < n]
    return len(nontrivial) <= 1


def candidate_plans(world_size: int, hierarchy=None) -> list[ReductionPlan]:
    """Every plan ``tune`` times: all-reduce, k-ary trees (k = 2, 4, 8, world size) and, when the
    hierarchy has more than one level, the hierarchical trees (k = 2, 4, world size).
    Plans with the same tree are listed once."""
    plans = [ReductionPlan("allreduce")]
    seen: set[tuple[int, ...]] = set()

    def add(plan: ReductionPlan) -> None:
        key = plan.tree(world_size).parent
        if key not in seen:
            seen.add(key)
            plans.append(plan)

    for k in (2, 4, 8, world_size):
        if 2 <= k <= max(world_size, 2):
            add(ReductionPlan("tree", k))
    if hierarchy is not None and not is_flat(hierarchy):
        for k in (2, 4, max(world_size, 2)):
            add(hierarchical_plan(hierarchy, k))
    return plans


def tree_of(plan: ReductionPlan, world_size: int) -> ReductionTree:
    """The reduction tree of a tree plan (for display and tests)."""
    return plan.tree(world_size)
