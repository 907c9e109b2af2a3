// tests/gpu_test_attention.cu: the GPU attention kernels against the double-precision CPU reference on fresh random
// inputs: core forward (out, lse) and backward (dq, dk, dv), determinism, inference = training forward, decode
// against a KV cache = teacher-forced forward, RoPE and the sigmoid gate; and a gated layer's decode step (the gate
// folded into the q, k, v product and the decode kernel) = the unfolded layer, bit for bit.
// Tolerances (relative, ||gpu - ref|| / ||ref|| over a whole tensor): fp32 mode 1e-5, bf16 1e-2. Inputs are rounded to
// the element type before the reference sees them, so both compute the same function.
#include "attention/attention.cuh"
#include "attention/attention_layer.cuh"
#include "attention/attention_ref.h"
#include "core/rng.h"
#include "tests/test.h"

#define CK(x) cudaCheck(x)

static const double TOL_FP32 = 1e-5, TOL_BF16 = 1e-2;
static double tol_of(Dtype dt) { return dt == DT_FP32 ? TOL_FP32 : TOL_BF16; }
static size_t esize(Dtype dt) { return dt == DT_BF16 ? sizeof(bf16) : sizeof(float); }
static const char *dt_name(Dtype dt) { return dt == DT_BF16 ? "bf16" : "fp32"; }

static void *dev_alloc(size_t bytes) {
    void *p;
    CK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

// 0xFF bytes: NaN in fp32 and in bf16, so any element a kernel forgets to write fails the comparison.
static void poison(void *d, size_t bytes) { CK(cudaMemset(d, 0xFF, bytes)); }

// Upload h as dt; h is rounded in place to the values the device holds.
static void *upload(double *h, size_t n, Dtype dt) {
    void *d = dev_alloc(n * esize(dt));
    if (dt == DT_FP32) {
        float *t = (float *)sdm_malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) h[i] = t[i] = (float)h[i];
        CK(cudaMemcpy(d, t, n * sizeof(float), cudaMemcpyHostToDevice));
        free(t);
    } else {
        bf16 *t = (bf16 *)sdm_malloc(n * sizeof(bf16));
        for (size_t i = 0; i < n; i++) {
            t[i] = __float2bfloat16((float)h[i]);
            h[i] = __bfloat162float(t[i]);
        }
        CK(cudaMemcpy(d, t, n * sizeof(bf16), cudaMemcpyHostToDevice));
        free(t);
    }
    return d;
}

