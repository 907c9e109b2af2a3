// sdm/sdm_op.cuh: the GPU SDM memory op (docs/SDM.md): chunked WY forward (training and prefill), backward, and
// the single-token decode step. The C API (shapes, sizing, entry points) is documented in sdm/sdm_op.h.
//
// Structure (per stream s = b*H + h, chunks of C tokens, all streams advance together):
//   wy_kernel        Phase 1, one CTA per (stream, chunk), no bank access: slot links between the chunk's entries
//                    (two-pointer merges of the sorted slot lists), per-slot decay scans from zero inside the chunk
//                    (docs/SDM.md#numerics), gather/scatter weights, Gram matrices A and S, and Linv = (I + diag(beta) A)^-1.
//   forward          Phase 2, sequential over chunks (a host loop, three launches per chunk, all streams at once):
//                    fgather (per (stream, token), whole rows: R0, E, snapshots), fsolve (per (stream, DB columns):
//                    Delta = Linv diag(beta) (V - R0), O = S Delta + E), fscatter (one warp per written slot: its last
//                    entry combines the slot's entries in a fixed order and writes the whole row once).
//   backward         reverse over chunks: token_kernel (per (stream, token), whole rows: write-path gradient of
//                    delta and the per-entry dot products against G and the bank), bsolve (per (stream, DB columns):
//                    dDelta, dX, dR0), bscatter (one warp per touched slot: the dense fp32 bank gradient G at the
//                    touched rows; bank rows restored from the snapshots), then bwy_kernel (per (stream, chunk): the
//                    C x C products, the Gram backward and the per-slot dgamma scans, one thread per slot).
//   decode_kernel    one token per stream, the recurrence in place (docs/SDM.md#the-recurrence).
// No floating-point atomics anywhere (integer atomicMax/atomicMin only build slot links): bitwise deterministic.
#ifndef SDM_SDM_OP_CUH
#define SDM_SDM_OP_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <limits.h>

#include "core/cuda_common.cuh"
#include "sdm/sdm_op.h"

// ------------------------------------------------------------------------------------------------------------------
// Small device helpers

