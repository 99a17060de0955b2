"""The data path: kitsune.pinned (pinned host pool) and kitsune.prefetch.

CPU tests run the pool's Python path over the host fake backend (ordinary memory),
each in a fresh process. GPU tests (marked gpu) check real pinning, data integrity
over 10^4 prefetched batches of random sizes, and that no buffer is reused early
while a consumer runs long kernels."""
import os

import pytest

from support import HAS_GPU, gpu, run

torch = pytest.importorskip("torch")


def test_pinned_empty_over_host_memory():
    out = run("""
        import torch, kitsune
        kp = kitsune.pinned
        kp._use_host_memory()
        a = kp.empty((1023, 3), torch.bfloat16)
        assert a.shape == (1023, 3) and a.dtype == torch.bfloat16 and a.device.type == "cpu"
        assert a.is_contiguous()
        a.copy_(torch.arange(3069, dtype=torch.float32).view(1023, 3))   # every element written
        assert torch.equal(a.float(), torch.arange(3069, dtype=torch.float32).view(1023, 3).bfloat16().float())
        s = kp.stats()
        assert s["requested_bytes.current"] == 1023 * 3 * 2, s
        assert s["allocated_bytes.current"] >= s["requested_bytes.current"]
        assert s["mapped_bytes.current"] >= s["allocated_bytes.current"]
        v = a[5:9]          # a view keeps the block alive
        del a
        assert kp.stats()["allocations.current"] == 1
        assert float(v[0, 0]) == 15.0
        del v
        s = kp.stats()
        assert s["allocations.current"] == 0 and s["requested_bytes.current"] == 0, s
        assert s["num_allocs"] == 1 and s["num_frees"] == 1
        z = kp.empty(0, torch.float32)            # zero elements: no block
        assert z.numel() == 0 and kp.stats()["num_allocs"] == 1
        for dt in (torch.float32, torch.float16, torch.int64, torch.uint8):
            t = kp.empty([7, 1, 5], dt)
            assert t.dtype == dt and t.shape == (7, 1, 5)
        for bad, msg in (((2, -1), "negative dimension -1"), (((1 << 38) + 1,), "more than the pool's limit"),
                         ((1 << 40, 1 << 30), "overflows")):
            try:
                kp.empty(bad, torch.float32)
            except RuntimeError as e:
                assert msg in str(e), str(e)
            else:
                raise AssertionError(f"no error for {bad}")
        mapped = kp.stats()["mapped_bytes.current"]
        big = [kp.empty((1 << 20) * k, torch.uint8) for k in (3, 5, 9)]
        assert kp.stats()["mapped_bytes.current"] > mapped
        del big
        kp.trim()
        assert kp.stats()["mapped_bytes.current"] <= mapped + (1 << 20), kp.stats()
        print("ok")
    """)
    assert "ok" in out


def test_prefetch_structure_and_arguments():
    from kitsune.data import _map
    import collections
    P = collections.namedtuple("P", "x y")
    t = torch.ones(2)
    batch = {"a": [t, 3, "s"], "b": (t, P(t, None)), "c": 1.5}
    out = _map(batch, lambda x: x * 2)
    assert torch.equal(out["a"][0], t * 2) and out["a"][1:] == [3, "s"]
    assert isinstance(out["b"][1], P) and torch.equal(out["b"][1].x, t * 2) and out["b"][1].y is None
    assert out["c"] == 1.5 and isinstance(out["a"], list) and isinstance(out["b"], tuple)
    import kitsune
    with pytest.raises(ValueError, match="copies to a CUDA device"):
        kitsune.prefetch([t], device="cpu")
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        kitsune.prefetch([t], device="cuda", depth=0)
    if not HAS_GPU:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            kitsune.prefetch([t])


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_pinned_without_gpu_fails_cleanly():
    out = run("""
        import torch, kitsune
        try:
            kitsune.pinned.empty(10, torch.float32)
        except RuntimeError as e:
            print("ERR", e)
    """)
    assert "ERR kitsune.pinned: page-locked memory needs a CUDA device" in out


@pytest.mark.gpu
@gpu
def test_pinned_is_page_locked_and_copies_async():
    out = run("""
        import torch, kitsune
        kp = kitsune.pinned
        x = kp.empty((4096, 1000), torch.float32)
        assert x.is_pinned()
        ref = torch.randn(4096, 1000)
        x.copy_(ref)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            d = x.to("cuda", non_blocking=True)
            kp.record_stream(x, s)
        del x   # the block waits for the copy before reuse
        y = kp.empty((4096, 1000), torch.float32)
        y.fill_(float("nan"))   # would clobber the copy if the block were reused early
        s.synchronize()
        assert torch.equal(d.cpu(), ref)
        try:
            kp.record_stream(torch.ones(3), s)
        except ValueError as e:
            print("ERR", e)
        print("pending", kp.stats()["num_pending_frees"])
    """)
    assert "ERR kitsune.pinned.record_stream: the tensor's memory is not a live block" in out
    assert "pending 1" in out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("allocator", ["native", "kitsune"])
def test_prefetch_integrity_random_sizes(allocator):
    """10^4 batches of random sizes and several dtypes, each checked on the GPU against
    a checksum computed on the CPU before it entered the prefetcher."""
    out = run(f"""
        import torch, kitsune
        if {allocator == "kitsune"!r}:
            kitsune.allocator.install()
        N = int({os.environ.get("KT_PREFETCH_BATCHES", "10000")})
        def batches():
            g = torch.Generator().manual_seed(0)
            for i in range(N):
                n = int(torch.randint(1, 200_000, (1,), generator=g))
                x = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
                y = torch.randint(0, 255, (n % 977 + 1, 3), generator=g).to(torch.uint8)
                z = x[::2].double()   # non-contiguous source, another dtype
                yield {{"x": x, "parts": [y, z], "i": i, "sum": (int(x.sum()), int(y.long().sum()), float(z.sum()))}}
        seen, bad = 0, 0
        for b in kitsune.prefetch(batches(), depth=3):
            assert b["x"].is_cuda and b["parts"][0].is_cuda and b["i"] == seen
            got = (int(b["x"].long().sum()), int(b["parts"][0].long().sum()), float(b["parts"][1].sum()))
            bad += got != b["sum"]
            seen += 1
        print("seen", seen, "bad", bad)
        print("pinned", kitsune.pinned.stats()["mapped_bytes.peak"], kitsune.pinned.stats()["requested_bytes.peak"])
    """)
    assert "bad 0" in out, out
    assert f"seen {os.environ.get('KT_PREFETCH_BATCHES', '10000')}" in out, out


@pytest.mark.gpu
@gpu
def test_prefetch_no_early_reuse_under_long_kernels():
    """The consumer runs a long kernel on each batch before reading it; meanwhile the
    prefetcher stages and copies the next batches (reusing pinned and device memory).
    Early reuse of either would change the data the consumer reads."""
    out = run("""
        import torch, kitsune
        torch.cuda.init()
        spin = torch.randn(2048, 2048, device="cuda")
        def batches():
            for i in range(300):
                yield torch.full((1 << 20,), float(i)), i
        bad = 0
        for x, i in kitsune.prefetch(batches(), depth=2):
            for _ in range(6):
                spin = torch.tanh(spin @ spin * 1e-3)   # ~ms of work queued before x is read
            bad += int((x != float(i)).sum())
            bad += int((x.cumsum(0)[-1] != float(i) * (1 << 20)))
        torch.cuda.synchronize()
        print("bad", bad)
    """)
    assert "bad 0" in out, out
