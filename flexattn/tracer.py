"""Python mods -> IR: call the mod once with symbolic values, torch.fx style.

`trace` calls a ``score_mod(score, b, h, q_idx, kv_idx)`` or ``mask_mod(b, h, q_idx, kv_idx)``
with `Proxy` objects. A Proxy wraps one IR node; its operators and the torch functions it meets
(through ``__torch_function__``) build new nodes with torch's type promotion (see flexattn/ir.py),
so the traced mod means per element exactly what it means under torch's vmap over
(b, h, q_idx, kv_idx):

    >>> bias = torch.randn(16, 128)
    >>> def rel_bias(score, b, h, q_idx, kv_idx):
    ...     return score + bias[h][(q_idx - kv_idx).abs().clamp(max=127)]
    >>> trace(rel_bias)
    <score_mod rel_bias: (score + bias[h][minimum(abs((q_idx - kv_idx)), 127)])>

What becomes what:
  - Python numbers the mod reads (closure cells, globals, attributes) become IR constants, so
    they are part of the mod's key.
  - Captured tensors indexed by (or combined with) a traced value become kernel inputs
    (`ir.Buffer`, numbered in first-use order). A captured 0-d tensor is a buffer read with no
    index, not a constant: changing its value in place does not need a new kernel.
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
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from flexattn import ir
from flexattn.mods import ARITY, MASK, SCORE, Mod

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


def _user_frame(depth: int = 1):
    """The innermost stack frame outside flexattn and torch: the mod line being traced."""
    frame = sys._getframe(depth)
    while frame is not None and _library_frame(frame):
        frame = frame.f_back
    return frame


# flexattn's own torch calls while a mod runs: promotion, constant folding, eager evaluation.
_INTERNAL_FILES = {os.path.join(_FLEXATTN_DIR, f) for f in ("ir.py", "tracer.py", "mods.py")}


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
    """The name the mod's code uses for ``tensor``: a local/closure variable, a global, an attribute."""
    frame = _user_frame(2)
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


def _number(x):
    """``x`` as a Python bool/int/float if it is a real number (numpy scalars included), else None."""
    if isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, torch.Tensor):
        return None
    kind = getattr(getattr(x, "dtype", None), "kind", None)  # numpy scalars: np.int64(3), np.bool_
    if kind == "b":
        return bool(x)
    if kind in ("i", "u"):
        return int(x)
    if kind == "f":
        return float(x)
    return None


def _v(x) -> ir.Node | bool | int | float:
    """The IR operand for ``x``: a node, or a Python number (a weak scalar for promotion)."""
    if isinstance(x, Proxy):
        return x.node
    n = _number(x)
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

    __slots__ = ("node", "tracer")

    def __init__(self, node: ir.Node, tracer: "_Trace"):
        self.node = node
        self.tracer = tracer

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
            b = _v(other)
            node = ir.binary(op, b, self.node) if reflected else ir.binary(op, self.node, b)
        return Proxy(node, self.tracer)
    return method


def _magic_unary(op: str):
    def method(self):
        return _apply(self.tracer, lambda: ir.unary(op, self.node))
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
        if item.node.dtype == torch.bool:
            what = "a bool traced value"
        elif item.node.dtype.is_floating_point:
            raise _fail(
                f"indexes captured tensor '{buffer.name}' with the {ir.dtype_name(item.node.dtype)} value "
                f"`{ir.to_text(item.node)}`; indices must be integers: convert with .long() or .int() "
                f"(after torch.floor/torch.round if needed)"
            )
        else:
            return item.node
    elif isinstance(_number(item), bool):
        what = "a Python bool"
    elif _number(item) is not None:
        n = _number(item)
        if isinstance(n, int):
            return n
        what = f"a float ({n!r})"
    elif isinstance(item, torch.Tensor):
        if item.dim() == 0 and ir.is_int(item.dtype):
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
            if "bool" in what else "")
    raise _fail(
        f"indexes captured tensor '{buffer.name}' with {what}; a mod reads single elements, so every "
        f"index must be an integer (a traced index like q_idx, a Python int, or a 0-d integer tensor).{hint}"
    )


# ---------------------------------------------------------------------------------------------
# The torch-function table: torch function or Tensor method -> handler building IR


