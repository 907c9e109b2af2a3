// tests/bench_rows.cu: what this GPU's memory gives the SDM op's access pattern, with no arithmetic: the measured
// floor of the op's row kernels (BENCHMARKS.md). The op moves whole rows of a large bank at random slots: the
// flagship's bank is 65,536 rows of 1,024 bf16 (2 KB) per stream, its bank gradient the same rows in fp32 (4 KB) or
// bf16. Timed here on a bank of 8 streams (1 GiB of 2 KB rows, 2 GiB of 4 KB rows; far above L2), launches of 65,536
// random rows each (one forward gather launch of the flagship at B = 4: 8 streams x 64 tokens x 128 rows):
//   gather  each warp reads K whole rows at a time (K = the rows it has in flight), XORs them into registers
//   update  each warp reads K whole rows, changes them and writes them back in place (distinct rows in a launch),
//           as the scatters do
// at 8 to 64 warps an SM (persistent grids of 1 to 8 blocks of 256 threads an SM), against a sequential read and a
// sequential copy of the same bank. The slots of the warp's next K rows are loaded before its current rows, so a row
// load never waits on a slot load: the most a row kernel of the op could get from the bus at that shape.
//   build/bench_rows [reps]
#include <vector>

#include "core/cuda_common.cuh"
#include "core/rng.h"
#include "core/wgmma.cuh"
#include "tests/bench.h"

#define ROWS_STREAMS 8
#define ROWS_N 65536                                  // rows a stream
#define ROWS_LAUNCH (ROWS_STREAMS * 64 * 128)         // rows a launch
#define ROWS_LAUNCHES 16                              // launches a timed run, each on its own slots
#define ROWS_THREADS 256

// Rows of Q 16-byte vectors a lane (Q = 4: 2 KB, 8: 4 KB); K rows in flight a warp. mode 0: gather, 1: update.
template <int K, int Q, int MODE>
__global__ void __launch_bounds__(ROWS_THREADS) rows_kernel(uint4 *bank, const int *slots, int n, uint4 *out) {
    const int lane = threadIdx.x % 32, gw = (blockIdx.x * ROWS_THREADS + threadIdx.x) / 32,
              tw = gridDim.x * ROWS_THREADS / 32;
    uint4 acc = make_uint4(0, 0, 0, 0);
    int next = gw * K + lane < n && lane < K ? slots[gw * K + lane] : -1;
    for (int k0 = gw * K; k0 < n; k0 += tw * K) {
        int sl[K];
#pragma unroll
        for (int j = 0; j < K; j++) sl[j] = __shfl_sync(0xffffffffu, next, j);
        int ka = k0 + tw * K + lane; // the next K rows' slots, before this step's rows
        next = ka < n && lane < K ? slots[ka] : -1;
        uint4 r[K][Q];
#pragma unroll
        for (int j = 0; j < K; j++)
#pragma unroll
            for (int u = 0; u < Q; u++)
                if (sl[j] >= 0) r[j][u] = bank[((size_t)sl[j] * Q + u) * 32 + lane];
#pragma unroll
        for (int j = 0; j < K; j++)
#pragma unroll
            for (int u = 0; u < Q; u++) {
                if (sl[j] < 0) continue;
                if (MODE == 0) {
                    acc.x ^= r[j][u].x; acc.y ^= r[j][u].y; acc.z ^= r[j][u].z; acc.w ^= r[j][u].w;
                } else {
                    uint4 x = r[j][u];
                    x.x ^= 0x00010001u; x.w ^= 0x00010001u; // the low mantissa bits of two bf16 pairs
                    bank[((size_t)sl[j] * Q + u) * 32 + lane] = x;
                }
            }
    }
    if (MODE == 0) out[gw * 32 + lane] = acc;
}

struct RowsBench {
    uint4 *bank, *out;
    int *gather_slots, *update_slots; // [ROWS_LAUNCHES][ROWS_LAUNCH]
    int sms, reps;
    double seq_read_tbs;
    uint32_t sum[2]; // the gathers' checksum of each row size (0: none yet), Q = 4 and 8
    int bad;         // gathers whose checksum differed
};

