// A decoder layer's row-wise fp32 operations on the CPU (pdserve.runtime.kernels.cpu_layer_ops):
// RMSNorm with the residual add, rotate-half RoPE, SiLU-and-multiply, the softmax of decode
// attention, and the copy of a step's keys and values into a float cache.
//
// Why hand-written: each is a few lines of arithmetic over a 576-float row, and torch spends
// 10-70 us of dispatch on each (F.rms_norm is a composite of six ops on the CPU, RoPE five), which
// made the glue between a decode step's matmuls cost as much as the matmuls themselves at a few
// streams. These are also the functions the one-call decode step (decode_step.c) runs, compiled
// once in their own unit: the eager step and the one-call step round every value the same way.
//
// Every row is computed alone, in a fixed order: a row's output does not depend on the other rows
// of its call, nor on how many threads split them.
#include "bf16.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LAYER_OPS_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LAYER_OPS_AVX512 1  // 16 lanes where the CPU has them: the same per-element arithmetic as 8
#endif
#endif

#define LANES 8

// exp(x) for 8 or 16 floats (Cephes' expf: 2^n times a degree-6 polynomial of the remainder, within
// about 2 ulp of expf over [-87, 88]; inputs are clamped there, so exp(-inf) comes out 2^-126 ~ 0).
#ifdef LAYER_OPS_AVX2
#define DEFINE_EXP(NAME, V, P, ROUND, CAST)                                                                 \
    static inline V NAME(V x) {                                                                            \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3365447505531f)), P##_set1_ps(88.3762626647949f));   \
        const V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                                 \
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                   \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                               \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                              \
        V p = P##_set1_ps(1.9875691500e-4f);                                                                \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                              \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                              \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                              \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                              \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                              \
        const V y = P##_add_ps(P##_fmadd_ps(P##_mul_ps(p, r), r, r), P##_set1_ps(1.0f));                   \
        return P##_mul_ps(y, CAST(P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23))); \
    }
DEFINE_EXP(exp8, __m256, _mm256, _mm256_round_ps, _mm256_castsi256_ps)
#ifdef LAYER_OPS_AVX512
DEFINE_EXP(exp16, __m512, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)
#endif

// BODY(a, b) for 8 elements at a time, i < n: full blocks loaded in place (LOAD: 8 elements of type T
// from a pointer to element i, as fp32), the tail through zero-padded copies, so that every element
// takes the same instructions wherever it sits in a row. STORE writes `value` (w of its lanes at i).
#define MAP8_T(T, LOAD, n, SRC_A, SRC_B, BODY, STORE)                                                 \
    for (int64_t i = 0; i < (n); i += LANES) {                                                        \
        const int64_t w = (n) - i < LANES ? (n) - i : LANES;                                          \
        T pa[LANES] = {0}, pb[LANES] = {0};                                                           \
        float res[LANES];                                                                             \
        (void)res;                                                                                    \
        const T* ra = (SRC_A) + i;                                                                    \
        const T* rb = (SRC_B) + i;                                                                    \
        if (w < LANES) {                                                                              \
            memcpy(pa, ra, w * sizeof(T));                                                            \
            memcpy(pb, rb, w * sizeof(T));                                                            \
            ra = pa;                                                                                  \
            rb = pb;                                                                                  \
        }                                                                                             \
        const __m256 a = LOAD(ra), b = LOAD(rb);                                                      \
        (void)b;                                                                                      \
        const __m256 value = BODY;                                                                    \
        STORE;                                                                                        \
    }
#define MAP8(n, SRC_A, SRC_B, BODY, STORE) MAP8_T(float, _mm256_loadu_ps, n, SRC_A, SRC_B, BODY, STORE)
#else
static inline float exp1(float x) {
    x = fminf(fmaxf(x, -87.3365447505531f), 88.3762626647949f);
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return ldexpf(p * r * r + r + 1.0f, (int)n);
}
#endif

