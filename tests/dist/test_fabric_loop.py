"""probe -> tune -> run, and generate, under torchrun across a fabric of network namespaces
(tests/fabric.py): the measured hierarchy, the plan tune picks by measurement, the flat-tree
override, and greedy tokens across the nodes.

Needs root (network namespaces, tc): skipped with "needs root and network namespaces" elsewhere.
Sizes are small (a few torchrun jobs of 4-6 CPU ranks); no test asserts a speed.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.fabric import NIC_BURST_BYTES, Fabric, run_report, unavailable_reason
from tests.tolerances import TOLERANCES

_REASON = unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

TOL = TOLERANCES[torch.float32].fp32
SHAPE = ["--device", "cpu", "-n", "4099", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def _report(results) -> dict:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    reports = [r.stdout for r in results if r.stdout.strip()]
    assert len(reports) == 1, [r.stderr[-1500:] for r in results]  # rank 0's node reports
    return json.loads(reports[0])


def test_probe_measure_follows_a_faster_node_pair(tmp_path):
    # Three nodes of two ranks; nodes 0 and 1 on 1 Gbit/s links, node 2 on 100 Mbit/s: the pair
    # of fast nodes is an island the node layout does not show (every inter-node pair is "net").
    out = tmp_path / "measured.yaml"
    with Fabric(3, rate="100mbit", rates={0: "1gbit", 1: "1gbit"}) as fab:
        results = fab.torchrun(["probe", "--measure", "--iterations", "2", "--json", "-o", str(out)],
                               ranks_per_node=2, join_timeout_s=60).wait(timeout=240)
    topo = _report(results)
    assert topo["hierarchy_source"] == "measured"
    levels = [lvl["groups"] for lvl in topo["hierarchy"]]
    assert levels[0] == [[0, 1], [2, 3], [4, 5]]  # torchrun's nodes: two ranks each
    assert levels[-1] == [[0, 1, 2, 3, 4, 5]]
    assert len(levels) == 3, levels
    island, alone = sorted(levels[1], key=len, reverse=True)
    assert len(island) == 4 and len(alone) == 2 and alone in levels[0]  # two whole nodes, and the third
    # The measurement is the fabric's: pairs with the lone node crossed its 100 Mbit/s link
    # (12.5 MB/s at most), the island's cross-node pairs a 1 Gbit/s one.
    bw = {(lk["a"], lk["b"]): lk["bandwidth_gbps"] for lk in topo["links"]}
    to_alone = [g for (a, b), g in bw.items() if (a in alone) != (b in alone)]
    in_island = [g for (a, b), g in bw.items() if a in island and b in island and a // 2 != b // 2]
    assert max(to_alone) < 0.0125 * 1.05, to_alone
    assert min(in_island) > 3 * max(to_alone), (in_island, to_alone)
    # The file keeps the measured hierarchy: the plans read it back from there.
    from tree_attn.topology import load_expected

    saved = load_expected(out)
    assert saved.hierarchy_source == "measured" and [h.groups for h in saved.hierarchy] == levels


def test_tune_picks_a_hierarchical_plan_and_run_takes_it_or_a_flat_tree(tmp_path):
    # 2 nodes x 2 ranks at 50 Mbit/s (a crossing of the 16.5 KB message: 2.6 ms, well above the
    # jitter of 4 ranks on a busy host), a NIC-like tbf bucket (each message at the link's rate).
    profile = tmp_path / "tuned.yaml"
    with Fabric(2, rate="50mbit", burst_bytes=NIC_BURST_BYTES) as fab:
        tuned = _report(fab.torchrun(["tune", "--device", "cpu", "--quick", "-o", str(profile), "--json"],
                                     ranks_per_node=2, join_timeout_s=60).wait(timeout=240))
        ran = run_report(fab.torchrun(["run", *SHAPE, "--steps", "2", "--warmup", "1", "-s", "tree", "--profile",
                                       str(profile), "--timeout", "60", "--json"],
                                      ranks_per_node=2, join_timeout_s=60).wait(timeout=240))
        flat = run_report(fab.torchrun(["run", *SHAPE, "--steps", "2", "--warmup", "1", "-s", "tree,allreduce",
                                        "--plan", "flat", "--timeout", "60", "--json"],
                                       ranks_per_node=2, join_timeout_s=60).wait(timeout=240))
    red = tuned["profile"]["reduction"]
    cands = red["candidates"]
    labels = [c["label"] for c in cands]
    print("tune in 2x2 at 50 Mbit/s:", ", ".join(f"{c['label']} {c['median_us']:.0f} us" for c in cands))
    # Timed: all-reduce, flat trees of several fan-outs, and the hierarchical tree.
    assert "allreduce" in labels and "tree k=2" in labels and "tree k=4" in labels
    assert any(lbl.startswith("hier ") for lbl in labels)
    assert all(c["chosen_by"] == "measured" and c["median_us"] > 0 for c in cands)
    (chosen,) = [c for c in cands if c["selected"]]
    assert chosen["median_us"] == min(c["median_us"] for c in cands)
    assert red["plan"]["label"] == chosen["label"]
    # The structural fact: the fastest is a hierarchical tree, one edge across the nodes.
    assert chosen["label"].startswith("hier "), labels
    parents = chosen["plan"]["parents"]
    assert sum(1 for r, p in enumerate(parents) if p >= 0 and r // 2 != p // 2) == 1, parents
    # run --profile decodes with the tuned plan, exactly.
    (row,) = ran["results"]
    assert row["plan"] == chosen["label"]
    assert ran["config"]["strategies"][0]["plan"]["parents"] == parents
    assert row["max_abs_err"] <= TOL.out_atol and row["max_lse_err"] <= TOL.lse_atol and row["ranks_agree"]
    # --plan flat: a k-ary tree in rank order across the nodes, exact too.
    rows = {r["strategy"]: r for r in flat["results"]}
    tree_plan = next(s["plan"] for s in flat["config"]["strategies"] if s["strategy"] == "tree")
    assert tree_plan["label"] == "tree k=2" and "parents" not in tree_plan
    assert rows["tree"]["plan"] == "tree k=2"
    for r in rows.values():
        assert r["max_abs_err"] <= TOL.out_atol and r["max_lse_err"] <= TOL.lse_atol and r["ranks_agree"], r


def test_generate_across_the_fabric_gives_transformers_tokens(tmp_path):
    from tests.generate.test_generate import GEN_ARGS, _expected_for_cli_prompt

    env = {"TREE_ATTN_PROFILE_DIR": str(tmp_path / "profiles")}
    with Fabric(2, rate="100mbit") as fab:
        results = fab.torchrun(GEN_ARGS, ranks_per_node=2, join_timeout_s=60, env=env).wait(timeout=300)
    result = _report(results)
    assert result["world_size"] == 4 and result["checked_against"] == "reference" and result["all_match"] is True
    expected = _expected_for_cli_prompt()
    names = [r["name"] for r in result["rows"]]
    assert any(n.startswith("hier ") for n in names) and "ring" in names, names
    for r in result["rows"]:
        assert r["tokens"] == expected, (r["name"], r["tokens"], expected)
    print(f"generate across 2 nodes x 2 ranks ({sys.platform}): rows {names} all equal transformers' "
          f"{len(expected)} tokens")
