#!/usr/bin/env bash
# scripts/kernel_profile.sh: the GPU time of every kernel a command launches, summed by kernel name, largest first
# (Nsight Compute with one metric, gpu__time_duration; clocks and caches left as they are). Kernels run one at a
# time under ncu, so the table shows where the time goes, not the overlap. Optional tooling: needs ncu and python3.
#
#   scripts/kernel_profile.sh TOP COMMAND [ARGS...]
#   NCU_ARGS="--profile-from-start off --launch-count 1500" scripts/kernel_profile.sh 20 ./infer_sdm RUN --bench ...
#
# Examples (docs/MODEL.md#step-profile has the by-part profile without ncu):
#   scripts/kernel_profile.sh 40 ./infer_sdm RUN --prompt "Hello" --max-new 24 --temperature 0 --no-graph
#   scripts/kernel_profile.sh 60 ./train_sdm -c configs/sdm_flagship.cfg steps=1 checkpoint.dump_every=0
# infer_sdm --bench brackets its timed decode steps with cudaProfilerStart/Stop, for --profile-from-start off.
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,12p' "$0"; exit 2; }
top=$1; shift
csv=$(mktemp); trap 'rm -f "$csv"' EXIT
# shellcheck disable=SC2086  # NCU_ARGS is a list of options
ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv ${NCU_ARGS:-} "$@" > "$csv"
python3 - "$csv" "$top" <<'PY'
import collections, csv, re, sys
rows, top = list(csv.reader(open(sys.argv[1], errors='replace'))), int(sys.argv[2])
scale = {'nsecond': 1e-3, 'usecond': 1.0, 'msecond': 1e3, 'second': 1e6}
hdr, agg = None, collections.OrderedDict()  # name -> [us, launches, grid, block]
for r in rows:  # the program's own output is interleaved with ncu's rows: keep the rows under the header
    if 'Kernel Name' in r and 'Metric Value' in r:
        hdr = r
        continue
    if not hdr or len(r) != len(hdr):
        continue
    d = dict(zip(hdr, r))
    if d.get('Metric Name') != 'gpu__time_duration.sum':
        continue
    us = float(d['Metric Value'].replace(',', '')) * scale.get(d.get('Metric Unit', 'nsecond'), 1e-3)
    name = re.sub(r'\(.*', '', d['Kernel Name'])[:72]
    a = agg.setdefault(name, [0.0, 0, d.get('Grid Size', ''), d.get('Block Size', '')])
    a[0] += us
    a[1] += 1
total = sum(a[0] for a in agg.values())
print(f"{total / 1e3:.3f} ms of GPU time in {sum(a[1] for a in agg.values())} kernels")
print(f"{'ms':>9} {'share':>6} {'launches':>8} {'us each':>9}  grid / block (first launch)  kernel")
for name, a in sorted(agg.items(), key=lambda x: -x[1][0])[:top]:
    print(f"{a[0] / 1e3:9.3f} {100 * a[0] / total:5.1f}% {a[1]:8d} {a[0] / a[1]:9.2f}  {a[2]} / {a[3]}  {name}")
PY
