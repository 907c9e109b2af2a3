// train_sdm.cu: trains a hybrid language model of sliding-window attention, full attention and Sparse Delta Memory
// layers (SDM_SPEC §6) on one or many GPUs.
//
//   ./train_sdm -c configs/sdm_flagship.cfg [key=value ...]
//   scripts/launch_local.sh 8 ./train_sdm -c configs/sdm_flagship.cfg      (8 GPUs of one node; see scripts/)
//
// Read top to bottom: the model on the GPU (parameters, activations, forward, backward), then the training loop
// (data, optimizer step with ZeRO-1 over NCCL, evaluation, checkpoints). Without data.train the embedded recall
// dataset is generated on first use. A run resumes from the newest complete checkpoint in its run_dir.
#include <sys/stat.h>
#include <time.h>

#include "attention/attention_layer.cuh"
#include "core/adamw.cuh"
#include "core/checkpoint.h"
#include "core/config.h"
#include "core/dist.cuh"
#include "core/layers.cuh"
#include "core/loss.cuh"
#include "core/matmul.cuh"
#include "core/model.h"
#include "core/optim.h"
#include "data/dataloader.h"
#include "data/dataset.h"
#include "sdm/sdm_layer.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Small kernels of the training program

// out[i] = in[i] in the compute dtype: the working weights from the fp32 master weights.
template <typename T> __global__ void cast_kernel(T *out, const float *in, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = act_from_float<T>(in[i]);
}

static inline void cast_to_work(void *out, const float *in, long long n, cudaDataType_t dtype, cudaStream_t s) {
    int blocks = (int)SDM_MIN(65536LL, (n + 255) / 256);
    ACT_DISPATCH(dtype, "cast_to_work", cast_kernel<T><<<blocks, 256, 0, s>>>((T *)out, in, n));
    cudaCheckLast();
}

