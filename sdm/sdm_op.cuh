// sdm/sdm_op.cuh: the GPU SDM memory op (docs/SDM.md): chunked WY forward (training and prefill), backward, and
// the single-token decode step. The C API (shapes, sizing, entry points) is documented in sdm/sdm_op.h.
//
// Structure (per stream s = b*H + h, chunks of C tokens, all streams advance together):
//   wy_kernel        Phase 1, one CTA per (stream, chunk), no bank access: the chunk's entries sorted by slot, one
//                    thread per slot group for the links between them and the per-slot decay scans from zero inside
//                    the chunk (docs/SDM.md#numerics), gather/scatter weights, Gram matrices A and S (one warp per
//                    row), and Linv = (I + diag(beta) A)^-1.
//   forward          Phase 2, sequential over chunks (a host loop, three launches per chunk, all streams at once;
//                    in a prefill of few streams one persistent launch running the same block bodies):
//                    fgather (per (stream, token), whole rows: R0, E, snapshots), fsolve (per (stream, DB columns):
//                    Delta = Linv diag(beta) (V - R0), O = S Delta + E), fscatter (one warp per written slot: its last
//                    entry combines the slot's entries in a fixed order and writes the whole row once).
//   backward         reverse over chunks: token_kernel (per (stream, token), whole rows of the bank gradient G:
//                    write-path gradient of delta, omega), bsolve (per (stream, DB columns): dDelta, dX, dR0),
//                    bscatter (one warp per entry: the dense bank gradient G, fp32 or bf16, at the touched rows,
//                    the dots psi, phi, eta against the chunk-start rows, read from the snapshots), then
//                    bwy_kernel (per (stream, chunk): the C x C products, the Gram backward and the per-slot dgamma
//                    sums, one thread per entry walking its slot's links in shared memory).
//   decode_kernel    one token per stream, the recurrence in place (docs/SDM.md#the-recurrence).
// No floating-point atomics anywhere (an integer atomicAdd only lists phase 1's slot groups, in an order no result
// depends on): bitwise deterministic.
#ifndef SDM_SDM_OP_CUH
#define SDM_SDM_OP_CUH

#include "sdm/sdm_op.h"
#include "sdm/sdm_op_common.cuh" // device helpers, snapshots, SdmOpArgs, host helpers
#include "sdm/sdm_op_wy.cuh"     // phase 1: per-chunk WY quantities
#include "sdm/sdm_op_fwd.cuh"    // sdm_op_forward
#include "sdm/sdm_op_bwd.cuh"    // sdm_op_backward
#include "sdm/sdm_op_decode.cuh" // sdm_op_decode

#endif
