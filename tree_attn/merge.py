"""The exact merge of partial attention states: the one combine every level uses.

A state over a set of keys is ``(o, lse)``: ``o`` the softmax-normalised output over those keys and
``lse`` the natural-log log-sum-exp of the scaled scores over them. Two states over disjoint key
sets merge exactly::

    lse = logaddexp(lse_a, lse_b)
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

The empty key set ``(o=0, lse=-inf)`` is the identity. An lse of +inf or NaN can only come from
an upstream fault; it is treated as an empty state so that one bad shard can never poison a row
with NaN (the row's result is then the merge of the other states).
"""

from __future__ import annotations

import torch

from .errors import ShapeError


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """Return ``lse`` as float32 with +inf and NaN replaced by -inf (empty state)."""
    lse = lse.float()
    return torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("-inf")))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly merge ``S`` partial states.

    Args:
        outs: ``[S, *batch, D]`` partial outputs (any float dtype).
        lses: ``[S, *batch]`` natural-log LSEs; -inf, +inf or NaN marks an empty state.

    Returns:
        ``(out, lse)``: out ``[*batch, D]`` float32, lse ``[*batch]`` float32. Rows where every
        state is empty give out 0 and lse -inf.
    """
    if outs.dim() < 2 or lses.dim() != outs.dim() - 1 or outs.shape[:-1] != lses.shape:
        raise ShapeError(
            f"merge_partials wants outs [S, ..., D] and lses [S, ...] with matching leading dims; "
            f"got outs {tuple(outs.shape)} and lses {tuple(lses.shape)}"
        )
    lses = sanitize_lse(lses)
    if outs.shape[0] == 0:
        return (
            torch.zeros(outs.shape[1:], dtype=torch.float32, device=outs.device),
            torch.full(lses.shape[1:], float("-inf"), dtype=torch.float32, device=outs.device),
        )
    m = lses.amax(dim=0)
    # A row with every state empty has max -inf; shift by 0 there so exp() gives 0, not NaN.
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe)  # [S, *batch]; 0 for empty states
    denom = w.sum(dim=0)
    # Weighted sum; empty states may carry garbage in o (even NaN), so zero them explicitly.
    contrib = torch.where(w.unsqueeze(-1) > 0, w.unsqueeze(-1) * outs.float(), 0.0)
    num = contrib.sum(dim=0)
    nonempty = denom > 0
    out = torch.where(nonempty.unsqueeze(-1), num / torch.where(nonempty, denom, 1.0).unsqueeze(-1), 0.0)
    lse = torch.where(nonempty, m_safe + torch.log(torch.where(nonempty, denom, 1.0)), float("-inf"))
    return out, lse


def merge_two(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states ``[*batch, D]`` / ``[*batch]``; float32 results. Same rules as above."""
    return merge_partials(torch.stack([out_a.float(), out_b.float()]), torch.stack([lse_a.float(), lse_b.float()]))


def empty_state(batch_shape: tuple[int, ...], head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The identity of the merge: out zeros ``[*batch, D]``, lse -inf ``[*batch]``, float32."""
    return (
        torch.zeros(*batch_shape, head_dim, dtype=torch.float32, device=device),
        torch.full(batch_shape, float("-inf"), dtype=torch.float32, device=device),
    )
