/* Score policies' per-candidate arithmetic on the CPU: KeyDiff's cosines, SnapKV's one-query attention and pool,
   Expected Attention's scores and statistics.

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

litkv_expected_scores and litkv_expected_stats (litkv.kvcache.expected_attention; HEAD a multiple of 16, the
caller's check): below, beside their code.

Each product is 16 partial sums over the vector, added in a fixed order, and the rest one by one; exponentials
from exp_cpu.h's polynomial (relative error below 2e-7). A (row, head)'s numbers do not depend on the others.
Everything runs on the calling thread.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_cpu.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16
#define UNPACK(...) __VA_ARGS__
#define SHUFFLE(a, b, INDICES) __builtin_shufflevector(a, b, UNPACK INDICES)
#define H8_LO (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#define H8_HI (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
#define Q4_LO (0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define Q4_HI (4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)
#define P2_LO (0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
#define P2_HI (2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31)
#define EVEN (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
#define ODD (1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)

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

/* The totals of 16 vectors in one: lane r = total(x[r]), its numbers added in total()'s order (each stage adds a
   lane to the one 8, then 4, then 2, then 1 away), so each has the bits of total(). */
static inline floats totals16(const floats x[LANES]) {
    floats h[8], q[4], p[2];
    for (int r = 0; r < 8; r++) /* lanes 0..7: x[2r]'s j + (j + 8); 8..15: x[2r + 1]'s */
        h[r] = SHUFFLE(x[2 * r], x[2 * r + 1], H8_LO) + SHUFFLE(x[2 * r], x[2 * r + 1], H8_HI);
    for (int r = 0; r < 4; r++) /* four lanes per slot: j + (j + 4) */
        q[r] = SHUFFLE(h[2 * r], h[2 * r + 1], Q4_LO) + SHUFFLE(h[2 * r], h[2 * r + 1], Q4_HI);
    for (int r = 0; r < 2; r++) /* two lanes per slot: q0 + q2, q1 + q3 */
        p[r] = SHUFFLE(q[2 * r], q[2 * r + 1], P2_LO) + SHUFFLE(q[2 * r], q[2 * r + 1], P2_HI);
    return SHUFFLE(p[0], p[1], EVEN) + SHUFFLE(p[0], p[1], ODD);
}

enum { WHOLE = HEAD / LANES }; /* whole vectors in a key; dot() adds the rest one by one */

/* Lane l < m: dot(key l, with) (keys' rows sn apart; with = NULL: the key itself), dot()'s bits; 0 past m. */
static inline floats block_dots(const float *k, int64_t sn, int64_t m, const float *with) {
    floats x[LANES];
    for (int64_t l = 0; l < LANES; l++) {
        floats sums = {0};
        for (int64_t j = 0; l < m && j < WHOLE; j++) {
            floats a, b;
            memcpy(&a, k + l * sn + j * LANES, sizeof a);
            memcpy(&b, (with ? with : k + l * sn) + j * LANES, sizeof b);
            sums += a * b;
        }
        x[l] = sums;
    }
    floats dots = totals16(x);
    for (int64_t l = 0; WHOLE * LANES < HEAD && l < m; l++) {
        const float *a = k + l * sn, *b = with ? with : a;
        float rest = dots[l];
        for (int64_t j = WHOLE * LANES; j < HEAD; j++) rest += a[j] * b[j];
        dots[l] = rest;
    }
    return dots;
}

/* sqrtf of each lane (one instruction with AVX-512; the same correctly rounded numbers either way). */
static inline floats square_roots(floats x) {
#ifdef __AVX512F__
    __m512 v;
    memcpy(&v, &x, sizeof v);
    v = _mm512_sqrt_ps(v);
    memcpy(&x, &v, sizeof x);
#else
    for (int l = 0; l < LANES; l++) x[l] = sqrtf(x[l]);
#endif
    return x;
}

/* One (row, KV head): keys k (n, HEAD) with rows sn numbers apart, positions p (n,), scores into out (n,). Sixteen
   keys at a time: their norms and products with the anchor side by side in a vector (each as dot() sums it), the
   anchor's sums in registers, added key after key. */
