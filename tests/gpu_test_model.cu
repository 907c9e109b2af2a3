// tests/gpu_test_model.cu: the whole training step on the GPU (model/gpu_model.cuh) against the double-precision
// CPU oracle (model/model_ref.h): the loss and the gradient of every parameter tensor, in the all-fp32 mode and in
// bf16; the working weights loaded in pieces; bitwise determinism of repeated steps; the same bits on a stream of
// its own (train_sdm's, with programmatic dependent launch) and from the step captured as a CUDA graph and replayed on
// other inputs; the same bits with selective activation recomputation on; a few AdamW steps (fp32 and bf16 moments)
// that must lower the loss of a fixed batch; ZeRO-2's gradient buckets on one rank; and the memory ledger against
// the device's own count.
#include "model/adamw.cuh"
#include "core/config.h"
#include "model/gpu_model.cuh"
#include "model/model_ref.h"
#include "tests/test.h"

// All-fp32 mode: relative error of the loss and of each tensor's gradient. (1e-4, not the kernels' 1e-5: a bias
// gradient is a sum over tokens that cancels, so its relative error grows with the cancellation.)
#define TOL_FP32 1e-4
// bf16 model: weights, activations and logits rounded to 8 bits, and a rounded sub-key score can move a slot in or
// out of the top-k, which changes that token's gradients outright. So a bf16 step is held to its loss and to the
// error of the whole gradient vector; the kernels' own tests hold bf16 to 1e-2 on inputs without such flips.
#define TOL_BF16_LOSS 1e-2
#define TOL_BF16_GRAD 0.25

static ModelDesc g_desc;

typedef struct {
    const char *name;
    const char *lines;
    int B, T;
} Case;

// Head dims 64 (the GPU attention supports 64 and 128); SDM row width 64.
static const Case CASES[] = {
    {"full attn GQA + gated SWA w=5 + SDM H=2 (learned bank, gate, norm), T ragged for C=4",
     "model.dim = 128\nmodel.n_layers = 3\nmodel.n_heads = 2\nmodel.n_kv_heads = 1\nmodel.vocab_size = 11\n"
     "model.multiple_of = 32\nmodel.attn_gate = true\nmodel.attn_at = 0\nmodel.swa_at = 1\nmodel.sdm_at = 2\n"
     "model.swa_window = 5\nsdm.num_heads = 2\nsdm.slots_per_head = 64\nsdm.num_writes = 4\nsdm.num_reads = 3\n"
     "sdm.chunk_size = 4\nsdm.backprop_on_memory = true\nsdm.output_gate = true\nsdm.normalize_readings = true\n"
     "sdm.A_init_range = 0.5,4\n",
     2, 14},
    {"tied head, SDM H=1 with 3 factors, key-weighted decay, zero bank, chunk 16 > T; full attn",
     "model.dim = 64\nmodel.n_layers = 2\nmodel.n_heads = 1\nmodel.vocab_size = 13\nmodel.multiple_of = 32\n"
     "model.weight_tying = true\nmodel.sdm_at = 0\nmodel.attn_at = 1\nsdm.num_heads = 1\nsdm.slots_per_head = 64\n"
     "sdm.product_key_factor_dims = 4,4,4\nsdm.num_writes = 5\nsdm.num_reads = 2\nsdm.chunk_size = 16\n"
     "sdm.key_weighted_decay = true\nsdm.backprop_on_memory = false\nsdm.A_init_range = 0.5,4\n",
     3, 9},
};

static int build_case(const Case *c, Config *cfg, const char *dtype) {
    char err[CFG_ERR], line[512];
    cfg_defaults(cfg);
    if (!cfg_parse_text(cfg, c->lines, "case", err)) { CHECK(0, "%s: %s", c->name, err); return 0; }
    snprintf(line, sizeof line, "distributed.model_dtype = %s", dtype);
    if (!cfg_apply_line(cfg, line, "case", err) || !cfg_validate(cfg, err)) {
        CHECK(0, "%s: %s", c->name, err);
        return 0;
    }
    model_build(&g_desc, cfg);
    return 1;
}

