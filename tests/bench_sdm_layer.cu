// tests/bench_sdm_layer.cu: forward + backward of one SDM layer with its projections (sdm/sdm_layer.cuh), bf16,
// on the issue-4 shapes: the flagship layer (D=2048, H=2, N=65536, W=R=64, C=64, B=8, T=4096; target <= 21 ms,
// <= 10 GiB) and D=768, H=1, N=36864, W=R=64, C=64, B=2, T=8192 (target <= 8 ms). Both with the flagship's
// options (learned bank, output gate, readings LayerNorm), on a stream of its own as train_sdm runs it (the forward's
// chunk loop launches with programmatic dependent launch there). Reports the median time of fwd+bwd, the
// forward/backward split, the per-stage times (the layer's marks in a step profile, core/profile.cuh), the device
// memory held, and the GEMM FLOPs against the measured bf16 matmul peak (~790 TFLOP/s on the H200). Then the
// flagship layer's decode step (sdm/sdm_infer.cuh: projections, top-k, memory op, readout) at batch 1 and 32
// (targets <= 25 and <= 60 us; its addressing is one launch of the block kernel) with its parts timed alone, and the
// top-k alone by both kernels over P.
#include "sdm/sdm_infer.cuh"
#include "tests/bench.h"
#include "tests/test.h"

#define BF16_PEAK_TFLOPS 790.0
#define HBM_TBPS 4.3 // measured copy bandwidth of the H200 (BENCHMARKS.md)

// x[i] = scale * (uniform(-1, 1) from a hash of (seed, i)), in the compute dtype
__global__ void fill_random_kernel(void *x, bool fp32, size_t n, uint32_t seed, float scale, float offset) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed * 2246822519u ^ (uint32_t)(i >> 32) * 3266489917u;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        dtype_store(x, i, offset + scale * ((float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f), fp32);
    }
}

static void *rand_buf(size_t n, uint32_t seed, float scale, float offset) {
    void *p;
    cudaCheck(cudaMalloc(&p, n * 2));
    fill_random_kernel<<<1024, 256>>>(p, false, n, seed, scale, offset);
    cudaCheckLast();
    return p;
}

static float *zero_grad(size_t n) {
    float *p;
    cudaCheck(cudaMalloc(&p, n * 4));
    cudaCheck(cudaMemset(p, 0, n * 4));
    return p;
}


// Mean time (ms) of `call` over reps launches on stream 0, after one warm-up launch.
#define TIME_PIECE(label, flops, call)                                                                          \
    do {                                                                                                       \
        call;                                                                                                  \
        cudaCheck(cudaEventRecord(e0, 0));                                                                     \
        for (int rep_ = 0; rep_ < 5; rep_++) call;                                                             \
        cudaCheck(cudaEventRecord(e1, 0));                                                                     \
        cudaCheck(cudaEventSynchronize(e1));                                                                   \
        float ms_;                                                                                             \
        cudaCheck(cudaEventElapsedTime(&ms_, e0, e1));                                                         \
        ms_ /= 5;                                                                                              \
        if ((flops) > 0) printf("     %-34s %8.3f ms  %5.0f TFLOP/s\n", label, ms_, (flops) / (ms_ * 1e-3) / 1e12); \
        else printf("     %-34s %8.3f ms\n", label, ms_);                                                      \
    } while (0)