// out[r] = rms_norm(x[r] + residual[r]) * weight, summed[r] = x[r] + residual[r] (residual NULL:
// out[r] = rms_norm(x[r]) * weight, summed untouched). The mean square is summed in double, then
// rounded once: 1 / sqrt(mean + eps) in fp32, and each value is (value * inv) * weight.
void add_rms_norm_f32(const float* x, int64_t x_stride, const float* residual, const float* weight, int64_t n,
                      int64_t d, float eps, float* out, float* summed) {
    for (int64_t r = 0; r < n; r++) {
        const float* xr = x + r * x_stride;
        float* s = residual != NULL ? summed + r * d : NULL;
        double ss = 0.0;
        for (int64_t i = 0; i < d; i++) {
            const float v = s != NULL ? xr[i] + residual[r * d + i] : xr[i];
            if (s != NULL) s[i] = v;
            ss += (double)v * v;
        }
        const float inv = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
        const float* src = s != NULL ? s : xr;
        for (int64_t i = 0; i < d; i++) out[r * d + i] = (src[i] * inv) * weight[i];
    }
}

// Rotate-half RoPE of `heads` heads of `dim` per row: x [n, heads, dim] (row stride x_stride) ->
// out [n, heads, dim] contiguous (out == x allowed, stride dim * heads then). cos, sin [P, dim].
//   out[i] = x[i] c[i] - x[i + h] s[i],  out[i + h] = x[i + h] c[i + h] + x[i] s[i + h]   (i < h = dim / 2)
// Returns -1, writing nothing, where a position is outside [0, P).
// Both dtypes' RoPE: T the row element, LOAD(v) its fp32 value, ROUND(x) an intermediate as the dtype
// holds it (in fp32), STORE(x) the stored element, TABLE(x) a cos / sin entry as the dtype holds it.
#define DEFINE_ROPE(NAME, T, LOAD, ROUND, STORE, TABLE)                                                   \
    int NAME(const T* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const int64_t* positions, \
             const float* cos, const float* sin, int64_t max_positions, T* out) {                           \
        const int64_t half = dim / 2;                                                                        \
        for (int64_t r = 0; r < n; r++)                                                                      \
            if (positions[r] < 0 || positions[r] >= max_positions) return -1;                                \
        for (int64_t r = 0; r < n; r++) {                                                                    \
            const float* c = cos + positions[r] * dim;                                                       \
            const float* s = sin + positions[r] * dim;                                                       \
            for (int64_t h = 0; h < heads; h++) {                                                            \
                const T* v = x + r * x_stride + h * dim;                                                     \
                T* o = out + (r * heads + h) * dim;                                                          \
                for (int64_t i = 0; i < half; i++) {                                                         \
                    const float lo = LOAD(v[i]), hi = LOAD(v[i + half]);                                     \
                    const float a = ROUND(lo * TABLE(c[i])), b = ROUND(hi * TABLE(s[i]));                    \
                    const float e = ROUND(hi * TABLE(c[i + half])), f = ROUND(lo * TABLE(s[i + half]));      \
                    o[i] = STORE(a - b);                                                                     \
                    o[i + half] = STORE(e + f);                                                              \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        return 0;                                                                                            \
    }
#define SAME(x) (x)
DEFINE_ROPE(rope_f32, float, SAME, SAME, SAME, SAME)

// out [n, inter] = silu(gate) * up, gate_up [n, 2 * inter] (gate first) with row stride `stride`;
// silu(g) = g / (1 + exp(-g)).
void silu_mul_f32(const float* gate_up, int64_t stride, int64_t n, int64_t inter, float* out) {
    for (int64_t r = 0; r < n; r++) {
        const float* g = gate_up + r * stride;
        const float* u = g + inter;
        float* o = out + r * inter;
#ifdef LAYER_OPS_AVX2
        MAP8(inter, g, u,
             _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                          exp8(_mm256_sub_ps(_mm256_setzero_ps(), a)))), b),
             if (w == LANES) _mm256_storeu_ps(o + i, value);
             else { _mm256_storeu_ps(res, value); memcpy(o + i, res, w * sizeof(float)); })
#else
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
#endif
    }
}

