/* A quantised linear layer's product for a few rows on the CPU: int4 and int8 weights, float32 rows; and a decode
step's two halves of a block over int4 layers, each in one call: RMSNorm + SwiGLU MLP + residual, and RMSNorm + the
attention's projection + RoPE.

Built at run time by litkv/modeling/quant_rows.py (litkv.core.c_build). The products read the codes once, in the
order they lie, no float copy of the weight, no bfloat16 rounding of the rows or of the outputs. Two ways, by the CPU:
where it has AVX-512 VNNI and VBMI (INT8_ACTIVATIONS, unless built with LITKV_FLOAT_ACTIVATIONS) each row is first
quantised to int8 per block of QBLOCK inputs (quantize_row) and the codes multiplied in exact integer dot products
(vpdpbusd), then scaled in float32; elsewhere the codes are turned into float32 in registers and multiply-added into
float32 sums. Everything runs on the calling thread.

litkv_int4_rows: y (R, N) = x (R, K) @ W^T with W[n][k] = (c[n][k] - 8) * s[g][n] + z[g][n], g = k / G, the codes c
in [0, 15] in the layout of PyTorch's CPU int4 kernel (`torch._convert_weight_to_int4pack_for_cpu`, where litkv reads
it: quant_weights._layout_known): blocks of 64 output rows, per input k 32 bytes, byte j holding row j of the block in
its low nibble and row j + 32 in its high one. sz (K / G, N) holds each bfloat16 scale and zero as one 32-bit word
(the scale in the low half, the zero in the high one). Float rows, per output and group: a running sum of c * x and
of x over the group's inputs in order, then out += s * (sum_cx - 8 * sum_x) + z * sum_x, group after group.

litkv_int8_rows: y (R, N) = x (R, K) @ W^T with W[n][k] = c[n][k] * s[n], the codes (N, K) int8 row-major, the
scales (N) bfloat16: per output LANES partial sums over k added up in a fixed tree, times s[n] (int8 rows where K is
a multiple of 64, else float rows).

litkv_int4_mlp: y = x + proj(silu(fc1(m)) * fc2(m)), m = RMSNorm(x) * w, the products as litkv_int4_rows's (x
first plus the attention's projection where given).
litkv_int4_qkv: a decode step's attention inputs, m = RMSNorm(x) * w, then queries and keys with RoPE and values.

An output's bits do not depend on R, on the other rows or on the other outputs.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* malloc for vectors: 64-byte aligned, so that no vector of 16 numbers spans two cache lines; NULL if it fails. */
static void *aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

#define LANES 16
#define ROWS 16 /* int8 outputs computed together */
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && !defined(LITKV_FLOAT_ACTIVATIONS)
#define INT8_ACTIVATIONS 1
#define QBLOCK 32        /* inputs per int8 block of a row */
#define CODES_AHEAD 4096 /* bytes of int4 codes read ahead (prefetched) */
#endif

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

#ifndef INT8_ACTIVATIONS
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

#endif

#ifdef INT8_ACTIVATIONS

/* Row x (K) as int8 codes q (K) and one scale d per QBLOCK inputs (K / QBLOCK): d = max |x| / 127 over the block,
   q = round(x * (127 / max |x|)) to the nearest, ties to even (all 0 where the block is 0), so x ~ q * d. */
static void quantize_row(const float *x, int8_t *q, float *d, float *dq, int64_t K) {
    for (int64_t b = 0; b < K; b += QBLOCK) {
        float amax = 0;
        for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(x[b + i]));
        const float inv = amax > 0 ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            q[b + i] = (int8_t)nearbyintf(x[b + i] * inv);
            sum += q[b + i];
        }
        d[b / QBLOCK] = amax / 127.0f;
        dq[b / QBLOCK] = d[b / QBLOCK] * (float)sum;
    }
}

/* Outputs n0 .. n0 + 63 of one int8 row (q, d) into y, as int4_block but by integer dot products: four inputs of
   each of the block's 64 outputs gathered into one 32-bit lane (vpermt2b over the layout's 4 x 32 bytes), the
   nibbles split, multiplied by the row's 4 codes and added in int32 (vpdpbusd; exact), then per QBLOCK inputs
   out += s * (d * sum_cq) and, per group, out += (z - 8 s) * sum_b d_b * sum_q_b. */
