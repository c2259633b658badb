#!/bin/sh
# tools/install.sh BUILD PREFIX [DESTDIR]: installs what `make` built in
# BUILD under DESTDIR/PREFIX: bin/tandem, lib/libtandem.a, with the CUDA
# backend lib/libtandem_cuda.a, with MPI lib/libtandem_mpi.a, the public
# headers (no *_impl.h) under include/tandem/<dir>/, and
# lib/pkgconfig/tandem.pc, so that a program builds with
#   cc prog.c $(pkg-config --cflags --libs tandem)
# (PKG_CONFIG_PATH=PREFIX/lib/pkgconfig where PREFIX is not a system one).
# The backend registers itself from a constructor in cuda/device_cuda.c
# that nothing references, so the .pc asks the linker for one of that
# object's symbols (-Wl,--undefined=tdm_cuda_device_count), which pulls it
# (and what it needs) from the CUDA archive. Called by `make install`; the
# headers come from the source tree this script is in.
#
# Other users (docs/SECURITY.md): every directory it writes into, and the
# prefix itself, must belong to this user or root and not be writable by
# group or others (a symlinked one: the link too must be ours or root's),
# or it stops before writing; files are put in place with install(1), which
# removes the destination first, so a symlink planted there is replaced,
# never written through (tandem.pc too: it is made in BUILD with mktemp and
# installed).
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
mpi_libs=$(sed -n 's/^MPI_LIBS=//p' "$build/link-libs")
root=$dest$prefix
me=$(id -u)
die() { echo "install.sh: $*" >&2; exit 1; }
check_dir() {
  if [ -L "$1" ]; then
    lo=$(stat -c %u "$1")
    [ "$lo" = "$me" ] || [ "$lo" = 0 ] || \
      die "$1 is a symbolic link that belongs to uid $lo, not to you (uid $me) or root: refusing to install through it"
  fi
  owner=$(stat -L -c %u "$1"); mode=$(stat -L -c %a "$1")
  [ "$owner" = "$me" ] || [ "$owner" = 0 ] || \
    die "$1: the directory belongs to uid $owner, not to you (uid $me) or root: another user could swap what is installed there"
  [ $(( 0$mode & 022 )) -eq 0 ] || \
    die "$1: the directory is writable by others (mode $mode): another user could swap what is installed there; run 'chmod go-w $1' or choose another PREFIX"
}
# checked before install -d (which would chmod an existing one to 755,
# hiding that others could write it until now) and after (new ones)
check_existing() { for x; do if [ -e "$x" ] || [ -L "$x" ]; then check_dir "$x"; fi; done; }
check_all() { # the directories of the prefix that files go into, and above
  $1 "$root" "$root/bin" "$root/lib" "$root/lib/pkgconfig" "$root/include" "$root/include/tandem"
}
check_existing_or_new() { for x; do check_dir "$x"; done; }
check_all check_existing
install -d "$root/bin" "$root/lib/pkgconfig" "$root/include/tandem"
check_all check_existing_or_new
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
# The MPI communicator (mpi/): its archive before libtandem's, which it uses,
# and MPI's own libraries.
mpi_link=""
if [ -e "$build/libtandem_mpi.a" ] && [ -n "$mpi_libs" ]; then
  install -m 644 "$build/libtandem_mpi.a" "$root/lib/libtandem_mpi.a"
  dirs="$dirs mpi"
  mpi_link="-ltandem_mpi "
else
  rm -f "$root/lib/libtandem_mpi.a"
  mpi_libs=""
fi
# The public headers only: a folder's *.h less its *_impl.h (internal; no
# public header includes one: tools/check-layers.sh), each with extern "C"
# guards for C++ programs.
for d in $dirs; do
  set --
  for h in "$src/$d"/*.h; do case $h in *_impl.h) ;; *) [ -e "$h" ] && set -- "$@" "$h";; esac; done
  [ $# -gt 0 ] || { echo "install.sh: no public headers in $src/$d" >&2; exit 1; }
  check_existing "$root/include/tandem/$d"
  install -d "$root/include/tandem/$d"
  check_dir "$root/include/tandem/$d"
  install -m 644 "$@" "$root/include/tandem/$d/"
done
pc=$(mktemp "$build/tandem.pc.XXXXXX")   # O_EXCL, ours
cat > "$pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: tandem
Description: DataParallel and DistributedDataParallel training in C (host${cuda_link:+ and CUDA} backends${mpi_link:+, MPI communicator})
Version: 0.1.0
Cflags: -I\${includedir}/tandem
Libs: -L\${libdir} ${cuda_link}${mpi_link}-ltandem ${cuda_libs:+$cuda_libs }${mpi_libs:+$mpi_libs }$libs
PC
install -m 644 "$pc" "$root/lib/pkgconfig/tandem.pc"
rm -f "$pc"
echo "installed tandem in $root (bin, lib, include/tandem, lib/pkgconfig/tandem.pc${cuda_link:+; CUDA backend included}${mpi_link:+; MPI communicator included})"
