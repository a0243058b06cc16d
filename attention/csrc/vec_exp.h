/* e^x for the attention kernels' softmax, one copy of each width for every kernel that takes it
 * (paged_decode.c's AVX512 and AVX2 items, sparse_attend.c): x <= 0 (scores minus their max),
 * Cephes' expf polynomial (its coefficients below, shared by both widths); 2^n is applied by
 * scalef (AVX512) or put into the exponent bits (AVX2). Below -87.3 (e^x < 1.2e-38, nothing next
 * to the max's 1) they return ~1e-38. */
#ifndef CUTTLE_VEC_EXP_H
#define CUTTLE_VEC_EXP_H
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define VEXP_FLOOR (-87.3f)
#define VEXP_LOG2E 1.44269504088896341f
#define VEXP_LN2_HI 0.693359375f /* ln 2 split in two, so r = x - n ln2 stays exact */
#define VEXP_LN2_LO (-2.12194440e-4f)
#define VEXP_P0 1.9875691500e-4f
#define VEXP_P1 1.3981999507e-3f
#define VEXP_P2 8.3334519073e-3f
#define VEXP_P3 4.1665795894e-2f
#define VEXP_P4 1.6666665459e-1f
#define VEXP_P5 5.0000001201e-1f

static inline __attribute__((always_inline)) __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(VEXP_FLOOR));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(VEXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(VEXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(VEXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(VEXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(VEXP_P5));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(VEXP_FLOOR));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(VEXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VEXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VEXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(VEXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(VEXP_P5));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
#endif
