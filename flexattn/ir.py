"""The expression IR shared by both front ends (Python tracer, DSL) and all back ends.

A `Node` is (op, dtype, src, arg): frozen, interned (structurally equal nodes are the same
object, so equality and hashing are O(1) and DAGs stay DAGs), with its dtype decided when it is
built. The builder functions below apply PyTorch's type promotion, treating Python numbers as
"weak" scalars exactly as torch does, and insert explicit casts so that every arithmetic node's
operands already have the node's dtype. Back ends therefore never promote anything.

Per-element semantics: every value is a scalar, as under torch.vmap over (b, h, q_idx, kv_idx).

Ops (``src`` arity in brackets):
    input[0]   arg = name: "score", "b", "h", "q_idx", "kv_idx"
    const[0]   arg = Python bool/int/float value
    load[n]    arg = Buffer; src = one index per buffer dimension (a gather)
    cast[1]    dtype = target
    where[3]   (cond, a, b)
    UNARY_OPS[1], BINARY_OPS[2]  (see the tables)
"""

from __future__ import annotations

import hashlib
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

import torch

# ---------------------------------------------------------------------------------------------
# dtypes

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

INDEX_DTYPE = torch.int32  # dtype of b, h, q_idx, kv_idx (as in torch's flex_attention)
INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")
SCORE_INPUTS = ("score",) + INDEX_INPUTS


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def is_int(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and dtype != torch.bool


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"flexattn does not support dtype {dtype} in mods") from None


class IRError(TypeError):
    """An expression that has no meaning (bad dtypes, wrong arity, overflowing constants)."""


# ---------------------------------------------------------------------------------------------
# Nodes


@dataclass(frozen=True)
class Buffer:
    """A captured tensor as the IR sees it: its position among the mod's buffers, dtype, rank.

    Shapes and strides are runtime kernel arguments, so they are not part of the structure.
    """

    index: int
    name: str
    dtype: torch.dtype
    ndim: int

    def __repr__(self) -> str:
        return f"Buffer({self.index}, {self.name!r}, {dtype_name(self.dtype)}, ndim={self.ndim})"


def _arg_key(arg: Any) -> Any:
    # 1 == 1.0 == True in Python; constants of different type must not intern together.
    if isinstance(arg, float):
        # NaN's sign bit is noise (folding inf - inf gives -nan on x86): all NaNs are one constant.
        return ("f", "nan") if math.isnan(arg) else ("f", arg, math.copysign(1.0, arg))
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg)
    return arg


class Node:
    """An interned IR node. Build nodes with the functions in this module, not directly."""

    __slots__ = ("op", "dtype", "src", "arg", "_key", "__weakref__")
    _table: "weakref.WeakValueDictionary[tuple, Node]" = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    op: str
    dtype: torch.dtype
    src: tuple["Node", ...]
    arg: Any

    def __new__(cls, op: str, dtype: torch.dtype, src: tuple["Node", ...] = (), arg: Any = None):
        ident = (op, dtype, tuple(id(s) for s in src), _arg_key(arg))
        with cls._lock:
            node = cls._table.get(ident)
            if node is None:
                node = object.__new__(cls)
                object.__setattr__(node, "op", op)
                object.__setattr__(node, "dtype", dtype)
                object.__setattr__(node, "src", tuple(src))
                object.__setattr__(node, "arg", arg)
                object.__setattr__(node, "_key", None)
                cls._table[ident] = node
        return node

    def __setattr__(self, name, value):
        raise AttributeError("IR nodes are immutable")

    def __reduce__(self):
        return (Node, (self.op, self.dtype, self.src, self.arg))

    # Interning makes identity equality structural equality.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError("IR nodes have no truth value")

    def __repr__(self) -> str:
        return f"Node({self.op}, {dtype_name(self.dtype)}, {to_text(self)})"

    def __str__(self) -> str:
        return to_text(self)

    def key(self) -> str:
        """A stable structural hash (the same across processes): the kernel cache key."""
        k = self._key
        if k is None:
            k = hashlib.sha256(serialize(self).encode()).hexdigest()[:32]
            object.__setattr__(self, "_key", k)
        return k