// Each piece of the layer outside the memory op timed on its own (after a fresh forward, so the inputs are real).
static void bench_pieces(SdmLayer *L, const SdmLayerParams *p, const SdmLayerGrads *g, const void *x, const void *dy,
                         void *y, void *dx) {
    const SdmDims *s = &L->s;
    int BT = L->B * L->T, H = s->heads, P = BT * H, D = s->dim, d = s->head_dim;
    double fin = 2.0 * BT * D * (double)L->n_in, fout = 2.0 * BT * (double)D * D;
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    sdm_layer_forward(L, p, x, y, 0);
    printf("   pieces (mean of 5):\n");
    TIME_PIECE("fwd GEMM in-projection", fin,
               matmul_forward(L->z, L->ctype, L->ldz, x, p->w_in, L->b_packed, L->ctype, BT, L->n_in, D, 0));
    TIME_PIECE("fwd GEMM out-projection", fout,
               matmul_forward(y, L->ctype, D, L->r, p->w_out, p->b_out, L->ctype, BT, D, D, 0));
    TIME_PIECE("addressing (gates, values, both top-k)", 0, sdm_layer_select(L, p, 0));
    TIME_PIECE("bank copy from M0", 0,
               sdm_bank_init(L->bank, DT_BF16, p->bank0, DT_BF16, (size_t)H * s->slots * d, L->B, 0));
    SdmReadoutArgs ra = sdm_layer_readout_args(L, p);
    TIME_PIECE("readout forward (LN, gate)", 0,
               sdm_readout_forward(&ra, L->o, L->r, L->ln_mean, L->ln_rstd, 0));
    TIME_PIECE("bwd GEMM out dW", fout,
               matmul_backward_weight(g->w_out, DT_FP32, dy, D, L->r, L->ctype, BT, D, D, 1, 0));
    TIME_PIECE("bwd GEMM out dX", fout,
               matmul_backward_input(L->tmp.dr, DT_FP32, dy, D, p->w_out, L->ctype, BT, D, D, 0, 0));
    TIME_PIECE("bwd bias matmul_colsum dY", 0, matmul_backward_bias(g->b_out, dy, L->ctype, D, BT, D, 1, 0));
    TIME_PIECE("readout backward (LN, gate)", 0,
               sdm_readout_backward(&ra, L->o, L->ln_mean, L->ln_rstd, L->tmp.dr, L->z, L->tmp.ln_partials, g->ln_w,
                                    g->ln_b, 0));
    SdmWriteGateArgs ga;
    ga.z = L->z; ga.dgamma = L->tmp.dgamma; ga.g = L->g; ga.beta = L->beta; ga.dbeta = L->tmp.dbeta;
    ga.A_log = p->A_log; ga.dt_bias = p->dt_bias; ga.kwd = 0;
    ga.col_a = L->col_a; ga.col_c = L->col_c; ga.gate_grad = L->tmp.gate_grad;
    TIME_PIECE("addressing backward, writes+gates", 0,
               sdm_address_backward(&L->tw, L->wslot, L->kappa, L->tmp.dkappa, 1.0f, P, H, L->z, DT_BF16, L->ldz,
                                    L->col_zk, 1, &ga, 0));
    TIME_PIECE("addressing backward, reads", 0,
               sdm_address_backward(&L->tr, L->rslot, L->rho, L->tmp.drho, 1.0f, P, H, L->z, DT_BF16, L->ldz,
                                    L->col_zq, 0, NULL, 0));
    TIME_PIECE("pack dv", 0, (sdm_pack_dv_kernel<<<BT, 256>>>(L->tmp.dv, L->z, false, L->ldz, L->col_v, D)));
    TIME_PIECE("dM0 batch sum", 0,
               sdm_bank_grad_sum(g->bank0, L->tmp.dbank, s->grad_bank_bf16, (size_t)H * s->slots * d, L->B, 0));
    TIME_PIECE("bwd GEMM in dW", fin,
               matmul_backward_weight(g->w_in, DT_FP32, L->z, L->ldz, x, L->ctype, BT, L->n_in, D, 1, 0));
    TIME_PIECE("bwd bias matmul_colsum dZ (all columns)", 0,
               matmul_backward_bias(g->b_in[0], L->z, L->ctype, L->ldz, BT, L->n_in, 1, 0));
    TIME_PIECE("bwd GEMM in dX", fin,
               matmul_backward_input(dx, L->ctype, L->z, L->ldz, p->w_in, L->ctype, BT, L->n_in, D, 0, 0));
    cudaCheckLast();
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
}

// Mean ms per profiled step of one part of the layer.
static float part_ms(Profiler *prof, const char *part) {
    return (float)(prof->table.part[prof_part(&prof->table, part)].ms / prof->table.steps);
}

// The layer's hyper-parameters with the flagship's options (learned bank, output gate, readings LayerNorm).
static SdmDims layer_dims(int D, int H, int nf, int W, int C) {
    SdmDims s;
    memset(&s, 0, sizeof(s));
    s.dim = D; s.heads = H; s.head_dim = D / H;
    s.n_factors = 2; s.factor_dims[0] = s.factor_dims[1] = nf; s.slots = nf * nf; s.key_dim = 2 * nf;
    s.writes = s.reads = W; s.chunk = C;
    s.write_act = s.read_act = SDM_ACT_SOFTMAX; s.write_scale = s.read_scale = 1.0f;
    s.learned_bank = 1; s.output_gate = 1; s.normalize_readings = 1; s.norm_eps = 1e-5f;
    s.snapshot = SDM_SNAP_NONE; s.bank_fp32 = 0;
    return s;
}

