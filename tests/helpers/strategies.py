"""Hypothesis strategies for random, well-defined IR trees (mask, score and integer mods).

Hypothesis strategies build random, well-defined IR trees together with the tensors they capture:

    >>> from hypothesis import given
    >>> @given(mask_irs(max_depth=3))
    ... def test_something(case):
    ...     node, buffers = case

Every generated tree is *reproducible*: any value that feeds a discontinuous op (a comparison, a
floor, a float->int cast, ``//``, ``%``, ``sign``) is computed with correctly rounded operations only,
so every correct back end gives the same bits there; approximate math (exp, tanh, pow, ...) only
flows into continuous ops, where back ends may differ by a few ulp. Integer values are tracked by
interval so that int32/int64 arithmetic never overflows (8/16-bit ints may wrap: that is defined),
divisors are non-zero constants, shifts are small, float math stays in its domain (log of
``abs(x) + 1``, pow of a positive base, exp of a bounded argument), so results are finite.

The strategies assume index grids of at most ``MAX_BH`` batches/heads and ``MAX_LEN`` positions,
and score tensors bounded by ``SCORE_BOUND`` (use `random_score`).

Left alone, about two thirds of random masks are constant (all true or all false) and half the score
mods never read the score, so an attention test would mostly check a zero output or a softmax that
ignores q and k. Each tree is therefore evaluated on a small probe grid (the ``PROBE`` corner of
every grid at least that large): a constant mask is combined with a simple index comparison that
splits the probe, and a score mod whose value does not depend on the score gets the score added;
only ``trivial`` of them (20% by default) are kept as they are, so the edge cases still come up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flexattn import ir
from flexattn.ir import Node
from helpers.grids import MAX_BH, MAX_LEN, SCORE_BOUND, eval_grid, random_score

_FLOAT_CAP = 3.0e4  # float values stay below this (float16 overflows at 65504)
_INT_CAP = {torch.int32: 2**30, torch.int64: 2**60}  # no overflow for 32/64-bit ints
_INT_BUFFER_DTYPES = (torch.int32, torch.int64, torch.int8, torch.uint8)
_FLOAT_BUFFER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The probe grid (B, H, Q_LEN, KV_LEN): a mask that is mixed here is mixed on every grid that holds it.
PROBE = (1, 1, 16, 16)


@dataclass
class _Val:
    node: Node
    lo: float  # bounds on the exact value (bools: 0..1)
    hi: float
    exact: bool  # computed with correctly rounded ops only (bitwise reproducible)

    @property
    def mag(self) -> float:
        return max(abs(self.lo), abs(self.hi))


def _clip_range(dtype: torch.dtype, lo: float, hi: float) -> tuple[float, float]:
    if dtype.is_floating_point or dtype == torch.bool:
        return lo, hi
    info = torch.iinfo(dtype)
    if lo < info.min or hi > info.max:  # 8/16-bit arithmetic wraps (well defined): any value
        return float(info.min), float(info.max)
    return lo, hi


class _Gen:
    """One draw of a random tree: holds the captured buffers created so far."""

    def __init__(self, draw, max_buffers: int, score_dtype, in_range_gathers: bool, exact_only: bool,
                 has_score: bool, trivial: float = 1.0):
        import hypothesis.strategies as st

        self.st = st
        self.draw = draw
        self.max_buffers = max_buffers
        self.score_dtype = score_dtype
        self.in_range = in_range_gathers
        self.exact_only = exact_only
        self.has_score = has_score  # float leaves may read the score (score mods only)
        self.trivial = trivial  # the chance that a constant mask / score-blind score mod is kept
        self.max_depth = 0
        self.buffers: list[tuple[ir.Buffer, torch.Tensor, float, float]] = []

    # -- draw helpers
    def pick(self, options):
        return self.draw(self.st.sampled_from(options))

    def chance(self, p: float) -> bool:
        return self.draw(self.st.integers(0, 99)) < p * 100

    def rarely(self, p: float) -> bool:
        # chance() for small p. Hypothesis draws the simplest choices far more often than uniformly
        # (pick(range(100)) < 10 came out for about half the masks), so the rare outcome is the far end.
        return self.pick(range(100)) >= 100 - p * 100

    def stop(self, depth: int) -> bool:
        # The top two levels are always ops (hypothesis otherwise favours tiny trees).
        return depth <= 0 or (depth < self.max_depth - 1 and self.chance(0.2))

    # -- buffers
    def buffer(self, kinds: tuple[torch.dtype, ...]):
        usable = [b for b in self.buffers if b[0].dtype in kinds]
        if usable and (len(self.buffers) >= self.max_buffers or self.chance(0.5)):
            return self.pick(usable)
        if len(self.buffers) >= self.max_buffers:
            return None
        dtype = self.pick(kinds)
        ndim = self.draw(self.st.integers(0, 3))
        shape = [self.draw(self.st.integers(1, 7)) for _ in range(ndim)]
        seed = self.draw(self.st.integers(0, 2**31 - 1))
        t, lo, hi = _random_buffer(dtype, shape, seed)
        buf = ir.Buffer(len(self.buffers), f"buf{len(self.buffers)}", dtype, ndim)
        entry = (buf, t, lo, hi)
        self.buffers.append(entry)
        return entry

    def load(self, kinds, depth: int) -> _Val | None:
        entry = self.buffer(kinds)
        if entry is None:
            return None
        buf, t, lo, hi = entry
        idx = [self.index(depth - 1, t.shape[d]) for d in range(buf.ndim)]
        node = ir.load(buf, idx)
        if node.dtype == torch.bool:
            lo, hi = 0.0, 1.0
        elif not self.in_range:
            lo, hi = min(lo, 0.0), max(hi, 0.0)  # out-of-range reads give 0
        return _Val(node, lo, hi, True)

    def index(self, depth: int, size: int) -> Node | int:
        """An index expression: inputs, negative / out-of-range constants, arithmetic, gathers."""
        choice = self.pick(["input", "input", "const", "expr", "gather"])
        if choice == "const":
            i = self.pick([0, 1, -1, -size, size - 1, size, 100, -100])
            x: Node | int = i if self.chance(0.5) else ir.const(i, self.pick([torch.int32, torch.int64]))
        elif choice == "gather" and depth > 0:
            v = self.load(_INT_BUFFER_DTYPES, depth)
            x = v.node if v is not None else ir.input_("q_idx")
        elif choice == "expr" and depth > 0:
            x = self.int_val(depth).node
        else:
            x = ir.input_(self.pick(ir.INDEX_INPUTS))
        if self.in_range:
            x = ir.binary("mod", x, size)
        return x

    # -- leaves
    def int_leaf(self) -> _Val:
        choice = self.pick(["input", "input", "const", "const64", "big", "load"])
        if choice == "input":
            name = self.pick(ir.INDEX_INPUTS)
            return _Val(ir.input_(name), 0, (MAX_BH if name in ("b", "h") else MAX_LEN) - 1, True)
        if choice == "load":
            v = self.load(_INT_BUFFER_DTYPES, 1)
            if v is not None:
                return v
        if choice == "big":  # int64 constants beyond int32
            c = self.pick([2**31, -(2**31) - 1, 2**40 + 3, -(2**33)])
            return _Val(ir.const(c), c, c, True)
        c = self.draw(self.st.integers(-20, 100))
        return _Val(ir.const(c, torch.int64 if choice == "const64" else torch.int32), c, c, True)

    def float_leaf(self, allow_score: bool) -> _Val:
        choice = self.pick(["score", "score", "const", "load", "cast"] if allow_score else ["const", "load", "cast"])
        if choice == "score":
            return _Val(ir.input_("score", self.score_dtype), -SCORE_BOUND, SCORE_BOUND, True)
        if choice == "load":
            v = self.load(_FLOAT_BUFFER_DTYPES, 1)
            if v is not None:
                return v
        if choice == "cast":
            v = self.int_leaf()
            if v.mag <= _FLOAT_CAP:
                dtype = self.pick(_FLOAT_BUFFER_DTYPES)
                return _Val(ir.cast(v.node, dtype), v.lo, v.hi, True)
        c = self.pick([0.5, -1.25, 2.0, 3.0, -0.1, 10.0, 1e-3])
        dtype = self.pick([torch.float32, torch.float32, torch.float16, torch.bfloat16, torch.float64])
        node = ir.const(c, dtype)
        v = float(torch.tensor(c, dtype=dtype).item())
        return _Val(node, v, v, True)

    def bool_leaf(self) -> _Val:
        choice = self.pick(["const", "load", "cmp"])
        if choice == "load":
            v = self.load((torch.bool,), 1)
            if v is not None:
                return v
        if choice == "cmp":
            a = self.int_leaf()
            op = self.pick(ir.COMPARISONS)
            try:
                return _Val(ir.binary(op, a.node, self.draw(self.st.integers(-2, 40))), 0, 1, True)
            except ir.IRError:  # uint8 < -1: the constant does not fit the operand's dtype
                pass
        return _Val(ir.const(self.pick([True, False])), 0, 1, True)

    # -- trees
    def int_val(self, depth: int) -> _Val:
        if self.stop(depth):
            return self.int_leaf()
        try:
            return self._int_op(depth)
        except ir.IRError:  # e.g. uint8 - 1: the constant does not fit the operand's dtype
            return self.int_leaf()

    def _int_op(self, depth: int) -> _Val:
        choice = self.pick(["add", "sub", "mul", "floordiv", "mod", "minmax", "bitwise", "shift", "neg",
                            "abs", "invert", "sign", "relu", "pow", "where", "cast_float", "cast_bool",
                            "add_bool", "floor"])
        a = self.int_val(depth - 1)
        if choice in ("add", "sub", "mul", "minmax", "bitwise"):
            b = self.int_val(depth - 1) if self.chance(0.7) else self._weak_int()
            bl, bh = (b.lo, b.hi) if isinstance(b, _Val) else (b, b)
            bn = b.node if isinstance(b, _Val) else b
            if choice == "add":
                return self._int_result(ir.binary("add", a.node, bn), a.lo + bl, a.hi + bh, a)
            if choice == "sub":
                return self._int_result(ir.binary("sub", a.node, bn), a.lo - bh, a.hi - bl, a)
            if choice == "mul":
                ps = [a.lo * bl, a.lo * bh, a.hi * bl, a.hi * bh]
                return self._int_result(ir.binary("mul", a.node, bn), min(ps), max(ps), a)
            if choice == "minmax":
                op = self.pick(["minimum", "maximum"])
                f = min if op == "minimum" else max
                return self._int_result(ir.binary(op, a.node, bn), f(a.lo, bl), f(a.hi, bh), a)
            op = self.pick(["and_", "or_", "xor"])
            m = 2.0 ** (int(max(a.mag, abs(bl), abs(bh))).bit_length() + 1)
            return self._int_result(ir.binary(op, a.node, bn), -m, m, a)
        if choice in ("floordiv", "mod"):
            d = self.pick([1, 2, 3, 7, -1, -2, -5, 64])
            dn = d if self.chance(0.5) else ir.const(d, self.pick([torch.int32, torch.int64]))
            if choice == "mod":
                lo, hi = (0, abs(d) - 1) if d > 0 else (d + 1, 0)
                return self._int_result(ir.binary("mod", a.node, dn), lo, hi, a)
            qs = [a.lo / d, a.hi / d]
            return self._int_result(ir.binary("floordiv", a.node, dn), math.floor(min(qs)), math.ceil(max(qs)), a)
        if choice == "shift":
            k = self.draw(self.st.integers(0, 4))
            if self.chance(0.5):
                return self._int_result(ir.binary("lshift", a.node, k), a.lo * 2**k, a.hi * 2**k, a)
            return self._int_result(ir.binary("rshift", a.node, k), math.floor(a.lo / 2**k), a.hi, a)
        if choice == "neg":
            return self._int_result(ir.unary("neg", a.node), -a.hi, -a.lo, a)
        if choice == "abs":
            return self._int_result(ir.unary("abs", a.node), 0, a.mag, a)
        if choice == "invert":
            return self._int_result(ir.unary("invert", a.node), -a.hi - 1, -a.lo - 1, a)
        if choice == "sign":
            return self._int_result(ir.unary("sign", a.node), -1, 1, a)
        if choice == "relu":
            return self._int_result(ir.unary("relu", a.node), 0, max(a.hi, 0), a)
        if choice == "floor":  # floor/ceil/round/trunc of an integer is itself
            return _Val(ir.unary(self.pick(["floor", "ceil", "round", "trunc"]), a.node), a.lo, a.hi, True)
        if choice == "pow":
            k = self.draw(self.st.integers(0, 3))
            ps = [a.lo**k, a.hi**k, 0 if a.lo <= 0 <= a.hi else a.lo**k]
            return self._int_result(ir.binary("pow", a.node, k), min(ps), max(ps), a)
        if choice == "where":
            c = self.bool_val(depth - 1)
            b = self.int_val(depth - 1)
            return self._int_result(ir.where(c.node, a.node, b.node), min(a.lo, b.lo), max(a.hi, b.hi), a)
        if choice == "cast_float":
            f = self.float_val(depth - 1, exact=True)
            if f.mag < 2**30:
                dtype = self.pick([torch.int32, torch.int64])
                return _Val(ir.cast(f.node, dtype), math.trunc(f.lo), math.trunc(f.hi), True)
            return a
        if choice == "cast_bool":
            c = self.bool_val(depth - 1)
            return _Val(ir.cast(c.node, self.pick([torch.int32, torch.int64, torch.uint8])), 0, 1, True)
        # add_bool: bool + int promotes to the int
        c = self.bool_val(depth - 1)
        return self._int_result(ir.binary("add", c.node, a.node), a.lo, a.hi + 1, a)

    def _weak_int(self) -> int:
        return self.draw(self.st.integers(-9, 40))

    def _int_result(self, node: Node, lo: float, hi: float, fallback: _Val) -> _Val:
        cap = _INT_CAP.get(node.dtype)
        if cap is not None and max(abs(lo), abs(hi)) > cap:
            return fallback  # would overflow: keep the operand instead
        lo, hi = _clip_range(node.dtype, lo, hi)
        return _Val(node, lo, hi, True)

    def float_val(self, depth: int, exact: bool = False) -> _Val:
        exact = exact or self.exact_only
        if self.stop(depth):
            return self.float_leaf(self.has_score)
        exact_ops = ["add", "sub", "mul", "div", "minmax", "neg", "abs", "relu", "round", "fdivmod", "where",
                     "cast", "cast_int", "sign", "int_div"]
        # (torch's float32 sqrt on CPU is not correctly rounded: it counts as approximate)
        approx_ops = ["exp", "log", "trig", "tanh", "tan", "act", "pow", "recip", "sqrt"]
        choice = self.pick(exact_ops + ([] if exact else approx_ops * 2))
        a = self.float_val(depth - 1, exact)
        if choice in ("add", "sub", "mul", "minmax", "div"):
            return self._float_binary(choice, a, depth, exact)
        if choice == "neg":
            return self._float_result(ir.unary("neg", a.node), -a.hi, -a.lo, a)
        if choice == "abs":
            return self._float_result(ir.unary("abs", a.node), 0, a.mag, a)
        if choice == "relu":
            return self._float_result(ir.unary("relu", a.node), 0, max(a.hi, 0), a)
        if choice == "sqrt":
            node = ir.unary("sqrt", ir.binary("add", ir.unary("abs", a.node), 0.5))
            return self._approx(node, 0, math.sqrt(a.mag + 0.5))
        if choice in ("round", "sign", "fdivmod"):
            if not a.exact:
                return a
            if choice == "round":
                op = self.pick(["floor", "ceil", "round", "trunc"])
                return self._float_result(ir.unary(op, a.node), math.floor(a.lo), math.ceil(a.hi), a)
            if choice == "sign":
                return self._float_result(ir.unary("sign", a.node), -1, 1, a)
            d = self.pick([0.75, 2.0, 3.0, -1.5, 0.1])
            if self.chance(0.5):
                return self._float_result(ir.binary("mod", a.node, d), -abs(d), abs(d), a)
            return self._float_result(ir.binary("floordiv", a.node, d), -a.mag / abs(d) - 1, a.mag / abs(d) + 1, a)
        if choice == "where":
            c = self.bool_val(depth - 1)
            b = self.float_val(depth - 1, exact)
            return self._float_result(ir.where(c.node, a.node, b.node), min(a.lo, b.lo), max(a.hi, b.hi), a, b)
        if choice == "cast":
            dtype = self.pick(_FLOAT_BUFFER_DTYPES)
            return self._float_result(ir.cast(a.node, dtype), a.lo, a.hi, a)
        if choice == "cast_int":
            v = self.int_val(depth - 1)
            if v.mag > _FLOAT_CAP:
                return a
            return _Val(ir.cast(v.node, self.pick(_FLOAT_BUFFER_DTYPES)), v.lo, v.hi, True)
        if choice == "int_div":  # int / int is a float (true division), here by a non-zero constant
            v = self.int_val(depth - 1)
            if v.mag > _FLOAT_CAP:
                return a
            d = self.pick([3, -7, 2])
            return _Val(ir.binary("truediv", v.node, d), -v.mag, v.mag, True)
        return self._float_approx(choice, a, depth)

    def _float_binary(self, choice: str, a: _Val, depth: int, exact: bool) -> _Val:
        """add, sub, mul, min/max or a division of ``a`` by another value (a weak float at times)."""
        b = self.float_val(depth - 1, exact) if self.chance(0.7) else self._weak_float()
        bv = b if isinstance(b, _Val) else _Val(b, b, b, True)  # type: ignore[arg-type]
        bn = b.node if isinstance(b, _Val) else b
        if choice == "add":
            return self._float_result(ir.binary("add", a.node, bn), a.lo + bv.lo, a.hi + bv.hi, a, bv)
        if choice == "sub":
            return self._float_result(ir.binary("sub", a.node, bn), a.lo - bv.hi, a.hi - bv.lo, a, bv)
        if choice == "mul":
            ps = [a.lo * bv.lo, a.lo * bv.hi, a.hi * bv.lo, a.hi * bv.hi]
            return self._float_result(ir.binary("mul", a.node, bn), min(ps), max(ps), a, bv)
        if choice == "minmax":
            op = self.pick(["minimum", "maximum"])
            f = min if op == "minimum" else max
            return self._float_result(ir.binary(op, a.node, bn), f(a.lo, bv.lo), f(a.hi, bv.hi), a, bv)
        # a / (|b| + 1): the divisor is >= 1
        den = ir.binary("add", ir.unary("abs", bv.node if isinstance(b, _Val) else ir.const(float(b))), 1.0)
        return self._float_result(ir.binary("truediv", a.node, den), -a.mag, a.mag, a, bv)

    def _float_approx(self, choice: str, a: _Val, depth: int) -> _Val:
        """Approximate math of ``a`` (exp, log, trig, activations, pow): inexact from here on."""
        x = a.node
        if choice == "exp":
            op = self.pick(["exp", "exp2", "expm1"])
            if a.mag > 8:
                x = ir.binary("mul", x, 8.0 / a.mag)
            hi = math.exp(min(a.hi, 8)) if op != "exp2" else 2 ** min(a.hi, 8)
            return self._approx(ir.unary(op, x), -1 if op == "expm1" else 0, hi)
        if choice == "log":
            op = self.pick(["log", "log2", "log1p", "rsqrt"])
            node = ir.unary(op, ir.binary("add", ir.unary("abs", x), 1.0))
            return self._approx(node, 0, math.log2(a.mag + 2) + 1)
        if choice == "recip":
            return self._approx(ir.unary("reciprocal", ir.binary("add", ir.unary("abs", x), 1.0)), 0, 1)
        if choice == "trig":
            return self._approx(ir.unary(self.pick(["sin", "cos"]), x), -1, 1)
        if choice == "tanh":
            op = self.pick(["tanh", "sigmoid", "erf"])
            return self._approx(ir.unary(op, x), -1, 1)
        if choice == "tan":
            return self._approx(ir.unary("tan", ir.unary("tanh", x)), -1.6, 1.6)
        if choice == "act":
            op = self.pick(["silu", "gelu", "gelu_tanh", "softplus"])
            return self._approx(ir.unary(op, x), -1, a.mag + 1)
        # pow of a positive base with a bounded exponent
        base = ir.binary("add", ir.unary("abs", x), 0.5)
        if self.chance(0.5):
            e = self.pick([0.5, 2.0, 3.0, -1.0, 1.5, 2])
            hi = (a.mag + 0.5) ** abs(e) + 2 ** abs(e)
            if hi > _FLOAT_CAP:
                return a
            return self._approx(ir.binary("pow", base, e), 0, hi)
        ev = self.float_val(depth - 1, False)
        en = ir.unary("tanh", ev.node)  # |exponent| < 1
        return self._approx(ir.binary("pow", base, ir.binary("mul", en, 2.0)), 0, (a.mag + 2) ** 2 + 4)

    def _weak_float(self) -> float:
        return self.pick([0.5, -2.0, 1.5, 3.0, 0.25])

    def _float_result(self, node: Node, lo: float, hi: float, *operands: _Val) -> _Val:
        if max(abs(lo), abs(hi)) > _FLOAT_CAP:
            return operands[0]
        return _Val(node, lo, hi, all(o.exact for o in operands))

    def _approx(self, node: Node, lo: float, hi: float) -> _Val:
        return _Val(node, lo, hi, False)

    def bool_val(self, depth: int) -> _Val:
        if self.stop(depth):
            return self.bool_leaf()
        try:
            return self._bool_op(depth)
        except ir.IRError:  # e.g. uint8 == -1: the constant does not fit the operand's dtype
            return self.bool_leaf()

    def _bool_op(self, depth: int) -> _Val:
        choice = self.pick(["cmp_int", "cmp_int", "cmp_float", "cmp_bool", "logic", "not", "where", "cast_int",
                            "cast_float"])
        if choice == "cmp_int":
            a = self.int_val(depth - 1)
            b = self.int_val(depth - 1) if self.chance(0.6) else self._weak_int()
            return _Val(ir.binary(self.pick(ir.COMPARISONS), a.node, b.node if isinstance(b, _Val) else b), 0, 1, True)
        if choice == "cmp_float":
            a = self.float_val(depth - 1, exact=True)
            b = self.float_val(depth - 1, exact=True) if self.chance(0.6) else self._weak_float()
            return _Val(ir.binary(self.pick(ir.COMPARISONS), a.node, b.node if isinstance(b, _Val) else b), 0, 1, True)
        if choice == "cmp_bool":  # ordered comparisons of bools: False < True
            a, b = self.bool_val(depth - 1), self.bool_val(depth - 1)
            return _Val(ir.binary(self.pick(ir.COMPARISONS), a.node, b.node), 0, 1, True)
        if choice == "logic":
            a, b = self.bool_val(depth - 1), self.bool_val(depth - 1)
            return _Val(ir.binary(self.pick(["and_", "or_", "xor"]), a.node, b.node), 0, 1, True)
        if choice == "not":
            return _Val(ir.unary(self.pick(["not", "invert"]), self.bool_val(depth - 1).node), 0, 1, True)
        if choice == "where":
            c, a, b = self.bool_val(depth - 1), self.bool_val(depth - 1), self.bool_val(depth - 1)
            return _Val(ir.where(c.node, a.node, b.node), 0, 1, True)
        if choice == "cast_int":
            return _Val(ir.cast(self.int_val(depth - 1).node, torch.bool), 0, 1, True)
        return _Val(ir.cast(self.float_val(depth - 1, exact=True).node, torch.bool), 0, 1, True)

    # -- interesting roots: masks that split the probe grid, score mods that read the score
    def probe(self, node: Node, score: torch.Tensor | None = None) -> torch.Tensor:
        return eval_grid(node, self.tensors(), *PROBE, score=score)

    def mixed_mask(self, v: _Val) -> _Val:
        """``v``, or ``v & cmp`` / ``v | cmp`` (a comparison that splits the probe) when ``v`` is
        constant on the probe grid, but for a ``trivial`` share of those."""
        out = self.probe(v.node, random_score(*PROBE, dtype=self.score_dtype, seed=1) if self.has_score else None)
        if not out.all() and out.any() or self.rarely(self.trivial):
            return v
        cmp = self.splitting_cmp()
        return _Val(ir.binary("and_" if out.all() else "or_", v.node, cmp), 0, 1, v.exact)

    def splitting_cmp(self) -> Node:
        """A causal, window, stripe or band comparison of q_idx and kv_idx; mixed on the probe grid."""
        q, kv = ir.input_("q_idx"), ir.input_("kv_idx")
        n = PROBE[2]
        choice = self.pick(["causal", "window", "stripe", "band"])
        if choice == "causal":  # q_idx + c >= kv_idx
            c = self.draw(self.st.integers(-n // 2, n // 2))
            return ir.binary(self.pick(["ge", "gt", "le", "lt"]), ir.binary("add", q, c), kv)
        if choice == "window":  # kv_idx < c  or  q_idx >= c
            c = self.draw(self.st.integers(1, n - 1))
            return ir.binary("lt", kv, c) if self.chance(0.5) else ir.binary("ge", q, c)
        if choice == "stripe":  # (q_idx + kv_idx) % m == r
            m = self.draw(self.st.integers(2, 5))
            r = self.draw(self.st.integers(0, m - 1))
            return ir.binary("eq", ir.binary("mod", ir.binary("add", q, kv), m), r)
        w = self.draw(self.st.integers(0, n // 2 - 1))  # |q_idx - kv_idx| <= w
        return ir.binary("le", ir.unary("abs", ir.binary("sub", q, kv)), w)

    def score_reading(self, v: _Val) -> _Val:
        """``v``, or ``v + score`` when ``v`` does not depend on the score on the probe grid, but
        for a ``trivial`` share of those."""
        scores = [random_score(*PROBE, dtype=self.score_dtype, seed=s) for s in (1, 2)]
        a, b = (self.probe(v.node, s) for s in scores)
        if not torch.equal(a, b) or v.mag + SCORE_BOUND > _FLOAT_CAP or self.rarely(self.trivial):
            return v
        node = ir.binary("add", v.node, ir.input_("score", self.score_dtype))
        return _Val(node, v.lo - SCORE_BOUND, v.hi + SCORE_BOUND, v.exact)

    def tensors(self) -> list[torch.Tensor]:
        return [t for _, t, _, _ in self.buffers]


def _random_buffer(dtype: torch.dtype, shape: list[int], seed: int) -> tuple[torch.Tensor, float, float]:
    """Random contents (never all zeros), with bounds: ints in [-3, 12] (indices, including negative
    and out-of-range ones), uint8 in [0, 12], floats ~ 2 N(0, 1) clamped to +-6, bools mixed."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) < 0.5
        t.view(-1)[0] = True
        if t.numel() > 1:
            t.view(-1)[-1] = False
        return t, 0.0, 1.0
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g, dtype=torch.float64) * 2).clamp(-6, 6)
        t = torch.where(t == 0, 1.0, t).to(dtype)
        return t, -6.0, 6.0
    lo = 0 if dtype == torch.uint8 else -3
    t = torch.randint(lo, 13, shape, generator=g).to(dtype)
    if not t.any():
        t.view(-1)[0] = 5
    return t, float(lo), 12.0


