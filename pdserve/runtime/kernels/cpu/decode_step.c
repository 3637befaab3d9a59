// A whole decode step of a Llama-family model with 4-bit weights and fp32 or bf16 activations, in one
// call (CPU; pdserve.runtime.kernels.cpu_decode_step): every layer's norms, projections, RoPE, KV
// write and paged attention, then the final norm. The CPU's counterpart of replaying a captured CUDA
// graph.
//
// Why: a one-stream SmolLM2 step is 30 layers x some 15 calls from Python, and on the CPUs we serve
// on each call costs 5-20 us of dispatch before its arithmetic; the step's matmuls read 119 MB in
// about 15 ms, and the calls around them cost nearly as much again. Here the same C functions that
// the eager step calls one by one (layer_ops.c, paged_attention.c, int4_matmul.c, other units of the
// same library: not inlined, so the same machine code) run in the eager step's order on the same
// values, so the two steps agree to the bit (tests/test_cpu_decode_step.py holds them to it). With
// more than one thread, each phase is split as the eager step splits it (projections by output
// rows, row operations and attention by sequences), a barrier between phases. The threads are the
// calling thread's OpenMP team, torch's own (threads.h): already running, no threads started a step.
//
// Shapes: B sequences, one token each; D hidden, H query heads, KVH kv heads, hd head dim, I the
// MLP's width. The cache is [num_blocks, layers, 2, block_size, KVH, hd] in the activations' dtype
// (fp32, or bf16 where DecodeStep.bf16), or, where DecodeStep.kv_int8, INT8 codes with a scale row a
// run ([..., block_size + 1, KVH, hd]: kv_write.c writes it, paged_attention*.c read it); contiguous.
#define _GNU_SOURCE  // syscall (the barrier's futex) and clock_gettime under -std=c11
#include "threads.h"
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The row operations and kernels, defined in the library's other units.
void add_rms_norm_f32(const float* x, int64_t x_stride, const float* residual, const float* weight, int64_t n,
                      int64_t d, float eps, float* out, float* summed);
int rope_f32(const float* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const int64_t* positions,
             const float* cos, const float* sin, int64_t max_positions, float* out);
void silu_mul_f32(const float* gate_up, int64_t stride, int64_t n, int64_t inter, float* out);
int kv_write_rows(char* cache, const char* k, int64_t k_stride, const char* v, int64_t v_stride, const int64_t* slots,
                  int64_t n, int64_t row_bytes, int64_t block_size, int64_t block_stride, int64_t k_offset,
                  int64_t num_slots);
int paged_attention_f32_f32_units(const float* q, float* out, float* scores, float scale, const float* cache,
                                  const int64_t* block_tables, const int64_t* context_lens, int64_t max_blocks,
                                  int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                                  int64_t block_stride, int64_t k_offset, int64_t v_offset, int64_t t_pad, int64_t u0,
                                  int64_t u1);
int int4_linear_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes, const float* scale,
                    const float* mins, const float* bias, int64_t n0, int64_t n1, float* y, int64_t y_stride);
int int4_linear_exact_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                          const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, float* y,
                          int64_t y_stride);
void add_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* residual, const uint16_t* weight,
                       int64_t n, int64_t d, float eps, uint16_t* out, uint16_t* summed);
int rope_bf16(const uint16_t* x, int64_t x_stride, int64_t n, int64_t heads, int64_t dim, const int64_t* positions,
              const float* cos, const float* sin, int64_t max_positions, uint16_t* out);
void silu_mul_bf16(const uint16_t* gate_up, int64_t stride, int64_t n, int64_t inter, uint16_t* out);
int paged_attention_bf16_bf16_units(const uint16_t* q, uint16_t* out, float* scores, float scale,
                                    const uint16_t* cache, const int64_t* block_tables, const int64_t* context_lens,
                                    int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim,
                                    int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,
                                    int64_t t_pad, int64_t u0, int64_t u1);
int paged_attention_bf16_i8_units(const uint16_t* q, uint16_t* out, float* scores, float scale,
                                  const int8_t* cache, const int64_t* block_tables, const int64_t* context_lens,
                                  int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t dim,
                                  int64_t block_size, int64_t block_stride, int64_t k_offset, int64_t v_offset,
                                  int64_t t_pad, int64_t u0, int64_t u1);