// Random bf16 parameters of layer L (seeds from `seed`); *bias holds the input biases, in z's column order.
static SdmLayerParams random_layer_params(const SdmLayer *L, uint32_t seed, void **bias) {
    const SdmDims *s = &L->s;
    int D = s->dim, H = s->heads, d = s->head_dim;
    float ws = 1.0f / sqrtf((float)D);
    SdmLayerParams p;
    memset(&p, 0, sizeof(p));
    p.w_in = rand_buf((size_t)L->n_in * D, seed + 1, 2.0f * ws, 0.0f);
    *bias = rand_buf(L->n_in, seed + 2, 0.1f, 0.0f);
    for (int i = 0; i < SDM_B_COUNT; i++) {
        int col, width;
        sdm_layer_bias_block(L, i, &col, &width);
        p.b_in[i] = dtype_elem_ptr(*bias, col, DT_BF16);
    }
    p.A_log = rand_buf(H, seed + 3, 0.5f, 1.0f);
    p.dt_bias = rand_buf(H, seed + 4, 1.0f, -3.0f);
    p.ln_w = rand_buf(d, seed + 5, 0.1f, 1.0f);
    p.ln_b = rand_buf(d, seed + 6, 0.1f, 0.0f);
    p.w_out = rand_buf((size_t)D * D, seed + 7, ws, 0.0f);
    p.b_out = rand_buf(D, seed + 8, 0.1f, 0.0f);
    p.bank0 = rand_buf((size_t)H * s->slots * d, seed + 9, 0.02f, 0.0f);
    return p;
}

static void free_layer_params(SdmLayerParams *p, void *bias) {
    const void *bufs[] = {p->w_in, bias, p->A_log, p->dt_bias, p->ln_w, p->ln_b, p->w_out, p->b_out, p->bank0};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaCheck(cudaFree((void *)bufs[i]));
}

