#!/bin/sh
# cuda/gpu-bench.sh: the GPU benchmarks of the bundle's run.sh, on GPU 0:
#   - the card's peak (NVIDIA's datasheet figure for the cards named below,
#     else FP32 computed as SMs x FP32 lanes x 2 x the top SM clock);
#   - cuBLAS sgemm at the MLP's and the GPT's shapes (tandem bench gemm),
#     in full FP32 and with TF32 tensor cores (TANDEM_CUDA_TF32=1), against
#     that peak;
#   - one-GPU training throughput of the MLP, the CNN and the GPT (tandem
#     bench train), and PyTorch training the same GPT, same batch, same
#     optimizer, on the same GPU (tools/torch_gpt_ref.py) with the python3
#     that has torch: tokens/s side by side.
#   sh cuda/gpu-bench.sh BUNDLE OUT DEADLINE [PYTHON]
# DEADLINE is a time in seconds since the epoch: an item whose estimate
# does not fit before it is skipped and listed as skipped. Writes the
# summary lines to OUT/bench.txt and the figures to OUT/bench.json; every
# command's output goes to stdout (run.sh's log). Exit 1 when a benchmark
# that ran failed, 0 otherwise. Not a test: speed is reported, never judged.
# Tested against a fake GPU run (tests/test_gpu_bundle.c); not yet run on a GPU.
bundle=${1:?usage: gpu-bench.sh BUNDLE OUT DEADLINE [PYTHON]}
out=${2:?}
deadline=${3:?}
py=${4:-}
tandem="$bundle/tandem"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tandem-bench.XXXXXX") || exit 1
trap 'rm -rf "$tmp"' EXIT
: > "$tmp/sgemm"; : > "$tmp/train"; : > "$tmp/torch"; : > "$tmp/skipped"; : > "$tmp/txt"
failed=""
js() { printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\t\n\r' '   ')"; }
num() { case $1 in ''|*[!0-9.]*) printf 'null' ;; *) printf '%s' "$1" ;; esac; }
line() { printf '%s\n' "$*" >> "$tmp/txt"; }
left() { echo $((deadline - $(date +%s))); }
# fits NAME ESTIMATE: whether an item estimated to take ESTIMATE s fits
fits() {
  if [ "$(left)" -lt "$2" ]; then
    echo "gpu-bench: $1: skipped, $(left) s left of the budget (needs ~$2 s)"
    printf '%s\n' "$1" >> "$tmp/skipped"
    return 1
  fi
}
# run_cmd NAME LIMIT CMD...: runs CMD with a time limit, output to stdout
# and $tmp/out; 0 when it succeeded
run_cmd() {
  name=$1 limit=$2; shift 2
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  [ "$limit" -lt 5 ] && limit=5
  echo "gpu-bench: $name: $*"
  timeout -k 5 "$limit" "$@" > "$tmp/out" 2>&1; rc=$?
  cat "$tmp/out"
  if [ $rc -ne 0 ]; then
    echo "gpu-bench: $name: FAILED (exit $rc$([ $rc = 124 ] && echo ", stopped after $limit s"))"
    failed="$failed $name"
    return 1
  fi
}

# --- the peak ------------------------------------------------------------------
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
info=$("$tandem" info 2>&1)
dev0=$(printf '%s\n' "$info" | sed -n 's/^  cuda:0  *//p' | head -1)
[ -n "$name" ] || name=$(printf '%s' "$dev0" | cut -d, -f1)
sms=$(printf '%s' "$dev0" | sed -n 's/.* \([0-9][0-9]*\) SMs.*/\1/p')
cc=$(printf '%s' "$dev0" | sed -n 's/.*compute capability \([0-9]*\.[0-9]*\).*/\1/p')
mhz=$(nvidia-smi --query-gpu=clocks.max.sm --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' ')
# NVIDIA's datasheets, dense (without sparsity), TFLOP/s
fp32="" tf32="" src=""
case $name in
  *H100*NVL*|*H200*NVL*) fp32=60; tf32=417.5; src="datasheet (${name}), dense" ;;
  *H100*PCIe*) fp32=51.2; tf32=378; src="datasheet (H100 PCIe), dense" ;;
  *H100*|*H200*) fp32=67; tf32=494.7; src="datasheet (H100/H200 SXM), dense" ;;
  *A100*) fp32=19.5; tf32=156; src="datasheet (A100), dense" ;;
esac
if [ -z "$fp32" ] && [ -n "$sms" ] && [ -n "$mhz" ]; then
  case $cc in 7.*|8.0) lanes=64 ;; *) lanes=128 ;; esac
  fp32=$(awk -v s="$sms" -v l="$lanes" -v m="$mhz" 'BEGIN { printf "%.1f", s * l * 2 * m / 1e6 }')
  src="computed: $sms SMs x $lanes FP32 lanes x 2 x $mhz MHz (compute capability $cc); TF32 unknown"
