#!/usr/bin/env bash
# Where NCCL is installed (nccl.h and libnccl under NCCL_HOME or CUDA_HOME, or the system's paths), `make` must build
# the multi-GPU programs: the mode line says "NCCL <version>: multi-GPU" and ./train_sdm links libnccl. NCCL=0 must
# say it builds single-GPU, and NCCL=1 must refuse where NCCL is absent. Needs the built ./train_sdm (make test builds
# it first). TRAIN_SDM overrides the binary checked.
pass=0; fail=0
check() {
    if [ "$1" = "$2" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL $3: got '$1', want '$2'"; fi
}
cd "$(dirname "$0")/.."
cuda=${CUDA_HOME:-/usr/local/cuda}; nccl=${NCCL_HOME:-$cuda}
bin=${TRAIN_SDM:-./train_sdm}
# The make of the user's shell, not a sub-make of `make test` (which prints no mode line).
mk() { env -u MAKELEVEL -u MAKEFLAGS -u MFLAGS make --no-print-directory -n "$@" 2>&1 | head -n 1; }

header=$(ls "$nccl/include/nccl.h" "$cuda/include/nccl.h" /usr/include/nccl.h 2>/dev/null | head -n 1)
lib=$(ls "$nccl"/lib64/libnccl.so* "$nccl"/lib/libnccl.so* "$cuda"/lib64/libnccl.so* 2>/dev/null | head -n 1)
[ -n "$lib" ] || lib=$(ldconfig -p 2>/dev/null | grep -o '/.*libnccl\.so.*' | head -n 1)
if [ -n "$header" ] && [ -n "$lib" ]; then
    echo "NCCL found: $header, $lib"
    check "$(mk train_sdm | grep -cE '^NCCL [0-9]+\.[0-9]+\.[0-9]+: multi-GPU$')" "1" "make's mode line"
    if [ -x "$bin" ]; then
        check "$(readelf -d "$bin" | grep -c 'NEEDED.*libnccl')" "1" "$bin links libnccl"
    else
        check "missing" "built" "$bin (run make first)"
    fi
else
    echo "NCCL not installed here: the link is not checked"
    check "$(mk train_sdm)" "NCCL not found: single-GPU build" "make's mode line"
    check "$(mk NCCL=1 train_sdm | grep -c 'NCCL=1 but nccl.h and libnccl were not found')" "1" "make NCCL=1 refuses"
fi
check "$(mk NCCL=0 train_sdm)" "NCCL=0: single-GPU build" "make NCCL=0's mode line"
check "$(mk NCCL=0 train_sdm | grep -c lnccl)" "0" "make NCCL=0 leaves libnccl out"
check "$(mk NCCL=1 NCCL_HOME=/nonexistent CUDA_HOME=/nonexistent train_sdm | grep -c 'NCCL=1 but')" \
      "$([ -e /usr/include/nccl.h ] && echo 0 || echo 1)" "make NCCL=1 refuses where NCCL is absent"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
