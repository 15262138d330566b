"""Symbolic derivatives of score mods (flexattn.autodiff) against torch.autograd, in float64.

For a mod IR, the eager evaluator runs it on float64 tensors that require grad; torch.autograd
gives d(sum(grad_out * out)) / d(score and every captured table). `autodiff.differentiate` plus
`helpers.autodiff_oracle.evaluate_grads` must give the same numbers.
"""


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexattn import autodiff, ir
from helpers import autodiff_oracle, testing

F64 = torch.float64
B, H, Q, KV = 2, 3, 5, 7


def inputs(score_dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "score": (torch.randn(B, H, Q, KV, generator=g, dtype=F64) * 2).to(score_dtype),
        "b": torch.arange(B, dtype=torch.int32).view(B, 1, 1, 1),
        "h": torch.arange(H, dtype=torch.int32).view(1, H, 1, 1),
        "q_idx": torch.arange(Q, dtype=torch.int32).view(1, 1, Q, 1),
        "kv_idx": torch.arange(KV, dtype=torch.int32).view(1, 1, 1, KV),
    }


# Captured tables: a relative-position bias (1-D, read at kv - q, which may be negative: wraps),
# a (h, q, kv) table, a per-head slope, a doc-id table (int) for nested gathers, a 0-d gate.
REL = ir.Buffer(0, "rel", F64, 1)
HQK = ir.Buffer(1, "hqk", F64, 3)
SLOPE = ir.Buffer(2, "slope", F64, 1)
DOC = ir.Buffer(3, "doc", torch.int64, 1)
GATE = ir.Buffer(4, "gate", F64, 0)


def tables(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2 * KV - 3, generator=g, dtype=F64),  # shorter than the widest kv - q: OOB reads
        torch.randn(H, Q, KV, generator=g, dtype=F64),
        torch.rand(H, generator=g, dtype=F64) + 0.25,
        torch.randint(-2, KV, (Q,), generator=g),          # negative ids wrap
        torch.tensor(0.7, dtype=F64),
    ]


class _Reference(ir.Evaluator):
    # torch.floor_divide has no autograd formula; its value is piecewise constant, which is what
    # autodiff's zero derivative encodes: detach it.
    def _eval(self, n):
        if n.op == "floordiv" and n.dtype.is_floating_point:
            with torch.no_grad():
                return super()._eval(n)
        return super()._eval(n)


def torch_grads(root, env, bufs, grad_out):
    env = dict(env)
    env["score"] = env["score"].detach().clone().requires_grad_(True)
    bufs = [t.detach().clone().requires_grad_(t.dtype.is_floating_point) for t in bufs]
    out = _Reference(env, bufs).value(root)
    assert out.dtype.is_floating_point
    wrt = [env["score"]] + [t for t in bufs if t.requires_grad]
    loss = (out * grad_out.to(out.dtype)).sum()
    if not loss.requires_grad:
        return [torch.zeros_like(t) for t in wrt]
    gs = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, gs)]


def our_grads(root, env, bufs, grad_out):
    d = autodiff.differentiate(root)
    ds, gb = autodiff_oracle.evaluate_grads(d, env, bufs, grad_out.to(root.dtype))
    shape = torch.broadcast_shapes(ds.shape, env["score"].shape)
    out = [ds.expand(shape).to(env["score"].dtype)]
    out += [gb.get(i, torch.zeros_like(t)) for i, t in enumerate(bufs) if t.dtype.is_floating_point]
    return out


def check(root, seed=0, score_dtype=F64, **tol):
    env, bufs = inputs(score_dtype, seed), tables(seed + 1)
    grad_out = torch.randn(B, H, Q, KV, generator=torch.Generator().manual_seed(seed + 2), dtype=F64)
    expected, got = torch_grads(root, env, bufs, grad_out), our_grads(root, env, bufs, grad_out)
    for name, e, g in zip(["score", "rel", "hqk", "slope", "gate"], expected, got):
        assert g.dtype == e.dtype, name
        torch.testing.assert_close(g, e, equal_nan=True, msg=lambda m: f"d/d{name} of {root}: {m}", **tol)


S = ir.input_("score", F64)
Bi, Hi, QI, KVI = (ir.input_(n) for n in ir.INDEX_INPUTS)

# --- every op, at ordinary points and at the subgradient corners -------------------------------

UNARY_FLOAT = [op for op, (_, rule) in ir.UNARY_OPS.items() if op not in ("not", "invert")]


