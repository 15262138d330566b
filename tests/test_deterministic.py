"""Deterministic mode (kernel option DETERMINISTIC, or torch.use_deterministic_algorithms): the
plan it picks, the exact sums that make captured-tensor gradients order-independent, and its
gradients against autograd through the float64 reference (Triton's CPU interpreter).

Bitwise equality from run to run is a GPU property (the interpreter runs programs in one order):
tests/test_deterministic_gpu.py checks it on the device.
"""

from __future__ import annotations

import math

import pytest
import torch

import flexattn
from flexattn import call
from flexattn.codegen import emit
from flexattn.codegen.cache import load_source
from flexattn import tracer
from flexattn.kernels import backward as bwd, hopper
from flexattn.mods import MASK, SCORE
from flexattn.reference import attention_reference
from helpers import testing

F64 = torch.float64
DET = {"DETERMINISTIC": True}


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


@pytest.fixture
def torch_deterministic():
    """torch.use_deterministic_algorithms(True) for the test, restored after it."""
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def make_qkv(B, Hq, Hkv, L, S, E, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, n, E, generator=g, dtype=F64).to(dtype).requires_grad_()
                 for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))


def weighted(out, lse, seed=1):
    g = torch.Generator().manual_seed(seed)
    d_out = torch.randn(out.shape, generator=g, dtype=F64)
    d_lse = torch.randn(lse.shape, generator=g, dtype=F64)
    return d_out, d_lse


# ---------------------------------------------------------------------------------------------
# The exact sums (templates/prelude.py: _fa_atomic_add_exact)

_ADD_KERNEL = '''

@triton.jit
def add_kernel(G, X, IDX, N, BLOCK: tl.constexpr):
    # G[IDX[i]] += X[i], in the order of i (the interpreter runs programs and lanes in order)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(X + offs, mask=inside, other=0.0)
    i = tl.load(IDX + offs, mask=inside, other=0)
    _fa_atomic_add_exact(G + i * 3, x, inside)
'''


def exact_sums(x: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """The int64 words [n, 3] of the exact sums of ``x`` grouped by ``idx``, added in order."""
    module = load_source(emit.prelude("interpret", exact_sums=True) + _ADD_KERNEL, "exact_sum_test", True)
    words = torch.zeros(n, 3, dtype=torch.int64)
    module.add_kernel[(math.ceil(len(x) / 64),)](words, x, idx, len(x), BLOCK=64)
    return words


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_exact_sums_do_not_depend_on_the_order(dtype):
    """The same contributions (signs mixed, magnitudes 1e-9 .. 1e6) in two orders: float sums
    differ, the exact sums' words are bitwise equal, and their value is the sum rounded once."""
    g = torch.Generator().manual_seed(0)
    n = 1000
    x = (torch.randn(n, generator=g, dtype=F64) * torch.logspace(-9, 6, n, dtype=F64)).to(dtype)
    idx = torch.randint(0, 3, (n,), generator=g)
    perm = torch.randperm(n, generator=g)
    floats = [torch.zeros(3, dtype=dtype).index_add_(0, i, v) for i, v in ((idx, x), (idx[perm], x[perm]))]
    assert not torch.equal(*floats), "these contributions must make float sums order-dependent"
    a, b = exact_sums(x, idx, 3), exact_sums(x[perm].contiguous(), idx[perm].contiguous(), 3)
    assert torch.equal(a, b)
    want = torch.tensor([math.fsum(x[idx == j].double().tolist()) for j in range(3)], dtype=F64)
    torch.testing.assert_close(bwd.exact_sum_value(a, F64), want, rtol=2 ** -52, atol=0.0)


def test_exact_sums_of_values_fixed_point_cannot_hold():
    """Tiny contributions are dropped toward zero; |x| >= 2^63, inf and nan give inf or nan, as a
    float sum of them would; a cancelling sum is exactly zero."""
    cases = [([1e-30, -3.0, 2.5, 1e-30], -0.5), ([1e30, 1.0], math.inf), ([-math.inf, 2.0], -math.inf),
             ([math.inf, -1e19], math.nan), ([math.nan, 1.0], math.nan), ([0.1, 0.7, -0.1, 1e-3, -0.7, -1e-3], 0.0)]
    for values, want in cases:
        words = exact_sums(torch.tensor(values, dtype=F64), torch.zeros(len(values), dtype=torch.int64), 1)
        got = bwd.exact_sum_value(words, F64).item()
        assert (math.isnan(got) and math.isnan(want)) or got == want, (values, got)


# ---------------------------------------------------------------------------------------------
# Which plan


def _backward_plans(monkeypatch):
    return testing.record_calls(monkeypatch, bwd, "run")


def _step(q, k, v, table, options=None):
    L = q.shape[2]

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L]

    out = flexattn.flex_attention(q, k, v, score_mod=rel, kernel_options=options)
    out.sum().backward()


