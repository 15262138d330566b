"""The block-sparse forward kernel on a CUDA GPU at realistic sizes (``pytest -m gpu``).

bf16/fp16 inputs, S up to 8k, head dims 64 and 128, against the eager reference in float32: the
kernel's error must stay within a small multiple of eager attention computed in the inputs' dtype
(`helpers.testing.assert_close_to_reference`). Skipped without a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import testing
from flexattn.attention import flex_attention
from flexattn.block_mask import create_block_mask
from flexattn.reference import attention_reference

pytestmark = pytest.mark.gpu

FORCE = {"FORCE_USE_FLEX_ATTENTION": True}


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window_1024(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def make_document_causal(S: int, device):
    lengths = torch.tensor([S // 2, S // 3, S - S // 2 - S // 3])
    doc = torch.repeat_interleave(torch.arange(3), lengths).to(device=device, dtype=torch.int32)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return document_causal


def make_alibi(H: int, device):
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def make_tempered_bias(H: int, device):
    """An affine score_mod with every coefficient in use (a negative score factor on some heads)."""
    temp = torch.linspace(-1.0, 2.0, H, device=device)
    bias = torch.linspace(-3.0, 3.0, H, device=device)

    def tempered_bias(score, b, h, q_idx, kv_idx):
        return score * temp[h] + bias[h] + 0.01 * (q_idx - 2 * kv_idx)

    return tempered_bias


def run_and_check(B, Hq, Hkv, S_Q, S_KV, D, dtype, score_mod=None, mask_mod=None, block=128, options=None):
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, Hq, S_Q, D, device=dev, dtype=dtype)
    k = torch.randn(B, Hkv, S_KV, D, device=dev, dtype=dtype)
    v = torch.randn(B, Hkv, S_KV, D, device=dev, dtype=dtype)
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S_Q, S_KV, device=dev, BLOCK_SIZE=block)
    gqa = Hq != Hkv
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True,
                              kernel_options={**FORCE, **(options or {})})
    common = dict(score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, dtype=torch.float32, **common)
    eager, eager_lse = testing.eager_reference(q, k, v, options, **common)
    testing.assert_close_to_reference(out, eager, ref, factor=2.0, name="out")
    # The float32 reference is itself accurate to ~1e-6 at these magnitudes.
    testing.assert_close_to_reference(lse, eager_lse.float(), ref_lse, factor=2.0, atol=1e-4, name="lse")
    assert not out.isnan().any()
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [1024, 4096])
def test_dense(S, D, dtype):
    run_and_check(2, 8, 8, S, S, D, dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_causal_8k(D):
    run_and_check(1, 4, 4, 8192, 8192, D, torch.bfloat16, mask_mod=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sliding_window_softcap(dtype):
    run_and_check(2, 8, 8, 4096, 4096, 128, dtype, score_mod=softcap, mask_mod=sliding_window_1024)


def test_document_alibi_gqa_uneven_lengths():
    # Lengths that are multiples of no block size; GQA 4:1.
    S = 3001
    run_and_check(2, 16, 4, S, S, 64, torch.bfloat16, score_mod=make_alibi(16, "cuda"),
                  mask_mod=make_document_causal(S, "cuda"))


def test_q_len_differs_from_kv_len():
    def suffix_causal(b, h, q_idx, kv_idx):  # queries are the last 1000 positions of 5000
        return q_idx + 4000 >= kv_idx

    run_and_check(1, 8, 2, 1000, 5000, 128, torch.bfloat16, mask_mod=suffix_causal)


@pytest.mark.parametrize("options", [
    {"PRESCALE_QK": True},
    {"BLOCKS_ARE_CONTIGUOUS": True},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
])
def test_kernel_options(options):
    run_and_check(1, 8, 8, 2048, 2048, 128, torch.bfloat16, mask_mod=causal, options=options)


def test_fully_masked_rows():
    def late_keys(b, h, q_idx, kv_idx):  # rows q_idx < 300 see nothing
        return (kv_idx <= q_idx) & (q_idx >= 300)

    out, lse = run_and_check(1, 4, 4, 2048, 2048, 64, torch.bfloat16, mask_mod=late_keys)
    assert (out[:, :, :300] == 0).all() and (lse[:, :, :300] == -math.inf).all()
    assert torch.isfinite(lse[:, :, 300:]).all()


def test_permuted_layout_and_head_dim_80():
    torch.manual_seed(0)
    B, H, S, D = 2, 8, 2000, 80
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    out = flex_attention(q, k, v, kernel_options=FORCE)
    assert out.stride() == torch.empty_like(q).stride()
    ref = attention_reference(q, k, v, dtype=torch.float32)
    eager = attention_reference(q, k, v, dtype=torch.bfloat16)
    testing.assert_close_to_reference(out, eager, ref, factor=2.0, name="out")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_tanh_error_is_level_with_libdevice(dtype):
    """Soft-capping with the hardware's tanh.approx.f32 (the default for 16-bit inputs): the
    output's error against float64 is at most 1.1x that with libdevice's tanh, and dQ's 1.25x."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2048, 128, device="cuda", dtype=dtype) * 2 for _ in range(3))
    g = torch.randn_like(q)
    q64 = q.double().requires_grad_()
    ref = attention_reference(q64, k, v, score_mod=softcap)
    (ref_dq,) = torch.autograd.grad(ref, q64, g.double())
    err = {}
    for fast in (True, False):
        qq = q.clone().requires_grad_()
        out = flex_attention(qq, k, v, score_mod=softcap, kernel_options={"FAST_TANH": fast})
        (dq,) = torch.autograd.grad(out, qq, g)
        err[fast] = ((out.double() - ref).abs().max().item(), (dq.double() - ref_dq).abs().max().item())
    assert err[True][0] <= 1.1 * err[False][0], err
    assert err[True][1] <= 1.25 * err[False][1], err
