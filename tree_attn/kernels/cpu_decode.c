/* Fused decode attention for CPU tensors: one sequential pass over each row's K and V.
 *
 * Built and loaded by cpu_native.py (ctypes; no Python headers, no torch headers). What it
 * computes is cpu_decode.py's contract (contiguous or paged caches, one or several query tokens per
 * row, causal or not) for caches whose head dimension is dense; that module decides when to call
 * it. Why it exists: torch's per-head products read a [N, Hkv, D] cache at about half of one
 * core's read bandwidth (MKL's sgemv streams at ~50% of a torch.sum on contiguous data too), and
 * no torch op fuses the score pass, the softmax and the p @ V pass. Here every byte of K and V is
 * read once, in memory order, and the work on it is done while it is in L1.
 *
 * For each row and each chunk of CHUNK tokens:
 *   1. scores s[r][t] = q[r] . k[t, r / G]  (r: a query row, t: a token of the chunk; K read token
 *      by token, all heads of one token back to back, the G rows of a KV head in one pass);
 *   2. per query row: the chunk's max, p = exp(s - max) in place, the running sum l and the
 *      running max m (online softmax; out rescaled by exp(m_old - m_new) when the max grows);
 *   3. out[r] += p[r][t] * v[t, r / G]  (V read the same way as K, mostly four tokens per load and
 *      store of out[r]; half-float values then widened once per token, not once per query row).
 * Then out /= l and lse = m + log(l). All arithmetic is float32; q is float32 and already scaled.
 *
 * NaN: a NaN score (or an infinite one, whose exp(inf - inf) is NaN in the torch path too) makes
 * the head's l, out and lse NaN, as in the torch path. Rows of length 0 give out 0 and lse -inf.
 *
 * Build flags allow reassociation (vectorised dot products and sums) but not finite-math: the
 * -inf start of the running max and NaN propagation must keep their IEEE meaning.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define FP8_SIMD 1
#else
#define FP8_SIMD 0
#endif

#define CHUNK 256 /* tokens per chunk: the chunk's scores [heads, CHUNK] float32 stay in cache */

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_E4M3 = 3, DT_E4M3FNUZ = 4 };

#define INLINE static inline __attribute__((always_inline))

/* Parts, for a parallel build (cpu_native.py compiles this file once per part, at once, and links
 * the objects into one library): -DTREE_ATTN_PART=P with P a dtype code (0-4) compiles that dtype's
 * decode instances only, P = -1 everything else (the entry points, the threads, the merge). Without
 * TREE_ATTN_PART the one compile holds every part. The parts share decode_<dtype> and wide_on,
 * hidden: the library exports the entry points only. */
#ifndef TREE_ATTN_PART
#define TREE_ATTN_PART -2
#endif
#define PART(p) (TREE_ATTN_PART == -2 || TREE_ATTN_PART == (p))
#define HIDDEN __attribute__((visibility("hidden")))

/* An fp8 byte as float32, exactly, with integer and float arithmetic and one select (no table: a
 * 256-entry gather does not vectorise). e4m3fn (OCP): sign, 4 exponent bits of bias 7, 3 mantissa
 * bits; NaN at 0x7f and 0xff, no infinity. e4m3fnuz (AMD CDNA3): bias 8, NaN at 0x80 only (no -0).
 * The byte, sign-extended to 32 bits and shifted left by 20, has its exponent and mantissa bits
 * under float32's (exponent field 0-15, mantissa bits 20-22) and copies of the sign above them;
 * masking keeps bit 31 as the sign. That float is the fp8 value times 2^-120 (e4m3fn) or 2^-119
 * (fnuz) exactly, subnormals included (an fp8 subnormal becomes a float32 subnormal of the same
 * mantissa); one multiply by the power of two restores it. Four integer operations, a multiply
 * and a select per element, against a shift for bf16. */
INLINE float load_fp8(int32_t b, int fnuz) {
    uint32_t u = ((uint32_t)b << 20) & 0x87f00000u; /* b: the byte sign-extended */
    float f;
    memcpy(&f, &u, sizeof f);
    f *= fnuz ? 0x1p119f : 0x1p120f;
    const int nan = fnuz ? u == 0x80000000u : (u & 0x7fffffffu) == 0x07f00000u;
    memcpy(&u, &f, sizeof u);
    u = nan ? 0x7fc00000u : u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Element i of a K/V array of dtype dt, as float32. dt is a compile-time constant after inlining.
 * Half floats are widened with integer operations (no _Float16 or F16C needed, and vectorisable):
 * the exponent and mantissa bits moved into a float and multiplied by 2^112 give normal and
 * subnormal halves exactly; infinities and NaN are set apart. fp8: load_fp8. */
INLINE float load(const void *restrict base, int64_t i, int dt) {
    if (dt == DT_F32)
        return ((const float *)base)[i];
    if (dt == DT_E4M3 || dt == DT_E4M3FNUZ)
        return load_fp8(((const int8_t *)base)[i], dt == DT_E4M3FNUZ);
    const uint32_t h = ((const uint16_t *)base)[i];
    uint32_t u;
    float f;
    if (dt == DT_BF16) {
        u = h << 16;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    const uint32_t em = h & 0x7fffu;
    u = em << 13;
    memcpy(&f, &u, sizeof f);
    f *= 0x1p112f;
    memcpy(&u, &f, sizeof u);
    u = em >= 0x7c00u ? (em << 13) | 0x7f800000u : u; /* inf, NaN */
    u |= (h & 0x8000u) << 16;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define IS_FP8(dt) ((dt) == DT_E4M3 || (dt) == DT_E4M3FNUZ)

#if FP8_SIMD
/* fp8 with AVX2 and F16C (x86-64 since 2013): the compiler's vectorisation of load_fp8 ran the
 * K pass at ~6 G elements/s, slower than bf16's memory-bound pass; written out, 16 bytes widen with
 * 3 integer operations and 2 conversions (13.5 G elements/s in the same loop, measured on a Zen 4
 * core). A byte, sign-extended to 16 bits, shifted left by 7 and masked with 0xbf80, is the half
 * float whose value is the fp8 value times 2^-8 (e4m3fn: exponent bias 7 against half's 15) or
 * 2^-7 (fnuz: bias 8), exactly, subnormals included (half subnormals of the same mantissa); F16C
 * converts halves to float32 exactly. FP8_UNIT restores the power of two, once per score (K) or per
 * widened value (V). NaN codes would come out finite (480 x the unit): a token's head vector is
 * checked for them first (byte compares, 32 at a time) and one that holds any takes the exact
 * scalar path (load_fp8), so NaN propagates as it does there. d must be a multiple of 16. */
#define FP8_UNIT(dt) ((dt) == DT_E4M3FNUZ ? 128.0f : 256.0f)

INLINE void fp8x16(const void *p, __m256 *lo, __m256 *hi) {
    __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    x = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xbf80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(x));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(x, 1));
}

/* Whether bytes x[0 .. d) hold an fp8 NaN code (e4m3fn: 0x7f, 0xff; fnuz: 0x80). */
INLINE int fp8_has_nan(const void *x, int64_t d, int dt) {
    const __m256i mask = _mm256_set1_epi8(dt == DT_E4M3FNUZ ? (char)0xff : 0x7f);
    const __m256i code = _mm256_set1_epi8(dt == DT_E4M3FNUZ ? (char)0x80 : 0x7f);
    __m256i any = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= d; i += 32) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)((const char *)x + i));
        any = _mm256_or_si256(any, _mm256_cmpeq_epi8(_mm256_and_si256(b, mask), code));
    }
    int found = !_mm256_testz_si256(any, any);
    for (; i < d; i++) {
        const uint8_t b = ((const uint8_t *)x)[i];
        found |= dt == DT_E4M3FNUZ ? b == 0x80 : (b & 0x7f) == 0x7f;
    }
    return found;
}

