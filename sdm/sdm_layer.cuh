// sdm/sdm_layer.cuh: the SDM layer on the GPU around the memory op (docs/SDM.md#layer-overview): the fused input
// projection, gates and values, the calls to the top-k addressing (sdm/sdm_topk.cuh), the bank copy from M0
// (sdm/sdm_bank.cuh), the memory op (sdm/sdm_op.cuh) and the readout (sdm/sdm_readout.cuh), then the output
// projection; the training API (sdm_layer_create / forward / backward). Inference state: sdm/sdm_infer.cuh.
// Layout follows sdm/sdm_ref.h and sdm/sdm_op.h: token-major [B,T,H,...] per-token per-head arrays; a "problem"
// p = token*H + h is one token and head. Precision: parameters, activations and matmul inputs in the layer's
// compute dtype (bf16, or fp32 for the all-fp32 test mode); gates, weights, scores, LayerNorm statistics, the op's
// inputs/outputs and every parameter gradient in fp32. No floating-point atomics anywhere.
#ifndef SDM_SDM_LAYER_CUH
#define SDM_SDM_LAYER_CUH

#include "core/cuda_common.cuh"
#include "core/matmul.cuh"
#include "sdm/sdm_bank.cuh"
#include "sdm/sdm_common.cuh"
#include "sdm/sdm_dims.h"
#include "sdm/sdm_op.cuh"
#include "sdm/sdm_readout.cuh"
#include "sdm/sdm_topk.cuh"

// =================================================================================================================
// Gates and values from the fused projection (docs/SDM.md#gates), one block per token:
//   v[tok, :] = z[tok, col_v : col_v + D] in fp32 (the op's input), g = -exp(A_log) softplus(a + dt_bias),
//   beta = sigmoid(c), with a = z[tok, col_a + h], c = z[tok, col_c + h].
// =================================================================================================================

__global__ void sdm_unpack_kernel(const void *z, bool fp32, int ldz, int col_v, int col_a, int col_c, int D, int H,
                              const void *A_log, const void *dt_bias, float *v, float *g, float *beta) {
    size_t tok = blockIdx.x, row = tok * ldz;
    for (int i = threadIdx.x; i < D; i += blockDim.x) v[tok * D + i] = dtype_load(z, row + col_v + i, fp32);
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float a = dtype_load(z, row + col_a + h, fp32), c = dtype_load(z, row + col_c + h, fp32);
        g[tok * H + h] = -expf(dtype_load(A_log, h, fp32)) * sdm_softplus(a + dtype_load(dt_bias, h, fp32));
        beta[tok * H + h] = sdm_sigmoid(c);
    }
}

// dz[tok, col_v : col_v + D] = dv[tok, :] (the op's value gradient into the fused projection's gradient)
__global__ void sdm_pack_dv_kernel(const float *dv, void *dz, bool fp32, int ldz, int col_v, int D) {
    size_t tok = blockIdx.x;
    for (int i = threadIdx.x; i < D; i += blockDim.x) dtype_store(dz, tok * ldz + col_v + i, dv[tok * D + i], fp32);
}

// =================================================================================================================
// The layer.
// =================================================================================================================

// Device parameters in the compute dtype. w_in: the model's consecutive wk, wq, wv, wa, wb (, wg) block [n_in, D],
// n_in = 2*H*K + D + 2*H (+ D with output_gate); consecutive because every block has a multiple of 8 elements when
// D % 8 == 0, so the model's 8-element tensor alignment adds no gaps. The biases need not be consecutive (ba and bb
// have H elements, so alignment gaps follow them): one pointer each, packed into the layer's own buffer.
enum { SDM_B_K, SDM_B_Q, SDM_B_V, SDM_B_A, SDM_B_B, SDM_B_G, SDM_B_COUNT };

