// Causal attention of one sequence's new prompt rows over the paged bf16 cache, rows in tiles
// (pdserve.runtime.kernels.cpu_attention.paged_prefill_attention), on CPUs with AVX512-BF16.
//
// Why: a prompt row is computed as the decode kernel (paged_attention.c) computes a generated row, so
// that its bits are a generated row's (tests/test_int8_prompts.py). Run one row at a time, that kernel
// walks the row's whole context, its keys and values coming from L2 once the context outgrows L1, for
// every row: at 200-token prompts (SmolLM2) prompt attention was 17 % of a prefill worker's engine time.
// Here the rows of a tile take turns over each run of 16 keys (and then of values) while the run is in
// L1; each row and head still computes the same sums in the same order (score_run_bf16, add_run_values:
// attention_avx512.h), so the output is the per-row kernel's, bit for bit.
//
// Rows r of a call: the last n positions of a context of `context_len` (row r sees the first
// context_len - n + r + 1), q and out [n, H, D], scores scratch [n, H, t_pad]. Cache layout as in
// paged_attention.c; one block table for every row.
#include "threads.h"
#include <stdint.h>

#define TILE_ROWS 8  // rows sharing each run (their value sums: 8 x 36 vectors of 64 bytes at SmolLM2's shape)

void softmax_rows_f32(float* scores, int64_t rows, int64_t t_pad, int64_t per_len, const int64_t* lens);  // layer_ops.c

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define MAX_HEAD_DIM 256
#define MAX_HEADS 64
#include "attention_avx512.h"

// Row r's tokens of the tile's run at t0 (`step` of them for the longest row): the per-row kernel's run of
// row r, cut at its context (0 or less: its context ended before t0).
static inline int64_t row_run(const int64_t* lens, int64_t r, int64_t t0, int64_t step) {
    return lens[r] - t0 < step ? lens[r] - t0 : step;
}

// Every row's scores of the tile [r0, r1) (lens[r]: row r's context), a run at a time.
static void tile_scores(const uint16_t* q, float* scores, float scale, const uint16_t* cache, const int64_t* table,
                        const int64_t* lens, int64_t r0, int64_t r1, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t t_pad) {
    const int64_t group = heads / kv_heads, row = kv_heads * dim, longest = lens[r1 - 1];
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < longest;) {
        const int64_t step = run_tokens(t0, longest, block_size);
        const uint16_t* keys = cache + table[t0 / block_size] * block_stride + k_offset + (t0 % block_size) * row;
        for (int64_t r = r0; r < r1; r++) {
            const int64_t n = row_run(lens, r, t0, step);
            if (n <= 0) continue;
            for (int64_t hq = 0; hq < heads; hq++)
                score_run_bf16(q + (r * heads + hq) * dim, keys + (hq / group) * dim, n, row, dim, scale16,
                               scores + (r * heads + hq) * t_pad + t0);
        }
        t0 += step;
    }
}

// add_run_values for two rows a and b at once (n_a <= n_b tokens of the run): each token's values widened
// once for both. Each sum still adds its tokens in order: the same sums as two separate calls.
static inline __attribute__((always_inline)) void add_run_values2(
        int64_t group, int64_t per_head, const float* pa, const float* pb, const uint16_t* rows, int64_t t0,
        int64_t n_a, int64_t n_b, int64_t g, int64_t row, int64_t dim, int64_t t_pad, __m512* sums_a, __m512* sums_b) {
    __m512 a[MAX_ACC_VECTORS / 2], b[MAX_ACC_VECTORS / 2];  // [group][per_head] each
    for (int64_t i = 0; i < group * per_head; i++) a[i] = sums_a[i], b[i] = sums_b[i];
    for (int64_t t = t0; t < t0 + n_a; t++) {
        const uint16_t* v = rows + (t - t0) * row + g * dim;
        for (int64_t c = 0; c < per_head; c++) {
            const __m512 vc = widen16(v + c * 16);
            for (int64_t j = 0; j < group; j++) {
                const int64_t at = (g * group + j) * t_pad + t, i = j * per_head + c;
                a[i] = _mm512_fmadd_ps(_mm512_set1_ps(pa[at]), vc, a[i]);
                b[i] = _mm512_fmadd_ps(_mm512_set1_ps(pb[at]), vc, b[i]);
            }
        }
    }
    for (int64_t i = 0; i < group * per_head; i++) sums_a[i] = a[i], sums_b[i] = b[i];
    add_run_values(group, per_head, pb, rows + n_a * row, t0 + n_a, n_b - n_a, g, row, dim, t_pad, sums_b);
}

