#!/bin/sh
# cuda/test-gpu.sh: the one-GPU validation kit (make test-gpu). Runs, on
# the GPUs there are (one is enough):
#   1. every CUDA test binary in full (what test-cuda runs: kernels vs host,
#      cuBLAS gemm, MLP/CNN training vs host, NCCL with 1, 2 and 3 ranks
#      sharing the GPU and a killed rank caught by the watchdog, DP on one
#      GPU and with 2-3 handles on it, DDP over NCCL vs one device with 1-3
#      ranks, bench, compare and train on the GPU, plus the host-side and
#      emulator suites), the GPT's (test_cuda_gpt) and FSDP's GPU and
#      emulator tests (test_fsdp_cli: two NCCL ranks sharing the GPU), and
#      --deterministic's one rank against two NCCL ranks sharing the GPU
#      (test_det_gpu: the same checkpoint bytes);
#   2. compute-sanitizer memcheck over the single-process GPU tests
#      (kernels, gemm, models, DP, peer copies), when it is installed;
# then prints a one-screen summary, also written to OUT/test-gpu.txt
# (the whole output to OUT/test-gpu.log).
#   sh cuda/test-gpu.sh [BUILD]
# Exit status: 0 when every one-GPU test (suite cuda_gpu) ran and passed,
# nothing else failed and memcheck found no error; 1 otherwise, in
# particular when a cuda_gpu test skipped on a machine with a GPU (e.g. a
# driver too old for this build); 77 when there is no GPU at all: nothing
# ran on a GPU, so nothing was validated (docs/CUDA.md says why this is not
# 0). Tests that need two or more GPUs (suite cuda_multi) are reported,
# not required.
#   TANDEM_COMPUTE_SANITIZER  compute-sanitizer to use ["none" to skip]
#                             [on PATH, else /usr/local/cuda/bin/]
#   TANDEM_KIT_OUT            OUT, where the summary and log go [BUILD]
#   TANDEM_MEMCHECK_TIMEOUT   seconds each memcheck run may take; one
#                             stopped there reports what it checked [none]
#   TANDEM_KIT_BUDGET         the time budget the summary warns past [480]
# A compute-sanitizer that cannot start (no test ran under it, no error
# found) is reported, not failed: memcheck runs where it starts.
KIT_NAME=test-gpu
. "$(dirname "$0")/test-lib.sh"
kit_setup "${1:-build}" || exit 1
out=${TANDEM_KIT_OUT:-$KIT_BUILD}
budget=${TANDEM_KIT_BUDGET:-480}
log="$out/test-gpu.log"
summary="$out/test-gpu.txt"
# everything from here on goes to the screen and to the log
if [ -z "$KIT_TEE" ]; then
  rm -f "$out/.test-gpu.rc"
  KIT_TEE=1 sh "$0" "$@" 2>&1 | tee "$log"
  # the status of the first command of the pipe, in POSIX sh
  exit "$(cat "$out/.test-gpu.rc" 2>/dev/null || echo 1)"
fi
finish() { echo "$1" > "$out/.test-gpu.rc"; exit "$1"; }

t0=$(date +%s)
kit_probe
kit_versions
echo "test-gpu: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -n); $KIT_NGPU GPU(s) seen by the driver"

# 1. every CUDA test binary
for name in test_cuda test_cuda_train test_bench_cuda test_cuda_gpt test_det_gpu; do
  kit_run "$name"
done
# FSDP's GPU test and its emulator twins (its host-only CLI tests are make test's)
kit_run test_fsdp_cli --filter '+(cuda_gpu|fsdp_emu)/*'
t1=$(date +%s)

# 2. memcheck over the single-process GPU tests (NCCL and the CLI fork
#    processes of their own and are left out)
san=${TANDEM_COMPUTE_SANITIZER:-$(command -v compute-sanitizer 2>/dev/null ||
      { [ -x /usr/local/cuda/bin/compute-sanitizer ] && echo /usr/local/cuda/bin/compute-sanitizer; })}
