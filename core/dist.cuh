// core/dist.cuh: data parallelism over GPUs and nodes with NCCL, ZeRO-2 style (or ZeRO-1).
//
// Every rank holds the full bf16/fp32 working weights and computes fp32 gradients on its slice of the batch, already
// scaled by 1/world through the loss scale. Rank r owns the shard of core/shard.h (the flat parameter array padded to
// world * shard): it holds the fp32 master weights and AdamW m, v of that shard only (model/adamw.cuh) and updates
// them; an all-gather brings the updated weights back to every rank. The gradients reach the owners in one of two
// ways. ZeRO-2 (distributed.fsdp_type = full_shard): a rank keeps only its shard of the summed gradient; the backward
// computes each block's gradients into a bucket and, as soon as the block is done, dist_reduce_add sums the bucket
// over ranks into the owners' shards (model/grad_buckets.h). ZeRO-1 (no_shard): every rank computes whole gradients,
// reduce-scattered once per step. A checkpoint gathers the shards to rank 0 piece by piece with broadcasts
// (train_sdm.cu). core/loopback.h has the same collectives for threads of one process, so tests/test_zero1.c and
// tests/test_zero2.c check this arithmetic on the CPU.
//
// Reproducibility: NCCL's reductions are deterministic for a fixed world size and topology, so runs are bitwise
// repeatable at a given world size. Across world sizes they are not bitwise equal: with 2 ranks a + b is the
// sequential sum, but for > 2 ranks the ring adds the ranks' gradients in an order that depends on the chunk, so each
// summed gradient differs from the sequential sum of tests/test_zero1.c by at most (world-1)·2^-24·Σ|g_r| (the
// standard bound of a sum of world terms in fp32), which AdamW turns into weight differences of the same relative
// order. With grad_acc_steps > 1 the two modes also group the terms differently (ZeRO-1 sums each rank's micro-batches
// first, ZeRO-2 each micro-batch's ranks): tests/test_zero2.c states the bound. In bf16 mode the working copy is the
// bf16 rounding of the fp32 master, so it may differ by one bf16 ulp (2^-8 relative) where the masters differ at all.
// Built without NCCL (SDM_HAVE_NCCL undefined) only world = 1 is accepted, and every collective is a no-op.
//
// A dead peer: NCCL waits without a timeout, so with several ranks a watchdog thread (core/watchdog.h) watches the
// run. Every collective call and every finished step (dist_progress) is progress: a rank that has not reached its next
// collective for distributed.timeout seconds is stuck waiting on a peer, and a communicator whose asynchronous error
// is set (NCCL saw a peer's connection drop) is broken. Either way the watchdog prints why, aborts the communicator
// and exits with status 1; the checkpoints written are whole (model/checkpoint.h renames a finished save into place).
#ifndef SDM_CORE_DIST_CUH
#define SDM_CORE_DIST_CUH

#include "core/bootstrap.h"
#include "core/cuda_common.cuh"
#include "core/shard.h"
#include "core/watchdog.h"

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
    long long n, shard; // parameters, and the per-rank shard: shard_size(n, world)
    Watchdog watch; // running only with several ranks
#ifdef SDM_HAVE_NCCL
    ncclComm_t comm;
    int comm_ready; // set (atomically) once comm exists: the watchdog runs from before its creation
    char watch_error[WATCH_MSG];
#endif
} Dist;

// The layout of rank `rank` of `world` over n parameters, without a communicator: all a dry run of the ledger needs.
static inline Dist dist_layout(int rank, int world, long long n_params) {
    Dist d;
    memset(&d, 0, sizeof d);
    d.rank = rank;
    d.world = world;
    d.n = n_params;
    d.shard = shard_size(n_params, world);
    return d;
}

// Progress for the watchdog: what (a static string; NULL keeps the last one) number at is done.
static inline void dist_progress(Dist *d, const char *what, long long at) { watchdog_beat(&d->watch, what, at); }

