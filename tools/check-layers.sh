#!/bin/sh
# tools/check-layers.sh [ROOT]: fails when an #include crosses a layer of
# the house the wrong way (the layers of docs/ARCHITECTURE.md: arrows only
# point down, the designs never use each other), and when a public header
# breaks what `make install` promises. Run by `make
# check-layers` and first thing by `make test`; ROOT defaults to the tree
# this script is in. Prints one line per violation, naming the file, the
# line, the include and the rule, then a count; exit 1 if there is any.
#
# The rules, per folder (a folder may always include itself):
#   core/                 -> nothing above it (libc, BLAS, zlib)
#   shm/ cuda/            -> core
#   mpi/                  -> shm, core
#   models/               -> core (models know nothing of parallelism)
#   dist/                 -> models, shm, core, and the weak headers
#                            cuda/cuda_weak.h and mpi/mpi_weak.h (their
#                            functions are NULL where cuda/ or mpi/ is not
#                            built, and dist/ tests them before calling),
#                            and mpi/job.h for its types alone (the job,
#                            the backends: no call goes through it)
#   rpc/                  -> dist, core
#   dp/                   -> models, core
#   ddp/ fsdp/ pp/ tp/    -> dist, models, core
#   ps/                   -> rpc, dist, models, core
#   tools/ tests/         -> everything
#   examples/             -> every public header (they build against the
#                            installed tree, which has no *_impl.h)
# and, whatever the folder:
#   - the designs (dp ddp fsdp pp tp ps) never include each other;
#   - only cuda/ includes CUDA, cuBLAS or NCCL headers; only mpi/ includes
#     mpi.h (builds without nvcc or Open MPI leave those folders out);
#   - a public header (a library folder's *.h not named *_impl.h: what
#     `make install` installs) includes no *_impl.h and has extern "C"
#     guards, so that C++ programs link its functions.
# A folder with C sources that is not in the table fails too: a new layer
# gets its rule here (and in DESIGN.md) before its first file lands.
# What it does not see: an #include through a macro, and calls made
# without an include (a declaration copied by hand).
set -eu
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root" || exit 2

# folder: the folders it may include besides itself ("*": any); an entry
# ending in .h allows that one header
rules='core:
shm:core
cuda:core
mpi:shm core
models:core
dist:models shm core cuda/cuda_weak.h mpi/mpi_weak.h mpi/job.h
rpc:dist core
dp:models core
ddp:dist models core
fsdp:dist models core
pp:dist models core
tp:dist models core
ps:rpc dist models core
tools:*
tests:*
examples:*'
designs='dp ddp fsdp pp tp ps'
# Known wrong-way includes allowed until the code moves, one "file include"
# a line (none now). A line whose include is gone is reported as stale
# (remove it); it does not fail the check.
allow=''
# the library's folders: their headers are installed, less *_impl.h
lib='core shm cuda mpi models dist rpc dp ddp fsdp pp tp ps'

