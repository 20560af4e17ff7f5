"""Decode attention on CPU tensors: the fused C kernel where it applies, else torch ops.

This is what ``decode_attention(impl="torch")`` (and ``"auto"`` for CPU tensors) runs on CPU ranks.
The float64 truth it is tested against is :func:`tree_attn.kernels.reference.decode_attention_float64`.

A contiguous or paged cache with a dense head dimension, with one query token per row (the decode
step of ``run``, ``tree_decode`` and ``generate``) or several (a verify step), goes to the C kernel
of :mod:`tree_attn.kernels.cpu_native` (``cpu_decode.c``) when this machine could build it: it reads
K and V once, in memory order, and reached 83-97% of one core's read bandwidth at MHA 8 x 128 fp32
where the torch ops below reach 42-47% (numbers and command in ``benchmarks/RESULTS.md``). Calls
with many query rows per KV head (``NATIVE_MAX_QUERY_ROWS``; MKL's GEMM wins there), caches whose
head dimension is strided, explicit chunking and machines without a C compiler take the torch ops,
described next.

Why it is shaped this way (measured on a 2-core AMD EPYC Zen 4 VM, torch 2.13 CPU with MKL, one
thread, MHA 8 x 128, fp32, 16,384 tokens per rank unless said; end-to-end numbers, the command and
the public peer's numbers are in ``benchmarks/RESULTS.md``):

* The KV cache is ``[B, N, Hkv, D]``: one token's heads are contiguous (4 KiB for 8 x 128 fp32),
  one head's keys are an ``[N, D]`` matrix with row stride ``Hkv * D``. That matrix is a valid BLAS
  operand without a copy, but a pass over it reads 512 B of every 4 KiB page: the hardware
  prefetchers stop at page boundaries, and a per-head ``sum`` over such a cache ran at 6.6 GB/s
  against 26.5 GB/s for one sequential ``torch.sum`` over the same bytes. The previous
  implementation's ``einsum("bhgd,bchd->bhgc")`` (a ``bmm`` over heads) read it that way at
  5-6 GB/s; its two einsums took 84% of its time, the per-chunk logsumexp/exp/stacked merge ~15%.
* So each chunk of ``C`` tokens (~1 MiB of K or V, about L2's size) is first read sequentially by a
  cheap reduction (``chunk.amax()``, which streams at the core's read bandwidth, ~10% faster than
  ``sum``; for fp16/bf16 inputs the float32 conversion is that read), then ``torch.bmm`` /
  ``baddbmm_`` work per head on the now cache-resident chunk, copy-free (MKL: ~30-40 GB/s on
  cache-resident 8 x 128 fp32 chunks on this core). K's score pass went from 13 ms to ~5 ms.
  What is left is those two passes back to back: a sequential read at DRAM speed, then the
  per-head compute from cache at about the same speed, so ~50% of the read bandwidth is this
  design's ceiling on one core. The other layouts and kernels measured (a head-major copy of the
  chunk, ``(k * q).sum(-1)``, ``embedding_bag`` for ``p @ V``, oneDNN grouped 1x1 convolution,
  sparse block-diagonal ``q``, ``scaled_dot_product_attention``) were no faster or slower.
* The softmax is exact and two-pass over blocks of up to ``SCORE_ELEMENTS`` scores: one pass over K
  writes every score of the block (``bmm`` into a preallocated buffer), then one max, one in-place
  ``sub_``/``exp_`` and one sum give the block's log-sum-exp, and one pass over V accumulates
  ``p @ V`` in place (``baddbmm_``): no per-chunk ``logsumexp``/``masked_fill``/``torch.stack``.
  Blocks are merged with the usual rescaling only when a row has more than one (more than 131,072
  tokens at 8 query heads).
* Rows are processed one at a time, each up to its own ``seq_lens`` entry: no masking at all, and
  rows of length 0 are skipped (out 0, lse -inf).
* GQA: the G query heads of a KV head are the M = G rows of one per-head product, so K and V are
  read once per KV head. MKL's small-M kernels reach only ~14 GB/s on cache-resident data at
  G = 4, so GQA 32/8 runs at ~30% of the read bandwidth (still ahead of a per-head einsum).
* Several query tokens per row (``q [B, Sq, Hq, D]``, speculative decoding's verify step): the
  Sq tokens join the G heads as the M = Sq * G rows of the same products, so K and V are still
  read once. Causal masking touches at most Sq - 1 score columns per row (the new tokens'), set
  to -inf after the scores are written.
* A paged cache (``block_table``): each chunk's tokens are gathered from the pool
  (``index_select``; a page of a 16-token pool is 64 KiB of contiguous memory at 8 x 128 fp32)
  into a chunk buffer, which replaces the sequential "touch" read: the per-head products then
  read it from cache, as for a contiguous cache. No copy of the whole shard is made.
* Extra memory is bounded: one score block (``SCORE_ELEMENTS`` floats, 4 MiB) and, for fp16/bf16
  inputs, two float32 chunk buffers. The cache is never converted as a whole.
* fp8 caches (``float8_e4m3fn``, ``float8_e4m3fnuz``, with float32 scales per KV head): read and
  widened like fp16/bf16 ones (the C kernel widens the bytes with integer arithmetic; the torch
  ops convert each chunk into its float32 buffer), and the scales folded as the Triton kernel
  folds them: ``k_scale[h]`` into the query rows of KV head h (scores ``(q * k_scale[h]) . k8``),
  ``v_scale[h]`` into their output (``out = v_scale[h] * sum p v8 / l``); lse needs nothing.
"""

