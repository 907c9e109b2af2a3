// model/model.h: the model description shared by every program: layer kinds, per-layer dims, and the ordered
// parameter table (name, shape, init rule, weight decay) built from a Config (docs/MODEL.md#parameter-table).
//
// Parameters live in one flat array in table order. Within a layer, tensors that one GEMM can consume together are
// adjacent: attention wq, wk, wv (, wg); SDM wk, wq, wv, wa, wb (, wg) then their biases in the same order; FFN w1, w3.
#ifndef SDM_MODEL_MODEL_H
#define SDM_MODEL_MODEL_H

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "attention/attn_dims.h"
#include "core/common.h"
#include "core/config.h"
#include "core/rng.h"
#include "sdm/sdm_dims.h"
#include "sdm/sdm_params.h"

typedef enum { LAYER_ATTN = 0, LAYER_SWA, LAYER_SDM } LayerKind;
static const char *const LAYER_KIND_NAMES[] = {"attn", "swa", "sdm"};

typedef enum { INIT_TRUNC_NORMAL = 0, INIT_ONES, INIT_ZEROS, INIT_A_LOG, INIT_DT_BIAS } InitRule;

typedef struct {
    char name[64];     // e.g. "layers.3.sdm.wk"
    int ndim;
    long long shape[2];
    long long numel;
    long long offset;  // into the flat parameter array: a multiple of MODEL_ALIGN
    InitRule init;
    double std, bound; // INIT_TRUNC_NORMAL: normal(0, std) truncated to [-bound, bound]
    int decay;         // AdamW weight decay applies (all but SDM A_log and dt_bias)
    int layer;         // -1 outside blocks
    int is_bank;       // the learned initial SDM bank M0 (state, not counted as model size)
    int is_embedding;  // token embedding or LM head
} ParamSpec;

#define MODEL_MAX_PARAMS (CFG_MAX_LAYERS * 32 + 8)
// tensors start at multiples of 8 elements: 16-byte aligned in bf16, as vector loads and cuBLASLt like
#define MODEL_ALIGN 8

typedef struct {
    int n_layers, dim, vocab, ffn_hidden, tied;
    double norm_eps;
    LayerKind kind[CFG_MAX_LAYERS];
    AttnDims attn[CFG_MAX_LAYERS]; // valid for LAYER_ATTN and LAYER_SWA layers
    SdmDims sdm;                   // shared by every SDM layer
    double A_lo, A_hi;             // SDM A init range
    int n_params;
    ParamSpec params[MODEL_MAX_PARAMS];
    long long total, n_bank, n_embedding, n_nonembedding; // parameter counts
    long long storage; // length of the flat parameter array: total plus the alignment gaps (zeros)
} ModelDesc;

// FFN hidden width of docs/MODEL.md#swiglu-ffn
static inline int model_ffn_hidden(int dim, int multiple_of, double multiplier) {
    long long hidden = 4LL * dim;
    hidden = 2 * hidden / 3;
    if (multiplier > 0) hidden = (long long)(multiplier * (double)hidden);
    return (int)(multiple_of * ((hidden + multiple_of - 1) / multiple_of));
}

// depth factor phi_l of docs/MODEL.md#initialisation
static inline double model_depth_factor(const Config *c, int layer) {
    if (!strcmp(c->init_std_factor, "global_depth")) return sqrt(2.0 * (c->n_layers + 1));
    if (!strcmp(c->init_std_factor, "current_depth")) return sqrt(2.0 * (layer + 1));
    if (!strcmp(c->init_std_factor, "dim_ratio")) return c->dim / 4096.0;
    return 1.0;
}

static inline SdmAct model_sdm_act(const char *name) {
    if (!strcmp(name, "l2_normalize")) return SDM_ACT_L2_NORMALIZE;
    if (!strcmp(name, "identity")) return SDM_ACT_IDENTITY;
    if (!strcmp(name, "sigmoid")) return SDM_ACT_SIGMOID;
    return SDM_ACT_SOFTMAX;
}

static inline SdmSnapshot model_snapshot(const char *name) {
    if (!strcmp(name, "bf16")) return SDM_SNAP_BF16;
    if (!strcmp(name, "fp8")) return SDM_SNAP_FP8;
    if (!strcmp(name, "int4")) return SDM_SNAP_INT4;
    return SDM_SNAP_NONE;
}

