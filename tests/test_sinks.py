"""Attention sinks (``sinks=``, gpt-oss): one logit per query head in every row's softmax
denominator, in the forward, decoding, the paged cache and the backward (Triton's CPU interpreter)
against the float64 reference, under torch.compile, and every bad input."""

from __future__ import annotations

import math

import pytest
import torch

import flexattn
from flexattn import AuxRequest
from flexattn.decode import decode_attention, valid_length
from flexattn.paged import PagedKVCache
from flexattn.reference import attention_reference

F64 = torch.float64


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


def qkv(B, Hq, Hkv, L, S, E, Ev=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, L, E, generator=g, dtype=F64).to(dtype),
            torch.randn(B, Hkv, S, E, generator=g, dtype=F64).to(dtype),
            torch.randn(B, Hkv, S, Ev or E, generator=g, dtype=F64).to(dtype))


def sink_logits(H, seed=1, dtype=torch.float32):
    """Sinks as large as the scores (N(0, 2)): they take a real share of each row."""
    return (2 * torch.randn(H, generator=torch.Generator().manual_seed(seed), dtype=F64)).to(dtype)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_with_empty_rows(b, h, q_idx, kv_idx):
    """Causal, and every fifth query row (2, 7, 12, ...) sees nothing."""
    return (q_idx >= kv_idx) & (q_idx % 5 != 2)


def softcap(score, b, h, q_idx, kv_idx):
    return 8 * torch.tanh(score / 8)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def alibi(score, b, h, q_idx, kv_idx):  # affine in the score: 16-bit inputs take SCORE_AFFINE
    return score + SLOPES[h] * (kv_idx - q_idx)


def check_rows(out, lse, ref_out, ref_lse, sinks, eager_out, factor=4.0, floor=1e-6):
    """The kernel's output within ``factor`` x eager's error of the float64 reference (plus a
    floor); its LSE within rounding; rows that see nothing give 0 and LSE = sinks[h]."""
    assert not out.isnan().any() and not lse.isnan().any()
    err = (out.double() - ref_out).abs().max().item()
    eager_err = (eager_out.double() - ref_out).abs().max().item()
    assert err <= factor * eager_err + floor, (err, eager_err)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(lse).all()


# ---------------------------------------------------------------------------------------------
# Forward