from __future__ import annotations

import torch

from .cpu_native import NativeDecodePlan, NativeKernel, decode_native, native_kernel, native_status
from .shapes import check_decode_inputs

# Bytes of one K (or V) chunk as stored: the unit that is read sequentially and then worked on per
# head from cache (L2 is 1 MiB per core on Zen 4, 1.25-2 MiB on recent Xeons). Measured at 8 x 128
# fp32: 16K tokens, 256-token chunks (1 MiB) 9.75 ms, 192 and 384 within 2%, 64 tokens 17% slower
# (each chunk costs ~15 us of op dispatch); 64K tokens, 128 to 512 tokens all within 1.5%. bf16
# takes 512 tokens (1 MiB read, a 2 MiB float32 buffer): 11% faster than 256 at 16K tokens.
CHUNK_BYTES = 1 << 20

# The C kernel's products are dot products per query row; MKL's GEMM wins once a KV head has many
# query rows (Sq x G). Measured with benchmarks/bench_cpu_rows.py (fp32, causal, one thread, C vs
# torch ops, ms): at 16,384 tokens MHA 8 x 128 at 1/2/4/8/16 rows 9.8/18.2, 10.5/25.3, 11.8/23.3,
# 19.8/32.4, 32.2/36.2; GQA 32/8 at 4/8/16/32/64 rows 10.5/22.9, 19.6/33.0, 35.2/42.5, 62.6/59.4,
# 130.0/98.3; at 65,536 tokens 16 rows 153.2/183.3 (MHA) and 153.0/177.9 (GQA), 32 rows
# 238.5/245.8, 64 rows 520.4/426.5. By default, calls with more rows per KV head than this take the
# torch ops.
NATIVE_MAX_QUERY_ROWS = 16

# Scores of one softmax block: [Hkv, G, T] float32 (4 MiB). Bounds the extra memory whatever N is;
# at 8 query heads a block holds 131,072 tokens, so a rank's shard is usually one block.
SCORE_ELEMENTS = 1 << 20


