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
#include "vec_exp.h"

#include <math.h>
#include <string.h>

int sparse_fast_enabled = 1;
void sparse_attend_set_fast_path(int enabled) { sparse_fast_enabled = enabled; }

#if HAVE_AVX2
int sparse_attend_fast_available(void) { return 1; }


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

float sparse_exp_sum(float *x, int64_t n, float mx) {
#if HAVE_AVX2
    if (sparse_fast_enabled) return exp_sum_avx2(x, n, mx);
#endif
    float sum = 0.f;
    for (int64_t i = 0; i < n; i++) { x[i] = expf(x[i] - mx); sum += x[i]; }
    return sum;
}

void sparse_attend(const float *qf, const void *k_cache, const void *v_cache, int kv_dtype, const int32_t *table,
                   const int64_t *t0, const int64_t *t1, int64_t nranges, int64_t block_size, int64_t token_stride,
                   int64_t h, int64_t heads, int64_t group, int64_t D, float *sc, float *acc, float *m, float *s) {
    const int64_t nr = heads * group; /* query rows */
    int64_t n = 0;
    for (int64_t i = 0; i < nranges; i++) n += t1[i] > t0[i] ? t1[i] - t0[i] : 0;
    memset(acc, 0, sizeof(float) * (size_t)(nr * D));
    for (int64_t r = 0; r < nr; r++) { m[r] = -INFINITY; s[r] = 0.f; }
    if (n == 0) return;
#if HAVE_AVX2
    const int fast = sparse_fast_enabled && D % 8 == 0;
#endif
    /* pass 1: scores, row-major: sc[r * n + key] */
    int64_t at = 0;
    for (int64_t i = 0; i < nranges; i++)
        for (int64_t t = t0[i]; t < t1[i]; t++, at++) {
            const int64_t off = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + h * D;
            for (int64_t r = 0; r < nr; r++) {
                const int64_t koff = off + (r / group) * D;
#if HAVE_AVX2
                const float x = fast ? dot_avx2(qf + r * D, k_cache, kv_dtype, koff, D) : dot_scalar(qf + r * D, k_cache, kv_dtype, koff, D);
#else
                const float x = dot_scalar(qf + r * D, k_cache, kv_dtype, koff, D);
#endif
                sc[r * n + at] = x;
                if (x > m[r]) m[r] = x;
            }
        }
    /* exp(score - max) in place and the sums */
    for (int64_t r = 0; r < nr; r++) {
        float *row = sc + r * n;
#if HAVE_AVX2
        if (fast) { s[r] = exp_sum_avx2(row, n, m[r]); continue; }
#endif
        float sum = 0.f;
        for (int64_t i = 0; i < n; i++) { row[i] = expf(row[i] - m[r]); sum += row[i]; }
        s[r] = sum;
    }
    /* pass 2: acc[r] += p v, the same keys in the same order */
    at = 0;
    for (int64_t i = 0; i < nranges; i++)
        for (int64_t t = t0[i]; t < t1[i]; t++, at++) {
            const int64_t off = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + h * D;
            for (int64_t hh = 0; hh < heads; hh++) {
                const int64_t voff = off + hh * D;
                float *a = acc + hh * group * D;
                const float *p = sc + hh * group * n + at;
#if HAVE_AVX2
                if (fast) {
                    if (group <= 4) { /* the group's accumulators for 8 dims stay in registers across its rows */
                        __m256 pv[4];
                        for (int64_t g = 0; g < group; g++) pv[g] = _mm256_set1_ps(p[g * n]);
                        for (int64_t d = 0; d < D; d += 8) {
                            const __m256 v = load8(v_cache, kv_dtype, voff + d);
                            for (int64_t g = 0; g < group; g++)
                                _mm256_storeu_ps(a + g * D + d, _mm256_fmadd_ps(pv[g], v, _mm256_loadu_ps(a + g * D + d)));
                        }
                    } else {
                        for (int64_t g = 0; g < group; g++) {
                            const __m256 pg = _mm256_set1_ps(p[g * n]);
                            for (int64_t d = 0; d < D; d += 8)
                                _mm256_storeu_ps(a + g * D + d, _mm256_fmadd_ps(pg, load8(v_cache, kv_dtype, voff + d), _mm256_loadu_ps(a + g * D + d)));
                        }
                    }
                    continue;
                }
#endif
                for (int64_t g = 0; g < group; g++) axpy_scalar(a + g * D, p[g * n], v_cache, kv_dtype, voff, D);
            }
        }
}
