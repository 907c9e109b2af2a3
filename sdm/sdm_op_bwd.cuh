// sdm/sdm_op_bwd.cuh: the chunked backward of the SDM op (docs/SDM.md#backward): sdm_op_backward runs over the chunks
// in reverse, three launches per chunk for all streams: token_kernel (the write-path gradient of delta and the
// per-entry dot products against the bank gradient G and the restored bank), bsolve (dDelta, dX, dR0, dv) and
// bscatter (the dense fp32 bank gradient G at the touched rows; bank rows restored from the snapshots), then one
// bwy_kernel over all chunks (the C x C products, the Gram backward and the per-slot dgamma scans). In: what
// sdm/sdm_op_fwd.cuh saved with training = 1, dout [B,T,H,d], dbank_final [B,H,N,d] or NULL; out: dkappa, dgamma
// [B,T,H,W], dbeta [B,T,H], dv [B,T,H,d], drho [B,T,H,R], dbank_init [B,H,N,d] fp32, and the initial bank restored.
#ifndef SDM_SDM_OP_BWD_CUH
#define SDM_SDM_OP_BWD_CUH

#include "sdm/sdm_op_common.cuh"

// ------------------------------------------------------------------------------------------------------------------
// Backward, in the reverse chunk loop.

#define SDM_TOK_THREADS 256

// Per (stream, token) of chunk cg: the write-path gradient of delta, wsum_t = sum_i pi kappa G[i], and the dots
// omega = <delta_t, G[i]>, eta = e^Lambda <G[i], M0[i]> (G before this chunk's update). Per token of chunk cd
// (whose bank rows are restored): phi = <dO_t, M0[j]>, psi = -beta_t <dX_t, M0[i]>. cg or cd may be -1.
// One warp per entry (entries k = warp, warp + 8, ...), whole rows; each warp keeps its partial wsum in smem and
// the partials are summed in warp order. Grid (C, S), SDM_TOK_THREADS threads, dynamic smem (2 + warps) d floats.
__global__ void __launch_bounds__(SDM_TOK_THREADS) sdm_token_kernel(SdmOpArgs a, const void *bank, int bank_fp32,
                                                                    const float *G, const float *dout, int cg, int cd) {
    extern __shared__ float sdm_tok_smem[];
    const int t = blockIdx.x, s = blockIdx.y, W = a.W, R = a.R, d = a.d, warps = SDM_TOK_THREADS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float *rowA = sdm_tok_smem, *rowB = rowA + d, *wpart = rowB + d; // wpart: [warps][d]
    const size_t rowN = (size_t)s * a.N;
    if (cg >= 0) {
        size_t tok = (size_t)s * a.Tp + (size_t)cg * a.C + t, ew = tok * W;
        for (int i = threadIdx.x; i < d; i += blockDim.x) rowA[i] = a.delta[tok * d + i];
        for (int i = threadIdx.x; i < warps * d; i += blockDim.x) wpart[i] = 0.f;
        __syncthreads();
        float *wp = wpart + warp * d;
        for (int k = warp; k < W; k += warps) {
            int slot = a.w_slot[ew + k];
            if (slot < 0) {
                if (lane == 0) a.omega[ew + k] = a.eta[ew + k] = 0.f;
                continue;
            }
            float w = a.w_scat[ew + k], p0 = 0.f, p1 = 0.f;
            const float *gr = G + (rowN + slot) * d;
            for (int col = lane * 4; col < d; col += 128) {
                float4 g = *(const float4 *)(gr + col), m = sdm_snap_load4(a.snap, ew + k, col);
                float4 dl = *(const float4 *)(rowA + col);
                *(float4 *)(wp + col) = sdm_axpy4(w, g, *(const float4 *)(wp + col));
                p0 += sdm_dot4(dl, g);
                p1 += sdm_dot4(g, m);
            }
            p0 = core_warp_sum(p0);
            p1 = core_warp_sum(p1);
            if (lane == 0) { a.omega[ew + k] = p0; a.eta[ew + k] = a.w_elam_tot[ew + k] * p1; }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float x = 0.f;
            for (int w = 0; w < warps; w++) x += wpart[w * d + i];
            a.wsum[((size_t)s * a.C + t) * d + i] = x;
        }
        __syncthreads();
    }
    if (cd >= 0) {
        int tp = cd * a.C + t;
        size_t tok = (size_t)s * a.Tp + tp, ew = tok * W, er = tok * R;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            rowA[i] = a.dx[tok * d + i];
            rowB[i] = tp < a.T ? dout[sdm_tok_off(a, s, tp, d) + i] : 0.f;
        }
        __syncthreads();
        float bt = a.beta[tok];
        for (int k = warp; k < (W > R ? W : R); k += warps) {
            int ws = k < W ? a.w_slot[ew + k] : -1, rs = k < R ? a.r_slot[er + k] : -1;
            float p0 = 0.f, p1 = 0.f;
            const void *brow = rs >= 0 ? (const char *)bank + (rowN + rs) * d * (bank_fp32 ? 4 : 2) : NULL;
            for (int col = lane * 4; col < d; col += 128) {
                if (ws >= 0) p0 += sdm_dot4(*(const float4 *)(rowA + col), sdm_snap_load4(a.snap, ew + k, col));
                if (rs >= 0) p1 += sdm_dot4(*(const float4 *)(rowB + col), sdm_load4_any(brow, col, bank_fp32));
            }
            p0 = core_warp_sum(p0);
            p1 = core_warp_sum(p1);
            if (lane == 0) {
                if (k < W) a.psi[ew + k] = -bt * p0;
                if (k < R) a.phi[er + k] = p1;
            }
        }
    }
}

