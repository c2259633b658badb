#!/bin/sh
# examples/pbs_ddp.sh: DDP training across the nodes of a PBS job (PBS Pro,
# OpenPBS, Torque), one rank per MPI slot PBS gives, through Open MPI's
# mpirun. Copy it, set the #PBS lines for your site, then
#
#   qsub -v DATA=/shared/fashion-mnist examples/pbs_ddp.sh
#
# PBS starts it on the first node with PBS_NODEFILE naming one host per
# slot; mpirun starts a rank per line there. Every rank runs `tandem train
# --mode ddp` and finds the others through MPI; ranks on one node share
# memory, nodes talk over MPI (backend hier, chosen by itself when the
# ranks span several nodes). Rank 0 prints and writes the checkpoint.
# docs/MULTINODE.md says more; tests/test_job_scripts.c runs this script
# with a faked PBS_NODEFILE on one machine.
#
# Settings, from the environment (qsub -v NAME=value) or their defaults:
#   TANDEM   the tandem binary (on every node)           [tandem on PATH]
#   DATA     --data: a directory every node reads, or synthetic [synthetic]
#   DEVICE   --device: cpu (host devices), cuda (the node's GPUs) [cpu]
#   EPOCHS   --epochs                                             [2]
#   SAVE     --save: a checkpoint path rank 0 can write  [ddp.safetensors]
#   BIND     mpirun --bind-to: core (a core per host rank), or none when
#            the ranks need more cores each (GPUs) or outnumber them [core]
#   TANDEM_ARGS  more options of `tandem train` (e.g. --batch 512)
#   MPIRUN_ARGS  more options of mpirun (e.g. --mca btl_tcp_if_include ib0)
#
#PBS -N tandem-ddp
#PBS -l select=2:ncpus=8:mpiprocs=8
#PBS -l walltime=01:00:00
#PBS -j oe
set -eu
[ -n "${PBS_NODEFILE:-}" ] || {
  echo "pbs_ddp.sh: PBS_NODEFILE is not set: submit this script with qsub (or set PBS_NODEFILE to a file naming one host per rank)" >&2
  exit 2
}
[ -r "$PBS_NODEFILE" ] || { echo "pbs_ddp.sh: PBS_NODEFILE=$PBS_NODEFILE: cannot read it" >&2; exit 1; }
cd "${PBS_O_WORKDIR:-.}"
TANDEM=${TANDEM:-tandem}
ranks=$(grep -c . "$PBS_NODEFILE") || true
nodes=$(grep . "$PBS_NODEFILE" | sort -u | wc -l)
[ "$ranks" -gt 0 ] || { echo "pbs_ddp.sh: $PBS_NODEFILE names no host" >&2; exit 1; }
echo "pbs_ddp.sh: $ranks ranks on $nodes node(s) from $PBS_NODEFILE"
# mpirun hands the ranks on other nodes only the variables named by -x
fwd=""
for v in TANDEM_DEBUG TANDEM_DEBUG_SUBSYS TANDEM_TIMEOUT NCCL_DEBUG; do
  eval "[ -n \"\${$v+set}\" ]" && fwd="$fwd -x $v"
done
# --map-by slot: a node's ranks are consecutive, as the nodefile lists them
# shellcheck disable=SC2086 # fwd, MPIRUN_ARGS and TANDEM_ARGS: lists of options
exec mpirun -np "$ranks" --hostfile "$PBS_NODEFILE" --map-by slot --bind-to "${BIND:-core}" \
    $fwd ${MPIRUN_ARGS:-} \
    "$TANDEM" train --mode ddp --device "${DEVICE:-cpu}" --data "${DATA:-synthetic}" \
    --epochs "${EPOCHS:-2}" --save "${SAVE:-ddp.safetensors}" ${TANDEM_ARGS:-}
