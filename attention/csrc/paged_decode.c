/* Paged attention rows for the CPU: query rows, each against its own list of paged K/V tokens.
 *
 * A row is one query token (all its heads) with a block table and a key count: a decode token
 * sees its whole sequence, row j of a prefill chunk its causal prefix, and a row of a segmented
 * step (a query against one cached document or prefix) that segment's keys. The caller merges a
 * token's rows by their log-sum-exp (written to `lse` when asked), so the kernel knows nothing of
 * segments. Reads each row's K and V once, straight out of the paged cache (NHD layout:
 * [num_blocks, block_size, num_kv_heads, head_dim]), so no per-layer gather copy is made; the
 * grouped query heads that share a KV head are processed together, so every K/V row is loaded
 * once per step. Scores, softmax and the weighted sum of V are in fp32 whatever the storage
 * dtype. Work items are (row, kv head range) pairs, spread over the OpenMP threads of the
 * process (the same libgomp torch uses, so no second thread pool competes for the cores).
 *
 * bf16 q and K/V with head_dim 64, 128 or 256 on a CPU with AVX512-BF16 take a vectorised path
 * (`item_bf16`): q.k with the bf16 dot instruction (exact products, fp32 sums; 16 dot vectors
 * reduced to 16 scores by one shuffle tree: 16 rows of a token, or for items of up to 8 rows 16
 * tokens of a row), a vectorised exp, and p.V in fp32 with the probability-weighted V rows
 * accumulated in registers. A CPU with AVX2 + FMA but no AVX512-BF16
 * takes its 8-lane twin (bf16 widened exactly by a shift or a mask, fp32 FMAs). The scalar-loop
 * path serves every other combination and is the reference the fast path is tested against.
 *
 * Read in place (host_pool.h): a block-table entry with bit 30 set (HOST_BLOCK) names a block of
 * `k_host` / `v_host` (the KV host tier), chosen per block, so one row may mix both pools.
 *
 * Built at first use by cuttle/attention/native/build.py with the host compiler; plain C so it
 * compiles in about a second and needs no torch headers. Python binding:
 * cuttle/attention/native_attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "host_pool.h"
#include "reduce16.h"
#include "vec_exp.h"

static inline __attribute__((always_inline)) float dot_bf16(const float *q, const uint16_t *k, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; d++) acc += q[d] * bf16_to_f32(k[d]);
    return acc;
}

static inline __attribute__((always_inline)) float dot_f32(const float *q, const float *k, int64_t n) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; d++) acc += q[d] * k[d];
    return acc;
}

static inline __attribute__((always_inline)) void axpy_bf16(float *acc, float p, const uint16_t *v, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) acc[d] += p * bf16_to_f32(v[d]);
}

static inline __attribute__((always_inline)) void axpy_f32(float *acc, float p, const float *v, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) acc[d] += p * v[d];
}

/* The first element of block table[b] in its pool (host or device) */
static inline __attribute__((always_inline)) const uint16_t *block_start(const uint16_t *dev, const uint16_t *host_pool,
                                                                        const int32_t *table, int64_t b, int64_t block_size,
                                                                        int64_t token_stride) {
    int host;
    const int64_t base = block_base(table[b], block_size, token_stride, &host);
    return (host ? host_pool : dev) + base;
}

/* Blocks lie scattered through the pool, so the hardware prefetchers cannot run ahead of a walk
 * from one block to the next: the fast paths' walks ask for the block two ahead themselves, into
 * L2 (locality 1: prefetcht2 on x86; t1 / t0 and one block ahead were slower on a Zen4 EPYC).
 * This asks for the item's part of block b of a bf16 cache (the fast paths'): its tokens' `lines`
 * cache lines from element `off` (the item's first head). In a decode step the KV comes from memory (the weights' stream has
 * just emptied the caches): there, with the row-major pass's chunk order below, one layer's call
 * on a pool of scattered blocks went, cache flushed before each call, 2 threads, Zen4: 1 row x
 * 1000 tokens (4 KV heads x 64) 0.099 -> 0.078 ms, 1 x 8000 (8 x 128) 2.58 -> 1.33 ms, 64 x 200
 * 1.07 -> 0.80 ms, 16 x 4000 5.43 -> 3.96 ms; the AVX2 build on the same CPU 1.3-1.6x. A Qwen3-0.6B-
 * shaped batch-1 step at 3800 tokens: 55.5 -> 39.8 ms with this switch alone (on / off alternating
 * step by step). Warm (the same small call repeated in cache) it costs: 1 x 1000 tokens 34 -> 42
 * us. paged_decode_set_prefetch(0) turns it off (A/B timing; the results are the same bits). */
