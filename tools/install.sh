#!/bin/sh
# tools/install.sh BUILD PREFIX [DESTDIR]: installs what `make` built in
# BUILD under DESTDIR/PREFIX: bin/tandem, lib/libtandem.a, with the CUDA
# backend lib/libtandem_cuda.a, the headers under include/tandem/<dir>/,
# and lib/pkgconfig/tandem.pc, so that a program builds with
#   cc prog.c $(pkg-config --cflags --libs tandem)
# (PKG_CONFIG_PATH=PREFIX/lib/pkgconfig where PREFIX is not a system one).
# The CUDA archive is linked whole: its objects register the backend from
# a constructor that nothing else references. Called by `make install`.
set -eu
build=${1:?usage: install.sh BUILD PREFIX [DESTDIR]}
prefix=${2:?usage: install.sh BUILD PREFIX [DESTDIR]}
dest=${3:-}
case $prefix in /*) ;; *) echo "install.sh: PREFIX must be an absolute path (got '$prefix')" >&2; exit 2;; esac
for f in "$build/tandem" "$build/libtandem.a" "$build/link-libs"; do
  [ -e "$f" ] || { echo "install.sh: $f is missing: run make first" >&2; exit 1; }
done
libs=$(sed -n 's/^LIBS=//p' "$build/link-libs")
cuda_libs=$(sed -n 's/^CUDA_LIBS=//p' "$build/link-libs")
root=$dest$prefix
install -d "$root/bin" "$root/lib/pkgconfig" "$root/include/tandem"
install -m 755 "$build/tandem" "$root/bin/tandem"
install -m 644 "$build/libtandem.a" "$root/lib/libtandem.a"
dirs="core models dp ddp shm"
whole=""
if [ -e "$build/libtandem_cuda.a" ] && [ -n "$cuda_libs" ]; then
  install -m 644 "$build/libtandem_cuda.a" "$root/lib/libtandem_cuda.a"
  dirs="$dirs cuda"
  whole="-Wl,--whole-archive -ltandem_cuda -Wl,--no-whole-archive "
else
  rm -f "$root/lib/libtandem_cuda.a"   # a stale one from an earlier CUDA build
  cuda_libs=""
fi
for d in $dirs; do
  install -d "$root/include/tandem/$d"
  for h in "$d"/*.h; do [ -e "$h" ] && install -m 644 "$h" "$root/include/tandem/$d/"; done
done
cat > "$root/lib/pkgconfig/tandem.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: tandem
Description: DataParallel and DistributedDataParallel training in C (host${whole:+ and CUDA} backends)
Version: 0.1.0
Cflags: -I\${includedir}/tandem
Libs: -L\${libdir} ${whole}-ltandem ${cuda_libs:+$cuda_libs }$libs
PC
echo "installed tandem in $root (bin, lib, include/tandem, lib/pkgconfig/tandem.pc${whole:+; CUDA backend included})"
