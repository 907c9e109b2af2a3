// core/matmul.cuh: the cuBLASLt matmul every layer uses, for row-major activations and row-major (out, in) weights.
//   forward          Y[M,N]  = X[M,K] · W[N,K]ᵀ (+ bias[N])   (decode's small M: kernels of our own where they
//                                                             beat cuBLASLt, core/matmul_small_m.cuh, picked by
//                                                             matmul_small_m_kernel)
//   forward + op     H = silu(X·W1ᵀ) * (X·W3ᵀ), OG = sigmoid(X·Wᵀ) * O   (where a kernel of our own takes the
//                                                             product, else the caller runs the element-wise
//                                                             kernel: decode's SwiGLU and attention gate in the
//                                                             product's store, bit for bit)
//   input norm       X = RMSNorm(h + add), ResidualNorm     (the norm kernel into x, then the product:
//                                                             MatmulParts.norm)
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
#include "core/layers.cuh"
#include "core/matmul_small_m.cuh"

#define MATMUL_WORKSPACE_BYTES (32u << 20)

typedef struct {
    int ready;
    cublasLtHandle_t handle;
    void *workspace;      // cuBLASLt workspace [MATMUL_WORKSPACE_BYTES]
    float *col_partials;  // bias_backward scratch [n_partials]
    size_t n_partials;
} MatmulContext;

static MatmulContext g_matmul = {};

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

// A cuBLASLt algorithm's configuration as text: tile, stages, split-K (and its reduction), CTA swizzle, cluster.
static inline void matmul_lt_algo_info(const cublasLtMatmulAlgo_t *algo, char *out, size_t size) {
    int tile = 0, stages = 0, splitk = 0, red = 0, swz = 0, cluster = 0;
    size_t w;
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &w);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz, &w);
    cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &w);
    snprintf(out, size, "tile %d stages %d splitK %d red %d swz %d cluster %d", tile, stages, splitk, red, swz,
             cluster);
}

#define MATMUL_LT_RANKS 8 // the most heuristic candidates matmul_lt asks for (bench_layers times them)

// Column-major core: D[m,n] (ldd) = op(A)[m,k] · op(B)[k,n] + beta·D, optional bias[m] epilogue (bias dtype = D's).
// A row-major matrix is the column-major transpose, which is how the three public products map onto this.
// `rank`: which of cuBLASLt's heuristic candidates runs (0: its first choice); `info` (not NULL) gets that
// candidate's configuration. Returns 0 without running when the heuristic offers fewer than rank + 1.
static inline int matmul_lt(void *d, Dtype d_dt, int ldd, const void *a, int lda, int trans_a,
                            const void *b, int ldb, int trans_b, Dtype in_dt, int m, int n, int k,
                            float beta, const void *bias, cudaStream_t stream, int rank = 0,
                            char *info = NULL, size_t info_size = 0) {
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
    cublasLtMatmulHeuristicResult_t heur[MATMUL_LT_RANKS];
    int found = 0;
    if (rank < 0 || rank >= MATMUL_LT_RANKS) sdm_die("matmul: heuristic rank %d outside 0..%d", rank, MATMUL_LT_RANKS - 1);
    cublasCheck(cublasLtMatmulAlgoGetHeuristic(g_matmul.handle, desc, la, lb, ld, ld, pref, rank + 1, heur, &found));
    if (found == 0)
        sdm_die("matmul: no cuBLASLt algorithm for m=%d n=%d k=%d (lda %d ldb %d ldd %d)", m, n, k, lda, ldb, ldd);
    if (found > rank) {
        const float alpha = 1.0f;
        cublasCheck(cublasLtMatmul(g_matmul.handle, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &heur[rank].algo,
                                   g_matmul.workspace, MATMUL_WORKSPACE_BYTES, stream));
        if (info) matmul_lt_algo_info(&heur[rank].algo, info, info_size);
    }
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    cublasCheck(cublasLtMatrixLayoutDestroy(la));
    cublasCheck(cublasLtMatrixLayoutDestroy(lb));
    cublasCheck(cublasLtMatrixLayoutDestroy(ld));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
    return found > rank;
}

