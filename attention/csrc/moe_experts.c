/* Routed experts of one MoE layer on CPU: routing, token-to-expert grouping, the SwiGLU expert
 * GEMMs and the weighted combine, each a single call (no per-expert loop in Python).
 *
 * Why: at decode a Qwen3-MoE layer's experts are small (a few hundred KB each); the torch path
 * spends its time in per-expert dispatch (two matmuls, a chunk, silu, mul, per active expert, each
 * op tens of microseconds), not in reading the weights. Here one call groups the assignments by
 * expert (a counting sort), then every (active expert, weight panel) pair is one work item of an
 * OpenMP loop: each selected expert's weights are read once per call, whatever the batch, and
 * tokens of one expert are processed in row tiles against a panel that stays in L1/L2.
 *
 * Packed layouts (made once by moe_pack_w13 / moe_pack_w2, kept by the Python binding):
 *   w13 [E, 2I, H] (gate rows, then up rows) -> per expert, panels of P13 intermediate features:
 *       w13p[e][p][k][c]      = gate row (P13 p + c), column k    (c < P13)
 *       w13p[e][p][k][P13 + c] = up   row (P13 p + c), column k
 *     so one k of a panel is 2 * P13 contiguous weights: one vector of gate, one of up, multiplied
 *     by x[k] broadcast; gate and up of the same features end in the same registers, so silu * up
 *     is computed in the GEMM's epilogue and the [T, 2I] intermediate never exists.
 *   w2 [E, H, I] -> per expert, panels of P2 output features: w2p[e][q][k][c] = w2 row (P2 q + c), column k.
 *   Rows past I (or H) are zero. Elements keep the weight's dtype (fp32 or bf16; bf16 widens to
 *   fp32 in registers with a shift, which is exact).
 * The weight format is a per-call code (moe_experts' w_format): MOE_W_F32, MOE_W_BF16, MOE_W_MXFP8.
 * MXFP8 panels (moe_pack_mx_w13 / moe_pack_mx_w2) keep the same order with one E4M3 byte per
 * weight, so one k of a panel is 16 bytes = one 16-byte load decoded in registers (mxfp8.h), and
 * the E8M0 block scales are packed alongside: per block of 32 k, the panel's 16 features' scale
 * bytes side by side (s13p[e][p][kb][c], s2p[e][q][kb][c]). The tile sums 32 k into block
 * accumulators and multiplies them by the 16 features' factors once per block (as mxfp8_gemm.c's
 * decode loop does), so the weight bytes are read once, 8.25 bits each. Without AVX2/F16C (or
 * with mxfp8_set_fast_path(0)) a panel is dequantized to fp32 and the fp32 tile runs on it.
 *
 * Numerics follow the torch expert path (moe/experts_torch.py): fp32 accumulation; with bf16
 * activations the GEMM outputs, silu and the product are rounded to bf16 where torch rounds them,
 * so the two differ only by summation order; the combine sums the top-k rows in slot order in fp32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dtypes.h"
#include "mxfp8.h"
#include "vec_exp.h"

enum { MOE_W_F32 = 0, MOE_W_BF16 = 1, MOE_W_MXFP8 = 2 };

#define P13 8 /* intermediate features per w13 panel (P13 gate + P13 up rows) */
#define P2 16 /* output features per w2 panel */
#define MR 4  /* token rows per register tile (MXFP8 tiles) */
#define MRP 6 /* token rows per register tile of the fp32/bf16 tiles: 12 accumulators cover the FMA
               * latency (4 rows left the GEMM at ~60% of MKL's rate at 256 tokens, one core) */

typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

static inline v8f fmadd(v8f a, v8f b, v8f c) {
#ifdef __FMA__
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* 8 weights at p (element offset already applied) as fp32 */
static inline __attribute__((always_inline)) v8f load8(const void *p, const int fmt) {
    v8f f;
    if (fmt == MOE_W_BF16) {
#ifdef __AVX2__
        const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
        v8u16 h;
        memcpy(&h, p, sizeof h);
        const v8u32 w = __builtin_convertvector(h, v8u32) << 16;
#endif
        memcpy(&f, &w, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

static inline size_t elsize(int fmt) { return fmt == MOE_W_BF16 ? 2 : fmt == MOE_W_MXFP8 ? 1 : 4; }

static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

#if defined(__AVX2__) && defined(__FMA__)
#define MOE_VEC_EPILOGUE 1
/* rnd on 8 lanes: f32_to_bf16's rounding (nearest even, NaN kept quiet) and back */
static inline __attribute__((always_inline)) __m256 rnd8(__m256 v, int bf16) {
    if (!bf16) return v;
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)),
                                       _mm256_set1_epi32((int)0xFFFF0000u));
    const __m256i qnan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), _mm256_set1_epi32((int)0xFFFF0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

/* h = rnd(rnd(silu(rnd(g))) * rnd(u)) on 8 lanes, silu(g) = g / (1 + e^-g) with the vector exp
 * (vec_exp.h, within an ulp or two of libm's; e^-g clamped at e^88, where g / (1 + e^-g) is
 * below 1e-36 either way) -- the scalar epilogue's roundings, as torch rounds its bf16 path */
static inline __attribute__((always_inline)) __m256 swiglu8(__m256 g, __m256 u, int bf16) {
    g = rnd8(g, bf16);
    u = rnd8(u, bf16);
    const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), _mm256_set1_ps(88.f)));
    const __m256 sv = rnd8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), bf16);
    return rnd8(_mm256_mul_ps(sv, u), bf16);
}
#endif

