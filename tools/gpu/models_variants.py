"""bench/models.py once per environment setting, each in fresh processes, and a line
per row with what the planned memory did (waits, plan and budget, late joins):

    python tools/gpu/models_variants.py --variants "KITSUNE_CONV_GRADS=together;KITSUNE_PLAN_WAITS=0" \
        -- --models inception:8 --recipes kitsune --no-cudnn-benchmark --cudnn-mode-b --kitsune-allocator

A variant is one or more NAME=VALUE separated by spaces; variants are separated by ';'
and the empty variant (the settings as they are) runs first. What follows -- goes to
bench/models.py. Writes --out/models_variants.json: each variant's rows.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
from benchlib import write_result  # noqa: E402


def summary(row):
    if "error" in row:
        return f"FAILED {row['error'][:100]}"
    cs = row.get("compile_step") or {}
    mp, cg = cs.get("memory_plan") or {}, cs.get("conv_grads") or {}
    mib = lambda k: f"{mp[k] / 2**20:.1f}" if mp.get(k) is not None else "-"   # noqa: E731
    late = cg.get("late_limited") or cg.get("late_refused") or ""
    cp = cs.get("capture_parts") or {}
    parts = "/".join(f"{cp[k]:.3f}" for k in ("record", "plan", "place")) + " s" if cp else "-"   # of the capture phase
    way = ("late" if cg.get("late") else "apart" if cg.get("apart") else "together") if cg else "-"
    return (f"{row['ms']:7.3f} ms  setup {row['setup_s']:5.2f} s  peak {row['peak_alloc_mib']:7.1f} MiB  "
            f"streams {cs.get('streams')}  plan {mib('plan_bytes')} / unwaited {mib('unwaited_bytes')} / "
            f"budget {mib('budget')} MiB  waits {mp.get('waits')}  conv grads {way}  capture {parts}  {late[:60]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", required=True)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "bench", "results"))
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    variants = [""] + [v.strip() for v in args.variants.split(";") if v.strip()]
    results = []
    for v in variants:
        env = dict(os.environ)
        env.update(kv.split("=", 1) for kv in v.split())
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, os.path.join(HERE, "..", "..", "bench", "models.py"), "--out", tmp] + rest
            print(f"== variant: {v or '(as set)'}", flush=True)
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False)
            path = os.path.join(tmp, "models.json")
            rows = []
            if os.path.exists(path):
                with open(path) as f:
                    rows = json.load(f)["rows"]
        for r in rows:
            print(f"  {r['model']:12s} {r['recipe']:12s} {summary(r)}", flush=True)
        results.append({"variant": v, "rows": rows})
    write_result(args.out, "models_variants", {"args": rest, "variants": results})


if __name__ == "__main__":
    main()
