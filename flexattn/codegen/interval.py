"""Triton back end of the interval analysis (`flexattn.interval`): the same transfer functions,
*staged*. Values are `Sym` names and every operation of `TritonOps` appends a line of Triton
source, which `emit_interval` wraps into a ``@triton.jit`` function for the block-mask kernel.
"""

from __future__ import annotations

import torch

from flexattn import ir
from flexattn.codegen import emit
from flexattn.interval import SummaryRefs, Summary, analyze


class Sym:
    """A staged Triton value: the name of a temporary in the generated function.

    ``is_bool`` marks comparison results: &, | and ^ between two of them go through the prelude's
    `_fa_and` / `_fa_or` / `_fa_xor` (Triton's interpreter cannot combine a bool scalar with a bool
    tile directly).
    """

    __slots__ = ("ops", "name", "is_bool")

    def __init__(self, ops: "TritonOps", name: str, is_bool: bool = False):
        self.ops, self.name, self.is_bool = ops, name, is_bool

    def __str__(self):
        return self.name

    def _bin(self, other, fmt, swap=False, is_bool=False):
        a, b = (other, self) if swap else (self, other)
        return self.ops.emit(fmt.format(_text(a), _text(b)), is_bool)

    def _logic(self, other, fn, symbol, swap=False):
        if self.is_bool and isinstance(other, Sym) and other.is_bool:
            return self._bin(other, f"{fn}({{}}, {{}})", swap, True)
        return self._bin(other, f"({{}} {symbol} {{}})", swap)

    def _cmp(self, other, symbol):
        return self._bin(other, f"({{}} {symbol} {{}})", is_bool=True)

    __add__ = lambda s, o: s._bin(o, "({} + {})")
    __radd__ = lambda s, o: s._bin(o, "({} + {})", True)
    __sub__ = lambda s, o: s._bin(o, "({} - {})")
    __rsub__ = lambda s, o: s._bin(o, "({} - {})", True)
    __mul__ = lambda s, o: s._bin(o, "({} * {})")
    __rmul__ = lambda s, o: s._bin(o, "({} * {})", True)
    __rshift__ = lambda s, o: s._bin(o, "({} >> {})")
    __and__ = lambda s, o: s._logic(o, "_fa_and", "&")
    __rand__ = lambda s, o: s._logic(o, "_fa_and", "&", True)
    __or__ = lambda s, o: s._logic(o, "_fa_or", "|")
    __ror__ = lambda s, o: s._logic(o, "_fa_or", "|", True)
    __xor__ = lambda s, o: s._logic(o, "_fa_xor", "^")
    __lt__ = lambda s, o: s._cmp(o, "<")
    __le__ = lambda s, o: s._cmp(o, "<=")
    __gt__ = lambda s, o: s._cmp(o, ">")
    __ge__ = lambda s, o: s._cmp(o, ">=")
    __eq__ = lambda s, o: s._cmp(o, "==")  # type: ignore[assignment]
    __ne__ = lambda s, o: s._cmp(o, "!=")  # type: ignore[assignment]
    __neg__ = lambda s: s.ops.emit(f"(-{s.name})")
    __invert__ = lambda s: s.ops.emit(f"({s.name} == 0)", True) if s.is_bool else s.ops.emit(f"(~{s.name})")
    __hash__ = None  # type: ignore[assignment]


def _text(x) -> str:
    if isinstance(x, Sym):
        return x.name
    if isinstance(x, bool):
        return "1" if x else "0"
    if isinstance(x, int):
        return str(x) if -(2**31) <= x < 2**31 else f"tl.full([], {x}, tl.int64)"
    if isinstance(x, float):
        return emit.pyval(x)
    raise TypeError(f"cannot stage {type(x).__name__}")


_LOW = (torch.float16, torch.bfloat16)


