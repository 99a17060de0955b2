/* Unit: the churn of issue 45 on the fake backend, and when memory goes back.
 *
 * The churn (bench/churn_trace.py writes the same one as a trace): a ring of 64 live
 * blocks, allocation i of a size drawn log-uniformly from 1 byte to 64 MiB replacing
 * the block in slot i mod 64, allocated before the old one is freed (as from Python),
 * 20,000 allocations, then the ring is freed. A first pass warms the pool up; a
 * second pass of the same sizes must make no backend call at all, and the pool's
 * peak stays within a stated bound of the live peak. Then: an ordinary free never
 * gives memory back, not even above a lowered limit; growth under a limit, a refused
 * reservation and kt_empty_cache do. */
#include <math.h>

#include "common.h"
#include "internal.h"

FAKE_POOL_SUITE(churn);

enum { RING = 64, ALLOCS = 20000, MAX_LOG2 = 26 };

static kt_pool_t *churn_pool(const kt_backend *b, int vmm, int release_on_grow) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.vmm = vmm;
  o.release_on_grow = release_on_grow;
  kt_pool_t *p = NULL;
  cr_assert_eq(kt_pool_create(&o, b, &p), KT_OK);
  return p;
}

/* bench/churn_trace.py's sizes: xorshift64* (test_rand) from seed 45, floor(2^(26u)). */
static size_t churn_size(uint64_t *seed) {
  double u = (double)(test_rand(seed) >> 11) * (1.0 / 9007199254740992.0);
  return (size_t)pow(2.0, MAX_LOG2 * u);
}

/* One pass; returns the live peak (requested bytes). streams: 1, or 2 alternating. */
static size_t churn_pass(kt_pool_t *p, int streams) {
  void *ring[RING] = {0};
  size_t sz[RING] = {0}, live = 0, peak = 0;
  kt_stream_t st[RING] = {0};
  uint64_t seed = 45;
  for (int i = 0; i < ALLOCS; i++) {
    size_t n = churn_size(&seed);
    kt_stream_t s = (streams > 1 && (i & 1)) ? (kt_stream_t)(uintptr_t)0x5040 : NULL;
    void *q;
    cr_assert_eq(kt_alloc(p, n, s, &q), KT_OK, "allocation %d of %zu bytes", i, n);
    live += n;
    if (live > peak) peak = live;
    int k = i % RING;
    if (ring[k]) {
      cr_assert_eq(kt_free(p, ring[k], sz[k], st[k]), KT_OK);
      live -= sz[k];
    }
    ring[k] = q; sz[k] = n; st[k] = s;
  }
  for (int k = 0; k < RING; k++)
    if (ring[k]) cr_assert_eq(kt_free(p, ring[k], sz[k], st[k]), KT_OK);
  return peak;
}

/* Calls that allocate, free, map or unmap device memory, create events or synchronize. */
static uint64_t calls(const kt_fake_counts *c) {
  return c->reserves + c->releases + c->failed_reserves + c->va_reserves + c->va_releases + c->maps + c->unmaps +
         c->event_creates + c->event_destroys + c->syncs;
}

/* Events recorded and queried (cached events: no creation). */
static uint64_t event_calls(const kt_fake_counts *c) { return c->event_records + c->event_queries; }

/* Two passes on a fresh pool; asserts the second makes no backend call (max_events
 * event records and queries at most) and the peak is within bound x the live peak. */
