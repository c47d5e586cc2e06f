/* The fast path of collectives over shared memory: one rank's compiled plan run in C while
 * every message is one EAGER packet (shm.EAGER_BYTES, 512 KiB) and nothing unusual happens.
 *
 * It writes and reads exactly the packets the Python engine does (same rings, same 64-byte
 * headers), so the two interleave freely. Anything it does not expect at the head of a
 * ring (another tag or kind, another fingerprint or size), and any wait longer than its
 * budget (for a packet, or for room in a full ring), makes it stop and say how far it got;
 * the Python engine takes over from there and handles it with its full checks (mismatch,
 * protocol, liveness, timeouts, sleeping). So this file only ever does the common case, and
 * never waits unboundedly.
 *
 * run(plan, arrays, peers, links, kernel, tag, fp1, fp2, budget_s, yield, wake)
 *   plan    bytes of int64 (see ringlet/transport/fast.py: encode)
 *   arrays  tuple of the call's buffers, indexed by the plan's buffer numbers
 *   peers   tuple of the ShmPeer objects the plan talks to (their state says whether C may go)
 *   links   tuple of bytes, 9 int64 each (fast.pack_link): in_ctrl, in_data, in_cap,
 *           out_ctrl, out_data, out_cap, flag, counts - addresses but the capacities -
 *           and the peer's pid; counts: the peer's int64[4] of messages and bytes sent
 *           and received by C (Peer.fast_counts), added to here, not through 4 Python
 *           attributes a call
 *   kernel  index of the reduce kernel (-1: the plan has no reduction)
 *   wake    wake(peer) rings the doorbell of a peer seen asleep (before any wait here)
 * Returns None when it did nothing (a peer has traffic queued, parked or a receive posted,
 * or is dead; a reduction over a misaligned buffer), else (rounds done, receives done in
 * the next round as a bit mask or -1 if it has not started, seconds waited, index of the
 * peer waited on last or -1, seconds of the wait it gave up on, the next round's CMA sends
 * still waiting for their answer as ((send, message id), ...)).
 * Reductions here do not consult NumPy's floating-point error state (np.errstate).
 *
 * One kind of message past the EAGER limit runs here too: a plain buffer's message in a
 * round that both sends and receives (an exchange: all_gather, all_to_all), which the
 * Python engine would move by cross-memory attach (cma.py). The sender writes the RTS
 * that names its buffer (RTS_CMA, the message id its ShmPeer would have used), before its
 * local copies when they do not write the buffer; the receiver, when that RTS is at the
 * head of the ring (looked for between 512 KiB pieces of its own local copies too), reads
 * the message with process_vm_readv and answers CTS_DONE; the sender's send is done at
 * that answer. Anything else - a refused or short read, a distance the probe called slow,
 * another kind of RTS - stops C with the RTS still unread, and the Python engine takes it
 * from there. A send still waiting for its answer when C stops is handed over too (run()'s
 * sixth item), and the engine waits for it as for its own.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#ifdef __linux__
#include <sys/uio.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#define HEADER_SIZE 64
#define EAGER 1
#define RTS 2
#define CTS 3
#define PAD 5
#define RTS_CMA 3     /* RTS flag: the data sits at address aux in the sender's memory */
#define CTS_DONE 2    /* CTS flag: the receiver has it (protocol.py) */
#define MAX_LINKS 64
#define MAX_CALLER 2     /* a Lane's caller buffers: an all_gather's input and output */
#define MAX_RECVS 62 /* the mask is one int64 */

typedef struct {
    uint32_t kind, flags;
    int64_t tag, msgid, length, aux, fp1, fp2, zc;
} header_t;

typedef struct {
    uint64_t *in_ctrl, *out_ctrl; /* [0] head, [8] tail */
    char *in_data, *out_data;
    int64_t in_cap, out_cap;
    uint64_t *flag;   /* the peer's "asleep" word: poke its doorbell after writing */
    int64_t *counts;  /* Peer.fast_counts: messages sent, bytes sent, messages and bytes received */
    int64_t head, tail;     /* as published in the rings' control words (ShmPeer's too) */
    int poke;
    int pid;          /* the peer's process: a message of its private memory is read there */
} link_t;

/* -- reduce kernels: dst = op(acc, in), with NumPy's results ------------------------------ */
/* (setup.py builds with -O3: the loops vectorize, as NumPy's do, once messages reach tens of
 * KiB; elementwise, so the bits are the same.) */
typedef void (*kernel_fn)(char *dst, const char *acc, const char *in, int64_t n);

#define BIN(NAME, T, EXPR)                                                          \
    static void NAME(char *d_, const char *a_, const char *b_, int64_t n) {         \
        T *d = (T *)d_; const T *a = (const T *)a_, *b = (const T *)b_;             \
        for (int64_t i = 0; i < n; i++) { T x = a[i], y = b[i]; d[i] = (EXPR); }    \
    }
/* Integers wrap like NumPy's: do the arithmetic unsigned and wide (signed overflow is
 * undefined, and two uint16_t would multiply as signed ints). */
#define INTS(T, U)                                                                 \
    BIN(sum_##T, T, (T)(U)((uint64_t)(U)x + (uint64_t)(U)y))                       \
    BIN(prod_##T, T, (T)(U)((uint64_t)(U)x * (uint64_t)(U)y))                      \
    BIN(min_##T, T, x <= y ? x : y)                                                \
    BIN(max_##T, T, x >= y ? x : y)                                                \
    BIN(band_##T, T, x & y)                                                        \
    BIN(bor_##T, T, x | y)                                                         \
    BIN(bxor_##T, T, x ^ y)
/* np.minimum/np.maximum propagate NaN (the first operand's, when both are) and, like x86's
 * minps, give the second operand on a tie: min(-0.0, +0.0) is +0.0. */
#define FLOATS(T)                                                                  \
    BIN(sum_##T, T, x + y)                                                         \
    BIN(prod_##T, T, x * y)                                                        \
    BIN(min_##T, T, (x < y || isnan(x)) ? x : y)                                   \
    BIN(max_##T, T, (x > y || isnan(x)) ? x : y)

INTS(int8_t, uint8_t) INTS(uint8_t, uint8_t) INTS(int16_t, uint16_t) INTS(uint16_t, uint16_t)
INTS(int32_t, uint32_t) INTS(uint32_t, uint32_t) INTS(int64_t, uint64_t) INTS(uint64_t, uint64_t)
FLOATS(float) FLOATS(double)

/* 16-bit floats: each step in float32, rounded back to nearest-even - the bits of NumPy's
 * float16 loops and of torch's bfloat16 (ops.Bfloat16Reduce). NumPy adds float16 one element
 * at a time through function calls (0.35 GB/s here, against 30 for float32): a 1 MiB float16
 * all_reduce took 60x its float32 twin. min/max keep an operand's bits, as NumPy's do (its
 * float16 ones give the first operand on a tie). */
#define HALF_PAIR(EXPR_V, EXPR_S)                                                          \
    uint16_t *d = (uint16_t *)d_; const uint16_t *a = (const uint16_t *)a_,                 \
        *b = (const uint16_t *)b_;                                                          \
    int64_t i = 0;                                                                          \
    for (; i + 8 <= n; i += 8) {                                                            \
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));              \
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));              \
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(EXPR_V, _MM_FROUND_TO_NEAREST_INT)); \
    }                                                                                       \
    for (; i < n; i++) {                                                                    \
        float x = _cvtsh_ss(a[i]), y = _cvtsh_ss(b[i]);                                     \
        d[i] = _cvtss_sh(EXPR_S, _MM_FROUND_TO_NEAREST_INT);                                \
    }
#define HALF_PICK(COND)                                                                    \
    uint16_t *d = (uint16_t *)d_; const uint16_t *a = (const uint16_t *)a_,                 \
        *b = (const uint16_t *)b_;                                                          \
    for (int64_t i = 0; i < n; i++) {                                                       \
        float x = _cvtsh_ss(a[i]), y = _cvtsh_ss(b[i]);                                     \
        d[i] = (COND) ? a[i] : b[i];                                                        \
    }
#if defined(__x86_64__) && defined(__GNUC__)
#define F16C __attribute__((target("f16c,avx")))
F16C static void sum_half(char *d_, const char *a_, const char *b_, int64_t n) {
    HALF_PAIR(_mm256_add_ps(x, y), x + y) }
F16C static void prod_half(char *d_, const char *a_, const char *b_, int64_t n) {
    HALF_PAIR(_mm256_mul_ps(x, y), x * y) }
F16C static void min_half(char *d_, const char *a_, const char *b_, int64_t n) {
    HALF_PICK(x <= y || isnan(x)) }
F16C static void max_half(char *d_, const char *a_, const char *b_, int64_t n) {
    HALF_PICK(x >= y || isnan(x)) }
#endif

static inline float bf16_float(uint16_t w) {
    union { uint32_t u; float f; } c = {(uint32_t)w << 16};
    return c.f;
}
static inline uint16_t float_bf16(float f) {   /* nearest, ties to even; NaN -> 0xFFFF */
    union { float f; uint32_t u; } c = {f};
    return isnan(f) ? 0xFFFF : (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}
#define BF16(NAME, EXPR)                                                                   \
    static void NAME(char *d_, const char *a_, const char *b_, int64_t n) {                 \
        uint16_t *d = (uint16_t *)d_; const uint16_t *a = (const uint16_t *)a_,             \
            *b = (const uint16_t *)b_;                                                      \
        for (int64_t i = 0; i < n; i++) {                                                   \
            float x = bf16_float(a[i]), y = bf16_float(b[i]);                               \
            d[i] = float_bf16(EXPR);                                                        \
        }                                                                                   \
    }
/* (np.minimum in float32, then rounded: ties give the second operand, as FLOATS above) */
BF16(sum_bf16, x + y) BF16(prod_bf16, x * y)
BF16(min_bf16, (x < y || isnan(x)) ? x : y) BF16(max_bf16, (x > y || isnan(x)) ? x : y)
#if defined(__x86_64__) && defined(__GNUC__)
/* ... and sum, prod 8 at a time where the CPU has AVX2 (the loop above does not vectorize:
 * 4.5 GB/s here against 25 for these; a 1 MiB bfloat16 all_reduce took 6x float32's) */
#define BF16_AVX2(NAME, VOP, OP)                                                           \
    __attribute__((target("avx2"))) static void NAME(char *d_, const char *a_,              \
                                                     const char *b_, int64_t n) {           \
        uint16_t *d = (uint16_t *)d_; const uint16_t *a = (const uint16_t *)a_,             \
            *b = (const uint16_t *)b_;                                                      \
        const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF),         \
            nan16 = _mm256_set1_epi32(0xFFFF);                                              \
        int64_t i = 0;                                                                      \
        for (; i + 8 <= n; i += 8) {                                                        \
            __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(         \
                _mm_loadu_si128((const __m128i *)(a + i))), 16));                           \
            __m256 y = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(         \
                _mm_loadu_si128((const __m128i *)(b + i))), 16));                           \
            __m256 r = VOP(x, y);                                                           \
            __m256i u = _mm256_castps_si256(r);                                             \
            __m256i even = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);                  \
            __m256i w = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, even)), 16); \
            w = _mm256_blendv_epi8(w, nan16, _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q))); \
            _mm_storeu_si128((__m128i *)(d + i), _mm_packus_epi32(                          \
                _mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));                \
        }                                                                                   \
        for (; i < n; i++) d[i] = float_bf16(bf16_float(a[i]) OP bf16_float(b[i]));         \
    }
