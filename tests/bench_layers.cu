// tests/bench_layers.cu: the RMSNorm and SwiGLU kernels of core/layers.cuh (the step profile's "norms,
// element-wise" part) at the flagship shape: n = B*T = 16384 rows, D = 2048, F = 5632, bf16. Each launcher is timed
// alone: median of CUDA-event timings after warm-up, with L2 flushed before each run (a 256 MiB memset outside the
// events), so every byte comes from HBM. Bytes are those of the [n, D] and [n, F] tensors each call must read and
// write once, as the profile's floors count them (docs/MODEL.md#step-profile); the weights, rstd and the backward's
// dw partials (3-4% of its bytes) are left out. Only the launchers are used, so this part also builds against an
// older core/layers.cuh: the same benchmark measures a tree before and after a change.
// Then decode's products (core/matmul.cuh) at the flagship's shapes and M = 1..64 streams: the GEMV, the MMA kernels
// and cuBLASLt, each called directly (see bench_products). Last, the cost of one more kernel in a decode step
// (bench_chain). `bench_layers products`: decode's products alone; `bench_layers persist`: decode's attention-layer
// products as launched against one persistent launch (bench_persist).
#include "core/layers.cuh"
#include "core/matmul.cuh"
#include "tests/bench.h"
#include "tests/test.h"

#define HBM_BYTES_PER_S 4.8e12 // the H200's HBM, as logging.hbm_tbps

typedef __nv_bfloat16 bf16;

static bf16 *dev_random(size_t n, uint32_t seed) {
    bf16 *d;
    cudaCheck(cudaMalloc((void **)&d, n * sizeof(bf16)));
    bench_fill<<<(unsigned)((n + 255) / 256), 256>>>(d, n, seed);
    cudaCheckLast();
    return d;
}


typedef struct {
    int n, D, F;
    bf16 *h, *branch, *hout, *y, *dy, *dx, *ab, *dab, *hf, *dhf, *w;
    float *rstd, *dw, *scratch;
    void *flush; // [FLUSH_BYTES], written before each timed run to empty L2
} Bufs;

#define FLUSH_BYTES ((size_t)256 << 20)

typedef enum { K_NORM, K_RES_NORM, K_NORM_BWD, K_NORM_BWD_ACC, K_SWIGLU, K_SWIGLU_BWD, K_COUNT } Kernel;

static const struct {
    const char *name;
    double tensors; // [n, D] tensors moved for the norms, [n, F] for SwiGLU
} KERNELS[K_COUNT] = {
    {"rmsnorm_forward (read x, write y)", 2},
    {"residual_rmsnorm_forward (read h, branch; write h_out, y)", 4},
    {"rmsnorm_backward, dx = (read x, dy; write dx)", 3},
    {"rmsnorm_backward, dx += (read x, dy, dx; write dx)", 4},
    {"swiglu_forward (read a, b; write h)", 3},
    {"swiglu_backward (read a, b, dh; write da, db)", 5},
};

static void launch(const Bufs *b, Kernel k) {
    int n = b->n, D = b->D, F = b->F;
    const float eps = 1e-5f;
    switch (k) {
    case K_NORM: rmsnorm_forward(b->y, b->rstd, b->h, b->w, DT_BF16, n, D, eps, 0); break;
    case K_RES_NORM:
        residual_rmsnorm_forward(b->hout, b->y, b->rstd, b->h, b->branch, b->w, DT_BF16, n, D, eps, 0);
        break;
    case K_NORM_BWD:
    case K_NORM_BWD_ACC:
        rmsnorm_backward(b->dx, b->dw, b->scratch, b->dy, b->hout, b->w, b->rstd, DT_BF16, n, D, k == K_NORM_BWD_ACC,
                         0);
        break;
    case K_SWIGLU: swiglu_forward(b->hf, b->ab, b->ab + F, 2 * F, DT_BF16, n, F, 0); break;
    case K_SWIGLU_BWD:
        swiglu_backward(b->dab, b->dab + F, 2 * F, b->dhf, b->ab, b->ab + F, 2 * F, DT_BF16, n, F, 0);
        break;
    default: break;
    }
}

// Median milliseconds of `reps` runs of kernel k, each after an L2 flush, following `warm` untimed runs.
static float time_kernel(const Bufs *b, Kernel k, int warm, int reps) {
    return bench_time(
        warm, reps, [&](int i) { cudaCheck(cudaMemsetAsync(b->flush, i & 0xFF, FLUSH_BYTES, 0)); },
        [&] { launch(b, k); }).median;
}

