"""The backward kernels (Triton's CPU interpreter) against autograd through the eager reference.

Three checks: torch.autograd.gradcheck in float64 (the kernels are the exact derivative of the
forward kernel), float64 kernels against autograd through `attention_reference` (the semantics),
and float32 / bfloat16 kernels whose error against the float64 reference must stay within a small
multiple of what eager attention in the same dtype gets (`testing.assert_close_to_reference`).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import flexattn
from flexattn import ir
from helpers import testing
from flexattn.mods import Mod
from flexattn.reference import attention_reference

F64 = torch.float64


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


def make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype=F64, Bkv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Bkv = B if Bkv is None else Bkv
    q = torch.randn(B, Hq, L, E, generator=g, dtype=F64).to(dtype).requires_grad_()
    k = torch.randn(Bkv, Hkv, S, E, generator=g, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(Bkv, Hkv, S, Ev, generator=g, dtype=F64).to(dtype).requires_grad_()
    return q, k, v


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def block_mask(mask_mod, B, H, L, S, block=16):
    return flexattn.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)


def grads(fn, inputs, seed=1, lse_weight=True):
    """Gradients of sum(out * g) + sum(lse * g') (finite LSE rows only) w.r.t. ``inputs``."""
    out, lse = fn()
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)).sum()
    if lse_weight:
        w = torch.randn(lse.shape, generator=g, dtype=F64).to(lse.dtype)
        loss = loss + torch.where(torch.isfinite(lse), lse * w, 0.0).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def compare_f64(q, k, v, *, score_mod=None, mask=None, tables=(), gqa=False, lse=True, tol=1e-10):
    """float64 kernels vs autograd through the float64 reference: equal to rounding."""
    inputs = (q, k, v, *tables)
    got = grads(lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask,
                                                enable_gqa=gqa, return_lse=True), inputs, lse_weight=lse)
    want = grads(lambda: attention_reference(q, k, v, score_mod=score_mod, block_mask=mask,
                                             enable_gqa=gqa, return_lse=True), inputs, lse_weight=lse)
    for name, a, b in zip(["dq", "dk", "dv"] + [f"d table{i}" for i in range(len(tables))], got, want):
        b = torch.zeros_like(a) if b is None else b
        assert not torch.isnan(a).any(), f"{name} has NaN"
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    return got


# ---------------------------------------------------------------------------------------------
# gradcheck (float64)


def _gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("case", ["dense", "causal_block_mask", "gqa_kv_broadcast"])
def test_gradcheck(case):
    if case == "dense":  # E != Ev, lengths not multiples of any tile
        q, k, v = make_qkv(1, 2, 2, 19, 23, 16, 24)
        _gradcheck(lambda q, k, v: flexattn.flex_attention(q, k, v, return_lse=True), (q, k, v))
    elif case == "causal_block_mask":
        q, k, v = make_qkv(1, 2, 2, 40, 37, 16, 24)
        bm = block_mask(causal, 1, 2, 40, 37)
        _gradcheck(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm, return_lse=True), (q, k, v))
    else:  # 4 query heads on 2 KV heads, K/V batch 1 broadcast over batch 2
        q, k, v = make_qkv(2, 4, 2, 21, 33, 16, 16, Bkv=1)
        bm = block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 12, 2, 4, 21, 33)
        _gradcheck(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm, enable_gqa=True), (q, k, v))


def test_preprocess_zeroes_the_dq_accumulator():
    """The Hopper backward's preprocess (here on the interpreter) writes Delta = rowsum(dO * O) - dLSE
    and zeroes the float32 dQ accumulator (poisoned with NaN), in the query's layout (heads inside),
    at a length off its 64-row tile and a head dim off a power of two."""
    from flexattn import tracer
    from flexattn.kernels import backward as bwd
    from flexattn.mods import MASK, SCORE

    B, H, L, E, Ev = 2, 3, 70, 24, 16
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, L, H, E, generator=g).transpose(1, 2)
    out, do = (torch.randn(B, H, L, Ev, generator=g) for _ in range(2))
    dlse = torch.randn(B, H, L, generator=g)
    cpu = torch.device("cpu")
    score = tracer.trace(lambda s, b, h, qi, ki: s, SCORE, score_dtype=torch.float32, device=cpu)
    mask = tracer.trace(lambda b, h, qi, ki: qi >= 0, MASK, device=cpu)
    pre = bwd._preprocess(bwd.module(score, mask, (), "interpret"), q, out, True, zero_dq=True)
    delta = torch.full((B, H, L), math.nan)
    dq_acc = torch.full((B, L, H, E), math.nan).transpose(1, 2)
    pre(*bwd.preprocess_args(out, do, dlse, delta, dq_acc, H, L))
    torch.testing.assert_close(delta, (out * do).sum(-1) - dlse)
    assert (dq_acc == 0).all()


