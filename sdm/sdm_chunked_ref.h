// sdm/sdm_chunked_ref.h: the chunked WY (UT-transform) form of the SDM memory op in double precision
// (docs/SDM.md#chunked-wy-form) and its reverse recursion over chunks (docs/SDM.md#backward). Same results as
// sdm_op_*_ref (sdm_ref.h) up to rounding, for every chunk length C. It is the blueprint of the GPU kernels, so it is
// structured the way they are:
//   Phase 1, per chunk and independent of the bank: per-slot decay scans from zero, Gram matrices A and S by two-
//            pointer merges of sorted slot lists, L = I + diag(beta) A and its inverse, loop-invariant products;
//   Phase 2, sequential over the chunk index (all B*H streams advance together): gather, small GEMMs, scatter with
//            multi-entry slots combined in a fixed order (entries sorted by (slot, time), summed serially);
//   backward Phase A, chunks in reverse: bank-gradient recursion and restoration of the bank from snapshot rows
//            (optionally with the bank gradient rounded to bf16 between chunks, as sdm.grad_bank_dtype = bf16 does);
//   backward Phase B, per chunk (batched on the GPU): Gram-matrix backward and per-slot scans into dgamma.
// Layout as sdm_ref.h: wslot, kappa, gamma [B,T,H,W]; beta [B,T,H]; v, out [B,T,H,d]; rslot, rho [B,T,H,R];
// bank [B,H,N,d]. Each (b,h) stream is padded to a multiple of C with inert tokens (kappa = rho = beta = gamma = 0,
// slots 0..W-1 and 0..R-1), never letting a chunk span two streams (docs/SDM.md#padding).
#ifndef SDM_SDM_CHUNKED_REF_H
#define SDM_SDM_CHUNKED_REF_H

#include <stdint.h>
#include <string.h>

#include "sdm/sdm_ref.h"

typedef struct {
    int C, d, W, R;
    // inputs of the chunk, local times t = 0..C-1; write entry e = t*W + w, read entry q = t*R + j
    int *ks, *qs;                  // [C*W], [C*R] slots, ascending per token
    double *kap, *gam;             // [C*W] write weights, log-decays
    double *beta;                  // [C]
    double *V;                     // [C*d]
    double *rho;                   // [C*R]
    // Phase 1 (docs/SDM.md#phases-on-the-gpu)
    int *order;                    // [C*W] write entries sorted by (slot, t): one segment per slot, in time order
    double *lam;                   // [C*W] lambda: inclusive forward sum of the slot's decays
    double *pi;                    // [C*W] exp(mu - gamma): decay of the slot after the entry, to the chunk end
    double *eLam;                  // [C*W] exp(Lambda) of the entry's slot (total chunk decay)
    double *lamr;                  // [C*R] lambda': the slot's decay sum up to the read (0 if not yet written)
    int *rsrc;                     // [C*R] position in `order` of the slot's last write entry at time <= t, or -1
    double *kw, *rw;               // [C*W] kappa e^lambda, [C*R] rho e^lambda': gather weights against M0
    double *A, *S, *Linv;          // [C*C] key-key Gram (strict lower), query-key Gram (lower), L^-1
    double *Bm, *P;                // [C*C] Bm = -L^-1 diag(beta), P = S Bm
    double *Dc, *Oc;               // [C*d] Dc = L^-1 diag(beta) V, Oc = S Dc
    // Phase 2 saves for the backward (docs/SDM.md#bank-restoration)
    double *snap;                  // [C*W*d] the chunk-start row M0[i] of every write entry
    double *Delta, *VmR0;          // [C*d] delta_t and v_t - r0_t
} SdmChunk;

static inline SdmChunk sdm_chunk_alloc(int C, int d, int W, int R) {
    size_t cw = (size_t)C * W, cr = (size_t)C * R, cc = (size_t)C * C, cd = (size_t)C * d;
    SdmChunk ch;
    ch.C = C; ch.d = d; ch.W = W; ch.R = R;
    ch.ks = (int *)sdm_malloc(sizeof(int) * cw); ch.qs = (int *)sdm_malloc(sizeof(int) * cr);
    ch.kap = sdm_ref_zeros(cw); ch.gam = sdm_ref_zeros(cw); ch.beta = sdm_ref_zeros(C); ch.V = sdm_ref_zeros(cd);
    ch.rho = sdm_ref_zeros(cr);
    ch.order = (int *)sdm_malloc(sizeof(int) * cw);
    ch.lam = sdm_ref_zeros(cw); ch.pi = sdm_ref_zeros(cw); ch.eLam = sdm_ref_zeros(cw);
    ch.lamr = sdm_ref_zeros(cr); ch.rsrc = (int *)sdm_malloc(sizeof(int) * cr);
    ch.kw = sdm_ref_zeros(cw); ch.rw = sdm_ref_zeros(cr);
    ch.A = sdm_ref_zeros(cc); ch.S = sdm_ref_zeros(cc); ch.Linv = sdm_ref_zeros(cc);
    ch.Bm = sdm_ref_zeros(cc); ch.P = sdm_ref_zeros(cc);
    ch.Dc = sdm_ref_zeros(cd); ch.Oc = sdm_ref_zeros(cd);
    ch.snap = sdm_ref_zeros(cw * d); ch.Delta = sdm_ref_zeros(cd); ch.VmR0 = sdm_ref_zeros(cd);
    return ch;
}