// ---- bf16 rows (the bf16 compute dtype's glue; pdserve.runtime.kernels.cpu_layer_ops) ----
// Each rounds to bf16 where torch's reference path (torch_ops.*_torch) does, and computes between
// the roundings in fp32 as torch does: products and sums of two bf16 values are exact or rounded once
// in fp32 alike, so RoPE equals torch's bit for bit; RMSNorm's mean and SiLU's exp are fp32 values
// within an ulp or two of torch's, so those outputs may differ from torch's by one bf16 ulp, rarely.

// f32_of (exact widening) and bf16_round (nearest even, as torch): bf16.h.

#ifdef LAYER_OPS_AVX2
// 8 bf16 -> 8 fp32 (exact), and 8 fp32 -> 8 bf16 rounded as bf16_round.
static inline __m256 load8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m128i round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    // 32 -> 16 bits (every value fits): packus works within 128-bit lanes, the permute joins them.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

static inline __m256 rounded8(__m256 v) {  // v rounded to bf16, back in fp32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(round8_bf16(v)), 16));
}

// The first w of 8 values rounded to bf16 into dst.
static inline void store_bf16(uint16_t* dst, int64_t w, __m256 v) {
    const __m128i r = round8_bf16(v);
    if (w == LANES) {
        _mm_storeu_si128((__m128i*)dst, r);
    } else {
        uint16_t t[LANES];
        _mm_storeu_si128((__m128i*)t, r);
        memcpy(dst, t, w * sizeof(uint16_t));
    }
}

// MAP8 over bf16 rows (computed in fp32), the results rounded to bf16 into out.
#define MAP8_BF16(n, SRC_A, SRC_B, out, BODY) \
    MAP8_T(uint16_t, load8_bf16, n, SRC_A, SRC_B, BODY, store_bf16((out) + i, w, value))
#endif

#ifdef LAYER_OPS_AVX512
// The same at 16 lanes; a row's tail through masked loads (zeros past it) and masked stores.
static inline __mmask16 lanes16(int64_t n, int64_t i) {
    return n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1u);
}

static inline __m512 load16_bf16(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m512i round16_bf16(__m512 v) {  // bf16_round of each lane, in the low 16 bits
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                  _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

static inline __m512 rounded16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(round16_bf16(v), 16)); }

static inline void store16_bf16(uint16_t* dst, __mmask16 m, __m512 v) {
    _mm256_mask_storeu_epi16(dst, m, _mm512_cvtepi32_epi16(round16_bf16(v)));
}

// VALUE(a, b) of 16 elements at a time of bf16 rows a and b (fp32 math), rounded to bf16 into out.
#define MAP16_BF16(n, SRC_A, SRC_B, out, VALUE)                                             \
    for (int64_t i = 0; i < (n); i += 16) {                                                 \
        const __mmask16 m = lanes16(n, i);                                                  \
        const __m512 a = load16_bf16((SRC_A) + i, m), b = load16_bf16((SRC_B) + i, m);      \
        store16_bf16((out) + i, m, VALUE);                                                  \
    }
#endif

// The sum of the squares of a bf16 row: squares of bf16 values are exact in double, and so (short
// of a 2^37 spread) are their sums, in any order; partial sums, so that the additions do not wait on
// each other.
static double sum_squares_bf16(const uint16_t* src, int64_t d) {
#if defined(LAYER_OPS_AVX512)
    __m512d part[4] = {_mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd(), _mm512_setzero_pd()};
    for (int64_t i = 0; i < d; i += 16) {
        const __m512 v = load16_bf16(src + i, lanes16(d, i));  // zeros past the row add nothing
        const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        const __m512d b = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        const int k = (int)(i / 16) & 1;
        part[k] = _mm512_fmadd_pd(a, a, part[k]);  // the product is exact: fused or not, the same sum
        part[2 + k] = _mm512_fmadd_pd(b, b, part[2 + k]);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_add_pd(part[0], part[1]), _mm512_add_pd(part[2], part[3])));
#else
    double part[LANES] = {0};
    int64_t i = 0;
