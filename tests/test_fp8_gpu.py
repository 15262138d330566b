"""float8 forward on the GPU (``pytest -m gpu``): real float8 tensor-core dots, P rounded to
float8, against float64 attention of the dequantised inputs."""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn.kernels import layout, plans
from flexattn.reference import attention_reference
from helpers.testing import dequantised, quantise_fp8 as quantise


def softcap(score, b, h, q_idx, kv_idx):
    return 20 * torch.tanh(score / 20)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", ["no mask", "causal", "softcap"])
def test_fp8_forward_error_on_the_gpu(case):
    torch.manual_seed(0)
    S = 2048
    (q, dq), (k, dk), (v, dv) = (quantise(torch.randn(2, 8, S, 128, device="cuda")) for _ in range(3))
    bm = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda") \
        if case == "causal" else None
    sm = softcap if case == "softcap" else None
    out = flexattn.flex_attention(q, k, v, score_mod=sm, block_mask=bm, descale_q=dq, descale_k=dk, descale_v=dv)
    assert out.dtype == torch.bfloat16
    ref = attention_reference(dequantised(q, dq), dequantised(k, dk), dequantised(v, dv), score_mod=sm,
                              block_mask=bm)
    bf16 = flexattn.flex_attention(*(dequantised(t, s).bfloat16() for t, s in ((q, dq), (k, dk), (v, dv))),
                                   score_mod=sm, block_mask=bm)
    err = (out.double() - ref).abs().max().item()
    err_bf16 = (bf16.double() - ref).abs().max().item()
    print(f"fp8 {case}: max error {err:.4f} (bf16 of the same values {err_bf16:.4f}), max |out| "
          f"{ref.abs().max().item():.3f}")
    assert not out.isnan().any()
    # P rounded to float8 (3 mantissa bits) bounds the error at a few percent of the output's range.
    assert err <= 0.06 * ref.abs().max().item()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon forward needs an sm_90 GPU")
@pytest.mark.parametrize("S, D, Hkv", [(1000, 128, 2), (2100, 256, 8), (333, 128, 8)])
def test_fp8_gluon_forward(S, D, Hkv, nan_outputs):
    """The Gluon kernel's float8 path (BACKEND='FLASH' insists on it): ragged lengths (V's rows
    padded for TMA), GQA, head dim 256, document + causal mask; level with the Triton template's
    float8 error on the same inputs, and the descales applied."""
    torch.manual_seed(0)
    (q, dq), (k, dk), (v, dv) = (quantise(torch.randn(2, h, S, D, device="cuda") * x)
                                 for h, x in ((8, 1.0), (Hkv, 1.0), (Hkv, 3.0)))
    doc = torch.arange(S, device="cuda") // 300

    def documents(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    bm = flexattn.create_block_mask(documents, None, None, S, S, device="cuda")
    common = dict(block_mask=bm, enable_gqa=Hkv != 8, descale_q=dq, descale_k=dk, descale_v=dv)
    out = flexattn.flex_attention(q, k, v, **common, kernel_options={"BACKEND": "FLASH"})
    triton_out = flexattn.flex_attention(q, k, v, **common, kernel_options={"BACKEND": "TRITON"})
    ref = attention_reference(dequantised(q, dq), dequantised(k, dk), dequantised(v, dv), block_mask=bm,
                              enable_gqa=Hkv != 8)
    err = (out.double() - ref).abs().max().item()
    err_triton = (triton_out.double() - ref).abs().max().item()
    print(f"fp8 Gluon S={S} D={D}: max error {err:.4f} (Triton template {err_triton:.4f})")
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert err <= 0.06 * ref.abs().max().item() and err <= 1.5 * err_triton + 1e-3
    half = flexattn.flex_attention(q, k, v, **dict(common, descale_v=dv / 2), kernel_options={"BACKEND": "FLASH"})
    torch.testing.assert_close(half.float(), out.float() / 2, atol=0, rtol=1e-2)
    bad = flexattn.flex_attention(q, k, v, **dict(common, descale_q=-dq), kernel_options={"BACKEND": "FLASH"})
    assert bad.isnan().all()  # the kernel folds scale * descales into exp2: a negative one is NaN


@pytest.mark.parametrize("S, D", [(1000, 72), (64, 128), (4097, 64)])
def test_k_major_copy_on_the_gpu(S, D):
    """The float8 V layout copy (a Triton kernel on the GPU): the same bytes, KV dimension
    innermost, also from a non-contiguous input and on the direct launches after the first."""
    torch.manual_seed(0)
    v = quantise(torch.randn(2, S, 3, D, device="cuda"))[0].transpose(1, 2)  # [2, 3, S, D], not contiguous
    for _ in range(3):
        out = layout.k_major(v)
        assert out.shape == v.shape and out.stride(2) == 1
        assert torch.equal(out.view(torch.uint8), v.view(torch.uint8))
    assert layout.k_major(out) is out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon forward needs an sm_90 GPU")
@pytest.mark.parametrize("D", [128, 256])
def test_fp8_alibi_takes_the_affine_form(D):
    """ALiBi + causal on float8 (the descales fold into the affine form's score factor): the Gluon
    kernel and the Triton template against float64 attention of the dequantised inputs."""
    torch.manual_seed(0)
    S, H = 1500, 8
    (q, dq), (k, dk), (v, dv) = (quantise(torch.randn(1, H, S, D, device="cuda") * x) for x in (1.0, 1.0, 3.0))
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H)

    def alibi(score, b, h, qi, ki):
        return score + slopes[h] * (ki - qi)

    bm = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cuda")
    ref = attention_reference(dequantised(q, dq), dequantised(k, dk), dequantised(v, dv), score_mod=alibi,
                              block_mask=bm)
    for backend in ("FLASH", "TRITON"):
        plans.FORWARD.plans.clear()
        out = flexattn.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, descale_q=dq, descale_k=dk,
                                      descale_v=dv, kernel_options={"BACKEND": backend})
        assert [p.kernel.constexprs["SCORE_AFFINE"] for p in plans.FORWARD.plans.values()] == [True]
        assert out.dtype == torch.bfloat16 and not out.isnan().any()
        assert (out.double() - ref).abs().max().item() <= 0.06 * ref.abs().max().item(), backend
