// python/kitsune/csrc/private_pools.cpp — KitsuneAllocator's private pools (allocator.h):
// one kt pool per MempoolId for CUDA graphs and torch.cuda.MemPool, whose segments are
// blocks of the device's pool; the capture plans they record and place by
// (kitsune/capplan.h: compile_step's planned graph memory); the segments behind
// kitsune.allocator.use()'s MemPools without a global install. Entry points for Python
// (ctypes): kt_bridge_capture_info, kt_bridge_memory_breakdown, kt_bridge_pool_*,
// kt_bridge_seg_*.
#include "allocator.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <exception>
#include <new>

namespace bridge {

// ---- a capture into a private pool ---------------------------------------------------
void KitsuneAllocator::beginAllocateToPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                                           std::function<bool(cudaStream_t)> filter) {
  // before mu_ (see blas_workspace_hint); PyTorch calls this with the capture stream current
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  int64_t workspaces = dev >= 0 && dev < static_cast<int>(pools_.size())
                           ? static_cast<int64_t>(blas_workspace_hint(pools_[dev], dev, stream))
                           : 0;
  std::lock_guard<std::mutex> g(mu_);
  Private* p = incref_private_locked(dev, id);
  TORCH_CHECK(!p->filter, "Kitsune: memory pool (", id.first, ", ", id.second, ") is already being allocated to");
  // Before the capture begins (PyTorch calls this first), while the device may
  // still synchronize: memory streams freed becomes usable by the graph's pool,
  // and the device's pool gets one free range ready of
  //   what its last releasing empty_cache gave back (torch.cuda.graph empties the
  //   cache just before capturing: the warm-up's working memory), plus a quarter
  //   for the private pool's own layout, one 20 MiB segment of it, and the cuBLAS
  //   and cuBLASLt workspaces the capture stream lacks (PyTorch allocates them per
  //   handle and stream, so a stream's first capture makes new ones).
  // A capture that needs more maps or reserves the rest as it goes; what it does
  // not use stays in the device's cache. Best effort; skipped beside another capture.
  int64_t emptied = emptied_[dev].exchange(0, std::memory_order_relaxed);   // used once
  int64_t hint = emptied + emptied / 4 + (int64_t{20} << 20) + workspaces;
  size_t ready = 0;
  kt_status st = kt_pool_prepare_capture(pools_[dev], static_cast<size_t>(hint), &ready);
  prepared_[dev] = {emptied, workspaces, hint, static_cast<int64_t>(ready), st};
  take_pending_locked(dev, id, p);
  p->filter = std::move(filter);
  capturing_.fetch_add(1, std::memory_order_relaxed);
  // eager allocations beside a capture must not synchronize the device, and no
  // event may be recorded or queried while it runs (cross-stream frees wait)
  kt_pool_hold_releases(pools_[dev], 1);
  kt_pool_defer_events(pools_[dev], 1);
  kt_pool_defer_events(p->pool, 1);
}

// torch.cuda.MemPool(): the pool exists (and counts one use) before anything is
// allocated to it.
void KitsuneAllocator::createOrIncrefPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                                          std::shared_ptr<cca::CUDAAllocator> allocator) {
  TORCH_CHECK(!allocator || allocator.get() == this,
              "Kitsune: with Kitsune installed, a torch.cuda.MemPool cannot use another allocator; "
              "create it without one (kitsune.allocator.use() does)");
  std::lock_guard<std::mutex> g(mu_);
  incref_private_locked(dev, id);
}

void KitsuneAllocator::endAllocateToPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Private* p = find_private(dev, id);
  if (!p || !p->filter) return;
  if (p->rec) kt_caprec_end(p->rec);
  if (p->placer) kt_placer_end(p->placer);
  p->filter = nullptr;
  capturing_.fetch_sub(1, std::memory_order_relaxed);
  kt_pool_hold_releases(pools_[dev], 0);
  kt_pool_defer_events(p->pool, 0);
  kt_pool_defer_events(pools_[dev], 0);
}

