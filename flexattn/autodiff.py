"""Symbolic reverse-mode differentiation of a score mod's IR.

The backward kernels need two things from a score mod ``out = f(score, b, h, q_idx, kv_idx)``:

* ``d out / d score`` — to turn the gradient of the modified score into the gradient of
  ``q·kᵀ·scale`` (then dQ and dK);
* ``d out / d value`` for every gather ``value = table[i0, i1, ...]`` from a *floating* captured
  tensor, with the gather's index expressions — the kernel adds ``grad · d out / d value`` into
  ``table.grad[i0, i1, ...]`` (same wrapping and bounds mask as the forward's load).

Both are new IR expressions over the same inputs and buffers as the mod, built with the `ir`
builders (so dtypes and promotion are exactly torch's) and sharing the mod's own nodes (interning
makes the forward subexpressions the derivative re-reads the same nodes, so emitters compute them
once). The rules follow torch's autograd formulas, including its subgradient conventions:

    relu'(0) = 0, abs'(0) = 0, max/min ties split the gradient in half, where() routes the
    gradient to the chosen branch only, floor/ceil/round/trunc/sign and float // have derivative
    0, integer and bool values carry no gradient, detach (Tensor.detach) passes none. (A floating
    `ir.clamp` is built so that x keeps the whole gradient at a bound, as torch.clamp.)

Example::

    >>> from flexattn import ir, autodiff
    >>> s = ir.input_("score")
    >>> d = autodiff.differentiate(ir.unary("tanh", ir.binary("truediv", s, 30.0)))
    >>> print(d.score)   # doctest: +SKIP
    ((1.0 - (tanh((score / 30.0)) * tanh((score / 30.0)))) / 30.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from flexattn import ir
from flexattn.ir import Node


class NotDifferentiableError(ir.IRError):
    """A score mod uses an op whose derivative flexattn cannot express in the IR."""


@dataclass(frozen=True)
class LoadGrad:
    """The derivative of a score mod with respect to one gathered value ``buffer[indices]``."""

    load: Node                 # the `load` node in the mod's IR
    grad: Node                 # d(out) / d(load), dtype = the buffer's dtype
    buffer: ir.Buffer
    indices: tuple[Node, ...]  # the gather's index expressions (== load.src)


@dataclass(frozen=True)
class ScoreModGrad:
    """``differentiate``'s result: d(out)/d(score) and one `LoadGrad` per floating gather."""

    score: Node
    loads: tuple[LoadGrad, ...]

    @property
    def buffers(self) -> list[ir.Buffer]:
        """Floating buffers that receive gradients, ordered by index, each once."""
        found = {g.buffer.index: g.buffer for g in self.loads}
        return [found[i] for i in sorted(found)]


# ---------------------------------------------------------------------------------------------
# Small builders that keep derivative trees short (seeds are the constant 1).


def _is_const(n: Node, value: float) -> bool:
    return n.op == "const" and n.arg == value


def _mul(a: Node, b: Node | float) -> Node:
    if isinstance(b, Node) and _is_const(b, 1) and a.dtype == ir.promote(a, b):
        return a
    if _is_const(a, 1) and isinstance(b, Node) and b.dtype == ir.promote(a, b):
        return b
    if not isinstance(b, Node) and b == 1:
        return a
    return ir.binary("mul", a, b)


def _add(a: Node | None, b: Node) -> Node:
    return b if a is None else ir.binary("add", a, b)


def _neg(a: Node) -> Node:
    return a.src[0] if a.op == "neg" else ir.unary("neg", a)


def _typed(x: Node, like: Node) -> Node:
    """``x`` cast to ``like``'s dtype: a gradient always has its primal's dtype (as in torch)."""
    return x if x.dtype == like.dtype else ir.cast(x, like.dtype)


def _zero(like: Node) -> Node:
    return ir.const(0.0, like.dtype)


# ---------------------------------------------------------------------------------------------
# The rule table: op -> rule(g, node, operands) giving one gradient (or None) per operand.
# ``g`` is d(root)/d(node) and has ``node``'s dtype; every rule mirrors torch's derivatives.yaml.

Rule = Callable[[Node, Node, tuple[Node, ...]], tuple[Node | None, ...]]
LN2 = math.log(2.0)


def _zero_rule(g, n, s):
    # Piecewise-constant functions: derivative 0 almost everywhere (torch returns zeros).
    return tuple(_zero(x) if x.dtype.is_floating_point else None for x in s)