int paged_attention_f32_i8_units(const float* q, float* out, float* scores, float scale, const int8_t* cache,
                                 const int64_t* block_tables, const int64_t* context_lens, int64_t max_blocks,
                                 int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride,
                                 int64_t k_offset, int64_t v_offset, int64_t t_pad, int64_t u0, int64_t u1);
#define KV_WRITE_INT8_ARGS                                                                                   \
    int8_t *cache, const void *k, const void *v, int64_t k_row_stride, int64_t v_row_stride, const int64_t *slots, \
        int64_t n, int64_t num_blocks, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t block_stride, \
        int64_t layer_offset
int kv_write_int8_f32(KV_WRITE_INT8_ARGS);
int kv_write_int8_bf16(KV_WRITE_INT8_ARGS);
int kv_write_int8_takes(int64_t kv_heads, int64_t dim);
int int4_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                     const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, uint16_t* y,
                     int64_t y_stride);
int int4_amx_linear_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                         const uint16_t* scale_zero, const float* bias, int64_t n, int64_t n0, int64_t n1,
                         uint16_t* y, int64_t y_stride);
int int4_q8_gemm_part(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* codes,
                      const float* scale, const float* mins, const float* bias, int64_t n0, int64_t n1, uint16_t* y,
                      int64_t y_stride);

// One projection: w[n, k] = q[n, k] * scale[n, k / 32] + mins[n, k / 32] (+ bias[n]; NULL: none).
typedef struct {
    const uint8_t* codes;  // [out, in / 2]
    const float* scale;    // [out, in / 32]
    const float* mins;     // [out, in / 32]
    const float* bias;     // [out] or NULL
    int64_t out_features, in_features;
    int64_t exact;  // fp32 steps: 1 the inputs as they are (int4_linear_exact_f32), 0 quantized to int8
    const uint8_t* amx_codes;        // bf16 steps of DecodeStep.amx_from_rows rows or more: int4_amx.c's
    const uint16_t* amx_scale_zero;  // layout of the same codes and their [in / 32, out, 2] bf16 scales; or NULL
    const uint8_t* gemm_codes;  // bf16 steps of DecodeStep.q8_gemm_from_rows rows or more: int4_q8_gemm.c's
    const float* gemm_scale;    // layout of the same codes, scales and mins (cpu_int4_matmul.q8_gemm_panels);
    const float* gemm_mins;     // or NULL
} Int4Weights;

typedef struct {
    const void* input_norm;  // [D], in the step's activation dtype
    const void* post_norm;   // [D]
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
    void* cache;               // in the activation dtype
    int64_t cache_blocks, cache_layers, block_size;
    const int64_t* block_tables;  // [B, max_blocks]
    int64_t max_blocks;
    const int64_t* context_lens;  // [B], this token included
    const void* final_norm;       // [D]
    int64_t bf16;                 // activations, norms and cache: 1 bf16, 0 fp32
    int64_t amx_from_rows;        // bf16 steps of this many rows or more: projections on AMX (0: never)
    int64_t kv_int8;              // 1: the cache holds INT8 codes and a scale row a run, 0: the activations' dtype
    int64_t q8_gemm_from_rows;    // bf16 steps of this many rows or more: projections on the VNNI GEMM (0: never)
} DecodeStep;

// Rows of a (block, layer, k/v) run: the block's tokens, and an INT8 cache's scale row.
static int64_t run_rows(const DecodeStep* s) { return s->block_size + (s->kv_int8 ? 1 : 0); }

// The phases of a layer, each a chunk counter of the step's (Scratch.next: PHASES a layer, then the
// final norm's).
enum { INPUT_NORM, QKV, ROPE_KV, ATTENTION, O_PROJ, POST_NORM, GATE_UP, SILU, DOWN, PHASES };

// Scratch of one step, one allocation: activations in the step's dtype (es bytes each), fp32 scores,
// and each phase's chunk counter (take_items), zero: no chunk taken.
typedef struct {
    char *residual, *normed, *qkv, *q, *k, *attn, *o, *gate_up, *act, *down;
    float* scores;
    atomic_llong* next;  // [num_layers * PHASES + 1]
    int64_t es;
    atomic_int no_memory;  // an INT8 KV write (kv_write.c's 3) or a GEMM found no memory: the step fails
} Scratch;

#define AT(buf, i) ((buf) + (i) * b->es)  // element i of an activation buffer of Scratch b

