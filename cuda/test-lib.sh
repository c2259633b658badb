# cuda/test-lib.sh: what cuda/test-cuda.sh and cuda/test-gpu.sh share
# (sourced, not run): seeing whether GPUs are present *without CUDA* (the
# kernel driver's own view, so that a driver too old for this build's
# runtime still counts as "a GPU is here"), the driver and runtime
# versions, running a Criterion binary and counting its results.
#
# Overrides, for the tests of these scripts (tests/test_cuda_kit.c) and
# for unusual installs:
#   TANDEM_NVIDIA_SMI   the nvidia-smi to run        [nvidia-smi on PATH]
#   TANDEM_NVIDIA_PROC  the driver's /proc directory [/proc/driver/nvidia]

# Reading Criterion's summary line is tests/criterion.sh's, as in make test.
. "$(dirname "$0")/../tests/criterion.sh"

# kit_setup BUILD: checks the build, exports TANDEM_BIN for the CLI tests,
# clears the emulator (the tests that use it set it themselves) and makes
# KIT_OUT, the file every binary's output is appended to.
kit_setup() {
  KIT_BUILD=$1
  if [ ! -x "$KIT_BUILD/tandem" ]; then
    echo "$KIT_NAME: $KIT_BUILD/tandem not found; run make first" >&2
    return 1
  fi
  TANDEM_BIN=$(cd "$KIT_BUILD" && pwd)/tandem; export TANDEM_BIN
  unset TANDEM_CUDA_EMULATOR
  KIT_OUT=$(mktemp "${TMPDIR:-/tmp}/tandem-kit.XXXXXX") || return 1
  trap 'rm -f "$KIT_OUT" "$KIT_OUT.1"' EXIT
  trap 'exit 130' INT TERM
  KIT_FAILED=""
}

# kit_probe: KIT_NGPU (GPUs the kernel driver sees; 0 without a driver),
# KIT_GPUS (one "GPU i: name" line each) and KIT_KDRIVER (the kernel
# driver's version, e.g. 535.104.05; empty when unknown). nvidia-smi
# first, then /proc/driver/nvidia (present whenever the driver is loaded,
# even when NVML fails, e.g. after a driver update without a reboot).
kit_probe() {
  smi=${TANDEM_NVIDIA_SMI:-nvidia-smi}
  proc=${TANDEM_NVIDIA_PROC:-/proc/driver/nvidia}
  KIT_NGPU=0; KIT_GPUS=""; KIT_KDRIVER=""
  if list=$("$smi" -L 2>/dev/null); then
    KIT_GPUS=$(printf '%s\n' "$list" | grep '^GPU [0-9]')
    KIT_NGPU=$(printf '%s\n' "$KIT_GPUS" | grep -c '^GPU [0-9]')
    KIT_KDRIVER=$("$smi" --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  fi
  if [ "$KIT_NGPU" -eq 0 ] && [ -d "$proc/gpus" ]; then
    i=0
    for g in "$proc"/gpus/*; do
      [ -e "$g" ] || continue
      model=$(sed -n 's/^Model:[[:space:]]*//p' "$g/information" 2>/dev/null | head -1)
      KIT_GPUS="${KIT_GPUS}GPU $i: ${model:-unknown model} (PCI $(basename "$g"))
"
      i=$((i + 1))
    done
    KIT_NGPU=$i
  fi
  if [ -z "$KIT_KDRIVER" ] && [ -r "$proc/version" ]; then
    KIT_KDRIVER=$(sed -n 's/.*Kernel Module[^0-9]*\([0-9][0-9.]*\).*/\1/p' "$proc/version" | head -1)
  fi
}

# kit_versions: KIT_COMMIT (the build's commit, from its version line),
# KIT_RT (this build's CUDA runtime, e.g. 13.0), KIT_DRV
# (the CUDA version the installed driver supports, "none" without one),
# KIT_CUDA (tandem info's device line: the error when no GPU is usable)
# and KIT_NEED (the driver branch this runtime needs), from `tandem info`.
kit_versions() {
  info=$("$KIT_BUILD/tandem" info 2>&1)
  KIT_RT=$(printf '%s\n' "$info" | sed -n 's/^  CUDA runtime *//p' | head -1)
  KIT_DRV=$(printf '%s\n' "$info" | sed -n 's/^  CUDA driver *//p' | head -1)
  KIT_CUDA=$(printf '%s\n' "$info" | sed -n 's/^  cuda  *//p' | head -1)
  KIT_COMMIT=$(printf '%s\n' "$info" | sed -n '1s/^tandem [^ ]* (\(.*\))$/\1/p')
  # NVIDIA's minimum Linux drivers: CUDA 13.x R580, 12.x R525, 11.x R450
  case "${KIT_RT%%.*}" in
    13) KIT_NEED="R580 (580.65.06) or newer" ;;
    12) KIT_NEED="R525 (525.60.13) or newer" ;;
    11) KIT_NEED="R450 (450.80.02) or newer" ;;
    *) KIT_NEED="one that supports CUDA ${KIT_RT:-?}" ;;
  esac
}

