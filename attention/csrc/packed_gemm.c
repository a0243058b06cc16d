/* y = x @ W^T (+ bias) in bf16 on a weight packed once for AVX512-BF16: the CPU GEMM of every
 * bf16 linear layer, from one decode row to a prefill chunk.
 *
 * Why not the GEMM library: torch's bf16 matmul packs (re-lays out) W on every call, which it
 * amortises over many rows but not over 5..64, and at 5..16 rows it reads W at a third of the
 * copy bandwidth (measured here). W is the same tensor every step, so we pack it once, into the
 * order the dot instruction consumes, and the inner loop only loads and multiplies. At 1..4 rows
 * the packed weight, one sequential stream per thread, also reads faster than the row-major
 * streaming kernel (small_m_linear.c) does.
 *
 * Packed layout: panels of 64 output features; within a panel, k-pairs in order, and for each
 * k-pair the 64 features' two bf16 weights side by side:
 *     packed[p][kk][c][j] = W[64 p + c][2 kk + j]      (zero past N and past K)
 * so one k-pair of a panel is 256 contiguous bytes = 4 zmm, and VDPBF16PS multiplies a zmm of
 * (16 features x 2 k) by x's two values of that k-pair broadcast to every lane. A 6-row x 64-
 * feature tile keeps 24 fp32 accumulators in registers: per k-pair 4 weight loads and 6
 * broadcasts feed 24 dot instructions, so the loop is bound by the dot unit, not by loads.
 *
 * Each thread takes a contiguous range of panels and runs every row tile of x over a panel
 * before moving on: the panel (K x 128 bytes) is read from memory once and then from L2, and
 * the weight streams sequentially (at a few rows the kernel is bound by that stream).
 * Products are exact and sums fp32 (as in torch's bf16 GEMM); results are rounded to bf16
 * (nearest even) once, after the bias is added in fp32.
 */
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "dot_bf16.h"

#define PANEL DOT_PANEL

int packed_gemm_available(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* Number of uint16 elements of the packed form of an [N, K] weight. */
int64_t packed_weight_numel(int64_t N, int64_t K) {
    return ((N + PANEL - 1) / PANEL) * PANEL * ((K + 1) / 2) * 2;
}

/* w: [N, K] bf16 row-major (nn.Linear's layout), out: packed_weight_numel(N, K) elements. */
void pack_weight_bf16(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
    const int64_t panels = (N + PANEL - 1) / PANEL, kp = (K + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = out + p * kp * PANEL * 2;
        for (int64_t c = 0; c < PANEL; c++) {
            const int64_t n = p * PANEL + c;
            for (int64_t kk = 0; kk < kp; kk++) {
                const int64_t k = 2 * kk;
                dst[(kk * PANEL + c) * 2] = n < N ? w[n * K + k] : 0;
                dst[(kk * PANEL + c) * 2 + 1] = n < N && k + 1 < K ? w[n * K + k + 1] : 0;
            }
        }
    }
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* One MR x 64 tile: rows x[0..MR) against panel wp (dot_bf16.h); writes y columns [n0, n0 + ncols). */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t x_stride, const uint16_t *wp,
                                                       int64_t K, const int MR, const float *bias, void *y,
                                                       int y_dtype, int64_t y_stride, int64_t ncols) {
    const uint16_t *r[DOT_MAX_M];
    for (int m = 0; m < MR; m++) r[m] = x + m * x_stride;
    __m512 acc[DOT_MAX_M][4];
    dot_bf16_tile(r, MR, wp, K, acc);
    for (int v = 0; v < 4; v++) {
        const int64_t c0 = 16 * v;
        if (c0 >= ncols) break;
        const __mmask16 mask = ncols - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (ncols - c0)) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) {
            const __m512 res = _mm512_add_ps(acc[m][v], bv);
            if (y_dtype == DT_BF16)
                _mm256_mask_storeu_epi16((uint16_t *)y + m * y_stride + c0, mask, (__m256i)_mm512_cvtneps_pbh(res));
            else
                _mm512_mask_storeu_ps((float *)y + m * y_stride + c0, mask, res);
        }
    }
}

#define TILE_FN(MR_)                                                                                        \
    static void tile_##MR_(const uint16_t *x, int64_t xs, const uint16_t *wp, int64_t K, const float *bias, \
                           void *y, int yd, int64_t ys, int64_t ncols) {                                    \
        tile(x, xs, wp, K, MR_, bias, y, yd, ys, ncols);                                                    \
    }
TILE_FN(1)
TILE_FN(2)
TILE_FN(3)
TILE_FN(4)
TILE_FN(5)
TILE_FN(6)
typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, const float *, void *, int, int64_t, int64_t);
#endif

/* x: [M, K] bf16 (row stride x_stride), wp: packed [N, K] weight, bias_f32: [N] fp32 or NULL,
 * y: [M, N] bf16 or fp32 (row stride y_stride). Returns 0, or -1 without AVX512-BF16. */
int packed_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp, const float *bias_f32, void *y,
                     int y_dtype, int64_t y_stride, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512BF16__
    static const tile_fn tiles[7] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
    const int64_t panels = (N + PANEL - 1) / PANEL, panel_elems = ((K + 1) / 2) * PANEL * 2;
    const size_t esize = y_dtype == DT_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
        const uint16_t *wpp = wp + p * panel_elems;
        const float *bp = bias_f32 ? bias_f32 + n0 : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
            const int mr = M - m0 < 6 ? (int)(M - m0) : 6;
            tiles[mr](x + m0 * x_stride, x_stride, wpp, K, bp, (char *)y + (m0 * y_stride + n0) * esize, y_dtype,
                      y_stride, ncols);
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)wp; (void)bias_f32; (void)y; (void)y_dtype; (void)y_stride; (void)M; (void)N; (void)K;
    return -1;
#endif
}