def _strategy(root_kind: str, max_depth: int, max_buffers: int, score_dtype, in_range_gathers: bool,
              exact_only: bool, trivial: float = 1.0):
    import hypothesis.strategies as st

    @st.composite
    def build(draw):
        gen = _Gen(draw, max_buffers, score_dtype, in_range_gathers, exact_only, root_kind == "score", trivial)
        gen.max_depth = max_depth
        if root_kind == "mask":
            v = gen.mixed_mask(gen.bool_val(max_depth))
        elif root_kind == "int":
            v = gen.int_val(max_depth)
        else:
            v = gen.score_reading(gen.float_val(max_depth))
            if gen.chance(0.2):  # the masking idiom: where(cond, x, -inf)
                cond = gen.mixed_mask(gen.bool_val(1))
                v = _Val(ir.where(cond.node, v.node, -math.inf), v.lo, v.hi, v.exact)
        return v.node, gen.tensors()

    return build()


def mask_irs(max_depth: int = 3, max_buffers: int = 3, in_range_gathers: bool = False, trivial: float = 0.2):
    """Strategy: (bool IR root over b, h, q_idx, kv_idx, captured tensors) pairs.

    Masks are mixed on the ``PROBE`` grid but for a ``trivial`` share of all-true / all-false ones
    (``trivial=1.0``: the raw generator).

    >>> node, buffers = mask_irs().example(); node.dtype
    torch.bool
    """
    return _strategy("mask", max_depth, max_buffers, torch.float32, in_range_gathers, False, trivial)


def score_irs(max_depth: int = 3, max_buffers: int = 3, score_dtype: torch.dtype = torch.float32,
              in_range_gathers: bool = False, exact_only: bool = False, trivial: float = 0.2):
    """Strategy: (float IR root over score, b, h, q_idx, kv_idx, captured tensors) pairs.

    ``exact_only`` leaves out approximate math (exp, tanh, ...), so every back end must agree
    bit for bit. ``in_range_gathers`` wraps every index into the buffer (``i % size``), for code
    that runs the mod eagerly with torch indexing (which raises on out-of-range indices). Score mods
    depend on the score on the ``PROBE`` grid but for a ``trivial`` share, and a ``where(cond, x,
    -inf)`` root has a mixed ``cond`` but for a ``trivial`` share.
    """
    return _strategy("score", max_depth, max_buffers, score_dtype, in_range_gathers, exact_only, trivial)


def int_irs(max_depth: int = 3, max_buffers: int = 3, in_range_gathers: bool = False):
    """Strategy: (integer IR root over b, h, q_idx, kv_idx, captured tensors); no overflow."""
    return _strategy("int", max_depth, max_buffers, torch.float32, in_range_gathers, True)
