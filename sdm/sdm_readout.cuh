// sdm/sdm_readout.cuh: the SDM layer's readout on the GPU (docs/SDM.md#readout): over rows p = token*H + h of the op
// readings o [P,d] fp32, r [P,d] (compute dtype) = sigmoid(zG) * LayerNorm_d(o) with the gate and the LayerNorm
// each optional; the backward gives the gradient of o (fp32, in place over dr), dzG into dz, and d ln_w, d ln_b
// (fp32, accumulated) from per-warp partials [2, n_warps, d] summed in a fixed order. d <= 2048, d % 4 == 0.
#ifndef SDM_SDM_READOUT_CUH
#define SDM_SDM_READOUT_CUH

#include "core/cuda_common.cuh"
#include "core/matmul.cuh"
#include "sdm/sdm_common.cuh"

// =================================================================================================================
// Readout (docs/SDM.md#readout) over rows p = token*H + h of width d: rn = LayerNorm_d(o) (shared weight/bias) or o;
// r = sigmoid(zG) * rn or rn. Forward: one block per row. Backward: one warp per row (lane L owns the float4 column
// groups L, L+32, ...), each warp walking a fixed contiguous range of rows, so the LayerNorm weight/bias gradients
// are per-warp partial sums [n_warps, d] that a deterministic column sum adds afterwards.
// =================================================================================================================

#define SDM_RO_WARPS_PER_BLOCK 4
// the backward's warps at most (H100, the flagship step's readout: 3.98 ms at 4096 warps, 4.47 at 16384)
#define SDM_RO_MAX_WARPS 4096
#define SDM_RO_MAX_D 2048

typedef struct {
    int P, d, H, ldz, col_g;
    int ln, gate;
    float eps;
    const void *ln_w, *ln_b; // [d] compute dtype
    const void *z;           // forward projections (zG)
    bool fp32;
    int n_warps, rows_per_warp;
} SdmReadoutArgs;

static inline int sdm_readout_warps(int P) { return SDM_MIN(P, SDM_RO_MAX_WARPS); }

__device__ __forceinline__ float4 sdm_ld4(const float *p) { return *(const float4 *)p; }
__device__ __forceinline__ float sdm_f4get(const float4 &v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The LayerNorm statistics of a row by one warp, lane L holding the row's float4 column groups L + 32 i in x[i]
// (zeros past d / 4): the lane's sums over i in order, then the butterfly (biased variance).
template <int NV>
__device__ __forceinline__ void sdm_ln_stats(const float4 *x, int lane, int d4, int d, float eps, float *mean,
                                             float *rstd) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) sum += (x[i].x + x[i].y) + (x[i].z + x[i].w);
    *mean = core_warp_sum(sum) / d;
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++)
        if (lane + 32 * i < d4)
            for (int j = 0; j < 4; j++) q += (sdm_f4get(x[i], j) - *mean) * (sdm_f4get(x[i], j) - *mean);
    *rstd = 1.0f / sqrtf(core_warp_sum(q) / d + eps);
}