static void bench(const char *name, int D, int H, int nf, int W, int C, int B, int T, double target_ms) {
    SdmDims s = layer_dims(D, H, nf, W, C);
    size_t free0, total;
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemGetInfo(&free0, &total));
    Profiler *prof = prof_create(BF16_PEAK_TFLOPS, HBM_TBPS);
    SdmLayer L = sdm_layer_create(&s, B, T, DT_BF16, prof, 0, NULL);
    size_t BT = (size_t)B * T, d = s.head_dim, nbank = (size_t)H * s.slots * d;
    void *bias;
    SdmLayerParams p = random_layer_params(&L, 0, &bias);
    SdmLayerGrads g;
    memset(&g, 0, sizeof(g));
    float *gbias = zero_grad(L.n_in);
    for (int i = 0; i < SDM_B_COUNT; i++) {
        int col, width;
        sdm_layer_bias_block(&L, i, &col, &width);
        g.b_in[i] = gbias + col;
    }
    g.w_in = zero_grad((size_t)L.n_in * D); g.A_log = zero_grad(H);
    g.dt_bias = zero_grad(H); g.ln_w = zero_grad(d); g.ln_b = zero_grad(d); g.w_out = zero_grad((size_t)D * D);
    g.b_out = zero_grad(D); g.bank0 = zero_grad(nbank);
    void *x = rand_buf(BT * D, 10, 1.0f, 0.0f), *dy = rand_buf(BT * D, 11, 1.0f, 0.0f);
    void *y = rand_buf(BT * D, 12, 1.0f, 0.0f), *dx = rand_buf(BT * D, 13, 1.0f, 0.0f);

    const int warm = 2, iters = 7;
    float tot[16], fwd[16], bwd[16], stsum[4];
    cudaEvent_t e0, e1, e2;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    cudaCheck(cudaEventCreate(&e2));
    size_t free_min = free0;
    cudaStream_t st; // a stream of its own, as training runs the layer (PDL in the forward's chunk loop)
    cudaCheck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaCheck(cudaDeviceSynchronize()); // the inputs, filled on the legacy stream
    for (int it = 0; it < warm + iters; it++) {
        prof_step_begin(prof, st);
        cudaCheck(cudaEventRecord(e0, st));
        sdm_layer_forward(&L, &p, x, y, st);
        cudaCheck(cudaEventRecord(e1, st));
        sdm_layer_backward(&L, &p, x, dy, dx, &g, st);
        cudaCheck(cudaEventRecord(e2, st));
        prof_step_end(prof, it >= warm);
        cudaCheck(cudaEventSynchronize(e2));
        size_t fr;
        cudaCheck(cudaMemGetInfo(&fr, &total));
        free_min = SDM_MIN(free_min, fr);
        if (it < warm) continue;
        cudaCheck(cudaEventElapsedTime(&fwd[it - warm], e0, e1));
        cudaCheck(cudaEventElapsedTime(&bwd[it - warm], e1, e2));
        tot[it - warm] = fwd[it - warm] + bwd[it - warm];
    }
    stsum[0] = part_ms(prof, SDM_PART_PROJ);
    stsum[1] = part_ms(prof, SDM_PART_ADDRESS);
    stsum[2] = part_ms(prof, SDM_PART_OP_WY) + part_ms(prof, SDM_PART_OP_FWD) + part_ms(prof, SDM_PART_OP_BWD);
    stsum[3] = part_ms(prof, SDM_PART_BANK) + part_ms(prof, SDM_PART_READOUT);
    qsort(tot, iters, sizeof(float), cmp_float);
    qsort(fwd, iters, sizeof(float), cmp_float);
    qsort(bwd, iters, sizeof(float), cmp_float);
    double gemm_flops = 3.0 * 2.0 * (double)BT * D * ((double)L.n_in + D); // fwd + dX + dW of both projections
    double peak_gib = (double)(free0 - free_min) / (1 << 30);
    printf("== %s: D=%d H=%d N=%d W=R=%d C=%d B=%d T=%d (bf16, bank bf16, snapshots none)\n", name, D, H, s.slots, W,
           C, B, T);
    printf("   fwd+bwd median %.2f ms (min %.2f, max %.2f; target %.0f ms)  forward %.2f ms  backward %.2f ms\n",
           tot[iters / 2], tot[0], tot[iters - 1], target_ms, fwd[iters / 2], bwd[iters / 2]);
    printf("   stages (mean ms): projections %.2f  top-k/addressing %.2f  memory op %.2f  rest %.2f\n", stsum[0],
           stsum[1], stsum[2], stsum[3]);
    printf("   GEMM %.1f GFLOP: %.0f TFLOP/s in the projection stage, %.3f ms at %.0f TFLOP/s (%.0f%% of the total)\n",
           gemm_flops / 1e9, gemm_flops / (stsum[0] * 1e-3) / 1e12, gemm_flops / (BF16_PEAK_TFLOPS * 1e12) * 1e3,
           BF16_PEAK_TFLOPS, 100.0 * gemm_flops / (BF16_PEAK_TFLOPS * 1e12) / (tot[iters / 2] * 1e-3));
    printf("   device memory: ledger %.2f GiB (op saved %.2f GiB, op scratch %.2f GiB), peak in use %.2f GiB\n",
           mem_gib(g_mem.live), (double)sdm_op_saved_bytes(&L.op) / (1 << 30),
           (double)sdm_op_scratch_bytes(&L.op) / (1 << 30), peak_gib);
    prof_print(&prof->table, stdout);
    CHECK(tot[iters / 2] > 0.0f, "%s: no time measured", name);
    bench_pieces(&L, &p, &g, x, dy, y, dx);
    sdm_layer_destroy(&L);
    prof_destroy(prof);
    free_layer_params(&p, bias);
    const void *bufs[] = {x, dy, y, dx, g.w_in, gbias, g.A_log, g.dt_bias, g.ln_w, g.ln_b, g.w_out, g.b_out, g.bank0};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) cudaCheck(cudaFree((void *)bufs[i]));
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    cudaCheck(cudaEventDestroy(e2));
    cudaCheck(cudaStreamDestroy(st));
}

#define DECODE_STEPS 100 // steps per graph
#define DECODE_COPIES 4  // weight copies cycled through: 4 x 42 MB outgrows the 50 MB L2, as a model's layers do

