// sdm/sdm_op_fwd.cuh: the chunked forward of the SDM op (docs/SDM.md#chunked-wy-form): sdm_op_forward (training and
// prefill) runs phase 1 (sdm/sdm_op_wy.cuh), then sequentially over the chunks, for all streams at once, three phases
// per chunk: fgather (R0, E, snapshots; X = beta (V - R0)), fsolve (Delta = Linv X, O = S Delta + E) and fscatter (each
// written slot's row updated once), either as three launches per chunk or, for a prefill of few streams, as one
// persistent cooperative launch whose blocks run the same block bodies between grid-wide barriers (same bits). In:
// v [B,T,H,d] and the phase-1 quantities; out: readings [B,T,H,d], the bank [B,H,N,d] advanced to the end of the
// sequence; with training = 1 also Delta, U = V - R0 [S][Tp][d] and the snapshots of the touched rows in `saved` for
// sdm/sdm_op_bwd.cuh.
#ifndef SDM_SDM_OP_FWD_CUH
#define SDM_SDM_OP_FWD_CUH

#include <cooperative_groups.h>

#include "sdm/sdm_op_common.cuh"
#include "sdm/sdm_op_wy.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Phase 2 (forward), one chunk c of every stream per round of three phases, each a block body called with its block's
// coordinates by a kernel of its own (the host loops over the chunks) or by the persistent kernel below:
//   fgather  per (stream, token) and side (write rows, read rows), whole rows: R0 and the snapshots, E;
//            X = beta (V - R0) and E to the per-chunk buffers (U = V - R0 saved for the backward)
//   fsolve   per (stream, DB columns): Delta = Linv X, O = S Delta + E
//   fscatter one warp per write entry; the last entry of each written slot writes its whole row
// Whole rows keep the random bank accesses long and contiguous (2-4 KB), which HBM serves far better than the
// short column slices of one-CTA-per-column-block designs (measured: see the notes in tests/bench_sdm_op.cu).

// Pointer to row t of chunk c's Delta: the saved [S][Tp][d] array when training, else the per-chunk buffer.
__device__ __forceinline__ float *sdm_delta_row(const SdmOpArgs &a, int s, int c, int t) {
    return a.training ? a.delta + ((size_t)s * a.Tp + (size_t)c * a.C + t) * a.d
                      : a.cdelta + ((size_t)s * a.C + t) * a.d;
}

// Block (t, s, z) of the grid (C, S, 2), SDM_ROW_THREADS threads, `work` and `bars` of sdm_gather_block_sum: z = 0
// gathers token t's write rows (R0, the snapshots; U and X), 1 its read rows (E), so a prefill's two streams still
// fill the GPU.
template <typename Tb, int STAGES>
__device__ __forceinline__ void sdm_fgather_block(const SdmOpArgs &a, const float *v, const Tb *bank, int c, dim3 blk,
                                                  float *work, uint32_t bars) {
    const int t = blk.x, s = blk.y, d = a.d, tp = c * a.C + t;
    const size_t tok = (size_t)s * a.Tp + tp, crow = ((size_t)s * a.C + t) * d;
    const Tb *M = bank + (size_t)s * a.N * d;
    if (blk.z == 1) {
        const float *e = sdm_gather_block_sum<Tb, STAGES>(a, M, a.r_slot, a.r_gath, tok * a.R, a.R, work, bars, false);
        for (int i = threadIdx.x; i < d; i += blockDim.x) a.ce[crow + i] = e[i];
        return;
    }
    const float *r0 =
        sdm_gather_block_sum<Tb, STAGES>(a, M, a.w_slot, a.w_gath, tok * a.W, a.W, work, bars, a.training != 0);
    float bt = a.beta[tok];
    for (int i = threadIdx.x; i < d; i += blockDim.x) { // U = V - R0 (saved), X = beta U
        float u = (tp < a.T ? v[sdm_tok_off(a, s, tp, d) + i] : 0.f) - r0[i];
        if (a.training) a.u[tok * d + i] = u;
        a.cx[crow + i] = bt * u;
    }
}

