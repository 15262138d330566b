"""Python mods -> IR: call the mod once with symbolic values, torch.fx style.

`trace` calls a ``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)``
with `Proxy` objects. A Proxy wraps one IR node; its operators and the torch functions it meets
(through ``__torch_function__``, looked up in the table of flexattn/torch_functions.py) build new
nodes with torch's type promotion (see flexattn/ir.py), so the traced mod means per element
exactly what it means under torch's vmap over (b, h, q_idx, kv_idx):

    >>> bias = torch.randn(16, 128)
    >>> def rel_bias(score, b, h, q_idx, kv_idx):
    ...     return score + bias[h][(q_idx - kv_idx).abs().clamp(max=127)]
    >>> trace(rel_bias)
    <score_mod rel_bias: (score + bias[h][minimum(abs((q_idx - kv_idx)), 127)])>

What becomes what:
  - Python numbers the mod reads (closure cells, globals, attributes) become IR constants, so
    they are part of the mod's key (`flexattn.scalars` passes those that change from call to
    call as captured 0-d tensors instead).
  - Captured tensors indexed by (or combined with) a traced value become kernel inputs
    (`ir.Buffer`, numbered in first-use order). A captured 0-d tensor is a buffer read with no
    index, not a constant: changing its value in place does not need a new kernel. A captured
    tensor's value handed to Python (``t.item()``, ``float(t)``, ``if t:``) is a constant of the
    IR instead: such a mod is marked (`Mod.host_values`) and traced again at each call.
  - ``torch.tensor(3.0)``, ``torch.ones(())``, ``x.new_ones((), dtype=torch.bool)`` inside a mod
    are constants.
  - Python control flow on a traced value (``if``, ``and``, ``int()``, ``range()``...) has no
    per-element meaning: it raises `TraceError` naming the mod, file and line.

A `TorchFunctionMode` is active while the mod runs so that the few torch calls made without a
Proxy argument (factories such as ``torch.tensor(2.0)``, ops on captured 0-d tensors) are seen too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import keyword
import linecache
import math
import os
import sys
import textwrap
import threading
from contextlib import contextmanager
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from flexattn import ir
from flexattn.mods import ARITY, MASK, SCORE, Mod
from flexattn.torch_functions import (FACTORIES, HANDLERS, NAMES, as_node, factory, handles, number,
                                      supported_list, torch_name)

__all__ = ["trace", "TraceError", "Proxy", "is_traced", "inline", "call"]


class TraceError(TypeError):
    """A Python mod that cannot be traced (control flow on traced values, unsupported calls...)."""


# ---------------------------------------------------------------------------------------------
# Trace state

_FLEXATTN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_local = threading.local()


def _stack() -> list["_Trace"]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


_STDLIB_HELPERS = {os.path.abspath(m.__file__) for m in (contextlib, functools)}


def _library_frame(frame) -> bool:
    name = frame.f_code.co_filename
    return name.startswith(_FLEXATTN_DIR) or name.startswith(_TORCH_DIR) or name in _STDLIB_HELPERS


def _user_frame(depth: int = 1, stop=None):
    """The innermost stack frame outside flexattn and torch: the mod line being traced; None where
    the walk reaches the frame ``stop`` first."""
    frame = sys._getframe(depth)
    while frame is not None and frame is not stop and _library_frame(frame):
        frame = frame.f_back
    return None if frame is stop else frame


# flexattn's own torch calls while a mod runs: promotion, constant folding, eager evaluation.
_INTERNAL_FILES = {os.path.join(_FLEXATTN_DIR, f) for f in ("ir.py", "tracer.py", "torch_functions.py", "mods.py")}


def _called_internally() -> bool:
    # Skip torch's own frames (F.silu -> handle_torch_function ...); whoever called torch decides.
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename in _INTERNAL_FILES


# Buffer names appear in printed DSL text, so they must not read as an input, an op or a literal.
_RESERVED = (set(ir.SCORE_INPUTS) | set(ir.UNARY_OPS) | set(ir.BINARY_OPS) | set(ir.DTYPES)
             | {"where", "inf", "nan", "load", "cast", "const", "input"})


class _Trace:
    """One `trace` call: the mod's name and kind, and the tensors it captured so far."""

    def __init__(self, kind: str, name: str, device: torch.device, score_dtype: torch.dtype):
        self.kind, self.name, self.device, self.score_dtype = kind, name, device, score_dtype
        self.tensors: list[torch.Tensor] = []
        self.buffers: dict[int, ir.Buffer] = {}  # id(tensor) -> Buffer (tensors keeps them alive)
        self.names: set[str] = set()
        self.host_values = False  # whether the mod read a captured tensor's value on the host
        self.entry = None  # the frame of the `trace` call, while the mod runs

    def describe(self) -> str:
        return f"{self.kind}_mod '{self.name}'"

    def capture(self, tensor: torch.Tensor, hint: str | None = None) -> ir.Buffer:
        """The Buffer for ``tensor``, registering it on first use (the same object is reused)."""
        buf = self.buffers.get(id(tensor))
        if buf is not None:
            return buf
        if tensor.is_complex() or tensor.dtype not in ir.DTYPE_NAMES or tensor.layout != torch.strided:
            raise _fail(
                f"reads a captured tensor of dtype {tensor.dtype} and layout {tensor.layout}; captured "
                f"tensors must be dense (strided) with one of the dtypes {', '.join(ir.DTYPES)}"
            )
        name = self._unique(hint or _variable_name(tensor) or f"buf{len(self.tensors)}")
        buf = ir.Buffer(len(self.tensors), name, tensor.dtype, tensor.dim())
        self.tensors.append(tensor)
        self.buffers[id(tensor)] = buf
        self.names.add(name)
        return buf

    def _unique(self, name: str) -> str:
        if not name.isidentifier() or keyword.iskeyword(name) or name in _RESERVED:
            name = f"{name}_buf" if name.isidentifier() else f"buf{len(self.tensors)}"
        base, i = name, 1
        while name in self.names:
            name, i = f"{base}_{i}", i + 1
        return name


