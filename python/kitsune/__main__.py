"""python -m kitsune: an environment report; python -m kitsune options: the options table."""
import os
import platform
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


def main(argv):
    if argv[1:] == ["options"]:
        print(options.markdown(), end="")
        return 0
    if argv[1:]:
        print("usage: python -m kitsune [options]", file=sys.stderr)
        return 2
    return report()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
