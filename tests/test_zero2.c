// tests/test_zero2.c: ZeRO-2's gradient reduction on the CPU with the loopback communicator (core/loopback.h), laid
// out as model/gpu_model.cuh lays it out: each rank keeps only its shard of the summed gradient; per micro-batch the
// backward computes the segments of model/grad_buckets.h (head, blocks L-1 .. 0, embedding) one after another, each
// into its bucket zeroed first, and sums each over ranks into the owners' shards as soon as it is complete
// (loop_reduce_add, dist_reduce_add's twin). At world sizes 2, 3 and 4, over toy models whose blocks of different
// sizes cross one or several shard boundaries, with uneven, padded and empty shards:
//   - one micro-batch per rank (grad_acc_steps 1): every rank's shard is bitwise that of the whole gradient world 1
//     accumulates from the same W micro-batches in rank order, padding and alignment gaps zero. The rest of the step
//     (the shard's norm, clip, AdamW, all-gather) is ZeRO-1's, which tests/test_zero1.c checks to be world 1's bitwise
//     from shards of these same bits; so the whole step is world 1's.
//   - grad_acc_steps 2: the shard is Σ_k fl(Σ_r g[k][r]), micro-batch k summed over the ranks r in rank order, then
//     accumulated over k: checked bitwise (a deterministic function of the micro-batches). It is not world 1's
//     sequential sum of the 2W micro-batches, which groups the terms otherwise; both are fp32 sums of the same M = 2W
//     terms, each within γ(M-1)·Σ|g| of the exact sum (γ(k) = k·u / (1 - k·u), u = 2^-24: the bound for any order of
//     summation), so they differ by at most 2·γ(M-1)·Σ|g| per element, as checked.
// Also: segments start aligned, consecutive blocks alternate buckets, each bucket is as large as its largest segment,
// and the pieces dist_reduce_add walks (one ncclReduce per owner) are exactly each owner's part of a segment
// (shard_overlap).
#include <float.h>
#include <pthread.h>

#include "core/loopback.h"
#include "core/rng.h"
#include "model/grad_buckets.h"
#include "tests/test.h"

#define MAX_WORLD 4
#define MAX_ACC 2

typedef struct {
    const ModelDesc *md;
    const GradBuckets *gb;
    int world, acc;                        // ranks, micro-batches per rank
    const float *grads[MAX_ACC][MAX_WORLD]; // micro-batch k of rank r: its gradient [n], zero in the alignment gaps
} Problem;

typedef struct {
    const Problem *pb;
    LoopComm comm;
    float *shard;              // [shard] this rank's shard of the summed gradient
    float *bucket[GB_BUCKETS]; // [gb->floats[b]]
} RankState;

// One micro-batch's backward on this rank with sharded gradients (gpu_model_backward): segment by segment in the
// backward's order, the segment's tensors' gradients accumulated into its zeroed bucket, then the bucket reduced.
static void backward(RankState *st, const float *g) {
    const ModelDesc *md = st->pb->md;
    const GradBuckets *gb = st->pb->gb;
    for (int s = gb->n - 1; s >= 0; s--) {
        const GradSegment *seg = &gb->seg[s];
        float *bucket = st->bucket[seg->bucket];
        memset(bucket, 0, sizeof(float) * (size_t)(seg->hi - seg->lo));
        for (int t = 0; t < md->n_params; t++) {
            const ParamSpec *p = &md->params[t];
            if (grad_segment_of(gb, p) != s) continue;
            for (long long i = p->offset; i < p->offset + p->numel; i++) bucket[i - seg->lo] += g[i];
        }
        loop_reduce_add(&st->comm, bucket, seg->lo, seg->hi, st->shard);
    }
}

// train_step's gradient phase on this rank: the shard starts zero (run's calloc), then acc micro-batches.
static void *rank_main(void *arg) {
    RankState *st = (RankState *)arg;
    for (int k = 0; k < st->pb->acc; k++) backward(st, st->pb->grads[k][st->comm.rank]);
    return NULL;
}