int64_t moe_packed_w13_numel(int64_t E, int64_t I, int64_t H) { return E * ((I + P13 - 1) / P13) * H * 2 * P13; }
int64_t moe_packed_w2_numel(int64_t E, int64_t H, int64_t I) { return E * ((H + P2 - 1) / P2) * I * P2; }

/* The panel permutations, for any element size es (bytes): w [E, 2I, K] (gate rows, then up rows)
 * -> [E][ceil(I/P13)][K][2 * P13], and w [E, N, K] -> [E][ceil(N/P2)][K][P2]; rows past I (or N)
 * are zero. fp32/bf16 weights are packed with K = H (or I); MXFP8 bytes likewise with es = 1, and
 * their scale bytes with K = H/32 (or I/32), which puts each block's scales in the panel order. */
static inline __attribute__((always_inline)) void panels13(const void *w, const size_t es, int64_t E, int64_t I, int64_t K,
                                                          void *out) {
    const int64_t np = (I + P13 - 1) / P13;
#pragma omp parallel for schedule(static)
    for (int64_t ep = 0; ep < E * np; ep++) {
        const int64_t e = ep / np, p = ep % np;
        char *dst = (char *)out + (size_t)ep * K * 2 * P13 * es;
        const char *src = (const char *)w + (size_t)e * 2 * I * K * es;
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < 2 * P13; c++) {
                const int64_t f = p * P13 + c % P13; /* intermediate feature */
                char *d = dst + (size_t)(k * 2 * P13 + c) * es;
                if (f < I) memcpy(d, src + (size_t)((c < P13 ? f : I + f) * K + k) * es, es);
                else memset(d, 0, es);
            }
    }
}

static inline __attribute__((always_inline)) void panels2(const void *w, const size_t es, int64_t E, int64_t N, int64_t K,
                                                         void *out) {
    const int64_t nq = (N + P2 - 1) / P2;
#pragma omp parallel for schedule(static)
    for (int64_t eq = 0; eq < E * nq; eq++) {
        const int64_t e = eq / nq, q = eq % nq;
        char *dst = (char *)out + (size_t)eq * K * P2 * es;
        const char *src = (const char *)w + (size_t)e * N * K * es;
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < P2; c++) {
                const int64_t f = q * P2 + c;
                char *d = dst + (size_t)(k * P2 + c) * es;
                if (f < N) memcpy(d, src + (size_t)(f * K + k) * es, es);
                else memset(d, 0, es);
            }
    }
}

/* es a constant in each branch, so the element copies compile to plain loads and stores */
static void pack_panels13(const void *w, size_t es, int64_t E, int64_t I, int64_t K, void *out) {
    if (es == 1) panels13(w, 1, E, I, K, out);
    else if (es == 2) panels13(w, 2, E, I, K, out);
    else panels13(w, 4, E, I, K, out);
}

static void pack_panels2(const void *w, size_t es, int64_t E, int64_t N, int64_t K, void *out) {
    if (es == 1) panels2(w, 1, E, N, K, out);
    else if (es == 2) panels2(w, 2, E, N, K, out);
    else panels2(w, 4, E, N, K, out);
}

/* w13: [E, 2I, H] contiguous, fmt MOE_W_F32 or MOE_W_BF16; out: moe_packed_w13_numel elements of the same type. */
int moe_pack_w13(const void *w, int fmt, int64_t E, int64_t I, int64_t H, void *out) {
    if (fmt != MOE_W_F32 && fmt != MOE_W_BF16) return -2;
    pack_panels13(w, elsize(fmt), E, I, H, out);
    return 0;
}

/* w2: [E, H, I] contiguous; out: moe_packed_w2_numel elements of the same type. */
int moe_pack_w2(const void *w, int fmt, int64_t E, int64_t H, int64_t I, void *out) {
    if (fmt != MOE_W_F32 && fmt != MOE_W_BF16) return -2;
    pack_panels2(w, elsize(fmt), E, H, I, out);
    return 0;
}

/* MXFP8 w13: data [E, 2I, H] E4M3 bytes, scale [E, 2I, H/32] E8M0 bytes -> out_data
 * (moe_packed_w13_numel bytes, the panel order above) and out_scale (that / 32 bytes). -2: H % 32. */
int moe_pack_mx_w13(const uint8_t *data, const uint8_t *scale, int64_t E, int64_t I, int64_t H, uint8_t *out_data,
                    uint8_t *out_scale) {
    if (H % MX_BLOCK) return -2;
    pack_panels13(data, 1, E, I, H, out_data);
    pack_panels13(scale, 1, E, I, H / MX_BLOCK, out_scale);
    return 0;
}

