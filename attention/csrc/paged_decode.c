/* Paged decode attention for the CPU: one new query token per sequence against its paged K/V.
 *
 * Reads each sequence's K and V rows once, straight out of the paged cache (NHD layout:
 * [num_blocks, block_size, num_kv_heads, head_dim]), so no per-layer gather copy is made; the
 * grouped query heads that share a KV head are processed together, so every K/V row is loaded
 * once per step. Scores, softmax and the weighted sum of V are in fp32 whatever the storage
 * dtype. Work items are (sequence, kv head) pairs, spread over the OpenMP threads of the
 * process (the same libgomp torch uses, so no second thread pool competes for the cores).
 *
 * Built at first use by cuttle/attention/cpu_kernels.py with the host compiler; plain C so it
 * compiles in about a second and needs no torch headers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

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

/* q, out: [rows, num_kv_heads * group, head_dim] (row stride q_row_stride / out_row_stride
 * elements); row_index[i]: the q/out row of decode sequence i; tables: [num_seqs, table_stride]
 * block ids; seq_lens[i]: keys of sequence i (>= 1). Returns 0, or -1 when a scratch
 * allocation fails (the caller falls back to the torch path).
 *
 * A work item is one sequence and a range of its KV heads. Within an item the loops walk the
 * sequence's tokens in cache order and, per token, all heads of the range: one token's K (or V)
 * row for all heads is contiguous (num_kv_heads * head_dim elements) and a block's tokens are
 * contiguous, so memory is read in long streams the hardware prefetcher follows. (Walking one
 * head at a time instead strides by a whole token row and runs several times slower.) */
int paged_decode_attention(const void *q, int q_dtype, int64_t q_row_stride, const void *k_cache,
                           const void *v_cache, int kv_dtype, void *out, int out_dtype,
                           int64_t out_row_stride, const int64_t *row_index, const int32_t *tables,
                           int64_t table_stride, const int32_t *seq_lens, int64_t num_seqs,
                           int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                           int64_t max_seq_len, float scale, int64_t head_chunks) {
    int failed = 0;
    const int64_t token_stride = num_kv_heads * head_dim; /* elements between consecutive slots */
    const int64_t heads_per_item = (num_kv_heads + head_chunks - 1) / head_chunks;
    const int64_t rows_per_item = heads_per_item * group; /* query heads handled by one item */
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(rows_per_item * max_seq_len));
        float *qf = (float *)malloc(sizeof(float) * (size_t)(rows_per_item * head_dim));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(rows_per_item * head_dim));
        if (!scores || !qf || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * head_chunks; item++) {
            if (failed) continue;
            const int64_t s = item / head_chunks;
            const int64_t h0 = (item % head_chunks) * heads_per_item;
            const int64_t h1 = h0 + heads_per_item < num_kv_heads ? h0 + heads_per_item : num_kv_heads;
            if (h0 >= h1) continue;
            const int64_t nrows = (h1 - h0) * group, len = seq_lens[s];
            const int32_t *table = tables + s * table_stride;
            const int64_t qoff = row_index[s] * q_row_stride + h0 * group * head_dim;
            for (int64_t i = 0; i < nrows * head_dim; i++)
                qf[i] = (q_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)q)[qoff + i])
                                            : ((const float *)q)[qoff + i]) * scale;
            /* pass 1: scores[r][t] for query head r = (h - h0) * group + g */
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const int64_t base = (int64_t)table[t0 / block_size] * block_size;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                for (int64_t tt = 0; tt < n; tt++) {
                    const int64_t off = (base + tt) * token_stride + h0 * head_dim;
                    for (int64_t r = 0; r < nrows; r++) {
                        const int64_t koff = off + (r / group) * head_dim;
                        scores[r * max_seq_len + t0 + tt] =
                            kv_dtype == DT_BF16 ? dot_bf16(qf + r * head_dim, (const uint16_t *)k_cache + koff, head_dim)
                                                : dot_f32(qf + r * head_dim, (const float *)k_cache + koff, head_dim);
                    }
                }
            }
            /* softmax in place (fp32, max-subtracted) */
            for (int64_t r = 0; r < nrows; r++) {
                float *sr = scores + r * max_seq_len, m = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < len; t++) m = sr[t] > m ? sr[t] : m;
                for (int64_t t = 0; t < len; t++) { sr[t] = expf(sr[t] - m); sum += sr[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; t++) sr[t] *= inv;
            }
            /* pass 2: the probability-weighted sum of V rows, in the same streaming order */
            memset(acc, 0, sizeof(float) * (size_t)(nrows * head_dim));
            for (int64_t t0 = 0; t0 < len; t0 += block_size) {
                const int64_t base = (int64_t)table[t0 / block_size] * block_size;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                for (int64_t tt = 0; tt < n; tt++) {
                    const int64_t off = (base + tt) * token_stride + h0 * head_dim;
                    for (int64_t r = 0; r < nrows; r++) {
                        const int64_t voff = off + (r / group) * head_dim;
                        const float p = scores[r * max_seq_len + t0 + tt];
                        if (kv_dtype == DT_BF16) axpy_bf16(acc + r * head_dim, p, (const uint16_t *)v_cache + voff, head_dim);
                        else axpy_f32(acc + r * head_dim, p, (const float *)v_cache + voff, head_dim);
                    }
                }
            }
            const int64_t ooff = row_index[s] * out_row_stride + h0 * group * head_dim;
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
