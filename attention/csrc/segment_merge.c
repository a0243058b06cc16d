/* A segmented attention step's work around the paged kernel, as native calls: the query rows of
 * parts whose keys were rotated elsewhere turned by -delta (`rotate_rows`), and the parts' results
 * merged per query row by their log-sum-exp (`merge_parts`). In torch these were a dozen small ops
 * a layer (rotate_partial's slices and cat, merge_lse_rows' scatter-max, exp, index_adds), the
 * largest cost of a decode step over squid's documents on a small model; as kernels they also let
 * such a step run as native calls only.
 *
 * Arithmetic follows the torch code it replaces (attention/rope.py rotate_partial, attention/
 * merge.py merge_lse_rows): fp32 throughout, one rounding at the store, parts summed in index
 * order; expf / logf may differ from torch's vectorised ones by an ulp. */
#include <math.h>
#include <stdint.h>

#include "dtypes.h"

static inline float load_as(const void *p, int dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Rows rows[i] of x (each `heads` x `dim` elements, `row_stride` elements apart, dtype dt) turned
 * in place over their first 2 * half dims (NeoX halves) by the angle whose cos / sin are row i of
 * cos / sin [n, half] fp32: x1 cos - x2 sin, x2 cos + x1 sin in fp32, rounded once. */
int rotate_rows(void *x, int dt, int64_t row_stride, const int64_t *rows, int64_t n, int64_t heads, int64_t dim,
                const float *cos, const float *sin, int64_t half) {
    if ((dt != DT_F32 && dt != DT_BF16) || 2 * half > dim) return -1;
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos + i * half, *s = sin + i * half;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = rows[i] * row_stride + h * dim;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = load_as(x, dt, base + j), x2 = load_as(x, dt, base + half + j);
                const float a = x1 * c[j], b = x2 * s[j], e = x2 * c[j], f = x1 * s[j];
                store_as(x, dt, base + j, a - b);
                store_as(x, dt, base + half + j, e + f);
            }
        }
    }
    return 0;
}

/* Output row r (of T) merges the parts idx[ptr[r]] .. idx[ptr[r + 1] - 1] of o_parts [V, H, D]
 * and lse_parts [V, H] (fp32): with m the largest lse (0 if all are -inf) and w = exp(lse - m),
 * out = sum(w o) / sum(w) (a part of weight 0 adds nothing, whatever its o holds) stored in
 * out_dt, and lse = m + log(sum(w)); a row with no non-empty part gets o = 0, lse = -inf.
 * D at most MERGE_MAX_DIM. */
#define MERGE_MAX_DIM 1024
int merge_parts(const float *o_parts, const float *lse_parts, const int64_t *ptr, const int64_t *idx, int64_t T,
                int64_t H, int64_t D, void *out, int out_dt, float *lse) {
    if ((out_dt != DT_F32 && out_dt != DT_BF16) || D > MERGE_MAX_DIM) return -1;
#pragma omp parallel for schedule(static) if (T * H * D >= 65536)
    for (int64_t rh = 0; rh < T * H; rh++) {
        const int64_t r = rh / H, h = rh % H;
        float m = -INFINITY;
        for (int64_t p = ptr[r]; p < ptr[r + 1]; p++) {
            const float l = lse_parts[idx[p] * H + h];
            m = l > m ? l : m;
        }
        const float shift = isinf(m) ? 0.0f : m;
        float acc[MERGE_MAX_DIM];
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        float total = 0.0f;
        for (int64_t p = ptr[r]; p < ptr[r + 1]; p++) {
            const float w = expf(lse_parts[idx[p] * H + h] - shift);
            total += w;
            if (!(w > 0.0f)) continue;
            const float *o = o_parts + (idx[p] * H + h) * D;
            for (int64_t d = 0; d < D; d++) acc[d] += o[d] * w;
        }
        const float denom = total > 0.0f ? total : 1.0f;
        for (int64_t d = 0; d < D; d++) store_as(out, out_dt, rh * D + d, acc[d] / denom);
        lse[rh] = shift + logf(total);
    }
    return 0;
}
