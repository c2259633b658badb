#!/bin/sh
# cuda/check-api.sh: does a CUDA toolkit (and its NCCL) provide every
# CUDA runtime, cuBLAS and NCCL function the backend calls? For building
# against an older toolkit than the default one, e.g. a CUDA 12.x for a
# driver older than R580, which cannot run CUDA 13 (docs/CUDA.md, "Drivers").
#   sh cuda/check-api.sh TOOLKIT_ROOT [NCCL_ROOT] [BUILD]
# Takes the undefined cuda*/cublas*/nccl* symbols of BUILD/cuda/*.o (the
# calls are the same whichever toolkit compiled them; nvcc's own __cuda*
# stubs are left out, the toolkit's nvcc makes its own), looks each up in
# the exported symbols of TOOLKIT/lib64 (or lib) libcudart.so and
# libcublas.so and NCCL_ROOT's libnccl.so (default: the toolkit's, then
# the system's), and checks nccl.h for NCCL >= 2.18.1 (ncclCommSplit; non-blocking
# communicators, ncclCommFinalize). Exit 0 when everything is there.
root=${1:?usage: sh cuda/check-api.sh TOOLKIT_ROOT [NCCL_ROOT] [BUILD]}
nccl=${2:-$root}
build=${3:-build}
objs=$(ls "$build"/cuda/*.o 2>/dev/null)
[ -n "$objs" ] || { echo "check-api: no $build/cuda/*.o; run make first" >&2; exit 1; }
lib() { # lib DIR NAME: the first DIR/{lib64,lib,lib/x86_64-linux-gnu,}/NAME, or /usr/lib's
  for d in "$1/lib64" "$1/lib" "$1/lib/x86_64-linux-gnu" "$1" /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/$2" ] && { echo "$d/$2"; return 0; }
  done
  return 1
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tandem-api.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
bad=0
for l in "$root:libcudart.so" "$root:libcublas.so" "$nccl:libnccl.so"; do
  f=$(lib "${l%%:*}" "${l#*:}") || { echo "check-api: ${l#*:} not found under ${l%%:*}"; bad=1; continue; }
  echo "check-api: $f"
  nm -D --defined-only "$f" | awk '{print $NF}' | sed 's/@.*//' >> "$tmp/have"
done
nm -u $objs | awk '{print $NF}' | grep -E '^(cuda|cublas|nccl)' | sort -u > "$tmp/need"
sort -u "$tmp/have" -o "$tmp/have"
missing=$(comm -23 "$tmp/need" "$tmp/have")
echo "check-api: $(wc -l < "$tmp/need") functions used"
if [ -n "$missing" ]; then
  echo "check-api: MISSING:"; printf '  %s\n' $missing; bad=1
fi
h=$(ls "$nccl/include/nccl.h" /usr/include/nccl.h 2>/dev/null | head -1)
if [ -n "$h" ]; then
  v=$(sed -n 's/^#define NCCL_VERSION_CODE *\([0-9]*\).*/\1/p' "$h")
  echo "check-api: $h: NCCL_VERSION_CODE ${v:-?}"
  [ "${v:-0}" -ge 21801 ] || { echo "check-api: NCCL older than 2.18.1 (ncclCommSplit)"; bad=1; }
else
  echo "check-api: nccl.h not found under $nccl/include or /usr/include"; bad=1
fi
[ $bad -eq 0 ] && echo "check-api: OK: every function the backend calls is there"
exit $bad
