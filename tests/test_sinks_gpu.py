"""Attention sinks on a CUDA GPU (``pytest -m gpu``): the Gluon Hopper forward (bfloat16, head dim
128: BACKEND='FLASH'), the Triton forward, decoding and the backward, at odd lengths, against the
float64 reference with the error bound of the other GPU tests (`helpers.testing`)."""

from __future__ import annotations

import pytest
import torch

from helpers import testing
from flexattn.attention import flex_attention
from flexattn.auxiliary import AuxRequest
from flexattn.block_mask import create_block_mask
from flexattn.decode import decode_attention
from flexattn.reference import attention_reference
from test_forward_gpu import causal, make_alibi, softcap

pytestmark = pytest.mark.gpu

HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="needs an sm_90 GPU")


def qkv(B, Hq, Hkv, S_Q, S_KV, D, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return (torch.randn(B, Hq, S_Q, D, device="cuda", dtype=dtype),
            torch.randn(B, Hkv, S_KV, D, device="cuda", dtype=dtype),
            torch.randn(B, Hkv, S_KV, D, device="cuda", dtype=dtype))


def sinks_for(H):
    return 2 * torch.randn(H, device="cuda", generator=torch.Generator("cuda").manual_seed(1))


def empty_rows_causal(b, h, q_idx, kv_idx):  # rows below 300 see nothing
    return (q_idx >= kv_idx) & (q_idx >= 300)


def check_forward(q, k, v, sinks, options, score_mod=None, mask_mod=None):
    S_Q, S_KV = q.shape[2], k.shape[2]
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S_Q, S_KV, device="cuda")
    common = dict(score_mod=score_mod, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1], sinks=sinks)
    out, aux = flex_attention(q, k, v, kernel_options=options, return_aux=AuxRequest(lse=True), **common)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **common)
    eager, eager_lse = attention_reference(q, k, v, dtype=q.dtype, return_lse=True, **common)
    testing.assert_close_to_reference(out, eager, ref, factor=2.0, name="out")
    testing.assert_close_to_reference(aux.lse, eager_lse.float(), ref_lse, factor=2.0, atol=1e-4, name="lse")
    assert torch.isfinite(aux.lse).all()
    return out, aux.lse


@HOPPER
@pytest.mark.parametrize("case", ["plain", "causal gqa", "alibi", "softcap empty rows"])
def test_hopper_forward(case):
    """The Gluon kernel's epilogue in each of its softmax's units (raw scores, an affine score_mod,
    a score_mod) and on rows that see nothing."""
    H = 8
    q, k, v = qkv(2, H, 2 if case == "causal gqa" else H, 1001, 1337, 128)
    sinks = sinks_for(H)
    score_mod = {"alibi": make_alibi(H, "cuda"), "softcap empty rows": softcap}.get(case)
    mask_mod = {"causal gqa": causal, "alibi": causal, "softcap empty rows": empty_rows_causal}.get(case)
    out, lse = check_forward(q, k, v, sinks, {"BACKEND": "FLASH"}, score_mod, mask_mod)
    if case == "softcap empty rows":
        assert (out[:, :, :300] == 0).all()
        torch.testing.assert_close(lse[:, :, :300], sinks.view(1, H, 1).expand(2, H, 300))


@HOPPER
@pytest.mark.parametrize("score_mod", [None, softcap])
def test_hopper_forward_head_dim_64(score_mod):
    """Three consumers' epilogues (192-row tiles, head dim 64), no block mask: at 128-row blocks
    masked calls at this head dim take the Triton template."""
    q, k, v = qkv(2, 8, 4, 1001, 1337, 64)
    check_forward(q, k, v, sinks_for(8), {"BACKEND": "FLASH"}, score_mod)


@pytest.mark.parametrize("D", [64, 128])
def test_triton_forward(D):
    q, k, v = qkv(2, 8, 4, 777, 1031, D)
    check_forward(q, k, v, sinks_for(8), {"BACKEND": "TRITON"}, softcap, causal)


@pytest.mark.parametrize("split", [1, 16])
def test_decoding(split):
    q, k, v = qkv(3, 8, 2, 1, 4099, 128)
    sinks = sinks_for(8)
    lengths = torch.tensor([4099, 1, 0], device="cuda", dtype=torch.int32)
    out, lse = decode_attention(q, k, v, enable_gqa=True, return_lse=True, kv_lengths=lengths, sinks=sinks,
                                kernel_options={"SPLIT_KV": split})

    def valid(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    common = dict(mask_mod=valid, enable_gqa=True, sinks=sinks, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, **common)
    eager, eager_lse = attention_reference(q, k, v, dtype=q.dtype, **common)
    testing.assert_close_to_reference(out, eager, ref, factor=2.0, name="out")
    testing.assert_close_to_reference(lse, eager_lse.float(), ref_lse, factor=2.0, atol=1e-4, name="lse")
    assert (out[2] == 0).all() and torch.allclose(lse[2], sinks.view(8, 1))


@pytest.mark.parametrize("dq_pass", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_backward(D, dq_pass):
    """The sinks' gradient next to dQ, dK, dV (the Hopper backward at these shapes on sm_90, the
    Triton one elsewhere; ``dq_pass``: dQ and Delta, which d sinks reads, by the Hopper backward's
    dQ pass): within 3x eager bfloat16 autograd's error of float32 autograd through the
    reference, as the other backward tests (test_backward_gpu.py)."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, 4, 1001, 1001, D))
    sinks = sinks_for(4).requires_grad_()
    g = torch.Generator(device="cuda").manual_seed(2)
    d_out = torch.randn(1, 4, 1001, D, device="cuda", generator=g)
    d_lse = torch.randn(1, 4, 1001, device="cuda", generator=g)
    bm = create_block_mask(causal, None, None, 1001, 1001, device="cuda")
    kw = dict(block_mask=bm, return_lse=True)
    got = testing.weighted_grads(*flex_attention(q, k, v, sinks=sinks, kernel_options={"DQ_PASS": dq_pass}, **kw),
                                 (q, k, v, sinks), d_out, d_lse)
    eager = testing.weighted_grads(*attention_reference(q, k, v, sinks=sinks, dtype=None, **kw), (q, k, v, sinks),
                                   d_out, d_lse)
    q32, k32, v32, s32 = (t.detach().float().requires_grad_() for t in (q, k, v, sinks))
    ref = testing.weighted_grads(*attention_reference(q32, k32, v32, sinks=s32, dtype=torch.float32, **kw),
                                 (q32, k32, v32, s32), d_out, d_lse)
    for name, a, e, r in zip(("dq", "dk", "dv", "d sinks"), got, eager, ref):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        testing.assert_close_to_reference(a, e, r, factor=3.0, name=f"D={D} {name}")
