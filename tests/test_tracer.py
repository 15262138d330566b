"""Tracer: Python mods -> IR, checked against the same mods run eagerly under torch.vmap.

The oracle is torch's own semantics: every traced mod is evaluated by `ir.evaluate` on an index
grid and compared with the Python mod vmapped over (b, h, q_idx, kv_idx) exactly as
torch.nn.attention.flex_attention does (int32 indices, 0-d values per element), including the
result dtype before the score cast.
"""

from __future__ import annotations

import functools
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import ir, masks
from flexattn.tracer import Proxy, TraceError, inline, is_traced, trace
from helpers.tracing import B, BIAS1, BIAS3, BIAS4, H, KV, Q, SCORE, causal, check, traced_eval, uncast, vmap_eval



def same(tensors, expected) -> bool:
    """The same tensor objects in the same order."""
    return len(tensors) == len(expected) and all(a is b for a, b in zip(tensors, expected))


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


# torch's other names for the same functions (each is its own entry of the handler table)
TORCH_ALIASES = [
    lambda s, b, h, q, kv: torch.subtract(s, q) + s.subtract(kv, alpha=2) + torch.multiply(s, 3) + s.multiply(q),
    lambda s, b, h, q, kv: torch.sgn(s) + s.sgn() * 2 + torch.where(torch.isposinf(s / (q - kv)), 1.0, 0.0)
    + torch.where(s.isposinf(), 5.0, 0.0),
    lambda b, h, q, kv: torch.greater(q, kv) ^ torch.greater_equal(kv, 3) ^ torch.less_equal(q, 5) ^ torch.not_equal(b, h),
    lambda b, h, q, kv: q.greater(4) ^ q.greater_equal(kv + 1) ^ q.less_equal(kv - 2) ^ kv.not_equal(2),
]


@pytest.mark.parametrize("fn", TORCH_ALIASES, ids=range(len(TORCH_ALIASES)))
def test_torch_function_aliases(fn):
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


def test_tensor_of_a_traced_value_is_that_value():
    # torch.tensor(t) copies t with its dtype; per element that is the traced value itself.
    copied = trace(lambda b, h, q_idx, kv_idx: torch.tensor(q_idx) >= kv_idx)
    assert copied.key() == trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).key()
    as_float = trace(lambda b, h, q_idx, kv_idx: torch.tensor(q_idx, dtype=torch.float64) > 0.5)
    assert ir.to_text(as_float.ir) == ir.to_text(trace(lambda b, h, q_idx, kv_idx: q_idx.double() > 0.5).ir)


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


def test_inline_keeps_a_float64_score_at_float64():
    # As the eager Mod.__call__ and torch's flex_attention with the same outer mod: a float32-traced
    # Mod called on a float64 score computes at float64 (casting the score to float32 was 2e-7 off).
    inner = trace(lambda s, b, h, q_idx, kv_idx: s * 3 + 1)
    mod = trace(lambda s, b, h, q_idx, kv_idx: inner(s, b, h, q_idx, kv_idx) - 1, score_dtype=torch.float64)
    assert str(mod.ir) == "(((score * 3.0) + 1.0) - 1.0)"
    score = torch.tensor([1 + 2**-40, math.pi], dtype=torch.float64)
    idx = torch.zeros(2, dtype=torch.int32)
    assert torch.equal(mod(score, idx, idx, idx, idx), score * 3 + 1 - 1)


def test_retyped_mod_takes_python_constants_at_the_new_score_dtype():
    # torch computes score * 0.1 at float64 for a float64 score, with 0.1 itself (not float32's
    # 0.10000000149...); float(q_idx) * 0.3 stays float32 in torch, so its 0.3 does too.
    def fn(s, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, s * 0.1, s - 0.7) + (q_idx - kv_idx) * 0.3
    wide = trace(trace(fn), score_dtype=torch.float64)
    assert str(wide.ir) == str(trace(fn, score_dtype=torch.float64).ir)
    assert "0.10000000149011612" not in str(wide.ir) and "0.699999988079071" not in str(wide.ir)
    outer = trace(lambda s, b, h, q_idx, kv_idx: trace(fn)(s, b, h, q_idx, kv_idx), score_dtype=torch.float64)
    assert outer.ir is wide.ir  # (inlined into a float64 mod: the same)


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


def test_tracing_a_ready_made_mask_keeps_none_of_the_callers_tensors_alive():
    """A mod of flexattn's own runs in no frame of the caller's, so tracing it reads none of the
    caller's locals: CPython up to 3.12 keeps the snapshot of a frame's locals made by reading
    them until they are read again, which would keep this step's tensors of a training loop alive
    for as long as the loop runs."""
    ids = torch.tensor([0, 0, 1, 1, 1])
    batch = torch.randn(8)
    alive = weakref.ref(batch)
    mod = flexattn.trace(masks.document(ids), "mask")
    del batch
    assert alive() is None
    # (the mask reads the ids' int32 ranks: the same documents)
    same = flexattn.create_mask(mod, 1, 1, 5, 5, device="cpu")[0, 0]
    assert torch.equal(same, ids[:, None] == ids[None, :])
