// tests/test_generate.c: the generator's bookkeeping (model/generate.cuh gen_batch) on the CPU. The GpuInferState
// calls it makes are replaced by a model whose next token is a hash of the stream's own state (seed, position, last
// token; EOS about one time in 23), so a request's tokens depend on nothing else and every request must generate
// what it generates alone: requests admitted into free streams, streams leaving the batch as they stop (the last
// active one moved into the place), the step launched ahead of reading the ids of the one before (its ids going to
// the requests its streams held at launch, a stopped request's token dropped), full-attention KV caches filled to
// exactly the documented need (P + max_new - 1 positions) and never past it. 1..9 streams, 1..13 requests,
// prompts of 1..8 tokens and outputs of 1..40, with and without the step ahead.
#include "core/common.h"
#include "core/sampling.h"
#include "data/tokenizer.h"
#include "tests/test.h"

#define MOCK_STREAMS 16

// The model: streams' positions, next tokens and seeds; ids copied into two halves by step launches.
typedef struct {
    int streams, max_tokens, full_attention;
    int pos[MOCK_STREAMS], next[MOCK_STREAMS];
    uint64_t seed[MOCK_STREAMS];
    int ids[2][MOCK_STREAMS], unread[2]; // a half's ids written and not yet read
    int errors;                           // a read of a half not written, a launch over unread ids, a KV overflow
} GpuInferState;

static uint64_t mock_hash(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}
static int mock_token(uint64_t seed, int pos, int last) {
    uint64_t h = mock_hash(seed * 1000003ULL + (uint64_t)pos * 7919ULL + (uint64_t)(last + 1));
    return h % 23 == 0 ? TOK_EOS : (int)(h % 256);
}

// The calls of model/gpu_model.cuh that gen_batch makes, on the model above (steps run when launched: the order
// of the device's stream).
static void gpu_infer_set_sampling(GpuInferState *I, const SamplingParams *sp) { (void)I, (void)sp; }
static void gpu_infer_reset(GpuInferState *I, int b) { I->pos[b] = 0, I->next[b] = -1; }
static void gpu_infer_seed(GpuInferState *I, int b, uint64_t seed) { I->seed[b] = seed; }
static void gpu_infer_prefill_device(GpuInferState *I, int b, const int *tokens, int T) {
    I->pos[b] = T;
    I->next[b] = mock_token(I->seed[b], T, tokens[T - 1]);
}
static int gpu_infer_sample(GpuInferState *I, int b) { return I->next[b]; }
static int gpu_infer_step_fits(const GpuInferState *I, int n) {
    for (int i = 0; i < n; i++)
        if (I->full_attention && I->pos[i] >= I->max_tokens) return 0;
    return 1;
}
static void gpu_infer_step_launch(GpuInferState *I, int n, int use_graph, int half) {
    (void)use_graph;
    I->errors += I->unread[half];
    for (int i = 0; i < n; i++) {
        I->errors += I->full_attention && I->pos[i] >= I->max_tokens;
        I->pos[i]++;
        I->ids[half][i] = I->next[i] = mock_token(I->seed[i], I->pos[i], I->next[i]);
    }
    I->unread[half] = 1;
}
static const int *gpu_infer_step_ids(GpuInferState *I, int half) {
    I->errors += !I->unread[half];
    I->unread[half] = 0;
    return I->ids[half];
}
static void gpu_infer_move(GpuInferState *I, int from, int to) {
    I->pos[to] = I->pos[from], I->next[to] = I->next[from], I->seed[to] = I->seed[from];
}

#define SDM_MODEL_GPU_MODEL_CUH // the calls above stand for model/gpu_model.cuh
#include "model/generate.cuh"

// One request alone, token by token with the same model: returns its tokens' count (out), *eos whether EOS ended it.
static int generate_alone(const int *prompt, int P, int max_new, uint64_t seed, int *out, int *eos) {
    int n = 0, pos = P, tok = mock_token(seed, P, prompt[P - 1]);
    *eos = 0;
    for (;;) {
        if (tok == TOK_EOS) {
            *eos = 1;
            break;
        }
        out[n++] = tok;
        if (n >= max_new) break;
        tok = mock_token(seed, ++pos, tok);
    }
    return n;
}

int main(void) {
    int differ = 0, requests = 0, errors = 0;
    long long steps[2] = {0, 0};
    for (int trial = 0; trial < 4000; trial++) {
        const int count = 1 + trial % 13, streams = 1 + (trial / 13) % 9, ahead = trial % 2;
        static int prompts[13][8], outs[13][40], alone[40];
        GenRequest req[13];
        GpuInferState I;
        memset(&I, 0, sizeof I);
        I.streams = streams, I.full_attention = (trial / 7) % 2;
        for (int r = 0; r < count; r++) {
            const int P = 1 + (int)(mock_hash(trial * 31 + r) % 8), max_new = 1 + (int)(mock_hash(trial * 17 + r) % 40);
            for (int k = 0; k < P; k++) prompts[r][k] = (int)(mock_hash(trial * 101 + r * 7 + k) % 256);
            req[r] = (GenRequest){prompts[r], P, max_new, outs[r], 0, 0};
            I.max_tokens = SDM_MAX(I.max_tokens, P + max_new - 1); // exactly the documented need
        }
        GenStats st = gen_batch(&I, req, count, NULL, 1000 + trial, 1, ahead, NULL);
        steps[ahead] += st.n_steps;
        errors += I.errors;
        for (int r = 0; r < count; r++) {
            int eos, n = generate_alone(prompts[r], req[r].P, req[r].max_new, 1000 + trial + r, alone, &eos);
            requests++;
            differ += n != req[r].n_new || eos != req[r].hit_eos || memcmp(alone, outs[r], sizeof(int) * n) != 0;
        }
    }
    printf("gen_batch: %d requests, %d differ from generating alone; %d misuses of the step calls; %lld steps one "
           "at a time, %lld a step ahead\n", requests, differ, errors, steps[0], steps[1]);
    CHECK(differ == 0, "gen_batch: %d of %d requests differ from the same request generated alone", differ, requests);
    CHECK(errors == 0, "gen_batch: %d reads of unwritten ids, launches over unread ids or KV overflows", errors);
    CHECK(steps[1] > steps[0], "the step ahead ran no extra step: it was never taken");
    return test_summary();
}