// ---- decode's products ---------------------------------------------------------------------------------------------
// Y[M,N] = X[M,K]·W[N,K]ᵀ at the flagship's decode shapes (D = 2048, F = 5632, V = 258) for M = 1..64 streams,
// bf16 weights, by each path of core/matmul.cuh called directly: the GEMV (M <= 8), the MMA kernels, cuBLASLt
// (matmul_forward_lt: one product per part). A time is the mean of PROD_REPS launches in a CUDA graph (decode replays
// its step as one), each on the next weight copy of a PROD_POOL_BYTES pool, so that the weights come from HBM, not
// from the 50 MB L2, as in a model whose other layers evict them. GB/s count the weight bytes N·K·2 alone.

#define PROD_POOL_BYTES ((size_t)512 << 20)
#define PROD_REPS 20
#define PROD_MAX_M 64
#define PROD_MAX_N 11264
#define PROD_MAX_K 5632

typedef struct {
    const char *name;
    int K, n_parts, N[3], fp32_out, bias;
} Product;

static const Product PRODUCTS[] = {
    {"qkv 2048 -> 3 x 2048 (3 parts)", 2048, 3, {2048, 2048, 2048}, 0, 0},
    {"qkv 2048 -> 6144 (the 3 parts as one)", 2048, 1, {6144}, 0, 0},
    {"attention out 2048 -> 2048", 2048, 1, {2048}, 0, 0},
    {"FFN w13 2048 -> 11264", 2048, 1, {11264}, 0, 0},
    {"FFN w2 5632 -> 2048", 5632, 1, {2048}, 0, 0},
    {"SDM input 2048 -> 6148 (+ bias)", 2048, 1, {6148}, 0, 1},
    {"LM head 2048 -> 258 (bytes), fp32 logits", 2048, 1, {258}, 1, 0},
};

// PATH_LT1: one cuBLASLt call for a one-part product whatever its width (matmul_lt; PATH_LT splits off N % 64)
typedef enum { PATH_GEMV, PATH_MMA, PATH_PIPE, PATH_LT, PATH_LT1, PATH_COUNT } Path;

static size_t product_weights(const Product *pr) {
    size_t n = 0;
    for (int p = 0; p < pr->n_parts; p++) n += (size_t)pr->N[p] * pr->K;
    return n;
}

// The product by `path` on weight copy w (its parts one after the other), outputs y[part] (row stride N).
static void product_run(const Product *pr, const bf16 *w, const bf16 *x, void *const *y, int M, Path path,
                        cudaStream_t st) {
    MatmulParts P = {pr->n_parts, {NULL}, {NULL}, {NULL}, {0}, {0}};
    for (int p = 0; p < pr->n_parts; p++) {
        P.w[p] = w, P.y[p] = y[p], P.N[p] = P.ldy[p] = pr->N[p];
        P.bias[p] = pr->bias ? x : NULL; // any bf16 values
        w += (size_t)pr->N[p] * pr->K;
    }
    if (path == PATH_LT1) {
        matmul_lt(y[0], pr->fp32_out ? DT_FP32 : DT_BF16, pr->N[0], w - (size_t)pr->N[0] * pr->K, pr->K, 1, x, pr->K, 0,
                  DT_BF16, pr->N[0], M, pr->K, 0.0f, P.bias[0], st);
        return;
    }
    static const MatmulKernel KERNEL_OF[PATH_LT1] = {MATMUL_KERNEL_GEMV, MATMUL_KERNEL_MMA, MATMUL_KERNEL_PIPE,
                                                     MATMUL_KERNEL_LT};
    matmul_parts_run(KERNEL_OF[path], &P, pr->fp32_out ? DT_FP32 : DT_BF16, x, DT_BF16, M, pr->K, st);
}

// Median ms of a replay of the CUDA graph that record() captures on st (`warm` untimed replays, then `reps` timed).
template <typename Record>
static float graph_median_ms(cudaStream_t st, cudaStreamCaptureMode mode, int warm, int reps, Record record) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaCheck(cudaStreamBeginCapture(st, mode));
    record();
    cudaCheck(cudaStreamEndCapture(st, &graph));
    cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
    BenchTime t = bench_time(warm, reps, [](int) {}, [&] { cudaCheck(cudaGraphLaunch(exec, st)); }, st);
    cudaCheck(cudaGraphExecDestroy(exec));
    cudaCheck(cudaGraphDestroy(graph));
    return t.median;
}

// Mean ms of run(w) (launches on st) over PROD_REPS calls in a CUDA graph, w the next copy of pr's weights each.
template <typename Run> static float product_graph_time(const Product *pr, const bf16 *pool, Run run, cudaStream_t st) {
    size_t w_n = product_weights(pr);
    int copies = (int)(PROD_POOL_BYTES / (w_n * sizeof(bf16)));
    // relaxed: cuBLASLt may load modules
    return graph_median_ms(st, cudaStreamCaptureModeRelaxed, 1, 5, [&] {
               for (int r = 0; r < PROD_REPS; r++) run(pool + (size_t)(r % copies) * w_n);
           }) / PROD_REPS;
}