typedef struct {
    const void *w_in;
    const void *b_in[SDM_B_COUNT]; // bk [H*K], bq [H*K], bv [D], ba [H], bb [H], bg [D] (bg NULL without output_gate)
    const void *A_log, *dt_bias;   // [H]
    const void *ln_w, *ln_b;       // [d] (normalize_readings, else NULL)
    const void *w_out, *b_out;     // [D, D], [D]
    const void *bank0;             // M0 [H*N, d] (learned_bank, else NULL)
} SdmLayerParams;

// fp32 gradients, accumulated (+=) by sdm_layer_backward; same shapes as SdmLayerParams (bank0: 16-byte aligned).
typedef struct {
    float *w_in, *b_in[SDM_B_COUNT], *A_log, *dt_bias, *ln_w, *ln_b, *w_out, *b_out, *bank0;
} SdmLayerGrads;

// Stage boundaries recorded with CUDA events when timing is on (see sdm_layer_stage_ms).
enum { SDM_EV_F0, SDM_EV_F_PROJ, SDM_EV_F_TOPK, SDM_EV_F_BANK, SDM_EV_F_OP, SDM_EV_F_READOUT, SDM_EV_F_OUT,
       SDM_EV_B0, SDM_EV_B_OUT, SDM_EV_B_READOUT, SDM_EV_B_OP, SDM_EV_B_TOPK, SDM_EV_B_SUMS, SDM_EV_B_IN, SDM_LAYER_EVENTS };

typedef struct {
    SdmDims s;
    int B, T;
    Dtype ctype;         // compute dtype: DT_FP32 in the all-fp32 mode, else DT_BF16
    SdmOpShape op;
    SdmTopkPlan tw, tr;     // write / read top-k
    int n_in, ldz;       // fused projection width and its row stride (multiple of 8)
    int col_zk, col_zq, col_v, col_a, col_c, col_g;
    // saved by the forward for the backward
    void *b_packed;      // [n_in] compute dtype: the input biases packed in the column order of z
    void *z;             // [BT, ldz] compute dtype: zK | zQ | v | a | c (| zG); the backward overwrites it with dz
    float *v, *g, *beta; // [BT, D], [BT, H], [BT, H]
    int *wslot, *rslot;  // [BT, H, W], [BT, H, R]
    float *kappa, *gamma, *rho;
    void *bank;          // [B, H, N, d] bank dtype; final bank after the forward, restored by the backward
    float *o;            // [BT, D] op readings
    float *ln_mean, *ln_rstd; // [BT, H]
    void *r;             // [BT, D] compute dtype, the input of Wo
    void *saved;         // sdm_op_saved_bytes
    // backward
    void *scratch;       // sdm_op_scratch_bytes
    float *dr;           // [BT, D] dY Wo, then (in place) the gradient of the op readings
    float *dkappa, *dgamma, *dbeta, *dv, *drho, *dbank; // op gradients
    float *gate_grad;    // [BT, 3H]: da, dc, dg * g in fp32
    float *ln_partials;  // [2, sdm_readout_warps, d]
    size_t device_bytes;
    int timing;
    cudaEvent_t ev[SDM_LAYER_EVENTS];
    cudaStream_t side;        // NULL, or a stream for the read top-k (sdm_layer_use_side_stream)
    cudaEvent_t fork, join;   // ordering between the caller's stream and `side`
} SdmLayer;

static inline void *sdm_layer_alloc(SdmLayer *L, size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    L->device_bytes += bytes;
    return p;
}

// NULL when the GPU layer supports the configuration, else the reason.
static inline const char *sdm_layer_check(const SdmDims *s) {
    if (s->write_act != SDM_ACT_SOFTMAX || s->read_act != SDM_ACT_SOFTMAX)
        return "the GPU layer implements only the softmax weight activation (write_act / read_act)";
    if (s->heads < 1 || s->dim % s->heads != 0 || s->head_dim != s->dim / s->heads) return "D must equal H * d";
    if (s->head_dim > SDM_RO_MAX_D || s->head_dim % 4 != 0) return "head dim d must be a multiple of 4, at most 2048";
    return NULL;
}

