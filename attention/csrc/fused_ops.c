/* The small elementwise ops of a decoder layer, fused: RMSNorm (alone or after the residual add),
 * q/k per-head RMSNorm + RoPE in place on the fused qkv rows, and silu(gate) * up.
 *
 * Why: in a CPU decode step these are a dozen torch ops per layer (x.float(), pow, mean, rsqrt,
 * mul, to, mul, add, chunk, mul, sub, cat, silu, mul), each a dispatch plus a pass over memory;
 * at batch 64 of a 0.6B model they were ~15% of the step, at batch 1 ~20% (dispatch alone).
 * Here each is one call and one pass over the rows.
 *
 * Exactness: every kernel reproduces torch's CPU results bit for bit, in fp32 and bf16, on torch
 * builds that run their AVX512 or AVX2 kernels, so the engine's numbers do not move:
 *   - rounding points: every op torch performs in the activation dtype is rounded to it here at
 *     the same place (bf16: round to nearest even after each mul/add/sub, as torch's bf16 ops do,
 *     whose fp32 products of two bf16 values are exact), fp32 ops are never fused into FMAs;
 *   - the sum of squares in RMSNorm follows the order of torch's cascade sum (SumKernel.cpp:
 *     4 vector accumulators in levels of 16 steps, then lane by lane), so the mean is the same;
 *   - silu's exp is Sleef's expf_u10 (the one torch's vectorized silu calls), ported below, and
 *     glibc's expf on the elements torch leaves to its scalar tail loop (the last < 2 vectors of
 *     each contiguous run it hands a thread; `threads` lets us find the runs torch would split).
 * Two vector widths of those torch kernels matter and are passed in by the caller: `lanes` of the
 * norms is that of torch's sum kernel (8 fp32 lanes even on AVX512 in torch 2.13; native/fused.py
 * finds it with a probe), `lanes` of silu that of its elementwise loops (16 on AVX512, 8 on
 * AVX2). NaN payloads are not reproduced (NaN stays NaN).
 *
 * Rows are independent; above PAR_MIN elements they are split over the OpenMP threads (torch's).
 */
#include <math.h>
#include <stdint.h>

#include "dtypes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSED_AVX512 1
#include <immintrin.h>
#endif

#ifdef __clang__
/* clang contracts a*b+c into an FMA by default; torch's ops round each product */
#pragma STDC FP_CONTRACT OFF
#endif

#define PAR_MIN 32768    /* elements: below this one thread does it, a fork costs more than the work */
#define MAX_HEAD_DIM 1024

#define INLINE static inline __attribute__((always_inline))

INLINE float ld(const void *p, int dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int dt, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* the value an op in dtype dt returns for the fp32 result v */
INLINE float rnd(int dt, float v) { return dt == DT_BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

#ifdef FUSED_AVX512
INLINE __m512 vld(const void *p, int dt, int64_t i, __mmask16 m) {
    if (dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* fp32 -> bf16 bits in the low half of each lane: nearest even, NaN kept quiet (as dtypes.h) */
INLINE __m512i v_bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

INLINE __m512 vrnd(int dt, __m512 v) {
    if (dt != DT_BF16) return v;
    return _mm512_castsi512_ps(_mm512_slli_epi32(v_bf16_bits(v), 16));
}

INLINE void vst(void *p, int dt, int64_t i, __m512 v, __mmask16 m) {
    if (dt == DT_BF16) _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(v_bf16_bits(v)));
    else _mm512_mask_storeu_ps((float *)p + i, m, v);
}

INLINE __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }
#endif

/* ---- sum of squares in torch's order ---------------------------------------------------------
 * torch computes x.pow(2).mean(-1) as sum(x*x) / n; its sum of a contiguous row (n >= L lanes) is
 * vectorized_inner_sum -> row_sum -> multi_row_sum (aten/src/ATen/native/cpu/SumKernel.cpp): the
 * n / L whole vectors are taken four at a time ("ilp" k = vector index mod 4) into accumulators
 * that cascade up to four levels every 2^level_power steps; leftover vectors go to accumulator
 * 0; the four are added 0+1, +2, +3; then a scalar starts at 0, adds the < L tail elements, then
 * the L lanes in order. n < L takes scalar_inner_sum: the same with one lane. */
static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = (uint64_t)(x - 1); v > 1; v >>= 1) b++;
    return b + 1;
}