static void churn_steady(const char *name, int vmm, int release_on_grow, int streams, double bound,
                         uint64_t max_events) {
  kt_pool_t *p = churn_pool(be, vmm, release_on_grow);
  kt_fake_counts c0, c1, c2;
  kt_fake_get_counts(be, &c0);
  size_t peak = churn_pass(p, streams);
  kt_fake_get_counts(be, &c1);
  cr_assert_eq(kt_pool_validate(p), KT_OK);
  kt_stats st1;
  kt_get_stats(p, &st1);
  cr_assert_eq(churn_pass(p, streams), peak);
  kt_fake_get_counts(be, &c2);
  kt_stats st2;
  kt_get_stats(p, &st2);
  double ratio = (double)st2.reserved_bytes.peak / (double)peak;
  cr_log_info("churn, %s: warm-up pass %llu backend calls (reserve %llu, map %llu, unmap %llu, synchronize %llu) "
              "and %llu event records and queries; steady pass %llu and %llu; peak reserved / live peak %.3f",
              name, (unsigned long long)(calls(&c1) - calls(&c0)), (unsigned long long)(c1.reserves - c0.reserves),
              (unsigned long long)(c1.maps - c0.maps), (unsigned long long)(c1.unmaps - c0.unmaps),
              (unsigned long long)(c1.syncs - c0.syncs), (unsigned long long)(event_calls(&c1) - event_calls(&c0)),
              (unsigned long long)(calls(&c2) - calls(&c1)), (unsigned long long)(event_calls(&c2) - event_calls(&c1)),
              ratio);
  cr_assert_eq(calls(&c2), calls(&c1), "%s: the steady pass called the backend %llu times", name,
               (unsigned long long)(calls(&c2) - calls(&c1)));
  cr_assert_leq(event_calls(&c2) - event_calls(&c1), max_events, "%s: %llu event calls in the steady pass", name,
                (unsigned long long)(event_calls(&c2) - event_calls(&c1)));
  cr_assert_eq(st2.reserved_bytes.peak, st1.reserved_bytes.peak, "%s: the steady pass grew the pool", name);
  cr_assert_leq(ratio, bound, "%s: peak reserved %.3fx the live peak", name, ratio);
  assert_stats_identities(p);
  kt_pool_destroy(p);
}

/* Measured when written: VMM 1.212x (the torch bridge's pool on one GPU), segments
 * 1.595x; the bounds leave room for small changes of placement. On two streams the
 * blocks one stream frees serve the other once an event says its work is done: the
 * steady pass records and queries such events (116 when written: cheap calls on
 * cached events), and allocates, maps or synchronizes nothing. */
Test(churn, vmm_steady_state_makes_no_backend_call) { churn_steady("VMM", 1, KT_RELEASE_SEGMENTS, 1, 1.25, 0); }
Test(churn, segments_steady_state_makes_no_backend_call) {
  churn_steady("segments", 0, KT_RELEASE_SEGMENTS, 1, 1.65, 0);
}
Test(churn, vmm_two_streams_steady_state_maps_nothing) {
  churn_steady("VMM, two streams", 1, KT_RELEASE_SEGMENTS, 2, 1.45, 400);
}


/* The old VMM policy for comparison: unmapping idle granules before the mapped total
 * passes its high mark keeps the peak lower, and keeps calling the backend. */
Test(churn, following_the_peak_keeps_remapping) {
  kt_pool_t *p = churn_pool(be, 1, KT_RELEASE_FOLLOW_PEAK);
  size_t peak = churn_pass(p, 1);
  kt_fake_counts c1, c2;
  kt_fake_get_counts(be, &c1);
  churn_pass(p, 1);
  kt_fake_get_counts(be, &c2);
  kt_stats st;
  kt_get_stats(p, &st);
  cr_log_info("churn, VMM following the peak: steady pass %llu backend calls (%llu synchronizations); "
              "peak reserved / live peak %.3f", (unsigned long long)(calls(&c2) - calls(&c1)),
              (unsigned long long)(c2.syncs - c1.syncs), (double)st.reserved_bytes.peak / (double)peak);
  cr_assert_gt(c2.syncs, c1.syncs);
  kt_pool_destroy(p);
}

/* Training-step-shaped lifetimes, as bench/memplan_traces.c makes them (forward
 * activations freed in reverse by the backward pass, a temporary a layer each way,
 * gradients kept to the end of the step; sizes 32 KiB to 256 MiB), here ended with the
 * step so that steps can follow each other on one pool. */
typedef struct { size_t size; int start, end; } life;

