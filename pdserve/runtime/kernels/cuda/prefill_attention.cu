// Prefill attention: causal attention of new tokens over their cached prefix plus themselves,
// flash-attention style (tiles of keys streamed through shared memory, online softmax).
//
// Shapes (elements; every tensor contiguous):
//   q            [N, H, D]                 new tokens of all sequences, packed (varlen) or one
//   kv_cache     [NB, L, 2, BS, KVH, D]    the new tokens' K/V are already written
//   cu_seqlens   [S + 1] int64             sequence s owns q rows [cu[s], cu[s+1])
//   context_lens [S] int64                 cached prefix + new tokens of each sequence
//   block_tables [S, MB] int64
//   out          [N, H, D]
// Query i of a sequence with n new tokens and context ctx sits at position ctx - n + i and
// attends to key positions 0 .. ctx - n + i.
//
// Geometry: one thread block of 128 threads per (tile of BM = 32 query rows, query head).
// Thread tid owns query row r = tid / 4 of the tile together with the three other lanes of
// its quad (q4 = tid % 4):
//   scores: columns c = q4 + 4 j (j < BN / 4) of each BN = 16-key tile;
//   output: float4 chunks d = 4 (q4 + 4 i) (i < D / 16) of the row, in registers.
// Row max / sum are combined across the quad with shuffles; the probabilities of a key are
// broadcast inside the quad with a shuffle for the P.V product.
// Shared memory (fp32, rows padded by 4 floats so that the quad's float4 reads of 4
// different key rows hit different banks): Q [BM][D+4] | K [BN][D+4] | V [BN][D+4].
//
// Numerics: Q K^T, the running max / sum and the output accumulate in fp32 (q scaled by
// `scale` on load, __expf on max-subtracted scores); the output is rounded once.
#include "common.cuh"

constexpr int PF_BM = 32;        // query rows per tile
constexpr int PF_BN = 16;        // keys per tile
constexpr int PF_THREADS = 128;  // 4 threads per query row
constexpr int PF_PAD = 4;        // floats of padding per shared-memory row

// Dynamic shared memory in floats: (BM + 2 BN) * (D + PAD); the host mirrors this formula
// (prefill_smem_bytes in cuda_ops.py).

