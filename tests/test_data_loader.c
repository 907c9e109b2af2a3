// The dataloader: rows are T+1 consecutive tokens at multiples of T; an epoch hands out every row at most once
// (all but fewer than G); rank slices are disjoint and together equal the global batch (which depends on
// G = world*B only); save/restore reproduces the exact next batches (across epochs and world sizes);
// shuffling is deterministic per seed; the validation loader reads rows in file order.
#define _POSIX_C_SOURCE 200809L
#include <sys/stat.h>
#include <unistd.h>

#include "data/dataloader.h"
#include "tests/test.h"
#include "tests/test_data_util.h"

#define T 16
#define VOCAB 65536  // of the test shards, and the model's
#define NSHARDS 4
static const size_t shard_tokens[NSHARDS] = {1000, 517, 2000, 33};
static char g_dir[TEST_PATH_LEN], g_pattern[TEST_PATH_LEN + 32];
static uint64_t g_rows;

// Token value = its position in the concatenation of all shards (in path order): rows identify themselves.
static void write_shards(void) {
    int32_t value = 0;
    g_rows = 0;
    for (int s = 0; s < NSHARDS; s++) {
        char prefix[16], err[DATA_ERR_LEN];
        ShardWriter w;
        snprintf(prefix, sizeof prefix, "s%d", s);
        int32_t *t = (int32_t *)sdm_malloc(shard_tokens[s] * sizeof(int32_t));
        for (size_t i = 0; i < shard_tokens[s]; i++) t[i] = value++;
        if (shard_writer_open(&w, g_dir, prefix, VOCAB, SHARD_TOKENIZER_EXTERNAL, 1u << 20, err) ||
            shard_writer_append(&w, t, shard_tokens[s], err) || shard_writer_close(&w, err))
            sdm_die("%s", err);
        free(t);
        g_rows += (shard_tokens[s] - 1) / T;
    }
    snprintf(g_pattern, sizeof g_pattern, "%s/s*.bin", g_dir);
}

static DataLoader open_loader(int B, int rank, int world, uint64_t seed, int shuffle) {
    DataLoader dl;
    char err[DATA_ERR_LEN];
    if (dataloader_open(&dl, g_pattern, B, T, rank, world, seed, shuffle, VOCAB, err)) sdm_die("%s", err);
    return dl;
}

static void next(DataLoader *dl, int32_t *out) {
    char err[DATA_ERR_LEN];
    if (dataloader_next_batch(dl, out, err)) sdm_die("%s", err);
}

// Row id of a row: its first token's position in the concatenated data; -1 if the row is not a real row.
static int64_t row_id(const int32_t *row) {
    int64_t base = 0;
    for (int s = 0; s < NSHARDS; s++) {
        int64_t end = base + (int64_t)shard_tokens[s];
        if (row[0] >= base && row[0] < end) {
            if ((row[0] - base) % T != 0 || row[0] + T >= end) return -1;
            for (int i = 1; i <= T; i++)
                if (row[i] != row[0] + i) return -1;
            return row[0];
        }
        base = end;
    }
    return -1;
}

static void test_epoch_coverage(int B, int world) {
    const uint64_t G = (uint64_t)B * (uint64_t)world, batches = g_rows / G;
    DataLoader dl[8];
    for (int r = 0; r < world; r++) dl[r] = open_loader(B, r, world, 42, 1);
    CHECK(dataloader_batches_per_epoch(&dl[0]) == batches, "batches per epoch %llu, expected %llu",
          (unsigned long long)dataloader_batches_per_epoch(&dl[0]), (unsigned long long)batches);
    int32_t *batch = (int32_t *)sdm_malloc((size_t)B * (T + 1) * sizeof(int32_t));
    char *seen = (char *)sdm_calloc(4000, 1);
    int bad_rows = 0, repeats = 0, in_file_order = 1;
    int64_t prev = -1;
    for (uint64_t k = 0; k < batches; k++)
        for (int r = 0; r < world; r++) {
            next(&dl[r], batch);
            for (int b = 0; b < B; b++) {
                int64_t id = row_id(batch + (size_t)b * (T + 1));
                if (id < 0) { bad_rows++; continue; }
                repeats += seen[id];
                seen[id] = 1;
                in_file_order &= id > prev;
                prev = id;
            }
        }
    CHECK(bad_rows == 0, "B=%d world=%d: %d rows are not T+1 consecutive tokens at a multiple of T", B, world,
          bad_rows);
    CHECK(repeats == 0, "B=%d world=%d: %d rows repeated within an epoch", B, world, repeats);
    CHECK(!in_file_order, "B=%d world=%d: the shuffled epoch is in file order", B, world);
    DataLoaderState st;
    dataloader_get_state(&dl[0], &st);
    CHECK(st.epoch == 0 && st.position == batches * G, "epoch 0 ends at position %llu",
          (unsigned long long)st.position);
    next(&dl[0], batch);
    dataloader_get_state(&dl[0], &st);
    CHECK(st.epoch == 1 && st.position == G, "the next batch starts epoch 1 (epoch %llu, position %llu)",
          (unsigned long long)st.epoch, (unsigned long long)st.position);
    for (int r = 0; r < world; r++) dataloader_close(&dl[r]);
    free(batch);
    free(seen);
}