UNARY_RULES: dict[str, Callable[[Node, Node, Node], Node | None]] = {
    "neg": lambda g, n, x: _neg(g),
    "detach": lambda g, n, x: None,  # a stop-gradient (Tensor.detach)
    "abs": lambda g, n, x: _mul(g, ir.unary("sign", x)),
    "sign": lambda g, n, x: _zero(x),
    "relu": lambda g, n, x: ir.where(ir.binary("gt", n, 0), g, 0),  # threshold_backward at 0
    "floor": lambda g, n, x: _zero(x),
    "ceil": lambda g, n, x: _zero(x),
    "round": lambda g, n, x: _zero(x),
    "trunc": lambda g, n, x: _zero(x),
    "exp": lambda g, n, x: _mul(g, n),
    "exp2": lambda g, n, x: _mul(_mul(g, n), LN2),
    "expm1": lambda g, n, x: _mul(g, ir.binary("add", n, 1)),
    "log": lambda g, n, x: ir.binary("truediv", g, x),
    "log2": lambda g, n, x: ir.binary("truediv", g, ir.binary("mul", x, LN2)),
    "log1p": lambda g, n, x: ir.binary("truediv", g, ir.binary("add", x, 1)),
    "sqrt": lambda g, n, x: ir.binary("truediv", g, ir.binary("mul", n, 2)),
    "rsqrt": lambda g, n, x: _mul(_mul(g, -0.5), ir.binary("pow", n, 3)),
    "reciprocal": lambda g, n, x: _mul(_neg(g), ir.binary("mul", n, n)),
    "sin": lambda g, n, x: _mul(g, ir.unary("cos", x)),
    "cos": lambda g, n, x: _mul(g, _neg(ir.unary("sin", x))),
    "tan": lambda g, n, x: _mul(g, ir.binary("add", ir.binary("mul", n, n), 1)),
    "tanh": lambda g, n, x: _mul(g, ir.binary("sub", 1, ir.binary("mul", n, n))),
    "sigmoid": lambda g, n, x: _mul(g, ir.binary("mul", ir.binary("sub", 1, n), n)),
    "erf": lambda g, n, x: _mul(
        g, ir.binary("mul", ir.unary("exp", _neg(ir.binary("mul", x, x))), 2.0 / math.sqrt(math.pi))
    ),
    "silu": lambda g, n, x: _silu_grad(g, x),
    "gelu": lambda g, n, x: _gelu_grad(g, x),
    "gelu_tanh": lambda g, n, x: _gelu_tanh_grad(g, x),
    # torch's softplus_backward (beta=1, threshold=20): identity above the threshold.
    "softplus": lambda g, n, x: ir.where(ir.binary("gt", x, 20), g, _mul(g, ir.unary("sigmoid", x))),
}


def _silu_grad(g, x):
    sig = ir.unary("sigmoid", x)
    return _mul(g, ir.binary("mul", sig, ir.binary("add", 1, ir.binary("mul", x, ir.binary("sub", 1, sig)))))


def _gelu_grad(g, x):
    cdf = ir.binary("mul", 0.5, ir.binary("add", 1, ir.unary("erf", ir.binary("mul", x, math.sqrt(0.5)))))
    pdf = ir.binary("mul", ir.unary("exp", ir.binary("mul", ir.binary("mul", x, x), -0.5)),
                    1.0 / math.sqrt(2.0 * math.pi))
    return _mul(g, ir.binary("add", cdf, ir.binary("mul", x, pdf)))


def _gelu_tanh_grad(g, x):
    beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
    x2 = ir.binary("mul", x, x)
    inner = ir.binary("mul", ir.binary("add", x, ir.binary("mul", ir.binary("mul", x2, x), kappa)), beta)
    t = ir.unary("tanh", inner)
    left = ir.binary("mul", 0.5, ir.binary("add", 1, t))
    right = ir.binary(
        "mul",
        ir.binary("mul", ir.binary("mul", 0.5, x), ir.binary("sub", 1, ir.binary("mul", t, t))),
        ir.binary("mul", ir.binary("add", 1, ir.binary("mul", x2, 3 * kappa)), beta),
    )
    return _mul(g, ir.binary("add", left, right))


def _minmax_rule(loser_of_a: str):
    # maximum: a gets nothing where a < b, b nothing where a > b, ties split (torch's convention).
    loser_of_b = {"lt": "gt", "gt": "lt"}[loser_of_a]

    def rule(g, n, s):
        a, b = s
        shared = ir.where(ir.binary("eq", a, b), ir.binary("truediv", g, 2), g)
        return (ir.where(ir.binary(loser_of_a, a, b), 0, shared),
                ir.where(ir.binary(loser_of_b, a, b), 0, shared))
    return rule


def _pow_rule(g, n, s):
    a, b = s
    # torch: d/da = where(b == 0, 0, g·b·a^(b-1)); d/db = g·where(a == 0 & b >= 0, 0, out·log(a))
    da = ir.where(ir.binary("eq", b, 0), 0, _mul(_mul(g, b), ir.binary("pow", a, ir.binary("sub", b, 1))))
    if b.op == "const":
        return da, None
    zero_base = ir.binary("and_", ir.binary("eq", a, 0), ir.binary("ge", b, 0))
    db = _mul(g, ir.where(zero_base, 0, ir.binary("mul", n, ir.unary("log", a))))
    return da, db