// Mean ms of the product by `path` (see above); y keeps the last launch's outputs.
static float product_time(const Product *pr, const bf16 *pool, const bf16 *x, void *const *y, int M, Path path,
                          cudaStream_t st) {
    return product_graph_time(pr, pool, [&](const bf16 *w) { product_run(pr, w, x, y, M, path, st); }, st);
}

// The largest relative L2 difference over the parts between two paths' outputs (M rows each).
static double product_diff(const Product *pr, void *const *a, void *const *b, int M) {
    double worst = 0.0;
    size_t es = pr->fp32_out ? 4 : 2;
    for (int p = 0; p < pr->n_parts; p++) {
        size_t n = (size_t)M * pr->N[p];
        unsigned char *ha = (unsigned char *)sdm_malloc(n * es), *hb = (unsigned char *)sdm_malloc(n * es);
        double *da = (double *)sdm_malloc(n * sizeof(double)), *db = (double *)sdm_malloc(n * sizeof(double));
        cudaCheck(cudaMemcpy(ha, a[p], n * es, cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(hb, b[p], n * es, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) {
            da[i] = pr->fp32_out ? ((float *)ha)[i] : __bfloat162float(((bf16 *)ha)[i]);
            db[i] = pr->fp32_out ? ((float *)hb)[i] : __bfloat162float(((bf16 *)hb)[i]);
        }
        double e = rel_error(da, db, n);
        worst = e > worst || e != e ? e : worst; // NaN sticks
        free(ha); free(hb); free(da); free(db);
    }
    return worst;
}

static void bench_products(void) {
    const int Ms[] = {1, 2, 4, 8, 16, 32, 64};
    static const char *PATH_NAMES[PATH_COUNT] = {"GEMV", "MMA", "MMA pipe", "cuBLASLt", "cuBLASLt, one call"};
    matmul_init(); // outside the graph captures: it allocates
    bf16 *pool = dev_random(PROD_POOL_BYTES / sizeof(bf16), 20), *x = dev_random((size_t)PROD_MAX_M * PROD_MAX_K, 21);
    void *y[PATH_COUNT][3];
    for (int v = 0; v < PATH_COUNT; v++)
        for (int p = 0; p < 3; p++) cudaCheck(cudaMalloc(&y[v][p], (size_t)PROD_MAX_M * PROD_MAX_N * sizeof(float)));
    cudaStream_t st;
    cudaCheck(cudaStreamCreate(&st));
    printf("\ndecode's products Y[M,N] = X[M,K]·W[N,K]ᵀ, bf16 weights from HBM, mean of %d launches in a CUDA graph;"
           " "
           "per path: us, GB/s of weights, %% of 4.8 TB/s; last: relative L2 difference from cuBLASLt's output\n",
           PROD_REPS);
    printf("| product | M | %s | %s | %s | %s | %s | vs cuBLASLt |\n|---|---|---|---|---|---|---|---|\n",
           PATH_NAMES[0], PATH_NAMES[1], PATH_NAMES[2], PATH_NAMES[3], PATH_NAMES[4]);
    for (size_t i = 0; i < sizeof PRODUCTS / sizeof PRODUCTS[0]; i++) {
        const Product *pr = &PRODUCTS[i];
        double bytes = product_weights(pr) * sizeof(bf16);
        for (size_t j = 0; j < sizeof Ms / sizeof Ms[0]; j++) {
            int M = Ms[j];
            printf("| %s | %d |", pr->name, M);
            for (int v = 0; v < PATH_COUNT; v++) {
                if ((v == PATH_GEMV && M > MATMUL_GEMV_MAX_M) || (v == PATH_LT1 && pr->n_parts > 1)) {
                    printf(" - |");
                    continue;
                }
                float ms = product_time(pr, pool, x, y[v], M, (Path)v, st);
                double bps = bytes / (ms * 1e-3);
                printf(" %.1f us, %.0f GB/s, %.0f%% |", ms * 1e3, bps / 1e9, 100.0 * bps / HBM_BYTES_PER_S);
                CHECK(ms > 0.0f, "%s M=%d %s: no time measured", pr->name, M, PATH_NAMES[v]);
            }
            for (int v = PATH_GEMV; v < PATH_COUNT; v++) {
                if (v == PATH_LT || (v == PATH_GEMV && M > MATMUL_GEMV_MAX_M) || (v == PATH_LT1 && pr->n_parts > 1))
                    continue;
                double d = product_diff(pr, y[v], y[PATH_LT], M);
                printf(" %s %.1e", PATH_NAMES[v], d);
                CHECK(d < 1e-2, "%s M=%d: %s differs from cuBLASLt by %.2e", pr->name, M, PATH_NAMES[v], d);
            }
            printf(" |\n");
        }
    }
    cudaCheck(cudaStreamDestroy(st));
    for (int v = 0; v < PATH_COUNT; v++)
        for (int p = 0; p < 3; p++) cudaCheck(cudaFree(y[v][p]));
    cudaCheck(cudaFree(pool));
    cudaCheck(cudaFree(x));
}

// cuBLASLt's heuristic candidates (ranks 0..MATMUL_LT_RANKS-1, rank 0 its first choice, which matmul_forward_lt runs)
// on the one-part products of decode at 8 and 32 rows, each timed as above: whether a fixed choice other than the
// first would be faster (a choice by timing would not give the same bits run to run; a fixed rank does).
static void bench_lt_ranks(void) {
    static const Product LT_PRODUCTS[] = {
        {"qkv 2048 -> 6144", 2048, 1, {6144}, 0, 0},
        {"attention out 2048 -> 2048", 2048, 1, {2048}, 0, 0},
        {"FFN w13 2048 -> 11264", 2048, 1, {11264}, 0, 0},
        {"FFN w2 5632 -> 2048", 5632, 1, {2048}, 0, 0},
        {"SDM input's main part 2048 -> 6144 (+ bias)", 2048, 1, {6144}, 0, 1},
    };
    const int Ms[] = {8, 32};
    bf16 *pool = dev_random(PROD_POOL_BYTES / sizeof(bf16), 22), *x = dev_random((size_t)PROD_MAX_M * PROD_MAX_K, 23);
    void *y0, *y;
    cudaCheck(cudaMalloc(&y0, (size_t)PROD_MAX_M * PROD_MAX_N * sizeof(bf16)));
    cudaCheck(cudaMalloc(&y, (size_t)PROD_MAX_M * PROD_MAX_N * sizeof(bf16)));
    cudaStream_t st;
    cudaCheck(cudaStreamCreate(&st));
    printf("\ncuBLASLt's heuristic candidates at decode's one-part products (us, mean of %d launches in a CUDA graph, "
           "weights from HBM; last: relative L2 difference from rank 0's output)\n| product | M | rank | us | "
           "configuration | vs rank 0 |\n|---|---|---|---|---|---|\n", PROD_REPS);
    for (size_t i = 0; i < sizeof LT_PRODUCTS / sizeof LT_PRODUCTS[0]; i++) {
        const Product *pr = &LT_PRODUCTS[i];
        for (size_t j = 0; j < sizeof Ms / sizeof Ms[0]; j++) {
            int M = Ms[j];
            for (int rank = 0; rank < MATMUL_LT_RANKS; rank++) {
                char info[128] = "";
                void *out = rank ? y : y0;
                auto run = [&](const bf16 *w) {
                    return matmul_lt(out, DT_BF16, pr->N[0], w, pr->K, 1, x, pr->K, 0, DT_BF16, pr->N[0], M, pr->K,
                                     0.0f, pr->bias ? x : NULL, st, rank, info, sizeof info);
                };
                if (!run(pool)) break; // fewer candidates
                cudaCheck(cudaStreamSynchronize(st));
                float ms = product_graph_time(pr, pool, run, st);
                cudaCheck(cudaStreamSynchronize(st));
                void *a[1] = {out}, *b[1] = {y0};
                double d = product_diff(pr, a, b, M);
                printf("| %s | %d | %d | %.1f | %s | %.1e |\n", pr->name, M, rank, ms * 1e3, info, d);
                CHECK(ms > 0.0f, "%s M=%d rank %d: no time measured", pr->name, M, rank);
                CHECK(d < 1e-2, "%s M=%d: rank %d differs from rank 0 by %.2e", pr->name, M, rank, d);
            }
        }
    }
    cudaCheck(cudaStreamDestroy(st));
    cudaCheck(cudaFree(y0));
    cudaCheck(cudaFree(y));
    cudaCheck(cudaFree(pool));
    cudaCheck(cudaFree(x));
}

// ---- the dependent-kernel floor of a decode step -------------------------------------------------------------------
// A decode step at batch 1 is a chain of ~185 kernels, each of which reads what the one before it wrote. This times
// such a chain with nothing else in it: CHAIN_KERNELS launches in a CUDA graph, each of CHAIN_BLOCKS blocks that read
// the previous kernel's [D] row (L2), sum it (warp butterflies, a barrier) and write their part of the next row, with
// programmatic dependent launch and without. Its time per kernel is what one more kernel in the step costs at least.

#define CHAIN_KERNELS 200
#define CHAIN_BLOCKS 16
#define CHAIN_D 2048

__global__ void __launch_bounds__(256) chain_kernel(const float *in, float *out) {
    __shared__ float warp_sum[8];
    pdl_enter();
    float v = 0.0f;
    for (int k = threadIdx.x; k < CHAIN_D; k += blockDim.x) v += in[k];
    v = core_warp_sum(v);
    if (threadIdx.x % 32 == 0) warp_sum[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0.0f;
    for (int w = 0; w < 8; w++) s += warp_sum[w];
    int k = blockIdx.x * blockDim.x + threadIdx.x;
    if (k < CHAIN_D) out[k] = in[k] + 1e-9f * s;
}

static void bench_chain(void) {
    float *row;
    cudaCheck(cudaMalloc((void **)&row, 2 * CHAIN_D * sizeof(float)));
    cudaCheck(cudaMemset(row, 0, 2 * CHAIN_D * sizeof(float)));
    cudaStream_t st;
    cudaCheck(cudaStreamCreate(&st));
    printf("\ndependent kernels in a CUDA graph (%d launches of %d blocks, each reading the last one's row)\n",
           CHAIN_KERNELS, CHAIN_BLOCKS);
    for (int pdl = 1; pdl >= 0; pdl--) {
        g_pdl = pdl;
        float ms = graph_median_ms(st, cudaStreamCaptureModeGlobal, 2, 9, [&] {
            for (int i = 0; i < CHAIN_KERNELS; i++)
                launch_pdl(chain_kernel, CHAIN_BLOCKS, 256, 0, st, (const float *)row + (i % 2) * CHAIN_D,
                           row + (1 - i % 2) * CHAIN_D);
        });
        printf("| %s | %.2f us a kernel |\n", pdl ? "programmatic dependent launch" : "plain launches",
               ms * 1e3 / CHAIN_KERNELS);
        CHECK(ms > 0.0f, "chain: no time measured");
    }
    g_pdl = 1;
    cudaCheck(cudaStreamDestroy(st));
    cudaCheck(cudaFree(row));
}

// ---- decode's products as one persistent kernel --------------------------------------------------------------------
// What a persistent decode kernel would gain at batch 1 (BENCHMARKS.md, issue 12): the products of the flagship's 18
// attention layers (q, k, v as one 2048 -> 6144, out 2048 -> 2048, w13 2048 -> 11264 without the SwiGLU, w2 5632 ->
// 2048: 72 products, 1.85 GB of weights, each product's input the output of the one before) timed
//   (a) as decode runs them: 72 GEMV launches (core/matmul_small_m.cuh) with programmatic dependent launch in a graph;
//   (b) as one cooperative launch of the same blocks, a grid-wide barrier (four kinds: persist_barrier) after
//       each product, a block issuing the next product's first weight tiles before it waits at the barrier (weights
//       are constant), so that its cp.async pipeline never drains between products;
//   (c) as (b) with EXTRA barriers after each product more: the short dependent kernels (norms, RoPE, attention
//       decode) a whole persistent step would hold, as barriers with nothing between them.
// (b) sums every output in the GEMV's order (thread partials in k order, warps in order), so its outputs must equal
// (a)'s bitwise: a check that the barrier orders the products.

#define PERSIST_LAYERS 18
#define PERSIST_STAGES (4 * PERSIST_LAYERS)

typedef struct {
    MatmulParts P; // one part: y = x W^T, bf16
    const bf16 *x;
    int K, groups;
} PersistStage;

// The grid's barrier number `gen` (1, 2, ...): stores before it visible to loads after it. `mode` bit 0, the shape:
// flat, every block adds to one counter (gridDim.x atomics in a row on one address); tree, block b adds to counter
// b % PERSIST_FAN and the last block of each of those to arrive adds to the top one (about gridDim.x / PERSIST_FAN +
// PERSIST_FAN atomics in a row). Bit 1, the ordering: fences around a relaxed atomic (__threadfence, as cooperative
// groups' grid sync does), or release / acquire atomics without fences (the block's stores reach thread 0 through
// __syncthreads; release and acquire are cumulative in the PTX memory model). Counters [PERSIST_FAN + 1][32] (128
// bytes apart), zero at the launch.
#define PERSIST_FAN 16
__device__ __forceinline__ unsigned persist_add(unsigned *p, int release) {
    unsigned old;
    if (release) asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(p) : "memory");
    else old = atomicAdd(p, 1u);
    return old;
}
__device__ __forceinline__ void persist_barrier(unsigned *count, unsigned gen, int mode) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const int tree = mode & 1, release = mode & 2;
        const unsigned fan = gridDim.x < PERSIST_FAN ? gridDim.x : PERSIST_FAN, sub = blockIdx.x % fan,
                       members = (gridDim.x - sub + fan - 1) / fan;
        unsigned *top = count + PERSIST_FAN * 32, target = gen * (tree ? fan : gridDim.x);
        if (!release) __threadfence();
        if (!tree) persist_add(top, release);
        else if (persist_add(count + sub * 32, release) + 1 == gen * members) {
            if (!release) __threadfence();
            persist_add(top, release);
        }
        unsigned v;
        do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(top) : "memory");
        while (v < target);
        if (!release) __threadfence();
    }
    __syncthreads();
}