static int prefetch_on = 1;
static inline __attribute__((always_inline)) void prefetch_block(const uint16_t *dev, const uint16_t *host_pool,
                                                                 const int32_t *table, int64_t b, int64_t len, int64_t block_size,
                                                                 int64_t token_stride, int64_t off, int64_t lines) {
    if (!prefetch_on || b * block_size >= len) return;
    const char *p = (const char *)(block_start(dev, host_pool, table, b, block_size, token_stride) + off);
    const int64_t n = len - b * block_size < block_size ? len - b * block_size : block_size;
    for (int64_t t = 0; t < n; t++)
        for (int64_t l = 0; l < lines; l++) __builtin_prefetch(p + t * token_stride * 2 + 64 * l, 0, 1);
}

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_FAST_BF16 1

extern int paged_decode_row_major; /* paged_decode_set_row_major (tests) */

/* Items with at most this many query rows lay their scores out row-major and reduce 16 tokens of
 * one row at a time (below); larger items 16 rows of one token (token-major). */
#define ROW_MAJOR_MAX_ROWS 8

/* One work item on the fast path: query rows [0, nrows) of the item (heads h0.. with `group`
 * query heads each) against one sequence; acc: [nrows][D] fp32. D is a compile-time constant at
 * every call. The scores are token-major ([len][rp], rp = nrows rounded up to 16: one reduce tree
 * turns 16 rows' dot vectors of one token into 16 scores) or, with at most ROW_MAJOR_MAX_ROWS rows
 * (a decode batch's item: a KV head or two of GQA), row-major ([nrows][lp], lp = len rounded up to
 * 16: the tree turns 16 tokens' dot vectors of one row into 16 scores, and the exponentials run 16
 * tokens a vector instead of mostly padding). Both give the same bits: each score is the same
 * dot-instruction sum reduced by the same tree (its lane order does not depend on the slot), the
 * maximum and the exponentials are exact per element, and each row's sum runs over its tokens in
 * order either way. At 2 rows an item (batch-1 decode of the MoE preset: 4 KV heads of 2 query
 * heads, 2 threads) the 8 layers' attention took 0.086 -> 0.059 ms at 200 tokens and 0.394 ->
 * 0.247 ms at 1000 (both layouts alternating in one process). */