// SDM layer dims from the config (docs/SDM.md#hyper-parameters: unset factors mean two of sqrt N).
static inline SdmDims model_sdm_dims(const Config *c) {
    SdmDims s;
    memset(&s, 0, sizeof s);
    s.dim = c->dim;
    s.heads = c->sdm_heads;
    s.head_dim = c->dim / c->sdm_heads;
    s.slots = c->sdm_slots;
    if (c->sdm_factors.n == 0) {
        s.n_factors = 2;
        s.factor_dims[0] = s.factor_dims[1] = (int)llround(sqrt((double)c->sdm_slots));
    } else {
        s.n_factors = c->sdm_factors.n;
        for (int f = 0; f < s.n_factors; f++) s.factor_dims[f] = (int)c->sdm_factors.v[f];
    }
    for (int f = 0; f < s.n_factors; f++) s.key_dim += s.factor_dims[f];
    s.writes = c->sdm_writes;
    s.reads = c->sdm_reads;
    s.chunk = c->sdm_chunk;
    s.write_act = model_sdm_act(c->write_act);
    s.read_act = model_sdm_act(c->read_act);
    s.write_scale = (float)c->write_act_scale;
    s.read_scale = (float)c->read_act_scale;
    s.key_weighted_decay = c->key_weighted_decay;
    s.learned_bank = c->backprop_on_memory;
    s.normalize_readings = c->normalize_readings;
    s.output_gate = c->output_gate;
    s.norm_eps = (float)c->sdm_norm_eps;
    s.snapshot = model_snapshot(c->snapshot_quant);
    s.bank_fp32 = !strcmp(c->bank_dtype, "fp32") || !strcmp(c->model_dtype, "fp32"); // all-fp32 mode: bank too
    s.grad_bank_bf16 = !strcmp(c->grad_bank_dtype, "bf16") && strcmp(c->model_dtype, "fp32"); // and its gradient
    return s;
}

// Attention head configuration of docs/MODEL.md#attention for a full (swa = 0) or sliding-window layer.
static inline AttnDims model_attn_dims(const Config *c, int swa) {
    AttnDims a;
    memset(&a, 0, sizeof a);
    a.dim = c->dim;
    a.rope_theta = c->rope_theta;
    if (!swa) {
        a.head_dim = c->head_dim ? c->head_dim : c->dim / c->n_heads;
        a.n_heads = c->n_heads;
        a.n_kv_heads = c->n_kv_heads ? c->n_kv_heads : a.n_heads;
        a.gated = c->attn_gate || c->full_attn_gate; // docs/MODEL.md#attention
    } else {
        a.n_heads = c->swa_n_heads ? c->swa_n_heads : c->n_heads;
        a.n_kv_heads = c->swa_n_kv_heads ? c->swa_n_kv_heads
                                         : (c->swa_n_heads ? a.n_heads : (c->n_kv_heads ? c->n_kv_heads : a.n_heads));
        a.head_dim = c->swa_head_dim ? c->swa_head_dim : c->dim / a.n_heads;
        a.window = c->swa_window;
        a.gated = c->attn_gate;
    }
    return a;
}

static inline ParamSpec *model_add(ModelDesc *m, int layer, const char *name, long long rows, long long cols,
                                   InitRule init, double std, double bound) {
    if (m->n_params >= MODEL_MAX_PARAMS) sdm_die("internal: too many parameter tensors");
    ParamSpec *p = &m->params[m->n_params++];
    memset(p, 0, sizeof *p);
    if (layer >= 0) snprintf(p->name, sizeof p->name, "layers.%d.%s", layer, name);
    else snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = cols > 0 ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = cols > 0 ? cols : 1;
    p->numel = rows * p->shape[1];
    p->offset = (m->storage + MODEL_ALIGN - 1) / MODEL_ALIGN * MODEL_ALIGN;
    p->init = init;
    p->std = std;
    p->bound = bound;
    p->decay = 1;
    p->layer = layer;
    m->total += p->numel;
    m->storage = p->offset + p->numel;
    return p;
}

// weight of shape [rows, cols] drawn from TN(std) truncated at +-3 std
static inline void model_add_tn(ModelDesc *m, int layer, const char *name, long long rows, long long cols, double std) {
    model_add(m, layer, name, rows, cols, INIT_TRUNC_NORMAL, std, 3 * std);
}