static void head(const float *k, int64_t sn, const int64_t *p, float *out, int64_t n) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++)
        count += p[i] >= 0;
    const float share = (float)(count > 0 ? count : 1);
    floats sums[WHOLE + 1] = {{0}}; /* the anchor: whole vectors, then the rest's numbers */
    for (int64_t i0 = 0; i0 < n; i0 += LANES) {
        const int64_t m = n - i0 < LANES ? n - i0 : LANES;
        const floats squares = block_dots(k + i0 * sn, sn, m, NULL);
        floats norms = {0}, weights;
        const floats roots = square_roots(squares);
        for (int64_t l = 0; l < m; l++) norms[l] = at_least_tiny(roots[l]);
        weights = ((floats){0} + 1.0f) / norms / share;
        memcpy(out + i0, &norms, m * sizeof(float));
        for (int64_t l = 0; l < m; l++) {
            const float *ki = k + (i0 + l) * sn, weight = p[i0 + l] < 0 ? 0.0f : weights[l];
            for (int64_t j = 0; j < WHOLE; j++) {
                floats v;
                memcpy(&v, ki + j * LANES, sizeof v);
                sums[j] += weight * v;
            }
            for (int64_t j = WHOLE * LANES; j < HEAD; j++) sums[WHOLE][j % LANES] += weight * ki[j];
        }
    }
    _Alignas(64) float anchor[HEAD];
    for (int64_t j = 0; j < HEAD; j++) anchor[j] = sums[j / LANES][j % LANES];
    const float anchor_norm = at_least_tiny(sqrtf(dot(anchor, anchor, HEAD)));
    for (int64_t i0 = 0; i0 < n; i0 += LANES) {
        const int64_t m = n - i0 < LANES ? n - i0 : LANES;
        floats norms = {0};
        memcpy(&norms, out + i0, m * sizeof(float));
        const floats scores = -block_dots(k + i0 * sn, sn, m, anchor) / (norms * anchor_norm);
        memcpy(out + i0, &scores, m * sizeof(float));
    }
}

void litkv_keydiff_scores(const float *keys, const int64_t *positions, float *out, int64_t b, int64_t g, int64_t n,
                          int64_t sb, int64_t sg, int64_t sn) {
    for (int64_t r = 0; r < b; r++)
        for (int64_t h = 0; h < g; h++)
            head(keys + r * sb + h * sg, sn, positions + (r * g + h) * n, out + (r * g + h) * n, n);
}

/* litkv_keydiff_scores of every layer of a decode step: layer l's keys at key_addresses[l] (every layer's of the
   strides sb, sg, sn), its positions and scores at l * b * g * n in positions and out. */
