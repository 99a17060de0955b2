// python/kitsune/csrc/bridge.cpp — Kitsune's C pool as PyTorch's CUDA allocator.
//
// The only C++ in Kitsune: PyTorch's allocator interface is a C++ class. This file
// converts types and errors and calls the C core; the logic lives in allocator/.
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
// Entry points for Python (ctypes): kt_bridge_install, kt_bridge_installed.
// It also owns the process's pinned host pool (kitsune/pinned.h) and registers
// torch.ops.kitsune.pinned_empty, which returns CPU tensors backed by it.
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ATen.h>
#include "kitsune/philox.h"
#include "kitsune/optim_math.h"
#include <ATen/ops/gelu_backward.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <cublasLt.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/ExpandUtils.h>
#include <ATen/native/Pool.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/where.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/safe_numerics.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>   // get_current_graph_task_keep_graph
#include <torch/library.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <string>
#include <unistd.h>
#include <execinfo.h>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>
#include <memory>
#include <vector>

extern "C" {
#include "kitsune/alloc.h"
#include "kitsune/capplan.h"
#include "kitsune/fusion.h"
#include "kitsune/pinned.h"
}

// A capture's recording taken from its pool (kitsune.allocator._take_recording): the
// recorded allocations and the captured graph's order, self-contained once the capture
// ended, so one recording can be planned within several budgets (compile_step holds
// late weight-gradient joins to the plan without them that way: one capture fewer).
struct TakenRecording {
  kt_caprec* rec;
  int64_t programmatic, programmatic_ordered;   // the graph's programmatic edges; of them, counted as order
};

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::Stat;
using c10::CachingDeviceAllocator::StatType;

constexpr uintptr_t kDeviceMask = 0xff;           // DataPtr context: device in the low 8 bits,
constexpr uintptr_t kPrivateBit = 0x100;          // a private pool's block (bit 8; blocks are
static_assert(KT_QUANTUM == 0x200, "context bits");  // 512-byte aligned)

class KitsuneAllocator;
KitsuneAllocator* g_allocator = nullptr;
void kitsune_delete(void* ctx);

// KITSUNE_* run-time option as an int; dflt when unset or empty.
int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

// A Kitsune pool for `device` with the process's options: every pool the bridge
// makes (per device, private, MemPool segments) comes from here. be: the CUDA
// backend, or a device pool's (kt_pool_backend_create) for a private pool.
// device_pool: the device's own pool, which maps granules of one address range
// (VMM) when the process sees one device; KITSUNE_VMM=0/1 overrides. With several
// devices it keeps segments by default: VMM memory is readable by other devices
// only once cuMemSetAccess grants them, which the backend does not do yet (peer
// copies and kernels would fault). Other pools keep segments.
kt_status create_device_pool(int device, kt_pool_t** out, bool device_pool = false, int device_count = 1,
                             const kt_backend* be = nullptr) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.device = device;
  o.release_on_grow = env_int("KITSUNE_RELEASE_ON_GROW", o.release_on_grow) != 0;
  o.vmm = device_pool && env_int("KITSUNE_VMM", device_count == 1) != 0;
  if (be) o.shared_segment = KT_SEGMENT_ALIGN;   // a private pool's segments are cheap blocks of the device's
  return kt_pool_create(&o, be ? be : kt_cuda_backend(), out);
}

// ---- the order of a capture's work, for capture plans (kitsune/capplan.h) -------------
// The graph being captured, as the allocator sees it: cudaStreamGetCaptureInfo gives a
// stream's frontier (the nodes its next work depends on) and the graph; its edges say
// what finishes before what. Plain edges count; a programmatic one (a kernel that may
// start before its predecessor ends) only into one of Kitsune's dependent launches,
// which wait for their predecessor before any memory access
// (kt_graph_node_waits_first). Leaving those out cut each stream's ancestry at every
// column sum and LayerNorm backward after d12bc89: the 4-stream Inception net's plan
// grew from 351.7 to 459.9 MiB (graph_memory_dae9a1f.json, graph_memory_b139609.json).
// KITSUNE_CAPTURE_ORDER=0 turns this off (streams are then kept apart, as before 71e76aa).
struct CaptureOrder {
  cudaGraph_t graph = nullptr;   // the capture's, from the first frontier asked
  kt_capture_order ops{};
  int64_t programmatic = 0;      // at the last edges taken: programmatic edges,
  int64_t programmatic_ordered = 0;   // of them counted as ordering
  std::unordered_map<cudaGraphNode_t, bool> waits;   // kt_graph_node_waits_first, asked once a node
};

bool plain_edges(const cudaGraphEdgeData* e, size_t n) {
  for (size_t i = 0; e && i < n; i++)
    if (e[i].type != cudaGraphDependencyTypeDefault) return false;
  return true;
}

