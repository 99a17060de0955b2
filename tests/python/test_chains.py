"""kitsune.pointwise_chain and the FX pass that makes it (kitsune/fx/chains.py): every
opcode against an fp64 reference written apart, broadcast / strided / bool operands,
bad programs refused by the op and its fake kernel alike, opcheck, and the pass on the
Dynamo path: real models give eager's outputs and gradients with the chains in place.
The CUDA kernel against the CPU reference: the gpu test at the end."""
import math
import os
import re

import pytest

torch = pytest.importorskip("torch")
import kitsune  # noqa: E402,F401  (the backend and the ops)
from kitsune.fx import chains  # noqa: E402
from kitsune.ops.chain import ARITY, OPCODES, Program  # noqa: E402
from support import gpu  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F = torch.nn.functional
chain = torch.ops.kitsune.pointwise_chain


def test_opcodes_are_the_headers():
    text = open(os.path.join(REPO, "fusion", "include", "kitsune", "fusion.h")).read()
    body = text[text.index("typedef enum kt_chain_opcode"):text.index("} kt_chain_opcode;")]
    names = re.findall(r"KT_OP_([A-Z0-9_]+)", re.sub(r"/\*.*?\*/", "", body, flags=re.S))
    assert names[-1] == "COUNT" and names[:-1] == OPCODES


def _ref(name, a, b, c):
    """One opcode in float64 on Python numbers."""
    gelu = lambda x: 0.5 * x * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    k = math.sqrt(2 / math.pi)
    gelu_t = lambda x: 0.5 * x * (1 + math.tanh(k * (x + 0.044715 * x ** 3)))  # noqa: E731
    d = 1e-6
    table = {
        "ADD": lambda: a + b, "SUB": lambda: a - b, "MUL": lambda: a * b, "DIV": lambda: a / b,
        "MAX": lambda: max(a, b), "MIN": lambda: min(a, b), "POW": lambda: abs(a) ** b, "NEG": lambda: -a,
        "EXP": lambda: math.exp(a), "LOG": lambda: math.log(abs(a)), "TANH": lambda: math.tanh(a),
        "SIGMOID": lambda: 1 / (1 + math.exp(-a)), "ERF": lambda: math.erf(a), "RSQRT": lambda: 1 / math.sqrt(abs(a)),
        "SQRT": lambda: math.sqrt(abs(a)), "RELU": lambda: max(a, 0.0), "GELU": lambda: gelu(a),
        "GELU_TANH": lambda: gelu_t(a), "SILU": lambda: a / (1 + math.exp(-a)), "ABS": lambda: abs(a),
        "RECIP": lambda: 1 / a, "LOG1P": lambda: math.log1p(abs(a)), "GT": lambda: float(a > b),
        "LT": lambda: float(a < b), "GE": lambda: float(a >= b), "LE": lambda: float(a <= b),
        "EQ": lambda: float(a == b), "NE": lambda: float(a != b), "WHERE": lambda: b if a != 0 else c,
        "GELU_BWD": lambda: a * (gelu(b + d) - gelu(b - d)) / (2 * d),
        "GELU_TANH_BWD": lambda: a * (gelu_t(b + d) - gelu_t(b - d)) / (2 * d),
    }
    return table[name]()


# operands that keep each opcode in its domain (LOG, SQRT, ... get |a|: the program takes ABS first)
_POSITIVE = {"LOG", "RSQRT", "SQRT", "LOG1P", "POW"}
_SKIP = {"CONST", "ROUND_BF16", "ROUND_F16", "TO_BOOL"}   # tested with the casts below


