/* allocator/backends/fake.c — a host backend that hands out addresses it never
 * touches. Reservations are placed first-fit in [2^36, 2^47) at 2 MiB alignment,
 * so released ranges are reused and the pool's radix stays small. Events complete
 * at once unless a test holds them; the test then completes them all at once.
 * Every call is counted so tests can prove the fast path never gets here.
 */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kitsune/backend.h"

/* A segment (g == NULL) or a reserved address range with one byte a granule
 * (1: mapped). */
typedef struct range { uintptr_t base; size_t size; uint8_t *g; } range;

typedef struct fake {
  kt_backend vt;
  pthread_mutex_t mu;
  size_t capacity;
  int fail_next, fail_next_host, misalign_host, hold;
  int dirty;                    /* a map or an event record since the last synchronize */
  uint64_t unsynced_unmaps;
  uint64_t issued, completed;   /* event tickets */
  range *r;                     /* sorted by base */
  size_t n, cap;
  kt_fake_counts c;
} fake;

typedef struct fake_event { uint64_t ticket; } fake_event;

#define FAKE_BASE ((uintptr_t)1 << 36)
#define FAKE_END ((uintptr_t)1 << 47)

/* First fit in [FAKE_BASE, FAKE_END) at 2 MiB alignment; under f->mu. */
static kt_status place(fake *f, size_t size, uint8_t *g, void **out) {
  if (f->n == f->cap) {
    size_t cap = f->cap ? 2 * f->cap : 64;
    range *nr = realloc(f->r, cap * sizeof *nr);
    if (!nr) return KT_ERR_BACKEND;
    f->r = nr; f->cap = cap;
  }
  uintptr_t at = FAKE_BASE;
  size_t i = 0;
  for (; i < f->n; i++) {
    if (at + size <= f->r[i].base) break;
    at = f->r[i].base + f->r[i].size;
  }
  if (at + size > FAKE_END) return KT_ERR_OOM;
  memmove(&f->r[i + 1], &f->r[i], (f->n - i) * sizeof *f->r);
  f->r[i] = (range){at, size, g};
  f->n++;
  *out = (void *)at;
  return KT_OK;
}

/* An injected failure or no room for size more bytes of memory; under f->mu. */
static bool refuse(fake *f, size_t size) {
  if (f->fail_next > 0 || (f->capacity && f->c.reserved_bytes + size > f->capacity)) {
    if (f->fail_next > 0) f->fail_next--;
    f->c.failed_reserves++;
    return true;
  }
  return false;
}

static kt_status f_reserve(void *ctx, int device, size_t size, void **out) {
  (void)device;
  fake *f = ctx;
  kt_status st = KT_ERR_OOM;
  pthread_mutex_lock(&f->mu);
  if (!refuse(f, size)) {
    st = place(f, size, NULL, out);
    if (st == KT_ERR_OOM) f->c.failed_reserves++;   /* no address space left */
  }
  if (st == KT_OK) {
    f->c.reserves++;
    f->c.reserved_bytes += size;
  }
  pthread_mutex_unlock(&f->mu);
  return st;
}

/* The range ptr starts, of the kind asked for (segment or address range); under f->mu. */
static range *find_start(fake *f, const void *ptr, bool va, size_t *index) {
  for (size_t i = 0; i < f->n; i++)
    if (f->r[i].base == (uintptr_t)ptr && (f->r[i].g != NULL) == va) { *index = i; return &f->r[i]; }
  return NULL;
}

static void drop(fake *f, size_t i) {
  free(f->r[i].g);
  memmove(&f->r[i], &f->r[i + 1], (f->n - i - 1) * sizeof *f->r);
  f->n--;
}

/* Releases the segment (va false) or address range (va true) ptr starts, of exactly
 * size bytes; an address range must have nothing mapped. */
static kt_status release_range(fake *f, void *ptr, size_t size, bool va) {
  kt_status st = KT_ERR_INVALID;
  pthread_mutex_lock(&f->mu);
  size_t i;
  range *r = find_start(f, ptr, va, &i);
  if (r && r->size == size && (!va || !memchr(r->g, 1, size / KT_SEGMENT_ALIGN))) {
    drop(f, i);
    if (va) { f->c.va_releases++; f->c.va_bytes -= size; }
    else { f->c.releases++; f->c.reserved_bytes -= size; }
    st = KT_OK;
  }
  pthread_mutex_unlock(&f->mu);
  return st;
}

