/* tests/c/nvtx_record.c — an NVTX injection library that records calls.
 * Load it with NVTX_INJECTION64_PATH=build/libnvtx_record.so; it appends one line
 * per call to the file named by KT_NVTX_RECORD:
 *   domain <name> | push <domain> <message> | pop <domain>
 *   heap_register <domain> <ptr> <size> | heap_unregister <domain> <ptr>
 *   region_register <domain> <ptr> <size> | region_unregister <domain> <ptr>
 * It implements the core module (domains, push/pop) and the memory extension. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtMem.h>

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static FILE *out;

typedef struct dom { char name[64]; } dom;
typedef struct heap { const void *ptr; } heap;

static void record(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void record(const char *fmt, ...) {
  pthread_mutex_lock(&mu);
  if (!out) {
    const char *path = getenv("KT_NVTX_RECORD");
    out = fopen(path ? path : "/dev/null", "a");
  }
  if (out) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(out, fmt, ap);
    va_end(ap);
    fputc('\n', out);
    fflush(out);
  }
  pthread_mutex_unlock(&mu);
}

static const char *dname(nvtxDomainHandle_t d) { return d ? ((dom *)d)->name : "(global)"; }

static nvtxDomainHandle_t NVTX_API domain_create(const char *name) {
  dom *d = calloc(1, sizeof *d);
  snprintf(d->name, sizeof d->name, "%s", name);
  record("domain %s", name);
  return (nvtxDomainHandle_t)d;
}
static int NVTX_API push_ex(nvtxDomainHandle_t d, const nvtxEventAttributes_t *a) {
  record("push %s %s", dname(d), a && a->messageType == NVTX_MESSAGE_TYPE_ASCII ? a->message.ascii : "?");
  return 0;
}
static int NVTX_API pop(nvtxDomainHandle_t d) { record("pop %s", dname(d)); return 0; }

static nvtxMemHeapHandle_t NVTX_API heap_register(nvtxDomainHandle_t d, const nvtxMemHeapDesc_t *desc) {
  const nvtxMemVirtualRangeDesc_t *r = desc->typeSpecificDesc;
  heap *h = calloc(1, sizeof *h);
  h->ptr = r->ptr;
  record("heap_register %s %p %zu usage=%u", dname(d), r->ptr, r->size, desc->usage);
  return (nvtxMemHeapHandle_t)h;
}
static void NVTX_API heap_unregister(nvtxDomainHandle_t d, nvtxMemHeapHandle_t h) {
  record("heap_unregister %s %p", dname(d), ((heap *)h)->ptr);
  free(h);
}
static void NVTX_API regions_register(nvtxDomainHandle_t d, const nvtxMemRegionsRegisterBatch_t *b) {
  const nvtxMemVirtualRangeDesc_t *r = b->regionDescElements;
  for (size_t i = 0; i < b->regionCount; i++)
    record("region_register %s %p %zu heap=%p", dname(d), r[i].ptr, r[i].size, b->heap ? ((heap *)b->heap)->ptr : NULL);
}
static void NVTX_API regions_unregister(nvtxDomainHandle_t d, const nvtxMemRegionsUnregisterBatch_t *b) {
  for (size_t i = 0; i < b->refCount; i++) record("region_unregister %s %p", dname(d), b->refElements[i].pointer);
}

int NVTX_API InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
  const NvtxExportTableCallbacks *cb = (const NvtxExportTableCallbacks *)get(NVTX_ETID_CALLBACKS);
  NvtxFunctionTable t = NULL;
  unsigned int n = 0;
  if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &t, &n) || n <= NVTX_CBID_CORE2_DomainCreateA) return 0;
  *t[NVTX_CBID_CORE2_DomainCreateA] = (NvtxFunctionPointer)domain_create;
  *t[NVTX_CBID_CORE2_DomainRangePushEx] = (NvtxFunctionPointer)push_ex;
  *t[NVTX_CBID_CORE2_DomainRangePop] = (NvtxFunctionPointer)pop;
  record("init core");
  return 1;
}

int NVTX_API InitializeInjectionNvtxExtension(nvtxExtModuleInfo_t *m) {
  if (m->moduleId != NVTX_EXT_MODULEID_MEM || m->segmentsCount < 1) return 0;
  intptr_t *slots = m->segments[0].functionSlots;
  size_t n = m->segments[0].slotCount;
  if (n <= NVTX3EXT_CBID_nvtxMemRegionsUnregister) return 0;
  slots[NVTX3EXT_CBID_nvtxMemHeapRegister] = (intptr_t)heap_register;
  slots[NVTX3EXT_CBID_nvtxMemHeapUnregister] = (intptr_t)heap_unregister;
  slots[NVTX3EXT_CBID_nvtxMemRegionsRegister] = (intptr_t)regions_register;
  slots[NVTX3EXT_CBID_nvtxMemRegionsUnregister] = (intptr_t)regions_unregister;
  record("init mem");
  return 1;
}
