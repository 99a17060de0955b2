/* allocator/backends/fake.c — a host backend that hands out addresses it never
 * touches. Reservations are placed first-fit in [2^36, 2^47) at 2 MiB alignment,
 * so released ranges are reused and the pool's radix stays small. Events complete
 * at once unless a test holds them; the test then completes them all at once.
 * Every call is counted so tests can prove the fast path never gets here.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kitsune/backend.h"

typedef struct range { uintptr_t base; size_t size; } range;

typedef struct fake {
  kt_backend vt;
  pthread_mutex_t mu;
  size_t capacity;
  int fail_next, fail_next_host, misalign_host, hold;
  uint64_t issued, completed;   /* event tickets */
  range *r;                     /* sorted by base */
  size_t n, cap;
  kt_fake_counts c;
} fake;

typedef struct fake_event { uint64_t ticket; } fake_event;

#define FAKE_BASE ((uintptr_t)1 << 36)
#define FAKE_END ((uintptr_t)1 << 47)

static kt_status f_reserve(void *ctx, int device, size_t size, void **out) {
  (void)device;
  fake *f = ctx;
  kt_status st = KT_OK;
  pthread_mutex_lock(&f->mu);
  if (f->fail_next > 0 || (f->capacity && f->c.reserved_bytes + size > f->capacity)) {
    if (f->fail_next > 0) f->fail_next--;
    f->c.failed_reserves++;
    st = KT_ERR_OOM;
    goto out;
  }
  if (f->n == f->cap) {
    size_t cap = f->cap ? 2 * f->cap : 64;
    range *nr = realloc(f->r, cap * sizeof *nr);
    if (!nr) { st = KT_ERR_BACKEND; goto out; }
    f->r = nr; f->cap = cap;
  }
  uintptr_t at = FAKE_BASE;
  size_t i = 0;
  for (; i < f->n; i++) {
    if (at + size <= f->r[i].base) break;
    at = f->r[i].base + f->r[i].size;
  }
  if (at + size > FAKE_END) { st = KT_ERR_OOM; f->c.failed_reserves++; goto out; }
  memmove(&f->r[i + 1], &f->r[i], (f->n - i) * sizeof *f->r);
  f->r[i] = (range){at, size};
  f->n++;
  f->c.reserves++;
  f->c.reserved_bytes += size;
  *out = (void *)at;
out:
  pthread_mutex_unlock(&f->mu);
  return st;
}

static kt_status f_release(void *ctx, int device, void *ptr, size_t size) {
  (void)device;
  fake *f = ctx;
  kt_status st = KT_ERR_INVALID;
  pthread_mutex_lock(&f->mu);
  for (size_t i = 0; i < f->n; i++) {
    if (f->r[i].base != (uintptr_t)ptr) continue;
    if (f->r[i].size != size) break;
    memmove(&f->r[i], &f->r[i + 1], (f->n - i - 1) * sizeof *f->r);
    f->n--;
    f->c.releases++;
    f->c.reserved_bytes -= size;
    st = KT_OK;
    break;
  }
  pthread_mutex_unlock(&f->mu);
  return st;
}

static kt_status f_event_create(void *ctx, int device, kt_event_t *out) {
  (void)device;
  fake *f = ctx;
  fake_event *e = calloc(1, sizeof *e);
  if (!e) return KT_ERR_BACKEND;
  pthread_mutex_lock(&f->mu);
  f->c.event_creates++; f->c.live_events++;
  pthread_mutex_unlock(&f->mu);
  *out = e;
  return KT_OK;
}

static kt_status f_event_destroy(void *ctx, int device, kt_event_t ev) {
  (void)device;
  fake *f = ctx;
  pthread_mutex_lock(&f->mu);
  f->c.event_destroys++; f->c.live_events--;
  pthread_mutex_unlock(&f->mu);
  free(ev);
  return KT_OK;
}

static kt_status f_event_record(void *ctx, int device, kt_event_t ev, kt_stream_t s) {
  (void)device; (void)s;
  fake *f = ctx;
  pthread_mutex_lock(&f->mu);
  f->c.event_records++;
  ((fake_event *)ev)->ticket = f->hold ? ++f->issued : 0;
  pthread_mutex_unlock(&f->mu);
  return KT_OK;
}

static kt_status f_event_query(void *ctx, int device, kt_event_t ev, int *done) {
  (void)device;
  fake *f = ctx;
  pthread_mutex_lock(&f->mu);
  f->c.event_queries++;
  *done = ((fake_event *)ev)->ticket <= f->completed;
  pthread_mutex_unlock(&f->mu);
  return KT_OK;
}

