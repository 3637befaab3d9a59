// sums16: 16 AVX-512 vectors' horizontal sums as one vector (paged_attention.c's and
// paged_attention_i8.c's scores passes). Include where AVX-512 is on.
#ifndef PDSERVE_SUMS16_H
#define PDSERVE_SUMS16_H
#include <immintrin.h>

// 16 vectors' horizontal sums as one vector: lane i is the sum of v[i]'s lanes. A transposing
// reduction (pairs of vectors, then 64-bit pairs, then 128-bit lanes twice): 15 shuffle-and-add
// steps for 16 sums, where 16 separate reductions take 4 dependent steps each.
static inline __m512 sums16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  // lanes 4j, 4j + 2: v[2i]'s partials; 4j + 1, 4j + 3: v[2i + 1]'s
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // 128-bit lane j: the j-th partials of v[4i .. 4i + 3]
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)  // 128-bit lanes: v[8i .. 8i + 3] and v[8i + 4 .. 8i + 7], two partials each
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

#endif
