// tests/rand_slots.h: random slot lists for the SDM tests and benchmarks: k distinct slots of [0, n), ascending.
#ifndef SDM_TESTS_RAND_SLOTS_H
#define SDM_TESTS_RAND_SLOTS_H

#include <stdlib.h>

#include "core/rng.h"

static inline int ascending_int_cmp(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

// Rejection when k is small against n (O(k^2)); otherwise selection sampling (Knuth's algorithm S, O(n)), which
// yields the slots already in order.
static inline void rand_slots(Rng *rng, int n, int k, int *out) {
    if (4 * k <= n) {
        for (int i = 0; i < k; i++) {
            int s, dup;
            do {
                s = (int)rng_below(rng, (uint32_t)n);
                dup = 0;
                for (int j = 0; j < i; j++) dup |= out[j] == s;
            } while (dup);
            out[i] = s;
        }
        qsort(out, (size_t)k, sizeof(int), ascending_int_cmp);
        return;
    }
    for (int i = 0, m = 0; i < n && m < k; i++)
        if (rng_below(rng, (uint32_t)(n - i)) < (uint32_t)(k - m)) out[m++] = i;
}

#endif