def test_the_option_and_torch_flag_pick_the_deterministic_plan(monkeypatch, torch_deterministic):
    """Unset, DETERMINISTIC follows torch's flag at call time; an explicit value wins; the mode is
    part of the call key, so switching picks the other plan, and a repeated call makes none."""
    runs = _backward_plans(monkeypatch)
    made = testing.record_calls(monkeypatch, bwd, "make_plan")
    q, k, v = make_qkv(1, 2, 2, 19, 19, 16, torch.float32)
    table = torch.randn(2, 40, requires_grad=True)
    call.forget()
    expected = []
    for flag, options, exact in ((True, None, True), (True, {"DETERMINISTIC": False}, False),
                                 (False, None, False), (False, DET, True), (True, None, True)):
        torch.use_deterministic_algorithms(flag)
        _step(q, k, v, table, options)
        expected.append(exact)
    assert [r[0].exact_grads for r in runs] == expected
    assert runs[0][0] is runs[-1][0]  # the same plan again
    assert len(made) == 3  # deterministic, explicitly not, unset: the modes that come again make none


def test_the_hopper_backward_plans_in_deterministic_mode(monkeypatch):
    """The Gluon Hopper backward adds dQ by reduce-adds, by default in no fixed order. In
    deterministic mode it adds them in each dQ tile's fixed order (DQ_ORDERED) without a block
    mask and at head dim 64 under masks that visit a quarter of the blocks or more; where captured
    tensors need gradients the Triton dQ pass writes dQ (one program per query tile, exact sums
    for the captured tensors), and elsewhere (or where DQ_PASS asks) the Gluon dQ pass does,
    beside the kernel's dK and dV."""
    from flexattn.kernels import plans
    from flexattn.kernels.tables import tables_of

    monkeypatch.setattr(hopper, "_machine_reason", lambda query, options: None)
    bias = torch.randn(2)
    doc = torch.arange(512) // 200
    cpu = torch.device("cpu")
    score = tracer.trace(lambda s, b, h, qi, ki: s + bias[h], SCORE, score_dtype=torch.float32, device=cpu)
    causal_fn, documents_fn = (lambda b, h, qi, ki: qi >= ki), (lambda b, h, qi, ki: doc[qi] == doc[ki])
    causal = tracer.trace(causal_fn, MASK, score_dtype=torch.float32, device=cpu)
    documents = tracer.trace(documents_fn, MASK, score_dtype=torch.float32, device=cpu)
    causal_tables = tables_of(flexattn.create_block_mask(causal_fn, None, None, 512, 512, device="cpu"))
    doc_tables = tables_of(flexattn.create_block_mask(documents_fn, None, None, 512, 512, device="cpu"))

    def plan(options, need=(False,), D=128, mask=causal, tables=None):
        q, k, v = (torch.randn(1, 2, 512, D).bfloat16() for _ in range(3))
        assert hopper.backward_reason(q, k, v, q, tables, options) is None
        return plans._make_backward_plan(q, k, v, q, q, score, mask, tables, options, need, score.buffers, False,
                                         launch_once=None)

    def plan_raw(options, L):  # (no score_mod: unmodified scores)
        identity = tracer.trace(lambda s, b, h, qi, ki: s, SCORE, score_dtype=torch.float32, device=cpu)
        q, k, v = (torch.randn(1, 2, L, 64).bfloat16() for _ in range(3))
        return plans._make_backward_plan(q, k, v, q, q, identity, causal, None, options, (), (), False,
                                         launch_once=None)

    default, det, det_grad = plan({}), plan(DET), plan(DET, need=(True,))
    assert isinstance(default, bwd.HopperPlan) and default.dq_pass is None and not default.ordered
    assert default.main.constexprs["COMPUTE_DQ"] and default.preprocess.constexprs["ZERO_DQ"]
    assert not default.main.constexprs["DQ_ORDERED"]
    # (deterministic: the same one pass, its dQ adds ordered by their own warp)
    for p in (det, plan(DET, D=64, tables=causal_tables), plan({**DET, "DQ_PASS": False}, mask=documents,
                                                                tables=doc_tables)):
        assert p.dq_pass is None and p.ordered and p.main.constexprs["DQ_ORDERED"]
        assert p.main.constexprs["COMPUTE_DQ"] and p.preprocess.constexprs["ZERO_DQ"]
    # (captured-tensor gradients: the Triton dQ pass, which sums them exactly)
    assert not det_grad.main.constexprs["COMPUTE_DQ"] and not det_grad.ordered
    assert det_grad.dq_pass.grad_buffers == (0,) and not det_grad.preprocess.constexprs["ZERO_DQ"]
    assert det_grad.dq_pass.exact_grads and not plan({}, need=(True,)).dq_pass.exact_grads
    # (a block mask at head dim 128, one that reads captured tensors, or DQ_PASS: the Gluon dQ
    # pass, which writes Delta itself)
    # (without a mask and a score_mod, up to KV_LEN 4096: the Gluon dQ pass; longer, the ordered adds)
    assert plan_raw(DET, bwd.SHORT_DQ_PASS + 1).ordered
    for p in (plan(DET, tables=causal_tables), plan(DET, D=64, mask=documents, tables=doc_tables),
              plan({**DET, "DQ_PASS": True}), plan_raw(DET, bwd.SHORT_DQ_PASS), plan_raw(DET, 1000)):
        assert isinstance(p.dq_pass, bwd.HopperDqPlan) and p.preprocess is None and not p.ordered
        assert not p.main.constexprs["COMPUTE_DQ"]
    monkeypatch.setattr(bwd, "GLUON_DQ", False)
    assert plan({**DET, "DQ_PASS": True}).dq_pass.grad_buffers == ()
    assert plan({"DQ_PASS": True}).dq_pass is not None and plan({"DQ_PASS": False}).dq_pass is None


