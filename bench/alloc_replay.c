/* bench/alloc_replay.c — replays an allocation trace against the allocator.
 *
 *   alloc_replay TRACE.csv [--backend fake|cuda] [--repeat R] [--json FILE] [--vmm] [--passes P]
 *                [--release-on-grow 0|1|2]
 *
 * TRACE is what kt_trace_start / kitsune.allocator.trace() record:
 *   thread,time_ns,action,ptr,size,stream
 * Events are replayed in file order on one thread; recorded pointers map to the new
 * ones, recorded streams to fake handles or to fresh CUDA streams. Prints ns/op and
 * peak reserved / peak live (live = sum of requested sizes of live blocks), and what
 * is reserved and live when the trace ends (for a trace that ends with an empty_cache,
 * as bench/graph_memory.py's do: the cache the pool cannot give back). --vmm: the pool maps granules of one range, as the torch
 * bridge's device pool does on one GPU. With --vmm the end state is also split by 2 MiB
 * granule: how many granules the live blocks touch and how full they are (the cache
 * that fragmentation pins), and how much is reserved beyond them (free granules kept).
 * --passes P replays the trace P times on one pool (blocks still live at the end of a
 * pass are freed first), so passes after the first show the warmed-up pool; on the fake
 * backend each pass prints the backend calls it made per allocation, and the first pass
 * its two halves (by allocation) too. ns/op and peaks are over all passes.
 * --release-on-grow sets kt_pool_options.release_on_grow (default 1, KT_RELEASE_SEGMENTS;
 * 2 is KT_RELEASE_FOLLOW_PEAK).
 */
#include "bench_common.h"

typedef struct ev { uint64_t ptr, stream; size_t size; char action; } ev;  /* a f r e */

/* open-addressing map: recorded pointer -> slot in the live table */
typedef struct map { uint64_t *key; void **val; size_t *size; size_t cap, n; } map;

static size_t hash(uint64_t k, size_t cap) { return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 20) & (cap - 1); }

static void map_put(map *m, uint64_t k, void *v, size_t size) {
  if (2 * (m->n + 1) > m->cap) {
    map old = *m;
    m->cap = old.cap ? 2 * old.cap : 1024;
    m->key = calloc(m->cap, sizeof *m->key); m->val = calloc(m->cap, sizeof *m->val); m->size = calloc(m->cap, sizeof *m->size);
    m->n = 0;
    for (size_t i = 0; i < old.cap; i++) if (old.key[i]) map_put(m, old.key[i], old.val[i], old.size[i]);
    free(old.key); free(old.val); free(old.size);
  }
  size_t i = hash(k, m->cap);
  while (m->key[i] && m->key[i] != k) i = (i + 1) & (m->cap - 1);
  if (!m->key[i]) m->n++;
  m->key[i] = k; m->val[i] = v; m->size[i] = size;
}

static long map_find(map *m, uint64_t k) {
  if (!m->cap) return -1;
  for (size_t i = hash(k, m->cap); m->key[i]; i = (i + 1) & (m->cap - 1)) if (m->key[i] == k) return (long)i;
  return -1;
}

/* Live bytes a granule: one piece per (block, granule) it touches, summed by granule. */
typedef struct piece { uint64_t g; size_t bytes; } piece;

static int piece_cmp(const void *a, const void *b) {
  const piece *x = a, *y = b;
  return x->g < y->g ? -1 : x->g > y->g;
}

/* The live blocks' granules at the end: touched granules, live bytes in them, and those
 * under a quarter full (their live bytes and blocks). */
typedef struct granules { size_t touched, live, sparse, sparse_live, sparse_blocks; } granules;

