// python/kitsune/csrc/history.cpp — memory you can see: torch.cuda.memory._snapshot()
// and _record_memory_history() under Kitsune, so PyTorch's memory visualizer
// (torch.cuda.memory._dump_snapshot, torch.cuda._memory_viz) shows Kitsune's pools.
//
// Segments and blocks come from the C core's memory map (kt_pool_walk): each backend
// segment, or run of mapped granules of a VMM range, with its blocks in address order
// (allocated, freed but waiting for other streams' work, free). While history is on,
// every allocation and free the bridge serves is noted here: the stack PyTorch's
// context recorder gathers (Python, C++ or both) for each live block, and alloc /
// free entries in a ring per device of at most alloc_trace_max_entries, as PyTorch's
// allocator keeps them. A free is entered as requested and completed at once (the
// pool's own completion of a free that waits for another stream is not seen here).
// What is not shown: segment reservations and releases as trace entries, and the
// blocks inside a private pool (a CUDA graph's) unless that pool's id is asked: the
// device pool shows each private pool's segment as one allocated block.
#include "allocator.h"

#include <c10/util/ApproximateClock.h>

#include <algorithm>

namespace bridge {

using Trace = c10::CachingDeviceAllocator::TraceEntry;

void KitsuneAllocator::recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                                     size_t alloc_trace_max_entries, cca::RecordContext when, bool clear_history,
                                     const std::vector<std::string>& skip_actions) {
  std::lock_guard<std::mutex> g(history_mu_);
  if (history_.size() < pools_.size()) history_.resize(pools_.size()), history_next_.resize(pools_.size());
  history_recorder_ = enabled ? context_recorder : nullptr;
  history_when_ = enabled ? when : cca::RecordContext::NEVER;
  history_max_ = std::max<size_t>(1, alloc_trace_max_entries);
  history_skip_ = std::unordered_set<std::string>(skip_actions.begin(), skip_actions.end());
  if (!enabled || clear_history) {
    for (auto& ring : history_) ring.clear();
    std::fill(history_next_.begin(), history_next_.end(), 0);
  }
  // Stacks of blocks allocated while history was on are kept only while it is on: frees
  // are not noted once it is off, so an address reused later would show a stale stack.
  if (!enabled) history_live_.clear();
  history_on_.store(enabled, std::memory_order_relaxed);
}

namespace {

void push(std::vector<Trace>& ring, size_t& next, size_t max, Trace&& e) {
  if (ring.size() < max) {
    ring.push_back(std::move(e));
    return;
  }
  ring[next] = std::move(e);   // the oldest entry goes
  next = (next + 1) % ring.size();
}

}  // namespace

void KitsuneAllocator::history_alloc(c10::DeviceIndex dev, void* p, size_t n, cudaStream_t stream) {
  cca::CreateContextFn rec;
  cca::RecordContext when;
  {
    std::lock_guard<std::mutex> g(history_mu_);
    rec = history_recorder_, when = history_when_;
  }
  // the stack, gathered outside the lock (it walks Python frames)
  std::shared_ptr<c10::GatheredContext> ctx = rec && when >= cca::RecordContext::STATE ? rec() : nullptr;
  std::lock_guard<std::mutex> g(history_mu_);
  if (!history_on_.load(std::memory_order_relaxed) || static_cast<size_t>(dev) >= history_.size()) return;
  history_live_[reinterpret_cast<uintptr_t>(p)] = {n, stream, ctx};
  if (!history_skip_.count("alloc"))
    push(history_[dev], history_next_[dev], history_max_,
         Trace(Trace::ALLOC, dev, reinterpret_cast<size_t>(p), n, stream, {0, 0}, c10::getApproximateTime(),
               when >= cca::RecordContext::ALLOC ? ctx : nullptr));
}

