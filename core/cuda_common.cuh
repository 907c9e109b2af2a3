// core/cuda_common.cuh: CUDA / cuBLAS error checking with file:line, the precision vocabulary (core/dtype.cuh) and
// conversion between its types (dtype_convert), and the deterministic warp and block sums shared by every CUDA
// module. Every CUDA and cuBLAS call in sdm.c goes through cudaCheck / cublasCheck; kernel launches are followed by
// cudaCheckLast() so a bad launch is reported where it happened. Programs call cuda_require_gpu() before their first
// CUDA call, so a machine without a usable GPU gets a plain message rather than the runtime's first error.
#ifndef SDM_CORE_CUDA_COMMON_CUH
#define SDM_CORE_CUDA_COMMON_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/common.h"
#include "core/dtype.cuh"
#include "core/memory.h"

static inline void cuda_check_at(cudaError_t err, const char *file, int line) {
    if (err != cudaSuccess) sdm_die("CUDA error at %s:%d: %s", file, line, cudaGetErrorString(err));
}

static inline void cublas_check_at(cublasStatus_t st, const char *file, int line) {
    if (st != CUBLAS_STATUS_SUCCESS) sdm_die("cuBLAS error at %s:%d: status %d", file, line, (int)st);
}

#define cudaCheck(call) cuda_check_at((call), __FILE__, __LINE__)
#define cublasCheck(call) cublas_check_at((call), __FILE__, __LINE__)
#define cudaCheckLast() cuda_check_at(cudaGetLastError(), __FILE__, __LINE__)

// Stop with a plain message unless a GPU and a driver that runs this CUDA runtime are visible. Without a driver the
// runtime says "CUDA driver version is insufficient for CUDA runtime version", which hides the actual problem.
static inline void cuda_require_gpu(void) {
    int devices = 0;
    cudaError_t err = cudaGetDeviceCount(&devices);
    if (err == cudaSuccess && devices > 0) return;
    sdm_die("no usable GPU or GPU driver found (CUDA: %s). sdm.c runs on NVIDIA GPUs: check that nvidia-smi lists one "
            "and that CUDA_VISIBLE_DEVICES does not hide it",
            err == cudaSuccess ? "no device" : cudaGetErrorString(err));
}

// Every device buffer comes from here: `bytes` under category `kind` of the ledger (core/memory.h); NULL in a dry run.
// SDM_POISON=B in the environment (a debugging aid; B a byte, e.g. 0xff or 0x7f) fills every new device buffer with
// bytes B. cudaMalloc promises no contents, so a kernel that reads memory nothing wrote may pass by luck on zeroed
// pages; poisoned, such a read turns into values a test reports: 0xff gives NaN (fp32, bf16) and index -1, but a
// NaN vanishes in fmaxf and comparisons, where 0x7f's 3.4e38 (and index 2.1e9) does not. Returns B, or -1: off.
static inline int device_poison(void) {
    static int poison = -2;
    if (poison == -2) {
        const char *v = getenv("SDM_POISON");
        poison = v && *v ? (int)(strtol(v, NULL, 0) & 0xff) : -1;
    }
    return poison;
}

static inline void *device_alloc(MemKind kind, size_t bytes) {
    if (g_mem.dry_run) {
        mem_record(kind, bytes);
        return NULL;
    }
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    if (device_poison() >= 0) cudaCheck(cudaMemset(p, device_poison(), bytes));
    mem_remember(p, kind, bytes);
    return p;
}

static inline void device_free(void *p) {
    if (!p) return;
    mem_forget(p);
    cudaCheck(cudaFree(p));
}

