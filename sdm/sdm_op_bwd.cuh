// sdm/sdm_op_bwd.cuh: the chunked backward of the SDM op (docs/SDM.md#backward): sdm_op_backward runs over the chunks
// in reverse, three launches per chunk for all streams: token_kernel (the write-path gradient of delta and omega from
// the bank gradient G before the chunk's update), bsolve (dDelta, dX, dR0, dv) and bscatter (G at the touched rows
// and the dots against the chunk-start rows: psi, phi, eta), then one
// bwy_kernel over all chunks (the C x C products, the Gram backward and the per-slot dgamma scans). G, dense
// [B,H,N,d], is accumulated in dbank_init: fp32, or bf16 with grad_bank_bf16 (Tg below; a row is loaded into fp32,
// every sum of a chunk is fp32, and the row is rounded to bf16 once when the chunk stores it).
// In: what sdm/sdm_op_fwd.cuh saved with training = 1, dout [B,T,H,d], dbank_final [B,H,N,d] fp32 or NULL; out:
// dkappa, dgamma [B,T,H,W], dbeta [B,T,H], dv [B,T,H,d], drho [B,T,H,R], dbank_init [B,H,N,d] (fp32 or bf16). The
// bank stays final: a chunk's start row of a slot it reads but does not write is the snapshot of the slot's next write
// after the chunk (later_snap, kept as the chunks walk back), or the final row when no later chunk writes it.
//
// Bytes per chunk and stream (docs/SDM.md#bytes-of-the-backward): every G row at a write entry is read twice (token,
// then bscatter's update, which needs dR0 from the solve in between) and written once, every G row at a read-only
// slot read and written once, every snapshot row read once, every read-only row read once (a snapshot row, or
// the final bank row). A bf16 G halves the G bytes.
#ifndef SDM_SDM_OP_BWD_CUH
#define SDM_SDM_OP_BWD_CUH

#include "sdm/sdm_op_common.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Backward, in the reverse chunk loop.

// Per (stream, token) of chunk c, from G (Tg: float or bf16) before the chunk's update: the write-path gradient of
// delta, wsum_t = sum_i pi kappa G[i] (the warps' partial rows summed in warp order), and omega = <delta_t, G[i]> per
// write entry. Grid (C, S), SDM_ROW_THREADS threads, dynamic smem (1 + SDM_ROW_WARPS) d floats. (Its rows by bulk
// copies, as fgather's: faster alone at B = 8, 4.58 -> 4.27 ms, slower in the flagship step at B = 4, whose 512
// blocks at three an SM leave a second wave a third full: op backward 83.1 -> 86.3 ms on an H100.)
template <typename Tg>
__global__ void __launch_bounds__(SDM_ROW_THREADS) sdm_token_kernel(SdmOpArgs a, const Tg *G, int c) {
    extern __shared__ float sdm_tok_smem[]; // delta_t [d], then the warps' partial rows [SDM_ROW_WARPS][d]
    const int t = blockIdx.x, s = blockIdx.y, d = a.d, warp = threadIdx.x / 32;
    const size_t tok = (size_t)s * a.Tp + (size_t)c * a.C + t;
    float *drow = sdm_tok_smem, *part = drow + d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) drow[i] = a.delta[tok * d + i];
    __syncthreads();
    sdm_gather_whole_rows<Tg>(a, G + (size_t)s * a.N * d, a.w_slot, a.w_scat, tok * a.W, a.W, part + warp * d, false,
                              drow, a.omega);
    sdm_sum_partials(part, d);
    for (int i = threadIdx.x; i < d; i += blockDim.x) a.wsum[((size_t)s * a.C + t) * d + i] = part[i];
}

static inline size_t sdm_token_smem(int d) { return (size_t)(1 + SDM_ROW_WARPS) * d * sizeof(float); }