// cuBLASLt runs far below peak when the output-feature count N is not a multiple of the tile width (measured on
// the H200: Z = X·Wᵀ with N = 6148 at 270 TFLOP/s, N = 2048 at 780). So N is split into an aligned main part
// (a multiple of MATMUL_ALIGN) and a narrow remainder, computed as two products, in the forward and in both
// backward products. Still true with the SDM layer's 16-byte aligned rows (H100, the flagship step: its SDM
// projections take 17.0 ms split everywhere, 25.3 split in the forward alone, 31.1 unsplit; BENCHMARKS.md).
#define MATMUL_ALIGN 64

static inline int matmul_main_part(int n) { return n > MATMUL_ALIGN ? n - n % MATMUL_ALIGN : n; }

typedef enum { MATMUL_KERNEL_LT, MATMUL_KERNEL_GEMV, MATMUL_KERNEL_MMA, MATMUL_KERNEL_PIPE } MatmulKernel;

static inline const char *matmul_kernel_name(MatmulKernel k) {
    return k == MATMUL_KERNEL_MMA    ? "MMA"
           : k == MATMUL_KERNEL_PIPE ? "MMA pipe"
           : k == MATMUL_KERNEL_GEMV ? "GEMV"
                                     : "cuBLASLt";
}

// Which kernel takes a forward product (`parts` products sharing X, MatmulParts, of N weight rows in all) of M rows of
// K in_type inputs, X and every W at `addr` (their addresses or'ed) 16-byte aligned, as measured on the H200
// (BENCHMARKS.md, decode's products): one bf16 row or up to MATMUL_GEMV_MAX_M fp32 rows the GEMV (63-91% of HBM at
// one row; its FMAs bind it beyond); up to MATMUL_MMA_MAX_M bf16 rows the MMA kernel for several parts, one launch
// where cuBLASLt takes one per part (q, k, v apart at 32 rows: 16.5 against 17.4 us), and for narrow products, where
// cuBLASLt's fixed cost dominates (the bytes LM head, 258 x 2048, at 32 rows: 4.9 against 9.4 us); other single bf16
// products of 2 or more rows cuBLASLt (the FFN's 2048 -> 11264 at 32 rows: 13.4 against 26.0 us by the MMA kernel,
// whose blocks fill HBM's queue less well); but the MMA pipe kernel, which moves wide products' weights as fast as
// cuBLASLt, takes a SwiGLU product (op) of 2..64 bf16 rows, the SwiGLU in its store, a kernel less (H100, the FFN's
// 2048 -> 11264 at 8 / 32 rows: 17.8 / 18.6 us against cuBLASLt's 17.6 / 18.1 and the SwiGLU kernel's 3.3), and a
// wide one whose N cuBLASLt would cut into an aligned main part and a remainder (the SDM input's 6148 at 8 / 32 rows:
// 11.7 / 14.3 against 16.7 / 17.4 with the remainder on a stream of its own, since removed; BENCHMARKS.md). The
// small-M kernels need rows of whole 16-byte vectors.
#define MATMUL_MMA_NARROW 512
static inline MatmulKernel matmul_small_m_kernel(Dtype in_type, int M, int N, int K, int parts, uintptr_t addr,
                                                 MatmulOut op = MATMUL_OUT_PLAIN) {
    if (M < 1 || (size_t)K * dtype_size(in_type) % 16 || addr % 16) return MATMUL_KERNEL_LT;
    if (in_type == DT_FP32) return M <= MATMUL_GEMV_MAX_M ? MATMUL_KERNEL_GEMV : MATMUL_KERNEL_LT;
    if (M == 1) return MATMUL_KERNEL_GEMV;
    if (M > MATMUL_MMA_MAX_M) return MATMUL_KERNEL_LT;
    if (op == MATMUL_OUT_SWIGLU) return MATMUL_KERNEL_PIPE;
    if (parts == 1 && N > MATMUL_MMA_NARROW) return N % MATMUL_ALIGN ? MATMUL_KERNEL_PIPE : MATMUL_KERNEL_LT;
    return MATMUL_KERNEL_MMA;
}

