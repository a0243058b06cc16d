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
 * The weight format is a per-call code (moe_experts' w_format): MOE_W_F32, MOE_W_BF16, MOE_W_MXFP8,
 * and MOE_W_BF16_DOT: bf16 in packed_gemm.c's k-pair order, 64 features a panel, for the AVX512-BF16
 * dot tiles (layout and why below, at moe_pack_dot_w13; run by experts_dot).
 * MXFP8 panels (moe_pack_mx_w13 / moe_pack_mx_w2) keep the same order with one E4M3 byte per
 * weight, so one k of a panel is 16 bytes = one 16-byte load decoded in registers (mxfp8.h), and
 * the E8M0 block scales are packed alongside: per block of 32 k, the panel's 16 features' scale
 * bytes side by side (s13p[e][p][kb][c], s2p[e][q][kb][c]). The tile sums 32 k into block
 * accumulators and multiplies them by the 16 features' factors once per block (as mxfp8_gemm.c's
 * decode loop does), so the weight bytes are read once, 8.25 bits each; a one-token tile on AVX2
 * (not batch-invariant) instead dequantizes each k's 16 weights in registers by placing their
 * bits (mxfp8.h) and sums them straight into four chains. Without AVX2/F16C (or
 * with mxfp8_set_fast_path(0)) a panel is dequantized to fp32 and the fp32 tile runs on it.
 *
 * Numerics follow the torch expert path (moe/experts_torch.py): fp32 accumulation; with bf16
 * activations the GEMM outputs, silu and the product are rounded to bf16 where torch rounds them,
 * so the two differ only by summation order; the combine sums the top-k rows in slot order in fp32.
 *
 * gpt-oss's experts (moe_experts_ep): per-expert biases added to the GEMM outputs (b13 [E, 2I],
 * gate then up; b2 [E, H]; in the activations' dtype) and its clamped SwiGLU,
 * (min(u, L) clamped at -L, plus 1) * g' sigmoid(alpha g') with g' = min(g, L), both in the
 * epilogues, rounded where torch's bf16 ops round. The widening formats only (F32, BF16, MXFP8):
 * the Python side packs such layers in them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dot_bf16.h"
#include "dtypes.h"
#include "mxfp8.h"
#include "vec_exp.h"

enum { MOE_W_F32 = 0, MOE_W_BF16 = 1, MOE_W_MXFP8 = 2, MOE_W_BF16_DOT = 3, MOE_W_MXFP8_DOT = 4 };

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

/* gpt-oss's activation on 8 lanes, each op rounded where torch's bf16 ops round (g, u already
 * are): g' = min(g, L), u' = clamp(u, -L, L), (u' + 1) * (g' * sigmoid(alpha g')) */
static inline __attribute__((always_inline)) __m256 clamped8(__m256 g, __m256 u, float alpha, float limit, int bf16) {
    g = rnd8(_mm256_min_ps(g, _mm256_set1_ps(limit)), bf16);
    u = rnd8(_mm256_max_ps(_mm256_min_ps(u, _mm256_set1_ps(limit)), _mm256_set1_ps(-limit)), bf16);
    const __m256 ga = rnd8(_mm256_mul_ps(g, _mm256_set1_ps(alpha)), bf16);
    const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), ga), _mm256_set1_ps(88.f)));
    const __m256 sg = rnd8(_mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e)), bf16);
    const __m256 gl = rnd8(_mm256_mul_ps(g, sg), bf16);
    const __m256 u1 = rnd8(_mm256_add_ps(u, _mm256_set1_ps(1.f)), bf16);
    return rnd8(_mm256_mul_ps(u1, gl), bf16);
}
#endif

/* the epilogue spec of moe_experts_ep (NULL biases and act 0: silu(gate) * up, no biases) */
typedef struct {
    const void *b13, *b2; /* in the activations' dtype */
    int act;              /* 0 silu(g) * u; 1 gpt-oss's clamped SwiGLU */
    float alpha, limit;
} epilogue_t;

static inline float bias_at(const void *b, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)b)[i]) : ((const float *)b)[i];
}

/* one feature's stage-1 epilogue, scalar: what the vector epilogues compute, lane by lane */
static inline float epilogue1(float g, float u, float bg, float bu, const epilogue_t *ep, int bf) {
    g = rnd(g, bf), u = rnd(u, bf);
    if (ep->b13) g = rnd(g + bg, bf), u = rnd(u + bu, bf);
    if (ep->act == 1) {
        g = rnd(fminf(g, ep->limit), bf);
        u = rnd(fmaxf(fminf(u, ep->limit), -ep->limit), bf);
        const float sg = rnd(1.f / (1.f + expf(-rnd(g * ep->alpha, bf))), bf);
        return rnd(rnd(u + 1.f, bf) * rnd(g * sg, bf), bf);
    }
    const float sv = rnd(g / (1.f + expf(-g)), bf);
    return rnd(sv * u, bf);
}

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

/* The group rule of both routers: keep the topk_group groups of highest score gs[g] (n_group groups
 * of gsz experts), set every value v of the other groups to `fill`; returns whether the cut between
 * kept and dropped groups is a near-tie. gsel: room for topk_group + 1 indices. */
static int keep_groups(float *v, const float *gs, int64_t n_group, int64_t topk_group, int64_t gsz, float fill, int64_t *gsel) {
    const int64_t gk = topk_group < n_group ? topk_group + 1 : topk_group;
    topk_desc(gs, n_group, gk, gsel);
    for (int64_t g = 0; g < n_group; g++) {
        int keep = 0;
        for (int64_t q = 0; q < topk_group; q++) keep |= gsel[q] == g;
        if (!keep)
            for (int64_t e = g * gsz; e < (g + 1) * gsz; e++) v[e] = fill;
    }
    return gk > topk_group && near_tie(gs[gsel[topk_group - 1]], gs[gsel[topk_group]]);
}

