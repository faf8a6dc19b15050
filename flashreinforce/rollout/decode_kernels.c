/* The decoding step's small operations and its attention, each one pass over its rows instead of several framework
 * kernels.
 *
 * Built at first use by rollout/fused_decode.py with the system's C compiler (no Python or torch headers; OpenMP
 * where the compiler has it) and called through ctypes on contiguous CPU tensors. The small operations round where
 * the model's own code rounds: a bf16 model computes each framework operation in fp32 and stores bf16, so each
 * intermediate a framework operation would store is rounded to bf16 here too (`store`), and the norm's sum adds in
 * torch's own order (`torch_sum`). Only exp differs from the framework's, in the last fp32 bit, which bf16 rounding
 * hides. The attention accumulates in fp32 as SDPA's CPU kernel does, in its own order (`attend`).
 *
 * dtype: 0 = float32, 1 = bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

/* Keys are scored in blocks of KEY_BLOCK, each converted to fp32 rows once and read by every query head of the
 * group. */
enum { KEY_BLOCK = 16 };

#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane t = the sum of v[t]'s 16 lanes, for t = 0..15: a transposing tree, four levels of shuffles and adds, in
 * place of sixteen horizontal sums (a dot product of a 64-wide head is only four vector products). The tree
 * leaves key t in lane 4 * (t % 4) + t / 4; the last permutation puts it back. */
static inline __m512 lane_sums(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, d);
}

/* scores[t] = scale * q . block[t] for the block's 16 rows of dim floats (dim a multiple of 16). */
static inline void score_block(const float *q, const float *block, int64_t dim, float scale, float *scores) {
    __m512 sums[KEY_BLOCK];
    for (int t = 0; t < KEY_BLOCK; t++) sums[t] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
        __m512 qd = _mm512_loadu_ps(q + d);
        for (int t = 0; t < KEY_BLOCK; t++)
            sums[t] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(block + t * dim + d), sums[t]);
    }
    _mm512_storeu_ps(scores, _mm512_mul_ps(lane_sums(sums), _mm512_set1_ps(scale)));
}

/* 16 floats from element i of a float32 (dtype 0) or bfloat16 (dtype 1) array. */
static inline __m512 load16(int dtype, const void *p, int64_t i) {
    if (!dtype) return _mm512_loadu_ps((const float *)p + i);
    __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* acc[g * dim + d] = sum over t < length of weights[g * stride + t] * value_t[d], the values from element `base`
 * (dim a multiple of 16): the sums of four query heads over 64 dimensions stay in registers while the values go by
 * once. */
static void weigh_values(int dtype, const float *weights, int64_t stride, const void *values, int64_t base,
                         int64_t length, int64_t group, int64_t dim, float *acc) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        int heads = group - g0 < 4 ? (int)(group - g0) : 4;
        for (int64_t d0 = 0; d0 < dim; d0 += 64) {
            int vectors = (dim - d0) / 16 < 4 ? (int)((dim - d0) / 16) : 4;
            __m512 sums[4][4], row[4];
            for (int i = 0; i < 4; i++) {
                row[i] = _mm512_setzero_ps();
                for (int j = 0; j < 4; j++) sums[i][j] = _mm512_setzero_ps();
            }
            for (int64_t t = 0; t < length; t++) {
                for (int j = 0; j < 4; j++)
                    if (j < vectors) row[j] = load16(dtype, values, base + t * dim + d0 + 16 * j);
                for (int i = 0; i < 4; i++) {
                    if (i >= heads) break;
                    __m512 w = _mm512_set1_ps(weights[(g0 + i) * stride + t]);
                    for (int j = 0; j < 4; j++)
                        if (j < vectors) sums[i][j] = _mm512_fmadd_ps(w, row[j], sums[i][j]);
                }
            }
            for (int i = 0; i < heads; i++)
                for (int j = 0; j < vectors; j++) _mm512_storeu_ps(acc + (g0 + i) * dim + d0 + 16 * j, sums[i][j]);
        }
    }
}
#define VECTOR_SCORES(dim) ((dim) % 16 == 0)
#else
static void weigh_values(int dtype, const float *weights, int64_t stride, const void *values, int64_t base,
                         int64_t length, int64_t group, int64_t dim, float *acc) {
    (void)dtype, (void)weights, (void)stride, (void)values, (void)base, (void)length, (void)group, (void)dim;
    (void)acc;
}
static inline void score_block(const float *q, const float *block, int64_t dim, float scale, float *scores) {
    (void)q, (void)block, (void)dim, (void)scale, (void)scores;
}
#define VECTOR_SCORES(dim) 0
#endif

