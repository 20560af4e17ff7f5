"""The decode-step cost model (tree_attn.cost): its arithmetic against hand computations, its
plans against the topology rules, its byte counts against what the library's collectives count in
real gloo runs, and its parameters' validation. It predicts; these tests check that it predicts
what it says it does, never a speed."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.bad_files import refused
from tree_attn.cost import (
    PRESETS,
    ClusterSpec,
    DeviceParams,
    LinkParams,
    Workload,
    cluster_plan,
    predict_step,
    preset,
)
from tree_attn.cost.fit import cluster_from_dict, cluster_from_topology
from tree_attn.cost.links import link_class
from tree_attn.errors import ConfigError
from tree_attn.reduce.plan import ReductionPlan

LINK = LinkParams("nvlink", p2p_latency_us=5.0, p2p_gbps=100.0, ar_step_us=1.0, ar_gbps=80.0, source="test")
NET = LinkParams("network", p2p_latency_us=20.0, p2p_gbps=10.0, ar_step_us=4.0, ar_gbps=9.0, source="test")
DEV = DeviceParams("test gpu", mem_gbps=1000.0, kernel_fraction=0.5, kernel_fixed_us=3.0, merge_us=2.0,
                   collective_us=5.0, source="test")


def cluster(nodes=1, g=4, **kw) -> ClusterSpec:
    return ClusterSpec("test", kw.pop("device", DEV), ranks_per_node=g, nodes=nodes, intra=LINK, network=NET,
                       step_overhead_us=7.0, **kw)


W = Workload(seq_len=10_000, batch=1, q_heads=8, kv_heads=2, head_dim=64, dtype="bf16")


def test_local_attention_is_fixed_cost_plus_bytes_over_achieved_bandwidth():
    c = cluster(g=4)
    shard = 2 * 1 * 2500 * 2 * 64 * 2  # K and V of 2,500 tokens, 2 KV heads x 64, bf16
    local = 3.0 + shard / (1000.0 * 0.5 * 1e3)
    tree = predict_step(c, W, "tree", ReductionPlan("tree", 2))
    assert tree.local_us == pytest.approx(local)
    assert tree.time_us == pytest.approx(7.0 + local + tree.comm_us)


def test_binary_tree_on_one_node_by_hand():
    # 4 ranks, k=2: 0 <- {1, 2}, 1 <- {3}. Up: 3 reaches 1 at alpha+beta; 1 merges; then 0 gets
    # 1's (the later arrival) and queues 2's bytes on its ingress, merges. Down: 0 sends to 1, 2
    # one after the other; 1 forwards to 3.
    c = cluster(g=4)
    msg = W.message_bytes
    hop = 5.0 + msg / 100e3
    xfer = msg / 100e3
    ready1 = hop + 2.0
    ready0 = max(ready1 + hop, hop) + xfer + 2.0
    have1 = ready0 + 5.0 + xfer
    have2 = ready0 + 5.0 + 2 * xfer
    have3 = have1 + 5.0 + xfer
    pred = predict_step(c, W, "tree", ReductionPlan("tree", 2))
    assert pred.comm_us == pytest.approx(max(have1, have2, have3))
    # bytes: the root and rank 1 send 2 messages each (root: 2 down; rank 1: 1 up, 1 down)
    assert pred.bytes_per_rank == 2 * msg and pred.messages == 2


def test_hierarchical_plan_crosses_the_network_only_between_node_leaders():
    c = cluster(nodes=3, g=4)
    plan = cluster_plan(c, 2)
    parents = plan.parents
    cross = [(r, p) for r, p in enumerate(parents) if p >= 0 and r // 4 != p // 4]
    assert all(r % 4 == 0 and p % 4 == 0 for r, p in cross) and len(cross) == 2
    assert plan.label == "hier nvlink>network k=2"
    # The flat binary tree over the same 12 ranks puts more edges on the network and is slower.
    flat = predict_step(c, W, "tree", ReductionPlan("tree", 2))
    hier = predict_step(c, W, "tree", plan)
    assert hier.time_us < flat.time_us


def test_allreduce_by_hand_one_node_and_across_nodes():
    c = cluster(g=4)
    pred = predict_step(c, W, "allreduce")

    def ar(n):
        return 5.0 + 2 * 3 * 1.0 + 2 * 3 / 4 * n / 80e3

    assert pred.comm_us == pytest.approx(ar(W.lse_bytes) + ar(W.message_bytes) + 2.0)
    payload = W.lse_bytes + W.message_bytes
    assert pred.bytes_per_rank == 2 * 3 * payload // 4 and pred.messages == 12
    c2 = cluster(nodes=4, g=4)
    pred2 = predict_step(c2, W, "allreduce")

    def ar2(n):
        return ar(n) + 2 * math.ceil(math.log2(4)) * 4.0 + 2 * n / 9e3

    assert pred2.comm_us == pytest.approx(ar2(W.lse_bytes) + ar2(W.message_bytes) + 2.0)


@pytest.mark.parametrize("overlap", [True, False])
def test_ring_rounds_overlap_or_add_and_wait_for_the_slowest_edge(overlap):
    dev = dataclasses.replace(DEV, overlap=overlap)
    c = cluster(nodes=2, g=3, device=dev)  # 6 ranks: edges 2->3 and 5->0 cross the network
    w = dataclasses.replace(W, seq_len=6_000)
    pred = predict_step(c, w, "ring")
    shard = w.shard_bytes(6)
    compute = 3.0 + shard / (1000.0 * 0.5 * 1e3)
    transfer = 20.0 + (shard + 4) / 10e3  # the network edge, not NVLink
    if overlap:  # the merge of each block but the first runs beside the next transfer, as ring_decode does
        rounds = max(compute, transfer) + 4 * max(compute + 2.0, transfer) + 2.0
    else:
        rounds = 5 * (compute + transfer + 2.0)
    assert pred.time_us == pytest.approx(7.0 + compute + rounds)
    if overlap:
        assert transfer > compute + 2.0  # transfer-bound: every merge but the last hides behind it
        assert pred.time_us == pytest.approx(7.0 + compute + 5 * transfer + 2.0)
        slow = dataclasses.replace(c, device=dataclasses.replace(dev, mem_gbps=10.0))  # compute-bound
        c_slow = 3.0 + shard / (10.0 * 0.5 * 1e3)
        assert c_slow > transfer
        assert predict_step(slow, w, "ring").time_us == pytest.approx(7.0 + c_slow + 5 * (c_slow + 2.0))
    assert pred.bytes_per_rank == 5 * (shard + 4) and pred.messages == 15  # even: 1,000 tokens each
    assert pred.extra_mem_bytes == 2 * shard  # the block in hand and the next one
    assert predict_step(c.with_shape(1, 2), w, "ring").extra_mem_bytes == w.shard_bytes(2)  # p = 2: one


def test_cpu_ranks_beyond_the_cores_share_them():
    dev = dataclasses.replace(DEV, shared_cores=2)
    c2, c8 = cluster(g=2, device=dev), cluster(g=8, device=dev)
    w = dataclasses.replace(W, seq_len=8_000)
    # 8 ranks on 2 cores: each rank's 1,000 tokens take 4x what 1,000 tokens take alone.
    alone = 3.0 + w.shard_bytes(8) / (1000.0 * 0.5 * 1e3)
    assert predict_step(c8, w, "tree").local_us == pytest.approx(4 * alone)
    assert predict_step(c2, w, "tree").local_us == pytest.approx(3.0 + w.shard_bytes(2) / (500.0 * 1e3))


def test_cpu_ring_round_shares_the_cores_but_not_the_waiting():
    """CPU ranks (no overlap): a round is compute + exchange; beyond the cores the cores' work
    (compute and the exchange's on-core part) is shared, the exchange's waiting is not."""
    dev = dataclasses.replace(DEV, shared_cores=2, overlap=False)
    link = dataclasses.replace(LINK, bulk_gbps=0.5, bulk_latency_us=100.0, bulk_cpu_fraction=0.25)
    w = dataclasses.replace(W, seq_len=8_000)

    def round_us(g):
        c = ClusterSpec("cpu", dev, ranks_per_node=g, intra=link, step_overhead_us=7.0)
        pred = predict_step(c, w, "ring")
        alone = 3.0 + w.shard_bytes(g) / (500.0 * 1e3)
        merge = 2.0 * max(1.0, g / 2)
        return pred, alone, 100.0 + (w.shard_bytes(g) + 4) / 0.5e3, merge

    pred, alone, transfer, merge = round_us(2)  # ranks = cores: compute + exchange
    assert pred.time_us == pytest.approx(7.0 + alone + (alone + transfer + merge))
    pred, alone, transfer, merge = round_us(8)  # 4 ranks per core
    busy = 4 * (alone + 0.25 * transfer)
    assert busy > alone + transfer  # this shape is core-bound
    assert pred.time_us == pytest.approx(7.0 + 4 * alone + 7 * (busy + merge))
    # All of the exchange on a core (the default): everything scales by ranks / cores.
    c = ClusterSpec("cpu", dev, ranks_per_node=8, intra=dataclasses.replace(link, bulk_cpu_fraction=None),
                    step_overhead_us=7.0)
    assert predict_step(c, w, "ring").time_us == pytest.approx(7.0 + 4 * alone + 7 * (4 * (alone + transfer) + merge))
    with pytest.raises(ConfigError, match="bulk_cpu_fraction"):
        dataclasses.replace(link, bulk_cpu_fraction=1.5)


def test_awkward_shapes_world_sizes_3_5_6_and_one_rank():
    for p in (1, 3, 5, 6):
        c = cluster(g=p)
        for strat in ("tree", "allreduce", "ring"):
            pred = predict_step(c, dataclasses.replace(W, seq_len=1001), strat)
            assert pred.time_us > 0 and pred.world_size == p
            if p == 1:
                assert pred.bytes_per_rank == 0 and pred.comm_us == 0
    # An empty cache still costs the fixed terms; more ranks than tokens leaves empty shards.
    assert predict_step(cluster(g=5), dataclasses.replace(W, seq_len=3), "tree").time_us > 0


def test_an_uneven_split_costs_its_largest_shard_and_each_strategy_its_buffers():
    """1,001 tokens on 4 ranks: the local attention and the peak memory are the 251-token shard's;
    beside it the tree holds its local, merged and downward states and one per child (the binary
    root has 2), the all-reduce 3 packed states, the ring two blocks in flight."""
    c, w = cluster(g=4), dataclasses.replace(W, seq_len=1001)
    shard = 2 * 1 * 251 * 2 * 64 * 2
    msg = 4 * 1 * 8 * (64 + 1)
    for strategy, extra in (("tree", (3 + 2) * msg), ("allreduce", 3 * msg), ("ring", 2 * shard)):
        pred = predict_step(c, w, strategy, ReductionPlan("tree", 2) if strategy == "tree" else None)
        assert pred.local_us == pytest.approx(3.0 + shard / (1000.0 * 0.5 * 1e3)), strategy
        assert (pred.extra_mem_bytes, pred.peak_mem_bytes) == (extra, shard + extra), strategy


@pytest.mark.parametrize("world, seq_len", [(3, 1001), (5, 3), (6, 4), (5, 0), (2, 1)])
def test_ring_bytes_and_messages_by_brute_force(world, seq_len):
    """The ring simulated round by round: in round s rank r forwards the block of rank r - s (its
    own first), p - 1 rounds, so never its successor's; a block is its K and V (3 messages with its
    lengths) or, when empty, its lengths alone (1 message). Empty shards included."""
    w = dataclasses.replace(W, seq_len=seq_len, batch=2)
    sizes = [seq_len // world + (1 if r < seq_len % world else 0) for r in range(world)]
    per_token = 2 * 2 * 2 * 64 * 2
    sent, msgs = [0] * world, [0] * world
    for s in range(world - 1):
        for r in range(world):
            n = sizes[(r - s) % world]
            sent[r] += n * per_token + 4 * 2
            msgs[r] += 3 if n else 1
    pred = predict_step(cluster(g=world), w, "ring")
    assert (pred.bytes_per_rank, pred.messages) == (max(sent), max(msgs))


def _cpu_fabric(**kw) -> ClusterSpec:
    """Two "nodes" of 2 CPU ranks each on one host of 2 cores (4 ranks share them: each runs at
    half speed), joined by a network link; no overlap of communication and compute."""
    dev = dataclasses.replace(DEV, shared_cores=2, overlap=False)
    return ClusterSpec("fabric", dev, ranks_per_node=2, nodes=2, intra=LINK, network=NET, step_overhead_us=7.0,
                       ranks_per_host=4, **kw)


def test_tree_on_cpu_ranks_across_nodes_by_hand():
    """Binary tree 0 <- {1, 2}, 1 <- {3}; 1-3 and 0-2 cross the network. A message's alpha is core
    work (x2), its bytes on the host link too (x2), on the network not (the wire is no core's)."""
    c = _cpu_fabric()
    msg = W.message_bytes
    share = 2.0

    def hop(link, queued=1):
        return share * link.p2p_latency_us + (share if link is LINK else 1.0) * queued * msg / (link.p2p_gbps * 1e3)

    merge = share * 2.0
    ready1 = hop(NET) + merge
    ready0 = max(ready1 + hop(LINK), hop(NET)) + msg / (NET.p2p_gbps * 1e3) + merge  # 2's bytes queue behind
    have1, have2 = ready0 + hop(LINK), ready0 + hop(NET, queued=2)
    have3 = have1 + hop(NET)
    pred = predict_step(c, W, "tree", ReductionPlan("tree", 2))
    assert pred.comm_us == pytest.approx(max(have1, have2, have3))
    assert pred.local_us == pytest.approx(share * (3.0 + W.shard_bytes(4) / (1000.0 * 0.5 * 1e3)))


def test_tree_over_shared_network_links_by_hand():
    """3 nodes of one GPU, each node's rank behind one shared link; the flat tree 0 <- {1, 2}. Up:
    1's and 2's states leave at once but 0's link in takes one after the other (the second
    arrives a wire time later); 0 merges; down: 0's link out sends to 1, then to 2."""
    c = ClusterSpec("nic", DEV, ranks_per_node=1, nodes=3, network=NET, step_overhead_us=7.0, shared_nic=True)
    wire, lat, merge = W.message_bytes / (NET.p2p_gbps * 1e3), NET.p2p_latency_us, DEV.merge_us
    top = 2 * wire + lat + merge
    pred = predict_step(c, W, "tree", ReductionPlan("tree", 2))
    assert pred.comm_us == pytest.approx(top + 2 * wire + lat)


def test_allreduce_on_cpu_ranks_across_nodes_by_hand():
    """gloo across nodes: one ring over all 4 ranks at the network's step (its alpha measured with
    the ranks on the cores: not shared again), 2 (p - 1) steps of 1/p of the payload each."""
    c = _cpu_fabric()

    def ar(n):
        return 5.0 + 2 * 3 * 4.0 + 2 * 3 / 4 * n / 9e3

    pred = predict_step(c, W, "allreduce")
    assert pred.comm_us == pytest.approx(ar(W.lse_bytes) + ar(W.message_bytes) + 2 * 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 5])