// ---- torch.cuda.MemPool and Inductor's graph pools -----------------------------------
// Inductor's CUDA graph trees check that a graph pool holds exactly the tensors
// they expect: every expected pointer is a live block of the pool, and the pool
// has no other live block.
bool KitsuneAllocator::checkPoolLiveAllocations(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                                                const std::unordered_set<void*>& expected) {
  std::lock_guard<std::mutex> g(mu_);
  Private* p = find_private(dev, id);
  if (!p) return expected.empty();
  kt_stats st;
  if (kt_get_stats(p->pool, &st) != KT_OK || st.allocations.current != static_cast<int64_t>(expected.size()))
    return false;
  kt_block_info info;
  for (void* ptr : expected)
    if (kt_block_query(p->pool, ptr, &info) != KT_OK) return false;
  return true;
}

// MemPool(use_on_oom=True) would let eager allocations fall back on the pool;
// Kitsune keeps private pools private. A MemPool's destructor sets it to false.
void KitsuneAllocator::setUseOnOOM(c10::DeviceIndex, c10::cuda::MempoolId_t, bool use_on_oom) {
  TORCH_CHECK(!use_on_oom, "Kitsune: torch.cuda.MemPool(use_on_oom=True) is not supported with Kitsune "
                           "installed (memory in a private pool is never handed to other allocations)");
}

void KitsuneAllocator::setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) {
  TORCH_CHECK(false, "Kitsune: torch.cuda.MemPool(no_split=True) is not supported with Kitsune installed");
}

int KitsuneAllocator::getPoolUseCount(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) {
  std::lock_guard<std::mutex> g(mu_);
  Private* p = find_private(dev, id);
  return p ? p->use_count : 0;
}

// One use fewer; the last release frees the pool's cache, and the pool goes
// once its last block is freed.
void KitsuneAllocator::releasePool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) {
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < private_.size(); i++) {
    if (private_[i].device != dev || private_[i].id != id) continue;
    if (--private_[i].use_count > 0) return;
    private_[i].released = true;
    kt_empty_cache(private_[i].pool);
    maybe_destroy_locked(i);
    return;
  }
}

// ---- stats ---------------------------------------------------------------------------
// The device's numbers include its private pools (graphs' memory is the device's).
// A private pool's segments are blocks of the device's pool, so they are in its
// reserved bytes already; in its allocated, active and requested bytes and its
// block count they stand in for the private pool's own blocks. Peaks and
// cumulative values stay the device pool's: a peak counts a graph's whole pool as
// allocated (an upper bound of the blocks live in it). Device calls are the device
// pool's (a private pool's reserves are blocks of it).
void KitsuneAllocator::add_private_stats(c10::DeviceIndex device, kt_stats* st) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : private_) {
    if (p.device != device) continue;
    kt_stats x;
    kt_get_stats(p.pool, &x);
    int64_t seg = x.reserved_bytes.current, live = 0, blocks = x.allocations.current - x.segments.current;
    if (p.placer) {   // its arenas are device-pool blocks too; its live blocks stand in for them
      kt_placer_stats ps;
      kt_placer_get_stats(p.placer, &ps);
      seg += static_cast<int64_t>(ps.arena_bytes);
      live = static_cast<int64_t>(ps.live_bytes);
      blocks += ps.live_blocks - ps.arenas;
    }
    st->allocated_bytes.current += x.allocated_bytes.current + live - seg;
    st->active_bytes.current += x.active_bytes.current + live - seg;
    st->requested_bytes.current += x.requested_bytes.current + live - seg;
    st->allocations.current += blocks;
    st->num_alloc_retries += x.num_alloc_retries;
    st->num_ooms += x.num_ooms;
  }
}

void KitsuneAllocator::breakdown(c10::DeviceIndex dev, int64_t* out) {
  kt_stats d;
  kt_get_stats(pool(dev), &d);
  int64_t v[8] = {static_cast<int64_t>(d.reserved_bytes.current), static_cast<int64_t>(d.allocated_bytes.current),
                  static_cast<int64_t>(d.segments.current), 0, 0, 0, 0, 0};
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : private_) {
    if (p.device != dev) continue;
    kt_stats x;
    kt_get_stats(p.pool, &x);
    v[3] += 1;
    v[4] += static_cast<int64_t>(x.reserved_bytes.current);
    v[5] += static_cast<int64_t>(x.allocated_bytes.current);
    if (p.placer) {
      kt_placer_stats ps;
      kt_placer_get_stats(p.placer, &ps);
      v[6] += static_cast<int64_t>(ps.arena_bytes);
      v[7] += static_cast<int64_t>(ps.live_bytes);
    }
  }
  std::memcpy(out, v, sizeof v);
}