static inline void sdm_chunk_free(SdmChunk *ch) {
    free(ch->ks); free(ch->qs); free(ch->kap); free(ch->gam); free(ch->beta); free(ch->V); free(ch->rho);
    free(ch->order); free(ch->lam); free(ch->pi); free(ch->eLam); free(ch->lamr); free(ch->rsrc); free(ch->kw);
    free(ch->rw); free(ch->A); free(ch->S); free(ch->Linv); free(ch->Bm); free(ch->P); free(ch->Dc); free(ch->Oc);
    free(ch->snap); free(ch->Delta); free(ch->VmR0);
}

// Die unless the k slots of a token are strictly ascending in [0, N) (the merges of docs/SDM.md#gram-matrices rely on
// it).
static inline void sdm_check_slot_list(const int *slot, int k, int N) {
    for (int i = 0; i < k; i++)
        if (slot[i] < 0 || slot[i] >= N || (i > 0 && slot[i] <= slot[i - 1]))
            sdm_die("sdm chunked op: slot list not strictly ascending in [0, %d)", N);
}

// Copy chunk c of stream (b,h) from the token-major arrays, padding times past T with inert tokens
// (docs/SDM.md#padding).
static inline void sdm_chunk_load(SdmChunk *ch, int T, int H, int N, int b, int h, int c, const int *wslot,
                                  const double *kappa, const double *gamma, const double *beta, const double *v,
                                  const int *rslot, const double *rho) {
    int C = ch->C, d = ch->d, W = ch->W, R = ch->R;
    for (int t = 0; t < C; t++) {
        int tg = c * C + t;
        if (tg < T) {
            size_t ow = sdm_tok_off(T, H, b, tg, h, W), orr = sdm_tok_off(T, H, b, tg, h, R);
            sdm_check_slot_list(wslot + ow, W, N);
            sdm_check_slot_list(rslot + orr, R, N);
            memcpy(ch->ks + t * W, wslot + ow, sizeof(int) * W);
            memcpy(ch->kap + t * W, kappa + ow, sizeof(double) * W);
            memcpy(ch->gam + t * W, gamma + ow, sizeof(double) * W);
            ch->beta[t] = beta[sdm_tok_off(T, H, b, tg, h, 1)];
            memcpy(ch->V + (size_t)t * d, v + sdm_tok_off(T, H, b, tg, h, d), sizeof(double) * d);
            memcpy(ch->qs + t * R, rslot + orr, sizeof(int) * R);
            memcpy(ch->rho + t * R, rho + orr, sizeof(double) * R);
        } else {
            for (int w = 0; w < W; w++) { ch->ks[t * W + w] = w; ch->kap[t * W + w] = 0.0; ch->gam[t * W + w] = 0.0; }
            for (int j = 0; j < R; j++) { ch->qs[t * R + j] = j; ch->rho[t * R + j] = 0.0; }
            ch->beta[t] = 0.0;
            memset(ch->V + (size_t)t * d, 0, sizeof(double) * d);
        }
    }
}

// ---- Phase 1 -----------------------------------------------------------------------------------------------------

static inline int sdm_i64_cmp(const void *pa, const void *pb) {
    int64_t a = *(const int64_t *)pa, b = *(const int64_t *)pb;
    return (a > b) - (a < b);
}

// Sort the write entries by (slot, t) (docs/SDM.md#decay-sums: the segmented-scan alternative to a scratch bank).
// Key slot*n + e: within a slot, e = t*W + w orders by time (a token's slots are distinct).
static inline void sdm_chunk_sort_entries(SdmChunk *ch) {
    int n = ch->C * ch->W;
    int64_t *key = (int64_t *)sdm_malloc(sizeof(int64_t) * n);
    for (int e = 0; e < n; e++) key[e] = (int64_t)ch->ks[e] * n + e;
    qsort(key, (size_t)n, sizeof(int64_t), sdm_i64_cmp);
    for (int p = 0; p < n; p++) ch->order[p] = (int)(key[p] % n);
    free(key);
}

