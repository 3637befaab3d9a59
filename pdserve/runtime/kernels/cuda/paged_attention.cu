// Paged decode attention: one query token per sequence over its paged KV context, split-K.
//
// Shapes (elements; every tensor contiguous):
//   q            [B, H, D]                          H = KVH * G (grouped-query heads)
//   kv_cache     [NB, L, 2, BS, KVH, D]             0 = keys, 1 = values
//   block_tables [B, MB] int64                      padded rows; only the first ceil(ctx/BS) read
//   context_lens [B] int64                          tokens of context, including the new one
//   out          [B, H, D]
//
// Split-K: the context of a sequence is cut into partitions of P tokens. Thread block
// (partition p, kv head kvh, sequence b) handles tokens [p*P, min((p+1)*P, ctx)) for the G
// query heads that share kv head kvh, so every K/V row is read from memory exactly once.
// With one partition the block writes the normalised output directly; otherwise it writes
// its partial result (max logit m_p, sum of exp l_p, unnormalised sum of exp * V o_p) and
// `paged_decode_reduce_*` combines the partitions:
//   M = max_p m_p,  out = sum_p exp(m_p - M) o_p / sum_p exp(m_p - M) l_p.
// Partitions starting at or after ctx do nothing, so the host sizes the grid from the
// padded table width (no device->host sync).
//
// Numerics: q is converted to fp32 and pre-multiplied by `scale`; dot products, softmax
// (max-subtracted, __expf) and the P.V accumulation are fp32; the output is rounded once.
//
// Scaled caches (C = signed char for int8, fp8e4m3_t for fp8; entry points
// paged_decode_attention_<dtype>_<i8|fp8>_d<D>): each (block, layer, k/v) slab has BS + 1 rows,
// the last holding one fp32 scale per kv head at the start of that head's D-byte slot; a K or
// V row is widened to fp32 and multiplied by its block's scale as it is loaded. `block_size`
// is the number of token rows (BS); the strides come from the cache tensor (BS + 1 rows).
#include "common.cuh"

constexpr int DECODE_THREADS = 128;
constexpr int DECODE_WARPS = DECODE_THREADS / 32;

__host__ __device__ constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// How the D elements of one K/V row are spread over a group of TG lanes: each lane holds VEC
// consecutive elements. Prefer 16-byte loads (VEC = 16 / sizeof(T)) when that gives a
// power-of-two group of at most a warp; otherwise one full warp with D / 32 elements each.
template <typename T, int D>
struct RowSplit {
    static constexpr int VEC16 = 16 / static_cast<int>(sizeof(T));
    static constexpr bool WIDE = D % VEC16 == 0 && is_pow2(D / VEC16) && D / VEC16 <= 32;
    static constexpr int VEC = WIDE ? VEC16 : D / 32;
    static constexpr int TG = D / VEC;
    static_assert(D % 32 == 0, "head dim must be a multiple of 32");
    static_assert(is_pow2(TG) && TG <= 32, "row split must fit a warp");
};

// Floats of dynamic shared memory the decode kernel needs (the host mirrors this formula):
//   q_s [G*D] | logits [G*P] | red [THREADS*VEC] | stats [2*G]
// (see paged_decode_smem_floats in cuda_ops.py).

template <typename C> struct CacheScaled { static constexpr bool value = false; };
template <> struct CacheScaled<signed char> { static constexpr bool value = true; };
template <> struct CacheScaled<fp8e4m3_t> { static constexpr bool value = true; };

// Loads VEC elements of one K/V row and, for a scaled cache, applies the block's scale of this
// head, found in the slab's row `block_size` (head_base points at this head's row 0 of the layer).
template <typename C, int VEC>
__device__ __forceinline__ void load_row(const C* __restrict__ head_base, long long blk, long long block_stride,
                                         int off, int block_size, long long row_stride, int col,
                                         float (&out)[VEC]) {
    const C* slab = head_base + blk * block_stride;
    load_vec<C, VEC>(slab + off * row_stride + col, out);
    if constexpr (CacheScaled<C>::value) {
        const float s = *reinterpret_cast<const float*>(slab + block_size * row_stride);
#pragma unroll
        for (int j = 0; j < VEC; ++j) out[j] *= s;
    }
}

