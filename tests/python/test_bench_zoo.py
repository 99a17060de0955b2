"""bench/zoo.py runs: its --smoke mode (tiny configurations of the zoo's models, on the
CPU, each recipe Kitsune's CPU path can run) writes a row for every model and recipe,
none failed, and losses equal to eager's where the recipe's arithmetic is eager's."""
import json
import os
import subprocess
import sys

import pytest

from support import REPO, env

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torchvision")


def test_zoo_smoke(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "zoo.py"), "--smoke", "--out", str(tmp_path),
                        "--models", "gpt2,llama,vit", "--recipes", "eager,kitsune,kitsune_dynamo"],
                       capture_output=True, text=True, env=dict(env(), CUDA_VISIBLE_DEVICES=""), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "zoo.json").read_text())
    rows = {(row["model"], row["recipe"]): row for row in doc["rows"]}
    assert set(rows) == {(m, rc) for m in ("gpt2", "llama", "vit") for rc in ("eager", "kitsune", "kitsune_dynamo")}
    for key, row in rows.items():
        assert "error" not in row, (key, row)
    for m in ("gpt2", "llama", "vit"):   # fp32 on the CPU, the same batches: eager's losses
        want = rows[m, "eager"]["losses"]
        for rc in ("kitsune", "kitsune_dynamo"):
            assert rows[m, rc]["losses"] == pytest.approx(want, rel=1e-4), (m, rc)
    assert "| gpt2 |" in (tmp_path / "zoo.md").read_text()


@pytest.mark.parametrize("workload", ["churn", "random"])
def test_alloc_churn_workloads_free_each_live_block_once(workload):
    """bench/alloc_churn.py's events: every block allocated once before its one free
    (the random trace reuses freed addresses: a new block each time), and all freed."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import alloc_churn
    live, seen = set(), set()
    for action, i, size in alloc_churn.events(workload):
        assert size >= 0
        if action == "alloc":
            assert i not in seen
            seen.add(i)
            live.add(i)
        else:
            live.remove(i)
    assert not live and len(seen) == (20000 if workload == "churn" else 10000)


def test_distributed_smoke(tmp_path):
    """bench/distributed.py --smoke: torchrun with gloo on the CPU, one rank and two, DDP and
    FSDP2 recipes: a row for each, none failed; Kitsune's recipes name why compile_step runs
    them eagerly, step the fused optimizer, and train as the eager recipe does."""
    pytest.importorskip("torch.distributed")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "distributed.py"), "--smoke", "--out",
                        str(tmp_path), "--models", "gpt2,llama", "--recipes",
                        "ddp_eager,ddp_kitsune,fsdp_eager,fsdp_kitsune"],
                       capture_output=True, text=True, env=dict(env(), CUDA_VISIBLE_DEVICES=""), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "distributed.json").read_text())
    rows = {(row["model"], row["recipe"], row["nproc"]): row for row in doc["rows"]}
    want = {("gpt2", rc, n) for rc in ("ddp_eager", "ddp_kitsune") for n in (1, 2)} | \
        {("llama", rc, n) for rc in ("fsdp_eager", "fsdp_kitsune") for n in (1, 2)}
    assert set(rows) == want
    for key, row in rows.items():
        assert "error" not in row, (key, row)
        if key[1].endswith("kitsune"):
            eager = rows[key[0], key[1].replace("kitsune", "eager"), key[2]]
            why = row["compile_step"]["reason"]
            assert ("DistributedDataParallel" if key[1].startswith("ddp") else "sharded") in why, why
            assert row["optimizer_path"].startswith("fused"), row["optimizer_path"]
            for a, b in zip(row["losses"], eager["losses"]):
                assert abs(a - b) < 1e-4 * max(1.0, abs(b)), (key, row["losses"], eager["losses"])
    assert "scaling efficiency" in (tmp_path / "distributed.md").read_text()
