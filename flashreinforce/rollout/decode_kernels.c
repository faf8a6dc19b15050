/* The decoding step's small operations, each one pass over its rows instead of several framework kernels.
 *
 * Built at first use by rollout/fused_decode.py with the system's C compiler (no Python or torch headers) and
 * called through ctypes on contiguous CPU tensors. Every function rounds where the model's own code rounds:
 * a bf16 model computes each framework operation in fp32 and stores bf16, so each intermediate a framework
 * operation would store is rounded to bf16 here too (`store`), and the norm's sum adds in torch's own order
 * (`torch_sum`). Only exp differs from the framework's, in the last fp32 bit, which bf16 rounding hides.
 *
 * dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Each kernel's body is written once for both dtypes and inlined twice with the dtype a constant, so the
 * compiler vectorizes each loop for one dtype: plain loops, no branches inside them. */
#define INLINE static inline __attribute__((always_inline))

INLINE float bits_to_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE uint32_t float_to_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* Round to nearest even, as torch's bfloat16 conversion does; NaN becomes the quiet NaN 0x7fc0. */
INLINE uint16_t bf16_round_bits(float f) {
    uint32_t bits = float_to_bits(f);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)rounded;
}

INLINE float load(int dtype, const void *p, int64_t i) {
    return dtype ? bits_to_float((uint32_t)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

INLINE void put(int dtype, void *p, int64_t i, float v) {
    if (dtype) ((uint16_t *)p)[i] = bf16_round_bits(v);
    else ((float *)p)[i] = v;
}

/* What storing v in the model's dtype and reading it back gives. */
INLINE float store(int dtype, float v) { return dtype ? bits_to_float((uint32_t)bf16_round_bits(v) << 16) : v; }

/* e^x within about one unit in the last place (Cephes' expf: a degree-6 polynomial after reducing by ln 2),
 * in plain arithmetic so that its loops vectorize, which libm's expf does not. */
INLINE float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  /* NaN passes through */
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * bits_to_float((uint32_t)((int32_t)n + 127) << 23);
}

/* ceil(log2(x)), at least 1 (torch's CeilLog2). */
static int64_t ceil_log2(int64_t x) {
    int64_t bits = 1;
    while (x > 2 && ((int64_t)1 << bits) < x) bits++;
    return bits;
}

/* The sum of x[0..n) in the order torch's CPU sum kernel adds them, with vectors of `lanes` floats (8 or 16):
 * four accumulator vectors over groups of four vectors, cascaded in levels of 16 groups, then the leftover
 * vectors, then the accumulators, then the leftover floats, then the lanes one by one. Another order rounds
 * differently, and a norm's last bit would then differ from the model's own. */
static float torch_sum(const float *x, int64_t n, int64_t lanes) {
    enum { LEVELS = 4, ILP = 4, MAX_LANES = 16 };
    if (n < lanes) lanes = 1;  /* fewer values than a vector: torch adds them as scalars, in the same cascade */
    float acc[LEVELS][ILP][MAX_LANES] = {{{0}}};
    int64_t vectors = n / lanes, groups = vectors / ILP;
    int64_t power = ceil_log2(groups) / LEVELS;
    if (power < 4) power = 4;
    int64_t step = (int64_t)1 << power, mask = step - 1, g = 0;
    while (g + step <= groups) {
        for (int64_t j = 0; j < step; j++, g++)
            for (int k = 0; k < ILP; k++)
                for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(g * ILP + k) * lanes + l];
        for (int level = 1; level < LEVELS; level++) {
            for (int k = 0; k < ILP; k++)
                for (int64_t l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((g & (mask << (level * power))) != 0) break;
        }
    }
    for (; g < groups; g++)
        for (int k = 0; k < ILP; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += x[(g * ILP + k) * lanes + l];
    for (int level = 1; level < LEVELS; level++)
        for (int k = 0; k < ILP; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = groups * ILP; v < vectors; v++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += x[v * lanes + l];
    for (int k = 1; k < ILP; k++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t i = vectors * lanes; i < n; i++) total += x[i];
    for (int64_t l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

INLINE void add_rms_norm_body(int dtype, const void *x, void *residual, const void *weight, void *out, int64_t rows,
                              int64_t dim, float eps, int64_t lanes, float *scratch) {
    float *squares = scratch + dim;
    for (int64_t r = 0; r < rows; r++) {
        int64_t base = r * dim;
        if (residual) {
            for (int64_t i = 0; i < dim; i++) {
                float v = store(dtype, load(dtype, residual, base + i) + load(dtype, x, base + i));
                put(dtype, residual, base + i, v);
                scratch[i] = v;
            }
        } else {
            for (int64_t i = 0; i < dim; i++) scratch[i] = load(dtype, x, base + i);
        }
        for (int64_t i = 0; i < dim; i++) squares[i] = scratch[i] * scratch[i];
        float inv = 1.0f / sqrtf(torch_sum(squares, dim, lanes) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            put(dtype, out, base + i, load(dtype, weight, i) * store(dtype, scratch[i] * inv));
    }
}

/* out = weight * rms_norm(x) per row of `dim`, the norm computed in fp32. With `residual` (not NULL), first
 * residual = residual + x in place, and the norm is of the new residual (a decoder layer's add, then its norm).
 * lanes: torch_sum's; scratch: 2 * dim floats. */
void add_rms_norm(int dtype, const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t dim,
                  float eps, int64_t lanes, float *scratch) {
    if (dtype) add_rms_norm_body(1, x, residual, weight, out, rows, dim, eps, lanes, scratch);
    else add_rms_norm_body(0, x, residual, weight, out, rows, dim, eps, lanes, scratch);
}

/* x's sum as torch_sum adds it: for finding the lanes of the running torch's sum kernel. */
float ordered_sum(const float *x, int64_t n, int64_t lanes) { return torch_sum(x, n, lanes); }

INLINE void silu_mul_body(int dtype, const void *gate_up, void *out, int64_t rows, int64_t width) {
    float activated[256];  /* in blocks: one loop of exp in fp32 vectorizes well, mixed with bf16 it does not */
    for (int64_t r = 0; r < rows; r++) {
        int64_t gate = r * 2 * width, up = gate + width, row_out = r * width;
        for (int64_t start = 0; start < width; start += 256) {
            int64_t count = width - start < 256 ? width - start : 256;
            for (int64_t j = 0; j < count; j++) {
                float g = load(dtype, gate_up, gate + start + j);
                activated[j] = g / (1.0f + exp_approx(-g));
            }
            for (int64_t j = 0; j < count; j++)
                put(dtype, out, row_out + start + j,
                    store(dtype, activated[j]) * load(dtype, gate_up, up + start + j));
        }
    }
}

/* out (rows, width) = silu(gate) * up, a gated MLP's activation, where each row of gate_up (rows, 2 * width)
 * is gate then up (their products computed as one). */
void silu_mul(int dtype, const void *gate_up, void *out, int64_t rows, int64_t width) {
    if (dtype) silu_mul_body(1, gate_up, out, rows, width);
    else silu_mul_body(0, gate_up, out, rows, width);
}

/* out = x * cos + rotate_half(x) * sin over one head of `dim` values, rotate_half(x) = (-x[half:], x[:half]). */
INLINE void rotate_head(int dtype, const void *x, int64_t in, const void *cos, const void *sin, int64_t angles,
                        void *out, int64_t base, int64_t dim) {
    int64_t half = dim / 2;
    for (int64_t d = 0; d < half; d++) {  /* rotate_half puts -x[half:] first */
        float v = store(dtype, load(dtype, x, in + d) * load(dtype, cos, angles + d)) +
                  store(dtype, -load(dtype, x, in + half + d) * load(dtype, sin, angles + d));
        put(dtype, out, base + d, v);
    }
    for (int64_t d = half; d < dim; d++) {  /* then x[:half] */
        float v = store(dtype, load(dtype, x, in + d) * load(dtype, cos, angles + d)) +
                  store(dtype, load(dtype, x, in + d - half) * load(dtype, sin, angles + d));
        put(dtype, out, base + d, v);
    }
}

INLINE void attention_inputs_body(int dtype, const void *qkv, const void *cos, const void *sin, void *query,
                                  void *keys, void *values, const int64_t *slots, const int64_t *positions,
                                  int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t capacity) {
    int64_t row_stride = (heads + 2 * kv_heads) * dim, bytes = dtype ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        int64_t in = r * row_stride, angles = r * dim;
        for (int64_t h = 0; h < heads; h++)
            rotate_head(dtype, qkv, in + h * dim, cos, sin, angles, query, (r * heads + h) * dim, dim);
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t at = ((slots[r] * kv_heads + h) * capacity + positions[r]) * dim;
            rotate_head(dtype, qkv, in + (heads + h) * dim, cos, sin, angles, keys, at, dim);
            memcpy((char *)values + at * bytes, (const char *)qkv + (in + (heads + kv_heads + h) * dim) * bytes,
                   dim * bytes);
        }
    }
}

/* A decoding step's attention inputs from the fused q, k, v product qkv (rows, (heads + 2 * kv_heads) * dim):
 * the rotary-embedded queries into query (rows, heads, dim), and each row's rotary-embedded key and its value
 * into the KV stores keys and values (slots, kv_heads, capacity, dim) at the row's slot and position. */
void attention_inputs(int dtype, const void *qkv, const void *cos, const void *sin, void *query, void *keys,
                      void *values, const int64_t *slots, const int64_t *positions, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t capacity) {
    if (dtype)
        attention_inputs_body(1, qkv, cos, sin, query, keys, values, slots, positions, rows, heads, kv_heads, dim,
                              capacity);
    else
        attention_inputs_body(0, qkv, cos, sin, query, keys, values, slots, positions, rows, heads, kv_heads, dim,
                              capacity);
}
