// core/wgmma.cuh: Hopper warpgroup matrix multiply (wgmma, sm_90a) for bf16 tiles in shared memory: the 128-byte
// swizzled tile layout the instructions read, the matrix descriptors that point at it, and the m64n128k16 products
// (fp32 accumulators in registers) with A from shared memory or from registers. Compiled only for sm_90a
// (CORE_HAVE_WGMMA); a build for another GPU keeps the mma.sync kernels. Also the Hopper copies that feed them: TMA
// tile loads (one thread issues a tile, an mbarrier counts its bytes), named barriers, register reallocation.
//
// Layout (PTX ISA, "Shared memory matrix layout", 128B swizzle): a bf16 tile [rows][128] is stored as two halves of 64
// columns, each half rows x 128 bytes; the 16-byte chunk c (0..7) of row r of a half sits at r*128 + ((c ^ r%8) * 16).
// Halves and tiles start on 1,024-byte boundaries (the swizzle is a function of the address bits).
#ifndef SDM_CORE_WGMMA_CUH
#define SDM_CORE_WGMMA_CUH

#include <cuda.h> // CUtensorMap (a type only: the driver function comes through the runtime)
#include <cudaTypedefs.h>
#include <stdint.h>

#include "core/cuda_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || (!defined(__CUDA_ARCH__) && defined(SDM_SM90A))
#define CORE_HAVE_WGMMA 1
#endif

#define WG_HALF_COLS 64 // bf16 columns of a swizzled half (128 bytes a row)

// The byte offset of element (r, col) of a swizzled [rows][128] tile, col a multiple of 8 (one 16-byte chunk).
__host__ __device__ __forceinline__ uint32_t wg_tile_offset(int rows, int r, int col) {
    int half = col / WG_HALF_COLS, c = (col % WG_HALF_COLS) / 8;
    return (uint32_t)(half * rows * 128 + r * 128 + ((c ^ (r & 7)) * 16));
}

// The first 1,024-byte boundary at or after p in shared memory (where swizzled tiles must start).
__device__ __forceinline__ unsigned char *wg_align_smem(unsigned char *p) {
    return p + ((1024 - ((uint32_t)__cvta_generic_to_shared(p) & 1023)) & 1023);
}

// A matrix descriptor: start address, leading and stride byte offsets, 128-byte swizzle (layout type 1).
__device__ __forceinline__ uint64_t wg_desc(uint32_t smem_addr, uint32_t lead_bytes, uint32_t stride_bytes) {
    return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | (uint64_t)((lead_bytes >> 4) & 0x3FFF) << 16 |
           (uint64_t)((stride_bytes >> 4) & 0x3FFF) << 32 | (uint64_t)1 << 62;
}

// The k-step ks (16 columns) of a swizzled [rows][128] tile read K-major (rows are M or N, columns are K), from row
// row0 (a multiple of 8): 8-row groups 1,024 bytes apart; the step's 32 bytes within a row (the hardware applies
// the swizzle to the advanced address).
__device__ __forceinline__ uint64_t wg_desc_kmajor(uint32_t tile, int rows, int row0, int ks) {
    return wg_desc(tile + (uint32_t)((ks / 4) * rows * 128 + row0 * 128 + (ks % 4) * 32), 16, 1024);
}

// The k-step ks (16 rows) of a swizzled [rows][128] tile read MN-major (rows are K, the 128 columns are N; the
// product transposes it): the two 64-column halves rows*128 bytes apart, 8-row groups 1,024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc_mnmajor(uint32_t tile, int rows, int ks) {
    return wg_desc(tile + (uint32_t)(ks * 16 * 128), (uint32_t)rows * 128, 1024);
}

#ifdef CORE_HAVE_WGMMA
// Order this warpgroup's register and shared-memory accesses before the products that follow.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N of this warpgroup's committed groups of products are still running.
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accesses of an accumulator across the asynchronous products.
template <int R> __device__ __forceinline__ void wg_fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// d [64 x 128] (+)= A [64 x 16] . B [16 x 128], A and B K-major in shared memory; accumulate unless !acc. The
// warpgroup's thread t holds rows 16*(t/32) + (t%32)/4 + 8*(e/2) and columns 8*i + 2*(t%4) + e%2 at d[4*i + e].
__device__ __forceinline__ void wg_mma_ss(float (&d)[64], uint64_t a, uint64_t b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, "
                 "%41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, "
                 "%61, %62, %63} "
                 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
                   "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
                   "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
                   "+f"(d[63])
                 : "l"(a), "l"(b), "r"(acc));
}

// The same at n = 64: d [64 x 64] (+)= A [64 x 16] . B [16 x 64], d[4*i + e] at columns 8*i + 2*(t%4) + e%2.
__device__ __forceinline__ void wg_mma_ss(float (&d)[32], uint64_t a, uint64_t b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31} "
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b), "r"(acc));
}

