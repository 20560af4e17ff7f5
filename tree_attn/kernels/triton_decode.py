"""Triton jit code of the split-KV (Flash-Decoding) decode-attention kernel. No host logic here:
the launcher in ``triton_launch.py`` validates inputs, picks the config and the grid.

Stage one, one program per (batch row, KV head, query-head block, split): all query heads that
share the KV head form the rows of a ``[BLOCK_G, D]`` query tile (padded to >= 16 rows for
``tl.dot``), so each K/V element of the split is read from memory once; the split is walked in
``BLOCK_N``-key tiles with an online softmax, in base 2 (``exp2`` is the native instruction; the
scores are pre-multiplied by ``log2(e)``). It writes the split's partial state ``(o, lse)`` with
``lse`` converted back to natural log.

Several query tokens per row (speculative decoding's verify step, ``q [B, Sq, Hq, D]``) join the
row tile the same way: row r of a program is token ``r // GROUP``, head ``r % GROUP`` of the KV
head, so the tile has ``Sq * GROUP`` rows and K/V are still read once. With ``CAUSAL`` each row
has its own key limit (``seq_len - Sq + 1 + token``); a row that has seen no key yet shifts its
exponentials by 0 instead of -inf (no NaN), and keeps the empty state.

A paged cache (``PAGED``): K and V are pools ``[num_blocks, PAGE_SIZE, Hkv, D]`` and each row's
pages are listed in a block table. When a page holds whole tiles (``PAGE_SIZE % BLOCK_N == 0``,
e.g. 16-key tiles in vLLM's 16-token pages) a tile reads one block id and keeps the contiguous
tile loads; otherwise (any other size, e.g. 1, 3 or 17 tokens, or tiles longer than a page) each
key computes its page and offset and the tile is a gather of BLOCK_N rows of D contiguous
elements. That keeps every size correct with one code path and costs BLOCK_N block-id loads
(from one or a few cache lines) per tile. Block ids are clamped into the pool: a bad id never
reads outside it (the host checks tables, see ``kernels.paged``).

A query whose dtype differs from a 16-bit cache's (``MIXED``): tensor-core dots take one operand
type, and rounding q to the cache's dtype would put its rounding error into every score (the
softmax turns a score error into a relative weight error), while converting the K/V tiles to fp32
costs registers the program does not have (the tiles then spill by kilobytes). So the tiles stay
as they are and q enters the dots as the sum of ``DOT_PARTS`` parts in the cache's dtype, and so do
the softmax weights: each part is the rounded remainder of the ones before, and every 16-bit x
16-bit product is exact in the fp32 accumulator. bf16 (8 significant bits, fp32's exponent range)
holds an fp16 value in 2 parts and an fp32 value in 3. fp16 (11 bits) holds a bf16 value in 1 part
and an fp32 value in 3, but not their range: with ``Q_PRESCALE`` q is first multiplied by a power
of two that puts its largest element in [2^14, 2^15) (exact, as is undoing it on the scores).
A few more tensor-core dots cost nothing in a kernel bound by reading K and V.

An fp8 cache (``KV_FP8``: ``float8_e4m3fn``, or ``float8_e4m3fnuz`` on AMD, with float32
dequantization scales per KV head): K/V tiles are loaded as fp8, one byte per element, and widened
in registers to fp16, as if the cache were fp16: an fp16 query enters the dots as it is, a bf16 or
fp32 one in fp16 parts (the ``MIXED`` path above, prescaled). fp16, not bf16: every e4m3 value
(4 significant bits, exponents 2^-9..2^8; fnuz 2^-10..2^7) is exact in either, but e4m3 -> fp16 is
one hardware conversion per two elements on sm_89+ and CDNA3 (bf16 takes a second one per
element), and the softmax weights enter the P @ V dot with 11 significant bits instead of 8. Each
fp8 x fp16 product is exact in the fp32 accumulator, so the scores are those of the stored values.
Nothing is dequantized in memory: ``k_scale[h]`` multiplies the softmax scale (one scalar per
program, which handles one KV head) and ``v_scale[h]`` the normalised output at the end (the
weights do not depend on it, so neither does lse). The split-KV partials and stage two are the
same as for any other cache.

The V tile's widening is written as inline PTX on NVIDIA GPUs (``FP8_PTX``): the conversion Triton
itself emits for ``.to(tl.float16)``, two elements per ``cvt.rn.f16x2.e4m3x2``, marked impure so
that Triton keeps it where it stands. Otherwise Triton moves P @ V's operand conversion above the
(pure, elementwise) widening, so the V tile reaches the dot still in fp8, in the transposed layout
of the dot's second operand, and an 8-bit transposed shared-memory read has no ``ldmatrix`` on
sm_89/sm_90: the sm_90 build then read V back one byte at a time (64 ``LDS.U8`` per thread and
64-key tile, plus as many instructions again to pack the bytes in pairs). With the widening kept in
place the tile goes shared memory -> registers (16-byte reads) -> fp16 -> shared memory ->
``ldmatrix.trans``, as a 16-bit cache's V does (see benchmarks/RESULTS.md for the instruction
counts). K needs none of this: its operand is not transposed, and ``ldmatrix`` reads its fp8 bytes.

Stage two, one program per (batch row, query head): the exact merge of the splits' states, the same
algebra as ``tree_attn.reduce.state.merge_states`` (max-shifted weights ``exp(lse_i - m)``, empty states
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
def _split_parts(x, DTYPE: tl.constexpr, PARTS: tl.constexpr):
    """``x`` (fp32) as ``PARTS`` (1 to 3) tensors of ``DTYPE`` whose sum is ``x`` up to the last
    part's rounding: each part is the rounded remainder of the ones before (fp32 holds each
    remainder exactly). Unused parts repeat the first."""
    hi = x.to(DTYPE)
    mid = hi
    lo = hi
    if PARTS > 1:
        rest = x - hi.to(tl.float32)
        mid = rest.to(DTYPE)
        if PARTS > 2:
            lo = (rest - mid.to(tl.float32)).to(DTYPE)
    return hi, mid, lo


@triton.jit
def _dot_parts(a0, a1, a2, b, PARTS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(a0 (+ a1 (+ a2))) @ b`` with fp32 accumulation: tensor-core dots of the parts, or under
    ``UPCAST`` (the CPU interpreter) fp32 dots of the same parts, the same products exactly."""
    if UPCAST:
        c = tl.dot(a0.to(tl.float32), b, input_precision=DOT_PRECISION)
        if PARTS > 1:
            c = tl.dot(a1.to(tl.float32), b, c, input_precision=DOT_PRECISION)
        if PARTS > 2:
            c = tl.dot(a2.to(tl.float32), b, c, input_precision=DOT_PRECISION)
    else:
        c = tl.dot(a0, b)
        if PARTS > 1:
            c = tl.dot(a1, b, c)
        if PARTS > 2:
            c = tl.dot(a2, b, c)
    return c


