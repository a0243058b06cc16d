/* Training-free top-k decode on the CPU: one query token per row against its sequence's paged
 * K/V and the per-block key summaries, reading only the summaries and the chosen blocks' keys.
 *
 * A work item is (row, range of KV heads); the GROUP query heads sharing a KV head choose one set
 * of blocks together. The summaries (and, for a row within the budget, the keys) are read for all
 * the item's heads at once, one contiguous run each (nsa_decode.c says why); the binding splits a
 * row's heads over items only when rows are fewer than twice the threads.
 * Per row and KV head (L keys, blocks of P keys, n = nsel blocks attended):
 *   1. if the query's block index t / P < n, every block is attended (dense);
 *   2. else each complete block j < L / P is scored per query head from its summary (Quest: the
 *      bound sum_i max(q_i m_i, q_i M_i); mean: q . mean), softmax over those blocks per head,
 *      summed over the group; the summary of block j sits in raw block table[e / B] at slot
 *      (e % B) / P, e = j*P + P - 1, of a [blocks, S, R, kv_heads, D] cache (R = 2: min, max);
 *   3. the first init_blocks and the local_blocks ending at the query's block are forced, then the
 *      best-scored complete blocks (ties to the lower) up to n;
 *   4. one softmax over the chosen blocks' keys (sparse_attend.c), o and the log-sum-exp written.
 * The rules are those of cuttle/attention/topk.py (the reference this kernel is tested against);
 * all math is fp32. `touched` (optional) receives per (row, KV head) the K/V tokens read, `selected`
 * (optional) the chosen blocks in rank order (forced ascending, then by score), -1 padded.
 * Read in place: a HOST_BLOCK table entry names a block of the host pool (k_host, v_host and its
 * summaries summ_host, the same layouts; host_pool.h); with no host pool such a table fails the
 * call (-2) before anything is read.
 * Python binding: cuttle/attention/native/topk.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "sparse_attend.h"

int topk_decode_rows(const void *q, int q_dtype, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                     const void *summ, const void *k_host, const void *v_host, const void *summ_host, int kv_dtype, void *out, int out_dtype, int64_t out_row_stride, float *lse,
                     int64_t lse_row_stride, const int64_t *rows, const int32_t *tables, int64_t table_stride,
                     const int32_t *lens, int64_t num_rows, int64_t num_kv_heads, int64_t group, int64_t D,
                     int64_t block_size, int64_t sslots, int64_t summary_rows, int64_t P, int64_t nsel,
                     int64_t init_blocks, int64_t local_blocks, int64_t max_len, float scale, int64_t head_chunks,
                     int32_t *selected, int64_t *touched) {
    int failed = 0;
    const int64_t token_stride = num_kv_heads * D;
    const int64_t max_blocks = (max_len + P - 1) / P + 1;
    const int64_t max_keys = (nsel < max_blocks ? nsel : max_blocks) * P;
    const int64_t heads_per_item = (num_kv_heads + head_chunks - 1) / head_chunks;
    const int64_t R = heads_per_item * group; /* query rows of an item */