static void int4_block_q8(const int8_t *q, const float *d, const float *dqs, const uint8_t *blk, const uint32_t *sz,
                          float *y, int64_t N, int64_t K, int64_t G, int64_t n0) {
    const __m512i lanes0 = _mm512_set_epi32(
        0x6f4f2f0f, 0x6e4e2e0e, 0x6d4d2d0d, 0x6c4c2c0c, 0x6b4b2b0b, 0x6a4a2a0a, 0x69492909, 0x68482808, 0x67472707,
        0x66462606, 0x65452505, 0x64442404, 0x63432303, 0x62422202, 0x61412101, 0x60402000);
    const __m512i lanes1 = _mm512_add_epi8(lanes0, _mm512_set1_epi8(16));
    const __m512i low = _mm512_set1_epi8(15);
    floats out[4] = {{0}, {0}, {0}, {0}};
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        floats cq[4] = {{0}, {0}, {0}, {0}};
        float dq = 0;
        for (int64_t b0 = g0; b0 < g0 + G; b0 += QBLOCK) {
            __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                              _mm512_setzero_si512()};
            for (int64_t k = b0; k < b0 + QBLOCK; k += 4) {
                int32_t four;
                memcpy(&four, q + k, sizeof(four));
                const __m512i xq = _mm512_set1_epi32(four);
                _mm_prefetch((const char *)(blk + k * 32 + CODES_AHEAD), _MM_HINT_T0);
                _mm_prefetch((const char *)(blk + k * 32 + CODES_AHEAD + 64), _MM_HINT_T0);
                const __m512i a = _mm512_loadu_si512(blk + k * 32), b = _mm512_loadu_si512(blk + k * 32 + 64);
                const __m512i v0 = _mm512_permutex2var_epi8(a, lanes0, b);
                const __m512i v1 = _mm512_permutex2var_epi8(a, lanes1, b);
                acc[0] = _mm512_dpbusd_epi32(acc[0], _mm512_and_si512(v0, low), xq);
                acc[1] = _mm512_dpbusd_epi32(acc[1], _mm512_and_si512(v1, low), xq);
                acc[2] = _mm512_dpbusd_epi32(acc[2], v0, xq);
                acc[3] = _mm512_dpbusd_epi32(acc[3], v1, xq);
            }
            acc[2] = _mm512_srai_epi32(_mm512_sub_epi32(acc[2], acc[0]), 4);
            acc[3] = _mm512_srai_epi32(_mm512_sub_epi32(acc[3], acc[1]), 4);
            const float db = d[b0 / QBLOCK];
            for (int i = 0; i < 4; i++) cq[i] += (floats)_mm512_cvtepi32_ps(acc[i]) * db;
            dq += dqs[b0 / QBLOCK];
        }
        const uint32_t *group = sz + (g0 / G) * N + n0;
        for (int i = 0; i < 4; i++) /* the next block's scales */
            _mm_prefetch((const char *)(group + 64 + i * LANES), _MM_HINT_T0);
        for (int i = 0; i < 4; i++) {
            words w;
            memcpy(&w, group + i * LANES, sizeof(w));
            const floats s = from_words(w << 16), z = from_words(w & 0xFFFF0000u);
            out[i] += s * cq[i] + (z - 8 * s) * dq;
        }
    }
    memcpy(y + n0, out, sizeof(out));
}
#endif

/* 1 where the int4 product quantises its rows to int8 (int4_block_q8: this CPU has AVX-512 VNNI and VBMI), else 0
   (int4_block: float32 rows). */
int litkv_int8_activations(void) {
#ifdef INT8_ACTIVATIONS
    return 1;
#else
    return 0;
#endif
}

/* Returns 1 (nothing written) where N is not a multiple of 64, G not a multiple of 32 dividing K, or R not in
   1 .. 8, else 0. */
