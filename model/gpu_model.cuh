// model/gpu_model.cuh: the hybrid model (docs/MODEL.md) on the GPU, shared by train_sdm and infer_sdm: its flat
// working-weight and gradient arrays, the activations the backward needs, and the forward and backward passes
//   h0 = E[token];  h' = h + Mixer_l(RMSNorm_a(h));  h+ = h' + FFN(RMSNorm_b(h'));  logits = W_out . RMSNorm_f(h^L)
// with the mixers of attention/attention_layer.cuh and sdm/sdm_layer.cuh. Weights and gradients live in flat arrays
// in the order of the model's parameter table (model/model.h); typed views into them (GmWeights, GmGrads) are built
// once, so the passes never look a tensor up by name. The fp32 master weights and AdamW state are the optimizer's
// (model/adamw.cuh AdamWState), owned by the training program. With ZeRO-2 a rank keeps only its shard of the
// gradients: the backward computes them block by block into buckets (model/grad_buckets.h), each summed over the
// ranks into the owners' shards as soon as its block is done, on a stream of its own beside the backward. The passes
// run on the stream their caller passes (training: a stream of its own, which a CUDA graph can capture; inputs from
// pinned host buffers then, see gpu_model_forward and gpu_model_plan_backward).
// Every buffer is allocated through the memory ledger (core/memory.h); a dry run of gpu_model_create is the
// `train_sdm --memory` breakdown. Selective activation recomputation (distributed.selective_act_ckpt): the norm
// outputs and the SwiGLU product are kept for one layer only and recomputed in the backward by the forward's
// kernels, so the step's bits do not change; the layers do the same for their cheap activations (attention gate,
// SDM readout). distributed.recompute_ffn also recomputes the FFN's W1|W3 product (a GEMM: the largest activation,
// [n, 2F] a layer, traded for 2 n D 2F FLOPs a layer).
#ifndef SDM_MODEL_GPU_MODEL_CUH
#define SDM_MODEL_GPU_MODEL_CUH

#include "attention/attention_layer.cuh"
#include "core/dist.cuh"
#include "core/layers.cuh"
#include "core/loss.cuh"
#include "core/matmul.cuh"
#include "core/profile.cuh"
#include "core/sampling.cuh"
#include "model/grad_buckets.h"
#include "model/model.h"
#include "core/shard.h"
#include "sdm/sdm_infer.cuh"
#include "sdm/sdm_layer.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Small kernels

