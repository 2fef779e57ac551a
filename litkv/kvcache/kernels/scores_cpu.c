/* Score policies' per-candidate arithmetic on the CPU: KeyDiff's cosines, and SnapKV's one-query attention.

Built at run time by litkv/kvcache/kernels/cpu_scores.py (litkv.core.c_build), once per head size HEAD (a -D
define). Keys are (B, G, N, HEAD) float32 with strides sb, sg, sn in numbers (the last axis contiguous); positions
(B, G, N) int64 and out (B, G, N) float32 are contiguous. Per (row, KV head):

litkv_keydiff_scores (litkv.kvcache.keydiff's rule), with |k| = max(sqrt(k . k), 1e-12):

    anchor  = sum over the candidates with a position >= 0 of (1 / |k|) / count * k   (count: how many, at least 1)
    out[i]  = -(k_i . anchor) / (|k_i| * max(|anchor|, 1e-12)),

the anchor held in registers, the keys read twice (the anchor, then the products).

litkv_snapkv_weights (litkv.kvcache.snapkv's decode step): queries q (B, G, M, HEAD) contiguous, one per query
head, and the row's query position qpos[b]; each query's softmax of scale * (q . k_i) over the candidates at
positions 0..qpos[b], summed over the M query heads in order; 0 everywhere for a pad query (qpos < 0). `scratch`
holds M * N floats (the logits; the keys are read once).

Each product is 16 partial sums over the vector, added in a fixed order, and the rest one by one; exponentials
from exp_cpu.h's polynomial (relative error below 2e-7). A (row, head)'s numbers do not depend on the others.
Everything runs on the calling thread.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_cpu.h"

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

void litkv_keydiff_scores(const float *keys, const int64_t *positions, float *out, int64_t b, int64_t g, int64_t n,
                          int64_t sb, int64_t sg, int64_t sn) {
    for (int64_t r = 0; r < b; r++)
        for (int64_t h = 0; h < g; h++)
            head(keys + r * sb + h * sg, sn, positions + (r * g + h) * n, out + (r * g + h) * n, n);
}

/* One (row, KV head) of litkv_snapkv_weights: queries q (M, HEAD), keys k (n, HEAD) sn apart, positions p. */
static void window_head(const float *q, int64_t m, const float *k, int64_t sn, const int64_t *p, int64_t qpos,
                        float scale, float *logits, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = 0.0f;
        const int seen = p[i] >= 0 && p[i] <= qpos;
        for (int64_t h = 0; h < m; h++)
            logits[h * n + i] = seen ? dot(q + h * HEAD, k + i * sn, HEAD) * scale : -INFINITY;
    }
    for (int64_t h = 0; h < m; h++) {
        float *l = logits + h * n, top = -INFINITY, sum = 0.0f;
        for (int64_t i = 0; i < n; i++)
            top = l[i] > top ? l[i] : top;
        if (top == -INFINITY) /* nothing to see: weights 0 (the PyTorch path's NaN turned to 0) */
            continue;
        for (int64_t i = 0; i < n; i++) {
            l[i] = exp_nonpositive(l[i] - top);
            sum += l[i];
        }
        for (int64_t i = 0; i < n; i++)
            out[i] += l[i] / sum;
    }
}

void litkv_snapkv_weights(const float *q, const float *keys, const int64_t *positions, const int64_t *qpos,
                          float *scratch, float *out, int64_t b, int64_t g, int64_t m, int64_t n, int64_t sb,
                          int64_t sg, int64_t sn, float scale) {
    for (int64_t r = 0; r < b; r++)
        for (int64_t h = 0; h < g; h++) {
            const int64_t row = r * g + h;
            window_head(q + row * m * HEAD, m, keys + r * sb + h * sg, sn, positions + row * n, qpos[r], scale,
                        scratch, out + row * n, n);
        }
}
