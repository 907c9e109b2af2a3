// tests/bench_attention.cu: bf16 attention forward and backward at the flagship shape (B=4, T=4096, 16 heads of 128),
// full causal and sliding window w=128. Median of many CUDA-event timings after warm-up; TFLOP/s counts only the
// (query, key) pairs inside the mask: forward 4*d flops per pair (Q K^T and P V), backward 10*d (five products).
// Then the decode step (attn_decode, gated as the flagship's layers) at 1, 8 and 32 streams: SWA w=128 at position
// 200 and full attention over 4096 positions.
#include "attention/attention.cuh"
#include "tests/bench.h"
#include "tests/test.h"

#define CK(x) cudaCheck(x)


typedef struct {
    const AttnDims *a;
    int B, T;
    bf16 *q, *k, *v, *out, *dout, *dq, *dk, *dv;
    float *lse;
    void *ws;
} BenchBufs;

static void run_pass(const BenchBufs *b, int backward) {
    if (backward)
        attn_backward(b->a, b->B, b->T, DT_BF16, b->q, b->k, b->v, b->out, b->lse, b->dout, b->dq, b->dk, b->dv, b->ws,
                      0);
    else
        attn_forward(b->a, b->B, b->T, DT_BF16, b->q, b->k, b->v, b->out, b->lse, 0);
}

typedef void (*KernelLaunch)(const AttnArgs &, int, cudaStream_t);

// Median milliseconds of `reps` timed runs after `warm` untimed ones: of a whole pass (launch NULL) or one kernel.
static float time_pass(const BenchBufs *b, int backward, KernelLaunch launch, const AttnArgs *args, int warm,
                       int reps) {
    return bench_time(warm, reps, [](int) {}, [&] {
        if (launch) launch(*args, b->B, 0);
        else run_pass(b, backward);
    }).median;
}

// (query, key) pairs inside the mask of one (sequence, head)
static double visible_pairs(int T, int window) {
    double n = 0.0;
    for (int p = 0; p < T; p++) n += window == 0 ? p + 1 : SDM_MIN(p + 1, window);
    return n;
}

static float *download_f(const bf16 *d, size_t n) {
    bf16 *h = (bf16 *)sdm_malloc(n * sizeof(bf16));
    float *f = (float *)sdm_malloc(n * sizeof(float));
    CK(cudaMemcpy(h, d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) f[i] = __bfloat162float(h[i]);
    free(h);
    return f;
}

// ||a - b|| / ||b||
static double rel_diff(const float *a, const float *b, size_t n) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) num += (double)(a[i] - b[i]) * (a[i] - b[i]), den += (double)b[i] * b[i];
    return sqrt(num / den);
}

// ---- decode ----------------------------------------------------------------------------------------------------
// One attn_decode (RoPE, cache append, attention, gate) of B streams at position P - 1 (P positions, the last w
// visible for SWA), 16 heads of 128. A time is the mean of DEC_REPS dependent launches in a CUDA graph with
// programmatic dependent launch (decode replays its step so), each on the next copy of the KV caches in a pool of
// DEC_POOL_BYTES, so that the keys come from HBM as in a model whose other layers evict them from L2. GB/s count
// the visible keys' and values' bytes.
#define DEC_POOL_BYTES ((size_t)1 << 30)
#define DEC_REPS 20

