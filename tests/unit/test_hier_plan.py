"""Topology-aware plans: exhaustive structural checks on fake hierarchies of 1 to 64 ranks."""

import math
import random

import pytest

from tree_attn import ConfigError
from tree_attn.reduce.hier_plan import candidate_plans, hierarchical_parents, hierarchical_plan
from tree_attn.reduce.plan import ReductionTree


def _random_hierarchy(n: int, rng: random.Random) -> list[tuple[str, list[list[int]]]]:
    """Nested partitions of 0..n-1: split into consecutive blocks, then merge blocks level by level."""
    groups = [[r] for r in range(n)]
    levels = []
    kinds = ["nvlink", "pix", "pxb", "phb", "node", "sys"]
    while len(groups) > 1:
        merged, i = [], 0
        while i < len(groups):
            take = rng.randint(1, 3)
            merged.append(sorted(r for g in groups[i : i + take] for r in g))
            i += take
        if len(merged) == len(groups):
            merged = [sorted(r for g in groups for r in g)]
        groups = merged
        levels.append((kinds[min(len(levels), len(kinds) - 1)], groups))
    return levels or [("self", [[0]])]


def _check_tree(parents, levels, fanout):
    n = len(parents)
    tree = ReductionTree.from_parents(parents)  # one root, no cycles, spans every rank
    # Simulate the reduction: each node's merged set = itself + its children's sets.
    def merged(r):
        s = [r]
        for c in tree.children[r]:
            s += merged(c)
        return s
    everything = merged(tree.root)
    assert sorted(everything) == list(range(n)), "every rank's state enters exactly once"
    # Every edge stays inside one group of the level where it was made: the child's and parent's
    # group at the level of the edge coincide, so parent and child share the group of some level.
    for r, p in enumerate(parents):
        if p >= 0:
            assert any(any(r in g and p in g for g in groups) for _, groups in levels)
    # Depth bound: per level, a k-ary heap over the subgroup leaders.
    bound = 0
    prev = [[r] for r in range(n)]
    for _, groups in levels:
        widest = max(sum(1 for pg in prev if pg[0] in g or set(pg) <= set(g)) for g in groups)
        bound += math.ceil(math.log(widest * (fanout - 1) + 1, fanout)) - 1 if widest > 1 else 0
        prev = groups
    assert tree.height <= bound
    for r in range(n):
        assert len(tree.children[r]) <= fanout * len(levels)


@pytest.mark.parametrize("n", list(range(1, 65)))
@pytest.mark.parametrize("fanout", [2, 3, 4])
def test_random_hierarchies(n, fanout):
    rng = random.Random(n * 10 + fanout)
    for _ in range(3):
        levels = _random_hierarchy(n, rng)
        _check_tree(hierarchical_parents(levels, fanout), levels, fanout)


def test_pcie_box_with_two_switches_merges_pairs_first():
    levels = [("pix", [[0, 1], [2, 3], [4, 5], [6, 7]]), ("pxb", [[0, 1, 2, 3], [4, 5, 6, 7]]),
              ("sys", [list(range(8))])]
    parents = hierarchical_parents(levels, 2)
    assert parents[1] == 0 and parents[3] == 2 and parents[5] == 4 and parents[7] == 6  # pairs under a switch
    assert parents[2] == 0 and parents[6] == 4  # then the switch leaders
    assert parents[4] == 0 and parents[0] == -1  # one message crosses the NUMA link
    crossing = [r for r, p in enumerate(parents) if p >= 0 and (r < 4) != (p < 4)]
    assert crossing == [4]


def test_two_numa_nodes_merge_inside_each_first():
    levels = [("node", [[0, 1, 2, 3], [4, 5, 6, 7]]), ("sys", [list(range(8))])]
    plan = hierarchical_plan(levels, 4)
    crossing = [r for r, p in enumerate(plan.parents) if p >= 0 and (r < 4) != (p < 4)]
    assert crossing == [4] and plan.label == "hier node>sys k=4"


