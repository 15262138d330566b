"""Affine score_mods (flexattn/codegen/affine.py): which mods have the form S score + K kv_idx +
Q q_idx + C with coefficients of b and h, that the coefficients reproduce the mod, and that the
forward's SCORE_AFFINE path (the Triton template on the interpreter; the Gluon kernels in
test_*_hopper_gpu.py) gives the float64 result, LSE and row max included.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexattn import call, ir, tracer
from flexattn.attention import flex_attention
from flexattn.auxiliary import AuxRequest
from flexattn.codegen import affine, emit
from flexattn.kernels import launch, plans
from flexattn.mods import SCORE, Mod
from flexattn.reference import attention_reference
from helpers import testing
from test_forward import check, make_block_mask, make_qkv

H = 4
SLOPES = torch.exp2(-8.0 * (torch.arange(H, dtype=torch.float32) + 1) / H)
TEMP = torch.tensor([1.5, -0.5, 2.0, 0.25])
BIAS_BF16 = torch.tensor([0.5, -1.25, 3.0, 0.0], dtype=torch.bfloat16)
BATCH_BIAS = torch.tensor([[0.1, 0.2, -0.3, 0.4], [-1.0, 0.5, 0.0, 2.0]])
REL = torch.randn(H, 64)
OFFSET = torch.tensor([3, -7, 0, 12], dtype=torch.int32)
NEG = torch.tensor([0.0, -math.inf, 0.5, 0.0])


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN (tests/conftest.py)."""


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def tempered_bias(score, b, h, q_idx, kv_idx):
    return score * TEMP[h] + BIAS_BF16[h] + 0.01 * (q_idx - 2 * kv_idx) - BATCH_BIAS[b, h]


def integer_distance(score, b, h, q_idx, kv_idx):
    return (score - (3 * kv_idx - q_idx + h) / 8) / 2


def _mod(fn):
    return tracer.trace(fn, SCORE, score_dtype=torch.float32, device=torch.device("cpu"))


# -- which mods have the form ------------------------------------------------------------------

AFFINE = [alibi, tempered_bias, integer_distance,
          lambda s, b, h, q, k: s,
          lambda s, b, h, q, k: s * 0.5 - h,
          lambda s, b, h, q, k: s + (k - q).float() * SLOPES[h] + SLOPES[b]]
NOT_AFFINE = {
    "product of positions": lambda s, b, h, q, k: s + q * k * 1e-3,
    "where": lambda s, b, h, q, k: torch.where(q >= k, s, s * 0.5),
    "tanh": lambda s, b, h, q, k: 30 * torch.tanh(s / 30),
    "square of the score": lambda s, b, h, q, k: s * s,
    "gather at a position": lambda s, b, h, q, k: s + REL[h, (k - q) % 64],
    "bfloat16 product": lambda s, b, h, q, k: s + BIAS_BF16[h] * (k - q),
    "no score": lambda s, b, h, q, k: SLOPES[h] * (k - q),
    "integer division": lambda s, b, h, q, k: s + (k - q) // 2,
    "score truncated": lambda s, b, h, q, k: s.to(torch.int32).to(torch.float32) + k,
}


def _coefficients(form: affine.Affine, buffers, b: int, h: int) -> list[float]:
    env = {"b": torch.tensor(b, dtype=torch.int32), "h": torch.tensor(h, dtype=torch.int32)}
    return [ir.evaluate(n, env, buffers).double().item() for n in form.nodes()]


def _assert_reproduces(mod: Mod, form: affine.Affine, B: int, Hn: int, L: int) -> None:
    """S score + K kv + Q q + C against the mod in float64, on every (b, h, q, kv) of a grid."""
    score = testing.random_score(B, Hn, L, L, torch.float64, seed=3) * 4
    b, h, q, kv = testing.index_grid(B, Hn, L, L)
    want = testing.reference_fp64(mod.ir, mod.buffers, B, Hn, L, L, score=score)
    coef = torch.tensor([[_coefficients(form, mod.buffers, i, j) for j in range(Hn)] for i in range(B)],
                        dtype=torch.float64)[:, :, None, None, :]
    got = coef[..., 0] * score + coef[..., 1] * kv + coef[..., 2] * q + coef[..., 3]
    scale = 1.0 + want.abs()
    assert ((got - want).abs() / scale).max().item() < 1e-5, f"{mod.source}: {form}"