/* logits [T, E] (fp32 or bf16) -> weights fp32 [T, k], ids int64 [T, k], tie[T] (1: a near-tie at
 * a selection cut, see near_tie; that token's result must be taken from the torch router).
 * scoring 0: softmax (fp32); with n_group > 1 (DeepSeek-V2's group_limited_greedy) only the
 * topk_group groups of highest max score keep theirs (the rest 0, as torch masks them) -> top-k ->
 * divide by their sum if renorm -> times scale.
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
            if (n_group > 1) {
                const int64_t gsz = E / n_group;
                for (int64_t g = 0; g < n_group; g++) {
                    float gm = s[g * gsz];
                    for (int64_t e = g * gsz + 1; e < (g + 1) * gsz; e++) gm = s[e] > gm ? s[e] : gm;
                    gs[g] = gm;
                }
                amb |= keep_groups(s, gs, n_group, topk_group, gsz, 0.f, gsel); /* (torch masks with 0 here) */
            }
            topk_desc(s, E, kk, sel);
            amb |= kk > k && near_tie(s[sel[k - 1]], s[sel[k]]);
            for (int64_t j = 0; j < k; j++) id[j] = sel[j], w[j] = s[sel[j]];
            if (renorm) {
                float ws = 0.f;
                for (int64_t j = 0; j < k; j++) ws += w[j];
                for (int64_t j = 0; j < k; j++) w[j] = w[j] / ws;
            }
            if (scale != 1.f)
                for (int64_t j = 0; j < k; j++) w[j] = w[j] * scale;
        } else {
            for (int64_t e = 0; e < E; e++) {
                s[e] = 1.f / (1.f + expf(-s[e]));
                choice[e] = bias ? s[e] + bias[e] : s[e];
            }
            if (n_group > 1) {
                const int64_t gsz = E / n_group;
                for (int64_t g = 0; g < n_group; g++) {
                    int64_t two[2];
                    topk_desc(choice + g * gsz, gsz, 2, two);
                    gs[g] = choice[g * gsz + two[0]] + choice[g * gsz + two[1]];
                }
                amb |= keep_groups(choice, gs, n_group, topk_group, gsz, -INFINITY, gsel);
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
 * every step would put a store-to-load forward in each FMA chain); at M <= 2 with `split` even and
 * odd k go to separate accumulators, so four or more independent FMA chains hide the FMA latency.
 * The split changes a row's summation order with the tile's height, so a batch-invariant call
 * (`invariant` of moe_experts) passes split = 0: every row then sums in one order whatever M. */
static inline __attribute__((always_inline)) void panel_tile(const float *const *r, const int M, const char *wp,
                                                             const int fmt, int64_t K, const int64_t stride,
                                                             const int64_t off, const int split, v8f *acc0, v8f *acc1) {
    const size_t es = elsize(fmt);
    v8f a0[MRP], a1[MRP], b0[MRP], b1[MRP];
    for (int m = 0; m < M; m++) a0[m] = a1[m] = b0[m] = b1[m] = (v8f){0};
    int64_t k = 0;
    if (M <= 2 && split)
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
                                                              const int fmt, int64_t H, int split, v8f *g, v8f *u) {
    panel_tile(xr, M, wp, fmt, H, 2 * P13, P13, split, g, u);
}

/* y accumulators (two vectors of P2 / 2) of M rows of h against one w2 panel */
static inline __attribute__((always_inline)) void down_tile(const float *const *hr, const int M, const char *wp,
                                                            const int fmt, int64_t I, int split, v8f *a, v8f *b) {
    panel_tile(hr, M, wp, fmt, I, P2, 8, split, a, b);
}

/* the (M, fmt) instances the tile loops dispatch to: constants, so the loops above unroll */
#define TILE_FNS(M_)                                                                                           \
    static void gateup_f32_##M_(const float *const *x, const char *w, int64_t H, int split, v8f *g, v8f *u) {  \
        gateup_tile(x, M_, w, MOE_W_F32, H, split, g, u);                                                      \
    }                                                                                                          \
    static void gateup_bf16_##M_(const float *const *x, const char *w, int64_t H, int split, v8f *g, v8f *u) { \
        gateup_tile(x, M_, w, MOE_W_BF16, H, split, g, u);                                                     \
    }                                                                                                          \
    static void down_f32_##M_(const float *const *h, const char *w, int64_t I, int split, v8f *a, v8f *b) {    \
        down_tile(h, M_, w, MOE_W_F32, I, split, a, b);                                                        \
    }                                                                                                          \
    static void down_bf16_##M_(const float *const *h, const char *w, int64_t I, int split, v8f *a, v8f *b) {   \
        down_tile(h, M_, w, MOE_W_BF16, I, split, a, b);                                                       \
    }
TILE_FNS(1)
TILE_FNS(2)
TILE_FNS(3)
TILE_FNS(4)
TILE_FNS(5)
TILE_FNS(6)
typedef void (*tile_fn)(const float *const *, const char *, int64_t, int, v8f *, v8f *);
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
                                                                        int64_t K, const int split, v8f *acc0, v8f *acc1) {
    __m256 t0[MR], t1[MR];
    for (int m = 0; m < M; m++) t0[m] = t1[m] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
        /* at M <= 2 with `split` (panel_tile's), odd k into c0/c1: four or more independent FMA chains */
        __m256 b0[MR], b1[MR], c0[MR], c1[MR];
        for (int m = 0; m < M; m++) b0[m] = b1[m] = c0[m] = c1[m] = _mm256_setzero_ps();
        for (int64_t k = kb * MX_BLOCK; k < (kb + 1) * MX_BLOCK; k += M <= 2 && split ? 2 : 1) {
            __m256 w0, w1;
            mx_decode16(wp + k * 16, &w0, &w1);
            for (int m = 0; m < M; m++) {
                const __m256 xs = _mm256_set1_ps(r[m][k]);
                b0[m] = _mm256_fmadd_ps(w0, xs, b0[m]);
                b1[m] = _mm256_fmadd_ps(w1, xs, b1[m]);
            }
            if (M <= 2 && split) {
                mx_decode16(wp + (k + 1) * 16, &w0, &w1);
                for (int m = 0; m < M; m++) {
                    const __m256 xs = _mm256_set1_ps(r[m][k + 1]);
                    c0[m] = _mm256_fmadd_ps(w0, xs, c0[m]);
                    c1[m] = _mm256_fmadd_ps(w1, xs, c1[m]);
                }
            }
        }
        if (M <= 2 && split)
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

/* One row's block kb of a panel on the fp16 route (any scale byte), the block sums scaled by the
 * features' factors and added to a (features 0-7) and b (8-15): the one-row tiles' blocks whose
 * scale bytes the placed decode cannot take. */
static inline __attribute__((always_inline)) MX_AVX2 void mx_panel_block_fp16(const float *r, const uint8_t *wp,
                                                                              const uint8_t *s, int64_t kb,
                                                                              __m256 *a, __m256 *b) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t k = kb * MX_BLOCK; k < (kb + 1) * MX_BLOCK; k++) {
        __m256 w0, w1;
        mx_decode16(wp + k * 16, &w0, &w1);
        const __m256 xs = _mm256_broadcast_ss(r + k);
        s0 = _mm256_fmadd_ps(w0, xs, s0);
        s1 = _mm256_fmadd_ps(w1, xs, s1);
    }
    __m256 f0, p0, f1, p1;
    mx_factors8(s, &f0, &p0);
    mx_factors8(s + 8, &f1, &p1);
    *a = _mm256_fmadd_ps(_mm256_mul_ps(s0, p0), f0, *a);
    *b = _mm256_fmadd_ps(_mm256_mul_ps(s1, p1), f1, *b);
}

/* M = 1 with `split`: mx_panel_tile's one-row counterpart on mxfp8.h's placed decode: each k's 16
 * elements dequantized with their features' factors 2^(b - 7) and summed into four chains per half
 * (k mod 4), no block sums; a block whose 16 scale bytes are not all <= MX_PLACED_MAX_B takes the
 * block-sum route. Another summation order than the M-row tile, so it runs only where that is
 * allowed (`split`, off under the batch-invariant switch). moe_experts takes mx_panel_row_sums
 * below instead where it expanded the row (1.07-1.36x faster, docs/moe.md); this one serves stage
 * 1 past ROW_SUMS_MAX_T tokens. */
static MX_AVX2 void mx_panel_row_placed(const float *r, const uint8_t *wp, const uint8_t *sp, int64_t K, v8f *acc0, v8f *acc1) {
    const __m256i lo = mx_placed_lo(), hi = mx_placed_hi();
    __m256 a[4], b[4];
    for (int j = 0; j < 4; j++) a[j] = b[j] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
        const uint8_t *s = sp + kb * 16;
        if (__builtin_expect(mx_placed_ok16(s), 1)) {
            const __m256 f0 = mx_placed_factors8(s), f1 = mx_placed_factors8(s + 8);
            for (int64_t k = kb * MX_BLOCK; k < (kb + 1) * MX_BLOCK; k += 4)
                for (int j = 0; j < 4; j++) {
                    const __m256i q = mx_placed_src(wp + (k + j) * 16);
                    const __m256 xs = _mm256_broadcast_ss(r + k + j);
                    a[j] = _mm256_fmadd_ps(mx_placed8(q, lo, f0), xs, a[j]);
                    b[j] = _mm256_fmadd_ps(mx_placed8(q, hi, f1), xs, b[j]);
                }
        } else {
            mx_panel_block_fp16(r, wp, s, kb, &a[0], &b[0]);
        }
    }
    const __m256 t0 = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
    const __m256 t1 = _mm256_add_ps(_mm256_add_ps(b[0], b[1]), _mm256_add_ps(b[2], b[3]));
    memcpy(acc0, &t0, sizeof(v8f));
    memcpy(acc1, &t1, sizeof(v8f));
}

