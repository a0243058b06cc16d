/* Read in place: a block-table entry with bit 30 set (HOST_BLOCK, cuttle.attention.metadata) names
 * block `id - HOST_BLOCK` of a second pool with the same layout (the KV host tier), so a sequence's
 * cold blocks are read where they lie instead of being copied into the first pool first. Every
 * paged kernel (paged_decode.c, sparse_attend.c and the NSA / top-k kernels around it) chooses the
 * pool per block through these helpers; the arithmetic does not depend on where a block lies. */
#ifndef CUTTLE_HOST_POOL_H
#define CUTTLE_HOST_POOL_H
#include <stdint.h>

#define HOST_BLOCK 0x40000000 /* block-table flag: the block is in the host pool */

/* element offset of block `id` and the pool it lies in (k/v chosen by the caller) */
static inline __attribute__((always_inline)) int64_t block_base(int32_t id, int64_t block_size, int64_t token_stride,
                                                                int *on_host) {
    *on_host = (id & HOST_BLOCK) != 0;
    return (int64_t)(id & ~HOST_BLOCK) * block_size * token_stride;
}

/* The first byte of block `id` (block_bytes bytes a block) in its pool: dev, or host for a
 * HOST_BLOCK id. */
static inline __attribute__((always_inline)) const char *pool_block(const char *dev, const char *host, int32_t id,
                                                                    int64_t block_bytes) {
    return (id & HOST_BLOCK) ? host + (int64_t)(id & ~HOST_BLOCK) * block_bytes : dev + (int64_t)id * block_bytes;
}

/* Whether any of table[0..n) names a host block (a kernel given no host pool refuses such a table). */
static inline int names_host_block(const int32_t *table, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (table[i] & HOST_BLOCK) return 1;
    return 0;
}
#endif
