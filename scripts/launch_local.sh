#!/usr/bin/env bash
# Start N processes on this node, one per GPU, with the rank variables core/bootstrap.h reads.
#   scripts/launch_local.sh N ./train_sdm -c configs/sdm_flagship.cfg
# Rank 0 serves the NCCL id on MASTER_PORT (default 29500). Exits with the first non-zero status of any rank.
set -u
n=${1:?usage: launch_local.sh N COMMAND...}; shift
[ $# -gt 0 ] || { echo "launch_local.sh: no command given" >&2; exit 2; }
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500} WORLD_SIZE=$n
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} # no NVLink multicast (shared hosts)
pids=()
for ((r = 0; r < n; r++)); do
    RANK=$r LOCAL_RANK=$r "$@" &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || { s=$?; [ $rc -eq 0 ] && rc=$s; }; done
exit $rc