def cpu_chunk_tokens(kv_heads: int, head_dim: int, element_size: int = 4) -> int:
    """Default tokens per chunk: about :data:`CHUNK_BYTES` of cache (``element_size`` bytes per
    value), at least 16."""
    return max(16, CHUNK_BYTES // max(1, kv_heads * head_dim * element_size))


def decode_attention_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, chunk_tokens: int | None = None,
    block_tokens: int | None = None, causal: bool = False, block_table: torch.Tensor | None = None,
    native: bool | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one or several new query tokens per row against a KV cache, for CPU tensors.

    CPU tensors with a dense head dimension (contiguous or paged caches, one or several query
    tokens, causal or not, at most :data:`NATIVE_MAX_QUERY_ROWS` query rows Sq x G per KV head)
    and default chunking run the fused C kernel of ``cpu_native`` when it is built; everything
    else the torch ops below.

    Args:
        q: ``[B, Hq, D]``, or ``[B, Sq, Hq, D]`` (Sq new tokens per row), float16/bfloat16/float32.
        k, v: ``[B, N, Hkv, D]`` float16/bfloat16/float32, or fp8 with ``k_scale``/``v_scale`` (one
            dtype), any strides (e.g. slices of a bigger cache), ``Hq % Hkv == 0``; query head
            ``h`` reads KV head ``h // (Hq / Hkv)``.
            With ``block_table``: pools ``[num_blocks, block_size, Hkv, D]``, read chunk by chunk
            (each ~1 MiB chunk's pages gathered into a buffer that stays in cache).
        seq_lens: optional integer ``[B]``: valid keys per row (0..N); later positions are ignored.
        scale: softmax scale, default ``D ** -0.5``.
        chunk_tokens: KV positions per chunk (default :func:`cpu_chunk_tokens`, ~1 MiB of cache).
        block_tokens: KV positions per softmax block (default: ``SCORE_ELEMENTS / (Sq Hq)``, rounded
            down to whole chunks); rows longer than that merge block states exactly.
        causal: the row's last Sq valid keys are the new tokens; token i sees keys
            ``[0, seq_len - Sq + 1 + i)`` (see ``reference.key_limits``).
        block_table: integer ``[B, max_blocks]`` for a paged cache (``seq_lens`` required; every
            entry a row reads must lie in the pool: ``check_decode_inputs`` checks it), or None.
        native: None: the C kernel where it applies, is available and is the faster (at most
            :data:`NATIVE_MAX_QUERY_ROWS` rows per KV head), else torch ops. True: the C kernel
            whatever the rows, or an error saying why not. False: torch ops.
        k_scale, v_scale: an fp8 cache's float32 ``[Hkv]`` dequantization scales (values checked
            by the caller), else None.

    Returns:
        ``out`` (q's shape and dtype) and ``lse`` float32 (``[B, Hq]`` or ``[B, Sq, Hq]``, natural
        log). Query tokens with no valid keys give out 0 and lse -inf. All arithmetic is float32.
        Works on any device (it reads ``seq_lens`` on the host), but is tuned for CPU: on GPUs use
        the Triton kernel.
    """
    shape = check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
    b, hq, hkv, d, n, sq = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len, shape.q_len
    g = shape.group
    rows = shape.query_rows  # the Sq tokens' G heads of one KV head: the M rows of one product
    if scale is None:
        scale = d**-0.5
    lens = [n] * b if seq_lens is None else [int(x) for x in seq_lens.tolist()]
    empty = n == 0 or max(lens, default=0) == 0
    kernel = None if empty else _native_kernel_for(native, q, k, v, rows, block_table, chunk_tokens, block_tokens)
    if kernel is not None:
        lens_t = torch.tensor(lens, dtype=torch.int64)
        o, l = decode_native(kernel, q, k, v, lens_t, scale, block_table, causal and sq > 1, k_scale, v_scale)
        return o.to(q.dtype), l
    dev = q.device
    out = torch.zeros(b, hkv, sq, g, d, dtype=torch.float32, device=dev)
    lse = torch.full((b, hkv, sq, g), float("-inf"), dtype=torch.float32, device=dev)
    if empty:
        return _finish(q, out, lse)

    step = max(1, int(chunk_tokens)) if chunk_tokens else cpu_chunk_tokens(hkv, d, k.element_size())
    block = block_tokens or SCORE_ELEMENTS // (hq * sq)
    block = max(step, block // step * step)  # whole chunks per block
    # [B, Hkv, Sq * G, D]: row r of a KV head's product is token r // G, head r % G.
    if sq == 1:
        qs = (q.float() * scale).reshape(b, hkv, rows, d)
    else:
        qs = (q.float() * scale).view(b, sq, hkv, g, d).transpose(1, 2).reshape(b, hkv, rows, d)
    if k_scale is not None:  # fp8: k_scale folded into each KV head's query rows
        qs = qs * k_scale.view(1, hkv, 1, 1)
    paged = block_table is not None
    work = _Work(k, v, step, hkv, rows, d, min(block, max(lens)), paged)
    if paged:
        bs = shape.block_size
        k, v = k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)  # [num_blocks * bs, Hkv, D]: a token per row
        offsets = torch.arange(bs)
    out_rows = out.view(b, hkv, rows, d)
    lse_rows = lse.view(b, hkv, rows)
    for row, length in enumerate(lens):
        if length == 0:
            continue
        if paged:  # the pool rows of this row's tokens, in order
            pages = block_table[row, : -(-length // bs)].to(torch.int64)
            tokens = (pages[:, None] * bs + offsets[None, :]).reshape(-1)[:length]
        # Causal: key t is hidden from tokens i with t >= length - Sq + 1 + i (only the last Sq - 1
        # keys of the row can be hidden from anyone).
        causal_from = length - sq + 1 if causal and sq > 1 else None
        state = None
        for s0 in range(0, length, block):
            s1 = min(length, s0 + block)
            hidden = _causal_mask(causal_from, s0, s1, sq, g)
            if paged:
                part = _block(qs[row], k, v, work, hidden, tokens[s0:s1])
            else:
                part = _block(qs[row], k[row, s0:s1], v[row, s0:s1], work, hidden)
            state = part if state is None else _merge(state, part)
        m, l, acc = state
        # A token that saw no key (only under causal: a row shorter than Sq) has l == 0: out 0,
        # lse -inf. NaN data keeps l NaN, and so the row NaN.
        torch.div(acc, l, out=out_rows[row])
        if causal_from is not None:
            out_rows[row].masked_fill_(l == 0, 0.0)
        lse_rows[row] = (m + torch.log(l)).squeeze(-1)
    if v_scale is not None:  # fp8: v_scale folded into each KV head's output
        out.mul_(v_scale.view(1, hkv, 1, 1, 1))
    return _finish(q, out, lse)


def native_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor | None, scale: float,
                causal: bool) -> NativeDecodePlan | None:
    """The C kernel's call resolved once for this signature (:class:`~.cpu_native.NativeDecodePlan`),
    or None where :func:`decode_attention_cpu` would take the torch ops (or the kernel is off).
    The inputs' shapes must have been checked (``check_decode_inputs``)."""
    b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
    sq = q.shape[1] if q.dim() == 4 else 1
    hkv = k.shape[2]
    kernel = _native_kernel_for(None, q, k, v, sq * (hq // hkv), block_table, None, None)
    if kernel is None:
        return None
    return NativeDecodePlan(
        kernel, batch=b, q_len=sq, q_heads=hq, kv_heads=hkv, head_dim=d, kv_dtype=k.dtype, scale=scale,
        causal=causal, tokens=q.dim() == 4, table_cols=0 if block_table is None else block_table.shape[1],
        block_size=k.shape[1] if block_table is not None else 0,
    )


def _native_kernel_for(native, q, k, v, rows, block_table, chunk_tokens, block_tokens) -> NativeKernel | None:
    """The C kernel when ``native`` allows it and the call is one it computes; None for the torch path.
    ``rows``: query rows per KV head (Sq x G)."""
    if native is False or (native is None and rows > NATIVE_MAX_QUERY_ROWS):
        return None
    why_not = None
    if q.device.type != "cpu":
        why_not = f"tensors on {q.device.type}"
    elif k.stride(-1) != 1 or v.stride(-1) != 1:
        why_not = "the head dimension of k and v must be dense (stride 1)"
    elif chunk_tokens or block_tokens:
        why_not = "chunk_tokens/block_tokens set the torch path's chunking"
    kernel = None if why_not else native_kernel()
    if why_not is None and kernel is None:
        why_not = native_status().detail
    if why_not is None and k.dtype not in kernel.dtypes:
        why_not = f"this build has no {k.dtype} kernel"
    if why_not is not None:
        if native:
            raise ValueError(f"the C decode kernel cannot run this call: {why_not}")
        return None
    return kernel


def _finish(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [B, Hkv, Sq, G, D]``, ``lse [B, Hkv, Sq, G]`` to q's layout (``[B, (Sq,) Hq, ...]``)."""
    b, hkv, sq, g, d = out.shape
    if sq == 1 and q.dim() == 3:  # views only: the one-token path allocates nothing more
        return out.view(b, hkv * g, d).to(q.dtype), lse.view(b, hkv * g)
    o = out.transpose(1, 2).reshape(b, sq, hkv * g, d).to(q.dtype)
    l = lse.transpose(1, 2).reshape(b, sq, hkv * g)
    return (o, l) if q.dim() == 4 else (o[:, 0], l[:, 0])


def _causal_mask(causal_from: int | None, s0: int, s1: int, sq: int, g: int) -> list[tuple[int, int]] | None:
    """For keys ``s0..s1-1`` of a block: ``(key index in the block, rows hidden from it)`` pairs;
    the first ``rows`` query rows (tokens ``0..rows/G - 1``) must not see that key. None: nothing
    hidden in this block."""
    if causal_from is None or s1 <= causal_from:
        return None
    return [(t - s0, min(sq, t - causal_from + 1) * g) for t in range(max(s0, causal_from), s1)]


class _Work:
    """Per-call settings and buffers of :func:`decode_attention_cpu` (bounded, N-independent)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, step: int, hkv: int, g: int, d: int, block: int,
                 paged: bool = False):
        dev = k.device
        self.step = step
        # Paged pools: each chunk's tokens are gathered (index_select, a page = block_size tokens
        # of contiguous memory) into these buffers, which then stay in cache for the per-head
        # products, as the "touch" below does for a contiguous cache.
        self.gk = torch.empty(step, hkv, d, dtype=k.dtype, device=dev) if paged else None
        self.gv = torch.empty(step, hkv, d, dtype=v.dtype, device=dev) if paged else None
        # fp16/bf16: one float32 chunk buffer per operand. The conversion is the sequential read,
        # and bmm then reads the converted chunk from cache. Converting the whole cache at once
        # would double its memory.
        convert = k.dtype != torch.float32
        self.kbuf = torch.empty(step, hkv, d, dtype=torch.float32, device=dev) if convert else None
        self.vbuf = torch.empty(step, hkv, d, dtype=torch.float32, device=dev) if convert else None
        # fp32: a sequential "touch" (chunk.amax(), a reduction that streams at the core's read
        # bandwidth; ~10% faster than sum) loads the chunk into L2 before bmm's per-head passes.
        # Only needed where one token's heads interleave ([B, N, Hkv, D] with Hkv > 1); with one
        # KV head, or a head-major cache seen through a transpose, a head's keys are contiguous.
        self.touch_k = not convert and not paged and hkv > 1 and k.stride(2) < k.stride(1)
        self.touch_v = not convert and not paged and hkv > 1 and v.stride(2) < v.stride(1)
        self.scores = torch.empty(block * hkv * g, dtype=torch.float32, device=dev)


def _gathered(pool: torch.Tensor, tokens: torch.Tensor, step: int, buf: torch.Tensor, perm: tuple[int, int, int]):
    """Chunks of ``step`` tokens of a paged pool (``[num_blocks * block_size, Hkv, D]``, rows
    ``tokens``), each gathered into ``buf`` and yielded permuted by ``perm``; a chunk is valid
    until the next one is gathered."""
    for c0 in range(0, tokens.shape[0], step):
        sel = tokens[c0 : c0 + step]
        yield torch.index_select(pool, 0, sel, out=buf[: sel.shape[0]]).permute(*perm)


def _block(qg: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, work: _Work, hidden=None, tokens=None):
    """Exact softmax state of one row's keys ``kb, vb [T, Hkv, D]`` (T <= the block size), or with
    ``tokens [T]`` (int64), of the rows ``tokens`` of flattened paged pools ``kb, vb``.

    ``qg [Hkv, G, D]`` float32, pre-scaled (G: the query rows per KV head, ``Sq * group``);
    ``hidden``: causal masking, from :func:`_causal_mask`. Returns ``m [Hkv, G, 1]`` (the block's max score),
    ``l [Hkv, G, 1]`` (sum of ``exp(score - m)``), ``acc [Hkv, G, D]`` (sum of
    ``exp(score - m) * v``), all float32.
    """
    hkv, g, d = qg.shape
    step = work.step
    if tokens is None:
        t = kb.shape[0]
        # Chunk views by one split call each: per-chunk Python slicing and permuting cost ~1 us per
        # view, several per chunk.
        k_head = kb.permute(1, 2, 0).split(step, dim=2)  # [Hkv, D, c]: bmm's operand, copy-free
        v_head = vb.permute(1, 0, 2).split(step, dim=1)  # [Hkv, c, D]
    else:
        t = tokens.shape[0]
        k_head = _gathered(kb, tokens, step, work.gk, (1, 2, 0))
        v_head = _gathered(vb, tokens, step, work.gv, (1, 0, 2))
    # The block's scores, chunk after chunk, each chunk's [Hkv, G, c] slab contiguous (bmm writes a
    # contiguous out directly; into a strided column slice of an [Hkv, G, T] buffer it cost ~25%
    # more). Whole chunks form one [nfull, Hkv, G, C] view, a shorter last chunk its own slab.
    full, rem = divmod(t, step)
    scores = work.scores
    whole = scores[: full * hkv * g * step].view(full, hkv, g, step)
    parts = [whole] if full else []  # [n, Hkv, G, c] views; the softmax reduces over dims 0 and 3
    slabs = list(whole.unbind(0))
    if rem:
        tail = scores[full * hkv * g * step : t * hkv * g].view(1, hkv, g, rem)
        parts.append(tail)
        slabs.append(tail[0])
    kbuf, touch = work.kbuf, work.touch_k
    for kh, slab in zip(k_head, slabs):
        if kbuf is not None:
            kh = kbuf[: kh.shape[2]].permute(1, 2, 0).copy_(kh)
        elif touch:
            kh.amax()  # reduces in memory order: a sequential read of the chunk
        torch.bmm(qg, kh, out=slab)  # [Hkv, G, D] @ [Hkv, D, c]
    if hidden:
        for t, rows in hidden:  # at most Sq - 1 keys
            j, col = divmod(t, step)
            slabs[j][:, :rows, col] = float("-inf")
    # Exact softmax over the block: one max, one in-place exp(score - max), one sum.
    m = None
    for p in parts:
        pm = p.amax(dim=(0, 3))
        m = pm if m is None else torch.maximum(m, pm)
    # A NaN score (NaN in q or k) makes m NaN and so the whole row NaN, as the contract asks.
    if hidden:
        # A query row that sees no key of this block: shift by 0 (its exp is 0, not NaN); the
        # state (m 0, l 0, acc 0) then merges as the empty state.
        m = m.masked_fill(m == float("-inf"), 0.0)
    l = None
    m4 = m[None, :, :, None]
    for p in parts:
        p.sub_(m4).exp_()
        ps = p.sum(dim=(0, 3))
        l = ps if l is None else l.add_(ps)
    acc = torch.zeros(hkv, g, d, dtype=torch.float32, device=qg.device)
    vbuf, touch = work.vbuf, work.touch_v
    for vh, slab in zip(v_head, slabs):
        if vbuf is not None:
            vh = vbuf[: vh.shape[1]].permute(1, 0, 2).copy_(vh)
        elif touch:
            vh.amax()
        acc.baddbmm_(slab, vh)  # += [Hkv, G, c] @ [Hkv, c, D]
    return m.unsqueeze(-1), l.unsqueeze(-1), acc


def _merge(a, b):
    """Merge two block states ``(m, l, acc)`` of one row exactly (online-softmax rescaling)."""
    m_a, l_a, acc_a = a
    m_b, l_b, acc_b = b
    m = torch.maximum(m_a, m_b)
    w_a = torch.exp(m_a - m)
    w_b = torch.exp(m_b - m)
    return m, l_a * w_a + l_b * w_b, acc_a * w_a + acc_b * w_b
