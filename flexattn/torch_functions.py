"""What each torch function and Tensor method means per element, for the tracer (flexattn/tracer.py).

One table maps a torch function (``torch.where``, ``F.gelu``, ``Tensor.clamp``...) to a handler
that builds the IR of that call on one element; `flexattn.tracer` sends every torch call on a
traced value here. Handlers see IR operands only (nodes and Python numbers, through the ``v``
converter the tracer passes them), never the tracer's proxies.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from flexattn import ir


def number(x):
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


# ---------------------------------------------------------------------------------------------
# The table: torch function or Tensor method -> handler building IR

HANDLERS: dict[Any, Callable] = {}
NAMES: dict[Any, str] = {}


def _resolve(path: str):
    root, *rest = path.split(".")
    obj = {"torch": torch, "Tensor": torch.Tensor, "F": torch.nn.functional}[root]
    for part in rest:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def handles(*paths: str):
    """Register the decorated handler for each torch function / Tensor method named in ``paths``.

    A handler is called as ``handler(v, *args, **kwargs)`` with the call's own arguments, where
    ``v(x)`` turns an argument into an IR operand (a node or a Python number); it returns an IR
    operand, and raises `ir.IRError` for a call with no per-element meaning.
    """
    def register(handler):
        for path in paths:
            func = _resolve(path)
            if func is not None:
                HANDLERS.setdefault(func, handler)
                NAMES.setdefault(func, path.replace("F.", "torch.nn.functional.")
                                          .replace("Tensor.", "torch.Tensor."))
        return handler
    return register


def torch_name(func) -> str:
    name = NAMES.get(func)
    if name:
        return name
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    module = getattr(func, "__module__", None) or ""
    if qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return "torch.Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    return f"{module}.{qual}" if module and not module.startswith("torch._C") else f"torch.{qual}"


def supported_list() -> str:
    names = {n for n in NAMES.values() if "__" not in n}
    # Tensor methods that mirror a supported torch.* function are implied by it.
    methods = sorted(n for n in names if n.startswith("torch.Tensor.") and f"torch.{n[13:]}" not in names)
    funcs = sorted(n for n in names if not n.startswith("torch.Tensor."))
    return (", ".join(funcs) + "; the same-named Tensor methods; and Tensor methods "
            + ", ".join("." + n[13:] + "()" for n in methods))

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
    handles(*_paths)(_unary_handler(_op))
del _op, _paths


@handles("torch.round", "Tensor.round")
def _round(v, input, *, decimals=0, out=None):
    _no_out(out)
    if decimals != 0:
        raise ir.IRError(f"torch.round(decimals={decimals}) is not supported in mods; scale, round and "
                         f"unscale instead")
    return ir.unary("round", v(input))


@handles("torch.relu", "Tensor.relu", "F.relu")
def _relu(v, input, inplace=False):
    return ir.unary("relu", v(input))


@handles("F.silu")
def _silu(v, input, inplace=False):
    return ir.unary("silu", v(input))


@handles("F.gelu")
def _gelu(v, input, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise ir.IRError(f"gelu(approximate={approximate!r}): expected 'none' or 'tanh'")
    return ir.unary("gelu" if approximate == "none" else "gelu_tanh", v(input))


@handles("F.softplus")
def _softplus(v, input, beta=1.0, threshold=20.0):
    x = v(input)
    if beta == 1 and threshold == 20:
        return ir.unary("softplus", x)
    # torch: x where beta * x > threshold, else log1p(exp(beta * x)) / beta
    bx = ir.binary("mul", x, beta)
    return ir.where(ir.binary("gt", bx, threshold), x, ir.binary("truediv", ir.unary("softplus", bx), beta))


@handles("F.leaky_relu")
def _leaky_relu(v, input, negative_slope=0.01, inplace=False):
    x = v(input)
    return ir.where(ir.binary("gt", x, 0), x, ir.binary("mul", x, negative_slope))


@handles("F.hardtanh")
def _hardtanh(v, input, min_val=-1.0, max_val=1.0, inplace=False):
    return ir.clamp(v(input), min_val, max_val, grad_at_bounds=False)


@handles("F.relu6")
def _relu6(v, input, inplace=False):
    return ir.clamp(v(input), 0, 6, grad_at_bounds=False)


@handles("torch.square", "Tensor.square")
def _square(v, input, *, out=None):
    _no_out(out)
    x = v(input)
    if isinstance(x, ir.Node) and x.dtype == torch.bool:
        x = ir.cast(x, torch.int64)  # torch.square promotes bool to int64
    return ir.binary("mul", x, x)


@handles("torch.isnan", "Tensor.isnan")
def _isnan(v, input):
    x = v(input)
    return ir.binary("ne", x, x)


@handles("torch.isinf", "Tensor.isinf")
def _isinf(v, input):
    x = v(input)
    return ir.binary("eq", ir.unary("abs", x), math.inf) if _is_float(x) else ir.const(False)


@handles("torch.isposinf", "Tensor.isposinf")
def _isposinf(v, input, *, out=None):
    x = v(input)
    return ir.binary("eq", x, math.inf) if _is_float(x) else ir.const(False)


@handles("torch.isneginf", "Tensor.isneginf")
def _isneginf(v, input, *, out=None):
    x = v(input)
    return ir.binary("eq", x, -math.inf) if _is_float(x) else ir.const(False)


@handles("torch.isfinite", "Tensor.isfinite")
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
    handles(*_paths)(_binary_handler(_op))
# Tensor's reflected methods get (self, other) and compute `other <op> self`.
for _op, _path in [("sub", "Tensor.__rsub__"), ("truediv", "Tensor.__rtruediv__"), ("truediv", "Tensor.__rdiv__"),
                   ("floordiv", "Tensor.__rfloordiv__"), ("mod", "Tensor.__rmod__"), ("pow", "Tensor.__rpow__"),
                   ("lshift", "Tensor.__rlshift__"), ("rshift", "Tensor.__rrshift__")]:
    handles(_path)(_binary_handler(_op, reflected=True))
del _op, _path, _paths


@handles("torch.add", "Tensor.add", "Tensor.__add__", "Tensor.__radd__")
def _add(v, input, other, *, alpha=1, out=None):
    _no_out(out)
    b = v(other)
    return ir.binary("add", v(input), b if alpha == 1 else ir.binary("mul", b, alpha))


@handles("torch.sub", "torch.subtract", "Tensor.sub", "Tensor.subtract", "Tensor.__sub__")
def _sub(v, input, other, *, alpha=1, out=None):
    _no_out(out)
    b = v(other)
    return ir.binary("sub", v(input), b if alpha == 1 else ir.binary("mul", b, alpha))


@handles("torch.div", "torch.divide", "torch.true_divide", "Tensor.div", "Tensor.divide",
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


@handles("torch.fmod", "Tensor.fmod")
def _fmod(v, input, other, *, out=None):
    _no_out(out)
    a, b = v(input), v(other)
    # C-style remainder (sign of the dividend) from Python-style remainder (sign of the divisor).
    r = ir.binary("mod", a, b)
    fix = ir.binary("and_", ir.binary("ne", r, 0), ir.binary("ne", ir.binary("lt", a, 0), ir.binary("lt", b, 0)))
    return ir.where(fix, ir.binary("sub", r, b), r)


def _elementwise_extreme(name: str, op: str):
    """torch.max / torch.min of two values; their one-argument and dim forms reduce, an error here."""
    def handler(v, input, other=None, *args, **kwargs):
        if other is None or args or kwargs or isinstance(other, int) and not isinstance(other, bool):
            raise ir.IRError(f"torch.{name}(x) / torch.{name}(x, dim) reduce over elements, which has no "
                             f"meaning per element; use torch.{op}(a, b)")
        return ir.binary(op, v(input), v(other))
    return handler


handles("torch.max", "Tensor.max")(_elementwise_extreme("max", "maximum"))
handles("torch.min", "Tensor.min")(_elementwise_extreme("min", "minimum"))


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
    handles(*_paths)(_logical(_op))
del _op, _paths


@handles("torch.where")
def _where_fn(v, condition, input=None, other=None, *, out=None):
    _no_out(out)
    if input is None or other is None:
        raise ir.IRError("torch.where(cond) with one argument returns indices; mods need torch.where(cond, a, b)")
    return ir.where(_truth(v(condition)), v(input), v(other))


@handles("Tensor.where")
def _tensor_where(v, self, condition, other):
    return ir.where(_truth(v(condition)), v(self), v(other))


@handles("torch.clamp", "torch.clip", "Tensor.clamp", "Tensor.clip")
def _clamp(v, input, min=None, max=None, *, out=None):
    _no_out(out)
    if min is None and max is None:
        raise ir.IRError("clamp() needs min= or max=")
    return ir.clamp(v(input), None if min is None else v(min), None if max is None else v(max))


@handles("torch.clamp_min", "Tensor.clamp_min")
def _clamp_min(v, input, min):
    return ir.clamp(v(input), v(min), None)


@handles("torch.clamp_max", "Tensor.clamp_max")
def _clamp_max(v, input, max):
    return ir.clamp(v(input), None, v(max))


# -- dtype conversion and constructors


def as_node(x) -> ir.Node:
    return x if isinstance(x, ir.Node) else ir.const(x)


def _cast(v, x, dtype) -> ir.Node:
    if not isinstance(dtype, torch.dtype):
        raise ir.IRError(f"expected a torch.dtype, got {dtype!r}")
    return ir.cast(as_node(v(x)), dtype)


@handles("Tensor.to")
def _to(v, self, *args, dtype=None, **kwargs):
    # .to(dtype), .to(device), .to(device, dtype), .to(other), plus copy/non_blocking/memory_format.
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(getattr(a, "dtype", None), torch.dtype):  # a tensor or a traced value
            dtype = a.dtype
    x = v(self)
    return x if dtype is None else _cast(v, self, dtype)


@handles("Tensor.type")
def _type(v, self, dtype=None, non_blocking=False, **kwargs):
    if not isinstance(dtype, torch.dtype):
        raise ir.IRError(f".type() needs a torch.dtype while tracing, got {dtype!r}")
    return _cast(v, self, dtype)


@handles("Tensor.type_as")
def _type_as(v, self, other):
    return _cast(v, self, other.dtype)


for _method, _dtype in {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                        "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64,
                        "short": torch.int16, "char": torch.int8, "byte": torch.uint8,
                        "bool": torch.bool}.items():
    handles(f"Tensor.{_method}")(functools.partial(lambda v, self, memory_format=None, *, _d: _cast(v, self, _d), _d=_dtype))
del _method, _dtype


@handles("Tensor.clone", "Tensor.contiguous", "torch.clone",
          "torch.positive", "Tensor.positive", "Tensor.__pos__", "Tensor.requires_grad_")
def _identity(v, self, *args, **kwargs):
    return as_node(v(self))


@handles("Tensor.detach", "torch.detach")
def _detach(v, self):
    # The same value, but the backward sends no gradient through it (to the score or a table)
    return ir.unary("detach", v(self))


def _scalar_size(size, what: str):
    if size and isinstance(size[0], (tuple, list, torch.Size)):
        (size,) = size
    if len(size) != 0:
        raise ir.IRError(f"calls {what} with size {tuple(size)}; per element only 0-d values exist: pass size ()")


def _fill(value, dtype, like) -> ir.Node:
    if dtype is None:
        dtype = like
    return ir.cast(as_node(value), dtype) if dtype is not None else as_node(value)


def _new_constant(value: int, what: str):
    def handler(v, self, *size, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False, **kw):
        if "size" in kw:  # torch's and_masks: b.new_ones(size=(), dtype=torch.bool, device=b.device)
            size = (kw.pop("size"),)
        if kw:
            raise ir.IRError(f"{what}() got unexpected keyword arguments {sorted(kw)}")
        _scalar_size(size, what)
        return ir.const(value, dtype or self.dtype)
    return handler


handles("Tensor.new_ones")(_new_constant(1, "new_ones"))
handles("Tensor.new_zeros")(_new_constant(0, "new_zeros"))


@handles("Tensor.new_full")
def _new_full(v, self, size, fill_value, *, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
    _scalar_size((size,), "new_full")
    return _fill(v(fill_value), dtype, self.dtype)


@handles("Tensor.new_tensor")
def _new_tensor(v, self, data, *, dtype=None, device=None, requires_grad=False):
    return _fill(v(data), dtype, self.dtype)


@handles("torch.ones_like")
def _ones_like(v, input, *, dtype=None, **kwargs):
    return ir.const(1, dtype or input.dtype)


@handles("torch.zeros_like")
def _zeros_like(v, input, *, dtype=None, **kwargs):
    return ir.const(0, dtype or input.dtype)


@handles("torch.full_like")
def _full_like(v, input, fill_value, *, dtype=None, **kwargs):
    return _fill(v(fill_value), dtype, input.dtype)


@handles("torch.tensor", "torch.as_tensor", "torch.scalar_tensor")
def _tensor(v, data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
    x = v(data)
    if dtype is None and not isinstance(x, ir.Node):
        dtype = ir.promote(x)  # torch.tensor(2.0) is float32, torch.tensor(2) int64
    return _fill(x, dtype, None)


# -- factories called without a traced argument (seen only through the trace mode)

FACTORIES = {_resolve(p): p for p in ("torch.tensor", "torch.as_tensor", "torch.scalar_tensor",
                                        "torch.ones", "torch.zeros", "torch.full")}


def factory(func, args, kwargs):
    """``torch.tensor(2.0)`` / ``torch.ones(())`` inside a mod: a constant, else None (run it)."""
    path = FACTORIES[func]
    if path in ("torch.tensor", "torch.as_tensor", "torch.scalar_tensor"):
        if len(args) != 1 or number(args[0]) is None or set(kwargs) - {"dtype", "device", "requires_grad"}:
            return None
        dtype = kwargs.get("dtype") or (torch.get_default_dtype() if path == "torch.scalar_tensor"
                                        else ir.promote(number(args[0])))
        return ir.const(number(args[0]), dtype)
    sizes = args[:1] if path == "torch.full" else args
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)):
        sizes = tuple(sizes[0])
    if sizes or set(kwargs) - {"dtype", "device", "requires_grad", "size", "fill_value"}:
        return None
    if "size" in kwargs and tuple(kwargs["size"]) != ():
        return None
    if path == "torch.full":
        fill = number(args[1] if len(args) > 1 else kwargs.get("fill_value"))
        if fill is None:
            return None
        return ir.const(fill, kwargs.get("dtype") or ir.promote(fill))
    return ir.const(1 if path == "torch.ones" else 0, kwargs.get("dtype") or torch.get_default_dtype())