// End (exclusive) of the slot segment of `order` that starts at position p.
static inline int sdm_segment_end(const SdmChunk *ch, int p) {
    int n = ch->C * ch->W, slot = ch->ks[ch->order[p]];
    while (p < n && ch->ks[ch->order[p]] == slot) p++;
    return p;
}

// Position in `order` of the last write entry of `slot` at time <= t, or -1 (binary search on (slot, time)).
static inline int sdm_last_write_at_or_before(const SdmChunk *ch, int slot, int t) {
    int lo = 0, hi = ch->C * ch->W; // first position whose (slot, time) is after (slot, t)
    while (lo < hi) {
        int mid = (lo + hi) / 2, e = ch->order[mid], s = ch->ks[e];
        if (s < slot || (s == slot && e / ch->W <= t)) lo = mid + 1;
        else hi = mid;
    }
    return (lo > 0 && ch->ks[ch->order[lo - 1]] == slot) ? lo - 1 : -1;
}

// per-slot log-decay sums (docs/SDM.md#decay-sums), accumulated from zero inside the chunk, by segmented scans over
// `order`.
static inline void sdm_chunk_decay_scans(SdmChunk *ch) {
    int n = ch->C * ch->W;
    for (int p0 = 0, p1; p0 < n; p0 = p1) {
        p1 = sdm_segment_end(ch, p0);
        double lam = 0.0, after = 0.0;
        for (int p = p0; p < p1; p++) ch->lam[ch->order[p]] = (lam += ch->gam[ch->order[p]]);
        for (int p = p1 - 1; p >= p0; p--) { // pi = exp(sum of the slot's later decays) = exp(mu - gamma)
            int e = ch->order[p];
            ch->pi[e] = exp(after);
            after += ch->gam[e];
            ch->eLam[e] = exp(lam);
        }
    }
    for (int e = 0; e < n; e++) ch->kw[e] = ch->kap[e] * exp(ch->lam[e]);
    for (int q = 0; q < ch->C * ch->R; q++) { // a read at t sees the writes of times <= t (half-integer read time)
        int p = sdm_last_write_at_or_before(ch, ch->qs[q], q / ch->R);
        ch->rsrc[q] = p;
        ch->lamr[q] = p < 0 ? 0.0 : ch->lam[ch->order[p]];
        ch->rw[q] = ch->rho[q] * exp(ch->lamr[q]);
    }
}

// Visit the common slots of two ascending lists (two-pointer merge); calls fn(ctx, ia, ib) with their positions.
typedef void (*SdmMergeFn)(void *ctx, int ia, int ib);
static inline void sdm_merge_common(const int *a, int na, const int *b, int nb, SdmMergeFn fn, void *ctx) {
    for (int i = 0, j = 0; i < na && j < nb;) {
        if (a[i] < b[j]) i++;
        else if (a[i] > b[j]) j++;
        else fn(ctx, i++, j++);
    }
}

// One Gram entry: sum over common slots of w_row w_col exp(lam_row - lam_col) (docs/SDM.md#gram-matrices). Row entries
// start at row_base (weights wr, log-decays lr), column entries at col_base (weights wc, log-decays lc).
typedef struct { const double *wr, *lr, *wc, *lc; double sum; } SdmGramAcc;
static inline void sdm_gram_add(void *ctx, int ia, int ib) {
    SdmGramAcc *g = (SdmGramAcc *)ctx;
    g->sum += g->wr[ia] * g->wc[ib] * exp(g->lr[ia] - g->lc[ib]);
}

// A[t,u] (u < t) over write entries and S[t,u] (u <= t) with read rows and write columns (docs/SDM.md#gram-matrices).
static inline void sdm_chunk_gram(SdmChunk *ch) {
    int C = ch->C, W = ch->W, R = ch->R;
    for (int t = 0; t < C; t++)
        for (int u = 0; u < C; u++) {
            SdmGramAcc a = {ch->kap + t * W, ch->lam + t * W, ch->kap + u * W, ch->lam + u * W, 0.0};
            if (u < t) sdm_merge_common(ch->ks + t * W, W, ch->ks + u * W, W, sdm_gram_add, &a);
            ch->A[t * C + u] = a.sum;
            SdmGramAcc s = {ch->rho + t * R, ch->lamr + t * R, ch->kap + u * W, ch->lam + u * W, 0.0};
            if (u <= t) sdm_merge_common(ch->qs + t * R, R, ch->ks + u * W, W, sdm_gram_add, &s);
            ch->S[t * C + u] = s.sum;
        }
}