/* The one-row tile on block sums (mx_panel_row_sums), used in place of mx_panel_row_placed where
 * the row was expanded first: a panel's k-pair (2 k x 16 features) is 32 contiguous bytes, which
 * mx_placed32 places as fp32 bits without multiplying (v[j] lane i: byte 4 i + j, so lanes 0-3 hold
 * features j, 4 + j, 8 + j, 12 + j of the even k and lanes 4-7 the same features of the odd k).
 * One multiply-add a register with the pair's x vector (x[2p] in lanes 0-3, x[2p+1] in lanes 4-7)
 * sums the pair; a block's sums (16 pairs, two chains) are scaled once by the features' factors.
 * Like the dense placed loop (mxfp8_gemm.c), the placed elements are element x 2^-120, so x is
 * scaled by 2^ks (mx_placed_shift of the row's max |x|) and the factors are 2^(b - 7 - ks): exact
 * power-of-two scaling, fp32 products and sums in this tile's order. Blocks with a scale byte above
 * MX_PLACED_MAX_B take the fp16 route with the unscaled row, in feature order. */

#define ROW_SUMS_MAX_T 16 /* tokens whose rows moe_experts expands up front for the one-row tiles */
#define ROW_SUMS_PREFETCH 2048 /* bytes ahead of the tile's reads that it prefetches */

/* row r [K] -> xe [4 K]: pair p's 8 floats [r[2p] x 4, r[2p + 1] x 4], times 2^ks; returns ks */
static int mx_pairs_expand(const float *r, int64_t K, float *xe) {
    const int ks = mx_placed_shift(mx_amax(r, K));
    const float sc = mx_bits_f32((uint32_t)(127 + ks) << 23);
    for (int64_t p = 0; p < K / 2; p++)
        for (int i = 0; i < 8; i++) xe[8 * p + i] = r[2 * p + (i >> 2)] * sc;
    return ks;
}

/* the factors 2^(b - 7 - ks) of a block's 16 scale bytes (all <= MX_PLACED_MAX_B) in the order of
 * mx_placed32's registers: f[j] lane i is feature 4 (i mod 4) + j's */
static inline __attribute__((always_inline)) MX_AVX2 void mx_pair_factors(const uint8_t *s, int ks, __m256 f[4]) {
    /* dword j of t: the scale bytes of features j, 4 + j, 8 + j, 12 + j */
    const __m128i t = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)s),
                                       _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m256i add = _mm256_set1_epi32(120 - ks);
    const __m128i d[4] = {_mm_shuffle_epi32(t, 0x00), _mm_shuffle_epi32(t, 0x55), _mm_shuffle_epi32(t, 0xAA),
                          _mm_shuffle_epi32(t, 0xFF)};
    for (int j = 0; j < 4; j++)
        f[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtepu8_epi32(d[j]), add), 23));
}

static MX_AVX2 void mx_panel_row_sums(const float *xe, int ks, const float *r, const uint8_t *wp, const uint8_t *sp,
                                      int64_t K, v8f *acc0, v8f *acc1) {
    __m256 tot[4], fa0 = _mm256_setzero_ps(), fa1 = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) tot[j] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
        const uint8_t *s = sp + kb * 16;
        if (__builtin_expect(mx_placed_ok16(s), 1)) {
            const uint8_t *w = wp + kb * MX_BLOCK * 16;
            const float *x = xe + kb * MX_BLOCK * 4;
            __m256 a[4], c[4], v[4];
            for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_ps();
            for (int q = 0; q < MX_BLOCK / 2; q += 2) {
                /* a cache line a step, ROW_SUMS_PREFETCH ahead: into the panel's next blocks, then the
                 * next panel (a thread's items are adjacent panels) */
                _mm_prefetch((const char *)(w + q * 32 + ROW_SUMS_PREFETCH), _MM_HINT_T0);
                mx_placed32(w + q * 32, v);
                const __m256 x0 = _mm256_loadu_ps(x + q * 8);
                for (int j = 0; j < 4; j++) a[j] = _mm256_fmadd_ps(v[j], x0, a[j]);
                mx_placed32(w + (q + 1) * 32, v);
                const __m256 x1 = _mm256_loadu_ps(x + (q + 1) * 8);
                for (int j = 0; j < 4; j++) c[j] = _mm256_fmadd_ps(v[j], x1, c[j]);
            }
            __m256 f[4];
            mx_pair_factors(s, ks, f);
            for (int j = 0; j < 4; j++) tot[j] = _mm256_fmadd_ps(_mm256_add_ps(a[j], c[j]), f[j], tot[j]);
        } else {
            mx_panel_block_fp16(r, wp, s, kb, &fa0, &fa1);
        }
    }
    /* feature 4 i + j: lane i (even k) + lane i + 4 (odd k) of tot[j] */
    float t[4][8], o[16];
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(t[j], tot[j]);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) o[4 * i + j] = t[j][i] + t[j][i + 4];
    const __m256 r0 = _mm256_add_ps(_mm256_loadu_ps(o), fa0), r1 = _mm256_add_ps(_mm256_loadu_ps(o + 8), fa1);
    memcpy(acc0, &r0, sizeof(v8f));
    memcpy(acc1, &r1, sizeof(v8f));
}


#define MX_TILE(M_)                                                                                           \
    static MX_AVX2 void mx_tile_##M_(const float *const *r, const uint8_t *wp, const uint8_t *sp, int64_t K, \
                                     int split, v8f *a0, v8f *a1) {                                          \
        if (M_ == 1 && split && mxfp8_placed_on()) mx_panel_row_placed(r[0], wp, sp, K, a0, a1);            \
        else mx_panel_tile(r, M_, wp, sp, K, split, a0, a1);                                                 \
    }
MX_TILE(1)
MX_TILE(2)
MX_TILE(3)
MX_TILE(4)
typedef void (*mx_tile_fn)(const float *const *, const uint8_t *, const uint8_t *, int64_t, int, v8f *, v8f *);
static const mx_tile_fn MX_TILES[MR + 1] = {0, mx_tile_1, mx_tile_2, mx_tile_3, mx_tile_4};
#endif

/* ---- bf16 tiles on the bf16 dot instruction (AVX512-BF16): the MOE_W_BF16_DOT layout ------- */

/* The dot layout (moe_pack_dot_w13 / moe_pack_dot_w2) is packed_gemm.c's: panels of DP = 64
 * features, k-pairs in order, each k-pair the 64 features' two bf16 weights side by side,
 *     w13d[e][g][kk][c][j]: c < 32 the gate row 32 g + c, c >= 32 the up row 32 g + c - 32, k = 2 kk + j
 *     w2d[e][q][kk][c][j]:  the w2 row 64 q + c, k = 2 kk + j
 * (zero past I, H and K). One k-pair of a panel is 4 zmm that VDPBF16PS takes as they are, against
 * a row's two values of that k-pair broadcast: a 6-row x 64-feature tile holds 24 accumulators and
 * each broadcast feeds 4 dot instructions (the 16-feature panels of the widening tiles fed one,
 * after a word permutation, and left the experts at ~40 % of the dense GEMM's rate). The gate and
 * up of 32 features end in the same tile, so silu * up is still the stage-1 epilogue. */