#ifdef LAYER_OPS_AVX2
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (; i + LANES <= d; i += LANES) {
        const __m256 v = load8_bf16(src + i);
        const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        lo = _mm256_fmadd_pd(a, a, lo);
        hi = _mm256_fmadd_pd(b, b, hi);
    }
    _mm256_storeu_pd(part, lo);
    _mm256_storeu_pd(part + 4, hi);
#endif
    for (; i < d; i++) part[i % LANES] += (double)f32_of(src[i]) * f32_of(src[i]);
    double ss = 0.0;
    for (int l = 0; l < LANES; l++) ss += part[l];
    return ss;
#endif
}

// As add_rms_norm_f32, in bf16: summed = bf16(x + residual), out = bf16(weight * bf16(summed * inv)),
// inv = 1 / sqrt(mean(summed^2) + eps) from a double sum, rounded once to fp32.
void add_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* residual, const uint16_t* weight,
                       int64_t n, int64_t d, float eps, uint16_t* out, uint16_t* summed) {
    for (int64_t r = 0; r < n; r++) {
        const uint16_t* xr = x + r * x_stride;
        uint16_t* s = residual != NULL ? summed + r * d : NULL;
        if (s != NULL) {
#if defined(LAYER_OPS_AVX512)
            MAP16_BF16(d, xr, residual + r * d, s, _mm512_add_ps(a, b))
#elif defined(LAYER_OPS_AVX2)
            MAP8_BF16(d, xr, residual + r * d, s, _mm256_add_ps(a, b))
#else
            for (int64_t i = 0; i < d; i++) s[i] = bf16_round(f32_of(xr[i]) + f32_of(residual[r * d + i]));
#endif
        }
        const uint16_t* src = s != NULL ? s : xr;
        const float inv = (float)(1.0 / sqrt(sum_squares_bf16(src, d) / (double)d + (double)eps));
#if defined(LAYER_OPS_AVX512)
        const __m512 scale = _mm512_set1_ps(inv);
        MAP16_BF16(d, src, weight, out + r * d, _mm512_mul_ps(b, rounded16(_mm512_mul_ps(a, scale))))
#elif defined(LAYER_OPS_AVX2)
        const __m256 scale = _mm256_set1_ps(inv);
        MAP8_BF16(d, src, weight, out + r * d, _mm256_mul_ps(b, rounded8(_mm256_mul_ps(a, scale))))
#else
        for (int64_t i = 0; i < d; i++)
            out[r * d + i] = bf16_round(f32_of(weight[i]) * f32_of(bf16_round(f32_of(src[i]) * inv)));
#endif
    }
}

// As silu_mul_f32, in bf16 as torch's silu(gate) * up rounds: bf16(bf16(silu(g)) * u). The bf16
// steps of few rows run it (cpu_layer_ops.SMALL_STEP_ROWS), eager and one-call alike; larger ones
// take torch's, whose vectorized exp can differ from exp8 in the last fp32 bit.
void silu_mul_bf16(const uint16_t* gate_up, int64_t stride, int64_t n, int64_t inter, uint16_t* out) {
    for (int64_t r = 0; r < n; r++) {
        const uint16_t* g = gate_up + r * stride;
        const uint16_t* u = g + inter;
        uint16_t* o = out + r * inter;
#if defined(LAYER_OPS_AVX512)
        MAP16_BF16(inter, g, u, o,
                   _mm512_mul_ps(rounded16(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                          exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))))),
                                 b))
#elif defined(LAYER_OPS_AVX2)
        MAP8_BF16(inter, g, u, o,
                  _mm256_mul_ps(rounded8(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                        exp8(_mm256_sub_ps(_mm256_setzero_ps(), a))))),
                                b))
#else
        for (int64_t i = 0; i < inter; i++)
            o[i] = bf16_round(f32_of(bf16_round(f32_of(g[i]) / (1.0f + exp1(-f32_of(g[i]))))) * f32_of(u[i]));
#endif
    }
}

