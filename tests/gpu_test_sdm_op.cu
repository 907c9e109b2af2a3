// tests/gpu_test_sdm_op.cu: the GPU SDM memory op (sdm/sdm_op.cuh) against the double-precision CPU oracle
// (sdm/sdm_ref.h): forward and every gradient on fresh random inputs, chunk-size invariance, the persistent forward =
// the per-chunk launches (bitwise), decode = prefill = training forward, bitwise determinism, snapshot modes and their
// independence of the batch, refusals.
// Tolerances (relative L2 error against the oracle): all-fp32 mode 1e-5, bf16 bank 1e-2. The same hold with heavily
// repeated slots (chains of C entries): every per-entry sum then has up to 2C fp32 terms, a relative rounding of about
// sqrt(2C) 2^-24 <= 2e-6 at C = 256, and softmax weights keep |A| <= 1 so the solve does not amplify it.
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

// The forward of shape s on the GPU, then with s->training the backward (a prefill leaves the gradients NULL).
// rounded_bank: the initial bank in the bank dtype.
static Result run_gpu_shape(const Case *c, const SdmOpShape *s, double *rounded_bank) {
    Dev D = dev_alloc(c, s);
    size_t tok = (size_t)c->B * c->T * c->H;
    upload_bank(c, s->bank_fp32, D.bank, rounded_bank);
    poison(D.out, tok * c->d * 4);
    poison(D.saved, sdm_op_saved_bytes(s));
    poison(D.scratch, sdm_op_scratch_bytes(s));
    poison(D.g.dkappa, tok * c->W * 4); poison(D.g.dgamma, tok * c->W * 4); poison(D.g.drho, tok * c->R * 4);
    poison(D.g.dbeta, tok * 4); poison(D.g.dv, tok * c->d * 4); poison(D.g.dbank_init, bank_elems(c) * 4);
    sdm_op_forward(s, &D.in, D.bank, D.out, D.saved, 0);
    Result r;
    memset(&r, 0, sizeof(r));
    r.bank_final = bank_to_host(c, s->bank_fp32, D.bank);
    r.out = to_host(D.out, tok * c->d);
    if (s->training) {
        sdm_op_backward(s, &D.in, D.bank, D.dout, D.dbank_final, &D.g, D.saved, D.scratch, 0);
        cudaCheck(cudaDeviceSynchronize());
        r.dkappa = to_host(D.g.dkappa, tok * c->W); r.dgamma = to_host(D.g.dgamma, tok * c->W);
        r.drho = to_host(D.g.drho, tok * c->R); r.dbeta = to_host(D.g.dbeta, tok); r.dv = to_host(D.g.dv, tok * c->d);
        r.dbank_init = to_host(D.g.dbank_init, bank_elems(c));
    }
    dev_free(&D);
    return r;
}

