#!/bin/sh
# tests/gpu_bundle_check.sh: the GPU bundle run as on a bare GPU machine,
# for tests/test_gpu_bundle.c, which runs it as root in a private mount
# namespace (unshare -m), so that what it hides is hidden from it alone:
#   sh tests/gpu_bundle_check.sh BUNDLE BUILD TMP
# 1. hides the system's copy of every library the bundle brings
#    (a bind mount of /dev/null over the file ld.so would open), except
#    those the shell tools used here need themselves (a bare machine has
#    those: grep's libpcre2, zlib), and shows that it took: BUILD/tandem,
#    linked against the system's copies, no longer starts;
# 2. makes NCCL reachable only as pip's nvidia-nccl of a python3 that
#    "has torch" (TMP/site on PYTHONPATH: a torch package and
#    nvidia/nccl/lib/libnccl.so.2, the toolkit's file bound there), the
#    toolkit's and the system's copies hidden;
# 3. runs `ldd` over every binary and library of the bundle with only the
#    bundle and the CUDA toolkit added to the search path;
# 4. runs BUNDLE/run.sh TMP/out and reports its exit status.
# Prints "key: value" lines for the test to check.
set -u
bundle=$(cd "${1:?usage: gpu_bundle_check.sh BUNDLE BUILD TMP}" && pwd)
build=$(cd "${2:?}" && pwd)
tmp=$(cd "${3:?}" && pwd)
cuda=$(sed -n 's/^CUDA_HOME=//p' "$tmp/cuda_home" 2>/dev/null)
cuda=${cuda:-/usr/local/cuda}

hide() { # hide FILE: /dev/null over the real file behind FILE
  r=$(readlink -f "$1") || return 0
  [ -f "$r" ] || return 0
  mount --bind /dev/null "$r" || { echo "check: FAILED to hide $r"; exit 1; }
  echo "hidden: $r"
}
# the libraries of the tools this script and run.sh use: not hidden
tools_libs=$(for b in sh bash sed grep awk sort timeout tee mount cut paste tr date \
                      ldconfig readlink mktemp head tail uniq wc cat env dirname basename \
                      "$(python3 -c 'import sys; print(sys.executable)')"; do
               p=$(command -v "$b") && ldd "$(readlink -f "$p")" 2>/dev/null
             done | awk '$2 == "=>" {print $1}' | sort -u)

# 2 first (binding needs the real file visible): NCCL through pip only
real_nccl=""
for d in "$cuda/lib64" "$cuda/lib" "$cuda/targets/x86_64-linux/lib"; do
  [ -f "$d/libnccl.so.2" ] && { real_nccl=$(readlink -f "$d/libnccl.so.2"); break; }
done
[ -n "$real_nccl" ] || { echo "check: FAILED: no libnccl.so.2 under $cuda"; exit 1; }
mkdir -p "$tmp/site/torch" "$tmp/site/nvidia/nccl/lib"
: > "$tmp/site/torch/__init__.py"
: > "$tmp/site/nvidia/nccl/lib/libnccl.so.2"
mount --bind "$real_nccl" "$tmp/site/nvidia/nccl/lib/libnccl.so.2" || { echo "check: FAILED to bind NCCL"; exit 1; }
for f in "$cuda/lib64/libnccl.so.2" "$cuda/lib/libnccl.so.2" \
         $(ldconfig -p | awk '$1 == "libnccl.so.2" {print $NF}'); do
  [ -e "$f" ] && hide "$f"
done

# 1. the bundle's libraries, the system's copies hidden
for f in "$bundle"/lib/*.so* "$bundle"/lib/compat/*; do
  n=$(basename "$f")
  [ "$n" = libtandem_bundle.so ] && continue
  if printf '%s\n' "$tools_libs" | grep -qx "$n"; then echo "kept (the tools need it): $n"; continue; fi
  for p in $(ldconfig -p | awk -v n="$n" '$1 == n {print $NF}'); do hide "$p"; done
  echo "hid: $n"
done
if "$build/tandem" --help > "$tmp/control.out" 2>&1; then
  echo "control: $build/tandem still starts: the libraries were not hidden"
else
  echo "control: $build/tandem no longer starts: $(head -1 "$tmp/control.out")"
fi

# 3. ldd with only the bundle and the toolkit added
n=0 bad=0
for f in "$bundle/tandem" "$bundle"/tests/test_* "$bundle"/lib/*.so* "$bundle"/lib/compat/*; do
  n=$((n + 1))
  LD_LIBRARY_PATH="$cuda/lib64:$bundle/lib/compat" ldd "$f" > "$tmp/ldd.out" 2>&1
  if grep -q 'not found' "$tmp/ldd.out"; then
    bad=$((bad + 1)); echo "ldd: $f: $(grep 'not found' "$tmp/ldd.out" | tr '\n' ' ')"
  fi
  awk '$2 == "=>" {print $1, $3}' "$tmp/ldd.out" >> "$tmp/resolved"
done
outside=$(sort -u "$tmp/resolved" | awk -v b="$bundle" -v c="$(readlink -f "$cuda")" -v c2="$cuda" \
  'index($2, b) != 1 && index($2, c) != 1 && index($2, c2) != 1 {print $1}' | sort -u | tr '\n' ' ')
echo "ldd: $n files, $bad with a library not found"
echo "ldd: resolved outside the bundle and the toolkit: $outside"

# 4. the run
PYTHONPATH="$tmp/site" sh "$bundle/run.sh" "$tmp/out" > "$tmp/run.out" 2>&1
echo "run: exit $?"
