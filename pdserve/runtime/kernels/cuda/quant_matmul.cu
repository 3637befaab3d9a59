// Mixed-precision matmul for decode: y = x . dequant(W)^T with W in the GPTQ layout (W8A16, W4A16).
//
// Shapes (elements; P = 32 / BITS codes per int32 word):
//   x        [N, K]       T (f32 / f16 / bf16), rows x_stride apart, N <= ROWS (1, 2, 4 or 8)
//   qweight  [ceil(K / P), O] int32: word r of column o holds code[r*P + j, o] at bits j*BITS..
//   scales   [G, O] fp32, zeros [G, O] fp32 (zero points, offset already applied)
//   g_idx    [K] int32: group of each input channel (any order: act-order works too)
//   partial  [KSPLIT, N, O] fp32: this split's share of y; the host sums the splits
//
// w[k, o] = (code[k, o] - zeros[g_idx[k], o]) * scales[g_idx[k], o]; products and sums in fp32.
//
// Thread o of block (bx, split) owns output column bx*THREADS + o for all N rows over the input
// channels of its split: consecutive threads read consecutive qweight words (coalesced), and one
// int32 load gives P codes. x and g_idx of a K tile are staged in shared memory and read by
// every thread at the same address (broadcast). The scale and zero of a column are reloaded only
// when the group changes, i.e. once per group for contiguous groups. The last word may be padded
// (K not a multiple of P): its spare codes meet x = 0 in the staged tile and add nothing.
// Larger N (prefill) is not this kernel's job: the host dequantizes once and uses a GEMM.
#include "common.cuh"

constexpr int QMM_THREADS = 128;  // output columns per thread block
constexpr int QMM_KTILE = 256;    // input channels staged per step (a multiple of 8 and of 4)

template <typename T, int BITS, int ROWS>
__device__ __forceinline__ void quant_matmul(
    float* __restrict__ partial, const T* __restrict__ x, const int* __restrict__ qweight,
    const float* __restrict__ scales, const float* __restrict__ zeros, const int* __restrict__ g_idx,
    long long x_stride, int n, int k_dim, int o_dim, int k_per_split) {
    constexpr int P = 32 / BITS;
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    static_assert(QMM_KTILE % P == 0, "a K tile must hold whole words");
    __shared__ float xs[ROWS][QMM_KTILE];
    __shared__ int gs[QMM_KTILE];

    const int o = blockIdx.x * QMM_THREADS + threadIdx.x;
    const int k_begin = blockIdx.y * k_per_split;  // a multiple of QMM_KTILE (host)
    const int k_end = min(k_begin + k_per_split, k_dim);
    const bool active = o < o_dim;

    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
    int cur_g = -1;
    float s = 0.0f, z = 0.0f;

    for (int k0 = k_begin; k0 < k_end; k0 += QMM_KTILE) {
        const int len = min(QMM_KTILE, k_end - k0);
        __syncthreads();  // the previous tile is no longer read
        for (int i = threadIdx.x; i < QMM_KTILE; i += QMM_THREADS) {
            const bool in = i < len;
            gs[i] = in ? g_idx[k0 + i] : 0;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
                xs[r][i] = (in && r < n) ? to_float(x[r * x_stride + k0 + i]) : 0.0f;
        }
        __syncthreads();
        if (!active) continue;
        const int words = (len + P - 1) / P;
        const int* col = qweight + static_cast<long long>(k0 / P) * o_dim + o;
        for (int w = 0; w < words; ++w) {
            const unsigned int word = static_cast<unsigned int>(col[static_cast<long long>(w) * o_dim]);
#pragma unroll
            for (int j = 0; j < P; ++j) {
                const int i = w * P + j;
                const int g = gs[i];
                if (g != cur_g) {
                    cur_g = g;
                    s = scales[static_cast<long long>(g) * o_dim + o];
                    z = zeros[static_cast<long long>(g) * o_dim + o];
                }
                const float wv = (static_cast<float>((word >> (BITS * j)) & MASK) - z) * s;
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(xs[r][i], wv, acc[r]);
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        if (r < n) partial[(static_cast<long long>(blockIdx.y) * n + r) * o_dim + o] = acc[r];
}

// ---- extern "C" entry points: quant_matmul_<dtype>_w<BITS>_r<ROWS> -----------------------------

#define PDS_QMM_ENTRY(SUFFIX, T, BITS, ROWS)                                                       \
    extern "C" __global__ void __launch_bounds__(QMM_THREADS)                                     \
        quant_matmul_##SUFFIX##_w##BITS##_r##ROWS(                                                 \
            float* partial, const T* x, const int* qweight, const float* scales,                  \
            const float* zeros, const int* g_idx, long long x_stride, int n, int k_dim,           \
            int o_dim, int k_per_split) {                                                          \
        quant_matmul<T, BITS, ROWS>(partial, x, qweight, scales, zeros, g_idx, x_stride, n,       \
                                    k_dim, o_dim, k_per_split);                                    \
    }

#define PDS_QMM_ROWS(SUFFIX, T, BITS)   \
    PDS_QMM_ENTRY(SUFFIX, T, BITS, 1)   \
    PDS_QMM_ENTRY(SUFFIX, T, BITS, 2)   \
    PDS_QMM_ENTRY(SUFFIX, T, BITS, 4)   \
    PDS_QMM_ENTRY(SUFFIX, T, BITS, 8)

#define PDS_QMM_ALL(SUFFIX, T) \
    PDS_QMM_ROWS(SUFFIX, T, 4) \
    PDS_QMM_ROWS(SUFFIX, T, 8)

PDS_FOR_EACH_DTYPE(PDS_QMM_ALL)
