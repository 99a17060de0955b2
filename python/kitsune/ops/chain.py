"""pointwise_chain: a straight-line program of pointwise ops run per element in one
launch (fusion/kernels/chain.cu; the CPU reference and the checks in
csrc/ops/chain.cpp). Its fake kernel, the opcode table (kitsune/fusion.h's
kt_chain_opcode, in order) and Program, which writes programs (kitsune/fx/chains.py
makes them from ATen graphs).

    torch.ops.kitsune.pointwise_chain(inputs, program, consts, out_regs, out_dtypes)

inputs: up to 8 tensors (float32, float16, bfloat16 or bool) that broadcast to one
shape of at most 6 dimensions, the outputs' shape; registers 0 .. len(inputs) - 1 hold
each element of them, as fp32. program: 5 integers an instruction (opcode, dst, a, b,
c), at most 64; consts: at most 16 floats, read by CONST (a: the index); out_regs: the
registers stored, each to a new tensor of its out_dtypes entry (1 to 4), contiguous, or
in the dense layout out_strides gives (the strides of each output in turn).
"""
import torch

from ._check import broadcast_shape, dense, fail

MAX_IN, MAX_OUT, MAX_OPS, MAX_REGS, MAX_DIM, MAX_CONST = 8, 4, 64, 32, 6, 16

# kt_chain_opcode, in the header's order (a test reads the header and compares)
OPCODES = ["CONST", "ADD", "SUB", "MUL", "DIV", "MAX", "MIN", "POW", "NEG", "EXP", "LOG", "TANH", "SIGMOID", "ERF",
           "RSQRT", "SQRT", "RELU", "GELU", "GELU_TANH", "SILU", "ABS", "RECIP", "LOG1P", "GT", "LT", "GE", "LE",
           "EQ", "NE", "WHERE", "ROUND_BF16", "ROUND_F16", "TO_BOOL", "GELU_BWD", "GELU_TANH_BWD"]
OP = {name: i for i, name in enumerate(OPCODES)}
ARITY = {name: 0 if name == "CONST" else 3 if name == "WHERE" else
         2 if name in ("ADD", "SUB", "MUL", "DIV", "MAX", "MIN", "POW", "GT", "LT", "GE", "LE", "EQ", "NE",
                       "GELU_BWD", "GELU_TANH_BWD") else 1
         for name in OPCODES}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.bool)
# a ScalarType[] argument reaches a fake kernel as c10::ScalarType's numbers
_SCALAR_TYPE = {6: torch.float32, 5: torch.float16, 15: torch.bfloat16, 11: torch.bool}


class Program:
    """A chain being written: ``x = p.input(); y = p.op("MUL", x, p.const(2.0))``,
    ``p.output(y, torch.bfloat16)``; ``p.args()`` gives (program, consts, out_regs,
    out_dtypes). Registers are reused once nothing reads them any more
    (:meth:`release`), so long chains fit in 32."""

    def __init__(self, n_inputs):
        if n_inputs > MAX_IN:
            raise ValueError(f"a chain takes at most {MAX_IN} inputs; got {n_inputs}")
        self.n_in = n_inputs
        self.code, self.consts, self.out_regs, self.out_dtypes = [], [], [], []
        self._free = list(range(MAX_REGS - 1, n_inputs - 1, -1))   # popped from the end: lowest first
        self._const_reg = {}

    def const(self, value):
        value = float(value)
        if value in self._const_reg:
            return self._const_reg[value]
        if value not in self.consts:
            self.consts.append(value)
        r = self._new()
        self.code.append((OP["CONST"], r, self.consts.index(value), 0, 0))
        self._const_reg[value] = r
        return r

    def op(self, name, *regs):
        if len(regs) != ARITY[name]:
            raise ValueError(f"{name} reads {ARITY[name]} registers; got {len(regs)}")
        r = self._new()
        a, b, c = (list(regs) + [0, 0, 0])[:3]
        self.code.append((OP[name], r, a, b, c))
        return r

    def release(self, reg):
        """reg is read no more: later instructions may write it (not inputs or constants)."""
        if reg >= self.n_in and reg not in self._const_reg.values() and reg not in self._free:
            self._free.append(reg)
            self._free.sort(reverse=True)

    def output(self, reg, dtype):
        self.out_regs.append(reg)
        self.out_dtypes.append(dtype)

    def args(self, out_strides=()):
        """(program, consts, out_regs, out_dtypes[, out_strides]): out_strides, the
        outputs' strides in turn, when any is not contiguous."""
        base = ([v for ins in self.code for v in ins], list(self.consts), list(self.out_regs), list(self.out_dtypes))
        return base + (list(out_strides),) if out_strides else base

    def _new(self):
        if not self._free:
            raise ValueError(f"a chain has {MAX_REGS} registers; this one needs more")
        return self._free.pop()


