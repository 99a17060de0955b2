/* allocator/src/trace.c — allocation trace: one CSV line per event.
 *   thread,time_ns,action,ptr,size,stream
 * Written under a lock with stdio buffering; the fast path only tests the hooks
 * word. bench/alloc_replay reads this format back.
 */
#include <unistd.h>
#include <sys/syscall.h>

#include "internal.h"

static __thread long tid;

void kt__trace(kt_pool_t *p, const char *action, uintptr_t ptr, size_t size, kt_stream_t s) {
  if (!tid) tid = syscall(SYS_gettid);
  uint64_t t = kt__now_ns();
  pthread_mutex_lock(&p->trace_lock);
  if (p->trace)
    fprintf(p->trace, "%ld,%llu,%s,0x%llx,%zu,0x%llx\n", tid, (unsigned long long)t, action,
            (unsigned long long)ptr, size, (unsigned long long)(uintptr_t)s);
  pthread_mutex_unlock(&p->trace_lock);
}

kt_status kt_trace_start(kt_pool_t *p, const char *path) {
  if (!p || !path) return KT_ERR_INVALID;
  FILE *f = fopen(path, "w");
  if (!f) return KT_ERR_IO;
  fputs("thread,time_ns,action,ptr,size,stream\n", f);
  pthread_mutex_lock(&p->trace_lock);
  FILE *old = p->trace;
  p->trace = f;
  pthread_mutex_unlock(&p->trace_lock);
  if (old) fclose(old);
  atomic_fetch_or(&p->hooks, KT_HOOK_TRACE);
  return KT_OK;
}

kt_status kt_trace_stop(kt_pool_t *p) {
  if (!p) return KT_ERR_INVALID;
  atomic_fetch_and(&p->hooks, ~KT_HOOK_TRACE);
  pthread_mutex_lock(&p->trace_lock);
  FILE *f = p->trace;
  p->trace = NULL;
  pthread_mutex_unlock(&p->trace_lock);
  if (f && fclose(f) != 0) return KT_ERR_IO;
  return KT_OK;
}
