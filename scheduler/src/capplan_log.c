/* scheduler/src/capplan_log.c — a capture plan written out for analysis off the GPU
 * (kitsune/capplan.h, kt_capplan_log; the bridge calls it when KITSUNE_CAPPLAN_LOG
 * names a directory).
 *
 * Two files a plan, dir/capplan_<pid>_<n> with n counting the plans this process
 * logged:
 *   .csv        a header line "# plan_bytes ... wait_by_slack ...", the column names,
 *               then a row a recorded block: block,size,stream,start,end,after,uses,
 *               unordered,offset (stream: the order streams first appeared in; offset:
 *               the planned offset, -1 for a block the plan left out);
 *   _share.txt  a line a planned block i, in the CSV's order of planned blocks:
 *               "i: j ..." for each j that may reuse i's bytes by the order
 *               (kt_caprec_share_matrix; plans of up to KT_CAPPLAN_ORDER_MAX_BLOCKS
 *               blocks only).
 * tools/capplan_log.py and tools/capplan_pack.py read them; keep the format.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "kitsune/capplan.h"

/* The pairs of planned blocks that may share bytes, a line a block. Best effort. */
static void write_share(const char *path, const kt_caprec *rec, int32_t blocks) {
  const size_t n = (size_t)blocks;
  if (n > KT_CAPPLAN_ORDER_MAX_BLOCKS) return;
  uint64_t *bits = calloc((n * n + 63) / 64 + 1, sizeof *bits);   /* at most 32 MiB */
  if (!bits) return;
  FILE *f = NULL;
  if (kt_caprec_share_matrix(rec, blocks, bits) == KT_OK && (f = fopen(path, "w"))) {
    for (size_t i = 0; i < n; i++) {
      fprintf(f, "%zu:", i);
      for (size_t j = 0; j < n; j++)
        if ((bits[(i * n + j) / 64] >> ((i * n + j) % 64)) & 1) fprintf(f, " %zu", j);
      fprintf(f, "\n");
    }
    fclose(f);
  }
  free(bits);
}

kt_status kt_capplan_log(const char *dir, const kt_caprec *rec, const kt_capplan *plan) {
  static atomic_int seq;
  if (!dir || !*dir || !rec || !plan) return KT_ERR_INVALID;
  char path[4096];
  const int len = snprintf(path, sizeof path - 16, "%s/capplan_%d_%d", dir, (int)getpid(), atomic_fetch_add(&seq, 1));
  if (len < 0 || (size_t)len >= sizeof path - 16) return KT_ERR_INVALID;   /* room for the suffixes */
  kt_capplan_info pi;
  kt_capplan_get_info(plan, &pi);
  snprintf(path + len, 16, "_share.txt");
  write_share(path, rec, pi.blocks);
  snprintf(path + len, 16, ".csv");
  FILE *f = fopen(path, "w");
  if (!f) return KT_ERR_IO;
  fprintf(f,
          "# plan_bytes %zu peak_bytes %zu stream_peak_bytes %zu graph_nodes %d cross_shares %d wait_gap %lld "
          "wait_by_slack %d\n",
          pi.plan_bytes, pi.peak_bytes, pi.group_peak_bytes, pi.graph_nodes, pi.cross_shares, (long long)pi.wait_gap,
          pi.wait_by_slack);
  fprintf(f, "block,size,stream,start,end,after,uses,unordered,offset\n");
  kt_caprec_info ri;
  kt_caprec_get_info(rec, &ri);
  kt_stream_t *streams = NULL;   /* in the order they first appear */
  size_t nstreams = 0, cap = 0;
  kt_status st = KT_OK;
  for (int32_t i = 0, j = 0; i < ri.blocks; i++) {
    kt_caprec_block b;
    if (kt_caprec_get_block(rec, i, &b) != KT_OK) break;
    size_t k = 0;
    while (k < nstreams && streams[k] != b.stream) k++;
    if (k == nstreams) {
      if (nstreams == cap) {
        kt_stream_t *more = realloc(streams, (cap ? 2 * cap : 8) * sizeof *streams);
        if (!more) {
          st = KT_ERR_HOST_OOM;
          break;
        }
        streams = more;
        cap = cap ? 2 * cap : 8;
      }
      streams[nstreams++] = b.stream;
    }
    uint64_t off = 0, size = 0;
    long long o = b.end >= 0 && kt_capplan_get_block(plan, j++, &off, &size) == KT_OK ? (long long)off : -1;
    fprintf(f, "%d,%llu,%zu,%lld,%lld,%d,%d,%d,%lld\n", i, (unsigned long long)b.size, k, (long long)b.start,
            (long long)b.end, b.after, b.uses, b.unordered, o);
  }
  free(streams);
  if (fclose(f) != 0 && st == KT_OK) st = KT_ERR_IO;
  return st;
}