// STAGES: sdm_gather_block_sum's (0, or SDM_GATHER_STAGES where sdm_gather_bulk_fits); dynamic smem
// sdm_gather_work_bytes.
template <typename Tb, int STAGES>
__global__ void __launch_bounds__(SDM_ROW_THREADS)
    sdm_fgather_kernel(SdmOpArgs a, const float *v, const Tb *bank, int c) {
    extern __shared__ __align__(128) float sdm_fgather_work[];
    __shared__ __align__(8) uint64_t bars[SDM_ROW_WARPS * (STAGES ? STAGES : 1)];
    pdl_enter();
    sdm_fgather_block<Tb, STAGES>(a, v, bank, c, blockIdx, sdm_fgather_work,
                                  (uint32_t)__cvta_generic_to_shared(bars));
}

// Block (column block, s) of the grid (d/DB, S), SDM_ROW_THREADS threads, `tiles` of sdm_op_tile_smem bytes of shared
// memory: X and Delta tiles [C][DB], S and Linv when staged (NB: sdm_solve_mats).
template <int NB>
__device__ __forceinline__ void sdm_fsolve_block(const SdmOpArgs &a, float *out, int c, bool staged, dim3 blk,
                                                 float *tiles) {
    const int C = a.C, DB = a.DB, nvec = DB / 4, s = blk.y, col0 = blk.x * DB, items = C * nvec;
    float *Xs = tiles, *Ds = Xs + C * DB;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, crow0 = (size_t)s * C * a.d;
    const float *Sc, *Li;
    const int ld = sdm_solve_mats<NB>(a, cc, staged, Ds + C * DB, &Sc, &Li);
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4;
        *(float4 *)(Xs + t * DB + lc) = *(const float4 *)(a.cx + crow0 + (size_t)t * a.d + col0 + lc);
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int u = 0; u <= t; u++) acc = sdm_axpy4(Li[t * ld + u], *(const float4 *)(Xs + u * DB + lc), acc);
        *(float4 *)(Ds + t * DB + lc) = acc;
        *(float4 *)(sdm_delta_row(a, s, c, t) + col0 + lc) = acc;
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        if (tp >= a.T) continue;
        float4 acc = *(const float4 *)(a.ce + crow0 + (size_t)t * a.d + col0 + lc);
        for (int u = 0; u <= t; u++) {
            float sv = Sc[t * ld + u];
            if (sv != 0.f) acc = sdm_axpy4(sv, *(const float4 *)(Ds + u * DB + lc), acc);
        }
        *(float4 *)(out + sdm_tok_off(a, s, tp, a.d) + col0 + lc) = acc;
    }
}

__global__ void __launch_bounds__(SDM_ROW_THREADS) sdm_fsolve_kernel(SdmOpArgs a, float *out, int c, bool staged) {
    extern __shared__ float sdm_smem_tiles[];
    pdl_enter();
    sdm_fsolve_block<4>(a, out, c, staged, blockIdx, sdm_smem_tiles);
}

// Column groups of 32 V a scatter warp holds at once (the whole 1024-wide bf16 row): their row loads, then each
// chained entry's delta loads, are all in flight together rather than one group's dependent loads after another's.
#define SDM_FSCATTER_GROUPS 4

// 1: when training with unquantised snapshots, the scatter reads a slot's row at the chunk's start from the entry's
// snapshot (the same bits, fgather wrote it this round) instead of the bank: consecutive warps then read consecutive
// rows, just written, where the bank's rows are random. Off until a GPU times it (BENCHMARKS.md, 36th session).
#ifndef SDM_FSCATTER_FROM_SNAP
#define SDM_FSCATTER_FROM_SNAP 0
#endif

