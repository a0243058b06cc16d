/* y = x @ W^T (+ bias) with W in MXFP8: E4M3 bytes [N, K] and E8M0 block scales [N, K/32] (blocks
 * of 32 along K, the layout cuttle.moe.mxfp8 writes), read as they are stored (8.25 bits a weight)
 * and decoded in registers (mxfp8.h). x is fp32 or bf16, y fp32 or bf16, sums are fp32.
 *
 * Two loops, both over the stored bytes (no repacked copy):
 *   - decode (M <= 8 rows, memory-bound): each thread streams a contiguous range of output rows,
 *     one weight row after the other, so its bytes are one sequential stream (reading 4 rows
 *     interleaved, 4 streams a few hundred bytes apart, kept a core at ~20 GB/s from memory on a
 *     Zen4 EPYC where one stream reads at ~35: the [151936, 1024] lm_head at M = 1 went 7.4 ->
 *     6.0 ms on this loop, 8.2 -> 4.2 ms on the bf16-dot one); per 32-element block the bytes
 *     become 4 fp32 registers, are dotted with every x row into a block sum, and the block sum is
 *     multiplied once by the block's scale factor. W's bytes are read once from memory (x rows
 *     5..8 are a second pass over the row, from L1: at M = 5..8 this was ~1.4x faster than the
 *     tile loop, one thread, K = 1024). One or two rows on the AVX2 path (not batch-invariant)
 *     take the placed loop instead, which decodes by placing the element bits (mxfp8.h) and dots
 *     x with the dequantized weights: the fp16 route's conversions bound the loop at 1-2 rows.
 *   - tile (M > 8, prefill): each thread dequantizes a tile of 16 weight rows to fp32 once (L2)
 *     and runs a 2-row x 4-weight-row register kernel over a chunk of x rows sized to stay in L2,
 *     so one conversion serves every row of the chunk.
 * K must be a multiple of 32 (the format's block; refused, never padded: -2). AVX2 + FMA + F16C
 * is chosen at run time (__builtin_cpu_supports), with a scalar fallback of the same math that
 * tests can force (mxfp8_set_fast_path(0)).
 *
 * Where the library is built for a CPU with AVX512-BF16 and AVX512-VBMI (-march=native on Zen4,
 * Sapphire Rapids), the decode loop takes bf16 activations without widening them (K a multiple
 * of 64): two 128-entry byte lookups (vpermt2b) turn 64 E4M3 bytes into the low and high bytes of
 * their exact bf16 values, the sign bit is OR-ed back in, and VDPBF16PS multiplies them with x
 * (bf16 times bf16 is exact in fp32) -- ~12 instructions for 64 weights against ~30 for the AVX2
 * decode through fp16. Products and sums are fp32 as on the other paths, except that the dot
 * instruction treats bf16 denormal inputs and fp32 denormal results as zero (products below
 * 2^-126, as torch's bf16 GEMM on the same instruction does). Where the CPU also has GFNI, 64
 * bytes without a zero or subnormal element skip the lookups (mxfp8.h, mx_decode64_bf16_x256:
 * the same bits), and at M = 1 the loop sums 16 weight rows' lane vectors with one tree.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "mxfp8.h"
#include "reduce16.h"

static int fast_path_on = -1; /* -1: decided on first use from the CPU */

int mxfp8_use_fast(void) {
    if (fast_path_on < 0) fast_path_on = mx_cpu_has_avx2();
    return fast_path_on;
}

int mxfp8_fast_path_available(void) { return mx_cpu_has_avx2(); }

/* Force the scalar loops (0) or return to the CPU's choice (1); returns the path now in effect. */
int mxfp8_set_fast_path(int on) {
    fast_path_on = on ? mx_cpu_has_avx2() : 0;
    return fast_path_on;
}

/* ---- dequantization ----------------------------------------------------------------------- */


static inline float dequant_one(uint8_t v, uint8_t b) {
    if ((v & 0x7F) == 0x7F) return mx_bits_f32(0x7FC00000u); /* the E4M3 NaN byte */
    float e = mx_e4m3_scaled(v);
    if (mx_scale_hi(b)) e *= 256.f;
    return e * mx_scale_factor(b);
}

#ifdef MX_X86
static MX_AVX2 void dequant_row_avx2(const uint8_t *d, const uint8_t *s, int64_t K, void *out, int dt) {
    for (int64_t kb = 0; kb < K / MX_BLOCK; kb++) {
        __m256 v[4];
        mx_dequant_block(d + kb * MX_BLOCK, s[kb], v);
        if (dt == DT_F32) {
            for (int i = 0; i < 4; i++) _mm256_storeu_ps((float *)out + kb * MX_BLOCK + 8 * i, v[i]);
        } else {
            float tmp[MX_BLOCK];
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(tmp + 8 * i, v[i]);
            for (int i = 0; i < MX_BLOCK; i++) ((uint16_t *)out)[kb * MX_BLOCK + i] = f32_to_bf16(tmp[i]);
        }
    }
    for (int64_t k = 0; k < K; k++) /* NaN element bytes (rare; the quantizer writes none outside NaN blocks) */
        if ((d[k] & 0x7F) == 0x7F) store_as(out, dt, k, mx_bits_f32(0x7FC00000u));
}
#endif

/* data [rows, K], scales [rows, K/32] -> out [rows, K] (fp32 or bf16): the correctly rounded value
 * of element * 2^(b - 127) (bf16: that fp32 value rounded to nearest even, as torch rounds it).
 * Returns 0, or -2 when K is not a multiple of 32. */
int mxfp8_dequantize(const uint8_t *data, const uint8_t *scales, int64_t rows, int64_t K, void *out, int out_dtype) {
    if (K % MX_BLOCK != 0) return -2;
    const int fast = mxfp8_use_fast();
    const int64_t KB = K / MX_BLOCK;
    const size_t esz = out_dtype == DT_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *d = data + r * K, *s = scales + r * KB;
        char *o = (char *)out + (size_t)(r * K) * esz;
#ifdef MX_X86
        if (fast) {
            dequant_row_avx2(d, s, K, o, out_dtype);
            continue;
        }
#endif
        for (int64_t k = 0; k < K; k++) store_as(o, out_dtype, k, dequant_one(d[k], s[k / MX_BLOCK]));
    }
    (void)fast;
    return 0;
}

/* ---- decode loop (M <= 8) ------------------------------------------------------------------ */