static granules granule_split(void **ptr, size_t *size, uint64_t *key, size_t cap) {
  const uint64_t G = KT_SEGMENT_ALIGN;
  size_t n = 0, k = 0;
  for (size_t i = 0; i < cap; i++)
    if (key[i] && size[i]) n += (size_t)((((uintptr_t)ptr[i] + size[i] - 1) / G) - ((uintptr_t)ptr[i] / G) + 1);
  piece *pc = malloc((n ? n : 1) * sizeof *pc);
  uint64_t *owner_g = malloc((n ? n : 1) * sizeof *owner_g);   /* the granule each block starts in */
  size_t nb = 0;
  for (size_t i = 0; i < cap; i++) {
    if (!key[i] || !size[i]) continue;
    uintptr_t a = (uintptr_t)ptr[i], b = a + size[i];
    owner_g[nb++] = a / G;
    for (uintptr_t g = a / G; g * G < b; g++) {
      uintptr_t lo = a > g * G ? a : g * G, hi = b < (g + 1) * G ? b : (g + 1) * G;
      pc[k++] = (piece){g, hi - lo};
    }
  }
  qsort(pc, k, sizeof *pc, piece_cmp);
  granules r = {0};
  for (size_t i = 0; i < k;) {
    size_t j = i, bytes = 0;
    for (; j < k && pc[j].g == pc[i].g; j++) bytes += pc[j].bytes;
    r.touched++;
    r.live += bytes;
    if (bytes < G / 4) {
      r.sparse++;
      r.sparse_live += bytes;
      for (size_t q = 0; q < nb; q++) r.sparse_blocks += owner_g[q] == pc[i].g;
    }
    i = j;
  }
  free(pc);
  free(owner_g);
  return r;
}

/* Backend calls between two snapshots of the fake's counters. */
typedef struct calls {
  uint64_t reserves, releases, va_reserves, maps, unmaps, syncs, ev_creates, ev_records, ev_queries;
  int64_t reserved_total;   /* bytes the pool ever reserved or mapped (its stats) */
} calls;

static calls calls_now(const kt_backend *be, kt_pool_t *pool) {
  calls c = {0};
  if (strcmp(be->name, "fake")) return c;
  kt_fake_counts k;
  kt_fake_get_counts(be, &k);
  kt_stats st;
  kt_get_stats(pool, &st);
  c = (calls){k.reserves, k.releases, k.va_reserves, k.maps, k.unmaps, k.syncs, k.event_creates, k.event_records,
              k.event_queries, st.reserved_bytes.allocated};
  return c;
}

static void calls_print(const char *what, calls a, calls b, long allocs) {
  double n = allocs ? (double)allocs : 1;
  uint64_t total = (b.reserves - a.reserves) + (b.releases - a.releases) + (b.va_reserves - a.va_reserves) +
                   (b.maps - a.maps) + (b.unmaps - a.unmaps) + (b.syncs - a.syncs) + (b.ev_creates - a.ev_creates) +
                   (b.ev_records - a.ev_records) + (b.ev_queries - a.ev_queries);
  printf("  %s: %ld allocs, backend calls %llu (%.4f per alloc): reserve %llu, release %llu, va_reserve %llu, "
         "map %llu, unmap %llu, synchronize %llu, event create %llu record %llu query %llu; %.0f MiB reserved or mapped\n",
         what, allocs, (unsigned long long)total, (double)total / n, (unsigned long long)(b.reserves - a.reserves),
         (unsigned long long)(b.releases - a.releases), (unsigned long long)(b.va_reserves - a.va_reserves),
         (unsigned long long)(b.maps - a.maps), (unsigned long long)(b.unmaps - a.unmaps),
         (unsigned long long)(b.syncs - a.syncs), (unsigned long long)(b.ev_creates - a.ev_creates),
         (unsigned long long)(b.ev_records - a.ev_records), (unsigned long long)(b.ev_queries - a.ev_queries),
         (double)(b.reserved_total - a.reserved_total) / 1048576.0);
}

static void map_del(map *m, size_t i) {   /* backward-shift deletion */
  m->key[i] = 0; m->n--;
  for (size_t j = (i + 1) & (m->cap - 1); m->key[j]; j = (j + 1) & (m->cap - 1)) {
    uint64_t k = m->key[j]; void *v = m->val[j]; size_t s = m->size[j];
    m->key[j] = 0; m->n--;
    map_put(m, k, v, s);
  }
}