BF16_AVX2(sum_bf16_avx2, _mm256_add_ps, +) BF16_AVX2(prod_bf16_avx2, _mm256_mul_ps, *)
/* ... and 16 at a time with AVX-512, a cache line of each input (32) a turn with the next
 * lines prefetched: its sources lie in a ring another core has just written, and without
 * that its reduce ran at 5.5 GB/s there against 14 on warm arrays (8 MiB all_reduce p = 2:
 * 756 us a call in the kernel; 2048 bytes ahead measured best of 512-4096) */
#define BF16_AVX512_STEP(VOP, OFF) {                                                       \
            __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(         \
                _mm256_loadu_si256((const __m256i *)(a + i + OFF))), 16));                  \
            __m512 y = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(         \
                _mm256_loadu_si256((const __m256i *)(b + i + OFF))), 16));                  \
            __m512 r = VOP(x, y);                                                           \
            __m512i u = _mm512_castps_si512(r);                                             \
            __m512i even = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);                  \
            __m512i w = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, even)), 16); \
            w = _mm512_mask_mov_epi32(w, _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), nan16);    \
            _mm256_storeu_si256((__m256i *)(d + i + OFF), _mm512_cvtepi32_epi16(w)); }
#define BF16_AVX512(NAME, VOP, OP)                                                         \
    __attribute__((target("avx512f,avx512bw"))) static void NAME(char *d_, const char *a_,  \
                                                                 const char *b_, int64_t n) { \
        uint16_t *d = (uint16_t *)d_; const uint16_t *a = (const uint16_t *)a_,             \
            *b = (const uint16_t *)b_;                                                      \
        const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF),         \
            nan16 = _mm512_set1_epi32(0xFFFF);                                              \
        int64_t i = 0;                                                                      \
        for (; i + 32 <= n; i += 32) {                                                      \
            _mm_prefetch((const char *)(a + i) + 2048, _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(b + i) + 2048, _MM_HINT_T0);                        \
            BF16_AVX512_STEP(VOP, 0) BF16_AVX512_STEP(VOP, 16)                              \
        }                                                                                   \
        for (; i + 16 <= n; i += 16) BF16_AVX512_STEP(VOP, 0)                               \
        for (; i < n; i++) d[i] = float_bf16(bf16_float(a[i]) OP bf16_float(b[i]));         \
    }
BF16_AVX512(sum_bf16_avx512, _mm512_add_ps, +) BF16_AVX512(prod_bf16_avx512, _mm512_mul_ps, *)
#endif

/* Order: per dtype (see fast.py DTYPES), the ops sum, prod, min, max, band, bor, bxor. The
 * float16 row is filled at import where the CPU converts halves (F16C); else it stays empty
 * and NumPy reduces float16. */
#define INT_ROW(T) sum_##T, prod_##T, min_##T, max_##T, band_##T, bor_##T, bxor_##T
#define FLOAT_ROW(T) sum_##T, prod_##T, min_##T, max_##T, NULL, NULL, NULL
static kernel_fn KERNELS[] = {
    INT_ROW(int8_t), INT_ROW(uint8_t), INT_ROW(int16_t), INT_ROW(uint16_t),
    INT_ROW(int32_t), INT_ROW(uint32_t), INT_ROW(int64_t), INT_ROW(uint64_t),
    FLOAT_ROW(float), FLOAT_ROW(double),
    NULL, NULL, NULL, NULL, NULL, NULL, NULL,      /* float16: PyInit__fastpath */
    FLOAT_ROW(bf16),
};
#define N_KERNELS ((int)(sizeof KERNELS / sizeof KERNELS[0]))
#define HALF_ROW 10
#define BF16_ROW 11
static const int64_t KERNEL_ITEMSIZE[] = {1, 1, 2, 2, 4, 4, 8, 8, 4, 8, 2, 2};  /* per row */

/* -- copies ---------------------------------------------------------------------------------
 * glibc's memcpy moves 2 KiB to ~1 MiB with `rep movsb`, which on some x86 cores crawls when
 * the destination lies a few bytes past the source within a page (AMD EPYC here: 512 KiB at
 * 2.4 GB/s against 40 at distance 0, distances 1-15; 16-63 ~20% slow; bench/copy_distance.py).
 * Such distances are common: views of a flat buffer start at any element. A plain vector
 * loop runs them at full speed, so copy_bytes takes it there and memcpy everywhere else. */
#define NEAR_BYTES 64      /* (dst - src) mod 4096 in [1, NEAR_BYTES): the loop's distances */
#define LOOP_MIN 2048      /* below, glibc does not use rep movsb */
static int loop_on = 1;    /* copy_loop(False): memcpy at every distance (bench/copy_distance.py) */

#if defined(__x86_64__) && defined(__GNUC__)
static int has_avx2;   /* set at import */

__attribute__((target("avx2"))) static void loop_avx2(char *d, const char *s, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_storeu_si256((__m256i *)(d + i), a);
        _mm256_storeu_si256((__m256i *)(d + i + 32), b);
        _mm256_storeu_si256((__m256i *)(d + i + 64), c);
        _mm256_storeu_si256((__m256i *)(d + i + 96), e);
    }
    memcpy(d + i, s + i, n - i);   /* < 128 bytes: no rep movsb */
}

static void loop_sse2(char *d, const char *s, size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_storeu_si128((__m128i *)(d + i), a);
        _mm_storeu_si128((__m128i *)(d + i + 16), b);
        _mm_storeu_si128((__m128i *)(d + i + 32), c);
        _mm_storeu_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
}

static int near_ahead(const char *d, const char *s, size_t n) {
    uintptr_t k = ((uintptr_t)d - (uintptr_t)s) & 4095;
    return loop_on && n >= LOOP_MIN && k != 0 && k < NEAR_BYTES;
}

/* memcpy's contract: the ranges do not overlap. */
static void copy_bytes(char *d, const char *s, size_t n) {
    if (!near_ahead(d, s, n)) {
        memcpy(d, s, n);
        return;
    }
    if (has_avx2) loop_avx2(d, s, n);
    else loop_sse2(d, s, n);
}
#else
static void copy_bytes(char *d, const char *s, size_t n) { memcpy(d, s, n); }
#endif

/* memmove's contract: the ranges may overlap (then memmove, whose backward copy is safe). */
static void move_bytes(char *d, const char *s, size_t n) {
    if (d + n <= s || s + n <= d) copy_bytes(d, s, n);
    else memmove(d, s, n);
}

/* -- rings ---------------------------------------------------------------------------------- */
static inline int64_t round64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* Distances (destination - source) mod 4096 within 64 bytes of 0 at which the kernel's copy
 * is slow here (cma.py's probe): bit d for d < 64, bit 64 + d - 4032 for d >= 4032. Set by
 * cma_slow() before each run of a plan with CMA messages; a message at one goes to Python. */
static uint64_t cma_slow_bits[2];

static int slow_distance(uintptr_t dst, uintptr_t src) {
    uint64_t d = (uint64_t)(dst - src) % 4096;
    if (d < 64) return (int)(cma_slow_bits[0] >> d & 1);
    if (d >= 4096 - 64) return (int)(cma_slow_bits[1] >> (d - (4096 - 64)) & 1);
    return 0;
}

/* Where a packet of `need` bytes would go after `head`, skipping the ring's tail end like
 * ShmPeer._write; -1 if there is no room now. *pad is set to the bytes skipped. */
static int64_t room(int64_t head, int64_t tail, int64_t cap, int64_t need, int64_t *pad) {
    int64_t free_ = cap - (head - tail), pos = head % cap;
    *pad = 0;
    if (cap - pos < need) {
        if (free_ < (cap - pos) + need) return -1;
        *pad = cap - pos;
        return 0;
    }
    return free_ < need ? -1 : pos;
}

static void put_header(char *at, uint32_t kind, int64_t tag, int64_t length, int64_t fp1,
                       int64_t fp2) {
    header_t h = {kind, 0, tag, kind == EAGER ? -1 : 0, length, 0, fp1, fp2, 0};  /* as Python */
    memcpy(at, &h, sizeof h);
}

/* The store that published head or tail must be visible before the peer's "asleep" flag
 * is read (a store-load order x86-64 does not keep), or a peer falling asleep is missed. */
static int asleep(link_t *l) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    return __atomic_load_n(l->flag, __ATOMIC_RELAXED) != 0;
}

