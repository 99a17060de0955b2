# Kitsune — one entry point. See README.md.
#   make demo       deps + the main job (GPU if present, else host backend)
#   make test       deps + CPU test suites (Criterion + pytest);
#                   PYTEST_ARGS="tests/python/test_ops.py -k add_relu" narrows pytest
#   make deps       what build and tests need, idempotent: Debian packages (apt-get,
#                   said before it runs), the private jemalloc, and a virtual
#                   environment .venv (VENV=...) with pytest, torch, torchvision,
#                   transformers, timm, accelerate and Kitsune itself
#                   (editable); nothing is pip-installed into the system Python
#   make all        build/libkitsune.so (+ static lib, tests, benchmarks, the torch bridge)
#   make lib        build/libkitsune.so alone (the C core and the CUDA kernels)
#   make test-asan  the C suites under AddressSanitizer + UBSan
#   make results    bench/results/LATEST.md from the current results JSON
#   make bench      C allocator benchmarks -> bench/results/
#   make bench-data pinned pool footprint + prefetch training (GPU) -> bench/results/
#   make bench-kernels fused kernels' bandwidth (GPU) -> bench/results/
#   make gpu-test   build + the suites on the CUDA backend (on a GPU machine);
#                   KT_PYTEST_ARGS="-k ..." narrows the pytest part (to split a run)
#   make clean

SHELL := /bin/bash
CC ?= gcc
# The Python that builds the bridge and runs the GPU targets; make test and make demo
# use the virtual environment's (VENV) instead.
PYTHON ?= python3
VENV ?= .venv
VENV_PY := $(abspath $(VENV))/bin/python
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(wildcard /usr/local/cuda/bin/nvcc))
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(NVCC)),/usr/local/cuda)
BUILD ?= build
# Criterion/jemalloc unpacked with dpkg -x for machines that cannot apt-get (GPU box)
DEPS_ROOT ?= $(CURDIR)/.deps/root
DEPS_INC := $(if $(wildcard $(DEPS_ROOT)/usr/include),-I$(DEPS_ROOT)/usr/include)
comma := ,
DEPS_LIB := $(if $(wildcard $(DEPS_ROOT)/usr/lib/x86_64-linux-gnu),-L$(DEPS_ROOT)/usr/lib/x86_64-linux-gnu -Wl$(comma)--disable-new-dtags$(comma)-rpath$(comma)$(DEPS_ROOT)/usr/lib/x86_64-linux-gnu)

# Private jemalloc for the pinned host pool (tools/jemalloc.sh says why not Debian's)
JE_DIR := $(CURDIR)/.deps/jemalloc
JE_LIB := $(JE_DIR)/lib/libjemalloc_pic.a

NVTX_DEF := $(if $(wildcard $(CUDA_HOME)/include/nvtx3/nvToolsExt.h),-DKT_HAVE_NVTX)
CPPFLAGS := -Iallocator/include -Ifusion/include -Ischeduler/include -Iallocator/src -I$(JE_DIR)/include -I$(CUDA_HOME)/include $(NVTX_DEF) -D_GNU_SOURCE
CFLAGS ?= -O2 -g
CFLAGS += -std=c11 -fPIC -Wall -Wextra -Wno-unused-parameter -pthread
# TLS descriptors: the thread-cache lookup stays a few instructions even in a
# dlopen'd library (general-dynamic TLS would call __tls_get_addr on every alloc).
ifeq ($(shell uname -m),x86_64)
CFLAGS += -mtls-dialect=gnu2
endif
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt -lpthread
ASAN_FLAGS := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -DKT_DEBUG