// As rope_f32, in bf16 as torch_ops.apply_rope_torch computes it: cos and sin rounded to bf16, each
// product rounded to bf16, then their difference (sum) rounded: bf16(bf16(x[i] c[i]) - bf16(x[i + h] s[i])),
// which is torch's bf16(bf16(x[i] c[i]) + bf16(-x[i + h] s[i])) (rounding to nearest even is symmetric).
// Scalar, or 16 of a head's positions at a time where the CPU has AVX-512.
#define ROUNDED_BF16(x) f32_of(bf16_round(x))
#ifndef LAYER_OPS_AVX512
DEFINE_ROPE(rope_bf16, uint16_t, f32_of, ROUNDED_BF16, bf16_round, ROUNDED_BF16)
#else
// The same arithmetic, 16 of a head's first-half positions i at a time (a row's tables rounded once
// for all its heads).
int rope_bf16(const uint16_t* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const int64_t* positions,
              const float* cos, const float* sin, int64_t max_positions, uint16_t* out) {
    const int64_t half = dim / 2;
    for (int64_t r = 0; r < n; r++)
        if (positions[r] < 0 || positions[r] >= max_positions) return -1;
    for (int64_t r = 0; r < n; r++) {
        const float* c = cos + positions[r] * dim;
        const float* s = sin + positions[r] * dim;
        for (int64_t i = 0; i < half; i += 16) {
            const __mmask16 m = lanes16(half, i);
            const __m512 c_lo = rounded16(_mm512_maskz_loadu_ps(m, c + i));
            const __m512 s_lo = rounded16(_mm512_maskz_loadu_ps(m, s + i));
            const __m512 c_hi = rounded16(_mm512_maskz_loadu_ps(m, c + i + half));
            const __m512 s_hi = rounded16(_mm512_maskz_loadu_ps(m, s + i + half));
            for (int64_t h = 0; h < heads; h++) {
                const uint16_t* v = x + r * x_stride + h * dim;
                uint16_t* o = out + (r * heads + h) * dim;
                const __m512 lo = load16_bf16(v + i, m), hi = load16_bf16(v + i + half, m);
                const __m512 a = rounded16(_mm512_mul_ps(lo, c_lo)), b = rounded16(_mm512_mul_ps(hi, s_lo));
                const __m512 e = rounded16(_mm512_mul_ps(hi, c_hi)), f = rounded16(_mm512_mul_ps(lo, s_hi));
                store16_bf16(o + i, m, _mm512_sub_ps(a, b));
                store16_bf16(o + i + half, m, _mm512_add_ps(e, f));
            }
        }
    }
    return 0;
}
#endif

// The largest of x[0 .. n) (NaNs skipped, as by x > mx ? x : mx: the vector max keeps its second
// operand where either is a NaN); -inf for an empty row. Any order gives the same value.
static float row_max(const float* x, int64_t n) {
    float mx = -INFINITY;
    int64_t i = 0;
#if defined(LAYER_OPS_AVX512)
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(x + i), m);
    mx = _mm512_reduce_max_ps(m);
#elif defined(LAYER_OPS_AVX2)
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; i + LANES <= n; i += LANES) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
    float part[LANES];
    _mm256_storeu_ps(part, m);
    for (int l = 0; l < LANES; l++) mx = part[l] > mx ? part[l] : mx;
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    return mx;
}

// x[i] = exp(x[i] - mx) for i < len; lane[l] += the new x[i] of i = l mod 8, in order of i (the
// same sums at either vector width: 16 lanes add their two halves in turn).
static void exp_rows_sum(float* x, int64_t len, float mx, float lane[LANES]) {
#if defined(LAYER_OPS_AVX512)
    const __m512 m = _mm512_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 16) {
        const __mmask16 k = lanes16(len, i);
        const __m512 value = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), m));
        _mm512_mask_storeu_ps(x + i, k, value);
        float res[16];
        _mm512_storeu_ps(res, value);
        for (int half = 0; half < 2; half++) {
            const int64_t w = len - i - 8 * half;
            if (w >= LANES) acc = _mm256_add_ps(acc, _mm256_loadu_ps(res + 8 * half));
            else for (int64_t l = 0; l < w; l++) lane[l] += res[8 * half + l];
        }
    }
    float part[LANES];
    _mm256_storeu_ps(part, acc);
    for (int l = 0; l < LANES; l++) lane[l] += part[l];
