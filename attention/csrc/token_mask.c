/* The sampler's token mask: set to -inf every logit whose bit is clear in its row's bitmask
 * (structured output, allowed_token_ids, bad_words; engine/sampler.py `apply_token_mask`).
 *
 * Bit t of 32-bit word w of a mask row is token 32 w + t (xgrammar's layout). A mask row is
 * mostly all-ones inside a JSON string and mostly all-zeros between JSON tokens, so each word is
 * tested whole first: an all-ones word costs one compare, an all-zeros word writes 32 floats, a
 * mixed word is a per-lane select. torch's unpack-then-masked_fill read and wrote a [rows, vocab]
 * bool tensor besides the logits (~0.4 ms for 16 rows of 8k tokens, ~7-11 ms for 16 rows of 152k).
 */
#include <math.h>
#include <stdint.h>

/* logits: fp32 rows of `vocab` values, row stride `stride`; rows[r] is the logits row that mask
 * row r (bitmask + r * width) applies to; width * 32 >= vocab (checked by the caller). */
void apply_token_bitmask_f32(float *logits, int64_t stride, int64_t vocab, const int64_t *rows, int64_t nrows,
                             const uint32_t *bitmask, int64_t width) {
    const int64_t words = (vocab + 31) / 32;
    /* one thread: the pass is bound by writing -inf (16 rows x 152k all-banned: ~0.7 ms), and the
     * call runs between the forward and the sampler, where a parallel region costs more to wake */
    for (int64_t r = 0; r < nrows; r++) {
        float *x = logits + rows[r] * stride;
        const uint32_t *m = bitmask + r * width;
        for (int64_t w = 0; w < words; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int n = vocab - base < 32 ? (int)(vocab - base) : 32;
            if (bits == 0) {
                for (int t = 0; t < n; t++) x[base + t] = -INFINITY;
                continue;
            }
            /* a mixed word: a select per lane, which the compiler vectorises */
            float *xw = x + base;
            for (int t = 0; t < n; t++) xw[t] = (bits >> t) & 1u ? xw[t] : -INFINITY;
        }
    }
}
