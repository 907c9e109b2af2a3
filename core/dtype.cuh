// core/dtype.cuh: the one precision vocabulary of sdm.c's GPU code (core/, attention/, sdm/). An activation, weight
// working copy or matmul operand is either bf16 (training) or fp32 (the all-fp32 test mode); every host API takes
// the element type as a Dtype. All arithmetic is fp32: the dtype is only the storage type.
//   host     dtype_size (bytes), dtype_cuda (cuBLAS's cudaDataType_t), dtype_name, dtype_elem_ptr (element i)
//   device   dtype_to_float / dtype_from_float<T> on the storage types T = float or __nv_bfloat16 (kernels templated
//            on T, instantiated by DTYPE_DISPATCH); dtype_load / dtype_store for kernels that switch at run time
//            (they take `bool fp32` = dt == DT_FP32); DtypePack<T, W>: W elements moved in one access (16 bytes:
//            DtypeVec<T>, the vector of the bandwidth-bound kernels)
#ifndef SDM_CORE_DTYPE_CUH
#define SDM_CORE_DTYPE_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/common.h"

typedef enum { DT_BF16 = 0, DT_FP32 = 1 } Dtype;

// Bytes of one element.
static inline size_t dtype_size(Dtype t) {
    if (t == DT_FP32) return 4;
    if (t == DT_BF16) return 2;
    sdm_die("internal: unsupported dtype %d", (int)t);
    return 0;
}

// The cuBLAS / cuBLASLt data type of t.
static inline cudaDataType_t dtype_cuda(Dtype t) {
    if (t == DT_FP32) return CUDA_R_32F;
    if (t == DT_BF16) return CUDA_R_16BF;
    sdm_die("internal: unsupported dtype %d", (int)t);
    return CUDA_R_32F;
}

static inline const char *dtype_name(Dtype t) { return t == DT_FP32 ? "fp32" : t == DT_BF16 ? "bf16" : "?"; }

// Address of element i of an array of dtype t.
static inline const void *dtype_elem_ptr(const void *p, size_t i, Dtype t) {
    return (const char *)p + i * dtype_size(t);
}

// Storage type <-> fp32 on the device.
__device__ __forceinline__ float dtype_to_float(float x) { return x; }
__device__ __forceinline__ float dtype_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T dtype_from_float(float x);
template <> __device__ __forceinline__ float dtype_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 dtype_from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16(x);
}

// W consecutive elements of T loaded or stored in one access of W * sizeof(T) bytes (ld/st.global.v4 for 16); the
// address must be aligned to that size. Kernels that stream rows use DtypeVec<T> = 16 bytes = 4 fp32 or 8 bf16.
template <typename T, int W> struct alignas(W * sizeof(T)) DtypePack {
    static constexpr int N = W;
    T e[W];
    __device__ __forceinline__ float get(int i) const { return dtype_to_float(e[i]); }
    __device__ __forceinline__ void set(int i, float v) { e[i] = dtype_from_float<T>(v); }
};
template <typename T> using DtypeVec = DtypePack<T, 16 / sizeof(T)>;

// Element i of 16 bytes u holding 16 / sizeof(T) elements of T, as a float: rows a loop holds stay packed in u's
// 4 registers until used, where an array of bf16 would take a register an element.
__device__ __forceinline__ unsigned dtype_word(const uint4 &u, int w) {
    return w == 0 ? u.x : w == 1 ? u.y : w == 2 ? u.z : u.w;
}
template <typename T> __device__ __forceinline__ float dtype_unpack16(const uint4 &u, int i);
template <> __device__ __forceinline__ float dtype_unpack16<float>(const uint4 &u, int i) {
    return __uint_as_float(dtype_word(u, i));
}
template <> __device__ __forceinline__ float dtype_unpack16<__nv_bfloat16>(const uint4 &u, int i) {
    unsigned w = dtype_word(u, i / 2); // element 2k in the low half of word k (little-endian)
    return __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
}

template <typename P, typename T> __device__ __forceinline__ P dtype_pack_load(const T *p) {
    return *(const P *)p;
}
template <typename P, typename T> __device__ __forceinline__ void dtype_pack_store(T *p, const P &v) {
    *(P *)p = v;
}

// Run `...` (a statement using the type name T) with T = float for DT_FP32 or __nv_bfloat16 for DT_BF16.
#define DTYPE_DISPATCH(dtype, what, ...)                                                \
    do {                                                                                \
        if ((dtype) == DT_FP32) {                                                       \
            typedef float T;                                                            \
            __VA_ARGS__;                                                                \
        } else if ((dtype) == DT_BF16) {                                                \
            typedef __nv_bfloat16 T;                                                    \
            __VA_ARGS__;                                                                \
        } else {                                                                        \
            sdm_die("%s: activation dtype must be fp32 or bf16 (got %d)", what, (int)(dtype)); \
        }                                                                               \
    } while (0)

// Load/store one element of an activation buffer that is either fp32 or bf16 (chosen at run time: the all-fp32
// test mode and the bf16 training mode share every kernel).
__device__ __forceinline__ float dtype_load(const void *p, size_t i, bool fp32) {
    return fp32 ? ((const float *)p)[i] : __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
__device__ __forceinline__ void dtype_store(void *p, size_t i, float v, bool fp32) {
    if (fp32) ((float *)p)[i] = v;
    else ((__nv_bfloat16 *)p)[i] = __float2bfloat16(v);
}

#endif
