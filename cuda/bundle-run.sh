#!/bin/sh
# run.sh: the tandem GPU bundle's one command (made on a Debian machine by
# `make gpu-bundle` from cuda/bundle-run.sh; docs/CUDA_TESTING.md, "Validating on
# a bare GPU machine"). On a machine with an NVIDIA driver, the CUDA
# toolkit and (optionally) PyTorch, and nothing else: no packages, no
# network, no root. Built and tested without a GPU (tests/test_gpu_bundle.c
# runs it to the no-GPU verdict); not yet run on a GPU.
#   sh run.sh [OUTDIR]           find the libraries, validate, benchmark
#   sh run.sh --check [OUTDIR]   only find the libraries and check that
#                                every binary resolves them
# 1. finds cuBLAS (the toolkit's lib64, the system, or pip's nvidia/cublas
#    of the python3 that has torch) and NCCL (the toolkit, the system, or
#    pip's nvidia/nccl), says which files it uses, and checks with ldd that
#    every binary and library of the bundle resolves;
# 2. runs the one-GPU validation, cuda/test-gpu.sh (every cuda_gpu test,
#    NCCL with 2-3 ranks sharing the GPU, DP with handles on one GPU,
#    DDP/FSDP over NCCL vs one device, compute-sanitizer memcheck where it
#    starts), bounded in time;
# 3. with a GPU, the benchmarks, cuda/gpu-bench.sh (cuBLAS sgemm at the
#    models' shapes against the card's peak, one-GPU training throughput,
#    PyTorch training the same GPT on the same GPU);
# 4. writes OUTDIR/summary.txt, OUTDIR/run.log (everything),
#    OUTDIR/results.json, and the kit's OUTDIR/test-gpu.{txt,log}.
# Exit status as cuda/test-gpu.sh's: 0 when every one-GPU test ran on the
# GPU and passed and the benchmarks ran; 1 on any failure (a run where no
# GPU test executed on a machine with a GPU included); 77 without a GPU
# (nothing validated).
# Environment: CUDA_HOME (the toolkit; default: above nvcc, else
# /usr/local/cuda), TANDEM_PYTHON (the python3 with torch),
# TANDEM_CUBLAS_LIB / TANDEM_NCCL_LIB (the files to use), TANDEM_RUN_BUDGET
# (seconds for the whole run, default 360).
bundle=$(cd "$(dirname "$0")" && pwd)
check_only=0
if [ "${1:-}" = "--check" ]; then check_only=1; shift; fi
out=${1:-$PWD/tandem-gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$out" || { echo "run.sh: cannot create $out" >&2; exit 1; }
out=$(cd "$out" && pwd)
log="$out/run.log"
# everything from here on goes to the screen and to the log
if [ -z "${TANDEM_RUN_TEE:-}" ]; then
  rm -f "$out/.run.rc"
  if [ $check_only = 1 ]; then set -- --check "$out"; else set -- "$out"; fi
  TANDEM_RUN_TEE=1 sh "$0" "$@" 2>&1 | tee "$log"
  exit "$(cat "$out/.run.rc" 2>/dev/null || echo 1)"
fi
t0=$(date +%s)
budget=${TANDEM_RUN_BUDGET:-360}
unset TANDEM_CUDA_EMULATOR
manifest() { sed -n "s/^$1=//p" "$bundle/BUNDLE.txt" | head -1; }
# ld.so.cache's list (ldconfig is in /sbin, often not on a user's PATH)
ldcache() { { command -v ldconfig > /dev/null 2>&1 && ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null; }
say() { echo "run.sh: $*"; }
# JSON strings: backslashes, quotes and control characters escaped
js() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\t\n\r' '   ')"; }
# problems fail the run whether or not there is a GPU; a missing cuBLAS or
# NCCL only matters with one, where the GPU tests then fail and say why
problems=""
problem() { say "PROBLEM: $*"; problems="$problems$*; "; }
notes=""
note() { say "NOTE: $*"; notes="$notes$*; "; }
finish() {
  echo "$1" > "$out/.run.rc"
  exit "$1"
}

say "bundle $bundle: commit $(manifest commit), built $(manifest built)"
say "results go to $out"

# --- the machine -----------------------------------------------------------
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
need=$(manifest glibc_needed)
older() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -t. -k1,1n -k2,2n -k3,3n | head -1)" = "$1" ]; }
if [ -n "$glibc" ] && [ -n "$need" ] && older "$glibc" "$need"; then
  say "FAILED: this machine's glibc is $glibc; the bundle's binaries need $need or newer"
  say "  (built on $(manifest built)); build the bundle on an older distribution"
  finish 1
fi
# a usable library: a regular, non-empty file
usable() { [ -f "$1" ] && [ -s "$1" ]; }
# sys_has SONAME: the system has a usable copy (ld.so.cache, default folders)
sys_has() {
  for f in $(ldcache | awk -v n="$1" '$1 == n {print $NF}') \
           /lib/x86_64-linux-gnu/"$1" /usr/lib/x86_64-linux-gnu/"$1" /lib64/"$1" /usr/lib64/"$1"; do
    usable "$f" && return 0
  done
  return 1
}
# the C++ runtime and libgcc_s: the system's, else the bundle's compat copies
compat=""
for l in $(manifest libs_compat); do sys_has "$l" || compat=1; done
if [ -n "$compat" ]; then
  need=$(manifest glibc_needed_compat)
  if [ -n "$glibc" ] && older "$glibc" "$need"; then
    say "FAILED: no system libstdc++/libgcc_s, and the bundle's copies need glibc $need (this one: $glibc)"
    finish 1
  fi
  say "libstdc++/libgcc_s: the bundle's copies (lib/compat; the system has none)"
fi

# the toolkit
if [ -z "${CUDA_HOME:-}" ]; then
  n=$(command -v nvcc 2>/dev/null)
  if [ -n "$n" ]; then CUDA_HOME=$(cd "$(dirname "$(readlink -f "$n")")/.." && pwd); else CUDA_HOME=/usr/local/cuda; fi
fi
say "CUDA toolkit: $CUDA_HOME$([ -d "$CUDA_HOME" ] || echo ' (not found)')"
tk_dirs="$CUDA_HOME/lib64 $CUDA_HOME/lib $CUDA_HOME/targets/x86_64-linux/lib"

# the python3 that has torch, and its pip packages' library folders
py="" py_torch="" py_nccl="" py_cublas=""
probe_py='
import importlib.util as u, os, sys
def loc(name):
    try:
        s = u.find_spec(name)
    except Exception:
        return ""
    if s is None:
        return ""
    d = list(s.submodule_search_locations or [])
    return d[0] if d else os.path.dirname(s.origin or "")
print(sys.executable); print(loc("torch")); print(loc("nvidia.nccl")); print(loc("nvidia.cublas"))
'
for c in ${TANDEM_PYTHON:-} python3 /usr/bin/python3 /usr/local/bin/python3 /opt/conda/bin/python3; do
  command -v "$c" > /dev/null 2>&1 || continue
  r=$("$c" -c "$probe_py" 2>/dev/null) || continue
  t=$(printf '%s\n' "$r" | sed -n 2p)
  [ -n "$t" ] || continue
  py=$(printf '%s\n' "$r" | sed -n 1p); py_torch=$t
  py_nccl=$(printf '%s\n' "$r" | sed -n 3p); py_cublas=$(printf '%s\n' "$r" | sed -n 4p)
  break
done
if [ -n "$py" ]; then say "python with torch: $py (torch in $py_torch)"
else say "python with torch: none found (PyTorch comparison skipped; TANDEM_PYTHON names one)"; fi

# find_lib SONAME: "path<TAB>where" of the first usable copy
find_lib() {
  for d in $tk_dirs; do usable "$d/$1" && { printf '%s\ttoolkit\n' "$d/$1"; return 0; }; done
  for f in $(ldcache | awk -v n="$1" '$1 == n {print $NF}'); do
    usable "$f" && { printf '%s\tsystem (ld.so.cache)\n' "$f"; return 0; }
  done
  case $1 in libnccl*) pd=$py_nccl ;; *) pd=$py_cublas ;; esac
  [ -n "$pd" ] && usable "$pd/lib/$1" && { printf '%s\tpip package of %s\n' "$pd/lib/$1" "$py"; return 0; }
  return 1
}
pick() { # pick NAME SONAME OVERRIDE: sets lib_path, lib_where
  lib_path="" lib_where=""
  if [ -n "$3" ]; then
    if usable "$3"; then lib_path=$3; lib_where="given ($4)"; return 0; fi
    say "$1: $4=$3 is not a readable library; looking elsewhere"
  fi
  r=$(find_lib "$2") || return 1
  lib_path=$(printf '%s' "$r" | cut -f1); lib_where=$(printf '%s' "$r" | cut -f2)
}
cublas_so=$(manifest cublas_soname); nccl_so=$(manifest nccl_soname)
if pick cuBLAS "$cublas_so" "${TANDEM_CUBLAS_LIB:-}" TANDEM_CUBLAS_LIB; then
  cublas=$lib_path cublas_where=$lib_where
  say "cuBLAS: $cublas ($cublas_where)"
