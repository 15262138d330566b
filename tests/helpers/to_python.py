"""IR -> Python source of an equivalent mod (for tracer round trips)."""

from __future__ import annotations

import linecache
import math
from typing import Any, Callable, Sequence

import torch

from flexattn import ir
from flexattn.ir import Node

_PY_BIN = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
    "and_": "&", "or_": "|", "xor": "^", "lshift": "<<", "rshift": ">>",
    "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}
_PY_UNARY = {
    "abs": "torch.abs", "sign": "torch.sign", "relu": "torch.relu", "floor": "torch.floor",
    "ceil": "torch.ceil", "round": "torch.round", "trunc": "torch.trunc", "exp": "torch.exp",
    "exp2": "torch.exp2", "expm1": "torch.expm1", "log": "torch.log", "log2": "torch.log2",
    "log1p": "torch.log1p", "sqrt": "torch.sqrt", "rsqrt": "torch.rsqrt",
    "reciprocal": "torch.reciprocal", "sin": "torch.sin", "cos": "torch.cos", "tan": "torch.tan",
    "tanh": "torch.tanh", "sigmoid": "torch.sigmoid", "erf": "torch.erf",
    "silu": "torch.nn.functional.silu", "gelu": "torch.nn.functional.gelu",
    "softplus": "torch.nn.functional.softplus",
}


def _py_literal(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else '(-float("inf"))'
        return f"({value!r})" if value < 0 or str(value).startswith("-") else repr(value)
    if isinstance(value, bool):
        return repr(value)
    return f"({value})" if value < 0 else str(value)


def to_python(node: Node, kind: str | None = None, name: str = "mod") -> str:
    """Python source of a mod equivalent to ``node`` (captured tensor ``i`` is the global ``B{i}``).

    Written the way users write mods: operators, ``torch.where``, ``.to(dtype)``, ``B0[i, j]``
    gathers (captured 0-d tensors are used bare). ``kind`` ("score"/"mask") picks the signature; default: "mask" for bool roots.
    >>> print(to_python(ir.binary("ge", ir.input_("q_idx"), ir.input_("kv_idx"))))
    def mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx)
    """
    order = ir.toposort(node)
    if kind is None:
        kind = "mask" if node.dtype == torch.bool else "score"
    text: dict[int, str] = {}

    def lit(c: Node, sibling: torch.dtype | None) -> str:
        weak = {bool: torch.bool, int: torch.int64, float: torch.float32}[type(c.arg)]
        if sibling is not None and c.dtype == sibling and ir.promote(ir.Node("input", sibling, (), "_"), c.arg) == sibling:
            return _py_literal(c.arg)
        if sibling is None and c.dtype == weak:
            return _py_literal(c.arg)
        return f"torch.tensor({_py_literal(c.arg)}, dtype=torch.{ir.dtype_name(c.dtype)})"

    def operand(n: Node, sibling: Node) -> str:
        if n.op != "const":
            return text[id(n)]
        # a literal takes its dtype from a tensor sibling; beside another literal it spells its own
        return lit(n, None if sibling.op == "const" else sibling.dtype)

    def a_is_bare_literal(n: Node) -> bool:
        a, b = n.src
        return a.op == "const" and b.op != "const" and not operand(a, b).startswith("torch.")

    for n in order:
        op = n.op
        if op == "const":
            t = lit(n, None)
        elif op == "input":
            t = n.arg
        elif op == "load":
            buf = n.arg
            idx = []
            for s in n.src:
                i = text[id(s)] if s.op != "const" else _py_literal(s.arg)
                if s.op != "const" and s.dtype not in (torch.int32, torch.int64):
                    i = f"{i}.long()"  # torch only indexes with int32/int64 (uint8 would be a mask)
                idx.append(i)
            # B0[i, j] (not B0[i][j]): the same under vmap, and right on broadcast index grids too
            t = f"B{buf.index}[{', '.join(idx)}]" if idx else f"B{buf.index}"
        elif op == "cast":
            t = f"{text[id(n.src[0])]}.to(torch.{ir.dtype_name(n.dtype)})"
        elif op == "where":
            c, a, b = n.src
            t = f"torch.where({text[id(c)]}, {operand(a, b)}, {operand(b, a)})"
        elif op == "truediv" and a_is_bare_literal(n):
            # `c / x` is reciprocal(x) * c in torch (Tensor.__rtruediv__), one ulp off c / x.
            a, b = n.src
            t = f"torch.div({text[id(b)]}.new_full((), {operand(a, b)}), {text[id(b)]})"
        elif op in _PY_BIN:
            a, b = n.src
            t = f"({operand(a, b)} {_PY_BIN[op]} {operand(b, a)})"
        elif op in ("minimum", "maximum"):
            a, b = n.src
            args = [text[id(s)] if s.op != "const" else _tensor_lit(s) for s in (a, b)]
            t = f"torch.{op}({args[0]}, {args[1]})"
        elif op == "neg":
            t = f"(-{text[id(n.src[0])]})"
        elif op in ("not", "invert"):
            t = f"(~{text[id(n.src[0])]})"
        elif op == "gelu_tanh":
            t = f'torch.nn.functional.gelu({text[id(n.src[0])]}, approximate="tanh")'
        else:
            t = f"{_PY_UNARY[op]}({text[id(n.src[0])]})"
        text[id(n)] = t
    body = text[id(node)]
    if node.op == "const":
        body = f"torch.tensor({_py_literal(node.arg)}, dtype=torch.{ir.dtype_name(node.dtype)})"
    params = ", ".join(ir.SCORE_INPUTS if kind == "score" else ir.INDEX_INPUTS)
    return f"def {name}({params}):\n    return {body}\n"


def _tensor_lit(c: Node) -> str:
    # torch.minimum/maximum take tensors only.
    return f"torch.tensor({_py_literal(c.arg)}, dtype=torch.{ir.dtype_name(c.dtype)})"


_PY_COUNTER = [0]


def python_mod(node: Node, buffers: Sequence[torch.Tensor], kind: str | None = None,
               name: str = "mod") -> Callable:
    """`to_python` compiled into a function closing over ``buffers`` (``inspect`` can read it).

    >>> fn = python_mod(ir.binary("ge", ir.input_("q_idx"), ir.input_("kv_idx")), [])
    >>> bool(fn(0, 0, torch.tensor(3), torch.tensor(2)))
    True
    """
    src = to_python(node, kind, name)
    _PY_COUNTER[0] += 1
    filename = f"<tests.helpers.testing.python_mod {_PY_COUNTER[0]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict[str, Any] = {"torch": torch}
    namespace.update({f"B{i}": t for i, t in enumerate(buffers)})
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]
