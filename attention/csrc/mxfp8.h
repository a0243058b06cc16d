/* MXFP8 (OCP MX v1.0) decoding for the CPU kernels: E4M3 element bytes and E8M0 block-scale
 * bytes to fp32, as static inline helpers so that every kernel reading MXFP8 weights (the dense
 * GEMM in mxfp8_gemm.c, a routed-expert kernel) shares one inner loop and one rounding rule.
 *
 * Element decode: an E4M3 byte `s eeee mmm` (bias 7) becomes the fp16 `s 0eeee mmm0000000`
 * (bias 15), i.e. the element times 2^-8 exactly, subnormals included (E4M3 subnormals land on
 * fp16 subnormals); F16C's vcvtph2ps then widens 8 of them to fp32 in one instruction. So one
 * 16-byte load gives 16 fp32 values with 3 integer ops and 2 conversions, all in registers.
 * The NaN byte (0x7F / 0xFF) decodes to 480 * 2^-8 here: quantize_mxfp8 writes it only into
 * blocks whose scale is NaN, and the NaN scale makes the block NaN (callers that take bytes from
 * elsewhere check them once: cuttle.attention.native.mxfp8.check_nan_elements; the dequantize
 * kernel alone decodes them as NaN everywhere).
 *
 * Block scale: E8M0 byte b means 2^(b - 127). With the elements carrying 2^-8, a block's factor
 * is 2^(b - 119), a normal fp32 for b <= 246; b in 247..254 needs the extra 2^8 applied apart
 * (mx_scale_hi), b = 255 is NaN. Every (element x factor) product is exact or rounded once, so
 * dequantization is the correctly rounded fp32 value of element * 2^(b - 127), as in
 * cuttle.moe.mxfp8.dequantize_mxfp8.
 */
#ifndef CUTTLE_MXFP8_H
#define CUTTLE_MXFP8_H
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MX_X86 1
#define MX_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

#define MX_BLOCK 32

static inline float mx_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The fp32 factor of scale byte b for elements that carry 2^-8 (b <= 254), NaN for 255. For
 * b > 246 this is 2^(b - 127) and the caller multiplies by 2^8 first (mx_scale_hi). */
static inline float mx_scale_factor(uint8_t b) {
    if (b == 255) return mx_bits_f32(0x7FC00000u);
    if (b > 246) return mx_bits_f32((uint32_t)b << 23); /* 2^(b - 127) */
    return mx_bits_f32((uint32_t)(b + 8) << 23);                       /* 2^(b - 119) */
}

static inline int mx_scale_hi(uint8_t b) { return b > 246 && b != 255; }

/* One E4M3 byte -> element * 2^-8 in fp32 (the scalar twin of mx_decode16). */
static inline float mx_e4m3_scaled(uint8_t v) {
    const uint32_t e = (v >> 3) & 0xF, m = v & 7;
    const float mag = e == 0 ? (float)m * mx_bits_f32(0x37000000u) /* m * 2^-17 */
                             : mx_bits_f32(((e + 112u) << 23) | (m << 20)); /* 2^(e-7-8) * 1.m */
    return (v & 0x80) ? -mag : mag;
}

/* Whether the vector loops run (CPU has AVX2 + FMA + F16C, not switched off by
 * mxfp8_set_fast_path(0)): one switch for every MXFP8 kernel, defined in mxfp8_gemm.c. */
int mxfp8_use_fast(void);

/* Whether the loops on the placed decode run (below; mxfp8_set_placed(0) turns them off for tests
 * and A/B timing), defined in mxfp8_gemm.c. */
int mxfp8_placed_on(void);

#ifdef MX_X86
/* 16 E4M3 bytes -> 16 fp32 (element * 2^-8) in two registers. */
static inline MX_AVX2 void mx_decode16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    /* sign-extended byte << 7: bit 15 = sign, bits 14..7 = a copy of the sign then eeee mmm;
     * clearing bit 14 leaves the fp16 s 0eeee mmm0000000 */
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBF80));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

