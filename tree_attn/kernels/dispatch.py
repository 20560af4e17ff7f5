"""``decode_attention``: pick the implementation for the tensors at hand."""

from __future__ import annotations

import torch

from .impl import IMPLS, resolve_impl, triton_interpreter_enabled  # noqa: F401 - re-exported
from .prepared import prepared_decode

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
    # Resolved once per signature (checks, config, workspace), then only launched: see prepared.py.
    return prepared_decode(q, k, v, seq_lens, scale=scale, impl=impl, config=config)(q, k, v, seq_lens)
