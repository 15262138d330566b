"""Deterministic mode on the GPU: the same inputs give bitwise the same gradients, run after run.

Run on the device machine: ``pytest -m gpu tests/test_deterministic_gpu.py``. bfloat16 at head
dim 128 (where the default backward's dQ on sm_90 is a sum of reduce-adds in no fixed order; in
deterministic mode the Hopper kernel leaves dQ to a dQ pass where the mask reads captured
tensors), a document mask and a relative-position table, with and without its gradient (many
scores add into each entry): five backward passes, every gradient bitwise equal, and close to the
float64 reference. Without captured tensors the Hopper kernel adds dQ itself, each tile's parts in
a fixed order (`test_ordered_dq_adds`).
"""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn.kernels import backward as bwd
from flexattn.reference import attention_reference
from helpers import testing

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
B, H, S, D = 2, 4, 1001, 128


def _inputs(table_grad: bool):
    g = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, generator=g).bfloat16().requires_grad_() for _ in range(3))
    table = (0.5 * torch.randn(H, 2 * S, device=DEVICE, generator=g)).requires_grad_(table_grad)
    d_out = torch.randn(B, H, S, D, device=DEVICE, generator=g)
    d_lse = torch.randn(B, H, S, device=DEVICE, generator=g)
    doc = (torch.arange(S, device=DEVICE) * 5 // S).repeat(B, 1)  # 5 documents, per batch row

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    bm = flexattn.create_block_mask(same_doc, B, 1, S, S, device=DEVICE)
    return q, k, v, table, d_out, d_lse, bm


def _rel(table):
    return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + S]


@pytest.mark.parametrize("table_grad", [True, False])
def test_five_backward_passes_are_bitwise_equal(table_grad, monkeypatch):
    q, k, v, table, d_out, d_lse, bm = _inputs(table_grad)
    inputs = (q, k, v, table) if table_grad else (q, k, v)
    runs = testing.record_calls(monkeypatch, bwd, "run")

    def grads(options):
        out, lse = flexattn.flex_attention(q, k, v, score_mod=_rel(table), block_mask=bm, return_lse=True,
                                           kernel_options=options)
        return testing.weighted_grads(out, lse, inputs, d_out, d_lse)

    first = grads({"DETERMINISTIC": True})
    for i in range(4):
        if i < 3:
            again = grads({"DETERMINISTIC": True})
        else:  # (torch's flag, around the call only: cuBLAS in the reference would refuse it)
            enabled = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
            try:
                again = grads(None)
            finally:
                torch.use_deterministic_algorithms(enabled)
        for name, a, b in zip(("dq", "dk", "dv", "d table"), first, again):
            assert torch.equal(a, b), f"run {i + 2}: {name} differs from run 1 in {(a != b).sum().item()} elements"
    for plan, *_ in runs:  # (on sm_90: the Gluon kernel's dK and dV, and a dQ pass: the Gluon one, or
        # the Triton one where the table needs a gradient, which it sums exactly)
        assert isinstance(plan, bwd.HopperPlan) and not plan.main.constexprs["COMPUTE_DQ"]
        if table_grad:
            assert type(plan.dq_pass) is bwd.Plan and plan.dq_pass.exact_grads
        else:
            assert isinstance(plan.dq_pass, bwd.HopperDqPlan)

    default = grads(None)
    q64, k64, v64, t64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v, table))
    ref = testing.weighted_grads(*attention_reference(q64, k64, v64, score_mod=_rel(t64), block_mask=bm,
                                                      return_lse=True), (q64, k64, v64, t64)[:len(inputs)],
                                 d_out.double(), d_lse.double())
    eager = testing.weighted_grads(*attention_reference(q, k, v, score_mod=_rel(table), block_mask=bm, dtype=None,
                                                        return_lse=True), inputs, d_out, d_lse)
    for name, a, e, r, dflt in zip(("dq", "dk", "dv", "d table"), first, eager, ref, default):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        if name == "d table":
            # Each entry sums ~B*S signed terms through the flash-style dS (Delta from the bf16
            # output): the bar is the default backward's error, whose float atomics sum the same terms.
            err = (a.double() - r).norm().item()
            err_default = (dflt.double() - r).norm().item()
            assert err <= 1.1 * err_default + 1e-4 * r.norm().item(), (err, err_default)
            continue
        testing.assert_close_to_reference(a, e, r, factor=3.0, name=name)


