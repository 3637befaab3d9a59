// The 8-bit output head times bf16 hidden states on CPUs with AVX512-BF16 (called through
// pdserve.runtime.kernels.cpu_int4_matmul.matmul_int8_bf16, for pdserve.quant.q8_head).
//
// Why hand-written: a decode step of a few streams reads the whole head (SmolLM2's tied 49152 x 576
// weight: 57 MB in bf16), the largest single read of a one-stream step once the projections are
// 4-bit. Its Q8_0 codes are half those bytes, and no torch kernel multiplies int8 weights with bf16
// inputs without first writing the dense weight out. Here each group's 32 codes become bf16 weights
// in registers, exactly the weights Q8Head.dequantize().to(bf16) holds, and `vdpbf16ps` multiplies
// them with the inputs, summing in fp32: the products the dense bf16 matmul sums, in another order.
// No input quantization (unlike int4_matmul.c's fp32 path), and each output is summed in one fixed
// order whatever the row count, tile or thread: a row's logits do not depend on what else its step
// holds.
//
//   w[n, k] = bf16(q[n, k] * scale[n, k / 32])      (q in -127..127)
//
// Layouts: codes [N, K] int8 in input order, scale [N, K / 32] fp32; x [M, K] bf16 with row stride
// (K a multiple of 32); y [M, N] fp32 with row stride.
//
// Measured on a 2-core Xeon (AVX512-BF16, one thread; SmolLM2's head): 1.98 ms against 3.50 for the
// dense bf16 matmul at one row, even at 4 rows, slower from 8 (oneDNN's dense matmul uses AMX there).
// A 4-bit variant for the projections (a 32-entry bf16 table a pair of groups, looked up by vpermw)
// lost to torch's int4 kernel at every row count on that CPU (0.21 against 0.17 ms at one row for
// 6144 x 576: the table's construction is ALU-bound) and was dropped.
#include "q8_widen.h"
#include "threads.h"
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF16_DOT 1
#endif

#define GROUP 32

// 1 where this build has the kernel (AVX512-BF16), else 0 and int8_linear_bf16 returns -2.
int bf16_dot_available(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}

#ifdef BF16_DOT
#define OUT_TILE 2  // output rows a tile: 2 x 8 accumulators beside 2 weight and 1 input vectors
#define IN_TILE 8   // input rows a tile

// One group's 32 codes -> its bf16 weights, in input order.
static inline __attribute__((always_inline)) __m512i group_weights(const int8_t* codes, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    return q8_widen32(codes, s, s);
}

// y for output rows [n, n + nr) and input rows [r, r + mt): nr x mt accumulators over all of K, each
// output summed lane by lane over the groups in order, then across its 16 lanes. Inlined with
// constant nr and mt (the dispatch below), so the accumulators stay in registers.
static inline __attribute__((always_inline)) void tile(const int8_t* codes, const float* scale, int64_t n, int nr,
                                                       int64_t k, const uint16_t* x, int64_t x_stride, int64_t r,
                                                       int mt, float* y, int64_t y_stride) {
    const int64_t groups = k / GROUP;
    __m512 acc[OUT_TILE][IN_TILE];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i w[OUT_TILE];
        for (int i = 0; i < nr; i++) {
            __builtin_prefetch(codes + (n + i + 8) * k + g * GROUP);  // 4 tiles ahead, as int4_matmul.c
            w[i] = group_weights(codes + (n + i) * k + g * GROUP, scale[(n + i) * groups + g]);
        }
        for (int j = 0; j < mt; j++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r + j) * x_stride + g * GROUP);
            for (int i = 0; i < nr; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)w[i], xv);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++) y[(r + j) * y_stride + n + i] = _mm512_reduce_add_ps(acc[i][j]);
}

#define TILE(NR, MT) tile(codes, scale, n, NR, k, x, x_stride, r, MT, y, y_stride)

static void tile_dispatch(const int8_t* codes, const float* scale, int64_t n, int nr, int64_t k, const uint16_t* x,
                          int64_t x_stride, int64_t r, int mt, float* y, int64_t y_stride) {
#define TILE_CASES(MT)                    \
    case 2 * 16 + MT: TILE(2, MT); break; \
    case 1 * 16 + MT: TILE(1, MT); break;
    switch (nr * 16 + mt) {
        TILE_CASES(8) TILE_CASES(7) TILE_CASES(6) TILE_CASES(5) TILE_CASES(4) TILE_CASES(3) TILE_CASES(2)
        case 2 * 16 + 1: TILE(2, 1); break;
        default: TILE(1, 1); break;
    }
}
#endif  // BF16_DOT

// codes [N, K] times x [M, K] bf16 -> y [M, N] fp32 for output rows [n0, n1). Returns 0, or -2 where
// this build lacks AVX512-BF16 or K is not a multiple of 32.
int int8_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* codes, const float* scale,
                     int64_t n0, int64_t n1, float* y, int64_t y_stride) {
#ifdef BF16_DOT
    if (k % GROUP) return -2;
    for (int64_t n = n0; n < n1; n += OUT_TILE) {
        const int nr = n + OUT_TILE <= n1 ? OUT_TILE : (int)(n1 - n);
        for (int64_t r = 0; r < m; r += IN_TILE)
            tile_dispatch(codes, scale, n, nr, k, x, x_stride, r, r + IN_TILE <= m ? IN_TILE : (int)(m - r), y, y_stride);
    }
    return 0;
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)codes, (void)scale, (void)n0, (void)n1, (void)y, (void)y_stride;
    return -2;
#endif
}

// The entry point Python calls (cpu_int4_matmul): split over threads (threads.h).
int int8_linear_bf16_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* codes,
                             const float* scale, int64_t n, float* y, int64_t y_stride, int64_t threads) {
    LINEAR_THREADS(int8_linear_bf16(x, m, k, x_stride, codes, scale, n0, n1, y, y_stride))
}
