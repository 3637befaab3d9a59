// 4-bit codes times int8-quantized bf16 inputs as a register-tiled GEMM on AVX512-VNNI
// (pdserve.runtime.kernels.cpu_int4_matmul.matmul_q8_gemm): the sums of int4_matmul.c, for steps of
// many rows (decode batches) on a CPU without AMX.
//
// Why a second kernel for the same sums: int4_matmul.c keeps each (output, input row) pair's dot in
// the lanes of one vector and reduces it at the end, which suits one to four rows (bound by reading
// the codes) but spends a convert, a multiply and an fma of fp32 per vpdpbusd. Here the lanes hold 16
// outputs: a vpdpbusd multiplies 16 outputs' 4 codes by one input row's 4 values (broadcast), 8 of them
// finish a group of 32, and the group's scale is applied once per 16 outputs and row. On a 2-core Zen 4
// (AVX512-BF16 and VNNI, no AMX) SmolLM2's 30 layers' projections at 32 rows took 39 ms against oneDNN's
// packed bf16 matmul's 58 (one thread, weights from memory; 8 rows 17 against 25).
//
//   y[m, n] = sum_g scale[n, g] * xd[m, g] * sum_{k in g} q[n, k] xq[m, k] + mins[n, g] * xsum[m, g]
//
// with xq, xd, xsum the inputs' int8 quantization per group of 32, int4_matmul.c's (`q8_inputs`,
// int4_common.h: xd = max |x| / 127, codes rounded half to even, xsum the quantized inputs' sum): the same
// numbers as int4_linear_bf16, summed in another order (outputs agree to fp32 rounding).
//
// Layouts (cpu_int4_matmul.q8_gemm_panels): codes [N / 16, K / 8, 16, 4] uint8, two codes a byte:
// byte i of lane l of block j of panel b holds output 16 b + l's input 8 j + i (low nibble) and
// 8 j + 4 + i (high), so one 64-byte load is two vpdpbusd operands after a mask and a shift (half
// the bytes of a code a byte: 39 -> 32 ms for SmolLM2's 30 layers at 32 rows, weights from memory);
// scale and mins [N / 16, K / 32, 16] fp32.
#include "bf16.h"
#include "int4_common.h"
#include "threads.h"

#define ROWS 4  // input rows a tile takes: ROWS x 2 x 2 accumulators beside the codes

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void zero_ps(__m512 a[ROWS][2], int nr, int nb) {
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nb; c++) a[i][c] = _mm512_setzero_ps();
}

static inline __attribute__((always_inline)) void zero_si(__m512i a[ROWS][2], int nr, int nb) {
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nb; c++) a[i][c] = _mm512_setzero_si512();
}

// Group g's integer sums of rows [r, r + nr) and panels [b, b + nb) into their fp32 accumulators:
// acc += dot * scale * xd + mins * xsum.
static inline __attribute__((always_inline)) void finish_group(__m512 acc[ROWS][2], __m512i dot[ROWS][2],
                                                               const float* scale, const float* mins, int64_t b,
                                                               int nb, int64_t groups, int64_t g, const float* xd,
                                                               const float* xsum, int64_t r, int nr) {
    for (int c = 0; c < nb; c++) {
        const __m512 s = _mm512_loadu_ps(scale + ((b + c) * groups + g) * 16);
        const __m512 mn = _mm512_loadu_ps(mins + ((b + c) * groups + g) * 16);
        for (int i = 0; i < nr; i++) {
            const __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(xd[(r + i) * groups + g]));
            acc[i][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][c]), sx, acc[i][c]);
            acc[i][c] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[(r + i) * groups + g]), acc[i][c]);
        }
    }
}

// The panels a tile reads come from memory once a call (its other row tiles find them in the caches), and
// at a decode step's few rows the first tile waited on them: while a pair's first row tile computes group g,
// the next pair's group g (`next` panels from panel b + 2: codes, scale, mins) is fetched into L2.
// SmolLM2's 30 layers (benchmarks/q8_gemm_bench.py, one thread, 2-core Zen 4): 11.2 / 19.5 / 29.1 ms at
// 8 / 20 / 32 rows without, 7.8 / 16.5 / 25.0 with (into L1: 9.8 / 18.1 / 26.7; two pairs ahead: no better).
static inline __attribute__((always_inline)) void prefetch_next_pair(const uint8_t* codes, const float* scale,
                                                                     const float* mins, int64_t b, int next,
                                                                     int64_t panel, int64_t group_bytes,
                                                                     int64_t groups, int64_t g) {
    for (int c = 0; c < next; c++) {
        const char* group_codes = (const char*)(codes + (b + 2 + c) * panel + g * group_bytes);
        for (int64_t i = 0; i < group_bytes; i += 64) __builtin_prefetch(group_codes + i, 0, 2);
        __builtin_prefetch(scale + ((b + 2 + c) * groups + g) * 16, 0, 2);
        if (mins != NULL) __builtin_prefetch(mins + ((b + 2 + c) * groups + g) * 16, 0, 2);
    }
}

