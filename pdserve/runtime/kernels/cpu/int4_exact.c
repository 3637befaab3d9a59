// 4- and 8-bit weights times fp32 inputs as they are, on the CPU (W4A32 / W8A32; called through
// pdserve.runtime.kernels.cpu_int4_matmul and the one-call decode step). Codes, scales and mins are
// int4_matmul.c's.
#include "int4_common.h"
#include "threads.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Why: the int8 inputs of int4_matmul.c are llama.cpp's method and its quality: SmolLM2's greedy
// answers change with them (docs/quantization.md). A CPU without native bf16 computes in fp32, where
// the dense matmul reads 8x the 4-bit codes' bytes: a one-stream step is then its memory's speed
// (SmolLM2 on a 2-core AVX2 EPYC: 43 ms dense, 5.9 with int8 inputs). Here each weight is dequantized
// in registers, w = q * scale + min (one fma, as `Int4Linear.dequantized` but fused: so within fp32
// rounding of it, not its bits), and multiplied with the unquantized inputs: the dequantized weight's
// matmul, read at the codes' size. A row's sums go over groups in one fixed order whatever else the
// call holds, so a token's output does not depend on its batch (tests/test_cpu_int4_exact.py).
//
// 4-bit inputs are put in the codes' unpacked order ([16 even | 16 odd] a group) once a call, so that
// a group's codes unpack with two masks; 8-bit codes are in input order and signed (min unused).

// x [M, K] -> xp [M, K]: each group's even inputs, then its odd ones (the codes' unpacked order).
static void exact_reorder_groups(const float* x, int64_t m, int64_t k, int64_t x_stride, float* xp) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < k / GROUP; g++) {
            const float* v = x + r * x_stride + g * GROUP;
            float* out = xp + r * k + g * GROUP;
            for (int i = 0; i < GROUP / 2; i++) {
                out[i] = v[2 * i];
                out[GROUP / 2 + i] = v[2 * i + 1];
            }
        }
}

#ifdef INT4_AVX2
#define EXACT_INPUT_TILE 4
// Full tiles of this many input rows take one output row at a time: a group's 4 dequantized vectors
// serve 8 rows (8 accumulators, 13 registers) where two output rows' 8 serve 4.
#define EXACT_ROWS_TILE 8
// One group's 32 weights of an output row, dequantized into 4 vectors of 8, in xp's order (4-bit:
// the low nibbles of code bytes 0-7, 8-15, then their high nibbles).
static inline __attribute__((always_inline)) void exact_weights(const uint8_t* codes, int bits, float scale,
                                                                float min, __m256 w[4]) {
    const __m256 s = _mm256_set1_ps(scale), mn = _mm256_set1_ps(min);
    // 4-bit: bytes 0-7 and 8-15 widened to 32-bit lanes once each, a lane's two nibbles then split by
    // mask and shift (widening each nibble vector, 4 lane-crossing shuffles a group, made the one-row
    // projections 1.2x slower: SmolLM2's 30 layers on two Zen 3 cores, 7.0 against 5.7 ms).
    if (bits == 4) {
        const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)codes));
        const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(codes + 8)));
        const __m256i low4 = _mm256_set1_epi32(0x0F);
        const __m256i parts[4] = {_mm256_and_si256(b0, low4), _mm256_and_si256(b1, low4), _mm256_srli_epi32(b0, 4),
                                  _mm256_srli_epi32(b1, 4)};
        for (int p = 0; p < 4; p++) w[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(parts[p]), s, mn);
    } else {
        for (int p = 0; p < 4; p++) {
            const __m128i c = _mm_loadl_epi64((const __m128i*)(codes + 8 * p));
            w[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), s);
        }
    }
}

