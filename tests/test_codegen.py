"""The Triton emitter against the eager evaluator: random IR trees, then each op's corner cases.

Kernels run on Triton's CPU interpreter (target "interpret") through the elementwise test bench;
the "cuda" target cannot run here, so its text is only parsed and checked for libdevice calls.

Tolerances. Integer and bool results must be bit-exact (the strategies only feed correctly
rounded float values into comparisons, floors and casts, so every correct back end agrees there).
Trees without approximate math (``exact_only``) must match bit for bit as well: + - * / sqrt,
min/max, floor/round, //, % and casts are correctly rounded (or exact) in torch and in the kernel,
and half/bfloat16 ops are computed in float32 and rounded once on both sides. Trees with exp, tanh,
pow, ... compare both results with a float64 evaluation of the same tree: the kernel's error may
be 4x eager's plus 8 ulp (of the tree's lowest float precision) of the largest intermediate
magnitude — the interpreter's exp/sin come from numpy and tanh/pow/expm1 are composed from core
ops, each a few ulp from torch's, and cancellation can carry an intermediate's ulp to the output.
"""

from __future__ import annotations

import ast
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexattn import ir
from helpers import testing as T
from flexattn.codegen import emit
from helpers.grid_kernel import evaluate_grid
from flexattn.mods import Mod

B, H, Q, KV = 2, 3, 37, 45  # odd sizes: partial tiles on both axes (BLOCK 16)
SMALL = settings(max_examples=25, deadline=None)

q_idx, kv_idx, b_in, h_in = (ir.input_(n) for n in ("q_idx", "kv_idx", "b", "h"))
score = ir.input_("score")


def run_kernel(node, buffers=(), grid=(B, H, Q, KV), score_t=None, out=None):
    kind = "mask" if node.dtype == torch.bool else "score"
    if kind == "score" and score_t is None:
        score_t = T.random_score(*grid)
    mod = Mod(kind, node, list(buffers))
    return evaluate_grid(mod, *grid, score=score_t, out=out), score_t


def eager(node, buffers=(), grid=(B, H, Q, KV), score_t=None):
    return T.eval_grid(node, list(buffers), *grid, score_t)


def assert_bit_exact(out, ref):
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    same = (out == ref) | (torch.isnan(out) & torch.isnan(ref)) if out.dtype.is_floating_point else out == ref
    if not same.all():
        i = tuple((~same).nonzero()[0].tolist())
        raise AssertionError(f"{(~same).sum().item()} elements differ, first at {i}: kernel {out[i].item()!r}, "
                             f"eager {ref[i].item()!r}")


def _tolerance(node, buffers, grid, score_t) -> float:
    """8 ulp of the tree's lowest float precision, at its largest float64 intermediate magnitude."""
    f64 = T.to_float64(node)
    env = ir.Evaluator(T.grid_inputs(*grid, score_t.double() if score_t is not None else None),
                       T.buffers_float64(buffers))
    env.value(f64)
    scale = 1.0
    for n in ir.toposort(f64):
        v = env.memo[id(n)]
        if n.dtype.is_floating_point and torch.isfinite(v).any():
            scale = max(scale, v[torch.isfinite(v)].abs().max().item())
    eps = max(torch.finfo(n.dtype).eps for n in ir.toposort(node) if n.dtype.is_floating_point)
    return 8 * eps * scale


def check_tree(node, buffers, grid=(B, H, Q, KV), exact=False):
    out, s = run_kernel(node, buffers, grid)
    ref = eager(node, buffers, grid, s)
    if not node.dtype.is_floating_point or exact:
        assert_bit_exact(out, ref)
        return
    ref64 = T.reference_fp64(node, buffers, *grid, s)
    T.assert_close_to_reference(out, ref, ref64, factor=4, atol=_tolerance(node, buffers, grid, s),
                                elementwise=True)


# ---------------------------------------------------------------------------------------------
# Random trees

grids = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 40), st.integers(1, 40))


@SMALL
@given(T.mask_irs(max_depth=4))
def test_random_masks_bit_exact(case):
    check_tree(*case)