INLINE float sum_sq_lanes(const void *x, int dt, int64_t n, const int L) {
    const int64_t nvec = n / L, rows = nvec / 4;
    int64_t lp = ceil_log2(rows) / 4;
    if (lp < 4) lp = 4;
    const int64_t step = (int64_t)1 << lp, mask = step - 1;
    float acc[4][4][16];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++) acc[j][k][l] = 0.f;
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t s = 0; s < step; s++, i++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < L; l++) {
                    const float v = ld(x, dt, (4 * i + k) * L + l);
                    acc[0][k][l] += v * v;
                }
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < L; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.f;
                }
            if (i & (mask << (j * lp))) break;
        }
    }
    for (; i < rows; i++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++) {
                const float v = ld(x, dt, (4 * i + k) * L + l);
                acc[0][k][l] += v * v;
            }
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < L; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = rows * 4; v < nvec; v++)
        for (int l = 0; l < L; l++) {
            const float e = ld(x, dt, v * L + l);
            acc[0][0][l] += e * e;
        }
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < L; l++) acc[0][0][l] += acc[0][k][l];
    float s = 0.f;
    for (int64_t e = nvec * L; e < n; e++) {
        const float v = ld(x, dt, e);
        s += v * v;
    }
    for (int l = 0; l < L; l++) s += acc[0][0][l];
    return s;
}

#ifdef FUSED_AVX512
/* The same order with the lanes in registers (L = 8: ymm, L = 16: zmm), for rows of n >= L. */
#define SUM_SQ_SIMD(NAME, L, VT, ZERO, ADD, MUL, LOAD, STORE)                                          \
    static float NAME(const void *x, int dt, int64_t n) {                                              \
        const int64_t nvec = n / L, rows = nvec / 4;                                                   \
        int64_t lp = ceil_log2(rows) / 4;                                                              \
        if (lp < 4) lp = 4;                                                                            \
        const int64_t step = (int64_t)1 << lp, mask = step - 1;                                        \
        VT acc[4][4];                                                                                  \
        for (int j = 0; j < 4; j++)                                                                    \
            for (int k = 0; k < 4; k++) acc[j][k] = ZERO;                                              \
        int64_t i = 0;                                                                                 \
        while (i + step <= rows) {                                                                     \
            for (int64_t s = 0; s < step; s++, i++)                                                    \
                for (int k = 0; k < 4; k++) {                                                          \
                    const VT v = LOAD(x, dt, (4 * i + k) * L);                                         \
                    acc[0][k] = ADD(acc[0][k], MUL(v, v));                                             \
                }                                                                                      \
            for (int j = 1; j < 4; j++) {                                                              \
                for (int k = 0; k < 4; k++) {                                                          \
                    acc[j][k] = ADD(acc[j][k], acc[j - 1][k]);                                         \
                    acc[j - 1][k] = ZERO;                                                              \
                }                                                                                      \
                if (i & (mask << (j * lp))) break;                                                     \
            }                                                                                          \
        }                                                                                              \
        for (; i < rows; i++)                                                                          \
            for (int k = 0; k < 4; k++) {                                                              \
                const VT v = LOAD(x, dt, (4 * i + k) * L);                                             \
                acc[0][k] = ADD(acc[0][k], MUL(v, v));                                                 \
            }                                                                                          \
        for (int j = 1; j < 4; j++)                                                                    \
            for (int k = 0; k < 4; k++) acc[0][k] = ADD(acc[0][k], acc[j][k]);                         \
        for (int64_t v = rows * 4; v < nvec; v++) {                                                    \
            const VT e = LOAD(x, dt, v * L);                                                           \
            acc[0][0] = ADD(acc[0][0], MUL(e, e));                                                     \
        }                                                                                              \
        for (int k = 1; k < 4; k++) acc[0][0] = ADD(acc[0][0], acc[0][k]);                             \
        float s = 0.f, lanes[L];                                                                       \
        for (int64_t e = nvec * L; e < n; e++) {                                                       \
            const float v = ld(x, dt, e);                                                              \
            s += v * v;                                                                                \
        }                                                                                              \
        STORE(lanes, acc[0][0]);                                                                       \
        for (int l = 0; l < L; l++) s += lanes[l];                                                     \
        return s;                                                                                      \
    }