def toposort(roots: Node | Iterable[Node], stop: set[int] = frozenset()) -> list[Node]:
    """Nodes reachable from ``roots``, operands before users, each once; the nodes whose id is in
    ``stop`` are listed without their operands."""
    if isinstance(roots, Node):
        roots = [roots]
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in seen:
                continue
            if expanded:
                seen.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            if id(node) in stop:
                continue
            for s in reversed(node.src):
                if id(s) not in seen:
                    stack.append((s, False))
    return order


def serialize(root: Node) -> str:
    """A canonical text for ``root`` with shared nodes numbered (used for keys)."""
    ids: dict[int, int] = {}
    lines = []
    for i, n in enumerate(toposort(root)):
        ids[id(n)] = i
        arg = n.arg
        if isinstance(arg, Buffer):
            arg = (arg.index, arg.name, dtype_name(arg.dtype), arg.ndim)
        elif isinstance(arg, torch.dtype):
            arg = dtype_name(arg)
        lines.append(f"{n.op}:{dtype_name(n.dtype)}:{[ids[id(s)] for s in n.src]}:{_arg_key(arg)!r}")
    return "\n".join(lines)


def buffers_of(root: Node | Iterable[Node]) -> list[Buffer]:
    """Buffers read by ``root``, ordered by index, each once."""
    found = {n.arg.index: n.arg for n in toposort(root) if n.op == "load"}
    return [found[i] for i in sorted(found)]


def substitute(root: Node, mapping: Callable[[Node], Node | None],
               rebuilt: Callable[[Node, tuple], Node] | None = None) -> Node:
    """Rebuild ``root`` bottom-up; ``mapping(node)`` may return a replacement for any leaf/node;
    a node whose operands changed is made again by ``rebuilt(node, operands)`` (`rebuild`)."""
    rebuilt = rebuilt or rebuild
    memo: dict[int, Node] = {}
    for n in toposort(root):
        rep = mapping(n)
        if rep is None:
            src = tuple(memo[id(s)] for s in n.src)
            rep = n if all(a is b for a, b in zip(src, n.src)) else rebuilt(n, src)
        memo[id(n)] = rep
    return memo[id(root)]


def rebuild(n: Node, src: tuple[Node, ...]) -> Node:
    """``n`` with new operands, re-running the builder (so promotion and folding apply)."""
    if n.op == "cast":
        return cast(src[0], n.dtype)
    if n.op == "where":
        return where(*src)
    if n.op == "load":
        return load(n.arg, src)
    if n.op in UNARY_OPS:
        return unary(n.op, src[0])
    if n.op in BINARY_OPS:
        return binary(n.op, src[0], src[1])
    raise IRError(f"cannot rebuild op {n.op}")


# ---------------------------------------------------------------------------------------------
# Op tables: name -> (eager torch implementation, result rule)
#   "same": result has the operand's dtype;  "float": ints/bools promote to the default float;
#   "bool": result is bool.

Scalar = Union[bool, int, float]
Operand = Union[Node, bool, int, float]


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


def _round_half_even(x):
    return torch.round(x)


UNARY_OPS: dict[str, tuple[Callable, str]] = {
    "neg": (torch.neg, "same"),
    "abs": (torch.abs, "same"),
    "not": (torch.logical_not, "bool"),
    "invert": (torch.bitwise_not, "same"),
    "sign": (torch.sign, "same"),
    "relu": (torch.relu, "same"),
    "floor": (torch.floor, "same_float"),
    "ceil": (torch.ceil, "same_float"),
    "round": (_round_half_even, "same_float"),
    "trunc": (torch.trunc, "same_float"),
    "exp": (torch.exp, "float"),
    "exp2": (torch.exp2, "float"),
    "expm1": (torch.expm1, "float"),
    "log": (torch.log, "float"),
    "log2": (torch.log2, "float"),
    "log1p": (torch.log1p, "float"),
    "sqrt": (torch.sqrt, "float"),
    "rsqrt": (torch.rsqrt, "float"),
    "reciprocal": (torch.reciprocal, "float"),
    "sin": (torch.sin, "float"),
    "cos": (torch.cos, "float"),
    "tan": (torch.tan, "float"),
    "tanh": (torch.tanh, "float"),
    "sigmoid": (torch.sigmoid, "float"),
    "erf": (torch.erf, "float"),
    "silu": (torch.nn.functional.silu, "float"),
    "gelu": (torch.nn.functional.gelu, "float"),
    "gelu_tanh": (_gelu_tanh, "float"),
    "softplus": (torch.nn.functional.softplus, "float"),
    # x itself, through which no gradient flows (Tensor.detach: a stop-gradient in a score mod)
    "detach": (torch.Tensor.detach, "same"),
}