else
  cublas="" cublas_where="not found"
  note "cuBLAS ($cublas_so) not found in $tk_dirs, ld.so.cache or pip's nvidia/cublas: GPU tests will fail (set TANDEM_CUBLAS_LIB)"
fi
if pick NCCL "$nccl_so" "${TANDEM_NCCL_LIB:-}" TANDEM_NCCL_LIB; then
  nccl=$lib_path nccl_where=$lib_where
  say "NCCL: $nccl ($nccl_where)"
else
  nccl="" nccl_where="not found"
  note "NCCL ($nccl_so) not found in the toolkit, ld.so.cache or pip's nvidia/nccl: NCCL tests will fail (set TANDEM_NCCL_LIB)"
fi
ld_path=""
for f in "$cublas" "$nccl"; do [ -n "$f" ] && ld_path="$ld_path${ld_path:+:}$(dirname "$f")"; done
[ -n "$compat" ] && ld_path="$ld_path${ld_path:+:}$bundle/lib/compat"
LD_LIBRARY_PATH="$ld_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; export LD_LIBRARY_PATH
[ -n "$cublas" ] && { TANDEM_CUBLAS_LIB=$cublas; export TANDEM_CUBLAS_LIB; }
[ -n "$nccl" ] && { TANDEM_NCCL_LIB=$nccl; export TANDEM_NCCL_LIB; }
say "CUDA runtime: $(manifest cudart), in the binaries"

