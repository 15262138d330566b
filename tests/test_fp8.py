"""float8_e4m3fn forward with per-tensor descale factors (FlashAttention-3's API shape), on the
CPU through Triton's interpreter, against float64 attention of the dequantised inputs."""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn.kernels import launch
from flexattn.reference import attention_reference
from helpers.launches import recorded_launches
from helpers.testing import dequantised, quantise_fp8 as quantise

def _inputs(S=150, D=64, Hq=4, Hkv=2, seed=0):
    torch.manual_seed(seed)
    return [quantise(torch.randn(2, h, S, D) * scale) for h, scale in ((Hq, 1.0), (Hkv, 1.0), (Hkv, 3.0))]


def softcap(score, b, h, q_idx, kv_idx):
    return 20 * torch.tanh(score / 20)


@pytest.mark.parametrize("masked", [False, True])
def test_fp8_forward_matches_float64_on_dequantised_inputs(masked, nan_outputs):
    (q, dq), (k, dk), (v, dv) = _inputs()
    S = q.shape[2]
    bm = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S) if masked else None
    out = flexattn.flex_attention(q, k, v, score_mod=softcap, block_mask=bm, enable_gqa=True,
                                  descale_q=dq, descale_k=dk, descale_v=dv)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, S, 64)
    ref = attention_reference(dequantised(q, dq), dequantised(k, dk), dequantised(v, dv), score_mod=softcap,
                              block_mask=bm, enable_gqa=True)
    err = (out.double() - ref).abs().max().item()
    # On the CPU P stays float32 (the interpreter's float8 rounding is wrong), so what is left is the
    # bfloat16 output's rounding; the GPU test (test_fp8_gpu.py) measures float8 P's error.
    assert err <= 1e-2 * ref.abs().max().item(), err
    # ... and without the descales the result is another one (they are applied, not ignored).
    plain = flexattn.flex_attention(q, k, v, score_mod=softcap, block_mask=bm, enable_gqa=True)
    assert (plain.double() - ref).abs().max().item() > 10 * err


def test_descale_v_scales_the_output():
    (q, dq), (k, dk), (v, dv) = _inputs(S=140, D=32)
    one = flexattn.flex_attention(q, k, v, enable_gqa=True, descale_q=dq, descale_k=dk)
    two = flexattn.flex_attention(q, k, v, enable_gqa=True, descale_q=dq, descale_k=dk,
                                  descale_v=torch.tensor([2.0]))
    torch.testing.assert_close(two.float(), 2 * one.float(), atol=0, rtol=1e-2)


def test_descales_that_flip_the_scores_sign_give_nan_not_a_wrong_result():
    # Without a score_mod the kernel folds scale * descale_q * descale_k into exp2's argument,
    # which needs it positive (descale factors are); the host cannot see device values, so a
    # negative product makes the kernel write NaN. With a score_mod nothing is folded.
    (q, dq), (k, dk), (v, dv) = _inputs(S=70, D=32)
    good = flexattn.flex_attention(q, k, v, enable_gqa=True, descale_q=dq, descale_k=dk, descale_v=dv)
    assert not good.isnan().any()
    out = flexattn.flex_attention(q, k, v, enable_gqa=True, descale_q=-dq, descale_k=dk, descale_v=dv)
    assert out.isnan().all()
    ident = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + 0.0, enable_gqa=True,
                                    descale_q=-dq, descale_k=dk, descale_v=dv)
    ref = attention_reference(dequantised(q, -dq), dequantised(k, dk), dequantised(v, dv), enable_gqa=True)
    assert (ident.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


def test_fp8_value_goes_to_the_kernel_k_major():
    """float8 P V takes V with the KV dimension innermost: a row-major value reaches the kernel as
    a K-major copy of itself, a K-major one as it is; both give the same output."""
    (q, dq), (k, dk), (v, dv) = _inputs(S=70, D=32)
    v_k_major = v.transpose(2, 3).contiguous().transpose(2, 3)
    outs = []
    for given in (v, v_k_major):
        seen = recorded_launches(lambda: outs.append(flexattn.flex_attention(
            q, k, given, enable_gqa=True, descale_q=dq, descale_k=dk, descale_v=dv)))
        value_arg = seen[0][1][2]
        assert value_arg.stride(2) == 1
        if given is v:  # the copy's rows of 70 values start 16-byte aligned (TMA reads them on a Hopper)
            assert value_arg.stride(3) == 80 and value_arg.stride(1) == 80 * 32
        assert torch.equal(value_arg.view(torch.uint8), v.view(torch.uint8))
        assert (value_arg is given) == (given is v_k_major)
    assert torch.equal(outs[0], outs[1])


def test_fp8_errors_name_the_argument():
    (q, dq), (k, dk), (v, dv) = _inputs(S=140, D=32)
    with pytest.raises(TypeError, match="descale_k must be a float32 tensor with one element"):
        flexattn.flex_attention(q, k, v, enable_gqa=True, descale_q=dq, descale_k=dk.double())
    with pytest.raises(TypeError, match="descale_q must be a float32 tensor with one element"):
        flexattn.flex_attention(q, k, v, enable_gqa=True, descale_q=torch.ones(2))
    qb = q.to(torch.bfloat16)
    with pytest.raises(TypeError, match="apply to float8_e4m3fn inputs; query is torch.bfloat16"):
        flexattn.flex_attention(qb, qb, qb, descale_q=dq)
    with pytest.raises(TypeError, match="decoding kernel takes float16, bfloat16 or float32"):
        flexattn.decode.decode_attention(q[:, :, :1], k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="float8 flex_attention is forward-only"):
        flexattn.flex_attention(q.clone().requires_grad_(), k, v, enable_gqa=True)
    q32 = torch.randn(1, 2, 140, 32, requires_grad=True)
    with pytest.raises(TypeError, match="key must have query's dtype"):
        flexattn.flex_attention(q32, k[:1], v[:1])


@pytest.mark.parametrize("S, D", [(1, 64), (20, 16)])
def test_short_and_narrow_inputs_get_float8_sized_products(S, D):
    """Float8 tensor-core products take K >= 32 (the GPU compiler refuses less): a KV length or a
    head dim that would shrink the KV tile or the padded head dim below it gets 32. Found by the
    GPU fuzz (tests/test_fuzz_gpu.py): L = S = 1 at head dim 64 did not compile. A tile or block
    size that cannot be 32 is an error that says so."""
    from flexattn.kernels import plans

    plans.FORWARD.plans.clear()
    (q, dq), (k, dk), (v, dv) = _inputs(S=S, D=D)
    descales = dict(descale_q=dq, descale_k=dk, descale_v=dv)
    out = flexattn.flex_attention(q, k, v, enable_gqa=True, **descales)
    ref = attention_reference(dequantised(q, dq), dequantised(k, dk), dequantised(v, dv), enable_gqa=True)
    assert (out.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    (plan,) = plans.FORWARD.plans.values()
    assert plan.kernel.constexprs["BLOCK_N"] == 32 and plan.kernel.constexprs["QK_HEAD_DIM_ROUNDED"] >= 32
    with pytest.raises(ValueError, match=r"kernel_options\['BLOCK_N'\]=16: float8 inputs take KV tiles of at least 32"):
        flexattn.flex_attention(q, k, v, enable_gqa=True, **descales, kernel_options={"BLOCK_N": 16})
    bm = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match=r"KV blocks are a multiple of 32 positions \(.*\); its BLOCK_SIZE gives 16"):
        flexattn.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, **descales)