static inline __attribute__((always_inline)) void item_bf16(
    const uint16_t *q, const uint16_t *k_dev, const uint16_t *v_dev, const uint16_t *k_host, const uint16_t *v_host,
    void *out, int out_dtype, const int32_t *table, int64_t len, int64_t skip, int64_t block_size, int64_t token_stride, int64_t h0,
    int64_t nrows, int64_t group, const int D, float scale, float *scores, float *acc, float *lse) {
    const int C = D / 32; /* 32-element chunks per head row */
    const int rm = nrows <= ROW_MAJOR_MAX_ROWS && paged_decode_row_major;
    const int64_t rp = (nrows + 15) & ~(int64_t)15, lp = (len + 15) & ~(int64_t)15;
    /* score of token t, row r: at t * st + r * sr */
    const int64_t st = rm ? 1 : rp, sr = rm ? lp : 1;
    float inv_sum[512], row_max[512], row_sum[512];
    const int64_t lines = (nrows / group) * D / 32; /* cache lines of one token's K (or V) for the item's heads */
    if (rm) {
        /* pass 1: scores[r][t] = scale * q_r . k_t, 16 tokens of a row at a time through the tree;
         * every row of the item over one 16-token chunk before the next chunk, so that the chunk's
         * K rows (all the item's heads) are read from memory once and then from L1 (row by row
         * over all tokens, each head's K was read once per query row of its group, from memory
         * once a row's K outgrew L2: 1.15-1.35x at 1000-8000 tokens, 0.97x on a small row in
         * cache; same scores, same tree) */
        const uint16_t *kp[16];
        int64_t b = 0, off = 0;
        const uint16_t *kb = block_start(k_dev, k_host, table, 0, block_size, token_stride) + h0 * D;
        for (int64_t pb = 1; pb <= 2; pb++) prefetch_block(k_dev, k_host, table, pb, len, block_size, token_stride, h0 * D, lines);
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
            const int nt = len - t0 < 16 ? (int)(len - t0) : 16;
            for (int i = 0; i < nt; i++) {
                kp[i] = kb + off * token_stride;
                if (++off == block_size && (++b) * block_size < len) {
                    off = 0;
                    kb = block_start(k_dev, k_host, table, b, block_size, token_stride) + h0 * D;
                    prefetch_block(k_dev, k_host, table, b + 2, len, block_size, token_stride, h0 * D, lines);
                }
            }
            for (int64_t r = 0; r < nrows; r++)
                _mm512_storeu_ps(scores + r * lp + t0, _mm512_mul_ps(dot16_bf16(q + r * D, kp, nt, (r / group) * D, C), _mm512_set1_ps(scale)));
        }
        for (int64_t r = 0; r < nrows; r++) /* keys before the window: no part in the max */
            for (int64_t t = 0; t < skip; t++) scores[r * lp + t] = -INFINITY;
        for (int64_t r = 0; r < nrows; r++) {
            float *sc = scores + r * lp;
            /* softmax numerators in place, 16 tokens a vector; the sum in token order */
            const __mmask16 tail = len % 16 ? (__mmask16)((1u << (len % 16)) - 1) : (__mmask16)0xFFFF;
            __m512 mv = _mm512_set1_ps(-INFINITY);
            for (int64_t t0 = 0; t0 < len; t0 += 16)
                mv = _mm512_mask_max_ps(mv, t0 + 16 <= len ? (__mmask16)0xFFFF : tail, mv, _mm512_loadu_ps(sc + t0));
            const float m = _mm512_reduce_max_ps(mv);
            for (int64_t t0 = 0; t0 < len; t0 += 16)
                _mm512_storeu_ps(sc + t0, exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + t0), _mm512_set1_ps(m))));
            for (int64_t t = 0; t < skip; t++) sc[t] = 0.f; /* (the exp floors at ~1e-38, not 0) */
            row_max[r] = m;
        }
        /* each row's sum in token order (what the token-major lanes add up), rows side by side */
        float sum[ROW_MAJOR_MAX_ROWS] = {0};
        for (int64_t t = 0; t < len; t++)
            for (int64_t r = 0; r < nrows; r++) sum[r] += scores[r * lp + t];
        for (int64_t r = 0; r < nrows; r++) {
            row_sum[r] = sum[r];
            inv_sum[r] = 1.f / sum[r];
        }
    } else {
        /* pass 1: scores[t][r] = scale * q_r . k_t, 16 rows at a time through the reduce tree */
        prefetch_block(k_dev, k_host, table, 1, len, block_size, token_stride, h0 * D, lines);
        for (int64_t t0 = 0; t0 < len; t0 += block_size) {
            int host;
            const int64_t base = block_base(table[t0 / block_size], block_size, token_stride, &host);
            const uint16_t *k_cache = host ? k_host : k_dev;
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;
            prefetch_block(k_dev, k_host, table, t0 / block_size + 2, len, block_size, token_stride, h0 * D, lines);
            for (int64_t tt = 0; tt < n; tt++) {
                const uint16_t *krow = k_cache + base + tt * token_stride + h0 * D;
                for (int64_t r0 = 0; r0 < nrows; r0 += 16) {
                    __m512 a[16];
#pragma GCC unroll 16
                    for (int i = 0; i < 16; i++) {
                        a[i] = _mm512_setzero_ps();
                        const int64_t r = r0 + i;
                        if (r < nrows) {
                            const uint16_t *kh = krow + (r / group) * D, *qr = q + r * D;
#pragma GCC unroll 8
                            for (int c = 0; c < C; c++)
                                a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(qr + 32 * c),
                                                        (__m512bh)_mm512_loadu_si512(kh + 32 * c));
                        }
                    }
                    _mm512_storeu_ps(scores + (t0 + tt) * rp + r0, _mm512_mul_ps(reduce16_ps(a), _mm512_set1_ps(scale)));
                }
            }
        }
        /* softmax numerators e = exp(s - max) in place; sums kept for the end (len >= 1 here) */
        for (int64_t r0 = 0; r0 < rp; r0 += 16) {
            __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < skip; t++) _mm512_storeu_ps(scores + t * rp + r0, _mm512_setzero_ps()); /* before the window */
            for (int64_t t = skip; t < len; t++) m = _mm512_max_ps(m, _mm512_loadu_ps(scores + t * rp + r0));
            for (int64_t t = skip; t < len; t++) {
                const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + t * rp + r0), m));
                _mm512_storeu_ps(scores + t * rp + r0, e);
                sum = _mm512_add_ps(sum, e);
            }
            _mm512_storeu_ps(inv_sum + r0, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
            _mm512_storeu_ps(row_max + r0, m);
            _mm512_storeu_ps(row_sum + r0, sum);
        }
    }
    if (lse)
        for (int64_t r = 0; r < nrows; r++) lse[r] = row_max[r] + logf(row_sum[r]);
    /* pass 2: acc_r += e[t][r] * v_t, per block and kv head with the group's accumulators in
     * registers. A bf16 pair (32 bits) splits into its even element (<< 16) and its odd one
     * (& 0xffff0000) with one op each, so acc holds each 32-chunk as [16 even dims | 16 odd
     * dims]; the order is undone once at the end. */
    const int RG = D == 256 ? 1 : D == 128 ? 2 : 4; /* rows whose accumulators fit in 16 registers */
    memset(acc, 0, sizeof(float) * (size_t)(nrows * D));
    for (int64_t pb = 0; pb < 2; pb++) prefetch_block(v_dev, v_host, table, pb, len, block_size, token_stride, h0 * D, lines);
    const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        int host;
        const int64_t base = block_base(table[t0 / block_size], block_size, token_stride, &host);
        const uint16_t *v_cache = host ? v_host : v_dev;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        prefetch_block(v_dev, v_host, table, t0 / block_size + 2, len, block_size, token_stride, h0 * D, lines);
        for (int64_t h = 0; h * group < nrows; h++) {
            for (int64_t g0 = 0; g0 < group; g0 += RG) {
                const int64_t r0 = h * group + g0;
                const int rg = group - g0 < RG ? (int)(group - g0) : RG;
                __m512 va[16];
#pragma GCC unroll 16
                for (int i = 0; i < RG * 2 * C; i++) va[i] = i / (2 * C) < rg ? _mm512_loadu_ps(acc + (r0 + i / (2 * C)) * D + 16 * (i % (2 * C))) : _mm512_setzero_ps();
                for (int64_t tt = 0; tt < n; tt++) {
                    const uint16_t *vrow = v_cache + base + tt * token_stride + (h0 + h) * D;
                    const float *e = scores + (t0 + tt) * st + r0 * sr;
#pragma GCC unroll 8
                    for (int c = 0; c < C; c++) {
                        const __m512i v = _mm512_loadu_si512(vrow + 32 * c);
                        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
#pragma GCC unroll 4
                        for (int i = 0; i < RG; i++) {
                            if (i < rg) {
                                const __m512 p = _mm512_set1_ps(e[i * sr]);
                                va[i * 2 * C + 2 * c] = _mm512_fmadd_ps(p, ve, va[i * 2 * C + 2 * c]);
                                va[i * 2 * C + 2 * c + 1] = _mm512_fmadd_ps(p, vo, va[i * 2 * C + 2 * c + 1]);
                            }
                        }
                    }
                }
#pragma GCC unroll 16
                for (int i = 0; i < RG * 2 * C; i++)
                    if (i / (2 * C) < rg) _mm512_storeu_ps(acc + (r0 + i / (2 * C)) * D + 16 * (i % (2 * C)), va[i]);
            }
        }
    }
    for (int64_t r = 0; r < nrows; r++) {
        const float inv = inv_sum[r];
        for (int c = 0; c < C; c++)
            for (int j = 0; j < 32; j++) {
                /* dim 32c + j sits at 32c + j/2 (even j) or 32c + 16 + j/2 (odd j) */
                const float v = acc[r * D + 32 * c + (j & 1) * 16 + j / 2] * inv;
                const int64_t o = r * D + 32 * c + j;
                if (out_dtype == DT_BF16) ((uint16_t *)out)[o] = f32_to_bf16(v);
                else ((float *)out)[o] = v;
            }
    }
}

