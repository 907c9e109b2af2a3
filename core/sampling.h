// core/sampling.h: the next-token choice of the generator (docs/MODEL.md#generation, `sample_tokens`), on the host:
//   temperature = 0: greedy (the first maximal logit);
//   otherwise p = softmax(logits / temperature), then
//     top_p set (0 < top_p):  sort descending (ties: lower token first), zero every token whose preceding cumulative
//                             mass already exceeds top_p, i.e. keep the smallest prefix of mass > top_p;
//     else top_k set (k > 0): zero every probability below the k-th largest (tokens tied with it stay);
//   renormalise and draw one token from core/rng.h (the first kept token whose cumulative mass exceeds the uniform).
//   top_p takes precedence over top_k.
// Everything is double precision and deterministic for a given RNG state; the sums go in a fixed order that a warp
// takes in parallel (sample_sum, sample_round_scan).
#ifndef SDM_CORE_SAMPLING_H
#define SDM_CORE_SAMPLING_H

#include <math.h>
#include <stdlib.h>

#include "core/common.h"
#include "core/rng.h"

typedef struct {
    double temperature; // 0: greedy
    double top_p;       // <= 0: unset
    int top_k;          // <= 0: unset
} SamplingParams;

typedef struct { double p; int token; } SampleEntry;

// Descending probability, then ascending token: a total order, so the sort is deterministic.
static inline int sample_entry_cmp(const void *a, const void *b) {
    const SampleEntry *x = (const SampleEntry *)a, *y = (const SampleEntry *)b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return x->token - y->token;
}

static inline int sample_argmax(const float *logits, int V) {
    int best = 0;
    for (int v = 1; v < V; v++)
        if (logits[v] > logits[best]) best = v;
    return best;
}

// The sampler's sums, in an order that a warp takes in parallel and core/sampling.cuh takes exactly so (a sum's
// rounding depends on its order, and the device must draw the host's tokens):
//   sample_sum         32 interleaved partial sums (element v into sum v % 32, in index order), then halved pairwise:
//                      s[l] += s[l + o] for o = 16, 8, 4, 2, 1 (a warp's butterfly);
//   sample_round_scan  32 elements' inclusive prefix sums by doubling: x[l] += x[l - o] for o = 1, 2, 4, 8, 16, each
//                      step on the values before it (a warp's shuffle-up scan); longer arrays go by rounds of 32,
//                      each round's sums after the carry of the rounds before (carry + x[l], then carry += x[31]).
#define SAMPLE_LANES 32
static inline double sample_sum(const double *p, int V) {
    double s[SAMPLE_LANES] = {0.0};
    for (int v = 0; v < V; v++) s[v % SAMPLE_LANES] += p[v];
    for (int o = SAMPLE_LANES / 2; o > 0; o /= 2)
        for (int l = 0; l < o; l++) s[l] += s[l + o];
    return s[0];
}
static inline void sample_round_scan(double *x) {
    for (int o = 1; o < SAMPLE_LANES; o *= 2)
        for (int l = SAMPLE_LANES - 1; l >= o; l--) x[l] += x[l - o];
}

// probs [V] = the distribution the sampler draws from (temperature > 0): softmax, the top-p or top-k cut, then
// renormalised; excluded tokens get exactly 0.
static inline void sample_distribution(const float *logits, int V, const SamplingParams *sp, double *probs) {
    double mx = logits[sample_argmax(logits, V)], sum;
    for (int v = 0; v < V; v++) probs[v] = exp(((double)logits[v] - mx) / sp->temperature);
    sum = sample_sum(probs, V);
    for (int v = 0; v < V; v++) probs[v] /= sum;
    if (sp->top_p > 0.0 || sp->top_k > 0) {
        SampleEntry *e = (SampleEntry *)sdm_malloc(sizeof(SampleEntry) * (size_t)V);
        for (int v = 0; v < V; v++) { e[v].p = probs[v]; e[v].token = v; }
        qsort(e, (size_t)V, sizeof *e, sample_entry_cmp);
        if (sp->top_p > 0.0) {
            double carry = 0.0; // mass of the rounds before
            for (int i0 = 0; i0 < V; i0 += SAMPLE_LANES) {
                double x[SAMPLE_LANES];
                for (int l = 0; l < SAMPLE_LANES; l++) x[l] = i0 + l < V ? e[i0 + l].p : 0.0;
                sample_round_scan(x);
                for (int l = 0; l < SAMPLE_LANES && i0 + l < V; l++) {
                    double before = l ? carry + x[l - 1] : carry; // mass of the tokens ahead of e[i0 + l]
                    if (before > sp->top_p) probs[e[i0 + l].token] = 0.0;
                }
                carry += x[SAMPLE_LANES - 1];
            }
        } else if (sp->top_k < V) {
            double kth = e[sp->top_k - 1].p;
            for (int v = 0; v < V; v++)
                if (probs[v] < kth) probs[v] = 0.0;
        }
        free(e);
        sum = sample_sum(probs, V);
        for (int v = 0; v < V; v++) probs[v] /= sum;
    }
}

// The next token from logits [V]; probs [V] is scratch (it ends holding the distribution drawn from).
static inline int sample_token(const float *logits, int V, const SamplingParams *sp, Rng *rng, double *probs) {
    if (sp->temperature <= 0.0) return sample_argmax(logits, V);
    sample_distribution(logits, V, sp, probs);
    double u = rng_uniform(rng), carry = 0.0; // the cumulative mass, by rounds (sample_round_scan)
    int last = 0;
    for (int v0 = 0; v0 < V; v0 += SAMPLE_LANES) {
        double x[SAMPLE_LANES];
        for (int l = 0; l < SAMPLE_LANES; l++) x[l] = v0 + l < V ? probs[v0 + l] : 0.0;
        sample_round_scan(x);
        for (int l = 0; l < SAMPLE_LANES && v0 + l < V; l++) {
            if (probs[v0 + l] <= 0.0) continue; // excluded: never drawn, whatever the rounding of the sums
            last = v0 + l;
            if (u < carry + x[l]) return last;
        }
        carry += x[SAMPLE_LANES - 1];
    }
    return last; // u within rounding of 1
}

#endif