# every binary and library resolves
missing=""
for f in "$bundle/tandem" "$bundle"/tests/test_* "$bundle"/lib/*.so* $cublas $nccl; do
  m=$(ldd "$f" 2>&1 | sed -n 's/^[[:space:]]*\(.*\) => not found.*/\1/p' | tr '\n' ' ')
  [ -n "$m" ] && missing="$missing $(basename "$f"): $m;"
done
if [ -n "$missing" ]; then
  problem "unresolved libraries:$missing"
else
  say "ldd: every binary and library of the bundle resolves (and cuBLAS, NCCL)"
fi
info=$("$bundle/tandem" info 2>&1) || problem "tandem info failed: $info"
printf '%s\n' "$info" | sed -n '/^devices:/,$p' | sed 's/^/run.sh: info: /'
nccl_ver=$(printf '%s\n' "$info" | sed -n 's/^  NCCL  *\([0-9][0-9.]*\).*/\1/p')
cublas_ver=$(printf '%s\n' "$info" | sed -n 's/^  cuBLAS  *\([0-9][0-9.]*\).*/\1/p')

libs_json() {
  printf '{"cublas": {"path": %s, "from": %s, "version": %s}, ' "$(js "$cublas")" "$(js "$cublas_where")" "$(js "$cublas_ver")"
  printf '"nccl": {"path": %s, "from": %s, "version": %s}, ' "$(js "$nccl")" "$(js "$nccl_where")" "$(js "$nccl_ver")"
  printf '"cudart": %s, "compat_libstdcxx": %s, "python": %s, "torch": %s}' "$(js "$(manifest cudart)")" \
    "$([ -n "$compat" ] && echo true || echo false)" "$(js "$py")" "$(js "$py_torch")"
}
if [ $check_only = 1 ]; then
  code=0; [ -n "$problems$notes" ] && code=1
  { printf '{"bundle": {"commit": %s, "built": %s}, "libraries": ' "$(js "$(manifest commit)")" "$(js "$(manifest built)")"
    libs_json; printf ', "problems": %s, "exit": %d}\n' "$(js "$problems$notes")" $code; } > "$out/results.json"
  say "check: $([ $code = 0 ] && echo "every library found and resolved" || echo "FAILED: $problems$notes")"
  finish $code