// Forward, one block of 32 NV threads per row p: thread (warp i, lane L) owns the float4 column group L + 32 i, the
// group that lane L of one warp per row holds in its i-th register, so warp 0 forms the LayerNorm statistics from the
// groups in shared memory with that warp's arithmetic (sdm_ln_stats). Every load of the row (readings, LayerNorm
// weight and bias, gate) is issued before any is used: one memory latency, where one warp walking the row's 32 groups
// in turn waited on its scalar weight and gate loads (8 us for decode's two rows). The LayerNorm's affine step is one
// fma for every element (the warp-per-row kernel's compiled code fused it for some elements and not others, so its
// fp32 outputs differ from these by an ulp in about a quarter of the elements; its bf16 outputs matched).
template <int NV>
__global__ void __launch_bounds__(32 * NV)
    sdm_readout_forward_kernel(SdmReadoutArgs ra, const float *o, void *r, float *ln_mean, float *ln_rstd) {
    __shared__ float4 xs[32 * NV];
    __shared__ float2 stats;
    pdl_enter();
    const int p = blockIdx.x, i = threadIdx.x >> 5, lane = threadIdx.x & 31, c4 = threadIdx.x, d4 = ra.d / 4;
    const bool in = c4 < d4;
    size_t zrow = (size_t)(p / ra.H) * ra.ldz + ra.col_g + (size_t)(p % ra.H) * ra.d;
    float4 x = in ? sdm_ld4(o + (size_t)p * ra.d + 4 * c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    float w[4], b[4], zg[4];
    for (int j = 0; j < 4; j++) {
        int c = 4 * c4 + j;
        w[j] = in && ra.ln ? dtype_load(ra.ln_w, c, ra.fp32) : 1.0f;
        b[j] = in && ra.ln ? dtype_load(ra.ln_b, c, ra.fp32) : 0.0f;
        zg[j] = in && ra.gate ? dtype_load(ra.z, zrow + c, ra.fp32) : 0.0f;
    }
    xs[c4] = x;
    __syncthreads();
    if (i == 0) {
        float mean = 0.0f, rstd = 1.0f;
        if (ra.ln) {
            float4 xl[NV];
#pragma unroll
            for (int g = 0; g < NV; g++) xl[g] = xs[lane + 32 * g];
            sdm_ln_stats<NV>(xl, lane, d4, ra.d, ra.eps, &mean, &rstd);
            if (lane == 0) { ln_mean[p] = mean; ln_rstd[p] = rstd; }
        }
        if (lane == 0) stats = make_float2(mean, rstd);
    }
    __syncthreads();
    if (!in) return;
    for (int j = 0; j < 4; j++) {
        float y = sdm_f4get(x, j);
        if (ra.ln) y = fmaf((y - stats.x) * stats.y, w[j], b[j]);
        if (ra.gate) y *= sdm_sigmoid(zg[j]);
        dtype_store(r, (size_t)p * ra.d + 4 * c4 + j, y, ra.fp32);
    }
}

// From dr [P,d] (gradient of r, fp32): dout [P,d] (gradient of the op readings; may alias dr: each element is
// read and then written by the same lane), dzG into dz (gate; dz may alias the forward z the same way), and the
// per-warp LayerNorm partials: partials[warp][d] = sum drn * xhat, partials[n_warps + warp][d] = sum drn.
template <int NV>
__global__ void __launch_bounds__(32 * SDM_RO_WARPS_PER_BLOCK)
    sdm_readout_backward_kernel(SdmReadoutArgs ra, const float *o, const float *ln_mean, const float *ln_rstd,
                                const float *dr, float *dout, void *dz, float *partials) {
    pdl_enter();
    int warp = blockIdx.x * SDM_RO_WARPS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (warp >= ra.n_warps) return;
    int d4 = ra.d / 4, p0 = warp * ra.rows_per_warp, p1 = min(ra.P, p0 + ra.rows_per_warp);
    float4 acc_w[NV], acc_b[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) acc_w[i] = acc_b[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p = p0; p < p1; p++) {
        float mean = ra.ln ? ln_mean[p] : 0.0f, rstd = ra.ln ? ln_rstd[p] : 1.0f;
        size_t zrow = (size_t)(p / ra.H) * ra.ldz + ra.col_g + (size_t)(p % ra.H) * ra.d;
        float xh[NV][4], gw[NV][4];
        float sg_sum = 0.0f, sgx_sum = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            float4 xv = make_float4(0.f, 0.f, 0.f, 0.f), gv = xv;
            if (c4 < d4) { xv = sdm_ld4(o + (size_t)p * ra.d + 4 * c4); gv = sdm_ld4(dr + (size_t)p * ra.d + 4 * c4); }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int c = 4 * c4 + j;
                float x = sdm_f4get(xv, j), g = sdm_f4get(gv, j);
                xh[i][j] = ra.ln ? (x - mean) * rstd : x;
                gw[i][j] = 0.0f;
                if (c4 >= d4) continue;
                float w = ra.ln ? dtype_load(ra.ln_w, c, ra.fp32) : 1.0f;
                if (ra.gate) {
                    float rn = ra.ln ? xh[i][j] * w + dtype_load(ra.ln_b, c, ra.fp32) : x;
                    float sg = sdm_sigmoid(dtype_load(ra.z, zrow + c, ra.fp32));
                    dtype_store(dz, zrow + c, g * rn * sg * (1.0f - sg), ra.fp32);
                    g *= sg;
                }
                if (ra.ln) {
                    float *aw = (float *)&acc_w[i], *ab = (float *)&acc_b[i];
                    aw[j] += g * xh[i][j];
                    ab[j] += g;
                }
                gw[i][j] = g * w;
                sg_sum += gw[i][j];
                sgx_sum += gw[i][j] * xh[i][j];
            }
        }
        float mean_g = 0.0f, mean_gx = 0.0f;
        if (ra.ln) {
            mean_g = core_warp_sum(sg_sum) / ra.d;
            mean_gx = core_warp_sum(sgx_sum) / ra.d;
        }
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            if (c4 >= d4) continue;
            float4 v;
            float *vv = (float *)&v;
#pragma unroll
            for (int j = 0; j < 4; j++) vv[j] = ra.ln ? rstd * (gw[i][j] - mean_g - xh[i][j] * mean_gx) : gw[i][j];
            *(float4 *)(dout + (size_t)p * ra.d + 4 * c4) = v;
        }
    }
    if (ra.ln) {
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + 32 * i;
            if (c4 >= d4) continue;
            *(float4 *)(partials + (size_t)warp * ra.d + 4 * c4) = acc_w[i];
            *(float4 *)(partials + ((size_t)ra.n_warps + warp) * ra.d + 4 * c4) = acc_b[i];
        }
    }
}