#define PREFETCH_BYTES 2048
#define DECODE_MAX_M 8 /* rows the decode loop takes (in passes of 4); more go to the tile loop */
/* rows the bf16-dot decode loop takes (passes of 8); more go to the bf16 tile loop. Re-tuned
 * against the transposing tile (Zen4, 2 threads, one process alternating the two, medians):
 * weights streamed from memory favour this loop up to ~12 rows ([151936, 512]: tile / decode
 * 1.65 at 8, 0.86-1.17 at 12, 0.86 at 16; [151936, 1024]: 1.62 at 8, 1.06-1.25 at 12, 0.81 at
 * 16), weights that stay in cache favour the tile from ~8 ([3072, 1024] 0.92 at 8, 0.86 at 12,
 * 0.55 at 16; [1024, 512] 0.95 / 0.62 / 0.58). The lm_head-sized weights, where the time is,
 * decide: 12 (it was 16, set against the first, scattering tile). */
#define DECODE_BF16_MAX_M 12

#ifdef MX_X86
/* One weight row (w, s) dotted with M fp32 x rows (stride K): out[m]. M is a constant at every
 * call site, so the loops unroll. */
static inline __attribute__((always_inline)) MX_AVX2 void dot_row_mx(const float *x, const uint8_t *w, const uint8_t *s,
                                                                     int64_t K, const int M, float *out) {
    const int64_t KB = K / MX_BLOCK;
    __m256 tot[4];
    for (int m = 0; m < M; m++) tot[m] = _mm256_setzero_ps();
    /* the hardware prefetcher alone left a core at ~60 % of its in-cache rate on weights from
     * memory: prefetch PREFETCH_BYTES ahead in the thread's stream (rows follow each other) */
    for (int64_t kb = 0; kb < KB; kb++) {
        __m256 v[4];
        _mm_prefetch((const char *)(w + kb * MX_BLOCK + PREFETCH_BYTES), _MM_HINT_T0);
        mx_decode16(w + kb * MX_BLOCK, &v[0], &v[1]);
        mx_decode16(w + kb * MX_BLOCK + 16, &v[2], &v[3]);
        const uint8_t b = s[kb];
        const __m256 f = _mm256_set1_ps(mx_scale_factor(b));
        for (int m = 0; m < M; m++) {
            const float *xm = x + m * K + kb * MX_BLOCK;
            __m256 blk = _mm256_mul_ps(v[0], _mm256_loadu_ps(xm));
            blk = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xm + 8), blk);
            blk = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xm + 16), blk);
            blk = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xm + 24), blk);
            if (__builtin_expect(mx_scale_hi(b), 0)) blk = _mm256_mul_ps(blk, _mm256_set1_ps(256.f));
            tot[m] = _mm256_fmadd_ps(blk, f, tot[m]);
        }
    }
    for (int m = 0; m < M; m++) out[m] = mx_hsum(tot[m]);
}

/* ---- placed loop (M <= 8, AVX2) ------------------------------------------------------------
 * The loop above decodes through the fp16 route, whose conversions share one port on Zen3
 * (mxfp8.h, "placed as fp32 bits"). This one places each block's elements as fp32 bits
 * (mx_placed32: element * 2^-120, no multiply), sums them times x in two chains, and scales the
 * block sum by its factor, as the loop above does: 5 shifts and 4 ANDs a block, and per row 5
 * multiplies / multiply-adds and an add, where the earlier placed loop also spent 4 multiplies a
 * block on the factors.
 *
 * The placed elements are tiny (2^-129 .. 2^-111), so their products with x would fall below
 * fp32's normal range: x is scaled by 2^k first (xd, in mx_dword_order's order), k chosen from
 * max |x| (mx_placed_shift) so that the largest |x| * 2^k lies in [2^100, 2^101), and the factor of
 * scale byte b is 2^(b - 7 - k). Scaling by a power of two is exact, so every product and sum is
 * the one an fp32 dot of x with the dequantized weights makes (the sums in this loop's order),
 * down to terms below 2^-97 of max |x| times the weight, which may round as subnormals (the whole
 * dot's fp32 error is far above them). Blocks with scale bytes above MX_PLACED_MAX_B take
 * mx_dequant_block and x itself. An inf in x gives k = 0; NaN entries are left out of the max;
 * both propagate as in the loop above.
 *
 * Even and odd blocks go to two sums at one or two rows (more independent chains), to one at three
 * or four (registers). Another summation order than the loop above, so a batch-invariant call keeps
 * that loop at every row count (as the widening bf16 GEMM does). Measured: see PLACED_MAX_M. */
static int placed_on = 1; /* mxfp8_set_placed */
/* x rows one pass of the placed loop takes; 5-8 rows run in passes of 4, as the loop above does.
 * Measured against the loop above (Zen3 EPYC, 2 threads, weights from memory, alternating in one
 * process: `benchmarks/mxfp8_gemm.py --ab-placed`, medians per shape; a control of the placed loop
 * against itself 0.98-1.05): 1 row 1.23-1.45x, 2 rows 1.10-1.41x, 3 rows 1.01-1.25x, 4 rows
 * 0.94-1.18x, 8 rows 0.98-1.19x (below 1 only on K = 2048 / 3072 at 4-8 rows, within the noise).
 * The earlier placed loop, which multiplied each element by its factor, was 1.14-1.28x at one row
 * and 0.78-1.02x at three or four. */
#define PLACED_MAX_M 4
int mxfp8_placed_on(void) { return placed_on; }

/* one block's sum of v times x lane for lane (both in one order: dword order for placed elements,
 * element order for mx_dequant_block's), in two chains */
static inline __attribute__((always_inline)) MX_AVX2 __m256 placed_block_sum(const __m256 v[4], const float *x) {
    __m256 a = _mm256_mul_ps(v[0], _mm256_loadu_ps(x)), b = _mm256_mul_ps(v[1], _mm256_loadu_ps(x + 8));
    a = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(x + 16), a);
    b = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(x + 24), b);
    return _mm256_add_ps(a, b);
}

/* block kb of one weight row into tot[0..R) */
static inline __attribute__((always_inline)) MX_AVX2 void placed_block(const float *x, const float *xd, const uint8_t *w,
                                                                       const uint8_t *s, const float *ftab, int64_t K,
                                                                       int64_t kb, const int R, __m256 *tot) {
    __m256 v[4];
    const uint8_t b = s[kb];
    if (__builtin_expect(b <= MX_PLACED_MAX_B, 1)) {
        mx_placed32(w + kb * MX_BLOCK, v);
        const __m256 f = _mm256_broadcast_ss(&ftab[b]);
        for (int r = 0; r < R; r++) tot[r] = _mm256_fmadd_ps(placed_block_sum(v, xd + r * K + kb * MX_BLOCK), f, tot[r]);
    } else {
        mx_dequant_block(w + kb * MX_BLOCK, b, v);
        for (int r = 0; r < R; r++) tot[r] = _mm256_add_ps(placed_block_sum(v, x + r * K + kb * MX_BLOCK), tot[r]);
    }
}

