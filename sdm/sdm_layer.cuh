// sdm/sdm_layer.cuh: the SDM layer on the GPU around the memory op (docs/SDM.md#layer-overview): the fused input
// projection, the calls to the addressing (gates, values, top-k: sdm/sdm_topk.cuh), the bank copy from M0
// (sdm/sdm_bank.cuh), the memory op (sdm/sdm_op.cuh) and the readout (sdm/sdm_readout.cuh), then the output
// projection; the training API (sdm_layer_create / forward / backward). Inference state: sdm/sdm_infer.cuh.
// Layout follows sdm/sdm_ref.h and sdm/sdm_op.h: token-major [B,T,H,...] per-token per-head arrays; a "problem"
// p = token*H + h is one token and head. Precision: parameters, activations and matmul inputs in the layer's
// compute dtype (bf16, or fp32 for the all-fp32 test mode); gates, weights, scores, LayerNorm statistics, the op's
// inputs/outputs and every parameter gradient in fp32. No floating-point atomics anywhere.
// Memory: what lives only inside one pass (the backward's gradients and op scratch, the per-sequence bank gradients,
// the forward's fp32 values) is an SdmLayerTemps that a model's layers share. With `recompute` the readout output r
// is not kept either: the backward rebuilds it from the op readings with the forward's own kernel (same bits).
#ifndef SDM_SDM_LAYER_CUH
#define SDM_SDM_LAYER_CUH

#include "core/cuda_common.cuh"
#include "core/matmul.cuh"
#include "core/profile.cuh"
#include "sdm/sdm_bank.cuh"
#include "sdm/sdm_common.cuh"
#include "sdm/sdm_dims.h"
#include "sdm/sdm_op.cuh"
#include "sdm/sdm_readout.cuh"
#include "sdm/sdm_topk.cuh"

// =================================================================================================================
// The values' gradient: dz[tok, col_v : col_v + D] = dv[tok, :] (the op's value gradient into the fused projection's
// gradient). The gates and values themselves come with the addressing (sdm/sdm_topk.cuh).
// =================================================================================================================

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

// Stage ends, marked in the step profile (core/profile.cuh) when the layer has a profiler; each stage belongs to
// one of the parts below (sdm_layer_stage_work).
enum { SDM_EV_F_PROJ, SDM_EV_F_TOPK, SDM_EV_F_BANK, SDM_EV_F_WY, SDM_EV_F_OP, SDM_EV_F_READOUT, SDM_EV_F_OUT,
       SDM_EV_B_OUT, SDM_EV_B_READOUT, SDM_EV_B_OP, SDM_EV_B_WY, SDM_EV_B_TOPK, SDM_EV_B_SUMS, SDM_EV_B_IN };
#define SDM_PART_PROJ "SDM projections"   // the fused input GEMM and Wo, forward and backward
#define SDM_PART_ADDRESS "SDM addressing" // gates, values, product-key top-k and weights, and their backward
#define SDM_PART_BANK "SDM bank, sums"    // bank copies of M0, the dM0 batch sum, the gate parameters' sums
#define SDM_PART_OP_WY "SDM op WY"           // the op's per-chunk work without bank rows: phase 1, bwy
#define SDM_PART_OP_FWD "SDM op forward"      // the op's chunk loop over the bank rows
#define SDM_PART_OP_BWD "SDM op backward"
#define SDM_PART_READOUT "SDM readout"     // readings LayerNorm and output gate, forward and backward

// Temporaries of one layer pass, shareable by every layer of one shape (they hold nothing between passes).
typedef struct {
    float *v;            // [BT, D] the op's values: read by the forward's op only
    void *r;             // [BT, D] compute dtype, the readout output (recompute only, else NULL)
    void *scratch;       // sdm_op_scratch_bytes
    float *dr;           // [BT, D] dY Wo, then (in place) the gradient of the op readings
    float *dkappa, *dgamma, *dbeta, *dv, *drho; // op gradients
    void *dbank;         // [B, H, N, d] per-sequence bank gradients, sdm_bank_grad_dtype (fp32 or bf16)
    float *gate_grad;    // [BT, 3H]: da, dc, dg * g in fp32
    float *ln_partials;  // [2, sdm_readout_warps, d]
} SdmLayerTemps;

