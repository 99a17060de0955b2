#!/usr/bin/env bash
# One device call: facts, clean build, then the parts named in GPU_RUN_PARTS
# (default, when unset, "test bench demo": make gpu-test, make bench, make demo-run; set but empty, the build alone; "pytest" runs
# only the pytest part of gpu-test, on KT_PYTEST_ARGS (paths and options; default tests/python); "data" adds
# make bench-data, "kernels" make bench-kernels, "profile" tools/gpu/profile_train.py, "gaps"
# tools/gpu/step_gaps.py, "optim" bench/kernels/optimizer.py, "ew" bench/kernels/elementwise.py, "lact" bench/kernels/linear_act.py, "colsum" bench/kernels/colsum.py, "pool" bench/kernels/pool.py, "losses" bench/loss_match.py (LOSS_ARGS), "copies" tools/gpu/copy_sources.py (COPY_MODELS, COPY_ARGS), "train" bench/kernels/train_models.py,
# "ncu" Nsight Compute on the dropout kernels, "ncu_ln" on the LayerNorm ones, "ncu_optim" on the fused AdamW step, "memsets" tools/gpu/graph_memsets.py, "models" bench/models.py, "zoo" bench/zoo.py (BENCH_ZOO_ARGS), "zoodiag" tools/gpu/zoo_diag.py (ZOODIAG_ARGS), "vitdiag" tools/gpu/vit_diag.py, "vitloss" tools/gpu/vit_loss_diag.py, "dist" bench/distributed.py (BENCH_DIST_ARGS), "ncu_chain" Nsight Compute on the chain kernel, "chains" test_chains.py + bench/kernels/chains.py, "zooprof" tools/gpu/zoo_profile.py (ZOOPROF), "churn" bench/alloc_churn.py, "variants" tools/gpu/models_variants.py (VARIANTS, VARIANTS_ARGS or BENCH_MODELS_ARGS), "gmem" bench/graph_memory.py, "ab" tools/gpu/ab_env.py (AB_SETTING, AB_MODELS), "pgraph"
# tools/gpu/profile_graph.py, "host" tools/gpu/host_replay.py, "alloc" the VMM C suites on CUDA, the allocator pytest,
# bench/alloc_shapes.py and bench/alloc_torch.py; KT_NO_CLEAN=1 keeps
# the last call's build). Everything is logged to $OUT/run.log; JSON results and the
# recorded trace also land in $OUT (the device tool brings back at most 8 files).
# Carry .deps (make gpu-deps). The whole make gpu-test (build included) takes more than
# one 600 s device call since a2f459b: split it, e.g. part "test" with
# KT_PYTEST_ARGS="--ignore=tests/python/test_fx.py --ignore=...test_ops.py ...", then part
# "pytest" with KT_NO_CLEAN=1 on the ignored files (bench/results/h100_gputest_a2f459b_part*.log).
# KT_COMMIT: write the local short HEAD into the command as a literal; git run on the
# device copy named a stale commit (bench/results/archive/h100_pytest_models_gmem_fd66c6b.log).
set -uo pipefail
OUT=${OUT:-/tmp/kt_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
parts=" ${GPU_RUN_PARTS-test bench demo} "   # set but empty: the build alone
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/run.log") 2>&1
echo "== machine =="; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)"; nvcc --version | tail -1; gcc --version | head -1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "commit: ${KT_COMMIT:-?}  parts:$parts"
[ -n "${KT_NO_CLEAN:-}" ] || make clean >/dev/null   # KT_NO_CLEAN=1: reuse a warm machine's build
echo "== build =="; make -j16 all 2>&1 | grep -E "error|warning"; [ -f build/libkitsune.so ] || { echo BUILD FAILED; exit 1; }
if [[ $parts == *" test "* ]]; then
  echo "== gpu-test =="; time make gpu-test 2>&1 | grep -vE "^\[----\] *$|^\[RUN \]|^\[PASS\]"
fi
if [[ $parts == *" pytest "* ]]; then
  # eval: KT_PYTEST_ARGS may quote, e.g. -k 'a or b'
  echo "== gpu pytest (${KT_PYTEST_ARGS:-all}) =="; time eval "KITSUNE_REQUIRE_GPU=1 \
    KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python python3 -m pytest -q -rfEs --durations=15 \
    ${KT_PYTEST_ARGS:-tests/python}" 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