/* One weight row dotted with R (1..4) x rows: x in their own order, xd scaled and in
 * mx_placed32's order (both with row stride K), ftab the factors 2^(b - 7 - k). Even and odd
 * blocks into their own sums. */
static inline __attribute__((always_inline)) MX_AVX2 void dot_placed_rows(const float *x, const float *xd,
                                                                          const uint8_t *w, const uint8_t *s,
                                                                          const float *ftab, int64_t K, const int R,
                                                                          float *out) {
    const int64_t KB = K / MX_BLOCK;
    __m256 t0[PLACED_MAX_M], t1[PLACED_MAX_M];
    for (int r = 0; r < R; r++) t0[r] = t1[r] = _mm256_setzero_ps();
    int64_t kb = 0;
    for (; kb + 1 < KB; kb += 2) {
        _mm_prefetch((const char *)(w + kb * MX_BLOCK + PREFETCH_BYTES), _MM_HINT_T0);
        placed_block(x, xd, w, s, ftab, K, kb, R, t0);
        placed_block(x, xd, w, s, ftab, K, kb + 1, R, R <= 2 ? t1 : t0);
    }
    if (kb < KB) placed_block(x, xd, w, s, ftab, K, kb, R, t0);
    for (int r = 0; r < R; r++) out[r] = mx_hsum(_mm256_add_ps(t0[r], t1[r]));
}
#define DOT_PLACED(R_)                                                                                       \
    static MX_AVX2 void dot_placed_##R_(const float *x, const float *xd, const uint8_t *w, const uint8_t *s, \
                                        const float *ftab, int64_t K, float *out) {                          \
        dot_placed_rows(x, xd, w, s, ftab, K, R_, out);                                                      \
    }
DOT_PLACED(1)
DOT_PLACED(2)
DOT_PLACED(3)
DOT_PLACED(4)
typedef void (*dot_placed_fn)(const float *, const float *, const uint8_t *, const uint8_t *, const float *, int64_t, float *);

#define ROW_MX(M_)                                                                                          \
    static MX_AVX2 void row_mx_##M_(const float *x, const uint8_t *w, const uint8_t *s, int64_t K, float *out) { \
        dot_row_mx(x, w, s, K, M_, out);                                                                   \
    }
ROW_MX(1)
ROW_MX(2)
ROW_MX(3)
ROW_MX(4)
typedef void (*row_mx_fn)(const float *, const uint8_t *, const uint8_t *, int64_t, float *);
#endif

static void dot_rows_scalar(const float *x, const uint8_t *w, const uint8_t *s, int64_t K, int M, float *out) {
    const int64_t KB = K / MX_BLOCK;
    for (int m = 0; m < M; m++) {
        float tot = 0.f;
        for (int64_t kb = 0; kb < KB; kb++) {
            float blk = 0.f;
            for (int i = 0; i < MX_BLOCK; i++) blk += x[m * K + kb * MX_BLOCK + i] * mx_e4m3_scaled(w[kb * MX_BLOCK + i]);
            if (mx_scale_hi(s[kb])) blk *= 256.f;
            tot += blk * mx_scale_factor(s[kb]);
        }
        out[m] = tot;
    }
}

/* returns the loop taken (mxfp8_last_linear_path's code) */
static int linear_decode(const float *x, const uint8_t *w, const uint8_t *s, const float *bias, void *y, int y_dtype,
                         int64_t M, int64_t N, int64_t K, int fast, int invariant) {
    const int64_t KB = K / MX_BLOCK;
#ifdef MX_X86
    /* 64-byte aligned: the loop's 32-byte loads of xd then never straddle cache lines (malloc's
     * 16-byte alignment ran 3-6 % slower at 4 rows, ad-hoc A/B on three 0.6B shapes) */
    float *xd = fast && placed_on && !invariant ? (float *)aligned_alloc(64, sizeof(float) * (size_t)(M * K)) : NULL;
    if (xd) { /* (without the buffer, the loop below) */
        /* (NaN entries are left out of the max: with them in, a row of 2^120 next to a row with a
         * NaN overflowed to inf and came out NaN) */
        const int k = mx_placed_shift(mx_amax(x, M * K));
        float ftab[MX_PLACED_MAX_B + 1];
        for (int b = 0; b <= MX_PLACED_MAX_B; b++) ftab[b] = mx_bits_f32((uint32_t)(b + 120 - k) << 23); /* 2^(b - 7 - k) */
        for (int64_t m = 0; m < M; m++) mx_dword_order(x + m * K, K, mx_bits_f32((uint32_t)(127 + k) << 23), xd + m * K);
        static const dot_placed_fn placed[PLACED_MAX_M + 1] = {0, dot_placed_1, dot_placed_2, dot_placed_3, dot_placed_4};
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            /* x rows 4 at a time: a second pass re-reads the row from L1, not memory */
            for (int64_t m0 = 0; m0 < M; m0 += PLACED_MAX_M) {
                const int64_t mc = M - m0 < PLACED_MAX_M ? M - m0 : PLACED_MAX_M;
                float acc[PLACED_MAX_M];
                placed[mc](x + m0 * K, xd + m0 * K, w + n * K, s + n * KB, ftab, K, acc);
                for (int64_t m = 0; m < mc; m++) store_as(y, y_dtype, (m0 + m) * N + n, acc[m] + (bias ? bias[n] : 0.f));
            }
        }
        free(xd);
        return 5;
    }
#endif
    (void)invariant;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        /* x rows 4 at a time: a second pass re-reads the row from L1, not memory */
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mc = M - m0 < 4 ? M - m0 : 4;
            float acc[4];
#ifdef MX_X86
            static const row_mx_fn rows[5] = {0, row_mx_1, row_mx_2, row_mx_3, row_mx_4};
            if (fast) rows[mc](x + m0 * K, w + n * K, s + n * KB, K, acc);
            else
#endif
                dot_rows_scalar(x + m0 * K, w + n * K, s + n * KB, K, (int)mc, acc);
            for (int64_t m = 0; m < mc; m++) store_as(y, y_dtype, (m0 + m) * N + n, acc[m] + (bias ? bias[n] : 0.f));
        }
    }
    return fast;
}