kt_status capture_frontier(void* ctx, kt_stream_t stream, uint64_t* nodes, size_t cap, size_t* n) {
  auto* c = static_cast<CaptureOrder*>(ctx);
  auto s = static_cast<cudaStream_t>(stream);
  // the legacy and per-thread default streams: asking about them during a capture
  // could invalidate it, and a capture never runs on them
  if (reinterpret_cast<uintptr_t>(s) <= 2) return KT_ERR_UNAVAILABLE;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t g = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* data = nullptr;
  size_t nd = 0;
  if (cudaStreamGetCaptureInfo(s, &status, nullptr, &g, &deps, &data, &nd) != cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  if (status != cudaStreamCaptureStatusActive || !g || !plain_edges(data, nd)) return KT_ERR_UNAVAILABLE;
  if (!c->graph) c->graph = g;
  else if (c->graph != g) return KT_ERR_UNAVAILABLE;   // a stream of another capture
  *n = nd;
  for (size_t i = 0; i < nd && i < cap; i++) nodes[i] = reinterpret_cast<uint64_t>(deps[i]);
  return KT_OK;
}

kt_status capture_edges(void* ctx, uint64_t* from, uint64_t* to, size_t cap, size_t* n) {
  auto* c = static_cast<CaptureOrder*>(ctx);
  if (!c->graph) return KT_ERR_UNAVAILABLE;
  size_t m = 0;
  if (cudaGraphGetEdges(c->graph, nullptr, nullptr, nullptr, &m) != cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  if (!from || !to || m > cap) {   // the count only (programmatic edges not yet left out)
    *n = m;
    return KT_OK;
  }
  std::vector<cudaGraphNode_t> f(m), t(m);
  std::vector<cudaGraphEdgeData> e(m);
  if (m && cudaGraphGetEdges(c->graph, f.data(), t.data(), e.data(), &m) != cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  size_t k = 0;
  c->programmatic = c->programmatic_ordered = 0;
  for (size_t i = 0; i < m && i < cap; i++) {
    if (e[i].type != cudaGraphDependencyTypeDefault) {
      c->programmatic++;
      if (e[i].type != cudaGraphDependencyTypeProgrammatic) continue;
      auto w = c->waits.find(t[i]);
      if (w == c->waits.end()) w = c->waits.emplace(t[i], kt_graph_node_waits_first(t[i]) != 0).first;
      if (!w->second) continue;
      c->programmatic_ordered++;
    }
    from[k] = reinterpret_cast<uint64_t>(f[i]);
    to[k++] = reinterpret_cast<uint64_t>(t[i]);
  }
  *n = k;
  return KT_OK;
}

// A plan within a budget (kt_capplan_create_within) orders a block's work after an
// earlier block's by adding that block's last nodes to the stream's dependencies.
kt_status capture_wait(void* ctx, kt_stream_t stream, const uint64_t* nodes, size_t n) {
  auto* c = static_cast<CaptureOrder*>(ctx);
  auto s = static_cast<cudaStream_t>(stream);
  if (!c->graph || reinterpret_cast<uintptr_t>(s) <= 2 || !n) return KT_ERR_UNAVAILABLE;
  std::vector<cudaGraphNode_t> deps(n);
  for (size_t i = 0; i < n; i++) deps[i] = reinterpret_cast<cudaGraphNode_t>(nodes[i]);
  if (cudaStreamUpdateCaptureDependencies(s, deps.data(), nullptr, n, cudaStreamAddCaptureDependencies) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return KT_ERR_UNAVAILABLE;
  }
  return KT_OK;
}

// KITSUNE_CAPPLAN_LOG=DIR: each plan compile_step takes also goes to
// DIR/capplan_<pid>_<n>.csv, a row a recorded block (size, stream as the order streams
// first appeared, recorded events, flags, planned offset or -1), and the pairs of
// planned blocks it let share bytes to DIR/capplan_<pid>_<n>_share.txt (a line a
// planned block i, in the CSV's order of planned blocks: "i: j ..." for each j that may
// reuse i's bytes by the order; plans of up to KT_CAPPLAN_ORDER_MAX_BLOCKS blocks; a plan
// with waits by recorded events, wait_by_slack 0, also lets the pairs its header's
// wait_gap names share), for analysis off
// the GPU (tools/capplan_log.py, tools/capplan_pack.py). Best effort: a file that cannot
// be written is skipped.
void log_plan(const kt_caprec* rec, const kt_capplan* plan) {
  static const char* dir = std::getenv("KITSUNE_CAPPLAN_LOG");
  static std::atomic<int> seq{0};
  if (!dir || !*dir) return;
  std::string path = std::string(dir) + "/capplan_" + std::to_string(getpid()) + "_" + std::to_string(seq++);
  kt_capplan_info pi;
  kt_capplan_get_info(plan, &pi);
  const size_t n = static_cast<size_t>(pi.blocks);
  std::vector<uint64_t> bits(n <= KT_CAPPLAN_ORDER_MAX_BLOCKS ? (n * n + 63) / 64 + 1 : 0);   // at most 32 MiB
  if (!bits.empty() && kt_caprec_share_matrix(rec, pi.blocks, bits.data()) == KT_OK) {
    if (FILE* sf = std::fopen((path + "_share.txt").c_str(), "w")) {
      for (size_t i = 0; i < n; i++) {
        std::fprintf(sf, "%zu:", i);
        for (size_t j = 0; j < n; j++)
          if ((bits[(i * n + j) / 64] >> ((i * n + j) % 64)) & 1) std::fprintf(sf, " %zu", j);
        std::fprintf(sf, "\n");
      }
      std::fclose(sf);
    }
  }
  FILE* f = std::fopen((path + ".csv").c_str(), "w");
  if (!f) return;
  std::fprintf(f,
               "# plan_bytes %zu peak_bytes %zu stream_peak_bytes %zu graph_nodes %d cross_shares %d wait_gap %lld "
               "wait_by_slack %d\n",
               pi.plan_bytes, pi.peak_bytes, pi.group_peak_bytes, pi.graph_nodes, pi.cross_shares,
               static_cast<long long>(pi.wait_gap), pi.wait_by_slack);
  std::fprintf(f, "block,size,stream,start,end,after,uses,unordered,offset\n");
  kt_caprec_info ri;
  kt_caprec_get_info(rec, &ri);
  std::vector<kt_stream_t> streams;
  for (int32_t i = 0, j = 0; i < ri.blocks; i++) {
    kt_caprec_block b;
    if (kt_caprec_get_block(rec, i, &b) != KT_OK) break;
    size_t k = 0;
    while (k < streams.size() && streams[k] != b.stream) k++;
    if (k == streams.size()) streams.push_back(b.stream);
    uint64_t off = 0, size = 0;
    long long o = b.end >= 0 && kt_capplan_get_block(plan, j++, &off, &size) == KT_OK ? static_cast<long long>(off) : -1;
    std::fprintf(f, "%d,%llu,%zu,%lld,%lld,%d,%d,%d,%lld\n", i, static_cast<unsigned long long>(b.size), k,
                 static_cast<long long>(b.start), static_cast<long long>(b.end), b.after, b.uses, b.unordered, o);
  }
  std::fclose(f);
}

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

class KitsuneAllocator final : public cca::CUDAAllocator {
 public:
  ~KitsuneAllocator() override = default;  // pools live until the process ends

  // ---- allocation ---------------------------------------------------------
  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex dev = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
    bool priv = false;
    void* p = alloc_on(dev, n, stream, &priv);
    uintptr_t ctx = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(dev) | (priv ? kPrivateBit : 0);
    return {p, reinterpret_cast<void*>(ctx), &kitsune_delete, c10::Device(c10::DeviceType::CUDA, dev)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &kitsune_delete; }

  void* raw_alloc(size_t n) override {
    c10::DeviceIndex dev = c10::cuda::current_device();
    return alloc_on(dev, n, c10::cuda::getCurrentCUDAStream(dev).stream());
  }
  void* raw_alloc_with_stream(size_t n, cudaStream_t stream) override {
    return alloc_on(c10::cuda::current_device(), n, stream);
  }
  // No context here: a private pool's block may start where the device pool's block
  // holding that pool's segment starts, so private pools are asked first.
  void raw_delete(void* ptr) override {
    int dev = c10::cuda::current_device();   // a guess
    if (has_private_.load(std::memory_order_relaxed) && ptr && free_private(ptr, dev) == KT_OK) return;
    free_any(ptr, dev);
  }

  void free_ctx(void* ctx) {
    uintptr_t v = reinterpret_cast<uintptr_t>(ctx);
    void* ptr = reinterpret_cast<void*>(v & ~(kDeviceMask | kPrivateBit));
    int dev = static_cast<int>(v & kDeviceMask);
    if (C10_UNLIKELY(v & kPrivateBit)) {
      if (!ptr) return;   // a 0-byte allocation (free_any returns on NULL itself)
      if (free_private(ptr, dev) != KT_OK) TORCH_WARN("Kitsune: free of ", ptr, " (a graph or MemPool block) on device ",
                                                      dev, " failed: no private pool holds it");
      return;
    }
    free_any(ptr, dev);
  }

  // ---- lifecycle -----------------------------------------------------------
  void init(int device_count) override {
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
  bool initialized() override { return initialized_; }
  void enable(bool) override {}
  bool isEnabled() const override { return true; }
  std::string name() override { return "kitsune"; }
  kt_pool_t* device_pool(c10::DeviceIndex device) { return pool(device); }

  // ---- cache, limits, streams -------------------------------------------------
  void emptyCache(c10::cuda::MempoolId_t mempool_id) override {
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
  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    kt_stats st;
    kt_get_stats(pool(device), &st);
    size_t free_b = 0, total = 0;
    {
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    }
    *largest = std::max(st.largest_free_block, free_b);  // what a workspace could get now
  }
  double getMemoryFraction(c10::DeviceIndex device) override {
    size_t limit = kt_get_memory_limit(pool(device));
    if (!limit) return 1.0;
    size_t free_b = 0, total = 0;
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
    return static_cast<double>(limit) / static_cast<double>(total);
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction > 0.0 && fraction <= 1.0, "Kitsune: memory fraction ", fraction,
                " is outside (0, 1]");
    kt_status st = kt_set_memory_fraction(pool(device), fraction);
    TORCH_CHECK(st == KT_OK, "Kitsune: set_memory_fraction(", fraction, ") failed: ", kt_status_str(st));
  }
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
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
  void* getBaseAllocation(void* ptr, size_t* size) override {
    kt_block_info bi;
    if (kt_block_query(pool(c10::cuda::current_device()), ptr, &bi) == KT_OK) *size = bi.size;
    return ptr;
  }

  // ---- stats -------------------------------------------------------------------
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
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
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    kt_reset_accumulated_stats(pool(device));
    std::lock_guard<std::mutex> g(mu_);
    for (auto& p : private_)
      if (p.device == device) kt_reset_accumulated_stats(p.pool);
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    kt_reset_peak_stats(pool(device));
    std::lock_guard<std::mutex> g(mu_);
    for (auto& p : private_)
      if (p.device == device) kt_reset_peak_stats(p.pool);
  }

  // The device's numbers include its private pools (graphs' memory is the device's).
  // A private pool's segments are blocks of the device's pool, so they are in its
  // reserved bytes already; in its allocated, active and requested bytes and its
  // block count they stand in for the private pool's own blocks. Peaks and
  // cumulative values stay the device pool's: a peak counts a graph's whole pool as
  // allocated (an upper bound of the blocks live in it). Device calls are the device
  // pool's (a private pool's reserves are blocks of it).
  void add_private_stats(c10::DeviceIndex device, kt_stats* st) {
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
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override { return {}; }
  cca::SnapshotInfo snapshot(c10::cuda::MempoolId_t, bool) override { return {}; }

  // ---- not supported yet: clear errors, never silent misbehaviour ---------------
  void beginAllocateToPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    // before mu_ (see workspace_hint); PyTorch calls this with the capture stream current
    int64_t workspaces = static_cast<int64_t>(workspace_hint(dev, c10::cuda::getCurrentCUDAStream(dev).stream()));
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
  void createOrIncrefPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(!allocator || allocator.get() == this,
                "Kitsune: with Kitsune installed, a torch.cuda.MemPool cannot use another allocator; "
                "create it without one (kitsune.allocator.use() does)");
    std::lock_guard<std::mutex> g(mu_);
    incref_private_locked(dev, id);
  }
  // Inductor's CUDA graph trees check that a graph pool holds exactly the tensors
  // they expect: every expected pointer is a live block of the pool, and the pool
  // has no other live block.
  bool checkPoolLiveAllocations(c10::DeviceIndex dev, c10::cuda::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
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
  void setUseOnOOM(c10::DeviceIndex, c10::cuda::MempoolId_t, bool use_on_oom) override {
    TORCH_CHECK(!use_on_oom, "Kitsune: torch.cuda.MemPool(use_on_oom=True) is not supported with Kitsune "
                             "installed (memory in a private pool is never handed to other allocations)");
  }
  void setNoSplit(c10::DeviceIndex, c10::cuda::MempoolId_t) override {
    TORCH_CHECK(false, "Kitsune: torch.cuda.MemPool(no_split=True) is not supported with Kitsune installed");
  }
  int getPoolUseCount(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) override {
    std::lock_guard<std::mutex> g(mu_);
    Private* p = find_private(dev, id);
    return p ? p->use_count : 0;
  }
  void endAllocateToPool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) override {
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
  // One use fewer; the last release frees the pool's cache, and the pool goes
  // once its last block is freed.
  void releasePool(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) override {
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
  cca::ShareableHandle shareIpcHandle(void*) override {
    TORCH_CHECK(false, "Kitsune: CUDA IPC handles are not supported by kitsune.allocator");
  }
  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false, "Kitsune: CUDA IPC handles are not supported by kitsune.allocator");
  }
  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext, bool,
                     const std::vector<std::string>&) override {
    TORCH_CHECK(!enabled, "Kitsune: torch.cuda.memory._record_memory_history is not supported; "
                          "record a trace with kitsune.allocator.trace(path) instead");
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> g(mu_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker) override {}
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }
  cudaError_t memcpyAsync(void* dst, int dst_dev, const void* src, int src_dev, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_dev == src_dev) return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, count, stream);
  }
  // Checkpoints (the layout of a graph pool, saved and restored) are what
  // torch.compile(mode="reduce-overhead") uses through Inductor's CUDA graph trees.
  static constexpr const char* kNoCheckpoints =
      "Kitsune: allocator checkpoints are not supported by kitsune.allocator. "
      "torch.compile(mode=\"reduce-overhead\") needs them for CUDA graph trees; with Kitsune "
      "installed, set torch._inductor.config.triton.cudagraph_trees = False (plain CUDA graphs, "
      "which Kitsune serves from private pools)";
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex, c10::cuda::MempoolId_t) override {
    TORCH_CHECK(false, kNoCheckpoints);
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex, std::shared_ptr<cca::AllocatorState>) override {
    TORCH_CHECK(false, kNoCheckpoints);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const final {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

 private:
  kt_pool_t* pool(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < static_cast<int>(pools_.size()), "Kitsune: device ", device,
                " has no pool (", pools_.size(), " devices initialised)");
    return pools_[device];
  }

  // Bytes of cuBLAS and cuBLASLt workspaces a capture on `stream` may allocate on
  // dev: the most that any stream holds now (PyTorch keys them by handle and stream;
  // a warm-up made them on its streams), else the sizes PyTorch says it would choose,
  // less what `stream` holds already (compile_step's capture stream holds its
  // partner's: kt_bridge_blas_share). Called without mu_: PyTorch allocates a
  // workspace while it holds its map's lock, and that allocation may need mu_.
  size_t workspace_hint(c10::DeviceIndex dev, cudaStream_t stream) {
    if (dev < 0 || dev >= static_cast<int>(pools_.size())) return 0;
    std::map<void*, size_t> per_stream;
    for (auto* w : {&at::cuda::cublas_handle_stream_to_workspace(), &at::cuda::cublaslt_handle_stream_to_workspace()}) {
      std::shared_lock<std::shared_mutex> lock(w->mutex);
      for (auto& kv : w->map) {
        kt_block_info bi;
        if (kv.second.device().index() == dev && kt_block_query(pools_[dev], kv.second.get(), &bi) == KT_OK)
          per_stream[std::get<1>(kv.first)] += bi.size;
      }
    }
    size_t most = 0;
    for (auto& kv : per_stream) most = std::max(most, kv.second);
    if (!most) return at::cuda::getChosenWorkspaceSize() + at::cuda::getCUDABlasLtWorkspaceSize();
    size_t held = per_stream[static_cast<void*>(stream)];
    return most > held ? most - held : 0;
  }

 public:
  // ---- capture plans (kitsune/capplan.h; compile_step's planned graph memory) ------
  // The next capture into (dev, id) records its allocations (record) or is laid out
  // by plan. Before beginAllocateToPool, outside any capture.
  kt_status set_pending(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, bool record, const kt_capplan* plan) {
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
  kt_status take_recording(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, TakenRecording** out) {
    std::lock_guard<std::mutex> g(mu_);
    Private* p = find_private(dev, id);
    if (!p || !p->rec || p->filter) return KT_ERR_INVALID;
    auto* t = new (std::nothrow) TakenRecording{p->rec, p->order ? p->order->programmatic : 0,
                                                p->order ? p->order->programmatic_ordered : 0};
    if (!t) return KT_ERR_HOST_OOM;
    p->rec = nullptr;
    *out = t;
    return KT_OK;
  }
  // out: arena bytes, arenas, live bytes, live blocks, planned, placed, refused, plan
  // bytes, peak bytes, the last begin's kt_status, waits. KT_ERR_INVALID when (dev, id)
  // has no placer.
  kt_status placer_stats(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, int64_t* out) {
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

  // What beginAllocateToPool prepared on dev last (kitsune.allocator.capture_info).
  struct Prepared {
    int64_t emptied = 0, workspaces = 0, hint = 0, ready = 0;
    kt_status status = KT_OK;
  };
  Prepared prepared(c10::DeviceIndex dev) {
    std::lock_guard<std::mutex> g(mu_);
    return dev >= 0 && dev <= static_cast<int>(kDeviceMask) ? prepared_[dev] : Prepared{};
  }

  // Where dev's reserved bytes are (kitsune.allocator.memory_breakdown): out[0..7] =
  // the device pool's reserved, allocated (private pools' segments and arenas are
  // blocks of it) and segment count; the private pools' count, segment bytes and
  // bytes allocated in them; placer arenas' bytes and the placed blocks live in them.
  void breakdown(c10::DeviceIndex dev, int64_t* out) {
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

 private:

  // priv (may be null): set when the block comes from a private pool.
  void* alloc_on(c10::DeviceIndex dev, size_t n, cudaStream_t stream, bool* priv = nullptr) {
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
    return p;
  }

  // Frees ptr from device's pool; if it is not there (a private pool, or raw_delete's
  // device guess was wrong), from device's private pools, then the other devices' pools.
  void free_any(void* ptr, int device) {
    if (!ptr) return;
    kt_status st = kt_free(pools_[device], ptr, 0, nullptr);
    if (C10_UNLIKELY(st == KT_ERR_INVALID)) st = free_elsewhere(ptr, device);
    // a deleter cannot throw; an unknown pointer here is a caller bug we must not hide
    if (C10_UNLIKELY(st != KT_OK))
      TORCH_WARN("Kitsune: free of ", ptr, " on device ", device, " failed: ", kt_status_str(st));
  }

  kt_status free_elsewhere(void* ptr, int device) {
    if (has_private_.load(std::memory_order_relaxed) && free_private(ptr, device) == KT_OK) return KT_OK;
    for (int d = 0; d < static_cast<int>(pools_.size()); d++)
      if (d != device && kt_free(pools_[d], ptr, 0, nullptr) == KT_OK) return KT_OK;
    return KT_ERR_INVALID;
  }

  // ---- private pools (CUDA graphs, MemPool): one kt pool per MempoolId ----------
  // While a capture is under way, allocations from streams its filter accepts go to
  // the capture's private pool; blocks freed there are reused only by that pool, so
  // memory a graph uses is never handed to eager code. releasePool destroys the pool
  // once its last block is freed.
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
    std::unique_ptr<CaptureOrder> order;   // the capture's graph (heap: Private moves)
  };
  // What the next capture into a pool does, asked before the pool may exist.
  struct Pending {
    c10::DeviceIndex device;
    c10::cuda::MempoolId_t id;
    bool record;
    const kt_capplan* plan;   // the caller keeps it alive until the capture begins
  };

  // The private pool for (dev, id), created if needed, with one more use.
  Private* incref_private_locked(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) {
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
  void take_pending_locked(c10::DeviceIndex dev, c10::cuda::MempoolId_t id, Private* p) {
    for (size_t i = 0; i < pending_.size(); i++) {
      Pending q = pending_[i];
      if (q.device != dev || q.id != id) continue;
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      static const bool ordered = env_int("KITSUNE_CAPTURE_ORDER", 1) != 0;
      const kt_capture_order* ord = nullptr;
      if (ordered) {
        if (!p->order) {
          p->order = std::make_unique<CaptureOrder>();
          p->order->ops = kt_capture_order{p->order.get(), capture_frontier, capture_edges, capture_wait};
        }
        p->order->graph = nullptr;   // this capture's is taken from its first frontier
        p->order->programmatic = p->order->programmatic_ordered = 0;
        p->order->waits.clear();     // another graph's nodes
        ord = &p->order->ops;
      }
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

  Private* find_private(c10::DeviceIndex dev, c10::cuda::MempoolId_t id) {
    for (auto& p : private_)
      if (p.device == dev && p.id == id) return &p;
    return nullptr;
  }

  // An allocation on a stream a capture's filter accepts goes to that capture's
  // private pool: at its planned offset when a placer places it, else from the pool.
  // Returns false when no capture takes the stream.
  bool capture_alloc(c10::DeviceIndex dev, size_t n, cudaStream_t stream, void** out, kt_status* st) {
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

  kt_status free_private(void* ptr, int device) {
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
  static kt_status free_in_locked(Private& p, void* ptr) {
    if (p.placer && kt_placer_free(p.placer, ptr) == KT_OK) return KT_OK;
    kt_status st = kt_free(p.pool, ptr, 0, nullptr);
    if (st == KT_OK && p.rec) (void)kt_caprec_free(p.rec, ptr);
    return st;
  }
  static kt_status use_in_locked(Private& p, void* ptr, cudaStream_t stream) {
    if (p.placer && kt_placer_use(p.placer, ptr, stream) == KT_OK) return KT_OK;
    kt_status st = kt_record_stream(p.pool, ptr, stream);
    if (st == KT_OK && p.rec) (void)kt_caprec_use(p.rec, ptr, stream);
    return st;
  }

  // Destroys private pool i if it was released and holds no live block.
  void maybe_destroy_locked(size_t i) {
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

  void notify_oom(c10::DeviceIndex dev, size_t n) {
    const kt_oom_info* o = kt_last_oom();
    std::vector<cca::OutOfMemoryObserver> obs;
    {
      std::lock_guard<std::mutex> g(mu_);
      obs = oom_observers_;
    }
    for (auto& f : obs) f(dev, n, o->device_total, o->device_free);
  }

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

void kitsune_delete(void* ctx) {
  if (ctx) g_allocator->free_ctx(ctx);
}

std::shared_ptr<KitsuneAllocator> g_owner;  // keeps the installed allocator alive

}  // namespace

extern "C" {

// Installs Kitsune as the CUDA allocator. Must run before CUDA initialises.
// Returns 0, or 1 with a message in err.
// KITSUNE_SEGV_BACKTRACE=1: a crash prints the native stack to stderr (a debugging
// aid for the GPU machine, which has no debugger).
void segv_backtrace(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

__attribute__((visibility("default"))) int kt_bridge_install(char* err, size_t len) {
  try {
    if (g_allocator) return 0;
    if (env_int("KITSUNE_SEGV_BACKTRACE", 0)) std::signal(SIGSEGV, segv_backtrace);
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
// The plan of a taken recording within budget bytes (< 0: none; kt_capplan_create_within).
// info[19]: planned blocks, arena bytes, plan bytes, live peak, recorded blocks, of them
// still live (left out), freed after the capture, the sum of the streams' live peaks,
// the recorded graph's nodes (0: streams kept apart), pairs shared across streams, the
// graph's programmatic edges and, of them, those counted as ordering, the wait gap (-1:
// none), the pairs only waits let share, the plan's bytes without waits, whether node
// times chose the plan, whether its pairs are by slack (then the least slack of one,
// ns), its waits' first-order delay (ns).
__attribute__((visibility("default"))) int kt_bridge_recording_plan(const TakenRecording* t, int64_t budget,
                                                                    kt_capplan** out, int64_t* info) {
  if (!t || !out || !info) return KT_ERR_INVALID;
  kt_caprec_info ri;
  kt_caprec_get_info(t->rec, &ri);
  kt_status st = kt_capplan_create_within(t->rec, budget < 0 ? UINT64_MAX : static_cast<uint64_t>(budget), out);
  if (st != KT_OK) return st;
  log_plan(t->rec, *out);
  kt_capplan_info ci;
  kt_capplan_get_info(*out, &ci);
  int64_t v[19] = {ci.blocks, static_cast<int64_t>(ci.arena_bytes), static_cast<int64_t>(ci.plan_bytes),
                   static_cast<int64_t>(ci.peak_bytes), ri.blocks, ri.live, ri.freed_after,
                   static_cast<int64_t>(ci.group_peak_bytes), ci.graph_nodes, ci.cross_shares,
                   t->programmatic, t->programmatic_ordered, ci.wait_gap, ci.wait_shares,
                   static_cast<int64_t>(ci.unwaited_bytes), ci.wait_timed, ci.wait_by_slack, ci.wait_slack_ns,
                   ci.wait_delay_ns};
  std::memcpy(info, v, sizeof v);
  return KT_OK;
}
// When the recorded graph's nodes finished in a replay (kt_caprec_set_times).
__attribute__((visibility("default"))) int kt_bridge_recording_set_times(TakenRecording* t, const uint64_t* nodes,
                                                                         const int64_t* finish_ns, size_t n) {
  return t ? kt_caprec_set_times(t->rec, nodes, finish_ns, n) : KT_ERR_INVALID;
}
__attribute__((visibility("default"))) void kt_bridge_recording_free(TakenRecording* t) {
  if (!t) return;
  kt_caprec_destroy(t->rec);
  delete t;
}
__attribute__((visibility("default"))) int kt_bridge_pool_placer_stats(int device, uint64_t id0, uint64_t id1,
                                                                       int64_t* out) {
  if (!g_allocator) return KT_ERR_UNAVAILABLE;
  return g_allocator->placer_stats(static_cast<c10::DeviceIndex>(device), {id0, id1}, out);
}
__attribute__((visibility("default"))) void kt_bridge_plan_free(kt_capplan* plan) { kt_capplan_destroy(plan); }

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

// ---- cuBLAS workspaces shared by a stream and compile_step's capture stream -------
// PyTorch gives every (cuBLAS handle, stream) pair a cuBLAS and a cuBLASLt workspace
// of its own (at::cuda::cublas(lt)_handle_stream_to_workspace), kept for the process:
// 65-66 MiB a stream on an H100 (bench/results/graph_memory_ws_2d2f006.json). A graph
// captured on a side stream bakes that stream's workspaces in, so every whole-step
// graph held 65 MiB that the eager step does not. kt_bridge_blas_share makes stream
// `to` use the workspaces of stream `from`, handle by handle: an alias is a DataPtr
// whose deleter does nothing. The caller owns the ordering this needs: work on `to`,
// and a replay of a graph captured on `to` (wherever it is launched), must be ordered
// with the work on `from` (compile_step fences them with events).
namespace {
void blas_alias_deleter(void*) {}
bool is_blas_alias(const at::DataPtr& d) { return d.get_deleter() == &blas_alias_deleter; }
at::DataPtr blas_alias(const at::DataPtr& of) {
  return at::DataPtr(of.get(), nullptr, &blas_alias_deleter, of.device());
}
std::atomic<int64_t> g_blas_test_frees{0};
void blas_test_deleter(void*) { g_blas_test_frees.fetch_add(1, std::memory_order_relaxed); }

at::cuda::WorkspaceMapWithMutex* blas_map(int kind) {
  return kind == 0 ? &at::cuda::cublas_handle_stream_to_workspace()
       : kind == 1 ? &at::cuda::cublaslt_handle_stream_to_workspace() : nullptr;
}
}  // namespace

extern "C" {

// For every handle with a workspace on `from` or `to`, in both maps:
//   on `from` only          -> `to` gets an alias of it
//   on `to` only, its own   -> it moves to `from`, `to` keeps an alias   (out[1]++)
//                              (its address is unchanged: graphs that baked it in
//                              stay valid, and `from` uses it from now on)
//   `to` has an alias       -> it points at `from`'s (a new one when PyTorch's
//                              clearCublasWorkspaces dropped the old), or goes when
//                              `from` has none
//   both their own          -> left apart: graphs may hold either        (out[2]++)
// out[0] counts the (map, handle) pairs whose `to` workspace is now `from`'s.
// out may be NULL. Never frees a workspace. KT_ERR_INVALID when from == to.
__attribute__((visibility("default"))) int kt_bridge_blas_share(uint64_t from, uint64_t to, int64_t* out) {
  if (from == to) return KT_ERR_INVALID;
  int64_t n[3] = {0, 0, 0};
  void* f = reinterpret_cast<void*>(from);
  void* t = reinterpret_cast<void*>(to);
  try {
    for (int kind = 0; kind < 2; ++kind) {
      auto* w = blas_map(kind);
      std::unique_lock<std::shared_mutex> lock(w->mutex);
      std::unordered_set<void*> handles;
      for (auto& kv : w->map)
        if (std::get<1>(kv.first) == f || std::get<1>(kv.first) == t) handles.insert(std::get<0>(kv.first));
      for (void* h : handles) {
        auto fi = w->map.find(std::make_tuple(h, f));
        auto ti = w->map.find(std::make_tuple(h, t));
        if (ti != w->map.end() && is_blas_alias(ti->second)) {   // ours: point it at `from`'s current one
          if (fi == w->map.end()) { w->map.erase(ti); continue; }
          if (ti->second.get() != fi->second.get()) ti->second = blas_alias(fi->second);
          ++n[0];
          continue;
        }
        if (ti == w->map.end()) {
          w->map.emplace(std::make_tuple(h, t), blas_alias(fi->second));
          ++n[0];
        } else if (fi == w->map.end()) {
          at::DataPtr own = std::move(ti->second);
          ti->second = blas_alias(own);
          w->map.emplace(std::make_tuple(h, f), std::move(own));
          ++n[0];
          ++n[1];
        } else {
          ++n[2];
        }
      }
    }
  } catch (const std::exception&) {
    return KT_ERR_HOST_OOM;
  }
  if (out) std::memcpy(out, n, sizeof n);
  return KT_OK;
}

// The workspaces of `stream`: rows of {map (0 cuBLAS, 1 cuBLASLt), handle, address,
// is an alias}, at most cap rows written; returns how many there are (or -1 on a
// bad argument).
__attribute__((visibility("default"))) int64_t kt_bridge_blas_list(uint64_t stream, int64_t* rows, int64_t cap) {
  if (cap < 0 || (cap > 0 && !rows)) return -1;
  int64_t n = 0;
  for (int kind = 0; kind < 2; ++kind) {
    auto* w = blas_map(kind);
    std::shared_lock<std::shared_mutex> lock(w->mutex);
    for (auto& kv : w->map) {
      if (std::get<1>(kv.first) != reinterpret_cast<void*>(stream)) continue;
      if (n < cap) {
        int64_t* r = rows + 4 * n;
        r[0] = kind;
        r[1] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(std::get<0>(kv.first)));
        r[2] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(kv.second.get()));
        r[3] = is_blas_alias(kv.second);
      }
      ++n;
    }
  }
  return n;
}

// Tests only (no GPU needed): puts a workspace entry whose deleter counts frees
// (address 0: erases the entry), and reads that count.
__attribute__((visibility("default"))) int kt_bridge_blas_test_put(int kind, uint64_t handle, uint64_t stream,
                                                                   uint64_t address) {
  auto* w = blas_map(kind);
  if (!w) return KT_ERR_INVALID;
  auto key = std::make_tuple(reinterpret_cast<void*>(handle), reinterpret_cast<void*>(stream));
  at::DataPtr old;
  {
    std::unique_lock<std::shared_mutex> lock(w->mutex);
    auto it = w->map.find(key);
    if (it != w->map.end()) {
      old = std::move(it->second);   // freed outside the lock
      w->map.erase(it);
    }
    if (address)
      w->map.emplace(key, at::DataPtr(reinterpret_cast<void*>(address), reinterpret_cast<void*>(address),
                                      &blas_test_deleter, c10::Device(c10::DeviceType::CUDA, 0)));
  }
  return KT_OK;
}
__attribute__((visibility("default"))) int64_t kt_bridge_blas_test_frees(void) {
  return g_blas_test_frees.load(std::memory_order_relaxed);
}

// A new non-blocking stream on device, for compile_step's captures: one no other
// code is handed (PyTorch's pool streams are shared round-robin), never destroyed.
__attribute__((visibility("default"))) int kt_bridge_stream_create(int device, int priority, uint64_t* out) {
  if (!out || device < 0) return KT_ERR_INVALID;
  try {
    c10::cuda::CUDAGuard g(static_cast<c10::DeviceIndex>(device));
    cudaStream_t s = nullptr;
    if (cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority) != cudaSuccess) {
      (void)cudaGetLastError();
      return KT_ERR_BACKEND;
    }
    *out = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s));
    return KT_OK;
  } catch (const std::exception&) {   // no such device
    return KT_ERR_UNAVAILABLE;
  }
}

}  // extern "C"

// ---- diagnostics: where an allocation's time goes, measured in C++ (no Python) ----
#include <chrono>

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

// ---- the pinned host pool: torch.ops.kitsune.pinned_empty + ctypes entry points ----
namespace {

std::mutex g_pinned_mu;
kt_pinned_pool_t* g_pinned = nullptr;
kt_backend* g_pinned_fake = nullptr;   // host fake backend, for tests without a GPU

// Creates g_pinned over `backend` with the process's options (g_pinned_mu held).
kt_status create_pinned_locked(const kt_backend* backend) {
  kt_status st = kt_pinned_create(backend, &g_pinned);
  if (st == KT_OK) kt_pinned_set_release_on_grow(g_pinned, env_int("KITSUNE_PINNED_RELEASE_ON_GROW", 1));
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

// ---- fused ops: torch.ops.kitsune.* (schemas here; fakes and autograd in ops.py) ----
namespace {
// CUDA: the C launchers of fusion/kernels on torch's current stream. CPU: the
// reference semantics in ATen. Inputs broadcast like PyTorch's binary ops and
// are made contiguous (a broadcast or strided operand is copied first).
using at::Tensor;

kt_dtype dtype_of(const Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return KT_F32;
    case at::kHalf: return KT_F16;
    case at::kBFloat16: return KT_BF16;
    default:
      TORCH_CHECK(false, "kitsune.", op, ": dtype ", t.scalar_type(),
                  " is not supported (float32, float16 and bfloat16 are)");
  }
}

void check_same(const Tensor& a, const Tensor& b, const char* op, const char* na, const char* nb) {
  TORCH_CHECK(a.device() == b.device(), "kitsune.", op, ": ", na, " is on ", a.device(), " but ", nb, " is on ",
              b.device());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "kitsune.", op, ": ", na, " is ", a.scalar_type(), " but ", nb,
              " is ", b.scalar_type(), " (cast one of them)");
}

void check_launch(kt_status st, const char* op) {
  TORCH_CHECK(st == KT_OK, "kitsune.", op, ": the CUDA kernel launch failed: ", kt_status_str(st));
}

void* stream_of(const Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// Operands broadcast to one shape, dense. The common case (same shapes, contiguous)
// returns the inputs as they are: no view, no copy on the launch path. So do operands
// that share one dense layout (channels-last activations, say): an elementwise op
// runs over their memory in order, and empty_like gives the output that layout.
std::vector<Tensor> broadcast_dense(std::initializer_list<Tensor> ts) {
  std::vector<Tensor> v(ts);
  bool same = true, one_layout = true;
  for (const auto& t : v) {
    same = same && t.sizes() == v[0].sizes();
    one_layout = one_layout && t.strides() == v[0].strides() && t.is_non_overlapping_and_dense();
  }
  if (same) {
    if (one_layout) return v;
    for (auto& t : v) t = t.contiguous();   // a no-op for contiguous tensors
    return v;
  }
  c10::DimVector shape(v[0].sizes().begin(), v[0].sizes().end());
  for (size_t i = 1; i < v.size(); i++) shape = at::infer_size_dimvector(shape, v[i].sizes());
  for (auto& t : v) t = t.expand(shape).contiguous();
  return v;
}

// The launcher shapes every binary op shares.
using BinaryLauncher = kt_status (*)(kt_dtype, const void*, const void*, void*, int64_t, void*);
using BinaryBackwardLauncher = kt_status (*)(kt_dtype, const void*, const void*, const void*, void*, void*, int64_t,
                                             void*);

// out = op(a, b) on the broadcast shape.
Tensor binary_cuda(const Tensor& a, const Tensor& b, const char* op, BinaryLauncher launch) {
  check_same(a, b, op, "a", "b");
  auto v = broadcast_dense({a, b});
  c10::cuda::CUDAGuard g(a.device());
  Tensor out = at::empty_like(v[0]);
  check_launch(launch(dtype_of(a, op), v[0].data_ptr(), v[1].data_ptr(), out.data_ptr(), out.numel(), stream_of(out)),
               op);
  return out;
}

// (grad_a, grad_b) of a binary op, at the broadcast shape; autograd (ops.py) sums
// them to each input's shape.
std::tuple<Tensor, Tensor> binary_backward_cuda(const Tensor& grad, const Tensor& a, const Tensor& b, const char* op,
                                                BinaryBackwardLauncher launch) {
  check_same(a, b, op, "a", "b");
  check_same(grad, a, op, "grad", "a");
  auto v = broadcast_dense({grad, a, b});
  c10::cuda::CUDAGuard g(a.device());
  Tensor ga = at::empty_like(v[0]), gb = at::empty_like(v[0]);
  check_launch(launch(dtype_of(a, op), v[0].data_ptr(), v[1].data_ptr(), v[2].data_ptr(), ga.data_ptr(),
                      gb.data_ptr(), ga.numel(), stream_of(ga)),
               op);
  return {ga, gb};
}

// The CPU references compute in fp32, or fp64 for fp64 inputs (which gradcheck uses).
at::ScalarType opmath(const Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

Tensor add_relu_cuda(const Tensor& a, const Tensor& b) { return binary_cuda(a, b, "add_relu", kt_add_relu); }
Tensor add_relu_cpu(const Tensor& a, const Tensor& b) {
  check_same(a, b, "add_relu", "a", "b");
  return at::relu(a + b);
}
// Takes (grad, out): binary_cuda's checks and broadcast fit it as they are.
Tensor add_relu_backward_cuda(const Tensor& grad, const Tensor& out) {
  return binary_cuda(grad, out, "add_relu_backward", kt_add_relu_backward);
}
Tensor add_relu_backward_cpu(const Tensor& grad, const Tensor& out) {
  return at::where(out > 0, grad, at::zeros_like(grad));
}

Tensor mul_tanh_cuda(const Tensor& a, const Tensor& b) { return binary_cuda(a, b, "mul_tanh", kt_mul_tanh); }
Tensor mul_tanh_cpu(const Tensor& a, const Tensor& b) {
  check_same(a, b, "mul_tanh", "a", "b");
  return at::tanh(a * b);
}
std::tuple<Tensor, Tensor> mul_tanh_backward_cuda(const Tensor& grad, const Tensor& a, const Tensor& b) {
  return binary_backward_cuda(grad, a, b, "mul_tanh_backward", kt_mul_tanh_backward);
}
std::tuple<Tensor, Tensor> mul_tanh_backward_cpu(const Tensor& grad, const Tensor& a, const Tensor& b) {
  Tensor t = at::tanh(a.to(opmath(a)) * b.to(opmath(a)));
  Tensor d = grad.to(opmath(grad)) * (1 - t * t);
  return {(d * b).to(a.scalar_type()), (d * a).to(a.scalar_type())};
}

int approx_code(c10::string_view approximate, const char* op) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh", "kitsune.", op, ": approximate must be 'none' or 'tanh', got '",
              approximate, "'");
  return approximate == "tanh" ? 1 : 0;
}
void check_bias(const Tensor& x, const Tensor& bias, const char* op) {
  check_same(x, bias, op, "x", "bias");
  TORCH_CHECK(x.dim() >= 1 && bias.dim() == 1 && bias.size(0) == x.size(-1), "kitsune.", op,
              ": bias must be 1-D with x.size(-1) = ", (x.dim() ? x.size(-1) : 0), " elements; got bias of shape ",
              bias.sizes(), " for x of shape ", x.sizes());
}
// Column sums of a 2-D (rows, cols) tensor with unit column stride (a bias
// gradient), accumulated in fp32 and stored as out_t. fp32, fp16 and bf16 on CUDA:
// kt_colsum (fusion/kernels/reduce.cu, deterministic; ATen's reduce_kernel took 12.2 us
// a call for GPT's bias gradients, bench/results/h100_profile_graph_gpt_e7b0309.log);
// anything else (fp64, the CPU, a fake tensor), ATen's sum.
Tensor colsum(const Tensor& x2, at::ScalarType out_t) {
  const at::ScalarType st = x2.scalar_type(), acc = st == at::kDouble ? at::kDouble : at::kFloat;
  const bool kt_type = st == at::kFloat || st == at::kHalf || st == at::kBFloat16;
  if (x2.is_cuda() && !x2.key_set().has(c10::DispatchKey::Python) && kt_type && x2.dim() == 2 &&
      (out_t == st || out_t == at::kFloat || (st == at::kFloat && (out_t == at::kHalf || out_t == at::kBFloat16))) &&
      x2.size(1) > 0 && (x2.stride(1) == 1 || x2.size(1) == 1) &&
      (x2.size(0) <= 1 || x2.stride(0) >= x2.size(1))) {
    const int64_t rows = x2.size(0), cols = x2.size(1), ld = rows > 1 ? x2.stride(0) : cols;
    const kt_dtype dt = dtype_of(x2, "colsum");
    c10::cuda::CUDAGuard g(x2.device());
    Tensor out = at::empty({cols}, x2.options().dtype(out_t));
    const int64_t wsn = kt_colsum_workspace(dt, rows, cols);
    Tensor ws = wsn ? at::empty({wsn}, x2.options().dtype(at::kFloat)) : Tensor();
    check_launch(kt_colsum_to(dt, dtype_of(out, "colsum"), x2.data_ptr(), out.data_ptr(),
                              wsn ? ws.data_ptr<float>() : nullptr, rows, cols, ld, stream_of(out)),
                 "colsum");
    return out;
  }
  return x2.sum(0, false, acc).to(out_t);
}

// An activation's backward on contiguous (rows, cols) g and aux, and the column sums
// of the result in out_t, in one kernel: {gx, sums}. launch(gx, sums, workspace,
// rows, cols) makes the kernel's call.
template <typename Launch>
std::tuple<Tensor, Tensor> act_grad_colsum(const Tensor& g, at::ScalarType out_t, const char* op, Launch launch) {
  const int64_t rows = g.size(0), cols = g.size(1);
  const kt_dtype dt = dtype_of(g, op);
  c10::cuda::CUDAGuard guard(g.device());
  Tensor gx = at::empty_like(g), out = at::empty({cols}, g.options().dtype(out_t));
  const int64_t wsn = kt_colsum_workspace(dt, rows, cols);
  Tensor ws = wsn ? at::empty({wsn}, g.options().dtype(at::kFloat)) : Tensor();
  check_launch(launch(dt, out_t == at::kFloat && g.scalar_type() != at::kFloat, gx, out,
                      wsn ? ws.data_ptr<float>() : nullptr, rows, cols),
               op);
  return {gx, out};
}

// ReLU's backward (y: ReLU's output) and its column sums (kt_relu_grad_colsum).
std::tuple<Tensor, Tensor> relu_grad_colsum(const Tensor& g, const Tensor& y, at::ScalarType out_t) {
  return act_grad_colsum(g, out_t, "relu_grad_colsum",
                         [&](kt_dtype dt, int f32, Tensor& gx, Tensor& out, float* ws, int64_t rows, int64_t cols) {
                           return kt_relu_grad_colsum(dt, f32, g.data_ptr(), y.data_ptr(), gx.data_ptr(),
                                                      out.data_ptr(), ws, rows, cols, stream_of(gx));
                         });
}

// GELU's backward at x + bias (bias undefined: x holds it already) and its column
// sums (kt_bias_gelu_grad_colsum): where an elementwise kernel wrote gx and kt_colsum
// read it back, one pass.
std::tuple<Tensor, Tensor> gelu_grad_colsum(const Tensor& g, const Tensor& x, const Tensor& bias, int approximate,
                                            at::ScalarType out_t) {
  return act_grad_colsum(g, out_t, "bias_gelu_backward",
                         [&](kt_dtype dt, int f32, Tensor& gx, Tensor& out, float* ws, int64_t rows, int64_t cols) {
                           return kt_bias_gelu_grad_colsum(dt, f32, g.data_ptr(), x.data_ptr(),
                                                           bias.defined() ? bias.data_ptr() : nullptr, gx.data_ptr(),
                                                           out.data_ptr(), ws, rows, cols, approximate, stream_of(gx));
                         });
}

Tensor bias_gelu_cuda(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
  check_bias(x, bias, "bias_gelu");
  int ap = approx_code(approximate, "bias_gelu");
  Tensor xc = x.contiguous(), bc = bias.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor out = at::empty_like(xc);
  if (out.numel() == 0) return out;
  check_launch(kt_bias_gelu(dtype_of(x, "bias_gelu"), xc.data_ptr(), bc.data_ptr(), out.data_ptr(), out.numel(),
                            bc.numel(), ap, stream_of(out)), "bias_gelu");
  return out;
}
Tensor bias_gelu_cpu(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
  check_bias(x, bias, "bias_gelu");
  approx_code(approximate, "bias_gelu");
  return at::gelu(x + bias, approximate);
}
std::tuple<Tensor, Tensor> bias_gelu_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& bias,
                                                   c10::string_view approximate) {
  check_bias(x, bias, "bias_gelu_backward");
  check_same(grad, x, "bias_gelu_backward", "grad", "x");
  int ap = approx_code(approximate, "bias_gelu_backward");
  Tensor gc = grad.expand(x.sizes()).contiguous(), xc = x.contiguous(), bc = bias.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  if (xc.numel() == 0) return {at::empty_like(xc), at::zeros_like(bias)};
  const int64_t n = bias.size(0);
  auto [gx, gb] = gelu_grad_colsum(gc.view({-1, n}), xc.view({-1, n}), bc, ap, bias.scalar_type());
  return {gx.view(x.sizes()), gb};
}
std::tuple<Tensor, Tensor> bias_gelu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& bias,
                                                  c10::string_view approximate) {
  check_bias(x, bias, "bias_gelu_backward");
  int ap = approx_code(approximate, "bias_gelu_backward");
  Tensor v = x.to(opmath(x)) + bias.to(opmath(x));
  Tensor d;
  if (ap) {
    const double k0 = 0.7978845608028654, k1 = 0.044715;
    Tensor t = at::tanh(k0 * (v + k1 * v * v * v));
    d = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * k0 * (1 + 3 * k1 * v * v);
  } else {
    d = 0.5 * (1 + at::erf(v * 0.7071067811865476)) + v * 0.3989422804014327 * at::exp(-0.5 * v * v);
  }
  Tensor gx = grad.to(opmath(grad)) * d;
  Tensor gb = gx.reshape({-1, bias.size(0)}).sum(0);
  return {gx.to(x.scalar_type()), gb.to(bias.scalar_type())};
}

Tensor swiglu_cuda(const Tensor& gate, const Tensor& up) { return binary_cuda(gate, up, "swiglu", kt_swiglu); }
Tensor swiglu_cpu(const Tensor& gate, const Tensor& up) {
  check_same(gate, up, "swiglu", "gate", "up");
  return at::silu(gate) * up;
}
std::tuple<Tensor, Tensor> swiglu_backward_cuda(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  return binary_backward_cuda(grad, gate, up, "swiglu_backward", kt_swiglu_backward);
}
std::tuple<Tensor, Tensor> swiglu_backward_cpu(const Tensor& grad, const Tensor& gate, const Tensor& up) {
  Tensor g = gate.to(opmath(gate)), s = at::sigmoid(g), gr = grad.to(opmath(grad));
  return {(gr * up.to(opmath(up)) * s * (1 + g * (1 - s))).to(gate.scalar_type()), (gr * g * s).to(up.scalar_type())};
}

void check_weight(const Tensor& x, const Tensor& w, const char* op) {
  check_same(x, w, op, "x", "weight");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "kitsune.", op,
              ": weight must be 1-D with x.size(-1) = ", (x.dim() ? x.size(-1) : 0), " elements; got weight of shape ",
              w.sizes(), " for x of shape ", x.sizes());
}
Tensor rms_norm_cuda(const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm");
  TORCH_CHECK(eps >= 0, "kitsune.rms_norm: eps must be >= 0, got ", eps);
  Tensor xc = x.contiguous(), wc = w.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor y = at::empty_like(xc);
  int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  if (rows == 0 || n == 0) return y;
  check_launch(kt_rms_norm(dtype_of(x, "rms_norm"), xc.data_ptr(), wc.data_ptr(), y.data_ptr(), rows, n, (float)eps,
                           stream_of(y)), "rms_norm");
  return y;
}
Tensor rms_norm_cpu(const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm");
  TORCH_CHECK(eps >= 0, "kitsune.rms_norm: eps must be >= 0, got ", eps);
  Tensor xf = x.to(opmath(x));
  return (xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps) * w.to(opmath(x))).to(x.scalar_type());
}
std::tuple<Tensor, Tensor> rms_norm_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm_backward");
  check_same(grad, x, "rms_norm_backward", "grad", "x");
  Tensor gc = grad.expand(x.sizes()).contiguous(), xc = x.contiguous(), wc = w.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor gx = at::empty_like(xc);
  int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  if (rows == 0 || n == 0) return {gx, at::zeros_like(w)};
  Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_launch(kt_rms_norm_backward(dtype_of(x, "rms_norm_backward"), gc.data_ptr(), xc.data_ptr(), wc.data_ptr(),
                                    gx.data_ptr(), rstd.data_ptr<float>(), rows, n, (float)eps, stream_of(gx)),
               "rms_norm_backward");
  // grad_weight = sum over rows of grad * x * r: the LayerNorm column kernel, no mean
  int64_t splits = kt_layer_norm_param_splits(rows, n);
  Tensor part = at::empty({splits, n}, x.options().dtype(at::kFloat));
  check_launch(kt_layer_norm_param_grads(dtype_of(x, "rms_norm_backward"), gc.data_ptr(), xc.data_ptr(),
                                         nullptr, rstd.data_ptr<float>(),
                                         part.data_ptr<float>(), nullptr, splits, rows, n, stream_of(gx)),
               "rms_norm_backward");
  return {gx, colsum(part, at::kFloat).to(w.scalar_type())};
}
std::tuple<Tensor, Tensor> rms_norm_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& w, double eps) {
  check_weight(x, w, "rms_norm_backward");
  Tensor xf = x.to(opmath(x)), gf = grad.to(opmath(x)).expand(x.sizes()), wf = w.to(opmath(x));
  int64_t n = x.size(-1);
  Tensor r = at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  Tensor dot = (gf * wf * xf).sum(-1, true);
  Tensor gx = r * wf * gf - xf * r.pow(3) / n * dot;
  Tensor gw = (gf * xf * r).reshape({-1, n}).sum(0);
  return {gx.to(x.scalar_type()), gw.to(w.scalar_type())};
}

// ---- LayerNorm family: layer_norm_relu, add_layer_norm (fusion/kernels/layer_norm.cu) ----
using OptTensor = std::optional<Tensor>;

const Tensor* opt(const OptTensor& t) { return t && t->defined() ? &*t : nullptr; }

// rows x n view for a LayerNorm over the trailing dims `shape`; checks weight/bias.
std::pair<int64_t, int64_t> norm_rows(const Tensor& x, c10::IntArrayRef shape, const Tensor* w, const Tensor* b,
                                      const char* op) {
  const int64_t k = (int64_t)shape.size();
  TORCH_CHECK(k >= 1 && x.dim() >= k && x.sizes().slice(x.dim() - k) == shape, "kitsune.", op,
              ": normalized_shape ", shape, " must match the trailing dimensions of x, of shape ", x.sizes());
  for (const Tensor* p : {w, b})
    if (p) {
      check_same(x, *p, op, "x", p == w ? "weight" : "bias");
      TORCH_CHECK(p->sizes() == shape, "kitsune.", op, ": ", p == w ? "weight" : "bias", " must have shape ",
                  shape, " (normalized_shape); got ", p->sizes());
    }
  int64_t n = c10::multiply_integers(shape);
  TORCH_CHECK(n > 0, "kitsune.", op, ": normalized_shape ", shape, " has no elements");
  return {x.numel() / n, n};
}
void check_eps(double eps, const char* op) { TORCH_CHECK(eps >= 0, "kitsune.", op, ": eps must be >= 0, got ", eps); }

// y = [relu](layer_norm(x [+ residual])); h_out receives x + residual when given.
Tensor ln_forward_cuda(const Tensor& x, const Tensor* res, const Tensor* w, const Tensor* b, Tensor* h_out,
                       int64_t rows, int64_t n, double eps, bool relu, const char* op) {
  Tensor xc = x.contiguous(), rc = res ? res->contiguous() : Tensor(), wc = w ? w->contiguous() : Tensor(),
         bc = b ? b->contiguous() : Tensor();
  c10::cuda::CUDAGuard g(x.device());
  Tensor y = at::empty_like(xc);
  if (h_out) *h_out = at::empty_like(xc);
  if (rows == 0) return y;
  check_launch(kt_layer_norm(dtype_of(x, op), xc.data_ptr(), res ? rc.data_ptr() : nullptr,
                             w ? wc.data_ptr() : nullptr, b ? bc.data_ptr() : nullptr,
                             h_out ? h_out->data_ptr() : nullptr, y.data_ptr(), rows, n, (float)eps, relu,
                             stream_of(y)),
               op);
  return y;
}

// (grad_h, grad_weight, grad_bias); an absent weight or bias gets an empty gradient.
std::tuple<Tensor, Tensor, Tensor> ln_backward_cuda(const Tensor& grad, const Tensor* grad_h_in, const Tensor& h,
                                                    const Tensor* w, const Tensor* b, int64_t rows, int64_t n,
                                                    double eps, bool relu, const char* op) {
  check_same(grad, h, op, "grad", "x");
  Tensor gc = grad.expand(h.sizes()).contiguous(), hc = h.contiguous();
  Tensor gic = grad_h_in ? grad_h_in->expand(h.sizes()).contiguous() : Tensor();
  Tensor wc = w ? w->contiguous() : Tensor(), bc = b ? b->contiguous() : Tensor();
  c10::cuda::CUDAGuard g(h.device());
  Tensor gh = at::empty_like(hc);
  auto fopt = h.options().dtype(at::kFloat);
  const kt_dtype dt = dtype_of(h, op);
  int64_t splits = kt_layer_norm_backward_splits(dt, rows, n);
  Tensor mean = at::empty({rows}, fopt), rstd = at::empty({rows}, fopt);
  // the weight's and the bias's stripe sums side by side in each row, (splits, 2n), so
  // one column sum finishes both (two reduce kernels a LayerNorm were 24 of GPT's
  // step, bench/results/h100_profile_graph_101578e.log)
  Tensor parts = w || b ? at::empty({splits, 2 * n}, fopt) : Tensor();
  float* pw = w ? parts.data_ptr<float>() : nullptr;
  float* pb = b ? parts.data_ptr<float>() + n : nullptr;
  if (rows > 0)
    check_launch(kt_layer_norm_backward(dt, gc.data_ptr(), grad_h_in ? gic.data_ptr() : nullptr, hc.data_ptr(),
                                        w ? wc.data_ptr() : nullptr, b ? bc.data_ptr() : nullptr, gh.data_ptr(),
                                        mean.data_ptr<float>(), rstd.data_ptr<float>(), pw, pb, 2 * n, splits, rows, n,
                                        (float)eps, relu, stream_of(gh)),
                 op);
  // the written columns: both halves, or the one wanted
  // in the parameters' dtype straight from the fp32 partials where they share one (two
  // cast kernels a LayerNorm were 24 launches, 30 us of GPT's step at 81772ef,
  // bench/results/h100_profile_graph_gpt_81772ef.log)
  const at::ScalarType pt = w && b && w->scalar_type() != b->scalar_type() ? at::kFloat
                            : w ? w->scalar_type() : b ? b->scalar_type() : at::kFloat;
  Tensor sums = !parts.defined() ? Tensor()
                : rows == 0      ? at::zeros({2 * n}, fopt.dtype(pt))
                : w && b         ? colsum(parts, pt)
                                 : colsum(parts.narrow(1, w ? 0 : n, n), pt);
  auto param = [&](const Tensor* p, int64_t first) {
    if (!p) return at::empty({0}, h.options());
    return sums.narrow(0, w && b ? first : 0, n).view(p->sizes()).to(p->scalar_type());
  };
  return {gh, param(w, 0), param(b, n)};
}

// CPU reference, fp32 (fp64 for fp64): the same formulas as the kernels.
Tensor ln_forward_cpu(const Tensor& h, const Tensor* w, const Tensor* b, int64_t n, double eps, bool relu) {
  Tensor hf = h.to(opmath(h)).reshape({-1, n});
  Tensor mean = hf.mean(1, true), var = (hf - mean).pow(2).mean(1, true);
  Tensor y = (hf - mean) * at::rsqrt(var + eps);
  if (w) y = y * w->to(opmath(h)).reshape({n});
  if (b) y = y + b->to(opmath(h)).reshape({n});
  if (relu) y = at::relu(y);
  return y.view(h.sizes()).to(h.scalar_type());
}
std::tuple<Tensor, Tensor, Tensor> ln_backward_cpu(const Tensor& grad, const Tensor* grad_h_in, const Tensor& h,
                                                   const Tensor* w, const Tensor* b, int64_t n, double eps,
                                                   bool relu) {
  auto om = opmath(h);
  Tensor hf = h.to(om).reshape({-1, n}), gf = grad.to(om).expand(h.sizes()).reshape({-1, n});
  Tensor mean = hf.mean(1, true), rstd = at::rsqrt((hf - mean).pow(2).mean(1, true) + eps);
  Tensor xh = (hf - mean) * rstd;
  Tensor wf = w ? w->to(om).reshape({n}) : at::ones({n}, hf.options());
  if (relu) gf = gf * ((xh * wf + (b ? b->to(om).reshape({n}) : at::zeros({n}, hf.options()))) > 0);
  Tensor dy = gf * wf;
  Tensor gh = rstd * (dy - dy.mean(1, true) - xh * (dy * xh).mean(1, true));
  if (grad_h_in) gh = gh + grad_h_in->to(om).expand(h.sizes()).reshape({-1, n});
  auto param = [&](const Tensor* p, const Tensor& v) {
    return p ? v.sum(0).view(p->sizes()).to(p->scalar_type()) : at::empty({0}, h.options());
  };
  return {gh.view(h.sizes()).to(h.scalar_type()), param(w, gf * xh), param(b, gf)};
}

Tensor layer_norm_relu_cuda(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                            double eps) {
  check_eps(eps, "layer_norm_relu");
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu");
  return ln_forward_cuda(x, nullptr, opt(w), opt(b), nullptr, rows, n, eps, true, "layer_norm_relu");
}
Tensor layer_norm_relu_cpu(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                           double eps) {
  check_eps(eps, "layer_norm_relu");
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu");
  return ln_forward_cpu(x, opt(w), opt(b), n, eps, true);
}
std::tuple<Tensor, Tensor, Tensor> layer_norm_relu_backward_cuda(const Tensor& grad, const Tensor& x,
                                                                 c10::IntArrayRef shape, const OptTensor& w,
                                                                 const OptTensor& b, double eps) {
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu_backward");
  return ln_backward_cuda(grad, nullptr, x, opt(w), opt(b), rows, n, eps, true, "layer_norm_relu_backward");
}
std::tuple<Tensor, Tensor, Tensor> layer_norm_relu_backward_cpu(const Tensor& grad, const Tensor& x,
                                                                c10::IntArrayRef shape, const OptTensor& w,
                                                                const OptTensor& b, double eps) {
  auto [rows, n] = norm_rows(x, shape, opt(w), opt(b), "layer_norm_relu_backward");
  return ln_backward_cpu(grad, nullptr, x, opt(w), opt(b), n, eps, true);
}

// add_layer_norm normalizes over the last dimension; x and residual have one shape.
std::pair<int64_t, int64_t> add_ln_rows(const Tensor& x, const Tensor& res, const OptTensor& w, const OptTensor& b,
                                        const char* op) {
  check_same(x, res, op, "x", "residual");
  TORCH_CHECK(x.sizes() == res.sizes(), "kitsune.", op, ": x and residual must have one shape; got ", x.sizes(),
              " and ", res.sizes());
  TORCH_CHECK(x.dim() >= 1, "kitsune.", op, ": x must have at least one dimension");
  return norm_rows(x, x.sizes().slice(x.dim() - 1), opt(w), opt(b), op);
}
std::tuple<Tensor, Tensor> add_layer_norm_cuda(const Tensor& x, const Tensor& res, const OptTensor& w,
                                               const OptTensor& b, double eps) {
  check_eps(eps, "add_layer_norm");
  auto [rows, n] = add_ln_rows(x, res, w, b, "add_layer_norm");
  Tensor h;
  Tensor y = ln_forward_cuda(x, &res, opt(w), opt(b), &h, rows, n, eps, false, "add_layer_norm");
  return {h, y};
}
std::tuple<Tensor, Tensor> add_layer_norm_cpu(const Tensor& x, const Tensor& res, const OptTensor& w,
                                              const OptTensor& b, double eps) {
  check_eps(eps, "add_layer_norm");
  auto [rows, n] = add_ln_rows(x, res, w, b, "add_layer_norm");
  Tensor h = x + res;
  return {h, ln_forward_cpu(h, opt(w), opt(b), n, eps, false)};
}
// Takes the sum h = x + residual (the forward's first output); grad_sum is the
// gradient reaching that output (None when it was not used).
std::tuple<Tensor, Tensor, Tensor> add_layer_norm_backward_cuda(const Tensor& grad, const OptTensor& grad_sum,
                                                                const Tensor& h, const OptTensor& w,
                                                                const OptTensor& b, double eps) {
  auto [rows, n] = add_ln_rows(h, h, w, b, "add_layer_norm_backward");
  return ln_backward_cuda(grad, opt(grad_sum), h, opt(w), opt(b), rows, n, eps, false, "add_layer_norm_backward");
}
std::tuple<Tensor, Tensor, Tensor> add_layer_norm_backward_cpu(const Tensor& grad, const OptTensor& grad_sum,
                                                               const Tensor& h, const OptTensor& w,
                                                               const OptTensor& b, double eps) {
  auto [rows, n] = add_ln_rows(h, h, w, b, "add_layer_norm_backward");
  return ln_backward_cpu(grad, opt(grad_sum), h, opt(w), opt(b), n, eps, false);
}

// ---- cross_entropy and linear_cross_entropy (fusion/kernels/cross_entropy.cu) ----
// logits (N, C) or (C,), target (N,) or () of int64 class indices.
std::pair<Tensor, Tensor> ce_views(const Tensor& logits, const Tensor& target, double smoothing, const char* op) {
  TORCH_CHECK(logits.dim() == 1 || logits.dim() == 2, "kitsune.", op,
              ": logits must be (N, C) or (C,); got shape ", logits.sizes(), " (flatten the leading dims)");
  TORCH_CHECK(target.scalar_type() == at::kLong, "kitsune.", op, ": target must be int64 class indices; got ",
              target.scalar_type());
  TORCH_CHECK(target.device() == logits.device(), "kitsune.", op, ": logits are on ", logits.device(),
              " but target is on ", target.device());
  TORCH_CHECK(target.dim() == logits.dim() - 1 && (logits.dim() == 1 || target.size(0) == logits.size(0)), "kitsune.",
              op, ": target of shape ", target.sizes(), " does not match logits of shape ", logits.sizes());
  TORCH_CHECK(smoothing >= 0 && smoothing <= 1, "kitsune.", op, ": label_smoothing must be in [0, 1], got ",
              smoothing);
  TORCH_CHECK(logits.size(-1) > 0, "kitsune.", op, ": logits have no classes");
  Tensor l = logits.reshape({-1, logits.size(-1)}).contiguous();
  if ((uintptr_t)l.data_ptr() & 15) l = l.clone();   // the gradient's alignment must match
  return {l, target.reshape({-1}).contiguous()};
}
// grad / (number of targets that are not ignore_index), fp32 on the device, one kernel
// and no host sync; an undefined grad means 1.
Tensor ce_scale(const Tensor& target, int64_t ignore, const Tensor& grad, const char* op) {
  Tensor sc = at::empty({1}, target.options().dtype(at::kFloat));
  Tensor g = grad.defined() ? (grad.scalar_type() == at::kDouble ? grad.to(at::kFloat) : grad).contiguous() : grad;
  check_launch(kt_cross_entropy_scale(g.defined() ? dtype_of(g, op) : KT_F32, g.defined() ? g.data_ptr() : nullptr,
                                      target.data_ptr<int64_t>(), target.numel(), ignore, sc.data_ptr<float>(),
                                      stream_of(sc)),
               op);
  return sc;
}
// The loss's dtype: the logits', or float32 for float16/bfloat16 logits with float_loss
// (under autocast, as F.cross_entropy's; the per-row losses are fp32 either way).
at::ScalarType ce_loss_dtype(const Tensor& l, bool float_loss) {
  auto dt = l.scalar_type();
  return float_loss && (dt == at::kHalf || dt == at::kBFloat16) ? at::kFloat : dt;
}
// The mean of the per-row losses over the rows not ignored, as a 0-d tensor of dtype.
Tensor ce_mean(const Tensor& losses, const Tensor& target, int64_t ignore, at::ScalarType dtype, const char* op) {
  Tensor out = at::empty({}, losses.options().dtype(dtype));
  check_launch(kt_cross_entropy_mean(dtype_of(out, op), losses.data_ptr<float>(), target.data_ptr<int64_t>(),
                                     target.numel(), ignore, out.data_ptr(), stream_of(out)),
               op);
  return out;
}

// The mean loss and, with_grad, in the same pass over the logits, its gradient for an
// incoming gradient of 1 (what backward() passes; undefined without with_grad).
std::tuple<Tensor, Tensor> ce_forward_cuda(const Tensor& logits, const Tensor& target, int64_t ignore,
                                           double smoothing, bool with_grad, bool float_loss, const char* op) {
  auto [l, t] = ce_views(logits, target, smoothing, op);
  c10::cuda::CUDAGuard g(l.device());
  Tensor scale = with_grad ? ce_scale(t, ignore, Tensor(), op) : Tensor();
  Tensor losses = at::empty({l.size(0)}, l.options().dtype(at::kFloat));
  Tensor gl = with_grad ? at::empty_like(l) : Tensor();
  check_launch(kt_cross_entropy(dtype_of(l, op), l.data_ptr(), t.data_ptr<int64_t>(), losses.data_ptr<float>(),
                                with_grad ? gl.data_ptr() : nullptr, with_grad ? scale.data_ptr<float>() : nullptr,
                                l.size(0), l.size(1), l.size(1), ignore, (float)smoothing, stream_of(l)),
               op);
  return {ce_mean(losses, t, ignore, ce_loss_dtype(l, float_loss), op), with_grad ? gl.view(logits.sizes()) : Tensor()};
}
Tensor cross_entropy_cuda(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing,
                          bool float_loss) {
  return std::get<0>(ce_forward_cuda(logits, target, ignore, smoothing, false, float_loss, "cross_entropy"));
}
Tensor ce_reference(const Tensor& l, const Tensor& t, int64_t ignore, double smoothing) {   // per row, opmath
  Tensor lf = l.to(opmath(l));
  Tensor lsm = at::log_softmax(lf, 1);
  Tensor keep = t != ignore, tc = at::where(keep, t, at::zeros_like(t));
  Tensor nll = -lsm.gather(1, tc.unsqueeze(1)).squeeze(1);
  Tensor loss = (1 - smoothing) * nll - smoothing * lsm.mean(1);
  return at::where(keep, loss, at::zeros_like(loss));
}
Tensor cross_entropy_cpu(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing,
                         bool float_loss) {
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy");
  Tensor bad = (t != ignore) & ((t < 0) | (t >= l.size(1)));
  TORCH_CHECK(!bad.any().item<bool>(), "kitsune.cross_entropy: a target is outside [0, ", l.size(1),
              ") and is not ignore_index ", ignore);
  return (ce_reference(l, t, ignore, smoothing).sum() / (t != ignore).sum()).to(ce_loss_dtype(l, float_loss));
}
Tensor cross_entropy_backward_cuda(const Tensor& grad, const Tensor& logits, const Tensor& target, int64_t ignore,
                                   double smoothing) {
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy_backward");
  c10::cuda::CUDAGuard g(l.device());
  TORCH_CHECK(grad.numel() == 1, "kitsune.cross_entropy_backward: grad must have one element (the loss is a mean); got ",
              grad.sizes());
  TORCH_CHECK(grad.device() == logits.device(), "kitsune.cross_entropy_backward: grad is on ", grad.device(),
              " but logits are on ", logits.device());
  Tensor scale = ce_scale(t, ignore, grad, "cross_entropy_backward");
  Tensor gl = at::empty_like(l);
  check_launch(kt_cross_entropy(dtype_of(l, "cross_entropy_backward"), l.data_ptr(), t.data_ptr<int64_t>(), nullptr,
                                gl.data_ptr(), scale.data_ptr<float>(), l.size(0), l.size(1), l.size(1), ignore,
                                (float)smoothing, stream_of(l)),
               "cross_entropy_backward");
  return gl.view(logits.sizes());
}
// cross_entropy's autograd forward takes this when the logits need a gradient, so its
// backward only rescales (cross_entropy_rescale_) and the logits need not outlive the
// forward: one kernel's two passes over the logits where the loss and the backward
// kernels made one and two.
std::tuple<Tensor, Tensor> cross_entropy_with_grad_cuda(const Tensor& logits, const Tensor& target, int64_t ignore,
                                                        double smoothing, bool float_loss) {
  return ce_forward_cuda(logits, target, ignore, smoothing, true, float_loss, "cross_entropy_with_grad");
}
// grad *= by, unless by is 1 (a one-element tensor on grad's device, read there: no
// host sync), in place.
void check_rescale(const Tensor& grad, const Tensor& by) {
  TORCH_CHECK(by.numel() == 1, "kitsune.cross_entropy_rescale_: by must have one element; got shape ", by.sizes());
  TORCH_CHECK(by.device() == grad.device(), "kitsune.cross_entropy_rescale_: grad is on ", grad.device(),
              " but by is on ", by.device());
  TORCH_CHECK(grad.is_contiguous(), "kitsune.cross_entropy_rescale_: grad must be contiguous");
}
void cross_entropy_rescale__cuda(const Tensor& grad, const Tensor& by) {
  check_rescale(grad, by);
  c10::cuda::CUDAGuard g(grad.device());
  Tensor b = by.reshape({1}).to(at::kFloat);
  check_launch(kt_cross_entropy_rescale(dtype_of(grad, "cross_entropy_rescale_"), grad.data_ptr(), grad.numel(),
                                        b.data_ptr<float>(), stream_of(grad)),
               "cross_entropy_rescale_");
}
void cross_entropy_rescale__cpu(const Tensor& grad, const Tensor& by) {
  check_rescale(grad, by);
  Tensor(grad).mul_(by.reshape({}));   // times 1 leaves every value as it is
}
// (softmax - q) / count per row, zero on ignored rows, in opmath.
Tensor ce_grad_reference(const Tensor& l, const Tensor& t, int64_t ignore, double smoothing) {
  Tensor lf = l.to(opmath(l));
  Tensor keep = t != ignore, tc = at::where(keep, t, at::zeros_like(t));
  Tensor q = at::one_hot(tc, l.size(1)).to(lf.scalar_type()) * (1 - smoothing) + smoothing / l.size(1);
  return (at::softmax(lf, 1) - q) * keep.unsqueeze(1) / keep.sum();
}
Tensor cross_entropy_backward_cpu(const Tensor& grad, const Tensor& logits, const Tensor& target, int64_t ignore,
                                  double smoothing) {
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy_backward");
  return (ce_grad_reference(l, t, ignore, smoothing) * grad.to(opmath(l))).to(l.scalar_type()).view(logits.sizes());
}
std::tuple<Tensor, Tensor> cross_entropy_with_grad_cpu(const Tensor& logits, const Tensor& target, int64_t ignore,
                                                       double smoothing, bool float_loss) {
  Tensor loss = cross_entropy_cpu(logits, target, ignore, smoothing, float_loss);   // checks the targets
  auto [l, t] = ce_views(logits, target, smoothing, "cross_entropy_with_grad");
  return {loss, ce_grad_reference(l, t, ignore, smoothing).to(l.scalar_type()).view(logits.sizes())};
}

// linear_cross_entropy: x (..., H), weight (V, H), bias (V,) or None, target (...).
std::tuple<Tensor, Tensor> lce_views(const Tensor& x, const Tensor& w, const Tensor& target, const Tensor* bias,
                                     double smoothing, const char* op) {
  check_same(x, w, op, "x", "weight");
  TORCH_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), "kitsune.", op,
              ": weight must be (num_classes, x.size(-1) = ", x.dim() ? x.size(-1) : 0, "); got ", w.sizes(),
              " for x of shape ", x.sizes());
  if (bias) {
    check_same(x, *bias, op, "x", "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "kitsune.", op, ": bias must have ", w.size(0),
                " elements (weight.size(0)); got shape ", bias->sizes());
  }
  TORCH_CHECK(target.sizes() == x.sizes().slice(0, x.dim() - 1), "kitsune.", op, ": target of shape ",
              target.sizes(), " does not match x of shape ", x.sizes(), " (one class index per row of x)");
  TORCH_CHECK(target.scalar_type() == at::kLong, "kitsune.", op, ": target must be int64 class indices; got ",
              target.scalar_type());
  TORCH_CHECK(smoothing >= 0 && smoothing <= 1, "kitsune.", op, ": label_smoothing must be in [0, 1], got ",
              smoothing);
  return {x.reshape({-1, x.size(-1)}).contiguous(), target.reshape({-1}).contiguous()};
}
// Rows per chunk: an eighth of the rows, at least 1024 (GEMMs with fewer rows run
// well below peak, and every chunk re-reads and re-writes the grad_weight
// accumulator), a multiple of 64.
int64_t lce_chunk(int64_t rows, int64_t chunk) {
  if (chunk > 0) return chunk;
  int64_t c = std::max<int64_t>(1024, (rows + 7) / 8);
  return ((c + 63) / 64) * 64;
}
// Loss (and, with grads, d loss / d x, weight, bias) one chunk of rows at a time:
// the chunk's logits come from cuBLAS, the kernel turns them into losses and, in
// place, into the chunk's logit gradients (already divided by the count), which two
// more GEMMs turn into grad_x and the grad_weight sum.
std::tuple<Tensor, Tensor, Tensor, Tensor> lce_cuda(const Tensor& x, const Tensor& w, const Tensor& target,
                                                    const OptTensor& bias_, int64_t ignore, double smoothing,
                                                    int64_t chunk, bool grads, bool float_loss, const char* op) {
  const Tensor* bias = opt(bias_);
  auto [x2, t] = lce_views(x, w, target, bias, smoothing, op);
  TORCH_CHECK(chunk >= 0, "kitsune.", op, ": chunk_size must be >= 0 (0 chooses), got ", chunk);
  kt_dtype dt = dtype_of(x, op);
  c10::cuda::CUDAGuard g(x.device());
  const int64_t rows = x2.size(0), H = x2.size(1), V = w.size(0);
  Tensor wc = w.contiguous();
  auto fopt = x.options().dtype(at::kFloat);
  Tensor losses = at::empty({rows}, fopt), inv = ce_scale(t, ignore, Tensor(), op);
  Tensor gx, gw, gb;
  if (grads) {
    gx = at::empty_like(x2);
    gw = rows ? at::empty({V, H}, w.options()) : at::zeros({V, H}, w.options());   // the first chunk writes it
    gb = bias ? at::zeros({V}, fopt) : Tensor();
  }
  // An odd number of classes (GPT-2's 50257) as a GEMM dimension keeps cuBLAS on slow
  // sm75-era kernels: the loss head measured 18.0 ms against torch.compile's 4.6 ms
  // (bench/results/kernels_loss_head_437c519.json), and 15.0 ms with only the logits'
  // row stride padded (kernels_loss_head_3828d42.json). So the classes are padded to a
  // multiple of 64 with zero weight rows (a copy of the weight per call): the padded
  // logits are 0, the kernel reads only the first V of each row and leaves the rest 0,
  // and zero gradient columns add nothing to grad_x; grad_weight's padded rows are dropped.
  const int64_t c = lce_chunk(rows, chunk), ld = (V + 63) / 64 * 64;
  if (ld != V && rows) {
    Tensor wp = at::zeros({ld, H}, wc.options());
    wp.narrow(0, 0, V).copy_(wc);
    wc = wp;
  }
  Tensor bp = bias && ld != V ? at::cat({*bias, at::zeros({ld - V}, bias->options())}) : bias ? *bias : Tensor();
  if (grads && ld != V) gw = rows ? at::empty({ld, H}, w.options()) : gw;
  Tensor buf = rows ? at::empty({std::min(c, rows), ld}, x.options()) : Tensor();
  for (int64_t r0 = 0; r0 < rows; r0 += c) {
    const int64_t n = std::min(c, rows - r0);
    Tensor xc = x2.narrow(0, r0, n);
    Tensor full = buf.narrow(0, 0, n);   // n x ld, contiguous
    if (bias) at::addmm_out(full, bp, xc, wc.t());
    else at::mm_out(full, xc, wc.t());
    Tensor logits = full;   // the GEMMs below see all ld columns (padding: zero gradients)
    check_launch(kt_cross_entropy(dt, logits.data_ptr(), t.data_ptr<int64_t>() + r0, losses.data_ptr<float>() + r0,
                                  grads ? logits.data_ptr() : nullptr, inv.data_ptr<float>(), n, V, ld, ignore,
                                  (float)smoothing, stream_of(logits)),
                 op);
    if (!grads) continue;
    Tensor gxc = gx.narrow(0, r0, n);
    at::mm_out(gxc, logits, wc);
    // grad_weight accumulates in the weight's dtype through the GEMM's beta = 1: each
    // chunk's product is summed in fp32 and added with one rounding (at most 8 by
    // default). An fp32 accumulator would cost twice the weight's memory (2 GiB for a
    // LLaMA-3-sized head: more than the logits it saves).
    if (r0 == 0) at::mm_out(gw, logits.t(), xc);
    else gw.addmm_(logits.t(), xc);
    if (bias) gb.add_(logits.narrow(1, 0, V).sum(0, false, at::kFloat));
  }
  if (grads && ld != V && rows) gw = gw.narrow(0, 0, V);   // the first V rows: contiguous
  Tensor loss = ce_mean(losses, t, ignore, ce_loss_dtype(x, float_loss), op);
  if (!grads) return {loss, Tensor(), Tensor(), Tensor()};
  return {loss, gx.view(x.sizes()), gw,
          bias ? gb.to(bias->scalar_type()) : at::empty({0}, x.options())};
}
std::tuple<Tensor, Tensor, Tensor, Tensor> lce_cpu(const Tensor& x, const Tensor& w, const Tensor& target,
                                                   const OptTensor& bias_, int64_t ignore, double smoothing,
                                                   bool grads, bool float_loss, const char* op) {
  const Tensor* bias = opt(bias_);
  auto [x2, t] = lce_views(x, w, target, bias, smoothing, op);
  auto om = opmath(x);
  Tensor xf = x2.to(om), wf = w.to(om);
  Tensor logits = at::mm(xf, wf.t());
  if (bias) logits = logits + bias->to(om);
  Tensor loss =
      (ce_reference(logits, t, ignore, smoothing).sum() / (t != ignore).sum()).to(ce_loss_dtype(x, float_loss));
  if (!grads) return {loss, Tensor(), Tensor(), Tensor()};
  Tensor gl = ce_grad_reference(logits, t, ignore, smoothing);
  return {loss, at::mm(gl, wf).view(x.sizes()).to(x.scalar_type()), at::mm(gl.t(), xf).to(w.scalar_type()),
          bias ? gl.sum(0).to(bias->scalar_type()) : at::empty({0}, x.options())};
}
Tensor linear_cross_entropy_cuda(const Tensor& x, const Tensor& w, const Tensor& target, const OptTensor& bias,
                                 int64_t ignore, double smoothing, int64_t chunk, bool float_loss) {
  return std::get<0>(
      lce_cuda(x, w, target, bias, ignore, smoothing, chunk, false, float_loss, "linear_cross_entropy"));
}
Tensor linear_cross_entropy_cpu(const Tensor& x, const Tensor& w, const Tensor& target, const OptTensor& bias,
                                int64_t ignore, double smoothing, int64_t chunk, bool float_loss) {
  return std::get<0>(lce_cpu(x, w, target, bias, ignore, smoothing, false, float_loss, "linear_cross_entropy"));
}
std::tuple<Tensor, Tensor, Tensor, Tensor> linear_cross_entropy_grads_cuda(const Tensor& x, const Tensor& w,
                                                                           const Tensor& target, const OptTensor& bias,
                                                                           int64_t ignore, double smoothing,
                                                                           int64_t chunk, bool float_loss) {
  return lce_cuda(x, w, target, bias, ignore, smoothing, chunk, true, float_loss, "linear_cross_entropy_grads");
}
std::tuple<Tensor, Tensor, Tensor, Tensor> linear_cross_entropy_grads_cpu(const Tensor& x, const Tensor& w,
                                                                          const Tensor& target, const OptTensor& bias,
                                                                          int64_t ignore, double smoothing,
                                                                          int64_t chunk, bool float_loss) {
  return lce_cpu(x, w, target, bias, ignore, smoothing, true, float_loss, "linear_cross_entropy_grads");
}