# every top-level folder holding C, C++ or CUDA sources (build outputs and
# hidden folders aside)
dirs=$(find . -mindepth 2 -type f \( -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' \
         -o -name '*.cc' -o -name '*.cpp' -o -name '*.hpp' \) \
         -not -path './build*' -not -path './.*' -not -path './shared/*' |
       sed 's|^\./||; s|/.*||' | sort -u)
[ -n "$dirs" ] || { echo "check-layers: no C sources under $root" >&2; exit 2; }
files=$(for d in $dirs; do
          find "$d" -type f \( -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh' \
            -o -name '*.cc' -o -name '*.cpp' -o -name '*.hpp' \) | sort
        done)

# shellcheck disable=SC2086 # $files: paths without spaces, checked below
printf '%s\n' $files | grep -q '[[:space:]]' && { echo "check-layers: a file name with a space" >&2; exit 2; }
# shellcheck disable=SC2086
awk -v rules="$rules" -v designs="$designs" -v lib="$lib" -v dirs="$dirs" -v allow="$allow" '
function norm(p,   n, i, a, out, k, o) {   # a/b/../c -> a/c, ./a -> a
    n = split(p, a, "/"); k = 0
    for (i = 1; i <= n; i++) {
        if (a[i] == "." || a[i] == "") continue
        if (a[i] == ".." && k > 0) { k--; continue }
        o[++k] = a[i]
    }
    out = ""
    for (i = 1; i <= k; i++) out = out (i > 1 ? "/" : "") o[i]
    return out
}
function exists(p,   line, r) {
    if (p in seen_file) return seen_file[p]
    r = (getline line < p) >= 0; close(p)
    return seen_file[p] = r
}
function list(a,   n, i, w, out) {    # "dist models x/y.h" -> ", dist/, models/, x/y.h"
    n = split(a, w, " "); out = ""
    for (i = 1; i <= n; i++) out = out ", " w[i] (w[i] ~ /\.h$/ ? "" : "/")
    return out
}
function bad(msg) {
    if ((FILENAME " " target) in allowed_once) { used[FILENAME " " target] = 1; return }
    printf "%s:%d: %s\n", FILENAME, FNR, msg; nbad++
}
function public_header(f,   top) {
    top = f; sub(/\/.*/, "", top)
    return (top in is_lib) && f ~ /\.h$/ && f !~ /_impl\.h$/ && f ~ /^[^\/]+\/[^\/]+$/
}
BEGIN {
    n = split(rules, rl, "\n")
    for (i = 1; i <= n; i++) {
        d = rl[i]; sub(/:.*/, "", d); a = rl[i]; sub(/^[^:]*:/, "", a)
        known[d] = 1; allowed[d] = a
        m = split(a, al, " ")
        for (j = 1; j <= m; j++) may[d, al[j]] = 1
        may[d, d] = 1
    }
    m = split(allow, al2, "\n"); for (j = 1; j <= m; j++) if (al2[j] != "") allowed_once[al2[j]] = 1
    m = split(designs, dl, " "); for (j = 1; j <= m; j++) is_design[dl[j]] = 1
    m = split(lib, ll, " "); for (j = 1; j <= m; j++) is_lib[ll[j]] = 1
    m = split(dirs, dd, "\n")
    for (j = 1; j <= m; j++)
        if (!(dd[j] in known)) {
            printf "%s/: a folder of C sources with no layer rule: add it to tools/check-layers.sh (and to DESIGN.md'"'"'s layers)\n", dd[j]
            nbad++
        }
    cuda_re = "^(cuda|cuda_[^/]*|cudaProfiler[^/]*|cublas[^/]*|cublasLt[^/]*|cusparse[^/]*|cusolver[^/]*|curand[^/]*|cufft[^/]*|cudnn[^/]*|nccl[^/]*|nvrtc[^/]*|nvtx[^/]*|nvml[^/]*|nvToolsExt[^/]*|cooperative_groups[^/]*|vector_types|driver_types)\\.h$|^(thrust|cub|nvtx3|cooperative_groups|cuda)/"
    mpi_re = "^(mpi|mpio|mpi-ext|mpi_portable_platform)\\.h$"
}
FNR == 1 {
    if (NR > 1) end_file()
    dir = FILENAME; sub(/\/[^\/]*$/, "", dir)
    top = FILENAME; sub(/\/.*/, "", top)
    pub = public_header(FILENAME); guard = 0; last = FILENAME; nfiles++
}
/extern "C"/ { guard = 1 }
/^[ \t]*#[ \t]*include[ \t]*[<"]/ {
    line = $0
    sub(/^[ \t]*#[ \t]*include[ \t]*/, "", line)
    sys = substr(line, 1, 1) == "<"
    name = substr(line, 2); sub(/[>"].*/, "", name)
    shown = sys ? "<" name ">" : "\"" name "\""
    # the project header it names: "dir/x.h" from the root (-I.), else
    # relative to the including file; none: a system or third-party one
    target = ""
    if (!sys) {
        target = norm(name)
        ttop = target; sub(/\/.*/, "", ttop)
        if (!(ttop in known) || target !~ /\// || !exists(target)) {
            target = norm(dir "/" name)
            if (!exists(target)) target = ""
            ttop = target; sub(/\/.*/, "", ttop)
        }
    }
    if (target == "") {
        if (name ~ cuda_re && top != "cuda")
            bad("includes " shown ": only cuda/ includes CUDA, cuBLAS or NCCL headers (a build without nvcc leaves cuda/ out; elsewhere use cuda/cuda.h or cuda/cuda_weak.h)")
        if (name ~ mpi_re && top != "mpi")
            bad("includes " shown ": only mpi/ includes mpi.h (a build without Open MPI leaves mpi/ out; elsewhere use mpi/mpi_comm.h or mpi/mpi_weak.h)")
        next
    }
    if (target ~ /_impl\.h$/ && pub)
        bad("public header includes " shown ": a public header (installed by make install) includes no *_impl.h; move what it needs into a public header")
    else if (target ~ /_impl\.h$/ && top == "examples")
        bad("includes " shown ": examples build against the installed headers, which have no *_impl.h")
    if (!(top in known) || allowed[top] == "*" || may[top, ttop] || may[top, target]) next
    if ((top in is_design) && (ttop in is_design))
        bad("includes " shown ": the designs (" designs ") never include each other; what two need goes down into dist/ (or models/, core/)")
    else if (top == "core")
        bad("includes " shown ": core/ reaches nothing above it")
    else if (top == "models")
        bad("includes " shown ": models/ -> core only: models know nothing of parallelism (they expose grad-ready hooks and flat buffers)")
    else if (top == "shm")
        bad("includes " shown ": shm/ -> core only: it knows nothing of models or training")
    else
        bad("includes " shown ": " top "/ may include only " top "/" list(allowed[top]) " (arrows only point down)")
}
function end_file() {
    if (pub && !guard) {
        printf "%s: public header without extern \"C\" guards: C++ programs could not link its functions (wrap its declarations in #ifdef __cplusplus extern \"C\" {)\n", last
        nbad++
    }
}
END {
    if (NR > 0) end_file()
    for (k in allowed_once)
        if (k in used) printf "check-layers: allowed for now: %s (tools/check-layers.sh, allow)\n", k
        else printf "check-layers: stale allowance \"%s\": that include is gone; remove it from tools/check-layers.sh\n", k
    if (nbad) { printf "check-layers: %d violation%s\n", nbad, nbad == 1 ? "" : "s"; exit 1 }
    printf "check-layers: ok (%d files)\n", nfiles
}
' $files