#ifdef SDM_HAVE_NCCL
// The watchdog's poll: the communicator's asynchronous error, NULL while there is none.
static const char *dist_watch_poll(void *ctx) {
    Dist *d = (Dist *)ctx;
    ncclResult_t e = ncclSuccess;
    if (!__atomic_load_n(&d->comm_ready, __ATOMIC_ACQUIRE)) return NULL;
    if (ncclCommGetAsyncError(d->comm, &e) != ncclSuccess || e == ncclSuccess || e == ncclInProgress) return NULL;
    snprintf(d->watch_error, WATCH_MSG, "NCCL error: %s (%s)", ncclGetErrorString(e), ncclGetLastError(d->comm));
    return d->watch_error;
}

// The watchdog's fire: say why, abort the communicator (which ends this rank's waiting NCCL kernels), exit 1. The
// alarm ends the process (SIGALRM's default action) should the abort itself hang; stdout is flushed unless the main
// thread holds it.
static void dist_watch_fire(void *ctx, const char *why) {
    Dist *d = (Dist *)ctx;
    fprintf(stderr, "sdm: rank %d of %d: %s; a peer rank has probably died or hung. Aborting NCCL and exiting; the "
            "checkpoints written so far are intact (distributed.timeout sets the time limit)\n", d->rank, d->world, why);
    if (!ftrylockfile(stdout)) {
        fflush(stdout);
        funlockfile(stdout);
    }
    alarm(60);
    if (__atomic_load_n(&d->comm_ready, __ATOMIC_ACQUIRE)) ncclCommAbort(d->comm);
    _exit(1);
}
#endif

// Join the run: pick this process's GPU (local_rank), exchange the NCCL id, create the communicator, and with several
// ranks start the watchdog (timeout_s: distributed.timeout, 0: only NCCL's errors end the run). The init file (if
// any) is removed by boot_exchange_id once every rank has read it. The ledger (core/memory.h) gets the device memory
// the CUDA context and the communicator take, which no device_alloc sees.
static inline void dist_init(Dist *d, const BootConfig *boot, long long n_params, double timeout_s) {
    char err[BOOT_ERR];
    if (!boot_check(boot, err)) sdm_die("%s", err);
    *d = dist_layout(boot->rank, boot->world, n_params);
    d->local_rank = boot->local_rank;
    int devices = 0;
    cudaCheck(cudaGetDeviceCount(&devices));
    int device = boot_device(d->local_rank, devices, getenv("CUDA_VISIBLE_DEVICES"), err);
    if (device < 0) sdm_die("%s", err);
    cudaCheck(cudaSetDevice(device));
    size_t context = device_used_bytes(); // the first runtime call on the device: the context exists after it
    mem_record(MEM_CONTEXT, context);
#ifdef SDM_HAVE_NCCL
    ncclUniqueId id;
    if (d->rank == 0 && d->world > 1) ncclCheck(ncclGetUniqueId(&id));
    if (!boot_exchange_id(boot, (unsigned char *)&id, err)) sdm_die("%s", err);
    if (d->world > 1) { // the watchdog also ends a creation that waits for a peer which died since the id exchange
        watchdog_start(&d->watch, timeout_s, 1.0, dist_watch_poll, dist_watch_fire, d, "the NCCL id exchange");
        ncclCheck(ncclCommInitRank(&d->comm, d->world, id, d->rank));
        __atomic_store_n(&d->comm_ready, 1, __ATOMIC_RELEASE);
        dist_progress(d, "the communicator's creation", -1);
    }
    size_t with_comm = device_used_bytes();
    mem_record(MEM_NCCL, with_comm > context ? with_comm - context : 0);
#else
    (void)timeout_s;
    if (d->world > 1)
        sdm_die("built without NCCL: only single-process runs (world size %d requested); rebuild where NCCL is "
                "installed (make prints 'NCCL <version>: multi-GPU', or set NCCL_HOME)", d->world);
#endif
}

static inline void dist_destroy(Dist *d) {
    watchdog_stop(&d->watch);
#ifdef SDM_HAVE_NCCL
    if (d->world > 1) ncclCheck(ncclCommDestroy(d->comm));
#endif
    (void)d;
}

