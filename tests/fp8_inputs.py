"""fp8 KV caches for kernel tests: quantize a cache per KV head, and the float64 truth on the
dequantized cache (what is stored, times its head's scale, exactly).

Written here, independently of the library's own quantize helper, so that the kernel tests do not
check the kernel against code that shares its assumptions.
"""

from __future__ import annotations

import torch

# Largest finite value of each format: e4m3 (OCP) 1.75 x 2^8, e4m3fnuz (bias 8) 1.875 x 2^7.
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
FP8_SHORT = {torch.float8_e4m3fn: "e4m3fn", torch.float8_e4m3fnuz: "e4m3fnuz"}


def quantize(x: torch.Tensor, dtype=torch.float8_e4m3fn, *, per_head: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., Hkv, D]`` (any float dtype) as fp8 with float32 scales ``[Hkv]``: per head
    ``amax / max`` (a head of zeros gets 1), or with ``per_head=False`` one scalar amax expanded
    to ``[Hkv]`` (what the dispatch layer does with a scalar scale). Returns ``(x8, scale)``."""
    hkv = x.shape[-2]
    xf = x.float()
    if per_head:
        amax = xf.abs().transpose(-2, 0).reshape(hkv, -1).amax(dim=1) if xf.numel() else torch.zeros(hkv)
    else:
        amax = (xf.abs().max() if xf.numel() else torch.tensor(0.0)).expand(hkv).clone()
    scale = torch.where(amax > 0, amax / FP8_MAX[dtype], torch.ones_like(amax)).float().contiguous()
    x8 = (xf / scale[:, None]).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x8, scale


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The cache's values, float64: ``x8 * scale[h]``, exact (4 x 24 significant bits)."""
    return x8.double() * scale.double()[:, None]
