/* bench/alloc_bench.c — the allocator's C benchmarks.
 *
 *  pairs:  alloc+free of one size, repeated, per thread; threads 1, 2, 4, each on
 *          its own stream ("own") or all on one stream ("shared"). Median of 5 runs
 *          of ns per pair as one thread sees it.
 *  random: RMM's random_allocations recipe: sizes uniform in [1, max] bytes;
 *          allocate with probability 0.73 while under the usage cap (else free a
 *          random live block); N allocations, then everything freed. Reports ns/op
 *          and peak reserved / peak live (live = sum of requested sizes).
 *  baselines (CUDA only): cudaMalloc+cudaFree and cudaMallocAsync+cudaFreeAsync pairs.
 *
 *  alloc_bench [--backend fake|cuda] [--json FILE] [--quick] [--trace FILE]
 *  alloc_bench --probe   prints the number of CUDA devices
 *  --no-lifetimes: pool without allocation time stamps; --pairs-only: skip the rest
 *  --peak-slack BYTES: kt_pool_options.peak_slack (0 = exact peaks, one atomic per call)
 *  --trace records the N=10000, max=4 MiB random run as a replayable trace.
 */
#include <pthread.h>

#include "bench_common.h"

#define MiB ((size_t)1 << 20)

static const kt_backend *be;
static kt_pool_t *pool;

typedef struct job {   /* one per thread, padded to its own cache lines */
  size_t size;
  long iters;
  kt_stream_t stream;
  pthread_barrier_t *bar;
  double ns;
  int err;
} __attribute__((aligned(128))) job;

static void *pair_thread(void *arg) {
  job *j = arg;
  void *p;
  for (int i = 0; i < 1000; i++) {    /* warm: the class is seen on this stream */
    if (kt_alloc(pool, j->size, j->stream, &p) != KT_OK) { j->err = 1; break; }
    kt_free(pool, p, j->size, j->stream);
  }
  pthread_barrier_wait(j->bar);
  int err = 0;                 /* local: writing j->err each iteration false-shares the job array */
  double t0 = now_s();
  for (long i = 0; i < j->iters; i++) {
    err |= kt_alloc(pool, j->size, j->stream, &p) != KT_OK;
    err |= kt_free(pool, p, j->size, j->stream) != KT_OK;
  }
  j->ns = (now_s() - t0) * 1e9 / (double)j->iters;
  j->err |= err;
  return NULL;
}

static kt_stream_t bench_stream(int i) {
  static kt_stream_t s[8];
  if (i == 0) return NULL;
  if (!s[i]) {
    if (!strcmp(be->name, "cuda")) {
      cudaStream_t cs;
      cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking);
      s[i] = cs;
    } else {
      s[i] = (kt_stream_t)(uintptr_t)(0x1000 * i);
    }
  }
  return s[i];
}

static double run_pairs(size_t size, int threads, int shared, long iters) {
  double runs[5];
  for (int r = 0; r < 5; r++) {
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)threads);
    job jobs[8];
    pthread_t th[8];
    for (int t = 0; t < threads; t++) {
      jobs[t] = (job){.size = size, .iters = iters, .stream = bench_stream(shared ? 1 : t + 1), .bar = &bar};
      pthread_create(&th[t], NULL, pair_thread, &jobs[t]);
    }
    double sum = 0;
    for (int t = 0; t < threads; t++) {
      pthread_join(th[t], NULL);
      if (jobs[t].err) { fprintf(stderr, "pair run failed\n"); exit(1); }
      sum += jobs[t].ns;
    }
    runs[r] = sum / threads;
    pthread_barrier_destroy(&bar);
  }
  qsort(runs, 5, sizeof *runs, cmp_double);
  return runs[2];
}

static int bench_vmm;   /* --vmm: pools map granules of one address range */

typedef struct rnd { double ns_per_op; size_t peak_reserved, peak_live, peak_allocated; long ops; } rnd;