// grads: fp32 [world * shard] (the padding is zero). Afterwards grads[rank*shard ...] holds the sum over ranks
// (NCCL's in-place form: the received chunk is the rank's own chunk of the send buffer).
static inline void dist_reduce_scatter_grads(Dist *d, float *grads, cudaStream_t stream) {
    dist_progress(d, NULL, 0);
#ifdef SDM_HAVE_NCCL
    if (d->world > 1)
        ncclCheck(ncclReduceScatter(grads, grads + d->rank * d->shard, (size_t)d->shard, ncclFloat, ncclSum, d->comm,
                                    stream));
#endif
    (void)d, (void)grads, (void)stream;
}

// y[i] += x[i], i < n: an owner's part of a reduced bucket into its gradient shard.
__global__ void dist_add_kernel(float *y, const float *x, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] += x[i];
}

// ZeRO-2: bucket[hi - lo] holds this rank's gradient of the flat range [lo, hi) (hi <= n); the sum over ranks of the
// part each rank owns is added to that rank's shard ([shard], element 0 = flat element rank*shard). One ncclReduce
// per owner's piece (the range may cross several shards), grouped, each in place into the owner's bucket (the other
// ranks' buckets keep their values); then the owner adds its piece, so micro-batches accumulate in the shard.
// core/loopback.h loop_reduce_add is the same on the CPU.
static inline void dist_reduce_add(Dist *d, float *bucket, long long lo, long long hi, float *shard,
                                   cudaStream_t stream) {
    dist_progress(d, NULL, 0);
#ifdef SDM_HAVE_NCCL
    if (d->world > 1) {
        ncclCheck(ncclGroupStart());
        ShardPiece p;
        for (long long a = lo; a < hi; a = p.hi) {
            p = shard_piece_at(d->n, d->world, hi - a, a); // [a, the end of a's shard or hi)
            float *piece = bucket + (p.lo - lo);
            ncclCheck(ncclReduce(piece, piece, (size_t)(p.hi - p.lo), ncclFloat, ncclSum, p.owner, d->comm, stream));
        }
        ncclCheck(ncclGroupEnd());
    }
#endif
    long long a, b;
    shard_overlap(d->n, d->world, d->rank, lo, hi, &a, &b);
    if (b == a) return;
    int blocks = (int)SDM_MIN(65536LL, (b - a + 255) / 256);
    dist_add_kernel<<<blocks, 256, 0, stream>>>(shard + (a - d->rank * d->shard), bucket + (a - lo), b - a);
    cudaCheckLast();
}

// params: [world * shard] elements of elem_bytes (4: fp32, 2: bf16); each rank contributes its shard, all receive
// every shard.
static inline void dist_all_gather(Dist *d, void *params, size_t elem_bytes, cudaStream_t stream) {
    dist_progress(d, NULL, 0);
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
    dist_progress(d, NULL, 0);
#ifdef SDM_HAVE_NCCL
    if (d->world > 1) ncclCheck(ncclAllReduce(x, x, n, ncclFloat, ncclSum, d->comm, stream));
#endif
    (void)d, (void)x, (void)n, (void)stream;
}

// buf[bytes] (device) of rank `root` to every rank, e.g. the checkpoint rank 0 picked on resume.
static inline void dist_broadcast(Dist *d, void *buf, size_t bytes, int root, cudaStream_t stream) {
    dist_progress(d, NULL, 0);
#ifdef SDM_HAVE_NCCL
    if (d->world > 1) ncclCheck(ncclBroadcast(buf, buf, bytes, ncclUint8, root, d->comm, stream));
#endif
    (void)d, (void)buf, (void)bytes, (void)root, (void)stream;
}

// dist_broadcast of a host buffer (small things: a step number, a loader state), through a temporary device copy;
// returns when buf holds root's bytes.
static inline void dist_broadcast_host(Dist *d, void *buf, size_t bytes, int root) {
    if (d->world == 1 || bytes == 0) return;
    void *dev = device_alloc(MEM_NCCL, bytes);
    cudaCheck(cudaMemcpy(dev, buf, bytes, cudaMemcpyHostToDevice));
    dist_broadcast(d, dev, bytes, root, 0);
    cudaCheck(cudaMemcpy(buf, dev, bytes, cudaMemcpyDeviceToHost)); // legacy default stream: waits for the broadcast
    device_free(dev);
}

#endif
