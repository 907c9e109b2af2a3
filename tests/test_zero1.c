// tests/test_zero1.c: ZeRO-1 data parallelism on the CPU with the loopback communicator (core/loopback.h), laid out
// as train_sdm.cu lays it out: each rank holds the fp32 master weights and AdamW m, v of its shard only, and the whole
// working copy. At world sizes 2, 3 and 4, over parameter tables whose shard boundaries fall inside tensors, at their
// starts and in the alignment gaps between them, with padded or empty shards:
//   - a few optimizer steps give bitwise the same master weights, AdamW state, working weights and gradient norms as
//     world size 1, global-norm clipping included;
//   - the state gathered to rank 0 piece by piece for a checkpoint (train_sdm's gather_to_rank0, with pieces smaller
//     than a shard that do not divide it, and larger ones) is world 1's state exactly;
//   - a run resumed from that checkpoint at the other world size (each rank takes its shard) goes on bitwise as the
//     uninterrupted run.
//
// What "the same" means: world W with one micro-batch per rank against world 1 accumulating the same W micro-batches
// in rank order, each micro-batch gradient already scaled by 1/W (train_step scales the loss by
// 1/(tokens·grad_acc·world)). World 1 sums ((g0 + g1) + g2) + ...; the loopback reduce-scatter sums the ranks in that
// same order, so the summed gradients agree bitwise. The squared norm is summed per SHARD_ALIGN block and then over
// the blocks in order (core/shard.h), a grid that does not depend on W, and the blocks' partial sums travel by an
// all-reduce in which every slot has one non-zero contributor (adding zeros is exact in any order), so the norm, the
// clip scale and hence the AdamW updates agree bitwise too. The step is train_step's: reduce-scatter, norm over the
// owned shard, all-reduce, clip scale (clip_scale), AdamW on the owned tensor elements with their decay flags
// (model_decay_run, adamw_element, adamw_coeffs) into the shard-sized state and the working copy, all-gather of the
// working copy. On NCCL with W > 2 the ring sums in another order: see core/dist.cuh for the bound that holds there.
#include <pthread.h>

#include "core/loopback.h"
#include "core/optim.h"
#include "core/rng.h"
#include "model/model.h"
#include "tests/test.h"

#define STEPS 3
#define SPLIT 1 // the checkpoint of the resumed runs is taken after this many steps
#define MAX_WORLD 4

typedef struct {
    const ModelDesc *md;                  // the parameter table: n = md->storage
    int world;                            // micro-batches per step: one per rank of the W-rank run
    long long piece;                      // elements per piece of the checkpoint gather
    const float *grads[STEPS][MAX_WORLD]; // micro-batch gradients [n]
    float grad_scale[STEPS];              // the gradients of step s are scaled by this: clipping on some steps only
    const float *init;                    // initial weights [n] (gaps included: nothing may change them)
    float clip;
} Problem;

typedef struct { float *p, *m, *v; } Saved; // a checkpoint's arrays [n] in flat order (rank 0's host copies)

typedef struct {
    const Problem *pb;
    LoopComm comm;
    int first, last;        // the steps [first, last) of this run
    const Saved *from;      // the checkpoint it resumes from (NULL: the initial weights, zero moments)
    long long lo, hi;       // the elements this rank owns (core/shard.h)
    float *master, *m, *v;  // [shard] this rank's shard: train_sdm's AdamWState
    float *work, *grads;    // [padded] the working weights (fp32 here) and the gradients, whole on every rank
    float norm[STEPS];
    Saved saved;            // rank 0: the state after the last step, gathered as save_checkpoint does
} RankState;

// train_sdm's upload_shard: this rank's shard of a host array [n] into a shard-sized one.
static void upload_shard(const RankState *st, float *shard, const float *host) {
    if (st->hi > st->lo) memcpy(shard, host + st->lo, sizeof(float) * (size_t)(st->hi - st->lo));
}

// train_sdm's set_params and resume: the shards of the master weights (and of m, v when resuming), the working copy
// whole.
static void load(RankState *st) {
    upload_shard(st, st->master, st->from ? st->from->p : st->pb->init);
    if (st->from) upload_shard(st, st->m, st->from->m), upload_shard(st, st->v, st->from->v);
    memcpy(st->work, st->from ? st->from->p : st->pb->init, sizeof(float) * (size_t)st->pb->md->storage);
}

