// sdm/sdm_op_common.cuh: what the kernels of the GPU SDM memory op share (docs/SDM.md#the-recurrence to
// docs/SDM.md#decode-and-prefill): 16-byte bank vectors (SdmBankVec: 4 fp32 or 8 bf16 values), 4-wide row loads/stores
// of a bf16 or fp32 row, the snapshot storage of the backward (none/bf16/fp8/int4 rows, fp8/int4 with one fp32 scale
// per 32 columns), SdmOpArgs (every pointer into `saved` / `scratch` at the offsets of sdm_op_layout in sdm/sdm_op.h,
// by value), the token-major offset of (stream, token) in a [B,T,H,width] array, and the host helpers every entry point
// uses (shape check, smem sizes). Streams are s = b*H + h (S = B*H); per-entry arrays are [S][Tp][W] / [S][Tp][R],
// per-chunk C x C arrays [S][nc][C][C], per-chunk rows [S][C][d] (see SdmOpLayout).
#ifndef SDM_SDM_OP_COMMON_CUH
#define SDM_SDM_OP_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <limits.h>

#include "core/cuda_common.cuh"
#include "core/wgmma.cuh"
#include "sdm/sdm_op.h"

// ------------------------------------------------------------------------------------------------------------------
// Small device helpers

// VEC consecutive bank elements = 16 bytes
template <typename Tb> struct SdmBankVec;
template <> struct SdmBankVec<float> {
    static constexpr int V = 4;
    __device__ static void unpack(uint4 r, float *x) {
        x[0] = __uint_as_float(r.x);
        x[1] = __uint_as_float(r.y);
        x[2] = __uint_as_float(r.z);
        x[3] = __uint_as_float(r.w);
    }
    __device__ static uint4 pack(const float *x) {
        return make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
    }
    __device__ static void load(const float *p, float *x) {
        float4 a = *(const float4 *)p;
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    }
    __device__ static void store(float *p, const float *x) { *(float4 *)p = make_float4(x[0], x[1], x[2], x[3]); }
};
template <> struct SdmBankVec<__nv_bfloat16> {
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
    __device__ static uint4 pack(const float *x) {
        uint4 a;
        __nv_bfloat162 *h = (__nv_bfloat162 *)&a;
        for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
        return a;
    }
    __device__ static void store(__nv_bfloat16 *p, const float *x) { *(uint4 *)p = pack(x); }
};

// 8 consecutive elements of a row of T (16 or 32 bytes; p 16-byte aligned)
template <typename T> __device__ __forceinline__ void sdm_load8(const T *p, float *x) {
    for (int i = 0; i < 8; i += SdmBankVec<T>::V) SdmBankVec<T>::load(p + i, x + i);
}
template <typename T> __device__ __forceinline__ void sdm_store8(T *p, const float *x) {
    for (int i = 0; i < 8; i += SdmBankVec<T>::V) SdmBankVec<T>::store(p + i, x + i);
}
// the same for a bf16 or fp32 row chosen at run time, columns [col, col+8)
__device__ __forceinline__ void sdm_load8_any(const void *row, int col, bool fp32, float *x) {
    if (fp32) sdm_load8((const float *)row + col, x);
    else sdm_load8((const __nv_bfloat16 *)row + col, x);
}
__device__ __forceinline__ void sdm_store8_any(void *row, int col, const float *x, bool fp32) {
    if (fp32) sdm_store8((float *)row + col, x);
    else sdm_store8((__nv_bfloat16 *)row + col, x);
}
__device__ __forceinline__ float sdm_dot8(const float *a, const float *b, float acc) {
    for (int i = 0; i < 8; i++) acc = fmaf(a[i], b[i], acc);
    return acc;
}
// y += a x over 8 fp32 values at p (32 bytes, 16-byte aligned)
__device__ __forceinline__ void sdm_axpy8(float a, const float *p, float *y) {
    float x[8];
    sdm_load8(p, x);
    for (int i = 0; i < 8; i++) y[i] = fmaf(a, x[i], y[i]);
}
__device__ __forceinline__ void sdm_store4_any(void *row, int col, float4 x, bool fp32) {
    if (fp32) { *(float4 *)((float *)row + col) = x; return; }
    __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
    uint2 a;
    a.x = *(uint32_t *)&lo;
    a.y = *(uint32_t *)&hi;
    *(uint2 *)((__nv_bfloat16 *)row + col) = a;
}
__device__ __forceinline__ float4 sdm_axpy4(float a, float4 x, float4 y) {
    return make_float4(fmaf(a, x.x, y.x), fmaf(a, x.y, y.y), fmaf(a, x.z, y.z), fmaf(a, x.w, y.w));
}

