// 32 of an 8-bit head's codes -> their bf16 weights, bf16(q * scale): the widening both of its bf16
// kernels share (bf16_matmul.c, one group of one output row a vector; int4_amx.c, one line of an AMX
// tile, 16 outputs' pairs). q is exact in fp32 and its product with a Q8_0 scale (an fp16) is too, so
// the one rounding is to bf16: the loaded weight's bits. Part of the library's cache key
// (cpu_attention.HEADERS).
#ifndef PDSERVE_Q8_WIDEN_H
#define PDSERVE_Q8_WIDEN_H
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <stdint.h>

// codes[0..15] scaled by scale_lo's lanes, codes[16..31] by scale_hi's: words 0-15, then 16-31.
static inline __attribute__((always_inline)) __m512i q8_widen32(const int8_t* codes, __m512 scale_lo,
                                                                __m512 scale_hi) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)codes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale_hi), _mm512_mul_ps(lo, scale_lo));
}
#endif
#endif