fi

# --- 2. the one-GPU validation --------------------------------------------
san=$(command -v compute-sanitizer 2>/dev/null || { [ -x "$CUDA_HOME/bin/compute-sanitizer" ] && echo "$CUDA_HOME/bin/compute-sanitizer"; })
vbudget=$((budget * 2 / 3))
say "validation: cuda/test-gpu.sh, at most $vbudget s (memcheck at most 45 s a binary)"
# the kit fits memcheck into its budget itself; the timeout is the backstop
TANDEM_KIT_OUT=$out TANDEM_KIT_BUDGET=$vbudget TANDEM_MEMCHECK_TIMEOUT=45 TANDEM_COMPUTE_SANITIZER=${san:-none} \
  timeout -k 10 $((vbudget + 30)) sh "$bundle/cuda/test-gpu.sh" "$bundle" > "$out/.kit.out" 2>&1
vrc=$?
cat "$out/.kit.out"; rm -f "$out/.kit.out"
if [ $vrc = 124 ] || [ $vrc = 137 ]; then
  problem "the validation did not finish within $((vbudget + 30)) s"
  vrc=1
fi
ksum="$out/test-gpu.txt"
verdict=$(sed -n 's/^  verdict  *//p' "$ksum" 2>/dev/null)
ngpu=$(grep -c '^  device  *GPU [0-9]' "$ksum" 2>/dev/null)
gpus=$(sed -n 's/^  device  *//p' "$ksum" 2>/dev/null | tr '\n' ';' | sed 's/;$//')
driver=$(sed -n 's/^  driver  *//p' "$ksum" 2>/dev/null)
memcheck=$(sed -n 's/^  memcheck  *//p' "$ksum" 2>/dev/null)

# DDP and FSDP over NCCL with ranks sharing the GPU: correctness only
kit_log="$out/test-gpu.log"
nccl_tests="cuda_gpu::nccl_ranks_every_collective cuda_gpu::nccl_killed_rank_is_caught_by_the_watchdog cuda_gpu::ddp_nccl_ranks_match_single_device cuda_gpu::two_nccl_ranks_on_one_gpu_equal_one_host_device"
nccl_lines="" nccl_json=""
for t in $nccl_tests; do
  r=$(grep -m1 -E "^\[(PASS|FAIL|SKIP)\] $t" "$kit_log" 2>/dev/null | sed 's/^\[\([A-Z]*\) *\].*/\1/')
  r=${r:-NOT RUN}
  nccl_lines="$nccl_lines    ${t#cuda_gpu::}: $r