// The W ranks of pb as threads; st[r] keeps rank r's shard and buckets.
static void run(const Problem *pb, RankState *st) {
    LoopGroup group;
    loop_group_init(&group, pb->world);
    pthread_t th[MAX_WORLD];
    for (int r = 0; r < pb->world; r++) {
        memset(&st[r], 0, sizeof st[r]);
        st[r].pb = pb;
        st[r].comm = loop_comm(&group, r, pb->md->storage);
        st[r].shard = (float *)sdm_calloc((size_t)st[r].comm.shard, sizeof(float));
        for (int b = 0; b < GB_BUCKETS; b++) st[r].bucket[b] = (float *)sdm_calloc((size_t)pb->gb->floats[b], 4);
        if (pthread_create(&th[r], NULL, rank_main, &st[r]) != 0) sdm_die("pthread_create failed");
    }
    for (int r = 0; r < pb->world; r++) pthread_join(th[r], NULL);
    loop_group_destroy(&group);
}

static void release(RankState *st, int world) {
    for (int r = 0; r < world; r++) {
        free(st[r].shard);
        for (int b = 0; b < GB_BUCKETS; b++) free(st[r].bucket[b]);
    }
}

// A toy model of exactly n parameters: an embedding tensor, blocks of 1 to 5 tensors, a head of one or two tensors.
// Tensors of 1 to n/8 elements, or for n >= 1000 also whole 64-element shard blocks (so that tensors and blocks
// start on shard boundaries too), with alignment gaps after odd sizes; the third tensor takes n/2 elements (as an SDM
// block's bank, it makes its block several times larger than the others, across several shards).
static void toy_model(ModelDesc *md, long long n, Rng *rng) {
    memset(md, 0, sizeof *md);
    long long most = n / 8;
    while (md->storage < n) {
        long long start = (md->storage + MODEL_ALIGN - 1) / MODEL_ALIGN * MODEL_ALIGN;
        long long numel = md->n_params == 2 ? n / 2
                        : n >= 1000 && rng_below(rng, 2) ? SHARD_ALIGN * (1 + rng_below(rng, 4))
                                                          : 1 + rng_below(rng, (uint32_t)most);
        model_add(md, -1, "t", start + numel + most < n ? numel : n - start, 0, INIT_ZEROS, 0, 0);
    }
    int last = md->n_params - 1 - (md->n_params > 5 && rng_below(rng, 2)), layer = 0, in_block = 0;
    if (last < 2) sdm_die("toy model of %lld parameters: only %d tensors", n, md->n_params);
    for (int i = 0; i < md->n_params; i++) {
        if (i == 0 || i >= last) { md->params[i].layer = -1; continue; }
        if (in_block == 5 || (in_block > 0 && rng_below(rng, 3) == 0)) layer++, in_block = 0;
        md->params[i].layer = layer;
        in_block++;
    }
    md->n_layers = layer + 1;
}

// The plan's segments that cross shard boundaries of world W: counts[0] += those crossing one, counts[1] += more.
static void count_crossings(const GradBuckets *gb, long long n, int world, int counts[2]) {
    long long shard = shard_size(n, world);
    for (int s = 0; s < gb->n; s++) {
        long long inside = (gb->seg[s].hi - 1) / shard - gb->seg[s].lo / shard;
        if (gb->seg[s].hi > gb->seg[s].lo && inside >= 1) counts[inside > 1]++;
    }
}

// The plan's own properties: segments start at multiples of MODEL_ALIGN, consecutive blocks use different buckets,
// each bucket's size is its largest segment, and dist_reduce_add's walk of a segment (shard_piece_at up to the
// segment's end) visits each owner once, in rank order, with exactly its part.
static void check_plan(const GradBuckets *gb, long long n, int world) {
    int bad = 0;
    long long most[GB_BUCKETS] = {0};
    for (int s = 0; s < gb->n; s++) {
        const GradSegment *seg = &gb->seg[s];
        most[seg->bucket] = SDM_MAX(most[seg->bucket], seg->hi - seg->lo);
        bad += seg->lo % MODEL_ALIGN != 0;
        if (s > 1 && s < gb->n - 1) bad += seg->bucket == gb->seg[s - 1].bucket;
        long long a = seg->lo;
        for (int q = 0; q < world; q++) {
            long long x, y;
            shard_overlap(n, world, q, seg->lo, seg->hi, &x, &y);
            if (x == y) continue;
            ShardPiece p = shard_piece_at(n, world, seg->hi - a, a);
            bad += p.lo != x || p.hi != y || p.owner != q;
            a = p.hi;
        }
        bad += a != seg->hi;
    }
    bad += memcmp(most, gb->floats, sizeof most) != 0;
    CHECK(bad == 0, "world %d, n %lld: %d faults in the gradient segments or their pieces", world, n, bad);
}

