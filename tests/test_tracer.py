"""Tracer: Python mods -> IR, checked against the same mods run eagerly under torch.vmap.

The oracle is torch's own semantics: every traced mod is evaluated by `ir.evaluate` on an index
grid and compared with the Python mod vmapped over (b, h, q_idx, kv_idx) exactly as
torch.nn.attention.flex_attention does (int32 indices, 0-d values per element), including the
result dtype before the score cast.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import ir
from helpers import testing
from flexattn.mods import Mod
from flexattn.tracer import Proxy, TraceError, inline, is_traced, trace

B, H, Q, KV = 2, 3, 11, 13  # not multiples of anything on purpose
SCORE = testing.random_score(B, H, Q, KV, seed=1)


def vmap_eval(fn, kind: str, score: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` over the full grid, vmapped like torch's flex_attention (innermost dim kv_idx)."""
    idx = [torch.arange(n, dtype=torch.int32) for n in (B, H, Q, KV)]
    f = fn
    prefix = (0,) if kind == "score" else ()
    for dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        f = torch.vmap(f, in_dims=prefix + dims)
    with TransformGetItemToIndex():
        return f(score, *idx) if kind == "score" else f(*idx)


def traced_eval(mod: Mod, score: torch.Tensor | None = None) -> torch.Tensor:
    return testing.eval_grid(mod.ir, mod.buffers, B, H, Q, KV, score if mod.kind == "score" else None)


def uncast(mod: Mod, natural: torch.dtype | None = None) -> ir.Node:
    """The score mod's value before trace() cast it to score_dtype (a no-op cast leaves no node)."""
    root = mod.ir
    if mod.kind == "score" and root.op == "cast" and root.dtype != natural:
        return root.src[0]
    return root


def check(fn, kind: str | None = None, **kw) -> Mod:
    """Trace ``fn``; its IR must match the eager vmapped ``fn`` in value and (pre-cast) dtype."""
    mod = trace(fn, kind, **kw)
    want = vmap_eval(fn, mod.kind, SCORE)
    got = traced_eval(mod, SCORE)
    if mod.ir.op != "const":  # casts of constants fold away, and with them the natural dtype
        assert uncast(mod, want.dtype).dtype == want.dtype, (mod, want.dtype)
    if mod.kind == "mask":
        assert got.dtype == torch.bool
        assert torch.equal(got, want.expand_as(got)), mod
    else:
        assert got.dtype == mod.score_dtype or mod.score_dtype is None
        torch.testing.assert_close(got, want.to(got.dtype).expand_as(got), rtol=1e-5, atol=1e-5, equal_nan=True)
    return mod


def same(tensors, expected) -> bool:
    """The same tensor objects in the same order."""
    return len(tensors) == len(expected) and all(a is b for a, b in zip(tensors, expected))


def location(fn, offset: int) -> str:
    """'file:line' of the line ``offset`` lines below ``fn``'s def line."""
    return f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno + offset}"


# ---------------------------------------------------------------------------------------------
# Operators, promotion, reflected operators with Python numbers

OPERATOR_MASKS = [
    lambda b, h, q, kv: q >= kv,
    lambda b, h, q, kv: 3 < q,                      # reflected comparison
    lambda b, h, q, kv: (q - kv) % 4 == 0,
    lambda b, h, q, kv: (kv - q) % 3 == 1,          # Python-sign remainder on negatives
    lambda b, h, q, kv: (kv - q) // 4 == -1,        # floor division on negatives
    lambda b, h, q, kv: 10 - q > kv,                # __rsub__
    lambda b, h, q, kv: 7 // (q + 1) > 1,           # __rfloordiv__
    lambda b, h, q, kv: 17 % (kv + 1) < 4,          # __rmod__
    lambda b, h, q, kv: 2 ** (q % 5) > kv,          # __rpow__
    lambda b, h, q, kv: q ** 2 < kv * 3,
    lambda b, h, q, kv: (q & 3) == (kv | 1),
    lambda b, h, q, kv: (5 & q) ^ (kv >> 1) != (1 << (h + 1)),
    lambda b, h, q, kv: (q < 5) & (kv > 2) | ~(b == 1),
    lambda b, h, q, kv: True & (q > kv),            # __rand__ with a Python bool
    lambda b, h, q, kv: False | (q > kv) ^ True,
    lambda b, h, q, kv: q / 2 > kv / 3,             # int / int -> float
    lambda b, h, q, kv: q * 0.5 >= 1.5 - kv,
    lambda b, h, q, kv: -q < -kv,
    lambda b, h, q, kv: abs(q - kv) <= 2,
    lambda b, h, q, kv: +q == q,
]


@pytest.mark.parametrize("fn", OPERATOR_MASKS, ids=range(len(OPERATOR_MASKS)))
def test_operators_masks(fn):
    check(fn)


OPERATOR_SCORES = [
    lambda s, b, h, q, kv: s * 2,
    lambda s, b, h, q, kv: 2 * s + 1,
    lambda s, b, h, q, kv: 1 - s,
    lambda s, b, h, q, kv: 1 / (1 + abs(s)),
    lambda s, b, h, q, kv: s / 3.0 - (q - kv) * 0.25,
    lambda s, b, h, q, kv: s + q,                   # int32 + float32 -> float32
    lambda s, b, h, q, kv: (q - kv) / 4,            # an int result of / is float
    lambda s, b, h, q, kv: s ** 2 + 2 ** (s / 8),
    lambda s, b, h, q, kv: s // 1.5 + s % 1.5,      # float floor-division / remainder
    lambda s, b, h, q, kv: q - kv,                  # int result: cast to score_dtype
    lambda s, b, h, q, kv: -s,
]


@pytest.mark.parametrize("fn", OPERATOR_SCORES, ids=range(len(OPERATOR_SCORES)))
def test_operators_scores(fn):
    check(fn)


def test_constant_results():
    mod = trace(lambda s, b, h, q, kv: 2, score_dtype=torch.float16)  # a Python number
    assert mod.ir.op == "const" and mod.ir.dtype == torch.float16 and mod.ir.arg == 2.0
    mod = trace(lambda b, h, q, kv: True)
    assert mod.ir.op == "const" and mod.ir.dtype == torch.bool and mod.ir.arg is True


def test_weak_python_scalars_keep_the_tensor_dtype():
    mod = trace(lambda b, h, q, kv: (q * 3 + 1) > kv)
    assert all(n.dtype == torch.int32 for n in ir.toposort(mod.ir) if n.op in ("mul", "add"))
    half = trace(lambda s, b, h, q, kv: s * 2.5, score_dtype=torch.float16)
    assert uncast(half).dtype == torch.float16


