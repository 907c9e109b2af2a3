// tests/gpu_test_core.cu: the dense kernels of core/layers.cuh, core/loss.cuh and model/adamw.cuh against the
// double-precision CPU references (core/ref_ops.h, core/optim.h), in the all-fp32 mode (relative error <= 1e-5) and
// the bf16 mode (<= 1e-2), on odd sizes. Inputs are rounded to the mode's storage type first, so the references see
// exactly what the GPU sees. Every output is poisoned with NaN before each run (0xFF bytes are NaN in fp32 and bf16),
// and every kernel is run twice and must give the same bits. Each case prints its relative error.
#include "model/adamw.cuh"
#include "core/layers.cuh"
#include "core/loss.cuh"
#include "core/optim.h"
#include "core/ref_ops.h"
#include "core/rng.h"
#include "tests/test.h"

typedef struct {
    Dtype dtype;
    const char *name;
    double tol;
} Mode;

static const Mode MODES[2] = {{DT_FP32, "fp32", 1e-5}, {DT_BF16, "bf16", 1e-2}};

// ------------------------------------------------------------------------------------------------------------------
// helpers

static double *host_doubles(size_t n) { return (double *)sdm_calloc(n, sizeof(double)); }

static void *dev_alloc(size_t bytes) {
    void *p;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

static void poison(void *d, size_t bytes) { cudaCheck(cudaMemset(d, 0xFF, bytes)); }

static void fill_normal(double *x, size_t n, Rng *r, double mean, double std) {
    for (size_t i = 0; i < n; i++) x[i] = mean + std * rng_normal(r);
}

// round x to the storage type of dtype (what an upload keeps)
static void round_to(double *x, size_t n, Dtype dtype) {
    for (size_t i = 0; i < n; i++)
        x[i] = dtype == DT_FP32 ? (double)(float)x[i] : (double)__bfloat162float(__float2bfloat16((float)x[i]));
}

static void upload(void *d, const double *x, size_t n, Dtype dtype) {
    size_t es = dtype_size(dtype);
    char *h = (char *)sdm_malloc(n * es);
    for (size_t i = 0; i < n; i++) {
        if (dtype == DT_FP32) ((float *)h)[i] = (float)x[i];
        else ((__nv_bfloat16 *)h)[i] = __float2bfloat16((float)x[i]);
    }
    cudaCheck(cudaMemcpy(d, h, n * es, cudaMemcpyHostToDevice));
    free(h);
}

static void download(double *x, const void *d, size_t n, Dtype dtype) {
    size_t es = dtype_size(dtype);
    char *h = (char *)sdm_malloc(n * es);
    cudaCheck(cudaMemcpy(h, d, n * es, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        x[i] = dtype == DT_FP32 ? ((float *)h)[i] : __bfloat162float(((__nv_bfloat16 *)h)[i]);
    free(h);
}

// a new device buffer holding x (rounded to dtype)
static void *dev_from(const double *x, size_t n, Dtype dtype) {
    void *d = dev_alloc(n * dtype_size(dtype));
    upload(d, x, n, dtype);
    return d;
}

// host copy of a device buffer's bytes (free it)
static void *snapshot(const void *d, size_t bytes) {
    void *h = sdm_malloc(bytes);
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

// print the case and its relative error, record pass/fail
static void report(const char *what, const double *got, const double *want, size_t n, double tol) {
    double err = rel_error(got, want, n);
    printf("  %-58s rel err %.3e (tol %.0e) %s\n", what, err, tol, err <= tol ? "ok" : "FAIL");
    CHECK(err <= tol, "%s: relative error %.3e > %.0e", what, err, tol);
}

// the device bytes equal an earlier snapshot (the second run of a kernel reproduced the first bit for bit)
static void report_same_bits(const char *what, const void *first, const void *d, size_t bytes) {
    void *second = snapshot(d, bytes);
    int same = memcmp(first, second, bytes) == 0;
    printf("  %-58s %s\n", what, same ? "bitwise equal: ok" : "DIFFERS: FAIL");
    CHECK(same, "%s: second run differs from the first", what);
    free(second);
}

static void report_true(const char *what, int ok) {
    printf("  %-58s %s\n", what, ok ? "ok" : "FAIL");
    CHECK(ok, "%s", what);
}

// ------------------------------------------------------------------------------------------------------------------
// token embedding

// Tokens with one hot token (≈40% of positions, a run far longer than EMB_CHUNK) and the rest uniform.
static void skewed_tokens(int *tok, int n, int V, Rng *r) {
    int hot = V / 3;
    for (int i = 0; i < n; i++) tok[i] = rng_uniform(r) < 0.4 ? hot : (int)rng_below(r, (uint32_t)V);
}

static void test_embedding(const Mode *mo, int n, int V, int D, Rng *r) {
    char what[160];
    printf("embedding %s n=%d V=%d D=%d\n", mo->name, n, V, D);
    size_t nd = (size_t)n * D, vd = (size_t)V * D, es = dtype_size(mo->dtype);
    int *tok = (int *)sdm_malloc(sizeof(int) * n);
    skewed_tokens(tok, n, V, r);
    double *E = host_doubles(vd), *dout = host_doubles(nd), *dE0 = host_doubles(vd);
    double *got = host_doubles(SDM_MAX(nd, vd)), *want = host_doubles(SDM_MAX(nd, vd)); // forward and backward
    fill_normal(E, vd, r, 0, 1);
    fill_normal(dout, nd, r, 0, 1);
    fill_normal(dE0, vd, r, 0, 1);
    round_to(E, vd, mo->dtype);
    round_to(dout, nd, mo->dtype);
    round_to(dE0, vd, DT_FP32);
    void *d_E = dev_from(E, vd, mo->dtype), *d_dout = dev_from(dout, nd, mo->dtype), *d_out = dev_alloc(nd * es);
    float *d_dE = (float *)dev_from(dE0, vd, DT_FP32);
    int *d_tok = (int *)dev_alloc(sizeof(int) * n);
    cudaCheck(cudaMemcpy(d_tok, tok, sizeof(int) * n, cudaMemcpyHostToDevice));

    // forward: an exact gather
    poison(d_out, nd * es);
    embedding_forward(d_out, d_E, d_tok, mo->dtype, n, D, 0);
    download(got, d_out, nd, mo->dtype);
    for (int i = 0; i < n; i++) memcpy(want + (size_t)i * D, E + (size_t)tok[i] * D, sizeof(double) * D);
    snprintf(what, sizeof what, "forward gather (exact)");
    report(what, got, want, nd, 0.0);

    // backward: dE += scatter(dout), accumulated onto random dE0
    EmbeddingBackwardPlan plan;
    embedding_backward_plan_create(&plan, n, V, D);
    int *plan_host = (int *)sdm_malloc(emb_plan_ints(&plan) * sizeof(int));
    embedding_backward_plan_fill(&plan, tok, plan_host);
    embedding_backward_plan_upload(&plan, plan_host, 0); // pageable: the copy has read it when this returns
    free(plan_host);
    embedding_backward(d_dE, d_dout, mo->dtype, &plan, 0);
    download(got, d_dE, vd, DT_FP32);
    memcpy(want, dE0, sizeof(double) * vd);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < D; k++) want[(size_t)tok[i] * D + k] += dout[(size_t)i * D + k];
    report("backward dE (+= onto random dE)", got, want, vd, mo->tol);
    int long_runs = 0;
    cudaCheck(cudaMemcpy(&long_runs, plan.d_buf + 1, sizeof(int), cudaMemcpyDeviceToHost));
    snprintf(what, sizeof what, "plan has a run split into pieces (%d long runs)", long_runs);
    report_true(what, long_runs >= 1);
    int *seen = (int *)sdm_calloc((size_t)V, sizeof(int)), untouched_ok = 1;
    for (int i = 0; i < n; i++) seen[tok[i]] = 1;
    for (int v = 0; v < V; v++)
        for (int k = 0; k < D && !seen[v]; k++) untouched_ok &= got[(size_t)v * D + k] == dE0[(size_t)v * D + k];
    report_true("rows of absent tokens unchanged", untouched_ok);

    void *first = snapshot(d_dE, vd * sizeof(float));
    upload(d_dE, dE0, vd, DT_FP32);
    embedding_backward(d_dE, d_dout, mo->dtype, &plan, 0);
    report_same_bits("backward determinism", first, d_dE, vd * sizeof(float));

    free(first);
    free(seen);
    embedding_backward_plan_destroy(&plan);
    cudaCheck(cudaFree(d_E));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dE));
    cudaCheck(cudaFree(d_tok));
    free(tok);
    free(E);
    free(dout);
    free(dE0);
    free(got);
    free(want);
}

// ------------------------------------------------------------------------------------------------------------------
// RMSNorm (+ residual)

// Where the forward puts h = h_in + branch, and where the backward puts dx.
typedef enum { RES_NONE, RES_OUT, RES_IN_PLACE } ResMode;  // no residual add; into h_out; over h_in
typedef enum { DX_SET, DX_ADD, DX_OVER_DY } DxMode;          // dx = (poisoned first); dx += (random dx); dx over dy

static void test_rmsnorm(const Mode *mo, int n, int D, ResMode res, DxMode dxm, Rng *r) {
    static const char *res_names[] = {"none", "h_out", "h_out over h_in"}, *dx_names[] = {"=", "+=", "= over dy"};
    const double eps = 1e-5;
    int residual = res != RES_NONE, accumulate = dxm == DX_ADD;
    RmsVecLayout lay = rmsnorm_vec_layout(mo->dtype, D);
    printf("rmsnorm %s n=%d D=%d residual %s, dx %s, ", mo->name, n, D, res_names[res], dx_names[dxm]);
    if (lay.vpt) printf("vector path (%d threads x %d)\n", lay.threads, lay.vpt);
    else printf("scalar path\n");
    size_t nd = (size_t)n * D, es = dtype_size(mo->dtype);
    Dtype dt = mo->dtype;
    double *h_in = host_doubles(nd), *branch = host_doubles(nd), *h = host_doubles(nd), *w = host_doubles(D);
    double *dy = host_doubles(nd), *dx0 = host_doubles(nd), *dw0 = host_doubles(D), *got = host_doubles(nd);
    double *want = host_doubles(nd), *rstd = host_doubles(n);
    fill_normal(h_in, nd, r, 0.3, 1.5);
    fill_normal(branch, nd, r, 0, 1);
    fill_normal(w, D, r, 1, 0.2);
    fill_normal(dy, nd, r, 0, 1);
    fill_normal(dx0, nd, r, 0, 1);
    fill_normal(dw0, D, r, 0, 1);
    round_to(h_in, nd, dt);
    round_to(branch, nd, dt);
    round_to(w, D, dt);
    round_to(dy, nd, dt);
    round_to(dx0, nd, dt);
    round_to(dw0, D, DT_FP32);
    // the norm's input: h_in (+ branch, rounded to the storage type as the kernel stores it)
    for (size_t i = 0; i < nd; i++) h[i] = h_in[i] + (residual ? branch[i] : 0.0);
    round_to(h, nd, dt);
    void *d_hin = dev_alloc(nd * es), *d_branch = dev_from(branch, nd, dt), *d_w = dev_from(w, D, dt);
    void *d_dy = dev_alloc(nd * es), *d_y = dev_alloc(nd * es), *d_dx = dev_alloc(nd * es);
    void *d_hout = res == RES_IN_PLACE ? d_hin : dev_alloc(nd * es);
    float *d_rstd = (float *)dev_alloc(sizeof(float) * n), *d_dw = (float *)dev_alloc(sizeof(float) * D);
    float *d_scratch = (float *)dev_alloc(sizeof(float) * rmsnorm_backward_scratch_floats(n, D));
    const void *d_x = residual ? d_hout : d_hin;    // the norm's input as the backward reads it
    const void *d_g = dxm == DX_OVER_DY ? d_dx : d_dy; // the backward's dy

    void *y1 = NULL, *r1 = NULL, *h1 = NULL, *dx1 = NULL, *dw1 = NULL; // the first run's outputs
    for (int run = 0; run < 2; run++) {
        upload(d_hin, h_in, nd, dt); // the in-place forward overwrote it
        upload(d_dy, dy, nd, dt);
        poison(d_y, nd * es);
        poison(d_rstd, sizeof(float) * n);
        if (res == RES_OUT) poison(d_hout, nd * es);
        if (residual) residual_rmsnorm_forward(d_hout, d_y, d_rstd, d_hin, d_branch, d_w, dt, n, D, (float)eps, 0);
        else rmsnorm_forward(d_y, d_rstd, d_hin, d_w, dt, n, D, (float)eps, 0);
        if (dxm == DX_SET) poison(d_dx, nd * es);
        else upload(d_dx, dxm == DX_ADD ? dx0 : dy, nd, dt);
        upload(d_dw, dw0, D, DT_FP32);
        poison(d_scratch, sizeof(float) * rmsnorm_backward_scratch_floats(n, D));
        rmsnorm_backward(d_dx, d_dw, d_scratch, d_g, d_x, d_w, d_rstd, dt, n, D, accumulate, 0);
        if (run == 0) {
            y1 = snapshot(d_y, nd * es);
            r1 = snapshot(d_rstd, sizeof(float) * n);
            h1 = residual ? snapshot(d_hout, nd * es) : NULL;
            dx1 = snapshot(d_dx, nd * es);
            dw1 = snapshot(d_dw, sizeof(float) * D);
            continue;
        }
        report_same_bits("forward y determinism", y1, d_y, nd * es);
        report_same_bits("forward rstd determinism", r1, d_rstd, sizeof(float) * n);
        if (residual) report_same_bits("forward h_out determinism", h1, d_hout, nd * es);
        report_same_bits("backward dx determinism", dx1, d_dx, nd * es);
        report_same_bits("backward dw determinism", dw1, d_dw, sizeof(float) * D);
        free(y1);
        free(r1);
        free(h1);
        free(dx1);
        free(dw1);
    }

    if (residual) {
        download(got, d_hout, nd, dt);
        report("forward h_out = h_in + branch", got, h, nd, mo->tol);
    }
    ref_rmsnorm_forward(h, w, want, n, D, eps);
    download(got, d_y, nd, dt);
    report("forward y", got, want, nd, mo->tol);
    for (int i = 0; i < n; i++) {
        double ms = 0;
        for (int k = 0; k < D; k++) ms += h[(size_t)i * D + k] * h[(size_t)i * D + k];
        want[i] = 1.0 / sqrt(ms / D + eps);
    }
    download(rstd, d_rstd, n, DT_FP32);
    report("forward rstd", rstd, want, n, mo->tol);

    double *dw_want = host_doubles(D), *dw_got = host_doubles(D);
    memcpy(want, dx0, sizeof(double) * nd);
    if (!accumulate) memset(want, 0, sizeof(double) * nd);
    memcpy(dw_want, dw0, sizeof(double) * D);
    ref_rmsnorm_backward(h, w, dy, want, dw_want, n, D, eps);
    download(got, d_dx, nd, dt);
    report(accumulate ? "backward dx (+= onto random dx)" : "backward dx (overwrite)", got, want, nd, mo->tol);
    download(dw_got, d_dw, D, DT_FP32);
    report("backward dw (+= onto random dw)", dw_got, dw_want, D, mo->tol);

    void *bufs[] = {d_hin, d_branch, d_w, d_dy, d_y, d_dx, d_rstd, d_dw, d_scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaCheck(cudaFree(bufs[i]));
    if (res != RES_IN_PLACE) cudaCheck(cudaFree(d_hout));
    double *hbufs[] = {h_in, branch, h, w, dy, dx0, dw0, got, want, rstd, dw_want, dw_got};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

// ------------------------------------------------------------------------------------------------------------------
// SwiGLU pointwise

// The FFN reference with selector weights isolates its pointwise part: with D = 2F, x = [a | b],
// W1 = [I 0], W3 = [0 I] (F x 2F) and W2 = [I; 0] (2F x F), FFN(x) = [h | 0] and the input gradient of
// dy = [dh | 0] is [da | db].
static void selector_weights(double *w1, double *w3, double *w2, int F) {
    int D = 2 * F;
    memset(w1, 0, sizeof(double) * F * D);
    memset(w3, 0, sizeof(double) * F * D);
    memset(w2, 0, sizeof(double) * D * F);
    for (int f = 0; f < F; f++) {
        w1[(size_t)f * D + f] = 1;
        w3[(size_t)f * D + F + f] = 1;
        w2[(size_t)f * F + f] = 1;
    }
}

static void test_swiglu(const Mode *mo, int n, int F, Rng *r) {
    Dtype dt = mo->dtype;
    int D = 2 * F;
    printf("swiglu %s n=%d F=%d (fused a|b rows of width 2F, backward in place), %s path\n", mo->name, n, F,
           F % (16 / (int)dtype_size(dt)) == 0 ? "vector" : "scalar");
    size_t nD = (size_t)n * D, nF = (size_t)n * F, es = dtype_size(dt);
    double *ab = host_doubles(nD), *dh = host_doubles(nF), *w1 = host_doubles((size_t)F * D);
    double *w3 = host_doubles((size_t)F * D), *w2 = host_doubles((size_t)D * F), *y = host_doubles(nD);
    double *dy = host_doubles(nD), *dab = host_doubles(nD), *got = host_doubles(nD), *want = host_doubles(nF);
    fill_normal(ab, nD, r, 0, 2);
    fill_normal(dh, nF, r, 0, 1);
    round_to(ab, nD, dt);
    round_to(dh, nF, dt);
    selector_weights(w1, w3, w2, F);
    void *d_ab = dev_from(ab, nD, dt), *d_dh = dev_from(dh, nF, dt), *d_h = dev_alloc(nF * es);
    char *a = (char *)d_ab, *b = a + (size_t)F * es;

    void *h1 = NULL, *dab1 = NULL;
    for (int run = 0; run < 2; run++) {
        upload(d_ab, ab, nD, dt);
        poison(d_h, nF * es);
        swiglu_forward(d_h, a, b, D, dt, n, F, 0);
        swiglu_backward(a, b, D, d_dh, a, b, D, dt, n, F, 0); // da, db over a, b
        if (run == 0) {
            h1 = snapshot(d_h, nF * es);
            dab1 = snapshot(d_ab, nD * es);
        }
    }
    report_same_bits("forward determinism", h1, d_h, nF * es);
    report_same_bits("backward determinism", dab1, d_ab, nD * es);

    ref_swiglu_forward(ab, w1, w3, w2, y, n, D, F);
    for (int i = 0; i < n; i++) memcpy(want + (size_t)i * F, y + (size_t)i * D, sizeof(double) * F);
    download(got, d_h, nF, dt);
    report("forward h = silu(a) * b", got, want, nF, mo->tol);
    for (int i = 0; i < n; i++) memcpy(dy + (size_t)i * D, dh + (size_t)i * F, sizeof(double) * F);
    ref_swiglu_backward(ab, w1, w3, w2, dy, dab, NULL, NULL, NULL, n, D, F);
    download(got, d_ab, nD, dt);
    report("backward [da | db]", got, dab, nD, mo->tol);

    free(h1);
    free(dab1);
    cudaCheck(cudaFree(d_ab));
    cudaCheck(cudaFree(d_dh));
    cudaCheck(cudaFree(d_h));
    double *hbufs[] = {ab, dh, w1, w3, w2, y, dy, dab, got, want};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

// ------------------------------------------------------------------------------------------------------------------
// fused cross-entropy

static void test_cross_entropy(const Mode *mo, int n, int V, int ld, Rng *r) {
    printf("cross_entropy %s n=%d V=%d ld=%d\n", mo->name, n, V, ld);
    Dtype dt = mo->dtype;
    size_t nl = (size_t)n * ld, nv = (size_t)n * V, es = dtype_size(dt);
    const double pad = 7.0; // the columns past V must keep this value
    double *logits = host_doubles(nl), *z = host_doubles(nv), *dz = host_doubles(nv), *got = host_doubles(nl);
    double *loss_want = host_doubles(n), *loss_got = host_doubles(n);
    int *targets = (int *)sdm_malloc(sizeof(int) * n);
    fill_normal(logits, nl, r, 0, 3);
    for (int i = 0; i < n; i++) {
        targets[i] = (int)rng_below(r, (uint32_t)V);
        for (int v = V; v < ld; v++) logits[(size_t)i * ld + v] = pad;
    }
    round_to(logits, nl, dt);
    for (int i = 0; i < n; i++) memcpy(z + (size_t)i * V, logits + (size_t)i * ld, sizeof(double) * V);
    void *d_logits = dev_alloc(nl * es);
    float *d_losses = (float *)dev_alloc(sizeof(float) * n), *d_mean = (float *)dev_alloc(sizeof(float));
    int *d_targets = (int *)dev_alloc(sizeof(int) * n);
    cudaCheck(cudaMemcpy(d_targets, targets, sizeof(int) * n, cudaMemcpyHostToDevice));

    void *l1 = NULL, *m1 = NULL, *g1 = NULL;
    for (int run = 0; run < 2; run++) {
        upload(d_logits, logits, nl, dt);
        poison(d_losses, sizeof(float) * n);
        poison(d_mean, sizeof(float));
        cross_entropy_forward_backward(d_logits, ld, d_targets, d_losses, dt, n, V, 1.0f / n, 0);
        loss_mean(d_mean, d_losses, n, 0);
        if (run == 0) {
            l1 = snapshot(d_losses, sizeof(float) * n);
            m1 = snapshot(d_mean, sizeof(float));
            g1 = snapshot(d_logits, nl * es);
        }
    }
    report_same_bits("per-row losses determinism", l1, d_losses, sizeof(float) * n);
    report_same_bits("mean determinism", m1, d_mean, sizeof(float));
    report_same_bits("dlogits determinism", g1, d_logits, nl * es);

    for (int i = 0; i < n; i++) loss_want[i] = ref_cross_entropy(z + (size_t)i * V, targets + i, NULL, 1, V);
    double mean_want = ref_cross_entropy(z, targets, dz, n, V), mean_got;
    download(loss_got, d_losses, n, DT_FP32);
    report("per-row losses", loss_got, loss_want, n, mo->tol);
    download(&mean_got, d_mean, 1, DT_FP32);
    report("mean loss", &mean_got, &mean_want, 1, mo->tol);
    download(got, d_logits, nl, dt);
    int pad_ok = 1;
    for (int i = 0; i < n; i++) {
        for (int v = V; v < ld; v++) pad_ok &= got[(size_t)i * ld + v] == pad;
        memmove(got + (size_t)i * V, got + (size_t)i * ld, sizeof(double) * V); // pack rows to width V
    }
    report("dlogits = (softmax - onehot) / n, in place", got, dz, nv, mo->tol);
    if (ld > V) report_true("columns past V untouched", pad_ok);

    // dscale = 0: losses only, logits left as they were
    upload(d_logits, logits, nl, dt);
    poison(d_losses, sizeof(float) * n);
    cross_entropy_forward_backward(d_logits, ld, d_targets, d_losses, dt, n, V, 0.0f, 0);
    download(loss_got, d_losses, n, DT_FP32);
    report("losses without gradient (dscale = 0)", loss_got, loss_want, n, mo->tol);
    download(got, d_logits, nl, dt);
    report("logits untouched when dscale = 0", got, logits, nl, 0.0);

    free(l1);
    free(m1);
    free(g1);
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_losses));
    cudaCheck(cudaFree(d_mean));
    cudaCheck(cudaFree(d_targets));
    free(targets);
    double *hbufs[] = {logits, z, dz, got, loss_want, loss_got};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

// ------------------------------------------------------------------------------------------------------------------
// AdamW over a parameter table

static ModelDesc g_model; // large: keep it off the stack

// A small table with decayed and non-decayed tensors interleaved, so runs split and merge.
static void build_table(ModelDesc *md) {
    memset(md, 0, sizeof *md);
    model_add(md, -1, "tok_emb", 1000, 37, INIT_ZEROS, 0, 0);
    model_add(md, 0, "sdm.A_log", 5, 0, INIT_ZEROS, 0, 0)->decay = 0;
    model_add(md, 0, "sdm.dt_bias", 5, 0, INIT_ZEROS, 0, 0)->decay = 0;
    model_add(md, 0, "ffn.w1", 701, 100, INIT_ZEROS, 0, 0);
    model_add(md, 0, "mixer_norm", 101, 0, INIT_ZEROS, 0, 0);
    model_add(md, 1, "sdm.A_log", 3, 0, INIT_ZEROS, 0, 0)->decay = 0;
}

static int in_tensor(const ModelDesc *md, long long i) {
    for (int t = 0; t < md->n_params; t++)
        if (i >= md->params[t].offset && i < md->params[t].offset + md->params[t].numel) return 1;
    return 0;
}

// Three AdamW steps on [lo, hi) of the table with moments stored as mt; returns the final p (fp32), m, v and the
// working copy (as doubles).
static void run_adamw(const Mode *mo, Dtype mt, const ModelDesc *md, long long lo, long long hi, const double *p0,
                      const double *grads, const double *scale, const AdamWHyper *hyper, double *p, double *m,
                      double *v, double *work, void **first_bits) {
    size_t n = (size_t)md->storage, es = dtype_size(mo->dtype), ms = dtype_size(mt);
    float *d_p = (float *)dev_from(p0, n, DT_FP32), *d_g = (float *)dev_alloc(sizeof(float) * n);
    char *d_m = (char *)dev_alloc(ms * n), *d_v = (char *)dev_alloc(ms * n);
    float *d_scale = scale ? (float *)dev_from(scale, 1, DT_FP32) : NULL;
    void *d_work = dev_alloc(n * es);
    AdamWCoeffs coeffs[ADAMW_COEFF_SETS], *d_coeffs = (AdamWCoeffs *)dev_alloc(sizeof coeffs);
    cudaCheck(cudaMemset(d_m, 0, ms * n));
    cudaCheck(cudaMemset(d_v, 0, ms * n));
    for (int t = 0; t < 3; t++) {
        AdamWHyper h = *hyper;
        h.t = t + 1;
        adamw_coeffs_fill(coeffs, &h);
        cudaCheck(cudaMemcpy(d_coeffs, coeffs, sizeof coeffs, cudaMemcpyHostToDevice));
        upload(d_g, grads + (size_t)t * n, n, DT_FP32);
        poison(d_work, n * es);
        adamw_update_model(md, lo, hi, d_p + lo, (char *)d_work + lo * es, mo->dtype, d_g + lo, d_m + lo * ms,
                           d_v + lo * ms, mt, d_coeffs, d_scale, 0);
    }
    download(p, d_p, n, DT_FP32);
    download(m, d_m, n, mt);
    download(v, d_v, n, mt);
    download(work, d_work, n, mo->dtype);
    first_bits[0] = snapshot(d_p, sizeof(float) * n);
    first_bits[1] = snapshot(d_work, n * es);
    void *bufs[] = {d_p, d_g, d_m, d_v, d_scale, d_work, d_coeffs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaCheck(cudaFree(bufs[i]));
}

// x rounded to fp32, then to the nearest bf16, ties to even, by integer arithmetic on the bits (not cuda_bf16.h's
// conversion, which the kernel uses); *tie: the fp32 value was halfway between two bf16 values.
static double bf16_nearest_even(double x, int *tie) {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    *tie = (u & 0xFFFFu) == 0x8000u;
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

// An AdamW case's moments: fp32; bf16 from normal inputs; bf16 from inputs on a grid where every moment is exact in
// fp32 before its rounding (below), so the kernel and the reference round the same values.
typedef enum { MOMENTS_FP32, MOMENTS_BF16, MOMENTS_BF16_EXACT } MomentCase;
static const char *const MOMENT_CASE_NAMES[3] = {"fp32 moments", "bf16 moments", "bf16 moments, exact grid"};

// Tolerances of m, v and of the master update. fp32: fp32 arithmetic against double. bf16: the reference rounds its
// double m, v to bf16 after each step where the kernel rounds its fp32 ones, so the two differ only where those
// straddle a rounding boundary. They differ by ~2e-7 relative (mostly the fp32 coefficient 1 - 0.9f), a bf16 step is
// 2^-8..2^-7 relative, so about one element in 2e4 rounds the other way per step, by one step (<= 2^-7), and keeps
// differing after: some 20 of the 1.1e5 elements after 3 steps, a relative error of about
// sqrt(20 / 1.1e5) * 2^-7 = 1e-4 in m, v and the update (a CPU emulation of the kernel gives 2e-5 to 6e-5; rounding
// toward zero instead, up to a step on every element, gives 7e-3 in m, v). Exact grid: the same bits, and fp32
// arithmetic in the update of p.
static const double MOMENT_TOL[3] = {1e-5, 1e-3, 0.0}, MASTER_TOL[3] = {1e-5, 1e-3, 1e-5};

// The exact grid: beta1 = 7/8, beta2 = 15/16, grad scale 1/2 and gradients ±k/64 with k in [16, 127], so the scaled
// gradient is k/128 (7 bits). m grows by at most 3 bits below its last bit per step (m_1 = g/8 has bits down to
// 2^-10, m_3 before rounding down to 2^-16, and |m| < 1): exact in fp32's 24 bits for these 3 steps. v >= g_t^2 / 16
// >= 2^-10, so a stored v has bits down to 2^-17 and 15/16 of it down to 2^-21, below 1: exact at every step. Both
// sides hold the exact value, so a rounding other than to nearest even, or no rounding, gives other bits; with only a
// few bits below bf16's 8, ties are common (tens of thousands in a case of 1.1e5 elements).
static void grid_gradients(double *g, size_t n, Rng *r) {
    for (size_t i = 0; i < n; i++) g[i] = (rng_uniform(r) < 0.5 ? -1 : 1) * (double)(16 + rng_below(r, 112)) / 64;
}

// The reference of run_adamw: ref_adamw_step on each tensor's part of [lo, hi) with its decay flag, gradients times
// scale (or 1); with bf16 moments m, v are rounded after each step, as the kernel stores them. Returns the ties.
static long long ref_adamw(const ModelDesc *md, long long lo, long long hi, const double *p0, const double *grads,
                           const double *scale, const AdamWHyper *hyper, Dtype mt, double *rp, double *rm,
                           double *rv) {
    size_t n = (size_t)md->storage;
    double *g = host_doubles(n);
    long long ties = 0;
    memcpy(rp, p0, sizeof(double) * n);
    for (int t = 0; t < 3; t++) {
        AdamWHyper h = *hyper;
        h.t = t + 1;
        for (size_t i = 0; i < n; i++) g[i] = grads[(size_t)t * n + i] * (scale ? (double)(float)*scale : 1.0);
        for (int i = 0; i < md->n_params; i++) {
            const ParamSpec *ps = &md->params[i];
            long long a = SDM_MAX(lo, ps->offset), b = SDM_MIN(hi, ps->offset + ps->numel);
            if (a < b) ref_adamw_step(rp + a, rm + a, rv + a, g + a, (size_t)(b - a), &h, ps->decay);
        }
        for (long long i = lo; i < hi && mt == DT_BF16; i++) {
            int tie_m, tie_v;
            rm[i] = bf16_nearest_even(rm[i], &tie_m);
            rv[i] = bf16_nearest_even(rv[i], &tie_v);
            ties += tie_m + tie_v;
        }
    }
    free(g);
    return ties;
}

// AdamW on the elements [lo, total - trim) of the table (a ZeRO-1 shard when lo or trim is not 0).
static void test_adamw(const Mode *mo, MomentCase mc, long long lo, long long trim, int with_scale, Rng *r) {
    ModelDesc *md = &g_model;
    build_table(md);
    long long hi = md->storage - trim;
    size_t n = (size_t)md->storage, range = (size_t)(hi - lo);
    int exact = mc == MOMENTS_BF16_EXACT;
    Dtype mt = mc == MOMENTS_FP32 ? DT_FP32 : DT_BF16;
    double scale = exact ? 0.5 : 0.37;
    printf("adamw %s, %s, elements [%lld, %lld) of %zu, grad scale %s, 3 steps\n", mo->name, MOMENT_CASE_NAMES[mc],
           lo, hi, n, with_scale ? (exact ? "0.5" : "0.37") : "none");
    // a large lr so the updates are far above rounding
    AdamWHyper hyper = {0.1, 0.1, exact ? 0.875 : 0.9, exact ? 0.9375 : 0.95, 1e-8, 0};
    double *p0 = host_doubles(n), *grads = host_doubles(3 * n), *p = host_doubles(n), *m = host_doubles(n);
    double *v = host_doubles(n), *work = host_doubles(n), *rp = host_doubles(n), *rm = host_doubles(n);
    double *rv = host_doubles(n), *dp = host_doubles(n), *rdp = host_doubles(n);
    fill_normal(p0, n, r, 0, 1);
    if (exact) grid_gradients(grads, 3 * n, r);
    else fill_normal(grads, 3 * n, r, 0, 1);
    round_to(p0, n, DT_FP32);
    round_to(grads, 3 * n, DT_FP32);
    long long ties = ref_adamw(md, lo, hi, p0, grads, with_scale ? &scale : NULL, &hyper, mt, rp, rm, rv);

    void *bits1[2], *bits2[2];
    run_adamw(mo, mt, md, lo, hi, p0, grads, with_scale ? &scale : NULL, &hyper, p, m, v, work, bits1);
    for (size_t i = 0; i < n; i++) dp[i] = p[i] - p0[i], rdp[i] = rp[i] - p0[i];
    int gaps_ok = 1; // alignment gaps between tensors: never written (the working copy there stays poisoned)
    for (size_t i = 0; i < n; i++)
        if (!in_tensor(md, (long long)i)) {
            gaps_ok &= p[i] == p0[i];
            work[i] = rp[i];
        }
    report_true("alignment gaps untouched", gaps_ok);
    report("master update p - p0 (fp32)", dp, rdp, n, MASTER_TOL[mc]);
    report(mt == DT_FP32 ? "first moment m (fp32)" : "first moment m (bf16)", m + lo, rm + lo, range, MOMENT_TOL[mc]);
    report(mt == DT_FP32 ? "second moment v (fp32)" : "second moment v (bf16)", v + lo, rv + lo, range,
           MOMENT_TOL[mc]);
    if (exact) {
        char what[160];
        snprintf(what, sizeof what, "ties to even reached (%lld ties)", ties);
        report_true(what, ties > 0);
    }
    report("working copy", work + lo, rp + lo, range, SDM_MAX(mo->tol, MASTER_TOL[mc]));
    int outside_ok = 1;
    for (size_t i = 0; i < n; i++)
        if ((long long)i < lo || (long long)i >= hi) outside_ok &= p[i] == p0[i] && m[i] == 0 && v[i] == 0;
    report_true("elements outside [lo, hi) untouched", outside_ok);
    run_adamw(mo, mt, md, lo, hi, p0, grads, with_scale ? &scale : NULL, &hyper, p, m, v, work, bits2);
    int same = !memcmp(bits1[0], bits2[0], sizeof(float) * n) && !memcmp(bits1[1], bits2[1], n * dtype_size(mo->dtype));
    report_true("determinism (master and working copy bitwise equal)", same);

    for (int i = 0; i < 2; i++) free(bits1[i]), free(bits2[i]);
    double *hbufs[] = {p0, grads, p, m, v, work, rp, rm, rv, dp, rdp};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++) free(hbufs[i]);
}

// ------------------------------------------------------------------------------------------------------------------
// global gradient norm and clip scale

static void test_grad_norm(long long n, Rng *r) {
    printf("grad norm n=%lld\n", n);
    double *g = host_doubles((size_t)n);
    fill_normal(g, (size_t)n, r, 0, 0.01);
    round_to(g, (size_t)n, DT_FP32);
    double ss = 0;
    for (long long i = 0; i < n; i++) ss += g[i] * g[i];
    double norm_want = sqrt(ss);
    float *d_g = (float *)dev_from(g, (size_t)n, DT_FP32), *d_scratch = (float *)dev_alloc(4 * ADAMW_NORM_SCRATCH);
    float *d_out = (float *)dev_alloc(3 * sizeof(float)); // sumsq, norm, scale

    void *first = NULL;
    for (int run = 0; run < 2; run++) {
        poison(d_out, 3 * sizeof(float));
        poison(d_scratch, 4 * ADAMW_NORM_SCRATCH);
        adamw_grad_sumsq(d_out, d_scratch, d_g, n, 0);
        if (run == 0) first = snapshot(d_out, sizeof(float));
    }
    report_same_bits("sum of squares determinism", first, d_out, sizeof(float));
    const double clips[3] = {0.5 * norm_want, 2.0 * norm_want, 0.0}; // clipping, no clipping, off
    for (int c = 0; c < 3; c++) {
        poison(d_out + 1, 2 * sizeof(float));
        adamw_clip_scale(d_out + 1, d_out + 2, d_out, (float)clips[c], 0);
        double got[2], want[2] = {norm_want, clips[c] > 0 ? fmin(1.0, clips[c] / (norm_want + 1e-6)) : 1.0};
        download(got, d_out + 1, 2, DT_FP32);
        char what[160];
        snprintf(what, sizeof what, "norm, clip = %.3g", clips[c]);
        report(what, got, want, 1, 1e-5);
        snprintf(what, sizeof what, "clip scale, clip = %.3g (want %.6f)", clips[c], want[1]);
        report(what, got + 1, want + 1, 1, 1e-5);
    }
    free(first);
    free(g);
    cudaCheck(cudaFree(d_g));
    cudaCheck(cudaFree(d_scratch));
    cudaCheck(cudaFree(d_out));
}

int main(void) {
    Rng r = rng_make(20261202);
    for (int m = 0; m < 2; m++) {
        const Mode *mo = &MODES[m];
        test_embedding(mo, 1031, 258, 1000, &r);
        test_embedding(mo, 1031, 50000, 96, &r);
        // RMSNorm paths (core/layers.cuh): the vector path with one vector per thread at D = 64, 1000 and 2048
        // (the flagship's width), and at D = 4096 in bf16 (512 threads); with two per thread at D = 4096 in fp32
        // and D = 4104 in bf16; the scalar path at D = 1002 (not a multiple of 4 or 8) and at D = 4104 in fp32 (1026
        // vectors, over RMS_THREADS * RMS_MAX_VPT). n = 5003 gives backward blocks of 16 rows, the last one short;
        // no n is a multiple of the 8-row tiles. The tolerances of MODES hold on both paths: all arithmetic is fp32
        // with sums of at most ~5000 terms split over threads, warps and blocks (relative error ~1e-6 at worst,
        // against 1e-5), and bf16 outputs are rounded once (2^-9 relative at most, ~1e-3 norm-wise, against 1e-2).
        test_rmsnorm(mo, 1031, 1000, RES_OUT, DX_ADD, &r);
        test_rmsnorm(mo, 4099, 1000, RES_NONE, DX_SET, &r);
        test_rmsnorm(mo, 5, 64, RES_OUT, DX_SET, &r);
        test_rmsnorm(mo, 5003, 2048, RES_OUT, DX_ADD, &r);
        test_rmsnorm(mo, 77, 4096, RES_IN_PLACE, DX_OVER_DY, &r);
        test_rmsnorm(mo, 300, 4104, RES_NONE, DX_ADD, &r);
        test_rmsnorm(mo, 263, 1002, RES_OUT, DX_ADD, &r);
        test_rmsnorm(mo, 263, 1002, RES_IN_PLACE, DX_OVER_DY, &r);
        test_rmsnorm(mo, 130, 1002, RES_NONE, DX_SET, &r);
        // SwiGLU: one element per thread at F = 333, and F = 204 in bf16; one 16-byte vector at F = 200, 2056
        // (bf16: 257 vectors, two column blocks of a row) and F = 204 in fp32. Elementwise: one fp32 evaluation and
        // one rounding per element, on either path.
        test_swiglu(mo, 77, 333, &r);
        test_swiglu(mo, 300, 200, &r);
        test_swiglu(mo, 41, 204, &r);
        test_swiglu(mo, 37, 2056, &r);
        test_cross_entropy(mo, 1031, 258, 264, &r);
        test_cross_entropy(mo, 257, 50000, 50000, &r);
        test_adamw(mo, MOMENTS_FP32, 0, 0, 0, &r);
        test_adamw(mo, MOMENTS_FP32, 517, 1, 1, &r);      // starts inside tok_emb, ends inside the last A_log
        test_adamw(mo, MOMENTS_FP32, 37002, 1000, 1, &r); // starts inside a no-decay run, ends inside ffn.w1
        test_adamw(mo, MOMENTS_BF16, 517, 1, 1, &r);      // optim.moment_dtype = bf16
        test_adamw(mo, MOMENTS_BF16_EXACT, 0, 0, 1, &r);
        test_adamw(mo, MOMENTS_BF16_EXACT, 37002, 1000, 1, &r);
    }
    // The RMSNorm cases above reach every path: scalar (a width not a multiple of the vector, and too wide a row in
    // fp32; bf16 rows of up to 8192 take the vector path), one and two vectors per thread.
    for (int m = 0; m < 2; m++) {
        Dtype dt = MODES[m].dtype;
        int fp32 = dt == DT_FP32, two = fp32 ? 4096 : 4104;
        char what[160];
        snprintf(what, sizeof what, "rmsnorm %s cases reach the scalar path and 1 and 2 vectors per thread",
                 MODES[m].name);
        report_true(what, rmsnorm_vec_layout(dt, 1002).vpt == 0 && rmsnorm_vec_layout(dt, 2048).vpt == 1 &&
                              rmsnorm_vec_layout(dt, two).vpt == 2 && (!fp32 || rmsnorm_vec_layout(dt, 4104).vpt == 0));
    }
    test_grad_norm(5, &r);
    test_grad_norm(1000003, &r);
    test_grad_norm(10000019, &r);
    return test_summary();
}