/* MXFP8 w2: data [E, H, I], scale [E, H, I/32] -> panels of P2 output features. -2: I % 32. */
int moe_pack_mx_w2(const uint8_t *data, const uint8_t *scale, int64_t E, int64_t H, int64_t I, uint8_t *out_data,
                   uint8_t *out_scale) {
    if (I % MX_BLOCK) return -2;
    pack_panels2(data, 1, E, H, I, out_data);
    pack_panels2(scale, 1, E, H, I / MX_BLOCK, out_scale);
    return 0;
}

/* ---- routing ---------------------------------------------------------------------------- */

/* indices of the k largest of v[0..n), descending, ties to the lower index */
static void topk_desc(const float *v, int64_t n, int64_t k, int64_t *idx) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++) {
            int taken = 0;
            for (int64_t q = 0; q < j; q++) taken |= idx[q] == i;
            if (taken) continue;
            if (best < 0 || v[i] > v[best]) best = i;
        }
        idx[j] = best;
    }
}

/* Whether the last kept value a and the first dropped value b are too close for the choice to be
 * certain: torch.topk breaks exact ties its own way (an implementation detail of its partial sort),
 * and torch's exp/sigmoid may differ from ours by an ulp or two, so within 4 ulps the caller lets
 * the torch router decide that token. */
static int near_tie(float a, float b) {
    if (a == b) return 1;
    if (!isfinite(a) || !isfinite(b)) return 0;
    const float m = fabsf(a) > fabsf(b) ? fabsf(a) : fabsf(b);
    return a - b <= 4.8e-7f * m;
}

/* logits [T, E] (fp32 or bf16) -> weights fp32 [T, k], ids int64 [T, k], tie[T] (1: a near-tie at
 * a selection cut, see near_tie; that token's result must be taken from the torch router).
 * scoring 0: softmax (fp32) -> top-k -> divide by their sum if renorm.
 * scoring 1 (DeepSeek-V3): s = sigmoid; choice = s + bias (bias fp32 [E] or NULL); with n_group > 1
 * keep the topk_group groups whose top-2 choices sum highest; top-k of choice; weights = s, divided
 * by (sum + 1e-20) if renorm, times scale.
 * Returns the number of tokens flagged in tie, or -1 on bad sizes. */
int64_t moe_route(const void *logits, int l_dtype, int64_t T, int64_t E, int64_t k, int scoring, int renorm,
                  int64_t n_group, int64_t topk_group, float scale, const float *bias, float *weights, int64_t *ids,
                  uint8_t *tie) {
    if (k < 1 || k > E || E > 4096 || n_group < 1 || E % n_group || topk_group < 1 || topk_group > n_group) return -1;
    if (scoring == 1 && n_group > 1 && E / n_group < 2) return -1;
    int64_t ties = 0;
#pragma omp parallel for schedule(static) reduction(+ : ties) if (T * E > 16384)
    for (int64_t t = 0; t < T; t++) {
        float s[4096], choice[4096], gs[4096];
        int64_t sel[4097], gsel[4097];
        for (int64_t e = 0; e < E; e++)
            s[e] = l_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)logits)[t * E + e]) : ((const float *)logits)[t * E + e];
        int64_t *id = ids + t * k;
        float *w = weights + t * k;
        const int64_t kk = k < E ? k + 1 : k; /* one past the cut, to see how close it is */
        int amb = 0;
        if (scoring == 0) {
            float m = s[0];
            for (int64_t e = 1; e < E; e++) m = s[e] > m ? s[e] : m;
            float sum = 0.f;
            for (int64_t e = 0; e < E; e++) {
                s[e] = expf(s[e] - m);
                sum += s[e];
            }
            for (int64_t e = 0; e < E; e++) s[e] = s[e] / sum;
            topk_desc(s, E, kk, sel);
            amb = kk > k && near_tie(s[sel[k - 1]], s[sel[k]]);
            for (int64_t j = 0; j < k; j++) id[j] = sel[j], w[j] = s[sel[j]];
            if (renorm) {
                float ws = 0.f;
                for (int64_t j = 0; j < k; j++) ws += w[j];
                for (int64_t j = 0; j < k; j++) w[j] = w[j] / ws;
            }
        } else {
            for (int64_t e = 0; e < E; e++) {
                s[e] = 1.f / (1.f + expf(-s[e]));
                choice[e] = bias ? s[e] + bias[e] : s[e];
            }
            if (n_group > 1) {
                const int64_t gsz = E / n_group, gk = topk_group < n_group ? topk_group + 1 : topk_group;
                for (int64_t g = 0; g < n_group; g++) {
                    int64_t two[2];
                    topk_desc(choice + g * gsz, gsz, 2, two);
                    gs[g] = choice[g * gsz + two[0]] + choice[g * gsz + two[1]];
                }
                topk_desc(gs, n_group, gk, gsel);
                amb |= gk > topk_group && near_tie(gs[gsel[topk_group - 1]], gs[gsel[topk_group]]);
                for (int64_t g = 0; g < n_group; g++) {
                    int keep = 0;
                    for (int64_t q = 0; q < topk_group; q++) keep |= gsel[q] == g;
                    if (!keep)
                        for (int64_t e = g * gsz; e < (g + 1) * gsz; e++) choice[e] = -INFINITY;
                }
            }
            topk_desc(choice, E, kk, sel);
            amb |= kk > k && near_tie(choice[sel[k - 1]], choice[sel[k]]);
            float ws = 0.f;
            for (int64_t j = 0; j < k; j++) {
                id[j] = sel[j];
                w[j] = s[sel[j]];
                ws += w[j];
            }
            for (int64_t j = 0; j < k; j++) w[j] = (renorm ? w[j] / (ws + 1e-20f) : w[j]) * scale;
        }
        tie[t] = (uint8_t)amb;
        ties += amb;
    }
    return ties;
}

