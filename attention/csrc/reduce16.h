/* Sixteen fp32 vectors summed lane-wise into one: lane j of the result is the horizontal sum of
 * a[j]. One transpose-and-add tree (45 shuffles / adds) instead of sixteen horizontal sums; used
 * where a kernel holds one accumulator vector per output (the decode attention kernels' scores,
 * through dot16_bf16 below; the MXFP8 batch-1 decode loop's weight rows). reduce8_ps: the same
 * for eight 8-lane vectors, in the AVX2 builds. */
#ifndef CUTTLE_REDUCE16_H
#define CUTTLE_REDUCE16_H

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

static inline __attribute__((always_inline)) __m512 reduce16_ps(const __m512 *a) {
    __m512 s[8], t[4], x[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44), _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

#if defined(__AVX512BF16__)
/* One bf16 query row q (C chunks of 32) dotted with the key rows kp[i] + off, i < nk (<= 16; the
 * other lanes are 0), on the bf16 dot instruction: the 16 sums through one tree (the decode
 * kernels' scores: paged_decode.c, sparse_attend.c). */
static inline __attribute__((always_inline)) __m512 dot16_bf16(const uint16_t *q, const uint16_t *const *kp, int nk, int64_t off,
                                                                 const int C) {
    __m512 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        a[i] = _mm512_setzero_ps();
        if (i < nk) {
#pragma GCC unroll 8
            for (int c = 0; c < C; c++)
                a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(q + 32 * c), (__m512bh)_mm512_loadu_si512(kp[i] + off + 32 * c));
        }
    }
    return reduce16_ps(a);
}
#endif
#endif

#if defined(__AVX2__)
#include <immintrin.h>
/* The AVX2 twin for 8 vectors: lane j of the result is the horizontal sum of a[j] (the AVX2
 * decode kernels' scores: paged_decode.c, sparse_attend.c). */
static inline __attribute__((always_inline)) __m256 reduce8_ps(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 t0 = _mm256_hadd_ps(s01, s23), t1 = _mm256_hadd_ps(s45, s67);
    /* t0 = [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], t1 likewise for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif
#endif
