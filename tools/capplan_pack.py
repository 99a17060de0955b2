"""How far a recorded capture's plan is from the smallest arena its order allows, off
the GPU, from the logs the bridge writes with KITSUNE_CAPPLAN_LOG=DIR (the CSV and
its _share.txt: which planned block may reuse which one's bytes):

    python3 tools/capplan_pack.py DIR/capplan_<pid>_<n>.csv [--tries N] [--seed S]

For each log:
  plan         the extent kt_memplan_shared found (the log's plan_bytes), and this
               tool's first fit in the orders scheduler/src/memplan.c tries now (six
               since the conflict orders; on a log of a plan made with the same orders
               they agree: a check that the log is read as the C code reads it)
  bound        a lower bound on any arena: the heaviest clique found of blocks that
               pairwise may not share bytes (lifetimes that meet, or an order that does
               not let the later reuse the earlier's bytes), grown greedily from the
               blocks live at each event (at least the live peak)
  orders       first fit in N random orders (sizes larger first, shuffled within a
               factor of two): the best extent found
The numbers are MiB; the blocks are sized as planned (512-byte multiples).

    python3 tools/capplan_pack.py LOG.csv --gaps 200,100,20,10,0

instead packs the order's pairs plus those a plan with waits at each gap adds
(kt_capplan_create_within: both blocks noted on the order, the later one allocated at
least gap recorded events after the earlier one's free), in kt_memplan's orders.
"""
import argparse
import csv
import os
import random

MiB = 2 ** 20
ALIGN = 512


def waited_pairs(blocks, waitable, gap):
    """The pairs a plan with waits at this gap lets share besides the order's
    (kt_capplan_create_within): both blocks noted on the order, the later one allocated
    at least gap recorded events after the earlier one's free."""
    n = len(blocks)
    return {(i, j) for i in range(n) for j in range(n)
            if i != j and waitable[i] and waitable[j] and blocks[j][1] - blocks[i][2] >= gap}


