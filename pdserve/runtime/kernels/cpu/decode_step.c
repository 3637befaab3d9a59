// A whole decode step of a Llama-family model with 4-bit weights and fp32 activations, in one call
// (CPU; pdserve.runtime.kernels.cpu_decode_step): every layer's norms, projections, RoPE, KV write
// and paged attention, then the final norm. The CPU's counterpart of replaying a captured CUDA graph.
//
// Why: a one-stream SmolLM2 step is 30 layers x some 15 calls from Python, and on the CPUs we serve
// on each call costs 5-20 us of dispatch before its arithmetic; the step's matmuls read 119 MB in
// about 15 ms, and the calls around them cost nearly as much again. Here the same C functions that
// the eager step calls one by one (layer_ops.c, paged_attention.c, int4_matmul.c, other units of the
// same library: not inlined, so the same machine code) run in the eager step's order on the same
// values, so the two steps agree to the bit (tests/test_cpu_decode_step.py holds them to it).
//
// Shapes: B sequences, one token each; D hidden, H query heads, KVH kv heads, hd head dim, I the
// MLP's width. The cache is [num_blocks, layers, 2, block_size, KVH, hd] fp32, contiguous.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// The row operations and kernels, defined in the library's other units.
void add_rms_norm_f32(const float* x, int64_t x_stride, const float* residual, const float* weight, int64_t n,
                      int64_t d, float eps, float* out, float* summed);
int rope_f32(const float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const int64_t* positions,
             const float* cos, const float* sin, int64_t max_positions, float* out);
void silu_mul_f32(const float* gate_up, int64_t stride, int64_t n, int64_t inter, float* out);
void kv_write_rows(char* cache, const char* k, int64_t k_stride, const char* v, int64_t v_stride, const int64_t* slots,
                   int64_t n, int64_t row_bytes, int64_t block_size, int64_t block_stride, int64_t k_offset);
int paged_attention_f32_f32(const float* q, float* out, float* scores, float scale, const float* cache,
                            const int64_t* block_tables, const int64_t* context_lens, int64_t batch,
                            int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                            int64_t block_stride, int64_t k_offset, int64_t v_offset, int64_t t_pad);
int int4_linear_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes, const float* scale,
                    const float* mins, const float* bias, int64_t n0, int64_t n1, float* y, int64_t y_stride);

// One projection: w[n, k] = q[n, k] * scale[n, k / 32] + mins[n, k / 32] (+ bias[n]; NULL: none).
typedef struct {
    const uint8_t* codes;  // [out, in / 2]
    const float* scale;    // [out, in / 32]
    const float* mins;     // [out, in / 32]
    const float* bias;     // [out] or NULL
    int64_t out_features, in_features;
} Int4Weights;

typedef struct {
    const float* input_norm;  // [D]
    const float* post_norm;   // [D]
    Int4Weights qkv, o, gate_up, down;
} LayerWeights;

typedef struct {
    int64_t batch, hidden, heads, kv_heads, head_dim, intermediate, num_layers;
    float eps, scale;
    const float* cos;  // [P, hd]
    const float* sin;
    int64_t max_positions;
    const int64_t* positions;  // [B]
    const int64_t* slots;      // [B]: block * block_size + offset of each token's KV
    float* cache;
    int64_t cache_layers, block_size;
    const int64_t* block_tables;  // [B, max_blocks]
    int64_t max_blocks;
    const int64_t* context_lens;  // [B], this token included
    const float* final_norm;      // [D]
} DecodeStep;

static void linear(const Int4Weights* w, const float* x, int64_t m, float* y) {
    int4_linear_f32(x, m, w->in_features, w->in_features, w->codes, w->scale, w->mins, w->bias, 0, w->out_features,
                    y, w->out_features);
}

// Scratch of one step, one allocation.
typedef struct {
    float *residual, *normed, *qkv, *q, *k, *attn, *o, *gate_up, *act, *down, *scores;
} Scratch;