// Random parameters away from their symmetric init (biases, norms), rounded to fp32 so both sides see the same.
static void random_params(const ModelDesc *m, double *params, float *host, Rng *r) {
    model_ref_init(m, 777, params);
    for (long long i = 0; i < m->storage; i++) {
        params[i] += 0.1 * rng_normal(r);
        host[i] = (float)params[i];
        params[i] = host[i];
    }
}

static double *download_grads(const GpuModel *g) {
    size_t n = (size_t)g->m->storage;
    float *f = (float *)sdm_malloc(4 * n);
    double *d = (double *)sdm_malloc(8 * n);
    cudaCheck(cudaMemcpy(f, g->grads, 4 * n, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) d[i] = f[i];
    free(f);
    return d;
}

// n values of a device buffer in the compute dtype, as doubles
static void download_act(double *out, const void *dev, size_t n, Dtype t) {
    size_t es = dtype_size(t);
    unsigned char *h = (unsigned char *)sdm_malloc(n * es);
    cudaCheck(cudaMemcpy(h, dev, n * es, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) {
        if (t == DT_FP32) out[i] = ((float *)h)[i];
        else {
            uint32_t bits = (uint32_t)((uint16_t *)h)[i] << 16;
            float f;
            memcpy(&f, &bits, 4);
            out[i] = f;
        }
    }
    free(h);
}

// Where GPU and CPU part ways: the residual stream per layer, and for SDM layers the selected slots.
static void report_forward(const GpuModel *g, double *params, const int *tokens, const int *targets, int B, int T) {
    const ModelDesc *m = g->m;
    size_t nd = (size_t)g->n * g->D;
    ModelRefActs acts;
    model_ref_forward(m, params, tokens, targets, B, T, &acts);
    double *got = (double *)sdm_malloc(sizeof(double) * nd), *normed = (double *)sdm_malloc(sizeof(double) * nd);
    for (int l = 0; l < g->L; l++) {
        download_act(got, gm_at(g, g->hmid, l, g->D), nd, g->ctype);
        double e_mid = rel_error(got, acts.hmid + nd * l, nd);
        download_act(got, gm_at(g, g->h, l + 1, g->D), nd, g->ctype);
        printf("  layer %d (%s): after mixer rel err %.2e, after FFN %.2e", l, LAYER_KIND_NAMES[m->kind[l]], e_mid,
               rel_error(got, acts.h + nd * (l + 1), nd));
        if (m->kind[l] == LAYER_SDM) { // the slots the CPU selects from its own input
            ref_rmsnorm_forward(acts.h + nd * l, model_ref_tensor(m, params, l, "mixer_norm"), normed, g->n, g->D,
                                m->norm_eps);
            SdmRefTrace tr = sdm_ref_trace_alloc(&m->sdm, B, T);
            SdmRefParams p = model_ref_sdm_params(model_ref_sdm(m, params, l));
            sdm_layer_forward_trace_ref(&m->sdm, B, T, &p, normed, &tr);
            size_t nw = (size_t)g->n * m->sdm.heads * m->sdm.writes, nr = (size_t)g->n * m->sdm.heads * m->sdm.reads;
            int *ws = (int *)sdm_malloc(4 * nw), *rs = (int *)sdm_malloc(4 * nr);
            cudaCheck(cudaMemcpy(ws, g->sdm[l].wslot, 4 * nw, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(rs, g->sdm[l].rslot, 4 * nr, cudaMemcpyDeviceToHost));
            int diff_w = 0, diff_r = 0;
            for (size_t i = 0; i < nw; i++) diff_w += ws[i] != tr.wslot[i];
            for (size_t i = 0; i < nr; i++) diff_r += rs[i] != tr.rslot[i];
            printf(", slots differing: %d of %zu writes, %d of %zu reads", diff_w, nw, diff_r, nr);
            free(ws);
            free(rs);
            sdm_ref_trace_free(&tr);
        }
        printf("\n");
    }
    model_ref_acts_free(&acts);
    free(got);
    free(normed);
}

// gpu_model_backward on stream st after gpu_model_forward on tokens, with their plan built here.
static void backward(GpuModel *g, const int *tokens, cudaStream_t st) {
    int *plan = (int *)sdm_malloc(sizeof(int) * gpu_model_plan_ints(g));
    gpu_model_plan_backward(g, tokens, plan);
    gpu_model_backward(g, plan, st);
    cudaCheck(cudaStreamSynchronize(st));
    free(plan);
}

// One micro-batch's gradients from zero on stream st (0: the legacy stream); returns its loss.
static float step_grads(GpuModel *g, const int *tokens, const int *targets, cudaStream_t st) {
    cudaCheck(cudaMemsetAsync(g->grads, 0, sizeof(float) * g->n_grads, st));
    gpu_model_forward(g, tokens, targets, 1.0f / g->n, st);
    backward(g, tokens, st);
    cudaCheck(cudaDeviceSynchronize());
    return gpu_model_loss(g);
}

// The working weights loaded through a staging buffer of 1000 floats (pieces that end inside tensors and divide
// nothing) have the bits of the load in one piece, the padding zero; in fp32 they are the host values themselves.
static void check_set_params_in_pieces(GpuModel *g, const float *host, const char *name, const char *dtype) {
    size_t bytes = (size_t)g->padded * g->es, real = (size_t)g->m->storage * g->es;
    char *whole = (char *)sdm_malloc(bytes), *pieces = (char *)sdm_malloc(bytes);
    gpu_model_set_params_in_pieces(g, host, g->padded);
    cudaCheck(cudaMemcpy(whole, g->work, bytes, cudaMemcpyDeviceToHost));
    gpu_model_set_params_in_pieces(g, host, 1000);
    cudaCheck(cudaMemcpy(pieces, g->work, bytes, cudaMemcpyDeviceToHost));
    int padding = 0;
    for (size_t i = real; i < bytes; i++) padding += whole[i] != 0;
    CHECK(g->m->storage > 2000 && !memcmp(whole, pieces, bytes) && padding == 0, "%s [%s]: the working weights "
          "loaded in pieces differ from one piece, or the padding is not zero (%d bytes)", name, dtype, padding);
    if (g->ctype == DT_FP32)
        CHECK(!memcmp(whole, host, real), "%s [fp32]: the working weights are not the host values", name);
    free(whole);
    free(pieces);
}

// g's gradients of the batch [n] (downloaded, fp32 [storage]) after one micro-batch (accumulate = 0) or after one
// more on top of the last.
static float *micro_batch_grads(GpuModel *g, const int *tokens, const int *targets, int accumulate) {
    if (accumulate) {
        gpu_model_forward(g, tokens, targets, 1.0f / g->n, 0);
        backward(g, tokens, 0);
    } else {
        step_grads(g, tokens, targets, 0);
    }
    float *f = (float *)sdm_malloc(4 * g->m->storage);
    cudaCheck(cudaMemcpy(f, g->grads, 4 * g->m->storage, cudaMemcpyDeviceToHost));
    return f;
}

// ZeRO-2's buckets (model/grad_buckets.h) on one rank, where the shard is the whole padded array: every gradient the
// backward writes must land in its segment's bucket and reach the shard, so one micro-batch gives the bits of the
// whole gradients of g. A second one accumulates in the shard: the same up to the grouping of each element's terms
// (the embedding's two kernels add to the running sum on one side, to the micro-batch's bucket on the other), a few
// fp32 roundings of the partial sums.
static void check_zero2_one_rank(const Case *c, const char *dtype, GpuModel *g, const int *tokens,
                                 const int *targets) {
    const ModelDesc *m = g->m;
    Dist one = dist_layout(0, 1, m->storage);
    GpuModel z;
    gpu_model_create(&z, m, c->B, c->T, g->ctype, 1, 0, &one);
    cudaCheck(cudaMemcpy(z.work, g->work, g->padded * g->es, cudaMemcpyDeviceToDevice));
    int bad = 0;
    for (int accumulate = 0; accumulate < 2; accumulate++) {
        float *whole = micro_batch_grads(g, tokens, targets, accumulate);
        float *shard = micro_batch_grads(&z, tokens, targets, accumulate);
        double err = 0, norm = 0;
        for (long long i = 0; i < m->storage; i++) {
            err += ((double)shard[i] - whole[i]) * ((double)shard[i] - whole[i]);
            norm += (double)whole[i] * whole[i];
        }
        bad += accumulate ? !(sqrt(err) <= 1e-6 * sqrt(norm)) : memcmp(whole, shard, 4 * m->storage) != 0;
        free(whole);
        free(shard);
    }
    CHECK(bad == 0, "%s [%s]: ZeRO-2's gradient shard on one rank differs from the whole gradients (%d of 2 "
          "micro-batches)", c->name, dtype, bad);
    gpu_model_destroy(&z);
}

// The step as train_sdm runs it: on a non-blocking stream of its own (its kernels then launch with programmatic
// dependent launch, core/cuda_common.cuh), and captured as a CUDA graph whose copies read pinned inputs and plan,
// replayed on a second batch, the first and the second again. Each gives the loss and gradient bits of the eager step
// on the legacy stream on its batch.
static void check_own_stream_and_graph(const Case *c, const char *dtype, GpuModel *g, const int *tokens,
                                       const int *targets) {
    int n = g->n;
    size_t bytes = 4 * (size_t)g->m->storage, plan_bytes = sizeof(int) * gpu_model_plan_ints(g);
    int *tokens2 = (int *)sdm_malloc(sizeof(int) * n), *targets2 = (int *)sdm_malloc(sizeof(int) * n);
    Rng r = rng_make(77);
    for (int i = 0; i < n; i++) {
        tokens2[i] = (int)rng_below(&r, (uint32_t)g->m->vocab);
        targets2[i] = (int)rng_below(&r, (uint32_t)g->m->vocab);
    }
    const int *tok[2] = {tokens, tokens2}, *tgt[2] = {targets, targets2};
    float want_loss[2], *want[2], *got = (float *)sdm_malloc(bytes);
    for (int b = 0; b < 2; b++) {
        want_loss[b] = step_grads(g, tok[b], tgt[b], 0);
        want[b] = (float *)sdm_malloc(bytes);
        cudaCheck(cudaMemcpy(want[b], g->grads, bytes, cudaMemcpyDeviceToHost));
    }
    cudaStream_t st;
    cudaCheck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float loss = step_grads(g, tokens, targets, st);
    cudaCheck(cudaMemcpy(got, g->grads, bytes, cudaMemcpyDeviceToHost));
    CHECK(loss == want_loss[0] && !memcmp(got, want[0], bytes), "%s [%s]: the step on a stream of its own differs "
          "from the legacy stream's", c->name, dtype);

    int *in_tokens, *in_targets, *in_plan;
    float *out_loss;
    cudaCheck(cudaMallocHost((void **)&in_tokens, sizeof(int) * n));
    cudaCheck(cudaMallocHost((void **)&in_targets, sizeof(int) * n));
    cudaCheck(cudaMallocHost((void **)&in_plan, plan_bytes));
    cudaCheck(cudaMallocHost((void **)&out_loss, sizeof(float)));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaCheck(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed));
    cudaCheck(cudaMemsetAsync(g->grads, 0, sizeof(float) * g->n_grads, st));
    gpu_model_forward(g, in_tokens, in_targets, 1.0f / g->n, st);
    gpu_model_backward(g, in_plan, st);
    cudaCheck(cudaMemcpyAsync(out_loss, g->loss, sizeof(float), cudaMemcpyDeviceToHost, st));
    cudaCheck(cudaStreamEndCapture(st, &graph));
    cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
    int bad = 0;
    for (int replay = 0; replay < 3; replay++) {
        int b = replay == 1 ? 0 : 1;
        memcpy(in_tokens, tok[b], sizeof(int) * n);
        memcpy(in_targets, tgt[b], sizeof(int) * n);
        gpu_model_plan_backward(g, tok[b], in_plan);
        cudaCheck(cudaGraphLaunch(exec, st));
        cudaCheck(cudaStreamSynchronize(st));
        cudaCheck(cudaMemcpy(got, g->grads, bytes, cudaMemcpyDeviceToHost));
        bad += *out_loss != want_loss[b] || memcmp(got, want[b], bytes) != 0;
    }
    printf("  own stream and CUDA graph: %d of 3 replays differ from the eager step\n", bad);
    CHECK(bad == 0, "%s [%s]: %d of 3 replays of the captured step differ from the eager step on their batch",
          c->name, dtype, bad);
    cudaCheck(cudaGraphExecDestroy(exec));
    cudaCheck(cudaGraphDestroy(graph));
    cudaCheck(cudaStreamDestroy(st));
    void *pinned[] = {in_tokens, in_targets, in_plan, out_loss};
    for (size_t i = 0; i < sizeof pinned / sizeof pinned[0]; i++) cudaCheck(cudaFreeHost(pinned[i]));
    free(want[0]);
    free(want[1]);
    free(got);
    free(tokens2);
    free(targets2);
}

static void check_case(const Case *c, const char *dtype) {
    int fp32 = !strcmp(dtype, "fp32");
    Config cfg;
    if (!build_case(c, &cfg, dtype)) return;
    const ModelDesc *m = &g_desc;
    int n = c->B * c->T;
    printf("case: %s [%s]\n", c->name, dtype);
    Rng r = rng_make(2024);
    double *params = (double *)sdm_malloc(sizeof(double) * m->storage);
    double *ref_grads = (double *)sdm_malloc(sizeof(double) * m->storage);
    float *host = (float *)sdm_calloc((size_t)m->storage, sizeof(float));
    int *tokens = (int *)sdm_malloc(sizeof(int) * n), *targets = (int *)sdm_malloc(sizeof(int) * n);
    random_params(m, params, host, &r);
    for (int i = 0; i < n; i++) {
        tokens[i] = (int)rng_below(&r, (uint32_t)m->vocab);
        targets[i] = (int)rng_below(&r, (uint32_t)m->vocab);
    }
    double ref_loss = model_ref_backward(m, params, tokens, targets, c->B, c->T, ref_grads);

    GpuModel g;
    gpu_model_create(&g, m, c->B, c->T, fp32 ? DT_FP32 : DT_BF16, 1, 0, NULL);
    gpu_model_set_params(&g, host);
    check_set_params_in_pieces(&g, host, c->name, dtype);
    double loss = step_grads(&g, tokens, targets, 0);
    report_forward(&g, params, tokens, targets, c->B, c->T);
    double err = fabs(loss - ref_loss) / fabs(ref_loss);
    printf("  loss gpu %.8f cpu %.8f rel err %.2e\n", loss, ref_loss, err);
    double tol = fp32 ? TOL_FP32 : TOL_BF16_LOSS;
    CHECK(err <= tol, "%s [%s]: loss rel err %.3e > %.1e", c->name, dtype, err, tol);
    double *grads = download_grads(&g);
    for (int t = 0; t < m->n_params; t++) {
        const ParamSpec *p = &m->params[t];
        double e = rel_error(grads + p->offset, ref_grads + p->offset, (size_t)p->numel);
        printf("  %-28s rel err %.2e%s\n", p->name, e, !fp32 || e <= TOL_FP32 ? "" : "  FAIL");
        if (fp32) CHECK(e <= TOL_FP32, "%s: d loss / d %s rel err %.3e > %.1e", c->name, p->name, e, TOL_FP32);
    }
    if (!fp32) {
        double e = rel_error(grads, ref_grads, (size_t)m->storage);
        printf("  whole gradient rel err %.2e\n", e);
        CHECK(e <= TOL_BF16_GRAD, "%s [bf16]: whole-gradient rel err %.3e > %.2f", c->name, e, TOL_BF16_GRAD);
    }

    // determinism: a second step on the same inputs gives the same bits
    float *bits1 = (float *)sdm_malloc(4 * m->storage), *bits2 = (float *)sdm_malloc(4 * m->storage);
    cudaCheck(cudaMemcpy(bits1, g.grads, 4 * m->storage, cudaMemcpyDeviceToHost));
    double loss2 = step_grads(&g, tokens, targets, 0);
    cudaCheck(cudaMemcpy(bits2, g.grads, 4 * m->storage, cudaMemcpyDeviceToHost));
    CHECK(loss2 == loss && !memcmp(bits1, bits2, 4 * m->storage), "%s [%s]: a repeated step differs", c->name, dtype);
    check_own_stream_and_graph(c, dtype, &g, tokens, targets);

    // selective activation recomputation: the same step with norms, SwiGLU, gates and readout recomputed in the
    // backward gives the same bits, and keeps fewer activations
    size_t acts_off = g_mem.bytes[MEM_ACTIVATIONS];
    GpuModel gr;
    gpu_model_create(&gr, m, c->B, c->T, g.ctype, 1, 1, NULL);
    gpu_model_set_params(&gr, host);
    double loss_r = step_grads(&gr, tokens, targets, 0);
    cudaCheck(cudaMemcpy(bits2, gr.grads, 4 * m->storage, cudaMemcpyDeviceToHost));
    size_t acts_on = g_mem.bytes[MEM_ACTIVATIONS] - acts_off;
    printf("  recompute on: loss %.8f, activations %zu bytes (off: %zu)\n", loss_r, acts_on, acts_off);
    CHECK(loss_r == loss && !memcmp(bits1, bits2, 4 * m->storage), "%s [%s]: recompute on and off differ", c->name,
          dtype);
    CHECK(acts_on < acts_off, "%s [%s]: recompute keeps %zu bytes of activations, off %zu", c->name, dtype, acts_on,
          acts_off);
    gpu_model_destroy(&gr);
    // the FFN's W1|W3 product recomputed too (GEMM by GEMM the forward's call), with and without the rest
    const int ffn_flags[2] = {GM_RECOMPUTE | GM_RECOMPUTE_FFN, GM_RECOMPUTE_FFN};
    for (int k = 0; k < 2; k++) {
        size_t acts0 = g_mem.bytes[MEM_ACTIVATIONS];
        gpu_model_create(&gr, m, c->B, c->T, g.ctype, 1, ffn_flags[k], NULL);
        gpu_model_set_params(&gr, host);
        double loss_f = step_grads(&gr, tokens, targets, 0);
        cudaCheck(cudaMemcpy(bits2, gr.grads, 4 * m->storage, cudaMemcpyDeviceToHost));
        size_t acts_f = g_mem.bytes[MEM_ACTIVATIONS] - acts0;
        printf("  recompute flags %d: loss %.8f, activations %zu bytes\n", ffn_flags[k], loss_f, acts_f);
        CHECK(loss_f == loss && !memcmp(bits1, bits2, 4 * m->storage), "%s [%s]: recompute flags %d differ from off",
              c->name, dtype, ffn_flags[k]);
        CHECK(acts_f < (k ? acts_off : acts_on), "%s [%s]: recompute flags %d keep %zu bytes of activations", c->name,
              dtype, ffn_flags[k], acts_f);
        gpu_model_destroy(&gr);
    }

    // a few AdamW steps on this batch must lower its loss, with fp32 and with bf16 moments (optim.moment_dtype)
    for (int k = 0; k < 2; k++) {
        Dtype moments = k ? DT_BF16 : DT_FP32;
        AdamWState opt;
        adamw_state_create(&opt, g.padded, moments);
        cudaCheck(cudaMemcpy(opt.master, host, 4 * m->storage, cudaMemcpyHostToDevice));
        gpu_model_set_params(&g, host);
        AdamWHyper hyper = {3e-3, 0.1, 0.9, 0.95, 1e-8, 0};
        AdamWCoeffs coeffs[ADAMW_COEFF_SETS];
        double first = step_grads(&g, tokens, targets, 0), last = first;
        for (int s = 1; s <= 20; s++) {
            hyper.t = s;
            adamw_coeffs_fill(coeffs, &hyper);
            adamw_load_coeffs(&opt, coeffs, 0);
            adamw_update_model(m, 0, m->storage, opt.master, g.work, g.ctype, g.grads, opt.m, opt.v, moments,
                               opt.coeffs, NULL, 0);
            last = step_grads(&g, tokens, targets, 0);
        }
        adamw_state_destroy(&opt);
        printf("  20 AdamW steps on one batch, %s moments: loss %.4f -> %.4f\n", dtype_name(moments), first, last);
        CHECK(last < 0.8 * first, "%s [%s]: 20 AdamW steps with %s moments took the loss only from %.4f to %.4f",
              c->name, dtype, dtype_name(moments), first, last);
    }
    check_zero2_one_rank(c, dtype, &g, tokens, targets);

    gpu_model_destroy(&g);
    free(bits1);
    free(bits2);
    free(grads);
    free(params);
    free(ref_grads);
    free(host);
    free(tokens);
    free(targets);
}

// The ledger (core/memory.h) against the device: a debug_hybrid model (about 11 GiB) after one training step holds,
// by cudaMemGetInfo, what the ledger says to within 5%, the promise of the start-up estimate. The difference is
// CUDA's page rounding, kernel images loaded on first launch and cuBLAS's own state.
static void check_ledger_against_device(void) {
    Config cfg;
    char err[CFG_ERR];
    cfg_defaults(&cfg);
    if (!cfg_load_file(&cfg, "configs/debug_hybrid.cfg", err) || !cfg_validate(&cfg, err)) {
        CHECK(0, "%s", err);
        return;
    }
    model_build(&g_desc, &cfg);
    int n = cfg.batch_size * cfg.seq_len;
    int *tokens = (int *)sdm_malloc(sizeof(int) * n), *targets = (int *)sdm_malloc(sizeof(int) * n);
    Rng r = rng_make(7);
    for (int i = 0; i < n; i++) {
        tokens[i] = (int)rng_below(&r, (uint32_t)g_desc.vocab);
        targets[i] = (int)rng_below(&r, (uint32_t)g_desc.vocab);
    }
    cudaCheck(cudaDeviceSynchronize());
    size_t used0 = device_used_bytes(), ledger0 = g_mem.live;
    GpuModel g;
    gpu_model_create(&g, &g_desc, cfg.batch_size, cfg.seq_len, DT_BF16, 1, cfg.selective_act_ckpt, NULL);
    step_grads(&g, tokens, targets, 0); // zero weights: a valid step, and every lazy allocation happens
    double used = (double)(device_used_bytes() - used0), ledger = (double)(g_mem.live - ledger0);
    printf("ledger vs device, debug_hybrid after one step: ledger %.3f GiB, device %.3f GiB (%+.1f%%)\n",
           ledger / (1 << 30), used / (1 << 30), 100.0 * (ledger - used) / used);
    CHECK(fabs(ledger - used) <= 0.05 * used, "the ledger says %.3f GiB, the device %.3f GiB", ledger / (1 << 30),
          used / (1 << 30));
    gpu_model_destroy(&g);
    free(tokens);
    free(targets);
}

int main(void) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        check_case(&CASES[i], "fp32");
        check_case(&CASES[i], "bf16");
    }
    check_ledger_against_device();
    matmul_destroy();
    return test_summary();
}
