// 4-bit weights times fp32 activations on the CPU (pdserve.runtime.kernels.cpu_int4_matmul).
//
// Why hand-written: torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) is fast with bf16 /
// fp16 activations only; on a CPU without native bf16 (AVX2: the compute dtype is fp32 there) it is
// slower than the dense fp32 matmul, which reads 8x the bytes. Decoding a few streams is bound by
// those bytes, so this does what llama.cpp does for Q4_1 weights: each input row is quantized to
// int8 per group of 32 (one fp32 scale a group), and each (output row, group) is an integer dot
// product of 4-bit codes with the int8 inputs, scaled once:
//
//   w[n, k] = q[n, k] * scale[n, g] + min[n, g]      (q in 0..15, g = k / 32; min = zero - 8 scale)
//   x[m, k] ~ xq[m, k] * xd[m, g]                    (xq in -127..127, round half to even)
//   y[m, n] = sum_g scale[n, g] * xd[m, g] * sum_{k in g} q[n, k] xq[m, k] + min[n, g] * xsum[m, g]
//
// xsum is the sum of the group's quantized inputs, xd[m, g] * sum_{k in g} xq[m, k] (int4_common.h says
// why), so y is the dequantized weight times the quantized inputs. The only error beside fp32 rounding
// is the inputs' quantization: |y - x w^T| <= sum_g xd[m, g] / 2 * sum_{k in g} |w[n, k]|.
//
// 8-bit weights (int8_linear_f32: a GGUF's Q8_0 output head) are the same sums with signed codes
// q in -127..127 and no min: w[n, k] = q[n, k] * scale[n, g]; codes [N, K] int8, in input order.
//
// Layouts: codes [N, K / 2] bytes, byte j of a row holding code 2j (low nibble) and 2j + 1 (high),
// as Int4Linear.nibbles keeps them; scale, min [N, K / 32] fp32; x [M, K] fp32 with row stride;
// y [M, N] fp32 with row stride. The integer dot runs on a group's codes unpacked as [its 16 even
// codes | its 16 odd codes], so xq is written in that order too (q8_quantize_groups).
#include "bf16.h"
#include "threads.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int4_common.h"
// AVX-512 with VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later): two groups a 512-bit vector, and
// one vpdpbusd for the AVX2 path's maddubs + madd. The group's integer dot is the same (no int16
// saturation is possible in either: |q x| <= 2 * 128 * 127 a pair); only the order of the fp32 sums
// over groups differs, so results agree with the AVX2 build to fp32 rounding, not bit for bit.
#if defined(INT4_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define INT4_AVX512 1
#endif
// Input rows a tile takes: AVX-512's 32 vector registers hold 2 x 8 accumulators beside the codes.
#ifdef INT4_AVX512
#define INPUT_TILE 8
#else
#define INPUT_TILE 4
#endif

// sum_g a[g] * b[g] over `groups` values.
static inline float dot_f32(const float* a, const float* b, int64_t groups) {
    float s = 0.0f;
    for (int64_t g = 0; g < groups; g++) s += a[g] * b[g];
    return s;
}

#ifdef INT4_AVX2

// One group's 16 code bytes -> 32 unsigned bytes: [low nibbles (even codes) | high nibbles (odd)].
static inline __m256i unpack_group(const uint8_t* codes) {
    const __m128i b = _mm_loadu_si128((const __m128i*)codes);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
}

#ifdef INT4_AVX512
// Two groups' 32 code bytes -> 64 unsigned bytes [g even | g odd | g+1 even | g+1 odd], xq's order.
static inline __m512i unpack_group_pair(const uint8_t* codes) {
    const __m256i b = _mm256_loadu_si256((const __m256i*)codes);
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo g | lo g+1 | hi g | hi g+1]
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
}

// Two groups' fp32 values s[0], s[1] -> 16 lanes [s[0] x 8 | s[1] x 8], the lanes of their dot products.
static inline __m512 pair_scale(const float* s) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)s))));
}