static inline size_t sdm_token_smem(int d) { return (size_t)(2 + SDM_TOK_THREADS / 32) * d * sizeof(float); }

// Per (stream, DB columns) for chunk c: dDelta = S^T dO + wsum, dX = Linv^T dDelta (saved; dv = beta dX), and
// dR0 = -beta dX into the per-chunk buffer cx. Grid (d/DB, S), 256 threads, dynamic smem: dO, dDelta tiles [C][DB].
__global__ void __launch_bounds__(256) sdm_bsolve_kernel(SdmOpArgs a, const float *dout, float *dv, int c) {
    extern __shared__ float sdm_smem_tiles[];
    const int C = a.C, DB = a.DB, nvec = DB / 4, s = blockIdx.y, col0 = blockIdx.x * DB, items = C * nvec;
    float *Os = sdm_smem_tiles, *DDs = Os + C * DB;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, tok0 = (size_t)s * a.Tp + (size_t)c * C;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        float4 o = tp < a.T ? *(const float4 *)(dout + sdm_tok_off(a, s, tp, a.d) + col0 + lc)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
        *(float4 *)(Os + t * DB + lc) = o;
    }
    __syncthreads();
    const float *Sc = a.Sm + cc, *Li = a.Linv + cc;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4;
        float4 acc = *(const float4 *)(a.wsum + ((size_t)s * C + t) * a.d + col0 + lc);
        for (int u = t; u < C; u++) {
            float sv = Sc[u * C + t];
            if (sv != 0.f) acc = sdm_axpy4(sv, *(const float4 *)(Os + u * DB + lc), acc);
        }
        *(float4 *)(DDs + t * DB + lc) = acc;
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int u = t; u < C; u++) acc = sdm_axpy4(Li[u * C + t], *(const float4 *)(DDs + u * DB + lc), acc);
        *(float4 *)(a.dx + (tok0 + t) * a.d + col0 + lc) = acc;
        float bt = a.beta[tok0 + t];
        *(float4 *)(a.cx + ((size_t)s * C + t) * a.d + col0 + lc) =
            make_float4(-bt * acc.x, -bt * acc.y, -bt * acc.z, -bt * acc.w);
        if (tp < a.T)
            *(float4 *)(dv + sdm_tok_off(a, s, tp, a.d) + col0 + lc) =
                make_float4(bt * acc.x, bt * acc.y, bt * acc.z, bt * acc.w);
    }
}

// acc += sum over the read entries of one slot (walking back from r) of rho e^lam' dO_t, 4 columns at col
__device__ __forceinline__ float4 sdm_read_chain_sum(const SdmOpArgs &a, const float *dout, int s, int c, size_t er,
                                                     int r, int col, float4 acc) {
    for (int q = r; q >= 0; q = a.r_prevr[er + q]) // read entries exist only for tokens inside the sequence
        acc =
            sdm_axpy4(a.r_gath[er + q], *(const float4 *)(dout + sdm_tok_off(a, s, c * a.C + q / a.R, a.d) + col), acc);
    return acc;
}

