/* e^x on the CPU for litkv's C sources beside this file (included; litkv.core.c_build hashes this header with each
   source that includes it). */
#ifndef LITKV_EXP_CPU_H
#define LITKV_EXP_CPU_H

#include <math.h>
#include <stdint.h>

/* e^r's Taylor polynomial of degree 7 by Horner's rule, for a float or a vector of them r. */
#define EXP_TAYLOR(r)                                                                                   \
    ((((((((r) * (1.0f / 5040.0f) + 1.0f / 720.0f) * (r) + 1.0f / 120.0f) * (r) + 1.0f / 24.0f) * (r) + \
        1.0f / 6.0f) * (r) + 0.5f) * (r) + 1.0f) * (r) + 1.0f)

/* e^x for x <= 0 (and -inf, which gives 0): x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor
   polynomial of degree 7 (relative error below 2e-7), times 2^n built in the exponent bits; below
   -87 (under float32's normal range) 0. Plain arithmetic, so that a loop of it vectorises. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = floorf(clamped * 1.44269504088896341f + 0.5f);
    const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    const float p = EXP_TAYLOR(r);
    union {
        int32_t bits;
        float value;
    } two = {.bits = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * two.value;
}

/* 16 floats (GCC / Clang vector extensions: one AVX-512 register, or what the target has) and exp_nonpositive of
   each, the same arithmetic in vector operations (floor as truncation corrected downwards, the selections by
   masks), since compilers do not vectorise the scalar function's loops. */
typedef float exp_floats __attribute__((vector_size(64)));
typedef int32_t exp_ints __attribute__((vector_size(64)));

static inline exp_floats exp_select(exp_ints mask, exp_floats yes, exp_floats no) {
    return (exp_floats)(((exp_ints)yes & mask) | ((exp_ints)no & ~mask));
}

static inline exp_floats exp16_nonpositive(exp_floats x) {
    const exp_floats floor = (exp_floats){0} - 87.0f;
    const exp_floats clamped = exp_select(x < floor, floor, x);
    const exp_floats y = clamped * 1.44269504088896341f + 0.5f;
    exp_floats n = __builtin_convertvector(__builtin_convertvector(y, exp_ints), exp_floats);
    n += __builtin_convertvector(n > y, exp_floats); /* truncation was toward zero: -1 where it rounded up */
    const exp_floats r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
    const exp_floats p = EXP_TAYLOR(r);
    const exp_ints two = (__builtin_convertvector(n, exp_ints) + 127) << 23;
    return exp_select(x < floor, (exp_floats){0}, p * (exp_floats)two);
}

/* The largest lane of x, NaN left out (a tree of maxima: the same number in any order). */
static inline float largest_lane(exp_floats x) {
    exp_floats y = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x = exp_select(y > x, y, x);
    y = __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x = exp_select(y > x, y, x);
    y = __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x = exp_select(y > x, y, x);
    return x[1] > x[0] ? x[1] : x[0];
}

#endif