// Tokens whose K or V rows one thread group (phase 1) or thread (phase 3) loads before it uses
// any of them: a decode step is bound by memory latency, and one row at a time left most of
// the bandwidth idle (kernel_bench: about 300 GB/s of the H200's 4.8 TB/s at batch 32).
constexpr int DECODE_UNROLL = 4;

// acc[j] += p[t] * v_t[col + j] over tokens t = first, first + step, ... < end, in that order
// (the order of the one-row loop this replaces, so the sums are unchanged).
template <typename C, int VEC>
__device__ __forceinline__ void accumulate_values(float (&acc)[VEC], const C* __restrict__ v_head,
                                                  const long long* __restrict__ table, long long block_stride,
                                                  int block_size, long long row_stride, int col,
                                                  const float* __restrict__ p_row, int start, int first,
                                                  int end, int step) {
    constexpr int U = DECODE_UNROLL;
    int t = first;
    for (; t + (U - 1) * step < end; t += U * step) {
        float v[U][VEC];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int tu = t + u * step;
            load_row<C, VEC>(v_head, table[tu / block_size], block_stride, tu % block_size, block_size,
                             row_stride, col, v[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float p = p_row[t + u * step - start];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] = fmaf(p, v[u][j], acc[j]);
        }
    }
    for (; t < end; t += step) {
        float v[VEC];
        load_row<C, VEC>(v_head, table[t / block_size], block_stride, t % block_size, block_size,
                         row_stride, col, v);
        const float p = p_row[t - start];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = fmaf(p, v[j], acc[j]);
    }
}