#define ITEM_BF16(D_)                                                                                   \
    static void item_bf16_##D_(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *kh,    \
                               const uint16_t *vh, void *out, int od, const int32_t *table, int64_t len,  \
                               int64_t skip, int64_t bs, int64_t ts, int64_t h0, int64_t nrows, int64_t group, \
                               float scale, float *scores, float *acc, float *qf, float *lse) {           \
        (void)qf;                                                                                       \
        item_bf16(q, k, v, kh, vh, out, od, table, len, skip, bs, ts, h0, nrows, group, D_, scale, scores, acc, lse); \
    }
ITEM_BF16(64)
ITEM_BF16(128)
ITEM_BF16(256)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_FAST_BF16 1



/* The AVX2 + FMA twin of the item above, for CPUs without the bf16 dot instruction (AMD Zen 2/3):
 * a bf16 pair (32 bits) splits into its even element (<< 16) and its odd one (& 0xffff0000), so
 * q is widened once into qf with each 16-dim block as [8 even | 8 odd] dims, q.k is two FMAs per
 * 16 dims against one K load, and 8 query rows' dot vectors are reduced to 8 scores at once.
 * scores: [len][rp] (rp = nrows rounded up to 8 here; the caller's buffer rounds to 16); acc:
 * [nrows][D] in the same even/odd order, undone at the end. */
