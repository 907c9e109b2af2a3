// core/sampling.h: the next-token choice of the generator (docs/MODEL.md#generation, `sample_tokens`), on the host:
//   temperature = 0: greedy (the first maximal logit);
//   otherwise p = softmax(logits / temperature), then
//     top_p set (0 < top_p):  sort descending (ties: lower token first), zero every token whose preceding cumulative
//                             mass already exceeds top_p, i.e. keep the smallest prefix of mass > top_p;
//     else top_k set (k > 0): zero every probability below the k-th largest (tokens tied with it stay);
//   renormalise and draw one token from core/rng.h. top_p takes precedence over top_k.
// Everything is double precision and deterministic for a given RNG state.
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

// probs [V] = the distribution the sampler draws from (temperature > 0): softmax, the top-p or top-k cut, then
// renormalised; excluded tokens get exactly 0.
static inline void sample_distribution(const float *logits, int V, const SamplingParams *sp, double *probs) {
    double mx = logits[sample_argmax(logits, V)], sum = 0.0;
    for (int v = 0; v < V; v++) sum += probs[v] = exp(((double)logits[v] - mx) / sp->temperature);
    for (int v = 0; v < V; v++) probs[v] /= sum;
    if (sp->top_p > 0.0 || sp->top_k > 0) {
        SampleEntry *e = (SampleEntry *)sdm_malloc(sizeof(SampleEntry) * (size_t)V);
        for (int v = 0; v < V; v++) { e[v].p = probs[v]; e[v].token = v; }
        qsort(e, (size_t)V, sizeof *e, sample_entry_cmp);
        if (sp->top_p > 0.0) {
            double before = 0.0; // mass of the tokens ahead of e[i]
            for (int i = 0; i < V; i++) {
                if (before > sp->top_p) probs[e[i].token] = 0.0;
                before += e[i].p;
            }
        } else if (sp->top_k < V) {
            double kth = e[sp->top_k - 1].p;
            for (int v = 0; v < V; v++)
                if (probs[v] < kth) probs[v] = 0.0;
        }
        free(e);
        sum = 0.0;
        for (int v = 0; v < V; v++) sum += probs[v];
        for (int v = 0; v < V; v++) probs[v] /= sum;
    }
}

// The next token from logits [V]; probs [V] is scratch (it ends holding the distribution drawn from).
static inline int sample_token(const float *logits, int V, const SamplingParams *sp, Rng *rng, double *probs) {
    if (sp->temperature <= 0.0) return sample_argmax(logits, V);
    sample_distribution(logits, V, sp, probs);
    double u = rng_uniform(rng), acc = 0.0;
    int last = 0;
    for (int v = 0; v < V; v++) {
        if (probs[v] <= 0.0) continue;
        acc += probs[v];
        last = v;
        if (u < acc) return v;
    }
    return last; // u within rounding of 1
}

#endif
