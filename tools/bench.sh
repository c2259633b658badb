#!/bin/sh
# make bench: the figures docs/PERFORMANCE.md records, measured in one run
# on this machine. Speed is never asserted in tests; it is measured here.
# Usage: sh tools/bench.sh BUILD_DIR
# Ends with a one-screen summary: the ratios issue 18 aims at, read from
# the outputs above it (each run's output is kept in a temporary folder).
set -eu
build=${1:-build}
t=$build/tandem
section() { printf '\n=== %s ===\n' "$*"; }
out=$(mktemp -d "${TMPDIR:-/tmp}/tandem-bench.XXXXXX")
trap 'rm -rf "$out"' EXIT
# run NAME CMD...: runs CMD, shows its output as it comes and keeps it in
# $out/NAME for the summary; a failing CMD fails make bench, as before.
run() {
    name=$1
    shift
    { rc=0; "$@" 2>&1 || rc=$?; echo "$rc" >"$out/$name.rc"; } | tee "$out/$name"
    rc=$(cat "$out/$name.rc")
    [ "$rc" -eq 0 ] || { echo "make bench: '$*' failed (exit $rc)" >&2; exit "$rc"; }
}
section "machine"
lscpu | sed -n 's/^Model name: *//p' | head -1
echo "cores: $(nproc), $(date -u '+%Y-%m-%d %H:%M UTC')"
section "single-core sgemm ceiling (tandem bench gemm)"
run gemm $t bench gemm
section "one host device, MLP 784-1024-1024-10 batch 256 (tandem bench train)"
run mlp1 $t bench train --model mlp --steps 40
section "one host device, CNN batch 128"
run cnn1 $t bench train --model cnn --steps 20
section "one host device, GPT gpt:4-128-4-128 batch 32 windows (docs/GPT.md)"
$t bench train --model gpt --steps 30
section "DP vs one device (tandem bench dp)"
$t bench dp --model mlp
$t bench dp --model cnn
section "one device vs DP vs DDP, MLP batch 256 (tandem compare)"
run cmp_mlp $t compare --data synthetic --model mlp --batch 256 --steps 30
section "one device vs DP vs DDP, CNN batch 128"
run cmp_cnn $t compare --data synthetic --model cnn --batch 128 --steps 12
section "one device vs DP vs DDP, GPT batch 32 windows of 128 bytes (fortunes)"
$t compare --model gpt --steps 20
section "overhead-bound: MLP 784-128-10, batch 64"
$t compare --data synthetic --model mlp:784-128-10 --batch 64 --steps 200 --warmup 20
section "baseline a user would otherwise run: one device, 2 BLAS threads"
run mlp_t2 $t bench train --model mlp --threads 2 --steps 40
$t bench train --model mlp:784-128-10 --batch 64 --threads 2 --steps 200
section "shared-memory all-reduce, 2 ranks: latency (tandem bench all_reduce)"
run ar_small $t bench all_reduce -n 2 -b 8 -e 4K -f 512 -w 100 -i 2000
section "shared-memory all-reduce, 2 ranks: 1, 4, 16, 64 MiB, copy in/out"
run ar_large $t bench all_reduce -n 2 -b 1M -e 64M -f 4
section "shared-memory all-reduce, 2 ranks: 1, 4, 16, 64 MiB, zero-copy"
$t bench all_reduce -n 2 -b 1M -e 64M -f 4 --zero-copy
section "shared-memory all-reduce, 4 ranks on 2 cores"
$t bench all_reduce -n 4 -b 8 -e 16M -f 8
section "shared-memory all-reduce vs Open MPI's MPI_Allreduce, 2 ranks, same run (--peer mpi)"
# Only where tandem was built with MPI (mpicc found) and mpirun runs (as
# root it wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1);
# elsewhere the summary says so instead of a figure.
mpi_ok=0
if $t bench all_reduce -n 2 -b 8 -e 64M -f 8 -w 20 -i 200 --peer mpi >"$out/ar_mpi" 2>&1; then
    mpi_ok=1
    cat "$out/ar_mpi"
else
    echo "(not measured; the run said:)"
    tail -n 20 "$out/ar_mpi"
fi