/* Write a packet of header only (an RTS, a CTS) - room checked before - and publish it. */
static void write_control(link_t *l, const header_t *h) {
    int64_t pad;
    int64_t tail = (int64_t)__atomic_load_n(&l->out_ctrl[8], __ATOMIC_ACQUIRE);
    int64_t pos = room(l->head, tail, l->out_cap, HEADER_SIZE, &pad);
    if (pad) {
        put_header(l->out_data + l->head % l->out_cap, PAD, 0, 0, 0, 0);
        l->head += pad;
    }
    memcpy(l->out_data + pos, h, sizeof *h);
    l->head += HEADER_SIZE;
    __atomic_store_n(&l->out_ctrl[0], (uint64_t)l->head, __ATOMIC_RELEASE);   /* publish */
    if (asleep(l)) l->poke = 1;
}

static void write_eager(link_t *l, const char *src, int64_t n, int64_t tag, int64_t fp1,
                        int64_t fp2) {
    int64_t need = HEADER_SIZE + round64(n), pad;
    int64_t tail = (int64_t)__atomic_load_n(&l->out_ctrl[8], __ATOMIC_ACQUIRE);
    int64_t pos = room(l->head, tail, l->out_cap, need, &pad);   /* checked before: fits */
    if (pad) {
        put_header(l->out_data + l->head % l->out_cap, PAD, 0, 0, 0, 0);
        l->head += pad;
    }
    if (n) copy_bytes(l->out_data + pos + HEADER_SIZE, src, (size_t)n);
    put_header(l->out_data + pos, EAGER, tag, n, fp1, fp2);
    l->head += need;
    __atomic_store_n(&l->out_ctrl[0], (uint64_t)l->head, __ATOMIC_RELEASE);   /* publish */
    if (asleep(l)) l->poke = 1;
    l->counts[0]++;
    l->counts[1] += n;
}

static void consumed(link_t *l, int64_t n) {
    l->tail += HEADER_SIZE + round64(n);
    __atomic_store_n(&l->in_ctrl[8], (uint64_t)l->tail, __ATOMIC_RELEASE);   /* hand back */
    if (asleep(l)) l->poke = 1;
    l->counts[2]++;
    l->counts[3] += n;
}

