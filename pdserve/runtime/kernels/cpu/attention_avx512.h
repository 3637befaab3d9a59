// The AVX-512 decode attention passes' shared pieces (paged_attention.c over a bf16 cache,
// paged_attention_i8.c over INT8 codes): the scores' transposing reduction, and the values' dispatch
// to register-held shapes and their rounded store. Include where AVX-512 is on.
#ifndef PDSERVE_ATTENTION_AVX512_H
#define PDSERVE_ATTENTION_AVX512_H
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

#define MAX_ACC_VECTORS 24  // group * dim / 16 fp32 sums a values pass holds in registers (of 32)

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

#ifdef __AVX512BF16__
// One query head's scores over a run of n <= 16 consecutive keys (rows `row` apart from `keys`, the head's
// D values): out[i] = scale * q . k_i, i < n. Each key's products summed with `vdpbf16ps` in its own
// lane-parallel vector, then one transposing reduction: a score's bits depend on its q and k alone.
// Inlined (a call each run and head cost the decode step 2-3 %: the 16 sums went through memory).
static inline __attribute__((always_inline)) void score_run_bf16(
        const uint16_t* q, const uint16_t* keys, int64_t n, int64_t row, int64_t dim, __m512 scale16, float* out) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    if (n == 16) {  // a whole run (most of them): no per-key choice in the loop (512-token prompt attention
                    // in tiles 125-146 against 135-172 ms with the choice in every run; decode steps: alike)
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
            for (int i = 0; i < 16; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(keys + i * row + d));
        }
    } else {
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
            for (int i = 0; i < 16; i++)  // rows past the run read row 0 again: lanes discarded
                acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(keys + (i < n ? i : 0) * row + d));
        }
    }
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << n) - 1), _mm512_mul_ps(scale16, sums16(acc)));
}
#endif

static inline __m512 widen16(const uint16_t* p) {  // 16 bf16 -> 16 fp32, exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// The scores' runs: up to 16 tokens from t0, within t0's block and the context of `len`.
static inline int64_t run_tokens(int64_t t0, int64_t len, int64_t block_size) {
    const int64_t in_block = block_size - t0 % block_size, n = in_block < 16 ? in_block : 16;
    return len - t0 < n ? len - t0 : n;
}

// A kv head's `group` query heads' value sums, acc [group][per_head] vectors of 16, rounded to bf16
// into out's rows g * group + j ([H, dim]).
static inline void store_group_rows_bf16(const __m512* acc, int64_t group, int64_t per_head, int64_t g,
                                         int64_t dim, uint16_t* out) {
    for (int64_t j = 0; j < group; j++) {
        float sums[16 * 16];  // per_head <= 16: head dims up to 256
        for (int64_t c = 0; c < per_head; c++) _mm512_storeu_ps(sums + c * 16, acc[j * per_head + c]);
        uint16_t* o = out + (g * group + j) * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = bf16_round(sums[d]);
    }
}

// A kv head g's `group` query heads' value sums (sums: [group][per_head] vectors of 16) plus a run of n
// tokens from t0 (`rows`: the run's first row), each probability p[(g * group + j) * t_pad + t] times the
// token's values, added in token order. Inlined with constant group and per_head so that the sums stay
// in registers for the run.
static inline __attribute__((always_inline)) void add_run_values(
        int64_t group, int64_t per_head, const float* p, const uint16_t* rows, int64_t t0, int64_t n, int64_t g,
        int64_t row, int64_t dim, int64_t t_pad, __m512* sums) {
    __m512 acc[MAX_ACC_VECTORS];  // [group][per_head]
    for (int64_t i = 0; i < group * per_head; i++) acc[i] = sums[i];
    for (int64_t t = t0; t < t0 + n; t++) {
        const uint16_t* v = rows + (t - t0) * row + g * dim;
        for (int64_t c = 0; c < per_head; c++) {
            const __m512 vc = widen16(v + c * 16);
            for (int64_t j = 0; j < group; j++)
                acc[j * per_head + c] =
                    _mm512_fmadd_ps(_mm512_set1_ps(p[(g * group + j) * t_pad + t]), vc, acc[j * per_head + c]);
        }
    }
    for (int64_t i = 0; i < group * per_head; i++) sums[i] = acc[i];
}

// FN(G, PH, ...) with G and PH constants for the shapes whose sums stay in registers once inlined
// (head dims 64 and 128: PH 4, 8; GQA groups 1-6 and 1-3), else FN(group, per_head, ...).
#define GQA_VALUES_DISPATCH(group, per_head, FN, ...)                                                      \
    switch ((group) * 100 + (per_head)) {                                                                  \
        case 104: FN(1, 4, __VA_ARGS__); break;                                                            \
        case 204: FN(2, 4, __VA_ARGS__); break;                                                            \
        case 304: FN(3, 4, __VA_ARGS__); break;                                                            \
        case 404: FN(4, 4, __VA_ARGS__); break;                                                            \
        case 504: FN(5, 4, __VA_ARGS__); break;                                                            \
        case 604: FN(6, 4, __VA_ARGS__); break;                                                            \
        case 108: FN(1, 8, __VA_ARGS__); break;                                                            \
        case 208: FN(2, 8, __VA_ARGS__); break;                                                            \
        case 308: FN(3, 8, __VA_ARGS__); break;                                                            \
        default: FN(group, per_head, __VA_ARGS__);                                                         \
    }

// The values pass of B sequences (a function with KERNEL_ARGS, probs and out): FN, a one_kv_head
// function (group, per_head, p, o, cache, table, len, g, row, dim, block_size, block_stride, offset,
// t_pad), for every kv head of every sequence.
#define VALUES_PASS(FN)                                                                                    \
    for (int64_t b = 0; b < batch; b++)                                                                    \
        for (int64_t g = 0; g < kv_heads; g++)                                                             \
            GQA_VALUES_DISPATCH(heads / kv_heads, dim / 16, FN, probs + b * heads * t_pad, out + b * heads * dim, \
                                cache, block_tables + b * max_blocks, context_lens[b], g, row, dim, block_size, \
                                block_stride, offset, t_pad)

#endif