// world ranks with B rows each == one rank with world*B rows, batch after batch (through epoch changes).
static void test_rank_slices(int B, int world, uint64_t seed, int shuffle) {
    const size_t row = T + 1, G = (size_t)B * (size_t)world;
    DataLoader whole = open_loader((int)G, 0, 1, seed, shuffle), dl[8];
    for (int r = 0; r < world; r++) dl[r] = open_loader(B, r, world, seed, shuffle);
    int32_t *global = (int32_t *)sdm_malloc(G * row * sizeof(int32_t)),
            *part = (int32_t *)sdm_malloc(B * row * sizeof(int32_t));
    int mismatches = 0;
    for (int k = 0; k < 100; k++) {
        next(&whole, global);
        for (int r = 0; r < world; r++) {
            next(&dl[r], part);
            mismatches += memcmp(part, global + (size_t)r * B * row, B * row * sizeof(int32_t)) != 0;
        }
    }
    CHECK(mismatches == 0, "B=%d world=%d shuffle=%d: %d rank slices differ from the global batch", B, world, shuffle,
          mismatches);
    dataloader_close(&whole);
    for (int r = 0; r < world; r++) dataloader_close(&dl[r]);
    free(global);
    free(part);
}

// Batches after restoring a state saved at step `at` equal those of the uninterrupted run (also when the
// restored run splits the same global batch over another number of ranks).
static void test_save_restore(int at) {
    const int B = 6, steps = 80;
    const size_t n = (size_t)B * (T + 1);
    DataLoader a = open_loader(B, 0, 1, 7, 1);
    int32_t *ref = (int32_t *)sdm_malloc((size_t)steps * n * sizeof(int32_t)),
            *got = (int32_t *)sdm_malloc(n * sizeof(int32_t));
    DataLoaderState saved;
    for (int k = 0; k < at; k++) next(&a, got);
    dataloader_get_state(&a, &saved);
    for (int k = 0; k < steps; k++) next(&a, ref + (size_t)k * n);
    DataLoader b = open_loader(B, 0, 1, 12345, 1);  // another seed, already used: the state's seed wins
    char err[DATA_ERR_LEN] = "";
    next(&b, got);
    CHECK(dataloader_set_state(&b, &saved, err) == 0, "restore: %s", err);
    int diff = 0;
    for (int k = 0; k < steps; k++) {
        next(&b, got);
        diff += memcmp(got, ref + (size_t)k * n, n * sizeof(int32_t)) != 0;
    }
    CHECK(diff == 0, "restored at %d: %d of %d batches differ", at, diff, steps);
    DataLoader r1 = open_loader(B / 3, 1, 3, 0, 1);  // rank 1 of 3: the middle third of every global batch
    CHECK(dataloader_set_state(&r1, &saved, err) == 0, "restore on 3 ranks: %s", err);
    int32_t *third = (int32_t *)sdm_malloc(n / 3 * sizeof(int32_t));
    diff = 0;
    for (int k = 0; k < steps; k++) {
        next(&r1, third);
        diff += memcmp(third, ref + (size_t)k * n + n / 3, n / 3 * sizeof(int32_t)) != 0;
    }
    CHECK(diff == 0, "restored at %d on 3 ranks: %d of %d slices differ", at, diff, steps);
    DataLoader c = open_loader(B, 0, 1, 7, 1);
    int32_t *first = (int32_t *)sdm_malloc(n * sizeof(int32_t));
    next(&c, first);
    CHECK(at == 0 || memcmp(first, ref, n * sizeof(int32_t)) != 0,
          "restored batches equal the first ones: the test would not see a wrong restore");
    DataLoaderState bad = saved;
    bad.total_rows++;
    CHECK(dataloader_set_state(&c, &bad, err) != 0 && strstr(err, "different data"),
          "state for other data accepted: %s", err);
    bad = saved;
    bad.magic = 0;
    CHECK(dataloader_set_state(&c, &bad, err) != 0 && strstr(err, "magic"), "state with bad magic accepted: %s", err);
    DataLoader other_T;
    if (dataloader_open(&other_T, g_pattern, B, T + 1, 0, 1, 7, 1, VOCAB, err)) sdm_die("%s", err);
    CHECK(dataloader_set_state(&other_T, &saved, err) != 0 && strstr(err, "seq_len"),
          "state for another T accepted: %s", err);
    dataloader_close(&other_T);
    dataloader_close(&a);
    dataloader_close(&b);
    dataloader_close(&c);
    dataloader_close(&r1);
    free(ref);
    free(got);
    free(third);
    free(first);
}