// u8 x s8 products summed by fours into int32 lanes. 8-bit codes are signed: |w| times x with w's sign.
static inline __m512i dot_pair(__m512i w, __m512i xv, int bits) {
    if (bits == 4) return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const __m512i s = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), s);
}

static inline __m256i dot_one(__m256i w, __m256i xv, int bits) {
    if (bits == 4) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
}

// The AVX2 tile's sums (below) over pairs of groups in 512-bit lanes; an odd last group in the low half.
static inline __attribute__((always_inline)) void tile(const uint8_t* codes, const float* scale, const float* mins,
                                                       int64_t n, int nr, int64_t k, const int8_t* xq,
                                                       const float* xd, const float* xsum, int64_t r, int mt,
                                                       float* y, int64_t y_stride, int bits) {
    const int64_t groups = k / GROUP;
    const int64_t row_bytes = bits == 4 ? k / 2 : k, group_bytes = bits == 4 ? GROUP / 2 : GROUP;
    __m512 acc[2][INPUT_TILE];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= groups; g += 2) {
        __m512i w[2];
        __m512 ws[2];
        for (int i = 0; i < nr; i++) {
            __builtin_prefetch(codes + (n + i + 8) * row_bytes + g * group_bytes);  // as the AVX2 tile's
            const uint8_t* c = codes + (n + i) * row_bytes + g * group_bytes;
            w[i] = bits == 4 ? unpack_group_pair(c) : _mm512_loadu_si512((const void*)c);
            ws[i] = pair_scale(scale + (n + i) * groups + g);
        }
        for (int j = 0; j < mt; j++) {
            const __m512i xv = _mm512_loadu_si512((const void*)(xq + (r + j) * k + g * GROUP));
            const __m512 xs = pair_scale(xd + (r + j) * groups + g);
            for (int i = 0; i < nr; i++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_pair(w[i], xv, bits)), _mm512_mul_ps(ws[i], xs),
                                            acc[i][j]);
        }
    }
    if (g < groups) {
        for (int i = 0; i < nr; i++) {
            const uint8_t* c = codes + (n + i) * row_bytes + g * group_bytes;
            const __m256i w = bits == 4 ? unpack_group(c) : _mm256_loadu_si256((const __m256i*)c);
            const __m256 ws = _mm256_set1_ps(scale[(n + i) * groups + g]);
            for (int j = 0; j < mt; j++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + (r + j) * k + g * GROUP));
                const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_one(w, xv, bits)),
                                                  _mm256_mul_ps(ws, _mm256_set1_ps(xd[(r + j) * groups + g])));
                acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_zextps256_ps512(prod));
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++)
            y[(r + j) * y_stride + n + i] =
                _mm512_reduce_add_ps(acc[i][j]) +
                (bits == 4 ? dot_f32(mins + (n + i) * groups, xsum + (r + j) * groups, groups) : 0.0f);
}
#else
// y for NR output rows [n, n + NR) and MT input rows [r, r + MT): NR x MT vector accumulators.
// Inlined with constant NR, MT and BITS (the switch below), so they stay in registers. BITS 8: codes
// are int8 [N, K], mins and xsum unused, and xq is in input order.
static inline __attribute__((always_inline)) void tile(const uint8_t* codes, const float* scale, const float* mins,
                                                       int64_t n, int nr, int64_t k, const int8_t* xq,
                                                       const float* xd, const float* xsum, int64_t r, int mt,
                                                       float* y, int64_t y_stride, int bits) {
    const int64_t groups = k / GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][4];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i w[2];
        __m256 ws[2];
        for (int i = 0; i < nr; i++) {
            // Codes four tiles ahead: a tile reads two rows at once, two streams that the hardware
            // prefetcher follows less well than one (SmolLM2's 8-bit head at one row: 7.4 -> 4.2 ms).
            __builtin_prefetch(codes + (n + i + 8) * (bits == 4 ? k / 2 : k) + g * (bits == 4 ? GROUP / 2 : GROUP));
            w[i] = bits == 4 ? unpack_group(codes + (n + i) * (k / 2) + g * (GROUP / 2))
                             : _mm256_loadu_si256((const __m256i*)(codes + (n + i) * k + g * GROUP));
            ws[i] = _mm256_set1_ps(scale[(n + i) * groups + g]);
        }
        for (int j = 0; j < mt; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + (r + j) * k + g * GROUP));
            const __m256 xs = _mm256_set1_ps(xd[(r + j) * groups + g]);
            for (int i = 0; i < nr; i++) {
                // u8 x s8 pairs summed to int16 (at most 2 * 127 * 127: no saturation), then to int32.
                // Signed 8-bit codes: |w| times x with w's sign, as maddubs takes one unsigned operand.
                const __m256i u = bits == 4 ? w[i] : _mm256_sign_epi8(w[i], w[i]);
                const __m256i s = bits == 4 ? xv : _mm256_sign_epi8(xv, w[i]);
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(ws[i], xs), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < mt; j++)
            y[(r + j) * y_stride + n + i] =
                hsum256(acc[i][j]) + (bits == 4 ? dot_f32(mins + (n + i) * groups, xsum + (r + j) * groups, groups) : 0.0f);
}