/* ---- expert GEMMs ------------------------------------------------------------------------ */

/* One k step of a panel tile: M rows' values r[m][k] broadcast against the two weight vectors of
 * that step (w0 / w1: 8 features each), into accumulators a0 / a1. */
static inline __attribute__((always_inline)) void panel_step(const float *const *r, const int M, int64_t k, v8f w0,
                                                             v8f w1, v8f *a0, v8f *a1) {
    for (int m = 0; m < M; m++) {
        const float s = r[m][k];
        const v8f sv = {s, s, s, s, s, s, s, s};
        a0[m] = fmadd(w0, sv, a0[m]);
        a1[m] = fmadd(w1, sv, a1[m]);
    }
}

/* Accumulators of M rows r[m] (fp32, length K) against a panel wp of K steps, each `stride`
 * weights (16 features: w0 at +0, w1 at +off): the gate/up tile (stride 2 * P13, off P13: acc0 =
 * gate, acc1 = up) and the down tile (stride P2, off 8: the two halves of the P2 outputs). The
 * accumulators live in registers (locals, stored once at the end: through the output pointers
 * every step would put a store-to-load forward in each FMA chain); at M <= 2 even and odd k go to
 * separate accumulators, so four or more independent FMA chains hide the FMA latency. */
static inline __attribute__((always_inline)) void panel_tile(const float *const *r, const int M, const char *wp,
                                                             const int fmt, int64_t K, const int64_t stride,
                                                             const int64_t off, v8f *acc0, v8f *acc1) {
    const size_t es = elsize(fmt);
    v8f a0[MRP], a1[MRP], b0[MRP], b1[MRP];
    for (int m = 0; m < M; m++) a0[m] = a1[m] = b0[m] = b1[m] = (v8f){0};
    int64_t k = 0;
    if (M <= 2)
        for (; k + 2 <= K; k += 2) {
            const char *p = wp + (size_t)k * stride * es;
            panel_step(r, M, k, load8(p, fmt), load8(p + off * es, fmt), a0, a1);
            panel_step(r, M, k + 1, load8(p + stride * es, fmt), load8(p + (stride + off) * es, fmt), b0, b1);
        }
    for (; k < K; k++) {
        const char *p = wp + (size_t)k * stride * es;
        panel_step(r, M, k, load8(p, fmt), load8(p + off * es, fmt), a0, a1);
    }
    for (int m = 0; m < M; m++) acc0[m] = a0[m] + b0[m], acc1[m] = a1[m] + b1[m];
}

/* gate/up accumulators of M token rows (xr[m]: fp32 rows of length H) against one w13 panel */
static inline __attribute__((always_inline)) void gateup_tile(const float *const *xr, const int M, const char *wp,
                                                              const int fmt, int64_t H, v8f *g, v8f *u) {
    panel_tile(xr, M, wp, fmt, H, 2 * P13, P13, g, u);
}

/* y accumulators (two vectors of P2 / 2) of M rows of h against one w2 panel */
static inline __attribute__((always_inline)) void down_tile(const float *const *hr, const int M, const char *wp,
                                                            const int fmt, int64_t I, v8f *a, v8f *b) {
    panel_tile(hr, M, wp, fmt, I, P2, 8, a, b);
}

/* the (M, fmt) instances the tile loops dispatch to: constants, so the loops above unroll */
#define TILE_FNS(M_)                                                                                      \
    static void gateup_f32_##M_(const float *const *x, const char *w, int64_t H, v8f *g, v8f *u) {      \
        gateup_tile(x, M_, w, MOE_W_F32, H, g, u);                                                        \
    }                                                                                                     \
    static void gateup_bf16_##M_(const float *const *x, const char *w, int64_t H, v8f *g, v8f *u) {     \
        gateup_tile(x, M_, w, MOE_W_BF16, H, g, u);                                                       \
    }                                                                                                     \
    static void down_f32_##M_(const float *const *h, const char *w, int64_t I, v8f *a, v8f *b) {        \
        down_tile(h, M_, w, MOE_W_F32, I, a, b);                                                          \
    }                                                                                                     \
    static void down_bf16_##M_(const float *const *h, const char *w, int64_t I, v8f *a, v8f *b) {       \
        down_tile(h, M_, w, MOE_W_BF16, I, a, b);                                                         \
    }
TILE_FNS(1)
TILE_FNS(2)
TILE_FNS(3)
TILE_FNS(4)
TILE_FNS(5)
TILE_FNS(6)
typedef void (*tile_fn)(const float *const *, const char *, int64_t, v8f *, v8f *);
static const tile_fn GATEUP[2][MRP + 1] = {{0, gateup_f32_1, gateup_f32_2, gateup_f32_3, gateup_f32_4, gateup_f32_5, gateup_f32_6},
                                           {0, gateup_bf16_1, gateup_bf16_2, gateup_bf16_3, gateup_bf16_4, gateup_bf16_5, gateup_bf16_6}};