// Y[m, n] (+)= A[m, k] . X[k, n]; with transA, A is given as [k, m] and A^T is used.
static inline void sdm_matmul(int m, int k, int n, const double *A, int transA, const double *X, double *Y,
                              int accumulate) {
    if (!accumulate) memset(Y, 0, sizeof(double) * m * n);
    for (int i = 0; i < m; i++)
        for (int l = 0; l < k; l++) {
            double a = transA ? A[l * m + i] : A[i * k + l];
            if (a != 0.0) sdm_axpy(Y + (size_t)i * n, a, X + (size_t)l * n, n);
        }
}

// docs/SDM.md#per-chunk-solution: L = I + diag(beta) A, L^-1 by forward substitution against I, then the loop-invariant
// products.
static inline void sdm_chunk_solve(SdmChunk *ch) {
    int C = ch->C, d = ch->d;
    for (int col = 0; col < C; col++)
        for (int t = 0; t < C; t++) { // column col of L^-1: L x = e_col, L[t,u] = beta_t A[t,u] below the diagonal
            double x = t == col ? 1.0 : 0.0;
            for (int u = col; u < t; u++) x -= ch->beta[t] * ch->A[t * C + u] * ch->Linv[u * C + col];
            ch->Linv[t * C + col] = t < col ? 0.0 : x;
        }
    double *bV = sdm_ref_zeros((size_t)C * d); // diag(beta) V
    for (int t = 0; t < C; t++)
        for (int u = 0; u < C; u++) ch->Bm[t * C + u] = -ch->Linv[t * C + u] * ch->beta[u];
    for (int t = 0; t < C; t++) sdm_axpy(bV + (size_t)t * d, ch->beta[t], ch->V + (size_t)t * d, d);
    sdm_matmul(C, C, d, ch->Linv, 0, bV, ch->Dc, 0);
    sdm_matmul(C, C, C, ch->S, 0, ch->Bm, ch->P, 0);
    sdm_matmul(C, C, d, ch->S, 0, ch->Dc, ch->Oc, 0);
    free(bV);
}

static inline void sdm_chunk_phase1(SdmChunk *ch) {
    sdm_chunk_sort_entries(ch);
    sdm_chunk_decay_scans(ch);
    sdm_chunk_gram(ch);
    sdm_chunk_solve(ch);
}

// ---- Phase 2 -----------------------------------------------------------------------------------------------------

// One chunk of one stream against its bank M [N,d] (M0 on entry, M_end on exit); O [C*d] the chunk's readings.
// Saves snapshot rows, Delta and V - R0 in ch for the backward.
static inline void sdm_chunk_forward_step(SdmChunk *ch, double *M, double *O) {
    int C = ch->C, d = ch->d, W = ch->W, R = ch->R, n = C * W;
    double *R0 = sdm_ref_zeros((size_t)C * d);
    // (a) gather: snapshots, R0 = sum kappa e^lambda M0[K], E = sum rho e^lambda' M0[Q] (into O)
    memset(O, 0, sizeof(double) * C * d);
    for (int e = 0; e < n; e++) {
        memcpy(ch->snap + (size_t)e * d, M + (size_t)ch->ks[e] * d, sizeof(double) * d);
        sdm_axpy(R0 + (size_t)(e / W) * d, ch->kw[e], ch->snap + (size_t)e * d, d);
    }
    for (int q = 0; q < C * R; q++) sdm_axpy(O + (size_t)(q / R) * d, ch->rw[q], M + (size_t)ch->qs[q] * d, d);
    // (b) small GEMMs: Delta = Bm R0 + Dc, O = P R0 + Oc + E
    memcpy(ch->Delta, ch->Dc, sizeof(double) * C * d);
    sdm_matmul(C, C, d, ch->Bm, 0, R0, ch->Delta, 1);
    sdm_matmul(C, C, d, ch->P, 0, R0, O, 1);
    sdm_axpy(O, 1.0, ch->Oc, C * d);
    for (int i = 0; i < C * d; i++) ch->VmR0[i] = ch->V[i] - R0[i];
    // (c) scatter, one slot segment at a time in time order: M[i] = e^Lambda M0[i] + sum_t pi kappa delta_t
    for (int p0 = 0, p1; p0 < n; p0 = p1) {
        p1 = sdm_segment_end(ch, p0);
        int e0 = ch->order[p0];
        double *row = M + (size_t)ch->ks[e0] * d;
        for (int k = 0; k < d; k++) row[k] = ch->eLam[e0] * ch->snap[(size_t)e0 * d + k];
        for (int p = p0; p < p1; p++) {
            int e = ch->order[p];
            sdm_axpy(row, ch->pi[e] * ch->kap[e], ch->Delta + (size_t)(e / W) * d, d);
        }
    }
    free(R0);
}

