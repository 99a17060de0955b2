/* kitsune/memplan.h — offsets for blocks whose lifetimes are known (pure C).
 *
 * The planning half of a capture pool laid out ahead of time: a CUDA graph's
 * allocations, recorded once as (size, allocated at event `start`, freed at event
 * `end`), are packed into one arena so that two blocks share bytes only when their
 * lifetimes do not overlap and they are of one group. First fit: each block, in turn, at the lowest aligned
 * offset where it overlaps no placed block whose lifetime meets its own; six
 * orders are tried (size, size x lifetime, lifetime, start, the bytes of the blocks
 * it must stay apart from, size x those; larger first) and the smallest arena kept.
 * The arena is never smaller than the peak of live bytes (kt_memplan_peak), the
 * bound the tests hold it against; finding the smallest arena is NP-hard in
 * general. On 200 training-step-shaped traces (tests/c/unit/test_memplan.c) the
 * arena was 1.027x the live peak on average and 1.157x at worst (1.047x and 1.16x
 * with the first four orders; size order alone gave 1.20x at worst).
 *
 * compile_step plans its graphs' memory with it (kitsune/capplan.h).
 * Functions return KT_OK, KT_ERR_INVALID (NULL, n < 0, start >= end, align not a
 * power of two, a size that overflows when aligned) or KT_ERR_HOST_OOM; on error
 * nothing is written.
 */
#ifndef KITSUNE_MEMPLAN_H
#define KITSUNE_MEMPLAN_H

#include <stdint.h>

#include "kitsune/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kt_memplan_block {
  uint64_t size;          /* bytes; 0 is allowed (offset 0, takes no room) */
  int64_t start, end;     /* live over events [start, end); end > start */
  int32_t group;          /* blocks of different groups never share bytes (CUDA streams with
                           * no order between them); 0 for all when there is one */
} kt_memplan_block;

/* offsets[i] for block i, each a multiple of align; *total = the arena's bytes. */
kt_status kt_memplan(const kt_memplan_block *blocks, int32_t n, uint64_t align, uint64_t *offsets,
                     uint64_t *total);

/* Whether block `earlier` (its lifetime ends at or before `later`'s start) may share
 * bytes with block `later`: 1 yes, 0 no. */
typedef int (*kt_memplan_share_fn)(void *ctx, int32_t earlier, int32_t later);

/* kt_memplan where share, not the groups, says which blocks whose lifetimes do not
 * meet may share bytes (a CUDA graph's blocks on streams that one ordered after the
 * other). share NULL: kt_memplan. */
kt_status kt_memplan_shared(const kt_memplan_block *blocks, int32_t n, uint64_t align, kt_memplan_share_fn share,
                            void *ctx, uint64_t *offsets, uint64_t *total);

/* The most bytes live at one event, sizes rounded up to align: no plan is smaller
 * (groups are ignored: with several, this bound is not tight). */
kt_status kt_memplan_peak(const kt_memplan_block *blocks, int32_t n, uint64_t align, uint64_t *peak);

#ifdef __cplusplus
}
#endif
#endif
