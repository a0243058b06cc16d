/* Sixteen fp32 vectors summed lane-wise into one: lane j of the result is the horizontal sum of
 * a[j]. One transpose-and-add tree (45 shuffles / adds) instead of sixteen horizontal sums; used
 * where a kernel holds one accumulator vector per output (paged_decode.c's scores, the MXFP8
 * batch-1 decode loop's weight rows). */
#ifndef CUTTLE_REDUCE16_H
#define CUTTLE_REDUCE16_H

#if defined(__AVX512F__)
#include <immintrin.h>

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
#endif
#endif
