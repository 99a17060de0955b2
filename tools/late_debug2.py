"""Debugging KITSUNE_CONV_GRADS=late with a bucket flushed during the backward (wip): test_sched's
failing model (256-channel Inception block, 16x16 input, a head large enough to fill a bucket),
trained late against together; variants: as is, the finish joining every plan and grad stream first,
the update after the backward. Prints loss diffs, the parameters off after the first replay, what the
flushes held and the streams the late callback ran on. Run: KITSUNE_LIBRARY=build/libkitsune.so
PYTHONPATH=python python3 tools/late_debug2.py"""
import copy, os
import torch, torch.nn as nn
import kitsune, kitsune.sched as ks, kitsune.optim as ko
torch.backends.cudnn.deterministic = True
LOG = {}
orig_end, orig_flush, orig_finish = ks._end_late, ko._InBackward._flush, ko._InBackward.finish
def end():
    LOG.setdefault("end_cur", []).append((torch.cuda.current_stream().cuda_stream, torch.cuda.is_current_stream_capturing(),
                                          len(ks._LATE)))
    orig_end()
ks._end_late = end
NAMES = {}
def flush(self):
    LOG.setdefault("flushes", []).append([NAMES.get(p, "?") for p in self.pending])
    LOG.setdefault("flush_cur", []).append(torch.cuda.current_stream().cuda_stream)
    return orig_flush(self)
ko._InBackward._flush = flush
JOINALL = False
def finish(self):
    cur = torch.cuda.current_stream()
    LOG["finish_cur"] = cur.cuda_stream
    if JOINALL:
        for ctx in list(ks._CONTEXTS.values()):
            for dev, gs in ctx.grads.items():
                for s in gs + list(ctx.per_device[dev][0]):
                    cur.wait_stream(s)
    seen = set(self.done + self.pending + self.left)
    LOG["late"] = [NAMES.get(p, "?") for p in self.group_of if p.grad is not None and p not in seen]
    return orig_finish(self)
ko._InBackward.finish = finish

torch.manual_seed(0)
base = nn.Sequential(nn.Conv2d(8, 256, 1), ks.Inception(256), nn.Flatten(), nn.LazyLinear(10)).cuda()
base(torch.randn(1, 8, 16, 16, device="cuda"))
batches = [(torch.randn(4, 8, 16, 16, device="cuda"), torch.randint(0, 10, (4,), device="cuda")) for _ in range(3)]

def train(mode, ib=True, n=6):
    os.environ["KITSUNE_CONV_GRADS"] = mode
    LOG.clear()
    m = kitsune.optimize(copy.deepcopy(base))
    NAMES.clear(); NAMES.update({p: k for k, p in m.named_parameters()})
    step = kitsune.compile_step(m, nn.functional.cross_entropy, torch.optim.AdamW(m.parameters(), lr=1e-3),
                                optimizer_in_backward=ib)
    losses = [float(step(*batches[i % 3])) for i in range(n)]
    st = step.stats()
    side = step._side.cuda_stream
    return m, losses, st, side, dict(LOG)

for ib in (True, False):
    ref, lref, st, side, log = train("together", ib)
    print(f"together ib={ib}: losses {[round(x, 4) for x in lref]} ib_launches={st.get('optimizer_in_backward')} "
          f"capture stream {side} log {log}")
    ref2, _, _, _, _ = train("together", ib, n=2)
    for joinall in ((False, True) if ib else (False,)):
        JOINALL = joinall
        m, l, st, side, log = train("late", ib)
        print(f"late ib={ib} joinall={joinall}: reason={st['reason']} conv={st.get('conv_grads')} "
              f"ib_launches={st.get('optimizer_in_backward')} capture stream {side}")
        print("   loss diffs", [f"{a - b:.2e}" for a, b in zip(l, lref)])
        print("   log", log)
        m2, _, _, _, _ = train("late", ib, n=2)   # after the warm-up and one replay
        off = [(k, f"{float((p - dict(ref2.named_parameters())[k]).abs().max()):.2e}") for k, p in m2.named_parameters()
               if float((p - dict(ref2.named_parameters())[k]).abs().max()) > 1e-6]
        print("   params off after one replay:", off)
    JOINALL = False