int litkv_int4_rows(const float *x, const uint8_t *packed, const uint32_t *sz, float *y, int64_t R, int64_t N,
                    int64_t K, int64_t G) {
    if (N % 64 != 0 || G < 32 || G % 32 != 0 || K % G != 0 || R < 1 || R > 8) return 1;
#ifdef INT8_ACTIVATIONS
    int8_t *q = aligned(R * K);
    float *d = aligned(2 * R * (K / QBLOCK) * sizeof(float)), *dq = d + R * (K / QBLOCK);
    if (!q || !d) {
        free(q);
        free(d);
        return 1;
    }
    for (int64_t r = 0; r < R; r++) quantize_row(x + r * K, q + r * K, d + r * (K / QBLOCK), dq + r * (K / QBLOCK), K);
    for (int64_t n0 = 0; n0 < N; n0 += 64)
        for (int64_t r = 0; r < R; r++)
            int4_block_q8(q + r * K, d + r * (K / QBLOCK), dq + r * (K / QBLOCK), packed + n0 * K / 2, sz, y + r * N,
                          N, K, G, n0);
    free(q);
    free(d);
#else
    for (int64_t n0 = 0; n0 < N; n0 += 64)
        for (int64_t r = 0; r < R; r++)
            int4_block(x + r * K, packed + n0 * K / 2, sz, y + r * N, N, K, G, n0);
#endif
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

/* exp(v) per lane within a few units in the last place (Cephes' polynomial after a split by powers of 2), v clamped
   to where the power of 2 is a normal float. */
static inline floats exp_lanes(floats v) {
    const ints low = v < -87.0f, high = v > 88.0f;
    const ints lowest = (ints)((floats){0} - 87.0f), highest = (ints)((floats){0} + 88.0f);
    v = (floats)(((ints)v & ~(low | high)) | (lowest & low) | (highest & high));
    const floats n = (v * 1.44269504f + 12582912.0f) - 12582912.0f; /* to the nearest integer */
    const floats r = (v - n * 0.693359375f) + n * 2.12194440e-4f;
    floats p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const ints bits = (__builtin_convertvector(n, ints) + 127) << 23;
    return (p * r * r + r + 1.0f) * (floats)bits;
}

/* m (R, C) = x / sqrt(mean(x^2) + eps) * w, row by row (C a multiple of LANES). */
static void rms_norm(const float *x, const float *w, float eps, float *m, int64_t R, int64_t C) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * C;
        floats ss = {0};
        for (int64_t i = 0; i < C; i += LANES) {
            floats v;
            memcpy(&v, xr + i, sizeof(v));
            ss += v * v;
        }
        const float norm = 1.0f / sqrtf(total(ss) / (float)C + eps);
        for (int64_t i = 0; i < C; i++) m[r * C + i] = xr[i] * norm * w[i];
    }
}

/* y (R, C) = x + proj(silu(fc1(m)) * fc2(m)), m = x / sqrt(mean(x^2) + eps) * w: a decode step's RMSNorm and
   SwiGLU MLP with its residual, fc1 and fc2 (H, C) and proj (C, H) int4 layers as litkv_int4_rows takes them. With
   attn (R, A) not NULL, x is first replaced by x + attn @ Wa^T (pa, sa: the attention's output projection (C, A)).
   Returns 1 (nothing written) where a product would, or memory is short, else 0. */
