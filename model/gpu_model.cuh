// model/gpu_model.cuh: the hybrid model (docs/MODEL.md) on the GPU, shared by train_sdm and infer_sdm: its flat
// parameter, gradient and optimizer arrays, the activations the backward needs, and the forward and backward passes
//   h0 = E[token];  h' = h + Mixer_l(RMSNorm_a(h));  h+ = h' + FFN(RMSNorm_b(h'));  logits = W_out . RMSNorm_f(h^L)
// with the mixers of attention/attention_layer.cuh and sdm/sdm_layer.cuh. Weights live in one flat array in the
// order of the model's parameter table (model/model.h), so a tensor is found by name.
#ifndef SDM_CORE_GPU_MODEL_CUH
#define SDM_CORE_GPU_MODEL_CUH

#include "attention/attention_layer.cuh"
#include "model/adamw.cuh"
#include "core/layers.cuh"
#include "core/loss.cuh"
#include "core/matmul.cuh"
#include "core/sampling.cuh"
#include "model/model.h"
#include "core/shard.h"
#include "sdm/sdm_infer.cuh"
#include "sdm/sdm_layer.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Small kernels

// out[i] = in[i] in the compute dtype: the working weights from the fp32 master weights.
template <typename T> __global__ void core_cast_kernel(T *out, const float *in, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = dtype_from_float<T>(in[i]);
}

static inline void gm_cast_to_work(void *out, const float *in, long long n, Dtype dtype, cudaStream_t s) {
    int blocks = (int)SDM_MIN(65536LL, (n + 255) / 256);
    DTYPE_DISPATCH(dtype, "gm_cast_to_work", core_cast_kernel<T><<<blocks, 256, 0, s>>>((T *)out, in, n));
    cudaCheckLast();
}

// pred[i] = argmax_v logits[i, v] (first maximum), one warp per row: the greedy next-token predictions.
template <typename T> __global__ void core_argmax_kernel(int *pred, const T *logits, int ld, int V, int n) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= n) return;
    float best = -INFINITY;
    int arg = 0;
    for (int v = lane; v < V; v += 32) {
        float x = dtype_to_float(logits[(size_t)row * ld + v]);
        if (x > best) { best = x; arg = v; }
    }
    for (int off = 16; off; off /= 2) {
        float ob = __shfl_xor_sync(0xffffffffu, best, off);
        int oa = __shfl_xor_sync(0xffffffffu, arg, off);
        if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
    }
    if (lane == 0) pred[row] = arg;
}

// ------------------------------------------------------------------------------------------------------------------
// The model on the GPU

typedef struct {
    const ModelDesc *m;
    int B, T, n, L, D, F, V, Vp; // n = B*T tokens; Vp: logits row stride (V rounded up to 8)
    Dtype ctype;                 // compute dtype: bf16, or fp32 in the exact mode
    size_t es;                   // its size in bytes
    long long padded;            // flat parameter storage padded to world shards (core/shard.h)
    // parameters, gradients, optimizer state: flat arrays in the model's table order
    float *master, *grads, *adam_m, *adam_v; // fp32 [padded]
    void *work;                              // compute dtype [padded]: the weights the layers read
    // activations saved for the backward (compute dtype unless noted)
    void *h;                          // [L+1][n, D] the residual stream entering block l; h[L] leaves the last
    void *hmid;                       // [L][n, D] after the mixer's residual add
    void *xmix, *xffn;                // [L][n, D] RMSNorm outputs: the mixer's and the FFN's inputs
    float *rstd_mix, *rstd_ffn;       // [L][n]
    void *ffn_ab;                     // [L][n, 2F] the fused W1|W3 product
    void *ffn_h;                      // [L][n, F] silu(a) * b
    void *xfinal;                     // [n, D]
    float *rstd_final;                // [n]
    void *logits;                     // [n, Vp], overwritten by dlogits in training
    float *losses, *loss;             // [n], [1] mean
    int *tokens, *targets;            // device [n]
    int *pred;                        // device [n] greedy predictions (evaluation)
    // scratch
    void *branch;                     // [n, D] a mixer or FFN output; in the backward a norm's output gradient
    void *dh;                         // [n, D] gradient of the residual stream
    void *dffn_h;                     // [n, F]
    float *norm_scratch;              // rmsnorm_backward's column partials
    float *clip_sumsq, *clip_norm, *clip_scale, *norm_scratch2; // optimizer step scalars and scratch
    EmbeddingBackwardPlan emb_plan;
    SdmLayer *sdm;                    // [L], used for SDM layers
    AttnLayer *attn;                  // [L], used for attention layers
} GpuModel;

