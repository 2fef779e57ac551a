/* A score policy's per-candidate arithmetic on the CPU: KeyDiff's cosine of each key to the anchor.

Built at run time by litkv/kvcache/kernels/cpu_scores.py (litkv.core.c_build), once per head size HEAD (a -D
define). litkv_keydiff_scores reads keys (B, G, N, HEAD) float32 (strides sb, sg, sn in numbers, the last axis
contiguous) and positions (B, G, N) int64 contiguous, and writes out (B, G, N) float32 contiguous: per (row, KV
head), with |k| = max(sqrt(k . k), 1e-12),

    anchor  = sum over the candidates with a position >= 0 of (1 / |k|) / count * k   (count: how many, at least 1)
    out[i]  = -(k_i . anchor) / (|k_i| * max(|anchor|, 1e-12)),

litkv.kvcache.keydiff's rule. Each product is 16 partial sums over the vector, added in a fixed order, and the
rest one by one; the anchor is held in registers; the keys are read twice (the anchor, then the products). A (row, head)'s numbers do not depend on
the others. Everything runs on the calling thread.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

typedef float floats __attribute__((vector_size(4 * LANES)));
typedef float halves __attribute__((vector_size(2 * LANES)));
typedef float quarters __attribute__((vector_size(LANES)));

/* The sum of a vector's numbers: its halves added, then their halves, then the last four in pairs. */
static inline float total(floats v) {
    halves lo, hi;
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    halves h = lo + hi;
    quarters a, b;
    memcpy(&a, &h, sizeof a);
    memcpy(&b, (const char *)&h + sizeof a, sizeof b);
    quarters q = a + b;
    return (q[0] + q[2]) + (q[1] + q[3]);
}

static float dot(const float *a, const float *b, int64_t d) {
    floats sums = {0};
    int64_t j = 0;
    for (; j + LANES <= d; j += LANES) {
        floats x, y;
        memcpy(&x, a + j, sizeof x);
        memcpy(&y, b + j, sizeof y);
        sums += x * y;
    }
    float rest = total(sums);
    for (; j < d; j++)
        rest += a[j] * b[j];
    return rest;
}

static inline float at_least_tiny(float x) { return x > 1e-12f ? x : 1e-12f; } /* torch's clamp(min=1e-12) */

/* One (row, KV head): keys k (n, HEAD) with rows sn numbers apart, positions p (n,), scores into out (n,). */
static void head(const float *k, int64_t sn, const int64_t *p, float *out, int64_t n) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++)
        count += p[i] >= 0;
    const float share = (float)(count > 0 ? count : 1);
    float anchor[HEAD] = {0};
    for (int64_t i = 0; i < n; i++) {
        const float *ki = k + i * sn;
        const float norm = at_least_tiny(sqrtf(dot(ki, ki, HEAD)));
        out[i] = norm;
        const float weight = p[i] < 0 ? 0.0f : (1.0f / norm) / share;
        for (int64_t j = 0; j < HEAD; j++)
            anchor[j] += weight * ki[j];
    }
    const float anchor_norm = at_least_tiny(sqrtf(dot(anchor, anchor, HEAD)));
    for (int64_t i = 0; i < n; i++)
        out[i] = -dot(k + i * sn, anchor, HEAD) / (out[i] * anchor_norm);
}

int litkv_keydiff_scores(const float *keys, const int64_t *positions, float *out, int64_t b, int64_t g, int64_t n,
                         int64_t sb, int64_t sg, int64_t sn) {
    for (int64_t r = 0; r < b; r++)
        for (int64_t h = 0; h < g; h++)
            head(keys + r * sb + h * sg, sn, positions + (r * g + h) * n, out + (r * g + h) * n, n);
    return 0;
}