INLINE __m256 vld8(const void *p, int dt, int64_t i) {
    if (dt == DT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}
INLINE __m512 vld16(const void *p, int dt, int64_t i) { return vld(p, dt, i, 0xffff); }

SUM_SQ_SIMD(sum_sq_simd8, 8, __m256, _mm256_setzero_ps(), _mm256_add_ps, _mm256_mul_ps, vld8, _mm256_storeu_ps)
SUM_SQ_SIMD(sum_sq_simd16, 16, __m512, _mm512_setzero_ps(), _mm512_add_ps, _mm512_mul_ps, vld16, _mm512_storeu_ps)
#endif

/* sum of x[i]^2 in the order of torch's sum kernel with `lanes` fp32 lanes */
static float sum_sq(const void *x, int dt, int64_t n, int lanes) {
#ifdef FUSED_AVX512
    if (lanes == 16 && n >= 16) return sum_sq_simd16(x, dt, n);
    if (lanes == 8 && n >= 8) return sum_sq_simd8(x, dt, n);
#endif
    if (lanes == 16 && n >= 16) return dt == DT_BF16 ? sum_sq_lanes(x, DT_BF16, n, 16) : sum_sq_lanes(x, DT_F32, n, 16);
    if (lanes == 8 && n >= 8) return dt == DT_BF16 ? sum_sq_lanes(x, DT_BF16, n, 8) : sum_sq_lanes(x, DT_F32, n, 8);
    return dt == DT_BF16 ? sum_sq_lanes(x, DT_BF16, n, 1) : sum_sq_lanes(x, DT_F32, n, 1);
}

/* 1 / sqrt(mean(x^2) + eps), each step rounded as torch's (sum / n, + eps, rsqrt = 1 / sqrt) */
static float inv_rms(const void *x, int dt, int64_t n, float eps, int lanes) {
    return 1.0f / sqrtf(sum_sq(x, dt, n, lanes) / (float)n + eps);
}

/* y[i] = w[i] * (x[i] * r), each product rounded to dt (HF: normalize in fp32, cast, scale) */
INLINE void scale_row(const void *x, const void *w, void *y, int dt, int64_t n, float r) {
    int64_t i = 0;
#ifdef FUSED_AVX512
    const __m512 rv = _mm512_set1_ps(r);
    for (; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 t = vrnd(dt, _mm512_mul_ps(vld(x, dt, i, m), rv));
        vst(y, dt, i, _mm512_mul_ps(vld(w, dt, i, m), t), m);
    }
#endif
    for (; i < n; i++) st(y, dt, i, ld(w, dt, i) * rnd(dt, ld(x, dt, i) * r));
}

/* out[i] = a[i] + b[i] rounded to dt (torch's add) */
INLINE void add_row(const void *a, const void *b, void *out, int dt, int64_t n) {
    int64_t i = 0;
#ifdef FUSED_AVX512
    for (; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        vst(out, dt, i, _mm512_add_ps(vld(a, dt, i, m), vld(b, dt, i, m)), m);
    }
#endif
    for (; i < n; i++) st(out, dt, i, ld(a, dt, i) + ld(b, dt, i));
}

INLINE const void *row_at(const void *p, int dt, int64_t off) {
    return dt == DT_BF16 ? (const void *)((const uint16_t *)p + off) : (const void *)((const float *)p + off);
}

INLINE void *row_at_mut(void *p, int dt, int64_t off) {
    return dt == DT_BF16 ? (void *)((uint16_t *)p + off) : (void *)((float *)p + off);
}

/* RMSNorm of `rows` rows of n: y = w * norm(x). With delta: first x_out = x + delta (rounded to
 * dt, the residual add), then y = w * norm(x_out). x and delta have row strides (unit inner
 * stride); x_out and y are contiguous [rows, n]; w is [n]. Everything in dtype dt. */
int fused_rms_norm(const void *x, int64_t x_stride, const void *delta, int64_t delta_stride, void *x_out,
                   const void *w, void *y, int dt, int64_t rows, int64_t n, float eps, int lanes) {
    if (n <= 0 || (dt != DT_F32 && dt != DT_BF16)) return -1;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const void *src = row_at(x, dt, r * x_stride);
        if (delta) {
            void *dst = row_at_mut(x_out, dt, r * n);
            add_row(src, row_at(delta, dt, r * delta_stride), dst, dt, n);
            src = dst;
        }
        scale_row(src, w, row_at_mut(y, dt, r * n), dt, n, inv_rms(src, dt, n, eps, lanes));
    }
    return 0;
}

