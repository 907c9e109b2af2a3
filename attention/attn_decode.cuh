// attention/attn_decode.cuh: the attention decode step on the GPU (docs/MODEL.md#inference, docs/MODEL.md#attention),
// one launch: RoPE on each stream's newest q [B,n_h,d_h] and k [B,n_kv,d_h] at its position pos[b], the rotated k and
// v appended to its KV cache [B,C,n_kv,d_h] (position p lives in slot p % C), and out [B,n_h,d_h] = attention of the
// newest query over positions 0..pos[b] (the last w of them for SWA), one block per (stream, head); for a gated
// layer out = og = sigmoid(z) * o, the gate of attn_gate_forward applied in the store.
#ifndef SDM_ATTN_DECODE_CUH
#define SDM_ATTN_DECODE_CUH

#include "attention/attn_common.cuh"
#include "attention/attn_rope_gate.cuh"

// A decode step at a few streams is a chain of dependent memory round trips, so the kernel is built to have few:
// after pdl_wait, (1) pos, the newest q, k, v and z rows; (2) every cached key and value row a warp attends, all
// loads in flight at once (the positions before p: none is the slot this step writes), while the block turns q and
// k by RoPE and appends k and v to the cache; then shuffles, shared memory and one store. The newest key is attended
// from shared memory, never re-read from the cache. The old positions lo..p-1 are split into ATTN_DECODE_PIECES
// consecutive pieces, taken by the block's warps in turn; the newest position is a piece of its own. A warp attends a
// piece in batches of ATTN_DECODE_LOADS 16-byte loads of K and of V a lane (AttnDecodeMap: 8 keys a batch for bf16
// rows of 128); the pieces merge through their maxima and sums in piece order. Every sum has one order fixed by the
// position and the window: a stream's bits depend neither on the batch nor on the launch (attn_decode_warps).
// q [B,n_h,d_h] (row stride ldq), k, v [B,n_kv,d_h] (ldkv), z [B,n_h,d_h] (ldq) or NULL (not gated); out [B,n_h,d_h];
// caches [B,C,n_kv,d_h]; inv_freq [d_h/2].
#define ATTN_DECODE_PIECES 16
#define ATTN_DECODE_LOADS 4

// How a warp's lanes hold K and V rows: lane l holds the 16-byte chunk c = l % LPR (elements c*VEC ..) of row slot
// r = l / LPR of each load, so a warp load covers RPL consecutive positions, a batch KEYS.
template <typename T, int D> struct AttnDecodeMap {
    static constexpr int VEC = 16 / sizeof(T), LPR = D / VEC, RPL = 32 / LPR, KEYS = ATTN_DECODE_LOADS * RPL;
    static_assert(LPR <= 32 && 32 % LPR == 0, "attn_decode: a row must fill whole lanes of a warp");
};

