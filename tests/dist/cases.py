"""What every distributed test case shares, with its defaults in one place: the heads, the seed
and (for the decode cases) the reduction plan and dtype, keyword-only; and the sharded KV of the
paged / multi-token / fp8 decode cases, whose fields (name, strategy, shard lengths, ...) are
positional and come first."""

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


@dataclass(frozen=True)
class ShardedCase:
    """One decode case over a sharded KV cache: rank r holds ``shard_lens[r]`` tokens per row,
    ``valid[r]`` of them valid (one length per row), paged into pools of ``block_size`` when given;
    q has ``sq`` tokens per row (``causal`` within them). Mixed with :class:`CaseHeads` or
    :class:`PlanCase` for the heads, seed and plan."""

    name: str
    strategy: str
    shard_lens: tuple[int, ...]
    valid: tuple[tuple[int, ...], ...]
    sq: int = 1
    causal: bool = False
    block_size: int | None = None

    @property
    def world(self) -> int:
        return len(self.shard_lens)

    @property
    def batch(self) -> int:
        return len(self.valid[0])