def load(path, waits=True):
    """(header, planned blocks [(size, start, end)], share set {(i, j)}, waitable flags);
    waits=False: the order's pairs alone, whatever the plan's wait_gap."""
    with open(path) as f:
        first = f.readline()
        words = first[1:].split()
        head = {k: int(v) for k, v in zip(words[::2], words[1::2])}
        rows = [{k: int(v) for k, v in r.items()} for r in csv.DictReader(f)]
    planned = [r for r in rows if r["end"] >= 0]   # freed: planned (live ones are left out)
    last = max([r["start"] for r in rows] + [r["end"] for r in rows]) + 1
    blocks = [((r["size"] + ALIGN - 1) // ALIGN * ALIGN, r["start"], last if r["after"] else r["end"]) for r in planned]
    share = set()
    with open(path[:-len(".csv")] + "_share.txt") as f:
        for line in f:
            i, rest = line.split(":")
            share.update((int(i), int(j)) for j in rest.split())
    waitable = [not r["after"] and not r["unordered"] for r in planned]
    if waits and head.get("wait_by_slack"):   # by node times, which the log does not hold
        raise ValueError(f"{path}: its waits were bought by slack in a timed replay, which the log does not hold; "
                         f"--gaps sweeps the order's pairs with waits by recorded events instead")
    if waits and head.get("wait_gap", -1) >= 0:   # a plan with waits: the pairs far enough apart share too
        share |= waited_pairs(blocks, waitable, head["wait_gap"])
    return head, blocks, share, waitable


def apart_fn(blocks, share):
    def apart(i, j):
        (_, si, ei), (_, sj, ej) = blocks[i], blocks[j]
        if sj < ei and si < ej:
            return True
        return (i, j) not in share if ei <= sj else (j, i) not in share
    return apart


def first_fit(blocks, order, apart):
    off, placed, arena = {}, [], 0
    for i in order:
        size = blocks[i][0]
        meet = sorted((off[j], off[j] + blocks[j][0]) for j in placed if blocks[j][0] and apart(i, j))
        at = 0
        for lo, hi in meet:
            if not size or at + size <= lo:
                break
            at = max(at, hi)
        off[i] = at
        placed.append(i)
        arena = max(arena, at + size)
    return arena, off


def c_orders(blocks, apart):
    """kt_memplan_shared's six orders (scheduler/src/memplan.c key_of / by_key)."""
    n = len(blocks)
    conflict = [sum(blocks[j][0] for j in range(n) if j != i and apart(i, j)) for i in range(n)]

    def keyed(k):
        return sorted(range(n), key=lambda i: (tuple(-v for v in k(i)[:2]), blocks[i][1], i))
    size = lambda i: (blocks[i][0], 0)                                   # noqa: E731
    area = lambda i: (blocks[i][0] * (blocks[i][2] - blocks[i][1]), blocks[i][0])   # noqa: E731
    length = lambda i: (blocks[i][2] - blocks[i][1], blocks[i][0])       # noqa: E731
    start = lambda i: (-blocks[i][1], blocks[i][0])                      # noqa: E731
    by_conflict = lambda i: (conflict[i], blocks[i][0])                  # noqa: E731
    size_conflict = lambda i: (blocks[i][0] * conflict[i], blocks[i][0])   # noqa: E731
    return [keyed(k) for k in (size, area, length, start, by_conflict, size_conflict)]


def clique_bound(blocks, apart):
    """The heaviest clique found: for each event, the blocks live there (pairwise
    apart), grown by the largest blocks apart from every member."""
    best, best_set = 0, []
    by_size = sorted(range(len(blocks)), key=lambda i: -blocks[i][0])
    for t in sorted({b[1] for b in blocks}):
        members = [i for i, (_, s, e) in enumerate(blocks) if s <= t < e]
        inside = set(members)
        for i in by_size:
            if i not in inside and blocks[i][0] and all(apart(i, j) for j in members):
                members.append(i)
                inside.add(i)
        w = sum(blocks[i][0] for i in members)
        if w > best:
            best, best_set = w, members
    return best, best_set


def gap_sweep(path, gaps):
    """The extent this tool's first fit (kt_memplan's orders) finds when waits let the
    pairs at least each gap apart share too, from the order's pairs alone."""
    head, blocks, share, waitable = load(path, waits=False)
    lines = [f"{os.path.basename(path)}: live peak {head.get('peak_bytes', 0) / MiB:.1f} MiB; gap: extent MiB "
             f"(pairs only waits let share)"]
    for gap in gaps:
        extra = waited_pairs(blocks, waitable, gap) - share
        apart = apart_fn(blocks, share | extra)
        extent = min(first_fit(blocks, o, apart)[0] for o in c_orders(blocks, apart))
        lines.append(f"  {gap:5d}: {extent / MiB:.1f} ({len(extra)})")
    return "\n".join(lines)


def report(path, tries, seed):
    head, blocks, share, _ = load(path)
    apart = apart_fn(blocks, share)
    c_best = min(first_fit(blocks, o, apart)[0] for o in c_orders(blocks, apart))
    bound, members = clique_bound(blocks, apart)
    rng = random.Random(seed)
    best = c_best
    for _ in range(tries):
        o = sorted(range(len(blocks)), key=lambda i: -blocks[i][0] * rng.uniform(0.5, 1.0))
        best = min(best, first_fit(blocks, o, apart)[0])
    return (f"{os.path.basename(path)}: {len(blocks)} planned blocks, {len(share)} pairs may share; "
            f"plan {head.get('plan_bytes', 0) / MiB:.1f} MiB (this tool's first fit {c_best / MiB:.1f}), "
            f"live peak {head.get('peak_bytes', 0) / MiB:.1f}, clique bound {bound / MiB:.1f} "
            f"({len(members)} blocks), best of {tries} random orders {best / MiB:.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--tries", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gaps", default=None,
                    help="comma-separated wait gaps: instead of the report, the extent with waits at each")
    a = ap.parse_args()
    for path in a.logs:
        print(gap_sweep(path, [int(g) for g in a.gaps.split(",")]) if a.gaps else report(path, a.tries, a.seed))


if __name__ == "__main__":
    main()
