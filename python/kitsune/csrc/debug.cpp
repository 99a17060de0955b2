// python/kitsune/csrc/debug.cpp — debugging aids: the SIGSEGV backtrace handler
// (KITSUNE_SEGV_BACKTRACE) and where an allocation's time goes, measured in C++ (no
// Python): kt_bridge_time_torch_allocate, kt_bridge_time_aten_empty,
// kt_bridge_time_kt_pair.
#include <ATen/ops/empty.h>
#include <c10/core/TensorOptions.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <execinfo.h>

#include <chrono>
#include <csignal>

#include "allocator.h"
#include "options.h"

// KITSUNE_SEGV_BACKTRACE=1: a crash prints the native stack to stderr (a debugging
// aid for the GPU machine, which has no debugger; tools/resolve_bt.py resolves it).
extern "C" void segv_backtrace(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

namespace bridge {

void install_segv_backtrace_if_asked() {
  if (option_int(Opt::kSegvBacktrace, 0)) std::signal(SIGSEGV, segv_backtrace);
}

}  // namespace bridge

using namespace bridge;   // the C entry points below work on the bridge's objects

extern "C" {

// ns per allocate()+delete of n bytes through torch's current CUDA allocator
// (Kitsune's when installed, else PyTorch's), on the current device and stream.
__attribute__((visibility("default"))) double kt_bridge_time_torch_allocate(size_t n, int iters) {
  c10::Allocator* a = c10::cuda::CUDACachingAllocator::get();
  for (int i = 0; i < 1000; i++) a->allocate(n);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; i++) a->allocate(n);   // the DataPtr dies at once: a free
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;
}

// ns per at::empty({n}, uint8, cuda) + its release: the op torch.empty runs, dispatcher
// included, without the interpreter.
__attribute__((visibility("default"))) double kt_bridge_time_aten_empty(size_t n, int iters) {
  const auto opts = at::TensorOptions().dtype(at::kByte).device(at::kCUDA);
  const int64_t len = static_cast<int64_t>(n);
  for (int i = 0; i < 1000; i++) (void)at::empty({len}, opts);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; i++) (void)at::empty({len}, opts);   // the tensor dies at once
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;
}

// ns per kt_alloc+kt_free pair on the installed allocator's device-0 pool, current stream.
__attribute__((visibility("default"))) double kt_bridge_time_kt_pair(size_t n, int iters) {
  if (!g_allocator) return -1;
  cudaStream_t s = c10::cuda::getCurrentCUDAStream(0).stream();
  kt_pool_t* pool = g_allocator->device_pool(0);
  void* p = nullptr;
  for (int i = 0; i < 1000; i++) { kt_alloc(pool, n, s, &p); kt_free(pool, p, n, s); }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; i++) { kt_alloc(pool, n, s, &p); kt_free(pool, p, n, s); }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;
}

}  // extern "C"