#pragma omp parallel
    {
        float *qf = (float *)malloc(sizeof(float) * (size_t)(R * D));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(R * D));
        float *ps = (float *)malloc(sizeof(float) * (size_t)(R * max_blocks));
        float *bsc = (float *)malloc(sizeof(float) * (size_t)max_blocks);
        char *taken = (char *)malloc((size_t)max_blocks);
        int64_t *pick = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * max_blocks));
        float *sc = (float *)malloc(sizeof(float) * (size_t)(R * max_keys));
        float *m = (float *)malloc(sizeof(float) * (size_t)(2 * R)), *s = m + R;
        int64_t *count = (int64_t *)malloc(sizeof(int64_t) * (size_t)heads_per_item);
        if (!qf || !acc || !ps || !bsc || !taken || !pick || !sc || !m || !count) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t *t1 = pick + max_blocks;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * head_chunks; item++) {
            if (failed) continue;
            int64_t r, h0;
            const int64_t nh = sparse_item(item, head_chunks, heads_per_item, num_kv_heads, &r, &h0), nr = nh * group;
            if (nh == 0) continue;
            const int64_t L = lens[r], t = L - 1;
            const int32_t *table = tables + r * table_stride;
            if (!k_host && names_host_block(table, (L + block_size - 1) / block_size)) {
#pragma omp atomic write
                failed = 2;
                continue;
            }
            sparse_load_q(qf, q, q_dtype, rows[r] * q_row_stride + h0 * group * D, nr * D, scale);
            const uint16_t *qb = q_dtype == DT_BF16 ? (const uint16_t *)q + rows[r] * q_row_stride + h0 * group * D : NULL;
            const int64_t cur = t / P, nb = cur + 1, nfull = L / P;
            if (nb <= nsel) {
                /* 1. every block: plain causal attention, all the item's heads reading each key row
                 * as one contiguous run */
                const int64_t zero = 0;
                sparse_attend(qf, qb, scale, k_cache, v_cache, k_host, v_host, kv_dtype, table, &zero, &L, 1, block_size, token_stride, h0, nh, group, D, sc, acc, m, s);
                for (int64_t hh = 0; hh < nh; hh++) {
                    count[hh] = L;
                    if (selected)
                        for (int64_t p = 0; p < nsel; p++) selected[(r * num_kv_heads + h0 + hh) * nsel + p] = p < nb ? (int32_t)p : -1;
                }
            } else {
                /* 2. block scores for all the item's heads (one contiguous run of each summary),
                 * per query head a softmax over the complete blocks */
                for (int64_t j = 0; j < nfull; j++) {
                    const int64_t e = j * P + P - 1;
                    int host;
                    const int64_t base = block_base(table[e / block_size], sslots * summary_rows, token_stride, &host) +
                                         ((e % block_size) / P) * summary_rows * token_stride + h0 * D;
                    const void *sm = host ? summ_host : summ;
                    for (int64_t i = 0; i < nr; i++) {
                        const float *qg = qf + i * D;
                        const int64_t off = base + (i / group) * D;
                        float x;
                        if (summary_rows == 2) { /* sum_d max(q m, q M) */
                            x = 0.f;
                            if (kv_dtype == DT_BF16) {
                                const uint16_t *mn = (const uint16_t *)sm + off, *mx = mn + token_stride;
#pragma omp simd reduction(+ : x)
                                for (int64_t d = 0; d < D; d++) {
                                    const float a = qg[d] * bf16_to_f32(mn[d]), b = qg[d] * bf16_to_f32(mx[d]);
                                    x += a > b ? a : b;
                                }
                            } else {
                                const float *mn = (const float *)sm + off, *mx = mn + token_stride;
#pragma omp simd reduction(+ : x)
                                for (int64_t d = 0; d < D; d++) {
                                    const float a = qg[d] * mn[d], b = qg[d] * mx[d];
                                    x += a > b ? a : b;
                                }
                            }
                        } else {
                            x = sparse_dot(qg, sm, kv_dtype, off, D);
                        }
                        ps[i * max_blocks + j] = x;
                    }
                }
                for (int64_t i = 0; i < nr; i++) {
                    float *row = ps + i * max_blocks, mx = -INFINITY;
                    for (int64_t j = 0; j < nfull; j++) mx = row[j] > mx ? row[j] : mx;
                    const float inv = 1.f / sparse_exp_sum(row, nfull, mx);
                    for (int64_t j = 0; j < nfull; j++) row[j] *= inv;
                }
                /* 3-4 per KV head: group sum, forced blocks (ascending), then the best complete
                 * others (ties to the lower) up to n; one softmax over the chosen keys */
                for (int64_t hh = 0; hh < nh; hh++) {
                    for (int64_t j = 0; j < nb; j++) bsc[j] = 0.f;
                    for (int64_t g = 0; g < group; g++)
                        for (int64_t j = 0; j < nfull; j++) bsc[j] += ps[(hh * group + g) * max_blocks + j];
                    const int64_t npick = sparse_pick_blocks(bsc, taken, pick, cur, nfull, nsel, init_blocks, local_blocks);
                    count[hh] = sparse_block_ranges(pick, t1, npick, P, L, selected, r * num_kv_heads + h0 + hh, nsel);
                    sparse_attend(qf + hh * group * D, qb ? qb + hh * group * D : NULL, scale, k_cache, v_cache, k_host, v_host, kv_dtype, table, pick, t1, npick, block_size, token_stride,
                                  h0 + hh, 1, group, D, sc, acc + hh * group * D, m + hh * group, s + hh * group);
                }
            }
            if (touched)
                for (int64_t hh = 0; hh < nh; hh++) touched[r * num_kv_heads + h0 + hh] = count[hh];
            for (int64_t i = 0; i < nr; i++) {
                const int64_t head = h0 * group + i;
                const int64_t ooff = rows[r] * out_row_stride + head * D;
                const float inv = 1.f / s[i];
                for (int64_t d = 0; d < D; d++) sparse_store(out, out_dtype, ooff + d, acc[i * D + d] * inv);
                if (lse) lse[rows[r] * lse_row_stride + head] = m[i] + logf(s[i]);
            }
        }
        free(qf); free(acc); free(ps); free(bsc); free(taken); free(pick); free(sc); free(m); free(count);
    }
    return failed == 2 ? -2 : failed ? -1 : 0;
}
