/* y = x @ W^T (+ bias) for bf16 W on CPUs with AVX2 + FMA but no bf16 dot instruction (AMD Zen 2/3,
 * Intel before Cooper Lake): every bf16 linear layer there, from one decode row to a prefill chunk.
 *
 * Why: without AVX512-BF16, torch's bf16 GEMM runs at ~30 GFLOP/s on this class of CPU (measured:
 * 29 GFLOP/s on a [64, 512] x [151936, 512] lm_head, 2 cores of an AVX2-only AMD EPYC), a quarter
 * of its fp32 GEMM, and a streaming kernel that walks several weight rows side by side reads memory at
 * half the rate one sequential stream does (17 vs 33 GB/s on that lm_head at one row). W is read
 * in place, row-major as nn.Linear stores it: no packed copy.
 *
 * Widening: a 32-byte load holds 16 bf16 weights as 8 uint32 words; `word << 16` is the even
 * elements and `word & 0xffff0000` the odd elements, each exactly as fp32. x is converted to fp32
 * once per call with each block of 16 columns split the same way (8 even, then 8 odd), so one load
 * and one shift or mask feed each FMA of 8 products. Sums are fp32; the bias is added in fp32 and
 * the result rounded once (to bf16 nearest-even, or kept fp32).
 *
 * Two loops:
 *  - M <= 8 (decode at small batch, bound by reading W): each thread takes a contiguous range of
 *    weight rows and finishes one row (all M x rows, in passes of 4 whose second re-reads the row
 *    from L1) before the next, so W is one sequential stream per thread, with a software prefetch
 *    PREFETCH_BYTES ahead of it.
 *  - more rows (bound by the FMA units): each thread takes blocks of NB weight rows; a block is read
 *    from memory once and then stays in L1/L2 while every 3-row tile of x runs over it, 3 x rows
 *    by 2 weight rows (12 accumulators) per tile.
 * Measured on that EPYC through gemm.linear (best of 5): the lm_head at one row in 4.0 ms (~38
 * GB/s; a torch copy ran at ~33), at 64 rows in 145 ms (~69 GFLOP/s; torch's bf16 GEMM 334 ms);
 * [6144, 1024] at 64 rows ~71 GFLOP/s.
 */
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define STREAM_MAX_ROWS 4 /* x rows per pass of the streaming loop */
#define STREAM_PASSES 2     /* passes over each weight row before the tiled loop takes over */
#define PREFETCH_BYTES 1024
#define TILE_M 3
#define TILE_N 2
#define NB 32 /* weight rows per work item of the tiled loop (a multiple of TILE_N) */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 even8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 odd8(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}


/* The scalar part of row n's dot with x row m: the columns past the last full block of 16 (xs
 * keeps those unsplit). */
static inline float tail_dot(const float *xs_m, const uint16_t *w_n, int64_t k0, int64_t K) {
    float s = 0.f;
    for (int64_t k = k0; k < K; k++) s += bf16_to_f32(w_n[k]) * xs_m[k];
    return s;
}

/* One weight row (w, K columns) against M x rows: out[m]. Two accumulators per x row and block
 * (even, odd); with U = 2 (one row, not batch-invariant) two blocks per iteration, so four
 * independent FMA chains, but a sum in another order than at U = 1, which every other row count
 * and the tiled loop use. */
static inline __attribute__((always_inline)) void stream_row(const float *xs, const uint16_t *w, int64_t K, const int M,
                                                             const int U, float *out) {
    __m256 a[STREAM_MAX_ROWS][2][2];
    for (int m = 0; m < M; m++)
        for (int u = 0; u < U; u++) a[m][u][0] = a[m][u][1] = _mm256_setzero_ps();
    const int64_t kfull = K / 16 * 16;
    int64_t k = 0;
    for (; k + 16 * U <= kfull; k += 16 * U) {
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
        for (int u = 0; u < U; u++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k + 16 * u));
            const __m256 we = even8(v), wo = odd8(v);
            for (int m = 0; m < M; m++) {
                a[m][u][0] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + m * K + k + 16 * u), a[m][u][0]);
                a[m][u][1] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + m * K + k + 16 * u + 8), a[m][u][1]);
            }
        }
    }
    for (; k < kfull; k += 16) { /* an odd block left at U = 2 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + k));
        for (int m = 0; m < M; m++) {
            a[m][0][0] = _mm256_fmadd_ps(even8(v), _mm256_loadu_ps(xs + m * K + k), a[m][0][0]);
            a[m][0][1] = _mm256_fmadd_ps(odd8(v), _mm256_loadu_ps(xs + m * K + k + 8), a[m][0][1]);
        }
    }
    for (int m = 0; m < M; m++) {
        __m256 s = _mm256_add_ps(a[m][0][0], a[m][0][1]);
        if (U == 2) s = _mm256_add_ps(s, _mm256_add_ps(a[m][1][0], a[m][1][1]));
        out[m] = hsum(s) + tail_dot(xs + m * K, w, kfull, K);
    }
}

#define STREAM_FN(NAME, M_, U_)                                                                         \
    static void NAME(const float *xs, const uint16_t *w, int64_t K, float *out) {                     \
        stream_row(xs, w, K, M_, U_, out);                                                             \
    }
STREAM_FN(stream_1, 1, 2)
STREAM_FN(stream_1_invariant, 1, 1)
STREAM_FN(stream_2, 2, 1)
STREAM_FN(stream_3, 3, 1)
STREAM_FN(stream_4, 4, 1)
typedef void (*stream_fn)(const float *, const uint16_t *, int64_t, float *);

/* MR x rows (xs, row stride K) by NR consecutive weight rows (w, row stride K): out[m * NR + n]. */
static inline __attribute__((always_inline)) void tile(const float *xs, const uint16_t *w, int64_t K, const int MR,
                                                       const int NR, float *out) {
    __m256 a[TILE_M][TILE_N][2];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) a[m][n][0] = a[m][n][1] = _mm256_setzero_ps();
    const int64_t kfull = K / 16 * 16;
    for (int64_t k = 0; k < kfull; k += 16) {
        for (int n = 0; n < NR; n++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + n * K + k));
            const __m256 we = even8(v), wo = odd8(v);
            for (int m = 0; m < MR; m++) {
                a[m][n][0] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xs + m * K + k), a[m][n][0]);
                a[m][n][1] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xs + m * K + k + 8), a[m][n][1]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++)
            out[m * NR + n] = hsum(_mm256_add_ps(a[m][n][0], a[m][n][1])) + tail_dot(xs + m * K, w + n * K, kfull, K);
}