typedef struct {
    SdmDims s;
    int B, T;
    Dtype ctype;         // compute dtype: DT_FP32 in the all-fp32 mode, else DT_BF16
    int recompute;       // r is rebuilt by the backward instead of kept
    SdmOpShape op;
    SdmTopkPlan tw, tr;     // write / read top-k
    int n_in, ldz;       // fused projection width and its row stride (multiple of 8)
    int col_zk, col_zq, col_v, col_a, col_c, col_g;
    // saved by the forward for the backward
    void *b_packed;      // [n_in] compute dtype: the input biases packed in the column order of z
    void *z;             // [BT, ldz] compute dtype: zK | zQ | v | a | c (| zG); the backward overwrites it with dz
    float *v, *g, *beta; // [BT, D] (training: tmp.v), [BT, H], [BT, H]
    int *wslot, *rslot;  // [BT, H, W], [BT, H, R]
    float *kappa, *gamma, *rho;
    void *bank;          // [B, H, N, d] bank dtype; final bank after the forward (the backward reads it)
    float *o;            // [BT, D] op readings
    float *ln_mean, *ln_rstd; // [BT, H]
    void *r;             // [BT, D] compute dtype, the input of Wo (recompute: tmp.r)
    void *saved;         // sdm_op_saved_bytes
    SdmLayerTemps tmp;   // training: the layer's own temporaries, or shared ones (owns_tmp = 0)
    int owns_tmp;
    Profiler *prof;      // NULL: not profiled
} SdmLayer;

// NULL when the GPU layer supports the configuration, else the reason.
static inline const char *sdm_layer_check(const SdmDims *s) {
    if (s->write_act != SDM_ACT_SOFTMAX || s->read_act != SDM_ACT_SOFTMAX)
        return "the GPU layer implements only the softmax weight activation (write_act / read_act)";
    if (s->heads < 1 || s->dim % s->heads != 0 || s->head_dim != s->dim / s->heads) return "D must equal H * d";
    if (s->head_dim > SDM_RO_MAX_D || s->head_dim % 4 != 0) return "head dim d must be a multiple of 4, at most 2048";
    return NULL;
}

// The memory op's shape inside a layer for B sequences of T tokens.
static inline SdmOpShape sdm_layer_op_shape(const SdmDims *s, int B, int T, int training) {
    SdmOpShape op;
    memset(&op, 0, sizeof(op)); // fields not set here (the forward path) keep their defaults
    op.B = B; op.T = T; op.H = s->heads; op.N = s->slots; op.d = s->head_dim; op.W = s->writes; op.R = s->reads;
    op.C = s->chunk; op.bank_fp32 = s->bank_fp32; op.snapshot = s->snapshot; op.training = training;
    op.grad_bank_bf16 = s->grad_bank_bf16;
    return op;
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
    L.op = sdm_layer_op_shape(s, B, T, training);
    if ((why = sdm_op_check(&L.op))) sdm_die("SDM layer: memory op: %s", why);
    L.tw = sdm_topk_plan_make(s, s->writes);
    L.tr = sdm_topk_plan_make(s, s->reads);
    L.col_zk = 0; L.col_zq = HK; L.col_v = 2 * HK; L.col_a = 2 * HK + D; L.col_c = L.col_a + H;
    L.col_g = L.col_c + H;
    L.n_in = L.col_g + (s->output_gate ? D : 0);
    L.ldz = (L.n_in + 7) & ~7;
    return L;
}

// Whether v / r are L->tmp's (training; r only with recompute) rather than the layer's own (inference).
static inline int sdm_layer_v_is_temp(const SdmLayer *L) { return L->op.training; }
static inline int sdm_layer_r_is_temp(const SdmLayer *L) { return L->op.training && L->recompute; }

