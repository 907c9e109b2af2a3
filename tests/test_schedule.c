// tests/test_schedule.c: the host side of the optimiser (core/optim.h): the learning-rate schedules of
// docs/MODEL.md#optimizer checked by their defining properties, the clip scale, the AdamW coefficients and the AdamW
// oracle's first step.
#include "core/optim.h"
#include "tests/test.h"

static const double MIN_RATIO = 0.1;

static double f(LrScheduler k, long long step) { return lr_schedule(k, step, 100, 1100, MIN_RATIO); }

static void test_warmup(void) {
    const LrScheduler kinds[2] = {LR_COSINE, LR_LINEAR}; // both share the warmup
    for (int i = 0; i < 2; i++) {
        LrScheduler k = kinds[i];
        CHECK(f(k, 0) == 0.0, "the first update uses f(0) = 0 (got %g)", f(k, 0));
        CHECK(f(k, 50) == 0.5, "f(warmup / 2) = 0.5 (got %g)", f(k, 50));
        CHECK(fabs(f(k, 99) - 0.99) < 1e-15, "f(warmup - 1) = 0.99 (got %.17g)", f(k, 99));
        CHECK(f(k, 100) == 1.0, "f(warmup) = 1 (got %.17g)", f(k, 100));
    }
    CHECK(lr_schedule(LR_COSINE, 0, 0, 10, MIN_RATIO) == 1.0, "no warmup: f(0) = 1");
}

static void test_decay(LrScheduler k, const char *name) {
    double mid = f(k, 600); // s = 1/2: both schedules are halfway between 1 and r
    CHECK(fabs(mid - 0.5 * (1 + MIN_RATIO)) < 1e-12, "%s: f(s = 1/2) = %.17g, want (1 + r) / 2", name, mid);
    int monotone = 1;
    for (long long s = 100; s < 1100; s++) monotone &= f(k, s + 1) <= f(k, s);
    CHECK(monotone, "%s: non-increasing from warmup to n_steps", name);
    double last = f(k, 1099);
    CHECK(last > MIN_RATIO && last - MIN_RATIO < 1e-2, "%s: the last update is just above r (got %.17g)", name, last);
    CHECK(f(k, 1100) == MIN_RATIO && f(k, 5000) == MIN_RATIO, "%s: f = r from n_steps on", name);
}

static void test_cosine_shape(void) {
    // a quarter of the way: r + (1 - r)(1 + cos(pi/4)) / 2
    double want = MIN_RATIO + 0.5 * (1 - MIN_RATIO) * (1 + sqrt(0.5));
    CHECK(fabs(f(LR_COSINE, 350) - want) < 1e-12, "cosine at s = 1/4: %.17g, want %.17g", f(LR_COSINE, 350), want);
    double lin = 1 - 0.25 * (1 - MIN_RATIO);
    CHECK(fabs(f(LR_LINEAR, 350) - lin) < 1e-12, "linear at s = 1/4: %.17g, want %.17g", f(LR_LINEAR, 350), lin);
}

static void test_constant(void) {
    int ok = 1;
    for (long long s = 0; s < 2000; s += 7) ok &= f(LR_CONSTANT, s) == 1.0;
    CHECK(ok, "constant: f = 1 at every step (warmup ignored, as the reference)");
    CHECK(lr_scheduler_from_name("cosine") == LR_COSINE && lr_scheduler_from_name("linear") == LR_LINEAR &&
              lr_scheduler_from_name("constant") == LR_CONSTANT,
          "scheduler names");
}

static void test_clip_scale(void) {
    CHECK(clip_scale(5.0f, 0.0f) == 1.0f, "clip 0 turns clipping off");
    CHECK(clip_scale(0.5f, 1.0f) == 1.0f, "a norm below clip is not scaled");
    float s = clip_scale(4.0f, 1.0f);
    CHECK(fabs(s - 1.0 / (4.0 + 1e-6)) < 1e-7, "norm 4, clip 1: scale %.9g, want 1 / (4 + 1e-6)", s);
}

static void test_adamw_coeffs(void) {
    AdamWHyper h = {3e-4, 0.1, 0.9, 0.95, 1e-8, 1};
    AdamWCoeffs c = adamw_coeffs(&h, 1), nd = adamw_coeffs(&h, 0);
    CHECK(fabs(c.decay_mul - (1 - 3e-5)) < 1e-7, "decayed tensor: decay_mul = 1 - lr wd (got %.9g)", c.decay_mul);
    CHECK(nd.decay_mul == 1.0f, "tensor without decay: decay_mul = 1");
    CHECK(fabs(c.step_size / 3e-3 - 1) < 1e-6, "t = 1: step size lr / (1 - beta1) (got %.9g)", c.step_size);
    CHECK(fabs(c.rsqrt_bc2 * sqrt(0.05) - 1) < 1e-6, "t = 1: 1 / sqrt(1 - beta2) (got %.9g)", c.rsqrt_bc2);
    h.t = 100000;
    c = adamw_coeffs(&h, 1);
    CHECK(fabs(c.step_size / 3e-4 - 1) < 1e-6 && fabs(c.rsqrt_bc2 - 1) < 1e-6, "large t: no bias correction left");
}

// The first Adam step moves every weight by lr · sign(g) (m̂ = g, v̂ = g²), after the decay p ← (1 − lr wd) p.
static void test_adamw_oracle_first_step(void) {
    AdamWHyper h = {1e-2, 0.1, 0.9, 0.95, 1e-8, 1};
    double p[4] = {0.5, -2.0, 0.0, 1.0}, m[4] = {0}, v[4] = {0}, g[4] = {3.0, -0.25, 1e-3, -7.0}, want[4];
    for (int i = 0; i < 4; i++) want[i] = p[i] * (1 - h.lr * h.weight_decay) - h.lr * (g[i] > 0 ? 1 : -1);
    ref_adamw_step(p, m, v, g, 4, &h, 1);
    check_close("AdamW oracle first step = decay then lr * sign(g)", p, want, 4, 1e-5);
}

int main(void) {
    test_warmup();
    test_decay(LR_COSINE, "cosine");
    test_decay(LR_LINEAR, "linear");
    test_cosine_shape();
    test_constant();
    test_clip_scale();
    test_adamw_coeffs();
    test_adamw_oracle_first_step();
    return test_summary();
}
