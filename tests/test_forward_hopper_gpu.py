"""The Gluon Hopper forward on an H100/H200 (``pytest -m gpu``): BACKEND='FLASH' makes every call
here run it (or fail saying why it cannot), against the float32 reference with the same error bound
as the Triton template's tests. Skipped without a compute capability 9.0 GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import testing
from flexattn.attention import flex_attention
from flexattn.auxiliary import AuxRequest
from flexattn.block_mask import create_block_mask
from flexattn.kernels import plans
from flexattn.reference import attention_reference
from test_forward_gpu import (causal, make_alibi, make_document_causal, make_tempered_bias, sliding_window_1024,
                              softcap)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")]

FLASH = {"BACKEND": "FLASH"}


def check(q, k, v, score_mod=None, mask_mod=None, scale=None, options=FLASH, block=128):
    S_Q, S_KV = q.shape[2], k.shape[2]
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S_Q, S_KV, device="cuda",
                                                         BLOCK_SIZE=block)
    gqa = q.shape[1] != k.shape[1]
    common = dict(score_mod=score_mod, block_mask=bm, enable_gqa=gqa, scale=scale)
    out, aux = flex_attention(q, k, v, **common, kernel_options=options,
                              return_aux=AuxRequest(lse=True, max_scores=True))
    ref, ref_lse = attention_reference(q, k, v, dtype=torch.float32, return_lse=True, **common)
    eager, eager_lse = attention_reference(q, k, v, dtype=q.dtype, return_lse=True, **common)
    testing.assert_close_to_reference(out, eager, ref, factor=2.0, name="out")
    testing.assert_close_to_reference(aux.lse, eager_lse.float(), ref_lse, factor=2.0, atol=1e-4, name="lse")
    assert not out.isnan().any()
    return out, aux


def qkv(B, Hq, Hkv, S_Q, S_KV, D, dtype=torch.bfloat16, Bkv=None):
    torch.manual_seed(0)
    q = torch.randn(B, Hq, S_Q, D, device="cuda", dtype=dtype)
    k = torch.randn(Bkv or B, Hkv, S_KV, D, device="cuda", dtype=dtype)
    v = torch.randn(Bkv or B, Hkv, S_KV, D, device="cuda", dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [1000, 4096])
def test_dense(S, dtype):
    check(*qkv(2, 8, 8, S, S, 128, dtype))


def test_causal_ragged_gqa_broadcast_batch():
    check(*qkv(2, 8, 2, 1500, 1500, 128, Bkv=1), mask_mod=causal)


def test_mods_with_captured_tensors():
    S = 3001
    check(*qkv(2, 16, 4, S, S, 128), score_mod=make_alibi(16, "cuda"), mask_mod=make_document_causal(S, "cuda"))


def test_sliding_window_softcap():
    check(*qkv(1, 8, 8, 4096, 4096, 128, torch.float16), score_mod=softcap, mask_mod=sliding_window_1024)


@pytest.mark.parametrize("group", [3, 16])
def test_head_groups(group):
    """The programs taking their query tiles HEAD_GROUP heads at a time (program_tile): 8 heads in
    groups of 3 (a first group of 2) and all together give the grid order's output and LSE."""
    q, k, v = qkv(2, 4, 2, 1500, 1500, 128)
    out, aux = check(q, k, v, mask_mod=causal, options={**FLASH, "HEAD_GROUP": group})
    base, base_aux = check(q, k, v, mask_mod=causal, options={**FLASH, "HEAD_GROUP": 1})
    assert torch.equal(out, base) and torch.equal(aux.lse, base_aux.lse)
    assert {getattr(p, "sizes", (None,))[-1] for p in plans.FORWARD.plans.values()} >= {min(group, 8), 1}


@pytest.mark.parametrize("D", [64, 128])
def test_max_scores_and_negative_scale(D):
    q, k, v = qkv(1, 4, 4, 777, 1234, D)
    for scale in (0.05, -0.08):
        out, aux = check(q, k, v, scale=scale)
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        torch.testing.assert_close(aux.max_scores, s.amax(-1), atol=2e-2, rtol=1e-3)


def test_fully_masked_rows():
    def late_keys(b, h, q_idx, kv_idx):  # rows q_idx < 300 see nothing
        return (kv_idx <= q_idx) & (q_idx >= 300)

    out, aux = check(*qkv(1, 4, 4, 2048, 2048, 128), mask_mod=late_keys)
    assert (out[:, :, :300] == 0).all() and (aux.lse[:, :, :300] == -math.inf).all()
    assert torch.isfinite(aux.lse[:, :, 300:]).all()