/* The largest of x[0..n), n >= 1, and their sum, over 16 independent lanes so that the loops vectorize. */
INLINE float lanes_max(const float *x, int64_t n) {
    float lanes[16];
    for (int l = 0; l < 16; l++) lanes[l] = x[0];
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
        for (int l = 0; l < 16; l++) lanes[l] = x[t + l] > lanes[l] ? x[t + l] : lanes[l];
    float top = x[0];
    for (; t < n; t++) top = x[t] > top ? x[t] : top;
    for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
}

INLINE float lanes_sum(const float *x, int64_t n) {
    float lanes[16] = {0};
    int64_t t = 0;
    for (; t + 16 <= n; t += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[t + l];
    for (int width = 8; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    float sum = lanes[0];
    for (; t < n; t++) sum += x[t];
    return sum;
}

/* scores[t] = scale * q . row of dim floats, with independent partial sums so that the products vectorize. */
INLINE float score_row(const float *q, const float *row, int64_t dim, float scale) {
    enum { LANES = 16 };
    float lanes[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] += q[d + l] * row[d + l];
    for (int width = LANES / 2; width > 0; width /= 2)  /* a tree, each level one vector operation */
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    float dot = lanes[0];
    for (; d < dim; d++) dot += q[d] * row[d];
    return dot * scale;
}

/* One row's attention for one KV head and the `group` query heads that share it, over positions [0, length) of
 * its KV slot (keys and values from element `base`): softmax(scale * q k^T) v with fp32 accumulation, as SDPA's
 * CPU kernel computes it; in bf16 the softmax's weights are rounded to bf16 before they weigh the values, as that
 * kernel rounds them. q: group * dim floats; scores: group rows of `stride` >= length rounded up to KEY_BLOCK;
 * work: (KEY_BLOCK + group) * dim + group floats. The sums run in another order than SDPA's, so the result may
 * differ from it in the last bits. */
INLINE void attend(int dtype, const float *q, const void *keys, const void *values, int64_t base, int64_t length,
                   int64_t group, int64_t dim, float scale, float *scores, int64_t stride, float *work, void *out,
                   int64_t out_at) {
    float *block = work, *acc = block + KEY_BLOCK * dim, *sums = acc + group * dim;
    for (int64_t t0 = 0; t0 < length; t0 += KEY_BLOCK) {
        int64_t count = length - t0 < KEY_BLOCK ? length - t0 : KEY_BLOCK;
        for (int64_t i = 0; i < count * dim; i++) block[i] = load(dtype, keys, base + t0 * dim + i);
        for (int64_t i = count * dim; i < KEY_BLOCK * dim; i++) block[i] = 0.0f;
        for (int64_t g = 0; g < group; g++) {
            if (VECTOR_SCORES(dim)) {
                score_block(q + g * dim, block, dim, scale, scores + g * stride + t0);
            } else {
                for (int64_t t = 0; t < count; t++)
                    scores[g * stride + t0 + t] = score_row(q + g * dim, block + t * dim, dim, scale);
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * stride;
        float top = lanes_max(s, length);
        for (int64_t t = 0; t < length; t++) s[t] = exp_approx(s[t] - top);
        sums[g] = lanes_sum(s, length);
        for (int64_t t = 0; t < length; t++) s[t] = store(dtype, s[t]);
    }
    if (VECTOR_SCORES(dim)) {
        weigh_values(dtype, scores, stride, values, base, length, group, dim, acc);
    } else {
        memset(acc, 0, (size_t)(group * dim) * sizeof(float));
        float *row = block;
        for (int64_t t = 0; t < length; t++) {
            for (int64_t d = 0; d < dim; d++) row[d] = load(dtype, values, base + t * dim + d);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g * stride + t], *a = acc + g * dim;
                for (int64_t d = 0; d < dim; d++) a[d] += p * row[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) put(dtype, out, out_at + g * dim + d, acc[g * dim + d] / sums[g]);
}

INLINE int decode_attention_body(int dtype, const void *qkv, const void *cos, const void *sin, void *keys,
                                 void *values, const int64_t *slots, const int64_t *positions, void *out, int64_t rows,
                                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t capacity, float scale,
                                 int threads, int64_t longest) {
    int64_t group = heads / kv_heads, row_stride = (heads + 2 * kv_heads) * dim, bytes = dtype ? 2 : 4;
    int64_t stride = (longest + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    int64_t work_floats = group * stride + group * dim + (KEY_BLOCK + group) * dim + group;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = malloc((size_t)work_floats * sizeof(float));
        failed = scores == NULL;
        /* First every row's new key and value into its slot, and its queries, rounded as the model stores them,
         * into their output's place (which the attention overwrites): rows of one request at several positions
         * (a prefill) read each other's keys, so all are stored before any attends (the loop's barrier). */
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < kv_heads; h++) {
                int64_t in = r * row_stride, angles = r * dim, out_at = (r * heads + h * group) * dim;
                int64_t at = ((slots[r] * kv_heads + h) * capacity + positions[r]) * dim;
                rotate_head(dtype, qkv, in + (heads + h) * dim, cos, sin, angles, keys, at, dim);
                memcpy((char *)values + at * bytes, (const char *)qkv + (in + (heads + kv_heads + h) * dim) * bytes,
                       (size_t)(dim * bytes));
                for (int64_t g = 0; g < group; g++)
                    rotate_head(dtype, qkv, in + (h * group + g) * dim, cos, sin, angles, out, out_at + g * dim, dim);
            }
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t h = 0; h < kv_heads; h++) {
                if (scores == NULL) continue;
                float *q = scores + group * stride, *work = q + group * dim;
                int64_t out_at = (r * heads + h * group) * dim, base = (slots[r] * kv_heads + h) * capacity * dim;
                for (int64_t d = 0; d < group * dim; d++) q[d] = load(dtype, out, out_at + d);
                attend(dtype, q, keys, values, base, positions[r] + 1, group, dim, scale, scores, stride, work, out,
                       out_at);
            }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Attention from the fused q, k, v product qkv (rows, (heads + 2 * kv_heads) * dim), a row a token: each row's
 * rotary-embedded key and its value into the KV stores keys and values (slots, kv_heads, capacity, dim) at the
 * row's slot and position, then its rotary-embedded queries attend to that slot's positions 0..position, the
 * query heads sharing a KV head together; out (rows, heads * dim). A decoding step has a row a slot; a prefill
 * several rows of one slot, any positions stored by earlier calls. Rows and KV heads are split over `threads`
 * threads (OpenMP, where the compiler has it). Returns 0, or -1 when scratch memory could not be had. */
int decode_attention(int dtype, const void *qkv, const void *cos, const void *sin, void *keys, void *values,
                     const int64_t *slots, const int64_t *positions, void *out, int64_t rows, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t capacity, float scale, int threads) {
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    if (dtype)
        return decode_attention_body(1, qkv, cos, sin, keys, values, slots, positions, out, rows, heads, kv_heads,
                                     dim, capacity, scale, threads, longest);
    return decode_attention_body(0, qkv, cos, sin, keys, values, slots, positions, out, rows, heads, kv_heads, dim,
                                 capacity, scale, threads, longest);
}
