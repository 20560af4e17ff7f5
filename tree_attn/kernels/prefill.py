"""Local prefill attention with its log-sum-exp: the one kernel every prefill block runs.

A block of queries ``q [Hq, S, D]`` over a block of keys ``k, v [Hkv, N, D]`` (grouped-query:
``Hq`` a multiple of ``Hkv``), either fully (every query sees every key) or causally with
``S == N`` (query i sees keys 0..i: the two blocks hold the same positions, in order). The state
``(out, lse)`` merges exactly with states over other keys (:mod:`tree_attn.reduce.state`), which is
how a rank's queries combine the blocks that reach it around the ring.
"""

from __future__ import annotations

import torch

# Query rows per block of the portable path (bounds its float32 score block); the capacity
# arithmetic counts it, so it is defined there.
from ..cost.capacity import QUERY_ROWS

__all__ = ["QUERY_ROWS", "attention_blockwise", "attention_with_lse"]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """``(out [Hq, S, D], lse [Hq, S])`` float32 of queries ``q [Hq, S, D]`` over ``k, v [Hkv, N, D]``;
    ``causal`` needs S == N (query i sees keys 0..i).

    On CPU: PyTorch's flash attention for CPU (grouped-query aware, never materialises the
    scores); its ``out`` is in q's dtype before the float32 cast (a 16-bit run rounds each block's
    partial once). Elsewhere :func:`attention_blockwise`."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), 0.0, causal, scale=scale
        )
        return out[0].float(), lse[0].float()
    return attention_blockwise(q, k, v, scale, causal)


def attention_blockwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """The portable path of :func:`attention_with_lse` (GPUs): blocks of :data:`QUERY_ROWS` query
    rows, float32 scores ``[Hq, rows, N]`` per block, exact log-sum-exp. Beside the output it holds
    float32 copies of K and V and one block's queries and scores (the capacity arithmetic counts them)."""
    hq, s, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    qg = q.reshape(hkv, g, s, d)
    kf, vf = k.float(), v.float()
    out = torch.empty((hkv, g, s, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((hkv, g, s), dtype=torch.float32, device=q.device)
    for start in range(0, s, QUERY_ROWS):
        stop = min(s, start + QUERY_ROWS)
        # in place on the block's own scores: one score block at a time, and logsumexp's temporary
        scores = torch.einsum("hgsd,hnd->hgsn", qg[:, :, start:stop].float(), kf).mul_(scale)
        if causal:
            rows = torch.arange(start, stop, device=q.device).view(-1, 1)
            cols = torch.arange(k.shape[1], device=q.device).view(1, -1)
            scores.masked_fill_(cols > rows, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        lse[:, :, start:stop] = block_lse
        out[:, :, start:stop] = torch.einsum("hgsn,hnd->hgsd", scores.sub_(block_lse.unsqueeze(-1)).exp_(), vf)
    return out.view(hq, s, d), lse.view(hq, s)