@SMALL
@given(T.mask_irs(max_depth=4))
def test_random_masks_with_kv_values_hoisted_bit_exact(case):
    """The Hopper backward's split of a mask (`emit_mod(hoist_kv=True)`): its KV-only values
    computed first by ``mask_mod_kv``, the rest by ``mask_mod``, give the unsplit mask's result."""
    node, buffers = case
    grid = (B, H, Q, KV)
    ref = eager(node, buffers, grid)
    for poison in (False, True):  # an element the kernel does not write shows in one of the two
        out = torch.full(grid, poison, dtype=torch.bool)
        assert_bit_exact(evaluate_grid(Mod("mask", node, list(buffers)), *grid, out=out, hoist_kv=True), ref)


@SMALL
@given(T.int_irs(max_depth=4), grids)
def test_random_integer_trees_bit_exact(case, grid):
    node, buffers = case
    if node.dtype == torch.int64:
        # Values up to 2**60: float64 holds integers exactly below 2**53, so compare two halves.
        hi = ir.cast(ir.binary("floordiv", node, 2**30), torch.float64)
        lo = ir.cast(ir.binary("mod", node, 2**30), torch.float64)
        node = ir.binary("add", ir.binary("mul", hi, 2.0**30), lo)
    check_tree(ir.cast(node, torch.float64), buffers, grid, exact=True)


@SMALL
@given(T.score_irs(max_depth=4, exact_only=True))
def test_random_exact_score_trees_bit_exact(case):
    check_tree(*case, exact=True)


@SMALL
@given(T.score_irs(max_depth=4), grids)
def test_random_score_trees_close(case, grid):
    check_tree(*case, grid=grid)


@settings(max_examples=15, deadline=None)
@given(T.score_irs(max_depth=3, score_dtype=torch.float16))
def test_random_half_score_trees_close(case):
    node, buffers = case
    s = T.random_score(B, H, Q, KV, dtype=torch.float16)
    out, _ = run_kernel(node, buffers, score_t=s)
    ref = eager(node, buffers, score_t=s)
    T.assert_close_to_reference(out, ref, T.reference_fp64(node, buffers, B, H, Q, KV, s), factor=4,
                                atol=_tolerance(node, buffers, (B, H, Q, KV), s), elementwise=True)


@settings(max_examples=10, deadline=None)
@given(T.score_irs(max_depth=4, max_buffers=3))
def test_cuda_target_emits_valid_python(case):
    node, _ = case
    for target in ("cuda", "interpret"):
        src = emit.prelude(target) + emit.emit_mod(node, "score", target=target).source
        ast.parse(src)
        assert ("libdevice" in src) == (target == "cuda")