// VEC consecutive bank elements = 16 bytes
template <typename Tb> struct BankVec;
template <> struct BankVec<float> {
    static constexpr int V = 4;
    __device__ static void unpack(uint4 r, float *x) {
        x[0] = __uint_as_float(r.x); x[1] = __uint_as_float(r.y); x[2] = __uint_as_float(r.z); x[3] = __uint_as_float(r.w);
    }
    __device__ static void load(const float *p, float *x) {
        float4 a = *(const float4 *)p;
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    }
    __device__ static void store(float *p, const float *x) { *(float4 *)p = make_float4(x[0], x[1], x[2], x[3]); }
};
template <> struct BankVec<__nv_bfloat16> {
    static constexpr int V = 8;
    __device__ static void unpack(uint4 r, float *x) {
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&r;
        for (int i = 0; i < 4; i++) { float2 f = __bfloat1622float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
    }
    __device__ static void load(const __nv_bfloat16 *p, float *x) {
        uint4 a = *(const uint4 *)p;
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&a;
        for (int i = 0; i < 4; i++) { float2 f = __bfloat1622float2(h[i]); x[2 * i] = f.x; x[2 * i + 1] = f.y; }
    }
    __device__ static void store(__nv_bfloat16 *p, const float *x) {
        uint4 a;
        __nv_bfloat162 *h = (__nv_bfloat162 *)&a;
        for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
        *(uint4 *)p = a;
    }
};

// 4 consecutive elements of a bf16 or fp32 row
__device__ __forceinline__ float4 load4_any(const void *row, int col, bool fp32) {
    if (fp32) return *(const float4 *)((const float *)row + col);
    uint2 a = *(const uint2 *)((const __nv_bfloat16 *)row + col);
    float2 lo = __bfloat1622float2(*(const __nv_bfloat162 *)&a.x), hi = __bfloat1622float2(*(const __nv_bfloat162 *)&a.y);
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ __forceinline__ void store4_any(void *row, int col, float4 x, bool fp32) {
    if (fp32) { *(float4 *)((float *)row + col) = x; return; }
    __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
    uint2 a;
    a.x = *(uint32_t *)&lo;
    a.y = *(uint32_t *)&hi;
    *(uint2 *)((__nv_bfloat16 *)row + col) = a;
}
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
__device__ __forceinline__ float4 axpy4(float a, float4 x, float4 y) {
    return make_float4(fmaf(a, x.x, y.x), fmaf(a, x.y, y.y), fmaf(a, x.z, y.z), fmaf(a, x.w, y.w));
}

// Where the snapshot rows live: payload [S][Tp][W] rows of row_bytes, fp8/int4 scales [S][Tp][W][d/DB].
struct SnapView {
    char *data;
    float *scale;
    int mode, bank_fp32, d, DB;
    size_t row_bytes;
};

// Store VEC values of snapshot row e at columns [col, col+V); `lanes` consecutive lanes of the warp hold the DB
// columns of one row (they share one fp8/int4 scale). Every lane of the warp must call it (shuffles).
template <int V>
__device__ void snap_store(const SnapView &sv, size_t e, int col, const float *x, bool active, int lanes) {
    char *row = sv.data + e * sv.row_bytes;
    if (sv.mode == SDM_SNAP_NONE || sv.mode == SDM_SNAP_BF16) {
        if (!active) return;
        if (sv.mode == SDM_SNAP_NONE && sv.bank_fp32) {
            for (int i = 0; i < V; i += 4) *(float4 *)((float *)row + col + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
        } else {
            for (int i = 0; i < V; i += 4) store4_any(row, col + i, make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]), false);
        }
        return;
    }
    float amax = 0.f;
    if (active)
        for (int i = 0; i < V; i++) amax = fmaxf(amax, fabsf(x[i]));
    for (int o = 1; o < lanes; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!active) return;
    bool fp8 = sv.mode == SDM_SNAP_FP8;
    float scale = fmaxf(amax / (fp8 ? 448.f : 7.f), 1e-12f), inv = 1.f / scale;
    if (col % sv.DB == 0) sv.scale[e * (sv.d / sv.DB) + col / sv.DB] = scale;
    if (fp8) {
        for (int i = 0; i < V; i++)
            ((__nv_fp8_storage_t *)row)[col + i] = __nv_cvt_float_to_fp8(x[i] * inv, __NV_SATFINITE, __NV_E4M3);
    } else {
        for (int i = 0; i < V; i += 2) {
            int hi = (int)fminf(fmaxf(rintf(x[i] * inv), -8.f), 7.f), lo = (int)fminf(fmaxf(rintf(x[i + 1] * inv), -8.f), 7.f);
            ((uint8_t *)row)[(col + i) / 2] = (uint8_t)(((hi & 15) << 4) | (lo & 15));
        }
    }
}

// 4 values of snapshot row e at columns [col, col+4), dequantised
__device__ __forceinline__ float4 snap_load4(const SnapView &sv, size_t e, int col) {
    const char *row = sv.data + e * sv.row_bytes;
    if (sv.mode == SDM_SNAP_NONE) return load4_any(row, col, sv.bank_fp32);
    if (sv.mode == SDM_SNAP_BF16) return load4_any(row, col, false);
    float s = sv.scale[e * (sv.d / sv.DB) + col / sv.DB];
    float v[4];
    if (sv.mode == SDM_SNAP_FP8) {
        for (int i = 0; i < 4; i++) {
            __half_raw h = __nv_cvt_fp8_to_halfraw(((const __nv_fp8_storage_t *)row)[col + i], __NV_E4M3);
            v[i] = __half2float(__half(h)) * s;
        }
    } else {
        for (int i = 0; i < 4; i += 2) {
            uint8_t b = ((const uint8_t *)row)[(col + i) / 2];
            v[i] = (float)((int)((uint32_t)b << 24) >> 28) * s;     // high nibble, sign-extended
            v[i + 1] = (float)((int)((uint32_t)b << 28) >> 28) * s; // low nibble
        }
    }
    return make_float4(v[0], v[1], v[2], v[3]);
}

// Everything the kernels need about the layout, by value.
struct OpArgs {
    int B, T, H, N, d, W, R, C, nc, Tp, DB, S, training;
    // phase-1 arrays (saved)
    int *w_slot, *w_prev, *w_next, *w_lastread;
    float *w_kappa, *w_lam, *w_gath, *w_scat, *w_pi, *w_elam_tot;
    int *r_slot, *r_prevw, *r_prevr, *r_nextr, *r_lastw;
    float *r_rho, *r_lam, *r_gath, *beta, *A, *Sm, *Linv, *cx, *ce, *cdelta, *delta, *u;
    SnapView snap;
    // backward scratch
    float *wsum, *dx, *omega, *eta, *psi, *phi, *dS, *dL, *dmu, *dlamr;
};

static inline OpArgs sdm_op_args(const SdmOpShape *s, void *saved, void *scratch) {
    SdmOpLayout L = sdm_op_layout(s);
    OpArgs a;
    memset(&a, 0, sizeof(a));
    a.B = s->B; a.T = s->T; a.H = s->H; a.N = s->N; a.d = s->d; a.W = s->W; a.R = s->R;
    a.C = L.C; a.nc = L.nc; a.Tp = L.Tp; a.DB = L.DB; a.S = L.S; a.training = s->training;
    char *sv = (char *)saved;
#define SDM_OP_PTR(field, type) a.field = (type *)(sv + L.field)
    SDM_OP_PTR(w_slot, int); SDM_OP_PTR(w_prev, int); SDM_OP_PTR(w_next, int); SDM_OP_PTR(w_lastread, int);
    SDM_OP_PTR(w_kappa, float); SDM_OP_PTR(w_lam, float); SDM_OP_PTR(w_gath, float); SDM_OP_PTR(w_scat, float);
    SDM_OP_PTR(w_pi, float); SDM_OP_PTR(w_elam_tot, float);
    SDM_OP_PTR(r_slot, int); SDM_OP_PTR(r_prevw, int); SDM_OP_PTR(r_prevr, int); SDM_OP_PTR(r_nextr, int); SDM_OP_PTR(r_lastw, int);
    SDM_OP_PTR(r_rho, float); SDM_OP_PTR(r_lam, float); SDM_OP_PTR(r_gath, float); SDM_OP_PTR(beta, float);
    SDM_OP_PTR(A, float); SDM_OP_PTR(Sm, float); SDM_OP_PTR(Linv, float);
    SDM_OP_PTR(cx, float); SDM_OP_PTR(ce, float); SDM_OP_PTR(cdelta, float);
    if (s->training) {
        SDM_OP_PTR(delta, float); SDM_OP_PTR(u, float);
        a.snap.data = sv + L.snap;
        a.snap.scale = (float *)(sv + L.snap_scale);
    }
    a.snap.mode = s->snapshot; a.snap.bank_fp32 = s->bank_fp32; a.snap.d = s->d; a.snap.DB = L.DB;
    a.snap.row_bytes = sdm_op_snap_row_bytes(s);
    if (scratch) {
        sv = (char *)scratch;
        SDM_OP_PTR(wsum, float); SDM_OP_PTR(dx, float); SDM_OP_PTR(omega, float); SDM_OP_PTR(eta, float);
        SDM_OP_PTR(psi, float); SDM_OP_PTR(phi, float); SDM_OP_PTR(dS, float); SDM_OP_PTR(dL, float);
        SDM_OP_PTR(dmu, float); SDM_OP_PTR(dlamr, float);
    }
#undef SDM_OP_PTR
    return a;
}

// Token-major offset of (stream s, token t) in a [B,T,H,width] array.
__device__ __forceinline__ size_t tok_off(const OpArgs &a, int s, int t, int width) {
    int b = s / a.H, h = s % a.H;
    return (((size_t)b * a.T + t) * a.H + h) * (size_t)width;
}

// ------------------------------------------------------------------------------------------------------------------
// Phase 1: the WY quantities of one chunk. Grid (nc, S), 256 threads, dynamic smem: the chunk's slot lists.

// Calls f(i, j) for every pair of equal entries of the sorted lists x[0..nx) and y[0..ny) (distinct within a list).
template <typename F> __device__ __forceinline__ void merge_equal(const int *x, int nx, const int *y, int ny, F f) {
    int i = 0, j = 0;
    while (i < nx && j < ny) {
        int a = x[i], b = y[j];
        if (a == b) { f(i, j); i++; j++; }
        else if (a < b) i++;
        else j++;
    }
}

__global__ void __launch_bounds__(256) sdm_wy_kernel(OpArgs a, const int *wslot, const float *kappa,
                                                     const float *gamma, const float *beta, const int *rslot,
                                                     const float *rho) {
    extern __shared__ int smem_slots[];
    const int c = blockIdx.x, s = blockIdx.y, C = a.C, W = a.W, R = a.R;
    const int nvalid = min(C, a.T - c * C); // tokens of this chunk inside the sequence; the rest are inert padding
    const int sW = W | 1, sR = R | 1; // odd row strides: lanes walking different tokens' lists hit different banks
    int *ks = smem_slots, *qs = smem_slots + C * sW;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * C) * W, er = ((size_t)s * a.Tp + (size_t)c * C) * R;
    int *prev = a.w_prev + ew, *next = a.w_next + ew, *lastread = a.w_lastread + ew;
    int *prevw = a.r_prevw + er, *prevr = a.r_prevr + er, *nextr = a.r_nextr + er, *lastw = a.r_lastw + er;
    float *lam = a.w_lam + ew, *gam = a.w_pi + ew, *nu = a.w_scat + ew, *lamtot = a.w_elam_tot + ew;
    float *kap = a.w_kappa + ew, *rlam = a.r_lam + er;
    // load (padding: slot -1, weights 0), initialise the links
    for (int e = threadIdx.x; e < C * W; e += blockDim.x) {
        int t = e / W;
        bool v = t < nvalid;
        size_t g = tok_off(a, s, c * C + t, W) + e % W;
        ks[t * sW + e % W] = v ? wslot[g] : -1;
        kap[e] = v ? kappa[g] : 0.f;
        gam[e] = v ? gamma[g] : 0.f;
        a.w_slot[ew + e] = ks[t * sW + e % W];
        prev[e] = -1; next[e] = INT_MAX; lastread[e] = -1;
    }
    for (int e = threadIdx.x; e < C * R; e += blockDim.x) {
        int t = e / R;
        bool v = t < nvalid;
        size_t g = tok_off(a, s, c * C + t, R) + e % R;
        qs[t * sR + e % R] = v ? rslot[g] : -1;
        a.r_rho[er + e] = v ? rho[g] : 0.f;
        a.r_slot[er + e] = qs[t * sR + e % R];
        prevw[e] = -1; prevr[e] = -1; nextr[e] = INT_MAX; lastw[e] = -1;
    }
    for (int t = threadIdx.x; t < C; t += blockDim.x)
        a.beta[(size_t)s * a.Tp + c * C + t] = t < nvalid ? beta[tok_off(a, s, c * C + t, 1)] : 0.f;
    __syncthreads();
    // links: the previous/next write of the same slot, the writes a read sees, the last write and read of a slot
    for (int p = threadIdx.x; p < nvalid * nvalid; p += blockDim.x) {
        int t = p / nvalid, u = p % nvalid;
        if (u < t) {
            merge_equal(ks + t * sW, W, ks + u * sW, W, [&](int i, int j) {
                atomicMax(prev + t * W + i, u * W + j);
                atomicMin(next + u * W + j, t * W + i);
            });
            merge_equal(qs + t * sR, R, qs + u * sR, R, [&](int i, int j) {
                atomicMax(prevr + t * R + i, u * R + j);
                atomicMin(nextr + u * R + j, t * R + i);
            });
        }
        merge_equal(qs + t * sR, R, ks + u * sW, W, [&](int i, int j) {
            if (u <= t) atomicMax(prevw + t * R + i, u * W + j);
            atomicMax(lastread + u * W + j, t * R + i);
            atomicMax(lastw + t * R + i, u * W + j);
        });
    }
    __syncthreads();
    for (int e = threadIdx.x; e < C * W; e += blockDim.x)
        if (next[e] == INT_MAX) next[e] = -1;
    for (int e = threadIdx.x; e < C * R; e += blockDim.x)
        if (nextr[e] == INT_MAX) nextr[e] = -1;
    __syncthreads();
    // per-slot decay scans from zero inside the chunk: lam inclusive forward, nu = sum strictly after, lamtot = slot total
    for (int t = 0; t < C; t++) {
        for (int k = threadIdx.x; k < W; k += blockDim.x) {
            int e = t * W + k, pr = prev[e];
            lam[e] = pr >= 0 ? lam[pr] + gam[e] : gam[e];
        }
        __syncthreads();
    }
    for (int t = C - 1; t >= 0; t--) {
        for (int k = threadIdx.x; k < W; k += blockDim.x) {
            int e = t * W + k, nx = next[e];
            nu[e] = nx >= 0 ? gam[nx] + nu[nx] : 0.f;
            lamtot[e] = nx >= 0 ? lamtot[nx] : lam[e];
        }
        __syncthreads();
    }
    // gather/scatter weights: kappa e^lam, pi kappa (pi = e^nu); e^Lambda of the slot
    for (int e = threadIdx.x; e < C * W; e += blockDim.x) {
        float pi = expf(nu[e]);
        a.w_gath[ew + e] = kap[e] * expf(lam[e]);
        gam[e] = pi; // w_pi: gamma is no longer needed
        nu[e] = pi * kap[e]; // w_scat
        lamtot[e] = expf(lamtot[e]);
    }
    for (int e = threadIdx.x; e < C * R; e += blockDim.x) {
        int pw = prevw[e];
        float l = pw >= 0 ? lam[pw] : 0.f;
        rlam[e] = l;
        a.r_gath[er + e] = a.r_rho[er + e] * expf(l);
    }
    __syncthreads();
    // Gram matrices A (strictly lower) and S (lower with diagonal), one thread per (t, u), merge order
    const size_t cc = ((size_t)s * a.nc + c) * C * C;
    const float *rr = a.r_rho + er;
    for (int p = threadIdx.x; p < C * C; p += blockDim.x) {
        int t = p / C, u = p % C;
        float av = 0.f, sv = 0.f;
        if (t < nvalid && u <= t) {
            if (u < t)
                merge_equal(ks + t * sW, W, ks + u * sW, W, [&](int i, int j) {
                    av += kap[t * W + i] * kap[u * W + j] * expf(lam[t * W + i] - lam[u * W + j]);
                });
            merge_equal(qs + t * sR, R, ks + u * sW, W, [&](int i, int j) {
                sv += rr[t * R + i] * kap[u * W + j] * expf(rlam[t * R + i] - lam[u * W + j]);
            });
        }
        a.A[cc + p] = av;
        a.Sm[cc + p] = sv;
    }
    __syncthreads();
    // Linv = (I + diag(beta) A)^-1 by forward substitution, thread j owns column j; the lower triangle is kept packed
    // in shared memory (X(t, j) at t (t + 1) / 2 + j), over the slot lists that are no longer needed
    const float *Ac = a.A + cc, *bt = a.beta + (size_t)s * a.Tp + c * C;
    float *X = (float *)smem_slots;
    for (int j = threadIdx.x; j < C; j += blockDim.x) {
        X[j * (j + 1) / 2 + j] = 1.f;
        for (int t = j + 1; t < C; t++) {
            float acc = 0.f;
            for (int u = j; u < t; u++) acc = fmaf(Ac[t * C + u], X[u * (u + 1) / 2 + j], acc);
            X[t * (t + 1) / 2 + j] = -bt[t] * acc;
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < C * C; p += blockDim.x) {
        int t = p / C, j = p % C;
        a.Linv[cc + p] = j <= t ? X[t * (t + 1) / 2 + j] : 0.f;
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Phase 2 (forward), one chunk c of every stream per round of three launches (the host loops over the chunks):
//   fgather_kernel  per (stream, token), whole rows: R0, E and the snapshots; X = beta (V - R0) and E to the
//                   per-chunk buffers (U = V - R0 saved for the backward)
//   fsolve_kernel   per (stream, DB columns): Delta = Linv X, O = S Delta + E
//   fscatter_kernel one warp per write entry; the last entry of each written slot writes its whole row
// Whole rows keep the random bank accesses long and contiguous (2-4 KB), which HBM serves far better than the
// short column slices of one-CTA-per-column-block designs (measured: see the notes in tests/bench_sdm_op.cu).
#define SDM_ROW_THREADS 256
#define SDM_ROW_WARPS (SDM_ROW_THREADS / 32)

// Pointer to row t of chunk c's Delta: the saved [S][Tp][d] array when training, else the per-chunk buffer.
__device__ __forceinline__ float *delta_row(const OpArgs &a, int s, int c, int t) {
    return a.training ? a.delta + ((size_t)s * a.Tp + (size_t)c * a.C + t) * a.d
                      : a.cdelta + ((size_t)s * a.C + t) * a.d;
}

#define SDM_GQ 4 // 16-byte row vectors per lane accumulated in registers per pass (one pass covers 32 * 4 * V columns)

// part[col] = sum over the entries k = warp, warp + warps, ... of gath[k] * row(slot[k])[col] (whole rows; `part` is
// the calling warp's partial row); `snap` stores each row's snapshot. The sums live in registers for SDM_GQ vectors
// per lane (wider rows take several passes over the entries, each over other columns), two entries' loads in flight.
template <typename Tb>
__device__ __forceinline__ void gather_whole_rows(const OpArgs &a, const Tb *M, const int *slots, const float *gath,
                                                  size_t e0, int n, float *part, bool snap) {
    constexpr int V = BankVec<Tb>::V;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nq = (a.d + 32 * V - 1) / (32 * V);
    for (int q0 = 0; q0 < nq; q0 += SDM_GQ) {
        float acc[SDM_GQ][V];
#pragma unroll
        for (int u = 0; u < SDM_GQ; u++)
            for (int i = 0; i < V; i++) acc[u][i] = 0.f;
        for (int k0 = warp; k0 < n; k0 += 2 * SDM_ROW_WARPS) {
            int k[2] = {k0, k0 + SDM_ROW_WARPS}, sl[2];
            float g[2];
            uint4 raw[2][SDM_GQ];
#pragma unroll
            for (int j = 0; j < 2; j++) {
                sl[j] = k[j] < n ? slots[e0 + k[j]] : -1; // -1 also for padding: warp-uniform
                g[j] = sl[j] >= 0 ? gath[e0 + k[j]] : 0.f;
#pragma unroll
                for (int u = 0; u < SDM_GQ; u++) {
                    int col = ((q0 + u) * 32 + lane) * V;
                    if (sl[j] >= 0 && q0 + u < nq && col < a.d) raw[j][u] = *(const uint4 *)(M + (size_t)sl[j] * a.d + col);
                }
            }
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int u = 0; u < SDM_GQ; u++) {
                    int col = ((q0 + u) * 32 + lane) * V;
                    if (sl[j] < 0 || q0 + u >= nq) continue; // warp-uniform
                    bool on = col < a.d;
                    float x[V];
                    if (on) {
                        BankVec<Tb>::unpack(raw[j][u], x);
                        for (int i = 0; i < V; i++) acc[u][i] = fmaf(g[j], x[i], acc[u][i]);
                    }
                    if (snap) snap_store<V>(a.snap, e0 + k[j], col, x, on, a.DB / V);
                }
        }
#pragma unroll
        for (int u = 0; u < SDM_GQ; u++) {
            int col = ((q0 + u) * 32 + lane) * V;
            if (q0 + u < nq && col < a.d)
                for (int i = 0; i < V; i++) part[col + i] = acc[u][i];
        }
    }
}

// Sums the warps' partial rows in warp order into part[0..d) (the block's total).
__device__ __forceinline__ void sum_partials(float *part, int d) {
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float x = part[i];
        for (int w = 1; w < SDM_ROW_WARPS; w++) x += part[w * d + i];
        part[i] = x;
    }
    __syncthreads();
}

// Grid (C, S), SDM_ROW_THREADS threads, dynamic smem SDM_ROW_WARPS * d floats.
template <typename Tb>
__global__ void __launch_bounds__(SDM_ROW_THREADS) sdm_fgather_kernel(OpArgs a, const float *v, const Tb *bank, int c) {
    extern __shared__ float part[]; // [warps][d]
    const int t = blockIdx.x, s = blockIdx.y, d = a.d, tp = c * a.C + t, warp = threadIdx.x / 32;
    const size_t tok = (size_t)s * a.Tp + tp, crow = ((size_t)s * a.C + t) * d;
    const Tb *M = bank + (size_t)s * a.N * d;
    gather_whole_rows<Tb>(a, M, a.w_slot, a.w_gath, tok * a.W, a.W, part + warp * d, a.training != 0);
    sum_partials(part, d);
    float bt = a.beta[tok];
    for (int i = threadIdx.x; i < d; i += blockDim.x) { // U = V - R0 (saved), X = beta U
        float u = (tp < a.T ? v[tok_off(a, s, tp, d) + i] : 0.f) - part[i];
        if (a.training) a.u[tok * d + i] = u;
        a.cx[crow + i] = bt * u;
    }
    __syncthreads(); // part is rewritten by the next gathers
    gather_whole_rows<Tb>(a, M, a.r_slot, a.r_gath, tok * a.R, a.R, part + warp * d, false);
    sum_partials(part, d);
    for (int i = threadIdx.x; i < d; i += blockDim.x) a.ce[crow + i] = part[i];
}

// Grid (d/DB, S), 256 threads, dynamic smem: X and Delta tiles [C][DB].
__global__ void __launch_bounds__(256) sdm_fsolve_kernel(OpArgs a, float *out, int c) {
    extern __shared__ float smem_tiles[];
    const int C = a.C, DB = a.DB, nvec = DB / 4, s = blockIdx.y, col0 = blockIdx.x * DB, items = C * nvec;
    float *Xs = smem_tiles, *Ds = Xs + C * DB;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, crow0 = (size_t)s * C * a.d;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4;
        *(float4 *)(Xs + t * DB + lc) = *(const float4 *)(a.cx + crow0 + (size_t)t * a.d + col0 + lc);
    }
    __syncthreads();
    const float *Li = a.Linv + cc, *Sc = a.Sm + cc;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int u = 0; u <= t; u++) acc = axpy4(Li[t * C + u], *(const float4 *)(Xs + u * DB + lc), acc);
        *(float4 *)(Ds + t * DB + lc) = acc;
        *(float4 *)(delta_row(a, s, c, t) + col0 + lc) = acc;
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        if (tp >= a.T) continue;
        float4 acc = *(const float4 *)(a.ce + crow0 + (size_t)t * a.d + col0 + lc);
        for (int u = 0; u <= t; u++) {
            float sv = Sc[t * C + u];
            if (sv != 0.f) acc = axpy4(sv, *(const float4 *)(Ds + u * DB + lc), acc);
        }
        *(float4 *)(out + tok_off(a, s, tp, a.d) + col0 + lc) = acc;
    }
}

