"""``return_aux=AuxRequest(...)``: torch 2.13's auxiliary outputs (lse, max_scores) from flex_attention."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import AuxOutput, AuxRequest
from flexattn.reference import apply_score_mod, attention_reference, dense_block_mask


def _inputs(B=1, Hq=4, Hkv=2, Q=37, KV=45, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Q, E, generator=g)
    k = torch.randn(B, Hkv, KV, E, generator=g)
    v = torch.randn(B, Hkv, KV, E, generator=g)
    return q, k, v


def _softcap(score, b, h, q_idx, kv_idx):
    return 8 * torch.tanh(score / 8) + 0.1 * h


def _mask(b, h, q_idx, kv_idx):  # rows 0..7 see nothing: exercises fully masked rows
    return (q_idx >= 8) & (q_idx + 8 >= kv_idx)


def _max_scores_reference(q, k, block_mask, score_mod, scale):
    """float64 row max of the modified, scaled scores; -inf where the row keeps nothing."""
    B, Hq, Q, E = q.shape
    KV = k.shape[2]
    kk = k.double().repeat_interleave(Hq // k.shape[1], dim=1)
    s = apply_score_mod(score_mod, (q.double() @ kk.transpose(-2, -1)) * scale)
    keep = dense_block_mask(block_mask, B, Hq, Q, KV)
    return s.masked_fill(~keep, -math.inf).amax(-1)


def test_aux_request_and_output_are_torchs_shape():
    assert AuxRequest._fields == torch_flex.AuxRequest._fields == ("lse", "max_scores")
    assert AuxOutput._fields == torch_flex.AuxOutput._fields == ("lse", "max_scores")
    assert AuxRequest() == (False, False) and AuxOutput() == (None, None)


@pytest.mark.parametrize("request_", [AuxRequest(lse=True), AuxRequest(max_scores=True),
                                      AuxRequest(lse=True, max_scores=True), AuxRequest()])
def test_return_aux_matches_float64_reference(request_):
    q, k, v = _inputs()
    scale = 0.3
    bm = flexattn.create_block_mask(_mask, None, None, q.shape[2], k.shape[2], device="cpu", BLOCK_SIZE=16)
    out, aux = flexattn.flex_attention(q, k, v, score_mod=_softcap, block_mask=bm, scale=scale, enable_gqa=True,
                                       return_aux=request_)
    assert isinstance(aux, AuxOutput)
    ref, ref_lse = attention_reference(q, k, v, score_mod=_softcap, block_mask=bm, scale=scale, enable_gqa=True,
                                       return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    if request_.lse:
        assert aux.lse.dtype == torch.float32 and aux.lse.shape == (1, 4, 37)
        torch.testing.assert_close(aux.lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
        assert torch.isneginf(aux.lse[:, :, :8]).all()
    else:
        assert aux.lse is None
    if request_.max_scores:
        ref_max = _max_scores_reference(q, k, bm, _softcap, scale)
        assert aux.max_scores.dtype == torch.float32 and aux.max_scores.shape == (1, 4, 37)
        torch.testing.assert_close(aux.max_scores.double(), ref_max, atol=2e-5, rtol=2e-5)
        assert torch.isneginf(aux.max_scores[:, :, :8]).all()
    else:
        assert aux.max_scores is None


def test_return_aux_matches_torch_flex_attention():
    """Same numbers as torch's own (eager) flex_attention with return_aux, natural-log units (torch's
    eager path returns no max_scores on the CPU: those are checked against float64 above)."""
    q, k, v = _inputs(Q=32, KV=32, seed=1)
    tbm = torch_flex.create_block_mask(_mask, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    want_out, want = torch_flex.flex_attention(q, k, v, score_mod=_softcap, block_mask=tbm, enable_gqa=True,
                                               return_aux=torch_flex.AuxRequest(lse=True))
    bm = flexattn.create_block_mask(_mask, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    out, aux = flexattn.flex_attention(q, k, v, score_mod=_softcap, block_mask=bm, enable_gqa=True,
                                       return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux.lse, want.lse, atol=1e-5, rtol=1e-5)


def test_torchs_aux_request_is_accepted():
    q, k, v = _inputs(Hq=2, Q=20, KV=20)
    out, aux = flexattn.flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(lse=True))
    _, lse = attention_reference(q, k, v, return_lse=True)
    torch.testing.assert_close(aux.lse.double(), lse, atol=2e-5, rtol=2e-5)


def test_return_aux_on_the_decoding_path():
    """A short query (the split-KV decoding kernel) gives the same aux outputs."""
    q, k, v = _inputs(Q=3, KV=70, seed=2)
    out, aux = flexattn.flex_attention(q, k, v, score_mod=_softcap, enable_gqa=True,
                                       return_aux=AuxRequest(lse=True, max_scores=True))
    bm = flexattn.create_block_mask(flexattn.noop_mask, None, None, 3, 70, device="cpu", BLOCK_SIZE=16)
    _, ref_lse = attention_reference(q, k, v, score_mod=_softcap, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(aux.lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    ref_max = _max_scores_reference(q, k, bm, _softcap, 1 / math.sqrt(16))
    torch.testing.assert_close(aux.max_scores.double(), ref_max, atol=2e-5, rtol=2e-5)


def test_return_lse_and_return_aux_together_is_an_error():
    q, k, v = _inputs(Hq=2, Q=16, KV=16)
    with pytest.raises(ValueError, match="return_lse.*return_aux|return_aux.*return_lse"):
        flexattn.flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))


def test_return_aux_wrong_type_is_an_error():
    q, k, v = _inputs(Hq=2, Q=16, KV=16)
    with pytest.raises(TypeError, match="return_aux"):
        flexattn.flex_attention(q, k, v, return_aux={"lse": True})


def test_lse_gradient_through_aux():
    """aux.lse is differentiable like return_lse's LSE."""
    q, k, v = (t.double().requires_grad_() for t in _inputs(Hq=2, Hkv=2, Q=16, KV=16, E=8, seed=3))
    out, aux = flexattn.flex_attention(q, k, v, return_aux=AuxRequest(lse=True))
    (aux.lse.sum() + out.sum()).backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o2, l2 = attention_reference(q2, k2, v2, return_lse=True)
    (l2.sum() + o2.sum()).backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-8, rtol=1e-6)
