/* NSA decode on the CPU: one query token per row against the paged raw and compressed caches,
 * reading only what natively sparse attention needs (arXiv 2502.11089): the compressed entries,
 * the top-n selected blocks and the sliding window.
 *
 * A work item is (row, KV head): the GROUP query heads sharing that KV head are processed
 * together, so they share one block selection (Eq. 10) and every K/V row is loaded once per
 * branch. Per item:
 *   1. compression branch: scores of the nc = (L - l) / d + 1 complete compressed entries (entry i
 *      sits in raw block table[e / B] at slot (e % B) / d, e = i*d + l - 1), softmax, p . cV;
 *   2. block scores: each entry's probability, summed over the group, added to every selection
 *      block it shares a stride-d unit with, once per unit (Eq. 9 read per entry: weights
 *      1, 2, 2, 2, 1 for l=32, d=16, l'=64);
 *   3. selection: the first init_blocks and the local_blocks ending at the query's block, then
 *      the best-scored others (ties to the lower block) up to top_n;
 *   4. selected and window branches: online softmax over the selected blocks' keys (the query's
 *      own block only up to the query) and over the last `window` keys;
 *   5. o = g_cmp o_cmp + g_slc o_slc + g_win o_win (gates fp32 [row, head, 3]).
 * The rules are those of cuttle/attention/nsa.py (the reference this kernel is tested against);
 * all math is fp32 whatever the storage dtype. `touched` (optional) receives, per item, the KV
 * tokens this kernel actually read (compressed entries + selected keys + window keys): the
 * counter of issue 16's acceptance 4. `selected` (optional) receives the chosen blocks in rank
 * order, -1 padded. Python binding: cuttle/attention/native/nsa.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

static inline float nsa_dot(const float *q, const void *k, int kv_dtype, int64_t off, int64_t n) {
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

static inline void nsa_axpy(float *acc, float p, const void *v, int kv_dtype, int64_t off, int64_t n) {
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

/* Online-softmax attention of `group` query rows (qf, pre-scaled) over raw keys [t0, t1) of one
 * sequence: state m, s (running max and sum) and acc [group][D] are updated in place. */
static void attend_range(const float *qf, const void *k_cache, const void *v_cache, int kv_dtype,
                         const int32_t *table, int64_t t0, int64_t t1, int64_t block_size, int64_t token_stride,
                         int64_t h, int64_t group, int64_t D, float *m, float *s, float *acc, float *sc) {
    for (int64_t t = t0; t < t1; t++) {
        const int64_t off = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + h * D;
        for (int64_t g = 0; g < group; g++) {
            const float x = nsa_dot(qf + g * D, k_cache, kv_dtype, off, D);
            if (x > m[g]) { /* rescale what was accumulated under the old max */
                const float r = m[g] == -INFINITY ? 0.f : expf(m[g] - x);
                s[g] *= r;
                for (int64_t i = 0; i < D; i++) acc[g * D + i] *= r;
                m[g] = x;
            }
            sc[g] = expf(x - m[g]);
            s[g] += sc[g];
            nsa_axpy(acc + g * D, sc[g], v_cache, kv_dtype, off, D);
        }
    }
}