// d [64 x 128] += A [64 x 16] . B [16 x 128], A in registers (the mma.sync m16n8k16 A fragment of each warp's 16
// rows), B MN-major in shared memory (transposed by the product).
__device__ __forceinline__ void wg_mma_rs_t(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, "
                 "%41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, "
                 "%61, %62, %63} "
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
                   "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
                   "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
                   "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// ---------------------------------------------------------------------------------------------------------------
// Tensor memory access (TMA) and the barriers around it. A copy of a tile from global memory is issued by one
// thread and completes on an mbarrier in shared memory (the barrier counts the bytes that land); warpgroups that take
// turns signal each other on named barriers; a warpgroup that only issues copies hands its registers to the others.

// An mbarrier at shared address bar that completes a phase after `count` arrivals (and the bytes expected of them).
__device__ __forceinline__ void wg_bar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Barrier initialisations, visible to the copy engine and the other threads (before a __syncthreads).
__device__ __forceinline__ void wg_bar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void wg_bar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrive and expect `bytes` more bytes of copies before the phase completes.
__device__ __forceinline__ void wg_bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Wait for the completion of the phase of parity `parity` (phases alternate 0, 1, 0, ...).
__device__ __forceinline__ void wg_bar_wait(uint32_t bar, int parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
// `bytes` contiguous bytes (a multiple of 16, both ends 16-byte aligned) from global memory into shared memory at
// smem, completing on bar: a row of a gather, one instruction and no registers for its bytes in flight.
__device__ __forceinline__ void wg_bulk_load(uint32_t smem, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
// This thread's shared-memory reads and writes (and those ordered before them by a barrier) before its next copies
// into shared memory: a buffer read by the warp is refilled only after.
__device__ __forceinline__ void wg_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Double buffers on mbarriers: use i of a buffer (i = 0, 1, 2, ...) is buffer i % 2, and completes phase i / 2 of
// its barriers. Before the producer refills buffer i % 2 for use i, the consumers have released use i - 2:
__device__ __forceinline__ void wg_wait_released(uint32_t empty, int i) {
    if (i >= 2) wg_bar_wait(empty, ((i >> 1) + 1) & 1);
}
// and before the consumers read use i, its copies have landed.
__device__ __forceinline__ void wg_wait_filled(uint32_t full, int i) { wg_bar_wait(full, (i >> 1) & 1); }
// The box at coordinates (c0, c1, c2, c3) of the 4-d tensor map tm into shared memory at smem, completing on bar.
__device__ __forceinline__ void wg_tma_load4(uint32_t smem, const CUtensorMap *tm, int c0, int c1, int c2, int c3,
                                             uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
                 "%5}], [%6];\n" ::"r"(smem),
                 "l"((uint64_t)tm), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
                 : "memory");
}
// Both 64-column halves of the [rows][128] tile at (row, head, sequence b) of tm into the swizzled tile at smem.
__device__ __forceinline__ void wg_tma_tile(uint32_t smem, const CUtensorMap *tm, int head, int row, int b, int rows,
                                            uint32_t bar) {
    wg_tma_load4(smem, tm, 0, head, row, b, bar);
    wg_tma_load4(smem + rows * 128, tm, WG_HALF_COLS, head, row, b, bar);
}
// Named barrier `id` (1..15; 0 is __syncthreads) among `threads` threads: wait for all, or only count this warp in.
__device__ __forceinline__ void wg_named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void wg_named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads));
}
// This warpgroup's registers a thread, lowered or raised to N (every warp of the warpgroup executes it).
template <int N> __device__ __forceinline__ void wg_setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void wg_setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
#endif

#ifdef CORE_HAVE_WGMMA
// The tensor map of a bf16 [B][T][heads][128] tensor at base read in boxes of `rows` rows of one head and 64 columns
// (one swizzled half, core/wgmma.cuh's layout), coordinates (column, head, row, sequence): rows past T read as 0.
// cuTensorMapEncodeTiled is a driver function; the runtime hands out its address, so nothing links libcuda.
static inline CUtensorMap wg_tensor_map(const void *base, int B, int T, int heads, int rows) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = NULL;
    if (!encode) {
        cudaDriverEntryPointQueryResult q;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void **)&encode, 12000,
                                                   cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess) sdm_die("the driver has no cuTensorMapEncodeTiled (TMA)");
    }
    CUtensorMap m;
    cuuint64_t dims[4] = {128, (cuuint64_t)heads, (cuuint64_t)T, (cuuint64_t)B};
    cuuint64_t strides[3] = {128 * 2, (cuuint64_t)heads * 128 * 2, (cuuint64_t)T * heads * 128 * 2}; // bytes
    cuuint32_t box[4] = {64, 1, (cuuint32_t)rows, 1}, step[4] = {1, 1, 1, 1};
    CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)base, dims, strides, box, step,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) sdm_die("cuTensorMapEncodeTiled: error %d (B %d, T %d, heads %d)", (int)r, B, T, heads);
    return m;
}
#endif

#endif
