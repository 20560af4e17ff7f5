"""Plan once, step many times, across spawned CPU ranks (gloo): the static-buffer step, the caches
behind the public collectives, bitwise repeatability, and NaN inputs.

CPU ranks on purpose (gloo; on GPU machines too), except the tests marked ``gpu``: the same loop
on one rank per GPU (NCCL), each step a replayed CUDA graph.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist.rank_fns import gpu_static_loops, prepared_checks, shard_inputs
from tests.tolerances import assert_state_close
from tree_attn.launch.spawn import launch_ranks


def _float64(q, ks, vs, lens=None):
    """Attention of q over the concatenated shards' valid keys, float64 (NaN propagates)."""
    b, hq, d = q.shape
    hkv = ks[0].shape[2]
    masks = []
    for i, kk in enumerate(ks):
        n = kk.shape[1]
        valid = lens[i] if lens is not None else torch.full((b,), n)
        masks.append(torch.arange(n)[None, :] < valid[:, None])
    k = torch.cat(ks, 1).double()
    v = torch.cat(vs, 1).double()
    mask = torch.cat(masks, 1)
    qd = q.double().view(b, hkv, hq // hkv, d) * d**-0.5
    s = torch.einsum("bhgd,bnhd->bhgn", qd, k).masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    # Masked keys must not contribute even if their values were NaN: zero them explicitly.
    out = torch.einsum("bhgn,bnhd->bhgd", p, torch.where(mask[:, :, None, None], v, 0.0))
    return out.reshape(b, hq, d), lse.reshape(b, hq)


WORLD_SIZES = (1, 2, 3, 5, 6)  # 2: where a tree_decode once came back 1e-6 off (the bitwise stress test)
CAPACITY, STEPS, CALLS = 12, 5, 25
@functools.cache
def _run(world: int) -> list:
    return launch_ranks(prepared_checks, world, args=(CAPACITY, STEPS, CALLS), timeout_s=120)


def _caches(world: int, capacity: int, seed: int):
    """Every rank's (k, v) as static_step_loop draws them."""
    g = torch.Generator().manual_seed(seed)
    torch.randn(2, capacity, 2, 16, generator=g)
    torch.randn(2, capacity, 2, 16, generator=g)
    return [(torch.randn(2, capacity, 2, 16, generator=g), torch.randn(2, capacity, 2, 16, generator=g))
            for _ in range(world)]


@pytest.mark.parametrize("strategy", ["tree", "allreduce"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_static_step_follows_in_place_updates(world, strategy):
    steps = STEPS
    per_rank = [r[("static", strategy)] for r in _run(world)]
    caches = _caches(world, CAPACITY, 40 + world)
    for rank, (history, counted, traffic, captured) in enumerate(per_rank):
        assert not captured  # CPU ranks: eager, same prepared objects
        assert counted == (steps * traffic[0], steps * traffic[1])
        for s, (q, lens, out, lse) in enumerate(history):
            ref_out, ref_lse = _float64(q, [c[0] for c in caches], [c[1] for c in caches], lens)
            assert_state_close(out, lse, ref_out, ref_lse, torch.float32)
            first = per_rank[0][0][s]
            same = torch.equal(out, first[2]) and torch.equal(lse, first[3])
            assert same, f"rank {rank} step {s} differs from rank 0"
    if world > 1:
        # messages per step come from the plan: the tree's edges (2 (p-1) in all), or 2 all-reduces
        total = sum(r[2][0] for r in per_rank)
        assert total == (2 * (world - 1) if strategy == "tree" else world * 4 * (world - 1))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_only_one_rank_shard_grows_no_rank_waits(world):
    steps = STEPS
    per_rank = [r["growing"] for r in _run(world)]
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(1, 4 + r, 2, 16, generator=g) for r in range(world)]
    extra = torch.randn(1, steps, 2, 16, generator=g)
    q = torch.randn(1, 4, 16, generator=g)
    for s in range(steps):
        ks = base[:-1] + [torch.cat([base[-1], extra[:, : s + 1]], 1)]
        ref_out, ref_lse = _float64(q, ks, [k.flip(-1) for k in ks])
        for rank in range(world):
            assert_state_close(*per_rank[rank][s], ref_out, ref_lse, torch.float32)


@pytest.mark.parametrize("strategy", ["tree", "allreduce", "ring"])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_repeated_calls_are_bitwise_identical(world, strategy):
    """Buffer reuse across isend/irecv must never race: identical calls give identical bits
    (random shard sizes, some empty)."""
    per_rank = [r[("repeat", strategy)] for r in _run(world)]
    for rank, (lens, outs) in enumerate(per_rank):
        first_out, first_lse = outs[0]
        for i, (out, lse) in enumerate(outs):
            assert torch.equal(out, first_out) and torch.equal(lse, first_lse), f"rank {rank} call {i} (shards {lens})"
        if strategy == "tree":
            assert torch.equal(first_out, per_rank[0][1][0][0])


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_nan_in_the_data_is_nan_in_that_row_on_every_rank_and_strategy(world):
    per_rank = [r["nan"] for r in _run(world)]

    for strategy, what in per_rank[0]:
        lens = [3 + r for r in range(world)]
        q, shards = shard_inputs(17, world, lens)
        ks = [s[0].clone() for s in shards]
        vs = [s[1].clone() for s in shards]
        bad = min(2, world - 1)
        if what == "query":
            q[1, 3, 0] = float("nan")
        else:
            (ks if what == "key" else vs)[bad][1, 1, 0, 0] = float("nan")
        ref_out, ref_lse = _float64(q, ks, vs)
        for rank in range(world):
            out, lse = per_rank[rank][(strategy, what)]
            label = f"{strategy}/{what}/rank {rank}"
            assert torch.equal(torch.isnan(out), torch.isnan(ref_out)), f"{label}: NaN exactly where float64 has it"
            assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), label
            assert torch.isnan(ref_out).any(), label  # the case does poison something
            ok = ~torch.isnan(ref_out)
            assert (out[ok].double() - ref_out[ok]).abs().max() < 2e-5, label


N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2, 3])
def test_gpu_step_is_a_replayed_graph_and_exact(world):
    """The graph-captured step (local kernel, merge kernel, NCCL messages or all-reduces, output
    copies) follows in-place updates of q and seq_lens exactly, on every rank, bit-identically."""
    if N_GPUS < world:
        pytest.skip(f"needs {world} GPUs" if world > 1 else "needs a GPU")
    per_rank = launch_ranks(gpu_static_loops, world, args=(CAPACITY, STEPS), backend="nccl", device_kind="cuda",
                            timeout_s=120)
    caches = _caches(world, CAPACITY, 40 + world)
    for strategy in ("tree", "allreduce"):
        for rank, r in enumerate(per_rank):
            history, counted, traffic, captured = r[strategy]
            assert captured, f"{strategy}: rank {rank} ran eagerly"
            assert counted == (STEPS * traffic[0], STEPS * traffic[1])
            for s, (q, lens, out, lse) in enumerate(history):
                ref_out, ref_lse = _float64(q, [c[0] for c in caches], [c[1] for c in caches], lens)
                assert_state_close(out, lse, ref_out, ref_lse, torch.float32)
                first = per_rank[0][strategy][0][s]
                assert torch.equal(out, first[2]) and torch.equal(lse, first[3])