if [[ $parts == *" bench "* ]]; then
  echo "== bench =="; BENCH_OUT="$OUT" BENCH_TRACE="$OUT/random_10k_4mib.csv" make bench
fi
if [[ $parts == *" data "* ]]; then
  echo "== bench-data =="; time BENCH_OUT="$OUT" make bench-data
fi
if [[ $parts == *" kernels "* ]]; then
  echo "== bench-kernels =="; time BENCH_OUT="$OUT" make bench-kernels
fi
if [[ $parts == *" profile "* ]]; then   # top kernels of one training step, to $OUT/profile.log
  echo "== profile =="
  for v in "gpt2 kitsune" "gpt2 eager" "llama kitsune" "llama eager"; do
    KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python python3 tools/gpu/profile_train.py $v
  done > "$OUT/profile.log" 2>&1; tail -5 "$OUT/profile.log"
fi
if [[ $parts == *" gaps "* ]]; then   # where the training step's GPU waits, to $OUT/gaps.log
  echo "== gaps =="
  for v in "llama kitsune" "llama eager" "gpt2 kitsune" "gpt2 eager"; do
    KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python python3 tools/gpu/step_gaps.py $v
  done > "$OUT/gaps.log" 2>&1; grep -E "^==|^host|^step|^synchron" "$OUT/gaps.log"
fi
if [[ $parts == *" optim "* ]]; then
  echo "== optimizer bench =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/kernels/optimizer.py --out "$OUT"
fi
if [[ $parts == *" ew "* ]]; then   # bench/kernels/elementwise.py alone (BENCH_KERNEL_ARGS)
  echo "== elementwise =="; time KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/kernels/elementwise.py --out "$OUT" ${BENCH_KERNEL_ARGS:-} 2>&1 | grep -v -i "warn\|online softmax\|split the\|important use\|softmax\.$"
fi
if [[ $parts == *" lact "* ]]; then   # bench/kernels/linear_act.py
  echo "== linear_act =="; time KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/kernels/linear_act.py --out "$OUT" ${BENCH_LACT_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" colsum "* ]]; then   # bench/kernels/colsum.py
  echo "== colsum =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/kernels/colsum.py --out "$OUT" 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" pool "* ]]; then   # bench/kernels/pool.py
  echo "== pool =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/kernels/pool.py --out "$OUT" 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" copies "* ]]; then   # tools/gpu/copy_sources.py (COPY_MODELS), to $OUT/copies.log
  echo "== copy sources =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/copy_sources.py ${COPY_MODELS:-inception} ${COPY_ARGS:-} 2>&1 | grep -v -i "warn" | tee "$OUT/copies.log" | head -60
fi
if [[ $parts == *" train "* ]]; then   # bench/kernels/train_models.py alone (GPT-2 and LLaMA, eager / kitsune / compile)
  echo "== train_models =="; time KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/kernels/train_models.py --out "$OUT" 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" ncu "* ]]; then   # Nsight Compute on the bf16 dropout kernels and bias_gelu (64 MB), to $OUT/ncu.log
  echo "== ncu =="
  KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python ncu --clock-control none \
    --kernel-name regex:'rng_kernel|ew_kernel' --launch-skip 3 --launch-count 6 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
    --section LaunchStats --section Occupancy python3 tools/gpu/ncu_dropout.py > "$OUT/ncu.log" 2>&1
  grep -E "rng_kernel|ew_kernel|Duration|Memory Throughput|Compute \(SM\)|Issue Slots Busy|Executed Ipc A|Registers Per|Achieved Occupancy" "$OUT/ncu.log" | head -80
fi
if [[ $parts == *" ncu_ln "* ]]; then   # Nsight Compute on the LayerNorm kernels (tools/gpu/ncu_layer_norm.py), to $OUT/ncu_ln.log
  echo "== ncu layer_norm =="
  KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python ncu --clock-control none \
    --kernel-name regex:'ln_|colsum' --launch-skip 4 --launch-count 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis python3 tools/gpu/ncu_layer_norm.py > "$OUT/ncu_ln.log" 2>&1
  grep -E "ln_|colsum|Duration|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Stall|Block Limit" "$OUT/ncu_ln.log" | head -80