// ---- sum_squared, mean_abs (fusion/kernels/reduce.cu) ----
// The reduced dims are moved last, so the kernel reduces rows of a [kept, reduced] view.
struct ReduceView { Tensor x; int64_t rows, n; c10::DimVector out_shape; };
ReduceView reduce_view(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim, const char* op) {
  const int64_t nd = x.dim();
  std::vector<bool> red(std::max<int64_t>(nd, 1), !dim || dim->empty());
  if (dim)
    for (int64_t d : *dim) {
      TORCH_CHECK(d >= -std::max<int64_t>(nd, 1) && d < std::max<int64_t>(nd, 1), "kitsune.", op, ": dim ", d,
                  " is out of range for a tensor of ", nd, " dimensions");
      red[d < 0 ? d + std::max<int64_t>(nd, 1) : d] = true;
    }
  std::vector<int64_t> perm;
  c10::DimVector out;
  int64_t rows = 1, n = 1;
  for (int64_t d = 0; d < nd; d++)
    if (!red[d]) { perm.push_back(d); out.push_back(x.size(d)); rows *= x.size(d); }
    else if (keepdim) out.push_back(1);
  for (int64_t d = 0; d < nd; d++)
    if (red[d]) { perm.push_back(d); n *= x.size(d); }
  return {nd ? x.permute(perm).contiguous() : x.contiguous(), rows, n, out};
}
Tensor reduce_cuda(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim, int op, const char* name) {
  auto v = reduce_view(x, dim, keepdim, name);
  kt_dtype dt = dtype_of(x, name);
  c10::cuda::CUDAGuard g(x.device());
  if (v.n == 0)   // sum over nothing is 0; mean over nothing is NaN, as in PyTorch
    return at::full(v.out_shape, op == KT_REDUCE_SUM_SQUARED ? 0.0 : NAN, x.options());
  Tensor out = at::empty({v.rows}, x.options());
  int64_t wsn = kt_reduce_workspace(v.rows, v.n);
  Tensor ws = wsn ? at::empty({wsn}, x.options().dtype(at::kFloat)) : Tensor();
  if (v.rows)
    check_launch(kt_reduce(dt, op, v.x.data_ptr(), out.data_ptr(), wsn ? ws.data_ptr<float>() : nullptr, v.rows, v.n,
                           stream_of(out)),
                 name);
  return out.view(v.out_shape);
}
Tensor reduce_cpu(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim, int op, const char* name) {
  auto v = reduce_view(x, dim, keepdim, name);
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kitsune.", name, ": x must be floating point; got ",
              x.scalar_type());
  Tensor xf = v.x.to(opmath(x)).reshape({v.rows, v.n});
  Tensor r = op == KT_REDUCE_SUM_SQUARED ? xf.pow(2).sum(1) : xf.abs().mean(1);
  return r.view(v.out_shape).to(x.scalar_type());
}
Tensor sum_squared_cuda(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cuda(x, dim, keepdim, KT_REDUCE_SUM_SQUARED, "sum_squared");
}
Tensor sum_squared_cpu(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cpu(x, dim, keepdim, KT_REDUCE_SUM_SQUARED, "sum_squared");
}
Tensor mean_abs_cuda(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cuda(x, dim, keepdim, KT_REDUCE_MEAN_ABS, "mean_abs");
}
Tensor mean_abs_cpu(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return reduce_cpu(x, dim, keepdim, KT_REDUCE_MEAN_ABS, "mean_abs");
}

