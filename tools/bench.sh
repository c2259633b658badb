#!/bin/sh
# make bench: the figures docs/PERFORMANCE.md records, measured in one run
# on this machine. Speed is never asserted in tests; it is measured here.
# Usage: sh tools/bench.sh BUILD_DIR
set -eu
build=${1:-build}
t=$build/tandem
section() { printf '\n=== %s ===\n' "$*"; }
section "machine"
lscpu | sed -n 's/^Model name: *//p' | head -1
echo "cores: $(nproc), $(date -u '+%Y-%m-%d %H:%M UTC')"
section "single-core sgemm ceiling (tandem bench gemm)"
$t bench gemm
section "one host device, MLP 784-1024-1024-10 batch 256 (tandem bench train)"
$t bench train --model mlp --steps 40
section "one host device, CNN batch 128"
$t bench train --model cnn --steps 20
section "one host device, GPT gpt:4-128-4-128 batch 32 windows (docs/GPT.md)"
$t bench train --model gpt --steps 30
section "DP vs one device (tandem bench dp)"
$t bench dp --model mlp
$t bench dp --model cnn
section "one device vs DP vs DDP, MLP batch 256 (tandem compare)"
$t compare --data synthetic --model mlp --batch 256 --steps 30
section "one device vs DP vs DDP, CNN batch 128"
$t compare --data synthetic --model cnn --batch 128 --steps 12
section "one device vs DP vs DDP, GPT batch 32 windows of 128 bytes (fortunes)"
$t compare --model gpt --steps 20
section "overhead-bound: MLP 784-128-10, batch 64"
$t compare --data synthetic --model mlp:784-128-10 --batch 64 --steps 200 --warmup 20
section "baseline a user would otherwise run: one device, 2 BLAS threads"
$t bench train --model mlp --threads 2 --steps 40
$t bench train --model mlp:784-128-10 --batch 64 --threads 2 --steps 200
section "shared-memory all-reduce, 2 ranks: latency (tandem bench all_reduce)"
$t bench all_reduce -n 2 -b 8 -e 4K -f 512 -w 100 -i 2000
section "shared-memory all-reduce, 2 ranks: 1, 4, 16, 64 MiB, copy in/out"
$t bench all_reduce -n 2 -b 1M -e 64M -f 4
section "shared-memory all-reduce, 2 ranks: 1, 4, 16, 64 MiB, zero-copy"
$t bench all_reduce -n 2 -b 1M -e 64M -f 4 --zero-copy
section "shared-memory all-reduce, 4 ranks on 2 cores"
$t bench all_reduce -n 4 -b 8 -e 16M -f 8