// y for NR output rows [n, n + NR) and MT input rows [r, r + MT): NR x MT accumulators of 8 lanes.
// A group's weights of both rows are dequantized first (8 vectors: with the accumulators more than
// AVX2's 16 registers, but a quarter at a time measured slower: 90.8 against 74.5 ms for SmolLM2's
// 30 layers at 32 rows, 2 threads).
static inline __attribute__((always_inline)) void exact_tile(const uint8_t* codes, const float* scale,
                                                             const float* mins, int64_t n, int nr, int64_t k,
                                                             const float* xp, int64_t r, int mt, float* y,
                                                             int64_t y_stride, int bits) {
    const int64_t groups = k / GROUP, row_bytes = bits == 4 ? k / 2 : k, group_bytes = bits == 4 ? GROUP / 2 : GROUP;
    __m256 acc[2][EXACT_ROWS_TILE];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 w[2][4];
        for (int i = 0; i < nr; i++) {
            const uint8_t* c = codes + (n + i) * row_bytes + g * group_bytes;
            __builtin_prefetch(c + 8 * row_bytes);  // as the int8-input tile's
            exact_weights(c, bits, scale[(n + i) * groups + g], bits == 4 ? mins[(n + i) * groups + g] : 0.0f, w[i]);
        }
        for (int p = 0; p < 4; p++)
            for (int j = 0; j < mt; j++) {
                const __m256 xv = _mm256_loadu_ps(xp + (r + j) * k + g * GROUP + 8 * p);
                for (int i = 0; i < nr; i++) acc[i][j] = _mm256_fmadd_ps(w[i][p], xv, acc[i][j]);
            }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++) y[(r + j) * y_stride + n + i] = hsum256(acc[i][j]);
}

// ---- Steps of many rows: the same sums as a GEMM, rows in the lanes ----
//
// Why: the tiles above dequantize a weight once per 8 input rows and read a tile's inputs once per
// output row: a 32-row step ran at ~44 GMAC/s on two Zen 3 cores, 56% of their FMA peak. An output's
// sum there is 8 lane sums, lane l over the inputs at xp index 8j + l for j = 0, 1, ... in order (one
// fma chain from zero), added as hsum256 adds lanes. Here the same chains run with the input rows in
// the lanes (16 rows: two vectors) and 6 outputs' weights broadcast from a panel dequantized once a
// call: a GEMM's 6 x 16 register tile (12 accumulators), fewer loads than fmas. Then each output's 8
// chains are added in hsum256's order: the tiles' bits, at any row count (tests/test_cpu_int4_exact.py).
#define PANEL_OUTPUTS 12  // a panel's outputs: 12 x 8 rows, or 6 x 16 rows, a tile
#define PANEL_ROWS 8      // rows a vector
#ifndef PANEL_FROM_ROWS
#define PANEL_FROM_ROWS 14
#endif

// r[i][l] -> r[l][i]: an 8 x 8 block of floats transposed in registers.
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int h = 0; h < 8; h += 4) {  // rows h .. h + 3: columns l and l + 4 in each vector's halves
        u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
        u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
        u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
        u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
    }
    for (int l = 0; l < 4; l++) {
        r[l] = _mm256_permute2f128_ps(u[l], u[l + 4], 0x20);
        r[l + 4] = _mm256_permute2f128_ps(u[l], u[l + 4], 0x31);
    }
}

// xp [M, K] -> xt [ceil(M / 8)][8][K / 8][8]: row block b's input 8j + l of row 8b + i at
// xt[b][l][j][i]; rows past M are 0.
static void panel_inputs(const float* xp, int64_t m, int64_t k, float* xt) {
    const int64_t steps = k / 8, blocks = (m + PANEL_ROWS - 1) / PANEL_ROWS;
    for (int64_t b = 0; b < blocks; b++) {
        const int rows = (b + 1) * PANEL_ROWS <= m ? PANEL_ROWS : (int)(m - b * PANEL_ROWS);
        float* block = xt + b * k * PANEL_ROWS;
        for (int64_t j = 0; j < steps; j++) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = i < rows ? _mm256_loadu_ps(xp + (b * PANEL_ROWS + i) * k + 8 * j) : _mm256_setzero_ps();
            transpose8(r);
            for (int l = 0; l < 8; l++) _mm256_storeu_ps(block + (l * steps + j) * PANEL_ROWS, r[l]);
        }
    }
}

// Outputs [n, n + no) dequantized into wl [no][8][K / 8]: output o's weight at xp index 8j + l at
// wl[o][l][j] (a group's 4 vectors over l transposed to 8 runs of 4 over p: j = 4g + p).
static void panel_weights(const uint8_t* codes, const float* scale, const float* mins, int64_t n, int no, int64_t k,
                          int bits, float* wl) {
    const int64_t groups = k / GROUP, steps = k / 8, row_bytes = bits == 4 ? k / 2 : k,
                  group_bytes = bits == 4 ? GROUP / 2 : GROUP;
    for (int o = 0; o < no; o++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t q = (n + o) * groups + g;
            __m256 w[4];
            exact_weights(codes + (n + o) * row_bytes + g * group_bytes, bits, scale[q], bits == 4 ? mins[q] : 0.0f,
                          w);
            const __m256 t0 = _mm256_unpacklo_ps(w[0], w[1]), t1 = _mm256_unpackhi_ps(w[0], w[1]);
            const __m256 t2 = _mm256_unpacklo_ps(w[2], w[3]), t3 = _mm256_unpackhi_ps(w[2], w[3]);
            const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                                 _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};  // lanes l, l + 4
            float* dst = wl + o * 8 * steps + 4 * g;
            for (int l = 0; l < 4; l++) {
                _mm_storeu_ps(dst + l * steps, _mm256_castps256_ps128(u[l]));
                _mm_storeu_ps(dst + (l + 4) * steps, _mm256_extractf128_ps(u[l], 1));
            }
        }
}

