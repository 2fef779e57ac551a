/* A linear layer's product for a few rows on the CPU, with the weight stored column-major.

Built at run time by litkv/modeling/row_linear.py (litkv.core.c_build). litkv_row_linear computes
    y[r][n] = sum over k of x[r][k] * W[n][k]  (+ bias[n])
for R rows x (R, K) float32, the weight W (N, K) float32 stored column-major: wt[k * N + n] = W[n][k] (the memory of
W^T, as `litkv.modeling.weight_layout.columns_contiguous` leaves it). For each input k the weight's N numbers lie
side by side, so the weight is read once, in order, and each output is one running sum over the inputs in order
(fused multiply-adds from 0, the bias added last): an output's bits do not depend on R, on the other rows or on how
the outputs are cut into blocks. The outputs are taken a block at a time (at most CHUNK numbers per row, held in
the first level of cache while every input is added into them); N must be a multiple of LANES. Everything runs on
the calling thread.
*/
#include <stdint.h>
#include <string.h>

#define LANES 16
#define CHUNK 8192 /* outputs per block, all rows together: 32 KB of sums */

typedef float floats __attribute__((vector_size(4 * LANES)));

/* Rows r of x (R, K) times the weight's outputs [n0, n0 + width) into sums (R, width), from 0. */
static void block(const float *x, const float *wt, float *sums, int64_t R, int64_t N, int64_t K, int64_t n0,
                  int64_t width) {
    memset(sums, 0, (size_t)(R * width) * sizeof(float));
    for (int64_t k = 0; k < K; k++) {
        const float *w = wt + k * N + n0;
        for (int64_t r = 0; r < R; r++) {
            const floats xk = (floats){0} + x[r * K + k];
            float *s = sums + r * width;
            for (int64_t j = 0; j < width; j += LANES) {
                floats v, a;
                memcpy(&v, w + j, sizeof(v));
                memcpy(&a, s + j, sizeof(a));
                a += xk * v;
                memcpy(s + j, &a, sizeof(a));
            }
        }
    }
}

/* y (R, N) = x (R, K) @ W^T (+ bias (N), or NULL); wt (K, N) the weight column-major. Returns 1 (nothing
   written) where N is not a multiple of LANES or R is not in 1 .. 8, else 0. */
int litkv_row_linear(const float *x, const float *wt, const float *bias, float *y, int64_t R, int64_t N, int64_t K) {
    /* a whole cache line per vector of sums: unaligned (a library's thread-local block is only as aligned as it
       asks), every load and store of the block's sums spans two lines and a step took about 30% longer */
    static _Thread_local _Alignas(64) float sums[CHUNK];
    if (N % LANES != 0 || R < 1 || R > 8) return 1;
    const int64_t step = CHUNK / R / LANES * LANES;
    for (int64_t n0 = 0; n0 < N; n0 += step) {
        const int64_t width = N - n0 < step ? N - n0 : step;
        block(x, wt, sums, R, N, K, n0, width);
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < width; j++)
                y[r * N + n0 + j] = bias == NULL ? sums[r * width + j] : sums[r * width + j] + bias[n0 + j];
    }
    return 0;
}