static void test_seeds(void) {
    const size_t n = 4 * (T + 1);
    int32_t x[4 * (T + 1)], y[4 * (T + 1)];
    DataLoader a = open_loader(4, 0, 1, 1, 1), b = open_loader(4, 0, 1, 1, 1), c = open_loader(4, 0, 1, 2, 1);
    int same = 1, differs = 0;
    for (int k = 0; k < 20; k++) {
        next(&a, x);
        next(&b, y);
        same &= memcmp(x, y, sizeof x) == 0;
        next(&c, y);
        differs += memcmp(x, y, n * sizeof(int32_t)) != 0;
    }
    CHECK(same, "the same seed gave different batches");
    CHECK(differs >= 18, "seeds 1 and 2 gave the same batch %d times of 20", 20 - differs);
    dataloader_close(&a);
    dataloader_close(&b);
    dataloader_close(&c);
}

// The shard order is shuffled too: over 20 seeds the first row comes from several shards.
static void test_shard_order_shuffled(void) {
    int32_t batch[T + 1];
    int from[NSHARDS] = {0}, distinct = 0;
    for (uint64_t seed = 0; seed < 20; seed++) {
        DataLoader dl = open_loader(1, 0, 1, seed, 1);
        next(&dl, batch);
        int64_t base = 0;
        for (int s = 0; s < NSHARDS; s++) {
            if (batch[0] >= base && batch[0] < base + (int64_t)shard_tokens[s]) from[s]++;
            base += (int64_t)shard_tokens[s];
        }
        dataloader_close(&dl);
    }
    for (int s = 0; s < NSHARDS; s++) distinct += from[s] > 0;
    CHECK(distinct >= 3, "the first row came from only %d shards over 20 seeds", distinct);
}

static void test_validation_order(void) {
    DataLoader v = open_loader(3, 1, 2, 99, 0);  // rank 1 of 2
    int32_t batch[3 * (T + 1)];
    int wrong = 0;
    const uint64_t batches = dataloader_batches_per_epoch(&v);
    for (int pass = 0; pass < 2; pass++) {
        dataloader_reset(&v);
        for (uint64_t k = 0; k < batches; k++) {
            next(&v, batch);
            for (int b = 0; b < 3; b++) {
                uint64_t p = k * 6 + 3 + (uint64_t)b, shard_first = 0;  // position p = the p-th row in file order
                int64_t base = 0, want = -1;
                for (int s = 0; s < NSHARDS && want < 0; s++) {
                    uint64_t rows = (shard_tokens[s] - 1) / T;
                    if (p < shard_first + rows) want = base + (int64_t)((p - shard_first) * T);
                    shard_first += rows;
                    base += (int64_t)shard_tokens[s];
                }
                wrong += row_id(batch + b * (T + 1)) != want;
            }
        }
    }
    CHECK(wrong == 0, "validation loader: %d rows out of file order", wrong);
    dataloader_close(&v);
}

static void test_permutation(void) {
    int bad = 0;
    for (uint64_t n = 1; n <= 300; n++) {
        char hit[300] = {0};
        for (uint64_t i = 0; i < n; i++) {
            uint64_t j = loader_permute(i, n, n * 77);
            if (j >= n || hit[j]) bad++;
            else hit[j] = 1;
        }
    }
    CHECK(bad == 0, "loader_permute is not a bijection (%d collisions or out of range)", bad);
    uint64_t fixed = 0;
    for (uint64_t i = 0; i < 1000; i++) fixed += loader_permute(i, 1000, 5) == i;
    CHECK(fixed < 20, "permutation of 1000 has %llu fixed points", (unsigned long long)fixed);
}