static rnd run_random(long n, size_t max, size_t cap, uint64_t seed, const char *trace) {
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.vmm = bench_vmm;
  kt_pool_t *p;
  if (kt_pool_create(&o, be, &p) != KT_OK) { fprintf(stderr, "pool create failed\n"); exit(1); }
  if (trace && kt_trace_start(p, trace) != KT_OK) { fprintf(stderr, "cannot write %s\n", trace); exit(1); }
  void **ptr = malloc((size_t)n * sizeof *ptr);
  size_t *sz = malloc((size_t)n * sizeof *sz);
  long live = 0, allocs = 0, ops = 0;
  size_t usage = 0, peak_live = 0;
  /* sizes and coin flips drawn up front so the timed loop is the allocator's */
  uint64_t s = seed;
  double t0 = now_s();
  while (allocs < n) {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    size_t size = 1 + s % max;
    int do_alloc = live == 0 || ((s >> 40) % 100 < 73 && usage + size <= cap);
    if (do_alloc) {
      if (kt_alloc(p, size, NULL, &ptr[live]) != KT_OK) { fprintf(stderr, "random: OOM at %zu\n", usage); exit(1); }
      sz[live++] = size;
      usage += size;
      if (usage > peak_live) peak_live = usage;
      allocs++;
    } else {
      long i = (long)((s >> 20) % (uint64_t)live);
      kt_free(p, ptr[i], sz[i], NULL);
      usage -= sz[i];
      ptr[i] = ptr[--live]; sz[i] = sz[live];
    }
    ops++;
  }
  while (live) { live--; kt_free(p, ptr[live], sz[live], NULL); ops++; }
  double dt = now_s() - t0;
  kt_stats st;
  kt_get_stats(p, &st);
  if (trace) kt_trace_stop(p);
  kt_pool_destroy(p);
  free(ptr); free(sz);
  return (rnd){dt * 1e9 / (double)ops, (size_t)st.reserved_bytes.peak, peak_live, (size_t)st.allocated_bytes.peak, ops};
}

static double cuda_baseline(size_t size, int async, long iters) {
  cudaStream_t s = (cudaStream_t)bench_stream(1);
  void *p;
  for (int i = 0; i < 100; i++) {
    if (async) { cudaMallocAsync(&p, size, s); cudaFreeAsync(p, s); } else { cudaMalloc(&p, size); cudaFree(p); }
  }
  double t0 = now_s();
  for (long i = 0; i < iters; i++) {
    if (async) { cudaMallocAsync(&p, size, s); cudaFreeAsync(p, s); } else { cudaMalloc(&p, size); cudaFree(p); }
  }
  double ns = (now_s() - t0) * 1e9 / (double)iters;
  cudaStreamSynchronize(s);
  return ns;
}

