// core/matmul.cuh: the cuBLASLt matmul every layer uses, for row-major activations and row-major (out, in) weights.
//   forward          Y[M,N]  = X[M,K] · W[N,K]ᵀ (+ bias[N])
//   backward input   dX[M,K] = dY[M,N] · W[N,K]            (overwrite or accumulate)
//   backward weight  dW[N,K] = dY[M,N]ᵀ · X[M,K]           (overwrite or accumulate)
//   backward bias    dbias[N] = Σ_rows dY                   (deterministic two-pass column sum, no atomics)
// X, W share one input dtype (core/dtype.cuh): bf16 (fp32 accumulate) or fp32 (true fp32: CUBLAS_COMPUTE_32F never
// uses TF32). Outputs may be bf16 or fp32 (e.g. bf16 inputs with fp32 gradient buffers). Y/dY may have a row stride
// (ld >= N) so that a fused projection can pad its width to a multiple of 8 for aligned rows.
// One cuBLASLt handle and workspace are created on first use and live until matmul_destroy(); a dry run of the
// ledger (core/memory.h) records the workspace and creates no handle.
#ifndef SDM_CORE_MATMUL_CUH
#define SDM_CORE_MATMUL_CUH

#include "core/cuda_common.cuh"

#define MATMUL_WORKSPACE_BYTES (32u << 20)

typedef struct {
    int ready;
    cublasLtHandle_t handle;
    void *workspace;      // cuBLASLt workspace [MATMUL_WORKSPACE_BYTES]
    float *col_partials;  // bias_backward scratch [n_partials]
    size_t n_partials;
} MatmulContext;

static MatmulContext g_matmul = {0, NULL, NULL, NULL, 0};

static inline void matmul_init(void) {
    if (g_matmul.ready) return;
    g_matmul.ready = 1;
    if (!g_mem.dry_run) cublasCheck(cublasLtCreate(&g_matmul.handle));
    g_matmul.workspace = device_alloc(MEM_CUBLAS, MATMUL_WORKSPACE_BYTES);
}

static inline void matmul_destroy(void) {
    if (!g_matmul.ready) return;
    if (g_matmul.handle) cublasCheck(cublasLtDestroy(g_matmul.handle));
    device_free(g_matmul.workspace);
    device_free(g_matmul.col_partials);
    memset(&g_matmul, 0, sizeof(g_matmul));
}

