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
holds M * N floats (the logits; the keys are read once). Each softmax's maximum and sum run in 16 interleaved parts
(vectors of exp_cpu.h), and its numerators are multiplied by the sum's reciprocal.

litkv_snapkv_pool (litkv.kvcache.snapkv's `_kept_scores`): per row of N candidates, the average pool of width
`kernel` of the weights over neighbours in token order (the candidates sorted by position, then slot; zeros past
the ends), added from the window's first number to its last and divided by `kernel`, as `snapkv.window_mean` adds
them (the same bits); 0 where the position is negative; then the larger of it and the row's running maximum
`best` (NB numbers, 0 past them; NaN where either is NaN, as torch.maximum). The order is found by an insertion
sort of `order` (a permutation of 0..N-1 per row, in and out), a merge sort where that would take more than 4 N
moves: left as the last call sorted it, a decode step's order is nearly sorted (one slot took the newest token)
and costs about 2 N moves; any permutation gives the same result. Returns 1 where its scratch cannot be allocated
(nothing written), else 0.

Each product is 16 partial sums over the vector, added in a fixed order, and the rest one by one; exponentials
from exp_cpu.h's polynomial (relative error below 2e-7). A (row, head)'s numbers do not depend on the others.
Everything runs on the calling thread.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* The largest of x[0..n) (NaN left out), in 16 interleaved parts (vectors of exp_cpu.h). */
static inline float largest(const float *x, int64_t n) {
    exp_floats lanes = (exp_floats){0} - INFINITY, v;
    float top = -INFINITY;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        memcpy(&v, x + i, sizeof(v));
        lanes = exp_select(v > lanes, v, lanes);
    }
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    const float most = largest_lane(lanes);
    return most > top ? most : top;
}

/* x[i] = e^(x[i] - top) for i < n; returns their sum, in 16 interleaved parts (then the rest, then the parts in
   order): exp16_nonpositive on vectors of 16, exp_nonpositive (the same arithmetic) on the rest. */
static inline float exponentials(float *x, int64_t n, float top) {
    exp_floats lanes = {0}, v;
    float sum = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        memcpy(&v, x + i, sizeof(v));
        v = exp16_nonpositive(v - top);
        memcpy(x + i, &v, sizeof(v));
        lanes += v;
    }
    for (; i < n; i++) {
        x[i] = exp_nonpositive(x[i] - top);
        sum += x[i];
    }
    for (int l = 0; l < 16; l++) sum += lanes[l];
    return sum;
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
        float *l = logits + h * n;
        const float top = largest(l, n);
        if (top == -INFINITY) /* nothing to see: weights 0 (the PyTorch path's NaN turned to 0) */
            continue;
        const float inverse = 1.0f / exponentials(l, n, top);
        for (int64_t i = 0; i < n; i++)
            out[i] += l[i] * inverse;
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

/* Whether slot a's candidate comes before slot b's in token order: (pos, slot) ascending. */
static inline int before(const int64_t *pos, int32_t a, int32_t b) {
    return pos[a] < pos[b] || (pos[a] == pos[b] && a < b);
}

/* order[0..n) (a permutation of 0..n-1) sorted by (pos[slot], slot), ascending: an insertion sort while it has made
   at most 4 n moves (a nearly sorted order costs about 2 n), then a merge sort of what is left (n log n), through
   spare (n numbers). */
static void sort_by_position(int32_t *order, const int64_t *pos, int64_t n, int32_t *spare) {
    int64_t budget = 4 * n, i = 1;
    for (; i < n && budget >= 0; i++) {
        const int32_t slot = order[i];
        int64_t j = i;
        for (; j > 0 && before(pos, slot, order[j - 1]); j--) order[j] = order[j - 1];
        order[j] = slot;
        budget -= i - j;
    }
    if (i >= n) return;
    int32_t *from = order, *to = spare; /* bottom-up merges of runs of `width` */
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            const int64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi) to[k++] = before(pos, from[b], from[a]) ? from[b++] : from[a++];
            while (a < mid) to[k++] = from[a++];
            while (b < hi) to[k++] = from[b++];
        }
        int32_t *swap = from;
        from = to, to = swap;
    }
    if (from != order) memcpy(order, from, (size_t)n * sizeof(int32_t));
}

int litkv_snapkv_pool(const float *weights, const int64_t *positions, const float *best, int64_t nb, int32_t *order,
                      float *out, int64_t rows, int64_t n, int64_t kernel) {
    const int64_t half = kernel / 2;
    /* a row's weights in token order with zeros around, and their pooled sums */
    float *sorted = calloc((size_t)(3 * n + 2 * half), sizeof(float)), *pooled = sorted + n + 2 * half;
    if (sorted == NULL) return 1;
    int32_t *spare = (int32_t *)(pooled + n); /* the merge sort's */
    for (int64_t row = 0; row < rows; row++) {
        const float *w = weights + row * n;
        const int64_t *p = positions + row * n;
        int32_t *o = order + row * n;
        float *y = out + row * n;
        sort_by_position(o, p, n, spare);
        for (int64_t r = 0; r < n; r++) sorted[half + r] = w[o[r]];
        for (int64_t r = 0; r < n; r++) pooled[r] = sorted[r];
        for (int64_t i = 1; i < kernel; i++) /* the window's numbers added in order, every window at once */
            for (int64_t r = 0; r < n; r++) pooled[r] += sorted[r + i];
        for (int64_t r = 0; r < n; r++) {
            const int32_t slot = o[r];
            float v = p[slot] < 0 ? 0.0f : pooled[r] / (float)kernel;
            if (best != NULL) {
                const float b = slot < nb ? best[row * nb + slot] : 0.0f;
                v = isnan(b) || isnan(v) ? NAN : b > v ? b : v;
            }
            y[slot] = v;
        }
    }
    free(sorted);
    return 0;
}