static uint64_t xs(uint64_t *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

static int make_step(uint64_t seed, life *b) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull;
  int layers = 4 + (int)(xs(&s) % 12), n = 0, t = 0;
  const size_t unit = 32 * KiB;
  for (int l = 0; l < layers; l++, t++) {
    b[n++] = (life){unit * (1 + xs(&s) % 4096), t, -1};
    b[n++] = (life){unit * (1 + xs(&s) % 8192), t, t + 1};
  }
  int grads = n + 1;
  for (int l = layers - 1; l >= 0; l--, t++) {
    b[n++] = (life){unit * (1 + xs(&s) % 8192), t, t + 1};
    b[n++] = (life){unit * (1 + xs(&s) % 2048), t, -2};
    b[2 * l].end = t + 1;
  }
  for (int i = grads; i < n; i += 2) b[i].end = t + 1;
  return n;
}

/* One step on p (frees first at each time); returns its live peak. */
static size_t run_step(kt_pool_t *p, const life *b, int n) {
  void *ptr[6 * 16];
  size_t live = 0, peak = 0;
  for (int t = 0; t <= 2 * 16 + 1; t++) {
    for (int i = 0; i < n; i++)
      if (b[i].end == t) { cr_assert_eq(kt_free(p, ptr[i], b[i].size, NULL), KT_OK); live -= b[i].size; }
    for (int i = 0; i < n; i++)
      if (b[i].start == t) {
        cr_assert_eq(kt_alloc(p, b[i].size, NULL, &ptr[i]), KT_OK);
        live += b[i].size;
        if (live > peak) peak = live;
      }
  }
  cr_assert_eq(live, 0);
  return peak;
}

/* The same step again and again (a training loop of fixed shapes): after the first,
 * no backend call at all, on 100 different steps. */
static void repeated_steps(int release_on_grow, double *mean, uint64_t *later_calls, uint64_t *later_syncs) {
  double sum = 0;
  *later_calls = *later_syncs = 0;
  for (uint64_t seed = 1; seed <= 100; seed++) {
    life b[6 * 16];
    int n = make_step(seed, b);
    kt_pool_t *p = churn_pool(be, 1, release_on_grow);
    size_t peak = run_step(p, b, n);
    kt_fake_counts c0, c1;
    kt_fake_get_counts(be, &c0);
    for (int k = 1; k < 5; k++) run_step(p, b, n);
    kt_fake_get_counts(be, &c1);
    *later_calls += calls(&c1) - calls(&c0) + event_calls(&c1) - event_calls(&c0);
    *later_syncs += c1.syncs - c0.syncs;
    kt_stats st;
    kt_get_stats(p, &st);
    sum += (double)st.reserved_bytes.peak / (double)peak;
    kt_pool_destroy(p);
  }
  *mean = sum / 100;
}

Test(churn, a_repeated_training_step_makes_no_backend_call_after_the_first) {
  double mean, mean_fp;
  uint64_t n, syncs, n_fp, syncs_fp;
  repeated_steps(KT_RELEASE_SEGMENTS, &mean, &n, &syncs);
  repeated_steps(KT_RELEASE_FOLLOW_PEAK, &mean_fp, &n_fp, &syncs_fp);
  cr_log_info("a step repeated 5 times, 100 steps, VMM: %llu backend calls in repeats 2-5, peak reserved / live "
              "peak %.4f (mean); following the peak: %llu calls (%llu synchronizations), %.4f",
              (unsigned long long)n, mean, (unsigned long long)n_fp, (unsigned long long)syncs_fp, mean_fp);
  cr_assert_eq(n, 0);
  cr_assert_leq(mean, 1.2, "1.14 when written");
}

/* Steps of changing shapes (60 different steps on one pool, as shape-varying training):
 * after warm-up a new shape may need more memory mapped, but nothing is unmapped and
 * nothing synchronizes. */