#define DP DOT_PANEL

int64_t moe_dot_w13_numel(int64_t E, int64_t I, int64_t H) { return E * ((I + 31) / 32) * ((H + 1) / 2) * 2 * DP; }
int64_t moe_dot_w2_numel(int64_t E, int64_t H, int64_t I) { return E * ((H + DP - 1) / DP) * ((I + 1) / 2) * 2 * DP; }

/* The weight row (of N rows of one expert) at feature c of dot panel p, or -1 for padding; gated:
 * w13 (N = 2I: 32 gate rows of the panel's 32 intermediate features, then their up rows). */
static inline int64_t dot_row(int gated, int64_t N, int64_t p, int64_t c) {
    if (gated) {
        const int64_t I = N / 2, f = 32 * p + c % 32; /* intermediate feature */
        return f < I ? (c < 32 ? f : I + f) : -1;
    }
    return DP * p + c < N ? DP * p + c : -1;
}

/* w [E, N, K] bf16 -> np panels per expert of the dot layout; gated: w13 (N = 2I, gate/up halves) */
static void pack_dot(const uint16_t *w, int64_t E, int64_t N, int64_t np, int64_t K, int gated, uint16_t *out) {
    const int64_t kp = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t ep = 0; ep < E * np; ep++) {
        const int64_t e = ep / np, p = ep % np;
        uint16_t *dst = out + (size_t)ep * (size_t)kp * 2 * DP;
        for (int64_t c = 0; c < DP; c++) {
            const int64_t row = dot_row(gated, N, p, c);
            const uint16_t *src = row >= 0 ? w + ((size_t)e * N + row) * K : NULL;
            for (int64_t kk = 0; kk < kp; kk++) {
                dst[(kk * DP + c) * 2] = src ? src[2 * kk] : 0;
                dst[(kk * DP + c) * 2 + 1] = src && 2 * kk + 1 < K ? src[2 * kk + 1] : 0;
            }
        }
    }
}

/* w13 [E, 2I, H] bf16 -> moe_dot_w13_numel elements; w2 [E, H, I] bf16 -> moe_dot_w2_numel. A pure
 * permutation: it needs no AVX512-BF16, only moe_experts on this format does. */
int moe_pack_dot_w13(const uint16_t *w, int64_t E, int64_t I, int64_t H, uint16_t *out) {
    pack_dot(w, E, 2 * I, (I + 31) / 32, H, 1, out);
    return 0;
}

int moe_pack_dot_w2(const uint16_t *w, int64_t E, int64_t H, int64_t I, uint16_t *out) {
    pack_dot(w, E, H, (H + DP - 1) / DP, I, 0, out);
    return 0;
}

/* MOE_W_MXFP8_DOT: the same panels and k-pairs with one E4M3 byte per weight, and the E8M0
 * scales per panel as [K/32][64] (the panel's 64 features' scale bytes of each block). Within a
 * k-pair's 128 bytes, each half (features 0-31 / 32-63) is permuted so that mx_decode64_bf16's
 * two unpacks (mxfp8.h) return features 0-15 and 16-31 already in the dot order: byte
 * 16 (w / 8) + w % 8 (+ 8 for the second 16 features) holds word w = 2 f + j of its 16. Packed
 * only where every scale byte is in mxfp8.h's safe range: then one exponent add per word makes
 * the exact scaled bf16 weight and the panel runs on the bf16 dot tiles. */
static inline int64_t mx_dot_pos(int64_t f, int64_t j) {
    const int64_t w = 2 * (f % 16) + j;
    return 16 * (w / 8) + w % 8 + (f >= 16 ? 8 : 0);
}

static void pack_mx_dot(const uint8_t *w, const uint8_t *sc, int64_t E, int64_t N, int64_t np, int64_t K, int gated,
                        uint8_t *out, uint8_t *out_s) {
    const int64_t kp = K / 2, KB = K / MX_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t ep = 0; ep < E * np; ep++) {
        const int64_t e = ep / np, p = ep % np;
        uint8_t *dst = out + (size_t)ep * (size_t)kp * 2 * DP, *dst_s = out_s + (size_t)ep * (size_t)KB * DP;
        for (int64_t c = 0; c < DP; c++) {
            const int64_t row = dot_row(gated, N, p, c);
            const uint8_t *src = row >= 0 ? w + ((size_t)e * N + row) * K : NULL;
            const int64_t half = c / 32, f = c % 32;
            for (int64_t kk = 0; kk < kp; kk++)
                for (int64_t j = 0; j < 2; j++) dst[kk * 2 * DP + half * DP + mx_dot_pos(f, j)] = src ? src[2 * kk + j] : 0;
            for (int64_t kb = 0; kb < KB; kb++) /* a padding row: zeros under a unit scale */
                dst_s[kb * DP + c] = src ? sc[((size_t)e * N + row) * KB + kb] : 127;
        }
    }
}

/* MXFP8 w13 (data [E, 2I, H], scale [E, 2I, H/32]) / w2 (data [E, H, I], scale [E, H, I/32]) ->
 * moe_dot_w13_numel / moe_dot_w2_numel bytes and a 32nd of that in scale bytes. -2: K % 32. */
int moe_pack_mx_dot_w13(const uint8_t *data, const uint8_t *scale, int64_t E, int64_t I, int64_t H, uint8_t *out,
                        uint8_t *out_scale) {
    if (H % MX_BLOCK) return -2;
    pack_mx_dot(data, scale, E, 2 * I, (I + 31) / 32, H, 1, out, out_scale);
    return 0;
}

int moe_pack_mx_dot_w2(const uint8_t *data, const uint8_t *scale, int64_t E, int64_t H, int64_t I, uint8_t *out,
                       uint8_t *out_scale) {
    if (I % MX_BLOCK) return -2;
    pack_mx_dot(data, scale, E, H, (H + DP - 1) / DP, I, 0, out, out_scale);
    return 0;
}

#ifdef __AVX512BF16__
#define MOE_DOT_BF16 1
/* out[m][0..63] = the 64 features of one dot-layout panel wp against M bf16 rows r[m] of length K:
 * the dense packed GEMM's tile (dot_bf16.h), stored for the epilogues */
static inline __attribute__((always_inline)) void dot64_tile(const uint16_t *const *r, const int M, const uint16_t *wp,
                                                             int64_t K, float out[][DP]) {
    __m512 acc[DOT_MAX_M][4];
    dot_bf16_tile(r, M, wp, K, acc);
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(out[m] + 16 * v, acc[m][v]);
}
#define DOT_TILE(M_)                                                                                        \
    static void dot_tile_##M_(const uint16_t *const *r, const uint16_t *wp, int64_t K, float out[][DP]) { \
        dot64_tile(r, M_, wp, K, out);                                                                     \
    }
DOT_TILE(1)
DOT_TILE(2)
DOT_TILE(3)
DOT_TILE(4)
DOT_TILE(5)
DOT_TILE(6)
typedef void (*dot_tile_fn)(const uint16_t *const *, const uint16_t *, int64_t, float[][DP]);
static const dot_tile_fn DOT_TILES[MRP + 1] = {0, dot_tile_1, dot_tile_2, dot_tile_3, dot_tile_4, dot_tile_5, dot_tile_6};

#ifdef MX_DOT_BF16
#define MOE_MX_DOT 1
/* The exponent shifts of one block of a MOE_W_MXFP8_DOT panel: its 64 features' scale bytes b as
 * words (b - 127) << 7, each twice (a feature's two k of a pair), 16 features a vector. */