class TritonOps:
    """Interval ops that append Triton source lines (see `emit_interval`)."""

    def __init__(self):
        self.lines: list[str] = []
        self.count = 0

    def emit(self, expr: str, is_bool: bool = False) -> Sym:
        name = f"v{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {expr}")
        return Sym(self, name, is_bool)

    def i64(self, value: int):
        return self.emit(f"tl.full([], {int(value)}, tl.int64)")

    # Half and bfloat16 values are held in float32, rounded to their dtype by `to` (as the
    # kernels compute them: emit's _LOW): Triton's interpreter has no bfloat16 arithmetic or
    # conversions (it would add and convert the bit patterns as integers).
    def fconst(self, value: float, dtype: torch.dtype):
        held = torch.float32 if dtype in _LOW else dtype
        return self.emit(f"tl.full([], {emit.pyval(float(value))}, {emit.TL_DTYPE[held]})")

    def to(self, x, dtype: torch.dtype):
        if dtype == torch.bfloat16:
            return self.emit(f"_fa_to_bf16({_text(x)}.to(tl.float32)).to(tl.float32)")
        if dtype == torch.float16:
            return self.emit(f"{_text(x)}.to(tl.float32).to(tl.float16).to(tl.float32)")
        return self.emit(f"{_text(x)}.to({emit.TL_DTYPE[dtype]})")

    def where(self, c, a, b):
        return self.emit(f"tl.where({_text(c)}, {_text(a)}, {_text(b)})")

    def _minmax(self, fn, a, b):
        # Floats propagate NaN (a NaN bound means "don't know"); ints ignore the flag.
        return self.emit(f"tl.{fn}({_text(a)}, {_text(b)}, propagate_nan=tl.PropagateNan.ALL)")

    def minimum(self, a, b):
        return self._minmax("minimum", a, b)

    def maximum(self, a, b):
        return self._minmax("maximum", a, b)

    def floordiv(self, a, b):
        return self.emit(f"_fa_floordiv_int({_text(a)}, {_text(b)})")

    def mod(self, a, b):
        return self.emit(f"_fa_mod_int({_text(a)}, {_text(b)})")

    def unary(self, op: str, x):
        fn = {"floor": "tl.floor", "ceil": "tl.ceil", "round": "_fa_round", "trunc": "_fa_trunc"}[op]
        return self.emit(f"{fn}({_text(x)})")

    def gather(self, table, idx):
        return self.emit(f"tl.load({_text(table)} + {_text(idx)})")


def summary_params(buffers: list[ir.Buffer]) -> list[str]:
    """Kernel parameter names for the summaries of ``buffers`` (after the mod's own)."""
    out = []
    for buf in buffers:
        i = buf.index
        out += [f"S{i}_min", f"S{i}_max", f"S{i}_off", f"S{i}_top"]
    return out


def summary_args(buffers: list[ir.Buffer], summaries: list[Summary]) -> list:
    out = []
    for buf in buffers:
        sm = summaries[buf.index]
        out += [sm.mins, sm.maxs, sm.offsets, sm.top]
    return out


def emit_interval(root: ir.Node, name: str = "mask_interval") -> tuple[str, tuple[str, ...]]:
    """The ``@triton.jit`` source of the interval analysis of ``root``, and its extra params.

    Signature: ``name(b, h, q_lo, q_hi, kv_lo, kv_hi, <mod buffer params>, <summary params>)``,
    returning int64 (lo, hi) of the root; ``lo == 1``: surely true, ``hi == 0``: surely false.
    Index arguments are int32 or int64 tensors that broadcast together.
    """
    if root.dtype != torch.bool:
        raise TypeError(f"interval analysis decides bool masks, got {ir.dtype_name(root.dtype)}")
    ops = TritonOps()
    inputs = {}
    for key, lo, hi in (("b", "b", "b"), ("h", "h", "h"), ("q_idx", "q_lo", "q_hi"), ("kv_idx", "kv_lo", "kv_hi")):
        slo = ops.emit(f"{lo}.to(tl.int64)")
        shi = slo if hi == lo else ops.emit(f"{hi}.to(tl.int64)")
        inputs[key] = (slo, shi)
    buffers = ir.buffers_of(root)
    refs = {}
    for buf in buffers:
        i = buf.index
        size = ops.emit(f"B{i}_n0.to(tl.int64)") if buf.ndim == 1 else None
        refs[i] = SummaryRefs(Sym(ops, f"S{i}_min"), Sym(ops, f"S{i}_max"), Sym(ops, f"S{i}_off"),
                               Sym(ops, f"S{i}_top"), size, buf.ndim)
    lo, hi = analyze(root, ops, inputs, refs)
    extra = tuple(emit.buffer_params(buffers) + summary_params(buffers))
    sig = ", ".join(["b", "h", "q_lo", "q_hi", "kv_lo", "kv_hi", *extra])
    body = "\n".join(f"    {line}" for line in ops.lines + [f"return {_text(lo)}, {_text(hi)}"])
    return f"@triton.jit\ndef {name}({sig}):\n{body}\n", extra
