// python/kitsune/csrc/allocator.h — KitsuneAllocator: Kitsune's C pools as PyTorch's
// CUDA allocator.
//
// C++ because PyTorch's allocator interface is a C++ class (c10's CUDAAllocator); the
// class converts types and errors and calls the C core, where the logic lives
// (allocator/, and scheduler/ for capture plans).
//   - one kt pool per device (CUDA backend), created by init();
//   - a DataPtr's context is the block pointer with the device in its low 8 bits
//     and a private-pool flag above them (blocks are 512-byte aligned), so a free
//     of an eager tensor needs no lookup table or lock;
//   - stats map onto torch.cuda.memory_stats() keys (the "all" aggregate);
//   - a failed allocation throws c10::OutOfMemoryError (torch.OutOfMemoryError)
//     with the pool's diagnosis;
//   - CUDA graphs and MemPools get private pools (one kt pool per MempoolId) whose
//     segments are blocks of the device's pool, made ready before a capture begins,
//     so a capture allocates no device memory when the device's pool holds enough.
// The class is declared here and defined by concern: allocator.cpp (allocation, frees,
// caches, limits, stats; the install entry points) and private_pools.cpp (private
// pools, capture plans' recording and placing, MemPool segments). The logic it keeps
// (which private pool a capture's stream allocates from, when one goes, how a DataPtr
// names its pool) is about PyTorch's objects: MempoolIds, std::function filters,
// DataPtrs.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "capture.h"
#include "kitsune/alloc.h"
#include "kitsune/capplan.h"

namespace bridge {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::StatType;

constexpr uintptr_t kDeviceMask = 0xff;           // DataPtr context: device in the low 8 bits,
constexpr uintptr_t kPrivateBit = 0x100;          // a private pool's block (bit 8; blocks are
static_assert(KT_QUANTUM == 0x200, "context bits");  // 512-byte aligned)

class KitsuneAllocator;
extern KitsuneAllocator* g_allocator;   // the installed allocator (kt_bridge_install), or null
void kitsune_delete(void* ctx);

// A Kitsune pool for `device` with the process's options: every pool the bridge
// makes (per device, private, MemPool segments) comes from here. be: the CUDA
// backend, or a device pool's (kt_pool_backend_create) for a private pool.
// device_pool: the device's own pool, which maps granules of one address range
// (VMM) when the process sees one device; KITSUNE_VMM=0/1 overrides. With several
// devices it keeps segments by default: VMM memory is readable by other devices
// only once cuMemSetAccess grants them, which the backend does not do yet (peer
// copies and kernels would fault). Other pools keep segments.
kt_status create_device_pool(int device, kt_pool_t** out, bool device_pool = false, int device_count = 1,
                             const kt_backend* be = nullptr);

// Bytes of cuBLAS and cuBLASLt workspaces a capture on `stream` may allocate on dev,
// whose pool is `pool` (blas.cpp, which says how it guesses).
size_t blas_workspace_hint(kt_pool_t* pool, c10::DeviceIndex dev, cudaStream_t stream);

// KITSUNE_SEGV_BACKTRACE=1: kt_bridge_install sets a SIGSEGV handler that prints the
// native stack (debug.cpp).
void install_segv_backtrace_if_asked();

class KitsuneAllocator final : public cca::CUDAAllocator {
 public:
  ~KitsuneAllocator() override = default;  // pools live until the process ends

