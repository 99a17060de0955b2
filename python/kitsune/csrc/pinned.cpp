// python/kitsune/csrc/pinned.cpp — the process's pinned host pool (kitsune/pinned.h):
// torch.ops.kitsune.pinned_empty, CPU tensors in page-locked memory from it, and the
// entry points for Python (ctypes; kitsune.pinned): kt_bridge_pinned_*.
#include <ATen/ops/from_blob.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>

#include "kitsune/alloc.h"
#include "kitsune/pinned.h"
#include "options.h"

namespace bridge {
namespace {

std::mutex g_pinned_mu;
kt_pinned_pool_t* g_pinned = nullptr;
kt_backend* g_pinned_fake = nullptr;   // host fake backend, for tests without a GPU

// Creates g_pinned over `backend` with the process's options (g_pinned_mu held).
kt_status create_pinned_locked(const kt_backend* backend) {
  kt_status st = kt_pinned_create(backend, &g_pinned);
  if (st == KT_OK) kt_pinned_set_release_on_grow(g_pinned, option_int(Opt::kPinnedReleaseOnGrow, 1));
  return st;
}

// The process's pinned pool, created on first use over the CUDA backend.
kt_pinned_pool_t* pinned_pool() {
  std::lock_guard<std::mutex> g(g_pinned_mu);
  if (g_pinned) return g_pinned;
  TORCH_CHECK(kt_cuda_device_count() > 0,
              "kitsune.pinned: page-locked memory needs a CUDA device, and none is visible");
  kt_status st = create_pinned_locked(kt_cuda_backend());
  TORCH_CHECK(st == KT_OK, "kitsune.pinned: creating the pinned pool failed: ", kt_status_str(st));
  return g_pinned;
}

void pinned_delete(void* ptr) {
  if (ptr) kt_pinned_free(g_pinned, ptr);   // only the pool's own blocks get here
}

at::Tensor pinned_empty(c10::IntArrayRef size, c10::ScalarType dtype) {
  uint64_t numel = 1;
  for (int64_t d : size) {
    TORCH_CHECK(d >= 0, "kitsune.pinned.empty: negative dimension ", d, " in size ", size);
    TORCH_CHECK(!c10::mul_overflows(numel, static_cast<uint64_t>(d), &numel),
                "kitsune.pinned.empty: size ", size, " overflows");
  }
  uint64_t nbytes = 0;
  TORCH_CHECK(!c10::mul_overflows(numel, static_cast<uint64_t>(c10::elementSize(dtype)), &nbytes) &&
                  nbytes <= KT_PINNED_MAX_ALLOC,
              "kitsune.pinned.empty: size ", size, " of ", dtype, " is more than the pool's limit of ",
              KT_PINNED_MAX_ALLOC, " bytes");
  kt_pinned_pool_t* pool = pinned_pool();
  void* p = nullptr;
  kt_status st = kt_pinned_alloc(pool, nbytes, &p);
  TORCH_CHECK_WITH(OutOfMemoryError, st != KT_ERR_OOM, "kitsune.pinned.empty: could not pin ", nbytes,
                   " bytes of host memory (cudaHostAlloc refused; page-locked memory is limited by "
                   "RAM and `ulimit -l`). Free pinned tensors or call kitsune.pinned.trim()");
  TORCH_CHECK(st == KT_OK, "kitsune.pinned.empty of ", nbytes, " bytes failed: ", kt_status_str(st));
  return at::for_blob(p, size)
      .deleter(pinned_delete)
      .options(at::TensorOptions().dtype(dtype).device(at::kCPU))
      .make_tensor();
}

}  // namespace

// The schema is library.cpp's; no tensor inputs, so the kernel serves every dispatch
// key (CompositeImplicitAutograd, what a catch-all kernel is).
TORCH_LIBRARY_IMPL(kitsune, CompositeImplicitAutograd, m) { m.impl("pinned_empty", &pinned_empty); }

}  // namespace bridge

using namespace bridge;   // the C entry points below work on the bridge's objects

extern "C" {

// Makes the pinned pool use the host fake backend (ordinary memory), for tests on
// machines without a GPU. Returns 0, or 1 when a pool already exists.
__attribute__((visibility("default"))) int kt_bridge_pinned_use_host_memory(void) {
  std::lock_guard<std::mutex> g(g_pinned_mu);
  if (g_pinned) return 1;
  g_pinned_fake = kt_fake_backend_create(0);
  return !g_pinned_fake || create_pinned_locked(g_pinned_fake) != KT_OK;
}

// KT_ERR_UNAVAILABLE (and zeros) before the pool exists.
__attribute__((visibility("default"))) int kt_bridge_pinned_stats(kt_pinned_stats* out) {
  std::memset(out, 0, sizeof *out);
  return g_pinned ? kt_pinned_get_stats(g_pinned, out) : KT_ERR_UNAVAILABLE;
}

__attribute__((visibility("default"))) int kt_bridge_pinned_trim(void) {
  return g_pinned ? kt_pinned_trim(g_pinned) : KT_OK;
}

__attribute__((visibility("default"))) void kt_bridge_pinned_reset_peak(void) {
  if (g_pinned) kt_pinned_reset_peak_stats(g_pinned);
}

__attribute__((visibility("default"))) int kt_bridge_pinned_record_stream(void* ptr, int device, void* stream) {
  return g_pinned ? kt_pinned_record_stream(g_pinned, ptr, device, stream) : KT_ERR_INVALID;
}

}  // extern "C"