template <typename T, typename C, int D>
__device__ __forceinline__ void paged_decode_partition(
    T* __restrict__ out,                    // [B, H, D]           (single-partition launch)
    float* __restrict__ part_out,           // [B, H, NP, D]       (multi-partition launch)
    float* __restrict__ part_max,           // [B, H, NP]
    float* __restrict__ part_sum,           // [B, H, NP]
    const T* __restrict__ q,                // [B, H, D]
    const C* __restrict__ cache,            // [NB, L, 2, BS (+ 1 if scaled), KVH, D]
    const long long* __restrict__ block_tables,  // [B, MB]
    const long long* __restrict__ context_lens,  // [B]
    long long layer_offset,                 // layer * (2 * BS * KVH * D)
    long long block_stride,                 // L * 2 * BS * KVH * D
    long long kv_stride,                    // BS * KVH * D: keys -> values
    int block_size, int max_blocks, int num_heads, int num_kv_heads,
    int partition_size, int num_partitions, float scale) {
    using S = RowSplit<C, D>;
    constexpr int VEC = S::VEC;
    constexpr int TG = S::TG;
    constexpr int NG = DECODE_THREADS / TG;  // thread groups: tokens handled at once

    const int part = blockIdx.x;
    const int kvh = blockIdx.y;
    const int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int G = num_heads / num_kv_heads;
    const int P = partition_size;
    const long long row_stride = static_cast<long long>(num_kv_heads) * D;  // one token's row

    const int ctx = static_cast<int>(context_lens[b]);
    const int start = part * P;
    const int head0 = kvh * G;  // first query head of this group
    if (ctx <= 0) {
        // Empty context: defined output (zeros) instead of garbage; the reduce kernel does
        // the same in the multi-partition case.
        if (num_partitions == 1 && part == 0) {
            for (int i = tid; i < G * D; i += DECODE_THREADS)
                out[(static_cast<long long>(b) * num_heads + head0) * D + i] = from_float<T>(0.0f);
        }
        return;
    }
    if (start >= ctx) return;  // whole block exits together: no barrier is skipped
    const int end = min(start + P, ctx);
    const int n = end - start;

    extern __shared__ float smem[];
    float* q_s = smem;                       // [G, D]   scaled query
    float* logits = q_s + G * D;             // [G, P]   scores, then exp(score - max)
    float* red = logits + G * P;             // [THREADS, VEC] partial P.V sums
    float* stats = red + DECODE_THREADS * VEC;  // [2, G]: max, sum of exp

    // ---- q of the G heads (contiguous G * D elements), scaled once ------------------------
    const T* q_b = q + (static_cast<long long>(b) * num_heads + head0) * D;
    for (int i = tid; i < G * D; i += DECODE_THREADS) q_s[i] = to_float(q_b[i]) * scale;
    __syncthreads();

    const long long* table = block_tables + static_cast<long long>(b) * max_blocks;
    const C* k_head = cache + layer_offset + static_cast<long long>(kvh) * D;  // keys of kvh
    const C* v_head = k_head + kv_stride;                                     // values of kvh

    // ---- phase 1: logits[g][t] = q_g . k_t for the partition's tokens ---------------------
    // Thread group `grp` (TG lanes) takes tokens t0 + u*NG + grp (u < DECODE_UNROLL) of each
    // round t0, loading their rows before reducing any; lane `lg` holds elements
    // [lg*VEC, (lg+1)*VEC) of a row. The loop bound is block-uniform so that all lanes of a
    // warp reach the shuffles together.
    {
        constexpr int U = DECODE_UNROLL;
        const int lg = tid % TG;
        const int grp = tid / TG;
        for (int t0 = start; t0 < end; t0 += U * NG) {
            float k[U][VEC];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = t0 + u * NG + grp;
                if (t < end) {
                    load_row<C, VEC>(k_head, table[t / block_size], block_stride, t % block_size, block_size,
                                     row_stride, lg * VEC, k[u]);
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) k[u][j] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int t = t0 + u * NG + grp;
                for (int g = 0; g < G; ++g) {
                    const float* qg = q_s + g * D + lg * VEC;
                    float dot = 0.0f;
#pragma unroll
                    for (int j = 0; j < VEC; ++j) dot = fmaf(qg[j], k[u][j], dot);
                    dot = group_sum<TG>(dot);
                    if (t < end && lg == 0) logits[g * P + (t - start)] = dot;
                }
            }
        }
    }
    __syncthreads();

    // ---- phase 2: softmax statistics of each head over the partition ---------------------
    {
        const int lane = tid & 31;
        const int warp = tid >> 5;
        for (int g = warp; g < G; g += DECODE_WARPS) {
            float* row = logits + g * P;
            float m = neg_inf();
            for (int i = lane; i < n; i += 32) m = fmaxf(m, row[i]);
            m = group_max<32>(m);
            float l = 0.0f;
            for (int i = lane; i < n; i += 32) {
                const float e = __expf(row[i] - m);
                row[i] = e;
                l += e;
            }
            l = group_sum<32>(l);
            if (lane == 0) {
                stats[g] = m;
                stats[G + g] = l;
            }
        }
    }
    __syncthreads();

    // ---- phase 3: o[g][:] = sum_t logits[g][t] * v_t ---------------------------------------
    // Work item w = (g, c) owns elements [c*VEC, (c+1)*VEC) of head g's output (NC = TG chunks
    // per row). With W = G*NC <= THREADS the spare threads split the tokens into NS slices
    // whose partial sums meet in `red`; with more work items than threads each thread loops
    // over several items and all tokens.
    const int NC = TG;
    const int W = G * NC;
    const long long out_row0 = static_cast<long long>(b) * num_heads + head0;  // (b, head0)
    auto emit = [&](int g, int d, float value) {
        // value: unnormalised sum of exp * V for element d of head g.
        if (num_partitions == 1) {
            out[(out_row0 + g) * D + d] = from_float<T>(value / stats[G + g]);
        } else {
            part_out[((out_row0 + g) * num_partitions + part) * D + d] = value;
        }
    };
    if (W <= DECODE_THREADS) {
        const int NS = DECODE_THREADS / W;
        const int slice = tid / W;
        const int w = tid % W;
        if (slice < NS) {
            const int g = w / NC;
            const int c = w % NC;
            float acc[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
            accumulate_values<C, VEC>(acc, v_head, table, block_stride, block_size, row_stride, c * VEC,
                                      logits + g * P, start, start + slice, end, NS);
#pragma unroll
            for (int j = 0; j < VEC; ++j) red[(slice * W + w) * VEC + j] = acc[j];
        }
        __syncthreads();
        // Element e = w*VEC + j = g*D + d (since NC*VEC = D).
        for (int e = tid; e < W * VEC; e += DECODE_THREADS) {
            float sum = 0.0f;
            for (int s = 0; s < NS; ++s) sum += red[s * W * VEC + e];
            emit(e / D, e % D, sum);
        }
    } else {
        for (int w = tid; w < W; w += DECODE_THREADS) {
            const int g = w / NC;
            const int c = w % NC;
            float acc[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] = 0.0f;
            accumulate_values<C, VEC>(acc, v_head, table, block_stride, block_size, row_stride, c * VEC,
                                      logits + g * P, start, start, end, 1);
#pragma unroll
            for (int j = 0; j < VEC; ++j) emit(g, c * VEC + j, acc[j]);
        }
    }
    if (num_partitions > 1) {
        for (int g = tid; g < G; g += DECODE_THREADS) {
            const long long idx = (out_row0 + g) * num_partitions + part;
            part_max[idx] = stats[g];
            part_sum[idx] = stats[G + g];
        }
    }
}