// Zero the warps' outputs before a gather case; after it, the XOR of every output word is the XOR of every word of
// the last launch's rows, whichever kernel, grid and order gathered them: each gather must give the first one's.
static void rows_out_clear(RowsBench &b) {
    cudaCheck(cudaMemset(b.out, 0, (size_t)8 * b.sms * ROWS_THREADS * sizeof(uint4)));
}
static void rows_out_check(RowsBench &b, int Q) {
    std::vector<uint32_t> h((size_t)8 * b.sms * ROWS_THREADS * 4);
    cudaCheck(cudaMemcpy(h.data(), b.out, h.size() * 4, cudaMemcpyDeviceToHost));
    uint32_t x = 0;
    for (uint32_t w : h) x ^= w;
    uint32_t &ref = b.sum[Q == 8];
    if (!ref) ref = x;
    else if (x != ref) { printf("  ^ checksum %08x, expected %08x\n", x, ref); b.bad++; }
}

#ifdef CORE_HAVE_WGMMA
// The gather with its rows in shared memory instead of registers: a warp keeps its next STAGES rows in flight as bulk
// copies (one 16-byte-aligned row a copy, issued by lane 0, landing on one mbarrier a stage), so the bytes in flight
// are not bounded by registers. Slots are read 32 of the warp's entries at a time, one a lane, ahead of their copies.
template <int STAGES, int Q>
__global__ void __launch_bounds__(ROWS_THREADS) rows_bulk_kernel(const uint4 *bank, const int *slots, int n,
                                                                 uint4 *out) {
    extern __shared__ __align__(128) uint4 rows_stage[]; // [warps][STAGES][Q * 32]
    __shared__ __align__(8) uint64_t rows_bar[ROWS_THREADS / 32][STAGES];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gw = (blockIdx.x * ROWS_THREADS + threadIdx.x) / 32,
              tw = gridDim.x * ROWS_THREADS / 32, bytes = Q * 512;
    uint4 *buf = rows_stage + (size_t)warp * STAGES * Q * 32;
    const uint32_t buf_s = (uint32_t)__cvta_generic_to_shared(buf),
                   bar_s = (uint32_t)__cvta_generic_to_shared(&rows_bar[warp][0]);
    if (lane < STAGES) wg_bar_init(bar_s + 8 * lane, 1);
    wg_bar_init_fence();
    __syncwarp();
    int ahead = -1;
    auto issue = [&](int i) { // the copy of the warp's entry i (k = gw + i tw) into stage i % STAGES
        if (i % 32 == 0) ahead = gw + (size_t)(i + lane) * tw < (size_t)n ? slots[gw + (size_t)(i + lane) * tw] : -1;
        int sl = __shfl_sync(0xffffffffu, ahead, i % 32);
        if (lane == 0 && sl >= 0) {
            uint32_t bar = bar_s + 8 * (i % STAGES);
            wg_bar_expect(bar, bytes);
            wg_bulk_load(buf_s + (i % STAGES) * bytes, bank + (size_t)sl * Q * 32, bytes, bar);
        }
    };
    for (int i = 0; i < STAGES; i++) issue(i);
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int i = 0; gw + (size_t)i * tw < (size_t)n; i++) {
        wg_bar_wait(bar_s + 8 * (i % STAGES), (i / STAGES) & 1);
#pragma unroll
        for (int u = 0; u < Q; u++) {
            uint4 r = buf[(i % STAGES) * Q * 32 + u * 32 + lane];
            acc.x ^= r.x; acc.y ^= r.y; acc.z ^= r.z; acc.w ^= r.w;
        }
        __syncwarp(); // every lane has read stage i % STAGES before it is refilled
        if (lane == 0) wg_fence_proxy_async();
        issue(i + STAGES);
    }
    out[gw * 32 + lane] = acc;
}

