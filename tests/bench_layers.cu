// tests/bench_layers.cu: the RMSNorm and SwiGLU kernels of core/layers.cuh (the step profile's "norms,
// element-wise" part) at the flagship shape: n = B*T = 16384 rows, D = 2048, F = 5632, bf16. Each launcher is timed
// alone: median of CUDA-event timings after warm-up, with L2 flushed before each run (a 256 MiB memset outside the
// events), so every byte comes from HBM. Bytes are those of the [n, D] and [n, F] tensors each call must read and
// write once, as the profile's floors count them (docs/MODEL.md#step-profile); the weights, rstd and the backward's
// dw partials (3-4% of its bytes) are left out. Only the launchers are used, so this file also builds against an
// older core/layers.cuh: the same benchmark measures a tree before and after a change.
#include "core/layers.cuh"
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

int main(void) {
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
    return test_summary();
}
