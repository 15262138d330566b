"""The IR: interning, structural keys, torch type promotion, folding, printer, errors, evaluator."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexattn import ir
from helpers import testing as T

q, kv, b, h = (ir.input_(n) for n in ("q_idx", "kv_idx", "b", "h"))
score = ir.input_("score")
bias = ir.Buffer(0, "bias", torch.float16, 2)
doc = ir.Buffer(1, "doc", torch.int64, 1)


def causal_doc_mask():
    same_doc = ir.binary("eq", ir.load(doc, [q]), ir.load(doc, [kv]))
    return ir.binary("and_", ir.binary("ge", q, kv), same_doc)


# ---------------------------------------------------------------------------------------------
# Interning and keys


def test_structurally_equal_nodes_are_the_same_object():
    assert causal_doc_mask() is causal_doc_mask()
    assert ir.binary("add", score, 1.0) is ir.binary("add", score, 1.0)
    assert ir.load(bias, [h, q]) is ir.load(ir.Buffer(0, "bias", torch.float16, 2), [h, q])
    assert ir.binary("add", score, 1.0) is not ir.binary("add", score, 2.0)


def test_constants_of_different_type_or_zero_sign_stay_distinct():
    c = [ir.const(1), ir.const(1.0), ir.const(True), ir.const(1, torch.int32), ir.const(0.0), ir.const(-0.0)]
    assert len({id(x) for x in c}) == len(c)
    assert ir.const(math.nan) is ir.const(-math.nan)  # all NaNs are one constant


def test_pickle_round_trip_interns():
    node = ir.where(causal_doc_mask(), ir.binary("add", score, ir.load(bias, [h, q])), -math.inf)
    assert pickle.loads(pickle.dumps(node)) is node


def test_nodes_are_immutable_and_have_no_truth_value():
    with pytest.raises(AttributeError):
        score.op = "x"
    with pytest.raises(TypeError, match="no truth value"):
        bool(ir.binary("ge", q, kv))


@settings(max_examples=30, deadline=None)
@given(T.mask_irs(max_depth=3), T.mask_irs(max_depth=3))
def test_keys_equal_iff_same_structure(x, y):
    a, b_ = x[0], y[0]
    assert (a.key() == b_.key()) == (a is b_)
    assert (ir.serialize(a) == ir.serialize(b_)) == (a is b_)


def test_keys_are_the_same_in_another_process():
    nodes = [causal_doc_mask(), ir.where(causal_doc_mask(), ir.unary("tanh", ir.binary("mul", score, 0.5)), -math.inf),
             ir.binary("add", ir.cast(q, torch.int64), 2**40), ir.const(math.nan)]
    code = ("import pickle, sys; nodes = pickle.loads(sys.stdin.buffer.read()); "
            "print(' '.join(n.key() for n in nodes))")
    proc = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(nodes), capture_output=True, check=True)
    assert proc.stdout.decode().split() == [n.key() for n in nodes]
    assert len(set(proc.stdout.decode().split())) == len(nodes)


def test_key_depends_on_buffer_dtype_and_constants():
    k = ir.binary("add", score, ir.load(bias, [h, q])).key()
    assert k != ir.binary("add", score, ir.load(ir.Buffer(0, "bias", torch.float32, 2), [h, q])).key()
    assert ir.binary("mul", score, 0.5).key() != ir.binary("mul", score, 0.25).key()


# ---------------------------------------------------------------------------------------------
# Promotion


DTYPES = list(ir.DTYPES.values())


@pytest.mark.parametrize("a", DTYPES, ids=str)
def test_promote_matches_torch_result_type(a):
    ta = torch.ones(3, dtype=a)
    na = ir.Node("input", a, (), "_x")
    for other in DTYPES:
        expected = torch.result_type(ta, torch.ones(3, dtype=other))
        assert ir.promote(na, ir.Node("input", other, (), "_y")) == expected, (a, other)
    for s in (False, 2, -3, 2**40, 0.5):
        assert ir.promote(na, s) == torch.result_type(ta, s), (a, s)
        assert ir.promote(s, na) == torch.result_type(s, ta), (s, a)


def test_promote_of_python_scalars_only():
    for x in (True, 3, 1.5):
        for y in (True, 3, 1.5):
            expected = torch.result_type(torch.tensor(x), torch.tensor(y)) if type(x) is type(y) else \
                torch.result_type(torch.tensor(x), y)
            assert ir.promote(x, y) == torch.promote_types(
                torch.tensor(x).dtype, torch.tensor(y).dtype) == expected


def test_builders_apply_promotion_and_cast_operands():
    x = ir.binary("add", ir.load(bias, [h, q]), score)  # float16 + float32
    assert x.dtype == torch.float32 and x.src[0].op == "cast" and x.src[0].dtype == torch.float32
    assert ir.binary("truediv", q, kv).dtype == torch.float32
    assert ir.binary("add", q, 1).dtype == torch.int32  # weak Python int
    assert ir.binary("add", ir.binary("ge", q, kv), 1).dtype == torch.int64
    assert ir.unary("exp", q).dtype == torch.float32
    assert ir.unary("floor", q) is q
    assert ir.binary("pow", q, 2).dtype == torch.int32 and ir.binary("pow", q, 0.5).dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Constant folding


def test_constant_folding():
    assert ir.binary("add", ir.const(2), 3) is ir.const(5)
    assert ir.binary("floordiv", ir.const(-7), 2) is ir.const(-4)
    assert ir.binary("mod", ir.const(-7), 3) is ir.const(2)
    assert ir.unary("exp", ir.const(0.0)) is ir.const(1.0)
    assert ir.cast(ir.const(-2.7), torch.int32) is ir.const(-2, torch.int32)
    assert ir.cast(ir.const(3), torch.bool) is ir.const(True)
    assert ir.binary("truediv", ir.const(1.0), 0.0) is ir.const(math.inf)
    assert ir.binary("lt", ir.const(1), ir.const(2)) is ir.const(True)
    c = ir.binary("ge", q, kv)
    assert ir.where(ir.const(True), score, 0.0) is score
    assert ir.where(c, score, score) is score
    assert ir.unary("not", ir.unary("not", c)) is c
    # integer division by zero folds to flexattn's defined value (x // 0 == 0, x % 0 == x)
    assert ir.binary("floordiv", ir.const(1), 0) is ir.const(0)
    assert ir.binary("mod", ir.const(-5), 0) is ir.const(-5)


def test_folded_constants_overflow_like_torch():
    big = ir.const(2**31 - 1, torch.int32)
    assert ir.binary("add", big, 1).arg == -(2**31)


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("build, message", [
    (lambda: ir.binary("add", ir.binary("ge", q, kv), ir.binary("lt", q, 3)), r"arithmetic \(add\) on two bools"),
    (lambda: ir.binary("and_", score, 1.0), r"and needs integer or bool operands, got float32"),
    (lambda: ir.binary("lshift", score, 1), r"lshift needs integer or bool operands, got float32"),
    (lambda: ir.unary("invert", score), r"~ \(bitwise not\) needs an integer or bool operand, got float32"),
    (lambda: ir.unary("neg", ir.binary("ge", q, kv)), r"negation of a bool"),
    (lambda: ir.unary("abs", ir.binary("ge", q, kv)), r"abs\(\) of a bool"),
    (lambda: ir.load(bias, [q]), r"'bias' has 2 dimension\(s\) but was indexed with 1 index"),
    (lambda: ir.load(bias, [q, score]), r"index 1 into captured tensor 'bias' must be an integer, got float32"),
    (lambda: ir.load(bias, [q, ir.binary("ge", q, kv)]), r"must be an integer, got bool"),
    (lambda: ir.const(2**31, torch.int32), r"constant 2147483648 does not fit in int32"),
    (lambda: ir.binary("add", q, 2**40), r"does not fit in int32"),
    (lambda: ir.const(300, torch.uint8), r"does not fit in uint8 \(range 0..255\)"),
    (lambda: ir.const(math.inf, torch.int64), r"cannot convert inf to int64"),
    (lambda: ir.const("3"), r"constants must be Python bool/int/float, got str"),
    (lambda: ir.where(q, score, 0.0), r"where\(\) condition must be bool, got int32"),
    (lambda: ir.input_("qidx"), r"unknown input 'qidx'"),
    (lambda: ir.input_("score", torch.int32), r"score must be floating point"),
    (lambda: ir.unary("cube", q), r"unknown unary op 'cube'"),
    (lambda: ir.cast(q, torch.complex64), r"does not support dtype"),
])
def test_builder_errors(build, message):
    with pytest.raises((ir.IRError, TypeError), match=message):
        build()


# ---------------------------------------------------------------------------------------------
# Printer


@pytest.mark.parametrize("build, text", [
    (lambda: ir.binary("ge", q, kv), "(q_idx >= kv_idx)"),
    (lambda: ir.where(ir.binary("ge", q, kv), score, -math.inf), "where((q_idx >= kv_idx), score, (-inf))"),
    (lambda: ir.binary("add", score, ir.load(bias, [h, q])), "(score + float32(bias[h][q_idx]))"),
    (lambda: ir.binary("eq", ir.load(doc, [q]), ir.load(doc, [kv])), "(doc[q_idx] == doc[kv_idx])"),
    (lambda: ir.unary("tanh", ir.binary("truediv", score, 30.0)), "tanh((score / 30.0))"),
    (lambda: ir.binary("floordiv", q, 16), "(q_idx // 16)"),
    (lambda: ir.unary("not", ir.binary("lt", q, 3)), "(~(q_idx < 3))"),
    (lambda: ir.binary("add", q, ir.const(3, torch.int64)), "(int64(q_idx) + 3)"),
    (lambda: ir.binary("sub", score, ir.load(doc, [-1])), "(score - float32(doc[(-1)]))"),
    (lambda: ir.binary("maximum", score, 0.0), "maximum(score, 0.0)"),
    (lambda: ir.const(2.5, torch.float64), "float64(2.5)"),
    (lambda: ir.binary("add", ir.cast(q, torch.float32), 1), "(float32(q_idx) + 1.0)"),
    (lambda: ir.unary("neg", score), "(-score)"),
])
def test_printer(build, text):
    node = build()
    assert ir.to_text(node) == text
    assert str(node) == text


# ---------------------------------------------------------------------------------------------
# Evaluator


def test_evaluator_gathers_wrap_and_read_zero_out_of_range():
    t = torch.tensor([10, 20, 30], dtype=torch.int64)
    idx = torch.tensor([-4, -3, -1, 0, 2, 3, 100], dtype=torch.int32)
    out = ir.evaluate(ir.load(doc, [q]), {"q_idx": idx}, [None, t])
    assert out.tolist() == [0, 10, 30, 10, 30, 0, 0]


def test_evaluator_wraps_small_int_indices_without_overflow():
    table = torch.arange(200, dtype=torch.float32)
    buf = ir.Buffer(0, "t", torch.float32, 1)
    idx = ir.cast(q, torch.int8)
    out = ir.evaluate(ir.load(buf, [idx]), {"q_idx": torch.tensor([-1, -100, 5], dtype=torch.int32)}, [table])
    assert out.tolist() == [199.0, 100.0, 5.0]


def test_evaluator_python_division_semantics():
    x = torch.tensor([-7, -1, 0, 5], dtype=torch.int32)
    out_div = ir.evaluate(ir.binary("floordiv", q, 3), {"q_idx": x})
    out_mod = ir.evaluate(ir.binary("mod", q, -3), {"q_idx": x})
    assert out_div.tolist() == [v // 3 for v in x.tolist()]
    assert out_mod.tolist() == [v % -3 for v in x.tolist()]


# ---------------------------------------------------------------------------------------------
# The testing helpers themselves: to_python and the float64 reference


@settings(max_examples=25, deadline=None)
@given(st.one_of(T.mask_irs(max_depth=3, in_range_gathers=True),
                 T.score_irs(max_depth=3, in_range_gathers=True, exact_only=True)))
def test_to_python_is_equivalent(case):
    node, buffers = case
    grid = (2, 3, 7, 9)
    s = T.random_score(*grid)
    fn = T.python_mod(node, buffers)
    args = T.index_grid(*grid)
    out = fn(s, *args) if node.dtype.is_floating_point else fn(*args)
    ref = T.eval_grid(node, buffers, *grid, s)
    out = torch.as_tensor(out).expand(ref.shape)
    assert out.dtype == ref.dtype, T.to_python(node)
    assert torch.equal(out, ref) or torch.allclose(out, ref, rtol=0, atol=0, equal_nan=True), T.to_python(node)


def test_to_python_two_literals_keep_their_dtype():
    # torch.where(flag, 0.0, -inf) would be float32: beside each other, literals spell their dtype
    flag = ir.Buffer(0, "flag", torch.bool, 0)
    half = torch.float16
    node = ir.where(ir.load(flag, []), ir.const(0.0, half), ir.const(-math.inf, half))
    out = T.python_mod(node, [torch.tensor(True)])(T.random_score(1, 1, 2, 2), *T.index_grid(1, 1, 2, 2))
    assert out.dtype == half == node.dtype


def test_to_python_text():
    src = T.to_python(ir.where(causal_doc_mask(), ir.binary("add", score, ir.load(bias, [h, q])), -math.inf))
    assert src == ('def mod(score, b, h, q_idx, kv_idx):\n    return torch.where(((q_idx >= kv_idx) & '
                   '(B1[q_idx] == B1[kv_idx])), (score + B0[h, q_idx].to(torch.float32)), (-float("inf")))\n')


def test_to_float64_reference():
    node = ir.binary("add", ir.unary("exp", ir.cast(q, torch.float16)), ir.binary("truediv", q, 3))
    f64 = T.to_float64(node)
    assert all(n.dtype in (torch.float64, torch.int32) for n in ir.toposort(f64))
    out = T.reference_fp64(node, [], 1, 1, 5, 1)
    assert torch.allclose(out.flatten(), torch.exp(torch.arange(5.0, dtype=torch.float64)) +
                          torch.arange(5, dtype=torch.float64) / 3, rtol=1e-15)


def test_assert_close_to_reference_fails_on_large_errors():
    ref = torch.linspace(-1, 1, 11, dtype=torch.float64)
    eager = ref.float()
    T.assert_close_to_reference(eager, eager, ref)
    with pytest.raises(AssertionError, match="error"):
        T.assert_close_to_reference(eager + 1e-3, eager, ref)
    with pytest.raises(AssertionError, match="NaN"):
        T.assert_close_to_reference(torch.full_like(eager, float("nan")), eager, ref)
