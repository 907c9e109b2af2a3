// attention/attention.cuh: causal and sliding-window attention on the GPU (docs/MODEL.md#attention): RoPE, the
// attention core (flash-style forward with logsumexp, deterministic backward), the sigmoid gate, and decode against a
// KV cache.
//
// Layouts (row-major, last index fastest; what the projection GEMM writes):
//   q, out, dq, dout [B,T,n_h,d_h];  k, v, dk, dv [B,T,n_kv,d_h];  lse [B,n_h,T] fp32 (natural log)
//   KV cache [B,C,n_kv,d_h]: position pos of stream b lives in slot pos % C (C = w: a ring buffer for SWA layers;
//   C >= the longest stream for full attention).
// Element type: DT_BF16 (tensor cores, mma.sync m16n8k16, or on sm_90a builds the warpgroup products wgmma fed by
// TMA at d_h = 128; fp32 accumulation) or DT_FP32 (plain fp32 arithmetic, for tight tests). Mask: key s visible
// from query p iff 0 <= p - s < w (w = 0: s <= p). GQA: query head j reads kv head j / (n_h / n_kv) by indexing.
// Head dims 64 and 128. Nothing here uses floating-point atomics: every output element is written by one thread,
// which sums its terms in a fixed order, so results are bitwise reproducible.
#ifndef SDM_ATTENTION_CUH
#define SDM_ATTENTION_CUH

#include "attention/attn_common.cuh"    // types, AttnArgs, row-per-warp helpers, host helpers
#include "attention/attn_rope_gate.cuh" // RoPE, sigmoid gate
#include "attention/attn_mma.cuh"       // tensor-core building blocks
#include "attention/attn_fwd.cuh"       // attn_forward (with attn_fwd_wgmma.cuh, the Hopper kernels)
#include "attention/attn_bwd.cuh"       // attn_backward
#include "attention/attn_decode.cuh"    // attn_decode: RoPE, KV-cache append and attention of one step

#endif