static inline __attribute__((always_inline)) MX_AVX512 void mx_dot_shifts(const uint8_t *sb, __m512i shift[4]) {
    const __m512i pairs = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5,
                                           4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int v = 0; v < 4; v++) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sb + 16 * v)));
        const __m256i sh = _mm256_slli_epi16(_mm256_sub_epi16(b, _mm256_set1_epi16(127)), 7);
        shift[v] = _mm512_permutexvar_epi16(pairs, _mm512_castsi256_si512(sh));
    }
}

/* One k-pair of a MOE_W_MXFP8_DOT panel (128 bytes at w) -> its 64 features' exact scaled bf16
 * weights in the dot order, 16 features a vector: per 64 bytes, two lookups and one exponent add
 * each, or (GFNI, no zero or subnormal element among them) the affine decode at element * 256 and
 * the exponent add less 8: the same words. */
static inline __attribute__((always_inline)) MX_AVX512 void mx_dot_kpair(const uint8_t *w, const mx_bf16_tabs *tabs,
                                                                          const __m512i shift[4], __m512i a[4]) {
    for (int half = 0; half < 2; half++) {
        const __m512i raw = _mm512_loadu_si512(w + half * DP);
        __m512i *out = a + 2 * half;
        const __m512i *sh = shift + 2 * half;
#ifdef MX_GFNI
        if (mx_gfni_on && __builtin_expect(mx_decode64_bf16_x256(raw, &out[0], &out[1]), 1)) {
            const __m512i less8 = _mm512_set1_epi16(8 << 7); /* no zero word here: every word takes the shift */
            out[0] = _mm512_add_epi16(out[0], _mm512_sub_epi16(sh[0], less8));
            out[1] = _mm512_add_epi16(out[1], _mm512_sub_epi16(sh[1], less8));
            continue;
        }
#endif
        mx_decode64_bf16(raw, tabs, &out[0], &out[1]);
        out[0] = mx_scale_bf16(out[0], sh[0]);
        out[1] = mx_scale_bf16(out[1], sh[1]);
    }
}

/* One MOE_W_MXFP8_DOT panel (K / 2 k-pairs, scales [K/32][64]) -> the bf16 dot layout in `panel`
 * (exact scaled weights), for experts with more rows than one register tile. */
static MX_AVX512 void mx_dot_dequant(const uint8_t *wp, const uint8_t *sp, int64_t K, uint16_t *panel) {
    const mx_bf16_tabs tabs = mx_load_bf16_tabs();
    for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
        __m512i shift[4];
        mx_dot_shifts(sp + kb * DP, shift);
        for (int64_t kk = kb * (MX_BLOCK / 2); kk < (kb + 1) * (MX_BLOCK / 2); kk++) {
            __m512i a[4];
            mx_dot_kpair(wp + kk * 2 * DP, &tabs, shift, a);
            for (int v = 0; v < 4; v++) _mm512_storeu_si512(panel + kk * 2 * DP + 32 * v, a[v]);
        }
    }
}

#define MX_DOT_MR 4 /* rows of the in-register tile: 16 accumulators beside the lookup tables and shifts */

/* dot64_tile on a MOE_W_MXFP8_DOT panel, decoding each k-pair in registers (M <= MX_DOT_MR): for
 * an expert with one tile of rows (decode) the weights are decoded once either way, and this
 * skips the buffer's store and reload. */
static inline __attribute__((always_inline)) MX_AVX512 void mx_dot64_tile(const uint16_t *const *r, const int M,
                                                                           const uint8_t *wp, const uint8_t *sp,
                                                                           int64_t K, float out[][DP]) {
    const mx_bf16_tabs tabs = mx_load_bf16_tabs();
    __m512 acc[MX_DOT_MR][4];
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 4; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
        __m512i shift[4];
        mx_dot_shifts(sp + kb * DP, shift);
        for (int64_t kk = kb * (MX_BLOCK / 2); kk < (kb + 1) * (MX_BLOCK / 2); kk++) {
            __m512i a[4];
            mx_dot_kpair(wp + kk * 2 * DP, &tabs, shift, a);
            for (int m = 0; m < M; m++) {
                int32_t pr;
                memcpy(&pr, r[m] + 2 * kk, 4);
                const __m512bh b = (__m512bh)_mm512_set1_epi32(pr);
                for (int v = 0; v < 4; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], (__m512bh)a[v], b);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(out[m] + 16 * v, acc[m][v]);
}
#define MX_DOT_TILE(M_)                                                                                       \
    static MX_AVX512 void mx_dot_tile_##M_(const uint16_t *const *r, const uint8_t *wp, const uint8_t *sp,   \
                                           int64_t K, float out[][DP]) {                                     \
        mx_dot64_tile(r, M_, wp, sp, K, out);                                                                \
    }
MX_DOT_TILE(1)
MX_DOT_TILE(2)
MX_DOT_TILE(3)
MX_DOT_TILE(4)
#define MX_DOT_MR_OR_0 MX_DOT_MR
typedef void (*mx_dot_tile_fn)(const uint16_t *const *, const uint8_t *, const uint8_t *, int64_t, float[][DP]);
static const mx_dot_tile_fn MX_DOT_TILES[MX_DOT_MR + 1] = {0, mx_dot_tile_1, mx_dot_tile_2, mx_dot_tile_3, mx_dot_tile_4};
#endif

#ifndef MOE_MX_DOT
#define MX_DOT_MR_OR_0 0 /* no MXFP8 dot tiles in this build (experts_dot never sees MXFP8 then) */
#endif

/* f32_to_bf16 on 16 lanes (nearest even; NaN kept, made quiet) */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                              _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}

static inline __m512 widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

/* Whether moe_experts runs MOE_W_BF16_DOT weights in this build (it was compiled for a CPU with
 * AVX512-BF16); the caller packs bf16 experts in that layout only then. */
int moe_dot_available(void) {
#ifdef MOE_DOT_BF16
    return 1;
#else
    return 0;
#endif
}