# kit_run NAME [ARGS...]: runs $KIT_BUILD/tests/NAME one test at a time,
# prints its result lines, appends its whole output to KIT_OUT and adds
# NAME to KIT_FAILED when it failed (exit status, or fewer passing than
# tested). Returns non-zero on failure.
kit_run() {
  name=$1; shift
  bin="$KIT_BUILD/tests/$name"
  if [ ! -x "$bin" ]; then
    echo "$KIT_NAME: $bin not found; run make first"
    KIT_FAILED="$KIT_FAILED $name"
    return 1
  fi
  "$bin" --verbose --jobs 1 "$@" > "$KIT_OUT.1" 2>&1; rc=$?
  grep -E '^\[(PASS|FAIL|ERR |SKIP)\]|Synthesis|Assertion|failed|CRASH' "$KIT_OUT.1" |
    grep -v '^\[----\]' | cut -c1-200
  cat "$KIT_OUT.1" >> "$KIT_OUT"
  cr_summary < "$KIT_OUT.1"
  line=$CR_LINE; t=$CR_TESTED; p=$CR_PASSED
  if [ $rc -ne 0 ] || [ "$t" != "$p" ] || [ -z "$line" ]; then
    echo "$KIT_NAME: $name FAILED (exit $rc; ${line:-no Criterion summary})"
    KIT_FAILED="$KIT_FAILED $name"
    return 1
  fi
  return 0
}

# kit_count ERE: lines of KIT_OUT matching it.
kit_count() { grep -cE "$1" "$KIT_OUT"; }

# kit_skip_reason SUITE: the first distinct reason its tests gave for skipping.
kit_skip_reason() {
  sed -n "s/^\[SKIP\] $1::[a-z_0-9]*: //p" "$KIT_OUT" | sort -u | head -1
}

# kit_gpus_but_nothing_ran: the loud explanation when the driver sees GPUs
# but no GPU test could use them (tests skipped "no CUDA device: ...").
kit_gpus_but_nothing_ran() {
  kit_versions
  echo "$KIT_NAME: FAILED: $KIT_NGPU GPU(s) present, but no GPU test ran:"
  printf '%s\n' "$KIT_GPUS" | sed "/^\$/d; s/^/$KIT_NAME:   /"
  echo "$KIT_NAME:   the tests said: ${1:-no reason given}"
  echo "$KIT_NAME:   kernel driver ${KIT_KDRIVER:-unknown}; CUDA version the driver supports: ${KIT_DRV:-unknown};" \
       "CUDA runtime of this build: ${KIT_RT:-unknown}"
  echo "$KIT_NAME:   CUDA ${KIT_RT:-?} needs an NVIDIA driver $KIT_NEED. Update the driver, or build"
  echo "$KIT_NAME:   against the CUDA 12.x toolkit the driver supports:"
  echo "$KIT_NAME:     make NVCC=/usr/local/cuda-12.x/bin/nvcc $KIT_NAME   (docs/CUDA.md, \"Drivers\")"
}
