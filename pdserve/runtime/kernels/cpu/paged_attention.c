// Decode attention over the paged KV cache, read in place (CPU; pdserve.runtime.kernels.cpu_attention).
//
// Why hand-written: torch has no paged attention on the CPU. Its path gathers every sequence's
// blocks into a padded copy, transposes it, and runs the flash kernel, whose fixed cost per
// (sequence, head) dominates at one query per head: at 32 sequences of ~330 tokens (SmolLM2, bf16,
// 1 thread) that was over half of a decode step. These two functions read keys and values straight
// from the cache blocks, for all query heads of a kv head at once; the softmax between them stays in
// torch (vectorized exp).
//
// Cache layout [num_blocks, layers, 2, rows, KVH, D], contiguous (bf16, fp32, or INT8 codes with a
// scale row: pdserve.runtime.kernels.kv_quant); block_tables [B, max_blocks]
// int64 (padded); context_lens [B] int64. Math in fp32 in a fixed order per sequence, so a sequence's
// output does not depend on the rest of the batch. Plain C, no intrinsics: the dot products keep
// LANES independent partial sums so that the compiler vectorizes them without reassociating.
#include "threads.h"
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_HEAD_DIM 256
#define MAX_HEADS 64

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void load_row_bf16(const uint16_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline void load_row_f32(const float* src, float* dst, int64_t n) { memcpy(dst, src, n * sizeof(float)); }

static inline float dot(const float* a, const float* b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// Both functions walk each sequence's context once, row by row: a row holds every kv head's
// D values (contiguous), and a block's rows of one layer are one contiguous run, prefetched a block
// ahead (the cache is far larger than the CPU caches: this pass is bound by memory, not arithmetic).
// Offsets and strides are in cache elements; `chunk` is one (block, layer, k/v) run of `chunk_rows`
// rows: the block's tokens, then (INT8 codes) a scale row holding one fp32 per head at its D slot.
// `row` is a token's stride (every kv head's D values); a call may take a span of the kv heads
// (`kv_heads` of them, `offset` at the first one's D slot, `heads` their query heads).

static inline void load_row_i8(const int8_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = (float)src[i];
}

// Into L2, not L1 (hint 2, prefetcht1): on a 2-core AMD EPYC, one layer's attention at 32 sequences of
// 336 tokens read from memory (benchmarks/cpu_attention_bench.py) took 1.15 ms with prefetcht0 and
// 0.75-0.92 with this; the loads stalled on the core's L1 miss buffers, which L2 prefetches do not hold.
static inline void prefetch_next(const char* next, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(next + i, 0, 2);
}

// The row of token t in its chunk, decoded to fp32 into dst ([KVH * D]); INT8 codes scaled per head.
#define LOAD_TOKEN_ROW(TC, LOADC, SCALED)                                                                     \
    int64_t slot = t % block_size;                                                                            \
    const TC* chunk = cache + table[t / block_size] * block_stride + offset;                                  \
    if (slot == 0 && t + block_size < len)                                                                    \
        prefetch_next((const char*)(cache + table[t / block_size + 1] * block_stride + offset),               \
                      block_size * row * (int64_t)sizeof(TC));                                                \
    LOADC(chunk + slot * row, dst, kv_heads * dim);                                                           \
    if (SCALED)                                                                                               \
        for (int64_t h = 0; h < kv_heads; h++) {                                                              \
            float sc;                                                                                         \
            memcpy(&sc, chunk + block_size * row + h * dim, sizeof sc);                                       \
            for (int64_t d = 0; d < dim; d++) dst[h * dim + d] *= sc;                                         \
        }

#define KERNEL_ARGS(TC)                                                                                       \
    const TC *cache, const int64_t *block_tables, const int64_t *context_lens, int64_t batch,                 \
        int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,                 \
        int64_t block_stride, int64_t offset, int64_t t_pad, int64_t row

// Shared by both kernels: sizes checked against the fixed buffers, then each sequence's length and table.
#define KERNEL_PROLOGUE                                                                                       \
    int64_t group = heads / kv_heads;                                                                         \
    if (dim > MAX_HEAD_DIM || heads > MAX_HEADS) return 1;
#define SEQUENCE_PROLOGUE                                                                                     \
    int64_t len = context_lens[b];                                                                            \
    const int64_t* table = block_tables + b * max_blocks;

// scores [B, H, T_pad]: scale * q . k over each sequence's context; positions past it are untouched.
#define DEFINE_SCORES(NAME, TQ, LOADQ, TC, LOADC, SCALED)                                                     \
    int NAME(const TQ* q, float* scores, float scale, KERNEL_ARGS(TC)) {                                      \
        KERNEL_PROLOGUE                                                                                       \
        static _Thread_local float qf[MAX_HEADS * MAX_HEAD_DIM], dst[MAX_HEADS * MAX_HEAD_DIM];              \
        for (int64_t b = 0; b < batch; b++) {                                                                 \
            SEQUENCE_PROLOGUE                                                                                 \
            LOADQ(q + b * heads * dim, qf, heads * dim);                                                      \
            float* out = scores + b * heads * t_pad;                                                          \
            for (int64_t t = 0; t < len; t++) {                                                               \
                LOAD_TOKEN_ROW(TC, LOADC, SCALED)                                                             \
                for (int64_t hq = 0; hq < heads; hq++)                                                        \
                    out[hq * t_pad + t] = scale * dot(qf + hq * dim, dst + (hq / group) * dim, dim);          \
            }                                                                                                 \
        }                                                                                                     \
        return 0;                                                                                             \
    }

// out [B, H, D] = probs [B, H, T_pad] @ values of each sequence's context (positions past it ignored).
#define DEFINE_WEIGHTED_VALUES(NAME, TQ, STOREQ, TC, LOADC, SCALED)                                           \
    int NAME(const float* probs, TQ* out, KERNEL_ARGS(TC)) {                                                  \
        KERNEL_PROLOGUE                                                                                       \
        static _Thread_local float acc[MAX_HEADS * MAX_HEAD_DIM], dst[MAX_HEADS * MAX_HEAD_DIM];             \
        for (int64_t b = 0; b < batch; b++) {                                                                 \
            SEQUENCE_PROLOGUE                                                                                 \
            const float* p = probs + b * heads * t_pad;                                                       \
            memset(acc, 0, heads * dim * sizeof(float));                                                      \
            for (int64_t t = 0; t < len; t++) {                                                               \
                LOAD_TOKEN_ROW(TC, LOADC, SCALED)                                                             \
                for (int64_t hq = 0; hq < heads; hq++) {                                                      \
                    float w = p[hq * t_pad + t];                                                              \
                    const float* v = dst + (hq / group) * dim;                                                \
                    float* a = acc + hq * dim;                                                                \
                    for (int64_t d = 0; d < dim; d++) a[d] += w * v[d];                                       \
                }                                                                                             \
            }                                                                                                 \
            TQ* o = out + b * heads * dim;                                                                    \
            for (int64_t i = 0; i < heads * dim; i++) o[i] = STOREQ(acc[i]);                                  \
        }                                                                                                     \
        return 0;                                                                                             \
    }

#define STORE_F32(x) (x)

// Names: paged_{scores,values}_<query dtype>_<cache dtype>.
DEFINE_SCORES(paged_scores_bf16_bf16, uint16_t, load_row_bf16, uint16_t, load_row_bf16, 0)
DEFINE_SCORES(paged_scores_f32_f32, float, load_row_f32, float, load_row_f32, 0)
DEFINE_SCORES(paged_scores_bf16_i8, uint16_t, load_row_bf16, int8_t, load_row_i8, 1)
DEFINE_SCORES(paged_scores_f32_i8, float, load_row_f32, int8_t, load_row_i8, 1)
DEFINE_WEIGHTED_VALUES(paged_values_bf16_bf16, uint16_t, f32_to_bf16, uint16_t, load_row_bf16, 0)
DEFINE_WEIGHTED_VALUES(paged_values_f32_f32, float, STORE_F32, float, load_row_f32, 0)
DEFINE_WEIGHTED_VALUES(paged_values_bf16_i8, uint16_t, f32_to_bf16, int8_t, load_row_i8, 1)
DEFINE_WEIGHTED_VALUES(paged_values_f32_i8, float, STORE_F32, int8_t, load_row_i8, 1)

// bf16 queries over a bf16 cache on CPUs with AVX512-BF16, head dims a multiple of 32 (SmolLM2's 64):
// the scores multiply the stored bf16 pairs directly (`vdpbf16ps`, fp32 sums, one horizontal sum a
// score) instead of widening every key to fp32 first, and the weighted values run one kv head at a
// time with its query heads' accumulators in registers instead of reloading [H, D] sums per token.
// The same products, other fp32 sum orders: a sequence's output still depends on nothing else. At
// 32 sequences of 264 tokens (one layer, one thread, Xeon with AVX512-BF16) the scalar-order
// versions above took 1.6 ms, about half of a 32-stream decode step through the stack.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BF16_DOT_ATTENTION 1
// The passes fetch a block's rows this many blocks before they compute them (one: 0.78-0.92 ms in the
// measurement above, two: 0.75, three: 0.80-0.83).
#define BLOCKS_AHEAD 2

// Blocks [0, BLOCKS_AHEAD) of a pass over a context of `len`, and then, at the start of each block, the
// block BLOCKS_AHEAD after it (its run at `offset`, `bytes` long).
static inline void prefetch_first_blocks(const uint16_t* cache, const int64_t* table, int64_t len,
                                         int64_t block_size, int64_t block_stride, int64_t offset, int64_t bytes) {
    for (int64_t j = 0; j < BLOCKS_AHEAD && j * block_size < len; j++)
        prefetch_next((const char*)(cache + table[j] * block_stride + offset), bytes);
}
static inline const char* block_ahead(const uint16_t* cache, const int64_t* table, int64_t t0, int64_t len,
                                      int64_t block_size, int64_t block_stride, int64_t offset) {
    const int64_t ahead = t0 / block_size + BLOCKS_AHEAD;
    if (t0 % block_size != 0 || ahead * block_size >= len) return NULL;
    return (const char*)(cache + table[ahead] * block_stride + offset);
}
#include "attention_avx512.h"

static int bf16_dot_applies(int64_t heads, int64_t kv_heads, int64_t dim) {
    return dim % 32 == 0 && dim <= MAX_HEAD_DIM && heads <= MAX_HEADS && (heads / kv_heads) * dim / 16 <= MAX_ACC_VECTORS;
}

// Scores 16 tokens at a time (a run of consecutive rows in one block): each query head's products
// with the 16 keys, then one transposing reduction (sums16). A token's score is the same sum
// whatever the batch (its lane and its run are fixed by its position in its own sequence).
static void scores_bf16_dot(const uint16_t* q, float* scores, float scale, KERNEL_ARGS(uint16_t)) {
    const int64_t group = heads / kv_heads;
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < batch; b++) {
        SEQUENCE_PROLOGUE
        const uint16_t* qb = q + b * heads * dim;
        float* out = scores + b * heads * t_pad;
        for (int64_t t0 = 0; t0 < len;) {
            const int64_t slot = t0 % block_size;
            const int64_t n = run_tokens(t0, len, block_size);
            const uint16_t* chunk = cache + table[t0 / block_size] * block_stride + offset;
            // A later block's rows, fetched while this run computes, a share before each head: a
            // burst of them all at once waits on the core's few outstanding misses. Its keys and its
            // values (the run after them: [2, rows, KVH, D]), so that the values pass finds them in
            // the L2 cache: one 12 KB stream a block instead of two 6 KB ones, a pass apart (SmolLM2,
            // 32 x 300 tokens, 30 layers, one thread, AMD EPYC: 16.2-17.0 against 17.6-18.8 ms; in a
            // 28-sequence decode step the values pass went from 17 to 11 % of it, the scores from 16 to 20).
            const char* next = block_ahead(cache, table, t0, len, block_size, block_stride, offset);
            const int64_t next_bytes = 2 * block_size * row * (int64_t)sizeof(uint16_t);
            const int64_t share_bytes = (next_bytes / heads + 63) / 64 * 64;
            if (t0 == 0) prefetch_first_blocks(cache, table, len, block_size, block_stride, offset, next_bytes);
            const uint16_t* keys = chunk + slot * row;
            for (int64_t hq = 0; hq < heads; hq++) {
                if (next != NULL)
                    for (int64_t i = hq * share_bytes; i < (hq + 1) * share_bytes && i < next_bytes; i += 64)
                        __builtin_prefetch(next + i, 0, 2);
                score_run_bf16(qb + hq * dim, keys + (hq / group) * dim, n, row, dim, scale16, out + hq * t_pad + t0);
            }
            t0 += n;
        }
    }
}

// One sequence's values, its kv heads' query heads (out: its [H, dim]), block by block: each run of a
// block's rows serves every kv head while it is in the L1 cache, a kv head's `group * per_head` sums
// in registers for the run and kept in `sums` between runs. (A kv head at a time over the whole context
// read the rows once a kv head, from L2 after the first: 0.82 against 0.68 ms in the measurement above.)
// Each sum adds the tokens in context order, as before. Inlined with constant group and per_head (the
// dispatch below), so that a run's sums stay in registers.
static inline __attribute__((always_inline)) void values_one_sequence(
        int64_t group, int64_t per_head, const float* p, uint16_t* out, const uint16_t* cache, const int64_t* table,
        int64_t len, int64_t kv_heads, int64_t row, int64_t dim, int64_t block_size, int64_t block_stride,
        int64_t offset, int64_t t_pad) {
    __m512 sums[MAX_HEADS * MAX_HEAD_DIM / 16];  // [kv_heads][group][per_head]
    const int64_t per_kv = group * per_head;  // no fetching ahead: the scores pass fetched keys and values
    for (int64_t i = 0; i < kv_heads * per_kv; i++) sums[i] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len;) {
        const int64_t n = run_tokens(t0, len, block_size);
        const uint16_t* rows = cache + table[t0 / block_size] * block_stride + offset + (t0 % block_size) * row;
        for (int64_t g = 0; g < kv_heads; g++)
            add_run_values(group, per_head, p, rows, t0, n, g, row, dim, t_pad, sums + g * per_kv);
        t0 += n;
    }
    for (int64_t g = 0; g < kv_heads; g++) store_group_rows_bf16(sums + g * per_kv, group, per_head, g, dim, out);
}

