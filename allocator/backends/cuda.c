/* allocator/backends/cuda.c — segments from cudaMalloc, granules mapped with the
 * driver's virtual memory calls, CUDA events.
 *
 * Built against the CUDA runtime linked statically (libcudart_static), which
 * loads the driver lazily: on a machine without a driver the library still
 * loads and every call returns KT_ERR_UNAVAILABLE / a zero device count. The
 * process never loads a second shared libcudart next to PyTorch's; stream and
 * event handles are driver objects shared by both runtimes.
 * Each call runs on the pool's device and restores the caller's current device.
 */
#include <cuda.h>              /* driver types only: the functions come through cudaGetDriverEntryPointByVersion */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <string.h>

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

/* ---- virtual memory: driver entry points, so there is no libcuda link ----------
 * One physical allocation a granule, its handle released as soon as it is mapped:
 * the mapping keeps the memory, and unmapping a granule frees it. */
typedef CUresult (*pf_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*pf_free)(CUdeviceptr, size_t);
typedef CUresult (*pf_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                              unsigned long long);
typedef CUresult (*pf_release)(CUmemGenericAllocationHandle);
typedef CUresult (*pf_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*pf_unmap)(CUdeviceptr, size_t);
typedef CUresult (*pf_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*pf_granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
typedef CUresult (*pf_device_get)(CUdevice *, int);
typedef CUresult (*pf_attribute)(int *, CUdevice_attribute, CUdevice);

static struct {
  pthread_once_t once;
  int ok;
  pf_reserve reserve; pf_free free; pf_create create; pf_release release;
  pf_map map; pf_unmap unmap; pf_access access; pf_granularity granularity; pf_device_get device_get;
  pf_attribute attribute;
} drv = {.once = PTHREAD_ONCE_INIT};

static void *entry(const char *name) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return NULL;
  }
  return fn;
}

static void load_driver(void) {
  drv.reserve = (pf_reserve)entry("cuMemAddressReserve");
  drv.free = (pf_free)entry("cuMemAddressFree");
  drv.create = (pf_create)entry("cuMemCreate");
  drv.release = (pf_release)entry("cuMemRelease");
  drv.map = (pf_map)entry("cuMemMap");
  drv.unmap = (pf_unmap)entry("cuMemUnmap");
  drv.access = (pf_access)entry("cuMemSetAccess");
  drv.granularity = (pf_granularity)entry("cuMemGetAllocationGranularity");
  drv.device_get = (pf_device_get)entry("cuDeviceGet");
  drv.attribute = (pf_attribute)entry("cuDeviceGetAttribute");
  drv.ok = drv.reserve && drv.free && drv.create && drv.release && drv.map && drv.unmap && drv.access &&
           drv.granularity && drv.device_get && drv.attribute;
}

static kt_status dmap(CUresult r) {
  if (r == CUDA_SUCCESS) return KT_OK;
  if (r == CUDA_ERROR_OUT_OF_MEMORY) return KT_ERR_OOM;
  if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_NO_DEVICE) return KT_ERR_UNAVAILABLE;
  return KT_ERR_BACKEND;
}

static CUmemAllocationProp device_prop(CUdevice dev) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  return prop;
}

/* Enters the device and checks the driver maps at KT_SEGMENT_ALIGN or finer. */
static kt_status vmm_enter(int device, int *prev, CUdevice *dev) {
  pthread_once(&drv.once, load_driver);
  kt_status st;
  *prev = enter(device, &st);
  if (st != KT_OK) return st;
  if (!drv.ok) return KT_ERR_UNAVAILABLE;
  if ((st = dmap(drv.device_get(dev, device))) != KT_OK) return st;
  int supported = 0;
  if (drv.attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, *dev) != CUDA_SUCCESS ||
      !supported)
    return KT_ERR_UNAVAILABLE;
  return KT_OK;
}

