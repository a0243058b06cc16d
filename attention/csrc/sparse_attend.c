/* The shared inner loop of the sparse decode kernels (declared in sparse_attend.h): attention of a
 * KV head's query group over chosen ranges of a sequence's paged keys.
 *
 * Two passes instead of a per-key online softmax: the scores of every chosen key go to a scratch
 * row per query head (head-major, so the max, the exp and the sum run over contiguous floats), then
 * one pass of p.V. On a CPU with AVX2 and FMA (the library is built with -march=native) the dots,
 * the exp and the p.V run 8 fp32 lanes wide, bf16 keys widened in registers (a bf16 is the top
 * half of an fp32: zero-extend and shift); the scalar loops serve other CPUs, head dims that are
 * not a multiple of 8, and the tests, which switch the vector path off to compare the two.
 * All math is fp32 whatever the storage dtype.
 */
#include "sparse_attend.h"

#include <math.h>
#include <string.h>

#include "dtypes.h"

static int fast_enabled = 1;
void sparse_attend_set_fast_path(int enabled) { fast_enabled = enabled; }

static inline float dot_scalar(const float *q, const void *k, int kv_dtype, int64_t off, int64_t n) {
    float acc = 0.f;
    if (kv_dtype == DT_BF16) {
        const uint16_t *kk = (const uint16_t *)k + off;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) acc += q[i] * bf16_to_f32(kk[i]);
    } else {
        const float *kk = (const float *)k + off;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) acc += q[i] * kk[i];
    }
    return acc;
}

static inline void axpy_scalar(float *acc, float p, const void *v, int kv_dtype, int64_t off, int64_t n) {
    if (kv_dtype == DT_BF16) {
        const uint16_t *vv = (const uint16_t *)v + off;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) acc[i] += p * bf16_to_f32(vv[i]);
    } else {
        const float *vv = (const float *)v + off;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) acc[i] += p * vv[i];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
int sparse_attend_fast_available(void) { return 1; }

static inline __m256 load8(const void *base, int kv_dtype, int64_t off) {
    if (kv_dtype == DT_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + off);
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline float dot_avx2(const float *q, const void *k, int kv_dtype, int64_t off, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, kv_dtype, off + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k, kv_dtype, off + i + 8), a1);
    }
    for (; i < n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, kv_dtype, off + i), a0);
    return hsum8(_mm256_add_ps(a0, a1));
}

/* e^x for x <= 0 (scores minus their max): Cephes' expf polynomial (as paged_decode.c's exp512),
 * 2^n put into the exponent bits; below -87.3 (e^x < 1.2e-38) it returns ~1e-38 */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* sc[0..n) = exp(sc - mx), returns their sum */
static inline float exp_sum_avx2(float *sc, int64_t n, float mx) {
    const __m256 m8 = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i), m8));
        _mm256_storeu_ps(sc + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float s = hsum8(sum);
    for (; i < n; i++) { sc[i] = expf(sc[i] - mx); s += sc[i]; }
    return s;
}
#else
int sparse_attend_fast_available(void) { return 0; }
#endif

float sparse_dot(const float *q, const void *k, int kv_dtype, int64_t off, int64_t D) {
#ifdef HAVE_AVX2
    if (fast_enabled && D % 8 == 0) return dot_avx2(q, k, kv_dtype, off, D);
#endif
    return dot_scalar(q, k, kv_dtype, off, D);
}

void sparse_axpy(float *acc, float p, const void *v, int kv_dtype, int64_t off, int64_t D) {
#ifdef HAVE_AVX2
    if (fast_enabled && D % 8 == 0) {
        const __m256 p8 = _mm256_set1_ps(p);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p8, load8(v, kv_dtype, off + d), _mm256_loadu_ps(acc + d)));
        return;
    }
#endif
    axpy_scalar(acc, p, v, kv_dtype, off, D);
}

float sparse_exp_sum(float *x, int64_t n, float mx) {
#ifdef HAVE_AVX2
    if (fast_enabled) return exp_sum_avx2(x, n, mx);
#endif
    float sum = 0.f;
    for (int64_t i = 0; i < n; i++) { x[i] = expf(x[i] - mx); sum += x[i]; }
    return sum;
}

void sparse_attend(const float *qf, const void *k_cache, const void *v_cache, int kv_dtype, const int32_t *table,
                   const int64_t *t0, const int64_t *t1, int64_t nranges, int64_t block_size, int64_t token_stride,
                   int64_t h, int64_t group, int64_t D, float *sc, float *acc, float *m, float *s) {
    int64_t n = 0;
    for (int64_t i = 0; i < nranges; i++) n += t1[i] > t0[i] ? t1[i] - t0[i] : 0;
    memset(acc, 0, sizeof(float) * (size_t)(group * D));
    for (int64_t g = 0; g < group; g++) { m[g] = -INFINITY; s[g] = 0.f; }
    if (n == 0) return;
#ifdef HAVE_AVX2
    const int fast = fast_enabled && D % 8 == 0;
#endif
    /* pass 1: scores, head-major: sc[g * n + key] */
    int64_t at = 0;
    for (int64_t i = 0; i < nranges; i++)
        for (int64_t t = t0[i]; t < t1[i]; t++, at++) {
            const int64_t off = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + h * D;
            for (int64_t g = 0; g < group; g++) {
#ifdef HAVE_AVX2
                const float x = fast ? dot_avx2(qf + g * D, k_cache, kv_dtype, off, D) : dot_scalar(qf + g * D, k_cache, kv_dtype, off, D);
#else
                const float x = dot_scalar(qf + g * D, k_cache, kv_dtype, off, D);
#endif
                sc[g * n + at] = x;
                if (x > m[g]) m[g] = x;
            }
        }
    /* exp(score - max) in place and the sums */
    for (int64_t g = 0; g < group; g++) {
        float *row = sc + g * n;
#ifdef HAVE_AVX2
        if (fast) { s[g] = exp_sum_avx2(row, n, m[g]); continue; }
#endif
        float sum = 0.f;
        for (int64_t i = 0; i < n; i++) { row[i] = expf(row[i] - m[g]); sum += row[i]; }
        s[g] = sum;
    }
    /* pass 2: acc[g] += p v, the same keys in the same order */
    at = 0;
    for (int64_t i = 0; i < nranges; i++)
        for (int64_t t = t0[i]; t < t1[i]; t++, at++) {
            const int64_t off = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + h * D;
#ifdef HAVE_AVX2
            if (fast) {
                if (group <= 4) { /* the group's accumulators for 8 dims stay in registers across its rows */
                    __m256 p[4];
                    for (int64_t g = 0; g < group; g++) p[g] = _mm256_set1_ps(sc[g * n + at]);
                    for (int64_t d = 0; d < D; d += 8) {
                        const __m256 v = load8(v_cache, kv_dtype, off + d);
                        for (int64_t g = 0; g < group; g++)
                            _mm256_storeu_ps(acc + g * D + d, _mm256_fmadd_ps(p[g], v, _mm256_loadu_ps(acc + g * D + d)));
                    }
                } else {
                    for (int64_t g = 0; g < group; g++) {
                        const __m256 p = _mm256_set1_ps(sc[g * n + at]);
                        for (int64_t d = 0; d < D; d += 8)
                            _mm256_storeu_ps(acc + g * D + d, _mm256_fmadd_ps(p, load8(v_cache, kv_dtype, off + d), _mm256_loadu_ps(acc + g * D + d)));
                    }
                }
                continue;
            }
#endif
            for (int64_t g = 0; g < group; g++) axpy_scalar(acc + g * D, sc[g * n + at], v_cache, kv_dtype, off, D);
        }
}