// Block (x, s) of the grid (ceil(C W / warps), S), SDM_ROW_THREADS threads, no shared memory: warp e of the chunk's
// write entries; when e is the last entry of its slot: M[i] = e^Lambda M0[i] + sum over the slot's entries (walking
// back) pi kappa delta_t.
template <typename Tb>
__device__ __forceinline__ void sdm_fscatter_block(const SdmOpArgs &a, Tb *bank, int c, dim3 blk) {
    constexpr int V = SdmBankVec<Tb>::V, G = SDM_FSCATTER_GROUPS;
    const int s = blk.y, e = blk.x * SDM_ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (e >= a.C * a.W) return;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * a.C) * a.W;
    // the entry's three words together: one memory latency before the tests, not one after each
    const int slot = a.w_slot[ew + e], next = a.w_next[ew + e];
    const float el = a.w_elam_tot[ew + e];
    if (slot < 0 || next >= 0) return;
    Tb *row = bank + ((size_t)s * a.N + slot) * a.d;
    // the row before the chunk: no entry of the chunk but this one writes the slot, so the bank still holds it
    const Tb *row0 = SDM_FSCATTER_FROM_SNAP && a.training && a.snap.mode == SDM_SNAP_NONE
                         ? (const Tb *)(a.snap.data + (ew + e) * a.snap.row_bytes)
                         : row;
    for (int col0 = lane * V; col0 < a.d; col0 += 32 * V * G) {
        float x[G][V];
#pragma unroll
        for (int u = 0; u < G; u++) {
            int col = col0 + u * 32 * V;
            if (col >= a.d) continue;
            SdmBankVec<Tb>::load(row0 + col, x[u]);
            for (int i = 0; i < V; i++) x[u][i] *= el;
        }
        for (int q = e; q >= 0; q = a.w_prev[ew + q]) {
            float w = a.w_scat[ew + q];
            const float *dr = sdm_delta_row(a, s, c, q / a.W) + col0;
#pragma unroll
            for (int u = 0; u < G; u++) {
                if (col0 + u * 32 * V >= a.d) continue;
                for (int i = 0; i < V; i += 4) {
                    float4 dv = *(const float4 *)(dr + u * 32 * V + i);
                    x[u][i] = fmaf(w, dv.x, x[u][i]); x[u][i + 1] = fmaf(w, dv.y, x[u][i + 1]);
                    x[u][i + 2] = fmaf(w, dv.z, x[u][i + 2]); x[u][i + 3] = fmaf(w, dv.w, x[u][i + 3]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < G; u++)
            if (col0 + u * 32 * V < a.d) SdmBankVec<Tb>::store(row + col0 + u * 32 * V, x[u]);
    }
}

template <typename Tb>
__global__ void __launch_bounds__(SDM_ROW_THREADS) sdm_fscatter_kernel(SdmOpArgs a, Tb *bank, int c) {
    pdl_enter();
    sdm_fscatter_block<Tb>(a, bank, c, blockIdx);
}

// The blocks of each phase of a chunk round, numbered x fastest.
struct SdmFwdGrids {
    dim3 gather, solve, scatter;
};

static inline SdmFwdGrids sdm_fwd_grids(const SdmOpArgs &a) {
    SdmFwdGrids g = {dim3(a.C, a.S, 2), dim3(a.d / a.DB, a.S), sdm_op_entry_grid(a, a.C * a.W)};
    return g;
}

static inline int sdm_grid_blocks(dim3 g) { return (int)(g.x * g.y * g.z); }

// Chunk c's gather on `grid` (sdm_fwd_grids): the rows by bulk copies when asked and sdm_gather_bulk_fits, else in
// registers.
template <typename Tb>
static void sdm_op_launch_fgather(const SdmOpArgs &a, dim3 grid, const float *v, const Tb *bank, int c, bool bulk,
                                  cudaStream_t stream) {
    bulk = bulk && sdm_gather_bulk_fits<Tb>(a.d);
    auto gather = bulk ? sdm_fgather_kernel<Tb, SDM_GATHER_BULK_STAGES> : sdm_fgather_kernel<Tb, 0>;
    size_t smem = bulk ? sdm_gather_work_bytes<Tb, SDM_GATHER_BULK_STAGES>(a.d) : sdm_gather_work_bytes<Tb, 0>(a.d);
    cudaCheck(cudaFuncSetAttribute(gather, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    launch_pdl(gather, grid, SDM_ROW_THREADS, smem, stream, a, v, bank, c);
}

// One chunk of the forward for every stream: gather, solve, scatter; with programmatic dependent launch
// (core/cuda_common.cuh) on a stream of its own, such as a prefill's, each launch overlaps the tail of the one before.
template <typename Tb>
static void sdm_op_forward_chunk(const SdmOpArgs &a, const SdmFwdGrids &g, const float *v, void *bank, float *out,
                                 int c, bool bulk, cudaStream_t stream) {
    size_t ts = sdm_op_tile_smem(a);
    cudaCheck(cudaFuncSetAttribute(sdm_fsolve_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ts));
    sdm_op_launch_fgather<Tb>(a, g.gather, v, (const Tb *)bank, c, bulk, stream);
    launch_pdl(sdm_fsolve_kernel, g.solve, SDM_ROW_THREADS, ts, stream, a, out, c, sdm_op_solve_staged(a));
    launch_pdl(sdm_fscatter_kernel<Tb>, g.scatter, SDM_ROW_THREADS, 0, stream, a, (Tb *)bank, c);
}

// ------------------------------------------------------------------------------------------------------------------
// The persistent forward: the whole chunk loop in one cooperative launch (docs/SDM.md#phases-on-the-gpu).

// body(b) for this block's share of the virtual blocks b of grid g: numbers blockIdx.x, blockIdx.x + gridDim.x, ...
// (x fastest, as a launch numbers its blocks). reuse_smem: a barrier after each, as the next one overwrites the
// shared memory this one may still read.
template <typename F> __device__ __forceinline__ void sdm_virtual_blocks(dim3 g, bool reuse_smem, F body) {
    const unsigned n = g.x * g.y * g.z;
    for (unsigned vb = blockIdx.x; vb < n; vb += gridDim.x) {
        body(dim3(vb % g.x, vb / g.x % g.y, vb / (g.x * g.y)));
        if (reuse_smem) __syncthreads();
    }
}

// Co-resident blocks of SDM_ROW_THREADS threads, dynamic smem sdm_fwd_persistent_smem: per chunk the three phases'
// block bodies over their virtual blocks, a grid-wide barrier after each (it also makes the phase's writes visible):
// the solves read all of the chunk's X and E rows, the scatters whole Delta rows, the next chunk's gathers the rows
// scattered, and their X and E overwrite those the solves read. Each output element is computed by the code and in
// the order of the three kernels: the same bits. At most 128 registers, for two blocks an SM (the gather body alone
// takes ~120); the solves stage S and Linv two vectors at a time, as four spilled (prefill 3.31 -> 3.21 ms a layer
// with two, 3.39 with four).
template <typename Tb>
__global__ void __launch_bounds__(SDM_ROW_THREADS, 2)
    sdm_fwd_persistent_kernel(SdmOpArgs a, const float *v, Tb *bank, float *out, SdmFwdGrids g, bool staged) {
    extern __shared__ float sdm_persist_smem[];
    cooperative_groups::grid_group grid = cooperative_groups::this_grid();
    for (int c = 0; c < a.nc; c++) {
        sdm_virtual_blocks(g.gather, true,
                           [&](dim3 b) { sdm_fgather_block<Tb, 0>(a, v, bank, c, b, sdm_persist_smem, 0); });
        grid.sync();
        sdm_virtual_blocks(g.solve, true, [&](dim3 b) { sdm_fsolve_block<2>(a, out, c, staged, b, sdm_persist_smem); });
        grid.sync();
        sdm_virtual_blocks(g.scatter, false, [&](dim3 b) { sdm_fscatter_block<Tb>(a, bank, c, b); });
        if (c + 1 < a.nc) grid.sync();
    }
}

static inline size_t sdm_fwd_persistent_smem(const SdmOpArgs &a) {
    size_t gather = sdm_gather_work_bytes<float, 0>(a.d); // the gather body here keeps its rows in registers
    return SDM_MAX(gather, sdm_op_tile_smem(a));
}

// Blocks of the persistent forward that fit on this GPU at once (its occupancy x SMs); 0 without cooperative launch.
template <typename Tb> static int sdm_fwd_coresident(size_t smem) {
    int dev, coop, per_sm = 0;
    cudaCheck(cudaGetDevice(&dev));
    cudaCheck(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
    cudaCheck(cudaFuncSetAttribute(sdm_fwd_persistent_kernel<Tb>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)smem));
    cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sdm_fwd_persistent_kernel<Tb>, SDM_ROW_THREADS,
                                                            smem));
    return coop ? per_sm * core_sm_count() : 0;
}

// Blocks of the persistent forward for this call (at most those co-resident and those of the largest phase; at most
// s->fwd_max_blocks when set), 0 for three launches per chunk. The op's choice is a speed choice (both give the same
// bits): persistent for a prefill (training = 0) whose gather round of C S 2 blocks fits in one co-resident grid, i.e.
// S C up to about the GPU's SMs at two blocks an SM. Such a round moves few bytes (flagship prefill, S = 2, C = 64:
// ~16 us at full bandwidth) and, as three launches, took 44.2 us on an H200, persistent 41.5 us (3.49 -> 3.32 ms a
// layer, tests/bench_sdm_op.cu prefill). Larger rounds, as training's B H streams, fill the GPU with every launch,
// and there a persistent block would walk several virtual blocks a phase in turn (at B = 8: no faster, slower with
// hot slots).
template <typename Tb> static int sdm_fwd_persistent_blocks(const SdmOpShape *s, const SdmOpArgs &a) {
    if (s->fwd_path == SDM_FWD_LAUNCHES || s->fwd_path == SDM_FWD_LAUNCHES_BULK ||
        (s->fwd_path == SDM_FWD_AUTO && s->training))
        return 0;
    SdmFwdGrids g = sdm_fwd_grids(a);
    int fit = sdm_fwd_coresident<Tb>(sdm_fwd_persistent_smem(a));
    if (s->fwd_path == SDM_FWD_AUTO && sdm_grid_blocks(g.gather) > fit) return 0;
    if (fit == 0) sdm_die("sdm_op: the persistent forward cannot run on this GPU (no cooperative launch or no room)");
    int need = SDM_MAX(sdm_grid_blocks(g.gather), SDM_MAX(sdm_grid_blocks(g.solve), sdm_grid_blocks(g.scatter)));
    int blocks = SDM_MIN(fit, need);
    return s->fwd_max_blocks > 0 ? SDM_MIN(blocks, s->fwd_max_blocks) : blocks;
}

// The chunk loop, persistent or three launches per chunk (sdm_fwd_persistent_blocks). The persistent kernel is
// launched without programmatic dependent launch: it starts once phase 1 has completed.
template <typename Tb>
static void sdm_op_forward_chunks(const SdmOpShape *s, const SdmOpArgs &a, const float *v, void *bank, float *out,
                                  cudaStream_t stream) {
    SdmFwdGrids g = sdm_fwd_grids(a);
    int blocks = sdm_fwd_persistent_blocks<Tb>(s, a);
    if (!blocks) {
        bool bulk = s->fwd_path == SDM_FWD_LAUNCHES_BULK || (s->fwd_path == SDM_FWD_AUTO && SDM_GATHER_BULK);
        for (int c = 0; c < a.nc; c++) sdm_op_forward_chunk<Tb>(a, g, v, bank, out, c, bulk, stream);
        return;
    }
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(SDM_ROW_THREADS);
    cfg.dynamicSmemBytes = sdm_fwd_persistent_smem(a);
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    cudaCheck(cudaLaunchKernelEx(&cfg, sdm_fwd_persistent_kernel<Tb>, a, v, (Tb *)bank, out, g,
                                 sdm_op_solve_staged(a)));
}

// sdm_op_forward in its two parts, so that a step profile can time them apart: phase 1 (no bank access), then the
// chunk loop over the bank.
static void sdm_op_forward_wy(const SdmOpShape *s, const SdmOpInputs *in, void *saved, cudaStream_t stream) {
    sdm_op_require(s);
    sdm_op_phase1(sdm_op_args(s, saved, NULL), in, stream);
}

static void sdm_op_forward_rounds(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out, void *saved,
                                  cudaStream_t stream) {
    SdmOpArgs a = sdm_op_args(s, saved, NULL);
    if (s->bank_fp32) sdm_op_forward_chunks<float>(s, a, in->v, bank, out, stream);
    else sdm_op_forward_chunks<__nv_bfloat16>(s, a, in->v, bank, out, stream);
}

static void sdm_op_forward(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out, void *saved,
                           cudaStream_t stream) {
    sdm_op_forward_wy(s, in, saved, stream);
    sdm_op_forward_rounds(s, in, bank, out, saved, stream);
}

#endif