// Where the snapshot rows live: payload [S][Tp][W] rows of row_bytes, fp8/int4 scales [S][Tp][W][n_scales], one per
// SDM_SNAP_SCALE_COLS columns.
struct SdmSnapView {
    char *data;
    float *scale;
    int mode, bank_fp32, n_scales;
    size_t row_bytes;
};

// Store VEC values of snapshot row e at columns [col, col+V); `lanes` consecutive lanes of the warp hold the
// SDM_SNAP_SCALE_COLS columns of one scale block. Every lane of the warp must call it (shuffles).
template <int V>
__device__ void sdm_snap_store(const SdmSnapView &sv, size_t e, int col, const float *x, bool active, int lanes) {
    char *row = sv.data + e * sv.row_bytes;
    if (sv.mode == SDM_SNAP_NONE || sv.mode == SDM_SNAP_BF16) {
        if (!active) return;
        if (sv.mode == SDM_SNAP_NONE && sv.bank_fp32) {
            for (int i = 0; i < V; i += 4)
                *(float4 *)((float *)row + col + i) = make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]);
        } else {
            for (int i = 0; i < V; i += 4)
                sdm_store4_any(row, col + i, make_float4(x[i], x[i + 1], x[i + 2], x[i + 3]), false);
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
    if (col % SDM_SNAP_SCALE_COLS == 0) sv.scale[e * sv.n_scales + col / SDM_SNAP_SCALE_COLS] = scale;
    if (fp8) {
        for (int i = 0; i < V; i++)
            ((__nv_fp8_storage_t *)row)[col + i] = __nv_cvt_float_to_fp8(x[i] * inv, __NV_SATFINITE, __NV_E4M3);
    } else {
        for (int i = 0; i < V; i += 2) {
            int hi = (int)fminf(fmaxf(rintf(x[i] * inv), -8.f), 7.f),
                lo = (int)fminf(fmaxf(rintf(x[i + 1] * inv), -8.f), 7.f);
            ((uint8_t *)row)[(col + i) / 2] = (uint8_t)(((hi & 15) << 4) | (lo & 15));
        }
    }
}

// 8 values of snapshot row e at columns [col, col+8), dequantised (col a multiple of 8: one scale block; 16-, 8- or
// 4-byte loads)
__device__ __forceinline__ void sdm_snap_load8(const SdmSnapView &sv, size_t e, int col, float *x) {
    const char *row = sv.data + e * sv.row_bytes;
    if (sv.mode == SDM_SNAP_NONE || sv.mode == SDM_SNAP_BF16) {
        sdm_load8_any(row, col, sv.mode == SDM_SNAP_NONE && sv.bank_fp32, x);
        return;
    }
    float s = sv.scale[e * sv.n_scales + col / SDM_SNAP_SCALE_COLS];
    if (sv.mode == SDM_SNAP_FP8) {
        uint2 raw = *(const uint2 *)(row + col);
        const __nv_fp8_storage_t *q = (const __nv_fp8_storage_t *)&raw;
        for (int i = 0; i < 8; i++) x[i] = __half2float(__half(__nv_cvt_fp8_to_halfraw(q[i], __NV_E4M3))) * s;
    } else {
        uint32_t raw = *(const uint32_t *)(row + col / 2); // byte i (bits 8i..8i+7): columns col + 2i, col + 2i + 1
        for (int i = 0; i < 4; i++) {
            uint32_t b = (raw >> (8 * i)) & 255u;
            x[2 * i] = (float)((int)(b << 24) >> 28) * s;     // high nibble, sign-extended
            x[2 * i + 1] = (float)((int)(b << 28) >> 28) * s; // low nibble
        }
    }
}

