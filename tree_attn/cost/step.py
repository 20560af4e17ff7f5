"""Predict one decode step for ``tree`` (any plan, hierarchical ones included), ``allreduce`` and
``ring`` from a :class:`ClusterSpec`. Pure functions: no torch, no torch.distributed.

What a step is, as ``reduce.collectives`` and ``reduce.ring`` run it:

- tree: each rank attends its query to its shard (``shard bytes / achieved bandwidth`` + a fixed
  cost), writes its packed state ``[B, Hq, D + 1]`` float32, then the plan's tree merges up (a node
  receives its children's messages as one batch, merges once, sends one message up) and sends the
  root's state back down the same edges (a node's sends to its children as one batch, so they
  leave its link one after the other).
- allreduce (the paper's Algorithm 3): the local attention, then two all-reduces, ``max`` of the
  lse ``[B, Hq]`` and ``sum`` of the packed rescaled state, then a rescale. An all-reduce on one
  node costs ``2 (g - 1)`` steps of the node's class; across nodes NCCL reduces inside each node,
  runs a tree across the nodes (``2 ceil(log2 nodes)`` network hops) and broadcasts back.
- ring: ``p`` rounds; in each of the first ``p - 1`` a rank forwards the KV block it holds to its
  successor while it computes on it and merges the result (``merge_two``, from the second block
  on) into its running state, so a round lasts ``max(compute [+ merge], transfer)`` (the
  overlap); the last round is the last block's compute and merge. All ranks transfer at once, so
  a round waits for the ring's slowest edge. On CPU ranks (no overlap: gloo copies on the cores
  that compute) a round is compute + transfer + merge, and with more ranks than cores its compute
  and transfer last the longer of their sum and the cores' shared work.

The merge alone (tree or all-reduce, after the local attention) is :func:`merge_us`: ``tune``'s
pricing of candidate plans (:mod:`tree_attn.cost.plan`) is this same function.

Bytes per rank follow ``reduce.comm``'s counting (the same numbers ``tree-attn run`` reports), and
peak memory per rank counts the KV shard plus what the step allocates (ring: two more shards in
flight; tree/allreduce: a few packed states).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .. import dtypes
from ..errors import ConfigError
from ..reduce.plan import ReductionPlan
from ..validate import check_int
from .params import ClusterSpec


def decode_message_bytes(batch: int, q_heads: int, head_dim: int) -> int:
    """Bytes of one packed partial state: float32 ``[B, Hq, D + 1]`` (the message a tree edge
    carries and the all-reduce sums, ``reduce.exchange``)."""
    return 4 * batch * q_heads * (head_dim + 1)


def decode_lse_bytes(batch: int, q_heads: int) -> int:
    """Bytes of one state's lse: float32 ``[B, Hq]`` (what the all-reduce form reduces first)."""
    return 4 * batch * q_heads


