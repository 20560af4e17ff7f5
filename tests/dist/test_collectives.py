"""tree_decode and ring_decode across spawned CPU ranks (gloo) against a float64 computation.

One launch per world size runs every case for that size (spawning ranks is the slow part on the
2-core CI machines); each case is then checked as its own test.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch

from tests.dist.per_world import each_case
from tests.dist.rank_fns import (
    Case,
    dies_on_rank_2,
    fails_after_its_sockets_close,
    mismatched_query,
    raises_on_rank_1,
    refusal_inputs,
    refusals_and_modes,
    ring_lengths_and_dtype_checks,
    run_cases,
)
from tests.tolerances import assert_state_close
from tree_attn import DistributedError
from tree_attn.kernels.reference import decode_attention_float64
from tree_attn.launch.spawn import launch_ranks

WORLD_SIZES = (1, 2, 3, 4, 5, 8)


def _cases_for(world: int) -> list[Case]:
    even = tuple([6] * world)
    uneven = tuple((3 * r + 1) % 7 for r in range(world))  # includes empty shards for world >= 3
    few = tuple(1 if r % 2 == 0 else 0 for r in range(world))  # fewer tokens than ranks
    rev = tuple(reversed(range(world)))
    fanouts = sorted({2, 3, world} & set(range(2, max(world, 2) + 1))) or [2]
    cases: list[Case] = []
    for strategy in ("allreduce", "tree", "ring"):
        cases.append(Case(f"{strategy}-even", strategy, even, seed=world))
        cases.append(Case(f"{strategy}-uneven-gqa8", strategy, uneven, q_heads=16, kv_heads=2, seed=world + 1))
        cases.append(Case(f"{strategy}-few-tokens-gqa1", strategy, few, q_heads=4, kv_heads=4, seed=world + 2))
        valid = tuple((max(n - 1, 0), 0) for n in uneven)  # a partial prefix, and an empty row
        cases.append(Case(f"{strategy}-seqlens-zeros", strategy, uneven, valid=valid, seed=world + 3))
        cases.append(Case(f"{strategy}-bf16", strategy, uneven, dtype=torch.bfloat16, seed=world + 4))
        cases.append(Case(f"{strategy}-fp16", strategy, even, dtype=torch.float16, seed=world + 5))
        cases.append(Case(f"{strategy}-large-logits", strategy, even, q_scale=30.0, seed=world + 6))
    for k in fanouts:
        cases.append(Case(f"tree-k{k}", "tree", uneven, fanout=k, q_heads=8, kv_heads=2, seed=world + 10 + k))
        cases.append(Case(f"tree-k{k}-reversed-order", "tree", uneven, fanout=k, rank_order=rev, seed=world + 20 + k))
    return cases


def _masked_float64(case: Case):
    """Attention over the union of the shards' valid keys, in float64."""
    q, shards = case.inputs()
    k = torch.cat([s[0] for s in shards], dim=1).double()
    v = torch.cat([s[1] for s in shards], dim=1).double()
    masks = []
    for kk, _, sl in shards:
        n = kk.shape[1]
        lens = sl if sl is not None else torch.full((case.batch,), n)
        masks.append(torch.arange(n)[None, :] < lens[:, None])
    mask = torch.cat(masks, dim=1)  # [B, N]
    g = case.q_heads // case.kv_heads
    qd = q.double().view(case.batch, case.kv_heads, g, case.head_dim) * case.head_dim**-0.5
    s = torch.einsum("bhgd,bnhd->bhgn", qd, k).masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("bhgn,bnhd->bhgd", p, v)
    return out.reshape(case.batch, case.q_heads, case.head_dim), lse.reshape(case.batch, case.q_heads)


@functools.cache
def _run_world(world: int):
    return launch_ranks(run_cases, world, args=(_cases_for(world),), timeout_s=60)


@each_case(WORLD_SIZES, _cases_for)
def test_every_rank_gets_the_exact_attention(world, index):
    case = _cases_for(world)[index]
    per_rank = _run_world(world)
    ref_out, ref_lse = _masked_float64(case)
    first_out, first_lse = per_rank[0][index]
    for rank in range(world):
        out, lse = per_rank[rank][index]
        assert out.dtype == case.dtype and out.shape == (case.batch, case.q_heads, case.head_dim)
        # contiguous, as NCCL collectives on the caller's side require
        assert out.is_contiguous() and lse.is_contiguous()
        assert_state_close(out, lse, ref_out, ref_lse, case.dtype, large_logits=case.q_scale > 1)
        # every rank holds the same bits (the tree broadcasts the root's result; all-reduce is symmetric)
        if case.strategy == "tree":
            assert torch.equal(out, first_out) and torch.equal(lse, first_lse)


