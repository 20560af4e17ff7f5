"""Triton jit code of the split-KV (Flash-Decoding) decode-attention kernel. No host logic here:
the launcher in ``triton_launch.py`` validates inputs, picks the config and the grid.

Stage one, one program per (batch row, KV head, query-head block, split): all query heads that
share the KV head form the rows of a ``[BLOCK_G, D]`` query tile (padded to >= 16 rows for
``tl.dot``), so each K/V element of the split is read from memory once; the split is walked in
``BLOCK_N``-key tiles with an online softmax, in base 2 (``exp2`` is the native instruction; the
scores are pre-multiplied by ``log2(e)``). It writes the split's partial state ``(o, lse)`` with
``lse`` converted back to natural log.

Stage two, one program per (batch row, query head): the exact merge of the splits' states, the same
algebra as ``tree_attn.merge.merge_states`` (max-shifted weights ``exp(lse_i - m)``, empty states
with lse -inf contribute nothing, a row with no keys gives out 0 and lse -inf; a NaN or +inf lse
makes the row NaN, or with ``FAULTY_IS_EMPTY`` counts as empty, as the public ``merge_partials``).
"""

from __future__ import annotations

import triton
import triton.language as tl

# ln(2): the kernel works in base 2 internally, lse leaves in natural log. Globals read
# inside @triton.jit must be constexpr. log2(e) is folded into the scale on the host (triton_launch).
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def split_kv_stage1_kernel(
    Q,  # [B, Hq, D]
    K,  # [B, N, Hkv, D]
    V,  # [B, N, Hkv, D]
    SEQ_LENS,  # [B] int32 (read only if HAS_SEQ_LENS)
    O_PART,  # [B, Hq, S, D] (fp32 partials, or the final output when S == 1); D stride 1
    LSE_PART,  # [B, Hq, S] fp32, natural log
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_ls,
    num_kv_heads,
    group_blocks,
    kv_len,
    split_len,  # keys per split, a multiple of BLOCK_N
    qk_scale_log2,  # softmax scale * log2(e)
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_G: tl.constexpr,  # padded query-head rows per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,
    STRIDE_QD: tl.constexpr,  # last-dim strides: usually 1; constexpr so that loads vectorise
    STRIDE_KD: tl.constexpr,
    STRIDE_VD: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    UPCAST: tl.constexpr,  # do all math in fp32 (fp32 inputs, mixed dtypes, or the CPU interpreter)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 dots (tf32 would lose ~3 decimal digits)
):
    pid_bhg = tl.program_id(0)
    pid_split = tl.program_id(1)
    gblk = pid_bhg % group_blocks
    bh = pid_bhg // group_blocks
    h = bh % num_kv_heads
    b = bh // num_kv_heads
    # 64-bit bases: row and head offsets of a multi-GB cache overflow int32 (16 x 1M x 8 x 128 > 2^31).
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    offs_g = gblk * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP
    hq64 = (h * GROUP + offs_g).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q_ptrs = Q + b64 * stride_qb + hq64[:, None] * stride_qh + offs_d[None, :] * STRIDE_QD
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    if HAS_SEQ_LENS:
        row_len = tl.load(SEQ_LENS + b).to(tl.int32)
        # Out-of-range lengths are clamped rather than trusted: never read past N.
        row_len = tl.minimum(tl.maximum(row_len, 0), kv_len)
    else:
        row_len = kv_len
    start = pid_split * split_len
    end = tl.minimum(start + split_len, row_len)

    offs_n0 = tl.arange(0, BLOCK_N)
    # Tile-local offsets fit int32; the tile's base advances in int64.
    k_local = offs_n0[:, None] * stride_kn + offs_d[None, :] * STRIDE_KD
    v_local = offs_n0[:, None] * stride_vn + offs_d[None, :] * STRIDE_VD
    start64 = start.to(tl.int64)
    k_ptrs = K + b64 * stride_kb + h64 * stride_kh + start64 * stride_kn + k_local
    v_ptrs = V + b64 * stride_vb + h64 * stride_vh + start64 * stride_vn + v_local
    step_k = tl.full([], BLOCK_N, tl.int64) * stride_kn
    step_v = tl.full([], BLOCK_N, tl.int64) * stride_vn

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every iteration has at least one valid key (start_n < end), so m_new below is finite and
    # no -inf - -inf can appear; an empty split runs no iteration at all.
    for start_n in range(start, end, BLOCK_N):
        mask_n = (start_n + offs_n0) < end
        # Masked lanes load 0, never what lies past seq_len (an unwritten cache may hold NaN).
        k = tl.load(k_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N] fp32
        else:
            qk = tl.dot(q, tl.trans(k))  # fp16/bf16 tensor-core dot, fp32 accumulation
        s = tl.where(mask_n[None, :], qk * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            # Tensor cores want matching operand types: p in V's dtype, fp32 accumulation.
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        k_ptrs += step_k
        v_ptrs += step_v

    # Only a split that ran no iteration has l_i == 0 (a valid key adds exp2(0) = 1 at its row's
    # max). NaN data gives a NaN l_i, which must stay NaN here (stage two then poisons the row)
    # rather than read as empty: "l_i > 0" would drop that split silently.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]  # acc is 0 for an empty split, so o is 0 there
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)

    o_ptrs = O_PART + b64 * stride_ob + hq64[:, None] * stride_oh + pid_split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o.to(O_PART.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    lse_ptrs = LSE_PART + b64 * stride_lb + hq64 * stride_lh + pid_split * stride_ls
    tl.store(lse_ptrs, lse, mask=mask_g)


@triton.jit
def split_kv_stage2_kernel(
    O_PART,  # [B, Hq, S, D] fp32, D stride 1
    LSE_PART,  # [B, Hq, S] fp32
    OUT,  # [B, Hq, D] in q's dtype, D stride 1
    LSE_OUT,  # [B, Hq] fp32
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_outb,
    stride_outh,
    stride_lob,
    stride_loh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
    FAULTY_IS_EMPTY: tl.constexpr,  # True: +inf/NaN lse = an empty state (public merge); False: NaN out
):
    pid = tl.program_id(0)
    h64 = (pid % num_heads).to(tl.int64)
    b64 = (pid // num_heads).to(tl.int64)
    offs_s0 = tl.arange(0, SPLIT_TILE)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse_base = LSE_PART + b64 * stride_lb + h64 * stride_lh
    o_base = O_PART + b64 * stride_pb + h64 * stride_ph

    # Pass 1: the largest lse. With FAULTY_IS_EMPTY (states handed in by callers, whose kernels
    # may mark an empty state with +inf or NaN) those are treated as empty, as in merge.py;
    # otherwise (our own splits and ranks, where NaN can only come from NaN data) any NaN or +inf
    # makes the row NaN, as torch SDPA does.
    m_vec = tl.full([SPLIT_TILE], float("-inf"), tl.float32)
    bad_vec = tl.zeros([SPLIT_TILE], tl.int32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        offs_s = s0 + offs_s0
        l = tl.load(lse_base + offs_s * stride_ls, mask=offs_s < num_splits, other=float("-inf"))
        faulty = ~(l < float("inf"))  # +inf or NaN (NaN < inf is false)
        l = tl.where(faulty, float("-inf"), l)
        bad_vec = tl.maximum(bad_vec, faulty.to(tl.int32))
        m_vec = tl.maximum(m_vec, l)
    m = tl.max(m_vec, 0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)  # all empty: shift by 0 so exp gives 0, not NaN

    # Pass 2: weights exp(lse_i - m) and the weighted sum of the partial outputs.
    den_vec = tl.zeros([SPLIT_TILE], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        offs_s = s0 + offs_s0
        mask_s = offs_s < num_splits
        l = tl.load(lse_base + offs_s * stride_ls, mask=mask_s, other=float("-inf"))
        l = tl.where(l < float("inf"), l, float("-inf"))
        w = tl.exp(l - m_safe)  # 0 for empty states
        o = tl.load(o_base + offs_s[:, None] * stride_ps + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        # An empty state's o is ignored explicitly (0 * NaN would be NaN).
        acc += tl.sum(tl.where(w[:, None] > 0.0, w[:, None] * o, 0.0), 0)
        den_vec += w
    den = tl.sum(den_vec, 0)
    nonempty = den > 0.0
    den_safe = tl.where(nonempty, den, 1.0)
    out = tl.where(nonempty, acc / den_safe, 0.0)
    lse = tl.where(nonempty, m_safe + tl.log(den_safe), float("-inf"))
    if not FAULTY_IS_EMPTY:
        poisoned = tl.max(bad_vec, 0) > 0
        out = tl.where(poisoned, float("nan"), out)
        lse = tl.where(poisoned, float("nan"), lse)
    tl.store(OUT + b64 * stride_outb + h64 * stride_outh + offs_d, out.to(OUT.dtype.element_ty), mask=mask_d)
    tl.store(LSE_OUT + b64 * stride_lob + h64 * stride_loh, lse)
