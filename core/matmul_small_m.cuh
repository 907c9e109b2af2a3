// core/matmul_small_m.cuh: decode's products of few rows (M <= 64), where cuBLASLt reads the weights slowly: the
// GEMV (one bf16 row, up to 8 fp32 rows), the MMA kernel (tensor cores, fragments from global memory) and the MMA
// pipe kernel (tensor cores, W and X streamed through shared memory), with MatmulParts (products sharing X, an
// output op in the store, an input norm) that they take. core/matmul.cuh picks among them and cuBLASLt
// (matmul_small_m_kernel) and runs them (matmul_parts_run). Each sums an output in one fixed order for every M.
#ifndef SDM_CORE_MATMUL_SMALL_M_CUH
#define SDM_CORE_MATMUL_SMALL_M_CUH

#include "core/cuda_common.cuh"
#include "core/layers.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Small-M forward (decode steps): Y[M,N] = X[M,K] · W[N,K]ᵀ (+ bias) for M <= MATMUL_GEMV_MAX_M is bound by reading
// W once, and cuBLASLt spreads such products over too few CTAs (on the H200 a decode step's 2048 x 11264 product
// ran at 3.1 TB/s and its 5632-deep ones, split-K, at 2.3). Here a group of MATMUL_GEMV_ROWS rows of W is summed by
// a block of MATMUL_GEMV_THREADS threads striding over K in 16-byte vectors; X is read through L1. Each output's sum
// has one fixed order (thread partials, warp butterfly, warps in order), the same for every M it takes.
// W streams through shared memory: the grid holds as many blocks as fit on the GPU at once (at most one a group),
// block b takes groups b, b + G, ... (G = the grid), and a thread keeps the 16-byte vectors of its next
// MATMUL_GEMV_STAGES - 1 tiles (a group's rows at one stride of K) in flight by cp.async while it sums the current
// one, across the end of a group into the next: no block ends and starts between groups, and 2 tiles a thread are
// always on the way (one block a group issued one tile's loads, then waited, summed and ended). A thread reads back
// only the vectors it copied, so the stages need no barrier. Launched with programmatic dependent launch
// (core/cuda_common.cuh), a block issues its first tiles before waiting for the kernel before it: W must be
// constant during a step (weights are), X is read after the wait.

#define MATMUL_GEMV_MAX_M 8
#ifndef MATMUL_GEMV_ROWS
#define MATMUL_GEMV_ROWS 4
#endif
#ifndef MATMUL_GEMV_THREADS
#define MATMUL_GEMV_THREADS 256
#endif
#ifndef MATMUL_GEMV_STAGES
#define MATMUL_GEMV_STAGES 3 // tiles of a block in shared memory: 3 x 16 KB (2: the one-row products alone 0-12%
                             // faster on an H100, the flagship's batch-1 decode step 1.8% slower)
#endif

// v[0..VEC) = the 16 bytes u as floats (VEC = 8 bf16 or 4 fp32).
__device__ __forceinline__ void matmul_gemv_unpack(uint4 u, const __nv_bfloat16 *, float *v) {
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void matmul_gemv_unpack(uint4 u, const float *, float *v) {
    v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y); v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
}

// v[0..VEC) = the 16 bytes at p as floats.
template <typename T>
__device__ __forceinline__ void matmul_gemv_load(const T *p, float *v) {
    matmul_gemv_unpack(__ldg((const uint4 *)p), p, v);
}

#define MATMUL_MAX_PARTS 4

// An element-wise op the small-M kernels fold into their store, so that a decode step runs no kernel of its own
// for it between two products. It applies the element-wise kernel's function (one definition, core/cuda_common.cuh)
// to the product rounded to Y's dtype, as that kernel reads a stored product: Y gets the bits of the two kernels.
// (In the store, each output's op runs once; folded into the next product's X loads instead, every block of that
// product would recompute all of its X's sigmoids.)
//   MATMUL_OUT_SWIGLU  W = [W1; W3] [2N, K]: Y[m, n] = silu(A[m, n]) * B[m, n], A = X·W1ᵀ, B = X·W3ᵀ (the FFN)
//   MATMUL_OUT_GATE    Y[m, n] = sigmoid(Z[m, n]) * O[m, n], Z = X·Wᵀ (the attention output gate)
typedef enum { MATMUL_OUT_PLAIN, MATMUL_OUT_SWIGLU, MATMUL_OUT_GATE } MatmulOut;

// Products that share X (e.g. a layer's q, k, v): part p is Y_p[M,N_p] (row stride ldy_p) = X · W_p[N_p,K]ᵀ
// (+ bias_p, NULL or [N_p] in Y's dtype). The small-M kernels run every part in one launch. An output op other than
// MATMUL_OUT_PLAIN takes one part, no bias, Y in X's dtype. With an input norm (norm.h set; core/layers.cuh
// ResidualNorm, rows of K in X's dtype) X is the norm's output, which the norm's own kernel writes into x first. (The
// GEMV computing it in its prologue instead, one kernel less, made the flagship's decode 4.5% slower on an H100: a
// block's norm delays its loop, where the norm kernel overlaps the GEMV's first W loads under PDL; folding it
// without that wait, rstd multiplying the sums at the end, made it 6% slower: BENCHMARKS.md.)
typedef struct {
    int n;
    const void *w[MATMUL_MAX_PARTS];
    void *y[MATMUL_MAX_PARTS];
    const void *bias[MATMUL_MAX_PARTS];
    int N[MATMUL_MAX_PARTS], ldy[MATMUL_MAX_PARTS];
    MatmulOut op = MATMUL_OUT_PLAIN; // what initializers that stop at ldy get
    const void *o = NULL;            // MATMUL_OUT_GATE: O [M, ldo] in Y's dtype
    int ldo = 0;
    ResidualNorm norm = {};          // the input norm, or none (norm.h NULL)
} MatmulParts;