INLINE float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* s[j * CHUNK] = q[j] . k for the G query rows of one KV head, k fp8 without NaN codes; G a
 * constant (1, 2, 4, 8): one pass over k feeds them all. */
INLINE void dots_fp8_const(const float *restrict q, const void *restrict k, int64_t d, int64_t G, float *s,
                           float unit) {
    __m256 acc[8][2];
    for (int64_t j = 0; j < G; j++)
        acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __m256 lo, hi;
        fp8x16((const char *)k + i, &lo, &hi);
        for (int64_t j = 0; j < G; j++) {
            acc[j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i), lo, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + j * d + i + 8), hi, acc[j][1]);
        }
    }
    for (int64_t j = 0; j < G; j++)
        s[j * CHUNK] = hsum(_mm256_add_ps(acc[j][0], acc[j][1])) * unit;
}

/* w[0 .. d) = x[0 .. d) as float32 (fp8 without NaN codes). */
INLINE void widen_fp8(float *restrict w, const void *restrict x, int64_t d, float unit) {
    const __m256 u = _mm256_set1_ps(unit);
    for (int64_t i = 0; i < d; i += 16) {
        __m256 lo, hi;
        fp8x16((const char *)x + i, &lo, &hi);
        _mm256_storeu_ps(w + i, _mm256_mul_ps(lo, u));
        _mm256_storeu_ps(w + i + 8, _mm256_mul_ps(hi, u));
    }
}

/* o[0 .. d) += p * x[0 .. d) (fp8 without NaN codes; p already times the unit). */
INLINE void axpy_fp8(float *restrict o, float p, const void *restrict x, int64_t d) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t i = 0; i < d; i += 16) {
        __m256 lo, hi;
        fp8x16((const char *)x + i, &lo, &hi);
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, lo, _mm256_loadu_ps(o + i)));
        _mm256_storeu_ps(o + i + 8, _mm256_fmadd_ps(pv, hi, _mm256_loadu_ps(o + i + 8)));
    }
}
#endif

/* q . k[0 .. d) */
INLINE float dot(const float *restrict q, const void *restrict k, int64_t d, int dt) {
    float acc = 0.0f;
#pragma GCC ivdep
    for (int64_t i = 0; i < d; i++)
        acc += q[i] * load(k, i, dt);
    return acc;
}

/* s[j * CHUNK] = q[j] . k for the G query rows j of one KV head (q rows d apart): one pass over
 * k feeds G independent sums. G is a constant in each instance (2, 4, 8), else a loop of dot.
 * (GQA 32/8 x 128 fp32 at 64K tokens: 56-59 ms against 72-74 ms with G separate dots.) */
INLINE void dots_const(const float *restrict q, const void *restrict k, int64_t d, int64_t G, float *s, int dt) {
    float acc[8] = {0.0f};
    for (int64_t i = 0; i < d; i++) {
        const float x = load(k, i, dt);
        for (int64_t j = 0; j < G; j++)
            acc[j] += q[j * d + i] * x;
    }
    for (int64_t j = 0; j < G; j++)
        s[j * CHUNK] = acc[j];
}

INLINE void dots(const float *restrict q, const void *restrict k, int64_t d, int64_t g, float *s, int dt) {
#if FP8_SIMD
    if (IS_FP8(dt) && d % 16 == 0 && !fp8_has_nan(k, d, dt)) {
        const float unit = FP8_UNIT(dt);
        switch (g) {
        case 1: dots_fp8_const(q, k, d, 1, s, unit); return;
        case 2: dots_fp8_const(q, k, d, 2, s, unit); return;
        case 4: dots_fp8_const(q, k, d, 4, s, unit); return;
        case 8: dots_fp8_const(q, k, d, 8, s, unit); return;
        default:
            for (int64_t j = 0; j < g; j++)
                dots_fp8_const(q + j * d, k, d, 1, s + j * CHUNK, unit);
            return;
        }
    }
#endif
    switch (g) {
    case 1: s[0] = dot(q, k, d, dt); return;
    case 2: dots_const(q, k, d, 2, s, dt); return;
    case 4: dots_const(q, k, d, 4, s, dt); return;
    case 8: dots_const(q, k, d, 8, s, dt); return;
    default:
        for (int64_t j = 0; j < g; j++)
            s[j * CHUNK] = dot(q + j * d, k, d, dt);
    }
}

/* o[0 .. d) += p * v[0 .. d) */
INLINE void axpy(float *restrict o, float p, const void *restrict v, int64_t d, int dt) {
#pragma GCC ivdep
    for (int64_t i = 0; i < d; i++)
        o[i] += p * load(v, i, dt);
}

/* o[0 .. d) += p[0] w0 + p[1] w1 + p[2] w2 + p[3] w3 (float32 values of four tokens): one load and
 * one store of o per four tokens. */
