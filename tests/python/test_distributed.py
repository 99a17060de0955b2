"""Kitsune under torch.distributed on the CPU (gloo): KitsuneOptimizer's fused step over
FSDP2's sharded parameters (DTensors: each rank updates its own shard with the fused
kernel) and over DDP's replicated ones, against torch.optim on an unsharded single-process
twin. Two ranks, spawned; world size 1 too."""
import os
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.01)),
              "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9, weight_decay=1e-4))}
STEPS = 4


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 6))


def _batches(world):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4 * world, 12, generator=g) for _ in range(STEPS)]


def _reference(opt_name, world):
    """The single-process run: the whole batch, torch.optim."""
    model = _model()
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    for x in _batches(world):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank, world, port, wrap, opt_name, out, driver="loop"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import kitsune
        model = _model()
        if wrap == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        cls, kw = OPTIMIZERS[opt_name]
        opt = kitsune.KitsuneOptimizer(cls, model.parameters(), **kw)
        paths, reason = [], None
        step = kitsune.compile_step(model, lambda out, _: out.square().mean(), opt) if driver == "compile_step" \
            else None
        for x in _batches(world):
            mine = x.chunk(world)[rank]
            if step is not None:
                step(mine, torch.zeros(()))
                reason = step.stats()["reason"]
            else:
                opt.zero_grad()
                model(mine).square().mean().backward()
                opt.step()
            paths.append(opt.get_stats()["path"])
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
        if rank == 0:
            torch.save({"params": [p.detach().clone() for p in params], "paths": paths, "reason": reason}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
@pytest.mark.parametrize("world", [1, 2])
def test_kitsune_optimizer_steps_sharded_and_replicated_parameters(world, wrap, opt_name, tmp_path):
    import torch.multiprocessing as mp
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(world, _port(), wrap, opt_name, out), nprocs=world, join=True,
                       start_method="spawn")
    got = torch.load(out)
    assert all(p.startswith("fused") for p in got["paths"]), got["paths"]   # no fallback to torch.optim
    for a, b in zip(got["params"], _reference(opt_name, world)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wrap", ["fsdp2", "ddp"])
def test_compile_step_runs_distributed_models_eagerly_with_the_reason(wrap, tmp_path):
    """compile_step over a DDP or FSDP2 model (two ranks) does not capture the collectives
    it cannot: it says so in stats()['reason'] and its eager steps train as the
    single-process run does, with the fused optimizer."""
    import warnings
    import torch.multiprocessing as mp
    out = str(tmp_path / "rank0.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.start_processes(_worker, args=(2, _port(), wrap, "adamw", out, "compile_step"), nprocs=2, join=True,
                           start_method="spawn")
    got = torch.load(out)
    assert ("DistributedDataParallel" if wrap == "ddp" else "sharded (FSDP)") in got["reason"], got["reason"]
    assert all(p.startswith("fused") for p in got["paths"]), got["paths"]
    for a, b in zip(got["params"], _reference("adamw", 2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_capture_blocker_finds_data_parallel_and_sharded_models_anywhere(tmp_path):
    """compile_step's reason to run eagerly, in one process (gloo, world size 1): DDP at the
    top, inside a wrapper and under torch.compile; composable replicate; FSDP2 and DTensor
    parameters; nothing for a plain model."""
    from kitsune.graph.step import _distributed_blocker
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert _distributed_blocker(_model()) is None
        ddp = torch.nn.parallel.DistributedDataParallel(_model())
        for wrapped in (ddp, torch.nn.Sequential(ddp), torch.compile(ddp)):
            assert "DistributedDataParallel" in _distributed_blocker(wrapped)
        from torch.distributed._composable import replicate
        assert "replicate" in _distributed_blocker(replicate(_model()))
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        sharded = _model()
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        assert "sharded (FSDP)" in _distributed_blocker(sharded)
    finally:
        dist.destroy_process_group()