def _active() -> "_Trace":
    stack = _stack()
    if not stack:
        raise TraceError("flexattn tracer used outside of trace()")
    return stack[-1]


def _variable_name(tensor: torch.Tensor) -> str | None:
    """The name the mod's code uses for ``tensor``: a local/closure variable, a global, an attribute.
    Only frames the mod runs in are read: a mod of flexattn's own (a ready-made mask) has none, and
    reading the caller's locals would keep its variables alive (CPython up to 3.12 keeps the
    snapshot ``f_locals`` made on the frame until the next read of it: a training loop's tensors
    of that step, for as long as the loop runs)."""
    stack = _stack()
    frame = _user_frame(2, stack[-1].entry if stack else None)
    if frame is None:
        return None
    scopes = [frame.f_locals, frame.f_globals]
    for scope in scopes:
        for name, value in scope.items():
            if value is tensor and not name.startswith("__"):
                return name
    for value in list(frame.f_locals.values()):  # self.bias, cfg.table ...
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not inspect.ismodule(value):
            for name, attr in attrs.items():
                if attr is tensor:
                    return name.lstrip("_") or None
    return None


def _where() -> str:
    """'\\n  at file:line (in fn)\\n    <source line>' for the mod line being traced, or ''."""
    frame = _user_frame(2)
    if frame is None:
        return ""
    code = frame.f_code
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f"\n  at {code.co_filename}:{frame.f_lineno} (in {code.co_name})" + (f"\n    {line}" if line else "")


def _fail(message: str) -> TraceError:
    """A TraceError naming the mod being traced and the line of the mod that caused it."""
    trace = _stack()[-1] if _stack() else None
    return TraceError(f"{trace.describe() if trace else 'mod'}: {message}{_where()}")


