"""Torch decode attention: the float64 truth, and the torch path ``decode_attention(impl="torch")`` runs.

- :func:`decode_attention_float64`: straightforward, unchunked, float64: the ground truth of tests.
- :func:`decode_attention_torch`: the torch implementation, exact in float32 arithmetic. CPU tensors
  go to :func:`tree_attn.kernels.cpu_decode.decode_attention_cpu` (tuned for one core's read
  bandwidth); other devices to the device-agnostic chunked form below, which processes the KV
  sequence in chunks and merges each chunk's state into a running state with the exact merge of
  ``tree_attn.reduce.state``, without host synchronisation.

Both forms convert only one chunk to float32 at a time, so memory stays bounded however long N is.

fp8 caches (``kernels.fp8``): with ``k_scale``, ``v_scale`` (float32 ``[Hkv]``), every form
attends over the dequantized cache ``k.float() * k_scale[h]``: the chunked form dequantizes each
chunk in float32, the float64 truth the whole cache in float64 (exact), the CPU path folds the
scales into the query and the output (``cpu_decode``).
"""

from __future__ import annotations

import torch

from ..reduce.state import merge_two
from .cpu_decode import decode_attention_cpu
from .shapes import check_decode_inputs

# Elements of one float32 K (or V) chunk: 4 Mi elements = 16 MiB, small enough to stay in a CPU's
# last-level cache region of interest and to bound the extra memory, big enough that the einsum
# calls are not dominated by Python overhead.
CHUNK_ELEMENTS = 1 << 22


