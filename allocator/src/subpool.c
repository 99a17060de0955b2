/* allocator/src/subpool.c — a backend that reserves segments from another pool.
 *
 * A pool on this backend (a CUDA graph's private pool, in the torch bridge) takes
 * its segments as large blocks of its parent, the device's pool, so the memory a
 * capture needs comes from what the parent already holds and no device allocation
 * happens while the capture runs. The blocks are allocated on a stream of their own
 * (the address of `token`): no eager stream's free list ever sees them, and the
 * parent hands them out only from ranges free for every stream.
 */
#include <stdlib.h>

#include "internal.h"

static char token;   /* the parent-side stream of every segment */

typedef struct sub_backend {
  kt_backend be;     /* first: the kt_backend* is the sub_backend* */
  kt_pool_t *parent;
} sub_backend;

static const kt_backend *pbe(void *ctx) { return ((sub_backend *)ctx)->parent->be; }
static int pdev(void *ctx) { return ((sub_backend *)ctx)->parent->device; }

static kt_status sub_reserve(void *ctx, int device, size_t size, void **out) {
  (void)device;
  return kt__alloc_nested(((sub_backend *)ctx)->parent, size, &token, out);
}

/* The contract of release: work enqueued before the call may still use the memory.
 * The parent would hand it to other streams at once, so wait for that work first. */
static kt_status sub_release(void *ctx, int device, void *ptr, size_t size) {
  (void)device;
  kt_status st = pbe(ctx)->synchronize(pbe(ctx)->ctx, pdev(ctx));
  if (st != KT_OK) return st;
  return kt_free_idle(((sub_backend *)ctx)->parent, ptr, size);
}

static kt_status sub_event_create(void *ctx, int device, kt_event_t *out) {
  (void)device;
  return pbe(ctx)->event_create(pbe(ctx)->ctx, pdev(ctx), out);
}
static kt_status sub_event_destroy(void *ctx, int device, kt_event_t ev) {
  (void)device;
  return pbe(ctx)->event_destroy(pbe(ctx)->ctx, pdev(ctx), ev);
}
static kt_status sub_event_record(void *ctx, int device, kt_event_t ev, kt_stream_t stream) {
  (void)device;
  return pbe(ctx)->event_record(pbe(ctx)->ctx, pdev(ctx), ev, stream);
}
static kt_status sub_event_query(void *ctx, int device, kt_event_t ev, int *done) {
  (void)device;
  return pbe(ctx)->event_query(pbe(ctx)->ctx, pdev(ctx), ev, done);
}
static kt_status sub_synchronize(void *ctx, int device) {
  (void)device;
  return pbe(ctx)->synchronize(pbe(ctx)->ctx, pdev(ctx));
}
static kt_status sub_mem_info(void *ctx, int device, size_t *free_bytes, size_t *total_bytes) {
  (void)device;
  if (!pbe(ctx)->mem_info) return KT_ERR_UNAVAILABLE;
  return pbe(ctx)->mem_info(pbe(ctx)->ctx, pdev(ctx), free_bytes, total_bytes);
}

kt_backend *kt_pool_backend_create(kt_pool_t *parent) {
  if (!parent) return NULL;
  sub_backend *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->parent = parent;
  b->be = (kt_backend){
      .name = "pool",
      .ctx = b,
      .reserve = sub_reserve,
      .release = sub_release,
      .event_create = sub_event_create,
      .event_destroy = sub_event_destroy,
      .event_record = sub_event_record,
      .event_query = sub_event_query,
      .synchronize = sub_synchronize,
      .mem_info = sub_mem_info,
      .reserve_quantum = KT_QUANTUM,   /* blocks of the parent: an arena holds its plan exactly */
  };
  return &b->be;
}

void kt_pool_backend_destroy(kt_backend *backend) { free(backend); }
