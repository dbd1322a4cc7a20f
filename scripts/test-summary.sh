#!/usr/bin/env bash
# Sums cargo's per-binary "test result:" lines from a log into one closing line,
# so a run's total is visible at the end (cargo prints a line per test binary,
# the last of which is often a doc-test binary with nothing in it).
set -euo pipefail
log=${1:?usage: test-summary.sh LOG}
awk '/^test result:/ {
  for (i = 1; i <= NF; i++) {
    if ($(i) ~ /^passed;?$/) p += $(i-1)
    if ($(i) ~ /^failed;?$/) f += $(i-1)
    if ($(i) ~ /^ignored;?$/) s += $(i-1)
  }
}
END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' "$log"