static void test_pattern_list(void) {
    char list[3 * TEST_PATH_LEN], err[DATA_ERR_LEN] = "";
    snprintf(list, sizeof list, "%s/s0_000000.bin,%s/s2_*.bin", g_dir, g_dir);
    DataLoader dl;
    CHECK(dataloader_open(&dl, list, 2, T, 0, 1, 1, 1, VOCAB, err) == 0 && dl.num_shards == 2 &&
          dl.total_rows == (shard_tokens[0] - 1) / T + (shard_tokens[2] - 1) / T, "comma-separated list: %s", err);
    if (dl.shards) dataloader_close(&dl);
    snprintf(list, sizeof list, "%s/s0_000000.bin,%s/nothing_*.bin", g_dir, g_dir);
    CHECK(dataloader_open(&dl, list, 2, T, 0, 1, 1, 1, VOCAB, err) != 0 && strstr(err, "nothing_") &&
          strstr(err, "no file"),
          "a pattern matching nothing: %s", err);
    CHECK(dataloader_open(&dl, g_pattern, 2, T, 2, 2, 1, 1, VOCAB, err) != 0 && strstr(err, "rank"),
          "rank >= world: %s", err);
}

// Issue 9: a shard's vocab above the model's is refused (unsigned: 0x80000000 is no negative number), so tokens of a
// million never reach the embedding; a FIFO named like a shard is refused at once instead of blocking.
static void test_refusals(void) {
    char err[DATA_ERR_LEN] = "", pattern[TEST_PATH_LEN + 32];
    const uint32_t huge = 0x80000000u;
    int32_t tokens[200];
    for (int i = 0; i < 200; i++) tokens[i] = 1000000 + i;
    ShardWriter w;
    if (shard_writer_open(&w, g_dir, "huge", huge, SHARD_TOKENIZER_EXTERNAL, 1000, err) ||
        shard_writer_append(&w, tokens, 200, err) || shard_writer_close(&w, err))
        sdm_die("%s", err);
    snprintf(pattern, sizeof pattern, "%s/huge_*.bin", g_dir);
    DataLoader dl;
    CHECK(dataloader_open(&dl, pattern, 2, T, 0, 1, 1, 1, 258, err) != 0 && strstr(err, "huge_000000.bin: offset 12") &&
          strstr(err, "vocab 2147483648 exceeds the model's vocabulary 258"), "vocab 0x80000000 accepted: %s", err);
    CHECK(dataloader_open(&dl, pattern, 2, T, 0, 1, 1, 1, huge, err) == 0, "the shard's own vocab refused: %s", err);
    if (dl.shards) dataloader_close(&dl);
    snprintf(pattern, sizeof pattern, "%s/fifo_000000.bin", g_dir);
    CHECK(mkfifo(pattern, 0600) == 0, "mkfifo %s", pattern);
    alarm(20);  // a hang becomes a failure
    CHECK(dataloader_open(&dl, pattern, 2, T, 0, 1, 1, 1, VOCAB, err) != 0 && strstr(err, pattern) &&
          strstr(err, "not a regular file"), "FIFO: %s", err);
    alarm(0);
    remove(pattern);
}

int main(void) {
    CHECK(sizeof(DataLoaderState) == 48, "DataLoaderState is %zu bytes: padding crept into the checkpoint record",
          sizeof(DataLoaderState));
    test_tmpdir(g_dir);
    write_shards();
    test_permutation();
    test_epoch_coverage(4, 1);
    test_epoch_coverage(3, 2);
    test_epoch_coverage(5, 7);
    test_rank_slices(2, 3, 5, 1);
    test_rank_slices(3, 2, 6, 1);
    test_rank_slices(1, 8, 7, 1);
    test_rank_slices(2, 4, 8, 0);
    test_save_restore(0);
    test_save_restore(17);
    test_save_restore(50);  // the 80 batches after it cross two epoch boundaries
    test_seeds();
    test_shard_order_shuffled();
    test_validation_order();
    test_pattern_list();
    test_refusals();
    test_rmdir(g_dir);
    return test_summary();
}