// Combines the partitions of one (sequence, query head): grid (H, B), any block size that is a
// multiple of 32; dynamic shared memory: NP floats (the partition weights).
template <typename T>
__device__ __forceinline__ void paged_decode_reduce(
    T* __restrict__ out,                    // [B, H, D]
    const float* __restrict__ part_out,     // [B, H, NP, D]
    const float* __restrict__ part_max,     // [B, H, NP]
    const float* __restrict__ part_sum,     // [B, H, NP]
    const long long* __restrict__ context_lens,  // [B]
    int num_heads, int head_dim, int partition_size, int num_partitions) {
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int tid = threadIdx.x;
    const long long row = static_cast<long long>(b) * num_heads + h;
    T* o = out + row * head_dim;
    const int ctx = static_cast<int>(context_lens[b]);
    if (ctx <= 0) {
        for (int d = tid; d < head_dim; d += blockDim.x) o[d] = from_float<T>(0.0f);
        return;
    }
    // Partitions that hold tokens (at most num_partitions by construction of the grid).
    const int used = min((ctx + partition_size - 1) / partition_size, num_partitions);
    const float* m = part_max + row * num_partitions;
    const float* l = part_sum + row * num_partitions;

    extern __shared__ float weights[];  // [NP]: exp(m_p - M)
    float M = neg_inf();
    for (int p = 0; p < used; ++p) M = fmaxf(M, m[p]);  // same addresses for all threads
    for (int p = tid; p < used; p += blockDim.x) weights[p] = __expf(m[p] - M);
    __syncthreads();
    float L = 0.0f;
    for (int p = 0; p < used; ++p) L = fmaf(weights[p], l[p], L);
    const float inv = 1.0f / L;
    const float* po = part_out + row * num_partitions * head_dim;
    for (int d = tid; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < used; ++p) acc = fmaf(weights[p], po[p * head_dim + d], acc);
        o[d] = from_float<T>(acc * inv);
    }
}

// ---- extern "C" entry points: paged_decode_attention_<dtype>_d<D>, paged_decode_reduce_<dtype>

// Indirection so that a macro passed as D (PDS_HEAD_DIM) is expanded before pasting.
#define PDS_DECODE_ENTRY(SUFFIX, T, D) PDS_DECODE_ENTRY_(SUFFIX, T, D)
#define PDS_DECODE_ENTRY_(SUFFIX, T, D)                                                          \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 4)                                \
        paged_decode_attention_##SUFFIX##_d##D(                                                 \
            T* out, float* part_out, float* part_max, float* part_sum, const T* q,              \
            const T* cache, const long long* block_tables, const long long* context_lens,       \
            long long layer_offset, long long block_stride, long long kv_stride,                \
            int block_size, int max_blocks, int num_heads, int num_kv_heads,                    \
            int partition_size, int num_partitions, float scale) {                              \
        paged_decode_partition<T, T, D>(out, part_out, part_max, part_sum, q, cache,            \
                                     block_tables, context_lens, layer_offset, block_stride,    \
                                     kv_stride, block_size, max_blocks, num_heads,              \
                                     num_kv_heads, partition_size, num_partitions, scale);      \
    }

