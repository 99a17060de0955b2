"""python -m kitsune: an environment report; python -m kitsune options: the options table;
python -m kitsune profile [--out DIR] [--max-entries N] [--native] SCRIPT [ARGS...]: runs a
training script under Kitsune's allocator with PyTorch's memory history on, then writes the
snapshot PyTorch's memory visualizer opens and an HTML timeline of memory over time."""
import argparse
import os
import platform
import runpy
import sys

from . import __version__, _native, options


def report():
    print(f"kitsune {__version__}  (python {platform.python_version()}, {platform.machine()})")
    try:
        lib = _native.native()
        print(f"  native library: {_native.library_path()}")
        print(f"  CUDA devices visible to Kitsune: {lib.kt_cuda_device_count()}")
    except _native.KitsuneNotBuiltError as e:
        print(f"  native library: not loaded\n    {e}")
    try:
        import torch
        cuda = torch.version.cuda or "none"
        print(f"  torch {torch.__version__} (CUDA {cuda}), cuda available: {torch.cuda.is_available()}")
        try:
            _native.bridge()
            ops = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kitsune::"))
            print(f"  torch bridge: loaded; torch.ops.kitsune: {', '.join(ops)}")
        except _native.KitsuneError as e:
            print(f"  torch bridge: not loaded ({str(e).split('. ')[0]})")
    except ImportError:
        print("  torch: not installed (needed from the PyTorch-allocator issue on)")
    for var in [o.name for o in options.OPTIONS] + ["NVTX_INJECTION64_PATH"]:
        if os.environ.get(var):
            print(f"  {var}={os.environ[var]}")
    return 0


def _mib(n):
    return f"{n / 2**20:,.1f} MiB"


def profile(argv):
    """python -m kitsune profile: the script runs as __main__ (its own arguments after its
    path); Kitsune's allocator is installed first (--native: PyTorch's, to compare) and
    torch.cuda.memory._record_memory_history records every allocation and free with its
    Python and C++ stack (at most --max-entries). When the script ends, or raises:
    DIR/memory.pickle (torch.cuda.memory._dump_snapshot; drop it on PyTorch's memory
    visualizer page or read it with torch.cuda._memory_viz), DIR/memory_timeline.html and
    DIR/memory_segments.html (torch.cuda._memory_viz.trace_plot / segment_plot), and a
    summary of the peaks. Returns the script's exit status."""
    ap = argparse.ArgumentParser(prog="python -m kitsune profile", description=profile.__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kitsune_profile", help="directory for the snapshot and the HTML (made)")
    ap.add_argument("--max-entries", type=int, default=100000, help="allocation events the history keeps")
    ap.add_argument("--native", action="store_true", help="PyTorch's own allocator instead of Kitsune's")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.max_entries < 1:
        ap.error(f"--max-entries must be at least 1, got {a.max_entries}")
    if not os.path.isfile(a.script):
        ap.error(f"no script at {a.script!r}")
    import torch
    if not torch.cuda.is_available():
        print("python -m kitsune profile: needs a CUDA device (none is visible)", file=sys.stderr)
        return 2
    if not a.native:
        from . import allocator
        allocator.install()
    torch.cuda.memory._record_memory_history(max_entries=a.max_entries)
    status = 0
    sys.argv = [a.script] + a.args
    try:
        runpy.run_path(a.script, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    finally:
        os.makedirs(a.out, exist_ok=True)
        pickle_path = os.path.join(a.out, "memory.pickle")
        torch.cuda.memory._dump_snapshot(pickle_path)
        snap = torch.cuda.memory._snapshot()
        from torch.cuda import _memory_viz as viz
        for name, plot in (("memory_timeline.html", viz.trace_plot), ("memory_segments.html", viz.segment_plot)):
            with open(os.path.join(a.out, name), "w") as f:
                f.write(plot(snap))
        torch.cuda.memory._record_memory_history(enabled=None)
        who = "PyTorch's allocator" if a.native else "Kitsune's allocator"
        events = sum(len(t) for t in snap.get("device_traces", []))
        print(f"kitsune profile ({who}): peak allocated {_mib(torch.cuda.max_memory_allocated())}, peak reserved "
              f"{_mib(torch.cuda.max_memory_reserved())}; {len(snap['segments'])} segments now, {events} events "
              f"recorded\n  {pickle_path}: PyTorch's memory visualizer opens it\n  "
              f"{os.path.join(a.out, 'memory_timeline.html')}, {os.path.join(a.out, 'memory_segments.html')}",
              file=sys.stderr)
    return status


def main(argv):
    if argv[1:] == ["options"]:
        print(options.markdown(), end="")
        return 0
    if argv[1:2] == ["profile"]:
        return profile(argv[2:])
    if argv[1:]:
        print("usage: python -m kitsune [options | profile [--out DIR] [--native] SCRIPT [ARGS...]]", file=sys.stderr)
        return 2
    return report()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