// Output columns of a block of `rows` rows of W: under SwiGLU a block pairs columns n0.. of W1 (its rows r <
// rows/2) with the same columns of W3 (rows r >= rows/2), so that both sums of a column meet in one thread.
__host__ __device__ constexpr int matmul_block_cols(MatmulOut op, int rows) {
    return op == MATMUL_OUT_SWIGLU ? rows / 2 : rows;
}

// Row r of a block of R rows of W whose first output column is n0: its output column, and its row of W.
template <MatmulOut OP, int R>
__device__ __forceinline__ int matmul_out_col(int n0, int r) {
    return OP == MATMUL_OUT_SWIGLU && r >= R / 2 ? n0 + r - R / 2 : n0 + r;
}
template <MatmulOut OP, int R>
__device__ __forceinline__ int matmul_w_row(int n0, int r, int N) {
    return OP == MATMUL_OUT_SWIGLU && r >= R / 2 ? N + n0 + r - R / 2 : n0 + r;
}

// The small-M kernels' grids: blocks of `cols` output columns, part after part.
static inline unsigned matmul_parts_blocks(const MatmulParts *P, int cols) {
    unsigned n = 0;
    for (int p = 0; p < P->n; p++) n += (unsigned)ceil_div(P->N[p], cols);
    return n;
}

// The part that block b of such a grid falls in; b becomes its index within that part.
__device__ __forceinline__ int matmul_block_part(const MatmulParts &P, int cols, int &b) {
    int p = 0;
    for (; p < P.n - 1 && b >= (P.N[p] + cols - 1) / cols; p++) b -= (P.N[p] + cols - 1) / cols;
    return p;
}

// v as a stored TY reads back.
template <typename TY>
__device__ __forceinline__ float matmul_rounded(float v) { return dtype_to_float(dtype_from_float<TY>(v)); }

// Y_p[m, n] = s + bias_p[n], or P's output op of s (and under SwiGLU s3, W3's sum of column n).
template <typename TY, MatmulOut OP>
__device__ __forceinline__ void matmul_part_store(const MatmulParts &P, int p, int m, int n, float s, float s3) {
    if (P.bias[p]) s += dtype_to_float(((const TY *)P.bias[p])[n]);
    if (OP == MATMUL_OUT_SWIGLU) s = core_swiglu(matmul_rounded<TY>(s), matmul_rounded<TY>(s3));
    if (OP == MATMUL_OUT_GATE)
        s = core_sigmoid_gate(matmul_rounded<TY>(s), dtype_to_float(((const TY *)P.o)[(size_t)m * P.ldo + n]));
    ((TY *)P.y[p])[(size_t)m * P.ldy[p] + n] = dtype_from_float<TY>(s);
}

// The stages of a GEMV block: [MATMUL_GEMV_STAGES][R][MATMUL_GEMV_THREADS] 16-byte vectors, thread t's at [.][r][t].
#define MATMUL_GEMV_STAGE_BYTES (MATMUL_GEMV_ROWS * MATMUL_GEMV_THREADS * 16)

// Issue the copies of a block's next tile into `stage`: group g (its index over all parts' groups) at K offset
// k (thread t's vector: k = t VEC + i STEP), rows past N, k past K and groups past the last zero-filled; then
// advance (g, k) to the tile after it. One commit group a call, empty past the last group, so that a wait for the
// group issued STAGES - 1 calls ago means "this tile".
template <typename T, int R, MatmulOut OP>
__device__ __forceinline__ void matmul_gemv_issue(uint4 *stage, const MatmulParts &P, int groups, int blocks, int K,
                                                  int &g, int &k) {
    constexpr int VEC = 16 / sizeof(T), STEP = MATMUL_GEMV_THREADS * VEC, C = matmul_block_cols(OP, R);
    if (g < groups) {
        int b = g;
        const int p = matmul_block_part(P, C, b);
        const T *w = (const T *)P.w[p];
        const int N = P.N[p], n0 = b * C;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const bool ok = matmul_out_col<OP, R>(n0, r) < N && k < K;
            core_cp_async16(stage + r * MATMUL_GEMV_THREADS + threadIdx.x,
                            ok ? w + (size_t)matmul_w_row<OP, R>(n0, r, N) * K + k : w, ok);
        }
        k += STEP;
        if (k - (int)threadIdx.x * VEC >= K) { // the group's last stride: the next tile starts the block's next group
            k = threadIdx.x * VEC;
            g += blocks;
        }
    }
    core_cp_async_commit();
}

// The barrier of a GEMV block's MATMUL_GEMV_THREADS threads (named barrier 1), so that a kernel of more threads can
// run the block in its first MATMUL_GEMV_THREADS (the SDM addressing's launch, sdm/sdm_topk.cuh).
__device__ __forceinline__ void matmul_gemv_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(MATMUL_GEMV_THREADS) : "memory");
}