/* Whether every scale byte of s[0..n) lies in [MX_BF16_SAFE_LO, MX_BF16_SAFE_HI] (mxfp8.h): the
 * bf16-dot loops (here and in moe_experts.c) scale weights exactly in bf16 only then. */
int mxfp8_scales_bf16_safe(const uint8_t *s, int64_t n) {
    uint8_t lo = 255, hi = 0;
    for (int64_t i = 0; i < n; i++) {
        lo = s[i] < lo ? s[i] : lo;
        hi = s[i] > hi ? s[i] : hi;
    }
    return n == 0 || (lo >= MX_BF16_SAFE_LO && hi <= MX_BF16_SAFE_HI);
}

/* ---- decode loop on bf16 activations with the bf16 dot instruction (M <= 8) ------------------ */

#if defined(MX_X86) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
uint8_t mx_bf16_lo_tab[128], mx_bf16_hi_tab[128];
static float factor_tab[256], factor256_tab[256];

__attribute__((constructor)) static void mx_dot_tables(void) {
    for (int v = 0; v < 128; v++) {
        uint32_t bits;
        const float e = (v == 0x7F ? 480.f / 256.f : mx_e4m3_scaled((uint8_t)v)) * 256.f;
        memcpy(&bits, &e, 4);
        mx_bf16_lo_tab[v] = (uint8_t)(bits >> 16);
        mx_bf16_hi_tab[v] = (uint8_t)(bits >> 24);
    }
    for (int b = 0; b < 256; b++) {
        factor_tab[b] = b == 255 ? mx_bits_f32(0x7FC00000u) : b == 0 ? mx_bits_f32(0x00400000u) : mx_bits_f32((uint32_t)b << 23);
        /* 2^(b - 135): the factor of chunks decoded at element * 256 (a denormal up to b = 8) */
        factor256_tab[b] = b == 255 ? mx_bits_f32(0x7FC00000u) : b <= 8 ? mx_bits_f32(1u << (b + 14)) : mx_bits_f32((uint32_t)(b - 8) << 23);
    }
}

#ifdef MX_GFNI
int mx_gfni_on = 1;
#endif

/* x row [K] bf16 -> the word order the decoded weights come in: within each 64-element chunk,
 * unpacklo/unpackhi of the byte lookups give elements 16L+0..7 and 16L+8..15 of 128-bit lane L,
 * so the first 32 words of a chunk hold elements {0-7, 16-23, 32-39, 48-55}, the next 32 the rest.
 * Dot lanes 0-7 then sum block 2c and lanes 8-15 block 2c + 1, for both halves. */
static void permute_x_bf16(const uint16_t *x, int64_t K, uint16_t *xp) {
    for (int64_t c = 0; c < K; c += 64)
        for (int j = 0; j < 32; j++) {
            xp[c + j] = x[c + 16 * (j / 8) + j % 8];
            xp[c + 32 + j] = x[c + 16 * (j / 8) + 8 + j % 8];
        }
}

/* 64 weights at w (scales sb[0], sb[1]) -> their bf16 words (l, h) and the fp32 factors of the dot
 * lanes (0-7: block sb[0], 8-15: block sb[1]). With GFNI, a chunk without zero or subnormal
 * elements is decoded at element * 256 (mx_decode64_bf16_x256) and its factors are 2^(b - 135):
 * the dot sums are then exactly 256 times the table's (a power of two, products exact in fp32), so
 * factor times sum gives the same bits either way. */
static inline __attribute__((always_inline)) MX_AVX512 __m512 decode_chunk_dot(const uint8_t *w, const uint8_t *sb,
                                                                               const mx_bf16_tabs *tabs, __m512i *l, __m512i *h) {
    const __m512i raw = _mm512_loadu_si512(w);
    const float *ft = factor_tab;
#ifdef MX_GFNI
    if (mx_gfni_on && __builtin_expect(mx_decode64_bf16_x256(raw, l, h), 1))
        ft = factor256_tab;
    else
#endif
        mx_decode64_bf16(raw, tabs, l, h);
    return _mm512_insertf32x8(_mm512_set1_ps(ft[sb[0]]), _mm256_set1_ps(ft[sb[1]]), 1);
}

/* One 64-weight chunk's step of a dot: the decoded words (wl, wh) and factors f against the 64
 * permuted bf16 x values at xm, added to tot. The one arithmetic of every bf16-dot decode loop (on
 * the fly, from a decoded row, two rows at once), so they all give the same bits. */
static inline __attribute__((always_inline)) MX_AVX512 __m512 dot_chunk_step(__m512 tot, __m512bh wl, __m512bh wh, __m512 f,
                                                                             const uint16_t *xm) {
    __m512 blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), wl, (__m512bh)_mm512_loadu_si512(xm));
    blk = _mm512_dpbf16_ps(blk, wh, (__m512bh)_mm512_loadu_si512(xm + 32));
    return _mm512_fmadd_ps(blk, f, tot);
}

/* One weight row dotted with M permuted bf16 x rows: tot[m], 16 lanes each to be summed. */
static inline __attribute__((always_inline)) MX_AVX512 void dot_row_bf16(const uint16_t *xp, const uint8_t *w, const uint8_t *s,
                                                                          int64_t K, const int M, const mx_bf16_tabs *tabs,
                                                                          __m512 *tot) {
    for (int m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += 64) {
        _mm_prefetch((const char *)(w + c + PREFETCH_BYTES), _MM_HINT_T0);
        __m512i l, h;
        const __m512 f = decode_chunk_dot(w + c, s + c / MX_BLOCK, tabs, &l, &h);
        for (int m = 0; m < M; m++) tot[m] = dot_chunk_step(tot[m], (__m512bh)l, (__m512bh)h, f, xp + m * K + c);
    }
}

/* The instances the loops below dispatch to (M a constant, so the loops unroll): the M dot-lane
 * vectors of one weight row, decoded on the fly (lanes_bf16_M) or from a row decoded before
 * (lanes_decoded_M: decode_row_dot, then the same dot_chunk_step on its words: the same bits
 * without decoding the row once per pass of x rows). */
#define LANES_BF16(M_)                                                                                              \
    static MX_AVX512 void lanes_bf16_##M_(const uint16_t *x, const uint8_t *w, const uint8_t *s, int64_t K,         \
                                          const mx_bf16_tabs *tabs, __m512 *tot) {                                  \
        dot_row_bf16(x, w, s, K, M_, tabs, tot);                                                                    \
    }