// Grid (ceil(C W / warps), S), SDM_ROW_THREADS threads: warp e of the chunk's write entries; when e is the last
// entry of its slot: M[i] = e^Lambda M0[i] + sum over the slot's entries (walking back) pi kappa delta_t.
template <typename Tb>
__global__ void __launch_bounds__(SDM_ROW_THREADS) sdm_fscatter_kernel(OpArgs a, Tb *bank, int c) {
    constexpr int V = BankVec<Tb>::V;
    const int s = blockIdx.y, e = blockIdx.x * SDM_ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (e >= a.C * a.W) return;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * a.C) * a.W;
    int slot = a.w_slot[ew + e];
    if (slot < 0 || a.w_next[ew + e] >= 0) return;
    Tb *row = bank + ((size_t)s * a.N + slot) * a.d;
    float el = a.w_elam_tot[ew + e];
    for (int col = lane * V; col < a.d; col += 32 * V) {
        float x[V];
        BankVec<Tb>::load(row + col, x);
        for (int i = 0; i < V; i++) x[i] *= el;
        for (int q = e; q >= 0; q = a.w_prev[ew + q]) {
            float w = a.w_scat[ew + q];
            const float *dr = delta_row(a, s, c, q / a.W) + col;
            for (int i = 0; i < V; i += 4) {
                float4 dv = *(const float4 *)(dr + i);
                x[i] = fmaf(w, dv.x, x[i]); x[i + 1] = fmaf(w, dv.y, x[i + 1]);
                x[i + 2] = fmaf(w, dv.z, x[i + 2]); x[i + 3] = fmaf(w, dv.w, x[i + 3]);
            }
        }
        BankVec<Tb>::store(row + col, x);
    }
}

