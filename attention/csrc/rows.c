/* Row copies of a decode step as native calls: gather rows by index (the embedding lookup, the
 * step's RoPE table rows), scatter rows to slots (this step's K/V into the paged cache), and
 * bf16 -> fp32 widening (the logits). In torch these were an index op each, a dispatch apiece;
 * as kernels they also let a whole decode step run as native calls (`native.graph`).
 *
 * Indices are checked before anything is written: an index outside [0, rows) returns -3 and
 * leaves the destination untouched (the caller raises the error torch would). Rows are plain
 * bytes, so any dtype copies exactly; bf16 -> fp32 is a 16-bit shift, exact as torch's. */
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

/* Large copies (a long prefill's embeddings) split over the threads; a decode step's few rows do not. */
#define PARALLEL_BYTES (1 << 20)

static int indices_ok(const int64_t *idx, int64_t n, int64_t rows) {
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= rows) return 0;
    return 1;
}

/* dst row i = src row idx[i]; strides in bytes. */
int gather_rows(const void *src, int64_t src_rows, int64_t src_stride, const int64_t *idx, int64_t n, void *dst,
                int64_t dst_stride, int64_t row_bytes) {
    if (!indices_ok(idx, n, src_rows)) return -3;
#pragma omp parallel for if (n * row_bytes >= PARALLEL_BYTES)
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)dst + i * dst_stride, (const char *)src + idx[i] * src_stride, (size_t)row_bytes);
    return 0;
}

/* dst row idx[i] = src row i; strides in bytes. Indices must be distinct (a cache slot each). */
int scatter_rows(const void *src, int64_t src_stride, const int64_t *idx, int64_t n, void *dst, int64_t dst_rows,
                 int64_t dst_stride, int64_t row_bytes) {
    if (!indices_ok(idx, n, dst_rows)) return -3;
#pragma omp parallel for if (n * row_bytes >= PARALLEL_BYTES)
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)dst + idx[i] * dst_stride, (const char *)src + i * src_stride, (size_t)row_bytes);
    return 0;
}

/* dst[r][j] = (float)src[r][j] for rows of n bf16 values; strides in elements. The bits move up 16
 * places (exactly bf16_to_f32), written as an integer shift so the loop vectorizes; a row of
 * logits (152k values) is split over the threads. */
#define WIDEN_CHUNK 8192
int widen_bf16_rows(const uint16_t *src, int64_t src_stride, float *dst, int64_t dst_stride, int64_t rows, int64_t n) {
    const int64_t chunks = (n + WIDEN_CHUNK - 1) / WIDEN_CHUNK;
#pragma omp parallel for collapse(2) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < chunks; c++) {
            const uint16_t *s = src + r * src_stride + c * WIDEN_CHUNK;
            uint32_t *d = (uint32_t *)(dst + r * dst_stride + c * WIDEN_CHUNK);
            const int64_t len = n - c * WIDEN_CHUNK < WIDEN_CHUNK ? n - c * WIDEN_CHUNK : WIDEN_CHUNK;
            for (int64_t j = 0; j < len; j++) d[j] = (uint32_t)s[j] << 16;
        }
    return 0;
}
