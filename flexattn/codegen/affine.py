"""Score mods that are affine in the score and the positions: ALiBi and other additive biases.

A score_mod of the form

    score_mod(score, b, h, q_idx, kv_idx) = S(b, h) * score + K(b, h) * kv_idx + Q(b, h) * q_idx + C(b, h)

(``score + slopes[h] * (kv_idx - q_idx)``, ``score * temperature[h] + bias[h]``, ``score + 0.1 *
(q_idx - kv_idx)``) lets a kernel skip the mod's per-score arithmetic. In base 2, relative to a
reference position ``r`` (an integer the kernel picks: the first query row of its tile):

    score_mod(...) / ln 2 = s * (S / ln 2) + u(kv_idx) + w(q_idx)
    u(kv_idx) = (K * (kv_idx - r) + (K + Q) * r + C) / ln 2
    w(q_idx)  = Q * (q_idx - r) / ln 2

u is a vector over a tile's KV columns and w one over its query rows. The softmax is the same
after adding a per-row constant, so the forward runs its online softmax on ``s * S / ln 2 + u``
and adds w to the row's LSE (and max) at the end; the backward's P is ``exp2(s * S / ln 2 + u -
(LSE / ln 2 - w))`` (the Hopper backward keeps ``(K + Q) r + C`` on w's side, where it costs fewer
registers; a row whose C is -inf has LSE -inf there and P 0). Per score that is one FMA where
the mod's own code was several operations (an integer subtraction, a conversion, a multiply and
two adds for ALiBi). The result differs from the direct evaluation by rounding only: w is at
most |Q| times a tile's rows and u about as large as the bias itself (for ALiBi K + Q is 0 exactly: u = K (kv_idx - r)), and their sum
carries a few float32 ulp of |Q| times the tile's rows (ALiBi at 64 rows: ~1e-5), far below a
16-bit input's rounding; the kernels take this form for 16-bit and float8 inputs only
(`flexattn.kernels.launch.affine_scores`). A constant term of -inf (a head switched off) lands in
u and masks the row, as the direct evaluation does.

`split` recognises the form on the IR; `flexattn.codegen.emit.emit_mod` then also writes
``{name}_affine(b, h, <buffers>)``, which returns (S, K, Q, C) as float32 scalars. Not recognised
(the kernels evaluate the mod directly): anything nonlinear in the score or the positions
(``q_idx * kv_idx``, ``where``, ``tanh``), gathers indexed by a position (``bias[kv_idx -
q_idx]``), positions or scores in half precision or float64. Integer arithmetic on the positions
wraps in the mod's own evaluation and not in the split form: `Affine.exact_below` tells, for a
sequence length, whether any integer value could leave its dtype (a bound |v| <= a * length + c
kept per integer node; b and h below 2^16, an integer gather unbounded), and the kernels take the
form only where none can.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexattn import ir
from flexattn.ir import Node

_VARS = ("score", "q_idx", "kv_idx")
_DTYPES = (torch.float32, torch.int32, torch.int64)
# Float coefficients are computed in float64 and rounded to float32 once, at the end: a mod that
# sums many terms (constants folded here, or products of captured values in the kernel) would
# otherwise round at every step of a different order than the mod's own.
_COEF = torch.float64


def _coef_dtype(dtype: torch.dtype) -> torch.dtype:
    return _COEF if dtype.is_floating_point else dtype


_BH_BOUND = 1 << 16  # b and h (a launch grid's second dimension holds B * H < 2^16)


@dataclass(frozen=True)
class Affine:
    """The coefficients of an affine score_mod: float32 nodes that read b, h and buffers only.
    ``int_bounds``: (a, c, limit) per integer value that depends on a position: |value| <= a *
    length + c, and its dtype holds up to ``limit``."""

    score: Node
    kv: Node
    q: Node
    const: Node
    int_bounds: tuple[tuple[float, float, int], ...] = ()

    def nodes(self) -> tuple[Node, Node, Node, Node]:
        return (self.score, self.kv, self.q, self.const)

    def exact_below(self, length: int) -> bool:
        """Whether, with every position below ``length``, no integer value of the mod can wrap
        (where it could, the split form and the mod's own arithmetic would differ)."""
        return all(a * length + c <= limit for a, c, limit in self.int_bounds)


Form = dict  # basis ("score", "q_idx", "kv_idx", "1") -> coefficient node


def _combine(op: str, a: Form, b: Form, dtype: torch.dtype) -> Form:
    out = {}
    for basis in a.keys() | b.keys():
        if basis in a and basis in b:
            out[basis] = ir.binary(op, a[basis], b[basis])
        elif basis in a:
            out[basis] = a[basis]
        else:
            out[basis] = b[basis] if op == "add" else ir.unary("neg", b[basis])
    return {k: ir.cast(v, _coef_dtype(dtype)) for k, v in out.items()}


def split(root: Node) -> Affine | None:
    """The coefficients of ``root`` (a score_mod's IR) when it is affine as described above,
    else None."""
    if root.dtype != torch.float32:
        return None
    order = ir.toposort(root)
    varies: dict[int, frozenset] = {}
    forms: dict[int, Form | None] = {}
    bounds: dict[int, tuple[float, float]] = {}
    for n in order:
        if n.op == "input":
            varies[id(n)] = frozenset([n.arg]) & frozenset(_VARS)
        else:
            varies[id(n)] = frozenset().union(*(varies[id(s)] for s in n.src)) if n.src else frozenset()
        forms[id(n)] = _form(n, varies, forms)
        if not n.dtype.is_floating_point:
            bounds[id(n)] = _int_bound(n, bounds)
    form = forms[id(root)]
    if form is None or "score" not in form:
        return None
    f32 = torch.float32
    coef = {k: ir.cast(v, f32) for k, v in form.items()}
    zero = ir.const(0.0, f32)
    int_bounds = tuple(sorted({(*bounds[id(n)], torch.iinfo(n.dtype).max) for n in order
                               if varies[id(n)] and n.dtype in (torch.int32, torch.int64)}))
    return Affine(coef["score"], coef.get("kv_idx", zero), coef.get("q_idx", zero), coef.get("1", zero),
                  int_bounds)


def _int_bound(n: Node, bounds: dict) -> tuple[float, float]:
    """(a, c) with |n| <= a * length + c for an integer or bool node (inf where unknown)."""
    inf = float("inf")
    if n.dtype == torch.bool:
        return (0.0, 1.0)
    if n.op == "input":
        return (1.0, 0.0) if n.arg in ("q_idx", "kv_idx") else (0.0, float(_BH_BOUND))
    if n.op == "const":
        return (0.0, float(abs(n.arg)))
    src = [bounds.get(id(s), (inf, inf)) for s in n.src]
    if n.op in ("add", "sub"):
        return (src[0][0] + src[1][0], src[0][1] + src[1][1])
    if n.op in ("neg", "abs", "cast"):
        return src[0]
    if n.op == "mul" and (src[0][0] == 0 or src[1][0] == 0):
        (a0, c0), (a1, c1) = src
        return (_times_bound(a0, c1) + _times_bound(a1, c0), _times_bound(c0, c1))
    return (inf, inf)


def _times_bound(x: float, y: float) -> float:
    return 0.0 if x == 0 or y == 0 else x * y  # (a zero term stays zero next to an unbounded one)


def _times(coef: Node, factor: Node) -> Node:
    """coef * factor, without the multiply when the coefficient is 1 or -1 (a position's own)."""
    if coef.op == "const" and coef.arg in (1, -1):
        factor = ir.cast(factor, coef.dtype)
        return factor if coef.arg == 1 else ir.unary("neg", factor)
    return ir.binary("mul", coef, factor)


def _form(n: Node, varies: dict, forms: dict) -> Form | None:
    if not varies[id(n)]:
        return {"1": ir.cast(n, _coef_dtype(n.dtype))}  # b, h, constants, gathers at b / h
    if n.dtype not in _DTYPES:
        return None
    if n.op == "input":
        return {n.arg: ir.const(1, _coef_dtype(n.dtype))}
    src = [forms[id(s)] for s in n.src]
    if any(f is None for f in src):
        return None
    if n.op in ("add", "sub"):
        return _combine(n.op, src[0], src[1], n.dtype)
    if n.op == "neg":
        return {k: ir.unary("neg", v) for k, v in src[0].items()}
    if n.op == "cast":
        s = n.src[0]
        if s.dtype not in _DTYPES or (n.dtype != torch.float32 and s.dtype == torch.float32):
            return None  # (float -> int truncates)
        return {k: ir.cast(v, _coef_dtype(n.dtype)) for k, v in src[0].items()}
    if n.op == "mul":
        a, b = n.src
        if varies[id(a)] and varies[id(b)]:
            return None
        form, factor = (src[0], b) if varies[id(a)] else (src[1], a)
        factor = ir.cast(factor, _coef_dtype(factor.dtype))
        return {k: _times(v, factor) for k, v in form.items()}
    if n.op == "truediv":
        a, b = n.src
        if varies[id(b)]:
            return None
        return {k: ir.binary("truediv", v, ir.cast(b, _COEF)) for k, v in src[0].items()}
    return None