@pytest.mark.parametrize("op", UNARY_FLOAT)
def test_unary_ops(op):
    check(ir.unary(op, S))
    # Zero, ties and large values: the corners of relu/abs/sign/softplus's threshold.
    env = inputs()
    corners = torch.tensor([0.0, -0.0, 1.0, -1.0, 20.0, 20.5, -20.5, 0.5, 1e-3, 3.0], dtype=F64)
    env["score"] = corners.view(1, 1, 1, -1).expand(B, H, Q, -1)
    d = autodiff.differentiate(ir.unary(op, S))
    ours, _ = autodiff_oracle.evaluate_grads(d, {k: v for k, v in env.items()}, [], torch.ones(()))
    x = env["score"].clone().requires_grad_(True)
    y = ir.UNARY_OPS[op][0](x).sum()
    (ref,) = torch.autograd.grad(y, x) if y.requires_grad else (torch.zeros_like(x),)  # (detach: none)
    torch.testing.assert_close(ours.expand_as(ref), ref, equal_nan=True)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "truediv", "mod", "pow", "minimum", "maximum",
                                "floordiv"])
def test_binary_ops(op):
    other = ir.load(HQK, [Hi, QI, KVI])
    check(ir.binary(op, S, other))
    check(ir.binary(op, other, S))
    check(ir.binary(op, S, S))                        # both operands the same node (ties for max)
    check(ir.binary(op, S, ir.binary("mul", S, 0.5)))  # ties at score == 0


def test_pow_corners():
    # torch's conventions at base 0 and exponent 0 (0 ** 0, d/dexponent at base 0, ...).
    for base in (S, ir.unary("relu", S)):
        for expo in (2, 3, 0.5, -1.0, 0.0):
            check(ir.binary("pow", base, expo))
        check(ir.binary("pow", base, ir.load(HQK, [Hi, QI, KVI])))
        check(ir.binary("pow", ir.load(REL, [Hi]), ir.unary("relu", S)))


def test_minmax_ties_split_the_gradient():
    t = ir.load(HQK, [Hi, QI, KVI])
    check(ir.binary("maximum", ir.unary("floor", S), ir.unary("floor", t)))
    check(ir.binary("minimum", ir.unary("round", S), ir.unary("round", t)))
    d = autodiff.differentiate(ir.binary("maximum", S, S))
    assert float(ir.evaluate(d.score, {"score": 1.0})) == 1.0   # 1/2 + 1/2


def test_where_routes_to_the_chosen_branch_only():
    t = ir.load(HQK, [Hi, QI, KVI])
    check(ir.where(ir.binary("gt", S, t), ir.binary("mul", S, t), ir.unary("exp", t)))
    check(ir.where(ir.binary("le", QI, KVI), S, ir.binary("mul", S, 3)))


def test_casts_keep_the_gradient_dtype():
    # score (f64) -> f32 -> tanh -> f64: torch computes the tanh part in float32, as do we.
    s32 = ir.cast(S, torch.float32)
    root = ir.cast(ir.unary("tanh", s32), F64)
    check(root, rtol=1e-6, atol=1e-6)
    d = autodiff.differentiate(root)
    assert d.score.dtype == F64
    # A bf16 score mod: the derivative is bf16, like torch's gradient.
    sb = ir.input_("score", torch.bfloat16)
    d = autodiff.differentiate(ir.binary("mul", ir.unary("sigmoid", sb), 2.0))
    assert d.score.dtype == torch.bfloat16
    # A float value built from integers carries no gradient.
    root = ir.binary("add", S, ir.binary("mul", ir.cast(ir.binary("sub", KVI, QI), F64), 0.5))
    d = autodiff.differentiate(root)
    assert d.score.op == "const" and d.score.arg == 1.0


# --- captured tables ------------------------------------------------------------------------


def test_relative_position_table():
    check(ir.binary("add", S, ir.load(REL, [ir.binary("sub", KVI, QI)])))


def test_h_q_kv_table():
    check(ir.binary("mul", S, ir.unary("sigmoid", ir.load(HQK, [Hi, QI, KVI]))))


def test_nested_gather():
    # rel[doc[q_idx]]: the integer table only routes; the float one gets the gradient.
    doc_q = ir.load(DOC, [QI])
    check(ir.binary("add", S, ir.binary("mul", ir.load(REL, [doc_q]), ir.load(SLOPE, [Hi]))))
    check(ir.binary("add", S, ir.load(HQK, [Hi, ir.cast(ir.load(DOC, [QI]), torch.int32), KVI])))


def test_same_table_read_twice():
    r1 = ir.load(REL, [ir.binary("sub", KVI, QI)])
    r2 = ir.load(REL, [ir.binary("sub", QI, KVI)])   # the mirror position: other entries
    check(ir.binary("add", ir.binary("mul", S, r1), ir.binary("mul", r2, r2)))
    d = autodiff.differentiate(ir.binary("add", ir.binary("mul", S, r1), ir.binary("mul", r2, r2)))
    assert len(d.loads) == 2 and d.buffers == [REL]


def test_alibi_and_gate():
    slope = ir.load(SLOPE, [Hi])
    dist = ir.cast(ir.binary("sub", KVI, QI), F64)
    gate = ir.load(GATE, [])
    check(ir.binary("mul", ir.binary("add", S, ir.binary("mul", slope, dist)), ir.unary("sigmoid", gate)))


def test_softcap():
    check(ir.binary("mul", ir.unary("tanh", ir.binary("truediv", S, 3.0)), 3.0))


