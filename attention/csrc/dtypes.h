/* The storage dtypes the native CPU kernels take (codes shared with cpu_kernels.py) and the bf16
 * conversions they use. bf16 -> fp32 is exact; fp32 -> bf16 rounds to nearest even and keeps NaN
 * quiet, as torch does, so a kernel's bf16 output equals torch's rounding of the same fp32 value. */
#ifndef CUTTLE_DTYPES_H
#define CUTTLE_DTYPES_H
#include <stdint.h>

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x007fffffu)) return (uint16_t)((v.u >> 16) | 0x40);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* y[i] = v stored as dtype dt (the linear kernels' scalar output store) */
static inline void store_as(void *y, int dt, int64_t i, float v) {
    if (dt == DT_BF16) ((uint16_t *)y)[i] = f32_to_bf16(v);
    else ((float *)y)[i] = v;
}
#endif
