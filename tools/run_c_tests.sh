#!/usr/bin/env bash
# Runs Criterion test binaries: run_c_tests.sh DIR TIER... ; prints a total.
set -u
dir=$1; shift
fail=0; passed=0; failed=0; skipped=0
for t in "$@"; do
  echo "== $t ($dir/$t) =="
  out=$("$dir/$t" --jobs 2 --verbose 2>&1); rc=$?
  echo "$out" | grep -v "^\[----\] *$\|^\[RUN \]\|^\[PASS\]\|^\[SKIP\]" | tail -n 40
  echo "$out" | grep "^\[SKIP\]" | sed "s/^\[SKIP\] [^:]*::[^:]*: /[SKIP] /" | sort | uniq -c
  syn=$(echo "$out" | grep "Synthesis" | tail -1)
  p=$(echo "$syn" | sed -n 's/.*Passing: \([0-9]*\).*/\1/p'); f=$(echo "$syn" | sed -n 's/.*Failing: \([0-9]*\).*/\1/p')
  c=$(echo "$syn" | sed -n 's/.*Crashing: \([0-9]*\).*/\1/p'); s=$(echo "$out" | grep -c "\[SKIP\]")
  passed=$((passed + ${p:-0})); failed=$((failed + ${f:-0} + ${c:-0})); skipped=$((skipped + s))
  [ $rc -eq 0 ] && [ -n "$syn" ] || fail=1
  if echo "$out" | grep -q "ERROR: [A-Za-z]*Sanitizer\|runtime error:"; then echo "sanitizer report in $t"; fail=1; failed=$((failed + 1)); fi
done
echo "C suites: $passed passed, $failed failed, $skipped skipped"
exit $fail