ORDERED = {"DETERMINISTIC": True, "DQ_PASS": False}  # (the ordered adds also where the dQ pass is the default)


def _softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def _ordered_cases():
    """(name, Hq, Hkv, Q_LEN, KV_LEN, D, score_mod, mask_mod, BLOCK_SIZE): no block mask with GQA
    and a soft-cap; causal with KV blocks of two programs' tiles; a sliding window across
    lengths at head dim 64. Lengths that no tile divides."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx + 200 >= kv_idx) & (q_idx - kv_idx < 300)

    return [("no mask, GQA, soft-cap", 4, 2, 1001, 1001, 128, _softcap, None, None),
            ("causal, KV blocks of 256", 4, 4, 1100, 1100, 128, None, causal, (128, 256)),
            ("sliding window, Q_LEN != KV_LEN", 2, 2, 700, 1300, 64, None, window, 128)]


@pytest.mark.parametrize("case", _ordered_cases(), ids=lambda c: c[0])
def test_ordered_dq_adds(case, monkeypatch):
    """Deterministic mode without captured tensors: the one pass adds dQ in each tile's fixed
    order (DQ_ORDERED), five passes are bitwise equal, and the gradients are as close to the
    float64 reference as torch's own bfloat16 math."""
    _, Hq, Hkv, Q_LEN, KV_LEN, Dh, score_mod, mask_mod, block = case
    g = torch.Generator(device=DEVICE).manual_seed(11)
    q = torch.randn(2, Hq, Q_LEN, Dh, device=DEVICE, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(2, Hkv, KV_LEN, Dh, device=DEVICE, generator=g).bfloat16().requires_grad_() for _ in range(2))
    d_out = torch.randn(2, Hq, Q_LEN, Dh, device=DEVICE, generator=g)
    d_lse = torch.randn(2, Hq, Q_LEN, device=DEVICE, generator=g)
    bm = None if mask_mod is None else flexattn.create_block_mask(mask_mod, None, None, Q_LEN, KV_LEN, device=DEVICE,
                                                                   BLOCK_SIZE=block)
    runs = testing.record_calls(monkeypatch, bwd, "run")

    def grads():
        out, lse = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True,
                                           enable_gqa=Hq != Hkv, kernel_options=ORDERED)
        return testing.weighted_grads(out, lse, (q, k, v), d_out, d_lse)

    first = grads()
    for i in range(4):
        for name, a, b in zip(("dq", "dk", "dv"), first, grads()):
            assert torch.equal(a, b), f"run {i + 2}: {name} differs from run 1 in {(a != b).sum().item()} elements"
    for plan, *_ in runs:
        assert isinstance(plan, bwd.HopperPlan) and plan.ordered and plan.main.constexprs["DQ_ORDERED"]
        assert plan.dq_pass is None and plan.main.constexprs["COMPUTE_DQ"]

    kw = dict(score_mod=score_mod, block_mask=bm, enable_gqa=Hq != Hkv, return_lse=True)
    leaves = tuple(t.detach().double().requires_grad_() for t in (q, k, v))
    ref = testing.weighted_grads(*attention_reference(*leaves, **kw), leaves, d_out.double(), d_lse.double())
    eager = testing.weighted_grads(*attention_reference(q, k, v, dtype=None, **kw), (q, k, v), d_out, d_lse)
    for name, a, e, r in zip(("dq", "dk", "dv"), first, eager, ref):
        assert torch.isfinite(a).all(), f"{name} has non-finite values"
        testing.assert_close_to_reference(a, e, r, factor=3.0, name=name)
