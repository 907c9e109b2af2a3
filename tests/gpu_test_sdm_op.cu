// tests/gpu_test_sdm_op.cu: the GPU SDM memory op (sdm/sdm_op.cuh) against the double-precision CPU oracle
// (sdm/sdm_ref.h): forward and every gradient on fresh random inputs, chunk-size invariance, the persistent forward =
// the per-chunk launches (bitwise), decode = prefill = training forward, bitwise determinism, snapshot modes and their
// independence of the batch, refusals.
// Tolerances (relative L2 error against the oracle): all-fp32 mode 1e-5, bf16 bank 1e-2. The same hold with heavily
// repeated slots (chains of C entries): every per-entry sum then has up to 2C fp32 terms, a relative rounding of about
// sqrt(2C) 2^-24 <= 2e-6 at C = 256, and softmax weights keep |A| <= 1 so the solve does not amplify it.
// The bank gradient in bf16 between chunks (grad_bank_bf16) over an fp32 bank: 5e-3, GRAD_BF16_TOL of
// tests/test_sdm_chunked.c, whose chunked oracle rounds G the same way (one rounding of 8 significant bits per touched
// row and chunk, ~1.7e-3 RMS, adding up over the few decayed chunks that carry it; observed there 0.7e-3 to 2.5e-3 at
// these shapes and decays, up to 7 chunks). Over a bf16 bank the two roundings' errors add: 1e-2 still.
#include <algorithm>
#include <vector>

#include "core/cuda_common.cuh"
#include "core/rng.h"
#include "sdm/sdm_op.cuh"
#include "sdm/sdm_ref.h"
#include "tests/rand_slots.h"
#include "tests/test.h"

#define TOL_FP32 1e-5
#define TOL_BF16 1e-2
#define TOL_CHUNK_FP32 1e-5 // GPU at chunk size C vs GPU at C = 64, fp32 mode
#define TOL_FP8 0.1         // kappa/gamma/rho gradients with fp8 snapshots vs none (fp32 bank)
#define TOL_INT4 0.4        // same with int4 snapshots
#define TOL_GRAD_BF16 5e-3  // fp32 bank, bank gradient in bf16 between chunks

typedef enum { GAMMA_UNIFORM, GAMMA_ZERO, GAMMA_VERY_NEGATIVE } GammaMode;

// Host inputs of one case, in the op's token-major layout.
typedef struct {
    int B, T, H, N, d, W, R;
    int *wslot, *rslot;
    double *kappa, *gamma, *beta, *v, *rho, *bank, *dout, *dbank_final;
} Case;

// positive weights summing to 1 (a softmax of normal scores)
static void draw_softmax(Rng *rng, int k, double *w) {
    double s = 0.0;
    for (int i = 0; i < k; i++) s += (w[i] = exp(rng_normal(rng)));
    for (int i = 0; i < k; i++) w[i] /= s;
}

static double *draw_normal(Rng *rng, size_t n, double std) {
    double *x = (double *)sdm_malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) x[i] = std * rng_normal(rng);
    return x;
}

static Case make_case(uint64_t seed, int B, int T, int H, int N, int d, int W, int R, GammaMode gm, int with_dfinal) {
    Case c;
    memset(&c, 0, sizeof(c));
    c.B = B; c.T = T; c.H = H; c.N = N; c.d = d; c.W = W; c.R = R;
    Rng rng = rng_make(seed);
    size_t tok = (size_t)B * T * H;
    c.wslot = (int *)sdm_malloc(tok * W * sizeof(int));
    c.rslot = (int *)sdm_malloc(tok * R * sizeof(int));
    c.kappa = (double *)sdm_malloc(tok * W * sizeof(double));
    c.gamma = (double *)sdm_malloc(tok * W * sizeof(double));
    c.rho = (double *)sdm_malloc(tok * R * sizeof(double));
    c.beta = (double *)sdm_malloc(tok * sizeof(double));
    for (size_t i = 0; i < tok; i++) {
        rand_slots(&rng, N, W, c.wslot + i * W);
        rand_slots(&rng, N, R, c.rslot + i * R);
        draw_softmax(&rng, W, c.kappa + i * W);
        draw_softmax(&rng, R, c.rho + i * R);
        for (int k = 0; k < W; k++)
            c.gamma[i * W + k] = gm == GAMMA_ZERO ? 0.0 : gm == GAMMA_VERY_NEGATIVE ? rng_range(&rng, -60.0, -30.0)
                                                                                 : rng_range(&rng, -3.0, 0.0);
        c.beta[i] = rng_range(&rng, 0.02, 0.98);
    }
    c.v = draw_normal(&rng, tok * d, 1.0);
    c.bank = draw_normal(&rng, (size_t)B * H * N * d, 0.5);
    c.dout = draw_normal(&rng, tok * d, 1.0);
    c.dbank_final = with_dfinal ? draw_normal(&rng, (size_t)B * H * N * d, 0.3) : NULL;
    return c;
}

// Every token of a (sequence, head) takes the write and read slot sets of its first token: each slot a chunk touches
// is written and read by every token of the chunk (chains of length C, the concentrated addressing of training).
static void repeat_first_slots(Case *c) {
    for (int b = 0; b < c->B; b++)
        for (int t = 1; t < c->T; t++)
            for (int h = 0; h < c->H; h++) {
                size_t i = ((size_t)b * c->T + t) * c->H + h, i0 = (size_t)b * c->T * c->H + h;
                memcpy(c->wslot + i * c->W, c->wslot + i0 * c->W, c->W * sizeof(int));
                memcpy(c->rslot + i * c->R, c->rslot + i0 * c->R, c->R * sizeof(int));
            }
}

// Every token of a stream draws its write and read slots from one hot set of `hot` slots spread over [0, N) (as
// tests/bench_sdm_op.cu's concentrated addressing): at hot = 4 W each slot of a chunk is hit by about a quarter of its
// tokens, at hot = W (and hot = R) by all of them.
static void draw_hot_slots(Case *c, uint64_t seed, int hot) {
    Rng rng = rng_make(seed);
    size_t tok = (size_t)c->B * c->T * c->H;
    for (size_t i = 0; i < tok; i++) {
        rand_slots(&rng, hot, c->W, c->wslot + i * c->W);
        rand_slots(&rng, hot, c->R, c->rslot + i * c->R);
        for (int k = 0; k < c->W; k++) c->wslot[i * c->W + k] *= c->N / hot;
        for (int k = 0; k < c->R; k++) c->rslot[i * c->R + k] *= c->N / hot;
    }
}

static void free_case(Case *c) {
    free(c->wslot); free(c->rslot); free(c->kappa); free(c->gamma); free(c->rho); free(c->beta);
    free(c->v); free(c->bank); free(c->dout); free(c->dbank_final);
}

// tokens of one chunk sharing a write slot with an earlier token of the same chunk (per stream)
static long count_collisions(const Case *c, int C) {
    long n = 0;
    for (int b = 0; b < c->B; b++)
        for (int h = 0; h < c->H; h++)
            for (int t = 0; t < c->T; t++)
                for (int u = (t / C) * C; u < t; u++) {
                    const int *x = c->wslot + sdm_tok_off(c->T, c->H, b, t, h, c->W);
                    const int *y = c->wslot + sdm_tok_off(c->T, c->H, b, u, h, c->W);
                    for (int i = 0; i < c->W; i++)
                        for (int j = 0; j < c->W; j++) n += x[i] == y[j];
                }
    return n;
}

// ---- device side ----------------------------------------------------------------------------------------------

typedef struct {
    SdmOpInputs in;
    void *bank;
    float *out, *dout, *dbank_final;
    SdmOpGrads g;
    void *saved, *scratch;
} Dev;