// x summed (or maxed) over the lanes whose ids differ only in the bits FROM, 2 FROM, .. below TO (powers of two): a
// butterfly, so each of those lanes gets the same bits.
template <int FROM, int TO> __device__ __forceinline__ float attn_lanes_sum(float x) {
#pragma unroll
    for (int off = FROM; off < TO; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}
template <int FROM, int TO> __device__ __forceinline__ float attn_lanes_max(float x) {
#pragma unroll
    for (int off = FROM; off < TO; off *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

// kr, vr = this lane's chunks of the K, V rows of the batch of positions s, s+1, .. (AttnDecodeMap), zero past s1.
template <typename T, int D>
__device__ __forceinline__ void attn_decode_load(uint4 (&kr)[ATTN_DECODE_LOADS], uint4 (&vr)[ATTN_DECODE_LOADS],
                                                 const AttnKvRows<T> &kv, int s, int s1) {
    typedef AttnDecodeMap<T, D> Map;
    int lane = threadIdx.x % 32, r = lane / Map::LPR, c = lane % Map::LPR;
#pragma unroll
    for (int u = 0; u < ATTN_DECODE_LOADS; u++) {
        int t = s + u * Map::RPL + r;
        if (t <= s1) {
            kr[u] = *(const uint4 *)(kv.krow(t) + c * Map::VEC);
            vr[u] = *(const uint4 *)(kv.vrow(t) + c * Map::VEC);
        } else {
            kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
        }
    }
}

// Online softmax over one batch (positions s.., up to s1) of a warp's piece. m (the running maximum score, base 2)
// is the same in every lane; l and o (elements c*VEC .. of the weighted sum of V rows) are this lane's row slot's
// share, added over the slots when the piece ends.
template <typename T, int D>
__device__ __forceinline__ void attn_decode_attend(const T *q_rot, const uint4 (&kr)[ATTN_DECODE_LOADS],
                                                   const uint4 (&vr)[ATTN_DECODE_LOADS], int s, int s1,
                                                   float scale_log2, float &m, float &l, float (&o)[16 / sizeof(T)]) {
    typedef AttnDecodeMap<T, D> Map;
    int r = threadIdx.x % 32 / Map::LPR, c = threadIdx.x % Map::LPR;
    const uint4 q = *(const uint4 *)(q_rot + c * Map::VEC); // from shared memory each batch: registers are scarce
    float sc[ATTN_DECODE_LOADS], mb = -INFINITY;
#pragma unroll
    for (int u = 0; u < ATTN_DECODE_LOADS; u++) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < Map::VEC; e++) d = fmaf(dtype_unpack16<T>(q, e), dtype_unpack16<T>(kr[u], e), d);
        sc[u] = attn_lanes_sum<1, Map::LPR>(d);
    }
#pragma unroll
    for (int u = 0; u < ATTN_DECODE_LOADS; u++) {
        sc[u] = s + u * Map::RPL + r <= s1 ? sc[u] * scale_log2 : -INFINITY; // past the piece: weight 0
        mb = fmaxf(mb, sc[u]);
    }
    float m_new = fmaxf(m, attn_lanes_max<Map::LPR, 32>(mb)), alpha = exp2f(m - m_new);
    l *= alpha;
#pragma unroll
    for (int e = 0; e < Map::VEC; e++) o[e] *= alpha;
#pragma unroll
    for (int u = 0; u < ATTN_DECODE_LOADS; u++) {
        float p = exp2f(sc[u] - m_new);
        l += p;
#pragma unroll
        for (int e = 0; e < Map::VEC; e++) o[e] = fmaf(p, dtype_unpack16<T>(vr[u], e), o[e]);
    }
    m = m_new;
}

// The block's newest rows (threads < d_h): q_rot, k_new = q (head j) and k (kv head g) turned by RoPE at position p
// with attn_rope's bits, v_new = v, in shared memory; k_new, v_new also to the cache rows kslot, vslot.
template <typename T, int D>
__device__ __forceinline__ void attn_decode_append(const T *qrow, const T *krow, const T *vrow, T *kslot, T *vslot,
                                                   int p, const float *inv_freq, T *q_rot, T *k_new, T *v_new) {
    int i = threadIdx.x;
    if (i < D / 2) {
        float sn, cs, y0, y1;
        sincosf((float)p * inv_freq[i], &sn, &cs);
        attn_rope_turn(dtype_to_float(qrow[2 * i]), dtype_to_float(qrow[2 * i + 1]), sn, cs, y0, y1);
        q_rot[2 * i] = dtype_from_float<T>(y0);
        q_rot[2 * i + 1] = dtype_from_float<T>(y1);
        attn_rope_turn(dtype_to_float(krow[2 * i]), dtype_to_float(krow[2 * i + 1]), sn, cs, y0, y1);
        kslot[2 * i] = k_new[2 * i] = dtype_from_float<T>(y0);
        kslot[2 * i + 1] = k_new[2 * i + 1] = dtype_from_float<T>(y1);
    }
    if (i < D) vslot[i] = v_new[i] = vrow[i];
}

// One block of W warps per (stream b, head j); warp w attends pieces w, w + W, ...; see above.
template <typename T, int D, int W>
__global__ void __launch_bounds__(32 * W, 32 / W)
attn_decode_kernel(const T *q, const T *k, const T *v, const T *z, int ldq, int ldkv, T *kc, T *vc, T *out,
                   const int *pos, const float *inv_freq, int nh, int nkv, int C, int window, float scale_log2) {
    typedef AttnDecodeMap<T, D> Map;
    constexpr int PC = ATTN_DECODE_PIECES;
    static_assert(32 * W >= D && PC % W == 0, "attn_decode: a thread per element of a row, whole pieces a warp");
    __shared__ __align__(16) float part_o[PC][D]; // each piece's unnormalised output
    __shared__ float part_m[PC + 1], part_l[PC];  // its maximum score (base 2; [PC]: the newest key's) and sum
    __shared__ __align__(16) T q_rot[D], k_new[D], v_new[D];
    pdl_enter();
    const int bh = blockIdx.x, j = bh % nh, b = bh / nh, g = j / (nh / nkv), p = pos[b];
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    const float zc = z && threadIdx.x < D ? dtype_to_float(z[(size_t)b * ldq + j * D + threadIdx.x]) : 0.0f;
    // piece u is the old positions lo + u per .. of lo..p-1; the first batch of warp w's first piece is loaded
    // before the append
    const int lo = attn_first_key_dev(p, window), per = (p - lo + PC - 1) / PC;
    const size_t row = (size_t)nkv * D, head = ((size_t)b * C * nkv + g) * D;
    const AttnKvRows<T> kv = {kc + head, vc + head, row, C};
    uint4 kr[ATTN_DECODE_LOADS], vr[ATTN_DECODE_LOADS];
    attn_decode_load<T, D>(kr, vr, kv, lo + w * per, min(p - 1, lo + w * per + per - 1));
    attn_decode_append<T, D>(q + (size_t)b * ldq + j * D, k + (size_t)b * ldkv + g * D, v + (size_t)b * ldkv + g * D,
                             kc + head + (size_t)(p % C) * row, vc + head + (size_t)(p % C) * row, p, inv_freq, q_rot,
                             k_new, v_new);
    __syncthreads(); // q_rot, k_new, v_new are visible to every warp
    if (w == W - 1) { // the newest key's score (this warp's last piece is the shortest)
        float d = 0.0f;
        for (int i = lane; i < D; i += 32) d = fmaf(dtype_to_float(q_rot[i]), dtype_to_float(k_new[i]), d);
        d = attn_lanes_sum<1, 32>(d);
        if (lane == 0) part_m[PC] = d * scale_log2;
    }
    for (int u = w; u < PC; u += W) {
        const int s0 = lo + u * per, s1 = min(p - 1, s0 + per - 1);
        float o[Map::VEC] = {}, m = -INFINITY, l = 0.0f; // an empty piece weighs nothing
        for (int s = s0; s <= s1; s += Map::KEYS) {
            if (s != s0 || u != w) attn_decode_load<T, D>(kr, vr, kv, s, s1);
            attn_decode_attend<T, D>(q_rot, kr, vr, s, s1, scale_log2, m, l, o);
        }
        l = attn_lanes_sum<Map::LPR, 32>(l);
#pragma unroll
        for (int e = 0; e < Map::VEC; e++) o[e] = attn_lanes_sum<Map::LPR, 32>(o[e]);
        if (lane < Map::LPR)
#pragma unroll
            for (int e = 0; e < Map::VEC; e++) part_o[u][lane * Map::VEC + e] = o[e];
        if (lane == 0) {
            part_m[u] = m;
            part_l[u] = l;
        }
    }
    __syncthreads();
    const int i = threadIdx.x;
    if (i >= D) return;
    float mx = part_m[PC];
    for (int u = 0; u < PC; u++) mx = fmaxf(mx, part_m[u]);
    float num = 0.0f, den = 0.0f;
    for (int u = 0; u < PC; u++) {
        float e = exp2f(part_m[u] - mx); // 0 for an empty piece, whose sums are 0
        den += e * part_l[u];
        num += e * part_o[u][i];
    }
    float e = exp2f(part_m[PC] - mx);
    den += e;
    num += e * dtype_to_float(v_new[i]);
    T oi = dtype_from_float<T>(num / den);
    out[(size_t)bh * D + i] = z ? dtype_from_float<T>(core_sigmoid_gate(zc, dtype_to_float(oi))) : oi;
}

// Warps a block: 16 while the B n_h blocks fit two to an SM (at 64 registers), else 8, four to an SM, so that the
// grid stays one wave (the flagship at batch 32: 512 blocks, 14.9 -> 12.3 us on the H200; at batch 1 16 warps are
// faster, 3.8 against 4.2 us). The pieces, hence the bits, are the same either way.
static inline int attn_decode_warps(int blocks) { return blocks <= 2 * core_sm_count() ? 16 : 8; }

template <typename T, int D>
static inline void attn_decode_launch(const AttnDims *a, int B, const AttnRope *r, const void *q, const void *k,
                                      const void *v, const void *z, int ldq, int ldkv, void *kc, void *vc, int C,
                                      const int *pos, void *out, cudaStream_t st) {
    int blocks = B * a->n_heads;
    auto kernel = attn_decode_warps(blocks) == 16 ? attn_decode_kernel<T, D, 16> : attn_decode_kernel<T, D, 8>;
    launch_pdl(kernel, (unsigned)blocks, 32 * attn_decode_warps(blocks), 0, st, (const T *)q, (const T *)k,
               (const T *)v, (const T *)z, ldq, ldkv, (T *)kc, (T *)vc, (T *)out, pos, (const float *)r->inv_freq,
               a->n_heads, a->n_kv_heads, C, a->window, ATTN_LOG2E / sqrtf((float)D));
    cudaCheckLast();
}

// Decode step of B streams: the newest token's q [B,n_h,d_h] (row stride ldq), k, v [B,n_kv,d_h] (row stride ldkv;
// before RoPE) at positions pos[b] (device): k, v appended to the caches [B,C,n_kv,d_h] after RoPE, out [B,n_h,d_h]
// = attention of q over positions 0..pos[b], or with z [B,n_h,d_h] (row stride ldq; NULL: none) the gated og =
// sigmoid(z) * that attention, the bits of attn_gate_forward on it. SWA needs C >= w, full attention C > pos[b] (the
// caller checks).
static inline void attn_decode(const AttnDims *a, int B, Dtype dt, const AttnRope *r, const void *q, const void *k,
                               const void *v, const void *z, int ldq, int ldkv, void *k_cache, void *v_cache, int C,
                               const int *pos, void *out, cudaStream_t st) {
    attn_check_dims(a);
    if (a->window > 0 && C < a->window)
        sdm_die("attention: KV cache of %d entries is shorter than the window %d", C, a->window);
    if (r->head_dim != a->head_dim)
        sdm_die("attention: RoPE table for head_dim %d used with %d", r->head_dim, a->head_dim);
    if (B == 0) return;
    auto launch = dt == DT_BF16 ? (a->head_dim == 64 ? attn_decode_launch<bf16, 64> : attn_decode_launch<bf16, 128>)
                                : (a->head_dim == 64 ? attn_decode_launch<float, 64> : attn_decode_launch<float, 128>);
    launch(a, B, r, q, k, v, z, ldq, ldkv, k_cache, v_cache, C, pos, out, st);
}

#endif
