"""The Python package: import without a build, loader diagnostics, the Pool API."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYDIR = os.path.join(REPO, "python")


def run_py(code, **env):
    e = dict(os.environ, PYTHONPATH=PYDIR, **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)


def test_import_works_without_a_build_and_first_use_says_how_to_fix():
    r = run_py("import kitsune\n"
               "try:\n    kitsune.native()\nexcept kitsune.KitsuneNotBuiltError as e:\n    print('ERR', e)\n",
               KITSUNE_LIBRARY="/nonexistent/libkitsune.so")
    assert r.returncode == 0, r.stderr
    assert "ERR libkitsune.so is not built" in r.stdout
    assert "/nonexistent/libkitsune.so (missing)" in r.stdout
    assert "run `make`" in r.stdout


def test_env_report_runs_with_and_without_library():
    r = run_py("import runpy; runpy.run_module('kitsune', run_name='__main__')", KITSUNE_LIBRARY="/nope.so")
    assert "native library: not loaded" in r.stdout
    r = run_py("import runpy; runpy.run_module('kitsune', run_name='__main__')")
    assert "CUDA devices visible to Kitsune:" in r.stdout, r.stdout + r.stderr


def test_import_kitsune_alone_registers_the_ops():
    pytest.importorskip("torch")
    r = run_py("import torch, kitsune\n"
               "print(torch.ops.kitsune.add_relu(torch.tensor([1., -3.]), torch.tensor([1., 1.])).tolist())\n"
               "print('cuda initialised', torch.cuda.is_initialized())\n",
               KITSUNE_LIBRARY=os.path.join(REPO, "build", "libkitsune.so"))
    assert r.returncode == 0, r.stderr
    assert "[2.0, 0.0]" in r.stdout and "cuda initialised False" in r.stdout, r.stdout


def test_torch_compile_finds_the_backend_after_import_kitsune_alone():
    """The torch_dynamo_backends entry point (pyproject.toml): it exists only where the
    package is installed (make test installs it, editable, into its virtual environment)."""
    pytest.importorskip("torch")
    import importlib.metadata as md
    if not any(ep.name == "kitsune" for ep in md.entry_points(group="torch_dynamo_backends")):
        pytest.skip("kitsune is not installed in this Python (no entry point): make test installs it")
    r = run_py("import torch, kitsune\n"
               "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())\n"
               "x = torch.randn(4, 8)\n"
               "out = torch.compile(m, backend='kitsune')(x)\n"
               "torch.testing.assert_close(out, m(x))\n"
               "print('fused', kitsune.fx.last_compile_report.fused)\n",
               KITSUNE_LIBRARY=os.path.join(REPO, "build", "libkitsune.so"))
    assert r.returncode == 0, r.stderr
    assert "fused [" in r.stdout and "bias_gelu" in r.stdout, r.stdout


@pytest.fixture
def pool():
    from kitsune.allocator import Pool
    p = Pool(backend="fake")
    yield p
    p.close()


def test_pool_alloc_free_and_pytorch_style_stats(pool):
    a = pool.alloc(1000)
    b = pool.alloc(5 << 20)
    assert a % 512 == 0 and b % 512 == 0 and a != b
    st = pool.stats()
    assert st["allocated_bytes.all.current"] == 1024 + (5 << 20)
    assert st["allocation.all.current"] == 2
    assert st["size_classes"][1024] == (1, 1)
    pool.free(a, 1000)
    pool.free(b)
    st = pool.stats()
    assert st["allocated_bytes.all.current"] == 0
    assert st["allocated_bytes.all.peak"] == 1024 + (5 << 20)
    assert st["reserved_bytes.all.current"] > 0
    pool.empty_cache()
    assert pool.stats()["reserved_bytes.all.current"] == 0
    pool.validate()
    assert pool.alloc(0) == 0


def test_vmm_pool_maps_granules_and_gives_idle_ones_back():
    from kitsune.allocator import Pool
    with Pool(backend="fake", vmm=True) as p:
        assert p.stats()["vmm"] is True
        a, b = p.alloc(20 << 20), p.alloc(20 << 20)
        p.free(a)                       # a 20 MiB hole: too small for what comes next
        c = p.alloc(30 << 20)
        st = p.stats()
        assert st["reserved_bytes.all.current"] == 50 << 20, st["reserved_bytes.all.current"]
        assert st["num_sync_all_streams"] == 1
        assert st["segment.all.current"] == 1       # one address range, not three segments
        p.validate()
        p.free(b)
        p.free(c)
        p.empty_cache()
        assert p.stats()["reserved_bytes.all.current"] == 0
    with Pool(backend="fake") as p:
        assert p.stats()["vmm"] is False


def test_errors_name_the_bad_value(pool):
    import kitsune
    with pytest.raises(ValueError, match=r"free\(ptr=0x1234"):
        pool.free(0x1234)
    with pytest.raises(ValueError, match=r"size=-1"):
        pool.alloc(-1)
    with pytest.raises(ValueError, match=r"set_memory_fraction\(1.5\)"):
        pool.set_memory_fraction(1.5)
    pool.set_memory_limit(8 << 20)
    with pytest.raises(kitsune.KitsuneOutOfMemoryError) as e:
        pool.alloc(16 << 20)
    msg = str(e.value)
    assert "tried to allocate 16.00 MiB" in msg and "limit 8.00 MiB" in msg and "Hint" in msg
    assert isinstance(e.value, MemoryError)
    with pytest.raises(ValueError, match="backend='tpu'"):
        from kitsune.allocator import Pool
        Pool(backend="tpu")


def test_trace_then_replay(pool, tmp_path):
    path = tmp_path / "t.csv"
    with pool.trace(path):
        ptrs = [pool.alloc(s, stream=0x100) for s in (100, 200000, 3 << 20)]
        for p in ptrs:
            pool.free(p)
    lines = path.read_text().splitlines()
    assert lines[0] == "thread,time_ns,action,ptr,size,stream"
    assert [l.split(",")[2] for l in lines[1:]] == ["alloc"] * 3 + ["free"] * 3
    replay = os.path.join(REPO, "build", "bench", "alloc_replay")
    if not os.path.exists(replay):
        pytest.skip("build/bench/alloc_replay not built")
    r = subprocess.run([replay, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "6 events" in r.stdout and "peak live 3345828" in r.stdout


def test_replay_splits_the_end_state_by_granule(tmp_path):
    """alloc_replay --vmm: a 4 KiB block left between two freed 8 MiB blocks, then an
    empty_cache: one granule stays mapped, touched by the live block and under a quarter
    full; nothing is reserved beyond it."""
    replay = os.path.join(REPO, "build", "bench", "alloc_replay")
    if not os.path.exists(replay):
        pytest.skip("build/bench/alloc_replay not built")
    path = tmp_path / "frag.csv"
    path.write_text("thread,time_ns,action,ptr,size,stream\n1,1,alloc,1000,8388608,0\n1,2,alloc,2000,4096,0\n"
                    "1,3,alloc,3000,8388608,0\n1,4,free,1000,8388608,0\n1,5,free,3000,8388608,0\n"
                    "1,6,empty_cache,0,0,0\n")
    r = subprocess.run([replay, str(path), "--vmm"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "at the end: reserved 2097152, live 4096 (VMM pool)" in r.stdout, r.stdout
    assert "live blocks touch 1 (2.0 MiB" in r.stdout and "1 are under a quarter full" in r.stdout, r.stdout
    assert "in 1 blocks starting there); reserved beyond the touched granules 0.0 MiB" in r.stdout, r.stdout


def test_demo_training_table_runs_on_cpu():
    """make demo's training script (GPU on the demo machine) runs end to end on the CPU
    and both variants reach the same loss (same weights, same batches)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "demo_train.py"), "--device", "cpu",
                          "--steps", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith(("MLP", "GPT-2"))]
    assert len(rows) == 2, out.stdout
    for r in rows:
        eager_loss, kitsune_loss = float(r[-2]), float(r[-1])
        assert abs(eager_loss - kitsune_loss) < 1e-4 * max(1.0, abs(eager_loss)), out.stdout


