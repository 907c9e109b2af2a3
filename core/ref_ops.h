// core/ref_ops.h: double-precision CPU reference of the dense building blocks (docs/MODEL.md): affine maps, RMSNorm,
// SwiGLU FFN, softmax cross-entropy. Written for clarity: they define what the GPU kernels must compute.
// Convention: forward functions overwrite their outputs; backward functions ACCUMULATE (+=) into every gradient.
#ifndef SDM_CORE_REF_OPS_H
#define SDM_CORE_REF_OPS_H

#include <math.h>

#include "core/common.h"

static inline double ref_dot(const double *a, const double *b, int n) {
    double s = 0.0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

// 1 / (1 + e^-x) without overflow for large |x|
static inline double ref_sigmoid(double x) {
    if (x >= 0.0) return 1.0 / (1.0 + exp(-x));
    double e = exp(x);
    return e / (1.0 + e);
}

// log(1 + e^x) without overflow
static inline double ref_softplus(double x) { return x > 0.0 ? x + log1p(exp(-x)) : log1p(exp(x)); }

// y[n, out] = x[n, in] . w[out, in]^T + b[out] (b may be NULL)
static inline void ref_linear_forward(const double *x, const double *w, const double *b, double *y, int n, int in,
                                      int out) {
    for (int i = 0; i < n; i++)
        for (int o = 0; o < out; o++) {
            double s = b ? b[o] : 0.0;
            y[(size_t)i * out + o] = s + ref_dot(x + (size_t)i * in, w + (size_t)o * in, in);
        }
}

// dx[n, in] += dy . w;  dw[out, in] += dy^T . x;  db[out] += sum_n dy. Any gradient pointer may be NULL.
static inline void ref_linear_backward(const double *x, const double *w, const double *dy, double *dx, double *dw,
                                       double *db, int n, int in, int out) {
    for (int i = 0; i < n; i++)
        for (int o = 0; o < out; o++) {
            double g = dy[(size_t)i * out + o];
            if (db) db[o] += g;
            for (int k = 0; k < in; k++) {
                if (dx) dx[(size_t)i * in + k] += g * w[(size_t)o * in + k];
                if (dw) dw[(size_t)o * in + k] += g * x[(size_t)i * in + k];
            }
        }
}

// y = x / sqrt(mean(x^2) + eps) * w, per row of width D
static inline void ref_rmsnorm_forward(const double *x, const double *w, double *y, int n, int D, double eps) {
    for (int i = 0; i < n; i++) {
        const double *xi = x + (size_t)i * D;
        double ms = 0;
        for (int k = 0; k < D; k++) ms += xi[k] * xi[k];
        double r = 1.0 / sqrt(ms / D + eps);
        for (int k = 0; k < D; k++) y[(size_t)i * D + k] = xi[k] * r * w[k];
    }
}

static inline void ref_rmsnorm_backward(const double *x, const double *w, const double *dy, double *dx, double *dw,
                                        int n, int D, double eps) {
    for (int i = 0; i < n; i++) {
        const double *xi = x + (size_t)i * D, *gi = dy + (size_t)i * D;
        double ms = 0, dot = 0;
        for (int k = 0; k < D; k++) {
            ms += xi[k] * xi[k];
            dot += gi[k] * w[k] * xi[k];
        }
        double r = 1.0 / sqrt(ms / D + eps);
        for (int k = 0; k < D; k++) {
            dw[k] += gi[k] * xi[k] * r;
            dx[(size_t)i * D + k] += r * gi[k] * w[k] - r * r * r * xi[k] * dot / D;
        }
    }
}

// FFN(x) = w2 . (silu(w1 . x) * (w3 . x)); w1, w3 [F, D], w2 [D, F]
static inline void ref_swiglu_forward(const double *x, const double *w1, const double *w3, const double *w2, double *y,
                                      int n, int D, int F) {
    double *a = (double *)sdm_malloc(sizeof(double) * n * F), *b = (double *)sdm_malloc(sizeof(double) * n * F);
    ref_linear_forward(x, w1, NULL, a, n, D, F);
    ref_linear_forward(x, w3, NULL, b, n, D, F);
    for (size_t i = 0; i < (size_t)n * F; i++) a[i] = a[i] * ref_sigmoid(a[i]) * b[i];
    ref_linear_forward(a, w2, NULL, y, n, F, D);
    free(a);
    free(b);
}

static inline void ref_swiglu_backward(const double *x, const double *w1, const double *w3, const double *w2,
                                       const double *dy, double *dx, double *dw1, double *dw3, double *dw2, int n,
                                       int D, int F) {
    size_t nf = (size_t)n * F;
    double *a = (double *)sdm_malloc(sizeof(double) * nf), *b = (double *)sdm_malloc(sizeof(double) * nf);
    double *h = (double *)sdm_malloc(sizeof(double) * nf), *dh = (double *)sdm_calloc(nf, sizeof(double));
    ref_linear_forward(x, w1, NULL, a, n, D, F);
    ref_linear_forward(x, w3, NULL, b, n, D, F);
    for (size_t i = 0; i < nf; i++) h[i] = a[i] * ref_sigmoid(a[i]) * b[i];
    ref_linear_backward(h, w2, dy, dh, dw2, NULL, n, F, D);
    for (size_t i = 0; i < nf; i++) { // overwrite a with d(w1 x) and b with d(w3 x)
        double s = ref_sigmoid(a[i]), silu = a[i] * s;
        double da = dh[i] * b[i] * (s + a[i] * s * (1 - s));
        b[i] = dh[i] * silu;
        a[i] = da;
    }
    ref_linear_backward(x, w1, a, dx, dw1, NULL, n, D, F);
    ref_linear_backward(x, w3, b, dx, dw3, NULL, n, D, F);
    free(a);
    free(b);
    free(h);
    free(dh);
}

// Mean over n rows of -log softmax(logits)[target]; dlogits (may be NULL) gets d(mean loss)/d(logits) (+=).
static inline double ref_cross_entropy(const double *logits, const int *targets, double *dlogits, int n, int V) {
    double total = 0;
    for (int i = 0; i < n; i++) {
        const double *z = logits + (size_t)i * V;
        double mx = z[0];
        for (int v = 1; v < V; v++) mx = fmax(mx, z[v]);
        double s = 0;
        for (int v = 0; v < V; v++) s += exp(z[v] - mx);
        double lse = mx + log(s);
        total += lse - z[targets[i]];
        if (dlogits)
            for (int v = 0; v < V; v++)
                dlogits[(size_t)i * V + v] += (exp(z[v] - lse) - (v == targets[i])) / n;
    }
    return total / n;
}

#endif
