// tests/test_sdm_chunked.c: the chunked WY form (sdm_chunked_ref.h) against the per-token oracle (sdm_ref.h):
// forward readings, final bank and every gradient, for chunk lengths 1..256, T not a multiple of C, B*H > 1,
// slots shared inside chunks, reads of same-token writes, a non-zero final-bank gradient, and gates at extremes.
#include "sdm/sdm_chunked_ref.h"
#include "tests/test.h"
#include "tests/sdm_op_case.h"

// Both forms are exact algebra on docs/SDM.md#the-recurrence in double; only rounding differs (observed ~1e-15).
#define CHUNKED_TOL 1e-10

typedef struct { double *dkappa, *dgamma, *dbeta, *dv, *drho, *dbank; } OpGrads;

static OpGrads op_grads_alloc(const OpCase *c) {
    OpGrads g;
    g.dkappa = (double *)sdm_malloc(sizeof(double) * op_n(c, c->W));
    g.dgamma = (double *)sdm_malloc(sizeof(double) * op_n(c, c->W));
    g.dbeta = (double *)sdm_malloc(sizeof(double) * op_n(c, 1));
    g.dv = (double *)sdm_malloc(sizeof(double) * op_n(c, c->d));
    g.drho = (double *)sdm_malloc(sizeof(double) * op_n(c, c->R));
    g.dbank = (double *)sdm_malloc(sizeof(double) * op_nbank(c));
    return g;
}

static void op_grads_free(OpGrads *g) {
    free(g->dkappa); free(g->dgamma); free(g->dbeta); free(g->dv); free(g->drho); free(g->dbank);
}

// The oracle's and the chunked form's outputs and gradients for one case and chunk length, compared.
static void compare_chunked(const char *name, OpCase *c, int C) {
    int B = c->B, T = c->T, H = c->H, N = c->N, d = c->d, W = c->W, R = c->R;
    double *bank = (double *)sdm_malloc(sizeof(double) * op_nbank(c));
    double *out = (double *)sdm_malloc(sizeof(double) * op_n(c, d));
    op_case_forward(c); // oracle into c->out, c->bank
    memcpy(bank, c->bank0, sizeof(double) * op_nbank(c));
    sdm_op_forward_chunked_ref(B, T, H, N, d, W, R, C, c->wslot, c->kappa, c->gamma, c->beta, c->v, c->rslot, c->rho,
                               bank, out);
    OpGrads ref = op_grads_alloc(c), got = op_grads_alloc(c);
    sdm_op_backward_ref(B, T, H, N, d, W, R, c->wslot, c->kappa, c->gamma, c->beta, c->v, c->rslot, c->rho, c->bank0,
                        c->dout, c->dbank, ref.dkappa, ref.dgamma, ref.dbeta, ref.dv, ref.drho, ref.dbank);
    sdm_op_backward_chunked_ref(B, T, H, N, d, W, R, C, c->wslot, c->kappa, c->gamma, c->beta, c->v, c->rslot,
                                c->rho, c->bank0, c->dout, c->dbank, got.dkappa, got.dgamma, got.dbeta, got.dv,
                                got.drho, got.dbank);
    int shared, own;
    count_collisions(B, T, H, W, R, C, c->wslot, c->rslot, &shared, &own);
    printf("%s C=%d: %d slot shares inside chunks, %d reads of own writes, readings err %.1e\n", name, C, shared, own,
           rel_error(out, c->out, op_n(c, d)));
    CHECK(C == 1 || shared > 0, "%s C=%d: no slot shared inside a chunk", name, C);
    char what[128];
#define CMP(label, a, b, n)                                            \
    snprintf(what, sizeof what, "%s C=%d: %s", name, C, label);        \
    check_close(what, a, b, n, CHUNKED_TOL)
    CMP("readings", out, c->out, op_n(c, d));
    CMP("final bank", bank, c->bank, op_nbank(c));
    CMP("dkappa", got.dkappa, ref.dkappa, op_n(c, W));
    CMP("dgamma", got.dgamma, ref.dgamma, op_n(c, W));
    CMP("dbeta", got.dbeta, ref.dbeta, op_n(c, 1));
    CMP("dv", got.dv, ref.dv, op_n(c, d));
    CMP("drho", got.drho, ref.drho, op_n(c, R));
    CMP("dbank_init", got.dbank, ref.dbank, op_nbank(c));
#undef CMP
    op_grads_free(&ref);
    op_grads_free(&got);
    free(bank);
    free(out);
}

int main(void) {
    static const int chunks[] = {1, 2, 3, 16, 64, 256};
    Rng rng = rng_make(7);
    OpCase small = op_case_make(&rng, 2, 37, 2, 7, 3, 3, 2, -1.0); // tiny bank: many shares per chunk
    for (int i = 0; i < 6; i++) compare_chunked("B2 H2 T37 N7 W3 R2", &small, chunks[i]);
    op_case_free(&small);

    OpCase longer = op_case_make(&rng, 1, 300, 2, 40, 4, 4, 4, -0.5); // several chunks of 64 and 256, ragged end
    for (int i = 3; i < 6; i++) compare_chunked("B1 H2 T300 N40 W4 R4", &longer, chunks[i]);
    op_case_free(&longer);

    OpCase even = op_case_make(&rng, 3, 32, 1, 6, 2, 2, 3, -2.0); // T a multiple of C
    compare_chunked("B3 H1 T32 N6 W2 R3", &even, 16);
    op_case_free(&even);

    OpCase flat = op_case_make(&rng, 2, 29, 2, 6, 3, 2, 2, 0.0); // no decay: alpha = 1
    compare_chunked("no decay", &flat, 8);
    op_case_free(&flat);

    OpCase wipe = op_case_make(&rng, 2, 29, 2, 6, 3, 2, 2, -1.0); // full wipe: alpha = 0 at every write
    for (size_t i = 0; i < op_n(&wipe, wipe.W); i++) wipe.gamma[i] = -1e4;
    compare_chunked("full wipe", &wipe, 8);
    op_case_free(&wipe);
    return test_summary();
}
