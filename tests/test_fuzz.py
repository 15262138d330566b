"""Fuzzing: random mods, shapes and block masks through flex_attention, forward and backward,
against the float64 eager reference.

Each example draws a score mod over the whole operator set (ints, bools, floats, captured tables
of every rank including 0-d, int8..int64 and float16..float64 dtypes, out-of-range and negative
gathers), optionally made deep (a `where` chain of up to 300 levels) and given integer // and %
by captured tables that hold zeros; a mask mod; a shape with odd lengths, GQA, K/V batch
broadcast and Ev != E; and no block mask, a created one, or hand-made tables (rows in random
order, full and partial tiles, garbage past the counts). The kernels run in float64 on the float64
IR, so they must match `attention_reference` (float64 eager torch) to rounding.

CI runs a few examples (derandomized, see conftest.py). For a long run set
``FLEXATTN_FUZZ_EXAMPLES`` (e.g. 2000; ``FLEXATTN_FUZZ_LOG=path`` logs each passed example). Every failure prints hypothesis's falsifying example
(shapes, the mod as IR text, the data seed) and a ``@reproduce_failure`` blob to replay it.
"""

from __future__ import annotations

import os

import torch
from helpers import testing
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import flexattn
from flexattn import ir
from flexattn.block_mask import BlockMask
from flexattn.mods import Mod
from flexattn.reference import attention_reference

F64 = torch.float64
FUZZ_EXAMPLES = int(os.environ.get("FLEXATTN_FUZZ_EXAMPLES", "4"))
FUZZ_LOG = os.environ.get("FLEXATTN_FUZZ_LOG")  # a long run appends one line per passed example
TOL = 1e-8  # float64 kernels against float64 eager: rounding only


def _deep(draw, node):
    """Wrap ``node`` in a chain of where(q_idx >= kv_idx + c, x * a, x + d): deep, bounded values."""
    depth = draw(st.sampled_from([0, 0, 20, 300]))
    for i in range(depth):
        cond = ir.binary("ge", ir.input_("q_idx"), ir.binary("add", ir.input_("kv_idx"), i % 7 - 3))
        node = ir.where(cond, ir.binary("mul", node, 0.99), ir.binary("add", node, 0.001 * (i % 5)))
    return node