// Per (stream, DB columns) for chunk c: dDelta = S^T dO + wsum, dX = Linv^T dDelta (saved; dv = beta dX), and
// dR0 = -beta dX into the per-chunk buffer cx. Grid (d/DB, S), 256 threads, dynamic smem (sdm_op_tile_smem): dO,
// dDelta tiles [C][DB], S and Linv when staged.
__global__ void __launch_bounds__(256) sdm_bsolve_kernel(SdmOpArgs a, const float *dout, float *dv, int c,
                                                         bool staged) {
    extern __shared__ float sdm_smem_tiles[];
    const int C = a.C, DB = a.DB, nvec = DB / 4, s = blockIdx.y, col0 = blockIdx.x * DB, items = C * nvec;
    float *Os = sdm_smem_tiles, *DDs = Os + C * DB;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, tok0 = (size_t)s * a.Tp + (size_t)c * C;
    const float *Sc, *Li;
    const int ld = sdm_solve_mats<4>(a, cc, staged, DDs + C * DB, &Sc, &Li);
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        float4 o = tp < a.T ? *(const float4 *)(dout + sdm_tok_off(a, s, tp, a.d) + col0 + lc)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
        *(float4 *)(Os + t * DB + lc) = o;
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4;
        float4 acc = *(const float4 *)(a.wsum + ((size_t)s * C + t) * a.d + col0 + lc);
        for (int u = t; u < C; u++) {
            float sv = Sc[u * ld + t];
            if (sv != 0.f) acc = sdm_axpy4(sv, *(const float4 *)(Os + u * DB + lc), acc);
        }
        *(float4 *)(DDs + t * DB + lc) = acc;
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int u = t; u < C; u++) acc = sdm_axpy4(Li[u * ld + t], *(const float4 *)(DDs + u * DB + lc), acc);
        *(float4 *)(a.dx + (tok0 + t) * a.d + col0 + lc) = acc;
        float bt = a.beta[tok0 + t];
        *(float4 *)(a.cx + ((size_t)s * C + t) * a.d + col0 + lc) =
            make_float4(-bt * acc.x, -bt * acc.y, -bt * acc.z, -bt * acc.w);
        if (tp < a.T)
            *(float4 *)(dv + sdm_tok_off(a, s, tp, a.d) + col0 + lc) =
                make_float4(bt * acc.x, bt * acc.y, bt * acc.z, bt * acc.w);
    }
}

// acc[0..8) += the sum over the entries of one slot in chunk c, walking back from entry e, of 8 columns at col:
// write entries kappa e^lam dR0_t (the per-chunk buffer cx), read entries rho e^lam' dO_t (reads exist only for
// tokens inside the sequence)
__device__ __forceinline__ void sdm_write_chain_sum(const SdmOpArgs &a, int s, size_t ew, int e, int col, float *acc) {
    for (int q = e; q >= 0; q = a.w_prev[ew + q])
        sdm_axpy8(a.w_gath[ew + q], a.cx + ((size_t)s * a.C + q / a.W) * a.d + col, acc);
}
__device__ __forceinline__ void sdm_read_chain_sum(const SdmOpArgs &a, const float *dout, int s, int c, size_t er,
                                                   int e, int col, float *acc) {
    for (int q = e; q >= 0; q = a.r_prevr[er + q])
        sdm_axpy8(a.r_gath[er + q], dout + sdm_tok_off(a, s, c * a.C + q / a.R, a.d) + col, acc);
}

// Four blocks an SM for bscatter (at most 64 registers, no spills): the warps' dependent loads are the limit, so more
// warps beat more registers (bench_sdm_op: 29.2 -> 26.5 ms at the flagship shape, 18.8 -> 15.7 with hot slots, against
// the compiler's 78-92 registers at three blocks). More row bytes in flight a warp lost on both GPUs (`bench_sdm_op 3
// grad`, flagship op, uniform slots, bf16 G): two groups of 8 columns a lane loaded ahead at three blocks an SM, 22.3
// -> 23.2 ms on an H100 and 16.6 -> 18.1 on the H200; each entry's whole rows copied into shared memory by bulk
// copies, the warp's next entry's in flight (0fc6426), 16.6 -> 18.9 ms on the H200 (BENCHMARKS.md). An A/B knob:
// five blocks (48 registers, 52-64 bytes spilled) lost on uniform slots on an H100 (29.2 -> 31.4 ms) and won with
// hot slots and in the step at initialisation (op backward 84.3 -> 81.2 ms); on the H200 the step's op backward
// 78.3 -> 76.6 ms, the step as trained -1.6 ms (uniform slots not timed there).
#ifndef SDM_BSCATTER_BLOCKS
#define SDM_BSCATTER_BLOCKS 4
#endif

