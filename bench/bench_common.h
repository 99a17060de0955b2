/* bench/bench_common.h — timing, machine description and JSON helpers. */
#ifndef KT_BENCH_COMMON_H
#define KT_BENCH_COMMON_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cuda_runtime_api.h>

#include "kitsune/alloc.h"

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void cpu_model(char *buf, size_t len) {
  snprintf(buf, len, "unknown");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f))
    if (!strncmp(line, "model name", 10)) {
      char *c = strchr(line, ':');
      if (c) { c += 2; c[strcspn(c, "\n")] = 0; snprintf(buf, len, "%s", c); }
      break;
    }
  fclose(f);
}

/* "cuda" needs a device; returns the backend or NULL with a message. */
static inline const kt_backend *bench_backend(const char *name, char *device, size_t len) {
  if (len < 64) return NULL;
  if (!strcmp(name, "cuda")) {
    if (kt_cuda_device_count() == 0) { fprintf(stderr, "no CUDA device: use --backend fake\n"); return NULL; }
    struct cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    snprintf(device, len, "%.180s (driver %d, runtime %d)", prop.name, drv, rt);
    return kt_cuda_backend();
  }
  snprintf(device, len, "host fake backend (no GPU)");
  return kt_fake_backend_create(0);
}

static inline void iso_date(char *buf, size_t len) {
  time_t t = time(NULL);
  strftime(buf, len, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
}

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

#endif
