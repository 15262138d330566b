"""The Gluon Hopper backward on an H100/H200 (``pytest -m gpu``): every call here checks that the
plan is the Hopper one, then compares dQ, dK, dV with the float32 reference (the bound of the
Triton backward's tests: 3x the error of a bfloat16 eager backward) and with the Triton backward
(BACKEND='TRITON') on the same inputs. Lengths that are not multiples of the 64x128 tiles, GQA,
K/V broadcast over the batch, block masks with partial and full blocks, score mods with captured
tensors (no gradient for them), a dLSE term and fully masked rows. Skipped without an sm_90 GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers import testing
from flexattn.attention import flex_attention
from flexattn.block_mask import create_block_mask
from flexattn.call import resolve_mask_mod
from flexattn.kernels import backward as bwd, plans
from flexattn.reference import attention_reference
from test_forward_gpu import (causal, make_alibi, make_document_causal, make_tempered_bias, sliding_window_1024,
                              softcap)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")]


def _grads(fn, inputs, d_out, d_lse):
    return testing.weighted_grads(*fn(), inputs, d_out, d_lse)


class _Counted:
    """Counts the Hopper backward's launches while in use."""

    def __enter__(self):
        self.calls, self.run = 0, bwd._run_hopper

        def counted(*args):
            self.calls += 1
            return self.run(*args)

        bwd._run_hopper = counted
        return self

    def __exit__(self, *exc):
        bwd._run_hopper = self.run


def check(B, Hq, Hkv, S_Q, S_KV, D, score_mod=None, mask_mod=None, Bkv=None, dtype=torch.bfloat16, with_lse=True,
          heads_inside=False, options=None):
    """``heads_inside``: Q, K, V are [B, S, H, D] tensors seen as [B, H, S, D]. ``options``: the
    Hopper call's kernel_options."""
    g = torch.Generator(device="cuda").manual_seed(S_Q * 7 + S_KV + D)

    def make(b, h, s):
        if heads_inside:
            return torch.randn(b, s, h, D, device="cuda", generator=g).to(dtype).transpose(1, 2).requires_grad_()
        return torch.randn(b, h, s, D, device="cuda", generator=g).to(dtype).requires_grad_()

    q, k, v = make(B, Hq, S_Q), make(Bkv or B, Hkv, S_KV), make(Bkv or B, Hkv, S_KV)
    d_out = torch.randn(B, Hq, S_Q, D, device="cuda", generator=g)
    d_lse = torch.randn(B, Hq, S_Q, device="cuda", generator=g) * (1.0 if with_lse else 0.0)
    bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, S_Q, S_KV, device="cuda")
    kw = dict(score_mod=score_mod, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=True)

    with _Counted() as hopper_runs:
        got = _grads(lambda: flex_attention(q, k, v, **kw, kernel_options=options), (q, k, v), d_out, d_lse)
        # (more than once where the tuner timed the Hopper backward's two forms: a block mask, S=4k)
        assert hopper_runs.calls >= 1, "the backward did not run the Hopper kernel"
        ran = hopper_runs.calls
        tri = _grads(lambda: flex_attention(q, k, v, **kw, kernel_options={"BACKEND": "TRITON"}), (q, k, v),
                     d_out, d_lse)
        assert hopper_runs.calls == ran, "BACKEND='TRITON' ran the Hopper backward"
    eager = _grads(lambda: attention_reference(q, k, v, dtype=None, **kw), (q, k, v), d_out, d_lse)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _grads(lambda: attention_reference(q32, k32, v32, dtype=torch.float32, **kw), (q32, k32, v32), d_out,
                 d_lse)
    for name, a, t, e, r in zip(("dq", "dk", "dv"), got, tri, eager, ref):
        assert a.shape == r.shape and a.dtype == dtype and a.stride() == t.stride()
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        testing.assert_close_to_reference(a, e, r, factor=3.0, name=name)
        err, err_triton = ((x.double() - r.double()).abs().max().item() for x in (a, t))
        assert err <= 1.5 * err_triton + 1e-3, f"{name}: error {err:.3g}, the Triton backward's {err_triton:.3g}"
    return got


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [1000, 2048])
def test_dense(S, D):
    check(2, 4, 4, S, S, D)


