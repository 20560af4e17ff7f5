"""The one table of tolerances for decode-attention kernel tests, and the comparison helper.

Errors come mostly from rounding ``out`` to the input dtype (fp16: 2^-11 relative, bf16: 2^-8) and,
on GPUs, from rounding the softmax weights to that dtype before the P @ V tensor-core dot. ``lse``
stays float32 end to end, so it is held much tighter. Values are |a - b| <= atol + rtol * |b|.

At long N an absolute tolerance alone says little: with random V, |out| shrinks like sqrt(e / N)
(about 0.01 at 262K keys), below bf16's atol, so an all-zero out would pass. Each (row, head) is
therefore also held to a relative error of its whole vector, ||out - ref|| <= out_rel_norm * ||ref||,
a bound that rounding meets at every N (bf16: about 2^-8 from rounding out, well under 1%).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    out_atol: float
    out_rtol: float
    lse_atol: float
    lse_rtol: float
    out_rel_norm: float


TOLERANCES: dict[torch.dtype, Tol] = {
    torch.float32: Tol(out_atol=2e-5, out_rtol=2e-5, lse_atol=2e-5, lse_rtol=1e-5, out_rel_norm=1e-4),
    torch.float16: Tol(out_atol=3e-3, out_rtol=3e-3, lse_atol=1e-3, lse_rtol=1e-4, out_rel_norm=2e-3),
    torch.bfloat16: Tol(out_atol=2e-2, out_rtol=2e-2, lse_atol=2e-3, lse_rtol=1e-4, out_rel_norm=1.5e-2),
}


def tol_for(*dtypes: torch.dtype) -> Tol:
    """The loosest tolerance among ``dtypes`` (mixed q / KV dtypes take the coarser one)."""
    order = [torch.float32, torch.float16, torch.bfloat16]
    return TOLERANCES[max(dtypes, key=order.index)]


def assert_decode_close(out, lse, ref_out, ref_lse, tol: Tol, what: str = "") -> None:
    """Compare a kernel's ``(out [B, Hq, D], lse [B, Hq])`` with a reference's.

    No NaN anywhere; lse -inf exactly where the reference's is (empty rows), finite values close;
    out close everywhere (0 on empty rows).
    """
    out = out.detach().cpu().double()
    lse = lse.detach().cpu().double()
    ref_out = ref_out.detach().cpu().double()
    ref_lse = ref_lse.detach().cpu().double()
    assert out.shape == ref_out.shape, f"{what}: out shape {tuple(out.shape)} != {tuple(ref_out.shape)}"
    assert lse.shape == ref_lse.shape, f"{what}: lse shape {tuple(lse.shape)} != {tuple(ref_lse.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in out"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    fin, ref_fin = torch.isfinite(lse), torch.isfinite(ref_lse)
    assert torch.equal(fin, ref_fin), f"{what}: lse finite masks differ: {fin.tolist()} vs {ref_fin.tolist()}"
    assert torch.all(lse[~fin] == float("-inf")), f"{what}: non-finite lse must be -inf"
    torch.testing.assert_close(lse[fin], ref_lse[fin], atol=tol.lse_atol, rtol=tol.lse_rtol, msg=lambda m: f"{what}: lse {m}")
    torch.testing.assert_close(out, ref_out, atol=tol.out_atol, rtol=tol.out_rtol, msg=lambda m: f"{what}: out {m}")
    ref_norm = ref_out.norm(dim=-1)
    rows = ref_norm > 0
    if rows.any():
        rel = (out - ref_out).norm(dim=-1)[rows] / ref_norm[rows]
        worst = rel.max().item()
        assert worst <= tol.out_rel_norm, f"{what}: out off by {worst:.3g} of its norm (limit {tol.out_rel_norm:g})"
    empty = ~ref_fin
    if empty.any():
        assert torch.all(out[empty] == 0), f"{what}: rows without keys must give out 0"
