"""Debugging KITSUNE_CONV_GRADS=late on the GPU (wip): trains the branchy test net and test_sched's
256-channel block with late against together, with and without the in-backward update and with
private copies of each late gradient's inputs, and prints which parameters differ and what the
late callbacks saw. Run: KITSUNE_LIBRARY=build/libkitsune.so PYTHONPATH=python python3 tools/late_debug.py
(its logs at bd9bb18 and 6f04743 count "drops", a failed backward's takes only; it now counts every take)"""
import copy, os, sys, threading, traceback
import torch, torch.nn as nn
import kitsune, kitsune.graph as kg, kitsune.sched as ks
kg._describe = lambda e: " | ".join(l.strip() for l in traceback.format_exception(e) if "File" in l and "kitsune" in l)[-900:]
torch.backends.cudnn.deterministic = True
LOG = {"takes": 0, "ends": 0, "assigned": 0, "tasks": set(), "threads": set(), "cur": set()}
orig_take, orig_end = ks._take_late, ks._end_late
def take():   # every take: the ends' and a failed backward's drops
    LOG["takes"] += 1; return orig_take()
def end():
    LOG["ends"] += 1; LOG["assigned"] += len(ks._LATE); LOG["threads"].add(threading.get_ident())
    LOG["cur"].add((torch.cuda.current_stream().cuda_stream, torch.cuda.is_current_stream_capturing()))
    orig_end()
    LOG["cur"].add(("after", torch.cuda.is_current_stream_capturing()))
ks._take_late, ks._end_late = take, end
orig_join = ks._Streams.join_late
def join(self, here, side, weight, grad, keep):
    LOG["tasks"].add(torch._C._current_graph_task_id()); orig_join(self, here, side, weight, grad, keep)
ks._Streams.join_late = join
CLONE = False
orig_bw = ks._ConvGradsApart.backward
SUB = {}
orig_cb = torch.ops.aten.convolution_backward
def cb(gy, x, w, *a):
    key = (x.data_ptr(), gy.data_ptr())
    if a[-1] == [False, True, False] and key in SUB:
        x, gy = SUB[key]
    return orig_cb(gy, x, w, *a)
torch.ops.aten.convolution_backward = cb
def bw(ctx, gy):
    if CLONE and torch.cuda.is_current_stream_capturing():
        x, w = ctx.saved_tensors
        # diagnostic: the late gradient reads private copies of x and gy made on the node's stream
        SUB[(x.data_ptr(), gy.data_ptr())] = (x.clone(memory_format=torch.preserve_format), gy.clone(memory_format=torch.preserve_format))
    return orig_bw(ctx, gy)
ks._ConvGradsApart.backward = staticmethod(bw)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1); self.block = ks.Inception(32); self.fc = nn.Linear(128, 10)
    def forward(self, x):
        return self.fc(self.block(torch.relu(self.stem(x))).mean((2, 3)))
torch.manual_seed(0)
base = Net().cuda()
batches = [(torch.randn(16, 3, 16, 16, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(4)]
def train(mode, ib=True, opt=True):
    os.environ["KITSUNE_CONV_GRADS"] = mode
    m = kitsune.optimize(copy.deepcopy(base)) if opt else copy.deepcopy(base)
    step = kitsune.compile_step(m, nn.functional.cross_entropy, torch.optim.AdamW(m.parameters(), lr=1e-3),
                                optimizer_in_backward=ib)
    losses = [float(step(*batches[i % 4])) for i in range(4)]
    st = step.stats()
    return m, losses, st
for ib in (True, False):
    ref, lr_, _ = train("together", ib)
    for clone in (False, True):
        CLONE = clone
        for k in LOG: LOG[k] = set() if isinstance(LOG[k], set) else 0
        m, l, st = train("late", ib)
        bad = [(n, float((p - dict(ref.named_parameters())[n]).abs().max())) for n, p in m.named_parameters()]
        bad = [(n, f"{d:.2e}") for n, d in bad if d > 1e-6]
        print(f"ib={ib} clone={clone} reason={st['reason'] and st['reason'][-600:]} conv={st.get('conv_grads')} ib_launch={st.get('optimizer_in_backward')}")
        print("   loss diffs", [f"{a-b:.2e}" for a, b in zip(l, lr_)], "params off:", bad)
        print("   log", {k: (sorted(map(str, v)) if isinstance(v, set) else v) for k, v in LOG.items()})
# test 2's model
base2 = nn.Sequential(nn.Conv2d(8, 256, 1), ks.Inception(256), nn.Flatten(), nn.LazyLinear(10)).cuda()
base2(torch.randn(1, 8, 8, 8, device="cuda"))
b2 = [(torch.randn(4, 8, 8, 8, device="cuda"), torch.randint(0, 10, (4,), device="cuda")) for _ in range(3)]
CLONE = False
for mode in ("together", "late"):
    os.environ["KITSUNE_CONV_GRADS"] = mode
    for k in LOG: LOG[k] = set() if isinstance(LOG[k], set) else 0
    m = kitsune.optimize(copy.deepcopy(base2))
    step = kitsune.compile_step(m, nn.functional.cross_entropy, torch.optim.AdamW(m.parameters(), lr=1e-3))
    l = [float(step(*b2[i % 3])) for i in range(4)]
    st = step.stats()
    print("test2", mode, l, st["reason"] and st["reason"][-900:], st.get("optimizer_in_backward"), LOG)