static char* scratch_alloc(const DecodeStep* s, Scratch* b) {
    const int64_t B = s->batch, D = s->hidden, hd = s->head_dim, H = s->heads, KVH = s->kv_heads;
    const int64_t qkv = (H + 2 * KVH) * hd, t_pad = s->max_blocks * s->block_size;
    const int64_t es = s->bf16 ? 2 : 4;
    const int64_t counters = s->num_layers * PHASES + 1;
    const int64_t sizes[12] = {B * D * es, B * D * es, B * qkv * es, B * H * hd * es, B * KVH * hd * es,
                               B * H * hd * es, B * D * es, B * 2 * s->intermediate * es, B * s->intermediate * es,
                               B * D * es, B * H * t_pad * 4, counters * (int64_t)sizeof(atomic_llong)};
    int64_t total = 0;
    for (int i = 0; i < 12; i++) total += (sizes[i] + 63) / 64 * 64;  // each buffer 64-byte aligned
    char* base = aligned_alloc(64, (size_t)total);
    if (base == NULL) return NULL;
    char** slots[10] = {&b->residual, &b->normed, &b->qkv, &b->q, &b->k, &b->attn, &b->o,
                        &b->gate_up, &b->act, &b->down};
    char* p = base;
    for (int i = 0; i < 10; i++) {
        *slots[i] = p;
        p += (sizes[i] + 63) / 64 * 64;
    }
    b->scores = (float*)p;
    b->next = (atomic_llong*)(p + (sizes[10] + 63) / 64 * 64);
    for (int64_t i = 0; i < counters; i++) atomic_init(&b->next[i], 0);
    b->es = es;
    atomic_init(&b->no_memory, 0);
    return base;
}

// The step's operations in its dtype: the eager step's C functions (cpu_layer_ops, cpu_attention,
// cpu_int4_matmul), picked by s->bf16.
static void norm_rows(const DecodeStep* s, const char* x, const char* residual, const void* weight, int64_t n,
                      char* out, char* summed) {
    if (s->bf16)
        add_rms_norm_bf16((const uint16_t*)x, s->hidden, (const uint16_t*)residual, weight, n, s->hidden, s->eps,
                          (uint16_t*)out, (uint16_t*)summed);
    else
        add_rms_norm_f32((const float*)x, s->hidden, (const float*)residual, weight, n, s->hidden, s->eps,
                         (float*)out, (float*)summed);
}

static void rope_rows(const DecodeStep* s, const char* x, int64_t x_stride, int64_t n, int64_t heads,
                      const int64_t* positions, char* out) {
    if (s->bf16)
        rope_bf16((const uint16_t*)x, x_stride, n, heads, s->head_dim, positions, s->cos, s->sin, s->max_positions,
                  (uint16_t*)out);
    else
        rope_f32((const float*)x, x_stride, n, heads, s->head_dim, positions, s->cos, s->sin, s->max_positions,
                 (float*)out);
}

static void silu_rows(const DecodeStep* s, const char* gate_up, int64_t n, char* out) {
    const int64_t I = s->intermediate;
    if (s->bf16)
        silu_mul_bf16((const uint16_t*)gate_up, 2 * I, n, I, (uint16_t*)out);
    else
        silu_mul_f32((const float*)gate_up, 2 * I, n, I, (float*)out);
}

// A barrier of the step's threads: spun on (the others' part of a phase is microseconds away), then
// slept on (a futex). Why sleep and not sched_yield: when another process keeps a core busy (the
// prefill worker beside this one), a member waiting here must free its core for the member that was
// preempted; a yield only gives way on its own core's run queue, so every barrier then waited out a
// scheduler time slice (a one-sequence step of 7 ms took 115 ms on 2 threads beside one busy
// process). Spinning long enough that an unloaded step never sleeps (BARRIER_SPIN_NS, longer than a
// phase's imbalance: a sequence's attention beside the others' nothing) costs a loaded one that
// long per barrier, so once any member has slept the step spins only BARRIER_SPIN_LOADED_NS. The
// step tells its caller whether its members slept through more than LOADED_SLEEP_SHARE of it (a
// core taken by another process), so that it runs on one thread for a while. Why time asleep and
// not the count of waits that ended asleep (what this took before): one short preemption (the
// worker's own gRPC threads, the gateway) makes the next barriers sleep too, at their short spin,
// so at 32 sequences most waits of an unloaded step ended asleep while its members slept a few
// percent of it; the step was taken as loaded and the last 20 s of a 32-stream benchmark ran on one
// thread of two idle cores (SmolLM2 fp32, 2-core AVX2 EPYC). Sense by generation count; the last
// to arrive wakes the sleepers, if any.
typedef struct {
    atomic_int arrived, generation, sleepers, slept;
    atomic_llong slept_ns;  // summed over the members
    int size;
} SpinBarrier;