// y for rows [r, r + NR) and outputs of panels [b, b + NB) (16 each), rounded to bf16 with bias.
static inline __attribute__((always_inline)) void tile(const uint8_t* codes, const float* scale, const float* mins,
                                                       const float* bias, int64_t b, int nb, int64_t k,
                                                       const int8_t* xq, const float* xd, const float* xsum,
                                                       int64_t r, int nr, uint16_t* y, int64_t y_stride, int next) {
    const int64_t groups = k / GROUP, panel = k * 8;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS][2];
    zero_ps(acc, nr, nb);
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[ROWS][2];
        zero_si(dot, nr, nb);
        prefetch_next_pair(codes, scale, mins, b, next, panel, GROUP * 8, groups, g);
        for (int j = 0; j < GROUP / 8; j++) {
            __m512i lo[2], hi[2];
            for (int c = 0; c < nb; c++) {
                const __m512i w = _mm512_loadu_si512((const void*)(codes + (b + c) * panel + (g * GROUP + 8 * j) * 8));
                lo[c] = _mm512_and_si512(w, low4);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
            }
            for (int i = 0; i < nr; i++) {
                const int8_t* xr = xq + (r + i) * k + g * GROUP + 8 * j;
                const __m512i x0 = _mm512_set1_epi32(*(const int32_t*)xr);
                const __m512i x1 = _mm512_set1_epi32(*(const int32_t*)(xr + 4));
                for (int c = 0; c < nb; c++)
                    dot[i][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[i][c], lo[c], x0), hi[c], x1);
            }
        }
        finish_group(acc, dot, scale, mins, b, nb, groups, g, xd, xsum, r, nr);
    }
    for (int c = 0; c < nb; c++) {
        const __m512 bv = bias != NULL ? _mm512_loadu_ps(bias + (b + c) * 16) : _mm512_setzero_ps();
        for (int i = 0; i < nr; i++) {
            float out[16];
            _mm512_storeu_ps(out, _mm512_add_ps(acc[i][c], bv));
            uint16_t* row = y + (r + i) * y_stride + (b + c) * 16;
            for (int l = 0; l < 16; l++) row[l] = bf16_round(out[l]);
        }
    }
}

// One group of 32 bf16 inputs quantized as q8_quantize_groups quantizes their fp32 widening (exact),
// with the same bits: the same max |x| and d = max / 127, inputs times 1 / d rounded half to even
// (vcvtps2dq in the default rounding mode, as rintf), the codes' exact sum. Vectorized because the
// scalar loop (widen, then a rintf an input) was 8 % of a 200-token prefill and 4 % of a 20-sequence
// decode step (perf, SmolLM2 bf16 on a 2-core Zen 4).
static inline __m512 widen_bf16x16(__m256i v) {  // exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

static inline void q8_group_bf16(const uint16_t* v, int8_t* out, float* xd, float* xsum, int32_t* qsum) {
    const __m512i raw = _mm512_loadu_si512((const void*)v);  // 32 bf16
    const __m512 lo = widen_bf16x16(_mm512_castsi512_si256(raw)), hi = widen_bf16x16(_mm512_extracti64x4_epi64(raw, 1));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / QMAX;
    const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtsepi32_epi8(qhi));
    *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    *xd = d;
    *xsum = (float)*qsum * d;
}

// x [m, k] bf16 quantized as int4_linear_bf16 quantizes it (in input order), with the codes' sums
// (qsum), in one block of the caller's (free(q.xq)); q.xq NULL where memory is short.
static Q8Inputs bf16_q8_inputs(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride) {
    const int64_t groups = k / GROUP;
    Q8Inputs q = {malloc((size_t)(m * k) + 3 * sizeof(float) * (size_t)(m * groups)), NULL, NULL, NULL};
    if (q.xq == NULL) return q;
    q.xd = (float*)(q.xq + m * k);  // m * k is a multiple of 32: aligned for floats
    q.xsum = q.xd + m * groups;
    q.qsum = (int32_t*)(q.xsum + m * groups);
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t i = r * groups + g;
            q8_group_bf16(x + r * x_stride + g * GROUP, q.xq + r * k + g * GROUP, q.xd + i, q.xsum + i, q.qsum + i);
        }
    return q;
}