// Column-major core: D[m,n] (ldd) = op(A)[m,k] · op(B)[k,n] + beta·D, optional bias[m] epilogue (bias dtype = D's).
// A row-major matrix is the column-major transpose, which is how the three public products map onto this.
static inline void matmul_lt(void *d, Dtype d_dt, int ldd, const void *a, int lda, int trans_a,
                             const void *b, int ldb, int trans_b, Dtype in_dt, int m, int n, int k,
                             float beta, const void *bias, cudaStream_t stream) {
    matmul_init();
    cudaDataType_t d_type = dtype_cuda(d_dt), in_type = dtype_cuda(in_dt);
    if (in_type != CUDA_R_16BF && in_type != CUDA_R_32F) sdm_die("matmul: inputs must be bf16 or fp32");
    if (d_type != CUDA_R_16BF && d_type != CUDA_R_32F) sdm_die("matmul: output must be bf16 or fp32");
    if (in_type == CUDA_R_32F && d_type != CUDA_R_32F) sdm_die("matmul: fp32 inputs need an fp32 output");
    if (m <= 0 || n <= 0 || k <= 0) sdm_die("matmul: empty product %d x %d x %d", m, n, k);
    cublasOperation_t opa = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, opb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDesc_t desc;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    if (bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    cublasLtMatrixLayout_t la, lb, ld;
    cublasCheck(cublasLtMatrixLayoutCreate(&la, in_type, trans_a ? k : m, trans_a ? m : k, lda));
    cublasCheck(cublasLtMatrixLayoutCreate(&lb, in_type, trans_b ? n : k, trans_b ? k : n, ldb));
    cublasCheck(cublasLtMatrixLayoutCreate(&ld, d_type, m, n, ldd));
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    size_t ws = MATMUL_WORKSPACE_BYTES;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    cublasCheck(cublasLtMatmulAlgoGetHeuristic(g_matmul.handle, desc, la, lb, ld, ld, pref, 1, &heur, &found));
    if (found == 0)
        sdm_die("matmul: no cuBLASLt algorithm for m=%d n=%d k=%d (lda %d ldb %d ldd %d)", m, n, k, lda, ldb, ldd);
    const float alpha = 1.0f;
    cublasCheck(cublasLtMatmul(g_matmul.handle, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &heur.algo,
                               g_matmul.workspace, MATMUL_WORKSPACE_BYTES, stream));
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    cublasCheck(cublasLtMatrixLayoutDestroy(la));
    cublasCheck(cublasLtMatrixLayoutDestroy(lb));
    cublasCheck(cublasLtMatrixLayoutDestroy(ld));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
}

// cuBLASLt runs far below peak when the output-feature count N is not a multiple of the tile width (measured on
// the H200: Z = X·Wᵀ with N = 6148 at 270 TFLOP/s, N = 2048 at 780). So N is split into an aligned main part
// (a multiple of MATMUL_ALIGN) and a narrow remainder, computed as two products.
#define MATMUL_ALIGN 64

static inline int matmul_main_part(int n) { return n > MATMUL_ALIGN ? n - n % MATMUL_ALIGN : n; }

// Y[M,N] (row stride ldy) = X[M,K] · W[N,K]ᵀ + bias[N] (bias may be NULL; its dtype is y_type's).
static inline void matmul_forward(void *y, Dtype y_type, int ldy, const void *x, const void *w,
                                  const void *bias, Dtype in_type, int M, int N, int K, cudaStream_t s) {
    // column-major: Yᵀ[N,M] = (W as col-major [K,N])ᵀ · (X as col-major [K,M])
    int n0 = matmul_main_part(N);
    matmul_lt(y, y_type, ldy, w, K, 1, x, K, 0, in_type, n0, M, K, 0.0f, bias, s);
    if (n0 < N)
        matmul_lt((void *)dtype_elem_ptr(y, n0, y_type), y_type, ldy, dtype_elem_ptr(w, (size_t)n0 * K, in_type), K, 1,
                  x, K, 0, in_type, N - n0, M, K, 0.0f, bias ? dtype_elem_ptr(bias, n0, y_type) : NULL, s);
}

// dX[M,K] (=, or += when accumulate) dY[M,N] (row stride lddy) · W[N,K].
static inline void matmul_backward_input(void *dx, Dtype dx_type, const void *dy, int lddy, const void *w,
                                         Dtype in_type, int M, int N, int K, int accumulate, cudaStream_t s) {
    // column-major: dXᵀ[K,M] = (W as col-major [K,N]) · (dY as col-major [N,M]); the sum over N in two parts
    int n0 = matmul_main_part(N);
    matmul_lt(dx, dx_type, K, w, K, 0, dy, lddy, 0, in_type, K, M, n0, accumulate ? 1.0f : 0.0f, NULL, s);
    if (n0 < N)
        matmul_lt(dx, dx_type, K, dtype_elem_ptr(w, (size_t)n0 * K, in_type), K, 0, dtype_elem_ptr(dy, n0, in_type),
                  lddy, 0, in_type, K, M, N - n0, 1.0f, NULL, s);
}

// dW[N,K] (=, or += when accumulate) dY[M,N]ᵀ (row stride lddy) · X[M,K].
static inline void matmul_backward_weight(void *dw, Dtype dw_type, const void *dy, int lddy, const void *x,
                                          Dtype in_type, int M, int N, int K, int accumulate,
                                          cudaStream_t s) {
    // column-major: dWᵀ[K,N] = (X as col-major [K,M]) · (dY as col-major [N,M])ᵀ
    int n0 = matmul_main_part(N);
    float beta = accumulate ? 1.0f : 0.0f;
    matmul_lt(dw, dw_type, K, x, K, 0, dy, lddy, 1, in_type, K, n0, M, beta, NULL, s);
    if (n0 < N)
        matmul_lt((void *)dtype_elem_ptr(dw, (size_t)n0 * K, dw_type), dw_type, K, x, K, 0,
                  dtype_elem_ptr(dy, n0, in_type), lddy, 1, in_type, K, N - n0, M, beta, NULL, s);
}

#define MATMUL_COLSUM_COLS 32
#define MATMUL_COLSUM_ROWS 8

// Pass 1: block (bx, split) sums columns [bx*32, bx*32+32) over its row range into partials[split, col].
// Each thread walks a fixed row subsequence, then the 8 row-lanes are added in a fixed order: deterministic.
__global__ void matmul_colsum_partial_kernel(float *partials, const void *dy, bool fp32, int ld, int M, int N,
                                      int rows_per_split) {
    __shared__ float acc[MATMUL_COLSUM_ROWS][MATMUL_COLSUM_COLS];
    int col = blockIdx.x * MATMUL_COLSUM_COLS + threadIdx.x;
    int r0 = blockIdx.y * rows_per_split, r1 = min(M, r0 + rows_per_split);
    float s = 0.0f;
    if (col < N)
        for (int r = r0 + threadIdx.y; r < r1; r += MATMUL_COLSUM_ROWS) s += dtype_load(dy, (size_t)r * ld + col, fp32);
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < N) {
        float t = 0.0f;
        for (int i = 0; i < MATMUL_COLSUM_ROWS; i++) t += acc[i][threadIdx.x];
        partials[(size_t)blockIdx.y * N + col] = t;
    }
}