// Microseconds per step (median and fastest of 7 launches) of DECODE_STEPS calls of step(i) captured in one CUDA
// graph on st.
template <typename Step> static BenchTime decode_graph_us(cudaStream_t st, Step step) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaCheck(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed)); // relaxed: the first GEMM allocates
    for (int i = 0; i < DECODE_STEPS; i++) step(i);
    cudaCheck(cudaStreamEndCapture(st, &graph));
    cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
    BenchTime t = bench_time(1, 7, [](int) {}, [&] { cudaCheck(cudaGraphLaunch(exec, st)); }, st);
    cudaCheck(cudaGraphExecDestroy(exec));
    cudaCheck(cudaGraphDestroy(graph));
    BenchTime us = {t.median * 1e3f / DECODE_STEPS, t.min * 1e3f / DECODE_STEPS};
    return us;
}

// The flagship layer's decode step of B streams (sdm_infer_decode), timed as a CUDA graph of DECODE_STEPS steps,
// each on new inputs (so new slots) and the next of DECODE_COPIES weight copies, as in a model where the other
// layers evict this one's weights from L2. Floor: the weights from HBM, plus 2 heads x (2W + R) bank rows. Then
// each part of the step alone, DECODE_STEPS times in a graph on the inputs the last step left: the two products,
// the addressing (gates, values, both top-k), the memory op (on one step's slots, so its bank rows stay in L2,
// unlike the step's) and the readout; alone, each pays its own launch and tail latency, which the step overlaps.
static void bench_decode(int B, double target_us) {
    SdmDims s = layer_dims(2048, 2, 256, 64, 64);
    int D = s.dim;
    SdmInferState I = sdm_infer_create(&s, B, B, DT_BF16);
    SdmLayerParams p[DECODE_COPIES];
    void *bias[DECODE_COPIES];
    for (int c = 0; c < DECODE_COPIES; c++) p[c] = random_layer_params(&I.L, 100 * c, &bias[c]);
    void *x = rand_buf((size_t)DECODE_STEPS * B * D, 20, 1.0f, 0.0f), *y = rand_buf((size_t)B * D, 21, 1.0f, 0.0f);
    cudaStream_t st;
    cudaCheck(cudaStreamCreate(&st));
    sdm_infer_reset(&I, &p[0], -1, st);
    BenchTime t = decode_graph_us(st, [&](int i) {
        sdm_infer_decode(&I, &p[i % DECODE_COPIES], (const char *)x + (size_t)i * B * D * 2, NULL, y, B, st);
    });
    float med = t.median, fastest = t.min;
    double weights = 2.0 * ((double)I.L.n_in + D) * D, rows = 2.0 * B * s.heads * (2 * s.writes + s.reads) * s.head_dim;
    printf("== flagship layer decode step, batch %2d: median %.1f us (min %.1f; target %.0f us); floor %.1f us "
           "(weights %.1f MB + bank rows %.1f MB at %.1f TB/s)\n", B, med, fastest, target_us,
           (weights + rows) / HBM_TBPS / 1e6, weights / 1e6, rows / 1e6, HBM_TBPS);
    CHECK(med > 0.0f, "decode batch %d: no time measured", B);
    SdmLayer *L = &I.L;
    const void *x0 = x;
    float t_in = decode_graph_us(st, [&](int i) {
        const SdmLayerParams *pi = &p[i % DECODE_COPIES];
        matmul_forward(L->z, L->ctype, L->ldz, x0, pi->w_in, L->b_packed, L->ctype, B, L->n_in, D, st);
    }).median;
    float t_addr = decode_graph_us(st, [&](int) { sdm_layer_select(L, &p[0], st); }).median;
    SdmOpInputs in = sdm_layer_op_inputs(L);
    float t_op = decode_graph_us(st, [&](int) { sdm_op_decode(&L->op, &in, I.banks, L->o, st); }).median;
    SdmReadoutArgs ra = sdm_layer_readout_args(L, &p[0]);
    float t_ro =
        decode_graph_us(st, [&](int) { sdm_readout_forward(&ra, L->o, L->r, L->ln_mean, L->ln_rstd, st); }).median;
    float t_out = decode_graph_us(st, [&](int i) {
        const SdmLayerParams *pi = &p[i % DECODE_COPIES];
        matmul_forward(y, L->ctype, D, L->r, pi->w_out, pi->b_out, L->ctype, B, D, D, st);
    }).median;
    printf("   parts alone (us): input product %.1f, addressing (gates, top-k) %.1f, memory op %.1f, readout %.1f, "
           "output product %.1f\n", t_in, t_addr, t_op, t_ro, t_out);
    cudaCheck(cudaStreamDestroy(st));
    for (int c = 0; c < DECODE_COPIES; c++) free_layer_params(&p[c], bias[c]);
    cudaCheck(cudaFree(x));
    cudaCheck(cudaFree(y));
    sdm_infer_destroy(&I);
}