// train_sdm's gather_to_rank0: a sharded array whole on rank 0 (malloc'ed; NULL on the other ranks), piece by piece
// through a staging buffer of at most pb->piece elements.
static float *gather_to_rank0(RankState *st, const float *shard) {
    LoopComm *c = &st->comm;
    long long n = st->pb->md->storage, piece = SDM_MIN(st->pb->piece, c->shard);
    float *stage = (float *)sdm_malloc(sizeof(float) * (size_t)piece);
    float *host = c->rank == 0 ? (float *)sdm_malloc(sizeof(float) * (size_t)n) : NULL;
    ShardPiece p;
    for (long long lo = 0; lo < n; lo = p.hi) {
        p = shard_piece_at(n, c->world, piece, lo);
        size_t bytes = sizeof(float) * (size_t)(p.hi - p.lo);
        if (c->rank == p.owner) memcpy(stage, shard + p.at, bytes);
        loop_broadcast(c, stage, bytes, p.owner);
        if (host) memcpy(host + p.lo, stage, bytes);
    }
    free(stage);
    return host;
}

// One optimizer step of train_step on this rank.
static void zero1_step(RankState *st, int step) {
    LoopComm *c = &st->comm;
    const Problem *pb = st->pb;
    long long n = pb->md->storage, padded = (long long)c->world * c->shard, lo = st->lo, a, b;
    int micro = pb->world / c->world, decay, next = 0;
    memset(st->grads, 0, sizeof(float) * (size_t)padded);
    for (int k = 0; k < micro; k++) {                              // the backward passes accumulate into grads
        const float *g = pb->grads[step][c->rank * micro + k];
        for (long long i = 0; i < n; i++) st->grads[i] += g[i];
    }
    loop_reduce_scatter_grads(c, st->grads);
    long long blocks = padded / SHARD_ALIGN, b0 = c->rank * c->shard / SHARD_ALIGN;
    float *partial = (float *)sdm_calloc((size_t)blocks, sizeof(float)), sumsq = 0.0f;
    shard_block_sumsq(partial, st->grads, n, b0, b0 + c->shard / SHARD_ALIGN);
    loop_all_reduce_sum(c, partial, (size_t)blocks);
    for (long long k = 0; k < blocks; k++) sumsq += partial[k];
    free(partial);
    st->norm[step] = sqrtf(sumsq);
    float scale = clip_scale(st->norm[step], pb->clip);
    AdamWHyper h = {1e-2, 0.1, 0.9, 0.95, 1e-8, step + 1};
    while (model_decay_run(pb->md, lo, st->hi, &next, &a, &b, &decay)) {
        AdamWCoeffs coeffs = adamw_coeffs(&h, decay);
        for (long long i = a; i < b; i++) {
            adamw_element(&st->master[i - lo], &st->m[i - lo], &st->v[i - lo], st->grads[i] * scale, coeffs);
            st->work[i] = st->master[i - lo];
        }
    }
    loop_all_gather(c, st->work, sizeof(float));
}

static void *rank_main(void *arg) {
    RankState *st = (RankState *)arg;
    load(st);
    for (int s = st->first; s < st->last; s++) zero1_step(st, s);
    st->saved.p = gather_to_rank0(st, st->master);
    st->saved.m = gather_to_rank0(st, st->m);
    st->saved.v = gather_to_rank0(st, st->v);
    return NULL;
}