static float *to_dev_f(const double *x, size_t n) {
    float *h = (float *)sdm_malloc(n * sizeof(float)), *d;
    for (size_t i = 0; i < n; i++) h[i] = (float)x[i];
    cudaCheck(cudaMalloc(&d, n * sizeof(float)));
    cudaCheck(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    free(h);
    return d;
}
static int *to_dev_i(const int *x, size_t n) {
    int *d;
    cudaCheck(cudaMalloc(&d, n * sizeof(int)));
    cudaCheck(cudaMemcpy(d, x, n * sizeof(int), cudaMemcpyHostToDevice));
    return d;
}
static float *dev_f(size_t n) { float *d; cudaCheck(cudaMalloc(&d, n * sizeof(float))); return d; }

static size_t bank_elems(const Case *c) { return (size_t)c->B * c->H * c->N * c->d; }

// the initial bank in the bank dtype; the oracle's copy is rounded the same way
static void upload_bank(const Case *c, int fp32, void *dst, double *rounded) {
    size_t n = bank_elems(c);
    if (fp32) {
        float *h = (float *)sdm_malloc(n * 4);
        for (size_t i = 0; i < n; i++) rounded[i] = h[i] = (float)c->bank[i];
        cudaCheck(cudaMemcpy(dst, h, n * 4, cudaMemcpyHostToDevice));
        free(h);
    } else {
        __nv_bfloat16 *h = (__nv_bfloat16 *)sdm_malloc(n * 2);
        for (size_t i = 0; i < n; i++) {
            h[i] = __float2bfloat16((float)c->bank[i]);
            rounded[i] = __bfloat162float(h[i]);
        }
        cudaCheck(cudaMemcpy(dst, h, n * 2, cudaMemcpyHostToDevice));
        free(h);
    }
}

static double *bank_to_host(const Case *c, int fp32, const void *src) {
    size_t n = bank_elems(c);
    double *r = (double *)sdm_malloc(n * sizeof(double));
    if (fp32) {
        float *h = (float *)sdm_malloc(n * 4);
        cudaCheck(cudaMemcpy(h, src, n * 4, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) r[i] = h[i];
        free(h);
    } else {
        __nv_bfloat16 *h = (__nv_bfloat16 *)sdm_malloc(n * 2);
        cudaCheck(cudaMemcpy(h, src, n * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) r[i] = __bfloat162float(h[i]);
        free(h);
    }
    return r;
}

static double *to_host(const float *d, size_t n) {
    float *h = (float *)sdm_malloc(n * 4);
    cudaCheck(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost));
    double *r = (double *)sdm_malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++) r[i] = h[i];
    free(h);
    return r;
}

static SdmOpShape shape_of(const Case *c, int C, int fp32, SdmSnapshot snap, int training) {
    SdmOpShape s;
    memset(&s, 0, sizeof(s));
    s.B = c->B; s.T = c->T; s.H = c->H; s.N = c->N; s.d = c->d; s.W = c->W; s.R = c->R; s.C = C;
    s.bank_fp32 = fp32; s.snapshot = snap; s.training = training;
    return s;
}

static Dev dev_alloc(const Case *c, const SdmOpShape *s) {
    Dev D;
    memset(&D, 0, sizeof(D));
    size_t tok = (size_t)c->B * c->T * c->H;
    D.in.wslot = to_dev_i(c->wslot, tok * c->W);
    D.in.rslot = to_dev_i(c->rslot, tok * c->R);
    D.in.kappa = to_dev_f(c->kappa, tok * c->W);
    D.in.gamma = to_dev_f(c->gamma, tok * c->W);
    D.in.rho = to_dev_f(c->rho, tok * c->R);
    D.in.beta = to_dev_f(c->beta, tok);
    D.in.v = to_dev_f(c->v, tok * c->d);
    D.dout = to_dev_f(c->dout, tok * c->d);
    D.dbank_final = c->dbank_final ? to_dev_f(c->dbank_final, bank_elems(c)) : NULL;
    cudaCheck(cudaMalloc(&D.bank, bank_elems(c) * 4));
    D.out = dev_f(tok * c->d);
    D.g.dkappa = dev_f(tok * c->W); D.g.dgamma = dev_f(tok * c->W); D.g.drho = dev_f(tok * c->R);
    D.g.dbeta = dev_f(tok); D.g.dv = dev_f(tok * c->d); D.g.dbank_init = dev_f(bank_elems(c));
    cudaCheck(cudaMalloc(&D.saved, sdm_op_saved_bytes(s)));
    cudaCheck(cudaMalloc(&D.scratch, sdm_op_scratch_bytes(s)));
    return D;
}

static void dev_free(Dev *D) {
    cudaFree((void *)D->in.wslot); cudaFree((void *)D->in.rslot); cudaFree((void *)D->in.kappa);
    cudaFree((void *)D->in.gamma); cudaFree((void *)D->in.rho); cudaFree((void *)D->in.beta); cudaFree((void *)D->in.v);
    cudaFree(D->dout); cudaFree(D->dbank_final); cudaFree(D->bank); cudaFree(D->out);
    cudaFree(D->g.dkappa); cudaFree(D->g.dgamma); cudaFree(D->g.drho); cudaFree(D->g.dbeta); cudaFree(D->g.dv);
    cudaFree(D->g.dbank_init); cudaFree(D->saved); cudaFree(D->scratch);
}

// Everything one GPU run produces, on the host.
typedef struct { double *out, *bank_final, *dkappa, *dgamma, *dbeta, *dv, *drho, *dbank_init; } Result;

static void free_result(Result *r) {
    free(r->out); free(r->bank_final); free(r->dkappa); free(r->dgamma); free(r->dbeta); free(r->dv); free(r->drho);
    free(r->dbank_init);
}

static void poison(void *p, size_t bytes) { cudaCheck(cudaMemset(p, 0xFF, bytes)); } // NaN in fp32 and bf16

// ---- phase 1 against its definitions ----------------------------------------------------------------------------

// What phase 1 (sdm/sdm_op_wy.cuh) saves, on the host, in its layout: per write entry [S][Tp][W], per read entry
// [S][Tp][R], beta [S][Tp], the Gram matrices and Linv [S][nc][C][C].
typedef struct {
    int *w_slot, *w_prev, *w_next, *w_lastread, *r_slot, *r_prevw, *r_prevr, *r_nextr, *r_nearw;
    float *w_kappa, *w_lam, *w_gath, *w_scat, *w_pi, *w_elam_tot, *r_rho, *r_lam, *r_gath, *beta, *A, *Sm, *Linv;
} Phase1;

template <typename T> static T *saved_part(const void *saved, size_t off, size_t n) {
    T *h = (T *)sdm_malloc(n * sizeof(T));
    cudaCheck(cudaMemcpy(h, (const char *)saved + off, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
}

static Phase1 phase1_download(const SdmOpShape *s, const void *saved) {
    SdmOpLayout L = sdm_op_layout(s);
    size_t ew = (size_t)L.S * L.Tp * s->W, er = (size_t)L.S * L.Tp * s->R, cc = (size_t)L.S * L.nc * L.C * L.C;
    Phase1 p;
#define P1_INT(f, n) p.f = saved_part<int>(saved, L.f, n)
#define P1_FLT(f, n) p.f = saved_part<float>(saved, L.f, n)
    P1_INT(w_slot, ew); P1_INT(w_prev, ew); P1_INT(w_next, ew); P1_INT(w_lastread, ew);
    P1_INT(r_slot, er); P1_INT(r_prevw, er); P1_INT(r_prevr, er); P1_INT(r_nextr, er); P1_INT(r_nearw, er);
    P1_FLT(w_kappa, ew); P1_FLT(w_lam, ew); P1_FLT(w_gath, ew); P1_FLT(w_scat, ew); P1_FLT(w_pi, ew);
    P1_FLT(w_elam_tot, ew); P1_FLT(r_rho, er); P1_FLT(r_lam, er); P1_FLT(r_gath, er);
    P1_FLT(beta, (size_t)L.S * L.Tp); P1_FLT(A, cc); P1_FLT(Sm, cc); P1_FLT(Linv, cc);
#undef P1_INT
#undef P1_FLT
    return p;
}

static void phase1_free(Phase1 *p) {
    free(p->w_slot); free(p->w_prev); free(p->w_next); free(p->w_lastread); free(p->r_slot); free(p->r_prevw);
    free(p->r_prevr); free(p->r_nextr); free(p->r_nearw); free(p->w_kappa); free(p->w_lam); free(p->w_gath);
    free(p->w_scat); free(p->w_pi); free(p->w_elam_tot); free(p->r_rho); free(p->r_lam); free(p->r_gath);
    free(p->beta); free(p->A); free(p->Sm); free(p->Linv);
}

// The forward of shape s on the GPU, then with s->training the backward (a prefill leaves the gradients NULL).
// rounded_bank: the initial bank in the bank dtype. p1: when set, what phase 1 saved, downloaded after the forward.
static Result run_gpu_shape(const Case *c, const SdmOpShape *s, double *rounded_bank, Phase1 *p1 = NULL) {
    Dev D = dev_alloc(c, s);
    size_t tok = (size_t)c->B * c->T * c->H;
    upload_bank(c, s->bank_fp32, D.bank, rounded_bank);
    poison(D.out, tok * c->d * 4);
    poison(D.saved, sdm_op_saved_bytes(s));
    poison(D.scratch, sdm_op_scratch_bytes(s));
    poison(D.g.dkappa, tok * c->W * 4); poison(D.g.dgamma, tok * c->W * 4); poison(D.g.drho, tok * c->R * 4);
    poison(D.g.dbeta, tok * 4); poison(D.g.dv, tok * c->d * 4); poison(D.g.dbank_init, bank_elems(c) * 4);
    sdm_op_forward(s, &D.in, D.bank, D.out, D.saved, 0);
    if (p1) *p1 = phase1_download(s, D.saved);
    Result r;
    memset(&r, 0, sizeof(r));
    r.bank_final = bank_to_host(c, s->bank_fp32, D.bank);
    r.out = to_host(D.out, tok * c->d);
    if (s->training) {
        sdm_op_backward(s, &D.in, D.bank, D.dout, D.dbank_final, &D.g, D.saved, D.scratch, 0);
        cudaCheck(cudaDeviceSynchronize());
        r.dkappa = to_host(D.g.dkappa, tok * c->W); r.dgamma = to_host(D.g.dgamma, tok * c->W);
        r.drho = to_host(D.g.drho, tok * c->R); r.dbeta = to_host(D.g.dbeta, tok); r.dv = to_host(D.g.dv, tok * c->d);
        r.dbank_init = bank_to_host(c, !s->grad_bank_bf16, D.g.dbank_init); // G's dtype
    }
    dev_free(&D);
    return r;
}

// Forward (training) then backward on the GPU, the forward's path chosen by the op; grad_bf16: the bank gradient in
// bf16 between chunks.
static Result run_gpu(const Case *c, int C, int fp32, SdmSnapshot snap, double *rounded_bank, int grad_bf16 = 0) {
    SdmOpShape s = shape_of(c, C, fp32, snap, 1);
    s.grad_bank_bf16 = grad_bf16;
    return run_gpu_shape(c, &s, rounded_bank);
}

static Result run_ref(const Case *c, const double *bank_init) {
    size_t tok = (size_t)c->B * c->T * c->H;
    Result r;
    r.out = (double *)sdm_malloc(tok * c->d * sizeof(double));
    r.bank_final = (double *)sdm_malloc(bank_elems(c) * sizeof(double));
    memcpy(r.bank_final, bank_init, bank_elems(c) * sizeof(double));
    sdm_op_forward_ref(c->B, c->T, c->H, c->N, c->d, c->W, c->R, c->wslot, c->kappa, c->gamma, c->beta, c->v, c->rslot,
                       c->rho, r.bank_final, r.out);
    r.dkappa = (double *)sdm_malloc(tok * c->W * sizeof(double));
    r.dgamma = (double *)sdm_malloc(tok * c->W * sizeof(double));
    r.drho = (double *)sdm_malloc(tok * c->R * sizeof(double)); r.dbeta = (double *)sdm_malloc(tok * sizeof(double));
    r.dv = (double *)sdm_malloc(tok * c->d * sizeof(double));
    r.dbank_init = (double *)sdm_malloc(bank_elems(c) * sizeof(double));
    sdm_op_backward_ref(c->B, c->T, c->H, c->N, c->d, c->W, c->R, c->wslot, c->kappa, c->gamma, c->beta, c->v,
                        c->rslot, c->rho, bank_init, c->dout, c->dbank_final, r.dkappa, r.dgamma, r.dbeta, r.dv,
                        r.drho, r.dbank_init);
    return r;
}

// Compares every output; returns the largest relative error.
static double compare(const char *name, const Case *c, const Result *x, const Result *ref, double tol) {
    size_t tok = (size_t)c->B * c->T * c->H;
    struct { const char *what; const double *a, *b; size_t n; } f[] = {
        {"out", x->out, ref->out, tok * c->d}, {"bank_final", x->bank_final, ref->bank_final, bank_elems(c)},
        {"dkappa", x->dkappa, ref->dkappa, tok * c->W}, {"dgamma", x->dgamma, ref->dgamma, tok * c->W},
        {"dbeta", x->dbeta, ref->dbeta, tok}, {"dv", x->dv, ref->dv, tok * c->d},
        {"drho", x->drho, ref->drho, tok * c->R}, {"dbank_init", x->dbank_init, ref->dbank_init, bank_elems(c)}};
    double worst = 0.0;
    char buf[160];
    for (int i = 0; i < 8; i++) {
        double e = rel_error(f[i].a, f[i].b, f[i].n);
        if (!(e <= worst)) worst = e; // NaN sticks
        snprintf(buf, sizeof(buf), "%s %s", name, f[i].what);
        check_close(buf, f[i].a, f[i].b, f[i].n, tol);
    }
    printf("  %-58s max rel err %.2e (tol %.0e)\n", name, worst, tol);
    return worst;
}

// Readings and final bank bitwise equal.
static int forward_equal(const Case *c, const Result *x, const Result *y) {
    size_t tok = (size_t)c->B * c->T * c->H;
    return !memcmp(x->out, y->out, tok * c->d * 8) && !memcmp(x->bank_final, y->bank_final, bank_elems(c) * 8);
}

static int bitwise_equal(const Case *c, const Result *x, const Result *y) {
    size_t tok = (size_t)c->B * c->T * c->H;
    return forward_equal(c, x, y) && !memcmp(x->dkappa, y->dkappa, tok * c->W * 8) &&
           !memcmp(x->dgamma, y->dgamma, tok * c->W * 8) &&
           !memcmp(x->dbeta, y->dbeta, tok * 8) && !memcmp(x->dv, y->dv, tok * c->d * 8) &&
           !memcmp(x->drho, y->drho, tok * c->R * 8) && !memcmp(x->dbank_init, y->dbank_init, bank_elems(c) * 8);
}

// FNV-1a over every output and gradient of a run: equal digests mean bitwise-equal results.
static unsigned long long result_digest(const Case *c, const Result *r) {
    size_t tok = (size_t)c->B * c->T * c->H;
    const double *parts[] = {r->out, r->bank_final, r->dkappa, r->dgamma, r->dbeta, r->dv, r->drho, r->dbank_init};
    size_t sizes[] = {tok * c->d, bank_elems(c), tok * c->W, tok * c->W, tok, tok * c->d, tok * c->R, bank_elems(c)};
    unsigned long long h = 0xCBF29CE484222325ull;
    for (int i = 0; i < 8; i++) {
        const unsigned char *b = (const unsigned char *)parts[i];
        for (size_t k = 0; k < sizes[i] * sizeof(double); k++) h = (h ^ b[k]) * 0x100000001B3ull;
    }
    return h;
}

// The digest of a fixed bf16 forward + backward (the case `--digest` runs in a fresh process).
static unsigned long long fixed_case_digest(void) {
    Case c = make_case(4242, 2, 300, 2, 128, 16, 16, 16, GAMMA_UNIFORM, 1);
    double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
    Result r = run_gpu(&c, 64, 0, SDM_SNAP_NONE, rb);
    unsigned long long h = result_digest(&c, &r);
    free_result(&r); free(rb); free_case(&c);
    return h;
}

// The same inputs in this process and in a fresh one (this binary re-run with --digest) give the same bits.
static void test_fresh_process(const char *self) {
    unsigned long long here = fixed_case_digest(), there = 0;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' --digest", self);
    FILE *p = popen(cmd, "r");
    int got = p && fscanf(p, "%llx", &there) == 1;
    if (p) pclose(p);
    CHECK(got && here == there, "a fresh process gives other bits (digest %016llx here, %016llx there)", here, there);
    printf("  fresh process: digest %016llx here, %016llx there\n", here, there);
}

// Position of `slot` in the ascending list x[0..k), or -1.
static int find_slot(const int *x, int k, int slot) {
    const int *p = std::lower_bound(x, x + k, slot);
    return p < x + k && *p == slot ? (int)(p - x) : -1;
}

// The phase-1 outputs of case c at chunk length C from their definitions (docs/SDM.md#decay-sums,
// docs/SDM.md#gram-matrices, sdm/sdm_op_wy.cuh), token by token and slot by slot, on the float inputs the GPU gets:
// links by searching the other tokens' lists, lambda and nu as fp32 sums in the order phase 1 adds them (one slot's
// decays in time order from zero; nu from the chunk's end back), so those and every link and copy must match bit for
// bit; the exponentials (host expf), A, S (double sums) and Linv (double forward substitution) to a tolerance.
static Phase1 phase1_expected(const Case *c, const SdmOpShape *s) {
    SdmOpLayout L = sdm_op_layout(s);
    const int C = L.C, W = c->W, R = c->R;
    size_t ew = (size_t)L.S * L.Tp * W, er = (size_t)L.S * L.Tp * R, cc = (size_t)L.S * L.nc * C * C;
    Phase1 p;
    p.w_slot = (int *)sdm_malloc(ew * 4); p.w_prev = (int *)sdm_malloc(ew * 4); p.w_next = (int *)sdm_malloc(ew * 4);
    p.w_lastread = (int *)sdm_malloc(ew * 4); p.r_slot = (int *)sdm_malloc(er * 4);
    p.r_prevw = (int *)sdm_malloc(er * 4); p.r_prevr = (int *)sdm_malloc(er * 4);
    p.r_nextr = (int *)sdm_malloc(er * 4); p.r_nearw = (int *)sdm_malloc(er * 4);
    p.w_kappa = (float *)sdm_malloc(ew * 4); p.w_lam = (float *)sdm_malloc(ew * 4);
    p.w_gath = (float *)sdm_malloc(ew * 4); p.w_scat = (float *)sdm_malloc(ew * 4);
    p.w_pi = (float *)sdm_malloc(ew * 4); p.w_elam_tot = (float *)sdm_malloc(ew * 4);
    p.r_rho = (float *)sdm_malloc(er * 4); p.r_lam = (float *)sdm_malloc(er * 4);
    p.r_gath = (float *)sdm_malloc(er * 4); p.beta = (float *)sdm_malloc((size_t)L.S * L.Tp * 4);
    p.A = (float *)sdm_malloc(cc * 4); p.Sm = (float *)sdm_malloc(cc * 4); p.Linv = (float *)sdm_malloc(cc * 4);
    std::vector<double> A(C * C), S(C * C), X(C * C);
    for (int st = 0; st < L.S; st++)
        for (int ch = 0; ch < L.nc; ch++) {
            const int b = st / c->H, h = st % c->H, nv = SDM_MIN(C, c->T - ch * C);
            const size_t t0 = (size_t)st * L.Tp + (size_t)ch * C, e0 = t0 * W, r0 = t0 * R;
            auto ks = [&](int t) { return c->wslot + sdm_tok_off(c->T, c->H, b, ch * C + t, h, W); };
            auto qs = [&](int t) { return c->rslot + sdm_tok_off(c->T, c->H, b, ch * C + t, h, R); };
            auto gam = [&](int t, int i) { return (float)c->gamma[sdm_tok_off(c->T, c->H, b, ch * C + t, h, W) + i]; };
            for (int t = 0; t < C; t++) { // padding first: inert, no links
                p.beta[t0 + t] = t < nv ? (float)c->beta[sdm_tok_off(c->T, c->H, b, ch * C + t, h, 1)] : 0.f;
                if (t < nv) continue;
                for (int i = 0; i < W; i++) {
                    size_t e = e0 + t * W + i;
                    p.w_slot[e] = p.w_prev[e] = p.w_next[e] = p.w_lastread[e] = -1;
                    p.w_kappa[e] = p.w_lam[e] = p.w_gath[e] = p.w_scat[e] = 0.f;
                    p.w_pi[e] = p.w_elam_tot[e] = 1.f;
                }
                for (int j = 0; j < R; j++) {
                    size_t r = r0 + t * R + j;
                    p.r_slot[r] = p.r_prevw[r] = p.r_prevr[r] = p.r_nextr[r] = p.r_nearw[r] = -1;
                    p.r_rho[r] = p.r_lam[r] = p.r_gath[r] = 0.f;
                }
            }
            for (int t = 0; t < nv; t++)
                for (int i = 0; i < W; i++) {
                    const size_t e = e0 + t * W + i;
                    const int sl = ks(t)[i];
                    int prev = -1, next = -1, last = -1, lr = -1, j;
                    for (int u = t - 1; u >= 0 && prev < 0; u--)
                        if ((j = find_slot(ks(u), W, sl)) >= 0) prev = u * W + j;
                    for (int u = t + 1; u < nv && next < 0; u++)
                        if ((j = find_slot(ks(u), W, sl)) >= 0) next = u * W + j;
                    for (int u = nv - 1; u >= 0 && lr < 0; u--)
                        if ((j = find_slot(qs(u), R, sl)) >= 0) lr = u * R + j;
                    float lam = 0.f, lamtot = 0.f, nu = 0.f;
                    bool first = true;
                    for (int u = 0; u < nv; u++) // lambda up to t, Lambda up to the slot's last write
                        if ((j = find_slot(ks(u), W, sl)) >= 0) {
                            lamtot = first ? gam(u, j) : lamtot + gam(u, j);
                            first = false;
                            if (u <= t) lam = lamtot;
                            last = u;
                        }
                    for (int u = last; u > t; u--) // nu = the later decays added from the slot's last write back
                        if ((j = find_slot(ks(u), W, sl)) >= 0) nu = gam(u, j) + nu;
                    const float kap = (float)c->kappa[sdm_tok_off(c->T, c->H, b, ch * C + t, h, W) + i];
                    p.w_slot[e] = sl; p.w_prev[e] = prev; p.w_next[e] = next; p.w_lastread[e] = lr;
                    p.w_kappa[e] = kap; p.w_lam[e] = lam; p.w_gath[e] = kap * expf(lam);
                    p.w_pi[e] = expf(nu); p.w_scat[e] = p.w_pi[e] * kap; p.w_elam_tot[e] = expf(lamtot);
                }
            for (int t = 0; t < nv; t++)
                for (int i = 0; i < R; i++) {
                    const size_t r = r0 + t * R + i;
                    const int sl = qs(t)[i];
                    int prevw = -1, prevr = -1, nextr = -1, nearw = -1, j;
                    for (int u = t; u >= 0 && prevw < 0; u--)
                        if ((j = find_slot(ks(u), W, sl)) >= 0) prevw = u * W + j;
                    for (int u = t - 1; u >= 0 && prevr < 0; u--)
                        if ((j = find_slot(qs(u), R, sl)) >= 0) prevr = u * R + j;
                    for (int u = t + 1; u < nv && nextr < 0; u++)
                        if ((j = find_slot(qs(u), R, sl)) >= 0) nextr = u * R + j;
                    for (int u = t + 1; u < nv && prevw < 0 && nearw < 0; u++)
                        if ((j = find_slot(ks(u), W, sl)) >= 0) nearw = u * W + j;
                    const float rho = (float)c->rho[sdm_tok_off(c->T, c->H, b, ch * C + t, h, R) + i];
                    p.r_slot[r] = sl; p.r_prevw[r] = prevw; p.r_prevr[r] = prevr; p.r_nextr[r] = nextr;
                    p.r_nearw[r] = prevw >= 0 ? prevw : nearw;
                    p.r_rho[r] = rho; p.r_lam[r] = prevw >= 0 ? p.w_lam[e0 + prevw] : 0.f;
                    p.r_gath[r] = rho * expf(p.r_lam[r]);
                }
            // A (u < t) and S (u <= t) over the common slots, in double from the fp32 weights and log-decays above
            for (int t = 0; t < C; t++)
                for (int u = 0; u < C; u++) {
                    double av = 0.0, sv = 0.0;
                    for (int i = 0; t < nv && u < t && i < W; i++) {
                        int j = find_slot(ks(u), W, ks(t)[i]);
                        if (j < 0) continue;
                        size_t et = e0 + t * W + i, eu = e0 + u * W + j;
                        av += (double)p.w_kappa[et] * p.w_kappa[eu] * exp((double)p.w_lam[et] - p.w_lam[eu]);
                    }
                    for (int i = 0; t < nv && u <= t && i < R; i++) {
                        int j = find_slot(ks(u), W, qs(t)[i]);
                        if (j < 0) continue;
                        size_t rt = r0 + t * R + i, eu = e0 + u * W + j;
                        sv += (double)p.r_rho[rt] * p.w_kappa[eu] * exp((double)p.r_lam[rt] - p.w_lam[eu]);
                    }
                    A[t * C + u] = av;
                    S[t * C + u] = sv;
                }
            for (int j = 0; j < C; j++) // Linv = (I + diag(beta) A)^-1, column j by forward substitution
                for (int t = 0; t < C; t++) {
                    double x = t == j ? 1.0 : 0.0;
                    for (int u = j; u < t; u++) x -= p.beta[t0 + t] * A[t * C + u] * X[u * C + j];
                    X[t * C + j] = t < j ? 0.0 : x;
                }
            size_t m0 = ((size_t)st * L.nc + ch) * C * C;
            for (int i = 0; i < C * C; i++) {
                p.A[m0 + i] = (float)A[i];
                p.Sm[m0 + i] = (float)S[i];
                p.Linv[m0 + i] = (float)X[i];
            }
        }
    return p;
}

// Entries where x and y differ, bit for bit (tol = 0) or by more than tol |y| + 1e-30 (the exponentials and the
// Gram sums, positive: a zero on one side must be a zero, or a denormal, on the other); the first one printed.
template <typename T>
static long phase1_diff(const char *name, const char *what, const T *x, const T *y, size_t n, double tol) {
    long bad = 0;
    for (size_t i = 0; i < n; i++) {
        bool ok = tol > 0 ? fabs((double)x[i] - (double)y[i]) <= tol * fabs((double)y[i]) + 1e-30
                          : !memcmp(&x[i], &y[i], sizeof(T));
        if (ok) continue;
        if (!bad++) printf("  %s: %s[%zu] = %.9g, expected %.9g\n", name, what, i, (double)x[i], (double)y[i]);
    }
    CHECK(bad == 0, "%s: phase-1 %s differs at %ld of %zu entries", name, what, bad, n);
    return bad;
}

// A device expf against the host's: a few ulp.
#define TOL_P1_EXP 1e-6
// Sums of up to W positive fp32 terms against double: each term's exponent lambda_t - lambda_u is rounded to fp32
// (|lambda_t - lambda_u| 2^-24 relative, below 5e-6 for the terms above 1e-30), each product and expf a few ulp, the
// sum at most W 2^-24 (8e-6 at W = 128).
#define TOL_P1_GRAM 3e-5
#define TOL_P1_LINV 1e-4 // relative L2 error of all Linv blocks (from the A above)

// Phase 1 of case c at chunk length C against phase1_expected: every link, slot and copy and lambda exactly, the
// exponentials, A and S per element, Linv as a whole.
static void check_phase1(const Case *c, int C, const char *name) {
    SdmOpShape s = shape_of(c, C, 0, SDM_SNAP_NONE, 1);
    SdmOpLayout L = sdm_op_layout(&s);
    Dev D = dev_alloc(c, &s);
    poison(D.saved, sdm_op_saved_bytes(&s));
    sdm_op_forward_wy(&s, &D.in, D.saved, 0);
    cudaCheck(cudaDeviceSynchronize());
    Phase1 g = phase1_download(&s, D.saved), x = phase1_expected(c, &s);
    size_t ew = (size_t)L.S * L.Tp * c->W, er = (size_t)L.S * L.Tp * c->R, cc = (size_t)L.S * L.nc * L.C * L.C;
    long bad = 0; // exact: slots, links, copies, lambda
    bad += phase1_diff(name, "w_slot", g.w_slot, x.w_slot, ew, 0);
    bad += phase1_diff(name, "w_prev", g.w_prev, x.w_prev, ew, 0);
    bad += phase1_diff(name, "w_next", g.w_next, x.w_next, ew, 0);
    bad += phase1_diff(name, "w_lastread", g.w_lastread, x.w_lastread, ew, 0);
    bad += phase1_diff(name, "r_slot", g.r_slot, x.r_slot, er, 0);
    bad += phase1_diff(name, "r_prevw", g.r_prevw, x.r_prevw, er, 0);
    bad += phase1_diff(name, "r_prevr", g.r_prevr, x.r_prevr, er, 0);
    bad += phase1_diff(name, "r_nextr", g.r_nextr, x.r_nextr, er, 0);
    bad += phase1_diff(name, "r_nearw", g.r_nearw, x.r_nearw, er, 0);
    bad += phase1_diff(name, "w_kappa", g.w_kappa, x.w_kappa, ew, 0);
    bad += phase1_diff(name, "w_lam", g.w_lam, x.w_lam, ew, 0);
    bad += phase1_diff(name, "r_rho", g.r_rho, x.r_rho, er, 0);
    bad += phase1_diff(name, "r_lam", g.r_lam, x.r_lam, er, 0);
    bad += phase1_diff(name, "beta", g.beta, x.beta, (size_t)L.S * L.Tp, 0);
    bad += phase1_diff(name, "w_gath", g.w_gath, x.w_gath, ew, TOL_P1_EXP); // to a tolerance
    bad += phase1_diff(name, "w_scat", g.w_scat, x.w_scat, ew, TOL_P1_EXP);
    bad += phase1_diff(name, "w_pi", g.w_pi, x.w_pi, ew, TOL_P1_EXP);
    bad += phase1_diff(name, "w_elam_tot", g.w_elam_tot, x.w_elam_tot, ew, TOL_P1_EXP);
    bad += phase1_diff(name, "r_gath", g.r_gath, x.r_gath, er, TOL_P1_EXP);
    bad += phase1_diff(name, "A", g.A, x.A, cc, TOL_P1_GRAM);
    bad += phase1_diff(name, "S", g.Sm, x.Sm, cc, TOL_P1_GRAM);
    std::vector<double> gl(g.Linv, g.Linv + cc), xl(x.Linv, x.Linv + cc);
    double el = rel_error(gl.data(), xl.data(), cc);
    CHECK(el <= TOL_P1_LINV, "%s: phase-1 Linv relative error %.2e > %.0e", name, el, TOL_P1_LINV);
    printf("  phase 1 %-50s %s memory: %s (Linv rel err %.1e)\n", name, L.wy_work_bytes ? "global" : "shared",
           bad ? "DIFFERS" : "links, scans, Gram as defined", el);
    phase1_free(&g); phase1_free(&x);
    dev_free(&D);
}

// ---- test groups ----------------------------------------------------------------------------------------------

typedef struct {
    int B, T, H, N, d, W, R, C;
    GammaMode gm;
    int collide; // 1: the case must have in-chunk slot collisions
    int hot;     // heavily repeated slots, run in every mode; 2: every token repeats its first slot sets; 3: every
                 // token draws its slots from a hot set of 4 W (each slot in about a quarter of a chunk's tokens)
} Spec;

static void test_against_oracle(void) {
    const Spec specs[] = {
        {2, 100, 2, 64, 16, 8, 8, 16, GAMMA_UNIFORM, 1, 0},       // small bank, T % C != 0
        {1, 200, 1, 4096, 32, 16, 16, 64, GAMMA_UNIFORM, 0, 0},   // large bank
        {3, 300, 4, 256, 8, 32, 24, 256, GAMMA_UNIFORM, 1, 0},    // H = 4, C = 256, ragged last chunk
        {1, 130, 1, 512, 8, 128, 128, 64, GAMMA_UNIFORM, 1, 0},   // W = R = 128
        {8, 77, 1, 16, 8, 1, 1, 16, GAMMA_UNIFORM, 1, 0},         // W = R = 1, B = 8
        {2, 90, 2, 256, 8, 128, 1, 32, GAMMA_UNIFORM, 1, 0},      // W = 128, R = 1
        {2, 90, 1, 256, 8, 1, 128, 32, GAMMA_UNIFORM, 0, 0},      // W = 1, R = 128
        {2, 100, 2, 32, 16, 8, 8, 64, GAMMA_ZERO, 1, 0},          // no decay
        {2, 100, 2, 32, 16, 8, 8, 64, GAMMA_VERY_NEGATIVE, 1, 0}, // full wipe
        // heavy repetition: a slot's entries spread over many threads of the Gram backward
        {2, 100, 2, 8, 16, 8, 8, 64, GAMMA_UNIFORM, 1, 1},        // W = R = N: every token touches every slot
        {2, 150, 1, 64, 16, 56, 48, 64, GAMMA_UNIFORM, 1, 1},     // W, R close to N = 64
        {2, 130, 2, 256, 16, 32, 24, 64, GAMMA_UNIFORM, 1, 2},    // every token the same 32 + 24 slots
        {1, 300, 1, 256, 8, 16, 16, 256, GAMMA_UNIFORM, 1, 2},    // the same at C = 256: chains of 256 entries
        {1, 150, 2, 4096, 16, 64, 64, 64, GAMMA_UNIFORM, 1, 2},   // the flagship's W, R, C: the same 64 + 64 slots
        {1, 200, 2, 4096, 16, 64, 64, 64, GAMMA_UNIFORM, 1, 3},   // the same from a hot set of 256
    };
    int n = (int)(sizeof(specs) / sizeof(specs[0]));
    for (int fp32 = 1; fp32 >= 0; fp32--)
        for (int i = 0; i < n; i++) {
            const Spec *p = &specs[i];
            if (!fp32 && i > 3 && !p->hot) continue; // bf16 bank: the first four shapes and the hot ones
            Case c = make_case(1000 + i, p->B, p->T, p->H, p->N, p->d, p->W, p->R, p->gm, i % 2);
            if (p->hot == 2) repeat_first_slots(&c);
            if (p->hot == 3) draw_hot_slots(&c, 3000 + i, 4 * p->W);
            if (p->collide)
                CHECK(count_collisions(&c, SDM_MIN(p->C, p->T)) > 0, "case %d has no in-chunk collisions", i);
            double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
            Result g = run_gpu(&c, p->C, fp32, SDM_SNAP_NONE, rb);
            Result ref = run_ref(&c, rb);
            char name[128];
            snprintf(name, sizeof(name), "%s B%d T%d H%d N%d d%d W%d R%d C%d g%d%s", fp32 ? "fp32" : "bf16", p->B,
                     p->T, p->H, p->N, p->d, p->W, p->R, p->C, (int)p->gm,
                     p->hot == 2 ? " same-slots" : p->hot == 3 ? " hot-set" : "");
            compare(name, &c, &g, &ref, fp32 ? TOL_FP32 : TOL_BF16);
            free_result(&g); free_result(&ref); free(rb); free_case(&c);
        }
}

// The bank gradient kept in bf16 between chunks (sdm.grad_bank_dtype = bf16) against the oracle, every output and
// gradient (half the cases start from a final-bank gradient, which the op rounds in): over an fp32 bank within
// TOL_GRAD_BF16, over a bf16 bank within TOL_BF16, at the shapes of test_against_oracle with many chunks per row (up
// to 7), no decay and repeated slots; and the rounding visible (not a silent fp32 run).
static void test_grad_bf16(void) {
    const Spec specs[] = {
        {2, 100, 2, 64, 16, 8, 8, 16, GAMMA_UNIFORM, 1, 0},       // small bank, 7 chunks, T % C != 0
        {1, 200, 1, 4096, 32, 16, 16, 64, GAMMA_UNIFORM, 0, 0},   // large bank
        {3, 300, 4, 256, 8, 32, 24, 256, GAMMA_UNIFORM, 1, 0},    // H = 4, C = 256, ragged last chunk
        {1, 130, 1, 512, 8, 128, 128, 64, GAMMA_UNIFORM, 1, 0},   // W = R = 128
        {2, 100, 2, 32, 16, 8, 8, 64, GAMMA_ZERO, 1, 0},          // no decay
        {2, 130, 2, 256, 16, 32, 24, 64, GAMMA_UNIFORM, 1, 2},    // every token the same 32 + 24 slots
        {1, 200, 2, 4096, 16, 64, 64, 64, GAMMA_UNIFORM, 1, 3},   // the flagship's W, R, C, a hot set of 256
    }; // (not full wipes: their dgamma is a cancelling sum, 1.3e-2 off in tests/test_sdm_chunked.c)
    int n = (int)(sizeof(specs) / sizeof(specs[0]));
    for (int fp32 = 1; fp32 >= 0; fp32--)
        for (int i = 0; i < n; i++) {
            const Spec *p = &specs[i];
            Case c = make_case(5000 + i, p->B, p->T, p->H, p->N, p->d, p->W, p->R, p->gm, i % 2);
            if (p->hot == 2) repeat_first_slots(&c);
            if (p->hot == 3) draw_hot_slots(&c, 6000 + i, 4 * p->W);
            double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
            Result g = run_gpu(&c, p->C, fp32, SDM_SNAP_NONE, rb, 1);
            Result ref = run_ref(&c, rb);
            char name[128];
            snprintf(name, sizeof(name), "%s bf16-G B%d T%d H%d N%d d%d W%d R%d C%d g%d%s", fp32 ? "fp32" : "bf16",
                     p->B, p->T, p->H, p->N, p->d, p->W, p->R, p->C, (int)p->gm,
                     p->hot == 2 ? " same-slots" : p->hot == 3 ? " hot-set" : "");
            compare(name, &c, &g, &ref, fp32 ? TOL_GRAD_BF16 : TOL_BF16);
            if (fp32) {
                Result f = run_gpu(&c, p->C, 1, SDM_SNAP_NONE, rb); // the same run with an fp32 G
                double e = rel_error(g.dbank_init, f.dbank_init, bank_elems(&c));
                CHECK(e > 1e-6, "%s: dbank_init equals the fp32 run's (rel %.1e): G was not rounded", name, e);
                free_result(&f);
            }
            free_result(&g); free_result(&ref); free(rb); free_case(&c);
        }
}

// Same inputs at C = 16..256 (fp32): all equal to C = 64 and to the oracle; two runs bitwise equal (fp32 and bf16).
// repeat: every token repeats its first slot sets (the Gram backward's sums over long slot chains).
static void test_chunk_invariance_and_determinism(int repeat) {
    Case c = make_case(77, 2, 300, 2, 128, 16, 16, 16, GAMMA_UNIFORM, 1);
    if (repeat) repeat_first_slots(&c);
    double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
    Result base = run_gpu(&c, 64, 1, SDM_SNAP_NONE, rb);
    Result ref = run_ref(&c, rb);
    compare("fp32 C=64 vs oracle", &c, &base, &ref, TOL_FP32);
    const int Cs[] = {16, 32, 128, 256};
    for (int i = 0; i < 4; i++) {
        Result r = run_gpu(&c, Cs[i], 1, SDM_SNAP_NONE, rb);
        char name[64];
        snprintf(name, sizeof(name), "fp32 C=%d vs C=64", Cs[i]);
        compare(name, &c, &r, &base, TOL_CHUNK_FP32);
        free_result(&r);
    }
    Result again = run_gpu(&c, 64, 1, SDM_SNAP_NONE, rb);
    CHECK(bitwise_equal(&c, &base, &again), "fp32: two runs differ");
    Result x = run_gpu(&c, 64, 0, SDM_SNAP_NONE, rb), y = run_gpu(&c, 64, 0, SDM_SNAP_NONE, rb); // bf16 bank
    CHECK(bitwise_equal(&c, &x, &y), "bf16: two runs differ");
    free_result(&x); free_result(&y);
    for (int fp32 = 0; fp32 <= 1; fp32++) { // bf16 bank gradient
        Result u = run_gpu(&c, 64, fp32, SDM_SNAP_NONE, rb, 1), w = run_gpu(&c, 64, fp32, SDM_SNAP_NONE, rb, 1);
        CHECK(bitwise_equal(&c, &u, &w), "%s bank, bf16 bank gradient: two runs differ", fp32 ? "fp32" : "bf16");
        free_result(&u); free_result(&w);
    }
    printf("  chunk invariance / determinism checked\n");
    free_result(&base); free_result(&ref); free_result(&again); free(rb); free_case(&c);
}

// Shape s with the forward's chunk loop as three launches per chunk, then with the gather's rows by bulk copies, then
// persistent on all the blocks that fit and on 3 blocks (each walks many virtual blocks of every phase): every run
// must give the launches' bits, in training every output and gradient (the backward reads what the forward saved), in
// a prefill readings and bank. Returns the persistent run on all blocks.
static Result run_persistent_vs_launches(const Case *c, SdmOpShape s, double *rounded_bank, const char *name) {
    s.fwd_path = SDM_FWD_LAUNCHES;
    Result base = run_gpu_shape(c, &s, rounded_bank);
    s.fwd_path = SDM_FWD_LAUNCHES_BULK;
    Result bulk = run_gpu_shape(c, &s, rounded_bank);
    int same_bulk = s.training ? bitwise_equal(c, &bulk, &base) : forward_equal(c, &bulk, &base);
    CHECK(same_bulk, "%s: the gather by bulk copies differs from the rows in registers", name);
    free_result(&bulk);
    s.fwd_path = SDM_FWD_PERSISTENT;
    Result all = run_gpu_shape(c, &s, rounded_bank);
    s.fwd_max_blocks = 3;
    Result few = run_gpu_shape(c, &s, rounded_bank);
    int same_all = s.training ? bitwise_equal(c, &all, &base) : forward_equal(c, &all, &base);
    int same_few = s.training ? bitwise_equal(c, &few, &base) : forward_equal(c, &few, &base);
    CHECK(same_all, "%s: the persistent forward differs from the launches", name);
    CHECK(same_few, "%s: the persistent forward on 3 blocks differs from the launches", name);
    printf("  %-58s persistent = bulk = launches: %s\n", name,
           same_all && same_few && same_bulk ? "same bits" : "DIFFERENT");
    free_result(&base); free_result(&few);
    return all;
}

// The persistent forward (the chunk loop in one cooperative launch) against the launches, bit for bit, and against
// the oracle (training: every output and gradient; prefill: readings and bank), its prefill bitwise equal to its
// training forward. S = 1, 2, 4 streams, C = 16 and 64, T a multiple of C and not, W = R = 64 and small W, R, d up to
// the flagship's 1024, both banks.
static void test_persistent_forward(void) {
    const Spec specs[] = {
        {1, 200, 1, 512, 64, 64, 64, 64, GAMMA_UNIFORM, 1, 0},   // S = 1, T % C != 0
        {1, 128, 2, 256, 1024, 64, 64, 64, GAMMA_UNIFORM, 1, 0}, // S = 2 (two heads), the flagship's d, W, R, C
        {2, 100, 1, 128, 32, 8, 8, 16, GAMMA_UNIFORM, 1, 0},     // S = 2 (two sequences), C = 16, T % C != 0
        {2, 64, 2, 256, 64, 64, 64, 16, GAMMA_UNIFORM, 1, 0},    // S = 4, C = 16, T % C == 0
        {1, 96, 4, 64, 32, 4, 12, 64, GAMMA_UNIFORM, 1, 0},      // S = 4 (four heads), small W != R, T % C != 0
        {4, 64, 1, 128, 128, 64, 64, 64, GAMMA_UNIFORM, 1, 0},   // S = 4 (four sequences), one chunk
    };
    int n = (int)(sizeof(specs) / sizeof(specs[0]));
    for (int fp32 = 1; fp32 >= 0; fp32--)
        for (int i = 0; i < n; i++) {
            const Spec *p = &specs[i];
            Case c = make_case(2000 + i, p->B, p->T, p->H, p->N, p->d, p->W, p->R, p->gm, i % 2);
            CHECK(count_collisions(&c, SDM_MIN(p->C, p->T)) > 0, "persistent case %d has no in-chunk collisions", i);
            double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
            size_t tok = (size_t)c.B * c.T * c.H;
            double tol = fp32 ? TOL_FP32 : TOL_BF16;
            char name[96], what[160];
            snprintf(name, sizeof(name), "%s B%d T%d H%d N%d d%d W%d R%d C%d", fp32 ? "fp32" : "bf16", p->B, p->T,
                     p->H, p->N, p->d, p->W, p->R, p->C);
            SdmOpShape s = shape_of(&c, p->C, fp32, SDM_SNAP_NONE, 1);
            snprintf(what, sizeof(what), "%s training", name);
            Result train = run_persistent_vs_launches(&c, s, rb, what);
            Result ref = run_ref(&c, rb);
            snprintf(what, sizeof(what), "persistent %s vs oracle", name);
            compare(what, &c, &train, &ref, tol);
            s.training = 0;
            snprintf(what, sizeof(what), "%s prefill", name);
            Result pre = run_persistent_vs_launches(&c, s, rb, what);
            snprintf(what, sizeof(what), "persistent %s prefill out vs oracle", name);
            check_close(what, pre.out, ref.out, tok * c.d, tol);
            snprintf(what, sizeof(what), "persistent %s prefill bank vs oracle", name);
            check_close(what, pre.bank_final, ref.bank_final, bank_elems(&c), tol);
            CHECK(forward_equal(&c, &pre, &train), "%s: persistent prefill differs from its training forward", name);
            free_result(&train); free_result(&ref); free_result(&pre); free(rb); free_case(&c);
        }
}

// bf16 snapshots (fp32 bank) and fp8/int4 (fp32 and bf16 banks) leave the forward bit-identical to none; their
// kappa/gamma/rho gradients are within TOL_BF16/TOL_FP8/TOL_INT4, the others unchanged. Over a bf16 bank the reads
// of rows a chunk or a later one writes take the dequantised snapshot rounded to bf16, as the bank would hold it.
static void test_snapshot_modes(int fp32) {
    Case c = make_case(91, 2, 200, 2, 128, 64, 16, 16, GAMMA_UNIFORM, 0);
    double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
    Result none = run_gpu(&c, 64, fp32, SDM_SNAP_NONE, rb);
    size_t tok = (size_t)c.B * c.T * c.H;
    const SdmSnapshot modes[] = {SDM_SNAP_BF16, SDM_SNAP_FP8, SDM_SNAP_INT4};
    const double tols[] = {TOL_BF16, TOL_FP8, TOL_INT4};
    const char *names[] = {"bf16", "fp8", "int4"};
    for (int i = fp32 ? 0 : 1; i < 3; i++) { // bf16 snapshots need an fp32 bank
        Result r = run_gpu(&c, 64, fp32, modes[i], rb);
        CHECK(!memcmp(r.out, none.out, tok * c.d * 8) && !memcmp(r.bank_final, none.bank_final, bank_elems(&c) * 8),
              "%s snapshots changed the forward", names[i]);
        double ek = rel_error(r.dkappa, none.dkappa, tok * c.W), eg = rel_error(r.dgamma, none.dgamma, tok * c.W);
        double er = rel_error(r.drho, none.drho, tok * c.R), eb = rel_error(r.dbeta, none.dbeta, tok);
        double ev = rel_error(r.dv, none.dv, tok * c.d), eG = rel_error(r.dbank_init, none.dbank_init, bank_elems(&c));
        printf("  %s bank, snapshot %-4s vs none: dkappa %.2e dgamma %.2e drho %.2e dbeta %.2e dv %.2e dbank %.2e "
               "(tol %.0e)\n", fp32 ? "fp32" : "bf16", names[i], ek, eg, er, eb, ev, eG, tols[i]);
        CHECK(ek <= tols[i] && eg <= tols[i] && er <= tols[i], "%s snapshot gradients off", names[i]);
        CHECK(eb <= TOL_FP32 && ev <= TOL_FP32 && eG <= TOL_FP32, "%s snapshots changed bank-free gradients", names[i]);
        free_result(&r);
    }
    free_result(&none); free(rb); free_case(&c);
}

// fp8/int4 snapshots round a row the same way at any batch size: sequence 0 of a batch of 8 gets the gradients it
// gets alone, although the solve kernels tile its columns differently (sdm_op_col_block: 64 columns at B = 8, 8 at
// B = 1). Only the order of fp32 sums may change, hence the fp32 tolerance.
static void test_snapshot_batch_independence(void) {
    Case c = make_case(93, 8, 64, 4, 128, 512, 16, 16, GAMMA_UNIFORM, 0);
    Case one = c;
    one.B = 1; // sequence 0: the first slice of every token-major array and of the bank
    double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
    double *rb1 = (double *)sdm_malloc(bank_elems(&one) * sizeof(double));
    size_t tok = (size_t)one.T * one.H;
    const SdmSnapshot modes[] = {SDM_SNAP_FP8, SDM_SNAP_INT4};
    const char *names[] = {"fp8", "int4"};
    for (int i = 0; i < 2; i++) {
        Result all = run_gpu(&c, 64, 1, modes[i], rb), alone = run_gpu(&one, 64, 1, modes[i], rb1);
        double ek = rel_error(all.dkappa, alone.dkappa, tok * c.W), eg = rel_error(all.dgamma, alone.dgamma, tok * c.W);
        double er = rel_error(all.drho, alone.drho, tok * c.R);
        printf("  %-4s snapshots, sequence 0 in a batch of 8 vs alone: dkappa %.2e dgamma %.2e drho %.2e\n", names[i],
               ek, eg, er);
        CHECK(ek <= TOL_FP32 && eg <= TOL_FP32 && er <= TOL_FP32, "%s snapshot rounding depends on the batch",
              names[i]);
        free_result(&all);
        free_result(&alone);
    }
    free(rb); free(rb1); free_case(&c);
}

// T decode steps = one prefill = the training forward (outputs and final bank); prefill bitwise = training forward.
static void test_decode(int fp32, int B, int T, int N, int d, int W, int R) {
    Case c = make_case(55 + fp32 + B + W, B, T, 2, N, d, W, R, GAMMA_UNIFORM, 0);
    double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
    size_t tok = (size_t)c.B * c.T * c.H;
    SdmOpShape st = shape_of(&c, 64, fp32, SDM_SNAP_NONE, 1), sp = shape_of(&c, 64, fp32, SDM_SNAP_NONE, 0);
    Dev D = dev_alloc(&c, &st);
    // training forward
    upload_bank(&c, fp32, D.bank, rb);
    poison(D.out, tok * c.d * 4);
    sdm_op_forward(&st, &D.in, D.bank, D.out, D.saved, 0);
    double *o_train = to_host(D.out, tok * c.d), *b_train = bank_to_host(&c, fp32, D.bank);
    // prefill
    upload_bank(&c, fp32, D.bank, rb);
    poison(D.out, tok * c.d * 4);
    poison(D.saved, sdm_op_saved_bytes(&sp));
    sdm_op_forward(&sp, &D.in, D.bank, D.out, D.saved, 0);
    double *o_pre = to_host(D.out, tok * c.d), *b_pre = bank_to_host(&c, fp32, D.bank);
    CHECK(!memcmp(o_pre, o_train, tok * c.d * 8) && !memcmp(b_pre, b_train, bank_elems(&c) * 8),
          "%s prefill differs from the training forward", fp32 ? "fp32" : "bf16");
    // decode: step t reads the [B,1,H,...] slice of token t
    Case s1 = c;
    s1.T = 1;
    SdmOpShape sd = shape_of(&s1, 64, fp32, SDM_SNAP_NONE, 0);
    size_t S = (size_t)c.B * c.H;
    int *ws = (int *)sdm_malloc(S * c.W * sizeof(int)), *rs = (int *)sdm_malloc(S * c.R * sizeof(int));
    double *kap = (double *)sdm_malloc(S * c.W * 8), *gam = (double *)sdm_malloc(S * c.W * 8);
    double *rho = (double *)sdm_malloc(S * c.R * 8), *bet = (double *)sdm_malloc(S * 8),
           *vv = (double *)sdm_malloc(S * c.d * 8);
    double *o_dec = (double *)sdm_malloc(tok * c.d * 8);
    upload_bank(&c, fp32, D.bank, rb);
    float *dout1 = dev_f(S * c.d);
    for (int t = 0; t < c.T; t++) {
        for (int b = 0; b < c.B; b++)
            for (int h = 0; h < c.H; h++) {
                size_t i = (size_t)b * c.H + h;
                memcpy(ws + i * c.W, c.wslot + sdm_tok_off(c.T, c.H, b, t, h, c.W), c.W * sizeof(int));
                memcpy(kap + i * c.W, c.kappa + sdm_tok_off(c.T, c.H, b, t, h, c.W), c.W * 8);
                memcpy(gam + i * c.W, c.gamma + sdm_tok_off(c.T, c.H, b, t, h, c.W), c.W * 8);
                memcpy(rs + i * c.R, c.rslot + sdm_tok_off(c.T, c.H, b, t, h, c.R), c.R * sizeof(int));
                memcpy(rho + i * c.R, c.rho + sdm_tok_off(c.T, c.H, b, t, h, c.R), c.R * 8);
                bet[i] = c.beta[sdm_tok_off(c.T, c.H, b, t, h, 1)];
                memcpy(vv + i * c.d, c.v + sdm_tok_off(c.T, c.H, b, t, h, c.d), c.d * 8);
            }
        SdmOpInputs in1;
        in1.wslot = to_dev_i(ws, S * c.W); in1.rslot = to_dev_i(rs, S * c.R); in1.kappa = to_dev_f(kap, S * c.W);
        in1.gamma = to_dev_f(gam, S * c.W); in1.rho = to_dev_f(rho, S * c.R); in1.beta = to_dev_f(bet, S);
        in1.v = to_dev_f(vv, S * c.d);
        poison(dout1, S * c.d * 4);
        sdm_op_decode(&sd, &in1, D.bank, dout1, 0);
        double *o1 = to_host(dout1, S * c.d);
        for (int b = 0; b < c.B; b++)
            for (int h = 0; h < c.H; h++)
                memcpy(o_dec + sdm_tok_off(c.T, c.H, b, t, h, c.d), o1 + ((size_t)b * c.H + h) * c.d, c.d * 8);
        free(o1);
        cudaFree((void *)in1.wslot);
        cudaFree((void *)in1.rslot);
        cudaFree((void *)in1.kappa);
        cudaFree((void *)in1.gamma);
        cudaFree((void *)in1.rho); cudaFree((void *)in1.beta); cudaFree((void *)in1.v);
    }
    double *b_dec = bank_to_host(&c, fp32, D.bank);
    double tol = fp32 ? TOL_FP32 : TOL_BF16;
    const char *nm = fp32 ? "fp32" : "bf16";
    char buf[96];
    snprintf(buf, sizeof(buf), "%s decode out vs prefill", nm);
    check_close(buf, o_dec, o_pre, tok * c.d, tol);
    snprintf(buf, sizeof(buf), "%s decode bank vs prefill", nm);
    check_close(buf, b_dec, b_pre, bank_elems(&c), tol);
    // and against the oracle
    Result ref = run_ref(&c, rb);
    snprintf(buf, sizeof(buf), "%s decode out vs oracle", nm);
    check_close(buf, o_dec, ref.out, tok * c.d, tol);
    printf("  %s decode (B=%d N=%d d=%d W=%d R=%d): out vs prefill %.2e, bank vs prefill %.2e, out vs oracle %.2e\n",
           nm, B, N, d, W, R, rel_error(o_dec, o_pre, tok * c.d), rel_error(b_dec, b_pre, bank_elems(&c)),
           rel_error(o_dec, ref.out, tok * c.d));
    free_result(&ref);
    free(ws); free(rs); free(kap); free(gam); free(rho); free(bet); free(vv); free(o_dec); free(b_dec);
    free(o_train); free(b_train); free(o_pre); free(b_pre); free(rb);
    cudaFree(dout1);
    dev_free(&D);
    free_case(&c);
}

// The cases of the phase-1 checks: uniform slots (few repeats), slots from a hot set (hot > 0: each slot of a chunk in
// about W / hot of its tokens: a quarter at 4 W, all at W), every token the slots of its stream's first token
// (hot < 0: chains of C entries), W != R, one slot per token, partial last chunks, the flagship's W = R = 64 at C = 64,
// and large chunks (C = 256; W = R = 128), whose working set phase 1 keeps in global memory.
typedef struct {
    int B, T, H, N, W, R, C, hot;
    GammaMode gm;
} Phase1Spec;

static const Phase1Spec k_phase1_specs[] = {
    {2, 150, 2, 65536, 64, 64, 64, 0, GAMMA_UNIFORM},        // the flagship's addressing, uniform, T % C != 0
    {1, 200, 2, 65536, 64, 64, 64, 256, GAMMA_UNIFORM},      // hot set of 256
    {1, 100, 2, 4096, 64, 64, 64, -1, GAMMA_UNIFORM},        // every token the same 64 + 64 slots
    {1, 130, 1, 4096, 64, 64, 64, 64, GAMMA_VERY_NEGATIVE},  // hot set of 64 (= W), full wipe
    {2, 90, 1, 64, 12, 20, 32, 0, GAMMA_UNIFORM},            // W != R, dense N
    {1, 100, 2, 512, 16, 48, 64, -1, GAMMA_ZERO},            // W != R, same slots, no decay
    {1, 77, 2, 16, 1, 1, 16, 0, GAMMA_UNIFORM},              // one slot per token
    {1, 70, 1, 256, 64, 1, 64, 64, GAMMA_UNIFORM},           // every token writes the same 64 slots, reads one
    {1, 300, 1, 256, 32, 32, 256, 128, GAMMA_UNIFORM},       // C = 256, hot set of 128
    {1, 130, 1, 2048, 128, 128, 64, 512, GAMMA_UNIFORM},     // W = R = 128, hot set of 512
};

static Case phase1_case(int i) {
    const Phase1Spec *p = &k_phase1_specs[i];
    Case c = make_case(5000 + i, p->B, p->T, p->H, p->N, 8, p->W, p->R, p->gm, 0);
    if (p->hot < 0) repeat_first_slots(&c);
    if (p->hot > 0) draw_hot_slots(&c, 6000 + i, p->hot);
    return c;
}

static void phase1_name(int i, char *buf, size_t n) {
    const Phase1Spec *p = &k_phase1_specs[i];
    snprintf(buf, n, "B%d T%d H%d N%d W%d R%d C%d %s g%d", p->B, p->T, p->H, p->N, p->W, p->R, p->C,
             p->hot < 0 ? "same-slots" : p->hot > 0 ? "hot-set" : "uniform", (int)p->gm);
}

static void test_phase1(void) {
    for (int i = 0; i < (int)(sizeof(k_phase1_specs) / sizeof(k_phase1_specs[0])); i++) {
        Case c = phase1_case(i);
        char name[96];
        phase1_name(i, name, sizeof(name));
        check_phase1(&c, k_phase1_specs[i].C, name);
        free_case(&c);
    }
}

static unsigned long long fnv1a(unsigned long long h, const void *p, size_t bytes) {
    for (size_t k = 0; k < bytes; k++) h = (h ^ ((const unsigned char *)p)[k]) * 0x100000001B3ull;
    return h;
}

// --wy-digest: for each phase-1 case (fp32 bank), a digest of everything phase 1 saved and one of every output and
// gradient of the forward and backward. Equal lines from two builds mean the same bits: how a rewrite of the WY
// kernels is checked against the kernels it replaces (run this at both commits and compare).
static void print_wy_digests(void) {
    for (int i = 0; i < (int)(sizeof(k_phase1_specs) / sizeof(k_phase1_specs[0])); i++) {
        Case c = phase1_case(i);
        SdmOpShape s = shape_of(&c, k_phase1_specs[i].C, 1, SDM_SNAP_NONE, 1);
        SdmOpLayout L = sdm_op_layout(&s);
        size_t ew = (size_t)L.S * L.Tp * c.W * 4, er = (size_t)L.S * L.Tp * c.R * 4;
        size_t cc = (size_t)L.S * L.nc * L.C * L.C * 4;
        double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
        Phase1 p;
        Result r = run_gpu_shape(&c, &s, rb, &p);
        unsigned long long h = 0xCBF29CE484222325ull;
        const void *wparts[] = {p.w_slot, p.w_prev, p.w_next, p.w_lastread, p.w_kappa, p.w_lam, p.w_gath, p.w_scat,
                                p.w_pi, p.w_elam_tot};
        const void *rparts[] = {p.r_slot, p.r_prevw, p.r_prevr, p.r_nextr, p.r_nearw, p.r_rho, p.r_lam, p.r_gath};
        for (int k = 0; k < 10; k++) h = fnv1a(h, wparts[k], ew);
        for (int k = 0; k < 8; k++) h = fnv1a(h, rparts[k], er);
        h = fnv1a(h, p.beta, (size_t)L.S * L.Tp * 4);
        h = fnv1a(h, p.A, cc); h = fnv1a(h, p.Sm, cc); h = fnv1a(h, p.Linv, cc);
        char name[96];
        phase1_name(i, name, sizeof(name));
        printf("%-48s phase1 %016llx op %016llx\n", name, h, result_digest(&c, &r));
        phase1_free(&p); free_result(&r); free(rb); free_case(&c);
    }
}

static void test_refusals(void) {
    SdmOpShape s;
    memset(&s, 0, sizeof(s));
    s.B = 1; s.T = 64; s.H = 1; s.N = 256; s.d = 64; s.W = 8; s.R = 8; s.C = 64;
    CHECK(sdm_op_check(&s) == NULL, "valid shape refused: %s", sdm_op_check(&s));
    s.d = 12; CHECK(sdm_op_check(&s) != NULL, "d = 12 accepted"); s.d = 64;
    s.C = 300; CHECK(sdm_op_check(&s) != NULL, "C = 300 accepted"); s.C = 64;
    s.W = 300; CHECK(sdm_op_check(&s) != NULL, "W > N accepted"); s.W = 8;
    s.fwd_path = (SdmFwdPath)4; CHECK(sdm_op_check(&s) != NULL, "unknown forward path accepted");
    s.fwd_path = SDM_FWD_AUTO;
    s.fwd_max_blocks = -1; CHECK(sdm_op_check(&s) != NULL, "fwd_max_blocks < 0 accepted"); s.fwd_max_blocks = 0;
    s.N = 1 << 16; s.T = 256; s.C = 256; s.W = s.R = 128;
    CHECK(sdm_op_check(&s) != NULL, "C*(W+R) over the shared-memory limit accepted");
    s.W = s.R = 8; s.snapshot = SDM_SNAP_BF16; s.bank_fp32 = 0;
    CHECK(sdm_op_check(&s) != NULL, "bf16 snapshots over a bf16 bank accepted");
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--digest")) { printf("%016llx\n", fixed_case_digest()); return 0; }
    if (argc > 1 && !strcmp(argv[1], "--wy-digest")) { print_wy_digests(); return 0; }
    test_refusals();
    test_phase1();
    test_against_oracle();
    test_grad_bf16();
    test_chunk_invariance_and_determinism(0);
    test_chunk_invariance_and_determinism(1);
    test_persistent_forward();
    test_snapshot_modes(1);
    test_snapshot_modes(0);
    test_snapshot_batch_independence();
    // decode at batch 1, 8, 32 (x 2 heads): reads of rows the same token writes (12 + 10 of 96 slots, 100 + 90 of
    // 256), and more entries than the decode kernel holds per warp (W, R > 64: rows loaded in turn, reads after the
    // writes); d = 40: a block's last lanes idle; the flagship's W = R = 64 and d = 1024 (every entry held, several
    // blocks a stream), on 256 slots so that reads of written rows are common
    for (int fp32 = 1; fp32 >= 0; fp32--) {
        test_decode(fp32, 1, 150, 96, 32, 12, 10);
        test_decode(fp32, 8, 60, 96, 32, 12, 10);
        test_decode(fp32, 32, 40, 256, 40, 100, 90);
        test_decode(fp32, 1, 24, 256, 1024, 64, 64);
        test_decode(fp32, 4, 12, 256, 1024, 64, 48);
    }
    test_fresh_process(argv[0]);
    return test_summary();
}