// Shape, column layout and top-k plans of a layer for B sequences of T tokens (no device buffers yet).
static inline SdmLayer sdm_layer_setup(const SdmDims *s, int B, int T, Dtype ctype, int training) {
    const char *why = sdm_layer_check(s);
    if (why) sdm_die("SDM layer: %s", why);
    SdmLayer L;
    memset(&L, 0, sizeof(L));
    L.s = *s;
    L.B = B; L.T = T;
    L.ctype = ctype;
    int D = s->dim, H = s->heads, HK = H * s->key_dim;
    L.op.B = B; L.op.T = T; L.op.H = H; L.op.N = s->slots; L.op.d = s->head_dim; L.op.W = s->writes;
    L.op.R = s->reads; L.op.C = s->chunk; L.op.bank_fp32 = s->bank_fp32; L.op.snapshot = s->snapshot;
    L.op.training = training;
    if ((why = sdm_op_check(&L.op))) sdm_die("SDM layer: memory op: %s", why);
    L.tw = sdm_topk_plan_make(s, s->writes);
    L.tr = sdm_topk_plan_make(s, s->reads);
    L.col_zk = 0; L.col_zq = HK; L.col_v = 2 * HK; L.col_a = 2 * HK + D; L.col_c = L.col_a + H;
    L.col_g = L.col_c + H;
    L.n_in = L.col_g + (s->output_gate ? D : 0);
    L.ldz = (L.n_in + 7) & ~7;
    return L;
}

// The per-token buffers of the forward for L->B * L->T tokens (all but the bank and the op's saved state).
static inline void sdm_layer_alloc_forward(SdmLayer *L) {
    const SdmDims *s = &L->s;
    size_t BT = (size_t)L->B * L->T, P = BT * s->heads, D = s->dim, W = s->writes, R = s->reads;
    size_t cs = dtype_size(L->ctype);
    L->b_packed = sdm_layer_alloc(L, (size_t)L->n_in * cs);
    L->z = sdm_layer_alloc(L, BT * L->ldz * cs);
    L->v = (float *)sdm_layer_alloc(L, BT * D * 4);
    L->g = (float *)sdm_layer_alloc(L, P * 4);
    L->beta = (float *)sdm_layer_alloc(L, P * 4);
    L->wslot = (int *)sdm_layer_alloc(L, P * W * 4);
    L->kappa = (float *)sdm_layer_alloc(L, P * W * 4);
    L->gamma = (float *)sdm_layer_alloc(L, P * W * 4);
    L->rslot = (int *)sdm_layer_alloc(L, P * R * 4);
    L->rho = (float *)sdm_layer_alloc(L, P * R * 4);
    L->o = (float *)sdm_layer_alloc(L, BT * D * 4);
    if (s->normalize_readings) {
        L->ln_mean = (float *)sdm_layer_alloc(L, P * 4);
        L->ln_rstd = (float *)sdm_layer_alloc(L, P * 4);
    }
    L->r = sdm_layer_alloc(L, BT * D * cs);
}

