/* A cache's decode step on the CPU: attention read straight from the codes (or the float32 numbers), in one pass.

Built at run time by litkv/kvcache/kernels/cpu_decode.py, once per (HEAD, GROUPS, BITS, M), with
    HEAD    numbers per key or value vector (the head size D),
    GROUPS  scales (and offsets) per vector, so that a group holds SIZE = HEAD / GROUPS numbers,
    BITS    8 or 4, or 32: float32 numbers, no scales (GROUPS 1), keys and values in tensors of their own
            (litkv_float_attend; the quantising functions are not built),
    M       queries per KV head (a decode step: the query heads that share a KV head),
so that every loop inside a slot has constant bounds and the compiler unrolls and vectorises it.

Layout (litkv.kvcache.quantized): slot s of row b and KV head g holds 2 * WIDTH bytes at
codes + b * stride_b + g * stride_g + s * stride_s, the key's codes first, then the value's. int8 codes
are stored biased by -128 (the byte XOR 0x80 is the code); int4 element i sits in the low nibble of byte
i and element i + HEAD / 2 in its high nibble. scales and offsets are float16 bits, those of slot s at
scales + b * scale_b + g * scale_g + s * scale_s (the key's GROUPS, then the value's); a number is
offset + scale * code.

litkv_quant_attend walks the slots of each (row, KV head) pair in blocks of BLOCK: it scores the block's
keys, folds the block into a running softmax (maximum and sum per query, as flash-decoding does), and
adds the block's values weighted by their softmax numerators, so each slot's codes are read once (the
value's right after the key's). The scales and offsets never multiply a number one by one:

- keys (quant_keys_cpu.h): each query is rounded to two int8 digits per group, its digits times the codes
  add up exactly as integers (AVX-512 VNNI where the compiler targets it, 16 slots at a time), and a group's
  score is scale * (step / 254) * that sum + offset * the query's float32 sum over the group;
- values: the codes as numbers times the softmax numerator times the group's scale, added into accumulators
  held over the block, and the offsets weighted by the numerators added per group once per block.

The arithmetic is on vectors of LANES numbers (GCC / Clang vector extensions, which every target lowers to its
own instructions); the softmax on vectors of 16 (exp_cpu.h). Sums run in a fixed order, so a row's result does
not depend on the other rows of the batch. Everything runs on the calling thread. Float32 slots share the
softmax and the values' loops; their keys are dotted with the float32 queries (LANES partial sums added up LANES
slots at a time).
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_cpu.h"

#if !defined(HEAD) || !defined(GROUPS) || !defined(BITS) || !defined(M)
#error "HEAD, GROUPS, BITS and M must be defined"
#endif
#if HEAD % GROUPS != 0 || (BITS != 8 && BITS != 4 && BITS != 32) || (BITS == 4 && HEAD % 2 != 0) || \
    (BITS == 32 && GROUPS != 1)
#error "HEAD must split into GROUPS groups (and be even for 4 bits); BITS must be 8, 4 or 32 (one group)"
#endif

#define WIDTH (HEAD * BITS / 8) /* bytes of one key or value */
#define SIZE (HEAD / GROUPS)    /* numbers per scale */
#define BLOCK 64                /* slots per step of the running softmax (a multiple of LANES and 16) */
#define AHEAD 64                /* slots ahead whose codes are asked for while a slot is scored */

/* A float16 number (its bits) as float32, exactly: the magnitude's bits moved into float32's places and scaled
   by 2^112 (normal and subnormal numbers), infinity and NaN made so; no branch, so that a loop of it
   vectorises. */
static inline float half_to_float(uint16_t h) {
    const uint32_t wide = (uint32_t)(h & 0x7FFF) << 13;
    float value;
    memcpy(&value, &wide, sizeof(value));
    value *= 0x1p112f;
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    bits = (h & 0x7C00) == 0x7C00 ? wide | 0x7F800000u : bits;
    bits |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&value, &bits, sizeof(value));
    return value;
}