template <int STAGES, int Q> static void bench_rows_bulk(RowsBench &b) {
    auto kern = rows_bulk_kernel<STAGES, Q>;
    const int smem = ROWS_THREADS / 32 * STAGES * Q * 512;
    cudaCheck(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int fit = 0;
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kern, ROWS_THREADS, smem));
    for (int bps = 1; bps <= fit && bps <= 8; bps++) {
        int grid = bps * b.sms;
        rows_out_clear(b);
        BenchTime t = bench_time(2, b.reps, [](int) {}, [&] {
            for (int l = 0; l < ROWS_LAUNCHES; l++)
                kern<<<grid, ROWS_THREADS, smem>>>(b.bank, b.gather_slots + (size_t)l * ROWS_LAUNCH, ROWS_LAUNCH,
                                                   b.out);
            cudaCheck(cudaGetLastError());
        });
        double tbs = (double)ROWS_LAUNCHES * ROWS_LAUNCH * Q * 512 / (t.median * 1e9);
        printf("%-7s %5d B %9d %9d %4s %9.3f %8.2f %7.0f%%\n", "bulk", Q * 512, STAGES, bps * 8, "-",
               t.median / ROWS_LAUNCHES * 1e3, tbs, 100.0 * tbs / b.seq_read_tbs);
        rows_out_check(b, Q);
    }
}
#endif

// Sequential read (MODE 0) or copy of the first half onto the second (1), four 16-byte vectors a thread in flight.
template <int MODE> __global__ void __launch_bounds__(ROWS_THREADS) seq_kernel(uint4 *buf, size_t n, uint4 *out) {
    const size_t tid = (size_t)blockIdx.x * ROWS_THREADS + threadIdx.x, nt = (size_t)gridDim.x * ROWS_THREADS;
    const size_t m = MODE ? n / 2 : n;
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (size_t i0 = tid; i0 < m; i0 += 4 * nt) {
        uint4 r[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            if (i0 + j * nt < m) r[j] = buf[i0 + j * nt];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (i0 + j * nt >= m) continue;
            if (MODE) buf[m + i0 + j * nt] = r[j];
            else { acc.x ^= r[j].x; acc.y ^= r[j].y; acc.z ^= r[j].z; acc.w ^= r[j].w; }
        }
    }
    if (!MODE) out[tid] = acc;
}


// The kernel at `blocks_per_sm` resident blocks of ROWS_THREADS an SM (skipped where they do not fit), one line.
template <int K, int Q, int MODE> static void bench_rows_case(RowsBench &b, int blocks_per_sm) {
    auto kern = rows_kernel<K, Q, MODE>;
    int fit = 0;
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kern, ROWS_THREADS, 0));
    cudaFuncAttributes fa;
    cudaCheck(cudaFuncGetAttributes(&fa, kern));
    if (blocks_per_sm > fit) return;
    const int *slots = MODE ? b.update_slots : b.gather_slots;
    int grid = blocks_per_sm * b.sms;
    if (MODE == 0) rows_out_clear(b);
    BenchTime t = bench_time(2, b.reps, [](int) {}, [&] {
        for (int l = 0; l < ROWS_LAUNCHES; l++)
            kern<<<grid, ROWS_THREADS>>>(b.bank, slots + (size_t)l * ROWS_LAUNCH, ROWS_LAUNCH, b.out);
        cudaCheck(cudaGetLastError());
    });
    double bytes = (double)ROWS_LAUNCHES * ROWS_LAUNCH * Q * 512 * (MODE ? 2 : 1), tbs = bytes / (t.median * 1e9);
    printf("%-7s %5d B %9d %9d %4d %9.3f %8.2f %7.0f%%\n", MODE ? "update" : "gather", Q * 512, K, blocks_per_sm * 8,
           fa.numRegs, t.median / ROWS_LAUNCHES * 1e3, tbs, 100.0 * tbs / b.seq_read_tbs);
    if (MODE == 0) rows_out_check(b, Q);
}

template <int K, int Q, int MODE> static void bench_rows_sweep(RowsBench &b) {
    for (int bps = 1; bps <= 8; bps *= 2) bench_rows_case<K, Q, MODE>(b, bps);
}

template <int MODE> static double bench_seq(RowsBench &b, size_t bytes) {
    int grid = 4 * b.sms;
    BenchTime t = bench_time(2, b.reps, [](int) {}, [&] {
        seq_kernel<MODE><<<grid, ROWS_THREADS>>>(b.bank, bytes / 16, b.out);
        cudaCheck(cudaGetLastError());
    });
    return (double)bytes / (t.median * 1e9); // a copy moves each byte of the half once read, once written
}