/* ---- q/k RMSNorm + RoPE --------------------------------------------------------------------
 * qkv: rows of [q_heads | k_heads | v heads] x head_dim (row stride row_stride, in dtype dt); the
 * q and k heads are rewritten in place: optionally RMSNorm per head (q_w / k_w, [head_dim]; NULL:
 * none), then NeoX rotate-half RoPE over the first rotary_dim dims with the row's cos/sin
 * ([rows, rotary_dim / 2] in dt, row stride cs_stride): (x1, x2) -> (x1*cos - x2*sin, x2*cos +
 * x1*sin), each product, difference and sum rounded to dt as torch's apply_rope computes them; the
 * dims past rotary_dim (partial rotary, GLM-4.5) are passed through. */
INLINE void norm_rope_head(void *h, int dt, int64_t d, int64_t half, const void *w, float eps, const void *c, const void *s,
                           int lanes) {
    float buf[MAX_HEAD_DIM];
    int64_t i = 0;
    if (w) {
        const float r = inv_rms(h, dt, d, eps, lanes);
#ifdef FUSED_AVX512
        const __m512 rv = _mm512_set1_ps(r);
        for (; i < d; i += 16) {
            const __mmask16 m = tail_mask(d - i);
            const __m512 t = vrnd(dt, _mm512_mul_ps(vld(h, dt, i, m), rv));
            _mm512_mask_storeu_ps(buf + i, m, vrnd(dt, _mm512_mul_ps(vld(w, dt, i, m), t)));
        }
#endif
        for (; i < d; i++) buf[i] = rnd(dt, ld(w, dt, i) * rnd(dt, ld(h, dt, i) * r));
    } else {
#ifdef FUSED_AVX512
        for (; i < d; i += 16) {
            const __mmask16 m = tail_mask(d - i);
            _mm512_mask_storeu_ps(buf + i, m, vld(h, dt, i, m));
        }
#endif
        for (; i < d; i++) buf[i] = ld(h, dt, i);
    }
    i = 0;
#ifdef FUSED_AVX512
    for (; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 x1 = _mm512_maskz_loadu_ps(m, buf + i), x2 = _mm512_maskz_loadu_ps(m, buf + half + i);
        const __m512 cv = vld(c, dt, i, m), sv = vld(s, dt, i, m);
        const __m512 o1 = _mm512_sub_ps(vrnd(dt, _mm512_mul_ps(x1, cv)), vrnd(dt, _mm512_mul_ps(x2, sv)));
        const __m512 o2 = _mm512_add_ps(vrnd(dt, _mm512_mul_ps(x2, cv)), vrnd(dt, _mm512_mul_ps(x1, sv)));
        vst(h, dt, i, o1, m);
        vst(h, dt, half + i, o2, m);
    }
#endif
    for (; i < half; i++) {
        const float cv = ld(c, dt, i), sv = ld(s, dt, i), x1 = buf[i], x2 = buf[half + i];
        const float a = rnd(dt, x1 * cv), b = rnd(dt, x2 * sv);
        const float e = rnd(dt, x2 * cv), f = rnd(dt, x1 * sv);
        st(h, dt, i, a - b);
        st(h, dt, half + i, e + f);
    }
    /* partial rotary: the dims past the rotated span keep their (normed) values */
    if (w)
        for (i = 2 * half; i < d; i++) st(h, dt, i, buf[i]);
}