// GEMV block `block` of `blocks` (threads 0..MATMUL_GEMV_THREADS-1; `stages`: MATMUL_GEMV_STAGES *
// MATMUL_GEMV_STAGE_BYTES of shared memory) takes groups block, block + blocks, ... of `groups`; group g takes output
// columns [g' C, g' C + C) of the part it falls in (g' = its index within that part; C = matmul_block_cols(OP, R)).
template <typename T, typename TY, int M, MatmulOut OP>
__device__ __forceinline__ void matmul_gemv_block(const MatmulParts &P, const T *x, int K, int groups, int block,
                                                  int blocks, uint4 *stages) {
    constexpr int VEC = 16 / sizeof(T), STEP = MATMUL_GEMV_THREADS * VEC, R = MATMUL_GEMV_ROWS,
                  WARPS = MATMUL_GEMV_THREADS / 32, S = MATMUL_GEMV_STAGES, TILE = R * MATMUL_GEMV_THREADS;
    constexpr int C = matmul_block_cols(OP, R);
    __shared__ float part[WARPS][R * M];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, k0 = threadIdx.x * VEC;
    int ig = block, ik = k0; // the next tile to issue
#pragma unroll
    for (int i = 0; i < S - 1; i++) // before pdl_wait: W is constant in a step
        matmul_gemv_issue<T, R, OP>(stages + i * TILE, P, groups, blocks, K, ig, ik);
    pdl_enter();
    float acc[R][M] = {};
    int k = k0;
    for (int g = block, i = 0; g < groups; i++) {
        // refill the stage read one tile ago: only this thread reads or writes its slots, so program order keeps its
        // reads of them before the new copies; the compiler barrier keeps the reads where they are
        asm volatile("" ::: "memory");
        matmul_gemv_issue<T, R, OP>(stages + (i + S - 1) % S * TILE, P, groups, blocks, K, ig, ik);
        core_cp_async_wait<S - 1>(); // this tile's copies have landed
        if (k < K) {
            float wv[R][VEC], xv[VEC];
#pragma unroll
            for (int r = 0; r < R; r++) matmul_gemv_unpack(stages[i % S * TILE + r * MATMUL_GEMV_THREADS + threadIdx.x],
                                                           x, wv[r]);
#pragma unroll
            for (int m = 0; m < M; m++) {
                matmul_gemv_load(x + (size_t)m * K + k, xv);
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int e = 0; e < VEC; e++) acc[r][m] = fmaf(wv[r][e], xv[e], acc[r][m]);
            }
        }
        k += STEP;
        if (k - k0 < K) continue;
        // the group's last tile: its sums, through shared memory, warps in order
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int m = 0; m < M; m++) {
                float v = core_warp_sum(acc[r][m]);
                if (lane == 0) part[warp][r * M + m] = v;
                acc[r][m] = 0.f;
            }
        matmul_gemv_sync();
        int b = g;
        const int p = matmul_block_part(P, C, b), n0 = b * C, r = threadIdx.x / M, m = threadIdx.x % M;
        if (threadIdx.x < C * M && n0 + r < P.N[p]) {
            float s = 0.f, s3 = 0.f;
            for (int j = 0; j < WARPS; j++) s += part[j][r * M + m];
            if (OP == MATMUL_OUT_SWIGLU)
                for (int j = 0; j < WARPS; j++) s3 += part[j][(r + C) * M + m];
            matmul_part_store<TY, OP>(P, p, m, n0 + r, s, s3);
        }
        matmul_gemv_sync(); // part is written again at the next group's end
        g += blocks;
        k = k0;
    }
}

template <typename T, typename TY, int M, MatmulOut OP>
__global__ void __launch_bounds__(MATMUL_GEMV_THREADS) matmul_gemv_kernel(MatmulParts P, const T *x, int K,
                                                                         int groups) {
    extern __shared__ __align__(16) uint4 stages[];
    matmul_gemv_block<T, TY, M, OP>(P, x, K, groups, blockIdx.x, gridDim.x, stages);
}

// Tests: at most this many GEMV or MMA pipe blocks when non-zero, so that every shape has blocks taking several
// groups.
static unsigned g_matmul_grid_cap = 0;

// The grid of a persistent small-M kernel (`threads` threads, `smem` bytes of dynamic shared memory) over `groups`
// groups: as many blocks as fit on the GPU at once (g_matmul_grid_cap at most), at most one a group; its dynamic
// shared memory limit is raised to `smem` first. The blocks an SM are asked of the driver once per kernel and size,
// not per launch (an eager decode step launches some 180 products). All blocks that fit: capping them at 2 or 3 an
// SM, so that the next product's blocks fit beside them, made the batch-1 decode step 14% / 8% slower on an H100
// (BENCHMARKS.md).
static inline unsigned matmul_persistent_grid(const void *kernel, int threads, size_t smem, unsigned groups,
                                              const char *what) {
    static struct { const void *kernel; size_t smem; int blocks; } memo[64];
    static int used = 0;
    int blocks = -1;
    for (int i = 0; i < used && blocks < 0; i++)
        if (memo[i].kernel == kernel && memo[i].smem == smem) blocks = memo[i].blocks;
    if (blocks < 0) {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
        if (used < 64) memo[used++] = {kernel, smem, blocks};
    }
    if (blocks < 1) sdm_die("matmul %s: no block of %zu bytes of shared memory fits on an SM", what, smem);
    unsigned fit = (unsigned)(blocks * core_sm_count());
    if (g_matmul_grid_cap && g_matmul_grid_cap < fit) fit = g_matmul_grid_cap;
    return groups < fit ? groups : fit;
}