/* A header-only packet read: hand its room back. */
static void skip_control(link_t *l) {
    l->tail += HEADER_SIZE;
    __atomic_store_n(&l->in_ctrl[8], (uint64_t)l->tail, __ATOMIC_RELEASE);
    if (asleep(l)) l->poke = 1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* -- Python glue ---------------------------------------------------------------------------- */
static PyObject *S_outq, *S_unexpected, *S_posted, *S_dead;
static PyObject *S_next_msgid, *S_last_rts, *S_cma, *S_ok, *S_reads;

static int get_i64(PyObject *obj, PyObject *name, int64_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int set_i64(PyObject *obj, PyObject *name, int64_t value) {
    PyObject *o = PyLong_FromLongLong(value);
    if (!o) return -1;
    int rc = PyObject_SetAttr(obj, name, o);
    Py_DECREF(o);
    return rc;
}

/* True when the peer is alive, has nothing queued out, nothing parked in and no receive
 * posted: only then are its ring's next packets this call's, in order (a posted irecv of
 * the same tag must get its message first). */
static int idle(PyObject *peer) {
    PyObject *v;
    int busy;
    if (!(v = PyObject_GetAttr(peer, S_dead))) return -1;
    busy = v != Py_None;
    Py_DECREF(v);
    if (busy) return 0;
    if (!(v = PyObject_GetAttr(peer, S_outq))) return -1;
    busy = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (busy) return busy < 0 ? -1 : 0;
    if (!(v = PyObject_GetAttr(peer, S_unexpected))) return -1;
    busy = PyObject_IsTrue(v);
    Py_DECREF(v);
    if (busy) return busy < 0 ? -1 : 0;
    if (!(v = PyObject_GetAttr(peer, S_posted))) return -1;
    busy = PyObject_IsTrue(v);
    Py_DECREF(v);
    return busy < 0 ? -1 : !busy;
}

/* idle(), for a peer whose outq (a deque), unexpected and posted (dicts) - which a peer never
 * replaces - a Lane holds: their sizes read in place instead of 3 attributes (a quarter of
 * a small call's C). */
static int idle_held(PyObject *peer, PyObject *const *held) {
    PyObject *v = PyObject_GetAttr(peer, S_dead);
    if (!v) return -1;
    int dead = v != Py_None;
    Py_DECREF(v);
    return !dead && Py_SIZE(held[0]) == 0 && PyDict_GET_SIZE(held[1]) == 0 &&
           PyDict_GET_SIZE(held[2]) == 0;
}

typedef struct {
    const int64_t *p, *end;
} reader_t;

static int next(reader_t *r, int64_t *v) {
    if (r->p >= r->end) return -1;
    *v = *r->p++;
    return 0;
}

/* Ring the doorbell of every peer seen asleep since the last call (wake(peer) in Python:
 * it swallows the socket's errors; a missed wake-up costs a sleeper at most its nap). */
static void wake_sleepers(link_t *L, Py_ssize_t npeers, PyObject *peers, PyObject *wake) {
    for (Py_ssize_t i = 0; i < npeers; i++) {
        if (!L[i].poke) continue;
        L[i].poke = 0;
        PyObject *r = PyObject_CallOneArg(wake, PyTuple_GET_ITEM(peers, i));
        if (r) Py_DECREF(r);
        else PyErr_Clear();
    }
}

/* One turn of a wait that makes no progress (for a packet, or for room in a ring). Its first
 * turn rings the doorbells of peers seen asleep and checks signals; once it has lasted
 * longer than `budget` it gives up. Returns 0 to go on waiting, 1 when the budget is spent
 * (its length added to *waited and set as *stalled), -1 on a signal (an exception set).
 * *since is when the wait started (0: not started). */
static int stall(double *since, double budget, int yield, double *waited, double *stalled,
                 link_t *L, Py_ssize_t npeers, PyObject *peers, PyObject *wake) {
    double t = now();
    if (*since == 0.0) {
        *since = t;
        wake_sleepers(L, npeers, peers, wake);   /* before waiting on them */
        if (PyErr_CheckSignals() < 0) return -1;
    } else if (t - *since > budget) {
        *waited += t - *since;
        *stalled = t - *since;
        return 1;
    }
    /* Ranks outnumber cores: let the one we wait for run. (Else spin, without a "pause":
     * it only delays noticing the packet, the one thing a small call waits for.) */
    if (yield) sched_yield();
    return 0;
}

/* -- running a plan: the steps run() and a Lane share ----------------------------------------- */
typedef struct {
    Py_ssize_t nbufs, npeers;
    Py_buffer views[8];
    char *buf[8];
    link_t L[MAX_LINKS];
    /* how far it got (run()'s result) */
    int64_t done_rounds, mask, last;
    double waited, stalled;
    uint64_t pending;              /* the round's CMA sends still waiting for CTS_DONE */
    int64_t msgid[64];             /* ... and their message ids, by send (the first 64) */
} exec_t;

/* Take the rings of `peers` from where the Python engine left them: 1, or 0 when some peer
 * is busy or dead (then nothing may be done here), or -1 on an error (an exception set).
 * `held`: NULL, or a Lane's queues of each peer (idle_held). */
static int bind_links(exec_t *x, PyObject *peers, PyObject *links, PyObject *held) {
    for (Py_ssize_t i = 0; i < x->npeers; i++) {
        PyObject *peer = PyTuple_GET_ITEM(peers, i), *t = PyTuple_GET_ITEM(links, i);
        int ok = held ? idle_held(peer, &PyTuple_GET_ITEM(held, 3 * i)) : idle(peer);
        if (ok <= 0) return ok;
        /* (packed once per prepared call: 8 Python ints to convert cost ~800 instructions) */
        if (!PyBytes_Check(t) || PyBytes_GET_SIZE(t) != 9 * sizeof(int64_t)) {
            PyErr_SetString(PyExc_TypeError, "run(): bad link");
            return -1;
        }
        link_t *l = &x->L[i];
        memset(l, 0, sizeof *l);
        int64_t w[9];
        memcpy(w, PyBytes_AS_STRING(t), sizeof w);
        l->in_ctrl = (uint64_t *)(intptr_t)w[0];
        l->in_data = (char *)(intptr_t)w[1];
        l->in_cap = w[2];
        l->out_ctrl = (uint64_t *)(intptr_t)w[3];
        l->out_data = (char *)(intptr_t)w[4];
        l->out_cap = w[5];
        l->flag = (uint64_t *)(intptr_t)w[6];
        l->counts = (int64_t *)(intptr_t)w[7];
        l->pid = (int)w[8];
        /* (ours to write, so as we last published them: no attribute to read or set back,
         * 40% of a small call's C before) */
        l->head = (int64_t)__atomic_load_n(&l->out_ctrl[0], __ATOMIC_RELAXED);
        l->tail = (int64_t)__atomic_load_n(&l->in_ctrl[8], __ATOMIC_RELAXED);
    }
    return 1;
}

#define RAN 0
#define INTERRUPTED (-1)
#define MALFORMED (-2)

/* The state of the round exec_rounds is in, for sweep(). */
typedef struct {
    const int64_t *rcv, *snd;
    int64_t nrecv, nsend, itemsize, tag, fp1, fp2;
    kernel_fn reduce;
    int64_t mask;            /* receives done */
    int64_t answered;        /* CTS_DONE answers taken (progress) */
} round_t;

/* The next packet of link `q`, PADs skipped and CTS_DONE answers to this round's CMA sends
 * to q taken on the way: 1 (its header in *h, its place in *pos), 0 when nothing more has
 * arrived. */
static int next_packet(exec_t *x, round_t *r, int64_t q, header_t *h, int64_t *pos) {
    link_t *l = &x->L[q];
    for (;;) {
        int64_t head = (int64_t)__atomic_load_n(&l->in_ctrl[0], __ATOMIC_ACQUIRE);
        if (head <= l->tail) return 0;   /* (a head that went backwards: nothing new) */
        *pos = l->tail % l->in_cap;
        memcpy(h, l->in_data + *pos, sizeof *h);
        if (h->kind == PAD) {
            l->tail += l->in_cap - *pos;
            __atomic_store_n(&l->in_ctrl[8], (uint64_t)l->tail, __ATOMIC_RELEASE);
            continue;
        }
        if (h->kind == CTS && h->flags == CTS_DONE && x->pending) {
            int64_t k = 0;
            for (; k < r->nsend && k < 64; k++)
                if ((x->pending >> k & 1) && r->snd[5 * k] == q && x->msgid[k] == h->msgid) break;
            if (k < r->nsend && k < 64) {    /* our message is read: the send is done */
                skip_control(l);
                x->pending &= ~((uint64_t)1 << k);
                l->counts[0]++;
                l->counts[1] += r->snd[5 * k + 3];
                r->answered++;
                continue;
            }
        }
        return 1;
    }
}

/* Read the CMA message whose RTS `h` is at the head of link `q` into `dst` and answer it
 * CTS_DONE: 1 done, 0 not now (no room for the answer), -1 not here (reads off or refused,
 * a slow distance, an id out of order: the Python engine takes the RTS, still unread),
 * -2 on an error (an exception set). */
static int read_cma(exec_t *x, PyObject *peers, int64_t q, const header_t *h, char *dst) {
    link_t *l = &x->L[q];
    PyObject *peer = PyTuple_GET_ITEM(peers, q);
    PyObject *reader = PyObject_GetAttr(peer, S_cma);
    if (!reader) return -2;
    PyObject *ok = PyObject_GetAttr(reader, S_ok);
    int on = ok ? PyObject_IsTrue(ok) : -1;
    Py_XDECREF(ok);
    int64_t last_rts, reads;
    if (on < 0 || get_i64(peer, S_last_rts, &last_rts) < 0) {
        Py_DECREF(reader);
        return -2;
    }
    if (!on || h->msgid <= last_rts || slow_distance((uintptr_t)dst, (uintptr_t)h->aux)) {
        Py_DECREF(reader);
        return -1;
    }
    int64_t pad;
    int64_t tail = (int64_t)__atomic_load_n(&l->out_ctrl[8], __ATOMIC_ACQUIRE);
    if (room(l->head, tail, l->out_cap, HEADER_SIZE, &pad) < 0) {
        Py_DECREF(reader);
        return 0;
    }
#ifdef __linux__
    struct iovec here = {dst, (size_t)h->length},
                 there = {(void *)(intptr_t)h->aux, (size_t)h->length};
    ssize_t got = process_vm_readv(l->pid, &here, 1, &there, 1, 0);
#else
    ssize_t got = -1;
#endif
    if (got != h->length) {     /* (the engine reads it again: it turns reads off if refused) */
        Py_DECREF(reader);
        return -1;
    }
    int64_t msgid = h->msgid, n = h->length;
    skip_control(l);
    l->counts[2]++;
    l->counts[3] += n;
    header_t done = {CTS, CTS_DONE, 0, msgid, 0, 0, 0, 0, 0};     /* as _queue_cts writes it */
    write_control(l, &done);
    int bad = set_i64(peer, S_last_rts, msgid) < 0 || get_i64(reader, S_reads, &reads) < 0 ||
              set_i64(reader, S_reads, reads + 1) < 0;
    Py_DECREF(reader);
    return bad ? -2 : 1;
}

/* One look at every link the round waits on: take what has arrived of its receives (in
 * order per peer) and the answers to its CMA sends. 1 some progress, 0 none, -1 something
 * else is first on a link (the Python engine takes over), -2 an exception set. *last: the
 * peer waited on last. */
static int sweep(exec_t *x, round_t *r, PyObject *peers, int64_t *last) {
    char **buf = x->buf;
    int64_t before = r->answered;
    int progressed = 0;
    uint64_t behind = 0;   /* peers whose earlier receive is still waiting */
    for (int64_t k = 0; k < r->nrecv; k++) {
        const int64_t *t = r->rcv + 8 * k;
        if (r->mask >> k & 1) continue;
        /* a peer's messages of one tag match receives in order: a later receive from it
         * must not take what an earlier one is waiting for */
        if (behind >> t[0] & 1) continue;
        header_t h;
        int64_t pos;
        if (!next_packet(x, r, t[0], &h, &pos)) {
            behind |= (uint64_t)1 << t[0];
            *last = t[0];
            continue;
        }
        link_t *l = &x->L[t[0]];
        char *dst = buf[t[2]] + t[3];
        if (h.tag != r->tag || h.fp1 != r->fp1 || h.fp2 != r->fp2 || h.length != t[4])
            return -1;
        if (!t[7]) {
            if (h.kind != EAGER || pos + HEADER_SIZE + t[4] > l->in_cap) return -1;
            const char *payload = l->in_data + pos + HEADER_SIZE;
            if (t[1])
                r->reduce(dst, t[5] < 0 ? dst : buf[t[5]] + t[6], payload, t[4] / r->itemsize);
            else
                copy_bytes(dst, payload, (size_t)t[4]);
            consumed(l, t[4]);
        } else {
            if (h.kind != RTS || h.flags != RTS_CMA) return -1;
            int got = read_cma(x, peers, t[0], &h, dst);
            if (got < 0) return got;
            if (!got) {            /* no room for the answer yet */
                behind |= (uint64_t)1 << t[0];
                *last = t[0];
                continue;
            }
        }
        r->mask |= (int64_t)1 << k;
        progressed = 1;
    }
    for (int64_t k = 0; k < r->nsend && k < 64 && x->pending; k++) {  /* answers: the others */
        int64_t q = r->snd[5 * k];
        if (!(x->pending >> k & 1) || (behind >> q & 1)) continue;
        header_t h;
        int64_t pos;
        if (next_packet(x, r, q, &h, &pos)) return -1;   /* (no receive of ours is next) */
        if (x->pending >> k & 1) *last = q;
        behind |= (uint64_t)1 << q;
    }
    return progressed || r->answered != before;
}

/* Do byte ranges [a, a + n) and [b, b + m) meet? */
static int overlap(const char *a, Py_ssize_t n, const char *b, Py_ssize_t m) {
    return a < b + m && b < a + n;
}

/* Run the plan's rounds (rd just past its header) as far as they go: RAN (x says how far),
 * INTERRUPTED by a signal or an error (an exception set) or MALFORMED. */
static int exec_rounds(exec_t *x, reader_t *rd, int64_t nrounds, int64_t itemsize,
                       kernel_fn reduce, int64_t tag, int64_t fp1, int64_t fp2, double budget,
                       int yield, PyObject *peers, PyObject *wake) {
    link_t *L = x->L;
    Py_ssize_t nbufs = x->nbufs, npeers = x->npeers;
    Py_buffer *views = x->views;
    char **buf = x->buf;
    /* Buffer b holds bytes [off, off + n): the plan never reaches outside the call's arrays. */
#define INSIDE(b, off, n) \
    ((b) >= 0 && (b) < nbufs && (off) >= 0 && (n) >= 0 && (off) + (n) <= views[b].len)
    int64_t done_rounds = 0, mask = -1, last = -1;
    double waited = 0.0, stalled = 0.0;
    int rc = RAN;
    x->pending = 0;
    for (; done_rounds < nrounds; done_rounds++) {
        int64_t nlocal, nrecv, nsend;
        if (next(rd, &nlocal) < 0 || next(rd, &nrecv) < 0 || next(rd, &nsend) < 0 ||
            nlocal < 0 || nrecv < 0 || nsend < 0 || nrecv > MAX_RECVS ||
            rd->end - rd->p < 8 * nlocal + 8 * nrecv + 5 * nsend)
            goto bad_plan;
        const int64_t *loc = rd->p, *rcv = loc + 8 * nlocal, *snd = rcv + 8 * nrecv;
        rd->p = snd + 5 * nsend;
        int cma_recv = 0, cma_send = 0;
        /* A wait for a CMA message, or for the answer to one, lasts as long as the peer's
         * read of it: the budget grows by 1 ns a byte (1 GB/s, a slow read here), so C does
         * not hand the engine a call only because its message is large. */
        double slack = 0.0;
        for (int64_t k = 0; k < nrecv; k++) {     /* peer, reduce, db, do, nbytes, ab, ao, cma */
            const int64_t *r = rcv + 8 * k;
            if (r[0] < 0 || r[0] >= npeers || !INSIDE(r[2], r[3], r[4]) ||
                (r[5] >= 0 && !INSIDE(r[5], r[6], r[4])) || (r[1] && !reduce) ||
                (r[7] && r[1]))
                goto bad_plan;
            cma_recv |= r[7] != 0;
            if (r[7]) slack += 1e-9 * (double)r[4];
        }
        for (int64_t k = 0; k < nsend; k++) {     /* peer, sb, so, nbytes, cma */
            const int64_t *s = snd + 5 * k;
            if (s[0] < 0 || s[0] >= npeers || !INSIDE(s[1], s[2], s[3]) || (s[4] && k >= 64))
                goto bad_plan;
            cma_send |= s[4] != 0;
            if (s[4]) slack += 1e-9 * (double)s[3];
        }
        for (int64_t k = 0; k < nlocal; k++) {    /* reduce, sb, so, n, db, do, ab, ao */
            const int64_t *t = loc + 8 * k;
            if (!INSIDE(t[1], t[2], t[3]) || !INSIDE(t[4], t[5], t[3]) ||
                (t[6] >= 0 && !INSIDE(t[6], t[7], t[3])) || (t[0] && !reduce))
                goto bad_plan;
        }
        /* Every send of the round must fit before any is written: wait for the receivers
         * to make room, within the budget like any wait here, else the Python engine queues
         * the round. (A rank a round or two ahead of the peer it sends to, as at p = 3 on 2
         * cores with 341 KiB packets, would otherwise leave C at nearly every call.) */
        double since_room = 0.0;
        for (;;) {
            int64_t heads[MAX_LINKS], blocked = -1;
            for (Py_ssize_t i = 0; i < npeers; i++) heads[i] = L[i].head;
            for (int64_t k = 0; k < nsend && blocked < 0; k++) {
                const int64_t *s = snd + 5 * k;
                link_t *l = &L[s[0]];
                int64_t need = HEADER_SIZE + (s[4] ? 0 : round64(s[3])), pad;
                int64_t tail = (int64_t)__atomic_load_n(&l->out_ctrl[8], __ATOMIC_ACQUIRE);
                if (room(heads[s[0]], tail, l->out_cap, need, &pad) < 0) blocked = s[0];
                else heads[s[0]] += pad + need;
            }
            if (blocked < 0) break;
            last = blocked;
            if (since_room == 0.0 && asleep(&L[blocked])) L[blocked].poke = 1;
            int gave_up = stall(&since_room, budget, yield, &waited, &stalled, L, npeers,
                                peers, wake);
            if (gave_up) {
                if (gave_up < 0) rc = INTERRUPTED;
                goto stop;
            }
        }
        if (since_room != 0.0) waited += now() - since_room;
        /* A CMA send's RTS goes before the local copies when none of them writes what it
         * sends: the peer reads it while we copy (work._independent's rule). */
        int early = cma_send;
        for (int64_t k = 0; k < nsend && early; k++) {
            const int64_t *s = snd + 5 * k;
            for (int64_t j = 0; j < nlocal && early; j++) {
                const int64_t *t = loc + 8 * j;
                early = !overlap(buf[s[1]] + s[2], s[3], buf[t[4]] + t[5], t[3]);
            }
        }
        round_t r = {rcv, snd, nrecv, nsend, itemsize, tag, fp1, fp2, reduce, 0, 0};
        for (int pass = 0; pass < 2; pass++) {
            if (pass == (early ? 1 : 0)) {     /* the local steps */
                /* a CMA receive is taken between 512 KiB pieces of the local copies when no
                 * receive writes what they touch (work._local_polling), and the sends are
                 * out (its answer takes room in a ring that they were promised) */
                int polling = cma_recv && (early || !nsend);
                for (int64_t k = 0; k < nrecv && polling; k++) {
                    const int64_t *q = rcv + 8 * k;
                    for (int64_t j = 0; j < nlocal && polling; j++) {
                        const int64_t *t = loc + 8 * j;
                        polling = !overlap(buf[q[2]] + q[3], q[4], buf[t[4]] + t[5], t[3]) &&
                                  !overlap(buf[q[2]] + q[3], q[4], buf[t[1]] + t[2], t[3]);
                    }
                }
                for (int64_t k = 0; k < nlocal; k++) {
                    const int64_t *t = loc + 8 * k;
                    char *dst = buf[t[4]] + t[5];
                    const char *src = buf[t[1]] + t[2];
                    if (t[0]) {
                        reduce(dst, t[6] < 0 ? dst : buf[t[6]] + t[7], src, t[3] / itemsize);
                        continue;
                    }
                    int64_t step = polling ? (512 << 10) : t[3];
                    for (int64_t at = 0; at < t[3]; at += step) {
                        if (polling && r.mask != (((int64_t)1 << nrecv) - 1)) {
                            int got = sweep(x, &r, peers, &last);
                            if (got == -2) {
                                rc = INTERRUPTED;
                                goto stop;
                            }
                            polling = got >= 0;     /* (something else first: after the copies) */
                        }
                        int64_t piece = t[3] - at < step ? t[3] - at : step;
                        move_bytes(dst + at, src + at, (size_t)piece);
                    }
                }
            } else {                           /* the sends */
                for (int64_t k = 0; k < nsend; k++) {
                    const int64_t *s = snd + 5 * k;
                    if (!s[4]) {
                        write_eager(&L[s[0]], buf[s[1]] + s[2], s[3], tag, fp1, fp2);
                        continue;
                    }
                    /* the id its ShmPeer would have given it: large messages are numbered
                     * 0, 1, 2, ... per direction, whoever sends them */
                    PyObject *peer = PyTuple_GET_ITEM(peers, s[0]);
                    int64_t msgid;
                    if (get_i64(peer, S_next_msgid, &msgid) < 0 ||
                        set_i64(peer, S_next_msgid, msgid + 1) < 0) {
                        rc = INTERRUPTED;
                        goto stop;
                    }
                    header_t h = {RTS, RTS_CMA, tag, msgid, s[3],
                                  (int64_t)(intptr_t)(buf[s[1]] + s[2]), fp1, fp2, 1};
                    write_control(&L[s[0]], &h);
                    x->msgid[k] = msgid;
                    x->pending |= (uint64_t)1 << k;
                }
            }
        }
        mask = r.mask;
        int64_t want = nrecv ? (((int64_t)1 << nrecv) - 1) : 0;
        double since = 0.0;    /* when this wait started making no progress */
        while (r.mask != want || x->pending) {
            int got = sweep(x, &r, peers, &last);
            mask = r.mask;
            if (got == -2) {
                rc = INTERRUPTED;
                goto stop;
            }
            if (got < 0) goto stop;
            if (got) {             /* like the engine's spin, the budget is per idle stretch */
                if (since != 0.0) waited += now() - since;
                since = 0.0;
                continue;
            }
            int gave_up = stall(&since, budget + slack, yield, &waited, &stalled, L, npeers,
                                peers, wake);
            if (gave_up) {
                if (gave_up < 0) rc = INTERRUPTED;
                goto stop;
            }
        }
        if (since != 0.0) waited += now() - since;
        mask = -1;
    }
    goto stop;
#undef INSIDE
bad_plan:   /* (fast.encode writes only valid plans: this is a guard, not a path) */
    rc = MALFORMED;
stop:
    x->done_rounds = done_rounds;
    x->mask = mask;
    x->last = last;
    x->waited = waited;
    x->stalled = stalled;
    return rc;
}

/* After a run: ring the doorbells of peers seen asleep, keeping an exception already set
 * (the rings are where C published them, which is where the Python engine reads them). 0. */
static int settle(exec_t *x, PyObject *peers, PyObject *wake) {
    int pokes = 0;
    for (Py_ssize_t i = 0; i < x->npeers; i++) pokes |= x->L[i].poke;
    if (!pokes) return 0;
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);       /* (a KeyboardInterrupt, say) */
    wake_sleepers(x->L, x->npeers, peers, wake);
    PyErr_Restore(type, value, trace);
    return 0;
}

/* run()'s result: (rounds done, receives done in the next round as a bit mask or -1,
 * seconds waited, index of the peer waited on last or -1, seconds of the wait given up on,
 * the next round's CMA sends still waiting for their CTS_DONE: ((send, message id), ...)). */
static PyObject *how_far(const exec_t *x) {
    /* (a tuple filled by hand: Py_BuildValue parses its format string every call) */
    PyObject *res = PyTuple_New(6);
    if (!res) return NULL;
    int64_t n = 0;
    for (int k = 0; k < 64; k++) n += (int64_t)(x->pending >> k & 1);
    PyObject *pending = PyTuple_New((Py_ssize_t)n);   /* (n = 0: the empty tuple, shared) */
    if (pending) {
        Py_ssize_t i = 0;
        for (int k = 0; k < 64 && pending; k++) {
            if (!(x->pending >> k & 1)) continue;
            PyObject *pair = Py_BuildValue("(iL)", k, (long long)x->msgid[k]);
            if (!pair) {
                Py_CLEAR(pending);
                break;
            }
            PyTuple_SET_ITEM(pending, i++, pair);
        }
    }
    PyObject *items[6] = {PyLong_FromLongLong(x->done_rounds), PyLong_FromLongLong(x->mask),
                          PyFloat_FromDouble(x->waited), PyLong_FromLongLong(x->last),
                          PyFloat_FromDouble(x->stalled), pending};
    for (int i = 0; i < 6; i++) {
        if (!items[i]) {
            for (int j = 0; j < 6; j++) Py_XDECREF(items[j]);
            Py_DECREF(res);
            return NULL;
        }
    }
    for (int i = 0; i < 6; i++) PyTuple_SET_ITEM(res, i, items[i]);
    return res;
}

static int plan_header(PyObject *plan, reader_t *rd, int64_t *nrounds, int64_t *itemsize) {
    const int64_t *words = (const int64_t *)PyBytes_AS_STRING(plan);
    rd->p = words;
    rd->end = words + PyBytes_GET_SIZE(plan) / 8;
    if (next(rd, nrounds) < 0 || next(rd, itemsize) < 0 || *itemsize <= 0) {
        PyErr_SetString(PyExc_ValueError, "run(): malformed plan");
        return -1;
    }
    return 0;
}

static int kernel_of(int kernel, kernel_fn *reduce) {
    *reduce = NULL;
    if (kernel < 0) return 0;
    if (kernel >= N_KERNELS || !(*reduce = KERNELS[kernel])) {
        PyErr_SetString(PyExc_ValueError, "run(): no such kernel");
        return -1;
    }
    return 0;
}

static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "run() takes 11 arguments");
        return NULL;
    }
    PyObject *arrays = args[1], *peers = args[2], *links = args[3], *wake = args[10];
    if (!PyBytes_Check(args[0]) || !PyTuple_Check(arrays) || !PyTuple_Check(peers) ||
        !PyTuple_Check(links) || PyTuple_GET_SIZE(peers) != PyTuple_GET_SIZE(links) ||
        PyTuple_GET_SIZE(peers) > MAX_LINKS || PyTuple_GET_SIZE(arrays) > 8 ||
        !PyCallable_Check(wake)) {
        PyErr_SetString(PyExc_TypeError, "run(): bad arguments");
        return NULL;
    }
    int kernel = (int)PyLong_AsLong(args[4]);
    int64_t tag = PyLong_AsLongLong(args[5]), fp1 = PyLong_AsLongLong(args[6]),
            fp2 = PyLong_AsLongLong(args[7]);
    double budget = PyFloat_AsDouble(args[8]);
    int yield = PyObject_IsTrue(args[9]);
    if (PyErr_Occurred()) return NULL;
    kernel_fn reduce;
    reader_t rd;
    int64_t nrounds, itemsize;
    if (kernel_of(kernel, &reduce) < 0 || plan_header(args[0], &rd, &nrounds, &itemsize) < 0)
        return NULL;

    exec_t x;
    x.nbufs = PyTuple_GET_SIZE(arrays);
    x.npeers = PyTuple_GET_SIZE(peers);
    Py_ssize_t got = 0;
    for (; got < x.nbufs; got++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(arrays, got), &x.views[got], PyBUF_SIMPLE) < 0)
            goto release;
        x.buf[got] = x.views[got].buf;
        /* the typed kernels need whole elements where they are (plan offsets are) */
        if (reduce && (uintptr_t)x.buf[got] % (uintptr_t)itemsize) {
            got++;
            goto untouched;
        }
    }
    int bound = bind_links(&x, peers, links, NULL);
    if (bound < 0) goto release;
    if (!bound) goto untouched;
    int rc = exec_rounds(&x, &rd, nrounds, itemsize, reduce, tag, fp1, fp2, budget, yield,
                         peers, wake);
    for (Py_ssize_t i = 0; i < x.nbufs; i++) PyBuffer_Release(&x.views[i]);
    if (settle(&x, peers, wake) < 0 || rc == INTERRUPTED) return NULL;
    if (rc == MALFORMED) {
        PyErr_SetString(PyExc_ValueError, "run(): malformed plan");
        return NULL;
    }
    return how_far(&x);

