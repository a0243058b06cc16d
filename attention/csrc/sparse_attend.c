/* The shared inner loop of the sparse decode kernels (declared in sparse_attend.h): attention of a
 * KV head's query group over chosen ranges of a sequence's paged keys.
 *
 * Two passes instead of a per-key online softmax: the scores of every chosen key go to a scratch
 * row per query head (head-major, so the max, the exp and the sum run over contiguous floats), then
 * one pass of p.V. Both walk the keys 16 at a time (key_walk: the block table read once a block),
 * every query row of the item over a chunk before the next, with the next chunk's rows prefetched
 * (the blocks are scattered, so the hardware prefetchers do not run ahead). Three loops:
 *   - attend_dot (the library built for AVX512-BF16: Zen4, Sapphire Rapids; bf16 rows and caches,
 *     head dim 64 / 128 / 256): q . k on the bf16 dot instruction from the unscaled bf16 q, 16
 *     keys reduced to 16 scores by one tree, the exponentials 16 wide, p.V in registers;
 *   - attend_avx2 (AVX2 + FMA, fp32 or bf16 caches, head dim a multiple of 8): the same walk with
 *     8 fp32 lanes, bf16 widened in registers (a bf16 is the top half of an fp32), 8 keys a tree;
 *   - the scalar loops: other CPUs, other head dims, and the reference the tests compare the
 *     vector loops with (sparse_attend_set_fast_path(0); set_dot_path(0) leaves AVX2 alone).
 * On a Zen4 EPYC (one layer at the Qwen3-0.6B shape, cache flushed, 2 threads) the AVX2 loops of
 * before had left NSA no faster than dense attention at 8k (1.64 vs 1.50 ms); docs/nsa.md has the
 * figures of these loops against them.
 * All math is fp32 whatever the storage dtype.
 */
#include "sparse_attend.h"
#include "reduce16.h"
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

/* The keys of the ranges in order, as pointers to their rows in a cache (at byte column `col` of
 * a token; rows token_stride bytes apart; a HOST_BLOCK table entry names a block of `host`, the
 * same layout: host_pool.h), 16 at a time: the block table is read once per block instead of a
 * division per key. */
typedef struct {
    const int32_t *table;
    const int64_t *t0, *t1;
    int64_t nranges, block_size, token_stride, i, t, off;
    const char *base; /* token 0 of the current block, at col */
    const char *cache, *host;
    int64_t col;
} key_walk;

static inline void walk_seek(key_walk *w) {
    while (w->i < w->nranges && w->t >= w->t1[w->i])
        if (++w->i < w->nranges) w->t = w->t0[w->i];
    if (w->i < w->nranges) {
        w->off = w->t % w->block_size;
        const int64_t b = w->block_size == 1 ? w->t : w->t / w->block_size; /* 1: NSA's compressed entries */
        w->base = pool_block(w->cache, w->host, w->table[b], w->block_size * w->token_stride) + w->col;
    }
}

static inline void walk_start(key_walk *w, const int32_t *table, const int64_t *t0, const int64_t *t1, int64_t nranges,
                              int64_t block_size, int64_t token_stride, const char *cache, const char *host, int64_t col) {
    *w = (key_walk){table, t0, t1, nranges, block_size, token_stride, 0, nranges > 0 ? t0[0] : 0, 0, NULL, cache, host, col};
    walk_seek(w);
}

static inline __attribute__((always_inline)) int walk_next16(key_walk *w, const char *kp[16]) {
    int n = 0;
    while (n < 16 && w->i < w->nranges) {
        kp[n++] = w->base + w->off * w->token_stride;
        w->t++;
        if (++w->off == w->block_size || w->t >= w->t1[w->i]) walk_seek(w);
    }
    return n;
}

/* The chosen keys lie in scattered blocks, one head's row every token_stride elements (a page
 * holds a few tokens), so the hardware prefetchers do not run ahead of the walk: a second walker,
 * one chunk of 16 keys ahead, asks for that chunk's rows (`lines` cache lines each) into L2
 * (prefetcht2, as paged_decode.c's block prefetch). On a Zen4 EPYC, one layer at the Qwen3-0.6B
 * shape (16 / 8 heads of 128), cache flushed before each call, 2 threads, off -> on: NSA 0.63 ->
 * 0.36 ms at 8k, 1.60 -> 1.05 ms at 64k, top-k 0.64 -> 0.42 and 0.98 -> 0.69 ms (batch 1); two
 * chunks ahead measured 0.87-1.05x of one. sparse_attend_set_prefetch(0) turns it off (A/B
 * timing; the same bits). */
