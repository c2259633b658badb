# tests/criterion.sh: reading a Criterion binary's output, shared by
# tests/run_all.sh (make test) and cuda/test-lib.sh (make test-cuda,
# make test-gpu). Sourced, not run.

# cr_summary < OUTPUT: CR_LINE, the last "[====] Synthesis: Tested: N |
# Passing: N | ..." line (empty when the binary printed none: it crashed
# or never started), and CR_TESTED and CR_PASSED from it (0 when absent).
cr_summary() {
  CR_LINE=$(grep 'Synthesis:' | tail -1)
  CR_TESTED=$(printf '%s' "$CR_LINE" | sed -n 's/.*Tested: \([0-9]*\).*/\1/p')
  CR_PASSED=$(printf '%s' "$CR_LINE" | sed -n 's/.*Passing: \([0-9]*\).*/\1/p')
  CR_TESTED=${CR_TESTED:-0}; CR_PASSED=${CR_PASSED:-0}
}
