// KV cache write: scatters the step's new keys and values into their cache slots.
//
// Shapes (elements):
//   k, v          [N, KVH, D]   row stride k_row_stride / v_row_stride (a row is KVH * D
//                               contiguous elements; rows may be views into a fused qkv)
//   slot_mapping  [N] int64     slot = block_id * BS + offset; a negative slot is skipped
//                               (padding tokens, e.g. under CUDA graphs)
//   kv_cache      [NB, L, 2, BS, KVH, D] contiguous
// Geometry: one thread block per token (grid.x = N), threads stride over the KVH * D row.
// It is a pure copy (same dtype in and out), so the kernel works on raw 16- or 32-bit words.
#include "common.cuh"

template <typename E>
__device__ __forceinline__ void write_kv_rows(
    E* __restrict__ cache, const E* __restrict__ k, const E* __restrict__ v,
    const long long* __restrict__ slot_mapping, long long k_row_stride, long long v_row_stride,
    int row_elems,            // KVH * D
    long long layer_offset,   // layer * 2 * BS * KVH * D
    long long block_stride,   // L * 2 * BS * KVH * D
    long long kv_stride,      // BS * KVH * D: keys -> values
    int block_size) {
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;
    const long long blk = slot / block_size;
    const long long off = slot % block_size;
    E* dst = cache + blk * block_stride + layer_offset + off * row_elems;
    const E* ks = k + token * k_row_stride;
    const E* vs = v + token * v_row_stride;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        dst[i] = ks[i];
        dst[kv_stride + i] = vs[i];
    }
}

extern "C" __global__ void write_kv_16(
    u16* cache, const u16* k, const u16* v, const long long* slot_mapping,
    long long k_row_stride, long long v_row_stride, int row_elems, long long layer_offset,
    long long block_stride, long long kv_stride, int block_size) {
    write_kv_rows<u16>(cache, k, v, slot_mapping, k_row_stride, v_row_stride, row_elems,
                       layer_offset, block_stride, kv_stride, block_size);
}

extern "C" __global__ void write_kv_32(
    unsigned int* cache, const unsigned int* k, const unsigned int* v,
    const long long* slot_mapping, long long k_row_stride, long long v_row_stride,
    int row_elems, long long layer_offset, long long block_stride, long long kv_stride,
    int block_size) {
    write_kv_rows<unsigned int>(cache, k, v, slot_mapping, k_row_stride, v_row_stride,
                                row_elems, layer_offset, block_stride, kv_stride, block_size);
}