int fused_qk_norm_rope(void *qkv, int dt, int64_t row_stride, int64_t rows, int64_t q_heads, int64_t k_heads,
                       int64_t head_dim, int64_t rotary_dim, const void *q_w, const void *k_w, float eps, const void *cos,
                       const void *sin, int64_t cs_stride, int lanes) {
    if (head_dim <= 0 || head_dim % 2 || head_dim > MAX_HEAD_DIM || (dt != DT_F32 && dt != DT_BF16)) return -1;
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > head_dim) return -1;
    const int64_t heads = q_heads + k_heads, items = rows * heads;
#pragma omp parallel for schedule(static) if (items * head_dim >= PAR_MIN)
    for (int64_t it = 0; it < items; it++) {
        const int64_t r = it / heads, h = it % heads;
        norm_rope_head(row_at_mut(qkv, dt, r * row_stride + h * head_dim), dt, head_dim, rotary_dim / 2, h < q_heads ? q_w : k_w,
                       eps, row_at(cos, dt, r * cs_stride), row_at(sin, dt, r * cs_stride), lanes);
    }
    return 0;
}

/* ---- silu(gate) * up ---------------------------------------------------------------------- */

/* Sleef's xexpf (sleefsimdsp.c, the FMA build torch's Vectorized<float>::exp calls), one lane. */
#define SLEEF_R_LN2 1.442695040888963407359924681001892137426645954152985934135449406931f
#define SLEEF_L2U 0.693145751953125f
#define SLEEF_L2L 1.428606765330187045e-06f

INLINE float pow2i(int32_t q) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)(q + 0x7f) << 23;
    return v.f;
}

static float sleef_expf(float d) {
    if (d < -104.f) return 0.f;
    if (100.f < d) return INFINITY;
    if (d != d) return d;
    const float qf = nearbyintf(d * SLEEF_R_LN2);
    const int32_t q = (int32_t)qf;
    float s = fmaf(qf, -SLEEF_L2U, d);
    s = fmaf(qf, -SLEEF_L2L, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    const float s2 = s * s;
    u = 1.0f + fmaf(s2, u, s);
    const float p1 = pow2i(q >> 1), p2 = pow2i(q - (q >> 1));
    const float t = u * p1;
    return t * p2;
}

#ifdef FUSED_AVX512
INLINE __m512 v_sleef_expf(__m512 d) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(SLEEF_R_LN2)));
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-SLEEF_L2U), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-SLEEF_L2L), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i q1 = _mm512_srai_epi32(q, 1), q2 = _mm512_sub_epi32(q, q1);
    const __m512i bias = _mm512_set1_epi32(0x7f);
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q1, bias), 23)));
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q2, bias), 23)));
    u = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ), u);
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ), _mm512_set1_ps(INFINITY));
}
#endif

/* y[i] = silu(g[i]) * u[i] over columns [a, b) of one row: silu = g / (1 + exp(-g)) rounded to
 * dt, then the product rounded to dt. Columns below vec_end take Sleef's exp, the rest expf. */