#endif  // INT4_AVX512

#define TILE(NR, MT) \
    (bits == 4 ? tile(codes, scale, mins, n, NR, k, xq, xd, xsum, r, MT, y, y_stride, 4) \
               : tile(codes, scale, mins, n, NR, k, xq, xd, xsum, r, MT, y, y_stride, 8))

static void tile_dispatch(const uint8_t* codes, const float* scale, const float* mins, int64_t n, int nr, int64_t k,
                          const int8_t* xq, const float* xd, const float* xsum, int64_t r, int mt, float* y,
                          int64_t y_stride, int bits) {
    // Both output-row counts for one input-row count.
#define TILE_CASES(MT) \
    case 2 * 16 + MT: TILE(2, MT); break; \
    case 1 * 16 + MT: TILE(1, MT); break;
    switch (nr * 16 + mt) {
#if INPUT_TILE == 8
        TILE_CASES(8) TILE_CASES(7) TILE_CASES(6) TILE_CASES(5)
#endif
        TILE_CASES(4) TILE_CASES(3) TILE_CASES(2)
        case 2 * 16 + 1: TILE(2, 1); break;
        default: TILE(1, 1); break;
    }
}
#else
// Portable: the same sums in scalar code (integer dot per group, one scale product per group).
static void tile_dispatch(const uint8_t* codes, const float* scale, const float* mins, int64_t n, int nr, int64_t k,
                          const int8_t* xq, const float* xd, const float* xsum, int64_t r, int mt, float* y,
                          int64_t y_stride, int bits) {
    const int64_t groups = k / GROUP;
    for (int i = 0; i < nr; i++) {
        const uint8_t* c = codes + (n + i) * (bits == 4 ? k / 2 : k);
        for (int j = 0; j < mt; j++) {
            const int8_t* xr = xq + (r + j) * k;
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int b = 0; b < GROUP / 2; b++) {
                    if (bits == 4) {
                        const uint8_t byte = c[g * (GROUP / 2) + b];
                        dot += (byte & 0x0F) * xr[g * GROUP + b] + (byte >> 4) * xr[g * GROUP + GROUP / 2 + b];
                    } else {
                        dot += (int8_t)c[g * GROUP + b] * xr[g * GROUP + b] +
                               (int8_t)c[g * GROUP + GROUP / 2 + b] * xr[g * GROUP + GROUP / 2 + b];
                    }
                }
                acc += (float)dot * (scale[(n + i) * groups + g] * xd[(r + j) * groups + g]);
            }
            y[(r + j) * y_stride + n + i] =
                acc + (bits == 4 ? dot_f32(mins + (n + i) * groups, xsum + (r + j) * groups, groups) : 0.0f);
        }
    }
}
#endif

