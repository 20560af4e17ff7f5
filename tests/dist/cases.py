"""What every distributed test case shares, with its defaults in one place: the heads, the seed
and (for the decode cases) the reduction plan and dtype. Keyword-only, so that each case's own
positional fields (name, strategy, shard lengths, ...) come first."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class CaseHeads:
    """``q_heads`` query heads over ``kv_heads`` KV heads (GQA group ``q_heads // kv_heads``) of
    ``head_dim``; ``seed`` seeds the case's inputs (identical in every process)."""

    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class PlanCase(CaseHeads):
    """And the reduction plan (the tree's ``fanout`` and ``rank_order``) and the inputs' ``dtype``."""

    fanout: int = 2
    rank_order: tuple[int, ...] | None = None
    dtype: torch.dtype = torch.float32