static void bench_decode(void) {
    const int H = 16, D = 128, Bs[3] = {1, 8, 32};
    const struct { int window, P; } cases[2] = {{128, 200}, {0, 4096}};
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    printf("\ndecode step (attn_decode: RoPE, append, attention, gate), bf16, %d heads of %d, mean of %d dependent "
           "launches in a CUDA graph, caches from HBM\n", H, D, DEC_REPS);
    printf("| mask | positions | streams | us | GB/s (visible K, V) |\n|---|---|---|---|---|\n");
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 3; i++) {
            int B = Bs[i], P = cases[c].P, C = cases[c].window ? cases[c].window : P;
            AttnDims a;
            a.dim = H * D; a.n_heads = H; a.n_kv_heads = H; a.head_dim = D; a.window = cases[c].window; a.gated = 1;
            a.rope_theta = 10000.0;
            AttnRope rope = attn_rope_create(D, a.rope_theta);
            size_t row = (size_t)B * H * D, cache = (size_t)B * C * H * D; // elements
            int copies = (int)SDM_MAX(1, SDM_MIN(DEC_REPS, DEC_POOL_BYTES / (2 * cache * sizeof(bf16))));
            bf16 *qkvz, *out, *pool;
            CK(cudaMalloc((void **)&qkvz, 4 * row * sizeof(bf16)));
            CK(cudaMalloc((void **)&out, row * sizeof(bf16)));
            CK(cudaMalloc((void **)&pool, 2 * cache * copies * sizeof(bf16)));
            bench_fill<<<(unsigned)((4 * row + 255) / 256), 256>>>(qkvz, 4 * row, 77u);
            bench_fill<<<(unsigned)((2 * cache * copies + 255) / 256), 256>>>(pool, 2 * cache * copies, 78u);
            int *hpos = (int *)sdm_malloc(B * sizeof(int)), *pos;
            for (int b = 0; b < B; b++) hpos[b] = P - 1;
            CK(cudaMalloc((void **)&pos, B * sizeof(int)));
            CK(cudaMemcpy(pos, hpos, B * sizeof(int), cudaMemcpyHostToDevice));
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int r = 0; r < DEC_REPS; r++) {
                bf16 *kc = pool + 2 * cache * (r % copies), *vc = kc + cache;
                attn_decode(&a, B, DT_BF16, &rope, qkvz, qkvz + row, qkvz + 2 * row, qkvz + 3 * row, H * D, H * D, kc,
                            vc, C, pos, out, st);
            }
            CK(cudaStreamEndCapture(st, &graph));
            CK(cudaGraphInstantiate(&exec, graph, 0));
            BenchTime t = bench_time(2, 9, [](int) {}, [&] { CK(cudaGraphLaunch(exec, st)); }, st);
            double us = t.median * 1e3 / DEC_REPS, visible = cases[c].window ? SDM_MIN(P, cases[c].window) : P;
            double bytes = 2.0 * B * visible * H * D * sizeof(bf16);
            printf("| %s | %d | %d | %.2f | %.0f |\n", cases[c].window ? "SWA w=128" : "full", P, B, us,
                   bytes / (us * 1e-6) / 1e9);
            CK(cudaDeviceSynchronize());
            CHECK(count_nonfinite(out, row) == 0, "decode B%d P%d: non-finite output", B, P);
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
            CK(cudaFree(qkvz)); CK(cudaFree(out)); CK(cudaFree(pool)); CK(cudaFree(pos));
            free(hpos);
            attn_rope_destroy(&rope);
        }
    CK(cudaStreamDestroy(st));
}

