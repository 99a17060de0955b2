/* bench/capplan_logs.c — how long kt_memplan_shared takes to pack a recorded capture,
 * on the plans the bridge logs with KITSUNE_CAPPLAN_LOG=DIR (DIR/capplan_<pid>_<n>.csv
 * and its _share.txt; bench/traces/capplan/ holds the H100 captures of ResNet-18 and
 * the branchy net at batch 8 that bench/models.py planned at 2774d17).
 *
 * Each log is packed again as kt_capplan_create_within packed it: the planned blocks
 * (rows with an offset), blocks freed after the capture to the plan's end, sharing the
 * pairs of the _share.txt and, for a plan with waits (its header's wait_gap >= 0), the
 * pairs of waitable blocks (not freed after the capture, noted on the order) at least
 * wait_gap recorded events apart. The arena must equal the log's plan_bytes (a check
 * that the log is read as the plan was made: "same" in the output). A plan within a
 * budget packs 2 to 12 times (capplan.c: fit_with_waits bisects over the gap).
 *
 *   capplan_logs [--repeat N] LOG.csv ...      (default N 50)
 *
 * Prints a line a log: blocks, arena MiB, same, ms a packing (the median of N); JSON
 * as the last line. Host time only, on whatever CPU runs it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kitsune/memplan.h"

enum { ALIGN = 512 };

typedef struct shares {
  int32_t n;
  unsigned char *order;   /* n x n: the _share.txt's pairs (earlier row, later column) */
  const unsigned char *waitable;
  const kt_memplan_block *b;
  long long gap;          /* < 0: no waits */
} shares;

static int share(void *ctx, int32_t i, int32_t j) {
  const shares *s = ctx;
  if (s->order[(size_t)i * (size_t)s->n + (size_t)j]) return 1;
  return s->gap >= 0 && s->waitable[i] && s->waitable[j] && s->b[j].start - s->b[i].end >= s->gap;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

typedef struct log_plan {
  kt_memplan_block *b;
  unsigned char *waitable;
  int32_t n;
  unsigned long long plan_bytes;
  long long gap;
} log_plan;

/* Reads LOG.csv: its header's plan_bytes and wait_gap, the planned blocks. 0 on success. */
static int read_csv(const char *path, log_plan *lp) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  char line[4096];
  int32_t cap = 1024, n = 0;
  lp->b = malloc(sizeof *lp->b * (size_t)cap);
  lp->waitable = malloc((size_t)cap);
  int32_t *after = malloc(sizeof *after * (size_t)cap);
  long long last = 0;   /* the recording's event count when it ended */
  int header = 0;
  while (lp->b && lp->waitable && after && fgets(line, sizeof line, f)) {
    if (line[0] == '#') {
      header = sscanf(line, "# plan_bytes %llu peak_bytes %*u stream_peak_bytes %*u graph_nodes %*d cross_shares %*d "
                      "wait_gap %lld", &lp->plan_bytes, &lp->gap) == 2;
      continue;
    }
    long long blk, size, stream, start, end, aft, uses, unord, off;
    if (sscanf(line, "%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld", &blk, &size, &stream, &start, &end, &aft, &uses,
               &unord, &off) != 9)
      continue;   /* the column names */
    long long t = aft ? end : end + 1;   /* a free after the capture: at the event count then */
    if (t > last) last = t;
    if (off < 0) continue;   /* live when planned: left out */
    if (n == cap) {
      cap *= 2;
      kt_memplan_block *nb = realloc(lp->b, sizeof *nb * (size_t)cap);
      unsigned char *nw = realloc(lp->waitable, (size_t)cap);
      int32_t *na = realloc(after, sizeof *na * (size_t)cap);
      if (nb) lp->b = nb;
      if (nw) lp->waitable = nw;
      if (na) after = na;
      if (!nb || !nw || !na) break;
    }
    lp->b[n] = (kt_memplan_block){(uint64_t)size, start, end, 0};
    lp->waitable[n] = !aft && !unord;
    after[n++] = (int32_t)aft;
  }
  fclose(f);
  int ok = header && lp->b && lp->waitable && after;
  for (int32_t i = 0; ok && i < n; i++)
    if (after[i]) lp->b[i].end = last + 1;   /* freed after the capture: to the plan's end */
  free(after);
  lp->n = n;
  return ok ? 0 : -1;
}