int litkv_int4_mlp(const float *attn, const uint8_t *pa, const uint32_t *sa, int64_t A, const float *x, const float *w,
                   float eps, const uint8_t *p1, const uint32_t *s1, const uint8_t *p2, const uint32_t *s2,
                   const uint8_t *p3, const uint32_t *s3, float *y, int64_t R, int64_t C, int64_t H, int64_t G) {
    if (C % 64 != 0 || H % 64 != 0 || G < 32 || G % 32 != 0 || C % G != 0 || H % G != 0 || R < 1 || R > 8)
        return 1;
    float *m = aligned((2 * R * C + 2 * R * H) * sizeof(float)), *a = m + R * C, *b = a + R * H, *h = b + R * H;
    if (!m) return 1;
    if (attn) {
        if (litkv_int4_rows(attn, pa, sa, h, R, C, A, G)) {
            free(m);
            return 1;
        }
        for (int64_t i = 0; i < R * C; i++) h[i] += x[i];
        x = h;
    }
    rms_norm(x, w, eps, m, R, C);
    int failed = litkv_int4_rows(m, p1, s1, a, R, H, C, G) || litkv_int4_rows(m, p2, s2, b, R, H, C, G);
    if (!failed) {
        for (int64_t i = 0; i < R * H; i += LANES) { /* silu(a) * b */
            floats u, v;
            memcpy(&u, a + i, sizeof(u));
            memcpy(&v, b + i, sizeof(v));
            u = u / (1.0f + exp_lanes(-u)) * v;
            memcpy(a + i, &u, sizeof(u));
        }
        failed = litkv_int4_rows(a, p3, s3, m, R, C, H, G);
    }
    if (!failed)
        for (int64_t i = 0; i < R * C; i++) y[i] = x[i] + m[i];
    free(m);
    return failed;
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

#ifdef INT8_ACTIVATIONS
/* Outputs n0 .. n0 + M - 1 of one int8 row q (K a multiple of 64) by integer dot products: per 64 inputs, each
   output's 64 codes (as unsigned bytes c + 128) times the row's 64 codes in int32 sums of four (vpdpbusd, started
   at -128 * the row's four codes: exact), those sums times their blocks' scales dl (16 lanes: 8 of one block's d, 8
   of the next one's) into float32 sums; then the LANES sums added up in a fixed tree, times s[n]. */
static inline void int8_outputs_q8(const int8_t *q, const float *dl, const int32_t *base, const int8_t *codes,
                                   const uint16_t *scales, float *y, int64_t K, int64_t n0, const int M) {
    floats acc[ROWS];
    for (int i = 0; i < M; i++) acc[i] = (floats){0};
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t k = 0; k < K; k += 64) {
        const __m512i qv = _mm512_loadu_si512(q + k), start = _mm512_loadu_si512(base + k / 4);
        floats dv;
        memcpy(&dv, dl + k / 4, sizeof(dv));
        for (int i = 0; i < M; i++) {
            _mm_prefetch((const char *)(codes + (n0 + i + ROWS) * K + k), _MM_HINT_T0); /* the next outputs' */
            const __m512i c = _mm512_xor_si512(_mm512_loadu_si512(codes + (n0 + i) * K + k), flip);
            acc[i] += (floats)_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, c, qv)) * dv;
        }
    }
    for (int i = 0; i < M; i++) y[n0 + i] = total(acc[i]) * from_bf16(scales[n0 + i]);
}

/* Row x (K, a multiple of 64) prepared for int8_outputs_q8: q and d (quantize_row), dl (K / 4) each block's d on
   its 8 lanes, base (K / 4) -128 * the sum of each lane's four codes. Returns 1 where it cannot allocate. */
static int int8_prepare(const float *x, int8_t *q, float *dl, int32_t *base, int64_t K) {
    float *d = aligned(2 * (K / QBLOCK) * sizeof(float));
    if (!d) return 1;
    quantize_row(x, q, d, d + K / QBLOCK, K);
    for (int64_t j = 0; j < K / 4; j++) {
        dl[j] = d[(j * 4) / QBLOCK];
        base[j] = -128 * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
    }
    free(d);
    return 0;
}
#endif