static inline void model_add_attention(ModelDesc *m, int l, const AttnDims *a, double s0, double phi) {
    long long q = (long long)a->n_heads * a->head_dim, kv = (long long)a->n_kv_heads * a->head_dim;
    model_add_tn(m, l, "attn.wq", q, a->dim, s0);
    model_add_tn(m, l, "attn.wk", kv, a->dim, s0);
    model_add_tn(m, l, "attn.wv", kv, a->dim, s0);
    if (a->gated) model_add_tn(m, l, "attn.wg", q, a->dim, s0);
    model_add(m, l, "attn.wo", a->dim, q, INIT_TRUNC_NORMAL, s0 / phi, 3 * s0); // bound not scaled by phi
}

// The tensors of sdm/sdm_params.h present in this configuration; ss: the layer's std of the truncated normals.
static inline void model_add_sdm(ModelDesc *m, int l, const SdmDims *s, double ss) {
#define MODEL_ADD_SDM(name, rows, cols, present, init, decay_flag)                                                  \
    if (present) {                                                                                                 \
        int tn = INIT_##init == INIT_TRUNC_NORMAL;                                                                 \
        ParamSpec *p = model_add(m, l, "sdm." #name, rows, cols, INIT_##init, tn ? ss : 0, tn ? 3 * ss : 0);       \
        p->decay = decay_flag;                                                                                     \
        p->is_bank = SDM_P_##name == SDM_P_bank;                                                                   \
    }
    SDM_PARAMS(MODEL_ADD_SDM)
#undef MODEL_ADD_SDM
}

// Build the model description from a validated config.
static inline void model_build(ModelDesc *m, const Config *c) {
    memset(m, 0, sizeof *m);
    m->n_layers = c->n_layers;
    m->dim = c->dim;
    m->vocab = c->vocab_size;
    m->tied = c->weight_tying;
    m->norm_eps = c->norm_eps;
    m->ffn_hidden = model_ffn_hidden(c->dim, c->multiple_of, c->ffn_dim_multiplier);
    m->A_lo = c->A_init_range.v[0];
    m->A_hi = c->A_init_range.v[1];
    int any_sdm = 0;
    for (int l = 0; l < c->n_layers; l++) {
        m->kind[l] = cfg_layer_in(&c->sdm_at, l) ? LAYER_SDM : cfg_layer_in(&c->swa_at, l) ? LAYER_SWA : LAYER_ATTN;
        if (m->kind[l] != LAYER_SDM) m->attn[l] = model_attn_dims(c, m->kind[l] == LAYER_SWA);
        any_sdm |= m->kind[l] == LAYER_SDM;
    }
    if (any_sdm) m->sdm = model_sdm_dims(c);

    double s0 = c->init_base_std > 0 ? c->init_base_std : 1.0 / sqrt((double)c->dim);
    double s2 = c->init_base_std > 0 ? c->init_base_std : 1.0 / sqrt((double)m->ffn_hidden);
    ParamSpec *emb = model_add(m, -1, "tok_emb", c->vocab_size, c->dim, INIT_TRUNC_NORMAL, s0, 3 * s0);
    emb->is_embedding = 1;
    for (int l = 0; l < c->n_layers; l++) {
        double phi = model_depth_factor(c, l);
        model_add(m, l, "mixer_norm", c->dim, 0, INIT_ONES, 0, 0);
        if (m->kind[l] == LAYER_SDM) model_add_sdm(m, l, &m->sdm, s0 / phi);
        else model_add_attention(m, l, &m->attn[l], s0, phi);
        model_add(m, l, "ffn_norm", c->dim, 0, INIT_ONES, 0, 0);
        model_add_tn(m, l, "ffn.w1", m->ffn_hidden, c->dim, s0);
        model_add_tn(m, l, "ffn.w3", m->ffn_hidden, c->dim, s0);
        model_add_tn(m, l, "ffn.w2", c->dim, m->ffn_hidden, s2 / phi);
    }
    model_add(m, -1, "norm", c->dim, 0, INIT_ONES, 0, 0);
    if (!m->tied) model_add(m, -1, "lm_head", c->vocab_size, c->dim, INIT_TRUNC_NORMAL, s0, 3 * s0)->is_embedding = 1;
    for (int i = 0; i < m->n_params; i++) {
        if (m->params[i].is_embedding) m->n_embedding += m->params[i].numel;
        if (m->params[i].is_bank) m->n_bank += m->params[i].numel;
    }
    m->n_nonembedding = m->total - m->n_embedding - m->n_bank;
}

// The tensor `name` ("layers.3.sdm.wk", "norm", ...) or NULL.
static inline const ParamSpec *model_find(const ModelDesc *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->params[i].name, name)) return &m->params[i];
    return NULL;
}

