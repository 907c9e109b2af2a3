// tests/bench.h: the benchmarks' timer: median (and minimum) of repeated runs timed with CUDA events on one stream.
#ifndef SDM_TESTS_BENCH_H
#define SDM_TESTS_BENCH_H

#include <math.h>
#include <stdlib.h>

#include "core/cuda_common.cuh"

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

// Deterministic pseudo-random bf16 in [-2, 2): real data (not zeros), the same for a given seed.
__global__ void bench_fill(__nv_bfloat16 *x, size_t n, uint32_t seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 16; h *= 0x7feb352du; h ^= h >> 15; h *= 0x846ca68bu; h ^= h >> 16;
    x[i] = __float2bfloat16((float)(h >> 8) * (4.0f / 16777216.0f) - 2.0f);
}

typedef struct {
    float median, min; // ms
} BenchTime;

// `warm` untimed runs of run(), then `reps` timed ones on stream st, each after prep() (untimed: e.g. an L2 flush).
template <typename Prep, typename Run>
static BenchTime bench_time(int warm, int reps, Prep prep, Run run, cudaStream_t st = 0) {
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (int i = 0; i < warm; i++) run();
    float *ms = (float *)sdm_malloc(reps * sizeof(float));
    for (int i = 0; i < reps; i++) {
        prep(i);
        cudaCheck(cudaEventRecord(e0, st));
        run();
        cudaCheck(cudaEventRecord(e1, st));
        cudaCheck(cudaEventSynchronize(e1));
        cudaCheck(cudaEventElapsedTime(&ms[i], e0, e1));
    }
    qsort(ms, reps, sizeof(float), cmp_float);
    BenchTime t = {ms[reps / 2], ms[0]};
    free(ms);
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    return t;
}

// Non-finite values among n bf16 values on the device (a benchmark's sanity check of its outputs).
static size_t count_nonfinite(const __nv_bfloat16 *d, size_t n) {
    __nv_bfloat16 *h = (__nv_bfloat16 *)sdm_malloc(n * sizeof(__nv_bfloat16));
    cudaCheck(cudaMemcpy(h, d, n * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += !isfinite(__bfloat162float(h[i]));
    free(h);
    return bad;
}

#endif
