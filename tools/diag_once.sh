set -uo pipefail
lscpu | grep -E "Socket|NUMA|Thread|Core|Model name|MHz"; lscpu -e | head -20
make -j16 all 2>&1 | grep -E "error|warning"
./build/bench/probe_costs 0 1 0 2 0 8 0 15 8 9
./build/bench/alloc_bench --backend cuda --quick --pairs-only
./build/bench/alloc_bench --backend cuda --quick --pairs-only --no-lifetimes
make gpu-test 2>&1 | tee $OUT/gpu_test.log | grep -E "^==|Synthesis|C suites|SKIP|FAIL|Assert|Unexpected|error" 