// Head dims: PDS_HEAD_DIM alone when the host sets it (any multiple of 32: 96, 160, 256 ...),
// else the two common ones, 64 and 128 (CI's nvcc build).
#if defined(PDS_HEAD_DIM)
#define PDS_DECODE_DHOST(SUFFIX, T) PDS_DECODE_ENTRY(SUFFIX, T, PDS_HEAD_DIM)
PDS_FOR_EACH_DTYPE(PDS_DECODE_DHOST)
#else
#define PDS_DECODE_D64(SUFFIX, T) PDS_DECODE_ENTRY(SUFFIX, T, 64)
PDS_FOR_EACH_DTYPE(PDS_DECODE_D64)
#define PDS_DECODE_D128(SUFFIX, T) PDS_DECODE_ENTRY(SUFFIX, T, 128)
PDS_FOR_EACH_DTYPE(PDS_DECODE_D128)
#endif

// Scaled caches: paged_decode_attention_<dtype>_<i8|fp8>_d<D>, same arguments with a byte cache.
#define PDS_DECODE_SCALED_ENTRY(SUFFIX, T, CSUFFIX, C, D) PDS_DECODE_SCALED_ENTRY_(SUFFIX, T, CSUFFIX, C, D)
#define PDS_DECODE_SCALED_ENTRY_(SUFFIX, T, CSUFFIX, C, D)                                        \
    extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 4)                                \
        paged_decode_attention_##SUFFIX##_##CSUFFIX##_d##D(                                     \
            T* out, float* part_out, float* part_max, float* part_sum, const T* q,              \
            const C* cache, const long long* block_tables, const long long* context_lens,       \
            long long layer_offset, long long block_stride, long long kv_stride,                \
            int block_size, int max_blocks, int num_heads, int num_kv_heads,                    \
            int partition_size, int num_partitions, float scale) {                              \
        paged_decode_partition<T, C, D>(out, part_out, part_max, part_sum, q, cache,            \
                                        block_tables, context_lens, layer_offset, block_stride, \
                                        kv_stride, block_size, max_blocks, num_heads,           \
                                        num_kv_heads, partition_size, num_partitions, scale);   \
    }
#define PDS_DECODE_SCALED_BOTH(SUFFIX, T, D)                     \
    PDS_DECODE_SCALED_ENTRY(SUFFIX, T, i8, signed char, D)       \
    PDS_DECODE_SCALED_ENTRY(SUFFIX, T, fp8, fp8e4m3_t, D)

#if defined(PDS_HEAD_DIM)
#define PDS_DECODE_SCALED_DHOST(SUFFIX, T) PDS_DECODE_SCALED_BOTH(SUFFIX, T, PDS_HEAD_DIM)
PDS_FOR_EACH_DTYPE(PDS_DECODE_SCALED_DHOST)
#else
#define PDS_DECODE_SCALED_D64(SUFFIX, T) PDS_DECODE_SCALED_BOTH(SUFFIX, T, 64)
PDS_FOR_EACH_DTYPE(PDS_DECODE_SCALED_D64)
#define PDS_DECODE_SCALED_D128(SUFFIX, T) PDS_DECODE_SCALED_BOTH(SUFFIX, T, 128)
PDS_FOR_EACH_DTYPE(PDS_DECODE_SCALED_D128)
#endif

#define PDS_DECODE_REDUCE_ENTRY(SUFFIX, T)                                                      \
    extern "C" __global__ void paged_decode_reduce_##SUFFIX(                                    \
        T* out, const float* part_out, const float* part_max, const float* part_sum,            \
        const long long* context_lens, int num_heads, int head_dim, int partition_size,         \
        int num_partitions) {                                                                   \
        paged_decode_reduce<T>(out, part_out, part_max, part_sum, context_lens, num_heads,      \
                               head_dim, partition_size, num_partitions);                       \
    }

PDS_FOR_EACH_DTYPE(PDS_DECODE_REDUCE_ENTRY)
