/* y = x @ W^T for a few rows of x (decode at small batch): a weight-streaming kernel.
 *
 * At batch 1..8 a linear layer is bound by reading W once from memory; the general GEMM library
 * paths reach only a fraction of the copy bandwidth there (measured: torch's bf16 mm at M=1 on a
 * 151936 x 1024 lm_head ran at a third of it). This kernel streams W (bf16 or fp32, row-major
 * [N, K] as nn.Linear stores it) exactly once: each thread takes a contiguous range of output
 * features, walks four weight rows at a time (four independent streams keep enough loads in
 * flight), and dots them with every row of x, which stays in L1/L2 as fp32. Accumulation is fp32.
 *
 * bf16 x and W (M <= 4) on a CPU with AVX512-BF16 use its dot instruction (32 products per
 * instruction, exact products, fp32 sums) over up to 16 weight rows at once: converting bf16 to
 * fp32 element by element caps a core at about half its share of the memory bandwidth.
 *
 * bf16 W on an AVX2 CPU without it is w16_gemm.c's (one sequential stream per thread reads faster
 * there than interleaved rows); it comes here only with the native bf16 GEMMs switched off
 * (CUTTLE_PACKED_GEMM=0), to the generic loop below.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "dtypes.h"


/* y[m, n0 + r] = acc[r * M + m] + bias[n0 + r] for the rows of one group that exist (< N) */
static inline void store_group(void *y, int y_dtype, const uint16_t *bias, const float *acc, int64_t n0, int64_t R,
                               int64_t M, int64_t N) {
    for (int64_t r = 0; r < R && n0 + r < N; r++)
        for (int64_t m = 0; m < M; m++) {
            const float b = bias ? bf16_to_f32(bias[n0 + r]) : 0.f;
            store_as(y, y_dtype, m * N + n0 + r, acc[r * M + m] + b);
        }
}

/* x: [M, K] (row stride x_stride elements), w: [N, K] contiguous, bias: [N] or NULL (same dtype
 * as w), y: [M, N] contiguous. Returns 0, or -1 when the fp32 copy of x cannot be allocated. */
#ifdef __AVX512BF16__
/* Dot products of M bf16 x rows with R consecutive bf16 weight rows, R * M accumulators kept in
 * registers (R and M are compile-time constants at every call site, so the loops unroll). More
 * rows in flight read memory faster: measured on the 0.6B model's layers, 16 rows at a time
 * streamed ~24 GB/s against ~19 GB/s for 4 (pure reads top out at ~31 GB/s here). */
static inline __attribute__((always_inline)) void dot_rows_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                                                                int64_t K, const int R, const int M, float *out) {
    __m512 a[16];
    for (int i = 0; i < R * M; i++) a[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int m = 0; m < M; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * x_stride + k);
            for (int r = 0; r < R; r++)
                a[r * M + m] = _mm512_dpbf16_ps(a[r * M + m], xv, (__m512bh)_mm512_loadu_si512(w + r * K + k));
        }
    }
    if (k < K) { /* tail: masked loads, zeros beyond K */
        const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        for (int m = 0; m < M; m++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * x_stride + k);
            for (int r = 0; r < R; r++)
                a[r * M + m] = _mm512_dpbf16_ps(a[r * M + m], xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k));
        }
    }
    for (int i = 0; i < R * M; i++) out[i] = _mm512_reduce_add_ps(a[i]);
}

/* rows [n0, n0 + R) of y for all M x rows; out index r * M + m */
#define ROWS_BF16(R_, M_)                                                                           \
    static void rows_bf16_##R_##_##M_(const uint16_t *x, int64_t xs, const uint16_t *w, int64_t K, \
                                      float *out) {                                                \
        dot_rows_bf16(x, xs, w, K, R_, M_, out);                                                   \
    }
ROWS_BF16(16, 1)
ROWS_BF16(8, 2)
ROWS_BF16(4, 3)
ROWS_BF16(4, 4)
ROWS_BF16(1, 1)
ROWS_BF16(1, 2)
ROWS_BF16(1, 3)
ROWS_BF16(1, 4)

typedef void (*rows_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, float *);

static int linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, void *y,
                       int y_dtype, int64_t M, int64_t N, int64_t K) {
    static const rows_fn wide[5] = {0, rows_bf16_16_1, rows_bf16_8_2, rows_bf16_4_3, rows_bf16_4_4};
    static const rows_fn one[5] = {0, rows_bf16_1_1, rows_bf16_1_2, rows_bf16_1_3, rows_bf16_1_4};
    const int R = M == 1 ? 16 : M == 2 ? 8 : 4;
    const int64_t groups = (N + R - 1) / R;
#pragma omp parallel for schedule(static)
    for (int64_t gidx = 0; gidx < groups; gidx++) {
        const int64_t n0 = gidx * R;
        float acc[16];
        if (n0 + R <= N) {
            wide[M](x, x_stride, w + n0 * K, K, acc);
        } else { /* the last, partial group: one row at a time */
            for (int64_t r = 0; n0 + r < N; r++) one[M](x, x_stride, w + (n0 + r) * K, K, acc + r * M);
        }
        store_group(y, y_dtype, bias, acc, n0, R, M, N);
    }
    return 0;
}
#endif

int small_m_linear(const void *x, int x_dtype, int64_t x_stride, const void *w, int w_dtype, const void *bias,
                   void *y, int y_dtype, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512BF16__
    if (x_dtype == DT_BF16 && w_dtype == DT_BF16 && M >= 1 && M <= 4)
        return linear_bf16((const uint16_t *)x, x_stride, (const uint16_t *)w, (const uint16_t *)bias, y, y_dtype, M, N, K);
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
                store_as(y, y_dtype, m * N + n0 + r, acc[r] + b);
            }
        }
    }
    free(xf);
    return 0;
}
