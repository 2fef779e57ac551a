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
offset + scale * code. A block's scales and offsets are turned into float32 once, and each piece of a key
or value is read back as offset + scale * code (one fused multiply-add per LANES numbers) before its
products with the queries, so the quantised and the float32 slots share every loop after `piece`.

litkv_quant_attend walks the slots of each (row, KV head) pair in blocks of BLOCK: it scores the block's
keys, folds the block into a running softmax (maximum and sum per query, as flash-decoding does), and
adds the block's values weighted by their softmax numerators, so each slot's codes are read once (the
value's right after the key's). The arithmetic is on vectors of LANES numbers (GCC / Clang vector
extensions, which every target lowers to its own instructions): a key's codes become LANES-number pieces,
each query's dot product is LANES partial sums added up LANES slots at a time, and a value's pieces are
added into accumulators held over the block. Sums run in float32 in a fixed order, so a row's result
does not depend on the other rows of the batch. Everything runs on the calling thread.
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
#define BLOCK 64                /* slots per step of the running softmax (a multiple of LANES) */
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

/* Numbers LANES * i .. LANES * i + LANES - 1 of one key or value: offset + scale * code, with its groups'
   scales and offsets (float32) at scale and base (float32 slots: the numbers themselves). */
static inline floats piece(const uint8_t *codes, int i, const float *scale, const float *base) {
#if BITS == 32
    (void)scale, (void)base;
    floats x;
    memcpy(&x, codes + sizeof(floats) * i, sizeof(x));
    return x;
#else
    bytes b;
#if BITS == 8
    memcpy(&b, codes + LANES * i, LANES);
    b ^= 0x80;
#else
    memcpy(&b, codes + LANES * (i % (PIECES / 2)), LANES);
    b = i < PIECES / 2 ? b & 0x0F : b >> 4;
#endif
    return __builtin_convertvector(__builtin_convertvector(b, ints), floats) * scale[i / PER_GROUP] + base[i / PER_GROUP];
#endif
}

/* The sums of the lanes of r[0], ..., r[LANES - 1], in that order: neighbouring lanes added, then pairs,
   fours, ... (a fixed order). */
