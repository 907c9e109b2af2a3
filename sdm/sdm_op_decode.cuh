// sdm/sdm_op_decode.cuh: the single-token decode step of the SDM op (docs/SDM.md#the-recurrence, docs/SDM.md#decode-and-prefill): sdm_op_decode applies the
// recurrence (retrieval from the decayed rows, delta, write, read after the write) to one token of each of the B*H
// streams, in place on the bank [B,H,N,d] (bf16 or fp32), readings to out [B,1,H,d]. Inputs in the op's layout with
// T = 1. No workspace.
#ifndef SDM_SDM_OP_DECODE_CUH
#define SDM_SDM_OP_DECODE_CUH

#include "sdm/sdm_op_common.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Decode: one token per stream, grid (ceil(d / (32 V)), S), 32 threads; each thread owns V columns of its stream
// and applies steps (1)-(5) of docs/SDM.md#the-recurrence to them (columns are independent, so no synchronisation).
template <typename Tb>
__global__ void __launch_bounds__(32) sdm_decode_kernel(SdmOpShape sh, SdmOpInputs in, Tb *bank, float *out) {
    constexpr int V = SdmBankVec<Tb>::V;
    const int s = blockIdx.y, col = (blockIdx.x * 32 + threadIdx.x) * V;
    if (col >= sh.d) return;
    Tb *M = bank + (size_t)s * sh.N * sh.d;
    const size_t ow = (size_t)s * sh.W, orr = (size_t)s * sh.R;
    float r[V], x[V];
    for (int i = 0; i < V; i++) r[i] = 0.f;
    for (int k = 0; k < sh.W; k++) { // (1)-(2): retrieval from the decayed rows
        SdmBankVec<Tb>::load(M + (size_t)in.wslot[ow + k] * sh.d + col, x);
        float g = in.kappa[ow + k] * expf(in.gamma[ow + k]);
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    float bt = in.beta[s];
    const float *vv = in.v + (size_t)s * sh.d + col;
    for (int i = 0; i < V; i++) r[i] = bt * (vv[i] - r[i]); // (3) r now holds delta
    for (int k = 0; k < sh.W; k++) { // (4) write
        Tb *row = M + (size_t)in.wslot[ow + k] * sh.d + col;
        SdmBankVec<Tb>::load(row, x);
        float a = expf(in.gamma[ow + k]), kp = in.kappa[ow + k];
        for (int i = 0; i < V; i++) x[i] = fmaf(a, x[i], kp * r[i]);
        SdmBankVec<Tb>::store(row, x);
    }
    for (int i = 0; i < V; i++) r[i] = 0.f;
    for (int k = 0; k < sh.R; k++) { // (5) read after the write
        SdmBankVec<Tb>::load(M + (size_t)in.rslot[orr + k] * sh.d + col, x);
        float g = in.rho[orr + k];
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    for (int i = 0; i < V; i += 4) SdmBankVec<float>::store(out + (size_t)s * sh.d + col + i, r + i);
}

static void sdm_op_decode(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out, cudaStream_t stream) {
    sdm_op_require(s);
    if (s->T != 1) sdm_die("sdm_op_decode: T must be 1 (got %d)", s->T);
    int S = s->B * s->H;
    if (s->bank_fp32) {
        sdm_decode_kernel<float><<<dim3(ceil_div(s->d, 32 * 4), S), 32, 0, stream>>>(*s, *in, (float *)bank, out);
    } else {
        sdm_decode_kernel<__nv_bfloat16><<<dim3(ceil_div(s->d, 32 * 8), S), 32, 0, stream>>>(*s, *in, (__nv_bfloat16 *)bank, out);
    }
    cudaCheckLast();
}

#endif