@pytest.mark.parametrize("fn", AFFINE, ids=range(len(AFFINE)))
def test_affine_forms_are_recognised_with_their_coefficients(fn):
    mod = _mod(fn)
    form = affine.split(mod.ir)
    assert form is not None
    _assert_reproduces(mod, form, 2, H, 40)
    source = emit.emit_mod(mod.ir, mod.kind)
    assert source.affine and "def score_mod_affine(b, h" in source.source


def test_alibi_coefficients_cancel_exactly():
    """K + Q == 0 for ALiBi, so w(q_idx) holds no absolute position (see affine.py)."""
    form = affine.split(_mod(alibi).ir)
    for h in range(H):
        s, k, q, c = _coefficients(form, (SLOPES,), 0, h)
        assert (s, k + q, c) == (1.0, 0.0, 0.0) and k == SLOPES[h].item()


@pytest.mark.parametrize("name", list(NOT_AFFINE))
def test_other_mods_are_not_affine(name):
    mod = _mod(NOT_AFFINE[name])
    assert affine.split(mod.ir) is None and not emit.emit_mod(mod.ir, mod.kind).affine


@pytest.mark.parametrize("fn, exact_at, wraps_at", [
    (lambda s, b, h, q, k: s + (k - q).float(), 2**30 - 1, None),  # (a bound of 2 x the length)
    (lambda s, b, h, q, k: s + (1000 * k - q).float(), 2**31 // 1001, 2**31 // 1000 + 1),
    (lambda s, b, h, q, k: s + (k * 64 * 64 * 64 * 64 * 64).float() * 1e-9, 1, 2),
    (lambda s, b, h, q, k: s + (3 * k - q + h).float(), (2**31 - 1 - 2**16) // 4, 2**31 // 3),
    (lambda s, b, h, q, k: s + ((k.to(torch.int64) * 2**40).to(torch.int32)).float(), None, 1),
    (lambda s, b, h, q, k: s + (k + OFFSET[h]).float(), None, 1),  # a gathered integer: unbounded
], ids=["distance", "factor", "chained_factors", "heads", "narrowing", "gathered_offset"])
def test_integer_terms_are_exact_only_below_the_length_where_they_cannot_wrap(fn, exact_at, wraps_at):
    """The split form does not wrap where the mod's int32 arithmetic would: the kernels take it
    only for lengths where no integer value can leave its dtype (`Affine.exact_below`, a bound that
    may be conservative but never promises a length where the mod wraps)."""
    form = affine.split(_mod(fn).ir)
    assert form is not None
    if exact_at is not None:
        assert form.exact_below(exact_at)
    if wraps_at is not None:
        assert not form.exact_below(wraps_at)


def test_shifts_are_not_affine():
    assert affine.split(_mod(lambda s, b, h, q, k: s + (k << 2).float()).ir) is None


@st.composite
def affine_trees(draw):
    """Random affine score_mods over b, h, positions, a per-head table and constants."""
    table = ir.Buffer(0, "t", torch.float32, 1)

    def coefficient(depth):
        kind = draw(st.sampled_from(["const", "table", "h", "b"] + ["sum"] * (depth > 0)))
        if kind == "const":
            return ir.const(draw(st.sampled_from([0.5, -1.0, 3.0, 0.125, -0.01])))
        if kind == "table":
            return ir.load(table, [ir.input_("h")])
        if kind in ("h", "b"):
            return ir.cast(ir.input_(kind), torch.float32)
        return ir.binary("add", coefficient(depth - 1), coefficient(depth - 1))

    def position_term():
        # integer arithmetic on the positions (small constant factors), then a float coefficient
        q, k = ir.input_("q_idx"), ir.input_("kv_idx")
        a, c = draw(st.integers(-3, 3)), draw(st.integers(-3, 3))
        t = ir.binary("add", ir.binary("mul", k, a), ir.binary("mul", q, c))
        t = ir.cast(ir.binary("sub", t, draw(st.integers(-5, 5))), torch.float32)
        if draw(st.booleans()):
            return ir.binary("truediv", t, draw(st.sampled_from([2.0, 8.0, 3.0])))
        return ir.binary("mul", coefficient(1), t)

    node = ir.binary("mul", ir.input_("score"), coefficient(1)) if draw(st.booleans()) else ir.input_("score")
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["add", "sub"]))
        node = ir.binary(op, node, position_term() if draw(st.booleans()) else coefficient(1))
    if draw(st.booleans()):
        node = ir.unary("neg", node)
    return node