/* LANES numbers per vector: 16 where every group (and for 4 bits, every half of a vector) holds a multiple of
   16, else 8 or 4; else no attention kernel (the caller takes the PyTorch path). */
#if HEAD % (16 * GROUPS) == 0 && (BITS != 4 || HEAD % 32 == 0)
#define LANES 16
#elif HEAD % (8 * GROUPS) == 0 && (BITS != 4 || HEAD % 16 == 0)
#define LANES 8
#elif HEAD % (4 * GROUPS) == 0 && (BITS != 4 || HEAD % 8 == 0)
#define LANES 4
#endif
#ifdef LANES
#define PIECES (HEAD / LANES)      /* LANES-number pieces of a key or value */
#define PER_GROUP (SIZE / LANES)   /* pieces per group */

typedef float floats __attribute__((vector_size(4 * LANES)));
typedef uint8_t bytes __attribute__((vector_size(LANES)));
typedef int32_t ints __attribute__((vector_size(4 * LANES)));

/* Quantised keys' integer products by AVX-512 VNNI where the compiler targets it: 16 slots' codes transposed so
   that a 32-bit lane holds 4 codes of one slot, each times 4 int8 numbers of a query in one instruction, 16 slots
   at a time; else by the vectors above, per slot (the same integers). */
#if BITS != 32 && LANES == 16 && WIDTH % 32 == 0 && SIZE % 4 == 0 && defined(__AVX512VNNI__) && \
    defined(__AVX512BW__) && !defined(LITKV_PORTABLE)
#include <immintrin.h>
#define VNNI 1
#endif

/* 1 where the keys' products take VNNI here, else 0 (tests compare the two builds bit for bit). */
int litkv_vnni(void) {
#ifdef VNNI
    return 1;
#else
    return 0;
#endif
}
/* Numbers LANES * i .. LANES * i + LANES - 1 of one key or value as stored: float32 slots' numbers, quantised
   slots' codes (as integers, before their scale and offset). */
#if BITS == 32
static inline floats numbers(const uint8_t *codes, int i) {
    floats x;
    memcpy(&x, codes + sizeof(floats) * i, sizeof(x));
    return x;
}
#else
static inline ints code_ints(const uint8_t *codes, int i) {
    bytes b;
#if BITS == 8
    memcpy(&b, codes + LANES * i, LANES);
    b ^= 0x80;
#else
    memcpy(&b, codes + LANES * (i % (PIECES / 2)), LANES);
    b = i < PIECES / 2 ? b & 0x0F : b >> 4;
#endif
    return __builtin_convertvector(b, ints);
}

static inline floats numbers(const uint8_t *codes, int i) {
    return __builtin_convertvector(code_ints(codes, i), floats);
}
#endif

/* The sums of the lanes of r[0], ..., r[LANES - 1], in that order: neighbouring lanes added, then pairs,
   fours, ... (a fixed order), for vectors of type T. */
#define UNPACK(...) __VA_ARGS__
#define ADD(a, b, F, S) (__builtin_shufflevector(a, b, UNPACK F) + __builtin_shufflevector(a, b, UNPACK S))
#if LANES == 4
#define LANE_TREE(T)                                                                                    \
    {                                                                                                   \
        T a[2];                                                                                         \
        for (int i = 0; i < 2; i++) a[i] = ADD(r[2 * i], r[2 * i + 1], (0, 4, 2, 6), (1, 5, 3, 7));      \
        return ADD(a[0], a[1], (0, 1, 4, 5), (2, 3, 6, 7));                                              \
    }
#elif LANES == 8
#define LANE_TREE(T)                                                                                    \
    {                                                                                                   \
        T a[4], b[2];                                                                                   \
        for (int i = 0; i < 4; i++)                                                                     \
            a[i] = ADD(r[2 * i], r[2 * i + 1], (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15)); \
        for (int i = 0; i < 2; i++)                                                                     \
            b[i] = ADD(a[2 * i], a[2 * i + 1], (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15)); \
        return ADD(b[0], b[1], (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15));                \
    }