BINARY_RULES: dict[str, Rule] = {
    "add": lambda g, n, s: (g, g),
    "sub": lambda g, n, s: (g, _neg(g)),
    "mul": lambda g, n, s: (_mul(g, s[1]), _mul(g, s[0])),
    "truediv": lambda g, n, s: (
        ir.binary("truediv", g, s[1]),
        _mul(_neg(g), ir.binary("truediv", s[0], ir.binary("mul", s[1], s[1]))),
    ),
    # torch has no derivative for floor_divide; the result is piecewise constant, so 0 is exact
    # almost everywhere (the same as floor(a / b), which torch does differentiate).
    "floordiv": _zero_rule,
    # torch.remainder: d/da = 1, d/db = -floor(a / b)
    "mod": lambda g, n, s: (g, _mul(_neg(g), ir.unary("floor", ir.binary("truediv", s[0], s[1])))),
    "pow": _pow_rule,
    "maximum": _minmax_rule("lt"),
    "minimum": _minmax_rule("gt"),
}


# ---------------------------------------------------------------------------------------------


def _differentiable_leaf(n: Node) -> bool:
    return (n.op == "input" and n.arg == "score") or (n.op == "load" and n.dtype.is_floating_point)


def _needs_grad(order: list[Node]) -> set[int]:
    """Floating nodes that depend on the score or on a floating gather."""
    needs: set[int] = set()
    for n in order:
        if not n.dtype.is_floating_point:
            continue
        if _differentiable_leaf(n):
            needs.add(id(n))
        elif n.op not in ("load", "detach") and any(id(s) in needs for s in n.src):
            needs.add(id(n))
    return needs


def _backprop(n: Node, g: Node) -> tuple[Node | None, ...]:
    """Gradients of ``n``'s operands given d(root)/d(n) = ``g``."""
    op, s = n.op, n.src
    if op == "cast":
        return (_typed(g, s[0]) if s[0].dtype.is_floating_point else None,)
    if op == "where":
        return None, ir.where(s[0], g, 0), ir.where(s[0], 0, g)
    if op in UNARY_RULES:
        return (UNARY_RULES[op](g, n, s[0]),)
    if op in BINARY_RULES:
        return BINARY_RULES[op](g, n, s)
    raise NotDifferentiableError(
        f"flexattn cannot differentiate the op {op!r} ({ir.to_text(n)}) in a score_mod; "
        f"rewrite it with differentiable ops, or detach the input that feeds it"
    )


def differentiate(root: Node) -> ScoreModGrad:
    """Derivatives of the score mod ``root`` w.r.t. the score and every floating gather.

    Reverse mode over ``ir.toposort(root)``: each node's adjoint (d root / d node, with the node's
    dtype) is the sum over its users of the rule for that user; operands that cannot carry a
    gradient (integers, bools, constants, values that do not depend on the score or a floating
    table) are skipped. Raises `NotDifferentiableError`, naming the op, for an op with no rule.

    Example::

        >>> s, kv, q = ir.input_("score"), ir.input_("kv_idx"), ir.input_("q_idx")
        >>> slopes = ir.Buffer(0, "slopes", torch.float32, 1)
        >>> alibi = ir.binary("add", s, ir.binary("mul", ir.load(slopes, [ir.input_("h")]),
        ...                                            ir.binary("sub", kv, q)))
        >>> d = differentiate(alibi)
        >>> d.score.op, d.loads[0].buffer.name, ir.to_text(d.loads[0].grad)
        ('const', 'slopes', 'float32((kv_idx - q_idx))')
    """
    order = ir.toposort(root)
    needs = _needs_grad(order)
    score = next((n for n in order if n.op == "input" and n.arg == "score"), None)
    if id(root) not in needs:
        zero = ir.const(0.0, score.dtype if score is not None else root.dtype)
        return ScoreModGrad(zero, tuple(_no_grad_loads(order)))

    adjoint: dict[int, Node] = {id(root): ir.const(1.0, root.dtype)}
    for n in reversed(order):
        g = adjoint.get(id(n))
        if g is None or n.op in ("input", "load", "const"):
            continue
        for operand, grad in zip(n.src, _backprop(n, g)):
            if grad is None or id(operand) not in needs:
                continue
            adjoint[id(operand)] = _add(adjoint.get(id(operand)), _typed(grad, operand))

    d_score = adjoint.get(id(score)) if score is not None else None
    if d_score is None:
        d_score = ir.const(0.0, score.dtype if score is not None else root.dtype)
    loads = []
    for n in order:
        if n.op == "load" and n.dtype.is_floating_point:
            g = adjoint.get(id(n), _zero(n))
            loads.append(LoadGrad(n, g, n.arg, n.src))
    return ScoreModGrad(d_score, tuple(loads))


def _no_grad_loads(order: list[Node]) -> list[LoadGrad]:
    return [LoadGrad(n, _zero(n), n.arg, n.src) for n in order if n.op == "load" and n.dtype.is_floating_point]


def check_differentiable(root: Node, name: str = "score_mod") -> None:
    """Raise `NotDifferentiableError` now (at trace time) if ``root`` has an op with no rule."""
    for n in ir.toposort(root):
        if n.op in ("input", "const", "load", "cast", "where") or not n.dtype.is_floating_point:
            continue
        if n.op not in UNARY_RULES and n.op not in BINARY_RULES:
            raise NotDifferentiableError(
                f"{name}: flexattn cannot differentiate the op {n.op!r} ({ir.to_text(n)}); "
                f"rewrite it with differentiable ops"
            )
