/* y = x @ W^T for a few rows of x (decode at small batch): a weight-streaming kernel.
 *
 * At batch 1..8 a linear layer is bound by reading W once from memory; the general GEMM library
 * paths reach only a fraction of the copy bandwidth there (measured: torch's bf16 mm at M=1 on a
 * 151936 x 1024 lm_head ran at a third of it). This kernel streams W (bf16 or fp32, row-major
 * [N, K] as nn.Linear stores it) exactly once: each thread takes a contiguous range of output
 * features, walks four weight rows at a time (four independent streams keep enough loads in
 * flight), and dots them with every row of x, which stays in L1/L2 as fp32. Accumulation is fp32.
 *
 * bf16 x and W on a CPU with AVX512-BF16 use its dot instruction (32 products per instruction,
 * exact products, fp32 sums): converting bf16 to fp32 element by element caps a core at about
 * half its share of the memory bandwidth.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x007fffffu)) return (uint16_t)((v.u >> 16) | 0x40);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

static inline void store(void *y, int dt, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}

/* x: [M, K] (row stride x_stride elements), w: [N, K] contiguous, bias: [N] or NULL (same dtype
 * as w), y: [M, N] contiguous. Returns 0, or -1 when the fp32 copy of x cannot be allocated. */
#ifdef __AVX512BF16__
/* four dot products of one bf16 x row with four bf16 weight rows */
static inline void dot4_bf16(const uint16_t *x, const uint16_t *w0, const uint16_t *w1, const uint16_t *w2,
                             const uint16_t *w3, int64_t K, float out[4]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_loadu_si512(w0 + k));
        a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_loadu_si512(w1 + k));
        a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_loadu_si512(w2 + k));
        a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_loadu_si512(w3 + k));
    }
    if (k < K) { /* tail: masked loads, zeros beyond K */
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
        a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w0 + k));
        a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + k));
        a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w2 + k));
        a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w3 + k));
    }
    out[0] = _mm512_reduce_add_ps(a0);
    out[1] = _mm512_reduce_add_ps(a1);
    out[2] = _mm512_reduce_add_ps(a2);
    out[3] = _mm512_reduce_add_ps(a3);
}
#endif

int small_m_linear(const void *x, int x_dtype, int64_t x_stride, const void *w, int w_dtype, const void *bias,
                   void *y, int y_dtype, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512BF16__
    if (x_dtype == DT_BF16 && w_dtype == DT_BF16) {
        const int64_t groups = (N + 3) / 4;
#pragma omp parallel for schedule(static)
        for (int64_t gidx = 0; gidx < groups; gidx++) {
            const int64_t n0 = gidx * 4, nr = N - n0 < 4 ? N - n0 : 4;
            const uint16_t *w0 = (const uint16_t *)w + n0 * K;
            const uint16_t *w1 = nr > 1 ? w0 + K : w0, *w2 = nr > 2 ? w0 + 2 * K : w0, *w3 = nr > 3 ? w0 + 3 * K : w0;
            for (int64_t m = 0; m < M; m++) {
                float acc[4];
                dot4_bf16((const uint16_t *)x + m * x_stride, w0, w1, w2, w3, K, acc);
                for (int64_t r = 0; r < nr; r++) {
                    const float b = bias ? bf16_to_f32(((const uint16_t *)bias)[n0 + r]) : 0.f;
                    store(y, y_dtype, m * N + n0 + r, acc[r] + b);
                }
            }
        }
        return 0;
    }
#endif
    float *xf = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xf) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++)
            xf[m * K + k] = x_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[m * x_stride + k])
                                               : ((const float *)x)[m * x_stride + k];
    const int64_t groups = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t gidx = 0; gidx < groups; gidx++) {
        const int64_t n0 = gidx * 4, nr = N - n0 < 4 ? N - n0 : 4;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = xf + m * K;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
            if (w_dtype == DT_BF16) {
                const uint16_t *w0 = (const uint16_t *)w + n0 * K;
                const uint16_t *w1 = nr > 1 ? w0 + K : w0, *w2 = nr > 2 ? w0 + 2 * K : w0, *w3 = nr > 3 ? w0 + 3 * K : w0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int64_t k = 0; k < K; k++) {
                    const float xv = xm[k];
                    a0 += xv * bf16_to_f32(w0[k]);
                    a1 += xv * bf16_to_f32(w1[k]);
                    a2 += xv * bf16_to_f32(w2[k]);
                    a3 += xv * bf16_to_f32(w3[k]);
                }
            } else {
                const float *w0 = (const float *)w + n0 * K;
                const float *w1 = nr > 1 ? w0 + K : w0, *w2 = nr > 2 ? w0 + 2 * K : w0, *w3 = nr > 3 ? w0 + 3 * K : w0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int64_t k = 0; k < K; k++) {
                    const float xv = xm[k];
                    a0 += xv * w0[k];
                    a1 += xv * w1[k];
                    a2 += xv * w2[k];
                    a3 += xv * w3[k];
                }
            }
            float acc[4] = {a0, a1, a2, a3};
            for (int64_t r = 0; r < nr; r++) {
                float b = 0.f;
                if (bias) b = w_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)bias)[n0 + r]) : ((const float *)bias)[n0 + r];
                /* torch adds the bias after rounding the product to the weight dtype in bf16 mm;
                 * we add it in fp32 and round once */
                store(y, y_dtype, m * N + n0 + r, acc[r] + b);
            }
        }
    }
    free(xf);
    return 0;
}
