/* bench/memplan_traces.c — planned offsets against a dynamic pool, on the same lifetimes.
 *
 * Training-step-shaped traces (forward activations freed in reverse by the backward
 * pass, a temporary a layer each way, gradients kept to the end; sizes 32 KiB to
 * 256 MiB, as in a model's step) are packed by kt_memplan and replayed, event by
 * event (frees first), through a Kitsune pool on the host fake backend, VMM and
 * segments. Prints, per trace and summarised, the plan's arena and the pool's peak
 * reserved bytes over the live peak. Bytes only, no time: the host fake is exact for
 * these. Output: a table, and JSON as the last line.
 *   memplan_traces [traces]      (default 200) */
#include <stdio.h>
#include <stdlib.h>

#include "kitsune/alloc.h"
#include "kitsune/memplan.h"

static uint64_t rnd(uint64_t *s) { *s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17; return *s; }

/* One step of `layers` layers into b (6 x layers entries); returns the count. */
static int32_t make_trace(uint64_t seed, kt_memplan_block *b, int *layers_out) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull;
  int layers = 4 + (int)(rnd(&s) % 12);
  const uint64_t unit = (uint64_t)32 << 10;
  int32_t n = 0;
  int64_t t = 0;
  for (int l = 0; l < layers; l++) {
    b[n++] = (kt_memplan_block){unit * (1 + rnd(&s) % 4096), t, -1, 0};
    b[n++] = (kt_memplan_block){unit * (1 + rnd(&s) % 8192), t, t + 1, 0};
    t++;
  }
  for (int l = layers - 1; l >= 0; l--) {
    b[n++] = (kt_memplan_block){unit * (1 + rnd(&s) % 8192), t, t + 1, 0};
    b[n++] = (kt_memplan_block){unit * (1 + rnd(&s) % 2048), t, INT64_MAX, 0};
    b[2 * l].end = t + 1;
    t++;
  }
  *layers_out = layers;
  return n;
}

/* Peak reserved bytes of a pool that allocates and frees b in event order. held:
 * releases held, as for a CUDA graph's memory during a capture (nothing can be
 * unmapped or released, since that would synchronize). */
static int64_t replay(const kt_memplan_block *b, int32_t n, int vmm, int held) {
  kt_backend *be = kt_fake_backend_create(0);
  kt_pool_options o;
  kt_pool_options_default(&o);
  o.vmm = vmm;
  kt_pool_t *p = NULL;
  void **ptr = calloc((size_t)n, sizeof *ptr);
  if (!be || !ptr || kt_pool_create(&o, be, &p) != KT_OK) { fprintf(stderr, "setup failed\n"); exit(1); }
  if (held) kt_pool_hold_releases(p, 1);
  int64_t tmax = 0;
  for (int32_t i = 0; i < n; i++) if (b[i].start > tmax) tmax = b[i].start;
  for (int64_t t = 0; t <= tmax + 1; t++) {
    for (int32_t i = 0; i < n; i++) if (b[i].end == t) kt_free(p, ptr[i], 0, NULL);
    for (int32_t i = 0; i < n; i++)
      if (b[i].start == t && kt_alloc(p, b[i].size, NULL, &ptr[i]) != KT_OK) { fprintf(stderr, "alloc failed\n"); exit(1); }
  }
  kt_stats st;
  kt_get_stats(p, &st);
  kt_pool_destroy(p);
  kt_fake_backend_destroy(be);
  free(ptr);
  return st.reserved_bytes.peak;
}

int main(int argc, char **argv) {
  int traces = argc > 1 ? atoi(argv[1]) : 200;
  enum { R = 5 };
  static const char *names[R] = {"plan", "pool_vmm", "pool_segments", "pool_vmm_held", "pool_segments_held"};
  double sum[R] = {0}, worst[R] = {0};
  kt_memplan_block b[6 * 16];
  uint64_t off[6 * 16];
  printf("%6s %6s %10s %8s %8s %8s %10s %10s\n", "trace", "layers", "peak MiB", "plan", "VMM", "segments",
         "VMM held", "seg held");
  for (int k = 1; k <= traces; k++) {
    int layers;
    int32_t n = make_trace((uint64_t)k, b, &layers);
    uint64_t total, peak;
    if (kt_memplan(b, n, 512, off, &total) != KT_OK || kt_memplan_peak(b, n, 512, &peak) != KT_OK) return 1;
    double pk = (double)peak;
    double r[R] = {(double)total / pk, (double)replay(b, n, 1, 0) / pk, (double)replay(b, n, 0, 0) / pk,
                   (double)replay(b, n, 1, 1) / pk, (double)replay(b, n, 0, 1) / pk};
    for (int i = 0; i < R; i++) { sum[i] += r[i]; if (r[i] > worst[i]) worst[i] = r[i]; }
    if (k <= 10)
      printf("%6d %6d %10.1f %8.3f %8.3f %8.3f %10.3f %10.3f\n", k, layers, pk / 1048576.0, r[0], r[1], r[2], r[3], r[4]);
  }
  printf("over %d traces, x the live peak (mean / worst):\n", traces);
  for (int i = 0; i < R; i++) printf("  %-20s %.3f / %.3f\n", names[i], sum[i] / traces, worst[i]);
  printf("{\"benchmark\": \"memplan_traces\", \"traces\": %d", traces);
  for (int i = 0; i < R; i++) printf(", \"%s\": {\"mean\": %.4f, \"worst\": %.4f}", names[i], sum[i] / traces, worst[i]);
  printf("}\n");
  return 0;
}