// The weight rows of P: every part's N, twice under SwiGLU (W = [W1; W3]).
static inline int matmul_parts_rows(const MatmulParts *P) {
    int n = 0;
    for (int p = 0; p < P->n; p++) n += P->N[p];
    return P->op == MATMUL_OUT_SWIGLU ? 2 * n : n;
}

// P's output op OP (not MATMUL_OUT_PLAIN) by `kernel`, X and Y of one dtype: the only instantiations it needs.
template <MatmulOut OP>
static inline void matmul_small_m_op(const MatmulParts *P, MatmulKernel kernel, const void *x, Dtype dtype, int M,
                                     int K, cudaStream_t s) {
    typedef __nv_bfloat16 bf;
    if (kernel == MATMUL_KERNEL_MMA) matmul_mma_run<bf, OP>(P, (const bf *)x, M, K, s);
    else if (kernel == MATMUL_KERNEL_PIPE) matmul_pipe_run<bf, OP>(P, (const bf *)x, M, K, s);
    else if (dtype == DT_FP32) matmul_gemv_run<float, float, OP>(P, (const float *)x, M, K, s);
    else matmul_gemv_run<bf, bf, OP>(P, (const bf *)x, M, K, s);
}

// X and every W of P, or'ed: 16-byte aligned when its low 4 bits are 0.
static inline uintptr_t matmul_parts_addr(const MatmulParts *P, const void *x) {
    uintptr_t addr = (uintptr_t)x;
    for (int p = 0; p < P->n; p++) addr |= (uintptr_t)P->w[p];
    return addr;
}

// Y[M,N] (row stride ldy) = X[M,K] · W[N,K]ᵀ + bias[N] by cuBLASLt, whatever M.
static inline void matmul_forward_lt(void *y, Dtype y_type, int ldy, const void *x, const void *w,
                                     const void *bias, Dtype in_type, int M, int N, int K, cudaStream_t s);

// Every part of P by the given kernel (the GEMV for M <= MATMUL_GEMV_MAX_M, the MMA kernels for bf16 and
// M <= MATMUL_MMA_MAX_M, all on 16-byte rows; cuBLASLt part by part). The tests and benches pick kernels here.
// P's input norm, if any, by the norm's own kernel into x first.
static inline void matmul_parts_run(MatmulKernel kernel, const MatmulParts *P, Dtype y_type, const void *x,
                                    Dtype in_type, int M, int K, cudaStream_t s) {
    typedef __nv_bfloat16 bf;
    if (in_type == DT_FP32 && y_type != DT_FP32) sdm_die("matmul: fp32 inputs need an fp32 output");
    bool rows16 = (size_t)K * dtype_size(in_type) % 16 == 0 && matmul_parts_addr(P, x) % 16 == 0;
    if (kernel != MATMUL_KERNEL_LT && (!rows16 || M < 1 ||
                                       M > (kernel == MATMUL_KERNEL_GEMV ? MATMUL_GEMV_MAX_M : MATMUL_MMA_MAX_M) ||
                                       (kernel != MATMUL_KERNEL_GEMV && in_type != DT_BF16)))
        sdm_die("matmul: the %s kernel cannot take %d rows of K = %d (%s)", matmul_kernel_name(kernel), M, K,
                dtype_name(in_type));
    if (P->op != MATMUL_OUT_PLAIN && (kernel == MATMUL_KERNEL_LT || P->n != 1 || y_type != in_type || P->bias[0]))
        sdm_die("matmul: an output op takes a kernel of our own, one part, no bias, and Y in X's dtype");
    if (P->norm.h) residual_norm_forward(&P->norm, (void *)x, in_type, M, K, s);
    if (P->op == MATMUL_OUT_SWIGLU) matmul_small_m_op<MATMUL_OUT_SWIGLU>(P, kernel, x, in_type, M, K, s);
    else if (P->op == MATMUL_OUT_GATE) matmul_small_m_op<MATMUL_OUT_GATE>(P, kernel, x, in_type, M, K, s);
    else if (kernel == MATMUL_KERNEL_MMA) {
        if (y_type == DT_FP32) matmul_mma_run<float>(P, (const bf *)x, M, K, s);
        else matmul_mma_run<bf>(P, (const bf *)x, M, K, s);
    } else if (kernel == MATMUL_KERNEL_PIPE) {
        if (y_type == DT_FP32) matmul_pipe_run<float>(P, (const bf *)x, M, K, s);
        else matmul_pipe_run<bf>(P, (const bf *)x, M, K, s);
    } else if (kernel == MATMUL_KERNEL_GEMV) {
        if (in_type == DT_FP32) matmul_gemv_run<float, float>(P, (const float *)x, M, K, s);
        else if (y_type == DT_FP32) matmul_gemv_run<bf, float>(P, (const bf *)x, M, K, s);
        else matmul_gemv_run<bf, bf>(P, (const bf *)x, M, K, s);
    } else {
        for (int p = 0; p < P->n; p++)
            matmul_forward_lt(P->y[p], y_type, P->ldy[p], x, P->w[p], P->bias[p], in_type, M, P->N[p], K, s);
    }
}

