#!/usr/bin/env bash
# FineWeb-Edu (ODC-By licence) as bytes-tokenizer shards, from JSONL.
# usage: scripts/prepare_fineweb_edu.sh [INPUT.jsonl[.gz|.zst]...] [-- prepare_data options]
#   Without inputs, a sample of FINEWEB_DOCS documents (default 20000) is taken from the Hugging Face
#   datasets-server API (needs internet; rows come as JSON, turned into JSONL with jq). The official parquet files
#   need a converter (e.g. `duckdb -c "COPY (SELECT text FROM 'x.parquet') TO 'x.jsonl' (FORMAT JSON)"`); give the
#   JSONL here.
# Output: data/generated/fineweb_edu (train_*.bin, val_*.bin); OUT_DIR overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-data/generated/fineweb_edu}
if [ $# -eq 0 ] || [ "$1" = "--" ]; then
    command -v jq >/dev/null || {
        echo "prepare_fineweb_edu: downloading needs jq; or pass local JSONL files" >&2; exit 1; }
    sample=data/generated/downloads/fineweb_edu_sample_${FINEWEB_DOCS:-20000}.jsonl
    if [ ! -s "$sample" ]; then
        mkdir -p "$(dirname "$sample")"
        api="https://datasets-server.huggingface.co/rows?\
dataset=HuggingFaceFW/fineweb-edu&config=sample-10BT&split=train"
        : > "$sample.part"
        for offset in $(seq 0 100 $(( ${FINEWEB_DOCS:-20000} - 100 ))); do
            curl -fsL --retry 3 "$api&offset=$offset&length=100" | jq -c '.rows[].row | {text: .text}' >> "$sample.part"
        done
        mv "$sample.part" "$sample"
    fi
    set -- "$sample" "$@"
fi
exec scripts/prepare_jsonl.sh "$out" "$@"