static inline __attribute__((always_inline)) void item_bf16(
    const uint16_t *q, const uint16_t *k_dev, const uint16_t *v_dev, const uint16_t *k_host, const uint16_t *v_host,
    void *out, int out_dtype, const int32_t *table, int64_t len, int64_t skip, int64_t block_size, int64_t token_stride, int64_t h0,
    int64_t nrows, int64_t group, const int D, float scale, float *scores, float *acc, float *qf, float *lse) {
    const int C = D / 16; /* 16-element blocks per head row */
    const int64_t rp = (nrows + 7) & ~(int64_t)7;
    const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
    for (int64_t r = 0; r < nrows; r++)
        for (int d = 0; d < D; d++) /* dim d of a block of 16: even -> slot d/2, odd -> 8 + d/2 */
            qf[r * D + (d & ~15) + (d & 1) * 8 + ((d & 15) >> 1)] = bf16_to_f32(q[r * D + d]);
    const int64_t lines = (nrows / group) * D / 32; /* cache lines of one token's K (or V) for the item's heads */
    /* pass 1: scores[t][r] = scale * q_r . k_t, 8 rows at a time through the reduce tree */
    prefetch_block(k_dev, k_host, table, 1, len, block_size, token_stride, h0 * D, lines);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        int host;
        const int64_t base = block_base(table[t0 / block_size], block_size, token_stride, &host);
        const uint16_t *k_cache = host ? k_host : k_dev;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        prefetch_block(k_dev, k_host, table, t0 / block_size + 2, len, block_size, token_stride, h0 * D, lines);
        for (int64_t tt = 0; tt < n; tt++) {
            const uint16_t *krow = k_cache + base + tt * token_stride + h0 * D;
            for (int64_t r0 = 0; r0 < nrows; r0 += 8) {
                __m256 a[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    a[i] = _mm256_setzero_ps();
                    const int64_t r = r0 + i;
                    if (r < nrows) {
                        const uint16_t *kh = krow + (r / group) * D;
                        const float *qr = qf + r * D;
                        __m256 b = _mm256_setzero_ps();
#pragma GCC unroll 16
                        for (int c = 0; c < C; c++) {
                            const __m256i kv = _mm256_loadu_si256((const __m256i *)(kh + 16 * c));
                            a[i] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(kv, 16)), _mm256_loadu_ps(qr + 16 * c), a[i]);
                            b = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(kv, hi_mask)), _mm256_loadu_ps(qr + 16 * c + 8), b);
                        }
                        a[i] = _mm256_add_ps(a[i], b);
                    }
                }
                _mm256_storeu_ps(scores + (t0 + tt) * rp + r0, _mm256_mul_ps(reduce8_ps(a), _mm256_set1_ps(scale)));
            }
        }
    }
    /* softmax numerators e = exp(s - max) in place; sums kept for the end (len >= 1 here) */
    float inv_sum[512], row_max[512], row_sum[512];
    for (int64_t r0 = 0; r0 < rp; r0 += 8) {
        __m256 m = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < skip; t++) _mm256_storeu_ps(scores + t * rp + r0, _mm256_setzero_ps()); /* before the window */
        for (int64_t t = skip; t < len; t++) m = _mm256_max_ps(m, _mm256_loadu_ps(scores + t * rp + r0));
        for (int64_t t = skip; t < len; t++) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + t * rp + r0), m));
            _mm256_storeu_ps(scores + t * rp + r0, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(inv_sum + r0, _mm256_div_ps(_mm256_set1_ps(1.f), sum));
        _mm256_storeu_ps(row_max + r0, m);
        _mm256_storeu_ps(row_sum + r0, sum);
    }
    if (lse)
        for (int64_t r = 0; r < nrows; r++) lse[r] = row_max[r] + logf(row_sum[r]);
    /* pass 2: acc_r += e[t][r] * v_t, one row and 64 dims (8 accumulators in registers) at a time;
     * the V rows of a block are re-read from L1 for each row of the group and each 64-dim chunk */
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t h = r / group;
        for (int c0 = 0; c0 < D; c0 += 64) {
            __m256 va[8];
            for (int i = 0; i < 8; i++) va[i] = _mm256_setzero_ps();
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                int host;
                const int64_t base = block_base(table[t0 / block_size], block_size, token_stride, &host);
                const uint16_t *v_cache = host ? v_host : v_dev;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                if (r == 0 && c0 == 0) { /* the first walk brings the blocks in for the others */
                    if (t0 == 0) prefetch_block(v_dev, v_host, table, 1, len, block_size, token_stride, h0 * D, lines);
                    prefetch_block(v_dev, v_host, table, t0 / block_size + 2, len, block_size, token_stride, h0 * D, lines);
                }
                for (int64_t tt = 0; tt < n; tt++) {
                    const uint16_t *vrow = v_cache + base + tt * token_stride + (h0 + h) * D + c0;
                    const __m256 p = _mm256_set1_ps(scores[(t0 + tt) * rp + r]);
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(vrow + 16 * c));
                        va[2 * c] = _mm256_fmadd_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), va[2 * c]);
                        va[2 * c + 1] = _mm256_fmadd_ps(p, _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask)), va[2 * c + 1]);
                    }
                }
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + r * D + c0 + 8 * i, va[i]);
        }
    }
    for (int64_t r = 0; r < nrows; r++) {
        const float inv = inv_sum[r];
        for (int d = 0; d < D; d++) {
            const float v = acc[r * D + (d & ~15) + (d & 1) * 8 + ((d & 15) >> 1)] * inv;
            const int64_t o = r * D + d;
            if (out_dtype == DT_BF16) ((uint16_t *)out)[o] = f32_to_bf16(v);
            else ((float *)out)[o] = v;
        }
    }
}

