// bf16 decode attention over an INT8 paged cache with AVX512-BF16 (paged_attention.c's bf16_i8
// passes where they apply). Why: the portable passes widen every code to fp32, scale it, and take one
// dot product per query head with a horizontal sum each: at 32 sequences of 270 tokens (SmolLM2, 30
// layers, one thread, Xeon with AVX512-BF16) 54 ms with every block in cache and 74 from memory,
// where the bf16 cache's passes take 11 and 37. So an INT8 cache (half the bytes) was slower to read;
// these passes take 14 and 30.
//
// The codes are exact in bf16 (|code| <= 127 needs 7 significant bits), so a run of 16 keys is
// widened to bf16 once (into L1) and the scores take the bf16 cache's `vdpbf16ps` products on it;
// the block's per-head scale multiplies each fp32 sum (q . (s * c) = s * (q . c)). The values fold
// the scale into the probability (p * s, then times the code widened to fp32). Other rounding than
// the portable passes' (which scale each code first), as close to the dequantized cache's attention;
// every value of a sequence is computed in an order fixed by its own positions, so its output depends
// on nothing else in the batch.
//
// Cache layout [num_blocks, layers, 2, bs + 1, KVH, D] int8; row bs of a (block, layer, k/v) run
// holds head h's fp32 scale in the first 4 bytes of its D-byte slot (pdserve.runtime.kv_cache).
// `offset` is where the layer's K (or V) run starts in a block, at the first of the call's
// `kv_heads` (a span of a token's, whose stride is `row`). Both return 1 where they do not apply (no
// AVX512-BF16, a head dim not a multiple of 32, too many query heads a kv head): the caller runs the
// portable passes.
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256  // paged_attention.c's
#define MAX_HEADS 64

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "attention_avx512.h"

static int i8_dot_applies(int64_t heads, int64_t kv_heads, int64_t dim) {
    return dim % 32 == 0 && dim <= MAX_HEAD_DIM && heads <= MAX_HEADS && heads % kv_heads == 0 &&
           (heads / kv_heads) * dim / 16 <= MAX_ACC_VECTORS;
}

static inline float head_scale(const int8_t* run, int64_t block_size, int64_t row, int64_t dim, int64_t h) {
    float s;
    memcpy(&s, run + block_size * row + h * dim, sizeof s);
    return s;
}

// Into L2 (hint 2), as paged_attention.c's prefetch_next: 32 x 336 from memory, 0.88 -> 0.65-0.80 ms a layer.
static inline void prefetch_run(const int8_t* run, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char*)run + i, 0, 2);
}

// n rows of `width` codes (row stride `row`) -> bf16 [n, width], exact (widths a multiple of 32).
static void widen_rows(const int8_t* codes, int64_t n, int64_t width, int64_t row, uint16_t* out) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t d = 0; d < width; d += 32) {
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(codes + i * row + d)));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
            _mm512_storeu_si512(out + i * width + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
}