// ------------------------------------------------------------------------------------------------------------------
// Backward, in the reverse chunk loop.

#define SDM_TOK_THREADS 256

// Per (stream, token) of chunk cg: the write-path gradient of delta, wsum_t = sum_i pi kappa G[i], and the dots
// omega = <delta_t, G[i]>, eta = e^Lambda <G[i], M0[i]> (G before this chunk's update). Per token of chunk cd
// (whose bank rows are restored): phi = <dO_t, M0[j]>, psi = -beta_t <dX_t, M0[i]>. cg or cd may be -1.
// One warp per entry (entries k = warp, warp + 8, ...), whole rows; each warp keeps its partial wsum in smem and
// the partials are summed in warp order. Grid (C, S), SDM_TOK_THREADS threads, dynamic smem (2 + warps) d floats.
__global__ void __launch_bounds__(SDM_TOK_THREADS) sdm_token_kernel(OpArgs a, const void *bank, int bank_fp32,
                                                                    const float *G, const float *dout, int cg, int cd) {
    extern __shared__ float tok_smem[];
    const int t = blockIdx.x, s = blockIdx.y, W = a.W, R = a.R, d = a.d, warps = SDM_TOK_THREADS / 32;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float *rowA = tok_smem, *rowB = rowA + d, *wpart = rowB + d; // wpart: [warps][d]
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
                float4 g = *(const float4 *)(gr + col), m = snap_load4(a.snap, ew + k, col);
                float4 dl = *(const float4 *)(rowA + col);
                *(float4 *)(wp + col) = axpy4(w, g, *(const float4 *)(wp + col));
                p0 += dot4(dl, g);
                p1 += dot4(g, m);
            }
            p0 = warp_sum(p0);
            p1 = warp_sum(p1);
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
            rowB[i] = tp < a.T ? dout[tok_off(a, s, tp, d) + i] : 0.f;
        }
        __syncthreads();
        float bt = a.beta[tok];
        for (int k = warp; k < (W > R ? W : R); k += warps) {
            int ws = k < W ? a.w_slot[ew + k] : -1, rs = k < R ? a.r_slot[er + k] : -1;
            float p0 = 0.f, p1 = 0.f;
            const void *brow = rs >= 0 ? (const char *)bank + (rowN + rs) * d * (bank_fp32 ? 4 : 2) : NULL;
            for (int col = lane * 4; col < d; col += 128) {
                if (ws >= 0) p0 += dot4(*(const float4 *)(rowA + col), snap_load4(a.snap, ew + k, col));
                if (rs >= 0) p1 += dot4(*(const float4 *)(rowB + col), load4_any(brow, col, bank_fp32));
            }
            p0 = warp_sum(p0);
            p1 = warp_sum(p1);
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
__global__ void __launch_bounds__(256) sdm_bsolve_kernel(OpArgs a, const float *dout, float *dv, int c) {
    extern __shared__ float smem_tiles[];
    const int C = a.C, DB = a.DB, nvec = DB / 4, s = blockIdx.y, col0 = blockIdx.x * DB, items = C * nvec;
    float *Os = smem_tiles, *DDs = Os + C * DB;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, tok0 = (size_t)s * a.Tp + (size_t)c * C;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        float4 o = tp < a.T ? *(const float4 *)(dout + tok_off(a, s, tp, a.d) + col0 + lc) : make_float4(0.f, 0.f, 0.f, 0.f);
        *(float4 *)(Os + t * DB + lc) = o;
    }
    __syncthreads();
    const float *Sc = a.Sm + cc, *Li = a.Linv + cc;
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4;
        float4 acc = *(const float4 *)(a.wsum + ((size_t)s * C + t) * a.d + col0 + lc);
        for (int u = t; u < C; u++) {
            float sv = Sc[u * C + t];
            if (sv != 0.f) acc = axpy4(sv, *(const float4 *)(Os + u * DB + lc), acc);
        }
        *(float4 *)(DDs + t * DB + lc) = acc;
    }
    __syncthreads();
    for (int it = threadIdx.x; it < items; it += blockDim.x) {
        int t = it / nvec, lc = (it % nvec) * 4, tp = c * C + t;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int u = t; u < C; u++) acc = axpy4(Li[u * C + t], *(const float4 *)(DDs + u * DB + lc), acc);
        *(float4 *)(a.dx + (tok0 + t) * a.d + col0 + lc) = acc;
        float bt = a.beta[tok0 + t];
        *(float4 *)(a.cx + ((size_t)s * C + t) * a.d + col0 + lc) = make_float4(-bt * acc.x, -bt * acc.y, -bt * acc.z, -bt * acc.w);
        if (tp < a.T) *(float4 *)(dv + tok_off(a, s, tp, a.d) + col0 + lc) = make_float4(bt * acc.x, bt * acc.y, bt * acc.z, bt * acc.w);
    }
}

