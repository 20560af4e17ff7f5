"""Context-parallel prefill attention: every rank's K/V block travels around the ring once per layer.

Each rank holds some of the prompt's positions (:mod:`.zigzag`) and, in each layer, their queries,
keys and values. A query must see every key at its position or before, wherever it is held. In
``p - 1`` steps every rank forwards the block it holds to its successor and receives its
predecessor's, so at step ``s`` rank ``r`` holds the block of rank ``r - s``; the send and receive
of the next block are posted before the current one is computed on, so the transfer overlaps the
compute (Ring Attention's prefill). Each block's partial state ``(out, lse)`` is merged into the
running state with the one merge (:func:`tree_attn.reduce.state.merge_states`), exactly.

What to compute is decided by positions, once per prefill (:func:`plan_ring`), never by masking:
runs of different ranks are disjoint, so a key run lies wholly before or wholly after a query run.
Before: the pair is computed in full; after: skipped; the rank's own block is one causal call
(its runs are sorted, so index order is position order). Keys before a query run are always a
prefix of a block (a block's runs are sorted too), so a step is a few calls on prefixes; with the
zig-zag layout exactly one call per step. The query-key pairs computed equal the causal pairs
(:meth:`RingPlan.pairs` = :meth:`SequenceShards.causal_pairs`): no masked block is computed.

Why the ring of K/V rather than partial states through the tree. Per layer, rank r's ``S_r``
queries need the other ranks' ``n - S_r`` keys. Moving the keys costs ``2 Hkv D`` elements per
token (K and V) in the cache dtype; moving the computation to the keys (every rank's queries sent
to every other rank, ``Hq D`` elements per token, and ``Hq (D + 1)`` float32 partial states sent
back to be merged along the tree) costs ``Hq D e + 4 Hq (D + 1)`` bytes per token. With
Llama-3.1-8B's grouped-query attention (32 query heads, 8 KV heads, D 128, bf16) that is 4 KiB
against 24.1 KiB per token: the ring moves 6x fewer bytes, and its blocks overlap the compute.
In prefill every rank has as many queries as keys, so this holds for every layer; the tree wins
decode, where one query row meets the whole cache.

Bytes per layer, per rank: the blocks it forwards, ``sum_{s<p-1} S_{r-s} * 2 Hkv D e``, about
``(p - 1) / p * n * 2 Hkv D e``; messages: one per non-empty block forwarded (an empty block is
not sent: both ends know its size from the assignment). :class:`~tree_attn.reduce.comm.CommStats`
counts them as they go.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..cost.capacity import MERGE_ROWS
from ..errors import ConfigError, ShapeError
from ..kernels.prefill import attention_with_lse
from . import comm
from .comm import CommStats
from .state import merge_states
from .zigzag import Run, SequenceShards

# MERGE_ROWS: query rows per partial state merged into the running state; it bounds the float32
# temporaries of a block's call (its partial and the merge's), whatever the rank's share. The
# capacity arithmetic counts it, so it is defined there.

__all__ = ["BlockCall", "PrefillTiming", "RingPlan", "plan_block", "plan_ring", "ring_prefill_attention"]


@dataclass(frozen=True)
class BlockCall:
    """One attention call on a block: this rank's queries ``q_start .. q_stop - 1`` (local
    indices) over the block's keys ``0 .. k_stop - 1``; ``causal``: the rank's own block, query i
    seeing keys 0..i (then ``q_start == 0`` and ``q_stop == k_stop``)."""

    q_start: int
    q_stop: int
    k_stop: int
    causal: bool = False

    @property
    def pairs(self) -> int:
        """Query-key pairs the call computes."""
        rows = self.q_stop - self.q_start
        return rows * (rows + 1) // 2 if self.causal else rows * self.k_stop


def plan_block(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], own: bool) -> tuple[BlockCall, ...]:
    """The calls for a block holding ``k_runs`` seen by queries at ``q_runs`` (both sorted).

    ``own``: the rank's own block (``k_runs == q_runs``): one causal call. Otherwise each query
    run attends in full to the block's runs that end at or before it starts (a prefix of the
    block) and skips the rest; consecutive query runs with the same prefix share one call."""
    size = sum(r.size for r in q_runs)
    if own:
        return (BlockCall(0, size, size, causal=True),) if size else ()
    calls: list[BlockCall] = []
    q_at = 0
    for qr in q_runs:
        prefix = 0
        for kr in k_runs:
            if kr.stop <= qr.start:
                prefix += kr.size
            elif kr.start >= qr.stop:
                break
            else:
                raise ConfigError(f"key run {kr.start}..{kr.stop - 1} overlaps query run {qr.start}..{qr.stop - 1}: "
                                  "ranks' positions must be disjoint")
        if prefix:
            last = calls[-1] if calls else None
            if last is not None and last.q_stop == q_at and last.k_stop == prefix:
                calls[-1] = BlockCall(last.q_start, q_at + qr.size, prefix)
            else:
                calls.append(BlockCall(q_at, q_at + qr.size, prefix))
        q_at += qr.size
    return tuple(calls)


@dataclass(frozen=True)
class RingPlan:
    """One rank's ring prefill, planned once and used by every layer.

    ``sizes[j]``: tokens rank j holds (the sizes of the blocks that travel); ``steps[s]``: the
    calls on the block in hand at step s, rank ``(rank - s) % world``'s."""

    rank: int
    shards: SequenceShards
    steps: tuple[tuple[BlockCall, ...], ...]

    @property
    def world(self) -> int:
        return self.shards.world_size

    @property
    def sizes(self) -> list[int]:
        return self.shards.sizes()

    @property
    def tokens(self) -> int:
        """Tokens this rank holds (its queries and its own block)."""
        return self.shards.size(self.rank)

    def source(self, step: int) -> int:
        """Whose block this rank holds at ``step``."""
        return (self.rank - step) % self.world

    def pairs(self) -> int:
        """Query-key pairs computed per head and layer: the causal pairs of this rank's queries."""
        return sum(call.pairs for calls in self.steps for call in calls)

    def block_bytes_sent(self, kv_heads: int, head_dim: int, itemsize: int) -> tuple[int, int]:
        """``(bytes, messages)`` this rank sends per layer: the non-empty blocks it forwards."""
        sizes = self.sizes
        sent = [sizes[self.source(s)] for s in range(self.world - 1)]
        return sum(sent) * 2 * kv_heads * head_dim * itemsize, sum(1 for n in sent if n)