static void values_bf16_dot(const float* probs, uint16_t* out, KERNEL_ARGS(uint16_t)) {
    for (int64_t b = 0; b < batch; b++)
        GQA_VALUES_DISPATCH(heads / kv_heads, dim / 16, values_one_sequence, probs + b * heads * t_pad,
                            out + b * heads * dim, cache, block_tables + b * max_blocks, context_lens[b], kv_heads,
                            row, dim, block_size, block_stride, offset, t_pad)
}
#endif

void softmax_rows_f32(float* scores, int64_t rows, int64_t t_pad, int64_t per_len, const int64_t* lens);  // layer_ops.c

// One sequence's query heads of kv heads [g0, g1) (q, out: its [H, D]; scores: its [H, T_pad]
// scratch): their scores, the softmax in place, then out, each head as a call over all heads computes
// it. k_offset and v_offset: where the layer's keys and values start in a block (cache elements).
// `NAME##_units` runs units [u0, u1) of B sequences' (sequence, kv head) pairs, in order, each
// sequence's run of them as one `NAME##_heads` call: the one split of the work, by the one-call decode
// step's members and by `NAME##_threads` (below), so that a step of fewer sequences than threads still
// spreads (one sequence: its kv heads over the threads). `NAME` runs every head of B sequences.
#define DEFINE_ATTENTION(NAME, TQ, TC, SCORES, VALUES)                                                       \
    int NAME##_heads(const TQ* q, TQ* out, float* scores, float scale, const TC* cache, const int64_t* table,  \
                     const int64_t* len, int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim,      \
                     int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset, int64_t t_pad, \
                     int64_t g0, int64_t g1) {                                                                \
        const int64_t group = heads / kv_heads, h0 = g0 * group, n = (g1 - g0) * group, row = kv_heads * dim;  \
        if (SCORES(q + h0 * dim, scores + h0 * t_pad, scale, cache, table, len, 1, max_blocks, n, g1 - g0, dim,  \
                   block_size, block_stride, k_offset + g0 * dim, t_pad, row))                                \
            return 1;                                                                                         \
        softmax_rows_f32(scores + h0 * t_pad, n, t_pad, n, len);                                              \
        return VALUES(scores + h0 * t_pad, out + h0 * dim, cache, table, len, 1, max_blocks, n, g1 - g0, dim,   \
                      block_size, block_stride, v_offset + g0 * dim, t_pad, row);                             \
    }                                                                                                         \
    int NAME##_units(const TQ* q, TQ* out, float* scores, float scale, const TC* cache,                       \
                     const int64_t* block_tables, const int64_t* context_lens, int64_t max_blocks, int64_t heads, \
                     int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride, int64_t k_offset,   \
                     int64_t v_offset, int64_t t_pad, int64_t u0, int64_t u1) {                               \
        for (int64_t u = u0; u < u1;) {                                                                       \
            const int64_t b = u / kv_heads, g0 = u % kv_heads;                                                \
            const int64_t g1 = kv_heads < g0 + u1 - u ? kv_heads : g0 + u1 - u;                               \
            if (NAME##_heads(q + b * heads * dim, out + b * heads * dim, scores + b * heads * t_pad, scale, cache, \
                             block_tables + b * max_blocks, context_lens + b, max_blocks, heads, kv_heads, dim,   \
                             block_size, block_stride, k_offset, v_offset, t_pad, g0, g1))                    \
                return 1;                                                                                     \
            u += g1 - g0;                                                                                     \
        }                                                                                                     \
        return 0;                                                                                             \
    }                                                                                                         \
    int NAME(const TQ* q, TQ* out, float* scores, float scale, const TC* cache, const int64_t* block_tables,  \
             const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads, int64_t kv_heads,  \
             int64_t dim, int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,        \
             int64_t t_pad) {                                                                                 \
        return NAME##_units(q, out, scores, scale, cache, block_tables, context_lens, max_blocks, heads, kv_heads, \
                            dim, block_size, block_stride, k_offset, v_offset, t_pad, 0, batch * kv_heads);   \
    }

