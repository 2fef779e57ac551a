/* Quantising a decode step's new tokens on the CPU, bit for bit as `litkv.kvcache.quantized` does: included by
quant_decode_cpu.c (beside this file) for 8- and 4-bit slots, with its macros (HEAD, GROUPS, SIZE, WIDTH, BITS) and
`half_to_float`. */

/* float32 to float16 bits, rounded to nearest even (beyond float16's range: infinity), as a cast does. */
static inline uint16_t float_to_half(float f) {
    union {
        float value;
        uint32_t bits;
    } in = {.value = f};
    const uint16_t sign = (uint16_t)((in.bits >> 16) & 0x8000);
    const uint32_t magnitude = in.bits & 0x7FFFFFFF;
    if (magnitude >= 0x47800000u) return sign | 0x7C00; /* 65536 and above (callers exclude NaN) */
    if (magnitude < 0x38800000u) return sign | (uint16_t)nearbyintf(fabsf(f) * 16777216.0f); /* below 2^-14 */
    uint32_t half = ((magnitude >> 23) - 112) << 10 | (magnitude & 0x7FFFFF) >> 13;
    const uint32_t rest = magnitude & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half += 1; /* a carry may reach infinity: right */
    return sign | (uint16_t)half;
}

/* The next float16 toward -infinity (down) or +infinity (up), as nextafter does. */
static inline uint16_t half_step(uint16_t h, int up) {
    if ((h & 0x7FFF) == 0) return up ? 0x0001 : 0x8001;
    return ((h & 0x8000) == 0) == (up != 0) ? h + 1 : h - 1;
}

/* Whether each of the n numbers at x is finite and within float16's range (else the PyTorch path). */
static int all_in_range(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(x[i]) <= 65504.0f)) return 0;
    return 1;
}

/* One group of SIZE numbers at v: its offset (the minimum rounded down to float16) and scale (the range over
   2^BITS - 1 rounded up), as float16 bits, and its codes (as numbers) into numbers; 1 where both zeros sit at
   an extreme (the caller takes the PyTorch path), else 0. */
static int quantize_group(const float *v, uint16_t *scale_bits, uint16_t *offset_bits, float *numbers) {
    const float levels = (float)((1 << BITS) - 1);
    float low = v[0], high = v[0];
    int zeros = 0; /* bit 0: a +0 seen, bit 1: a -0 seen */
    for (int i = 0; i < SIZE; i++) {
        low = v[i] < low ? v[i] : low, high = v[i] > high ? v[i] : high;
        if (v[i] == 0.0f) zeros |= signbit(v[i]) ? 2 : 1;
    }
    if (zeros == 3 && (low == 0.0f || high == 0.0f)) return 1;
    uint16_t offset = float_to_half(low);
    if (half_to_float(offset) > low) offset = half_step(offset, 0);
    const float base = half_to_float(offset), range = (high - base) / levels;
    uint16_t scale = float_to_half(range);
    if (half_to_float(scale) < range) scale = half_step(scale, 1);
    const float factor = half_to_float(scale), inverse = 1.0f / (factor > 1e-30f ? factor : 1e-30f);
    for (int i = 0; i < SIZE; i++) {
        const float code = nearbyintf((v[i] - base) * inverse);
        numbers[i] = code < 0.0f ? 0.0f : code > levels ? levels : code;
    }
    *scale_bits = scale, *offset_bits = offset;
    return 0;
}

/* litkv.kvcache.quantized.quantize for float16 scales, bit for bit: each group of SIZE numbers of each
   of `rows` rows of HEAD (x float32, contiguous) gets offset = its minimum rounded down to float16,
   scale = (maximum - offset) / (2^BITS - 1) rounded up to float16, and codes round((x - offset) / scale)
   (times the reciprocal of the scale, at least 1e-30) clamped to [0, 2^BITS - 1], stored as the storage
   keeps them (int8: biased by -128; int4: two per byte): row r's codes at codes + (r / per) * code_stride +
   (r % per) * WIDTH, its scales and offsets at (r / per) * scale_stride + (r % per) * GROUPS (rows in runs
   of `per` side by side, e.g. a storage's slots). Returns 1 without finishing when a number is not
   finite or beyond float16's range, or a group whose minimum or maximum is zero holds both +0 and -0 (which
   zero is the extreme is the PyTorch reduction's choice): the caller then takes the PyTorch path; else 0. */
/* One row of HEAD numbers at x quantised: its codes to out (WIDTH bytes), its GROUPS scales and offsets; 1 as
   quantize_group, else 0. */