// The bank gradient at the chunk's touched rows and the bank restore, one warp per entry, whole rows:
//   write entry e, last of its slot:  G[i] = e^Lambda G[i] + sum_writes kappa e^lam dR0_t + sum_reads rho e^lam' dO_t
//   read entry r, last read of a slot the chunk does not write:  G[j] += sum_reads rho e^lam' dO_t
//   write entry e, first of its slot: M[i] = snapshot (the chunk-start row)
// Grid (ceil(C (W + R) / warps), S), SDM_ROW_THREADS threads.
__global__ void __launch_bounds__(SDM_ROW_THREADS) sdm_bscatter_kernel(SdmOpArgs a, void *bank, int bank_fp32, float *G,
                                                                       const float *dout, int c) {
    const int s = blockIdx.y, i = blockIdx.x * SDM_ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    const int CW = a.C * a.W;
    if (i >= CW + a.C * a.R) return;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * a.C) * a.W, er = ((size_t)s * a.Tp + (size_t)c * a.C) * a.R;
    const size_t rowN = (size_t)s * a.N;
    if (i < CW) {
        int slot = a.w_slot[ew + i];
        if (slot < 0) return;
        if (a.w_prev[ew + i] < 0) { // restore
            void *row = (char *)bank + (rowN + slot) * a.d * (bank_fp32 ? 4 : 2);
            for (int col = lane * 4; col < a.d; col += 128)
                sdm_store4_any(row, col, sdm_snap_load4(a.snap, ew + i, col), bank_fp32);
        }
        if (a.w_next[ew + i] >= 0) return;
        float *g = G + (rowN + slot) * a.d;
        float el = a.w_elam_tot[ew + i];
        int lr = a.w_lastread[ew + i];
        for (int col = lane * 4; col < a.d; col += 128) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f), racc = acc;
            for (int q = i; q >= 0; q = a.w_prev[ew + q])
                acc =
                    sdm_axpy4(a.w_gath[ew + q], *(const float4 *)(a.cx + ((size_t)s * a.C + q / a.W) * a.d + col), acc);
            if (lr >= 0) racc = sdm_read_chain_sum(a, dout, s, c, er, lr, col, racc);
            float4 x = sdm_axpy4(el, *(const float4 *)(g + col), acc);
            *(float4 *)(g + col) = make_float4(x.x + racc.x, x.y + racc.y, x.z + racc.z, x.w + racc.w);
        }
    } else {
        int r = i - CW, slot = a.r_slot[er + r];
        if (slot < 0 || a.r_nextr[er + r] >= 0 || a.r_lastw[er + r] >= 0) return;
        float *g = G + (rowN + slot) * a.d;
        for (int col = lane * 4; col < a.d; col += 128) {
            float4 racc = sdm_read_chain_sum(a, dout, s, c, er, r, col, make_float4(0.f, 0.f, 0.f, 0.f));
            float4 x = *(const float4 *)(g + col);
            *(float4 *)(g + col) = make_float4(x.x + racc.x, x.y + racc.y, x.z + racc.z, x.w + racc.w);
        }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Backward, batched over all chunks: grid (nc, S), 256 threads.

// out[t][u] = scale * <X_t, Y_u> over d for u <= t (u < t when strict), 0 elsewhere. X, Y: [C][d] fp32 rows with row
// stride d (X rows may be token-major: xrow(t) gives the row pointer or NULL for padding). 64x64 output tiles,
// 32-column smem slices, 4x4 outputs per thread.
template <typename RowX>
__device__ void sdm_chunk_gram(int C, int d, RowX xrow, const float *Y, float scale, bool strict, float *out,
                               float *sm) {
    float *xs = sm, *ys = sm + 64 * 33;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int t0 = 0; t0 < C; t0 += 64)
        for (int u0 = 0; u0 <= t0; u0 += 64) {
            float acc[4][4] = {};
            for (int k0 = 0; k0 < d; k0 += 32) {
                __syncthreads();
                for (int i = threadIdx.x; i < 64 * 32; i += blockDim.x) {
                    int r = i / 32, k = i % 32;
                    const float *xr = t0 + r < C ? xrow(t0 + r) : NULL;
                    xs[r * 33 + k] = xr && k0 + k < d ? xr[k0 + k] : 0.f;
                    ys[r * 33 + k] = u0 + r < C && k0 + k < d ? Y[(size_t)(u0 + r) * d + k0 + k] : 0.f;
                }
                __syncthreads();
                for (int k = 0; k < 32; k++)
                    for (int i = 0; i < 4; i++)
                        for (int j = 0; j < 4; j++)
                            acc[i][j] = fmaf(xs[(ty * 4 + i) * 33 + k], ys[(tx * 4 + j) * 33 + k], acc[i][j]);
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    int t = t0 + ty * 4 + i, u = u0 + tx * 4 + j;
                    if (t < C && u < C) out[t * C + u] = (u < t || (u == t && !strict)) ? scale * acc[i][j] : 0.f;
                }
        }
    __syncthreads();
}