fi
if [[ $parts == *" ncu_optim "* ]]; then   # Nsight Compute on the fused AdamW step (tools/gpu/ncu_optim.py), to $OUT/ncu_optim.log
  echo "== ncu optimizer =="
  KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python ncu --clock-control none \
    --kernel-name regex:'multi_tensor' --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 tools/gpu/ncu_optim.py > "$OUT/ncu_optim.log" 2>&1
  grep -E "multi_tensor|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots Busy|Executed Ipc A|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Stall|Block Limit|Grid Size" "$OUT/ncu_optim.log" | head -60
fi
if [[ $parts == *" zoo "* ]]; then   # bench/zoo.py (BENCH_ZOO_ARGS, e.g. "--models gpt2,llama" or "--dynamic")
  echo "== zoo =="; time KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/zoo.py --out "$OUT" ${BENCH_ZOO_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" zoodiag "* ]]; then   # tools/gpu/zoo_diag.py: ResNet-18's one-liner against eager twins
  echo "== zoo diag =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/zoo_diag.py ${ZOODIAG_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" chains "* ]]; then   # pointwise chains: the kernel against the CPU reference, then bench/kernels/chains.py
  echo "== chains =="; KITSUNE_REQUIRE_GPU=1 KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 -m pytest -q -rfEs tests/python/test_chains.py 2>&1 | tail -5
  KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python python3 bench/kernels/chains.py --out "$OUT" \
    ${BENCH_CHAINS_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" zooprof "* ]]; then   # tools/gpu/zoo_profile.py: one step's kernels by kind (ZOOPROF: "MODEL RECIPE ..." lines)
  echo "== zoo profile =="
  while read -r spec; do [ -n "$spec" ] && KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/zoo_profile.py $spec 2>&1 | grep -v -i "warn"; done <<< "${ZOOPROF:-gpt2 eager compile kitsune}"
fi
if [[ $parts == *" vitdiag "* ]]; then   # tools/gpu/vit_diag.py: ViT-B/16's one-liner against eager, rewrite by rewrite
  echo "== vit diag =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/vit_diag.py 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" ncu_chain "* ]]; then   # Nsight Compute on the pointwise-chain kernel (tools/gpu/ncu_chain.py), to $OUT/ncu_chain.log
  echo "== ncu chain =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python ncu --kernel-name regex:chain_kernel \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section InstructionStats \
    python3 tools/gpu/ncu_chain.py > "$OUT/ncu_chain.log" 2>&1
  grep -E "^  [A-Za-z]|chain_kernel|ops:|Duration|Throughput|Registers|Achieved Occ|Theoretical Occ|Stall|Executed Ipc|Issue Slots|Block Limit|Warp Cycles" "$OUT/ncu_chain.log" | head -90
