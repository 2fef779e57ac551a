/* A quantised linear layer's product for a few rows on the CPU: int4 and int8 weights, float32 rows.

Built at run time by litkv/modeling/quant_rows.py (litkv.core.c_build). Both read the codes once, in the order they
lie, turn them into float32 in registers and multiply-add them into float32 sums: no bfloat16 rounding of the rows or
of the outputs, no float copy of the weight. Everything runs on the calling thread.

litkv_int4_rows: y (R, N) = x (R, K) @ W^T with W[n][k] = (c[n][k] - 8) * s[g][n] + z[g][n], g = k / G, the codes c
in [0, 15] in the layout of PyTorch's CPU int4 kernel (`torch._convert_weight_to_int4pack_for_cpu`, where litkv reads
it: quant_weights._layout_known): blocks of 64 output rows, per input k 32 bytes, byte j holding row j of the block in
its low nibble and row j + 32 in its high one. sz (K / G, N) holds each bfloat16 scale and zero as one 32-bit word
(the scale in the low half, the zero in the high one). Per output and group: a running sum of c * x and of x over the
group's inputs in order, then out += s * (sum_cx - 8 * sum_x) + z * sum_x, group after group.

litkv_int8_rows: y (R, N) = x (R, K) @ W^T with W[n][k] = c[n][k] * s[n], the codes (N, K) int8 row-major, the
scales (N) bfloat16: per output LANES partial sums over k (k, k + LANES, ...) added up in a fixed tree, times s[n].

An output's bits do not depend on R, on the other rows or on the other outputs.
*/
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16
#define ROWS 16 /* int8 outputs computed together */

typedef float floats __attribute__((vector_size(4 * LANES)));
typedef float floats8 __attribute__((vector_size(32)));
typedef float floats4 __attribute__((vector_size(16)));
typedef uint32_t words __attribute__((vector_size(4 * LANES)));
typedef int32_t ints __attribute__((vector_size(4 * LANES)));
typedef uint8_t bytes __attribute__((vector_size(LANES)));

/* Through int32: a direct conversion of bytes to floats is not vectorised by every compiler. */
static inline floats from_bytes(bytes b) { return __builtin_convertvector(__builtin_convertvector(b, ints), floats); }

static inline floats from_words(words w) {
    floats f;
    memcpy(&f, &w, sizeof(f));
    return f;
}

/* Outputs n0 .. n0 + 63 of one row x into y: blk the K * 32 bytes of codes of their block. */
static void int4_block(const float *x, const uint8_t *blk, const uint32_t *sz, float *y, int64_t N, int64_t K,
                       int64_t G, int64_t n0) {
    floats out[4] = {{0}, {0}, {0}, {0}};
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        floats acc[4] = {{0}, {0}, {0}, {0}};
        float xs = 0;
        for (int64_t k = g0; k < g0 + G; k++) {
            const float xk = x[k];
            xs += xk;
#ifdef __AVX512F__ /* each byte widened by its load, the nibbles taken apart as int32 (the same numbers) */
            const ints a = (ints)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + k * 32)));
            const ints b = (ints)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + k * 32 + 16)));
            acc[0] += __builtin_convertvector(a & 15, floats) * xk;
            acc[1] += __builtin_convertvector(b & 15, floats) * xk;
            acc[2] += __builtin_convertvector(a >> 4, floats) * xk;
            acc[3] += __builtin_convertvector(b >> 4, floats) * xk;
#else
            const bytes low = (bytes){0} + 15;
            bytes a, b;
            memcpy(&a, blk + k * 32, sizeof(a));
            memcpy(&b, blk + k * 32 + 16, sizeof(b));
            acc[0] += from_bytes(a & low) * xk;
            acc[1] += from_bytes(b & low) * xk;
            acc[2] += from_bytes(a >> 4) * xk;
            acc[3] += from_bytes(b >> 4) * xk;
#endif
        }
        const uint32_t *group = sz + (g0 / G) * N + n0;
        for (int i = 0; i < 4; i++) {
            words w;
            memcpy(&w, group + i * LANES, sizeof(w));
            const floats s = from_words(w << 16), z = from_words(w & 0xFFFF0000u);
            out[i] += s * (acc[i] - 8 * xs) + z * xs;
        }
    }
    memcpy(y + n0, out, sizeof(out));
}

/* Returns 1 (nothing written) where N is not a multiple of 64, G not a multiple of 2 dividing K, or R not in
   1 .. 8, else 0. */
int litkv_int4_rows(const float *x, const uint8_t *packed, const uint32_t *sz, float *y, int64_t R, int64_t N,
                    int64_t K, int64_t G) {
    if (N % 64 != 0 || G < 2 || G % 2 != 0 || K % G != 0 || R < 1 || R > 8) return 1;
    for (int64_t n0 = 0; n0 < N; n0 += 64)
        for (int64_t r = 0; r < R; r++)
            int4_block(x + r * K, packed + n0 * K / 2, sz, y + r * N, N, K, G, n0);
    return 0;
}

static inline float total(floats v) {
    floats8 a, b;
    memcpy(&a, &v, sizeof(a));
    memcpy(&b, (const char *)&v + sizeof(a), sizeof(b));
    a += b;
    floats4 c, d;
    memcpy(&c, &a, sizeof(c));
    memcpy(&d, (const char *)&a + sizeof(c), sizeof(d));
    c += d;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof(f));
    return f;
}

/* LANES int8 codes as floats, exactly. With AVX-512 one sign-extending load and a conversion; elsewhere read as
   unsigned bytes with the sign bit flipped, widened, less 128 (GCC 12 widens a signed byte vector loaded from memory
   one byte at a time). The same numbers either way. */
static inline floats code_row(const int8_t *row) {
#ifdef __AVX512F__
    return (floats)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)row)));
#else
    bytes c;
    memcpy(&c, row, sizeof(c));
    return __builtin_convertvector(__builtin_convertvector(c ^ 0x80, ints) - 128, floats);
#endif
}

/* Outputs n0 .. n0 + M - 1 of row x (M = ROWS, or 1 for the last ones): each one sum of LANES partial sums. ROWS
   outputs at a time share each load of x (and measured faster than 1, 4 or 8 at a time on the AMD EPYC). */
static inline void int8_outputs(const float *x, const int8_t *codes, const uint16_t *scales, float *y, int64_t K,
                                int64_t n0, const int M) {
    floats acc[ROWS];
    for (int i = 0; i < M; i++) acc[i] = (floats){0};
    for (int64_t k = 0; k < K; k += LANES) {
        floats xv;
        memcpy(&xv, x + k, sizeof(xv));
        for (int i = 0; i < M; i++) acc[i] += code_row(codes + (n0 + i) * K + k) * xv;
    }
    for (int i = 0; i < M; i++) y[n0 + i] = total(acc[i]) * from_bf16(scales[n0 + i]);
}

/* Returns 1 (nothing written) where K is not a multiple of LANES or R not in 1 .. 8, else 0. */
int litkv_int8_rows(const float *x, const int8_t *codes, const uint16_t *scales, float *y, int64_t R, int64_t N,
                    int64_t K) {
    if (K % LANES != 0 || R < 1 || R > 8) return 1;
    int64_t n0 = 0;
    for (; n0 + ROWS <= N; n0 += ROWS)
        for (int64_t r = 0; r < R; r++) int8_outputs(x + r * K, codes, scales, y + r * N, K, n0, ROWS);
    for (; n0 < N; n0++)
        for (int64_t r = 0; r < R; r++) int8_outputs(x + r * K, codes, scales, y + r * N, K, n0, 1);
    return 0;
}