def _pow(a, b):
    return torch.pow(a, b)


BINARY_OPS: dict[str, tuple[Callable, str]] = {
    "add": (torch.add, "same"),
    "sub": (torch.sub, "same"),
    "mul": (torch.mul, "same"),
    "truediv": (torch.true_divide, "float"),
    "floordiv": (torch.floor_divide, "same"),
    "mod": (torch.remainder, "same"),
    "pow": (_pow, "same"),
    "minimum": (torch.minimum, "same"),
    "maximum": (torch.maximum, "same"),
    "and_": (torch.bitwise_and, "same"),
    "or_": (torch.bitwise_or, "same"),
    "xor": (torch.bitwise_xor, "same"),
    "lshift": (torch.bitwise_left_shift, "same"),
    "rshift": (torch.bitwise_right_shift, "same"),
    "eq": (torch.eq, "bool"),
    "ne": (torch.ne, "bool"),
    "lt": (torch.lt, "bool"),
    "le": (torch.le, "bool"),
    "gt": (torch.gt, "bool"),
    "ge": (torch.ge, "bool"),
}
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
BITWISE = ("and_", "or_", "xor", "lshift", "rshift")


# ---------------------------------------------------------------------------------------------
# Builders


def _weak_dtype(value: Scalar) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.get_default_dtype()
    raise IRError(f"expected a Python number or an IR node, got {type(value).__name__}")


def promote(*operands: Operand) -> torch.dtype:
    """torch's result dtype for these operands; Python numbers are weak scalars."""
    nodes = [x for x in operands if isinstance(x, Node)]
    scalars = [x for x in operands if not isinstance(x, Node)]
    if not nodes:
        # All weak: the widest category wins, at torch's default dtype for it.
        return max((_weak_dtype(s) for s in scalars), key=lambda d: (d.is_floating_point, d != torch.bool))
    dtype = nodes[0].dtype
    for n in nodes[1:]:
        dtype = torch.promote_types(dtype, n.dtype)
    for s in scalars:
        dtype = torch.result_type(torch.empty((), dtype=dtype), s)
    return dtype


def const(value: Scalar, dtype: torch.dtype | None = None) -> Node:
    """A constant; without ``dtype`` it takes torch's default for the Python type."""
    if isinstance(value, Node):
        return value if dtype is None else cast(value, dtype)
    if not isinstance(value, (bool, int, float)):
        raise IRError(f"constants must be Python bool/int/float, got {type(value).__name__}")
    dtype = dtype or _weak_dtype(value)
    dtype_name(dtype)
    if dtype == torch.bool:
        value = bool(value)
    elif dtype.is_floating_point:
        value = float(value)
    else:
        if isinstance(value, float):
            if not math.isfinite(value):
                raise IRError(f"cannot convert {value} to {dtype_name(dtype)}")
            value = int(value)
        info = torch.iinfo(dtype)
        if not info.min <= value <= info.max:
            raise IRError(f"constant {value} does not fit in {dtype_name(dtype)} (range {info.min}..{info.max})")
        value = int(value)
    return Node("const", dtype, (), value)