// acc += sum over the read entries of one slot (walking back from r) of rho e^lam' dO_t, 4 columns at col
__device__ __forceinline__ float4 read_chain_sum(const OpArgs &a, const float *dout, int s, int c, size_t er, int r,
                                                 int col, float4 acc) {
    for (int q = r; q >= 0; q = a.r_prevr[er + q]) // read entries exist only for tokens inside the sequence
        acc = axpy4(a.r_gath[er + q], *(const float4 *)(dout + tok_off(a, s, c * a.C + q / a.R, a.d) + col), acc);
    return acc;
}

// The bank gradient at the chunk's touched rows and the bank restore, one warp per entry, whole rows:
//   write entry e, last of its slot:  G[i] = e^Lambda G[i] + sum_writes kappa e^lam dR0_t + sum_reads rho e^lam' dO_t
//   read entry r, last read of a slot the chunk does not write:  G[j] += sum_reads rho e^lam' dO_t
//   write entry e, first of its slot: M[i] = snapshot (the chunk-start row)
// Grid (ceil(C (W + R) / warps), S), SDM_ROW_THREADS threads.
__global__ void __launch_bounds__(SDM_ROW_THREADS) sdm_bscatter_kernel(OpArgs a, void *bank, int bank_fp32, float *G,
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
            for (int col = lane * 4; col < a.d; col += 128) store4_any(row, col, snap_load4(a.snap, ew + i, col), bank_fp32);
        }
        if (a.w_next[ew + i] >= 0) return;
        float *g = G + (rowN + slot) * a.d;
        float el = a.w_elam_tot[ew + i];
        int lr = a.w_lastread[ew + i];
        for (int col = lane * 4; col < a.d; col += 128) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f), racc = acc;
            for (int q = i; q >= 0; q = a.w_prev[ew + q])
                acc = axpy4(a.w_gath[ew + q], *(const float4 *)(a.cx + ((size_t)s * a.C + q / a.W) * a.d + col), acc);
            if (lr >= 0) racc = read_chain_sum(a, dout, s, c, er, lr, col, racc);
            float4 x = axpy4(el, *(const float4 *)(g + col), acc);
            *(float4 *)(g + col) = make_float4(x.x + racc.x, x.y + racc.y, x.z + racc.z, x.w + racc.w);
        }
    } else {
        int r = i - CW, slot = a.r_slot[er + r];
        if (slot < 0 || a.r_nextr[er + r] >= 0 || a.r_lastw[er + r] >= 0) return;
        float *g = G + (rowN + slot) * a.d;
        for (int col = lane * 4; col < a.d; col += 128) {
            float4 racc = read_chain_sum(a, dout, s, c, er, r, col, make_float4(0.f, 0.f, 0.f, 0.f));
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
__device__ void chunk_gram(int C, int d, RowX xrow, const float *Y, float scale, bool strict, float *out, float *sm) {
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
                        for (int j = 0; j < 4; j++) acc[i][j] = fmaf(xs[(ty * 4 + i) * 33 + k], ys[(tx * 4 + j) * 33 + k], acc[i][j]);
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) {
                    int t = t0 + ty * 4 + i, u = u0 + tx * 4 + j;
                    if (t < C && u < C) out[t * C + u] = (u < t || (u == t && !strict)) ? scale * acc[i][j] : 0.f;
                }
        }
    __syncthreads();
}