fi
if [[ $parts == *" dist "* ]]; then   # bench/distributed.py (BENCH_DIST_ARGS, e.g. "--nproc 2"): DDP / FSDP2 by torchrun
  echo "== distributed =="; time KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/distributed.py --out "$OUT" ${BENCH_DIST_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" vitloss "* ]]; then   # tools/gpu/vit_loss_diag.py: the fused loss on ViT-B/16 against F.cross_entropy
  echo "== vit loss diag =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/vit_loss_diag.py 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" models "* ]]; then   # bench/models.py (BENCH_MODELS_ARGS)
  echo "== models =="; time KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/models.py --out "$OUT" ${BENCH_MODELS_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" variants "* ]]; then   # tools/gpu/models_variants.py: bench/models.py (BENCH_MODELS_ARGS) once per VARIANTS setting
  echo "== models variants =="; time KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/models_variants.py --out "$OUT" --variants "${VARIANTS:?set VARIANTS}" -- ${VARIANTS_ARGS:-${BENCH_MODELS_ARGS:-}} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" losses "* ]]; then   # bench/loss_match.py (LOSS_MODELS): kitsune's loss curves against eager
  echo "== loss match =="; time KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/loss_match.py --out "$OUT" --models ${LOSS_MODELS:-mlp,lenet,resnet18,gpt,inception} ${LOSS_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" gmem "* ]]; then   # bench/graph_memory.py (BENCH_GMEM_ARGS; GMEM_LOG=1: the plans' CSV logs to $OUT)
  [ -n "${GMEM_LOG:-}" ] && export KITSUNE_CAPPLAN_LOG="$OUT"   # GMEM_TRACE=1: device-pool traces to $OUT
  [ -n "${GMEM_TRACE:-}" ] && export KITSUNE_GMEM_TRACE="$OUT"
  echo "== graph memory =="; time KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/graph_memory.py --out "$OUT" ${BENCH_GMEM_ARGS:-} 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" ab "* ]]; then   # tools/gpu/ab_env.py: AB_SETTING (NAME=VALUE for side A; AB_B for side B) on AB_MODELS
  echo "== A/B ${AB_SETTING:?set AB_SETTING} ${AB_B:-} =="; KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so \
    PYTHONPATH=$PWD/python python3 tools/gpu/ab_env.py "$AB_SETTING" ${AB_B:+--b "$AB_B"} --models ${AB_MODELS:-gpt} \
    --out "$OUT" 2>&1 | grep -v -i "warn"
fi
if [[ $parts == *" pgraph "* ]]; then   # kernels inside the captured step (PGRAPH_MODELS), to $OUT/profile_graph.log
  echo "== profile graph =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/profile_graph.py ${PGRAPH_MODELS:-mlp resnet18} > "$OUT/profile_graph.log" 2>&1
  grep -v -i warn "$OUT/profile_graph.log" | head -${PGRAPH_HEAD:-120}
fi
if [[ $parts == *" memsets "* ]]; then   # the memset nodes of compile_step's graph (GRAPH_MODELS), to $OUT/memsets.log
  echo "== graph memsets =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/graph_memsets.py ${GRAPH_MODELS:-gpt} > "$OUT/memsets.log" 2>&1
  grep -v -i warn "$OUT/memsets.log" | head -60
fi
if [[ $parts == *" host "* ]]; then   # host time of a replayed step (HOST_MODELS), to $OUT/host.log
  echo "== host replay =="; KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 tools/gpu/host_replay.py ${HOST_MODELS:-mlp lenet} > "$OUT/host.log" 2>&1
  grep -v -i warn "$OUT/host.log" | head -80
fi
if [[ $parts == *" alloc "* ]]; then   # allocator under torch: VMM suites, its pytest, alloc_shapes + alloc_torch
  echo "== C suites, VMM pools on CUDA =="
  KT_TEST_VMM=1 KT_TEST_BACKEND=cuda KT_REQUIRE_GPU=1 bash tools/run_c_tests.sh build/tests conformance stress
  echo "== allocator pytest =="; KITSUNE_REQUIRE_GPU=1 KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 -m pytest -q -rfEs -s tests/python/test_torch_allocator.py 2>&1 | grep -v -i "warn" | tail -25
  echo "== alloc_shapes =="; time KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/alloc_shapes.py --out "$OUT" ${BENCH_SHAPES_ARGS:-}
  echo "== alloc_torch =="; time KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so PYTHONPATH=$PWD/python \
    python3 bench/alloc_torch.py --out "$OUT" ${BENCH_ATORCH_ARGS:-}
fi
if [[ $parts == *" churn "* ]]; then   # bench/alloc_churn.py: the churn ring and random_allocations per allocator
  if ls .deps/wheels/rmm_cu13-*.whl >/dev/null 2>&1; then   # RMM (make gpu-deps), for rmm_pool
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .deps/wheels/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  echo "== alloc_churn =="; time KT_COMMIT=${KT_COMMIT:-?} KITSUNE_LIBRARY=$PWD/build/libkitsune.so \
    PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} \
    python3 bench/alloc_churn.py --out "$OUT" ${BENCH_CHURN_ARGS:-}
fi
if [[ $parts == *" demo "* ]]; then
  echo "== demo =="; make demo-run
fi