// Launch the instantiation whose NV float4 groups per lane cover d (d <= 2048, d % 4 == 0).
#define SDM_RO_DISPATCH(kernel, ra, st, ...)                                                                           \
    do {                                                                                                               \
        int blocks_ = ceil_div((ra).n_warps, SDM_RO_WARPS_PER_BLOCK), thr_ = 32 * SDM_RO_WARPS_PER_BLOCK;              \
        if ((ra).d <= 128) launch_pdl(kernel<1>, blocks_, thr_, 0, st, ra, __VA_ARGS__);                               \
        else if ((ra).d <= 256) launch_pdl(kernel<2>, blocks_, thr_, 0, st, ra, __VA_ARGS__);                          \
        else if ((ra).d <= 512) launch_pdl(kernel<4>, blocks_, thr_, 0, st, ra, __VA_ARGS__);                          \
        else if ((ra).d <= 1024) launch_pdl(kernel<8>, blocks_, thr_, 0, st, ra, __VA_ARGS__);                         \
        else launch_pdl(kernel<16>, blocks_, thr_, 0, st, ra, __VA_ARGS__);                                            \
    } while (0)

static inline void sdm_readout_forward(const SdmReadoutArgs *ra, const float *o, void *r, float *ln_mean,
                                       float *ln_rstd, cudaStream_t st) {
    int nv = ra->d <= 128 ? 1 : ra->d <= 256 ? 2 : ra->d <= 512 ? 4 : ra->d <= 1024 ? 8 : 16; // float4 groups / 32
    void (*kernel)(SdmReadoutArgs, const float *, void *, float *, float *) =
        nv == 1 ? sdm_readout_forward_kernel<1> : nv == 2 ? sdm_readout_forward_kernel<2> :
        nv == 4 ? sdm_readout_forward_kernel<4> : nv == 8 ? sdm_readout_forward_kernel<8> :
        sdm_readout_forward_kernel<16>;
    launch_pdl(kernel, ra->P, 32 * nv, 0, st, *ra, o, r, ln_mean, ln_rstd);
}

// ...and, with the LayerNorm, d ln_w and d ln_b (accumulated) as column sums of the per-warp partials.
static inline void sdm_readout_backward(const SdmReadoutArgs *ra, const float *o, const float *ln_mean,
                                        const float *ln_rstd, float *dr, void *dz, float *partials, float *dln_w,
                                        float *dln_b, cudaStream_t st) {
    SDM_RO_DISPATCH(sdm_readout_backward_kernel, *ra, st, o, ln_mean, ln_rstd, dr, dr, dz, partials);
    if (ra->ln) {
        matmul_colsum(dln_w, partials, DT_FP32, ra->d, ra->n_warps, ra->d, 1, st);
        matmul_colsum(dln_b, partials + (size_t)ra->n_warps * ra->d, DT_FP32, ra->d, ra->n_warps, ra->d, 1, st);
    }
}

#endif
