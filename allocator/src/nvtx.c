/* allocator/src/nvtx.c — NVTX annotations in the "kitsune" domain.
 *
 * Ranges mark the slow paths (segment reserve/release, empty_cache, OOM retry).
 * Each segment is registered as an NVTX memory heap (a sub-allocator's heap) and,
 * when a tool is attached, every block is registered as a region of it on alloc and unregistered on free,
 * so tools that read NVTX (Nsight, compute-sanitizer) see sub-allocations. Blocks are
 * registered exactly when a tool returned a heap handle for their segment: a tool
 * that treats a sub-allocator heap as inaccessible except for its regions (as
 * compute-sanitizer does) must see every block; without a tool the per-block calls
 * are skipped entirely. Some tools (compute-sanitizer) create no domains: then the
 * default domain is used.
 */
#include <stdlib.h>

#include "internal.h"

#ifdef KT_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtMem.h>

static nvtxDomainHandle_t domain;      /* one "kitsune" domain per process */
static pthread_once_t domain_once = PTHREAD_ONCE_INIT;
static void domain_make(void) { domain = nvtxDomainCreateA("kitsune"); }

void kt__nvtx_init(kt_pool_t *p) {
  pthread_once(&domain_once, domain_make);
  p->nvtx_domain = domain;   /* NULL (the default domain) when no tool handles domains */
  p->nvtx_regions = 0;       /* turned on by the first segment a tool registers as a heap */
}

void kt__nvtx_push(kt_pool_t *p, const char *name) {
  nvtxEventAttributes_t a = {0};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  nvtxDomainRangePushEx((nvtxDomainHandle_t)p->nvtx_domain, &a);
}

void kt__nvtx_pop(kt_pool_t *p) { nvtxDomainRangePop((nvtxDomainHandle_t)p->nvtx_domain); }

void *kt__nvtx_heap_register(kt_pool_t *p, uintptr_t base, size_t size) {
  nvtxMemVirtualRangeDesc_t r = {size, (const void *)base};
  nvtxMemHeapDesc_t d = {0};
  d.extCompatID = NVTX_EXT_COMPATID_MEM;
  d.structSize = sizeof d;
  d.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
  d.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  d.typeSpecificDescSize = sizeof r;
  d.typeSpecificDesc = &r;
  return (void *)nvtxMemHeapRegister((nvtxDomainHandle_t)p->nvtx_domain, &d);
}

void kt__nvtx_heap_unregister(kt_pool_t *p, void *heap) {
  if (heap) nvtxMemHeapUnregister((nvtxDomainHandle_t)p->nvtx_domain, (nvtxMemHeapHandle_t)heap);
}

void kt__nvtx_region(kt_pool_t *p, void *heap, uintptr_t addr, size_t size, int alive) {
  if (alive) {
    nvtxMemVirtualRangeDesc_t r = {size, (const void *)addr};
    nvtxMemRegionsRegisterBatch_t b = {0};
    b.extCompatID = NVTX_EXT_COMPATID_MEM;
    b.structSize = sizeof b;
    b.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    b.heap = (nvtxMemHeapHandle_t)heap;
    b.regionCount = 1;
    b.regionDescElementSize = sizeof r;
    b.regionDescElements = &r;
    nvtxMemRegionsRegister((nvtxDomainHandle_t)p->nvtx_domain, &b);
  } else {
    nvtxMemRegionRef_t ref;
    ref.pointer = (const void *)addr;
    nvtxMemRegionsUnregisterBatch_t b = {0};
    b.extCompatID = NVTX_EXT_COMPATID_MEM;
    b.structSize = sizeof b;
    b.refType = NVTX_MEM_REGION_REF_TYPE_POINTER;
    b.refCount = 1;
    b.refElementSize = sizeof ref;
    b.refElements = &ref;
    nvtxMemRegionsUnregister((nvtxDomainHandle_t)p->nvtx_domain, &b);
  }
}

#else  /* built without NVTX headers */
void kt__nvtx_init(kt_pool_t *p) { p->nvtx_domain = NULL; p->nvtx_regions = 0; }
void kt__nvtx_push(kt_pool_t *p, const char *name) { (void)p; (void)name; }
void kt__nvtx_pop(kt_pool_t *p) { (void)p; }
void *kt__nvtx_heap_register(kt_pool_t *p, uintptr_t base, size_t size) { (void)p; (void)base; (void)size; return NULL; }
void kt__nvtx_heap_unregister(kt_pool_t *p, void *heap) { (void)p; (void)heap; }
void kt__nvtx_region(kt_pool_t *p, void *heap, uintptr_t addr, size_t size, int alive) {
  (void)p; (void)heap; (void)addr; (void)size; (void)alive;
}
#endif
