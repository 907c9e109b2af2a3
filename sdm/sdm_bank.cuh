// sdm/sdm_bank.cuh: the SDM layer's banks on the GPU (docs/SDM.md#the-bank, docs/SDM.md#layer-chain-rule): B sequences'
// banks [B, H, N, d] in the bank dtype (bf16 or fp32) initialised from the learned M0 [H, N, d] (or zeros), the M0
// gradient as the sum over b in order of the per-sequence bank gradients (fp32, or bf16 with sdm.grad_bank_dtype), and
// the size of one sequence's bank.
#ifndef SDM_SDM_BANK_CUH
#define SDM_SDM_BANK_CUH

#include "core/cuda_common.cuh"
#include "sdm/sdm_dims.h"
#include "sdm/sdm_op_common.cuh" // sdm_load8 / sdm_store8

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

// dm0[i] += sum_b dbank[b, i] in fp32, b in order; dbank in Tg (float or bf16), 8 elements a thread (per_seq % 8 == 0:
// d is a multiple of 8; dm0 16-byte aligned)
template <typename Tg>
__global__ void sdm_bank_grad_sum_kernel(float *dm0, const Tg *dbank, size_t per_seq, int B) {
    size_t n8 = per_seq / 8;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float s[8], t[8], acc[8];
        sdm_load8(dbank + 8 * i, s);
        for (int b = 1; b < B; b++) {
            sdm_load8(dbank + (size_t)b * per_seq + 8 * i, t);
            for (int k = 0; k < 8; k++) s[k] += t[k];
        }
        sdm_load8(dm0 + 8 * i, acc);
        for (int k = 0; k < 8; k++) acc[k] += s[k];
        sdm_store8(dm0 + 8 * i, acc);
    }
}

// dm0 [per_seq] += the sum over b of dbank [B, per_seq] (bf16 with grad_bank_bf16, else fp32).
static inline void sdm_bank_grad_sum(float *dm0, const void *dbank, int grad_bank_bf16, size_t per_seq, int B,
                                     cudaStream_t s) {
    if (grad_bank_bf16)
        sdm_bank_grad_sum_kernel<<<2112, 256, 0, s>>>(dm0, (const __nv_bfloat16 *)dbank, per_seq, B);
    else sdm_bank_grad_sum_kernel<<<2112, 256, 0, s>>>(dm0, (const float *)dbank, per_seq, B);
    cudaCheckLast();
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

// The dtype of a layer's per-sequence bank gradients (SdmDims.grad_bank_bf16, sdm.grad_bank_dtype).
static inline Dtype sdm_bank_grad_dtype(const SdmDims *s) { return s->grad_bank_bf16 ? DT_BF16 : DT_FP32; }

// Bytes of one sequence's bank [H, N, d] in the bank dtype.
static inline size_t sdm_bank_bytes(const SdmDims *s) { return (size_t)s->heads * s->slots * sdm_bank_row_bytes(s); }

#endif