@pytest.mark.parametrize("name", [n for n in OPCODES if n not in _SKIP])
def test_each_opcode_matches_a_float64_reference(name):
    g = torch.Generator().manual_seed(hash(name) % 1000)
    xs = [torch.randn(257, generator=g) * 2 for _ in range(3)]
    if name == "WHERE":
        xs[0] = (xs[0] > 0).float()
    if name in ("EQ", "NE"):
        xs[1][::3] = xs[0][::3]   # some equal pairs
    if name in ("DIV", "RECIP"):
        xs[1] = xs[1].sign() * (xs[1].abs() + 0.5)
        xs[0] = xs[0] if name == "DIV" else xs[1]
    p = Program(3)
    ins = [0, 1, 2]
    if name in _POSITIVE:
        ins[0] = p.op("ABS", 0)
    r = p.op(name, *ins[:ARITY[name]])
    p.output(r, torch.float32)
    got = chain(xs, *p.args())[0].double()
    want = torch.tensor([_ref(name, *(float(x[i]) for x in xs)) for i in range(257)], dtype=torch.float64)
    tol = 2e-3 if name.endswith("_BWD") else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_broadcast_strided_bool_inputs_and_casts(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, generator=g).to(dtype).t()          # strided (a transpose)
    row = torch.randn(6, generator=g).to(dtype)                # broadcast along dim 0
    s = torch.tensor(1.5)                                      # 0-dim, fp32
    mask = torch.rand(5, 6, generator=g) > 0.3                 # bool
    p = Program(4)
    a = p.op("MUL", 0, 2)                                      # x * s
    b = p.op("ADD", a, 1)                                      # + row
    c = p.op("GELU_TANH", b)
    d = p.op("WHERE", 3, c, p.const(0.0))                      # masked
    e = p.op("ROUND_BF16", d)
    gt = p.op("GT", d, p.const(0.1))
    p.output(d, dtype)
    p.output(e, torch.float32)
    p.output(gt, torch.bool)
    out = chain([x, row, s, mask], *p.args())
    xd, rd = x.double(), row.double()
    dd = torch.where(mask, F.gelu(xd * 1.5 + rd, approximate="tanh"), torch.zeros((), dtype=torch.float64))
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert [o.shape for o in out] == [torch.Size([5, 6])] * 3 and all(o.is_contiguous() for o in out)
    assert [o.dtype for o in out] == [dtype, torch.float32, torch.bool]
    torch.testing.assert_close(out[0].double(), dd, rtol=tol, atol=tol)
    torch.testing.assert_close(out[1], dd.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out[2] == (dd > 0.1), torch.ones(5, 6, dtype=torch.bool)) or \
        (out[2] != (dd > 0.1)).sum() <= 1   # a value at 0.1 may round either way


def test_outputs_are_new_tensors_even_for_an_input_register():
    x = torch.randn(4)
    p = Program(1)
    p.output(0, torch.float32)
    out = chain([x], *p.args())[0]
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def _refusals():
    x, b = torch.randn(4, 8), torch.randn(8)
    f32 = [torch.float32]
    return [
        (([x, b], [1, 2, 0, 5, 0], [], [2], f32), "read before it is written"),
        (([x, b], [99, 2, 0, 1, 0], [], [2], f32), "not valid"),
        (([x, b], [1, 2, 0, 1], [], [2], f32), "5 a instruction"),
        (([x, b], [0, 2, 3, 0, 0], [1.0], [2], f32), "reads constant 3 of 1"),
        (([x, b], [1, 2, 0, 1, 0], [], [2, 2], f32), "out_"),
        (([x.long(), b], [1, 2, 0, 1, 0], [], [2], f32), "inputs[0] is"),
        (([x, b], [1, 2, 0, 1, 0], [], [2], [torch.int32]), "out_dtypes[0]"),
        (([x, torch.randn(3)], [1, 2, 0, 1, 0], [], [2], f32), "does not broadcast"),
        (([x] * 9, [], [], [0], f32), "at most 8"),
        (([torch.randn([1] * 7)], [], [], [0], f32), "at most 6"),
    ]


@pytest.mark.parametrize("case", range(len(_refusals())))
def test_bad_programs_are_refused_by_the_op_and_its_fake(case):
    from torch._subclasses.fake_tensor import FakeTensorMode
    args, words = _refusals()[case]
    with pytest.raises(RuntimeError, match=re.escape(words) if words != "out_" else "out_"):
        chain(*args)
    with FakeTensorMode() as mode:
        fake = ([mode.from_tensor(t) for t in args[0]],) + args[1:]
        with pytest.raises(RuntimeError):
            chain(*fake)


def test_opcheck():
    g = torch.Generator().manual_seed(3)
    p = Program(2)
    p.output(p.op("SILU", p.op("ADD", 0, 1)), torch.bfloat16)
    x, b = torch.randn(3, 4, generator=g), torch.randn(4, generator=g)
    torch.library.opcheck(chain, ([x, b], *p.args()), test_utils=("test_schema", "test_faketensor"))


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        h = torch.sigmoid(h) * h * 0.5 + torch.tanh(h) - 1.0 / (1.0 + h * h)   # a chain
        return x + self.b(h).clamp_min(0.0) * 2.0


def _hf_llama():   # rotary embeddings: q * cos + rotate_half(q) * sin, in transposed layouts
    T = pytest.importorskip("transformers")
    cfg = T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=64, max_position_embeddings=32)
    return T.LlamaForCausalLM(cfg)


def _count_chains(monkeypatch):
    made = []
    real = chains.fuse

    def counting(gm):
        n = real(gm)
        made.append(n)
        return n
    monkeypatch.setattr(chains, "fuse", counting)
    return made