def test_predicted_bytes_equal_what_the_library_counts(world):
    """Run tree (k=2), allreduce and ring on gloo ranks with an uneven split and compare each
    strategy's bytes and messages per rank with the model's."""
    from tree_attn.commands.run.decode import RunSpec, run_decode
    from tree_attn.launch.setup import LaunchSetup

    plans = (("tree", ReductionPlan("tree", 2)), ("allreduce", ReductionPlan("allreduce")), ("ring", None))
    spec = RunSpec(LaunchSetup(world_size=world, dtype="float32", plans=plans), seq_len=1001, batch=2, q_heads=4,
                   kv_heads=2, head_dim=16, steps=1, warmup=1)
    result = run_decode(spec)
    c = cluster(g=world)
    w = Workload(1001, 2, 4, 2, 16, "fp32")
    for row in result.results:
        pred = predict_step(c, w, row.strategy, ReductionPlan("tree", 2) if row.strategy == "tree" else None)
        assert (row.bytes_sent_per_step, row.messages_per_step) == (pred.bytes_per_rank, pred.messages), row.strategy


def test_presets_cover_the_three_clusters_and_cite_every_value():
    assert set(PRESETS) == {"h100-sxm", "mi300x", "rtx4090-pcie"}
    for c in PRESETS.values():
        assert c.device.source and c.intra.source and c.network.source
        assert c.network.kind == "network" and c.ranks_per_node == 8
    assert preset("rtx4090-pcie").intra.kind == "pcie_host"
    with pytest.raises(ConfigError, match="unknown cluster preset 'dgx'"):
        preset("dgx")


