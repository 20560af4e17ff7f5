"""``decode_attention``: pick the implementation for the tensors at hand."""

from __future__ import annotations

import os

import torch

from ..errors import ConfigError, KernelUnavailableError
from .reference import decode_attention_torch

IMPLS = ("auto", "torch", "triton")


def triton_interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``impl`` ("auto" | "torch" | "triton") to the one that will run on ``device``."""
    if impl not in IMPLS:
        raise ConfigError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "auto":
        # torch.cuda covers ROCm too (HIP tensors report device type "cuda").
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton" and device.type != "cuda" and not triton_interpreter_enabled():
        raise KernelUnavailableError(
            f"impl='triton' needs CUDA or ROCm tensors; these are on {device}. "
            "Use impl='torch' (or 'auto'), or set TRITON_INTERPRET=1 to run the kernel in Triton's CPU interpreter."
        )
    return impl


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str = "auto",
    config=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per row against a KV cache, with its log-sum-exp.

    Args:
        q: ``[B, Hq, D]``; k, v: ``[B, N, Hkv, D]``, ``Hq % Hkv == 0``; fp16, bf16 or fp32.
        seq_lens: optional int ``[B]``, valid KV length per row (0..N).
        scale: softmax scale, default ``D ** -0.5``.
        impl: "auto" (Triton on GPUs, torch on CPU), "torch" or "triton".
        config: a ``kernels.config.DecodeConfig`` for the Triton kernel (ignored by torch).

    Returns:
        ``out [B, Hq, D]`` in q's dtype, ``lse [B, Hq]`` float32 natural log; rows without keys
        give out 0 and lse -inf.
    """
    which = resolve_impl(impl, q.device)
    if which == "torch":
        return decode_attention_torch(q, k, v, seq_lens=seq_lens, scale=scale)
    from .triton_launch import decode_attention_triton  # lazy: triton is optional at import time

    return decode_attention_triton(q, k, v, seq_lens=seq_lens, scale=scale, config=config)