// Names: paged_attention_<query dtype>_<cache dtype>.
#ifdef BF16_DOT_ATTENTION
// bf16 over bf16: the AVX512-BF16 passes where they apply, else the portable ones.
static int scores_bf16_any(const uint16_t* q, float* scores, float scale, KERNEL_ARGS(uint16_t)) {
    if (!bf16_dot_applies(heads, kv_heads, dim))
        return paged_scores_bf16_bf16(q, scores, scale, cache, block_tables, context_lens, batch, max_blocks, heads,
                                      kv_heads, dim, block_size, block_stride, offset, t_pad, row);
    scores_bf16_dot(q, scores, scale, cache, block_tables, context_lens, batch, max_blocks, heads, kv_heads, dim,
                    block_size, block_stride, offset, t_pad, row);
    return 0;
}

static int values_bf16_any(const float* probs, uint16_t* out, KERNEL_ARGS(uint16_t)) {
    if (!bf16_dot_applies(heads, kv_heads, dim))
        return paged_values_bf16_bf16(probs, out, cache, block_tables, context_lens, batch, max_blocks, heads,
                                      kv_heads, dim, block_size, block_stride, offset, t_pad, row);
    values_bf16_dot(probs, out, cache, block_tables, context_lens, batch, max_blocks, heads, kv_heads, dim,
                    block_size, block_stride, offset, t_pad, row);
    return 0;
}
DEFINE_ATTENTION(paged_attention_bf16_bf16, uint16_t, uint16_t, scores_bf16_any, values_bf16_any)
#else
DEFINE_ATTENTION(paged_attention_bf16_bf16, uint16_t, uint16_t, paged_scores_bf16_bf16, paged_values_bf16_bf16)
#endif
// A pass that tries a vectorized version first (it returns 1 where it does not apply), then the portable one.
#define KERNEL_CALL_ARGS                                                                                   \
    cache, block_tables, context_lens, batch, max_blocks, heads, kv_heads, dim, block_size, block_stride, offset, \
        t_pad, row