static const tile_fn DOWN[2][MRP + 1] = {{0, down_f32_1, down_f32_2, down_f32_3, down_f32_4, down_f32_5, down_f32_6},
                                         {0, down_bf16_1, down_bf16_2, down_bf16_3, down_bf16_4, down_bf16_5, down_bf16_6}};

/* ---- MXFP8 tiles: one 16-byte panel row (16 features) per k, block sums scaled per 32 k ---- */

#ifdef MX_X86
/* acc0/acc1 (features 0-7 / 8-15 of the panel) of M rows r[m] (fp32, length K) against an MXFP8
 * panel wp [K][16] with scales sp [K/32][16]: the gate/up tile (acc0 = gate, acc1 = up) and the
 * down tile (two halves of P2 = 16 outputs) are this one loop. */
static inline __attribute__((always_inline)) MX_AVX2 void mx_panel_tile(const float *const *r, const int M,
                                                                        const uint8_t *wp, const uint8_t *sp,
                                                                        int64_t K, v8f *acc0, v8f *acc1) {
    __m256 t0[MR], t1[MR];
    for (int m = 0; m < M; m++) t0[m] = t1[m] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
        /* at M <= 2, odd k into c0/c1: four or more independent FMA chains */
        __m256 b0[MR], b1[MR], c0[MR], c1[MR];
        for (int m = 0; m < M; m++) b0[m] = b1[m] = c0[m] = c1[m] = _mm256_setzero_ps();
        for (int64_t k = kb * MX_BLOCK; k < (kb + 1) * MX_BLOCK; k += M <= 2 ? 2 : 1) {
            __m256 w0, w1;
            mx_decode16(wp + k * 16, &w0, &w1);
            for (int m = 0; m < M; m++) {
                const __m256 xs = _mm256_set1_ps(r[m][k]);
                b0[m] = _mm256_fmadd_ps(w0, xs, b0[m]);
                b1[m] = _mm256_fmadd_ps(w1, xs, b1[m]);
            }
            if (M <= 2) {
                mx_decode16(wp + (k + 1) * 16, &w0, &w1);
                for (int m = 0; m < M; m++) {
                    const __m256 xs = _mm256_set1_ps(r[m][k + 1]);
                    c0[m] = _mm256_fmadd_ps(w0, xs, c0[m]);
                    c1[m] = _mm256_fmadd_ps(w1, xs, c1[m]);
                }
            }
        }
        if (M <= 2)
            for (int m = 0; m < M; m++) b0[m] = _mm256_add_ps(b0[m], c0[m]), b1[m] = _mm256_add_ps(b1[m], c1[m]);
        __m256 f0, p0, f1, p1;
        mx_factors8(sp + kb * 16, &f0, &p0);
        mx_factors8(sp + kb * 16 + 8, &f1, &p1);
        for (int m = 0; m < M; m++) {
            t0[m] = _mm256_fmadd_ps(_mm256_mul_ps(b0[m], p0), f0, t0[m]);
            t1[m] = _mm256_fmadd_ps(_mm256_mul_ps(b1[m], p1), f1, t1[m]);
        }
    }
    for (int m = 0; m < M; m++) {
        memcpy(&acc0[m], &t0[m], sizeof(v8f));
        memcpy(&acc1[m], &t1[m], sizeof(v8f));
    }
}
#define MX_TILE(M_)                                                                                           \
    static MX_AVX2 void mx_tile_##M_(const float *const *r, const uint8_t *wp, const uint8_t *sp, int64_t K, \
                                     v8f *a0, v8f *a1) {                                                     \
        mx_panel_tile(r, M_, wp, sp, K, a0, a1);                                                             \
    }
MX_TILE(1)
MX_TILE(2)
MX_TILE(3)
MX_TILE(4)
typedef void (*mx_tile_fn)(const float *const *, const uint8_t *, const uint8_t *, int64_t, v8f *, v8f *);
static const mx_tile_fn MX_TILES[MR + 1] = {0, mx_tile_1, mx_tile_2, mx_tile_3, mx_tile_4};
#endif

/* ---- bf16 tiles on the bf16 dot instruction (AVX512-BF16): bf16 weights and activations ------ */

#ifdef __AVX512BF16__
#define MOE_DOT_BF16 1
/* Both panel kinds hold 16 features per k (gate|up or 16 outputs). Two k steps are 32 contiguous
 * words [k][16] [k+1][16]; VDPBF16PS wants each feature's two k side by side, so one vpermw puts
 * them in that order (word 2i = (k, i), 2i + 1 = (k + 1, i)) and lane i of the result is feature
 * i. Rows r[m] are bf16 (the activations as they are; h rounded to bf16 where torch rounds it),
 * broadcast a k-pair at a time. Products are exact and sums fp32, as in the widening tiles; only
 * the summation order differs (and the instruction flushes denormal inputs and products). */