static void varying_steps(int release_on_grow, double *mean, double *late_calls, double *late_syncs) {
  double sum = 0;
  uint64_t lc = 0, ls = 0;
  for (uint64_t rep = 0; rep < 20; rep++) {
    kt_pool_t *p = churn_pool(be, 1, release_on_grow);
    size_t peak = 0;
    kt_fake_counts c0 = {0}, c1;
    for (int k = 0; k < 60; k++) {
      if (k == 30) kt_fake_get_counts(be, &c0);
      life b[6 * 16];
      int n = make_step(1000 + rep * 100 + (uint64_t)k, b);
      size_t pk = run_step(p, b, n);
      if (pk > peak) peak = pk;
    }
    kt_fake_get_counts(be, &c1);
    lc += calls(&c1) - calls(&c0) + event_calls(&c1) - event_calls(&c0);
    ls += c1.syncs - c0.syncs;
    cr_assert(release_on_grow == KT_RELEASE_FOLLOW_PEAK || (c1.syncs == c0.syncs && c1.unmaps == c0.unmaps),
              "run %llu: %llu synchronizations, %llu unmaps after warm-up", (unsigned long long)rep,
              (unsigned long long)(c1.syncs - c0.syncs), (unsigned long long)(c1.unmaps - c0.unmaps));
    kt_stats st;
    kt_get_stats(p, &st);
    sum += (double)st.reserved_bytes.peak / (double)peak;
    kt_pool_destroy(p);
  }
  *mean = sum / 20;
  *late_calls = (double)lc / 20;
  *late_syncs = (double)ls / 20;
}

Test(churn, changing_shapes_unmap_and_synchronize_nothing_after_warm_up) {
  double mean, calls_late, syncs_late, mean_fp, calls_fp, syncs_fp;
  varying_steps(KT_RELEASE_SEGMENTS, &mean, &calls_late, &syncs_late);
  varying_steps(KT_RELEASE_FOLLOW_PEAK, &mean_fp, &calls_fp, &syncs_fp);
  cr_log_info("60 steps of changing shapes, VMM: %.1f backend calls in the last 30 (%.1f synchronizations), peak "
              "reserved / live peak %.4f (mean of 20 runs); following the peak: %.1f calls (%.1f synchronizations), "
              "%.4f", calls_late, syncs_late, mean, calls_fp, syncs_fp, mean_fp);
  cr_assert_leq(mean, 1.2, "1.11 when written");
}

/* Blocks of every kind (slab classes, large, one used on another stream) on two
 * streams, freed one by one: no free releases, unmaps or synchronizes, whatever the
 * pool mode, even with a limit lowered below what is reserved. */
static void frees_release_nothing(int vmm, int release_on_grow) {
  kt_pool_t *p = churn_pool(be, vmm, release_on_grow);
  enum { N = 96 };
  void *ptr[N];
  size_t sz[N];
  kt_stream_t st[N];
  uint64_t seed = 7;
  for (int i = 0; i < N; i++) {
    sz[i] = churn_size(&seed) + 1;
    st[i] = (i & 1) ? (kt_stream_t)(uintptr_t)0x5040 : NULL;
    cr_assert_eq(kt_alloc(p, sz[i], st[i], &ptr[i]), KT_OK);
  }
  cr_assert_eq(kt_record_stream(p, ptr[3], (kt_stream_t)(uintptr_t)0x5080), KT_OK);
  kt_stats s;
  kt_get_stats(p, &s);
  cr_assert_eq(kt_set_memory_limit(p, (size_t)s.reserved_bytes.current / 2), KT_OK);   /* below what is reserved */
  kt_fake_counts c0, c;
  kt_fake_get_counts(be, &c0);
  for (int i = N - 1; i >= 0; i--) {   /* largest addresses first: whole segments go idle */
    cr_assert_eq(kt_free(p, ptr[i], sz[i], st[i]), KT_OK);
    kt_fake_get_counts(be, &c);
    cr_assert(c.releases == c0.releases && c.unmaps == c0.unmaps && c.syncs == c0.syncs &&
              c.va_releases == c0.va_releases && c.reserved_bytes == c0.reserved_bytes,
              "free %d gave memory back (vmm %d, release_on_grow %d)", i, vmm, release_on_grow);
  }
  cr_assert_eq(c.event_records, c0.event_records + 1, "the block used on another stream records its event");
  kt_get_stats(p, &s);
  cr_assert_eq(s.reserved_bytes.current, (int64_t)c0.reserved_bytes, "all cached");
  assert_stats_identities(p);
  kt_pool_destroy(p);
}

