// tests/emulate_bscatter_stage.cu: emulates, on the CPU (no GPU needed), the staging of sdm_bscatter_staged_kernel
// (sdm/sdm_op_bwd.cuh): the real host-side layout (sdm_op_layout, sdm_op_args, sdm_bscatter_stage,
// sdm_bscatter_staged_smem, SDM_BSCATTER_STAGE_MAX) with a mirror of the device pieces (sdm_stage_row's two copy
// loops for the 32 lanes, sdm_stage_snap, sdm_staged_snap_view, the column loop lane * 8 + 256 k, and the bytes
// sdm_snap_load8 and sdm_load8_any read). Every d the op takes up to 1400 (and 200 random wider shapes), every
// snapshot format, both banks; per block all 8 warps stage a random entry each (a write entry: its snapshot row and
// scales; a read entry: a snapshot row or the bank row; the G row when it updates it) before any is checked. Checks:
//  - each cp.async: 16 bytes with 16-aligned source and destination, else 4 bytes 4-aligned; the destination inside
//    the warp's own area and the block's dynamic shared memory, the source inside the row it copies;
//  - each staged row copied exactly once, byte for byte (no gap, no overlap);
//  - every 8 values a lane decodes from its warp's staged copy (the kernel's columns and scale) have the bits of those
//    sdm_bscatter_kernel decodes from global memory at the same lane and columns, and come only from bytes this warp
//    staged for this entry's row or scales;
//  - the launcher's choice (staged where d <= 1024 over an fp32 bank, d <= 1360 over a bf16 one, else the fallback),
//    and at least three blocks an SM when staged (four at the flagship's bf16 bank, 48 KB a block).
// MUTANT=1..6 plants a bug in the mirror (1: 16-byte copies whenever the size allows, source alignment unchecked; 2:
// scales over the row; 3: scale view off by one; 4: G over the row; 5: a lane stride of 31; 6: warp areas 16 bytes
// short) to show the checks see it: 2-6 fail; 1 passes, since every row the op stages starts 16-aligned whenever
// its size is a multiple of 16 (256-aligned regions, rows a multiple of 16 apart), so the source test is defensive.
// Not built by make (it mirrors a kernel that is to go after its A/B). Build and run from the repository root:
//   nvcc -O2 -std=c++17 -arch=sm_90 -I. --expt-relaxed-constexpr tests/emulate_bscatter_stage.cu -o build/emu_bsc
//   build/emu_bsc            # prints a summary; exits 1 on a failed check
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "sdm/sdm_op.cuh"

static unsigned long long g_rng = 88172645463325252ull;
static unsigned long long rnd() { g_rng ^= g_rng << 13; g_rng ^= g_rng >> 7; g_rng ^= g_rng << 17; return g_rng; }
static int rand_below(int n) { return (int)(rnd() % (unsigned long long)n); }

static int g_mutant = 0;
static long g_fails, g_checks, g_copies16, g_copies4, g_staged, g_fallback;
#define EXPECT(c, ...)                                                                                                 \
    do {                                                                                                               \
        g_checks++;                                                                                                    \
        if (!(c) && g_fails++ < 20) { printf("FAIL: " __VA_ARGS__); printf("\n"); }                                   \
    } while (0)

// The block's dynamic shared memory, and for each byte the tag of the row that last wrote it (-1: none).
struct Smem {
    std::vector<unsigned char> b;
    std::vector<int> who;
    size_t base; // its address: any multiple of 16 (extern __align__(16))
};
struct Row { const char *lo, *hi; int tag; }; // the global bytes a staging reads, and their tag