@contextmanager
def _located():
    """Turn IR errors (bad dtypes, overflowing constants) into TraceErrors that point at the mod."""
    try:
        yield
    except ir.IRError as e:
        if isinstance(e, TraceError):
            raise
        raise _fail(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Values: Proxy (a traced scalar) and _View (a captured tensor indexed along its leading dims)


def _v(x) -> ir.Node | bool | int | float:
    """The IR operand for ``x``: a node, or a Python number (a weak scalar for promotion)."""
    if isinstance(x, Proxy):
        return x.node
    n = number(x)
    if n is not None:
        return n
    if isinstance(x, torch.Tensor):
        trace = _active()
        if x.dim() != 0:
            name = trace.buffers[id(x)].name if id(x) in trace.buffers else (_variable_name(x) or "tensor")
            raise _fail(
                f"combines captured tensor '{name}' of shape {tuple(x.shape)} with a traced value; a mod "
                f"works on one element at a time, so index the tensor down to a single element first "
                f"(e.g. {name}[h] or {name}[q_idx, kv_idx])"
            )
        return ir.load(trace.capture(x), ())
    if isinstance(x, _View):
        x._incomplete()
    raise _fail(f"uses a {type(x).__name__} ({x!r}) as a value; expected a traced value, a Python "
                f"number or a 0-d tensor")


def _wrap(x, trace: "_Trace"):
    return Proxy(x, trace) if isinstance(x, ir.Node) else x


_CONTROL_FLOW_HINT = (
    "A mod is traced once with symbolic values (one per (b, h, q_idx, kv_idx) element), so Python "
    "cannot branch on them. Use torch.where(cond, a, b) instead of if/else or a conditional "
    "expression, `&`, `|`, `~` instead of and/or/not, torch.minimum/torch.maximum instead of "
    "min/max, torch functions instead of math.*, and a captured tensor instead of a Python list."
)


class Proxy:
    """A traced scalar: one IR node. Operators and torch functions on it build IR.

    Per element, like a 0-d tensor under vmap: ``.shape == ()``, ``.dtype`` is the node's dtype.
    """

    __slots__ = ("node", "tracer", "weak")

    def __init__(self, node: ir.Node, tracer: "_Trace", weak: bool = False):
        self.node = node
        self.tracer = tracer
        self.weak = weak  # (computed from dynamic Python numbers and plain Python numbers alone: `_is_weak`)

    # -- tensor-like attributes
    @property
    def dtype(self) -> torch.dtype:
        return self.node.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(())

    @property
    def device(self) -> torch.device:
        return self.tracer.device

    ndim = property(lambda self: 0)
    requires_grad = property(lambda self: False)
    is_cuda = property(lambda self: self.tracer.device.type == "cuda")

    def dim(self) -> int:
        return 0

    def size(self, dim: int | None = None):
        if dim is not None:
            raise IndexError("a traced value is a scalar: it has no dimension to size()")
        return torch.Size(())

    def numel(self) -> int:
        return 1

    def is_floating_point(self) -> bool:
        return self.node.dtype.is_floating_point

    def __repr__(self) -> str:
        return f"Proxy({ir.to_text(self.node)}: {ir.dtype_name(self.node.dtype)})"

    __hash__ = object.__hash__  # __eq__ builds IR; proxies still work as dict keys by identity

    # -- everything else a Tensor has goes through the torch-function table
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def __getattr__(self, name: str):
        attr = getattr(torch.Tensor, name, None)
        if attr is None or name.startswith("_"):
            raise AttributeError(f"traced value (a {ir.dtype_name(self.node.dtype)} scalar) has no attribute {name!r}")
        if not callable(attr):
            raise _fail(f"reads the attribute .{name} of a traced value; only .dtype, .device, .shape "
                        f"and .ndim are available while tracing")
        return functools.partial(_dispatch_method, attr, self)

    def __getitem__(self, index):
        raise _fail("indexes a traced value; traced values are scalars (one element each), only "
                    "captured tensors can be indexed")

    # -- Python control flow: an error, unless the value is a known constant
    def _concrete(self, what: str):
        if self.node.op == "const":
            return self.node.arg
        raise _fail(f"uses the traced value `{ir.to_text(self.node)}` in Python control flow ({what}). "
                    f"{_CONTROL_FLOW_HINT}")

    def __bool__(self):
        return bool(self._concrete("bool(): `if`, `while`, `and`, `or`, `not`, min/max or a conditional expression"))

    def __index__(self):
        value = self._concrete("used as a Python integer index: range(), a list/tuple index, slicing")
        if not isinstance(value, int):
            raise _fail(f"{value!r} is used as an integer index but is not an integer")
        return int(value)

    def __int__(self):
        return int(self._concrete("int()"))

    def __float__(self):
        return float(self._concrete("float() or a math.* function"))

    def __complex__(self):
        return complex(self._concrete("complex()"))

    def item(self):
        return self._concrete(".item()")

    def tolist(self):
        return self._concrete(".tolist()")

    def __iter__(self):
        self._concrete_never("iterated over")

    def __len__(self):
        self._concrete_never("len()")

    def _concrete_never(self, what: str):
        raise _fail(f"a traced value was {what}, but traced values are scalars. {_CONTROL_FLOW_HINT}")

    def __round__(self, ndigits=None):
        if ndigits is not None:
            raise _fail("round(x, ndigits) is not supported on traced values")
        return _apply(self.tracer, lambda: ir.unary("round", self.node))

    def __floor__(self):
        return _apply(self.tracer, lambda: ir.unary("floor", self.node))

    def __ceil__(self):
        return _apply(self.tracer, lambda: ir.unary("ceil", self.node))

    def __trunc__(self):
        return _apply(self.tracer, lambda: ir.unary("trunc", self.node))

    @staticmethod
    def __flexattn_inline__(mod, args):
        """`Mod.__call__` on traced values: inline the Mod's IR (see `inline`)."""
        return inline(mod, args)

    def __pos__(self):
        return self


def _apply(trace: "_Trace", build: Callable[[], ir.Node]) -> Proxy:
    with _located():
        return Proxy(build(), trace)


# The one operator table: magic name -> (IR op, arity). Binary operators also get their
# reflected twin (__radd__: `1 + q_idx`); comparisons need none, Python swaps them itself.
_MAGIC = {
    "add": ("add", 2), "sub": ("sub", 2), "mul": ("mul", 2), "truediv": ("truediv", 2),
    "floordiv": ("floordiv", 2), "mod": ("mod", 2), "pow": ("pow", 2),
    "and": ("and_", 2), "or": ("or_", 2), "xor": ("xor", 2), "lshift": ("lshift", 2), "rshift": ("rshift", 2),
    "eq": ("eq", 2), "ne": ("ne", 2), "lt": ("lt", 2), "le": ("le", 2), "gt": ("gt", 2), "ge": ("ge", 2),
    "neg": ("neg", 1), "abs": ("abs", 1), "invert": ("invert", 1),
}


def _magic_binary(op: str, reflected: bool):
    def method(self, other):
        with _located():
            mine, weak = self, False
            if self.weak or _is_weak(other):
                lift, weak = _weak_lift((self, other))
                if lift is not None:
                    mine, other = lift(self), lift(other)
            a, b = _v(mine), _v(other)
            node = ir.binary(op, b, a) if reflected else ir.binary(op, a, b)
        return Proxy(node, self.tracer, weak=weak)
    return method


def _magic_unary(op: str):
    def method(self):
        out = _apply(self.tracer, lambda: ir.unary(op, self.node))
        out.weak = self.weak  # (-w of a dynamic number: weak too)
        return out
    return method


def _magic_methods():
    """(dunder name, method) for every entry of `_MAGIC`."""
    for name, (op, arity) in _MAGIC.items():
        if arity == 1:
            yield f"__{name}__", _magic_unary(op)
            continue
        yield f"__{name}__", _magic_binary(op, reflected=False)
        if op not in ir.COMPARISONS:
            yield f"__r{name}__", _magic_binary(op, reflected=True)


for _name, _method in _magic_methods():
    _method.__name__ = _name
    setattr(Proxy, _name, _method)
del _name, _method


class _View:
    """A captured tensor indexed along its leading dims (``bias[b]`` of a 3-d ``bias``).

    It only supports further indexing; once every dim has an index it becomes a load.
    """

    def __init__(self, trace: "_Trace", tensor: torch.Tensor, buffer: ir.Buffer, indices: tuple):
        self.trace, self.tensor, self.buffer, self.indices = trace, tensor, buffer, indices

    def __getitem__(self, index):
        return _gather(self.trace, self.tensor, index, self.buffer, self.indices)

    def __repr__(self) -> str:
        idx = "".join(f"[{ir.to_text(i)}]" for i in self.indices)
        return f"<partially indexed {self.buffer.name}{idx}>"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def _incomplete(self, *_args):
        n, d = len(self.indices), self.buffer.ndim
        example = ", ".join(("b", "h", "q_idx", "kv_idx")[-d:] if d <= 4 else ["i"] * d)
        raise _fail(
            f"uses captured tensor '{self.buffer.name}' ({d} dims) indexed with only {n} index(es); a mod "
            f"reads single elements: index all {d} dims, e.g. {self.buffer.name}[{example}]"
        )

    __bool__ = __index__ = __int__ = __float__ = __iter__ = __len__ = _incomplete

    def __getattr__(self, name: str):
        if name.startswith("_") or not hasattr(torch.Tensor, name):
            raise AttributeError(name)
        self._incomplete()  # bias[b].float(), bias[b].shape ...


for _name, _ in _magic_methods():  # a partially indexed tensor is not a value yet
    setattr(_View, _name, _View._incomplete)
_View.__pos__ = _View._incomplete
_View.__hash__ = object.__hash__
del _name, _


def _gather(trace: "_Trace", tensor: torch.Tensor, index, buffer: ir.Buffer | None = None, prefix: tuple = ()):
    """``tensor[index]`` with traced indices: a load once all dims are indexed, else a `_View`."""
    if buffer is None:
        if tensor.dim() == 0:
            raise _fail("indexes a 0-d captured tensor; use it directly, without an index")
        buffer = trace.capture(tensor)
    items = index if isinstance(index, tuple) else (index,)
    idx = list(prefix)
    for item in items:
        idx.append(_index_operand(trace, buffer, item))
    if len(idx) > buffer.ndim:
        raise _fail(f"indexes captured tensor '{buffer.name}' ({buffer.ndim} dims) with {len(idx)} indices")
    if len(idx) < buffer.ndim:
        return _View(trace, tensor, buffer, tuple(idx))
    with _located():
        return Proxy(ir.load(buffer, idx), trace)


def _index_operand(trace: "_Trace", buffer: ir.Buffer, item):
    what = None
    if isinstance(item, Proxy):
        if item.node.dtype in (torch.bool, torch.uint8):  # (torch indexes with a uint8 tensor as a bool mask)
            what = f"a {ir.dtype_name(item.node.dtype)} traced value"
        elif item.node.dtype.is_floating_point:
            raise _fail(
                f"indexes captured tensor '{buffer.name}' with the {ir.dtype_name(item.node.dtype)} value "
                f"`{ir.to_text(item.node)}`; indices must be integers: convert with .long() or .int() "
                f"(after torch.floor/torch.round if needed)"
            )
        else:
            return item.node
    elif isinstance(number(item), bool):
        what = "a Python bool"
    elif number(item) is not None:
        n = number(item)
        if isinstance(n, int):
            return n
        what = f"a float ({n!r})"
    elif isinstance(item, torch.Tensor):
        if item.dim() == 0 and ir.is_int(item.dtype) and item.dtype != torch.uint8:
            return ir.load(trace.capture(item), ())
        what = f"a tensor of dtype {item.dtype} and shape {tuple(item.shape)}"
    elif isinstance(item, slice):
        what = "a slice"
    elif item is None:
        what = "None (a new axis)"
    elif item is Ellipsis:
        what = "`...`"
    elif isinstance(item, _View):
        item._incomplete()
    else:
        what = f"a {type(item).__name__}"
    hint = (" A bool index is a mask that selects elements; per element use torch.where(cond, a, b)."
            if "bool" in what else
            " torch reads a uint8 tensor index as a bool mask; to gather, convert it with .long() or .int()."
            if "uint8" in what else "")
    raise _fail(
        f"indexes captured tensor '{buffer.name}' with {what}; a mod reads single elements, so every "
        f"index must be an integer (a traced index like q_idx, a Python int, or a 0-d integer tensor).{hint}"
    )


# ---------------------------------------------------------------------------------------------
# Dispatch: a torch call on traced values goes to its handler in flexattn/torch_functions.py


def _is_weak(x) -> bool:
    """Whether ``x`` stands for a Python number that changed between calls (`flexattn.scalars`),
    traced as a 0-d tensor, or was computed from such numbers and Python numbers alone: it promotes
    as the Python number would, weakly."""
    if isinstance(x, Proxy):
        return x.weak
    return isinstance(x, torch.Tensor) and getattr(x, "_flexattn_weak", False)


def _weak_lift(operands) -> tuple[Callable | None, bool]:
    """For the operands of one operation, some weak (`_is_weak`): ``(lift, weak result)``. ``lift``
    turns a weak operand into the traced value of the dtype a Python number of its kind takes
    beside the strong traced operands (a float: float32 beside integers and bools, as in torch,
    their float dtype beside floats; an int: the strong integer dtype, uint8 beside uint8, int64
    beside bools) and leaves the others; None where no operand is strong. The result is weak in
    turn where the operands are weak values and Python numbers alone (``w * 100``)."""
    strong = [a for a in operands if isinstance(a, Proxy) and not a.weak]
    if not strong:
        return None, all(_is_weak(a) or number(a) is not None for a in operands if a is not None)
    nodes = [a.node for a in strong]

    def lift(a):
        if not _is_weak(a):
            return a
        v = _v(a)
        kind = 0.0 if v.dtype.is_floating_point else False if v.dtype == torch.bool else 0
        return Proxy(ir.cast(v, ir.promote(*nodes, kind)), strong[0].tracer)
    return lift, False


def _dispatch(func, args, kwargs):
    handler = HANDLERS.get(func)
    weak_result = False
    flat = list(_flat(args, kwargs))
    if any(_is_weak(a) for a in flat):
        lift, weak_result = _weak_lift(flat)
        if lift is not None:
            args = tuple(type(a)(map(lift, a)) if isinstance(a, (tuple, list)) else lift(a) for a in args)
            kwargs = {k: lift(a) for k, a in kwargs.items()}
    trace = next((a.tracer for a in _flat(args, kwargs) if isinstance(a, Proxy)), None) or _active()
    if handler is None:
        raise _fail(
            f"calls {torch_name(func)} on a traced value, which flexattn cannot trace. Supported: "
            f"operators (+ - * / // % ** & | ^ ~ << >> comparisons), indexing captured tensors, "
            f"{supported_list()}."
        )
    with _located():
        out = handler(_v, *args, **kwargs)
    if weak_result and isinstance(out, ir.Node):
        return Proxy(out, trace, weak=True)
    return _wrap(out, trace)


def _dispatch_method(func, self, *args, **kwargs):
    return _dispatch(func, (self, *args), kwargs)


def _flat(args, kwargs):
    for a in (*args, *kwargs.values()):
        for item in (a if isinstance(a, (tuple, list)) else (a,)):
            if isinstance(item, slice):  # x[1:q_idx]: torch would call q_idx.__index__
                yield from (item.start, item.stop, item.step)
            else:
                yield item


# Indexing a captured tensor is the tracer's own business (it makes `_View`s and buffer reads).
handles("Tensor.__getitem__")(lambda v, self, index: _gather(_active(), self, index))


@handles("Tensor.__setitem__")
def _setitem(v, self, index, value):
    raise _fail("writes into a tensor; mods must not have side effects")


def _liftable(func, args, kwargs) -> bool:
    """Does this plain-tensor call read a 0-d tensor that must become a buffer read?"""
    if func not in HANDLERS or func in FACTORIES:
        return False
    if NAMES[func] == "torch.Tensor.__getitem__":
        items = args[1] if len(args) > 1 and isinstance(args[1], tuple) else args[1:]
        return any(isinstance(i, torch.Tensor) and i.dim() == 0 and ir.is_int(i.dtype) and i.dtype != torch.uint8
                   for i in items)  # (a uint8 index is a mask to torch: torch runs it)
    tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.dim() == 0 for t in tensors)