void litkv_keydiff_scores_layers(const int64_t *key_addresses, const int64_t *positions, float *out, int64_t layers,
                                 int64_t b, int64_t g, int64_t n, int64_t sb, int64_t sg, int64_t sn) {
    for (int64_t l = 0; l < layers; l++)
        litkv_keydiff_scores((const float *)(intptr_t)key_addresses[l], positions + l * b * g * n,
                             out + l * b * g * n, b, g, n, sb, sg, sn);
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

/* litkv_snapkv_weights of `layers` layers of one decode step in one call: layer l's queries at q + l B G M HEAD,
   its keys at the address key_addresses[l] (every layer's keys of the same strides), its positions at positions +
   l B G N and its weights into out + l B G N; qpos shared (one call's queries). */
void litkv_snapkv_weights_layers(const float *q, const int64_t *key_addresses, const int64_t *positions,
                                 const int64_t *qpos, float *scratch, float *out, int64_t layers, int64_t b, int64_t g,
                                 int64_t m, int64_t n, int64_t sb, int64_t sg, int64_t sn, float scale) {
    for (int64_t l = 0; l < layers; l++) {
        const float *keys = (const float *)(intptr_t)key_addresses[l];
        const int64_t at = l * b * g * n; /* layer l's positions and weights */
        litkv_snapkv_weights(q + l * b * g * m * HEAD, keys, positions + at, qpos, scratch, out + at, b, g, m, n, sb,
                             sg, sn, scale);
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

/* ---- litkv_expected_scores: expected attention (litkv.kvcache.expected_attention's `expected`) ---- */

#define BLOCK 64              /* slots per block of the quadratic forms: VECS vectors of 16 */
#define VECS (BLOCK / LANES)
#define LO1 (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
#define HI1 (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31)
#define LO2 (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
#define HI2 (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31)
#define LO4 (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
#define HI4 (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31)
#define LO8 (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#define HI8 (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
#define STAGE(x, H, LO, HI)                                                                                     \
    for (int r = 0; r < LANES; r++)                                                                             \
        if (!(r & H)) {                                                                                         \
            const floats a = x[r], b = x[r + H];                                                                \
            x[r] = SHUFFLE(a, b, LO), x[r + H] = SHUFFLE(a, b, HI);                                             \
        }

/* x[r][c] -> x[c][r] for a 16 x 16 tile: stage H swaps bit H of the row with bit H of the column, one two-source
   shuffle per row (rows r and r + H give r's numbers at columns without bit H, r + H's at the others). */
static inline void transpose16(floats x[LANES]) {
    STAGE(x, 1, LO1, HI1)
    STAGE(x, 2, LO2, HI2)
    STAGE(x, 4, LO4, HI4)
    STAGE(x, 8, LO8, HI8)
}

/* kt[d][v] = number d of the keys of slots i0 + 16 v + lane (k's rows sn apart; zeros past slot n). */
static void transpose_block(const float *k, int64_t sn, int64_t i0, int64_t n, floats kt[HEAD][VECS]) {
    for (int v = 0; v < VECS; v++)
        for (int d0 = 0; d0 < HEAD; d0 += LANES) {
            floats x[LANES];
            for (int l = 0; l < LANES; l++) {
                const int64_t i = i0 + v * LANES + l;
                if (i < n)
                    memcpy(&x[l], k + i * sn + d0, sizeof(floats));
                else
                    x[l] = (floats){0};
            }
            transpose16(x);
            for (int j = 0; j < LANES; j++) kt[d0 + j][v] = x[j];
        }
}

#define MOST 3 /* query heads whose forms one pass over a block's keys multiplies */

/* Logits m . k + k^T A k of the block's first `vecs` vectors of slots into l[h][0..16 vecs), for `heads` query heads
   (at most MOST): `mean[h]` m (HEAD), `form[h]` (HEAD x HEAD) the upper triangle of A with the off-diagonal numbers
   doubled (zeros below; NULL without the covariance). Per dim a, t = m_a + sum_{b >= a} form[a][b] k_b, then
   l += k_a t: several heads share each load of k_b; a head alone sums b even and odd apart (chains long enough to
   keep the multiply-add units busy). */
static inline __attribute__((always_inline)) void block_logits(const floats kt[HEAD][VECS], const float *const *mean,
                                                               const float *const *form, float (*l)[BLOCK],
                                                               const int heads, const int vecs) {
    floats acc[MOST][VECS];
    for (int h = 0; h < heads; h++)
        for (int v = 0; v < vecs; v++) acc[h][v] = (floats){0};
    for (int a = 0; a < HEAD; a++) {
        floats t[MOST][VECS], odd[VECS];
        for (int h = 0; h < heads; h++)
            for (int v = 0; v < vecs; v++) t[h][v] = (floats){0} + mean[h][a];
        if (form[0] != NULL && heads == 1) {
            const float *row = form[0] + a * HEAD;
            for (int v = 0; v < vecs; v++) odd[v] = (floats){0};
            for (int b = a & ~1; b < HEAD; b += 2)
                for (int v = 0; v < vecs; v++) t[0][v] += row[b] * kt[b][v], odd[v] += row[b + 1] * kt[b + 1][v];
            for (int v = 0; v < vecs; v++) t[0][v] += odd[v];
        } else if (form[0] != NULL)
            for (int b = a; b < HEAD; b++)
                for (int h = 0; h < heads; h++) {
                    const float w = form[h][a * HEAD + b];
                    for (int v = 0; v < vecs; v++) t[h][v] += w * kt[b][v];
                }
        for (int h = 0; h < heads; h++)
            for (int v = 0; v < vecs; v++) acc[h][v] += kt[a][v] * t[h][v];
    }
    for (int h = 0; h < heads; h++)
        for (int v = 0; v < vecs; v++) memcpy(l[h] + v * LANES, &acc[h][v], sizeof(floats));
}

/* block_logits of `heads` (1..MOST) heads over a whole block (vecs = VECS) or its first vector (1). */
static void some_logits(const floats kt[HEAD][VECS], const float *const *mean, const float *const *form,
                        float (*l)[BLOCK], int heads, int whole) {
    if (heads == 3)
        whole ? block_logits(kt, mean, form, l, 3, VECS) : block_logits(kt, mean, form, l, 3, 1);
    else if (heads == 2)
        whole ? block_logits(kt, mean, form, l, 2, VECS) : block_logits(kt, mean, form, l, 2, 1);
    else
        whole ? block_logits(kt, mean, form, l, 1, VECS) : block_logits(kt, mean, form, l, 1, 1);
}

/* One (row, query head)'s mean and form (block_logits) from its statistics: s0 the weight, s1 (HEAD) the weighted
   queries, s2 (HEAD x HEAD) their outer products (NULL without the covariance); cs, sn (n_elem) the mean future
   rotation R (sines with their first half negated). mu = s1 / max(s0, 1e-300), mean = R mu / sqrt(HEAD),
   A = R (s2 / total - mu mu^T) R^T / (2 HEAD), in float64, then float32. R x = cos x + sin x rolled by n_elem / 2 on
   the first n_elem numbers (the rest as they are), so R C R^T is two such passes: U = C R^T by rows, then R U. */
static void prepare(double s0, const double *s1, const double *s2, const double *cs, const double *sn, int64_t n_elem,
                    float *mean, float *form) {
    const int64_t half = n_elem / 2;
    _Alignas(64) double c[HEAD], s[HEAD], mu[HEAD], rot[HEAD], crow[HEAD];
    int64_t partner[HEAD];
    const double total = s0 > 1e-300 ? s0 : 1e-300;
    for (int64_t i = 0; i < HEAD; i++) {
        c[i] = i < n_elem ? cs[i] : 1.0, s[i] = i < n_elem ? sn[i] : 0.0, mu[i] = s1[i] / total;
        partner[i] = i < half ? i + half : i < n_elem ? i - half : i;
    }
    for (int64_t i = 0; i < HEAD; i++) rot[i] = c[i] * mu[i] + s[i] * mu[partner[i]];
    for (int64_t i = 0; i < HEAD; i++) mean[i] = (float)(rot[i] / sqrt((double)HEAD));
    if (s2 == NULL) return;
    const double scale = 1.0 / (2.0 * HEAD), share = scale / total;
    _Alignas(64) double u[HEAD][HEAD];
    for (int64_t r = 0; r < HEAD; r++) {
        for (int64_t j = 0; j < HEAD; j++) crow[j] = s2[r * HEAD + j] * share - scale * mu[r] * mu[j];
        for (int64_t j = 0; j < half; j++) u[r][j] = c[j] * crow[j] + s[j] * crow[j + half];
        for (int64_t j = half; j < n_elem; j++) u[r][j] = c[j] * crow[j] + s[j] * crow[j - half];
        for (int64_t j = n_elem; j < HEAD; j++) u[r][j] = crow[j];
    }
    for (int64_t a = 0; a < HEAD; a++) {
        const double ca = c[a], sa = s[a], *ua = u[a], *up = u[partner[a]];
        float *row = form + a * HEAD;
        for (int64_t b = 0; b < a; b++) row[b] = 0.0f;
        row[a] = (float)(ca * ua[a] + sa * up[a]);
        for (int64_t b = a + 1; b < HEAD; b++) row[b] = (float)(2.0 * (ca * ua[b] + sa * up[b]));
    }
}

/* One (row, KV head): keys k and values vals (n, HEAD) ks / vs numbers apart, positions p (n); `heads` the m
   query heads' means and forms (prepare), `logits` m n floats of scratch; scores into out (n). */
static void expected_head(const float *k, int64_t ks, const float *vals, int64_t vs, const int64_t *p, int64_t n,
                          int64_t m, const float *heads_at, int covariance, int64_t n_sink, int vnorm,
                          float epsilon, float *logits, float *out) {
    const int64_t each = HEAD + (covariance ? HEAD * HEAD : 0);
    floats kt[HEAD][VECS];
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        transpose_block(k, ks, i0, n, kt);
        const int64_t vecs = (n - i0 + LANES - 1) / LANES, count = n - i0 < BLOCK ? n - i0 : BLOCK;
        for (int64_t h0 = 0; h0 < m; h0 += MOST) {
            const int heads = m - h0 < MOST ? (int)(m - h0) : MOST;
            const float *mean[MOST], *form[MOST];
            _Alignas(64) float l[MOST][BLOCK];
            for (int h = 0; h < heads; h++)
                mean[h] = heads_at + (h0 + h) * each, form[h] = covariance ? mean[h] + HEAD : NULL;
            if (vecs >= VECS)
                some_logits((const floats(*)[VECS])kt, mean, form, l, heads, 1);
            else
                for (int64_t v = 0; v < vecs; v++) { /* the last block's vectors one by one */
                    floats one[HEAD][VECS];
                    _Alignas(64) float part[MOST][BLOCK];
                    for (int d = 0; d < HEAD; d++) one[d][0] = kt[d][v];
                    some_logits((const floats(*)[VECS])one, mean, form, part, heads, 0);
                    for (int h = 0; h < heads; h++) memcpy(l[h] + v * LANES, part[h], sizeof(floats));
                }
            for (int h = 0; h < heads; h++)
                for (int64_t i = 0; i < count; i++)
                    logits[(h0 + h) * n + i0 + i] = p[i0 + i] < n_sink ? -INFINITY : l[h][i];
        }
    }
    for (int64_t i = 0; i < n; i++) out[i] = 0.0f;
    for (int64_t h = 0; h < m; h++) { /* softmax per query head; none where every slot is hidden or one is NaN */
        float *l = logits + h * n;
        const float top = largest(l, n);
        if (top == -INFINITY || top == INFINITY) continue;
        const float sum = exponentials(l, n, top);
        if (sum != sum) continue;
        for (int64_t i = 0; i < n; i++) out[i] += l[i] / sum;
    }
    for (int64_t i = 0; i < n; i++) {
        out[i] /= (float)m;
        if (vnorm) {
            const float *v = vals + i * vs;
            out[i] = (out[i] + epsilon) * sqrtf(dot(v, v, HEAD));
        }
    }
}

/* The RoPE table's cos and sin (sines with their first half negated) at position p, clamped to the table's rows,
   in float64: tc, ts (rows, n_elem) float32, rows sr numbers apart and numbers se apart. */
static void table_at(const float *tc, const float *ts, int64_t rows, int64_t sr, int64_t se, int64_t p,
                     int64_t n_elem, double *c, double *s) {
    p = p < 0 ? 0 : p >= rows ? rows - 1 : p;
    for (int64_t j = 0; j < n_elem; j++)
        c[j] = tc[p * sr + j * se], s[j] = (j < n_elem / 2 ? -1.0 : 1.0) * (double)ts[p * sr + j * se];
}

void litkv_expected_scores(const float *keys, const float *values, const int64_t *positions, const double *s0,
                           const double *s1, const double *s2, const float *tc, const float *ts, const double *fc,
                           const double *fs, float *scratch, float *out, int64_t b, int64_t g, int64_t m, int64_t n,
                           int64_t n_elem, int64_t rows, int64_t sr, int64_t se, int64_t ksb, int64_t ksg,
                           int64_t ksn, int64_t vsb, int64_t vsg, int64_t vsn, int64_t n_sink, int64_t vnorm,
                           float epsilon) {
    const int64_t each = HEAD + (s2 != NULL ? HEAD * HEAD : 0), hq = g * m;
    float *heads = scratch, *logits = scratch + hq * each;
    _Alignas(64) double cp[HEAD], sp[HEAD], cs[HEAD], sn[HEAD];
    for (int64_t r = 0; r < b; r++) {
        const int64_t *p = positions + r * g * n;
        int64_t newest = INT64_MIN; /* the mean rotation of the positions after the row's newest token */
        for (int64_t i = 0; i < g * n; i++) newest = p[i] > newest ? p[i] : newest;
        table_at(tc, ts, rows, sr, se, newest, n_elem, cp, sp);
        for (int64_t j = 0; j < n_elem; j++)
            cs[j] = cp[j] * fc[j] - sp[j] * fs[j], sn[j] = sp[j] * fc[j] + cp[j] * fs[j];
        for (int64_t h = 0; h < hq; h++) {
            const int64_t q = r * hq + h;
            prepare(s0[q], s1 + q * HEAD, s2 == NULL ? NULL : s2 + q * HEAD * HEAD, cs, sn, n_elem,
                    heads + h * each, heads + h * each + HEAD);
        }
        for (int64_t h = 0; h < g; h++)
            expected_head(keys + r * ksb + h * ksg, ksn, values + r * vsb + h * vsg, vsn, p + h * n, n, m,
                          heads + h * m * each, s2 != NULL, n_sink, (int)vnorm, epsilon, logits, out + (r * g + h) * n);
    }
}

/* Expected attention's statistics after a decode step's query per row (`updated_stats` with one query): q
   (B, H, HEAD) float32 rows qsb, heads qsh numbers apart, at positions qpos (B); each turned back to position 0
   (R(p)^T q from the RoPE table, float64), then, where p >= n_sink, o = decay * s + the query's terms (s0 + 1,
   s1 + q, s2 + q q^T; decay 1 for uniform weights); elsewhere o = s. s2 and o2 NULL without the covariance. */
void litkv_expected_stats(const float *q, int64_t qsb, int64_t qsh, const int64_t *qpos, const float *tc,
                          const float *ts, int64_t rows, int64_t sr, int64_t se, int64_t n_elem, int64_t n_sink,
                          double decay, const double *s0, const double *s1, const double *s2, double *o0, double *o1,
                          double *o2, int64_t b, int64_t hq) {
    const int64_t half = n_elem / 2;
    _Alignas(64) double c[HEAD], s[HEAD], x[HEAD];
    for (int64_t r = 0; r < b; r++) {
        table_at(tc, ts, rows, sr, se, qpos[r], n_elem, c, s);
        const int valid = qpos[r] >= n_sink;
        const double w = valid ? 1.0 : 0.0, shrink = valid ? decay : 1.0;
        for (int64_t h = 0; h < hq; h++) {
            const float *qh = q + r * qsb + h * qsh;
            const int64_t k = r * hq + h;
            for (int64_t i = 0; i < HEAD; i++) {
                const double partner = i < half ? qh[i + half] : i < n_elem ? qh[i - half] : 0.0;
                x[i] = i < n_elem ? qh[i] * c[i] - partner * s[i] : qh[i];
            }
            o0[k] = s0[k] * shrink + w;
            for (int64_t i = 0; i < HEAD; i++) o1[k * HEAD + i] = s1[k * HEAD + i] * shrink + x[i] * w;
            if (s2 == NULL) continue;
            for (int64_t i = 0; i < HEAD; i++) {
                const double xi = x[i] * w;
                const double *si = s2 + (k * HEAD + i) * HEAD;
                double *oi = o2 + (k * HEAD + i) * HEAD;
                for (int64_t j = 0; j < HEAD; j++) oi[j] = si[j] * shrink + xi * x[j];
            }
        }
    }
}