"
  nccl_json="$nccl_json${nccl_json:+, }{\"test\": $(js "$t"), \"result\": $(js "$r")}"
done

# --- 3. benchmarks ------------------------------------------------------------
brc=0
if [ "$ngpu" -gt 0 ] 2>/dev/null; then
  left=$((budget - ($(date +%s) - t0) - 10))
  say "benchmarks: cuda/gpu-bench.sh, $left s left"
  sh "$bundle/cuda/gpu-bench.sh" "$bundle" "$out" "$(( $(date +%s) + left ))" "$py"
  brc=$?
  [ $brc = 0 ] || problem "a benchmark failed (see bench lines above)"
else
  say "benchmarks: not run (no GPU)"
fi

# --- 4. summary, results --------------------------------------------------
t1=$(date +%s)
code=$vrc
[ -n "$problems" ] && code=1
case $code in
  0) final="PASS: validated on the GPU, benchmarks ran" ;;
  77) final="NO GPU: nothing ran on a GPU, nothing was validated (exit 77)" ;;
  *) final="FAILED: ${problems:-the validation failed}" ;;
esac
{
  echo "==== tandem GPU bundle ========================================================"
  echo "  bundle           commit $(manifest commit), built $(manifest built)"
  echo "  machine          $(uname -n), glibc ${glibc:-?}; ${gpus:-no GPU}"
  echo "  driver           ${driver:-?}"
  echo "  cuBLAS           ${cublas_ver:-?} ${cublas:-none} ($cublas_where)"
  echo "  NCCL             ${nccl_ver:-?} ${nccl:-none} ($nccl_where)"
  echo "  CUDA runtime     $(manifest cudart)"
  echo "  validation       ${verdict:-no verdict (see run.log)}"
  echo "  memcheck         ${memcheck:-?}"
  echo "  NCCL ranks sharing one GPU (correctness, not speed):"
  printf '%s' "$nccl_lines"
  [ -f "$out/bench.txt" ] && cat "$out/bench.txt"
  echo "  time             $((t1 - t0)) s (budget $budget s)"
  [ $((t1 - t0)) -gt "$budget" ] && echo "  WARNING          over the $budget s budget"
  echo "  verdict          $final"
  echo "==============================================================================="
} > "$out/summary.txt"
cat "$out/summary.txt"
{
  printf '{"bundle": {"commit": %s, "built": %s, "cuda_archs": %s},\n' "$(js "$(manifest commit)")" \
    "$(js "$(manifest built)")" "$(js "$(manifest cuda_archs)")"
  printf ' "machine": {"host": %s, "glibc": %s, "gpus": %s, "driver": %s},\n' "$(js "$(uname -n)")" \
    "$(js "$glibc")" "$(js "$gpus")" "$(js "$driver")"
  printf ' "libraries": '; libs_json; printf ',\n'
  printf ' "validation": {"exit": %d, "verdict": %s, "memcheck": %s, "suites": {' "$vrc" "$(js "$verdict")" "$(js "$memcheck")"
  sed -n 's/^  \([a-z_]*\)  *\([0-9][0-9]*\)  *\([0-9][0-9]*\)  *\([0-9][0-9]*\).*/"\1": {"passed": \2, "failed": \3, "skipped": \4}/p' \
    "$ksum" 2>/dev/null | paste -sd, - | sed 's/,/, /g'
  printf '}},\n "nccl_shared_gpu_correctness": [%s],\n' "$nccl_json"
  printf ' "benchmarks": '
  if [ -f "$out/bench.json" ]; then cat "$out/bench.json"; else printf 'null'; fi
  printf ',\n "time_s": %d, "budget_s": %d, "problems": %s, "exit": %d}\n' $((t1 - t0)) "$budget" "$(js "$problems")" "$code"
} > "$out/results.json"
say "wrote $out/summary.txt, $out/run.log, $out/results.json, $out/test-gpu.txt, $out/test-gpu.log"
finish $code
