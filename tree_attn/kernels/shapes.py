"""Validation of decode-attention inputs, shared by every implementation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ShapeError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class DecodeShape:
    """The sizes of one decode-attention call.

    batch B, query heads Hq, KV heads Hkv (Hq % Hkv == 0), head dim D, KV length N (padded).
    """

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_len: int

    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.q_heads // self.kv_heads


def check_arg_types(q, k, v, seq_lens) -> None:
    """Raise :class:`ShapeError` unless q, k, v are tensors and seq_lens a tensor or None (cheap:
    run on every call, before anything reads their attributes)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if seq_lens is not None and not isinstance(seq_lens, torch.Tensor):
        raise ShapeError(f"seq_lens must be an integer torch.Tensor [B] or None; got {type(seq_lens).__name__}")


def check_decode_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None
) -> DecodeShape:
    """Check shapes, dtypes and devices of ``q [B, Hq, D]``, ``k, v [B, N, Hkv, D]``, ``seq_lens [B]``.

    Raises :class:`ShapeError` naming the offending tensor and its shape.
    """
    check_arg_types(q, k, v, seq_lens)
    if q.dim() != 3:
        raise ShapeError(f"q must be [B, Hq, D]; got shape {tuple(q.shape)}")
    if k.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"k and v must be [B, N, Hkv, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ShapeError(f"k and v must have the same shape; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, d = q.shape
    bk, n, hkv, dk = k.shape
    if bk != b:
        raise ShapeError(f"batch mismatch: q has B={b}, k/v have B={bk}")
    if dk != d:
        raise ShapeError(f"head dim mismatch: q has D={d}, k/v have D={dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ShapeError(f"query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FLOAT_DTYPES:
            raise ShapeError(f"{name} must be float16, bfloat16 or float32; got {t.dtype}")
    if k.dtype != v.dtype:
        raise ShapeError(f"k and v must share a dtype; got k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ShapeError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if seq_lens is not None:
        if seq_lens.dim() != 1 or seq_lens.shape[0] != b:
            raise ShapeError(f"seq_lens must be [B]=[{b}]; got shape {tuple(seq_lens.shape)}")
        if seq_lens.dtype.is_floating_point or seq_lens.dtype.is_complex or seq_lens.dtype == torch.bool:
            raise ShapeError(f"seq_lens must be an integer tensor; got {seq_lens.dtype}")
        if seq_lens.device != q.device:
            raise ShapeError(f"seq_lens must be on {q.device}; got {seq_lens.device}")
        if seq_lens.device.type == "cpu":
            check_seq_lens_range(seq_lens, n)
    return DecodeShape(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, kv_len=n)


def check_seq_lens_range(seq_lens: torch.Tensor, n: int) -> None:
    """Raise :class:`ShapeError` unless every value of ``seq_lens`` (a CPU tensor) lies in 0..n."""
    if seq_lens.numel() > 0:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > n:
            raise ShapeError(f"seq_lens must lie in 0..N={n}; got values from {lo} to {hi}")