template <typename T, int D>
__device__ __forceinline__ void prefill_tile(
    T* __restrict__ out,                   // [N, H, D]
    const T* __restrict__ q,               // [N, H, D]
    const T* __restrict__ cache,           // [NB, L, 2, BS, KVH, D]
    const long long* __restrict__ table,   // this sequence's block table
    long long layer_offset, long long block_stride, long long kv_stride,
    int q_start,  // packed row of the sequence's first new token
    int n,        // new tokens of the sequence
    int ctx,      // context length (prefix + new tokens)
    int tile,     // query tile of the sequence
    int head, int num_heads, int num_kv_heads, int block_size, float scale) {
    static_assert(D % 32 == 0, "head dim must be a multiple of 32");
    constexpr int LD = D + PF_PAD;          // shared-memory row stride (floats)
    constexpr int CHUNKS = D / 16;          // float4 output chunks per thread
    constexpr int COLS = PF_BN / 4;         // score columns per thread
    constexpr int ROW_VECS = D / 4;         // float4 chunks per row

    extern __shared__ float smem[];
    float* q_s = smem;                      // [BM][LD]
    float* k_s = q_s + PF_BM * LD;          // [BN][LD]
    float* v_s = k_s + PF_BN * LD;          // [BN][LD]

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int r = tid / 4;                  // query row of the tile
    const int q4 = tid % 4;                 // lane within the quad
    const int kvh = head / (num_heads / num_kv_heads);
    const long long row_stride = static_cast<long long>(num_kv_heads) * D;
    const long long q_row_stride = static_cast<long long>(num_heads) * D;

    const int row0 = tile * PF_BM;              // first query of the tile (sequence-relative)
    const int rows = min(PF_BM, n - row0);      // valid rows in the tile (>= 1)
    const int q_lo = ctx - n;                   // position of the sequence's first new token
    const int my_pos = q_lo + row0 + r;         // this row's position (rows >= `rows` unused)
    const int kv_end = min(q_lo + row0 + rows, ctx);  // keys [0, kv_end) are visible to some row

    // ---- Q tile, scaled, rows beyond the sequence zero-filled ------------------------------
    for (int idx = tid; idx < PF_BM * ROW_VECS; idx += PF_THREADS) {
        const int rr = idx / ROW_VECS;
        const int dc = idx % ROW_VECS;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (rr < rows) {
            load_vec<T, 4>(q + (q_start + row0 + rr) * q_row_stride + head * D + dc * 4, v);
#pragma unroll
            for (int j = 0; j < 4; ++j) v[j] *= scale;
        }
        *reinterpret_cast<float4*>(q_s + rr * LD + dc * 4) = make_float4(v[0], v[1], v[2], v[3]);
    }

    float acc[CHUNKS][4];
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    float m = neg_inf();  // running max of this row
    float l = 0.0f;       // running sum of exp(score - m)

    const T* k_head = cache + layer_offset + static_cast<long long>(kvh) * D;
    const T* v_head = k_head + kv_stride;

    for (int kv0 = 0; kv0 < kv_end; kv0 += PF_BN) {  // block-uniform loop
        __syncthreads();  // the previous K/V tile is consumed (and Q is stored, first time)
        // ---- K, V tile: key kv0 + c, zero beyond the context -------------------------------
        for (int idx = tid; idx < PF_BN * ROW_VECS; idx += PF_THREADS) {
            const int c = idx / ROW_VECS;
            const int dc = idx % ROW_VECS;
            const int pos = kv0 + c;
            float kv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float vv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (pos < ctx) {
                const long long blk = table[pos / block_size];
                const long long off = blk * block_stride + (pos % block_size) * row_stride + dc * 4;
                load_vec<T, 4>(k_head + off, kv);
                load_vec<T, 4>(v_head + off, vv);
            }
            *reinterpret_cast<float4*>(k_s + c * LD + dc * 4) = make_float4(kv[0], kv[1], kv[2], kv[3]);
            *reinterpret_cast<float4*>(v_s + c * LD + dc * 4) = make_float4(vv[0], vv[1], vv[2], vv[3]);
        }
        __syncthreads();

        // ---- scores of row r against keys c = q4 + 4 j --------------------------------------
        float s[COLS];
#pragma unroll
        for (int j = 0; j < COLS; ++j) s[j] = 0.0f;
        const float* qr = q_s + r * LD;
#pragma unroll 8
        for (int d = 0; d < D; d += 4) {
            const float4 qv = *reinterpret_cast<const float4*>(qr + d);
#pragma unroll
            for (int j = 0; j < COLS; ++j) {
                const float4 kv = *reinterpret_cast<const float4*>(k_s + (q4 + 4 * j) * LD + d);
                s[j] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, s[j]))));
            }
        }
        float tile_max = neg_inf();
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            const int pos = kv0 + q4 + 4 * j;
            if (pos > my_pos || pos >= ctx) s[j] = neg_inf();  // causal + context mask
            tile_max = fmaxf(tile_max, s[j]);
        }
        tile_max = group_max<4>(tile_max);

        // ---- online softmax update ----------------------------------------------------------
        const float m_new = fmaxf(m, tile_max);
        // A row that has seen only masked keys keeps m = -inf; use 0 as the reference so that
        // exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
        const float ref = m_new == neg_inf() ? 0.0f : m_new;
        const float corr = __expf(m - ref);
        float psum = 0.0f;
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
            s[j] = __expf(s[j] - ref);
            psum += s[j];
        }
        psum = group_sum<4>(psum);
        l = l * corr + psum;
        m = m_new;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] *= corr;

        // ---- acc += p . V: key c's probability lives in lane (quad base + c % 4), slot c / 4
#pragma unroll
        for (int c = 0; c < PF_BN; ++c) {
            const float p = __shfl_sync(0xffffffffu, s[c / 4], (lane & ~3) | (c % 4));
            const float* vr = v_s + c * LD;
#pragma unroll
            for (int i = 0; i < CHUNKS; ++i) {
                const float4 vv = *reinterpret_cast<const float4*>(vr + 4 * (q4 + 4 * i));
                acc[i][0] = fmaf(p, vv.x, acc[i][0]);
                acc[i][1] = fmaf(p, vv.y, acc[i][1]);
                acc[i][2] = fmaf(p, vv.z, acc[i][2]);
                acc[i][3] = fmaf(p, vv.w, acc[i][3]);
            }
        }
    }

    // ---- normalise and store the valid rows -------------------------------------------------
    if (r < rows) {
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* o = out + (q_start + row0 + r) * q_row_stride + head * D;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const float v[4] = {acc[i][0] * inv, acc[i][1] * inv, acc[i][2] * inv, acc[i][3] * inv};
            store_vec<T, 4>(o + 4 * (q4 + 4 * i), v);
        }
    }
}

// Exclusive prefix sum of the query tiles of each sequence: tile_offsets[s] = first global
// tile of sequence s, tile_offsets[S] = total. One block of PF_SCAN_THREADS threads.
constexpr int PF_SCAN_THREADS = 1024;

