"""The one table of tolerances, and the comparison helpers every test uses.

Errors are absolute on outputs of unit-variance inputs (|out| <= max |v| ~ 4) and on lse.
- float32: the fast paths and the float64 truth differ by rounding order only.
- float16 / bfloat16: inputs are rounded to the dtype before the float64 truth sees them (the
  truth is computed from the same rounded tensors), so the error is the fp32 accumulation plus the
  final rounding of ``out`` to the dtype: half an ulp at |out| < 4 is 2^-9 for fp16 and 2^-6
  for bf16.
"""

from __future__ import annotations

import torch

# (out atol, lse atol) by input dtype
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 2e-5),
    torch.bfloat16: (3e-2, 2e-5),
}

# Large logits (queries scaled by 30): scores reach ~100, their float32 rounding (~1e-5 absolute)
# becomes a relative error of the softmax weights, so out and lse get ~30x looser bounds.
LARGE_LOGIT_OUT_ATOL = 1e-4
LARGE_LOGIT_LSE_ATOL = 2e-3


def assert_state_close(
    out, lse, ref_out, ref_lse, dtype: torch.dtype, large_logits: bool = False
) -> None:
    """Compare a result ``(out, lse)`` with a float64 truth; -inf lse must match exactly, no NaN."""
    out_atol, lse_atol = TOLERANCES[dtype]
    if large_logits:
        out_atol, lse_atol = max(out_atol, LARGE_LOGIT_OUT_ATOL), max(lse_atol, LARGE_LOGIT_LSE_ATOL)
    out64, lse64 = out.detach().cpu().double(), lse.detach().cpu().double()
    assert lse.dtype == torch.float32, f"lse must be float32, got {lse.dtype}"
    assert not torch.isnan(out64).any(), "out has NaN"
    assert not torch.isnan(lse64).any(), "lse has NaN"
    ref_out, ref_lse = ref_out.double(), ref_lse.double()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse64), empty), "lse is -inf exactly where the row has no keys"
    assert (out64[empty] == 0).all(), "rows without keys give out 0"
    if (~empty).any():
        out_err = (out64 - ref_out)[~empty].abs().max().item()
        lse_err = (lse64 - ref_lse)[~empty].abs().max().item()
        assert out_err <= out_atol, f"out error {out_err:.3e} > {out_atol:.1e} ({dtype})"
        assert lse_err <= lse_atol, f"lse error {lse_err:.3e} > {lse_atol:.1e} ({dtype})"


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