// Everything the kernels need about the layout, by value.
struct SdmOpArgs {
    int B, T, H, N, d, W, R, C, nc, Tp, DB, S, training;
    // phase-1 arrays (saved)
    int *w_slot, *w_prev, *w_next, *w_lastread;
    float *w_kappa, *w_lam, *w_gath, *w_scat, *w_pi, *w_elam_tot;
    int *r_slot, *r_prevw, *r_prevr, *r_nextr, *r_nearw;
    float *r_rho, *r_lam, *r_gath, *beta, *A, *Sm, *Linv, *cx, *ce, *cdelta, *delta, *u;
    SdmSnapView snap;
    char *wy_work; // phase 1's working sets in global memory ([S][nc] of sdm_wy_layout bytes), or NULL: shared memory
    // backward scratch
    float *wsum, *dx, *omega, *eta, *psi, *phi, *dmu, *dlamr;
    int *later_snap; // [S][N]: per slot, the write entry whose snapshot holds the row after the chunk, or -1
    char *bwy_work; // the backward WY kernel's working sets in global memory ([S][nc] of sdm_bwy_layout), or NULL
};

static inline SdmOpArgs sdm_op_args(const SdmOpShape *s, void *saved, void *scratch) {
    SdmOpLayout L = sdm_op_layout(s);
    SdmOpArgs a;
    memset(&a, 0, sizeof(a));
    a.B = s->B; a.T = s->T; a.H = s->H; a.N = s->N; a.d = s->d; a.W = s->W; a.R = s->R;
    a.C = L.C; a.nc = L.nc; a.Tp = L.Tp; a.DB = L.DB; a.S = L.S; a.training = s->training;
    char *sv = (char *)saved;
#define SDM_OP_PTR(field, type) a.field = (type *)(sv + L.field)
    SDM_OP_PTR(w_slot, int); SDM_OP_PTR(w_prev, int); SDM_OP_PTR(w_next, int); SDM_OP_PTR(w_lastread, int);
    SDM_OP_PTR(w_kappa, float); SDM_OP_PTR(w_lam, float); SDM_OP_PTR(w_gath, float); SDM_OP_PTR(w_scat, float);
    SDM_OP_PTR(w_pi, float); SDM_OP_PTR(w_elam_tot, float);
    SDM_OP_PTR(r_slot, int);
    SDM_OP_PTR(r_prevw, int);
    SDM_OP_PTR(r_prevr, int);
    SDM_OP_PTR(r_nextr, int);
    SDM_OP_PTR(r_nearw, int);
    SDM_OP_PTR(r_rho, float); SDM_OP_PTR(r_lam, float); SDM_OP_PTR(r_gath, float); SDM_OP_PTR(beta, float);
    SDM_OP_PTR(A, float); SDM_OP_PTR(Sm, float); SDM_OP_PTR(Linv, float);
    SDM_OP_PTR(cx, float); SDM_OP_PTR(ce, float); SDM_OP_PTR(cdelta, float);
    if (s->training) {
        SDM_OP_PTR(delta, float); SDM_OP_PTR(u, float);
        a.snap.data = sv + L.snap;
        a.snap.scale = (float *)(sv + L.snap_scale);
    }
    a.snap.mode = s->snapshot; a.snap.bank_fp32 = s->bank_fp32; a.snap.n_scales = (int)sdm_op_snap_scales(s);
    a.snap.row_bytes = sdm_op_snap_row_bytes(s);
    a.wy_work = L.wy_work_bytes ? sv + L.wy_work : NULL;
    if (scratch) {
        sv = (char *)scratch;
        SDM_OP_PTR(wsum, float); SDM_OP_PTR(dx, float); SDM_OP_PTR(omega, float); SDM_OP_PTR(eta, float);
        SDM_OP_PTR(psi, float); SDM_OP_PTR(phi, float); SDM_OP_PTR(dmu, float); SDM_OP_PTR(dlamr, float);
        SDM_OP_PTR(later_snap, int);
        a.bwy_work = L.bwy_work_bytes ? sv + L.bwy_work : NULL;
    }
#undef SDM_OP_PTR
    return a;
}