#define SCORES_EITHER(NAME, TQ, TC, FAST, PORTABLE)                                                         \
    static int NAME(const TQ* q, float* scores, float scale, KERNEL_ARGS(TC)) {                            \
        return FAST(q, scores, scale, KERNEL_CALL_ARGS) && PORTABLE(q, scores, scale, KERNEL_CALL_ARGS);   \
    }
#define VALUES_EITHER(NAME, TQ, TC, FAST, PORTABLE)                                                         \
    static int NAME(const float* probs, TQ* out, KERNEL_ARGS(TC)) {                                        \
        return FAST(probs, out, KERNEL_CALL_ARGS) && PORTABLE(probs, out, KERNEL_CALL_ARGS);               \
    }

// fp32 over fp32: the AVX2 passes (paged_attention_f32.c) where they apply, else the portable ones.
int paged_scores_f32_avx2(const float* q, float* scores, float scale, KERNEL_ARGS(float));
int paged_values_f32_avx2(const float* probs, float* out, KERNEL_ARGS(float));
SCORES_EITHER(scores_f32_any, float, float, paged_scores_f32_avx2, paged_scores_f32_f32)
VALUES_EITHER(values_f32_any, float, float, paged_values_f32_avx2, paged_values_f32_f32)
DEFINE_ATTENTION(paged_attention_f32_f32, float, float, scores_f32_any, values_f32_any)
// bf16 over INT8 codes: the AVX512-BF16 passes (paged_attention_i8.c) where they apply, else the portable ones.
int paged_scores_bf16_i8_avx512(const uint16_t* q, float* scores, float scale, KERNEL_ARGS(int8_t));
int paged_values_bf16_i8_avx512(const float* probs, uint16_t* out, KERNEL_ARGS(int8_t));
SCORES_EITHER(scores_bf16_i8_any, uint16_t, int8_t, paged_scores_bf16_i8_avx512, paged_scores_bf16_i8)
VALUES_EITHER(values_bf16_i8_any, uint16_t, int8_t, paged_values_bf16_i8_avx512, paged_values_bf16_i8)
DEFINE_ATTENTION(paged_attention_bf16_i8, uint16_t, int8_t, scores_bf16_i8_any, values_bf16_i8_any)
DEFINE_ATTENTION(paged_attention_f32_i8, float, int8_t, paged_scores_f32_i8, paged_values_f32_i8)