// Run `world` ranks (threads: 1 or pb->world) over steps [first, last) from `from` (NULL: the start); st[r] keeps
// each rank's state.
static void run(const Problem *pb, int world, int first, int last, const Saved *from, RankState *st) {
    LoopGroup group;
    loop_group_init(&group, world);
    pthread_t th[MAX_WORLD];
    long long n = pb->md->storage;
    for (int r = 0; r < world; r++) {
        memset(&st[r], 0, sizeof st[r]);
        st[r].pb = pb;
        st[r].comm = loop_comm(&group, r, n);
        st[r].first = first;
        st[r].last = last;
        st[r].from = from;
        shard_range(n, world, r, &st[r].lo, &st[r].hi);
        size_t shard = (size_t)st[r].comm.shard, padded = shard * (size_t)world;
        st[r].master = (float *)sdm_calloc(shard, sizeof(float));
        st[r].m = (float *)sdm_calloc(shard, sizeof(float));
        st[r].v = (float *)sdm_calloc(shard, sizeof(float));
        st[r].work = (float *)sdm_calloc(padded, sizeof(float));
        st[r].grads = (float *)sdm_calloc(padded, sizeof(float));
        if (pthread_create(&th[r], NULL, rank_main, &st[r]) != 0) sdm_die("pthread_create failed");
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
    loop_group_destroy(&group);
}

static void release(RankState *st, int world) {
    for (int r = 0; r < world; r++) {
        float *bufs[] = {st[r].master, st[r].m, st[r].v, st[r].work, st[r].grads, st[r].saved.p, st[r].saved.m,
                         st[r].saved.v};
        for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    }
}

static int same_bits(const float *a, const float *b, long long n) {
    return n <= 0 || memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

// The ranks st[0 .. world) of a run that ended after step STEPS against the uninterrupted world-1 run `one`: each
// rank's shards, its working weights, the norms of steps [first, STEPS), and rank 0's gathered checkpoint.
static void check_same(const char *how, const Problem *pb, const RankState *one, const RankState *st, int world,
                       int first) {
    char what[128];
    long long n = pb->md->storage;
    snprintf(what, sizeof what, "W = %d, %s, n %lld, piece %lld", pb->world, how, n, pb->piece);
    for (int r = 0; r < world; r++) {
        long long lo = st[r].lo, count = st[r].hi - lo;
        CHECK(same_bits(st[r].master, one->master + lo, count) && same_bits(st[r].m, one->m + lo, count) &&
              same_bits(st[r].v, one->v + lo, count), "%s: rank %d's shard of the master weights or AdamW "
              "state differs from world 1", what, r);
        CHECK(same_bits(st[r].work, one->work, n), "%s: rank %d's working weights differ from world 1", what, r);
        CHECK(!memcmp(st[r].norm + first, one->norm + first, sizeof(float) * (STEPS - first)),
              "%s: rank %d's norms differ", what, r);
    }
    CHECK(same_bits(st[0].saved.p, one->master, n) && same_bits(st[0].saved.m, one->m, n) &&
          same_bits(st[0].saved.v, one->v, n), "%s: the gathered checkpoint differs from world 1's state", what);
}

// A parameter table of exactly n elements: tensors of 1 to 300 elements, so that alignment gaps follow those of odd
// sizes, or of whole 64-element blocks, so that tensors also start on shard boundaries; every fifth not decayed (as
// SDM A_log and dt_bias).
static void random_table(ModelDesc *md, long long n, Rng *rng) {
    memset(md, 0, sizeof *md);
    while (md->storage < n) {
        long long start = (md->storage + MODEL_ALIGN - 1) / MODEL_ALIGN * MODEL_ALIGN;
        long long numel = rng_below(rng, 2) ? 1 + rng_below(rng, 300) : SHARD_ALIGN * (1 + rng_below(rng, 4));
        model_add(md, -1, "t", start + numel + 300 < n ? numel : n - start, 0, INIT_ZEROS, 0, 0)->decay =
            md->n_params % 5 != 0;
    }
}

// Where the rank boundaries of world W fall in the table (counts): inside a tensor, at the start of a tensor right
// after another, at the start of a tensor after an alignment gap (shards and tensor offsets are multiples of
// MODEL_ALIGN, so a boundary cannot fall inside a gap).
static void count_boundaries(const ModelDesc *md, int world, int counts[3]) {
    for (int r = 1; r < world; r++) {
        long long at = r * shard_size(md->storage, world);
        for (int i = 0; i < md->n_params; i++) {
            const ParamSpec *p = &md->params[i];
            if (at > p->offset && at < p->offset + p->numel) counts[0]++;
            else if (at == p->offset && i > 0) counts[p[-1].offset + p[-1].numel == at ? 1 : 2]++;
        }
    }
}

// World W against world 1 on a table of n parameters, with checkpoints gathered in pieces of `piece` elements.
static void test_world(int world, long long n, long long piece, int boundaries[3]) {
    Rng rng = rng_make((uint64_t)(n * 16 + world));
    ModelDesc *md = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    random_table(md, n, &rng);
    count_boundaries(md, world, boundaries);
    float *data = (float *)sdm_malloc(sizeof(float) * (size_t)(n * (STEPS * world + 1)));
    Problem pb = {md, world, piece, {{0}}, {1.0f, 1e-3f, 0.3f}, data, 1.0f};
    for (long long i = 0; i < n; i++) data[i] = (float)rng_normal(&rng) * 0.02f;
    for (int s = 0; s < STEPS; s++)
        for (int k = 0; k < world; k++) {
            float *g = data + n * (1 + s * world + k);
            for (long long i = 0; i < n; i++)  // 1/W: the loss scale of train_step; varied exponents
                g[i] = (float)(rng_normal(&rng) * exp(4.0 * rng_uniform(&rng) - 2.0)) * pb.grad_scale[s] / world;
            pb.grads[s][k] = g;
        }
    RankState one[1], st[MAX_WORLD], then[MAX_WORLD];
    run(&pb, 1, 0, STEPS, NULL, one);
    CHECK(one[0].norm[0] > pb.clip && one[0].norm[1] < pb.clip, "world %d, n %lld: the steps should clip, then not "
          "(norms %g, %g)", world, n, one[0].norm[0], one[0].norm[1]);
    run(&pb, world, 0, STEPS, NULL, st);
    check_same("world W", &pb, one, st, world, 0);
    release(st, world);
    // a checkpoint after SPLIT steps at one world size, resumed at the other
    run(&pb, world, 0, SPLIT, NULL, st);
    run(&pb, 1, SPLIT, STEPS, &st[0].saved, then);
    check_same("world W resumed at world 1", &pb, one, then, 1, SPLIT);
    release(st, world);
    release(then, 1);
    run(&pb, 1, 0, SPLIT, NULL, st);
    run(&pb, world, SPLIT, STEPS, &st[0].saved, then);
    check_same("world 1 resumed at world W", &pb, one, then, world, SPLIT);
    release(st, 1);
    release(then, world);
    release(one, 1);
    free(data);
    free(md);
}

// The shard arithmetic: every parameter owned by exactly one rank, shards aligned, padding under one block per rank;
// the pieces of a gather cover [0, n) in order, each within its owner's shard and at most `piece` long, and a piece
// ends only at the piece size, a shard's end or n.
static void test_shards(void) {
    int bad = 0, bad_pieces = 0;
    const long long pieces[] = {1, 37, 64, 1000};
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
            for (size_t k = 0; k < sizeof pieces / sizeof *pieces; k++) {
                ShardPiece p;
                for (long long lo = 0; lo < n; lo = p.hi) {
                    p = shard_piece_at(n, world, pieces[k], lo);
                    long long end = (long long)p.owner * s + s;
                    bad_pieces += p.lo != lo || p.hi <= lo || p.hi - lo > pieces[k] || p.owner >= world ||
                                  p.at != lo - (long long)p.owner * s || p.hi > end ||
                                  (p.hi - lo < pieces[k] && p.hi != end && p.hi != n);
                }
            }
        }
    CHECK(bad == 0, "shard arithmetic: %d bad layouts", bad);
    CHECK(bad_pieces == 0, "shard pieces: %d bad pieces", bad_pieces);
}

// model_decay_run over random ranges of a random table: the runs update exactly the tensor elements of the range,
// each with its tensor's decay flag, in order, and no two consecutive runs could have been one launch.
static void test_decay_runs(void) {
    Rng rng = rng_make(7);
    ModelDesc *md = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    random_table(md, 3000, &rng);
    long long n = md->storage;
    signed char *want = (signed char *)sdm_malloc((size_t)n), *got = (signed char *)sdm_malloc((size_t)n); // -1: none
    int bad = 0;
    for (int trial = 0; trial < 300; trial++) {
        long long lo = rng_below(&rng, (uint32_t)n), hi = lo + rng_below(&rng, (uint32_t)(n - lo + 1)), a, b;
        memset(want, -1, (size_t)n);
        memset(got, -1, (size_t)n);
        for (int t = 0; t < md->n_params; t++)
            for (long long i = md->params[t].offset; i < md->params[t].offset + md->params[t].numel; i++)
                if (i >= lo && i < hi) want[i] = (signed char)md->params[t].decay;
        long long end = lo;
        int decay, before = -1, next = 0;
        while (model_decay_run(md, lo, hi, &next, &a, &b, &decay)) {
            bad += a < end || b > hi || a >= b || (a == end && decay == before);
            for (long long i = a; i < b; i++) got[i] = (signed char)decay;
            end = b;
            before = decay;
        }
        bad += memcmp(want, got, (size_t)n) != 0;
    }
    CHECK(bad == 0, "model_decay_run: %d bad runs or ranges", bad);
    free(want);
    free(got);
    free(md);
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
    test_decay_runs();
    test_small_collectives();
    // 4099: a padded last shard; 64 x 12: shards that end exactly at n; 100 at world 3, 4: empty last shards.
    // Pieces: smaller than every shard and dividing none (37), smaller than the larger shards (1000), whole shards.
    const long long sizes[] = {100, 1000, 4099, 64 * 12}, pieces[] = {37, 1000, 1 << 20};
    int boundaries[3] = {0, 0, 0};
    for (int world = 2; world <= MAX_WORLD; world++)
        for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
            for (size_t k = 0; k < sizeof pieces / sizeof *pieces; k++)
                test_world(world, sizes[i], pieces[k], boundaries);
    CHECK(boundaries[0] && boundaries[1] && boundaries[2], "the tables should put rank boundaries inside tensors "
          "(%d), at tensor starts right after another (%d) and after a gap (%d)", boundaries[0], boundaries[1],
          boundaries[2]);
    return test_summary();
}