// Forward (training) then backward on the GPU, the forward's path chosen by the op.
static Result run_gpu(const Case *c, int C, int fp32, SdmSnapshot snap, double *rounded_bank) {
    SdmOpShape s = shape_of(c, C, fp32, snap, 1);
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

// ---- test groups ----------------------------------------------------------------------------------------------

typedef struct {
    int B, T, H, N, d, W, R, C;
    GammaMode gm;
    int collide; // 1: the case must have in-chunk slot collisions
    int hot;     // heavily repeated slots, run in every mode; 2: every token repeats its first slot sets
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
    };
    int n = (int)(sizeof(specs) / sizeof(specs[0]));
    for (int fp32 = 1; fp32 >= 0; fp32--)
        for (int i = 0; i < n; i++) {
            const Spec *p = &specs[i];
            if (!fp32 && i > 3 && !p->hot) continue; // bf16 bank: the first four shapes and the hot ones
            Case c = make_case(1000 + i, p->B, p->T, p->H, p->N, p->d, p->W, p->R, p->gm, i % 2);
            if (p->hot == 2) repeat_first_slots(&c);
            if (p->collide)
                CHECK(count_collisions(&c, SDM_MIN(p->C, p->T)) > 0, "case %d has no in-chunk collisions", i);
            double *rb = (double *)sdm_malloc(bank_elems(&c) * sizeof(double));
            Result g = run_gpu(&c, p->C, fp32, SDM_SNAP_NONE, rb);
            Result ref = run_ref(&c, rb);
            char name[128];
            snprintf(name, sizeof(name), "%s B%d T%d H%d N%d d%d W%d R%d C%d g%d%s", fp32 ? "fp32" : "bf16", p->B,
                     p->T, p->H, p->N, p->d, p->W, p->R, p->C, (int)p->gm, p->hot == 2 ? " same-slots" : "");
            compare(name, &c, &g, &ref, fp32 ? TOL_FP32 : TOL_BF16);
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
    printf("  chunk invariance / determinism checked\n");
    free_result(&base); free_result(&ref); free_result(&again); free(rb); free_case(&c);
}

// Shape s with the forward's chunk loop as three launches per chunk, then persistent on all the blocks that fit and on
// 3 blocks (each walks many virtual blocks of every phase): the persistent runs must give the launches' bits, in
// training every output and gradient (the backward reads what the forward saved), in a prefill readings and bank.
// Returns the persistent run on all blocks.
static Result run_persistent_vs_launches(const Case *c, SdmOpShape s, double *rounded_bank, const char *name) {
    s.fwd_path = SDM_FWD_LAUNCHES;
    Result base = run_gpu_shape(c, &s, rounded_bank);
    s.fwd_path = SDM_FWD_PERSISTENT;
    Result all = run_gpu_shape(c, &s, rounded_bank);
    s.fwd_max_blocks = 3;
    Result few = run_gpu_shape(c, &s, rounded_bank);
    int same_all = s.training ? bitwise_equal(c, &all, &base) : forward_equal(c, &all, &base);
    int same_few = s.training ? bitwise_equal(c, &few, &base) : forward_equal(c, &few, &base);
    CHECK(same_all, "%s: the persistent forward differs from the launches", name);
    CHECK(same_few, "%s: the persistent forward on 3 blocks differs from the launches", name);
    printf("  %-58s persistent = launches: %s\n", name, same_all && same_few ? "same bits" : "DIFFERENT");
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
// of rows the chunk writes take the dequantised snapshot rounded to bf16, as the restore stores it.
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

static void test_refusals(void) {
    SdmOpShape s;
    memset(&s, 0, sizeof(s));
    s.B = 1; s.T = 64; s.H = 1; s.N = 256; s.d = 64; s.W = 8; s.R = 8; s.C = 64;
    CHECK(sdm_op_check(&s) == NULL, "valid shape refused: %s", sdm_op_check(&s));
    s.d = 12; CHECK(sdm_op_check(&s) != NULL, "d = 12 accepted"); s.d = 64;
    s.C = 300; CHECK(sdm_op_check(&s) != NULL, "C = 300 accepted"); s.C = 64;
    s.W = 300; CHECK(sdm_op_check(&s) != NULL, "W > N accepted"); s.W = 8;
    s.fwd_path = (SdmFwdPath)3; CHECK(sdm_op_check(&s) != NULL, "unknown forward path accepted");
    s.fwd_path = SDM_FWD_AUTO;
    s.fwd_max_blocks = -1; CHECK(sdm_op_check(&s) != NULL, "fwd_max_blocks < 0 accepted"); s.fwd_max_blocks = 0;
    s.N = 1 << 16; s.T = 256; s.C = 256; s.W = s.R = 128;
    CHECK(sdm_op_check(&s) != NULL, "C*(W+R) over the shared-memory limit accepted");
    s.W = s.R = 8; s.snapshot = SDM_SNAP_BF16; s.bank_fp32 = 0;
    CHECK(sdm_op_check(&s) != NULL, "bf16 snapshots over a bf16 bank accepted");
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--digest")) { printf("%016llx\n", fixed_case_digest()); return 0; }
    test_refusals();
    test_against_oracle();
    test_chunk_invariance_and_determinism(0);
    test_chunk_invariance_and_determinism(1);
    test_persistent_forward();
    test_snapshot_modes(1);
    test_snapshot_modes(0);
    test_snapshot_batch_independence();
    // decode at batch 1, 8, 32 (x 2 heads): reads of rows the same token writes (12 + 10 of 96 slots, 100 + 90 of
    // 256), and more entries than the decode kernel holds per warp (W, R > 64: rows loaded in turn, reads after the
    // writes); d = 40: a block's last lanes idle
    for (int fp32 = 1; fp32 >= 0; fp32--) {
        test_decode(fp32, 1, 150, 96, 32, 12, 10);
        test_decode(fp32, 8, 60, 96, 32, 12, 10);
        test_decode(fp32, 32, 40, 256, 40, 100, 90);
    }
    test_fresh_process(argv[0]);
    return test_summary();
}