@pytest.mark.parametrize("used", ["out", "lse"])
def test_an_unused_output_reaches_the_backward_as_none(used, monkeypatch):
    """A loss of the output alone (or the LSE alone): the other gradient reaches the autograd
    function's backward as None, not a tensor of zeros to fill and read, and the gradients are
    autograd's through the float64 reference."""
    from flexattn.call import FlexAttentionFunction
    from flexattn.kernels import backward as bwd

    runs = testing.record_calls(monkeypatch, bwd, "run")
    received = testing.record_calls(monkeypatch, FlexAttentionFunction, "backward")
    q, k, v = make_qkv(1, 2, 2, 26, 30, 16, 16)
    bm = block_mask(causal, 1, 2, 26, 30)
    w = torch.linspace(-1.0, 2.0, 26 * 16, dtype=F64)

    def loss(out, lse):
        return (out * w.view(26, 16)).sum() if used == "out" else (lse * w[:26]).sum()

    got = torch.autograd.grad(loss(*flexattn.flex_attention(q, k, v, block_mask=bm, return_lse=True)), (q, k, v))
    want = torch.autograd.grad(loss(*attention_reference(q, k, v, block_mask=bm, return_lse=True)), (q, k, v),
                               allow_unused=True)  # (the LSE does not depend on v)
    assert received[-1][1 if used == "lse" else 2] is None  # (ctx, grad_out, grad_lse)
    grad_out, grad_lse = runs[-1][6:8]
    assert (grad_lse is None) if used == "out" else (grad_out is not None and not grad_out.any())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-10, atol=1e-10)


def test_gradcheck_learnable_tables():
    # A relative-position table and per-head slopes, through a block mask with partial tiles.
    q, k, v = make_qkv(1, 2, 2, 26, 30, 16, 16)
    rel = torch.randn(2 * 32 - 1, dtype=F64, requires_grad=True)
    slope = torch.rand(2, dtype=F64, requires_grad=True)
    bm = block_mask(causal, 1, 2, 26, 30)

    def fn(q, k, v, rel, slope):
        def mod(score, b, h, q_idx, kv_idx):
            return score + rel[kv_idx - q_idx + 31] + slope[h] * (kv_idx - q_idx)
        return flexattn.flex_attention(q, k, v, score_mod=mod, block_mask=bm)

    _gradcheck(fn, (q, k, v, rel, slope))


# ---------------------------------------------------------------------------------------------
# float64 kernels against the float64 reference


def test_dense_and_lse_gradient():
    compare_f64(*make_qkv(2, 2, 2, 37, 29, 16, 24))


def test_kv_tiles_cross_block_mask_blocks():
    # Sparse blocks of (16, 32): each KV block is two dQ tiles at BLOCK_N2 = 16 and the lists are
    # walked with indirect jumps; tiles larger than the sequence; a non-square block mask.
    q, k, v = make_qkv(1, 2, 2, 50, 70, 16, 16)
    mask = flexattn.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx // 8) % 2 != (kv_idx // 16) % 3,
                                      1, 2, 50, 70, device="cpu", BLOCK_SIZE=(16, 32))
    compare_f64(q, k, v, mask=mask)


def test_gqa_and_kv_batch_broadcast():
    q, k, v = make_qkv(2, 6, 2, 33, 40, 16, 32, Bkv=1)
    mask = block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (h == 1), 2, 6, 33, 40)
    compare_f64(q, k, v, mask=mask, gqa=True)


def test_per_head_block_mask_with_gqa():
    # The transposed lists differ per query head of a group: each head walks its own.
    q, k, v = make_qkv(1, 4, 2, 48, 48, 16, 16)
    mask = block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 8 * (h + 1), 1, 4, 48, 48)
    compare_f64(q, k, v, mask=mask, gqa=True)