// The per-token buffers of the forward for L->B * L->T tokens (all but the bank and the op's saved state).
static inline void sdm_layer_alloc_forward(SdmLayer *L) {
    const SdmDims *s = &L->s;
    size_t BT = (size_t)L->B * L->T, P = BT * s->heads, D = s->dim, W = s->writes, R = s->reads;
    size_t cs = dtype_size(L->ctype);
    L->b_packed = device_alloc(MEM_ACTIVATIONS, (size_t)L->n_in * cs);
    L->z = device_alloc(MEM_ACTIVATIONS, BT * L->ldz * cs);
    L->v = sdm_layer_v_is_temp(L) ? L->tmp.v : (float *)device_alloc(MEM_ACTIVATIONS, BT * D * 4);
    L->g = (float *)device_alloc(MEM_ACTIVATIONS, P * 4);
    L->beta = (float *)device_alloc(MEM_ACTIVATIONS, P * 4);
    L->wslot = (int *)device_alloc(MEM_ACTIVATIONS, P * W * 4);
    L->kappa = (float *)device_alloc(MEM_ACTIVATIONS, P * W * 4);
    L->gamma = (float *)device_alloc(MEM_ACTIVATIONS, P * W * 4);
    L->rslot = (int *)device_alloc(MEM_ACTIVATIONS, P * R * 4);
    L->rho = (float *)device_alloc(MEM_ACTIVATIONS, P * R * 4);
    L->o = (float *)device_alloc(MEM_ACTIVATIONS, BT * D * 4);
    if (s->normalize_readings) {
        L->ln_mean = (float *)device_alloc(MEM_ACTIVATIONS, P * 4);
        L->ln_rstd = (float *)device_alloc(MEM_ACTIVATIONS, P * 4);
    }
    L->r = sdm_layer_r_is_temp(L) ? L->tmp.r : device_alloc(MEM_ACTIVATIONS, BT * D * cs);
}

// Temporaries for training layers of B sequences of T tokens; with recompute also the shared readout output r.
static inline SdmLayerTemps sdm_layer_temps_create(const SdmDims *s, int B, int T, Dtype ctype, int recompute) {
    size_t BT = (size_t)B * T, P = BT * s->heads, D = s->dim, W = s->writes, R = s->reads;
    SdmOpShape op = sdm_layer_op_shape(s, B, T, 1);
    SdmLayerTemps t;
    memset(&t, 0, sizeof t);
    t.v = (float *)device_alloc(MEM_SCRATCH, BT * D * 4);
    if (recompute) t.r = device_alloc(MEM_SCRATCH, BT * D * dtype_size(ctype));
    t.scratch = device_alloc(MEM_SCRATCH, sdm_op_scratch_bytes(&op));
    t.dr = (float *)device_alloc(MEM_SCRATCH, BT * D * 4);
    t.dkappa = (float *)device_alloc(MEM_SCRATCH, P * W * 4);
    t.dgamma = (float *)device_alloc(MEM_SCRATCH, P * W * 4);
    t.dbeta = (float *)device_alloc(MEM_SCRATCH, P * 4);
    t.dv = (float *)device_alloc(MEM_SCRATCH, BT * D * 4);
    t.drho = (float *)device_alloc(MEM_SCRATCH, P * R * 4);
    t.dbank = device_alloc(MEM_BANK_GRADS,
                           (size_t)B * s->heads * s->slots * s->head_dim * dtype_size(sdm_bank_grad_dtype(s)));
    t.gate_grad = (float *)device_alloc(MEM_SCRATCH, BT * 3 * s->heads * 4);
    if (s->normalize_readings)
        t.ln_partials = (float *)device_alloc(MEM_SCRATCH, 2 * (size_t)sdm_readout_warps((int)P) * s->head_dim * 4);
    return t;
}

static inline void sdm_layer_temps_destroy(SdmLayerTemps *t) {
    void *bufs[] = {t->v, t->r, t->scratch, t->dr, t->dkappa, t->dgamma, t->dbeta, t->dv, t->drho, t->dbank,
                    t->gate_grad, t->ln_partials};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) device_free(bufs[i]);
    memset(t, 0, sizeof *t);
}

