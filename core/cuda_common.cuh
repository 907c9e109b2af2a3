// core/cuda_common.cuh: CUDA / cuBLAS error checking with file:line, and small device helpers shared by every
// CUDA module. Every CUDA and cuBLAS call in sdm.c goes through cudaCheck / cublasCheck; kernel launches are
// followed by cudaCheckLast() so a bad launch is reported where it happened.
#ifndef SDM_CORE_CUDA_COMMON_CUH
#define SDM_CORE_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/common.h"

static inline void cuda_check_at(cudaError_t err, const char *file, int line) {
    if (err != cudaSuccess) sdm_die("CUDA error at %s:%d: %s", file, line, cudaGetErrorString(err));
}

static inline void cublas_check_at(cublasStatus_t st, const char *file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) sdm_die("cuBLAS error at %s:%d: status %d", file, line, (int)st);
}

#define cudaCheck(call) cuda_check_at((call), __FILE__, __LINE__)
#define cublasCheck(call) cublas_check_at((call), __FILE__, __LINE__)
#define cudaCheckLast() cuda_check_at(cudaGetLastError(), __FILE__, __LINE__)

static inline int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }

// Bytes of one element of a matmul/activation dtype (only the two sdm.c uses).
static inline size_t dtype_size(cudaDataType_t t) {
    if (t == CUDA_R_32F) return 4;
    if (t == CUDA_R_16BF) return 2;
    sdm_die("internal: unsupported dtype %d", (int)t);
    return 0;
}

// Sum over the 32 lanes of a warp by a fixed xor butterfly: every lane gets the same, reproducible bits.
__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Load/store one element of an activation buffer that is either fp32 or bf16 (chosen at run time: the all-fp32
// test mode and the bf16 training mode share every kernel).
__device__ __forceinline__ float load_act(const void *p, size_t i, bool fp32) {
    return fp32 ? ((const float *)p)[i] : __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
__device__ __forceinline__ void store_act(void *p, size_t i, float v, bool fp32) {
    if (fp32) ((float *)p)[i] = v;
    else ((__nv_bfloat16 *)p)[i] = __float2bfloat16(v);
}

#endif