def test_block_mask_without_transposed_lists():
    # torch's BlockMask built from kv lists only: the host transposes them.
    from torch.nn.attention.flex_attention import BlockMask

    q, k, v = make_qkv(1, 2, 2, 40, 40, 16, 16)
    bm = block_mask(causal, 1, 2, 40, 40)
    bare = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                    bm.full_kv_indices, BLOCK_SIZE=16, mask_mod=causal, seq_lengths=(40, 40))
    bare.q_num_blocks = bare.q_indices = bare.full_q_num_blocks = bare.full_q_indices = None
    want = compare_f64(q, k, v, mask=bm)
    got = compare_f64(q, k, v, mask=bare)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fully_masked_rows_get_zero_gradients():
    # Rows q_idx % 5 == 0 see nothing; a score mod whose derivative is infinite at masked scores
    # (sqrt(0)) must not leak NaN either.
    q, k, v = make_qkv(1, 2, 2, 40, 36, 16, 16)
    mask = block_mask(lambda b, h, q_idx, kv_idx: (q_idx % 5 != 0) & (kv_idx <= q_idx), 1, 2, 40, 36)

    def mod(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= q_idx, score, 0.0) + torch.sqrt(torch.relu(score))

    dq, dk, dv = compare_f64(q, k, v, score_mod=mod, mask=mask, tol=1e-9)
    assert (dq[:, :, ::5] == 0).all()
    assert not any(torch.isnan(t).any() for t in (dq, dk, dv))


def test_score_mod_derivative_is_inlined():
    q, k, v = make_qkv(1, 2, 2, 35, 27, 16, 24)

    def softcap(score, b, h, q_idx, kv_idx):
        return 7.0 * torch.tanh(score / 7.0)

    compare_f64(q, k, v, score_mod=softcap, mask=block_mask(causal, 1, 2, 35, 27))


# -- learnable tables --------------------------------------------------------------------------