// ---- driver ------------------------------------------------------------------------------------------------------

// All chunks of all streams, loaded and through Phase 1: chunk c of stream bh is chunks[c * B*H + bh].
static inline SdmChunk *sdm_chunks_prepare(int B, int T, int H, int N, int d, int W, int R, int C, const int *wslot,
                                           const double *kappa, const double *gamma, const double *beta,
                                           const double *v, const int *rslot, const double *rho, int *n_chunks) {
    if (C < 1) sdm_die("sdm chunked op: chunk length %d < 1", C);
    int nc = (T + C - 1) / C, S = B * H;
    SdmChunk *chunks = (SdmChunk *)sdm_malloc(sizeof(SdmChunk) * (size_t)nc * S);
    for (int c = 0; c < nc; c++)
        for (int bh = 0; bh < S; bh++) {
            SdmChunk *ch = chunks + c * S + bh;
            *ch = sdm_chunk_alloc(C, d, W, R);
            sdm_chunk_load(ch, T, H, N, bh / H, bh % H, c, wslot, kappa, gamma, beta, v, rslot, rho);
            sdm_chunk_phase1(ch);
        }
    *n_chunks = nc;
    return chunks;
}

static inline void sdm_chunks_free(SdmChunk *chunks, int n) {
    for (int i = 0; i < n; i++) sdm_chunk_free(chunks + i);
    free(chunks);
}

// Phase 2 over all chunks; readings of real tokens go to out [B,T,H,d]; bank [B,H,N,d] ends in its final state.
static inline void sdm_chunks_forward(SdmChunk *chunks, int nc, int B, int T, int H, int N, double *bank,
                                      double *out) {
    int S = B * H, C = chunks[0].C, d = chunks[0].d;
    double *O = sdm_ref_zeros((size_t)C * d);
    for (int c = 0; c < nc; c++)
        for (int bh = 0; bh < S; bh++) {
            sdm_chunk_forward_step(chunks + c * S + bh, bank + (size_t)bh * N * d, O);
            for (int t = 0; t < C && c * C + t < T; t++)
                memcpy(out + sdm_tok_off(T, H, bh / H, c * C + t, bh % H, d), O + (size_t)t * d, sizeof(double) * d);
        }
    free(O);
}

// The memory op, forward, in the chunked form. Arguments as sdm_op_forward_ref plus the chunk length C >= 1.
static inline void sdm_op_forward_chunked_ref(int B, int T, int H, int N, int d, int W, int R, int C,
                                              const int *wslot, const double *kappa, const double *gamma,
                                              const double *beta, const double *v, const int *rslot,
                                              const double *rho, double *bank, double *out) {
    if (T < 1 || B * H < 1) return;
    int nc;
    SdmChunk *chunks = sdm_chunks_prepare(B, T, H, N, d, W, R, C, wslot, kappa, gamma, beta, v, rslot, rho, &nc);
    sdm_chunks_forward(chunks, nc, B, T, H, N, bank, out);
    sdm_chunks_free(chunks, nc * B * H);
}

// ---- backward Phase A (docs/SDM.md#reverse-recursion-over-chunks), chunks in reverse ---------------------------

// What Phase A leaves for Phase B, per chunk.
typedef struct {
    double *dO;                    // [C*d] gradient of the chunk's readings (0 for padding)
    double *dX;                    // [C*d] gradient of X = diag(beta)(V - R0)
    double *omega, *psi, *eta;     // [C*W] <delta_t, G_ti>, <dR0_t, M0[i]>, e^Lambda <G_ti, M0[i]>
    double *phi;                   // [C*R] <dO_t, M0[j]>
} SdmChunkGrad;

static inline SdmChunkGrad sdm_chunk_grad_alloc(int C, int d, int W, int R) {
    SdmChunkGrad g;
    g.dO = sdm_ref_zeros((size_t)C * d); g.dX = sdm_ref_zeros((size_t)C * d);
    g.omega = sdm_ref_zeros((size_t)C * W); g.psi = sdm_ref_zeros((size_t)C * W); g.eta = sdm_ref_zeros((size_t)C * W);
    g.phi = sdm_ref_zeros((size_t)C * R);
    return g;
}

static inline void sdm_chunk_grad_free(SdmChunkGrad *g) {
    free(g->dO); free(g->dX); free(g->omega); free(g->psi); free(g->eta); free(g->phi);
}