// 8 consecutive values of a T row as loaded (16 bytes of bf16, 32 of fp32), unpacked to fp32 at use.
template <typename T> struct SdmRaw8 {
    uint4 r[8 / SdmBankVec<T>::V];
    __device__ void load(const T *p) {
        for (int k = 0; k < 8 / SdmBankVec<T>::V; k++) r[k] = *(const uint4 *)(p + k * SdmBankVec<T>::V);
    }
    __device__ void get(float *x) const {
        for (int k = 0; k < 8 / SdmBankVec<T>::V; k++) SdmBankVec<T>::unpack(r[k], x + k * SdmBankVec<T>::V);
    }
};

// 8 values of a chunk-start row M0 (a snapshot row or a bank row). BF16 (snapshots `none` over a bf16 bank, the
// flagship's): both are bf16 rows, held raw. Otherwise any snapshot mode or bank dtype, dequantised into fp32 at the
// load (get rounds a snapshot row to bf16 for a bf16 bank when asked).
template <bool BF16> struct SdmM0Group;
template <> struct SdmM0Group<true> {
    SdmRaw8<__nv_bfloat16> v;
    __device__ void load_snap(const SdmSnapView &sv, size_t e, int col) {
        v.load((const __nv_bfloat16 *)(sv.data + e * sv.row_bytes) + col);
    }
    __device__ void load_bank(const void *row, int col, bool) { v.load((const __nv_bfloat16 *)row + col); }
    __device__ void get(float *x, bool) const { v.get(x); }
};
template <> struct SdmM0Group<false> {
    float v[8];
    __device__ void load_snap(const SdmSnapView &sv, size_t e, int col) { sdm_snap_load8(sv, e, col, v); }
    __device__ void load_bank(const void *row, int col, bool fp32) { sdm_load8_any(row, col, fp32, v); }
    __device__ void get(float *x, bool round_bf16) const {
        for (int k = 0; k < 8; k++) x[k] = round_bf16 ? __bfloat162float(__float2bfloat16_rn(v[k])) : v[k];
    }
};

