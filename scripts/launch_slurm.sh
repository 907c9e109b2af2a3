#!/usr/bin/env bash
# Multi-node run under SLURM: one task per GPU. Submit with, e.g.
#   sbatch --nodes=8 --ntasks-per-node=8 --gpus-per-node=8 \
#       scripts/launch_slurm.sh ./train_sdm -c configs/sdm_flagship.cfg
# core/bootstrap.h reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID; rank 0 (the first node) serves the NCCL id to
# the tasks that show this run's SDM_RUN_SECRET (made here unless set; srun passes the environment on). srun stops
# every task when one fails (--kill-on-bad-exit) and exits non-zero.
set -u
[ $# -gt 0 ] || { echo "launch_slurm.sh: no command given" >&2; exit 2; }
export SDM_RUN_SECRET=${SDM_RUN_SECRET:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
unset RANK WORLD_SIZE LOCAL_RANK # SLURM's variables give the layout
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
# a port per job, below Linux's ephemeral range (32768-60999), where an outgoing connection may hold it
export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 12000))}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
exec srun --kill-on-bad-exit=1 "$@"
