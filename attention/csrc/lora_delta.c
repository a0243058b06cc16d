/* A LoRA adapter's delta added to a projection's output rows (engine/lora.py):
 *
 *     y[row] = round(y[row] + (x[row] A^T) (s B)^T)
 *
 * with A [R, K] and sB [N, R] in fp32, taken here transposed (at: [K, R], bt: [R, N]) so both
 * products are elementwise loops over a contiguous run that the compiler vectorizes without
 * reordering a sum: t[j] accumulates x[k] * at[k, j] over k in order, then acc[n] accumulates
 * t[j] * bt[j, n] over j in order, and y is rounded once from fp32 (y + acc), as torch's
 * `y.add_(delta)` rounds. A row's value depends on that row alone (any batch, any threads), so
 * the kernel is batch-invariant by construction, and as a native call a decode step with an
 * adapter can be recorded in a kernel graph (`native.graph`).
 *
 * Rows: `rows` NULL means rows 0..M-1 of x and y; else x row i and y row rows[i] for i < M
 * (an adapter's rows scattered through the step). Indices are checked before anything is
 * written (-3). Returns 0, -1 when scratch cannot be allocated, -2 for R > LORA_MAX_RANK. */
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"

#define LORA_MAX_RANK 4096
/* rows x work (multiply-adds) above which the rows are split over the threads */
#define PARALLEL_WORK (1 << 21)

static inline float load_as(const void *p, int dt, int64_t i) {
    return dt == DT_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Up to ROWS_AT_ONCE rows are computed together, 16 values of each at a time held in registers
 * (2 x 8-wide vectors a row), so each value of at and bt is read once per block of rows, not
 * once per row. Which path (vector or scalar tail) computes a value depends only on its column,
 * and every value's sum runs in the same order as for a row alone: blocking changes no value. */
#define ROWS_AT_ONCE 4
typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* out[r][c0..c0+16) (stride ld) = sum over i in order of s[r][i] * w[i * W + c0 ..] for nr rows */
static inline __attribute__((always_inline)) void tile16(const float *s, int64_t s_stride, const float *w, int64_t W,
                                                         int64_t c0, int64_t I, const int nr, float *out, int64_t ld) {
    v8 lo[ROWS_AT_ONCE] = {0}, hi[ROWS_AT_ONCE] = {0};
    for (int64_t i = 0; i < I; i++) {
        const v8 w0 = *(const v8 *)(w + i * W + c0), w1 = *(const v8 *)(w + i * W + c0 + 8);
        for (int r = 0; r < nr; r++) {
            const float sv = s[r * s_stride + i];
            lo[r] += sv * w0;
            hi[r] += sv * w1;
        }
    }
    for (int r = 0; r < nr; r++) {
        *(v8 *)(out + r * ld + c0) = lo[r];
        *(v8 *)(out + r * ld + c0 + 8) = hi[r];
    }
}

/* the columns past the last whole tile, one at a time in the same order */
static inline void tail(const float *s, int64_t s_stride, const float *w, int64_t W, int64_t c0, int64_t I, int nr,
                        float *out, int64_t ld) {
    for (int64_t c = c0; c < W; c++)
        for (int r = 0; r < nr; r++) {
            float acc = 0.f;
            for (int64_t i = 0; i < I; i++) acc += s[r * s_stride + i] * w[i * W + c];
            out[r * ld + c] = acc;
        }
}

static void block_delta(const void *x, int x_dtype, int64_t x_stride, const int64_t *xr, int nr, int64_t K, int64_t N,
                        const float *at, int64_t R, const float *bt, float *xf, float *t, float *acc) {
    for (int r = 0; r < nr; r++)
        for (int64_t k = 0; k < K; k++) xf[r * K + k] = load_as(x, x_dtype, xr[r] * x_stride + k);
    const int64_t R16 = R & ~(int64_t)15, N16 = N & ~(int64_t)15;
    switch (nr) { /* a constant row count a call: the accumulators stay in registers */
#define TILES(NR)                                                                        \
    case NR:                                                                             \
        for (int64_t j = 0; j < R16; j += 16) tile16(xf, K, at, R, j, K, NR, t, R);      \
        tail(xf, K, at, R, R16, K, NR, t, R);                                            \
        for (int64_t n = 0; n < N16; n += 16) tile16(t, R, bt, N, n, R, NR, acc, N);     \
        tail(t, R, bt, N, N16, R, NR, acc, N);                                           \
        break;
        TILES(1)
        TILES(2)
        TILES(3)
        TILES(4)
#undef TILES
    }
}

int lora_add_rows(void *y, int y_dtype, int64_t y_stride, const void *x, int x_dtype, int64_t x_stride, const int64_t *rows,
                  int64_t M, int64_t K, int64_t N, const float *at, int64_t R, const float *bt, int64_t y_rows) {
    if (R < 1 || R > LORA_MAX_RANK) return -2;
    if (rows)
        for (int64_t i = 0; i < M; i++)
            if (rows[i] < 0 || rows[i] >= y_rows) return -3;
    const int64_t blocks = (M + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
    int failed = 0;
#pragma omp parallel if (M * (K + N) * R >= PARALLEL_WORK)
    {
        float *t = malloc(sizeof(float) * (size_t)(ROWS_AT_ONCE * (R + N + K)));
        if (!t) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (!t) continue;
            float *acc = t + ROWS_AT_ONCE * R, *xf = acc + ROWS_AT_ONCE * N;
            int64_t xr[ROWS_AT_ONCE];
            const int nr = (int)(M - blk * ROWS_AT_ONCE < ROWS_AT_ONCE ? M - blk * ROWS_AT_ONCE : ROWS_AT_ONCE);
            for (int r = 0; r < nr; r++) xr[r] = rows ? rows[blk * ROWS_AT_ONCE + r] : blk * ROWS_AT_ONCE + r;
            block_delta(x, x_dtype, x_stride, xr, nr, K, N, at, R, bt, xf, t, acc);
            for (int r = 0; r < nr; r++)
                for (int64_t n = 0; n < N; n++)
                    store_as(y, y_dtype, xr[r] * y_stride + n, load_as(y, y_dtype, xr[r] * y_stride + n) + acc[r * N + n]);
        }
        free(t);
    }
    return failed ? -1 : 0;
}