int main(int argc, char **argv) {
    RowsBench b;
    b.reps = argc > 1 ? atoi(argv[1]) : 5;
    b.sms = core_sm_count();
    cudaDeviceProp p;
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    const size_t bank_bytes = (size_t)ROWS_STREAMS * ROWS_N * 4096; // room for the 4 KB rows
    cudaCheck(cudaMalloc(&b.bank, bank_bytes));
    cudaCheck(cudaMalloc(&b.out, (size_t)8 * b.sms * ROWS_THREADS * sizeof(uint4)));
    bench_fill<<<(unsigned)ceil_div(bank_bytes / 2, 256), 256>>>((__nv_bfloat16 *)b.bank, bank_bytes / 2, 1);
    cudaCheck(cudaGetLastError());

    // gather: uniform slots with repeats, as the op's; update: distinct rows in a launch (a partial shuffle)
    const int rows = ROWS_STREAMS * ROWS_N;
    std::vector<int> g((size_t)ROWS_LAUNCHES * ROWS_LAUNCH), u(g.size()), perm(rows);
    Rng rng = rng_make(7);
    for (size_t i = 0; i < g.size(); i++) g[i] = (int)(rng_u64(&rng) % rows);
    for (int i = 0; i < rows; i++) perm[i] = i;
    for (int l = 0; l < ROWS_LAUNCHES; l++)
        for (int i = 0; i < ROWS_LAUNCH; i++) {
            int j = i + (int)(rng_u64(&rng) % (uint64_t)(rows - i));
            std::swap(perm[i], perm[j]);
            u[(size_t)l * ROWS_LAUNCH + i] = perm[i];
        }
    cudaCheck(cudaMalloc(&b.gather_slots, g.size() * sizeof(int)));
    cudaCheck(cudaMalloc(&b.update_slots, u.size() * sizeof(int)));
    cudaCheck(cudaMemcpy(b.gather_slots, g.data(), g.size() * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(b.update_slots, u.data(), u.size() * sizeof(int), cudaMemcpyHostToDevice));

    b.seq_read_tbs = 1.0; // so that the sequential figures print against themselves first
    double rd = bench_seq<0>(b, bank_bytes / 2), cp = bench_seq<1>(b, bank_bytes / 2);
    b.seq_read_tbs = rd;
    printf("GPU %s, %d SMs; %d launches of %d random rows, median of %d\n", p.name, b.sms, ROWS_LAUNCHES,
           ROWS_LAUNCH, b.reps);
    printf("sequential read of 1 GiB: %.2f TB/s; copy of 512 MiB onto 512 MiB: %.2f TB/s (read + written)\n", rd,
           cp);
    printf("%-7s %7s %9s %9s %4s %9s %8s %8s\n", "pattern", "row", "rows/warp", "warps/SM", "regs", "us/launch",
           "TB/s", "of read");
    b.sum[0] = b.sum[1] = 0;
    b.bad = 0;
    // the gathers first: the updates change the bank
    bench_rows_sweep<1, 4, 0>(b);
    bench_rows_sweep<2, 4, 0>(b);
    bench_rows_sweep<4, 4, 0>(b);
    bench_rows_sweep<8, 4, 0>(b);
    bench_rows_sweep<1, 8, 0>(b);
    bench_rows_sweep<2, 8, 0>(b);
    bench_rows_sweep<4, 8, 0>(b);
#ifdef CORE_HAVE_WGMMA
    bench_rows_bulk<2, 4>(b);
    bench_rows_bulk<4, 4>(b);
    bench_rows_bulk<8, 4>(b);
    bench_rows_bulk<2, 8>(b);
    bench_rows_bulk<4, 8>(b);
#endif
    bench_rows_sweep<1, 4, 1>(b);
    bench_rows_sweep<2, 4, 1>(b);
    bench_rows_sweep<4, 4, 1>(b);
    bench_rows_sweep<1, 8, 1>(b);
    bench_rows_sweep<2, 8, 1>(b);
    if (b.bad) {
        printf("%d gathers gave another checksum than the first of their row size\n", b.bad);
        return 1;
    }
    cudaCheck(cudaDeviceSynchronize());
    return 0;
}
