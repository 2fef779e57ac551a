/* A decode step's drop on the CPU: for each row of a policy's scores, the one candidate that loses its slot.

Built at run time by litkv/kvcache/kernels/cpu_select.py (litkv.core.c_build). litkv_lowest_one reads scores
(R, N) float32 and positions (R, N) int64, both contiguous, and writes out (R,) int64: per row the index that
litkv.kvcache.score.ScoreKVCache.lowest(scores, positions, 1) gives, every candidate's value being

    -inf            where the position is negative (an empty slot or a pad),
    +inf            else where it is protected: its position at least the row's largest minus (recent - 1)
                    (recent > 0), or in [0, sinks) (sinks > 0),
    its score       else,

and the lowest value losing, equal values broken by the smaller position, equal positions by the first index
(torch.argmin's choice). The recent window is the row's `recent` newest candidates only where exactly `recent`
positions reach that threshold (a row that keeps its newest tokens, one position each); where a row's do not, a
score read is NaN or a position is outside [-1, 2^31 - 1), it returns 1 and writes nothing the caller uses (the caller takes the PyTorch path); else 0.
Exact: comparisons only. Everything runs on the calling thread.
*/
#include <stdint.h>
#include <string.h>

#define NEG_INF_KEY ((int32_t)0x807FFFFF) /* ORDERED(-inf) */
#define POS_INF_KEY ((int32_t)0x7F800000) /* ORDERED(+inf) */

/* A candidate's rank as one int64, lower loses: its value's order-preserving bits (-inf for a negative position,
   +inf where protected, else its score's, -0 as +0), then its position + 1. Sets *unsure where a score it reads
   is NaN or the position is outside [-1, 2^31 - 1). Integer operations only, so the compiler vectorises the
   loops. */
static inline int64_t rank(float score, int64_t position, int64_t threshold, int64_t sinks, int *unsure) {
    int32_t bits;
    memcpy(&bits, &score, sizeof bits);
    bits = bits == INT32_MIN ? 0 : bits;
    int32_t ordered = bits < 0 ? bits ^ INT32_MAX : bits;
    int read = position >= 0 && position < threshold && position >= sinks;
    *unsure |= (read & ((bits & INT32_MAX) > POS_INF_KEY)) | (position < -1) | (position >= INT32_MAX);
    int32_t key = position < 0 ? NEG_INF_KEY : (read ? ordered : POS_INF_KEY);
    return (int64_t)((uint64_t)(int64_t)key << 32 | (uint64_t)(position + 1));
}

/* One row's drop, or -1 (`rank` unsure): the lowest rank, then the first index holding it. */
static int64_t row_lowest(const float *s, const int64_t *p, int64_t n, int64_t threshold, int64_t sinks) {
    int unsure = 0;
    int64_t lowest = INT64_MAX;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rank(s[i], p[i], threshold, sinks, &unsure);
        lowest = r < lowest ? r : lowest;
    }
    if (unsure)
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (rank(s[i], p[i], threshold, sinks, &unsure) == lowest)
            return i;
    return -1; /* unreachable: some candidate holds the lowest rank */
}

/* Whether exactly `recent` positions reach the row's threshold of protection by recency, its largest position
   minus (recent - 1), which goes to *threshold. */
static int recent_threshold(const int64_t *p, int64_t n, int64_t recent, int64_t *threshold) {
    int64_t newest = INT64_MIN;
    for (int64_t i = 0; i < n; i++)
        newest = p[i] > newest ? p[i] : newest;
    int64_t count = 0;
    *threshold = newest - (recent - 1);
    for (int64_t i = 0; i < n; i++)
        count += p[i] >= *threshold;
    return count == recent;
}

int litkv_lowest_one(const float *scores, const int64_t *positions, int64_t *out, int64_t rows, int64_t n,
                     int64_t recent, int64_t sinks) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t *p = positions + r * n;
        int64_t threshold = INT64_MAX;
        if (recent > 0 && !recent_threshold(p, n, recent, &threshold))
            return 1;
        int64_t drop = row_lowest(scores + r * n, p, n, threshold, sinks);
        if (drop < 0)
            return 1;
        out[r] = drop;
    }
    return 0;
}