def plan_ring(shards: SequenceShards, rank: int) -> RingPlan:
    """Rank ``rank``'s calls at every ring step (see :func:`plan_block`)."""
    if not 0 <= rank < shards.world_size:
        raise ConfigError(f"rank {rank} outside 0..{shards.world_size - 1}")
    mine = shards.runs[rank]
    steps = tuple(plan_block(mine, shards.runs[(rank - s) % shards.world_size], own=s == 0)
                  for s in range(shards.world_size))
    return RingPlan(rank, shards, steps)


@dataclass
class PrefillTiming:
    """Host time spent computing and waiting for blocks, and the query-key pairs computed (per
    head), summed over the layers. On GPUs the host time of an asynchronous launch is not the
    device's: there only ``pairs`` is meaningful."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    pairs: int = 0
    layers: int = 0
    stats: CommStats = field(default_factory=CommStats)


def _merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """``acc`` <- merge(acc, new), in place, for one block of rows."""
    merged_out, merged_lse = merge_states(torch.stack([acc_out, out]), torch.stack([acc_lse, lse]))
    acc_out.copy_(merged_out)
    acc_lse.copy_(merged_lse)


def _call(acc_out, acc_lse, q, blk_k, blk_v, call: BlockCall, scale: float) -> None:
    """Run ``call`` on the block and merge its partial into the running state, in row blocks."""
    keys, values = blk_k[:, :call.k_stop], blk_v[:, :call.k_stop]
    for start in range(call.q_start, call.q_stop, MERGE_ROWS):
        stop = min(call.q_stop, start + MERGE_ROWS)
        out, lse = attention_with_lse(q[:, start:stop], keys, values, scale, causal=False)
        _merge_into(acc_out[:, start:stop], acc_lse[:, start:stop], out, lse)


def ring_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan, *, scale: float,
                           group=None, timing: PrefillTiming | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's causal attention over the whole prompt, its blocks exchanged around the ring.

    Args:
        q: ``[Hq, S_r, D]`` this rank's queries, in its position order (``S_r = plan.tokens``).
        k, v: ``[Hkv, S_r, D]`` this rank's keys and values, same order.
        plan: from :func:`plan_ring` for this rank of ``group``.
        timing: where the compute and wait time, pairs and bytes are added (optional).

    Returns:
        ``(out [Hq, S_r, D], lse [Hq, S_r])`` float32. Every rank of the group must call this,
        layer by layer, an empty rank (``S_r = 0``) included: it relays the others' blocks.
    """
    hq, s_r, d = q.shape
    hkv = k.shape[0]
    if k.shape != (hkv, s_r, d) or v.shape != k.shape or hq % max(hkv, 1):
        raise ShapeError(f"ring prefill wants q [Hq, S, D] and k, v [Hkv, S, D] with Hq a multiple of Hkv; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if s_r != plan.tokens:
        raise ShapeError(f"rank {plan.rank} holds {plan.tokens} tokens by its plan but got {s_r}")
    world = plan.world
    if world > 1:
        comm.require_initialized()
        if dist.get_world_size(group) != world or dist.get_rank(group) != plan.rank:
            raise ConfigError(f"the ring plan is for rank {plan.rank} of {world}; this process is rank "
                              f"{dist.get_rank(group)} of {dist.get_world_size(group)}")
    timing = timing if timing is not None else PrefillTiming()
    sizes = plan.sizes
    succ, pred = (plan.rank + 1) % world, (plan.rank - 1) % world
    cur = torch.stack([k, v]) if world > 1 and s_r else None  # what travels: [2, Hkv, S_r, D]
    acc_out = acc_lse = None
    for step in range(world):
        t0 = time.perf_counter()
        reqs, nxt = [], None
        if step < world - 1:
            n_src = sizes[(plan.rank - step - 1) % world]  # the block that arrives in this step
            nxt = torch.empty((2, hkv, n_src, d), dtype=k.dtype, device=k.device) if n_src else None
            sends = [(cur, succ)] if sizes[plan.source(step)] else []
            recvs = [(nxt, pred)] if n_src else []
            reqs = comm.batch_p2p(sends, recvs, group, timing.stats)
        blk_k, blk_v = (k, v) if step == 0 else (cur[0], cur[1]) if cur is not None else (None, None)
        for call in plan.steps[step]:
            if call.causal:  # the own block, first: its state starts the running one
                acc_out, acc_lse = attention_with_lse(q, blk_k, blk_v, scale, causal=True)
            else:
                _call(acc_out, acc_lse, q, blk_k, blk_v, call, scale)
            timing.pairs += call.pairs
        t1 = time.perf_counter()
        if reqs:
            comm.wait_all(reqs, f"ring prefill step {step}: exchange with ranks {pred} and {succ}",
                          [f"to rank {succ}"] * len(sends) + [f"from rank {pred}"] * len(recvs))
        timing.compute_s += t1 - t0
        timing.wait_s += time.perf_counter() - t1
        if step < world - 1:
            cur = nxt
    timing.layers += 1
    if acc_out is None:  # this rank holds no token
        acc_out = q.new_zeros((hq, 0, d), dtype=torch.float32)
        acc_lse = q.new_zeros((hq, 0), dtype=torch.float32)
    return acc_out, acc_lse