static int prefetch_on = 1;
void sparse_attend_set_prefetch(int on) { prefetch_on = on != 0; }

static inline __attribute__((always_inline)) void prefetch_next16(key_walk *ahead, int64_t lines) {
    if (!prefetch_on) return;
    const char *pp[16];
    const int np = walk_next16(ahead, pp);
    for (int i = 0; i < np; i++)
        for (int64_t l = 0; l < lines; l++) __builtin_prefetch(pp[i] + 64 * l, 0, 1);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DOT_BF16 1
int sparse_dot_enabled = 1;

/* sparse_attend for bf16 q (qb: the rows unscaled) and bf16 K/V on the bf16 dot instruction, D a
 * constant (64, 128, 256): 16 keys of one query row are 16 dot vectors reduced to 16 scores by one
 * shuffle tree (reduce16.h's dot16_bf16), times the scale after
 * the sum (q . k has exact products in fp32, so scale * sum is what the fp32 path computes up to
 * the rounding of sums); the exponentials 16 a vector; p.V with each query row's D accumulators in
 * registers over every key. A bf16 pair splits
 * into its even element (<< 16) and its odd one (& 0xffff0000), so the accumulators hold each 32
 * dims as [16 even | 16 odd], undone once at the end (as paged_decode.c's p.V). */
static inline __attribute__((always_inline)) void attend_dot(const uint16_t *qb, float scale, const uint16_t *k_cache,
                                                             const uint16_t *v_cache, const uint16_t *k_host,
                                                             const uint16_t *v_host, const int32_t *table, const int64_t *t0,
                                                             const int64_t *t1, int64_t nranges, int64_t block_size,
                                                             int64_t token_stride, int64_t h, int64_t heads, int64_t group,
                                                             const int D, int64_t n, float *sc, float *acc, float *m, float *s) {
    const int C = D / 32;
    const int64_t nr = heads * group;
    const __mmask16 tail = n % 16 ? (__mmask16)((1u << (n % 16)) - 1) : (__mmask16)0xFFFF;
    key_walk w;
    const char *kp[16];
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    const char *kh = (const char *)k_host, *vh = (const char *)v_host;
    const int64_t ts = 2 * token_stride; /* bytes */
    /* pass 1: scores, 16 keys of a row at a time; every row over a chunk of keys before the next
     * chunk, so the chunk's K rows come from memory once */
    key_walk ahead;
    walk_start(&w, table, t0, t1, nranges, block_size, ts, kc, kh, 2 * h * D);
    walk_start(&ahead, table, t0, t1, nranges, block_size, ts, kc, kh, 2 * h * D);
    const int64_t k_lines = heads * D / 32; /* the item's heads of one key row: bf16, 64-byte lines */
    prefetch_next16(&ahead, k_lines);
    for (int64_t at = 0; at < n; at += 16) {
        const int nk = walk_next16(&w, kp);
        prefetch_next16(&ahead, k_lines);
        const uint16_t *kr[16];
        for (int i = 0; i < nk; i++) kr[i] = (const uint16_t *)kp[i];
        for (int64_t r = 0; r < nr; r++)
            _mm512_mask_storeu_ps(sc + r * n + at, at + 16 <= n ? (__mmask16)0xFFFF : tail,
                                  _mm512_mul_ps(dot16_bf16(qb + r * D, kr, nk, (r / group) * D, C), _mm512_set1_ps(scale)));
    }
    /* the row maxima, the numerators in place and their sums */
    for (int64_t r = 0; r < nr; r++) {
        float *row = sc + r * n;
        __m512 mv = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t at = 0; at < n; at += 16)
            mv = _mm512_mask_max_ps(mv, at + 16 <= n ? (__mmask16)0xFFFF : tail, mv, _mm512_maskz_loadu_ps(at + 16 <= n ? (__mmask16)0xFFFF : tail, row + at));
        m[r] = _mm512_reduce_max_ps(mv);
        const __m512 mx = _mm512_set1_ps(m[r]);
        for (int64_t at = 0; at < n; at += 16) {
            const __mmask16 k = at + 16 <= n ? (__mmask16)0xFFFF : tail;
            const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + at), mx)));
            _mm512_mask_storeu_ps(row + at, k, e);
            sum = _mm512_add_ps(sum, e);
        }
        s[r] = _mm512_reduce_add_ps(sum);
    }
    /* pass 2: acc_r = sum p v over the keys, RG rows' accumulators in registers per walk */
    const int RG = D == 256 ? 1 : D == 128 ? 2 : 4;
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t hh = 0; hh < heads; hh++)
        for (int64_t g0 = 0; g0 < group; g0 += RG) {
            const int64_t r0 = hh * group + g0;
            const int rg = group - g0 < RG ? (int)(group - g0) : RG;
            __m512 va[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) va[i] = _mm512_setzero_ps();
            const int64_t col = 2 * (h + hh) * D;
            /* the first walk of a head brings its V rows in for the others (group > RG) */
            const int first = g0 == 0;
            walk_start(&w, table, t0, t1, nranges, block_size, ts, vc, vh, col);
            if (first) {
                walk_start(&ahead, table, t0, t1, nranges, block_size, ts, vc, vh, col);
                prefetch_next16(&ahead, D / 32);
            }
            for (int64_t at = 0; at < n; at += 16) {
                const int nk = walk_next16(&w, kp);
                if (first) prefetch_next16(&ahead, D / 32);
                for (int i = 0; i < nk; i++) {
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++) {
                        const __m512i v = _mm512_loadu_si512((const uint16_t *)kp[i] + 32 * c);
                        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
#pragma GCC unroll 4
                        for (int j = 0; j < RG; j++)
                            if (j < rg) {
                                const __m512 p = _mm512_set1_ps(sc[(r0 + j) * n + at + i]);
                                va[j * 2 * C + 2 * c] = _mm512_fmadd_ps(p, ve, va[j * 2 * C + 2 * c]);
                                va[j * 2 * C + 2 * c + 1] = _mm512_fmadd_ps(p, vo, va[j * 2 * C + 2 * c + 1]);
                            }
                    }
                }
            }
            for (int j = 0; j < rg; j++) {
                float tmp[256];
                for (int i = 0; i < 2 * C; i++) _mm512_storeu_ps(tmp + 16 * i, va[j * 2 * C + i]);
                float *a = acc + (r0 + j) * D;
                for (int c = 0; c < C; c++) /* dim 32c + d sits at 32c + d/2 (even d) or 32c + 16 + d/2 (odd d) */
                    for (int d = 0; d < 32; d++) a[32 * c + d] = tmp[32 * c + (d & 1) * 16 + d / 2];
            }
        }
}