Test(churn, an_ordinary_free_never_gives_memory_back) {
  frees_release_nothing(1, KT_RELEASE_SEGMENTS);
  frees_release_nothing(0, KT_RELEASE_SEGMENTS);
  frees_release_nothing(1, KT_RELEASE_FOLLOW_PEAK);
  frees_release_nothing(0, KT_RELEASE_NEVER);
}

/* What does give memory back: growth that would pass the limit, a refused
 * reservation (the OOM retry; on VMM pools test_vmm.c's refused map) and
 * kt_empty_cache. */
static void limit_refusal_and_trim_release(int vmm) {
  kt_pool_t *p = churn_pool(be, vmm, KT_RELEASE_SEGMENTS);
  void *a, *b, *c, *d;
  cr_assert_eq(kt_alloc(p, 24 * MiB, NULL, &a), KT_OK);
  cr_assert_eq(kt_alloc(p, 24 * MiB, NULL, &b), KT_OK);
  cr_assert_eq(kt_free(p, a, 0, NULL), KT_OK);            /* 24 MiB cached */
  kt_fake_counts c0, c1;
  kt_fake_get_counts(be, &c0);
  cr_assert_eq(kt_set_memory_limit(p, 60 * MiB), KT_OK);
  cr_assert_eq(kt_alloc(p, 30 * MiB, NULL, &c), KT_OK);   /* fits no hole; 24 + 24 + 30 > 60 */
  kt_fake_get_counts(be, &c1);
  cr_assert(c1.releases + c1.unmaps > c0.releases + c0.unmaps, "the limit made cached memory go back (vmm %d)", vmm);
  kt_stats s;
  kt_get_stats(p, &s);
  cr_assert_leq(s.reserved_bytes.current, (int64_t)(60 * MiB));
  cr_assert_eq(kt_set_memory_limit(p, 0), KT_OK);
  cr_assert_eq(kt_free(p, c, 0, NULL), KT_OK);
  if (vmm) {   /* a VMM pool maps d over c's granules: nothing to refuse */
    cr_assert_eq(kt_alloc(p, 40 * MiB, NULL, &d), KT_OK);
  } else {     /* b live, c's 30 MiB cached, the device nearly full */
    kt_get_stats(p, &s);
    uint64_t retries = s.num_alloc_retries;
    kt_fake_get_counts(be, &c0);
    kt_fake_set_capacity(be, c0.reserved_bytes + 16 * MiB);
    cr_assert_eq(kt_alloc(p, 40 * MiB, NULL, &d), KT_OK, "the OOM retry releases the cache");
    kt_fake_get_counts(be, &c1);
    cr_assert_gt(c1.releases, c0.releases);
    kt_get_stats(p, &s);
    cr_assert_eq(s.num_alloc_retries, retries + 1);
    kt_fake_set_capacity(be, 0);
  }
  cr_assert_eq(kt_free(p, b, 0, NULL), KT_OK);
  cr_assert_eq(kt_free(p, d, 0, NULL), KT_OK);
  cr_assert_eq(kt_empty_cache(p), KT_OK);
  kt_fake_get_counts(be, &c1);
  cr_assert_eq(c1.reserved_bytes, 0, "empty_cache gives everything back (vmm %d)", vmm);
  assert_stats_identities(p);
  kt_pool_destroy(p);
}

Test(churn, a_limit_a_refusal_and_empty_cache_give_memory_back) {
  limit_refusal_and_trim_release(1);
  limit_refusal_and_trim_release(0);
}