LANES_BF16(1)
LANES_BF16(2)
LANES_BF16(3)
LANES_BF16(4)
LANES_BF16(5)
LANES_BF16(6)
LANES_BF16(7)
LANES_BF16(8)
typedef void (*lanes_bf16_fn)(const uint16_t *, const uint8_t *, const uint8_t *, int64_t, const mx_bf16_tabs *, __m512 *);
static const lanes_bf16_fn LANES_FLY[DECODE_MAX_M + 1] = {0, lanes_bf16_1, lanes_bf16_2, lanes_bf16_3, lanes_bf16_4,
                                                          lanes_bf16_5, lanes_bf16_6, lanes_bf16_7, lanes_bf16_8};

typedef struct {
    __m512i l, h;
    __m512 f;
} mx_dot_chunk;

static MX_AVX512 void decode_row_dot(const uint8_t *w, const uint8_t *s, int64_t K, const mx_bf16_tabs *tabs, mx_dot_chunk *out) {
    for (int64_t c = 0; c < K; c += 64) out[c / 64].f = decode_chunk_dot(w + c, s + c / MX_BLOCK, tabs, &out[c / 64].l, &out[c / 64].h);
}

#define LANES_DECODED(M_)                                                                                          \
    static MX_AVX512 void lanes_decoded_##M_(const uint16_t *x, const mx_dot_chunk *d, int64_t K, __m512 *tot) {   \
        for (int m = 0; m < M_; m++) tot[m] = _mm512_setzero_ps();                                                 \
        for (int64_t c = 0; c < K; c += 64)                                                                        \
            for (int m = 0; m < M_; m++)                                                                           \
                tot[m] = dot_chunk_step(tot[m], (__m512bh)d[c / 64].l, (__m512bh)d[c / 64].h, d[c / 64].f, x + m * K + c); \
    }
LANES_DECODED(1)
LANES_DECODED(2)
LANES_DECODED(3)
LANES_DECODED(4)
LANES_DECODED(5)
LANES_DECODED(6)
LANES_DECODED(7)
LANES_DECODED(8)
typedef void (*lanes_decoded_fn)(const uint16_t *, const mx_dot_chunk *, int64_t, __m512 *);
static const lanes_decoded_fn LANES_DECODED_FNS[DECODE_MAX_M + 1] = {
    0, lanes_decoded_1, lanes_decoded_2, lanes_decoded_3, lanes_decoded_4, lanes_decoded_5, lanes_decoded_6,
    lanes_decoded_7, lanes_decoded_8};

/* lanes_decoded_8 for two weight rows at once (d0, d1): twice the independent chains */
static MX_AVX512 void lanes_decoded_8x2(const uint16_t *x, const mx_dot_chunk *d0, const mx_dot_chunk *d1, int64_t K,
                                        __m512 *t0, __m512 *t1) {
    for (int m = 0; m < 8; m++) t0[m] = t1[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < K; c += 64) {
        const mx_dot_chunk *a = d0 + c / 64, *b = d1 + c / 64;
        for (int m = 0; m < 8; m++) {
            t0[m] = dot_chunk_step(t0[m], (__m512bh)a->l, (__m512bh)a->h, a->f, x + m * K + c);
            t1[m] = dot_chunk_step(t1[m], (__m512bh)b->l, (__m512bh)b->h, b->f, x + m * K + c);
        }
    }
}

/* y = x W^T (+ bias) for M permuted bf16 x rows (permute_x_bf16), at any M: each thread takes
 * groups of 16 weight rows; per pass of up to 8 x rows, the 16 rows' dot lanes of each x row are
 * summed by one transpose-and-add tree (reduce16_ps: ~10 % of the M = 1 loop's time at K = 512
 * against a horizontal sum each, a Zen4 EPYC in cache). A row's lanes and their tree are the same
 * operations at every M and every place in a group, so an output's bits do not depend on the row
 * count: batch-invariant. One pass (M <= 8) decodes the weight rows on the fly; more passes decode
 * the group once into a per-thread buffer (16 rows x K/64 chunks of 192 bytes) and read it after.
 * Taken at one row, and at every row count by a batch-invariant call (linear_decode_rows_bf16 is
 * faster at 2..12 rows). */
static int linear_decode_bf16(const uint16_t *xp, const uint8_t *w, const uint8_t *s, const float *bias, void *y,
                              int y_dtype, int64_t M, int64_t N, int64_t K) {
    const int64_t KB = K / MX_BLOCK, KC = K / 64, groups = (N + 15) / 16;
    const int buffered = M > DECODE_MAX_M;
    int failed = 0;
#pragma omp parallel
    {
        const mx_bf16_tabs tabs = mx_load_bf16_tabs();
        mx_dot_chunk *d = buffered ? (mx_dot_chunk *)aligned_alloc(64, sizeof(mx_dot_chunk) * (size_t)(16 * KC)) : NULL;
        if (buffered && !d) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t n0 = g * 16, nr = N - n0 < 16 ? N - n0 : 16;
                if (buffered)
                    for (int64_t i = 0; i < nr; i++) decode_row_dot(w + (n0 + i) * K, s + (n0 + i) * KB, K, &tabs, d + i * KC);
                for (int64_t m0 = 0; m0 < M; m0 += DECODE_MAX_M) {
                    const int64_t mc = M - m0 < DECODE_MAX_M ? M - m0 : DECODE_MAX_M;
                    __m512 lanes[DECODE_MAX_M][16];
                    int64_t i0 = 0;
                    if (buffered && mc == DECODE_MAX_M)
                        for (; i0 + 2 <= nr; i0 += 2) {
                            __m512 t0[DECODE_MAX_M], t1[DECODE_MAX_M];
                            lanes_decoded_8x2(xp + m0 * K, d + i0 * KC, d + (i0 + 1) * KC, K, t0, t1);
                            for (int64_t m = 0; m < mc; m++) lanes[m][i0] = t0[m], lanes[m][i0 + 1] = t1[m];
                        }
                    for (int64_t i = i0; i < 16; i++) {
                        __m512 tot[DECODE_MAX_M];
                        if (i >= nr)
                            for (int64_t m = 0; m < mc; m++) tot[m] = _mm512_setzero_ps();
                        else if (buffered)
                            LANES_DECODED_FNS[mc](xp + m0 * K, d + i * KC, K, tot);
                        else
                            LANES_FLY[mc](xp + m0 * K, w + (n0 + i) * K, s + (n0 + i) * KB, K, &tabs, tot);
                        for (int64_t m = 0; m < mc; m++) lanes[m][i] = tot[m];
                    }
                    for (int64_t m = 0; m < mc; m++) {
                        float out[16];
                        _mm512_storeu_ps(out, reduce16_ps(lanes[m]));
                        for (int64_t i = 0; i < nr; i++)
                            store_as(y, y_dtype, (m0 + m) * N + n0 + i, out[i] + (bias ? bias[n0 + i] : 0.f));
                    }
                }
            }
        }
        free(d);
    }
    return failed ? -1 : 0;
}

