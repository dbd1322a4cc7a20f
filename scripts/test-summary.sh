#!/usr/bin/env bash
# Sums cargo's per-binary "test result:" lines of LOG into one closing line, so a run's
# total is visible at the end (cargo prints a line per test binary, the last of which is
# often a doc-test binary with nothing in it), and lists every test that did not run:
#   - ignored: libtest's "test NAME ... ignored[, REASON]" lines;
#   - skipped at run time: the harness's "SKIPPED: REASON" lines (`harness::cannot_run`
#     writes them past libtest's capture; a passing test's own output is never shown).
# "skipped" in the closing line counts both. In CI and as root a run-time skip fails its
# test instead, so there it is 0. More logs after LOG (the benches' quick run) add their
# SKIPPED lines; their "test result:" lines are not summed (`cargo test --benches` runs
# the unit tests a second time).
set -euo pipefail
log=${1:?usage: test-summary.sh LOG [MORE_LOGS...]}
shift
more=()
for extra in "$@"; do
  # A log that is missing (its step did not run) has nothing to add.
  [ -f "$extra" ] && more+=("$extra")
done
awk -v first="$log" '
FILENAME == first && /^test result:/ {
  for (i = 1; i <= NF; i++) {
    if ($(i) ~ /^passed;?$/) p += $(i-1)
    if ($(i) ~ /^failed;?$/) f += $(i-1)
    if ($(i) ~ /^ignored;?$/) ig += $(i-1)
  }
  next
}
FILENAME == first && /^test .* \.\.\. ignored/ {
  names[++n] = $0
  next
}
# Anywhere in a line: with one test thread libtest writes "test NAME ... " before the
# test runs, and the skip lands after it.
/SKIPPED: / {
  line = $0
  sub(/^test .* \.\.\. /, "", line)
  skips[++k] = line
}
END {
  printf "tests: %d passed, %d failed, %d skipped (%d ignored, %d skipped at run time)\n", p, f, ig + k, ig, k
  for (i = 1; i <= n; i++) print "  " names[i]
  for (i = 1; i <= k; i++) print "  " skips[i]
}' "$log" "${more[@]}"
