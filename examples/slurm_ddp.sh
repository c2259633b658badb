#!/bin/sh
# examples/slurm_ddp.sh: DDP training across the nodes of a Slurm job, one
# rank per task, started by srun. Copy it, set the #SBATCH lines for your
# site, then
#
#   sbatch --export=ALL,DATA=/shared/fashion-mnist examples/slurm_ddp.sh
#
# Slurm runs it on the first node of the allocation; srun starts the job's
# tasks on every node. Each runs `tandem train --mode ddp` and finds the
# others through MPI, which srun's PMIx (--mpi=pmix) sets up; ranks on one
# node share memory, nodes talk over MPI (backend hier, chosen by itself
# when the ranks span several nodes). Rank 0 prints and writes the
# checkpoint. tandem must be built against an MPI whose PMIx Slurm knows
# (Open MPI 4 or 5 usually is: `srun --mpi=list` names the plugins; with
# MPICH use SRUN_MPI=pmi2). docs/MULTINODE.md says more;
# tests/test_job_scripts.c runs this script with faked SLURM_* variables
# and an srun that starts the ranks with mpirun (no Slurm on the test
# machine).
#
# Settings, from the environment (sbatch --export=ALL,NAME=value) or their
# defaults:
#   TANDEM   the tandem binary (on every node)           [tandem on PATH]
#   DATA     --data: a directory every node reads, or synthetic [synthetic]
#   DEVICE   --device: cpu (host devices), cuda (the node's GPUs) [cpu]
#   EPOCHS   --epochs                                             [2]
#   SAVE     --save: a checkpoint path rank 0 can write  [ddp.safetensors]
#   SRUN_MPI srun's --mpi plugin                                  [pmix]
#   TANDEM_ARGS  more options of `tandem train` (e.g. --batch 512)
#   SRUN_ARGS    more options of srun (e.g. --gpus-per-task=1)
#
#SBATCH --job-name=tandem-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --cpus-per-task=1
#SBATCH --time=01:00:00
set -eu
[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_NTASKS:-}" ] || {
  echo "slurm_ddp.sh: SLURM_JOB_ID or SLURM_NTASKS is not set: submit this script with sbatch (or run it inside salloc with --ntasks)" >&2
  exit 2
}
command -v srun >/dev/null 2>&1 || { echo "slurm_ddp.sh: srun not found on PATH: run this script on a Slurm node" >&2; exit 1; }
TANDEM=${TANDEM:-tandem}
echo "slurm_ddp.sh: $SLURM_NTASKS ranks on ${SLURM_JOB_NUM_NODES:-?} node(s) (${SLURM_JOB_NODELIST:-?}), job $SLURM_JOB_ID"
# srun passes the whole environment to the tasks (--export=ALL is its
# default); --kill-on-bad-exit: a rank that fails ends the others at once
# (tandem's own deadlines would, later); --cpu-bind=cores: a core per host
# rank.
# shellcheck disable=SC2086 # SRUN_ARGS and TANDEM_ARGS: lists of options
exec srun --mpi="${SRUN_MPI:-pmix}" --ntasks="$SLURM_NTASKS" --kill-on-bad-exit=1 --cpu-bind=cores ${SRUN_ARGS:-} \
    "$TANDEM" train --mode ddp --device "${DEVICE:-cpu}" --data "${DATA:-synthetic}" \
    --epochs "${EPOCHS:-2}" --save "${SAVE:-ddp.safetensors}" ${TANDEM_ARGS:-}