static inline SdmLayer sdm_layer_create(const SdmDims *s, int B, int T, Dtype ctype, int timing) {
    SdmLayer L = sdm_layer_setup(s, B, T, ctype, 1);
    sdm_layer_alloc_forward(&L);
    int W = s->writes, R = s->reads, d = s->head_dim;
    size_t BT = (size_t)B * T, P = BT * s->heads, D = s->dim;
    size_t bank_elems = (size_t)B * s->heads * s->slots * d;
    L.bank = sdm_layer_alloc(&L, B * sdm_bank_bytes(s));
    if (s->normalize_readings) L.ln_partials = (float *)sdm_layer_alloc(&L, 2 * (size_t)sdm_readout_warps((int)P) * d * 4);
    L.saved = sdm_layer_alloc(&L, sdm_op_saved_bytes(&L.op));
    L.scratch = sdm_layer_alloc(&L, sdm_op_scratch_bytes(&L.op));
    L.dr = (float *)sdm_layer_alloc(&L, BT * D * 4);
    L.dkappa = (float *)sdm_layer_alloc(&L, P * W * 4);
    L.dgamma = (float *)sdm_layer_alloc(&L, P * W * 4);
    L.dbeta = (float *)sdm_layer_alloc(&L, P * 4);
    L.dv = (float *)sdm_layer_alloc(&L, BT * D * 4);
    L.drho = (float *)sdm_layer_alloc(&L, P * R * 4);
    L.dbank = (float *)sdm_layer_alloc(&L, bank_elems * 4);
    L.gate_grad = (float *)sdm_layer_alloc(&L, BT * 3 * s->heads * 4);
    L.timing = timing;
    if (timing)
        for (int i = 0; i < SDM_LAYER_EVENTS; i++) cudaCheck(cudaEventCreate(&L.ev[i]));
    return L;
}

static inline void sdm_layer_destroy(SdmLayer *L) {
    void *bufs[] = {L->b_packed, L->z, L->v, L->g, L->beta, L->wslot, L->kappa, L->gamma, L->rslot, L->rho, L->bank,
                    L->o, L->ln_mean, L->ln_rstd, L->ln_partials, L->r, L->saved, L->scratch, L->dr, L->dkappa,
                    L->dgamma, L->dbeta, L->dv, L->drho, L->dbank, L->gate_grad};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaCheck(cudaFree(bufs[i]));
    if (L->timing)
        for (int i = 0; i < SDM_LAYER_EVENTS; i++) cudaCheck(cudaEventDestroy(L->ev[i]));
    if (L->side) {
        cudaCheck(cudaStreamDestroy(L->side));
        cudaCheck(cudaEventDestroy(L->fork));
        cudaCheck(cudaEventDestroy(L->join));
    }
    sdm_topk_plan_free(&L->tw);
    sdm_topk_plan_free(&L->tr);
    memset(L, 0, sizeof(*L));
}

// Run the read top-k on a stream of its own, beside the gates and the write top-k (it needs only z). Each top-k
// problem is one warp's work, so at decode's few problems the two kernels are latency-bound and overlap fully.
static inline void sdm_layer_use_side_stream(SdmLayer *L) {
    cudaCheck(cudaStreamCreateWithFlags(&L->side, cudaStreamNonBlocking));
    cudaCheck(cudaEventCreateWithFlags(&L->fork, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&L->join, cudaEventDisableTiming));
}

static inline void sdm_layer_mark(SdmLayer *L, int ev, cudaStream_t s) {
    if (L->timing) cudaCheck(cudaEventRecord(L->ev[ev], s));
}

// First column of each input bias block in z (SDM_B_* order) and its width.
static inline void sdm_layer_bias_block(const SdmLayer *L, int which, int *col, int *width) {
    const SdmDims *s = &L->s;
    int HK = s->heads * s->key_dim, cols[SDM_B_COUNT] = {L->col_zk, L->col_zq, L->col_v, L->col_a, L->col_c, L->col_g};
    int widths[SDM_B_COUNT] = {HK, HK, s->dim, s->heads, s->heads, s->output_gate ? s->dim : 0};
    *col = cols[which];
    *width = widths[which];
}

static inline SdmOpInputs sdm_layer_op_inputs(const SdmLayer *L) {
    SdmOpInputs in;
    in.wslot = L->wslot; in.kappa = L->kappa; in.gamma = L->gamma; in.beta = L->beta; in.v = L->v;
    in.rslot = L->rslot; in.rho = L->rho;
    return in;
}

