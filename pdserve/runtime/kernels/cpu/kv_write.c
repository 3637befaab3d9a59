// Writing new keys and values into an INT8 paged KV cache (CPU; pdserve.runtime.kernels.cpu_kv_write).
//
// Why hand-written: the torch version (pdserve.runtime.kernels.kv_quant.write_kv, the reference)
// is dozens of small ops per layer per step (unique, scatter_reduce, masks, fancy-index scatters),
// which at 32 decode streams of SmolLM2 cost what the INT8 read saves. This does the same in one
// pass over the new rows (plus the requantize of a block whose scale grew), with the same bits:
//
//   per (block, k/v, head) of the call: scale = max(old scale, or 0 if the call writes the block's
//   offset 0; amax of ALL the call's rows in the block / 127), at least 2^-100. If it grew from an
//   old scale > 0 in any head, the block's codes of every head are requantized: round(code * (old /
//   new)). New codes: round(x / scale) clamped to [-127, 127]. round is half to even (rintf under
//   the default rounding mode, as torch.round); x / scale is a true fp32 division, as torch's.
//
// -ffp-contract=fast (the library's CFLAGS) cannot change a result here: no expression multiplies
// and adds (divisions, one product fed to rintf, comparisons), so there is nothing to fuse.
//
// Cache layout [num_blocks, layers, 2, bs + 1, KVH, D] int8, contiguous; row bs of a (block, layer,
// k/v) run holds head h's fp32 scale in the first 4 bytes of its D-byte slot (pdserve.runtime.kv_cache).
// Inputs k, v [N, KVH, D] (fp32 or bf16), each head's D values contiguous and a row's heads adjacent;
// rows `row_stride` elements apart (the value tensor is a strided view of the fused qkv output).
// Offsets and strides of the cache are in bytes (= elements).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define QMAX 127.0f

static const float TINY = 0x1p-100f;  // kv_quant._TINY: the scale of an all-zero head

static inline float bf16_bits_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline int8_t encode(float x) {  // kv_quant.encode for int8: round half to even, then saturate
    float q = rintf(x);
    q = q < QMAX ? q : QMAX;  // (in this order of operands: vminps / vmaxps)
    q = q > -QMAX ? q : -QMAX;
    return (int8_t)(int32_t)q;
}

// max |x| over n values. The bits of a float without its sign order as the float does (+0 lowest,
// then subnormals, normals, inf; a NaN above them all, so it propagates as torch's amax does): an
// integer max, which the compiler vectorizes where a float max reduction (NaN rules) it does not.
static inline float amax_f32(const float* x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        u &= 0x7fffffffu;
        m = u > m ? u : m;
    }
    float f;
    memcpy(&f, &m, sizeof f);
    return f;
}

static inline float amax_bf16(const uint16_t* x, int64_t n) {
    uint16_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t u = x[i] & 0x7fffu;
        m = u > m ? u : m;
    }
    return bf16_bits_to_f32(m);
}

static inline float fmax_nonnegative(float a, float b) { return a != a || a > b ? a : b; }  // NaN kept

static int compare_i64(const void* a, const void* b) {
    int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return (x > y) - (x < y);
}

// The call's rows grouped by block: rows order[start[g] .. start[g + 1]) are block g's. Consecutive
// rows of one block (a prefill chunk, one row per sequence at decode) form a group as they come;
// only where a block's rows are not adjacent are the rows sorted by (block, row). Returns the
// number of groups, or -1 (no memory).
static int64_t group_rows(const int64_t* blocks, int64_t n, int64_t* order, int64_t* start) {
    int64_t runs = 0;
    for (int64_t i = 0; i < n; i++) {
        order[i] = i;
        if (i == 0 || blocks[i] != blocks[i - 1]) start[runs++] = i;
    }
    start[runs] = n;
    int64_t* heads = malloc((size_t)runs * sizeof *heads);
    if (heads == NULL) return -1;
    for (int64_t r = 0; r < runs; r++) heads[r] = blocks[start[r]];
    qsort(heads, (size_t)runs, sizeof *heads, compare_i64);
    int repeated = 0;
    for (int64_t r = 1; r < runs; r++) repeated |= heads[r] == heads[r - 1];
    free(heads);
    if (!repeated) return runs;
    for (int64_t i = 0; i < n; i++) order[i] = blocks[i] * n + i;  // (block, row) as one sortable key
    qsort(order, (size_t)n, sizeof *order, compare_i64);
    int64_t groups = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t block = order[i] / n;
        order[i] %= n;
        if (i == 0 || block != blocks[order[i - 1]]) start[groups++] = i;
    }
    start[groups] = n;
    return groups;
}

// Requantizes the `bs` token rows of a (block, layer, k/v) run to new scales: code * (old / new) per head.
static void requantize_run(int8_t* restrict run, int64_t bs, int64_t kv_heads, int64_t dim,
                           const float* restrict ratio) {
    for (int64_t t = 0; t < bs; t++)
        for (int64_t h = 0; h < kv_heads; h++) {
            int8_t* restrict c = run + (t * kv_heads + h) * dim;
            float r = ratio[h];
            for (int64_t d = 0; d < dim; d++) c[d] = encode((float)c[d] * r);
        }
}

// One token row [KVH * D] of fp32 values into its codes, head h divided by scale[h].
static void encode_row(const float* restrict x, int8_t* restrict dst, const float* restrict scale, int64_t kv_heads,
                       int64_t dim) {
    for (int64_t h = 0; h < kv_heads; h++) {
        float s = scale[h];
        for (int64_t d = 0; d < dim; d++) dst[h * dim + d] = encode(x[h * dim + d] / s);
    }
}