FORWARD_CASES = {
    # name: (Hq, Hkv, L, S, score_mod, mask_mod, dtype)
    "plain": (2, 2, 37, 45, None, None, torch.float32),
    "causal": (2, 2, 45, 45, None, causal, torch.float32),
    "empty rows": (3, 3, 29, 41, None, causal_with_empty_rows, torch.float32),
    "softcap gqa": (4, 2, 21, 53, softcap, causal, torch.float32),
    "alibi bfloat16": (4, 4, 33, 33, alibi, causal, torch.bfloat16),
    "float64": (2, 1, 19, 23, softcap, None, F64),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_matches_the_reference(case):
    Hq, Hkv, L, S, score_mod, mask_mod, dtype = FORWARD_CASES[case]
    q, k, v = qkv(2, Hq, Hkv, L, S, 16, 24, dtype)
    sinks = sink_logits(Hq)
    bm = None if mask_mod is None else flexattn.create_block_mask(mask_mod, 2, Hq, L, S, device="cpu",
                                                                    BLOCK_SIZE=16)
    kw = dict(score_mod=score_mod, block_mask=bm, enable_gqa=Hq != Hkv)
    out, lse = flexattn.flex_attention(q, k, v, return_lse=True, sinks=sinks,
                                       kernel_options={"FORCE_USE_FLEX_ATTENTION": True}, **kw)
    ref_out, ref_lse = attention_reference(q, k, v, return_lse=True, sinks=sinks, **kw)
    eager_out = attention_reference(q, k, v, dtype=None, sinks=sinks, **kw)
    floor = 1e-3 if dtype == torch.bfloat16 else 1e-6
    check_rows(out, lse, ref_out, ref_lse, sinks, eager_out, floor=floor)
    if case == "empty rows":
        dead = (torch.arange(L) % 5 == 2)
        assert (out[:, :, dead] == 0).all()
        torch.testing.assert_close(lse[:, :, dead], sinks.view(1, Hq, 1).expand(2, Hq, int(dead.sum())))


def test_the_sink_changes_the_rows_as_the_formula_says():
    """out_sink = out * exp(lse - lse_sink), lse_sink = logaddexp(lse, sink): the sink only
    rescales each row (a check that does not go through the reference)."""
    q, k, v = qkv(1, 2, 2, 26, 31, 16, dtype=F64)
    sinks = sink_logits(2, dtype=F64)
    out, lse = flexattn.flex_attention(q, k, v, return_lse=True)
    out_s, lse_s = flexattn.flex_attention(q, k, v, return_lse=True, sinks=sinks)
    want_lse = torch.logaddexp(lse, sinks.view(1, 2, 1))
    torch.testing.assert_close(lse_s, want_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_s, out * torch.exp(lse - want_lse)[..., None], rtol=1e-12, atol=1e-12)


def test_new_sink_values_reuse_the_plan():
    """Sinks' values are arguments: a second call with other values gives their result from the
    same plan; sinks or none are different plans."""
    from flexattn.kernels import plans

    q, k, v = qkv(1, 2, 2, 20, 20, 16)
    force = {"FORCE_USE_FLEX_ATTENTION": True}
    flexattn.flex_attention(q, k, v, sinks=sink_logits(2, seed=1), kernel_options=force)
    n = len(plans.FORWARD)
    for seed in (2, 3):
        sinks = sink_logits(2, seed=seed)
        out = flexattn.flex_attention(q, k, v, sinks=sinks, kernel_options=force)
        torch.testing.assert_close(out.double(), attention_reference(q, k, v, sinks=sinks), atol=1e-6, rtol=1e-6)
    assert len(plans.FORWARD) == n
    flexattn.flex_attention(q, k, v, kernel_options=force)
    assert len(plans.FORWARD) == n + 1


def test_aux_lse_includes_the_sink_and_max_scores_do_not():
    q, k, v = qkv(1, 3, 3, 27, 27, 16)
    sinks = sink_logits(3)
    bm = flexattn.create_block_mask(causal_with_empty_rows, 1, 3, 27, 27, device="cpu", BLOCK_SIZE=16)
    out, aux = flexattn.flex_attention(q, k, v, block_mask=bm, sinks=sinks,
                                       return_aux=AuxRequest(lse=True, max_scores=True))
    _, plain = flexattn.flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True, max_scores=True))
    ref_out, ref_lse = attention_reference(q, k, v, block_mask=bm, sinks=sinks, return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(aux.lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(aux.max_scores, plain.max_scores)  # -inf on rows that see nothing, as without sinks
    assert (aux.max_scores[:, :, 2] == -math.inf).all()


def test_bfloat16_sinks_and_non_contiguous_sinks():
    q, k, v = qkv(1, 4, 4, 19, 19, 16)
    table = sink_logits(8).view(4, 2)
    sinks = table[:, 1]  # stride 2
    out = flexattn.flex_attention(q, k, v, sinks=sinks)
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, sinks=sinks), atol=1e-6, rtol=1e-6)
    half = sinks.to(torch.bfloat16)
    out = flexattn.flex_attention(q, k, v, sinks=half)
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, sinks=half), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Decoding and the paged cache


@pytest.mark.parametrize("split", [1, 4])
def test_decoding_adds_the_sink_once(split):
    """Short queries, GQA packed rows, split KV: the sink joins the merged rows once (a sink per
    split would count it ``split`` times); batch 1's rows see no KV at all (kv_lengths 0)."""
    q, k, v = qkv(2, 4, 2, 3, 77, 16, 24)
    sinks = sink_logits(4)
    lengths = torch.tensor([77, 0], dtype=torch.int32)
    opts = {"SPLIT_KV": split}
    out, lse = decode_attention(q, k, v, enable_gqa=True, return_lse=True, kernel_options=opts, sinks=sinks,
                                kv_lengths=lengths)
    kw = dict(mask_mod=valid_length(lengths), enable_gqa=True, sinks=sinks)
    ref_out, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    check_rows(out, lse, ref_out, ref_lse, sinks, attention_reference(q, k, v, dtype=None, **kw))
    assert (out[1] == 0).all()
    torch.testing.assert_close(lse[1], sinks.view(4, 1).expand(4, 3))


def test_decoding_with_a_block_mask_and_score_mod():
    q, k, v = qkv(1, 2, 2, 5, 70, 16)
    sinks = sink_logits(2)
    bm = flexattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 60, 1, 1, 5, 70, device="cpu",
                                    BLOCK_SIZE=16)
    out, lse = decode_attention(q, k, v, score_mod=softcap, block_mask=bm, return_lse=True, sinks=sinks,
                                kernel_options={"SPLIT_KV": 3})
    kw = dict(score_mod=softcap, block_mask=bm, sinks=sinks)
    ref_out, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    check_rows(out, lse, ref_out, ref_lse, sinks, attention_reference(q, k, v, dtype=None, **kw))


def test_flex_attention_takes_the_decoding_kernel_with_sinks():
    q, k, v = qkv(1, 2, 2, 2, 40, 16)
    sinks = sink_logits(2)
    out = flexattn.flex_attention(q, k, v, sinks=sinks, kernel_options={"BACKEND": "TRITON_DECODE"})
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, sinks=sinks), atol=1e-6, rtol=1e-6)