#define ATTEND_DOT(D_)                                                                                                  \
    static void attend_dot_##D_(const uint16_t *qb, float scale, const uint16_t *k, const uint16_t *v, const uint16_t *kh,  \
                                const uint16_t *vh, const int32_t *table, const int64_t *t0, const int64_t *t1,             \
                                int64_t nranges, int64_t bs, int64_t ts, int64_t h, int64_t heads, int64_t group, int64_t n, \
                                float *sc, float *acc, float *m, float *s) {                                                \
        attend_dot(qb, scale, k, v, kh, vh, table, t0, t1, nranges, bs, ts, h, heads, group, D_, n, sc, acc, m, s);       \
    }
ATTEND_DOT(64)
ATTEND_DOT(128)
ATTEND_DOT(256)
int sparse_attend_dot_available(void) { return 1; }
#else
int sparse_dot_enabled = 0;
int sparse_attend_dot_available(void) { return 0; }
#endif

#if HAVE_AVX2
/* The AVX2 + FMA loop (fp32 or bf16 caches, D a multiple of 8): the same walk of the keys as
 * attend_dot, 16 keys a chunk with the next chunk prefetched; q . k in fp32 from the scaled fp32 q,
 * 8 keys of a row reduced to 8 scores by one tree (the loop before took a horizontal sum per key);
 * p.V with up to 3 rows x 32 dims of accumulators in registers over every key (before: loaded and
 * stored per key), the keys walked once per 32 dims and 3 rows of a head, the first walk of a
 * head prefetching for the rest. The AVX2 build (-march=znver3) timed on a Zen4 EPYC, one layer
 * at the Qwen3-0.6B shape, cache flushed, 2 threads, the loop before vs this one alternating in
 * one process: NSA 8k batch 1 2.27 -> 0.80 ms, 64k 5.84 -> 2.90, 32k batch 8 16.8 -> 10.2; top-k
 * 2.97 -> 1.22, 3.49 -> 1.52, 21.4 -> 7.3 (not timed on an AVX2-only CPU). */