#define TILE_FN(MR_, NR_)                                                                               \
    static void tile_##MR_##_##NR_(const float *xs, const uint16_t *w, int64_t K, float *out) {        \
        tile(xs, w, K, MR_, NR_, out);                                                                 \
    }
TILE_FN(1, 1)
TILE_FN(2, 1)
TILE_FN(3, 1)
TILE_FN(1, 2)
TILE_FN(2, 2)
TILE_FN(3, 2)
typedef void (*tile_fn)(const float *, const uint16_t *, int64_t, float *);

static void store_tile(void *y, int y_dtype, const uint16_t *bias, const float *acc, int64_t m0, int64_t n0, int MR,
                       int NR, int64_t N) {
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++)
            store_as(y, y_dtype, (m0 + m) * N + n0 + n, acc[m * NR + n] + (bias ? bf16_to_f32(bias[n0 + n]) : 0.f));
}
#endif

int w16_gemm_available(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* x: [M, K] bf16 or fp32 (row stride x_stride elements), w: [N, K] bf16 contiguous, bias: [N] bf16
 * or NULL, y: [M, N] contiguous bf16 or fp32. Returns 0; -1 when the fp32 copy of x cannot be
 * allocated; -2 when the library was built without AVX2 + FMA. invariant: 1 for a batch-invariant
 * call (one row summed in the order of every other row count). */
int w16_linear(const void *x, int x_dtype, int64_t x_stride, const uint16_t *w, const uint16_t *bias, void *y,
               int y_dtype, int64_t M, int64_t N, int64_t K, int invariant) {
#if defined(__AVX2__) && defined(__FMA__)
    if (M <= 0 || N <= 0) return 0;
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * K));
    if (!xs) return -1;
    const int64_t kfull = K / 16 * 16;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) {
            /* column k of a full block goes to its even/odd half; the tail stays in place */
            const int64_t dst = k < kfull ? (k & ~15) + ((k & 1) ? 8 : 0) + ((k & 15) >> 1) : k;
            xs[m * K + dst] = x_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[m * x_stride + k])
                                                 : ((const float *)x)[m * x_stride + k];
        }
    if (M <= STREAM_PASSES * STREAM_MAX_ROWS) {
        const stream_fn fns[STREAM_MAX_ROWS + 1] = {0, invariant ? stream_1_invariant : stream_1, stream_2, stream_3,
                                                    stream_4};
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            /* x rows 4 at a time: a second pass re-reads the weight row from L1, not memory */
            for (int64_t m0 = 0; m0 < M; m0 += STREAM_MAX_ROWS) {
                const int mc = M - m0 < STREAM_MAX_ROWS ? (int)(M - m0) : STREAM_MAX_ROWS;
                float acc[STREAM_MAX_ROWS];
                fns[mc](xs + m0 * K, w + n * K, K, acc);
                store_tile(y, y_dtype, bias, acc, m0, n, mc, 1, N);
            }
        }
    } else {
        static const tile_fn fns[TILE_M + 1][TILE_N + 1] = {
            {0, 0, 0}, {0, tile_1_1, tile_1_2}, {0, tile_2_1, tile_2_2}, {0, tile_3_1, tile_3_2}};
        const int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t n_end = (b + 1) * NB < N ? (b + 1) * NB : N;
            for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
                const int mr = M - m0 < TILE_M ? (int)(M - m0) : TILE_M;
                for (int64_t n0 = b * NB; n0 < n_end; n0 += TILE_N) {
                    const int nr = n_end - n0 < TILE_N ? (int)(n_end - n0) : TILE_N;
                    float acc[TILE_M * TILE_N];
                    fns[mr][nr](xs + m0 * K, w + n0 * K, K, acc);
                    store_tile(y, y_dtype, bias, acc, m0, n0, mr, nr, N);
                }
            }
        }
    }
    free(xs);
    return 0;
#else
    (void)x; (void)x_dtype; (void)x_stride; (void)w; (void)bias; (void)y; (void)y_dtype; (void)M; (void)N; (void)K;
    (void)invariant;
    return -2;
#endif
}