// Y[M,N] (row stride ldy) = X[M,K] · W[N,K]ᵀ + bias[N] by cuBLASLt, whatever M.
static inline void matmul_forward_lt(void *y, Dtype y_type, int ldy, const void *x, const void *w,
                                     const void *bias, Dtype in_type, int M, int N, int K, cudaStream_t s) {
    // column-major: Yᵀ[N,M] = (W as col-major [K,N])ᵀ · (X as col-major [K,M])
    int n0 = matmul_main_part(N);
    matmul_lt(y, y_type, ldy, w, K, 1, x, K, 0, in_type, n0, M, K, 0.0f, bias, s);
    if (n0 < N)
        matmul_lt((void *)dtype_elem_ptr(y, n0, y_type), y_type, ldy, dtype_elem_ptr(w, (size_t)n0 * K, in_type), K, 1, x, K, 0,
                  in_type, N - n0, M, K, 0.0f, bias ? dtype_elem_ptr(bias, n0, y_type) : NULL, s);
}

// Y[M,N] (row stride ldy) = X[M,K] · W[N,K]ᵀ + bias[N] (bias may be NULL; its dtype is y_type's); norm: X's input
// norm (MatmulParts.norm; x its buffer) or NULL.
static inline void matmul_forward(void *y, Dtype y_type, int ldy, const void *x, const void *w,
                                  const void *bias, Dtype in_type, int M, int N, int K, cudaStream_t s,
                                  const ResidualNorm *norm = NULL) {
    MatmulParts P = {1, {w}, {y}, {bias}, {N}, {ldy}};
    if (norm) P.norm = *norm;
    matmul_parts_run(matmul_small_m_kernel(in_type, M, N, K, 1, matmul_parts_addr(&P, x)), &P, y_type, x, in_type, M,
                     K, s);
}

// P's parts as the one product they are in memory (returns 1 and sets *one): each W_p right after W_{p-1}, each
// Y_p right after Y_{p-1}'s columns in rows of one stride, no bias, no output op. The small-M kernels' outputs do
// not depend on how a product is cut into parts; cuBLASLt then takes it in one call where it would take one per
// part (a decode step's q, k, v at 32 rows: 9.2 us as one product, 16.5 by the MMA kernel; BENCHMARKS.md).
static inline int matmul_parts_merge(const MatmulParts *P, Dtype y_type, Dtype in_type, int K, MatmulParts *one) {
    if (P->n < 2 || P->op != MATMUL_OUT_PLAIN) return 0;
    int N = P->N[0];
    for (int p = 1; p < P->n; p++) {
        if (P->bias[p - 1] || P->bias[p] || P->ldy[p] != P->ldy[0] ||
            P->w[p] != dtype_elem_ptr(P->w[p - 1], (size_t)P->N[p - 1] * K, in_type) ||
            P->y[p] != dtype_elem_ptr(P->y[p - 1], P->N[p - 1], y_type))
            return 0;
        N += P->N[p];
    }
    *one = (MatmulParts){1, {P->w[0]}, {P->y[0]}, {NULL}, {N}, {P->ldy[0]}};
    one->norm = P->norm;
    return 1;
}