_HANDLERS: dict[Any, Callable] = {}
_HANDLER_NAMES: dict[Any, str] = {}


def _resolve(path: str):
    root, *rest = path.split(".")
    obj = {"torch": torch, "Tensor": torch.Tensor, "F": torch.nn.functional}[root]
    for part in rest:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _handles(*paths: str):
    """Register the decorated handler for each torch function / Tensor method named in ``paths``.

    A handler is called as ``handler(v, *args, **kwargs)`` with the call's own arguments, where
    ``v(x)`` turns an argument into an IR operand (a node or a Python number); it returns an IR
    operand, and raises `ir.IRError` for a call with no per-element meaning.
    """
    def register(handler):
        for path in paths:
            func = _resolve(path)
            if func is not None:
                _HANDLERS.setdefault(func, handler)
                _HANDLER_NAMES.setdefault(func, path.replace("F.", "torch.nn.functional.")
                                          .replace("Tensor.", "torch.Tensor."))
        return handler
    return register


def _torch_name(func) -> str:
    name = _HANDLER_NAMES.get(func)
    if name:
        return name
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    if qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return "torch.Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    return f"{module}.{qual}" if module and not module.startswith("torch._C") else f"torch.{qual}"


def _supported_list() -> str:
    names = {n for n in _HANDLER_NAMES.values() if "__" not in n}
    # Tensor methods that mirror a supported torch.* function are implied by it.
    methods = sorted(n for n in names if n.startswith("torch.Tensor.") and f"torch.{n[13:]}" not in names)
    funcs = sorted(n for n in names if not n.startswith("torch.Tensor."))
    return (", ".join(funcs) + "; the same-named Tensor methods; and Tensor methods "
            + ", ".join("." + n[13:] + "()" for n in methods))


def _dispatch(func, args, kwargs):
    handler = _HANDLERS.get(func)
    trace = next((a.tracer for a in _flat(args, kwargs) if isinstance(a, Proxy)), None) or _active()
    if handler is None:
        raise _fail(
            f"calls {_torch_name(func)} on a traced value, which flexattn cannot trace. Supported: "
            f"operators (+ - * / // % ** & | ^ ~ << >> comparisons), indexing captured tensors, "
            f"{_supported_list()}."
        )
    with _located():
        out = handler(_v, *args, **kwargs)
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


def _unary_handler(op: str):
    def handler(v, input, *, out=None):
        _no_out(out)
        return ir.unary(op, v(input))
    return handler


def _no_out(out):
    if out is not None:
        raise ir.IRError("out= is not supported in mods")


_UNARY_FUNCS = {
    "abs": ("torch.abs", "torch.absolute", "Tensor.abs", "Tensor.absolute", "Tensor.__abs__"),
    "neg": ("torch.neg", "torch.negative", "Tensor.neg", "Tensor.negative", "Tensor.__neg__"),
    "exp": ("torch.exp", "torch.special.exp", "Tensor.exp"),
    "exp2": ("torch.exp2", "torch.special.exp2", "Tensor.exp2"),
    "expm1": ("torch.expm1", "torch.special.expm1", "Tensor.expm1"),
    "log": ("torch.log", "Tensor.log"),
    "log2": ("torch.log2", "Tensor.log2"),
    "log1p": ("torch.log1p", "torch.special.log1p", "Tensor.log1p"),
    "sqrt": ("torch.sqrt", "Tensor.sqrt"),
    "rsqrt": ("torch.rsqrt", "Tensor.rsqrt"),
    "reciprocal": ("torch.reciprocal", "Tensor.reciprocal"),
    "sin": ("torch.sin", "Tensor.sin"),
    "cos": ("torch.cos", "Tensor.cos"),
    "tan": ("torch.tan", "Tensor.tan"),
    "tanh": ("torch.tanh", "Tensor.tanh", "F.tanh"),
    "sigmoid": ("torch.sigmoid", "torch.special.expit", "Tensor.sigmoid", "F.sigmoid"),
    "erf": ("torch.erf", "torch.special.erf", "Tensor.erf"),
    "floor": ("torch.floor", "Tensor.floor", "Tensor.__floor__"),
    "ceil": ("torch.ceil", "Tensor.ceil", "Tensor.__ceil__"),
    "trunc": ("torch.trunc", "torch.fix", "Tensor.trunc", "Tensor.fix", "Tensor.__trunc__"),
    "sign": ("torch.sign", "torch.sgn", "Tensor.sign", "Tensor.sgn"),
    "not": ("torch.logical_not", "Tensor.logical_not"),
    "invert": ("torch.bitwise_not", "Tensor.bitwise_not", "Tensor.__invert__"),
}
for _op, _paths in _UNARY_FUNCS.items():
    _handles(*_paths)(_unary_handler(_op))