// World W with acc micro-batches per rank on a toy model of n parameters, against world 1's whole gradients.
static void test_world(int world, int acc, long long n, int crossings[2], int *reordered) {
    Rng rng = rng_make((uint64_t)(n * 64 + world * 4 + acc));
    ModelDesc *md = (ModelDesc *)sdm_malloc(sizeof(ModelDesc));
    toy_model(md, n, &rng);
    GradBuckets gb;
    grad_buckets_plan(&gb, md);
    check_plan(&gb, n, world);
    count_crossings(&gb, n, world, crossings);
    Problem pb = {md, &gb, world, acc, {{0}}};
    float *data = (float *)sdm_calloc((size_t)(n * acc * world), sizeof(float)); // the gaps stay zero
    for (int k = 0; k < acc; k++)
        for (int r = 0; r < world; r++) {
            float *g = data + n * (k * world + r);
            for (int t = 0; t < md->n_params; t++) // 1/W: the loss scale of train_step; varied exponents
                for (long long i = md->params[t].offset; i < md->params[t].offset + md->params[t].numel; i++)
                    g[i] = (float)(rng_normal(&rng) * exp(4.0 * rng_uniform(&rng) - 2.0)) / world;
            pb.grads[k][r] = g;
        }
    // world 1: the whole gradient accumulated micro-batch by micro-batch; and grouped as ZeRO-2 groups it
    long long padded = shard_padded(n, world);
    float *sequential = (float *)sdm_calloc((size_t)padded, sizeof(float));
    float *grouped = (float *)sdm_calloc((size_t)padded, sizeof(float));
    double *bound = (double *)sdm_calloc((size_t)n, sizeof(double));
    int m = acc * world;
    double gamma = (m - 1) * (FLT_EPSILON / 2) / (1 - (m - 1) * (FLT_EPSILON / 2));
    for (long long i = 0; i < n; i++)
        for (int k = 0; k < acc; k++) {
            float sum = pb.grads[k][0][i];
            for (int r = 0; r < world; r++) {
                sequential[i] += pb.grads[k][r][i];
                if (r > 0) sum += pb.grads[k][r][i];
                bound[i] += 2 * gamma * fabs(pb.grads[k][r][i]);
            }
            grouped[i] += sum;
        }
    RankState st[MAX_WORLD];
    run(&pb, st);
    long long shard = st[0].comm.shard;
    int same = 1, within = 1;
    for (int r = 0; r < world; r++) {
        const float *want = (acc == 1 ? sequential : grouped) + r * shard;
        same &= !memcmp(st[r].shard, want, sizeof(float) * (size_t)shard);
        for (long long i = r * shard; i < SDM_MIN(n, (r + 1) * shard); i++) {
            within &= fabs((double)st[r].shard[i - r * shard] - sequential[i]) <= bound[i];
            *reordered += st[r].shard[i - r * shard] != sequential[i];
        }
    }
    CHECK(same, "world %d, acc %d, n %lld, %d blocks: the shards differ from world 1's %s sums", world, acc, n,
          md->n_layers, acc == 1 ? "sequential" : "grouped");
    CHECK(within, "world %d, acc %d, n %lld: a shard is further from world 1's sequential sum than 2·γ(%d)·Σ|g|",
          world, acc, n, m - 1);
    release(st, world);
    free(sequential);
    free(grouped);
    free(bound);
    free(data);
    free(md);
}

int main(void) {
    // 130 at world 4: an empty last shard; 4099: a padded last shard; 64 x 40: shards that end exactly at n
    const long long sizes[] = {130, 700, 4099, 64 * 40};
    int crossings[2] = {0, 0}, reordered = 0;
    for (int world = 2; world <= MAX_WORLD; world++)
        for (int acc = 1; acc <= MAX_ACC; acc++)
            for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) test_world(world, acc, sizes[i], crossings,
                                                                                 &reordered);
    CHECK(crossings[0] && crossings[1], "the toy models should have segments crossing one shard boundary (%d) and "
          "several (%d)", crossings[0], crossings[1]);
    CHECK(reordered > 0, "grad_acc_steps 2 should group some sum differently from world 1's sequential order");
    return test_summary();
}