// y rows [r0, r0 + mt) (mt <= 8 NV: row blocks xb[0 .. NV)), outputs [n, n + NO) of the panel wl
// (NO x NV <= 12 accumulators).
static inline __attribute__((always_inline)) void panel_tile(const float* wl, int no, int nv, int64_t steps,
                                                             const float* const* xb, int64_t r0, int mt, int64_t n,
                                                             float* y, int64_t y_stride) {
    __m256 part[8][PANEL_OUTPUTS][2];  // each lane chain's sum, rows in the lanes
    for (int l = 0; l < 8; l++) {
        __m256 acc[PANEL_OUTPUTS][2];
        for (int o = 0; o < no; o++)
            for (int v = 0; v < nv; v++) acc[o][v] = _mm256_setzero_ps();
        const float* xl[2] = {xb[0] + l * steps * PANEL_ROWS, xb[nv - 1] + l * steps * PANEL_ROWS};
        const float* wo = wl + l * steps;
        for (int64_t j = 0; j < steps; j++) {
            __m256 x[2];
            for (int v = 0; v < nv; v++) x[v] = _mm256_loadu_ps(xl[v] + j * PANEL_ROWS);
            for (int o = 0; o < no; o++) {
                const __m256 b = _mm256_broadcast_ss(wo + o * 8 * steps + j);
                for (int v = 0; v < nv; v++) acc[o][v] = _mm256_fmadd_ps(b, x[v], acc[o][v]);
            }
        }
        for (int o = 0; o < no; o++)
            for (int v = 0; v < nv; v++) part[l][o][v] = acc[o][v];
    }
    for (int o = 0; o < no; o++)
        for (int v = 0; v < nv; v++) {
            __m256 (*p)[PANEL_OUTPUTS][2] = part;  // hsum256's order: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
            const __m256 sum = _mm256_add_ps(
                _mm256_add_ps(_mm256_add_ps(p[0][o][v], p[4][o][v]), _mm256_add_ps(p[2][o][v], p[6][o][v])),
                _mm256_add_ps(_mm256_add_ps(p[1][o][v], p[5][o][v]), _mm256_add_ps(p[3][o][v], p[7][o][v])));
            float rows[8];
            _mm256_storeu_ps(rows, sum);
            for (int i = 0; i < 8 && 8 * v + i < mt; i++) y[(r0 + 8 * v + i) * y_stride + n + o] = rows[i];
        }
}

#define PANEL_TILE(NO, NV) panel_tile(wl, NO, NV, steps, xb, r0, mt, n, y, y_stride)

static void panel_tile_dispatch(const float* wl, int no, int nv, int64_t steps, const float* const* xb, int64_t r0,
                                int mt, int64_t n, float* y, int64_t y_stride) {
    switch (nv * 16 + no) {
        case 2 * 16 + 6: PANEL_TILE(6, 2); break;
        case 2 * 16 + 5: PANEL_TILE(5, 2); break;
        case 2 * 16 + 4: PANEL_TILE(4, 2); break;
        case 2 * 16 + 3: PANEL_TILE(3, 2); break;
        case 2 * 16 + 2: PANEL_TILE(2, 2); break;
        case 2 * 16 + 1: PANEL_TILE(1, 2); break;
        case 1 * 16 + 12: PANEL_TILE(12, 1); break;
        case 1 * 16 + 11: PANEL_TILE(11, 1); break;
        case 1 * 16 + 10: PANEL_TILE(10, 1); break;
        case 1 * 16 + 9: PANEL_TILE(9, 1); break;
        case 1 * 16 + 8: PANEL_TILE(8, 1); break;
        case 1 * 16 + 7: PANEL_TILE(7, 1); break;
        case 1 * 16 + 6: PANEL_TILE(6, 1); break;
        case 1 * 16 + 5: PANEL_TILE(5, 1); break;
        case 1 * 16 + 4: PANEL_TILE(4, 1); break;
        case 1 * 16 + 3: PANEL_TILE(3, 1); break;
        case 1 * 16 + 2: PANEL_TILE(2, 1); break;
        default: PANEL_TILE(1, 1); break;
    }
}

