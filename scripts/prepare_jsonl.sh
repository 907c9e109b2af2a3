#!/usr/bin/env bash
# Any JSONL corpus with a "text" field (plain, .gz or .zst; local files or http(s) URLs) as bytes-tokenizer
# shards. Used for FineWeb-Edu and similar web corpora; see scripts/prepare_fineweb_edu.sh.
# usage: scripts/prepare_jsonl.sh OUT_DIR INPUT... [-- prepare_data options]
#   INPUT      path or URL; URLs are downloaded once into data/generated/downloads/
# Plain local files are read directly (errors name file:line); compressed ones are streamed through
# standard input (errors name <stdin>:line, counted over the concatenation of those files).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,8p' "$0" >&2; exit 2; }
out=$1; shift
inputs=(); opts=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; opts=("$@"); break; fi
    inputs+=("$1"); shift
done
local_inputs=()
for f in "${inputs[@]}"; do
    case "$f" in
    http://*|https://*)
        dest=data/generated/downloads/$(basename "${f%%\?*}")
        if [ ! -s "$dest" ]; then
            mkdir -p "$(dirname "$dest")"
            echo "downloading $f"
            curl -fL --retry 3 -o "$dest.part" "$f" && mv "$dest.part" "$dest"
        fi
        local_inputs+=("$dest");;
    *) [ -r "$f" ] || { echo "prepare_jsonl: $f: cannot read" >&2; exit 1; }
        local_inputs+=("$f");;
    esac
done
make --no-print-directory prepare_data >/dev/null
plain=(); packed=()
for f in "${local_inputs[@]}"; do
    case "$f" in *.gz|*.zst) packed+=("$f");; *) plain+=("$f");; esac
done
if [ ${#packed[@]} -gt 0 ] && [ ${#plain[@]} -gt 0 ]; then
    echo "prepare_jsonl: give either plain or compressed inputs in one run (prepare_data writes one set of shards)" >&2
    exit 2
fi
if [ ${#plain[@]} -gt 0 ]; then
    exec ./prepare_data --format jsonl ${opts[@]+"${opts[@]}"} -o "$out" "${plain[@]}"
fi
for f in "${packed[@]}"; do
    case "$f" in *.gz) gzip -dc "$f";; *.zst) zstd -dc "$f";; esac
done | ./prepare_data --format jsonl ${opts[@]+"${opts[@]}"} -o "$out" -