def test_parameters_are_validated_and_round_trip():
    with pytest.raises(ConfigError, match="nvlink.p2p_gbps: expected a positive number"):
        LinkParams("nvlink", 1.0, 0.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="link class 'infiniband'"):
        LinkParams("infiniband", 1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ConfigError, match="kernel_fraction"):
        dataclasses.replace(DEV, kernel_fraction=1.5)
    with pytest.raises(ConfigError, match="need a network link class"):
        ClusterSpec("x", DEV, ranks_per_node=8, nodes=2, intra=LINK)
    with pytest.raises(ConfigError, match="query heads"):
        Workload(10, q_heads=6, kv_heads=4)
    c = cluster(nodes=2, g=4)
    back = cluster_from_dict(c.to_dict())
    for strat in ("tree", "allreduce", "ring"):
        assert predict_step(back, W, strat) == predict_step(c, W, strat)
    with pytest.raises(ConfigError, match="unknown key"):
        cluster_from_dict({**c.to_dict(), "colour": 1})


FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "topology"


def test_a_parameters_file_keeps_the_node_hierarchy(tmp_path):
    """A calibration of a PCIe / two-socket box, written and read back, plans the same tree."""
    import json

    from tree_attn.cost.fit import load_params
    from tree_attn.topology import load_dump

    topo = load_dump(str(FIXTURES / "dgx1_v100_8gpu_nvidia-smi_topo_mp.txt"))
    c = cluster_from_topology(topo, device=DEV, network=NET)
    assert c.hierarchy and len(c.hierarchy) > 1
    path = tmp_path / "params.json"
    path.write_text(json.dumps(c.to_dict()))
    back = load_params(path)
    assert back.hierarchy == c.hierarchy
    assert cluster_plan(back).parents == cluster_plan(c).parents
    assert cluster_plan(back).label == cluster_plan(c).label
    assert predict_step(back, W, "tree") == predict_step(c, W, "tree")


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(ranks_per_node="eight"), "ranks_per_node: expected a whole number"),
    (lambda d: d.update(ranks_per_node=8.7), "ranks_per_node: expected a whole number"),
    (lambda d: d.update(step_overhead_us="x"), "step_overhead_us: expected a number"),
    (lambda d: d["pair_links"][0].update(a="x"), r"pair_links\[0\].a: expected a whole number in 0..7"),
    (lambda d: d["pair_links"][0].update(b=9), r"pair_links\[0\].b: expected a whole number in 0..7"),
    (lambda d: d["pair_links"].pop(), "27 pairs for 8 ranks per node"),
    (lambda d: d.update(notes="abc"), "notes: expected a list of strings"),
    (lambda d: d["hierarchy"][-1].update(groups=[[0, 1, 2, 3, 4, 5, 6]]), "hierarchy"),
    (lambda d: d["device"].update(mem_gbps="fast"), "device.mem_gbps"),
    (lambda d: d.update(device=3), "device: expected a mapping"),
])
def test_a_bad_parameters_file_is_one_clear_error(tmp_path, change, match):
    import json

    from tree_attn.cost.fit import load_params
    from tree_attn.topology import load_dump

    d = cluster_from_topology(load_dump(str(FIXTURES / "dgx1_v100_8gpu_nvidia-smi_topo_mp.txt")),
                              device=DEV, network=NET).to_dict()
    change(d)
    path = tmp_path / "bad.json"
    assert str(path) in refused(load_params, path, json.dumps(d), ConfigError, match)