// The entry points Python calls (cpu_attention): the (sequence, kv head) units in `threads` contiguous
// parts over OpenMP threads (threads.h), as the one-call decode step splits them. A sequence's output
// is the same whatever the split: each head is computed alone, in its own fixed order.
#define DEFINE_THREADED_ATTENTION(NAME, TQ, TC)                                                               \
    int NAME##_threads(const TQ* q, TQ* out, float* scores, float scale, const TC* cache,                      \
                       const int64_t* block_tables, const int64_t* context_lens, int64_t batch,               \
                       int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,   \
                       int64_t block_stride, int64_t k_offset, int64_t v_offset, int64_t t_pad,                \
                       int64_t threads) {                                                                     \
        if (threads <= 1)                                                                                     \
            return NAME(q, out, scores, scale, cache, block_tables, context_lens, batch, max_blocks, heads,   \
                        kv_heads, dim, block_size, block_stride, k_offset, v_offset, t_pad);                  \
        int failed = 0;                                                                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(|:failed)")                   \
        for (int64_t p = 0; p < threads; p++)                                                                 \
            failed |= NAME##_units(q, out, scores, scale, cache, block_tables, context_lens, max_blocks, heads, \
                                   kv_heads, dim, block_size, block_stride, k_offset, v_offset, t_pad,        \
                                   part_start(batch * kv_heads, p, threads, 1),                               \
                                   part_start(batch * kv_heads, p + 1, threads, 1));                          \
        return failed;                                                                                        \
    }

DEFINE_THREADED_ATTENTION(paged_attention_bf16_bf16, uint16_t, uint16_t)
DEFINE_THREADED_ATTENTION(paged_attention_f32_f32, float, float)
DEFINE_THREADED_ATTENTION(paged_attention_bf16_i8, uint16_t, int8_t)
DEFINE_THREADED_ATTENTION(paged_attention_f32_i8, float, int8_t)