INLINE void silu_mul_cols(const void *g, const void *u, void *y, int dt, int64_t a, int64_t vec_end, int64_t b) {
    int64_t i = a;
#ifdef FUSED_AVX512
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= vec_end; i += 16) {
        const __m512 gv = vld(g, dt, i, 0xffff);
        const __m512 e = v_sleef_expf(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 sv = vrnd(dt, _mm512_div_ps(gv, _mm512_add_ps(one, e)));
        vst(y, dt, i, _mm512_mul_ps(sv, vld(u, dt, i, 0xffff)), 0xffff);
    }
#endif
    for (; i < b; i++) {
        const float gv = ld(g, dt, i);
        const float e = i < vec_end ? sleef_expf(-gv) : expf(-gv);
        st(y, dt, i, rnd(dt, gv / (1.0f + e)) * ld(u, dt, i));
    }
}

/* gu: rows of [gate (inter) | up (inter)], row stride gu_stride; y: contiguous [rows, inter].
 * `threads` is torch's thread count: torch's elementwise loop hands each thread a contiguous
 * range of the rows * inter outputs (at::parallel_for, grain 32768), and within each row
 * segment of a range it runs vectors of 2 * (its vector length) and a scalar tail; we find the
 * same segments to know which elements torch computed with the scalar expf. */
int fused_silu_mul(const void *gu, int64_t gu_stride, void *y, int dt, int64_t rows, int64_t inter, int lanes,
                   int threads) {
    if (inter <= 0 || (dt != DT_F32 && dt != DT_BF16)) return -1;
    const int64_t numel = rows * inter, grain = 32768;
    int64_t tasks = threads > 1 ? (numel + grain - 1) / grain : 1;
    if (tasks > threads) tasks = threads;
    if (tasks < 1) tasks = 1;
    const int64_t chunk = (numel + tasks - 1) / tasks;
    /* torch's vector step in elements: Vectorized<float> is `lanes` wide, Vectorized<BFloat16>
     * twice that, and its loop takes two vectors per iteration */
    const int64_t vstep = (dt == DT_BF16 ? 4 : 2) * (int64_t)lanes;
#pragma omp parallel for schedule(static) if (numel >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const void *g = row_at(gu, dt, r * gu_stride), *u = row_at(gu, dt, r * gu_stride + inter);
        void *yr = row_at_mut(y, dt, r * inter);
        int64_t a = 0;
        while (a < inter) {
            const int64_t flat = r * inter + a;
            int64_t b = (flat / chunk + 1) * chunk - r * inter;
            if (b > inter) b = inter;
            silu_mul_cols(g, u, yr, dt, a, a + (b - a) / vstep * vstep, b);
            a = b;
        }
    }
    return 0;
}

/* y[i] = sigmoid(x[i]) = 1 / (1 + expf(-x[i])) over n contiguous elements (fp32, or bf16 rounded
 * once), every element by the same scalar formula: torch's sigmoid takes its vector exp for most
 * elements and the scalar one for the tail of each thread's range, so an element's bits follow its
 * position in the tensor, i.e. the batch it is in. For the gates of the batch-invariant forward
 * (NSA's branch gates, a shared expert's gate). */
int fused_sigmoid(const void *x, void *y, int dt, int64_t n) {
    if (dt != DT_F32 && dt != DT_BF16) return -1;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) st(y, dt, i, 1.0f / (1.0f + expf(-ld(x, dt, i))));
    return 0;
}

/* Attention sinks (gpt-oss): o[t, h, :] *= sigmoid(lse[t, h] - sink[h]) in place, the factor by which
 * a sink logit joining a row's softmax (with a zero value) scales the row's output. o [rows, heads,
 * dim] contiguous (fp32, or bf16 rounded once from the fp32 product), lse fp32 [rows, heads], sinks
 * [heads] in o's dtype. One scalar formula per (row, head), so a row's bits do not depend on the
 * batch around it; the torch code it replaces (fused.sink_scale's fallback) computes the same fp32
 * factor (within an ulp: torch's vector exp), fp32 product, one rounding. */
