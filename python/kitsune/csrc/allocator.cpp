// python/kitsune/csrc/allocator.cpp — KitsuneAllocator (allocator.h): allocation and
// frees, caches, limits and streams, stats, what is not supported; the install entry
// points for Python (ctypes): kt_bridge_install, kt_bridge_installed, kt_bridge_trace.
// The hot path: allocate -> alloc_on -> kt_alloc, and kitsune_delete -> free_ctx ->
// free_any -> kt_free, with one unlikely branch each into the private pools
// (private_pools.cpp) while a capture is under way or for a private pool's block.
#include "allocator.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <cstdio>
#include <exception>

#include "options.h"

namespace bridge {

KitsuneAllocator* g_allocator = nullptr;

namespace {

std::shared_ptr<KitsuneAllocator> g_owner;  // keeps the installed allocator alive

Stat to_stat(const kt_stat& s) {
  Stat out;
  out.current = s.current;
  out.peak = s.peak;
  out.allocated = s.allocated;
  out.freed = s.freed;
  return out;
}

[[noreturn]] void raise_status(kt_status st, const char* what, size_t size, int device) {
  if (st == KT_ERR_OOM) {
    char msg[1024];
    kt_format_oom(kt_last_oom(), msg, sizeof msg);
    TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
  }
  TORCH_CHECK(false, "Kitsune: ", what, " of ", size, " bytes on device ", device, " failed: ", kt_status_str(st));
}

// Checkpoints (the layout of a graph pool, saved and restored) are what
// torch.compile(mode="reduce-overhead") uses through Inductor's CUDA graph trees.
constexpr const char* kNoCheckpoints =
    "Kitsune: allocator checkpoints are not supported by kitsune.allocator. "
    "torch.compile(mode=\"reduce-overhead\") needs them for CUDA graph trees; with Kitsune "
    "installed, set torch._inductor.config.triton.cudagraph_trees = False (plain CUDA graphs, "
    "which Kitsune serves from private pools)";

}  // namespace

// A pool with the process's options (allocator.h says which).
kt_status create_device_pool(int device, kt_pool_t** out, bool device_pool, int device_count,
                             const kt_backend* be) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.device = device;
  // 0 none, 1 idle segments (a VMM pool then unmaps nothing), 2 also unmap idle granules
  // to follow the peak (the default): kitsune/alloc.h, KT_RELEASE_*
  const int release = option_int(Opt::kReleaseOnGrow, o.release_on_grow);
  o.release_on_grow = release < KT_RELEASE_NEVER ? KT_RELEASE_NEVER
                      : release > KT_RELEASE_FOLLOW_PEAK ? KT_RELEASE_FOLLOW_PEAK : release;
  o.vmm = device_pool && option_int(Opt::kVmm, device_count == 1) != 0;
  if (be) o.shared_segment = KT_SEGMENT_ALIGN;   // a private pool's segments are cheap blocks of the device's
  return kt_pool_create(&o, be ? be : kt_cuda_backend(), out);
}

void kitsune_delete(void* ctx) {
  if (ctx) g_allocator->free_ctx(ctx);
}

// ---- allocation ---------------------------------------------------------------------
c10::DataPtr KitsuneAllocator::allocate(size_t n) {
  c10::DeviceIndex dev = c10::cuda::current_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  bool priv = false;
  void* p = alloc_on(dev, n, stream, &priv);
  uintptr_t ctx = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(dev) | (priv ? kPrivateBit : 0);
  return {p, reinterpret_cast<void*>(ctx), &kitsune_delete, c10::Device(c10::DeviceType::CUDA, dev)};
}

void* KitsuneAllocator::raw_alloc(size_t n) {
  c10::DeviceIndex dev = c10::cuda::current_device();
  return alloc_on(dev, n, c10::cuda::getCurrentCUDAStream(dev).stream());
}

void* KitsuneAllocator::raw_alloc_with_stream(size_t n, cudaStream_t stream) {
  return alloc_on(c10::cuda::current_device(), n, stream);
}

