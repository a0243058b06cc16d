/* Attention of one KV head's query group over a *subset* of a sequence's paged keys: the inner
 * loop both sparse decode kernels share (nsa_decode.c: selected blocks and window; topk_decode.c:
 * the top-k blocks). Implementation: sparse_attend.c. */
#ifndef CUTTLE_SPARSE_ATTEND_H
#define CUTTLE_SPARSE_ATTEND_H
#include <stdint.h>

/* `group` query rows qf [group][D] (fp32, already multiplied by the softmax scale) against the keys
 * of the ranges [t0[i], t1[i]) of one sequence (block table `table`, KV head h of a
 * [blocks, block_size, kv_heads, D] cache; kv_dtype DT_F32 or DT_BF16). Two passes over the keys:
 * scores, then exp(score - max) and p.V. Writes, per query row g: m[g] = the max score, s[g] = the
 * sum of exp(score - m[g]) and acc[g][D] = sum exp(score - m[g]) v (not normalised; an empty key
 * set gives m = -inf, s = 0, acc = 0). sc: scratch of group * (number of keys) floats. */
void sparse_attend(const float *qf, const void *k_cache, const void *v_cache, int kv_dtype, const int32_t *table,
                   const int64_t *t0, const int64_t *t1, int64_t nranges, int64_t block_size, int64_t token_stride,
                   int64_t h, int64_t group, int64_t D, float *sc, float *acc, float *m, float *s);

/* The same loops' pieces for a kernel's other branches (vectorised like sparse_attend):
 * q . k over D of fp32 q and a cached row (fp32 or bf16) at element offset off; acc += p * v;
 * x[0..n) = exp(x - mx) in place, returning their sum. */
float sparse_dot(const float *q, const void *k, int kv_dtype, int64_t off, int64_t D);
void sparse_axpy(float *acc, float p, const void *v, int kv_dtype, int64_t off, int64_t D);
float sparse_exp_sum(float *x, int64_t n, float mx);

/* Tests turn the vector (AVX2) path off to compare it with the scalar loops on the same inputs;
 * fast_available says whether this build has the vector path (0 on a CPU without AVX2 + FMA). */
void sparse_attend_set_fast_path(int enabled);
int sparse_attend_fast_available(void);
#endif
