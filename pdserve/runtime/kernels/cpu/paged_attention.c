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

static inline void load_row_i8(const int8_t* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = (float)src[i];
}

static inline void prefetch_next(const char* next, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(next + i);
}

// The row of token t in its chunk, decoded to fp32 into dst ([KVH * D]); INT8 codes scaled per head.
#define LOAD_TOKEN_ROW(TC, LOADC, SCALED)                                                                     \
    int64_t slot = t % block_size;                                                                            \
    const TC* chunk = cache + table[t / block_size] * block_stride + offset;                                  \
    if (slot == 0 && t + block_size < len)                                                                    \
        prefetch_next((const char*)(cache + table[t / block_size + 1] * block_stride + offset),               \
                      block_size * row * (int64_t)sizeof(TC));                                                \
    LOADC(chunk + slot * row, dst, row);                                                                      \
    if (SCALED)                                                                                               \
        for (int64_t h = 0; h < kv_heads; h++) {                                                              \
            float sc;                                                                                         \
            memcpy(&sc, chunk + block_size * row + h * dim, sizeof sc);                                       \
            for (int64_t d = 0; d < dim; d++) dst[h * dim + d] *= sc;                                         \
        }

#define KERNEL_ARGS(TC)                                                                                       \
    const TC *cache, const int64_t *block_tables, const int64_t *context_lens, int64_t batch,                 \
        int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,                 \
        int64_t block_stride, int64_t offset, int64_t t_pad

// Shared by both kernels: sizes checked against the fixed buffers, then each sequence's length and table.
#define KERNEL_PROLOGUE                                                                                       \
    int64_t group = heads / kv_heads, row = kv_heads * dim;                                                   \
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

void softmax_rows_f32(float* scores, int64_t rows, int64_t t_pad, int64_t per_len, const int64_t* lens);  // layer_ops.c

// One call: scores into `scores` ([B, H, T_pad] scratch), their softmax in place, then out. k_offset
// and v_offset: where the layer's keys and values start in a block (cache elements).
#define DEFINE_ATTENTION(NAME, TQ, TC, SCORES, VALUES)                                                       \
    int NAME(const TQ* q, TQ* out, float* scores, float scale, const TC* cache, const int64_t* block_tables,  \
             const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads, int64_t kv_heads,  \
             int64_t dim, int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,        \
             int64_t t_pad) {                                                                                 \
        if (SCORES(q, scores, scale, cache, block_tables, context_lens, batch, max_blocks, heads, kv_heads,  \
                   dim, block_size, block_stride, k_offset, t_pad))                                           \
            return 1;                                                                                         \
        softmax_rows_f32(scores, batch * heads, t_pad, heads, context_lens);                                  \
        return VALUES(scores, out, cache, block_tables, context_lens, batch, max_blocks, heads, kv_heads, dim, \
                      block_size, block_stride, v_offset, t_pad);                                             \
    }

// Names: paged_attention_<query dtype>_<cache dtype>.
DEFINE_ATTENTION(paged_attention_bf16_bf16, uint16_t, uint16_t, paged_scores_bf16_bf16, paged_values_bf16_bf16)
DEFINE_ATTENTION(paged_attention_f32_f32, float, float, paged_scores_f32_f32, paged_values_f32_f32)
DEFINE_ATTENTION(paged_attention_bf16_i8, uint16_t, int8_t, paged_scores_bf16_i8, paged_values_bf16_i8)
DEFINE_ATTENTION(paged_attention_f32_i8, float, int8_t, paged_scores_f32_i8, paged_values_f32_i8)
