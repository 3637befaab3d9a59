// Elementwise / row kernels of the layer: RMSNorm, fused residual add + RMSNorm, RoPE,
// SiLU-and-mul. All math is fp32; each op rounds where the torch reference rounds, so that the
// 16-bit results match it to within one rounding.
//
// Row tensors are [N, hidden] with a row stride (elements) and contiguous rows; outputs are
// contiguous.
#include "common.cuh"

// out = w * T(x * rsqrt(mean(x^2) + eps)), one block per row (grid.x = N).
template <typename T>
__device__ __forceinline__ void rms_norm_row(
    T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
    long long x_row_stride, int hidden, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * x_row_stride;
    T* o = out + row * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = to_float(xr[i]);
        ss = fmaf(v, v, ss);
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float normed = to_float(from_float<T>(to_float(xr[i]) * rstd));  // .to(x.dtype)
        o[i] = from_float<T>(to_float(weight[i]) * normed);
    }
}

// summed = T(x + residual) -> residual_out; out = rms_norm(summed). One block per row.
template <typename T>
__device__ __forceinline__ void add_rms_norm_row(
    T* __restrict__ out, T* __restrict__ residual_out, const T* __restrict__ x,
    const T* __restrict__ residual, const T* __restrict__ weight, long long x_row_stride,
    long long r_row_stride, int hidden, float eps) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * x_row_stride;
    const T* rr = residual + row * r_row_stride;
    T* so = residual_out + row * hidden;
    T* o = out + row * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const T summed = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
        so[i] = summed;  // read back below by this same thread
        const float v = to_float(summed);
        ss = fmaf(v, v, ss);
    }
    const float rstd = rsqrtf(block_sum(ss, scratch) / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float normed = to_float(from_float<T>(to_float(so[i]) * rstd));
        o[i] = from_float<T>(to_float(weight[i]) * normed);
    }
}

// Rotate-half RoPE on q [N, H, D] and k [N, KVH, D] (rows strided, heads contiguous) into
// contiguous q_out, k_out. cos, sin: fp32 [P, D]; positions: int64 [N]. One block per token;
// thread i handles the pair (i, i + D/2) of one head:
//   out[i]       = x[i] c[i] - x[i + D/2] s[i]
//   out[i + D/2] = x[i + D/2] c[i + D/2] + x[i] s[i + D/2]
// c and s are rounded to T first, as the reference casts the tables to q's dtype.
template <typename T>
__device__ __forceinline__ void rope_token(
    T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ q,
    const T* __restrict__ k, const long long* __restrict__ positions,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    long long q_row_stride, long long k_row_stride, int num_heads, int num_kv_heads,
    int head_dim) {
    const long long token = blockIdx.x;
    const int half = head_dim / 2;
    const long long pos = positions[token];
    const float* cr = cos_table + pos * head_dim;
    const float* sr = sin_table + pos * head_dim;
    const int pairs = (num_heads + num_kv_heads) * half;
    for (int idx = threadIdx.x; idx < pairs; idx += blockDim.x) {
        const int head = idx / half;
        const int i = idx % half;
        const T* src;
        T* dst;
        if (head < num_heads) {
            src = q + token * q_row_stride + head * head_dim;
            dst = q_out + (token * num_heads + head) * head_dim;
        } else {
            const int kh = head - num_heads;
            src = k + token * k_row_stride + kh * head_dim;
            dst = k_out + (token * num_kv_heads + kh) * head_dim;
        }
        const float x0 = to_float(src[i]);
        const float x1 = to_float(src[i + half]);
        const float c0 = to_float(from_float<T>(cr[i]));
        const float c1 = to_float(from_float<T>(cr[i + half]));
        const float s0 = to_float(from_float<T>(sr[i]));
        const float s1 = to_float(from_float<T>(sr[i + half]));
        dst[i] = from_float<T>(x0 * c0 - x1 * s0);
        dst[i + half] = from_float<T>(x1 * c1 + x0 * s1);
    }
}

// out[n, i] = T(T(silu(gate)) * up) with gate_up [N, 2I] (gate first); grid (N, ceil(I / 256)).
template <typename T>
__device__ __forceinline__ void silu_and_mul_row(
    T* __restrict__ out, const T* __restrict__ gate_up, long long row_stride, int inter) {
    const long long row = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const T* gr = gate_up + row * row_stride;
    const float g = to_float(gr[i]);
    const float u = to_float(gr[inter + i]);
    const float act = to_float(from_float<T>(g / (1.0f + expf(-g))));  // F.silu rounds
    out[row * inter + i] = from_float<T>(act * u);
}

#define PDS_NORM_ENTRIES(SUFFIX, T)                                                             \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_##SUFFIX(                       \
        T* out, const T* x, const T* weight, long long x_row_stride, int hidden, float eps) {   \
        rms_norm_row<T>(out, x, weight, x_row_stride, hidden, eps);                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_##SUFFIX(                   \
        T* out, T* residual_out, const T* x, const T* residual, const T* weight,                \
        long long x_row_stride, long long r_row_stride, int hidden, float eps) {                \
        add_rms_norm_row<T>(out, residual_out, x, residual, weight, x_row_stride, r_row_stride, \
                            hidden, eps);                                                       \
    }                                                                                           \
    extern "C" __global__ void rope_##SUFFIX(                                                   \
        T* q_out, T* k_out, const T* q, const T* k, const long long* positions,                 \
        const float* cos_table, const float* sin_table, long long q_row_stride,                 \
        long long k_row_stride, int num_heads, int num_kv_heads, int head_dim) {                \
        rope_token<T>(q_out, k_out, q, k, positions, cos_table, sin_table, q_row_stride,        \
                      k_row_stride, num_heads, num_kv_heads, head_dim);                         \
    }                                                                                           \
    extern "C" __global__ void silu_and_mul_##SUFFIX(T* out, const T* gate_up,                  \
                                                     long long row_stride, int inter) {         \
        silu_and_mul_row<T>(out, gate_up, row_stride, inter);                                   \
    }

PDS_FOR_EACH_DTYPE(PDS_NORM_ENTRIES)
