/* The keys' products of a quantised cache's decode step on the CPU, from the codes as integers: included by
quant_decode_cpu.c (beside this file) for 8- and 4-bit slots, with its macros (HEAD, GROUPS, SIZE, WIDTH, M, LANES,
PIECES, PER_GROUP, BLOCK, AHEAD, VNNI), vector types and `code_ints` / `int_lane_sums`.

Each query (times the attention's scale, float32) is rounded per group of SIZE numbers to two int8 digits: step =
max |x| / 127, d1 the nearest integer to x / step (ties to even), d2 the nearest to what d1 left times 254, so x =
step * (d1 + d2 / 254) within step / 508 = max |x| / 64,516 (about 16 bits), and the whole number w = 254 d1 + d2
fits in int16. A key group's codes c times w add up exactly in int32 (at most SIZE * 255 * 32385: SIZE <= 256 for
int8 codes, which cpu_decode.py sees to), and the group's score is scale * (step / 254) * that sum + offset * (the
float32 sum of the group's numbers). With AVX-512 VNNI 16 slots' codes are transposed so that a 32-bit lane holds 4
codes of one slot, times 4 digits of a query in one instruction (16 slots, no sums across lanes; the two digits'
sums joined as 254 I1 + I2); else each slot's products with w go into lanes added up LANES slots at a time. Both
give the same integers, so the same bits. */

/* The queries of one (row, KV head) pair as the key products take them: each query's whole numbers w (qi; where
   VNNI its digits d1, d2 as quads[k][m][e]: numbers 4 e .. 4 e + 3 as the bytes of one int32), its step / 254 per
   group (unit: what 1 of w is worth) and the group's sum of its float32 numbers (total). */
typedef struct {
    _Alignas(64) float unit[M][GROUPS], total[M][GROUPS];
#ifdef VNNI
    _Alignas(64) int32_t quads[2][M][HEAD / 4];
#else
    ints qi[M][PIECES];
#endif
} queries;

/* The M queries at qq (M, HEAD) times qscale, rounded as the file's comment says; a group holding a number that is
   not finite gets unit NaN (its scores NaN, as the float path's would be). */
static void prepare_queries(const float *qq, float qscale, queries *q) {
    for (int m = 0; m < M; m++) {
        _Alignas(64) float x[HEAD];
        _Alignas(64) int8_t digits[2][HEAD];
        for (int d = 0; d < HEAD; d++) x[d] = qq[m * HEAD + d] * qscale; /* as PyTorch's q * scale rounds */
        for (int g = 0; g < GROUPS; g++) {
            const float *v = x + g * SIZE;
            float top = 0.0f, sum = 0.0f;
            int finite = 1;
            for (int d = 0; d < SIZE; d++) {
                top = fabsf(v[d]) > top ? fabsf(v[d]) : top, sum += v[d];
                finite &= isfinite(v[d]) != 0;
            }
            const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
            for (int d = 0; d < SIZE; d++) {
                const float rest = finite ? v[d] * inverse : 0.0f, first = nearbyintf(rest);
                digits[0][g * SIZE + d] = (int8_t)first;
                digits[1][g * SIZE + d] = (int8_t)nearbyintf((rest - first) * 254.0f);
            }
            q->unit[m][g] = finite ? top / 127.0f / 254.0f : NAN, q->total[m][g] = sum;
        }
#ifdef VNNI
        for (int k = 0; k < 2; k++) memcpy(q->quads[k][m], digits[k], sizeof(digits[k]));
#else
        for (int i = 0; i < PIECES; i++)
            for (int l = 0; l < LANES; l++) q->qi[m][i][l] = 254 * digits[0][i * LANES + l] + digits[1][i * LANES + l];
#endif
    }
}

/* dots[m] for LANES slots from their integer products (sums[m][g], lane t: slot t's codes of group g times query
   m's whole numbers): that times the query's unit and the key's scale (scale[e * BLOCK + t]), plus the key's offset
   (base[e * BLOCK + t]) times the query's sum. */
static inline void integer_dots(const queries *q, ints sums[M][GROUPS], const float *scale, const float *base,
                                floats dots[M]) {
    for (int m = 0; m < M; m++) {
        floats total = {0};
        for (int g = 0; g < GROUPS; g++) {
            floats factor, shift;
            memcpy(&factor, scale + g * BLOCK, sizeof(factor));
            memcpy(&shift, base + g * BLOCK, sizeof(shift));
            total += __builtin_convertvector(sums[m][g], floats) * (factor * q->unit[m][g]) + shift * q->total[m][g];
        }
        dots[m] = total;
    }
}

#ifndef VNNI
/* dots[m]: query m dotted with the keys of the LANES slots at c, c + stride_s, ... (the first `count` of them,
   whose scales and offsets are scale[e][t], base[e][t]; the rest 0), from each slot's integer products in lanes
   added up LANES slots at a time. */