def input_(name: str, dtype: torch.dtype | None = None) -> Node:
    if name not in SCORE_INPUTS:
        raise IRError(f"unknown input {name!r}; inputs are {SCORE_INPUTS}")
    if name == "score":
        dtype = dtype or torch.float32
        if not dtype.is_floating_point:
            raise IRError(f"score must be floating point, got {dtype}")
    else:
        dtype = INDEX_DTYPE
    return Node("input", dtype, (), name)


def as_node(x: Operand, dtype: torch.dtype) -> Node:
    """``x`` as a node of ``dtype`` (casting nodes, typing constants)."""
    if isinstance(x, Node):
        return x if x.dtype == dtype else cast(x, dtype)
    return const(x, dtype)


def _fold(op: str, dtype: torch.dtype, src: tuple[Node, ...], arg: Any = None) -> Node | None:
    """Evaluate ops whose operands are all constants."""
    if not src or not all(s.op == "const" for s in src):
        return None
    env = Evaluator({}, [])
    try:
        out = env.value(Node(op, dtype, src, arg))
    except (RuntimeError, ZeroDivisionError):
        return None  # e.g. integer division by zero: keep it for the run-time to decide
    return const(out.item(), dtype)


def cast(x: Operand, dtype: torch.dtype) -> Node:
    dtype_name(dtype)
    if not isinstance(x, Node):
        x = const(x)
    if x.dtype == dtype:
        return x
    if x.op == "const":
        value = x.arg
        if dtype == torch.bool:
            return const(bool(value), dtype)
        if dtype.is_floating_point:
            return Node("const", dtype, (), float(torch.tensor(value, dtype=x.dtype).to(dtype).item()))
        return const(int(torch.tensor(value, dtype=x.dtype).to(dtype).item()), dtype)
    return Node("cast", dtype, (x,))


def unary(op: str, x: Operand) -> Node:
    if op not in UNARY_OPS:
        raise IRError(f"unknown unary op {op!r}")
    rule = UNARY_OPS[op][1]
    xd = x.dtype if isinstance(x, Node) else _weak_dtype(x)
    if op == "not":
        x, dtype = as_node(x, torch.bool) if xd == torch.bool else binary("ne", x, 0), torch.bool
        if x.op == "not":
            return x.src[0]
    elif op == "invert":
        if xd.is_floating_point:
            raise IRError("~ (bitwise not) needs an integer or bool operand, got " + dtype_name(xd))
        if xd == torch.bool:
            return unary("not", x)
        x, dtype = as_node(x, xd), xd
    elif op == "neg" and xd == torch.bool:
        raise IRError("negation of a bool is not supported (use ~ or `not`)")
    elif op == "detach" and not xd.is_floating_point:
        return as_node(x, xd)  # (integers and bools carry no gradient)
    elif op in ("abs", "relu") and xd == torch.bool:
        raise IRError(f"{op}() of a bool is not supported (torch has no bool {op}); cast to int first")
    elif rule == "float":
        dtype = xd if xd.is_floating_point else torch.get_default_dtype()
        x = as_node(x, dtype)
    elif rule == "same_float" and not xd.is_floating_point:
        return as_node(x, xd)  # floor/ceil/round/trunc of an integer is itself
    else:
        x, dtype = as_node(x, xd), xd
    folded = _fold(op, dtype, (x,))
    return folded if folded is not None else Node(op, dtype, (x,))


def binary(op: str, a: Operand, b: Operand) -> Node:
    if op not in BINARY_OPS:
        raise IRError(f"unknown binary op {op!r}")
    rule = BINARY_OPS[op][1]
    dtype = promote(a, b)
    if op == "truediv" and not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    if op in BITWISE and dtype.is_floating_point:
        raise IRError(f"{op.rstrip('_')} needs integer or bool operands, got {dtype_name(dtype)}")
    if op in ("lshift", "rshift") and dtype == torch.bool:
        raise IRError(f"{op} needs integer operands, got bool")
    if op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow") and dtype == torch.bool:
        raise IRError(f"arithmetic ({op}) on two bools is not supported; use &, |, ^ or cast to int")
    out_dtype = torch.bool if rule == "bool" else dtype
    src = (as_node(a, dtype), as_node(b, dtype))
    folded = _fold(op, out_dtype, src)
    return folded if folded is not None else Node(op, out_dtype, src)


