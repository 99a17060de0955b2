#!/usr/bin/env python3
"""bench/churn_trace.py — writes the churn of issue 45 as an allocation trace.

    python3 bench/churn_trace.py [-o FILE] [--allocs N] [--ring R] [--max-log2 K] [--seed S]

The churn: a ring of R live blocks (64); allocation i gets a size drawn log-uniformly
from 1 byte to 2^K bytes (K = 26: 64 MiB) and replaces the block in slot i mod R. As
from Python (`ring[i % R] = torch.empty(n, dtype=torch.uint8, device="cuda")`), the new
block is allocated before the one it replaces is freed. N allocations (20,000), then the
last R blocks are freed. One thread, the default stream, a fixed seed: the same file
every time, so it is generated rather than committed (about 1.2 MB).

The format is what kt_trace_start records and bench/alloc_replay reads
(`thread,time_ns,action,ptr,size,stream`); pointers are ids, times are the event index.

    python3 bench/churn_trace.py -o build/churn.csv
    build/bench/alloc_replay build/churn.csv --vmm --passes 2    # backend calls per pass

The generator is xorshift64* (tests/c/common.h's test_rand), and a size is
floor(2^(K*u)) with u = (r >> 11) / 2^53, so tests/c/unit/test_churn.c draws the same
sizes from the same seed in C.
"""
import argparse
import sys

MASK = (1 << 64) - 1


def xorshift64s(state):
    """One step of test_rand: returns (new state, output)."""
    s = state
    s ^= s >> 12
    s ^= (s << 25) & MASK
    s ^= s >> 27
    return s, (s * 2685821657736338717) & MASK


def churn(allocs=20000, ring=64, max_log2=26, seed=45):
    """Yields (action, id, size): 'alloc' or 'free' events of the ring churn."""
    state = seed
    slots = [None] * ring
    for i in range(allocs):
        state, r = xorshift64s(state)
        u = (r >> 11) * (1.0 / (1 << 53))
        size = int(2.0 ** (max_log2 * u))
        yield "alloc", i + 1, size
        old = slots[i % ring]
        if old is not None:
            yield "free", old[0], old[1]
        slots[i % ring] = (i + 1, size)
    for old in slots:
        if old is not None:
            yield "free", old[0], old[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--out", help="trace file (default: standard output)")
    ap.add_argument("--allocs", type=int, default=20000)
    ap.add_argument("--ring", type=int, default=64)
    ap.add_argument("--max-log2", type=int, default=26, help="largest size is below 2^K bytes")
    ap.add_argument("--seed", type=int, default=45)
    a = ap.parse_args()
    if a.seed == 0:
        ap.error("--seed must be nonzero (xorshift)")
    out = open(a.out, "w") if a.out else sys.stdout
    out.write("thread,time_ns,action,ptr,size,stream\n")
    for t, (action, ident, size) in enumerate(churn(a.allocs, a.ring, a.max_log2, a.seed)):
        out.write("0,%d,%s,0x%x,%d,0x0\n" % (t, action, ident, size))
    if a.out:
        out.close()


if __name__ == "__main__":
    main()
