"""fp8 KV shards across CPU ranks (gloo): tree_decode, the all-reduce merge, ring_decode,
TreeDecodeStep and RingDecodeStep (generate's ring layer step) at world sizes 1-5, against float64
on the union of the DEQUANTIZED shards (each rank's stored values times its own scales), out and
lse at the bf16 tolerance. Contiguous and
paged shards, GQA, shards and rows that are empty or not a multiple of the page, several causal
query tokens, scales per KV head, as 0-d tensors and as Python numbers.

Then the ring's traffic, counted exactly: an fp8 block is half a bf16 block's bytes, plus one
message of its scales (8 * Hkv bytes) per step, and RingDecodeStep sends what ring_decode sends.

One spawn of 5 ranks runs every world size (one process group per size): spawning is the slow
part on two cores.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist.fp8_rank_fns import MAX_WORLD, F8Case, run_fp8_cases
from tests.dist.per_world import each_case
from tests.fp8_inputs import dequantize
from tests.paged_inputs import float64_over_shards
from tests.tolerances import assert_decode_close, tol_for
from tree_attn.launch.spawn import launch_ranks

WORLDS = tuple(range(1, MAX_WORLD + 1))
TRAFFIC_LENS = {w: tuple(0 if r == 1 else 5 + 3 * r for r in range(w)) for w in WORLDS}  # rank 1 empty
TRAFFIC_SHAPE = (2, 2, 16)  # B, Hkv, D
STRATEGIES = ("tree", "allreduce", "ring")


def _cases_for(world: int) -> list[F8Case]:
    uneven = tuple((3 * r + 2) % 7 for r in range(world))  # an empty shard from world 3 on
    valid = tuple((n, max(n - 2, 0)) for n in uneven)
    causal_lens = tuple(9 if r == world - 1 else (4 * r + 3) % 8 for r in range(world))
    causal_valid = tuple((n, n if r == world - 1 else max(n - 3, 0)) for r, n in enumerate(causal_lens))
    s = 100 * world
    return [
        *(F8Case(f"{st}-gqa4-uneven", st, uneven, valid, seed=s + i) for i, st in enumerate(STRATEGIES)),
        *(F8Case(f"{st}-paged5-sq3-causal", st, causal_lens, causal_valid, sq=3, causal=True, block_size=5,
                 seed=s + 10 + i) for i, st in enumerate(STRATEGIES)),
        F8Case("allreduce-scalar-tensor-scales-mha", "allreduce", uneven, valid, per_head=False, q_heads=4, kv_heads=4,
               seed=s + 20),
        F8Case("ring-number-scales-gqa8", "ring", uneven, valid, per_head=False, number_scales=True, kv_heads=1,
               seed=s + 21),
        F8Case("tree-step-paged3", "tree-step", uneven, valid, block_size=3, seed=s + 22),
        # generate's ring layer step: each rank's pool with its own scales, sent along with it
        F8Case("ring-step-gqa4-uneven", "ring-step", uneven, valid, seed=s + 30),
        F8Case("ring-step-paged5-sq3-causal", "ring-step", causal_lens, causal_valid, sq=3, causal=True,
               block_size=5, seed=s + 31),
        F8Case("ring-step-scalar-tensor-scales-mha", "ring-step", uneven, valid, per_head=False, q_heads=4,
               kv_heads=4, seed=s + 32),
    ]


@functools.cache
def _run():
    cases = {w: _cases_for(w) for w in WORLDS}
    traffic = {w: (TRAFFIC_LENS[w], *TRAFFIC_SHAPE) for w in WORLDS}
    return launch_ranks(run_fp8_cases, MAX_WORLD, args=(cases, traffic), timeout_s=120)


def _truth(case: F8Case):
    q, shards = case.inputs()
    return float64_over_shards(q.double(), [(dequantize(k8, ks), dequantize(v8, vs), lens)
                                            for k8, v8, ks, vs, lens in shards], case.causal)


@each_case(WORLDS, _cases_for)
def test_fp8_shards_exact_on_every_rank(world, index):
    case = _cases_for(world)[index]
    per_rank = _run()
    ref_out, ref_lse = _truth(case)
    for rank in range(world):
        out, lse, _ = per_rank[rank][0][world][index]
        assert out.dtype == torch.bfloat16
        if case.sq == 1:
            out, lse = out[:, None], lse[:, None]
        assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.bfloat16), what=f"{case.name} rank {rank}")
    if world == 1:  # one rank sends nothing (apart from the ring's shape exchange: none at world 1)
        assert per_rank[0][0][world][index][2] == (0, 0)


def _ring_expected(world: int, rank: int, itemsize: int, fp8: bool, shape_exchange: bool) -> tuple[int, int]:
    """(messages, bytes) one rank sends in one ring_decode call, from the counting rules in
    reduce/comm.py: per step its block's lengths (int32 [B]), K and V unless the block is empty,
    and an fp8 block's scales (float32 [2, Hkv]); the shape all-gather ((p - 1) x 9 int64)."""
    b, hkv, d = TRAFFIC_SHAPE
    lens = TRAFFIC_LENS[world]
    messages = nbytes = 0
    for step in range(world - 1):
        n = lens[(rank - step) % world]
        messages += 1 + (2 if n > 0 else 0) + (1 if fp8 else 0)
        nbytes += 4 * b + (2 * b * n * hkv * d * itemsize if n > 0 else 0) + (2 * hkv * 4 if fp8 else 0)
    if shape_exchange:
        messages += world - 1
        nbytes += (world - 1) * 9 * 8
    return messages, nbytes


@pytest.mark.parametrize("world", WORLDS)
def test_ring_sends_fp8_blocks_at_half_the_bytes_plus_scales(world):
    per_rank = _run()
    b, hkv, _ = TRAFFIC_SHAPE
    for rank in range(world):
        counts = per_rank[rank][1][world]
        for name, itemsize, fp8 in (("fp8", 1, True), ("bfloat16", 2, False)):
            first, second = counts[name]
            assert first == _ring_expected(world, rank, itemsize, fp8, True), (name, rank)
            assert second == _ring_expected(world, rank, itemsize, fp8, False), (name, rank)
            assert counts[f"{name}-step"] == second, (name, rank)  # RingDecodeStep counts as ring_decode
        # The K/V bytes exactly halve; the rest is the lengths, and the scales fp8 adds.
        (m8, b8), (m16, b16) = counts["fp8"][1], counts["bfloat16"][1]
        overhead = (world - 1) * 4 * b
        scales = (world - 1) * 2 * hkv * 4
        assert 2 * (b8 - overhead - scales) == b16 - overhead
        assert m8 == m16 + (world - 1)
        if world > 2:
            assert b16 - overhead > 0
