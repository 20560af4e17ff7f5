"""``decode_attention``: pick the implementation for the tensors at hand."""

from __future__ import annotations

import torch

from .impl import IMPLS, resolve_impl, triton_interpreter_enabled  # noqa: F401 - re-exported
from .prepared import DecodeOptions, prepared_decode


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, impl: str = "auto", config=None,
    block_table: torch.Tensor | None = None, causal: bool = False, k_scale=None, v_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one or several query tokens per row against a KV cache, with its log-sum-exp.

    Args:
        q: ``[B, Hq, D]`` (one token per row), or ``[B, Sq, Hq, D]`` with Sq in 1..16 (e.g. the
            drafted tokens of speculative decoding's verify step); fp16, bf16 or fp32.
        k, v: ``[B, N, Hkv, D]``, ``Hq % Hkv == 0``; or, with ``block_table``, paged pools
            ``[num_blocks, block_size, Hkv, D]`` (block_size 1..256). fp16, bf16, fp32, or fp8
            (``torch.float8_e4m3fn``; ``float8_e4m3fnuz`` on ROCm) with ``k_scale``/``v_scale``.
        seq_lens: optional int ``[B]``, valid KV length per row (0..N; with a block table
            required, 0..max_blocks * block_size).
        scale: softmax scale, default ``D ** -0.5``.
        impl: "auto" (Triton on GPUs, torch on CPU), "torch" or "triton".
        config: a ``kernels.config.DecodeConfig`` for the Triton kernel (ignored by torch).
        block_table: int32 ``[B, max_blocks]``: row b's token t is at
            ``k[block_table[b, t // block_size], t % block_size]``; entries past a row's last
            needed block are ignored. Entries a row reads must lie in the pool (checked on every
            call for CPU tensors, once per signature on GPUs: ``kernels.paged``).
        causal: the row's last Sq valid keys are the new tokens themselves: query token i sees
            keys ``[0, seq_len - Sq + 1 + i)`` (bottom-right aligned, FlashAttention's and
            FlashInfer's convention). False: every token sees every valid key.
        k_scale, v_scale: an fp8 cache's float32 dequantization scales (required with one, refused
            without): each a positive finite number, or a tensor ``[Hkv]`` (one per KV head) or
            ``()`` on the cache's device (other float dtypes are converted). The cache's value is
            ``k.float() * k_scale[h]``; ``tree_attn.quantize_kv`` makes such a cache and its scales.
            Tensor values are checked (finite, positive) on every call for CPU tensors, once per
            signature on GPUs; the kernels read them at every call.

    Returns:
        ``out`` in q's dtype and shape (``[B, Hq, D]`` or ``[B, Sq, Hq, D]``), ``lse`` float32
        natural log (``[B, Hq]`` or ``[B, Sq, Hq]``); query tokens without keys give out 0 and
        lse -inf.
    """
    # Resolved once per signature (checks, config, workspace), then only launched: see prepared.py.
    prepared = prepared_decode(q, k, v, seq_lens, block_table=block_table,
                               options=DecodeOptions(scale, impl, config, causal=causal), k_scale=k_scale,
                               v_scale=v_scale)
    return prepared(q, k, v, seq_lens, block_table=block_table, k_scale=k_scale, v_scale=v_scale)