// The top-k alone on the flagship layer's shape (N = 256 x 256, k = 64, 2 heads, bf16 scores) at P problems, by each
// kernel (the launcher takes the block one for P <= SDM_TOPK_BLOCK_MAX_P): where the two cross. Each time is the mean
// of TOPK_REPS launches in a CUDA graph (no launch gaps).
#define TOPK_REPS 20
static void bench_topk_paths(void) {
    SdmDims s = layer_dims(2048, 2, 256, 64, 64);
    SdmTopkPlan pl = sdm_topk_plan_make(&s, s.reads);
    const int Ps[] = {2, 64, 256, 512, 1024, 2048}, n_P = sizeof(Ps) / sizeof(Ps[0]), H = s.heads;
    int P_max = Ps[n_P - 1], ldz = H * s.key_dim, k = pl.k;
    void *z = rand_buf((size_t)P_max / H * ldz, 30, 2.0f, 0.0f);
    int *slot;
    float *w;
    cudaCheck(cudaMalloc(&slot, sizeof(int) * P_max * k));
    cudaCheck(cudaMalloc(&w, sizeof(float) * P_max * k));
    cudaStream_t st;
    cudaCheck(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0));
    cudaCheck(cudaEventCreate(&e1));
    for (int i = 0; i < n_P; i++) {
        float us[2];
        for (int v = 0; v < 2; v++) {
            pl.path = v ? SDM_TOPK_BLOCK : SDM_TOPK_WARP;
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            cudaCheck(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            SdmTopkJob job = {&pl, 0, {slot, w, NULL, NULL, NULL, 0, 1.0f}};
            for (int r = 0; r < TOPK_REPS; r++) sdm_topk_forward(&job, 1, z, DT_BF16, ldz, H, Ps[i], NULL, st);
            cudaCheck(cudaStreamEndCapture(st, &graph));
            cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
            cudaCheck(cudaGraphLaunch(exec, st)); // warm-up
            cudaCheck(cudaEventRecord(e0, st));
            cudaCheck(cudaGraphLaunch(exec, st));
            cudaCheck(cudaEventRecord(e1, st));
            cudaCheck(cudaEventSynchronize(e1));
            cudaCheck(cudaEventElapsedTime(&us[v], e0, e1));
            us[v] *= 1e3f / TOPK_REPS;
            cudaCheck(cudaGraphExecDestroy(exec));
            cudaCheck(cudaGraphDestroy(graph));
        }
        printf("   top-k alone (N=%d, k=%d), P=%4d: warp kernel %7.1f us, block kernel %7.1f us%s\n", s.slots, k,
               Ps[i], us[0], us[1], Ps[i] <= SDM_TOPK_BLOCK_MAX_P ? " (block taken)" : "");
        CHECK(us[0] > 0.0f && us[1] > 0.0f, "top-k P=%d: no time measured", Ps[i]);
    }
    cudaCheck(cudaEventDestroy(e0));
    cudaCheck(cudaEventDestroy(e1));
    cudaCheck(cudaStreamDestroy(st));
    cudaCheck(cudaFree(slot));
    cudaCheck(cudaFree(w));
    cudaCheck(cudaFree(z));
    sdm_topk_plan_free(&pl);
}

int main(int argc, char **argv) {
    int which = argc > 1 ? atoi(argv[1]) : 0; // 0: all, 1: flagship only, 2: D=768 only, 3: decode only
    if (which == 0 || which == 1) bench("flagship layer", 2048, 2, 256, 64, 64, 8, 4096, 21.0);
    if (which == 0 || which == 2) bench("D=768 layer", 768, 1, 192, 64, 64, 2, 8192, 8.0);
    if (which == 0 || which == 3) {
        bench_decode(1, 25.0);
        bench_decode(32, 60.0);
        bench_topk_paths();
    }
    matmul_destroy();
    return test_summary();
}