// pred[i] = argmax_v logits[i, v] (first maximum), one warp per row: the greedy next-token predictions.
template <typename T> __global__ void argmax_kernel(int *pred, const T *logits, int ld, int V, int n) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= n) return;
    float best = -INFINITY;
    int arg = 0;
    for (int v = lane; v < V; v += 32) {
        float x = act_to_float(logits[(size_t)row * ld + v]);
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
    cudaDataType_t ctype;        // compute dtype: bf16, or fp32 in the exact mode
    size_t es;                   // its size in bytes
    long long padded;            // flat parameter storage padded to a multiple of the world size
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

// The SDM layer's tensors: the input weights wk..wg are adjacent in the table (one fused GEMM), the biases each
// follow an alignment gap, so they are passed one by one.
static inline SdmLayerParams gm_sdm_params(const GpuModel *g, int l) {
    SdmLayerParams p;
    p.w_in = gm_weight(g, l, "sdm.wk");
    for (int i = 0; i < SDM_B_COUNT; i++) p.b_in[i] = gm_weight(g, l, SDM_BIAS_NAMES[i]);
    p.A_log = gm_weight(g, l, "sdm.A_log");
    p.dt_bias = gm_weight(g, l, "sdm.dt_bias");
    p.ln_w = gm_weight(g, l, "sdm.ln_w");
    p.ln_b = gm_weight(g, l, "sdm.ln_b");
    p.w_out = gm_weight(g, l, "sdm.wo");
    p.b_out = gm_weight(g, l, "sdm.bo");
    p.bank0 = gm_weight(g, l, "sdm.bank");
    return p;
}

static inline SdmLayerGrads gm_sdm_grads(const GpuModel *g, int l) {
    SdmLayerGrads d;
    d.w_in = gm_grad(g, l, "sdm.wk");
    for (int i = 0; i < SDM_B_COUNT; i++) d.b_in[i] = gm_grad(g, l, SDM_BIAS_NAMES[i]);
    d.A_log = gm_grad(g, l, "sdm.A_log");
    d.dt_bias = gm_grad(g, l, "sdm.dt_bias");
    d.ln_w = gm_grad(g, l, "sdm.ln_w");
    d.ln_b = gm_grad(g, l, "sdm.ln_b");
    d.w_out = gm_grad(g, l, "sdm.wo");
    d.b_out = gm_grad(g, l, "sdm.bo");
    d.bank0 = gm_grad(g, l, "sdm.bank");
    return d;
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

static inline void gpu_model_create(GpuModel *g, const ModelDesc *m, int B, int T, int fp32, int world) {
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
    g->ctype = fp32 ? CUDA_R_32F : CUDA_R_16BF;
    g->es = dtype_size(g->ctype);
    g->padded = (m->storage + world - 1) / world * world;
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
        if (m->kind[l] == LAYER_SDM) g->sdm[l] = sdm_layer_create(&m->sdm, B, T, fp32, 0);
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
    cast_to_work(g->work, g->master, g->padded, g->ctype, 0);
}

// Mixer of layer l: y = Mixer(x) (forward, saving what its backward needs).
static inline void mixer_forward(GpuModel *g, int l, const void *x, void *y) {
    if (g->m->kind[l] == LAYER_SDM) {
        SdmLayerParams p = gm_sdm_params(g, l);
        sdm_layer_forward(&g->sdm[l], &p, x, y, 0);
    } else {
        AttnLayerParams p = gm_attn_params(g, l);
        attn_layer_forward(&g->attn[l], &p, x, y, 0);
    }
}

// dx (overwritten) and the mixer's parameter gradients (+=) from dy.
static inline void mixer_backward(GpuModel *g, int l, const void *x, const void *dy, void *dx) {
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
        mixer_forward(g, l, gm_at(g, g->xmix, l, D), g->branch);
        residual_rmsnorm_forward(hmid, xffn, g->rstd_ffn + (size_t)l * n, h, g->branch, gm_weight(g, l, "ffn_norm"),
                                 g->ctype, n, D, eps, 0);
        // SwiGLU FFN: one GEMM for W1|W3 (adjacent in the parameter table), then W2
        matmul_forward(ab, g->ctype, 2 * F, xffn, gm_weight(g, l, "ffn.w1"), NULL, g->ctype, n, 2 * F, D, 0);
        swiglu_forward(hf, ab, (char *)ab + F * g->es, 2 * F, g->ctype, n, F, 0);
        matmul_forward(g->branch, g->ctype, D, hf, gm_weight(g, l, "ffn.w2"), NULL, g->ctype, n, D, F, 0);
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
    matmul_backward_weight(gm_grad(g, -1, gm_head_name(g)), CUDA_R_32F, g->logits, g->Vp, g->xfinal, g->ctype, n,
                           g->V, D, 1, 0);
    matmul_backward_input(g->branch, g->ctype, g->logits, g->Vp, gm_weight(g, -1, gm_head_name(g)), g->ctype, n, g->V,
                          D, 0, 0);
    rmsnorm_backward(g->dh, gm_grad(g, -1, "norm"), g->norm_scratch, g->branch, gm_at(g, g->h, g->L, D),
                     gm_weight(g, -1, "norm"), g->rstd_final, g->ctype, n, D, 0, 0);
    for (int l = g->L - 1; l >= 0; l--) {
        // FFN branch: dh = d h[l+1], also the residual part of d hmid[l]
        void *ab = gm_at(g, g->ffn_ab, l, 2 * F), *bb = (char *)ab + F * g->es;
        matmul_backward_weight(gm_grad(g, l, "ffn.w2"), CUDA_R_32F, g->dh, D, gm_at(g, g->ffn_h, l, F), g->ctype, n, D,
                               F, 1, 0);
        matmul_backward_input(g->dffn_h, g->ctype, g->dh, D, gm_weight(g, l, "ffn.w2"), g->ctype, n, D, F, 0, 0);
        swiglu_backward(ab, bb, 2 * F, g->dffn_h, ab, bb, 2 * F, g->ctype, n, F, 0); // ab becomes d(W1|W3 product)
        matmul_backward_weight(gm_grad(g, l, "ffn.w1"), CUDA_R_32F, ab, 2 * F, gm_at(g, g->xffn, l, D), g->ctype, n,
                               2 * F, D, 1, 0);
        matmul_backward_input(g->branch, g->ctype, ab, 2 * F, gm_weight(g, l, "ffn.w1"), g->ctype, n, 2 * F, D, 0, 0);
        rmsnorm_backward(g->dh, gm_grad(g, l, "ffn_norm"), g->norm_scratch, g->branch, gm_at(g, g->hmid, l, D),
                         gm_weight(g, l, "ffn_norm"), g->rstd_ffn + (size_t)l * n, g->ctype, n, D, 1, 0);
        // mixer branch: dh = d hmid[l], also the residual part of d h[l]
        mixer_backward(g, l, gm_at(g, g->xmix, l, D), g->dh, g->branch);
        rmsnorm_backward(g->dh, gm_grad(g, l, "mixer_norm"), g->norm_scratch, g->branch, gm_at(g, g->h, l, D),
                         gm_weight(g, l, "mixer_norm"), g->rstd_mix + (size_t)l * n, g->ctype, n, D, 1, 0);
    }
    embedding_backward_plan_build(&g->emb_plan, tokens, 0);
    embedding_backward(gm_grad(g, -1, "tok_emb"), g->dh, g->ctype, &g->emb_plan, 0);
}

static inline float gpu_model_loss(const GpuModel *g) {
    float loss;
    cudaCheck(cudaMemcpy(&loss, g->loss, sizeof loss, cudaMemcpyDeviceToHost));
    return loss;
}

// ------------------------------------------------------------------------------------------------------------------
// The training loop

typedef struct {
    Config cfg;
    ModelDesc *m;
    Dist dist;
    GpuModel g;
    DataLoader train, val;
    int32_t *batch;          // host [B, T+1]
    int *inputs, *targets;   // host [B*T]
    long long step;          // optimizer steps done
    FILE *log;               // run_dir/train.log (rank 0)
} Run;

// inputs[b, t] = row[b][t], targets[b, t] = row[b][t+1]
static inline void split_batch(const Run *r) {
    int B = r->g.B, T = r->g.T;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            r->inputs[b * T + t] = r->batch[(size_t)b * (T + 1) + t];
            r->targets[b * T + t] = r->batch[(size_t)b * (T + 1) + t + 1];
        }
}

static inline void next_batch(Run *r, DataLoader *dl) {
    char err[DATA_ERR_LEN];
    if (dataloader_next_batch(dl, r->batch, err)) sdm_die("%s", err);
    split_batch(r);
}

static inline void say(const Run *r, const char *fmt, ...) {
    if (r->dist.rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    char line[2048];
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fputs(line, stdout);
    fflush(stdout);
    if (r->log) { fputs(line, r->log); fflush(r->log); }
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static inline void open_data(Run *r) {
    char err[DATA_ERR_LEN], train[CFG_STR + 64], val[CFG_STR + 64];
    const Config *c = &r->cfg;
    if (!c->train_data[0] || !c->val_data[0]) {
        if (dataset_ensure_default(DATASET_DEFAULT_DIR, err)) sdm_die("%s", err);
        snprintf(train, sizeof train, "%s/%s", DATASET_DEFAULT_DIR, DATASET_TRAIN_PATTERN);
        snprintf(val, sizeof val, "%s/%s", DATASET_DEFAULT_DIR, DATASET_VAL_PATTERN);
    }
    if (c->train_data[0]) snprintf(train, sizeof train, "%s", c->train_data);
    if (c->val_data[0]) snprintf(val, sizeof val, "%s", c->val_data);
    if (dataloader_open(&r->train, train, c->batch_size, c->seq_len, r->dist.rank, r->dist.world, (uint64_t)c->seed, 1,
                        err))
        sdm_die("%s", err);
    if (dataloader_open(&r->val, val, c->batch_size, c->seq_len, r->dist.rank, r->dist.world, (uint64_t)c->seed, 0,
                        err))
        sdm_die("%s", err);
    if ((int)r->train.vocab > c->vocab_size || (int)r->val.vocab > c->vocab_size)
        sdm_die("%s: the shards' vocabulary (%u) exceeds model.vocab_size %d", train, r->train.vocab, c->vocab_size);
}

// Initial weights (SDM_SPEC §6.7), the same on every rank.
static inline void init_params(Run *r) {
    const ModelDesc *m = r->m;
    float *host = (float *)sdm_calloc((size_t)m->storage, sizeof(float));
    for (int i = 0; i < m->n_params; i++) model_init_tensor(m, i, (unsigned long long)r->cfg.seed, host + m->params[i].offset);
    gpu_model_set_params(&r->g, host);
    free(host);
}

// One optimizer step: grad_acc_steps micro-batches forward and backward, gradients reduce-scattered over ranks,
// the global norm clipped, AdamW on this rank's shard, the updated weights all-gathered. Returns the mean loss.
static inline float train_step(Run *r) {
    GpuModel *g = &r->g;
    const Config *c = &r->cfg;
    Dist *d = &r->dist;
    int acc = c->grad_acc_steps;
    cudaCheck(cudaMemset(g->grads, 0, sizeof(float) * g->padded));
    float loss = 0;
    for (int k = 0; k < acc; k++) {
        next_batch(r, &r->train);
        gpu_model_forward(g, r->inputs, r->targets, 1.0f / ((float)g->n * acc * d->world));
        gpu_model_backward(g, r->inputs);
        loss += gpu_model_loss(g) / acc;
    }
    dist_reduce_scatter_grads(d, g->grads, 0);
    long long lo = d->rank * d->shard, hi = SDM_MIN(lo + d->shard, r->m->storage);
    grad_sumsq(g->clip_sumsq, g->norm_scratch2, g->grads + lo, SDM_MAX(hi - lo, 0LL), 0);
    dist_all_reduce_sum(d, g->clip_sumsq, 1, 0);
    grad_clip_scale(g->clip_norm, g->clip_scale, g->clip_sumsq, (float)c->clip, 0);
    AdamWHyper hyper = {c->lr * lr_schedule(lr_scheduler_from_name(c->scheduler), r->step, c->warmup, c->steps,
                                            c->lr_min_ratio),
                        c->weight_decay, c->beta1, c->beta2, c->adam_eps, r->step + 1};
    if (hi > lo)
        adamw_update_model(r->m, lo, hi, g->master + lo, (char *)g->work + lo * g->es, g->ctype, g->grads + lo,
                           g->adam_m + lo, g->adam_v + lo, &hyper, g->clip_scale, 0);
    dist_all_gather(d, g->work, g->es, 0);
    r->step++;
    return loss;
}

// Mean loss over ranks of a host value, through the device.
static inline float mean_over_ranks(Run *r, float x) {
    if (r->dist.world == 1) return x;
    cudaCheck(cudaMemcpy(r->g.clip_sumsq, &x, sizeof x, cudaMemcpyHostToDevice));
    dist_all_reduce_sum(&r->dist, r->g.clip_sumsq, 1, 0);
    cudaCheck(cudaMemcpy(&x, r->g.clip_sumsq, sizeof x, cudaMemcpyDeviceToHost));
    return x / r->dist.world;
}

// Validation loss over eval.steps batches, and the recall accuracy of the greedy predictions on them.
static inline void evaluate(Run *r) {
    GpuModel *g = &r->g;
    RecallScore score;
    memset(&score, 0, sizeof score);
    int *pred = (int *)sdm_malloc(sizeof(int) * g->n);
    dataloader_reset(&r->val);
    int batches = (int)SDM_MIN((uint64_t)r->cfg.eval_steps, dataloader_batches_per_epoch(&r->val));
    double loss = 0;
    for (int k = 0; k < batches; k++) {
        next_batch(r, &r->val);
        gpu_model_forward(g, r->inputs, r->targets, 0.0f);
        loss += gpu_model_loss(g);
        ACT_DISPATCH(g->ctype, "argmax", argmax_kernel<T><<<ceil_div(g->n, 8), 256>>>(g->pred, (const T *)g->logits,
                                                                                       g->Vp, g->V, g->n));
        cudaCheck(cudaMemcpy(pred, g->pred, sizeof(int) * g->n, cudaMemcpyDeviceToHost));
        for (int b = 0; b < g->B; b++)
            recall_score_row(&score, r->batch + (size_t)b * (g->T + 1), pred + (size_t)b * g->T, g->T);
    }
    float val = mean_over_ranks(r, batches ? (float)(loss / batches) : 0.0f);
    uint64_t q, exact, digits, right;
    recall_score_totals(&score, &q, &exact, &digits, &right);
    say(r, "eval step %lld | val loss %.4f over %d batches | recall (rank 0) %llu queries, digit acc %.4f, exact %.4f\n",
        r->step, val, batches, (unsigned long long)q, digits ? (double)right / digits : 0.0, q ? (double)exact / q : 0.0);
    if (r->dist.rank == 0) {
        recall_score_print(&score, stdout);
        if (r->log) recall_score_print(&score, r->log);
    }
    free(pred);
}

// Gather the sharded state to rank 0 and write a checkpoint there.
static inline void save_checkpoint(Run *r) {
    GpuModel *g = &r->g;
    dist_all_gather(&r->dist, g->master, 4, 0);
    dist_all_gather(&r->dist, g->adam_m, 4, 0);
    dist_all_gather(&r->dist, g->adam_v, 4, 0);
    if (r->dist.rank != 0) return;
    size_t n = (size_t)r->m->storage;
    float *p = (float *)sdm_malloc(4 * n), *mm = (float *)sdm_malloc(4 * n), *vv = (float *)sdm_malloc(4 * n);
    cudaCheck(cudaMemcpy(p, g->master, 4 * n, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(mm, g->adam_m, 4 * n, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(vv, g->adam_v, 4 * n, cudaMemcpyDeviceToHost));
    DataLoaderState ls;
    dataloader_get_state(&r->train, &ls);
    CkptTrainState st = {(uint64_t)r->step, 0, mm, vv, &ls, sizeof ls};
    char err[CKPT_ERR];
    if (!ckpt_save(r->cfg.run_dir, r->m, &r->cfg, p, &st, r->cfg.keep_checkpoints, err)) sdm_die("%s", err);
    say(r, "checkpoint: %s/step_%08lld\n", r->cfg.run_dir, r->step);
    free(p);
    free(mm);
    free(vv);
}

// Continue from the newest complete checkpoint of run_dir, if any. The stored model must match this config's.
static inline void resume(Run *r) {
    uint64_t steps[1];
    if (ckpt_list(r->cfg.run_dir, steps, 1) == 0) return;
    char dir[1024], path[1100], err[CKPT_ERR];
    ckpt_step_dir(dir, sizeof dir, r->cfg.run_dir, steps[0], "");
    Config stored;
    ModelDesc *sm = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    float *params = NULL;
    uint64_t step, rng;
    snprintf(path, sizeof path, "%s/model.bin", dir);
    if (!ckpt_load_model(path, &stored, sm, &params, &step, err)) sdm_die("%s", err);
    if (sm->storage != r->m->storage || sm->n_params != r->m->n_params)
        sdm_die("%s: the checkpoint's model differs from the configured one (delete run_dir or fix the config)", path);
    size_t n = (size_t)r->m->storage;
    float *mm = (float *)sdm_malloc(4 * n), *vv = (float *)sdm_malloc(4 * n);
    DataLoaderState ls;
    snprintf(path, sizeof path, "%s/state.bin", dir);
    if (!ckpt_load_state(path, n, mm, vv, &ls, sizeof ls, &step, &rng, err)) sdm_die("%s", err);
    char derr[DATA_ERR_LEN];
    if (dataloader_set_state(&r->train, &ls, derr)) sdm_die("%s: %s", path, derr);
    gpu_model_set_params(&r->g, params);
    cudaCheck(cudaMemcpy(r->g.adam_m, mm, 4 * n, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(r->g.adam_v, vv, 4 * n, cudaMemcpyHostToDevice));
    r->step = (long long)step;
    say(r, "resumed from %s at step %lld\n", dir, r->step);
    free(params);
    free(mm);
    free(vv);
    free(sm);
}

static void usage(void) {
    printf("usage: train_sdm -c CONFIG.cfg [key=value ...]\n"
           "  -c FILE     config file (see configs/); later key=value arguments override it\n"
           "  --help      this text and every config key\n"
           "Multi-GPU: rank, world size and local rank come from RANK/WORLD_SIZE/LOCAL_RANK or SLURM_PROCID/\n"
           "SLURM_NTASKS/SLURM_LOCALID; rank 0 serves the NCCL id on MASTER_ADDR:MASTER_PORT (see scripts/).\n\n");
    cfg_print_help(stdout);
}

#ifndef SDM_TESTING
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { usage(); return 0; }

    // 1. configuration, the process layout, the model description
    Run r;
    memset(&r, 0, sizeof r);
    char err[CFG_ERR];
    if (!cfg_from_args(&r.cfg, argc, argv, err)) sdm_die("%s", err);
    const Config *c = &r.cfg;
    r.m = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    model_build(r.m, c);
    BootConfig boot = boot_from_env();
    dist_init(&r.dist, &boot, r.m->storage);
    if (r.dist.rank == 0) {
        mkdir(c->run_dir, 0755);
        char path[CFG_STR + 32];
        snprintf(path, sizeof path, "%s/train.log", c->run_dir);
        r.log = fopen(path, "a");
        snprintf(path, sizeof path, "%s/config.cfg", c->run_dir);
        FILE *fp = fopen(path, "w");
        if (fp) { cfg_dump(c, fp); fclose(fp); }
        model_print_summary(r.m, c, stdout);
    }
    say(&r, "ranks %d | micro-batch %d x %d tokens | %s | est. memory per GPU %.1f GiB\n", r.dist.world,
        c->batch_size, c->seq_len, c->model_dtype, model_train_memory_bytes(r.m, c, r.dist.world) / (1 << 30));

    // 2. data, the model on the GPU, its initial or resumed state
    open_data(&r);
    r.batch = (int32_t *)sdm_malloc(sizeof(int32_t) * c->batch_size * (c->seq_len + 1));
    r.inputs = (int *)sdm_malloc(sizeof(int) * c->batch_size * c->seq_len);
    r.targets = (int *)sdm_malloc(sizeof(int) * c->batch_size * c->seq_len);
    gpu_model_create(&r.g, r.m, c->batch_size, c->seq_len, !strcmp(c->model_dtype, "fp32"), r.dist.world);
    init_params(&r);
    resume(&r);

    // 3. train
    double t0 = now_s(), t_log = t0;
    long long first_step = r.step;
    long long tokens_per_step = (long long)c->batch_size * c->seq_len * c->grad_acc_steps * r.dist.world;
    while (r.step < c->steps) {
        float loss = mean_over_ranks(&r, train_step(&r));
        if (!isfinite(loss)) sdm_die("step %lld: loss is %f; stopping (the last checkpoint is intact)", r.step, loss);
        if (r.step % c->log_freq == 0 || r.step == c->steps) {
            float norm;
            cudaCheck(cudaMemcpy(&norm, r.g.clip_norm, sizeof norm, cudaMemcpyDeviceToHost));
            double t = now_s(), per_step = (t - t_log) / (r.step % c->log_freq ? r.step % c->log_freq : c->log_freq);
            t_log = t;
            say(&r, "step %6lld/%d | loss %.4f | lr %.3e | grad norm %.3f | %.1f ms/step | %.0f tok/s\n", r.step,
                c->steps, loss,
                c->lr * lr_schedule(lr_scheduler_from_name(c->scheduler), r.step - 1, c->warmup, c->steps,
                                    c->lr_min_ratio),
                norm, 1e3 * per_step, tokens_per_step / per_step);
        }
        if ((c->eval_every && r.step % c->eval_every == 0) || (c->probe_freq && r.step % c->probe_freq == 0))
            evaluate(&r);
        if (c->dump_every && r.step % c->dump_every == 0) save_checkpoint(&r);
    }
    if (r.step > first_step && c->dump_every && r.step % c->dump_every) save_checkpoint(&r); // the final state
    say(&r, "done: %lld steps in %.1f s\n", r.step, now_s() - t0);

    gpu_model_destroy(&r.g);
    dataloader_close(&r.train);
    dataloader_close(&r.val);
    dist_destroy(&r.dist);
    if (r.log) fclose(r.log);
    free(r.batch);
    free(r.inputs);
    free(r.targets);
    free(r.m);
    return 0;
}
#endif