INLINE void axpy4(float *restrict o, const float *restrict p, const float *restrict w0, const float *restrict w1,
                  const float *restrict w2, const float *restrict w3, int64_t d) {
    const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
#pragma GCC ivdep
    for (int64_t i = 0; i < d; i++)
        o[i] += p0 * w0[i] + p1 * w1[i] + p2 * w2[i] + p3 * w3[i];
}

/* w[0 .. d) = x[0 .. d) as float32. */
INLINE void widen(float *restrict w, const void *restrict x, int64_t d, int dt) {
#pragma GCC ivdep
    for (int64_t i = 0; i < d; i++)
        w[i] = load(x, i, dt);
}

/* The address of element i of an array of dtype dt. */
INLINE const void *at(const void *base, int64_t i, int dt) {
    return (const char *)base + i * (dt == DT_F32 ? 4 : (dt == DT_E4M3 || dt == DT_E4M3FNUZ) ? 1 : 2);
}


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define WIDE 1
/* The 512-bit path (AVX-512 F, BW and VBMI: Intel since Ice Lake, AMD since Zen 4), for head
 * sizes 64, 128 and 256 (the instances with a constant head size) and 1-8 query rows per KV head
 * (bf16: 3-8, see BF16_WIDE_ROWS). 64 elements of K or
 * V are widened to four float32 vectors in registers, in an order of the dtype's own (widen64):
 * the query rows are put in that order once per row (wide_order) and out is summed in it and put
 * back at the end, so no element is ever moved to match. fp8 is widened exactly by two 128-entry
 * byte tables (VPERMI2B: the high and low byte of each code's bfloat16 value, NaN codes' included,
 * so there is no NaN check), the sign OR'ed in, then bfloat16 to float32 by interleaving zero
 * bytes; bf16 by interleaving zero words; f16 by VCVTPH2PS; f32 as is. */
typedef struct {
    __m512i hi0, hi1, lo0, lo1; /* e4m3 code & 0x7f -> bf16 value's high / low byte, codes 0-63, 64-127 */
} fp8_tables_t;

INLINE void fp8_tables(fp8_tables_t *t, int dt) {
    uint8_t hi[128], lo[128];
    for (int c = 0; c < 128; c++) {
        const float f = load_fp8(c, dt == DT_E4M3FNUZ);
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        hi[c] = (uint8_t)(u >> 24);
        lo[c] = (uint8_t)(u >> 16);
    }
    t->hi0 = _mm512_loadu_si512(hi);
    t->hi1 = _mm512_loadu_si512(hi + 64);
    t->lo0 = _mm512_loadu_si512(lo);
    t->lo1 = _mm512_loadu_si512(lo + 64);
}

/* Element of a 64-element block that position p (0-63) of widen64's four vectors holds. */
INLINE int64_t wide_src(int64_t p, int dt) {
    const int64_t v = p >> 4, j = (p >> 2) & 3, i = p & 3; /* vector, 128-bit lane, element in lane */
    if (IS_FP8(dt))
        return 16 * j + 4 * v + i;
    if (dt == DT_BF16)
        return 32 * (v >> 1) + 8 * j + 4 * (v & 1) + i;
    return p;
}

/* 64 bfloat16 values (a: the first 32, b: the last 32) as float32 in w: zero words interleaved. */
INLINE void bf16x64(__m512i a, __m512i b, __m512 w[4]) {
    const __m512i z = _mm512_setzero_si512();
    w[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, a));
    w[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, a));
    w[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, b));
    w[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, b));
}

/* x[0 .. 64) as float32, in widen64's order */
INLINE void widen64(const void *x, __m512 w[4], int dt, const fp8_tables_t *t) {
    if (dt == DT_F32) {
        for (int v = 0; v < 4; v++)
            w[v] = _mm512_loadu_ps((const float *)x + 16 * v);
    } else if (dt == DT_F16) {
        for (int v = 0; v < 4; v++)
            w[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + 16 * v)));
    } else if (dt == DT_BF16) {
        bf16x64(_mm512_loadu_si512(x), _mm512_loadu_si512((const uint16_t *)x + 32), w);
    } else {
        const __m512i c = _mm512_loadu_si512(x);
        __m512i hi = _mm512_permutex2var_epi8(t->hi0, c, t->hi1); /* the code's low 7 bits index */
        __m512i lo = _mm512_permutex2var_epi8(t->lo0, c, t->lo1);
        hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0xf8); /* hi | (c & 0x80) */
        if (dt == DT_E4M3FNUZ) { /* 0x80 is NaN (the table gave -0) */
            const __mmask64 nan = _mm512_cmpeq_epi8_mask(c, _mm512_set1_epi8((char)0x80));
            hi = _mm512_mask_mov_epi8(hi, nan, _mm512_set1_epi8(0x7f));
            lo = _mm512_mask_mov_epi8(lo, nan, _mm512_set1_epi8((char)0xc0));
        }
        bf16x64(_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi), w); /* per 128 bits: 0-7, 8-15 */
    }
}

/* dst[0 .. d) = src[0 .. d) put in (to = 1) or taken out of (to = 0) widen64's order. */
INLINE void wide_order(float *restrict dst, const float *restrict src, int64_t d, int dt, int to) {
    for (int64_t b = 0; b < d; b += 64)
        for (int64_t p = 0; p < 64; p++) {
            const int64_t e = b + wide_src(p, dt);
            if (to)
                dst[b + p] = src[e];
            else
                dst[e] = src[b + p];
        }
}

/* The sums of four vectors' lanes: {sum a, sum b, sum c, sum d} (13 operations, not 4 x 8). */
INLINE __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* per 128 bits: a, b, a, b */
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xee)); /* a, b, c, d */
    const __m256 y = _mm256_add_ps(_mm512_castps512_ps256(x),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

/* The G dot products qp[r] . k (r < G; qp rows d apart, in widen64's order) as G vectors whose
 * lanes sum to them. */
INLINE void dots_wide(const float *qp, const void *k, int64_t G, int64_t d, __m512 *acc, int dt,
                      const fp8_tables_t *tb) {
    __m512 a[8][2];
    for (int64_t r = 0; r < G; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < d; b += 64) {
        __m512 w[4];
        widen64(at(k, b, dt), w, dt, tb);
        for (int64_t r = 0; r < G; r++) {
            const float *qr = qp + r * d + b;
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(qr), w[0], a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16), w[1], a[r][1]);
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 32), w[2], a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 48), w[3], a[r][1]);
        }
    }
    for (int64_t r = 0; r < G; r++)
        acc[r] = _mm512_add_ps(a[r][0], a[r][1]);
}

