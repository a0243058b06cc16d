/* A kernel graph's recorded calls (cuttle/attention/native/graph.py) replayed from C.
 *
 * Why: a replay from Python pays a ctypes call per kernel -- argument conversion, the libffi call,
 * result boxing -- ~0.7 us warm at 11 arguments, several times that on the caches a decode step's
 * weight stream has just emptied, for ~95 kernels a step. Here one call runs them all.
 *
 * How a call is made without knowing its C signature: every kernel argument is an integer class
 * value (a pointer, int64_t or int) or a float, and every kernel returns void, int or int64_t. On
 * the x86-64 System V and AArch64 (Linux) calling conventions, integer arguments fill the
 * integer argument registers in order and then 8-byte stack slots in order, while float
 * arguments fill the vector registers in order independently of them (a kernel has at most 8, so
 * none goes to the stack). A callee that takes some integers and some floats therefore reads
 * exactly what a call through `generic_fn` -- 8 integers, 8 doubles, 24 more integers -- passes
 * when the integers come in their order and the floats in theirs: the first 6 (x86-64) or 8
 * (AArch64) integers in registers, the rest in stack slots, unused trailing arguments ignored (the
 * caller pops them). An int argument is read from the low 32 bits of its register or slot; a float
 * from the low 32 bits of its vector register, so each float is passed as a double whose low 32
 * bits are the float's. An int result is the low 32 bits of the return register. Built for x86-64
 * Linux only, where it is tested; AArch64 Linux follows the same rules (x0-x7, v0-v7, 8-byte stack
 * slots) but stays on the Python loop until it runs on such a machine. Any other platform, or a
 * signature outside these limits, is refused by graph.py, which then replays from Python. */
#include <stdint.h>

#define REPLAY_INTS 32 /* 8 in the generic prototype's registers + 24 stack slots */
#define REPLAY_FLOATS 8

typedef struct {
    void *fn;
    int32_t ret;    /* 0: void (not checked), 1: int, 2: int64_t */
    int32_t pad;
    int64_t expect; /* the result at capture */
    int64_t ints[REPLAY_INTS];
    uint64_t floats[REPLAY_FLOATS]; /* the float's bits in the low 32 */
} replay_call;

#if defined(__x86_64__) && defined(__linux__)
typedef int64_t (*generic_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double,
                              double, double, double, double, double, double, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

static inline double bits_double(uint64_t u) {
    union {
        uint64_t u;
        double d;
    } v = {.u = u};
    return v.d;
}

int graph_replay_available(void) { return 1; }

/* Runs calls[start .. n) in order; returns the index of the first call whose result differs from
 * its capture's (that result in *got; the later calls are not run), or n. */
int64_t graph_replay(const replay_call *calls, int64_t start, int64_t n, int64_t *got) {
    for (int64_t i = start; i < n; i++) {
        const replay_call *c = calls + i;
        const int64_t *a = c->ints;
        const uint64_t *f = c->floats;
        int64_t r = ((generic_fn)c->fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], bits_double(f[0]),
                                        bits_double(f[1]), bits_double(f[2]), bits_double(f[3]), bits_double(f[4]),
                                        bits_double(f[5]), bits_double(f[6]), bits_double(f[7]), a[8], a[9], a[10],
                                        a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21],
                                        a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30], a[31]);
        if (c->ret == 1) r = (int32_t)r;
        if (c->ret != 0 && r != c->expect) {
            *got = r;
            return i;
        }
    }
    return n;
}
#else
int graph_replay_available(void) { return 0; }

int64_t graph_replay(const replay_call *calls, int64_t start, int64_t n, int64_t *got) {
    (void)calls, (void)start, (void)got;
    return -1 - n; /* never called: graph.py checks graph_replay_available first */
}
#endif