LIB_SRC := $(wildcard allocator/src/*.c) $(wildcard allocator/backends/*.c) $(wildcard scheduler/src/*.c)
# CUDA sources (fused kernels; CUDA-graph edits): SASS for sm_80 and sm_90, PTX for
# newer GPUs; linked into libkitsune.so
CU_SRC := $(wildcard fusion/kernels/*.cu) $(wildcard scheduler/src/*.cu)
CU_OBJ := $(patsubst %.cu,$(BUILD)/obj/%.o,$(CU_SRC))
NVCC_FLAGS := -std=c++17 -O3 -Xcompiler -fPIC -Ifusion/include -Ischeduler/include -Iallocator/include \
  -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
LIB_HDR := $(wildcard allocator/include/kitsune/*.h) $(wildcard allocator/src/*.h) $(wildcard scheduler/include/kitsune/*.h)
OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(LIB_SRC))
ASAN_OBJ := $(patsubst %.c,$(BUILD)/asan/%.o,$(LIB_SRC))

TIERS := unit integration stress conformance hotpath
TEST_BINS := $(addprefix $(BUILD)/tests/,$(TIERS))
ASAN_BINS := $(addprefix $(BUILD)/asan-tests/,$(filter-out hotpath,$(TIERS)))
BENCH_BINS := $(BUILD)/bench/alloc_bench $(BUILD)/bench/alloc_replay $(BUILD)/bench/probe_costs $(BUILD)/bench/memplan_traces $(BUILD)/bench/capplan_logs
TEST_LIBS := $(DEPS_LIB) -lcriterion -lm

.SECONDARY:

.PHONY: bridge all lib deps test test-c test-python test-asan demo demo-run results bench bench-data bench-kernels gpu-test gpu-deps clean
all: $(BUILD)/libkitsune.so $(BUILD)/libkitsune.a $(TEST_BINS) $(BENCH_BINS) $(BUILD)/libnvtx_record.so bridge

lib: $(BUILD)/libkitsune.so

# The C++ bridge to PyTorch (needs torch; skipped with a message without it)
bridge: $(BUILD)/libkitsune.so
	@bash tools/build_bridge.sh $(BUILD)

$(JE_LIB):
	@bash tools/jemalloc.sh

$(BUILD)/obj/%.o: %.c $(LIB_HDR) | $(JE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(BUILD)/asan/%.o: %.c $(LIB_HDR) | $(JE_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -std=c11 -fPIC -Wall -Wextra -Wno-unused-parameter -pthread $(ASAN_FLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.cu $(wildcard fusion/kernels/*.cuh) $(wildcard fusion/include/kitsune/*.h) $(wildcard scheduler/include/kitsune/*.h)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@

# Only kt_* is exported; the static CUDA runtime stays private to the library.
$(BUILD)/libkitsune.so: $(OBJ) $(CU_OBJ) allocator/exports.map $(JE_LIB)
	$(CC) -shared -o $@ $(OBJ) $(CU_OBJ) $(JE_LIB) -Wl,--version-script=allocator/exports.map -Wl,--exclude-libs,ALL $(CUDA_LIBS) -lstdc++ -lm

$(BUILD)/libkitsune.a: $(OBJ)
	@rm -f $@; ar rcs $@ $(OBJ)

$(BUILD)/tests/%: tests/c/%/*.c tests/c/common.h $(BUILD)/libkitsune.a
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(DEPS_INC) -Itests/c $(CFLAGS) -o $@ $(wildcard tests/c/$*/*.c) $(BUILD)/libkitsune.a $(JE_LIB) $(CUDA_LIBS) $(TEST_LIBS)

$(BUILD)/asan-tests/%: tests/c/%/*.c tests/c/common.h $(ASAN_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(DEPS_INC) -Itests/c -std=c11 -pthread $(ASAN_FLAGS) -o $@ $(wildcard tests/c/$*/*.c) $(ASAN_OBJ) $(JE_LIB) $(CUDA_LIBS) $(TEST_LIBS)

$(BUILD)/bench/%: bench/%.c $(BUILD)/libkitsune.a
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -o $@ $< $(BUILD)/libkitsune.a $(JE_LIB) $(CUDA_LIBS) -lm

# A planted out-of-bounds write inside a pool block, for compute-sanitizer (gpu-test)
$(BUILD)/tests/oob_write: tests/gpu/oob_write.cu $(BUILD)/libkitsune.a
	@mkdir -p $(dir $@)
	$(NVCC) -O2 -arch=sm_90 -Iallocator/include $(NVTX_DEF) -o $@ $< $(BUILD)/libkitsune.a $(JE_LIB) -lcudart_static -ldl -lrt -lpthread

# NVTX injection library that records calls (tests/c/nvtx_record.c)
$(BUILD)/libnvtx_record.so: tests/c/nvtx_record.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -shared -o $@ $<