int fused_sink_scale(void *o, int dt, const float *lse, const void *sinks, int64_t rows, int64_t heads, int64_t dim) {
    if (dt != DT_F32 && dt != DT_BF16) return -1;
#pragma omp parallel for schedule(static) if (rows * heads * dim >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const float f = 1.0f / (1.0f + expf(-(lse[r * heads + h] - ld(sinks, dt, h))));
            const int64_t base = (r * heads + h) * dim;
            for (int64_t d = 0; d < dim; d++) st(o, dt, base + d, ld(o, dt, base + d) * f);
        }
    return 0;
}

/* Elementwise ops between the kernels of a decoder layer, as torch computes them (fp32, or bf16
 * rounded once from the fp32 result), so a step that used to run them in torch gives the same
 * bits and can replay as a kernel graph: out = x + y (`op` 0; y [rows, n] rows y_stride apart),
 * out = x * f (`op` 1) or x / f (`op` 2) with f = the row's factor rows_f[r] (in dt) where rows_f
 * is given, else the float `s` (torch's Python-number operand, taken as a float). x: rows x_stride
 * apart, each n contiguous elements; out [rows, n] contiguous. One formula per element:
 * batch-invariant. */
int fused_elementwise(const void *x, int64_t x_stride, const void *y, int64_t y_stride, const void *rows_f, float s, void *out,
                      int dt, int64_t rows, int64_t n, int op) {
    if ((dt != DT_F32 && dt != DT_BF16) || op < 0 || op > 2 || (op == 0 && !y)) return -1;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float f = rows_f ? ld(rows_f, dt, r) : s;
        for (int64_t j = 0; j < n; j++) {
            const float a = ld(x, dt, r * x_stride + j);
            const float v = op == 0 ? a + ld(y, dt, r * y_stride + j) : op == 1 ? a * f : a / f;
            st(out, dt, r * n + j, v);
        }
    }
    return 0;
}

/* RMSNorm in place over rows of n elements x_stride apart (unit inner stride): the whole-row q / k
 * norms of MiniMax-M2 and OLMo, applied to their columns of the fused qkv rows, so no copy of the
 * rows is made (a torch cat was one, and kept such decode steps out of kernel graphs). Same
 * arithmetic as fused_rms_norm. */
int fused_rms_norm_inplace(void *x, int64_t x_stride, const void *w, int dt, int64_t rows, int64_t n, float eps, int lanes) {
    if (n <= 0 || (dt != DT_F32 && dt != DT_BF16)) return -1;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        void *row = row_at_mut(x, dt, r * x_stride);
        scale_row(row, w, row, dt, n, inv_rms(row, dt, n, eps, lanes));
    }
    return 0;
}

/* StarCoder2's LayerNorm and gelu, so its decode steps are native calls only (kernel graphs) and
 * one formula per row / element (batch-invariant). Not torch's bits: torch's layer_norm sums by
 * its own moments kernel and its gelu takes a vector tanh, so results agree to within an fp32
 * ulp or two (one bf16 rounding of the same float value, mostly the same bits).
 * y = (x - mean) / sqrt(var + eps) * w + b per row of n (x_stride apart, unit inner stride; y
 * contiguous), the moments in double, the rest in fp32, rounded once to dt. */
int fused_layer_norm(const void *x, int64_t x_stride, const void *w, const void *b, void *y, int dt, int64_t rows, int64_t n,
                     float eps) {
    if (n <= 0 || (dt != DT_F32 && dt != DT_BF16)) return -1;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        double s = 0.0, ss = 0.0;
        for (int64_t j = 0; j < n; j++) s += ld(x, dt, r * x_stride + j);
        const double mean = s / (double)n;
        for (int64_t j = 0; j < n; j++) {
            const double d = ld(x, dt, r * x_stride + j) - mean;
            ss += d * d;
        }
        const float m = (float)mean, rstd = 1.0f / sqrtf((float)(ss / (double)n) + eps);
        for (int64_t j = 0; j < n; j++)
            st(y, dt, r * n + j, (ld(x, dt, r * x_stride + j) - m) * rstd * ld(w, dt, j) + (b ? ld(b, dt, j) : 0.0f));
    }
    return 0;
}

