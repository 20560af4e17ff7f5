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
                       float *l, int64_t *ko, int64_t *vo, float *vw, int dt) {
    const int64_t heads_per_token = g / sq;
    const int64_t hq = hn * g;
    for (int64_t r = 0; r < hq; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(out, 0, sizeof(float) * (size_t)(hq * d));
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
}

/* All rows, all heads, keys [t0, t1) of each row (clipped to the row's length): the softmax state
 * of that token range, as out (normalised) and lse. table: NULL (k, v [b, n, hkv, d], row stride
 * ksb / vsb) or the block table [b, table_stride] int64 with pools [blocks, bs, hkv, d] (page
 * stride ksb / vsb). d and dt are constants in each instance below (unrolled, vectorised loops). */
INLINE int decode_rows(const float *q, const void *k, const void *v, const int64_t *lens, const int64_t *table,
                       int64_t table_stride, int64_t bs, int64_t sq, int64_t causal, int64_t b, int64_t hkv, int64_t g, int64_t d, int64_t ksb,
                       int64_t ksn, int64_t ksh, int64_t vsb, int64_t vsn, int64_t vsh, int64_t t0, int64_t t1,
                       float *out, float *lse, int dt) {
    const int64_t hq = hkv * g;
    float *scratch = malloc(sizeof(float) * (size_t)(hq * (CHUNK + 2) + 4 * d) + sizeof(int64_t) * 2 * CHUNK);
    if (!scratch)
        return -1;
    int64_t *ko = (int64_t *)scratch, *vo = ko + CHUNK; /* first: int64 alignment */
    float *s = (float *)(vo + CHUNK), *m = s + hq * CHUNK, *l = m + hq, *vw = l + hq;
    for (int64_t row = 0; row < b; row++) {
        const int64_t first = t0 < lens[row] ? t0 : lens[row];
        const int64_t end = t1 < lens[row] ? t1 : lens[row];
        const int64_t *pages = table ? table + row * table_stride : NULL;
        const tokens_t kt = {pages, bs, row * ksb, ksb, ksn}, vt = {pages, bs, row * vsb, vsb, vsn};
        decode_row(q + row * hq * d, k, &kt, v, &vt, first, end - first, lens[row], sq, causal, hkv, g, d, ksh, vsh,
                   out + row * hq * d, lse + row * hq, s, m, l, ko, vo, vw, dt);
    }
    free(scratch);
    return 0;
}

#define DECODE_ARGS                                                                                             \
    const float *q, const void *k, const void *v, const int64_t *lens, const int64_t *table, int64_t table_stride,    \
        int64_t bs, int64_t sq, int64_t causal, int64_t b, int64_t hkv, int64_t g, int64_t d,                      \
        int64_t ksb, int64_t ksn, int64_t ksh, int64_t vsb, int64_t vsn, int64_t vsh, int64_t t0, int64_t t1,    \
        float *out, float *lse
#define PASS(D, DT) decode_rows(q, k, v, lens, table, table_stride, bs, sq, causal, b, hkv, g, D, ksb, ksn, ksh, vsb, vsn, vsh, t0, t1, out, lse, DT)

/* One instance per dtype, with the usual head sizes as constants (a constant d lets the compiler
 * unroll and vectorise the dot products fully: 96% of the read bandwidth against 65-76% with a
 * runtime d, measured at 8 x 128 fp32). */
#define DEFINE_DECODE(NAME, DT)                                                                               \
    static int NAME(DECODE_ARGS) {                                                                            \
        switch (d) {                                                                                          \
        case 64: return PASS(64, DT);                                                                         \
        case 128: return PASS(128, DT);                                                                       \
        case 256: return PASS(256, DT);                                                                       \
        default: return PASS(d, DT);                                                                          \
        }                                                                                                     \
    }
DEFINE_DECODE(decode_f32, DT_F32)
DEFINE_DECODE(decode_bf16, DT_BF16)
DEFINE_DECODE(decode_f16, DT_F16)
DEFINE_DECODE(decode_e4m3, DT_E4M3)
DEFINE_DECODE(decode_e4m3fnuz, DT_E4M3FNUZ)

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