// No context here: a private pool's block may start where the device pool's block
// holding that pool's segment starts, so private pools are asked first.
void KitsuneAllocator::raw_delete(void* ptr) {
  int dev = c10::cuda::current_device();   // a guess
  if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) history_free(dev, ptr);
  if (has_private_.load(std::memory_order_relaxed) && ptr && free_private(ptr, dev) == KT_OK) return;
  free_any(ptr, dev);
}

void KitsuneAllocator::free_ctx(void* ctx) {
  uintptr_t v = reinterpret_cast<uintptr_t>(ctx);
  void* ptr = reinterpret_cast<void*>(v & ~(kDeviceMask | kPrivateBit));
  int dev = static_cast<int>(v & kDeviceMask);
  if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) history_free(dev, ptr);
  if (C10_UNLIKELY(v & kPrivateBit)) {
    if (!ptr) return;   // a 0-byte allocation (free_any returns on NULL itself)
    if (free_private(ptr, dev) != KT_OK) TORCH_WARN("Kitsune: free of ", ptr, " (a graph or MemPool block) on device ",
                                                    dev, " failed: no private pool holds it");
    return;
  }
  free_any(ptr, dev);
}

// priv (may be null): set when the block comes from a private pool.
void* KitsuneAllocator::alloc_on(c10::DeviceIndex dev, size_t n, cudaStream_t stream, bool* priv) {
  void* p = nullptr;
  kt_pool_t* target = pool(dev);
  kt_status st;
  if (C10_UNLIKELY(capturing_.load(std::memory_order_relaxed)) && capture_alloc(dev, n, stream, &p, &st)) {
    if (priv) *priv = true;
  } else {
    st = kt_alloc(target, n, stream, &p);
  }
  if (C10_UNLIKELY(st != KT_OK)) {
    if (st == KT_ERR_OOM) notify_oom(dev, n);
    raise_status(st, "allocation", n, dev);
  }
  if (C10_UNLIKELY(history_on_.load(std::memory_order_relaxed))) history_alloc(dev, p, n, stream);
  return p;
}

// Frees ptr from device's pool; if it is not there (a private pool, or raw_delete's
// device guess was wrong), from device's private pools, then the other devices' pools.
void KitsuneAllocator::free_any(void* ptr, int device) {
  if (!ptr) return;
  kt_status st = kt_free(pools_[device], ptr, 0, nullptr);
  if (C10_UNLIKELY(st == KT_ERR_INVALID)) st = free_elsewhere(ptr, device);
  // a deleter cannot throw; an unknown pointer here is a caller bug we must not hide
  if (C10_UNLIKELY(st != KT_OK))
    TORCH_WARN("Kitsune: free of ", ptr, " on device ", device, " failed: ", kt_status_str(st));
}

kt_status KitsuneAllocator::free_elsewhere(void* ptr, int device) {
  if (has_private_.load(std::memory_order_relaxed) && free_private(ptr, device) == KT_OK) return KT_OK;
  for (int d = 0; d < static_cast<int>(pools_.size()); d++)
    if (d != device && kt_free(pools_[d], ptr, 0, nullptr) == KT_OK) return KT_OK;
  return KT_ERR_INVALID;
}

void KitsuneAllocator::notify_oom(c10::DeviceIndex dev, size_t n) {
  const kt_oom_info* o = kt_last_oom();
  std::vector<cca::OutOfMemoryObserver> obs;
  {
    std::lock_guard<std::mutex> g(mu_);
    obs = oom_observers_;
  }
  for (auto& f : obs) f(dev, n, o->device_total, o->device_free);
}

