#!/usr/bin/env bash
# The tree is layered by folder and nothing includes upward:
#   core/                    the base (errors, CUDA helpers, config, matmul, RNG, collectives)   includes core/
#   data/ sdm/ attention/    the modules, each knowing only the base                              core/ + itself
#   model/                   the model: description, CPU and GPU model, checkpoints, optimizer    everything below
#   tools/                   stand-alone utilities                                                core/ + itself
# Programs (train_sdm.cu, infer_sdm.cu, data/prepare_data.c) and tests/ may include anything.
# Usage: tests/test_layers.sh [ROOT] (default: the repository root).
pass=0; fail=0
root=${1:-"$(dirname "$0")/.."}
cd "$root" || { echo "0 passed, 1 failed"; exit 1; }

allowed() {  # allowed FOLDER -> the folders it may include from
    case $1 in
        core) echo "core" ;;
        data|sdm|attention|tools) echo "core $1" ;;
        model) echo "core data sdm attention model" ;;
    esac
}

for dir in core data sdm attention model tools; do
    [ -d "$dir" ] || continue
    ok_dirs=" $(allowed "$dir") "
    for f in "$dir"/*; do
        [ -f "$f" ] || continue
        case $f in data/prepare_data.c) continue ;; esac  # a program, not a layer file
        bad_lines=$(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" | while IFS= read -r line; do
            inc=${line#*\"}; inc=${inc%%\"*}
            top=${inc%%/*}
            [ "$top" = "$inc" ] && { echo "$line (include without a folder)"; continue; }
            case $ok_dirs in *" $top "*) ;; *) echo "$line" ;; esac
        done)
        if [ -n "$bad_lines" ]; then
            while IFS= read -r l; do echo "FAIL $f:$l: $dir/ may include only: $(allowed "$dir")"; done <<< "$bad_lines"
            fail=$((fail + 1))
        else
            pass=$((pass + 1))
        fi
    done
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