extern "C" __global__ void __launch_bounds__(PF_SCAN_THREADS)
    prefill_tile_offsets(const long long* __restrict__ cu_seqlens, int num_seqs,
                         int* __restrict__ tile_offsets) {
    __shared__ int buf[PF_SCAN_THREADS];
    __shared__ int carry;
    const int tid = threadIdx.x;
    if (tid == 0) {
        carry = 0;
        tile_offsets[0] = 0;
    }
    for (int base = 0; base < num_seqs; base += PF_SCAN_THREADS) {
        const int s = base + tid;
        const int n = s < num_seqs ? static_cast<int>(cu_seqlens[s + 1] - cu_seqlens[s]) : 0;
        buf[tid] = n > 0 ? (n + PF_BM - 1) / PF_BM : 0;
        __syncthreads();
        for (int off = 1; off < PF_SCAN_THREADS; off *= 2) {  // Hillis-Steele inclusive scan
            const int x = tid >= off ? buf[tid - off] : 0;
            __syncthreads();
            buf[tid] += x;
            __syncthreads();
        }
        if (s < num_seqs) tile_offsets[s + 1] = carry + buf[tid];
        __syncthreads();  // everyone has read `carry`
        if (tid == PF_SCAN_THREADS - 1) carry += buf[tid];
        __syncthreads();
    }
}

// ---- extern "C" entry points ---------------------------------------------------------------
// prefill_attention_<dtype>_d<D>: one sequence; grid (ceil(n / BM), H).
// prefill_attention_varlen_<dtype>_d<D>: packed sequences; grid (tile_offsets upper bound, H):
//   block x finds its sequence by binary search over tile_offsets; blocks past the total exit.

// Indirection so that a macro passed as D (PDS_HEAD_DIM) is expanded before pasting.
#define PDS_PREFILL_ENTRY(SUFFIX, T, D) PDS_PREFILL_ENTRY_(SUFFIX, T, D)
#define PDS_PREFILL_ENTRY_(SUFFIX, T, D)                                                         \
    extern "C" __global__ void __launch_bounds__(PF_THREADS, 2) prefill_attention_##SUFFIX##_d##D( \
        T* out, const T* q, const T* cache, const long long* block_table,                       \
        long long layer_offset, long long block_stride, long long kv_stride, int n, int ctx,    \
        int num_heads, int num_kv_heads, int block_size, float scale) {                         \
        prefill_tile<T, D>(out, q, cache, block_table, layer_offset, block_stride, kv_stride,   \
                           0, n, ctx, blockIdx.x, blockIdx.y, num_heads, num_kv_heads,          \
                           block_size, scale);                                                  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(PF_THREADS, 2)                                 \
        prefill_attention_varlen_##SUFFIX##_d##D(                                               \
            T* out, const T* q, const T* cache, const long long* cu_seqlens,                    \
            const long long* context_lens, const long long* block_tables,                       \
            const int* tile_offsets, int num_seqs, int max_blocks, long long layer_offset,      \
            long long block_stride, long long kv_stride, int num_heads, int num_kv_heads,       \
            int block_size, float scale) {                                                      \
        const int tile = blockIdx.x;                                                            \
        if (tile >= tile_offsets[num_seqs]) return;                                             \
        int lo = 0, hi = num_seqs - 1; /* last s with tile_offsets[s] <= tile */                \
        while (lo < hi) {                                                                       \
            const int mid = (lo + hi + 1) / 2;                                                  \
            if (tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;                         \
        }                                                                                       \
        const int q_start = static_cast<int>(cu_seqlens[lo]);                                   \
        const int n = static_cast<int>(cu_seqlens[lo + 1]) - q_start;                           \
        prefill_tile<T, D>(out, q, cache, block_tables + static_cast<long long>(lo) * max_blocks, \
                           layer_offset, block_stride, kv_stride, q_start, n,                   \
                           static_cast<int>(context_lens[lo]), tile - tile_offsets[lo],         \
                           blockIdx.y, num_heads, num_kv_heads, block_size, scale);             \
    }

// Head dims: PDS_HEAD_DIM alone when the host sets it (any multiple of 32: 96, 160, 256 ...),
// else the two common ones, 64 and 128 (CI's nvcc build).
#if defined(PDS_HEAD_DIM)
#define PDS_PREFILL_DHOST(SUFFIX, T) PDS_PREFILL_ENTRY(SUFFIX, T, PDS_HEAD_DIM)
PDS_FOR_EACH_DTYPE(PDS_PREFILL_DHOST)
#else
#define PDS_PREFILL_D64(SUFFIX, T) PDS_PREFILL_ENTRY(SUFFIX, T, 64)
PDS_FOR_EACH_DTYPE(PDS_PREFILL_D64)
#define PDS_PREFILL_D128(SUFFIX, T) PDS_PREFILL_ENTRY(SUFFIX, T, 128)
PDS_FOR_EACH_DTYPE(PDS_PREFILL_D128)
#endif

