#!/bin/sh
# The pipeline figures of docs/PERFORMANCE.md: on 2 host devices, for the
# default GPT and MLP, M = 1, 2, 4, 8, 16 micro-batches: samples/s of one
# device, DDP(2) and PP(2) in GPipe and 1F1B (tandem compare), the
# measured bubble beside (S-1)/(M+S-1), and each stage's peak activation
# memory. Each configuration runs REPS times (default 3); the table has
# the medians, and the ratios come from the same run.
# Usage: sh tools/pp_figures.sh BUILD_DIR [REPS] [STEPS]
set -eu
build=${1:-build}
reps=${2:-3}
steps=${3:-8}
t=$build/tandem
out=$(mktemp -d "${TMPDIR:-/tmp}/tandem-ppfig.XXXXXX")
trap 'rm -rf "$out"' EXIT
echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores," \
     "$(date -u '+%Y-%m-%d %H:%M UTC'), load $(cut -d' ' -f1-3 /proc/loadavg)"
med() { sort -g | awk '{v[NR]=$1} END {if (NR == 0) print "-"; else if (NR % 2) print v[(NR+1)/2]; else print (v[NR/2]+v[NR/2+1])/2}'; }
for model in gpt mlp; do
    case $model in gpt) batch=32 ;; *) batch=256 ;; esac
    data=""
    [ $model = mlp ] && data="--data synthetic"
    : >"$out/ddp.$model"
    for r in $(seq "$reps"); do
        $t compare --modes single,ddp --device cpu:2 --model $model $data --batch $batch \
            --steps "$steps" --warmup 2 >"$out/o" 2>&1
        awk '/^  single\(1\)/ {s=$2} /^  DDP\(2\)/ {d=$2} END {print s, d, d/s}' "$out/o" \
            >>"$out/ddp.$model"
    done
    printf '\n%s, batch %s, %s steps (2 warm-up), medians of %s runs\n' $model $batch "$steps" "$reps"
    printf '  single %s samples/s, DDP(2) %s samples/s (%sx single)\n' \
        "$(cut -d' ' -f1 "$out/ddp.$model" | med)" "$(cut -d' ' -f2 "$out/ddp.$model" | med)" \
        "$(cut -d' ' -f3 "$out/ddp.$model" | med)"
    printf '  %-6s %3s %10s %8s %8s %8s %12s %12s\n' sched M "samples/s" "x single" "bubble" \
        "ideal" "peak act 0" "peak act 1"
    for sched in gpipe 1f1b; do
        for m in 1 2 4 8 16; do
            : >"$out/pp"
            for r in $(seq "$reps"); do
                $t compare --modes single,pp --device cpu:2 --model $model $data \
                    --batch $batch --steps "$steps" --warmup 2 --schedule $sched \
                    --microbatches $m >"$out/o" 2>&1 || true
                awk '/^  single\(1\)/ {s=$2}
                     /^  pp\(2\)/ {for (i = 1; i <= NF; i++) if ($i == "samples/s") p=$(i-1)}
                     /^  bubble:/ {b=$2; sub("%","",b); th=$11; sub("%","",th)}
                     /^  0  / && NF > 5 {a0=$5} /^  1  / && NF > 5 {a1=$5}
                     END {print p, p/s, b, th, a0, a1}' "$out/o" >>"$out/pp"
            done
            printf '  %-6s %3s %10s %8s %7s%% %7s%% %8s MiB %8s MiB\n' $sched $m \
                "$(cut -d' ' -f1 "$out/pp" | med)" "$(cut -d' ' -f2 "$out/pp" | med)" \
                "$(cut -d' ' -f3 "$out/pp" | med)" "$(cut -d' ' -f4 "$out/pp" | med)" \
                "$(cut -d' ' -f5 "$out/pp" | med)" "$(cut -d' ' -f6 "$out/pp" | med)"
        done
    done
done
echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
