// sdm/sdm_common.cuh: small device helpers of the SDM layer's kernels (sdm/sdm_topk.cuh, sdm/sdm_readout.cuh,
// sdm/sdm_layer.cuh): sigmoid, softplus, the decay gate and the order-preserving float <-> uint32 map of the
// top-k keys.
#ifndef SDM_SDM_COMMON_CUH
#define SDM_SDM_COMMON_CUH

#include "core/cuda_common.cuh"

#define SDM_FULL_MASK 0xffffffffu

// ---- small device helpers ----------------------------------------------------------------------------------------

__device__ __forceinline__ float sdm_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float sdm_softplus(float x) { return x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x)); }
// The log-decay of docs/SDM.md#gates, g = -exp(A_log) softplus(a + dt_bias), for every kernel that forms it.
__device__ __forceinline__ float sdm_gate_decay(float a, float A_log, float dt_bias) {
    return -expf(A_log) * sdm_softplus(a + dt_bias);
}

// Order-preserving map float32 -> uint32 (a < b  <=>  ord(a) < ord(b)); -0 maps like +0 since the CPU reference
// compares floats, for which the two are a tie. ord(-inf) = 0x007fffff > 0, so 0 can mean "no candidate".
__device__ __forceinline__ uint32_t sdm_f2ord(float v) {
    if (v == 0.0f) v = 0.0f;
    uint32_t u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float sdm_ord2f(uint32_t o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

#endif