#else
#define LANE_TREE(T)                                                                                     \
    {                                                                                                    \
        T a[8], b[4], c[2];                                                                              \
        for (int i = 0; i < 8; i++)                                                                      \
            a[i] = ADD(r[2 * i], r[2 * i + 1], (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30), \
                       (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31));                     \
        for (int i = 0; i < 4; i++)                                                                      \
            b[i] = ADD(a[2 * i], a[2 * i + 1], (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29), \
                       (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31));                    \
        for (int i = 0; i < 2; i++)                                                                      \
            c[i] = ADD(b[2 * i], b[2 * i + 1], (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27), \
                       (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31));                    \
        return ADD(c[0], c[1], (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),                 \
                   (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));                      \
    }
#endif
static inline floats lane_sums(const floats r[LANES]) LANE_TREE(floats)
#if BITS != 32 && !defined(VNNI)
static inline ints int_lane_sums(const ints r[LANES]) LANE_TREE(ints)
#endif
#undef LANE_TREE
#undef ADD
#undef UNPACK

/* Slots [s0, s0 + n)'s float16 scales and offsets (slot s's at sc + s * scale_s and of + s * scale_s: the key's
   GROUPS, then the value's) as float32 into scale[e][t] and base[e][t]; nothing for float32 slots. Where the block's
   slots lie side by side, one run of numbers is converted (a loop that vectorises), then spread. */
static inline void block_scales(const uint16_t *sc, const uint16_t *of, int64_t s0, int n, int64_t scale_s,
                                float scale[2 * GROUPS][BLOCK], float base[2 * GROUPS][BLOCK]) {
#if BITS != 32
    _Alignas(64) float run[2][BLOCK * 2 * GROUPS];
    if (n < BLOCK) memset(run, 0, sizeof(run)); /* past n: read by the shuffles below, never used */
    if (scale_s == 2 * GROUPS) {
        const uint16_t *from = sc + s0 * scale_s, *start = of + s0 * scale_s;
        for (int i = 0; i < n * 2 * GROUPS; i++)
            run[0][i] = half_to_float(from[i]), run[1][i] = half_to_float(start[i]);
    } else
        for (int t = 0; t < n; t++)
            for (int e = 0; e < 2 * GROUPS; e++) {
                run[0][t * 2 * GROUPS + e] = half_to_float(sc[(s0 + t) * scale_s + e]);
                run[1][t * 2 * GROUPS + e] = half_to_float(of[(s0 + t) * scale_s + e]);
            }
#if GROUPS == 1 /* a key's and a value's number side by side: 16 slots' pairs split by two shuffles */
    for (int i = 0; i < 2; i++)
        for (int t = 0; t < n; t += 16) {
            exp_floats a, b;
            memcpy(&a, run[i] + 2 * t, sizeof(a)), memcpy(&b, run[i] + 2 * t + 16, sizeof(b));
            const exp_floats keys =
                __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const exp_floats values =
                __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            float(*into)[BLOCK] = i ? base : scale;
            memcpy(into[0] + t, &keys, sizeof(keys)), memcpy(into[1] + t, &values, sizeof(values));
        }
#else
    for (int t = 0; t < n; t++)
        for (int e = 0; e < 2 * GROUPS; e++)
            scale[e][t] = run[0][t * 2 * GROUPS + e], base[e][t] = run[1][t * 2 * GROUPS + e];
#endif
#else
    (void)sc, (void)of, (void)s0, (void)n, (void)scale_s, (void)scale, (void)base;
#endif
}

#if BITS == 32
/* The queries of one (row, KV head) pair as the key products take them: the numbers times the attention's scale. */
typedef struct {
    floats qv[M][PIECES];
} queries;