static inline SdmReadoutArgs sdm_layer_readout_args(const SdmLayer *L, const SdmLayerParams *p) {
    SdmReadoutArgs ra;
    ra.P = L->B * L->T * L->s.heads;
    ra.d = L->s.head_dim; ra.H = L->s.heads; ra.ldz = L->ldz; ra.col_g = L->col_g;
    ra.ln = L->s.normalize_readings; ra.gate = L->s.output_gate; ra.eps = L->s.norm_eps;
    ra.ln_w = p->ln_w; ra.ln_b = p->ln_b; ra.z = L->z; ra.fp32 = L->ctype == DT_FP32;
    ra.n_warps = sdm_readout_warps(ra.P);
    ra.rows_per_warp = ceil_div(ra.P, ra.n_warps);
    return ra;
}

// L->b_packed = the input biases in the column order of z (the fused projection's bias), after every change of
// the weights: each training forward; once per reset in inference, where it would cost six copies per token.
static inline void sdm_layer_pack_biases(SdmLayer *L, const SdmLayerParams *p, cudaStream_t st) {
    for (int i = 0; i < SDM_B_COUNT; i++) {
        int col, width;
        sdm_layer_bias_block(L, i, &col, &width);
        if (width)
            cudaCheck(cudaMemcpyAsync((void *)dtype_elem_ptr(L->b_packed, col, L->ctype), p->b_in[i],
                                      (size_t)width * dtype_size(L->ctype), cudaMemcpyDeviceToDevice, st));
    }
}

// z = x W_inᵀ + b (the fused projection, biases packed by sdm_layer_pack_biases), then the gates, values and both
// top-k selections with their weights, for the L->B * L->T tokens of x [B,T,D].
static inline void sdm_layer_address(SdmLayer *L, const SdmLayerParams *p, const void *x, cudaStream_t st) {
    const SdmDims *s = &L->s;
    int BT = L->B * L->T, H = s->heads, P = BT * H, D = s->dim;
    bool f32 = L->ctype == DT_FP32;
    matmul_forward(L->z, L->ctype, L->ldz, x, p->w_in, L->b_packed, L->ctype, BT, L->n_in, D, st);
    sdm_layer_mark(L, SDM_EV_F_PROJ, st);
    cudaStream_t rs = st; // the read top-k's stream
    if (L->side) {
        cudaCheck(cudaEventRecord(L->fork, st));
        cudaCheck(cudaStreamWaitEvent(L->side, L->fork, 0));
        rs = L->side;
    }
    sdm_topk_forward(&L->tr, L->z, L->ctype, L->ldz, L->col_zq, H, P, s->read_scale, NULL, 0, L->rslot, L->rho, NULL,
                     NULL, rs);
    sdm_unpack_kernel<<<BT, 256, 0, st>>>(L->z, f32, L->ldz, L->col_v, L->col_a, L->col_c, D, H, p->A_log, p->dt_bias,
                                      L->v, L->g, L->beta);
    cudaCheckLast();
    sdm_topk_forward(&L->tw, L->z, L->ctype, L->ldz, L->col_zk, H, P, s->write_scale, L->g, s->key_weighted_decay, L->wslot,
                 L->kappa, NULL, L->gamma, st);
    if (L->side) {
        cudaCheck(cudaEventRecord(L->join, L->side));
        cudaCheck(cudaStreamWaitEvent(st, L->join, 0));
    }
    sdm_layer_mark(L, SDM_EV_F_TOPK, st);
}

// y [B,T,D] = Wo · readout(the op readings L->o) + bo.
static inline void sdm_layer_output(SdmLayer *L, const SdmLayerParams *p, void *y, cudaStream_t st) {
    SdmReadoutArgs ra = sdm_layer_readout_args(L, p);
    sdm_readout_forward(&ra, L->o, L->r, L->ln_mean, L->ln_rstd, st);
    sdm_layer_mark(L, SDM_EV_F_READOUT, st);
    int BT = L->B * L->T, D = L->s.dim;
    matmul_forward(y, L->ctype, D, L->r, p->w_out, p->b_out, L->ctype, BT, D, D, st);
    sdm_layer_mark(L, SDM_EV_F_OUT, st);
}