def where(cond: Operand, a: Operand, b: Operand) -> Node:
    cond = as_node(cond, torch.bool) if not isinstance(cond, Node) else cond
    if cond.dtype != torch.bool:
        raise IRError(f"where() condition must be bool, got {dtype_name(cond.dtype)}")
    dtype = promote(a, b)
    a, b = as_node(a, dtype), as_node(b, dtype)
    if cond.op == "const":
        return a if cond.arg else b
    if a is b:
        return a
    return Node("where", dtype, (cond, a, b))


def load(buffer: Buffer, indices: Iterable[Operand]) -> Node:
    """Gather ``buffer[indices...]``; indices must be integer (bool indices are rejected)."""
    idx = []
    for i, x in enumerate(indices):
        xd = x.dtype if isinstance(x, Node) else _weak_dtype(x)
        if not is_int(xd):
            raise IRError(
                f"index {i} into captured tensor '{buffer.name}' must be an integer, got {dtype_name(xd)}"
            )
        idx.append(as_node(x, xd))
    if len(idx) != buffer.ndim:
        raise IRError(
            f"captured tensor '{buffer.name}' has {buffer.ndim} dimension(s) but was indexed with "
            f"{len(idx)} index(es); mods must read single elements"
        )
    return Node("load", buffer.dtype, tuple(idx), buffer)


def clamp(x: Operand, lo: Operand | None = None, hi: Operand | None = None, *,
          grad_at_bounds: bool = True) -> Node:
    """torch.clamp: ``minimum(maximum(x, lo), hi)``. A floating clamp also keeps torch's gradients
    at a tie, which maximum/minimum (the tie's gradient split in half) would not: x gets the whole
    gradient where lo <= x <= hi (``grad_at_bounds=False``: lo < x < hi, as hardtanh and relu6),
    a bound where x is beyond it. Hence ``where(x >= lo, x, maximum(x, lo))``: the same value, NaN
    included (``where(x <= lo, lo, maximum(x, lo))`` for hardtanh)."""
    out = x
    for bound, op, keep, past in ((lo, "maximum", "ge", "le"), (hi, "minimum", "le", "ge")):
        if bound is None:
            continue
        extreme = binary(op, out, bound)
        if not isinstance(extreme, Node) or not extreme.dtype.is_floating_point:
            out = extreme
        elif grad_at_bounds:
            out = where(binary(keep, out, bound), out, extreme)
        else:
            out = where(binary(past, out, bound), bound, extreme)
    if not isinstance(out, Node):
        out = const(out)
    return out


# ---------------------------------------------------------------------------------------------
# Eager evaluator: the reference back end


