// python/kitsune/csrc/blas.cpp — PyTorch's cuBLAS and cuBLASLt workspaces, as the
// allocator and compile_step see them: what a capture may allocate for them
// (blas_workspace_hint), and a stream sharing another's (kt_bridge_blas_share). C++
// because the workspaces are PyTorch's C++ maps of DataPtrs
// (at::cuda::cublas(lt)_handle_stream_to_workspace).
#include <ATen/cuda/CUDAContextLight.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <tuple>
#include <unordered_set>

#include "allocator.h"

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
namespace bridge {
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

// Bytes of cuBLAS and cuBLASLt workspaces a capture on `stream` may allocate on dev,
// whose pool is `pool`: the most that any stream holds now (PyTorch keys them by
// handle and stream; a warm-up made them on its streams), else the sizes PyTorch says
// it would choose, less what `stream` holds already (compile_step's capture stream
// holds its partner's: kt_bridge_blas_share). Called without the allocator's lock:
// PyTorch allocates a workspace while it holds its map's lock, and that allocation
// may need the allocator's.
size_t blas_workspace_hint(kt_pool_t* pool, c10::DeviceIndex dev, cudaStream_t stream) {
  std::map<void*, size_t> per_stream;
  for (auto* w : {&at::cuda::cublas_handle_stream_to_workspace(), &at::cuda::cublaslt_handle_stream_to_workspace()}) {
    std::shared_lock<std::shared_mutex> lock(w->mutex);
    for (auto& kv : w->map) {
      kt_block_info bi;
      if (kv.second.device().index() == dev && kt_block_query(pool, kv.second.get(), &bi) == KT_OK)
        per_stream[std::get<1>(kv.first)] += bi.size;
    }
  }
  size_t most = 0;
  for (auto& kv : per_stream) most = std::max(most, kv.second);
  if (!most) return at::cuda::getChosenWorkspaceSize() + at::cuda::getCUDABlasLtWorkspaceSize();
  size_t held = per_stream[static_cast<void*>(stream)];
  return most > held ? most - held : 0;
}

}  // namespace bridge

using namespace bridge;   // the C entry points below work on the bridge's objects

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

}  // extern "C"