// ---- attention_score: (q @ k^T) * scale as one cuBLAS batched GEMM, scale in alpha ----
// CompositeImplicitAutograd: autograd and fake shapes come from baddbmm's.
Tensor attention_score(const Tensor& q, const Tensor& k, std::optional<double> scale) {
  check_same(q, k, "attention_score", "q", "k");
  TORCH_CHECK(q.dim() >= 2 && k.dim() == q.dim() && q.sizes().slice(0, q.dim() - 2) == k.sizes().slice(0, k.dim() - 2)
                  && q.size(-1) == k.size(-1),
              "kitsune.attention_score: q (..., Lq, d) and k (..., Lk, d) must share batch dims and d; got ",
              q.sizes(), " and ", k.sizes());
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), "kitsune.attention_score: q must be floating point; got ",
              q.scalar_type());
  const int64_t d = q.size(-1), lq = q.size(-2), lk = k.size(-2);
  const double s = scale ? *scale : 1.0 / std::sqrt((double)std::max<int64_t>(d, 1));
  Tensor qb = q.reshape({-1, lq, d}), kb = k.reshape({-1, lk, d});
  Tensor out = at::baddbmm(at::empty({qb.size(0), lq, lk}, q.options()), qb, kb.transpose(1, 2), /*beta=*/0, s);
  c10::DimVector shape(q.sizes().begin(), q.sizes().end() - 1);
  shape.push_back(lk);
  return out.view(shape);
}

// ---- gelu_dropout, bias_dropout_add (fusion/kernels/dropout.cu) ----
// Each call draws (seed, offset) from PyTorch's default generator of the tensor's
// device (torch.manual_seed makes it repeatable) and returns them as an int64 CPU
// tensor `rng`; the mask is never stored. The backward ops and dropout_mask rebuild
// it from rng with the same Philox code (kitsune/philox.h) on either device.
std::pair<uint64_t, uint64_t> dropout_seed(const Tensor& like, const char* op) {
  if (like.is_cuda()) {
    auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
        std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(like.device().index()));
    std::lock_guard<std::mutex> lock(gen->mutex_);
    at::PhiloxCudaState st = gen->philox_cuda_state(4);
    TORCH_CHECK(!st.captured_, "kitsune.", op, ": dropout inside a CUDA graph capture is not supported yet");
    return {st.seed_.val, st.offset_.val};
  }
  auto gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return {gen->random64(), 0};
}
Tensor rng_tensor(std::pair<uint64_t, uint64_t> s) {
  Tensor t = at::empty({2}, at::TensorOptions().dtype(at::kLong));
  t.data_ptr<int64_t>()[0] = (int64_t)s.first;
  t.data_ptr<int64_t>()[1] = (int64_t)s.second;
  return t;
}
std::pair<uint64_t, uint64_t> rng_values(const Tensor& rng, const char* op) {
  TORCH_CHECK(rng.device().is_cpu() && rng.scalar_type() == at::kLong && rng.numel() == 2, "kitsune.", op,
              ": rng must be the int64 CPU tensor of 2 values the forward returned; got ", rng.scalar_type(), " ",
              rng.sizes(), " on ", rng.device());
  Tensor r = rng.contiguous();
  return {(uint64_t)r.data_ptr<int64_t>()[0], (uint64_t)r.data_ptr<int64_t>()[1]};
}
void check_p(double p, const char* op) {
  TORCH_CHECK(p >= 0 && p <= 1, "kitsune.", op, ": dropout probability p must be in [0, 1], got ", p);
}
// A forward's dropout: the effective p (0 outside training) and, when something is
// dropped, a fresh (seed, offset) from the device's generator ({0, 0} otherwise).
struct DropoutDraw { double p; std::pair<uint64_t, uint64_t> seed; };
DropoutDraw dropout_draw(const Tensor& x, double p, bool training, const char* op) {
  check_p(p, op);
  const double pe = training ? p : 0.0;
  return {pe, pe > 0 ? dropout_seed(x, op) : std::pair<uint64_t, uint64_t>{0, 0}};
}
double keep_scale(double p) { return p < 1 ? 1.0 / (1.0 - p) : 0.0; }

// The keep mask (bool, n elements) on the CPU: the reference and the check of the
// GPU's. bits: random bits an element (kitsune/philox.h, dropout_bits).
Tensor keep_mask(std::pair<uint64_t, uint64_t> s, int64_t n, double p, int bits) {
  Tensor m = at::empty({n}, at::TensorOptions().dtype(at::kBool));
  bool* d = m.data_ptr<bool>();
  const uint64_t thr = kt_dropout_threshold(p, bits);
  const int per = kt_dropout_per_block(bits);
  uint32_t ks[2 * KT_PHILOX_ROUNDS];
  kt_philox_seed_keys(s.first, ks);
  for (int64_t b = 0; b * per < n; b++) {
    uint32_t w[4];
    kt_philox_block_ks(ks, s.second, (uint64_t)b, w);
    for (int j = 0; j < per && b * per + j < n; j++) d[b * per + j] = kt_dropout_keep(w, j, bits, thr);
  }
  return m;
}
// The rule (dropout.cu's kBits): 16 bits for 2-byte elements, else 32.
int dropout_bits(at::ScalarType dt) { return c10::elementSize(dt) == 2 ? 16 : 32; }
Tensor dropout_mask(const Tensor& rng, int64_t n, double p, at::ScalarType dtype) {
  check_p(p, "dropout_mask");
  TORCH_CHECK(n >= 0, "kitsune.dropout_mask: n must be >= 0, got ", n);
  TORCH_CHECK(at::isFloatingType(dtype), "kitsune.dropout_mask: dtype must be the dropped tensor's floating dtype, got ",
              dtype);
  return keep_mask(rng_values(rng, "dropout_mask"), n, p, dropout_bits(dtype));
}
// mask * scale in the opmath dtype, shaped like x (x's dtype picks the mask's bits)
Tensor scaled_mask(std::pair<uint64_t, uint64_t> s, const Tensor& x, double p) {
  return keep_mask(s, x.numel(), p, dropout_bits(x.scalar_type())).view(x.sizes()).to(opmath(x)) * keep_scale(p);
}

std::tuple<Tensor, Tensor> gelu_dropout_cuda(const Tensor& x, double p, bool training, c10::string_view approximate) {
  int ap = approx_code(approximate, "gelu_dropout");
  auto [pe, s] = dropout_draw(x, p, training, "gelu_dropout");
  Tensor xc = x.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor out = at::empty_like(xc);
  check_launch(kt_gelu_dropout(dtype_of(x, "gelu_dropout"), xc.data_ptr(), out.data_ptr(), xc.numel(), pe, s.first,
                               s.second, ap, stream_of(out)),
               "gelu_dropout");
  return {out, rng_tensor(s)};
}
std::tuple<Tensor, Tensor> gelu_dropout_cpu(const Tensor& x, double p, bool training, c10::string_view approximate) {
  approx_code(approximate, "gelu_dropout");
  auto [pe, s] = dropout_draw(x, p, training, "gelu_dropout");
  Tensor out = at::gelu(x.to(opmath(x)), approximate) * scaled_mask(s, x, pe);
  return {out.to(x.scalar_type()), rng_tensor(s)};
}
Tensor gelu_dropout_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& rng, double p,
                                  c10::string_view approximate) {
  check_p(p, "gelu_dropout_backward");
  check_same(grad, x, "gelu_dropout_backward", "grad", "x");
  int ap = approx_code(approximate, "gelu_dropout_backward");
  auto s = rng_values(rng, "gelu_dropout_backward");
  Tensor gc = grad.expand(x.sizes()).contiguous(), xc = x.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor gx = at::empty_like(xc);
  check_launch(kt_gelu_dropout_backward(dtype_of(x, "gelu_dropout_backward"), gc.data_ptr(), xc.data_ptr(),
                                        gx.data_ptr(), xc.numel(), p, s.first, s.second, ap, stream_of(gx)),
               "gelu_dropout_backward");
  return gx;
}
Tensor gelu_dropout_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& rng, double p,
                                 c10::string_view approximate) {
  check_p(p, "gelu_dropout_backward");
  approx_code(approximate, "gelu_dropout_backward");
  auto s = rng_values(rng, "gelu_dropout_backward");
  Tensor g = grad.to(opmath(x)).expand(x.sizes()) * scaled_mask(s, x, p);
  return at::gelu_backward(g, x.to(opmath(x)), approximate).to(x.scalar_type());
}

void check_bias_residual(const Tensor& x, const Tensor& bias, const Tensor& residual, const char* op) {
  check_bias(x, bias, op);
  check_same(x, residual, op, "x", "residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "kitsune.", op, ": residual must have x's shape ", x.sizes(), "; got ",
              residual.sizes());
}
std::tuple<Tensor, Tensor> bias_dropout_add_cuda(const Tensor& x, const Tensor& bias, const Tensor& residual, double p,
                                                 bool training) {
  check_bias_residual(x, bias, residual, "bias_dropout_add");
  auto [pe, s] = dropout_draw(x, p, training, "bias_dropout_add");
  Tensor xc = x.contiguous(), bc = bias.contiguous(), rc = residual.contiguous();
  c10::cuda::CUDAGuard g(x.device());
  Tensor out = at::empty_like(xc);
  check_launch(kt_bias_dropout_add(dtype_of(x, "bias_dropout_add"), xc.data_ptr(), bc.data_ptr(), rc.data_ptr(),
                                   out.data_ptr(), xc.numel(), bc.numel(), pe, s.first, s.second, stream_of(out)),
               "bias_dropout_add");
  return {out, rng_tensor(s)};
}
std::tuple<Tensor, Tensor> bias_dropout_add_cpu(const Tensor& x, const Tensor& bias, const Tensor& residual, double p,
                                                bool training) {
  check_bias_residual(x, bias, residual, "bias_dropout_add");
  auto [pe, s] = dropout_draw(x, p, training, "bias_dropout_add");
  auto om = opmath(x);
  Tensor out = residual.to(om) + (x.to(om) + bias.to(om)) * scaled_mask(s, x, pe);
  return {out.to(x.scalar_type()), rng_tensor(s)};
}
Tensor dropout_backward_cuda(const Tensor& grad, const Tensor& rng, double p) {
  check_p(p, "dropout_backward");
  auto s = rng_values(rng, "dropout_backward");
  Tensor gc = grad.contiguous();
  c10::cuda::CUDAGuard g(grad.device());
  Tensor gx = at::empty_like(gc);
  check_launch(kt_dropout_backward(dtype_of(grad, "dropout_backward"), gc.data_ptr(), gx.data_ptr(), gc.numel(), p,
                                   s.first, s.second, stream_of(gx)),
               "dropout_backward");
  return gx;
}
Tensor dropout_backward_cpu(const Tensor& grad, const Tensor& rng, double p) {
  check_p(p, "dropout_backward");
  auto s = rng_values(rng, "dropout_backward");
  return (grad.to(opmath(grad)) * scaled_mask(s, grad, p)).to(grad.scalar_type());
}

// ---- fused optimizer steps: adam_, sgd_ (fusion/kernels/optim.cu) ----
// In place over lists of parameters, gradients and states, all of one device and
// dtype (kitsune.optim groups them), each dense in memory: a parameter contiguous, or
// dense in another layout (a channels-last convolution weight) with its gradient and
// states in the same strides, so that element i in memory is the same element of
// all of them. CUDA: the multi-tensor kernel; CPU:
// the same per-element code (kitsune/optim_math.h), in double for fp64.
// A registered op, called through the dispatcher.
template <typename Sig> c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
// A parameter the flat kernels can take: contiguous, or dense in another layout.
bool dense(const Tensor& p) { return p.is_non_overlapping_and_dense(); }
// t lies in memory as p does: both contiguous (any shapes of one numel), or one shape
// and one set of strides, dense.
bool laid_out_as(const Tensor& t, const Tensor& p) {
  if (t.is_contiguous() && p.is_contiguous()) return t.numel() == p.numel();
  return t.sizes() == p.sizes() && t.strides() == p.strides() && dense(p);
}
// list[i] of an optimizer's lists must match params[i]: device, dtype, size, layout.
void check_entry(const char* op, const char* name, size_t i, const Tensor& t, const Tensor& p) {
  TORCH_CHECK(t.device() == p.device() && t.scalar_type() == p.scalar_type() && laid_out_as(t, p), "kitsune.", op, ": ",
              name, "[", i, "] must be a ", p.scalar_type(), " tensor on ", p.device(), " laid out as params[", i,
              "] (", p.sizes(), ", strides ", p.strides(), "); got ", t.scalar_type(), " ", t.sizes(), ", strides ",
              t.strides(), " on ", t.device());
}
void check_sizes(const char* op, at::TensorList params, std::initializer_list<std::pair<const char*, at::TensorList>> rest) {
  for (const auto& [name, list] : rest)
    TORCH_CHECK(list.size() == params.size(), "kitsune.", op, ": ", name, " has ", list.size(), " tensors but params has ",
                params.size());
}
void check_lists(const char* op, at::TensorList params, std::initializer_list<std::pair<const char*, at::TensorList>> rest) {
  check_sizes(op, params, rest);
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor& p = params[i];
    TORCH_CHECK(dense(p), "kitsune.", op, ": params[", i, "] is not dense in memory (strides ", p.strides(), ")");
    TORCH_CHECK(p.device() == params[0].device() && p.scalar_type() == params[0].scalar_type(), "kitsune.", op,
                ": params[", i, "] is ", p.scalar_type(), " on ", p.device(), " but params[0] is ",
                params[0].scalar_type(), " on ", params[0].device(), " (one dtype and device a call)");
    for (const auto& [name, list] : rest) check_entry(op, name, i, list[i], p);
  }
}
kt::AdamArgs adam_args(double lr, double beta1, double beta2, double eps, double wd, bool decoupled, double step,
                       const char* op) {
  TORCH_CHECK(step >= 1, "kitsune.", op, ": step must be >= 1 (the count after this update), got ", step);
  TORCH_CHECK(lr >= 0 && eps >= 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "kitsune.", op,
              ": need lr >= 0, eps >= 0 and betas in [0, 1); got lr ", lr, " eps ", eps, " betas (", beta1, ", ", beta2,
              ")");
  kt::AdamArgs a{lr, beta1, beta2, eps, wd, 0, 0, decoupled ? 1 : 0, nullptr, nullptr};
  return kt::adam_coefficients(a, lr, step);
}
template <typename S, typename F> void adam_cpu_one(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                                                    const kt::AdamArgs& a) {
  S *pp = p.data_ptr<S>(), *mp = m.data_ptr<S>(), *vp = v.data_ptr<S>();
  const S* gp = g.data_ptr<S>();
  for (int64_t i = 0; i < p.numel(); i++) {
    F w = static_cast<F>(pp[i]), mm = static_cast<F>(mp[i]), vv = static_cast<F>(vp[i]);
    kt::adam_elem<F>(w, mm, vv, static_cast<F>(gp[i]), a);
    pp[i] = static_cast<S>(w), mp[i] = static_cast<S>(mm), vp[i] = static_cast<S>(vv);
  }
}
template <typename S, typename F> void sgd_cpu_one(const Tensor& p, const Tensor& g, const Tensor* buf,
                                                   const kt::SgdArgs& a) {
  S* pp = p.data_ptr<S>();
  S* bp = buf ? buf->data_ptr<S>() : nullptr;
  const S* gp = g.data_ptr<S>();
  for (int64_t i = 0; i < p.numel(); i++) {
    F w = static_cast<F>(pp[i]), b = bp ? static_cast<F>(bp[i]) : F(0);
    kt::sgd_elem<F>(w, b, static_cast<F>(gp[i]), a);
    pp[i] = static_cast<S>(w);
    if (bp) bp[i] = static_cast<S>(b);
  }
}
#define KT_OPT_CPU_DISPATCH(dt, FN, ...)                                                  \
  switch (dt) {                                                                           \
    case at::kDouble: FN<double, double>(__VA_ARGS__); break;                             \
    case at::kFloat: FN<float, float>(__VA_ARGS__); break;                                \
    case at::kHalf: FN<c10::Half, float>(__VA_ARGS__); break;                             \
    case at::kBFloat16: FN<c10::BFloat16, float>(__VA_ARGS__); break;                     \
    default: TORCH_CHECK(false, "kitsune: dtype ", dt, " is not supported by the fused optimizer"); \
  }

// The CUDA launches of adam_ / sgd_ and their capturable forms (lists checked).
void launch_adam(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, const kt::AdamArgs& a) {
  std::vector<void*> pp, gp, mp, vp;
  std::vector<int64_t> n;
  for (size_t i = 0; i < params.size(); i++) {
    pp.push_back(params[i].data_ptr()), gp.push_back(grads[i].data_ptr()), mp.push_back(m[i].data_ptr());
    vp.push_back(v[i].data_ptr()), n.push_back(params[i].numel());
  }
  c10::cuda::CUDAGuard g(params[0].device());
  check_launch(kt_adam_multi(dtype_of(params[0], "adam_"), (int)pp.size(), pp.data(), gp.data(), mp.data(), vp.data(),
                             n.data(), &a, stream_of(params[0])),
               "adam_");
}
void launch_sgd(at::TensorList params, at::TensorList grads, at::TensorList bufs, const kt::SgdArgs& a) {
  std::vector<void*> pp, gp, bp;
  std::vector<int64_t> n;
  for (size_t i = 0; i < params.size(); i++) {
    pp.push_back(params[i].data_ptr()), gp.push_back(grads[i].data_ptr()), n.push_back(params[i].numel());
    bp.push_back(a.momentum != 0 ? bufs[i].data_ptr() : nullptr);
  }
  c10::cuda::CUDAGuard g(params[0].device());
  check_launch(kt_sgd_multi(dtype_of(params[0], "sgd_"), (int)pp.size(), pp.data(), gp.data(), bp.data(), n.data(), &a,
                            stream_of(params[0])),
               "sgd_");
}
void adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, double lr, double beta1,
              double beta2, double eps, double wd, bool decoupled, double step) {
  check_lists("adam_", params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}});
  auto a = adam_args(lr, beta1, beta2, eps, wd, decoupled, step, "adam_");
  for (size_t i = 0; i < params.size(); i++)
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), adam_cpu_one, params[i], grads[i], m[i], v[i], a);
}
void adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, double lr, double beta1,
               double beta2, double eps, double wd, bool decoupled, double step) {
  check_lists("adam_", params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}});
  auto a = adam_args(lr, beta1, beta2, eps, wd, decoupled, step, "adam_");
  if (!params.empty()) launch_adam(params, grads, m, v, a);
}
// Whether every parameter is dense and its gradient laid out as it is (what adam_ /
// sgd_ take); KitsuneOptimizer asks before it changes anything, else it falls back to
// torch.optim.
bool optim_fusable(at::TensorList params, at::TensorList grads) {
  TORCH_CHECK(params.size() == grads.size(), "kitsune.optim_fusable: ", params.size(), " params but ", grads.size(),
              " grads");
  for (size_t i = 0; i < params.size(); i++)
    if (params[i].is_sparse() || grads[i].is_sparse() || !dense(params[i]) || !laid_out_as(grads[i], params[i]))
      return false;
  return true;
}
// Adds 1 to a torch.optim "step" state (a one-element tensor) and returns the new
// count: in place through the pointer for a CPU float or double (torch.optim's
// default), else with add_ and a read (a device scalar: one sync).
double bump_step(const Tensor& s) {
  if (s.is_cpu() && s.scalar_type() == at::kFloat) return *s.data_ptr<float>() += 1.f;
  if (s.is_cpu() && s.scalar_type() == at::kDouble) return *s.data_ptr<double>() += 1.0;
  s.add_(1);
  return s.item<double>();
}
// One torch.optim Adam / AdamW step over a parameter group: each state_steps entry is
// incremented (as torch.optim's foreach path does), then one adam_ call per (device,
// dtype, step count), in first-seen order. The Python loop this replaces (a float()
// of every step tensor, a foreach add over CPU scalars, the bucketing) took about
// 0.6 ms of host time for GPT-2's 148 tensors.
void adam_step(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v,
               at::TensorList steps, double lr, double beta1, double beta2, double eps, double wd, bool decoupled) {
  // everything adam_ checks (but one dtype a call: the buckets make that so), checked
  // before any step count is changed
  const char* op = "adam_step_";
  check_sizes(op, params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}, {"state_steps", steps}});
  adam_args(lr, beta1, beta2, eps, wd, decoupled, 1.0, op);
  for (size_t i = 0; i < params.size(); i++) {
    TORCH_CHECK(steps[i].numel() == 1, "kitsune.adam_step_: state_steps[", i, "] must have one element; got ",
                steps[i].sizes());
    TORCH_CHECK(dense(params[i]), "kitsune.adam_step_: params[", i, "] is not dense in memory (strides ",
                params[i].strides(), ")");
    check_entry(op, "grads", i, grads[i], params[i]);
    check_entry(op, "exp_avgs", i, m[i], params[i]);
    check_entry(op, "exp_avg_sqs", i, v[i], params[i]);
  }
  static auto adam = op_handle<void(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double, double,
                                    double, double, double, bool, double)>("kitsune::adam_");
  struct Bucket {
    c10::Device dev;
    at::ScalarType dt;
    double step;
    std::vector<Tensor> p, g, m, v;
  };
  std::vector<Bucket> buckets;
  for (size_t i = 0; i < params.size(); i++) {
    const double step = bump_step(steps[i]);
    const Tensor& p = params[i];
    auto b = std::find_if(buckets.begin(), buckets.end(), [&](const Bucket& b) {
      return b.dev == p.device() && b.dt == p.scalar_type() && b.step == step;
    });
    if (b == buckets.end()) b = buckets.insert(buckets.end(), Bucket{p.device(), p.scalar_type(), step, {}, {}, {}, {}});
    b->p.push_back(p), b->g.push_back(grads[i]), b->m.push_back(m[i]), b->v.push_back(v[i]);
  }
  for (const Bucket& b : buckets) adam.call(b.p, b.g, b.m, b.v, lr, beta1, beta2, eps, wd, decoupled, b.step);
}
kt::SgdArgs sgd_args(double lr, double momentum, double dampening, double wd, bool nesterov, bool first) {
  TORCH_CHECK(lr >= 0 && momentum >= 0, "kitsune.sgd_: need lr >= 0 and momentum >= 0; got lr ", lr, " momentum ",
              momentum);
  TORCH_CHECK(!nesterov || (momentum > 0 && dampening == 0), "kitsune.sgd_: nesterov needs momentum > 0 and dampening 0");
  return {lr, momentum, dampening, wd, nesterov ? 1 : 0, first ? 1 : 0, nullptr, nullptr};
}
void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs, double lr, double momentum,
             double dampening, double wd, bool nesterov, bool first) {
  auto a = sgd_args(lr, momentum, dampening, wd, nesterov, first);
  if (momentum != 0) check_lists("sgd_", params, {{"grads", grads}, {"momentum_buffers", bufs}});
  else check_lists("sgd_", params, {{"grads", grads}});
  for (size_t i = 0; i < params.size(); i++) {
    const Tensor* b = momentum != 0 ? &bufs[i] : nullptr;
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), sgd_cpu_one, params[i], grads[i], b, a);
  }
}
void sgd_cuda(at::TensorList params, at::TensorList grads, at::TensorList bufs, double lr, double momentum,
              double dampening, double wd, bool nesterov, bool first) {
  auto a = sgd_args(lr, momentum, dampening, wd, nesterov, first);
  if (momentum != 0) check_lists("sgd_", params, {{"grads", grads}, {"momentum_buffers", bufs}});
  else check_lists("sgd_", params, {{"grads", grads}});
  if (!params.empty()) launch_sgd(params, grads, bufs, a);
}

