#!/bin/sh
# tools/install.sh BUILD PREFIX [DESTDIR]: installs what `make` built in
# BUILD under DESTDIR/PREFIX: bin/tandem, lib/libtandem.a, with the CUDA
# backend lib/libtandem_cuda.a, the headers under include/tandem/<dir>/,
# and lib/pkgconfig/tandem.pc, so that a program builds with
#   cc prog.c $(pkg-config --cflags --libs tandem)
# (PKG_CONFIG_PATH=PREFIX/lib/pkgconfig where PREFIX is not a system one).
# The backend registers itself from a constructor in cuda/device_cuda.c
# that nothing references, so the .pc asks the linker for one of that
# object's symbols (-Wl,--undefined=tdm_cuda_device_count), which pulls it
# (and what it needs) from the CUDA archive. Called by `make install`; the
# headers come from the source tree this script is in.
set -eu
build=${1:?usage: install.sh BUILD PREFIX [DESTDIR]}
prefix=${2:?usage: install.sh BUILD PREFIX [DESTDIR]}
dest=${3:-}
src=$(cd "$(dirname "$0")/.." && pwd)
case $prefix in /*) ;; *) echo "install.sh: PREFIX must be an absolute path (got '$prefix')" >&2; exit 2;; esac
for f in "$build/tandem" "$build/libtandem.a" "$build/link-libs"; do
  [ -e "$f" ] || { echo "install.sh: $f is missing: run make first" >&2; exit 1; }
done
libs=$(sed -n 's/^LIBS=//p' "$build/link-libs")
lib_dirs=$(sed -n 's/^LIB_DIRS=//p' "$build/link-libs")
cuda_libs=$(sed -n 's/^CUDA_LIBS=//p' "$build/link-libs")
root=$dest$prefix
install -d "$root/bin" "$root/lib/pkgconfig" "$root/include/tandem"
install -m 755 "$build/tandem" "$root/bin/tandem"
install -m 644 "$build/libtandem.a" "$root/lib/libtandem.a"
dirs=$lib_dirs
cuda_link=""
if [ -e "$build/libtandem_cuda.a" ] && [ -n "$cuda_libs" ]; then
  install -m 644 "$build/libtandem_cuda.a" "$root/lib/libtandem_cuda.a"
  dirs="$dirs cuda"
  cuda_link="-Wl,--undefined=tdm_cuda_device_count -ltandem_cuda "
else
  rm -f "$root/lib/libtandem_cuda.a"   # a stale one from an earlier CUDA build
  cuda_libs=""
fi
for d in $dirs; do
  set -- "$src/$d"/*.h
  [ -e "$1" ] || { echo "install.sh: no headers in $src/$d" >&2; exit 1; }
  install -d "$root/include/tandem/$d"
  install -m 644 "$@" "$root/include/tandem/$d/"
done
cat > "$root/lib/pkgconfig/tandem.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: tandem
Description: DataParallel and DistributedDataParallel training in C (host${cuda_link:+ and CUDA} backends)
Version: 0.1.0
Cflags: -I\${includedir}/tandem
Libs: -L\${libdir} ${cuda_link}-ltandem ${cuda_libs:+$cuda_libs }$libs
PC
echo "installed tandem in $root (bin, lib, include/tandem, lib/pkgconfig/tandem.pc${cuda_link:+; CUDA backend included})"