// Training forward: y [B,T,D] = the layer of x [B,T,D] (both compute dtype); saves what the backward needs.
static inline void sdm_layer_forward(SdmLayer *L, const SdmLayerParams *p, const void *x, void *y, cudaStream_t st) {
    const SdmDims *s = &L->s;
    sdm_layer_mark(L, SDM_EV_F0, st);
    sdm_layer_pack_biases(L, p, st);
    sdm_layer_address(L, p, x, st);
    sdm_bank_init(L->bank, sdm_bank_dtype(s), s->learned_bank ? p->bank0 : NULL, L->ctype,
              (size_t)s->heads * s->slots * s->head_dim, L->B, st);
    sdm_layer_mark(L, SDM_EV_F_BANK, st);
    SdmOpInputs in = sdm_layer_op_inputs(L);
    sdm_op_forward(&L->op, &in, L->bank, L->o, L->saved, st);
    sdm_layer_mark(L, SDM_EV_F_OP, st);
    sdm_layer_output(L, p, y, st);
}

// Backward after sdm_layer_forward on the same x: dx [B,T,D] (compute dtype) is overwritten, every parameter
// gradient in g is accumulated. Consumes the forward's saved state (the op restores the bank; z becomes dz), so it
// runs once per forward.
static inline void sdm_layer_backward(SdmLayer *L, const SdmLayerParams *p, const void *x, const void *dy,
                                      void *dx, const SdmLayerGrads *g, cudaStream_t st) {
    const SdmDims *s = &L->s;
    int BT = L->B * L->T, H = s->heads, P = BT * H, D = s->dim, d = s->head_dim;
    bool f32 = L->ctype == DT_FP32;
    void *dz = L->z; // in place: each gradient entry overwrites the forward value only its own thread still reads
    sdm_layer_mark(L, SDM_EV_B0, st);
    // output projection
    matmul_backward_weight(g->w_out, DT_FP32, dy, D, L->r, L->ctype, BT, D, D, 1, st);
    matmul_backward_bias(g->b_out, dy, L->ctype, D, BT, D, 1, st);
    matmul_backward_input(L->dr, DT_FP32, dy, D, p->w_out, L->ctype, BT, D, D, 0, st);
    sdm_layer_mark(L, SDM_EV_B_OUT, st);
    // readout: gate and LayerNorm; dr becomes the gradient of the op readings in place
    SdmReadoutArgs ra = sdm_layer_readout_args(L, p);
    sdm_readout_backward(&ra, L->o, L->ln_mean, L->ln_rstd, L->dr, dz, L->ln_partials, g->ln_w, g->ln_b, st);
    sdm_layer_mark(L, SDM_EV_B_READOUT, st);
    // the memory op
    SdmOpInputs in = sdm_layer_op_inputs(L);
    SdmOpGrads og;
    og.dkappa = L->dkappa; og.dgamma = L->dgamma; og.dbeta = L->dbeta; og.dv = L->dv; og.drho = L->drho;
    og.dbank_init = L->dbank;
    sdm_op_backward(&L->op, &in, L->bank, L->dr, NULL, &og, L->saved, L->scratch, st);
    sdm_layer_mark(L, SDM_EV_B_OP, st);
    // addressing, gates and values back into dz
    SdmWriteGateArgs ga;
    ga.z = L->z; ga.dgamma = L->dgamma; ga.g = L->g; ga.beta = L->beta; ga.dbeta = L->dbeta;
    ga.A_log = p->A_log; ga.dt_bias = p->dt_bias; ga.kwd = s->key_weighted_decay;
    ga.col_a = L->col_a; ga.col_c = L->col_c; ga.gate_grad = L->gate_grad;
    sdm_address_backward(&L->tw, L->wslot, L->kappa, L->dkappa, s->write_scale, P, H, dz, L->ctype, L->ldz, L->col_zk, 1, &ga,
                     st);
    sdm_address_backward(&L->tr, L->rslot, L->rho, L->drho, s->read_scale, P, H, dz, L->ctype, L->ldz, L->col_zq, 0, NULL,
                     st);
    sdm_pack_dv_kernel<<<BT, 256, 0, st>>>(L->dv, dz, f32, L->ldz, L->col_v, D);
    cudaCheckLast();
    sdm_layer_mark(L, SDM_EV_B_TOPK, st);
    // learned bank and gate parameters
    if (s->learned_bank) {
        if ((uintptr_t)g->bank0 % 16) sdm_die("SDM layer: the M0 gradient must be 16-byte aligned");
        sdm_bank_grad_sum_kernel<<<2112, 256, 0, st>>>(g->bank0, L->dbank, (size_t)H * s->slots * d, L->B);
        cudaCheckLast();
    }
    matmul_colsum(g->dt_bias, L->gate_grad, DT_FP32, 3 * H, BT, H, 1, st);
    matmul_colsum(g->A_log, L->gate_grad + 2 * H, DT_FP32, 3 * H, BT, H, 1, st);
    sdm_layer_mark(L, SDM_EV_B_SUMS, st);
    // input projection
    matmul_backward_weight(g->w_in, DT_FP32, dz, L->ldz, x, L->ctype, BT, L->n_in, D, 1, st);
    // input biases: ba and bb from the fp32 gate gradients, the others from dz
    for (int i = 0; i < SDM_B_COUNT; i++) {
        int col, width;
        sdm_layer_bias_block(L, i, &col, &width);
        if (i == SDM_B_A || i == SDM_B_B)
            matmul_colsum(g->b_in[i], L->gate_grad + (i == SDM_B_A ? 0 : H), DT_FP32, 3 * H, BT, H, 1, st);
        else if (width)
            matmul_backward_bias(g->b_in[i], dtype_elem_ptr(dz, col, L->ctype), L->ctype, L->ldz, BT, width, 1, st);
    }
    matmul_backward_input(dx, L->ctype, dz, L->ldz, p->w_in, L->ctype, BT, L->n_in, D, 0, st);
    sdm_layer_mark(L, SDM_EV_B_IN, st);
}