/* s[r * CHUNK + t] = qp[r] . k[t] for the chunk's n tokens and every query row r (G per KV head):
 * four rows' sums at a time (the rows of 4 / G heads for G = 1, 2; else a head's rows by fours,
 * its last 1-3 with zero vectors beside them). */
INLINE void scores_wide(const float *qp, const void *k, const int64_t *ko, int64_t n, int64_t hn, int64_t G,
                        int64_t d, int64_t ksh, float *s, int dt, const fp8_tables_t *tb) {
    const int64_t HG = G < 4 && 4 % G == 0 ? 4 / G : 1; /* heads per group of rows */
    const __m512 z = _mm512_setzero_ps();
    const int64_t grouped = hn - hn % HG;
    for (int64_t t = 0; t < n; t++) {
        for (int64_t h = 0; h < grouped; h += HG) {
            __m512 acc[8];
            for (int64_t j = 0; j < HG; j++)
                dots_wide(qp + (h + j) * G * d, at(k, ko[t] + (h + j) * ksh, dt), G, d, acc + j * G, dt, tb);
            for (int64_t r = 0; r < HG * G; r += 4) {
                const int64_t m = HG * G - r < 4 ? HG * G - r : 4; /* rows in this sum */
                float x[4];
                _mm_storeu_ps(x, sum4(acc[r], m > 1 ? acc[r + 1] : z, m > 2 ? acc[r + 2] : z, m > 3 ? acc[r + 3] : z));
                for (int64_t i = 0; i < m; i++)
                    s[(h * G + r + i) * CHUNK + t] = x[i];
            }
        }
        for (int64_t h = grouped; h < hn; h++) {
            __m512 acc[8];
            dots_wide(qp + h * G * d, at(k, ko[t] + h * ksh, dt), G, d, acc, dt, tb);
            for (int64_t r = 0; r < G; r++)
                s[(h * G + r) * CHUNK + t] = _mm512_reduce_add_ps(acc[r]);
        }
    }
}

/* out[r] += sum over tokens [t0, t1) of s[r * CHUNK + t] * v[t] for rows r0 .. r0 + R of KV head h,
 * elements b .. b + 64 (out in widen64's order; R <= 4): the sums stay in registers over the tokens. */
INLINE void values_wide_rows(float *out, const float *s, const void *v, const int64_t *vo, int64_t t0, int64_t t1,
                             int64_t h, int64_t b, int64_t r0, int64_t R, int64_t G, int64_t d, int64_t vsh, int dt,
                             const fp8_tables_t *tb) {
    __m512 acc[4][4];
    for (int64_t r = 0; r < R; r++)
        for (int v4 = 0; v4 < 4; v4++)
            acc[r][v4] = _mm512_setzero_ps();
    for (int64_t t = t0; t < t1; t++) {
        __m512 w[4];
        widen64(at(v, vo[t] + h * vsh + b, dt), w, dt, tb);
        for (int64_t r = 0; r < R; r++) {
            const __m512 p = _mm512_set1_ps(s[(h * G + r0 + r) * CHUNK + t]);
            for (int v4 = 0; v4 < 4; v4++)
                acc[r][v4] = _mm512_fmadd_ps(p, w[v4], acc[r][v4]);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *o = out + (h * G + r0 + r) * d + b;
        for (int v4 = 0; v4 < 4; v4++)
            _mm512_storeu_ps(o + 16 * v4, _mm512_add_ps(_mm512_loadu_ps(o + 16 * v4), acc[r][v4]));
    }
}

/* bf16 with fewer rows per KV head keeps the other paths: the 512-bit one was 5-13% slower there */
#define BF16_WIDE_ROWS 3

#define WIDE_TOKENS 16 /* tokens per update of out in values_wide (at 4 rows, 8: fp8 1.10x the time, 64: bf16 1.09x) */

/* out[r] += sum over the chunk's tokens t of s[r * CHUNK + t] * v[t] (out in widen64's order), for
 * 3-8 rows per KV head: for each block of WIDE_TOKENS tokens, KV head and 64 elements, up to 4
 * rows' sums stay in registers (one load and store of out per block, not per token). */
INLINE void values_wide(float *out, const float *s, const void *v, const int64_t *vo, int64_t n, int64_t hn,
                        int64_t G, int64_t d, int64_t vsh, int dt, const fp8_tables_t *tb) {
    for (int64_t t0 = 0; t0 < n; t0 += WIDE_TOKENS) {
        const int64_t t1 = t0 + WIDE_TOKENS < n ? t0 + WIDE_TOKENS : n;
        for (int64_t h = 0; h < hn; h++)
            for (int64_t b = 0; b < d; b += 64) {
                values_wide_rows(out, s, v, vo, t0, t1, h, b, 0, G < 4 ? G : 4, G, d, vsh, dt, tb);
                if (G > 4)
                    values_wide_rows(out, s, v, vo, t0, t1, h, b, 4, G - 4, G, d, vsh, dt, tb);
            }
    }
}

/* values_wide for 1 or 2 rows per KV head: token by token, out loaded and stored per token, so V
 * is read in memory order (in blocks of tokens: 1.1-1.5x the time at 1-2 rows, each head's slice of
 * a block then a stream of its own; 2 or 4 tokens per update of out: 1.1-1.5x too). */
INLINE void values_wide_seq(float *out, const float *s, const void *v, const int64_t *vo, int64_t n, int64_t hn,
                            int64_t G, int64_t d, int64_t vsh, int dt, const fp8_tables_t *tb) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < hn; h++)
            for (int64_t b = 0; b < d; b += 64) {
                __m512 w[4];
                widen64(at(v, vo[t] + h * vsh + b, dt), w, dt, tb);
                for (int64_t r = 0; r < G; r++) {
                    const __m512 p = _mm512_set1_ps(s[(h * G + r) * CHUNK + t]);
                    float *o = out + (h * G + r) * d + b;
                    for (int v4 = 0; v4 < 4; v4++)
                        _mm512_storeu_ps(o + 16 * v4, _mm512_fmadd_ps(p, w[v4], _mm512_loadu_ps(o + 16 * v4)));
                }
            }
}
#else
#define WIDE 0
#endif