static inline void tile_dots(const queries *q, const uint8_t *c, int64_t stride_s, int count,
                             const float *scale, const float *base, floats dots[M]) {
    ints r[M][GROUPS][LANES], sums[M][GROUPS];
    for (int t = 0; t < LANES; t++) {
        ints one[M][GROUPS] = {{{0}}};
        if (t < count) {
            for (int at = 0; at < 2 * WIDTH; at += 64) __builtin_prefetch(c + (t + AHEAD) * stride_s + at);
            for (int i = 0; i < PIECES; i++) {
                const ints x = code_ints(c + t * stride_s, i);
                for (int m = 0; m < M; m++) one[m][i / PER_GROUP] += x * q->qi[m][i];
            }
        }
        for (int m = 0; m < M; m++)
            for (int g = 0; g < GROUPS; g++) r[m][g][t] = one[m][g];
    }
    for (int m = 0; m < M; m++)
        for (int g = 0; g < GROUPS; g++) sums[m][g] = int_lane_sums(r[m][g]);
    integer_dots(q, sums, scale, base, dots);
}
#else
/* 32-bit words w .. w + 7 of 16 slots' key codes (slot t at c + t * stride_s) into out[i]: lane t holds slot t's
   word w + i (an 8 x 8 transpose in each half of 8 vectors that hold slots t and t + 8). */
static inline void transpose(const uint8_t *c, int64_t stride_s, int w, __m512i out[8]) {
    __m512i z[8], a[8], b[8];
    for (int t = 0; t < 8; t++) {
        const __m256i low = _mm256_loadu_si256((const __m256i *)(c + t * stride_s + 4 * w));
        const __m256i high = _mm256_loadu_si256((const __m256i *)(c + (t + 8) * stride_s + 4 * w));
        z[t] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    }
    for (int t = 0; t < 8; t += 2)
        a[t] = _mm512_unpacklo_epi32(z[t], z[t + 1]), a[t + 1] = _mm512_unpackhi_epi32(z[t], z[t + 1]);
    for (int t = 0; t < 8; t += 4) {
        b[t] = _mm512_unpacklo_epi64(a[t], a[t + 2]), b[t + 1] = _mm512_unpackhi_epi64(a[t], a[t + 2]);
        b[t + 2] = _mm512_unpacklo_epi64(a[t + 1], a[t + 3]), b[t + 3] = _mm512_unpackhi_epi64(a[t + 1], a[t + 3]);
    }
    const __m512i first = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int i = 0; i < 4; i++) {
        out[i] = _mm512_permutex2var_epi64(b[i], first, b[i + 4]);
        out[i + 4] = _mm512_permutex2var_epi64(b[i], second, b[i + 4]);
    }
}

/* acc[k][m][g] += query m's digit k of numbers 4 e .. 4 e + 3 (group g) times the codes in x's lanes (4 per
   slot). */
static inline void add_products(const queries *q, __m512i x, int e, ints acc[2][M][GROUPS]) {
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < M; m++) {
            const __m512i digits = _mm512_set1_epi32(q->quads[k][m][e]);
            acc[k][m][4 * e / SIZE] = (ints)_mm512_dpbusd_epi32((__m512i)acc[k][m][4 * e / SIZE], x, digits);
        }
}

/* dots[m]: query m dotted with the keys of the 16 slots at c, c + stride_s, ... (the first `count` of them, whose
   scales and offsets are scale[e][t], base[e][t]; the rest 0), as the vectors' tile_dots computes them. */
static inline void tile_dots(const queries *q, const uint8_t *c, int64_t stride_s, int count,
                             const float *scale, const float *base, floats dots[M]) {
    _Alignas(64) uint8_t part[16][WIDTH];
    if (count < 16) { /* the last slots: copied, so that nothing past them is read */
        memset(part, 0, sizeof(part));
        for (int t = 0; t < count; t++) memcpy(part[t], c + t * stride_s, WIDTH);
        c = part[0], stride_s = WIDTH;
    } else
        for (int t = 0; t < 16; t++)
            for (int at = 0; at < 2 * WIDTH; at += 64) __builtin_prefetch(c + (t + AHEAD) * stride_s + at);
    ints acc[2][M][GROUPS], sums[M][GROUPS];
    memset(acc, 0, sizeof(acc));
    for (int w = 0; w < WIDTH / 4; w += 8) {
        __m512i words[8];
        transpose(c, stride_s, w, words);
        for (int i = 0; i < 8; i++) {
#if BITS == 8
            add_products(q, _mm512_xor_si512(words[i], _mm512_set1_epi8((char)0x80)), w + i, acc);
#else
            const __m512i nibbles = _mm512_set1_epi8(0x0F);
            add_products(q, _mm512_and_si512(words[i], nibbles), w + i, acc);
            add_products(q, _mm512_and_si512(_mm512_srli_epi32(words[i], 4), nibbles), HEAD / 8 + w + i, acc);
#endif
        }
    }
    for (int m = 0; m < M; m++)
        for (int g = 0; g < GROUPS; g++) { /* 254 I1 + I2 as (I1 << 8) - (I1 << 1) + I2, unsigned: no overflow */
            typedef uint32_t unsigned_ints __attribute__((vector_size(4 * LANES)));
            const unsigned_ints first = (unsigned_ints)acc[0][m][g];
            sums[m][g] = (ints)((first << 8) - (first << 1) + (unsigned_ints)acc[1][m][g]);
        }
    integer_dots(q, sums, scale, base, dots);
}
#endif