// One warp per entry of chunk c, whole rows, 8 columns per lane and step; M0 is the chunk-start row:
//   write entry e (slot i):  psi = <dR0_t, M0[i]> (M0 = its snapshot row);
//     first entry of i:      later_snap[i] = e (M0[i] is the row after the chunk before this one);
//     last entry of i:       eta = e^Lambda <G[i], M0[i]> for every entry of i (G before the update), then
//                            G[i] = e^Lambda G[i] + sum_writes kappa e^lam dR0_t + sum_reads rho e^lam' dO_t
//   read entry r (slot j):   phi = <dO_t, M0[j]> (M0 = the snapshot of a write entry of j in the chunk, else of
//                            later_snap[j] (a later chunk's), rounded to the bank dtype as the bank would hold it, else
//                            the final bank row);
//     last read of a slot the chunk does not write:  G[j] += sum_reads rho e^lam' dO_t
// G rows are Tg (float or bf16): loaded into fp32, stored once per chunk (bf16: rounded to nearest even).
// Each touched G row is read and written by one warp only, later_snap[i] written by one warp and read by none (a
// read entry looks it up only for a slot the chunk does not write), so the launch has no races and a fixed order of
// sums. Grid (ceil(C (W + R) / warps), S), SDM_ROW_THREADS threads, SDM_BSCATTER_BLOCKS an SM. BF16: snapshots
// `none` over a bf16 bank (SdmM0Group).
template <typename Tg, bool BF16>
__global__ void __launch_bounds__(SDM_ROW_THREADS, SDM_BSCATTER_BLOCKS)
    sdm_bscatter_kernel(SdmOpArgs a, const void *bank, int bank_fp32, Tg *G, const float *dout, int c) {
    const int s = blockIdx.y, i = blockIdx.x * SDM_ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32, d = a.d;
    const int CW = a.C * a.W;
    if (i >= CW + a.C * a.R) return;
    const size_t tok0 = (size_t)s * a.Tp + (size_t)c * a.C, ew = tok0 * a.W, er = tok0 * a.R, row0 = (size_t)s * a.N;
    const size_t row_bytes = (size_t)d * (bank_fp32 ? 4 : 2);
    if (i < CW) {
        int slot = a.w_slot[ew + i];
        if (slot < 0) { // padding
            if (lane == 0) a.psi[ew + i] = a.eta[ew + i] = 0.f;
            return;
        }
        const bool first = a.w_prev[ew + i] < 0, last = a.w_next[ew + i] < 0;
        const float *dr0 = a.cx + ((size_t)s * a.C + i / a.W) * d;
        const float el = a.w_elam_tot[ew + i];
        const int lr = a.w_lastread[ew + i];
        Tg *grow = G + (row0 + slot) * d;
        float psi = 0.f, eta = 0.f;
        for (int col = lane * 8; col < d; col += 256) {
            SdmM0Group<BF16> m;
            SdmRaw8<Tg> g;
            m.load_snap(a.snap, ew + i, col);
            if (last) g.load(grow + col);
            float x[8], mv[8];
            sdm_load8(dr0 + col, x);
            m.get(mv, false);
            psi = sdm_dot8(x, mv, psi);
            if (!last) continue;
            float gv[8], acc[8] = {}, racc[8] = {};
            g.get(gv);
            eta = sdm_dot8(gv, mv, eta);
            sdm_write_chain_sum(a, s, ew, i, col, acc);
            if (lr >= 0) sdm_read_chain_sum(a, dout, s, c, er, lr, col, racc);
            for (int k = 0; k < 8; k++) x[k] = fmaf(el, gv[k], acc[k]) + racc[k];
            sdm_store8(grow + col, x);
        }
        psi = core_warp_sum(psi);
        eta = core_warp_sum(eta);
        if (lane == 0) {
            a.psi[ew + i] = psi;
            if (first) a.later_snap[row0 + slot] = (int)(ew + i);
            if (last)
                for (int q = i; q >= 0; q = a.w_prev[ew + q]) a.eta[ew + q] = el * eta;
        }
    } else {
        int r = i - CW, slot = a.r_slot[er + r];
        if (slot < 0) { // padding
            if (lane == 0) a.phi[er + r] = 0.f;
            return;
        }
        const int lw = a.r_nearw[er + r];                  // a write entry of the slot in this chunk, or -1
        const bool upd = lw < 0 && a.r_nextr[er + r] < 0; // the last read of a slot the chunk does not write
        const int e = lw >= 0 ? (int)(ew + lw) : a.later_snap[row0 + slot]; // M0's snapshot entry, or -1: the bank
        const float *dO = dout + sdm_tok_off(a, s, c * a.C + r / a.R, d);
        const void *brow = (const char *)bank + (row0 + slot) * row_bytes;
        Tg *grow = G + (row0 + slot) * d;
        float phi = 0.f;
        for (int col = lane * 8; col < d; col += 256) {
            SdmM0Group<BF16> m;
            SdmRaw8<Tg> g;
            if (e >= 0) m.load_snap(a.snap, e, col);
            else m.load_bank(brow, col, bank_fp32);
            if (upd) g.load(grow + col);
            float x[8], mv[8];
            sdm_load8(dO + col, x);
            m.get(mv, e >= 0 && !bank_fp32);
            phi = sdm_dot8(x, mv, phi);
            if (!upd) continue;
            float gv[8], racc[8] = {};
            g.get(gv);
            sdm_read_chain_sum(a, dout, s, c, er, r, col, racc);
            for (int k = 0; k < 8; k++) x[k] = gv[k] + racc[k];
            sdm_store8(grow + col, x);
        }
        phi = core_warp_sum(phi);
        if (lane == 0) a.phi[er + r] = phi;
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Backward, batched over all chunks: grid (nc, S), SDM_BWY_THREADS threads.

#define SDM_BWY_THREADS 512 // sdm_chunk_gram's tiling is for this many

// out[t][u] = scale * <X_t, Y_u> over d for u <= t (u < t when strict), 0 elsewhere. X, Y: [C][d] fp32 rows with row
// stride d (X rows may be token-major: xrow(t) gives the row pointer or NULL for padding). 64x64 output tiles,
// 32-column slices in shared memory (`sm`: [2][64][33] floats), each thread loading one float4 of X's and of Y's slice,
// the next slice's loads in flight while one is multiplied, 2x4 outputs per thread (SDM_BWY_THREADS = 512). Each
// output is one fma chain over the columns in order.
template <typename RowX>
__device__ void sdm_chunk_gram(int C, int d, RowX xrow, const float *Y, float scale, bool strict, float *out,
                               float *sm) {
    float *xs = sm, *ys = sm + 64 * 33;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, lr = threadIdx.x / 8, lc = threadIdx.x % 8 * 4;
    // this thread's float4 of a row's slice from column k (d is a multiple of 8: a float4 is in or out whole), and
    // its place in a staged slice
    auto load = [&](const float *row, int k) {
        return row && k < d ? *(const float4 *)(row + k) : make_float4(0.f, 0.f, 0.f, 0.f);
    };
    auto stage = [&](float *m, float4 v) {
        m[lr * 33 + lc] = v.x; m[lr * 33 + lc + 1] = v.y; m[lr * 33 + lc + 2] = v.z; m[lr * 33 + lc + 3] = v.w;
    };
    for (int t0 = 0; t0 < C; t0 += 64)
        for (int u0 = 0; u0 <= t0; u0 += 64) {
            const float *xr = t0 + lr < C ? xrow(t0 + lr) : NULL, *yr = u0 + lr < C ? Y + (size_t)(u0 + lr) * d : NULL;
            float4 xv = load(xr, lc), yv = load(yr, lc);
            float acc[2][4] = {};
            for (int k0 = 0; k0 < d; k0 += 32) {
                __syncthreads();
                stage(xs, xv);
                stage(ys, yv);
                __syncthreads();
                xv = load(xr, k0 + 32 + lc); // the next slice, in flight during this one's products
                yv = load(yr, k0 + 32 + lc);
                for (int k = 0; k < 32; k++)
                    for (int i = 0; i < 2; i++)
                        for (int j = 0; j < 4; j++)
                            acc[i][j] = fmaf(xs[(ty * 2 + i) * 33 + k], ys[(tx * 4 + j) * 33 + k], acc[i][j]);
            }
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 4; j++) {
                    int t = t0 + ty * 2 + i, u = u0 + tx * 4 + j;
                    if (t < C && u < C) out[t * C + u] = (u < t || (u == t && !strict)) ? scale * acc[i][j] : 0.f;
                }
        }
    __syncthreads();
}

// A link staged as 16 bits (entries number below 49152; 0xffff: none).
__device__ __forceinline__ int sdm_link16(unsigned short x) { return x == 0xffffu ? -1 : (int)x; }

// Grid (nc, S), SDM_BWY_THREADS threads; SMEM: the working set (sdm_bwy_layout) in dynamic shared memory, else in
// a.bwy_work. Two blocks an SM at the flagship's chunk (112 KB each, at most 64 registers): one block's products or
// row loads overlap the other's chain walks.
template <bool SMEM>
__global__ void __launch_bounds__(SDM_BWY_THREADS, 2) sdm_bwy_kernel(SdmOpArgs a, const float *dout, float *dkappa,
                                                                  float *dgamma, float *dbeta, float *drho) {
    extern __shared__ __align__(16) unsigned char sdm_bwy_smem[];
    const int c = blockIdx.x, s = blockIdx.y, C = a.C, W = a.W, R = a.R, CW = C * W, CR = C * R;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * C) * W, er = ((size_t)s * a.Tp + (size_t)c * C) * R;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, tok0 = (size_t)s * a.Tp + (size_t)c * C;
    const int nvalid = min(C, a.T - c * C), nw = nvalid * W, nr = nvalid * R;
    const SdmBwyLayout L = sdm_bwy_layout(C, W, R);
    unsigned char *work = SMEM ? sdm_bwy_smem : (unsigned char *)a.bwy_work + ((size_t)s * a.nc + c) * L.bytes;
    float *dS = (float *)(work + L.mats), *dL = dS + C * C, *bt = dL + C * C;
    unsigned short *prev = (unsigned short *)(work + L.links), *next = prev + CW, *prevr = next + CW,
                   *prevw = prevr + CR;
    float *vals = (float *)(work + L.vals), *kap = vals, *lam = kap + CW, *rho = lam + CW;
    // lambda' of read r: that of its last write (phase 1 saves r_lam as exactly this)
    auto rlam = [&](int r) { int pw = sdm_link16(prevw[r]); return pw >= 0 ? lam[pw] : 0.f; };
    const float *Dl = a.delta + tok0 * a.d, *DX = a.dx + tok0 * a.d;
    // the links and beta of the chunk (padding has none); the Gram products read neither
    for (int e = threadIdx.x; e < CW; e += blockDim.x) {
        prev[e] = (unsigned short)a.w_prev[ew + e];
        next[e] = (unsigned short)a.w_next[ew + e];
    }
    for (int r = threadIdx.x; r < CR; r += blockDim.x) {
        prevr[r] = (unsigned short)a.r_prevr[er + r];
        prevw[r] = (unsigned short)a.r_prevw[er + r];
    }
    for (int t = threadIdx.x; t < C; t += blockDim.x) bt[t] = a.beta[tok0 + t];
    // dS = dO Delta^T (u <= t), dL = -dX Delta^T (u < t); the tiles over the per-entry values, staged after them
    sdm_chunk_gram(
        C, a.d, [&](int t) { return t < nvalid ? dout + sdm_tok_off(a, s, c * C + t, a.d) : (const float *)NULL; },
        Dl, 1.f, false, dS, vals);
    sdm_chunk_gram(C, a.d, [&](int t) { return DX + (size_t)t * a.d; }, Dl, -1.f, true, dL, vals);
    for (int e = threadIdx.x; e < CW; e += blockDim.x) {
        kap[e] = a.w_kappa[ew + e];
        lam[e] = a.w_lam[ew + e];
    }
    for (int r = threadIdx.x; r < CR; r += blockDim.x) rho[r] = a.r_rho[er + r];
    // dbeta_t = <V - R0, dX>_t + sum_{u<t} A[t,u] dL[t,u], one warp per token
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int t = warp; t < nvalid; t += blockDim.x / 32) {
        float x = 0.f;
        for (int k = lane; k < a.d; k += 32) x = fmaf(a.u[(tok0 + t) * a.d + k], DX[(size_t)t * a.d + k], x);
        for (int u = lane; u < t; u += 32) x = fmaf(a.A[cc + t * C + u], dL[t * C + u], x);
        x = core_warp_sum(x);
        if (lane == 0) dbeta[sdm_tok_off(a, s, c * C + t, 1)] = x;
    }
    __syncthreads();
    // Per-entry terms, in gather form: one thread per write or read entry sums everything its entry receives, the
    // direct terms, then the Gram backward over the other entries of its slot (walking the chunk's links, in chain
    // order), so a slot hit by many tokens spreads over as many threads and every sum has one owner and a fixed order
    // (no atomics). Padding (no links, dropped gradients) is skipped.
    //   write entry q:  dkappa = pi omega + e^lam psi, dlam = kappa e^lam psi, dmu = kappa pi omega, then per A pair
    //                   with an earlier write b (q is the row), a later write b (q is the column), and per S pair
    //                   with a read at or after q
    //   read entry r:   drho = e^lam' phi, dlam' = rho e^lam' phi, then per S pair with a write at or before r
    // An S pair whose write entry is prevw[r] has lam' = lam: its two log-decay terms cancel and are skipped. dkappa
    // and drho are final; dlam, dmu, dlam' go to psi, dmu, dlamr for the dgamma sums.
    for (int e = threadIdx.x; e < nw + nr; e += blockDim.x) {
        if (e < nw) {
            const int q = e, tq = q / W;
            const float kq = kap[q], lq = lam[q], pi = a.w_pi[ew + q], el = expf(lq), om = a.omega[ew + q],
                        ps = a.psi[ew + q];
            float k = pi * om + el * ps, l = kq * el * ps;
            a.dmu[ew + q] = kq * pi * om;
            for (int b = sdm_link16(prev[q]); b >= 0; b = sdm_link16(prev[b])) { // A[tq, tb]
                float gA = bt[tq] * dL[tq * C + b / W], E = expf(lq - lam[b]);
                k += gA * kap[b] * E;
                l += gA * kq * kap[b] * E;
            }
            for (int b = sdm_link16(next[q]); b >= 0; b = sdm_link16(next[b])) { // A[tb, tq]
                int tb = b / W;
                float gA = bt[tb] * dL[tb * C + tq], E = expf(lam[b] - lq);
                k += gA * kap[b] * E;
                l -= gA * kap[b] * kq * E;
            }
            for (int r = a.w_lastread[ew + q]; r >= 0 && r / R >= tq; r = sdm_link16(prevr[r])) { // S[tr, tq]
                float gS = dS[(r / R) * C + tq], E = expf(rlam(r) - lq);
                k += gS * rho[r] * E;
                if (q != sdm_link16(prevw[r])) l -= gS * rho[r] * kq * E;
            }
            dkappa[sdm_tok_off(a, s, c * C + tq, W) + q % W] = k;
            a.psi[ew + q] = l;
        } else {
            const int r = e - nw, tr = r / R, pw = sdm_link16(prevw[r]);
            const float rr = rho[r], lr = rlam(r), el = expf(lr), ph = a.phi[er + r];
            float k = el * ph, l = rr * el * ph;
            for (int q = pw; q >= 0; q = sdm_link16(prev[q])) { // S[tr, tq]
                float gS = dS[tr * C + q / W], E = expf(lr - lam[q]);
                k += gS * kap[q] * E;
                if (q != pw) l += gS * rr * kap[q] * E;
            }
            drho[sdm_tok_off(a, s, c * C + tr, R) + r % R] = k;
            a.dlamr[er + r] = l;
        }
    }
    __syncthreads();
    // the dgamma sums walk the same chains over dlam, dmu, dlam', staged over the values
    float *dlam = vals, *dmu = dlam + CW, *dlr = dmu + CW;
    for (int q = threadIdx.x; q < nw; q += blockDim.x) {
        dlam[q] = a.psi[ew + q];
        dmu[q] = a.dmu[ew + q];
    }
    for (int r = threadIdx.x; r < nr; r += blockDim.x) dlr[r] = a.dlamr[er + r];
    __syncthreads();
    // dgamma_q = eta_q + sum_{writes b at or after q} dlam_b + sum_{writes b before q} dmu_b
    //          + sum_{reads at or after q} dlam'_r, one thread per write entry
    // (docs/SDM.md#per-entry-gradients also lists -kappa pi omega for q and dmu_q itself: they cancel exactly since
    // pi_q = e^{mu_q - gamma_q} does not depend on gamma_q, and dropping both avoids a catastrophic cancellation when
    // gamma << 0)
    for (int q = threadIdx.x; q < nw; q += blockDim.x) {
        const int tq = q / W;
        float x = a.eta[ew + q];
        for (int b = q; b >= 0; b = sdm_link16(next[b])) x += dlam[b];
        for (int b = sdm_link16(prev[q]); b >= 0; b = sdm_link16(prev[b])) x += dmu[b];
        for (int r = a.w_lastread[ew + q]; r >= 0 && r / R >= tq; r = sdm_link16(prevr[r])) x += dlr[r];
        dgamma[sdm_tok_off(a, s, c * C + tq, W) + q % W] = x;
    }
}