@pytest.mark.parametrize("which", ["mlp", "llama"])
def test_dynamo_path_with_chains_gives_eagers_outputs_and_gradients(which, monkeypatch):
    torch.manual_seed(0)
    if which == "mlp":
        model, inputs = _MLP(), (torch.randn(8, 16),)
        loss = lambda out: out.square().mean()  # noqa: E731
    else:
        model, inputs = _hf_llama(), (torch.randint(0, 64, (2, 16)),)
        loss = lambda out: out.logits.float().square().mean()  # noqa: E731
    twin = __import__("copy").deepcopy(model)
    made = _count_chains(monkeypatch)
    torch._dynamo.reset()
    fast = torch.compile(model, backend="kitsune", options={"inductor": False})
    lf, le = loss(fast(*inputs)), loss(twin(*inputs))
    lf.backward()
    le.backward()
    assert sum(made) >= 2, made   # chains in the forward and the backward graphs
    torch.testing.assert_close(lf, le, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_kitsune_chains_0_makes_none(monkeypatch):
    monkeypatch.setenv("KITSUNE_CHAINS", "0")
    made = _count_chains(monkeypatch)
    torch._dynamo.reset()
    fast = torch.compile(_MLP(), backend="kitsune", options={"inductor": False})
    fast(torch.randn(4, 16)).sum().backward()
    assert made == []


def test_a_value_read_between_members_keeps_the_order():
    """h = x * 2; y = h @ w (not pointwise, reads h); z = h + y: z cannot join h's
    group (the chain would run after the matmul that needs h)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        h = x * 2.0
        y = h @ w
        return torch.relu(h + y) * 3.0
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    n = chains.fuse(gm)
    assert n == 1   # relu(h + y) * 3: one chain after the matmul
    torch.testing.assert_close(gm(x, w), f(x, w))


def _random_chains(dtype, trials=40):
    """(inputs, program args) of random programs over a strided, a broadcast and a transposed
    input, the outputs in the dtype given, in fp32, and one transposed."""
    g = torch.Generator().manual_seed(11)
    names = [n for n in OPCODES if n not in ("CONST", "TO_BOOL", "WHERE", "POW", "LOG", "RSQRT", "SQRT", "LOG1P")]
    for trial in range(trials):
        # rows of 64 (a multiple of the kernel's 8 elements a thread: whole tiles in a row, the bias row
        # read as vectors where aligned) or 65; the bias aligned or one element off; the third input
        # transposed or one value a row (stride 0 along it)
        cols = 64 if trial % 2 == 0 else 65
        bias = torch.randn(cols + 1, generator=g).to(dtype)
        bias = bias[1:] if trial % 4 >= 2 else bias[:cols]
        third = torch.randn(cols, 33, generator=g).to(dtype).t() if trial % 3 != 1 else \
            torch.randn(33, 1, generator=g).to(dtype).expand(33, cols)
        xs = [torch.randn(33, cols, generator=g).to(dtype), bias, third]
        p = Program(3)
        regs = [0, 1, 2]
        for _ in range(int(torch.randint(3, 12, (1,), generator=g))):
            name = names[int(torch.randint(0, len(names), (1,), generator=g))]
            picks = [regs[int(torch.randint(0, len(regs), (1,), generator=g))] for _ in range(ARITY[name])]
            if name in ("GT", "LT", "GE", "LE", "EQ", "NE"):   # not x against tanh(|x|): equal to the last bit
                picks[1] = p.op("ADD", picks[1], p.const(0.25))   # for small x, where the libms may differ
            r = p.op(name, *picks)
            r = p.op("TANH", r)   # keep values in range for the next op
            regs.append(r)
        p.output(regs[-1], dtype)
        p.output(regs[-2], torch.float32)
        p.output(regs[-3], torch.bool if trial % 2 else dtype)
        yield xs, p.args([cols, 1, 1, 33, 1, 33] if trial % 3 == 0 else ())


_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}   # chains of up to 24 transcendentals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernels_code_on_the_cpu_matches_the_reference(dtype):
    """The CUDA kernel's per-element code (kt_chain_run_host: addressing, loads, opcodes,
    stores) against the ATen reference, written apart, on random programs."""
    interpreted = torch.ops.kitsune._pointwise_chain_interpreted
    for xs, args in _random_chains(dtype):
        want = chain(xs, *args)
        got = interpreted(xs, *args)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.stride() == b.stride()
            torch.testing.assert_close(a.float(), b.float(), rtol=_TOL[dtype], atol=_TOL[dtype], equal_nan=True)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_kernel_matches_the_cpu_reference(dtype):
    for xs, args in _random_chains(dtype):
        want = chain(xs, *args)
        cuda = [x.cuda() for x in xs]
        for o in want:   # poison: blocks of the outputs' sizes full of NaN, freed just before
            torch.full(o.shape, float("nan"), device="cuda").to(o.dtype)
        got = chain(cuda, *args)
        for a, b in zip(got, want):
            assert a.is_cuda and a.dtype == b.dtype and a.stride() == b.stride()
            torch.testing.assert_close(a.cpu().float(), b.float(), rtol=_TOL[dtype], atol=_TOL[dtype], equal_nan=True)

def test_outputs_in_the_strides_asked():
    x = torch.randn(5, 6)
    p = Program(1)
    p.output(p.op("EXP", 0), torch.float32)
    out = chain([x], *p.args([1, 5]))[0]
    assert out.stride() == (1, 5)
    torch.testing.assert_close(out, x.exp())
    with pytest.raises(RuntimeError, match="not a dense layout"):
        chain([x], *p.args([1, 1]))
    with pytest.raises(RuntimeError, match="out_strides has 3 entries"):
        chain([x], *p.args([1, 5, 1]))


def test_operand_groups_merge_into_one_chain():
    """where(y > 0, g * y, g * -0.5) + x over a hand-written tanh-GELU: the comparison's
    group and the GELU's merge at the where; nothing pointwise is left outside."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y, b):
        h = x + b
        t = torch.tanh(h * 0.7978845608 * (1.0 + 0.044715 * h * h))
        g = 0.5 * h * (1.0 + t)
        return (torch.where(y > 0, g * y, g * -0.5) + x).to(torch.float32).clamp_min(0.0)
    x, y, b = (torch.randn(8, 16).bfloat16(), torch.randn(8, 16).bfloat16(), torch.randn(16).bfloat16())
    gm = make_fx(f, tracing_mode="fake")(x, y, b)
    assert chains.fuse(gm) == 1
    left = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in chains.LOWER]
    assert left == []
    want = f(x.double(), y.double(), b.double())
    got = gm(x, y, b)
    got = got[0] if isinstance(got, (list, tuple)) else got
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.double(), rtol=2e-2, atol=2e-2)   # bf16 inputs, fp32 between


