// core/dist.cuh: data parallelism over GPUs and nodes with NCCL, ZeRO-1 style.
//
// Every rank holds the full bf16/fp32 working weights and computes full fp32 gradients on its slice of the batch.
// Gradients are reduce-scattered (sum, then scaled by 1/world) so that rank r owns the contiguous shard
// [r*shard, (r+1)*shard) of the flat parameter array (padded to world*shard); AdamW updates that shard of the fp32
// master weights and of m, v; an all-gather brings the updated weights back to every rank. NCCL's ring reductions
// are deterministic for a fixed number of ranks, so runs are bitwise repeatable at a given world size.
// Built without NCCL (SDM_HAVE_NCCL undefined) only world = 1 is accepted.
#ifndef SDM_CORE_DIST_CUH
#define SDM_CORE_DIST_CUH

#include "core/bootstrap.h"
#include "core/cuda_common.cuh"

#ifdef SDM_HAVE_NCCL
#include <nccl.h>
#define ncclCheck(call)                                                                                              \
    do {                                                                                                             \
        ncclResult_t r_ = (call);                                                                                    \
        if (r_ != ncclSuccess) sdm_die("NCCL error at %s:%d: %s", __FILE__, __LINE__, ncclGetErrorString(r_));       \
    } while (0)
#endif

typedef struct {
    int rank, world, local_rank;
    long long n, shard;  // parameters, and the per-rank shard (world * shard >= n)
#ifdef SDM_HAVE_NCCL
    ncclComm_t comm;
#endif
} Dist;

// Join the run: pick this process's GPU (local_rank), exchange the NCCL id, create the communicator.
static inline void dist_init(Dist *d, const BootConfig *boot, long long n_params) {
    char err[BOOT_ERR];
    if (!boot_check(boot, err)) sdm_die("%s", err);
    memset(d, 0, sizeof *d);
    d->rank = boot->rank;
    d->world = boot->world;
    d->local_rank = boot->local_rank;
    d->n = n_params;
    d->shard = (n_params + d->world - 1) / d->world;
    int devices = 0;
    cudaCheck(cudaGetDeviceCount(&devices));
    if (d->local_rank >= devices) sdm_die("local rank %d but only %d GPUs are visible", d->local_rank, devices);
    cudaCheck(cudaSetDevice(d->local_rank));
#ifdef SDM_HAVE_NCCL
    ncclUniqueId id;
    if (d->rank == 0) ncclCheck(ncclGetUniqueId(&id));
    if (!boot_exchange_id(boot, (unsigned char *)&id, err)) sdm_die("%s", err);
    ncclCheck(ncclCommInitRank(&d->comm, d->world, id, d->rank));
#else
    if (d->world > 1) sdm_die("built without NCCL: only single-process runs (world size %d requested)", d->world);
#endif
}

static inline void dist_destroy(Dist *d) {
#ifdef SDM_HAVE_NCCL
    ncclCheck(ncclCommDestroy(d->comm));
#endif
    (void)d;
}

// grads: fp32 [world * shard] (the padding is zero). Afterwards grads[rank*shard ...] holds the sum over ranks.
static inline void dist_reduce_scatter_grads(Dist *d, float *grads, cudaStream_t stream) {
#ifdef SDM_HAVE_NCCL
    if (d->world > 1)
        ncclCheck(ncclReduceScatter(grads, grads + d->rank * d->shard, (size_t)d->shard, ncclFloat, ncclSum, d->comm,
                                    stream));
#endif
    (void)d, (void)grads, (void)stream;
}

// params: [world * shard]; each rank contributes its shard, all receive every shard. elem: ncclFloat/ncclBfloat16
// equivalents are chosen by the element size (4 or 2 bytes).
static inline void dist_all_gather(Dist *d, void *params, size_t elem_bytes, cudaStream_t stream) {
#ifdef SDM_HAVE_NCCL
    if (d->world > 1) {
        ncclDataType_t t = elem_bytes == 4 ? ncclFloat : ncclBfloat16;
        char *base = (char *)params;
        ncclCheck(ncclAllGather(base + d->rank * d->shard * elem_bytes, base, (size_t)d->shard, t, d->comm, stream));
    }
#endif
    (void)d, (void)params, (void)elem_bytes, (void)stream;
}

// Sum n floats over ranks in place (e.g. squared gradient norms, loss sums).
static inline void dist_all_reduce_sum(Dist *d, float *x, size_t n, cudaStream_t stream) {
#ifdef SDM_HAVE_NCCL
    if (d->world > 1) ncclCheck(ncclAllReduce(x, x, n, ncclFloat, ncclSum, d->comm, stream));
#endif
    (void)d, (void)x, (void)n, (void)stream;
}

#endif
