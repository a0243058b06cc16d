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

int lora_add_rows(void *y, int y_dtype, int64_t y_stride, const void *x, int x_dtype, int64_t x_stride, const int64_t *rows,
                  int64_t M, int64_t K, int64_t N, const float *at, int64_t R, const float *bt, int64_t y_rows) {
    if (R < 1 || R > LORA_MAX_RANK) return -2;
    if (rows)
        for (int64_t i = 0; i < M; i++)
            if (rows[i] < 0 || rows[i] >= y_rows) return -3;
    int failed = 0;
#pragma omp parallel if (M * (K + N) * R >= PARALLEL_WORK)
    {
        float *t = malloc(sizeof(float) * (size_t)(R + N));
        if (!t) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for
        for (int64_t i = 0; i < M; i++) {
            if (!t) continue;
            float *acc = t + R;
            const int64_t xr = rows ? rows[i] : i, yr = rows ? rows[i] : i;
            for (int64_t j = 0; j < R; j++) t[j] = 0.f;
            for (int64_t k = 0; k < K; k++) {
                const float xv = load_as(x, x_dtype, xr * x_stride + k);
                const float *a = at + k * R;
                for (int64_t j = 0; j < R; j++) t[j] += xv * a[j];
            }
            for (int64_t n = 0; n < N; n++) acc[n] = 0.f;
            for (int64_t j = 0; j < R; j++) {
                const float tj = t[j];
                const float *b = bt + j * N;
                for (int64_t n = 0; n < N; n++) acc[n] += tj * b[n];
            }
            for (int64_t n = 0; n < N; n++)
                store_as(y, y_dtype, yr * y_stride + n, load_as(y, y_dtype, yr * y_stride + n) + acc[n]);
        }
        free(t);
    }
    return failed ? -1 : 0;
}
