"""The zig-zag assignment of prefill positions to ranks, and the ring prefill's per-block plan: every
position exactly once, balanced tokens and causal work, empty chunks and ranks, and no computed
query-key pair outside the causal triangle (pure arithmetic, no ranks)."""

from __future__ import annotations

import pytest

from tree_attn.errors import ConfigError
from tree_attn.reduce.ring_prefill import BlockCall, plan_block, plan_ring
from tree_attn.reduce.zigzag import Run, SequenceShards, contiguous, zigzag

SIZES = [0, 1, 2, 3, 5, 7, 11, 12, 13, 64, 301, 1000, 4097]
WORLDS = [1, 2, 3, 4, 5, 6, 8]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", SIZES)
def test_every_position_once_tokens_balanced(n, world):
    shards = zigzag(n, world)  # __post_init__ checks the cover; here it is checked again, plainly
    held = sorted(i for r in range(world) for i in shards.positions(r))
    assert held == list(range(n))
    for r in range(world):
        assert shards.positions(r) == sorted(shards.positions(r))
        assert len(shards.runs[r]) <= 2
    sizes = shards.sizes()
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n
    assert sizes[-1] == min(sizes), "the last rank (it receives the new tokens) holds the fewest prompt tokens"
    # the 2p chunks differ by at most one token
    chunks = sorted(run.size for mine in shards.runs for run in mine)
    if n >= 2 * world:
        assert len(chunks) == 2 * world and chunks[-1] - chunks[0] <= 1


def test_rank_r_holds_chunks_r_and_mirror():
    shards = zigzag(16, 4)  # 8 chunks of 2
    assert shards.runs == ((Run(0, 2), Run(14, 16)), (Run(2, 4), Run(12, 14)), (Run(4, 6), Run(10, 12)),
                           (Run(6, 8), Run(8, 10)))
    # not divisible: 7 tokens over 2 ranks -> rank 0 holds 4 (chunks of 2 and 2), rank 1 holds 3 (1 and 2)
    assert zigzag(7, 2).runs == ((Run(0, 2), Run(5, 7)), (Run(2, 3), Run(3, 5)))


@pytest.mark.parametrize("n, world, empty", [(3, 5, [3, 4]), (1, 4, [1, 2, 3]), (0, 3, [0, 1, 2]), (5, 4, [])])
def test_fewer_tokens_than_ranks_leaves_ranks_empty(n, world, empty):
    shards = zigzag(n, world)
    assert [r for r in range(world) if not shards.runs[r]] == empty
    assert sum(shards.sizes()) == n


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n", [4096, 4099, 65536 + 7])
def test_causal_work_balanced_where_contiguous_is_not(n, world):
    zz = [zigzag(n, world).causal_pairs(r) for r in range(world)]
    mean = sum(zz) / world
    assert max(zz) / mean <= 1.01 and min(zz) / mean >= 0.99  # the benchmark's goal is 1.25x
    assert sum(zz) == n * (n + 1) // 2
    cont = [contiguous(n, world).causal_pairs(r) for r in range(world)]
    assert max(cont) / mean > 0.99 * (2 * world - 1) / world  # the last contiguous shard: (2p - 1)/p of the mean


def test_to_dict_lists_each_ranks_runs_as_start_stop():
    """The assignment as ``generate --json`` reports it: stop is exclusive, empty ranks hold []."""
    assert zigzag(7, 2).to_dict() == {"scheme": "zigzag", "tokens": 7, "runs": [[[0, 2], [5, 7]], [[2, 3], [3, 5]]]}
    assert contiguous(2, 3).to_dict() == {"scheme": "contiguous", "tokens": 2, "runs": [[[0, 1]], [[1, 2]], []]}


def test_shards_reject_gaps_overlaps_and_unsorted_runs():
    with pytest.raises(ConfigError, match="position 2 is missing"):
        SequenceShards(4, ((Run(0, 2),), (Run(3, 4),)))
    with pytest.raises(ConfigError, match="held twice"):
        SequenceShards(4, ((Run(0, 3),), (Run(2, 4),)))
    with pytest.raises(ConfigError, match="sorted"):
        SequenceShards(4, ((Run(2, 4), Run(0, 2)),))
    with pytest.raises(ConfigError, match="cover"):
        SequenceShards(5, ((Run(0, 4),),))
    for bad in [(-1, 2), (3, 3)]:
        with pytest.raises(ConfigError):
            Run(*bad)
    for args in [(-1, 2), (4, 0), (4, True), (True, 2)]:
        with pytest.raises(ConfigError):
            zigzag(*args)


