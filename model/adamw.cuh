// model/adamw.cuh: the optimiser step on the GPU (docs/MODEL.md#optimizer): global gradient L2 norm and clip scale
// (deterministic two-pass reduction), and AdamW on the fp32 master weights that also writes the working copy
// (bf16, or fp32 in the all-fp32 mode), its moments m, v stored in fp32 or bf16 (optim.moment_dtype); the state
// they work on (AdamWState). The schedule and the per-step coefficients are host code in core/optim.h; the kernels
// read the coefficients from device memory (AdamWState.coeffs), so a step captured in a CUDA graph takes each step's
// values from a copy made before or inside each replay, with no new kernel arguments. With ZeRO-1 each rank calls
// adamw_grad_sumsq on its gradient shard, all-reduces the one float, then adamw_clip_scale.
#ifndef SDM_MODEL_ADAMW_CUH
#define SDM_MODEL_ADAMW_CUH

#include "core/cuda_common.cuh"
#include "model/model.h"
#include "core/optim.h"

// ------------------------------------------------------------------------------------------------------------------
// Global gradient norm

#define ADAMW_NORM_THREADS 256
// floats of scratch adamw_grad_sumsq needs: one partial per block, at most this many blocks
#define ADAMW_NORM_SCRATCH 1024

// Block b sums the squares of its contiguous chunk [b·chunk, (b+1)·chunk): thread t takes every 256th element from
// chunk start + t, then the fixed block tree. partial[b] = the block's sum.
__global__ void adamw_grad_sumsq_partial_kernel(float *partial, const float *g, long long n, long long chunk) {
    __shared__ float scratch[32];
    long long start = (long long)blockIdx.x * chunk, end = start + chunk < n ? start + chunk : n;
    float acc = 0.0f;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) acc += g[i] * g[i];
    acc = core_block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// One block of ADAMW_NORM_SCRATCH threads: thread t holds partial t (or 0), then the fixed block tree.
__global__ void adamw_grad_sumsq_finish_kernel(float *sumsq, const float *partial, int blocks) {
    __shared__ float scratch[32];
    float acc = core_block_sum(threadIdx.x < blocks ? partial[threadIdx.x] : 0.0f, scratch);
    if (threadIdx.x == 0) *sumsq = acc;
}

// *sumsq (device) = Σ g[i]² over g[n] (fp32), bitwise reproducible for a given n; scratch: ADAMW_NORM_SCRATCH floats.
static inline void adamw_grad_sumsq(float *sumsq, float *scratch, const float *g, long long n, cudaStream_t s) {
    long long per_block = 8LL * ADAMW_NORM_THREADS; // at least this many elements per block before adding blocks
    int blocks = (int)SDM_MAX(1LL, SDM_MIN((long long)ADAMW_NORM_SCRATCH, (n + per_block - 1) / per_block));
    long long chunk = (n + blocks - 1) / blocks;
    adamw_grad_sumsq_partial_kernel<<<blocks, ADAMW_NORM_THREADS, 0, s>>>(scratch, g, n, chunk);
    cudaCheckLast();
    adamw_grad_sumsq_finish_kernel<<<1, ADAMW_NORM_SCRATCH, 0, s>>>(sumsq, scratch, blocks);
    cudaCheckLast();
}

__global__ void adamw_clip_scale_kernel(float *norm, float *scale, const float *sumsq, float clip) {
    float nrm = sqrtf(*sumsq);
    *norm = nrm;
    *scale = clip_scale(nrm, clip);
}

// *norm = sqrt(*sumsq), *scale = min(1, clip / (norm + 1e-6)) (1 when clip <= 0); all device floats. The scale stays
// on the device and is applied inside adamw_update, so the step needs no host synchronisation.
static inline void adamw_clip_scale(float *norm, float *scale, const float *sumsq, float clip, cudaStream_t s) {
    adamw_clip_scale_kernel<<<1, 1, 0, s>>>(norm, scale, sumsq, clip);
    cudaCheckLast();
}

// ------------------------------------------------------------------------------------------------------------------
// The optimizer's state, owned by the training program: the fp32 master weights and AdamW moments of this rank's
// ZeRO-1 shard of the model's flat parameter array (core/shard.h; one rank: the whole padded array), the device
// scalars of the gradient clip and the step's coefficients. Element i of master, m, v is element rank * shard + i of
// the flat array.

// A step's coefficients by weight-decay flag: [0] for tensors without decay, [1] with (adamw_coeffs_fill).
#define ADAMW_COEFF_SETS 2