// pred[i] = argmax_v logits[i, v] (first maximum), one warp per row: the greedy next-token predictions.
template <typename T> __global__ void gm_argmax_kernel(int *pred, const T *logits, int ld, int V, int n) {
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
// Typed views of the flat arrays: a pointer per tensor, found by name once by gpu_model_create

// Block l's working weights (compute dtype) and fp32 gradients. The mixer's views are those of its kind.
typedef struct {
    const void *mixer_norm, *ffn_norm; // [D]
    const void *ffn_w13, *ffn_w2;      // [2F, D]: ffn.w1 then ffn.w3 (adjacent, one GEMM); [D, F]
    AttnLayerParams attn;              // attention and SWA layers
    SdmLayerParams sdm;                // SDM layers
} GmBlockWeights;

typedef struct {
    float *mixer_norm, *ffn_norm, *ffn_w13, *ffn_w2;
    AttnLayerGrads attn;
    SdmLayerGrads sdm;
} GmBlockGrads;

typedef struct {
    const void *tok_emb, *norm, *head; // [V, D], [D], [V, D]: lm_head, or tok_emb when tied
    GmBlockWeights *block;             // [L]
} GmWeights;

typedef struct {
    float *tok_emb, *norm, *head; // head == tok_emb when tied: both gradients accumulate into one tensor
    GmBlockGrads *block;          // [L]
} GmGrads;

// ZeRO-2 (model/grad_buckets.h): the buckets the backward computes the gradients in, and their reductions into this
// rank's shard on a stream of their own, beside the backward's stream.
typedef struct {
    Dist *dist;                       // the ranks; NULL: whole gradients (one rank, or ZeRO-1)
    GradBuckets plan;                 // the segments and the buckets' sizes
    float *bucket[GB_BUCKETS];        // fp32 [plan.floats[b]]
    cudaStream_t stream;              // the reductions run here
    cudaEvent_t computed[GB_BUCKETS]; // bucket b holds a complete segment (recorded by the backward)
    cudaEvent_t reduced[GB_BUCKETS];  // bucket b's reduction is done: it may be zeroed again
} GmZero2;

// ------------------------------------------------------------------------------------------------------------------
// The model on the GPU

typedef struct {
    const ModelDesc *m;
    int B, T, n, L, D, F, V, Vp; // n = B*T tokens; Vp: logits row stride (V rounded up to 8)
    Dtype ctype;                 // compute dtype: bf16, or fp32 in the exact mode
    size_t es;                   // its size in bytes
    int recompute;               // selective activation recomputation: xmix, xffn, ffn_h hold one layer
    int recompute_ffn;           // the FFN's W1|W3 product recomputed too: ffn_ab holds one layer
    long long padded;            // flat parameter storage padded to world shards (core/shard.h)
    // parameters and gradients: flat arrays in the model's table order, and typed views into them
    void *work;                       // compute dtype [padded]: the weights the layers read
    float *grads;                     // fp32 [n_grads]: the whole gradient, or with ZeRO-2 this rank's shard of it
    long long n_grads;                // padded, or with ZeRO-2 the shard
    GmWeights weights;                // into work
    GmGrads grad;                     // into grads, or with ZeRO-2 into the buckets
    GmZero2 zero2;
    // activations saved for the backward (compute dtype unless noted)
    void *h;                          // [L+1][n, D] the residual stream entering block l; h[L] leaves the last
    void *hmid;                       // [L][n, D] after the mixer's residual add
    void *xmix, *xffn;                // [L][n, D] RMSNorm outputs: the mixer's and the FFN's inputs ([n, D]: recompute)
    float *rstd_mix, *rstd_ffn;       // [L][n]
    void *ffn_ab;                     // [L][n, 2F] the fused W1|W3 product
    void *ffn_h;                      // [L][n, F] silu(a) * b ([n, F]: recompute)
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
    EmbeddingBackwardPlan emb_plan;
    SdmLayer *sdm;                    // [L], used for SDM layers
    AttnLayer *attn;                  // [L], used for attention layers
    Profiler *prof;                   // NULL: not profiled (gpu_model_set_profiler)
    SdmLayerTemps sdm_tmp;            // the SDM layers' temporaries, one set for all of them
    AttnLayerBwd attn_bw;             // the attention layers' backward temporaries, sized for the largest layer
} GpuModel;

// Where a tensor's values live, for the views: element p->offset of a flat array of es-byte elements ...
static inline auto gm_in_flat(const void *base, size_t es) {
    return [=](const ParamSpec *p) { return (const void *)((const char *)base + p->offset * es); };
}

// ... or, for ZeRO-2's gradients, its place in the bucket of its segment (the segment's first element at element 0).
static inline auto gm_in_buckets(const GmZero2 *z) {
    return [=](const ParamSpec *p) {
        const GradSegment *s = &z->plan.seg[grad_segment_of(&z->plan, p)];
        return (const void *)(z->bucket[s->bucket] + (p->offset - s->lo));
    };
}

// Tensor `suffix` of layer l (l < 0: a top-level tensor) where `place` puts it; NULL when absent. The table must have
// it exactly when `present`: a missing or unexpected tensor stops the build.
template <typename P, typename Place>
static inline P gm_tensor(const ModelDesc *m, Place place, int l, const char *suffix, int present) {
    const ParamSpec *p = l >= 0 ? model_layer_param(m, l, suffix) : model_find(m, suffix);
    if (!p != !present)
        sdm_die("internal: tensor %s of layer %d is %s the parameter table", suffix, l,
                p ? "unexpected in" : "missing from");
    return p ? (P)place(p) : NULL;
}

// Block l's views (GmBlockWeights or GmBlockGrads) where `place` puts the tensors. The SDM input weights wk..wg are
// adjacent in the table (one fused GEMM reads them from wk); the biases each follow an alignment gap, so they are
// passed one by one.
template <typename V, typename Place> static inline V gm_block_view(const ModelDesc *m, int l, Place place) {
    typedef decltype(V::ffn_w2) P; // const void * (weights) or float * (gradients)
    auto at = [&](const char *suffix, int present) { return gm_tensor<P>(m, place, l, suffix, present); };
    V v;
    memset(&v, 0, sizeof v);
    v.mixer_norm = at("mixer_norm", 1);
    v.ffn_norm = at("ffn_norm", 1);
    v.ffn_w13 = at("ffn.w1", 1);
    v.ffn_w2 = at("ffn.w2", 1);
    if (m->kind[l] == LAYER_SDM) {
        const SdmDims *s = &m->sdm;
        P t[SDM_P_COUNT];
#define GM_SDM_TENSOR(name, rows, cols, present, ...) t[SDM_P_##name] = at("sdm." #name, present);
        SDM_PARAMS(GM_SDM_TENSOR)
#undef GM_SDM_TENSOR
        v.sdm.w_in = t[SDM_P_wk];
        static_assert(SDM_P_bk + SDM_B_G == SDM_P_bg, "the layer's bias order SDM_B_* is the list's bk..bg");
        for (int i = 0; i < SDM_B_COUNT; i++) v.sdm.b_in[i] = t[SDM_P_bk + i];
        v.sdm.A_log = t[SDM_P_A_log];
        v.sdm.dt_bias = t[SDM_P_dt_bias];
        v.sdm.ln_w = t[SDM_P_ln_w];
        v.sdm.ln_b = t[SDM_P_ln_b];
        v.sdm.w_out = t[SDM_P_wo];
        v.sdm.b_out = t[SDM_P_bo];
        v.sdm.bank0 = t[SDM_P_bank];
    } else {
        v.attn.wq = at("attn.wq", 1);
        v.attn.wk = at("attn.wk", 1);
        v.attn.wv = at("attn.wv", 1);
        v.attn.wg = at("attn.wg", m->attn[l].gated);
        v.attn.wo = at("attn.wo", 1);
    }
    return v;
}

// The model's views (GmWeights or GmGrads) where `place` puts the tensors; block: [L] views, filled here.
template <typename V, typename B, typename Place>
static inline V gm_view(const ModelDesc *m, Place place, B *block) {
    typedef decltype(V::head) P;
    V v;
    v.tok_emb = gm_tensor<P>(m, place, -1, "tok_emb", 1);
    v.norm = gm_tensor<P>(m, place, -1, "norm", 1);
    P lm_head = gm_tensor<P>(m, place, -1, "lm_head", !m->tied);
    v.head = m->tied ? v.tok_emb : lm_head;
    for (int l = 0; l < m->n_layers; l++) block[l] = gm_block_view<B>(m, l, place);
    v.block = block;
    return v;
}

// row i of a per-layer activation stack of rows x width elements
static inline void *gm_at(const GpuModel *g, void *stack, int layer, size_t width) {
    return (char *)stack + (size_t)layer * g->n * width * g->es;
}

// Layer l's slice of a stack that recomputation shrinks to one slice (xmix, xffn, ffn_h).
static inline void *gm_recomputed_at(const GpuModel *g, void *stack, int layer, size_t width) {
    return g->recompute ? stack : gm_at(g, stack, layer, width);
}

// Layer l's W1|W3 product a|b [n, 2F] (one slice for all layers with recompute_ffn).
static inline void *gm_ffn_ab_at(const GpuModel *g, int layer) {
    return gm_at(g, g->ffn_ab, g->recompute_ffn ? 0 : layer, 2 * (size_t)g->F);
}

// Tensors `second` directly after `first` in layer l (so one GEMM can read both), or die.
static inline void gm_require_adjacent(const ModelDesc *m, int l, const char *first, const char *second) {
    const ParamSpec *a = model_layer_param(m, l, first), *b = model_layer_param(m, l, second);
    if (a && b && a->offset + a->numel != b->offset)
        sdm_die("layer %d: %s and %s are not adjacent in the parameter table (model.dim and the FFN width must be "
                "multiples of %d)", l, first, second, MODEL_ALIGN);
}

// The gradients: whole, or with ZeRO-2 over zero2's ranks this rank's shard of them and the buckets the backward
// computes them in, its reductions' stream and events (none in a dry run).
static inline void gm_grads_create(GpuModel *g, Dist *zero2) {
    g->n_grads = zero2 ? zero2->shard : g->padded;
    g->grads = (float *)device_alloc(MEM_GRADS, g->n_grads * 4);
    device_zero(g->grads, g->n_grads * 4);
    GmBlockGrads *block = (GmBlockGrads *)sdm_calloc(g->L, sizeof(GmBlockGrads));
    if (!zero2) {
        g->grad = gm_view<GmGrads>(g->m, gm_in_flat(g->grads, 4), block);
        return;
    }
    GmZero2 *z = &g->zero2;
    z->dist = zero2;
    grad_buckets_plan(&z->plan, g->m);
    for (int b = 0; b < GB_BUCKETS; b++) z->bucket[b] = (float *)device_alloc(MEM_GRADS, z->plan.floats[b] * 4);
    g->grad = gm_view<GmGrads>(g->m, gm_in_buckets(z), block);
    if (g_mem.dry_run) return;
    cudaCheck(cudaStreamCreateWithFlags(&z->stream, cudaStreamNonBlocking));
    for (int b = 0; b < GB_BUCKETS; b++) {
        cudaCheck(cudaEventCreateWithFlags(&z->computed[b], cudaEventDisableTiming));
        cudaCheck(cudaEventCreateWithFlags(&z->reduced[b], cudaEventDisableTiming));
    }
}

static inline void gm_grads_destroy(GpuModel *g) {
    GmZero2 *z = &g->zero2;
    device_free(g->grads);
    free(g->grad.block);
    if (!z->dist) return;
    for (int b = 0; b < GB_BUCKETS; b++) {
        device_free(z->bucket[b]);
        cudaCheck(cudaEventDestroy(z->computed[b]));
        cudaCheck(cudaEventDestroy(z->reduced[b]));
    }
    cudaCheck(cudaStreamDestroy(z->stream));
}

// What the backward recomputes (gpu_model_create's `recompute`): bit flags.
#define GM_RECOMPUTE 1     // distributed.selective_act_ckpt: norms, SwiGLU, attention gate, SDM readout
#define GM_RECOMPUTE_FFN 2 // distributed.recompute_ffn: the FFN's W1|W3 product

// The model for micro-batches of B x T tokens, parameters padded to `world` shards, recomputing in the backward what
// the GM_RECOMPUTE flags of `recompute` say; zero2: this rank's communicator when it keeps only its shard of the
// gradients (ZeRO-2, zero2->world == world), NULL for whole gradients. In a dry run of the ledger (g_mem.dry_run) only
// the sizes are recorded.
static inline void gpu_model_create(GpuModel *g, const ModelDesc *m, int B, int T, Dtype ctype, int world,
                                    int recompute, Dist *zero2) {
    for (int l = 0; l < m->n_layers; l++) {
        gm_require_adjacent(m, l, "ffn.w1", "ffn.w3");
        for (int i = SDM_P_wk; i < SDM_P_wg; i++) { // the fused input weights
            char first[32], second[32];
            snprintf(first, sizeof first, "sdm.%s", sdm_param_name(i));
            snprintf(second, sizeof second, "sdm.%s", sdm_param_name(i + 1));
            gm_require_adjacent(m, l, first, second);
        }
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
    g->recompute = (recompute & GM_RECOMPUTE) != 0;
    g->recompute_ffn = (recompute & GM_RECOMPUTE_FFN) != 0;
    g->padded = shard_padded(m->storage, world);
    size_t n = (size_t)g->n, D = (size_t)g->D, F = (size_t)g->F, L = (size_t)g->L, P = (size_t)g->padded;
    size_t Lr = g->recompute ? 1 : L, Lab = g->recompute_ffn ? 1 : L; // slices of the recomputed stacks

    matmul_init(); // the cuBLASLt workspace, in the ledger from the start
    gm_grads_create(g, zero2);
    g->work = device_alloc(MEM_WEIGHTS, P * g->es);
    g->weights = gm_view<GmWeights>(m, gm_in_flat(g->work, g->es),
                                    (GmBlockWeights *)sdm_calloc(L, sizeof(GmBlockWeights)));

    g->h = device_alloc(MEM_ACTIVATIONS, (L + 1) * n * D * g->es);
    g->hmid = device_alloc(MEM_ACTIVATIONS, L * n * D * g->es);
    g->xmix = device_alloc(MEM_ACTIVATIONS, Lr * n * D * g->es);
    g->xffn = device_alloc(MEM_ACTIVATIONS, Lr * n * D * g->es);
    g->rstd_mix = (float *)device_alloc(MEM_ACTIVATIONS, L * n * 4);
    g->rstd_ffn = (float *)device_alloc(MEM_ACTIVATIONS, L * n * 4);
    g->ffn_ab = device_alloc(MEM_ACTIVATIONS, Lab * n * 2 * F * g->es);
    g->ffn_h = device_alloc(MEM_ACTIVATIONS, Lr * n * F * g->es);
    g->xfinal = device_alloc(MEM_ACTIVATIONS, n * D * g->es);
    g->rstd_final = (float *)device_alloc(MEM_ACTIVATIONS, n * 4);
    g->logits = device_alloc(MEM_ACTIVATIONS, n * g->Vp * g->es);
    g->losses = (float *)device_alloc(MEM_ACTIVATIONS, n * 4);
    g->loss = (float *)device_alloc(MEM_ACTIVATIONS, 4);
    g->tokens = (int *)device_alloc(MEM_ACTIVATIONS, n * 4);
    g->targets = (int *)device_alloc(MEM_ACTIVATIONS, n * 4);
    g->pred = (int *)device_alloc(MEM_ACTIVATIONS, n * 4);
    g->branch = device_alloc(MEM_SCRATCH, n * D * g->es);
    g->dh = device_alloc(MEM_SCRATCH, n * D * g->es);
    g->dffn_h = device_alloc(MEM_SCRATCH, n * F * g->es);
    g->norm_scratch = (float *)device_alloc(MEM_SCRATCH, rmsnorm_backward_scratch_floats(g->n, g->D) * 4);
    embedding_backward_plan_create(&g->emb_plan, g->n, g->V, g->D);

    // one set of layer temporaries for all layers: the SDM layers share a shape, the attention ones get the largest
    AttnBwdSizes attn_max = {0, 0, 0, 0};
    int any_sdm = 0;
    for (int l = 0; l < g->L; l++) {
        if (m->kind[l] == LAYER_SDM) any_sdm = 1;
        else attn_max = attn_bwd_sizes_max(attn_max, attn_layer_bwd_sizes(&m->attn[l], B, T, ctype, g->recompute));
    }
    if (any_sdm) g->sdm_tmp = sdm_layer_temps_create(&m->sdm, B, T, ctype, g->recompute);
    if (attn_max.q) g->attn_bw = attn_layer_bwd_create(attn_max);
    g->sdm = (SdmLayer *)sdm_calloc(L, sizeof(SdmLayer));
    g->attn = (AttnLayer *)sdm_calloc(L, sizeof(AttnLayer));
    for (int l = 0; l < g->L; l++) {
        if (m->kind[l] == LAYER_SDM) g->sdm[l] = sdm_layer_create(&m->sdm, B, T, ctype, 0, g->recompute, &g->sdm_tmp);
        else g->attn[l] = attn_layer_create(&m->attn[l], B, T, g->ctype, g->recompute, &g->attn_bw);
    }
}

static inline void gpu_model_destroy(GpuModel *g) {
    for (int l = 0; l < g->L; l++) {
        if (g->m->kind[l] == LAYER_SDM) sdm_layer_destroy(&g->sdm[l]);
        else attn_layer_destroy(&g->attn[l]);
    }
    sdm_layer_temps_destroy(&g->sdm_tmp);
    attn_layer_bwd_destroy(&g->attn_bw);
    free(g->sdm);
    free(g->attn);
    free(g->weights.block);
    gm_grads_destroy(g);
    embedding_backward_plan_destroy(&g->emb_plan);
    void *bufs[] = {g->work, g->h, g->hmid, g->xmix, g->xffn, g->rstd_mix, g->rstd_ffn, g->ffn_ab,
                    g->ffn_h, g->xfinal, g->rstd_final, g->logits, g->losses, g->loss, g->tokens, g->targets, g->pred,
                    g->branch, g->dh, g->dffn_h, g->norm_scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) device_free(bufs[i]);
}

// Time the passes by part with `prof` (NULL: stop): the model's own marks and every mixer's.
static inline void gpu_model_set_profiler(GpuModel *g, Profiler *prof) {
    g->prof = prof;
    for (int l = 0; l < g->L; l++) {
        if (g->m->kind[l] == LAYER_SDM) g->sdm[l].prof = prof;
        else g->attn[l].prof = prof;
    }
}

// Parts of the step profile outside the mixers (which mark their own). A mark gives the work of the region before
// it (core/profile.cuh): GEMM FLOPs, or the bytes an element-wise pass must read and write at least.
#define GM_PART_HOST "host, input copies"
#define GM_PART_EMBED "embedding"
#define GM_PART_ELEM "norms, element-wise"
#define GM_PART_FFN "FFN GEMMs"
#define GM_PART_HEAD "LM head"
#define GM_PART_LOSS "loss"
#define GM_PART_GRADS "ZeRO-2 buckets: zero, wait"

static inline void gm_mark(const GpuModel *g, const char *part, double flops, double bytes, cudaStream_t st) {
    prof_mark(g->prof, part, flops, bytes, st);
}

// Bytes of `tensors` tensors [n, width] in the compute dtype.
static inline double gm_bytes(const GpuModel *g, double tensors, int n, int width) {
    return tensors * n * width * g->es;
}

// The working weights from host fp32 [m->storage] (the padding zero), `piece` floats at a time through a staging
// buffer: the same cast of the same values as from a whole device copy, without one (a ZeRO-1 rank holds only its
// shard of the fp32 master weights, and inference none).
static inline void gpu_model_set_params_in_pieces(GpuModel *g, const float *host, long long piece) {
    device_upload_fp32_as(g->work, g->ctype, host, g->m->storage, piece);
    size_t real = (size_t)g->m->storage * g->es;
    cudaCheck(cudaMemset((char *)g->work + real, 0, (size_t)g->padded * g->es - real)); // the padding
}

static inline void gpu_model_set_params(GpuModel *g, const float *host) {
    gpu_model_set_params_in_pieces(g, host, (long long)(MEM_STAGE_BYTES / sizeof(float)));
}

// Mixer of layer l: y = Mixer(x) (forward, saving what its backward needs).
static inline void gm_mixer_forward(GpuModel *g, int l, const void *x, void *y, cudaStream_t st) {
    const GmBlockWeights *w = &g->weights.block[l];
    if (g->m->kind[l] == LAYER_SDM) sdm_layer_forward(&g->sdm[l], &w->sdm, x, y, st);
    else attn_layer_forward(&g->attn[l], &w->attn, x, y, st);
}

// dx (overwritten) and the mixer's parameter gradients (+=) from dy.
static inline void gm_mixer_backward(GpuModel *g, int l, const void *x, const void *dy, void *dx, cudaStream_t st) {
    const GmBlockWeights *w = &g->weights.block[l];
    const GmBlockGrads *d = &g->grad.block[l];
    if (g->m->kind[l] == LAYER_SDM) sdm_layer_backward(&g->sdm[l], &w->sdm, x, dy, dx, &d->sdm, st);
    else attn_layer_backward(&g->attn[l], &w->attn, &d->attn, x, dy, dx, st);
}

// SwiGLU FFN of block w on n rows: y [n, D] = W2 (silu(a) * b) with a|b [n, 2F] = x W1|W3ᵀ in one GEMM (the two
// are adjacent in the parameter table); ab and hf [n, F] keep the intermediates when `keep` (training's backward
// reads them), else a few rows (inference) take the SwiGLU in the GEMM's store, the same bits in hf alone.
// norm (inference, not with keep): x's input norm (core/matmul_small_m.cuh MatmulParts.norm; x its buffer) or NULL.
static inline void gm_ffn_forward(const GpuModel *g, const GmBlockWeights *w, const void *x, const ResidualNorm *norm,
                                  void *ab, void *hf, void *y, int n, int keep, cudaStream_t st) {
    int D = g->D, F = g->F;
    if (keep && norm) sdm_die("gm_ffn_forward: an input norm is for inference, which keeps no intermediates");
    if (keep || !matmul_forward_swiglu(hf, x, w->ffn_w13, g->ctype, n, F, D, st, norm)) {
        matmul_forward(ab, g->ctype, 2 * F, x, w->ffn_w13, NULL, g->ctype, n, 2 * F, D, st);
        gm_mark(g, GM_PART_FFN, 2.0 * n * D * 2 * F, 0, st);
        swiglu_forward(hf, ab, (char *)ab + F * g->es, 2 * F, g->ctype, n, F, st);
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 3, n, F), st);
    }
    matmul_forward(y, g->ctype, D, hf, w->ffn_w2, NULL, g->ctype, n, D, F, st);
    gm_mark(g, GM_PART_FFN, 2.0 * n * D * F, 0, st);
}