/* The default loop for 2..DECODE_BF16_MAX_M rows: each thread a range of weight rows, every x row's
 * lanes summed on their own (a horizontal sum), up to 8 x rows a pass (the row is decoded once a
 * pass: the lookups cost more than a dot; further passes read it from L1). Its sums are ordered
 * otherwise than linear_decode_bf16's tree, so it is not taken for batch-invariant calls: in an
 * A/B of the two on the [151936, 512] lm_head (Zen4, 2 threads, medians of 9) they were within
 * 6 % at 1..4 rows, and this one 1.08x faster at 8 rows and 1.32x at 12. */
static void linear_decode_rows_bf16(const uint16_t *xp, const uint8_t *w, const uint8_t *s, const float *bias, void *y,
                                    int y_dtype, int64_t M, int64_t N, int64_t K) {
    const int64_t KB = K / MX_BLOCK;
#pragma omp parallel
    {
        const mx_bf16_tabs tabs = mx_load_bf16_tabs();
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            for (int64_t m0 = 0; m0 < M; m0 += DECODE_MAX_M) {
                const int64_t mc = M - m0 < DECODE_MAX_M ? M - m0 : DECODE_MAX_M;
                __m512 tot[DECODE_MAX_M];
                LANES_FLY[mc](xp + m0 * K, w + n * K, s + n * KB, K, &tabs, tot);
                for (int64_t m = 0; m < mc; m++)
                    store_as(y, y_dtype, (m0 + m) * N + n, _mm512_reduce_add_ps(tot[m]) + (bias ? bias[n] : 0.f));
            }
        }
    }
}

/* ---- tile loop on bf16 activations (M > 8): panels dequantized to bf16 for packed_gemm.c ------ */

int packed_gemm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *wp, const float *bias_f32, void *y,
                     int y_dtype, int64_t y_stride, int64_t M, int64_t N, int64_t K);

#define BF16_PANEL 64 /* packed_gemm.c's PANEL: features per panel */

/* 64 weights of one row (bytes wr[ch..ch+64), scales sr[ch/32], sr[ch/32 + 1]) -> their scaled
 * bf16 words in decode64_bf16's order (one k-pair a dword); the block scale is added to the
 * exponents of the non-zero words (words 0-15 of each half are block ch/32, words 16-31 the next).
 * With GFNI, a chunk without zero or subnormal elements is decoded at element * 256
 * (mx_decode64_bf16_x256), so every word is non-zero and takes the scale less 8 unmasked: the same
 * words as the table path. */
static inline __attribute__((always_inline)) MX_AVX512 void decode_chunk_bf16(const uint8_t *wr, const uint8_t *sr, int64_t ch,
                                                                               const mx_bf16_tabs *tabs, __m512i *wl, __m512i *wh) {
    const __m512i shift = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)((sr[ch / 32] - 127) * 128)),
                                                  _mm512_set1_epi16((short)((sr[ch / 32 + 1] - 127) * 128)));
    const __m512i raw = _mm512_loadu_si512(wr + ch);
    __m512i l, h;
#ifdef MX_GFNI
    if (mx_gfni_on && __builtin_expect(mx_decode64_bf16_x256(raw, &l, &h), 1)) {
        const __m512i shift256 = _mm512_sub_epi16(shift, _mm512_set1_epi16(8 * 128));
        *wl = _mm512_add_epi16(l, shift256);
        *wh = _mm512_add_epi16(h, shift256);
        return;
    }
#endif
    mx_decode64_bf16(raw, tabs, &l, &h);
    *wl = mx_scale_bf16(l, shift);
    *wh = mx_scale_bf16(h, shift);
}

/* r[i] = 16 dwords (k-pairs) of row c0 + i -> for each dword lane j, the 16 rows' dwords stored
 * contiguously at dst[pair(j) * BF16_PANEL] (pair(j) = 8 (j / 4) + j % 4, + 4 for the high half):
 * a 16 x 16 transpose in registers (32-bit and 64-bit unpacks, then two 128-bit lane shuffles). */
static inline __attribute__((always_inline)) MX_AVX512 void transpose16_store(const __m512i r[16], uint32_t *dst, int high) {
    __m512i t[16], u[16];
    for (int a = 0; a < 16; a += 2) {
        t[a] = _mm512_unpacklo_epi32(r[a], r[a + 1]);
        t[a + 1] = _mm512_unpackhi_epi32(r[a], r[a + 1]);
    }
    /* u[4b + q], 128-bit lane L: rows 4b..4b+3 at input lane 4L + q */
    for (int b = 0; b < 16; b += 4) {
        u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for (int q = 0; q < 4; q++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x88), v1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xDD);
        const __m512i w0 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xDD);
        const __m512i o[4] = {_mm512_shuffle_i32x4(v0, w0, 0x88), _mm512_shuffle_i32x4(v1, w1, 0x88),
                              _mm512_shuffle_i32x4(v0, w0, 0xDD), _mm512_shuffle_i32x4(v1, w1, 0xDD)}; /* lane L = 0..3 */
        for (int L = 0; L < 4; L++) _mm512_storeu_si512(dst + (8 * L + q + 4 * high) * BF16_PANEL, o[L]);
    }
}

/* Rows [0, nr) of W (row stride K, scales stride K/32) -> one packed_gemm panel of bf16 weights:
 * panel[kk][c][j] = W[c][2 kk + j], zero for rows past nr. 16 rows at a time, each 64-weight chunk
 * decoded and scaled (decode_chunk_bf16), then transposed so that each k-pair's 16 rows are one
 * store (the first version scattered each row's 32 pairs: [151936, 512] at 64 rows took 37.7-41.1
 * ms against 31.9-32.2 now, Zen4, 2 threads, alternating builds). `next` (nr_next rows, or NULL):
 * the thread's next panel, one cache line of it prefetched per chunk decoded, so that its bytes
 * arrive while this panel's GEMM runs (without, a panel's decode waits on memory and the GEMM
 * leaves it idle). With the GFNI decode in decode_chunk_bf16, against the library before both:
 * [151936, 512] from memory at 16 / 32 / 64 rows 15.2 / 20.5 / 34.0 -> 12.6 / 17.7 / 31.6 ms
 * (Zen4, 2 threads, both builds alternating in one process). */
