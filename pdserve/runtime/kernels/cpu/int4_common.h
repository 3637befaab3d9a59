// What the 4- and 8-bit weight kernels share: int4_matmul.c (int8 inputs) and int4_exact.c (fp32
// inputs as they are) read the same codes, scales and mins (layouts: int4_matmul.c's head comment).
#ifndef PDSERVE_INT4_COMMON_H
#define PDSERVE_INT4_COMMON_H

#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT4_AVX2 1
#endif

#define GROUP 32  // inputs a scale (and min) covers

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