/* Whether decode calls take the 512-bit path where it applies (1, the default; the tests turn it
 * off to check the other paths on the same machine). Defined in the entry points' part. */
extern HIDDEN int wide_on;


/* Below this, exp is taken at EXP_LO: exp(-87.3) ~ 1.2e-38 instead of a smaller number or 0. Every
 * sum such a term joins holds a term 1 (the max's), so float32 cannot tell the difference; and the
 * one exp of -inf (the first chunk's rescale) multiplies sums that are still 0. */
#define EXP_LO -87.3f

/* x clamped to [EXP_LO, ...): NaN gives EXP_LO (the caller counts NaN apart). */
INLINE float exp_arg(float x) { return x >= EXP_LO ? x : EXP_LO; }

/* exp(x) for EXP_LO <= x <= 0, float32, relative error ~2e-7: x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by a degree-7 polynomial (Cephes' expf coefficients), 2^n built in the exponent bits.
 * No branch and no select, so the loops that call it vectorise: the clamp is a loop of its own,
 * because in one loop with it the compiler splits the body on the clamp's condition and then
 * cannot vectorise it. */
INLINE float exp_clamped(float x) {
    const int32_t n = (int32_t)(x * 1.44269504088896341f - 0.5f); /* round(x / ln 2); x <= 0 */
    const float fn = (float)n;
    const float r = x - fn * 0.693359375f + fn * 2.12194440e-4f; /* x - n ln2, in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* max(start, x[0 .. n)), NaN ignored: per-lane maxima (a select per lane vectorises; a running
 * max does not without finite-math), then the lanes. */
#define MAX_LANES 16
INLINE float max_of(const float *restrict x, int64_t n, float start) {
    float lane[MAX_LANES];
    for (int64_t l = 0; l < MAX_LANES; l++)
        lane[l] = start;
    int64_t t = 0;
    for (; t + MAX_LANES <= n; t += MAX_LANES)
        for (int64_t l = 0; l < MAX_LANES; l++)
            lane[l] = x[t + l] > lane[l] ? x[t + l] : lane[l];
    float m = start;
    for (; t < n; t++)
        m = x[t] > m ? x[t] : m;
    for (int64_t l = 0; l < MAX_LANES; l++)
        m = lane[l] > m ? lane[l] : m;
    return m;
}

/* Where a row's tokens are, in elements from the K (or V) base pointer: contiguous (pages NULL:
 * token t at base + t * sn) or paged (token t at pages[t / bs] * sb + (t % bs) * sn; pages is the
 * row of the block table, every entry the row reads checked by the caller to lie in the pool). */
typedef struct {
    const int64_t *pages;
    int64_t bs, base, sb, sn;
} tokens_t;

INLINE int64_t token_at(const tokens_t *tk, int64_t t) {
    return tk->pages ? tk->pages[t / tk->bs] * tk->sb + (t % tk->bs) * tk->sn : tk->base + t * tk->sn;
}

/* One row, all heads (hn KV heads of g query rows each), keys [first, first + len) of the row:
 * q, out [hn * g, d] contiguous, lse [hn * g]; kt, vt: where the row's tokens are; head stride
 * ksh / vsh, element stride 1 (in elements). s: [hn * g, CHUNK] scratch; m, l: [hn * g]; ko, vo:
 * [CHUNK] scratch (the chunk's token offsets); vw: [4, d] scratch (four tokens' V head, widened).
 * Query row r of a KV head is query token r / (g / sq), head r % (g / sq). Under causal, token i
 * sees the row's keys [0, row_len - sq + 1 + i): a suffix of each chunk is hidden from it, so its
 * softmax runs over the chunk's first visible keys only and the hidden ones get p = 0. */
INLINE void decode_row(const float *q, const void *k, const tokens_t *kt, const void *v, const tokens_t *vt,
                       int64_t first, int64_t len, int64_t row_len, int64_t sq, int64_t causal, int64_t hn,
                       int64_t g, int64_t d, int64_t ksh, int64_t vsh, float *out, float *lse, float *s, float *m,
                       float *l, int64_t *ko, int64_t *vo, float *vw, float *qp, const void *tables, int dt,
                       int wide_d) {
    const int64_t heads_per_token = g / sq;
    const int64_t hq = hn * g;
    for (int64_t r = 0; r < hq; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)(hq * d));
#if WIDE
    const int wide = wide_on && wide_d && g <= 8 && (dt != DT_BF16 || g >= BF16_WIDE_ROWS);
    const fp8_tables_t *tb = tables;
    if (wide)
        for (int64_t r = 0; r < hq; r++)
            wide_order(qp + r * d, q + r * d, d, dt, 1);
#else
    (void)qp;
    (void)tables;
    (void)wide_d;
#endif
    if (len == 0) {
        for (int64_t r = 0; r < hq; r++)
            lse[r] = -INFINITY;
        return;
    }
    for (int64_t c = 0; c < len; c += CHUNK) {
        const int64_t n = len - c < CHUNK ? len - c : CHUNK;
        for (int64_t t = 0; t < n; t++) {
            ko[t] = token_at(kt, first + c + t);
            vo[t] = token_at(vt, first + c + t);
        }
#if WIDE
        if (wide)
            switch (g) { /* G a constant in each */
            case 1: scores_wide(qp, k, ko, n, hn, 1, d, ksh, s, dt, tb); break;
            case 2: scores_wide(qp, k, ko, n, hn, 2, d, ksh, s, dt, tb); break;
            case 3: scores_wide(qp, k, ko, n, hn, 3, d, ksh, s, dt, tb); break;
            case 4: scores_wide(qp, k, ko, n, hn, 4, d, ksh, s, dt, tb); break;
            case 5: scores_wide(qp, k, ko, n, hn, 5, d, ksh, s, dt, tb); break;
            case 6: scores_wide(qp, k, ko, n, hn, 6, d, ksh, s, dt, tb); break;
            case 7: scores_wide(qp, k, ko, n, hn, 7, d, ksh, s, dt, tb); break;
            default: scores_wide(qp, k, ko, n, hn, 8, d, ksh, s, dt, tb); break;
            }
        else
#endif
        for (int64_t t = 0; t < n; t++) {
            for (int64_t h = 0; h < hn; h++) {
                dots(q + h * g * d, at(k, ko[t] + h * ksh, dt), d, g, s + h * g * CHUNK + t, dt);
            }
        }
        for (int64_t r = 0; r < hq; r++) {
            float *sr = s + r * CHUNK;
            const int64_t token = (r % g) / heads_per_token;
            const int64_t limit = causal ? row_len - sq + 1 + token : row_len; /* keys [0, limit) */
            const int64_t seen = limit - (first + c);
            const int64_t nv = seen < 0 ? 0 : (seen < n ? seen : n); /* visible keys of the chunk */
            for (int64_t t = nv; t < n; t++)
                sr[t] = 0.0f; /* hidden: p = 0 in the p @ V pass */
            if (nv == 0)
                continue;
            float mc = max_of(sr, nv, m[r]);
            int32_t nans = 0; /* a NaN score (NaN in q or k), or an inf one (inf - inf) */
            for (int64_t t = 0; t < nv; t++) {
                const float x = sr[t] - mc;
                nans += x != x;
                sr[t] = exp_arg(x);
            }
            float sum = 0.0f;
            for (int64_t t = 0; t < nv; t++) {
                const float p = exp_clamped(sr[t]);
                sr[t] = p;
                sum += p;
            }
            if (nans)
                sum = NAN; /* then l, out and lse of this head are NaN */
            if (mc != m[r]) { /* the max grew: rescale what was summed so far (0 on the first chunk) */
                const float a = exp_clamped(exp_arg(m[r] - mc));
                float *o = out + r * d;
                for (int64_t i = 0; i < d; i++)
                    o[i] *= a;
                l[r] *= a;
            }
            l[r] += sum;
            m[r] = mc;
        }
#if WIDE
        if (wide) {
            switch (g) {
            case 1: values_wide_seq(out, s, v, vo, n, hn, 1, d, vsh, dt, tb); break;
            case 2: values_wide_seq(out, s, v, vo, n, hn, 2, d, vsh, dt, tb); break;
            case 3: values_wide(out, s, v, vo, n, hn, 3, d, vsh, dt, tb); break;
            case 4: values_wide(out, s, v, vo, n, hn, 4, d, vsh, dt, tb); break;
            case 5: values_wide(out, s, v, vo, n, hn, 5, d, vsh, dt, tb); break;
            case 6: values_wide(out, s, v, vo, n, hn, 6, d, vsh, dt, tb); break;
            case 7: values_wide(out, s, v, vo, n, hn, 7, d, vsh, dt, tb); break;
            default: values_wide(out, s, v, vo, n, hn, 8, d, vsh, dt, tb); break;
            }
            continue;
        }
#endif
        /* Four tokens per update of out: float32 caches, and half-float ones with at least 8 query
         * rows per KV head (compute-bound: one widening serves them all; 9-13% faster at 8 rows).
         * With fewer rows, half-float caches stay token by token: four tokens at a time, with the
         * widened copy as extra traffic, was 3-35% slower at 1-4 rows (8 x 128, 65,536 tokens). */
        int64_t t = 0;
        for (; t + 4 <= n && (dt == DT_F32 || g >= 8); t += 4) {
            for (int64_t h = 0; h < hn; h++) {
                const float *w[4];
                for (int64_t u = 0; u < 4; u++) {
                    const void *vp = at(v, vo[t + u] + h * vsh, dt);
                    if (dt == DT_F32) {
                        w[u] = (const float *)vp;
                    } else { /* widened once here, not once per query row */
#if FP8_SIMD
                        if (IS_FP8(dt) && d % 16 == 0 && !fp8_has_nan(vp, d, dt))
                            widen_fp8(vw + u * d, vp, d, FP8_UNIT(dt));
                        else
#endif
                            widen(vw + u * d, vp, d, dt);
                        w[u] = vw + u * d;
                    }
                }
                for (int64_t j = 0; j < g; j++) {
                    const int64_t r = h * g + j;
                    axpy4(out + r * d, s + r * CHUNK + t, w[0], w[1], w[2], w[3], d);
                }
            }
        }
        for (; t < n; t++) {
            for (int64_t h = 0; h < hn; h++) {
                const void *vp = at(v, vo[t] + h * vsh, dt);
#if FP8_SIMD
                if (IS_FP8(dt) && d % 16 == 0 && !fp8_has_nan(vp, d, dt)) {
                    const float unit = FP8_UNIT(dt);
                    for (int64_t j = 0; j < g; j++) {
                        const int64_t r = h * g + j;
                        axpy_fp8(out + r * d, s[r * CHUNK + t] * unit, vp, d);
                    }
                    continue;
                }
#endif
                for (int64_t j = 0; j < g; j++) {
                    const int64_t r = h * g + j;
                    axpy(out + r * d, s[r * CHUNK + t], vp, d, dt);
                }
            }
        }
    }
    for (int64_t r = 0; r < hq; r++) {
        if (l[r] == 0.0f) { /* saw no key (causal, a row shorter than sq): out 0 (already), lse -inf */
            lse[r] = -INFINITY;
            continue;
        }
        const float inv = 1.0f / l[r];
        float *o = out + r * d;
        for (int64_t i = 0; i < d; i++)
            o[i] *= inv;
        lse[r] = m[r] + logf(l[r]);
    }
#if WIDE
    if (wide)
        for (int64_t r = 0; r < hq; r++) {
            memcpy(vw, out + r * d, sizeof(float) * (size_t)d);
            wide_order(out + r * d, vw, d, dt, 0);
        }
#endif
}

