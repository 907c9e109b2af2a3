// tests/test_sampling.c: the generator's sampler (core/sampling.h): greedy is the argmax, top-k keeps exactly k
// tokens (distinct logits), top-p keeps the smallest descending prefix of mass > p, precedence of top-p, the
// empirical frequencies of many draws match the renormalised distribution (chi-square), and draws are a function
// of the seed.
#include "core/sampling.h"
#include "tests/test.h"

#define V 12
#define DRAWS 200000
// Chi-square acceptance: the 1e-6 upper quantile for <= 11 degrees of freedom is below 45, so a correct sampler
// fails with probability < 1e-6 while a sampler off by 2% on a token of mass 0.1 (+~80 at 200k draws) fails.
#define CHI2_MAX 45.0

static void random_logits(float *logits, Rng *r) {
    for (int v = 0; v < V; v++) logits[v] = (float)(2.0 * rng_normal(r));
}

static int count_kept(const double *probs) {
    int n = 0;
    for (int v = 0; v < V; v++) n += probs[v] > 0.0;
    return n;
}

static void test_greedy(void) {
    Rng r = rng_make(1);
    SamplingParams sp = {0.0, 0.9, 3};
    double probs[V];
    for (int trial = 0; trial < 100; trial++) {
        float logits[V];
        random_logits(logits, &r);
        int best = 0;
        for (int v = 0; v < V; v++)
            if (logits[v] > logits[best]) best = v;
        CHECK(sample_token(logits, V, &sp, &r, probs) == best, "greedy trial %d is not the argmax %d", trial, best);
    }
    float tied[V] = {0};
    tied[3] = tied[7] = 1.0f;
    CHECK(sample_token(tied, V, &sp, &r, probs) == 3, "greedy tie: the first maximum wins");
}

// Softmax of logits / T in double, the reference the cut distributions are checked against.
static void softmax_ref(const float *logits, double T, double *p) {
    double mx = logits[0], sum = 0.0;
    for (int v = 1; v < V; v++) mx = fmax(mx, logits[v]);
    for (int v = 0; v < V; v++) sum += p[v] = exp((logits[v] - mx) / T);
    for (int v = 0; v < V; v++) p[v] /= sum;
}

static void test_top_k(void) {
    Rng r = rng_make(2);
    double probs[V], ref[V];
    for (int k = 1; k <= V; k++) {
        float logits[V];
        random_logits(logits, &r);
        SamplingParams sp = {0.7, 0.0, k};
        sample_distribution(logits, V, &sp, probs);
        softmax_ref(logits, 0.7, ref);
        CHECK(count_kept(probs) == k, "top-k %d keeps %d tokens", k, count_kept(probs));
        // kept = the k largest; kept ones proportional to the full softmax
        double kept_mass = 0.0;
        for (int v = 0; v < V; v++) kept_mass += probs[v] > 0 ? ref[v] : 0.0;
        for (int v = 0; v < V; v++) {
            int larger = 0;
            for (int u = 0; u < V; u++) larger += logits[u] > logits[v];
            CHECK((probs[v] > 0) == (larger < k), "top-k %d: token %d (rank %d) kept=%d", k, v, larger, probs[v] > 0);
            if (probs[v] > 0)
                CHECK(fabs(probs[v] - ref[v] / kept_mass) <= 1e-12, "top-k %d: token %d not renormalised", k, v);
        }
    }
}

static void test_top_p(void) {
    Rng r = rng_make(3);
    double probs[V], ref[V];
    const double ps[] = {0.05, 0.3, 0.5, 0.8, 0.95, 0.999, 1.0};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) {
        float logits[V];
        random_logits(logits, &r);
        SamplingParams sp = {1.3, ps[i], 2}; // top_k is ignored: top-p takes precedence
        sample_distribution(logits, V, &sp, probs);
        softmax_ref(logits, 1.3, ref);
        // the kept set is a descending prefix; its mass exceeds p and without its smallest member it does not
        double kept = 0.0, smallest = 2.0;
        for (int v = 0; v < V; v++)
            if (probs[v] > 0) { kept += ref[v]; smallest = fmin(smallest, ref[v]); }
        int prefix = 1;
        for (int v = 0; v < V; v++)
            for (int u = 0; u < V; u++)
                if (probs[v] > 0 && probs[u] == 0 && ref[u] > ref[v]) prefix = 0;
        CHECK(prefix, "top-p %.3f: the kept tokens are not the most probable ones", ps[i]);
        CHECK(kept > ps[i] || count_kept(probs) == V, "top-p %.3f: kept mass %.6f", ps[i], kept);
        CHECK(kept - smallest <= ps[i], "top-p %.3f: prefix not minimal (mass %.6f without its last)", ps[i],
              kept - smallest);
        printf("top-p %.3f keeps %d of %d tokens (mass %.4f)\n", ps[i], count_kept(probs), V, kept);
    }
}

// Frequencies of DRAWS draws against the distribution they are drawn from (chi-square over the kept tokens).
static void check_frequencies(const char *what, const float *logits, const SamplingParams *sp) {
    Rng r = rng_make(4);
    double probs[V], expect[V];
    long counts[V] = {0};
    sample_distribution(logits, V, sp, expect);
    for (int i = 0; i < DRAWS; i++) counts[sample_token(logits, V, sp, &r, probs)]++;
    double chi2 = 0.0;
    int stray = 0;
    for (int v = 0; v < V; v++) {
        if (expect[v] > 0)
            chi2 += (counts[v] - DRAWS * expect[v]) * (counts[v] - DRAWS * expect[v]) / (DRAWS * expect[v]);
        else stray += counts[v] != 0;
    }
    printf("%s: chi-square %.2f over %d kept tokens (max %.0f)\n", what, chi2, count_kept(expect), CHI2_MAX);
    CHECK(chi2 <= CHI2_MAX, "%s: chi-square %.2f > %.0f", what, chi2, CHI2_MAX);
    CHECK(stray == 0, "%s: %d excluded tokens were drawn", what, stray);
}

static void test_frequencies(void) {
    Rng r = rng_make(5);
    float logits[V];
    for (int v = 0; v < V; v++) logits[v] = (float)(0.5 * rng_normal(&r));
    SamplingParams plain = {1.0, 0.0, 0}, hot = {2.5, 0.0, 0}, k5 = {0.8, 0.0, 5}, p7 = {1.0, 0.7, 0};
    check_frequencies("plain T=1", logits, &plain);
    check_frequencies("T=2.5", logits, &hot);
    check_frequencies("top-k 5 T=0.8", logits, &k5);
    check_frequencies("top-p 0.7", logits, &p7);
}

static void test_seeded(void) {
    float logits[V];
    Rng r = rng_make(6);
    random_logits(logits, &r);
    SamplingParams sp = {1.0, 0.9, 0};
    double probs[V];
    Rng a = rng_make(42), b = rng_make(42), c = rng_make(43);
    int same = 1, differ = 0;
    for (int i = 0; i < 200; i++) {
        int x = sample_token(logits, V, &sp, &a, probs), y = sample_token(logits, V, &sp, &b, probs);
        same &= x == y;
        differ |= x != sample_token(logits, V, &sp, &c, probs);
    }
    CHECK(same, "the same seed gave different draws");
    CHECK(differ, "seeds 42 and 43 gave the same 200 draws");
}

int main(void) {
    test_greedy();
    test_top_k();
    test_top_p();
    test_frequencies();
    test_seeded();
    return test_summary();
}
