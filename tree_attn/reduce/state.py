"""The exact merge of partial attention states: the one combine every level uses.

A state over a set of keys is ``(o, lse)``: ``o`` the softmax-normalised output over those keys and
``lse`` the natural-log log-sum-exp of the scaled scores over them. Two states over disjoint key
sets merge exactly::

    lse = logaddexp(lse_a, lse_b)
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

The empty key set ``(o=0, lse=-inf)`` is the identity. An lse of +inf or NaN means different things
by where the state comes from. Our own kernels mark an empty state with -inf only, so from them a
NaN can only come from NaN (or inf) data: the merged row is NaN, as torch SDPA and FlashAttention
give, never a silent answer over the other states. States handed to the public
:func:`merge_partials` may come from kernels that use +inf or NaN as an empty sentinel: there they
are empty states.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError


def merge_states(
    outs: torch.Tensor, lses: torch.Tensor, *, faulty_is_empty: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly merge ``S`` partial states: the one merge, every level.

    Args:
        outs: ``[S, *batch, D]`` partial outputs (any float dtype).
        lses: ``[S, *batch]`` natural-log LSEs; -inf marks an empty state (its out is ignored,
            whatever it holds).
        faulty_is_empty: how a +inf or NaN lse is read. False (states our own kernels made, where
            only NaN or inf data can produce one): the row's result is NaN, as torch SDPA gives.
            True (states callers hand to :func:`merge_partials`, whose kernels may use them as
            empty sentinels): an empty state.
        dtype: what the merge computes in and returns: float32, or float64 for the float64
            references beside the fast paths.

    Returns:
        ``(out, lse)``: out ``[*batch, D]``, lse ``[*batch]``, both ``dtype``. Rows where every
        state is empty give out 0 and lse -inf.
    """
    if outs.dim() < 2 or lses.dim() != outs.dim() - 1 or outs.shape[:-1] != lses.shape:
        raise ShapeError(
            f"merge wants outs [S, ..., D] and lses [S, ...] with matching leading dims; "
            f"got outs {tuple(outs.shape)} and lses {tuple(lses.shape)}"
        )
    if outs.device != lses.device:
        raise ShapeError(f"outs and lses must be on one device; got {outs.device} and {lses.device}")
    lses = lses.to(dtype)
    faulty = ~(lses < float("inf"))  # +inf or NaN
    lses = torch.where(faulty, float("-inf"), lses)
    if outs.shape[0] == 0:
        return (
            torch.zeros(outs.shape[1:], dtype=dtype, device=outs.device),
            torch.full(lses.shape[1:], float("-inf"), dtype=dtype, device=outs.device),
        )
    m = lses.amax(dim=0)
    # A row with every state empty has max -inf; shift by 0 there so exp() gives 0, not NaN.
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe)  # [S, *batch]; 0 for empty states
    denom = w.sum(dim=0)
    # Weighted sum; empty states may carry garbage in o (even NaN), so zero them explicitly.
    contrib = torch.where(w.unsqueeze(-1) > 0, w.unsqueeze(-1) * outs.to(dtype), 0.0)
    num = contrib.sum(dim=0)
    nonempty = denom > 0
    out = torch.where(nonempty.unsqueeze(-1), num / torch.where(nonempty, denom, 1.0).unsqueeze(-1), 0.0)
    lse = torch.where(nonempty, m_safe + torch.log(torch.where(nonempty, denom, 1.0)), float("-inf"))
    if not faulty_is_empty:
        poisoned = faulty.any(dim=0)
        out = torch.where(poisoned.unsqueeze(-1), float("nan"), out)
        lse = torch.where(poisoned, float("nan"), lse)
    return out, lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly merge ``S`` partial states handed in by a caller (the public API).

    Args:
        outs: ``[S, *batch, D]`` partial outputs (any float dtype).
        lses: ``[S, *batch]`` natural-log LSEs; -inf, +inf or NaN marks an empty state.

    Returns:
        ``(out, lse)``: out ``[*batch, D]`` float32, lse ``[*batch]`` float32. Rows where every
        state is empty give out 0 and lse -inf.
    """
    for name, t in (("outs", outs), ("lses", lses)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise ShapeError(f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64); "
                             f"got {t.dtype}")
    return merge_states(outs, lses, faulty_is_empty=True)


def merge_two(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two of our own states ``[*batch, D]`` / ``[*batch]``; float32 results; NaN or +inf
    lse makes the row NaN (see :func:`merge_states`)."""
    return merge_states(torch.stack([out_a.float(), out_b.float()]), torch.stack([lse_a.float(), lse_b.float()]))


def empty_state(batch_shape: tuple[int, ...], head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The identity of the merge: out zeros ``[*batch, D]``, lse -inf ``[*batch]``, float32."""
    return (
        torch.zeros(*batch_shape, head_dim, dtype=torch.float32, device=device),
        torch.full(batch_shape, float("-inf"), dtype=torch.float32, device=device),
    )
