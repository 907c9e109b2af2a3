// sdm/sdm_infer.cuh: the SDM layer's inference state on the GPU (docs/SDM.md#decode-and-prefill): per-stream banks
// [streams, H, N, d], the prefill of one stream's prompt (chunked forward without saves) and the decode step of every
// stream (one token each, in place), on the training layer's forward buffers (sdm/sdm_layer.cuh).
#ifndef SDM_SDM_INFER_CUH
#define SDM_SDM_INFER_CUH

#include "sdm/sdm_layer.cuh"

// =================================================================================================================
// Inference (docs/SDM.md#decode-and-prefill): each stream's bank persists between calls. A prefill runs one stream's
// prompt through the op's chunked forward without saves (training = 0) and leaves the final bank as the decode state; a
// decode step applies docs/SDM.md#the-recurrence to one token of every stream in place (sdm_op_decode). Both reuse the
// training forward's projections, top-k and readout on the first rows of the state's buffers.
// =================================================================================================================

typedef struct {
    SdmLayer L;         // forward buffers for up to `rows` tokens (no backward buffers); L.B, L.T: the current call
    int streams, rows;  // rows = max(max_tokens, streams)
    void *banks;        // [streams, H, N, d] bank dtype: each stream's memory
    size_t saved_bytes; // size of L.saved, the prefill op's scratch
} SdmInferState;

// A one-stream bf16 decode step runs the output gate's columns of the input product in the addressing's launch (1,
// the default: the flagship layer's batch-1 step 30.4 -> 28.1 us and the model's 1.195 -> 1.179 ms on an H100), or
// with the other columns (0; SDM_GATE_FUSED=0 builds it; the tests compare the two).
#ifndef SDM_GATE_FUSED
#define SDM_GATE_FUSED 1
#endif
static int g_sdm_gate_fused = SDM_GATE_FUSED;

// State for `streams` streams and prompts of up to max_tokens tokens; call sdm_infer_reset before use.
static inline SdmInferState sdm_infer_create(const SdmDims *s, int streams, int max_tokens, Dtype ctype) {
    SdmInferState I;
    memset(&I, 0, sizeof I);
    I.streams = streams;
    I.rows = SDM_MAX(max_tokens, streams);
    I.L = sdm_layer_setup(s, 1, I.rows, ctype, 0);
    sdm_layer_alloc_forward(&I.L);
    I.saved_bytes = sdm_op_saved_bytes(&I.L.op);
    I.L.saved = device_alloc(MEM_SCRATCH, I.saved_bytes);
    I.banks = device_alloc(MEM_SDM_SAVED, (size_t)streams * sdm_bank_bytes(s));
    return I;
}

static inline void sdm_infer_destroy(SdmInferState *I) {
    device_free(I->banks);
    sdm_layer_destroy(&I->L);
    memset(I, 0, sizeof *I);
}

static inline void *sdm_infer_bank(const SdmInferState *I, int b) {
    return (char *)I->banks + (size_t)b * sdm_bank_bytes(&I->L.s);
}

// Stream b's bank (b < 0: every stream's) = a copy of the learned M0, or zeros without a learned bank
// (docs/SDM.md#the-bank); also packs the input biases of p, which the prefills and decode steps then use.
static inline void sdm_infer_reset(SdmInferState *I, const SdmLayerParams *p, int b, cudaStream_t st) {
    const SdmDims *s = &I->L.s;
    sdm_bank_init(b < 0 ? I->banks : sdm_infer_bank(I, b), sdm_bank_dtype(s), s->learned_bank ? p->bank0 : NULL,
                  I->L.ctype, (size_t)s->heads * s->slots * s->head_dim, b < 0 ? I->streams : 1, st);
    sdm_layer_pack_biases(&I->L, p, st);
}

// The buffers' first B*T rows describe this call.
static inline void sdm_infer_shape(SdmInferState *I, int B, int T) {
    if (B * T > I->rows) sdm_die("SDM inference: %d tokens exceed the state's %d rows", B * T, I->rows);
    I->L.B = I->L.op.B = B;
    I->L.T = I->L.op.T = T;
}

// Prefill of stream b: y [T, D] = the layer of its prompt's x [T, D] (compute dtype), continuing from the stream's
// bank (a fresh copy of M0 after sdm_infer_reset) and leaving it after the last token.
static inline void sdm_infer_prefill(SdmInferState *I, const SdmLayerParams *p, int b, const void *x, void *y, int T,
                                     cudaStream_t st) {
    sdm_infer_shape(I, 1, T);
    if (sdm_op_saved_bytes(&I->L.op) > I->saved_bytes)
        sdm_die("SDM inference: prefill scratch too small for T = %d", T);
    sdm_layer_address(&I->L, p, x, st);
    SdmOpInputs in = sdm_layer_op_inputs(&I->L);
    sdm_op_forward(&I->L.op, &in, sdm_infer_bank(I, b), I->L.o, I->L.saved, st);
    sdm_layer_output(&I->L, p, y, st);
}

// Decode step of streams 0..n-1: y [n, D] = the layer of one new token per stream x [n, D]; norm: x's input norm
// (core/matmul_small_m.cuh MatmulParts.norm; x its buffer, read by the input product alone) or NULL.
// The output gate's columns of the input product (a third of its weights: D of 2HK + 2D + 2H) are read by the
// readout alone. Where the GEMV takes the product (one bf16 row), they run in the addressing's launch, in blocks of
// their own beside its few blocks (one a problem), so that the chain of dependent kernels a token waits for reads
// two thirds of the weights; the same GEMV code, so the same bits.
static inline void sdm_infer_decode(SdmInferState *I, const SdmLayerParams *p, const void *x, const ResidualNorm *norm,
                                    void *y, int n, cudaStream_t st) {
    if (n < 1 || n > I->streams) sdm_die("SDM inference: a decode step of %d of %d streams", n, I->streams);
    sdm_infer_shape(I, n, 1);
    SdmLayer *L = &I->L;
    const int D = L->s.dim;
    const bool fuse = g_sdm_gate_fused && L->s.output_gate && L->ctype == DT_BF16 &&
                      matmul_small_m_kernel(DT_BF16, n, L->n_in, D, 1, (uintptr_t)x | (uintptr_t)p->w_in) ==
                          MATMUL_KERNEL_GEMV;
    if (fuse) {
        const size_t g0 = (size_t)L->col_g * 2; // bytes before the gate's columns (bf16)
        matmul_forward(L->z, DT_BF16, L->ldz, x, p->w_in, L->b_packed, DT_BF16, 1, L->col_g, D, st, norm);
        SdmTopkSide side = {(const char *)p->w_in + g0 * D, x, (const char *)L->b_packed + g0, (char *)L->z + g0,
                            L->n_in - L->col_g, D};
        sdm_layer_select(L, p, st, &side);
    } else {
        sdm_layer_address(L, p, x, st, norm);
    }
    SdmOpInputs in = sdm_layer_op_inputs(L);
    sdm_op_decode(&L->op, &in, I->banks, L->o, st);
    sdm_layer_output(L, p, y, st);
}

// Stream `to`'s bank = stream `from`'s (a generator compacting its active streams).
static inline void sdm_infer_copy_stream(SdmInferState *I, int from, int to, cudaStream_t st) {
    cudaCheck(cudaMemcpyAsync(sdm_infer_bank(I, to), sdm_infer_bank(I, from), sdm_bank_bytes(&I->L.s),
                              cudaMemcpyDeviceToDevice, st));
}

#endif