__global__ void __launch_bounds__(256) sdm_bwy_kernel(OpArgs a, const float *dout, float *dkappa, float *dgamma,
                                                      float *dbeta, float *drho) {
    __shared__ float sm[2 * 64 * 33];
    const int c = blockIdx.x, s = blockIdx.y, C = a.C, W = a.W, R = a.R;
    const size_t ew = ((size_t)s * a.Tp + (size_t)c * C) * W, er = ((size_t)s * a.Tp + (size_t)c * C) * R;
    const size_t cc = ((size_t)s * a.nc + c) * C * C, tok0 = (size_t)s * a.Tp + (size_t)c * C;
    const int nvalid = min(C, a.T - c * C);
    const float *Dl = a.delta + tok0 * a.d, *DX = a.dx + tok0 * a.d;
    float *dS = a.dS + cc, *dL = a.dL + cc;
    // dS = dO Delta^T (u <= t), dL = -dX Delta^T (u < t)
    chunk_gram(C, a.d, [&](int t) { return t < nvalid ? dout + tok_off(a, s, c * C + t, a.d) : (const float *)NULL; },
               Dl, 1.f, false, dS, sm);
    chunk_gram(C, a.d, [&](int t) { return DX + (size_t)t * a.d; }, Dl, -1.f, true, dL, sm);
    // dbeta_t = <V - R0, dX>_t + sum_{u<t} A[t,u] dL[t,u], one warp per token
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int t = warp; t < nvalid; t += blockDim.x / 32) {
        float x = 0.f;
        for (int k = lane; k < a.d; k += 32) x = fmaf(a.u[(tok0 + t) * a.d + k], DX[(size_t)t * a.d + k], x);
        for (int u = lane; u < t; u += 32) x = fmaf(a.A[cc + t * C + u], dL[t * C + u], x);
        x = warp_sum(x);
        if (lane == 0) dbeta[tok_off(a, s, c * C + t, 1)] = x;
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
    float *dk = a.omega + ew, *dg = a.eta + ew, *dlam = a.psi + ew, *dmu = a.dmu + ew, *dr = a.phi + er, *dlr = a.dlamr + er;
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
        for (int r = a.w_lastread[ew + h]; r >= 0; r = prevr[r]) // read-write pairs with the write at or before the read
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
        // (docs/SDM.md#per-entry-gradients also lists -kappa pi omega for q and dmu_q itself: they cancel exactly since pi_q = e^{mu_q -
        // gamma_q} does not depend on gamma_q, and dropping both avoids a catastrophic cancellation when gamma << 0)
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
        size_t o = tok_off(a, s, c * C + e / W, W) + e % W;
        dkappa[o] = dk[e];
        dgamma[o] = dg[e];
    }
    for (int e = threadIdx.x; e < nvalid * R; e += blockDim.x) drho[tok_off(a, s, c * C + e / R, R) + e % R] = dr[e];
}