def test_zero_dim_tensors_promote_like_tensors():
    t64 = torch.tensor(0.5, dtype=torch.float64)
    mod = check(lambda s, b, h, q, kv: s + t64)
    assert uncast(mod).dtype == torch.float64       # as under vmap: 0-d + 0-d -> promote_types
    mod = check(lambda b, h, q, kv: q + torch.tensor(2) > kv)
    assert any(n.dtype == torch.int64 for n in ir.toposort(mod.ir))


# ---------------------------------------------------------------------------------------------
# torch.where, torch functions, F functions, Tensor methods


WHERE_MODS = [
    lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
    lambda s, b, h, q, kv: torch.where(q >= kv, 1.0, 0.0),
    lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.tensor(-1e4)),
    lambda s, b, h, q, kv: torch.where(q > kv, q, kv * 0.5) + s,
    lambda s, b, h, q, kv: s.where(q >= kv, 0.0),
    lambda b, h, q, kv: torch.where(q >= kv, True, False),
    lambda b, h, q, kv: torch.where(q >= kv, kv > 3, False),
    lambda b, h, q, kv: torch.where(b == 0, q >= kv, q <= kv),
]


@pytest.mark.parametrize("fn", WHERE_MODS, ids=range(len(WHERE_MODS)))
def test_where(fn):
    check(fn)


def test_where_promotes_per_element():
    # Per element every value is 0-d, so where(c, float64 0-d, float16) is float64, as torch.where
    # gives on real 0-d tensors and as compiled flex_attention traces it. (Eager vmap differs: its
    # where batching rule lets the batched float16 branch win over an unbatched 0-d tensor.)
    t64 = torch.tensor(0.5, dtype=torch.float64)
    mod = trace(lambda s, b, h, q, kv: torch.where(q >= kv, t64, s), score_dtype=torch.float16)
    assert uncast(mod).dtype == torch.float64
    x = torch.tensor(1.0, dtype=torch.float16)
    assert torch.where(torch.tensor(True), t64, x).dtype == torch.float64


TORCH_FUNCS = [
    lambda s, b, h, q, kv: torch.abs(s) + torch.clamp(s, min=-1.0, max=2.0) + torch.clamp(q, max=4),
    lambda s, b, h, q, kv: torch.exp(-torch.abs(s)) + torch.exp2(s / 8) + torch.expm1(s / 8),
    lambda s, b, h, q, kv: torch.log(torch.abs(s) + 1) + torch.log2(q + 1) + torch.log1p(torch.abs(s)),
    lambda s, b, h, q, kv: torch.sqrt(torch.abs(s)) + torch.rsqrt(torch.abs(s) + 1) + torch.reciprocal(s),
    lambda s, b, h, q, kv: torch.sin(s) + torch.cos(q) + torch.tan(s / 8),
    lambda s, b, h, q, kv: torch.tanh(s) + torch.sigmoid(s) + torch.erf(s) + torch.special.expit(s),
    lambda s, b, h, q, kv: torch.floor(s) + torch.ceil(s) + torch.round(s) + torch.trunc(s) + torch.sign(s),
    lambda s, b, h, q, kv: torch.minimum(s, q * 0.5) + torch.maximum(s, torch.tensor(0.0)),
    lambda s, b, h, q, kv: torch.pow(s, 2) + torch.square(q) + torch.pow(2.0, s / 4),
    lambda s, b, h, q, kv: torch.remainder(s, 1.5) + torch.fmod(s, 1.5) + torch.fmod(q - kv, 3),
    lambda s, b, h, q, kv: torch.div(q - kv, 3, rounding_mode="trunc") + torch.div(q - kv, 3, rounding_mode="floor"),
    lambda s, b, h, q, kv: torch.div(s, 3, rounding_mode="trunc") + torch.div(s, 2) + torch.true_divide(q, 4),
    lambda s, b, h, q, kv: torch.floor_divide(kv - q, 4) + torch.add(s, q, alpha=2) + torch.sub(s, 1, alpha=3),
    lambda s, b, h, q, kv: torch.mul(s, 2) + torch.neg(s) + torch.max(s, q) - torch.min(s, kv),
    lambda s, b, h, q, kv: torch.where(torch.isnan(s) | torch.isinf(s) | ~torch.isfinite(s), 0.0, s),
    lambda s, b, h, q, kv: F.silu(s) + F.gelu(s) + F.gelu(s, approximate="tanh") + F.relu(s) + F.softplus(s),
    lambda s, b, h, q, kv: F.softplus(s, beta=2.0, threshold=5.0) + F.leaky_relu(s, 0.1) + F.hardtanh(s) + F.relu6(s),
    lambda s, b, h, q, kv: F.tanh(s) + F.sigmoid(s) + torch.relu(s - 1),
]


@pytest.mark.parametrize("fn", TORCH_FUNCS, ids=range(len(TORCH_FUNCS)))
def test_torch_functions(fn):
    check(fn)


TORCH_FUNC_MASKS = [
    lambda b, h, q, kv: torch.logical_and(q >= kv, kv > 2) | torch.logical_not(b == 0),
    lambda b, h, q, kv: torch.logical_or(q - kv, b) ^ torch.logical_xor(q > 3, kv),
    lambda b, h, q, kv: torch.bitwise_and(q, 3) == torch.bitwise_or(kv, 1),
    lambda b, h, q, kv: torch.bitwise_xor(q, kv) < torch.bitwise_left_shift(h, 1) + torch.bitwise_right_shift(q, 1),
    lambda b, h, q, kv: torch.bitwise_not(q > kv),
    lambda b, h, q, kv: torch.eq(q, kv) | torch.gt(q, 5) | torch.le(kv, 1) | torch.ne(b, 0) & torch.lt(h, 1),
    lambda b, h, q, kv: torch.ge(torch.abs(q - kv), 3),
]


@pytest.mark.parametrize("fn", TORCH_FUNC_MASKS, ids=range(len(TORCH_FUNC_MASKS)))
def test_torch_function_masks(fn):
    check(fn)