static void prepare_queries(const float *qq, float qscale, queries *q) {
    for (int m = 0; m < M; m++)
        for (int i = 0; i < PIECES; i++) {
            memcpy(&q->qv[m][i], qq + m * HEAD + i * LANES, sizeof(floats));
            q->qv[m][i] *= qscale; /* as PyTorch's q * scale rounds */
        }
}

/* dots[m]: query m dotted with the keys of each of the LANES slots at c, c + stride_s, ... (the first `count` of
   them; the rest 0). */
static inline void tile_dots(const queries *q, const uint8_t *c, int64_t stride_s, int count, const float *scale,
                             const float *base, floats dots[M]) {
    (void)scale, (void)base;
    floats r[M][LANES];
    for (int t = 0; t < LANES; t++) {
        if (t >= count) {
            for (int m = 0; m < M; m++) r[m][t] = (floats){0};
            continue;
        }
        floats x[PIECES];
        for (int at = 0; at < 2 * WIDTH; at += 64) __builtin_prefetch(c + (t + AHEAD) * stride_s + at);
        for (int i = 0; i < PIECES; i++) x[i] = numbers(c + t * stride_s, i);
        for (int m = 0; m < M; m++) {
            floats a = q->qv[m][0] * x[0];
            for (int i = 1; i < PIECES; i++) a += q->qv[m][i] * x[i];
            r[m][t] = a;
        }
    }
    for (int m = 0; m < M; m++) dots[m] = lane_sums(r[m]);
}
#else
#include "quant_keys_cpu.h"
#endif

/* Scores of slots [s0, s0 + n) (n <= BLOCK; their scales and offsets in scale, base) into out[m][t]: q . key,
   soft-capped when softcap > 0, -inf where the mask hides the slot (mask NULL: none hidden). Returns nonzero where
   it hides one. */
static inline int block_scores(const queries *q, const uint8_t *c, const uint8_t *mask, int64_t s0, int n,
                               int64_t stride_s, const float scale[2 * GROUPS][BLOCK],
                               const float base[2 * GROUPS][BLOCK], float softcap, float out[M][BLOCK]) {
    ints any = {0};
    for (int t0 = 0; t0 < n; t0 += LANES) {
        const int count = n - t0 < LANES ? n - t0 : LANES;
        floats dots[M];
        tile_dots(q, c + (s0 + t0) * stride_s, stride_s, count, scale[0] + t0, base[0] + t0, dots);
        ints hidden;
        for (int t = 0; t < LANES; t++) hidden[t] = t < count && mask != NULL ? mask[s0 + t0 + t] == 0 : 0;
        hidden = -hidden;
        any |= hidden;
        for (int m = 0; m < M; m++) {
            floats total = dots[m];
            if (softcap > 0.0f)
                for (int t = 0; t < LANES; t++) total[t] = tanhf(total[t] / softcap) * softcap;
            ints bits;
            memcpy(&bits, &total, sizeof(bits));
            bits = (bits & ~hidden) | (hidden & ((ints){0} + (int32_t)0xFF800000));
            memcpy(out[m] + t0, &bits, sizeof(bits));
        }
    }
    int hides = 0;
    for (int t = 0; t < LANES; t++) hides |= any[t];
    return hides;
}

/* The numbers of the key or value at c, as `numbers` gives them (int4 with AVX-512: the codes' nibbles picked
   from a table of the numbers 0 .. 15, which reads only each lane's low 4 bits). */
static inline void all_numbers(const uint8_t *c, floats x[PIECES]) {
#if BITS == 4 && defined(VNNI)
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int j = 0; j < PIECES / 2; j++) {
        const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * j)));
        x[j] = (floats)_mm512_permutexvar_ps(both, table);
        x[j + PIECES / 2] = (floats)_mm512_permutexvar_ps(_mm512_srli_epi32(both, 4), table);
    }