// Outputs [n0, n1) of the rows xp [M, K] (xp order) by the panel GEMM: each panel of 12 outputs
// dequantized once, then 6 x 16-row tiles over the row pairs' blocks and 12 x 8 over a last block.
// Returns 0, or -1 without scratch.
static int panel_linear(const float* xp, int64_t m, int64_t k, const uint8_t* codes, const float* scale,
                        const float* mins, int64_t n0, int64_t n1, float* y, int64_t y_stride, int bits) {
    const int64_t steps = k / 8, blocks = (m + PANEL_ROWS - 1) / PANEL_ROWS, block_floats = k * PANEL_ROWS;
    float* xt = malloc(sizeof(float) * (size_t)(blocks * block_floats + PANEL_OUTPUTS * k));
    if (xt == NULL) return -1;
    float* wl = xt + blocks * block_floats;
    panel_inputs(xp, m, k, xt);
    for (int64_t n = n0; n < n1; n += PANEL_OUTPUTS) {
        const int no = n + PANEL_OUTPUTS <= n1 ? PANEL_OUTPUTS : (int)(n1 - n);
        panel_weights(codes, scale, mins, n, no, k, bits, wl);
        for (int64_t b = 0; b < blocks; b += 2) {
            const int64_t r0 = b * PANEL_ROWS;
            const int mt = r0 + 2 * PANEL_ROWS <= m ? 2 * PANEL_ROWS : (int)(m - r0);
            const float* xb[2] = {xt + b * block_floats, xt + (b + 1) * block_floats};
            if (mt > PANEL_ROWS)
                for (int o = 0; o < no; o += PANEL_OUTPUTS / 2)
                    panel_tile_dispatch(wl + o * k, no - o < PANEL_OUTPUTS / 2 ? no - o : PANEL_OUTPUTS / 2, 2, steps,
                                        xb, r0, mt, n + o, y, y_stride);
            else
                panel_tile_dispatch(wl, no, 1, steps, xb, r0, mt, n, y, y_stride);
        }
    }
    free(xt);
    return 0;
}

#define EXACT_TILE(NR, MT) \
    (bits == 4 ? exact_tile(codes, scale, mins, n, NR, k, xp, r, MT, y, y_stride, 4) \
               : exact_tile(codes, scale, mins, n, NR, k, xp, r, MT, y, y_stride, 8))

static void exact_tile_dispatch(const uint8_t* codes, const float* scale, const float* mins, int64_t n, int nr,
                                int64_t k, const float* xp, int64_t r, int mt, float* y, int64_t y_stride, int bits) {
    switch (nr * 16 + mt) {
        case 1 * 16 + EXACT_ROWS_TILE: EXACT_TILE(1, EXACT_ROWS_TILE); break;
        case 2 * 16 + 4: EXACT_TILE(2, 4); break;
        case 2 * 16 + 3: EXACT_TILE(2, 3); break;
        case 2 * 16 + 2: EXACT_TILE(2, 2); break;
        case 2 * 16 + 1: EXACT_TILE(2, 1); break;
        case 1 * 16 + 4: EXACT_TILE(1, 4); break;
        case 1 * 16 + 3: EXACT_TILE(1, 3); break;
        case 1 * 16 + 2: EXACT_TILE(1, 2); break;
        default: EXACT_TILE(1, 1); break;
    }
}

// ---- The last 1-3 rows: many outputs a tile ----
//
// Why: an output's sum is one fma chain a lane (4 dependent fmas a group), so a tile of 2 outputs x
// 1 row can wait on the fma's latency (4 cycles on Zen 3) rather than its throughput. Up to 8
// outputs' chains at once: the Q8 head at one row 1.28 -> 1.15 ms on two Zen 3 cores; the 4-bit
// projections, bound by their codes' widening, about the same. The chains, and so the bits, are the
// tiles' (each output's weights dequantized as `exact_weights`).
#define NARROW_CHAINS 8  // outputs x rows of a narrow tile: its accumulators
#define NARROW_OUTPUTS 8 // outputs of a block whose last rows take narrow tiles