def test_nvswitch_node_is_flat():
    levels = [("nvlink", [list(range(8))])]
    plan = hierarchical_plan(levels, 8)
    assert plan.parents == (-1, 0, 0, 0, 0, 0, 0, 0)
    # a flat hierarchy adds no hierarchical candidates beyond the k-ary trees
    labels = [p.label for p in candidate_plans(8, levels)]
    assert labels == ["allreduce", "tree k=2", "tree k=4", "tree k=8"]


def test_candidates_include_hierarchical_when_useful():
    levels = [("pix", [[0, 1], [2, 3]]), ("sys", [[0, 1, 2, 3]])]
    labels = [p.label for p in candidate_plans(4, levels)]
    assert "allreduce" in labels and "tree k=2" in labels and "tree k=4" in labels
    # hier k=2 over pairs equals... a distinct tree from the heap k=2 (which joins 0-1, 0-2, 1-3)
    assert any(l.startswith("hier") for l in labels)


def test_non_nested_hierarchy_is_refused():
    with pytest.raises(ConfigError, match="splits a group"):
        hierarchical_parents([("pix", [[0, 1], [2, 3]]), ("pxb", [[0, 2], [1, 3]]), ("sys", [[0, 1, 2, 3]])])
    with pytest.raises(ConfigError, match="one group of all"):
        hierarchical_parents([("pix", [[0, 1], [2, 3]])])


def test_bad_hierarchies_and_fanouts_are_refused():
    two = [("pix", [[0, 1], [2, 3]]), ("sys", [[0, 1, 2, 3]])]
    with pytest.raises(ConfigError, match="last level must cover ranks 0..n-1"):
        hierarchical_parents([("sys", [[0, 2]])])
    # a faster level that leaves a rank out, or holds one twice, is not a partition
    with pytest.raises(ConfigError, match="'pix' is not a partition"):
        hierarchical_parents([("pix", [[0, 1]]), ("sys", [[0, 1, 2]])])
    with pytest.raises(ConfigError, match="'pix' is not a partition"):
        hierarchical_parents([("pix", [[0, 1], [1, 2]]), ("sys", [[0, 1, 2]])])
    with pytest.raises(ConfigError, match="1 fan-outs given for 2 hierarchy levels"):
        hierarchical_parents(two, [2])
    with pytest.raises(ConfigError, match="fan-out must be an integer >= 2; got 1"):
        hierarchical_parents(two, [2, 1])


def test_per_level_fanouts_apply_fastest_first():
    """Fan-out 3 inside the four-rank groups, 2 among the three group leaders."""
    levels = [("nvlink", [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]), ("sys", [list(range(12))])]
    plan = hierarchical_plan(levels, [3, 2])
    assert plan.parents == (-1, 0, 0, 0, 0, 4, 4, 4, 0, 8, 8, 8)
    assert plan.fanout == 3 and plan.label == "hier nvlink>sys k=3/2"


def test_label_leaves_out_levels_that_join_nothing():
    levels = [("self", [[r] for r in range(4)]), ("pix", [[0, 1], [2, 3]]), ("sys", [[0, 1, 2, 3]])]
    assert hierarchical_plan(levels, 2).label == "hier pix>sys k=2"


def test_candidates_of_a_two_level_box_of_16():
    """Every k-ary tree (2, 4, 8, the flat 16) and every hierarchical one (2, 4, 16) tune times."""
    levels = [("nvlink", [list(range(8)), list(range(8, 16))]), ("sys", [list(range(16))])]
    labels = [p.label for p in candidate_plans(16, levels)]
    assert labels == ["allreduce", "tree k=2", "tree k=4", "tree k=8", "tree k=16",
                      "hier nvlink>sys k=2", "hier nvlink>sys k=4", "hier nvlink>sys k=16"]