def test_float16_causal_ragged_gqa_broadcast_batch():
    check(2, 8, 2, 1500, 1500, 128, mask_mod=causal, Bkv=1, dtype=torch.float16)


def test_heads_inside_layout():
    dq, _, _ = check(2, 4, 4, 1000, 1000, 128, mask_mod=causal, heads_inside=True)
    assert dq.transpose(1, 2).is_contiguous()


def test_cross_lengths():
    check(1, 4, 4, 700, 1333, 128)
    check(1, 4, 4, 1333, 700, 64, mask_mod=sliding_window_1024)


def test_mods_with_captured_tensors():
    S = 3001
    check(2, 16, 4, S, S, 128, score_mod=make_alibi(16, "cuda"), mask_mod=make_document_causal(S, "cuda"))


@pytest.mark.parametrize("D", [64, 128])
def test_int64_document_ids_run_as_int32_ranks(D):
    """int64 document ids that the mask only compares run as their int32 ranks
    (flexattn/block_mask/ranks.py), here ids whose low 32 bits are all equal, which a cast to int32
    would merge into one document; GQA, ALiBi, a length no tile divides."""
    S = 2049
    lengths = torch.tensor([S // 2, S // 3, S - S // 2 - S // 3])
    doc = (torch.repeat_interleave(torch.arange(3), lengths) * 2**32 + 5).to("cuda")

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    bm = create_block_mask(document_causal, None, None, S, S, device="cuda")
    assert [t.dtype for t in resolve_mask_mod(bm, torch.device("cuda"))[1]] == [torch.int32]
    check(2, 8, 2, S, S, D, score_mod=make_alibi(8, "cuda"), mask_mod=document_causal)


@pytest.mark.parametrize("D", [64, 128])
def test_affine_score_mods(D):
    """ALiBi and a tempered bias take the kernel's SCORE_AFFINE path (flexattn/codegen/affine.py)."""
    for fn in (make_alibi(8, "cuda"), make_tempered_bias(8, "cuda")):
        plans.BACKWARD.plans.clear()
        check(2, 8, 2, 1000, 1300, D, score_mod=fn, mask_mod=causal)
        assert any(getattr(p, "main", None) is not None and p.main.constexprs.get("SCORE_AFFINE")
                   for p in plans.BACKWARD.plans.values())


@pytest.mark.parametrize("D", [64, 128])
def test_score_mod_of_constant_derivative_evaluated_per_score(D):
    """A score_mod that is not affine (abs) but whose derivative in the score is a constant takes
    LATE_DP_WAIT with its own arithmetic: the mask (one that reads a captured tensor) is evaluated
    again after dP's wait on the partial tiles."""
    def distance(score, b, h, q_idx, kv_idx):
        return 0.5 * score - 0.01 * (q_idx - kv_idx).abs()

    S = 1100
    plans.BACKWARD.plans.clear()
    check(1, 4, 4, S, S, D, score_mod=distance, mask_mod=make_document_causal(S, "cuda"))
    mains = [p.main.constexprs for p in plans.BACKWARD.plans.values() if getattr(p, "main", None) is not None]
    assert any(c["LATE_DP_WAIT"] and not c["SCORE_AFFINE"] for c in mains)


def test_softcap_sliding_window_without_lse_grad():
    check(1, 8, 8, 4096, 4096, 128, score_mod=softcap, mask_mod=sliding_window_1024, with_lse=False)


def test_fully_masked_rows():
    def late_keys(b, h, q_idx, kv_idx):  # rows q_idx < 300 see nothing
        return (kv_idx <= q_idx) & (q_idx >= 300)

    dq, _, _ = check(1, 4, 4, 2048, 2048, 128, mask_mod=late_keys)
    assert (dq[:, :, :300] == 0).all()


@pytest.mark.parametrize("defer", [False, True])
def test_both_dq_schedules(monkeypatch, defer):
    """The consumers meeting every step for dQ, and dQ deferred to the next step (DEFER_DQ, which
    `bwd.defer_dq` picks per call), forced on calls of both head dims: a GQA group (the deferred
    dQ of a head's last step is added in the next head's first), lengths that are not multiples
    of the tiles, partial and full blocks, fully masked rows."""
    monkeypatch.setattr(bwd, "defer_dq", lambda *args: defer)
    plans.BACKWARD.plans.clear()
    S = 1500
    check(2, 8, 2, S, S, 128, score_mod=make_alibi(8, "cuda"), mask_mod=make_document_causal(S, "cuda"))
    check(1, 4, 4, 1333, 700, 64, mask_mod=sliding_window_1024)

    def late_keys(b, h, q_idx, kv_idx):  # rows q_idx < 300 see nothing
        return (kv_idx <= q_idx) & (q_idx >= 300)

    dq, _, _ = check(1, 4, 2, 1000, 1000, 64, mask_mod=late_keys)
    assert (dq[:, :, :300] == 0).all()
    assert {p.main.constexprs["DEFER_DQ"] for p in plans.BACKWARD.plans.values() if hasattr(p, "main")} == {defer}
    plans.BACKWARD.plans.clear()


@pytest.mark.parametrize("group", [3, 8])
def test_head_groups(group):
    """The programs taking their KV tiles HEAD_GROUP heads at a time (program_tile): 4 and 8 (batch
    x KV head) programs' heads in groups of 3 (a first group of 1 or 2) and all together."""
    plans.BACKWARD.plans.clear()
    S = 1500
    check(2, 4, 2, S, S, 128, score_mod=make_alibi(4, "cuda"), mask_mod=make_document_causal(S, "cuda"),
          options={"HEAD_GROUP": group})
    check(2, 4, 4, 1000, 1000, 64, mask_mod=causal, options={"HEAD_GROUP": group})
    assert {p.sizes[-1] for p in plans.BACKWARD.plans.values() if hasattr(p, "main")} == {min(group, 4), min(group, 8)}
    plans.BACKWARD.plans.clear()


@pytest.mark.parametrize("gluon", [True, False])
def test_dq_by_the_dq_pass(gluon, monkeypatch):
    """DQ_PASS: the Gluon kernel computes dK and dV only and a dQ pass writes dQ, the Gluon one
    (templates/backward_dq_hopper.py) or the Triton one: GQA with a score_mod and a document mask
    (partial and full blocks), head dim 64 with lengths that are not multiples of the tiles, K/V
    broadcast over the batch, [B, S, H, D] tensors, fully masked rows; the LSE's gradient (which
    the Gluon pass folds into the Delta it writes) throughout."""
    monkeypatch.setattr(bwd, "GLUON_DQ", gluon)
    plans.BACKWARD.plans.clear()
    on = {"DQ_PASS": True}
    S = 1500
    check(2, 8, 2, S, S, 128, score_mod=make_alibi(8, "cuda"), mask_mod=make_document_causal(S, "cuda"), options=on)
    check(1, 4, 4, 1333, 700, 64, mask_mod=sliding_window_1024, options=on)
    check(2, 4, 2, 1000, 1000, 128, mask_mod=causal, Bkv=1, options=on)
    check(2, 4, 4, 777, 777, 128, mask_mod=causal, heads_inside=True, options=on)  # (O's rows strided too)

    def late_keys(b, h, q_idx, kv_idx):  # rows q_idx < 300 see nothing
        return (kv_idx <= q_idx) & (q_idx >= 300)

    dq, _, _ = check(1, 4, 2, 1000, 1000, 64, mask_mod=late_keys, options=on)
    assert (dq[:, :, :300] == 0).all()
    made = [p for p in plans.BACKWARD.plans.values() if hasattr(p, "main")]
    assert made and all(p.dq_pass is not None and not p.main.constexprs["COMPUTE_DQ"] for p in made)
    assert all(isinstance(p.dq_pass, bwd.HopperDqPlan) == gluon for p in made)
    plans.BACKWARD.plans.clear()


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_kernel_without_dq(persistent, monkeypatch):
    """The kernel without dQ and the Gluon dQ pass as persistent programs
    (`backward.persistent_programs`), a few of them so that each walks many tiles through both K/V (Q/dO)
    buffers (an odd count too), against one program per tile: GQA with ALiBi and a document mask, head dim 64 with cross lengths and a sliding window,
    K/V broadcast over the batch (float32 dK and dV stored from the registers), [B, S, H, D]."""
    monkeypatch.setattr(bwd, "persistent_programs", lambda mask: persistent)
    monkeypatch.setattr(bwd.launch, "num_sms", lambda device: 5)
    plans.BACKWARD.plans.clear()
    on = {"DQ_PASS": True}
    S = 1500
    check(2, 8, 2, S, S, 128, score_mod=make_alibi(8, "cuda"), mask_mod=make_document_causal(S, "cuda"), options=on)
    check(1, 4, 4, 1333, 700, 64, mask_mod=sliding_window_1024, options=on)
    check(3, 4, 2, 1000, 1000, 128, mask_mod=causal, Bkv=1, options=on)
    check(2, 4, 4, 777, 777, 128, score_mod=softcap, heads_inside=True, options=on)
    made = [p for p in plans.BACKWARD.plans.values() if hasattr(p, "main")]
    assert made and all(p.main.constexprs["PERSISTENT"] == persistent for p in made)
    assert all((p.main.grid[0] == 5) == persistent for p in made)
    gluon_dq = [p.dq_pass.main for p in made if isinstance(p.dq_pass, bwd.HopperDqPlan)]
    assert gluon_dq and all(m.constexprs["PERSISTENT"] == persistent and (m.grid[0] == 5) == persistent
                            for m in gluon_dq)
    plans.BACKWARD.plans.clear()


def test_captured_tensor_gradients_take_the_dq_pass():
    """A captured tensor that needs a gradient: the Gluon kernel computes dK and dV, the Triton dQ
    pass dQ and the tensor's gradient, which matches the Triton backward's and float64's."""
    slopes = torch.exp2(-torch.arange(1, 5, dtype=torch.float32, device="cuda")).requires_grad_()
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 4, 700, 128, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    d_out = torch.randn(1, 4, 700, 128, device="cuda", generator=g)

    def alibi(s, b, h, qi, ki):
        return s + slopes[h] * (ki - qi)

    def grads(options):
        out = flex_attention(q, k, v, score_mod=alibi, kernel_options=options)
        return torch.autograd.grad(out, (q, k, v, slopes), d_out)

    with _Counted() as hopper_runs:
        got = grads(None)
        assert hopper_runs.calls == 1
        tri = grads({"BACKEND": "TRITON"})
        assert hopper_runs.calls == 1
    s64 = slopes.detach().double().requires_grad_()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(attention_reference(q64, k64, v64, score_mod=lambda s, b, h, qi, ki: s + s64[h] * (ki - qi)),
                              (q64, k64, v64, s64), d_out.double())
    for name, a, t, r in zip(("dq", "dk", "dv", "d slopes"), got, tri, ref):
        assert torch.isfinite(a).all(), name
        err, err_triton = ((x.double() - r).abs().max().item() for x in (a, t))
        assert err <= 1.5 * err_triton + 1e-3 * r.abs().max().item(), (name, err, err_triton)