__global__ void __launch_bounds__(256) sdm_bwy_kernel(SdmOpArgs a, const float *dout, float *dkappa, float *dgamma,
                                                      float *dbeta, float *drho) {
    __shared__ float sm[2 * 64 * 33];
    const int c = blockIdx.x, s = blockIdx.y, C = a.C, W = a.W, R = a.R;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * C) * W, er = ((size_t)s * a.Tp + (size_t)c * C) * R;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, tok0 = (size_t)s * a.Tp + (size_t)c * C;
    const int nvalid = min(C, a.T - c * C);
    const float *Dl = a.delta + tok0 * a.d, *DX = a.dx + tok0 * a.d;
    float *dS = a.dS + cc, *dL = a.dL + cc;
    // dS = dO Delta^T (u <= t), dL = -dX Delta^T (u < t)
    sdm_chunk_gram(
        C, a.d, [&](int t) { return t < nvalid ? dout + sdm_tok_off(a, s, c * C + t, a.d) : (const float *)NULL; },
        Dl, 1.f, false, dS, sm);
    sdm_chunk_gram(C, a.d, [&](int t) { return DX + (size_t)t * a.d; }, Dl, -1.f, true, dL, sm);
    // dbeta_t = <V - R0, dX>_t + sum_{u<t} A[t,u] dL[t,u], one warp per token
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int t = warp; t < nvalid; t += blockDim.x / 32) {
        float x = 0.f;
        for (int k = lane; k < a.d; k += 32) x = fmaf(a.u[(tok0 + t) * a.d + k], DX[(size_t)t * a.d + k], x);
        for (int u = lane; u < t; u += 32) x = fmaf(a.A[cc + t * C + u], dL[t * C + u], x);
        x = core_warp_sum(x);
        if (lane == 0) dbeta[sdm_tok_off(a, s, c * C + t, 1)] = x;
    }
    // per-entry direct terms (in place: omega -> dkappa, eta stays (dgamma direct), psi -> dlam; phi -> drho)
    for (int e = threadIdx.x; e < C * W; e += blockDim.x) {
        size_t g = ew + e;
        float kap = a.w_kappa[g], pi = a.w_pi[g], el = expf(a.w_lam[g]), om = a.omega[g], ps = a.psi[g];
        a.omega[g] = pi * om + el * ps;
        a.psi[g] = kap * el * ps;
        a.dmu[g] = kap * pi * om;
    }
    for (int e = threadIdx.x; e < C * R; e += blockDim.x) {
        size_t g = er + e;
        float el = expf(a.r_lam[g]), ph = a.phi[g];
        a.phi[g] = el * ph;
        a.dlamr[g] = a.r_rho[g] * el * ph;
    }
    __syncthreads();
    // one thread per written slot (its last entry): Gram backward over the slot's entries, then the dgamma scans
    float *dk = a.omega + ew, *dg = a.eta + ew, *dlam = a.psi + ew, *dmu = a.dmu + ew, *dr = a.phi + er,
          *dlr = a.dlamr + er;
    const float *kap = a.w_kappa + ew, *lam = a.w_lam + ew, *rho = a.r_rho + er, *rlam = a.r_lam + er;
    const float *bt = a.beta + tok0;
    const int *prev = a.w_prev + ew, *prevr = a.r_prevr + er, *prevw = a.r_prevw + er;
    for (int h = threadIdx.x; h < C * W; h += blockDim.x) {
        if (a.w_slot[ew + h] < 0 || a.w_next[ew + h] >= 0) continue;
        for (int b = h; b >= 0; b = prev[b]) // write pairs (b later, q earlier)
            for (int q = prev[b]; q >= 0; q = prev[q]) {
                int tb = b / W, tq = q / W;
                float gA = bt[tb] * dL[tb * C + tq], E = expf(lam[b] - lam[q]), x = gA * kap[b] * kap[q] * E;
                dk[b] += gA * kap[q] * E;
                dk[q] += gA * kap[b] * E;
                dlam[b] += x;
                dlam[q] -= x;
            }
        // read-write pairs with the write at or before the read
        for (int r = a.w_lastread[ew + h]; r >= 0; r = prevr[r])
            for (int q = h; q >= 0; q = prev[q]) {
                int tr = r / R, tq = q / W;
                if (tq > tr) continue;
                float gS = dS[tr * C + tq], E = expf(rlam[r] - lam[q]), x = gS * rho[r] * kap[q] * E;
                dr[r] += gS * kap[q] * E;
                dk[q] += gS * rho[r] * E;
                if (q != prevw[r]) { // E = e^{lam_prevw[r] - lam_q} depends on the gammas in (q, prevw[r]] only
                    dlr[r] += x;
                    dlam[q] -= x;
                }
            }
        // dgamma_q = eta_q + sum_{writes b at or after q} dlam_b + sum_{reads at or after q} dlam'_r
        //          + sum_{writes b before q} dmu_b
        // (docs/SDM.md#per-entry-gradients also lists -kappa pi omega for q and dmu_q itself: they cancel exactly since
        // pi_q = e^{mu_q - gamma_q} does not depend on gamma_q, and dropping both avoids a catastrophic cancellation
        // when gamma << 0)
        for (int q = h; q >= 0; q = prev[q]) {
            int tq = q / W;
            float x = dg[q];
            for (int b = h; b >= 0; b = prev[b]) x += b / W >= tq ? dlam[b] : dmu[b];
            for (int r = a.w_lastread[ew + h]; r >= 0; r = prevr[r])
                if (r / R >= tq) x += dlr[r];
            dg[q] = x;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nvalid * W; e += blockDim.x) {
        size_t o = sdm_tok_off(a, s, c * C + e / W, W) + e % W;
        dkappa[o] = dk[e];
        dgamma[o] = dg[e];
    }
    for (int e = threadIdx.x; e < nvalid * R; e += blockDim.x)
        drho[sdm_tok_off(a, s, c * C + e / R, R) + e % R] = dr[e];
}

