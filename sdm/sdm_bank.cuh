// sdm/sdm_bank.cuh: the SDM layer's banks on the GPU (docs/SDM.md#the-bank, docs/SDM.md#layer-chain-rule): B sequences'
// banks [B, H, N, d] in the bank dtype (bf16 or fp32) initialised from the learned M0 [H, N, d] (or zeros), the M0
// gradient as the sum over b in order of the per-sequence fp32 bank gradients, and the size of one sequence's bank.
#ifndef SDM_SDM_BANK_CUH
#define SDM_SDM_BANK_CUH

#include "core/cuda_common.cuh"
#include "sdm/sdm_dims.h"

// =================================================================================================================
// The bank: every sequence starts from its own copy of M0 (docs/SDM.md#the-bank), and dM0 is the sum of the copies'
// gradients over b in order 0..B-1 (docs/SDM.md#layer-chain-rule).
// =================================================================================================================

__global__ void sdm_bank_copy_kernel(void *bank, bool bank_fp32, const void *m0, bool m0_fp32, size_t per_seq, int B) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < per_seq; i += (size_t)gridDim.x * blockDim.x) {
        float x = dtype_load(m0, i, m0_fp32);
        for (int b = 0; b < B; b++) dtype_store(bank, (size_t)b * per_seq + i, x, bank_fp32);
    }
}

// bank[b, :] = m0 for every b, in 16-byte units (n16 per sequence)
__global__ void sdm_bank_replicate_kernel(uint4 *bank, const uint4 *m0, size_t n16, int B) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        uint4 x = m0[i];
        for (int b = 0; b < B; b++) bank[(size_t)b * n16 + i] = x;
    }
}

// dm0[i] += sum_b dbank[b, i]; per_seq % 4 == 0 (d is a multiple of 8)
__global__ void sdm_bank_grad_sum_kernel(float *dm0, const float *dbank, size_t per_seq, int B) {
    size_t n4 = per_seq / 4;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 s = ((const float4 *)dbank)[i];
        for (int b = 1; b < B; b++) {
            float4 t = ((const float4 *)(dbank + (size_t)b * per_seq))[i];
            s.x += t.x; s.y += t.y; s.z += t.z; s.w += t.w;
        }
        float4 acc = ((float4 *)dm0)[i];
        acc.x += s.x; acc.y += s.y; acc.z += s.z; acc.w += s.w;
        ((float4 *)dm0)[i] = acc;
    }
}

// bank [B, per_seq] (bank dtype) = M0 [per_seq] (m0 dtype) for every b, or zeros when m0 is NULL.
static inline void sdm_bank_init(void *bank, Dtype bank_dt, const void *m0, Dtype m0_dt, size_t per_seq, int B,
                             cudaStream_t s) {
    if (!m0) {
        cudaCheck(cudaMemsetAsync(bank, 0, (size_t)B * per_seq * dtype_size(bank_dt), s));
        return;
    }
    if (bank_dt == m0_dt && (uintptr_t)m0 % 16 == 0) { // same dtype: read M0 once, write B copies, 16 B at a time
        size_t n16 = per_seq * dtype_size(bank_dt) / 16;
        sdm_bank_replicate_kernel<<<2112, 256, 0, s>>>((uint4 *)bank, (const uint4 *)m0, n16, B);
        cudaCheckLast();
        return;
    }
    sdm_bank_copy_kernel<<<1056, 256, 0, s>>>(bank, bank_dt == DT_FP32, m0, m0_dt == DT_FP32, per_seq, B);
    cudaCheckLast();
}

// The bank dtype of a layer (SdmDims.bank_fp32).
static inline Dtype sdm_bank_dtype(const SdmDims *s) { return s->bank_fp32 ? DT_FP32 : DT_BF16; }

// Bytes of one bank row [d] in the bank dtype.
static inline int sdm_bank_row_bytes(const SdmDims *s) { return s->head_dim * (int)dtype_size(sdm_bank_dtype(s)); }

// Bytes of one sequence's bank [H, N, d] in the bank dtype.
static inline size_t sdm_bank_bytes(const SdmDims *s) { return (size_t)s->heads * s->slots * sdm_bank_row_bytes(s); }

#endif