// The backward's launches (separate so the benchmark can time them one by one). Plain launches: with programmatic
// dependent launch, as the forward's chunk loop has, the flagship step's op backward took 91.8 ms against 84.2 on
// an H100 (BENCHMARKS.md, thirty-fifth session).
template <typename Tg>
static inline void sdm_op_launch_token(const SdmOpArgs &a, const Tg *G, int c, cudaStream_t stream) {
    size_t smem = sdm_token_smem(a.d);
    cudaCheck(cudaFuncSetAttribute(sdm_token_kernel<Tg>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    sdm_token_kernel<Tg><<<dim3(a.C, a.S), SDM_ROW_THREADS, smem, stream>>>(a, G, c);
    cudaCheckLast();
}
static inline void sdm_op_launch_bsolve(const SdmOpArgs &a, const float *dout, float *dv, int c, cudaStream_t stream) {
    size_t smem = sdm_op_tile_smem(a);
    cudaCheck(cudaFuncSetAttribute(sdm_bsolve_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    sdm_bsolve_kernel<<<dim3(a.d / a.DB, a.S), 256, smem, stream>>>(a, dout, dv, c, sdm_op_solve_staged(a));
    cudaCheckLast();
}
template <typename Tg>
static inline void sdm_op_launch_bscatter(const SdmOpArgs &a, const void *bank, int bank_fp32, Tg *G, const float *dout,
                                          int c, cudaStream_t stream) {
    const dim3 grid = sdm_op_entry_grid(a, a.C * (a.W + a.R));
    if (a.snap.mode == SDM_SNAP_NONE && !bank_fp32)
        sdm_bscatter_kernel<Tg, true><<<grid, SDM_ROW_THREADS, 0, stream>>>(a, bank, bank_fp32, G, dout, c);
    else sdm_bscatter_kernel<Tg, false><<<grid, SDM_ROW_THREADS, 0, stream>>>(a, bank, bank_fp32, G, dout, c);
    cudaCheckLast();
}
static inline void sdm_op_launch_bwy(const SdmOpArgs &a, const float *dout, const SdmOpGrads *g, cudaStream_t stream) {
    const dim3 grid(a.nc, a.S);
    if (a.bwy_work) {
        sdm_bwy_kernel<false><<<grid, SDM_BWY_THREADS, 0, stream>>>(a, dout, g->dkappa, g->dgamma, g->dbeta, g->drho);
    } else {
        size_t smem = sdm_bwy_layout(a.C, a.W, a.R).bytes;
        cudaCheck(cudaFuncSetAttribute(sdm_bwy_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        sdm_bwy_kernel<true><<<grid, SDM_BWY_THREADS, smem, stream>>>(a, dout, g->dkappa, g->dgamma, g->dbeta,
                                                                       g->drho);
    }
    cudaCheckLast();
}

// dst [n] bf16 = src [n] fp32 rounded to nearest even (n a multiple of 8, both 16-byte aligned)
__global__ void sdm_op_round_bf16_kernel(__nv_bfloat16 *dst, const float *src, size_t n8) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float x[8];
        sdm_load8(src + 8 * i, x);
        sdm_store8(dst + 8 * i, x);
    }
}

// The reverse chunk loop over the bank gradient G [S][N][d] in Tg (dbank_init itself): G starts as dbank_final
// (fp32; rounded when Tg is bf16) or zero.
template <typename Tg>
static void sdm_op_backward_chunks(const SdmOpArgs &a, int bank_fp32, const void *bank, const float *dout,
                                   const float *dbank_final, float *dv, Tg *G, cudaStream_t stream) {
    size_t n = (size_t)a.S * a.N * a.d;
    if (!dbank_final) cudaCheck(cudaMemsetAsync(G, 0, n * sizeof(Tg), stream));
    else if (sizeof(Tg) == 4) {
        if ((const void *)dbank_final != (const void *)G)
            cudaCheck(cudaMemcpyAsync(G, dbank_final, n * 4, cudaMemcpyDeviceToDevice, stream));
    } else {
        if ((const void *)dbank_final == (const void *)G)
            sdm_die("sdm_op_backward: a bf16 bank gradient cannot share dbank_final's fp32 buffer");
        sdm_op_round_bf16_kernel<<<2112, 256, 0, stream>>>((__nv_bfloat16 *)G, dbank_final, n / 8);
        cudaCheckLast();
    }
    if ((size_t)a.S * a.Tp * a.W > INT_MAX)
        sdm_die("sdm_op_backward: %d x %d x %d write entries exceed an int", a.S, a.Tp, a.W);
    cudaCheck(cudaMemsetAsync(a.later_snap, 0xff, (size_t)a.S * a.N * sizeof(int), stream)); // -1: the final row
    for (int c = a.nc - 1; c >= 0; c--) {
        sdm_op_launch_token(a, (const Tg *)G, c, stream);
        sdm_op_launch_bsolve(a, dout, dv, c, stream);
        sdm_op_launch_bscatter(a, bank, bank_fp32, G, dout, c, stream);
    }
}

// sdm_op_backward in its two parts, so that a step profile can time them apart: the reverse chunk loop over the bank
// gradient, then the per-chunk WY backward (no bank access).
static void sdm_op_backward_rounds(const SdmOpShape *s, const void *bank, const float *dout, const float *dbank_final,
                                   const SdmOpGrads *g, void *saved, void *scratch, cudaStream_t stream) {
    sdm_op_require(s);
    if (!s->training) sdm_die("sdm_op_backward: the forward must run with training = 1");
    SdmOpArgs a = sdm_op_args(s, saved, scratch);
    if (s->grad_bank_bf16)
        sdm_op_backward_chunks(a, s->bank_fp32, bank, dout, dbank_final, g->dv, (__nv_bfloat16 *)g->dbank_init, stream);
    else sdm_op_backward_chunks(a, s->bank_fp32, bank, dout, dbank_final, g->dv, (float *)g->dbank_init, stream);
}

static void sdm_op_backward_wy(const SdmOpShape *s, const float *dout, const SdmOpGrads *g, void *saved,
                               void *scratch, cudaStream_t stream) {
    sdm_op_launch_bwy(sdm_op_args(s, saved, scratch), dout, g, stream);
}

static void sdm_op_backward(const SdmOpShape *s, const SdmOpInputs *in, const void *bank, const float *dout,
                            const float *dbank_final, const SdmOpGrads *g, void *saved, void *scratch,
                            cudaStream_t stream) {
    (void)in; // everything the backward needs from the inputs was saved by the forward (V - R0, weights, links)
    sdm_op_backward_rounds(s, bank, dout, dbank_final, g, saved, scratch, stream);
    sdm_op_backward_wy(s, dout, g, saved, scratch, stream);
}

#endif