// The backward's launches (separate so the benchmark can time them one by one).
static inline void sdm_op_launch_token(const SdmOpArgs &a, const void *bank, int bank_fp32, const float *G,
                                       const float *dout, int cg, int cd, cudaStream_t stream) {
    size_t smem = sdm_token_smem(a.d);
    cudaCheck(cudaFuncSetAttribute(sdm_token_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    sdm_token_kernel<<<dim3(a.C, a.S), SDM_TOK_THREADS, smem, stream>>>(a, bank, bank_fp32, G, dout, cg, cd);
    cudaCheckLast();
}
static inline void sdm_op_launch_bsolve(const SdmOpArgs &a, const float *dout, float *dv, int c, cudaStream_t stream) {
    size_t smem = sdm_op_tile_smem(a);
    cudaCheck(cudaFuncSetAttribute(sdm_bsolve_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    sdm_bsolve_kernel<<<dim3(a.d / a.DB, a.S), 256, smem, stream>>>(a, dout, dv, c);
    cudaCheckLast();
}
static inline void sdm_op_launch_bscatter(const SdmOpArgs &a, void *bank, int bank_fp32, float *G, const float *dout,
                                          int c, cudaStream_t stream) {
    sdm_bscatter_kernel<<<sdm_op_entry_grid(a, a.C * (a.W + a.R)), SDM_ROW_THREADS, 0, stream>>>(a, bank, bank_fp32, G,
                                                                                                  dout, c);
    cudaCheckLast();
}
static inline void sdm_op_launch_bwy(const SdmOpArgs &a, const float *dout, const SdmOpGrads *g, cudaStream_t stream) {
    sdm_bwy_kernel<<<dim3(a.nc, a.S), 256, 0, stream>>>(a, dout, g->dkappa, g->dgamma, g->dbeta, g->drho);
    cudaCheckLast();
}

static void sdm_op_backward(const SdmOpShape *s, const SdmOpInputs *in, void *bank, const float *dout,
                            const float *dbank_final, const SdmOpGrads *g, void *saved, void *scratch,
                            cudaStream_t stream) {
    sdm_op_require(s);
    (void)in; // everything the backward needs from the inputs was saved by the forward (V - R0, weights, links)
    if (!s->training) sdm_die("sdm_op_backward: the forward must run with training = 1");
    SdmOpArgs a = sdm_op_args(s, saved, scratch);
    size_t bank_elems = (size_t)a.S * a.N * a.d;
    if (dbank_final)
        cudaCheck(cudaMemcpyAsync(g->dbank_init, dbank_final, bank_elems * 4, cudaMemcpyDeviceToDevice, stream));
    else cudaCheck(cudaMemsetAsync(g->dbank_init, 0, bank_elems * 4, stream));
    for (int c = a.nc - 1; c >= -1; c--) {
        // dots of chunk c against G (before its update) and of chunk c + 1 against its restored bank
        sdm_op_launch_token(a, bank, s->bank_fp32, g->dbank_init, dout, c, c + 1 < a.nc ? c + 1 : -1, stream);
        if (c < 0) break;
        sdm_op_launch_bsolve(a, dout, g->dv, c, stream);
        sdm_op_launch_bscatter(a, bank, s->bank_fp32, g->dbank_init, dout, c, stream);
    }
    sdm_op_launch_bwy(a, dout, g, stream);
}

#endif
