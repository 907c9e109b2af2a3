#!/usr/bin/env bash
# Citations of the design documents resolve inside the repository: no source file cites the external design spec or a
# numbered section (the section sign, U+00A7) of a document outside the repository, and every
# `docs/<PAGE>.md#<anchor>` (and every link between the docs/ pages) names an existing page and one of its headings
# (GitHub slugs: lower case, punctuation dropped, spaces as hyphens, repeated headings numbered -1, -2, ...).
# Usage: tests/test_docs.sh [ROOT] (default: the repository root).
pass=0; fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
root=${1:-"$(dirname "$0")/.."}
cd "$root" || { echo "0 passed, 1 failed"; exit 1; }

# Source files that may carry citations (not build outputs or generated data).
files=$(find . \( -name .git -o -name build -o -name generated -o -name runs \) -prune -o -type f \
    \( -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.c' -o -name '*.md' -o -name '*.sh' -o -name '*.cfg' \
       -o -name Makefile \) -print | sort)

# The anchors of a Markdown page, one per line.
anchors() {
    awk '
        /^```/ { fence = !fence; next }
        fence || !/^#+ / { next }
        {
            h = $0; sub(/^#+ +/, "", h); sub(/ +#* *$/, "", h)
            s = tolower(h); gsub(/[^a-z0-9 _-]/, "", s); gsub(/ /, "-", s)
            if (s in seen) { n = seen[s]++; print s "-" n } else { seen[s] = 1; print s }
        }' "$1"
}

# 1. No citation of the external spec, and no section sign (numbered sections of documents outside the repository).
spec='SDM_''SPEC'             # spelled apart so that this file does not cite it
sect=$(printf '\302\247')    # the section sign in UTF-8, likewise
for f in $files; do
    hits=$(grep -n -e "$spec" -e "$sect" "$f")
    if [ -n "$hits" ]; then
        while IFS= read -r h; do
            bad "$f:$h: cites a document outside the repository (cite docs/<PAGE>.md#<anchor>)"
        done <<< "$hits"
    else
        ok
    fi
done

# 2. Every docs/<PAGE>.md[#<anchor>] citation in a source file, and every PAGE.md[#anchor] or #anchor link inside docs/.
# check FILE TARGET_PAGE ANCHOR
check() {
    if [ ! -f "$2" ]; then bad "$1: cites $2, which does not exist"; return; fi
    if [ -n "$3" ] && ! anchors "$2" | grep -qx -- "$3"; then
        bad "$1: cites $2#$3, which is not a heading of $2"; return
    fi
    ok
}
for f in $files; do
    for ref in $(grep -o 'docs/[A-Za-z0-9_.-]*\.md\(#[A-Za-z0-9_-]*\)\?' "$f" | sort -u); do
        page=${ref%%#*}; anchor=""; [ "$page" != "$ref" ] && anchor=${ref#*#}
        check "$f" "$page" "$anchor"
    done
done
for f in docs/*.md; do
    [ -f "$f" ] || continue
    for link in $(grep -o '](\([A-Za-z0-9_.-]*\.md\)\?\(#[A-Za-z0-9_-]*\)\?)' "$f" | sort -u); do
        target=${link#](}; target=${target%)}
        page=${target%%#*}; anchor=""; [ "$page" != "$target" ] && anchor=${target#*#}
        [ -z "$page" ] && page=$(basename "$f")
        check "$f" "docs/$page" "$anchor"
    done
done

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