/* All rows, all heads, keys [t0, t1) of each row (clipped to the row's length): the softmax state
 * of that token range, as out (normalised) and lse. table: NULL (k, v [b, n, hkv, d], row stride
 * ksb / vsb) or the block table [b, table_stride] int64 with pools [blocks, bs, hkv, d] (page
 * stride ksb / vsb). d and dt are constants in each instance below (unrolled, vectorised loops). */
INLINE int decode_rows(const float *q, const void *k, const void *v, const int64_t *lens, const int64_t *table,
                       int64_t table_stride, int64_t bs, int64_t sq, int64_t causal, int64_t b, int64_t hkv, int64_t g, int64_t d, int64_t ksb,
                       int64_t ksn, int64_t ksh, int64_t vsb, int64_t vsn, int64_t vsh, int64_t t0, int64_t t1,
                       float *out, float *lse, int dt, int wide_d) {
    const int64_t hq = hkv * g;
    float *scratch = malloc(sizeof(float) * (size_t)(hq * (CHUNK + 2 + d) + 4 * d) + sizeof(int64_t) * 2 * CHUNK);
    if (!scratch)
        return -1;
    int64_t *ko = (int64_t *)scratch, *vo = ko + CHUNK; /* first: int64 alignment */
    float *s = (float *)(vo + CHUNK), *m = s + hq * CHUNK, *l = m + hq, *vw = l + hq, *qp = vw + 4 * d;
#if WIDE
    fp8_tables_t tables;
    if (IS_FP8(dt))
        fp8_tables(&tables, dt);
    const void *tb = &tables;
#else
    const void *tb = NULL;
#endif
    for (int64_t row = 0; row < b; row++) {
        const int64_t first = t0 < lens[row] ? t0 : lens[row];
        const int64_t end = t1 < lens[row] ? t1 : lens[row];
        const int64_t *pages = table ? table + row * table_stride : NULL;
        const tokens_t kt = {pages, bs, row * ksb, ksb, ksn}, vt = {pages, bs, row * vsb, vsb, vsn};
        decode_row(q + row * hq * d, k, &kt, v, &vt, first, end - first, lens[row], sq, causal, hkv, g, d, ksh, vsh,
                   out + row * hq * d, lse + row * hq, s, m, l, ko, vo, vw, qp, tb, dt, wide_d);
    }
    free(scratch);
    return 0;
}