// ---- lifecycle ------------------------------------------------------------------------
void KitsuneAllocator::init(int device_count) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(device_count <= static_cast<int>(kDeviceMask) + 1, "Kitsune: ", device_count,
              " devices; at most ", kDeviceMask + 1, " are supported");
  while (static_cast<int>(pools_.size()) < device_count) {
    int dev = static_cast<int>(pools_.size());
    kt_pool_t* p = nullptr;
    kt_status st = create_device_pool(dev, &p, /*device_pool=*/true, device_count);
    TORCH_CHECK(st == KT_OK, "Kitsune: creating the pool for device ", dev, " failed: ", kt_status_str(st));
    kt_backend* sub = kt_pool_backend_create(p);
    TORCH_CHECK(sub, "Kitsune: out of host memory creating device ", dev, "'s graph-pool backend");
    pools_.push_back(p);
    subs_.push_back(sub);
  }
  initialized_ = true;
}

// ---- cache, limits, streams -------------------------------------------------------
void KitsuneAllocator::emptyCache(c10::cuda::MempoolId_t mempool_id) {
  if (mempool_id.first == 0 && mempool_id.second == 0) {
    for (size_t d = 0; d < pools_.size(); d++) {
      kt_stats before, after;
      kt_get_stats(pools_[d], &before);
      kt_empty_cache(pools_[d]);
      kt_get_stats(pools_[d], &after);
      int64_t freed = before.reserved_bytes.current - after.reserved_bytes.current;
      if (freed > 0) emptied_[d].store(freed, std::memory_order_relaxed);   // a capture's hint
    }
    std::lock_guard<std::mutex> g(mu_);
    if (!capturing_.load(std::memory_order_relaxed))   // a release synchronizes
      for (auto& p : private_)
        if (p.placer) kt_placer_trim(p.placer);
    return;
  }
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : private_)
    if (p.id == mempool_id) kt_empty_cache(p.pool);
}

void KitsuneAllocator::cacheInfo(c10::DeviceIndex device, size_t* largest) {
  kt_stats st;
  kt_get_stats(pool(device), &st);
  size_t free_b = 0, total = 0;
  {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
  }
  *largest = std::max(st.largest_free_block, free_b);  // what a workspace could get now
}

double KitsuneAllocator::getMemoryFraction(c10::DeviceIndex device) {
  size_t limit = kt_get_memory_limit(pool(device));
  if (!limit) return 1.0;
  size_t free_b = 0, total = 0;
  c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
  return static_cast<double>(limit) / static_cast<double>(total);
}

void KitsuneAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(fraction > 0.0 && fraction <= 1.0, "Kitsune: memory fraction ", fraction,
              " is outside (0, 1]");
  kt_status st = kt_set_memory_fraction(pool(device), fraction);
  TORCH_CHECK(st == KT_OK, "Kitsune: set_memory_fraction(", fraction, ") failed: ", kt_status_str(st));
}

void KitsuneAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  if (ptr.get_deleter() != &kitsune_delete || !ptr.get()) return;  // not one of ours
  kt_status st;
  if (reinterpret_cast<uintptr_t>(ptr.get_context()) & kPrivateBit) {
    std::lock_guard<std::mutex> g(mu_);
    st = KT_ERR_INVALID;
    for (auto& p : private_)
      if (p.device == ptr.device().index() && (st = use_in_locked(p, ptr.get(), stream.stream())) == KT_OK) break;
  } else {
    st = kt_record_stream(pool(ptr.device().index()), ptr.get(), stream.stream());
  }
  TORCH_CHECK(st == KT_OK, "Kitsune: record_stream failed: ", kt_status_str(st));
}

void* KitsuneAllocator::getBaseAllocation(void* ptr, size_t* size) {
  kt_block_info bi;
  if (kt_block_query(pool(c10::cuda::current_device()), ptr, &bi) == KT_OK) *size = bi.size;
  return ptr;
}

