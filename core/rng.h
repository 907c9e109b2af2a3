// core/rng.h: a small seeded RNG (splitmix64) with uniform, normal and truncated-normal draws.
// The state is one uint64, so it can be saved in checkpoints and reproduced exactly. The uniform draw also runs on
// the device (core/sampling.cuh), giving the host's bits from the same state.
#ifndef SDM_CORE_RNG_H
#define SDM_CORE_RNG_H

#include <math.h>
#include <stdint.h>

#include "core/common.h"

typedef struct { uint64_t state; } Rng;

static inline Rng rng_make(uint64_t seed) {
    Rng r;
    r.state = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
    return r;
}

static inline SDM_HOST_DEVICE uint64_t rng_u64(Rng *r) {
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// uniform in [0, 1), 53 random bits
static inline SDM_HOST_DEVICE double rng_uniform(Rng *r) {
    return (double)(rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
}

static inline double rng_range(Rng *r, double lo, double hi) { return lo + (hi - lo) * rng_uniform(r); }

// standard normal by Box-Muller (one draw per call: simple and reproducible)
static inline double rng_normal(Rng *r) {
    double u1 = rng_uniform(r), u2 = rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// normal(0, std) truncated to [-bound, bound] by rejection
static inline double rng_trunc_normal(Rng *r, double std, double bound) {
    for (;;) {
        double x = std * rng_normal(r);
        if (x >= -bound && x <= bound) return x;
    }
}

// uniform integer in [0, n)
static inline uint32_t rng_below(Rng *r, uint32_t n) { return (uint32_t)(rng_u64(r) % n); }

#endif
