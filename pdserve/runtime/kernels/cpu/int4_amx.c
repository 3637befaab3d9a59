// 4- and 8-bit weights times bf16 inputs on AMX tiles (Intel Sapphire Rapids and later): y = x @ w^T,
// w the dense bf16 weight the codes stand for, dequantized a panel of 32 output rows at a time in cache.
//
// Why: a bf16 decode step of 8-32 sequences is bound by reading its weights (oneDNN's dense bf16
// matmul runs on AMX, but reads 2 bytes a weight: SmolLM2's 212 MB of projections a step, about 35 ms
// on one core of a 2-core Xeon), and torch's int4 kernel reads a quarter of that but multiplies on
// AVX-512 (at 32 rows it is compute-bound, slower than the dense matmul). Here the codes are read
// (half a byte a weight and a bf16 scale and zero per group of 32), widened to bf16 in L2 and
// multiplied on the tiles: the dense bf16 matmul's weights, bit for bit, from 5 bits a weight read, not 16.
//
// The weight w[n, k] = bf16(((q - 8) * scale + zero)) in fp32, multiply then add, each rounded:
// `Int4Linear.dequantized`'s arithmetic, so the tiles multiply exactly its dense copy's values; only
// the order of the fp32 sums differs from oneDNN's. Computed as one fma, which is the same: the
// product of q - 8 (4 bits) and a bf16 scale (8) is exact in fp32, so the multiply never rounds and
// the fma's one rounding is the add's (a block's widening, the kernel's main cost, 12 % faster).
// The codes come laid out for the tiles (`int4_cpu.AmxForm`): for each block of 16 output rows and
// 32 inputs (one group each), 16 lines of 16 bytes, one a row of the weight's tile
// (`dequantize_block`). Scales and zeros are read where torch's int4 kernel reads them
// (`Int4Linear.scales_and_zeros`, [K / 32, N, 2] bf16): a block's 16 (scale, zero) pairs are 64
// contiguous bytes.
//
// 8-bit codes (an output head kept as its file's Q8_0: pdserve.quant.q8_head) take the same panels:
// w[n, k] = bf16(q * scale), q in -127..127 and scale the group's fp32 (the file's fp16), whose
// product is exact in fp32, so w is the loaded bf16 weight bit for bit. A block is 576 bytes: its
// 16 x 32 codes as 16 lines of 32 bytes in the tiles' pair order (line r's byte 2c + j: output c's
// input 2r + j), then its 16 outputs' scales; blocks in the panels' order, so that the kernel reads one
// stream (the scales apart, [K / 32, N], measured within 2 %: SmolLM2's head at 32 rows, one thread,
// 9.85 against 9.65 ms). That head then reads 32 MB a step instead of the dense copy's 57.
#define _GNU_SOURCE  // syscall(), for arch_prctl
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "q8_widen.h"
#include "threads.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#define PDSERVE_AMX 1
#endif

// 1 where this build has the kernel and the kernel lets the process use AMX's tile data (Linux asks
// each process to request it: arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), else 0.
int int4_amx_available(void) {
#ifdef PDSERVE_AMX
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
#else
    return 0;
#endif
}

#ifdef PDSERVE_AMX
enum { PANEL = 32, BLOCK_BYTES = 256, Q8_BLOCK_BYTES = 512 + 64, TILE_ELEMS = 16 * 32 };

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

// Tiles: 0-3 accumulators C[row group][column half], 4-5 the inputs' row groups, 6-7 the weights' halves.
static void configure(int rows0, int rows1) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&cfg);
}

// A tile line's lanes 2c and 2c + 1 hold output c's pair of inputs: v's 16 per-output values spread to
// those pairs, outputs 0-7 (half 0: lanes 0-15) or 8-15 (half 1: lanes 16-31 of the line).
static inline __m512 pairs_of(__m512 v, int half) {
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(_mm512_add_epi32(pairs, _mm512_set1_epi32(8 * half)), v);
}