/* Whether moe_experts runs MOE_W_MXFP8_DOT weights in this build (AVX512-BF16 and VBMI). */
int moe_mx_dot_available(void) {
#ifdef MOE_MX_DOT
    return 1;
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

/* Counting sort of the A = T * k assignments by expert, token order kept inside an expert: expert
 * e's assignments are sorted[cnt[e] .. cnt[e + 1]) (cnt: E + 1 zeros on entry), active[0 .. *nact)
 * the experts that have any. -3 when an id lies outside [0, E). */
static int group_by_expert(const int64_t *ids, int64_t A, int64_t E, int64_t *cnt, int64_t *pos, int64_t *sorted,
                           int64_t *active, int64_t *nact) {
    for (int64_t a = 0; a < A; a++) {
        if (ids[a] < 0 || ids[a] >= E) return -3;
        cnt[ids[a] + 1]++;
    }
    *nact = 0;
    for (int64_t e = 0; e < E; e++) {
        if (cnt[e + 1]) active[(*nact)++] = e;
        cnt[e + 1] += cnt[e];
        pos[e] = cnt[e];
    }
    for (int64_t a = 0; a < A; a++) sorted[pos[ids[a]]++] = a;
    return 0;
}

/* whether every active expert holds at most one register tile of rows (decode): then stage-1
 * items cost the same and go out statically */
static int at_most_rows(const int64_t *cnt, const int64_t *active, int64_t nact, int rows) {
    int yes = 1;
    for (int64_t ai = 0; ai < nact; ai++) yes &= cnt[active[ai] + 1] - cnt[active[ai]] <= rows;
    return yes;
}

/* Stage-1 work distribution of both expert loops: a thread's next item of n, or -1 when done.
 * When the items cost the same (uniform) each thread takes a contiguous range [next, end): it
 * reads long sequential stretches of the packed weights (one expert's panels are adjacent), which
 * the hardware prefetchers stream far better than pieces handed out alternately; otherwise items
 * go out dynamically from *claim. */
static inline int64_t next_item(int uniform, int64_t *next, int64_t end, int64_t *claim, int64_t n) {
    int64_t it;
    if (uniform) return *next < end ? (*next)++ : -1;
#pragma omp atomic capture
    it = (*claim)++;
    return it < n ? it : -1;
}

#ifdef MOE_DOT_BF16
_Static_assert(MRP == DOT_MAX_M, "experts_dot runs DOT_TILES over MRP-row tiles");

/* The panel at element offset `at` of dot-layout weights w (bytes for MXFP8, scales s) as the
 * bf16 tiles read it: bf16 as stored; MXFP8 dequantized into `buf`, unless its expert's rows fit
 * the register tile (inreg), which decodes it itself (the return value is then unused). */
static inline const uint16_t *dot_panel(const void *w, const uint8_t *s, size_t at, int64_t K, int mx, int inreg,
                                        uint16_t *buf) {
#ifdef MOE_MX_DOT
    if (mx && !inreg) {
        mx_dot_dequant((const uint8_t *)w + at, s + at / MX_BLOCK, K, buf);
        return buf;
    }
#endif
    (void)s, (void)K, (void)mx, (void)inreg, (void)buf;
    return (const uint16_t *)w + at;
}

/* M rows r against that panel: the MXFP8 register tile or the bf16 tile on wp (dot_panel's) */
static inline void dot_panel_tile(const uint16_t *const *r, int M, const uint16_t *wp, const void *w, const uint8_t *s,
                                  size_t at, int64_t K, int inreg, float o[][DP]) {
#ifdef MOE_MX_DOT
    if (inreg) {
        MX_DOT_TILES[M](r, (const uint8_t *)w + at, s + at / MX_BLOCK, K, o);
        return;
    }
#endif
    (void)w, (void)s, (void)at, (void)inreg;
    DOT_TILES[M](r, wp, K, o);
}

/* moe_experts on MOE_W_BF16_DOT weights (bf16 activations): stage 1 writes h = silu(gate) * up in
 * bf16 (exactly the rounded values the widening tiles keep in fp32), stage 2 the expert outputs
 * rounded to bf16 (as torch rounds them), and the combine sums each token's k rows in slot order
 * in fp32, 16 columns at a time -- the same operations, in the same order per element, as the
 * widening path's scalar epilogues. */
static int experts_dot(const uint16_t *x, int64_t x_stride, int64_t T, int64_t H, const int64_t *ids,
                       const float *weights, int64_t k, const void *w13d, const void *w2d, const uint8_t *s13,
                       const uint8_t *s2, int64_t E, int64_t I, void *out, int out_dtype) {
    const int64_t A = T * k;
    /* MOE_W_MXFP8_DOT: an expert with one register tile of rows decodes each panel in the tile,
     * one with more dequantizes it to bf16 first, into this thread's part of `scratch` */
    const int mx = s13 != NULL;
    const int nthreads = omp_get_max_threads();
    const size_t scratch_words = (size_t)(H > I ? H : I) * DP; /* one panel of the longer K, bf16 */
    const int64_t ng = (I + 31) / 32, nq = (H + DP - 1) / DP, kp13 = (H + 1) / 2, kp2 = (I + 1) / 2;
    int64_t *cnt = calloc((size_t)E + 1, sizeof *cnt), *pos = malloc(sizeof *pos * (size_t)E);
    int64_t *sorted = malloc(sizeof *sorted * (size_t)A), *active = malloc(sizeof *active * (size_t)E);
    uint16_t *hb = malloc(sizeof *hb * (size_t)(A * I)); /* h rows in expert-sorted order */
    uint16_t *ys = malloc(sizeof *ys * (size_t)(A * H)); /* expert outputs, rows in assignment order t*k+j */
    uint16_t *scratch = mx ? malloc(sizeof *scratch * scratch_words * (size_t)nthreads) : NULL;
    int rc = 0;
    int64_t nact = 0;
    if (!cnt || !pos || !sorted || !active || !hb || !ys || (mx && !scratch)) {
        rc = -1;
        goto done;
    }
    if ((rc = group_by_expert(ids, A, E, cnt, pos, sorted, active, &nact))) goto done;
    const int uniform = at_most_rows(cnt, active, nact, MRP);
    int64_t claim = 0;
    /* one parallel region, one barrier: see moe_experts */
#pragma omp parallel num_threads(nthreads)
    {
        const int nth = omp_get_num_threads(), me = omp_get_thread_num();
        uint16_t *panel = mx ? scratch + scratch_words * (size_t)me : NULL;
        const int64_t n1 = nact * ng;
        int64_t next = uniform ? n1 * me / nth : 0, it;
        const int64_t end1 = uniform ? n1 * (me + 1) / nth : n1;
        float o[MRP][DP];
        /* stage 1: one item per (active expert, panel of 32 gate + 32 up features) */
        while ((it = next_item(uniform, &next, end1, &claim, n1)) >= 0) {
            const int64_t e = active[it / ng], g = it % ng;
            const size_t at = (size_t)(e * ng + g) * (size_t)kp13 * 2 * DP; /* elements (bytes for MXFP8) */
            const int inreg = mx && cnt[e + 1] - cnt[e] <= MX_DOT_MR_OR_0;
            const uint16_t *wp = dot_panel(w13d, s13, at, H, mx, inreg, panel);
            const int nc = I - 32 * g < 32 ? (int)(I - 32 * g) : 32;
            for (int64_t r0 = cnt[e]; r0 < cnt[e + 1]; r0 += MRP) {
                const int M = cnt[e + 1] - r0 < MRP ? (int)(cnt[e + 1] - r0) : MRP;
                const uint16_t *xb[MRP];
                for (int m = 0; m < M; m++) xb[m] = x + (sorted[r0 + m] / k) * x_stride;
                dot_panel_tile(xb, M, wp, w13d, s13, at, H, inreg, o);
                for (int m = 0; m < M; m++) {
                    uint16_t hv[32];
                    for (int v = 0; v < 4; v++) {
                        const __m256 h8 = swiglu8(_mm256_loadu_ps(o[m] + 8 * v), _mm256_loadu_ps(o[m] + 32 + 8 * v), 1);
                        /* h8 is a bf16 value already (swiglu8 rounds last): its high halves are exact */
                        _mm_storeu_si128((__m128i *)(hv + 8 * v), _mm256_cvtepi32_epi16(_mm256_srli_epi32(_mm256_castps_si256(h8), 16)));
                    }
                    memcpy(hb + (r0 + m) * I + 32 * g, hv, sizeof *hv * (size_t)nc);
                }
            }
        }
#pragma omp barrier
        /* stage 2 + combine: each thread owns a contiguous range of 64-column panels [q0, q1) for
         * every token (so the combine needs no barrier), expert by expert; with more threads than
         * H / 64 panels the rest wait at the end (H 512: 8 panels, fine on this 2-core target) */
        const int64_t q0 = nq * me / nth, q1 = nq * (me + 1) / nth;
        for (int64_t ai = 0; ai < nact; ai++) {
            const int64_t e = active[ai];
            for (int64_t q = q0; q < q1; q++) {
                const size_t at = (size_t)(e * nq + q) * (size_t)kp2 * 2 * DP;
                const int inreg = mx && cnt[e + 1] - cnt[e] <= MX_DOT_MR_OR_0;
                const uint16_t *wp = dot_panel(w2d, s2, at, I, mx, inreg, panel);
                const int nc = H - DP * q < DP ? (int)(H - DP * q) : DP;
                for (int64_t r0 = cnt[e]; r0 < cnt[e + 1]; r0 += MRP) {
                    const int M = cnt[e + 1] - r0 < MRP ? (int)(cnt[e + 1] - r0) : MRP;
                    const uint16_t *hr[MRP];
                    for (int m = 0; m < M; m++) hr[m] = hb + (r0 + m) * I;
                    dot_panel_tile(hr, M, wp, w2d, s2, at, I, inreg, o);
                    for (int m = 0; m < M; m++) {
                        uint16_t yv[DP];
                        for (int v = 0; v < 4; v++) _mm256_storeu_si256((__m256i *)(yv + 16 * v), bf16x16(_mm512_loadu_ps(o[m] + 16 * v)));
                        memcpy(ys + sorted[r0 + m] * H + DP * q, yv, sizeof *yv * (size_t)nc);
                    }
                }
            }
        }
        const int64_t c0 = q0 * DP, c1 = q1 * DP < H ? q1 * DP : H;
        for (int64_t t = 0; t < T; t++)
            for (int64_t c = c0; c < c1; c += 16) {
                const __mmask16 lanes = c1 - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (c1 - c)) - 1);
                __m512 s = _mm512_setzero_ps();
                for (int64_t j = 0; j < k; j++) {
                    const __m512 y = widen16(_mm256_maskz_loadu_epi16(lanes, ys + (t * k + j) * H + c));
                    s = _mm512_add_ps(s, _mm512_mul_ps(y, _mm512_set1_ps(weights[t * k + j])));
                }
                if (out_dtype == DT_BF16) _mm256_mask_storeu_epi16((uint16_t *)out + t * H + c, lanes, bf16x16(s));
                else _mm512_mask_storeu_ps((float *)out + t * H + c, lanes, s);
            }
    }