// scores [B, H, T_pad] = scale * q . k over each sequence's context, 16 tokens (one run of a block) at
// a time: the run widened, each query head's 16 products summed by one transposing reduction, times
// its kv head's scale in the block.
int paged_scores_bf16_i8_avx512(const uint16_t* q, float* scores, float scale, const int8_t* cache,
                                const int64_t* block_tables, const int64_t* context_lens, int64_t batch,
                                int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                int64_t block_stride, int64_t offset, int64_t t_pad, int64_t row) {
    if (!i8_dot_applies(heads, kv_heads, dim)) return 1;
    static _Thread_local uint16_t keys[16 * MAX_HEADS * MAX_HEAD_DIM] __attribute__((aligned(64)));
    const int64_t group = heads / kv_heads, width = kv_heads * dim, run_bytes = (block_size + 1) * row;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = context_lens[b];
        const int64_t* table = block_tables + b * max_blocks;
        const uint16_t* qb = q + b * heads * dim;
        float* out = scores + b * heads * t_pad;
        for (int64_t t0 = 0; t0 < len;) {
            const int64_t slot = t0 % block_size;
            const int64_t n = run_tokens(t0, len, block_size);
            const int8_t* run = cache + table[t0 / block_size] * block_stride + offset;
            if (t0 + n < len && (t0 + n) % block_size == 0)
                prefetch_run(cache + table[(t0 + n) / block_size] * block_stride + offset, run_bytes);
            widen_rows(run + slot * row, n, width, row, keys);
            for (int64_t hq = 0; hq < heads; hq++) {
                const int64_t g = hq / group;
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t d = 0; d < dim; d += 32) {
                    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + hq * dim + d);
                    const uint16_t* kd = keys + g * dim + d;
                    for (int i = 0; i < 16; i++) {  // rows past the run read row 0 again: lanes discarded
                        const __m512bh k = (__m512bh)_mm512_loadu_si512(kd + (i < n ? i : 0) * width);
                        acc[i] = _mm512_dpbf16_ps(acc[i], qv, k);
                    }
                }
                const __m512 s = _mm512_set1_ps(scale * head_scale(run, block_size, row, dim, g));
                _mm512_mask_storeu_ps(out + hq * t_pad + t0, (__mmask16)((1u << n) - 1), _mm512_mul_ps(s, sums16(acc)));
            }
            t0 += n;
        }
    }
    return 0;
}

static inline __m512 widen16_i8(const int8_t* p) {  // 16 codes -> 16 fp32, exact
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// One kv head g of one sequence: its `group` query heads' rows of out, sums in registers. Inlined
// with constant group and per_head (the dispatch below).
static inline __attribute__((always_inline)) void values_i8_one_kv_head(
        int64_t group, int64_t per_head, const float* p, uint16_t* out, const int8_t* cache, const int64_t* table,
        int64_t len, int64_t g, int64_t row, int64_t dim, int64_t block_size, int64_t block_stride, int64_t offset,
        int64_t t_pad) {
    __m512 acc[MAX_ACC_VECTORS];  // [group][per_head]
    for (int64_t i = 0; i < group * per_head; i++) acc[i] = _mm512_setzero_ps();
    const int64_t run_bytes = (block_size + 1) * row;
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int8_t* run = cache + table[t0 / block_size] * block_stride + offset;
        if (g == 0 && t0 + block_size < len)
            prefetch_run(cache + table[t0 / block_size + 1] * block_stride + offset, run_bytes);
        const float s = head_scale(run, block_size, row, dim, g);
        const int64_t end = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t slot = 0; slot < end; slot++) {
            const int8_t* v = run + slot * row + g * dim;
            for (int64_t c = 0; c < per_head; c++) {
                const __m512 vc = widen16_i8(v + c * 16);
                for (int64_t j = 0; j < group; j++)
                    acc[j * per_head + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[(g * group + j) * t_pad + t0 + slot] * s),
                                                            vc, acc[j * per_head + c]);
            }
        }
    }
    store_group_rows_bf16(acc, group, per_head, g, dim, out);
}

// out [B, H, D] = probs [B, H, T_pad] @ the values of each sequence's context, one kv head at a time.
int paged_values_bf16_i8_avx512(const float* probs, uint16_t* out, const int8_t* cache, const int64_t* block_tables,
                                const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads,
                                int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride,
                                int64_t offset, int64_t t_pad, int64_t row) {
    if (!i8_dot_applies(heads, kv_heads, dim)) return 1;
    VALUES_PASS(values_i8_one_kv_head)
    return 0;
}
#else
int paged_scores_bf16_i8_avx512(const uint16_t* q, float* scores, float scale, const int8_t* cache,
                                const int64_t* block_tables, const int64_t* context_lens, int64_t batch,
                                int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                int64_t block_stride, int64_t offset, int64_t t_pad, int64_t row) {
    return 1;
}

int paged_values_bf16_i8_avx512(const float* probs, uint16_t* out, const int8_t* cache, const int64_t* block_tables,
                                const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads,
                                int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride,
                                int64_t offset, int64_t t_pad, int64_t row) {
    return 1;
}
#endif