deps:
	@PYTHON=$(PYTHON) bash tools/deps.sh $(VENV)

# The GPU machine installs nothing: unpack Debian packages here, carry .deps.
gpu-deps:
	@bash tools/gpu_deps.sh

test: deps
	@$(MAKE) --no-print-directory test-c test-python PYTHON=$(VENV_PY)

test-c: $(TEST_BINS) $(BUILD)/libkitsune.so $(BUILD)/libnvtx_record.so
	@echo "-- conformance on the CUDA backend (skips without a GPU) --"
	@KT_TEST_BACKEND=cuda bash tools/run_c_tests.sh $(BUILD)/tests conformance
	@echo "-- all C suites on the host fake backend --"
	@bash tools/run_c_tests.sh $(BUILD)/tests $(TIERS)
	@echo "-- conformance and stress on VMM pools (fake) --"
	@KT_TEST_VMM=1 bash tools/run_c_tests.sh $(BUILD)/tests conformance stress

test-python: $(BUILD)/libkitsune.so $(BUILD)/bench/alloc_replay bridge
	@KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python $(PYTHON) -m pytest -q \
	  $${PYTEST_ARGS:-tests/python}

test-asan: $(ASAN_BINS)
	@ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  KT_STRESS_OPS=200000 bash tools/run_c_tests.sh $(BUILD)/asan-tests $(filter-out hotpath,$(TIERS))

demo: deps
	@$(MAKE) --no-print-directory demo-run PYTHON=$(VENV_PY)

# The demo itself, with $(PYTHON) as it is (the GPU machine runs this: it has torch and
# no package index)
demo-run: $(BUILD)/libkitsune.so $(BENCH_BINS) bridge
	@PYTHON=$(PYTHON) bash tools/demo.sh $(BUILD)

results:
	@$(PYTHON) tools/results.py

bench: $(BENCH_BINS)
	@bash tools/bench.sh $(BUILD)

# Fused kernels on the GPU: GB/s against copy, eager and torch.compile
bench-kernels: $(BUILD)/libkitsune.so bridge
	@KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python \
	  $(PYTHON) bench/kernels/elementwise.py --out $${BENCH_OUT:-bench/results} $${BENCH_KERNEL_ARGS:-}
	@KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python \
	  $(PYTHON) bench/kernels/loss_head.py --out $${BENCH_OUT:-bench/results}
	@KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python \
	  $(PYTHON) bench/kernels/train_models.py --out $${BENCH_OUT:-bench/results}
	@KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python \
	  $(PYTHON) bench/kernels/optimizer.py --out $${BENCH_OUT:-bench/results}

# The data path on the GPU: pinned footprint (torch vs Kitsune) and prefetch training
bench-data: $(BUILD)/libkitsune.so bridge
	@KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python \
	  $(PYTHON) bench/data/pinned_footprint.py --out $${BENCH_OUT:-bench/results}
	@KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python \
	  $(PYTHON) bench/data/prefetch_train.py --out $${BENCH_OUT:-bench/results}

gpu-test: $(TEST_BINS) $(BUILD)/libkitsune.so $(BUILD)/libnvtx_record.so $(BUILD)/bench/alloc_replay bridge $(BUILD)/tests/oob_write
	@KT_TEST_BACKEND=cuda KT_REQUIRE_GPU=1 bash tools/run_c_tests.sh $(BUILD)/tests conformance stress
	@KT_TEST_VMM=1 KT_TEST_BACKEND=cuda KT_REQUIRE_GPU=1 bash tools/run_c_tests.sh $(BUILD)/tests conformance stress
	@bash tools/gpu/sanitizer_oob.sh $(BUILD)
	@bash tools/run_c_tests.sh $(BUILD)/tests $(TIERS)
	@KITSUNE_REQUIRE_GPU=1 KITSUNE_LIBRARY=$(CURDIR)/$(BUILD)/libkitsune.so PYTHONPATH=$(CURDIR)/python \
	  $(PYTHON) -m pytest -q -rs --durations=15 tests/python $${KT_PYTEST_ARGS:-}

clean:
	rm -rf $(BUILD) dist
