#!/bin/sh
# tools/fr_overhead.sh [TANDEM] [PAIRS] [RANKS]: the flight recorder's cost
# on a small and a large all_reduce (issue 16; docs/DEBUGGING.md,
# "Figures"): `tandem bench all_reduce -n RANKS` (default 2; 1 gives the
# cost per call where nothing waits for a peer, which on a shared VM is
# steadier than the two ranks' spin) with the recorder off (TANDEM_FR_SIZE=0)
# and on (the default, 2000 entries), at 8 B and 1 MiB, PAIRS times
# (default 10), interleaved in ABBA order (off-on, then on-off) so that a
# machine changing speed part-way weighs on both alike. Prints every
# pair, then per size and column (out of place, in place) the medians, the
# median of the per-pair ratios on/off, which is the figure (1.02 = the
# recorder costs 2%), and the ratio of the minima (the least disturbed
# runs; compare the two on a busy machine). The bench prints microseconds
# to 3 decimals (ns).
T=${1:-build/tandem}
N=${2:-10}
R=${3:-2}
out=$(mktemp) || exit 1
trap 'rm -f "$out"' EXIT
# one run: FR size, bytes, iterations, warm-up -> "fr size oop_us ip_us"
run() {
  TANDEM_FR_SIZE=$1 "$T" bench all_reduce -n "$R" -b "$2" -e "$2" -i "$3" -w "$4" \
      --memcpy-bytes 1M |
    awk -v fr="$1" -v s="$2" '$1 == s && $6 == "|" { print fr, s, $7, $12 }'
}
i=1
while [ "$i" -le "$N" ]; do
  for size in 8 1048576; do
    # one rank's 8 B call takes tens of ns: many more of them
    if [ "$size" != 8 ]; then it=300; wu=30; elif [ "$R" = 1 ]; then it=5000000; wu=1000
    else it=20000; wu=2000; fi
    if [ $((i % 2)) = 1 ]; then order="0 2000"; else order="2000 0"; fi
    for fr in $order; do
      line=$(run "$fr" "$size" "$it" "$wu")
      [ -n "$line" ] || { echo "fr_overhead: the bench printed no row (TANDEM_FR_SIZE=$fr, $size B)" >&2; exit 1; }
      echo "$i $line" | tee -a "$out"
    done
  done
  i=$((i + 1))
done
echo "# pair fr bytes oop_us ip_us above; summary (on = 2000 entries, off = 0):"
awk '
function median(a, n,   i, j, t) {
  for (i = 2; i <= n; i++) { t = a[i]; for (j = i - 1; j >= 1 && a[j] > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
  return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
}
{ v[$1, $2, $3, "oop"] = $4; v[$1, $2, $3, "ip"] = $5; pairs[$1] = 1; sizes[$3] = 1 }
END {
  for (s in sizes) for (c = 0; c < 2; c++) {
    col = c ? "ip" : "oop"; n = 0
    for (p in pairs) {
      n++; off[n] = v[p, 0, s, col]; on[n] = v[p, 2000, s, col]; r[n] = on[n] / off[n]
    }
    mo = median(off, n); mn = median(on, n); rr = median(r, n)   # sorts off, on: [1] = min
    printf "%8d B %-3s: off %.3f us, on %.3f us (medians of %d); on/off %.4f (median of the per-pair ratios), %.4f (ratio of the minima)\n",
           s, col, mo, mn, n, rr, on[1] / off[1]
  }
}' "$out" | sort -n