/* One 32-element block decoded and scaled: the exact dequantized fp32 values (rounded once). */
static inline MX_AVX2 void mx_dequant_block(const uint8_t *p, uint8_t b, __m256 out[4]) {
    mx_decode16(p, &out[0], &out[1]);
    mx_decode16(p + 16, &out[2], &out[3]);
    const __m256 f = _mm256_set1_ps(mx_scale_factor(b));
    if (mx_scale_hi(b)) {
        const __m256 pre = _mm256_set1_ps(256.f);
        for (int i = 0; i < 4; i++) out[i] = _mm256_mul_ps(out[i], pre);
    }
    for (int i = 0; i < 4; i++) out[i] = _mm256_mul_ps(out[i], f);
}

/* The factors of 8 consecutive scale bytes (for 8 features side by side, as the MoE kernel's
 * panels store them): f = mx_scale_factor(b) per lane and pre = 256 where mx_scale_hi(b), else 1.
 * A block sum is scaled as (sum * pre) * f. */
static inline MX_AVX2 void mx_factors8(const uint8_t *s, __m256 *f, __m256 *pre) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s));
    const __m256i hi = _mm256_cmpgt_epi32(b, _mm256_set1_epi32(246)); /* 247..255 */
    const __m256i nan = _mm256_cmpeq_epi32(b, _mm256_set1_epi32(255));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(b, _mm256_andnot_si256(hi, _mm256_set1_epi32(8))), 23);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), nan);
    *f = _mm256_castsi256_ps(bits);
    *pre = _mm256_blendv_ps(_mm256_set1_ps(1.f), _mm256_set1_ps(256.f), _mm256_castsi256_ps(_mm256_andnot_si256(nan, hi)));
}

/* ---- E4M3 placed as fp32 bits (the placed loops) --------------------------------------------
 * The route above goes through vcvtph2ps and vextracti128, which share one port on Zen3 (one a
 * cycle): with 6 of them per 32-element block that port bounds a one-row loop (~9 cycles a block
 * in L1). Instead an element can be placed as fp32 bits: vpshufb puts its byte at the top of a
 * dword (zeros below), an arithmetic shift by 4 and an AND leave sign s, exponent field eeee and
 * mantissa mmm -- element * 2^-120 exactly (an fp32 subnormal when e = 0) -- and one multiply by
 * 2^(b - 7) gives element * 2^(b - 127), the dequantized weight rounded once, as mx_dequant_block
 * gives it. 4 ops and a multiply per 8 weights, no conversion; the weights come out dequantized,
 * so a loop dots x with them directly (no block factor). For scale bytes <= MX_PLACED_MAX_B only
 * (above, 2^(b - 7) overflows: callers take the route above). Elements with e = 0 are subnormal
 * inputs to the multiply, slower on some CPUs, never wrong. */
#define MX_PLACED_MAX_B 134

/* vpshufb controls: from 16 bytes in both 128-bit lanes, lane 0 takes bytes 0..3 (lo) / 8..11 (hi)
 * and lane 1 bytes 4..7 / 12..15, each at the top of a dword: elements 0..7 / 8..15 in order */
static inline MX_AVX2 __m256i mx_placed_lo(void) {
    const char z = (char)0x80;
    return _mm256_setr_epi8(z, z, z, 0, z, z, z, 1, z, z, z, 2, z, z, z, 3, z, z, z, 4, z, z, z, 5, z, z, z, 6, z, z, z, 7);
}
static inline MX_AVX2 __m256i mx_placed_hi(void) {
    const char z = (char)0x80;
    return _mm256_setr_epi8(z, z, z, 8, z, z, z, 9, z, z, z, 10, z, z, z, 11, z, z, z, 12, z, z, z, 13, z, z, z, 14, z, z, z, 15);
}

/* 16 bytes at p in both lanes (the vpshufb source) */
static inline MX_AVX2 __m256i mx_placed_src(const uint8_t *p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
}

/* the 8 elements `shuf` picks from q, times f (2^(b - 7) per lane): their dequantized fp32 values */
static inline __attribute__((always_inline)) MX_AVX2 __m256 mx_placed8(__m256i q, __m256i shuf, __m256 f) {
    const __m256i bits = _mm256_and_si256(_mm256_srai_epi32(_mm256_shuffle_epi8(q, shuf), 4), _mm256_set1_epi32((int)0x87F00000u));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), f);
}

/* max |x| over the n entries of x that are not NaN (a NaN stays NaN whatever x is scaled by; taking
 * it into the max let the entries after it decide the scale alone) */
static inline float mx_amax(const float *x, int64_t n) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) {
        const float a = x[i] < 0.f ? -x[i] : x[i];
        if (a > amax) amax = a;
    }
    return amax;
}

