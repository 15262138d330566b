"""Shared test helpers (tests only, not shipped): random IR strategies, index grids, float64 references, IR -> Python.

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
"""

from __future__ import annotations

import linecache
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flexattn import ir
from flexattn.ir import Node

MAX_BH = 4  # index grids used with the strategies have B, H <= MAX_BH
MAX_LEN = 128  # ... and Q_LEN, KV_LEN <= MAX_LEN
SCORE_BOUND = 8.0  # |score| <= SCORE_BOUND (see random_score)

_FLOAT_CAP = 3.0e4  # float values stay below this (float16 overflows at 65504)
_INT_CAP = {torch.int32: 2**30, torch.int64: 2**60}  # no overflow for 32/64-bit ints
_INT_BUFFER_DTYPES = (torch.int32, torch.int64, torch.int8, torch.uint8)
_FLOAT_BUFFER_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ---------------------------------------------------------------------------------------------
# Grids, scores and references


def index_grid(B: int, H: int, Q_LEN: int, KV_LEN: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """int32 (b, h, q_idx, kv_idx) shaped [B,1,1,1], [1,H,1,1], [1,1,Q,1], [1,1,1,KV] (broadcast).

    >>> b, h, q_idx, kv_idx = index_grid(2, 3, 5, 7); (q_idx >= kv_idx).shape
    torch.Size([1, 1, 5, 7])
    """
    sizes = (B, H, Q_LEN, KV_LEN)
    out = []
    for d, n in enumerate(sizes):
        shape = [1, 1, 1, 1]
        shape[d] = n
        out.append(torch.arange(n, dtype=torch.int32, device=device).view(shape))
    return tuple(out)


def random_score(B: int, H: int, Q_LEN: int, KV_LEN: int, dtype=torch.float32, seed: int = 0,
                 device="cpu") -> torch.Tensor:
    """A [B, H, Q, KV] score tensor, standard normal times 2, clamped to +-SCORE_BOUND, no zeros."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(B, H, Q_LEN, KV_LEN, generator=g, dtype=torch.float64) * 2).clamp(-SCORE_BOUND, SCORE_BOUND)
    s = torch.where(s == 0, 0.5, s)
    return s.to(dtype).to(device)


def grid_inputs(B: int, H: int, Q_LEN: int, KV_LEN: int, score: torch.Tensor | None = None) -> dict:
    """The ``inputs`` dict `ir.evaluate` takes for a full index grid (plus ``score`` if given)."""
    device = score.device if score is not None else "cpu"
    inputs = dict(zip(ir.INDEX_INPUTS, index_grid(B, H, Q_LEN, KV_LEN, device)))
    if score is not None:
        inputs["score"] = score
    return inputs


def eval_grid(node: Node, buffers: Sequence[torch.Tensor], B: int, H: int, Q_LEN: int, KV_LEN: int,
              score: torch.Tensor | None = None) -> torch.Tensor:
    """``node`` evaluated eagerly (same dtype) at every grid point, broadcast to [B, H, Q, KV]."""
    out = ir.evaluate(node, grid_inputs(B, H, Q_LEN, KV_LEN, score), buffers)
    return out.expand(B, H, Q_LEN, KV_LEN)


def to_float64(node: Node) -> Node:
    """``node`` with every float value computed in float64 (the reference for float trees).

    Float constants, float casts, the score input and float buffer reads become float64; integer
    and bool parts are unchanged (so indices, comparisons and gathers mean the same).
    >>> to_float64(ir.unary("exp", ir.input_("q_idx"))).dtype
    torch.float64
    """
    f64 = torch.float64

    def up(x: Node) -> Node:
        return ir.cast(x, f64) if not x.dtype.is_floating_point else x

    def mapping_fn(n: Node, src: tuple[Node, ...]) -> Node:
        op = n.op
        if op == "const":
            return ir.const(n.arg, f64) if n.dtype.is_floating_point else n
        if op == "input":
            return ir.input_("score", f64) if n.arg == "score" else n
        if op == "load":
            buf = n.arg
            if buf.dtype.is_floating_point:
                buf = ir.Buffer(buf.index, buf.name, f64, buf.ndim)
            return ir.load(buf, src)
        if op == "cast":
            return ir.cast(src[0], f64 if n.dtype.is_floating_point else n.dtype)
        if n.dtype.is_floating_point:
            # Ops that turn ints into the default float ("float" rule, truediv): go via float64.
            if op in ir.UNARY_OPS:
                return ir.unary(op, up(src[0]))
            if op == "truediv":
                return ir.binary(op, up(src[0]), up(src[1]))
        return ir.rebuild(n, src)

    memo: dict[int, Node] = {}
    for n in ir.toposort(node):
        memo[id(n)] = mapping_fn(n, tuple(memo[id(s)] for s in n.src))
    return memo[id(node)]


def buffers_float64(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffers as `to_float64` reads them (float tensors upcast to float64)."""
    return [t.double() if t.dtype.is_floating_point else t for t in buffers]


def reference_fp64(node: Node, buffers: Sequence[torch.Tensor], B: int, H: int, Q_LEN: int, KV_LEN: int,
                   score: torch.Tensor | None = None) -> torch.Tensor:
    """``node`` evaluated in float64 on the grid (see `to_float64`), broadcast to [B, H, Q, KV]."""
    s64 = score.double() if score is not None else None
    return eval_grid(to_float64(node), buffers_float64(buffers), B, H, Q_LEN, KV_LEN, s64)


def quantise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor float8_e4m3fn quantisation: ``(x / s as float8, s)``, s mapping max|x| to 448."""
    s = (x.abs().max() / 448).reshape(1).float()
    return (x / s).to(torch.float8_e4m3fn), s


def dequantised(x8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The float64 values a float8 tensor and its descale factor stand for."""
    return x8.double() * s.double()


def assert_close_to_reference(out: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor,
                              factor: float = 2.0, atol: float | None = None,
                              elementwise: bool = False, name: str = "kernel") -> None:
    """Assert ``out``'s error against the float64 ``ref`` is within ``factor`` x ``eager``'s + ``atol``.

    ``eager`` is the same computation in ``out``'s dtype by a trusted implementation (torch), so
    its error is what that dtype costs; the kernel may be a small multiple worse. ``atol`` (default
    4 ulp of ``out``'s dtype at the largest reference magnitude) covers elements where eager happens
    to be exact. NaN/inf must match ``eager`` or ``ref`` exactly where either has one. ``elementwise`` compares
    every element; otherwise the max errors are compared (the usual attention-test criterion).
    >>> r = torch.tensor([1.0], dtype=torch.float64)
    >>> assert_close_to_reference(torch.tensor([1.0]), torch.tensor([1.0]), r)
    """
    if out.shape != ref.shape or eager.shape != ref.shape:
        raise AssertionError(f"shapes differ: {name} {tuple(out.shape)}, eager {tuple(eager.shape)}, "
                             f"reference {tuple(ref.shape)}")
    if torch.isnan(out.float()).any() and not torch.isnan(eager.float()).any():
        bad = torch.isnan(out.float()).nonzero()[0].tolist()
        raise AssertionError(f"{name} has NaN (unwritten or invalid) at {bad}, eager has none")
    ref = ref.double()
    o, e = out.double(), eager.double()
    special = ~torch.isfinite(ref) | ~torch.isfinite(e)
    # Where eager is non-finite (or the reference is), the kernel must give the same special value
    # as eager or as the float64 reference: a discrete choice (``score == 0.5``) can flip under
    # eager's rounding, and then the kernel agreeing with float64 is the right answer.
    same = ((o == e) | (torch.isnan(o) & torch.isnan(e))
            | (o == ref) | (torch.isnan(o) & torch.isnan(ref)))
    if (special & ~same).any():
        i = (special & ~same).nonzero()[0].tolist()
        raise AssertionError(f"{name} {o[tuple(i)].item()} != eager {e[tuple(i)].item()} "
                             f"(reference {ref[tuple(i)].item()}) at {i}")
    fin = ~special
    if not fin.any():
        return
    if atol is None:
        eps = torch.finfo(out.dtype).eps if out.dtype.is_floating_point else 0.0
        atol = 4 * eps * max(1.0, ref[fin].abs().max().item())
    err_o = torch.where(fin, (o - ref).abs(), 0.0)
    err_e = torch.where(fin, (e - ref).abs(), 0.0)
    if elementwise:
        bad = err_o > factor * err_e + atol
        if bad.any():
            i = bad.nonzero()[0].tolist()
            t = tuple(i)
            raise AssertionError(
                f"{name} error {err_o[t].item():.3g} > {factor} x eager error {err_e[t].item():.3g} + "
                f"{atol:.3g} at {i} ({bad.sum().item()} elements): {name} {o[t].item()!r}, eager "
                f"{e[t].item()!r}, reference {ref[t].item()!r}")
    else:
        eo, ee = err_o.max().item(), err_e.max().item()
        if eo > factor * ee + atol:
            raise AssertionError(f"{name} max error {eo:.3g} > {factor} x eager max error {ee:.3g} + {atol:.3g}")


def weighted_grads(out: torch.Tensor, lse: torch.Tensor, inputs: Sequence[torch.Tensor], d_out: torch.Tensor,
                   d_lse: torch.Tensor) -> tuple:
    """Gradients w.r.t. ``inputs`` of sum(out * d_out) + sum(lse * d_lse) over the rows of finite LSE,
    computed in ``d_out``'s dtype (None for an input the loss does not reach)."""
    finite_lse = torch.where(torch.isfinite(lse), lse.to(d_lse.dtype) * d_lse, 0.0)
    loss = (out.to(d_out.dtype) * d_out).sum() + finite_lse.sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def backward_atol(grad_ref: torch.Tensor, dtypes: Sequence[torch.dtype], d_out: torch.Tensor,
                  value: torch.Tensor, lse: torch.Tensor) -> float:
    """The absolute slack of a flash-style backward's gradient in low precision, against the float64
    gradient ``grad_ref`` (``dtypes``: the inputs' and the gradient's; the largest epsilon counts).

    Flash-style backwards compute dS = P * (dP - Delta) with Delta = rowsum(dO * O) from the stored
    O: a cancellation eager autograd (softmax's backward on the exact P) does not have, worth a few
    ulp of |dP| (one visible key: dS is 0 in eager, ~eps * |dP| here). So the slack scales with
    max |dP| = max |dO V^T| (``d_out`` [B, Hq, L, Ev], ``value`` [B or 1, Hkv, S, Ev]), not only
    with the gradient. P is recomputed from the stored float32 LSE, whose rounding (eps |lse|) is
    P's relative error there: scores of large magnitude (|lse| ~ 1e3) scale it by max |lse|.
    """
    vv = value.detach().double().repeat_interleave(d_out.shape[1] // value.shape[1], dim=1)
    dp_max = (d_out.double() @ vv.transpose(-2, -1)).abs().max().item() if d_out.numel() and vv.numel() else 0.0
    finite = lse[lse.isfinite()]
    lse_max = finite.abs().max().item() if finite.numel() else 0.0
    mag = max(1.0, grad_ref.abs().max().item() if grad_ref.numel() else 0.0)
    eps = max(torch.finfo(d).eps for d in dtypes)
    return 8 * eps * mag * max(1.0, dp_max, lse_max)


def record_calls(monkeypatch, owner: Any, name: str) -> list[tuple]:
    """Wrap ``owner.name`` (for the test's duration) so that each call's positional arguments
    are appended to the returned list; the real function still runs."""
    real = getattr(owner, name)
    calls: list[tuple] = []

    def recording(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def capture_after_warmup(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, static outputs)``: ``step`` warmed up on a side stream (trace, plan, compile), as
    torch's recipe does, then one call captured (on torch's default capture stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


# ---------------------------------------------------------------------------------------------
# Random IR


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
                 has_score: bool):
        import hypothesis.strategies as st

        self.st = st
        self.draw = draw
        self.max_buffers = max_buffers
        self.score_dtype = score_dtype
        self.in_range = in_range_gathers
        self.exact_only = exact_only
        self.has_score = has_score  # float leaves may read the score (score mods only)
        self.max_depth = 0
        self.buffers: list[tuple[ir.Buffer, torch.Tensor, float, float]] = []

    # -- draw helpers
    def pick(self, options):
        return self.draw(self.st.sampled_from(options))

    def chance(self, p: float) -> bool:
        return self.draw(self.st.integers(0, 99)) < p * 100

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
        # Approximate math: inexact from here on.
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
              exact_only: bool):
    import hypothesis.strategies as st

    @st.composite
    def build(draw):
        gen = _Gen(draw, max_buffers, score_dtype, in_range_gathers, exact_only, root_kind == "score")
        gen.max_depth = max_depth
        if root_kind == "mask":
            v = gen.bool_val(max_depth)
        elif root_kind == "int":
            v = gen.int_val(max_depth)
        else:
            v = gen.float_val(max_depth)
            if root_kind == "score" and gen.chance(0.2):  # the masking idiom: where(cond, x, -inf)
                v = _Val(ir.where(gen.bool_val(1).node, v.node, -math.inf), v.lo, v.hi, v.exact)
        return v.node, gen.tensors()

    return build()


def mask_irs(max_depth: int = 3, max_buffers: int = 3, in_range_gathers: bool = False):
    """Strategy: (bool IR root over b, h, q_idx, kv_idx, captured tensors) pairs.

    >>> node, buffers = mask_irs().example(); node.dtype
    torch.bool
    """
    return _strategy("mask", max_depth, max_buffers, torch.float32, in_range_gathers, False)


def score_irs(max_depth: int = 3, max_buffers: int = 3, score_dtype: torch.dtype = torch.float32,
              in_range_gathers: bool = False, exact_only: bool = False):
    """Strategy: (float IR root over score, b, h, q_idx, kv_idx, captured tensors) pairs.

    ``exact_only`` leaves out approximate math (exp, tanh, ...), so every back end must agree
    bit for bit. ``in_range_gathers`` wraps every index into the buffer (``i % size``), for code
    that runs the mod eagerly with torch indexing (which raises on out-of-range indices).
    """
    return _strategy("score", max_depth, max_buffers, score_dtype, in_range_gathers, exact_only)


def int_irs(max_depth: int = 3, max_buffers: int = 3, in_range_gathers: bool = False):
    """Strategy: (integer IR root over b, h, q_idx, kv_idx, captured tensors); no overflow."""
    return _strategy("int", max_depth, max_buffers, torch.float32, in_range_gathers, True)


# ---------------------------------------------------------------------------------------------
# IR -> Python source (for tracer round trips)

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
