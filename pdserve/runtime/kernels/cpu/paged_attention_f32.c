// fp32 decode attention over an fp32 paged cache with AVX2 + FMA (paged_attention.c's f32_f32 passes
// where they apply). Why: the portable passes copy each token's row, then take one dot product per
// query head with a horizontal sum each, and reload the [H, D] value sums from memory for every
// token: at 32 sequences of 300 tokens (SmolLM2, fp32, 2 threads, AVX2 EPYC) 48 ms of 30 layers,
// four times what reading the cache costs. Here the scores take 8 tokens at a time, each query head's
// 8 products summed by one transposing reduction; the weighted values keep a kv head's query heads'
// sums in registers, a share of the head dim a pass. Every value of a sequence is computed in an
// order fixed by its own positions: its output depends on nothing else in the batch.
//
// Cache layout as paged_attention.c's: [num_blocks, layers, 2, rows, KVH, D]; `offset` is where the
// layer's K (or V) rows start in a block, in floats, at the first of the call's `kv_heads` (a span
// of a token's, whose stride is `row`). Both return 1 where they do not apply (no AVX2, a head dim
// not a multiple of 8): the caller runs the portable passes.
#include <stdint.h>
#include <string.h>

#define TILE 8       // tokens a score pass takes at once (the lanes of one vector)
#define MAX_ACC 12   // fp32 vectors of value sums a pass keeps in registers (of AVX2's 16)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// 8 vectors' horizontal sums as one vector: lane i is the sum of v[i]'s lanes.
static inline __m256 sums8(const __m256 v[8]) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // 128-bit halves: 4-lane partials
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// Into L2 (hint 2), as paged_attention.c's prefetch_next: 32 x 336 from memory, 2.6 -> 1.8-2.0 ms a layer.
static inline void prefetch_bytes(const char* p, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; i += 64) __builtin_prefetch(p + i, 0, 2);
}

// scores [B, H, T_pad] = scale * q . k over each sequence's context (positions past it untouched).
int paged_scores_f32_avx2(const float* q, float* scores, float scale, const float* cache, const int64_t* block_tables,
                          const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride, int64_t offset,
                          int64_t t_pad, int64_t row) {
    if (dim % 8 != 0 || heads % kv_heads != 0) return 1;
    const int64_t group = heads / kv_heads;
    const int64_t block_bytes = block_size * row * (int64_t)sizeof(float);
    const int64_t share_bytes = (block_bytes / heads + 63) / 64 * 64;  // of the next block, fetched per head
    const __m256 scale8 = _mm256_set1_ps(scale);
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = context_lens[b], *table = block_tables + b * max_blocks;
        const float* qb = q + b * heads * dim;
        float* out = scores + b * heads * t_pad;
        for (int64_t t0 = 0; t0 < len;) {  // a tile: up to 8 consecutive rows of one block
            const int64_t slot = t0 % block_size;
            int64_t n = block_size - slot < TILE ? block_size - slot : TILE;
            n = len - t0 < n ? len - t0 : n;
            const float* keys = cache + table[t0 / block_size] * block_stride + offset + slot * row;
            // The next block's rows are fetched while this tile computes, a share before each head
            // (a burst of them all at once waits on the core's few outstanding misses).
            const char* next = t0 + n < len && (t0 + n) % block_size == 0
                                   ? (const char*)(cache + table[(t0 + n) / block_size] * block_stride + offset) : NULL;
            if (t0 == 0) prefetch_bytes((const char*)keys, 0, block_bytes);
            for (int64_t hq = 0; hq < heads; hq++) {
                if (next != NULL) {
                    const int64_t lo = hq * share_bytes, hi = lo + share_bytes;
                    prefetch_bytes(next, lo, hi < block_bytes ? hi : block_bytes);
                }
                const float* kh = keys + (hq / group) * dim;
                __m256 acc[TILE];
                for (int i = 0; i < TILE; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t d = 0; d < dim; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qb + hq * dim + d);
                    for (int i = 0; i < TILE; i++)  // rows past the tile read its row 0 again: lanes discarded
                        acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kh + (i < n ? i : 0) * row + d), acc[i]);
                }
                float s[TILE];
                _mm256_storeu_ps(s, _mm256_mul_ps(scale8, sums8(acc)));
                memcpy(out + hq * t_pad + t0, s, n * sizeof(float));
            }
            t0 += n;
        }
    }
    return 0;
}