done:
    free(cnt), free(pos), free(sorted), free(active), free(hb), free(ys), free(scratch);
    return rc;
}
#endif

/* out[t] = sum_j weights[t, j] * W2[ids[t, j]] (silu(G x[t]) * (U x[t])), G/U/W2 of that expert.
 *
 * x: [T, H] rows x_stride apart, dtype x_dtype (fp32/bf16; the computation follows it: bf16 rounds
 * where torch's bf16 path rounds); ids int64 [T, k] in [0, E); weights fp32 [T, k]; w13p / w2p:
 * packed by moe_pack_w13 / moe_pack_w2 in format w_format; w13_scale / w2_scale: MXFP8 block
 * scales (NULL for fp32/bf16); out: [T, H] contiguous, out_dtype; invariant: 1 for a batch-invariant
 * call (each row's result independent of T and of the other rows).
 * Returns 0; -1 allocation failed; -2 weight format not implemented; -3 an expert id out of range. */
static int experts_run(const void *x, int x_dtype, int64_t x_stride, int64_t T, int64_t H, const int64_t *ids,
                       const float *weights, int64_t k, const void *w13p, const void *w2p, int w_format,
                       const void *w13_scale, const void *w2_scale, int64_t E, int64_t I, void *out, int out_dtype,
                       int invariant, const epilogue_t *ep);

int moe_experts(const void *x, int x_dtype, int64_t x_stride, int64_t T, int64_t H, const int64_t *ids,
                const float *weights, int64_t k, const void *w13p, const void *w2p, int w_format,
                const void *w13_scale, const void *w2_scale, int64_t E, int64_t I, void *out, int out_dtype,
                int invariant) {
    const epilogue_t plain = {NULL, NULL, 0, 0.f, 0.f};
    return experts_run(x, x_dtype, x_stride, T, H, ids, weights, k, w13p, w2p, w_format, w13_scale, w2_scale, E, I, out,
                       out_dtype, invariant, &plain);
}

/* moe_experts with gpt-oss's epilogues: b13 [E, 2I] (gate then up) and b2 [E, H] in x's dtype, or
 * NULL; act 1 for the clamped SwiGLU (alpha, limit). -2 on the dot formats (not implemented). */
int moe_experts_ep(const void *x, int x_dtype, int64_t x_stride, int64_t T, int64_t H, const int64_t *ids,
                   const float *weights, int64_t k, const void *w13p, const void *w2p, int w_format,
                   const void *w13_scale, const void *w2_scale, int64_t E, int64_t I, void *out, int out_dtype,
                   int invariant, const void *b13, const void *b2, int act, float alpha, float limit) {
    if (act < 0 || act > 1) return -2;
    const epilogue_t ep = {b13, b2, act, alpha, limit};
    return experts_run(x, x_dtype, x_stride, T, H, ids, weights, k, w13p, w2p, w_format, w13_scale, w2_scale, E, I, out,
                       out_dtype, invariant, &ep);
}