static inline void *gpu_alloc(size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

// Parameter `suffix` of layer l (l < 0: a top-level tensor) in the working weights / fp32 gradients.
static inline void *gm_weight(const GpuModel *g, int l, const char *suffix) {
    const ParamSpec *p = l >= 0 ? model_layer_param(g->m, l, suffix) : model_find(g->m, suffix);
    return p ? (char *)g->work + p->offset * g->es : NULL;
}

static inline float *gm_grad(const GpuModel *g, int l, const char *suffix) {
    const ParamSpec *p = l >= 0 ? model_layer_param(g->m, l, suffix) : model_find(g->m, suffix);
    return p ? g->grads + p->offset : NULL;
}

// row i of a per-layer activation stack of rows x width elements
static inline void *gm_at(const GpuModel *g, void *stack, int layer, size_t width) {
    return (char *)stack + (size_t)layer * g->n * width * g->es;
}

static const char *const SDM_BIAS_NAMES[SDM_B_COUNT] = {"sdm.bk", "sdm.bq", "sdm.bv", "sdm.ba", "sdm.bb", "sdm.bg"};

// The SDM layer's tensors of one layer as S (SdmLayerParams: working weights, or SdmLayerGrads: fp32 gradients),
// each found by `at(name)`. The input weights wk..wg are adjacent in the table (one fused GEMM); the biases each
// follow an alignment gap, so they are passed one by one.
template <typename S, typename At> static inline S gm_sdm_tensors(At at) {
    S t;
    t.w_in = at("sdm.wk");
    for (int i = 0; i < SDM_B_COUNT; i++) t.b_in[i] = at(SDM_BIAS_NAMES[i]);
    t.A_log = at("sdm.A_log");
    t.dt_bias = at("sdm.dt_bias");
    t.ln_w = at("sdm.ln_w");
    t.ln_b = at("sdm.ln_b");
    t.w_out = at("sdm.wo");
    t.b_out = at("sdm.bo");
    t.bank0 = at("sdm.bank");
    return t;
}

static inline SdmLayerParams gm_sdm_params(const GpuModel *g, int l) {
    return gm_sdm_tensors<SdmLayerParams>([&](const char *name) { return (const void *)gm_weight(g, l, name); });
}

static inline SdmLayerGrads gm_sdm_grads(const GpuModel *g, int l) {
    return gm_sdm_tensors<SdmLayerGrads>([&](const char *name) { return gm_grad(g, l, name); });
}

static inline AttnLayerParams gm_attn_params(const GpuModel *g, int l) {
    AttnLayerParams p = {gm_weight(g, l, "attn.wq"), gm_weight(g, l, "attn.wk"), gm_weight(g, l, "attn.wv"),
                         gm_weight(g, l, "attn.wg"), gm_weight(g, l, "attn.wo")};
    return p;
}

static inline AttnLayerGrads gm_attn_grads(const GpuModel *g, int l) {
    AttnLayerGrads d = {gm_grad(g, l, "attn.wq"), gm_grad(g, l, "attn.wk"), gm_grad(g, l, "attn.wv"),
                        gm_grad(g, l, "attn.wg"), gm_grad(g, l, "attn.wo")};
    return d;
}

// Tensors `second` directly after `first` in layer l (so one GEMM can read both), or die.
static inline void gm_require_adjacent(const ModelDesc *m, int l, const char *first, const char *second) {
    const ParamSpec *a = model_layer_param(m, l, first), *b = model_layer_param(m, l, second);
    if (a && b && a->offset + a->numel != b->offset)
        sdm_die("layer %d: %s and %s are not adjacent in the parameter table (model.dim and the FFN width must be "
                "multiples of %d)", l, first, second, MODEL_ALIGN);
}

static inline void gpu_model_create(GpuModel *g, const ModelDesc *m, int B, int T, Dtype ctype, int world) {
    for (int l = 0; l < m->n_layers; l++) {
        gm_require_adjacent(m, l, "ffn.w1", "ffn.w3");
        const char *sdm_in[] = {"sdm.wk", "sdm.wq", "sdm.wv", "sdm.wa", "sdm.wb", "sdm.wg"};
        for (int i = 0; i + 1 < 6; i++) gm_require_adjacent(m, l, sdm_in[i], sdm_in[i + 1]);
    }
    memset(g, 0, sizeof *g);
    g->m = m;
    g->B = B;
    g->T = T;
    g->n = B * T;
    g->L = m->n_layers;
    g->D = m->dim;
    g->F = m->ffn_hidden;
    g->V = m->vocab;
    g->Vp = (m->vocab + 7) / 8 * 8;
    g->ctype = ctype;
    g->es = dtype_size(g->ctype);
    g->padded = shard_padded(m->storage, world);
    size_t n = (size_t)g->n, D = (size_t)g->D, F = (size_t)g->F, L = (size_t)g->L, P = (size_t)g->padded;

    g->master = (float *)gpu_alloc(P * 4);
    g->grads = (float *)gpu_alloc(P * 4);
    g->adam_m = (float *)gpu_alloc(P * 4);
    g->adam_v = (float *)gpu_alloc(P * 4);
    g->work = gpu_alloc(P * g->es);
    cudaCheck(cudaMemset(g->master, 0, P * 4));
    cudaCheck(cudaMemset(g->grads, 0, P * 4));
    cudaCheck(cudaMemset(g->adam_m, 0, P * 4));
    cudaCheck(cudaMemset(g->adam_v, 0, P * 4));

    g->h = gpu_alloc((L + 1) * n * D * g->es);
    g->hmid = gpu_alloc(L * n * D * g->es);
    g->xmix = gpu_alloc(L * n * D * g->es);
    g->xffn = gpu_alloc(L * n * D * g->es);
    g->rstd_mix = (float *)gpu_alloc(L * n * 4);
    g->rstd_ffn = (float *)gpu_alloc(L * n * 4);
    g->ffn_ab = gpu_alloc(L * n * 2 * F * g->es);
    g->ffn_h = gpu_alloc(L * n * F * g->es);
    g->xfinal = gpu_alloc(n * D * g->es);
    g->rstd_final = (float *)gpu_alloc(n * 4);
    g->logits = gpu_alloc(n * g->Vp * g->es);
    g->losses = (float *)gpu_alloc(n * 4);
    g->loss = (float *)gpu_alloc(4);
    g->tokens = (int *)gpu_alloc(n * 4);
    g->targets = (int *)gpu_alloc(n * 4);
    g->pred = (int *)gpu_alloc(n * 4);
    g->branch = gpu_alloc(n * D * g->es);
    g->dh = gpu_alloc(n * D * g->es);
    g->dffn_h = gpu_alloc(n * F * g->es);
    g->norm_scratch = (float *)gpu_alloc(rmsnorm_backward_scratch_floats(g->n, g->D) * 4);
    g->clip_sumsq = (float *)gpu_alloc(4);
    g->clip_norm = (float *)gpu_alloc(4);
    g->clip_scale = (float *)gpu_alloc(4);
    g->norm_scratch2 = (float *)gpu_alloc(GRAD_NORM_SCRATCH * 4);
    embedding_backward_plan_create(&g->emb_plan, g->n, g->V, g->D);

    g->sdm = (SdmLayer *)sdm_calloc(L, sizeof(SdmLayer));
    g->attn = (AttnLayer *)sdm_calloc(L, sizeof(AttnLayer));
    for (int l = 0; l < g->L; l++) {
        if (m->kind[l] == LAYER_SDM) g->sdm[l] = sdm_layer_create(&m->sdm, B, T, ctype, 0);
        else g->attn[l] = attn_layer_create(&m->attn[l], B, T, g->ctype);
    }
}

static inline void gpu_model_destroy(GpuModel *g) {
    for (int l = 0; l < g->L; l++) {
        if (g->m->kind[l] == LAYER_SDM) sdm_layer_destroy(&g->sdm[l]);
        else attn_layer_destroy(&g->attn[l]);
    }
    free(g->sdm);
    free(g->attn);
    embedding_backward_plan_destroy(&g->emb_plan);
    void *bufs[] = {g->master, g->grads, g->adam_m, g->adam_v, g->work, g->h, g->hmid, g->xmix, g->xffn,
                    g->rstd_mix, g->rstd_ffn, g->ffn_ab, g->ffn_h, g->xfinal, g->rstd_final, g->logits, g->losses,
                    g->loss, g->tokens, g->targets, g->pred, g->branch, g->dh, g->dffn_h, g->norm_scratch,
                    g->clip_sumsq, g->clip_norm, g->clip_scale, g->norm_scratch2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaCheck(cudaFree(bufs[i]));
}

// Master weights from host fp32 [m->storage], and the working copy from them.
static inline void gpu_model_set_params(GpuModel *g, const float *host) {
    cudaCheck(cudaMemcpy(g->master, host, sizeof(float) * g->m->storage, cudaMemcpyHostToDevice));
    gm_cast_to_work(g->work, g->master, g->padded, g->ctype, 0);
}

// Mixer of layer l: y = Mixer(x) (forward, saving what its backward needs).
static inline void gm_mixer_forward(GpuModel *g, int l, const void *x, void *y) {
    if (g->m->kind[l] == LAYER_SDM) {
        SdmLayerParams p = gm_sdm_params(g, l);
        sdm_layer_forward(&g->sdm[l], &p, x, y, 0);
    } else {
        AttnLayerParams p = gm_attn_params(g, l);
        attn_layer_forward(&g->attn[l], &p, x, y, 0);
    }
}

// dx (overwritten) and the mixer's parameter gradients (+=) from dy.
static inline void gm_mixer_backward(GpuModel *g, int l, const void *x, const void *dy, void *dx) {
    if (g->m->kind[l] == LAYER_SDM) {
        SdmLayerParams p = gm_sdm_params(g, l);
        SdmLayerGrads d = gm_sdm_grads(g, l);
        sdm_layer_backward(&g->sdm[l], &p, x, dy, dx, &d, 0);
    } else {
        AttnLayerParams p = gm_attn_params(g, l);
        AttnLayerGrads d = gm_attn_grads(g, l);
        attn_layer_backward(&g->attn[l], &p, &d, x, dy, dx, 0);
    }
}

static inline const char *gm_head_name(const GpuModel *g) { return g->m->tied ? "tok_emb" : "lm_head"; }

// SwiGLU FFN of layer l on n rows: y [n, D] = W2 (silu(a) * b) with a|b [n, 2F] = x W1|W3ᵀ in one GEMM (the two
// are adjacent in the parameter table); ab and hf [n, F] keep the intermediates.
static inline void gm_ffn_forward(const GpuModel *g, int l, const void *x, void *ab, void *hf, void *y, int n,
                                  cudaStream_t st) {
    int D = g->D, F = g->F;
    matmul_forward(ab, g->ctype, 2 * F, x, gm_weight(g, l, "ffn.w1"), NULL, g->ctype, n, 2 * F, D, st);
    swiglu_forward(hf, ab, (char *)ab + F * g->es, 2 * F, g->ctype, n, F, st);
    matmul_forward(y, g->ctype, D, hf, gm_weight(g, l, "ffn.w2"), NULL, g->ctype, n, D, F, st);
}

// Forward over tokens/targets (host int32 [n]). Leaves the mean loss in g->loss; with dscale != 0 the logits are
// overwritten by dscale * d(sum of losses)/d(logits), ready for gpu_model_backward.
static inline void gpu_model_forward(GpuModel *g, const int *tokens, const int *targets, float dscale) {
    const ModelDesc *m = g->m;
    int n = g->n, D = g->D, F = g->F;
    float eps = (float)m->norm_eps;
    cudaCheck(cudaMemcpy(g->tokens, tokens, sizeof(int) * n, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(g->targets, targets, sizeof(int) * n, cudaMemcpyHostToDevice));
    embedding_forward(g->h, gm_weight(g, -1, "tok_emb"), g->tokens, g->ctype, n, D, 0);
    rmsnorm_forward(g->xmix, g->rstd_mix, g->h, gm_weight(g, 0, "mixer_norm"), g->ctype, n, D, eps, 0);
    for (int l = 0; l < g->L; l++) {
        void *h = gm_at(g, g->h, l, D), *hmid = gm_at(g, g->hmid, l, D);
        void *xffn = gm_at(g, g->xffn, l, D), *ab = gm_at(g, g->ffn_ab, l, 2 * F), *hf = gm_at(g, g->ffn_h, l, F);
        gm_mixer_forward(g, l, gm_at(g, g->xmix, l, D), g->branch);
        residual_rmsnorm_forward(hmid, xffn, g->rstd_ffn + (size_t)l * n, h, g->branch, gm_weight(g, l, "ffn_norm"),
                                 g->ctype, n, D, eps, 0);
        gm_ffn_forward(g, l, xffn, ab, hf, g->branch, n, 0);
        int last = l == g->L - 1;
        residual_rmsnorm_forward(gm_at(g, g->h, l + 1, D), last ? g->xfinal : gm_at(g, g->xmix, l + 1, D),
                                 last ? g->rstd_final : g->rstd_mix + (size_t)(l + 1) * n, hmid, g->branch,
                                 last ? gm_weight(g, -1, "norm") : gm_weight(g, l + 1, "mixer_norm"), g->ctype, n, D,
                                 eps, 0);
    }
    matmul_forward(g->logits, g->ctype, g->Vp, g->xfinal, gm_weight(g, -1, gm_head_name(g)), NULL, g->ctype, n, g->V,
                   D, 0);
    cross_entropy_forward_backward(g->logits, g->Vp, g->targets, g->losses, g->ctype, n, g->V, dscale, 0);
    loss_mean(g->loss, g->losses, n, 0);
}

// Accumulate (+=) every parameter gradient after gpu_model_forward with dscale != 0.
static inline void gpu_model_backward(GpuModel *g, const int *tokens) {
    int n = g->n, D = g->D, F = g->F;
    // LM head and final norm
    matmul_backward_weight(gm_grad(g, -1, gm_head_name(g)), DT_FP32, g->logits, g->Vp, g->xfinal, g->ctype, n,
                           g->V, D, 1, 0);
    matmul_backward_input(g->branch, g->ctype, g->logits, g->Vp, gm_weight(g, -1, gm_head_name(g)), g->ctype, n, g->V,
                          D, 0, 0);
    rmsnorm_backward(g->dh, gm_grad(g, -1, "norm"), g->norm_scratch, g->branch, gm_at(g, g->h, g->L, D),
                     gm_weight(g, -1, "norm"), g->rstd_final, g->ctype, n, D, 0, 0);
    for (int l = g->L - 1; l >= 0; l--) {
        // FFN branch: dh = d h[l+1], also the residual part of d hmid[l]
        void *ab = gm_at(g, g->ffn_ab, l, 2 * F), *bb = (char *)ab + F * g->es;
        matmul_backward_weight(gm_grad(g, l, "ffn.w2"), DT_FP32, g->dh, D, gm_at(g, g->ffn_h, l, F), g->ctype, n, D,
                               F, 1, 0);
        matmul_backward_input(g->dffn_h, g->ctype, g->dh, D, gm_weight(g, l, "ffn.w2"), g->ctype, n, D, F, 0, 0);
        swiglu_backward(ab, bb, 2 * F, g->dffn_h, ab, bb, 2 * F, g->ctype, n, F, 0); // ab becomes d(W1|W3 product)
        matmul_backward_weight(gm_grad(g, l, "ffn.w1"), DT_FP32, ab, 2 * F, gm_at(g, g->xffn, l, D), g->ctype, n,
                               2 * F, D, 1, 0);
        matmul_backward_input(g->branch, g->ctype, ab, 2 * F, gm_weight(g, l, "ffn.w1"), g->ctype, n, 2 * F, D, 0, 0);
        rmsnorm_backward(g->dh, gm_grad(g, l, "ffn_norm"), g->norm_scratch, g->branch, gm_at(g, g->hmid, l, D),
                         gm_weight(g, l, "ffn_norm"), g->rstd_ffn + (size_t)l * n, g->ctype, n, D, 1, 0);
        // mixer branch: dh = d hmid[l], also the residual part of d h[l]
        gm_mixer_backward(g, l, gm_at(g, g->xmix, l, D), g->dh, g->branch);
        rmsnorm_backward(g->dh, gm_grad(g, l, "mixer_norm"), g->norm_scratch, g->branch, gm_at(g, g->h, l, D),
                         gm_weight(g, l, "mixer_norm"), g->rstd_mix + (size_t)l * n, g->ctype, n, D, 1, 0);
    }
    embedding_backward_plan_build(&g->emb_plan, tokens, 0);
    embedding_backward(gm_grad(g, -1, "tok_emb"), g->dh, g->ctype, &g->emb_plan, 0);
}

// g->pred[n] (device) = the greedy next-token prediction at every position of the last forward.
static inline void gpu_model_argmax(GpuModel *g) {
    DTYPE_DISPATCH(g->ctype, "argmax",
                 core_argmax_kernel<T><<<ceil_div(g->n, 8), 256>>>(g->pred, (const T *)g->logits, g->Vp, g->V, g->n));
    cudaCheckLast();
}

static inline float gpu_model_loss(const GpuModel *g) {
    float loss;
    cudaCheck(cudaMemcpy(&loss, g->loss, sizeof loss, cudaMemcpyDeviceToHost));
    return loss;
}

// ------------------------------------------------------------------------------------------------------------------
// Inference (docs/MODEL.md#inference): generation state of `streams` independent streams over a model's weights.
// Each stream has its own SDM banks, KV caches, position and sampler state; a stream starts fresh (gpu_infer_reset:
// banks = M0, position 0), takes its prompt in one prefill (the training kernels at full width), then one token
// per decode step. A decode step runs streams 0..n-1 together (a generator keeps its active streams first, see
// gpu_infer_move); with sampling on the device it is captured once per n as a CUDA graph and replayed, and the host
// reads back only the n sampled ids. Every inference kernel runs on the state's own stream, which a graph can capture.

typedef struct {
    const GpuModel *g;             // the weights (g->work) and the model's dimensions
    int streams, max_tokens, rows; // rows = max(max_tokens, streams): scratch capacity in tokens
    int full_attention;            // some layer is full attention: a stream holds at most max_tokens positions
    SdmInferState *sdm;            // [L], for SDM layers
    AttnInferState *attn;          // [L], for attention layers
    void *h, *x, *branch;          // [rows, D] compute dtype: residual stream, normed input, a block's branch
    void *ab, *hf;                 // [rows, 2F], [rows, F] FFN intermediates
    float *rstd;                   // [rows] (written by the norms, unused)
    float *logits;                 // [streams, Vp] fp32 on the device: row b = the next-token logits of stream b
    float *logits_host;            // [streams, Vp]
    int *prompt;                   // device [max_tokens]: the prompt of a prefill
    int *next;                     // device [streams]: each stream's next input token (the last sampled one)
    int *next_host;                // pinned [streams]: the sampled ids read back after a step
    int *pos_len;                  // device [2, streams]: the new token's position per stream, then pos + 1
    int *pos;                      // host [2, streams]: the same (pos[b] = positions processed so far)
    SamplingParams sp;             // the sampler of gpu_infer_sample and of the captured graphs
    Rng *rng;                      // device [streams]: each stream's sampler state
    double *probs;                 // device [streams, V] sampler scratch
    int *order;                    // device [streams, V] sampler scratch
    cudaStream_t stream;           // every inference kernel runs here
    cudaGraphExec_t *graph;        // [streams + 1]: graph[n] = a sampling decode step of streams 0..n-1, or NULL
} GpuInferState;

static inline void gpu_infer_create(GpuInferState *I, const GpuModel *g, int streams, int max_tokens) {
    memset(I, 0, sizeof *I);
    I->g = g;
    I->streams = streams;
    I->max_tokens = max_tokens;
    I->rows = SDM_MAX(max_tokens, streams);
    size_t rows = (size_t)I->rows, D = (size_t)g->D, F = (size_t)g->F, S = (size_t)streams;
    I->sdm = (SdmInferState *)sdm_calloc(g->L, sizeof(SdmInferState));
    I->attn = (AttnInferState *)sdm_calloc(g->L, sizeof(AttnInferState));
    for (int l = 0; l < g->L; l++) {
        if (g->m->kind[l] == LAYER_SDM) {
            I->sdm[l] = sdm_infer_create(&g->m->sdm, streams, max_tokens, g->ctype);
        } else {
            I->attn[l] = attn_infer_create(&g->m->attn[l], streams, max_tokens, g->ctype);
            if (g->m->attn[l].window == 0) I->full_attention = 1;
        }
    }
    I->h = gpu_alloc(rows * D * g->es);
    I->x = gpu_alloc(rows * D * g->es);
    I->branch = gpu_alloc(rows * D * g->es);
    I->ab = gpu_alloc(rows * 2 * F * g->es);
    I->hf = gpu_alloc(rows * F * g->es);
    I->rstd = (float *)gpu_alloc(rows * 4);
    I->logits = (float *)gpu_alloc(S * g->Vp * 4);
    I->logits_host = (float *)sdm_malloc(S * g->Vp * 4);
    I->prompt = (int *)gpu_alloc((size_t)max_tokens * 4);
    I->next = (int *)gpu_alloc(S * 4);
    cudaCheck(cudaMallocHost((void **)&I->next_host, S * 4));
    I->pos_len = (int *)gpu_alloc(2 * S * 4);
    I->pos = (int *)sdm_calloc(2 * S, sizeof(int));
    I->rng = (Rng *)gpu_alloc(S * sizeof(Rng));
    I->probs = (double *)gpu_alloc(S * g->V * sizeof(double));
    I->order = (int *)gpu_alloc(S * g->V * 4);
    cudaCheck(cudaStreamCreate(&I->stream)); // blocking: ordered after the weights' uploads on the legacy stream
    I->graph = (cudaGraphExec_t *)sdm_calloc(S + 1, sizeof(cudaGraphExec_t));
}

// Drop the captured decode graphs (they hold the sampler's parameters).
static inline void gpu_infer_drop_graphs(GpuInferState *I) {
    for (int n = 0; n <= I->streams; n++)
        if (I->graph[n]) cudaCheck(cudaGraphExecDestroy(I->graph[n]));
    memset(I->graph, 0, sizeof(cudaGraphExec_t) * (size_t)(I->streams + 1));
}

static inline void gpu_infer_destroy(GpuInferState *I) {
    gpu_infer_drop_graphs(I);
    for (int l = 0; l < I->g->L; l++) {
        if (I->g->m->kind[l] == LAYER_SDM) sdm_infer_destroy(&I->sdm[l]);
        else attn_infer_destroy(&I->attn[l]);
    }
    void *bufs[] = {I->h, I->x, I->branch, I->ab, I->hf, I->rstd, I->logits, I->prompt, I->next, I->pos_len, I->rng,
                    I->probs, I->order};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaCheck(cudaFree(bufs[i]));
    cudaCheck(cudaFreeHost(I->next_host));
    cudaCheck(cudaStreamDestroy(I->stream));
    free(I->sdm);
    free(I->attn);
    free(I->logits_host);
    free(I->pos);
    free(I->graph);
    memset(I, 0, sizeof *I);
}

// Stream b's position is now p: host and device copies of (pos, len).
static inline void gpu_infer_set_pos(GpuInferState *I, int b, int p) {
    I->pos[b] = p;
    I->pos[I->streams + b] = p + 1;
    cudaCheck(cudaMemcpyAsync(I->pos_len + b, I->pos + b, sizeof(int), cudaMemcpyHostToDevice, I->stream));
    cudaCheck(cudaMemcpyAsync(I->pos_len + I->streams + b, I->pos + I->streams + b, sizeof(int),
                              cudaMemcpyHostToDevice, I->stream));
    cudaCheck(cudaStreamSynchronize(I->stream)); // the host values may change before an asynchronous copy reads them
}

// Stream b (b < 0: every stream) starts afresh: its SDM banks become copies of M0 (or zeros), its position 0.
static inline void gpu_infer_reset(GpuInferState *I, int b) {
    for (int l = 0; l < I->g->L; l++)
        if (I->g->m->kind[l] == LAYER_SDM) {
            SdmLayerParams p = gm_sdm_params(I->g, l);
            sdm_infer_reset(&I->sdm[l], &p, b, I->stream);
        }
    for (int i = 0; i < I->streams; i++)
        if (b < 0 || i == b) gpu_infer_set_pos(I, i, 0);
}

// Stream b's sampler starts from rng_make(seed), as the host sampler's Rng would.
static inline void gpu_infer_seed(GpuInferState *I, int b, uint64_t seed) {
    Rng r = rng_make(seed);
    cudaCheck(cudaMemcpyAsync(I->rng + b, &r, sizeof r, cudaMemcpyHostToDevice, I->stream));
    cudaCheck(cudaStreamSynchronize(I->stream));
}

// The sampler of later samples and decode steps; a change drops the graphs captured with the old one.
static inline void gpu_infer_set_sampling(GpuInferState *I, const SamplingParams *sp) {
    if (I->sp.temperature == sp->temperature && I->sp.top_p == sp->top_p && I->sp.top_k == sp->top_k) return;
    gpu_infer_drop_graphs(I);
    I->sp = *sp;
}

// Stream `to` takes over stream `from`'s state (banks, KV caches, position, next token, sampler), so a generator
// can keep its active streams in 0..n-1 when one finishes.
static inline void gpu_infer_move(GpuInferState *I, int from, int to) {
    if (from == to) return;
    for (int l = 0; l < I->g->L; l++) {
        if (I->g->m->kind[l] == LAYER_SDM) sdm_infer_copy_stream(&I->sdm[l], from, to, I->stream);
        else attn_infer_copy_stream(&I->attn[l], from, to, I->stream);
    }
    cudaCheck(cudaMemcpyAsync(I->next + to, I->next + from, sizeof(int), cudaMemcpyDeviceToDevice, I->stream));
    cudaCheck(cudaMemcpyAsync(I->rng + to, I->rng + from, sizeof(Rng), cudaMemcpyDeviceToDevice, I->stream));
    gpu_infer_set_pos(I, to, I->pos[from]);
}

// Mixer of layer l on the n rows of I->x into I->branch: a prefill of stream b (b >= 0), or a decode step of
// streams 0..n-1.
static inline void gpu_infer_mixer(GpuInferState *I, int l, int b, int n) {
    const GpuModel *g = I->g;
    if (g->m->kind[l] == LAYER_SDM) {
        SdmLayerParams p = gm_sdm_params(g, l);
        if (b >= 0) sdm_infer_prefill(&I->sdm[l], &p, b, I->x, I->branch, n, I->stream);
        else sdm_infer_decode(&I->sdm[l], &p, I->x, I->branch, n, I->stream);
    } else {
        AttnLayerParams p = gm_attn_params(g, l);
        if (b >= 0) attn_infer_prefill(&I->attn[l], &p, b, I->x, I->branch, n, I->stream);
        else attn_infer_decode(&I->attn[l], &p, I->x, I->branch, I->pos_len, I->pos_len + I->streams, n, I->stream);
    }
}

// The model on n tokens[n] (device; see gpu_infer_mixer for b); the logits of the last n_out rows go to rows
// first..first+n_out-1 of I->logits.
static inline void gpu_infer_run(GpuInferState *I, const int *tokens, int b, int n, int n_out, int first) {
    const GpuModel *g = I->g;
    int D = g->D;
    float eps = (float)g->m->norm_eps;
    cudaStream_t st = I->stream;
    embedding_forward(I->h, gm_weight(g, -1, "tok_emb"), tokens, g->ctype, n, D, st);
    rmsnorm_forward(I->x, I->rstd, I->h, gm_weight(g, 0, "mixer_norm"), g->ctype, n, D, eps, st);
    for (int l = 0; l < g->L; l++) {
        gpu_infer_mixer(I, l, b, n);
        residual_rmsnorm_forward(I->h, I->x, I->rstd, I->h, I->branch, gm_weight(g, l, "ffn_norm"), g->ctype, n, D,
                                 eps, st);
        gm_ffn_forward(g, l, I->x, I->ab, I->hf, I->branch, n, st);
        const void *next_norm = l == g->L - 1 ? gm_weight(g, -1, "norm") : gm_weight(g, l + 1, "mixer_norm");
        residual_rmsnorm_forward(I->h, I->x, I->rstd, I->h, I->branch, next_norm, g->ctype, n, D, eps, st);
    }
    const void *last = (const char *)I->x + (size_t)(n - n_out) * D * g->es;
    matmul_forward(I->logits + (size_t)first * g->Vp, DT_FP32, g->Vp, last, gm_weight(g, -1, gm_head_name(g)), NULL,
                   g->ctype, n_out, g->V, D, st);
}

// Host copy of the logits rows first..first+n-1 (rows of g->Vp floats, valid until the next call); synchronises.
static inline const float *gpu_infer_logits(GpuInferState *I, int first, int n) {
    size_t row = (size_t)I->g->Vp;
    cudaCheck(cudaMemcpyAsync(I->logits_host + first * row, I->logits + first * row, n * row * 4,
                              cudaMemcpyDeviceToHost, I->stream));
    cudaCheck(cudaStreamSynchronize(I->stream));
    return I->logits_host + first * row;
}

// Prefill of stream b (fresh: after gpu_infer_reset) with its prompt tokens[T] (host), any length up to
// max_tokens: the logits of the token after the prompt stay in row b of I->logits.
static inline void gpu_infer_prefill_device(GpuInferState *I, int b, const int *tokens, int T) {
    if (b < 0 || b >= I->streams) sdm_die("gpu_infer_prefill: stream %d of %d", b, I->streams);
    if (I->pos[b] != 0) sdm_die("gpu_infer_prefill: stream %d is not fresh (call gpu_infer_reset first)", b);
    if (T < 1 || T > I->max_tokens) sdm_die("gpu_infer_prefill: a prompt of %d tokens (1..%d)", T, I->max_tokens);
    cudaCheck(cudaMemcpyAsync(I->prompt, tokens, sizeof(int) * T, cudaMemcpyHostToDevice, I->stream));
    gpu_infer_run(I, I->prompt, b, T, 1, b);
    gpu_infer_set_pos(I, b, T);
}

// The same, returning those logits [V] (host fp32, valid until the next call).
static inline const float *gpu_infer_prefill(GpuInferState *I, int b, const int *tokens, int T) {
    gpu_infer_prefill_device(I, b, tokens, T);
    return gpu_infer_logits(I, b, 1);
}

// Positions pos and len of streams 0..n-1 advance by one on the device (the host mirrors it).
__global__ void gpu_infer_advance_kernel(int *pos_len, int streams, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    pos_len[i]++;
    pos_len[streams + i]++;
}

// Enqueue one decode step of streams 0..n-1 on their next tokens: logits rows 0..n-1, positions + 1, and with
// `sample` the next tokens drawn into I->next and copied to I->next_host.
static inline void gpu_infer_enqueue_decode(GpuInferState *I, int n, int sample) {
    gpu_infer_run(I, I->next, -1, n, n, 0);
    gpu_infer_advance_kernel<<<ceil_div(n, 256), 256, 0, I->stream>>>(I->pos_len, I->streams, n);
    cudaCheckLast();
    if (!sample) return;
    sample_tokens(I->logits, I->g->Vp, I->g->V, n, &I->sp, I->rng, I->probs, I->order, I->next, I->stream);
    cudaCheck(cudaMemcpyAsync(I->next_host, I->next, sizeof(int) * n, cudaMemcpyDeviceToHost, I->stream));
}

// Refuse a decode step of streams 0..n-1 that would overflow a full-attention KV cache; then advance the host's
// positions.
static inline void gpu_infer_count_step(GpuInferState *I, int n) {
    if (n < 1 || n > I->streams) sdm_die("gpu_infer_decode: a step of %d of %d streams", n, I->streams);
    for (int i = 0; i < n; i++) {
        if (I->full_attention && I->pos[i] >= I->max_tokens)
            sdm_die("gpu_infer_decode: stream %d is full (%d positions, the KV cache holds %d)", i, I->pos[i],
                    I->max_tokens);
        I->pos[i]++;
        I->pos[I->streams + i]++;
    }
}

// Teacher-forced decode step of every stream: one new token per stream, tokens[streams] (host); returns the logits
// [streams, Vp] (host fp32, row stride g->Vp, valid until the next call) of the token after each.
static inline const float *gpu_infer_decode(GpuInferState *I, const int *tokens) {
    gpu_infer_count_step(I, I->streams);
    cudaCheck(cudaMemcpyAsync(I->next, tokens, sizeof(int) * I->streams, cudaMemcpyHostToDevice, I->stream));
    gpu_infer_enqueue_decode(I, I->streams, 0);
    return gpu_infer_logits(I, 0, I->streams);
}

// Stream b's next token drawn (I->sp) from its logits row, e.g. after its prefill; returns it.
static inline int gpu_infer_sample(GpuInferState *I, int b) {
    const GpuModel *g = I->g;
    sample_tokens(I->logits + (size_t)b * g->Vp, g->Vp, g->V, 1, &I->sp, I->rng + b, I->probs, I->order, I->next + b,
                  I->stream);
    cudaCheck(cudaMemcpyAsync(I->next_host + b, I->next + b, sizeof(int), cudaMemcpyDeviceToHost, I->stream));
    cudaCheck(cudaStreamSynchronize(I->stream));
    return I->next_host[b];
}

// graph[n], captured on first use. Relaxed capture: the first GEMM of a process may allocate cuBLASLt's workspace.
static inline cudaGraphExec_t gpu_infer_graph(GpuInferState *I, int n) {
    if (!I->graph[n]) {
        cudaGraph_t graph;
        cudaCheck(cudaStreamBeginCapture(I->stream, cudaStreamCaptureModeRelaxed));
        gpu_infer_enqueue_decode(I, n, 1);
        cudaCheck(cudaStreamEndCapture(I->stream, &graph));
        cudaCheck(cudaGraphInstantiate(&I->graph[n], graph, 0));
        cudaCheck(cudaGraphDestroy(graph));
    }
    return I->graph[n];
}

// Decode step of streams 0..n-1 on their next tokens, sampling the token after each (I->sp): replays graph[n]
// (use_graph) or launches the same kernels one by one. Returns the n sampled ids (host, valid until the next
// call); the only synchronisation of the step is reading them.
static inline const int *gpu_infer_step(GpuInferState *I, int n, int use_graph) {
    gpu_infer_count_step(I, n);
    if (use_graph) cudaCheck(cudaGraphLaunch(gpu_infer_graph(I, n), I->stream));
    else gpu_infer_enqueue_decode(I, n, 1);
    cudaCheck(cudaStreamSynchronize(I->stream));
    return I->next_host;
}

#endif