memcheck="not run: no GPU"
mc_bad=0
if [ "$KIT_NGPU" -gt 0 ]; then
  if [ -z "$san" ] || [ "$san" = none ]; then
    memcheck="not run: compute-sanitizer not installed (set TANDEM_COMPUTE_SANITIZER)"
  else
    memcheck=""
    for spec in "test_cuda:cuda_gpu/!(nccl*|cli*|describe)" \
                "test_cuda_train:cuda_gpu/@(dp_*|peer_copy*)"; do
      name=${spec%%:*}; filter=${spec#*:}
      # with a per-run limit, what is left of the budget bounds it too
      if [ -n "${TANDEM_MEMCHECK_TIMEOUT:-}" ]; then
        room=$((budget - ($(date +%s) - t0) - 20))
        if [ $room -lt 15 ]; then
          memcheck="$memcheck $name: not run, the time budget was used up;"
          continue
        fi
        [ $room -lt "$TANDEM_MEMCHECK_TIMEOUT" ] && TANDEM_MEMCHECK_TIMEOUT=$room
      fi
      echo "test-gpu: memcheck: $name --filter '$filter'"
      ${TANDEM_MEMCHECK_TIMEOUT:+timeout -k 10 "$TANDEM_MEMCHECK_TIMEOUT"} \
      "$san" --tool memcheck --target-processes all --error-exitcode 86 --print-limit 20 \
        "$KIT_BUILD/tests/$name" --verbose --jobs 1 --filter "$filter" > "$KIT_OUT.1" 2>&1; rc=$?
      grep -E 'ERROR SUMMARY|Synthesis|Invalid|FAIL' "$KIT_OUT.1" | sort | uniq -c | head -20
      errs=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$KIT_OUT.1" |
             awk '{s += $1} END {print s + 0}')
      line=$(grep 'Synthesis:' "$KIT_OUT.1" | tail -1)
      t=$(printf '%s' "$line" | sed -n 's/.*Tested: \([0-9]*\).*/\1/p'); t=${t:-0}
      p=$(printf '%s' "$line" | sed -n 's/.*Passing: \([0-9]*\).*/\1/p'); p=${p:-0}
      ran=$(grep -c '^\[\(PASS\|FAIL\)\]' "$KIT_OUT.1")
      if [ "$errs" -eq 0 ] && [ -n "$TANDEM_MEMCHECK_TIMEOUT" ] && { [ $rc -eq 124 ] || [ $rc -eq 137 ]; }; then
        memcheck="$memcheck $name: stopped after ${TANDEM_MEMCHECK_TIMEOUT} s, 0 errors in the $ran tests it ran;"
      elif [ "$errs" -eq 0 ] && [ "$t" = 0 ] && [ "$ran" = 0 ]; then
        why=$(grep -m1 -E '^========= (Error|ERROR)|rror' "$KIT_OUT.1" | cut -c1-100)
        memcheck="$memcheck $name: compute-sanitizer did not start (exit $rc: ${why:-no message}), not checked;"
      elif [ $rc -ne 0 ] || [ "$errs" -gt 0 ] || [ "$t" = 0 ] || [ "$t" != "$p" ]; then
        mc_bad=1
        memcheck="$memcheck $name: FAILED (exit $rc, $errs error(s), $p/$t tests passed);"
        tail -40 "$KIT_OUT.1"
      else
        memcheck="$memcheck $name: $t tests, 0 errors;"
      fi
    done
  fi
fi
t2=$(date +%s)

# 3. the verdict and the summary
row() {
  printf '  %-16s %6s %6s %7s  %s\n' "$1" "$(kit_count "^\[PASS\] $1::")" \
    "$(kit_count "^\[FAIL\] $1::")" "$(kit_count "^\[SKIP\] $1::")" "$2"
}
gpu_pass=$(kit_count '^\[PASS\] cuda_gpu::')
not_run=$(sed -n 's/^\[SKIP\] \(cuda_gpu::[a-z_0-9]*\): \(.*\)/    \1: \2/p' "$KIT_OUT" | cut -c1-160)
if [ "$KIT_NGPU" -eq 0 ]; then
  verdict="NO GPU: nothing ran on a GPU, nothing was validated (exit 77)"; code=77
  [ -n "$KIT_FAILED" ] && { verdict="FAILED:$KIT_FAILED (and no GPU)"; code=1; }
elif [ -n "$KIT_FAILED" ]; then
  verdict="FAILED:$KIT_FAILED"; code=1
elif [ -n "$not_run" ] || [ "$gpu_pass" -eq 0 ]; then
  verdict="FAILED: one-GPU tests did not run (see 'not run' above)"; code=1
elif [ $mc_bad -ne 0 ]; then
  verdict="FAILED: memcheck"; code=1
else
  verdict="PASS: all $gpu_pass one-GPU tests ran and passed"; code=0
fi
{
  echo "==== test-gpu summary ========================================================"
  echo "  when             $(date -u '+%Y-%m-%d %H:%M UTC'), host $(uname -n), commit ${KIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  printf '%s\n' "$KIT_GPUS" | sed '/^$/d; s/^/  device           /'
  [ "$KIT_NGPU" -eq 0 ] && echo "  device           none (no nvidia-smi GPU, no /proc/driver/nvidia/gpus)"
  echo "  driver           kernel ${KIT_KDRIVER:-unknown}, supports CUDA ${KIT_DRV:-?}; build's runtime CUDA ${KIT_RT:-?}"
  [ -n "$KIT_CUDA" ] && echo "  cuda             $KIT_CUDA" | cut -c1-160
  printf '  %-16s %6s %6s %7s\n' suite passed failed skipped
  row cuda_gpu "one GPU: must all pass"
  row cuda_multi "need 2+ GPUs: reported only"
  row cuda_emu "kernel emulator (host)"
  row cuda_emu_cli "CLI on emulated GPUs"
  row bench_emu "bench on emulated GPUs"
  row bench_check "bench's #wrong check"
  row cuda_nodev "no-GPU failure paths"
  row bench_nodev "no-GPU failure paths"
  row fsdp_emu "FSDP on emulated GPUs"
  if [ -n "$not_run" ] && [ "$KIT_NGPU" -gt 0 ]; then echo "  not run:"; printf '%s\n' "$not_run" | head -8; fi
  echo "  memcheck         ${memcheck# }"
  echo "  time             $((t2 - t0)) s (tests $((t1 - t0)) s, memcheck $((t2 - t1)) s; budget $budget s)"
  [ $((t2 - t0)) -gt "$budget" ] && echo "  WARNING          over the $budget-second budget"
  echo "  verdict          $verdict"
  echo "==============================================================================="
} > "$summary"
cat "$summary"
if [ $code -eq 77 ]; then
  echo "test-gpu: no GPU: nothing ran on a GPU. The host-side and emulator suites above passed, but"
  echo "test-gpu: they validate no CUDA call; run make test-gpu on a machine with an NVIDIA GPU."
elif [ "$KIT_NGPU" -gt 0 ] && [ "$gpu_pass" -eq 0 ]; then
  kit_gpus_but_nothing_ran "$(kit_skip_reason cuda_gpu)"
fi
finish $code
