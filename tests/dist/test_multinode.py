"""Multi-node launch on one machine: two torchrun "nodes" x 2 CPU ranks over loopback (gloo), the
way a cluster job starts (`torchrun --nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint
HOST:PORT -m tree_attn run ...`). The plan must put the node boundary at the network class (one
edge between the nodes' leaders) and every strategy must be exact."""

from __future__ import annotations

import json

import pytest

from tests.torchrun import clean_env, run_nodes
from tree_attn.launch.env import NodeLayout, RankEnv, torchrun_layout
from tree_attn.launch.plans import multinode_plan
from tree_attn.reduce.plan import ReductionTree

pytestmark = pytest.mark.slow  # CI runs the whole suite, slow tests included (.ci/run)


def test_multinode_plan_crosses_the_network_once_per_node():
    # 3 nodes x 2 CPU ranks: inside a node the ranks merge first; the nodes' leaders 0, 2, 4 then
    # merge over the network, the last level.
    plan, text = multinode_plan(NodeLayout(3, 2), "cpu", None)
    tree = ReductionTree.from_parents(plan.parents)
    cross = [(r, p) for r, p in enumerate(tree.parent) if p >= 0 and r // 2 != p // 2]
    assert sorted(cross) == [(2, 0), (4, 0)] or sorted(cross) == [(2, 0), (4, 2)]
    assert plan.label.endswith("net k=2") and "3 nodes x 2 ranks" in text


def test_torchrun_layout_reads_the_node_from_group_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    env = RankEnv(rank=3, world_size=4, backend="gloo", device="cpu", local_rank=1)
    assert torchrun_layout(env) == NodeLayout(2, 2, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(Exception, match="LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=4"):
        torchrun_layout(env)


def test_two_nodes_of_two_ranks_on_loopback(tmp_path):
    env = clean_env(GLOO_SOCKET_IFNAME="lo")  # what a user sets to pick the interface; loopback here
    # Odd sizes: 4,099 tokens over 4 ranks (uneven shards), GQA 4/2, D 16.
    args = ["--device", "cpu", "-n", "4099", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--steps", "2",
            "--warmup", "1", "-s", "tree,allreduce,ring", "--timeout", "60", "--json"]
    outs = run_nodes(["run", *args], nodes=2, per_node=2, env=env, cwd=tmp_path, timeout=90)
    for code, _, err in outs:
        assert code == 0, err[-3000:]
    # The c10d rendezvous numbers the nodes by arrival (torchrun ignores --node-rank with it): the
    # node that holds rank 0 reports, the other prints nothing on stdout.
    reports = [out for _, out, _ in outs if out.strip()]
    assert len(reports) == 1, outs
    data = json.loads(reports[0])
    cfg = data["config"]
    assert cfg["world_size"] == 4 and cfg["nodes"] == 2
    tree_plan = next(s["plan"] for s in cfg["strategies"] if s["strategy"] == "tree")
    parents = tree_plan["parents"]
    cross = [(r, p) for r, p in enumerate(parents) if p >= 0 and r // 2 != p // 2]
    assert cross == [(2, 0)], parents  # one edge crosses the node boundary: leader to leader
    assert tree_plan["label"] == "hier sys>net k=2"
    assert "2 nodes x 2 ranks" in data["profile"]["text"]
    for r in data["results"]:
        assert r["max_abs_err"] <= 1e-5 and r["max_lse_err"] <= 1e-5, r
    tree = next(r for r in data["results"] if r["strategy"] == "tree")
    # the busiest ranks send 2 packed states [1, 4, 17] float32: the root to its 2 children, node 1's
    # leader one up and one down
    assert tree["ranks_agree"] and tree["bytes_sent_per_step"] == 2 * 4 * 17 * 4