int main(int argc, char **argv) {
  const char *path = NULL, *backend = "fake", *json = NULL;
  int repeat = 1, vmm = 0, passes = 1, release = KT_RELEASE_SEGMENTS;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
    else if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!strcmp(argv[i], "--vmm")) vmm = 1;
    else if (!strcmp(argv[i], "--passes") && i + 1 < argc && atoi(argv[i + 1]) > 0) passes = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--release-on-grow") && i + 1 < argc) release = atoi(argv[++i]);
    else if (!path && argv[i][0] != '-') path = argv[i];
    else { fprintf(stderr, "usage: %s TRACE.csv [--backend fake|cuda] [--repeat R] [--json FILE] [--vmm] [--passes P] [--release-on-grow 0|1|2]\n", argv[0]); return 2; }
  }
  if (!path) { fprintf(stderr, "usage: %s TRACE.csv [--backend fake|cuda] [--repeat R] [--json FILE] [--vmm] [--passes P] [--release-on-grow 0|1|2]\n", argv[0]); return 2; }
  FILE *f = fopen(path, "r");
  if (!f) { fprintf(stderr, "cannot read %s\n", path); return 1; }
  size_t cap = 1 << 16, n = 0;
  ev *evs = malloc(cap * sizeof *evs);
  char line[512];
  long lineno = 0;
  uint64_t streams[64];
  int nstreams = 0;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    if (lineno == 1 && !strncmp(line, "thread,", 7)) continue;
    long tid; unsigned long long t, ptr, stream; size_t size; char action[32];
    if (sscanf(line, "%ld,%llu,%31[^,],%llx,%zu,%llx", &tid, &t, action, &ptr, &size, &stream) != 6) {
      fprintf(stderr, "%s:%ld: not a trace line: %s", path, lineno, line);
      return 1;
    }
    char a = !strcmp(action, "alloc") ? 'a' : !strcmp(action, "free") ? 'f' : !strcmp(action, "record_stream") ? 'r'
           : !strcmp(action, "empty_cache") ? 'e' : 0;
    if (!a) continue;   /* oom and future actions: not replayed */
    if (n == cap) evs = realloc(evs, (cap *= 2) * sizeof *evs);
    evs[n++] = (ev){ptr, stream, size, a};
    int known = 0;
    for (int i = 0; i < nstreams; i++) known |= streams[i] == stream;
    if (!known && a != 'e') {
      if (nstreams == 64) { fprintf(stderr, "more than 64 streams in the trace\n"); return 1; }
      streams[nstreams++] = stream;
    }
  }
  fclose(f);
  char device[256], date[32];
  const kt_backend *be = bench_backend(backend, device, sizeof device);
  if (!be) return 1;
  iso_date(date, sizeof date);
  kt_stream_t mapped[64];
  for (int i = 0; i < nstreams; i++) {
    if (!strcmp(be->name, "cuda") && streams[i]) {
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      mapped[i] = s;
    } else {
      mapped[i] = (kt_stream_t)(uintptr_t)streams[i];
    }
  }
  double best = 1e30;
  size_t peak_reserved = 0, peak_live = 0, end_reserved = 0, end_live = 0;
  granules end_g = {0};
  long ops = 0, missing = 0;
  for (int r = 0; r < repeat; r++) {
    kt_pool_options o;
    kt_pool_options_default(&o);
    o.vmm = vmm;
    o.release_on_grow = release;
    kt_pool_t *pool;
    if (kt_pool_create(&o, be, &pool) != KT_OK) return 1;
    map m = {0};
    size_t live = 0;
    peak_live = 0; ops = 0; missing = 0;
    long nallocs = 0;
    for (size_t i = 0; i < n; i++) nallocs += evs[i].action == 'a';
    double dt = 0;   /* the passes' time, without the printing between them */
    for (int pass = 0; pass < passes; pass++) {
      calls c0 = calls_now(be, pool), chalf = c0;
      long allocs = 0;
      double tp = now_s();
      for (size_t i = 0; i < n; i++) {
        ev *e = &evs[i];
        kt_stream_t s = NULL;
        for (int k = 0; k < nstreams; k++) if (streams[k] == e->stream) { s = mapped[k]; break; }
        if (e->action == 'a') {
          void *p;
          if (allocs == nallocs / 2) chalf = calls_now(be, pool);
          allocs++;
          if (kt_alloc(pool, e->size, s, &p) != KT_OK) { fprintf(stderr, "replay: allocation of %zu failed\n", e->size); return 1; }
          if (p) map_put(&m, e->ptr, p, e->size);
          live += e->size;
          if (live > peak_live) peak_live = live;
        } else if (e->action == 'f') {
          long k = map_find(&m, e->ptr);
          if (k < 0) { missing++; continue; }   /* allocated before the trace started */
          kt_free(pool, m.val[k], m.size[k], s);
          live -= m.size[k];
          map_del(&m, (size_t)k);
        } else if (e->action == 'r') {
          long k = map_find(&m, e->ptr);
          if (k >= 0) kt_record_stream(pool, m.val[k], s);
        } else {
          kt_empty_cache(pool);
        }
        ops++;
      }
      if (passes > 1 && pass + 1 < passes) {   /* what the trace left live: freed before the next pass */
        for (size_t i = 0; i < m.cap; i++)
          if (m.key[i]) { kt_free(pool, m.val[i], m.size[i], NULL); live -= m.size[i]; m.key[i] = 0; }
        m.n = 0;
      }
      double dtp = now_s() - tp;
      dt += dtp;
      if (r == repeat - 1 && !strcmp(be->name, "fake")) {
        char what[64];
        calls c1 = calls_now(be, pool);
        if (passes > 1) printf("pass %d: %.1f ns/op\n", pass + 1, dtp * 1e9 / (double)(n ? n : 1));
        if (pass == 0) {
          calls_print("first half ", c0, chalf, nallocs / 2);
          calls_print("second half", chalf, c1, allocs - nallocs / 2);
        }
        snprintf(what, sizeof what, "pass %d     ", pass + 1);
        calls_print(what, c0, c1, allocs);
      }
    }
    if (dt < best) best = dt;
    kt_stats st;
    kt_get_stats(pool, &st);
    peak_reserved = (size_t)st.reserved_bytes.peak;
    end_reserved = (size_t)st.reserved_bytes.current;
    end_live = live;
    end_g = granule_split(m.val, m.size, m.key, m.cap);
    for (size_t i = 0; i < m.cap; i++) if (m.key[i]) kt_free(pool, m.val[i], m.size[i], NULL);
    free(m.key); free(m.val); free(m.size);
    kt_pool_destroy(pool);
  }
  double ns = best * 1e9 / (double)(ops ? ops : 1);
  double ratio = peak_live ? (double)peak_reserved / (double)peak_live : 0;
  printf("replay %s: %zu events, %d streams, backend %s (%s)\n", path, n, nstreams, be->name, device);
  printf("  %.1f ns/op (best of %d), peak reserved %zu, peak live %zu, reserved/live %.3f%s\n", ns, repeat,
         peak_reserved, peak_live, ratio, missing ? " (frees of untraced blocks skipped)" : "");
  printf("  at the end: reserved %zu, live %zu%s\n", end_reserved, end_live, vmm ? " (VMM pool)" : "");
  if (vmm) {
    const double M = 1048576.0;
    size_t held = end_g.touched * KT_SEGMENT_ALIGN;
    printf("  granules: live blocks touch %zu (%.1f MiB, %.1f MiB live in them); %zu are under a quarter full "
           "(%.2f MiB live in %zu blocks starting there); reserved beyond the touched granules %.1f MiB\n",
           end_g.touched, held / M, end_g.live / M, end_g.sparse, end_g.sparse_live / M, end_g.sparse_blocks,
           end_reserved > held ? (end_reserved - held) / M : 0.0);
  }
  if (json) {
    FILE *js = fopen(json, "w");
    if (!js) { fprintf(stderr, "cannot write %s\n", json); return 1; }
    fprintf(js, "{\"benchmark\": \"alloc_replay\", \"trace\": \"%s\", \"backend\": \"%s\", \"device\": \"%s\", \"date\": \"%s\", "
            "\"commit\": \"%s\", \"events\": %zu, \"ns_per_op\": %.1f, \"peak_reserved\": %zu, \"peak_live\": %zu, "
            "\"reserved_over_live\": %.4f, \"end_reserved\": %zu, \"end_live\": %zu, \"vmm\": %d}\n", path, be->name, device,
            date, getenv("KT_COMMIT") ? getenv("KT_COMMIT") : "?", n, ns, peak_reserved, peak_live, ratio, end_reserved,
            end_live, vmm);
    fclose(js);
  }
  return 0;
}