#else
    for (int i = 0; i < PIECES; i++) x[i] = numbers(c, i);
#endif
}

/* Adds slots [s0, s0 + n) weighted by p[m][t] to acc (M, HEAD): each value's stored numbers times p[m][t] and
   (quantised slots) its group's scale, scale[GROUPS + g][t]; the offsets' part is added by block_offsets. Where
   `hides` (the mask hides a slot of the block), a slot whose weights are all 0 is skipped, so that what a hidden
   slot holds is never read. */
static inline void block_values(const uint8_t *c, int64_t s0, int n, int64_t stride_s,
                                const float scale[2 * GROUPS][BLOCK], float p[M][BLOCK], int hides,
                                floats acc[M][PIECES]) {
    floats sum[M][PIECES]; /* acc, held in registers over the block */
    _Alignas(64) float w[M][GROUPS][BLOCK];
    for (int m = 0; m < M; m++)
        for (int g = 0; g < GROUPS; g++)
            for (int t = 0; t < n; t++) w[m][g][t] = BITS == 32 ? p[m][t] : p[m][t] * scale[GROUPS + g][t];
    memcpy(sum, acc, sizeof(sum));
    for (int t = 0; t < n; t++) {
        if (hides) {
            int any = 0;
            for (int m = 0; m < M; m++) any |= p[m][t] != 0.0f;
            if (!any) continue; /* hidden from every query: its codes are not read */
        }
        floats x[PIECES];
        all_numbers(c + (s0 + t) * stride_s, x);
        for (int i = 0; i < PIECES; i++)
            for (int m = 0; m < M; m++) sum[m][i] += w[m][i / PER_GROUP][t] * x[i];
    }
    memcpy(acc, sum, sizeof(sum));
}

/* shift[m][g] += the value offsets of slots [0, n) (base[GROUPS + g][t]) weighted by p[m][t] (a slot of weight 0
   adds nothing, whatever its offset holds; p is 0 past n), in 16 interleaved parts. */
static inline void block_offsets(const float base[2 * GROUPS][BLOCK], const float p[M][BLOCK], int n,
                                 float shift[M][GROUPS]) {
    const int whole = (n + 15) & ~15;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < GROUPS; g++) {
            exp_floats lanes = {0}, weight, offset;
            for (int t = 0; t < whole; t += 16) {
                memcpy(&weight, p[m] + t, sizeof(weight)), memcpy(&offset, base[GROUPS + g] + t, sizeof(offset));
                lanes += exp_select(weight != 0.0f, weight * offset, (exp_floats){0});
            }
            for (int l = 0; l < 16; l++) shift[m][g] += lanes[l];
        }
}

/* Folds one block's scores (n of them; the rest of the row is overwritten with -inf) into the running maximum of
   each query and its sum, kept in 16 lanes: p[m][t] becomes e^(score - maximum) (0 past n), and alpha[m] the
   factor that rescales what was summed before the block (1 where the maximum stays). Vectors of 16 numbers
   (exp16_nonpositive), the queries side by side. */
static void block_softmax(float scores[M][BLOCK], int n, float *maximum, exp_floats *sum, float p[M][BLOCK],
                          float *alpha) {
    const int whole = (n + 15) & ~15;
    exp_floats lanes[M], x, top[M];
    for (int m = 0; m < M; m++) {
        for (int t = n; t < whole; t++) scores[m][t] = -INFINITY;
        lanes[m] = (exp_floats){0} + maximum[m];
    }
    for (int t = 0; t < whole; t += 16)
        for (int m = 0; m < M; m++) {
            memcpy(&x, scores[m] + t, sizeof(x));
            lanes[m] = exp_select(x > lanes[m], x, lanes[m]);
        }
    for (int m = 0; m < M; m++) {
        const float largest = largest_lane(lanes[m]);
        alpha[m] = largest == maximum[m] ? 1.0f : exp_nonpositive(maximum[m] - largest); /* -inf - -inf: NaN */
        maximum[m] = largest;
        top[m] = (exp_floats){0} + largest;
        sum[m] *= alpha[m];
    }
    for (int t = 0; t < whole; t += 16)
        for (int m = 0; m < M; m++) {
            memcpy(&x, scores[m] + t, sizeof(x));
            x = maximum[m] == -INFINITY ? (exp_floats){0} : exp16_nonpositive(x - top[m]); /* nothing seen yet */
            memcpy(p[m] + t, &x, sizeof(x));
            sum[m] += x;
        }
}