static inline floats lane_sums(const floats r[LANES]) {
#define ADD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__) + __builtin_shufflevector(a, b, SECOND))
    floats a[LANES / 2];
#if LANES == 4
#define SECOND 1, 5, 3, 7
    for (int i = 0; i < 2; i++) a[i] = ADD(r[2 * i], r[2 * i + 1], 0, 4, 2, 6);
#undef SECOND
#define SECOND 2, 3, 6, 7
    return ADD(a[0], a[1], 0, 1, 4, 5);
#undef SECOND
#elif LANES == 8
#define SECOND 1, 9, 3, 11, 5, 13, 7, 15
    floats b[2];
    for (int i = 0; i < 4; i++) a[i] = ADD(r[2 * i], r[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14);
#undef SECOND
#define SECOND 2, 3, 10, 11, 6, 7, 14, 15
    for (int i = 0; i < 2; i++) b[i] = ADD(a[2 * i], a[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13);
#undef SECOND
#define SECOND 4, 5, 6, 7, 12, 13, 14, 15
    return ADD(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11);
#undef SECOND
#else
    floats b[4], c[2];
#define SECOND 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
    for (int i = 0; i < 8; i++) a[i] = ADD(r[2 * i], r[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
#undef SECOND
#define SECOND 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
    for (int i = 0; i < 4; i++) b[i] = ADD(a[2 * i], a[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
#undef SECOND
#define SECOND 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
    for (int i = 0; i < 2; i++) c[i] = ADD(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
#undef SECOND
#define SECOND 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
    return ADD(c[0], c[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
#undef SECOND
#endif
#undef ADD
}

/* Slots [s0, s0 + n)'s float16 scales and offsets (slot s's at sc + s * scale_s and of + s * scale_s: the key's
   GROUPS, then the value's) as float32 into scale[t] and base[t]; nothing for float32 slots. */
static inline void block_scales(const uint16_t *sc, const uint16_t *of, int64_t s0, int n, int64_t scale_s,
                                float scale[BLOCK][2 * GROUPS], float base[BLOCK][2 * GROUPS]) {
#if BITS != 32
    if (scale_s == 2 * GROUPS) { /* the block's slots side by side: one run of numbers */
        const uint16_t *from = sc + s0 * scale_s, *start = of + s0 * scale_s;
        float *to = scale[0], *begin = base[0];
        for (int i = 0; i < n * 2 * GROUPS; i++) to[i] = half_to_float(from[i]), begin[i] = half_to_float(start[i]);
        return;
    }
    for (int t = 0; t < n; t++)
        for (int e = 0; e < 2 * GROUPS; e++) {
            scale[t][e] = half_to_float(sc[(s0 + t) * scale_s + e]);
            base[t][e] = half_to_float(of[(s0 + t) * scale_s + e]);
        }
#else
    (void)sc, (void)of, (void)s0, (void)n, (void)scale_s, (void)scale, (void)base;
#endif
}

/* dots[m]: query m dotted with the keys of each of the LANES slots at c, c + stride_s, ... (the first `count` of
   them, whose scales and offsets are scale[t], base[t]; the rest 0). */
static inline void tile_dots(const floats qv[M][PIECES], const uint8_t *c, int64_t stride_s, int count,
                             const float scale[][2 * GROUPS], const float base[][2 * GROUPS], floats dots[M]) {
    floats r[M][LANES];
    for (int t = 0; t < LANES; t++) {
        if (t >= count) {
            for (int m = 0; m < M; m++) r[m][t] = (floats){0};
            continue;
        }
        floats x[PIECES];
        for (int at = 0; at < 2 * WIDTH; at += 64) __builtin_prefetch(c + (t + AHEAD) * stride_s + at);
        for (int i = 0; i < PIECES; i++) x[i] = piece(c + t * stride_s, i, scale[t], base[t]);
        for (int m = 0; m < M; m++) {
            floats a = qv[m][0] * x[0];
            for (int i = 1; i < PIECES; i++) a += qv[m][i] * x[i];
            r[m][t] = a;
        }
    }
    for (int m = 0; m < M; m++) dots[m] = lane_sums(r[m]);
}

/* Scores of slots [s0, s0 + n) (n <= BLOCK; their scales and offsets in scale, base) into out[m][t]: q . key,
   soft-capped when softcap > 0, -inf where the mask hides the slot (mask NULL: none hidden). Returns nonzero where
   it hides one. */
static inline int block_scores(const floats qv[M][PIECES], const uint8_t *c, const uint8_t *mask, int64_t s0,
                               int n, int64_t stride_s, const float scale[BLOCK][2 * GROUPS],
                               const float base[BLOCK][2 * GROUPS], float softcap, float out[M][BLOCK]) {
    ints any = {0};
    for (int t0 = 0; t0 < n; t0 += LANES) {
        const int count = n - t0 < LANES ? n - t0 : LANES;
        floats dots[M];
        tile_dots(qv, c + (s0 + t0) * stride_s, stride_s, count, scale + t0, base + t0, dots);
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

/* Adds slots [s0, s0 + n) (their values' scales and offsets at scale[t] + GROUPS, base[t] + GROUPS) weighted by
   p[m][t] to acc (M, HEAD); where `hides` (the mask hides a slot of the block), a slot whose weights are all 0
   is skipped, so that what a hidden slot holds is never read. */
static inline void block_values(const uint8_t *c, int64_t s0, int n, int64_t stride_s,
                                const float scale[BLOCK][2 * GROUPS], const float base[BLOCK][2 * GROUPS],
                                float p[M][BLOCK], int hides, floats acc[M][PIECES]) {
    floats sum[M][PIECES]; /* acc, held in registers over the block */
    memcpy(sum, acc, sizeof(sum));
    for (int t = 0; t < n; t++) {
        if (hides) {
            int any = 0;
            for (int m = 0; m < M; m++) any |= p[m][t] != 0.0f;
            if (!any) continue; /* hidden from every query: its codes are not read */
        }
        for (int i = 0; i < PIECES; i++) {
            const floats x = piece(c + (s0 + t) * stride_s, i, scale[t] + GROUPS, base[t] + GROUPS);
            for (int m = 0; m < M; m++) sum[m][i] += p[m][t] * x;
        }
    }
    memcpy(acc, sum, sizeof(sum));
}

/* Folds one block's scores into the running maximum and sum of each query: p[m][t] becomes e^(score -
   maximum), and alpha[m] the factor that rescales what was summed before the block. */
static void block_softmax(float scores[M][BLOCK], int n, float *maximum, float *sum, float p[M][BLOCK],
                          float *alpha) {
    for (int m = 0; m < M; m++) {
        float lanes[LANES], top = maximum[m]; /* the maximum and the sum in LANES interleaved parts */
        for (int l = 0; l < LANES; l++) lanes[l] = top;
        int t = 0;
        for (; t + LANES <= n; t += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] = scores[m][t + l] > lanes[l] ? scores[m][t + l] : lanes[l];
        for (; t < n; t++) top = scores[m][t] > top ? scores[m][t] : top;
        for (int l = 0; l < LANES; l++) top = lanes[l] > top ? lanes[l] : top;
        if (top == -INFINITY) { /* nothing seen yet: the block adds nothing */
            for (t = 0; t < n; t++) p[m][t] = 0.0f;
            alpha[m] = 1.0f;
            continue;
        }
        alpha[m] = exp_nonpositive(maximum[m] - top);
        maximum[m] = top;
        for (t = 0; t < n; t++) p[m][t] = exp_nonpositive(scores[m][t] - top);
        float total = 0.0f;
        for (int l = 0; l < LANES; l++) lanes[l] = 0.0f;
        for (t = 0; t + LANES <= n; t += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += p[m][t + l];
        for (; t < n; t++) total += p[m][t];
        for (int l = 0; l < LANES; l++) total += lanes[l];
        sum[m] = sum[m] * alpha[m] + total;
    }
}

/* One (row, KV head) pair's decode attention: its M queries qq (M, HEAD), times qscale, over S slots whose
   keys start at k and values at v (slot s at k + s * key_s, v + s * value_s bytes); scales and offsets at sc
   and of (the key's first, then the value's; unused for float32); seen: a byte per slot, nonzero where it may
   be attended (NULL: every slot). Writes out (M, HEAD); where w is not NULL, the scores (M, S) into score and the softmax weights
   summed over the M queries, times `factor`, into w (S). */
static void attend_pair(const float *qq, const uint8_t *k, const uint8_t *v, int64_t key_s, int64_t value_s,
                        const uint16_t *sc, const uint16_t *of, int64_t scale_s, const uint8_t *seen, int64_t S,
                        float qscale, float softcap, float *out, float *score, float *w, float factor) {
    floats qv[M][PIECES], acc[M][PIECES];
    float block[M][BLOCK], p[M][BLOCK], alpha[M], maximum[M], sum[M], scale[BLOCK][2 * GROUPS], base[BLOCK][2 * GROUPS];
    for (int m = 0; m < M; m++) {
        for (int i = 0; i < PIECES; i++) {
            memcpy(&qv[m][i], qq + m * HEAD + i * LANES, sizeof(floats));
            qv[m][i] *= qscale; /* as PyTorch's q * scale rounds */
        }
        for (int i = 0; i < PIECES; i++) acc[m][i] = (floats){0};
        maximum[m] = -INFINITY, sum[m] = 0.0f;
    }
    for (int64_t s0 = 0; s0 < S; s0 += BLOCK) {
        const int n = S - s0 < BLOCK ? (int)(S - s0) : BLOCK;
        block_scales(sc, of, s0, n, scale_s, scale, base);
        const int hides = block_scores(qv, k, seen, s0, n, key_s, scale, base, softcap, block);
        if (w != NULL)
            for (int m = 0; m < M; m++) memcpy(score + m * S + s0, block[m], n * sizeof(float));
        block_softmax(block, n, maximum, sum, p, alpha);
        for (int m = 0; m < M; m++)
            for (int i = 0; i < PIECES; i++) acc[m][i] *= alpha[m];
        block_values(v, s0, n, value_s, scale, base, p, hides, acc);
    }
    for (int m = 0; m < M; m++) {
        for (int i = 0; i < PIECES; i++) {
            const floats value = acc[m][i] / sum[m];
            memcpy(out + m * HEAD + i * LANES, &value, sizeof(value));
        }
    }
    if (w != NULL) { /* e^(score - maximum) / sum, added over the queries */
        float per_query[M];
        for (int m = 0; m < M; m++) per_query[m] = factor / sum[m];
        for (int64_t s = 0; s < S; s++) {
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
/* float32 to float16 bits, rounded to nearest even (beyond float16's range: infinity), as a cast does. */
static inline uint16_t float_to_half(float f) {
    union {
        float value;
        uint32_t bits;
    } in = {.value = f};
    const uint16_t sign = (uint16_t)((in.bits >> 16) & 0x8000);
    const uint32_t magnitude = in.bits & 0x7FFFFFFF;
    if (magnitude >= 0x47800000u) return sign | 0x7C00; /* 65536 and above (callers exclude NaN) */
    if (magnitude < 0x38800000u) return sign | (uint16_t)nearbyintf(fabsf(f) * 16777216.0f); /* below 2^-14 */
    uint32_t half = ((magnitude >> 23) - 112) << 10 | (magnitude & 0x7FFFFF) >> 13;
    const uint32_t rest = magnitude & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half += 1; /* a carry may reach infinity: right */
    return sign | (uint16_t)half;
}

/* The next float16 toward -infinity (down) or +infinity (up), as nextafter does. */
static inline uint16_t half_step(uint16_t h, int up) {
    if ((h & 0x7FFF) == 0) return up ? 0x0001 : 0x8001;
    return ((h & 0x8000) == 0) == (up != 0) ? h + 1 : h - 1;
}

/* Whether each of the n numbers at x is finite and within float16's range (else the PyTorch path). */
static int all_in_range(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(x[i]) <= 65504.0f)) return 0;
    return 1;
}

/* One group of SIZE numbers at v: its offset (the minimum rounded down to float16) and scale (the range over
   2^BITS - 1 rounded up), as float16 bits, and its codes (as numbers) into numbers; 1 where both zeros sit at
   an extreme (the caller takes the PyTorch path), else 0. */
static int quantize_group(const float *v, uint16_t *scale_bits, uint16_t *offset_bits, float *numbers) {
    const float levels = (float)((1 << BITS) - 1);
    float low = v[0], high = v[0];
    int zeros = 0; /* bit 0: a +0 seen, bit 1: a -0 seen */
    for (int i = 0; i < SIZE; i++) {
        low = v[i] < low ? v[i] : low, high = v[i] > high ? v[i] : high;
        if (v[i] == 0.0f) zeros |= signbit(v[i]) ? 2 : 1;
    }
    if (zeros == 3 && (low == 0.0f || high == 0.0f)) return 1;
    uint16_t offset = float_to_half(low);
    if (half_to_float(offset) > low) offset = half_step(offset, 0);
    const float base = half_to_float(offset), range = (high - base) / levels;
    uint16_t scale = float_to_half(range);
    if (half_to_float(scale) < range) scale = half_step(scale, 1);
    const float factor = half_to_float(scale), inverse = 1.0f / (factor > 1e-30f ? factor : 1e-30f);
    for (int i = 0; i < SIZE; i++) {
        const float code = nearbyintf((v[i] - base) * inverse);
        numbers[i] = code < 0.0f ? 0.0f : code > levels ? levels : code;
    }
    *scale_bits = scale, *offset_bits = offset;
    return 0;
}

/* litkv.kvcache.quantized.quantize for float16 scales, bit for bit: each group of SIZE numbers of each
   of `rows` rows of HEAD (x float32, contiguous) gets offset = its minimum rounded down to float16,
   scale = (maximum - offset) / (2^BITS - 1) rounded up to float16, and codes round((x - offset) / scale)
   (times the reciprocal of the scale, at least 1e-30) clamped to [0, 2^BITS - 1], stored as the storage
   keeps them (int8: biased by -128; int4: two per byte): row r's codes at codes + (r / per) * code_stride +
   (r % per) * WIDTH, its scales and offsets at (r / per) * scale_stride + (r % per) * GROUPS (rows in runs
   of `per` side by side, e.g. a storage's slots). Returns 1 without finishing when a number is not
   finite or beyond float16's range, or a group whose minimum or maximum is zero holds both +0 and -0 (which
   zero is the extreme is the PyTorch reduction's choice): the caller then takes the PyTorch path; else 0. */
int litkv_quantize(const float *x, int64_t rows, int64_t per, uint8_t *codes, int64_t code_stride, uint16_t *scales,
                   uint16_t *offsets, int64_t scale_stride) {
    if (!all_in_range(x, rows * HEAD)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        float numbers[HEAD];
        for (int j = 0; j < GROUPS; j++) {
            uint16_t *scale = scales + r / per * scale_stride + r % per * GROUPS + j;
            if (quantize_group(x + r * HEAD + j * SIZE, scale, offsets + (scale - scales), numbers + j * SIZE)) return 1;
        }
        uint8_t *out = codes + r / per * code_stride + r % per * WIDTH;
#if BITS == 8
        for (int i = 0; i < WIDTH; i++) out[i] = (uint8_t)numbers[i] ^ 0x80;
#else
        for (int i = 0; i < WIDTH; i++) out[i] = (uint8_t)numbers[i] | (uint8_t)((uint8_t)numbers[i + WIDTH] << 4);
#endif
    }
    return 0;
}

/* errors[r]: the mean squared difference between row r of x (rows of HEAD numbers, as litkv_quantize takes
   them) and its quantised form read back (offset + scale * code, float32), the quantisation error
   `quantized.round_trip_error` measures (summed in another order: equal within float32 rounding). Returns 1
   where litkv_quantize would (errors then unreliable), else 0. */
int litkv_round_trip_errors(const float *x, int64_t rows, float *errors) {
    if (!all_in_range(x, rows * HEAD)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int j = 0; j < GROUPS; j++) {
            const float *v = x + r * HEAD + j * SIZE;
            float numbers[SIZE];
            uint16_t scale, offset;
            if (quantize_group(v, &scale, &offset, numbers)) return 1;
            const float factor = half_to_float(scale), base = half_to_float(offset);
            for (int i = 0; i < SIZE; i++) {
                const float miss = v[i] - (numbers[i] * factor + base);
                total += miss * miss;
            }
        }
        errors[r] = total / HEAD;
    }
    return 0;
}

/* A staged slot moved into place (`KVStorage.commit_staged`): for each of the `rows` (row, KV head) pairs r,
   the 2 * WIDTH code bytes and 2 * GROUPS scales and offsets of slot `room` copied into slot target[r] (nothing
   where target[r] is `room`: the staged token is the one dropped). Row r's slot s of codes at codes + r *
   code_stride + s * 2 * WIDTH, of scales and offsets at r * scale_stride + s * 2 * GROUPS. */
void litkv_commit(uint8_t *codes, int64_t code_stride, uint16_t *scales, uint16_t *offsets, int64_t scale_stride,
                  const int64_t *target, int64_t rows, int64_t room) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t to = target[r];
        if (to == room) continue;
        uint8_t *c = codes + r * code_stride;
        uint16_t *s = scales + r * scale_stride, *o = offsets + r * scale_stride;
        memcpy(c + to * 2 * WIDTH, c + room * 2 * WIDTH, 2 * WIDTH);
        memcpy(s + to * 2 * GROUPS, s + room * 2 * GROUPS, 2 * GROUPS * sizeof(uint16_t));
        memcpy(o + to * 2 * GROUPS, o + room * 2 * GROUPS, 2 * GROUPS * sizeof(uint16_t));
    }
}
#endif
