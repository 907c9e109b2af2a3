// core/act.cuh: compile-time activation types for the dense kernels (core/layers.cuh, core/loss.cuh, core/adamw.cuh).
// Kernels are templated on the activation element type T (float for the all-fp32 mode, __nv_bfloat16 for training);
// host wrappers take the run-time cudaDataType_t (as core/matmul.cuh does) and pick the instantiation by ACT_DISPATCH.
// All arithmetic is fp32: T is only the storage type.
#ifndef SDM_CORE_ACT_CUH
#define SDM_CORE_ACT_CUH

#include "core/cuda_common.cuh"

__device__ __forceinline__ float act_to_float(float x) { return x; }
__device__ __forceinline__ float act_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T act_from_float(float x);
template <> __device__ __forceinline__ float act_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 act_from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

// Run `...` (a statement using the type name T) with T = float for CUDA_R_32F or __nv_bfloat16 for CUDA_R_16BF.
#define ACT_DISPATCH(dtype, what, ...)                                                  \
    do {                                                                                \
        if ((dtype) == CUDA_R_32F) {                                                    \
            typedef float T;                                                            \
            __VA_ARGS__;                                                                \
        } else if ((dtype) == CUDA_R_16BF) {                                            \
            typedef __nv_bfloat16 T;                                                    \
            __VA_ARGS__;                                                                \
        } else {                                                                        \
            sdm_die("%s: activation dtype must be fp32 or bf16 (got %d)", what, (int)(dtype)); \
        }                                                                               \
    } while (0)

// Deterministic sum of one float per thread over a block of blockDim.x threads (a multiple of 32, at most 1024):
// a fixed shuffle tree in each warp, then warp 0 adds the warp totals in the same tree. Every thread gets the sum.
// `scratch` is __shared__ float[32]; the call ends with a barrier so scratch can be reused right after.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

#endif