// Pass 2: out[col] (=, or +=) the splits' partials summed in split order.
__global__ void matmul_colsum_finish_kernel(float *out, const float *partials, int splits, int N, int accumulate) {
    int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= N) return;
    float t = 0.0f;
    for (int s = 0; s < splits; s++) t += partials[(size_t)s * N + col];
    out[col] = accumulate ? out[col] + t : t;
}

// out[N] (=, or +=) Σ_{r<M} dy[r, :N] (row stride ld), fp32 result; dy is bf16 or fp32 (dy_type).
// The split count depends only on (M, N), so a given shape always sums in the same order.
static inline void matmul_colsum(float *out, const void *dy, Dtype dy_type, int ld, int M, int N, int accumulate,
                          cudaStream_t s) {
    matmul_init();
    int col_blocks = ceil_div(N, MATMUL_COLSUM_COLS);
    int splits = SDM_MAX(1, SDM_MIN(ceil_div(264, col_blocks), ceil_div(M, 256)));
    int rows_per_split = ceil_div(M, splits);
    splits = ceil_div(M, rows_per_split);
    size_t need = (size_t)splits * N;
    if (need > g_matmul.n_partials) {
        device_free(g_matmul.col_partials);
        g_matmul.col_partials = (float *)device_alloc(MEM_SCRATCH, need * sizeof(float));
        g_matmul.n_partials = need;
    }
    matmul_colsum_partial_kernel<<<dim3(col_blocks, splits), dim3(MATMUL_COLSUM_COLS, MATMUL_COLSUM_ROWS), 0, s>>>(
        g_matmul.col_partials, dy, dy_type == DT_FP32, ld, M, N, rows_per_split);
    cudaCheckLast();
    matmul_colsum_finish_kernel<<<ceil_div(N, 256), 256, 0, s>>>(out, g_matmul.col_partials, splits, N, accumulate);
    cudaCheckLast();
}

// dbias[N] (=, or +=) Σ_rows dY[M,N] (row stride lddy).
static inline void matmul_backward_bias(float *dbias, const void *dy, Dtype dy_type, int lddy, int M, int N,
                                        int accumulate, cudaStream_t s) {
    matmul_colsum(dbias, dy, dy_type, lddy, M, N, accumulate, s);
}

#endif
