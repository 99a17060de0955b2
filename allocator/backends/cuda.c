/* allocator/backends/cuda.c — segments from cudaMalloc, CUDA events.
 *
 * Built against the CUDA runtime linked statically (libcudart_static), which
 * loads the driver lazily: on a machine without a driver the library still
 * loads and every call returns KT_ERR_UNAVAILABLE / a zero device count. The
 * process never loads a second shared libcudart next to PyTorch's; stream and
 * event handles are driver objects shared by both runtimes.
 * Each call runs on the pool's device and restores the caller's current device.
 */
#include <cuda_runtime_api.h>

#include "kitsune/backend.h"

static kt_status map(cudaError_t e) {
  if (e == cudaSuccess) return KT_OK;
  cudaGetLastError();  /* clear the non-sticky error so later calls are not confused */
  if (e == cudaErrorMemoryAllocation) return KT_ERR_OOM;
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return KT_ERR_UNAVAILABLE;
  return KT_ERR_BACKEND;
}

/* Switch to device, remembering the caller's; returns the previous ordinal or -1. */
static int enter(int device, kt_status *st) {
  int cur = -1;
  *st = map(cudaGetDevice(&cur));
  if (*st == KT_OK && cur != device) *st = map(cudaSetDevice(device));
  return cur;
}
static void leave(int device, int prev) {
  if (prev >= 0 && prev != device) cudaSetDevice(prev);
}

static kt_status c_reserve(void *ctx, int device, size_t size, void **out) {
  (void)ctx;
  kt_status st;
  int prev = enter(device, &st);
  if (st == KT_OK) {
    /* A cudaMalloc while this thread captures a CUDA graph in global mode would
     * invalidate the capture; relaxed mode allows it (PyTorch's allocator does the
     * same). Outside a capture this changes nothing. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    st = map(cudaMalloc(out, size));
    cudaThreadExchangeStreamCaptureMode(&mode);
  }
  leave(device, prev);
  return st;
}

static kt_status c_release(void *ctx, int device, void *ptr, size_t size) {
  (void)ctx; (void)size;
  kt_status st;
  int prev = enter(device, &st);
  if (st == KT_OK) st = map(cudaFree(ptr));  /* synchronizes: safe with work in flight */
  leave(device, prev);
  return st;
}

static kt_status c_event_create(void *ctx, int device, kt_event_t *out) {
  (void)ctx;
  kt_status st;
  int prev = enter(device, &st);
  if (st == KT_OK) st = map(cudaEventCreateWithFlags((cudaEvent_t *)out, cudaEventDisableTiming));
  leave(device, prev);
  return st;
}

static kt_status c_event_destroy(void *ctx, int device, kt_event_t ev) {
  (void)ctx; (void)device;
  return map(cudaEventDestroy((cudaEvent_t)ev));
}

static kt_status c_event_record(void *ctx, int device, kt_event_t ev, kt_stream_t s) {
  (void)ctx;
  kt_status st;
  int prev = enter(device, &st);
  if (st == KT_OK) st = map(cudaEventRecord((cudaEvent_t)ev, (cudaStream_t)s));
  leave(device, prev);
  return st;
}

static kt_status c_event_query(void *ctx, int device, kt_event_t ev, int *done) {
  (void)ctx; (void)device;
  cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
  if (e == cudaErrorNotReady) { cudaGetLastError(); *done = 0; return KT_OK; }
  *done = e == cudaSuccess;
  return map(e);
}

static kt_status c_synchronize(void *ctx, int device) {
  (void)ctx;
  kt_status st;
  int prev = enter(device, &st);
  if (st == KT_OK) st = map(cudaDeviceSynchronize());
  leave(device, prev);
  return st;
}

static kt_status c_mem_info(void *ctx, int device, size_t *free_b, size_t *total) {
  (void)ctx;
  kt_status st;
  int prev = enter(device, &st);
  if (st == KT_OK) st = map(cudaMemGetInfo(free_b, total));
  leave(device, prev);
  return st;
}

/* Portable: the pages are pinned for every device's context, not only the current one. */
static kt_status c_host_alloc(void *ctx, size_t size, void **out) {
  (void)ctx;
  return map(cudaHostAlloc(out, size, cudaHostAllocPortable));
}

static kt_status c_host_free(void *ctx, void *ptr, size_t size) {
  (void)ctx; (void)size;
  return map(cudaFreeHost(ptr));
}

static const kt_backend cuda_backend = {
    .name = "cuda", .ctx = NULL, .reserve = c_reserve, .release = c_release,
    .event_create = c_event_create, .event_destroy = c_event_destroy, .event_record = c_event_record,
    .event_query = c_event_query, .synchronize = c_synchronize, .mem_info = c_mem_info,
    .host_alloc = c_host_alloc, .host_free = c_host_free};

const kt_backend *kt_cuda_backend(void) { return &cuda_backend; }

int kt_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
  return n;
}