def test_paged_cache_decoding_with_sinks():
    B, Hkv, E, page = 2, 2, 16, 16
    lengths = [53, 29]
    k, v = qkv(B, Hkv, Hkv, 60, 60, E, seed=3)[1:]
    q = qkv(B, 4, Hkv, 1, 1, E, seed=4)[0]
    cache = PagedKVCache(n_pages=8, page_size=page, max_batch_size=B, num_heads=Hkv, head_dim=E)
    for b in (1, 0):  # pages out of order
        cache.reserve(b, lengths[b])
    cache.assign(torch.arange(B, dtype=torch.int32), torch.arange(60)[None].expand(B, -1), k, v)
    sinks = sink_logits(4)
    lens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = decode_attention(q, cache.k_cache, cache.v_cache, mask_mod=cache.get_mask_mod(valid_length(lens)),
                                enable_gqa=True, return_lse=True, sinks=sinks, kernel_options={"SPLIT_KV": 2})
    ref_out, ref_lse = attention_reference(q, k, v, mask_mod=valid_length(lens), enable_gqa=True, sinks=sinks,
                                           return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Backward


def grads(fn, inputs, seed=5):
    """Gradients of sum(out * g) + sum(lse * g') w.r.t. ``inputs`` (the LSE is finite everywhere
    with sinks)."""
    out, lse = fn()
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=F64).to(out.dtype)).sum()
    loss = loss + (lse * torch.randn(lse.shape, generator=g, dtype=F64).to(lse.dtype)).sum()
    return torch.autograd.grad(loss, inputs)


BACKWARD_CASES = {
    # name: (Hq, Hkv, L, S, mask_mod)
    "plain": (2, 2, 23, 29, None),
    "empty rows gqa": (4, 2, 29, 35, causal_with_empty_rows),
}


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_gradients_match_autograd_of_the_reference(case):
    """float64 kernels: dq, dk, dv, d sinks and the gradient of a captured bias against autograd
    through the float64 reference, equal to rounding."""
    Hq, Hkv, L, S, mask_mod = BACKWARD_CASES[case]
    q, k, v = (t.requires_grad_() for t in qkv(2, Hq, Hkv, L, S, 16, 8, dtype=F64))
    sinks = sink_logits(Hq, dtype=F64).requires_grad_()
    bias = torch.randn(Hq, S, dtype=F64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    bm = None if mask_mod is None else flexattn.create_block_mask(mask_mod, 2, Hq, L, S, device="cpu",
                                                                    BLOCK_SIZE=16)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    kw = dict(score_mod=biased, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=True, sinks=sinks)
    inputs = (q, k, v, sinks, bias)
    got = grads(lambda: flexattn.flex_attention(q, k, v, **kw), inputs)
    want = grads(lambda: attention_reference(q, k, v, **kw), inputs)
    for name, a, b in zip(["dq", "dk", "dv", "d sinks", "d bias"], got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")


def test_float32_sink_gradient_is_close_to_the_reference():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 33, 33, 16))
    sinks = sink_logits(2).requires_grad_()
    bm = flexattn.create_block_mask(causal, 1, 1, 33, 33, device="cpu", BLOCK_SIZE=16)
    got = grads(lambda: flexattn.flex_attention(q, k, v, block_mask=bm, return_lse=True, sinks=sinks), (sinks,))[0]
    q64, k64, v64, s64 = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    want = grads(lambda: attention_reference(q64, k64, v64, block_mask=bm, return_lse=True, sinks=s64), (s64,))[0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_a_sink_of_minus_inf_is_no_sink():
    """Outputs and LSE of the call without sinks (-inf on rows that see nothing), and a gradient
    of 0 for that head, not NaN, in the forward, decoding and the backward."""
    q, k, v = (torch.randn(1, 2, 40, 16, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([-math.inf, 0.5], dtype=torch.float64, requires_grad=True)
    mask = flexattn.create_block_mask(lambda b, h, qi, ki: (qi >= 8) & (ki <= qi), None, None, 40, 40, device="cpu",
                                      BLOCK_SIZE=16)
    out, lse = flexattn.flex_attention(q, k, v, block_mask=mask, sinks=sinks, return_lse=True)
    plain, plain_lse = flexattn.flex_attention(q, k, v, block_mask=mask, return_lse=True)
    torch.testing.assert_close(out[:, 0], plain[:, 0], atol=0, rtol=0)
    torch.testing.assert_close(lse[:, 0], plain_lse[:, 0], atol=0, rtol=0)
    assert lse[0, 0, :8].eq(-math.inf).all() and lse[0, 1, :8].eq(0.5).all()
    out.sum().backward()
    assert sinks.grad[0] == 0 and sinks.grad[1].isfinite()
    q1, k1, v1 = (t.float() for t in (q[:, :, :1], k, v))
    empty = decode_attention(q1, k1, v1, mask_mod=lambda b, h, qi, ki: ki < 0, sinks=sinks.detach().float(),
                             return_lse=True)
    assert empty[0].eq(0).all() and empty[1][0, 0].eq(-math.inf).all() and empty[1][0, 1].eq(0.5).all()


def test_gradcheck_of_sinks():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 9, 11, 8, dtype=F64))
    sinks = sink_logits(2, dtype=F64).requires_grad_()
    bm = flexattn.create_block_mask(causal_with_empty_rows, 1, 1, 9, 11, device="cpu", BLOCK_SIZE=16)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: flexattn.flex_attention(q, k, v, block_mask=bm, return_lse=True, sinks=s),
        (q, k, v, sinks), fast_mode=True, atol=1e-7, rtol=1e-6)


