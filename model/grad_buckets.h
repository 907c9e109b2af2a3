// model/grad_buckets.h: ZeRO-2's gradient segments and buckets, plain C, shared by model/gpu_model.cuh and
// tests/test_zero2.c (docs/MODEL.md#multi-gpu).
//
// With sharded gradients a rank keeps only its shard of the summed fp32 gradient (core/shard.h). The flat parameter
// array is cut into segments in table order (model_build): the token embedding, each block's tensors (contiguous), and
// the final norm with the LM head. The backward completes them in reverse: the head segment (a tied LM head's gradient
// is the embedding's), blocks L-1 .. 0, then the embedding. It computes each segment into a bucket zeroed before, and
// once the segment is complete the bucket is summed over ranks into the owners' shards (core/dist.cuh
// dist_reduce_add). Blocks alternate between two buckets, so one block's reduction can run beside the next block's
// backward; each bucket is sized for the largest segment it takes. Alignment gaps between blocks lie in no segment:
// nothing writes their gradient, which stays zero.
#ifndef SDM_MODEL_GRAD_BUCKETS_H
#define SDM_MODEL_GRAD_BUCKETS_H

#include "model/model.h"

enum { GB_EVEN, GB_ODD, GB_EMBEDDING, GB_HEAD, GB_BUCKETS }; // blocks of even and odd index, the two outer segments

typedef struct { long long lo, hi; int bucket; } GradSegment; // the flat range [lo, hi), from element 0 of its bucket

typedef struct {
    int n;                               // segments: L + 2
    GradSegment seg[CFG_MAX_LAYERS + 2]; // table order: the embedding, block l at l + 1, the head at n - 1
    long long floats[GB_BUCKETS];        // each bucket's size: its largest segment
} GradBuckets;

// The segment of tensor p.
static inline int grad_segment_of(const GradBuckets *gb, const ParamSpec *p) {
    return p->layer >= 0 ? p->layer + 1 : p->offset < gb->seg[1].lo ? 0 : gb->n - 1;
}

// The segments of model m: each block from its first tensor's start to its last one's end, the embedding before,
// the head after from the next multiple of MODEL_ALIGN. Each segment starts at such a multiple, so a tensor has in
// its bucket the alignment it has in the flat array (vector loads, cuBLASLt). Dies unless every tensor lies in its
// segment and the segments follow each other.
static inline void grad_buckets_plan(GradBuckets *gb, const ModelDesc *m) {
    int L = m->n_layers;
    memset(gb, 0, sizeof *gb);
    gb->n = L + 2;
    for (int l = 0; l < L; l++) {
        GradSegment s = {m->storage, 0, l % 2 ? GB_ODD : GB_EVEN};
        gb->seg[l + 1] = s;
    }
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        if (p->layer < 0) continue;
        GradSegment *s = &gb->seg[p->layer + 1];
        s->lo = SDM_MIN(s->lo, p->offset);
        s->hi = SDM_MAX(s->hi, p->offset + p->numel);
    }
    long long head_lo = (gb->seg[L].hi + MODEL_ALIGN - 1) / MODEL_ALIGN * MODEL_ALIGN;
    GradSegment embedding = {0, gb->seg[1].lo, GB_EMBEDDING}, head = {head_lo, m->storage, GB_HEAD};
    gb->seg[0] = embedding;
    gb->seg[L + 1] = head;
    for (int i = 0; i < m->n_params; i++) {
        const ParamSpec *p = &m->params[i];
        const GradSegment *s = &gb->seg[grad_segment_of(gb, p)];
        if (p->offset < s->lo || p->offset + p->numel > s->hi)
            sdm_die("internal: tensor %s lies outside its gradient segment [%lld, %lld)", p->name, s->lo, s->hi);
    }
    for (int k = 0; k < gb->n; k++) {
        if (k > 0 && gb->seg[k].lo < gb->seg[k - 1].hi) sdm_die("internal: gradient segment %d overlaps the last", k);
        gb->floats[gb->seg[k].bucket] = SDM_MAX(gb->floats[gb->seg[k].bucket], gb->seg[k].hi - gb->seg[k].lo);
    }
}

#endif