/* Reads LOG_share.txt ("i: j ..." a planned block) into an n x n matrix. 0 on success. */
static int read_share(const char *path, int32_t n, unsigned char **out) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  unsigned char *m = calloc((size_t)n * (size_t)n + 1, 1);
  char *line = NULL;
  size_t cap = 0;
  while (m && getline(&line, &cap, f) > 0) {
    char *p = line, *e;
    long i = strtol(p, &e, 10);
    if (e == p || *e != ':' || i < 0 || i >= n) continue;
    for (p = e + 1;; p = e) {
      long j = strtol(p, &e, 10);
      if (e == p) break;
      if (j >= 0 && j < n) m[(size_t)i * (size_t)n + (size_t)j] = 1;
    }
  }
  fclose(f);
  free(line);
  if (!m) return -1;
  *out = m;
  return 0;
}

int main(int argc, char **argv) {
  int repeat = 50, first = 1;
  if (argc > 2 && !strcmp(argv[1], "--repeat")) {
    repeat = atoi(argv[2]);
    first = 3;
  }
  if (repeat < 1 || first >= argc) {
    fprintf(stderr, "usage: capplan_logs [--repeat N>=1] LOG.csv ...\n");
    return 2;
  }
  double *ms = malloc(sizeof *ms * (size_t)repeat);
  int failed = 0;
  printf("%-28s %6s %10s %5s %12s\n", "log", "blocks", "arena MiB", "same", "ms a packing");
  char json[1 << 14];
  size_t jl = (size_t)snprintf(json, sizeof json, "{\"bench\": \"capplan_logs\", \"repeat\": %d, \"logs\": [", repeat);
  for (int a = first; a < argc && ms; a++) {
    log_plan lp = {0};
    char share_path[4096];
    size_t len = strlen(argv[a]);
    if (len < 4 || strcmp(argv[a] + len - 4, ".csv") || len + 16 > sizeof share_path) {
      fprintf(stderr, "capplan_logs: %s is not a LOG.csv\n", argv[a]);
      failed = 1;
      continue;
    }
    snprintf(share_path, sizeof share_path, "%.*s_share.txt", (int)(len - 4), argv[a]);
    unsigned char *order = NULL;
    if (read_csv(argv[a], &lp) || read_share(share_path, lp.n, &order)) {
      fprintf(stderr, "capplan_logs: cannot read %s and its _share.txt\n", argv[a]);
      free(lp.b);
      free(lp.waitable);
      failed = 1;
      continue;
    }
    shares s = {lp.n, order, lp.waitable, lp.b, lp.gap};
    uint64_t *off = malloc(sizeof *off * ((size_t)lp.n + 1)), total = 0;
    for (int r = 0; r < repeat && off; r++) {
      double t0 = now_s();
      if (kt_memplan_shared(lp.b, lp.n, ALIGN, share, &s, off, &total) != KT_OK) {
        failed = 1;
        break;
      }
      ms[r] = (now_s() - t0) * 1e3;
    }
    qsort(ms, (size_t)repeat, sizeof *ms, by_double);
    const char *base = strrchr(argv[a], '/') ? strrchr(argv[a], '/') + 1 : argv[a];
    int same = total == lp.plan_bytes;
    failed |= !same;
    printf("%-28s %6d %10.1f %5s %12.3f\n", base, lp.n, (double)total / 1048576.0, same ? "yes" : "NO",
           ms[repeat / 2]);
    if (jl < sizeof json)
      jl += (size_t)snprintf(json + jl, sizeof json - jl, "%s{\"log\": \"%s\", \"blocks\": %d, \"arena_bytes\": %llu, "
                             "\"logged_plan_bytes\": %llu, \"wait_gap\": %lld, \"ms_median\": %.4f}",
                             a > first ? ", " : "", base, lp.n, (unsigned long long)total, lp.plan_bytes, lp.gap,
                             ms[repeat / 2]);
    free(off);
    free(order);
    free(lp.b);
    free(lp.waitable);
  }
  if (jl < sizeof json) printf("%s]}\n", json);
  free(ms);
  return failed;
}