// The tensor `suffix` of layer l ("sdm.wk") or NULL.
static inline const ParamSpec *model_layer_param(const ModelDesc *m, int l, const char *suffix) {
    char name[64];
    snprintf(name, sizeof name, "layers.%d.%s", l, suffix);
    return model_find(m, name);
}

// The elements AdamW updates within [lo, hi) of the flat array (a ZeRO-1 shard, or everything), as runs: adjacent
// tensors (no alignment gap between them) with one weight-decay flag, clipped to [lo, hi); the gaps are in none.
// Call with *next = 0, then again while it returns 1: each call gives the next run [*a, *b) and its flag *decay.
// Plain C, so tests/test_zero1.c updates its shards through the walk of model/adamw.cuh's adamw_update_model.
static inline int model_decay_run(const ModelDesc *m, long long lo, long long hi, int *next, long long *a,
                                  long long *b, int *decay) {
    *a = *b = 0;
    *decay = 0;
    for (; *next < m->n_params; (*next)++) {
        const ParamSpec *p = &m->params[*next];
        long long x = SDM_MAX(lo, p->offset), y = SDM_MIN(hi, p->offset + p->numel);
        if (x >= y) continue;                                    // outside the range
        if (*b > *a && (x != *b || p->decay != *decay)) return 1; // tensor *next starts the next run
        if (*b == *a) { *a = x; *decay = p->decay; }
        *b = y;
    }
    return *b > *a;
}

// SDM gate parameters at init (docs/MODEL.md#initialisation): A_log = log(max(U(A_lo, A_hi), 1e-4)), and dt_bias the
// inverse softplus of dt = max(exp(U(ln 0.001, ln 0.1)), 1e-4), so that softplus(a + dt_bias) starts near dt. One draw
// each.
static inline double model_init_A_log(Rng *r, double A_lo, double A_hi) {
    return log(fmax(rng_range(r, A_lo, A_hi), 1e-4));
}

static inline double model_init_dt_bias(Rng *r) {
    double dt = fmax(exp(rng_range(r, log(0.001), log(0.1))), 1e-4);
    return dt + log(-expm1(-dt));
}

#define MODEL_INIT_BLOCK 65536 // values drawn from one RNG stream

// Initialise block `block` of tensor `index` (its values [block*MODEL_INIT_BLOCK, ...)) into out, tensor-relative
// (docs/MODEL.md#initialisation). Each block draws from its own stream, derived from the seed, the tensor's index and
// the block, so the values do not depend on how the work is split over threads.
static inline void model_init_block(const ModelDesc *m, int index, unsigned long long seed, long long block,
                                    float *out) {
    const ParamSpec *p = &m->params[index];
    Rng r =
        rng_make((seed * 1000003ull + (unsigned long long)index) * 0x9E3779B97F4A7C15ull + (unsigned long long)block);
    long long end = SDM_MIN(p->numel, (block + 1) * MODEL_INIT_BLOCK);
    for (long long i = block * MODEL_INIT_BLOCK; i < end; i++) {
        double v = 0;
        switch (p->init) {
        case INIT_TRUNC_NORMAL: v = rng_trunc_normal(&r, p->std, p->bound); break;
        case INIT_ONES: v = 1; break;
        case INIT_ZEROS: v = 0; break;
        case INIT_A_LOG: v = model_init_A_log(&r, m->A_lo, m->A_hi); break;
        case INIT_DT_BIAS: v = model_init_dt_bias(&r); break;
        }
        out[i] = (float)v;
    }
}

static inline long long model_init_blocks(const ParamSpec *p) {
    return (p->numel + MODEL_INIT_BLOCK - 1) / MODEL_INIT_BLOCK;
}

static inline void model_init_tensor(const ModelDesc *m, int index, unsigned long long seed, float *out) {
    for (long long b = 0; b < model_init_blocks(&m->params[index]); b++) model_init_block(m, index, seed, b, out);
}

typedef struct { const ModelDesc *m; unsigned long long seed; float *storage; int thread, threads; } ModelInitJob;