# ---- summary -------------------------------------------------------------
# field VALUE of a 'NAME(N)' row of tandem compare's throughput table
cmp_sps() { awk -v m="$2" '$1 == m && $3 ~ /x$/ { print $2; exit }' "$out/$1"; }
train_sps() { sed -n 's/^ *throughput: \([0-9.]*\) samples\/s.*/\1/p' "$out/$1" | head -1; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "n/a"; else printf "%.2fx", a / b }'; }
# column C of the all_reduce row of SIZE bytes: out-of-place us ($7) and
# busbw ($9), in-place us ($12)
ar_us() { awk -v s="$2" -v c="$3" '$1 == s && $6 == "|" { print $c; exit }' "$out/$1"; }

section "summary (ratios of the runs above, issue 18's aims)"
printf '%s\n' "shm all_reduce, 2 ranks, tandem vs Open MPI's MPI_Allreduce (aim: tandem no slower at any size):"
# vs-MPI (MPI's time over tandem's, > 1: tandem faster) of the shm rows
# in [LO, HI] bytes: "min .. max" over sizes, out of place and in place
mpi_band() {
    awk -v lo="$1" -v hi="$2" '$7 == "shm" && $1 + 0 >= lo && $1 + 0 <= hi && $NF ~ /^[0-9.]+$/ {
        a = $(NF - 1); sub(/,$/, "", a); b = $NF
        for (k = 0; k < 2; k++) { v = k ? b : a; if (n++ == 0 || v < mn) mn = v; if (v > mx) mx = v }
    } END { if (n) printf "%.2fx .. %.2fx (MPI time / tandem time, oop and ip)", mn, mx }' "$out/ar_mpi"
}
for band in "8 4096 8 B .. 4 KiB" "4097 67108864 8 KiB .. 64 MiB"; do
    set -- $band
    lo=$1 hi=$2
    shift 2
    r=
    [ "$mpi_ok" -eq 1 ] && r=$(mpi_band "$lo" "$hi")
    printf '  %-22s %s\n' "$*" "${r:-needs MPI build and mpirun (the --peer mpi run failed: see its section)}"
done
printf '  %-22s 8 B: %s us (in place %s); 4 KiB: %s us; 64 MiB: busbw %s GB/s\n' "tandem alone:" \
    "$(ar_us ar_small 8 7)" "$(ar_us ar_small 8 12)" "$(ar_us ar_small 4096 7)" \
    "$(ar_us ar_large 67108864 9)"
one=$(cmp_sps cmp_mlp 'single(1)')
ddp=$(cmp_sps cmp_mlp 'DDP(2)')
dp=$(cmp_sps cmp_mlp 'DP(2)')
t2=$(train_sps mlp_t2)
t1=$(train_sps mlp1)
printf '%s\n' "MLP 784-1024-1024-10, batch 256 (aims: DDP(2) >= 1.8x one device, >= 1.00x one device with 2 BLAS threads):"
printf '  DDP(2) / one device      %s   (compare: %s vs %s samples/s)\n' "$(ratio "$ddp" "$one")" "$ddp" "$one"
printf '  DP(2) / one device       %s\n' "$(ratio "$dp" "$one")"
printf '  DDP(2) / 2 BLAS threads  %s   (bench train --threads 2: %s samples/s)\n' "$(ratio "$ddp" "$t2")" "$t2"
printf '  2 BLAS threads / 1       %s   (bench train: %s samples/s)\n' "$(ratio "$t2" "$t1")" "$t1"
cnn_frac=$(sed -n 's/.*= \([0-9]*%\) of the \([0-9.]*\) GFLOP\/s sgemm.*/\1 of \2 GFLOP\/s/p' "$out/cnn1" | head -1)
printf '%s\n' "CNN batch 128 (aim: one device >= 50% of the sgemm ceiling, the speed-up carried into DP and DDP):"
printf '  one device: %s sgemm ceiling\n' "${cnn_frac:-n/a}"
printf '  DDP(2) / one device %s, DP(2) / one device %s\n' \
    "$(ratio "$(cmp_sps cmp_cnn 'DDP(2)')" "$(cmp_sps cmp_cnn 'single(1)')")" \
    "$(ratio "$(cmp_sps cmp_cnn 'DP(2)')" "$(cmp_sps cmp_cnn 'single(1)')")"