// ------------------------------------------------------------------------------------------------------------------
// Decode: one token per stream, grid (ceil(d / (32 V)), S), 32 threads; each thread owns V columns of its stream
// and applies steps (1)-(5) of docs/SDM.md#the-recurrence to them (columns are independent, so no synchronisation).
template <typename Tb>
__global__ void __launch_bounds__(32) sdm_decode_kernel(SdmOpShape sh, SdmOpInputs in, Tb *bank, float *out) {
    constexpr int V = BankVec<Tb>::V;
    const int s = blockIdx.y, col = (blockIdx.x * 32 + threadIdx.x) * V;
    if (col >= sh.d) return;
    Tb *M = bank + (size_t)s * sh.N * sh.d;
    const size_t ow = (size_t)s * sh.W, orr = (size_t)s * sh.R;
    float r[V], x[V];
    for (int i = 0; i < V; i++) r[i] = 0.f;
    for (int k = 0; k < sh.W; k++) { // (1)-(2): retrieval from the decayed rows
        BankVec<Tb>::load(M + (size_t)in.wslot[ow + k] * sh.d + col, x);
        float g = in.kappa[ow + k] * expf(in.gamma[ow + k]);
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    float bt = in.beta[s];
    const float *vv = in.v + (size_t)s * sh.d + col;
    for (int i = 0; i < V; i++) r[i] = bt * (vv[i] - r[i]); // (3) r now holds delta
    for (int k = 0; k < sh.W; k++) { // (4) write
        Tb *row = M + (size_t)in.wslot[ow + k] * sh.d + col;
        BankVec<Tb>::load(row, x);
        float a = expf(in.gamma[ow + k]), kp = in.kappa[ow + k];
        for (int i = 0; i < V; i++) x[i] = fmaf(a, x[i], kp * r[i]);
        BankVec<Tb>::store(row, x);
    }
    for (int i = 0; i < V; i++) r[i] = 0.f;
    for (int k = 0; k < sh.R; k++) { // (5) read after the write
        BankVec<Tb>::load(M + (size_t)in.rslot[orr + k] * sh.d + col, x);
        float g = in.rho[orr + k];
        for (int i = 0; i < V; i++) r[i] = fmaf(g, x[i], r[i]);
    }
    for (int i = 0; i < V; i += 4) BankVec<float>::store(out + (size_t)s * sh.d + col + i, r + i);
}

// ------------------------------------------------------------------------------------------------------------------
// Host entry points

static inline void sdm_op_require(const SdmOpShape *s) {
    const char *msg = sdm_op_check(s);
    if (msg) sdm_die("sdm_op: unsupported shape (B=%d T=%d H=%d N=%d d=%d W=%d R=%d C=%d): %s", s->B, s->T, s->H,
                     s->N, s->d, s->W, s->R, s->C, msg);
}

static inline size_t sdm_op_tile_smem(const OpArgs &a) { return (size_t)2 * a.C * a.DB * sizeof(float); }
static inline size_t sdm_op_row_smem(const OpArgs &a) { return (size_t)SDM_ROW_WARPS * a.d * sizeof(float); }
static inline dim3 sdm_op_entry_grid(const OpArgs &a, int entries) { return dim3(ceil_div(entries, SDM_ROW_WARPS), a.S); }

static inline void sdm_op_phase1(const OpArgs &a, const SdmOpInputs *in, cudaStream_t stream) {
    size_t smem = (size_t)SDM_MAX(a.C * ((a.W | 1) + (a.R | 1)), a.C * (a.C + 1) / 2) * sizeof(int);
    cudaCheck(cudaFuncSetAttribute(sdm_wy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    sdm_wy_kernel<<<dim3(a.nc, a.S), 256, smem, stream>>>(a, in->wslot, in->kappa, in->gamma, in->beta, in->rslot,
                                                          in->rho);
    cudaCheckLast();
}

// One chunk of the forward for every stream: gather, solve, scatter.
template <typename Tb>
static void sdm_op_forward_chunk(const OpArgs &a, const float *v, void *bank, float *out, int c, cudaStream_t stream) {
    size_t rs = sdm_op_row_smem(a), ts = sdm_op_tile_smem(a);
    cudaCheck(cudaFuncSetAttribute(sdm_fgather_kernel<Tb>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)rs));
    cudaCheck(cudaFuncSetAttribute(sdm_fsolve_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ts));
    sdm_fgather_kernel<Tb><<<dim3(a.C, a.S), SDM_ROW_THREADS, rs, stream>>>(a, v, (const Tb *)bank, c);
    cudaCheckLast();
    sdm_fsolve_kernel<<<dim3(a.d / a.DB, a.S), 256, ts, stream>>>(a, out, c);
    cudaCheckLast();
    sdm_fscatter_kernel<Tb><<<sdm_op_entry_grid(a, a.C * a.W), SDM_ROW_THREADS, 0, stream>>>(a, (Tb *)bank, c);
    cudaCheckLast();
}

static void sdm_op_forward(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out, void *saved,
                           cudaStream_t stream) {
    sdm_op_require(s);
    OpArgs a = sdm_op_args(s, saved, NULL);
    sdm_op_phase1(a, in, stream);
    for (int c = 0; c < a.nc; c++) {
        if (s->bank_fp32) sdm_op_forward_chunk<float>(a, in->v, bank, out, c, stream);
        else sdm_op_forward_chunk<__nv_bfloat16>(a, in->v, bank, out, c, stream);
    }
}

// The backward's launches (separate so the benchmark can time them one by one).
static inline void sdm_op_launch_token(const OpArgs &a, const void *bank, int bank_fp32, const float *G,
                                       const float *dout, int cg, int cd, cudaStream_t stream) {
    size_t smem = sdm_token_smem(a.d);
    cudaCheck(cudaFuncSetAttribute(sdm_token_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    sdm_token_kernel<<<dim3(a.C, a.S), SDM_TOK_THREADS, smem, stream>>>(a, bank, bank_fp32, G, dout, cg, cd);
    cudaCheckLast();
}
static inline void sdm_op_launch_bsolve(const OpArgs &a, const float *dout, float *dv, int c, cudaStream_t stream) {
    size_t smem = sdm_op_tile_smem(a);
    cudaCheck(cudaFuncSetAttribute(sdm_bsolve_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    sdm_bsolve_kernel<<<dim3(a.d / a.DB, a.S), 256, smem, stream>>>(a, dout, dv, c);
    cudaCheckLast();
}
static inline void sdm_op_launch_bscatter(const OpArgs &a, void *bank, int bank_fp32, float *G, const float *dout,
                                          int c, cudaStream_t stream) {
    sdm_bscatter_kernel<<<sdm_op_entry_grid(a, a.C * (a.W + a.R)), SDM_ROW_THREADS, 0, stream>>>(a, bank, bank_fp32, G,
                                                                                                  dout, c);
    cudaCheckLast();
}
static inline void sdm_op_launch_bwy(const OpArgs &a, const float *dout, const SdmOpGrads *g, cudaStream_t stream) {
    sdm_bwy_kernel<<<dim3(a.nc, a.S), 256, 0, stream>>>(a, dout, g->dkappa, g->dgamma, g->dbeta, g->drho);
    cudaCheckLast();
}

static void sdm_op_backward(const SdmOpShape *s, const SdmOpInputs *in, void *bank, const float *dout,
                            const float *dbank_final, const SdmOpGrads *g, void *saved, void *scratch,
                            cudaStream_t stream) {
    sdm_op_require(s);
    (void)in; // everything the backward needs from the inputs was saved by the forward (V - R0, weights, links)
    if (!s->training) sdm_die("sdm_op_backward: the forward must run with training = 1");
    OpArgs a = sdm_op_args(s, saved, scratch);
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

static void sdm_op_decode(const SdmOpShape *s, const SdmOpInputs *in, void *bank, float *out, cudaStream_t stream) {
    sdm_op_require(s);
    if (s->T != 1) sdm_die("sdm_op_decode: T must be 1 (got %d)", s->T);
    int S = s->B * s->H;
    if (s->bank_fp32) {
        sdm_decode_kernel<float><<<dim3(ceil_div(s->d, 32 * 4), S), 32, 0, stream>>>(*s, *in, (float *)bank, out);
    } else {
        sdm_decode_kernel<__nv_bfloat16><<<dim3(ceil_div(s->d, 32 * 8), S), 32, 0, stream>>>(*s, *in, (__nv_bfloat16 *)bank, out);
    }
    cudaCheckLast();
}

#endif