// adam_capturable_ / sgd_capturable_: the same updates with the learning rate and
// (Adam) step count in `hyper`, a float64 tensor on the parameters' device ({lr, step}
// for Adam, {lr} for SGD), read when the update runs, so a CUDA graph that captured the
// call follows an LR scheduler and counts its steps on replay. Adam adds 1 to hyper[1]
// first (on the stream, captured with the rest) unless count_step is false: a step
// that updates a group's parameters in several calls (several dtypes, or buckets
// during the backward) counts in the first only, and the others must be ordered after
// it. SGD's momentum buffers must exist. found_inf (optional; torch.amp's inf check, a
// one-element float32 tensor on the parameters' device, 0 or 1) makes the update
// conditional, read when it runs: where it is not 0 nothing changes, and Adam's step
// count moves on by 1 - found_inf, as GradScaler skips the whole optimizer step.
const float* skip_flag(const std::optional<Tensor>& found_inf, const Tensor& p0, const char* op) {
  if (!found_inf.has_value() || !found_inf->defined()) return nullptr;
  const Tensor& f = *found_inf;
  TORCH_CHECK(f.scalar_type() == at::kFloat && f.numel() == 1 && f.device() == p0.device(), "kitsune.", op,
              ": found_inf must be a one-element float32 tensor on ", p0.device(), "; got ", f.scalar_type(), " ",
              f.sizes(), " on ", f.device());
  return f.data_ptr<float>();
}
bool skipped_now(const float* skip) { return skip && *skip != 0.f; }   // the CPU path: read at once
void check_hyper(const Tensor& hyper, const Tensor& p0, int64_t n, const char* op) {
  TORCH_CHECK(hyper.scalar_type() == at::kDouble && hyper.dim() == 1 && hyper.numel() == n && hyper.is_contiguous() &&
                  hyper.device() == p0.device(),
              "kitsune.", op, ": hyper must be a contiguous float64 tensor of ", n, " elements on ", p0.device(),
              "; got ", hyper.scalar_type(), " ", hyper.sizes(), " on ", hyper.device());
}
kt::AdamArgs adam_capturable_args(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v,
                                  Tensor& hyper, double beta1, double beta2, double eps, double wd, bool decoupled,
                                  bool count_step, const std::optional<Tensor>& found_inf) {
  const char* op = "adam_capturable_";
  check_lists(op, params, {{"grads", grads}, {"exp_avgs", m}, {"exp_avg_sqs", v}});
  kt::AdamArgs a = adam_args(0.0, beta1, beta2, eps, wd, decoupled, 1.0, op);
  if (params.empty()) return a;
  check_hyper(hyper, params[0], 2, op);
  a.skip = skip_flag(found_inf, params[0], op);
  if (count_step) {
    Tensor count = hyper.narrow(0, 1, 1);
    if (a.skip) count.sub_(*found_inf).add_(1);   // exact: found_inf is 0 or 1, the count an integer
    else count.add_(1);
  }
  a.dev = hyper.data_ptr<double>();
  return a;
}
void adam_capturable_cpu(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v, Tensor hyper,
                         double beta1, double beta2, double eps, double wd, bool decoupled, bool count_step,
                         const std::optional<Tensor>& found_inf) {
  const kt::AdamArgs a = kt::resolve(
      adam_capturable_args(params, grads, m, v, hyper, beta1, beta2, eps, wd, decoupled, count_step, found_inf));
  if (skipped_now(a.skip)) return;
  for (size_t i = 0; i < params.size(); i++)
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), adam_cpu_one, params[i], grads[i], m[i], v[i], a);
}
void adam_capturable_cuda(at::TensorList params, at::TensorList grads, at::TensorList m, at::TensorList v,
                          Tensor hyper, double beta1, double beta2, double eps, double wd, bool decoupled,
                          bool count_step, const std::optional<Tensor>& found_inf) {
  const kt::AdamArgs a =
      adam_capturable_args(params, grads, m, v, hyper, beta1, beta2, eps, wd, decoupled, count_step, found_inf);
  if (params.empty()) return;
  launch_adam(params, grads, m, v, a);
}
kt::SgdArgs sgd_capturable_args(at::TensorList params, at::TensorList grads, at::TensorList bufs, const Tensor& hyper,
                                double momentum, double dampening, double wd, bool nesterov,
                                const std::optional<Tensor>& found_inf) {
  const char* op = "sgd_capturable_";
  kt::SgdArgs a = sgd_args(0.0, momentum, dampening, wd, nesterov, false);
  if (momentum != 0) check_lists(op, params, {{"grads", grads}, {"momentum_buffers", bufs}});
  else check_lists(op, params, {{"grads", grads}});
  if (!params.empty()) {
    check_hyper(hyper, params[0], 1, op);
    a.dev = hyper.data_ptr<double>();
    a.skip = skip_flag(found_inf, params[0], op);
  }
  return a;
}
void sgd_capturable_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs, Tensor hyper,
                        double momentum, double dampening, double wd, bool nesterov,
                        const std::optional<Tensor>& found_inf) {
  const kt::SgdArgs a =
      kt::resolve(sgd_capturable_args(params, grads, bufs, hyper, momentum, dampening, wd, nesterov, found_inf));
  if (skipped_now(a.skip)) return;
  for (size_t i = 0; i < params.size(); i++)
    KT_OPT_CPU_DISPATCH(params[i].scalar_type(), sgd_cpu_one, params[i], grads[i], momentum != 0 ? &bufs[i] : nullptr, a);
}
void sgd_capturable_cuda(at::TensorList params, at::TensorList grads, at::TensorList bufs, Tensor hyper,
                         double momentum, double dampening, double wd, bool nesterov,
                         const std::optional<Tensor>& found_inf) {
  const kt::SgdArgs a = sgd_capturable_args(params, grads, bufs, hyper, momentum, dampening, wd, nesterov, found_inf);
  if (!params.empty()) launch_sgd(params, grads, bufs, a);
}

// ---- batch_norm_relu (fusion/kernels/batch_norm.cu) ----
// relu(F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum,
// eps)) over dim 1; returns (out, save_mean, save_invstd) and updates the running
// stats in place in training, as native_batch_norm does.
struct BnShape { int64_t N, C, S; };
BnShape bn_shape(const Tensor& x, std::initializer_list<std::pair<const char*, const OptTensor*>> per_channel,
                 const char* op) {
  TORCH_CHECK(x.dim() >= 2, "kitsune.", op, ": x must be (N, C, ...); got shape ", x.sizes());
  const int64_t N = x.size(0), C = x.size(1);
  for (const auto& [name, t] : per_channel)
    if (*t && (*t)->defined()) {
      TORCH_CHECK((*t)->dim() == 1 && (*t)->size(0) == C && (*t)->device() == x.device(), "kitsune.", op, ": ", name,
                  " must have C = ", C, " elements on ", x.device(), "; got ", (*t)->sizes(), " on ", (*t)->device());
    }
  return {N, C, N && C ? x.numel() / (N * C) : 0};
}
c10::DimVector bn_bcast(const Tensor& x) {   // (1, C, 1, ...)
  c10::DimVector s(x.dim(), 1);
  s[1] = x.size(1);
  return s;
}
std::vector<int64_t> bn_dims(const Tensor& x) {
  std::vector<int64_t> d{0};
  for (int64_t i = 2; i < x.dim(); i++) d.push_back(i);
  return d;
}
// The forward's checks, on both devices; returns the (N, C, S) view.
BnShape bn_forward_checks(const Tensor& x, const OptTensor& w, const OptTensor& b, const OptTensor& rm,
                          const OptTensor& rv, bool training, double eps, const char* op) {
  auto s = bn_shape(x, {{"weight", &w}, {"bias", &b}, {"running_mean", &rm}, {"running_var", &rv}}, op);
  TORCH_CHECK(!training || s.N * s.S > 1, "kitsune.", op, ": expected more than 1 value per channel when training, got ",
              s.N * s.S);
  TORCH_CHECK(training || (rm && rm->defined() && rv && rv->defined()), "kitsune.", op,
              ": eval mode needs running_mean and running_var");
  TORCH_CHECK(eps >= 0, "kitsune.", op, ": eps must be >= 0, got ", eps);
  for (const OptTensor* p : {&w, &b})
    if (*p && (*p)->defined()) check_same(x, **p, op, "x", p == &w ? "weight" : "bias");
  return s;
}
// A channels-last (NHWC) batch is run as it lies, as (N * H * W, C, 1) rows: no copy,
// and the output is channels-last too (convolutions then need no transposes).
bool bn_channels_last(const Tensor& x) {
  return x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}
BnShape bn_kernel_shape(const Tensor& x, BnShape s) {
  return bn_channels_last(x) ? BnShape{s.N * s.S, s.C, 1} : s;
}
// batch_norm_add_relu: relu(F.batch_norm(x, ...) + residual), residual x's shape and
// dtype (a ResNet block's end); the backward also returns the residual's gradient.
void bn_residual_checks(const Tensor& x, const Tensor& r, const char* op) {
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == x.scalar_type() && r.device() == x.device(), "kitsune.", op,
              ": residual must have x's shape, dtype and device ", x.sizes(), " ", x.scalar_type(), " ", x.device(),
              "; got ", r.sizes(), " ", r.scalar_type(), " ", r.device());
}
std::tuple<Tensor, Tensor, Tensor> bn_relu_cuda(const Tensor& x, const Tensor* res, const OptTensor& w,
                                                const OptTensor& b, const OptTensor& rm, const OptTensor& rv,
                                                bool training, double momentum, double eps, const char* op) {
  auto s = bn_kernel_shape(x, bn_forward_checks(x, w, b, rm, rv, training, eps, op));
  if (res) bn_residual_checks(x, *res, op);
  kt_dtype dt = dtype_of(x, op);
  c10::cuda::CUDAGuard g(x.device());
  Tensor xc = bn_channels_last(x) ? x : x.contiguous(), out = at::empty_like(xc);
  Tensor rc = res ? res->contiguous(bn_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous)
                  : Tensor();
  auto fopt = x.options().dtype(at::kFloat);
  Tensor wc = w && w->defined() ? w->contiguous() : Tensor(), bc = b && b->defined() ? b->contiguous() : Tensor();
  Tensor mean, invstd, rmf, rvf, ws;
  if (training) {
    mean = at::empty({s.C}, fopt), invstd = at::empty({s.C}, fopt);
    ws = at::empty({kt_batch_norm_workspace(s.N, s.C, s.S)}, fopt);
    if (rm && rm->defined()) rmf = rm->scalar_type() == at::kFloat && rm->is_contiguous() ? *rm : rm->to(at::kFloat).contiguous();
    if (rv && rv->defined()) rvf = rv->scalar_type() == at::kFloat && rv->is_contiguous() ? *rv : rv->to(at::kFloat).contiguous();
  } else {
    mean = rm->to(at::kFloat).contiguous();
    invstd = (rv->to(at::kFloat) + eps).rsqrt().contiguous();
  }
  if (s.N * s.C * s.S > 0)
    check_launch(kt_batch_norm(dt, xc.data_ptr(), rc.defined() ? rc.data_ptr() : nullptr, out.data_ptr(),
                               wc.defined() ? wc.data_ptr() : nullptr,
                               bc.defined() ? bc.data_ptr() : nullptr, s.N, s.C, s.S, training, (float)momentum,
                               (float)eps, mean.data_ptr<float>(), invstd.data_ptr<float>(),
                               rmf.defined() ? rmf.data_ptr<float>() : nullptr,
                               rvf.defined() ? rvf.data_ptr<float>() : nullptr,
                               ws.defined() ? ws.data_ptr<float>() : nullptr, 1, stream_of(out)),
                 op);
  if (rmf.defined() && !rmf.is_same(*rm)) rm->copy_(rmf);
  if (rvf.defined() && !rvf.is_same(*rv)) rv->copy_(rvf);
  return {out, mean, invstd};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_cuda(const Tensor& x, const OptTensor& w, const OptTensor& b,
                                                        const OptTensor& rm, const OptTensor& rv, bool training,
                                                        double momentum, double eps) {
  return bn_relu_cuda(x, nullptr, w, b, rm, rv, training, momentum, eps, "batch_norm_relu");
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_add_relu_cuda(const Tensor& x, const Tensor& res, const OptTensor& w,
                                                            const OptTensor& b, const OptTensor& rm,
                                                            const OptTensor& rv, bool training, double momentum,
                                                            double eps) {
  return bn_relu_cuda(x, &res, w, b, rm, rv, training, momentum, eps, "batch_norm_add_relu");
}
std::tuple<Tensor, Tensor, Tensor> bn_relu_cpu(const Tensor& x, const Tensor* res, const OptTensor& w,
                                               const OptTensor& b, const OptTensor& rm, const OptTensor& rv,
                                               bool training, double momentum, double eps, const char* op) {
  auto s = bn_forward_checks(x, w, b, rm, rv, training, eps, op);
  if (res) bn_residual_checks(x, *res, op);
  auto om = opmath(x);
  Tensor xf = x.to(om), mean, invstd;
  auto dims = bn_dims(x);
  auto bc = bn_bcast(x);
  if (training) {
    mean = xf.mean(dims);
    Tensor var = (xf - mean.view(bc)).pow(2).mean(dims);
    invstd = (var + eps).rsqrt();
    const double M = (double)(s.N * s.S);
    at::NoGradGuard ng;
    if (rm && rm->defined()) rm->copy_(*rm * (1 - momentum) + mean * momentum);
    if (rv && rv->defined()) rv->copy_(*rv * (1 - momentum) + var * (M / (M - 1)) * momentum);
  } else {
    mean = rm->to(om), invstd = (rv->to(om) + eps).rsqrt();
  }
  Tensor y = (xf - mean.view(bc)) * invstd.view(bc);
  if (w && w->defined()) y = y * w->to(om).view(bc);
  if (b && b->defined()) y = y + b->to(om).view(bc);
  if (res) y = y + res->to(om);
  return {at::relu(y).to(x.scalar_type()), mean, invstd};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_cpu(const Tensor& x, const OptTensor& w, const OptTensor& b,
                                                       const OptTensor& rm, const OptTensor& rv, bool training,
                                                       double momentum, double eps) {
  return bn_relu_cpu(x, nullptr, w, b, rm, rv, training, momentum, eps, "batch_norm_relu");
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_add_relu_cpu(const Tensor& x, const Tensor& res, const OptTensor& w,
                                                           const OptTensor& b, const OptTensor& rm, const OptTensor& rv,
                                                           bool training, double momentum, double eps) {
  return bn_relu_cpu(x, &res, w, b, rm, rv, training, momentum, eps, "batch_norm_add_relu");
}
// (gx, gres (undefined unless asked for), gw, gb)
using BnBwd = std::tuple<Tensor, Tensor, Tensor, Tensor>;
BnBwd bn_relu_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                            const Tensor& mean, const Tensor& invstd, bool training, bool residual, const char* op) {
  auto s = bn_kernel_shape(x, bn_shape(x, {{"weight", &w}}, op));
  check_same(grad, x, op, "grad", "x");
  c10::cuda::CUDAGuard g(x.device());
  const auto fmt = bn_channels_last(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  Tensor gc = grad.contiguous(fmt), xc = x.contiguous(fmt), oc = out.contiguous(fmt), gx = at::empty_like(xc);
  Tensor gr = residual ? at::empty_like(xc) : Tensor();
  auto fopt = x.options().dtype(at::kFloat);
  Tensor sum_g = at::empty({s.C}, fopt), sum_gx = at::empty({s.C}, fopt);   // every channel written
  Tensor ws = at::empty({std::max<int64_t>(1, kt_batch_norm_workspace(s.N, s.C, s.S))}, fopt);
  Tensor wc = w && w->defined() ? w->contiguous() : Tensor();
  Tensor mf = mean.to(at::kFloat).contiguous(), isf = invstd.to(at::kFloat).contiguous();
  if (s.N * s.C * s.S > 0)
    check_launch(kt_batch_norm_backward(dtype_of(x, op), gc.data_ptr(), xc.data_ptr(), oc.data_ptr(), gx.data_ptr(),
                                        gr.defined() ? gr.data_ptr() : nullptr,
                                        wc.defined() ? wc.data_ptr() : nullptr, s.N, s.C, s.S, training,
                                        mf.data_ptr<float>(), isf.data_ptr<float>(), sum_g.data_ptr<float>(),
                                        sum_gx.data_ptr<float>(), ws.data_ptr<float>(), 1, stream_of(gx)),
                 op);
  Tensor gw = w && w->defined() ? sum_gx.to(w->scalar_type()) : at::empty({0}, x.options());
  Tensor gb = sum_g.to(x.scalar_type());
  return {gx, gr, gw, gb};
}
BnBwd bn_relu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                           const Tensor& mean, const Tensor& invstd, bool training, bool residual, const char* op) {
  auto s = bn_shape(x, {{"weight", &w}}, op);
  auto om = opmath(x);
  auto bc = bn_bcast(x);
  auto dims = bn_dims(x);
  Tensor gp = grad.to(om) * (out > 0);
  Tensor m = mean.to(om).view(bc), is = invstd.to(om).view(bc);
  Tensor xh = (x.to(om) - m) * is;
  Tensor sum_g = gp.sum(dims), sum_gx = (gp * xh).sum(dims);
  Tensor scale = w && w->defined() ? w->to(om).view(bc) * is : is;
  const double M = (double)(s.N * s.S);
  Tensor gx = training ? scale * (gp - sum_g.view(bc) / M - xh * sum_gx.view(bc) / M) : scale * gp;
  Tensor gw = w && w->defined() ? sum_gx.to(w->scalar_type()) : at::empty({0}, x.options());
  return {gx.to(x.scalar_type()), residual ? gp.to(x.scalar_type()) : Tensor(), gw, sum_g.to(x.scalar_type())};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_backward_cuda(const Tensor& grad, const Tensor& x,
                                                                 const Tensor& out, const OptTensor& w,
                                                                 const Tensor& mean, const Tensor& invstd,
                                                                 bool training) {
  auto [gx, gr, gw, gb] =
      bn_relu_backward_cuda(grad, x, out, w, mean, invstd, training, false, "batch_norm_relu_backward");
  return {gx, gw, gb};
}
std::tuple<Tensor, Tensor, Tensor> batch_norm_relu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& out,
                                                                const OptTensor& w, const Tensor& mean,
                                                                const Tensor& invstd, bool training) {
  auto [gx, gr, gw, gb] =
      bn_relu_backward_cpu(grad, x, out, w, mean, invstd, training, false, "batch_norm_relu_backward");
  return {gx, gw, gb};
}
BnBwd batch_norm_add_relu_backward_cuda(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                                        const Tensor& mean, const Tensor& invstd, bool training) {
  return bn_relu_backward_cuda(grad, x, out, w, mean, invstd, training, true, "batch_norm_add_relu_backward");
}
BnBwd batch_norm_add_relu_backward_cpu(const Tensor& grad, const Tensor& x, const Tensor& out, const OptTensor& w,
                                       const Tensor& mean, const Tensor& invstd, bool training) {
  return bn_relu_backward_cpu(grad, x, out, w, mean, invstd, training, true, "batch_norm_add_relu_backward");
}

// ---- autograd in C++ for the ops a model calls once per layer ----
// torch.library.register_autograd runs the forward through Python (about 70 us of
// host time a call, measured on CPU against 20 us for F.rms_norm). A LLaMA-style step
// had 15.9 ms of kernels in a 24 ms step (bench/results/h100_profile_llama_kitsune_
// ed26073.log): the GPU waited, most likely on that host time. These Functions call the
// forward op below autograd and the *_backward op from backward, on the Autograd key.
// (The linear_cross_entropy op keeps its autograd in ops.py: kitsune.ops'
// linear_cross_entropy, an autograd.Function, forms the gradients in its forward.)
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

Tensor sum_to_shape(const Tensor& g, const Tensor& like) {
  return g.sizes() == like.sizes() ? g : at::sum_to(g, like.sizes());
}
// An absent weight or bias cannot be an undefined input of a custom Function: it is
// passed as a 0-element placeholder, with bit 0 (weight) / bit 1 (bias) of `present`
// saying which are real.
Tensor placeholder_if_absent(const OptTensor& t, const Tensor& like) {
  return t && t->defined() ? *t : at::empty({0}, like.options());
}
int64_t present_bits(const OptTensor& w, const OptTensor& b) {
  return (w && w->defined() ? 1 : 0) | (b && b->defined() ? 2 : 0);
}
OptTensor opt_if(const Tensor& t, int64_t present, int bit) { return present & bit ? OptTensor(t) : OptTensor(); }
Tensor grad_if(const Tensor& g, int64_t present, int bit) { return present & bit ? g : Tensor(); }

using BinarySig = Tensor(const Tensor&, const Tensor&);
using BinaryBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&);

// add_relu: backward from the output; both gradients are grad where out > 0.
struct AddReluFn : torch::autograd::Function<AddReluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b) {
    static auto op = op_handle<BinarySig>("kitsune::add_relu");
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      out = op.call(a, b);
    }
    ctx->saved_data["sa"] = a.sizes().vec();
    ctx->saved_data["sb"] = b.sizes().vec();
    ctx->save_for_backward({out});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto bwd = op_handle<BinarySig>("kitsune::add_relu_backward");
    Tensor g = bwd.call(go[0], ctx->get_saved_variables()[0]);
    auto to = [&](const char* k) {
      auto s = ctx->saved_data[k].toIntVector();
      return g.sizes() == c10::IntArrayRef(s) ? g : at::sum_to(g, s);
    };
    return {to("sa"), to("sb")};
  }
};

// mul_tanh (which 0), swiglu (which 1): backward op (grad, a, b) -> both gradients.
struct BinaryFn : torch::autograd::Function<BinaryFn> {
  static const char* name(int64_t which, bool backward) {
    static const char* n[2][2] = {{"kitsune::mul_tanh", "kitsune::mul_tanh_backward"},
                                  {"kitsune::swiglu", "kitsune::swiglu_backward"}};
    return n[which][backward];
  }
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b, int64_t which) {
    static auto ops = std::array{op_handle<BinarySig>(name(0, false)), op_handle<BinarySig>(name(1, false))};
    ctx->saved_data["which"] = which;
    ctx->save_for_backward({a, b});
    at::AutoDispatchBelowADInplaceOrView g;
    return ops[which].call(a, b);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto ops = std::array{op_handle<BinaryBwdSig>(name(0, true)), op_handle<BinaryBwdSig>(name(1, true))};
    auto s = ctx->get_saved_variables();
    auto [ga, gb] = ops[ctx->saved_data["which"].toInt()].call(go[0], s[0], s[1]);
    return {sum_to_shape(ga, s[0]), sum_to_shape(gb, s[1]), Tensor()};
  }
};

struct BiasGeluFn : torch::autograd::Function<BiasGeluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, std::string approximate) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::bias_gelu");
    ctx->saved_data["approximate"] = approximate;
    ctx->save_for_backward({x, bias});
    at::AutoDispatchBelowADInplaceOrView g;
    return op.call(x, bias, approximate);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                           c10::string_view)>("kitsune::bias_gelu_backward");
    auto s = ctx->get_saved_variables();
    auto [gx, gb] = op.call(go[0], s[0], s[1], ctx->saved_data["approximate"].toStringRef());
    return {gx, gb, Tensor()};
  }
};

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, double eps) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, double)>("kitsune::rms_norm");
    ctx->saved_data["eps"] = eps;
    ctx->save_for_backward({x, w});
    at::AutoDispatchBelowADInplaceOrView g;
    return op.call(x, w, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
        "kitsune::rms_norm_backward");
    auto s = ctx->get_saved_variables();
    auto [gx, gw] = op.call(go[0], s[0], s[1], ctx->saved_data["eps"].toDouble());
    return {gx, gw, Tensor()};
  }
};

using LnBwdTuple = std::tuple<Tensor, Tensor, Tensor>;

struct LayerNormReluFn : torch::autograd::Function<LayerNormReluFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::vector<int64_t> shape, const Tensor& w,
                        const Tensor& b, int64_t present, double eps) {
    static auto op = op_handle<Tensor(const Tensor&, c10::IntArrayRef, const OptTensor&, const OptTensor&, double)>(
        "kitsune::layer_norm_relu");
    ctx->saved_data["shape"] = shape;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["present"] = present;
    ctx->save_for_backward({x, w, b});
    at::AutoDispatchBelowADInplaceOrView g;
    return op.call(x, shape, opt_if(w, present, 1), opt_if(b, present, 2), eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<LnBwdTuple(const Tensor&, const Tensor&, c10::IntArrayRef, const OptTensor&,
                                          const OptTensor&, double)>("kitsune::layer_norm_relu_backward");
    auto s = ctx->get_saved_variables();
    auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t p = ctx->saved_data["present"].toInt();
    auto [gx, gw, gb] = op.call(go[0], s[0], shape, opt_if(s[1], p, 1), opt_if(s[2], p, 2),
                                ctx->saved_data["eps"].toDouble());
    return {gx, Tensor(), grad_if(gw, p, 1), grad_if(gb, p, 2), Tensor(), Tensor()};
  }
};