def _int_division(draw, node, buffers):
    """Add float(t0[q] // t1[kv] + t0[q] % t1[kv]) * 0.01 with int tables that contain zeros."""
    if not draw(st.booleans()):
        return node, buffers
    dtype = draw(st.sampled_from([torch.int8, torch.int32, torch.int64, torch.uint8]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    lo = 0 if dtype == torch.uint8 else -6
    num = torch.randint(lo, 50, (draw(st.integers(1, 9)),), generator=g).to(dtype)
    den = torch.randint(lo, 7, (draw(st.integers(1, 9)),), generator=g).to(dtype)
    den[0] = 0
    b_num = ir.Buffer(len(buffers), f"buf{len(buffers)}", dtype, 1)
    b_den = ir.Buffer(len(buffers) + 1, f"buf{len(buffers) + 1}", dtype, 1)
    a = ir.load(b_num, [ir.input_("q_idx")])  # out of range reads give 0
    d = ir.load(b_den, [ir.input_("kv_idx")])
    term = ir.binary("add", ir.binary("floordiv", a, d), ir.binary("mod", a, d))
    node = ir.binary("add", node, ir.binary("mul", ir.cast(term, F64), 0.01))
    return node, [*buffers, num, den]


def _hand_made_tables(draw, Bm, Hm, n_q, n_kv, seed):
    """Random kv tables: each row lists distinct blocks in random order, split into partial and
    full, with garbage (negative, out of range) past the counts."""
    g = torch.Generator().manual_seed(seed)
    with_full = draw(st.booleans())
    cols = n_kv + draw(st.integers(0, 2))
    num = torch.zeros(Bm, Hm, n_q, dtype=torch.int32)
    idx = torch.randint(-5, 3 * n_kv + 3, (Bm, Hm, n_q, cols), generator=g, dtype=torch.int32)
    fnum, fidx = num.clone(), idx.clone().flip(-1)
    for b in range(Bm):
        for h in range(Hm):
            for r in range(n_q):
                perm = torch.randperm(n_kv, generator=g)
                k = int(torch.randint(0, n_kv + 1, (1,), generator=g))
                chosen = perm[:k]
                kf = int(torch.randint(0, k + 1, (1,), generator=g)) if with_full else 0
                full, part = chosen[:kf], chosen[kf:]
                num[b, h, r], idx[b, h, r, :len(part)] = len(part), part.to(torch.int32)
                fnum[b, h, r], fidx[b, h, r, :len(full)] = len(full), full.to(torch.int32)
    return (num, idx) + ((fnum, fidx) if with_full else (None, None))


@st.composite
def problems(draw):
    node, bufs = draw(testing.score_irs(max_depth=3, max_buffers=2))
    # torch has no derivative for floor_divide on floats (autodiff's 0 is exact, but the
    # reference cannot say so).
    assume(not any(n.op == "floordiv" and n.dtype.is_floating_point for n in ir.toposort(node)))
    node = _deep(draw, testing.to_float64(node))
    node, bufs = _int_division(draw, node, testing.buffers_float64(bufs))
    mask = draw(testing.mask_irs(max_depth=3, max_buffers=2))
    Hkv, G = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    B = draw(st.integers(1, 2))
    shape = dict(B=B, Bkv=draw(st.sampled_from([1, B])), Hq=Hkv * G, Hkv=Hkv, L=draw(st.integers(1, 70)),
                 S=draw(st.integers(1, 70)), E=draw(st.sampled_from([16, 24, 40])),
                 Ev=draw(st.sampled_from([8, 16, 24])))
    block = dict(kind=draw(st.sampled_from(["none", "created", "hand_made"])),
                 size=draw(st.sampled_from([16, 32, (16, 32), (32, 16)])),
                 per_batch=draw(st.booleans()), per_head=draw(st.booleans()))
    return (node, bufs), mask, shape, block, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


def _block_mask(block, mask, shape, seed, draw_tables):
    B, Hq, L, S = shape["B"], shape["Hq"], shape["L"], shape["S"]
    mask_mod = Mod("mask", mask[0], mask[1], name="fuzz_mask")
    size = block["size"]
    Bm = B if block["per_batch"] else None
    Hm = Hq if block["per_head"] else None
    if block["kind"] == "none":
        return None
    if block["kind"] == "created":
        return flexattn.create_block_mask(mask_mod, Bm, Hm, L, S, device="cpu", BLOCK_SIZE=size)
    qb, kvb = (size, size) if isinstance(size, int) else size
    tables = draw_tables(Bm or 1, Hm or 1, -(-L // qb), -(-S // kvb), seed)
    return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=size, mask_mod=mask_mod, seq_lengths=(L, S))


def _loss_grads(out, lse, inputs, seed):
    g = torch.Generator().manual_seed(seed + 1)
    loss = (out * torch.randn(out.shape, generator=g, dtype=F64)).sum()
    w = torch.randn(lse.shape, generator=g, dtype=F64)
    loss = loss + torch.where(torch.isfinite(lse), lse.double() * w, 0.0).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(problem=problems(), data=st.data())
def test_fuzz_attention_forward_and_backward_against_float64(problem, data):
    (node, bufs), mask, s, block, also_no_grad, seed = problem
    bm = _block_mask(block, mask, s, seed, lambda *a: _hand_made_tables(data.draw, *a))
    mod = Mod("score", node, bufs, name="fuzz_score")
    note(f"score_mod: {ir.to_text(node)[:2000]}\nmask_mod: {ir.to_text(mask[0])}\nshape: {s}\nblock: {block}\n"
         f"seed: {seed}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s["B"], s["Hq"], s["L"], s["E"], generator=g, dtype=F64).requires_grad_()
    k = torch.randn(s["Bkv"], s["Hkv"], s["S"], s["E"], generator=g, dtype=F64).requires_grad_()
    v = torch.randn(s["Bkv"], s["Hkv"], s["S"], s["Ev"], generator=g, dtype=F64).requires_grad_()
    gqa = s["Hq"] != s["Hkv"]

    out, lse = flexattn.flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL, msg=lambda m: f"out: {m}")
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=TOL, rtol=TOL, msg=lambda m: f"lse: {m}")

    got = _loss_grads(out, lse, (q, k, v), seed)
    want = _loss_grads(ref, ref_lse, (q, k, v), seed)
    for name, a, b in zip(["dq", "dk", "dv"], got, want):
        b = torch.zeros_like(a) if b is None else b  # e.g. every row masked: no path to the input
        assert not torch.isnan(a).any(), f"{name} has NaN"
        torch.testing.assert_close(a, b, atol=TOL * 10, rtol=TOL * 10, msg=lambda m: f"{name}: {m}")

    if also_no_grad:  # without autograd, short queries take the split-KV decoding kernel
        with torch.no_grad():
            out2, lse2 = flexattn.flex_attention(q, k, v, score_mod=mod, block_mask=bm, enable_gqa=gqa,
                                                 return_lse=True)
        torch.testing.assert_close(out2, ref.detach(), atol=TOL, rtol=TOL, msg=lambda m: f"no-grad out: {m}")
        torch.testing.assert_close(lse2.double(), ref_lse.detach().double(), atol=TOL, rtol=TOL,
                                   msg=lambda m: f"no-grad lse: {m}")
    if FUZZ_LOG:
        with open(FUZZ_LOG, "a") as f:
            f.write(f"ok seed={seed} shape={s} block={block['kind']} nodes={len(ir.toposort(node))}\n")