#define DECODE_ARGS                                                                                             \
    const float *q, const void *k, const void *v, const int64_t *lens, const int64_t *table, int64_t table_stride,    \
        int64_t bs, int64_t sq, int64_t causal, int64_t b, int64_t hkv, int64_t g, int64_t d,                      \
        int64_t ksb, int64_t ksn, int64_t ksh, int64_t vsb, int64_t vsn, int64_t vsh, int64_t t0, int64_t t1,    \
        float *out, float *lse
#define PASS(D, DT, W) decode_rows(q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, D, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1, out, lse, DT, W)

/* One instance per dtype, with the usual head sizes as constants (a constant d lets the compiler
 * unroll and vectorise the dot products fully: 96% of the read bandwidth against 65-76% with a
 * runtime d, measured at 8 x 128 fp32). W: whether the instance has the 512-bit path (those with
 * a constant head size: in the runtime one too it would add a third to the build's ~30 s of compiler time). */
#define DEFINE_DECODE(NAME, DT)                                                                               \
    HIDDEN int NAME(DECODE_ARGS) {                                                                            \
        switch (d) {                                                                                          \
        case 64: return PASS(64, DT, 1);                                                                      \
        case 128: return PASS(128, DT, 1);                                                                    \
        case 256: return PASS(256, DT, 1);                                                                    \
        default: return PASS(d, DT, 0);                                                                       \
        }                                                                                                     \
    }
HIDDEN int decode_f32(DECODE_ARGS);
HIDDEN int decode_bf16(DECODE_ARGS);
HIDDEN int decode_f16(DECODE_ARGS);
HIDDEN int decode_e4m3(DECODE_ARGS);
HIDDEN int decode_e4m3fnuz(DECODE_ARGS);
#if PART(0) /* the parts' numbers are the dtype codes */
DEFINE_DECODE(decode_f32, DT_F32)
#endif
#if PART(1)
DEFINE_DECODE(decode_bf16, DT_BF16)
#endif
#if PART(2)
DEFINE_DECODE(decode_f16, DT_F16)
#endif
#if PART(3)
DEFINE_DECODE(decode_e4m3, DT_E4M3)
#endif
#if PART(4)
DEFINE_DECODE(decode_e4m3fnuz, DT_E4M3FNUZ)
#endif

#if PART(-1) /* the entry points */
HIDDEN int wide_on = WIDE;


/* Which dtypes this build supports: bit DT set for each. */
int tree_attn_cpu_dtypes(void) {
    return (1 << DT_F32) | (1 << DT_BF16) | (1 << DT_F16) | (1 << DT_E4M3) | (1 << DT_E4M3FNUZ);
}

/* out[0 .. n) = x[0 .. n) of dtype dt as float32, with the kernel's own widening (the tests check
 * every 16-bit and fp8 code against torch's conversion). Returns 0, -2 for an unknown dtype. */
int tree_attn_cpu_widen(int dt, const void *restrict x, int64_t n, float *restrict out) {
    switch (dt) {
    case DT_F32: widen(out, x, n, DT_F32); return 0;
    case DT_BF16: widen(out, x, n, DT_BF16); return 0;
    case DT_F16: widen(out, x, n, DT_F16); return 0;
    case DT_E4M3: widen(out, x, n, DT_E4M3); return 0;
    case DT_E4M3FNUZ: widen(out, x, n, DT_E4M3FNUZ); return 0;
    default: return -2;
    }
}

/* out[0 .. n) = fp8 x[0 .. n) as float32 through the fast path of the decode loops (fp8x16 and the
 * unit: AVX2 + F16C builds), NaN codes included as that path sees them (the decode loops send those
 * vectors to the exact path instead). Returns 0; -2 for a dtype that is not fp8; -3 when this
 * build has no fast path or n is not a multiple of 16. For the tests. */
int tree_attn_cpu_widen_fp8_fast(int dt, const void *restrict x, int64_t n, float *restrict out) {
    if (!IS_FP8(dt))
        return -2;
#if FP8_SIMD
    if (n % 16)
        return -3;
    widen_fp8(out, x, n, FP8_UNIT(dt));
    return 0;
#else
    (void)x;
    (void)n;
    (void)out;
    return -3;
#endif
}

/* Turns the 512-bit path on (1) or off (0) for the calls that follow; returns whether this build
 * has it (1) or not (0). For the tests, which run the other paths on the same machine too. */
int tree_attn_cpu_wide(int on) {
    wide_on = WIDE && on;
    return WIDE;
}

/* out[0 .. n) = x[0 .. n) of dtype dt as float32 through the 512-bit path's widening (widen64, then
 * back to element order). Returns 0; -2 for an unknown dtype; -3 when this build has no such path
 * or n is not a multiple of 64. For the tests. */
int tree_attn_cpu_widen_wide(int dt, const void *restrict x, int64_t n, float *restrict out) {
    if (dt < DT_F32 || dt > DT_E4M3FNUZ)
        return -2;
    if (!WIDE || n % 64)
        return -3;
#if WIDE
    fp8_tables_t tb;
    if (IS_FP8(dt))
        fp8_tables(&tb, dt);
    for (int64_t b = 0; b < n; b += 64) {
        __m512 w[4];
        float tmp[64];
        widen64(at(x, b, dt), w, dt, &tb);
        for (int v = 0; v < 4; v++)
            _mm512_storeu_ps(tmp + 16 * v, w[v]);
        wide_order(out + b, tmp, 64, dt, 0);
    }
#else
    (void)x;
    (void)out;
#endif
    return 0;
}