TENSOR_METHODS = [
    lambda s, b, h, q, kv: s.abs() + s.clamp(min=-1.0, max=1.0) + s.clamp(max=0.5) + s.clip(-2, 2),
    lambda s, b, h, q, kv: s.exp().clamp(max=100.0) + s.tanh() + s.sigmoid() + s.neg(),
    lambda s, b, h, q, kv: q.float() / 2 + kv.double() + q.to(torch.float16) + s.half().float(),
    lambda s, b, h, q, kv: (s * 4).int() + (s * 4).long() + s.to(torch.int32) + q.to(s),
    lambda s, b, h, q, kv: s + (q > kv).float() + (q > kv).int() + (q > kv).to(s.dtype) + q.type_as(s),
    lambda s, b, h, q, kv: s.to("cpu", torch.float64) + s.to(device=s.device) + s.clone().detach().contiguous(),
    lambda s, b, h, q, kv: s.floor() + s.ceil() + s.round() + s.trunc() + s.sign() + s.square() + s.pow(2),
    lambda s, b, h, q, kv: s.abs().sqrt() + (s.abs() + 1).log() + s.sin() + s.cos() + s.erf() + s.relu(),
    lambda s, b, h, q, kv: s.maximum(q * 0.5) + s.minimum(kv * 0.5) + s.add(1) + s.mul(2) + s.sub(q) + s.div(2),
    lambda s, b, h, q, kv: s + q.remainder(3) + q.floor_divide(2) + q.bitwise_and(3) + q.short() + q.char(),
]


@pytest.mark.parametrize("fn", TENSOR_METHODS, ids=range(len(TENSOR_METHODS)))
def test_tensor_methods(fn):
    check(fn)


def test_bool_method_and_logical_methods():
    check(lambda b, h, q, kv: (q - kv).bool() & q.ge(kv) & kv.lt(9) | q.eq(kv).logical_not().logical_and(b == 1))


# ---------------------------------------------------------------------------------------------
# Constants built inside a mod; tensor-like attributes of traced values


def test_new_ones_and_friends_are_constants():
    mods = [
        lambda b, h, q, kv: b.new_ones((), dtype=torch.bool) & (q >= kv),
        lambda b, h, q, kv: b.new_ones(size=(), dtype=torch.bool, device=b.device) & (q >= kv),  # torch's and_masks
        lambda b, h, q, kv: b.new_zeros((), dtype=torch.bool) | (q >= kv),
        lambda b, h, q, kv: b.new_full((), 3) < q,
        lambda b, h, q, kv: q.new_tensor(4) < kv,
        lambda b, h, q, kv: torch.ones_like(q) + torch.zeros_like(kv) + torch.full_like(q, 2) < kv,
        lambda b, h, q, kv: torch.ones_like(q, dtype=torch.bool) & (q >= kv),
        lambda b, h, q, kv: torch.tensor(2) + torch.tensor(1.5) + torch.scalar_tensor(1) < q,
        lambda b, h, q, kv: torch.ones(()) + torch.zeros([]) + torch.full((), 3) < kv,
        lambda b, h, q, kv: torch.tensor(3, dtype=torch.int32) + torch.tensor(True) < kv,
    ]
    for fn in mods:
        mod = check(fn)
        assert same(mod.buffers, ()) and ir.buffers_of(mod.ir) == [], mod


def test_numpy_scalars_are_weak_python_numbers():
    import numpy as np

    mod = check(lambda s, b, h, q, kv: s * np.float64(0.5) + (q + np.int64(3) > kv) * np.int64(2))
    assert uncast(mod).dtype == torch.float32


def test_new_ones_dtype_defaults_to_the_tensors():
    mod = trace(lambda b, h, q, kv: (b.new_ones(()) + q) > kv)
    assert all(n.dtype == torch.int32 for n in ir.toposort(mod.ir) if n.op == "const")


def test_constant_tensor_conversions_are_allowed():
    # A torch.tensor(number) made inside the mod is a known constant: Python may use its value.
    def mod(b, h, q_idx, kv_idx):
        n = int(torch.tensor(3))
        if torch.tensor(True):
            return q_idx - n >= kv_idx
        return q_idx < 0

    check(mod)


def test_proxy_tensor_attributes():
    seen = {}

    def mod(score, b, h, q_idx, kv_idx):
        seen.update(dtype=score.dtype, qdtype=q_idx.dtype, shape=q_idx.shape, ndim=q_idx.ndim,
                    dim=q_idx.dim(), numel=q_idx.numel(), size=q_idx.size(), device=score.device,
                    fp=score.is_floating_point(), traced=is_traced((score,)))
        return score

    trace(mod, score_dtype=torch.bfloat16)
    assert seen == dict(dtype=torch.bfloat16, qdtype=torch.int32, shape=torch.Size([]), ndim=0, dim=0,
                        numel=1, size=torch.Size([]), device=torch.device("cpu"), fp=True, traced=True)


def test_device_argument_is_what_proxies_report():
    seen = []
    trace(lambda b, h, q, kv: seen.append(q.device) or q >= kv, device="meta")
    assert seen == [torch.device("meta")]


# ---------------------------------------------------------------------------------------------
# Gathers from captured tensors

g = torch.Generator().manual_seed(0)
BIAS1 = torch.randn(Q, generator=g)
BIAS4 = torch.randn(B, H, Q, KV, generator=g)
BIAS3 = torch.randn(B, H, Q, generator=g)
DOC = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], dtype=torch.int32)  # KV entries
OFFSETS = torch.tensor([0, 3, 5, 9], dtype=torch.int64)
SCALE0 = torch.tensor(0.75)
SHIFT0 = torch.tensor(2, dtype=torch.int64)


def test_gather_1d_and_4d():
    mod = check(lambda s, b, h, q_idx, kv_idx: s + BIAS1[q_idx] + BIAS4[b, h, q_idx, kv_idx])
    assert mod.buffers[0] is BIAS1 and mod.buffers[1] is BIAS4
    assert [buf.name for buf in ir.buffers_of(mod.ir)] == ["BIAS1", "BIAS4"]


def test_chained_partial_indexing():
    mod = check(lambda s, b, h, q_idx, kv_idx: s + BIAS4[b][h][q_idx][kv_idx] + BIAS3[b, h][q_idx] + BIAS4[b][h, q_idx][kv_idx])
    assert same(mod.buffers, (BIAS4, BIAS3))  # deduplicated by identity, first-use order


def test_nested_and_clamped_gathers():
    def document(b, h, q_idx, kv_idx):
        q_doc = DOC[torch.clamp(q_idx, max=KV - 1)]
        same = q_doc == DOC[kv_idx]
        return same & (q_idx - OFFSETS[q_doc] >= kv_idx - OFFSETS[DOC[kv_idx]])

    mod = check(document)
    assert same(mod.buffers, (DOC, OFFSETS))
    check(lambda s, b, h, q_idx, kv_idx: s + BIAS1[(q_idx - kv_idx).abs().clamp(max=Q - 1)])
    check(lambda s, b, h, q_idx, kv_idx: s + BIAS1[(kv_idx * 3 + 1) % Q])
    check(lambda s, b, h, q_idx, kv_idx: s + BIAS1[q_idx, ])           # a 1-tuple index
    check(lambda s, b, h, q_idx, kv_idx: s + BIAS4[0, h, q_idx, -1])   # Python ints, negative wraps