def test_sink_gradient_without_keys():
    """KV_LEN = 0: every row's LSE is its head's sink and its output 0, so d sinks[h] is the sum
    of dLSE over the head's rows (Delta = -dLSE), not 0."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 3, 16, generator=g, dtype=F64).requires_grad_()
    k = v = torch.randn(2, 4, 0, 16, generator=g, dtype=F64)
    sinks = torch.randn(4, generator=g, dtype=F64).requires_grad_()
    out, lse = flexattn.flex_attention(q, k, v, sinks=sinks, return_lse=True)
    w = torch.randn(lse.shape, generator=g, dtype=F64)
    (got,) = torch.autograd.grad(out.sum() + (lse * w).sum(), sinks)
    torch.testing.assert_close(got, w.sum((0, 2)), rtol=1e-12, atol=1e-12)


def test_sinks_alone_require_grad():
    """Only the sinks need a gradient: the call still records the backward."""
    q, k, v = qkv(1, 2, 2, 12, 12, 8, dtype=F64)
    sinks = sink_logits(2, dtype=F64).requires_grad_()
    out = flexattn.flex_attention(q, k, v, sinks=sinks)
    (got,) = torch.autograd.grad(out.sum(), sinks)
    s64 = sinks.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(attention_reference(q, k, v, sinks=s64).sum(), s64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# torch.compile


class SinkAttention(torch.nn.Module):
    def __init__(self, heads=2):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))

    def forward(self, q, k, v):
        return flexattn.flex_attention(q, k, v, score_mod=softcap, sinks=self.sinks)


def test_compiled_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    model = SinkAttention()
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 21, 21, 16))

    def run(m):
        for t in (q, k, v, model.sinks):
            t.grad = None
        out = m(q, k, v)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return out, [t.grad.clone() for t in (q, k, v, model.sinks)]

    ref, ref_grads = run(model)
    out, got = run(torch.compile(model, fullgraph=True))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_compiled_decoding_with_sinks():
    torch._dynamo.reset()
    q, k, v = qkv(1, 2, 2, 1, 50, 16)
    sinks = sink_logits(2)
    compiled = torch.compile(lambda q, k, v, s: decode_attention(q, k, v, sinks=s), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, sinks).double(), attention_reference(q, k, v, sinks=sinks),
                               atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_sinks_are_clear_errors():
    q, k, v = qkv(1, 2, 2, 8, 8, 16)
    with pytest.raises(ValueError, match=r"sinks must have shape \[2\].*got \[3\]"):
        flexattn.flex_attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match=r"sinks must have shape \[2\].*got \[1, 2\]"):
        decode_attention(q, k, v, sinks=torch.zeros(1, 2))
    with pytest.raises(TypeError, match="sinks must be a float16, bfloat16, float32 or float64 tensor, got torch.int64"):
        flexattn.flex_attention(q, k, v, sinks=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="sinks must be on query's device cpu, got meta"):
        flexattn.flex_attention(q, k, v, sinks=torch.zeros(2, device="meta"))
    with pytest.raises(TypeError, match=r"sinks must be a tensor of shape \[2\].*got list"):
        flexattn.flex_attention(q, k, v, sinks=[0.0, 1.0])
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in qkv(1, 2, 2, 32, 32, 32))
    with pytest.raises(TypeError, match="sinks are not supported with float8_e4m3fn inputs"):
        flexattn.flex_attention(q8, k8, v8, sinks=torch.zeros(2))


def test_decoding_rejects_sinks_that_need_a_gradient():
    q, k, v = qkv(1, 2, 2, 1, 16, 16)
    with pytest.raises(ValueError, match="computes no gradients"):
        decode_attention(q, k, v, sinks=torch.zeros(2, requires_grad=True))
