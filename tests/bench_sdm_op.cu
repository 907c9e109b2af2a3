// tests/bench_sdm_op.cu: op-only timings of the GPU SDM memory op (sdm/sdm_op.cuh): training forward, backward,
// prefill and decode at the issue-4 shapes, bf16 bank, uniform random slots; the flagship shape also with fp8 and
// int4 snapshots, and with concentrated slots (every token draws its slots from a hot set of 256 or of W slots: each
// slot hit by ~16 or by all 64 tokens of a chunk, as learned product keys do; `hot` as the second argument runs only
// these and the uniform case; `prefill`: one 4,096-token stream of the flagship layer at C = 32, 64, 128; `grad`: the
// flagship shape, uniform and hot-256 slots, with the bank gradient G in fp32 then in bf16, sdm.grad_bank_dtype;
// `flagship`: the flagship's case alone, uniform slots and a bf16 G; `overlap`: the flagship step's op backward (B = 4)
// beside the weight-gradient GEMMs of one group of its blocks on a second stream, to learn whether the step gains by
// running them together).
// Prefills are timed three ways: as the op chooses, with three launches per chunk, and persistent (one cooperative
// launch for the chunk loop, docs/SDM.md#phases-on-the-gpu). Median of repeated runs (CUDA events) after a warm-up.
// For each: time, the op's device memory, and the byte floor (bank rows that must move, over the 4.3 TB/s measured
// HBM bandwidth; a snapshot row takes s bytes: 2d for none, d + 4 d/32 for fp8, d/2 + 4 d/32 for int4):
//   forward (training): per token and head read W + R rows, write W rows and W snapshot rows -> (2W + R) d 2 + W s
//   prefill:            read W + R rows, write W rows                                          -> (2W + R) d 2 bytes
//   backward: G rows (g = 4 bytes, 2 with a bf16 G) read + written at W + R rows, W snapshot rows read, R rows
//             read (bank or snapshot)                                  -> (2W + 2R) d g + R d 2 + W s bytes
//   decode: read W + R rows, write W rows per stream                                           -> (2W + R) d 2 bytes
//
// Notes (one H200, 2026-12-02, op only, flagship shape B=8 T=4096 H=2 N=65536 d=1024 W=R=64 C=64, bf16 bank;
// floors: forward 8.0 ms, backward 22.0 ms):
//   v1 design, one persistent CTA per (stream, 64-column block) walking all chunks (replaced by
//   docs/SDM.md#phases-on-the-gpu):
//       forward 33.7 ms, backward 112.6 ms; the same kernels with one launch per chunk: prefill 31.4 vs 31.2 ms
//       persistent (no gain from persistence); gathers of 128-byte row slices, latency-bound.
//   batched loads + split gathers in that design: forward 27.3 ms, backward 60.3 ms (phase-2 column loop 23.5 ms).
//   whole-row kernels, host loop over chunks: forward 30.9, backward 44.4; its row gather spent 19.6 of
//       the 30.9 ms in 8-way bank-conflicted shared-memory read-modify-writes of the partial sums;
//   staging all row loads of a warp before use (more registers, lower occupancy): token kernel 16.0 -> 29.2 ms,
//       backward scatter 23.6 -> 34.8 ms: reverted;
//   partial sums in registers (current): gather 19.6 -> 7.9 ms; forward 18.0 ms, backward 44.9 ms.
//   Per launch kind (ms, all 64 chunks): phase1 2.3 | gather 7.9 (3.1 TB/s of row traffic) solve 2.0 scatter 5.7 |
//   token 16.1 (2.6 TB/s) bsolve 2.2 bscatter 23.9 (3.5 TB/s) bwy 1.5.
#include <algorithm>
#include <vector>

#include "core/cuda_common.cuh"
#include "core/matmul.cuh"
#include "core/rng.h"
#include "sdm/sdm_op.cuh"
#include "tests/rand_slots.h"

#define HBM_BYTES_PER_S 4.3e12