def test_zero_dim_captures_are_buffer_reads_not_constants():
    def mod(score, b, h, q_idx, kv_idx):
        return score * SCALE0 + BIAS1[q_idx - SHIFT0]

    traced = check(mod)
    assert same(traced.buffers, (SCALE0, SHIFT0, BIAS1))  # first-use order
    loads = [n for n in ir.toposort(traced.ir) if n.op == "load"]
    assert any(n.arg.name == "SCALE0" and n.src == () for n in loads)
    # Changing the captured value changes the result without re-tracing, and the key stays.
    key = traced.key()
    before = traced_eval(traced, SCORE)
    old = SCALE0.item()
    try:
        SCALE0.fill_(2.0)
        after = traced_eval(traced, SCORE)
        assert trace(mod).key() == key
        torch.testing.assert_close(after, vmap_eval(mod, "score", SCORE))
    finally:
        SCALE0.fill_(old)
    assert not torch.equal(before, after)


def test_zero_dim_tensors_as_indices_and_scalars_without_a_proxy():
    # BIAS1[SHIFT0] and SHIFT0 * 2 involve no traced value: the trace mode still reads them lazily.
    mod = check(lambda s, b, h, q_idx, kv_idx: s + BIAS1[SHIFT0] + SHIFT0 * 2 + BIAS1[SHIFT0 + 1])
    assert {id(t) for t in mod.buffers} == {id(BIAS1), id(SHIFT0)}
    text = str(mod.ir)
    assert "BIAS1[SHIFT0]" in text and "BIAS1[(SHIFT0 + 1)]" in text and "(SHIFT0 * 2)" in text, text


def test_tensor_computed_inside_the_mod_is_captured():
    mod = check(lambda s, b, h, q_idx, kv_idx: s + torch.arange(Q, dtype=torch.float32)[q_idx] * 0.1)
    assert len(mod.buffers) == 1 and mod.buffers[0].shape == (Q,)
    assert ir.buffers_of(mod.ir)[0].name == "buf0"


def test_requires_grad_capture_is_recorded():
    w = torch.randn(H, requires_grad=True)
    mod = check(lambda s, b, h, q_idx, kv_idx: s + w[h])
    assert mod.buffers[0] is w and mod.buffers[0].requires_grad


def test_buffer_names_unique_valid_and_from_attributes():
    class Bias:
        def __init__(self):
            self.table = torch.randn(H)
            self._private = torch.randn(H)

        def __call__(self, score, b, h, q_idx, kv_idx):
            return score + self.table[h] + self._private[h]

    mod = check(Bias())
    assert [buf.name for buf in ir.buffers_of(mod.ir)] == ["table", "private"]

    t1, t2 = torch.randn(H), torch.randn(H)

    def first(score, b, h, q_idx, kv_idx):
        x = t1
        return score + x[h]

    def second(score, b, h, q_idx, kv_idx):
        x = t2
        return first(score, b, h, q_idx, kv_idx) + x[h]

    def reserved(score, b, h, q_idx, kv_idx):
        exp = t1
        return score + exp[h]

    names = [buf.name for buf in ir.buffers_of(trace(second).ir)]
    assert names == ["x", "x_1"]
    assert [buf.name for buf in ir.buffers_of(trace(reserved).ir)] == ["exp_buf"]


# ---------------------------------------------------------------------------------------------
# Python numbers are constants; closures, partials, bound methods, defaults


def test_python_numbers_are_constants_in_the_key():
    def make(window):
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= window

    assert trace(make(3)).key() == trace(make(3)).key()
    assert trace(make(3)).key() != trace(make(4)).key()
    check(make(3))


