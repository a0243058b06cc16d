/* Attention of one KV head's query group over a *subset* of a sequence's paged keys: the inner
 * loop both sparse decode kernels share (nsa_decode.c: selected blocks and window; topk_decode.c:
 * the top-k blocks), implemented in sparse_attend.c; and, inline here, the rest of what the two
 * kernels do alike (work items, q loading, block selection, block ranges, stores). */
#ifndef CUTTLE_SPARSE_ATTEND_H
#define CUTTLE_SPARSE_ATTEND_H
#include <stdint.h>

#include "dtypes.h"
#include "host_pool.h"

/* heads * group query rows qf [heads * group][D] (fp32, already multiplied by the softmax scale;
 * row r belongs to KV head h + r / group) against the keys of the ranges [t0[i], t1[i]) of one
 * sequence (block table `table`, KV heads h .. h + heads - 1 of a [blocks, block_size, kv_heads, D]
 * cache; kv_dtype DT_F32 or DT_BF16; a HOST_BLOCK entry names a block of k_host / v_host, the same
 * layout, read in place: host_pool.h). Several consecutive heads read one contiguous run of each key
 * row, which streams where one head alone reads a short piece every token_stride elements. Two
 * passes over the keys: scores, then exp(score - max) and p.V. Writes, per query row r: m[r] = the
 * max score, s[r] = the sum of exp(score - m[r]) and acc[r][D] = sum exp(score - m[r]) v (not
 * normalised; an empty key set gives m = -inf, s = 0, acc = 0). sc: scratch of heads * group *
 * (number of keys) floats; afterwards row r's numerators exp(score - m[r]) lie at sc[r * n ..
 * r * n + n), n the number of keys, in range order. qb (or NULL): the same rows as bf16, unscaled,
 * and `scale`: with bf16 K/V and head_dim 64, 128 or 256 on a CPU with AVX512-BF16 the scores
 * are then scale * (qb . k) on the bf16 dot instruction (exact products, fp32 sums). */
void sparse_attend(const float *qf, const uint16_t *qb, float scale, const void *k_cache, const void *v_cache,
                   const void *k_host, const void *v_host, int kv_dtype, const int32_t *table, const int64_t *t0, const int64_t *t1, int64_t nranges, int64_t block_size,
                   int64_t token_stride, int64_t h, int64_t heads, int64_t group, int64_t D, float *sc, float *acc, float *m,
                   float *s);

/* x[0..n) = exp(x - mx) in place, returning their sum (vectorised like sparse_attend). */
float sparse_exp_sum(float *x, int64_t n, float mx);

/* Tests turn the vector loops (AVX2, and the bf16 dot loop where built) off to compare them with
 * the scalar loops on the same inputs; fast_available says whether this build has the AVX2 loop
 * (0 on a CPU without AVX2 + FMA). */
void sparse_attend_set_fast_path(int enabled);
int sparse_attend_fast_available(void);
extern int sparse_fast_enabled;
/* The bf16-dot loop (AVX512-BF16 builds) on or off for bf16 rows (tests, A/B timing); returns
 * whether it is now in use. */
int sparse_attend_set_dot_path(int enabled);
int sparse_attend_dot_available(void);
/* The vector loops' key prefetch on (1, the default) or off (A/B timing; the same results). */
void sparse_attend_set_prefetch(int on);

/* The loops' pieces, inline for the kernels' other loops: q . k over D of fp32 q and a cached row
 * (fp32 or bf16) at element offset off (sparse_dot); acc += p * v (axpy_scalar). */
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

/* ---- the work-item scaffolding both kernels share ------------------------------------------- */

/* Work item `item` of num_rows * head_chunks: row *r and its KV heads *h0 .. *h0 + return - 1
 * (heads_per_item of them, fewer at the end); 0 heads: nothing to do. */
static inline int64_t sparse_item(int64_t item, int64_t head_chunks, int64_t heads_per_item, int64_t num_kv_heads,
                                  int64_t *r, int64_t *h0) {
    *r = item / head_chunks;
    *h0 = (item % head_chunks) * heads_per_item;
    const int64_t h1 = *h0 + heads_per_item < num_kv_heads ? *h0 + heads_per_item : num_kv_heads;
    return h1 > *h0 ? h1 - *h0 : 0;
}

/* qf[0..n) = q[off..off+n) * scale in fp32 (q fp32 or bf16) */
static inline void sparse_load_q(float *qf, const void *q, int q_dtype, int64_t off, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++)
        qf[i] = (q_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)q)[off + i]) : ((const float *)q)[off + i]) * scale;
}

/* Block selection of one KV head among blocks 0 .. cur (the query's own is cur): the first
 * init_blocks and the local_blocks ending at cur are forced (ascending), then the best-scored
 * (bsc) of the candidates 0 .. ncand - 1 not yet taken, ties to the lower block, until `want`
 * or no candidate is left. taken: scratch of cur + 1. Returns the count written to pick. */
static inline int64_t sparse_pick_blocks(const float *bsc, char *taken, int64_t *pick, int64_t cur, int64_t ncand,
                                         int64_t want, int64_t init_blocks, int64_t local_blocks) {
    int64_t npick = 0;
    for (int64_t j = 0; j <= cur; j++) taken[j] = 0;
    for (int64_t j = 0; j <= cur && npick < want; j++)
        if (j < init_blocks || j > cur - local_blocks) { taken[j] = 1; pick[npick++] = j; }
    while (npick < want) {
        int64_t best = -1;
        for (int64_t j = 0; j < ncand; j++)
            if (!taken[j] && (best < 0 || bsc[j] > bsc[best])) best = j;
        if (best < 0) break;
        taken[best] = 1;
        pick[npick++] = best;
    }
    return npick;
}

/* The picked blocks of P keys as key ranges [pick[p], t1[p]) of a sequence of L keys (starts
 * written over the block ids); `selected` (optional, n slots at item index it) gets the block ids
 * first, -1 padded. Returns the keys the ranges hold. */
static inline int64_t sparse_block_ranges(int64_t *pick, int64_t *t1, int64_t npick, int64_t P, int64_t L,
                                          int32_t *selected, int64_t it, int64_t n) {
    if (selected)
        for (int64_t p = 0; p < n; p++) selected[it * n + p] = p < npick ? (int32_t)pick[p] : -1;
    int64_t count = 0;
    for (int64_t p = 0; p < npick; p++) {
        const int64_t a = pick[p] * P;
        t1[p] = a + P < L ? a + P : L;
        pick[p] = a;
        count += t1[p] - a;
    }
    return count;
}

/* out[off] = o, stored as fp32 or bf16 */
static inline void sparse_store(void *out, int out_dtype, int64_t off, float o) {
    if (out_dtype == DT_BF16) ((uint16_t *)out)[off] = f32_to_bf16(o);
    else ((float *)out)[off] = o;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* 8 fp32 lanes of a cached row; a bf16 is the top half of an fp32: zero-extend and shift */
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
#else
#define HAVE_AVX2 0
#endif

static inline float sparse_dot(const float *q, const void *k, int kv_dtype, int64_t off, int64_t D) {
#if HAVE_AVX2
    if (sparse_fast_enabled && D % 8 == 0) return dot_avx2(q, k, kv_dtype, off, D);
#endif
    return dot_scalar(q, k, kv_dtype, off, D);
}
#endif