def test_deterministic_mode_skips_autotuning():
    """A timed tile choice may differ between processes: deterministic mode takes the defaults."""
    from flexattn.kernels import tuning

    cpu = torch.device("cpu")  # (tuning asked for: on the CPU too)
    for knobs in (tuning.FORWARD_KNOBS, tuning.BACKWARD_KNOBS):
        assert tuning.enabled({"AUTOTUNE": True}, cpu, knobs)
        assert not tuning.enabled({"AUTOTUNE": True, **DET}, cpu, knobs)


# ---------------------------------------------------------------------------------------------
# Gradients against the float64 reference


def _doc_mask(B, H, L, S):
    doc = torch.tensor([i * 3 // L for i in range(max(L, S))])

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return flexattn.create_block_mask(same_doc, B, H, L, S, device="cpu", BLOCK_SIZE=16)


@pytest.mark.parametrize("case", ["rel_table_gqa_documents", "per_head_causal_kv_broadcast"])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_gradients_against_float64(case, dtype):
    """q, k, v and a captured table's gradients (many scores add into one table entry) in
    deterministic mode equal autograd through the float64 reference: to rounding in float64,
    within eager float32's error times a small factor in float32."""
    if case == "rel_table_gqa_documents":  # GQA 4 -> 2, odd lengths, a document block mask
        B, Hq, Hkv, L, S = 2, 4, 2, 37, 37
        table = torch.randn(Hq, 2 * S, dtype=F64)

        def mod(t):
            return lambda score, b, h, q_idx, kv_idx: score + t[h, q_idx - kv_idx + S]
        bm, gqa = _doc_mask(B, Hq, L, S), True
    else:  # one slope per head, causal, K/V of batch 1 broadcast over batch 2
        B, Hq, Hkv, L, S = 2, 2, 2, 29, 33
        table = torch.rand(Hq, dtype=F64)

        def mod(t):
            return lambda score, b, h, q_idx, kv_idx: score - t[h] * (q_idx - kv_idx).abs()
        bm = flexattn.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B, Hq, L, S, device="cpu",
                                        BLOCK_SIZE=16)
        gqa = False
    q, k, v = make_qkv(B, Hq, Hkv, L, S, 16, dtype)
    if case == "per_head_causal_kv_broadcast":
        k, v = (t.detach()[:1].requires_grad_() for t in (k, v))
    t_low = table.to(dtype).requires_grad_()
    t64 = table.clone().requires_grad_()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kw = dict(block_mask=bm, enable_gqa=gqa, return_lse=True)
    got_out = flexattn.flex_attention(q, k, v, score_mod=mod(t_low), kernel_options=DET, **kw)
    d_out, d_lse = weighted(*got_out)
    got = testing.weighted_grads(*got_out, (q, k, v, t_low), d_out, d_lse)
    want = testing.weighted_grads(*attention_reference(q64, k64, v64, score_mod=mod(t64), **kw),
                                  (q64, k64, v64, t64), d_out, d_lse)
    names = ("dq", "dk", "dv", "d table")
    if dtype == F64:
        for name, a, b in zip(names, got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
        return
    eager = testing.weighted_grads(*attention_reference(q, k, v, score_mod=mod(t_low), dtype=None, **kw),
                                   (q, k, v, t_low), d_out.to(dtype), d_lse.to(dtype))
    for name, a, e, b in zip(names, got, eager, want):
        testing.assert_close_to_reference(a, e, b, factor=3.0, name=name)


def test_gradcheck_learnable_tables_deterministic():
    """float64 gradcheck through the exact sums: a relative-position table, per-head slopes and a
    0-d bias, through a causal block mask with partial tiles."""
    q, k, v = make_qkv(1, 2, 2, 26, 30, 16)
    rel = torch.randn(2 * 32 - 1, dtype=F64, requires_grad=True)
    slope = torch.rand(2, dtype=F64, requires_grad=True)
    shift = torch.randn((), dtype=F64, requires_grad=True)
    bm = flexattn.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 2, 26, 30, device="cpu",
                                    BLOCK_SIZE=16)

    def fn(q, k, v, rel, slope, shift):
        def mod(score, b, h, q_idx, kv_idx):
            return score + rel[kv_idx - q_idx + 31] + slope[h] * (kv_idx - q_idx) + shift * score
        return flexattn.flex_attention(q, k, v, score_mod=mod, block_mask=bm, kernel_options=DET)

    assert torch.autograd.gradcheck(fn, (q, k, v, rel, slope, shift), fast_mode=True, atol=1e-7, rtol=1e-6)


def test_ordered_counts_cover_the_tiles_of_whole_blocks(monkeypatch):
    """The ordered adds' counts: one per 64-row dQ tile of every sparse query block, including a
    last block's tiles that start past Q_LEN (the kernel adds nothing there but still counts
    them; counting only the tiles below Q_LEN ran one tile into the next head's counts)."""
    from flexattn.kernels.tables import ordered_q_lists, tables_of

    monkeypatch.setattr(hopper, "_machine_reason", lambda query, options: None)
    q = torch.randn(2, 3, 700, 64).bfloat16()
    causal = tracer.trace(lambda b, h, qi, ki: qi >= ki, MASK, score_dtype=torch.float32, device=torch.device("cpu"))
    tables = tables_of(flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 700, 700, device="cpu"))
    score = tracer.trace(lambda s, b, h, qi, ki: s, SCORE, score_dtype=torch.float32, device=torch.device("cpu"))
    plan = bwd.hopper_plan(q, q, q, score, causal, tables, DET, False, None, True)
    assert plan.ordered and plan.dq_tiles == 6 * 2  # (6 blocks of 128 rows, 11 tiles below Q_LEN)
    assert bwd.dq_counts(plan, q.device).numel() == 2 * 3 * plan.dq_tiles
    lists = ordered_q_lists(tables, 700)
    starts = [(int(e) & 0x7FFF) * 128 + t * 64 for n, row in zip(lists.num.flatten().tolist(), lists.idx.flatten(0, -2))
              for e in row[:n] for t in range(2)]
    assert max(starts) // 64 == plan.dq_tiles - 1