// Every part of P (whose op is OP) for M in 1..8 rows of X (P's input norm, if any, already in x), on the persistent
// grid (matmul_persistent_grid); which block takes a group does not change its sums.
template <typename T, typename TY, MatmulOut OP = MATMUL_OUT_PLAIN>
static inline void matmul_gemv_run(const MatmulParts *P, const T *x, int M, int K, cudaStream_t s) {
    const unsigned groups = matmul_parts_blocks(P, matmul_block_cols(OP, MATMUL_GEMV_ROWS));
    const size_t smem = MATMUL_GEMV_STAGES * MATMUL_GEMV_STAGE_BYTES;
    void (*kernel)(MatmulParts, const T *, int, int) = NULL;
#define MATMUL_GEMV_CASE(m) \
    case m: kernel = matmul_gemv_kernel<T, TY, m, OP>; break;
    switch (M) {
        MATMUL_GEMV_CASE(1) MATMUL_GEMV_CASE(2) MATMUL_GEMV_CASE(3) MATMUL_GEMV_CASE(4)
        MATMUL_GEMV_CASE(5) MATMUL_GEMV_CASE(6) MATMUL_GEMV_CASE(7) MATMUL_GEMV_CASE(8)
    }
#undef MATMUL_GEMV_CASE
    const unsigned grid = matmul_persistent_grid((const void *)kernel, MATMUL_GEMV_THREADS, smem, groups, "GEMV");
    launch_pdl(kernel, grid, MATMUL_GEMV_THREADS, smem, s, *P, x, K, (int)groups);
    cudaCheckLast();
}

// ------------------------------------------------------------------------------------------------------------------
// Small-M forward on tensor cores (decode batches, bf16): at 32 streams cuBLASLt's products took half of the
// flagship's 2.4 ms decode step, whose weights take 0.57 ms to read, and the GEMV's FMAs (one per weight and row)
// would be compute-bound at such M. Here mma.sync m16n8k16 (bf16 in, fp32 accumulate) computes Y = X·Wᵀ with
// A = X (MT = ceil(M/16) tiles of 16 rows, rows >= M zero) and B = Wᵀ (an n-tile: 8 output features). A block owns
// MATMUL_MMA_NT n-tiles of one part and all M rows; its warps split K in 32-wide k-blocks, warp w taking blocks w,
// w + WARPS, ... and loading W for UNROLL of them at once, around L1 (read once) so that L1 keeps X for the other
// blocks; then the warps' partials are added in warp order through shared memory (+ bias).
//
// Fragments come straight from global memory, 16 bytes a lane, with K permuted: an mma's sum does not depend on
// which 16 k it takes in which slot, as long as A and B use the same map. Lane l (g = l/4, t = l%4) loads
// w = W[n0+g][kb+8t, +8), lo = X[m0+g][same], hi = X[m0+g+8][same]; register .x holds k = kb+8t+{0,1}, .y +{2,3},
// .z +{4,5}, .w +{6,7}, the lower k in the lower half, as the ISA packs pairs. The PTX ISA's m16n8k16 .bf16 layouts
// (κ: the mma's k): A a0a1 (row g, κ 2t+{0,1}), a2a3 (row g+8, same), a4a5 (row g, κ 2t+8+{0,1}), a6a7 (row g+8,
// same); B b0b1 (κ 2t+{0,1}, col g), b2b3 (κ 2t+8+{0,1}, col g); C c0c1 (row g, col 2t+{0,1}), c2c3 (row g+8, same).
// So the first mma takes A = {lo.x, hi.x, lo.y, hi.y}, B = {w.x, w.y}: κ 2t+e -> k kb+8t+e, κ 2t+8+e -> kb+8t+2+e,
// the same map in A's rows g, g+8 and in B's column g, and over t = 0..3 a bijection onto {kb+8t+j : j < 4}. The
// second takes .z, .w: the same onto {kb+8t+4+j}. Together every k of the block once; c0..c3 are Y[m0+g][n0+2t+e]
// and Y[m0+g+8][n0+2t+e]. A 16-byte chunk past K is zero in W and X (K % 8 == 0 keeps a chunk whole).
//
// Batch invariance: an output's sum is fixed by K alone (the k-block -> warp split, each warp's mma sequence, the
// warp order of the final sum); a tensor core computes each element of D from its row of A and column of B, and
// padding rows are zeros never stored. So row m's bits depend neither on M nor on the other rows: a stream's logits
// do not depend on how many rows it takes with it. tests/gpu_test_sdm_layer.cu checks it, each row inside products
// of 1, 9 and 64 rows at another position of another tile. matmul_small_m_kernel says which products take it.

#ifndef MATMUL_MMA_MAX_M
#define MATMUL_MMA_MAX_M 64
#endif
#ifndef MATMUL_MMA_NT
#define MATMUL_MMA_NT 2 // n-tiles (8 rows of W each) a block
#endif
#ifndef MATMUL_MMA_WARPS
#define MATMUL_MMA_WARPS 8
#endif
#ifndef MATMUL_MMA_UNROLL
#define MATMUL_MMA_UNROLL 4 // k-blocks whose W loads a warp has in flight at once
#endif
#define MATMUL_MMA_ROWS (8 * MATMUL_MMA_NT)
static_assert(MATMUL_MMA_MAX_M <= 64, "matmul: the MMA kernel takes at most 4 tiles of 16 rows");

// c[0..4) += A·B for one m16n8k16 tile, operands packed as the ISA lays them out (see above).
__device__ __forceinline__ void matmul_mma_16816(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 16 bytes at p (zeros where !ok): W read once, without allocating in L1; X through L1.
__device__ __forceinline__ uint4 matmul_mma_load_w(const __nv_bfloat16 *p, bool ok) {
    uint4 u = make_uint4(0, 0, 0, 0);
    if (ok)
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
            : "l"(p));
    return u;
}
__device__ __forceinline__ uint4 matmul_mma_load_x(const __nv_bfloat16 *p, bool ok) {
    return ok ? __ldg((const uint4 *)p) : make_uint4(0, 0, 0, 0);
}