typedef struct {
    long long n;                 // the shard's length: shard_size(storage, world)
    float *master;               // fp32 [n]
    void *m, *v;                 // [n] of moment_type
    Dtype moment_type;           // fp32, or bf16 (optim.moment_dtype): half the bytes
    float *sumsq, *norm, *scale; // device scalars: sum of squared gradients, their global L2 norm, the clip scale
    float *scratch;              // [ADAMW_NORM_SCRATCH] adamw_grad_sumsq's partials
    AdamWCoeffs *coeffs;         // device [ADAMW_COEFF_SETS]: the coefficients adamw_update_model applies
} AdamWState;

// n zero elements of type t in the ledger's category kind (core/memory.h); a dry run records the size only.
static inline void *adamw_zeros(MemKind kind, long long n, Dtype t) {
    void *p = device_alloc(kind, dtype_size(t) * n);
    device_zero(p, dtype_size(t) * n);
    return p;
}

static inline void adamw_state_create(AdamWState *o, long long n, Dtype moment_type) {
    o->n = n;
    o->master = (float *)adamw_zeros(MEM_MASTER, n, DT_FP32);
    o->m = adamw_zeros(MEM_ADAMW, n, moment_type);
    o->v = adamw_zeros(MEM_ADAMW, n, moment_type);
    o->moment_type = moment_type;
    o->sumsq = (float *)adamw_zeros(MEM_SCRATCH, 1, DT_FP32);
    o->norm = (float *)adamw_zeros(MEM_SCRATCH, 1, DT_FP32);
    o->scale = (float *)adamw_zeros(MEM_SCRATCH, 1, DT_FP32);
    o->scratch = (float *)adamw_zeros(MEM_SCRATCH, ADAMW_NORM_SCRATCH, DT_FP32);
    o->coeffs = (AdamWCoeffs *)device_alloc(MEM_SCRATCH, ADAMW_COEFF_SETS * sizeof(AdamWCoeffs));
}

static inline void adamw_state_destroy(AdamWState *o) {
    void *bufs[] = {o->master, o->m, o->v, o->sumsq, o->norm, o->scale, o->scratch, o->coeffs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) device_free(bufs[i]);
    memset(o, 0, sizeof *o);
}

// host[ADAMW_COEFF_SETS] = the coefficients of the update with hyper-parameters h, by weight-decay flag: computed
// on the host in double and rounded once, so every way they reach the kernels gives the same floats.
static inline void adamw_coeffs_fill(AdamWCoeffs *host, const AdamWHyper *h) {
    for (int decay = 0; decay < ADAMW_COEFF_SETS; decay++) host[decay] = adamw_coeffs(h, decay);
}

// The coefficients of the next adamw_update_model from host[ADAMW_COEFF_SETS] (adamw_coeffs_fill), copied on stream
// s: from pinned memory, a captured step reads the values written there before each replay.
static inline void adamw_load_coeffs(AdamWState *o, const AdamWCoeffs *host, cudaStream_t s) {
    cudaCheck(cudaMemcpyAsync(o->coeffs, host, ADAMW_COEFF_SETS * sizeof(AdamWCoeffs), cudaMemcpyHostToDevice, s));
}

// ------------------------------------------------------------------------------------------------------------------
// AdamW

// The update of elements i .. i + W - 1, every array read and written in one access of W elements (W = 4: vectors;
// W = 1: one element): p, m, v as the pointers hold them, work (may be NULL) = p after it.
template <int W, typename T, typename M>
__device__ __forceinline__ void adamw_elements(float *p, T *work, const float *g, M *m, M *v, long long i,
                                               AdamWCoeffs c, float gs) {
    typedef DtypePack<float, W> FP;
    typedef DtypePack<M, W> MP;
    typedef DtypePack<T, W> TP;
    FP pv = dtype_pack_load<FP>(p + i), gv = dtype_pack_load<FP>(g + i);
    MP mv = dtype_pack_load<MP>(m + i), vv = dtype_pack_load<MP>(v + i);
    TP wv;
#pragma unroll
    for (int e = 0; e < W; e++) {
        float pi = pv.e[e], mi = mv.get(e), vi = vv.get(e);
        adamw_element(&pi, &mi, &vi, gv.e[e] * gs, c);
        mv.set(e, mi);
        vv.set(e, vi);
        pv.e[e] = pi;
        wv.set(e, pi);
    }
    dtype_pack_store(m + i, mv);
    dtype_pack_store(v + i, vv);
    dtype_pack_store(p + i, pv);
    if (work) dtype_pack_store(work + i, wv);
}