// The norm after block l: the next block's mixer norm, or the final norm after the last block.
static inline const void *gm_next_norm(const GpuModel *g, int l) {
    return l == g->L - 1 ? g->weights.norm : g->weights.block[l + 1].mixer_norm;
}

// Forward over tokens/targets (host int32 [n]) on stream st. Leaves the mean loss in g->loss; with dscale != 0 the
// logits are overwritten by dscale * d(sum of losses)/d(logits), ready for gpu_model_backward. The inputs are copied
// on st: pageable host memory is read before this returns; a captured step passes pinned buffers, which its copy
// nodes read at every replay.
static inline void gpu_model_forward(GpuModel *g, const int *tokens, const int *targets, float dscale,
                                     cudaStream_t st) {
    const GmWeights *w = &g->weights;
    int n = g->n, D = g->D, F = g->F;
    float eps = (float)g->m->norm_eps;
    cudaCheck(cudaMemcpyAsync(g->tokens, tokens, sizeof(int) * n, cudaMemcpyHostToDevice, st));
    cudaCheck(cudaMemcpyAsync(g->targets, targets, sizeof(int) * n, cudaMemcpyHostToDevice, st));
    gm_mark(g, GM_PART_HOST, PROF_NA, PROF_NA, st);
    embedding_forward(g->h, w->tok_emb, g->tokens, g->ctype, n, D, st);
    gm_mark(g, GM_PART_EMBED, 0, gm_bytes(g, 2, n, D), st);
    rmsnorm_forward(g->xmix, g->rstd_mix, g->h, w->block[0].mixer_norm, g->ctype, n, D, eps, st);
    gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 2, n, D), st);
    for (int l = 0; l < g->L; l++) {
        void *h = gm_at(g, g->h, l, D), *hmid = gm_at(g, g->hmid, l, D), *ab = gm_ffn_ab_at(g, l);
        void *xffn = gm_recomputed_at(g, g->xffn, l, D), *hf = gm_recomputed_at(g, g->ffn_h, l, F);
        gm_mixer_forward(g, l, gm_recomputed_at(g, g->xmix, l, D), g->branch, st);
        residual_rmsnorm_forward(hmid, xffn, g->rstd_ffn + (size_t)l * n, h, g->branch, w->block[l].ffn_norm,
                                 g->ctype, n, D, eps, st);
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 4, n, D), st);
        gm_ffn_forward(g, &w->block[l], xffn, NULL, ab, hf, g->branch, n, 1, st);
        int last = l == g->L - 1;
        residual_rmsnorm_forward(gm_at(g, g->h, l + 1, D), last ? g->xfinal : gm_recomputed_at(g, g->xmix, l + 1, D),
                                 last ? g->rstd_final : g->rstd_mix + (size_t)(l + 1) * n, hmid, g->branch,
                                 gm_next_norm(g, l), g->ctype, n, D, eps, st);
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 4, n, D), st);
    }
    matmul_forward(g->logits, g->ctype, g->Vp, g->xfinal, w->head, NULL, g->ctype, n, g->V, D, st);
    gm_mark(g, GM_PART_HEAD, 2.0 * n * g->V * D, 0, st);
    cross_entropy_forward_backward(g->logits, g->Vp, g->targets, g->losses, g->ctype, n, g->V, dscale, st);
    loss_mean(g->loss, g->losses, n, st);
    gm_mark(g, GM_PART_LOSS, 0, gm_bytes(g, 2, n, g->Vp), st);
}