// sdm_stage_row(dst, src, bytes, lane) for the 32 lanes of a warp (dst at byte dst of the block's smem, its warp's
// area [lo, hi)).
static void stage_row(Smem &S, size_t dst, size_t lo, size_t hi, const void *src, int bytes, Row row) {
    std::vector<int> seen(bytes, 0);
    const bool wide = ((((g_mutant == 1 ? 0 : (uintptr_t)src) | (uintptr_t)bytes) & 15) == 0);
    const int size = wide ? 16 : 4, stride = (g_mutant == 5 && wide ? 31 : 32) * size;
    for (int lane = 0; lane < 32; lane++)
        for (int k = lane * size; k < bytes; k += stride) {
            const char *from = (const char *)src + k;
            EXPECT(((S.base + dst + k) % size) == 0 && ((uintptr_t)from % size) == 0, "%d-byte copy misaligned", size);
            EXPECT(dst + k >= lo && dst + k + size <= hi, "copy outside the warp's area");
            EXPECT(from >= row.lo && from + size <= row.hi, "source outside the row");
            if (dst + k + size > S.b.size()) { EXPECT(false, "copy outside the block's smem"); continue; }
            for (int j = 0; j < size; j++) {
                S.b[dst + k + j] = (unsigned char)from[j];
                S.who[dst + k + j] = row.tag;
                seen[k + j]++;
            }
            (wide ? g_copies16 : g_copies4)++;
        }
    for (int k = 0; k < bytes; k++) EXPECT(seen[k] == 1, "byte %d of a %d-byte row copied %d times", k, bytes, seen[k]);
}

// The loads of a decode: from global memory (S NULL), or from the staged smem, where every byte must carry `tag`.
struct Reader {
    Smem *S;
    int tag;
    bool bad;
    void read(const void *p, void *out, int n) {
        if (S) {
            size_t off = (const unsigned char *)p - S->b.data();
            if (off + n > S->b.size()) { bad = true; memset(out, 0, n); return; }
            for (int j = 0; j < n; j++) bad |= S->who[off + j] != tag;
        }
        memcpy(out, p, n);
    }
};

// sdm_snap_load8(sv, e, col, x): the payload's loads through r, the scale's through rs
static void snap_load8(Reader &r, Reader &rs, const SdmSnapView &sv, size_t e, int col, float *x) {
    const char *row = sv.data + e * sv.row_bytes;
    if (sv.mode == SDM_SNAP_NONE || sv.mode == SDM_SNAP_BF16) {
        if (sv.mode == SDM_SNAP_NONE && sv.bank_fp32) { r.read((const float *)row + col, x, 32); return; }
        __nv_bfloat16 h[8];
        r.read((const __nv_bfloat16 *)row + col, h, 16);
        for (int i = 0; i < 8; i++) x[i] = __bfloat162float(h[i]);
        return;
    }
    float s;
    rs.read(&sv.scale[e * sv.n_scales + col / SDM_SNAP_SCALE_COLS], &s, 4);
    if (sv.mode == SDM_SNAP_FP8) {
        unsigned char q[8];
        r.read(row + col, q, 8);
        for (int i = 0; i < 8; i++) x[i] = __half2float(__half(__nv_cvt_fp8_to_halfraw(q[i], __NV_E4M3))) * s;
    } else {
        uint32_t raw;
        r.read(row + col / 2, &raw, 4);
        for (int i = 0; i < 4; i++) {
            uint32_t b = (raw >> (8 * i)) & 255u;
            x[2 * i] = (float)((int)(b << 24) >> 28) * s;
            x[2 * i + 1] = (float)((int)(b << 28) >> 28) * s;
        }
    }
}
// sdm_load8_any(row, col, fp32, x)
static void load8_any(Reader &r, const void *row, int col, bool fp32, float *x) {
    if (fp32) { r.read((const float *)row + col, x, 32); return; }
    __nv_bfloat16 h[8];
    r.read((const __nv_bfloat16 *)row + col, h, 16);
    for (int i = 0; i < 8; i++) x[i] = __bfloat162float(h[i]);
}

enum { TAG_G = 1, TAG_M = 2, TAG_S = 3 }; // + 4 * warp: G's row, M0's row (snapshot payload or bank row), scales

// One warp's entry: stream, chunk, slot, the snapshot entry within the chunk; write, updates G, M0 from a snapshot.
struct Entry { int s, c, slot, e; bool last, use_snap; };

// Random bytes everywhere (finite fp32 values where the rows hold fp32: NaN bits would still compare by memcmp).
static void fill(const SdmOpArgs &a, char *bank, float *G, size_t rows, int fp32) {
    const size_t ew = (size_t)a.S * a.Tp * a.W, d = a.d;
    for (size_t i = 0; i < ew * a.snap.row_bytes; i++) a.snap.data[i] = (char)rnd();
    for (size_t i = 0; i < ew * a.snap.n_scales; i++) a.snap.scale[i] = (float)(rnd() % 1000) / 100.f + 0.01f;
    for (size_t i = 0; i < rows * d * (fp32 ? 4 : 2); i++) bank[i] = (char)rnd();
    for (size_t i = 0; i < rows * d; i++) G[i] = (float)(int)(rnd() % 2001 - 1000) / 9.f;
}

