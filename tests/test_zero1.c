// tests/test_zero1.c: ZeRO-1 data parallelism on the CPU with the loopback communicator (core/loopback.h): at world
// sizes 2, 3 and 4, and parameter counts that leave uneven, padded or empty shards, a few optimizer steps give
// bitwise the same fp32 weights and AdamW state as world size 1, global-norm clipping included.
//
// What "the same" means: world W with one micro-batch per rank against world 1 accumulating the same W micro-batches
// in rank order, each micro-batch gradient already scaled by 1/W (train_step scales the loss by
// 1/(tokens·grad_acc·world)). World 1 sums ((g0 + g1) + g2) + ...; the loopback reduce-scatter sums the ranks in that
// same order, so the summed gradients agree bitwise. The squared norm is summed per SHARD_ALIGN block and then over
// the blocks in order (core/shard.h), a grid that does not depend on W, and the blocks' partial sums travel by an
// all-reduce in which every slot has one non-zero contributor (adding zeros is exact in any order), so the norm, the
// clip scale and hence the AdamW updates agree bitwise too. The step is train_step's: reduce-scatter, norm over the
// owned shard, all-reduce, clip scale (clip_scale), AdamW on the owned range (adamw_element, adamw_coeffs),
// all-gather. On NCCL with W > 2 the ring sums in another order: see core/dist.cuh for the bound that holds there.
#include <pthread.h>

#include "core/loopback.h"
#include "core/optim.h"
#include "core/rng.h"
#include "tests/test.h"

#define STEPS 3
#define MAX_WORLD 4

typedef struct {
    long long n;
    const float *grads[STEPS][MAX_WORLD]; // micro-batch gradients [n], one per rank (world W) or all W (world 1)
    float grad_scale[STEPS];              // the gradients of step s are scaled by this: clipping on some steps only
    const float *init;                    // initial weights [n]
    float clip;
} Problem;

typedef struct {
    const Problem *pb;
    LoopComm comm;
    int micro; // micro-batches this rank accumulates: world 1 takes all W of the W-rank run
    float *master, *m, *v, *grads; // [padded]
    float norm[STEPS];
} RankState;

// One optimizer step of train_step on this rank.
static void zero1_step(RankState *st, int step) {
    LoopComm *c = &st->comm;
    const Problem *pb = st->pb;
    long long n = pb->n, padded = (long long)c->world * c->shard, lo, hi;
    memset(st->grads, 0, sizeof(float) * (size_t)padded);
    for (int k = 0; k < st->micro; k++) {                          // the backward passes accumulate into grads
        const float *g = pb->grads[step][st->micro == 1 ? c->rank : k];
        for (long long i = 0; i < n; i++) st->grads[i] += g[i];
    }
    loop_reduce_scatter_grads(c, st->grads);
    shard_range(n, c->world, c->rank, &lo, &hi);
    long long blocks = padded / SHARD_ALIGN, b0 = c->rank * c->shard / SHARD_ALIGN;
    float *partial = (float *)sdm_calloc((size_t)blocks, sizeof(float)), sumsq = 0.0f;
    shard_block_sumsq(partial, st->grads, n, b0, b0 + c->shard / SHARD_ALIGN);
    loop_all_reduce_sum(c, partial, (size_t)blocks);
    for (long long b = 0; b < blocks; b++) sumsq += partial[b];
    free(partial);
    st->norm[step] = sqrtf(sumsq);
    float scale = clip_scale(st->norm[step], pb->clip);
    AdamWHyper h = {1e-2, 0.1, 0.9, 0.95, 1e-8, step + 1};
    AdamWCoeffs k = adamw_coeffs(&h, 1);
    for (long long i = lo; i < hi; i++) adamw_element(&st->master[i], &st->m[i], &st->v[i], st->grads[i] * scale, k);
    loop_all_gather(c, st->master, sizeof(float));
}

static void *rank_main(void *arg) {
    RankState *st = (RankState *)arg;
    for (int s = 0; s < STEPS; s++) zero1_step(st, s);
    return NULL;
}