// Recomputation: what layer l's FFN backward reads (its input norm and SwiGLU product with `recompute`, the W1|W3
// product with `recompute_ffn`) or the mixer's input norm, by the forward's kernels on the forward's stored inputs
// and buffers, so the bits are the forward's (rstd is rewritten with the values it holds).
static inline void gm_recompute_ffn(GpuModel *g, int l, cudaStream_t st) {
    int n = g->n, D = g->D, F = g->F;
    void *ab = gm_ffn_ab_at(g, l);
    if (g->recompute) {
        rmsnorm_forward(g->xffn, g->rstd_ffn + (size_t)l * n, gm_at(g, g->hmid, l, D), g->weights.block[l].ffn_norm,
                        g->ctype, n, D, (float)g->m->norm_eps, st);
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 2, n, D), st);
    }
    if (g->recompute_ffn) {
        matmul_forward(ab, g->ctype, 2 * F, gm_recomputed_at(g, g->xffn, l, D), g->weights.block[l].ffn_w13, NULL,
                       g->ctype, n, 2 * F, D, st);
        gm_mark(g, GM_PART_FFN, 2.0 * n * D * 2 * F, 0, st);
    }
    if (g->recompute) {
        swiglu_forward(g->ffn_h, ab, (char *)ab + F * g->es, 2 * F, g->ctype, n, F, st);
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 3, n, F), st);
    }
}