class Evaluator:
    """Evaluates IR with torch ops on broadcastable tensors (works under torch.vmap too).

    ``inputs`` maps input names to tensors (or Python numbers); ``buffers`` are the captured
    tensors by index. Gathers wrap negative indices like Python and read 0 (False) out of range,
    exactly as the kernels do.
    """

    def __init__(self, inputs: dict[str, Any], buffers: list[torch.Tensor] | tuple, device=None,
                 keep_score_dtype: bool = False):
        self.keep_score_dtype = keep_score_dtype  # floating scores are not cast to the traced dtype
        self.inputs = inputs
        self.buffers = buffers
        self.device = device
        self.memo: dict[int, torch.Tensor] = {}

    def value(self, node: Node) -> torch.Tensor:
        for n in toposort(node):
            if id(n) not in self.memo:
                self.memo[id(n)] = self._eval(n)
        return self.memo[id(node)]

    def _tensor(self, x, dtype):
        if isinstance(x, torch.Tensor):
            return x if x.dtype == dtype else x.to(dtype)
        return torch.tensor(x, dtype=dtype, device=self.device)

    def _eval(self, n: Node) -> torch.Tensor:
        op = n.op
        if op == "const":
            return torch.tensor(n.arg, dtype=n.dtype, device=self.device)
        if op == "input":
            x = self.inputs.get(n.arg)
            if self.keep_score_dtype and n.arg == "score" and isinstance(x, torch.Tensor) and x.is_floating_point():
                return x
            try:
                return self._tensor(self.inputs[n.arg], n.dtype)
            except KeyError:
                raise IRError(f"no value given for input {n.arg!r}") from None
        src = [self.memo[id(s)] for s in n.src]
        if self.keep_score_dtype and op in ("where", *BINARY_OPS):
            src = self._widened(n, src)
        if op == "cast":
            return src[0].to(n.dtype)
        if op == "where":
            return torch.where(src[0], src[1], src[2])
        if op == "load":
            buf = self.buffers[n.arg.index]
            if buf.dim() == 0:
                return buf.clone() if not src else buf[()]
            ok = None
            idx = []
            for d, i in enumerate(src):
                size = buf.shape[d]
                i = i.long()  # int8/uint8 indices: i + size must not wrap
                i = torch.where(i < 0, i + size, i)
                inb = (i >= 0) & (i < size)
                ok = inb if ok is None else ok & inb
                idx.append(i.clamp(0, max(size - 1, 0)).long())
            val = buf[tuple(idx)]
            return torch.where(ok, val, torch.zeros((), dtype=val.dtype, device=val.device))
        if op in UNARY_OPS:
            return UNARY_OPS[op][0](src[0])
        if op in BINARY_OPS:
            if op == "pow" and not n.dtype.is_floating_point:
                return _int_pow(src[0], src[1])
            if op in ("floordiv", "mod") and is_int(n.dtype):
                return _int_div_or_mod(op, src[0], src[1]).to(n.dtype)
            out = BINARY_OPS[op][0](src[0], src[1])
            return out if out.dtype.is_floating_point and n.dtype.is_floating_point and \
                out.dtype.itemsize > n.dtype.itemsize else out.to(n.dtype)
        raise IRError(f"cannot evaluate op {op!r}")

    def _widened(self, n: Node, src: list) -> list:
        """``src`` of a float op that meets a score wider than the traced one: every operand at
        the wider dtype, constants made again from their Python value (weak scalars, as torch
        computes ``score * 0.1`` with a float64 score), as a mod re-typed to that score's dtype."""
        wide = [t.dtype for s, t in zip(n.src, src) if s.dtype.is_floating_point and t.dtype != s.dtype
                and t.dtype.is_floating_point and t.dtype.itemsize > s.dtype.itemsize]
        if not wide:
            return src
        dtype = wide[0]
        return [t if not s.dtype.is_floating_point else
                torch.tensor(s.arg, dtype=dtype, device=t.device) if s.op == "const" else t.to(dtype)
                for s, t in zip(n.src, src)]