untouched:   /* nothing was done: the Python engine runs the call */
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&x.views[i]);
    Py_RETURN_NONE;
release:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&x.views[i]);
    return NULL;
}

/* -- Lane: a blocking call C ran whole once, run again in one call from Python -------------- *
 * Lane(plan, peers, links, kernel, fp1, fp2, at, tmp_at, nbufs, nbytes, writes, pool,
 *      group, tag, tag_mod, algorithm, wake, ranks)
 * holds what the full path checked and prepared for a call (collectives._lane and
 * runtime._lane say when one is made and taken). lane.run(budget, yield, a, b) takes the
 * caller's buffers in the call's order (a broadcast's one, an all_gather's input and output,
 * a barrier's none; None for the rest - a fixed count: a call with *args cost a small call
 * 0.2-0.3 us more): buffer k is the plan's buffer `at[k]` of its `nbufs` (-1: the plan
 * does not use it, as a gather's output off the root; it is ignored) and must be
 * C-contiguous, `nbytes[k]` long, writable if `writes[k]`, aligned for the kernel, and
 * apart from every other buffer of the call that is written (an in-place all_gather's
 * input inside its output, which the full path copies or keeps, takes the full path),
 * takes a scratch array from `pool` if the plan has one (at `tmp_at`), the call's number
 * from `group` (its `seq`; the wire tag `tag` | seq % `tag_mod`; no group: the wire tag is
 * `tag`) and runs the plan. Returns
 *   None   nothing done (a buffer it does not take, no scratch free, a peer busy): the
 *          full path runs the call, with its checks and errors;
 *   True   done; a collective's counted in the lane (calls, seconds waited, the longest
 *          wait, the world rank waited on last (`ranks` of the peers), the call number:
 *          lane.take(); work.fold_lanes adds them to rl.stats);
 *   False  (no group) not begun;
 *   (seq, tag, how far: run()'s tuple, scratch or None) begun, to finish in Python.
 * Why in C: a Python call costs ~180 ns here. Repeated 8 B all_reduces at p = 2, in one job:
 * 5.9 us a call through the lane when it was Python, 2.4 us calling run() alone; through
 * this one 3.2 (bench/small_budget.py splits a call). */