static void load_row(const void* src, int bf16, float* restrict dst, int64_t n) {
    if (bf16) {
        const uint16_t* restrict x = src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_bits_to_f32(x[i]);
    } else {
        memcpy(dst, src, (size_t)n * sizeof(float));
    }
}

static float amax_of(const void* x, int bf16, int64_t n) { return bf16 ? amax_bf16(x, n) : amax_f32(x, n); }

// Whether the INT8 write takes heads of these shapes (its fixed buffers; a head's scale slot is its
// first 4 bytes): the one-call decode step asks before it runs.
int kv_write_int8_takes(int64_t kv_heads, int64_t dim) {
    return kv_heads <= MAX_HEADS && dim <= MAX_HEAD_DIM && dim % 4 == 0;
}

// What both entry points do; `bf16`: k and v hold bf16 bits, else fp32. Element sizes and strides of
// k, v in elements; of the cache in bytes.
static int kv_write_int8(int8_t* cache, const void* k, const void* v, int bf16, int64_t k_row_stride,
                         int64_t v_row_stride, const int64_t* slots, int64_t n, int64_t num_blocks, int64_t kv_heads,
                         int64_t dim, int64_t block_size, int64_t block_stride, int64_t layer_offset) {
    if (!kv_write_int8_takes(kv_heads, dim)) return 2;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_blocks * block_size) return 1;  // torch's path decides what it means
    int64_t row = kv_heads * dim, run_stride = (block_size + 1) * row, esize = bf16 ? 2 : 4;
    int64_t* scratch = malloc((size_t)(3 * n + 1) * sizeof *scratch);
    if (scratch == NULL) return 3;
    int64_t *blocks = scratch, *order = scratch + n, *start = scratch + 2 * n;
    for (int64_t i = 0; i < n; i++) blocks[i] = slots[i] / block_size;
    int64_t groups = group_rows(blocks, n, order, start);
    if (groups < 0) {
        free(scratch);
        return 3;
    }
    const char* src[2] = {k, v};
    int64_t src_stride[2] = {k_row_stride * esize, v_row_stride * esize};  // bytes
    static _Thread_local float values[MAX_HEADS * MAX_HEAD_DIM];
    for (int64_t g = 0; g < groups; g++) {
        int64_t first = start[g], last = start[g + 1];
        int8_t* base = cache + blocks[order[first]] * block_stride + layer_offset;  // the block's keys run
        int fresh = 0;  // the call starts the block (writes its offset 0): its stored scale is a stale one
        for (int64_t i = first; i < last; i++) fresh |= slots[order[i]] % block_size == 0;
        float old[2][MAX_HEADS], scale[2][MAX_HEADS], ratio[2][MAX_HEADS];
        int grown = 0;
        for (int kind = 0; kind < 2; kind++) {
            int8_t* scale_row = base + kind * run_stride + block_size * row;
            for (int64_t h = 0; h < kv_heads; h++) {
                float amax = 0.0f;  // over all of the call's rows in the block, before any is encoded
                for (int64_t i = first; i < last; i++)
                    amax = fmax_nonnegative(amax, amax_of(src[kind] + order[i] * src_stride[kind] + h * dim * esize,
                                                          bf16, dim));
                float o = 0.0f, need = amax / QMAX;
                if (!fresh) memcpy(&o, scale_row + h * dim, sizeof o);
                float sc = o > need ? o : need;
                sc = sc < TINY ? TINY : sc;
                grown |= sc > o && o > 0.0f;
                old[kind][h] = o;
                scale[kind][h] = sc;
            }
        }
        for (int kind = 0; kind < 2 && grown; kind++) {  // every head, as torch: an unchanged one has ratio 1
            for (int64_t h = 0; h < kv_heads; h++) ratio[kind][h] = old[kind][h] / scale[kind][h];
            requantize_run(base + kind * run_stride, block_size, kv_heads, dim, ratio[kind]);
        }
        for (int64_t i = first; i < last; i++) {
            int64_t r = order[i], offset = slots[r] % block_size;
            for (int kind = 0; kind < 2; kind++) {
                load_row(src[kind] + r * src_stride[kind], bf16, values, row);
                encode_row(values, base + kind * run_stride + offset * row, scale[kind], kv_heads, dim);
            }
        }
        for (int kind = 0; kind < 2; kind++)
            for (int64_t h = 0; h < kv_heads; h++)
                memcpy(base + kind * run_stride + block_size * row + h * dim, &scale[kind][h], sizeof(float));
    }
    free(scratch);
    return 0;
}

// Names: kv_write_int8_<input dtype>. 0 = written; otherwise nothing was written (1: a slot out of
// range, 2: more heads or a wider head than the fixed buffers, or a head dim not a multiple of 4,
// 3: no memory).
#define KV_WRITE_ARGS                                                                                          \
    int8_t *cache, const void *k, const void *v, int64_t k_row_stride, int64_t v_row_stride,                \
        const int64_t *slots, int64_t n, int64_t num_blocks, int64_t kv_heads, int64_t dim, int64_t block_size, \
        int64_t block_stride, int64_t layer_offset
#define KV_WRITE_CALL(BF16)                                                                                    \
    kv_write_int8(cache, k, v, BF16, k_row_stride, v_row_stride, slots, n, num_blocks, kv_heads, dim, block_size, \
                  block_stride, layer_offset)

int kv_write_int8_f32(KV_WRITE_ARGS) { return KV_WRITE_CALL(0); }
int kv_write_int8_bf16(KV_WRITE_ARGS) { return KV_WRITE_CALL(1); }