// A lane's W chunks of k-blocks kb0 + u WARPS (u < U) for its NT n-tiles: block rows 8 j + g (matmul_w_row; under
// SwiGLU a tile lies in W1 or in W3 as a whole, NT being even).
template <int U, int NT, MatmulOut OP>
__device__ __forceinline__ void matmul_mma_load_ws(uint4 (&wv)[U][NT], const __nv_bfloat16 *w, int n0, int N, int K,
                                                   int kb0, int g, int t) {
    static_assert(OP != MATMUL_OUT_SWIGLU || NT % 2 == 0, "matmul: SwiGLU pairs whole n-tiles of W1 and W3");
    constexpr int R = 8 * NT;
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            int n = matmul_w_row<OP, R>(n0, 8 * j, N) + g, k = (kb0 + u * MATMUL_MMA_WARPS) * 32 + 8 * t;
            wv[u][j] = matmul_mma_load_w(w + (size_t)n * K + k, matmul_out_col<OP, R>(n0, 8 * j) + g < N && k < K);
        }
}

// Block b takes output columns [b' C, b' C + C) of the part it falls in (C = matmul_block_cols(OP, R), R =
// MATMUL_MMA_ROWS) for all M <= 16 MT rows of X.
template <typename TY, int MT, MatmulOut OP>
__global__ void __launch_bounds__(MATMUL_MMA_WARPS * 32)
    matmul_mma_kernel(MatmulParts P, const __nv_bfloat16 *x, int M, int K) {
    constexpr int NT = MATMUL_MMA_NT, R = MATMUL_MMA_ROWS, WARPS = MATMUL_MMA_WARPS, U = MATMUL_MMA_UNROLL;
    constexpr int C = matmul_block_cols(OP, R);
    static_assert(WARPS * 16 * MT * R * sizeof(float) <= 48 * 1024, "matmul: MMA partials exceed shared memory");
    __shared__ float part[WARPS][16 * MT][R]; // [warp][row of X][row of W within the block]
    int b = blockIdx.x;
    const int p = matmul_block_part(P, C, b);
    const __nv_bfloat16 *w = (const __nv_bfloat16 *)P.w[p];
    const int N = P.N[p], n0 = b * C, KB = (K + 31) / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    float acc[MT][NT][4] = {};
    uint4 wv[U][NT];
    matmul_mma_load_ws<U, NT, OP>(wv, w, n0, N, K, warp, g, t); // before pdl_wait: W is constant in a step
    pdl_enter();
    for (int kb0 = warp; kb0 < KB; kb0 += WARPS * U) {
        if (kb0 != warp) matmul_mma_load_ws<U, NT, OP>(wv, w, n0, N, K, kb0, g, t);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k = (kb0 + u * WARPS) * 32 + 8 * t; // past K: zero fragments, D = C exactly
#pragma unroll
            for (int i = 0; i < MT; i++) {
                int m = 16 * i + g;
                uint4 lo = matmul_mma_load_x(x + (size_t)m * K + k, m < M && k < K);
                uint4 hi = matmul_mma_load_x(x + (size_t)(m + 8) * K + k, m + 8 < M && k < K);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    matmul_mma_16816(acc[i][j], lo.x, hi.x, lo.y, hi.y, wv[u][j].x, wv[u][j].y);
                    matmul_mma_16816(acc[i][j], lo.z, hi.z, lo.w, hi.w, wv[u][j].z, wv[u][j].w);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) part[warp][16 * i + g + 8 * (e / 2)][8 * j + 2 * t + e % 2] = acc[i][j][e];
    __syncthreads();
    for (int o = threadIdx.x; o < M * C; o += WARPS * 32) {
        int m = o / C, r = o % C;
        if (n0 + r >= N) continue;
        float s = 0.f, s3 = 0.f;
        for (int j = 0; j < WARPS; j++) s += part[j][m][r];
        if (OP == MATMUL_OUT_SWIGLU)
            for (int j = 0; j < WARPS; j++) s3 += part[j][m][r + C];
        matmul_part_store<TY, OP>(P, p, m, n0 + r, s, s3);
    }
}

// Every part of P (whose op is OP) for M in 1..64 rows of bf16 X (X and every W 16-byte aligned, K % 8 == 0), TY
// output.
template <typename TY, MatmulOut OP = MATMUL_OUT_PLAIN>
static inline void matmul_mma_run(const MatmulParts *P, const __nv_bfloat16 *x, int M, int K, cudaStream_t s) {
    unsigned grid = matmul_parts_blocks(P, matmul_block_cols(OP, MATMUL_MMA_ROWS));
#define MATMUL_MMA_CASE(mt) \
    case mt: launch_pdl(matmul_mma_kernel<TY, mt, OP>, grid, MATMUL_MMA_WARPS * 32, 0, s, *P, x, M, K); break;
    switch (ceil_div(M, 16)) {
        MATMUL_MMA_CASE(1) MATMUL_MMA_CASE(2) MATMUL_MMA_CASE(3) MATMUL_MMA_CASE(4)
    default: sdm_die("matmul: the MMA kernel takes 1..64 rows, not %d", M);
    }
#undef MATMUL_MMA_CASE
}

// ------------------------------------------------------------------------------------------------------------------
// Small-M forward on tensor cores with W streamed through shared memory (decode batches, bf16). The MMA kernel above
// loads W fragments straight from global memory, one short-lived block per 16 rows of W, and each block reads all of
// X: at 32 rows X's bytes are twice W's. Here, as in the GEMV, the grid holds as many blocks as fit on the GPU, block
// b takes groups b, b + G, ... of MATMUL_PIPE_ROWS rows of W, and tiles (a group's rows and X's M rows at
// MATMUL_PIPE_KT of K) stream through MATMUL_PIPE_STAGES stages of shared memory by cp.async, STAGES - 1 tiles ahead
// across group boundaries, so X's bytes are M / ROWS of W's. A thread copies the same 16-byte column of every tile
// (its row pointers set once a group: the copies cost a few instructions each). Warp (wn, wk) of a block owns the
// n-tiles wn + j MATMUL_PIPE_WARPS_N (j < MATMUL_PIPE_NTW; under SwiGLU the first half of them in W1, the second the
// same columns in W3) and the k-blocks wk, wk + WARPS_K, ... of each tile; at a group's end the WARPS_K partial sums
// of an output are added in wk order. So an output's sum is fixed by K alone (each warp's chain of mma over its
// k-blocks in order, with the K permutation of the MMA kernel: fragments of 16 bytes a lane), the same for every M
// and every row's neighbours: batch invariance, as above. Measured (H100, bench_layers): as fast as cuBLASLt on the
// FFN's wide product, so it takes decode's SwiGLU products (the SwiGLU in its store, a kernel less), and faster on
// the SDM input's 6148 columns, which cuBLASLt cuts in two; slower than cuBLASLt on the other products (q, k, v as
// one at 32 rows: 14.1 against 11.7 us; 2048 rows, 64 groups for 132 SMs: up to 2x) and than the MMA kernel on
// narrow ones. Tuned there for the FFN's product, which has the most groups: 2 x 2 warps (across n-tiles x across
// k-blocks) and 4 stages of tiles 128 deep. Deeper tiles and more warps are faster on q, k, v and the SDM input
// alone but not in the decode step, and a K split over clusters brings the 2048-row products only to cuBLASLt's
// speed (BENCHMARKS.md, twenty-second session).

#ifndef MATMUL_PIPE_WARPS_N
#define MATMUL_PIPE_WARPS_N 2 // warps across a group's n-tiles
#endif
#ifndef MATMUL_PIPE_WARPS_K
#define MATMUL_PIPE_WARPS_K 2 // warps across a tile's k-blocks
#endif
#ifndef MATMUL_PIPE_NTW
#define MATMUL_PIPE_NTW 2 // n-tiles (8 rows of W) a warp
#endif
#ifndef MATMUL_PIPE_KB
#define MATMUL_PIPE_KB 4 // 32-wide k-blocks a tile
#endif
#ifndef MATMUL_PIPE_STAGES
#define MATMUL_PIPE_STAGES 4
#endif
#define MATMUL_PIPE_THREADS (32 * MATMUL_PIPE_WARPS_N * MATMUL_PIPE_WARPS_K)
#define MATMUL_PIPE_ROWS (8 * MATMUL_PIPE_NTW * MATMUL_PIPE_WARPS_N)
#define MATMUL_PIPE_KT (32 * MATMUL_PIPE_KB)
#define MATMUL_PIPE_CH (MATMUL_PIPE_KT / 8)         // 16-byte chunks of a tile's row
#define MATMUL_PIPE_PASS (MATMUL_PIPE_THREADS / MATMUL_PIPE_CH) // rows the block copies at once
#define MATMUL_PIPE_LD MATMUL_PIPE_KT                // a shared-memory row, in bf16
static_assert(MATMUL_PIPE_STAGES >= 2 && MATMUL_PIPE_STAGES <= 4, "matmul: 2..4 pipeline stages");
static_assert(MATMUL_PIPE_NTW % 2 == 0, "matmul: SwiGLU pairs a warp's n-tiles in W1 and W3");
static_assert(MATMUL_PIPE_KB % MATMUL_PIPE_WARPS_K == 0 && MATMUL_PIPE_KB >= 2,
              "matmul: a tile's k-blocks split evenly over warps; rows of 8 or more chunks (the swizzle)");
static_assert(MATMUL_PIPE_THREADS % MATMUL_PIPE_CH == 0 && MATMUL_PIPE_ROWS % MATMUL_PIPE_PASS == 0 &&
                  16 % MATMUL_PIPE_PASS == 0 && MATMUL_PIPE_PASS % 2 == 0,
              "matmul: a thread copies one column of a tile's W rows and X rows");

// Where chunk c (16 bytes) of row r of a tile lies in its shared-memory row: odd rows swap the halves of each 128
// bytes, so that the two rows a quarter-warp reads (g = 2q, 2q + 1; chunks 4 kb + t) fall in 8 distinct 16-byte bank
// groups.
__device__ __forceinline__ int matmul_pipe_chunk(int r, int c) { return c ^ (r & 1) << 2; }

// Bytes of dynamic shared memory for MT tiles of 16 rows of X: the stages (W's rows, then X's), then the partial
// sums of the warps wk > 0 for the end of a group.
static inline size_t matmul_pipe_smem(int mt) {
    return MATMUL_PIPE_STAGES * (size_t)(MATMUL_PIPE_ROWS + 16 * mt) * MATMUL_PIPE_LD * sizeof(__nv_bfloat16) +
           (size_t)(MATMUL_PIPE_WARPS_K - 1) * MATMUL_PIPE_WARPS_N * mt * MATMUL_PIPE_NTW * 4 * 32 * sizeof(float);
}

// A thread's copies into the stages: the tile (g, k) it issues next (g over all parts' groups), and its rows of W
// in that group at its column of chunks (NULL past the part's N).
template <int MT, MatmulOut OP> struct MatmulPipeCopier {
    static constexpr int R = MATMUL_PIPE_ROWS, C = matmul_block_cols(OP, R), RPT = R / MATMUL_PIPE_PASS;
    const __nv_bfloat16 *w[RPT];
    int g, k;

    __device__ void point(const MatmulParts &P, int K, int groups) {
        if (g >= groups) return;
        int b = g;
        const int p = matmul_block_part(P, C, b), N = P.N[p], n0 = b * C, col = threadIdx.x % MATMUL_PIPE_CH * 8;
        const __nv_bfloat16 *wp = (const __nv_bfloat16 *)P.w[p];
#pragma unroll
        for (int j = 0; j < RPT; j++) {
            const int r = threadIdx.x / MATMUL_PIPE_CH + j * MATMUL_PIPE_PASS;
            w[j] = matmul_out_col<OP, R>(n0, r) < N ? wp + (size_t)matmul_w_row<OP, R>(n0, r, N) * K + col : NULL;
        }
    }
    // X's M rows at K offset kt into `stage` (chunks past K zero-filled)
    __device__ static void copy_x(__nv_bfloat16 *stage, const __nv_bfloat16 *x, int M, int K, int kt) {
        const int c = threadIdx.x % MATMUL_PIPE_CH, r0 = threadIdx.x / MATMUL_PIPE_CH, kk = kt + c * 8;
        __nv_bfloat16 *xs = stage + R * MATMUL_PIPE_LD + matmul_pipe_chunk(r0, c) * 8; // PASS is even: r's parity
#pragma unroll
        for (int j = 0; j < 16 * MT / MATMUL_PIPE_PASS; j++) {
            const int m = r0 + j * MATMUL_PIPE_PASS;
            if (m < M) core_cp_async16(xs + m * MATMUL_PIPE_LD, x + (size_t)m * K + (kk < K ? kk : 0), kk < K);
        }
    }
    // tile (g, k) into `stage` (W rows past N and chunks past K zero-filled; X's rows too unless x is NULL), then
    // advance to the block's next tile; one commit group a call, empty past the last group
    __device__ void copy(__nv_bfloat16 *stage, const MatmulParts &P, const __nv_bfloat16 *x, int M, int K,
                         int groups) {
        if (g < groups) {
            const int c = threadIdx.x % MATMUL_PIPE_CH, r0 = threadIdx.x / MATMUL_PIPE_CH;
            const bool in = k + c * 8 < K;
            __nv_bfloat16 *ws = stage + r0 * MATMUL_PIPE_LD + matmul_pipe_chunk(r0, c) * 8;
#pragma unroll
            for (int j = 0; j < RPT; j++)
                core_cp_async16(ws + j * MATMUL_PIPE_PASS * MATMUL_PIPE_LD, w[j] && in ? w[j] + k : (const void *)P.w[0],
                                w[j] && in);
            if (x) copy_x(stage, x, M, K, k);
            k += MATMUL_PIPE_KT;
            if (k >= K) { // the group's last tile: the next one starts the block's next group
                k = 0;
                g += gridDim.x;
                point(P, K, groups);
            }
        }
        core_cp_async_commit();
    }
};

// Wait until at most n (< MATMUL_PIPE_STAGES - 1, or the steady state's MATMUL_PIPE_STAGES - 2) of this thread's
// newest commit groups are in flight.
__device__ __forceinline__ void matmul_pipe_wait(int n) {
    if (n >= MATMUL_PIPE_STAGES - 2) core_cp_async_wait<MATMUL_PIPE_STAGES - 2>();
    else if (n <= 0) core_cp_async_wait<0>();
    else core_cp_async_wait<1>(); // n == 1 < STAGES - 2: four stages
}

// Block b takes groups b, b + G, ... of `groups` (G = gridDim.x; MatmulParts' groups of matmul_block_cols(OP,
// MATMUL_PIPE_ROWS) output columns) for all M <= 16 MT rows of X.
template <typename TY, int MT, MatmulOut OP>
__global__ void __launch_bounds__(MATMUL_PIPE_THREADS)
    matmul_pipe_kernel(MatmulParts P, const __nv_bfloat16 *x, int M, int K, int groups) {
    constexpr int R = MATMUL_PIPE_ROWS, C = matmul_block_cols(OP, R), S = MATMUL_PIPE_STAGES, NTW = MATMUL_PIPE_NTW,
                  LD = MATMUL_PIPE_LD, WN = MATMUL_PIPE_WARPS_N, WK = MATMUL_PIPE_WARPS_K, KT = MATMUL_PIPE_KT;
    constexpr int STAGE = (R + 16 * MT) * LD, PART = MT * NTW * 4; // a stage's bf16; a warp's sums a lane
    extern __shared__ __align__(16) __nv_bfloat16 pipe_smem[];
    float *partials = (float *)(pipe_smem + S * STAGE); // [WK - 1][WN][PART][32]
    const int lane = threadIdx.x % 32, wn = threadIdx.x / 32 % WN, wk = threadIdx.x / 32 / WN, g8 = lane / 4,
              t = lane % 4;
    MatmulPipeCopier<MT, OP> cp;
    cp.g = blockIdx.x, cp.k = 0;
    cp.point(P, K, groups);
    // W's first tiles before pdl_wait (W is constant in a step), then X's rows for them in a commit group of its own
    for (int i = 0; i < S - 1; i++) cp.copy(pipe_smem + i * STAGE, P, NULL, M, K, groups);
    pdl_enter();
    const int tiles = (K + KT - 1) / KT; // a group's
    for (int i = 0; i < S - 1 && blockIdx.x + i / tiles * gridDim.x < groups; i++)
        cp.copy_x(pipe_smem + i * STAGE, x, M, K, i % tiles * KT);
    core_cp_async_commit();
    float acc[MT][NTW][4] = {};
    int k = 0;
    for (int gr = blockIdx.x, i = 0; gr < groups; i++) {
        // tile i has landed (the first S - 1 tiles: with X's group, committed after them), and every warp is done
        // with tile i - 1, whose stage the next copy refills
        matmul_pipe_wait(i < S - 2 ? i : S - 2);
        __syncthreads();
        cp.copy(pipe_smem + (i + S - 1) % S * STAGE, P, x, M, K, groups);
        const __nv_bfloat16 *ws = pipe_smem + i % S * STAGE, *xs = ws + R * LD;
#pragma unroll
        for (int kb = wk; kb < MATMUL_PIPE_KB; kb += WK) {
            const int kc = matmul_pipe_chunk(g8, 4 * kb + t) * 8; // this lane's 16 bytes of the k-block (rows of
                                                                     // g8's parity)
            uint4 wv[NTW];
#pragma unroll
            for (int j = 0; j < NTW; j++) wv[j] = *(const uint4 *)(ws + (8 * (wn + j * WN) + g8) * LD + kc);
#pragma unroll
            for (int mi = 0; mi < MT; mi++) {
                const int m = 16 * mi + g8;
                uint4 lo = m < M ? *(const uint4 *)(xs + m * LD + kc) : make_uint4(0, 0, 0, 0);
                uint4 hi = m + 8 < M ? *(const uint4 *)(xs + (m + 8) * LD + kc) : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < NTW; j++) {
                    matmul_mma_16816(acc[mi][j], lo.x, hi.x, lo.y, hi.y, wv[j].x, wv[j].y);
                    matmul_mma_16816(acc[mi][j], lo.z, hi.z, lo.w, hi.w, wv[j].z, wv[j].w);
                }
            }
        }
        k += KT;
        if (k < K) continue;
        // the group's last tile: the warps wk > 0 hand their sums to warp (wn, 0), which adds them in wk order (the
        // partials are written again at the next group's end, after the barrier of at least one more tile)
        float *flat = &acc[0][0][0];
        auto partial = [&](int o, int e) -> float & { // warp (wn, o)'s sum e, lane `lane`
            return partials[(((size_t)(o - 1) * WN + wn) * PART + e) * 32 + lane];
        };
        if (WK > 1 && wk > 0)
#pragma unroll
            for (int e = 0; e < PART; e++) partial(wk, e) = flat[e];
        if (WK > 1) __syncthreads();
        if (wk == 0) {
            for (int o = 1; o < WK; o++)
#pragma unroll
                for (int e = 0; e < PART; e++) flat[e] += partial(o, e);
            // c0 c1: row g, columns 2t, 2t + 1 of the n-tile; c2 c3: row g + 8
            int b = gr;
            const int p = matmul_block_part(P, C, b), n0 = b * C;
            constexpr int JO = OP == MATMUL_OUT_SWIGLU ? NTW / 2 : NTW; // n-tiles of outputs (W1's under SwiGLU)
#pragma unroll
            for (int mi = 0; mi < MT; mi++)
#pragma unroll
                for (int j = 0; j < JO; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int m = 16 * mi + g8 + 8 * (e / 2),
                                  n = n0 + matmul_out_col<OP, R>(0, 8 * (wn + j * WN) + 2 * t + e % 2);
                        if (m < M && n < P.N[p])
                            matmul_part_store<TY, OP>(P, p, m, n, acc[mi][j][e],
                                                      OP == MATMUL_OUT_SWIGLU ? acc[mi][j + JO][e] : 0.f);
                    }
        }
#pragma unroll
        for (int e = 0; e < PART; e++) flat[e] = 0.f;
        gr += gridDim.x;
        k = 0;
    }
}