  // ---- allocation (allocator.cpp) -------------------------------------------
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &kitsune_delete; }
  void* raw_alloc(size_t n) override;
  void* raw_alloc_with_stream(size_t n, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void free_ctx(void* ctx);

  // ---- lifecycle ----------------------------------------------------------------
  void init(int device_count) override;
  bool initialized() override { return initialized_; }
  void enable(bool) override {}
  bool isEnabled() const override { return true; }
  std::string name() override { return "kitsune"; }
  kt_pool_t* device_pool(c10::DeviceIndex device) { return pool(device); }

  // ---- cache, limits, streams -------------------------------------------------
  void emptyCache(c10::cuda::MempoolId_t mempool_id) override;
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;

  // ---- stats ----------------------------------------------------------------------
  DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  void add_private_stats(c10::DeviceIndex device, kt_stats* st);   // private_pools.cpp
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override { return {}; }
  // ---- memory history and snapshots (history.cpp) ----------------------------------
  // torch.cuda.memory._snapshot(): segments and blocks from kt_pool_walk (the device
  // pools; a private pool's when its id is asked), with the stacks recorded while
  // _record_memory_history was on; recordHistory: alloc / free entries with their
  // stacks, as PyTorch's allocator keeps them.
  cca::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool_id, bool include_traces) override;
  struct HistoryLive {   // a block allocated while history was on
    size_t size;
    cudaStream_t stream;
    std::shared_ptr<c10::GatheredContext> context;
  };
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clear_history, const std::vector<std::string>& skip_actions) override;

  // ---- private pools: CUDA graphs, torch.cuda.MemPool (private_pools.cpp) ----------
  void beginAllocateToPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override;
  void createOrIncrefPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override;
  void setUseOnOOM(c10::DeviceIndex, c10::cuda::MempoolId_t, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) override;
  int getPoolUseCount(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) override;
  void endAllocateToPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) override;
  void releasePool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) override;

  // ---- not supported yet: clear errors, never silent misbehaviour (allocator.cpp) ---
  cca::ShareableHandle shareIpcHandle(void*) override;
  std::shared_ptr<void> getIpcDevPtr(std::string) override;
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker) override {}
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_dev, const void* src, int src_dev, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex, c10::cuda::MempoolId_t) override;
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) override;
  void copy_data(void* dest, const void* src, std::size_t count) const final;

  // ---- capture plans (kitsune/capplan.h; compile_step's planned graph memory) ------
  // private_pools.cpp
  kt_status set_pending(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, bool record, const kt_capplan* plan);
  kt_status take_recording(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, TakenRecording** out);
  kt_status placer_stats(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, int64_t* out);

  // What beginAllocateToPool prepared on dev last (kitsune.allocator.capture_info).
  struct Prepared {
    int64_t emptied = 0, workspaces = 0, hint = 0, ready = 0;
    kt_status status = KT_OK;
  };
  Prepared prepared(c10::DeviceIndex dev);

  // Where dev's reserved bytes are (kitsune.allocator.memory_breakdown): out[0..7] =
  // the device pool's reserved, allocated (private pools' segments and arenas are
  // blocks of it) and segment count; the private pools' count, segment bytes and
  // bytes allocated in them; placer arenas' bytes and the placed blocks live in them.
  void breakdown(c10::DeviceIndex dev, int64_t* out);

 private:
  kt_pool_t* pool(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < static_cast<int>(pools_.size()), "Kitsune: device ", device,
                " has no pool (", pools_.size(), " devices initialised)");
    return pools_[device];
  }

  // ---- memory history (history.cpp): called on every allocation and free while on ----
  void history_alloc(c10::DeviceIndex dev, void* p, size_t n, cudaStream_t stream);
  void history_free(int dev, void* p);
  std::atomic<bool> history_on_{false};
  std::mutex history_mu_;
  cca::CreateContextFn history_recorder_ = nullptr;   // under history_mu_, as the rest
  cca::RecordContext history_when_ = cca::RecordContext::NEVER;
  size_t history_max_ = 0;
  std::unordered_set<std::string> history_skip_;
  std::unordered_map<uintptr_t, HistoryLive> history_live_;
  std::vector<std::vector<c10::CachingDeviceAllocator::TraceEntry>> history_;   // a ring per device
  std::vector<size_t> history_next_;                                            // its oldest entry

  // ---- allocation and frees (allocator.cpp) ---------------------------------------
  void* alloc_on(c10::DeviceIndex dev, size_t n, cudaStream_t stream, bool* priv = nullptr);
  void free_any(void* ptr, int device);
  kt_status free_elsewhere(void* ptr, int device);
  void notify_oom(c10::DeviceIndex dev, size_t n);

  // ---- private pools (CUDA graphs, MemPool): one kt pool per MempoolId ----------
  // While a capture is under way, allocations from streams its filter accepts go to
  // the capture's private pool; blocks freed there are reused only by that pool, so
  // memory a graph uses is never handed to eager code. releasePool destroys the pool
  // once its last block is freed. (private_pools.cpp)
  struct Private {
    c10::DeviceIndex device;
    c10::cuda::MempoolId_t id;
    kt_pool_t* pool;
    std::function<bool(cudaStream_t)> filter;  // set while allocating to this pool
    bool released = false;
    int use_count = 0;   // createOrIncrefPool / beginAllocateToPool minus releasePool
    // kitsune.allocator's capture plans (compile_step): a recording of this pool's
    // capture, and the placer that lays a capture out by a plan (kitsune/capplan.h)
    kt_caprec* rec = nullptr;
    kt_placer* placer = nullptr;
    kt_status placer_status = KT_OK;   // of the last kt_placer_begin
    CaptureOrder order;   // the capture's graph (kt_capture_graph; heap: Private moves)
  };
  // What the next capture into a pool does, asked before the pool may exist.
  struct Pending {
    c10::DeviceIndex device;
    c10::cuda::MempoolId_t id;
    bool record;
    const kt_capplan* plan;   // the caller keeps it alive until the capture begins
  };

  Private* incref_private_locked(c10::DeviceIndex dev, c10::cuda::MempoolId_t id);
  void take_pending_locked(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, Private* p);
  Private* find_private(c10::DeviceIndex dev, c10::cuda::MempoolId_t id);
  bool capture_alloc(c10::DeviceIndex dev, size_t n, cudaStream_t stream, void** out, kt_status* st);
  kt_status free_private(void* ptr, int device);
  static kt_status free_in_locked(Private& p, void* ptr);
  static kt_status use_in_locked(Private& p, void* ptr, cudaStream_t stream);
  void maybe_destroy_locked(size_t i);

  std::mutex mu_;
  std::vector<kt_pool_t*> pools_;
  std::vector<kt_backend*> subs_;             // per device: private pools' backend (its pool's blocks)
  std::atomic<int64_t> emptied_[kDeviceMask + 1] = {};  // per device: what its last releasing empty_cache gave back
  Prepared prepared_[kDeviceMask + 1];                  // under mu_
  std::vector<Private> private_;             // under mu_
  std::vector<Pending> pending_;             // under mu_
  std::atomic<int> capturing_{0};             // private pools being allocated to
  std::atomic<bool> has_private_{false};
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  bool initialized_ = false;
};

}  // namespace bridge