def test_ranks_with_different_query_shapes_get_a_clear_error():
    with pytest.raises(DistributedError, match=r"ranks disagree on the query/KV shape.*Hq 8 vs 4|Hq 4 vs 8"):
        launch_ranks(mismatched_query, 3, timeout_s=30)


def test_ring_with_known_lengths_and_kv_dtype_check():
    per_rank = launch_ranks(ring_lengths_and_dtype_checks, 3, timeout_s=60)
    for rank, (plain, given, wrong, dtype_err) in enumerate(per_rank):
        # lengths given up front: the same exchange, so the same bits, without the shape all-gather
        assert torch.equal(plain[0], given[0]) and torch.equal(plain[1], given[1])
        assert wrong is not None and "lengths=[1, 2, 3]" in wrong and f"rank {rank}" in wrong
        assert dtype_err is not None and "KV dtype" in dtype_err
        assert "bfloat16" in dtype_err and "float32" in dtype_err


def test_a_rank_that_raises_stops_the_run():
    with pytest.raises(DistributedError, match="rank 1 failed: ValueError: boom on purpose"):
        launch_ranks(raises_on_rank_1, 3, timeout_s=30)


def test_the_failing_ranks_own_error_is_reported_not_its_peers_lost_connection():
    """Rank 0 reports first that its peer went away; rank 1's own error, the cause, comes 0.3 s
    later and is the one raised (the launcher waits up to PEER_ERROR_GRACE_S for it)."""
    with pytest.raises(DistributedError) as err:
        launch_ranks(fails_after_its_sockets_close, 2, args=(0.3,), timeout_s=30)
    assert str(err.value).startswith("rank 1 failed: ValueError: rank 1's own failure"), str(err.value)


def test_a_rank_that_dies_stops_the_others_in_bounded_time():
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"^rank 2 died \(exit code 3\) without reporting; the other ranks"):
        launch_ranks(dies_on_rank_2, 3, timeout_s=15)
    assert time.monotonic() - t0 < 60


def test_a_rank_whose_inputs_are_refused_stops_every_rank_at_once():
    """Rank 1's own checks refuse its first call (a float64 q, an fp8 shard without k_scale,
    seq_lens beyond its shard): it raises its error and ranks 0 and 2 a DistributedError quoting it,
    through the shape exchange they all join (they used to wait out the collective timeout, then
    report a timed-out all_gather). And tree_decode's results hold with a q that requires grad and
    for a signature first met inside torch.inference_mode."""
    t0 = time.monotonic()
    per_rank = launch_ranks(refusals_and_modes, 3, timeout_s=60)
    assert time.monotonic() - t0 < 60  # far below the 60 s a waiting rank would need to time out
    own = {"tree_decode": ("ShapeError", "q must be float16, bfloat16 or float32; got torch.float64"),
           "TreeDecodeStep": ("ConfigError", "needs its dequantization scales: pass k_scale"),
           "ring_decode": ("ShapeError", "seq_lens must lie in 0..N=0")}
    for rank, (errors, _) in enumerate(per_rank):
        for call, (kind, text) in own.items():
            assert errors[call] is not None, f"rank {rank}, {call}: no error"
            got_kind, got = errors[call]
            if rank == 1:
                assert got_kind == kind and text in got, (rank, call, errors[call])
            else:
                assert got_kind == "DistributedError", (rank, call, errors[call])
                assert "rank 1 refused its inputs" in got and f"{kind}: " in got and text in got, (rank, call, got)
    q, shards = refusal_inputs()
    k = torch.cat([s[0] for s in shards], dim=1)
    v = torch.cat([s[1] for s in shards], dim=1)
    for name, heads in (("grad", 8), ("after inference mode", 4), ("step built in inference mode", 4)):
        ref_out, ref_lse = decode_attention_float64(q[:, :heads].contiguous(), k, v)
        for rank, (_, results) in enumerate(per_rank):
            out, lse = results[name]
            assert not out.requires_grad
            assert_state_close(out, lse, ref_out, ref_lse, torch.float32)