static MX_AVX512 void dequant_panel_bf16(const uint8_t *w, const uint8_t *s, int64_t nr, int64_t K, uint16_t *panel,
                                         const uint8_t *next, int64_t nr_next) {
    const int64_t KB = K / MX_BLOCK;
    const mx_bf16_tabs tabs = mx_load_bf16_tabs();
    uint32_t *pd = (uint32_t *)panel;
    for (int64_t c0 = 0; c0 < BF16_PANEL; c0 += 16)
        for (int64_t ch = 0; ch < K; ch += 64) {
            __m512i lo[16], hi[16];
            for (int i = 0; i < 16; i++) {
                if (next && c0 + i < nr_next) _mm_prefetch((const char *)(next + (c0 + i) * K + ch), _MM_HINT_T0);
                if (c0 + i < nr) decode_chunk_bf16(w + (c0 + i) * K, s + (c0 + i) * KB, ch, &tabs, &lo[i], &hi[i]);
                else lo[i] = hi[i] = _mm512_setzero_si512();
            }
            transpose16_store(lo, pd + (ch / 2) * BF16_PANEL + c0, 0);
            transpose16_store(hi, pd + (ch / 2) * BF16_PANEL + c0, 1);
        }
}

/* y = x W^T (+ bias) for bf16 x, M > 8: each thread dequantizes a panel of 64 weight rows to bf16
 * (K x 128 bytes, in L2) and runs packed_gemm.c's 6-row dot tiles over every x row; exact weights,
 * fp32 sums, as on the other loops. K % 64 == 0 and every scale byte in the safe range (checked by
 * the caller). Returns -1 when a buffer cannot be allocated. */
static int linear_tile_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const uint8_t *s, const float *bias,
                            void *y, int y_dtype, int64_t M, int64_t N, int64_t K) {
    const int64_t KB = K / MX_BLOCK, panels = (N + BF16_PANEL - 1) / BF16_PANEL;
    const size_t esize = y_dtype == DT_BF16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(K * BF16_PANEL));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t n0 = p * BF16_PANEL, nr = N - n0 < BF16_PANEL ? N - n0 : BF16_PANEL;
                const int64_t n1 = n0 + BF16_PANEL, nr1 = N - n1 < BF16_PANEL ? N - n1 : BF16_PANEL;
                dequant_panel_bf16(w + n0 * K, s + n0 * KB, nr, K, buf, n1 < N ? w + n1 * K : NULL, nr1);
                /* one panel: packed_gemm's own parallel loop runs nested, i.e. on this thread */
                packed_gemm_bf16(x, x_stride, buf, bias ? bias + n0 : NULL, (char *)y + n0 * esize, y_dtype, N, M, nr, K);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
#endif

/* Which loop the last mxfp8_linear call took: 0 scalar, 1 AVX2 decode, 2 bf16-dot decode, 3 tile
 * (fp32), 4 bf16 tile, 5 AVX2 placed (1-2 rows) (tests check that a case exercises the path it means to). */
static int last_path = -1;
int mxfp8_last_linear_path(void) { return last_path; }

int mxfp8_bf16_dot_available(void) {
#ifdef MX_DOT_BF16
    return 1;
#else
    return 0;
#endif
}

static int bf16_dot_on = 1;

/* Let bf16 activations take the bf16-dot decode loop where it is built (1, the default) or send
 * them to the AVX2 loop (0, for tests and A/B timing); returns whether the loop is now in use. */
int mxfp8_set_bf16_dot(int on) {
    bf16_dot_on = on != 0;
    return bf16_dot_on && mxfp8_bf16_dot_available();
}

/* Let calls on the AVX2 path take the placed loops (1, the default: this file's at 1-2 x rows and
 * the routed experts' MXFP8 tile at one row) or the M-row loops (0, for tests and A/B timing);
 * returns whether they are now in use (0 where the library is not for x86). */
int mxfp8_set_placed(int on) {
    placed_on = on != 0;
#ifdef MX_X86
    return placed_on;
#else
    return 0;
#endif
}

/* Let the bf16-dot loops (this decode loop, the experts' MXFP8 dot layout) take the GF2P8AFFINEQB
 * decode where it is built (1, the default) or only the table lookups (0: tests compare the two,
 * which give the same bits); returns whether it is on. */
int mxfp8_set_gfni_decode(int on) {
#ifdef MX_GFNI
    mx_gfni_on = on != 0;
    return mx_gfni_on;
#else
    (void)on;
    return 0;
#endif
}

/* ---- tile loop (M > 8) ---------------------------------------------------------------------- */

#define TILE_N 16

#ifdef MX_X86
/* rows a (and b, if two) of x against 4 rows of the fp32 tile wt (row stride K) */
static inline __attribute__((always_inline)) MX_AVX2 void micro_mx(const float *xa, const float *xb, const float *wt,
                                                                   int64_t K, const int two, float out[8]) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 a = _mm256_loadu_ps(xa + k);
        const __m256 b = two ? _mm256_loadu_ps(xb + k) : a;
        for (int j = 0; j < 4; j++) {
            const __m256 w = _mm256_loadu_ps(wt + j * K + k);
            acc[j] = _mm256_fmadd_ps(a, w, acc[j]);
            if (two) acc[4 + j] = _mm256_fmadd_ps(b, w, acc[4 + j]);
        }
    }
    for (int i = 0; i < (two ? 8 : 4); i++) out[i] = mx_hsum(acc[i]);
}
static MX_AVX2 void micro_mx_2(const float *xa, const float *xb, const float *wt, int64_t K, float out[8]) {
    micro_mx(xa, xb, wt, K, 1, out);
}
static MX_AVX2 void micro_mx_1(const float *xa, const float *wt, int64_t K, float out[8]) {
    micro_mx(xa, xa, wt, K, 0, out);
}
#endif

#ifdef MX_X86
/* one weight row (KB blocks) to fp32 on the AVX2 decode, for the tile: its own function so that the
 * AVX intrinsics sit under MX_AVX2 (a build for a CPU without AVX then still compiles and takes
 * the scalar loop at run time) */