class Window:
    size = 4

    def mask(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < self.size)

    @staticmethod
    def static(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx


def test_callable_forms():
    def with_defaults(b, h, q_idx, kv_idx, window=3, scale=2.0):
        return q_idx - kv_idx < window * scale

    def shifted(score, b, h, q_idx, kv_idx, *, shift=1):
        return score + shift

    def generic(offset, b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    assert check(Window().mask).kind == "mask"
    assert check(Window.static).kind == "mask"
    assert check(with_defaults).kind == "mask"
    assert check(shifted).kind == "score"
    assert check(functools.partial(generic, 2)).kind == "mask"
    assert check(functools.partial(with_defaults, window=5)).kind == "mask"
    assert trace(functools.partial(generic, 2)).name == "generic"
    assert trace(Window().mask).name == "mask"
    assert trace(lambda b, h, q, kv: q >= kv, name="causal").name == "causal"
    assert check(lambda *args: args[2] >= args[3], kind="mask").kind == "mask"
    assert check(lambda score, *idx: score * 2, kind="score").kind == "score"


def test_source_is_recorded():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    assert trace(causal).source.startswith("def causal(b, h, q_idx, kv_idx):")


# ---------------------------------------------------------------------------------------------
# Mods calling mods: Python functions, torch's and ours and_masks/or_masks, Mods (inlining)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx <= 4


def test_mods_calling_mods_with_derived_indices():
    check(lambda b, h, q_idx, kv_idx: causal(b, h, q_idx - 3, kv_idx) & window(b, h, q_idx, kv_idx * 2))
    check(lambda s, b, h, q_idx, kv_idx: torch.where(causal(b, h, q_idx, kv_idx + SHIFT0), s, -math.inf))


@pytest.mark.parametrize("combine", [torch_flex.and_masks, torch_flex.or_masks,
                                     flexattn.and_masks, flexattn.or_masks])
def test_and_or_masks(combine):
    fn = combine(causal, window, lambda b, h, q_idx, kv_idx: DOC[kv_idx] == DOC[q_idx])
    mod = check(fn)
    assert same(mod.buffers, (DOC,))
    torch_mask = torch_flex.create_mask(fn, B, H, Q, KV, device="cpu")
    assert torch.equal(traced_eval(mod), torch_mask)


def test_inline_a_mod_remaps_buffers():
    inner = trace(lambda b, h, q_idx, kv_idx: DOC[q_idx % KV] == DOC[kv_idx])
    assert same(inner.buffers, (DOC,))

    def outer(b, h, q_idx, kv_idx):
        return (OFFSETS[DOC[kv_idx]] <= q_idx) & inner(b, h, q_idx + 1, kv_idx)

    mod = check(outer)
    assert same(mod.buffers, (DOC, OFFSETS))  # DOC (read first) deduplicated with the inner Mod's
    assert [b.index for b in ir.buffers_of(mod.ir)] == [0, 1]
    # inline() directly: the proxies' nodes replace the Mod's inputs.
    seen = []
    trace(lambda b, h, q_idx, kv_idx: seen.append(inline(inner, (b, h, kv_idx, q_idx))) or seen[0])
    assert isinstance(seen[0], Proxy) and str(seen[0].node) == "(DOC[(kv_idx % 13)] == DOC[q_idx])"


def test_inline_score_mod_and_python_number_arguments():
    bias = trace(lambda s, b, h, q_idx, kv_idx: s + BIAS4[b, h, q_idx, kv_idx])
    check(lambda s, b, h, q_idx, kv_idx: bias(s * 2, b, h, q_idx, kv_idx) + bias(1.0, 0, h, 2, kv_idx))
    half = trace(lambda s, b, h, q_idx, kv_idx: bias(s, b, h, q_idx, kv_idx), score_dtype=torch.float16)
    assert half.score_dtype == torch.float16 and half.ir.dtype == torch.float16
    assert same(half.buffers, (BIAS4,))


def test_inline_converts_arguments_to_the_mods_input_dtypes():
    # As the eager Mod.__call__ does: an int64 index becomes the Mod's int32 input.
    inner = trace(causal)
    mod = check(lambda b, h, q_idx, kv_idx: inner(b, h, q_idx + SHIFT0, kv_idx))
    assert str(mod.ir) == "(int32((int64(q_idx) + SHIFT0)) >= kv_idx)"


def test_is_traced():
    assert not is_traced((1, torch.zeros(()), "x"))
    seen = []
    trace(lambda b, h, q, kv: seen.append(is_traced((1, q))) or q >= kv)
    assert seen == [True]


# ---------------------------------------------------------------------------------------------
# Mods that are already traced; score_dtype; kind inference


def test_trace_of_a_mod():
    mod = trace(lambda s, b, h, q_idx, kv_idx: s * 2)
    assert trace(mod) is mod
    assert trace(mod, "score") is mod
    half = trace(mod, score_dtype=torch.float16)
    assert half is not mod and half.score_dtype == torch.float16 and half.ir.dtype == torch.float16
    assert trace(half, score_dtype=torch.float16) is half
    assert trace(mod, name="double").name == "double"
    mask = trace(causal)
    assert trace(mask, score_dtype=torch.float16) is mask
    with pytest.raises(ValueError, match="kind='score'"):
        trace(mask, "score")


def test_score_dtype_is_input_and_output_dtype():
    mod = trace(lambda s, b, h, q_idx, kv_idx: s + BIAS1[q_idx], score_dtype=torch.bfloat16)
    assert mod.score_dtype == torch.bfloat16 and mod.ir.dtype == torch.bfloat16
    assert uncast(mod).dtype == torch.float32  # bf16 score + f32 bias promotes, then casts back


def test_kind_inference_errors():
    with pytest.raises(TraceError, match=r"cannot tell whether mod '<lambda>'.*kind='score' or kind='mask'"):
        trace(lambda *args: args[0])
    with pytest.raises(TraceError, match=r"takes 3 required positional argument\(s\); a score_mod takes 5"):
        trace(lambda b, q, kv: q)
    with pytest.raises(TraceError, match=r"takes 6 required"):
        trace(lambda a, s, b, h, q, kv: q)
    with pytest.raises(TraceError, match=r"required keyword-only parameter 'scale'"):
        def f(b, h, q_idx, kv_idx, *, scale):
            return q_idx
        trace(f)
    with pytest.raises(TraceError, match="cannot read the signature"):
        trace(torch.maximum)
    with pytest.raises(ValueError, match="kind must be 'score', 'mask' or None, got 'bias'"):
        trace(causal, "bias")
    with pytest.raises(TypeError, match="score_dtype must be a floating-point torch.dtype, got torch.int32"):
        trace(causal, score_dtype=torch.int32)
    with pytest.raises(TypeError, match="expected a score_mod/mask_mod function or a Mod, got int"):
        trace(3)


# ---------------------------------------------------------------------------------------------
# Errors


def test_control_flow_error_names_mod_file_line_and_suggests_where():
    def branchy(b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return True
        return False

    with pytest.raises(TraceError) as e:
        trace(branchy)
    msg = str(e.value)
    assert "mask_mod 'branchy'" in msg and location(branchy, 1) in msg
    assert "if q_idx >= kv_idx:" in msg and "torch.where" in msg and "`(q_idx >= kv_idx)`" in msg
    assert isinstance(e.value, TypeError)


@pytest.mark.parametrize("body, what", [
    (lambda b, h, q, kv: q > 1 and kv > 1, "bool()"),
    (lambda b, h, q, kv: max(q, kv) > 2, "bool()"),
    (lambda b, h, q, kv: torch.tensor(math.exp(q)) > 1, "float()"),
    (lambda b, h, q, kv: int(q) > 1, "int()"),
    (lambda b, h, q, kv: [True, False][kv], "integer index"),
    (lambda b, h, q, kv: q.item() > 1, ".item()"),
    (lambda b, h, q, kv: len(q) > 1, "len()"),
    (lambda b, h, q, kv: [x for x in q], "iterated over"),
    (lambda b, h, q, kv: range(q), "integer index"),
])
def test_control_flow_errors(body, what):
    with pytest.raises(TraceError) as e:
        trace(body, "mask")
    msg = str(e.value)
    assert what in msg and "torch.where" in msg and "mask_mod '<lambda>'" in msg
    assert f"{__file__}:" in msg  # the line of this test file that holds the lambda


def test_error_location_is_the_inner_mod_line():
    def inner(b, h, q_idx, kv_idx):
        return bool(q_idx > 3)

    def outer(b, h, q_idx, kv_idx):
        return torch_flex.and_masks(causal, inner)(b, h, q_idx, kv_idx)

    with pytest.raises(TraceError) as e:
        trace(outer)
    assert "mask_mod 'outer'" in str(e.value) and location(inner, 1) in str(e.value)


def test_unsupported_torch_function_names_itself_and_lists_supported():
    def cum(score, b, h, q_idx, kv_idx):
        return torch.cumsum(score, 0)

    with pytest.raises(TraceError) as e:
        trace(cum)
    msg = str(e.value)
    assert "calls torch.cumsum on a traced value" in msg and location(cum, 1) in msg
    assert "torch.where" in msg and "torch.exp" in msg and "torch.nn.functional.gelu" in msg
    with pytest.raises(TraceError, match=r"calls torch.Tensor.cumsum"):
        trace(lambda s, b, h, q, kv: s.cumsum(0))
    with pytest.raises(TraceError, match=r"torch.max\(x\) / torch.max\(x, dim\).*torch.maximum"):
        trace(lambda s, b, h, q, kv: torch.max(s))
    with pytest.raises(TraceError, match=r"attribute .T of a traced value"):
        trace(lambda s, b, h, q, kv: s.T)
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        trace(lambda s, b, h, q, kv: s.nonsense)


@pytest.mark.parametrize("body, expected", [
    (lambda s, b, h, q, kv: s + BIAS1[q * 0.5], r"indexes captured tensor 'BIAS1' with the float32 value `\(float32\(q_idx\) \* 0.5\)`; indices must be integers"),
    (lambda s, b, h, q, kv: s + BIAS1[q > kv], r"indexes captured tensor 'BIAS1' with a bool traced value.*torch.where"),
    (lambda s, b, h, q, kv: s + BIAS1[True], r"with a Python bool"),
    (lambda s, b, h, q, kv: s + BIAS1[1:q], r"'BIAS1' with a slice"),
    (lambda s, b, h, q, kv: s + BIAS3[b, :, q], r"'BIAS3' with a slice"),
    (lambda s, b, h, q, kv: s + BIAS3[b, ..., q], r"'BIAS3' with `...`"),
    (lambda s, b, h, q, kv: s + BIAS3[b, None], r"'BIAS3' with None"),
    (lambda s, b, h, q, kv: s + BIAS3[b, 2.0], r"'BIAS3' with a float \(2.0\)"),
    (lambda s, b, h, q, kv: s + BIAS1[q, kv], r"'BIAS1' \(1 dims\) with 2 indices"),
    (lambda s, b, h, q, kv: s + BIAS3[b][h], r"captured tensor 'BIAS3' \(3 dims\) indexed with only 2 index\(es\).*BIAS3\[h, q_idx, kv_idx\]"),
    (lambda s, b, h, q, kv: torch.exp(BIAS3[b]), r"'BIAS3' \(3 dims\) indexed with only 1"),
    (lambda s, b, h, q, kv: BIAS3[b].float(), r"'BIAS3' \(3 dims\) indexed with only 1"),
    (lambda s, b, h, q, kv: s + BIAS3, r"combines captured tensor 'BIAS3' of shape \(2, 3, 11\) with a traced value"),
    (lambda s, b, h, q, kv: s[0], r"indexes a traced value"),
    (lambda s, b, h, q, kv: q * 2**40, r"constant 1099511627776 does not fit in int32"),
    (lambda s, b, h, q, kv: s + b.new_ones((2,)), r"new_ones with size \(2,\)"),
    (lambda s, b, h, q, kv: torch.round(s, decimals=2), r"torch.round\(decimals=2\)"),
    (lambda s, b, h, q, kv: torch.where(s > 0), r"torch.where\(cond, a, b\)"),
    (lambda s, b, h, q, kv: F.gelu(s, approximate="fast"), r"expected 'none' or 'tanh'"),
    (lambda s, b, h, q, kv: s + "x", r"uses a str \('x'\) as a value"),
    (lambda s, b, h, q, kv: ~s, r"needs an integer or bool operand, got float32"),
])
def test_error_messages(body, expected):
    with pytest.raises(TraceError, match=expected) as e:
        trace(body, "score")
    assert "score_mod '<lambda>'" in str(e.value) and f"{__file__}:" in str(e.value)


def test_result_errors():
    with pytest.raises(TraceError, match=r"mask_mod 'diff' must return a bool, but it returned a int32 value: `\(q_idx - kv_idx\)`"):
        def diff(b, h, q_idx, kv_idx):
            return q_idx - kv_idx
        trace(diff)
    with pytest.raises(TraceError, match=r"score_mod 'nothing' returned None; expected a float score value \(missing `return`\?\)"):
        def nothing(score, b, h, q_idx, kv_idx):
            score + 1
        trace(nothing)
    with pytest.raises(TraceError, match=r"returned tuple"):
        trace(lambda b, h, q, kv: (q, kv))


def test_captured_tensor_with_unsupported_dtype():
    c = torch.zeros(4, dtype=torch.complex64)
    with pytest.raises(TraceError, match=r"captured tensor of dtype torch.complex64"):
        trace(lambda s, b, h, q, kv: s + c[q])


def test_error_class_is_exported():
    assert flexattn.TraceError is TraceError and issubclass(TraceError, TypeError)
    assert flexattn.trace is trace


# ---------------------------------------------------------------------------------------------
# attention-gym style mods


def generate_sliding_window(window_size):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window_size)
    return sliding_window


def generate_prefix_lm(prefix_lengths):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_lengths[b]) | (q_idx >= kv_idx)
    return prefix_lm


def generate_doc_mask(document_id, offsets):
    def doc_mask(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        return same_doc & (q_logical >= kv_logical)
    return doc_mask


def generate_alibi_bias(num_heads):
    slopes = torch.exp2(-((torch.arange(num_heads, dtype=torch.float32) + 1) * 8.0 / num_heads))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


def generate_tanh_softcap(soft_cap, approx=False):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)
    return tanh_softcap


def generate_rel_bias(table, max_distance):
    def rel_bias(score, b, h, q_idx, kv_idx):
        rel = torch.clamp(kv_idx - q_idx, -max_distance, max_distance) + max_distance
        return score + table[h, rel]
    return rel_bias


DOC_IDS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3], dtype=torch.int32)
GYM_MASKS = [
    causal,
    generate_sliding_window(3),
    generate_prefix_lm(torch.tensor([2, 5])),
    generate_doc_mask(DOC_IDS, torch.tensor([0, 3, 5, 10])),
    torch_flex.and_masks(generate_sliding_window(4), generate_doc_mask(DOC_IDS, torch.tensor([0, 3, 5, 10]))),
    torch_flex.or_masks(generate_prefix_lm(torch.tensor([2, 5])), generate_sliding_window(2)),
    torch_flex.noop_mask,
    flexattn.noop_mask,
]
GYM_SCORES = [
    generate_alibi_bias(H),
    generate_tanh_softcap(5.0),
    generate_rel_bias(torch.randn(H, 9, generator=g), 4),
    lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -float("inf")),
]