int main(int argc, char **argv) {
  const char *backend = "fake", *json = NULL, *trace = NULL;
  int quick = 0, lifetimes = 1, pairs_only = 0;
  size_t slack = KT_DEFAULT_PEAK_SLACK;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
    else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!strcmp(argv[i], "--trace") && i + 1 < argc) trace = argv[++i];
    else if (!strcmp(argv[i], "--quick")) quick = 1;
    else if (!strcmp(argv[i], "--no-lifetimes")) lifetimes = 0;
    else if (!strcmp(argv[i], "--pairs-only")) pairs_only = 1;
    else if (!strcmp(argv[i], "--vmm")) bench_vmm = 1;
    else if (!strcmp(argv[i], "--peak-slack") && i + 1 < argc) slack = (size_t)atoll(argv[++i]);
    else if (!strcmp(argv[i], "--probe")) { printf("%d\n", kt_cuda_device_count()); return 0; }
    else { fprintf(stderr, "usage: %s [--backend fake|cuda] [--json FILE] [--trace FILE] [--quick] [--vmm]\n", argv[0]); return 2; }
  }
  char device[256], cpu[256], date[32];
  be = bench_backend(backend, device, sizeof device);
  if (!be) return 1;
  cpu_model(cpu, sizeof cpu);
  iso_date(date, sizeof date);
  const char *commit = getenv("KT_COMMIT");
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.track_lifetimes = lifetimes;
  o.peak_slack = slack;
  o.vmm = bench_vmm;
  if (kt_pool_create(&o, be, &pool) != KT_OK) { fprintf(stderr, "pool create failed\n"); return 1; }

  printf("Kitsune allocator benchmark\n  backend: %s\n  device:  %s\n  cpu:     %s\n  date:    %s  commit %s\n\n",
         be->name, device, cpu, date, commit ? commit : "?");
  FILE *js = json ? fopen(json, "w") : NULL;
  if (json && !js) { fprintf(stderr, "cannot write %s\n", json); return 1; }
  if (js) fprintf(js, "{\n  \"benchmark\": \"alloc_bench\",\n  \"backend\": \"%s\",\n  \"device\": \"%s\",\n  \"cpu\": \"%s\",\n"
                  "  \"date\": \"%s\",\n  \"commit\": \"%s\",\n  \"lifetimes\": %d,\n  \"peak_slack\": %zu,\n  \"pairs\": [\n", be->name, device, cpu, date, commit ? commit : "?", lifetimes, slack);

  size_t sizes[] = {512, 4096, 65536, 1 << 20, 8 * MiB};
  int threads[] = {1, 2, 4};
  long iters = quick ? 200000 : 2000000;
  printf("alloc+free pair, ns per pair per thread (median of 5 runs, %ld pairs each; lifetimes %s; peak slack %zu)\n",
         iters, lifetimes ? "tracked" : "off", slack);
  printf("  %10s  %8s  %8s  %8s  %8s  %8s  %8s\n", "size", "1 thr", "2 own", "2 shared", "4 own", "4 shared", "");
  run_pairs(4096, 1, 0, iters);   /* untimed: the first table cell should not pay for CPU ramp-up */
  int first = 1;
  for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
    printf("  %10zu", sizes[si]);
    for (int ti = 0; ti < 3; ti++)
      for (int shared = 0; shared < (threads[ti] > 1 ? 2 : 1); shared++) {
        double ns = run_pairs(sizes[si], threads[ti], shared, sizes[si] > KT_LARGE_THRESHOLD ? iters / 10 : iters);
        printf("  %8.1f", ns);
        if (js) fprintf(js, "%s    {\"size\": %zu, \"threads\": %d, \"streams\": \"%s\", \"ns_per_pair\": %.2f}",
                        first ? "" : ",\n", sizes[si], threads[ti], shared ? "shared" : "own", ns), first = 0;
      }
    printf("\n");
  }
  if (pairs_only) { if (js) { fprintf(js, "\n  ]\n}\n"); fclose(js); } kt_pool_destroy(pool); return 0; }
  if (js) fprintf(js, "\n  ],\n  \"random_allocations\": [\n");

  long ns_[] = {1000, 10000, 100000};
  size_t maxes[] = {1, 4, 64};
  size_t cap = (size_t)4 << 30;
  printf("\nrandom_allocations (RMM recipe, p(alloc)=0.73, usage cap %zu GiB, then all freed)\n", cap >> 30);
  printf("  %8s  %8s  %10s  %14s  %14s  %10s\n", "N", "max MiB", "ns/op", "peak reserved", "peak live", "res/live");
  first = 1;
  for (int ni = 0; ni < 3; ni++)
    for (int mi = 0; mi < 3; mi++) {
      if (quick && ns_[ni] == 100000) continue;
      const char *tr = (trace && ns_[ni] == 10000 && maxes[mi] == 4) ? trace : NULL;
      rnd r = run_random(ns_[ni], maxes[mi] * MiB, cap, 0x1234567ull + (uint64_t)ni * 31 + mi, tr);
      double ratio = (double)r.peak_reserved / (double)r.peak_live;
      printf("  %8ld  %8zu  %10.1f  %14zu  %14zu  %10.3f\n", ns_[ni], maxes[mi], r.ns_per_op, r.peak_reserved, r.peak_live, ratio);
      if (js) fprintf(js, "%s    {\"n\": %ld, \"max_mib\": %zu, \"ops\": %ld, \"ns_per_op\": %.1f, \"peak_reserved\": %zu, "
                      "\"peak_live\": %zu, \"peak_allocated\": %zu, \"reserved_over_live\": %.4f}",
                      first ? "" : ",\n", ns_[ni], maxes[mi], r.ops, r.ns_per_op, r.peak_reserved, r.peak_live,
                      r.peak_allocated, ratio), first = 0;
    }
  if (js) fprintf(js, "\n  ]");
  if (!strcmp(be->name, "cuda")) {
    printf("\nCUDA baselines, ns per alloc+free pair (single thread)\n  %10s  %12s  %14s\n", "size", "cudaMalloc", "cudaMallocAsync");
    if (js) fprintf(js, ",\n  \"cuda_baselines\": [\n");
    first = 1;
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
      double a = cuda_baseline(sizes[si], 0, quick ? 200 : 2000), b = cuda_baseline(sizes[si], 1, quick ? 20000 : 200000);
      printf("  %10zu  %12.1f  %14.1f\n", sizes[si], a, b);
      if (js) fprintf(js, "%s    {\"size\": %zu, \"cudaMalloc_ns\": %.1f, \"cudaMallocAsync_ns\": %.1f}", first ? "" : ",\n", sizes[si], a, b), first = 0;
    }
    if (js) fprintf(js, "\n  ]");
  }
  if (js) { fprintf(js, "\n}\n"); fclose(js); }
  kt_pool_destroy(pool);
  return 0;
}