#define ITEM_BF16(D_)                                                                                   \
    static void item_bf16_##D_(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *kh,    \
                               const uint16_t *vh, void *out, int od, const int32_t *table, int64_t len,  \
                               int64_t skip, int64_t bs, int64_t ts, int64_t h0, int64_t nrows, int64_t group, \
                               float scale, float *scores, float *acc, float *qf, float *lse) {           \
        item_bf16(q, k, v, kh, vh, out, od, table, len, skip, bs, ts, h0, nrows, group, D_, scale, scores, acc, qf, lse); \
    }
ITEM_BF16(64)
ITEM_BF16(128)
ITEM_BF16(256)
#endif

/* Tests turn the fast path off to compare it with the scalar loops on the same inputs, and the
 * row-major items off to compare them with the token-major ones (the same bits). */
static int fast_path_enabled = 1, last_call_fast = 0;
int paged_decode_row_major = 1;
void paged_decode_set_fast_path(int enabled) { fast_path_enabled = enabled; }
void paged_decode_set_row_major(int enabled) { paged_decode_row_major = enabled; }
void paged_decode_set_prefetch(int enabled) { prefetch_on = enabled; }
int paged_decode_last_call_fast(void) { return last_call_fast; }

/* q: [*, num_kv_heads * group, head_dim] rows (row stride q_row_stride elements); out likewise
 * (out_row_stride); lse: NULL or [*, num_kv_heads * group] fp32 (lse_row_stride). Row i reads q
 * row q_rows[i], attends to the first lens[i] tokens of block table tables[i] ([num_rows,
 * table_stride] block ids) but the first skips[i] of them (skips NULL: none; a sliding window
 * starting inside the row's first block, each skipped key weighted exactly 0), and writes out row out_rows[i] and, when lse is given, the natural-log
 * log-sum-exp of its scaled scores (lse row out_rows[i]). A row with no keys (lens[i] == 0) gets
 * o = 0 and lse = -inf. The scratch is sized from the longest row, found here (not passed in:
 * a recorded call (`native.graph`) replays with the lengths of its step). Table entries flagged HOST_BLOCK read
 * k_host / v_host (same layout as the caches; NULL when there is no host pool). Returns 0, -1
 * when a scratch allocation fails, -2 when a row names a host block and no host pool was given.
 *
 * A work item is one row and a range of its KV heads. Within an item the loops walk the row's
 * tokens in cache order and, per token, all heads of the range: one token's K (or V) row for all
 * heads is contiguous (num_kv_heads * head_dim elements) and a block's tokens are contiguous, so
 * memory is read in long streams the hardware prefetcher follows. (Walking one head at a time
 * instead strides by a whole token row and runs several times slower.) */