typedef struct {
    PyObject_HEAD
    PyObject *plan, *peers, *links, *pool, *group, *algorithm, *wake;
    PyObject *held;    /* each peer's outq, unexpected, posted (idle_held), or NULL */
    int kernel, nat, tmp_at, nbufs;
    int at[MAX_CALLER], writes[MAX_CALLER];
    int64_t nbytes[MAX_CALLER], fp1, fp2, tag, tag_mod;
    int64_t ranks[MAX_LINKS];
    int64_t calls, last_rank, stamp;     /* since lane.take() */
    double wait_s, max_wait_s;
} Lane;

static PyObject *S_seq;
static int64_t unfolded;   /* calls the lanes ran and have not been taken yet */
static int64_t ticks;      /* calls the lanes ran, ever: each lane's stamp orders its last */

static int lane_traverse(Lane *self, visitproc visit, void *arg) {
    Py_VISIT(self->plan);
    Py_VISIT(self->peers);
    Py_VISIT(self->links);
    Py_VISIT(self->pool);
    Py_VISIT(self->group);
    Py_VISIT(self->algorithm);
    Py_VISIT(self->wake);
    Py_VISIT(self->held);
    return 0;
}

static int lane_clear(Lane *self) {
    Py_CLEAR(self->plan);
    Py_CLEAR(self->peers);
    Py_CLEAR(self->links);
    Py_CLEAR(self->pool);
    Py_CLEAR(self->group);
    Py_CLEAR(self->algorithm);
    Py_CLEAR(self->wake);
    Py_CLEAR(self->held);
    return 0;
}