// matmul_gemv_issue over the stages: the tile after (s, g, k), into the next stage where this block's groups of
// stage s are done.
__device__ __forceinline__ void persist_issue(uint4 *buf, const PersistStage *st, int &s, int &g, int &k) {
    while (s < PERSIST_STAGES && g >= st[s].groups) s++, g = blockIdx.x, k = threadIdx.x * 8;
    if (s < PERSIST_STAGES)
        matmul_gemv_issue<bf16, MATMUL_GEMV_ROWS, MATMUL_OUT_PLAIN>(buf, st[s].P, st[s].groups, gridDim.x, st[s].K, g,
                                                                    k);
    else core_cp_async_commit();
}

// matmul_gemv_kernel's loop (M = 1, bf16) over every stage, `extra` + 1 barriers of `mode` & 3 (persist_barrier)
// after each; x through L2 (__ldcg), since other blocks of this grid wrote it.
__global__ void __launch_bounds__(MATMUL_GEMV_THREADS) persist_kernel(const PersistStage *st, unsigned *count,
                                                                      int extra, int mode) {
    constexpr int VEC = 8, STEP = MATMUL_GEMV_THREADS * VEC, R = MATMUL_GEMV_ROWS, WARPS = MATMUL_GEMV_THREADS / 32,
                  S = MATMUL_GEMV_STAGES, TILE = R * MATMUL_GEMV_THREADS;
    __shared__ float part[WARPS][R];
    extern __shared__ __align__(16) uint4 stages[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, k0 = threadIdx.x * VEC;
    int is = 0, ig = blockIdx.x, ik = k0; // the next tile to issue
    for (int i = 0; i < S - 1; i++) persist_issue(stages + i * TILE, st, is, ig, ik);
    unsigned arrivals = 0;
    for (int s = 0, i = 0; s < PERSIST_STAGES; s++) {
        for (int e = 0; s > 0 && e <= extra; e++) persist_barrier(count, ++arrivals, mode);
        const bf16 *x = st[s].x;
        const int K = st[s].K, groups = st[s].groups;
        // mode & 4: this thread's x vectors (k0, k0 + STEP, k0 + 2 STEP: K <= 3 STEP here) loaded once a product,
        // as the GEMV's __ldg finds them in L1 after the first block of an SM; else one L2 trip a tile
        uint4 xh[3] = {};
        if (mode & 4)
            for (int j = 0; j < 3 && k0 + j * STEP < K; j++) xh[j] = __ldcg((const uint4 *)(x + k0 + j * STEP));
        float acc[R] = {};
        for (int g = blockIdx.x, k = k0; g < groups; i++) {
            asm volatile("" ::: "memory");
            persist_issue(stages + (i + S - 1) % S * TILE, st, is, ig, ik);
            core_cp_async_wait<S - 1>();
            if (k < K) {
                float wv[R][VEC], xv[VEC];
#pragma unroll
                for (int r = 0; r < R; r++) matmul_gemv_unpack(stages[i % S * TILE + r * MATMUL_GEMV_THREADS + threadIdx.x],
                                                               x, wv[r]);
                const int j = (k - k0) / STEP;
                matmul_gemv_unpack(mode & 4 ? (j == 0 ? xh[0] : j == 1 ? xh[1] : xh[2]) : __ldcg((const uint4 *)(x + k)),
                                   x, xv);
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int e = 0; e < VEC; e++) acc[r] = fmaf(wv[r][e], xv[e], acc[r]);
            }
            k += STEP;
            if (k - k0 < K) continue;
#pragma unroll
            for (int r = 0; r < R; r++) {
                float v = core_warp_sum(acc[r]);
                if (lane == 0) part[warp][r] = v;
                acc[r] = 0.f;
            }
            __syncthreads();
            if (threadIdx.x < R && g * R + (int)threadIdx.x < st[s].P.N[0]) {
                float v = 0.f;
                for (int j = 0; j < WARPS; j++) v += part[j][threadIdx.x];
                matmul_part_store<bf16, MATMUL_OUT_PLAIN>(st[s].P, 0, 0, g * R + threadIdx.x, v, 0.f);
            }
            __syncthreads();
            g += gridDim.x;
            k = k0;
        }
    }
}

