/* bench/probe_costs.c — what the hot path's primitives cost on this host.
 * The allocator's fast path is a handful of loads plus one lock and one atomic;
 * this measures those primitives alone, and cache-line transfer between two
 * threads pinned to chosen CPUs, so pair timings can be read against them.
 *   probe_costs [cpuA cpuB]...   pairs of CPUs for the two-thread tests */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#include "bench_common.h"
#include "internal.h"

/* bench/probe_costs.c: compares the coarse clock the pool stamps allocations with */

#define N 20000000L

static _Alignas(64) _Atomic uint64_t shared;
static pthread_barrier_t bar;

typedef struct { int cpu; double ns; int mode; } arg_t;

static void pin(int cpu) {
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *hammer(void *p) {
  arg_t *a = p;
  pin(a->cpu);
  pthread_barrier_wait(&bar);
  double t0 = now_s();
  for (long i = 0; i < N / 10; i++) atomic_fetch_add_explicit(&shared, 1, memory_order_relaxed);
  a->ns = (now_s() - t0) * 1e9 / (N / 10);
  return NULL;
}

int main(int argc, char **argv) {
  double t0; volatile uint64_t sink = 0;
  t0 = now_s(); for (long i = 0; i < N; i++) sink += __builtin_ia32_rdtsc(); printf("rdtsc                    %6.2f ns\n", (now_s() - t0) * 1e9 / N);
  t0 = now_s(); for (long i = 0; i < N / 10; i++) sink += kt__now_ns(); printf("clock_gettime(MONOTONIC) %6.2f ns\n", (now_s() - t0) * 1e9 / (N / 10));
  struct timespec ts;
  t0 = now_s(); for (long i = 0; i < N; i++) { clock_gettime(CLOCK_MONOTONIC_COARSE, &ts); sink += (uint64_t)ts.tv_nsec; }
  printf("clock_gettime(COARSE)    %6.2f ns\n", (now_s() - t0) * 1e9 / N);
  _Atomic uint64_t x = 0;
  t0 = now_s(); for (long i = 0; i < N; i++) atomic_fetch_add_explicit(&x, 1, memory_order_relaxed); printf("lock xadd uncontended    %6.2f ns\n", (now_s() - t0) * 1e9 / N);
  kt_spinlock l = {0};
  t0 = now_s(); for (long i = 0; i < N; i++) { kt_spin_lock(&l); kt_spin_unlock(&l); } printf("spinlock lock+unlock     %6.2f ns\n", (now_s() - t0) * 1e9 / N);
  (void)sink;
  pthread_barrier_init(&bar, NULL, 2);
  for (int i = 1; i + 1 < argc; i += 2) {
    arg_t a = {atoi(argv[i]), 0, 0}, b = {atoi(argv[i + 1]), 0, 0};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, hammer, &a); pthread_create(&tb, NULL, hammer, &b);
    pthread_join(ta, NULL); pthread_join(tb, NULL);
    printf("contended xadd cpus %2d,%2d %6.1f ns/op\n", a.cpu, b.cpu, (a.ns + b.ns) / 2);
  }
  return 0;
}
