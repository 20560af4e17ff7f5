"""Functions run inside spawned ranks (module level so the spawn start method can pickle them)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from tree_attn import ReductionPlan, ring_decode, tree_decode


@dataclass(frozen=True)
class Case:
    """One distributed decode case. ``shard_lens[r]`` tokens on rank r; ``valid[r]`` optional
    per-row valid lengths of that shard (seq_lens)."""

    name: str
    strategy: str  # "allreduce" | "tree" | "ring"
    shard_lens: tuple[int, ...]
    fanout: int = 2
    rank_order: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32
    batch: int = 2
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    valid: tuple[tuple[int, ...], ...] | None = None
    q_scale: float = 1.0
    seed: int = 0

    def inputs(self):
        """q and every shard's (k, v, seq_lens), identical in every process."""
        g = torch.Generator().manual_seed(self.seed)
        q = (torch.randn(self.batch, self.q_heads, self.head_dim, generator=g) * self.q_scale).to(self.dtype)
        shards = []
        for r, n in enumerate(self.shard_lens):
            k = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g).to(self.dtype)
            v = torch.randn(self.batch, n, self.kv_heads, self.head_dim, generator=g).to(self.dtype)
            sl = torch.tensor(self.valid[r]) if self.valid is not None else None
            shards.append((k, v, sl))
        return q, shards


def run_cases(env, cases: list[Case]):
    results = []
    for case in cases:
        q, shards = case.inputs()
        k, v, sl = shards[env.rank]
        if case.strategy == "ring":
            out, lse = ring_decode(q, k, v, seq_lens=sl)
        else:
            plan = ReductionPlan(case.strategy, case.fanout, rank_order=case.rank_order)
            out, lse = tree_decode(q, k, v, seq_lens=sl, plan=plan)
        results.append((out, lse))
    return results


def mismatched_query(env):
    heads = 8 if env.rank != 1 else 4
    q = torch.randn(1, heads, 16)
    k = torch.randn(1, 3, 2, 16)
    return tree_decode(q, k, k)


def raises_on_rank_1(env):
    if env.rank == 1:
        raise ValueError("boom on purpose")
    q = torch.randn(1, 4, 8)
    k = torch.randn(1, 3, 2, 8)
    return tree_decode(q, k, k)


def dies_on_rank_2(env):
    q = torch.randn(1, 4, 8)
    k = torch.randn(1, 3, 2, 8)
    tree_decode(q, k, k)  # everyone is up
    if env.rank == 2:
        os._exit(3)
    time.sleep(0.5)
    return tree_decode(q, k, k, plan=ReductionPlan("allreduce"))


def ring_lengths_and_dtype_checks(env):
    """World 3. Returns (ring result without lengths, ring result with lengths, the error text for
    wrong lengths, the error text when rank 1's KV dtype differs)."""
    from tree_attn import DistributedError

    lens = (5, 0, 7)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 8, 16, generator=g)
    shards = [torch.randn(2, n, 2, 16, generator=g) for n in lens]
    k = shards[env.rank]
    v = k.flip(-1).contiguous()
    plain = ring_decode(q, k, v)
    given = ring_decode(q, k, v, lengths=list(lens))
    try:
        ring_decode(q, k, v, lengths=[1, 2, 3])
        wrong = None
    except DistributedError as exc:
        wrong = str(exc)
    kd = k.to(torch.bfloat16) if env.rank == 1 else k
    try:
        tree_decode(q, kd, kd)
        dtype_err = None
    except DistributedError as exc:
        dtype_err = str(exc)
    return plain, given, wrong, dtype_err