static void matmul_rows(const uint8_t* codes, const float* scale, const float* mins, int64_t n0, int64_t n1,
                        int64_t k, const int8_t* xq, const float* xd, const float* xsum, int64_t m, float* y,
                        int64_t y_stride, int bits) {
    for (int64_t n = n0; n < n1; n += 2) {
        const int nr = n + 2 <= n1 ? 2 : 1;
        for (int64_t r = 0; r < m; r += INPUT_TILE) {
            const int mt = r + INPUT_TILE <= m ? INPUT_TILE : (int)(m - r);
            tile_dispatch(codes, scale, mins, n, nr, k, xq, xd, xsum, r, mt, y, y_stride, bits);
        }
    }
}

// One call for a linear (the decode step's path): x [M, K] quantized into scratch of this call's
// own, then y for output rows [n0, n1), plus bias[n] where bias is not NULL. Each thread's part
// quantizes x again: M K values beside its (n1 - n0) M K products, at least 256 times more, and it
// saves a second call and three tensors a projection. Returns 0, or -1 where the scratch cannot be had.
static int linear_q8(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes, const float* scale,
                     const float* mins, const float* bias, int64_t n0, int64_t n1, float* y, int64_t y_stride,
                     int bits) {
    const Q8Inputs q = q8_inputs(x, m, k, x_stride, bits == 8);
    if (q.xq == NULL) return -1;
    matmul_rows(codes, scale, mins, n0, n1, k, q.xq, q.xd, q.xsum, m, y, y_stride, bits);
    free(q.xq);
    if (bias != NULL)
        for (int64_t r = 0; r < m; r++)
            for (int64_t n = n0; n < n1; n++) y[r * y_stride + n] += bias[n];
    return 0;
}

int int4_linear_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes, const float* scale,
                    const float* mins, const float* bias, int64_t n0, int64_t n1, float* y, int64_t y_stride) {
    return linear_q8(x, m, k, x_stride, codes, scale, mins, bias, n0, n1, y, y_stride, 4);
}

int int8_linear_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* codes, const float* scale,
                    int64_t n0, int64_t n1, float* y, int64_t y_stride) {
    return linear_q8(x, m, k, x_stride, (const uint8_t*)codes, scale, NULL, NULL, n0, n1, y, y_stride, 8);
}

// bf16 rows in and out (the bf16 compute dtype's steps of few rows: pdserve.quant.int4_cpu): x
// widened to fp32 (exact), the same quantized sums as int4_linear_f32, plus bias[n] (fp32, NULL:
// none), each output rounded once to bf16 (nearest even). Returns 0, or -1 without scratch.
int int4_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                     const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, uint16_t* y,
                     int64_t y_stride) {
    float* xf = malloc(sizeof(float) * (size_t)(m * k + m * n1));
    if (xf == NULL) return -1;
    float* yf = xf + m * k;  // [m, n1]: columns [n0, n1) written
    bf16_rows_to_f32(x, m, k, x_stride, xf);
    const int err = linear_q8(xf, m, k, k, codes, scale, mins, bias, n0, n1, yf, n1, 4);
    for (int64_t r = 0; r < m && !err; r++)
        for (int64_t n = n0; n < n1; n++) y[r * y_stride + n] = bf16_round(yf[r * n1 + n]);
    free(xf);
    return err;
}

// The entry points Python calls (cpu_int4_matmul): split over threads (threads.h).
int int4_linear_f32_threads(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                            const float* scale, const float* mins, const float* bias, int64_t n, float* y,
                            int64_t y_stride, int64_t threads) {
    LINEAR_THREADS(int4_linear_f32(x, m, k, x_stride, codes, scale, mins, bias, n0, n1, y, y_stride))
}

int int8_linear_f32_threads(const float* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* codes,
                            const float* scale, int64_t n, float* y, int64_t y_stride, int64_t threads) {
    LINEAR_THREADS(int8_linear_f32(x, m, k, x_stride, codes, scale, n0, n1, y, y_stride))
}

int int4_linear_bf16_threads(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                             const float* scale, const float* mins, const float* bias, int64_t n, uint16_t* y,
                             int64_t y_stride, int64_t threads) {
    LINEAR_THREADS(int4_linear_bf16(x, m, k, x_stride, codes, scale, mins, bias, n0, n1, y, y_stride))
}