// A training layer for B sequences of T tokens, marked in prof (NULL: not profiled). shared: temporaries from
// sdm_layer_temps_create for this shape and the same `recompute` (one set serves every layer of a model), or NULL for
// the layer's own.
static inline SdmLayer sdm_layer_create(const SdmDims *s, int B, int T, Dtype ctype, Profiler *prof, int recompute,
                                        const SdmLayerTemps *shared) {
    SdmLayer L = sdm_layer_setup(s, B, T, ctype, 1);
    L.recompute = recompute;
    L.owns_tmp = shared == NULL;
    L.tmp = shared ? *shared : sdm_layer_temps_create(s, B, T, ctype, recompute);
    sdm_layer_alloc_forward(&L);
    L.bank = device_alloc(MEM_SDM_SAVED, B * sdm_bank_bytes(s));
    L.saved = device_alloc(MEM_SDM_SAVED, sdm_op_saved_bytes(&L.op));
    L.prof = prof;
    return L;
}

static inline void sdm_layer_destroy(SdmLayer *L) {
    void *bufs[] = {L->b_packed, L->z, sdm_layer_v_is_temp(L) ? NULL : L->v, L->g, L->beta, L->wslot, L->kappa,
                    L->gamma, L->rslot, L->rho, L->bank, L->o, L->ln_mean, L->ln_rstd,
                    sdm_layer_r_is_temp(L) ? NULL : L->r, L->saved};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) device_free(bufs[i]);
    if (L->owns_tmp) sdm_layer_temps_destroy(&L->tmp);
    sdm_topk_plan_free(&L->tw);
    sdm_topk_plan_free(&L->tr);
    memset(L, 0, sizeof(*L));
}

// The step-profile part of stage `ev` and its work for the part's floor: the GEMMs' FLOPs; the bytes the bank
// copies, the op (sdm_op_floor_bytes) and the readout must move. The addressing's work is not counted (n/a).
static inline const char *sdm_layer_stage_work(const SdmLayer *L, int ev, double *flops, double *bytes) {
    const SdmDims *s = &L->s;
    double BT = (double)L->B * L->T, D = s->dim, cs = (double)dtype_size(L->ctype);
    double proj_in = 2 * BT * D * L->n_in, proj_out = 2 * BT * D * D, bank = (double)sdm_bank_bytes(s);
    double m0 = (double)s->heads * s->slots * s->head_dim; // elements of M0
    *flops = *bytes = 0;
    switch (ev) {
    case SDM_EV_F_PROJ: *flops = proj_in; return SDM_PART_PROJ;
    case SDM_EV_F_OUT: *flops = proj_out; return SDM_PART_PROJ;
    case SDM_EV_B_OUT: *flops = 2 * proj_out; return SDM_PART_PROJ; // dX and dW
    case SDM_EV_B_IN: *flops = 2 * proj_in; return SDM_PART_PROJ;
    case SDM_EV_F_TOPK:
    case SDM_EV_B_TOPK: *flops = *bytes = PROF_NA; return SDM_PART_ADDRESS;
    case SDM_EV_F_BANK: *bytes = L->B * bank + (s->learned_bank ? m0 * cs : 0); return SDM_PART_BANK;
    case SDM_EV_B_SUMS: // dM0 += the batch's bank gradients; the gate gradients' column sums
        *bytes = (s->learned_bank ? L->B * m0 * dtype_size(sdm_bank_grad_dtype(s)) + 2 * m0 * 4 : 0) +
                 BT * 3 * s->heads * 4;
        return SDM_PART_BANK;
    case SDM_EV_F_WY:
    case SDM_EV_B_WY: *flops = *bytes = PROF_NA; return SDM_PART_OP_WY;
    case SDM_EV_F_OP: *bytes = sdm_op_floor_bytes(&L->op, 0); return SDM_PART_OP_FWD;
    case SDM_EV_B_OP: *bytes = sdm_op_floor_bytes(&L->op, 1); return SDM_PART_OP_BWD;
    case SDM_EV_F_READOUT: *bytes = BT * D * (4 + cs); return SDM_PART_READOUT; // fp32 readings in, r out
    default: *bytes = BT * D * 3 * 4; return SDM_PART_READOUT;               // readings and dr in, dr out (fp32)
    }
}