int paged_attention_rows(const void *q, int q_dtype, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, const void *k_host, const void *v_host, int kv_dtype, void *out, int out_dtype, int64_t out_row_stride,
                         float *lse, int64_t lse_row_stride, const int64_t *q_rows, const int64_t *out_rows,
                         const int32_t *tables, int64_t table_stride, const int32_t *lens, const int32_t *skips, int64_t num_rows,
                         int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                         float scale, int64_t head_chunks) {
    int failed = 0;
    int64_t max_len = 0;
    for (int64_t i = 0; i < num_rows; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
    if (!k_host || !v_host) /* a host block with no host pool would read anywhere: refuse the call */
        for (int64_t i = 0; i < num_rows; i++)
            for (int64_t b = 0; b * block_size < lens[i]; b++)
                if (tables[i * table_stride + b] & HOST_BLOCK) return -2;
    const int64_t token_stride = num_kv_heads * head_dim; /* elements between consecutive slots */
    const int64_t heads_per_item = (num_kv_heads + head_chunks - 1) / head_chunks;
    const int64_t rows_per_item = heads_per_item * group; /* query heads handled by one item */
    const int64_t score_len = max_len > 0 ? max_len : 1;
#ifdef HAVE_FAST_BF16
    typedef void (*item_fn)(const uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *,
                            void *, int, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                            float *, float *, float *, float *);
    item_fn fast = NULL;
    if (q_dtype == DT_BF16 && kv_dtype == DT_BF16 && rows_per_item <= 512 && fast_path_enabled)
        fast = head_dim == 64 ? item_bf16_64 : head_dim == 128 ? item_bf16_128 : head_dim == 256 ? item_bf16_256 : NULL;
    last_call_fast = fast != NULL;
#else
    last_call_fast = 0;
#endif
#pragma omp parallel
    {
        /* the fast path's scores: token-major [len][rows rounded to 16], or row-major [rows][len
         * rounded to 16] (items of up to ROW_MAJOR_MAX_ROWS rows) */
        const int64_t score_tm = ((rows_per_item + 15) & ~(int64_t)15) * score_len;
        const int64_t score_rm = rows_per_item * ((score_len + 15) & ~(int64_t)15);
        float *scores = (float *)malloc(sizeof(float) * (size_t)(score_tm > score_rm ? score_tm : score_rm));
        float *qf = (float *)malloc(sizeof(float) * (size_t)(rows_per_item * head_dim));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(rows_per_item * head_dim));
        if (!scores || !qf || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * head_chunks; item++) {
            if (failed) continue;
            const int64_t s = item / head_chunks;
            const int64_t h0 = (item % head_chunks) * heads_per_item;
            const int64_t h1 = h0 + heads_per_item < num_kv_heads ? h0 + heads_per_item : num_kv_heads;
            if (h0 >= h1) continue;
            const int64_t nrows = (h1 - h0) * group, len = lens[s];
            /* the row's first `skip` keys are outside its sliding window: weight 0 (skip < len) */
            const int64_t skip = skips ? skips[s] : 0;
            const int32_t *table = tables + s * table_stride;
            const int64_t qoff = q_rows[s] * q_row_stride + h0 * group * head_dim;
            const int64_t ooff = out_rows[s] * out_row_stride + h0 * group * head_dim;
            float *lse_item = lse ? lse + out_rows[s] * lse_row_stride + h0 * group : NULL;
            if (len <= 0) { /* no keys: a neutral part for the merge */
                for (int64_t i = 0; i < nrows * head_dim; i++) {
                    if (out_dtype == DT_BF16) ((uint16_t *)out)[ooff + i] = 0;
                    else ((float *)out)[ooff + i] = 0.f;
                }
                if (lse_item)
                    for (int64_t r = 0; r < nrows; r++) lse_item[r] = -INFINITY;
                continue;
            }
#ifdef HAVE_FAST_BF16
            if (fast) {
                void *o = out_dtype == DT_BF16 ? (void *)((uint16_t *)out + ooff) : (void *)((float *)out + ooff);
                fast(((const uint16_t *)q) + qoff, (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                     (const uint16_t *)k_host, (const uint16_t *)v_host, o, out_dtype,
                     table, len, skip, block_size, token_stride, h0, nrows, group, scale, scores, acc, qf, lse_item);
                continue;
            }
#endif
            for (int64_t i = 0; i < nrows * head_dim; i++)
                qf[i] = (q_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)q)[qoff + i])
                                            : ((const float *)q)[qoff + i]) * scale;
            /* pass 1: scores[r][t] for query head r = (h - h0) * group + g */
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                int host;
                const int64_t base = block_base(table[t0 / block_size], block_size, token_stride, &host);
                const void *kc = host ? k_host : k_cache;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                for (int64_t tt = 0; tt < n; tt++) {
                    const int64_t off = base + tt * token_stride + h0 * head_dim;
                    for (int64_t r = 0; r < nrows; r++) {
                        const int64_t koff = off + (r / group) * head_dim;
                        scores[r * score_len + t0 + tt] =
                            kv_dtype == DT_BF16 ? dot_bf16(qf + r * head_dim, (const uint16_t *)kc + koff, head_dim)
                                                : dot_f32(qf + r * head_dim, (const float *)kc + koff, head_dim);
                    }
                }
            }
            /* softmax in place (fp32, max-subtracted) */
            for (int64_t r = 0; r < nrows; r++) {
                float *sr = scores + r * score_len, m = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < skip; t++) sr[t] = 0.f; /* before the window */
                for (int64_t t = skip; t < len; t++) m = sr[t] > m ? sr[t] : m;
                for (int64_t t = skip; t < len; t++) { sr[t] = expf(sr[t] - m); sum += sr[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; t++) sr[t] *= inv;
                if (lse_item) lse_item[r] = m + logf(sum);
            }
            /* pass 2: the probability-weighted sum of V rows, in the same streaming order */
            memset(acc, 0, sizeof(float) * (size_t)(nrows * head_dim));
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                int host;
                const int64_t base = block_base(table[t0 / block_size], block_size, token_stride, &host);
                const void *vc = host ? v_host : v_cache;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                for (int64_t tt = 0; tt < n; tt++) {
                    const int64_t off = base + tt * token_stride + h0 * head_dim;
                    for (int64_t r = 0; r < nrows; r++) {
                        const int64_t voff = off + (r / group) * head_dim;
                        const float p = scores[r * score_len + t0 + tt];
                        if (kv_dtype == DT_BF16) axpy_bf16(acc + r * head_dim, p, (const uint16_t *)vc + voff, head_dim);
                        else axpy_f32(acc + r * head_dim, p, (const float *)vc + voff, head_dim);
                    }
                }
            }
            for (int64_t i = 0; i < nrows * head_dim; i++) {
                if (out_dtype == DT_BF16) ((uint16_t *)out)[ooff + i] = f32_to_bf16(acc[i]);
                else ((float *)out)[ooff + i] = acc[i];
            }
        }
        free(scores);
        free(qf);
        free(acc);
    }
    return failed ? -1 : 0;
}