/* One (row, KV head) pair's decode attention: its M queries qq (M, HEAD), times qscale, over S slots whose
   keys start at k and values at v (slot s at k + s * key_s, v + s * value_s bytes); scales and offsets at sc
   and of (the key's first, then the value's; unused for float32); seen: a byte per slot, nonzero where it may
   be attended (NULL: every slot). Writes out (M, HEAD); where w is not NULL, the scores (M, S) into score and
   the softmax weights summed over the M queries, times `factor`, into w (S). */
static void attend_pair(const float *qq, const uint8_t *k, const uint8_t *v, int64_t key_s, int64_t value_s,
                        const uint16_t *sc, const uint16_t *of, int64_t scale_s, const uint8_t *seen, int64_t S,
                        float qscale, float softcap, float *out, float *score, float *w, float factor) {
    queries q;
    floats acc[M][PIECES];
    _Alignas(64) float block[M][BLOCK], p[M][BLOCK], alpha[M], maximum[M], sum[M], shift[M][GROUPS] = {{0}};
    exp_floats lanes[M]; /* each query's running sum, in 16 parts */
    _Alignas(64) float scale[2 * GROUPS][BLOCK] = {{0}}, base[2 * GROUPS][BLOCK] = {{0}};
    prepare_queries(qq, qscale, &q);
    for (int m = 0; m < M; m++) {
        for (int i = 0; i < PIECES; i++) acc[m][i] = (floats){0};
        maximum[m] = -INFINITY, lanes[m] = (exp_floats){0};
    }
    for (int64_t s0 = 0; s0 < S; s0 += BLOCK) {
        const int n = S - s0 < BLOCK ? (int)(S - s0) : BLOCK;
        block_scales(sc, of, s0, n, scale_s, scale, base);
        const int hides = block_scores(&q, k, seen, s0, n, key_s, scale, base, softcap, block);
        if (w != NULL)
            for (int m = 0; m < M; m++) memcpy(score + m * S + s0, block[m], n * sizeof(float));
        block_softmax(block, n, maximum, lanes, p, alpha);
        for (int m = 0; m < M; m++) {
            for (int i = 0; i < PIECES; i++) acc[m][i] *= alpha[m];
            for (int g = 0; g < GROUPS; g++) shift[m][g] *= alpha[m];
        }
        block_values(v, s0, n, value_s, scale, p, hides, acc);
        if (BITS != 32) block_offsets(base, p, n, shift);
    }
    for (int m = 0; m < M; m++) {
        sum[m] = 0.0f;
        for (int l = 0; l < 16; l++) sum[m] += lanes[m][l];
        for (int i = 0; i < PIECES; i++) {
            const floats value = (acc[m][i] + shift[m][i / PER_GROUP]) / sum[m];
            memcpy(out + m * HEAD + i * LANES, &value, sizeof(value));
        }
    }
    if (w != NULL) { /* e^(score - maximum) / sum, added over the queries */
        _Alignas(64) float per_query[M];
        for (int m = 0; m < M; m++) per_query[m] = factor / sum[m];
        int64_t s = 0;
        for (; s + 16 <= S; s += 16) {
            exp_floats total = {0}, x;
            for (int m = 0; m < M; m++) {
                memcpy(&x, score + m * S + s, sizeof(x));
                total += exp16_nonpositive(x - maximum[m]) * per_query[m];
            }
            memcpy(w + s, &total, sizeof(total));
        }
        for (; s < S; s++) {
            float total = 0.0f;
            for (int m = 0; m < M; m++) total += exp_nonpositive(score[m * S + s] - maximum[m]) * per_query[m];
            w[s] = total;
        }
    }
}

