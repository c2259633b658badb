#!/bin/sh
# tools/det_bench.sh: the cost of --deterministic 8 against the default
# mode, in one run: throughput of the MLP and the GPT at N = 1 (single)
# and N = 2 (ddp), each configuration run REPS times interleaved, medians
# and their ratio (docs/PERFORMANCE.md). Usage: tools/det_bench.sh [REPS]
set -eu
T=${TANDEM_BIN:-build/tandem}
REPS=${1:-5}
run() { # model args... -> samples (or windows) per second of the epoch line
    out=$("$T" train "$@" --epochs 1 --no-eval --quiet 2>&1) || {
        echo "det_bench: tandem train $* failed: $(echo "$out" | tail -1)" >&2
        exit 1
    }
    echo "$out" | sed -n 's/.*, \([0-9]*\) \(samples\|windows\)\/s.*/\1/p' | tail -1
}
median() { sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for model in mlp gpt; do
    if [ $model = mlp ]; then
        M="--model mlp --data synthetic --synthetic-size 12000 --batch 256 --max-steps 30"
    else
        M="--model gpt:2-64-4-64 --batch 32 --max-steps 30"
    fi
    for r in $(seq "$REPS"); do
        for n in 1 2; do
            if [ $n = 1 ]; then mode="--mode single"; else mode="--mode ddp --device cpu:2"; fi
            # shellcheck disable=SC2086
            run $M $mode >>"$tmp/$model.$n.default"
            # shellcheck disable=SC2086
            run $M $mode --deterministic 8 >>"$tmp/$model.$n.det"
        done
    done
    for n in 1 2; do
        d=$(median <"$tmp/$model.$n.default")
        k=$(median <"$tmp/$model.$n.det")
        echo "  raw $model N=$n default: $(tr '\n' ' ' <"$tmp/$model.$n.default")det: $(tr '\n' ' ' <"$tmp/$model.$n.det")"
        echo "$model N=$n: default $d/s, --deterministic 8 $k/s, ratio $(echo "$k $d" | awk '{printf "%.2f", $1/$2}')"
    done
done
