#!/bin/sh
# cuda/test-cuda.sh: runs the CUDA test binaries of a build
# (tests/test_cuda.c: backend, kernels, NCCL; tests/test_cuda_train.c: DP,
# DDP and compare on CUDA devices; tests/test_bench_cuda.c: bench) and says plainly whether the GPU half ran or was
# skipped.
#   sh cuda/test-cuda.sh [BUILD]        (make test-cuda runs this)
# Exit status: non-zero on any failure; 0 when every test that could run
# passed (on a machine without a GPU only the host-side half runs).
build=${1:-build}
TANDEM_BIN=$(cd "$build" && pwd)/tandem; export TANDEM_BIN
# Real GPUs only: the tests that use the emulator set it themselves.
unset TANDEM_CUDA_EMULATOR
all=""
for name in test_cuda test_cuda_train test_bench_cuda; do
  bin="$build/tests/$name"
  if [ ! -x "$bin" ]; then
    echo "test-cuda: $bin not found; run make first" >&2
    exit 1
  fi
  out=$("$bin" --verbose --jobs 1 2>&1); rc=$?
  printf '%s\n' "$out" | grep -E '^\[(PASS|FAIL|ERR )|Synthesis|Assertion|failed' | grep -v '^\[----\]'
  line=$(printf '%s\n' "$out" | grep 'Synthesis:' | tail -1)
  t=$(printf '%s' "$line" | sed -n 's/.*Tested: \([0-9]*\).*/\1/p'); t=${t:-0}
  p=$(printf '%s' "$line" | sed -n 's/.*Passing: \([0-9]*\).*/\1/p'); p=${p:-0}
  if [ $rc -ne 0 ] || [ "$t" != "$p" ]; then
    echo "test-cuda: $name FAILED ($line)"
    exit 1
  fi
  all="$all
$out"
done
skipped=$(printf '%s\n' "$all" | grep -c '^\[SKIP\]')
passed=$(printf '%s\n' "$all" | grep -c '^\[PASS\]')
reason=$(printf '%s\n' "$all" | sed -n 's/^\[SKIP\] cuda_gpu::[a-z_0-9]*: //p' | sort -u | head -1)
if printf '%s\n' "$all" | grep -q '^\[PASS\] cuda_gpu::'; then
  echo "test-cuda: GPU tests ran: $passed passed, $skipped skipped"
else
  echo "test-cuda: SKIPPED $skipped GPU tests: ${reason:-no CUDA device}"
  nodev=$(printf '%s\n' "$all" | grep -cE '^\[PASS\] (cuda|bench)_nodev::')
  emu=$(printf '%s\n' "$all" | grep -c '^\[PASS\] cuda_emu::')
  cli=$(printf '%s\n' "$all" | grep -cE '^\[PASS\] (cuda_emu_cli|bench_emu)::')
  echo "test-cuda: host-side tests passed: $nodev fail-fast, $emu on the kernel emulator," \
       "$cli of the CLI on emulated GPUs"
  echo "test-cuda: the CUDA backend is built, not run on a GPU"
fi
exit 0