// One chunk in reverse. On entry M is the chunk's end bank and G [N,d] = dLoss/dM_end; on exit M = M0 (restored
// from the snapshots) and G = dLoss/dM0.
static inline void sdm_chunk_backward_step(const SdmChunk *ch, double *M, double *G, SdmChunkGrad *cg) {
    int C = ch->C, d = ch->d, W = ch->W, R = ch->R, n = C * W;
    double *Gw = sdm_ref_zeros((size_t)n * d), *dDelta = sdm_ref_zeros((size_t)C * d);
    // 1-2. gather G at the write entries; write-path gradient of delta: w_t = sum_i pi kappa G_ti
    for (int e = 0; e < n; e++) {
        memcpy(Gw + (size_t)e * d, G + (size_t)ch->ks[e] * d, sizeof(double) * d);
        sdm_axpy(dDelta + (size_t)(e / W) * d, ch->pi[e] * ch->kap[e], Gw + (size_t)e * d, d);
    }
    // 3-4. dDelta = S^T dO + W;  dX = L^-T dDelta
    sdm_matmul(C, C, d, ch->S, 1, cg->dO, dDelta, 1);
    sdm_matmul(C, C, d, ch->Linv, 1, dDelta, cg->dX, 0);
    // 8. bank gradient: written slots G[i] = e^Lambda G_i + sum_t kappa e^lambda dR0_t with dR0 = -beta dX (one
    //    segment at a time, time order), then the reads add rho e^lambda' dO_t
    for (int p0 = 0, p1; p0 < n; p0 = p1) {
        p1 = sdm_segment_end(ch, p0);
        int e0 = ch->order[p0];
        double *row = G + (size_t)ch->ks[e0] * d;
        for (int k = 0; k < d; k++) row[k] = ch->eLam[e0] * Gw[(size_t)e0 * d + k];
        for (int p = p0; p < p1; p++) {
            int e = ch->order[p], t = e / W;
            sdm_axpy(row, -ch->kw[e] * ch->beta[t], cg->dX + (size_t)t * d, d);
        }
    }
    for (int q = 0; q < C * R; q++) sdm_axpy(G + (size_t)ch->qs[q] * d, ch->rw[q], cg->dO + (size_t)(q / R) * d, d);
    // 9. restore the bank to M0
    for (int e = 0; e < n; e++) memcpy(M + (size_t)ch->ks[e] * d, ch->snap + (size_t)e * d, sizeof(double) * d);
    // 10. dot products against M0
    for (int e = 0; e < n; e++) {
        int t = e / W;
        const double *m0 = ch->snap + (size_t)e * d, *g = Gw + (size_t)e * d;
        cg->omega[e] = ref_dot(ch->Delta + (size_t)t * d, g, d);
        cg->psi[e] = -ch->beta[t] * ref_dot(cg->dX + (size_t)t * d, m0, d);
        cg->eta[e] = ch->eLam[e] * ref_dot(g, m0, d);
    }
    for (int q = 0; q < C * R; q++) cg->phi[q] = ref_dot(cg->dO + (size_t)(q / R) * d, M + (size_t)ch->qs[q] * d, d);
    free(Gw);
    free(dDelta);
}

// ---- backward Phase B (docs/SDM.md#per-entry-gradients), independent per chunk -----------------------------------

// Per-entry gradients of one chunk, chunk-local: dkap, dgam [C*W], dbeta [C], dV [C*d], drho [C*R] (overwritten).
typedef struct { double *dkap, *dgam, *dbeta, *dV, *drho; } SdmChunkInputGrads;

// Gram backward for one common slot: the upstream g of entry (row, col) flows to both weights and both log-decays.
typedef struct { const double *wr, *lr, *wc, *lc; double *dwr, *dlr, *dwc, *dlc; double g; } SdmGramBack;
static inline void sdm_gram_back(void *ctx, int ia, int ib) {
    SdmGramBack *b = (SdmGramBack *)ctx;
    double E = exp(b->lr[ia] - b->lc[ib]), x = b->g * b->wr[ia] * b->wc[ib] * E;
    b->dwr[ia] += b->g * b->wc[ib] * E;
    b->dwc[ib] += b->g * b->wr[ia] * E;
    b->dlr[ia] += x;
    b->dlc[ib] -= x;
}