static inline void gm_recompute_mixer_input(GpuModel *g, int l, cudaStream_t st) {
    int n = g->n, D = g->D;
    rmsnorm_forward(g->xmix, g->rstd_mix + (size_t)l * n, gm_at(g, g->h, l, D), g->weights.block[l].mixer_norm,
                    g->ctype, n, D, (float)g->m->norm_eps, st);
}

// ZeRO-2 (model/grad_buckets.h; no-ops with whole gradients). Segments: 0 the embedding, l + 1 block l, L + 1 the
// head. Segment s's bucket is zeroed for the backward to compute the segment in, once its last reduction is done.
static inline void gm_segment_open(GpuModel *g, int s, cudaStream_t st) {
    GmZero2 *z = &g->zero2;
    if (!z->dist) return;
    const GradSegment *seg = &z->plan.seg[s];
    cudaCheck(cudaStreamWaitEvent(st, z->reduced[seg->bucket], 0));
    cudaCheck(cudaMemsetAsync(z->bucket[seg->bucket], 0, sizeof(float) * (seg->hi - seg->lo), st));
    gm_mark(g, GM_PART_GRADS, 0, 4.0 * (seg->hi - seg->lo), st);
}

// Segment s is complete: its bucket is summed over the ranks into their shards on the reductions' stream, while the
// backward goes on.
static inline void gm_segment_reduce(GpuModel *g, int s, cudaStream_t st) {
    GmZero2 *z = &g->zero2;
    if (!z->dist) return;
    const GradSegment *seg = &z->plan.seg[s];
    int b = seg->bucket;
    cudaCheck(cudaEventRecord(z->computed[b], st));
    cudaCheck(cudaStreamWaitEvent(z->stream, z->computed[b], 0));
    dist_reduce_add(z->dist, z->bucket[b], seg->lo, seg->hi, g->grads, z->stream);
    cudaCheck(cudaEventRecord(z->reduced[b], z->stream));
}

