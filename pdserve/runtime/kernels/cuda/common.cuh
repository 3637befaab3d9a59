// Shared device helpers of the pdserve CUDA kernels.
//
// Deliberately header-free (no cuda_fp16.h / cuda_bf16.h): the same text compiles with nvcc
// (CI) and with NVRTC through cupy.RawModule (runtime) without any include path for the CUDA
// toolkit. 16-bit values travel as their raw bits (`half_t`, `bf16_t`); arithmetic is always
// done in fp32 after `to_float` and rounded back once with `from_float` (round to nearest
// even, like torch).
#pragma once

typedef unsigned short u16;

// Raw-bit carriers of the 16-bit dtypes: distinct types so that templates dispatch on them.
struct half_t { u16 bits; };
struct bf16_t { u16 bits; };

// -inf without <math.h> (NVRTC has no INFINITY macro without headers).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ---- conversions ---------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }

__device__ __forceinline__ float to_float(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

__device__ __forceinline__ float to_float(bf16_t x) {
    // bf16 is the upper half of an fp32: widening is exact.
    return __uint_as_float(static_cast<unsigned int>(x.bits) << 16);
}

// KV cache codes of the scaled formats (value = code * per-block, per-head scale): int8 is a
// plain signed char; fp8 e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits, no inf)
// travels as its raw byte and is widened exactly by bit manipulation (no sm_89 cvt needed).
struct fp8e4m3_t { unsigned char bits; };

__device__ __forceinline__ float to_float(signed char x) { return static_cast<float>(x); }

__device__ __forceinline__ float to_float(fp8e4m3_t x) {
    const unsigned int u = x.bits;
    const unsigned int e = (u >> 3) & 0xfu;
    const unsigned int m = u & 7u;
    const float mag = e ? __uint_as_float(((e + 120u) << 23) | (m << 20))
                        : static_cast<float>(m) * 0.001953125f;  // subnormal: m * 2^-9
    return (u & 0x80u) ? -mag : mag;
}

template <typename T> __device__ __forceinline__ T from_float(float f);

template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }

template <> __device__ __forceinline__ half_t from_float<half_t>(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}

template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
    // Round to nearest even on the dropped 16 bits; NaN stays a (quiet) NaN.
    unsigned int u = __float_as_uint(f);
    bf16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.bits = static_cast<u16>((u >> 16) | 0x0040u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        b.bits = static_cast<u16>(u >> 16);
    }
    return b;
}

// ---- vector loads --------------------------------------------------------------------------

// Loads N consecutive elements of T starting at p into fp32 registers, using the widest
// aligned access that N * sizeof(T) allows (16, 8, 4 bytes, else element by element).
// Callers guarantee that p is aligned to that width (checked on the host: base pointers are
// 16-byte aligned and every row stride keeps the alignment).
template <typename T, int N>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[N]) {
    constexpr int BYTES = N * static_cast<int>(sizeof(T));
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / sizeof(T);
#pragma unroll
        for (int i = 0; i < N / PER; ++i) {
            uint4 raw = reinterpret_cast<const uint4*>(p)[i];
            const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int j = 0; j < PER; ++j) out[i * PER + j] = to_float(v[j]);
        }
    } else if constexpr (BYTES % 8 == 0) {
        constexpr int PER = 8 / sizeof(T);
#pragma unroll
        for (int i = 0; i < N / PER; ++i) {
            uint2 raw = reinterpret_cast<const uint2*>(p)[i];
            const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int j = 0; j < PER; ++j) out[i * PER + j] = to_float(v[j]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) out[j] = to_float(p[j]);
    }
}

// Stores N fp32 values as T at p (same alignment contract as load_vec).
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[N]) {
    constexpr int BYTES = N * static_cast<int>(sizeof(T));
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / sizeof(T);
#pragma unroll
        for (int i = 0; i < N / PER; ++i) {
            uint4 raw;
            T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (int j = 0; j < PER; ++j) v[j] = from_float<T>(in[i * PER + j]);
            reinterpret_cast<uint4*>(p)[i] = raw;
        }
    } else if constexpr (BYTES % 8 == 0) {
        constexpr int PER = 8 / sizeof(T);
#pragma unroll
        for (int i = 0; i < N / PER; ++i) {
            uint2 raw;
            T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (int j = 0; j < PER; ++j) v[j] = from_float<T>(in[i * PER + j]);
            reinterpret_cast<uint2*>(p)[i] = raw;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) p[j] = from_float<T>(in[j]);
    }
}

// ---- reductions ----------------------------------------------------------------------------

// Sum / max over aligned groups of WIDTH lanes (WIDTH a power of two <= 32); every lane of
// the group gets the result.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off, WIDTH);
    return x;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int off = WIDTH / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off, WIDTH));
    return x;
}

// Sum over the whole thread block (blockDim.x a multiple of 32, <= 1024). `scratch` holds
// 32 floats of shared memory; the result is returned to every thread.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = blockDim.x >> 5;
    x = group_sum<32>(x);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < num_warps ? scratch[lane] : 0.0f;
    return group_sum<32>(x);
}

// Instantiation filters. CI compiles every entry point for head dims 64 and 128; at run
// time the host compiles one module per (file, dtype, head dim) with -DPDS_ONLY_<DTYPE> and
// -DPDS_HEAD_DIM=<D> (any multiple of 32), so that NVRTC only builds what a model uses.
#if defined(PDS_ONLY_F32)
#define PDS_FOR_EACH_DTYPE(MACRO) MACRO(f32, float)
#elif defined(PDS_ONLY_F16)
#define PDS_FOR_EACH_DTYPE(MACRO) MACRO(f16, half_t)
#elif defined(PDS_ONLY_BF16)
#define PDS_FOR_EACH_DTYPE(MACRO) MACRO(bf16, bf16_t)
#else
// Instantiates `MACRO(name_suffix, T)` for the three supported dtypes.
#define PDS_FOR_EACH_DTYPE(MACRO) \
    MACRO(f32, float)             \
    MACRO(f16, half_t)            \
    MACRO(bf16, bf16_t)
#endif