@settings(max_examples=60, deadline=None)
@given(tree=affine_trees())
def test_random_affine_mods_split_into_coefficients_that_reproduce_them(tree):
    mod = Mod(SCORE, tree, (torch.tensor([0.3, -2.0, 1.0, 0.75]),))
    form = affine.split(tree)
    assert form is not None, mod.source
    _assert_reproduces(mod, form, 2, H, 24)


# -- the forward's SCORE_AFFINE path on the interpreter -----------------------------------------


def _fresh() -> None:
    """Forget known calls and plans: a known call reuses its plan without planning again, so
    `_took_affine_path` would see no plan (and a patched `launch.affine_scores` would not run)."""
    call.forget()
    plans.FORWARD.plans.clear()


def _took_affine_path() -> bool:
    kernels = [p.kernel for p in plans.FORWARD.plans.values() if getattr(p, "kernel", None) is not None]
    assert kernels, "no forward plan was made since _fresh()"
    return any(k.constexprs.get("SCORE_AFFINE") for k in kernels)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fn, scale", [(alibi, None), (tempered_bias, -0.2), (integer_distance, 0.3)],
                         ids=["alibi", "tempered_bias", "integer_distance"])
def test_forward_takes_the_affine_form(fn, scale, dtype):
    """Lengths that are not multiples of the tiles, GQA, a causal block mask, LSE and row max."""
    _fresh()
    q, k, v = make_qkv(2, H, 2, 77, 131, 32, 32, dtype, seed=5)
    bm = make_block_mask(causal, None, None, 77, 131, 32)
    check(q, k, v, score_mod=fn, block_mask=bm, enable_gqa=True, scale=scale)
    assert _took_affine_path()
    _, aux = flex_attention(q, k, v, score_mod=fn, block_mask=bm, enable_gqa=True, scale=scale,
                            kernel_options={"FORCE_USE_FLEX_ATTENTION": True},
                            return_aux=AuxRequest(max_scores=True))
    scores = _reference_scores(q, k, fn, scale or 1 / math.sqrt(32))
    want = scores.masked_fill(~causal(0, 0, *torch.meshgrid(torch.arange(77), torch.arange(131), indexing="ij")),
                              -math.inf).amax(-1)
    torch.testing.assert_close(aux.max_scores.double(), want, atol=1e-3, rtol=1e-5)


