#!/usr/bin/env bash
# tests/fuzz/seeds.sh CORPUS_DIR: the seed corpora of the libFuzzer harnesses (tests/fuzz/fuzz_*.c), made at run time
# from the repository's own valid inputs: the shipped configs, a checkpoint written by build/test_checkpoint --save,
# shards written by ./prepare_data, a hello and an init file of the bootstrap's format, prompts and TSV texts. Each
# harness's first input byte selects its mode, so each seed is that byte followed by the input. Existing corpus files
# (what earlier runs found) are kept.
set -euo pipefail
out=${1:?usage: tests/fuzz/seeds.sh CORPUS_DIR}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
seed() { # seed HARNESS NAME MODE_BYTE [FILE]: the mode byte then FILE (or standard input)
    mkdir -p "$out/$1"
    { printf "\\x$3"; cat "${4:--}"; } > "$out/$1/seed_$2"
}

# config: each shipped config as a text (0), as key=value arguments without comments (1), as a file (2)
for f in configs/*.cfg; do
    b=$(basename "$f" .cfg)
    seed fuzz_config "$b.text" 00 "$f"
    sed -e 's/#.*//' -e 's/ *= */=/' -e '/^ *$/d' "$f" | seed fuzz_config "$b.args" 01
    seed fuzz_config "$b.file" 02 "$f"
done

# checkpoint: model.bin and state.bin of the test model, as written (0, 1) and with the checksum recomputed (2, 3)
build/test_checkpoint --save "$tmp/run" > /dev/null
d="$tmp/run/step_00000017"
seed fuzz_checkpoint model 00 "$d/model.bin"
seed fuzz_checkpoint model.fix 02 "$d/model.bin"
seed fuzz_checkpoint state 01 "$d/state.bin"
seed fuzz_checkpoint state.fix 03 "$d/state.bin"

# shard: shards of a text made by prepare_data (a full one and the short last one), and a manifest
head -c 3000 docs/FORMATS.md > "$tmp/doc.txt"
./prepare_data --quiet --shard-tokens 1500 --val-every 0 -o "$tmp/shards" "$tmp/doc.txt" > /dev/null 2>&1
seed fuzz_shard full 00 "$tmp/shards/train_000000.bin"
seed fuzz_shard last 00 "$tmp/shards/train_000001.bin"
printf 'sdm.c shard manifest 1\ns_000000.bin 5 1034\n' | seed fuzz_shard manifest 01

# prepare: text as a whole file, paragraphs and lines; JSONL
head -c 3000 docs/FORMATS.md | seed fuzz_prepare file 00
head -c 3000 docs/SDM.md | seed fuzz_prepare para 01
head -c 2000 data/README.md | seed fuzz_prepare line.skip.val 0e
jsonl='{"text": "caf\u00e9 \ud83d\ude00\n\"quoted\"", "id": [1, -2.5e3, true, false, null, {"text": 1}]}
   
{"meta": {"x": "y"}, "text": "second"}'
printf '%s\n' "$jsonl" | seed fuzz_prepare jsonl 03
printf '%s\n{"text": "bad \\x"}\n' "$jsonl" | seed fuzz_prepare jsonl.skip 07

# prompts: plain lines and JSONL
printf 'The capital of France is\n\nOnce upon a time\r\n' | seed fuzz_prompts plain 00
printf '%s\n' "$jsonl" | seed fuzz_prompts jsonl 01

# bootstrap: hellos (rank 1, the taken rank 2, another world size), an init file, an environment
secret=0123456789abcdef0123456789abcdef
msg() { # msg CODE WORLD: a message of core/bootstrap.h with the test secret and a zero id
    local code world
    code=$(printf '\\x%02x' "$1") world=$(printf '\\x%02x' "$2")
    printf "SDMB\\x00\\x00\\x00\\x01\\x00\\x00\\x00${code}\\x00\\x00\\x00${world}%s" "$secret"
    head -c $((64 - ${#secret} + 128)) /dev/zero
}
msg 1 4 | seed fuzz_bootstrap hello1 00
msg 2 4 | seed fuzz_bootstrap hello2 00
msg 3 8 | seed fuzz_bootstrap hello.world 00
msg 0 4 | seed fuzz_bootstrap init 01
printf '1\n4\n1\n\x01\n\x01\n\x01\n29500\n30\n127.0.0.1\n\x01\n%s\n' "$secret" | seed fuzz_bootstrap env 02

# svgplot: a chart, and one with a log x axis
printf '# step 1000\nsdm\t1024\t0.9\nswa\t1\t0.1\nsdm\t1\t0.5\n\nswa\t1024\t0.12\n' | seed fuzz_svgplot chart 00
printf 'a\t1\t2\na\t1024\t3\nb\t8\t1e-3\n' | seed fuzz_svgplot logx 07