def test_capplan_log_tool_reads_a_log(tmp_path):
    """tools/capplan_log.py on a log in the bridge's format: the live peak over the
    recorded events, what is live there by stream, each stream's own peak; the largest
    blocks at the peak, and the peak with a block left out."""
    log = tmp_path / "capplan_1_0.csv"
    MiB = 2 ** 20
    log.write_text("# plan_bytes 9437184 peak_bytes 8388608 stream_peak_bytes 10485760 graph_nodes 40 cross_shares 3\n"
                   "block,size,stream,start,end,after,uses,unordered,offset\n"
                   f"0,{4 * MiB},0,0,3,0,1,0,0\n"        # x: S0, read on S1, freed at 3
                   f"1,{2 * MiB},1,1,2,0,0,0,4194304\n"  # t: S1 temporary
                   f"2,{4 * MiB},0,4,7,1,0,0,0\n"        # y: freed after the capture
                   f"3,{1 * MiB},1,5,-1,0,0,1,-1\n")     # z: still live (left out of the plan)
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "capplan_log.py"), str(log)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "4 blocks, plan 9.0 MiB" in out and "graph nodes 40" in out
    assert "peak 6.0 MiB at event 1" in out, out                 # x and t
    assert "stream 0, used on another: 4.0 MiB in 1 blocks" in out, out
    assert "stream 1: 2.0 MiB in 1 blocks" in out, out
    assert "stream 0 alone: peak 4.0 MiB" in out and "stream 1 alone: peak 2.0 MiB" in out, out
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "capplan_log.py"), "--largest", "1",
                        "--without", "1", str(log)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "block 0: 4.000 MiB, stream 0, events [0, 3)" in r.stdout and "block 1:" not in r.stdout, r.stdout
    assert "without blocks 1: peak 5.0 MiB at event 5" in r.stdout, r.stdout   # y and z, to the end
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "capplan_log.py"), str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a capplan log" in r.stderr