static kt_status c_va_reserve(void *ctx, int device, size_t size, void **out) {
  (void)ctx;
  int prev;
  CUdevice dev;
  kt_status st = vmm_enter(device, &prev, &dev);
  if (st == KT_OK) {
    CUmemAllocationProp prop = device_prop(dev);
    size_t g = 0;
    st = dmap(drv.granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (st == KT_OK && (!g || KT_SEGMENT_ALIGN % g)) st = KT_ERR_UNAVAILABLE;
  }
  if (st == KT_OK) {
    CUdeviceptr p = 0;
    st = dmap(drv.reserve(&p, size, KT_SEGMENT_ALIGN, 0, 0));
    if (st == KT_OK) *out = (void *)(uintptr_t)p;
  }
  leave(device, prev);
  return st;
}

static kt_status c_va_release(void *ctx, int device, void *ptr, size_t size) {
  (void)ctx; (void)device;
  pthread_once(&drv.once, load_driver);
  return drv.ok ? dmap(drv.free((CUdeviceptr)(uintptr_t)ptr, size)) : KT_ERR_UNAVAILABLE;
}

static void unmap_granules(CUdeviceptr base, size_t n) {
  for (size_t i = 0; i < n; i++) drv.unmap(base + i * KT_SEGMENT_ALIGN, KT_SEGMENT_ALIGN);
}

static kt_status c_map(void *ctx, int device, void *ptr, size_t size) {
  (void)ctx;
  int prev;
  CUdevice dev;
  kt_status st = vmm_enter(device, &prev, &dev);
  if (st != KT_OK) { leave(device, prev); return st; }
  /* allowed beside a CUDA graph capture in relaxed mode, as cudaMalloc is */
  enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  CUmemAllocationProp prop = device_prop(dev);
  CUdeviceptr base = (CUdeviceptr)(uintptr_t)ptr;
  size_t n = size / KT_SEGMENT_ALIGN, done = 0;
  for (; done < n && st == KT_OK; done++) {
    CUmemGenericAllocationHandle h;
    st = dmap(drv.create(&h, KT_SEGMENT_ALIGN, &prop, 0));
    if (st != KT_OK) break;
    st = dmap(drv.map(base + done * KT_SEGMENT_ALIGN, KT_SEGMENT_ALIGN, 0, h, 0));
    drv.release(h);   /* the mapping holds the memory from here */
    if (st != KT_OK) break;
  }
  if (st == KT_OK) {
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    st = dmap(drv.access(base, size, &acc, 1));
  }
  if (st != KT_OK) unmap_granules(base, done);   /* never touched: no work can use it */
  cudaThreadExchangeStreamCaptureMode(&mode);
  leave(device, prev);
  return st;
}

static kt_status c_unmap(void *ctx, int device, void *ptr, size_t size) {
  (void)ctx;
  kt_status st;
  int prev = enter(device, &st);
  if (st == KT_OK) {
    CUdeviceptr base = (CUdeviceptr)(uintptr_t)ptr;
    for (size_t i = 0; i < size / KT_SEGMENT_ALIGN; i++) {   /* every granule tried; the first error kept */
      kt_status e = dmap(drv.unmap(base + i * KT_SEGMENT_ALIGN, KT_SEGMENT_ALIGN));
      if (st == KT_OK) st = e;
    }
  }
  leave(device, prev);
  return st;
}

static const kt_backend cuda_backend = {
    .name = "cuda", .ctx = NULL, .reserve = c_reserve, .release = c_release,
    .event_create = c_event_create, .event_destroy = c_event_destroy, .event_record = c_event_record,
    .event_query = c_event_query, .synchronize = c_synchronize, .mem_info = c_mem_info,
    .host_alloc = c_host_alloc, .host_free = c_host_free,
    .va_reserve = c_va_reserve, .va_release = c_va_release, .map = c_map, .unmap = c_unmap};

const kt_backend *kt_cuda_backend(void) { return &cuda_backend; }

int kt_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); return 0; }
  return n;
}