#define LOADED_SLEEP_SHARE 4  // loaded: members asleep over 1/4 of the step (of size - 1 members' time)

#define BARRIER_SPIN_NS 300000
#define BARRIER_SPIN_LOADED_NS 20000

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void barrier_wait(SpinBarrier* b) {
    if (b->size == 1) return;
    const int gen = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->size - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_seq_cst);
#ifdef __linux__
        if (atomic_load_explicit(&b->sleepers, memory_order_seq_cst))
            syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#endif
        return;
    }
    const int loaded = atomic_load_explicit(&b->slept, memory_order_relaxed) > 0;
    const int64_t until = now_ns() + (loaded ? BARRIER_SPIN_LOADED_NS : BARRIER_SPIN_NS);
    for (int spins = 1;; spins++) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return;
        if (spins % 256 == 0 && now_ns() > until) break;
    }
    atomic_fetch_add_explicit(&b->slept, 1, memory_order_relaxed);
#ifdef __linux__
    atomic_fetch_add_explicit(&b->sleepers, 1, memory_order_seq_cst);
    const int64_t asleep = now_ns();
    while (atomic_load_explicit(&b->generation, memory_order_seq_cst) == gen)  // returns at once if it moved
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
    atomic_fetch_sub_explicit(&b->sleepers, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&b->slept_ns, now_ns() - asleep, memory_order_relaxed);
#else
    while (atomic_load_explicit(&b->generation, memory_order_acquire) == gen) sched_yield();
#endif
}

typedef struct {
    const DecodeStep* s;
    const LayerWeights* layers;
    const void* embeddings;
    void* out;
    Scratch b;
    SpinBarrier barrier;
} Team;

// A member of the step's team: its id of `parts`, and whether the step's phases are taken in chunks.
typedef struct {
    int id, parts, fine;
} Member;

// Steps of FINE_FROM_ROWS sequences or more take their projections and attention in
// CHUNKS_PER_MEMBER chunks a member, their row operations in 2, each chunk taken by whichever member
// asks next. Why: with a fixed share a member, one that another process preempts (the worker's own
// gRPC thread, the gateway, the prefill worker: a decode worker's two threads share two cores with
// them) holds the other at the barrier, asleep, until it has run its share (through the stack at 32
// streams on a 2-core Xeon a single thread was runnable in 30 % of samples). Taken a chunk at a time,
// a late member's share shrinks to what it had started (8 streams: 5-10 % more tokens a second). Fewer
// sequences keep a fixed share a member: there a chunk's fixed costs (a call, the counter's cache
// line moving between cores) are much of its work (4 sequences: 13.0 ms a step in fixed shares,
// 13.7 in chunks). Each item is computed as on one thread, whoever computes it: the bits do not
// depend on the split.
#define CHUNKS_PER_MEMBER 4
#define FINE_FROM_ROWS 8

// The next items [lo, hi) of a phase's [0, total) for member `me` (bounds multiples of `align`): 1, or
// 0 when none are left. *next counts the phase's chunks taken (zero before the phase); *taken, the
// calls of this member's loop over the phase.
static int take_items(const Member* me, atomic_llong* next, int* taken, int64_t per_member, int64_t total,
                      int64_t align, int64_t* lo, int64_t* hi) {
    int64_t chunk, chunks;
    if (me->fine) {
        chunks = me->parts * per_member;
        chunk = atomic_fetch_add_explicit(next, 1, memory_order_relaxed);
        if (chunk >= chunks) return 0;
    } else {
        if ((*taken)++) return 0;
        chunks = me->parts;
        chunk = me->id;
    }
    *lo = part_start(total, chunk, chunks, align);
    *hi = part_start(total, chunk + 1, chunks, align);
    return 1;
}

// for each non-empty range [LO, HI) member ME takes of a phase (take_items).
#define FOR_ITEMS(ME, NEXT, PER_MEMBER, TOTAL, ALIGN, LO, HI)                                                  \
    for (int taken_ = 0; take_items(ME, NEXT, &taken_, PER_MEMBER, TOTAL, ALIGN, &(LO), &(HI));)             \
        if ((HI) > (LO))