#if BITS == 32
/* Decode attention over float32 slots: keys and values (B, G, S, HEAD) float32 with element strides key_b,
   key_g, key_s and value_b, value_g, value_s (each vector contiguous); the rest as litkv_quant_attend's. */
void litkv_float_attend(const float *q, const float *keys, const float *values, const uint8_t *mask,
                        const uint8_t *counted, float *y, float *scores, float *weights, int64_t B, int64_t G,
                        int64_t S, int64_t key_b, int64_t key_g, int64_t key_s, int64_t value_b, int64_t value_g,
                        int64_t value_s, int64_t mask_b, int64_t mask_g, float scale, float softcap) {
    for (int64_t bg = 0; bg < B * G; bg++) {
        const int64_t b = bg / G, g = bg % G;
        const uint8_t *k = (const uint8_t *)(keys + b * key_b + g * key_g);
        const uint8_t *v = (const uint8_t *)(values + b * value_b + g * value_g);
        attend_pair(q + bg * M * HEAD, k, v, key_s * 4, value_s * 4, NULL, NULL, 0,
                    mask == NULL ? NULL : mask + b * mask_b + g * mask_g, S, scale, softcap, y + bg * M * HEAD,
                    weights == NULL ? NULL : scores + bg * M * S, weights == NULL ? NULL : weights + bg * S,
                    counted == NULL || counted[b] ? 1.0f : 0.0f);
    }
}
#else
/* Decode attention over quantised slots.

   q (B, G, M, HEAD) float32, contiguous, multiplied here by `scale` (float32 products, as PyTorch's q * scale);
   codes, scales and offsets as above (offsets with the strides of scales); mask: byte s of row b and KV head g
   at mask + b * mask_b + g * mask_g + s, nonzero where the slot may be attended (NULL: every slot); softcap: the
   soft-capping threshold, 0 for none. Writes y (B, G, M, HEAD) float32; where weights is not NULL, the
   scores (B, G, M, S) (soft-capped, -inf where hidden) and from them the softmax weights summed over each KV
   head's M queries, weights (B, G, S), counting row b's query only where counted is NULL or counted[b] is
   nonzero. */
void litkv_quant_attend(const float *q, const uint8_t *codes, const uint16_t *scales, const uint16_t *offsets,
                        const uint8_t *mask, const uint8_t *counted, float *y, float *scores, float *weights,
                        int64_t B, int64_t G, int64_t S,
                        int64_t stride_b, int64_t stride_g, int64_t stride_s, int64_t scale_b, int64_t scale_g,
                        int64_t scale_s, int64_t mask_b, int64_t mask_g, float scale, float softcap) {
    for (int64_t bg = 0; bg < B * G; bg++) {
        const int64_t b = bg / G, g = bg % G;
        const uint8_t *c = codes + b * stride_b + g * stride_g;
        attend_pair(q + bg * M * HEAD, c, c + WIDTH, stride_s, stride_s, scales + b * scale_b + g * scale_g,
                    offsets + b * scale_b + g * scale_g, scale_s,
                    mask == NULL ? NULL : mask + b * mask_b + g * mask_g, S, scale, softcap,
                    y + bg * M * HEAD, weights == NULL ? NULL : scores + bg * M * S,
                    weights == NULL ? NULL : weights + bg * S, counted == NULL || counted[b] ? 1.0f : 0.0f);
    }
}
#endif
#endif

#if BITS != 32 /* the quantising functions: quantised caches only */
#include "quantize_cpu.h"
#endif
