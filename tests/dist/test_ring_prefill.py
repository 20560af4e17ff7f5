"""The ring prefill's attention across spawned CPU ranks (gloo) against a float64 full causal
attention of the whole sequence: out and lse of every position, world sizes 1 to 6, grouped-query
and plain heads, sequences not divisible by the world size, fewer tokens than ranks (empty ranks
relay the blocks), zig-zag and contiguous layouts; and the bytes and messages counted.

One launch per world size runs every case (spawning is the slow part on two cores)."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist.per_world import each_case
from tests.dist.prefill_rank_fns import PrefillCase, ring_prefill_cases
from tests.tolerances import assert_state_close
from tree_attn.launch.spawn import launch_ranks
from tree_attn.reduce.ring_prefill import plan_ring

WORLD_SIZES = (1, 2, 3, 4, 5, 6)


def _cases_for(world: int) -> list[PrefillCase]:
    return [
        PrefillCase("zigzag-gqa4-uneven", 6 * world + 5, seed=world),
        PrefillCase("zigzag-mha-rows", 4 * world + 3, q_heads=4, kv_heads=4, head_dim=8, merge_rows=3, seed=world + 10),
        PrefillCase("zigzag-fewer-than-ranks", max(1, world - 2), q_heads=4, kv_heads=1, seed=world + 20),
        PrefillCase("zigzag-bf16-gqa8", 3 * world + 1, q_heads=16, kv_heads=2, dtype=torch.bfloat16, seed=world + 30),
        PrefillCase("contiguous-gqa2", 5 * world + 2, q_heads=4, kv_heads=2, layout="contiguous", seed=world + 40),
    ]


@functools.cache
def _run(world: int):
    return launch_ranks(ring_prefill_cases, world, backend="gloo", device_kind="cpu", timeout_s=60.0,
                        args=(_cases_for(world),))


def _float64_causal(q, k, v, scale):
    hq, n, _ = q.shape
    g = hq // k.shape[0]
    kk = k.double().repeat_interleave(g, 0)
    vv = v.double().repeat_interleave(g, 0)
    scores = torch.einsum("hsd,hnd->hsn", q.double(), kk) * scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.einsum("hsn,hnd->hsd", torch.exp(scores - lse.unsqueeze(-1)), vv), lse


@pytest.mark.slow
@each_case(WORLD_SIZES, _cases_for)
def test_ring_prefill_equals_float64_causal_attention(world, index):
    case = _cases_for(world)[index]
    per_rank = _run(world)
    q, k, v, scale = case.inputs()
    ref_out, ref_lse = _float64_causal(q, k, v, scale)
    shards = case.shards(world)
    hq, n, d = q.shape
    out = torch.full((hq, n, d), float("nan"), dtype=torch.float32)
    lse = torch.full((hq, n), float("nan"), dtype=torch.float32)
    for r, results in enumerate(per_rank):
        pos, o, l, sent, messages, pairs = results[index]
        assert pos.tolist() == shards.positions(r)
        assert o.shape == (hq, len(pos), d) and l.shape == (hq, len(pos)) and o.dtype == torch.float32
        out[:, pos], lse[:, pos] = o, l
        # bytes and messages: the non-empty blocks this rank forwarded (p - 1 steps of one layer)
        expected = plan_ring(shards, r).block_bytes_sent(k.shape[0], d, k.element_size())
        assert (sent, messages) == expected
        assert pairs == shards.causal_pairs(r)
    # [S, Hq, D] rows as the tolerance table's batch rows
    assert_state_close(out.transpose(0, 1), lse.transpose(0, 1), ref_out.transpose(0, 1), ref_lse.transpose(0, 1),
                       case.dtype)