// Entry for tests: bf16_q8_inputs' codes, xd and xsum of x [m, k] into caller's arrays. Returns 0, or -1.
int q8_quantize_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, int8_t* xq, float* xd, float* xsum) {
    const Q8Inputs q = bf16_q8_inputs(x, m, k, x_stride);
    if (q.xq == NULL) return -1;
    memcpy(xq, q.xq, (size_t)(m * k));
    memcpy(xd, q.xd, sizeof(float) * (size_t)(m * (k / GROUP)));
    memcpy(xsum, q.xsum, sizeof(float) * (size_t)(m * (k / GROUP)));
    free(q.xq);
    return 0;
}

// Every tile of outputs [n0, n1) (pairs of panels) and the m rows (ROWS at a time): TILES(nb) with b, r, nr
// set, and `next` the panels of the next pair that the pair's first row tile fetches (prefetch_next_pair).
#define FOR_TILES(TILES)                                                          \
    for (int64_t b = n0 / 16; b < n1 / 16; b += 2) {                              \
        const int nb = b + 2 <= n1 / 16 ? 2 : 1;                                  \
        const int64_t after = n1 / 16 - (b + 2);                                  \
        for (int64_t r = 0; r < m; r += ROWS) {                                   \
            const int nr = r + ROWS <= m ? ROWS : (int)(m - r);                   \
            const int next = r > 0 || after <= 0 ? 0 : after >= 2 ? 2 : 1;        \
            if (nb == 2) {                                                        \
                TILES(2)                                                          \
            } else {                                                              \
                TILES(1)                                                          \
            }                                                                     \
        }                                                                         \
    }

// TILE_FN(nr, NB) with nr (1..ROWS) a constant, so that each tile's loops unroll.
#define BY_ROWS(TILE_FN, NB)                          \
    switch (nr) {                                     \
        case 4: TILE_FN(4, NB); break;                \
        case 3: TILE_FN(3, NB); break;                \
        case 2: TILE_FN(2, NB); break;                \
        default: TILE_FN(1, NB); break;               \
    }

#define TILE(NR, NB) tile(codes, scale, mins, bias, b, NB, k, xq, xd, xsum, r, NR, y, y_stride, next)
#define TILE_ROWS(NB) BY_ROWS(TILE, NB)

// Outputs [n0, n1) (multiples of 16) of every row: the rows widened to fp32 (exact) and quantized, as
// int4_linear_bf16 does, into this call's own scratch. Also the one-call decode step's (decode_step.c).
int int4_q8_gemm_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                     const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, uint16_t* y,
                     int64_t y_stride) {
    const Q8Inputs q = bf16_q8_inputs(x, m, k, x_stride);
    if (q.xq == NULL) return -1;
    const int8_t* xq = q.xq;
    const float *xd = q.xd, *xsum = q.xsum;
    FOR_TILES(TILE_ROWS)
    free(q.xq);
    return 0;
}

int int4_q8_gemm_available(void) { return 1; }

// 8-bit codes (a GGUF's Q8_0 output head, quant.q8_head): codes [N / 16, K / 4, 16, 4] uint8, byte i of
// lane l of block j of panel b holding q + 128 (q in -127..127: vpdpbusd's unsigned operand) of output
// 16 b + l's input 4 j + i; scale [N / 16, K / 32, 16] fp32. y = sum_g scale * xd * sum q xq: the file's
// weights times the quantized inputs, as llama.cpp runs a Q8_0 head (its inputs quantized likewise).
// y fp32 (logits), no bias.
//
// A group's integer sum less 128 times the inputs' codes' sum is sum q xq exactly (|.| < 2^24: its fp32
// conversion exact too), scaled once: one fma a group, row and 16 outputs where the 4-bit tiles' finish
// (mins = -128 scale, before) took two and read the mins, 3.5 MB more a step for SmolLM2's head. (Its two
// terms, each about 128 times the result, cancelled in fp32: 2e-7 of the largest output off the float64
// sums against 1.2e-7 now.)
static inline __attribute__((always_inline)) void finish_group8(__m512 acc[ROWS][2], __m512i dot[ROWS][2],
                                                                const float* scale, int64_t b, int nb,
                                                                int64_t groups, int64_t g, const float* xd,
                                                                const int32_t* qsum, int64_t r, int nr) {
    for (int c = 0; c < nb; c++) {
        const __m512 s = _mm512_loadu_ps(scale + ((b + c) * groups + g) * 16);
        for (int i = 0; i < nr; i++) {
            const __m512i offset = _mm512_set1_epi32(128 * qsum[(r + i) * groups + g]);
            const __m512 sx = _mm512_mul_ps(s, _mm512_set1_ps(xd[(r + i) * groups + g]));
            acc[i][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[i][c], offset)), sx, acc[i][c]);
        }
    }
}