#elif defined(LAYER_OPS_AVX2)
    const __m256 m = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    MAP8(len, x, x, exp8(_mm256_sub_ps(a, m)),
         if (w == LANES) {
             _mm256_storeu_ps(x + i, value);
             acc = _mm256_add_ps(acc, value);
         } else {
             _mm256_storeu_ps(res, value);
             memcpy(x + i, res, w * sizeof(float));
             for (int64_t l = 0; l < w; l++) lane[l] += res[l];
         })
    float part[LANES];
    _mm256_storeu_ps(part, acc);
    for (int l = 0; l < LANES; l++) lane[l] += part[l];
#else
    for (int64_t i = 0; i < len; i++) {
        x[i] = exp1(x[i] - mx);
        lane[i % LANES] += x[i];
    }
#endif
}

// In place: each of `rows` rows of t_pad scores becomes the softmax of its first len[row / per_len]
// values (those past it are left as they are: nobody reads them). Sums in a fixed order.
void softmax_rows_f32(float* scores, int64_t rows, int64_t t_pad, int64_t per_len, const int64_t* lens) {
    for (int64_t row = 0; row < rows; row++) {
        float* x = scores + row * t_pad;
        const int64_t len = lens[row / per_len];
        float lane[LANES] = {0};
        exp_rows_sum(x, len, row_max(x, len), lane);
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += lane[l];
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < len; i++) x[i] *= inv;
    }
}

// out[r] = the index of row r's largest value (`rows` rows of `cols` floats, `stride` apart), as torch's
// max(dim=-1).indices: the first maximal one, or the first NaN where the row has any. Why in C: torch's
// CPU max-with-indices is a scalar loop, 1.1 ms of a 28-sequence decode step's 48 at one thread over
// SmolLM2's 49,152 logits (2.5 %), where a vectorized max and a search for its first match take a
// tenth of that. Two passes a row; the second stops at the match (from the L2 cache).
static int64_t row_argmax(const float* x, int64_t n) {
    float mx = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(LAYER_OPS_AVX512)
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        m = _mm512_max_ps(v, m);  // a NaN lane keeps m: NaNs are counted apart
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    mx = _mm512_reduce_max_ps(m);
    nan = unordered != 0;
#endif
    for (; i < n; i++) {
        nan |= isnan(x[i]);
        mx = x[i] > mx ? x[i] : mx;
    }
    i = 0;
    if (nan) {
        while (!isnan(x[i])) i++;
        return i;
    }
#if defined(LAYER_OPS_AVX512)
    const __m512 target = _mm512_set1_ps(mx);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == mx) return i;
    return 0;  // an empty row
}

void argmax_rows_f32(const float* x, int64_t rows, int64_t cols, int64_t stride, int64_t* out) {
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax(x + r * stride, cols);
}

// Rows k[i], v[i] ([row_bytes] each, row strides in bytes) into token slot slots[i] of a float cache
// [num_blocks, layers, 2, block_size, row]: the slot's K row at block * block_stride + k_offset +
// offset * row_bytes, its V row block_size rows further (all in bytes). A negative slot is padding,
// skipped (as the CUDA write skips it). Returns -1, writing nothing, where a slot is past the cache's
// num_slots = num_blocks * block_size.
int kv_write_rows(char* cache, const char* k, int64_t k_stride, const char* v, int64_t v_stride, const int64_t* slots,
                  int64_t n, int64_t row_bytes, int64_t block_size, int64_t block_stride, int64_t k_offset,
                  int64_t num_slots) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] >= num_slots) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0) continue;
        char* dst = cache + (slots[i] / block_size) * block_stride + k_offset + (slots[i] % block_size) * row_bytes;
        memcpy(dst, k + i * k_stride, (size_t)row_bytes);
        memcpy(dst + block_size * row_bytes, v + i * v_stride, (size_t)row_bytes);
    }
    return 0;
}