del _op, _paths


@_handles("torch.round", "Tensor.round")
def _round(v, input, *, decimals=0, out=None):
    _no_out(out)
    if decimals != 0:
        raise ir.IRError(f"torch.round(decimals={decimals}) is not supported in mods; scale, round and "
                         f"unscale instead")
    return ir.unary("round", v(input))


@_handles("torch.relu", "Tensor.relu", "F.relu")
def _relu(v, input, inplace=False):
    return ir.unary("relu", v(input))


@_handles("F.silu")
def _silu(v, input, inplace=False):
    return ir.unary("silu", v(input))


@_handles("F.gelu")
def _gelu(v, input, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise ir.IRError(f"gelu(approximate={approximate!r}): expected 'none' or 'tanh'")
    return ir.unary("gelu" if approximate == "none" else "gelu_tanh", v(input))


@_handles("F.softplus")
def _softplus(v, input, beta=1.0, threshold=20.0):
    x = v(input)
    if beta == 1 and threshold == 20:
        return ir.unary("softplus", x)
    # torch: x where beta * x > threshold, else log1p(exp(beta * x)) / beta
    bx = ir.binary("mul", x, beta)
    return ir.where(ir.binary("gt", bx, threshold), x, ir.binary("truediv", ir.unary("softplus", bx), beta))


@_handles("F.leaky_relu")
def _leaky_relu(v, input, negative_slope=0.01, inplace=False):
    x = v(input)
    return ir.where(ir.binary("gt", x, 0), x, ir.binary("mul", x, negative_slope))


@_handles("F.hardtanh")
def _hardtanh(v, input, min_val=-1.0, max_val=1.0, inplace=False):
    return ir.clamp(v(input), min_val, max_val)


@_handles("F.relu6")
def _relu6(v, input, inplace=False):
    return ir.clamp(v(input), 0, 6)


@_handles("torch.square", "Tensor.square")
def _square(v, input, *, out=None):
    _no_out(out)
    x = v(input)
    if isinstance(x, ir.Node) and x.dtype == torch.bool:
        x = ir.cast(x, torch.int64)  # torch.square promotes bool to int64
    return ir.binary("mul", x, x)


@_handles("torch.isnan", "Tensor.isnan")
def _isnan(v, input):
    x = v(input)
    return ir.binary("ne", x, x)


@_handles("torch.isinf", "Tensor.isinf")
def _isinf(v, input):
    x = v(input)
    return ir.binary("eq", ir.unary("abs", x), math.inf) if _is_float(x) else ir.const(False)


@_handles("torch.isposinf", "Tensor.isposinf")
def _isposinf(v, input, *, out=None):
    x = v(input)
    return ir.binary("eq", x, math.inf) if _is_float(x) else ir.const(False)


@_handles("torch.isneginf", "Tensor.isneginf")
def _isneginf(v, input, *, out=None):
    x = v(input)
    return ir.binary("eq", x, -math.inf) if _is_float(x) else ir.const(False)


@_handles("torch.isfinite", "Tensor.isfinite")
def _isfinite(v, input):
    x = v(input)
    if not _is_float(x):
        return ir.const(True)
    return ir.binary("and_", ir.binary("eq", x, x), ir.binary("ne", ir.unary("abs", x), math.inf))


def _is_float(x) -> bool:
    return x.dtype.is_floating_point if isinstance(x, ir.Node) else isinstance(x, float)


# -- binary


def _binary_handler(op: str, reflected: bool = False):
    def handler(v, input, other, *, out=None):
        _no_out(out)
        a, b = v(input), v(other)
        return ir.binary(op, b, a) if reflected else ir.binary(op, a, b)
    return handler


_BINARY_FUNCS = {
    "mul": ("torch.mul", "torch.multiply", "Tensor.mul", "Tensor.multiply", "Tensor.__mul__", "Tensor.__rmul__"),
    "floordiv": ("torch.floor_divide", "Tensor.floor_divide", "Tensor.__floordiv__"),
    "mod": ("torch.remainder", "Tensor.remainder", "Tensor.__mod__"),
    "pow": ("torch.pow", "Tensor.pow", "Tensor.__pow__"),
    "minimum": ("torch.minimum", "Tensor.minimum"),
    "maximum": ("torch.maximum", "Tensor.maximum"),
    "and_": ("torch.bitwise_and", "Tensor.bitwise_and", "Tensor.__and__", "Tensor.__rand__"),
    "or_": ("torch.bitwise_or", "Tensor.bitwise_or", "Tensor.__or__", "Tensor.__ror__"),
    "xor": ("torch.bitwise_xor", "Tensor.bitwise_xor", "Tensor.__xor__", "Tensor.__rxor__"),
    "lshift": ("torch.bitwise_left_shift", "Tensor.bitwise_left_shift", "Tensor.__lshift__"),
    "rshift": ("torch.bitwise_right_shift", "Tensor.bitwise_right_shift", "Tensor.__rshift__"),
    "eq": ("torch.eq", "Tensor.eq", "Tensor.__eq__"),
    "ne": ("torch.ne", "torch.not_equal", "Tensor.ne", "Tensor.not_equal", "Tensor.__ne__"),
    "lt": ("torch.lt", "torch.less", "Tensor.lt", "Tensor.less", "Tensor.__lt__"),
    "le": ("torch.le", "torch.less_equal", "Tensor.le", "Tensor.less_equal", "Tensor.__le__"),
    "gt": ("torch.gt", "torch.greater", "Tensor.gt", "Tensor.greater", "Tensor.__gt__"),
    "ge": ("torch.ge", "torch.greater_equal", "Tensor.ge", "Tensor.greater_equal", "Tensor.__ge__"),
}
for _op, _paths in _BINARY_FUNCS.items():
    _handles(*_paths)(_binary_handler(_op))
# Tensor's reflected methods get (self, other) and compute `other <op> self`.
for _op, _path in [("sub", "Tensor.__rsub__"), ("truediv", "Tensor.__rtruediv__"), ("truediv", "Tensor.__rdiv__"),
                   ("floordiv", "Tensor.__rfloordiv__"), ("mod", "Tensor.__rmod__"), ("pow", "Tensor.__rpow__"),
                   ("lshift", "Tensor.__rlshift__"), ("rshift", "Tensor.__rrshift__")]:
    _handles(_path)(_binary_handler(_op, reflected=True))
del _op, _path, _paths


@_handles("torch.add", "Tensor.add", "Tensor.__add__", "Tensor.__radd__")
def _add(v, input, other, *, alpha=1, out=None):
    _no_out(out)
    b = v(other)
    return ir.binary("add", v(input), b if alpha == 1 else ir.binary("mul", b, alpha))


@_handles("torch.sub", "torch.subtract", "Tensor.sub", "Tensor.subtract", "Tensor.__sub__")
def _sub(v, input, other, *, alpha=1, out=None):
    _no_out(out)
    b = v(other)
    return ir.binary("sub", v(input), b if alpha == 1 else ir.binary("mul", b, alpha))


@_handles("torch.div", "torch.divide", "torch.true_divide", "Tensor.div", "Tensor.divide",
          "Tensor.true_divide", "Tensor.__truediv__", "Tensor.__div__")
def _div(v, input, other, *, rounding_mode=None, out=None):
    _no_out(out)
    a, b = v(input), v(other)
    if rounding_mode is None:
        return ir.binary("truediv", a, b)
    if rounding_mode == "floor":
        return ir.binary("floordiv", a, b)
    if rounding_mode == "trunc":
        if ir.promote(a, b).is_floating_point:
            return ir.unary("trunc", ir.binary("truediv", a, b))
        # Integer division rounding toward zero: floor, plus one when inexact and signs differ.
        q, r = ir.binary("floordiv", a, b), ir.binary("mod", a, b)
        fix = ir.binary("and_", ir.binary("ne", r, 0), ir.binary("ne", ir.binary("lt", a, 0), ir.binary("lt", b, 0)))
        return ir.where(fix, ir.binary("add", q, 1), q)
    raise ir.IRError(f"div(rounding_mode={rounding_mode!r}): expected None, 'trunc' or 'floor'")


@_handles("torch.fmod", "Tensor.fmod")
def _fmod(v, input, other, *, out=None):
    _no_out(out)
    a, b = v(input), v(other)
    # C-style remainder (sign of the dividend) from Python-style remainder (sign of the divisor).
    r = ir.binary("mod", a, b)
    fix = ir.binary("and_", ir.binary("ne", r, 0), ir.binary("ne", ir.binary("lt", a, 0), ir.binary("lt", b, 0)))
    return ir.where(fix, ir.binary("sub", r, b), r)


@_handles("torch.max", "Tensor.max")
def _max(v, input, other=None, *args, **kwargs):
    if other is None or args or kwargs or isinstance(other, int) and not isinstance(other, bool):
        raise ir.IRError("torch.max(x) / torch.max(x, dim) reduce over elements, which has no meaning per "
                         "element; use torch.maximum(a, b)")
    return ir.binary("maximum", v(input), v(other))


@_handles("torch.min", "Tensor.min")
def _min(v, input, other=None, *args, **kwargs):
    if other is None or args or kwargs or isinstance(other, int) and not isinstance(other, bool):
        raise ir.IRError("torch.min(x) / torch.min(x, dim) reduce over elements, which has no meaning per "
                         "element; use torch.minimum(a, b)")
    return ir.binary("minimum", v(input), v(other))


def _logical(op: str):
    def handler(v, input, other, *, out=None):
        _no_out(out)
        return ir.binary(op, _truth(v(input)), _truth(v(other)))
    return handler


def _truth(x):
    if isinstance(x, ir.Node):
        return x if x.dtype == torch.bool else ir.binary("ne", x, 0)
    return bool(x)


for _op, _paths in {"and_": ("torch.logical_and", "Tensor.logical_and"),
                    "or_": ("torch.logical_or", "Tensor.logical_or"),
                    "xor": ("torch.logical_xor", "Tensor.logical_xor")}.items():
    _handles(*_paths)(_logical(_op))
del _op, _paths


@_handles("torch.where")
def _where_fn(v, condition, input=None, other=None, *, out=None):
    _no_out(out)
    if input is None or other is None:
        raise ir.IRError("torch.where(cond) with one argument returns indices; mods need torch.where(cond, a, b)")
    return ir.where(_truth(v(condition)), v(input), v(other))


@_handles("Tensor.where")
def _tensor_where(v, self, condition, other):
    return ir.where(_truth(v(condition)), v(self), v(other))


@_handles("torch.clamp", "torch.clip", "Tensor.clamp", "Tensor.clip")
def _clamp(v, input, min=None, max=None, *, out=None):
    _no_out(out)
    if min is None and max is None:
        raise ir.IRError("clamp() needs min= or max=")
    return ir.clamp(v(input), None if min is None else v(min), None if max is None else v(max))


@_handles("torch.clamp_min", "Tensor.clamp_min")
def _clamp_min(v, input, min):
    return ir.clamp(v(input), v(min), None)


@_handles("torch.clamp_max", "Tensor.clamp_max")
def _clamp_max(v, input, max):
    return ir.clamp(v(input), None, v(max))


# -- dtype conversion and constructors


def _as_node(x) -> ir.Node:
    return x if isinstance(x, ir.Node) else ir.const(x)


def _cast(v, x, dtype) -> ir.Node:
    if not isinstance(dtype, torch.dtype):
        raise ir.IRError(f"expected a torch.dtype, got {dtype!r}")
    return ir.cast(_as_node(v(x)), dtype)


@_handles("Tensor.to")
def _to(v, self, *args, dtype=None, **kwargs):
    # .to(dtype), .to(device), .to(device, dtype), .to(other), plus copy/non_blocking/memory_format.
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(getattr(a, "dtype", None), torch.dtype):  # a tensor or a traced value
            dtype = a.dtype
    x = v(self)
    return x if dtype is None else _cast(v, self, dtype)


@_handles("Tensor.type")
def _type(v, self, dtype=None, non_blocking=False, **kwargs):
    if not isinstance(dtype, torch.dtype):
        raise ir.IRError(f".type() needs a torch.dtype while tracing, got {dtype!r}")
    return _cast(v, self, dtype)


@_handles("Tensor.type_as")
def _type_as(v, self, other):
    return _cast(v, self, other.dtype)


for _method, _dtype in {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                        "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64,
                        "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
                        "bool": torch.bool}.items():
    _handles(f"Tensor.{_method}")(functools.partial(lambda v, self, memory_format=None, *, _d: _cast(v, self, _d), _d=_dtype))
del _method, _dtype


@_handles("Tensor.clone", "Tensor.detach", "Tensor.contiguous", "torch.clone", "torch.detach",
          "torch.positive", "Tensor.positive", "Tensor.__pos__", "Tensor.requires_grad_")
def _identity(v, self, *args, **kwargs):
    return _as_node(v(self))


def _scalar_size(size, what: str):
    if size and isinstance(size[0], (tuple, list, torch.Size)):
        (size,) = size
    if len(size) != 0:
        raise ir.IRError(f"calls {what} with size {tuple(size)}; per element only 0-d values exist: pass size ()")


def _fill(value, dtype, like) -> ir.Node:
    if dtype is None:
        dtype = like
    return ir.cast(_as_node(value), dtype) if dtype is not None else _as_node(value)


def _new_constant(value: int, what: str):
    def handler(v, self, *size, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False, **kw):
        if "size" in kw:  # torch's and_masks: b.new_ones(size=(), dtype=torch.bool, device=b.device)
            size = (kw.pop("size"),)
        if kw:
            raise ir.IRError(f"{what}() got unexpected keyword arguments {sorted(kw)}")
        _scalar_size(size, what)
        return ir.const(value, dtype or self.dtype)
    return handler


_handles("Tensor.new_ones")(_new_constant(1, "new_ones"))
_handles("Tensor.new_zeros")(_new_constant(0, "new_zeros"))


@_handles("Tensor.new_full")
def _new_full(v, self, size, fill_value, *, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    _scalar_size((size,), "new_full")
    return _fill(v(fill_value), dtype, self.dtype)


@_handles("Tensor.new_tensor")
def _new_tensor(v, self, data, *, dtype=None, device=None, requires_grad=False):
    return _fill(v(data), dtype, self.dtype)


@_handles("torch.ones_like")
def _ones_like(v, input, *, dtype=None, **kwargs):
    return ir.const(1, dtype or input.dtype)


@_handles("torch.zeros_like")
def _zeros_like(v, input, *, dtype=None, **kwargs):
    return ir.const(0, dtype or input.dtype)


@_handles("torch.full_like")
def _full_like(v, input, fill_value, *, dtype=None, **kwargs):
    return _fill(v(fill_value), dtype, input.dtype)


@_handles("torch.tensor", "torch.as_tensor", "torch.scalar_tensor")
def _tensor(v, data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
    x = v(data)
    if dtype is None and not isinstance(x, ir.Node):
        dtype = ir.promote(x)  # torch.tensor(2.0) is float32, torch.tensor(2) int64
    return _fill(x, dtype, None)


_handles("Tensor.__getitem__")(lambda v, self, index: _gather(_active(), self, index))


@_handles("Tensor.__setitem__")
def _setitem(v, self, index, value):
    raise _fail("writes into a tensor; mods must not have side effects")


# -- factories called without a traced argument (seen only through the trace mode)

_FACTORIES = {_resolve(p): p for p in ("torch.tensor", "torch.as_tensor", "torch.scalar_tensor",
                                        "torch.ones", "torch.zeros", "torch.full")}


def _factory(func, args, kwargs):
    """``torch.tensor(2.0)`` / ``torch.ones(())`` inside a mod: a constant, else None (run it)."""
    path = _FACTORIES[func]
    if path in ("torch.tensor", "torch.as_tensor", "torch.scalar_tensor"):
        if len(args) != 1 or _number(args[0]) is None or set(kwargs) - {"dtype", "device", "requires_grad"}:
            return None
        dtype = kwargs.get("dtype") or (torch.get_default_dtype() if path == "torch.scalar_tensor"
                                        else ir.promote(_number(args[0])))
        return ir.const(_number(args[0]), dtype)
    sizes = args[:1] if path == "torch.full" else args
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    if sizes or set(kwargs) - {"dtype", "device", "requires_grad", "size", "fill_value"}:
        return None
    if "size" in kwargs and tuple(kwargs["size"]) != ():
        return None
    if path == "torch.full":
        fill = _number(args[1] if len(args) > 1 else kwargs.get("fill_value"))
        if fill is None:
            return None
        return ir.const(fill, kwargs.get("dtype") or ir.promote(fill))
    return ir.const(1 if path == "torch.ones" else 0, kwargs.get("dtype") or torch.get_default_dtype())


def _liftable(func, args, kwargs) -> bool:
    """Does this plain-tensor call read a 0-d tensor that must become a buffer read?"""
    if func not in _HANDLERS or func in _FACTORIES:
        return False
    if _HANDLER_NAMES[func] == "torch.Tensor.__getitem__":
        items = args[1] if len(args) > 1 and isinstance(args[1], tuple) else args[1:]
        return any(isinstance(i, torch.Tensor) and i.dim() == 0 and ir.is_int(i.dtype) for i in items)
    tensors = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.dim() == 0 for t in tensors)


class _TraceMode(TorchFunctionMode):
    """Active while a mod runs: routes calls on traced values to the table, and catches the calls
    that have none (``torch.tensor(2.0)``, ``table[t0]`` with a captured 0-d ``t0``) when the mod
    itself made them (flexattn's own torch calls, e.g. constant folding, pass straight through)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, (Proxy, _View)) for a in _flat(args, kwargs)):
            return _dispatch(func, args, kwargs)
        if (func in _FACTORIES or func in _HANDLERS) and not _called_internally():
            if func in _FACTORIES:
                node = _factory(func, args, kwargs)
                if node is not None:
                    return Proxy(node, _active())
            elif _liftable(func, args, kwargs):
                return _dispatch(func, args, kwargs)
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
    converted to the Mod's input dtypes, as the eager ``Mod.__call__`` does.
    """
    trace = next(a.tracer for a in args if isinstance(a, Proxy))
    names = ir.SCORE_INPUTS if mod.kind == SCORE else ir.INDEX_INPUTS
    inputs: dict[str, ir.Node] = {}
    with _located():
        for name, arg in zip(names, args):
            inputs[name] = _as_node(_v(arg))
        memo: dict[int, ir.Node] = {}
        for n in ir.toposort(mod.ir):
            src = tuple(memo[id(s)] for s in n.src)
            if n.op == "input":
                new = ir.cast(inputs[n.arg], n.dtype)
            elif n.op == "load":
                buf = trace.capture(mod.buffers[n.arg.index], hint=n.arg.name)
                new = ir.load(buf, src)
            elif n.src and any(a is not b for a, b in zip(src, n.src)):
                new = ir.rebuild(n, src)
            else:
                new = n
            memo[id(n)] = new
        root = memo[id(mod.ir)]
        if mod.kind == SCORE and isinstance(args[0], Proxy) and args[0].dtype.is_floating_point:
            root = ir.cast(root, args[0].dtype)
    return Proxy(root, trace)


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
    try:
        with _TraceMode():
            out = fn(*(Proxy(n, t) for n in inputs))
            root = _result(t, out)
    finally:
        stack.pop()
    return Mod(kind, root, t.tensors, name=name, source=_source(fn), fn=fn)


def _result(t: _Trace, out) -> ir.Node:
    if out is None or isinstance(out, (tuple, list, dict, str)):
        raise TraceError(f"{t.describe()} returned {type(out).__name__ if out is not None else 'None'}; "
                         f"expected a {'float score' if t.kind == SCORE else 'bool'} value"
                         + (" (missing `return`?)" if out is None else ""))
    with _located():
        root = _as_node(_v(out))
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
        root = ir.substitute(mod.ir, lambda n: new_score if n.op == "input" and n.arg == "score" else None)
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