fi
echo "gpu-bench: GPU 0: ${name:-?}; ${dev0:-no tandem info line}; top SM clock ${mhz:-?} MHz"
echo "gpu-bench: peak: FP32 ${fp32:-?} TFLOP/s, TF32 ${tf32:-?} TFLOP/s (${src:-unknown card})"
line "  GPU              ${name:-?}, ${sms:-?} SMs, compute capability ${cc:-?}, top clock ${mhz:-?} MHz"
line "  peak             FP32 ${fp32:-?}, TF32 ${tf32:-?} TFLOP/s (${src:-unknown card})"
pct() { # pct GFLOPS PEAK_TFLOPS
  [ -n "$2" ] && [ -n "$1" ] && awk -v g="$1" -v p="$2" 'BEGIN { printf "%.1f", 100 * g / (p * 1000) }'
}

# --- sgemm ---------------------------------------------------------------------
# sgemm_item MODEL[@BATCH]:fp32|tf32
sgemm_item() {
  item=$1
  math=${item##*:}; mb=${item%:*}; model=${mb%@*}; batch=""
  case $mb in *@*) batch=${mb#*@} ;; esac
  fits "sgemm $mb $math" 15 || return 0
  tf=0; peak=$fp32; [ "$math" = tf32 ] && { tf=1; peak=$tf32; }
  run_cmd "sgemm $mb $math" 60 env TANDEM_CUDA_TF32=$tf "$tandem" bench gemm --device cuda:0 \
    --model "$model" ${batch:+--batch "$batch"} || return 0
  if [ "$math" = tf32 ] && ! grep -q 'TF32 tensor cores' "$tmp/out"; then
    echo "gpu-bench: sgemm $mb tf32: the output does not say TF32"; failed="$failed sgemm-$mb-tf32"; return 0
  fi
  best="" bestg=0
  sed -n 's/^  \(.*[^ ]\)  *\([0-9.][0-9.]*\) ms  *\([0-9.][0-9.]*\) GFLOP\/s$/\1|\2|\3/p' "$tmp/out" > "$tmp/rows"
  while IFS='|' read -r shape ms gf; do
    printf '{"model": %s, "batch": %s, "math": %s, "shape": %s, "ms": %s, "gflops": %s, "pct_of_peak": %s}\n' \
      "$(js "$model")" "$(num "${batch:-256}")" "$(js "$math")" "$(js "$shape")" "$(num "$ms")" "$(num "$gf")" \
      "$(num "$(pct "$gf" "$peak")")" >> "$tmp/sgemm"
    if awk -v a="$gf" -v b="$bestg" 'BEGIN { exit !(a > b) }'; then bestg=$gf; best=$shape; fi
  done < "$tmp/rows"
  p=$(pct "$bestg" "$peak")
  line "$(printf '    %-24s %9s GFLOP/s = %5s%% (%s)' "$mb $math" "$bestg" "${p:-?}" "$best")"
}

# --- training on one GPU, and PyTorch on the same GPT -----------------------------
tandem_tok() { sed -n "s/^$1 \([0-9.]*\)$/\1/p" "$tmp/tok" | head -1; }
: > "$tmp/tok"
train_item() {
  item=$1 model=${1%@*} batch=${1#*@}
  fits "train $item" 20 || return 0
  run_cmd "train $item" 120 "$tandem" bench train --device cuda:0 --model "$model" --batch "$batch" \
    --steps 30 || return 0
  grep -q 'cuBLAS' "$tmp/out" || { echo "gpu-bench: train $item: not on cuBLAS?"; failed="$failed train-$item"; return 0; }
  desc=$(sed -n 's/^model \(.*\) (\([0-9]*\) parameters).*/\1 \2/p' "$tmp/out")
  params=${desc##* }; desc=${desc% *}
  ms=$(sed -n 's/^  step: median \([0-9.]*\) ms.*/\1/p' "$tmp/out")
  sps=$(sed -n 's/^  throughput: \([0-9.]*\) \(samples\|windows\)\/s.*/\1/p' "$tmp/out")
  tps=$(sed -n 's/.* = \([0-9.]*\) tokens\/s$/\1/p' "$tmp/out")
  gp=$(sed -n 's/.* = \([0-9]*\)% of the .*/\1/p' "$tmp/out")
  [ -n "$tps" ] && printf '%s@%s %s\n%s@%s:params %s\n' "$desc" "$batch" "$tps" "$desc" "$batch" "$params" >> "$tmp/tok"
  printf '{"model": %s, "batch": %s, "params": %s, "step_ms": %s, "per_s": %s, "tokens_per_s": %s, "gemm_pct_of_sgemm_ceiling": %s}\n' \
    "$(js "$desc")" "$(num "$batch")" "$(num "$params")" "$(num "$ms")" "$(num "$sps")" "$(num "$tps")" \
    "$(num "$gp")" >> "$tmp/train"
  if [ -n "$tps" ]; then
    line "$(printf '    %-24s %8s ms, %s tokens/s' "$desc b$batch" "$ms" "$tps")"
  else
    line "$(printf '    %-24s %8s ms, %s samples/s' "$desc b$batch" "$ms" "$sps")"
  fi
}

pytorch_item() {
if [ -z "$py" ]; then
  line "  PyTorch          not run: no python3 with torch found"
elif fits "pytorch gpt" 60; then
  if run_cmd "pytorch gpt" 150 "$py" "$bundle/tools/torch_gpt_ref.py" --run gpt@32 \
       --run gpt:6-384-6-256@64 --attn manual,sdpa --steps 30; then
    grep '^{' "$tmp/out" >> "$tmp/torch"
    line "  PyTorch, same GPT, same GPU (tokens/s; tandem / PyTorch):"
    grep '^{' "$tmp/out" | while read -r j; do
      m=$(printf '%s' "$j" | sed -n 's/.*"model": "\([^"]*\)".*/\1/p')
      b=$(printf '%s' "$j" | sed -n 's/.*"batch": \([0-9]*\).*/\1/p')
      a=$(printf '%s' "$j" | sed -n 's/.*"attn": "\([^"]*\)".*/\1/p')
      tp=$(printf '%s' "$j" | sed -n 's/.*"tokens_per_s": \([0-9.]*\).*/\1/p')
      pp=$(printf '%s' "$j" | sed -n 's/.*"params": \([0-9]*\).*/\1/p')
      tt=$(tandem_tok "$m@$b"); tpar=$(tandem_tok "$m@$b:params")
      ratio=$( [ -n "$tt" ] && awk -v a="$tt" -v b="$tp" 'BEGIN { printf "%.2fx", a / b }')
      note=""
      [ -n "$tpar" ] && [ "$tpar" != "$pp" ] && note=" PARAMETER COUNTS DIFFER: tandem $tpar, PyTorch $pp"
      line "$(printf '    %-24s PyTorch %s tokens/s (%s attention), tandem %s: %s%s' "$m b$b" "$tp" "$a" "${tt:-not run}" "${ratio:-?}" "$note")"
    done
    if grep -q 'PARAMETER COUNTS DIFFER' "$tmp/txt"; then failed="$failed pytorch-params"; fi
  fi
fi
}

# The order is the value's: the FP32 rates and the training figures with
# PyTorch beside them first, then TF32 and the larger GPT's gemm shapes.
line "  sgemm            best of the model's shapes, GFLOP/s = % of peak (every shape in run.log)"
sgemm_item mlp:fp32
sgemm_item gpt@32:fp32
line "  train, 1 GPU     median step after 5 warm-up steps, throughput"
for t in mlp@256 cnn@128 gpt@32 gpt:6-384-6-256@64; do train_item "$t"; done
pytorch_item
line "  sgemm, more      TF32 (TANDEM_CUDA_TF32=1) and the larger GPT's shapes"
for g in mlp:tf32 gpt@32:tf32 gpt:6-384-6-256@64:fp32 gpt:6-384-6-256@64:tf32; do sgemm_item "$g"; done

# --- the results -----------------------------------------------------------------
arr() { paste -sd, "$1" | sed 's/},{/}, {/g'; }
{
  printf '{"peak": {"gpu": %s, "sms": %s, "compute_capability": %s, "max_sm_mhz": %s, "fp32_tflops": %s, "tf32_tflops": %s, "source": %s},\n' \
    "$(js "$name")" "$(num "$sms")" "$(js "$cc")" "$(num "$mhz")" "$(num "$fp32")" "$(num "$tf32")" "$(js "$src")"
  printf '  "sgemm": [%s],\n  "train": [%s],\n  "pytorch": [%s],\n' "$(arr "$tmp/sgemm")" "$(arr "$tmp/train")" "$(arr "$tmp/torch")"
  printf '  "skipped": [%s], "failed": %s}' "$(sed 's/.*/"&"/' "$tmp/skipped" | paste -sd, -)" "$(js "${failed# }")"
} > "$out/bench.json"
[ -s "$tmp/skipped" ] && line "  skipped          $(paste -sd, "$tmp/skipped" | sed 's/,/, /g') (time budget)"
[ -n "$failed" ] && line "  bench FAILED    ${failed}"
cp "$tmp/txt" "$out/bench.txt"
[ -z "$failed" ]
