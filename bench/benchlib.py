"""What every GPU benchmark's result file carries, written one way.

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from benchlib import write_result
    write_result(out_dir, "kernels_loss_head", {"reps": 10, "rows": rows})
"""
import datetime
import json
import os


def write_result(out_dir, bench, payload):
    """Writes <out_dir>/<bench>.json: the payload plus bench name, UTC date, device,
    torch version and KT_COMMIT (the caller names the commit, taken on the machine the
    tree came from: on the GPU machine's copy `git rev-parse HEAD` named a stale commit,
    a09cec9 for fd66c6b's tree in bench/results/archive/h100_pytest_models_gmem_fd66c6b.log).
    Returns the path."""
    import torch
    res = {"bench": bench, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "commit": os.environ.get("KT_COMMIT", "?")}
    res.update(payload)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, bench + ".json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)
    return path


def cuda_ms(fn, reps, before=None):
    """Median milliseconds of fn() over reps calls, each between two CUDA events on the
    current stream; before() (an L2 flush, say) runs ahead of each, untimed."""
    import statistics

    import torch
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(fn, xs, reps, calls=50, reset=None):
    """Microseconds a call of fn: calls calls, rotating over the inputs xs, captured in one
    CUDA graph (after a warm-up on a side stream, then reset() if given) and its replay
    timed with CUDA events, median of reps replays. L2 is not flushed: as inside a
    training step's graph, an input is what a kernel has just written."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs:
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(xs[i % len(xs)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def run_child(cmd, model, recipe, env=None):
    """Runs a benchmark's child process (cmd), passing its output through, and returns the
    row it printed as "ROW <json>", or an error row naming its exit status."""
    import subprocess
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    row = None
    for line in proc.stdout:
        if line.startswith("ROW "):
            row = json.loads(line[4:])
        else:
            print(line, end="", flush=True)
    rc = proc.wait()
    return row or {"model": model, "recipe": recipe, "error": f"the child process exited with {rc} and no result"}