// Host-to-device copy and zero fill that a dry run skips (its buffers do not exist).
static inline void device_upload(void *dst, const void *src, size_t bytes) {
    if (!g_mem.dry_run) cudaCheck(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

static inline void device_zero(void *dst, size_t bytes) {
    if (!g_mem.dry_run) cudaCheck(cudaMemset(dst, 0, bytes));
}

// out[i] = in[i] for i < n, from dtype `from` to dtype `to` (into bf16: rounded to nearest even; the same dtype: a
// copy): the working weights from fp32 master weights, and the optimizer's bf16 moments to and from fp32.
template <typename To, typename From> __global__ void dtype_convert_kernel(To *out, const From *in, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = dtype_from_float<To>(dtype_to_float(in[i]));
}

static inline void dtype_convert(void *out, Dtype to, const void *in, Dtype from, long long n, cudaStream_t s) {
    if (n <= 0) return;
    if (to == from) {
        cudaCheck(cudaMemcpyAsync(out, in, n * dtype_size(to), cudaMemcpyDeviceToDevice, s));
        return;
    }
    int blocks = (int)SDM_MIN(65536LL, (n + 255) / 256);
    DTYPE_DISPATCH(from, "dtype_convert", typedef T From;
                   DTYPE_DISPATCH(to, "dtype_convert",
                                  dtype_convert_kernel<T, From><<<blocks, 256, 0, s>>>((T *)out, (const From *)in, n)));
    cudaCheckLast();
}

// dev [n] of dtype t = host fp32 [n], `piece` floats at a time through a MEM_STAGING buffer (no whole device copy of
// the host array: weights, moments, a resume's pieces), converted on the device (dtype_convert). Elementwise, so the
// bits do not depend on the pieces.
static inline void device_upload_fp32_as(void *dev, Dtype t, const float *host, long long n, long long piece) {
    piece = SDM_MAX(1LL, SDM_MIN(piece, n));
    float *stage = (float *)device_alloc(MEM_STAGING, sizeof(float) * piece);
    for (long long at = 0; at < n; at += piece) {
        long long count = SDM_MIN(piece, n - at);
        cudaCheck(cudaMemcpy(stage, host + at, sizeof(float) * count, cudaMemcpyHostToDevice));
        dtype_convert((char *)dev + at * dtype_size(t), t, stage, DT_FP32, count, 0);
    }
    device_free(stage);
}

// Device bytes in use now (context, libraries and every allocation), as nvidia-smi counts them.
static inline size_t device_used_bytes(void) {
    size_t free_b = 0, total_b = 0;
    cudaCheck(cudaMemGetInfo(&free_b, &total_b));
    return total_b - free_b;
}

static inline int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }

// Sum over the 32 lanes of a warp by a fixed xor butterfly: every lane gets the same, reproducible bits.
__device__ __forceinline__ float core_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Deterministic sum of one float per thread over a block of blockDim.x threads (a multiple of 32, at most 1024):
// a fixed shuffle tree in each warp, then warp 0 adds the warp totals in the same tree. Every thread gets the sum.
// `scratch` is __shared__ float[32]; the call ends with a barrier so scratch can be reused right after.
__device__ __forceinline__ float core_block_sum(float v, float *scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    v = core_warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    t = core_warp_sum(t);
    __syncthreads();
    return t;
}

// Element-wise functions that must give the same bits wherever they run: the SwiGLU and attention-gate kernels
// (core/layers.cuh, attention/attn_rope_gate.cuh) and the decode products that fold them into their store
// (core/matmul_small_m.cuh, MatmulOut). One definition each, inlined into all of them.
__device__ __forceinline__ float core_sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
// SwiGLU: silu(a) * b.
__device__ __forceinline__ float core_swiglu(float a, float b) { return a * core_sigmoidf(a) * b; }
// The attention output gate: sigmoid(z) * o, by a division (not core_sigmoidf's reciprocal: other bits).
__device__ __forceinline__ float core_sigmoid_gate(float z, float o) { return o / (1.0f + expf(-z)); }

// ------------------------------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90): a kernel launched by launch_pdl may be scheduled while the kernel before it
// on the stream is still running, so its launch latency and whatever it does before pdl_wait() (reading weights,
// which nothing in a step writes) hide behind the other's tail. A decode step is some 280 short kernels, so this
// latency is a large share of it. The rule that keeps it exact: a kernel launched by launch_pdl calls pdl_wait()
// on every path before it touches memory an earlier kernel of the stream writes or reads (only constant data may be
// read before). griddepcontrol.wait returns once the grids it depends on have completed and their writes are
// visible, so "this grid completed" still implies "every earlier grid completed" down the chain. pdl_trigger() lets
// the next kernel be scheduled once every block of this one has started. Both are no-ops in a grid launched
// without the attribute. Launches on the legacy stream (evaluation, the tests' steps) stay plain launches. The
// training step runs on a stream of its own, so it gets them too: its weights change only in the optimizer at the
// end of a step, after every kernel that reads them, and the next step starts after the host has waited for it.
__device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// The first statement of a kernel that reads nothing constant early (after its constant loads where it has some):
// let the next kernel be scheduled, then wait for the earlier grids. The next kernel's blocks start, and issue their
// constant loads (a GEMV's first weight tiles), while this one still waits: exact all the same, since that kernel
// waits for this grid, which completes only after its own wait. (Waiting first, then triggering: the flagship's
// batch-1 decode step took 1.222 ms on an H100 against 1.173 this way; BENCHMARKS.md.)
__device__ __forceinline__ void pdl_enter(void) {
    pdl_trigger();
    pdl_wait();
}

// cp.async (sm_80+): 16 bytes from global to shared memory without passing through registers, zero-filled where
// `valid` is false (gmem must still be a valid address); a thread's copies become visible to it once it has waited
// for their commit group. No "memory" clobber: a caller that reuses a buffer orders its own accesses.
__device__ __forceinline__ void core_cp_async16(void *smem, const void *gmem, bool valid) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void core_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's newest commit groups are still in flight (a compiler barrier too: reads of
// the copied data stay after it).
template <int N> __device__ __forceinline__ void core_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// A hint that the 128-byte line holding p be fetched into L2 (no register written, no fault on a valid address).
__device__ __forceinline__ void core_prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Streaming multiprocessors of the current device (asked once: a process drives one GPU).
static inline int core_sm_count(void) {
    static int sms = 0;
    if (!sms) {
        int dev;
        cudaCheck(cudaGetDevice(&dev));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    }
    return sms;
}

static int g_pdl = 1; // launch_pdl uses programmatic dependent launch (infer_sdm --no-pdl turns it off to compare)

// kernel<<<grid, block, smem, s>>>(args...), with programmatic dependent launch when allowed (see above).
template <typename... Params, typename... Args>
static inline void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                              Args... args) {
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = g_pdl && s != 0 ? 1 : 0;
    cudaCheck(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...));
}

#endif