static float* scratch_alloc(const DecodeStep* s, Scratch* b) {
    const int64_t B = s->batch, D = s->hidden, hd = s->head_dim, H = s->heads, KVH = s->kv_heads;
    const int64_t qkv = (H + 2 * KVH) * hd, t_pad = s->max_blocks * s->block_size;
    const int64_t sizes[11] = {B * D, B * D, B * qkv, B * H * hd, B * KVH * hd, B * H * hd, B * D,
                               B * 2 * s->intermediate, B * s->intermediate, B * D, B * H * t_pad};
    int64_t total = 0;
    for (int i = 0; i < 11; i++) total += (sizes[i] + 15) / 16 * 16;  // each buffer 64-byte aligned
    float* base = aligned_alloc(64, (size_t)total * sizeof(float));
    if (base == NULL) return NULL;
    float** slots[11] = {&b->residual, &b->normed, &b->qkv, &b->q, &b->k, &b->attn, &b->o,
                         &b->gate_up, &b->act, &b->down, &b->scores};
    float* p = base;
    for (int i = 0; i < 11; i++) {
        *slots[i] = p;
        p += (sizes[i] + 15) / 16 * 16;
    }
    return base;
}

// Layer l: its input is the previous layer's MLP output `b->down` and the residual stream before it
// (layer 0: the embeddings, in b->residual); its own MLP output goes to b->down.
static int layer_step(const DecodeStep* s, const LayerWeights* w, int64_t l, Scratch* b) {
    const int64_t B = s->batch, D = s->hidden, hd = s->head_dim, H = s->heads, KVH = s->kv_heads;
    const int64_t width = (H + 2 * KVH) * hd, row = KVH * hd;
    const int64_t block_stride = s->cache_layers * 2 * s->block_size * row;  // cache elements
    if (l == 0)
        add_rms_norm_f32(b->residual, D, NULL, w->input_norm, B, D, s->eps, b->normed, NULL);
    else
        add_rms_norm_f32(b->down, D, b->residual, w->input_norm, B, D, s->eps, b->normed, b->residual);
    linear(&w->qkv, b->normed, B, b->qkv);
    if (rope_f32(b->qkv, width, B, H, hd, s->positions, s->cos, s->sin, s->max_positions, b->q) ||
        rope_f32(b->qkv + H * hd, width, B, KVH, hd, s->positions, s->cos, s->sin, s->max_positions, b->k))
        return 2;
    kv_write_rows((char*)s->cache, (const char*)b->k, row * 4, (const char*)(b->qkv + (H + KVH) * hd), width * 4,
                  s->slots, B, row * 4, s->block_size, block_stride * 4, l * 2 * s->block_size * row * 4);
    if (paged_attention_f32_f32(b->q, b->attn, b->scores, s->scale, s->cache, s->block_tables, s->context_lens, B,
                                s->max_blocks, H, KVH, hd, s->block_size, block_stride,
                                l * 2 * s->block_size * row, (l * 2 + 1) * s->block_size * row,
                                s->max_blocks * s->block_size))
        return 3;
    linear(&w->o, b->attn, B, b->o);
    add_rms_norm_f32(b->o, D, b->residual, w->post_norm, B, D, s->eps, b->normed, b->residual);
    linear(&w->gate_up, b->normed, B, b->gate_up);
    silu_mul_f32(b->gate_up, 2 * s->intermediate, B, s->intermediate, b->act);
    linear(&w->down, b->act, B, b->down);
    return 0;
}

// embeddings [B, D] -> out [B, D]: the final norm of the last layer's output. Returns 0; 1 where the
// scratch cannot be had, 2 for a position past the RoPE tables, 3 for a shape the attention does
// not take (nothing written to out then; the cache may hold this step's first layers' KV).
int decode_step_f32(const DecodeStep* s, const LayerWeights* layers, const float* embeddings, float* out) {
    Scratch b;
    float* base = scratch_alloc(s, &b);
    if (base == NULL) return 1;
    memcpy(b.residual, embeddings, (size_t)(s->batch * s->hidden) * sizeof(float));
    int err = 0;
    for (int64_t l = 0; l < s->num_layers && !err; l++) err = layer_step(s, &layers[l], l, &b);
    if (!err)
        add_rms_norm_f32(b.down, s->hidden, b.residual, s->final_norm, s->batch, s->hidden, s->eps, out, b.residual);
    free(base);
    return err;
}