static inline void sdm_chunk_entry_grads(const SdmChunk *ch, const SdmChunkGrad *cg, SdmChunkInputGrads *out) {
    int C = ch->C, d = ch->d, W = ch->W, R = ch->R, n = C * W;
    double *dlam = sdm_ref_zeros((size_t)n), *dmu = sdm_ref_zeros((size_t)n), *dlamr_at = sdm_ref_zeros((size_t)n);
    double *dlamr = sdm_ref_zeros((size_t)C * R);
    // 5. dV = diag(beta) dX, dbeta_t = <v_t - r0_t, dX_t>
    for (int t = 0; t < C; t++) {
        const double *dx = cg->dX + (size_t)t * d;
        out->dbeta[t] = ref_dot(ch->VmR0 + (size_t)t * d, dx, d);
        for (int k = 0; k < d; k++) out->dV[(size_t)t * d + k] = ch->beta[t] * dx[k];
    }
    // direct per-entry terms (docs/SDM.md#per-entry-gradients)
    for (int e = 0; e < n; e++) {
        double el = exp(ch->lam[e]);
        out->dkap[e] = ch->pi[e] * cg->omega[e] + el * cg->psi[e];
        dlam[e] = ch->kap[e] * el * cg->psi[e];
        dmu[e] = ch->kap[e] * ch->pi[e] * cg->omega[e];
        out->dgam[e] = -dmu[e] + cg->eta[e];
    }
    for (int q = 0; q < C * R; q++) {
        double el = exp(ch->lamr[q]);
        out->drho[q] = el * cg->phi[q];
        dlamr[q] = ch->rho[q] * el * cg->phi[q];
    }
    // 6-7. dL = -dX Delta^T (strict lower): dA[t,u] = beta_t dL[t,u], dbeta_t += sum_u A[t,u] dL[t,u];
    //      dS[t,u] = <dO_t, delta_u> (u <= t); each through the Gram backward over the pair's common slots
    for (int t = 0; t < C; t++)
        for (int u = 0; u <= t; u++) {
            const double *du = ch->Delta + (size_t)u * d;
            if (u < t) {
                double dL = -ref_dot(cg->dX + (size_t)t * d, du, d);
                out->dbeta[t] += ch->A[t * C + u] * dL;
                SdmGramBack a = {ch->kap + t * W, ch->lam + t * W, ch->kap + u * W, ch->lam + u * W,
                                 out->dkap + t * W, dlam + t * W, out->dkap + u * W, dlam + u * W, ch->beta[t] * dL};
                sdm_merge_common(ch->ks + t * W, W, ch->ks + u * W, W, sdm_gram_back, &a);
            }
            SdmGramBack s = {ch->rho + t * R, ch->lamr + t * R, ch->kap + u * W, ch->lam + u * W,
                             out->drho + t * R, dlamr + t * R, out->dkap + u * W, dlam + u * W,
                             ref_dot(cg->dO + (size_t)t * d, du, d)};
            sdm_merge_common(ch->qs + t * R, R, ch->ks + u * W, W, sdm_gram_back, &s);
        }
    // log-decay gradients into dgamma by per-slot scans inside the chunk: a read's dlambda' reaches the slot's write
    // entries at times <= t, i.e. the segment prefix ending at rsrc
    for (int q = 0; q < C * R; q++)
        if (ch->rsrc[q] >= 0) dlamr_at[ch->rsrc[q]] += dlamr[q];
    for (int p0 = 0, p1; p0 < n; p0 = p1) {
        p1 = sdm_segment_end(ch, p0);
        double later = 0.0, earlier = 0.0;
        for (int p = p1 - 1; p >= p0; p--) { // reverse inclusive scan of dlambda (+ the reads' dlambda')
            int e = ch->order[p];
            later += dlam[e] + dlamr_at[p];
            out->dgam[e] += later;
        }
        for (int p = p0; p < p1; p++) { // forward inclusive scan of dmu
            int e = ch->order[p];
            earlier += dmu[e];
            out->dgam[e] += earlier;
        }
    }
    free(dlam); free(dmu); free(dlamr_at); free(dlamr);
}