@pytest.mark.parametrize("fn", GYM_MASKS, ids=lambda f: getattr(f, "__name__", "mask"))
def test_attention_gym_masks(fn):
    mod = trace(fn)
    assert torch.equal(traced_eval(mod).expand(B, H, Q, KV), torch_flex.create_mask(fn, B, H, Q, KV, device="cpu"))
    if fn not in (torch_flex.noop_mask, flexattn.noop_mask):  # vmap of a constant is unbatched
        check(fn)


@pytest.mark.parametrize("fn", GYM_SCORES, ids=lambda f: getattr(f, "__name__", "score"))
def test_attention_gym_scores(fn):
    mod = check(fn)
    # torch's create_mask on a score mod: where the score became -inf.
    want = torch_flex.create_mask(fn, B, H, Q, KV, device="cpu")
    assert torch.equal(~torch.isneginf(traced_eval(mod, torch.zeros(B, H, Q, KV))), want)


# ---------------------------------------------------------------------------------------------
# Property tests: random Python mods written with the constructs above

T_INT = torch.tensor([3, -2, 7, 0, 5, 1, -4], dtype=torch.int64)
T_INT2 = torch.randint(-3, 9, (H, 5), generator=g, dtype=torch.int32)
T_FLOAT2 = torch.randn(H, 5, generator=g)
T_FLOAT4 = torch.randn(B, H, Q, KV, generator=g).to(torch.float16)
T_BOOL = torch.tensor([True, False, True, True, False, False])
T_DOC = torch.tensor([0, 1, 1, 2, 0, 2, 1, 0, 2], dtype=torch.int32)
T_OFF = torch.tensor([4, -1, 2], dtype=torch.int64)
T0_INT = torch.tensor(3, dtype=torch.int64)
T0_IDX = torch.tensor(2, dtype=torch.int32)
T0_F64 = torch.tensor(0.375, dtype=torch.float64)