/* k for placed loops that scale x by 2^k before dotting it with placed elements (element x
 * 2^-120: their products with x would underflow), for max |x| = amax: 2^k * amax in [2^100,
 * 2^101), clamped to 0..119 so that the block factors 2^(b - 7 - k) are normal fp32 for
 * b <= MX_PLACED_MAX_B */
static inline int mx_placed_shift(float amax) {
    uint32_t u;
    memcpy(&u, &amax, 4);
    const int e = (int)((u >> 23) & 0xFF);
    if (e == 0xFF) return 0; /* inf / NaN */
    if (e == 0) return 119;  /* zero or subnormal */
    const int k = 100 - (e - 127);
    return k < 0 ? 0 : k > 119 ? 119 : k;
}

/* the factors 2^(b - 7) of 8 scale bytes, all <= MX_PLACED_MAX_B */
static inline MX_AVX2 __m256 mx_placed_factors8(const uint8_t *s) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)s));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(120)), 23));
}

/* A 32-element block placed in dword order, for loops that read contiguous blocks (the dense
 * placed loop): reading the block as 16-bit words, an arithmetic word shift by 4 leaves each
 * word's high byte as s ssss eeee mmm0000 in the word, so one AND keeps the high word's as the fp32
 * bits s 0000eeee mmm (element * 2^-120, as mx_placed8) and an AND and a dword shift by 16 the low
 * word's; a word shift by 8 first does the same for the low bytes. 5 shifts per 32 elements where
 * mx_placed8 takes 8 shuffles and shifts (the ops Zen3 runs on two ports): 1.1-1.2x the one-row placed
 * loop on mx_placed8 (lm_head [151936, 512] from memory, one or two threads, Zen3). v[j] lane i
 * is element 4 i + j times 2^-120 (no factor: the caller scales block sums, mxfp8_gemm.c's placed
 * loop) and dots it with x in the same order (mx_dword_order). */
static inline __attribute__((always_inline)) MX_AVX2 void mx_placed32(const uint8_t *p, __m256 v[4]) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)p);
    const __m256i hi = _mm256_set1_epi32((int)0x87F00000u), lo = _mm256_set1_epi32(0x87F0);
    const __m256i odd = _mm256_srai_epi16(q, 4), even = _mm256_srai_epi16(_mm256_slli_epi16(q, 8), 4);
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(even, lo), 16));
    v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(odd, lo), 16));
    v[2] = _mm256_castsi256_ps(_mm256_and_si256(even, hi));
    v[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, hi));
}

/* x [K] (K a multiple of 32) times sc -> xd in mx_placed32's order: xd[32 kb + 8 j + i] = x[32 kb + 4 i + j] * sc */
static inline void mx_dword_order(const float *x, int64_t K, float sc, float *xd) {
    for (int64_t b = 0; b < K; b += MX_BLOCK)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 8; i++) xd[b + 8 * j + i] = x[b + 4 * i + j] * sc;
}

/* whether all 16 scale bytes at s are <= MX_PLACED_MAX_B */
static inline MX_AVX2 int mx_placed_ok16(const uint8_t *s) {
    const __m128i b = _mm_loadu_si128((const __m128i *)s), lim = _mm_set1_epi8((char)MX_PLACED_MAX_B);
    return _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(b, lim), lim)) == 0xFFFF;
}

static inline MX_AVX2 float mx_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int mx_cpu_has_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
static inline int mx_cpu_has_avx2(void) { return 0; }
#endif
/* ---- E4M3 -> bf16 for the bf16 dot instruction (AVX512-BF16 + VBMI builds) ----------------- */

/* Scale bytes b for which element * 2^(b - 127) is a normal bf16 for every non-zero E4M3 element
 * (2^-9 .. 448): then the scaled weight is exact in bf16 and is the element's bf16 with b - 127
 * added to its exponent field. That holds for 10 <= b <= 246; the lower end is 64 so that a
 * weight (>= 2^-72) times an activation stays above the fp32 normal range the dot instruction
 * keeps (it flushes smaller products) unless |x| < 2^-54. Outside (tiny or huge blocks, NaN) the
 * callers take their fp32 loops; real weights have b around 100-127. */