static inline void sdm_layer_mark(SdmLayer *L, int ev, cudaStream_t s) {
    if (!L->prof || !L->prof->on) return;
    double flops, bytes;
    const char *part = sdm_layer_stage_work(L, ev, &flops, &bytes);
    prof_mark(L->prof, part, flops, bytes, s);
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

// The gates, values and both top-k selections with their weights from the fused projection L->z, for the
// L->B * L->T tokens (one launch at decode: sdm/sdm_topk.cuh), with the product `side` (or NULL) in that launch.
static inline void sdm_layer_select(SdmLayer *L, const SdmLayerParams *p, cudaStream_t st,
                                    const SdmTopkSide *side = NULL) {
    const SdmDims *s = &L->s;
    SdmGates gates = {p->A_log, p->dt_bias, L->col_v, L->col_a, L->col_c, s->dim, L->v, L->g, L->beta};
    SdmTopkJob jobs[2] = {
        {&L->tw, L->col_zk, {L->wslot, L->kappa, NULL, L->gamma, L->g, s->key_weighted_decay, s->write_scale}},
        {&L->tr, L->col_zq, {L->rslot, L->rho, NULL, NULL, NULL, 0, s->read_scale}}};
    sdm_topk_forward(jobs, 2, L->z, L->ctype, L->ldz, s->heads, L->B * L->T * s->heads, &gates, st, side);
}

// z = x W_inᵀ + b (the fused projection, biases packed by sdm_layer_pack_biases), then sdm_layer_select, for the
// L->B * L->T tokens of x [B,T,D]; norm: x's input norm (core/matmul_small_m.cuh MatmulParts.norm; x its buffer)
// or NULL.
static inline void sdm_layer_address(SdmLayer *L, const SdmLayerParams *p, const void *x, cudaStream_t st,
                                     const ResidualNorm *norm = NULL) {
    int BT = L->B * L->T, D = L->s.dim;
    matmul_forward(L->z, L->ctype, L->ldz, x, p->w_in, L->b_packed, L->ctype, BT, L->n_in, D, st, norm);
    sdm_layer_mark(L, SDM_EV_F_PROJ, st);
    sdm_layer_select(L, p, st);
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
    sdm_layer_pack_biases(L, p, st);
    sdm_layer_address(L, p, x, st);
    sdm_bank_init(L->bank, sdm_bank_dtype(s), s->learned_bank ? p->bank0 : NULL, L->ctype,
              (size_t)s->heads * s->slots * s->head_dim, L->B, st);
    sdm_layer_mark(L, SDM_EV_F_BANK, st);
    SdmOpInputs in = sdm_layer_op_inputs(L);
    sdm_op_forward_wy(&L->op, &in, L->saved, st);
    sdm_layer_mark(L, SDM_EV_F_WY, st);
    sdm_op_forward_rounds(&L->op, &in, L->bank, L->o, L->saved, st);
    sdm_layer_mark(L, SDM_EV_F_OP, st);
    sdm_layer_output(L, p, y, st);
}

// Backward after sdm_layer_forward on the same x: dx [B,T,D] (compute dtype) is overwritten, every parameter
// gradient in g is accumulated. Consumes the forward's saved state (z becomes dz), so it runs once per
// forward.
static inline void sdm_layer_backward(SdmLayer *L, const SdmLayerParams *p, const void *x, const void *dy,
                                      void *dx, const SdmLayerGrads *g, cudaStream_t st) {
    const SdmDims *s = &L->s;
    int BT = L->B * L->T, H = s->heads, P = BT * H, D = s->dim, d = s->head_dim;
    bool f32 = L->ctype == DT_FP32;
    void *dz = L->z; // in place: each gradient entry overwrites the forward value only its own thread still reads
    SdmReadoutArgs ra = sdm_layer_readout_args(L, p);
    // the readout output again (recompute), before dz overwrites the gate columns it reads
    if (L->recompute) sdm_readout_forward(&ra, L->o, L->r, L->ln_mean, L->ln_rstd, st);
    // output projection
    matmul_backward_weight(g->w_out, DT_FP32, dy, D, L->r, L->ctype, BT, D, D, 1, st);
    matmul_backward_bias(g->b_out, dy, L->ctype, D, BT, D, 1, st);
    matmul_backward_input(L->tmp.dr, DT_FP32, dy, D, p->w_out, L->ctype, BT, D, D, 0, st);
    sdm_layer_mark(L, SDM_EV_B_OUT, st);
    // readout: gate and LayerNorm; dr becomes the gradient of the op readings in place
    sdm_readout_backward(&ra, L->o, L->ln_mean, L->ln_rstd, L->tmp.dr, dz, L->tmp.ln_partials, g->ln_w, g->ln_b, st);
    sdm_layer_mark(L, SDM_EV_B_READOUT, st);
    // the memory op (everything it needs of its inputs was saved by the forward)
    SdmOpGrads og;
    og.dkappa = L->tmp.dkappa; og.dgamma = L->tmp.dgamma; og.dbeta = L->tmp.dbeta; og.dv = L->tmp.dv;
    og.drho = L->tmp.drho; og.dbank_init = L->tmp.dbank;
    sdm_op_backward_rounds(&L->op, L->bank, L->tmp.dr, NULL, &og, L->saved, L->tmp.scratch, st);
    sdm_layer_mark(L, SDM_EV_B_OP, st);
    sdm_op_backward_wy(&L->op, L->tmp.dr, &og, L->saved, L->tmp.scratch, st);
    sdm_layer_mark(L, SDM_EV_B_WY, st);
    // addressing, gates and values back into dz
    SdmWriteGateArgs ga;
    ga.z = L->z; ga.dgamma = L->tmp.dgamma; ga.g = L->g; ga.beta = L->beta; ga.dbeta = L->tmp.dbeta;
    ga.A_log = p->A_log; ga.dt_bias = p->dt_bias; ga.kwd = s->key_weighted_decay;
    ga.col_a = L->col_a; ga.col_c = L->col_c; ga.gate_grad = L->tmp.gate_grad;
    sdm_address_backward(&L->tw, L->wslot, L->kappa, L->tmp.dkappa, s->write_scale, P, H, dz, L->ctype, L->ldz,
                         L->col_zk, 1, &ga, st);
    sdm_address_backward(&L->tr, L->rslot, L->rho, L->tmp.drho, s->read_scale, P, H, dz, L->ctype, L->ldz,
                         L->col_zq, 0, NULL, st);
    sdm_pack_dv_kernel<<<BT, 256, 0, st>>>(L->tmp.dv, dz, f32, L->ldz, L->col_v, D);
    cudaCheckLast();
    sdm_layer_mark(L, SDM_EV_B_TOPK, st);
    // learned bank and gate parameters
    if (s->learned_bank) {
        if ((uintptr_t)g->bank0 % 16) sdm_die("SDM layer: the M0 gradient must be 16-byte aligned");
        sdm_bank_grad_sum(g->bank0, L->tmp.dbank, s->grad_bank_bf16, (size_t)H * s->slots * d, L->B, st);
    }
    matmul_colsum(g->dt_bias, L->tmp.gate_grad, DT_FP32, 3 * H, BT, H, 1, st);
    matmul_colsum(g->A_log, L->tmp.gate_grad + 2 * H, DT_FP32, 3 * H, BT, H, 1, st);
    sdm_layer_mark(L, SDM_EV_B_SUMS, st);
    // input projection
    matmul_backward_weight(g->w_in, DT_FP32, dz, L->ldz, x, L->ctype, BT, L->n_in, D, 1, st);
    // input biases: ba and bb from the fp32 gate gradients, the others from dz
    for (int i = 0; i < SDM_B_COUNT; i++) {
        int col, width;
        sdm_layer_bias_block(L, i, &col, &width);
        if (i == SDM_B_A || i == SDM_B_B)
            matmul_colsum(g->b_in[i], L->tmp.gate_grad + (i == SDM_B_A ? 0 : H), DT_FP32, 3 * H, BT, H, 1, st);
        else if (width)
            matmul_backward_bias(g->b_in[i], dtype_elem_ptr(dz, col, L->ctype), L->ctype, L->ldz, BT, width, 1, st);
    }
    matmul_backward_input(dx, L->ctype, dz, L->ldz, p->w_in, L->ctype, BT, L->n_in, D, 0, st);
    sdm_layer_mark(L, SDM_EV_B_IN, st);
}

#endif