static inline __attribute__((always_inline)) void dot_panel_tile(const uint16_t *const *r, const int M, const uint16_t *wp,
                                                                 int64_t K, float out[][16]) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 a[MRP], b[MRP];
    for (int m = 0; m < M; m++) a[m] = b[m] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; 2 * kk + 3 < K; kk += 2) { /* two k-pairs a step: at M <= 2, four or more dot chains */
        const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(wp + 2 * kk * 16));
        const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(wp + (2 * kk + 2) * 16));
        for (int m = 0; m < M; m++) {
            int32_t p0, p1;
            memcpy(&p0, r[m] + 2 * kk, 4);
            memcpy(&p1, r[m] + 2 * kk + 2, 4);
            a[m] = _mm512_dpbf16_ps(a[m], w0, (__m512bh)_mm512_set1_epi32(p0));
            b[m] = _mm512_dpbf16_ps(b[m], w1, (__m512bh)_mm512_set1_epi32(p1));
        }
    }
    for (; 2 * kk + 1 < K; kk++) {
        const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_loadu_si512(wp + 2 * kk * 16));
        for (int m = 0; m < M; m++) {
            int32_t p0;
            memcpy(&p0, r[m] + 2 * kk, 4);
            a[m] = _mm512_dpbf16_ps(a[m], w0, (__m512bh)_mm512_set1_epi32(p0));
        }
    }
    if (K & 1) { /* the last k alone: its 16 weights beside zeros, x[K-1] beside a zero */
        const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(order, _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(wp + (K - 1) * 16))));
        for (int m = 0; m < M; m++) a[m] = _mm512_dpbf16_ps(a[m], w0, (__m512bh)_mm512_set1_epi32((int32_t)r[m][K - 1]));
    }
    for (int m = 0; m < M; m++) _mm512_storeu_ps(out[m], _mm512_add_ps(a[m], b[m]));
}
#define DOT_TILE(M_)                                                                                         \
    static void dot_tile_##M_(const uint16_t *const *r, const uint16_t *wp, int64_t K, float out[][16]) {  \
        dot_panel_tile(r, M_, wp, K, out);                                                                  \
    }
DOT_TILE(1)
DOT_TILE(2)
DOT_TILE(3)
DOT_TILE(4)
DOT_TILE(5)
DOT_TILE(6)
typedef void (*dot_tile_fn)(const uint16_t *const *, const uint16_t *, int64_t, float[][16]);
static const dot_tile_fn DOT_TILES[MRP + 1] = {0, dot_tile_1, dot_tile_2, dot_tile_3, dot_tile_4, dot_tile_5, dot_tile_6};
#endif

static int bf16_dot_on = 1;

/* Let bf16 experts with bf16 activations take the dot tiles where the library has them (1, the
 * default) or the widening tiles (0: tests, A/B timing); returns whether the dot tiles are in use. */
int moe_set_bf16_dot(int on) {
    bf16_dot_on = on != 0;
#ifdef MOE_DOT_BF16
    return bf16_dot_on;
#else
    return 0;
#endif
}

/* The scalar route: the panel dequantized to fp32 [K][16] (exact values), for the fp32 tiles. */
static void mx_panel_dequant(const uint8_t *wp, const uint8_t *sp, int64_t K, float *out) {
    for (int64_t k = 0; k < K; k++)
        for (int c = 0; c < 16; c++) {
            const uint8_t b = sp[(k / MX_BLOCK) * 16 + c];
            float v = mx_e4m3_scaled(wp[k * 16 + c]);
            if (mx_scale_hi(b)) v *= 256.f;
            out[k * 16 + c] = v * mx_scale_factor(b);
        }
}

/* out[t] = sum_j weights[t, j] * W2[ids[t, j]] (silu(G x[t]) * (U x[t])), G/U/W2 of that expert.
 *
 * x: [T, H] rows x_stride apart, dtype x_dtype (fp32/bf16; the computation follows it: bf16 rounds
 * where torch's bf16 path rounds); ids int64 [T, k] in [0, E); weights fp32 [T, k]; w13p / w2p:
 * packed by moe_pack_w13 / moe_pack_w2 in format w_format; w13_scale / w2_scale: MXFP8 block
 * scales (NULL for fp32/bf16); out: [T, H] contiguous, out_dtype.
 * Returns 0; -1 allocation failed; -2 weight format not implemented; -3 an expert id out of range. */
