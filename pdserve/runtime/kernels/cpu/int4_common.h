// What the 4- and 8-bit weight kernels share: int4_matmul.c (int8 inputs) and int4_exact.c (fp32
// inputs as they are) read the same codes, scales and mins (layouts: int4_matmul.c's head comment);
// int4_matmul.c and int4_q8_gemm.c quantize their inputs to int8 alike (`q8_inputs`; int4_q8_gemm.c's
// bf16 rows in AVX-512, `q8_group_bf16`, with the same bits).
#ifndef PDSERVE_INT4_COMMON_H
#define PDSERVE_INT4_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT4_AVX2 1
#endif

#define GROUP 32  // inputs a scale (and min) covers

#define QMAX 127.0f

// Inputs [M, K] -> xq [M, K] int8 (each group's even inputs, then its odd ones; in input order where
// `in_order`, for 8-bit codes), xd and xsum [M, K / 32]. xsum is the sum of the group's quantized inputs
// (xd times its codes' sum), as llama.cpp's Q8_1 keeps it, not of the inputs themselves: then a 4-bit
// weight's min multiplies the same inputs its codes do, and the product is the dequantized weight times
// the quantized inputs, whose error weighs each input's rounding by its weight (centred on zero).
// With the exact sum the codes' part (0..15, all positive) carried the rounding alone, uncancelled:
// SmolLM2's projections' outputs were 2-3x further from x w^T, its perplexity on README.md 51.9
// against 51.2 (benchmarks/int4_perplexity.py).
static inline void q8_quantize_groups(const float* x, int64_t m, int64_t k, int64_t x_stride, int8_t* xq, float* xd,
                                      float* xsum, int64_t in_order) {
    const int64_t groups = k / GROUP;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float* v = x + r * x_stride + g * GROUP;
            float amax = 0.0f;
            for (int i = 0; i < GROUP; i++) {
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
            const float d = amax / QMAX;
            const float inv = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t* out = xq + r * k + g * GROUP;
            int32_t sum = 0;  // of the codes: exact
            if (in_order) {
                for (int i = 0; i < GROUP; i++) sum += out[i] = (int8_t)(int32_t)rintf(v[i] * inv);
            } else {
                for (int i = 0; i < GROUP / 2; i++) {
                    sum += out[i] = (int8_t)(int32_t)rintf(v[2 * i] * inv);
                    sum += out[GROUP / 2 + i] = (int8_t)(int32_t)rintf(v[2 * i + 1] * inv);
                }
            }
            xd[r * groups + g] = d;
            xsum[r * groups + g] = (float)sum * d;
        }
    }
}

// An input's int8 quantization per group (int4_matmul.c's head comment): xq [M, K] int8, xd and xsum
// [M, K / 32] fp32, in one block of the caller's (free(q.xq)); q.xq is NULL where memory is short.
typedef struct {
    int8_t* xq;
    float* xd;
    float* xsum;
    int32_t* qsum;  // [M, K / 32] the codes' sums (int4_q8_gemm.c's 8-bit tiles; NULL from q8_inputs)
} Q8Inputs;

static inline Q8Inputs q8_inputs(const float* x, int64_t m, int64_t k, int64_t x_stride, int64_t in_order) {
    const int64_t groups = k / GROUP;
    Q8Inputs q = {malloc((size_t)(m * k) + 2 * sizeof(float) * (size_t)(m * groups)), NULL, NULL, NULL};
    if (q.xq == NULL) return q;
    q.xd = (float*)(q.xq + m * k);  // m * k is a multiple of 32: aligned for floats
    q.xsum = q.xd + m * groups;
    q8_quantize_groups(x, m, k, x_stride, q.xq, q.xd, q.xsum, in_order);
    return q;
}

#ifdef INT4_AVX2
// The sum of v's 8 lanes, in this order: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)); the exact
// kernel's panel GEMM adds its lane sums in this order too (its bits are the tiles').
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
