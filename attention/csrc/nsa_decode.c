/* NSA decode on the CPU: one query token per row against the paged raw and compressed caches,
 * reading only what natively sparse attention needs (arXiv 2502.11089): the compressed entries,
 * the top-n selected blocks and the sliding window.
 *
 * A work item is (row, range of KV heads): the GROUP query heads sharing a KV head are processed
 * together, so they share one block selection (Eq. 10) and every K/V row is loaded once per
 * branch; the compressed entries and the window are read for all the item's heads at once, one
 * contiguous run per entry or key (a single head reads 2 * head_dim bytes every
 * kv_heads * head_dim * 2: at batch 8 and 64k, where the compressed cache is far larger than the
 * caches, those strided reads missed on every entry and made the kernel memory-latency bound).
 * The binding picks the range so that every thread has items (few rows: a few heads per item).
 * Per item:
 *   1. compression branch: attention over the nc = (L - l) / d + 1 complete compressed entries
 *      (entry i sits in raw block table[e / B] at slot (e % B) / d, e = i*d + l - 1), read as
 *      keys by sparse_attend through a table of their rows, so it shares the selected and window
 *      branches' loops (the bf16 dot loop included); its probabilities also score the blocks;
 *   2. block scores: each entry's probability, summed over the group, added to every selection
 *      block it shares a stride-d unit with, once per unit (Eq. 9 read per entry: weights
 *      1, 2, 2, 2, 1 for l=32, d=16, l'=64);
 *   3. selection: the first init_blocks and the local_blocks ending at the query's block, then
 *      the best-scored others (ties to the lower block) up to top_n;
 *   4. selected and window branches: one softmax each over the selected blocks' keys (the query's
 *      own block only up to the query) and over the last `window` keys, in two passes (scores,
 *      then exp and p.V: sparse_attend.c, on the bf16 dot instruction or 8 lanes wide with AVX2,
 *      where the scalar per-key online softmax this kernel had spent most of its time in expf and
 *      rescales);
 *   5. o = g_cmp o_cmp + g_slc o_slc + g_win o_win (gates fp32 [row, head, 3]); or, given
 *      `branch_out` (fp32 [row, head, 3, D], at the row's out row) and `branch_lse` (fp32 [row, head, 3]),
 *      the three branches apart, normalised, with their log-sum-exps (-inf and 0 for a branch
 *      with no key): a squid part's result, merged over the row's parts by the caller before the gates
 *      (gates and out are then not read or written).
 * The rules are those of cuttle/attention/nsa.py (the reference this kernel is tested against);
 * all math is fp32 whatever the storage dtype. `touched` (optional) receives, per (row, KV head), the KV
 * tokens this kernel actually read (compressed entries + selected keys + window keys): the
 * counter of issue 16's acceptance 4. `selected` (optional) receives the chosen blocks in rank
 * order, -1 padded. Read in place: a HOST_BLOCK table entry names a block of the host pool (k_host,
 * v_host, and its compressed entries ck_host, cv_host; the same layouts; host_pool.h); with no host
 * pool such a table fails the call (-2) before anything is read.
 * Python binding: cuttle/attention/native/nsa.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "sparse_attend.h"

int nsa_decode_rows(const void *q, int q_dtype, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                    const void *ck_cache, const void *cv_cache, const void *k_host, const void *v_host,
                    const void *ck_host, const void *cv_host, int kv_dtype, const float *gates,
                    int64_t gate_row_stride, void *out, int out_dtype, int64_t out_row_stride, const int64_t *rows,
                    const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t num_rows,
                    int64_t num_kv_heads, int64_t group, int64_t D, int64_t block_size, int64_t cslots,
                    int64_t cmp_block, int64_t cmp_stride, int64_t sel_block, int64_t top_n, int64_t init_blocks,
                    int64_t local_blocks, int64_t window, int64_t max_len, float scale, int64_t head_chunks,
                    int32_t *selected, int64_t *touched, float *branch_out, float *branch_lse) {
    int failed = 0;
    const int64_t token_stride = num_kv_heads * D;
    const int64_t max_nc = max_len >= cmp_block ? (max_len - cmp_block) / cmp_stride + 1 : 0;
    const int64_t max_blocks = (max_len + sel_block - 1) / sel_block + 1;
    const int64_t units_per_entry = cmp_block / cmp_stride, units_per_block = sel_block / cmp_stride;
    const int64_t sel_keys = (top_n < max_blocks ? top_n : max_blocks) * sel_block;
    const int64_t heads_per_item = (num_kv_heads + head_chunks - 1) / head_chunks;
    const int64_t R = heads_per_item * group; /* query rows of an item */
    const int64_t max_keys = sel_keys > window ? (sel_keys > max_nc ? sel_keys : max_nc) : (window > max_nc ? window : max_nc);