def test_mod_without_score_or_floats():
    d = autodiff.differentiate(ir.cast(ir.binary("sub", KVI, QI), F64))
    assert d.score.op == "const" and d.score.arg == 0.0 and d.loads == ()
    d = autodiff.differentiate(ir.load(REL, [KVI]))
    assert d.score.op == "const" and d.score.arg == 0.0 and len(d.loads) == 1
    check(ir.binary("add", ir.load(REL, [KVI]), 0.0))


# --- errors ---------------------------------------------------------------------------------


def test_every_float_op_has_a_rule():
    assert autodiff_oracle.missing_rules() == []


def test_unknown_op_is_a_clear_error():
    bogus = ir.Node("bessel_j0", F64, (S,))
    with pytest.raises(autodiff.NotDifferentiableError, match="bessel_j0"):
        autodiff.differentiate(ir.binary("add", bogus, S))
    with pytest.raises(autodiff.NotDifferentiableError, match="my_mod.*bessel_j0"):
        autodiff.check_differentiable(bogus, "my_mod")
    autodiff.check_differentiable(ir.unary("tanh", S))  # fine: no error


# --- random mods ----------------------------------------------------------------------------

SAFE_UNARY = ["neg", "abs", "relu", "exp", "expm1", "sin", "cos", "tanh", "sigmoid", "erf", "silu",
              "gelu", "gelu_tanh", "softplus", "floor", "sign", "round"]
POSITIVE_UNARY = ["log", "log2", "log1p", "sqrt", "rsqrt", "reciprocal"]


def _positive(x):
    return ir.binary("add", ir.binary("mul", x, x), 0.5)


def float_leaves():
    rel = ir.load(REL, [ir.binary("sub", KVI, QI)])
    return st.sampled_from([
        S, S, S,
        rel,
        ir.load(HQK, [Hi, QI, KVI]),
        ir.load(SLOPE, [Hi]),
        ir.load(REL, [ir.load(DOC, [QI])]),
        ir.load(GATE, []),
        ir.cast(ir.binary("sub", QI, KVI), F64),
        ir.const(1.5, F64),
    ])


def _extend(children):
    unary = st.tuples(st.sampled_from(SAFE_UNARY), children).map(lambda t: ir.unary(*t))
    bounded = st.tuples(st.sampled_from(POSITIVE_UNARY), children).map(
        lambda t: ir.unary(t[0], _positive(t[1])))
    binary = st.tuples(st.sampled_from(["add", "sub", "mul", "maximum", "minimum"]), children, children).map(
        lambda t: ir.binary(*t))
    divide = st.tuples(children, children).map(lambda t: ir.binary("truediv", t[0], _positive(t[1])))
    power = st.tuples(children, st.sampled_from([2, 3, 0.5, -1.5])).map(
        lambda t: ir.binary("pow", _positive(t[0]) if t[1] != int(t[1]) else t[0], t[1]))
    fpow = st.tuples(children, children).map(lambda t: ir.binary("pow", _positive(t[0]), ir.unary("tanh", t[1])))
    modulo = st.tuples(children, st.sampled_from([1.5, -2.0])).map(lambda t: ir.binary("mod", *t))
    fdiv = st.tuples(children, st.sampled_from([0.7, -2.0])).map(lambda t: ir.binary("floordiv", *t))
    choose = st.tuples(st.sampled_from(["lt", "ge", "eq"]), children, children, children, children).map(
        lambda t: ir.where(ir.binary(t[0], t[1], t[2]), t[3], t[4]))
    rel_mask = st.tuples(children, children).map(lambda t: ir.where(ir.binary("le", KVI, QI), t[0], t[1]))
    return st.one_of(unary, bounded, binary, divide, power, fpow, modulo, fdiv, choose, rel_mask)


def score_irs_local():
    return st.recursive(float_leaves(), _extend, max_leaves=10)


@settings(max_examples=150, deadline=None)
@given(root=score_irs_local(), seed=st.integers(0, 2**16))
def test_random_mods_match_torch_autograd(root, seed):
    check(root, seed=seed)


@settings(max_examples=100, deadline=None)
@given(case=testing.score_irs(max_depth=4),
       seed=st.integers(0, 2**16))
def test_shared_random_score_irs_match_torch_autograd(case, seed):
    # The project-wide strategy (mixed dtypes, gathers out of range, int/bool subtrees), in float64.
    node, bufs = case
    root, bufs = testing.to_float64(node), testing.buffers_float64(bufs)
    env = testing.grid_inputs(2, 3, 9, 11, testing.random_score(2, 3, 9, 11, torch.float64, seed))
    grad_out = torch.randn(2, 3, 9, 11, generator=torch.Generator().manual_seed(seed), dtype=F64)
    expected, got = torch_grads(root, env, bufs, grad_out), our_grads(root, env, bufs, grad_out)
    for i, (e, g) in enumerate(zip(expected, got)):
        torch.testing.assert_close(g, e, equal_nan=True, msg=lambda m: f"grad {i} of {root}: {m}")