static int experts_run(const void *x, int x_dtype, int64_t x_stride, int64_t T, int64_t H, const int64_t *ids,
                       const float *weights, int64_t k, const void *w13p, const void *w2p, int w_format,
                       const void *w13_scale, const void *w2_scale, int64_t E, int64_t I, void *out, int out_dtype,
                       int invariant, const epilogue_t *ep) {
    const int plain_ep = !ep->b13 && !ep->b2 && ep->act == 0;
    /* the dot tiles sum every row in one order at every tile height; the panel tiles do so when
     * told (`invariant`: no even/odd split at M <= 2, see panel_tile) */
    const int split = !invariant;
    if (w_format == MOE_W_BF16_DOT || w_format == MOE_W_MXFP8_DOT) {
        const int mxd = w_format == MOE_W_MXFP8_DOT;
        if (!plain_ep) return -2;
#ifdef MOE_DOT_BF16
#ifndef MOE_MX_DOT
        if (mxd) return -2;
#endif
        if (x_dtype != DT_BF16 || (mxd && (H % MX_BLOCK || I % MX_BLOCK || !w13_scale || !w2_scale))) return -2;
        if (T * k == 0) return 0;
        return experts_dot((const uint16_t *)x, x_stride, T, H, ids, weights, k, w13p, w2p,
                           mxd ? (const uint8_t *)w13_scale : NULL, mxd ? (const uint8_t *)w2_scale : NULL, E, I, out,
                           out_dtype);
#else
        (void)mxd;
        return -2;
#endif
    }
    if (w_format != MOE_W_F32 && w_format != MOE_W_BF16 && w_format != MOE_W_MXFP8) return -2;
    const int mx = w_format == MOE_W_MXFP8;
    if (mx && (H % MX_BLOCK || I % MX_BLOCK || !w13_scale || !w2_scale)) return -2;
    const int64_t A = T * k;
    if (A == 0) return 0;
    const int bf = x_dtype == DT_BF16, fi = w_format == MOE_W_BF16;
    const int mx_fast = mx && mxfp8_use_fast();
    const int mr = mx ? MR : MRP; /* rows per register tile */
    /* the scalar MXFP8 route's per-thread fp32 panel: [max(H, I)][16] */
    const int64_t panel_k = H > I ? H : I;
    const size_t es = elsize(w_format);
    const int64_t np = (I + P13 - 1) / P13, nq = (H + P2 - 1) / P2;
    int64_t *cnt = calloc((size_t)E + 1, sizeof *cnt), *pos = malloc(sizeof *pos * (size_t)E);
    int64_t *sorted = malloc(sizeof *sorted * (size_t)A), *active = malloc(sizeof *active * (size_t)E);
    float *xf = malloc(sizeof *xf * (size_t)(T * H)); /* x as fp32 (exact for bf16) */
    float *h = malloc(sizeof *h * (size_t)(A * I));    /* silu(gate) * up, rows in expert-sorted order */
    float *ys = malloc(sizeof *ys * (size_t)(A * H));  /* expert outputs, rows in assignment order t*k+j */
    int rc = 0;
    float *panels = NULL, *xe1 = NULL, *xe2 = NULL;
    int *ks1 = NULL;
    if (!cnt || !pos || !sorted || !active || !xf || !h || !ys) {
        rc = -1;
        goto done;
    }
    int64_t nact;
    if ((rc = group_by_expert(ids, A, E, cnt, pos, sorted, active, &nact))) goto done;

    /* x as fp32 once (exact for bf16); in parallel only when it is big enough to pay a fork */
#pragma omp parallel for schedule(static) if (T * H >= (1 << 18))
    for (int64_t t = 0; t < T; t++)
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
#ifdef MX_X86
    /* the one-row tiles on block sums (mx_panel_row_sums) take rows expanded and scaled first: the
     * tokens' rows here, once (for up to ROW_SUMS_MAX_T tokens, where one-row tiles are common and
     * the copies small), and each h row in the thread that needs it (known only after stage 1) */
    const int row_sums = mx_fast && split && mxfp8_placed_on();
    if (row_sums) {
        xe2 = malloc(sizeof(float) * (size_t)(4 * I) * (size_t)nthreads);
        if (T <= ROW_SUMS_MAX_T) {
            xe1 = malloc(sizeof(float) * (size_t)(4 * H * T));
            ks1 = malloc(sizeof(int) * (size_t)T);
        }
        if (!xe2 || (T <= ROW_SUMS_MAX_T && (!xe1 || !ks1))) {
            rc = -1;
            goto done;
        }
        for (int64_t t = 0; xe1 && t < T; t++) ks1[t] = mx_pairs_expand(xf + t * H, H, xe1 + t * 4 * H);
    }
#endif
    /* One parallel region with one barrier (between the two stages): on a machine shared with
     * other busy processes every barrier can wait a whole scheduler slice for a descheduled
     * thread, so the stages are arranged to need no more. */
    const int uniform = at_most_rows(cnt, active, nact, mr);
    int64_t claim = 0; /* stage 1's next item when items go out dynamically */
#pragma omp parallel num_threads(nthreads)
    {
        float *panel = panels ? panels + (size_t)omp_get_thread_num() * (size_t)(panel_k * 16) : NULL;
        /* stage 1: h = silu(x G^T) * (x U^T), one item per (active expert, panel), see next_item */
        const int nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t n1 = nact * np;
        int64_t next = uniform ? n1 * me / nth : 0, it;
        const int64_t end1 = uniform ? n1 * (me + 1) / nth : n1;
        while ((it = next_item(uniform, &next, end1, &claim, n1)) >= 0) {
            const int64_t e = active[it / np], p = it % np;
            const char *wp = (const char *)w13p + (size_t)((e * np + p) * H * 2 * P13) * es;
            const uint8_t *sp = mx ? (const uint8_t *)w13_scale + (size_t)((e * np + p) * (H / MX_BLOCK) * 2 * P13) : NULL;
            if (mx && !mx_fast) mx_panel_dequant((const uint8_t *)wp, sp, H, panel);
            for (int64_t r0 = cnt[e]; r0 < cnt[e + 1]; r0 += mr) {
                const int M = cnt[e + 1] - r0 < mr ? (int)(cnt[e + 1] - r0) : mr;
                const float *xr[MRP];
                for (int m = 0; m < M; m++) xr[m] = xf + (sorted[r0 + m] / k) * H;
                v8f g[MRP], u[MRP];
#ifdef MX_X86
                if (M == 1 && xe1) {
                    const int64_t tok = sorted[r0] / k;
                    mx_panel_row_sums(xe1 + tok * 4 * H, ks1[tok], xr[0], (const uint8_t *)wp, sp, H, g, u);
                } else if (mx_fast) MX_TILES[M](xr, (const uint8_t *)wp, sp, H, split, g, u);
                else
#endif
                if (mx) GATEUP[0][M](xr, (const char *)panel, H, split, g, u);
                else GATEUP[fi][M](xr, wp, H, split, g, u);
                const int nc = I - p * P13 < P13 ? (int)(I - p * P13) : P13; /* features of this panel */
                for (int m = 0; m < M; m++) {
                    float *hm = h + (r0 + m) * I + p * P13;
#ifdef MOE_VEC_EPILOGUE
                    float hv[P13];
                    __m256 gv, uv;
                    memcpy(&gv, &g[m], sizeof gv);
                    memcpy(&uv, &u[m], sizeof uv);
                    if (plain_ep) {
                        _mm256_storeu_ps(hv, swiglu8(gv, uv, bf));
                    } else {
                        float bg[P13] = {0}, bu[P13] = {0};
                        for (int c = 0; ep->b13 && c < nc; c++)
                            bg[c] = bias_at(ep->b13, e * 2 * I + p * P13 + c, bf), bu[c] = bias_at(ep->b13, e * 2 * I + I + p * P13 + c, bf);
                        gv = rnd8(gv, bf), uv = rnd8(uv, bf);
                        if (ep->b13) gv = rnd8(_mm256_add_ps(gv, _mm256_loadu_ps(bg)), bf), uv = rnd8(_mm256_add_ps(uv, _mm256_loadu_ps(bu)), bf);
                        _mm256_storeu_ps(hv, ep->act == 1 ? clamped8(gv, uv, ep->alpha, ep->limit, bf) : swiglu8(gv, uv, bf));
                    }
                    memcpy(hm, hv, sizeof(float) * (size_t)nc);
#else
                    for (int c = 0; c < nc; c++)
                        hm[c] = epilogue1(g[m][c], u[m][c], ep->b13 ? bias_at(ep->b13, e * 2 * I + p * P13 + c, bf) : 0.f,
                                          ep->b13 ? bias_at(ep->b13, e * 2 * I + I + p * P13 + c, bf) : 0.f, ep, bf);
#endif
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
        float *xe = xe2 ? xe2 + (size_t)me * (size_t)(4 * I) : NULL; /* this thread's expanded h row */
        int64_t xe_row = -1;
        int xe_ks = 0;
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
#ifdef MX_X86
                    if (M == 1 && xe) {
                        if (xe_row != r0) xe_ks = mx_pairs_expand(hr[0], I, xe), xe_row = r0;
                        mx_panel_row_sums(xe, xe_ks, hr[0], (const uint8_t *)wp, sp, I, a0, a1);
                    } else if (mx_fast) MX_TILES[M](hr, (const uint8_t *)wp, sp, I, split, a0, a1);
                    else
#endif
                    if (mx) DOWN[0][M](hr, (const char *)panel, I, split, a0, a1);
                    else DOWN[fi][M](hr, wp, I, split, a0, a1);
                    for (int m = 0; m < M; m++) {
                        float *y = ys + sorted[r0 + m] * H;
                        for (int c = 0; c < P2 && q * P2 + c < H; c++) y[q * P2 + c] = rnd(c < 8 ? a0[m][c] : a1[m][c - 8], bf);
                        for (int c = 0; ep->b2 && c < P2 && q * P2 + c < H; c++)
                            y[q * P2 + c] = rnd(y[q * P2 + c] + bias_at(ep->b2, e * H + q * P2 + c, bf), bf);
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
    free(panels), free(xe1), free(xe2), free(ks1);
    free(cnt), free(pos), free(sorted), free(active), free(xf), free(h), free(ys);
    return rc;
}