def _shifted_causal(b, h, q_idx, kv_idx):
    return q_idx - 2 >= kv_idx


INNER_MOD = trace(lambda b, h, q_idx, kv_idx: T_BOOL[(q_idx + kv_idx) % 6] | (b == h))


@st.composite
def int_exprs(draw, depth):
    """(text, fn(env) -> int-valued traced/tensor value); magnitudes stay far below int32 limits."""
    c = st.integers(-3, 3)
    nz = st.sampled_from([-3, -2, 2, 3])
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        leaf = draw(st.sampled_from(["b", "h", "q", "kv", "T0_INT", "tensor", "T_INT[T0_IDX]"]))
        if leaf == "T0_INT":
            return "T0_INT", lambda e: T0_INT
        if leaf == "tensor":
            v = draw(c)
            return f"torch.tensor({v})", lambda e: torch.tensor(v)
        if leaf == "T_INT[T0_IDX]":
            return leaf, lambda e: T_INT[T0_IDX]
        return leaf, lambda e, leaf=leaf: e[leaf]
    sub = lambda: draw(int_exprs(depth - 1))  # noqa: E731
    kind = draw(st.integers(0, 20))
    (ta, a) = sub()
    if kind == 0:
        (tb, b) = sub()
        return f"({ta} + {tb})", lambda e: a(e) + b(e)
    if kind == 1:
        (tb, b) = sub()
        return f"({ta} - {tb})", lambda e: a(e) - b(e)
    if kind == 2:
        k = draw(c)
        return f"({ta} * {k})", lambda e: a(e) * k
    if kind == 3:
        k = draw(c)
        return f"({k} - {ta})", lambda e: k - a(e)
    if kind == 4:
        k = draw(nz)
        return f"({ta} // {k})", lambda e: a(e) // k
    if kind == 5:
        k = draw(nz)
        return f"({ta} % {k})", lambda e: a(e) % k
    if kind == 6:
        k, mode = draw(nz), draw(st.sampled_from(["trunc", "floor"]))
        return f"torch.div({ta}, {k}, rounding_mode={mode!r})", lambda e: torch.div(a(e), k, rounding_mode=mode)
    if kind == 7:
        k = draw(nz)
        return f"torch.fmod({ta}, {k})", lambda e: torch.fmod(a(e), k)
    if kind == 8:
        return f"abs({ta})", lambda e: abs(a(e))
    if kind == 9:
        (tb, b) = sub()
        f = draw(st.sampled_from([torch.minimum, torch.maximum]))
        return f"torch.{f.__name__}({ta}, {tb})", lambda e: f(a(e), b(e))
    if kind == 10:
        lo = draw(st.integers(-4, 2))
        return f"{ta}.clamp(min={lo}, max={lo + 6})", lambda e: a(e).clamp(min=lo, max=lo + 6)
    if kind == 11:
        (tc, cond), (tb, b) = draw(bool_exprs(depth - 1)), sub()
        return f"torch.where({tc}, {ta}, {tb})", lambda e: torch.where(cond(e), a(e), b(e))
    if kind == 12:
        k = draw(c)
        (tc, cond) = draw(bool_exprs(depth - 1))
        return f"torch.where({tc}, {ta}, {k})", lambda e: torch.where(cond(e), a(e), k)
    if kind == 13:
        return f"T_INT[{ta} % 7]", lambda e: T_INT[a(e) % 7]
    if kind == 14:
        return f"T_INT2[h][{ta} % 5]", lambda e: T_INT2[e["h"]][a(e) % 5]
    if kind == 15:
        return f"T_OFF[T_DOC[{ta} % 9]]", lambda e: T_OFF[T_DOC[a(e) % 9]]
    if kind == 16:
        return f"{ta}.long()", lambda e: a(e).long()
    if kind == 17:
        return f"({ta}.float() * 0.5).floor().int()", lambda e: (a(e).float() * 0.5).floor().int()
    if kind == 18:
        return f"torch.round({ta} / 2).long()", lambda e: torch.round(a(e) / 2).long()
    if kind == 19:
        return f"({ta} + T0_INT)", lambda e: a(e) + T0_INT
    return f"(-{ta})", lambda e: -a(e)


@st.composite
def bool_exprs(draw, depth):
    if depth == 0 or draw(st.integers(0, 4)) == 0:
        (ta, a), (tb, b) = draw(int_exprs(0)), draw(int_exprs(0))
        op = draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))
        return f"({ta} {op} {tb})", lambda e: _compare(op, a(e), b(e))
    kind = draw(st.integers(0, 11))
    if kind <= 2:
        (ta, a), (tb, b) = draw(int_exprs(depth - 1)), draw(int_exprs(depth - 1))
        op = draw(st.sampled_from(["<", "<=", ">", ">=", "==", "!="]))
        return f"({ta} {op} {tb})", lambda e: _compare(op, a(e), b(e))
    if kind == 3:
        (ta, a) = draw(int_exprs(depth - 1))
        k = draw(st.integers(-3, 8))
        return f"({k} <= {ta})", lambda e: k <= a(e)
    (ta, a), (tb, b) = draw(bool_exprs(depth - 1)), draw(bool_exprs(depth - 1))
    if kind == 4:
        return f"({ta} & {tb})", lambda e: a(e) & b(e)
    if kind == 5:
        return f"({ta} | {tb})", lambda e: a(e) | b(e)
    if kind == 6:
        return f"({ta} ^ ~{tb})", lambda e: a(e) ^ ~b(e)
    if kind == 7:
        f = draw(st.sampled_from([torch.logical_and, torch.logical_or, torch.logical_xor]))
        return f"torch.{f.__name__}({ta}, {tb})", lambda e: f(a(e), b(e))
    if kind == 8:
        (ti, i) = draw(int_exprs(depth - 1))
        return f"(T_BOOL[{ti} % 6] & {ta})", lambda e: T_BOOL[i(e) % 6] & a(e)
    if kind == 9:
        (ti, i) = draw(int_exprs(depth - 1))
        return (f"_shifted_causal(b, h, {ti}, kv)",
                lambda e: _shifted_causal(e["b"], e["h"], i(e), e["kv"]))
    if kind == 10:
        return f"(True & {ta} | False)", lambda e: True & a(e) | False
    (ti, i) = draw(int_exprs(depth - 1))
    return f"INNER_MOD(b, h, {ti}, kv)", lambda e: INNER_MOD(e["b"], e["h"], i(e), e["kv"])


