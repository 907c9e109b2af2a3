// core/optim.h: the host side of the optimiser (docs/MODEL.md#optimizer): the learning-rate schedule, the AdamW
// coefficients of one step, the gradient-clipping scale, and a double-precision AdamW step that is the oracle of the
// GPU kernel. Plain C (also compiled by nvcc); clip_scale is shared with the device code so both use one formula.
#ifndef SDM_CORE_OPTIM_H
#define SDM_CORE_OPTIM_H

#include <math.h>
#include <string.h>

#include "core/common.h"
#include "core/config.h"

typedef enum { LR_COSINE = 0, LR_CONSTANT, LR_LINEAR } LrScheduler;

static inline LrScheduler lr_scheduler_from_name(const char *name) {
    if (!strcmp(name, "cosine")) return LR_COSINE;
    if (!strcmp(name, "constant")) return LR_CONSTANT;
    if (!strcmp(name, "linear")) return LR_LINEAR;
    sdm_die("unknown learning-rate scheduler '%s' (cosine, constant or linear)", name);
    return LR_COSINE;
}

// f(step), the factor of the peak lr for the update that follows `step` completed updates (the first update uses
// f(0)). As the reference: warmup f = step / warmup for step < warmup; then over
// s = (step − warmup) / (n_steps − warmup) in [0, 1): cosine f = r + ½(1 − r)(1 + cos πs),
// linear f = 1 − s(1 − r); f = r from n_steps on (the reference's jump back to 1 at exactly step = n_steps, never
// reached by a run of n_steps updates, is not reproduced). "constant" is f = 1 at every step, warmup included, as in
// the reference.
static inline double lr_schedule(LrScheduler kind, long long step, long long warmup, long long n_steps,
                                 double min_ratio) {
    if (kind == LR_CONSTANT) return 1.0;
    if (step < warmup) return (double)step / (double)warmup;
    if (step >= n_steps) return min_ratio;
    double s = (double)(step - warmup) / (double)(n_steps - warmup);
    if (kind == LR_LINEAR) return 1.0 - s * (1.0 - min_ratio);
    return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + cos(3.14159265358979323846 * s));
}

// Gradient clipping as torch.nn.utils.clip_grad_norm_: gradients are multiplied by min(1, clip / (norm + 1e-6));
// clip <= 0 turns clipping off.
static inline SDM_HOST_DEVICE float clip_scale(float norm, float clip) {
    if (clip <= 0.0f) return 1.0f;
    float c = clip / (norm + 1e-6f);
    return c < 1.0f ? c : 1.0f;
}

// The hyper-parameters of one AdamW update: the scheduled lr (peak lr times lr_schedule), and t, the 1-based number
// of this update (bias corrections).
typedef struct {
    double lr, weight_decay, beta1, beta2, eps;
    long long t;
} AdamWHyper;

// The hyper-parameters of the update after `step` completed updates, from the config's optim.* keys: the one place
// the learning-rate schedule is evaluated.
static inline AdamWHyper adamw_hyper(const Config *c, long long step) {
    AdamWHyper h = {c->lr * lr_schedule(lr_scheduler_from_name(c->scheduler), step, c->warmup, c->steps,
                                        c->lr_min_ratio),
                    c->weight_decay, c->beta1, c->beta2, c->adam_eps, step + 1};
    return h;
}

// The per-step constants of the AdamW update of one tensor (decoupled weight decay, docs/MODEL.md#optimizer):
//   p ← p · decay_mul;  m ← β1 m + (1 − β1) g;  v ← β2 v + (1 − β2) g²;
//   p ← p − step_size · m / (sqrt(v) · rsqrt_bc2 + eps)
// with decay_mul = 1 − lr·wd (wd = 0 when the tensor is not decayed), step_size = lr / (1 − β1^t),
// rsqrt_bc2 = 1 / sqrt(1 − β2^t). These are PyTorch's AdamW formulas.
typedef struct {
    float beta1, beta2, eps, decay_mul, step_size, rsqrt_bc2;
} AdamWCoeffs;

static inline AdamWCoeffs adamw_coeffs(const AdamWHyper *h, int decay) {
    AdamWCoeffs c;
    c.beta1 = (float)h->beta1;
    c.beta2 = (float)h->beta2;
    c.eps = (float)h->eps;
    c.decay_mul = (float)(1.0 - (decay ? h->lr * h->weight_decay : 0.0));
    c.step_size = (float)(h->lr / (1.0 - pow(h->beta1, (double)h->t)));
    c.rsqrt_bc2 = (float)(1.0 / sqrt(1.0 - pow(h->beta2, (double)h->t)));
    return c;
}

// The AdamW update of one element with these coefficients (g already scaled): the formula of the GPU kernel
// (model/adamw.cuh), also run on the CPU by tests/test_zero1.c.
static inline SDM_HOST_DEVICE void adamw_element(float *p, float *m, float *v, float g, AdamWCoeffs c) {
    *m = c.beta1 * *m + (1.0f - c.beta1) * g;
    *v = c.beta2 * *v + (1.0f - c.beta2) * g * g;
    *p = *p * c.decay_mul - c.step_size * *m / (sqrtf(*v) * c.rsqrt_bc2 + c.eps);
}

// The oracle: one AdamW update of n elements in double, written from docs/MODEL.md#optimizer (gradient g already
// scaled).
static inline void ref_adamw_step(double *p, double *m, double *v, const double *g, size_t n, const AdamWHyper *h,
                                  int decay) {
    double bc1 = 1.0 - pow(h->beta1, (double)h->t), bc2 = 1.0 - pow(h->beta2, (double)h->t);
    double wd = decay ? h->weight_decay : 0.0;
    for (size_t i = 0; i < n; i++) {
        p[i] -= h->lr * wd * p[i];
        m[i] = h->beta1 * m[i] + (1.0 - h->beta1) * g[i];
        v[i] = h->beta2 * v[i] + (1.0 - h->beta2) * g[i] * g[i];
        double mhat = m[i] / bc1, vhat = v[i] / bc2;
        p[i] -= h->lr * mhat / (sqrt(vhat) + h->eps);
    }
}

#endif
