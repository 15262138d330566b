"""`varlen_attention` on a GPU: bfloat16 against torch's ``varlen_attn`` (FlashAttention) and a
float64 reference, forward and backward; the decoding path; offsets checked without a sync."""

import inspect

import pytest
import torch

from flexattn import AuxRequest
from flexattn.varlen import varlen_attention
from test_varlen import offsets, reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
LENGTHS = [1, 517, 0, 130, 2049, 77, 1000]


def inputs(lq, lk, Hq=8, Hkv=8, D=128, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, D, device=DEV, generator=g).to(torch.bfloat16).requires_grad_()  # noqa: E731
    return mk(sum(lq), Hq), mk(sum(lk), Hkv), mk(sum(lk), Hkv)


def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window):
    """torch's ``varlen_attn`` on the same call; GQA by repeated K/V heads and causal by
    ``is_causal`` where this torch's version predates ``enable_gqa`` / ``window_size``."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if "window_size" in params:
        kw["window_size"] = window
    elif window in ((-1, -1), (-1, 0)):
        kw["is_causal"] = window == (-1, 0)
    else:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no window_size (checked on the CPU against float64)")
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def errors(got, ref, eager):
    got, ref, eager = (t.detach().cpu().double() for t in (got, ref, eager))
    return (got - ref).abs().max().item(), (eager - ref).abs().max().item()


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (256, 0), (100, 50)])
def test_matches_torch_varlen_attn_and_float64(window):
    cu = offsets(LENGTHS).to(DEV)
    q, k, v = inputs(LENGTHS, LENGTHS, Hq=8, Hkv=2)
    out, lse = varlen_attention(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), window_size=window, enable_gqa=True,
                                return_aux=AuxRequest(lse=True))
    theirs = torch_varlen(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), window)
    ref, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), cu.cpu(), window)
    ours_err, torch_err = errors(out.cpu(), ref, theirs.cpu())
    assert ours_err <= 3 * torch_err + 1e-3, (ours_err, torch_err)
    seen = ref_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), seen)
    torch.testing.assert_close(lse.cpu().double()[seen], ref_lse[seen], atol=1e-4, rtol=1e-4)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    flash = torch.autograd.grad(theirs, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g.cpu())  # (through the CPU copies the reference took)
    for name, a, b, r in zip("qkv", ours, flash, refs):
        ours_err, torch_err = errors(a.cpu(), r, b.cpu())
        assert ours_err <= 3 * torch_err + 1e-3, (name, ours_err, torch_err)


def test_decoding_path_matches_torch():
    lq, lk = [1] * 6, [4000, 1, 17, 9000, 0, 300]
    cu_q, cu_k = offsets(lq).to(DEV), offsets(lk).to(DEV)
    q, k, v = inputs(lq, lk, Hq=16, Hkv=4)
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu_q, cu_k, 1, 9000, window_size=(-1, 0), enable_gqa=True)
        theirs = torch_varlen(q, k, v, cu_q, cu_k, 1, 9000, (-1, 0))
    ref, _ = reference(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), (-1, 0))
    ours_err, torch_err = errors(out.cpu(), ref, theirs.cpu())
    assert ours_err <= 3 * torch_err + 1e-3, (ours_err, torch_err)
    assert not out[4].any()  # (the sequence without keys)


def test_offsets_are_checked_without_a_host_sync():
    cu = offsets([3, 5]).to(DEV)
    q, k, v = inputs([3, 5], [3, 5])
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            varlen_attention(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))
    finally:
        torch.cuda.set_sync_debug_mode("default")