static int quantize_row(const float *x, uint8_t *out, uint16_t *scales, uint16_t *offsets) {
    _Alignas(64) float numbers[HEAD];
    for (int j = 0; j < GROUPS; j++)
        if (quantize_group(x + j * SIZE, scales + j, offsets + j, numbers + j * SIZE)) return 1;
#if BITS == 8
    for (int i = 0; i < WIDTH; i++) out[i] = (uint8_t)numbers[i] ^ 0x80;
#else
    for (int i = 0; i < WIDTH; i++) out[i] = (uint8_t)numbers[i] | (uint8_t)((uint8_t)numbers[i + WIDTH] << 4);
#endif
    return 0;
}

int litkv_quantize(const float *x, int64_t rows, int64_t per, uint8_t *codes, int64_t code_stride, uint16_t *scales,
                   uint16_t *offsets, int64_t scale_stride) {
    if (!all_in_range(x, rows * HEAD)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r / per * scale_stride + r % per * GROUPS;
        if (quantize_row(x + r * HEAD, codes + r / per * code_stride + r % per * WIDTH, scales + at, offsets + at))
            return 1;
    }
    return 0;
}

/* litkv_quantize of one token per (row, KV head) given as its key and value apart (a decode step's): k, v (B, G,
   HEAD) float32 with rows ksb / vsb and heads ksg / vsg numbers apart; pair (r, h)'s key into part 0 and value
   into part 1 of its slot at codes + (r G + h) code_stride, scales and offsets at (r G + h) scale_stride (the
   slot's own addresses). Returns as litkv_quantize (every number checked before anything is written). */
int litkv_quantize_pair(const float *k, int64_t ksb, int64_t ksg, const float *v, int64_t vsb, int64_t vsg, int64_t b,
                        int64_t g, uint8_t *codes, int64_t code_stride, uint16_t *scales, uint16_t *offsets,
                        int64_t scale_stride) {
    for (int64_t r = 0; r < b; r++)
        for (int64_t h = 0; h < g; h++)
            if (!all_in_range(k + r * ksb + h * ksg, HEAD) || !all_in_range(v + r * vsb + h * vsg, HEAD)) return 1;
    for (int64_t r = 0; r < b; r++)
        for (int64_t h = 0; h < g; h++) {
            const int64_t pair = r * g + h, at = pair * scale_stride;
            uint8_t *out = codes + pair * code_stride;
            if (quantize_row(k + r * ksb + h * ksg, out, scales + at, offsets + at) ||
                quantize_row(v + r * vsb + h * vsg, out + WIDTH, scales + at + GROUPS, offsets + at + GROUPS))
                return 1;
        }
    return 0;
}

/* errors[r]: the mean squared difference between row r of x (rows of HEAD numbers, as litkv_quantize takes
   them) and its quantised form read back (offset + scale * code, float32), the quantisation error
   `quantized.round_trip_error` measures (summed in another order: equal within float32 rounding). Returns 1
   where litkv_quantize would (errors then unreliable), else 0. */
int litkv_round_trip_errors(const float *x, int64_t rows, float *errors) {
    if (!all_in_range(x, rows * HEAD)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        float total = 0.0f;
        for (int j = 0; j < GROUPS; j++) {
            const float *v = x + r * HEAD + j * SIZE;
            _Alignas(64) float numbers[SIZE];
            uint16_t scale, offset;
            if (quantize_group(v, &scale, &offset, numbers)) return 1;
            const float factor = half_to_float(scale), base = half_to_float(offset);
            for (int i = 0; i < SIZE; i++) {
                const float miss = v[i] - (numbers[i] * factor + base);
                total += miss * miss;
            }
        }
        errors[r] = total / HEAD;
    }
    return 0;
}

/* A staged slot moved into place (`KVStorage.commit_staged`): for each of the `rows` (row, KV head) pairs r,
   the 2 * WIDTH code bytes and 2 * GROUPS scales and offsets of slot `room` copied into slot target[r] (nothing
   where target[r] is `room`: the staged token is the one dropped). Row r's slot s of codes at codes + r *
   code_stride + s * 2 * WIDTH, of scales and offsets at r * scale_stride + s * 2 * GROUPS. */
void litkv_commit(uint8_t *codes, int64_t code_stride, uint16_t *scales, uint16_t *offsets, int64_t scale_stride,
                  const int64_t *target, int64_t rows, int64_t room) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t to = target[r];
        if (to == room) continue;
        uint8_t *c = codes + r * code_stride;
        uint16_t *s = scales + r * scale_stride, *o = offsets + r * scale_stride;
        memcpy(c + to * 2 * WIDTH, c + room * 2 * WIDTH, 2 * WIDTH);
        memcpy(s + to * 2 * GROUPS, s + room * 2 * GROUPS, 2 * GROUPS * sizeof(uint16_t));
        memcpy(o + to * 2 * GROUPS, o + room * 2 * GROUPS, 2 * GROUPS * sizeof(uint16_t));
    }
}