// ---- capture plans (kitsune/capplan.h; compile_step's planned graph memory) ----------
// The next capture into (dev, id) records its allocations (record) or is laid out
// by plan. Before beginAllocateToPool, outside any capture.
kt_status KitsuneAllocator::set_pending(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, bool record,
                                        const kt_capplan* plan) {
  std::lock_guard<std::mutex> g(mu_);
  if (dev < 0 || dev >= static_cast<int>(pools_.size()) || (!record && !plan)) return KT_ERR_INVALID;
  for (auto& q : pending_)
    if (q.device == dev && q.id == id) {
      q = Pending{dev, id, record, plan};
      return KT_OK;
    }
  pending_.push_back(Pending{dev, id, record, plan});
  return KT_OK;
}

// (dev, id)'s recorded capture, taken from the pool: the recording ends there and is
// the caller's (kt_bridge_recording_plan as often as asked, then
// kt_bridge_recording_free). KT_ERR_INVALID when the pool recorded none.
kt_status KitsuneAllocator::take_recording(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, TakenRecording** out) {
  std::lock_guard<std::mutex> g(mu_);
  Private* p = find_private(dev, id);
  if (!p || !p->rec || p->filter) return KT_ERR_INVALID;
  int64_t programmatic = 0, ordered = 0;
  kt_capture_graph_programmatic(p->order.get(), &programmatic, &ordered);
  auto* t = new (std::nothrow) TakenRecording{p->rec, programmatic, ordered};
  if (!t) return KT_ERR_HOST_OOM;
  p->rec = nullptr;
  *out = t;
  return KT_OK;
}

// out: arena bytes, arenas, live bytes, live blocks, planned, placed, refused, plan
// bytes, peak bytes, the last begin's kt_status, waits. KT_ERR_INVALID when (dev, id)
// has no placer.
kt_status KitsuneAllocator::placer_stats(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, int64_t* out) {
  std::lock_guard<std::mutex> g(mu_);
  Private* p = find_private(dev, id);
  if (!p || !p->placer) return KT_ERR_INVALID;
  kt_placer_stats s;
  kt_placer_get_stats(p->placer, &s);
  int64_t v[11] = {static_cast<int64_t>(s.arena_bytes), s.arenas, static_cast<int64_t>(s.live_bytes), s.live_blocks,
                   s.planned, s.placed, s.refused, static_cast<int64_t>(s.plan_bytes),
                   static_cast<int64_t>(s.peak_bytes), p->placer_status, s.waits};
  std::memcpy(out, v, sizeof v);
  return KT_OK;
}

KitsuneAllocator::Prepared KitsuneAllocator::prepared(c10::DeviceIndex dev) {
  std::lock_guard<std::mutex> g(mu_);
  return dev >= 0 && dev <= static_cast<int>(kDeviceMask) ? prepared_[dev] : Prepared{};
}

// ---- the pools ---------------------------------------------------------------------------
// The private pool for (dev, id), created if needed, with one more use.
KitsuneAllocator::Private* KitsuneAllocator::incref_private_locked(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) {
  Private* p = find_private(dev, id);
  if (!p) {
    kt_pool_t* kp = nullptr;
    TORCH_CHECK(dev >= 0 && dev < static_cast<int>(pools_.size()), "Kitsune: device ", dev,
                " has no pool (", pools_.size(), " devices initialised)");
    kt_status st = create_device_pool(dev, &kp, false, 1, subs_[dev]);
    TORCH_CHECK(st == KT_OK, "Kitsune: creating a private pool on device ", dev, " failed: ", kt_status_str(st));
    // A block freed during a capture is still used by the graph's replays, so a
    // segment whose blocks are all free is not idle: never release one on growth
    // or on an OOM retry (a cudaFree would also end the capture). releasePool's
    // kt_empty_cache, once the graph is gone, releases them.
    kt_pool_hold_releases(kp, 1);
    private_.push_back(Private{dev, id, kp, nullptr, false, 0});
    p = &private_.back();
    has_private_.store(true, std::memory_order_relaxed);
  }
  p->released = false;
  p->use_count++;
  return p;
}

