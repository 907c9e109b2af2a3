#!/usr/bin/env bash
# TinyShakespeare (1.1 MB of Shakespeare's plays, public domain) as bytes-tokenizer shards.
# usage: scripts/prepare_tinyshakespeare.sh [INPUT.txt] [OUT_DIR]
#   INPUT.txt  a local copy; without it the file is downloaded once into data/generated/downloads/
#   OUT_DIR    default data/generated/tinyshakespeare (train_*.bin, val_*.bin)
# Documents are the speeches (blank-line separated paragraphs); every 10th goes to validation.
set -euo pipefail
cd "$(dirname "$0")/.."
URL=https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt
input=${1:-}
out=${2:-data/generated/tinyshakespeare}
if [ -z "$input" ]; then
    input=data/generated/downloads/tinyshakespeare.txt
    if [ ! -s "$input" ]; then
        mkdir -p "$(dirname "$input")"
        echo "downloading $URL"
        curl -fL --retry 3 -o "$input.part" "$URL" && mv "$input.part" "$input"
    fi
fi
make --no-print-directory prepare_data >/dev/null
./prepare_data --format text --unit para --val-every 10 -o "$out" "$input"