/* Returns 1 (nothing written) where K is not a multiple of LANES or R not in 1 .. 8, else 0. */
int litkv_int8_rows(const float *x, const int8_t *codes, const uint16_t *scales, float *y, int64_t R, int64_t N,
                    int64_t K) {
    if (K % LANES != 0 || R < 1 || R > 8) return 1;
#ifdef INT8_ACTIVATIONS
    if (K % 64 == 0) {
        int8_t *q = aligned(R * K);
        float *dl = aligned(R * (K / 4) * sizeof(float));
        int32_t *base = aligned(R * (K / 4) * sizeof(int32_t));
        int failed = !q || !dl || !base;
        for (int64_t r = 0; r < R && !failed; r++)
            failed = int8_prepare(x + r * K, q + r * K, dl + r * (K / 4), base + r * (K / 4), K);
        int64_t n0 = 0;
        for (; n0 + ROWS <= N && !failed; n0 += ROWS)
            for (int64_t r = 0; r < R; r++)
                int8_outputs_q8(q + r * K, dl + r * (K / 4), base + r * (K / 4), codes, scales, y + r * N, K, n0, ROWS);
        for (; n0 < N && !failed; n0++)
            for (int64_t r = 0; r < R; r++)
                int8_outputs_q8(q + r * K, dl + r * (K / 4), base + r * (K / 4), codes, scales, y + r * N, K, n0, 1);
        free(q);
        free(dl);
        free(base);
        return failed;
    }
#endif
    int64_t n0 = 0;
    for (; n0 + ROWS <= N; n0 += ROWS)
        for (int64_t r = 0; r < R; r++) int8_outputs(x + r * K, codes, scales, y + r * N, K, n0, ROWS);
    for (; n0 < N; n0++)
        for (int64_t r = 0; r < R; r++) int8_outputs(x + r * K, codes, scales, y + r * N, K, n0, 1);
    return 0;
}

/* Head `src` (HS) rotated into `dst` by RoPE over half-split pairs: dst[i] = src[i] c[i] - src[i + h] s[i],
   dst[i + h] = src[i + h] c[i + h] + src[i] s[i + h], h = HS / 2. */
static void rope_head(const float *src, const float *c, const float *s, float *dst, int64_t HS) {
    const int64_t h = HS / 2;
    for (int64_t i = 0; i < h; i++) {
        dst[i] = src[i] * c[i] - src[i + h] * s[i];
        dst[i + h] = src[i + h] * c[i + h] + src[i] * s[i + h];
    }
}

/* A decode step's attention inputs: m (B * T, C) = RMSNorm(x) * w as litkv_int4_mlp's, qkv = m @ W^T by
   litkv_int4_rows (N = (NH + 2 NG) * HS outputs: NH query heads, NG key heads, NG value heads), then the queries q
   (B, NH, T, HS) and keys k (B, NG, T, HS) rotated by RoPE (rope_head; cos and sin (CB, T, HS), CB 1 or B) and the
   values v (B, NG, T, HS). Returns 1 (nothing written) where the product would, HS is odd, or memory is short, else
   0. */
int litkv_int4_qkv(const float *x, const float *w, float eps, const uint8_t *packed, const uint32_t *sz,
                   const float *cos, const float *sin, float *m, float *q, float *k, float *v, int64_t B, int64_t T,
                   int64_t CB, int64_t C, int64_t NH, int64_t NG, int64_t HS, int64_t G) {
    const int64_t R = B * T, N = (NH + 2 * NG) * HS;
    if (C % LANES != 0 || HS % 2 != 0 || (CB != 1 && CB != B) || R < 1 || R > 8) return 1;
    float *normed = aligned((R * C + R * N) * sizeof(float)), *qkv = normed + R * C;
    if (!normed) return 1;
    rms_norm(x, w, eps, normed, R, C);
    if (litkv_int4_rows(normed, packed, sz, qkv, R, N, C, G)) {
        free(normed);
        return 1;
    }
    memcpy(m, normed, R * C * sizeof(float));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const float *row = qkv + (b * T + t) * N;
            const float *c = cos + ((CB == 1 ? 0 : b) * T + t) * HS, *s = sin + ((CB == 1 ? 0 : b) * T + t) * HS;
            for (int64_t h = 0; h < NH; h++) rope_head(row + h * HS, c, s, q + ((b * NH + h) * T + t) * HS, HS);
            for (int64_t g = 0; g < NG; g++) {
                rope_head(row + (NH + g) * HS, c, s, k + ((b * NG + g) * T + t) * HS, HS);
                memcpy(v + ((b * NG + g) * T + t) * HS, row + (NH + NG + g) * HS, HS * sizeof(float));
            }
        }
    free(normed);
    return 0;
}