// The backward's stream waits for every reduction: the shard is complete, the buckets are free for the next one.
static inline void gm_segments_join(GpuModel *g, cudaStream_t st) {
    GmZero2 *z = &g->zero2;
    if (!z->dist) return;
    for (int b = 0; b < GB_BUCKETS; b++) cudaCheck(cudaStreamWaitEvent(st, z->reduced[b], 0));
    gm_mark(g, GM_PART_GRADS, PROF_NA, PROF_NA, st);
}

// The plan gpu_model_backward reads, for the forward's host tokens [n]: the embedding backward's (core/layers.cuh),
// built on the host into plan [gpu_model_plan_ints(g)] (host; pinned for a captured step, which copies it at every
// replay), so no step computes on the host between its kernels.
static inline size_t gpu_model_plan_ints(const GpuModel *g) { return emb_plan_ints(&g->emb_plan); }

static inline void gpu_model_plan_backward(GpuModel *g, const int *tokens, int *plan) {
    embedding_backward_plan_fill(&g->emb_plan, tokens, plan);
}

// Accumulate (+=) every parameter gradient after gpu_model_forward with dscale != 0, on stream st; plan: that
// forward's tokens' (gpu_model_plan_backward), copied on st like the forward's inputs. With ZeRO-2 the gradients are
// computed in the buckets and added, summed over ranks, to this rank's shard g->grads, complete when st reaches the
// end of this call.
static inline void gpu_model_backward(GpuModel *g, const int *plan, cudaStream_t st) {
    const GmWeights *w = &g->weights;
    const GmGrads *d = &g->grad;
    int n = g->n, D = g->D, F = g->F;
    gm_segment_open(g, 0, st); // the embedding's bucket, where a tied LM head's gradient goes too
    gm_segment_open(g, g->L + 1, st);
    // LM head and final norm
    matmul_backward_weight(d->head, DT_FP32, g->logits, g->Vp, g->xfinal, g->ctype, n, g->V, D, 1, st);
    matmul_backward_input(g->branch, g->ctype, g->logits, g->Vp, w->head, g->ctype, n, g->V, D, 0, st);
    gm_mark(g, GM_PART_HEAD, 4.0 * n * g->V * D, 0, st);
    rmsnorm_backward(g->dh, d->norm, g->norm_scratch, g->branch, gm_at(g, g->h, g->L, D), w->norm, g->rstd_final,
                     g->ctype, n, D, 0, st);
    gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 3, n, D), st);
    gm_segment_reduce(g, g->L + 1, st);
    for (int l = g->L - 1; l >= 0; l--) {
        const GmBlockWeights *wl = &w->block[l];
        const GmBlockGrads *dl = &d->block[l];
        gm_segment_open(g, l + 1, st);
        // FFN branch: dh = d h[l+1], also the residual part of d hmid[l]
        void *ab = gm_ffn_ab_at(g, l), *bb = (char *)ab + F * g->es;
        if (g->recompute || g->recompute_ffn) gm_recompute_ffn(g, l, st);
        matmul_backward_weight(dl->ffn_w2, DT_FP32, g->dh, D, gm_recomputed_at(g, g->ffn_h, l, F), g->ctype, n, D, F,
                               1, st);
        matmul_backward_input(g->dffn_h, g->ctype, g->dh, D, wl->ffn_w2, g->ctype, n, D, F, 0, st);
        gm_mark(g, GM_PART_FFN, 4.0 * n * D * F, 0, st);
        swiglu_backward(ab, bb, 2 * F, g->dffn_h, ab, bb, 2 * F, g->ctype, n, F, st); // ab becomes d(W1|W3 product)
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 5, n, F), st);
        matmul_backward_weight(dl->ffn_w13, DT_FP32, ab, 2 * F, gm_recomputed_at(g, g->xffn, l, D), g->ctype, n, 2 * F,
                               D, 1, st);
        matmul_backward_input(g->branch, g->ctype, ab, 2 * F, wl->ffn_w13, g->ctype, n, 2 * F, D, 0, st);
        gm_mark(g, GM_PART_FFN, 4.0 * n * 2 * F * D, 0, st);
        rmsnorm_backward(g->dh, dl->ffn_norm, g->norm_scratch, g->branch, gm_at(g, g->hmid, l, D), wl->ffn_norm,
                         g->rstd_ffn + (size_t)l * n, g->ctype, n, D, 1, st);
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 4, n, D), st);
        // mixer branch: dh = d hmid[l], also the residual part of d h[l]
        if (g->recompute) {
            gm_recompute_mixer_input(g, l, st);
            gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 2, n, D), st);
        }
        gm_mixer_backward(g, l, gm_recomputed_at(g, g->xmix, l, D), g->dh, g->branch, st);
        rmsnorm_backward(g->dh, dl->mixer_norm, g->norm_scratch, g->branch, gm_at(g, g->h, l, D), wl->mixer_norm,
                         g->rstd_mix + (size_t)l * n, g->ctype, n, D, 1, st);
        gm_mark(g, GM_PART_ELEM, 0, gm_bytes(g, 4, n, D), st);
        gm_segment_reduce(g, l + 1, st);
    }
    embedding_backward_plan_upload(&g->emb_plan, plan, st);
    gm_mark(g, GM_PART_HOST, PROF_NA, PROF_NA, st);
    embedding_backward(d->tok_emb, g->dh, g->ctype, &g->emb_plan, st);
    gm_mark(g, GM_PART_EMBED, 0, gm_bytes(g, 1, n, D), st);
    gm_segment_reduce(g, 0, st);
    gm_segments_join(g, st);
}