def _check_program(program, consts, out_regs, n_in):
    """What kt_chain_check and the bridge refuse in a program (the fake kernel's copy)."""
    op = "pointwise_chain"
    if len(program) // 5 > MAX_OPS or len(consts) > MAX_CONST:
        fail(op, f"{len(program) // 5} instructions and {len(consts)} constants; at most {MAX_OPS} and {MAX_CONST}")
    written = set(range(n_in))
    for j in range(len(program) // 5):
        code, dst, a, b, c = program[5 * j:5 * j + 5]
        if not 0 <= code < len(OPCODES) or not 0 <= dst < MAX_REGS:
            fail(op, "the program is not valid: an opcode >= 35, a register >= 32 or read before it is written")
        name = OPCODES[code]
        if name == "CONST" and not 0 <= a < len(consts):
            fail(op, f"instruction {j} reads constant {a} of {len(consts)}")
        if any(r not in written for r in (a, b, c)[:ARITY[name]]):
            fail(op, "the program is not valid: an opcode >= 35, a register >= 32 or read before it is written")
        written.add(dst)
    if any(r not in written for r in out_regs):
        fail(op, "the program is not valid: an output register is never written")


@torch.library.register_fake("kitsune::_pointwise_chain_interpreted")
@torch.library.register_fake("kitsune::pointwise_chain")
def _(inputs, program, consts, out_regs, out_dtypes, out_strides=()):
    op = "pointwise_chain"
    if len(inputs) > MAX_IN:
        fail(op, f"{len(inputs)} inputs; at most {MAX_IN}")
    if len(program) % 5:
        fail(op, f"program has {len(program)} entries; it must be 5 a instruction (op, dst, a, b, c)")
    if not 1 <= len(out_regs) <= MAX_OUT or len(out_dtypes) != len(out_regs):
        fail(op, f"{len(out_regs)} out_regs and {len(out_dtypes)} out_dtypes; 1 to {MAX_OUT}, as many of each")
    for k, t in enumerate(inputs):
        if t.dtype not in DTYPES:
            fail(op, f"inputs[{k}] is {t.dtype}; a chain takes float32, float16, bfloat16 and bool")
        if t.device != inputs[0].device:
            fail(op, f"inputs[0] is on {inputs[0].device} but inputs[{k}] is on {t.device}")
    out_dtypes = [_SCALAR_TYPE.get(d, d) if isinstance(d, int) else d for d in out_dtypes]
    for k, d in enumerate(out_dtypes):
        if d not in DTYPES:
            fail(op, f"out_dtypes[{k}] is {d}; a chain takes float32, float16, bfloat16 and bool")
    _check_program(program, consts, out_regs, len(inputs))
    shape = list(broadcast_shape(op, {f"inputs[{k}]": t for k, t in enumerate(inputs)})) if inputs else []
    if len(shape) > MAX_DIM:
        fail(op, f"the inputs broadcast to {len(shape)} dimensions; at most {MAX_DIM}")
    if out_strides and len(out_strides) != len(out_regs) * len(shape):
        fail(op, f"out_strides has {len(out_strides)} entries; it must be empty (contiguous outputs) or give "
                 f"{len(shape)} strides for each of the {len(out_regs)} outputs")
    device = inputs[0].device if inputs else torch.device("cpu")
    outs = []
    for k, d in enumerate(out_dtypes):
        if out_strides:
            t = torch.empty_strided(shape, out_strides[k * len(shape):(k + 1) * len(shape)], dtype=d, device=device)
            if not dense(t):
                fail(op, f"out_strides for output {k} ({list(t.stride())}) are not a dense layout of shape {shape}")
        else:
            t = torch.empty(shape, dtype=d, device=device)
        outs.append(t)
    return outs
