#!/bin/sh
# cuda/bundle.sh: the second half of `make gpu-bundle` (cuda/cuda.mk links
# the binaries into BUNDLE first): copies in every shared library they need
# except glibc's own and the CUDA ones (the GPU machine brings its driver,
# cuBLAS from its toolkit and NCCL from its toolkit or pip), the scripts of
# the one-GPU kit and the benchmarks, run.sh, and a manifest; then checks
# that nothing is missing and that the folder fits in MAX_MIB.
#   sh cuda/bundle.sh BUNDLE CUDA_HOME "CUDA_ARCHS" NVCC_VERSION
# Layout: BUNDLE/{run.sh, tandem, tests/test_*, lib/ (libtandem_bundle.so:
# the library and the CUDA backend, and the copies), lib/compat/, cuda/*.sh,
# tests/criterion.sh, tools/torch_gpt_ref.py, BUNDLE.txt}: the binaries sit
# where the kit expects a build (tandem, tests/), the scripts where they sit
# in the repository, so cuda/test-gpu.sh runs unchanged with BUILD = BUNDLE.
set -eu
bundle=${1:?usage: bundle.sh BUNDLE CUDA_HOME CUDA_ARCHS NVCC_VERSION}
cuda_home=${2:?}
archs=${3:?}
nvcc_version=${4:-?}
src=$(cd "$(dirname "$0")/.." && pwd)
MAX_MIB=64

case " $archs " in
  *" 90 "*) ;;
  *) echo "gpu-bundle: CUDA_ARCHS='$archs' has no 90: H100/H200 need sm_90 code (the default is 80 90)" >&2
     exit 1 ;;
esac
bins="$bundle/tandem"
for t in "$bundle"/tests/test_*; do bins="$bins $t"; done

# glibc's libraries come from the GPU machine (they must match its ld.so);
# the CUDA ones are found there by run.sh. Everything else is copied, into
# lib/, except the C++ runtime and libgcc_s: every Linux system has them,
# matched to its own glibc (Debian 12's libstdc++ needs glibc 2.36), and the
# binaries need little of them (CXXABI_1.3), so they go to lib/compat/,
# which run.sh puts on LD_LIBRARY_PATH only where the system lacks them.
keep_out() {
  case $1 in
    linux-vdso.so*|ld-linux*|libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*) return 0 ;;
    libresolv.so.*|libutil.so.*|libanl.so.*|libnsl.so.*|libmvec.so.*) return 0 ;;
    libcuda.so*|libcudart.so*|libcublas*|libnccl.so*|libnvidia-*) return 0 ;;
  esac
  return 1
}
compat_lib() { case $1 in libstdc++.so.*|libgcc_s.so.*) return 0 ;; esac; return 1; }
# oneDNN is not copied: tandem loads libdnnl.so.2 with dlopen on a host
# device's first bfloat16 product (ldd does not list it), and its 38 MiB
# would take the folder over MAX_MIB; without it those products warn once
# and widen to float32 (core/device_host.c).
# lib/ holds libtandem_bundle.so (the make rule's); the copies are redone
find "$bundle/lib" -mindepth 1 ! -name libtandem_bundle.so -exec rm -rf {} +
mkdir -p "$bundle/lib/compat"
# the libraries of the binaries and, through ldd, of their libraries
for f in $bins; do
  ldd "$f" | while read -r name arrow path rest; do
    [ "$arrow" = "=>" ] || continue
    keep_out "$name" && continue
    if [ "$path" = "not" ]; then echo "gpu-bundle: $f needs $name, not found on this machine" >&2; exit 1; fi
    dest="$bundle/lib/$name"
    compat_lib "$name" && dest="$bundle/lib/compat/$name"
    [ -e "$dest" ] || cp -L "$path" "$dest"
  done
done
chmod 644 "$bundle"/lib/*.so* "$bundle"/lib/compat/*

# the scripts, where the kit looks for them
mkdir -p "$bundle/cuda" "$bundle/tools"
cp "$src/cuda/test-gpu.sh" "$src/cuda/test-lib.sh" "$src/cuda/gpu-bench.sh" "$bundle/cuda/"
cp "$src/tests/criterion.sh" "$bundle/tests/"
cp "$src/tools/torch_gpt_ref.py" "$bundle/tools/"
cp "$src/cuda/bundle-run.sh" "$bundle/run.sh"

# the newest glibc symbol version anything here needs: run.sh compares it
# with the GPU machine's glibc before running anything
glibc_of() { for f; do objdump -T "$f"; done 2>/dev/null |
              sed -n 's/.*GLIBC_\([0-9][0-9.]*\).*/\1/p' | sort -u -t. -k1,1n -k2,2n -k3,3n | tail -1; }
glibc=$(glibc_of $bins "$bundle"/lib/*.so*)
glibc_compat=$(glibc_of "$bundle"/lib/compat/*)
cublas_major=$(sed -n 's/^#define CUBLAS_VER_MAJOR *\([0-9]*\).*/\1/p' "$cuda_home/include/cublas_api.h")
commit=$(cd "$src" && git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
  echo "commit=$commit"
  echo "built=$(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -n) ($(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"))"
  echo "nvcc=$nvcc_version"
  echo "cuda_archs=$archs"
  echo "cudart=static (CUDA $nvcc_version)"
  echo "cublas_soname=libcublas.so.${cublas_major:-?}"
  echo "nccl_soname=libnccl.so.2"
  echo "glibc_needed=${glibc:-?}"
  echo "glibc_needed_compat=${glibc_compat:-?}"
  echo "libs=$(cd "$bundle/lib" && ls -d *.so* | tr '\n' ' ' | sed 's/ $//')"
  echo "libs_compat=$(cd "$bundle/lib/compat" && ls | tr '\n' ' ' | sed 's/ $//')"
  echo "onednn=not bundled (libdnnl.so.2 loaded at need from the GPU machine; without it host bfloat16 products widen to float32)"
} > "$bundle/BUNDLE.txt"

# nothing missing: every binary and library resolves with the CUDA
# toolkit's folders on the path (run.sh puts the GPU machine's there)
missing=$(for f in $bins "$bundle"/lib/*.so* "$bundle"/lib/compat/*; do
            LD_LIBRARY_PATH="$cuda_home/lib64:$cuda_home/lib" ldd "$f" 2>&1 | sed -n "s|^\t*\(.*\) => not found|$f: \1|p"
          done)
if [ -n "$missing" ]; then
  echo "gpu-bundle: unresolved libraries:" >&2
  printf '%s\n' "$missing" >&2
  exit 1
fi

bytes=$(du -sb "$bundle" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
nlibs=$(ls -d "$bundle"/lib/*.so* "$bundle"/lib/compat/* | wc -l)
echo "gpu-bundle: $bundle: $mib MiB ($bytes bytes; at most $MAX_MIB MiB): tandem, $(echo "$bins" | wc -w | awk '{print $1 - 1}') test binaries, $nlibs libraries in lib/, run.sh"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "gpu-bundle: $bundle is $mib MiB, over the $MAX_MIB MiB limit" >&2
  exit 1
fi
echo "gpu-bundle: needs glibc >= ${glibc:-?} on the GPU machine (>= ${glibc_compat:-?} if it has no libstdc++ of its own); cuBLAS libcublas.so.${cublas_major:-?} and NCCL 2 are found there"
echo "gpu-bundle: copy the folder to the GPU machine and run: sh gpu-bundle/run.sh [OUTDIR]"