# Tensor methods that hand a tensor's value to Python (what a mod then folds as a constant).
_HOST_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                         torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__complex__})


class _TraceMode(TorchFunctionMode):
    """Active while a mod runs: routes calls on traced values to the table, and catches the calls
    that have none (``torch.tensor(2.0)``, ``table[t0]`` with a captured 0-d ``t0``) when the mod
    itself made them (flexattn's own torch calls, e.g. constant folding, pass straight through)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, (Proxy, _View)) for a in _flat(args, kwargs)):
            return _dispatch(func, args, kwargs)
        if (func in FACTORIES or func in HANDLERS) and not _called_internally():
            if func in FACTORIES:
                node = factory(func, args, kwargs)
                if node is not None:
                    return Proxy(node, _active())
            elif _liftable(func, args, kwargs):
                return _dispatch(func, args, kwargs)
        if func in _HOST_READS and args and isinstance(args[0], torch.Tensor) and not _called_internally():
            _active().host_values = True  # (the value is folded into the IR: `Mod.host_values`)
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Entry points


def call(func, args: tuple, kwargs: dict):
    """Apply a torch function or Tensor method as if the mod being traced had called it (replays
    the recordings of `flexattn.capture`)."""
    if any(isinstance(a, (Proxy, _View)) for a in _flat(args, kwargs)):
        return _dispatch(func, args, kwargs)
    return func(*args, **kwargs)


def is_traced(args) -> bool:
    """True when any of ``args`` is a traced value (a mod is being called inside `trace`)."""
    return any(isinstance(a, Proxy) for a in args)


def inline(mod: Mod, args) -> Proxy:
    """Call a traced `Mod` on traced values: its IR with its inputs replaced by ``args``.

    Its captured tensors join the current trace's buffers (deduplicated by identity). Inputs are
    converted to the Mod's input dtypes, as the eager ``Mod.__call__`` does, except a floating
    score: it passes at the caller's precision (a float64 score stays float64), as there.
    """
    trace = next(a.tracer for a in args if isinstance(a, Proxy))
    names = ir.SCORE_INPUTS if mod.kind == SCORE else ir.INDEX_INPUTS
    inputs: dict[str, ir.Node] = {}
    with _located():
        for name, arg in zip(names, args):
            inputs[name] = as_node(_v(arg))
        memo: dict[int, ir.Node] = {}
        for n in ir.toposort(mod.ir):
            src = tuple(memo[id(s)] for s in n.src)
            if n.op == "input":
                given = inputs[n.arg]
                keep = n.arg == "score" and given.dtype.is_floating_point
                new = given if keep else ir.cast(given, n.dtype)
            elif n.op == "load":
                buf = trace.capture(mod.buffers[n.arg.index], hint=n.arg.name)
                new = ir.load(buf, src)
            elif n.src and any(a is not b for a, b in zip(src, n.src)):
                new = _rebuild(n, src)
            else:
                new = n
            memo[id(n)] = new
        root = memo[id(mod.ir)]
        if mod.kind == SCORE and isinstance(args[0], Proxy) and args[0].dtype.is_floating_point:
            root = ir.cast(root, args[0].dtype)
    return Proxy(root, trace)


def _rebuild(n: ir.Node, src: tuple) -> ir.Node:
    """`ir.rebuild` of a mod whose score changed dtype: a floating constant that had the dtype of
    its floating sibling (a Python number, typed by it: ``score * 0.1``) follows the sibling to its
    new dtype, made again from its Python value, as torch computes ``score * 0.1`` at float64 for a
    float64 score (the eager `ir.Evaluator` does the same); ``float(q_idx) * 0.3`` stays float32."""
    if n.op in ir.BINARY_OPS or n.op == "where":
        src = list(src)
        k = len(src) - 2  # (where: cond, a, b)
        for i in (k, k + 1):
            j = 2 * k + 1 - i
            c, old, new = n.src[i], n.src[j], src[j]
            if (c.op == "const" and c.dtype.is_floating_point and old.dtype == c.dtype
                    and new.dtype.is_floating_point and new.dtype != old.dtype):
                src[i] = ir.const(c.arg, new.dtype)
        src = tuple(src)
    return ir.rebuild(n, src)


def trace(fn, kind: str | None = None, *, score_dtype: torch.dtype = torch.float32,
          name: str | None = None, device: torch.device | str | None = None) -> Mod:
    """Trace a Python ``score_mod`` / ``mask_mod`` into a `Mod`.

    ``kind`` is "score" or "mask"; by default it comes from the number of required positional
    parameters (5 or 4). ``score_dtype`` is the dtype of the ``score`` input and of a score mod's
    result. ``device`` is what ``q_idx.device`` reports while tracing (default cpu). A `Mod` is
    returned as is (re-typed if its score dtype differs).

        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> trace(causal)
        <mask_mod causal: (q_idx >= kv_idx)>
    """
    if not isinstance(score_dtype, torch.dtype) or not score_dtype.is_floating_point:
        raise TypeError(f"trace(): score_dtype must be a floating-point torch.dtype, got {score_dtype!r}")
    if kind is not None and kind not in ARITY:
        raise ValueError(f"trace(): kind must be 'score', 'mask' or None, got {kind!r}")
    if isinstance(fn, Mod):
        return _retype(fn, kind, score_dtype, name)
    if not callable(fn):
        raise TypeError(f"trace(): expected a score_mod/mask_mod function or a Mod, got {type(fn).__name__}")
    name = name or _function_name(fn)
    kind = kind or _infer_kind(fn, name)
    t = _Trace(kind, name, torch.device(device) if device is not None else torch.device("cpu"), score_dtype)
    if kind == SCORE:
        inputs = [ir.input_("score", score_dtype)] + [ir.input_(n) for n in ir.INDEX_INPUTS]
    else:
        inputs = [ir.input_(n) for n in ir.INDEX_INPUTS]
    stack = _stack()
    stack.append(t)
    t.entry = sys._getframe()
    try:
        with _TraceMode():
            out = fn(*(Proxy(n, t) for n in inputs))
            root = _result(t, out)
    finally:
        stack.pop()
        t.entry = None
    mod = Mod(kind, root, t.tensors, name=name, source=_source(fn), fn=fn)
    mod.host_values = t.host_values
    return mod


def _result(t: _Trace, out) -> ir.Node:
    if out is None or isinstance(out, (tuple, list, dict, str)):
        raise TraceError(f"{t.describe()} returned {type(out).__name__ if out is not None else 'None'}; "
                         f"expected a {'float score' if t.kind == SCORE else 'bool'} value"
                         + (" (missing `return`?)" if out is None else ""))
    with _located():
        root = as_node(_v(out))
        if t.kind == SCORE:
            return ir.cast(root, t.score_dtype)
    if root.dtype != torch.bool:
        raise TraceError(
            f"{t.describe()} must return a bool, but it returned a {ir.dtype_name(root.dtype)} value: "
            f"`{ir.to_text(root)}`. Return a comparison (e.g. q_idx >= kv_idx) or convert with .bool()"
        )
    return root


def _retype(mod: Mod, kind, score_dtype, name) -> Mod:
    if kind is not None and kind != mod.kind:
        raise ValueError(f"trace(): {mod.kind}_mod '{mod.name}' was passed with kind={kind!r}")
    current = mod.score_dtype
    if mod.kind == SCORE and (current not in (None, score_dtype) or mod.ir.dtype != score_dtype):
        new_score = ir.input_("score", score_dtype)
        root = ir.substitute(mod.ir, lambda n: new_score if n.op == "input" and n.arg == "score" else None,
                             _rebuild)
        return Mod(mod.kind, ir.cast(root, score_dtype), mod.buffers, name=name or mod.name,
                   source=mod.source, fn=mod.fn)
    if name is not None and name != mod.name:
        return Mod(mod.kind, mod.ir, mod.buffers, name=name, source=mod.source, fn=mod.fn)
    return mod


def _function_name(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        name = type(fn).__name__
    return name


def _source(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    try:
        return textwrap.dedent(inspect.getsource(fn)).strip()
    except (OSError, TypeError):
        return ""


def _infer_kind(fn, name: str) -> str:
    """"score" for 5 required positional parameters, "mask" for 4 (like torch's flex_attention)."""
    ask = "pass kind='score' or kind='mask' to trace()"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise TraceError(f"cannot read the signature of mod '{name}'; {ask}") from None
    P = inspect.Parameter
    required = optional = 0
    varargs = False
    for p in sig.parameters.values():
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            if p.default is P.empty:
                required += 1
            else:
                optional += 1
        elif p.kind == P.VAR_POSITIONAL:
            varargs = True
        elif p.kind == P.KEYWORD_ONLY and p.default is P.empty:
            raise TraceError(f"mod '{name}' has a required keyword-only parameter '{p.name}'; mods are "
                             f"called with positional arguments only")
    if required == ARITY[SCORE]:
        return SCORE
    if required == ARITY[MASK]:
        return MASK
    most = math.inf if varargs else required + optional
    fits = [k for k, n in ARITY.items() if required <= n <= most]
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise TraceError(f"cannot tell whether mod '{name}' {sig} is a score_mod (5 arguments) or a "
                         f"mask_mod (4 arguments); {ask}")
    raise TraceError(
        f"mod '{name}' {sig} takes {required} required positional argument(s); a score_mod takes 5 "
        f"(score, b, h, q_idx, kv_idx) and a mask_mod 4 (b, h, q_idx, kv_idx)"
    )