def _reference_scores(q, k, fn, scale):
    """The modified scores in float64 (query heads over a KV head group, as enable_gqa)."""
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    b, h, i, j = testing.index_grid(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return fn(s, b, h, i, j).double()


def test_direct_and_affine_forms_agree(monkeypatch):
    """The same calls with SCORE_AFFINE off (the mod evaluated per score): as close to float64."""
    q, k, v = make_qkv(1, H, H, 100, 100, 16, 16, torch.float16, seed=9)
    opts = {"FORCE_USE_FLEX_ATTENTION": True}
    ref, ref_lse = attention_reference(q, k, v, score_mod=tempered_bias, return_lse=True)
    errors = []
    for on in (True, False):
        if not on:
            monkeypatch.setattr(launch, "affine_scores", lambda score, dtype, length: False)
        _fresh()
        out, lse = flex_attention(q, k, v, score_mod=tempered_bias, return_lse=True, kernel_options=opts)
        assert _took_affine_path() == on
        errors.append(((out.double() - ref).abs().max().item(), (lse.double() - ref_lse).abs().max().item()))
    (out_affine, lse_affine), (out_direct, lse_direct) = errors
    assert out_affine <= 1.25 * out_direct + 1e-4 and lse_affine <= 1e-5, errors


def test_float8_inputs_take_the_affine_form():
    """float8 Q, K, V with descales (folded into the form's score factor) against float64
    attention of the dequantised inputs."""
    q, k, v = (t * s for t, s in zip(make_qkv(2, H, 2, 77, 131, 32, 32, torch.float32, seed=2), (1.0, 1.0, 3.0)))
    (q8, dq), (k8, dk), (v8, dv) = (testing.quantise_fp8(t) for t in (q, k, v))
    bm = make_block_mask(causal, None, None, 77, 131, 32)
    _fresh()
    out = flex_attention(q8, k8, v8, score_mod=alibi, block_mask=bm, enable_gqa=True, descale_q=dq,
                         descale_k=dk, descale_v=dv, kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
    assert _took_affine_path()
    ref = attention_reference(*(testing.dequantised(t, d) for t, d in ((q8, dq), (k8, dk), (v8, dv))),
                              score_mod=alibi, block_mask=bm, enable_gqa=True)
    assert (out.double() - ref).abs().max().item() <= 0.06 * ref.abs().max().item()


def test_lengths_where_an_integer_could_wrap_keep_the_direct_path():
    """kv_idx * 2^24 fits int32 below 128 positions: the affine form at 100, the mod's own
    arithmetic at 131 (where the mod's int32 product wraps, and the kernel must wrap with it)."""
    def scaled(score, b, h, q_idx, kv_idx):
        return score + (kv_idx * 64 * 64 * 64 * 64).float() * 1e-7

    for length, affine_path in ((100, True), (131, False)):
        q, k, v = make_qkv(1, 2, 2, length, length, 16, 16, torch.bfloat16, seed=length)
        _fresh()
        check(q, k, v, score_mod=scaled)
        assert _took_affine_path() == affine_path


def test_prescaled_q_takes_the_affine_form():
    q, k, v = make_qkv(2, H, H, 70, 90, 32, 32, torch.bfloat16, seed=6)
    _fresh()
    check(q, k, v, score_mod=tempered_bias, kernel_options={"PRESCALE_QK": True}, factor=3.0)
    assert _took_affine_path()


def test_a_minus_inf_constant_term_masks_the_head_and_fully_masked_rows_stay_empty():
    """A per-head bias of -inf (a head switched off) lands in the columns' term: that head's rows
    see nothing (output 0, LSE -inf) as with the mod's own arithmetic; rows that the mask leaves
    empty (q_idx < 10) too."""
    def switch(score, b, h, q_idx, kv_idx):
        return score + NEG[h] + SLOPES[h] * (kv_idx - q_idx)

    def late(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx + 10

    q, k, v = make_qkv(1, H, H, 60, 60, 16, 16, torch.float16, seed=8)
    bm = make_block_mask(late, None, None, 60, 60, 32)
    _fresh()
    out, lse = check(q, k, v, score_mod=switch, block_mask=bm)
    assert _took_affine_path()
    assert (out[:, 1] == 0).all() and (lse[:, 1] == -math.inf).all()
    assert (out[:, :, :10] == 0).all() and (lse[:, :, :10] == -math.inf).all()
    assert torch.isfinite(lse[:, [0, 2, 3], 10:]).all()


def test_float32_inputs_keep_the_direct_path():
    """Float32 inputs evaluate the mod per score (the split's rounding would show at their precision)."""
    q, k, v = make_qkv(1, H, H, 40, 40, 16, 16, torch.float32)
    _fresh()
    check(q, k, v, score_mod=alibi)
    assert not _took_affine_path()