def test_alpha_rsub_and_positional_arguments():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y):
        h = torch.rsub(torch.relu(torch.add(x, y, alpha=2.5) - 1.0), 3.0, alpha=2)   # rsub's alpha by position
        return F.gelu(h - torch.sub(x, y, alpha=0.5), approximate="tanh")
    x, y = torch.randn(8, 8), torch.randn(8)
    gm = make_fx(f, tracing_mode="fake")(x, y)
    assert chains.fuse(gm) == 1
    got = gm(x, y)
    torch.testing.assert_close(got[0] if isinstance(got, (list, tuple)) else got, f(x, y))


_UNARY = [torch.tanh, torch.sigmoid, torch.relu, torch.exp, F.silu, F.gelu, torch.neg, torch.abs, torch.erf,
          lambda t: F.gelu(t, approximate="tanh"), lambda t: t.clamp_min(-0.5), lambda t: t * t]
_BINARY = [torch.add, torch.sub, torch.mul, torch.maximum, torch.minimum,
           lambda a, b: torch.where(a > b, a, b * 0.5), lambda a, b: a / (b.abs() + 1.0)]


@pytest.mark.parametrize("seed", range(12))
def test_random_pointwise_graphs_give_eagers_values(seed):
    """Random DAGs of pointwise ops over broadcast operands, with values also read by a
    matmul in between (which splits groups): the fused graph equals the ATen one."""
    from torch.fx.experimental.proxy_tensor import make_fx
    g = torch.Generator().manual_seed(seed)

    def pick(n):
        return int(torch.randint(0, n, (1,), generator=g))

    plan = [(pick(3), pick(len(_UNARY)), pick(len(_BINARY)), pick(8), pick(8)) for _ in range(14)]

    def f(x, y, w, b):
        vals = [x, y, b]
        for kind, u, bi, i, j in plan:
            a, c = vals[i % len(vals)], vals[j % len(vals)]
            if kind == 0:
                vals.append(torch.tanh(_UNARY[u](a)))
            elif kind == 1:
                vals.append(torch.tanh(_BINARY[bi](a, c)))
            else:
                vals.append(torch.tanh((a if a.dim() == 2 else x) @ w))   # not pointwise
        return vals[-1] + vals[-2] * 0.5, vals[-3]

    args = (torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g), torch.randn(5, 5, generator=g),
            torch.randn(5, generator=g))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert chains.fuse(gm) >= 1
    for a, b in zip(gm(*args), f(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