@dataclass(frozen=True)
class Workload:
    """One decode step's shape: ``seq_len`` KV tokens in all, split evenly over the ranks (the
    first ``seq_len % p`` ranks one more, as ``RunSpec.shard_sizes``). ``dtype`` is the query's
    and ``kv_dtype`` the cache's (None: ``dtype``); an fp8 cache is 1 byte per element, and its
    float32 scales (``[2, Hkv]``) travel with each ring block."""

    seq_len: int
    batch: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "q_heads", "kv_heads", "head_dim"):
            check_int(getattr(self, name), name.replace("_", " "), positive=True, must=True)
        check_int(self.seq_len, "sequence length", minimum=0, must=True)
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"query heads ({self.q_heads}) must be a multiple of KV heads ({self.kv_heads})")
        dtypes.parse_dtype(self.dtype)
        if self.kv_dtype is not None:
            dtypes.parse_kv_dtype(self.kv_dtype)

    @property
    def kv_name(self) -> str:
        """The KV cache's canonical dtype name."""
        return dtypes.parse_kv_dtype(self.dtype if self.kv_dtype is None else self.kv_dtype)

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of the KV cache."""
        return dtypes.itemsize(self.kv_name)

    @property
    def scale_bytes(self) -> int:
        """An fp8 cache's scales (``k_scale``, ``v_scale``: float32 ``[Hkv]`` each), else 0."""
        return 2 * 4 * self.kv_heads if dtypes.is_fp8(self.kv_name) else 0

    def shard_sizes(self, world_size: int) -> list[int]:
        """Tokens per rank, as ``RunSpec.shard_sizes``: the first ``seq_len % p`` ranks one more."""
        base, extra = divmod(self.seq_len, world_size)
        return [base + (1 if r < extra else 0) for r in range(world_size)]

    def shard_tokens(self, world_size: int) -> int:
        """Tokens of the largest shard."""
        return -(-self.seq_len // world_size)

    def shard_bytes(self, world_size: int) -> int:
        """K and V bytes of the largest shard."""
        return 2 * self.batch * self.shard_tokens(world_size) * self.kv_heads * self.head_dim * self.elem_bytes

    @property
    def message_bytes(self) -> int:
        """One packed partial state: float32 ``[B, Hq, D + 1]`` (:func:`decode_message_bytes`)."""
        return decode_message_bytes(self.batch, self.q_heads, self.head_dim)

    @property
    def lse_bytes(self) -> int:
        return decode_lse_bytes(self.batch, self.q_heads)


@dataclass(frozen=True)
class StepPrediction:
    """One strategy's predicted decode step on one cluster and workload.

    ``time_us`` = ``overhead_us + local_us + comm_us`` (ring: its rounds, compute and transfer
    overlapped, in ``comm_us``; ``local_us`` is then its first block). ``bytes_per_rank`` and
    ``messages`` are the busiest rank's, per step; ``peak_mem_bytes`` the largest rank's KV shard
    plus what the step allocates; ``extra_mem_bytes`` that allocation alone.
    """

    strategy: str
    plan: str
    world_size: int
    seq_len: int
    time_us: float
    local_us: float
    comm_us: float
    overhead_us: float
    bytes_per_rank: int
    messages: int
    peak_mem_bytes: int
    extra_mem_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def local_attention_us(cluster: ClusterSpec, tokens: int, w: Workload) -> float:
    """One rank's attention of the query over ``tokens`` KV tokens: fixed cost + bytes / achieved
    bandwidth, slowed by the sharing of cores when CPU ranks outnumber them."""
    dev = cluster.device
    nbytes = 2 * w.batch * tokens * w.kv_heads * w.head_dim * w.elem_bytes
    t = dev.kernel_fixed_us + nbytes / (dev.kernel_gbps * 1e3)
    return t * _core_share(cluster)


def _core_share(cluster: ClusterSpec) -> float:
    """CPU ranks of one host share its cores: with more ranks than cores each computes (and runs
    gloo's copies) at cores / ranks of its speed (the run gives each rank one intra-op thread)."""
    cores = cluster.device.shared_cores
    if cores is None:
        return 1.0
    return max(1.0, (cluster.ranks_per_host or cluster.ranks_per_node) / cores)


def _wire_share(cluster: ClusterSpec, link) -> float:
    """How much the core sharing slows a message's bytes on ``link``: a CPU rank's own copies on
    a host link (loopback) slow with the cores' share; a network link's rate does not (the bytes
    wait for the wire, not for a core)."""
    return 1.0 if link.kind == "network" else _core_share(cluster)


def predict_tree(cluster: ClusterSpec, w: Workload, plan: ReductionPlan) -> StepPrediction:
    """The tree strategy under ``plan`` (a k-ary or explicit, e.g. hierarchical, tree)."""
    if plan.strategy != "tree":
        raise ConfigError(f"predict_tree needs a tree plan; got {plan.label}")
    p = cluster.world_size
    tree = plan.tree(p)
    msg = w.message_bytes
    local = local_attention_us(cluster, w.shard_tokens(p), w)
    comm = _tree_merge_us(cluster, plan, msg)
    sends = [(1 if tree.parent[r] >= 0 else 0) + len(tree.children[r]) for r in range(p)]
    extra = msg * (3 + max(len(c) for c in tree.children))  # local, merged, down + one per child
    return _prediction("tree", plan.label, cluster, w, local, comm, max(sends) * msg, max(sends), extra)


def merge_us(cluster: ClusterSpec, plan: ReductionPlan, message_bytes: int, lse_bytes: int = 0) -> float:
    """One all-ranks merge under ``plan`` after the local attention, microseconds: the step's
    communication for a tree or all-reduce plan (``message_bytes``: one packed state; ``lse_bytes``:
    the lse the all-reduce form reduces first, ``[B, Hq]`` float32)."""
    if plan.strategy == "allreduce":
        return _allreduce_merge_us(cluster, message_bytes, lse_bytes)
    return _tree_merge_us(cluster, plan, message_bytes)


def _tree_merge_us(cluster: ClusterSpec, plan: ReductionPlan, msg: int) -> float:
    if cluster.shared_nic and cluster.nodes > 1:
        return _tree_merge_shared_nic_us(cluster, plan, msg)
    p = cluster.world_size
    tree = plan.tree(p)
    share = _core_share(cluster)
    merge = cluster.device.merge_us * share
    # Upward pass, children before parents (deepest first).
    order = sorted(range(p), key=lambda r: -tree.depth[r])
    ready = [0.0] * p  # when a node's merged state is ready to go up (after its local attention)
    for node in order:
        kids = tree.children[node]
        if not kids:
            ready[node] = 0.0
            continue
        arrivals = [ready[c] + _p2p_us(cluster, cluster.link(c, node), msg) for c in kids]
        # Messages from several children share the node's ingress: all but the first queue for
        # it, each at its own link's bandwidth.
        ingress = sum(_wire_share(cluster, cluster.link(c, node)) * msg / (cluster.link(c, node).p2p_gbps * 1e3)
                      for c in kids[1:])
        ready[node] = max(arrivals) + ingress + merge
    # Downward pass: a node sends to its children one after the other on its egress.
    have = [0.0] * p
    root = tree.root
    have[root] = ready[root]
    for node in sorted(range(p), key=lambda r: tree.depth[r]):
        t = have[node]
        for i, c in enumerate(tree.children[node]):
            link = cluster.link(node, c)
            have[c] = t + share * link.p2p_latency_us + _wire_share(cluster, link) * (i + 1) * msg / (
                link.p2p_gbps * 1e3)
    return max(have) if p > 1 else 0.0


def _tree_merge_shared_nic_us(cluster: ClusterSpec, plan: ReductionPlan, msg: int) -> float:
    """The tree's merge where a node's ranks share one network link (``cluster.shared_nic``): a
    message between nodes holds the sending node's link out and the receiving node's link in for
    ``bytes / bandwidth``, so messages that cross from (or into) the same node at once queue one
    behind the other; this is what a flat tree pays and a hierarchical one (one message per node
    each way) does not. Events in time order; messages inside a node as in :func:`_tree_merge_us`."""
    import heapq

    p = cluster.world_size
    tree = plan.tree(p)
    share = _core_share(cluster)
    merge = cluster.device.merge_us * share
    free_out = [0.0] * cluster.nodes  # when each node's link out, and in, is free again
    free_in = [0.0] * cluster.nodes

    def send(src: int, dst: int, t: float) -> tuple[float, float]:
        """(when the sender is done with it, when it has arrived) for a message sent at ``t``."""
        link = cluster.link(src, dst)
        wire = _wire_share(cluster, link) * msg / (link.p2p_gbps * 1e3)
        if link.kind != "network":
            return t + wire, t + wire + share * link.p2p_latency_us
        a, b = cluster.node_of(src), cluster.node_of(dst)
        start = max(t, free_out[a], free_in[b])
        free_out[a] = free_in[b] = start + wire
        return start + wire, start + wire + share * link.p2p_latency_us

    # Upward: a rank sends its state up once it has merged its children's.
    arrived: list[list[float]] = [[] for _ in range(p)]
    queue = [(0.0, r) for r in range(p) if not tree.children[r]]
    heapq.heapify(queue)
    top = 0.0
    while queue:
        t, r = heapq.heappop(queue)
        parent = tree.parent[r]
        if parent < 0:
            top = t
            continue
        _, at = send(r, parent, t)
        arrived[parent].append(at)
        if len(arrived[parent]) == len(tree.children[parent]):
            heapq.heappush(queue, (max(arrived[parent]) + merge, parent))
    # Downward: a rank sends the result to its children one after the other.
    have = [0.0] * p
    have[tree.root] = top
    queue = [(top, tree.root)]
    while queue:
        t, r = heapq.heappop(queue)
        for c in tree.children[r]:
            t, have[c] = send(r, c, t)
            heapq.heappush(queue, (have[c], c))
    return max(have)


def _p2p_us(cluster: ClusterSpec, link, nbytes: float) -> float:
    """One message on ``link`` as a rank sharing the host's cores sees it: its alpha (posting,
    waking up: core work) slowed by the share, its bytes by :func:`_wire_share`."""
    return _core_share(cluster) * link.p2p_latency_us + _wire_share(cluster, link) * nbytes / (link.p2p_gbps * 1e3)


def allreduce_us(cluster: ClusterSpec, nbytes: int) -> float:
    """One all-reduce of ``nbytes`` over the whole cluster (see the module doc)."""
    g, nodes = cluster.ranks_per_node, cluster.nodes
    if cluster.world_size == 1:
        return 0.0
    t = cluster.device.collective_us
    if nodes > 1 and not cluster.device.overlap:
        # CPU ranks (gloo): one ring over all p ranks, each of its 2 (p - 1) steps as slow as its
        # slowest edge, a network one (every node's ring edge out crosses it); each step moves
        # 1/p of the payload.
        p = cluster.world_size
        slow = cluster.network
        return t + 2 * (p - 1) * slow.ar_step_us + 2 * (p - 1) / p * nbytes / (slow.ar_gbps * 1e3)
    if g > 1:
        # A ring all-reduce steps at the pace of its slowest link: the largest per-step alpha among
        # the links the node's pairs use (its pairs' own, and the node's class for any pair they
        # leave out).
        links = list(cluster.pair_links.values())
        if cluster.intra is not None and len(links) < g * (g - 1) // 2:
            links.append(cluster.intra)
        intra = max(links, key=lambda l: l.ar_step_us)
        t += 2 * (g - 1) * intra.ar_step_us + 2 * (g - 1) / g * nbytes / (intra.ar_gbps * 1e3)
    if nodes > 1:
        hops = 2 * math.ceil(math.log2(nodes))
        t += hops * cluster.network.ar_step_us + 2 * nbytes / (cluster.network.ar_gbps * 1e3)
    return t


def predict_allreduce(cluster: ClusterSpec, w: Workload) -> StepPrediction:
    """The paper's Algorithm 3: all-reduce max of lse, all-reduce sum of the packed state."""
    p = cluster.world_size
    local = local_attention_us(cluster, w.shard_tokens(p), w)
    comm = _allreduce_merge_us(cluster, w.message_bytes, w.lse_bytes)
    payload = w.lse_bytes + w.message_bytes
    sent = (2 * (p - 1) * payload) // p if p > 1 else 0
    msgs = 4 * (p - 1) if p > 1 else 0
    return _prediction("allreduce", "allreduce", cluster, w, local, comm, sent, msgs, 3 * w.message_bytes)


def _allreduce_merge_us(cluster: ClusterSpec, message_bytes: int, lse_bytes: int) -> float:
    """The all-reduce form's merge: the lse's all-reduce, the packed state's, then a rescale."""
    if cluster.world_size == 1:
        return 0.0
    share = _core_share(cluster)
    collectives = allreduce_us(cluster, lse_bytes) + allreduce_us(cluster, message_bytes)
    if cluster.nodes > 1 and not cluster.device.overlap:
        # Across nodes the ring's steps wait for the network; its per-step alpha was measured
        # with the job's ranks on the host's cores (``probe --measure`` in the same job), so the
        # share is in it already.
        return collectives + cluster.device.merge_us * share
    return collectives * share + cluster.device.merge_us * share


def predict_ring(cluster: ClusterSpec, w: Workload) -> StepPrediction:
    """The Ring baseline: ``p - 1`` overlapped rounds of compute and KV transfer, then the last
    block's compute; a merge after every block but the first."""
    p = cluster.world_size
    block = w.shard_tokens(p)
    shard = w.shard_bytes(p)
    compute = local_attention_us(cluster, block, w)
    merge = cluster.device.merge_us * _core_share(cluster)
    if p == 1:
        return _prediction("ring", "ring", cluster, w, compute, 0.0, 0, 0, 0)
    # Every rank sends at once: a round waits for the ring's slowest edge (r -> r + 1).
    slowest = max((cluster.link(r, (r + 1) % p) for r in range(p)), key=lambda l: l.bulk_us(shard))
    transfer = slowest.bulk_us(shard + 4 * w.batch + w.scale_bytes)  # the block, its lengths (and scales)
    if cluster.device.overlap:
        # ring_decode merges a block before it waits for the next: the merge runs beside the
        # transfer too. Round 0 merges nothing; the last block's compute and merge follow the
        # last round (its compute is ``local``).
        rounds = max(compute, transfer) + (p - 2) * max(compute + merge, transfer) + merge
    else:
        # CPU ranks: gloo's copies run on the cores that compute, so a round is compute + transfer.
        # With more ranks than cores, the cores' work (the compute and the part of the exchange
        # spent on a core) is shared, while the rest of the exchange is waiting, which other
        # ranks' work fills: the round lasts the longer of the two.
        share = _core_share(cluster)
        alone = compute / share
        busy = alone + transfer * (slowest.bulk_cpu_fraction or 1.0)
        both = max(alone + transfer, busy * share)
        rounds = (p - 1) * (both + merge)
    # One block's compute counts as ``local``; the other blocks' compute, the transfers and the
    # merges as ``comm`` (``rounds``).
    # Rank r forwards every block but its successor's (the last to reach it): the busiest rank is
    # the one whose successor holds the smallest block. An empty block sends only its lengths (and
    # an fp8 block's scales, one more message, whatever its size).
    sizes = w.shard_sizes(p)
    per_token = 2 * w.batch * w.kv_heads * w.head_dim * w.elem_bytes
    per_block = 4 * w.batch + w.scale_bytes
    sent = (max(sum(n * per_token for i, n in enumerate(sizes) if i != (r + 1) % p) for r in range(p))
            + per_block * (p - 1))
    scale_msgs = 1 if w.scale_bytes else 0
    msgs = max(sum((3 if n else 1) + scale_msgs for i, n in enumerate(sizes) if i != (r + 1) % p) for r in range(p))
    # The caller's shard stays; the block in hand and the one arriving are allocated (one for p = 2).
    return _prediction("ring", "ring", cluster, w, compute, rounds, sent, msgs, min(2, p - 1) * shard)


def _prediction(strategy, label, cluster, w, local, comm, sent, msgs, extra) -> StepPrediction:
    p = cluster.world_size
    over = cluster.step_overhead_us
    return StepPrediction(
        strategy=strategy, plan=label, world_size=p, seq_len=w.seq_len,
        time_us=over + local + comm, local_us=local, comm_us=comm, overhead_us=over,
        bytes_per_rank=int(sent), messages=int(msgs),
        peak_mem_bytes=int(w.shard_bytes(p) + extra), extra_mem_bytes=int(extra),
    )


def predict_step(cluster: ClusterSpec, w: Workload, strategy: str, plan: ReductionPlan | None = None) -> StepPrediction:
    """One strategy by name: ``tree`` (with ``plan``, default the cluster's hierarchical binary
    tree), ``allreduce`` or ``ring``."""
    if strategy == "tree":
        return predict_tree(cluster, w, plan if plan is not None else cluster_plan(cluster))
    if strategy == "allreduce":
        return predict_allreduce(cluster, w)
    if strategy == "ring":
        return predict_ring(cluster, w)
    raise ConfigError(f"unknown strategy {strategy!r}; choose tree, allreduce or ring")


def cluster_hierarchy(cluster: ClusterSpec) -> list[tuple[str, list[list[int]]]]:
    """The cluster's hierarchy, fastest first: the node's own levels (per node), then the network
    joining the nodes. Ranks r of node n are ``n * g .. n * g + g - 1``."""
    g, nodes = cluster.ranks_per_node, cluster.nodes
    node_levels = list(cluster.hierarchy) if cluster.hierarchy else [
        (cluster.intra.kind if cluster.intra is not None else "self", [list(range(g))])]
    levels = []
    for kind, groups in node_levels:
        levels.append((kind, [[n * g + r for r in grp] for n in range(nodes) for grp in groups]))
    if nodes > 1:
        levels.append(("network", [list(range(nodes * g))]))
    return levels


def cluster_plan(cluster: ClusterSpec, fanout: int = 2) -> ReductionPlan:
    """The topology-aware tree for the cluster: k-ary inside the fastest groups, then among their
    leaders level by level, the network last (``reduce.hier_plan``)."""
    from ..reduce.hier_plan import hierarchical_parents

    p = cluster.world_size
    if p == 1:
        return ReductionPlan("tree", fanout)
    levels = cluster_hierarchy(cluster)
    parents = hierarchical_parents(levels, fanout)
    kinds = ">".join(dict.fromkeys(k for k, _ in levels))
    return ReductionPlan("tree", fanout, parents=parents, label=f"hier {kinds} k={fanout}")

