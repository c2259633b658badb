#!/bin/sh
# cuda/test-cuda.sh: runs the CUDA test binaries of a build
# (tests/test_cuda.c: backend, kernels, NCCL; tests/test_cuda_train.c: DP,
# DDP and compare on CUDA devices; tests/test_bench_cuda.c: bench) and says
# plainly whether the GPU half ran or was skipped, and why.
#   sh cuda/test-cuda.sh [BUILD]        (make test-cuda runs this)
# Exit status: 1 on any failure, and also when the kernel driver sees GPUs
# but no GPU test ran (e.g. a driver too old for this build's CUDA runtime:
# that is a broken setup, not a machine without a GPU); 0 when every test
# that could run passed and either a GPU test ran or no GPU is present.
# The stricter one-GPU validation kit is cuda/test-gpu.sh (make test-gpu).
KIT_NAME=test-cuda
. "$(dirname "$0")/test-lib.sh"
kit_setup "${1:-build}" || exit 1
kit_probe
for name in test_cuda test_cuda_train test_bench_cuda; do
  kit_run "$name"
done
if [ -n "$KIT_FAILED" ]; then
  echo "test-cuda: FAILED:$KIT_FAILED"
  exit 1
fi
skipped=$(kit_count '^\[SKIP\]')
passed=$(kit_count '^\[PASS\]')
if [ "$(kit_count '^\[PASS\] cuda_(gpu|multi)::')" -gt 0 ]; then
  echo "test-cuda: GPU tests ran: $passed passed, $skipped skipped"
  exit 0
fi
reason=$(kit_skip_reason cuda_gpu)
if [ "$KIT_NGPU" -gt 0 ]; then
  kit_gpus_but_nothing_ran "$reason"
  exit 1
fi
echo "test-cuda: SKIPPED $skipped GPU tests: ${reason:-no CUDA device} (the kernel driver sees no GPU)"
nodev=$(kit_count '^\[PASS\] (cuda|bench)_nodev::')
emu=$(kit_count '^\[PASS\] cuda_emu::')
cli=$(kit_count '^\[PASS\] (cuda_emu_cli|bench_emu)::')
echo "test-cuda: host-side tests passed: $nodev fail-fast, $emu on the kernel emulator," \
     "$cli of the CLI on emulated GPUs"
echo "test-cuda: the CUDA backend is built, not run on a GPU"
exit 0