// Run `world` ranks (threads) over the problem; micro = micro-batches per rank. st[r] keeps each rank's state.
static void run(const Problem *pb, int world, int micro, RankState *st) {
    LoopGroup group;
    loop_group_init(&group, world);
    pthread_t th[MAX_WORLD];
    for (int r = 0; r < world; r++) {
        st[r].pb = pb;
        st[r].comm = loop_comm(&group, r, pb->n);
        st[r].micro = micro;
        size_t padded = (size_t)shard_padded(pb->n, world);
        st[r].master = (float *)sdm_calloc(padded, sizeof(float));
        st[r].m = (float *)sdm_calloc(padded, sizeof(float));
        st[r].v = (float *)sdm_calloc(padded, sizeof(float));
        st[r].grads = (float *)sdm_calloc(padded, sizeof(float));
        memcpy(st[r].master, pb->init, sizeof(float) * (size_t)pb->n);
        if (pthread_create(&th[r], NULL, rank_main, &st[r]) != 0) sdm_die("pthread_create failed");
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
    loop_group_destroy(&group);
}

static void release(RankState *st, int world) {
    for (int r = 0; r < world; r++) free(st[r].master), free(st[r].m), free(st[r].v), free(st[r].grads);
}

static int same_bits(const float *a, const float *b, long long n) { return memcmp(a, b, sizeof(float) * n) == 0; }

// World W against world 1 on n parameters.
static void test_world(int world, long long n) {
    Rng rng = rng_make((uint64_t)(n * 16 + world));
    float *data = (float *)sdm_malloc(sizeof(float) * (size_t)(n * (STEPS * world + 1)));
    Problem pb = {n, {{0}}, {1.0f, 1e-3f, 0.3f}, data, 1.0f};
    for (long long i = 0; i < n; i++) data[i] = (float)rng_normal(&rng) * 0.02f;
    for (int s = 0; s < STEPS; s++)
        for (int k = 0; k < world; k++) {
            float *g = data + n * (1 + s * world + k);
            for (long long i = 0; i < n; i++)  // 1/W: the loss scale of train_step; varied exponents
                g[i] = (float)(rng_normal(&rng) * exp(4.0 * rng_uniform(&rng) - 2.0)) * pb.grad_scale[s] / world;
            pb.grads[s][k] = g;
        }
    RankState one[1], many[MAX_WORLD];
    memset(one, 0, sizeof one);
    memset(many, 0, sizeof many);
    run(&pb, 1, world, one);
    run(&pb, world, 1, many);
    CHECK(one[0].norm[0] > pb.clip && one[0].norm[1] < pb.clip, "world %d, n %lld: the steps should clip, then not "
          "(norms %g, %g)", world, n, one[0].norm[0], one[0].norm[1]);
    for (int r = 0; r < world; r++) {
        long long lo, hi;
        shard_range(n, world, r, &lo, &hi);
        CHECK(same_bits(many[r].master, one[0].master, n), "world %d, n %lld: rank %d's weights differ from world 1",
              world, n, r);
        CHECK(same_bits(many[r].m + lo, one[0].m + lo, hi - lo) && same_bits(many[r].v + lo, one[0].v + lo, hi - lo),
              "world %d, n %lld: rank %d's AdamW shard differs from world 1", world, n, r);
        CHECK(!memcmp(many[r].norm, one[0].norm, sizeof one[0].norm), "world %d, n %lld: rank %d's norms differ",
              world, n, r);
    }
    release(one, 1);
    release(many, world);
    free(data);
}

// The shard arithmetic: every parameter owned by exactly one rank, shards aligned, padding under one block per rank.
static void test_shards(void) {
    int bad = 0;
    for (int world = 1; world <= 8; world++)
        for (long long n = 1; n < 700; n += 7) {
            long long next = 0, s = shard_size(n, world);
            for (int r = 0; r < world; r++) {
                long long lo, hi;
                shard_range(n, world, r, &lo, &hi);
                if (hi > lo && (lo != next || hi > n)) bad++;
                if (hi > lo) next = hi;
            }
            if (next != n || s % SHARD_ALIGN || shard_padded(n, world) < n ||
                s - (n + world - 1) / world >= SHARD_ALIGN)
                bad++;
        }
    CHECK(bad == 0, "shard arithmetic: %d bad layouts", bad);
}

typedef struct {
    LoopComm comm;
    unsigned short half[3 * 64]; // bf16-sized elements, world 3
    double bcast[4];
} SmallState;

static void *small_main(void *arg) {
    SmallState *st = (SmallState *)arg;
    LoopComm *c = &st->comm;
    for (long long i = 0; i < c->shard; i++) st->half[c->rank * c->shard + i] = (unsigned short)(c->rank * 1000 + i);
    loop_all_gather(c, st->half, 2);
    if (c->rank == 1) for (int i = 0; i < 4; i++) st->bcast[i] = 0.5 + i;
    loop_broadcast(c, st->bcast, sizeof st->bcast, 1);
    return NULL;
}

// All-gather of 2-byte elements and broadcast from a non-zero root, world 3.
static void test_small_collectives(void) {
    LoopGroup group;
    loop_group_init(&group, 3);
    SmallState st[3];
    pthread_t th[3];
    memset(st, 0, sizeof st);
    for (int r = 0; r < 3; r++) {
        st[r].comm = loop_comm(&group, r, 3 * 64 - 5);
        pthread_create(&th[r], NULL, small_main, &st[r]);
    }
    for (int r = 0; r < 3; r++) pthread_join(th[r], NULL);
    loop_group_destroy(&group);
    int bad = 0;
    for (int r = 0; r < 3; r++) {
        for (int i = 0; i < 3 * 64; i++) bad += st[r].half[i] != (unsigned short)(i / 64 * 1000 + i % 64);
        for (int i = 0; i < 4; i++) bad += st[r].bcast[i] != 0.5 + i;
    }
    CHECK(bad == 0, "loopback all-gather (2 bytes) or broadcast: %d wrong elements", bad);
}

int main(void) {
    test_shards();
    test_small_collectives();
    const long long sizes[] = {100, 1000, 4099, 64 * 12};
    for (int world = 2; world <= MAX_WORLD; world++)
        for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) test_world(world, sizes[i]);
    return test_summary();
}