@pytest.mark.parametrize("content, match", [(b"{a: [}", "not valid YAML or JSON: line 1"),
                                             (bytes(range(256)), "is not text")])
def test_a_parameters_file_that_is_not_yaml_is_one_clear_error(tmp_path, content, match):
    from tree_attn.cost.fit import load_params

    refused(load_params, tmp_path / "bad.json", content, ConfigError, match)


def test_cluster_from_a_measured_topology_uses_its_numbers(tmp_path):
    from tree_attn.topology import Link, LinkKind, Measurement, P2PStatus, host_topology, load_dump

    topo = host_topology(3)
    links = [dataclasses.replace(l, bandwidth_gbps=2.0 + l.a, bandwidth_source="measured", latency_us=50.0 + l.b)
             for l in topo.links]
    meas = Measurement("gloo", 5, 4096, 8, 16512, 400.0, "cpu")
    c = cluster_from_topology(topo.replace(links=links, measurement=meas),
                              device=dataclasses.replace(DEV, collective_us=0.0))
    assert c.link(0, 2).p2p_gbps == 2.0 and c.link(1, 2).p2p_latency_us == 52.0 and c.link(0, 1).kind == "host_loopback"
    assert c.link(0, 1).ar_step_us == pytest.approx(400.0 / (2 * 2))
    with pytest.raises(ConfigError, match="CPU ranks needs the CPU device"):
        cluster_from_topology(topo)
    # A recorded dump: pairs keep their classes; PCIe without P2P is priced as host-staged.
    dgx1 = load_dump("tests/fixtures/topology/dgx1_v100_8gpu_nvidia-smi_topo_mp.txt")
    c = cluster_from_topology(dgx1, device=DEV, nodes=2, network=NET)
    assert c.world_size == 16 and c.link(0, 8).kind == "network" and c.link(0, 4).kind == "cross_socket"
    plan = cluster_plan(c)
    assert plan.label == "hier pix>phb>sys>network k=2"
    assert link_class(Link(0, 1, LinkKind.PIX, p2p=P2PStatus.OK), cpu=False) == "pcie_p2p"
    assert link_class(Link(0, 1, LinkKind.PIX, p2p=P2PStatus.UNSUPPORTED), cpu=False) == "pcie_host"