// Layer l's attention for units [u0, u1) of the step's (sequence, kv head) pairs (paged_attention.c's
// units, as its threaded entry points split them): their K rows, then their V rows a block further.
static void attention_units(const DecodeStep* s, const Scratch* b, int64_t l, int64_t u0, int64_t u1) {
    const int64_t H = s->heads, KVH = s->kv_heads, hd = s->head_dim, row = KVH * hd, rows = run_rows(s);
    const int64_t block_stride = s->cache_layers * 2 * rows * row, t_pad = s->max_blocks * s->block_size;
    const int64_t k_offset = l * 2 * rows * row, v_offset = (l * 2 + 1) * rows * row;  // cache elements
#define ATTENTION_ARGS                                                                                         \
    s->block_tables, s->context_lens, s->max_blocks, H, KVH, hd, s->block_size, block_stride, k_offset, v_offset, \
        t_pad, u0, u1
    if (s->kv_int8 && s->bf16)
        paged_attention_bf16_i8_units((const uint16_t*)b->q, (uint16_t*)b->attn, b->scores, s->scale, s->cache,
                                      ATTENTION_ARGS);
    else if (s->kv_int8)
        paged_attention_f32_i8_units((const float*)b->q, (float*)b->attn, b->scores, s->scale, s->cache,
                                     ATTENTION_ARGS);
    else if (s->bf16)
        paged_attention_bf16_bf16_units((const uint16_t*)b->q, (uint16_t*)b->attn, b->scores, s->scale, s->cache,
                                        ATTENTION_ARGS);
    else
        paged_attention_f32_f32_units((const float*)b->q, (float*)b->attn, b->scores, s->scale, s->cache,
                                      ATTENTION_ARGS);
#undef ATTENTION_ARGS
}

// Rows' new keys (RoPE'd, in b->k) and values (in b->qkv) into layer l's slots: the eager step's
// writes (kv_write_rows for a cache in the activations' dtype, kv_write_int8_* for INT8 codes).
static void write_kv_rows(const DecodeStep* s, Scratch* b, int64_t l, int64_t r0, int64_t n) {
    const int64_t hd = s->head_dim, H = s->heads, KVH = s->kv_heads, row = KVH * hd, es = b->es;
    const int64_t width = (H + 2 * KVH) * hd, rows = run_rows(s), block_stride = s->cache_layers * 2 * rows * row;
    const char *k = AT(b->k, r0 * row), *v = AT(b->qkv, r0 * width + (H + KVH) * hd);
    if (!s->kv_int8) {  // slots checked before the step
        kv_write_rows((char*)s->cache, k, row * es, v, width * es, s->slots + r0, n, row * es, s->block_size,
                      block_stride * es, l * 2 * rows * row * es, s->cache_blocks * s->block_size);
        return;
    }
    int (*write)(KV_WRITE_INT8_ARGS) = s->bf16 ? kv_write_int8_bf16 : kv_write_int8_f32;
    if (write((int8_t*)s->cache, k, v, row, width, s->slots + r0, n, s->cache_blocks, KVH, hd, s->block_size,
              block_stride, l * 2 * rows * row))  // shapes and slots checked before: only no memory is left
        atomic_store(&b->no_memory, 1);
}

// Whether a projection of m rows runs on the AMX kernel, or on the VNNI GEMM (the eager step's kernels
// for the same row count, Int4Linear.__call__), else on the Q8 kernel.
static int runs_amx(const DecodeStep* s, const Int4Weights* w, int64_t m) {
    return s->bf16 && w->amx_codes != NULL && s->amx_from_rows > 0 && m >= s->amx_from_rows;
}

static int runs_q8_gemm(const DecodeStep* s, const Int4Weights* w, int64_t m) {
    return s->bf16 && w->gemm_codes != NULL && s->q8_gemm_from_rows > 0 && m >= s->q8_gemm_from_rows;
}