int main(void) {
    const int B = 4, T = 4096, H = 16, D = 128, windows[2] = {0, 128}, warm = 5, reps = 30;
    size_t n = (size_t)B * T * H * D;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    bf16 *buf[8];
    for (int i = 0; i < 8; i++) {
        CK(cudaMalloc((void **)&buf[i], n * sizeof(bf16)));
        bench_fill<<<(unsigned)((n + 255) / 256), 256>>>(buf[i], n, 1234u + i);
    }
    float *lse;
    CK(cudaMalloc((void **)&lse, (size_t)B * H * T * sizeof(float)));
    void *ws;
    float ms[2][2];
    double tflops[2][2];
    for (int c = 0; c < 2; c++) {
        AttnDims a;
        a.dim = H * D; a.n_heads = H; a.n_kv_heads = H; a.head_dim = D; a.window = windows[c]; a.gated = 0;
        a.rope_theta = 10000.0;
        CK(cudaMalloc(&ws, attn_backward_workspace_bytes(&a, B, T)));
        BenchBufs bb = {&a, B, T, buf[0], buf[1], buf[2], buf[3], buf[4], buf[5], buf[6], buf[7], lse, ws};
        double pairs = visible_pairs(T, windows[c]) * B * H;
        for (int bwd = 0; bwd < 2; bwd++) {
            ms[c][bwd] = time_pass(&bb, bwd, NULL, NULL, warm, reps);
            tflops[c][bwd] = (bwd ? 10.0 : 4.0) * D * pairs / (ms[c][bwd] * 1e-3) / 1e12;
        }
        // tile configurations of each tensor-core kernel, timed alone (the pass above ran them, so lse and delta hold
        // real values)
        AttnArgs p = attn_args(&a, T);
        p.q = bb.q; p.k = bb.k; p.v = bb.v; p.o = bb.out; p.dout = bb.dout; p.out = bb.out;
        p.dq = bb.dq; p.dk = bb.dk; p.dv = bb.dv; p.lse = lse; p.delta = (float *)ws;
        struct { const char *name; KernelLaunch f; } variants[] = {
            {"fwd 8 warps x 16 rows x 64 keys, 1/SM", attn_fwd_mma<128, 8, 64, 1, 1, true>},
            {"fwd 4 warps x 16 rows x 64 keys, 2/SM", attn_fwd_mma<128, 4, 64, 1, 2, true>},
            {"fwd 4 warps x 16 rows x 64 keys, 2/SM, no skip", attn_fwd_mma<128, 4, 64, 1, 2, false>},
            {"fwd 4 warps x 32 rows x 64 keys, 1/SM", attn_fwd_mma<128, 4, 64, 2, 1, true>},
            {"fwd 4 warps x 32 rows x 64 keys, 1/SM, no skip", attn_fwd_mma<128, 4, 64, 2, 1, false>},
            {"fwd 4 warps x 32 rows x 32 keys, 2/SM", attn_fwd_mma<128, 4, 32, 2, 2, true>},
            {"fwd wgmma, TMA producer, 2 warpgroups x 64 rows", attn_wgmma_available() ? attn_fwd_wgmma : NULL},
            {"delta", attn_delta<bf16, 128>},
            {"dkdv 4 warps x 64 queries, 2/SM", attn_dkdv_mma<128, 4, 64, 2, true>},
            {"dkdv 4 warps x 64 queries, 2/SM, no skip", attn_dkdv_mma<128, 4, 64, 2, false>},
            {"dkdv 4 warps x 32 queries, 2/SM", attn_dkdv_mma<128, 4, 32, 2, true>},
            {"dq 4 warps x 64 keys, 2/SM", attn_dq_mma<128, 4, 64, 2, true>},
            {"dq 4 warps x 64 keys, 2/SM, no skip", attn_dq_mma<128, 4, 64, 2, false>},
            {"dq 4 warps x 32 keys, 2/SM", attn_dq_mma<128, 4, 32, 2, true>},
            {"dkdv wgmma, TMA producer, 2 warpgroups x 64 keys", attn_wgmma_available() ? attn_dkdv_wgmma : NULL},
            {"dq wgmma, TMA producer, 2 warpgroups x 64 queries", attn_wgmma_available() ? attn_dq_wgmma : NULL},
        };
        // each forward variant's output must match the default's (the GPU tests check the default against the CPU)
        float *ref_out = download_f(bb.out, n);
        printf("window %d, kernel variants (median ms):\n", windows[c]);
        for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
            if (!variants[i].f) continue; // not in this build (wgmma: sm_90a)
            float t = time_pass(&bb, 0, variants[i].f, &p, 3, 15);
            printf("  %-48s %.3f", variants[i].name, t);
            if (strncmp(variants[i].name, "fwd", 3) == 0) {
                printf(" = %5.1f TFLOP/s", 4.0 * D * pairs / (t * 1e-3) / 1e12);
                CK(cudaDeviceSynchronize());
                float *got = download_f(bb.out, n);
                double err = rel_diff(got, ref_out, n);
                CHECK(err < 1e-2, "%s: output differs from the default forward by %.2e", variants[i].name, err);
                printf("   (output vs default: %.1e)", err);
                free(got);
            }
            printf("\n");
        }
        free(ref_out);
        CK(cudaDeviceSynchronize());
        CHECK(count_nonfinite(buf[3], n) == 0, "window %d: non-finite forward output", windows[c]);
        CHECK(count_nonfinite(buf[5], n) == 0, "window %d: non-finite dq", windows[c]);
        CK(cudaFree(ws));
    }
    printf("\nbf16, B=%d T=%d heads=%d d=%d, median of %d after %d warm-up\n", B, T, H, D, reps, warm);
    printf("| mask | pass | ms | TFLOP/s (inside mask) |\n|---|---|---|---|\n");
    for (int c = 0; c < 2; c++)
        for (int bwd = 0; bwd < 2; bwd++)
            printf("| %s | %s | %.3f | %.1f |\n", windows[c] ? "SWA w=128" : "full causal", bwd ? "bwd" : "fwd",
                   ms[c][bwd], tflops[c][bwd]);
    printf("SWA w=128 speed-up over full causal: fwd %.1fx, bwd %.1fx, fwd+bwd %.1fx\n", ms[0][0] / ms[1][0],
           ms[0][1] / ms[1][1], (ms[0][0] + ms[0][1]) / (ms[1][0] + ms[1][1]));
    for (int i = 0; i < 8; i++) CK(cudaFree(buf[i]));
    CK(cudaFree(lse));
    bench_decode();
    return test_summary();
}
