#!/bin/sh
# Runs every Criterion test binary under BUILD/tests (or those named after
# it), prints each one's result, and ends with one line
# "tests: N passed, N failed" that sums them. Exits non-zero on any failure.
. "$(dirname "$0")/criterion.sh"
build=${1:-build}; shift
if [ $# -gt 0 ]; then bins=""; for n in "$@"; do bins="$bins $build/tests/$n"; done
else bins=$(ls "$build"/tests/test_* 2>/dev/null | grep -v '\.[od]$'); fi
# CLI tests find the binary of the same build here.
TANDEM_BIN=$(cd "$build" && pwd)/tandem; export TANDEM_BIN
# The CUDA emulator only where a test asks for it (it would turn "cuda" into
# emulated devices for every test).
unset TANDEM_CUDA_EMULATOR
# A failing launch or train keeps its flight-recorder dumps in a new
# $TMPDIR/tandem-fr-* directory (docs/DEBUGGING.md); the many failures the
# tests cause on purpose keep theirs here, removed at the end.
TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/tandem-tests.XXXXXX"); export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
pass=0; fail=0; bad=""
for b in $bins; do
  name=$(basename "$b")
  start=$(date +%s)
  out=$("$b" --jobs 2 2>&1); rc=$?
  secs=$(( $(date +%s) - start ))
  cr_summary <<EOF
$out
EOF
  line=$CR_LINE; t=$CR_TESTED; p=$CR_PASSED
  if [ $rc -ne 0 ] || [ "$t" != "$p" ] || [ "$t" = 0 ]; then
    printf '%s\n' "$out" | tail -60
    f=$(( t - p )); [ $f -le 0 ] && f=1
    fail=$(( fail + f )); pass=$(( pass + p )); bad="$bad $name"
    printf 'FAIL %-28s %s (%ss, exit %s)\n' "$name" "$line" "$secs" "$rc"
  else
    pass=$(( pass + p ))
    printf 'ok   %-28s %3s tests (%ss)\n' "$name" "$t" "$secs"
    # a test that skips part of itself says so in a line of its own
    printf '%s\n' "$out" | grep ': SKIPPED ' | sort -u | sed 's/^/     /'
  fi
done
[ -n "$bad" ] && echo "failing:$bad"
echo "tests: $pass passed, $fail failed"
[ $fail -eq 0 ]