// beginAllocateToPool: starts what set_pending asked for this capture. A placer
// whose arena cannot be had leaves the capture to the pool (placer_status says why).
void KitsuneAllocator::take_pending_locked(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, Private* p) {
  for (size_t i = 0; i < pending_.size(); i++) {
    Pending q = pending_[i];
    if (q.device != dev || q.id != id) continue;
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    const kt_capture_order* ord = capture_order_begin(&p->order);   // capture.cpp
    if (q.record) {
      kt_caprec_destroy(p->rec);
      p->rec = nullptr;
      if (kt_caprec_create(&p->rec) != KT_OK) p->rec = nullptr;
      if (p->rec) (void)kt_caprec_set_order(p->rec, ord);
    }
    if (q.plan) {
      p->placer_status = p->placer ? KT_OK : kt_placer_create(subs_[dev], dev, &p->placer);
      if (p->placer_status == KT_OK) p->placer_status = kt_placer_set_order(p->placer, ord);
      if (p->placer_status == KT_OK) p->placer_status = kt_placer_begin(p->placer, q.plan);
    }
    return;
  }
}

KitsuneAllocator::Private* KitsuneAllocator::find_private(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) {
  for (auto& p : private_)
    if (p.device == dev && p.id == id) return &p;
  return nullptr;
}

// An allocation on a stream a capture's filter accepts goes to that capture's
// private pool: at its planned offset when a placer places it, else from the pool.
// Returns false when no capture takes the stream.
bool KitsuneAllocator::capture_alloc(c10::DeviceIndex dev, size_t n, cudaStream_t stream, void** out, kt_status* st) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : private_) {
    if (p.device != dev || !p.filter || !p.filter(stream)) continue;
    if (p.placer && (*st = kt_placer_alloc(p.placer, n, stream, out)) == KT_OK) return true;
    *st = kt_alloc(p.pool, n, stream, out);   // pure C: never calls back into the bridge
    if (*st == KT_OK && p.rec) (void)kt_caprec_alloc(p.rec, *out, n, stream);   // a miss only loses precision
    return true;
  }
  return false;
}

kt_status KitsuneAllocator::free_private(void* ptr, int device) {
  std::lock_guard<std::mutex> g(mu_);
  for (size_t i = 0; i < private_.size(); i++) {
    Private& p = private_[i];
    if (p.device != device || free_in_locked(p, ptr) != KT_OK) continue;
    maybe_destroy_locked(i);
    return KT_OK;
  }
  return KT_ERR_INVALID;
}

// A block of private pool p: placed by its placer, else its pool's (and recorded).
kt_status KitsuneAllocator::free_in_locked(Private& p, void* ptr) {
  if (p.placer && kt_placer_free(p.placer, ptr) == KT_OK) return KT_OK;
  kt_status st = kt_free(p.pool, ptr, 0, nullptr);
  if (st == KT_OK && p.rec) (void)kt_caprec_free(p.rec, ptr);
  return st;
}

kt_status KitsuneAllocator::use_in_locked(Private& p, void* ptr, cudaStream_t stream) {
  if (p.placer && kt_placer_use(p.placer, ptr, stream) == KT_OK) return KT_OK;
  kt_status st = kt_record_stream(p.pool, ptr, stream);
  if (st == KT_OK && p.rec) (void)kt_caprec_use(p.rec, ptr, stream);
  return st;
}

// Destroys private pool i if it was released and holds no live block.
void KitsuneAllocator::maybe_destroy_locked(size_t i) {
  Private& p = private_[i];
  if (!p.released || p.filter) return;
  kt_stats st;
  kt_get_stats(p.pool, &st);
  if (st.allocations.current != 0) return;
  if (p.placer) {
    kt_placer_stats ps;
    kt_placer_get_stats(p.placer, &ps);
    if (ps.live_blocks != 0) return;
    kt_placer_destroy(p.placer);
  }
  kt_caprec_destroy(p.rec);
  kt_pool_destroy(p.pool);
  private_.erase(private_.begin() + static_cast<std::ptrdiff_t>(i));
  has_private_.store(!private_.empty(), std::memory_order_relaxed);
}

}  // namespace bridge