static double *download(const void *d, size_t n, Dtype dt) {
    double *h = (double *)sdm_malloc(n * sizeof(double));
    void *t = sdm_malloc(n * esize(dt));
    CK(cudaMemcpy(t, d, n * esize(dt), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) h[i] = dt == DT_FP32 ? ((float *)t)[i] : __bfloat162float(((bf16 *)t)[i]);
    free(t);
    return h;
}

static void *download_raw(const void *d, size_t bytes) {
    void *h = sdm_malloc(bytes);
    CK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

static double *random_vec(Rng *r, size_t n) {
    double *x = (double *)sdm_malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) x[i] = rng_normal(r);
    return x;
}

static double norm(const double *x, size_t n) { return sqrt(ref_dot(x, x, (int)n)); }

// ||a - b|| / max(||b||, floor), checked against tol and returned for the printed table. For gradients that are
// exactly zero in exact arithmetic (dq, dk when every query sees only itself: w = 1 or T = 1) the floor is the size of
// a gradient that is not (dv), so rounding noise is measured on the scale of the layer's gradients.
static double check_err(const char *what, const double *a, const double *b, size_t n, double floor, double tol) {
    double num = 0.0;
    for (size_t i = 0; i < n; i++) num += (a[i] - b[i]) * (a[i] - b[i]);
    double err = sqrt(num) / fmax(fmax(norm(b, n), floor), 1e-300);
    CHECK(err <= tol, "%s: relative error %.3e > tolerance %.1e", what, err, tol);
    return err;
}

typedef struct {
    int B, T, nh, nkv, D, window;
    int backward;  // also check dq, dk, dv against the reference
    int row_step;  // 0: every output row is compared; k: only rows t % k == 0 and t = T-1 (large T, full causal)
} CoreCase;

static AttnDims dims_of(const CoreCase *c) {
    AttnDims a;
    a.dim = 0; a.n_heads = c->nh; a.n_kv_heads = c->nkv; a.head_dim = c->D; a.window = c->window; a.gated = 0;
    a.rope_theta = 10000.0;
    return a;
}

typedef struct { void *out, *dq, *dk, *dv; float *lse; } CoreOutputs;

static void run_core(const AttnDims *a, const CoreCase *c, Dtype dt, void *q, void *k, void *v, void *dout,
                     void *ws, CoreOutputs *o, size_t nq, size_t nk, size_t nl) {
    poison(o->out, nq * esize(dt)); poison(o->lse, nl * sizeof(float));
    poison(o->dq, nq * esize(dt)); poison(o->dk, nk * esize(dt)); poison(o->dv, nk * esize(dt));
    attn_forward(a, c->B, c->T, dt, q, k, v, o->out, o->lse, 0);
    attn_backward(a, c->B, c->T, dt, q, k, v, o->out, o->lse, dout, o->dq, o->dk, o->dv, ws, 0);
    CK(cudaDeviceSynchronize());
}

static int bitwise_equal(const void *d1, const void *d2, size_t bytes) {
    void *h1 = download_raw(d1, bytes), *h2 = download_raw(d2, bytes);
    int eq = memcmp(h1, h2, bytes) == 0;
    free(h1); free(h2);
    return eq;
}

// Reference forward on the compared rows only; returns how many rows were compared.
static size_t ref_forward_rows(const AttnDims *a, const CoreCase *c, const double *q, const double *k, const double *v,
                               const double *gpu_out, const double *gpu_lse, double *ref_o, double *got_o,
                               double *ref_l, double *got_l) {
    AttnRefQKV in = {q, k, v};
    double *prob = (double *)sdm_malloc((size_t)c->T * sizeof(double));
    size_t rows = 0, D = (size_t)c->D;
    for (int b = 0; b < c->B; b++)
        for (int t = 0; t < c->T; t++) {
            if (c->row_step && t % c->row_step != 0 && t != c->T - 1) continue;
            for (int j = 0; j < c->nh; j++, rows++) {
                size_t row = ((size_t)b * c->T + t) * c->nh + j, hrow = ((size_t)b * c->nh + j) * c->T + t;
                ref_l[rows] = attn_core_forward_row_ref(a, c->T, &in, b, t, j, ref_o + rows * D, prob);
                memcpy(got_o + rows * D, gpu_out + row * D, D * sizeof(double));
                got_l[rows] = gpu_lse[hrow];
            }
        }
    free(prob);
    return rows;
}

// A forward's out and lse (device) against the CPU reference on the compared rows: relative errors into err[0..1].
static void check_forward(const AttnDims *a, const CoreCase *c, Dtype dt, const double *q, const double *k,
                          const double *v, const void *d_out, const float *d_lse, const char *name, double tol,
                          double *err) {
    size_t nq = (size_t)c->B * c->T * c->nh * c->D, nl = (size_t)c->B * c->nh * c->T;
    double *out = download(d_out, nq, dt);
    float *lse_f = (float *)download_raw(d_lse, nl * sizeof(float));
    double *lse = (double *)sdm_malloc(nl * sizeof(double));
    for (size_t i = 0; i < nl; i++) lse[i] = lse_f[i];
    double *ref_o = (double *)sdm_malloc(nq * sizeof(double)), *got_o = (double *)sdm_malloc(nq * sizeof(double));
    double *ref_l = (double *)sdm_malloc(nl * sizeof(double)), *got_l = (double *)sdm_malloc(nl * sizeof(double));
    size_t rows = ref_forward_rows(a, c, q, k, v, out, lse, ref_o, got_o, ref_l, got_l);
    char what[240];
    snprintf(what, sizeof what, "%s: out (%zu rows)", name, rows);
    err[0] = check_err(what, got_o, ref_o, rows * c->D, 0.0, tol);
    snprintf(what, sizeof what, "%s: lse", name);
    err[1] = check_err(what, got_l, ref_l, rows, 0.0, tol);
    free(out); free(lse_f); free(lse); free(ref_o); free(got_o); free(ref_l); free(got_l);
}

// A backward's dq, dk, dv (device, in o) against the CPU's: relative errors into err[0..2]; floor_q, floor_k: the
// error floors of dq and dk (test_core says when they are not zero).
static void check_backward(const CoreOutputs *o, Dtype dt, size_t nq, size_t nk, const double *rdq, const double *rdk,
                           const double *rdv, double floor_q, double floor_k, const char *name, double tol,
                           double *err) {
    double *gdq = download(o->dq, nq, dt), *gdk = download(o->dk, nk, dt), *gdv = download(o->dv, nk, dt);
    char what[240];
    snprintf(what, sizeof what, "%s: dq", name);
    err[0] = check_err(what, gdq, rdq, nq, floor_q, tol);
    snprintf(what, sizeof what, "%s: dk", name);
    err[1] = check_err(what, gdk, rdk, nk, floor_k, tol);
    snprintf(what, sizeof what, "%s: dv", name);
    err[2] = check_err(what, gdv, rdv, nk, 0.0, tol);
    free(gdq); free(gdk); free(gdv);
}

static void test_core(const CoreCase *c, Dtype dt, uint64_t seed) {
    AttnDims a = dims_of(c);
    size_t nq = (size_t)c->B * c->T * c->nh * c->D, nk = (size_t)c->B * c->T * c->nkv * c->D,
           nl = (size_t)c->B * c->nh * c->T;
    Rng rng = rng_make(seed);
    double *q = random_vec(&rng, nq), *k = random_vec(&rng, nk), *v = random_vec(&rng, nk),
           *dout = random_vec(&rng, nq);
    void *dq_in = upload(q, nq, dt), *dk_in = upload(k, nk, dt), *dv_in = upload(v, nk, dt),
         *ddout = upload(dout, nq, dt);
    void *ws = dev_alloc(attn_backward_workspace_bytes(&a, c->B, c->T));
    CoreOutputs o1, o2;
    CoreOutputs *os[2] = {&o1, &o2};
    for (int i = 0; i < 2; i++) {
        os[i]->out = dev_alloc(nq * esize(dt)); os[i]->dq = dev_alloc(nq * esize(dt));
        os[i]->dk = dev_alloc(nk * esize(dt)); os[i]->dv = dev_alloc(nk * esize(dt));
        os[i]->lse = (float *)dev_alloc(nl * sizeof(float));
    }
    run_core(&a, c, dt, dq_in, dk_in, dv_in, ddout, ws, &o1, nq, nk, nl);
    char name[160];
    snprintf(name, sizeof name, "%s B%d T%d h%d/%d d%d w%d", dt_name(dt), c->B, c->T, c->nh, c->nkv, c->D, c->window);
    double tol = tol_of(dt);

    // forward: out and lse
    double err[5] = {0, 0, -1, -1, -1}; // out, lse, dq, dk, dv (-1: not compared)
    check_forward(&a, c, dt, q, k, v, o1.out, o1.lse, name, tol, err);
    // at d_h = 128 an sm_90a build's forward is the wgmma kernel: the mma.sync kernel (other builds') checked too
    if (dt == DT_BF16 && c->D == 128 && attn_use_wgmma(c->D)) {
        AttnArgs p = attn_args(&a, c->T);
        p.q = dq_in; p.k = dk_in; p.v = dv_in; p.out = o2.out; p.lse = o2.lse;
        poison(o2.out, nq * esize(dt)); poison(o2.lse, nl * sizeof(float));
        attn_fwd_mma_for_mask<128>(p, c->B, 0);
        CK(cudaDeviceSynchronize());
        double merr[2];
        char mname[200];
        snprintf(mname, sizeof mname, "%s mma.sync", name);
        check_forward(&a, c, dt, q, k, v, o2.out, o2.lse, mname, tol, merr);
        printf("| %s | %d | %d | %d/%d | %d | %d | mma.sync forward | %.1e | %.1e | - | - | - | - |\n", dt_name(dt),
               c->B, c->T, c->nh, c->nkv, c->D, c->window, merr[0], merr[1]);
    }

    // backward: dq, dk, dv
    if (c->backward) {
        double *rdq = (double *)sdm_malloc(nq * sizeof(double)), *rdk = (double *)sdm_malloc(nk * sizeof(double));
        double *rdv = (double *)sdm_malloc(nk * sizeof(double));
        attn_core_backward_ref(&a, c->B, c->T, q, k, v, dout, rdq, rdk, rdv);
        double dv_rms = norm(rdv, nk) / sqrt((double)nk);
        int self_only = c->window == 1 || c->T == 1;
        double floor_q = self_only ? dv_rms * sqrt((double)nq) : 0.0,
               floor_k = self_only ? dv_rms * sqrt((double)nk) : 0.0;
        check_backward(&o1, dt, nq, nk, rdq, rdk, rdv, floor_q, floor_k, name, tol, err + 2);
        // at d_h = 128 an sm_90a build's backward is the wgmma passes: the mma.sync passes checked too
        if (dt == DT_BF16 && c->D == 128 && attn_use_wgmma(c->D)) {
            AttnArgs p = attn_args(&a, c->T);
            p.q = dq_in; p.k = dk_in; p.v = dv_in; p.o = o1.out; p.dout = ddout; p.lse = o1.lse;
            p.dq = o2.dq; p.dk = o2.dk; p.dv = o2.dv; p.delta = (float *)ws;
            poison(o2.dq, nq * esize(dt)); poison(o2.dk, nk * esize(dt)); poison(o2.dv, nk * esize(dt));
            attn_delta<bf16, 128>(p, c->B, 0);
            attn_dkdv_mma<128, ATTN_DKDV_CFG>(p, c->B, 0);
            attn_dq_mma<128, ATTN_DQ_CFG>(p, c->B, 0);
            CK(cudaDeviceSynchronize());
            double merr[3];
            char mname[200];
            snprintf(mname, sizeof mname, "%s mma.sync", name);
            check_backward(&o2, dt, nq, nk, rdq, rdk, rdv, floor_q, floor_k, mname, tol, merr);
            printf("| %s | %d | %d | %d/%d | %d | %d | mma.sync backward | - | - | %.1e | %.1e | %.1e | - |\n",
                   dt_name(dt), c->B, c->T, c->nh, c->nkv, c->D, c->window, merr[0], merr[1], merr[2]);
        }
        free(rdq); free(rdk); free(rdv);
    }

    // determinism: a second run into other (poisoned) buffers is bitwise equal
    run_core(&a, c, dt, dq_in, dk_in, dv_in, ddout, ws, &o2, nq, nk, nl);
    int same = bitwise_equal(o1.out, o2.out, nq * esize(dt)) && bitwise_equal(o1.lse, o2.lse, nl * sizeof(float)) &&
               bitwise_equal(o1.dq, o2.dq, nq * esize(dt)) && bitwise_equal(o1.dk, o2.dk, nk * esize(dt)) &&
               bitwise_equal(o1.dv, o2.dv, nk * esize(dt));
    CHECK(same, "%s: two runs differ", name);
    // inference (no lse) writes the same output as training
    poison(o2.out, nq * esize(dt));
    attn_forward(&a, c->B, c->T, dt, dq_in, dk_in, dv_in, o2.out, NULL, 0);
    CK(cudaDeviceSynchronize());
    CHECK(bitwise_equal(o1.out, o2.out, nq * esize(dt)), "%s: inference forward differs from training forward", name);
    printf("| %s | %d | %d | %d/%d | %d | %d | %s |", dt_name(dt), c->B, c->T, c->nh, c->nkv, c->D, c->window,
           c->row_step ? "every 97th + last" : "all");
    for (int i = 0; i < 5; i++) printf(err[i] < 0 ? " - |" : " %.1e |", err[i]);
    printf(" %s |\n", same ? "yes" : "NO");

    free(q); free(k); free(v); free(dout);
    for (int i = 0; i < 2; i++) {
        cudaFree(os[i]->out); cudaFree(os[i]->dq); cudaFree(os[i]->dk); cudaFree(os[i]->dv); cudaFree(os[i]->lse);
    }
    cudaFree(dq_in); cudaFree(dk_in); cudaFree(dv_in); cudaFree(ddout); cudaFree(ws);
}

// Decode token by token (one attn_decode per step: RoPE on the newest q and k, k and v appended to the cache, the
// newest query attended) for B streams and compare every step's output with the full forward on the rotated
// inputs: the CPU reference and the GPU's own (attn_rope, then attn_forward). The cache rows the steps wrote must be
// the bits attn_rope gives the keys (the fused rotation is the prefill's) and the values copied. Each step runs
// again with a random gate z (appending the same rows to the same slots): its og must be the bits of
// attn_gate_forward on z and the ungated output. Stream 0 also decodes alone, on caches of its own: every step's
// output must be the bits it gets in the batch (at B n_h > 2 SMs the batch takes 8-warp blocks, alone 16).
static void test_decode(int B, int T, int nh, int nkv, int D, int window, Dtype dt) {
    CoreCase c = {B, T, nh, nkv, D, window, 0, 0};
    AttnDims a = dims_of(&c);
    AttnRope rope = attn_rope_create(D, a.rope_theta);
    int C = window > 0 ? window : T; // ring of w entries for SWA, the whole sequence for full attention
    size_t nq = (size_t)B * T * nh * D, nk = (size_t)B * T * nkv * D, es = esize(dt);
    Rng rng = rng_make(77 + window + D);
    double *q = random_vec(&rng, nq), *k = random_vec(&rng, nk), *v = random_vec(&rng, nk), *z = random_vec(&rng, nq);
    char *dq_in = (char *)upload(q, nq, dt), *dk_in = (char *)upload(k, nk, dt), *dv_in = (char *)upload(v, nk, dt);
    char *dz_in = (char *)upload(z, nq, dt);
    // per-step inputs [B, one token]: gathered from the [B,T,...] tensors
    char *qt = (char *)dev_alloc((size_t)B * nh * D * es), *kt = (char *)dev_alloc((size_t)B * nkv * D * es);
    char *vt = (char *)dev_alloc((size_t)B * nkv * D * es), *ot = (char *)dev_alloc((size_t)B * nh * D * es);
    char *zt = (char *)dev_alloc((size_t)B * nh * D * es), *ogt = (char *)dev_alloc((size_t)B * nh * D * es);
    char *og_ref = (char *)dev_alloc((size_t)B * nh * D * es);
    int gate_same = 1;
    char *kc = (char *)dev_alloc((size_t)B * C * nkv * D * es), *vc = (char *)dev_alloc((size_t)B * C * nkv * D * es);
    char *dec = (char *)dev_alloc(nq * es), *full = (char *)dev_alloc(nq * es);
    char *kdec = (char *)dev_alloc(nk * es), *vdec = (char *)dev_alloc(nk * es); // each step's cache rows
    int *dpos = (int *)dev_alloc(B * sizeof(int));
    int *hpos = (int *)sdm_malloc(B * sizeof(int));
    poison(kc, (size_t)B * C * nkv * D * es); poison(vc, (size_t)B * C * nkv * D * es); poison(dec, nq * es);
    size_t qrow = (size_t)nh * D * es, krow = (size_t)nkv * D * es;
    char *kc1 = (char *)dev_alloc(C * krow), *vc1 = (char *)dev_alloc(C * krow), *o1 = (char *)dev_alloc(qrow);
    int alone_same = 1;
    for (int t = 0; t < T; t++) {
        for (int b = 0; b < B; b++) {
            hpos[b] = t;
            size_t bt = (size_t)b * T + t;
            CK(cudaMemcpy(qt + b * qrow, dq_in + bt * qrow, qrow, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(kt + b * krow, dk_in + bt * krow, krow, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(vt + b * krow, dv_in + bt * krow, krow, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(zt + b * qrow, dz_in + bt * qrow, qrow, cudaMemcpyDeviceToDevice));
        }
        CK(cudaMemcpy(dpos, hpos, B * sizeof(int), cudaMemcpyHostToDevice));
        attn_decode(&a, B, dt, &rope, qt, kt, vt, NULL, nh * D, nkv * D, kc, vc, C, dpos, ot, 0);
        attn_decode(&a, B, dt, &rope, qt, kt, vt, zt, nh * D, nkv * D, kc, vc, C, dpos, ogt, 0);
        attn_gate_forward(dt, (size_t)B * nh * D, zt, ot, og_ref, 0);
        gate_same &= bitwise_equal(ogt, og_ref, B * qrow);
        attn_decode(&a, 1, dt, &rope, qt, kt, vt, NULL, nh * D, nkv * D, kc1, vc1, C, dpos, o1, 0);
        alone_same &= bitwise_equal(o1, ot, qrow);
        for (int b = 0; b < B; b++) {
            size_t bt = (size_t)b * T + t, cslot = ((size_t)b * C + t % C) * krow;
            CK(cudaMemcpy(dec + bt * qrow, ot + b * qrow, qrow, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(kdec + bt * krow, kc + cslot, krow, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(vdec + bt * krow, vc + cslot, krow, cudaMemcpyDeviceToDevice));
        }
    }
    attn_rope(&rope, &a, B, T, dt, dq_in, dk_in, NULL, 1, 0);
    attn_forward(&a, B, T, dt, dq_in, dk_in, dv_in, full, NULL, 0);
    CK(cudaDeviceSynchronize());
    char what[160];
    snprintf(what, sizeof what, "decode %s B%d T%d h%d/%d d%d w%d: cache keys are attn_rope's, values copied",
             dt_name(dt), B, T, nh, nkv, D, window);
    CHECK(bitwise_equal(kdec, dk_in, nk * es) && bitwise_equal(vdec, dv_in, nk * es), "%s", what);
    snprintf(what, sizeof what, "decode %s B%d T%d h%d/%d d%d w%d: gated og = attn_gate_forward's bits", dt_name(dt),
             B, T, nh, nkv, D, window);
    CHECK(gate_same, "%s", what);
    snprintf(what, sizeof what, "decode %s B%d T%d h%d/%d d%d w%d: stream 0 alone = in the batch (%d and %d warps)",
             dt_name(dt), B, T, nh, nkv, D, window, attn_decode_warps(B * nh), attn_decode_warps(nh));
    CHECK(alone_same, "%s", what);
    double *ref = (double *)sdm_malloc(nq * sizeof(double));
    attn_rope_ref(q, B, T, nh, D, a.rope_theta, 1);
    attn_rope_ref(k, B, T, nkv, D, a.rope_theta, 1);
    attn_core_forward_ref(&a, B, T, q, k, v, ref, NULL);
    double *gdec = download(dec, nq, dt), *gfull = download(full, nq, dt);
    snprintf(what, sizeof what, "decode %s B%d T%d h%d/%d d%d w%d (cache %d) vs reference", dt_name(dt), B, T, nh, nkv,
             D, window, C);
    double e_ref = check_err(what, gdec, ref, nq, 0.0, tol_of(dt));
    snprintf(what, sizeof what, "decode %s B%d T%d h%d/%d d%d w%d vs GPU forward", dt_name(dt), B, T, nh, nkv, D,
             window);
    double e_gpu = check_err(what, gdec, gfull, nq, 0.0, dt == DT_FP32 ? 1e-6 : TOL_BF16);
    printf("decode %s B%d T%d h%d/%d d%d w%d cache %d: vs reference %.1e, vs GPU forward %.1e\n", dt_name(dt), B, T, nh,
           nkv, D, window, C, e_ref, e_gpu);
    free(q); free(k); free(v); free(z); free(ref); free(gdec); free(gfull); free(hpos);
    attn_rope_destroy(&rope);
    void *bufs[] = {dq_in, dk_in, dv_in, dz_in, qt, kt, vt, zt, ot, ogt, og_ref, kc, vc, dec, full, kdec, vdec, dpos,
                    kc1, vc1, o1};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
}

// RoPE forward and backward against the reference, with positions starting at 0 and at per-stream offsets pos0.
static void test_rope(Dtype dt) {
    const int B = 2, T = 1000, nh = 4, nkv = 2, D = 128, off1 = 37;
    AttnDims a;
    a.dim = 0; a.n_heads = nh; a.n_kv_heads = nkv; a.head_dim = D; a.window = 0; a.gated = 0; a.rope_theta = 10000.0;
    AttnRope rope = attn_rope_create(D, a.rope_theta);
    size_t nq = (size_t)B * T * nh * D, nk = (size_t)B * T * nkv * D;
    Rng rng = rng_make(5);
    double *q = random_vec(&rng, nq), *k = random_vec(&rng, nk);
    int h_pos0[2] = {0, off1}, *d_pos0 = (int *)dev_alloc(sizeof h_pos0);
    CK(cudaMemcpy(d_pos0, h_pos0, sizeof h_pos0, cudaMemcpyHostToDevice));
    for (int dir = 1; dir >= -1; dir -= 2)
        for (int with_pos = 0; with_pos < 2; with_pos++) {
            void *tq = upload(q, nq, dt), *tk = upload(k, nk, dt);
            attn_rope(&rope, &a, B, T, dt, tq, tk, with_pos ? d_pos0 : NULL, dir, 0);
            CK(cudaDeviceSynchronize());
            double *gq = download(tq, nq, dt), *gk = download(tk, nk, dt);
            // reference: stream b rotated as rows pos0[b].. of a longer sequence
            double *rq = (double *)sdm_calloc(nq, sizeof(double)), *rk = (double *)sdm_calloc(nk, sizeof(double));
            for (int b = 0; b < B; b++) {
                int off = with_pos ? h_pos0[b] : 0;
                size_t qr = (size_t)nh * D, kr = (size_t)nkv * D;
                double *lq = (double *)sdm_calloc((size_t)(T + off) * qr, sizeof(double));
                double *lk = (double *)sdm_calloc((size_t)(T + off) * kr, sizeof(double));
                memcpy(lq + off * qr, q + b * T * qr, T * qr * sizeof(double));
                memcpy(lk + off * kr, k + b * T * kr, T * kr * sizeof(double));
                attn_rope_ref(lq, 1, T + off, nh, D, a.rope_theta, dir);
                attn_rope_ref(lk, 1, T + off, nkv, D, a.rope_theta, dir);
                memcpy(rq + b * T * qr, lq + off * qr, T * qr * sizeof(double));
                memcpy(rk + b * T * kr, lk + off * kr, T * kr * sizeof(double));
                free(lq); free(lk);
            }
            char what[120];
            snprintf(what, sizeof what, "rope %s dir %d pos0 %s: q", dt_name(dt), dir, with_pos ? "{0,37}" : "none");
            double eq = check_err(what, gq, rq, nq, 0.0, tol_of(dt));
            snprintf(what, sizeof what, "rope %s dir %d pos0 %s: k", dt_name(dt), dir, with_pos ? "{0,37}" : "none");
            double ek = check_err(what, gk, rk, nk, 0.0, tol_of(dt));
            printf("rope %s direction %+d pos0 %s: q %.1e, k %.1e\n", dt_name(dt), dir, with_pos ? "{0,37}" : "none",
                   eq, ek);
            free(gq); free(gk); free(rq); free(rk);
            cudaFree(tq); cudaFree(tk);
        }
    free(q); free(k);
    cudaFree(d_pos0);
    attn_rope_destroy(&rope);
}

static void test_gate(Dtype dt) {
    const size_t n = 100000;
    Rng rng = rng_make(9);
    double *z = random_vec(&rng, n), *o = random_vec(&rng, n), *dog = random_vec(&rng, n);
    void *dz_in = upload(z, n, dt), *do_in = upload(o, n, dt), *ddog = upload(dog, n, dt);
    void *og = dev_alloc(n * esize(dt)), *d_o = dev_alloc(n * esize(dt)), *dz = dev_alloc(n * esize(dt));
    poison(og, n * esize(dt)); poison(d_o, n * esize(dt)); poison(dz, n * esize(dt));
    attn_gate_forward(dt, n, dz_in, do_in, og, 0);
    attn_gate_backward(dt, n, dz_in, do_in, ddog, d_o, dz, 0);
    CK(cudaDeviceSynchronize());
    double *r_og = (double *)sdm_malloc(n * sizeof(double)), *r_do = (double *)sdm_malloc(n * sizeof(double));
    double *r_dz = (double *)sdm_malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) {
        double s = ref_sigmoid(z[i]);
        r_og[i] = s * o[i];
        r_do[i] = s * dog[i];
        r_dz[i] = dog[i] * o[i] * s * (1.0 - s);
    }
    double *g_og = download(og, n, dt), *g_do = download(d_o, n, dt), *g_dz = download(dz, n, dt);
    char what[80];
    snprintf(what, sizeof what, "gate %s forward", dt_name(dt));
    double e0 = check_err(what, g_og, r_og, n, 0.0, tol_of(dt));
    snprintf(what, sizeof what, "gate %s backward do", dt_name(dt));
    double e1 = check_err(what, g_do, r_do, n, 0.0, tol_of(dt));
    snprintf(what, sizeof what, "gate %s backward dz", dt_name(dt));
    double e2 = check_err(what, g_dz, r_dz, n, 0.0, tol_of(dt));
    printf("gate %s: forward %.1e, backward do %.1e, dz %.1e\n", dt_name(dt), e0, e1, e2);
    free(z); free(o); free(dog); free(r_og); free(r_do); free(r_dz); free(g_og); free(g_do); free(g_dz);
    cudaFree(dz_in); cudaFree(do_in); cudaFree(ddog); cudaFree(og); cudaFree(d_o); cudaFree(dz);
}

// A gated layer's decode step (attn_infer_decode: q, k, v and z = x Wgᵀ as one product, their weights consecutive
// as in the model's table; the gate in attn_decode's store) against the unfolded path on a second state: that product
// by matmul_forward on the four weights as one [2 n_h d_h + 2 n_kv d_h, D] matrix, attn_decode on its q, k, v
// columns, attn_gate_forward on its z columns, og Woᵀ. Every step's q|k|v|z rows, og, y and the caches must be the
// same bits (random weights and inputs, B streams at positions 0..T-1). Where one kernel of our own takes both the
// product and the gate's product alone (one row; fp32 up to 8 rows) they must also be the bits of attn_layer_out's
// gate, the decode before the fold: those kernels' outputs do not depend on how a product is cut (cuBLASLt may pick
// another algorithm for the gate's narrower product alone).
static void test_layer_decode_gate(Dtype dt, int B, int nh, int nkv, int hd, int window) {
    const int dim = 256, T = 8;
    AttnDims a;
    a.dim = dim; a.n_heads = nh; a.n_kv_heads = nkv; a.head_dim = hd; a.window = window; a.gated = 1;
    a.rope_theta = 10000.0;
    int nq = nh * hd, nk = nkv * hd;
    size_t es = esize(dt), wn[5] = {(size_t)nq * dim, (size_t)nk * dim, (size_t)nk * dim, (size_t)nq * dim,
                                    (size_t)dim * nq};
    Rng rng = rng_make(300 + B + hd + window);
    void *wqkvg = dev_alloc((wn[0] + wn[1] + wn[2] + wn[3]) * es), *w[5];
    size_t off = 0;
    for (int i = 0; i < 5; i++) {
        double *h = random_vec(&rng, wn[i]);
        for (size_t j = 0; j < wn[i]; j++) h[j] /= sqrt((double)dim); // unit-scale products
        w[i] = upload(h, wn[i], dt);
        free(h);
        if (i < 4) { // wq, wk, wv, wg consecutive
            CK(cudaMemcpy((char *)wqkvg + off * es, w[i], wn[i] * es, cudaMemcpyDeviceToDevice));
            cudaFree(w[i]);
            w[i] = (char *)wqkvg + off * es;
            off += wn[i];
        }
    }
    AttnLayerParams p = {w[0], w[1], w[2], w[3], w[4]};
    AttnInferState I = attn_infer_create(&a, B, T, dt), J = attn_infer_create(&a, B, T, dt);
    int ld = I.qkv_ld;
    CHECK(ld == 2 * nq + 2 * nk, "layer decode: q|k|v|z rows of %d columns, not %d", ld, 2 * nq + 2 * nk);
    char *qkvz = (char *)dev_alloc((size_t)B * ld * es);
    void *z = dev_alloc((size_t)B * nq * es), *og = dev_alloc((size_t)B * nq * es);
    void *y = dev_alloc((size_t)B * dim * es), *y_ref = dev_alloc((size_t)B * dim * es);
    void *y_old = dev_alloc((size_t)B * dim * es);
    int *dpos = (int *)dev_alloc(B * sizeof(int)), *hpos = (int *)sdm_malloc(B * sizeof(int));
    int same = 1, same_old = 1, old_applies = 0;
    for (int t = 0; t < T; t++) {
        double *hx = random_vec(&rng, (size_t)B * dim);
        void *x = upload(hx, (size_t)B * dim, dt);
        free(hx);
        for (int b = 0; b < B; b++) hpos[b] = t;
        CK(cudaMemcpy(dpos, hpos, B * sizeof(int), cudaMemcpyHostToDevice));
        attn_infer_decode(&I, &p, x, NULL, y, dpos, B, 0);
        matmul_forward(qkvz, dt, ld, x, wqkvg, NULL, dt, B, ld, dim, 0);
        char *q = qkvz, *k = q + nq * es, *v = k + nk * es, *zc = v + nk * es;
        attn_decode(&a, B, dt, &J.rope, q, k, v, NULL, ld, ld, J.k_cache, J.v_cache, J.C, dpos, J.o, 0);
        CK(cudaMemcpy2D(z, nq * es, zc, ld * es, nq * es, B, cudaMemcpyDeviceToDevice));
        attn_gate_forward(dt, (size_t)B * nq, z, J.o, og, 0);
        attn_layer_wo(&a, dt, &p, og, B, y_ref, 0);
        uintptr_t addr = (uintptr_t)x | (uintptr_t)wqkvg;
        MatmulKernel k_all = matmul_small_m_kernel(dt, B, ld, dim, 1, addr);
        old_applies = k_all != MATMUL_KERNEL_LT && k_all == matmul_small_m_kernel(dt, B, nq, dim, 1, addr);
        if (old_applies) attn_layer_out(&a, dt, &p, x, J.o, J.z, J.og, B, 1, y_old, 0);
        CK(cudaDeviceSynchronize());
        same &= bitwise_equal(I.qkv, qkvz, (size_t)B * ld * es) && bitwise_equal(I.og, og, (size_t)B * nq * es) &&
                bitwise_equal(y, y_ref, (size_t)B * dim * es);
        if (old_applies)
            same_old &= bitwise_equal(J.og, og, (size_t)B * nq * es) && bitwise_equal(y_old, y, (size_t)B * dim * es);
        cudaFree(x);
    }
    size_t cache = (size_t)B * I.C * nk * es;
    same &= bitwise_equal(I.k_cache, J.k_cache, cache) && bitwise_equal(I.v_cache, J.v_cache, cache);
    CHECK(same, "layer decode %s B%d h%d/%d d%d w%d: the folded gate differs from the unfolded path", dt_name(dt), B,
          nh, nkv, hd, window);
    CHECK(same_old, "layer decode %s B%d h%d/%d d%d w%d: the folded gate differs from attn_layer_out's", dt_name(dt), B,
          nh, nkv, hd, window);
    printf("layer decode %s B%d h%d/%d d%d w%d: folded gate = unfolded path bitwise %s, = attn_layer_out %s\n",
           dt_name(dt), B, nh, nkv, hd, window, same ? "yes" : "NO",
           old_applies ? (same_old ? "yes" : "NO") : "(other kernels)");
    attn_infer_destroy(&I);
    attn_infer_destroy(&J);
    void *bufs[] = {wqkvg, w[4], qkvz, z, og, y, y_ref, y_old, dpos};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaFree(bufs[i]);
    free(hpos);
}

int main(void) {
    printf("| type | B | T | n_h/n_kv | d_h | w | rows | out | lse | dq | dk | dv | 2 runs bitwise equal |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    // B, T, n_h, n_kv, d_h, window, backward checked, row_step (0: all rows)
    const CoreCase cases[] = {
        {1, 1, 2, 1, 64, 0, 1, 0},       {4, 17, 4, 2, 128, 0, 1, 0},     {1, 128, 8, 1, 64, 17, 1, 0},
        {1, 1000, 2, 2, 64, 1, 1, 0},    {1, 1000, 2, 1, 128, 256, 1, 0}, {4, 128, 2, 1, 128, 128, 1, 0},
        {1, 1000, 2, 2, 64, 0, 1, 0},    {4, 1000, 8, 4, 128, 17, 1, 0},  {1, 300, 8, 1, 64, 0, 1, 0},
        {2, 100, 4, 4, 128, 1000, 1, 0},
    };
    const CoreCase big[] = {
        {1, 4096, 2, 1, 128, 128, 1, 0}, {1, 4096, 2, 2, 64, 256, 1, 0}, {4, 4096, 8, 1, 128, 0, 0, 97},
    };
    Dtype dts[2] = {DT_FP32, DT_BF16};
    for (int d = 0; d < 2; d++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_core(&cases[i], dts[d], 1000 * d + i);
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) test_core(&big[i], DT_BF16, 5000 + i);
    for (int d = 0; d < 2; d++) {
        test_decode(3, 60, 4, 2, 64, 17, dts[d]);
        test_decode(3, 60, 4, 2, 128, 0, dts[d]);
        test_decode(2, 40, 8, 1, 128, 128, dts[d]);
        test_decode(1, 200, 16, 16, 128, 128, dts[d]); // the flagship's heads, the ring wrapped
        test_decode(20, 150, 16, 16, 128, 128, dts[d]); // 320 blocks: 8-warp blocks on the H200's 132 SMs
        test_decode(1, 300, 2, 1, 128, 0, dts[d]);     // several batches of keys a warp
        test_decode(1, 300, 2, 2, 64, 0, dts[d]);
        test_decode(2, 20, 4, 2, 64, 1, dts[d]);       // window 1: the newest key alone
        test_rope(dts[d]);
        test_gate(dts[d]);
        // B: one row (GEMV), a few (fp32 GEMV, bf16 MMA), more than the small-M kernels take (cuBLASLt)
        const int bs[3] = {1, 3, 70};
        for (int i = 0; i < 3; i++) {
            test_layer_decode_gate(dts[d], bs[i], 4, 2, 64, 5);
            test_layer_decode_gate(dts[d], bs[i], 2, 1, 128, 0);
        }
    }
    return test_summary();
}