// Token-major offset of (stream s, token t) in a [B,T,H,width] array.
__device__ __forceinline__ size_t sdm_tok_off(const SdmOpArgs &a, int s, int t, int width) {
    int b = s / a.H, h = s % a.H;
    return (((size_t)b * a.T + t) * a.H + h) * (size_t)width;
}

// Threads of the whole-row kernels (one warp per token row or per entry): fgather, fscatter, token, bscatter.
#define SDM_ROW_THREADS 256
#define SDM_ROW_WARPS (SDM_ROW_THREADS / 32)

// ------------------------------------------------------------------------------------------------------------------
// Whole-row gathers (forward over the bank, backward over the bank gradient)

#define SDM_GQ 4 // 16-byte row vectors per lane accumulated in registers per pass (one pass covers 32 * 4 * V columns)
#ifndef SDM_GE
#define SDM_GE 2 // entries whose rows a warp loads together (an A/B knob; 3 lost on an H100: 9.82 against 9.68 ms)
#endif
static_assert(32 % SDM_GE == 0, "SDM_GE divides a warp's 32 slots loaded ahead");
// The gathers' slots and weights loaded 32 entries a warp ahead (1) or each just before its rows (0, an A/B knob).
// H100 flagship step, graph steps in two runs: 417.4 / 417.6 against 419.7 / 419.4 ms (op forward -1.3 ms, backward
// -0.7), the same losses; not yet timed on the H200.
#ifndef SDM_SLOTS_AHEAD
#define SDM_SLOTS_AHEAD 1
#endif

