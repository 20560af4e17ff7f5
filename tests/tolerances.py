"""The one table of tolerances for decode-attention results, and the one comparison helper.

Every test that checks an attention state ``(out [B, Hq, D], lse [B, Hq])`` (the torch reference,
the merge, the collectives, the Triton kernel) uses :func:`assert_decode_close` with a row of
:data:`TOLERANCES`, picked by :func:`tol_for`. The check is the same everywhere: no NaN; lse
float32 and -inf exactly where the reference row has no keys (out 0 there); finite lse close;
out close element-wise (``|a - b| <= atol + rtol * |b|``); and each (row, head) within a relative
error of its whole vector, ``||out - ref|| <= out_rel_norm * ||ref||``. That last bound matters at
long N: with random V, |out| shrinks like sqrt(e / N) (about 0.01 at 262K keys), below bf16's
atol, so an all-zero out would pass the element-wise bound alone.

Rows are by input dtype, with one column per kind of arithmetic, because the errors differ:
- ``fp32``: fp32 arithmetic on inputs already rounded to the dtype (the float64 truth is computed
  from the same rounded tensors): the torch reference, merges, collectives on CPU ranks, and the
  Triton kernel in the CPU interpreter (it upcasts). The only error of note is rounding ``out`` to
  the dtype: half an ulp at |out| < 4 is 2^-10 for fp16, 2^-7 for bf16; lse stays float32.
- ``gpu``: the compiled Triton kernel on a GPU, whose fp16/bf16 tensor-core P @ V dot takes the
  softmax weights rounded to the dtype (and whose exp2/log2 are the hardware approximations).
  These are the values the GPU tests were written and run with; they are never looser than they
  were.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Tol:
    out_atol: float
    out_rtol: float
    lse_atol: float
    lse_rtol: float
    out_rel_norm: float


class Row(NamedTuple):
    fp32: Tol  # fp32 arithmetic on rounded inputs (CPU, interpreter)
    gpu: Tol  # the compiled kernel on a GPU


TOLERANCES: dict[torch.dtype, Row] = {
    torch.float32: Row(
        fp32=Tol(out_atol=2e-5, out_rtol=0.0, lse_atol=2e-5, lse_rtol=0.0, out_rel_norm=1e-4),
        gpu=Tol(out_atol=2e-5, out_rtol=2e-5, lse_atol=2e-5, lse_rtol=1e-5, out_rel_norm=1e-4),
    ),
    torch.float16: Row(
        fp32=Tol(out_atol=3e-3, out_rtol=0.0, lse_atol=2e-5, lse_rtol=0.0, out_rel_norm=2e-3),
        gpu=Tol(out_atol=3e-3, out_rtol=3e-3, lse_atol=1e-3, lse_rtol=1e-4, out_rel_norm=2e-3),
    ),
    torch.bfloat16: Row(
        fp32=Tol(out_atol=2e-2, out_rtol=0.0, lse_atol=2e-5, lse_rtol=0.0, out_rel_norm=1.5e-2),
        gpu=Tol(out_atol=2e-2, out_rtol=2e-2, lse_atol=2e-3, lse_rtol=1e-4, out_rel_norm=1.5e-2),
    ),
}

# Large logits (queries scaled by 30): scores reach ~100, their float32 rounding (~1e-5 absolute)
# becomes a relative error of the softmax weights, so out and lse get ~30x looser bounds.
LARGE_LOGIT_OUT_ATOL = 1e-4
LARGE_LOGIT_LSE_ATOL = 2e-3

_ORDER = [torch.float32, torch.float16, torch.bfloat16]


def tol_for(*dtypes: torch.dtype, device: torch.device | str = "cpu", large_logits: bool = False) -> Tol:
    """The tolerance for a result computed from inputs of ``dtypes`` on ``device``.

    Mixed q / KV dtypes take the coarsest dtype's row; a CUDA (or ROCm) ``device`` means the
    compiled kernel (column ``gpu``), anything else fp32 arithmetic (column ``fp32``).
    ``large_logits`` widens out and lse for scores of ~100 (see above).
    """
    row = TOLERANCES[max(dtypes, key=_ORDER.index)]
    tol = row.gpu if torch.device(device).type == "cuda" else row.fp32
    if large_logits:
        tol = replace(tol, out_atol=max(tol.out_atol, LARGE_LOGIT_OUT_ATOL),
                      lse_atol=max(tol.lse_atol, LARGE_LOGIT_LSE_ATOL))
    return tol


def assert_decode_close(out, lse, ref_out, ref_lse, tol: Tol, what: str = "") -> None:
    """Compare a result ``(out [B, Hq, D], lse [B, Hq])`` with a reference's (a float64 truth or
    another implementation), under ``tol``. See the module docstring for what is checked."""
    assert lse.dtype == torch.float32, f"{what}: lse must be float32, got {lse.dtype}"
    out = out.detach().cpu().double()
    lse = lse.detach().cpu().double()
    ref_out = ref_out.detach().cpu().double()
    ref_lse = ref_lse.detach().cpu().double()
    assert out.shape == ref_out.shape, f"{what}: out shape {tuple(out.shape)} != {tuple(ref_out.shape)}"
    assert lse.shape == ref_lse.shape, f"{what}: lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    assert not torch.isposinf(lse).any(), f"{what}: +inf in lse"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), (
        f"{what}: lse must be -inf exactly where the row has no keys: "
        f"{torch.isneginf(lse).tolist()} vs {empty.tolist()}"
    )
    if empty.any():
        assert torch.all(out[empty] == 0), f"{what}: rows without keys must give out 0"
    fin = ~empty
    if fin.any():
        lse_err = (lse[fin] - ref_lse[fin]).abs()
        lse_bound = tol.lse_atol + tol.lse_rtol * ref_lse[fin].abs()
        worst = int((lse_err - lse_bound).argmax())
        assert bool((lse_err <= lse_bound).all()), (
            f"{what}: lse error {lse_err[worst].item():.3e} > {lse_bound[worst].item():.1e} "
            f"(max lse error {lse_err.max().item():.3e})"
        )
    if out.numel():
        out_err = (out - ref_out).abs()
        out_bound = tol.out_atol + tol.out_rtol * ref_out.abs()
        assert bool((out_err <= out_bound).all()), (
            f"{what}: out error {out_err.max().item():.3e} beyond atol {tol.out_atol:g} + rtol {tol.out_rtol:g} * |ref|"
        )
        ref_norm = ref_out.norm(dim=-1)
        rows = ref_norm > 0
        if rows.any():
            rel = (out - ref_out).norm(dim=-1)[rows] / ref_norm[rows]
            worst_rel = rel.max().item()
            assert worst_rel <= tol.out_rel_norm, (
                f"{what}: out off by {worst_rel:.3g} of its norm (limit {tol.out_rel_norm:g})")


def assert_state_close(out, lse, ref_out, ref_lse, dtype: torch.dtype, large_logits: bool = False) -> None:
    """:func:`assert_decode_close` for a state computed in fp32 arithmetic from ``dtype`` inputs
    (the reference, merges, collectives on CPU ranks)."""
    assert_decode_close(out, lse, ref_out, ref_lse, tol_for(dtype, large_logits=large_logits), what=str(dtype))


def random_decode_inputs(
    batch: int, q_heads: int, kv_heads: int, head_dim: int, kv_len: int, dtype=torch.float32, seed: int = 0,
    q_scale: float = 1.0,
):
    """Random ``q [B, Hq, D]``, ``k, v [B, N, Hkv, D]`` (CPU, ``dtype``) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, q_heads, head_dim, generator=g) * q_scale).to(dtype)
    k = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_len, kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v