int nsa_decode_rows(const void *q, int q_dtype, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                    const void *ck_cache, const void *cv_cache, int kv_dtype, const float *gates,
                    int64_t gate_row_stride, void *out, int out_dtype, int64_t out_row_stride, const int64_t *rows,
                    const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t num_rows,
                    int64_t num_kv_heads, int64_t group, int64_t D, int64_t block_size, int64_t cslots,
                    int64_t cmp_block, int64_t cmp_stride, int64_t sel_block, int64_t top_n, int64_t init_blocks,
                    int64_t local_blocks, int64_t window, int64_t max_len, float scale, int32_t *selected,
                    int64_t *touched) {
    int failed = 0;
    const int64_t token_stride = num_kv_heads * D;
    const int64_t max_nc = max_len >= cmp_block ? (max_len - cmp_block) / cmp_stride + 1 : 0;
    const int64_t max_blocks = (max_len + sel_block - 1) / sel_block + 1;
    const int64_t units_per_entry = cmp_block / cmp_stride, units_per_block = sel_block / cmp_stride;
#pragma omp parallel
    {
        float *qf = (float *)malloc(sizeof(float) * (size_t)(group * D));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(3 * group * D));
        float *pc = (float *)malloc(sizeof(float) * (size_t)(group * (max_nc > 0 ? max_nc : 1)));
        float *bsc = (float *)malloc(sizeof(float) * (size_t)max_blocks);
        char *taken = (char *)malloc((size_t)max_blocks);
        int64_t *pick = (int64_t *)malloc(sizeof(int64_t) * (size_t)(top_n > 0 ? top_n : 1));
        float *m = (float *)malloc(sizeof(float) * (size_t)(6 * group)), *s = m + 3 * group;
        float *sc = (float *)malloc(sizeof(float) * (size_t)group);
        if (!qf || !acc || !pc || !bsc || !taken || !pick || !m || !sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * num_kv_heads; item++) {
            if (failed) continue;
            const int64_t r = item / num_kv_heads, h = item % num_kv_heads;
            const int64_t L = lens[r], t = L - 1;
            const int32_t *table = tables + r * table_stride;
            const int64_t qoff = rows[r] * q_row_stride + h * group * D;
            for (int64_t i = 0; i < group * D; i++)
                qf[i] = (q_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)q)[qoff + i]) : ((const float *)q)[qoff + i]) * scale;
            memset(acc, 0, sizeof(float) * (size_t)(3 * group * D));
            for (int64_t g = 0; g < 3 * group; g++) { m[g] = -INFINITY; s[g] = 0.f; }
            int64_t count = 0;
            /* 1. compression branch (two passes: the probabilities also score the blocks) */
            const int64_t nc = L >= cmp_block ? (L - cmp_block) / cmp_stride + 1 : 0;
            for (int64_t i = 0; i < nc; i++) {
                const int64_t e = i * cmp_stride + cmp_block - 1;
                const int64_t off = ((int64_t)table[e / block_size] * cslots + (e % block_size) / cmp_stride) * token_stride + h * D;
                for (int64_t g = 0; g < group; g++) {
                    const float x = nsa_dot(qf + g * D, ck_cache, kv_dtype, off, D);
                    pc[g * max_nc + i] = x;
                    if (x > m[g]) m[g] = x;
                }
            }
            for (int64_t g = 0; g < group && nc > 0; g++) {
                for (int64_t i = 0; i < nc; i++) { pc[g * max_nc + i] = expf(pc[g * max_nc + i] - m[g]); s[g] += pc[g * max_nc + i]; }
                const float inv = 1.f / s[g];
                for (int64_t i = 0; i < nc; i++) pc[g * max_nc + i] *= inv;
            }
            for (int64_t i = 0; i < nc; i++) {
                const int64_t e = i * cmp_stride + cmp_block - 1;
                const int64_t off = ((int64_t)table[e / block_size] * cslots + (e % block_size) / cmp_stride) * token_stride + h * D;
                for (int64_t g = 0; g < group; g++) nsa_axpy(acc + g * D, pc[g * max_nc + i], cv_cache, kv_dtype, off, D);
            }
            count += nc;
            /* 2. block scores (Eq. 9 per entry, Eq. 10 over the group) */
            const int64_t cur = t / sel_block, nb = cur + 1;
            for (int64_t j = 0; j < nb; j++) { bsc[j] = 0.f; taken[j] = 0; }
            for (int64_t i = 0; i < nc; i++) {
                float ps = 0.f;
                for (int64_t g = 0; g < group; g++) ps += pc[g * max_nc + i];
                for (int64_t u = i; u < i + units_per_entry; u++) {
                    const int64_t j = u / units_per_block;
                    if (j < nb) bsc[j] += ps;
                }
            }
            /* 3. selection: forced blocks (ascending), then the best others, ties to the lower */
            int64_t npick = 0;
            const int64_t want = top_n < nb ? top_n : nb;
            for (int64_t j = 0; j < nb && npick < want; j++)
                if (j < init_blocks || j > cur - local_blocks) { taken[j] = 1; pick[npick++] = j; }
            while (npick < want) {
                int64_t best = -1;
                for (int64_t j = 0; j < nb; j++)
                    if (!taken[j] && (best < 0 || bsc[j] > bsc[best])) best = j;
                taken[best] = 1;
                pick[npick++] = best;
            }
            if (selected)
                for (int64_t p = 0; p < top_n; p++) selected[item * top_n + p] = p < npick ? (int32_t)pick[p] : -1;
            /* 4. selected blocks and the window, each an online softmax of its own */
            float *m1 = m + group, *s1 = s + group, *a1 = acc + group * D;
            for (int64_t g = 0; g < group; g++) { m1[g] = -INFINITY; s1[g] = 0.f; }
            for (int64_t p = 0; p < npick; p++) {
                const int64_t t0 = pick[p] * sel_block, t1 = t0 + sel_block < L ? t0 + sel_block : L;
                attend_range(qf, k_cache, v_cache, kv_dtype, table, t0, t1, block_size, token_stride, h, group, D, m1, s1, a1, sc);
                count += t1 - t0;
            }
            float *m2 = m + 2 * group, *s2 = s + 2 * group, *a2 = acc + 2 * group * D;
            for (int64_t g = 0; g < group; g++) { m2[g] = -INFINITY; s2[g] = 0.f; }
            const int64_t w0 = L - window > 0 ? L - window : 0;
            attend_range(qf, k_cache, v_cache, kv_dtype, table, w0, L, block_size, token_stride, h, group, D, m2, s2, a2, sc);
            count += L - w0;
            if (touched) touched[item] = count;
            /* 5. gated sum; an empty branch (no key) contributes 0 */
            for (int64_t g = 0; g < group; g++) {
                const int64_t head = h * group + g;
                const float *gt = gates + rows[r] * gate_row_stride + head * 3;
                const float w_c = nc > 0 ? gt[0] : 0.f;
                const float w_s = s1[g] > 0.f ? gt[1] / s1[g] : 0.f, w_w = s2[g] > 0.f ? gt[2] / s2[g] : 0.f;
                const int64_t ooff = rows[r] * out_row_stride + head * D;
                for (int64_t i = 0; i < D; i++) {
                    const float o = w_c * acc[g * D + i] + w_s * a1[g * D + i] + w_w * a2[g * D + i];
                    if (out_dtype == DT_BF16) ((uint16_t *)out)[ooff + i] = f32_to_bf16(o);
                    else ((float *)out)[ooff + i] = o;
                }
            }
        }
        free(qf); free(acc); free(pc); free(bsc); free(taken); free(pick); free(m); free(sc);
    }
    return failed ? -1 : 0;
}
