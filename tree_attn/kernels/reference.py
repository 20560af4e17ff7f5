"""Torch decode attention: the float64 truth, and the torch path ``decode_attention(impl="torch")`` runs.

- :func:`decode_attention_float64`: straightforward, unchunked, float64: the ground truth of tests.
- :func:`decode_attention_torch`: the torch implementation, exact in float32 arithmetic. CPU tensors
  go to :func:`tree_attn.kernels.cpu_decode.decode_attention_cpu` (tuned for one core's read
  bandwidth); other devices to the device-agnostic chunked form below, which processes the KV
  sequence in chunks and merges each chunk's state into a running state with the exact merge of
  ``tree_attn.merge``, without host synchronisation.

Both forms convert only one chunk to float32 at a time, so memory stays bounded however long N is.
"""

from __future__ import annotations

import torch

from ..merge import merge_two
from .cpu_decode import decode_attention_cpu
from .shapes import check_decode_inputs

# Elements of one float32 K (or V) chunk: 4 Mi elements = 16 MiB, small enough to stay in a CPU's
# last-level cache region of interest and to bound the extra memory, big enough that the einsum
# calls are not dominated by Python overhead.
CHUNK_ELEMENTS = 1 << 22


def _chunk_tokens(batch: int, kv_heads: int, head_dim: int) -> int:
    per_token = max(1, batch * kv_heads * head_dim)
    return max(64, CHUNK_ELEMENTS // per_token)


def decode_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one new query per row against a KV cache.

    CPU tensors run :func:`tree_attn.kernels.cpu_decode.decode_attention_cpu`; others, and inputs
    that need gradients, the chunked einsum form (:func:`decode_attention_chunked`).

    Args:
        q: ``[B, Hq, D]``.
        k, v: ``[B, N, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: query head h reads KV head h // (Hq/Hkv)).
        seq_lens: optional int ``[B]``: valid keys per row (0..N); later positions are ignored.
        scale: softmax scale, default ``D ** -0.5``.
        chunk_tokens: KV positions per chunk (default: ~1 MiB of K as stored per chunk on CPU, see
            ``cpu_decode``; about 16 MiB of float32 per chunk elsewhere).

    Returns:
        ``out [B, Hq, D]`` in q's dtype and ``lse [B, Hq]`` float32 (natural log). Rows with no
        valid keys give out 0 and lse -inf.
    """
    # The CPU path writes into preallocated buffers (bmm out=, in-place exp): not differentiable.
    # Inputs that need gradients take the chunked form, which autograd can follow.
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and not needs_grad:
        return decode_attention_cpu(q, k, v, seq_lens=seq_lens, scale=scale, chunk_tokens=chunk_tokens)
    return decode_attention_chunked(q, k, v, seq_lens=seq_lens, scale=scale, chunk_tokens=chunk_tokens)


def decode_attention_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The device-agnostic chunked form of :func:`decode_attention_torch` (same contract).

    No host synchronisation (seq_lens become a mask), so it suits GPU tensors. On CPU it is the
    slower form: its einsums read the interleaved ``[N, Hkv, D]`` cache head by head, and each chunk
    adds a logsumexp and a stacked merge: ~8 GB/s at 8 x 128 fp32 on one Zen 4 core, 21-31% of a
    sequential ``torch.sum`` (``benchmarks/RESULTS.md``).
    """
    shape = check_decode_inputs(q, k, v, seq_lens)
    b, hq, hkv, d, n = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len
    g = shape.group
    if scale is None:
        scale = d**-0.5
    step = chunk_tokens or _chunk_tokens(b, hkv, d)
    qf = (q.float() * scale).view(b, hkv, g, d)
    out = torch.zeros(b, hkv, g, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hkv, g), float("-inf"), dtype=torch.float32, device=q.device)
    positions = torch.arange(step, device=q.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        kc = k[:, start:stop].float()  # [B, C, Hkv, D]
        vc = v[:, start:stop].float()
        scores = torch.einsum("bhgd,bchd->bhgc", qf, kc)  # [B, Hkv, G, C]
        if seq_lens is not None:
            valid = (start + positions[: stop - start]).unsqueeze(0) < seq_lens.to(q.device).unsqueeze(1)  # [B, C]
            scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        c_lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]; -inf where the chunk is all masked
        c_lse_safe = torch.where(torch.isfinite(c_lse), c_lse, torch.zeros_like(c_lse))
        p = torch.exp(scores - c_lse_safe.unsqueeze(-1))
        c_out = torch.einsum("bhgc,bchd->bhgd", p, vc)
        out, lse = merge_two(out, lse, c_out, c_lse)
    return out.view(b, hq, d).to(q.dtype), lse.view(b, hq)


def decode_attention_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Straightforward float64 decode attention on CPU, unchunked: the ground truth for tests.

    Same contract as :func:`decode_attention_torch`, but returns out and lse in float64.
    """
    shape = check_decode_inputs(q, k, v, seq_lens)
    b, hq, hkv, d, n = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len
    g = shape.group
    if scale is None:
        scale = d**-0.5
    qd = q.detach().cpu().double().view(b, hkv, g, d) * scale
    kd = k.detach().cpu().double()
    vd = v.detach().cpu().double()
    scores = torch.einsum("bhgd,bnhd->bhgn", qd, kd)
    if seq_lens is not None:
        valid = torch.arange(n).unsqueeze(0) < seq_lens.cpu().unsqueeze(1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - lse_safe.unsqueeze(-1))
    out = torch.einsum("bhgn,bnhd->bhgd", p, vd)
    return out.reshape(b, hq, d), lse.reshape(b, hq)