static void attend_avx2(const float *qf, const void *k_cache, const void *v_cache, const void *k_host, const void *v_host,
                        int kv_dtype, const int32_t *table,
                        const int64_t *t0, const int64_t *t1, int64_t nranges, int64_t block_size, int64_t token_stride,
                        int64_t h, int64_t heads, int64_t group, int64_t D, int64_t n, float *sc, float *acc, float *m,
                        float *s) {
    const int64_t nr = heads * group, es = kv_dtype == DT_BF16 ? 2 : 4, ts = es * token_stride;
    const char *kc = (const char *)k_cache, *vc = (const char *)v_cache;
    const char *kh = (const char *)k_host, *vh = (const char *)v_host;
    key_walk w, ahead;
    const char *kp[16];
    const int64_t k_lines = (heads * D * es + 63) / 64;
    /* pass 1: scores, every row over a chunk of keys before the next chunk */
    walk_start(&w, table, t0, t1, nranges, block_size, ts, kc, kh, es * h * D);
    walk_start(&ahead, table, t0, t1, nranges, block_size, ts, kc, kh, es * h * D);
    prefetch_next16(&ahead, k_lines);
    for (int64_t at = 0; at < n; at += 16) {
        const int nk = walk_next16(&w, kp);
        prefetch_next16(&ahead, k_lines);
        for (int64_t r = 0; r < nr; r++) {
            const float *qr = qf + r * D;
            const int64_t koff = (r / group) * D;
            for (int i0 = 0; i0 < nk; i0 += 8) {
                __m256 a[8];
                for (int i = 0; i < 8; i++) {
                    a[i] = _mm256_setzero_ps();
                    if (i0 + i < nk)
                        for (int64_t d = 0; d < D; d += 8)
                            a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), load8(kp[i0 + i], kv_dtype, koff + d), a[i]);
                }
                float x[8];
                _mm256_storeu_ps(x, reduce8_ps(a));
                for (int i = 0; i < 8 && i0 + i < nk; i++) sc[r * n + at + i0 + i] = x[i];
            }
        }
    }
    for (int64_t r = 0; r < nr; r++) {
        const float *row = sc + r * n;
        __m256 mv = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + i));
        float x[8], mx = -INFINITY;
        _mm256_storeu_ps(x, mv);
        for (int j = 0; j < 8; j++) mx = x[j] > mx ? x[j] : mx;
        for (; i < n; i++) mx = row[i] > mx ? row[i] : mx;
        m[r] = mx;
        s[r] = exp_sum_avx2(sc + r * n, n, mx);
    }
    /* pass 2 */
    for (int64_t hh = 0; hh < heads; hh++) {
        const int64_t col = es * (h + hh) * D;
        int first = 1;
        for (int64_t g0 = 0; g0 < group; g0 += 3)
            for (int64_t c0 = 0; c0 < D; c0 += 32) {
                const int rg = group - g0 < 3 ? (int)(group - g0) : 3, cv = D - c0 < 32 ? (int)(D - c0) / 8 : 4;
                const int64_t r0 = hh * group + g0;
                __m256 va[12];
                for (int i = 0; i < 12; i++) va[i] = _mm256_setzero_ps();
                walk_start(&w, table, t0, t1, nranges, block_size, ts, vc, vh, col);
                if (first) { /* the first walk of a head brings its V rows in for the others */
                    walk_start(&ahead, table, t0, t1, nranges, block_size, ts, vc, vh, col);
                    prefetch_next16(&ahead, (D * es + 63) / 64);
                }
                for (int64_t at = 0; at < n; at += 16) {
                    const int nk = walk_next16(&w, kp);
                    if (first) prefetch_next16(&ahead, (D * es + 63) / 64);
                    for (int i = 0; i < nk; i++)
                        for (int c = 0; c < cv; c++) {
                            const __m256 v = load8(kp[i], kv_dtype, c0 + 8 * c);
                            for (int j = 0; j < rg; j++)
                                va[4 * j + c] = _mm256_fmadd_ps(_mm256_set1_ps(sc[(r0 + j) * n + at + i]), v, va[4 * j + c]);
                        }
                }
                first = 0;
                for (int j = 0; j < rg; j++)
                    for (int c = 0; c < cv; c++) _mm256_storeu_ps(acc + (r0 + j) * D + c0 + 8 * c, va[4 * j + c]);
            }
    }
}
#endif

