// Splitting a call over threads, for the library's entry points that take a `threads` count.
//
// Why OpenMP and not threads of our own: torch's CPU ops run on OpenMP, and after each parallel
// region libgomp's idle team members spin for a while before they sleep. Threads of ours (the Python
// pool this replaced) then waited for cores those spinners held: at 2 threads a 32-sequence decode
// attention took as long as at one. The library is built with -fopenmp and loaded after torch, so its
// `libgomp.so.1` is the one torch's wheel already loaded (the loader matches the soname) and a
// region here runs on the calling thread's own team, the one its torch ops use.
// Part of the library's cache key (cpu_attention.HEADERS).
#ifndef PDSERVE_THREADS_H
#define PDSERVE_THREADS_H
#include <stdint.h>

// Start of part `part` of `parts` over [0, total), a multiple of `align` (the last part ends at total).
static inline int64_t part_start(int64_t total, int64_t part, int64_t parts, int64_t align) {
    return part >= parts ? total : total * part / parts / align * align;
}

// The body of a `<linear>_threads` entry point (int4_matmul.c, bf16_matmul.c, int4_amx.c): output rows
// [0, n) in `threads` parts of whole multiples of ALIGN rows (the kernel's tile: 2, or an AMX panel's
// 32), each part quantizing or widening its inputs itself (one call a part, nothing shared). CALL uses
// n0, n1; a part returns 0 or a negative code, and the lowest is returned.
#define LINEAR_THREADS(CALL) LINEAR_THREADS_ALIGNED(2, CALL)
#define LINEAR_THREADS_ALIGNED(ALIGN, CALL)                                                                   \
    int err = 0;                                                                                              \
    _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(min:err) if(threads > 1)")      \
    for (int64_t p = 0; p < threads; p++) {                                                                   \
        const int64_t n0 = part_start(n, p, threads, ALIGN), n1 = part_start(n, p + 1, threads, ALIGN);       \
        if (n1 > n0) {                                                                                        \
            const int e = CALL;                                                                               \
            err = e < err ? e : err;                                                                          \
        }                                                                                                     \
    }                                                                                                         \
    return err;
#endif