int moe_experts(const void *x, int x_dtype, int64_t x_stride, int64_t T, int64_t H, const int64_t *ids,
                const float *weights, int64_t k, const void *w13p, const void *w2p, int w_format,
                const void *w13_scale, const void *w2_scale, int64_t E, int64_t I, void *out, int out_dtype) {
    if (w_format != MOE_W_F32 && w_format != MOE_W_BF16 && w_format != MOE_W_MXFP8) return -2;
    const int mx = w_format == MOE_W_MXFP8;
    if (mx && (H % MX_BLOCK || I % MX_BLOCK || !w13_scale || !w2_scale)) return -2;
    const int64_t A = T * k;
    if (A == 0) return 0;
    const int bf = x_dtype == DT_BF16, fi = w_format == MOE_W_BF16;
    const int mx_fast = mx && mxfp8_use_fast();
    const int mr = mx ? MR : MRP; /* rows per register tile */
#ifdef MOE_DOT_BF16
    const int dot = bf16_dot_on && bf && fi;
#else
    const int dot = 0;
#endif
    /* the scalar MXFP8 route's per-thread fp32 panel: [max(H, I)][16] */
    const int64_t panel_k = H > I ? H : I;
    const size_t es = elsize(w_format);
    const int64_t np = (I + P13 - 1) / P13, nq = (H + P2 - 1) / P2;
    int64_t *cnt = calloc((size_t)E + 1, sizeof *cnt), *pos = malloc(sizeof *pos * (size_t)E);
    int64_t *sorted = malloc(sizeof *sorted * (size_t)A), *active = malloc(sizeof *active * (size_t)E);
    float *xf = dot ? NULL : malloc(sizeof *xf * (size_t)(T * H)); /* x as fp32 (exact for bf16); the dot tiles read x */
    float *h = malloc(sizeof *h * (size_t)(A * I));    /* silu(gate) * up, rows in expert-sorted order */
    float *ys = malloc(sizeof *ys * (size_t)(A * H));  /* expert outputs, rows in assignment order t*k+j */
    uint16_t *hb = dot ? malloc(sizeof *hb * (size_t)(A * I)) : NULL; /* h in bf16 for the dot tiles */
    int rc = 0;
    float *panels = NULL;
    if (!cnt || !pos || !sorted || !active || (!dot && !xf) || !h || !ys || (dot && !hb)) {
        rc = -1;
        goto done;
    }
    /* counting sort of the assignments by expert, token order kept inside an expert */
    for (int64_t a = 0; a < A; a++) {
        if (ids[a] < 0 || ids[a] >= E) {
            rc = -3;
            goto done;
        }
        cnt[ids[a] + 1]++;
    }
    int64_t nact = 0;
    for (int64_t e = 0; e < E; e++) {
        if (cnt[e + 1]) active[nact++] = e;
        cnt[e + 1] += cnt[e];
        pos[e] = cnt[e];
    }
    for (int64_t a = 0; a < A; a++) sorted[pos[ids[a]]++] = a;

    /* x as fp32 once (exact for bf16); in parallel only when it is big enough to pay a fork */
#pragma omp parallel for schedule(static) if (T * H >= (1 << 18))
    for (int64_t t = 0; t < (dot ? 0 : T); t++)
        for (int64_t c = 0; c < H; c++)
            xf[t * H + c] = bf ? bf16_to_f32(((const uint16_t *)x)[t * x_stride + c]) : ((const float *)x)[t * x_stride + c];
    /* the scalar MXFP8 route's fp32 panels, one per thread, allocated before the parallel region so
     * it needs no barrier to agree on a failed allocation */
    const int nthreads = omp_get_max_threads();
    panels = mx && !mx_fast ? malloc(sizeof(float) * (size_t)(panel_k * 16) * (size_t)nthreads) : NULL;
    if (mx && !mx_fast && !panels) {
        rc = -1;
        goto done;
    }
    /* One parallel region with one barrier (between the two stages): on a machine shared with
     * other busy processes every barrier can wait a whole scheduler slice for a descheduled
     * thread, so the stages are arranged to need no more. */
    /* every active expert holds at most one register tile of rows (decode): stage-1 items cost the same */
    int uniform = 1;
    for (int64_t ai = 0; ai < nact; ai++) uniform &= cnt[active[ai] + 1] - cnt[active[ai]] <= mr;
    int64_t claim = 0; /* stage 1's next item when items go out dynamically */
#pragma omp parallel num_threads(nthreads)
    {
        float *panel = panels ? panels + (size_t)omp_get_thread_num() * (size_t)(panel_k * 16) : NULL;
        /* stage 1: h = silu(x G^T) * (x U^T), one item per (active expert, panel) */
        /* a thread's items: when every active expert has at most one register tile of rows
         * (decode) the items cost the same, and a static split into contiguous ranges makes each
         * thread read long sequential stretches of the packed weights (one expert's panels are
         * adjacent), which the hardware prefetchers stream far better than 16 KB pieces handed
         * out alternately; otherwise items go out dynamically */
        const int nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t n1 = nact * np;
        int64_t next = uniform ? n1 * me / nth : 0;
        const int64_t end1 = uniform ? n1 * (me + 1) / nth : n1;
        for (;;) {
            int64_t it;
            if (uniform) {
                if (next >= end1) break;
                it = next++;
            } else {
#pragma omp atomic capture
                it = claim++;
                if (it >= n1) break;
            }
            const int64_t e = active[it / np], p = it % np;
            const char *wp = (const char *)w13p + (size_t)((e * np + p) * H * 2 * P13) * es;
            const uint8_t *sp = mx ? (const uint8_t *)w13_scale + (size_t)((e * np + p) * (H / MX_BLOCK) * 2 * P13) : NULL;
            if (mx && !mx_fast) mx_panel_dequant((const uint8_t *)wp, sp, H, panel);
            for (int64_t r0 = cnt[e]; r0 < cnt[e + 1]; r0 += mr) {
                const int M = cnt[e + 1] - r0 < mr ? (int)(cnt[e + 1] - r0) : mr;
                const float *xr[MRP];
                for (int m = 0; m < M && !dot; m++) xr[m] = xf + (sorted[r0 + m] / k) * H;
                v8f g[MRP], u[MRP];
#ifdef MOE_DOT_BF16
                if (dot) {
                    const uint16_t *xb[MRP];
                    for (int m = 0; m < M; m++) xb[m] = (const uint16_t *)x + (sorted[r0 + m] / k) * x_stride;
                    float gu[MRP][16]; /* lanes 0-7 gate, 8-15 up */
                    DOT_TILES[M](xb, (const uint16_t *)wp, H, gu);
                    for (int m = 0; m < M; m++) memcpy(&g[m], gu[m], sizeof(v8f)), memcpy(&u[m], gu[m] + 8, sizeof(v8f));
                } else
#endif
#ifdef MX_X86
                if (mx_fast) MX_TILES[M](xr, (const uint8_t *)wp, sp, H, g, u);
                else
#endif
                if (mx) GATEUP[0][M](xr, (const char *)panel, H, g, u);
                else GATEUP[fi][M](xr, wp, H, g, u);
                const int nc = I - p * P13 < P13 ? (int)(I - p * P13) : P13; /* features of this panel */
                for (int m = 0; m < M; m++) {
                    float *hm = h + (r0 + m) * I + p * P13;
#ifdef MOE_VEC_EPILOGUE
                    float hv[P13];
                    __m256 gv, uv;
                    memcpy(&gv, &g[m], sizeof gv);
                    memcpy(&uv, &u[m], sizeof uv);
                    _mm256_storeu_ps(hv, swiglu8(gv, uv, bf));
                    memcpy(hm, hv, sizeof(float) * (size_t)nc);
#else
                    for (int c = 0; c < nc; c++) {
                        const float gv = rnd(g[m][c], bf), uv = rnd(u[m][c], bf);
                        const float sv = rnd(gv / (1.f + expf(-gv)), bf);
                        hm[c] = rnd(sv * uv, bf);
                    }
#endif
                    if (dot)
                        for (int c = 0; c < nc; c++) hb[(r0 + m) * I + p * P13 + c] = f32_to_bf16(hm[c]); /* exact */
                }
            }
        }
#pragma omp barrier
        /* stage 2 + combine: each thread owns a contiguous range of output panels [q0, q1):
         * ys[a][its columns] = h[a] W2^T for every active expert, expert by expert (one expert's
         * panels of the range are adjacent in w2p, so this too is one sequential stretch per
         * expert), then each token's k rows of those columns summed in slot order (fp32 products
         * and sums). The thread owns its columns for every token, so the combine needs no
         * barrier; each expert's w2 panel is still read once. */
        const int64_t q0 = nq * me / nth, q1 = nq * (me + 1) / nth;
        for (int64_t ai = 0; ai < nact; ai++) {
            const int64_t e = active[ai];
            for (int64_t q = q0; q < q1; q++) {
                const char *wp = (const char *)w2p + (size_t)((e * nq + q) * I * P2) * es;
                const uint8_t *sp = mx ? (const uint8_t *)w2_scale + (size_t)((e * nq + q) * (I / MX_BLOCK) * P2) : NULL;
                if (mx && !mx_fast) mx_panel_dequant((const uint8_t *)wp, sp, I, panel);
                for (int64_t r0 = cnt[e]; r0 < cnt[e + 1]; r0 += mr) {
                    const int M = cnt[e + 1] - r0 < mr ? (int)(cnt[e + 1] - r0) : mr;
                    const float *hr[MRP];
                    for (int m = 0; m < M; m++) hr[m] = h + (r0 + m) * I;
                    v8f a0[MRP], a1[MRP];
#ifdef MOE_DOT_BF16
                    if (dot) {
                        const uint16_t *hbr[MRP];
                        for (int m = 0; m < M; m++) hbr[m] = hb + (r0 + m) * I;
                        float o[MRP][16];
                        DOT_TILES[M](hbr, (const uint16_t *)wp, I, o);
                        for (int m = 0; m < M; m++) memcpy(&a0[m], o[m], sizeof(v8f)), memcpy(&a1[m], o[m] + 8, sizeof(v8f));
                    } else
#endif
#ifdef MX_X86
                    if (mx_fast) MX_TILES[M](hr, (const uint8_t *)wp, sp, I, a0, a1);
                    else
#endif
                    if (mx) DOWN[0][M](hr, (const char *)panel, I, a0, a1);
                    else DOWN[fi][M](hr, wp, I, a0, a1);
                    for (int m = 0; m < M; m++) {
                        float *y = ys + sorted[r0 + m] * H;
                        for (int c = 0; c < P2 && q * P2 + c < H; c++) y[q * P2 + c] = rnd(c < 8 ? a0[m][c] : a1[m][c - 8], bf);
                    }
                }
            }
        }
        const int64_t c0 = q0 * P2, c1 = q1 * P2 < H ? q1 * P2 : H;
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = c0; c < c1; c++) {
                float s = 0.f;
                for (int64_t j = 0; j < k; j++) {
                    const float pr = ys[(t * k + j) * H + c] * weights[t * k + j];
                    s += pr;
                }
                if (out_dtype == DT_BF16) ((uint16_t *)out)[t * H + c] = f32_to_bf16(s);
                else ((float *)out)[t * H + c] = s;
            }
    }
done:
    free(panels);
    free(cnt), free(pos), free(sorted), free(active), free(xf), free(h), free(ys), free(hb);
    return rc;
}