static inline __attribute__((always_inline)) void narrow_tile(const uint8_t* codes, const float* scale,
                                                              const float* mins, int64_t n, int nr, int64_t k,
                                                              const float* xp, int64_t r, int mt, float* y,
                                                              int64_t y_stride, int bits) {
    const int64_t groups = k / GROUP, row_bytes = bits == 4 ? k / 2 : k, group_bytes = bits == 4 ? GROUP / 2 : GROUP;
    __m256 acc[NARROW_CHAINS];
    for (int c = 0; c < nr * mt; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        for (int i = 0; i < nr; i++) {
            const uint8_t* c = codes + (n + i) * row_bytes + g * group_bytes;
            __builtin_prefetch(c + NARROW_OUTPUTS * row_bytes);
            __m256 w[4];
            exact_weights(c, bits, scale[(n + i) * groups + g], bits == 4 ? mins[(n + i) * groups + g] : 0.0f, w);
            for (int p = 0; p < 4; p++)
                for (int j = 0; j < mt; j++)
                    acc[i * mt + j] = _mm256_fmadd_ps(w[p], _mm256_loadu_ps(xp + (r + j) * k + g * GROUP + 8 * p),
                                                      acc[i * mt + j]);
        }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++) y[(r + j) * y_stride + n + i] = hsum256(acc[i * mt + j]);
}

#define NARROW_TILE(NR, MT) \
    (bits == 4 ? narrow_tile(codes, scale, mins, n, NR, k, xp, r, MT, y, y_stride, 4) \
               : narrow_tile(codes, scale, mins, n, NR, k, xp, r, MT, y, y_stride, 8))

// Rows [r, r + mt) (mt <= 3) of outputs [n, n + nb) (nb <= NARROW_OUTPUTS), NARROW_CHAINS / mt
// outputs a tile.
static void narrow_rows(const uint8_t* codes, const float* scale, const float* mins, int64_t n0, int nb, int64_t k,
                        const float* xp, int64_t r, int mt, float* y, int64_t y_stride, int bits) {
    const int per_tile = NARROW_CHAINS / mt;
    for (int64_t n = n0; n < n0 + nb; n += per_tile) {
        const int nr = n + per_tile <= n0 + nb ? per_tile : (int)(n0 + nb - n);
        switch (mt * 16 + nr) {
            case 1 * 16 + 8: NARROW_TILE(8, 1); break;
            case 1 * 16 + 7: NARROW_TILE(7, 1); break;
            case 1 * 16 + 6: NARROW_TILE(6, 1); break;
            case 1 * 16 + 5: NARROW_TILE(5, 1); break;
            case 1 * 16 + 4: NARROW_TILE(4, 1); break;
            case 1 * 16 + 3: NARROW_TILE(3, 1); break;
            case 1 * 16 + 2: NARROW_TILE(2, 1); break;
            case 1 * 16 + 1: NARROW_TILE(1, 1); break;
            case 2 * 16 + 4: NARROW_TILE(4, 2); break;
            case 2 * 16 + 3: NARROW_TILE(3, 2); break;
            case 2 * 16 + 2: NARROW_TILE(2, 2); break;
            case 2 * 16 + 1: NARROW_TILE(1, 2); break;
            case 3 * 16 + 2: NARROW_TILE(2, 3); break;
            default: NARROW_TILE(1, 3); break;
        }
    }
}
#else
#define EXACT_INPUT_TILE 4
#define EXACT_ROWS_TILE 8
// Portable: the same weights (fmaf) and, per output, 8 partial sums over the group's lanes as the
// vector code keeps them, added in the same order.
static void exact_tile_dispatch(const uint8_t* codes, const float* scale, const float* mins, int64_t n, int nr,
                                int64_t k, const float* xp, int64_t r, int mt, float* y, int64_t y_stride, int bits) {
    const int64_t groups = k / GROUP, row_bytes = bits == 4 ? k / 2 : k;
    for (int i = 0; i < nr; i++) {
        const uint8_t* c = codes + (n + i) * row_bytes;
        for (int j = 0; j < mt; j++) {
            const float* xr = xp + (r + j) * k;
            float lane[8] = {0};
            for (int64_t g = 0; g < groups; g++) {
                const float s = scale[(n + i) * groups + g], mn = bits == 4 ? mins[(n + i) * groups + g] : 0.0f;
                for (int e = 0; e < GROUP; e++) {
                    int q;
                    if (bits == 4) {
                        const uint8_t byte = c[g * (GROUP / 2) + e % 16];
                        q = e < 16 ? (byte & 0x0F) : (byte >> 4);
                    } else {
                        q = (int8_t)c[g * GROUP + e];
                    }
                    const float w = bits == 4 ? fmaf((float)q, s, mn) : (float)q * s;
                    lane[e % 8] = fmaf(w, xr[g * GROUP + e], lane[e % 8]);
                }
            }
            float sum = 0.0f;
            for (int e = 0; e < 8; e++) sum += lane[e];
            y[(r + j) * y_stride + n + i] = sum;
        }
    }
}

