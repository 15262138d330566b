"""Tracer on whole mods: attention-gym style mods and random Python mods, against torch's vmap.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from helpers import testing
from flexattn.tracer import trace
from helpers.tracing import B, H, KV, Q, SCORE, causal, check, g, traced_eval


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