static kt_status f_synchronize(void *ctx, int device) {
  (void)device;
  fake *f = ctx;
  pthread_mutex_lock(&f->mu);
  f->c.syncs++;
  f->completed = f->issued;
  pthread_mutex_unlock(&f->mu);
  return KT_OK;
}

static kt_status f_mem_info(void *ctx, int device, size_t *free_b, size_t *total) {
  (void)device;
  fake *f = ctx;
  pthread_mutex_lock(&f->mu);
  size_t cap = f->capacity ? f->capacity : ((size_t)80 << 30);
  *total = cap;
  *free_b = cap > f->c.reserved_bytes ? cap - f->c.reserved_bytes : 0;
  pthread_mutex_unlock(&f->mu);
  return KT_OK;
}

/* Misaligned mode hands out base + 256 (as cudaHostAlloc may for odd sizes); the
 * word before the block remembers the base, a magic word marks it. */
#define FAKE_MISALIGN 256
#define FAKE_MAGIC 0x6b6974737566616bull

static kt_status f_host_alloc(void *ctx, size_t size, void **out) {
  fake *f = ctx;
  pthread_mutex_lock(&f->mu);
  int fail = f->fail_next_host > 0, mis = f->misalign_host;
  if (fail) { f->fail_next_host--; f->c.failed_host_allocs++; }
  pthread_mutex_unlock(&f->mu);
  void *base = NULL;
  if (fail || posix_memalign(&base, 4096, (size ? size : 1) + (mis ? FAKE_MISALIGN : 0)) != 0) return KT_ERR_OOM;
  *out = base;
  if (mis) {
    uint64_t *w = (uint64_t *)((char *)base + FAKE_MISALIGN);
    w[-1] = (uint64_t)(uintptr_t)base;
    w[-2] = FAKE_MAGIC;
    *out = w;
  }
  pthread_mutex_lock(&f->mu);
  f->c.host_allocs++;
  f->c.host_bytes += size;
  pthread_mutex_unlock(&f->mu);
  return KT_OK;
}

static kt_status f_host_free(void *ctx, void *ptr, size_t size) {
  fake *f = ctx;
  uint64_t *w = ptr;
  if (((uintptr_t)ptr & 4095) == FAKE_MISALIGN && w[-2] == FAKE_MAGIC) free((void *)(uintptr_t)w[-1]);
  else free(ptr);
  pthread_mutex_lock(&f->mu);
  f->c.host_frees++;
  f->c.host_bytes -= size;
  pthread_mutex_unlock(&f->mu);
  return KT_OK;
}

kt_backend *kt_fake_backend_create(size_t capacity) {
  fake *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  pthread_mutex_init(&f->mu, NULL);
  f->capacity = capacity;
  f->vt = (kt_backend){
      .name = "fake", .ctx = f, .reserve = f_reserve, .release = f_release,
      .event_create = f_event_create, .event_destroy = f_event_destroy, .event_record = f_event_record,
      .event_query = f_event_query, .synchronize = f_synchronize, .mem_info = f_mem_info,
      .host_alloc = f_host_alloc, .host_free = f_host_free};
  return &f->vt;
}

void kt_fake_backend_destroy(kt_backend *b) {
  if (!b) return;
  fake *f = b->ctx;
  pthread_mutex_destroy(&f->mu);
  free(f->r);
  free(f);
}

void kt_fake_get_counts(const kt_backend *b, kt_fake_counts *out) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  *out = f->c;
  pthread_mutex_unlock(&f->mu);
}

void kt_fake_set_capacity(kt_backend *b, size_t capacity) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  f->capacity = capacity;
  pthread_mutex_unlock(&f->mu);
}

void kt_fake_fail_next_reserves(kt_backend *b, int n) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  f->fail_next = n;
  pthread_mutex_unlock(&f->mu);
}

void kt_fake_fail_next_host_allocs(kt_backend *b, int n) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  f->fail_next_host = n;
  pthread_mutex_unlock(&f->mu);
}

void kt_fake_misalign_host(kt_backend *b, int on) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  f->misalign_host = on;
  pthread_mutex_unlock(&f->mu);
}

void kt_fake_hold_events(kt_backend *b, int hold) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  f->hold = hold;
  pthread_mutex_unlock(&f->mu);
}

void kt_fake_complete_events(kt_backend *b) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  f->completed = f->issued;
  pthread_mutex_unlock(&f->mu);
}

int kt_fake_owns(const kt_backend *b, const void *ptr, size_t size) {
  fake *f = b->ctx;
  int own = 0;
  pthread_mutex_lock(&f->mu);
  for (size_t i = 0; i < f->n; i++)
    if ((uintptr_t)ptr >= f->r[i].base && (uintptr_t)ptr + size <= f->r[i].base + f->r[i].size) { own = 1; break; }
  pthread_mutex_unlock(&f->mu);
  return own;
}
