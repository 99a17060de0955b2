#!/usr/bin/env bash
# kt_memplan_shared now against the one of commit REV (default HEAD~1): the same
# offsets on random instances, and their host times (tools/memplan_compare.c); then
# bench/capplan_logs.c on the H100 capture logs, built with each.
#   bash tools/memplan_compare.sh [REV] [instances]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-HEAD~1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
inc="-Ischeduler/include -Iallocator/include"
git show "$rev:scheduler/src/memplan.c" > "$tmp/ref.c"
cc=${CC:-gcc}
$cc -O2 $inc -Dkt_memplan_shared=ref_kt_memplan_shared -Dkt_memplan=ref_kt_memplan \
  -Dkt_memplan_peak=ref_kt_memplan_peak -c "$tmp/ref.c" -o "$tmp/ref_renamed.o"
$cc -O2 $inc -c "$tmp/ref.c" -o "$tmp/ref.o"
$cc -O2 $inc -c scheduler/src/memplan.c -o "$tmp/now.o"
$cc -O2 $inc tools/memplan_compare.c "$tmp/ref_renamed.o" "$tmp/now.o" -o "$tmp/compare"
echo "== kt_memplan_shared: $(git rev-parse --short "$rev") against the working tree =="
"$tmp/compare" ${2:-3000}
for side in ref now; do
  $cc -O2 $inc bench/capplan_logs.c "$tmp/$side.o" -o "$tmp/logs_$side"
  echo "== bench/capplan_logs with the packer of $([ $side = ref ] && git rev-parse --short "$rev" || echo "the working tree") =="
  "$tmp/logs_$side" bench/traces/capplan/*.csv | head -n -1
done