static void one_shape(int d, SdmSnapshot mode, int fp32, int W, int R, int C, int T, int B, int H) {
    SdmOpShape s;
    memset(&s, 0, sizeof(s));
    s.B = B; s.T = T; s.H = H; s.N = 64; s.d = d; s.W = W; s.R = R; s.C = C; s.bank_fp32 = fp32; s.snapshot = mode;
    s.training = 1;
    if (sdm_op_check(&s)) return;
    const size_t sb = (sdm_op_saved_bytes(&s) + 255) & ~(size_t)255, xb = (sdm_op_scratch_bytes(&s) + 255) & ~255;
    char *saved = (char *)aligned_alloc(256, sb), *scratch = (char *)aligned_alloc(256, xb);
    const SdmOpArgs a = sdm_op_args(&s, saved, scratch);
    const size_t rows = (size_t)a.S * a.N, row_bytes = (size_t)d * (fp32 ? 4 : 2);
    char *bank = (char *)aligned_alloc(256, (rows * row_bytes + 255) & ~(size_t)255);
    float *G = (float *)aligned_alloc(256, (rows * d * 4 + 255) & ~(size_t)255);
    fill(a, bank, G, rows, fp32);

    const size_t smem = sdm_bscatter_staged_smem(a, fp32);
    const bool fits = smem <= SDM_BSCATTER_STAGE_MAX;
    EXPECT(fits == (fp32 ? d <= 1024 : d <= 1360), "fallback rule: d=%d fp32=%d smem=%zu", d, fp32, smem);
    if (!fits) g_fallback++;
    if (fits) {
        g_staged++;
        // blocks an SM: the launch bounds' 4 (256 threads, <= 64 registers), and H200's 228 KB an SM, 1 KB of it
        // reserved per block
        const int by_smem = (int)((228 << 10) / (smem + 1024)), blocks = std::min(by_smem, 4);
        EXPECT(smem <= (227 << 10) && blocks >= 3, "%d blocks an SM at %zu bytes a block", blocks, smem);
        if (d == 1024 && !fp32) EXPECT(blocks == 4 && smem == 48 << 10, "flagship: %d blocks, %zu B", blocks, smem);
        const SdmBscatterStage L = sdm_bscatter_stage(a, fp32);
        EXPECT(L.bytes % 16 == 0 && L.m_off % 16 == 0 && L.s_off % 16 == 0, "area offsets not multiples of 16");
        EXPECT((size_t)L.bytes * SDM_ROW_WARPS == smem, "smem is not SDM_ROW_WARPS areas");
        const int step = L.bytes - (g_mutant == 6 ? 16 : 0); // bytes between two warps' areas
        Smem S;
        S.b.assign(smem, 0);
        S.base = 16 * (1 + rand_below(64));
        for (int trial = 0; trial < 3; trial++) {
            Entry en[SDM_ROW_WARPS];
            S.who.assign(smem, -1);
            for (int w = 0; w < SDM_ROW_WARPS; w++) { // every warp stages (all in flight), then every lane reads
                Entry &x = en[w];
                x.s = rand_below(a.S); x.c = rand_below(a.nc); x.slot = rand_below(a.N); x.e = rand_below(a.C * a.W);
                const bool write = rand_below(2);
                x.last = rand_below(2);
                x.use_snap = write || rand_below(2);
                const size_t ew = ((size_t)x.s * a.Tp + (size_t)x.c * a.C) * a.W, row0 = (size_t)x.s * a.N;
                const size_t lo = (size_t)w * step, hi = lo + L.bytes;
                if (x.use_snap) { // sdm_stage_snap
                    const char *src = a.snap.data + (ew + x.e) * a.snap.row_bytes;
                    stage_row(S, lo + L.m_off, lo, hi, src, (int)a.snap.row_bytes,
                              {src, src + a.snap.row_bytes, 4 * w + TAG_M});
                    if (a.snap.n_scales) {
                        const float *sc = a.snap.scale + (ew + x.e) * a.snap.n_scales;
                        stage_row(S, lo + (g_mutant == 2 ? L.m_off : L.s_off), lo, hi, sc, 4 * a.snap.n_scales,
                                  {(const char *)sc, (const char *)(sc + a.snap.n_scales), 4 * w + TAG_S});
                    }
                } else {
                    const char *src = bank + (row0 + x.slot) * row_bytes;
                    stage_row(S, lo + L.m_off, lo, hi, src, (int)row_bytes, {src, src + row_bytes, 4 * w + TAG_M});
                }
                const float *grow = G + (row0 + x.slot) * d;
                if (x.last)
                    stage_row(S, lo + (g_mutant == 4 ? L.m_off : 0), lo, hi, grow, 4 * d,
                              {(const char *)grow, (const char *)(grow + d), 4 * w + TAG_G});
            }
            for (int w = 0; w < SDM_ROW_WARPS; w++) {
                const Entry &x = en[w];
                const size_t ew = ((size_t)x.s * a.Tp + (size_t)x.c * a.C) * a.W, row0 = (size_t)x.s * a.N;
                unsigned char *area = S.b.data() + (size_t)w * step;
                SdmSnapView sm = a.snap; // sdm_staged_snap_view
                sm.data = (char *)(area + L.m_off);
                sm.scale = (float *)(area + L.s_off) + (g_mutant == 3);
                const float *grow = G + (row0 + x.slot) * d, *Gs = (const float *)area;
                for (int lane = 0; lane < 32; lane++)
                    for (int col = lane * 8; col < d; col += 256) {
                        float m0[8], m1[8], g1[8];
                        Reader glob = {NULL, 0, false}, stM = {&S, 4 * w + TAG_M, false},
                               stS = {&S, 4 * w + TAG_S, false}, stG = {&S, 4 * w + TAG_G, false};
                        if (x.use_snap) {
                            snap_load8(glob, glob, a.snap, ew + x.e, col, m0);
                            snap_load8(stM, stS, sm, 0, col, m1);
                        } else {
                            load8_any(glob, bank + (row0 + x.slot) * row_bytes, col, fp32, m0);
                            load8_any(stM, sm.data, col, fp32, m1);
                        }
                        EXPECT(!stM.bad && !stS.bad, "M0 read from bytes not staged for it: format %d fp32 %d d=%d "
                               "col %d", (int)mode, fp32, d, col);
                        EXPECT(!memcmp(m0, m1, 32), "M0 differs: format %d fp32 %d d=%d col %d", (int)mode, fp32, d,
                               col);
                        if (!x.last) continue;
                        stG.read(Gs + col, g1, 32);
                        EXPECT(!stG.bad && !memcmp(grow + col, g1, 32), "G differs or not staged: d=%d col %d", d, col);
                    }
            }
        }
    }
    free(saved); free(scratch); free(bank); free(G);
}