// Every part of P (whose op is OP) for M in 1..64 rows of bf16 X (X and every W 16-byte aligned, K % 8 == 0), TY
// output, on the persistent grid.
template <typename TY, MatmulOut OP = MATMUL_OUT_PLAIN>
static inline void matmul_pipe_run(const MatmulParts *P, const __nv_bfloat16 *x, int M, int K, cudaStream_t s) {
    const unsigned groups = matmul_parts_blocks(P, matmul_block_cols(OP, MATMUL_PIPE_ROWS));
    const int mt = ceil_div(M, 16);
    const size_t smem = matmul_pipe_smem(mt);
    void (*kernel)(MatmulParts, const __nv_bfloat16 *, int, int, int) = NULL;
    switch (mt) {
    case 1: kernel = matmul_pipe_kernel<TY, 1, OP>; break;
    case 2: kernel = matmul_pipe_kernel<TY, 2, OP>; break;
    case 3: kernel = matmul_pipe_kernel<TY, 3, OP>; break;
    case 4: kernel = matmul_pipe_kernel<TY, 4, OP>; break;
    default: sdm_die("matmul: the MMA pipe kernel takes 1..64 rows, not %d", M);
    }
    const unsigned grid = matmul_persistent_grid((const void *)kernel, MATMUL_PIPE_THREADS, smem, groups, "MMA pipe");
    launch_pdl(kernel, grid, MATMUL_PIPE_THREADS, smem, s, *P, x, M, K, (int)groups);
    cudaCheckLast();
}

#endif
