// bf16 <-> fp32 for the library's units (layer_ops.c, int4_matmul.c): widening is exact, rounding is
// to nearest even as torch's float -> bfloat16 (a NaN stays a quiet NaN). Part of the library's
// cache key (cpu_attention.HEADERS), so a change here rebuilds it.
#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float f32_of(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// bf16 rows [m, k] (row stride x_stride) -> fp32 rows [m, k], contiguous.
static inline void bf16_rows_to_f32(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, float* out) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++) out[r * k + i] = f32_of(x[r * x_stride + i]);
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
#endif