// add_layer_norm: (h, y) = (x + residual, layer_norm(h)); h is saved (it is an output).
struct AddLayerNormFn : torch::autograd::Function<AddLayerNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& w,
                               const Tensor& b, int64_t present, double eps) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                          const OptTensor&, double)>("kitsune::add_layer_norm");
    Tensor h, y;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      std::tie(h, y) = op.call(x, r, opt_if(w, present, 1), opt_if(b, present, 2), eps);
    }
    ctx->set_materialize_grads(false);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["present"] = present;
    ctx->save_for_backward({h, w, b});
    return {h, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<LnBwdTuple(const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                                          const OptTensor&, double)>("kitsune::add_layer_norm_backward");
    auto s = ctx->get_saved_variables();
    const Tensor& h = s[0];
    if (!go[1].defined() && !go[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    Tensor gy = go[1].defined() ? go[1] : at::zeros_like(h);
    const int64_t p = ctx->saved_data["present"].toInt();
    OptTensor gs = go[0].defined() ? OptTensor(go[0]) : OptTensor();
    auto [gh, gw, gb] = op.call(gy, gs, h, opt_if(s[1], p, 1), opt_if(s[2], p, 2), ctx->saved_data["eps"].toDouble());
    return {gh, gh, grad_if(gw, p, 1), grad_if(gb, p, 2), Tensor(), Tensor()};
  }
};

// batch_norm_relu and batch_norm_add_relu (Res): the running stats are mutated in place
// (not differentiable); absent tensors are placeholders, bits: 1 weight, 2 bias,
// 4 running_mean, 8 running_var. With Res, r is the residual, whose gradient is g' (the
// gradient through the ReLU's mask), written by the backward kernel beside gx; without,
// r is a placeholder that gets no gradient.
using BnFwd = std::tuple<Tensor, Tensor, Tensor>;
template <bool Res>
struct BatchNormReluFn : torch::autograd::Function<BatchNormReluFn<Res>> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& r, const Tensor& w,
                               const Tensor& b, const Tensor& rm, const Tensor& rv, int64_t present, bool training,
                               double momentum, double eps) {
    Tensor out, mean, invstd;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      const OptTensor wo = opt_if(w, present, 1), bo = opt_if(b, present, 2), rmo = opt_if(rm, present, 4),
                      rvo = opt_if(rv, present, 8);
      if constexpr (Res) {
        static auto op = op_handle<BnFwd(const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                                         const OptTensor&, const OptTensor&, bool, double, double)>(
            "kitsune::batch_norm_add_relu");
        std::tie(out, mean, invstd) = op.call(x, r, wo, bo, rmo, rvo, training, momentum, eps);
      } else {
        static auto op = op_handle<BnFwd(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                         const OptTensor&, bool, double, double)>("kitsune::batch_norm_relu");
        std::tie(out, mean, invstd) = op.call(x, wo, bo, rmo, rvo, training, momentum, eps);
      }
    }
    ctx->saved_data["present"] = present;
    ctx->saved_data["training"] = training;
    ctx->save_for_backward({x, out, w, mean, invstd});
    ctx->mark_non_differentiable({mean, invstd});
    ctx->set_materialize_grads(false);   // else two zero-filled (C,) gradients a call, for mean and invstd
    return {out, mean, invstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto s = ctx->get_saved_variables();
    const int64_t p = ctx->saved_data["present"].toInt();
    const bool training = ctx->saved_data["training"].toBool();
    Tensor g = go[0].defined() ? go[0] : at::zeros_like(s[1]);
    Tensor gx, gr, gw, gb;
    if constexpr (Res) {
      static auto op = op_handle<BnBwd(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                                       const Tensor&, bool)>("kitsune::batch_norm_add_relu_backward");
      std::tie(gx, gr, gw, gb) = op.call(g, s[0], s[1], opt_if(s[2], p, 1), s[3], s[4], training);
    } else {
      static auto op = op_handle<BnFwd(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                                       const Tensor&, bool)>("kitsune::batch_norm_relu_backward");
      std::tie(gx, gw, gb) = op.call(g, s[0], s[1], opt_if(s[2], p, 1), s[3], s[4], training);
    }
    return {gx, gr, grad_if(gw, p, 1), grad_if(gb, p, 2), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};
template <bool Res>
BnFwd bn_relu_autograd(const Tensor& x, const Tensor& r, const OptTensor& w, const OptTensor& b, const OptTensor& rm,
                       const OptTensor& rv, bool training, double momentum, double eps) {
  int64_t present = present_bits(w, b) | (rm && rm->defined() ? 4 : 0) | (rv && rv->defined() ? 8 : 0);
  auto out = BatchNormReluFn<Res>::apply(x, r, placeholder_if_absent(w, x), placeholder_if_absent(b, x),
                                         placeholder_if_absent(rm, x), placeholder_if_absent(rv, x), present,
                                         training, momentum, eps);
  return {out[0], out[1], out[2]};
}
BnFwd batch_norm_relu_autograd(const Tensor& x, const OptTensor& w, const OptTensor& b, const OptTensor& rm,
                               const OptTensor& rv, bool training, double momentum, double eps) {
  return bn_relu_autograd<false>(x, placeholder_if_absent(std::nullopt, x), w, b, rm, rv, training, momentum, eps);
}
BnFwd batch_norm_add_relu_autograd(const Tensor& x, const Tensor& r, const OptTensor& w, const OptTensor& b,
                                   const OptTensor& rm, const OptTensor& rv, bool training, double momentum,
                                   double eps) {
  return bn_relu_autograd<true>(x, r, w, b, rm, rv, training, momentum, eps);
}

// ---- linear_act: act(x @ W^T + b) ----
// On CUDA, one cuBLASLt GEMM with the bias and activation in its epilogue, on
// PyTorch's cuBLASLt handle and workspace (so one cuBLASLt in the process):
//   relu:      epilogue RELU_BIAS; the backward masks with the output;
//   gelu_tanh: fp16 and bf16, epilogue GELU_AUX_BIAS, which also stores the
//              pre-activation x @ W^T + b for the backward (its leading dimension
//              must be a multiple of 8: out_features % 8 == 0); fp32 as gelu;
//   gelu:      the GEMM, then kitsune.bias_gelu. cuBLASLt's GELU epilogue is the
//              tanh form, and ATen's _addmm_activation(use_gelu) is exact erf on the
//              CPU but that epilogue on CUDA, so neither gives erf GELU in one GEMM;
//   none:      F.linear's addmm; the backward sums the bias gradient with kt_colsum
//              (colsum above) where ATen's linear backward runs its reduce_kernel.
// The relu backward masks the gradient and sums the bias gradient in one kernel
// (kt_relu_grad_colsum), then plain GEMMs; gelu_tanh through cuBLASLt likewise
// (kt_bias_gelu_grad_colsum at the saved pre-activation). cuBLASLt's BGRADB epilogue,
// which gelu_tanh used before, ran as a kernel of its own after the weight GEMM
// (25 us against ATen's 33 us sum at 8192 x 3072 bf16; H100, 9743aae).
// Where cuBLASLt offers no algorithm (odd shapes or alignment), and on the CPU, the
// op composes ATen ops instead. x (..., in), weight (out, in), bias (out,).
void check_linear_act(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  TORCH_CHECK(act == "relu" || act == "gelu" || act == "gelu_tanh" || act == "none",
              "kitsune.linear_act: act must be 'relu', 'gelu', 'gelu_tanh' or 'none', got '", act, "'");
  check_same(x, w, "linear_act", "x", "weight");
  check_same(x, b, "linear_act", "x", "bias");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 2 && w.size(1) == x.size(-1) && b.dim() == 1 && b.size(0) == w.size(0),
              "kitsune.linear_act: need x (..., in), weight (out, in), bias (out,); got ", x.sizes(), ", ", w.sizes(),
              ", ", b.sizes());
}

// A column-major cuBLASLt GEMM D (m, n) = op(A) op(B), with an epilogue. RAII over
// the descriptors; run() returns false (and launches nothing) when the heuristic
// has no algorithm.
struct LtGemm {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  LtGemm(at::ScalarType st, bool ta, bool tb, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldd,
         cublasLtEpilogue_t epi) {
    const cudaDataType_t dt = st == at::kHalf ? CUDA_R_16F : st == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    const cublasComputeType_t ct = st == at::kFloat && at::globalContext().allowTF32CuBLAS()
                                       ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    lt_check(cublasLtMatmulDescCreate(&desc, ct, CUDA_R_32F));
    const cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    attr(CUBLASLT_MATMUL_DESC_TRANSA, opa);
    attr(CUBLASLT_MATMUL_DESC_TRANSB, opb);
    attr(CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
    lt_check(cublasLtMatrixLayoutCreate(&a, dt, ta ? k : m, ta ? m : k, lda));
    lt_check(cublasLtMatrixLayoutCreate(&b, dt, tb ? n : k, tb ? k : n, ldb));
    lt_check(cublasLtMatrixLayoutCreate(&d, dt, m, n, ldd));
  }
  ~LtGemm() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  static void lt_check(cublasStatus_t st) {
    TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "kitsune.linear_act: cuBLASLt call failed with status ", (int)st);
  }
  template <typename V> void attr(cublasLtMatmulDescAttributes_t at, const V& v) {
    lt_check(cublasLtMatmulDescSetAttribute(desc, at, &v, sizeof(v)));
  }
  bool run(const void* A, const void* B, void* D) {
    cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
    size_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
    void* ws = at::cuda::getCUDABlasLtWorkspace();
    cublasLtMatmulPreference_t pref;
    lt_check(cublasLtMatmulPreferenceCreate(&pref));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                             sizeof(ws_size));
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, d, d, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) return false;
    const float one = 1.f, zero = 0.f;
    lt_check(cublasLtMatmul(h, desc, &one, A, a, B, b, &zero, D, d, D, d, &res.algo, ws, ws_size,
                            at::cuda::getCurrentCUDAStream().stream()));
    return true;
  }
};

// cuBLASLt takes real CUDA memory: a tensor subclass (a FakeTensor under ShapeProp or
// torch.compile's tracing, which reaches this code through the C++ autograd kernel)
// composes ATen ops instead, which dispatch to it.
bool lt_dtype_ok(const Tensor& x) {
  return x.is_cuda() && !x.key_set().has(c10::DispatchKey::Python) &&
         (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat);
}

// out (M, N) = act(x2 (M, K) @ w (N, K)^T + b) in one cuBLASLt GEMM (D^T = W . x2^T in
// column-major terms); pre, when defined, receives x2 @ w^T + b. False: no algorithm.
bool lt_linear_act(const Tensor& x2, const Tensor& w, const Tensor& b, const Tensor& out, const Tensor& pre,
                   cublasLtEpilogue_t epi) {
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  c10::cuda::CUDAGuard g(x2.device());
  LtGemm gemm(x2.scalar_type(), true, false, N, M, K, K, K, N, epi);
  gemm.attr(CUBLASLT_MATMUL_DESC_BIAS_POINTER, b.data_ptr());
  if (pre.defined()) {
    gemm.attr(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre.data_ptr());
    gemm.attr(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, N);
  }
  return gemm.run(w.data_ptr(), x2.data_ptr(), out.data_ptr());
}

// The forward's results: out, and what the backward differentiates the activation
// at: for relu nothing (it masks with out), for none nothing; for gelu_tanh through cuBLASLt the
// pre-activation x @ W^T + b (pre_has_bias); otherwise the GEMM output before the
// bias (bias_gelu_backward adds it).
struct LinearActOut {
  Tensor out, saved;
  bool pre_has_bias;
};
LinearActOut linear_act_impl(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  check_linear_act(x, w, b, act);
  Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  c10::DimVector shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.size(0);
  const int64_t N = w.size(0);
  if (act == "none") return {at::addmm(b, x2, w.t()).view(shape), Tensor(), false};
  // gelu_tanh in fp32 composes: the epilogue's GELU is off by up to 4e-6 where
  // PyTorch's fp32 GELU is off by 2e-8 (H100, test_ops at 707707a); in 16-bit
  // formats that is far below the output's rounding.
  const bool lt_gelu = act == "gelu_tanh" && N % 8 == 0 && x.scalar_type() != at::kFloat;
  if (lt_dtype_ok(x) && x2.numel() > 0 && (act == "relu" || lt_gelu)) {
    Tensor wc = w.contiguous(), bc = b.contiguous(), out = at::empty({x2.size(0), N}, x2.options());
    Tensor pre = act == "relu" ? Tensor() : at::empty_like(out);
    if (lt_linear_act(x2, wc, bc, out, pre, act == "relu" ? CUBLASLT_EPILOGUE_RELU_BIAS
                                                          : CUBLASLT_EPILOGUE_GELU_AUX_BIAS))
      return {out.view(shape), pre, act != "relu"};
  }
  if (act == "relu") return {at::relu(at::addmm(b, x2, w.t())).view(shape), Tensor(), false};
  static auto bias_gelu = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::bias_gelu");
  Tensor mm = at::mm(x2, w.t());
  return {bias_gelu.call(mm, b, act == "gelu" ? "none" : "tanh").view(shape), mm, false};
}
Tensor linear_act_fwd(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  return linear_act_impl(x, w, b, act).out;
}

struct LinearActFn : torch::autograd::Function<LinearActFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& b, std::string act) {
    LinearActOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = linear_act_impl(x, w, b, act);
    }
    ctx->saved_data["act"] = act;
    ctx->saved_data["pre_has_bias"] = r.pre_has_bias;
    ctx->save_for_backward({x, w, b, act == "relu" ? r.out : r.saved});
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto relu_bwd = op_handle<BinarySig>("kitsune::add_relu_backward");
    static auto gelu_bwd = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                c10::string_view)>("kitsune::bias_gelu_backward");
    auto s = ctx->get_saved_variables();
    const Tensor &x = s[0], &w = s[1], &b = s[2];
    const std::string act = ctx->saved_data["act"].toStringRef();
    const int64_t N = w.size(0);
    // only the gradients autograd asks for: the first layer's input (a batch) needs
    // none, and its (M, K) GEMM was a fifth of the MLP's backward GEMM work
    const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1), need_b = ctx->needs_input_grad(2);
    Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous(), g2 = go[0].reshape({-1, N}).contiguous(), gpre, gw, gb;
    if (act == "gelu_tanh" && ctx->saved_data["pre_has_bias"].toBool()) {
      // GELU's backward at the epilogue's pre-activation and the bias gradient in one
      // pass (kt_bias_gelu_grad_colsum with no bias to add), then plain GEMMs: it was
      // ATen's gelu_backward and cuBLASLt's BGRADB, a kernel of its own after the GEMM
      std::tie(gpre, gb) = gelu_grad_colsum(g2, s[3].reshape({-1, N}).contiguous(), Tensor(), 1, b.scalar_type());
    } else if (act == "gelu" || act == "gelu_tanh") {
      std::tie(gpre, gb) = gelu_bwd.call(g2, s[3], b, act == "gelu" ? "none" : "tanh");
    } else if (act == "none") {
      gpre = g2;
      if (need_b) gb = colsum(g2, b.scalar_type());
    } else if (act == "relu" && lt_dtype_ok(x) && x2.numel() > 0) {
      // ReLU's mask and the bias gradient in one kernel, then a plain weight GEMM: the
      // elementwise kernel and cuBLASLt's BGRADB epilogue kernel were two launches
      // (MLP: 2.7 + 3.0 us a step for its two layers, h100_profile_graph_9d33764.log)
      Tensor sums;
      std::tie(gpre, sums) = relu_grad_colsum(g2, s[3].reshape({-1, N}).contiguous(), b.scalar_type());
      if (need_b) gb = sums;
    } else {   // relu where the fused pass does not run (the CPU, fake tensors, no rows)
      gpre = relu_bwd.call(g2, s[3].reshape({-1, N})).contiguous();
      if (need_b) gb = colsum(gpre, b.scalar_type());
    }
    if (need_w && !gw.defined()) gw = at::mm(gpre.t(), x2);
    return {need_x ? at::mm(gpre, w).view(x.sizes()) : Tensor(), need_w ? gw : Tensor(), need_b ? gb : Tensor(),
            Tensor()};
  }
};
Tensor linear_act_autograd(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
  return LinearActFn::apply(x, w, b, std::string(act));
}

// ---- channel_bias: act(y + bias over dim 1) ----
// A convolution's bias, split from it by kitsune.optimize (F.conv2d(x, W) then this
// op, with the ReLU that follows when there is one). ATen's convolution_backward sums
// the bias gradient over (N, H, W) in one reduction that left the H100 mostly idle at
// LeNet's and the Inception net's shapes: reduce_kernel, 44.6 us a step for LeNet's
// two convolutions, 31-59 us a call in the Inception net
// (bench/results/h100_profile_graph_101578e.log). Here the sum takes two stages with
// parallelism in both: each (n, c) plane's sum (N C outputs), then a sum over n, on the
// gradient's own strides (a slice of torch.cat's gradient is not copied: fb40403 made
// NCHW copies of those, bench/results/h100_channel_bias_fb40403.log); a 2-D (rows, C)
// gradient, column sums over S slabs of rows, then over the slabs.
// Sums accumulate in fp32 (fp64 for fp64) in a fixed order (deterministic), and the gradient is
// rounded once to the bias's dtype. The forward: kt_bias_act where the channels are
// last in memory, else ATen's y + bias and relu in place. y and bias share a dtype;
// under autocast the bias is cast to y's (as a convolution does with its bias).
// g (N, C, H, W) with channels last in memory: its (N H W, C) rows as a 2-D view
// whose rows are stride(3) elements apart (wider than C for a channel slice of a
// channels-last tensor); undefined for any other layout.
Tensor channel_rows(const Tensor& g) {
  const int64_t N = g.size(0), C = g.size(1), H = g.size(2), W = g.size(3);
  // a dim of size 1 may have any stride: the row step comes from the innermost one that is not
  const int64_t ld = W > 1 ? g.stride(3) : H > 1 ? g.stride(2) : N > 1 ? g.stride(0) : C;
  const bool rows = (C == 1 || g.stride(1) == 1) && ld >= C && (H == 1 || g.stride(2) == W * ld) &&
                    (N == 1 || g.stride(0) == H * W * ld);
  return rows ? g.as_strided({N * H * W, C}, {ld, 1}) : Tensor();
}

// t as its dense (rows, C) matrix: a 2-D contiguous t, or channel_rows of a 4-D one
// whose rows are C apart (dense in channels-last); undefined otherwise (including fake
// tensors, whose sizes may be symbolic, and empty ones).
Tensor dense_channel_rows(const Tensor& t) {
  if (!t.is_cuda() || t.key_set().has(c10::DispatchKey::Python) || t.numel() == 0) return Tensor();
  const Tensor r = t.dim() == 2 ? t : t.dim() == 4 ? channel_rows(t) : Tensor();
  return r.defined() && r.is_contiguous() ? r : Tensor();
}

Tensor channel_sum(const Tensor& g, at::ScalarType out_t) {
  const int64_t C = g.size(1), N = g.size(0);
  const at::ScalarType acc = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (g.numel() == 0) return at::zeros({C}, g.options().dtype(out_t));
  // channels last in memory, on real CUDA memory (a fake tensor's sizes may be
  // symbolic): one kt_colsum over the (N H W, C) rows, also where they are a channel
  // slice of wider rows (torch.cat's gradient in NHWC)
  if (g.is_cuda() && !g.key_set().has(c10::DispatchKey::Python)) {
    Tensor rows = g.dim() == 2 ? g : g.dim() == 4 ? channel_rows(g) : Tensor();
    if (rows.defined() && (rows.stride(1) == 1 || C == 1)) return colsum(rows, out_t);
  }
  if (g.dim() > 2) {   // each (n, c)'s sum over the spatial dims (N C outputs), then over n: no copy, any strides
    c10::DimVector spatial;
    for (int64_t d = 2; d < g.dim(); d++) spatial.push_back(d);
    return g.sum(spatial, false, acc).sum(0).to(out_t);
  }
  if (!g.is_contiguous()) return g.sum(0, false, acc).to(out_t);
  int64_t S = 1;   // (N, C): column sums over S slabs of rows, then over the slabs
  for (int64_t s = 256; s > 1; s /= 2)
    if (N % s == 0 && N / s >= s) { S = s; break; }
  return g.view({S, N / S, C}).sum(1, false, acc).sum(0).to(out_t);
}

void check_channel_bias(const Tensor& y, const Tensor& b, c10::string_view act) {
  TORCH_CHECK(act == "none" || act == "relu", "kitsune.channel_bias: act must be 'none' or 'relu', got '", act, "'");
  check_same(y, b, "channel_bias", "y", "bias");
  TORCH_CHECK(y.dim() >= 2 && b.dim() == 1 && b.size(0) == y.size(1),
              "kitsune.channel_bias: need y (N, C, ...) and bias (C,); got ", y.sizes(), " and ", b.sizes());
  TORCH_CHECK(at::isFloatingType(y.scalar_type()) && at::isFloatingType(b.scalar_type()),
              "kitsune.channel_bias: y and bias must be floating point, got ", y.scalar_type(), " and ",
              b.scalar_type());
}

Tensor channel_bias_fwd(const Tensor& y, const Tensor& b, c10::string_view act) {
  check_channel_bias(y, b, act);
  const int64_t C = b.size(0);
  // channels last in memory (a channels-last convolution's output, or (rows, C)): one
  // kernel, bias[i % C] (ATen's broadcast add ran as its generic, unvectorized kernel
  // there: bench/results/h100_channel_bias_fb40403.log, CUDAFunctor_add)
  // (checked only for real CUDA tensors: a fake one's sizes may be symbolic)
  auto channels_last = [&] {
    return (y.dim() == 4 && y.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
           (y.is_contiguous() && y.numel() == y.size(0) * C);
  };
  if (lt_dtype_ok(y) && y.numel() > 0 && channels_last()) {
    c10::cuda::CUDAGuard g(y.device());
    Tensor out = at::empty_like(y), bc = b.contiguous();
    check_launch(kt_bias_act(dtype_of(y, "channel_bias"), y.data_ptr(), bc.data_ptr(), out.data_ptr(), y.numel(), C,
                             act == "relu", stream_of(out)), "channel_bias");
    return out;
  }
  c10::DimVector shape(y.dim(), 1);
  shape[1] = b.size(0);
  Tensor out = at::add(y, b.view(shape));
  return act == "relu" ? out.clamp_min_(0) : out;
}

struct ChannelBiasFn : torch::autograd::Function<ChannelBiasFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& y, const Tensor& b, std::string act) {
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      out = channel_bias_fwd(y, b, act);
    }
    ctx->saved_data["relu"] = act == "relu";
    if (act == "relu") ctx->save_for_backward({out});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    Tensor g = go[0];
    if (ctx->saved_data["relu"].toBool()) {
      const Tensor y = ctx->get_saved_variables()[0];
      // g and y dense with channels last (a channels-last convolution's output and its
      // gradient, or (rows, C)): ReLU's mask and the bias gradient in one pass over
      // their (N H W, C) rows (kt_relu_grad_colsum), where threshold_backward and the
      // column sum read the gradient twice (the Inception net's 6 ReLU'd convolutions)
      const Tensor g2 = dense_channel_rows(g), y2 = dense_channel_rows(y);
      if (g2.defined() && y2.defined() && lt_dtype_ok(g) && g.scalar_type() == y.scalar_type()) {
        auto [gx, sums] = relu_grad_colsum(g2, y2, g.scalar_type());
        return {g.dim() == 2 ? gx : gx.view({g.size(0), g.size(2), g.size(3), g.size(1)}).permute({0, 3, 1, 2}),
                sums, Tensor()};
      }
      g = at::threshold_backward(g, y, 0);
    }
    return {g, channel_sum(g, g.scalar_type()), Tensor()};
  }
};
Tensor channel_bias_autograd(const Tensor& y, const Tensor& b, c10::string_view act) {
  return ChannelBiasFn::apply(y, b, std::string(act));
}

// ---- bias_relu_pool: max_pool2d(relu(y + bias over dim 1), kernel_size) ----
// A convolution's bias, its ReLU and a max pooling over non-overlapping windows
// (stride = kernel, no padding, floor mode), taken together by kitsune.optimize
// (LeNet-style blocks). On CUDA with y NCHW-contiguous in fp32/fp16/bf16: one kernel
// forward, and backward one kernel (the input gradient and its per-plane sums) plus a
// column sum over n (fusion/kernels/pool.cu). Otherwise (the CPU, other layouts, fake
// tensors) channel_bias and ATen's pooling, whose results these equal. The kernel
// path saves y and the bias only: its backward finds each window's winner again
// (torch's unfused ops keep the relu output and int64 indices).
struct PoolGeom {
  int64_t kh, kw;
};
PoolGeom check_bias_relu_pool(const Tensor& y, const Tensor& b, c10::IntArrayRef k) {
  check_same(y, b, "bias_relu_pool", "y", "bias");
  TORCH_CHECK(y.dim() == 4 && b.dim() == 1 && b.size(0) == y.size(1),
              "kitsune.bias_relu_pool: need y (N, C, H, W) and bias (C,); got ", y.sizes(), " and ", b.sizes());
  TORCH_CHECK(at::isFloatingType(y.scalar_type()) && b.scalar_type() == y.scalar_type(),
              "kitsune.bias_relu_pool: y and bias must share a floating point dtype, got ", y.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(k.size() == 1 || k.size() == 2, "kitsune.bias_relu_pool: kernel_size must be one or two ints, got ", k);
  const int64_t kh = k[0], kw = k.size() == 2 ? k[1] : k[0];
  TORCH_CHECK(kh >= 1 && kw >= 1 && kh <= 64 && kw <= 64, "kitsune.bias_relu_pool: kernel_size must be in 1..64, got ",
              k);
  TORCH_CHECK(y.size(2) >= kh && y.size(3) >= kw, "kitsune.bias_relu_pool: the input's ", y.size(2), " x ", y.size(3),
              " is smaller than the ", kh, " x ", kw, " window");
  return {kh, kw};
}

bool pool_kernel_ok(const Tensor& y) { return lt_dtype_ok(y) && y.is_contiguous() && y.numel() > 0; }

// out; z and idx (the relu output and the pooling's indices, for the backward) on the
// unfused path only: channel_bias's kernel where channels are last in memory, then
// ATen's pooling, as these ops ran before they were fused.
struct PoolOut {
  Tensor out, z, idx;
};
PoolOut bias_relu_pool_impl(const Tensor& y, const Tensor& b, PoolGeom p) {
  if (!pool_kernel_ok(y)) {
    Tensor z = channel_bias_fwd(y, b, "relu");
    auto [out, idx] = at::max_pool2d_with_indices(z, {p.kh, p.kw}, {p.kh, p.kw});
    return {out, z, idx};
  }
  c10::cuda::CUDAGuard g(y.device());
  Tensor out = at::empty({y.size(0), y.size(1), y.size(2) / p.kh, y.size(3) / p.kw}, y.options()), bc = b.contiguous();
  check_launch(kt_bias_relu_pool(dtype_of(y, "bias_relu_pool"), y.data_ptr(), bc.data_ptr(), out.data_ptr(), y.size(0),
                                 y.size(1), y.size(2), y.size(3), (int)p.kh, (int)p.kw, stream_of(out)),
               "bias_relu_pool");
  return {out, Tensor(), Tensor()};
}
Tensor bias_relu_pool_fwd(const Tensor& y, const Tensor& b, c10::IntArrayRef k) {
  return bias_relu_pool_impl(y, b, check_bias_relu_pool(y, b, k)).out;
}

struct BiasReluPoolFn : torch::autograd::Function<BiasReluPoolFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& y, const Tensor& b, std::vector<int64_t> k) {
    const PoolGeom p = check_bias_relu_pool(y, b, k);
    PoolOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = bias_relu_pool_impl(y, b, p);
    }
    ctx->saved_data["k"] = std::vector<int64_t>{p.kh, p.kw};
    ctx->save_for_backward({r.z.defined() ? Tensor() : y, b, r.z, r.idx});
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto s = ctx->get_saved_variables();
    const Tensor &y = s[0], &b = s[1], &z = s[2];
    auto k = ctx->saved_data["k"].toIntVector();
    Tensor gy, gb;
    if (z.defined()) {   // the unfused path's
      gy = at::threshold_backward(
          at::max_pool2d_with_indices_backward(go[0], z, k, k, {0, 0}, {1, 1}, false, s[3]), z, 0);
      gb = channel_sum(gy, b.scalar_type());
    } else {
      c10::cuda::CUDAGuard guard(y.device());
      const int64_t N = y.size(0), C = y.size(1);
      Tensor gc = go[0].contiguous(), bc = b.contiguous();
      gy = at::empty_like(y);
      Tensor sums = at::empty({N, C}, y.options().dtype(at::kFloat));
      check_launch(kt_bias_relu_pool_backward(dtype_of(y, "bias_relu_pool"), gc.data_ptr(), y.data_ptr(),
                                              bc.data_ptr(), gy.data_ptr(), sums.data_ptr<float>(), N, C, y.size(2),
                                              y.size(3), (int)k[0], (int)k[1], stream_of(gy)),
                   "bias_relu_pool backward");
      gb = colsum(sums, b.scalar_type());
    }
    return {gy, gb, Tensor()};
  }
};
Tensor bias_relu_pool_autograd(const Tensor& y, const Tensor& b, c10::IntArrayRef k) {
  return BiasReluPoolFn::apply(y, b, k.vec());
}