// part[col] = sum over the entries k = warp, warp + warps, ... of gath[k] * row(slot[k])[col] (whole rows; `part` is
// the calling warp's partial row); `snap` stores each row's snapshot; with dot_row (d floats, any memory) also
// dots[e0 + k] = <dot_row, row(slot[k])> (0 for padding). The sums live in registers for SDM_GQ vectors per lane
// (wider rows take several passes over the entries, each over other columns; a dot adds its passes in order), SDM_GE
// entries' loads in flight. Used by the forward over the bank and by the backward over the bank gradient.
template <typename Tb>
__device__ __forceinline__ void sdm_gather_whole_rows(const SdmOpArgs &a, const Tb *M, const int *slots,
                                                      const float *gath, size_t e0, int n, float *part, bool snap,
                                                      const float *dot_row = NULL, float *dots = NULL) {
    constexpr int V = SdmBankVec<Tb>::V;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nq = (a.d + 32 * V - 1) / (32 * V);
    for (int q0 = 0; q0 < nq; q0 += SDM_GQ) {
        float acc[SDM_GQ][V];
#pragma unroll
        for (int u = 0; u < SDM_GQ; u++)
            for (int i = 0; i < V; i++) acc[u][i] = 0.f;
        // the slots and weights of the warp's next 32 entries, one a lane, loaded before their rows are needed: a
        // row's load then waits on a shuffle, not on a dependent global load (-1 past n and for padding)
        int ahead_sl = -1;
        float ahead_g = 0.f;
        for (int k0 = warp; k0 < n; k0 += SDM_GE * SDM_ROW_WARPS) {
            const int lead = (k0 - warp) / SDM_ROW_WARPS; // the entry k0's index among the warp's entries
            if (SDM_SLOTS_AHEAD && lead % 32 == 0) {
                int ka = k0 + lane * SDM_ROW_WARPS;
                ahead_sl = ka < n ? slots[e0 + ka] : -1;
                ahead_g = ahead_sl >= 0 ? gath[e0 + ka] : 0.f;
            }
            int k[SDM_GE], sl[SDM_GE];
            float g[SDM_GE], pd[SDM_GE];
#pragma unroll
            for (int j = 0; j < SDM_GE; j++) k[j] = k0 + j * SDM_ROW_WARPS, pd[j] = 0.f;
            uint4 raw[SDM_GE][SDM_GQ];
#pragma unroll
            for (int j = 0; j < SDM_GE; j++) {
                if (SDM_SLOTS_AHEAD) {
                    sl[j] = __shfl_sync(0xffffffffu, ahead_sl, (lead + j) % 32); // warp-uniform
                    g[j] = __shfl_sync(0xffffffffu, ahead_g, (lead + j) % 32);
                } else {
                    sl[j] = k[j] < n ? slots[e0 + k[j]] : -1; // -1 also for padding: warp-uniform
                    g[j] = sl[j] >= 0 ? gath[e0 + k[j]] : 0.f;
                }
#pragma unroll
                for (int u = 0; u < SDM_GQ; u++) {
                    int col = ((q0 + u) * 32 + lane) * V;
                    if (sl[j] >= 0 && q0 + u < nq && col < a.d)
                        raw[j][u] = *(const uint4 *)(M + (size_t)sl[j] * a.d + col);
                }
            }
#pragma unroll
            for (int j = 0; j < SDM_GE; j++)
#pragma unroll
                for (int u = 0; u < SDM_GQ; u++) {
                    int col = ((q0 + u) * 32 + lane) * V;
                    if (sl[j] < 0 || q0 + u >= nq) continue; // warp-uniform
                    bool on = col < a.d;
                    float x[V];
                    if (on) {
                        SdmBankVec<Tb>::unpack(raw[j][u], x);
                        for (int i = 0; i < V; i++) acc[u][i] = fmaf(g[j], x[i], acc[u][i]);
                        if (dot_row)
                            for (int i = 0; i < V; i++) pd[j] = fmaf(dot_row[col + i], x[i], pd[j]);
                    }
                    if (snap) sdm_snap_store<V>(a.snap, e0 + k[j], col, x, on, SDM_SNAP_SCALE_COLS / V);
                }
            if (dot_row)
                for (int j = 0; j < SDM_GE; j++) {
                    if (k[j] >= n) continue; // warp-uniform
                    float p = core_warp_sum(pd[j]);
                    if (lane == 0) dots[e0 + k[j]] = (q0 > 0 ? dots[e0 + k[j]] : 0.f) + p;
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

// The forward's gather over the bank (fgather) by bulk copies (sdm_gather_rows_bulk), SDM_GATHER_STAGES rows in
// flight a warp: SDM_FWD_LAUNCHES_BULK, and the default of the launches where SDM_GATHER_BULK is 1 (0: the rows in
// registers, sdm_gather_whole_rows, as the persistent path and GPUs before sm_90 keep). H100, `bench_sdm_op 3
// flagship` (B = 8): fgather 10.19 ms with registers, 9.72 with 4 stages, 11.01 with 8; in the flagship step (int4
// snapshots, B = 4, step-ab) the op forward 50.0 -> 47.6 ms and the step 423.6 -> 420.4 ms with 4 stages, the same
// losses. Not yet timed on an H200.
#ifndef SDM_GATHER_STAGES
#define SDM_GATHER_STAGES 4
#endif
#ifndef SDM_GATHER_BULK
#define SDM_GATHER_BULK 1
#endif
static_assert(SDM_GATHER_STAGES >= 0 && SDM_GATHER_STAGES <= 12, "8 warps' rings of 2 KB rows in a block's smem");
#ifdef CORE_HAVE_WGMMA // bulk copies need sm_90
#define SDM_GATHER_BULK_STAGES SDM_GATHER_STAGES
#else
#define SDM_GATHER_BULK_STAGES 0
#endif

#ifdef CORE_HAVE_WGMMA
// sdm_gather_whole_rows for rows of at most 32 SDM_GQ V values (one pass), with the same sums in the same order (the
// same bits), but each of the warp's entries' rows comes into the warp's ring `stage` of STAGES rows of d Tb by a bulk
// copy that lane 0 issues STAGES entries ahead, completing on the stage's mbarrier (`bars`: STAGES of them, 8 bytes
// apart, shared memory): the row bytes in flight are bounded by shared memory, not by registers. The rows must be 16
// bytes aligned (d Tb a multiple of 16 bytes). part: d floats of the warp's sum (may alias `stage`: written last).
template <typename Tb, int STAGES>
__device__ __forceinline__ void sdm_gather_rows_bulk(const SdmOpArgs &a, const Tb *M, const int *slots,
                                                     const float *gath, size_t e0, int n, Tb *stage, uint32_t bars,
                                                     float *part, bool snap) {
    constexpr int V = SdmBankVec<Tb>::V;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nq = (a.d + 32 * V - 1) / (32 * V);
    const int nw = n > warp ? (n - warp + SDM_ROW_WARPS - 1) / SDM_ROW_WARPS : 0; // entries warp + i warps, i < nw
    const uint32_t row_bytes = (uint32_t)(a.d * sizeof(Tb)), stage_s = (uint32_t)__cvta_generic_to_shared(stage);
    if (lane < STAGES) wg_bar_init(bars + 8 * lane, 1);
    wg_bar_init_fence();
    __syncwarp();
    // the slots of the warp's entries 32 at a time, one a lane: the copies' (issued STAGES entries ahead) and the
    // sums' (with the weights)
    int copy_sl = -1, sum_sl = -1;
    float sum_g = 0.f;
    auto issue = [&](int i) { // entry i's copy into stage i % STAGES; a padding entry only completes its phase
        if (i % 32 == 0) copy_sl = i + lane < nw ? slots[e0 + warp + (size_t)(i + lane) * SDM_ROW_WARPS] : -1;
        int sl = __shfl_sync(0xffffffffu, copy_sl, i % 32);
        if (lane != 0 || i >= nw) return;
        uint32_t bar = bars + 8 * (i % STAGES);
        if (sl < 0) { wg_bar_arrive(bar); return; }
        wg_bar_expect(bar, row_bytes);
        wg_bulk_load(stage_s + (i % STAGES) * row_bytes, M + (size_t)sl * a.d, row_bytes, bar);
    };
    for (int i = 0; i < STAGES; i++) issue(i);
    float acc[SDM_GQ][V];
#pragma unroll
    for (int u = 0; u < SDM_GQ; u++)
        for (int i = 0; i < V; i++) acc[u][i] = 0.f;
    for (int i = 0; i < nw; i++) {
        if (i % 32 == 0) {
            size_t e = e0 + warp + (size_t)(i + lane) * SDM_ROW_WARPS;
            sum_sl = i + lane < nw ? slots[e] : -1;
            sum_g = sum_sl >= 0 ? gath[e] : 0.f;
        }
        const int sl = __shfl_sync(0xffffffffu, sum_sl, i % 32); // warp-uniform
        const float g = __shfl_sync(0xffffffffu, sum_g, i % 32);
        wg_bar_wait(bars + 8 * (i % STAGES), (i / STAGES) & 1);
        const size_t e = e0 + warp + (size_t)i * SDM_ROW_WARPS;
        if (sl >= 0) {
            const Tb *row = stage + (size_t)(i % STAGES) * a.d;
#pragma unroll
            for (int u = 0; u < SDM_GQ; u++) {
                int col = (u * 32 + lane) * V;
                if (u >= nq) continue;
                bool on = col < a.d;
                float x[V];
                if (on) {
                    SdmBankVec<Tb>::load(row + col, x);
                    for (int k = 0; k < V; k++) acc[u][k] = fmaf(g, x[k], acc[u][k]);
                }
                if (snap) sdm_snap_store<V>(a.snap, e, col, x, on, SDM_SNAP_SCALE_COLS / V);
            }
        }
        __syncwarp(); // the warp has read stage i % STAGES: refill it
        if (lane == 0) wg_fence_proxy_async();
        issue(i + STAGES);
    }
    __syncwarp(); // every lane past its last read of the ring before `part` (which may alias it) is written
#pragma unroll
    for (int u = 0; u < SDM_GQ; u++) {
        int col = (u * 32 + lane) * V;
        if (u < nq && col < a.d)
            for (int k = 0; k < V; k++) part[col + k] = acc[u][k];
    }
}
#endif

// Sums the warps' partial rows (warp w's at part + w stride) in warp order into part[0..d) (the block's total).
__device__ __forceinline__ void sdm_sum_partials(float *part, int d, int stride) {
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float x = part[i];
        for (int w = 1; w < SDM_ROW_WARPS; w++) x += part[w * stride + i];
        part[i] = x;
    }
    __syncthreads();
}
__device__ __forceinline__ void sdm_sum_partials(float *part, int d) { sdm_sum_partials(part, d, d); }

// fgather's gather of n entries from e0 into the block's summed row: the rows in registers (STAGES = 0,
// sdm_gather_whole_rows) or by bulk copies (sdm_gather_rows_bulk, sdm_gather_bulk_fits). `work`: shared memory of
// sdm_gather_work_bytes, the warps' partial rows or their rings (a partial row at its ring's start); `bars`: STAGES
// mbarriers a warp (shared memory). Returns the block's sum (work[0..d)); the arguments as sdm_gather_whole_rows's.
template <typename Tb, int STAGES> __host__ __device__ __forceinline__ int sdm_gather_work_stride(int d) {
    return STAGES ? (int)(STAGES * d * sizeof(Tb) / sizeof(float)) : d; // floats from a warp's work to the next's
}
template <typename Tb, int STAGES> static inline size_t sdm_gather_work_bytes(int d) {
    return (size_t)SDM_ROW_WARPS * sdm_gather_work_stride<Tb, STAGES>(d) * sizeof(float);
}
// Whether the bulk-copy gather takes rows of d Tb: one pass of registers, a ring at least a partial row.
template <typename Tb> static inline bool sdm_gather_bulk_fits(int d) {
    return SDM_GATHER_BULK_STAGES > 0 && d <= 32 * SDM_GQ * SdmBankVec<Tb>::V &&
           SDM_GATHER_BULK_STAGES * sizeof(Tb) >= sizeof(float);
}
template <typename Tb, int STAGES>
__device__ __forceinline__ float *sdm_gather_block_sum(const SdmOpArgs &a, const Tb *M, const int *slots,
                                                       const float *gath, size_t e0, int n, float *work,
                                                       uint32_t bars, bool snap) {
    const int stride = sdm_gather_work_stride<Tb, STAGES>(a.d);
    float *own = work + threadIdx.x / 32 * stride;
#ifdef CORE_HAVE_WGMMA
    if constexpr (STAGES > 0)
        sdm_gather_rows_bulk<Tb, STAGES>(a, M, slots, gath, e0, n, (Tb *)own, bars + threadIdx.x / 32 * 8 * STAGES,
                                         own, snap);
    else
#endif
        sdm_gather_whole_rows<Tb>(a, M, slots, gath, e0, n, own, snap);
    sdm_sum_partials(work, a.d, stride);
    return work;
}

// ------------------------------------------------------------------------------------------------------------------
// Host helpers of the entry points

static inline void sdm_op_require(const SdmOpShape *s) {
    const char *msg = sdm_op_check(s);
    if (msg) sdm_die("sdm_op: unsupported shape (B=%d T=%d H=%d N=%d d=%d W=%d R=%d C=%d): %s", s->B, s->T, s->H,
                     s->N, s->d, s->W, s->R, s->C, msg);
}

// The solves' C x C matrices (S and Linv of a chunk) in shared memory when they fit in this many bytes (C <= 89):
// their loop over u then reads shared memory instead of an L1/L2 trip per step, the solves' cost at a prefill's few
// streams (docs/SDM.md#phases-on-the-gpu); larger chunks read them from global memory. Staged rows are C + 1 floats
// apart, so the 16 rows a warp reads at one u fall in 16 banks (at a stride of C = 64 they shared one bank, which
// made staging slower than L1: measured, prefill 47.3 -> 50.5 ms).
#define SDM_SOLVE_STAGE_BYTES (64 << 10)

static inline bool sdm_op_solve_staged(const SdmOpArgs &a) {
    return (size_t)2 * a.C * (a.C + 1) * sizeof(float) <= SDM_SOLVE_STAGE_BYTES;
}

// Dynamic shared memory of the solves: two tiles [C][DB], then S and Linv [C][C + 1] when staged.
static inline size_t sdm_op_tile_smem(const SdmOpArgs &a) {
    size_t mats = sdm_op_solve_staged(a) ? (size_t)2 * a.C * (a.C + 1) * sizeof(float) : 0;
    return (size_t)2 * a.C * a.DB * sizeof(float) + mats;
}

// The chunk's S and Linv ([C][C] at element cc) for a solve: copied into shared memory at `smem` with rows ld = C + 1
// apart when `staged`, else read in place (ld = C). Call before the block's first barrier; read after it. Returns ld.
// A thread's loads (16-byte ones when C % 4 == 0) are all issued before its first store: with a prefill's few blocks
// the staging is a chain of memory latencies, and a store between two loads would order them (the compiler cannot
// tell shared from global behind the pointers). NB: 16-byte vectors of each matrix a thread has in flight at once (4
// in the solve kernels: fsolve 1.66 -> 1.29 ms, bsolve 1.94 -> 1.49 at the flagship's B = 8; 2 where registers are
// short, as in the persistent forward). Phase 1 wrote the matrices before this launch: read-only here.
template <int NB>
__device__ __forceinline__ int sdm_solve_mats(const SdmOpArgs &a, size_t cc, bool staged, float *smem,
                                              const float **Sc, const float **Li) {
    const int C = a.C, ld = C + 1;
    *Sc = a.Sm + cc;
    *Li = a.Linv + cc;
    if (!staged) return C;
    float *Ss = smem, *Ls = smem + C * ld;
    if (C % 4 == 0) {
        const int n4 = C * C / 4;
        const float4 *S4 = (const float4 *)*Sc, *L4 = (const float4 *)*Li;
        for (int i0 = threadIdx.x; i0 < n4; i0 += NB * blockDim.x) {
            float4 sv[NB], lv[NB];
#pragma unroll
            for (int j = 0; j < NB; j++) {
                int i = i0 + j * blockDim.x;
                if (i < n4) { sv[j] = __ldg(S4 + i); lv[j] = __ldg(L4 + i); }
            }
#pragma unroll
            for (int j = 0; j < NB; j++) {
                int i = i0 + j * blockDim.x, o = 4 * i / C * ld + 4 * i % C;
                if (i >= n4) continue;
                Ss[o] = sv[j].x; Ss[o + 1] = sv[j].y; Ss[o + 2] = sv[j].z; Ss[o + 3] = sv[j].w;
                Ls[o] = lv[j].x; Ls[o + 1] = lv[j].y; Ls[o + 2] = lv[j].z; Ls[o + 3] = lv[j].w;
            }
        }
    } else {
        for (int i = threadIdx.x; i < C * C; i += blockDim.x) {
            Ss[i / C * ld + i % C] = __ldg(*Sc + i);
            Ls[i / C * ld + i % C] = __ldg(*Li + i);
        }
    }
    *Sc = Ss;
    *Li = Ls;
    return ld;
}
static inline dim3 sdm_op_entry_grid(const SdmOpArgs &a, int entries) {
    return dim3(ceil_div(entries, SDM_ROW_WARPS), a.S);
}

#endif