// x[i] *= scale, so that a chain of products keeps its values near 1.
__global__ void persist_scale(bf16 *x, size_t n, float scale) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __float2bfloat16(__bfloat162float(x[i]) * scale);
}

static void bench_persist(void) {
    const int D = 2048, F = 5632, N[4] = {3 * D, D, 2 * F, D}, K[4] = {D, D, D, F};
    size_t w_n = 0, y_n = 0;
    for (int p = 0; p < 4; p++) w_n += (size_t)N[p] * K[p], y_n += N[p];
    for (int p = 0; p < 4; p++) // persist_kernel holds at most 3 x vectors a thread
        CHECK(K[p] <= 3 * MATMUL_GEMV_THREADS * 8, "persistent chain: K = %d beyond 3 x vectors a thread", K[p]);
    bf16 *w = dev_random(w_n * PERSIST_LAYERS, 41), *x0 = dev_random(D, 42), *ya, *yb;
    persist_scale<<<(unsigned)((w_n * PERSIST_LAYERS + 255) / 256), 256>>>(w, w_n * PERSIST_LAYERS,
                                                                          sqrtf(3.0f / (4.0f * D)));
    cudaCheckLast();
    cudaCheck(cudaMalloc((void **)&ya, 2 * y_n * PERSIST_LAYERS * sizeof(bf16)));
    yb = ya + y_n * PERSIST_LAYERS;
    // the stages of (a) (outputs ya) and of (b) (outputs yb), each product's x the one before's y
    PersistStage hs[2][PERSIST_STAGES];
    for (int v = 0; v < 2; v++) {
        const bf16 *wl = w, *x = x0;
        bf16 *y = v ? yb : ya;
        for (int s = 0; s < PERSIST_STAGES; s++) {
            int p = s % 4;
            PersistStage *t = &hs[v][s];
            *t = {};
            t->P.n = 1, t->P.w[0] = wl, t->P.y[0] = y, t->P.N[0] = t->P.ldy[0] = N[p];
            t->x = x, t->K = K[p], t->groups = ceil_div(N[p], MATMUL_GEMV_ROWS);
            // K[p] of F: w2 reads the first F of w13's 2F outputs (their bytes are what counts)
            wl += (size_t)N[p] * K[p], x = y, y += N[p];
        }
    }
    PersistStage *dst;
    unsigned *count;
    cudaCheck(cudaMalloc((void **)&dst, sizeof hs[1]));
    cudaCheck(cudaMemcpy(dst, hs[1], sizeof hs[1], cudaMemcpyHostToDevice));
    const size_t count_bytes = (PERSIST_FAN + 1) * 32 * sizeof(unsigned);
    cudaCheck(cudaMalloc((void **)&count, count_bytes));
    cudaStream_t st;
    cudaCheck(cudaStreamCreate(&st));
    const size_t smem = MATMUL_GEMV_STAGES * MATMUL_GEMV_STAGE_BYTES;
    const unsigned grid =
        matmul_persistent_grid((const void *)persist_kernel, MATMUL_GEMV_THREADS, smem, 1u << 30, "persistent chain");
    auto graph_ms = [&](auto record) { return graph_median_ms(st, cudaStreamCaptureModeGlobal, 2, 9, record); };
    auto persistent = [&](int extra, int mode) {
        cudaCheck(cudaMemsetAsync(count, 0, count_bytes, st));
        cudaLaunchAttribute attr;
        attr.id = cudaLaunchAttributeCooperative; // every block resident at once, or the launch fails
        attr.val.cooperative = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid, cfg.blockDim = MATMUL_GEMV_THREADS, cfg.dynamicSmemBytes = smem, cfg.stream = st;
        cfg.attrs = &attr, cfg.numAttrs = 1;
        cudaCheck(cudaLaunchKernelEx(&cfg, persist_kernel, (const PersistStage *)dst, count, extra, mode));
    };
    constexpr int MODES = 8, VARIANTS = 1 + 2 * MODES; // the launches, then each mode with 1 and 2 barriers a product
    float ms[VARIANTS];
    ms[0] = graph_ms([&] {
        for (int s = 0; s < PERSIST_STAGES; s++)
            matmul_gemv_run<bf16, bf16>(&hs[0][s].P, hs[0][s].x, 1, hs[0][s].K, st);
    });
    size_t y_bytes = y_n * PERSIST_LAYERS * sizeof(bf16);
    unsigned char *a = (unsigned char *)sdm_malloc(2 * y_bytes);
    for (int v = 1; v < VARIANTS; v++) {
        cudaCheck(cudaMemset(yb, 0, y_bytes));
        ms[v] = graph_ms([&] { persistent((v - 1) / MODES, (v - 1) % MODES); });
        cudaCheck(cudaMemcpy(a, ya, 2 * y_bytes, cudaMemcpyDeviceToHost));
        CHECK(memcmp(a, a + y_bytes, y_bytes) == 0, "persistent chain: outputs differ from the launched GEMVs'");
    }
    CHECK(count_nonfinite(ya, y_n * PERSIST_LAYERS) == 0, "persistent chain: non-finite outputs");
    free(a);
    double gb = w_n * PERSIST_LAYERS * sizeof(bf16) / 1e9;
    printf("\nthe 18 attention layers' products at batch 1 (%d products, %.2f GB of weights; %u blocks persistent)\n",
           PERSIST_STAGES, gb, grid);
    printf("| path | us a step | us a layer | TB/s |\n|---|---|---|---|\n");
    static const char *SHAPE[2] = {"flat", "tree"}, *ORDER[2] = {"fences", "release/acquire"},
                      *X[2] = {"x from L2 a tile", "x held"};
    printf("| 72 GEMV launches, PDL, one graph (decode today) | %.1f | %.2f | %.2f |\n", ms[0] * 1e3,
           ms[0] * 1e3 / PERSIST_LAYERS, gb / ms[0]);
    for (int v = 1; v < VARIANTS; v++) {
        const int mode = (v - 1) % MODES;
        printf("| one persistent launch, %d barrier%s a product (%s, %s; %s) | %.1f | %.2f | %.2f |\n",
               1 + (v - 1) / MODES, v > MODES ? "s" : "", SHAPE[mode & 1], ORDER[mode >> 1 & 1], X[mode >> 2],
               ms[v] * 1e3, ms[v] * 1e3 / PERSIST_LAYERS, gb / ms[v]);
    }
    cudaCheck(cudaStreamDestroy(st));
    cudaCheck(cudaFree(dst));
    cudaCheck(cudaFree(count));
    cudaCheck(cudaFree(ya));
    cudaCheck(cudaFree(w));
    cudaCheck(cudaFree(x0));
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "persist")) {
        bench_persist();
        matmul_destroy();
        return test_summary();
    }
    if (argc > 1 && !strcmp(argv[1], "products")) {
        bench_products();
        matmul_destroy();
        return test_summary();
    }
    const int n = 4 * 4096, D = 2048, F = 5632, L = 24, warm = 3, reps = 20;
    size_t nd = (size_t)n * D, nf = (size_t)n * F;
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    Bufs b;
    b.n = n, b.D = D, b.F = F;
    b.h = dev_random(nd, 1), b.branch = dev_random(nd, 2), b.hout = dev_random(nd, 3), b.y = dev_random(nd, 4);
    b.dy = dev_random(nd, 5), b.dx = dev_random(nd, 6), b.ab = dev_random(2 * nf, 7), b.dab = dev_random(2 * nf, 8);
    b.hf = dev_random(nf, 9), b.dhf = dev_random(nf, 10), b.w = dev_random(D, 11);
    cudaCheck(cudaMalloc((void **)&b.rstd, n * sizeof(float)));
    cudaCheck(cudaMalloc((void **)&b.dw, D * sizeof(float)));
    cudaCheck(cudaMemset(b.dw, 0, D * sizeof(float)));
    cudaCheck(cudaMalloc((void **)&b.scratch, rmsnorm_backward_scratch_floats(n, D) * sizeof(float)));
    cudaCheck(cudaMalloc(&b.flush, FLUSH_BYTES));

    // the backward reads the fused forward's h_out and rstd, as in the model: run the forwards first
    float ms[K_COUNT];
    for (int k = 0; k < K_COUNT; k++) ms[k] = time_kernel(&b, (Kernel)k, warm, reps);
    cudaCheck(cudaDeviceSynchronize());
    CHECK(count_nonfinite(b.y, nd) == 0, "non-finite rmsnorm output");
    CHECK(count_nonfinite(b.dx, nd) == 0, "non-finite rmsnorm dx");
    CHECK(count_nonfinite(b.hf, nf) == 0, "non-finite swiglu output");
    CHECK(count_nonfinite(b.dab, 2 * nf) == 0, "non-finite swiglu da, db");

    printf("\nbf16, n=%d D=%d F=%d, median of %d after %d warm-up, L2 flushed before each\n", n, D, F, reps, warm);
    printf("| kernel | ms | GB/s | %% of 4.8 TB/s |\n|---|---|---|---|\n");
    for (int k = 0; k < K_COUNT; k++) {
        double bytes = KERNELS[k].tensors * n * (k >= K_SWIGLU ? F : D) * sizeof(bf16), bps = bytes / (ms[k] * 1e-3);
        printf("| %s | %.3f | %.0f | %.1f%% |\n", KERNELS[k].name, ms[k], bps / 1e9, 100.0 * bps / HBM_BYTES_PER_S);
    }
    // The flagship step's calls (model/gpu_model.cuh, recomputation on): per layer two fused forwards, the FFN's
    // SwiGLU forward and its recomputation, two norm recomputations, the SwiGLU backward and two accumulating norm
    // backwards; once the first norm forward and the final norm's backward.
    double step = L * (2 * ms[K_RES_NORM] + 2 * ms[K_SWIGLU] + 2 * ms[K_NORM] + ms[K_SWIGLU_BWD] +
                       2 * ms[K_NORM_BWD_ACC]) + ms[K_NORM] + ms[K_NORM_BWD];
    printf("flagship step (%d layers, recomputation on), these kernels back to back: %.1f ms\n", L, step);

    void *bufs[] = {b.h, b.branch, b.hout, b.y, b.dy, b.dx, b.ab, b.dab, b.hf, b.dhf, b.w, b.rstd, b.dw, b.scratch,
                    b.flush};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) cudaCheck(cudaFree(bufs[i]));
    bench_products();
    bench_lt_ranks();
    bench_chain();
    matmul_destroy();
    return test_summary();
}