// g->pred[n] (device) = the greedy next-token prediction at every position of the last forward.
static inline void gpu_model_argmax(GpuModel *g) {
    DTYPE_DISPATCH(g->ctype, "argmax",
                 gm_argmax_kernel<T><<<ceil_div(g->n, 8), 256>>>(g->pred, (const T *)g->logits, g->Vp, g->V, g->n));
    cudaCheckLast();
}

// The mean loss of the last forward (a copy on the legacy stream: it waits for a forward there, as evaluation runs).
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
    void *h[2];                    // [rows, D] compute dtype: the residual stream entering a block, after its mixer
    void *x, *branch;              // [rows, D]: a norm's output (where no product computes it), a block's branch
    void *ab, *hf;                 // [rows, 2F], [rows, F] FFN intermediates
    float *logits;                 // [streams, Vp] fp32 on the device: row b = the next-token logits of stream b
    float *logits_host;            // [streams, Vp]
    int *prompt;                   // device [max_tokens]: the prompt of a prefill
    int *next;                     // device [streams]: each stream's next input token (the last sampled one)
    int *next_host;                // pinned [2, streams]: the sampled ids read back, two steps' (gpu_infer_step_launch)
    cudaEvent_t ids_ready[2];      // each half of next_host written
    int *pos_dev;                  // device [streams]: each stream's next position (that of its newest token)
    int *pos;                      // host [streams]: the same (pos[b] = positions processed so far)
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
    for (int i = 0; i < 2; i++) I->h[i] = device_alloc(MEM_ACTIVATIONS, rows * D * g->es);
    I->x = device_alloc(MEM_ACTIVATIONS, rows * D * g->es);
    I->branch = device_alloc(MEM_ACTIVATIONS, rows * D * g->es);
    I->ab = device_alloc(MEM_ACTIVATIONS, rows * 2 * F * g->es);
    I->hf = device_alloc(MEM_ACTIVATIONS, rows * F * g->es);
    I->logits = (float *)device_alloc(MEM_ACTIVATIONS, S * g->Vp * 4);
    cudaCheck(cudaMemset(I->logits, 0, S * g->Vp * 4)); // columns V..Vp-1 are never written, yet copied to the host
    I->logits_host = (float *)sdm_malloc(S * g->Vp * 4);
    I->prompt = (int *)device_alloc(MEM_ACTIVATIONS, (size_t)max_tokens * 4);
    I->next = (int *)device_alloc(MEM_ACTIVATIONS, S * 4);
    cudaCheck(cudaMallocHost((void **)&I->next_host, 2 * S * 4));
    for (int i = 0; i < 2; i++) cudaCheck(cudaEventCreateWithFlags(&I->ids_ready[i], cudaEventDisableTiming));
    I->pos_dev = (int *)device_alloc(MEM_ACTIVATIONS, S * 4);
    I->pos = (int *)sdm_calloc(S, sizeof(int));
    I->rng = (Rng *)device_alloc(MEM_ACTIVATIONS, S * sizeof(Rng));
    I->probs = (double *)device_alloc(MEM_ACTIVATIONS, S * g->V * sizeof(double));
    I->order = (int *)device_alloc(MEM_ACTIVATIONS, S * g->V * 4);
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
    void *bufs[] = {I->h[0], I->h[1], I->x, I->branch, I->ab, I->hf, I->logits, I->prompt, I->next, I->pos_dev,
                    I->rng, I->probs, I->order};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) device_free(bufs[i]);
    cudaCheck(cudaFreeHost(I->next_host));
    for (int i = 0; i < 2; i++) cudaCheck(cudaEventDestroy(I->ids_ready[i]));
    cudaCheck(cudaStreamDestroy(I->stream));
    free(I->sdm);
    free(I->attn);
    free(I->logits_host);
    free(I->pos);
    free(I->graph);
    memset(I, 0, sizeof *I);
}

// Stream b's position is now p: host and device copies.
static inline void gpu_infer_set_pos(GpuInferState *I, int b, int p) {
    I->pos[b] = p;
    cudaCheck(cudaMemcpyAsync(I->pos_dev + b, I->pos + b, sizeof(int), cudaMemcpyHostToDevice, I->stream));
    cudaCheck(cudaStreamSynchronize(I->stream)); // the host values may change before an asynchronous copy reads them
}