static inline __attribute__((always_inline)) void tile8(const uint8_t* codes, const float* scale, int64_t b, int nb,
                                                        int64_t k, const int8_t* xq, const float* xd,
                                                        const int32_t* qsum, int64_t r, int nr, float* y,
                                                        int64_t y_stride, int next) {
    const int64_t groups = k / GROUP, panel = k * 16;
    __m512 acc[ROWS][2];
    zero_ps(acc, nr, nb);
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[ROWS][2];
        zero_si(dot, nr, nb);
        prefetch_next_pair(codes, scale, NULL, b, next, panel, GROUP * 16, groups, g);
        for (int j = 0; j < GROUP / 4; j++) {
            __m512i w[2];
            for (int c = 0; c < nb; c++)
                w[c] = _mm512_loadu_si512((const void*)(codes + (b + c) * panel + (g * GROUP + 4 * j) * 16));
            for (int i = 0; i < nr; i++) {
                const __m512i x = _mm512_set1_epi32(*(const int32_t*)(xq + (r + i) * k + g * GROUP + 4 * j));
                for (int c = 0; c < nb; c++) dot[i][c] = _mm512_dpbusd_epi32(dot[i][c], w[c], x);
            }
        }
        finish_group8(acc, dot, scale, b, nb, groups, g, xd, qsum, r, nr);
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < nb; c++) _mm512_storeu_ps(y + (r + i) * y_stride + (b + c) * 16, acc[i][c]);
}

#define TILE8(NR, NB) tile8(codes, scale, b, NB, k, xq, xd, qsum, r, NR, y, y_stride, next)
#define TILE8_ROWS(NB) BY_ROWS(TILE8, NB)

// Outputs [n0, n1) (multiples of 16) of every row of x [m, k] bf16, as int4_q8_gemm_part quantizes them.
int int8_q8_gemm_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                      const float* scale, int64_t n0, int64_t n1, float* y, int64_t y_stride) {
    const Q8Inputs q = bf16_q8_inputs(x, m, k, x_stride);
    if (q.xq == NULL) return -1;
    const int8_t* xq = q.xq;
    const float* xd = q.xd;
    const int32_t* qsum = q.qsum;
    FOR_TILES(TILE8_ROWS)
    free(q.xq);
    return 0;
}

// x [m, k] bf16 -> y [m, n] fp32 over 8-bit codes (tile8), outputs split over `threads` parts of whole pairs
// of panels. n a multiple of 16, k of 32. Returns 0, or -1 without scratch.
int int8_q8_gemm_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                         const float* scale, int64_t n, float* y, int64_t y_stride, int64_t threads) {
    LINEAR_THREADS_ALIGNED(32, int8_q8_gemm_part(x, m, k, x_stride, codes, scale, n0, n1, y, y_stride))
}

// x [m, k] bf16 (row stride x_stride) -> y [m, n] bf16 (row stride y_stride), outputs split over
// `threads` parts of whole pairs of panels. n a multiple of 16, k of 32. Returns 0, or -1 without scratch.
int int4_q8_gemm_bf16_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                              const float* scale, const float* mins, const float* bias, int64_t n, uint16_t* y,
                              int64_t y_stride, int64_t threads) {
    LINEAR_THREADS_ALIGNED(32, int4_q8_gemm_part(x, m, k, x_stride, codes, scale, mins, bias, n0, n1, y, y_stride))
}
#else
int int4_q8_gemm_available(void) { return 0; }

int q8_quantize_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, int8_t* xq, float* xd, float* xsum) {
    return -2;
}

int int8_q8_gemm_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                         const float* scale, int64_t n, float* y, int64_t y_stride, int64_t threads) {
    return -2;
}

int int4_q8_gemm_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                      const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, uint16_t* y,
                      int64_t y_stride) {
    return -2;
}

int int4_q8_gemm_bf16_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                              const float* scale, const float* mins, const float* bias, int64_t n, uint16_t* y,
                              int64_t y_stride, int64_t threads) {
    return -2;  // not built for this CPU: callers ask int4_q8_gemm_available first
}
#endif