// Thread `thread` of `threads` takes every threads-th (tensor, block) pair.
static inline void *model_init_worker(void *arg) {
    const ModelInitJob *j = (const ModelInitJob *)arg;
    long long job = 0;
    for (int i = 0; i < j->m->n_params; i++)
        for (long long b = 0; b < model_init_blocks(&j->m->params[i]); b++, job++)
            if (job % j->threads == j->thread)
                model_init_block(j->m, i, j->seed, b, j->storage + j->m->params[i].offset);
    return NULL;
}

// Every tensor of the flat storage [m->storage] (alignment gaps zero), on `threads` threads (the 2B parameters of
// the flagship take about a minute on one core).
static inline void model_init_all(const ModelDesc *m, unsigned long long seed, float *storage, int threads) {
    memset(storage, 0, sizeof(float) * (size_t)m->storage);
    threads = SDM_MAX(1, SDM_MIN(threads, 64));
    pthread_t tid[64];
    ModelInitJob jobs[64];
    for (int t = 0; t < threads; t++) {
        ModelInitJob j = {m, seed, storage, t, threads};
        jobs[t] = j;
        if (pthread_create(&tid[t], NULL, model_init_worker, &jobs[t]) != 0) sdm_die("cannot start an init thread");
    }
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
}

static inline void model_print_summary(const ModelDesc *m, const Config *c, FILE *fp) {
    long long per_kind[3] = {0, 0, 0}, ffn = 0, norms = 0;
    int count[3] = {0, 0, 0};
    for (int l = 0; l < m->n_layers; l++) count[m->kind[l]]++;
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        if (p->is_embedding || p->is_bank) continue;
        if (strstr(p->name, "norm") && !strstr(p->name, "sdm.")) norms += p->numel;
        else if (strstr(p->name, ".ffn.")) ffn += p->numel;
        else per_kind[m->kind[p->layer]] += p->numel;
    }
    fprintf(fp, "model %s: %d layers, dim %d, vocab %d, FFN hidden %d, %s head\n", c->name, m->n_layers, m->dim,
            m->vocab, m->ffn_hidden, m->tied ? "tied" : "untied");
    fprintf(fp, "  layer types:");
    for (int l = 0; l < m->n_layers; l++) fprintf(fp, " %s", LAYER_KIND_NAMES[m->kind[l]]);
    fprintf(fp, "\n");
    fprintf(fp, "  %-36s %16s\n", "parameters", "count");
    for (int k = 0; k < 3; k++)
        if (count[k])
            fprintf(fp, "  %-36s %16lld  (%d x %lld)\n", k == LAYER_SDM ? "SDM mixers (no bank)"
                                                          : k == LAYER_SWA ? "SWA mixers" : "full-attention mixers",
                    per_kind[k], count[k], per_kind[k] / count[k]);
    fprintf(fp, "  %-36s %16lld  (%d x %lld)\n", "FFN", ffn, m->n_layers, ffn / m->n_layers);
    fprintf(fp, "  %-36s %16lld\n", "norms", norms);
    fprintf(fp, "  %-36s %16lld\n", "non-embedding (no bank)", m->n_nonembedding);
    fprintf(fp, "  %-36s %16lld\n", "embedding + output", m->n_embedding);
    fprintf(fp, "  %-36s %16lld\n", "learned bank (all layers)", m->n_bank);
    fprintf(fp, "  %-36s %16lld\n", "total incl. bank", m->total);
}

// Weights of the matrices every token is multiplied by: the 2-D tensors but the SDM bank and the token embedding
// (a lookup; when tied it is the LM head and counts once).
static inline long long model_matmul_params(const ModelDesc *m) {
    long long n = 0;
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        if (p->ndim == 2 && !p->is_bank && (m->tied || strcmp(p->name, "tok_emb"))) n += p->numel;
    }
    return n;
}

// Model FLOPs of one training token (forward and backward) at sequence length T, the numerator of MFU
// (docs/MODEL.md#model-flops): 6 per matmul weight, plus 12 d_h per query head and visible key of each attention
// layer (averaged over the T positions). The SDM op, the addressing, norms and element-wise work are not counted.
static inline double model_flops_per_token(const ModelDesc *m, int T) {
    double flops = 6.0 * (double)model_matmul_params(m);
    for (int l = 0; l < m->n_layers; l++)
        if (m->kind[l] != LAYER_SDM) {
            const AttnDims *a = &m->attn[l];
            flops += 12.0 * a->n_heads * a->head_dim * attn_mask_pairs(T, a->window) / T;
        }
    return flops;
}

#endif