int main() {
    if (getenv("MUTANT")) g_mutant = atoi(getenv("MUTANT"));
    static const SdmSnapshot modes[] = {SDM_SNAP_NONE, SDM_SNAP_BF16, SDM_SNAP_FP8, SDM_SNAP_INT4};
    for (int d = 8; d <= 1400; d += 8) // every d that stages, and the first that fall back
        for (int m = 0; m < 4; m++)
            for (int fp32 = 0; fp32 < 2; fp32++)
                one_shape(d, modes[m], fp32, 1 + rand_below(8), 1 + rand_below(8), 1 + rand_below(16),
                          1 + rand_below(40), 1, 1 + rand_below(2));
    for (int i = 0; i < 200; i++) // random shapes up to d = 4096
        one_shape(8 * (1 + rand_below(512)), modes[rand_below(4)], rand_below(2), 1 + rand_below(16),
                  1 + rand_below(16), 1 + rand_below(64), 1 + rand_below(70), 1 + rand_below(2), 1 + rand_below(2));
    for (int m = 0; m < 4; m++) // the flagship's rows: d = 1024, W = R = C = 64
        for (int fp32 = 0; fp32 < 2; fp32++) one_shape(1024, modes[m], fp32, 64, 64, 64, 70, 1, 1);
    printf("emulate_bscatter_stage%s: %ld checks, %ld failed; %ld shapes staged, %ld fell back; %ld 16-byte and %ld "
           "4-byte copies\n", g_mutant ? " (with a planted bug)" : "", g_checks, g_fails, g_staged, g_fallback,
           g_copies16, g_copies4);
    return g_fails != 0;
}
