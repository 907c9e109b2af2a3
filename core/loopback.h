// core/loopback.h: a communicator with the interface of core/dist.cuh's NCCL one (reduce-scatter of fp32 gradients,
// ZeRO-2's reduction of a gradient bucket into the owners' shards, all-gather of 4- or 2-byte elements, all-reduce
// sum, broadcast) for `world` ranks that are threads of one process, on host memory. Lets the CPU tests run the ZeRO-1
// and ZeRO-2 arithmetic at world sizes 2, 3, 4 without a GPU.
//
// Every rank's thread calls each collective in the same order, as with NCCL. A call publishes the rank's buffer,
// waits for all ranks (barrier), computes this rank's part of the result from the others' buffers, and waits again
// before returning, so no buffer changes while another rank reads it. Sums run over ranks 0, 1, ..., world-1 in that
// order (((b0 + b1) + b2) + ...), the order in which one process accumulates its micro-batches: that is what makes
// world W bitwise equal to world 1 (tests/test_zero1.c, tests/test_zero2.c). NCCL's ring sums in another order for
// world > 2 (see core/dist.cuh).
#ifndef SDM_CORE_LOOPBACK_H
#define SDM_CORE_LOOPBACK_H

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/common.h"
#include "core/shard.h"

#define LOOP_MAX_WORLD 16

// What the ranks share: one per run.
typedef struct {
    int world;
    pthread_barrier_t barrier;
    void *buf[LOOP_MAX_WORLD]; // each rank's buffer in the collective under way
} LoopGroup;

// One rank's handle: the same layout fields as Dist.
typedef struct {
    int rank, world;
    long long n, shard;
    LoopGroup *group;
} LoopComm;

static inline void loop_group_init(LoopGroup *g, int world) {
    if (world < 1 || world > LOOP_MAX_WORLD) sdm_die("loopback: world size %d outside 1..%d", world, LOOP_MAX_WORLD);
    memset(g, 0, sizeof *g);
    g->world = world;
    if (pthread_barrier_init(&g->barrier, NULL, (unsigned)world) != 0) sdm_die("loopback: no barrier");
}

static inline void loop_group_destroy(LoopGroup *g) { pthread_barrier_destroy(&g->barrier); }

static inline LoopComm loop_comm(LoopGroup *g, int rank, long long n_params) {
    LoopComm c = {rank, g->world, n_params, shard_size(n_params, g->world), g};
    return c;
}

static inline void loop_publish(LoopComm *c, void *buf) {
    c->group->buf[c->rank] = buf;
    pthread_barrier_wait(&c->group->barrier);
}

static inline void loop_done(LoopComm *c) { pthread_barrier_wait(&c->group->barrier); }

// out[i] = Σ over ranks in order of buf_q[off + i], i < count (out may be this rank's own buf + off: element i of
// it is read before it is written, and no other rank reads it).
static inline void loop_sum(LoopComm *c, float *out, long long off, long long count) {
    float **b = (float **)c->group->buf;
    for (long long i = 0; i < count; i++) {
        float s = b[0][off + i];
        for (int q = 1; q < c->world; q++) s += b[q][off + i];
        out[i] = s;
    }
}

// grads: fp32 [world * shard]. Afterwards grads[rank*shard ...] holds the sum over ranks (dist_reduce_scatter_grads).
static inline void loop_reduce_scatter_grads(LoopComm *c, float *grads) {
    loop_publish(c, grads);
    loop_sum(c, grads + c->rank * c->shard, c->rank * c->shard, c->shard);
    loop_done(c);
}

// ZeRO-2 (dist_reduce_add): bucket[hi - lo] holds this rank's gradient of the flat range [lo, hi) (hi <= n); the sum
// over ranks of the part each rank owns is added to that rank's shard ([shard], element 0 = flat element
// rank*shard). As with NCCL's reduce, the owner's bucket takes the sum in place first (no other rank reads that part).
static inline void loop_reduce_add(LoopComm *c, float *bucket, long long lo, long long hi, float *shard) {
    long long a, b;
    shard_overlap(c->n, c->world, c->rank, lo, hi, &a, &b);
    loop_publish(c, bucket);
    loop_sum(c, bucket + (a - lo), a - lo, b - a);
    for (long long i = a; i < b; i++) shard[i - c->rank * c->shard] += bucket[i - lo];
    loop_done(c);
}

// params: [world * shard] elements of elem_bytes; rank q's shard goes to every rank (dist_all_gather).
static inline void loop_all_gather(LoopComm *c, void *params, size_t elem_bytes) {
    loop_publish(c, params);
    size_t bytes = (size_t)c->shard * elem_bytes;
    for (int q = 0; q < c->world; q++)
        if (q != c->rank) memcpy((char *)params + q * bytes, (char *)c->group->buf[q] + q * bytes, bytes);
    loop_done(c);
}

// Sum n floats over ranks in place (dist_all_reduce_sum). Every rank reads every buffer whole, so the sums go to a
// scratch first and into x only after all ranks have read.
static inline void loop_all_reduce_sum(LoopComm *c, float *x, size_t n) {
    float *sum = (float *)sdm_malloc(n * sizeof(float));
    loop_publish(c, x);
    loop_sum(c, sum, 0, (long long)n);
    loop_done(c);
    memcpy(x, sum, n * sizeof(float));
    free(sum);
}

// buf[bytes] of `root` to every rank (dist_broadcast).
static inline void loop_broadcast(LoopComm *c, void *buf, size_t bytes, int root) {
    loop_publish(c, buf);
    if (c->rank != root) memcpy(buf, c->group->buf[root], bytes);
    loop_done(c);
}

#endif