// ---- segments for a torch.cuda.MemPool (kitsune.allocator.use()) ----------------
// Without a global install, PyTorch's own caching allocator keeps managing blocks
// and asks a MemPool's allocator only for segments; these two functions, in the
// pluggable-allocator ABI, serve those segments from one Kitsune pool per device.
// PyTorch releases a segment only once no work uses it, so one stream (the NULL
// handle) stands for all.
namespace bridge {
namespace {
std::mutex g_seg_mu;
std::vector<kt_pool_t*> g_seg_pools;

kt_pool_t* seg_pool(int device, bool create) {
  std::lock_guard<std::mutex> g(g_seg_mu);
  if (device < 0) return nullptr;
  if (static_cast<size_t>(device) >= g_seg_pools.size()) {
    if (!create) return nullptr;
    g_seg_pools.resize(device + 1, nullptr);
  }
  if (!g_seg_pools[device] && create && create_device_pool(device, &g_seg_pools[device]) != KT_OK)
    g_seg_pools[device] = nullptr;
  return g_seg_pools[device];
}
}  // namespace
}  // namespace bridge

using namespace bridge;   // the C entry points below work on the bridge's objects

extern "C" {

// What the last capture (or MemPool use) on device prepared: out[0..4] = bytes the
// last releasing empty_cache gave back, workspace bytes, bytes asked to be ready,
// bytes ready, kt_status. KT_ERR_UNAVAILABLE when Kitsune is not installed.
__attribute__((visibility("default"))) int kt_bridge_capture_info(int device, int64_t* out) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  auto p = g_allocator->prepared(static_cast<c10::DeviceIndex>(device));
  out[0] = p.emptied; out[1] = p.workspaces; out[2] = p.hint; out[3] = p.ready; out[4] = p.status;
  return KT_OK;
}

// Eight int64 (KitsuneAllocator::breakdown); KT_ERR_UNAVAILABLE when Kitsune is not
// installed, KT_ERR_INVALID for a device without a pool.
__attribute__((visibility("default"))) int kt_bridge_memory_breakdown(int device, int64_t* out) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  try {
    g_allocator->breakdown(static_cast<c10::DeviceIndex>(device), out);
  } catch (const std::exception&) {
    return KT_ERR_INVALID;
  }
  return KT_OK;
}

// Capture plans (kitsune.allocator's _record_capture / _take_recording / _place_capture,
// used by compile_step). Pool ids are torch.cuda.graph_pool_handle()'s pair.
__attribute__((visibility("default"))) int kt_bridge_pool_record(int device, uint64_t id0, uint64_t id1) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  return g_allocator->set_pending(static_cast<c10::DeviceIndex>(device), {id0, id1}, true, nullptr);
}

__attribute__((visibility("default"))) int kt_bridge_pool_place(int device, uint64_t id0, uint64_t id1,
                                                                const kt_capplan* plan) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  return g_allocator->set_pending(static_cast<c10::DeviceIndex>(device), {id0, id1}, false, plan);
}

__attribute__((visibility("default"))) int kt_bridge_pool_take_recording(int device, uint64_t id0, uint64_t id1,
                                                                         TakenRecording** out) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  return g_allocator->take_recording(static_cast<c10::DeviceIndex>(device), {id0, id1}, out);
}

__attribute__((visibility("default"))) int kt_bridge_pool_placer_stats(int device, uint64_t id0, uint64_t id1,
                                                                       int64_t* out) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  return g_allocator->placer_stats(static_cast<c10::DeviceIndex>(device), {id0, id1}, out);
}

__attribute__((visibility("default"))) void* kt_bridge_seg_alloc(size_t size, int device, cudaStream_t) {
  kt_pool_t* p = seg_pool(device, true);
  void* out = nullptr;
  if (!p || kt_alloc(p, size, nullptr, &out) != KT_OK) return nullptr;   // PyTorch reports the OOM
  return out;
}

__attribute__((visibility("default"))) void kt_bridge_seg_free(void* ptr, size_t size, int device, cudaStream_t) {
  kt_pool_t* p = seg_pool(device, false);
  if (p && ptr) kt_free(p, ptr, size, nullptr);
}

// KT_ERR_UNAVAILABLE before the device's segment pool exists.
__attribute__((visibility("default"))) int kt_bridge_seg_stats(int device, kt_stats* out) {
  kt_pool_t* p = seg_pool(device, false);
  return p ? kt_get_stats(p, out) : KT_ERR_UNAVAILABLE;
}

}  // extern "C"