static kt_status f_release(void *ctx, int device, void *ptr, size_t size) {
  (void)device;
  return release_range(ctx, ptr, size, false);
}

#define GRANULE KT_SEGMENT_ALIGN

static kt_status f_va_reserve(void *ctx, int device, size_t size, void **out) {
  (void)device;
  fake *f = ctx;
  if (!size || size % GRANULE) return KT_ERR_INVALID;
  uint8_t *g = calloc(size / GRANULE, 1);
  if (!g) return KT_ERR_BACKEND;
  pthread_mutex_lock(&f->mu);
  kt_status st = place(f, size, g, out);
  if (st == KT_OK) { f->c.va_reserves++; f->c.va_bytes += size; }
  pthread_mutex_unlock(&f->mu);
  if (st != KT_OK) free(g);
  return st;
}

static kt_status f_va_release(void *ctx, int device, void *ptr, size_t size) {
  (void)device;
  return release_range(ctx, ptr, size, true);
}

/* The address range holding [ptr, ptr+size), granule-aligned; under f->mu. */
static range *va_holding(fake *f, const void *ptr, size_t size) {
  uintptr_t a = (uintptr_t)ptr;
  if (!size || a % GRANULE || size % GRANULE) return NULL;
  for (size_t i = 0; i < f->n; i++)
    if (f->r[i].g && a >= f->r[i].base && a + size <= f->r[i].base + f->r[i].size) return &f->r[i];
  return NULL;
}

/* Every granule of [first, first+n) of r in state want? */
static bool granules_are(const range *r, size_t first, size_t n, uint8_t want) {
  for (size_t k = first; k < first + n; k++)
    if (r->g[k] != want) return false;
  return true;
}

/* Maps (map = 1) or unmaps granules of [ptr, ptr+size): every one must be in the
 * other state; a map may be refused like a reserve. */
static kt_status set_mapped(fake *f, void *ptr, size_t size, uint8_t map) {
  kt_status st = KT_ERR_INVALID;
  pthread_mutex_lock(&f->mu);
  range *r = va_holding(f, ptr, size);
  size_t first = r ? ((uintptr_t)ptr - r->base) / GRANULE : 0, n = size / GRANULE;
  if (r && granules_are(r, first, n, !map)) {
    st = map && refuse(f, size) ? KT_ERR_OOM : KT_OK;
    if (st == KT_OK) {
      memset(r->g + first, map, n);
      if (map) {
        f->c.maps++;
        f->c.mapped_bytes += size;
        f->c.reserved_bytes += size;
        f->dirty = 1;
      } else {
        f->c.unmaps++;
        f->c.mapped_bytes -= size;
        f->c.reserved_bytes -= size;
        if (f->dirty) f->unsynced_unmaps++;
      }
    }
  }
  pthread_mutex_unlock(&f->mu);
  return st;
}

static kt_status f_map(void *ctx, int device, void *ptr, size_t size) {
  (void)device;
  return set_mapped(ctx, ptr, size, 1);
}

static kt_status f_unmap(void *ctx, int device, void *ptr, size_t size) {
  (void)device;
  return set_mapped(ctx, ptr, size, 0);
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
  f->dirty = 1;
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
  f->dirty = 0;
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
  kt_backend *b = kt_fake_backend_create_novmm(capacity);
  if (b) {
    b->va_reserve = f_va_reserve; b->va_release = f_va_release;
    b->map = f_map; b->unmap = f_unmap;
  }
  return b;
}

kt_backend *kt_fake_backend_create_novmm(size_t capacity) {
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
  for (size_t i = 0; i < f->n; i++) free(f->r[i].g);
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
  uintptr_t a = (uintptr_t)ptr;
  for (size_t i = 0; i < f->n; i++) {
    const range *r = &f->r[i];
    if (a < r->base || a + size > r->base + r->size) continue;
    if (!r->g) { own = 1; break; }
    size_t first = (a - r->base) / GRANULE, last = (a + (size ? size : 1) - 1 - r->base) / GRANULE;
    own = granules_are(r, first, last - first + 1, 1);
    break;
  }
  pthread_mutex_unlock(&f->mu);
  return own;
}

uint64_t kt_fake_unsynced_unmaps(const kt_backend *b) {
  fake *f = b->ctx;
  pthread_mutex_lock(&f->mu);
  uint64_t n = f->unsynced_unmaps;
  pthread_mutex_unlock(&f->mu);
  return n;
}