@triton.jit
def _widen_fp8(x, DTYPE: tl.constexpr, PTX: tl.constexpr):
    """An fp8 (e4m3) tile widened exactly to ``DTYPE`` (fp16, the only type the kernel widens to).
    With ``PTX`` (NVIDIA, sm_89+) by the instruction Triton's own conversion uses, four elements
    (one 32-bit register) per inline assembly block, impure so that Triton does not move a layout
    conversion above it (see the module docstring); elsewhere (AMD, the CPU interpreter) by
    Triton's conversion."""
    if PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
        )
    else:
        return x.to(DTYPE)


@triton.jit
def split_kv_stage1_kernel(
    Q,  # [B, (Sq,) Hq, D]
    # K: [B, N, Hkv, D], or with PAGED a pool [num_blocks, PAGE_SIZE, Hkv, D] (then the "b" and "n"
    # strides are the block's and the in-page ones)
    K,
    V,  # as K
    SEQ_LENS,  # [B] int32 (read only if HAS_SEQ_LENS)
    BLOCK_TABLE,  # [B, max_blocks] int32 (read only if PAGED)
    K_SCALE,  # [Hkv] float32 dequantization scales of an fp8 cache (read only if KV_FP8)
    V_SCALE,  # as K_SCALE
    O_PART,  # [B, (Sq,) Hq, S, D] (fp32 partials, or the final output when S == 1); D stride 1
    LSE_PART,  # [B, (Sq,) Hq, S] fp32, natural log
    stride_qb,
    stride_qt,  # query token stride (unused when Q_LEN == 1)
    stride_qh,
    stride_btb,
    num_blocks,  # pool size (PAGED): block ids are clamped to 0..num_blocks-1
    stride_kb,
    stride_kn,
    stride_kh,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lt,
    stride_lh,
    stride_ls,
    num_kv_heads,
    group_blocks,
    kv_len,  # N (PAGED: max_blocks * PAGE_SIZE)
    split_len,  # keys per split, a multiple of BLOCK_N
    qk_scale_log2,  # softmax scale * log2(e)
    GROUP: tl.constexpr,  # query heads per KV head
    Q_LEN: tl.constexpr,  # query tokens per row (Sq)
    CAUSAL: tl.constexpr,  # token i sees keys [0, seq_len - Q_LEN + 1 + i)
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # tokens per block of the pool (PAGED)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_G: tl.constexpr,  # padded query-head rows per program (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,
    STRIDE_QD: tl.constexpr,  # last-dim strides: usually 1; constexpr so that loads vectorise
    STRIDE_KD: tl.constexpr,
    STRIDE_VD: tl.constexpr,
    HAS_SEQ_LENS: tl.constexpr,
    UPCAST: tl.constexpr,  # do all math in fp32 (an fp32 cache, or the CPU interpreter)
    MIXED: tl.constexpr,  # q's dtype differs from the (16-bit) cache's: the parts path (see above)
    DOT_PARTS: tl.constexpr,  # MIXED: q and p enter the dots as this many parts (1 to 3) in the cache's dtype
    Q_PRESCALE: tl.constexpr,  # MIXED over an fp16 cache: scale q into fp16's range first
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 dots (tf32 would lose ~3 decimal digits)
    KV_FP8: tl.constexpr,  # K/V are fp8 with per-KV-head scales (see above)
    FP8_PTX: tl.constexpr,  # KV_FP8 on NVIDIA: V widened by inline PTX (see above)
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

    # Row r of the tile: query token r // GROUP, head r % GROUP of this KV head.
    offs_g = gblk * BLOCK_G + tl.arange(0, BLOCK_G)
    mask_g = offs_g < GROUP * Q_LEN
    if Q_LEN == 1:
        hq64 = (h * GROUP + offs_g).to(tl.int64)
        row_q = hq64 * stride_qh
        row_o = hq64 * stride_oh
        row_l = hq64 * stride_lh
    else:
        tok = offs_g // GROUP
        hq64 = (h * GROUP + offs_g % GROUP).to(tl.int64)
        tok64 = tok.to(tl.int64)
        row_q = tok64 * stride_qt + hq64 * stride_qh
        row_o = tok64 * stride_ot + hq64 * stride_oh
        row_l = tok64 * stride_lt + hq64 * stride_lh
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q_ptrs = Q + b64 * stride_qb + row_q[:, None] + offs_d[None, :] * STRIDE_QD
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    # The dots' operand type: the cache's, or for an fp8 cache the 16-bit type its tiles widen to.
    qk_scale = qk_scale_log2
    if KV_FP8:
        dot_t = tl.float16
        qk_scale = qk_scale_log2 * tl.load(K_SCALE + h)  # this program's KV head
    else:
        dot_t = K.dtype.element_ty
    if MIXED:
        qf = q.to(tl.float32)
        if Q_PRESCALE:
            # 2^-e with e = floor(log2 max|q|) - 14 from the exponent bits: the largest element lands
            # in [2^14, 2^15), far from fp16's overflow (65504) and its subnormals (< 2^-14).
            q_max = tl.max(tl.max(tl.abs(qf), 1), 0)
            e = (q_max.to(tl.int32, bitcast=True) >> 23) - 127 - 14
            e = tl.minimum(tl.maximum(e, -100), 113)  # 2^-e and 2^e stay normal fp32 numbers
            qf = qf * ((127 - e) << 23).to(tl.float32, bitcast=True)
            qk_scale = qk_scale * ((127 + e) << 23).to(tl.float32, bitcast=True)
        q0, q1, q2 = _split_parts(qf, dot_t, DOT_PARTS)
    elif UPCAST:
        q = q.to(tl.float32)

    if HAS_SEQ_LENS:
        row_len = tl.load(SEQ_LENS + b).to(tl.int32)
        # Out-of-range lengths are clamped rather than trusted: never read past N.
        row_len = tl.minimum(tl.maximum(row_len, 0), kv_len)
    else:
        row_len = kv_len
    start = pid_split * split_len
    end = tl.minimum(start + split_len, row_len)
    if CAUSAL:
        # Keys each row sees: the row's past plus its token's new keys up to itself.
        row_lim = row_len - Q_LEN + 1 + (offs_g // GROUP)

    offs_n0 = tl.arange(0, BLOCK_N)
    # Tile-local offsets fit int32; the tile's base advances in int64.
    k_local = offs_n0[:, None] * stride_kn + offs_d[None, :] * STRIDE_KD
    v_local = offs_n0[:, None] * stride_vn + offs_d[None, :] * STRIDE_VD
    start64 = start.to(tl.int64)
    if PAGED:
        k_ptrs = K + h64 * stride_kh + k_local  # plus each tile's (or key's) page and offset
        v_ptrs = V + h64 * stride_vh + v_local
        bt_row = BLOCK_TABLE + b64 * stride_btb
    else:
        k_ptrs = K + b64 * stride_kb + h64 * stride_kh + start64 * stride_kn + k_local
        v_ptrs = V + b64 * stride_vb + h64 * stride_vh + start64 * stride_vn + v_local
        bt_row = BLOCK_TABLE  # never read (the compiler wants every name defined on both paths)
    step_k = tl.full([], BLOCK_N, tl.int64) * stride_kn
    step_v = tl.full([], BLOCK_N, tl.int64) * stride_vn

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Without CAUSAL every iteration has at least one valid key (start_n < end), so m_new below is
    # finite and no -inf - -inf can appear; an empty split runs no iteration at all. With CAUSAL a
    # row may see none of a tile's keys: see m_shift.
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        mask_n = offs_n < end
        if PAGED:
            if PAGE_SIZE % BLOCK_N == 0:
                # The tile lies in one page (tiles start at multiples of BLOCK_N): one block id.
                blk = tl.load(bt_row + start_n // PAGE_SIZE)
                blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
                in_page = tl.full([], 0, tl.int64) + start_n % PAGE_SIZE  # int64 (start_n may be a Python int)
                kt_ptrs = k_ptrs + (blk * stride_kb + in_page * stride_kn)
                vt_ptrs = v_ptrs + (blk * stride_vb + in_page * stride_vn)
            else:
                # Page and offset per key: any page size, any tile length.
                blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
                blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
                in_page = (offs_n % PAGE_SIZE).to(tl.int64)
                kt_ptrs = (K + h64 * stride_kh + (blk * stride_kb + in_page * stride_kn)[:, None]
                           + offs_d[None, :] * STRIDE_KD)
                vt_ptrs = (V + h64 * stride_vh + (blk * stride_vb + in_page * stride_vn)[:, None]
                           + offs_d[None, :] * STRIDE_VD)
        else:
            kt_ptrs = k_ptrs
            vt_ptrs = v_ptrs
        # Masked lanes load 0, never what lies past seq_len (an unwritten cache may hold NaN).
        k = tl.load(kt_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        elif KV_FP8:
            k = k.to(dot_t)  # exact (see above)
        if MIXED:
            qk = _dot_parts(q0, q1, q2, tl.trans(k), DOT_PARTS, UPCAST, DOT_PRECISION)
        elif UPCAST:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N] fp32
        else:
            qk = tl.dot(q, tl.trans(k))  # fp16/bf16 tensor-core dot, fp32 accumulation
        if CAUSAL:
            seen = mask_n[None, :] & (offs_n[None, :] < row_lim[:, None])
            s = tl.where(seen, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no key yet (m_new -inf) shifts by 0: its weights are exp2(-inf)
            # = 0, not NaN, and it stays the empty state. NaN data keeps m_new NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            s = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = m_new
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vt_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8 and not UPCAST:
            v = _widen_fp8(v, dot_t, FP8_PTX)
        if MIXED:
            p0, p1, p2 = _split_parts(p, dot_t, DOT_PARTS)
            if UPCAST:
                v = v.to(tl.float32)
            pv = _dot_parts(p0, p1, p2, v, DOT_PARTS, UPCAST, DOT_PRECISION)
        elif UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            # Tensor cores want matching operand types: p in V's dtype, fp32 accumulation.
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        if not PAGED:
            k_ptrs += step_k
            v_ptrs += step_v

    # Only a split that ran no iteration has l_i == 0 (a valid key adds exp2(0) = 1 at its row's
    # max). NaN data gives a NaN l_i, which must stay NaN here (stage two then poisons the row)
    # rather than read as empty: "l_i > 0" would drop that split silently.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if KV_FP8:
        o = acc * (tl.load(V_SCALE + h) / l_safe)[:, None]  # acc is 0 for an empty split, so o is 0 there
    else:
        o = acc / l_safe[:, None]  # acc is 0 for an empty split, so o is 0 there
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)

    o_ptrs = O_PART + b64 * stride_ob + row_o[:, None] + pid_split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, o.to(O_PART.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
    lse_ptrs = LSE_PART + b64 * stride_lb + row_l + pid_split * stride_ls
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
    # may mark an empty state with +inf or NaN) those are treated as empty, as in reduce/state.py;
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
        o = tl.load(o_base + offs_s[:, None] * stride_ps + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :],
                    other=0.0)
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