// ---- max_pool2d: F.max_pool2d(x, kernel_size, stride, padding, ceil_mode=...), dilation 1 ----
// On CUDA with a 4-D x NCHW- or channels-last-contiguous in fp32/fp16/bf16 and windows of
// at most 256 elements: Kitsune's kernels (fusion/kernels/pool.cu), which save a byte per
// output (the winner's place in its window) for a gather backward. Otherwise (the CPU,
// 3-D input, other layouts, fake tensors) ATen's max_pool2d_with_indices and its
// backward. Both give ATen's output, layout and gradient.
struct MaxPoolArgs {
  int64_t kh, kw, sh, sw, ph, pw;
  bool ceil;
};

// ATen's own output size (floor or ceil mode; dilation 1), without its checks: ours
// name the op and the bad value.
int64_t pooled_size(int64_t in, int64_t k, int64_t s, int64_t p, bool ceil) {
  return at::native::pooling_output_shape_pad_lr<int64_t>(in, k, p, p, s, 1, ceil);
}

MaxPoolArgs check_max_pool2d(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p, bool ceil) {
  TORCH_CHECK(x.dim() == 3 || x.dim() == 4, "kitsune.max_pool2d: need x (N, C, H, W) or (C, H, W), got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kitsune.max_pool2d: x must be floating point, got ",
              x.scalar_type());
  TORCH_CHECK(x.size(-1) > 0 && x.size(-2) > 0 && x.size(-3) > 0,
              "kitsune.max_pool2d: x's C, H and W must be non-zero, got ", x.sizes());
  TORCH_CHECK(k.size() == 1 || k.size() == 2, "kitsune.max_pool2d: kernel_size must be one or two ints, got ", k);
  TORCH_CHECK(s.size() <= 2, "kitsune.max_pool2d: stride must be empty (= kernel_size), one or two ints, got ", s);
  TORCH_CHECK(p.size() == 1 || p.size() == 2, "kitsune.max_pool2d: padding must be one or two ints, got ", p);
  MaxPoolArgs a{k[0], k.back(), s.empty() ? k[0] : s[0], s.empty() ? k.back() : s.back(), p[0], p.back(), ceil};
  TORCH_CHECK(a.kh >= 1 && a.kw >= 1, "kitsune.max_pool2d: kernel_size must be positive, got ", k);
  TORCH_CHECK(a.sh >= 1 && a.sw >= 1, "kitsune.max_pool2d: stride must be positive, got ", s);
  TORCH_CHECK(a.ph >= 0 && a.pw >= 0 && 2 * a.ph <= a.kh && 2 * a.pw <= a.kw,
              "kitsune.max_pool2d: padding must be in 0..kernel_size / 2, got padding ", p, " for kernel_size ", k);
  const int64_t oh = pooled_size(x.size(-2), a.kh, a.sh, a.ph, ceil),
                ow = pooled_size(x.size(-1), a.kw, a.sw, a.pw, ceil);
  TORCH_CHECK(oh >= 1 && ow >= 1, "kitsune.max_pool2d: the input's ", x.size(-2), " x ", x.size(-1), " (padding ", p,
              ") is smaller than the ", a.kh, " x ", a.kw, " window");
  return a;
}

// The kernels' memory format for x, or nullopt for ATen's path.
std::optional<at::MemoryFormat> max_pool_format(const Tensor& x, const MaxPoolArgs& a) {
  if (!lt_dtype_ok(x) || x.dim() != 4 || a.kh * a.kw > 256 || a.sh > INT32_MAX || a.sw > INT32_MAX) return std::nullopt;
  const auto f = x.suggest_memory_format();
  if (f == at::MemoryFormat::ChannelsLast ? x.is_contiguous(f) : x.is_contiguous()) return f;
  return std::nullopt;
}

kt_pool2d pool_geometry(const Tensor& x, const MaxPoolArgs& a, at::MemoryFormat f) {
  return kt_pool2d{x.size(0),
                   x.size(1),
                   x.size(2),
                   x.size(3),
                   pooled_size(x.size(2), a.kh, a.sh, a.ph, a.ceil),
                   pooled_size(x.size(3), a.kw, a.sw, a.pw, a.ceil),
                   (int)a.kh,
                   (int)a.kw,
                   (int)a.sh,
                   (int)a.sw,
                   (int)a.ph,
                   (int)a.pw,
                   f == at::MemoryFormat::ChannelsLast};
}

// out, and what the backward needs: where (the kernels' bytes) or idx (ATen's indices).
struct MaxPoolOut {
  Tensor out, where, idx;
  bool channels_last;
};
MaxPoolOut max_pool2d_impl(const Tensor& x, const MaxPoolArgs& a) {
  const auto f = max_pool_format(x, a);
  if (!f) {
    auto [out, idx] = at::max_pool2d_with_indices(x, {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1}, a.ceil);
    return {out, Tensor(), idx, false};
  }
  c10::cuda::CUDAGuard g(x.device());
  const kt_pool2d geo = pool_geometry(x, a, *f);
  auto opts = x.options().memory_format(*f);
  Tensor out = at::empty({geo.n, geo.c, geo.oh, geo.ow}, opts),
         where = at::empty({geo.n, geo.c, geo.oh, geo.ow}, opts.dtype(at::kByte));
  check_launch(kt_max_pool2d(dtype_of(x, "max_pool2d"), x.data_ptr(), out.data_ptr(), where.data_ptr<uint8_t>(),
                             &geo, stream_of(out)),
               "max_pool2d");
  return {out, where, Tensor(), geo.channels_last != 0};
}
Tensor max_pool2d_fwd(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p, bool ceil) {
  return max_pool2d_impl(x, check_max_pool2d(x, k, s, p, ceil)).out;
}

struct MaxPoolFn : torch::autograd::Function<MaxPoolFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::vector<int64_t> k, std::vector<int64_t> s,
                        std::vector<int64_t> p, bool ceil) {
    const MaxPoolArgs a = check_max_pool2d(x, k, s, p, ceil);
    MaxPoolOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = max_pool2d_impl(x, a);
    }
    // The kernels' backward needs x's shape and layout, not x.
    ctx->saved_data["geo"] = std::vector<int64_t>{a.kh, a.kw, a.sh, a.sw, a.ph, a.pw, a.ceil};
    ctx->saved_data["shape"] = x.sizes().vec();
    ctx->saved_data["cl"] = r.channels_last;
    ctx->save_for_backward({r.where.defined() ? Tensor() : x, r.where, r.idx});
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    auto sv = ctx->get_saved_variables();
    auto v = ctx->saved_data["geo"].toIntVector();
    const MaxPoolArgs a{v[0], v[1], v[2], v[3], v[4], v[5], v[6] != 0};
    if (sv[2].defined())   // ATen's path
      return {at::max_pool2d_with_indices_backward(go[0], sv[0], {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1},
                                                   a.ceil, sv[2]),
              Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor& where = sv[1];
    const auto f = ctx->saved_data["cl"].toBool() ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    c10::cuda::CUDAGuard guard(where.device());
    Tensor g = go[0].contiguous(f),
           gx = at::empty(ctx->saved_data["shape"].toIntVector(), go[0].options().memory_format(f));
    const kt_pool2d geo = pool_geometry(gx, a, f);
    check_launch(kt_max_pool2d_backward(dtype_of(g, "max_pool2d"), g.data_ptr(), where.data_ptr<uint8_t>(),
                                        gx.data_ptr(), &geo, stream_of(gx)),
                 "max_pool2d backward");
    return {gx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};
Tensor max_pool2d_autograd(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p, bool ceil) {
  return MaxPoolFn::apply(x, k.vec(), s.vec(), p.vec(), ceil);
}

// ---- max_pool2d_where / max_pool2d_backward_add: a pooled tensor's gradients in one pass ----
// The pieces of kitsune.fx's max-pool branch point (an Inception block's input feeds its
// pooling and the other branches' convolutions): the forward's output with the kernels'
// winner bytes, and a backward that adds the other branches' gradients of x while it
// gathers the pooling's, where autograd would add them one launch each (3 adds of the
// block input's gradient a block in the Inception net). CUDA: the kernels where they
// take x (max_pool_format: dtype, layout, window); elsewhere, and on the CPU, a reference
// through ATen's indices, on x's device: the same bytes and sums.
// The corners (rows, columns; in the padding where negative) of the (oh, ow) windows,
// as (oh, 1) and (1, ow) int64 tensors on device d.
std::pair<Tensor, Tensor> window_corners(const MaxPoolArgs& a, int64_t oh, int64_t ow, at::Device d) {
  auto o = at::TensorOptions().dtype(at::kLong).device(d);
  return {at::arange(oh, o).view({oh, 1}) * a.sh - a.ph, at::arange(ow, o).view({1, ow}) * a.sw - a.pw};
}
std::tuple<Tensor, Tensor> max_pool2d_where_cpu(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s,
                                                c10::IntArrayRef p, bool ceil) {
  const MaxPoolArgs a = check_max_pool2d(x, k, s, p, ceil);
  TORCH_CHECK(x.dim() == 4, "kitsune.max_pool2d_where: need x (N, C, H, W), got ", x.sizes());
  TORCH_CHECK(a.kh * a.kw <= 256, "kitsune.max_pool2d_where: a window of at most 256 elements, got ", a.kh, " x ",
              a.kw);
  auto [out, idx] = at::max_pool2d_with_indices(x, {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1}, a.ceil);
  auto [h0, w0] = window_corners(a, out.size(2), out.size(3), x.device());
  const int64_t w = x.size(3);
  Tensor ih = at::floor_divide(idx, w), iw = idx - ih * w;
  Tensor where = ((ih - h0) * a.kw + (iw - w0)).to(at::kByte).contiguous(out.suggest_memory_format());
  return {out, where};
}
std::tuple<Tensor, Tensor> max_pool2d_where_cuda(const Tensor& x, c10::IntArrayRef k, c10::IntArrayRef s,
                                                 c10::IntArrayRef p, bool ceil) {
  const MaxPoolArgs a = check_max_pool2d(x, k, s, p, ceil);
  if (!max_pool_format(x, a)) return max_pool2d_where_cpu(x, k, s, p, ceil);   // ATen's, on the device
  MaxPoolOut r = max_pool2d_impl(x, a);
  return {r.out, r.where};
}

// grad (or none) and adds: tensors of the input's shape; the result in where's layout.
// Returns the pooling's arguments, checked against the input's size.
MaxPoolArgs check_backward_add(const OptTensor& grad, const Tensor& where, const std::vector<Tensor>& adds,
                               c10::IntArrayRef size, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p,
                               bool ceil) {
  TORCH_CHECK(size.size() == 4, "kitsune.max_pool2d_backward_add: input_size must be (N, C, H, W), got ", size);
  TORCH_CHECK(where.scalar_type() == at::kByte && where.dim() == 4 && where.size(0) == size[0] &&
                  where.size(1) == size[1],
              "kitsune.max_pool2d_backward_add: where must be max_pool2d_where's uint8 (N, C, oh, ow) for input ",
              size, ", got ", where.scalar_type(), " ", where.sizes());
  TORCH_CHECK(grad.has_value() || !adds.empty(), "kitsune.max_pool2d_backward_add: no gradient to sum");
  if (grad) {
    TORCH_CHECK(grad->sizes() == where.sizes() && grad->device() == where.device(),
                "kitsune.max_pool2d_backward_add: grad of shape ", grad->sizes(), " on ", grad->device(),
                " does not match the pooled output's ", where.sizes(), " on ", where.device());
  }
  const Tensor& ref = grad ? *grad : adds[0];
  for (const Tensor& t : adds)
    TORCH_CHECK(t.sizes() == size && t.scalar_type() == ref.scalar_type() && t.device() == where.device(),
                "kitsune.max_pool2d_backward_add: every addend must be ", ref.scalar_type(), " of the input's shape ",
                size, " on ", where.device(), "; got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
  return check_max_pool2d(at::empty(size, ref.options().device(at::kMeta)), k, s, p, ceil);
}
Tensor max_pool2d_backward_add_cpu(const OptTensor& grad, const Tensor& where, at::TensorList adds_in,
                                   c10::IntArrayRef size, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p,
                                   bool ceil) {
  std::vector<Tensor> adds(adds_in.begin(), adds_in.end());
  const MaxPoolArgs a = check_backward_add(grad, where, adds, size, k, s, p, ceil);
  const Tensor& ref = grad ? *grad : adds[0];
  const auto f = where.suggest_memory_format();
  Tensor acc;
  if (grad) {
    auto [h0, w0] = window_corners(a, where.size(2), where.size(3), where.device());
    Tensor b = where.to(at::kLong), dh = at::floor_divide(b, a.kw), dw = b - dh * a.kw;
    Tensor idx = ((h0 + dh) * size[3] + (w0 + dw)).contiguous(f);
    acc = at::max_pool2d_with_indices_backward(grad->to(opmath(ref)), at::empty(size, ref.options().dtype(opmath(ref))
                                                                                   .memory_format(f)),
                                               {a.kh, a.kw}, {a.sh, a.sw}, {a.ph, a.pw}, {1, 1}, a.ceil, idx);
  }
  for (const Tensor& t : adds) acc = acc.defined() ? acc + t.to(opmath(ref)) : t.to(opmath(ref));
  return acc.to(ref.scalar_type()).contiguous(f);
}
Tensor max_pool2d_backward_add_cuda(const OptTensor& grad, const Tensor& where, at::TensorList adds_in,
                                    c10::IntArrayRef size, c10::IntArrayRef k, c10::IntArrayRef s, c10::IntArrayRef p,
                                    bool ceil) {
  std::vector<Tensor> adds(adds_in.begin(), adds_in.end());
  const MaxPoolArgs a = check_backward_add(grad, where, adds, size, k, s, p, ceil);
  const Tensor& ref = grad ? *grad : adds[0];
  if (!lt_dtype_ok(ref))   // the dtypes the kernels do not take: ATen's, on the device
    return max_pool2d_backward_add_cpu(grad, where, adds_in, size, k, s, p, ceil);
  const auto f = where.is_contiguous(at::MemoryFormat::ChannelsLast) && !where.is_contiguous()
                     ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  TORCH_CHECK(where.is_contiguous(f), "kitsune.max_pool2d_backward_add: where must be dense (NCHW or channels-last)");
  c10::cuda::CUDAGuard guard(where.device());
  Tensor gx = at::empty(size, ref.options().memory_format(f));
  const kt_pool2d geo = pool_geometry(gx, a, f);
  TORCH_CHECK(geo.oh == where.size(2) && geo.ow == where.size(3), "kitsune.max_pool2d_backward_add: where's ",
              where.sizes(), " is not the pooled size of ", size);
  Tensor g = grad ? grad->contiguous(f) : Tensor();
  // beyond the kernel's addend slots, the rest summed first (one more launch each)
  for (auto& t : adds) t = t.contiguous(f);
  while (adds.size() > KT_POOL_ADDENDS) {
    Tensor last = adds.back();
    adds.pop_back();
    adds.back() = adds.back() + last;
  }
  kt_addends ad{};
  ad.n = (int)adds.size();
  for (int i = 0; i < ad.n; i++) ad.p[i] = adds[i].data_ptr();
  check_launch(kt_max_pool2d_backward_add(dtype_of(gx, "max_pool2d_backward_add"), g.defined() ? g.data_ptr() : nullptr,
                                          where.data_ptr<uint8_t>(), &ad, gx.data_ptr(), &geo, stream_of(gx)),
               "max_pool2d_backward_add");
  return gx;
}

// ---- embedding: F.embedding(indices, weight, padding_idx) ----
// The forward is ATen's lookup; the weight gradient, on CUDA for fp32/fp16/bf16, is
// Kitsune's (fusion/kernels/embedding.cu: a radix sort over the vocabulary's bits
// only, then a block per run of equal indices), where ATen's sorts all 64 bits of the
// indices. Elsewhere (the CPU, fake tensors, other dtypes) ATen's dense backward.
// padding_idx -1: none (kitsune.ops.embedding counts a negative one from the end first, as
// F.embedding does).
Tensor embedding_fwd(const Tensor& w, const Tensor& indices, int64_t padding_idx) {
  TORCH_CHECK(w.dim() == 2, "kitsune.embedding: weight must be (num_embeddings, embedding_dim), got ", w.sym_sizes());
  const c10::SymInt& rows = w.sym_size(0);
  TORCH_CHECK(padding_idx == -1 || (padding_idx >= 0 && rows > padding_idx),
              "kitsune.embedding: padding_idx must be -1 (none) or in [0, ", rows, "), got ", padding_idx);
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
              "kitsune.embedding: indices must be int64 or int32, got ", indices.scalar_type());
  return at::embedding(w, indices, padding_idx);
}
Tensor embedding_backward_impl(const Tensor& grad, const Tensor& indices, const c10::SymInt& sym_rows,
                               int64_t padding_idx) {
  // sizes only on real CUDA tensors (a fake one's may be symbolic)
  const bool real = grad.is_cuda() && !grad.key_set().has(c10::DispatchKey::Python) &&
                    !indices.key_set().has(c10::DispatchKey::Python) &&
                    (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kHalf ||
                     grad.scalar_type() == at::kBFloat16);
  const int64_t wsn = real ? kt_embedding_backward_workspace(indices.numel(), sym_rows.expect_int()) : -1;
  if (wsn < 0 || (grad.size(-1) + 127) / 128 > 65535)
    return at::embedding_dense_backward_symint(grad, indices, sym_rows, padding_idx, false);
  const int64_t dim = grad.size(-1), n = indices.numel(), rows = sym_rows.expect_int();
  c10::cuda::CUDAGuard g(grad.device());
  Tensor gc = grad.reshape({n, dim}).contiguous(), ic = indices.reshape({n}).to(at::kLong).contiguous();
  Tensor out = at::empty({rows, dim}, gc.options());
  Tensor ws = at::empty({wsn > 0 ? wsn : 1}, gc.options().dtype(at::kByte));   // the caching allocator: 512-aligned
  check_launch(kt_embedding_backward(dtype_of(gc, "embedding"), gc.data_ptr(), ic.data_ptr<int64_t>(), n, dim, rows,
                                     padding_idx, out.data_ptr(), ws.data_ptr(), wsn, stream_of(out)),
               "embedding backward");
  return out;
}

struct EmbeddingFn : torch::autograd::Function<EmbeddingFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& w, const Tensor& indices, int64_t padding_idx) {
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      out = embedding_fwd(w, indices, padding_idx);
    }
    ctx->saved_data["rows"] = w.sym_size(0);
    ctx->saved_data["padding"] = padding_idx;
    ctx->save_for_backward({indices});
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const auto saved = ctx->get_saved_variables();
    return {embedding_backward_impl(go[0], saved[0], ctx->saved_data["rows"].toSymInt(),
                                    ctx->saved_data["padding"].toInt()),
            Tensor(), Tensor()};
  }
};
Tensor embedding_autograd(const Tensor& w, const Tensor& indices, int64_t padding_idx) {
  return EmbeddingFn::apply(w, indices, padding_idx);
}

// ---- global_avg_pool: x.mean(dim, keepdim) where dim is H and W of an (N, C, H, W) x ----
// On CUDA for a channels-last x (dense in NHWC and not NCHW-contiguous too) in
// fp32/fp16/bf16 with pixels: Kitsune's kernels (fusion/kernels/avg_pool.cu), which need
// no workspace where ATen's strided reduction stages partial sums in a buffer twice the
// input's size. Otherwise (the CPU, NCHW, other ranks or dims, fake tensors) ATen's mean
// with its own autograd: the same values to rounding, and ATen's errors.
bool gap_kernel_ok(const Tensor& x, c10::IntArrayRef dim) {
  if (!lt_dtype_ok(x) || x.dim() != 4 || dim.size() != 2) return false;
  for (int64_t d : dim)
    if (d < -4 || d > 3) return false;   // ATen's range error
  const int64_t a = (dim[0] + 4) % 4, b = (dim[1] + 4) % 4;
  return std::min(a, b) == 2 && std::max(a, b) == 3 && x.size(2) * x.size(3) > 0 &&
         x.is_contiguous(at::MemoryFormat::ChannelsLast) && !x.is_contiguous();
}

Tensor gap_kernel_fwd(const Tensor& x, bool keepdim) {
  c10::cuda::CUDAGuard g(x.device());
  const int64_t n = x.size(0), c = x.size(1);
  Tensor out = keepdim ? at::empty({n, c, 1, 1}, x.options()) : at::empty({n, c}, x.options());
  check_launch(kt_global_avg_pool(dtype_of(x, "global_avg_pool"), x.data_ptr(), out.data_ptr(), n, c,
                                  x.size(2) * x.size(3), stream_of(out)),
               "global_avg_pool");
  return out;
}

Tensor global_avg_pool_fwd(const Tensor& x, c10::IntArrayRef dim, bool keepdim) {
  return gap_kernel_ok(x, dim) ? gap_kernel_fwd(x, keepdim) : at::mean(x, dim, keepdim);
}

struct GlobalAvgPoolFn : torch::autograd::Function<GlobalAvgPoolFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, bool keepdim) {
    at::AutoDispatchBelowADInplaceOrView g;
    ctx->saved_data["shape"] = x.sizes().vec();   // the backward needs x's shape, not x
    return gap_kernel_fwd(x, keepdim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const Tensor g = go[0].contiguous();
    c10::cuda::CUDAGuard guard(g.device());
    Tensor gx = at::empty(shape, g.options().memory_format(at::MemoryFormat::ChannelsLast));
    check_launch(kt_global_avg_pool_backward(dtype_of(g, "global_avg_pool"), g.data_ptr(), gx.data_ptr(), shape[0],
                                             shape[1], shape[2] * shape[3], stream_of(gx)),
                 "global_avg_pool backward");
    return {gx, Tensor()};
  }
};
Tensor global_avg_pool_autograd(const Tensor& x, c10::IntArrayRef dim, bool keepdim) {
  return gap_kernel_ok(x, dim) ? GlobalAvgPoolFn::apply(x, keepdim) : at::mean(x, dim, keepdim);
}

// ---- bias_cat: torch.cat([x_i + bias_i over dim -3], dim) ----
// The branches of an Inception block: their convolutions' biases and the concatenation
// in one kernel; the backward splits the gradient into dense per-part gradients (what
// cuDNN takes; a channel slice it copies, twice) and sums the bias gradients on the way
// (fusion/kernels/cat.cu). Parts are Conv2d outputs, (N, C, H, W) or, from an unbatched
// input, (C, H, W): the bias is over dim -3 and dim is torch.cat's. On CUDA for 4-D
// parts concatenated over their channels (dim 1 or -3), at most KT_CAT_MAX of them in
// fp32/fp16/bf16 sharing one layout (NCHW- or channels-last-contiguous); otherwise (the
// CPU, 3-D parts, another dim, mixed layouts, fake tensors) the bias adds and ATen's cat,
// whose results these equal.
void check_bias_cat(at::TensorList xs, at::TensorList bs) {
  TORCH_CHECK(!xs.empty() && xs.size() == bs.size(), "kitsune.bias_cat: need as many biases as parts (at least one), got ",
              xs.size(), " parts and ", bs.size(), " biases");
  for (size_t i = 0; i < xs.size(); i++) {
    const Tensor &x = xs[i], &b = bs[i];
    TORCH_CHECK((x.dim() == 3 || x.dim() == 4) && x.dim() == xs[0].dim() && b.dim() == 1 && b.size(0) == x.size(-3),
                "kitsune.bias_cat: part ", i, ": need x (N, C, H, W) or (C, H, W), as part 0, and bias (C,); got ",
                x.sizes(), " and ", b.sizes());
    TORCH_CHECK(at::isFloatingType(x.scalar_type()), "kitsune.bias_cat: part ", i, " must be floating point, got ",
                x.scalar_type());
    check_same(x, b, "bias_cat", "a part", "its bias");
    check_same(xs[0], x, "bias_cat", "part 0", ("part " + std::to_string(i)).c_str());
  }
}

// Whether dim (torch.cat's, wrapped) is the parts' channel dim -3.
bool channel_cat(at::TensorList xs, int64_t dim) { return xs[0].dim() == 4 && (dim == 1 || dim == -3); }

// The kernels' layout for the parts, or nullopt for ATen's path.
std::optional<at::MemoryFormat> bias_cat_format(at::TensorList xs, int64_t dim) {
  if (xs.size() > KT_CAT_MAX || !channel_cat(xs, dim)) return std::nullopt;
  const auto f = xs[0].suggest_memory_format();
  for (const Tensor& x : xs)
    if (!lt_dtype_ok(x) || x.suggest_memory_format() != f || !x.is_contiguous(f) || x.size(0) != xs[0].size(0) ||
        x.size(2) != xs[0].size(2) || x.size(3) != xs[0].size(3))
      return std::nullopt;
  return f;
}

kt_cat_parts cat_parts(at::TensorList parts, bool channels_last) {
  kt_cat_parts p{};
  p.k = (int)parts.size();
  for (int i = 0; i < p.k; i++) {
    p.data[i] = parts[i].data_ptr();
    p.c[i] = parts[i].size(1);
    p.off[i + 1] = p.off[i] + p.c[i];
  }
  p.n = parts[0].size(0), p.h = parts[0].size(2), p.w = parts[0].size(3);
  p.channels_last = channels_last;
  return p;
}

// out, and the layout the kernels ran in (nullopt: ATen's path), for the backward.
struct BiasCatOut {
  Tensor out;
  std::optional<at::MemoryFormat> format;
};
BiasCatOut bias_cat_impl(at::TensorList xs, at::TensorList bs, int64_t dim) {
  const auto f = bias_cat_format(xs, dim);
  if (!f) {
    std::vector<Tensor> ys;
    for (size_t i = 0; i < xs.size(); i++)
      ys.push_back(xs[i].dim() == 4 ? channel_bias_fwd(xs[i], bs[i], "none") : at::add(xs[i], bs[i].view({-1, 1, 1})));
    return {at::cat(ys, dim), f};
  }
  c10::cuda::CUDAGuard g(xs[0].device());
  std::vector<Tensor> bc;
  for (const Tensor& b : bs) bc.push_back(b.contiguous());
  kt_cat_parts p = cat_parts(xs, *f == at::MemoryFormat::ChannelsLast);
  for (int i = 0; i < p.k; i++) p.bias[i] = bc[i].data_ptr();
  Tensor out = at::empty({p.n, p.off[p.k], p.h, p.w}, xs[0].options().memory_format(*f));
  check_launch(kt_bias_cat(dtype_of(out, "bias_cat"), &p, out.data_ptr(), stream_of(out)), "bias_cat");
  return {out, f};
}
Tensor bias_cat_fwd(at::TensorList xs, at::TensorList bs, int64_t dim) {
  check_bias_cat(xs, bs);
  return bias_cat_impl(xs, bs, dim).out;
}