// One block's 16 x 32 bf16 weights, in the tiles' pair layout, from its 256 bytes of codes and its
// 16 (scale, zero) pairs. Line r's byte i holds lane i's code (low nibble) and lane 16 + i's (high) of
// the tile's row r, lane 2c + j being output c's input 2r + j: each half of a line is then 16 lanes
// of 8 outputs (their scales and zeros spread to pairs once a block), widened by one permute
// (q - 8 looked up, exact), scaled and shifted by one fma (exact as a multiply then an add: above)
// and rounded to bf16 by one convert.
static void dequantize_block(const uint8_t* codes, const uint16_t* scale_zero, uint16_t* out) {
    const __m512i pairs = _mm512_loadu_si512(scale_zero);  // bf16 bits: scale low, zero high
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xFFFF0000u)));
    const __m512 scale_lo = pairs_of(scale, 0), scale_hi = pairs_of(scale, 1);
    const __m512 zero_lo = pairs_of(zero, 0), zero_hi = pairs_of(zero, 1);
    const __m512 centred = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);  // q - 8
    for (int r = 0; r < 16; r++) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(codes + 16 * r)));
        __m512 lo = _mm512_permutexvar_ps(b, centred);  // the index's low 4 bits: the low nibble
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), centred);
        lo = _mm512_fmadd_ps(lo, scale_lo, zero_lo);
        hi = _mm512_fmadd_ps(hi, scale_hi, zero_hi);
        _mm512_storeu_si512(out + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// One block's 16 x 32 bf16 weights from its 512 bytes of 8-bit codes and its 16 fp32 scales: each
// line's two halves are 16 lanes of 8 outputs (their scales spread to pairs once a block), widened
// exactly, scaled by one multiply (exact: above) and rounded to bf16 by one convert.
static void widen_q8_block(const int8_t* codes, const float* scale, uint16_t* out) {
    const __m512 scales = _mm512_loadu_ps(scale), scale_lo = pairs_of(scales, 0), scale_hi = pairs_of(scales, 1);
    for (int r = 0; r < 16; r++) _mm512_storeu_si512(out + 32 * r, q8_widen32(codes + 32 * r, scale_lo, scale_hi));
}

// The cache lines of a block of the next panel (its codes, `block_bytes` of them, and the line of its
// scales where they lie apart), fetched while this panel's block is widened. Why: the dequantization
// reads each block's codes once, from memory (a step reads every weight once), and waits on each
// miss: the hardware prefetchers follow a panel's two runs of blocks and its scales' stride poorly.
// Fetching the next panel's block as this one is widened (SmolLM2's 30 layers' projections, cold, one
// thread of a 2-core Xeon: 31.7 -> 19.7 ms at 1 row, 33.4 -> 26.9 at 32; a decode step of 32
// sequences on two threads 49.8 -> 43.8 ms, of 8: 32.4 -> 24.5).
static inline void prefetch_block(const uint8_t* next_codes, int64_t block_bytes, const void* next_scales) {
    for (int64_t line = 0; line < block_bytes; line += 64) __builtin_prefetch((const char*)next_codes + line);
    if (next_scales) __builtin_prefetch(next_scales);
}

// Rows [m0, m0 + rows) (rows <= 32) of y's columns [n, n + 32) from a dequantized panel.
static void multiply_panel(const uint16_t* x, int64_t m0, int rows, int64_t kb, int64_t x_stride,
                           const uint16_t* panel, const float* bias, int64_t n, float* acc, uint16_t* y,
                           int64_t y_stride) {
    const int rows0 = rows < 16 ? rows : 16, rows1 = rows - rows0;
    _tile_zero(0);
    _tile_zero(1);
    if (rows1) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint16_t* x0 = x + m0 * x_stride;
    for (int64_t b = 0; b < kb; b++) {
        _tile_loadd(6, panel + (2 * b) * TILE_ELEMS, 64);
        _tile_loadd(7, panel + (2 * b + 1) * TILE_ELEMS, 64);
        _tile_loadd(4, x0 + 32 * b, x_stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1) {
            _tile_loadd(5, x0 + 16 * x_stride + 32 * b, x_stride * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    if (rows1) {
        _tile_stored(2, acc + 16 * 32, 128);
        _tile_stored(3, acc + 16 * 32 + 16, 128);
    }
    const __m512 b0 = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + n + 16) : _mm512_setzero_ps();
    for (int i = 0; i < rows; i++) {
        const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(acc + 32 * i), b0);
        const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(acc + 32 * i + 16), b1);
        _mm512_storeu_si512(y + (m0 + i) * y_stride + n, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

// Output columns [n0, n1) (multiples of 32) of y [m, n] bf16 for x [m, k] bf16, from 4-bit codes with
// bf16 (scale, zero) pairs (bits 4) or 8-bit codes with fp32 scales (bits 8); 0, or -1 without scratch.
// Inlined with constant `bits` into each entry point below.
static inline __attribute__((always_inline)) int amx_linear_part(
        const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes, const void* scales,
        const float* bias, int64_t n, int64_t n0, int64_t n1, uint16_t* y, int64_t y_stride, int bits) {
    const int64_t kb = k / 32, block_bytes = bits == 4 ? BLOCK_BYTES : Q8_BLOCK_BYTES;
    uint16_t* panel = aligned_alloc(64, (size_t)(kb * 2 * TILE_ELEMS * sizeof(uint16_t)));
    float* acc = aligned_alloc(64, 32 * 32 * sizeof(float));
    if (!panel || !acc) {
        free(panel);
        free(acc);
        return -1;
    }
    int configured = -1;
    for (int64_t col = n0; col < n1; col += PANEL) {
        const int last = col + PANEL >= n1;
        for (int64_t b = 0; b < kb; b++) {
            for (int64_t half = 0; half < 2; half++) {
                const int64_t block = (col / 16 + half) * kb + b, first = b * n + col + 16 * half;
                const uint8_t* block_codes = codes + block * block_bytes;
                uint16_t* widened = panel + (2 * b + half) * TILE_ELEMS;
                if (bits == 4) {
                    const uint16_t* scale_zero = (const uint16_t*)scales + first * 2;
                    if (!last)  // the next panel's block: 2 * kb blocks on, its scales PANEL columns on
                        prefetch_block(block_codes + 2 * kb * block_bytes, block_bytes, scale_zero + PANEL * 2);
                    dequantize_block(block_codes, scale_zero, widened);
                } else {  // the codes' 512 bytes, then the scales
                    if (!last) prefetch_block(block_codes + 2 * kb * block_bytes, block_bytes, NULL);
                    widen_q8_block((const int8_t*)block_codes, (const float*)(block_codes + 512), widened);
                }
            }
        }
        for (int64_t m0 = 0; m0 < m; m0 += 32) {
            const int rows = m - m0 < 32 ? (int)(m - m0) : 32;
            if (rows != configured) {
                configure(rows < 16 ? rows : 16, rows > 16 ? rows - 16 : 0);
                configured = rows;
            }
            multiply_panel(x, m0, rows, kb, x_stride, panel, bias, col, acc, y, y_stride);
        }
    }
    _tile_release();
    free(panel);
    free(acc);
    return 0;
}

// 4-bit codes; also one member's part of the one-call decode step's projections (decode_step.c).
int int4_amx_linear_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                         const uint16_t* scale_zero, const float* bias, int64_t n, int64_t n0, int64_t n1,
                         uint16_t* y, int64_t y_stride) {
    return amx_linear_part(x, m, k, x_stride, codes, scale_zero, bias, n, n0, n1, y, y_stride, 4);
}

static int int8_amx_linear_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* blocks,
                                int64_t n, int64_t n0, int64_t n1, uint16_t* y, int64_t y_stride) {
    return amx_linear_part(x, m, k, x_stride, blocks, NULL, NULL, n, n0, n1, y, y_stride, 8);
}
#else
int int4_amx_linear_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                         const uint16_t* scale_zero, const float* bias, int64_t n, int64_t n0, int64_t n1,
                         uint16_t* y, int64_t y_stride) {
    (void)x, (void)m, (void)k, (void)x_stride, (void)codes, (void)scale_zero, (void)bias, (void)n, (void)n0;
    (void)n1, (void)y, (void)y_stride;
    return -2;
}
#endif

// x [m, k] bf16 (row stride x_stride), the codes and bf16 scales/zeros laid out as above for n output
// rows (n and k multiples of 32), bias [n] fp32 or NULL -> y [m, n] bf16 (row stride y_stride); the
// output rows split over `threads` in whole panels. 0, -1 without scratch, -2 without the kernel.
int int4_amx_linear_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                            const uint16_t* scale_zero, const float* bias, int64_t n, uint16_t* y,
                            int64_t y_stride, int64_t threads) {
#ifdef PDSERVE_AMX
    if (!int4_amx_available()) return -2;
    LINEAR_THREADS_ALIGNED(PANEL, int4_amx_linear_part(x, m, k, x_stride, codes, scale_zero, bias, n, n0, n1, y,
                                                       y_stride))
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)codes, (void)scale_zero, (void)bias, (void)n, (void)y;
    (void)y_stride, (void)threads;
    return -2;
#endif
}

// x [m, k] bf16 times 8-bit codes and scales in blocks laid out as above (n and k multiples of 32)
// -> y [m, n] bf16; the output rows split over `threads` in whole panels. 0, -1 without scratch,
// -2 without the kernel.
int int8_amx_linear_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* blocks,
                            int64_t n, uint16_t* y, int64_t y_stride, int64_t threads) {
#ifdef PDSERVE_AMX
    if (!int4_amx_available()) return -2;
    LINEAR_THREADS_ALIGNED(PANEL, int8_amx_linear_part(x, m, k, x_stride, blocks, n, n0, n1, y, y_stride))
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)blocks, (void)n, (void)y, (void)y_stride;
    (void)threads;
    return -2;
#endif
}