def _int_div_or_mod(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Integer ``a // b`` or ``a % b`` with flexattn's meaning for a zero divisor: ``x // 0 == 0``
    and ``x % 0 == x`` (torch raises on the CPU and gives garbage on the GPU; a kernel cannot raise)."""
    zero = b == 0
    d = torch.where(zero, torch.ones_like(b), b)
    out = BINARY_OPS[op][0](a, d)
    return torch.where(zero, torch.zeros_like(out) if op == "floordiv" else a.to(out.dtype), out)


def _int_pow(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if bool((b < 0).any()):
        raise IRError("integers to negative integer powers are not allowed")
    return torch.pow(a, b)


def evaluate(node: Node, inputs: dict[str, Any], buffers=(), device=None) -> torch.Tensor:
    """Evaluate ``node`` eagerly; see `Evaluator`."""
    return Evaluator(inputs, list(buffers), device).value(node)


# ---------------------------------------------------------------------------------------------
# Printer: DSL text that parses back to the same IR

_BIN_SYMBOL = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
    "and_": "&", "or_": "|", "xor": "^", "lshift": "<<", "rshift": ">>",
    "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}
_DEFAULT_CONST_DTYPE = {bool: torch.bool, int: torch.int64, float: torch.float32}


def _const_text(value: Scalar) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "(-inf)"
        text = repr(value)
        if "e" not in text and "." not in text:
            text += ".0"
        return f"({text})" if value < 0 or text.startswith("-") else text
    return f"({value})" if value < 0 else str(value)


def _weak_fits(c: Node, sibling_dtype: torch.dtype) -> bool:
    """Would the bare literal of ``c`` promote with a ``sibling_dtype`` operand to ``c.dtype``?"""
    sibling = Node("input", sibling_dtype, (), "_")  # any node of that dtype
    return c.dtype == sibling_dtype and c.dtype == promote(sibling, c.arg)


# to_text names a shared subexpression with `let` once its text is longer than this, and any
# expression nested this deep: the text stays linear in the number of distinct nodes (repeating
# shared subtrees is exponential in depth) and well inside the DSL's nesting limit.
_LET_SHARED_CHARS = 40
_LET_DEPTH = 64


def to_text(root: Node) -> str:
    """Render ``root`` as DSL text that parses back to ``root`` (fully parenthesised).

    Small trees are one expression. Large shared subexpressions and very deep ones are written
    once, as ``let _v0 = ...`` lines before the expression, so the text is linear in the number of
    distinct nodes.
    """
    order = toposort(root)
    uses: dict[int, int] = {}
    for n in order:
        for s in n.src:
            uses[id(s)] = uses.get(id(s), 0) + 1
    taken = {n.arg.name for n in order if n.op == "load"}
    lets: list[str] = []
    depth: dict[int, int] = {}
    memo: dict[int, str] = {}

    def lit(c: Node, sibling: torch.dtype | None) -> str:
        if sibling is not None and _weak_fits(c, sibling):
            return _const_text(c.arg)
        if c.dtype == _DEFAULT_CONST_DTYPE[type(c.arg)]:
            return _const_text(c.arg)
        return f"{dtype_name(c.dtype)}({_const_text(c.arg)})"

    def operand(n: Node, sibling: Node) -> str:
        # Two constants: neither anchors the other's dtype, so each is written with its own.
        return lit(n, sibling.dtype if sibling.op != "const" else None) if n.op == "const" else memo[id(n)]

    for n in toposort(root):
        op = n.op
        if op == "const":
            text = lit(n, None)
        elif op == "input":
            text = n.arg
        elif op == "load":
            text = n.arg.name + "".join(f"[{memo[id(s)] if s.op != 'const' else _idx_text(s)}]" for s in n.src) \
                if n.src else n.arg.name
        elif op == "cast":
            text = f"{dtype_name(n.dtype)}({memo[id(n.src[0])]})"
        elif op == "where":
            c, a, b = n.src
            text = f"where({memo[id(c)]}, {operand(a, b)}, {operand(b, a)})"
        elif op in _BIN_SYMBOL:
            a, b = n.src
            text = f"({operand(a, b)} {_BIN_SYMBOL[op]} {operand(b, a)})"
        elif op in BINARY_OPS:
            a, b = n.src
            text = f"{op}({operand(a, b)}, {operand(b, a)})"
        elif op == "neg":
            text = f"(-{memo[id(n.src[0])]})"
        elif op in ("not", "invert"):
            text = f"(~{memo[id(n.src[0])]})"
        else:
            text = f"{op}({memo[id(n.src[0])]})"
        memo[id(n)] = text
        depth[id(n)] = 1 + max((depth[id(s)] for s in n.src), default=0)
        if n is not root and op not in ("const", "input") and (
                depth[id(n)] >= _LET_DEPTH or (uses[id(n)] > 1 and len(text) > _LET_SHARED_CHARS)):
            name = f"_v{len(lets)}"
            while name in taken:
                name = "_" + name
            lets.append(f"let {name} = {text}")
            memo[id(n)], depth[id(n)] = name, 0
    out = memo[id(root)]
    if root.op == "const":
        out = lit(root, None)
    return "\n".join(lets + [out])


def _idx_text(c: Node) -> str:
    # Index constants: a bare int literal keeps its weak int64 dtype when reparsed.
    return _const_text(c.arg) if c.dtype == torch.int64 else f"{dtype_name(c.dtype)}({_const_text(c.arg)})"