def test_results_page_and_readme_headline_are_current():
    """bench/results/LATEST.md and the README's headline table are generated from the
    committed JSON (make results); a stale one fails here."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "results.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _kitsune_cli(*args, cwd=None):
    e = dict(os.environ, PYTHONPATH=PYDIR)
    return subprocess.run([sys.executable, "-m", "kitsune", *args], capture_output=True, text=True, env=e,
                          timeout=300, cwd=cwd)


def test_profile_refuses_bad_arguments_by_name(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    r = _kitsune_cli("profile", "--max-entries", "0", str(script))
    assert r.returncode == 2 and "--max-entries must be at least 1, got 0" in r.stderr and "ran" not in r.stdout
    r = _kitsune_cli("profile", str(tmp_path / "missing.py"))
    assert r.returncode == 2 and "no script at" in r.stderr


def test_profile_without_a_gpu_says_so(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    r = _kitsune_cli("profile", str(script))
    assert r.returncode == 2 and "needs a CUDA device" in r.stderr and "ran" not in r.stdout


@pytest.mark.gpu
def test_profile_writes_the_snapshot_and_timeline_of_a_script(tmp_path):
    """python -m kitsune profile SCRIPT ARGS: the script runs as __main__ with its own
    arguments under Kitsune's allocator; its exit status comes back; memory.pickle (the
    snapshot PyTorch's visualizer opens, with the script's allocations and their
    stacks) and the two HTML views are written; the summary names the peaks."""
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "def grow():\n"
        "    return [torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device='cuda') for _ in range(3)]\n"
        "keep = grow()\n"
        "sys.exit(3)\n")
    out = tmp_path / "prof"
    r = _kitsune_cli("profile", "--out", str(out), str(script), "5", cwd=str(tmp_path))
    assert r.returncode == 3, r.stderr
    assert "Kitsune's allocator" in r.stderr and "peak allocated" in r.stderr
    import pickle
    with open(out / "memory.pickle", "rb") as f:
        snap = pickle.load(f)
    frames = [f["name"] for t in snap["device_traces"] for e in t if e["action"] == "alloc" and e["size"] == 5 << 20
              for f in e.get("frames", [])]
    assert "grow" in frames
    for name in ("memory_timeline.html", "memory_segments.html"):
        assert (out / name).stat().st_size > 1000