#define MX_BF16_SAFE_LO 64
#define MX_BF16_SAFE_HI 246
int mxfp8_scales_bf16_safe(const uint8_t *s, int64_t n); /* mxfp8_gemm.c */

#if defined(MX_X86) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define MX_DOT_BF16 1
#if defined(__GFNI__)
#define MX_GFNI 1
#define MX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16,gfni")))
#else
#define MX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16")))
#endif

/* E4M3 magnitude byte (7 bits) -> the low and high byte of the element's bf16 value (filled by
 * mxfp8_gemm.c's constructor; see there) */
extern uint8_t mx_bf16_lo_tab[128], mx_bf16_hi_tab[128];

/* The byte tables as the lookups take them (the caller loads them once, outside its loop). */
typedef struct {
    __m512i lo0, lo1, hi0, hi1;
} mx_bf16_tabs;

static inline __attribute__((always_inline)) MX_AVX512 mx_bf16_tabs mx_load_bf16_tabs(void) {
    return (mx_bf16_tabs){_mm512_loadu_si512(mx_bf16_lo_tab), _mm512_loadu_si512(mx_bf16_lo_tab + 64),
                          _mm512_loadu_si512(mx_bf16_hi_tab), _mm512_loadu_si512(mx_bf16_hi_tab + 64)};
}

/* 64 E4M3 bytes -> their exact bf16 words (unscaled), in the unpacks' order: *wl holds elements
 * 0-7, 16-23, 32-39, 48-55, *wh the others (bytes 16 L + i of 128-bit lane L; word 8 L + i). */
static inline __attribute__((always_inline)) MX_AVX512 void mx_decode64_bf16(__m512i raw, const mx_bf16_tabs *t, __m512i *wl,
                                                                              __m512i *wh) {
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, raw, t->lo1); /* index bits 0..6 */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, raw, t->hi1), raw,
                                                 _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (raw & 0x80) */
    *wl = _mm512_unpacklo_epi8(lo, hi);
    *wh = _mm512_unpackhi_epi8(lo, hi);
}

#ifdef MX_GFNI
/* 64 E4M3 bytes -> the bf16 words of element * 256, in mx_decode64_bf16's order, by bit arithmetic
 * instead of the two table lookups, when no element has a zero exponent field (returns 0 and
 * leaves wl / wh alone if one does: zeros and subnormals take the table). For exponent e >= 1 and
 * mantissa m, element * 256 = 2^(e + 1) * 1.m has the bf16 exponent field e + 128 (binary
 * 1000eeee), so its high byte is sign | 0x40 | e >> 1 and its low byte (e & 1) << 7 | m << 4: each
 * an affine map of the element's bits, one GF2P8AFFINEQB each (matrix row 7 - i feeds bit i). On a
 * Zen4 EPYC the affine ops leave the shuffle unit to the unpacks: ~15 % off the M = 1 decode loop
 * in cache (a standalone harness, the two decodes alternating).
 * The 0x7F byte (E4M3 NaN) gives 480 * 256 here and 480 in the table, as the callers expect (NaN
 * comes from the block scale). */
extern int mx_gfni_on; /* mxfp8_gemm.c: mxfp8_set_gfni_decode switches it (tests) */

static inline __attribute__((always_inline)) MX_AVX512 int mx_decode64_bf16_x256(__m512i raw, __m512i *wl, __m512i *wh) {
    if (_mm512_testn_epi8_mask(raw, _mm512_set1_epi8(0x78))) return 0;
    const __m512i lo = _mm512_gf2p8affine_epi64_epi8(raw, _mm512_set1_epi64(0x0000000001020408LL), 0x00); /* m << 4, e & 1 */
    const __m512i hi = _mm512_gf2p8affine_epi64_epi8(raw, _mm512_set1_epi64(0x1020400000000080LL), 0x40); /* sign, 1, e >> 1 */
    *wl = _mm512_unpacklo_epi8(lo, hi);
    *wh = _mm512_unpackhi_epi8(lo, hi);
    return 1;
}
#endif

/* w with the block scale's exponent (words `shift` = (b - 127) << 7) added to its non-zero words:
 * the exact bf16 of element * 2^(b - 127) for a safe b (zeros stay zero) */
static inline __attribute__((always_inline)) MX_AVX512 __m512i mx_scale_bf16(__m512i w, __m512i shift) {
    return _mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7FFF)), w, shift);
}
#endif
#endif
