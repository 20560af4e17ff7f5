"""Paged KV shards and several query tokens per row across spawned CPU ranks (gloo), world sizes 1
to 5: tree (several plans), allreduce and ring, against a float64 computation of the union of the
shards (``tests/paged_inputs.float64_over_shards``), ``out`` and ``lse``.

Under ``causal`` the new tokens' KV is the last Sq valid keys of the last rank's shard. One launch
per world size runs every case (spawning is the slow part on 2 cores).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist.paged_rank_fns import MTCase, run_mt_cases, short_last_shard
from tests.dist.per_world import each_case
from tests.paged_inputs import float64_over_shards
from tests.tolerances import assert_decode_close, assert_state_close, tol_for
from tree_attn import DistributedError
from tree_attn.launch.spawn import launch_ranks

WORLD_SIZES = (1, 2, 3, 4, 5)
LAST_LEN = 20  # the last rank's shard: room for 16 new tokens


def _shards(world: int):
    """Shard lengths (rank 1 empty from 3 ranks on) and per-row valid lengths (a row of length 0
    on the middle ranks; the last rank's rows hold at least 16 keys, for Sq=16 under causal)."""
    lens = [0 if (r == 1 and world >= 3) else (5 * r + 3) % 11 for r in range(world - 1)] + [LAST_LEN]
    valid = [(n, 0 if 0 < r < world - 1 else max(n - 2, 0)) for r, n in enumerate(lens[:-1])] + [(LAST_LEN, 17)]
    return tuple(lens), tuple(valid)


def _cases_for(world: int) -> list[MTCase]:
    lens, valid = _shards(world)
    cases = []
    for s in ("allreduce", "tree", "ring"):
        seed = 100 * world + 10 * ("allreduce", "tree", "ring").index(s)
        cases += [
            MTCase(f"{s}-paged-bs3-one-token", s, lens, valid, block_size=3, q3=True, seed=seed),
            MTCase(f"{s}-contig-sq5-causal-gqa4", s, lens, valid, sq=5, causal=True, seed=seed + 1),
            MTCase(f"{s}-paged-bs16-sq16-causal-mqa", s, lens, valid, sq=16, causal=True, block_size=16, kv_heads=1,
                   seed=seed + 2),
            MTCase(f"{s}-paged-bs17-sq2-bf16", s, lens, valid, sq=2, block_size=17, dtype=torch.bfloat16,
                   seed=seed + 3),
        ]
    rev = tuple(reversed(range(world)))
    for k in sorted({3, world} & set(range(3, world + 1))):
        cases.append(MTCase(f"tree-k{k}-reversed-paged-bs1-sq4-causal-d80", "tree", lens, valid, sq=4, causal=True,
                            block_size=1, fanout=k, rank_order=rev, q_heads=4, kv_heads=4, head_dim=80, seed=world + k))
    return cases


def _step_case(world: int) -> MTCase:
    valid = tuple((9, 4) for _ in range(world - 1)) + ((5, 3),)
    return MTCase("step", "tree", tuple([9] * world), valid, sq=3, causal=True, block_size=4, seed=7 + world)


@functools.cache
def _run(world: int):
    return launch_ranks(run_mt_cases, world, args=(_cases_for(world), _step_case(world)), timeout_s=90)


def _truth(case: MTCase):
    q, shards = case.inputs()
    out, lse = float64_over_shards(q, [s[:3] for s in shards], case.causal)
    return (out[:, 0], lse[:, 0]) if case.q3 else (out, lse)


@each_case(WORLD_SIZES, _cases_for)
def test_paged_multi_token_is_exact_on_every_rank(world, index):
    case = _cases_for(world)[index]
    per_rank = _run(world)
    ref_out, ref_lse = _truth(case)
    first_out, first_lse = per_rank[0][0][index]
    for rank in range(world):
        out, lse = per_rank[rank][0][index]
        assert out.dtype == case.dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
        assert_state_close(out, lse, ref_out, ref_lse, case.dtype)
        if case.strategy == "tree":  # the root's bits, broadcast
            assert torch.equal(out, first_out) and torch.equal(lse, first_lse)


@pytest.mark.parametrize("strategy", ["tree", "allreduce"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_tree_decode_step_follows_block_tables_and_lengths(world, strategy):
    """TreeDecodeStep, paged and causal: queries, the last rank's lengths and every rank's block
    table change between replays; each step is exact against float64 on every rank."""
    case = _step_case(world)
    _, shards = case.inputs()
    for rank in range(world):
        history, captured = _run(world)[rank][1][strategy]
        assert not captured  # CPU ranks: eager
        for s, (q, all_lens, flipped, out, lse) in enumerate(history):
            truth = [((k.flip(0), v.flip(0)) if flipped else (k, v)) + (all_lens[r],)
                     for r, (k, v, *_rest) in enumerate(shards)]
            ref_out, ref_lse = float64_over_shards(q, truth, True)
            assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


def test_causal_needs_the_new_tokens_on_the_last_rank():
    """A last-rank row with fewer valid keys than Sq is a ShapeError that says where the new
    tokens' KV must be (world size 1: the only rank is the last)."""
    error = _run(1)[0][2]
    assert error is not None
    assert "the 3 new tokens' keys must be the last 3 valid keys of the last rank's (rank 0) shard" in error
    assert "row 1 has only 2 valid keys" in error


def test_causal_short_shard_on_the_last_of_three_ranks_stops_the_run():
    """At world size 3 it is rank 2 (the last) that refuses; the run stops with its message (from
    rank 2 itself, or from a peer that the shape exchange told, whichever reports first)."""
    with pytest.raises(DistributedError, match=(
            r"rank (2 failed|[01] failed: rank 2 refused its inputs.*): causal decoding over 3 rank\(s\): the 4 new "
            r"tokens. keys must be the last 4 valid keys of the last rank.s \(rank 2\) shard")):
        launch_ranks(short_last_shard, 3, timeout_s=20)


N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gpu_ranks_paged_multi_token_exact_and_steps_captured(world):
    """The same cases on one GPU per rank (NCCL, the compiled kernel), and the TreeDecodeStep loop
    as replayed CUDA graphs with block tables rewritten between replays."""
    if N_GPUS < world:
        pytest.skip(f"needs {world} GPUs" if world > 1 else "needs a GPU")
    cases = _cases_for(world)
    per_rank = launch_ranks(run_mt_cases, world, args=(cases, _step_case(world)), backend="nccl", device_kind="cuda",
                            timeout_s=120)
    for index, case in enumerate(cases):
        ref_out, ref_lse = _truth(case)
        for rank in range(world):
            out, lse = per_rank[rank][0][index]
            assert_decode_close(out, lse, ref_out, ref_lse, tol_for(case.dtype, device="cuda"),
                                what=f"{case.name} rank {rank}")
    _, shards = _step_case(world).inputs()
    for strategy in ("tree", "allreduce"):
        for rank in range(world):
            history, captured = per_rank[rank][1][strategy]
            assert captured, f"{strategy}: rank {rank} ran eagerly"
            for s, (q, all_lens, flipped, out, lse) in enumerate(history):
                truth = [((k.flip(0), v.flip(0)) if flipped else (k, v)) + (all_lens[r],)
                         for r, (k, v, *_rest) in enumerate(shards)]
                ref_out, ref_lse = float64_over_shards(q, truth, True)
                assert_decode_close(out, lse, ref_out, ref_lse, tol_for(torch.float32, device="cuda"),
                                    what=f"{strategy} step {s}")