/* Let bf16 rows take the bf16-dot loop where it is built (1, the default) or the AVX2 loop (0:
 * tests compare the two; A/B timing); returns whether the dot loop is now in use. */
int sparse_attend_set_dot_path(int enabled) {
    sparse_dot_enabled = enabled && sparse_attend_dot_available();
    return sparse_dot_enabled;
}

void sparse_attend(const float *qf, const uint16_t *qb, float scale, const void *k_cache, const void *v_cache,
                   const void *k_host, const void *v_host, int kv_dtype, const int32_t *table, const int64_t *t0, const int64_t *t1, int64_t nranges, int64_t block_size,
                   int64_t token_stride, int64_t h, int64_t heads, int64_t group, int64_t D, float *sc, float *acc, float *m,
                   float *s) {
    const int64_t nr = heads * group; /* query rows */
    int64_t n = 0;
    for (int64_t i = 0; i < nranges; i++) n += t1[i] > t0[i] ? t1[i] - t0[i] : 0;
    memset(acc, 0, sizeof(float) * (size_t)(nr * D));
    for (int64_t r = 0; r < nr; r++) { m[r] = -INFINITY; s[r] = 0.f; }
    if (n == 0) return;
#ifdef HAVE_DOT_BF16
    if (qb && kv_dtype == DT_BF16 && sparse_fast_enabled && sparse_dot_enabled && (D == 64 || D == 128 || D == 256)) {
        const uint16_t *k = (const uint16_t *)k_cache, *v = (const uint16_t *)v_cache;
        const uint16_t *kh = (const uint16_t *)k_host, *vh = (const uint16_t *)v_host;
        if (D == 64) attend_dot_64(qb, scale, k, v, kh, vh, table, t0, t1, nranges, block_size, token_stride, h, heads, group, n, sc, acc, m, s);
        else if (D == 128) attend_dot_128(qb, scale, k, v, kh, vh, table, t0, t1, nranges, block_size, token_stride, h, heads, group, n, sc, acc, m, s);
        else attend_dot_256(qb, scale, k, v, kh, vh, table, t0, t1, nranges, block_size, token_stride, h, heads, group, n, sc, acc, m, s);
        return;
    }
#endif
    (void)qb;
    (void)scale;
#if HAVE_AVX2
    if (sparse_fast_enabled && D % 8 == 0) {
        attend_avx2(qf, k_cache, v_cache, k_host, v_host, kv_dtype, table, t0, t1, nranges, block_size, token_stride, h, heads, group, D, n, sc,
                    acc, m, s);
        return;
    }
#endif
    /* the scalar loops. pass 1: scores, row-major: sc[r * n + key] */
    int64_t at = 0;
    int host;
    for (int64_t i = 0; i < nranges; i++)
        for (int64_t t = t0[i]; t < t1[i]; t++, at++) {
            const int64_t off = block_base(table[t / block_size], block_size, token_stride, &host) + (t % block_size) * token_stride + h * D;
            const void *kc = host ? k_host : k_cache;
            for (int64_t r = 0; r < nr; r++) {
                const float x = dot_scalar(qf + r * D, kc, kv_dtype, off + (r / group) * D, D);
                sc[r * n + at] = x;
                if (x > m[r]) m[r] = x;
            }
        }
    /* exp(score - max) in place and the sums */
    for (int64_t r = 0; r < nr; r++) {
        float *row = sc + r * n, sum = 0.f;
        for (int64_t i = 0; i < n; i++) { row[i] = expf(row[i] - m[r]); sum += row[i]; }
        s[r] = sum;
    }
    /* pass 2: acc[r] += p v, the same keys in the same order */
    at = 0;
    for (int64_t i = 0; i < nranges; i++)
        for (int64_t t = t0[i]; t < t1[i]; t++, at++) {
            const int64_t off = block_base(table[t / block_size], block_size, token_stride, &host) + (t % block_size) * token_stride + h * D;
            const void *vc = host ? v_host : v_cache;
            for (int64_t hh = 0; hh < heads; hh++)
                for (int64_t g = 0; g < group; g++)
                    axpy_scalar(acc + (hh * group + g) * D, sc[(hh * group + g) * n + at], vc, kv_dtype, off + hh * D, D);
        }
}