def test_calibration_line_through_two_points():
    from tree_attn.cost.calibrate import line_through as _line

    # 10 us fixed + 2 GB/s: 1,000 tokens of 1,000 B = 1 MB -> 510 us; 4,000 tokens -> 2,010 us.
    fixed, gbps = _line({1000: 510e-6, 4000: 2010e-6}, 1000)
    assert fixed == pytest.approx(10.0) and gbps == pytest.approx(2.0)
    fixed, gbps = _line({1000: 600e-6, 4000: 500e-6}, 1000)  # noise: the long point's rate
    assert fixed == 0.0 and gbps == pytest.approx(4e6 / 500e-6 / 1e9)


def test_cpu_calibration_measures_every_term_on_cpu_ranks():
    """calibrate_cpu on this host's CPU ranks (gloo; a short run): every measured term is set and
    sane, and the calibrated cluster predicts all three strategies at 2 and 8 ranks."""
    from tree_attn.cost.calibrate import calibrate_cpu

    c = calibrate_cpu(repeats=1, iterations=2)
    link, dev = c.intra, c.device
    assert dev.mem_gbps > 0 and dev.merge_us > 0 and dev.shared_cores >= 1 and not dev.overlap
    assert link.bulk_gbps > 0 and link.bulk_latency_us >= 0 and 0 < link.bulk_cpu_fraction <= 1
    assert link.p2p_gbps > 0 and link.p2p_latency_us > 0 and c.step_overhead_us > 0
    w = Workload(seq_len=65_536, dtype="fp32")
    for ranks in (2, 8):
        cr = c.with_shape(1, ranks)
        preds = {s: predict_step(cr, w, s) for s in ("tree", "allreduce", "ring")}
        assert all(p.time_us > p.local_us > 0 for p in preds.values())
        assert preds["ring"].bytes_per_rank == (ranks - 1) * (w.shard_bytes(ranks) + 4)