/* y = gelu(x) with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), per
 * element in fp32, rounded once to dt; x [rows, n] rows x_stride apart, y contiguous. */
int fused_gelu_tanh(const void *x, int64_t x_stride, void *y, int dt, int64_t rows, int64_t n) {
    if (dt != DT_F32 && dt != DT_BF16) return -1;
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
#pragma omp parallel for schedule(static) if (rows * n >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++) {
            const float v = ld(x, dt, r * x_stride + j);
            st(y, dt, r * n + j, 0.5f * v * (1.0f + tanhf(k0 * (v + k1 * v * v * v))));
        }
    return 0;
}

/* ---- multi-head latent attention: q / k / v assembled for the paged cache ----------------------
 * DeepSeek-V2 / V3's per-head q (nope then rope dims, the checkpoint's order; rows of
 * heads * (nope + rope), q_stride apart), the shared rotary key (rows of rope, k_rot_stride apart)
 * and the decompressed kv (rows of heads * (nope + vdim), kv_stride apart) -> q_out, k_out, v_out
 * [rows, heads, cache_dim] contiguous: rotary dims first (de-interleaved first where the checkpoint
 * stores them as pairs), rotated as torch's apply_rope rotates them (norm_rope_head, no norm), then
 * the nope dims, v, and zeros up to cache_dim -- what mla.py's torch code builds with cats and pads,
 * in one pass, so an MLA decode step is native calls only. */
int fused_mla_qkv(const void *q, int64_t q_stride, const void *k_rot, int64_t k_rot_stride, const void *kv, int64_t kv_stride,
                  const void *cos, const void *sin, int64_t cs_stride, void *q_out, void *k_out, void *v_out, int dt, int64_t rows,
                  int64_t heads, int64_t nope, int64_t rope, int64_t vdim, int64_t cache_dim, int interleave, int lanes) {
    if ((dt != DT_F32 && dt != DT_BF16) || rope <= 0 || rope % 2 || rope > MAX_HEAD_DIM || nope < 0 || vdim <= 0 ||
        nope + rope > cache_dim || vdim > cache_dim)
        return -1;
    const int64_t half = rope / 2;
#pragma omp parallel for schedule(static) if (rows * heads * cache_dim >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const void *c = row_at(cos, dt, r * cs_stride), *s = row_at(sin, dt, r * cs_stride);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t qo = (r * heads + h) * cache_dim, qi = r * q_stride + h * (nope + rope);
            const int64_t kvi = r * kv_stride + h * (nope + vdim);
            for (int64_t i = 0; i < rope; i++) {
                const int64_t j = interleave ? (i < half ? 2 * i : 2 * (i - half) + 1) : i;
                st(q_out, dt, qo + i, ld(q, dt, qi + nope + j));
                if (h == 0) st(k_out, dt, qo + i, ld(k_rot, dt, r * k_rot_stride + j));
            }
            norm_rope_head(row_at_mut(q_out, dt, qo), dt, rope, half, (const void *)0, 0.f, c, s, lanes);
            if (h == 0) norm_rope_head(row_at_mut(k_out, dt, qo), dt, rope, half, (const void *)0, 0.f, c, s, lanes);
            else
                for (int64_t i = 0; i < rope; i++) st(k_out, dt, qo + i, ld(k_out, dt, r * heads * cache_dim + i));
            for (int64_t i = 0; i < nope; i++) {
                st(q_out, dt, qo + rope + i, ld(q, dt, qi + i));
                st(k_out, dt, qo + rope + i, ld(kv, dt, kvi + i));
            }
            for (int64_t i = nope + rope; i < cache_dim; i++) st(q_out, dt, qo + i, 0.f), st(k_out, dt, qo + i, 0.f);
            for (int64_t i = 0; i < vdim; i++) st(v_out, dt, qo + i, ld(kv, dt, kvi + nope + i));
            for (int64_t i = vdim; i < cache_dim; i++) st(v_out, dt, qo + i, 0.f);
        }
    }
    return 0;
}