#pragma omp parallel
    {
        float *qf = (float *)malloc(sizeof(float) * (size_t)(R * D));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(3 * R * D)); /* compressed | selected | window */
        float *pc = (float *)malloc(sizeof(float) * (size_t)(R * (max_nc > 0 ? max_nc : 1)));
        float *bsc = (float *)malloc(sizeof(float) * (size_t)max_blocks);
        char *taken = (char *)malloc((size_t)max_blocks);
        int64_t *pick = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * (top_n > 0 ? top_n : 1)));
        float *m = (float *)malloc(sizeof(float) * (size_t)(6 * R)), *s = m + 3 * R;
        float *sc = (float *)malloc(sizeof(float) * (size_t)(R * (max_keys > 0 ? max_keys : 1)));
        int64_t *sel_count = (int64_t *)malloc(sizeof(int64_t) * (size_t)heads_per_item);
        int32_t *ctab = (int32_t *)malloc(sizeof(int32_t) * (size_t)(max_nc > 0 ? max_nc : 1));
        if (!qf || !acc || !pc || !bsc || !taken || !pick || !m || !sc || !sel_count || !ctab) {
#pragma omp atomic write
            failed = 1;
        }
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
            float *mc = m, *s0 = s, *a0 = acc;
            /* 1. compression branch for all the item's heads: entry i (e = i*d + l - 1) is slot
             * (e % B) / d of raw block table[e / B], i.e. row ctab[i] = table[e / B] * cslots + slot of
             * the compressed cache seen as blocks of one entry, so sparse_attend reads the entries
             * as keys (one contiguous run of the item's heads each). Its numerators, normalised,
             * also score the blocks (pc). */
            const int64_t nc = L >= cmp_block ? (L - cmp_block) / cmp_stride + 1 : 0;
            for (int64_t i = 0; i < nc; i++) {
                const int64_t e = i * cmp_stride + cmp_block - 1;
                const int32_t id = table[e / block_size]; /* a host block's entries are host rows */
                ctab[i] = (int32_t)((int64_t)(id & ~HOST_BLOCK) * cslots + (e % block_size) / cmp_stride) | (id & HOST_BLOCK);
            }
            const int64_t zero = 0;
            sparse_attend(qf, qb, scale, ck_cache, cv_cache, ck_host, cv_host, kv_dtype, ctab, &zero, &nc, 1, 1, token_stride, h0, nh, group, D,
                          sc, a0, mc, s0);
            for (int64_t j = 0; j < nr && nc > 0; j++) {
                const float inv = 1.f / s0[j];
                for (int64_t i = 0; i < nc; i++) pc[j * max_nc + i] = sc[j * nc + i] * inv;
            }
            /* 2-4 per KV head: block scores (Eq. 9 per entry, Eq. 10 over the group), selection
             * (forced blocks ascending, then the best others, ties to the lower) and the selected
             * blocks' softmax */
            const int64_t cur = t / sel_block, nb = cur + 1;
            const int64_t want = top_n < nb ? top_n : nb;
            float *m1 = m + nr, *s1 = s + nr, *a1 = acc + nr * D;
            for (int64_t hh = 0; hh < nh; hh++) {
                for (int64_t j = 0; j < nb; j++) bsc[j] = 0.f;
                for (int64_t i = 0; i < nc; i++) {
                    float ps = 0.f;
                    for (int64_t g = 0; g < group; g++) ps += pc[(hh * group + g) * max_nc + i];
                    for (int64_t u = i; u < i + units_per_entry; u++) {
                        const int64_t j = u / units_per_block;
                        if (j < nb) bsc[j] += ps;
                    }
                }
                const int64_t npick = sparse_pick_blocks(bsc, taken, pick, cur, nb, want, init_blocks, local_blocks);
                int64_t *t1 = pick + top_n;
                const int64_t count = sparse_block_ranges(pick, t1, npick, sel_block, L, selected, r * num_kv_heads + h0 + hh, top_n);
                sparse_attend(qf + hh * group * D, qb ? qb + hh * group * D : NULL, scale, k_cache, v_cache, k_host, v_host, kv_dtype, table, pick, t1, npick, block_size, token_stride,
                              h0 + hh, 1, group, D, sc, a1 + hh * group * D, m1 + hh * group, s1 + hh * group);
                sel_count[hh] = count;
            }
            /* 5. the window, all the item's heads together (contiguous runs of each key row) */
            float *m2 = m + 2 * nr, *s2 = s + 2 * nr, *a2 = acc + 2 * nr * D;
            const int64_t w0 = L - window > 0 ? L - window : 0;
            sparse_attend(qf, qb, scale, k_cache, v_cache, k_host, v_host, kv_dtype, table, &w0, &L, 1, block_size, token_stride, h0, nh, group, D, sc, a2, m2, s2);
            if (touched)
                for (int64_t hh = 0; hh < nh; hh++) touched[r * num_kv_heads + h0 + hh] = nc + sel_count[hh] + L - w0;
            if (branch_out) { /* a part's branches apart (normalised) and their log-sum-exps */
                const float *ms[3] = {m, m + nr, m + 2 * nr}, *ss[3] = {s0, s1, s2}, *as[3] = {a0, a1, a2};
                for (int64_t j = 0; j < nr; j++) {
                    const int64_t head = h0 * group + j;
                    for (int b = 0; b < 3; b++) {
                        const float sum = ss[b][j], inv = sum > 0.f ? 1.f / sum : 0.f;
                        float *o = branch_out + ((rows[r] * (num_kv_heads * group) + head) * 3 + b) * D;
                        for (int64_t i = 0; i < D; i++) o[i] = as[b][j * D + i] * inv;
                        branch_lse[(rows[r] * (num_kv_heads * group) + head) * 3 + b] = sum > 0.f ? ms[b][j] + logf(sum) : -INFINITY;
                    }
                }
                continue;
            }
            /* 6. gated sum; an empty branch (no key) contributes 0 */
            for (int64_t j = 0; j < nr; j++) {
                const int64_t head = h0 * group + j;
                const float *gt = gates + rows[r] * gate_row_stride + head * 3;
                const float w_c = s0[j] > 0.f ? gt[0] / s0[j] : 0.f;
                const float w_s = s1[j] > 0.f ? gt[1] / s1[j] : 0.f, w_w = s2[j] > 0.f ? gt[2] / s2[j] : 0.f;
                const int64_t ooff = rows[r] * out_row_stride + head * D;
                for (int64_t i = 0; i < D; i++)
                    sparse_store(out, out_dtype, ooff + i, w_c * a0[j * D + i] + w_s * a1[j * D + i] + w_w * a2[j * D + i]);
            }
        }
        free(qf); free(acc); free(pc); free(bsc); free(taken); free(pick); free(m); free(sc); free(sel_count); free(ctab);
    }
    return failed == 2 ? -2 : failed ? -1 : 0;
}