@pytest.mark.gpu
def test_gpu_calibration_measures_this_node():
    """What a GPU machine runs (benchmarks/calibrate_costmodel.py): measured single-GPU terms and,
    with several GPUs, the probed links with --measure numbers."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tree_attn.cost.calibrate import calibrate_gpu

    c = calibrate_gpu(repeats=3, long_tokens=65536)
    assert 0 < c.device.kernel_fraction <= 1 and c.device.kernel_fixed_us >= 0 and c.device.merge_us > 0
    gpus = torch.cuda.device_count()
    assert c.ranks_per_node == (gpus if gpus > 1 else 8)  # one GPU: the preset node's shape
    assert c.network is not None
    for strat in ("tree", "allreduce", "ring"):
        assert predict_step(c, Workload(65536), strat).time_us > 0
        assert predict_step(c.with_shape(16, 8), Workload(5_120_000), strat).time_us > 0


def test_a_gpu_calibration_borrows_only_what_one_node_cannot_measure():
    """calibrate_gpu's cluster: the measured device on the probed node; the network (and, on one
    GPU, the node's links) from the preset of that kind of GPU, so that `simulate` can price
    clusters from a one-GPU calibration."""
    from tree_attn.cost.calibrate import gpu_cluster
    from tree_attn.cost.presets import preset_for_device
    from tree_attn.topology import Topology, load_dump

    assert [preset_for_device(n) for n in ("NVIDIA H200", "AMD Instinct MI300X", "NVIDIA GeForce RTX 4090")] == [
        "h100-sxm", "mi300x", "rtx4090-pcie"]
    dev = dataclasses.replace(preset("h100-sxm").device, name="NVIDIA H200", kernel_fraction=0.9, kernel_fixed_us=7.0)
    h200 = load_dump("tests/fixtures/topology/h200_hgx_8gpu_12nic_nvidia-smi_topo_m.txt")
    one = Topology(devices=h200.devices[:1], links=[], source=h200.source)
    c1 = gpu_cluster(one, dev, fixed_us=7.0, gbps=4000.0)
    assert c1.device == dev and c1.step_overhead_us == 0.0  # the measured fixed cost holds the launch
    assert (c1.ranks_per_node, c1.intra, c1.network) == (8, preset("h100-sxm").intra, preset("h100-sxm").network)
    assert any("no link was measured" in n for n in c1.notes)
    c8 = gpu_cluster(h200, dev, fixed_us=7.0, gbps=4000.0)
    assert c8.ranks_per_node == 8 and c8.network == preset("h100-sxm").network and c8.device == dev
    for c in (c1, c8):
        big = c.with_shape(16, 8)
        for strat in ("tree", "allreduce", "ring"):
            assert (predict_step(big, Workload(5_120_000), strat).time_us
                    > predict_step(c, Workload(32_768), strat).local_us)



def test_the_allreduce_steps_at_its_slowest_link_whatever_the_cluster_shape():
    """A node of mixed classes (DGX-1: PCIe switches, host bridges, sockets) prices its all-reduce
    at the largest per-step alpha of its pairs, before and after with_shape (which fills in the
    node's class for pairs it no longer describes)."""
    from tree_attn.topology.dumps import load_dump

    dgx1 = load_dump("tests/fixtures/topology/dgx1_v100_8gpu_nvidia-smi_topo_mp.txt")
    c = cluster_from_topology(dgx1, device=DEV)
    slowest = max(c.pair_links.values(), key=lambda l: l.ar_step_us)
    assert slowest.kind == "pcie_host"  # PCIe of unknown P2P status: host-staged, the slowest step
    w = Workload(65536)
    same = predict_step(c, w, "allreduce")
    assert predict_step(c.with_shape(1, 8), w, "allreduce").comm_us == same.comm_us
    step = 5.0 + 2 * 7 * slowest.ar_step_us  # collective_us + 2 (g - 1) steps, plus the byte terms
    assert same.comm_us > 2 * step


@pytest.mark.parametrize("dump", [
    "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt", "mi300x_8gpu_amd-smi_topology.txt",
    "dgx1_v100_8gpu_nvidia-smi_topo_mp.txt", "rtx4090_8gpu_dual_epyc7542_nvidia-smi_topo_m_whitespace_collapsed.txt",
])
def test_tune_prices_a_plan_as_simulate_predicts_its_merge(dump, capsys, tmp_path, monkeypatch):
    """tune's plan pricing (cost.plan: the built-in profiles, tune --topology) and simulate's step
    model read one link-class table and one merge: every candidate plan on a recorded topology costs
    what `tree-attn simulate --topology` predicts for its merge, in the profile tune writes too."""
    import json

    from tree_attn.cli.app import main
    from tree_attn.cost import merge_us
    from tree_attn.cost.plan import plan_cluster, predict_plan_us
    from tree_attn.profiles import load_profile
    from tree_attn.reduce.hier_plan import candidate_plans
    from tree_attn.topology.dumps import load_dump

    path = f"tests/fixtures/topology/{dump}"
    topo = load_dump(path)
    assert main(["simulate", "--topology", path, "-w", "8", "-n", "64K", "-k", "4", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    row = sim["rows"][0]
    w = Workload(65536)  # simulate's default shape (Llama-3.1-8B attention, batch 1)
    msg, lse = w.message_bytes, w.lse_bytes
    assert predict_plan_us(ReductionPlan("allreduce"), topo, msg, lse) == row["allreduce"]["comm_us"]
    tree = cluster_plan(plan_cluster(topo), fanout=4)  # the topology-aware tree simulate predicts
    assert row["tree"]["plan"] == tree.label
    assert predict_plan_us(tree, topo, msg, lse) == row["tree"]["comm_us"]
    # Every plan tune prices, on the very cluster simulate resolved from the dump.
    cluster = cluster_from_dict(sim["cluster"])
    plans = candidate_plans(len(topo), topo.hierarchy)
    assert len(plans) >= 4
    for plan in plans:
        step = predict_step(cluster, w, plan.strategy, plan if plan.strategy == "tree" else None)
        priced = predict_plan_us(plan, topo, msg, lse)
        assert priced == step.comm_us == merge_us(cluster, plan, msg, lse), plan.label
    # `tune --topology` (model-derived: nothing timed) writes those very prices, lse bytes included.
    monkeypatch.setenv("TREE_ATTN_PROFILE_DIR", str(tmp_path / "saved"))
    out = tmp_path / "tuned.yaml"
    assert main(["tune", "--device", "cpu", "--topology", path, "--output", str(out)]) == 0, capsys.readouterr().err
    tuned = load_profile(out)
    assert tuned.origin == "model" and tuned.reduction.message_bytes == msg
    by_label = {c.label: c.predicted_us for c in tuned.reduction.candidates}
    assert by_label == {p.label: predict_plan_us(p, topo, msg, lse) for p in plans}
    assert by_label["allreduce"] == row["allreduce"]["comm_us"]