// Every part of P (see MatmulParts): one launch when M is small or the parts are one product in memory
// (matmul_parts_merge), else one cuBLASLt product each.
static inline void matmul_forward_parts(const MatmulParts *P, Dtype y_type, const void *x, Dtype in_type, int M,
                                        int K, cudaStream_t s) {
    if (P->n < 1 || P->n > MATMUL_MAX_PARTS) sdm_die("matmul: %d parts (1..%d)", P->n, MATMUL_MAX_PARTS);
    MatmulParts one;
    if (matmul_parts_merge(P, y_type, in_type, K, &one)) P = &one;
    matmul_parts_run(matmul_small_m_kernel(in_type, M, matmul_parts_rows(P), K, P->n, matmul_parts_addr(P, x)), P,
                     y_type, x, in_type, M, K, s);
}

// P (one part with an output op, X and Y of one dtype) by the kernel matmul_small_m_kernel picks for its product;
// returns 0 where that is cuBLASLt, having done nothing but P's input norm, if any, into x (the caller's product
// reads X there).
static inline int matmul_forward_op(const MatmulParts *P, const void *x, Dtype dtype, int M, int K, cudaStream_t s) {
    MatmulKernel kernel = matmul_small_m_kernel(dtype, M, matmul_parts_rows(P), K, 1, matmul_parts_addr(P, x), P->op);
    if (kernel == MATMUL_KERNEL_LT) {
        if (P->norm.h) residual_norm_forward(&P->norm, (void *)x, dtype, M, K, s);
        return 0;
    }
    matmul_parts_run(kernel, P, dtype, x, dtype, M, K, s);
    return 1;
}

// H[M,N] = silu(X·W1ᵀ) * (X·W3ᵀ) for W13 = [W1; W3] [2N, K], all of one dtype: the bits of matmul_forward into
// A|B [M, 2N] followed by swiglu_forward (core/layers.cuh), in one small-M launch (MATMUL_OUT_SWIGLU); norm: X's input
// norm (MatmulParts.norm; x its buffer) or NULL. Returns 0, having done nothing but the norm into x, when no small-M
// kernel takes the product: the caller runs those two on x.
static inline int matmul_forward_swiglu(void *h, const void *x, const void *w13, Dtype dtype, int M, int N, int K,
                                        cudaStream_t s, const ResidualNorm *norm = NULL) {
    MatmulParts P = {1, {w13}, {h}, {NULL}, {N}, {N}, MATMUL_OUT_SWIGLU, NULL, 0};
    if (norm) P.norm = *norm;
    return matmul_forward_op(&P, x, dtype, M, K, s);
}

// OG[M,N] = sigmoid(X·Wᵀ) * O[M,N] (OG, O of row stride N), all of one dtype: the bits of matmul_forward into Z
// followed by attn_gate_forward (attention/attn_rope_gate.cuh), in one small-M launch (MATMUL_OUT_GATE); returns 0
// as matmul_forward_swiglu does.
static inline int matmul_forward_gate(void *og, const void *o, const void *x, const void *w, Dtype dtype, int M,
                                      int N, int K, cudaStream_t s) {
    MatmulParts P = {1, {w}, {og}, {NULL}, {N}, {N}, MATMUL_OUT_GATE, o, N};
    return matmul_forward_op(&P, x, dtype, M, K, s);
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