def chunk_tokens_for(batch: int, kv_heads: int, head_dim: int) -> int:
    """KV positions per chunk of :func:`decode_attention_chunked` by default: a float32 K chunk of
    at most :data:`CHUNK_ELEMENTS` elements, and at least 64 positions."""
    per_token = max(1, batch * kv_heads * head_dim)
    return max(64, CHUNK_ELEMENTS // per_token)


def key_limits(lens: torch.Tensor, q_len: int, causal: bool) -> torch.Tensor:
    """Keys each query token sees: ``[B, Sq]`` int64, token i of row b sees positions
    ``[0, limit[b, i])``. Without ``causal`` every token sees ``lens[b]`` keys; with it, the row's
    last Sq valid keys are the new tokens and token i sees ``lens[b] - Sq + 1 + i`` (bottom-right
    aligned, as FlashAttention and FlashInfer do; clamped at 0: a row shorter than Sq gives its
    first tokens no keys, out 0 and lse -inf)."""
    lens = lens.to(torch.int64)
    if not causal:
        return lens[:, None].expand(-1, q_len)
    offs = torch.arange(q_len, device=lens.device) - (q_len - 1)
    return (lens[:, None] + offs[None, :]).clamp_(min=0)


def _as_tokens(q: torch.Tensor) -> torch.Tensor:
    """``q`` as ``[B, Sq, Hq, D]`` (a view: a ``[B, Hq, D]`` query is one token per row)."""
    return q if q.dim() == 4 else q.unsqueeze(1)


def _dequantized(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., Hkv, D]`` as ``dtype``, times its head's scale when given (an fp8 cache)."""
    x = x.to(dtype)
    return x if scale is None else x * scale.to(device=x.device, dtype=dtype)[:, None]


def _contiguous_kv(k, v, seq_lens, block_table):
    """Contiguous ``k, v [B, N, Hkv, D]`` (pages gathered when a block table is given)."""
    if block_table is None:
        return k, v
    from .paged import gather_pages

    return gather_pages(k, block_table, seq_lens), gather_pages(v, block_table, seq_lens)


def decode_attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, chunk_tokens: int | None = None,
    block_table: torch.Tensor | None = None, causal: bool = False,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one or several new query tokens per row against a KV cache.

    CPU tensors run :func:`tree_attn.kernels.cpu_decode.decode_attention_cpu` (which reads a paged
    pool chunk by chunk); others, and inputs that need gradients, the chunked einsum form
    (:func:`decode_attention_chunked`), for which a paged cache is first gathered into a
    contiguous one (a copy of the rows' pages; on GPUs the Triton kernel reads pages in place).

    Args:
        q: ``[B, Hq, D]``, or ``[B, Sq, Hq, D]`` for Sq (1..16) new tokens per row.
        k, v: ``[B, N, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: query head h reads KV head h // (Hq/Hkv));
            with ``block_table``: pools ``[num_blocks, block_size, Hkv, D]``.
        seq_lens: optional int ``[B]``: valid keys per row (0..N); later positions are ignored.
            Required with ``block_table``.
        scale: softmax scale, default ``D ** -0.5``.
        chunk_tokens: KV positions per chunk (default: ~1 MiB of K as stored per chunk on CPU, see
            ``cpu_decode``; about 16 MiB of float32 per chunk elsewhere).
        block_table: int ``[B, max_blocks]``: row b's token t is ``k[block_table[b, t // bs], t % bs]``.
        causal: the row's last Sq valid keys are the new tokens; token i sees the keys before them
            and new tokens ``<= i`` (see :func:`key_limits`).
        k_scale, v_scale: an fp8 cache's float32 ``[Hkv]`` scales (checked by the caller,
            ``kernels.prepared``), else None.

    Returns:
        ``out`` in q's dtype and shape (``[B, Hq, D]`` or ``[B, Sq, Hq, D]``) and ``lse``
        float32 (``[B, Hq]`` or ``[B, Sq, Hq]``, natural log). Query tokens with no valid keys
        give out 0 and lse -inf.
    """
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    # The CPU path writes into preallocated buffers (bmm out=, in-place exp): not differentiable.
    # Inputs that need gradients take the chunked form, which autograd can follow.
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and not needs_grad:
        return decode_attention_cpu(
            q, k, v, seq_lens=seq_lens, scale=scale, chunk_tokens=chunk_tokens, causal=causal, block_table=block_table,
            **scales,
        )
    if block_table is not None:  # checked before its pages are gathered (the chunked form checks the rest)
        check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
        k, v = _contiguous_kv(k, v, seq_lens, block_table)
    return decode_attention_chunked(q, k, v, seq_lens=seq_lens, scale=scale, chunk_tokens=chunk_tokens, causal=causal,
                                    **scales)


def decode_attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, chunk_tokens: int | None = None,
    causal: bool = False, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device-agnostic chunked form of :func:`decode_attention_torch` (same contract, contiguous
    KV only; an fp8 chunk is dequantized in float32, ``k.float() * k_scale[h]``).

    No host synchronisation (seq_lens become a mask), so it suits GPU tensors. On CPU it is the
    slower form: its einsums read the interleaved ``[N, Hkv, D]`` cache head by head, and each chunk
    adds a logsumexp and a stacked merge: ~8 GB/s at 8 x 128 fp32 on one Zen 4 core, 21-31% of a
    sequential ``torch.sum`` (``benchmarks/RESULTS.md``).
    """
    shape = check_decode_inputs(q, k, v, seq_lens, None, causal, fp8_kv=True)
    b, hq, hkv, d, n, sq = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len, shape.q_len
    g = shape.group
    if scale is None:
        scale = d**-0.5
    step = chunk_tokens or chunk_tokens_for(b, hkv, d)
    qf = (_as_tokens(q).float() * scale).view(b, sq, hkv, g, d)
    out = torch.zeros(b, sq, hkv, g, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, sq, hkv, g), float("-inf"), dtype=torch.float32, device=q.device)
    masked = seq_lens is not None or causal
    if masked:
        lens = seq_lens.to(q.device) if seq_lens is not None else torch.full((b,), n, device=q.device)
        limits = key_limits(lens, sq, causal)  # [B, Sq]
    positions = torch.arange(step, device=q.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        kc = _dequantized(k[:, start:stop], k_scale, torch.float32)  # [B, C, Hkv, D]
        vc = _dequantized(v[:, start:stop], v_scale, torch.float32)
        scores = torch.einsum("bshgd,bchd->bshgc", qf, kc)  # [B, Sq, Hkv, G, C]
        if masked:
            valid = (start + positions[: stop - start])[None, None, :] < limits[:, :, None]  # [B, Sq, C]
            scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
        c_lse = torch.logsumexp(scores, dim=-1)  # [B, Sq, Hkv, G]; -inf where the chunk is all masked
        c_lse_safe = torch.where(torch.isfinite(c_lse), c_lse, torch.zeros_like(c_lse))
        p = torch.exp(scores - c_lse_safe.unsqueeze(-1))
        c_out = torch.einsum("bshgc,bchd->bshgd", p, vc)
        out, lse = merge_two(out, lse, c_out, c_lse)
    out, lse = out.view(b, sq, hq, d).to(q.dtype), lse.view(b, sq, hq)
    return (out, lse) if q.dim() == 4 else (out[:, 0], lse[:, 0])


def decode_attention_float64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, block_table: torch.Tensor | None = None,
    causal: bool = False, k_scale=None, v_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straightforward float64 decode attention on CPU, unchunked: the ground truth for tests.

    Same contract as :func:`decode_attention_torch` (paged pools are gathered with
    :func:`tree_attn.kernels.paged.gather_pages`, Sq tokens and ``causal`` masked per token), but
    returns out and lse in float64. An fp8 cache is dequantized in float64 (exactly) with
    ``k_scale``, ``v_scale`` (numbers or tensors, a scalar or ``[Hkv]``).
    """
    shape = check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
    b, hq, hkv, d, n, sq = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len, shape.q_len
    g = shape.group
    if scale is None:
        scale = d**-0.5
    k, v = _contiguous_kv(k, v, seq_lens, block_table)
    qd = _as_tokens(q).detach().cpu().double().view(b, sq, hkv, g, d) * scale
    kd = _dequantized(k.detach().cpu(), _scale64(k_scale, hkv), torch.float64)
    vd = _dequantized(v.detach().cpu(), _scale64(v_scale, hkv), torch.float64)
    scores = torch.einsum("bshgd,bnhd->bshgn", qd, kd)
    if seq_lens is not None or causal:
        lens = seq_lens.cpu() if seq_lens is not None else torch.full((b,), n)
        valid = torch.arange(n)[None, None, :] < key_limits(lens, sq, causal)[:, :, None]  # [B, Sq, N]
        scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - lse_safe.unsqueeze(-1))
    out = torch.einsum("bshgn,bnhd->bshgd", p, vd).reshape(b, sq, hq, d)
    lse = lse.reshape(b, sq, hq)
    return (out, lse) if q.dim() == 4 else (out[:, 0], lse[:, 0])


def _scale64(s, kv_heads: int) -> torch.Tensor | None:
    """A scale (number or tensor, scalar or ``[Hkv]``) as float64 ``[Hkv]`` on CPU, or None."""
    if s is None:
        return None
    t = torch.as_tensor(s, dtype=torch.float64).detach().cpu().reshape(-1)
    return t.expand(kv_heads) if t.numel() == 1 else t
