"""torch 2.13 API parity: BlockMask fields both ways, create_block_mask's signature, lazy submodules."""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import BlockMask, masks
from flexattn.reference import attention_reference

S = 40


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, S, 16, generator=g) for _ in range(3))


def test_create_block_mask_has_torchs_signature():
    theirs = list(inspect.signature(torch_flex.create_block_mask).parameters.values())
    ours = list(inspect.signature(flexattn.create_block_mask).parameters.values())
    assert [(p.name, p.kind) for p in ours[:len(theirs)]] == [(p.name, p.kind) for p in theirs]
    for a, b in zip(ours, theirs):
        if a.name != "device":  # ours: None means CUDA when available, as torch's accelerator default
            assert a.default == b.default, a.name


def test_dq_write_order_is_refused_with_the_reason():
    with pytest.raises(NotImplementedError, match=r"compute_dq_write_order=True.*already deterministic"):
        flexattn.create_block_mask(masks.causal, None, None, S, S, device="cpu", compute_dq_write_order=True)
    with pytest.raises(TypeError, match=r"dq_kv_order must be a bool"):
        flexattn.create_block_mask(masks.causal, None, None, S, S, device="cpu", dq_kv_order=torch.arange(2))


def test_flexattn_block_mask_in_torch_flex_attention():
    q, k, v = _qkv()
    mod = masks.document(lengths=[13, 27], causal=True)
    bm = flexattn.create_block_mask(mod, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    ref = attention_reference(q, k, v, mask_mod=mod)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = torch_flex.flex_attention(q, k, v, block_mask=bm)
        compiled = torch.compile(torch_flex.flex_attention, backend="aot_eager", fullgraph=True)(q, k, v, block_mask=bm)
    torch.testing.assert_close(eager.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.double(), ref, atol=1e-5, rtol=1e-5)


def test_torch_block_mask_in_flexattn():
    q, k, v = _qkv(1)
    mod = masks.sliding_window(9)
    tbm = torch_flex.create_block_mask(mod, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    ref = attention_reference(q, k, v, mask_mod=mod)
    torch.testing.assert_close(flexattn.flex_attention(q, k, v, block_mask=tbm).double(), ref, atol=1e-5, rtol=1e-5)
    ours = BlockMask.from_torch(tbm)
    for a, b in zip(ours.as_tuple(), tbm.as_tuple(), strict=True):  # the same 17 fields, tables shared
        assert a is b if isinstance(b, torch.Tensor) or callable(b) else a == b
    assert torch.equal(ours.to_dense(), tbm.to_dense()) and ours.mask_mod is mod
    with pytest.raises(TypeError, match=r"block_mask must be a torch or flexattn BlockMask, got dict"):
        BlockMask.from_torch({})


def test_submodules_are_attributes_without_importing_them():
    code = ("import sys, flexattn\n"
            "names = ['decode', 'paged', 'masks', 'scores', 'viz', 'integrations']\n"
            "assert not any('flexattn.' + n in sys.modules for n in names), 'imported eagerly'\n"
            "print([getattr(flexattn, n).__name__ for n in names])\n"
            "print(flexattn.AuxRequest(lse=True), flexattn.AuxOutput())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "['flexattn.decode', 'flexattn.paged', 'flexattn.masks', 'flexattn.scores', 'flexattn.viz', "
        "'flexattn.integrations']",
        "AuxRequest(lse=True, max_scores=False) AuxOutput(lse=None, max_scores=None)"]
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        flexattn.nope  # noqa: B018


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_in_the_inputs_dtype_is_torchs_eager(dtype):
    """``attention_reference(dtype=None)`` costs what torch's eager flex_attention costs in that
    dtype (Q K^T and softmax in float32): the error budget the kernel tests allow is a multiple of it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, 2, 64, 64, generator=g) * s).to(dtype) for s in (3.0, 3.0, 1.0))
    score_mod = flexattn.scores.softcap(20.0)
    bm = torch_flex.create_block_mask(masks.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "not compiled" notice
        theirs, their_lse = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True)
    ours, our_lse = attention_reference(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True, dtype=None)
    assert ours.dtype == dtype and our_lse.dtype == torch.float32
    torch.testing.assert_close(ours, theirs)  # the dtype's default tolerances
    torch.testing.assert_close(our_lse, their_lse, atol=1e-4, rtol=1e-5)
