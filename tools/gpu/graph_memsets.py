"""Where the memset nodes of Kitsune's captured training step come from: each memset
node of the compile_step graph of bench/models.py's model, with its bytes, value and
the kernels before and after it in the graph (CUDA driver API through ctypes).

    python tools/gpu/graph_memsets.py gpt

compile_step's graphs are captured with keep_graph=True here (torch.cuda.CUDAGraph is
wrapped for this process) so the cudaGraph_t stays readable. Prints the node types'
counts, then one line a memset. tools/gpu/gpu_run.sh runs it as part "memsets"
(GRAPH_MODELS, default gpt).
"""
import ctypes
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import models  # noqa: E402

_Graph = torch.cuda.CUDAGraph
torch.cuda.CUDAGraph = lambda *a, **k: _Graph(*a, **dict(k, keep_graph=True))

cu = ctypes.CDLL("libcuda.so.1")
TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
         7: "event_record", 8: "ext_sem_signal", 9: "ext_sem_wait", 10: "mem_alloc", 11: "mem_free",
         12: "batch_mem_op", 13: "conditional"}


class MemsetParams(ctypes.Structure):   # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class KernelParams(ctypes.Structure):   # CUDA_KERNEL_NODE_PARAMS (v2)
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def check(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


def nodes_of(graph):
    n = ctypes.c_size_t(0)
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
    arr = (ctypes.c_void_p * n.value)()
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), arr, ctypes.byref(n)), "cuGraphGetNodes")
    return list(arr)


def kind(node):
    t = ctypes.c_int(0)
    check(cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
    return TYPES.get(t.value, str(t.value))


def neighbours(node, fn):
    n = ctypes.c_size_t(0)
    f = getattr(cu, fn + "_v2", None)
    args = (None,) if f is not None else ()
    f = f or getattr(cu, fn)
    check(f(ctypes.c_void_p(node), None, *args, ctypes.byref(n)), fn)
    arr = (ctypes.c_void_p * max(n.value, 1))()
    check(f(ctypes.c_void_p(node), arr, *args, ctypes.byref(n)), fn)
    return list(arr)[:n.value]


def describe(node):
    k = kind(node)
    if k != "kernel":
        return k
    p = KernelParams()
    if cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)) != 0:
        return "kernel ?"
    name = ctypes.c_char_p()
    if cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(p.func)) != 0 or not name.value:
        return "kernel ?"
    return name.value.decode()[:70]


def main():
    for name in sys.argv[1:] or ["gpt"]:
        gen = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model, loss_fn, data = models.build(name, gen)
        step, _ = models.make("kitsune", model, loss_fn)
        for i in range(3):
            step(*data[i % len(data)])
        torch.cuda.synchronize()
        for g in step._graphs.values():
            nodes = nodes_of(g.graph.raw_cuda_graph())
            print(f"== {name}: {len(nodes)} nodes: {dict(Counter(kind(n) for n in nodes))}")
            for n in nodes:
                if kind(n) != "memset":
                    continue
                m = MemsetParams()
                check(cu.cuGraphMemsetNodeGetParams(ctypes.c_void_p(n), ctypes.byref(m)), "memset params")
                nbytes = m.width * m.height * m.elementSize
                before = ", ".join(describe(p) for p in neighbours(n, "cuGraphNodeGetDependencies")) or "-"
                after = ", ".join(describe(s) for s in neighbours(n, "cuGraphNodeGetDependentNodes")) or "-"
                print(f"  memset {nbytes:>10} B value {m.value}  after [{before}]  before [{after}]")


if __name__ == "__main__":
    main()
