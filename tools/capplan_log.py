"""What a recorded capture's memory is made of, from the logs the bridge writes with
KITSUNE_CAPPLAN_LOG=DIR (one CSV a plan compile_step takes: a row a recorded block):

    python3 tools/capplan_log.py DIR/capplan_*.csv

For each log: the live bytes over the recorded events (a block freed during the capture
lives over [start, end); one freed after it, or still live, to the end), their peak and
what is live there (by stream, and whether used on another stream), each stream's own
peak, and the plan's extent against them. Off the GPU: the logs come from a device run
(e.g. bench/graph_memory.py with the variable set).

    --largest K     also list the K largest blocks live at the peak (block, MiB, events)
    --without B,..  the peak again with those blocks left out: what the capture would
                    peak at if the operations that allocate them did not
"""
import argparse
import csv

MiB = 2 ** 20


def load(path):
    """(header dict, rows): the '# key value ...' line and the block rows as ints."""
    head, rows = {}, []
    with open(path) as f:
        first = f.readline()
        if not first.startswith("#"):
            raise ValueError(f"{path}: not a capplan log (no '# plan_bytes ...' line)")
        words = first[1:].split()
        head = {k: int(v) for k, v in zip(words[::2], words[1::2])}
        for r in csv.DictReader(f):
            rows.append({k: int(v) for k, v in r.items()})
    return head, rows


def lifetimes(rows):
    """(size, stream, start, end, used elsewhere) a block; end = the last event + 1 for
    blocks freed after the capture or still live."""
    last = max([r["start"] for r in rows] + [r["end"] for r in rows if r["end"] >= 0 and not r["after"]] + [0]) + 1
    return [(r["size"], r["stream"], r["start"], last if r["end"] < 0 or r["after"] else r["end"], r["uses"] > 0)
            for r in rows]


def peak(blocks):
    """(peak bytes, the event it is first reached at) over blocks' [start, end)."""
    ev = sorted([(s, sz) for sz, _, s, e, _ in blocks] + [(e, -sz) for sz, _, s, e, _ in blocks],
                key=lambda x: (x[0], x[1]))   # frees first at one event
    live = most = 0
    at = None
    for t, d in ev:
        live += d
        if live > most:
            most, at = live, t
    return most, at


def report(path, largest=0, without=()):
    head, rows = load(path)
    blocks = lifetimes(rows)
    most, at = peak(blocks)
    lines = [f"{path}: {len(rows)} blocks, plan {head.get('plan_bytes', 0) / MiB:.1f} MiB, "
             f"recorded peak (the plan's bound) {head.get('peak_bytes', 0) / MiB:.1f}, "
             f"streams' own peaks {head.get('stream_peak_bytes', 0) / MiB:.1f}, graph nodes {head.get('graph_nodes', 0)}, "
             f"pairs shared across streams {head.get('cross_shares', 0)}",
             f"  live bytes, every block to its free: peak {most / MiB:.1f} MiB at event {at}"]
    if at is not None:
        here = [b for b in blocks if b[2] <= at < b[3]]
        by = {}
        for sz, s, _, _, used in here:
            k = (s, used)
            by[k] = by.get(k, 0) + sz
        for (s, used), sz in sorted(by.items()):
            n = sum(1 for b in here if (b[1], b[4]) == (s, used))
            lines.append(f"    stream {s}{', used on another' if used else ''}: {sz / MiB:.1f} MiB in {n} blocks")
        live = sorted((i for i, b in enumerate(blocks) if b[2] <= at < b[3]), key=lambda i: -blocks[i][0])
        for i in live[:largest]:
            sz, s, start, end, _ = blocks[i]
            lines.append(f"    block {rows[i]['block']}: {sz / MiB:.3f} MiB, stream {s}, events [{start}, {end})")
    for s in sorted({b[1] for b in blocks}):
        p, _ = peak([b for b in blocks if b[1] == s])
        lines.append(f"  stream {s} alone: peak {p / MiB:.1f} MiB")
    if without:
        rest = [b for b, r in zip(blocks, rows) if r["block"] not in without]
        p, t = peak(rest)
        lines.append(f"  without blocks {', '.join(map(str, sorted(without)))}: peak {p / MiB:.1f} MiB at event {t}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--largest", type=int, default=0)
    ap.add_argument("--without", default="", help="block numbers, comma-separated")
    args = ap.parse_args()
    without = {int(b) for b in args.without.split(",") if b}
    for path in args.logs:
        print(report(path, args.largest, without))


if __name__ == "__main__":
    main()
