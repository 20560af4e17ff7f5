"""Reduction plans are pure data: trees span every rank once, depths are as expected, errors clear."""

import math

import pytest

from tree_attn import ConfigError, ReductionPlan
from tree_attn.reduce.plan import ReductionTree, kary_tree


@pytest.mark.parametrize("world", list(range(1, 33)))
@pytest.mark.parametrize("fanout", [2, 3, 4, 8])
def test_kary_tree_spans_every_rank_once(world, fanout):
    tree = kary_tree(list(range(world)), fanout)
    assert tree.root == 0
    # every non-root rank has exactly one parent, and appears once among all children lists
    kids = [c for cs in tree.children for c in cs]
    assert sorted(kids) == list(range(1, world))
    assert all(len(cs) <= fanout for cs in tree.children)
    # heap depth: positions 1..k are depth 1, next k^2 depth 2, ...
    expected_height = 0 if world == 1 else math.ceil(math.log(world * (fanout - 1) + 1, fanout)) - 1
    assert tree.height == expected_height


def test_rank_order_puts_root_first_and_neighbours_together():
    tree = kary_tree([3, 1, 0, 2], 2)
    assert tree.root == 3 and tree.children[3] == (1, 0) and tree.parent[2] == 1


def test_from_parents_rejects_cycles_and_two_roots():
    with pytest.raises(ConfigError, match="exactly one root"):
        ReductionTree.from_parents([-1, -1, 0])
    with pytest.raises(ConfigError, match="cycle"):
        ReductionTree.from_parents([-1, 2, 1])
    with pytest.raises(ConfigError, match="not a valid parent"):
        ReductionTree.from_parents([-1, 7])
    # the edges of the range: a parent one past the last rank, a rank its own parent, no root at all
    for parents, text in (([-1, 2], "not a valid parent"), ([-1, 1], "not a valid parent"),
                          ([1, 0], "exactly one root"), ([1, 2, 0], "exactly one root")):
        with pytest.raises(ConfigError, match=text):
            ReductionTree.from_parents(parents)
    with pytest.raises(ConfigError, match="fan-out must be at least 2; got 1"):
        kary_tree([0, 1, 2], 1)


def test_plan_validation():
    with pytest.raises(ConfigError, match="unknown strategy 'butterfly'"):
        ReductionPlan("butterfly")
    with pytest.raises(ConfigError, match="fanout must be an integer >= 2; got 1"):
        ReductionPlan("tree", 1)
    with pytest.raises(ConfigError, match="permutation of 0..3"):
        ReductionPlan("tree", 2, rank_order=(0, 1, 1, 3)).check(4)
    with pytest.raises(ConfigError, match="3 entries for 4 ranks"):
        ReductionPlan("tree", parents=(-1, 0, 0)).check(4)
    # the same refusals from tree() called alone, and from check() of a plan that builds no tree
    with pytest.raises(ConfigError, match="3 entries for 4 ranks"):
        ReductionPlan("tree", parents=(-1, 0, 0)).tree(4)
    with pytest.raises(ConfigError, match="permutation of 0..3"):
        ReductionPlan("tree", 2, rank_order=(0, 2, 1)).tree(4)
    with pytest.raises(ConfigError, match="3 entries for 4 ranks"):
        ReductionPlan("allreduce", parents=(-1, 0, 0)).check(4)
    with pytest.raises(ConfigError, match="permutation of 0..3"):
        ReductionPlan("allreduce", rank_order=(0, 1, 1, 3)).check(4)


def test_plan_round_trip_and_labels():
    p = ReductionPlan("tree", 4, rank_order=(1, 0, 2, 3))
    assert ReductionPlan.from_dict(p.to_dict()) == p
    explicit = ReductionPlan("tree", 2, parents=(2, 2, -1, 0), label="hier pix>sys k=2")
    back = ReductionPlan.from_dict(explicit.to_dict())  # what a saved profile keeps of its tree
    assert back == explicit and back.tree(4).parent == (2, 2, -1, 0)
    assert p.label == "tree k=4" and ReductionPlan("allreduce").label == "allreduce"
    with pytest.raises(ConfigError, match="unknown plan keys: colour"):
        ReductionPlan.from_dict({"strategy": "tree", "colour": "red"})


def test_large_fanout_is_the_flat_tree():
    tree = ReductionPlan("tree", 16).tree(5)
    assert tree.height == 1 and tree.children[0] == (1, 2, 3, 4)