_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
            "!=": operator.ne}


def _compare(op, a, b):
    return _COMPARE[op](a, b)


@st.composite
def float_exprs(draw, depth):
    if depth == 0 or draw(st.integers(0, 4)) == 0:
        leaf = draw(st.sampled_from(["s", "s", "T0_F64", "T_FLOAT2", "T_FLOAT4", "tensor", "int"]))
        if leaf == "s":
            return "s", lambda e: e["s"]
        if leaf == "T0_F64":
            return "T0_F64", lambda e: T0_F64
        if leaf == "T_FLOAT2":
            (ti, i) = draw(int_exprs(1))
            return f"T_FLOAT2[h][{ti} % 5]", lambda e: T_FLOAT2[e["h"]][i(e) % 5]
        if leaf == "T_FLOAT4":
            return "T_FLOAT4[b, h, q, kv]", lambda e: T_FLOAT4[e["b"], e["h"], e["q"], e["kv"]]
        if leaf == "tensor":
            return "torch.tensor(1.5)", lambda e: torch.tensor(1.5)
        (ti, i) = draw(int_exprs(1))
        return f"({ti}).float()", lambda e: i(e).float()
    (ta, a) = draw(float_exprs(depth - 1))
    kind = draw(st.integers(0, 16))
    if kind == 0:
        (tb, b) = draw(float_exprs(depth - 1))
        return f"({ta} + {tb})", lambda e: a(e) + b(e)
    if kind == 1:
        (tb, b) = draw(float_exprs(depth - 1))
        return f"({ta} * {tb})", lambda e: a(e) * b(e)
    if kind == 2:
        return f"(2.0 - {ta} * 0.5)", lambda e: 2.0 - a(e) * 0.5
    if kind == 3:
        return f"(1.0 / (1.0 + {ta}.abs()))", lambda e: 1.0 / (1.0 + a(e).abs())
    if kind == 4:
        return f"({ta} / 3)", lambda e: a(e) / 3
    if kind == 5:
        f = draw(st.sampled_from([torch.tanh, torch.sigmoid, torch.erf, torch.sin, F.silu, F.relu]))
        return f"{f.__name__}({ta})", lambda e: f(a(e))
    if kind == 6:
        return f'F.gelu({ta}, approximate="tanh")', lambda e: F.gelu(a(e), approximate="tanh")
    if kind == 7:
        return f"torch.exp(-{ta}.abs())", lambda e: torch.exp(-a(e).abs())
    if kind == 8:
        return f"torch.sqrt({ta}.abs())", lambda e: torch.sqrt(a(e).abs())
    if kind == 9:
        return f"{ta}.clamp(min=-1.0, max=2.0)", lambda e: a(e).clamp(min=-1.0, max=2.0)
    if kind == 10:
        (tc, cond) = draw(bool_exprs(depth - 1))
        return f'torch.where({tc}, {ta}, -float("inf"))', lambda e: torch.where(cond(e), a(e), -float("inf"))
    if kind == 11:
        # Both branches float32: vmap's where promotes an unbatched 0-d branch as a weak value
        # (see test_where_promotes_per_element), so mixed-dtype branches are tested there.
        (tc, cond), (tb, b) = draw(bool_exprs(depth - 1)), draw(float_exprs(depth - 1))
        return (f"torch.where({tc}, {ta}.float(), {tb}.float())",
                lambda e: torch.where(cond(e), a(e).float(), b(e).float()))
    if kind == 12:
        (tb, b) = draw(float_exprs(depth - 1))
        return f"torch.maximum({ta}, {tb})", lambda e: torch.maximum(a(e), b(e))
    if kind == 13:
        return f"({ta}.clamp(-3, 3) ** 2)", lambda e: a(e).clamp(-3, 3) ** 2
    if kind == 14:
        return f"F.softplus({ta})", lambda e: F.softplus(a(e))
    if kind == 15:
        return f"{ta}.half().float()", lambda e: a(e).half().float()
    (ti, i) = draw(int_exprs(depth - 1))
    return f"({ta} + {ti} * 0.25)", lambda e: a(e) + i(e) * 0.25


def _as_mask(text, fn):
    def mod(b, h, q, kv):
        return fn(dict(b=b, h=h, q=q, kv=kv))
    mod.__name__ = "random_mask"
    mod.text = text
    return mod


def _as_score(text, fn):
    def mod(s, b, h, q, kv):
        return fn(dict(s=s, b=b, h=h, q=q, kv=kv))
    mod.__name__ = "random_score"
    mod.text = text
    return mod


PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(bool_exprs(3))
def test_random_python_masks_match_vmap(expr):
    mod = _as_mask(*expr)
    traced = check(mod)
    note = expr[0]
    assert torch.equal(traced_eval(traced).expand(B, H, Q, KV),
                       torch_flex.create_mask(mod, B, H, Q, KV, device="cpu")), note


@PROPERTY
@given(float_exprs(3))
def test_random_python_scores_match_vmap(expr):
    check(_as_score(*expr))


@PROPERTY
@given(st.one_of(testing.mask_irs(in_range_gathers=True).map(lambda c: ("mask",) + c),
                 testing.score_irs(in_range_gathers=True).map(lambda c: ("score",) + c)))
def test_ir_to_python_round_trip(case):
    """IR -> Python source (testing.python_mod) -> trace: the same values as the IR and as vmap."""
    kind, node, buffers = case
    fn = testing.python_mod(node, buffers, kind)
    mod = check(fn)
    want = testing.eval_grid(node, buffers, B, H, Q, KV, SCORE if kind == "score" else None)
    got = traced_eval(mod, SCORE)
    if kind == "mask":
        assert torch.equal(got.expand_as(want), want)
    else:
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-5, equal_nan=True)
