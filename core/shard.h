// core/shard.h: the ZeRO shard arithmetic, plain C, shared by the NCCL communicator (core/dist.cuh), the loopback
// communicator (core/loopback.h), the GPU buffers (model/gpu_model.cuh) and train_sdm's checkpoint gather, so the
// CPU tests exercise the production layout.
//
// The flat parameter array of n elements is padded to world * shard elements; rank r owns [r*shard, (r+1)*shard) ∩
// [0, n) (possibly empty for the last ranks of a tiny model). shard = ceil(n / world) rounded up to SHARD_ALIGN
// elements, so every shard starts on a 256-byte boundary in fp32 (NCCL and vector loads like that), and the grid of
// SHARD_ALIGN-element blocks is the same at every world size: a reduction done per block and then over the blocks in
// order (shard_block_sumsq) gives the same bits whatever the number of ranks.
#ifndef SDM_CORE_SHARD_H
#define SDM_CORE_SHARD_H

#define SHARD_ALIGN 64LL

static inline long long shard_size(long long n, int world) {
    long long s = (n + world - 1) / world;
    return (s + SHARD_ALIGN - 1) / SHARD_ALIGN * SHARD_ALIGN;
}

static inline long long shard_padded(long long n, int world) { return shard_size(n, world) * world; }

// The elements [*lo, *hi) of the n real parameters that `rank` owns (lo == hi: none).
static inline void shard_range(long long n, int world, int rank, long long *lo, long long *hi) {
    long long s = shard_size(n, world);
    *lo = (long long)rank * s;
    *hi = *lo + s < n ? *lo + s : n;
    if (*hi < *lo) *hi = *lo;
}

// Piece by piece through a bounded buffer (a checkpoint's gather to rank 0): the element range [lo, hi) of the flat
// array, inside the shard of rank `owner`, where it starts at element `at` of that rank's shard-sized arrays.
typedef struct { long long lo, hi, at; int owner; } ShardPiece;

// The piece of [0, n) that starts at element lo (< n): at most `piece` elements, never crossing into the next shard.
// The walk over the whole array: lo = 0, then lo = p.hi while lo < n.
static inline ShardPiece shard_piece_at(long long n, int world, long long piece, long long lo) {
    long long s = shard_size(n, world), end = (lo / s + 1) * s, hi = lo + piece < end ? lo + piece : end;
    ShardPiece p = {lo, hi < n ? hi : n, lo % s, (int)(lo / s)};
    return p;
}

// The part [*a, *b) of the flat range [lo, hi) that `rank` owns (*a == *b: none), e.g. the piece of a ZeRO-2
// gradient bucket that is summed into this rank's shard. One interval: a shard is contiguous.
static inline void shard_overlap(long long n, int world, int rank, long long lo, long long hi, long long *a,
                                 long long *b) {
    long long own_lo, own_hi;
    shard_range(n, world, rank, &own_lo, &own_hi);
    *a = lo > own_lo ? lo : own_lo;
    *b = hi < own_hi ? hi : own_hi;
    if (*b < *a) *b = *a;
}

// partial[b] = Σ g[i]² over block b = [b*SHARD_ALIGN, (b+1)*SHARD_ALIGN) of g[0..n) (elements beyond n count as 0),
// summed in index order in fp32, for the blocks b in [b0, b1). The blocks of a shard are those of its range.
static inline void shard_block_sumsq(float *partial, const float *g, long long n, long long b0, long long b1) {
    for (long long b = b0; b < b1; b++) {
        float acc = 0.0f;
        for (long long i = b * SHARD_ALIGN; i < (b + 1) * SHARD_ALIGN && i < n; i++) acc += g[i] * g[i];
        partial[b] = acc;
    }
}

#endif