#define NARROW_OUTPUTS 8
static void narrow_rows(const uint8_t* codes, const float* scale, const float* mins, int64_t n0, int nb, int64_t k,
                        const float* xp, int64_t r, int mt, float* y, int64_t y_stride, int bits) {
    exact_tile_dispatch(codes, scale, mins, n0, nb, k, xp, r, mt, y, y_stride, bits);
}
#endif

// Output rows [n0, n1) of x [M, K] times the codes, inputs unquantized (+ bias[n] where not NULL).
// Returns 0, or -1 where the scratch cannot be had.
static int linear_exact(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                        const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, float* y,
                        int64_t y_stride, int bits) {
    const float* xp = x;
    float* scratch = NULL;
    if (bits == 4) {
        scratch = malloc(sizeof(float) * (size_t)(m * k));
        if (scratch == NULL) return -1;
        exact_reorder_groups(x, m, k, x_stride, scratch);
        xp = scratch;
    } else if (x_stride != k) {
        scratch = malloc(sizeof(float) * (size_t)(m * k));
        if (scratch == NULL) return -1;
        for (int64_t r = 0; r < m; r++) memcpy(scratch + r * k, x + r * x_stride, sizeof(float) * (size_t)k);
        xp = scratch;
    }
    // Each output's sums take one order whatever the tile (per lane over groups, then the lanes), so
    // rows give the same bits in any tile, and in the panel GEMM.
    int64_t tiles_to = n1;  // outputs [n0, tiles_to) by the tiles
#ifdef INT4_AVX2
    if (m >= PANEL_FROM_ROWS && panel_linear(xp, m, k, codes, scale, mins, n0, n1, y, y_stride, bits) == 0)
        tiles_to = n0;  // (without scratch: the tiles)
#endif
    for (int64_t n = n0; n < tiles_to; n += NARROW_OUTPUTS) {  // a block's codes stay in L1 over its rows
        const int nb = n + NARROW_OUTPUTS <= tiles_to ? NARROW_OUTPUTS : (int)(tiles_to - n);
        int64_t r = 0;
        for (; r + EXACT_ROWS_TILE <= m; r += EXACT_ROWS_TILE)
            for (int i = 0; i < nb; i++)
                exact_tile_dispatch(codes, scale, mins, n + i, 1, k, xp, r, EXACT_ROWS_TILE, y, y_stride, bits);
        for (; r + EXACT_INPUT_TILE <= m; r += EXACT_INPUT_TILE)
            for (int i = 0; i < nb; i += 2)
                exact_tile_dispatch(codes, scale, mins, n + i, i + 2 <= nb ? 2 : 1, k, xp, r, EXACT_INPUT_TILE, y,
                                    y_stride, bits);
        if (r < m) narrow_rows(codes, scale, mins, n, nb, k, xp, r, (int)(m - r), y, y_stride, bits);
    }
    free(scratch);
    if (bias != NULL)
        for (int64_t r = 0; r < m; r++)
            for (int64_t n = n0; n < n1; n++) y[r * y_stride + n] += bias[n];
    return 0;
}

int int4_linear_exact_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                          const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, float* y,
                          int64_t y_stride) {
    return linear_exact(x, m, k, x_stride, codes, scale, mins, bias, n0, n1, y, y_stride, 4);
}

int int8_linear_exact_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* codes,
                          const float* scale, int64_t n0, int64_t n1, float* y, int64_t y_stride) {
    return linear_exact(x, m, k, x_stride, (const uint8_t*)codes, scale, NULL, NULL, n0, n1, y, y_stride, 8);
}

int int4_linear_exact_f32_threads(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                                  const float* scale, const float* mins, const float* bias, int64_t n, float* y,
                                  int64_t y_stride, int64_t threads) {
    LINEAR_THREADS(int4_linear_exact_f32(x, m, k, x_stride, codes, scale, mins, bias, n0, n1, y, y_stride))
}

int int8_linear_exact_f32_threads(const float* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* codes,
                                  const float* scale, int64_t n, float* y, int64_t y_stride, int64_t threads) {
    LINEAR_THREADS(int8_linear_exact_f32(x, m, k, x_stride, codes, scale, n0, n1, y, y_stride))
}
