"""Interval (range) analysis of mask IR over tiles: decide whole tiles without evaluating them.

For a tile of query indices ``[q_lo, q_hi]`` x KV indices ``[kv_lo, kv_hi]`` we compute, node by
node, an interval that contains every value the node can take on the tile. For the bool root that
interval says "always true" (the tile is full), "always false" (empty) or "don't know" (the caller
evaluates the tile's elements). Causal, sliding-window, prefix-LM and other affine masks are
decided exactly, except for the tiles their boundary crosses; gathers from captured 1-D tensors
(document ids) use min/max summaries of the tensor (`Summary`).

Representation. Integers and bools are bounded in int64 (bools as 0/1: ``lo == 1`` means always
true, ``hi == 0`` always false). Floats are bounded in the node's own dtype, so a bound is rounded
by the same monotone rounding as the elements it bounds; a float interval is either NaN-free, or
both bounds are NaN, which means "anything, NaN included" (every comparison then says don't know).
Whatever an op cannot bound soundly (integer overflow, transcendental functions, float division,
ops we don't model) goes to the dtype's whole range: the analysis may give up, never lie.

One set of transfer functions serves two back ends through an ``ops`` object:

* `EagerOps` runs them on torch tensors, vectorised over many tiles at once (the CPU path);
* `flexattn.codegen.interval.TritonOps` *stages* them as Triton source for the block-mask kernel
  (this module imports nothing from codegen).

Example::

    >>> from flexattn import ir
    >>> q, kv = ir.input_("q_idx"), ir.input_("kv_idx")
    >>> causal = ir.binary("ge", q, kv)
    >>> t = torch.tensor
    >>> tile_states(causal, {"b": (t(0), t(0)), "h": (t(0), t(0)),
    ...     "q_idx": (t([0, 0, 128]), t([127, 127, 255])), "kv_idx": (t([128, 0, 0]), t([255, 127, 127]))}, [])
    tensor([0, 3, 2], dtype=torch.int8)

(empty above the diagonal, unknown on it, full below.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flexattn import ir
from flexattn.lru import LRU

# Tile states, shared with the block-mask kernels.
EMPTY, PARTIAL, FULL, UNKNOWN = 0, 1, 2, 3

I64 = torch.int64
I64_MIN, I64_MAX = torch.iinfo(I64).min, torch.iinfo(I64).max
ADD_SAFE = 1 << 62  # |bounds| below this: a sum or difference of two fits in int64
MUL_SAFE = 1 << 31  # |bounds| below this: a product fits in int64

# Granule of the buffer summaries: tile-aligned index ranges (tiles are multiples of 16) are exact.
LOG_GRANULE = 4
GRANULE = 1 << LOG_GRANULE


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


# ---------------------------------------------------------------------------------------------
# Back ends


class EagerOps:
    """Interval ops on torch tensors (all bounds broadcast against each other)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device

    def i64(self, value: int):
        return torch.tensor(value, dtype=I64, device=self.device)

    def fconst(self, value: float, dtype: torch.dtype):
        return torch.tensor(value, dtype=dtype, device=self.device)

    def to(self, x, dtype: torch.dtype):
        return x.to(dtype)

    def where(self, c, a, b):
        return torch.where(c, a, b)

    def minimum(self, a, b):
        return torch.minimum(a, b)  # propagates NaN

    def maximum(self, a, b):
        return torch.maximum(a, b)

    def floordiv(self, a, b):
        return torch.div(a, b, rounding_mode="floor")

    def mod(self, a, b):
        return torch.remainder(a, b)

    def unary(self, op: str, x):
        return {"floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "trunc": torch.trunc}[op](x)

    def gather(self, table, idx):
        return table[idx]


# ---------------------------------------------------------------------------------------------
# Buffer summaries


@dataclass
class Summary:
    """Min/max pyramid of a captured tensor, for bounding gathers from it.

    1-D tensors: level 0 holds the min/max of each `GRANULE` of elements, level k+1 of each pair of
    level-k entries, up to one entry (the global min/max), all levels concatenated in ``mins`` /
    ``maxs`` with level k starting at ``offsets[k]``. Other ranks keep only the global entry.
    Int and bool tensors are summarised in int64, floats in their own dtype (NaN propagates).
    """

    mins: torch.Tensor
    maxs: torch.Tensor
    offsets: torch.Tensor
    ndim: int

    @property
    def top(self) -> int:
        return self.mins.numel() - 1

    @staticmethod
    def of(t: torch.Tensor) -> "Summary":
        """The summary of ``t`` (the one `keep` made, while ``t`` is unchanged)."""
        kept = Summary.kept(t)
        return kept if kept is not None else Summary._of(t)

    @staticmethod
    def kept(t: torch.Tensor) -> "Summary | None":
        """The summary `keep` made of ``t``, while ``t`` is unchanged; else None."""
        kept = _KEPT.get(id(t))
        return kept[2] if kept is not None and kept[0] is t and kept[1] == t._version else None

    @staticmethod
    def levels(n: int) -> int:
        """K, the top level of the pyramid of a 1-D tensor of ``n`` elements: level 0 holds 2**K
        granules (the first level with one entry)."""
        return (-(-n // GRANULE) - 1).bit_length()

    @staticmethod
    def pyramid(mins: torch.Tensor, maxs: torch.Tensor, K: int) -> "Summary":
        """The summary of a 1-D tensor from its pyramid (levels 0 .. ``K``) made elsewhere (the
        block-mask kernels' host side makes it with two kernel launches)."""
        return Summary(mins, maxs, _offsets(K, mins.device), 1)

    @staticmethod
    def keep(t: torch.Tensor, summary: "Summary | None" = None) -> None:
        """Keep ``t``'s summary for every later `of` (while ``t`` is unchanged): for tables that
        flexattn makes once and reads in many block masks (the positions of a shard). ``summary``:
        ``t``'s, made elsewhere (the block-mask kernels' host side makes a 1-D table's in two
        launches, `flexattn.kernels.mask_tiles.summary`); else made here."""
        _KEPT[id(t)] = (t, t._version, summary if summary is not None else Summary._of(t))

    @staticmethod
    def _of(t: torch.Tensor) -> "Summary":
        x = t.detach()
        if not x.dtype.is_floating_point:
            x = x.to(I64)
        device = x.device
        if x.numel() == 0:
            zero = torch.zeros(1, dtype=x.dtype, device=device)
            return Summary(zero, zero.clone(), _offsets(0, device), t.dim())
        if x.dim() != 1:
            mn, mx = torch.aminmax(x)
            return Summary(mn.reshape(1), mx.reshape(1), _offsets(0, device), t.dim())
        # Level 0 has 2**K granules: the tail is padded with the last element, which every entry
        # that covers a padded position also covers, so no entry's bounds change. Minima and
        # order-reversed maxima (negated floats; complemented ints, which cannot overflow) sit in
        # one [2, n] tensor, so that each level is one reduction of the one below.
        K = Summary.levels(x.numel())
        extra = (GRANULE << K) - x.numel()
        if extra:
            x = torch.cat([x, x[-1:].expand(extra)])
        flip = torch.neg if x.dtype.is_floating_point else torch.bitwise_not
        levels = [torch.stack([x, flip(x)]).view(2, -1, GRANULE).amin(-1)]
        for _ in range(K):
            levels.append(levels[-1].view(2, -1, 2).amin(-1))
        both = torch.cat(levels, dim=1)
        return Summary(both[0], flip(both[1]), _offsets(K, device), 1)


_OFFSETS = LRU(64)  # (levels, device) -> offsets tensor
_KEPT = LRU(256)  # id -> (tensor, version, Summary), `Summary.keep`


def _offsets(K: int, device: torch.device) -> torch.Tensor:
    """Where each level of a pyramid of ``2**K`` granules starts (level k has ``2**(K - k)``
    entries), on ``device``: made once (a host-to-device copy waits for the stream)."""
    hit = _OFFSETS.get((K, device))
    if hit is None:
        hit = torch.tensor([(2 << K) - (2 << (K - k)) for k in range(K + 1)],
                           dtype=I64, device=device)
        _OFFSETS[(K, device)] = hit
    return hit


@dataclass
class SummaryRefs:
    """Where a back end finds one buffer's summary: tables, level offsets, top entry, size."""

    mins: Any
    maxs: Any
    offsets: Any
    top: Any
    size: Any  # dim-0 size of a 1-D buffer
    ndim: int


# ---------------------------------------------------------------------------------------------
# Transfer functions


def _top(ops, dtype: torch.dtype):
    k = _kind(dtype)
    if k == "bool":
        return ops.i64(0), ops.i64(1)
    if k == "int":
        info = torch.iinfo(dtype)
        return ops.i64(info.min), ops.i64(info.max)
    nan = ops.fconst(float("nan"), dtype)
    return nan, nan


def _fit(ops, lo, hi, dtype: torch.dtype, ok=None):
    """Integer bounds for ``dtype``: its whole range where they overflow it (or ``ok`` is false)."""
    info = torch.iinfo(dtype)
    fits = (lo >= info.min) & (hi <= info.max)
    ok = fits if ok is None else ok & fits
    tlo, thi = _top(ops, dtype)
    return ops.where(ok, lo, tlo), ops.where(ok, hi, thi)


def _nan_norm(ops, lo, hi, dtype):
    """Float bounds: if either is NaN, both are (the interval then means "anything")."""
    bad = (lo != lo) | (hi != hi)
    nan = ops.fconst(float("nan"), dtype)
    return ops.where(bad, nan, lo), ops.where(bad, nan, hi)


def _finite(lo, hi):
    # x - x is 0 for finite x, NaN for inf and NaN.
    return ((lo - lo) == 0) & ((hi - hi) == 0)


def _within(x, bound: int):
    lo, hi = x
    return (lo >= -bound) & (hi <= bound)


def _as_bool(ops, true, false):
    """A bool interval from "surely true" / "surely false" conditions."""
    return ops.to(true, I64), ops.to(~false, I64)


def _compare(op, a, b):
    """(surely true, surely false) of ``a op b`` for intervals a, b."""
    (alo, ahi), (blo, bhi) = a, b
    if op == "lt":
        return ahi < blo, alo >= bhi
    if op == "le":
        return ahi <= blo, alo > bhi
    if op == "gt":
        return alo > bhi, ahi <= blo
    if op == "ge":
        return alo >= bhi, ahi < blo
    same = (alo == ahi) & (blo == bhi) & (alo == blo)
    apart = (ahi < blo) | (bhi < alo)
    return (same, apart) if op == "eq" else (apart, same)


def _bitlen(ops, x):
    """Number of bits of ``x`` (0 <= x < 2**63), branch-free: 0 -> 0, 1 -> 1, 5 -> 3."""
    n = ops.i64(0)
    for s in (32, 16, 8, 4, 2, 1):
        big = x >= (1 << s)
        x = ops.where(big, x >> s, x)
        n = n + ops.where(big, ops.i64(s), ops.i64(0))
    return n + x


def _load(ops, n: ir.Node, s, refs: SummaryRefs):
    """Bounds of ``buffer[index]``: in-range indices query the pyramid; others may read 0."""
    dtype = n.dtype
    is_float = dtype.is_floating_point
    zero = ops.fconst(0.0, dtype) if is_float else ops.i64(0)

    def value(table, at):  # (floats in the back end's form of ``dtype``: see `_arith`)
        v = ops.gather(table, at)
        return ops.to(v, dtype) if is_float else v

    glo = value(refs.mins, refs.top)
    ghi = value(refs.maxs, refs.top)
    if refs.ndim == 0:
        lo, hi = glo, ghi
    elif refs.ndim == 1:
        ilo, ihi = s[0]
        size = refs.size
        pos = (ilo >= 0) & (ihi < size)
        neg = (ilo >= -size) & (ihi < 0)  # negative indices wrap like Python's
        qlo = ops.where(pos, ilo, ops.where(neg, ilo + size, ops.i64(0)))
        qhi = ops.where(pos, ihi, ops.where(neg, ihi + size, ops.i64(0)))
        g1, g2 = qlo >> LOG_GRANULE, qhi >> LOG_GRANULE
        # At level k = bitlen(g2 - g1) entries cover 2**k granules, so [g1, g2] meets at most two.
        k = _bitlen(ops, g2 - g1)
        off = ops.gather(refs.offsets, k)
        a, b = off + (g1 >> k), off + (g2 >> k)
        mn = ops.minimum(value(refs.mins, a), value(refs.mins, b))
        mx = ops.maximum(value(refs.maxs, a), value(refs.maxs, b))
        inside = pos | neg
        lo = ops.where(inside, mn, ops.minimum(glo, zero))
        hi = ops.where(inside, mx, ops.maximum(ghi, zero))
    else:
        lo, hi = ops.minimum(glo, zero), ops.maximum(ghi, zero)
    if is_float:
        return _nan_norm(ops, lo, hi, dtype)
    return lo, hi


def _cast(ops, n: ir.Node, x):
    src, dst = n.src[0].dtype, n.dtype
    ks, kd = _kind(src), _kind(dst)
    lo, hi = x
    if kd == "bool":
        zero = 0.0 if ks == "float" else 0
        return _as_bool(ops, (lo > zero) | (hi < zero), (lo == zero) & (hi == zero))
    if kd == "float":
        return _nan_norm(ops, ops.to(lo, dst), ops.to(hi, dst), dst)
    if ks == "float":
        ok = (lo >= -float(ADD_SAFE)) & (hi <= float(ADD_SAFE))  # false for NaN
        zero = ops.fconst(0.0, src)
        lo = ops.to(ops.where(ok, lo, zero), I64)  # float -> int truncates toward zero
        hi = ops.to(ops.where(ok, hi, zero), I64)
        return _fit(ops, lo, hi, dst, ok)
    return _fit(ops, lo, hi, dst)


def _arith(ops, op, n, a, b):
    dtype = n.dtype
    (alo, ahi), (blo, bhi) = a, b
    if op == "add":
        lo, hi = alo + blo, ahi + bhi
    elif op == "sub":
        lo, hi = alo - bhi, ahi - blo
    else:
        p = (alo * blo, alo * bhi, ahi * blo, ahi * bhi)
        lo = ops.minimum(ops.minimum(p[0], p[1]), ops.minimum(p[2], p[3]))
        hi = ops.maximum(ops.maximum(p[0], p[1]), ops.maximum(p[2], p[3]))
    if dtype.is_floating_point:
        # Rounded to ``dtype`` (a no-op for torch tensors of that dtype; the staged back end
        # computes half/bfloat16 in float32, as the kernels do, and rounds here, once).
        lo, hi = ops.to(lo, dtype), ops.to(hi, dtype)
        # Finite operands never give NaN here; inf - inf or 0 * inf could.
        ok = _finite(alo, ahi) & _finite(blo, bhi)
        nan = ops.fconst(float("nan"), dtype)
        return _nan_norm(ops, ops.where(ok, lo, nan), ops.where(ok, hi, nan), dtype)
    safe = ADD_SAFE if op != "mul" else MUL_SAFE
    return _fit(ops, lo, hi, dtype, _within(a, safe) & _within(b, safe))


def _floordiv_or_mod(ops, op, n, a, b):
    dtype = n.dtype
    if dtype.is_floating_point:
        return _top(ops, dtype)
    (alo, ahi), (blo, bhi) = a, b
    pos, neg = blo > 0, bhi < 0
    ok = (pos | neg) & _within(a, ADD_SAFE) & _within(b, ADD_SAFE)
    one = ops.i64(1)
    # Divisors that may be 0 are replaced by 1 (their result is discarded) so nothing traps.
    dlo, dhi = ops.where(ok, blo, one), ops.where(ok, bhi, one)
    # A divisor that is exactly 0: x // 0 == 0 and x % 0 == x (flexattn's meaning everywhere).
    zero = (blo == 0) & (bhi == 0)
    if op == "floordiv":
        # floor(x / d) is monotone in x and in d on each side of 0: the corners bound it.
        p = [ops.floordiv(x, d) for x in (alo, ahi) for d in (dlo, dhi)]
        lo = ops.minimum(ops.minimum(p[0], p[1]), ops.minimum(p[2], p[3]))
        hi = ops.maximum(ops.maximum(p[0], p[1]), ops.maximum(p[2], p[3]))
        lo, hi = _fit(ops, lo, hi, dtype, ok)
        return ops.where(zero, ops.i64(0), lo), ops.where(zero, ops.i64(0), hi)
    # Python-sign modulo: in [0, d-1] for d > 0 and [d+1, 0] for d < 0; exact when the numerator
    # range stays inside one period of a constant divisor.
    lo = ops.where(pos, ops.i64(0), dlo + 1)
    hi = ops.where(pos, dhi - 1, ops.i64(0))
    period = (dlo == dhi) & (ops.floordiv(alo, dlo) == ops.floordiv(ahi, dlo))
    lo = ops.where(period, ops.mod(alo, dlo), lo)
    hi = ops.where(period, ops.mod(ahi, dlo), hi)
    lo, hi = _fit(ops, lo, hi, dtype, ok)
    return ops.where(zero, alo, lo), ops.where(zero, ahi, hi)


def _bitwise(ops, op, n, a, b):
    (alo, ahi), (blo, bhi) = a, b
    if n.dtype == torch.bool:
        if op == "and_":
            return ops.minimum(alo, blo), ops.minimum(ahi, bhi)
        if op == "or_":
            return ops.maximum(alo, blo), ops.maximum(ahi, bhi)
        known = (alo == ahi) & (blo == bhi)
        v = alo ^ blo
        return ops.where(known, v, ops.i64(0)), ops.where(known, v, ops.i64(1))
    if op == "and_":
        # x & c lies in [0, c] when c >= 0.
        tlo, thi = _top(ops, n.dtype)
        an, bn = alo >= 0, blo >= 0
        hi = ops.where(an & bn, ops.minimum(ahi, bhi), ops.where(an, ahi, ops.where(bn, bhi, thi)))
        lo = ops.where(an | bn, ops.i64(0), tlo)
        return lo, hi
    if op == "rshift":
        # Arithmetic shift by a known amount is floor division by a power of two: monotone.
        ok = (blo == bhi) & (blo >= 0) & (blo < 63)
        sh = ops.where(ok, blo, ops.i64(0))
        return _fit(ops, alo >> sh, ahi >> sh, n.dtype, ok)
    return _top(ops, n.dtype)


def _unary(ops, op, n, x):
    dtype = n.dtype
    lo, hi = x
    if op == "not":
        return 1 - hi, 1 - lo
    if op == "detach":
        return lo, hi
    if dtype.is_floating_point:
        if op == "neg":
            lo, hi = -hi, -lo
        elif op == "abs":
            lo, hi = _abs(ops, lo, hi, ops.fconst(0.0, dtype))
        elif op == "relu":
            zero = ops.fconst(0.0, dtype)
            lo, hi = ops.maximum(lo, zero), ops.maximum(hi, zero)
        elif op in ("floor", "ceil", "round", "trunc"):
            lo, hi = ops.unary(op, lo), ops.unary(op, hi)
        else:
            return _top(ops, dtype)  # transcendental: implementations need not be monotone
        return _nan_norm(ops, lo, hi, dtype)
    if op == "neg":
        return _fit(ops, -hi, -lo, dtype, _within(x, ADD_SAFE))
    if op == "invert":
        info = torch.iinfo(dtype)
        if info.min == 0:  # unsigned: ~x is max - x (not -1 - x, which is below the type's range)
            return (info.max - hi, info.max - lo) if info.max <= I64_MAX else _top(ops, dtype)
        return ~hi, ~lo
    if op == "abs":
        alo, ahi = _abs(ops, lo, hi, ops.i64(0))
        return _fit(ops, alo, ahi, dtype, _within(x, ADD_SAFE))
    if op == "sign":
        def sgn(v):
            return ops.where(v > 0, ops.i64(1), ops.where(v < 0, ops.i64(-1), ops.i64(0)))
        return sgn(lo), sgn(hi)
    if op == "relu":
        zero = ops.i64(0)
        return ops.maximum(lo, zero), ops.maximum(hi, zero)
    return _top(ops, dtype)


def _abs(ops, lo, hi, zero):
    alo = ops.where(lo >= zero, lo, ops.where(hi <= zero, -hi, zero))
    ahi = ops.maximum(-lo, hi)
    return alo, ahi


def _transfer(ops, n: ir.Node, s: list, inputs: dict, refs: dict[int, SummaryRefs]):
    op = n.op
    if op == "const":
        if n.dtype.is_floating_point:
            c = ops.fconst(n.arg, n.dtype)
        else:
            c = ops.i64(int(n.arg))
        return c, c
    if op == "input":
        return inputs[n.arg]
    if op == "load":
        return _load(ops, n, s, refs[n.arg.index])
    if op == "cast":
        return _cast(ops, n, s[0])
    if op == "where":
        (clo, chi), (alo, ahi), (blo, bhi) = s
        yes, no = clo == 1, chi == 0
        lo = ops.where(yes, alo, ops.where(no, blo, ops.minimum(alo, blo)))
        hi = ops.where(yes, ahi, ops.where(no, bhi, ops.maximum(ahi, bhi)))
        return lo, hi
    if op in ir.COMPARISONS:
        return _as_bool(ops, *_compare(op, s[0], s[1]))
    if op in ("add", "sub", "mul"):
        return _arith(ops, op, n, s[0], s[1])
    if op in ("floordiv", "mod"):
        return _floordiv_or_mod(ops, op, n, s[0], s[1])
    if op in ("minimum", "maximum"):
        f = ops.minimum if op == "minimum" else ops.maximum
        return f(s[0][0], s[1][0]), f(s[0][1], s[1][1])
    if op in ("and_", "or_", "xor", "lshift", "rshift"):
        return _bitwise(ops, op, n, s[0], s[1])
    if op in ir.UNARY_OPS:
        return _unary(ops, op, n, s[0])
    return _top(ops, n.dtype)  # truediv, pow, ...: not modelled


def analyze(root: ir.Node, ops, inputs: dict, refs: dict[int, SummaryRefs]):
    """Bounds (lo, hi) of ``root``; ``inputs`` maps b/h/q_idx/kv_idx to int64 (lo, hi)."""
    memo: dict[int, Any] = {}
    for n in ir.toposort(root):
        memo[id(n)] = _transfer(ops, n, [memo[id(x)] for x in n.src], inputs, refs)
    return memo[id(root)]


# ---------------------------------------------------------------------------------------------
# Entry points


def tile_states(root: ir.Node, inputs: dict, buffers, summaries: list[Summary] | None = None) -> torch.Tensor:
    """EMPTY / FULL / UNKNOWN (int8) for each tile, eagerly with torch ops.

    ``inputs`` maps "b", "h", "q_idx", "kv_idx" to (lo, hi) tensors that broadcast together (one
    entry per tile); ranges are inclusive and must hold only in-range indices. FULL here means
    "every element in the ranges is true": callers downgrade tiles cut by the sequence end.
    """
    if root.dtype != torch.bool:
        raise TypeError(f"interval analysis decides bool masks, got {ir.dtype_name(root.dtype)}")
    device = next(iter(inputs.values()))[0].device
    ops = EagerOps(device)
    if summaries is None:
        summaries = [Summary.of(t) for t in buffers]
    refs = {}
    for buf in ir.buffers_of(root):
        sm, t = summaries[buf.index], buffers[buf.index]
        refs[buf.index] = SummaryRefs(sm.mins, sm.maxs, sm.offsets, sm.top,
                                       t.shape[0] if t.dim() == 1 else 0, t.dim())
    ins = {k: (lo.to(I64), hi.to(I64)) for k, (lo, hi) in inputs.items()}
    lo, hi = analyze(root, ops, ins, refs)
    state = torch.where(lo == 1, FULL, torch.where(hi == 0, EMPTY, UNKNOWN)).to(torch.int8)
    shape = torch.broadcast_shapes(*(t.shape for pair in ins.values() for t in pair))
    return state.expand(shape)