// Every row's values of the tile [r0, r1) from its probabilities (scores, softmaxed), a run at a time.
static inline __attribute__((always_inline)) void tile_values(
        int64_t group, int64_t per_head, const float* probs, uint16_t* out, const uint16_t* cache,
        const int64_t* table, const int64_t* lens, int64_t r0, int64_t r1, int64_t heads, int64_t kv_heads,
        int64_t dim, int64_t block_size, int64_t block_stride, int64_t v_offset, int64_t t_pad) {
    const int64_t per_kv = group * per_head, per_row = kv_heads * per_kv, row = kv_heads * dim, longest = lens[r1 - 1];
    __m512 sums[TILE_ROWS * MAX_HEADS * MAX_HEAD_DIM / 16 / 4];  // [tile][kv_heads][group][per_head]
    for (int64_t i = 0; i < (r1 - r0) * per_row; i++) sums[i] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < longest;) {
        const int64_t step = run_tokens(t0, longest, block_size);
        const uint16_t* rows = cache + table[t0 / block_size] * block_stride + v_offset + (t0 % block_size) * row;
        for (int64_t r = r0; r < r1; r += 2) {  // rows in pairs (contexts grow with r: b's run is a's or longer)
            const int64_t n = row_run(lens, r, t0, step), nb = r + 1 < r1 ? row_run(lens, r + 1, t0, step) : 0;
            for (int64_t g = 0; g < kv_heads; g++) {
                __m512* sa = sums + (r - r0) * per_row + g * per_kv;
                if (n > 0 && nb > 0 && group * per_head <= MAX_ACC_VECTORS / 2)
                    add_run_values2(group, per_head, probs + r * heads * t_pad, probs + (r + 1) * heads * t_pad,
                                    rows, t0, n, nb, g, row, dim, t_pad, sa, sa + per_row);
                else if (n > 0 || nb > 0)  // one of the two (a row whose context ended before t0 adds nothing)
                    add_run_values(group, per_head, probs + (n > 0 ? r : r + 1) * heads * t_pad, rows, t0,
                                   n > 0 ? n : nb, g, row, dim, t_pad, n > 0 ? sa : sa + per_row);
            }
        }
        t0 += step;
    }
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < kv_heads; g++)
            store_group_rows_bf16(sums + (r - r0) * per_row + g * per_kv, group, per_head, g, dim,
                                  out + r * heads * dim);
}

// Rows [r0, r1) in tiles: scores, each row's softmax, values.
static void prefill_rows(const uint16_t* q, uint16_t* out, float* scores, float scale, const uint16_t* cache,
                         const int64_t* table, const int64_t* lens, int64_t r0, int64_t r1, int64_t heads,
                         int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride, int64_t k_offset,
                         int64_t v_offset, int64_t t_pad) {
    for (int64_t t = r0; t < r1; t += TILE_ROWS) {
        const int64_t t1 = t + TILE_ROWS < r1 ? t + TILE_ROWS : r1;
        tile_scores(q, scores, scale, cache, table, lens, t, t1, heads, kv_heads, dim, block_size, block_stride,
                    k_offset, t_pad);
        for (int64_t r = t; r < t1; r++) softmax_rows_f32(scores + r * heads * t_pad, heads, t_pad, heads, lens + r);
        GQA_VALUES_DISPATCH(heads / kv_heads, dim / 16, tile_values, scores, out, cache, table, lens, t, t1, heads,
                            kv_heads, dim, block_size, block_stride, v_offset, t_pad)
    }
}

// 1 where the tiles do not apply (the caller runs the per-row kernel): head dims not a multiple of 32,
// more heads or a larger group than the register-held sums take. lens [n]: each row's context.
int paged_prefill_bf16_threads(const uint16_t* q, uint16_t* out, float* scores, float scale, const uint16_t* cache,
                               const int64_t* table, const int64_t* lens, int64_t n, int64_t heads, int64_t kv_heads,
                               int64_t dim, int64_t block_size, int64_t block_stride, int64_t k_offset,
                               int64_t v_offset, int64_t t_pad, int64_t threads) {
    const int64_t group = heads / kv_heads;
    if (dim % 32 != 0 || dim > MAX_HEAD_DIM || heads > MAX_HEADS || group * dim / 16 > MAX_ACC_VECTORS
        || kv_heads * group * dim / 16 > MAX_HEADS * MAX_HEAD_DIM / 16 / 4)
        return 1;
    if (threads <= 1) {
        prefill_rows(q, out, scores, scale, cache, table, lens, 0, n, heads, kv_heads, dim, block_size, block_stride,
                     k_offset, v_offset, t_pad);
        return 0;
    }
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t p = 0; p < threads; p++)  // later rows see longer contexts: parts of equal rows differ a little
        prefill_rows(q, out, scores, scale, cache, table, lens, part_start(n, p, threads, TILE_ROWS),
                     part_start(n, p + 1, threads, TILE_ROWS), heads, kv_heads, dim, block_size, block_stride,
                     k_offset, v_offset, t_pad);
    return 0;
}
#else
int paged_prefill_bf16_threads(const uint16_t* q, uint16_t* out, float* scores, float scale, const uint16_t* cache,
                               const int64_t* table, const int64_t* lens, int64_t n, int64_t heads, int64_t kv_heads,
                               int64_t dim, int64_t block_size, int64_t block_stride, int64_t k_offset,
                               int64_t v_offset, int64_t t_pad, int64_t threads) {
    return 1;  // no AVX512-BF16: the per-row kernel
}
#endif