def test_table_by_relative_position():
    q, k, v = make_qkv(1, 2, 2, 40, 37, 16, 24)
    rel = torch.randn(2 * 40 - 1, dtype=F64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score + rel[kv_idx - q_idx + 39]

    compare_f64(q, k, v, score_mod=mod, mask=block_mask(causal, 1, 2, 40, 37), tables=(rel,))


def test_table_by_head_query_key():
    q, k, v = make_qkv(1, 3, 3, 29, 31, 16, 16)
    bias = torch.randn(3, 29, 31, dtype=F64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid(bias[h, q_idx, kv_idx])

    compare_f64(q, k, v, score_mod=mod, tables=(bias,))


@pytest.mark.parametrize("op", ["clamp", "clamp_min", "clamp_max", "clip", "tensor_bound", "relu6", "hardtanh"])
def test_clamp_at_its_bounds_has_torch_gradients(op):
    """Learnable values exactly at a clamp's bounds (a zero-initialised table under clamp(min=0)):
    torch.clamp passes the whole gradient to x at a bound, hardtanh / relu6 none; a tensor bound
    gets it only where x is beyond it. Not maximum/minimum's tie, which splits it in half."""
    q, k, v = make_qkv(1, 2, 2, 19, 23, 16, 16)
    t = torch.tensor([0.0, 6.0], dtype=F64, requires_grad=True)
    lo = torch.tensor([0.0, 7.0], dtype=F64, requires_grad=True)
    f = {"clamp": lambda x: x.clamp(0.0, 6.0), "clamp_min": lambda x: torch.clamp_min(x, 0.0),
         "clamp_max": lambda x: torch.clamp(x, max=6.0), "clip": lambda x: torch.clip(x, 0.0, 6.0),
         "relu6": torch.nn.functional.relu6, "hardtanh": lambda x: torch.nn.functional.hardtanh(x, 0.0, 6.0)}.get(op)

    def mod(score, b, h, q_idx, kv_idx):
        if op == "tensor_bound":
            return score + torch.clamp(t[h], min=lo[h]) * 0.5
        return score + f(t[h]) * (kv_idx - q_idx) * 0.1

    compare_f64(q, k, v, score_mod=mod, tables=(t, lo) if op == "tensor_bound" else (t,))


def test_detach_stops_the_gradient():
    """``.detach()`` / ``torch.detach`` in a score mod is a stop-gradient, as in torch: no gradient
    through the detached score (a straight-through term, a detached gate) nor into a detached table."""
    q, k, v = make_qkv(1, 2, 2, 19, 23, 16, 16)
    frozen = torch.randn(2, dtype=F64, requires_grad=True)
    learnt = torch.randn(2, dtype=F64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        gate = torch.sigmoid(score).detach()
        return score * gate + frozen[h].detach() * score + torch.detach(score * learnt[h]) * 0.5 + learnt[h]

    dq, dk, dv, d_frozen, d_learnt = compare_f64(q, k, v, score_mod=mod, tables=(frozen, learnt))
    assert (d_frozen == 0).all() and (d_learnt != 0).all()


def test_table_through_nested_gather_and_read_twice():
    # doc ids (int, no gradient) route into a float table that is read twice in one mod; a 0-d
    # gate and an out-of-range index (reads 0, sends nothing back) complete the picture.
    q, k, v = make_qkv(1, 2, 2, 40, 40, 16, 16)
    doc = torch.randint(0, 6, (40,), generator=torch.Generator().manual_seed(3))
    table = torch.randn(6, dtype=F64, requires_grad=True)
    gate = torch.tensor(0.3, dtype=F64, requires_grad=True)
    short = torch.randn(30, dtype=F64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return (score + table[doc[q_idx]] * table[doc[kv_idx]] + gate * table[doc[q_idx]]
                + short[kv_idx + 10])

    # Traced once, so the reference runs the IR (which reads 0 out of range, like the kernels).
    traced = flexattn.trace(mod, score_dtype=F64)
    dq, dk, dv, dt, dg, ds = compare_f64(q, k, v, score_mod=traced, tables=(table, gate, short))
    assert (ds[:10] == 0).all() and (ds[10:] != 0).all()  # kv_idx + 10 reads entries 10..29 (and beyond)


def test_only_tables_needing_grad_are_scattered():
    q, k, v = make_qkv(1, 2, 2, 24, 24, 16, 16)
    q.requires_grad_(False)
    frozen = torch.randn(24, dtype=F64)
    learned = torch.randn(2, dtype=F64, requires_grad=True)

    def mod(score, b, h, q_idx, kv_idx):
        return score * learned[h] + frozen[kv_idx]

    out = flexattn.flex_attention(q, k, v, score_mod=mod)
    dk, dlearned = torch.autograd.grad(out.sum(), (k, learned))
    ref = attention_reference(q, k, v, score_mod=mod)
    rk, rl = torch.autograd.grad(ref.sum(), (k, learned))
    torch.testing.assert_close(dk, rk, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dlearned, rl, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# Low precision: within a small multiple of eager's error


def check_low_precision(dtype, *, B=1, Hq=2, Hkv=2, L=40, S=37, E=16, Ev=16, Bkv=None, score_mod=None,
                        score_mod64=None, mask=None, tables=(), tables64=(), factor=3.0, seed=0):
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, Bkv=Bkv, seed=seed)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    gqa = Hq != Hkv
    kw = dict(block_mask=mask, enable_gqa=gqa, return_lse=True)
    got = grads(lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, **kw), (q, k, v, *tables), seed)
    eager = grads(lambda: attention_reference(q, k, v, score_mod=score_mod, dtype=None, **kw),
                  (q, k, v, *tables), seed)
    ref = grads(lambda: attention_reference(q64, k64, v64, score_mod=score_mod64 or score_mod, **kw),
                (q64, k64, v64, *tables64), seed)
    # The slack of a flash-style backward (testing.backward_atol): cancellation in dP - Delta and
    # the float32 LSE's rounding.
    g = torch.Generator().manual_seed(seed)
    d_out = torch.randn(q.shape[:3] + (Ev,), generator=g, dtype=F64)
    with torch.no_grad():
        _, lse = attention_reference(q64, k64, v64, score_mod=score_mod64 or score_mod, **kw)
    for name, a, e, r in zip(["dq", "dk", "dv"] + [f"d table{i}" for i in range(len(tables))], got, eager, ref):
        e = torch.zeros_like(a) if e is None else e
        r = torch.zeros_like(a, dtype=F64) if r is None else r
        atol = testing.backward_atol(r, (dtype, a.dtype), d_out, v64, lse)
        testing.assert_close_to_reference(a, e, r, factor=factor, atol=atol, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_alibi_causal(dtype):
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float32, requires_grad=True)
    slopes64 = slopes.detach().double().requires_grad_()

    def alibi(t):
        return lambda score, b, h, q_idx, kv_idx: score + t[h] * (kv_idx - q_idx)

    check_low_precision(dtype, score_mod=alibi(slopes), score_mod64=alibi(slopes64), tables=(slopes,),
                        tables64=(slopes64,), mask=block_mask(causal, 1, 2, 40, 37))


# ---------------------------------------------------------------------------------------------
# Hypothesis: random mods, masks and shapes, float32 kernels vs float64 autograd

MASKS = {
    "none": None,
    "causal": causal,
    "window": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 12),
    "prefix": lambda b, h, q_idx, kv_idx: (kv_idx < 8) | (q_idx % 3 == h),
}


@st.composite
def problems(draw):
    node, bufs = draw(testing.score_irs(max_depth=3, max_buffers=2))
    # torch has no derivative for floor_divide on floats (autodiff's 0 is exact, but the reference
    # cannot say so): leave those mods to the autodiff tests.
    assume(not any(n.op == "floordiv" and n.dtype.is_floating_point for n in ir.toposort(node)))
    Hkv = draw(st.sampled_from([1, 2]))
    shape = dict(
        B=draw(st.integers(1, 2)), Hkv=Hkv, Hq=Hkv * draw(st.sampled_from([1, 2])),
        L=draw(st.integers(1, 48)), S=draw(st.integers(1, 48)),
        E=draw(st.sampled_from([16, 24])), Ev=draw(st.sampled_from([16, 8])),
    )
    shape["Bkv"] = draw(st.sampled_from([1, shape["B"]]))
    return node, bufs, shape, draw(st.sampled_from(sorted(MASKS))), draw(st.sampled_from([16, 32]))


@settings(max_examples=10, deadline=None)
@given(problem=problems(), seed=st.integers(0, 2**16))
def test_random_mods_match_float64_autograd(problem, seed):
    node, bufs, s, mask_name, block = problem
    tables = [t.detach().clone().requires_grad_(t.dtype.is_floating_point) for t in bufs]
    tables64 = [t.detach().double().requires_grad_() if t.dtype.is_floating_point else t
                for t in testing.buffers_float64(bufs)]
    mod = Mod("score", node, tables, name="random")
    mod64 = Mod("score", testing.to_float64(node), tables64, name="random64")
    mask = MASKS[mask_name]
    bm = block_mask(mask, s["B"], s["Hq"], s["L"], s["S"], block) if mask is not None else None
    learn = [t for t in tables if t.requires_grad]
    learn64 = [t for t in tables64 if t.requires_grad]
    # Float tables of float16/bfloat16 get gradients rounded to their dtype: compare in float64
    # terms through the helper's atol (4 ulp of that dtype at the largest gradient).
    check_low_precision(torch.float32, score_mod=mod, score_mod64=mod64, mask=bm, tables=learn,
                        tables64=learn64, factor=4.0, seed=seed, **s)


def test_undifferentiable_score_mod_fails_at_call_time(monkeypatch):
    """An op without a derivative rule is reported by flex_attention itself, before any kernel runs."""
    from flexattn import autodiff

    monkeypatch.delitem(autodiff.UNARY_RULES, "tanh")
    q, k, v = (torch.randn(1, 1, 20, 16, requires_grad=True) for _ in range(3))
    softcap = lambda score, b, h, q_idx, kv_idx: 20 * torch.tanh(score / 20)  # noqa: E731
    with pytest.raises(autodiff.NotDifferentiableError, match="tanh"):
        flexattn.flex_attention(q, k, v, score_mod=softcap)
    with torch.no_grad():  # no gradient wanted: nothing to differentiate, so it runs
        assert torch.isfinite(flexattn.flex_attention(q, k, v, score_mod=softcap)).all()


def test_blocks_are_contiguous_promise_covers_only_the_kv_lists():
    """BLOCKS_ARE_CONTIGUOUS promises consecutive KV blocks per query block; the transposed lists
    of the dK/dV pass need not be (here KV block 0 is seen by query blocks 0 and 2, not 1)."""
    from flexattn.block_mask import BlockMask

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 48, 16, dtype=F64, requires_grad=True) for _ in range(3))
    # Query blocks (16 rows) see KV blocks (32 columns): [0], [1], [0] - each list is contiguous.
    kv_num = torch.tensor([[[1, 1, 1]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 1], [1, 0], [0, 1]]]], dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(16, 32), seq_lengths=(48, 48),
                                    mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx - 30)
    want = grads(lambda: attention_reference(q, k, v, block_mask=mask, return_lse=True), (q, k, v))
    got = grads(lambda: flexattn.flex_attention(q, k, v, block_mask=mask, return_lse=True,
                                                kernel_options={"BLOCKS_ARE_CONTIGUOUS": True}), (q, k, v))
    for name, a, b in zip(["dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