/* The entry point: decode attention of sq query tokens per row over keys [t0, t1) of every row.
 *   q    [b, hkv * g, d] float32 contiguous, already multiplied by the softmax scale; the g rows
 *        of a KV head are its sq tokens' g / sq query heads, token-major;
 *   causal: 0, or 1 (token i of a row sees its keys [0, lens[row] - sq + 1 + i));
 *   k, v [b, n, hkv, d] of dtype dt, strides (ksb, ksn, ksh, 1) and (vsb, vsn, vsh, 1) in elements;
 *   lens [b] valid keys per row (0..n);
 *   table NULL, or a block table [b, table_stride] int64 with k, v pools [blocks, bs, hkv, d]
 *        (strides (ksb, ksn, ksh, 1): ksb is then the page stride);
 *   out  [b, hkv * g, d] float32, lse [b, hkv * g] float32: the softmax state of those keys (a
 *        row with none of them: out 0, lse -inf); states of disjoint ranges merge exactly.
 * Returns 0, -1 when scratch memory could not be allocated, -2 for an unsupported dtype. */
int tree_attn_cpu_decode(int dt, DECODE_ARGS) {
    switch (dt) {
    case DT_F32: return decode_f32(q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, d, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1, out, lse);
    case DT_BF16: return decode_bf16(q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, d, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1, out, lse);
    case DT_F16: return decode_f16(q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, d, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1, out, lse);
    case DT_E4M3: return decode_e4m3(q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, d, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1, out, lse);
    case DT_E4M3FNUZ: return decode_e4m3fnuz(q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, d, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1, out, lse);
    default: return -2;
    }
}

/* The exact merge of two softmax states of disjoint key ranges, in place into (o0, l0):
 * rows x d outputs and rows lses, float32. What reduce/state.py's merge gives for two: an empty
 * state (lse -inf, out 0) is the identity, two empty ones give out 0 and lse -inf, and a NaN (or
 * +inf, from infinite data) lse makes the row NaN. */
static void merge_into(float *restrict o0, float *restrict l0, const float *restrict o1, const float *restrict l1,
                       int64_t rows, int64_t d) {
    for (int64_t r = 0; r < rows; r++) {
        const float a = l0[r], b = l1[r];
        float m = a > b ? a : b; /* a NaN lse reaches the row through its weight, exp(NaN) */
        if (m == -INFINITY) /* both empty: shift by 0, so the weights are 0, not NaN */
            m = 0.0f;
        const float w0 = expf(a - m), w1 = expf(b - m), den = w0 + w1;
        const float inv = 1.0f / (den > 0.0f ? den : 1.0f); /* both empty: out stays 0; NaN stays NaN */
        float *restrict o = o0 + r * d;
        const float *restrict p = o1 + r * d;
        for (int64_t i = 0; i < d; i++)
            o[i] = (o[i] * w0 + p[i] * w1) * inv;
        l0[r] = m + logf(den); /* log(0) = -inf for two empty states */
    }
}

/* One contiguous range of keys, for one thread of tree_attn_cpu_decode_parts. */
typedef struct {
    int dt;
    const float *q;
    const void *k, *v;
    const int64_t *lens, *table;
    int64_t table_stride, bs, sq, causal, b, hkv, g, d, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1;
    float *out, *lse;
    int rc;
} part_t;

static void *run_part(void *arg) {
    part_t *p = arg;
    p->rc = tree_attn_cpu_decode(p->dt, p->q, p->k, p->v, p->lens, p->table, p->table_stride, p->bs, p->sq,
                                 p->causal, p->b, p->hkv, p->g, p->d, p->ksb, p->ksn, p->ksh, p->vsb, p->vsn, p->vsh,
                                 p->t0, p->t1, p->out, p->lse);
    return NULL;
}

#define MAX_PARTS 64

/* tree_attn_cpu_decode over keys [0, longest) split into `parts` contiguous ranges, one per
 * thread (the calling thread runs the first; a thread that cannot be started runs its range in
 * the caller instead), their states merged exactly into the first: outs [parts, b, hkv * g, d]
 * and lses [parts, b, hkv * g] float32 are scratch, and on return outs[0], lses[0] hold the
 * result. Threads are started per call: about 55 us each on the 2-core development VM, less than
 * the Python pool's hand-off and torch-op merge this replaced (see cpu_native.py). Returns 0, -1 (scratch memory), -2 (dtype), -4 (parts
 * outside 1..64). */
int tree_attn_cpu_decode_parts(int dt, const float *q, const void *k, const void *v, const int64_t *lens,
                               const int64_t *table, int64_t table_stride, int64_t bs, int64_t sq, int64_t causal,
                               int64_t b, int64_t hkv, int64_t g, int64_t d, int64_t ksb, int64_t ksn, int64_t ksh,
                               int64_t vsb, int64_t vsn, int64_t vsh, int64_t longest, int64_t parts, float *outs,
                               float *lses) {
    if (parts < 1 || parts > MAX_PARTS)
        return -4;
    const int64_t rows = b * hkv * g;
    part_t job[MAX_PARTS];
    pthread_t tid[MAX_PARTS];
    int started[MAX_PARTS] = {0};
    for (int64_t i = 0; i < parts; i++) {
        job[i] = (part_t){dt, q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, d, ksb, ksn, ksh, vsb,
                          vsn, vsh, i * longest / parts, (i + 1) * longest / parts, outs + i * rows * d,
                          lses + i * rows, 0};
    }
    for (int64_t i = 1; i < parts; i++)
        started[i] = pthread_create(&tid[i], NULL, run_part, &job[i]) == 0;
    run_part(&job[0]);
    int rc = job[0].rc;
    for (int64_t i = 1; i < parts; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            run_part(&job[i]);
        rc = rc ? rc : job[i].rc;
    }
    if (rc)
        return rc;
    for (int64_t i = 1; i < parts; i++)
        merge_into(outs, lses, outs + i * rows * d, lses + i * rows, rows, d);
    return 0;
}
#endif /* PART(-1) */