void KitsuneAllocator::history_free(int dev, void* p) {
  if (!p) return;
  cca::CreateContextFn rec;
  cca::RecordContext when;
  {
    std::lock_guard<std::mutex> g(history_mu_);
    rec = history_recorder_, when = history_when_;
  }
  std::shared_ptr<c10::GatheredContext> ctx = rec && when == cca::RecordContext::ALL ? rec() : nullptr;
  std::lock_guard<std::mutex> g(history_mu_);
  auto it = history_live_.find(reinterpret_cast<uintptr_t>(p));
  if (it == history_live_.end() || dev < 0 || static_cast<size_t>(dev) >= history_.size()) return;   // from before
  const HistoryLive live = it->second;
  history_live_.erase(it);
  const auto t = c10::getApproximateTime();
  for (auto action : {Trace::FREE_REQUESTED, Trace::FREE_COMPLETED})
    if (!history_skip_.count(action == Trace::FREE_REQUESTED ? "free_requested" : "free_completed"))
      push(history_[dev], history_next_[dev], history_max_,
           Trace(action, static_cast<c10::DeviceIndex>(dev), reinterpret_cast<size_t>(p), live.size, live.stream,
                 {0, 0}, t, ctx));
}

namespace {

struct WalkInto {
  c10::DeviceIndex device;
  c10::cuda::MempoolId_t owner;
  std::vector<cca::SegmentInfo>* out;
  const std::unordered_map<uintptr_t, KitsuneAllocator::HistoryLive>* live;
};

// kt_pool_walk's callback: a SegmentInfo a segment, a BlockInfo a block.
int add_to_snapshot(void* ctx, const kt_walk_segment* seg, const kt_walk_block* blk) {
  auto* w = static_cast<WalkInto*>(ctx);
  if (!blk) {
    cca::SegmentInfo s;
    s.device = w->device;
    s.address = seg->base;
    s.total_size = seg->size;
    s.is_large = seg->size > ((size_t)1 << 20);   // PyTorch's small pool: 2 MiB segments of blocks <= 1 MiB
    s.is_expandable = seg->vmm != 0;
    s.owner_private_pool_id = w->owner;
    w->out->push_back(std::move(s));
    return 0;
  }
  cca::SegmentInfo& s = w->out->back();
  c10::CachingDeviceAllocator::BlockInfo b;
  b.size = blk->size;
  b.requested_size = blk->requested;
  b.allocated = blk->state == KT_WALK_LIVE;
  b.active = blk->state != KT_WALK_FREE;
  if (b.allocated) {
    auto it = w->live->find(blk->addr);
    if (it != w->live->end()) b.context_when_allocated = it->second.context;
    if (!s.stream) s.stream = blk->stream;   // a segment serves several streams here; the first live block's
  }
  s.requested_size += blk->requested;
  s.allocated_size += b.allocated ? blk->size : 0;
  s.active_size += b.active ? blk->size : 0;
  s.blocks.push_back(std::move(b));
  return 0;
}

}  // namespace

cca::SnapshotInfo KitsuneAllocator::snapshot(c10::cuda::MempoolId_t mempool_id, bool include_traces) {
  cca::SnapshotInfo info;
  const bool everything = mempool_id.first == 0 && mempool_id.second == 0;
  std::lock_guard<std::mutex> pools_lock(mu_);   // mu_, then history_mu_, then the pools' own locks
  std::lock_guard<std::mutex> g(history_mu_);
  auto walk = [&](kt_pool_t* p, c10::DeviceIndex dev, c10::cuda::MempoolId_t owner) {
    WalkInto w{dev, owner, &info.segments, &history_live_};
    TORCH_CHECK(kt_pool_walk(p, add_to_snapshot, &w) == KT_OK, "Kitsune: the memory map of device ", dev,
                " could not be read");
  };
  if (everything) {
    for (size_t d = 0; d < pools_.size(); d++)
      if (pools_[d]) walk(pools_[d], static_cast<c10::DeviceIndex>(d), {0, 0});
  } else {
    for (const Private& p : private_)
      if (p.id == mempool_id && p.pool) walk(p.pool, p.device, p.id);
  }
  if (include_traces) {
    info.device_traces.resize(pools_.size());
    for (size_t d = 0; d < history_.size() && d < pools_.size(); d++) {   // oldest first
      const auto& ring = history_[d];
      const size_t k = history_next_[d];
      info.device_traces[d].assign(ring.begin() + static_cast<std::ptrdiff_t>(k), ring.end());
      info.device_traces[d].insert(info.device_traces[d].end(), ring.begin(),
                                   ring.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  return info;
}

}  // namespace bridge