static MX_AVX2 void tile_row_avx2(const uint8_t *w, const uint8_t *s, int64_t KB, float *out) {
    for (int64_t kb = 0; kb < KB; kb++) {
        __m256 v[4];
        mx_dequant_block(w + kb * MX_BLOCK, s[kb], v);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + kb * MX_BLOCK + 8 * i, v[i]);
    }
}
#endif

static void dequant_tile(const uint8_t *w, const uint8_t *s, int64_t rows, int64_t K, float *wt, int fast) {
    const int64_t KB = K / MX_BLOCK;
    for (int64_t r = 0; r < rows; r++) {
#ifdef MX_X86
        if (fast) {
            tile_row_avx2(w + r * K, s + r * KB, KB, wt + r * K);
            continue;
        }
#endif
        for (int64_t k = 0; k < K; k++) {
            float e = mx_e4m3_scaled(w[r * K + k]);
            const uint8_t b = s[r * KB + k / MX_BLOCK];
            if (mx_scale_hi(b)) e *= 256.f;
            wt[r * K + k] = e * mx_scale_factor(b);
        }
    }
    (void)fast;
}

static int linear_tile(const float *x, const uint8_t *w, const uint8_t *s, const float *bias, void *y, int y_dtype,
                       int64_t M, int64_t N, int64_t K, int fast) {
    const int64_t KB = K / MX_BLOCK, tiles = (N + TILE_N - 1) / TILE_N;
    /* x rows per chunk: ~256 KiB of fp32 x beside the tile in L2 */
    int64_t chunk = (65536 / K) & ~(int64_t)1;
    if (chunk < 8) chunk = 8;
    int failed = 0;
#pragma omp parallel
    {
        float *wt = (float *)malloc(sizeof(float) * (size_t)(TILE_N * K));
        if (!wt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            for (int64_t m0 = 0; m0 < M; m0 += chunk) {
                const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
#pragma omp for schedule(static)
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t n0 = t * TILE_N, nr = N - n0 < TILE_N ? N - n0 : TILE_N;
                    dequant_tile(w + n0 * K, s + n0 * KB, nr, K, wt, fast);
                    if (nr < TILE_N) memset(wt + nr * K, 0, sizeof(float) * (size_t)((TILE_N - nr) * K));
                    for (int64_t m = m0; m < m1; m += 2) {
                        const int two = m + 1 < m1;
                        for (int64_t j0 = 0; j0 < nr; j0 += 4) {
                            float out[8];
#ifdef MX_X86
                            if (fast) {
                                if (two) micro_mx_2(x + m * K, x + (m + 1) * K, wt + j0 * K, K, out);
                                else micro_mx_1(x + m * K, wt + j0 * K, K, out);
                            } else
#endif
                            {
                                for (int i = 0; i < (two ? 8 : 4); i++) {
                                    const float *xm = x + (m + i / 4) * K, *wr = wt + (j0 + i % 4) * K;
                                    float a = 0.f;
                                    for (int64_t k = 0; k < K; k++) a += xm[k] * wr[k];
                                    out[i] = a;
                                }
                            }
                            for (int i = 0; i < (two ? 8 : 4); i++) {
                                const int64_t n = n0 + j0 + i % 4;
                                if (n < n0 + nr) store_as(y, y_dtype, (m + i / 4) * N + n, out[i] + (bias ? bias[n] : 0.f));
                            }
                        }
                    }
                }
            }
        }
        free(wt);
    }
    (void)fast;
    return failed ? -1 : 0;
}

/* x: [M, K] fp32/bf16 (row stride x_stride), data/scales: the MXFP8 weight [N, K] / [N, K/32],
 * bias: [N] fp32 or NULL, y: [M, N] contiguous (fp32/bf16). Returns 0; -1 when a buffer cannot be
 * allocated; -2 when K is not a multiple of 32. invariant: 1 for a batch-invariant call: the decode
 * loops and the tile loops sum in different orders, so then a decode loop takes every row count, in
 * passes of 8 rows (bf16 x with K % 64 == 0: the bf16-dot one; otherwise the fp32 one). Measured
 * (benchmarks/batch_invariance.py): the bf16 tile loop for every row count instead halved batch-1
 * decode. */
int mxfp8_linear(const void *x, int x_dtype, int64_t x_stride, const uint8_t *data, const uint8_t *scales,
                 const float *bias, void *y, int y_dtype, int64_t M, int64_t N, int64_t K, int invariant) {
    if (K % MX_BLOCK != 0) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int fast = mxfp8_use_fast();
#ifdef MX_DOT_BF16
    if (fast && bf16_dot_on && x_dtype == DT_BF16 && (M <= DECODE_BF16_MAX_M || invariant) && K % 64 == 0) {
        uint16_t *xp = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(M * K));
        if (!xp) return -1;
        for (int64_t m = 0; m < M; m++) permute_x_bf16((const uint16_t *)x + m * x_stride, K, xp + m * K);
        int rc = 0;
        if (M == 1 || invariant) rc = linear_decode_bf16(xp, data, scales, bias, y, y_dtype, M, N, K);
        else linear_decode_rows_bf16(xp, data, scales, bias, y, y_dtype, M, N, K);
        free(xp);
        last_path = 2;
        return rc;
    }
    if (fast && bf16_dot_on && x_dtype == DT_BF16 && K % 64 == 0 && mxfp8_scales_bf16_safe(scales, N * (K / MX_BLOCK))) {
        last_path = 4;
        return linear_tile_bf16((const uint16_t *)x, x_stride, data, scales, bias, y, y_dtype, M, N, K);
    }
#endif
    const float *xf = (const float *)x;
    float *copy = NULL;
    if (x_dtype != DT_F32 || x_stride != K) { /* one contiguous fp32 copy of x (small next to W) */
        copy = (float *)malloc(sizeof(float) * (size_t)(M * K));
        if (!copy) return -1;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++)
                copy[m * K + k] = x_dtype == DT_BF16 ? bf16_to_f32(((const uint16_t *)x)[m * x_stride + k])
                                                     : ((const float *)x)[m * x_stride + k];
        xf = copy;
    }
    int rc = 0;
    const int decode = M <= DECODE_MAX_M || invariant;
    if (decode) last_path = linear_decode(xf, data, scales, bias, y, y_dtype, M, N, K, fast, invariant);
    else {
        rc = linear_tile(xf, data, scales, bias, y, y_dtype, M, N, K, fast);
        last_path = 3;
    }
    free(copy);
    return rc;
}