// Output rows [n0, n1) of a projection (aligned to the kernel's 2-row tiles, or the AMX kernel's
// 32-row panels, or the GEMM's pairs of 16-output panels). 0, or -1 where the GEMM had no memory.
static int linear_rows(const DecodeStep* s, const Int4Weights* w, const char* x, int64_t m, char* y, int64_t n0,
                       int64_t n1) {
    if (runs_q8_gemm(s, w, m))
        return int4_q8_gemm_part((const uint16_t*)x, m, w->in_features, w->in_features, w->gemm_codes,
                                 w->gemm_scale, w->gemm_mins, w->bias, n0, n1, (uint16_t*)y, w->out_features);
    if (runs_amx(s, w, m))
        int4_amx_linear_part((const uint16_t*)x, m, w->in_features, w->in_features, w->amx_codes, w->amx_scale_zero,
                             w->bias, w->out_features, n0, n1, (uint16_t*)y, w->out_features);
    else if (s->bf16)
        int4_linear_bf16((const uint16_t*)x, m, w->in_features, w->in_features, w->codes, w->scale, w->mins,
                         w->bias, n0, n1, (uint16_t*)y, w->out_features);
    else
        (w->exact ? int4_linear_exact_f32 : int4_linear_f32)((const float*)x, m, w->in_features, w->in_features,
                                                             w->codes, w->scale, w->mins, w->bias, n0, n1, (float*)y,
                                                             w->out_features);
    return 0;
}

// A projection's output rows, as member `me` takes them. The GEMM in one chunk a member: each call
// quantizes all of its m input rows (as each thread's part of the eager call does).
static void linear_items(const DecodeStep* s, const Int4Weights* w, const char* x, int64_t m, char* y,
                         const Member* me, atomic_llong* next, Scratch* b) {
    const int gemm = runs_q8_gemm(s, w, m);
    int64_t n0, n1;
    FOR_ITEMS(me, next, gemm ? 1 : CHUNKS_PER_MEMBER, w->out_features, gemm || runs_amx(s, w, m) ? 32 : 2, n0, n1)
        if (linear_rows(s, w, x, m, y, n0, n1)) atomic_store(&b->no_memory, 1);
}

// Layer l on member `me`: its input is the previous layer's MLP output b->down and the residual
// stream before it (layer 0: the embeddings, in b->residual); its own MLP output goes to b->down.
// Rows (row operations), (sequence, kv head) pairs (attention) and output features (projections)
// are split over the members (take_items; next: the layer's PHASES counters), a barrier after each
// phase; every value is computed as on one thread.
static void layer_step(const DecodeStep* s, const LayerWeights* w, int64_t l, Scratch* b, const Member* me,
                       atomic_llong* next, SpinBarrier* bar) {
    const int64_t B = s->batch, D = s->hidden, hd = s->head_dim, H = s->heads, KVH = s->kv_heads;
    const int64_t I = s->intermediate, width = (H + 2 * KVH) * hd, row = KVH * hd;
    int64_t r0, r1;
    FOR_ITEMS(me, next + INPUT_NORM, 2, B, 1, r0, r1) {
        if (l == 0)
            norm_rows(s, AT(b->residual, r0 * D), NULL, w->input_norm, r1 - r0, AT(b->normed, r0 * D), NULL);
        else
            norm_rows(s, AT(b->down, r0 * D), AT(b->residual, r0 * D), w->input_norm, r1 - r0, AT(b->normed, r0 * D),
                      AT(b->residual, r0 * D));
    }
    barrier_wait(bar);
    linear_items(s, &w->qkv, b->normed, B, b->qkv, me, next + QKV, b);
    barrier_wait(bar);
    FOR_ITEMS(me, next + ROPE_KV, 2, B, 1, r0, r1) {  // positions checked before the step: RoPE cannot fail
        const int64_t n = r1 - r0;
        rope_rows(s, AT(b->qkv, r0 * width), width, n, H, s->positions + r0, AT(b->q, r0 * H * hd));
        rope_rows(s, AT(b->qkv, r0 * width + H * hd), width, n, KVH, s->positions + r0, AT(b->k, r0 * row));
        write_kv_rows(s, b, l, r0, n);
    }
    barrier_wait(bar);
    FOR_ITEMS(me, next + ATTENTION, CHUNKS_PER_MEMBER, B * KVH, 1, r0, r1)  // shapes checked before the step
        attention_units(s, b, l, r0, r1);
    barrier_wait(bar);
    linear_items(s, &w->o, b->attn, B, b->o, me, next + O_PROJ, b);
    barrier_wait(bar);
    FOR_ITEMS(me, next + POST_NORM, 2, B, 1, r0, r1)
        norm_rows(s, AT(b->o, r0 * D), AT(b->residual, r0 * D), w->post_norm, r1 - r0, AT(b->normed, r0 * D),
                  AT(b->residual, r0 * D));
    barrier_wait(bar);
    linear_items(s, &w->gate_up, b->normed, B, b->gate_up, me, next + GATE_UP, b);
    barrier_wait(bar);
    FOR_ITEMS(me, next + SILU, 2, B, 1, r0, r1) silu_rows(s, AT(b->gate_up, r0 * 2 * I), r1 - r0, AT(b->act, r0 * I));
    barrier_wait(bar);
    linear_items(s, &w->down, b->act, B, b->down, me, next + DOWN, b);
    barrier_wait(bar);
}

