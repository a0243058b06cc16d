/* The bf16 dot tile shared by the dense packed GEMM (packed_gemm.c) and the routed experts'
 * dot layouts (moe_experts.c): M (<= 6) bf16 rows against one panel of 64 features packed as
 * k-pairs, each k-pair the 64 features' two weights side by side (4 zmm), accumulated by
 * VDPBF16PS into acc[m][0..3] (features 16 v .. 16 v + 15). Rows are pointers, so a caller may
 * pass strided rows (the GEMM) or gathered ones (an expert's tokens). Products are exact and sums
 * fp32; the instruction flushes denormal inputs and products. Static inline: M is a constant at
 * every call site, so the row loop unrolls and the accumulators stay in registers. */
#ifndef CUTTLE_DOT_BF16_H
#define CUTTLE_DOT_BF16_H
#include <stdint.h>
#include <string.h>

#define DOT_PANEL 64 /* features per panel */
#define DOT_MAX_M 6  /* rows per tile: 24 accumulators beside the 4 weight vectors */

#ifdef __AVX512BF16__
#include <immintrin.h>

/* one k-pair (w: its 128 weights) against the rows' pair kk; last_alone: an odd K's last k,
 * broadcast beside a zero (its weights' pair is zero too, and the row is never read past its end) */
static inline __attribute__((always_inline)) void dot_bf16_step(const uint16_t *const *r, const int M, const uint16_t *w,
                                                                int64_t kk, int last_alone, __m512 acc[][4]) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int m = 0; m < M; m++) {
        int32_t pr;
        if (last_alone) pr = (int32_t)r[m][2 * kk];
        else memcpy(&pr, r[m] + 2 * kk, 4);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(pr);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, b);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, b);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], w2, b);
        acc[m][3] = _mm512_dpbf16_ps(acc[m][3], w3, b);
    }
}

/* acc = rows r[0..M) (length K) against the panel wp (ceil(K/2) k-pairs) */
static inline __attribute__((always_inline)) void dot_bf16_tile(const uint16_t *const *r, const int M, const uint16_t *wp,
                                                                int64_t K, __m512 acc[][4]) {
    for (int m = 0; m < M; m++)
        for (int v = 0; v < 4; v++) acc[m][v] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk < K / 2; kk++) dot_bf16_step(r, M, wp + kk * 2 * DOT_PANEL, kk, 0, acc);
    if (K & 1) dot_bf16_step(r, M, wp + kk * 2 * DOT_PANEL, kk, 1, acc);
}
#endif
#endif