// Grid-stride over groups of 4 elements (q < n4: elements 4q..4q+3, each array read and written in one vector of 4),
// then over the elements past 4 n4 one by one: the update of core/optim.h's AdamWCoeffs with g scaled by *grad_scale,
// in fp32 on moments stored as M, each element the same expression whichever way it goes. With M = bf16 the moments
// are rounded to nearest even when stored; the update of p uses them before that rounding. bf16 keeps 8 significant
// bits and fp32's exponent range: v stays >= 0 (rounding keeps the sign), and its relative error of at most 2^-8
// moves sqrt(v) + eps by at most 2^-9 relative. A step's decay of a moment by beta changes every bf16 value when
// 1 - beta >= 2^-8; closer to 1 the rounding undoes it for some values, which then stall, so cfg_validate refuses
// such betas with bf16 moments (core/config.h).
template <typename T, typename M>
__global__ void adamw_kernel(float *p, T *work, const float *g, M *m, M *v, long long n, long long n4,
                             const AdamWCoeffs *coeffs, const float *grad_scale) {
    const AdamWCoeffs c = *coeffs;
    const float gs = grad_scale ? *grad_scale : 1.0f;
    const long long stride = (long long)gridDim.x * blockDim.x, t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long q = t; q < n4; q += stride) adamw_elements<4>(p, work, g, m, v, 4 * q, c, gs);
    for (long long i = 4 * n4 + t; i < n; i += stride) adamw_elements<1>(p, work, g, m, v, i, c, gs);
}

// One AdamW update of n elements with the coefficients *c (device): p (fp32 master), m, v (moment_type) in place;
// work[n] (working copy of work_type, may be NULL) = p after the update; g[n] fp32 gradient times *grad_scale (device
// float, NULL for 1). Vectors of 4 where every array is aligned to them (tensors start at multiples of MODEL_ALIGN
// elements, so all but a shard's odd start are): 16-byte fp32 loads, against 4-byte ones.
static inline void adamw_update(float *p, void *work, Dtype work_type, const float *g, void *m, void *v,
                                Dtype moment_type, long long n, const AdamWCoeffs *c, const float *grad_scale,
                                cudaStream_t s) {
    if (n <= 0) return;
    auto vec4 = [](const void *x, Dtype t) { return (uintptr_t)x % (4 * dtype_size(t)) == 0; };
    const bool vec = vec4(p, DT_FP32) && vec4(g, DT_FP32) && vec4(m, moment_type) && vec4(v, moment_type) &&
                     vec4(work, work_type); // NULL is aligned
    const long long n4 = vec ? n / 4 : 0;
    const int blocks = (int)SDM_MAX(1LL, SDM_MIN(65536LL, (SDM_MAX(n4, n - 4 * n4) + 255) / 256));
    DTYPE_DISPATCH(work_type, "adamw_update", typedef T Work;
                   DTYPE_DISPATCH(moment_type, "adamw_update",
                                  adamw_kernel<Work, T><<<blocks, 256, 0, s>>>(p, (Work *)work, g, (T *)m, (T *)v, n,
                                                                               n4, c, grad_scale)));
    cudaCheckLast();
}

// AdamW over the elements [lo, hi) of the model's flat parameter array (a ZeRO-1 shard, or everything), each tensor
// with the coefficients of its weight-decay flag (ParamSpec.decay): coeffs[decay], device [ADAMW_COEFF_SETS]
// (adamw_load_coeffs). Every pointer points at element lo of its flat array (for the optimizer's shard-sized arrays:
// their element 0). Only tensor elements are touched (the alignment gaps between tensors stay as they are); adjacent
// tensors with the same flag are updated by one launch (model_decay_run).
static inline void adamw_update_model(const ModelDesc *md, long long lo, long long hi, float *p, void *work,
                                      Dtype work_type, const float *g, void *m, void *v, Dtype moment_type,
                                      const AdamWCoeffs *coeffs, const float *grad_scale, cudaStream_t s) {
    long long a, b;
    int decay, next = 0;
    size_t ms = dtype_size(moment_type);
    while (model_decay_run(md, lo, hi, &next, &a, &b, &decay)) {
        long long off = a - lo;
        adamw_update(p + off, work ? (char *)work + off * dtype_size(work_type) : NULL, work_type, g + off,
                     (char *)m + off * ms, (char *)v + off * ms, moment_type, b - a, coeffs + (decay != 0),
                     grad_scale, s);
    }
}

#endif