static void run_member(Team* t, int id) {
    const DecodeStep* s = t->s;
    const Member me = {.id = id, .parts = t->barrier.size, .fine = t->barrier.size > 1 && s->batch >= FINE_FROM_ROWS};
    for (int64_t l = 0; l < s->num_layers; l++)
        layer_step(s, &t->layers[l], l, &t->b, &me, t->b.next + l * PHASES, &t->barrier);
    const Scratch* b = &t->b;
    int64_t r0, r1;
    FOR_ITEMS(&me, b->next + s->num_layers * PHASES, 2, s->batch, 1, r0, r1)
        norm_rows(s, AT(b->down, r0 * s->hidden), AT(b->residual, r0 * s->hidden), s->final_norm, r1 - r0,
                  AT((char*)t->out, r0 * s->hidden), AT(b->residual, r0 * s->hidden));
}

#define MAX_THREADS 64
#define ATTENTION_MAX_HEAD_DIM 256  // paged_attention.c's buffers
#define ATTENTION_MAX_HEADS 64

// embeddings [B, D] -> out [B, D]: the final norm of the last layer's output, on `threads` threads
// of the calling thread's OpenMP team (fewer where OpenMP gives fewer). Returns 0; 1 where the
// scratch cannot be had, 2 for a position past the RoPE tables, 3 for a shape the attention does not
// take, 4 for a KV slot past the cache (nothing written then); 1 too where an INT8 KV write or a GEMM
// found no memory (that layer's rows unwritten: the step's output is not to be used). `loaded`: 1 when its
// members slept at the barriers through more than 1 / LOADED_SLEEP_SHARE of it (another process had
// the cores), else 0.
int decode_step(const DecodeStep* s, const LayerWeights* layers, const void* embeddings, void* out, int64_t threads,
                int64_t* loaded) {
    for (int64_t r = 0; r < s->batch; r++)
        if (s->positions[r] < 0 || s->positions[r] >= s->max_positions) return 2;
    for (int64_t r = 0; r < s->batch; r++)  // (a padding slot, < 0, is skipped, but not by the INT8 write)
        if (s->slots[r] >= s->cache_blocks * s->block_size || (s->kv_int8 && s->slots[r] < 0)) return 4;
    if (s->head_dim > ATTENTION_MAX_HEAD_DIM || s->heads > ATTENTION_MAX_HEADS) return 3;
    if (s->kv_int8 && !kv_write_int8_takes(s->kv_heads, s->head_dim)) return 3;
    Team t = {.s = s, .layers = layers, .embeddings = embeddings, .out = out};
    char* base = scratch_alloc(s, &t.b);
    if (base == NULL) return 1;
    memcpy(t.b.residual, embeddings, (size_t)(s->batch * s->hidden * t.b.es));
    const int wanted = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : (int)threads;
    atomic_init(&t.barrier.arrived, 0);
    atomic_init(&t.barrier.generation, 0);
    atomic_init(&t.barrier.sleepers, 0);
    atomic_init(&t.barrier.slept, 0);
    atomic_init(&t.barrier.slept_ns, 0);
    t.barrier.size = 1;
    const int64_t start = now_ns();
#pragma omp parallel num_threads(wanted)
    {
#pragma omp single
        t.barrier.size = omp_get_num_threads();  // (the single's own barrier: every member sees it)
        run_member(&t, omp_get_thread_num());
    }
    const int64_t others_ns = (now_ns() - start) * (t.barrier.size - 1);  // the time of all but one member
    *loaded = LOADED_SLEEP_SHARE * (int64_t)atomic_load(&t.barrier.slept_ns) > others_ns && others_ns > 0;
    const int no_memory = atomic_load(&t.b.no_memory);
    free(base);
    return no_memory ? 1 : 0;
}