// x rounded to bf16 as the GPU stores a bank-gradient row: to float, then to the nearest even of 8 significant bits
static inline double sdm_ref_bf16(double x) {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u += 0x7fffu + ((u >> 16) & 1u); // inf and NaN stay
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
// rows slots[0..n) of G [N][d] rounded to bf16 (a row listed twice, or already bf16, is unchanged by a second rounding)
static inline void sdm_ref_bf16_rows(double *G, const int *slots, int n, int d) {
    for (int e = 0; e < n; e++)
        for (int k = 0; k < d; k++) G[(size_t)slots[e] * d + k] = sdm_ref_bf16(G[(size_t)slots[e] * d + k]);
}

// The memory op, backward, in the chunked form. Arguments as sdm_op_backward_ref plus the chunk length C >= 1 and
// grad_bf16: 1 keeps the bank gradient G in bf16 between chunks as the GPU's grad_bank_bf16 does (the initial G
// rounded, then after each chunk the rows it touched; every sum inside a chunk stays in double).
static inline void sdm_op_backward_chunked_ref(int B, int T, int H, int N, int d, int W, int R, int C, int grad_bf16,
                                               const int *wslot, const double *kappa, const double *gamma,
                                               const double *beta, const double *v, const int *rslot,
                                               const double *rho, const double *bank_init, const double *dout,
                                               const double *dbank_final, double *dkappa, double *dgamma,
                                               double *dbeta, double *dv, double *drho, double *dbank_init) {
    int S = B * H;
    size_t nbank = (size_t)S * N * d;
    if (dbank_final) memcpy(dbank_init, dbank_final, sizeof(double) * nbank);
    else memset(dbank_init, 0, sizeof(double) * nbank);
    if (grad_bf16)
        for (size_t i = 0; i < nbank; i++) dbank_init[i] = sdm_ref_bf16(dbank_init[i]);
    if (T < 1 || S < 1) return;
    int nc;
    SdmChunk *chunks = sdm_chunks_prepare(B, T, H, N, d, W, R, C, wslot, kappa, gamma, beta, v, rslot, rho, &nc);
    double *bank = (double *)sdm_malloc(sizeof(double) * nbank);
    double *out = (double *)sdm_malloc(sizeof(double) * (size_t)S * T * d);
    memcpy(bank, bank_init, sizeof(double) * nbank);
    sdm_chunks_forward(chunks, nc, B, T, H, N, bank, out); // bank is now final; the chunks hold the saves
    SdmChunkGrad *cgs = (SdmChunkGrad *)sdm_malloc(sizeof(SdmChunkGrad) * (size_t)nc * S);
    // Phase A: chunks in reverse, G = dbank_init evolving from dLoss/dM_final to dLoss/dM_init
    for (int c = nc - 1; c >= 0; c--)
        for (int bh = 0; bh < S; bh++) {
            SdmChunkGrad *cg = cgs + c * S + bh;
            *cg = sdm_chunk_grad_alloc(C, d, W, R);
            for (int t = 0; t < C && c * C + t < T; t++)
                memcpy(cg->dO + (size_t)t * d, dout + sdm_tok_off(T, H, bh / H, c * C + t, bh % H, d),
                       sizeof(double) * d);
            size_t row0 = (size_t)bh * N * d;
            const SdmChunk *ch = chunks + c * S + bh;
            sdm_chunk_backward_step(ch, bank + row0, dbank_init + row0, cg);
            if (grad_bf16) { // padding's slots too: rounding a row that is already bf16 changes nothing
                sdm_ref_bf16_rows(dbank_init + row0, ch->ks, C * W, d);
                sdm_ref_bf16_rows(dbank_init + row0, ch->qs, C * R, d);
            }
        }
    // Phase B: per-entry gradients of every chunk, scattered to the token-major outputs (real tokens only)
    SdmChunkInputGrads lg;
    lg.dkap = sdm_ref_zeros((size_t)C * W); lg.dgam = sdm_ref_zeros((size_t)C * W); lg.dbeta = sdm_ref_zeros(C);
    lg.dV = sdm_ref_zeros((size_t)C * d); lg.drho = sdm_ref_zeros((size_t)C * R);
    for (int c = 0; c < nc; c++)
        for (int bh = 0; bh < S; bh++) {
            sdm_chunk_entry_grads(chunks + c * S + bh, cgs + c * S + bh, &lg);
            for (int t = 0; t < C && c * C + t < T; t++) {
                int b = bh / H, h = bh % H, tg = c * C + t;
                memcpy(dkappa + sdm_tok_off(T, H, b, tg, h, W), lg.dkap + t * W, sizeof(double) * W);
                memcpy(dgamma + sdm_tok_off(T, H, b, tg, h, W), lg.dgam + t * W, sizeof(double) * W);
                dbeta[sdm_tok_off(T, H, b, tg, h, 1)] = lg.dbeta[t];
                memcpy(dv + sdm_tok_off(T, H, b, tg, h, d), lg.dV + (size_t)t * d, sizeof(double) * d);
                memcpy(drho + sdm_tok_off(T, H, b, tg, h, R), lg.drho + t * R, sizeof(double) * R);
            }
            sdm_chunk_grad_free(cgs + c * S + bh);
        }
    free(lg.dkap); free(lg.dgam); free(lg.dbeta); free(lg.dV); free(lg.drho);
    free(cgs);
    free(bank);
    free(out);
    sdm_chunks_free(chunks, nc * S);
}

#endif
