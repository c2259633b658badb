#!/bin/sh
# tools/bench_levers.sh: the memory levers' figures for docs/PERFORMANCE.md:
# `tandem bench train` on one host device for each precision (fp32, bf16,
# fp16) without and with activation checkpointing (segments of 1 block),
# REPS rounds, the six configurations interleaved within each round so
# that the machine's load falls on all of them alike. Prints one line per
# run and, per model, the medians over the rounds and the ratios taken
# within each round (their median). Step time is the device thread's CPU
# time (the machine is shared: wall time measures the neighbours too);
# wall time is printed beside it.
#
#   sh tools/bench_levers.sh [BUILD] [REPS] [MODELS...]
#   (defaults: build, 3, gpt gpt:4-256-4-128)
set -eu
BUILD=${1:-build}
REPS=${2:-3}
[ $# -ge 2 ] && shift 2 || shift $#
MODELS=${*:-"gpt gpt:4-256-4-128"}
T=$BUILD/tandem
STEPS=${STEPS:-6}
out=$(mktemp)
trap 'rm -f "$out"' EXIT INT TERM
for model in $MODELS; do
  r=1
  while [ "$r" -le "$REPS" ]; do
    for ck in 0 1; do
      for p in fp32 bf16 fp16; do
        $T bench train --model "$model" --steps "$STEPS" --precision "$p" \
           --checkpoint-activations "$ck" > "$out.run"
        wall=$(sed -n 's/.*step: median \([0-9.]*\) ms.*/\1/p' "$out.run")
        cpu=$(sed -n 's/.*step CPU time (this thread): median \([0-9.]*\) ms.*/\1/p' "$out.run")
        act=$(sed -n 's/.*activations \([0-9.]*\) MiB.*/\1/p' "$out.run")
        peak=$(sed -n 's/.*device peak \([0-9.]*\) MiB.*/\1/p' "$out.run")
        tok=$(sed -n 's/.*= \([0-9]*\) tokens per CPU second.*/\1/p' "$out.run")
        echo "$model $r $p $ck $cpu $wall $tok $act $peak" | tee -a "$out"
      done
    done
    r=$((r + 1))
  done
done
rm -f "$out.run"
echo
echo "model precision ckpt | CPU ms/step  tokens/CPU-s  wall ms/step | activations MiB  peak MiB  (medians over $REPS rounds)"
awk '
function median(s,   a, n, i, j, t) {
  n = split(s, a, " ")
  for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
  return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{ k = $1 " " $3 " " $4; cpu[k] = cpu[k] " " $5; wall[k] = wall[k] " " $6; tok[k] = tok[k] " " $7
  act[k] = $8; peak[k] = $9; c[$1 " " $2 " " $3 " " $4] = $5
  if (!(k in seen)) { seen[k] = 1; order[++n] = k } models[$1] = 1; rounds[$2] = 1 }
END {
  for (i = 1; i <= n; i++) { k = order[i]
    printf "%-18s | %10.1f %12.0f %12.1f | %10.2f %9.2f\n", k, median(cpu[k]), median(tok[k]), median(wall[k]), act[k], peak[k] }
  print ""
  print "ratios within each round (median over rounds):"
  for (m in models) {
    bf = ""; f16 = ""; ck32 = ""; ck16 = ""
    for (r in rounds) {
      f = c[m " " r " fp32 0"]; b = c[m " " r " bf16 0"]
      if (f && b) bf = bf " " f / b
      if (f && c[m " " r " fp16 0"]) f16 = f16 " " f / c[m " " r " fp16 0"]
      if (f && c[m " " r " fp32 1"]) ck32 = ck32 " " c[m " " r " fp32 1"] / f
      if (b && c[m " " r " bf16 1"]) ck16 = ck16 " " c[m " " r " bf16 1"] / b
    }
    printf "  %s: bf16 %.2fx fp32 tokens/s, fp16 %.2fx; checkpointing costs %+.0f%% step time in fp32, %+.0f%% in bf16; activations %.2fx smaller with it (fp32)\n", \
      m, median(bf), median(f16), 100 * (median(ck32) - 1), 100 * (median(ck16) - 1), act[m " fp32 0"] / act[m " fp32 1"]
  }
}' "$out"