static float *dev_random(Rng *rng, size_t n, float lo, float hi) {
    std::vector<float> h(n);
    for (size_t i = 0; i < n; i++) h[i] = (float)rng_range(rng, lo, hi);
    float *d;
    cudaCheck(cudaMalloc(&d, n * 4));
    cudaCheck(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice));
    return d;
}

// positive weights summing to 1 per group of k
static float *dev_weights(Rng *rng, size_t groups, int k) {
    std::vector<float> h(groups * k);
    for (size_t g = 0; g < groups; g++) {
        double s = 0.0;
        for (int i = 0; i < k; i++) s += (h[g * k + i] = (float)exp(rng_normal(rng)));
        for (int i = 0; i < k; i++) h[g * k + i] = (float)(h[g * k + i] / s);
    }
    float *d;
    cudaCheck(cudaMalloc(&d, h.size() * 4));
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    return d;
}

// k ascending slots of [0, n) per group; hot > 0: drawn from the hot set {0, n/hot, 2 n/hot, ...} of hot slots
static int *dev_slots(Rng *rng, size_t groups, int k, int n, int hot) {
    std::vector<int> h(groups * k);
    for (size_t g = 0; g < groups; g++) {
        rand_slots(rng, hot ? hot : n, k, h.data() + g * k);
        if (hot)
            for (int i = 0; i < k; i++) h[g * k + i] *= n / hot;
    }
    int *d;
    cudaCheck(cudaMalloc(&d, h.size() * 4));
    cudaCheck(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    return d;
}

static SdmOpInputs make_inputs(Rng *rng, const SdmOpShape *s, int hot) {
    size_t tok = (size_t)s->B * s->T * s->H;
    SdmOpInputs in;
    in.wslot = dev_slots(rng, tok, s->W, s->N, hot);
    in.rslot = dev_slots(rng, tok, s->R, s->N, hot);
    in.kappa = dev_weights(rng, tok, s->W);
    in.rho = dev_weights(rng, tok, s->R);
    in.gamma = dev_random(rng, tok * s->W, -0.1f, 0.f);
    in.beta = dev_random(rng, tok, 0.05f, 0.95f);
    in.v = dev_random(rng, tok * s->d, -1.f, 1.f);
    return in;
}

static void free_inputs(SdmOpInputs *in) {
    cudaFree((void *)in->wslot); cudaFree((void *)in->rslot); cudaFree((void *)in->kappa); cudaFree((void *)in->rho);
    cudaFree((void *)in->gamma); cudaFree((void *)in->beta); cudaFree((void *)in->v);
}

static void *dev_bank(Rng *rng, size_t n) { // bf16 bank, random values
    std::vector<__nv_bfloat16> h(1 << 20);
    for (size_t i = 0; i < h.size(); i++) h[i] = __float2bfloat16((float)(0.02 * rng_normal(rng)));
    char *d;
    cudaCheck(cudaMalloc(&d, n * 2));
    for (size_t off = 0; off < n; off += h.size())
        cudaCheck(cudaMemcpy(d + off * 2, h.data(), std::min(h.size(), n - off) * 2, cudaMemcpyHostToDevice));
    return d;
}

// What the op's forward and backward read and write at one shape: random inputs (slots uniform, or from a hot set
// of `hot` slots), a random bf16 bank, dout, the gradients (G in fp32 or bf16 as the shape says), saved and scratch.
struct OpBench {
    SdmOpInputs in;
    void *bank, *saved, *scratch;
    float *out, *dout;
    SdmOpGrads g;
    size_t tok, bank_n, gbank_b, saved_b, scratch_b;
};

static OpBench op_bench_make(const SdmOpShape *s, int hot) {
    OpBench o;
    Rng rng = rng_make(1234);
    o.in = make_inputs(&rng, s, hot);
    o.tok = (size_t)s->B * s->T * s->H;
    o.bank_n = (size_t)s->B * s->H * s->N * s->d;
    o.gbank_b = o.bank_n * (s->grad_bank_bf16 ? 2 : 4);
    o.bank = dev_bank(&rng, o.bank_n);
    o.dout = dev_random(&rng, o.tok * s->d, -1.f, 1.f);
    cudaCheck(cudaMalloc(&o.out, o.tok * s->d * 4));
    size_t tw = o.tok * s->W * 4, tr = o.tok * s->R * 4;
    cudaCheck(cudaMalloc(&o.g.dkappa, tw)); cudaCheck(cudaMalloc(&o.g.dgamma, tw)); cudaCheck(cudaMalloc(&o.g.drho, tr));
    cudaCheck(cudaMalloc(&o.g.dbeta, o.tok * 4)); cudaCheck(cudaMalloc(&o.g.dv, o.tok * s->d * 4));
    cudaCheck(cudaMalloc(&o.g.dbank_init, o.gbank_b));
    o.saved_b = sdm_op_saved_bytes(s);
    o.scratch_b = sdm_op_scratch_bytes(s);
    cudaCheck(cudaMalloc(&o.saved, o.saved_b));
    cudaCheck(cudaMalloc(&o.scratch, o.scratch_b));
    return o;
}

static void op_bench_free(OpBench *o) {
    cudaFree(o->bank); cudaFree(o->out); cudaFree(o->dout); cudaFree(o->saved); cudaFree(o->scratch);
    cudaFree(o->g.dkappa); cudaFree(o->g.dgamma); cudaFree(o->g.drho); cudaFree(o->g.dbeta); cudaFree(o->g.dv);
    cudaFree(o->g.dbank_init);
    free_inputs(&o->in);
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static double gib(size_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

static void report(const char *what, float ms, double floor_bytes) {
    double floor_ms = floor_bytes / HBM_BYTES_PER_S * 1e3;
    printf("  %-34s %9.3f ms   floor %7.3f ms (%6.2f GB)   floor/time %5.1f%%\n", what, ms, floor_ms, floor_bytes / 1e9,
           100.0 * floor_ms / ms);
}

// Median time of fn() over reps runs after one warm-up.
template <typename F> static float time_ms(int reps, F fn) {
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0)); cudaCheck(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r <= reps; r++) {
        float ms;
        cudaCheck(cudaEventRecord(e0));
        fn();
        cudaCheck(cudaEventRecord(e1));
        cudaCheck(cudaEventSynchronize(e1));
        cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        if (r) t.push_back(ms);
    }
    cudaCheck(cudaEventDestroy(e0)); cudaCheck(cudaEventDestroy(e1));
    return median(t);
}

// token and bscatter over all chunks with the bank gradient G in Tg (fp32 or bf16)
template <typename Tg>
static void bench_grad_parts(const SdmOpArgs &a, void *bank, Tg *G, const float *dout, int reps, float *tk, float *bc) {
    *tk = time_ms(reps, [&] { for (int c = a.nc - 1; c >= 0; c--) sdm_op_launch_token(a, (const Tg *)G, c, 0); });
    *bc = time_ms(reps, [&] { for (int c = a.nc - 1; c >= 0; c--) sdm_op_launch_bscatter(a, bank, 0, G, dout, c, 0); });
}

// Where the time goes: each launch kind of the forward and backward timed alone over all chunks (on the state left
// by a full forward + backward; the values they compute are not used).
static void bench_parts(const SdmOpShape *s, const SdmOpInputs *in, void *bank, const float *dout, const SdmOpGrads *g,
                        void *saved, void *scratch, int reps) {
    SdmOpArgs a = sdm_op_args(s, saved, scratch);
    size_t ts = sdm_op_tile_smem(a);
    float p1 = time_ms(reps, [&] { sdm_op_phase1(a, in, 0); });
    SdmFwdGrids fgr = sdm_fwd_grids(a);
    float fg = time_ms(reps, [&] {
        for (int c = 0; c < a.nc; c++)
            sdm_op_launch_fgather(a, fgr.gather, in->v, (const __nv_bfloat16 *)bank, c, SDM_GATHER_BULK, 0);
    });
    float fs = time_ms(reps, [&] {
        for (int c = 0; c < a.nc; c++)
            sdm_fsolve_kernel<<<fgr.solve, SDM_ROW_THREADS, ts>>>(a, g->dv, c, sdm_op_solve_staged(a));
    });
    float fc = time_ms(reps, [&] {
        for (int c = 0; c < a.nc; c++)
            sdm_fscatter_kernel<__nv_bfloat16><<<fgr.scatter, SDM_ROW_THREADS>>>(a, (__nv_bfloat16 *)bank, c);
    });
    float tk, bc;
    if (s->grad_bank_bf16) bench_grad_parts(a, bank, (__nv_bfloat16 *)g->dbank_init, dout, reps, &tk, &bc);
    else bench_grad_parts(a, bank, (float *)g->dbank_init, dout, reps, &tk, &bc);
    float bs = time_ms(reps, [&] { for (int c = a.nc - 1; c >= 0; c--) sdm_op_launch_bsolve(a, dout, g->dv, c, 0); });
    float bw = time_ms(reps, [&] { sdm_op_launch_bwy(a, dout, g, 0); });
    cudaCheckLast();
    printf("  parts (ms): phase1 %.3f (%zu KB a chunk in %s memory) | fgather %.3f fsolve %.3f fscatter %.3f | token "
           "%.3f bsolve %.3f bscatter %.3f bwy %.3f (%zu KB a chunk in %s memory)\n", p1,
           sdm_wy_layout(a.C, a.W, a.R).bytes >> 10, a.wy_work ? "global" : "shared", fg, fs, fc, tk, bs, bc, bw,
           sdm_bwy_layout(a.C, a.W, a.R).bytes >> 10, a.bwy_work ? "global" : "shared");
}

// Training forward + backward, prefill, and the forward with the host-loop schedule at one shape; hot: slots from a
// hot set of that many slots (0: uniform over N); grad_bf16: the bank gradient in bf16 (sdm.grad_bank_dtype).
static void bench_train(int B, int T, int H, int N, int d, int W, int R, int C, SdmSnapshot snap, int reps,
                        int hot = 0, int grad_bf16 = 0) {
    SdmOpShape s;
    memset(&s, 0, sizeof(s));
    s.B = B; s.T = T; s.H = H; s.N = N; s.d = d; s.W = W; s.R = R; s.C = C; s.bank_fp32 = 0;
    s.snapshot = snap; s.training = 1; s.grad_bank_bf16 = grad_bf16;
    static const char *const snap_names[] = {"none", "bf16", "fp8", "int4"};
    char slots[48] = "uniform slots";
    if (hot) snprintf(slots, sizeof(slots), "slots from a hot set of %d", hot);
    printf("shape B=%d T=%d H=%d N=%d d=%d W=%d R=%d C=%d (bf16 bank, %s snapshots, %s bank gradient, DB=%d, %s)\n",
           B, T, H, N, d, W, R, C, snap_names[snap], grad_bf16 ? "bf16" : "fp32", sdm_op_col_block(&s), slots);
    OpBench o = op_bench_make(&s, hot);
    SdmOpInputs &in = o.in;
    void *bank = o.bank, *saved = o.saved, *scratch = o.scratch;
    float *out = o.out, *dout = o.dout;
    SdmOpGrads &g = o.g;
    printf("  memory: bank %.2f GiB, saved %.2f GiB, scratch %.2f GiB, dbank_init %.2f GiB, inputs+grads %.2f GiB\n",
           gib(o.bank_n * 2), gib(o.saved_b), gib(o.scratch_b), gib(o.gbank_b),
           gib(o.tok * (2 * d + 3 * W + 3 * R + 2) * 4 * 2));
    cudaEvent_t e0, e1, e2;
    cudaCheck(cudaEventCreate(&e0)); cudaCheck(cudaEventCreate(&e1)); cudaCheck(cudaEventCreate(&e2));
    std::vector<float> tf, tb;
    for (int r = 0; r <= reps; r++) { // first round is the warm-up
        float a, b;
        cudaCheck(cudaEventRecord(e0));
        sdm_op_forward(&s, &in, bank, out, saved, 0);
        cudaCheck(cudaEventRecord(e1));
        sdm_op_backward(&s, &in, bank, dout, NULL, &g, saved, scratch, 0);
        cudaCheck(cudaEventRecord(e2));
        cudaCheck(cudaEventSynchronize(e2));
        cudaCheck(cudaEventElapsedTime(&a, e0, e1));
        cudaCheck(cudaEventElapsedTime(&b, e1, e2));
        if (r) { tf.push_back(a); tb.push_back(b); }
    }
    SdmOpShape sp = s, sl, spp; // prefill: the op's choice, three launches per chunk, persistent
    sp.training = 0;
    sl = spp = sp;
    sl.fwd_path = SDM_FWD_LAUNCHES;
    spp.fwd_path = SDM_FWD_PERSISTENT;
    float tpre = time_ms(reps, [&] { sdm_op_forward(&sp, &in, bank, out, saved, 0); });
    float tl = time_ms(reps, [&] { sdm_op_forward(&sl, &in, bank, out, saved, 0); });
    float tp = time_ms(reps, [&] { sdm_op_forward(&spp, &in, bank, out, saved, 0); });
    SdmOpArgs pa = sdm_op_args(&sp, saved, NULL);
    int auto_blocks = sdm_fwd_persistent_blocks<__nv_bfloat16>(&sp, pa);
    double th_ = (double)o.tok, floor_p = th_ * (2.0 * W + R) * d * 2;
    double floor_f = sdm_op_floor_bytes(&s, 0), floor_b = sdm_op_floor_bytes(&s, 1);
    report("forward (training)", median(tf), floor_f);
    report("backward", median(tb), floor_b);
    report("forward + backward", median(tf) + median(tb), floor_f + floor_b);
    char what[64];
    snprintf(what, sizeof(what), "prefill (op's choice: %s)", auto_blocks ? "persistent" : "launches");
    report(what, tpre, floor_p);
    report("prefill, launches", tl, floor_p);
    snprintf(what, sizeof(what), "prefill, persistent (%d blocks)", sdm_fwd_persistent_blocks<__nv_bfloat16>(&spp, pa));
    report(what, tp, floor_p);
    bench_parts(&s, &in, bank, dout, &g, saved, scratch, reps);
    op_bench_free(&o);
}

// Whether the op's backward (bound by the latency of its row loads) and GEMMs (bound by the tensor cores) gain by
// sharing the GPU: the flagship step's op backward (B = 4, uniform slots, bf16 G) on one stream, and on another the
// weight-gradient GEMMs of one group of the flagship's blocks (three SWA blocks and the SDM block: q, k, v, o, and the
// FFN's W2 and W1|W3 per block, n = 16,384 tokens, D = 2048, F = 5632), alone and together, with either stream at the
// higher priority. Saved = alone summed - together.
static void bench_overlap(int reps) {
    const int B = 4, T = 4096, H = 2, N = 65536, d = 1024, W = 64, R = 64, n = B * T, D = 2048, F = 5632;
    SdmOpShape s;
    memset(&s, 0, sizeof(s));
    s.B = B; s.T = T; s.H = H; s.N = N; s.d = d; s.W = W; s.R = R; s.C = 64; s.bank_fp32 = 0;
    s.snapshot = SDM_SNAP_NONE; s.training = 1; s.grad_bank_bf16 = 1;
    OpBench o = op_bench_make(&s, 0);
    sdm_op_forward(&s, &o.in, o.bank, o.out, o.saved, 0);
    Rng rng = rng_make(4321);
    // the GEMMs' operands: dY [n, 2F] and X [n, F] bf16 (each GEMM reads its leading columns), dW fp32
    matmul_init();
    void *dy = dev_bank(&rng, (size_t)n * 2 * F), *x = dev_bank(&rng, (size_t)n * F);
    float *dw;
    cudaCheck(cudaMalloc(&dw, (size_t)2 * F * D * 4));
    struct { int N, K; } gemms[] = {{D, D}, {D, D}, {D, D}, {D, D}, {D, F}, {2 * F, D}}; // dW [N, K] of one block
    double flops = 0;
    for (auto &m : gemms) flops += 4 * 2.0 * n * m.N * m.K;
    int lo, hi;
    cudaCheck(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    cudaStream_t st[2][2]; // [stream][0: normal priority, 1: high]
    for (int i = 0; i < 2; i++)
        for (int p = 0; p < 2; p++) cudaCheck(cudaStreamCreateWithPriority(&st[i][p], cudaStreamNonBlocking, p ? hi : lo));
    cudaEvent_t fork, join;
    cudaCheck(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    auto op = [&](cudaStream_t q) { sdm_op_backward(&s, &o.in, o.bank, o.dout, NULL, &o.g, o.saved, o.scratch, q); };
    auto mm = [&](cudaStream_t q) {
        for (int b = 0; b < 4; b++)
            for (auto &m : gemms) matmul_backward_weight(dw, DT_FP32, dy, 2 * F, x, DT_BF16, n, m.N, m.K, 1, q);
    };
    auto both = [&](cudaStream_t a, cudaStream_t b) { // on the legacy stream's timeline: fork, both, join
        cudaCheck(cudaEventRecord(fork, 0));
        cudaCheck(cudaStreamWaitEvent(a, fork, 0)); cudaCheck(cudaStreamWaitEvent(b, fork, 0));
        op(a);
        mm(b);
        cudaCheck(cudaEventRecord(join, a)); cudaCheck(cudaStreamWaitEvent(0, join, 0));
        cudaCheck(cudaEventRecord(join, b)); cudaCheck(cudaStreamWaitEvent(0, join, 0));
    };
    float t_op = time_ms(reps, [&] { op(0); }), t_mm = time_ms(reps, [&] { mm(0); });
    float t_eq = time_ms(reps, [&] { both(st[0][0], st[1][0]); });
    float t_oph = time_ms(reps, [&] { both(st[0][1], st[1][0]); });
    float t_mmh = time_ms(reps, [&] { both(st[0][0], st[1][1]); });
    cudaCheckLast();
    printf("overlap: the flagship step's op backward (B=%d) and one block group's weight-gradient GEMMs (%.2f TFLOP)\n"
           "  op backward alone %.3f ms | GEMMs alone %.3f ms (%.0f TFLOP/s) | sum %.3f ms\n"
           "  together: same priority %.3f ms (saved %.3f) | op first %.3f (saved %.3f) | GEMMs first %.3f (saved %.3f)\n",
           B, flops / 1e12, t_op, t_mm, flops / t_mm / 1e9, t_op + t_mm, t_eq, t_op + t_mm - t_eq, t_oph,
           t_op + t_mm - t_oph, t_mmh, t_op + t_mm - t_mmh);
    for (int i = 0; i < 2; i++)
        for (int p = 0; p < 2; p++) cudaCheck(cudaStreamDestroy(st[i][p]));
    cudaCheck(cudaEventDestroy(fork)); cudaCheck(cudaEventDestroy(join));
    cudaFree(dy); cudaFree(x); cudaFree(dw);
    op_bench_free(&o);
}

// Decode steps for a batch of B streams per head, timed as 100 steps of a captured CUDA graph.
static void bench_decode(int B, int H, int N, int d, int W, int R) {
    SdmOpShape s;
    memset(&s, 0, sizeof(s));
    s.B = B; s.T = 1; s.H = H; s.N = N; s.d = d; s.W = W; s.R = R; s.C = 64;
    Rng rng = rng_make(99);
    SdmOpInputs in = make_inputs(&rng, &s, 0);
    size_t bank_n = (size_t)B * H * N * d;
    void *bank = dev_bank(&rng, bank_n);
    float *out;
    cudaCheck(cudaMalloc(&out, (size_t)B * H * d * 4));
    cudaStream_t st;
    cudaCheck(cudaStreamCreate(&st));
    const int steps = 100;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaCheck(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < steps; i++) sdm_op_decode(&s, &in, bank, out, st);
    cudaCheck(cudaStreamEndCapture(st, &graph));
    cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    cudaCheck(cudaEventCreate(&e0)); cudaCheck(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r <= 10; r++) {
        float ms;
        cudaCheck(cudaEventRecord(e0, st));
        cudaCheck(cudaGraphLaunch(exec, st));
        cudaCheck(cudaEventRecord(e1, st));
        cudaCheck(cudaEventSynchronize(e1));
        cudaCheck(cudaEventElapsedTime(&ms, e0, e1));
        if (r) t.push_back(ms / steps);
    }
    char what[64];
    snprintf(what, sizeof(what), "decode step, batch %d (H=%d)", B, H);
    report(what, median(t), (double)B * H * (2.0 * W + R) * d * 2);
    printf("    = %.1f us per step\n", median(t) * 1e3);
    cudaCheck(cudaGraphExecDestroy(exec));
    cudaCheck(cudaGraphDestroy(graph));
    cudaFree(bank); cudaFree(out);
    free_inputs(&in);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    printf("GPU %s, %d SMs; byte floors at %.1f TB/s\n", p.name, p.multiProcessorCount, HBM_BYTES_PER_S / 1e12);
    if (argc > 2 && !strcmp(argv[2], "prefill")) { // one flagship stream's prompt (S = 2) at three chunk sizes
        for (int C = 32; C <= 128; C *= 2) bench_train(1, 4096, 2, 65536, 1024, 64, 64, C, SDM_SNAP_NONE, reps);
        return 0;
    }
    if (argc > 2 && !strcmp(argv[2], "flagship")) { // the flagship's case alone: uniform slots, G in bf16
        bench_train(8, 4096, 2, 65536, 1024, 64, 64, 64, SDM_SNAP_NONE, reps, 0, 1);
        return 0;
    }
    if (argc > 2 && !strcmp(argv[2], "overlap")) {
        bench_overlap(reps);
        return 0;
    }
    if (argc > 2 && !strcmp(argv[2], "grad")) { // the flagship backward with G in fp32, then in bf16
        for (int hot = 0; hot <= 256; hot += 256)
            for (int gb = 0; gb <= 1; gb++)
                bench_train(8, 4096, 2, 65536, 1024, 64, 64, 64, SDM_SNAP_NONE, reps, hot, gb);
        return 0;
    }
    bench_train(8, 4096, 2, 65536, 1024, 64, 64, 64, SDM_SNAP_NONE, reps);
    bench_train(8, 4096, 2, 65536, 1024, 64, 64, 64, SDM_SNAP_NONE, reps, 256);
    bench_train(8, 4096, 2, 65536, 1024, 64, 64, 64, SDM_SNAP_NONE, reps, 64);
    if (argc > 2 && !strcmp(argv[2], "hot")) return 0;
    bench_train(8, 4096, 2, 65536, 1024, 64, 64, 64, SDM_SNAP_FP8, reps);
    bench_train(8, 4096, 2, 65536, 1024, 64, 64, 64, SDM_SNAP_INT4, reps);
    bench_train(2, 8192, 1, 36864, 768, 64, 64, 64, SDM_SNAP_NONE, reps);
    bench_train(2, 8192, 1, 36864, 768, 64, 64, 256, SDM_SNAP_NONE, reps);
    bench_decode(1, 2, 65536, 1024, 64, 64);
    bench_decode(32, 2, 65536, 1024, 64, 64);
    return 0;
}
