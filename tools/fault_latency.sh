#!/bin/sh
# tools/fault_latency.sh [TANDEM]: the time from an injected fault to the
# doctor's verdict line, for a rank SIGKILLed and a rank SIGSTOPped, forked
# by tandem train and launched by tandem launch (docs/DEBUGGING.md,
# "Figures"). Each output line of the run is stamped on arrival; the
# latency is the stamp of "... doctor: ..." minus that of "test fault".
# The stall is named after TANDEM_SHM_STALL_MS (default 3000; 500 here,
# the minimum, as a user who wants fast detection would set it; run it
# with TANDEM_SHM_STALL_MS=3000 in the environment for the default). A
# stopped rank cannot exit by itself, but the verdict does not wait for the
# teardown's SIGKILL after the grace period: it is printed once the other
# ranks have failed and exited (docs/DEBUGGING.md); launch is measured at
# its default --grace-ms and at 100 ms, which should now be alike.
T=${1:-build/tandem}
ARGS="--mode ddp --data synthetic --synthetic-size 4096 --batch 64 --model mlp:784-64-10 --no-eval --quiet --epochs 1"
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done; }
lat() { awk '/test fault/ && !f {f=$1} /doctor:/ && !d {d=$1} END {if (f && d) printf "%.0f ms\n", (d-f)*1000; else print "n/a"}'; }
export TANDEM_SHM_STALL_MS=${TANDEM_SHM_STALL_MS:-500}
TMPDIR=$(mktemp -d); export TMPDIR   # where the failed runs keep their dumps
for fault in 1:20 1:20:STOP; do
  printf 'train  %-10s ' "$fault"
  TANDEM_DDP_TEST_KILL=$fault $T train $ARGS --device cpu:2 2>&1 | stamp | lat
  printf 'launch %-10s ' "$fault"
  TANDEM_DDP_TEST_KILL=$fault $T launch -n 2 -- $T train $ARGS 2>&1 | stamp | lat
  printf 'launch %-10s --grace-ms 100: ' "$fault"
  TANDEM_DDP_TEST_KILL=$fault $T launch -n 2 --grace-ms 100 -- $T train $ARGS 2>&1 | stamp | lat
done
rm -rf "$TMPDIR"   # the dumps of these failures are of no interest