// ---- stats --------------------------------------------------------------------------
DeviceStats KitsuneAllocator::getDeviceStats(c10::DeviceIndex device) {
  kt_stats st;
  kt_get_stats(pool(device), &st);
  add_private_stats(device, &st);
  DeviceStats out;
  const auto all = static_cast<size_t>(StatType::AGGREGATE);
  out.allocation[all] = to_stat(st.allocations);
  out.segment[all] = to_stat(st.segments);
  out.active[all] = to_stat(st.allocations);
  out.allocated_bytes[all] = to_stat(st.allocated_bytes);
  out.reserved_bytes[all] = to_stat(st.reserved_bytes);
  out.active_bytes[all] = to_stat(st.active_bytes);
  out.requested_bytes[all] = to_stat(st.requested_bytes);
  out.num_alloc_retries = static_cast<int64_t>(st.num_alloc_retries);
  out.num_ooms = static_cast<int64_t>(st.num_ooms);
  out.num_device_alloc = static_cast<int64_t>(st.num_backend_reserves);
  out.num_device_free = static_cast<int64_t>(st.num_backend_releases);
  out.num_sync_all_streams = static_cast<int64_t>(st.num_release_syncs);
  return out;
}

void KitsuneAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  kt_reset_accumulated_stats(pool(device));
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : private_)
    if (p.device == device) kt_reset_accumulated_stats(p.pool);
}

void KitsuneAllocator::resetPeakStats(c10::DeviceIndex device) {
  kt_reset_peak_stats(pool(device));
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : private_)
    if (p.device == device) kt_reset_peak_stats(p.pool);
}

// ---- not supported yet: clear errors, never silent misbehaviour -----------------------
cca::ShareableHandle KitsuneAllocator::shareIpcHandle(void*) {
  TORCH_CHECK(false, "Kitsune: CUDA IPC handles are not supported by kitsune.allocator");
}

std::shared_ptr<void> KitsuneAllocator::getIpcDevPtr(std::string) {
  TORCH_CHECK(false, "Kitsune: CUDA IPC handles are not supported by kitsune.allocator");
}

void KitsuneAllocator::attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> g(mu_);
  oom_observers_.push_back(std::move(observer));
}

void KitsuneAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return;
  }
  C10_CUDA_CHECK(err);
}

cudaError_t KitsuneAllocator::memcpyAsync(void* dst, int dst_dev, const void* src, int src_dev, size_t count,
                                          cudaStream_t stream, bool p2p_enabled) {
  if (p2p_enabled || dst_dev == src_dev) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  return cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, count, stream);
}

// Checkpoints (the layout of a graph pool, saved and restored) are what
// torch.compile(mode="reduce-overhead") uses through Inductor's CUDA graph trees.
std::shared_ptr<cca::AllocatorState> KitsuneAllocator::getCheckpointState(c10::DeviceIndex, c10::cuda::MempoolId_t) {
  TORCH_CHECK(false, kNoCheckpoints);
}

cca::CheckpointDelta KitsuneAllocator::setCheckpointPoolState(c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) {
  TORCH_CHECK(false, kNoCheckpoints);
}

void KitsuneAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

}  // namespace bridge

using namespace bridge;   // the C entry points below work on the bridge's objects

extern "C" {

// Installs Kitsune as the CUDA allocator. Must run before CUDA initialises.
// Returns 0, or 1 with a message in err.
__attribute__((visibility("default"))) int kt_bridge_install(char* err, size_t len) {
  try {
    if (g_allocator) return 0;
    install_segv_backtrace_if_asked();
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      (void)cudaGetLastError();
      std::snprintf(err, len, "no CUDA device is visible (%s)", e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
      return 1;
    }
    auto a = std::make_shared<KitsuneAllocator>();
    a->init(n);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    g_owner = a;
    g_allocator = a.get();
    return 0;
  } catch (const std::exception& ex) {
    std::snprintf(err, len, "%s", ex.what());
    return 1;
  }
}

__attribute__((visibility("default"))) int kt_bridge_installed(void) { return g_allocator != nullptr; }

// Starts (path != NULL) or stops (path == NULL) the allocation trace of the
// installed allocator's pool for device. Returns a kt_status.
__attribute__((visibility("default"))) int kt_bridge_trace(int device, const char* path) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  try {
    kt_pool_t* p = g_allocator->device_pool(static_cast<c10::DeviceIndex>(device));
    return path ? kt_trace_start(p, path) : kt_trace_stop(p);
  } catch (const std::exception&) {
    return KT_ERR_INVALID;
  }
}

}  // extern "C"