static void lane_dealloc(Lane *self) {
    unfolded -= self->calls;      /* (a lane dropped with its engine, its counts untaken) */
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* self->held: each peer's outq, unexpected and posted, when they are a deque and two dicts
 * (else NULL: bind_links asks idle()). 0, or -1 on an error. */
static int hold_queues(Lane *self, PyObject *peers) {
    static PyObject *const *names[3] = {&S_outq, &S_unexpected, &S_posted};
    Py_ssize_t n = PyTuple_GET_SIZE(peers);
    PyObject *held = PyTuple_New(3 * n);
    if (!held) return -1;
    int all = 1;
    for (Py_ssize_t i = 0; i < n && all; i++) {
        for (int k = 0; k < 3; k++) {
            PyObject *q = PyObject_GetAttr(PyTuple_GET_ITEM(peers, i), *names[k]);
            if (!q) {
                Py_DECREF(held);
                return -1;
            }
            PyTuple_SET_ITEM(held, 3 * i + k, q);
            all &= k ? PyDict_CheckExact(q) : strcmp(Py_TYPE(q)->tp_name, "collections.deque") == 0;
        }
    }
    if (all) self->held = held;
    else Py_DECREF(held);
    return 0;
}

/* Fill `out` (n entries) from a tuple of n ints; -1 and an exception when it is not one. */
static int int_tuple(PyObject *t, Py_ssize_t n, int64_t *out) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != n) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, i));
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static PyObject *lane_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"plan", "peers", "links", "kernel", "fp1", "fp2", "at", "tmp_at",
                            "nbufs", "nbytes", "writes", "pool", "group", "tag", "tag_mod",
                            "algorithm", "wake", "ranks", NULL};
    PyObject *plan, *peers, *links, *pool, *group, *algorithm, *wake, *ranks, *at, *nbytes,
             *writes;
    int kernel, tmp_at, nbufs;
    long long fp1, fp2, tag, tag_mod;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!iLLO!iiO!O!OOLLOOO!", names,
                                     &PyBytes_Type, &plan, &PyTuple_Type, &peers,
                                     &PyTuple_Type, &links, &kernel, &fp1, &fp2, &PyTuple_Type,
                                     &at, &tmp_at, &nbufs, &PyTuple_Type, &nbytes, &PyTuple_Type,
                                     &writes, &pool, &group, &tag, &tag_mod, &algorithm, &wake,
                                     &PyTuple_Type, &ranks))
        return NULL;
    Py_ssize_t npeers = PyTuple_GET_SIZE(peers), nat = PyTuple_GET_SIZE(at);
    int64_t at_[MAX_CALLER], nbytes_[MAX_CALLER], writes_[MAX_CALLER], ranks_[MAX_LINKS];
    kernel_fn reduce;
    if (kernel_of(kernel, &reduce) < 0) return NULL;
    int bad = nat > MAX_CALLER || npeers != PyTuple_GET_SIZE(links) || npeers > MAX_LINKS ||
              int_tuple(at, nat, at_) < 0 || int_tuple(nbytes, nat, nbytes_) < 0 ||
              int_tuple(writes, nat, writes_) < 0 || int_tuple(ranks, npeers, ranks_) < 0;
    if (PyErr_Occurred()) return NULL;
    /* the plan's buffers: each caller's it uses, and tmp, once each */
    int used = tmp_at >= 0;
    for (Py_ssize_t k = 0; k < nat && !bad; k++) {
        bad |= at_[k] >= nbufs || nbytes_[k] < 0 || (at_[k] >= 0 && at_[k] == tmp_at);
        for (Py_ssize_t j = 0; j < k; j++) bad |= at_[k] >= 0 && at_[k] == at_[j];
        used += at_[k] >= 0;
    }
    if (bad || nbufs < 0 || nbufs > 8 || tmp_at >= nbufs || nbufs != used ||
        (tmp_at >= 0 && !PyList_Check(pool)) || (group != Py_None && tag_mod <= 0) ||
        !PyCallable_Check(wake)) {
        PyErr_SetString(PyExc_ValueError, "Lane(): bad arguments");
        return NULL;
    }
    Lane *self = (Lane *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    for (Py_ssize_t i = 0; i < npeers; i++) self->ranks[i] = ranks_[i];
    for (Py_ssize_t k = 0; k < nat; k++) {
        self->at[k] = (int)at_[k];
        self->nbytes[k] = nbytes_[k];
        self->writes[k] = writes_[k] != 0;
    }
    self->nat = (int)nat;
    Py_INCREF(plan); self->plan = plan;
    Py_INCREF(peers); self->peers = peers;
    Py_INCREF(links); self->links = links;
    Py_INCREF(pool); self->pool = pool;
    Py_INCREF(group); self->group = group;
    Py_INCREF(algorithm); self->algorithm = algorithm;
    Py_INCREF(wake); self->wake = wake;
    self->kernel = kernel;
    self->tmp_at = tmp_at;
    self->nbufs = nbufs;
    self->fp1 = fp1;
    self->fp2 = fp2;
    self->tag = tag;
    self->tag_mod = tag_mod;
    self->last_rank = -1;
    if (hold_queues(self, peers) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* A scratch array from the pool (a new reference), or NULL when none is free. */
static PyObject *pop_scratch(PyObject *pool) {
    Py_ssize_t n = PyList_GET_SIZE(pool);
    if (n == 0) return NULL;
    PyObject *tmp = PyList_GET_ITEM(pool, n - 1);
    Py_INCREF(tmp);
    if (PyList_SetSlice(pool, n - 1, n, NULL) < 0) {
        Py_DECREF(tmp);
        PyErr_Clear();
        return NULL;
    }
    return tmp;
}

/* Release the first `got` caller buffers a Lane bound (those the plan uses). */
static void release_caller(Lane *self, exec_t *x, int got) {
    for (int k = 0; k < got; k++)
        if (self->at[k] >= 0) PyBuffer_Release(&x->views[self->at[k]]);
}


static PyObject *lane_run(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 + MAX_CALLER) {
        PyErr_SetString(PyExc_TypeError, "Lane.run(budget, yield, a, b)");
        return NULL;
    }
    double budget = PyFloat_AsDouble(args[0]);
    int yield = PyObject_IsTrue(args[1]);
    if (PyErr_Occurred()) return NULL;
    kernel_fn reduce;
    reader_t rd;
    int64_t nrounds, itemsize;
    if (kernel_of(self->kernel, &reduce) < 0 ||
        plan_header(self->plan, &rd, &nrounds, &itemsize) < 0)
        return NULL;
    exec_t x;
    x.nbufs = self->nbufs;
    x.npeers = PyTuple_GET_SIZE(self->peers);
    int got = 0;      /* caller buffers bound */
    for (; got < self->nat; got++) {
        int b = self->at[got];
        if (b < 0) continue;          /* (not the plan's: ignored) */
        Py_buffer *v = &x.views[b];
        /* (PyBUF_SIMPLE: a NumPy array that is not C-contiguous refuses it) */
        if (PyObject_GetBuffer(args[2 + got], v, self->writes[got] ? PyBUF_WRITABLE
                                                                   : PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            goto declined;
        }
        x.buf[b] = v->buf;
        int clash = v->len != self->nbytes[got] ||
                    (reduce && (uintptr_t)v->buf % (uintptr_t)itemsize);
        for (int j = 0; j < got && !clash; j++) {
            int c = self->at[j];
            clash = c >= 0 && (self->writes[got] || self->writes[j]) &&
                    overlap(v->buf, v->len, x.views[c].buf, x.views[c].len);
        }
        if (clash) {
            got++;
            goto declined;
        }
    }
    PyObject *tmp = NULL;
    if (self->tmp_at >= 0) {
        Py_buffer *t = &x.views[self->tmp_at];
        if (!(tmp = pop_scratch(self->pool))) goto declined;
        if (PyObject_GetBuffer(tmp, t, PyBUF_WRITABLE) < 0) {
            release_caller(self, &x, got);
            Py_DECREF(tmp);
            return NULL;
        }
        x.buf[self->tmp_at] = t->buf;
    }
    int bound = bind_links(&x, self->peers, self->links, self->held);
    if (bound <= 0) {
        for (int i = 0; i < x.nbufs; i++) PyBuffer_Release(&x.views[i]);
        if (tmp) {
            if (PyList_Append(self->pool, tmp) < 0) bound = -1;
            Py_DECREF(tmp);
        }
        if (bound < 0) return NULL;
        Py_RETURN_NONE;
    }
    int64_t seq = 0, tag = self->tag;
    if (self->group != Py_None) {
        if (get_i64(self->group, S_seq, &seq) < 0 || set_i64(self->group, S_seq, seq + 1) < 0) {
            for (int i = 0; i < x.nbufs; i++) PyBuffer_Release(&x.views[i]);
            Py_XDECREF(tmp);
            return NULL;
        }
        seq += 1;
        tag |= seq % self->tag_mod;
    }
    int rc = exec_rounds(&x, &rd, nrounds, itemsize, reduce, tag, self->fp1, self->fp2,
                         budget, yield, self->peers, self->wake);
    for (int i = 0; i < x.nbufs; i++) PyBuffer_Release(&x.views[i]);
    if (settle(&x, self->peers, self->wake) < 0 || rc != RAN) {
        if (rc == MALFORMED && !PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "run(): malformed plan");
        Py_XDECREF(tmp);
        return NULL;
    }
    if (x.done_rounds == nrounds) {
        if (tmp) {
            int bad = PyList_Append(self->pool, tmp);
            Py_DECREF(tmp);
            if (bad < 0) return NULL;
        }
        if (self->group != Py_None) {    /* (a send or receive is counted by the peer) */
            self->calls++;
            unfolded++;
            self->wait_s += x.waited;
            if (x.waited >= self->max_wait_s) self->max_wait_s = x.waited;
            if (x.last >= 0) self->last_rank = self->ranks[x.last];
            self->stamp = ++ticks;     /* (not seq: every group numbers its own calls) */
        }
        Py_RETURN_TRUE;
    }
    if (self->group == Py_None) {    /* a send or receive stops before it moves a byte */
        Py_XDECREF(tmp);
        Py_RETURN_FALSE;
    }
    PyObject *ran = how_far(&x);
    if (!ran) {
        Py_XDECREF(tmp);
        return NULL;
    }
    PyObject *res = Py_BuildValue("(LLNN)", (long long)seq, (long long)tag, ran,
                                  tmp ? tmp : Py_NewRef(Py_None));
    return res;
declined:     /* a buffer it does not take, or no scratch free: nothing done */
    release_caller(self, &x, got);
    Py_RETURN_NONE;
}

/* lane.take(): (calls, seconds waited, the longest wait, world rank waited on last or None,
 * when its last call ran: a count over every lane's calls) since the last take, and start
 * counting again. */
static PyObject *lane_take(Lane *self, PyObject *unused) {
    (void)unused;
    PyObject *last = self->last_rank >= 0 ? PyLong_FromLongLong(self->last_rank)
                                          : Py_NewRef(Py_None);
    if (!last) return NULL;
    PyObject *res = Py_BuildValue("(LddNL)", (long long)self->calls, self->wait_s,
                                  self->max_wait_s, last, (long long)self->stamp);
    if (res) {
        unfolded -= self->calls;
        self->calls = 0;
        self->wait_s = self->max_wait_s = 0.0;
        self->last_rank = -1;
    }
    return res;
}

/* unfolded(): how many calls all lanes ran that lane.take() has not yet taken. */
static PyObject *lanes_unfolded(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLongLong(unfolded);
}

static PyMethodDef LANE_METHODS[] = {
    {"run", (PyCFunction)(void (*)(void))lane_run, METH_FASTCALL,
     "run(budget, yield, a, b): the call again on buffers a, b; see the type's comment."},
    {"take", (PyCFunction)lane_take, METH_NOARGS,
     "(calls, seconds waited, longest wait, rank waited on last, last call number) since last taken."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef LANE_MEMBERS[] = {
    {"algorithm", T_OBJECT, offsetof(Lane, algorithm), READONLY, "the algorithm it runs"},
    {"calls", T_LONGLONG, offsetof(Lane, calls), READONLY, "calls run since last taken"},
    {"group", T_OBJECT, offsetof(Lane, group), READONLY, "the group it numbers, or None"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringlet.transport._fastpath.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A blocking call C ran whole once, to run again in one call; see the source.",
    .tp_new = lane_new,
    .tp_dealloc = (destructor)lane_dealloc,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_methods = LANE_METHODS,
    .tp_members = LANE_MEMBERS,
};

/* split_copy(dst, src, nbytes, chunk, ctrl, front, msg, kernel): one side of a message copied
 * (or reduced) by its receiver and its sender at once (transport/split.py). ctrl points at
 * two uint64 in shared memory: [0] the chunks not yet claimed, msg << 48 | (next from the
 * front) << 24 | (one past the last from the back), msg being the message's id mod 2^16;
 * [1] chunks done. Each side claims a chunk with a CAS - the receiver from the front, the
 * sender from the back - copies it (kernel -1) or reduces it into dst (dst = op(dst, src),
 * KERNELS[kernel]; chunk a multiple of the element size, both addresses aligned to it),
 * and counts it done (a release: the bytes are visible before the count), until none is
 * left or the word names another message (this side came too late). dst, src are
 * addresses (the message's first byte in each). Returns the chunks this side did. The GIL
 * is released: nothing here touches a Python object. */
static PyObject *split_copy(PyObject *self, PyObject *args) {
    unsigned long long dst, src, ctrl;
    long long nbytes, chunk, msg;
    int front, kernel;
    if (!PyArg_ParseTuple(args, "KKLLKpLi", &dst, &src, &nbytes, &chunk, &ctrl, &front, &msg,
                          &kernel))
        return NULL;
    kernel_fn reduce = NULL;
    int64_t itemsize = 1;
    if (kernel >= 0) {
        if (kernel >= N_KERNELS || !(reduce = KERNELS[kernel])) {
            PyErr_SetString(PyExc_ValueError, "split_copy: no such kernel");
            return NULL;
        }
        itemsize = KERNEL_ITEMSIZE[kernel / 7];
    }
    if (nbytes < 0 || chunk <= 0 || chunk % itemsize || nbytes % itemsize || !ctrl ||
        (reduce && (dst % itemsize || src % itemsize))) {
        PyErr_SetString(PyExc_ValueError, "split_copy: bad size, alignment or control word");
        return NULL;
    }
    uint64_t *claim = (uint64_t *)(uintptr_t)ctrl, *done = claim + 1;
    long long mine = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        uint64_t w = __atomic_load_n(claim, __ATOMIC_ACQUIRE), next;
        uint64_t id = w >> 48, lo = (w >> 24) & 0xFFFFFFu, hi = w & 0xFFFFFFu, k;
        if (id != ((uint64_t)msg & 0xFFFFu) || lo >= hi) break;
        if (front) { k = lo; next = id << 48 | (lo + 1) << 24 | hi; }
        else { k = hi - 1; next = id << 48 | lo << 24 | (hi - 1); }
        if (!__atomic_compare_exchange_n(claim, &w, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        long long at = (long long)k * chunk;
        long long n = nbytes - at < chunk ? nbytes - at : chunk;
        char *d = (char *)(uintptr_t)dst + at;
        const char *s = (const char *)(uintptr_t)src + at;
        if (reduce) reduce(d, d, s, n / itemsize);
        else copy_bytes(d, s, (size_t)n);
        __atomic_fetch_add(done, 1, __ATOMIC_RELEASE);
        mine++;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(mine);
}

/* address(obj): the address of the first byte of a buffer (a NumPy array, any strides) -
 * arr.ctypes.data without the ctypes object (2-3 us a call; several per large message). */
static PyObject *address(PyObject *self, PyObject *obj) {
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_STRIDES) < 0) return NULL;
    PyObject *res = PyLong_FromVoidPtr(v.buf);
    PyBuffer_Release(&v);
    return res;
}

/* cma(write, pid, local, remote, nbytes): process_vm_writev (write) or process_vm_readv of
 * nbytes between our address local and pid's address remote, the GIL released: the bytes
 * moved, or -errno (transport/cma.py; ctypes' call cost 3-5 us). */
static PyObject *cma(PyObject *self, PyObject *args) {
    int write, pid;
    unsigned long long local, remote;
    long long n;
    if (!PyArg_ParseTuple(args, "piKKL", &write, &pid, &local, &remote, &n)) return NULL;
#ifdef __linux__
    struct iovec l = {(void *)(uintptr_t)local, (size_t)n}, r = {(void *)(uintptr_t)remote, (size_t)n};
    ssize_t got;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    got = write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got < 0) err = errno;
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(got < 0 ? -(long long)err : (long long)got);
#else
    return PyLong_FromLongLong(-38);   /* ENOSYS */
#endif
}

/* copy(dst, src): dst[:] = src for two C-contiguous buffers of one size, by copy_bytes (or
 * memmove where they overlap) - the Python engine's large copies (transport/copies.py).
 * Object arrays are refused (their bytes are references). The GIL is released for large
 * ones. */
static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src)");
        return NULL;
    }
    Py_buffer d, s;
    if (PyObject_GetBuffer(args[0], &d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &s, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    if ((d.format && strchr(d.format, 'O')) || (s.format && strchr(s.format, 'O'))) {
        PyErr_SetString(PyExc_TypeError, "copy: object references are not bytes to copy");
    } else if (d.len != s.len) {
        PyErr_Format(PyExc_ValueError, "copy: %zd bytes into %zd", s.len, d.len);
    } else if (d.len >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        move_bytes(d.buf, s.buf, (size_t)d.len);
        Py_END_ALLOW_THREADS
    } else {
        move_bytes(d.buf, s.buf, (size_t)d.len);
    }
    int bad = PyErr_Occurred() != NULL;
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

/* cma_slow(low, high): the distances where the kernel copies slowly (slow_distance's bits;
 * transport/fast.py sets them from cma.py's probe before a plan with CMA messages runs). */
static PyObject *cma_slow(PyObject *self, PyObject *args) {
    unsigned long long lo, hi;
    if (!PyArg_ParseTuple(args, "KK", &lo, &hi)) return NULL;
    cma_slow_bits[0] = lo;
    cma_slow_bits[1] = hi;
    Py_RETURN_NONE;
}

/* copy_loop(on): whether copies take the vector loop at slow distances (the default) or
 * memcpy everywhere, as before it - for A/B measurements in one job. Returns the old setting. */
static PyObject *copy_loop(PyObject *self, PyObject *on) {
    int v = PyObject_IsTrue(on);
    if (v < 0) return NULL;
    int old = loop_on;
    loop_on = v;
    return PyBool_FromLong(old);
}

/* reduce(kernel, dst, acc, src): dst = op(acc, src) by KERNELS[kernel], for the Python
 * engine's reductions of a dtype NumPy reduces slowly (fast.CReduce). Buffers contiguous, of
 * one size, a whole number of elements; the GIL is released past 64 KiB. */
static PyObject *reduce_buffers(PyObject *self, PyObject *args) {
    (void)self;
    int kernel;
    Py_buffer d, a, b;
    if (!PyArg_ParseTuple(args, "iw*y*y*", &kernel, &d, &a, &b)) return NULL;
    PyObject *res = NULL;
    kernel_fn reduce = kernel >= 0 && kernel < N_KERNELS ? KERNELS[kernel] : NULL;
    int64_t itemsize = reduce ? KERNEL_ITEMSIZE[kernel / 7] : 1;
    if (!reduce)
        PyErr_SetString(PyExc_ValueError, "reduce: no such kernel");
    else if (d.len != a.len || d.len != b.len || d.len % itemsize)
        PyErr_SetString(PyExc_ValueError, "reduce: buffers of different sizes");
    else {
        int64_t n = d.len / itemsize;
        if (d.len > 65536) {
            Py_BEGIN_ALLOW_THREADS
            reduce(d.buf, a.buf, b.buf, n);
            Py_END_ALLOW_THREADS
        } else {
            reduce(d.buf, a.buf, b.buf, n);
        }
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return res;
}

/* kernels(): which kernels this CPU has, one byte per index (1: there). */
static PyObject *kernels(PyObject *self, PyObject *noargs) {
    (void)self; (void)noargs;
    char have[N_KERNELS];
    for (int k = 0; k < N_KERNELS; k++) have[k] = KERNELS[k] != NULL;
    return PyBytes_FromStringAndSize(have, N_KERNELS);
}

static PyMethodDef METHODS[] = {
    {"reduce", reduce_buffers, METH_VARARGS, "dst = op(acc, src) by a kernel; see its comment."},
    {"kernels", kernels, METH_NOARGS, "Which reduce kernels this CPU has (a byte each)."},
    {"address", address, METH_O, "The address of a buffer's first byte."},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "dst[:] = src for contiguous buffers of one size, at full speed at every distance."},
    {"copy_loop", copy_loop, METH_O, "Take the vector loop at slow distances (True) or not."},
    {"cma", cma, METH_VARARGS, "process_vm_readv/writev of one range; see the function's comment."},
    {"cma_slow", cma_slow, METH_VARARGS, "Set the distances where CMA reads are slow (bits)."},
    {"unfolded", lanes_unfolded, METH_NOARGS, "Calls the lanes ran, not yet taken."},
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "Run a compiled all-eager shared-memory plan; see the module source."},
    {"split_copy", split_copy, METH_VARARGS,
     "Copy one side's share of a message both ends copy; see the function's comment."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__fastpath(void) {
#define INTERN(v, s) if (!(v = PyUnicode_InternFromString(s))) return NULL
    INTERN(S_outq, "outq");
    INTERN(S_unexpected, "unexpected");
    INTERN(S_posted, "posted");
    INTERN(S_dead, "dead");
    INTERN(S_seq, "seq");
    INTERN(S_next_msgid, "next_msgid");
    INTERN(S_last_rts, "last_rts");
    INTERN(S_cma, "cma");
    INTERN(S_ok, "ok");
    INTERN(S_reads, "reads");
#undef INTERN
#if defined(__x86_64__) && defined(__GNUC__)
    has_avx2 = __builtin_cpu_supports("avx2") != 0;
    if (__builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx")) {
        kernel_fn half[] = {sum_half, prod_half, min_half, max_half};
        for (int k = 0; k < 4; k++) KERNELS[HALF_ROW * 7 + k] = half[k];
    }
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
        KERNELS[BF16_ROW * 7] = sum_bf16_avx512;
        KERNELS[BF16_ROW * 7 + 1] = prod_bf16_avx512;
    } else if (has_avx2) {
        KERNELS[BF16_ROW * 7] = sum_bf16_avx2;
        KERNELS[BF16_ROW * 7 + 1] = prod_bf16_avx2;
    }
#endif
    if (PyType_Ready(&LaneType) < 0) return NULL;
    PyObject *m = PyModule_Create(&MODULE);
    if (!m) return NULL;
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(m, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