@pytest.mark.parametrize("layout", [zigzag, contiguous])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", [0, 1, 3, 7, 12, 13, 301])
def test_ring_plan_computes_exactly_the_causal_pairs(layout, n, world):
    """Every block call lies inside the causal triangle and together they cover it: the computed
    pairs equal the causal pairs, query by query (no masked block, none missing)."""
    shards = layout(n, world)
    for r in range(world):
        plan = plan_ring(shards, r)
        assert plan.pairs() == shards.causal_pairs(r)
        mine = shards.positions(r)
        seen = {i: 0 for i in mine}
        for s, calls in enumerate(plan.steps):
            keys = shards.positions(plan.source(s))
            for call in calls:
                for qi in range(call.q_start, call.q_stop):
                    visible = keys[:qi + 1] if call.causal else keys[:call.k_stop]
                    assert all(kpos <= mine[qi] for kpos in visible), (r, s, call)
                    seen[mine[qi]] += len(visible)
        assert all(seen[i] == i + 1 for i in mine), (r, seen)
        if layout is zigzag:
            assert all(len(calls) <= 1 for calls in plan.steps), "zig-zag: one call per ring step"


def test_plan_block_rules():
    a, b = (Run(0, 2), Run(6, 8)), (Run(2, 4), Run(4, 6))
    assert plan_block(a, a, own=True) == (BlockCall(0, 4, 4, causal=True),)
    assert plan_block(a, b, own=False) == (BlockCall(2, 4, 4),)  # run 6..7 sees the whole block, 0..1 nothing
    assert plan_block(b, a, own=False) == (BlockCall(0, 4, 2),)  # both runs see 0..1 only: one call
    assert plan_block((), a, own=False) == () and plan_block(a, (), own=False) == ()
    with pytest.raises(ConfigError, match="overlaps"):
        plan_block((Run(0, 4),), (Run(2, 3),), own=False)


def test_bytes_per_layer_of_the_ring():
    shards = zigzag(1000, 4)  # 250 tokens each
    plan = plan_ring(shards, 1)
    assert plan.block_bytes_sent(kv_heads=8, head_dim=128, itemsize=2) == (3 * 250 * 2 * 8 * 128 * 2, 3)
    few = plan_ring(zigzag(2, 4), 3)  # ranks 2 and 3 are empty; rank 3 forwards blocks of 3, 2, 1
    assert few.block_bytes_sent(1, 1, 1) == (2 * 1, 1)


@pytest.mark.parametrize("hq, hkv, s, n, causal", [
    *[(hq, hkv, s, s, causal) for hq, hkv, s in [(8, 2, 130), (4, 4, 64), (6, 3, 1), (4, 1, 0)]
      for causal in (True, False)],
    (8, 2, 70, 200, False), (4, 2, 0, 5, False)])  # fewer queries than keys: full attention only
def test_the_gpus_blockwise_prefill_attention_equals_float64(hq, hkv, s, n, causal):
    """The GPUs' portable prefill attention (blocks of query rows), run here on CPU tensors:
    out and lse against float64, grouped-query heads, rows not a multiple of the block, no rows.
    The query is a transposed view, as the attention hook hands it over."""
    import torch

    from tests.tolerances import assert_state_close
    from tree_attn.kernels.prefill import attention_blockwise

    g = torch.Generator().manual_seed(s * 7 + n)
    q = torch.randn(s, hq, 16, generator=g).transpose(0, 1)
    k, v = torch.randn(hkv, n, 16, generator=g), torch.randn(hkv, n, 16, generator=g)
    out, lse = attention_blockwise(q, k, v, 0.25, causal)
    scores = torch.einsum("hsd,hnd->hsn", q.double(), k.double().repeat_interleave(hq // hkv, 0)) * 0.25
    if causal:
        scores = scores.masked_fill(torch.ones(s, n, dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref = torch.einsum("hsn,hnd->hsd", torch.exp(scores - ref_lse.unsqueeze(-1)),
                       v.double().repeat_interleave(hq // hkv, 0))
    assert out.shape == (hq, s, 16) and lse.shape == (hq, s) and out.dtype == torch.float32
    if s:
        assert_state_close(out.transpose(0, 1), lse.transpose(0, 1), ref.transpose(0, 1), ref_lse.transpose(0, 1),
                           torch.float32)
