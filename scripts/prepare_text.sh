#!/usr/bin/env bash
# Real text for the loss-by-position comparison (issue 15): the King James Bible (public domain) from Debian's
# bible-kjv-text package, one document per chapter (1189 documents, 4.1 MB, 1.1-18 KB each), every 10th chapter to
# validation (a split by document).
# usage: scripts/prepare_text.sh [BIBLE_OUTPUT.txt] [OUT_DIR]
#   BIBLE_OUTPUT.txt  the output of `bible -l 100000 gen1:1-rev22:21` (chapter headings "Book N", verses "  N text");
#                     without it the packages bible-kjv (the reader, 99 kB) and bible-kjv-text (2.4 MB) are fetched
#                     once with `apt-get download` into data/generated/downloads/kjv and unpacked there (no root, no
#                     installation), unless a `bible` program is already installed.
#   OUT_DIR           default data/generated/kjv (train_*.bin, val_*.bin)
# Documents: the heading line, then the chapter's verses one per line without their numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
input=${1:-}
out=${2:-data/generated/kjv}
downloads=data/generated/downloads/kjv
if [ -z "$input" ]; then
    input=$downloads/kjv.txt
    if [ ! -s "$input" ]; then
        mkdir -p "$downloads"
        if command -v bible >/dev/null; then
            bible=(bible)
        else
            if [ ! -x "$downloads/root/usr/bin/bible" ]; then
                echo "fetching bible-kjv and bible-kjv-text with apt-get download (2.5 MB)"
                (cd "$downloads" && apt-get download bible-kjv bible-kjv-text)
                for deb in "$downloads"/bible-kjv*.deb; do dpkg-deb -x "$deb" "$downloads/root"; done
            fi
            bible=("$downloads/root/usr/bin/bible" -p "$downloads/root/usr/lib")
        fi
        "${bible[@]}" -l 100000 gen1:1-rev22:21 > "$input.part" && mv "$input.part" "$input"
    fi
fi
docs=$(mktemp)
trap 'rm -f "$docs"' EXIT
# a heading ("Genesis 1", "1 Samuel 3", "Song of Solomon 2") starts a document; blank lines separate documents
awk '/^[^ ].* [0-9]+$/ { if (n++) print ""; print; next }
     /^ +[0-9]+ / { sub(/^ +[0-9]+ /, ""); print }' "$input" > "$docs"
[ -s "$docs" ] || { echo "prepare_text: no chapters in $input (expected the output of bible)" >&2; exit 1; }
make --no-print-directory prepare_data >/dev/null
./prepare_data --format text --unit para --val-every 10 --quiet -o "$out" "$docs"