struct BiasCatFn : torch::autograd::Function<BiasCatFn> {
  static Tensor forward(AutogradContext* ctx, at::TensorList xs, at::TensorList bs, int64_t dim) {
    check_bias_cat(xs, bs);
    BiasCatOut r;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      r = bias_cat_impl(xs, bs, dim);
    }
    const int64_t d = at::maybe_wrap_dim(dim, r.out.dim());
    std::vector<int64_t> sizes;
    for (const Tensor& x : xs) sizes.push_back(x.size(d));
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["dim"] = d;
    ctx->saved_data["kernel"] = r.format.has_value();
    ctx->saved_data["cl"] = r.format == at::MemoryFormat::ChannelsLast;
    ctx->saved_data["bias_dtype"] = bs[0].scalar_type();
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t d = ctx->saved_data["dim"].toInt();
    const auto bt = ctx->saved_data["bias_dtype"].toScalarType();
    const size_t k = sizes.size();
    const Tensor& g = go[0];
    variable_list grads(2 * k + 1);
    if (!ctx->saved_data["kernel"].toBool()) {   // ATen's path: cat's narrow views, sums over all but dim -3
      const at::ScalarType acc = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      int64_t off = 0;
      for (size_t i = 0; i < k; off += sizes[i], i++) {
        grads[i] = g.narrow(d, off, sizes[i]);
        grads[k + i] = g.dim() == 4 ? channel_sum(grads[i], bt) : grads[i].sum({1, 2}, false, acc).to(bt);
      }
      return grads;
    }
    const bool cl = ctx->saved_data["cl"].toBool();
    const auto f = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    c10::cuda::CUDAGuard guard(g.device());
    for (size_t i = 0; i < k; i++)
      grads[i] = at::empty({g.size(0), sizes[i], g.size(2), g.size(3)}, g.options().memory_format(f));
    kt_cat_parts p = cat_parts(at::TensorList(grads.data(), k), cl);
    const int64_t ctot = p.off[p.k], rows = kt_bias_cat_partials(&p);
    TORCH_CHECK(rows >= 0, "kitsune.bias_cat backward: invalid parts");
    Tensor partial = at::empty({rows, ctot}, g.options().dtype(at::kFloat));
    const int64_t gs[4] = {g.stride(0), g.stride(1), g.stride(2), g.stride(3)};
    check_launch(kt_bias_cat_backward(dtype_of(g, "bias_cat"), g.data_ptr(), gs, &p, partial.data_ptr<float>(),
                                      stream_of(g)),
                 "bias_cat backward");
    Tensor sums = rows ? colsum(partial, at::kFloat) : at::zeros({ctot}, g.options().dtype(at::kFloat));
    for (size_t i = 0; i < k; i++) grads[k + i] = sums.narrow(0, p.off[i], sizes[i]).to(bt);
    return grads;
  }
};
Tensor bias_cat_autograd(at::TensorList xs, at::TensorList bs, int64_t dim) { return BiasCatFn::apply(xs, bs, dim); }

// kitsune.channel_sum (tests and benches): the bias gradient's sum over every dim but 1,
// in fp32 (fp64 for fp64 input).
Tensor channel_sum_op(const Tensor& g) {
  TORCH_CHECK(g.dim() >= 2, "kitsune.channel_sum: need (N, C, ...), got ", g.sizes());
  return channel_sum(g, g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

// cross_entropy. When the logits need a gradient, the forward forms it
// (cross_entropy_with_grad: the gradient for an incoming 1) and keeps it instead of
// the logits; the backward scales it by the incoming gradient in place
// (cross_entropy_rescale_, which writes nothing when that is 1), or, when the graph is
// kept for another backward, into a new tensor. Without a gradient to form (no grad
// mode, or logits that need none) the forward computes the loss alone and keeps the
// logits, and a backward goes through cross_entropy_backward.
struct CrossEntropyFn : torch::autograd::Function<CrossEntropyFn> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target, int64_t ignore,
                        double smoothing, bool float_loss, bool form_grad) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, int64_t, double, bool)>("kitsune::cross_entropy");
    static auto with_grad = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, int64_t, double, bool)>(
        "kitsune::cross_entropy_with_grad");
    ctx->saved_data["ignore"] = ignore;
    ctx->saved_data["smoothing"] = smoothing;
    at::AutoDispatchBelowADInplaceOrView g;
    if (form_grad) {
      auto [loss, grad] = with_grad.call(logits, target, ignore, smoothing, float_loss);
      ctx->save_for_backward({grad});   // one saved tensor: the backward knows the gradient was formed
      return loss;
    }
    ctx->save_for_backward({logits, target});
    return op.call(logits, target, ignore, smoothing, float_loss);
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, double)>(
        "kitsune::cross_entropy_backward");
    static auto rescale = op_handle<void(const Tensor&, const Tensor&)>("kitsune::cross_entropy_rescale_");
    auto s = ctx->get_saved_variables();
    // A backward that builds a graph (create_graph=True: grad mode is on here) would
    // differentiate a gradient formed in the forward as a constant: its second
    // derivative with respect to the logits would come out silently missing.
    TORCH_CHECK(s.size() == 2 || !at::GradMode::is_enabled(),
                "kitsune.cross_entropy has no double backward: its gradient is formed in the forward, so a backward "
                "with create_graph=True would treat it as a constant. For higher-order gradients use "
                "F.cross_entropy (compile_step(..., fuse_loss=False); outside kitsune.optimize's model)");
    Tensor grad;
    if (s.size() == 2) {   // logits and target: the loss alone was formed
      grad = op.call(go[0], s[0], s[1], ctx->saved_data["ignore"].toInt(), ctx->saved_data["smoothing"].toDouble());
    } else if (torch::autograd::get_current_graph_task_keep_graph()) {
      grad = s[0] * go[0];   // the saved gradient serves the next backward too
    } else {
      grad = s[0];   // released after this backward: ours to scale
      rescale.call(grad, go[0]);
    }
    return {grad, Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// sum_squared (which 0) and mean_abs (which 1): d/dx sum x^2 = 2x; d/dx mean |x| = sign(x) / n.
struct ReduceFn : torch::autograd::Function<ReduceFn> {
  using Sig = Tensor(const Tensor&, at::OptionalIntArrayRef, bool);
  static Tensor forward(AutogradContext* ctx, const Tensor& x, std::optional<std::vector<int64_t>> dim, bool keepdim,
                        int64_t which) {
    static auto ops = std::array{op_handle<Sig>("kitsune::sum_squared"), op_handle<Sig>("kitsune::mean_abs")};
    ctx->saved_data["which"] = which;
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView g;
    Tensor out = ops[which].call(x, dim ? at::OptionalIntArrayRef(*dim) : at::OptionalIntArrayRef(), keepdim);
    // the gradient's shape before broadcasting: the output with the reduced dims kept
    ctx->saved_data["kept"] = keepdim || x.dim() == 0 ? out.sizes().vec() : kept_shape(x, dim);
    return out;
  }
  static std::vector<int64_t> kept_shape(const Tensor& x, const std::optional<std::vector<int64_t>>& dim) {
    std::vector<int64_t> s = x.sizes().vec();
    if (!dim || dim->empty()) std::fill(s.begin(), s.end(), 1);
    else
      for (int64_t d : *dim) s[d < 0 ? d + x.dim() : d] = 1;
    return s;
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    const Tensor x = ctx->get_saved_variables()[0];
    auto kept = ctx->saved_data["kept"].toIntVector();
    Tensor g = go[0].reshape(kept);
    Tensor gx;
    if (ctx->saved_data["which"].toInt() == 0) {
      gx = 2 * x * g;
    } else {
      const int64_t n = g.numel() ? x.numel() / g.numel() : 1;
      gx = at::sign(x) * g / (double)std::max<int64_t>(n, 1);
    }
    return {gx, Tensor(), Tensor(), Tensor()};
  }
};

// gelu_dropout: (out, rng); the mask is rebuilt from rng in the backward.
struct GeluDropoutFn : torch::autograd::Function<GeluDropoutFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, double p, bool training, std::string approx) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, double, bool, c10::string_view)>(
        "kitsune::gelu_dropout");
    Tensor out, rng;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      std::tie(out, rng) = op.call(x, p, training, approx);
    }
    ctx->saved_data["p"] = training ? p : 0.0;
    ctx->saved_data["approximate"] = approx;
    ctx->save_for_backward({x, rng});
    ctx->mark_non_differentiable({rng});
    ctx->set_materialize_grads(false);   // else a zero-filled gradient for rng
    return {out, rng};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, double, c10::string_view)>(
        "kitsune::gelu_dropout_backward");
    auto s = ctx->get_saved_variables();
    Tensor g = go[0].defined() ? go[0] : at::zeros_like(s[0]);
    return {op.call(g, s[0], s[1], ctx->saved_data["p"].toDouble(), ctx->saved_data["approximate"].toStringRef()),
            Tensor(), Tensor(), Tensor()};
  }
};

// bias_dropout_add: out = residual + dropout(x + bias); (out, rng).
struct BiasDropoutAddFn : torch::autograd::Function<BiasDropoutAddFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& bias, const Tensor& residual,
                               double p, bool training) {
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double, bool)>(
        "kitsune::bias_dropout_add");
    Tensor out, rng;
    {
      at::AutoDispatchBelowADInplaceOrView g;
      std::tie(out, rng) = op.call(x, bias, residual, p, training);
    }
    ctx->saved_data["p"] = training ? p : 0.0;
    ctx->saved_data["nbias"] = bias.size(0);
    ctx->saved_data["bias_dtype"] = (int64_t)bias.scalar_type();
    ctx->save_for_backward({rng});
    ctx->mark_non_differentiable({rng});
    ctx->set_materialize_grads(false);   // else a zero-filled gradient for rng
    return {out, rng};
  }
  static variable_list backward(AutogradContext* ctx, variable_list go) {
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, double)>("kitsune::dropout_backward");
    if (!go[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    Tensor gx = op.call(go[0], ctx->get_saved_variables()[0], ctx->saved_data["p"].toDouble());
    auto bdt = (at::ScalarType)ctx->saved_data["bias_dtype"].toInt();
    Tensor gb = gx.reshape({-1, ctx->saved_data["nbias"].toInt()})
                    .sum(0, false, at::promote_types(gx.scalar_type(), at::kFloat))
                    .to(bdt);
    return {gx, gb, go[0], Tensor(), Tensor()};
  }
};

Tensor add_relu_autograd(const Tensor& a, const Tensor& b) { return AddReluFn::apply(a, b); }
Tensor cross_entropy_autograd(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing,
                              bool float_loss) {
  return CrossEntropyFn::apply(logits, target, ignore, smoothing, float_loss,
                               at::GradMode::is_enabled() && logits.requires_grad());
}
std::optional<std::vector<int64_t>> dims_vec(at::OptionalIntArrayRef dim) {
  return dim ? std::optional<std::vector<int64_t>>(dim->vec()) : std::nullopt;
}
Tensor sum_squared_autograd(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return ReduceFn::apply(x, dims_vec(dim), keepdim, 0);
}
Tensor mean_abs_autograd(const Tensor& x, at::OptionalIntArrayRef dim, bool keepdim) {
  return ReduceFn::apply(x, dims_vec(dim), keepdim, 1);
}
std::tuple<Tensor, Tensor> gelu_dropout_autograd(const Tensor& x, double p, bool training,
                                                 c10::string_view approximate) {
  auto out = GeluDropoutFn::apply(x, p, training, std::string(approximate));
  return {out[0], out[1]};
}
std::tuple<Tensor, Tensor> bias_dropout_add_autograd(const Tensor& x, const Tensor& bias, const Tensor& residual,
                                                     double p, bool training) {
  auto out = BiasDropoutAddFn::apply(x, bias, residual, p, training);
  return {out[0], out[1]};
}
Tensor mul_tanh_autograd(const Tensor& a, const Tensor& b) { return BinaryFn::apply(a, b, 0); }
Tensor swiglu_autograd(const Tensor& a, const Tensor& b) { return BinaryFn::apply(a, b, 1); }
Tensor bias_gelu_autograd(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
  return BiasGeluFn::apply(x, bias, std::string(approximate));
}
Tensor rms_norm_autograd(const Tensor& x, const Tensor& w, double eps) { return RmsNormFn::apply(x, w, eps); }
Tensor layer_norm_relu_autograd(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                                double eps) {
  return LayerNormReluFn::apply(x, shape.vec(), placeholder_if_absent(w, x), placeholder_if_absent(b, x),
                                present_bits(w, b), eps);
}
std::tuple<Tensor, Tensor> add_layer_norm_autograd(const Tensor& x, const Tensor& r, const OptTensor& w,
                                                   const OptTensor& b, double eps) {
  auto out = AddLayerNormFn::apply(x, r, placeholder_if_absent(w, x), placeholder_if_absent(b, x), present_bits(w, b),
                                   eps);
  return {out[0], out[1]};
}

// ---- autocast: torch.autocast regions ----
// Under autocast a Linear's output is bf16/fp16 while norm weights and biases stay
// fp32, which the kernels (one dtype per call) would refuse. These Autocast-key
// kernels cast, above autograd (so the casts are differentiable):
//   binary ops: both operands to their promoted dtype;
//   ops with parameters: the parameters (and a residual) to the activation's dtype;
//   linear_act: x, weight and bias to the autocast dtype (as F.linear);
//   linear_cross_entropy: x, weight and bias to the autocast dtype (as F.linear
//   would), the loss returned in fp32 (float_loss: the fp32 mean, as
//   F.cross_entropy's is under autocast).
//   cross_entropy: no cast (its kernel reads 16-bit logits in fp32 arithmetic), the
//   loss returned in fp32 (float_loss), as F.cross_entropy's under autocast.
// sum_squared and mean_abs take one floating tensor and need no cast;
// attention_score is composite and its baddbmm is cast by autocast itself.
template <c10::DispatchKey Key> struct Autocast {
  static Tensor cast(const Tensor& t, at::ScalarType dt) { return t.defined() && t.scalar_type() != dt ? t.to(dt) : t; }
  static OptTensor cast(const OptTensor& t, at::ScalarType dt) {
    return t && t->defined() ? OptTensor(cast(*t, dt)) : t;
  }
  template <const char* Name> static Tensor binary(const Tensor& a, const Tensor& b) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<BinarySig>(Name);
    auto dt = at::result_type(a, b);
    return op.call(cast(a, dt), cast(b, dt));
  }
  static Tensor bias_gelu(const Tensor& x, const Tensor& bias, c10::string_view approximate) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::bias_gelu");
    return op.call(x, cast(bias, x.scalar_type()), approximate);
  }
  static Tensor channel_bias(const Tensor& y, const Tensor& bias, c10::string_view act) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::string_view)>("kitsune::channel_bias");
    return op.call(y, cast(bias, y.scalar_type()), act);
  }
  static Tensor bias_relu_pool(const Tensor& y, const Tensor& bias, c10::IntArrayRef k) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, c10::IntArrayRef)>("kitsune::bias_relu_pool");
    return op.call(y, cast(bias, y.scalar_type()), k);
  }
  static Tensor bias_cat(at::TensorList xs, at::TensorList bs, int64_t dim) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(at::TensorList, at::TensorList, int64_t)>("kitsune::bias_cat");
    std::vector<Tensor> bc;
    for (size_t i = 0; i < bs.size(); i++) bc.push_back(i < xs.size() ? cast(bs[i], xs[i].scalar_type()) : bs[i]);
    return op.call(xs, bc, dim);
  }
  static Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, double)>("kitsune::rms_norm");
    return op.call(x, cast(w, x.scalar_type()), eps);
  }
  static Tensor layer_norm_relu(const Tensor& x, c10::IntArrayRef shape, const OptTensor& w, const OptTensor& b,
                                double eps) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, c10::IntArrayRef, const OptTensor&, const OptTensor&, double)>(
        "kitsune::layer_norm_relu");
    return op.call(x, shape, cast(w, x.scalar_type()), cast(b, x.scalar_type()), eps);
  }
  static std::tuple<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& r, const OptTensor& w,
                                                   const OptTensor& b, double eps) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                                          const OptTensor&, double)>("kitsune::add_layer_norm");
    auto dt = at::result_type(x, r);
    return op.call(cast(x, dt), cast(r, dt), cast(w, dt), cast(b, dt), eps);
  }
  static Tensor linear_act(const Tensor& x, const Tensor& w, const Tensor& b, c10::string_view act) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, c10::string_view)>(
        "kitsune::linear_act");
    auto dt = at::autocast::get_autocast_dtype(Key == c10::DispatchKey::AutocastCUDA ? at::kCUDA : at::kCPU);
    return op.call(cast(x, dt), cast(w, dt), cast(b, dt), act);   // as F.linear under autocast
  }
  static Tensor linear_cross_entropy(const Tensor& x, const Tensor& w, const Tensor& target, const OptTensor& bias,
                                     int64_t ignore, double smoothing, int64_t chunk, bool) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, int64_t, double,
                                      int64_t, bool)>("kitsune::linear_cross_entropy");
    auto dt = at::autocast::get_autocast_dtype(Key == c10::DispatchKey::AutocastCUDA ? at::kCUDA : at::kCPU);
    return op.call(cast(x, dt), cast(w, dt), target, cast(bias, dt), ignore, smoothing, chunk, true);
  }
  static Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore, double smoothing, bool) {
    c10::impl::ExcludeDispatchKeyGuard no(Key);
    static auto op = op_handle<Tensor(const Tensor&, const Tensor&, int64_t, double, bool)>("kitsune::cross_entropy");
    return op.call(logits, target, ignore, smoothing, true);
  }
};
constexpr char kAddRelu[] = "kitsune::add_relu", kMulTanh[] = "kitsune::mul_tanh", kSwiglu[] = "kitsune::swiglu";

}  // namespace

TORCH_LIBRARY(kitsune, m) {
  // A CPU tensor in page-locked memory from Kitsune's pinned pool (no tensor
  // inputs, so a catch-all kernel).
  m.def("pinned_empty(int[] size, ScalarType dtype) -> Tensor", &pinned_empty);
  m.def("add_relu(Tensor a, Tensor b) -> Tensor");
  m.def("add_relu_backward(Tensor grad, Tensor out) -> Tensor");
  m.def("mul_tanh(Tensor a, Tensor b) -> Tensor");
  m.def("mul_tanh_backward(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)");
  m.def("bias_gelu(Tensor x, Tensor bias, str approximate='none') -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias, str approximate='none') -> (Tensor, Tensor)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps=1e-6) -> (Tensor, Tensor)");
  m.def("layer_norm_relu(Tensor x, int[] normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-5) -> Tensor");
  m.def("layer_norm_relu_backward(Tensor grad, Tensor x, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor? weight=None, Tensor? bias=None, float eps=1e-5) -> (Tensor, Tensor)");
  m.def("add_layer_norm_backward(Tensor grad, Tensor? grad_sum, Tensor sum, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("cross_entropy(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, bool float_loss=False) -> Tensor");
  m.def("cross_entropy_backward(Tensor grad, Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0) -> Tensor");
  m.def("cross_entropy_with_grad(Tensor logits, Tensor target, int ignore_index=-100, float label_smoothing=0.0, bool float_loss=False) -> (Tensor, Tensor)");
  m.def("cross_entropy_rescale_(Tensor(a!) grad, Tensor by) -> ()");
  m.def("linear_cross_entropy(Tensor x, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, float label_smoothing=0.0, int chunk_size=0, bool float_loss=False) -> Tensor");
  m.def("linear_cross_entropy_grads(Tensor x, Tensor weight, Tensor target, Tensor? bias=None, int ignore_index=-100, float label_smoothing=0.0, int chunk_size=0, bool float_loss=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("sum_squared(Tensor x, int[1]? dim=None, bool keepdim=False) -> Tensor");
  m.def("mean_abs(Tensor x, int[1]? dim=None, bool keepdim=False) -> Tensor");
  m.def("attention_score(Tensor q, Tensor k, float? scale=None) -> Tensor");
  m.def("gelu_dropout(Tensor x, float p, bool training=True, str approximate='none') -> (Tensor, Tensor)");
  m.def("gelu_dropout_backward(Tensor grad, Tensor x, Tensor rng, float p, str approximate='none') -> Tensor");
  m.def("bias_dropout_add(Tensor x, Tensor bias, Tensor residual, float p, bool training=True) -> (Tensor, Tensor)");
  m.def("dropout_backward(Tensor grad, Tensor rng, float p) -> Tensor");
  m.def("dropout_mask(Tensor rng, int n, float p, ScalarType dtype=float) -> Tensor");
  m.def("adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled, float step) -> ()");
  m.def("adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] state_steps, float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled) -> ()");
  m.impl("adam_step_", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &adam_step));
  m.def("adam_capturable_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!) hyper, float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool count_step=True, Tensor? found_inf=None) -> ()");
  m.def("sgd_capturable_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor hyper, float momentum, float dampening, float weight_decay, bool nesterov, Tensor? found_inf=None) -> ()");
  m.def("optim_fusable(Tensor[] params, Tensor[] grads) -> bool");
  m.impl("optim_fusable", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &optim_fusable));
  m.def("sgd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, float lr, float momentum, float dampening, float weight_decay, bool nesterov, bool first) -> ()");
  m.def("batch_norm_relu(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("batch_norm_relu_backward(Tensor grad, Tensor x, Tensor out, Tensor? weight, Tensor save_mean, Tensor save_invstd, bool training) -> (Tensor, Tensor, Tensor)");
  m.def("batch_norm_add_relu(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("batch_norm_add_relu_backward(Tensor grad, Tensor x, Tensor out, Tensor? weight, Tensor save_mean, Tensor save_invstd, bool training) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("linear_act(Tensor x, Tensor weight, Tensor bias, str act='relu') -> Tensor");
  m.impl("linear_act", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &linear_act_fwd));
  m.def("channel_bias(Tensor y, Tensor bias, str act='none') -> Tensor");
  m.impl("channel_bias", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &channel_bias_fwd));
  m.def("bias_relu_pool(Tensor y, Tensor bias, int[] kernel_size) -> Tensor");
  m.impl("bias_relu_pool", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &bias_relu_pool_fwd));
  m.def("max_pool2d(Tensor x, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode) -> Tensor");
  m.impl("max_pool2d", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &max_pool2d_fwd));
  m.def("max_pool2d_where(Tensor x, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode) -> (Tensor, Tensor)");
  m.def("max_pool2d_backward_add(Tensor? grad, Tensor where, Tensor[] adds, int[] input_size, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode) -> Tensor");
  m.def("embedding(Tensor weight, Tensor indices, int padding_idx=-1) -> Tensor");
  m.impl("embedding", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &embedding_fwd));
  m.def("global_avg_pool(Tensor x, int[] dim, bool keepdim=False) -> Tensor");
  m.impl("global_avg_pool", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &global_avg_pool_fwd));
  m.def("bias_cat(Tensor[] xs, Tensor[] biases, int dim=1) -> Tensor");
  m.impl("bias_cat", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &bias_cat_fwd));
  m.def("channel_sum(Tensor g) -> Tensor");
  m.impl("channel_sum", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &channel_sum_op));
  m.impl("attention_score", torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, &attention_score));
}

// Ops with a CUDA kernel (NAME_cuda) and a CPU reference (NAME_cpu), one list so the
// two registrations cannot drift apart (the in-place optimizer steps are named apart).
#define KT_DEVICE_OPS(X) \
  X(add_relu) \
  X(add_relu_backward) \
  X(mul_tanh) \
  X(mul_tanh_backward) \
  X(bias_gelu) \
  X(bias_gelu_backward) \
  X(swiglu) \
  X(swiglu_backward) \
  X(rms_norm) \
  X(rms_norm_backward) \
  X(layer_norm_relu) \
  X(layer_norm_relu_backward) \
  X(add_layer_norm) \
  X(add_layer_norm_backward) \
  X(cross_entropy) \
  X(cross_entropy_backward) \
  X(cross_entropy_with_grad) \
  X(cross_entropy_rescale_) \
  X(linear_cross_entropy) \
  X(linear_cross_entropy_grads) \
  X(sum_squared) \
  X(mean_abs) \
  X(gelu_dropout) \
  X(gelu_dropout_backward) \
  X(bias_dropout_add) \
  X(dropout_backward) \
  X(batch_norm_relu) \
  X(batch_norm_relu_backward) \
  X(batch_norm_add_relu) \
  X(batch_norm_add_relu_backward) \
  X(max_pool2d_where) \
  X(max_pool2d_backward_add)

#define KT_IMPL_CUDA(name) m.impl(#name, &name##_cuda);
#define KT_IMPL_CPU(name) m.impl(#name, &name##_cpu);

TORCH_LIBRARY_IMPL(kitsune, CUDA, m) {
  KT_DEVICE_OPS(KT_IMPL_CUDA)
  m.impl("adam_", &adam_cuda);
  m.impl("sgd_", &sgd_cuda);
  m.impl("adam_capturable_", &adam_capturable_cuda);
  m.impl("sgd_capturable_", &sgd_capturable_cuda);
}

TORCH_LIBRARY_IMPL(kitsune, CPU, m) {
  KT_DEVICE_OPS(KT_IMPL_CPU)
  m.impl("adam_", &adam_cpu);
  m.impl("sgd_", &sgd_cpu);
  m.impl("adam_capturable_", &adam_capturable_cpu);
  m.impl("sgd_capturable_", &sgd_capturable_cpu);
  m.impl("dropout_mask", &dropout_mask);   // CPU only: rebuilds a dropout mask for checking
}

TORCH_LIBRARY_IMPL(kitsune, Autograd, m) {
  m.impl("add_relu", &add_relu_autograd);
  m.impl("mul_tanh", &mul_tanh_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("layer_norm_relu", &layer_norm_relu_autograd);
  m.impl("add_layer_norm", &add_layer_norm_autograd);
  m.impl("batch_norm_relu", &batch_norm_relu_autograd);
  m.impl("batch_norm_add_relu", &batch_norm_add_relu_autograd);
  m.impl("linear_act", &linear_act_autograd);
  m.impl("channel_bias", &channel_bias_autograd);
  m.impl("bias_relu_pool", &bias_relu_pool_autograd);
  m.impl("max_pool2d", &max_pool2d_autograd);
  m.impl("embedding", &embedding_autograd);
  m.impl("global_avg_pool", &global_avg_pool_autograd);
  m.impl("bias_cat", &bias_cat_autograd);
  m.impl("cross_entropy", &cross_entropy_autograd);
  m.impl("sum_squared", &sum_squared_autograd);
  m.impl("mean_abs", &mean_abs_autograd);
  m.impl("gelu_dropout", &gelu_dropout_autograd);
  m.impl("bias_dropout_add", &bias_dropout_add_autograd);
}

#define KT_AUTOCAST_IMPLS(KEY)                                                          \
  TORCH_LIBRARY_IMPL(kitsune, KEY, m) {                                                  \
    using A = Autocast<c10::DispatchKey::KEY>;                                           \
    m.impl("add_relu", &A::binary<kAddRelu>);                                            \
    m.impl("mul_tanh", &A::binary<kMulTanh>);                                            \
    m.impl("swiglu", &A::binary<kSwiglu>);                                               \
    m.impl("bias_gelu", &A::bias_gelu);                                                  \
    m.impl("channel_bias", &A::channel_bias);                                            \
    m.impl("bias_relu_pool", &A::bias_relu_pool);                                        \
    m.impl("bias_cat", &A::bias_cat);                                                    \
    m.impl("rms_norm", &A::rms_norm);                                                    \
    m.impl("layer_norm_relu", &A::layer_norm_relu);                                      \
    m.impl("add_layer_norm", &A::add_layer_norm);                                        \
    m.impl("linear_cross_entropy", &A::linear_cross_entropy);                            \
    m.impl("cross_entropy", &A::cross_entropy);                                          \
    m.impl("linear_act", &A::linear_act);                                                \
  }
KT_AUTOCAST_IMPLS(AutocastCUDA)
KT_AUTOCAST_IMPLS(AutocastCPU)

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

// ---- segments for a torch.cuda.MemPool (kitsune.allocator.use()) ----------------
// Without a global install, PyTorch's own caching allocator keeps managing blocks
// and asks a MemPool's allocator only for segments; these two functions, in the
// pluggable-allocator ABI, serve those segments from one Kitsune pool per device.
// PyTorch releases a segment only once no work uses it, so one stream (the NULL
// handle) stands for all.
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

extern "C" {

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
