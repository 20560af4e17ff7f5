"""The measured hierarchy (topology.islands), the plan override (--plan), and the cost model's
fabric pieces (the network class from a measured topology, a node's ranks behind one link).
Pure Python: no ranks, no namespaces (the fabric itself: tests/dist/test_fabric_loop.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tree_attn.cost.fit import cluster_from_dict, fabric_cluster, network_from_topology
from tree_attn.cost.links import LinkParams
from tree_attn.cost.params import ClusterSpec, DeviceParams
from tree_attn.cost.step import Workload, cluster_plan, predict_step
from tree_attn.errors import ConfigError, TopologyError
from tree_attn.launch.env import NodeLayout
from tree_attn.launch.plans import choose_plans
from tree_attn.reduce.hier_plan import hierarchical_plan
from tree_attn.reduce.plan import ReductionPlan
from tree_attn.topology.host import host_topology
from tree_attn.topology.islands import measured_levels, with_measured_hierarchy
from tree_attn.topology.model import HierarchyLevel, Measurement, Topology
from tree_attn.topology.nodes import multinode_topology


def _measured(nodes: int, per_node: int, gbps, jitter: float = 0.0) -> Topology:
    """A measured topology of ``nodes`` x ``per_node`` CPU ranks; ``gbps(node_a, node_b)`` the
    bandwidth of a pair (the same node: loopback), ``jitter`` a deterministic spread."""
    topo = multinode_topology(host_topology(per_node), nodes)
    links = []
    for lk in topo.links:
        na, nb = lk.a // per_node, lk.b // per_node
        bw = gbps(na, nb) * (1 + jitter * ((lk.a * 7 + lk.b) % 3))
        links.append(dataclasses.replace(lk, bandwidth_gbps=bw, bandwidth_source="measured", latency_us=200.0))
    meas = Measurement("gloo", 3, 1 << 20, 8, 16512, 5000.0, "cpu")
    return topo.replace(links=links, measurement=meas)


def _rates(fast: set[int] | None):
    return lambda a, b: 2.0 if a == b else (0.125 if fast and {a, b} <= fast else 0.0125)


@pytest.mark.parametrize("fast, island", [({0, 1}, [0, 1, 2, 3]), ({1, 3}, [2, 3, 6, 7])])
def test_a_faster_node_pair_is_an_island_of_its_own(fast, island):
    topo = with_measured_hierarchy(_measured(4, 2, _rates(fast), jitter=0.3), 1 << 20)
    assert topo.hierarchy_source == "measured"
    levels = [(h.kind, h.groups) for h in topo.hierarchy]
    assert levels[0] == ("sys", [[0, 1], [2, 3], [4, 5], [6, 7]])  # a node's ranks are never split
    assert levels[1][0] == "net" and island in levels[1][1] and len(levels[1][1]) == 3
    assert levels[-1] == ("net", [list(range(8))])
    # The plan follows it: one message between the island's nodes, then one per island.
    parents = hierarchical_plan(topo.hierarchy, 2).parents
    cross = [(r, p) for r, p in enumerate(parents) if p >= 0 and r // 2 != p // 2]
    assert len(cross) == 3 and sum(1 for r, p in cross if r in island and p in island) == 1


def test_alike_links_keep_the_layout_and_a_noisy_loopback_splits_nothing():
    topo = _measured(3, 2, _rates(None), jitter=0.4)
    assert with_measured_hierarchy(topo, 1 << 20).hierarchy_source == "layout"
    noisy = _measured(3, 2, lambda a, b: (0.5 if a == 2 else 4.0) if a == b else 0.0125)
    assert [h.groups for h in measured_levels(noisy, 1 << 20)] == [[[0, 1], [2, 3], [4, 5]], [[0, 1, 2, 3, 4, 5]]]


def test_measured_hierarchy_round_trips_and_is_checked():
    topo = with_measured_hierarchy(_measured(3, 2, _rates({0, 1})), 1 << 20)
    back = Topology.from_dict(topo.to_dict())
    assert back.hierarchy_source == "measured" and [h.groups for h in back.hierarchy] == \
        [h.groups for h in topo.hierarchy]
    assert back.fingerprint == topo.fingerprint  # measured numbers are not part of it
    with pytest.raises(TopologyError, match="splits a group"):
        topo.replace(measured_hierarchy=[HierarchyLevel("sys", [[0, 2], [1, 3], [4, 5]]),
                                         HierarchyLevel("net", [[0, 1], [2, 3, 4, 5]]),
                                         HierarchyLevel("net", [list(range(6))])])
    with pytest.raises(TopologyError, match="one group"):
        topo.replace(measured_hierarchy=[HierarchyLevel("sys", [[0, 1], [2, 3], [4, 5]])])
    # One machine's probed file keeps its old keys (no hierarchy_source written for "probe").
    assert "hierarchy_source" not in host_topology(4).to_dict()


def test_plan_override_flat_and_hier_across_nodes():
    layout = NodeLayout(2, 2, 0)
    _, choice, _, plans = choose_plans(None, ["tree", "allreduce"], None, 4, "cpu", layout, shape="flat")
    tree = dict(plans)["tree"]
    assert tree.label == "tree k=2" and tree.parents is None and "flat" in choice.text
    _, _, _, plans = choose_plans(None, ["tree"], 4, 4, "cpu", layout, shape="flat")
    assert dict(plans)["tree"].label == "tree k=4"
    _, _, _, plans = choose_plans(None, ["tree"], None, 4, "cpu", layout, shape="hier")
    assert dict(plans)["tree"].parents == (-1, 0, 0, 2)
    with pytest.raises(ConfigError, match="--plan must be one of auto, hier, flat"):
        choose_plans(None, ["tree"], None, 4, "cpu", layout, shape="star")
    with pytest.raises(ConfigError, match="flat takes no --profile"):
        choose_plans("x.yaml", ["tree"], None, 4, "cpu", layout, shape="flat")


def _host() -> ClusterSpec:
    dev = DeviceParams("cpu rank", mem_gbps=6.0, kernel_fraction=1.0, kernel_fixed_us=500.0, merge_us=100.0,
                       shared_cores=2, overlap=False)
    loop = LinkParams("host_loopback", 300.0, 2.5, 200.0, 2.5, bulk_gbps=0.5, bulk_cpu_fraction=0.5)
    return ClusterSpec("cpu", dev, ranks_per_node=2, intra=loop, step_overhead_us=400.0)


def test_the_network_class_comes_from_the_measured_topology():
    topo = _measured(2, 2, _rates(None))
    net = network_from_topology(topo, host_link=_host().intra)
    assert net.kind == "network" and net.p2p_gbps == pytest.approx(0.0125) and net.p2p_latency_us == 200.0
    wire = 2 * 3 / 4 * 16512 / (0.0125 * 1e3)
    assert net.ar_step_us == pytest.approx((5000.0 - wire) / 6)
    assert net.bulk_cpu_fraction == pytest.approx(0.5 / 0.5 * 0.0125)
    with pytest.raises(ConfigError, match="no network links"):
        network_from_topology(host_topology(4))


def test_on_a_shared_link_the_hierarchical_tree_beats_a_flat_one_and_bytes_match_the_run():
    net = network_from_topology(_measured(2, 2, _rates(None)), host_link=_host().intra)
    w = Workload(16384, 1, 32, 8, 128, "float32")
    for nodes in (2, 4):
        cluster = fabric_cluster(_host(), net, nodes, 2)
        assert cluster.shared_nic and cluster.ranks_per_host == 2 * nodes
        hier = predict_step(cluster, w, "tree", cluster_plan(cluster))
        flat = predict_step(cluster, w, "tree", ReductionPlan("tree", 2))
        ring = predict_step(cluster, w, "ring")
        assert hier.time_us < flat.time_us < ring.time_us
        # bytes per step of the busiest rank, as run counts them: a state up and one per child down
        for pred, plan in ((hier, cluster_plan(cluster)), (flat, ReductionPlan("tree", 2))):
            tree = plan.tree(2 * nodes)
            sends = max((tree.parent[r] >= 0) + len(tree.children[r]) for r in range(2 * nodes))
            assert pred.bytes_per_rank == sends * 32 * 129 * 4
        assert cluster_from_dict(cluster.to_dict()).shared_nic