// Stage times (ms) of the last forward+backward when timing is on: [0] projections (both GEMM groups, forward and
// backward), [1] top-k and addressing (gates, softmax, routing), [2] the memory op, [3] the rest (bank copy and
// dM0, readout, gate sums), [4] forward total, [5] backward total. Synchronises on the last event.
static inline void sdm_layer_stage_ms(SdmLayer *L, float *ms) {
    if (!L->timing) sdm_die("sdm_layer_stage_ms: the layer was created without timing");
    cudaCheck(cudaEventSynchronize(L->ev[SDM_EV_B_IN]));
    float t[SDM_LAYER_EVENTS];
    for (int i = 1; i < SDM_LAYER_EVENTS; i++)
        if (i != SDM_EV_B0) cudaCheck(cudaEventElapsedTime(&t[i], L->ev[i - 1], L->ev[i]));
    ms[0] = t[SDM_EV_F_PROJ] + t[SDM_EV_F_OUT] + t[SDM_EV_B_OUT] + t[SDM_EV_B_IN];
    ms[1] = t[SDM_EV_F_TOPK] + t[SDM_EV_B_TOPK];
    ms[2] = t[SDM_EV_F_OP] + t[SDM_EV_B_OP];
    ms[3] = t[SDM_EV_F_BANK] + t[SDM_EV_F_READOUT] + t[SDM_EV_B_READOUT] + t[SDM_EV_B_SUMS];
    cudaCheck(cudaEventElapsedTime(&ms[4], L->ev[SDM_EV_F0], L->ev[SDM_EV_F_OUT]));
    cudaCheck(cudaEventElapsedTime(&ms[5], L->ev[SDM_EV_B0], L->ev[SDM_EV_B_IN]));
}

#endif