@pytest.mark.parametrize("D, S_KV", [(128, 384), (256, 320)])
def test_kv_length_inside_a_block_past_the_tiles(D, S_KV):
    """KV blocks of 256 positions, several of the kernel's KV tiles each, and a KV length that is a
    multiple of the tiles but not of the blocks: the last block's tiles past KV_LEN must be masked
    (they were visited unmasked, their zero-filled keys counted in the softmax: found by
    tests/test_fuzz_gpu.py)."""
    q, k, v = qkv(2, 4, 2, 300, S_KV, D)
    doc = (torch.arange(S_KV, device="cuda") // 100).to(torch.int32)

    def documents(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    for mask_mod in (causal, documents):
        check(q, k, v, mask_mod=mask_mod, block=256)
        check(q, k, v, mask_mod=mask_mod, block=(128, 256))


@pytest.mark.parametrize("S_Q, S_KV", [(1000, 1000), (4097, 4097), (193, 450)])
def test_head_dim_64_takes_three_consumers(S_Q, S_KV):
    """Head dim 64: 192-row tiles over three consumer warp groups, at lengths that are not multiples
    of the tiles (the last tile's rows past Q_LEN), with GQA and K/V broadcast over the batch, a
    score_mod, a captured bias table and an affine score_mod."""
    rel = torch.randn(4, 255, device="cuda")

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + rel[h, (q_idx - kv_idx).clamp(-127, 127) + 127]

    check(*qkv(2, 8, 2, S_Q, S_KV, 64, Bkv=1))
    check(*qkv(1, 8, 8, S_Q, S_KV, 64, torch.float16), score_mod=softcap)
    check(*qkv(2, 4, 4, S_Q, S_KV, 64), score_mod=relative_bias)
    check(*qkv(2, 8, 4, S_Q, S_KV, 64), score_mod=make_tempered_bias(8, "cuda"))
    assert {p.kernel.constexprs["BLOCK_M"] for p in plans.FORWARD.plans.values()
            if p.descriptors is not None and p.out_shape[3] == 64} == {192}


@pytest.mark.parametrize("S_Q, S_KV", [(1000, 1000), (4097, 4097), (193, 450)])
def test_head_dim_64_reads_a_masks_128_row_lists_regrouped(S_Q, S_KV):
    """Head dim 64 under block masks of 128-row blocks: the 192-row tiles read the lists regrouped
    to their rows (a tile spans one and a half blocks: partial where either lists a block, full
    where both hold it full), at lengths off both block sizes, with GQA and K/V broadcast over the
    batch, captured tensors in both mods, and 64-row blocks (three to a tile)."""
    plans.FORWARD.plans.clear()
    check(*qkv(2, 8, 2, S_Q, S_KV, 64, Bkv=1), mask_mod=causal)
    check(*qkv(1, 8, 8, S_Q, S_KV, 64), mask_mod=sliding_window_1024, score_mod=softcap)
    check(*qkv(2, 8, 4, S_Q, S_KV, 64), score_mod=make_alibi(8, "cuda"),
          mask_mod=make_document_causal(max(S_Q, S_KV), "cuda"))
    check(*qkv(1, 4, 4, S_Q, S_KV, 64), mask_mod=causal, block=(64, 128))
    regrouped = [p for p in plans.FORWARD.plans.values() if p.descriptors is not None and p.out_shape[3] == 64]
    assert regrouped and {(p.rows, p.kernel.constexprs["SPARSE_Q_BLOCK_SIZE"]) for p in regrouped} == {(192, 192)}


@pytest.mark.parametrize("S", [333, 2100])
def test_head_dim_256(S):
    check(*qkv(2, 4, 4, S, S, 256))
    check(*qkv(1, 8, 2, S, S, 256), score_mod=make_alibi(8, "cuda"), mask_mod=make_document_causal(S, "cuda"))


@pytest.mark.parametrize("D", [128, 256])
def test_affine_score_mods(D):
    """ALiBi and a tempered bias take the kernel's SCORE_AFFINE path (flexattn/codegen/affine.py):
    output, LSE and the row max, at lengths that are not multiples of the tiles."""
    for fn in (make_alibi(8, "cuda"), make_tempered_bias(8, "cuda")):
        plans.FORWARD.plans.clear()
        q, k, v = qkv(2, 8, 2, 1500, 1700, D)
        out, aux = check(q, k, v, score_mod=fn, mask_mod=causal)
        assert [(p.descriptors is not None, p.kernel.constexprs["SCORE_AFFINE"])
                for p in plans.FORWARD.plans.values()] == [(True, True)]  # (the Gluon kernel's plan)
        kk = k.float().repeat_interleave(4, dim=1)
        i, j = torch.arange(1500, device="cuda")[:, None], torch.arange(1700, device="cuda")[None, :]
        h = torch.arange(8, device="cuda")[:, None, None]
        s = fn((q.float() @ kk.transpose(-1, -2)) / math.sqrt(D), 0, h, i, j).masked_fill(i < j, -math.inf)
        torch.testing.assert_close(aux.max_scores, s.amax(-1), atol=3e-2, rtol=1e-3)


def test_permuted_layout():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3000, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    out, _ = check(q, k, v, mask_mod=causal)
    assert out.stride() == torch.empty_like(q).stride()


def test_level_with_the_triton_template():
    q, k, v = qkv(2, 8, 8, 2048, 2048, 128)
    flash, _ = check(q, k, v, mask_mod=causal)
    triton_out, _ = check(q, k, v, mask_mod=causal, options={"BACKEND": "TRITON"})
    assert (flash.float() - triton_out.float()).abs().max().item() < 2e-2


def test_flash_refuses_what_it_cannot_run():
    q, k, v = qkv(1, 4, 4, 512, 512, 80)
    with pytest.raises(ValueError, match="BACKEND='FLASH'.*head dims"):
        flex_attention(q, k, v, kernel_options=FLASH)
    q, k, v = qkv(1, 4, 4, 512, 512, 64)  # 128-column tiles against a mask's 64-column blocks
    bm = create_block_mask(causal, None, None, 512, 512, device="cuda", BLOCK_SIZE=(128, 64))
    with pytest.raises(ValueError, match="BACKEND='FLASH'.*KV blocks of 64 are not multiples of the kernel's 128"):
        flex_attention(q, k, v, block_mask=bm, kernel_options=FLASH)