// Chunks [c0, c0 + NC) of 8 floats of kv head g's `G` query heads over one sequence's values: out rows
// of those heads. Inlined with constant G and NC (the dispatch below) so that the G * NC sums stay in
// registers; each sum is accumulated over the tokens in order, one fma a token.
static inline __attribute__((always_inline)) void values_pass(
        const float* p, float* out, const float* cache, const int64_t* table, int64_t len, int64_t g, int64_t G,
        int64_t c0, int64_t NC, int64_t row, int64_t dim, int64_t block_size, int64_t block_stride, int64_t offset,
        int64_t t_pad) {
    __m256 acc[MAX_ACC];  // [G][NC]
    for (int64_t i = 0; i < G * NC; i++) acc[i] = _mm256_setzero_ps();
    const int64_t block_bytes = block_size * row * (int64_t)sizeof(float);
    for (int64_t t = 0; t < len; t++) {
        const int64_t slot = t % block_size;
        const float* chunk = cache + table[t / block_size] * block_stride + offset;
        if (g == 0 && c0 == 0 && slot == 0 && t + block_size < len)  // the first pass fetches the next block
            prefetch_bytes((const char*)(cache + table[t / block_size + 1] * block_stride + offset), 0, block_bytes);
        const float* v = chunk + slot * row + g * dim + c0 * 8;
        for (int64_t j = 0; j < G; j++) {
            const __m256 w = _mm256_set1_ps(p[(g * G + j) * t_pad + t]);
            for (int64_t c = 0; c < NC; c++)
                acc[j * NC + c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + c * 8), acc[j * NC + c]);
        }
    }
    for (int64_t j = 0; j < G; j++)
        for (int64_t c = 0; c < NC; c++) _mm256_storeu_ps(out + (g * G + j) * dim + (c0 + c) * 8, acc[j * NC + c]);
}

// Chunks a pass takes for a group of G query heads: a power of two that divides the head's chunks.
static int64_t chunks_per_pass(int64_t G, int64_t per_head) {
    int64_t nc = 8;
    while (nc > 1 && (G * nc > MAX_ACC || per_head % nc != 0)) nc /= 2;
    return nc;
}

// out [B, H, D] = probs [B, H, T_pad] @ values of each sequence's context (positions past it ignored).
int paged_values_f32_avx2(const float* probs, float* out, const float* cache, const int64_t* block_tables,
                          const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride, int64_t offset,
                          int64_t t_pad, int64_t row) {
    const int64_t group = heads / kv_heads, per_head = dim / 8;
    if (dim % 8 != 0 || heads % kv_heads != 0 || group > MAX_ACC) return 1;
    const int64_t nc = chunks_per_pass(group, per_head);
    for (int64_t b = 0; b < batch; b++) {
        const int64_t len = context_lens[b], *table = block_tables + b * max_blocks;
        const float* p = probs + b * heads * t_pad;
        float* o = out + b * heads * dim;
        for (int64_t g = 0; g < kv_heads; g++)
            for (int64_t c0 = 0; c0 < per_head; c0 += nc) {
#define VALUES_CASE(G, NC)                                                                                   \
    case G * 100 + NC:                                                                                        \
        values_pass(p, o, cache, table, len, g, G, c0, NC, row, dim, block_size, block_stride, offset, t_pad); \
        break;
                switch (group * 100 + nc) {  // GQA groups 1-12 at the chunk counts chunks_per_pass picks
                    VALUES_CASE(1, 8) VALUES_CASE(1, 4) VALUES_CASE(1, 2) VALUES_CASE(1, 1)
                    VALUES_CASE(2, 4) VALUES_CASE(2, 2) VALUES_CASE(2, 1) VALUES_CASE(3, 4) VALUES_CASE(3, 2)
                    VALUES_CASE(3, 1) VALUES_CASE(4, 2) VALUES_CASE(4, 1) VALUES_CASE(5, 2) VALUES_CASE(5, 1)
                    VALUES_CASE(6, 2) VALUES_CASE(6, 1) VALUES_CASE(7, 1) VALUES_CASE(8, 1)
                    default:
                        values_pass(p, o, cache, table, len, g, group, c0, nc, row, dim, block_size, block_stride,
                                    offset, t_pad);
                }
#undef VALUES_CASE
            }
    }
    return 0;
}

#else  // no AVX2 + FMA: the portable passes run
int paged_scores_f32_avx2(const float* q, float* scores, float scale, const float* cache, const int64_t* block_tables,
                          const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride, int64_t offset,
                          int64_t t_pad, int64_t row) {
    return 1;
}

int paged_values_f32_avx2(const float* probs, float* out, const float* cache, const int64_t* block_tables,
                          const int64_t* context_lens, int64_t batch, int64_t max_blocks, int64_t heads,
                          int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride, int64_t offset,
                          int64_t t_pad, int64_t row) {
    return 1;
}
#endif