// Stream b (b < 0: every stream) starts afresh: its SDM banks become copies of M0 (or zeros), its position 0.
static inline void gpu_infer_reset(GpuInferState *I, int b) {
    for (int l = 0; l < I->g->L; l++)
        if (I->g->m->kind[l] == LAYER_SDM) sdm_infer_reset(&I->sdm[l], &I->g->weights.block[l].sdm, b, I->stream);
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

// Mixer of layer l on the n rows that `norm` normalizes (ResidualNorm), into I->branch: a prefill of stream b (b >= 0),
// whose input is normalized into I->x first (a gated attention layer's prefill reads it twice), or a decode step of
// streams 0..n-1, whose input product takes the norm (I->x its buffer).
static inline void gpu_infer_mixer(GpuInferState *I, int l, int b, int n, const ResidualNorm *norm) {
    const GmBlockWeights *w = &I->g->weights.block[l];
    if (b >= 0) residual_norm_forward(norm, I->x, I->g->ctype, n, I->g->D, I->stream);
    if (I->g->m->kind[l] == LAYER_SDM) {
        if (b >= 0) sdm_infer_prefill(&I->sdm[l], &w->sdm, b, I->x, I->branch, n, I->stream);
        else sdm_infer_decode(&I->sdm[l], &w->sdm, I->x, norm, I->branch, n, I->stream);
    } else {
        if (b >= 0) attn_infer_prefill(&I->attn[l], &w->attn, b, I->x, I->branch, n, I->stream);
        else attn_infer_decode(&I->attn[l], &w->attn, I->x, norm, I->branch, I->pos_dev, n, I->stream);
    }
}

// The model on n tokens[n] (device; see gpu_infer_mixer for b); the logits of the last n_out rows go to rows
// first..first+n_out-1 of I->logits. Each norm is the input norm of the product after it (ResidualNorm: its kernel
// runs first, in the product's call), which reads the stream from one of I->h and writes the sum to the other: h[0]
// enters each block (the embedding first), h[1] leaves its mixer.
static inline void gpu_infer_run(GpuInferState *I, const int *tokens, int b, int n, int n_out, int first) {
    const GpuModel *g = I->g;
    int D = g->D;
    float eps = (float)g->m->norm_eps;
    const GmWeights *w = &g->weights;
    cudaStream_t st = I->stream;
    embedding_forward(I->h[0], w->tok_emb, tokens, g->ctype, n, D, st);
    ResidualNorm norm = {I->h[0], NULL, NULL, w->block[0].mixer_norm, eps};
    for (int l = 0; l < g->L; l++) {
        gpu_infer_mixer(I, l, b, n, &norm); // every row: the banks and KV caches take all of them
        // after the last mixer only the n_out logits rows go on (a prefill's other rows would feed nothing)
        int r = l == g->L - 1 ? n - n_out : 0, m = n - r;
        size_t off = (size_t)r * D * g->es;
        void *h0 = (char *)I->h[0] + off, *h1 = (char *)I->h[1] + off, *x = (char *)I->x + off;
        void *br = (char *)I->branch + off;
        norm = (ResidualNorm){h0, br, h1, w->block[l].ffn_norm, eps};
        gm_ffn_forward(g, &w->block[l], x, &norm, I->ab, I->hf, br, m, 0, st);
        norm = (ResidualNorm){h1, br, h0, gm_next_norm(g, l), eps};
    }
    const void *last = (const char *)I->x + (size_t)(n - n_out) * D * g->es;
    matmul_forward(I->logits + (size_t)first * g->Vp, DT_FP32, g->Vp, last, w->head, NULL, g->ctype, n_out, g->V, D,
                   st, &norm);
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

// Positions of streams 0..n-1 advance by one on the device (the host mirrors it).
__global__ void gpu_infer_advance_kernel(int *pos, int n) {
    pdl_enter();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) pos[i]++;
}

// Enqueue one decode step of streams 0..n-1 on their next tokens: logits rows 0..n-1, positions + 1, and with
// `sample` the next tokens drawn into I->next.
static inline void gpu_infer_enqueue_decode(GpuInferState *I, int n, int sample) {
    gpu_infer_run(I, I->next, -1, n, n, 0);
    launch_pdl(gpu_infer_advance_kernel, ceil_div(n, 256), 256, 0, I->stream, I->pos_dev, n);
    if (sample) sample_tokens(I->logits, I->g->Vp, I->g->V, n, &I->sp, I->rng, I->probs, I->order, I->next, I->stream);
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

// A decode step of streams 0..n-1 captured as a graph (the caller destroys it). Relaxed capture: the first GEMM of a
// process may allocate cuBLASLt's workspace.
static inline cudaGraph_t gpu_infer_capture_decode(GpuInferState *I, int n) {
    cudaGraph_t graph;
    cudaCheck(cudaStreamBeginCapture(I->stream, cudaStreamCaptureModeRelaxed));
    gpu_infer_enqueue_decode(I, n, 1);
    cudaCheck(cudaStreamEndCapture(I->stream, &graph));
    return graph;
}

// graph[n], captured on first use.
static inline cudaGraphExec_t gpu_infer_graph(GpuInferState *I, int n) {
    if (!I->graph[n]) {
        cudaGraph_t graph = gpu_infer_capture_decode(I, n);
        cudaCheck(cudaGraphInstantiate(&I->graph[n], graph, 0));
        cudaCheck(cudaGraphDestroy(graph));
    }
    return I->graph[n];
}

// Launch a decode step of streams 0..n-1 on their next tokens, sampling the token after each (I->sp): replays
// graph[n] (use_graph) or launches the same kernels one by one, then copies the n sampled ids into half `half` of
// I->next_host. Nothing waits: the next step may be launched before gpu_infer_step_ids reads these (the sampled
// tokens it reads never leave the device).
static inline void gpu_infer_step_launch(GpuInferState *I, int n, int use_graph, int half) {
    gpu_infer_count_step(I, n);
    if (use_graph) cudaCheck(cudaGraphLaunch(gpu_infer_graph(I, n), I->stream));
    else gpu_infer_enqueue_decode(I, n, 1);
    int *ids = I->next_host + (size_t)half * I->streams;
    cudaCheck(cudaMemcpyAsync(ids, I->next, sizeof(int) * n, cudaMemcpyDeviceToHost, I->stream));
    cudaCheck(cudaEventRecord(I->ids_ready[half], I->stream));
}

// The ids of the step last launched into half `half` (host, valid until a step is launched into it again): the
// step's only synchronisation.
static inline const int *gpu_infer_step_ids(GpuInferState *I, int half) {
    cudaCheck(cudaEventSynchronize(I->ids_ready[half]));
    return I->next_host + (size_t)half * I->streams;
}

// One decode step of streams 0..n-1, waited for: returns its n sampled ids (see gpu_infer_step_launch).
static inline const int *gpu_infer_step(GpuInferState *I, int n, int use_graph) {
    gpu_infer_step_launch(I, n, use_graph, 0);
    return gpu_infer_step_ids(I, 0);
}

// `steps` decode steps of streams 0..n-1 as generation runs them (model/generate.cuh): each launched before the
// host reads the ids of the one before, so the GPU never waits for the host (infer_sdm --bench). Returns the last
// step's ids.
static inline const int *gpu_infer_steps_ahead(GpuInferState *I, int n, int use_graph, int steps) {
    for (int i = 0; i < steps; i++) {
        gpu_infer_step_launch(I, n, use_graph, i % 2);
        if (i > 0) gpu_infer_step_ids(I, (i - 1) % 2);
    }
    return gpu_infer_step_ids(I, (steps - 1) % 2);
}

// Whether a decode step of streams 0..n-1 fits their KV caches (gpu_infer_count_step would refuse it otherwise).
static inline int gpu_infer_step_fits(const GpuInferState *I, int n) {
    for (int i = 0; i < n; i++)
        if (I->full_attention && I->pos[i] >= I->max_tokens) return 0;
    return 1;
}

#endif