# ---------------------------------------------------------------------------------------------
# Integer division and modulo: Python semantics on negatives


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8])
@pytest.mark.parametrize("d", [3, -3, 7, -1, 64])
def test_int_floordiv_mod_python_semantics(dtype, d):
    x = ir.cast(ir.binary("sub", q_idx, kv_idx), dtype)  # -44..36: negatives and positives
    for op in ("floordiv", "mod"):
        node = ir.cast(ir.binary(op, x, ir.const(d, dtype)), torch.float64)
        out, _ = run_kernel(node)
        vals = torch.arange(Q).view(-1, 1) - torch.arange(KV).view(1, -1)
        expected = [[(a // d if op == "floordiv" else a % d) for a in row] for row in vals.tolist()]
        assert out[0, 0].tolist() == expected


def test_int_floordiv_by_runtime_value():
    # divisor from a captured tensor (not a constant), negative and positive
    div = torch.tensor([3, -2, 5, -7], dtype=torch.int32)
    buf = ir.Buffer(0, "div", torch.int32, 1)
    d = ir.load(buf, [ir.binary("mod", h_in, 4)])
    x = ir.binary("sub", q_idx, 20)
    node = ir.cast(ir.binary("add", ir.binary("mul", ir.binary("floordiv", x, d), 100), ir.binary("mod", x, d)),
                   torch.float32)
    out, _ = run_kernel(node, [div], grid=(1, 4, 41, 3))
    for h in range(4):
        dv = div[h].item()
        for q in range(41):
            assert out[0, h, q, 0].item() == ((q - 20) // dv) * 100 + (q - 20) % dv


def test_float_floordiv_mod_match_python():
    vals = torch.tensor([1.0, -1.0, 5.5, -7.25, 0.3, 0.0, -0.0, 1e-3], dtype=torch.float64)
    divs = [0.1, -0.1, 2.0, -3.0, 0.7]
    buf = ir.Buffer(0, "x", torch.float64, 1)
    x = ir.load(buf, [kv_idx])
    for d in divs:
        for op, py in (("floordiv", lambda a, b: a // b), ("mod", lambda a, b: a % b)):
            node = ir.where(ir.binary("ne", score, 1234.0), ir.binary(op, x, d), 0.0)  # a tile, no arithmetic
            out, s = run_kernel(node, [vals], grid=(1, 1, 1, len(vals)))
            expected = [py(a, d) for a in vals.tolist()]
            got = out[0, 0, 0].tolist()
            assert got == expected, (op, d, got, expected)
            # signs of zeros as torch gives them (Python's % differs there: -0.0 % 0.1 is 0.0)
            ref = eager(node, [vals], grid=(1, 1, 1, len(vals)), score_t=s)
            assert torch.equal(torch.signbit(out), torch.signbit(ref)), (op, d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_floordiv_mod_low_precision_match_torch(dtype):
    x = ir.cast(ir.binary("mul", ir.binary("sub", q_idx, 18), 0.37), dtype)
    node = ir.cast(ir.binary("add", ir.binary("floordiv", x, 0.7), ir.binary("mod", x, -0.3)), torch.float32)
    out, _ = run_kernel(node)
    assert_bit_exact(out, eager(node))


# ---------------------------------------------------------------------------------------------
# Promotion, casts, constants


def test_promote_matches_torch_result_type_for_all_pairs():
    dtypes = list(ir.DTYPES.values())
    for a in dtypes:
        ta = torch.ones(2, dtype=a)
        na = ir.Node("input", a, (), "_a")
        for b in dtypes:
            assert ir.promote(na, ir.Node("input", b, (), "_b")) == torch.result_type(ta, torch.ones(2, dtype=b))
        for s in (True, 3, -2, 2.5):
            assert ir.promote(na, s) == torch.result_type(ta, s), (a, s)


@pytest.mark.parametrize("target", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_float_to_int_truncates_and_to_bool(target):
    # score * 3 in (-24, 24): truncation toward zero for negatives; to bool: nonzero, NaN -> True
    s = T.random_score(B, H, Q, KV)
    s[0, 0, 0, :4] = torch.tensor([0.0, -0.0, float("nan") if target == torch.bool else 2.0, -0.5])
    x = ir.binary("mul", score, 3.0)
    if target == torch.uint8:
        x = ir.unary("abs", x)
    node = ir.cast(ir.cast(x if target != torch.bool else score, target), torch.float32)
    out, _ = run_kernel(node, score_t=s)
    if target != torch.bool:
        assert_bit_exact(out, eager(node, score_t=s))
        assert out[0, 0, 0, 3].item() == (-1.0 if target != torch.uint8 else 1.0)  # -1.5 -> -1
    else:
        assert out[0, 0, 0, :4].tolist() == [0.0, 0.0, 1.0, 1.0]
        assert_bit_exact(out, eager(node, score_t=s))


def test_int_to_bool_and_bool_to_int():
    node = ir.binary("add", ir.cast(ir.cast(ir.binary("sub", q_idx, kv_idx), torch.bool), torch.int32),
                     ir.cast(ir.binary("lt", q_idx, 5), torch.int64))
    out, _ = run_kernel(ir.cast(node, torch.float32))
    assert_bit_exact(out, eager(ir.cast(node, torch.float32)))
    assert out.max().item() == 2 and out.min().item() == 0


def test_bool_ordered_comparisons_and_logic():
    a = ir.binary("ge", q_idx, kv_idx)
    c = ir.binary("lt", b_in, 1)  # a scalar bool against tiles
    for op in ir.COMPARISONS + ("and_", "or_", "xor"):
        node = ir.binary(op, a, c)
        out, _ = run_kernel(node)
        assert_bit_exact(out, eager(node))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_math_is_computed_in_float32(dtype):
    buf = ir.Buffer(0, "x", dtype, 1)
    x = ir.load(buf, [kv_idx])
    values = torch.linspace(-3, 3, KV, dtype=torch.float64).to(dtype)
    for op in ("exp", "sin", "tanh", "sigmoid", "log1p", "silu", "gelu"):
        arg = ir.unary("abs", x) if op == "log1p" else x
        node = ir.unary(op, arg)
        src = emit.emit_mod(ir.binary("add", node, ir.cast(score, dtype)), "score", target="interpret").source
        assert ".to(tl.float32)" in src
        out, s = run_kernel(ir.cast(node, torch.float32), [values])
        ref = eager(ir.cast(node, torch.float32), [values], score_t=s)
        # one rounding to half/bfloat16 of a float32 result a few ulp from torch's: at most 1 ulp apart
        ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((out - ref).abs() <= ulp).all(), op
    # exact ops round once from float32, as torch does: bit-exact
    y = ir.binary("add", ir.binary("mul", x, ir.cast(score, dtype)), ir.binary("truediv", x, 3.0))
    node = ir.cast(ir.binary("maximum", y, ir.unary("neg", x)), torch.float32)
    out, s = run_kernel(node, [values])
    assert_bit_exact(out, eager(node, [values], score_t=s))


def test_bfloat16_rounds_to_nearest_even():
    # Triton's interpreter truncates float32 -> bfloat16; the emitter must round like torch.
    node = ir.cast(ir.cast(score, torch.bfloat16), torch.float32)
    s = T.random_score(B, H, Q, KV)
    out, _ = run_kernel(node, score_t=s)
    assert_bit_exact(out, s.to(torch.bfloat16).float())


def test_special_float_constants():
    cases = [
        ir.where(ir.binary("ge", q_idx, kv_idx), score, -math.inf),
        ir.where(ir.binary("lt", q_idx, 3), ir.binary("add", score, math.inf), score),
        ir.where(ir.binary("eq", kv_idx, 7), math.nan, score),
        ir.binary("minimum", score, ir.const(math.inf, torch.float64)),
    ]
    for node in cases:
        src = emit.emit_mod(node, "score", target="cuda").source
        ast.parse(src)
        out, s = run_kernel(node)
        assert_bit_exact(out, eager(node, score_t=s))
    out, _ = run_kernel(cases[0])
    assert torch.isinf(out).sum().item() == B * H * sum(max(KV - q - 1, 0) for q in range(Q))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pow_special_values_follow_torch(dtype):
    # The interpreter's pow is composed from exp2/log2: x ** 0 and 1 ** y must still be 1 when
    # exp2(y * log2|x|) is NaN (0 ** 0, inf ** 0, 1 ** inf), and a base of -0.0 or -inf keeps
    # torch's (IEEE's) sign and magnitude. (A traced exponent: a constant one is unrolled.)
    inf, nan = math.inf, math.nan
    pairs = [(0.0, 0.0), (-0.0, 0.0), (inf, 0.0), (-inf, 0.0), (nan, 0.0), (1.0, inf), (1.0, -inf),
             (1.0, nan), (-1.0, inf), (-1.0, -inf), (-0.0, -1.0), (-0.0, 3.0), (-0.0, -2.0), (-0.0, 0.5),
             (-inf, 2.5), (-inf, -2.5), (-inf, 3.0), (-inf, -3.0), (-2.0, 3.0), (-2.0, 0.5), (0.5, inf),
             (2.0, -inf), (-0.5, inf), (0.0, -1.0), (nan, 1.0), (2.0, nan), (-8.0, 1.0 / 3)]
    base = torch.tensor([[a for a, _ in pairs]], dtype=dtype)
    expo = torch.tensor([[e for _, e in pairs]], dtype=dtype)
    # (indexed by both positions: a value along one axis only is broadcast by adding +0.0)
    node = ir.binary("pow", ir.load(ir.Buffer(0, "base", dtype, 2), [q_idx, kv_idx]),
                     ir.load(ir.Buffer(1, "expo", dtype, 2), [q_idx, kv_idx]))
    grid = (1, 1, 1, len(pairs))
    out, _ = run_kernel(ir.cast(node, torch.float32), [base, expo], grid=grid)
    want = torch.pow(base, expo).float()[0]
    same = (out[0, 0, 0] == want) | (out[0, 0, 0].isnan() & want.isnan())
    same &= (torch.signbit(out[0, 0, 0]) == torch.signbit(want)) | want.isnan()
    bad = [(pairs[i], out[0, 0, 0, i].item(), want[i].item()) for i in (~same).nonzero().flatten().tolist()]
    assert not bad, bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log1p_special_values(dtype):
    x = torch.tensor([math.inf, -1.0, -2.0, math.nan, 0.0, -0.0, 1e-30, 3.0, 1e30], dtype=dtype)
    node = ir.unary("log1p", ir.load(ir.Buffer(0, "x", dtype, 1), [kv_idx]))
    out, _ = run_kernel(ir.cast(node, torch.float32), [x], grid=(1, 1, 1, len(x)))
    torch.testing.assert_close(out[0, 0, 0], torch.log1p(x).float(), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_relu_keeps_nan(dtype):
    # torch.relu(nan) is nan; a NaN dropped to 0 changes a mask such as relu(x) != 0.
    s = T.random_score(B, H, Q, KV)
    s[0, 0, 0, :3] = torch.tensor([float("nan"), -1.0, 2.0])
    node = ir.cast(ir.unary("relu", ir.cast(score, dtype)), torch.float32)
    out, _ = run_kernel(node, score_t=s)
    assert_bit_exact(out, eager(node, score_t=s))
    assert math.isnan(out[0, 0, 0, 0].item()) and out[0, 0, 0, 1:3].tolist() == [0.0, 2.0]


def test_int64_constants():
    big = 2**40 + 3
    x = ir.binary("add", ir.cast(q_idx, torch.int64), big)
    node = ir.binary("gt", ir.binary("sub", x, ir.const(2**40, torch.int64)), kv_idx)
    out, _ = run_kernel(node)
    assert_bit_exact(out, eager(node))
    assert out[0, 0].tolist() == [[q + 3 > k for k in range(KV)] for q in range(Q)]
    val = ir.cast(ir.binary("floordiv", x, 2**20), torch.float64)
    out, _ = run_kernel(val)
    assert out[0, 0, :, 0].tolist() == [float((q + big) // 2**20) for q in range(Q)]


def test_int32_literal_range_is_not_an_error():
    c = ir.const(2**31 - 1, torch.int32)
    node = ir.binary("eq", ir.binary("sub", c, q_idx), c)
    out, _ = run_kernel(node)
    assert out[0, 0, :, 0].tolist() == [q == 0 for q in range(Q)]


# ---------------------------------------------------------------------------------------------
# Gathers


def test_gathers_wrap_negative_and_read_zero_out_of_range():
    # The buffer is a view inside a larger tensor full of a sentinel: an out-of-bounds read shows.
    backing = torch.full((20,), 999.0)
    backing[5:10] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    view = backing[5:10]
    buf = ir.Buffer(0, "v", torch.float32, 1)
    idx = ir.binary("sub", kv_idx, 12)  # -12 .. 32
    node = ir.binary("add", ir.load(buf, [idx]), ir.binary("mul", score, 0.0))
    out, _ = run_kernel(node, [view], grid=(1, 1, 3, KV))
    expected = []
    for k in range(KV):
        i = k - 12
        i = i + 5 if i < 0 else i
        expected.append(view[i].item() if 0 <= i < 5 else 0.0)
    assert out[0, 0, 0].tolist() == expected
    assert (out != 999.0).all()
    assert_bit_exact(out, eager(node, [view], grid=(1, 1, 3, KV), score_t=torch.zeros(1, 1, 3, KV)))


def test_gathers_at_the_index_inputs_skip_the_wrap_but_not_the_bound():
    # q_idx and kv_idx are never negative: no wrap, only the upper bound (reads past the end give 0)
    backing = torch.full((20,), 999.0)
    view = backing[5:15]
    view.copy_(torch.arange(10.0) + 1)
    buf = ir.Buffer(0, "v", torch.float32, 1)
    node = ir.binary("add", ir.load(buf, [kv_idx]), ir.binary("mul", score, 0.0))
    assert "tl.where(kv_idx < 0" not in emit.emit_mod(node, "score").source
    out, _ = run_kernel(node, [view], grid=(1, 1, 2, KV))
    assert out[0, 0, 0].tolist() == [float(k + 1) if k < 10 else 0.0 for k in range(KV)]
    shifted = ir.binary("add", ir.load(buf, [ir.binary("sub", kv_idx, 1)]), ir.binary("mul", score, 0.0))
    assert "tl.where(" in emit.emit_mod(shifted, "score").source  # kv_idx - 1 is -1 at 0: it wraps


def test_kv_hoisting_takes_the_outermost_kv_only_values_that_read_memory():
    doc = ir.Buffer(0, "doc", torch.int32, 1)
    slope = ir.Buffer(1, "slope", torch.float32, 1)
    same_doc = ir.binary("eq", ir.load(doc, [q_idx]), ir.load(doc, [kv_idx]))
    positive = ir.binary("gt", ir.load(slope, [h_in]), 0.0)
    node = ir.binary("and_", ir.binary("and_", same_doc, ir.binary("ge", q_idx, kv_idx)), positive)
    hoisted = emit._kv_invariant_values(node)
    assert [str(n) for n in hoisted] == [str(ir.load(doc, [kv_idx])), str(positive)]
    src = emit.emit_mod(node, "mask", target="gluon", hoist_kv=True)
    assert src.pre_args == ("mask_mod_kv0", "mask_mod_kv1")
    assert "def mask_mod_kv(b, h, kv_idx, B0," in src.source
    assert "def mask_mod(b, h, q_idx, kv_idx, mask_mod_kv0, mask_mod_kv1, B0," in src.source
    docs = torch.arange(KV, dtype=torch.int32) // 7
    slopes = torch.tensor([0.5, -0.25, 2.0])  # head 1 sees nothing
    for poison in (False, True):
        out = torch.full((B, H, Q, KV), poison, dtype=torch.bool)
        hoisted_out = evaluate_grid(Mod("mask", node, [docs, slopes]), B, H, Q, KV, out=out, hoist_kv=True)
        assert_bit_exact(hoisted_out, eager(node, [docs, slopes]))
    assert hoisted_out[:, 0].any() and not hoisted_out[:, 1].any()
    # nothing that reads memory along the KV axis only: one function, as without hoisting
    causal = ir.binary("ge", q_idx, kv_idx)
    assert emit.emit_mod(causal, "mask", hoist_kv=True) == emit.emit_mod(causal, "mask")


def test_nested_and_strided_gathers():
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2, -1, 9], dtype=torch.int64)
    offsets = torch.arange(40, dtype=torch.int32).view(4, 10).t()  # non-contiguous, [10, 4]
    bd = ir.Buffer(0, "doc", torch.int64, 1)
    bo = ir.Buffer(1, "offsets", torch.int32, 2)
    d = ir.load(bd, [ir.binary("mod", q_idx, 9)])
    node = ir.binary("ge", kv_idx, ir.load(bo, [ir.binary("add", d, 3), ir.binary("sub", h_in, 1)]))
    out, _ = run_kernel(node, [doc, offsets])
    assert_bit_exact(out, eager(node, [doc, offsets]))


def test_small_int_index_into_large_buffer():
    # int8 index -1 into a 200-element buffer wraps to 199 (the wrap is computed in int64).
    table = torch.arange(200, dtype=torch.float32) + 1
    idx = ir.cast(ir.binary("sub", kv_idx, 3), torch.int8)
    node = ir.binary("add", ir.load(ir.Buffer(0, "t", torch.float32, 1), [idx]), ir.binary("mul", score, 0.0))
    out, _ = run_kernel(node, [table], grid=(1, 1, 2, 8))
    assert out[0, 0, 0].tolist() == [198.0, 199.0, 200.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_rank0_buffer():
    scale = torch.tensor(0.25, dtype=torch.float64)
    node = ir.binary("mul", score, ir.load(ir.Buffer(0, "scale", torch.float64, 0), []))
    out, s = run_kernel(node, [scale])
    assert_bit_exact(out, eager(node, [scale], score_t=s))


# ---------------------------------------------------------------------------------------------
# Result shapes: broadcasting to the score tile, constant masks


@pytest.mark.parametrize("make", [
    lambda: ir.const(1.5),
    lambda: ir.const(-2.0, torch.float64),
    lambda: ir.binary("mul", ir.cast(h_in, torch.float32), 0.5),
    lambda: ir.cast(ir.binary("sub", q_idx, kv_idx), torch.float32),
    lambda: ir.unary("exp", ir.binary("mul", ir.cast(q_idx, torch.float16), 0.25)),
], ids=["const", "const64", "per_head", "no_score", "half"])
def test_score_mod_not_reading_score_broadcasts(make):
    node = make()
    out, s = run_kernel(node)
    assert out.shape == (B, H, Q, KV) and not torch.isnan(out).any()
    assert_bit_exact(out, eager(node, score_t=s).to(out.dtype).expand(B, H, Q, KV))


@pytest.mark.parametrize("value", [True, False])
def test_constant_mask_mod(value):
    node = ir.const(value)
    prefill = torch.full((B, H, Q, KV), not value)
    out, _ = run_kernel(node, out=prefill)
    assert (out == value).all()
    prefill = torch.full((B, H, Q, KV), not value)
    out, _ = run_kernel(ir.binary("or_", ir.binary("ge", b_in, 0), ir.const(value)) if value else
                        ir.binary("lt", b_in, 0), out=prefill)
    assert (out == value).all()


def test_every_op_has_an_emitter_for_both_targets():
    x = ir.cast(kv_idx, torch.float32)
    i = ir.binary("sub", q_idx, kv_idx)
    for op in ir.UNARY_OPS:
        arg = ir.binary("ne", i, 0) if op in ("not",) else i if op in ("invert",) else x
        node = ir.unary(op, arg)
        for target in ("cuda", "interpret"):
            ast.parse(emit.prelude(target) + emit.emit_mod(ir.cast(node, torch.float32), "score",
                                                            target=target).source)
    for op in ir.BINARY_OPS:
        a, c = (i, ir.binary("mod", kv_idx, 5)) if op in ir.BITWISE or op == "pow" else (x, ir.binary("add", x, 1.0))
        if op == "pow":
            c = 3
        node = ir.cast(ir.binary(op, a, c), torch.float32)
        for target in ("cuda", "interpret"):
            ast.parse(emit.prelude(target) + emit.emit_mod(node, "score", target=target).source)
        out, s = run_kernel(node, grid=(1, 1, 17, 19))
        T.assert_close_to_reference(out, eager(node, grid=(1, 1, 17, 19), score_t=s),
                                    T.reference_fp64(node, [], 1, 1, 17, 19, s), factor=4, elementwise=True,
                                    atol=1e-5 * 100)


def test_cuda_math_uses_libdevice():
    x = ir.cast(kv_idx, torch.float32)
    for op, fn in (("tanh", "libdevice.tanh"), ("expm1", "libdevice.expm1"), ("log1p", "libdevice.log1p"),
                   ("round", "libdevice.rint"), ("tan", "libdevice.tan")):
        src = emit.prelude("cuda") + emit.emit_mod(ir.unary(op, x), "score", target="cuda").source
        assert fn in src and f"_fa_{op}(" in src
    node = ir.binary("add", ir.binary("pow", x, score), ir.binary("mod", score, 0.3))
    src = emit.prelude("cuda") + emit.emit_mod(node, "score", target="cuda").source
    assert "libdevice.pow" in src and "libdevice.fmod" in src and "_fa_pow(" in src and "_fa_mod_float(" in src


def test_emission_is_deterministic():
    node = ir.where(ir.binary("ge", q_idx, kv_idx), ir.unary("tanh", ir.binary("mul", score, 0.5)), -math.inf)
    a = emit.emit_mod(node, "score", target="interpret").source
    b = emit.emit_mod(ir.where(ir.binary("ge", q_idx, kv_idx),
                               ir.unary("tanh", ir.binary("mul", score, 0.5)), -math.inf), "score",
                      target="interpret").source
    assert a == b


def test_fast_tanh_only_for_16_bit_cuda_inputs():
    from flexattn.kernels import options as opts

    assert "tanh.approx.f32" in emit.prelude("cuda", fast_math=True)
    assert "tanh.approx.f32" not in emit.prelude("cuda")
    assert "tanh.approx.f32" not in emit.prelude("interpret", fast_math=True)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert opts.fast_math({}, cuda, torch.bfloat16) and opts.fast_math({}, cuda, torch.float16)
    assert not opts.fast_math({"FAST_TANH": False}, cuda, torch.bfloat16)
    assert not opts.fast_math({}, cuda, torch.float32)
    assert not opts.fast_math({}, cpu, torch.bfloat16)
    # float32 tanh goes through the helper the fast prelude replaces; float64 keeps libdevice's.
    x = ir.input_("score", torch.float32)
    assert "_fa_tanh_f32(" in emit.emit_mod(ir.unary("tanh", x), "score", target="cuda").source
    x64 = ir.input_("score", torch.float64)
    src = emit.emit_mod(ir.unary("tanh", x64), "score", target="cuda").source
    assert "_fa_tanh(" in src and "_fa_tanh_f32(" not in src
