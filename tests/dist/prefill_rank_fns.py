"""Rank functions of the ring prefill tests (module level, so the spawn start method can pickle them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tree_attn.reduce import ring_prefill
from tree_attn.reduce.ring_prefill import PrefillTiming, plan_ring, ring_prefill_attention
from tree_attn.reduce.zigzag import contiguous, zigzag


@dataclass(frozen=True)
class PrefillCase:
    """Random q, k, v of one ``tokens``-token sequence, split by ``layout`` over the ranks."""

    name: str
    tokens: int
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    layout: str = "zigzag"
    merge_rows: int | None = None  # smaller row blocks of the merge, to exercise them
    seed: int = 0

    def shards(self, world: int):
        return (zigzag if self.layout == "zigzag" else contiguous)(self.tokens, world)

    def inputs(self):
        """Global ``q [Hq, n, D]``, ``k, v [Hkv, n, D]`` (identical in every process) and the scale."""
        g = torch.Generator().manual_seed(self.seed)
        q = torch.randn(self.q_heads, self.tokens, self.head_dim, generator=g).to(self.dtype)
        k = torch.randn(self.kv_heads, self.tokens, self.head_dim, generator=g).to(self.dtype)
        v = torch.randn(self.kv_heads, self.tokens, self.head_dim, generator=g).to(self.dtype)
        return q, k, v, self.head_dim ** -0.5


def ring_prefill_cases(env, cases: list[PrefillCase]):
    """Each case on this rank: ``(positions, out, lse, bytes sent, messages)``."""
    results = []
    default_rows = ring_prefill.MERGE_ROWS
    for case in cases:
        q, k, v, scale = case.inputs()
        shards = case.shards(env.world_size)
        pos = torch.tensor(shards.positions(env.rank), dtype=torch.long)
        plan = plan_ring(shards, env.rank)
        timing = PrefillTiming()
        ring_prefill.MERGE_ROWS = case.merge_rows or default_rows
        try:
            out, lse = ring_prefill_attention(q[:, pos], k[:, pos], v[:, pos], plan, scale=scale, timing=timing)
        finally:
            ring_prefill.MERGE_ROWS = default_rows
        results.append((pos, out, lse, timing.stats.bytes_sent, timing.stats.messages, timing.pairs))
    return results
