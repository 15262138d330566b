"""The DSL front end: syntax, meaning (IR equal to the builders'), errors, round trips, and DSL mods
running where Python mods run (torch's flex_attention, create_block_mask, vmap, generated kernels)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import flexattn
from flexattn import ir
from helpers import testing
from flexattn.dsl import FUNCTIONS, DSLError, mask_mod, parse, parse_with_buffers, score_mod
from flexattn.mods import Mod

Q, KV, B_, H_, S = (ir.input_(n) for n in ("q_idx", "kv_idx", "b", "h", "score"))
bi, un, where, const = ir.binary, ir.unary, ir.where, ir.const


# ---------------------------------------------------------------------------------------------
# Meaning: each construct builds exactly what the IR builders build


def test_brief_examples():
    assert parse("q_idx >= kv_idx and q_idx - kv_idx <= 256", "mask") is \
        bi("and_", bi("ge", Q, KV), bi("le", bi("sub", Q, KV), 256))

    bias = torch.randn(4)
    buf = ir.Buffer(0, "bias", torch.float32, 1)
    assert parse("score + bias[h] * tanh(score / 5.0)", "score", {"bias": bias}) is \
        bi("add", S, bi("mul", ir.load(buf, [H_]), un("tanh", bi("truediv", S, 5.0))))

    doc = torch.tensor([0, 0, 1, 1, 2], dtype=torch.int32)
    dbuf = ir.Buffer(0, "doc", torch.int32, 1)
    assert parse("where(doc[q_idx] == doc[kv_idx], score, -inf)", "score", {"doc": doc}) is \
        where(bi("eq", ir.load(dbuf, [Q]), ir.load(dbuf, [KV])), S, -math.inf)


@pytest.mark.parametrize("text, expected", [
    # arithmetic precedence and associativity
    ("1 + 2 * q_idx", lambda: bi("add", 1, bi("mul", 2, Q))),
    ("q_idx - kv_idx - 1", lambda: bi("sub", bi("sub", Q, KV), 1)),
    ("q_idx // 2 * 3", lambda: bi("mul", bi("floordiv", Q, 2), 3)),
    ("q_idx % 7 + kv_idx / 2", lambda: bi("add", bi("mod", Q, 7), bi("truediv", KV, 2))),
    ("-q_idx ** 2", lambda: un("neg", bi("pow", Q, 2))),
    ("q_idx ** 2 ** 3", lambda: bi("pow", Q, 8)),  # right-assoc; 2 ** 3 is a literal
    ("q_idx ** -1.0", lambda: bi("pow", Q, -1.0)),
    ("+q_idx", lambda: Q),
    ("~q_idx", lambda: un("invert", Q)),
    ("(q_idx + 1) * 2", lambda: bi("mul", bi("add", Q, 1), 2)),
    # bitwise precedence: | < ^ < & < shifts < +
    ("q_idx | kv_idx ^ b & h", lambda: bi("or_", Q, bi("xor", KV, bi("and_", B_, H_)))),
    ("q_idx << 1 + kv_idx", lambda: bi("lshift", Q, bi("add", 1, KV))),
    ("q_idx >> 2 & 3", lambda: bi("and_", bi("rshift", Q, 2), 3)),
    ("q_idx & 3 == 1", lambda: bi("eq", bi("and_", Q, 3), 1)),
    # comparisons, chained like Python
    ("q_idx != kv_idx", lambda: bi("ne", Q, KV)),
    ("q_idx < kv_idx", lambda: bi("lt", Q, KV)),
    ("q_idx > kv_idx", lambda: bi("gt", Q, KV)),
    ("0 <= q_idx - kv_idx < 128",
     lambda: bi("and_", bi("le", 0, bi("sub", Q, KV)), bi("lt", bi("sub", Q, KV), 128))),
    # logic: not > and > or, all below comparisons
    ("not q_idx == kv_idx", lambda: un("not", bi("eq", Q, KV))),
    ("q_idx < 1 or q_idx < 2 and kv_idx < 3",
     lambda: bi("or_", bi("lt", Q, 1), bi("and_", bi("lt", Q, 2), bi("lt", KV, 3)))),
    ("~(q_idx < 3)", lambda: un("not", bi("lt", Q, 3))),
    ("(q_idx < 1) ^ (kv_idx < 1)", lambda: bi("xor", bi("lt", Q, 1), bi("lt", KV, 1))),
    # conditional expression
    ("score if q_idx >= kv_idx else -inf", lambda: where(bi("ge", Q, KV), S, -math.inf)),
    ("1.0 if q_idx < 2 else 2.0 if q_idx < 4 else 3.0",
     lambda: where(bi("lt", Q, 2), 1.0, where(bi("lt", Q, 4), 2.0, 3.0))),
])
def test_precedence(text, expected):
    assert parse(text) is expected()


@pytest.mark.parametrize("text, value, dtype", [
    ("5", 5, torch.int64), ("0x1F", 31, torch.int64), ("2.5", 2.5, torch.float32),
    ("1e-3", 1e-3, torch.float32), ("1.5E+2", 150.0, torch.float32), (".5", 0.5, torch.float32),
    ("3.", 3.0, torch.float32), ("True", True, torch.bool), ("False", False, torch.bool),
    ("inf", math.inf, torch.float32), ("-inf", -math.inf, torch.float32), ("(-7)", -7, torch.int64),
    ("int32(5)", 5, torch.int32), ("float16(-0.5)", -0.5, torch.float16), ("uint8(200)", 200, torch.uint8),
    ("bool(2)", True, torch.bool), ("7 // 2", 3, torch.int64), ("-7 % 3", 2, torch.int64),
    ("2 ** -1", 0.5, torch.float32), ("~5", -6, torch.int64), ("not False", True, torch.bool),
])
def test_literals(text, value, dtype):
    n = parse(text)
    assert n is const(value, dtype)


@pytest.mark.parametrize("text", ["010", "q_idx < 0010", "007 + q_idx > 0"])
def test_leading_zeros_are_refused_as_in_python(text):
    with pytest.raises(DSLError, match="leading zeros"):
        parse(text)
    assert parse("00 + q_idx > 0") is parse("0 + q_idx > 0")


def test_nan_literal():
    n = parse("nan")
    assert n.op == "const" and math.isnan(n.arg) and n.dtype == torch.float32


def test_literals_are_weak_scalars():
    # Like Python constants in a traced mod, literals do not widen the other operand.
    assert parse("q_idx - 4").dtype == torch.int32
    assert parse("score * 0.5", score_dtype=torch.float16).dtype == torch.float16
    assert parse("score * (1 / 8)", score_dtype=torch.bfloat16) is \
        bi("mul", ir.input_("score", torch.bfloat16), 0.125)
    assert parse("q_idx * 1.5").dtype == torch.float32
    # a typed constant is not weak
    assert parse("q_idx + int64(1)").dtype == torch.int64


@pytest.mark.parametrize("op", sorted(op for op in ir.UNARY_OPS if op != "not"))
def test_unary_functions(op):
    for arg, node in (("score", S), ("q_idx", Q), ("(q_idx > 0)", bi("gt", Q, 0))):
        try:
            expected = un(op, node)
        except ir.IRError as e:  # e.g. invert(score): the same error, located
            with pytest.raises(DSLError, match=r"at line 1, column 1") as info:
                parse(f"{op}({arg})")
            assert info.value.message == str(e)
            continue
        assert parse(f"{op}({arg})") is expected


@pytest.mark.parametrize("name", sorted(ir.DTYPES))
def test_casts(name):
    dtype = ir.DTYPES[name]
    assert parse(f"{name}(score)") is ir.cast(S, dtype)
    assert parse(f"{name}(q_idx + 1)") is ir.cast(bi("add", Q, 1), dtype)
    assert parse(f"{name}(1)") is const(1, dtype)


def test_other_functions():
    assert parse("minimum(q_idx, kv_idx)") is bi("minimum", Q, KV)
    assert parse("maximum(score, 0.0)") is bi("maximum", S, 0.0)
    assert parse("min(q_idx, kv_idx, 7)") is bi("minimum", bi("minimum", Q, KV), 7)
    assert parse("max(q_idx, kv_idx)") is bi("maximum", Q, KV)
    assert parse("clamp(score, -1.0, 1.0)") is ir.clamp(S, -1.0, 1.0)
    assert parse("abs(q_idx - kv_idx)") is un("abs", bi("sub", Q, KV))
    assert parse("pow(score, 2)") is bi("pow", S, 2)
    assert parse("where(q_idx > 2, 1, 0,)") is where(bi("gt", Q, 2), 1, 0)  # trailing comma


def test_layout_lets_comments():
    text = """
    # a sliding window with 4 sink tokens
    let dist = q_idx - kv_idx          # how far back
    let in_window = dist >= 0 and dist < 128

    in_window or kv_idx < 4
    """
    dist = bi("sub", Q, KV)
    expected = bi("or_", bi("and_", bi("ge", dist, 0), bi("lt", dist, 128)), bi("lt", KV, 4))
    assert parse(text, "mask") is expected
    assert parse("let dist = q_idx - kv_idx; let in_window = dist >= 0 and dist < 128; "
                 "in_window or kv_idx < 4", "mask") is expected
    # newlines inside brackets join lines, as in Python; backslash continues a line
    assert parse("where(q_idx >= kv_idx,\n      score,\n      -inf)") is where(bi("ge", Q, KV), S, -math.inf)
    assert parse("q_idx \\\n >= kv_idx") is bi("ge", Q, KV)
    assert parse("q_idx >= kv_idx  # trailing comment without newline") is bi("ge", Q, KV)


# ---------------------------------------------------------------------------------------------
# Bindings


def test_tensor_bindings_and_indexing():
    table = torch.randn(3, 5)
    doc = torch.arange(6)
    s0 = torch.tensor(2.0)
    node, bufs = parse_with_buffers("table[h][kv_idx] + table[h, doc[q_idx]] * s0", "score",
                                    {"table": table, "doc": doc, "s0": s0})
    tb, db, sb = (ir.Buffer(0, "table", torch.float32, 2), ir.Buffer(1, "doc", torch.int64, 1),
                  ir.Buffer(2, "s0", torch.float32, 0))
    assert node is bi("add", ir.load(tb, [H_, KV]),
                      bi("mul", ir.load(tb, [H_, ir.load(db, [Q])]), ir.load(sb, [])))
    assert bufs[0] is table and bufs[1] is doc and bufs[2] is s0


def test_buffer_order_is_binding_order():
    a, b = torch.randn(4), torch.randn(4)
    node, bufs = parse_with_buffers("score + b_[h] + a_[h]", "score", {"a_": a, "b_": b})
    assert [t for t in bufs] == [a, b] or (bufs[0] is a and bufs[1] is b)
    assert {n.arg.name: n.arg.index for n in ir.toposort(node) if n.op == "load"} == {"a_": 0, "b_": 1}


def test_number_bindings_are_weak_constants():
    assert parse("q_idx - kv_idx <= window", "mask", {"window": 256}) is bi("le", bi("sub", Q, KV), 256)
    assert parse("cap * tanh(score / cap)", "score", {"cap": 30.0}, torch.float16).dtype == torch.float16


def test_mod_bindings_are_inlined():
    causal = mask_mod("q_idx >= kv_idx")
    assert parse("causal(b, h, q_idx - 4, kv_idx)", "mask", {"causal": causal}) is \
        bi("ge", bi("sub", Q, 4), KV)

    def py_causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    assert parse("py_causal(b, h, q_idx - 4, kv_idx) & (kv_idx > 1)", "mask", {"py_causal": py_causal}) is \
        bi("and_", bi("ge", bi("sub", Q, 4), KV), bi("gt", KV, 1))

    # a called mod's tensors join the caller's buffers (after its own, shared ones once)
    doc = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    bias = torch.randn(3)
    same_doc = mask_mod("doc[q_idx] == doc[kv_idx]", doc=doc)
    m = score_mod("where(same_doc(b, h, q_idx, kv_idx), score + bias[h], -inf)", same_doc=same_doc, bias=bias)
    assert m.buffers[0] is bias and m.buffers[1] is doc
    m2 = mask_mod("same_doc(b, h, q_idx, kv_idx) and doc[q_idx] > 0", same_doc=same_doc, doc=doc)
    assert m2.buffers == (doc,)
    assert len(ir.buffers_of(m2.ir)) == 1

    softcap = score_mod("30.0 * tanh(score / 30.0)")
    assert parse("softcap(score * 2.0, b, h, q_idx, kv_idx)", "score", {"softcap": softcap}) is \
        bi("mul", 30.0, un("tanh", bi("truediv", bi("mul", S, 2.0), 30.0)))


def test_mod_is_a_mod():
    doc = torch.tensor([0, 0, 1, 1, 1])
    text = "doc[q_idx] == doc[kv_idx]"
    m = flexattn.mask_mod(text, doc=doc)
    assert isinstance(m, Mod) and m.kind == "mask" and m.source == text and m.buffers == (doc,)
    assert m.ir is parse(text, "mask", {"doc": doc})
    s = flexattn.score_mod("score * 2.0")
    assert s.kind == "score" and s.ir is bi("mul", S, 2.0) and s.buffers == ()
    assert flexattn.DSLError is DSLError and issubclass(DSLError, ValueError)
    # eager call on tensors, as torch would call a Python mod
    out = m(0, 0, torch.arange(5)[:, None], torch.arange(5)[None, :])
    assert torch.equal(out, doc[:, None] == doc[None, :])


def test_dsl_mod_inside_a_traced_python_mod():
    doc = torch.tensor([0, 0, 1, 1, 1])
    same_doc = mask_mod("doc[q_idx] == doc[kv_idx]", doc=doc)

    def shifted_doc_causal(b, h, q_idx, kv_idx):
        return same_doc(b, h, q_idx - 1, kv_idx) & (q_idx >= kv_idx)

    traced = flexattn.trace(shifted_doc_causal)
    assert traced.ir is parse("doc[q_idx - 1] == doc[kv_idx] and q_idx >= kv_idx", "mask", {"doc": doc})
    assert traced.buffers[0] is doc


def test_text_is_never_evaluated():
    for text in ["__import__('os').system('echo hi')", "open('x')", "exec('1')", "q_idx.__class__"]:
        with pytest.raises(DSLError):
            parse(text)


# ---------------------------------------------------------------------------------------------
# Errors: where, with a caret, and what to do


def _error(text, kind=None, bindings=None, **kw) -> DSLError:
    with pytest.raises(DSLError) as info:
        parse(text, kind, bindings, **kw)
    return info.value


def _caret_line(e: DSLError) -> str:
    return str(e).splitlines()[3]


def test_unknown_name():
    e = _error("q_id >= kv_idx", "mask", {"bias": torch.randn(3)})
    assert (e.line, e.column) == (1, 1)
    msg = str(e)
    assert "unknown name 'q_id' at line 1, column 1" in msg
    assert "    q_id >= kv_idx\n    ^^^^\n" in msg
    assert "did you mean 'q_idx'?" in msg
    assert "known names: b, h, q_idx, kv_idx, bias" in msg
    assert "functions: abs," in msg and "tanh" in msg
    assert "score" not in msg.split("known names:")[1].split("\n")[0]  # masks have no score

    e = _error("let d = q_idx - kv_idx\nd >= 0 and dd < 5", "mask")
    assert (e.line, e.column) == (2, 12) and "known names: b, h, q_idx, kv_idx, d" in str(e)
    assert _caret_line(e) == "    " + " " * 11 + "^^"


def test_score_in_mask():
    e = _error("score > 0", "mask")
    assert "a mask mod has no 'score'" in str(e) and (e.line, e.column) == (1, 1)


@pytest.mark.parametrize("text, line, column, message", [
    ("q_idx >= ", 1, 9, "unexpected end of text"),
    ("q_idx >= kv_idx)", 1, 16, "unexpected ')'"),
    ("let a = 1\nlet b = a +* 2\nb", 2, 12, "unexpected '*'"),
    ("q_idx $ 3", 1, 7, "unexpected character '$'"),
    ("(q_idx\n + 1)\n > 3", 3, 2, "unexpected '>'"),
    ("clamp(score, min=0)", 1, 17, "unexpected '='"),
    ("", 1, 1, "empty text"),
])
def test_syntax_errors(text, line, column, message):
    e = _error(text)
    assert (e.line, e.column) == (line, column)
    assert str(e).startswith(f"{message} at line {line}, column {column}:")
    assert _caret_line(e) == "    " + " " * (column - 1) + "^"


def test_syntax_error_lists_expected():
    e = _error("q_idx >= ")
    assert "expected" in str(e) and "a name" in str(e) and "'('" in str(e)


@pytest.mark.parametrize("text, bindings, column, width, message", [
    ("bias[h, h] > 0", {"bias": torch.randn(3)}, 1, 10, "has 1 dimension(s) but was indexed with 2"),
    ("bias[h][q_idx][kv_idx] > 0", {"bias": torch.randn(3, 4)}, 1, 22, "has 2 dimension(s)"),
    ("q_idx > bias", {"bias": torch.randn(3)}, 9, 4, "'bias' is a 1-d tensor and must be indexed"),
    ("bias[1.5] > 0", {"bias": torch.randn(3)}, 1, 9, "index 0 into captured tensor 'bias' must be an integer"),
    ("tanh(q_idx, 2) > 0", {}, 1, 14, "tanh() takes 1 argument, got 2"),
    ("clamp(q_idx, 1) > 0", {}, 1, 15, "clamp() takes 3 arguments, got 2"),
    ("min(q_idx) > 0", {}, 1, 10, "min() takes at least 2 arguments, got 1"),
    ("tanh > 0", {}, 1, 4, "'tanh' is a function and must be called"),
    ("q_idx(1) > 0", {}, 1, 5, "'q_idx' is not a function"),
    ("q_idx[1] > 0", {}, 1, 5, "'q_idx' cannot be indexed"),
    ("c(b, h, q_idx) > 0", {"c": Mod("mask", ir.const(True))}, 1, 14, "mask_mod 'c' takes 4 arguments, got 3"),
    ("c(b, h, 1.5, kv_idx)", {"c": Mod("mask", ir.const(True))}, 1, 20, "argument 3 (q_idx) of 'c' must be an integer"),
    ("c > 0", {"c": Mod("mask", ir.const(True))}, 1, 1, "'c' is a mod and must be called"),
    ("q_idx > 0 and 1.5 & q_idx > 0", {}, 15, 11, "and needs integer or bool operands, got float32"),
    ("q_idx > 0 and int8(300) > 0", {}, 15, 9, "constant 300 does not fit in int8"),
    ("q_idx > 0 and kv_idx", {}, 1, 20, "'and' needs bool operands, got bool and int32"),
    ("q_idx > 0 or kv_idx", {}, 1, 19, "'or' needs bool operands"),
    ("not q_idx", {}, 1, 9, "'not' needs bool operands, got int32"),
    ("where(q_idx, 1, 0) > 0", {}, 1, 18, "where() condition must be bool, got int32"),
    ("-(q_idx > 0)", {}, 1, 12, "negation of a bool is not supported"),
])
def test_semantic_errors(text, bindings, column, width, message):
    e = _error(text, "mask", bindings)
    assert message in e.message
    assert (e.line, e.column) == (1, column)
    assert _caret_line(e) == "    " + " " * (column - 1) + "^" * width


def test_result_type_errors():
    e = _error("q_idx - kv_idx", "mask")
    assert "mask text must produce bool, but it produces int32" in str(e) and (e.line, e.column) == (1, 1)
    assert _caret_line(e) == "    " + "^" * len("q_idx - kv_idx")
    e = _error("let x = 1\nq_idx > x", "score")
    assert "score text must produce a floating-point score, but it produces bool" in str(e)
    assert (e.line, e.column) == (2, 1)
    with pytest.raises(DSLError, match="mask text must produce bool"):
        mask_mod("q_idx")


def test_let_errors():
    e = _error("let x = 1\nlet x = 2\nx > q_idx")
    assert "'x' is already defined (line 1)" in str(e) and (e.line, e.column) == (2, 5)
    e = _error("let q_idx = 1\nq_idx > 0")
    assert "'q_idx' is already defined" in str(e)
    e = _error("let w = 2\nq_idx > w", bindings={"w": 3})
    assert "'w' is already defined (a keyword binding)" in str(e)


def test_binding_errors():
    with pytest.raises(DSLError, match="binding 'q_idx' would hide an input"):
        parse("q_idx > 0", bindings={"q_idx": 3})
    with pytest.raises(DSLError, match="binding 'tanh' would hide a built-in function"):
        parse("q_idx > 0", bindings={"tanh": 3})
    with pytest.raises(DSLError, match="binding 'x' must be a tensor, a Python number or a mod.*got str"):
        parse("q_idx > 0", bindings={"x": "q_idx"})
    with pytest.raises(DSLError, match="binding 'z' is a tensor of dtype torch.complex64"):
        parse("q_idx > 0", bindings={"z": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(DSLError, match="the mod text must be a str, got int"):
        parse(5)
    with pytest.raises(DSLError, match="kind must be 'score', 'mask' or None, got 'bias'"):
        parse("q_idx", "bias")


# ---------------------------------------------------------------------------------------------
# Round trip: the IR printer writes DSL text that parses back to the same interned node


def _bindings(buffers: list[torch.Tensor], node: ir.Node) -> dict[str, torch.Tensor]:
    names = {b.index: b.name for b in ir.buffers_of(node)}
    return {names.get(i, f"unused{i}"): t for i, t in enumerate(buffers)}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(testing.mask_irs(max_depth=4))
def test_round_trip_mask_irs(case):
    node, buffers = case
    assert parse(ir.to_text(node), "mask", _bindings(buffers, node)) is node


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(testing.score_irs(max_depth=4, score_dtype=torch.float16))
def test_round_trip_score_irs(case):
    node, buffers = case
    assert parse(ir.to_text(node), "score", _bindings(buffers, node), score_dtype=torch.float16) is node


# The hypothesis strategies build only well-defined trees; this generator also makes the odd
# ones (typed constants of every dtype, nan/inf/-0.0, ops between two constants, casts).
_T = {"bias": torch.randn(4), "doc": torch.arange(6, dtype=torch.int32), "table": torch.randn(3, 5).half(),
      "s0": torch.tensor(2.0), "keep": torch.ones(7, dtype=torch.bool)}
_BUF = {n: ir.Buffer(i, n, t.dtype, t.dim()) for i, (n, t) in enumerate(_T.items())}


def _random_ir(r: random.Random, depth: int):
    def leaf():
        if r.random() < 0.4:
            return ir.input_(r.choice(ir.SCORE_INPUTS))
        value = r.choice([0, 1, -3, 2.5, -0.0, 1e-3, math.inf, -math.inf, math.nan, True, 300, -1e20])
        try:
            return const(value, r.choice(list(ir.DTYPES.values()))) if r.random() < 0.6 else value
        except ir.IRError:
            return value

    if depth == 0:
        return leaf()
    sub = lambda: _random_ir(r, depth - 1)  # noqa: E731
    k = r.random()
    try:
        if k < 0.3:
            return bi(r.choice(list(ir.BINARY_OPS)), sub(), sub())
        if k < 0.5:
            return un(r.choice(list(ir.UNARY_OPS)), sub())
        if k < 0.6:
            return where(bi("lt", sub(), sub()), sub(), sub())
        if k < 0.7:
            return ir.cast(sub(), r.choice(list(ir.DTYPES.values())))
        if k < 0.85:
            buf = _BUF[r.choice(list(_T))]
            return ir.load(buf, [ir.cast(sub(), r.choice([torch.int32, torch.int64])) for _ in range(buf.ndim)])
        return sub()
    except ir.IRError:
        return leaf()


def test_round_trip_odd_trees():
    r = random.Random(1234)
    checked = 0
    for _ in range(400):
        n = _random_ir(r, 4)
        n = n if isinstance(n, ir.Node) else const(n)
        assert parse(ir.to_text(n), None, _T) is n, ir.to_text(n)
        checked += n.op not in ("const", "input")
    assert checked > 200


def test_mod_called_on_a_float64_score_computes_as_the_python_mod_does():
    """A float32 mod called on float64 scores (the float64 oracle, torch's flex_attention) keeps the
    score's precision through its ops, with literals as weak Python floats, as the Python mod and
    flexattn's re-typed kernels do; the parts without the score stay float32, as in torch."""
    score = torch.linspace(-3, 3, 7, dtype=torch.float64).view(1, 1, 7, 1)
    q_idx, kv_idx = torch.arange(7, dtype=torch.int32).view(1, 1, 7, 1), torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    for text, fn in (("score + 1e-12", lambda s, q: s + 1e-12),
                     ("tanh(score / 30) * 30", lambda s, q: torch.tanh(s / 30) * 30),
                     ("score * 0.1 + q_idx * 0.1", lambda s, q: s * 0.1 + q * 0.1),
                     ("where(q_idx > 2, score, 0.3) - score", lambda s, q: torch.where(q > 2, s, 0.3) - s)):
        out = score_mod(text)(score, 0, 0, q_idx, kv_idx)
        assert out.dtype == torch.float64 and torch.equal(out, fn(score, q_idx)), text


def test_round_trip_of_dsl_mods():
    texts = ["let d = q_idx - kv_idx\n0 <= d < 64 or kv_idx < 4",
             "score - slope[h] * float32(abs(q_idx - kv_idx))",
             "where(q_idx // 16 == kv_idx // 16, softcap * tanh(score / softcap), -inf)"]
    bindings = {"slope": torch.rand(4), "softcap": 20.0}
    for text in texts:
        n = parse(text, None, bindings)
        assert parse(str(n), None, bindings) is n


# ---------------------------------------------------------------------------------------------
# DSL mods where Python mods run


def _python_and_dsl_mods():
    doc = torch.tensor([0] * 9 + [1] * 14 + [2] * 14)  # 37 tokens, not a multiple of the block
    slope = torch.rand(3) + 0.1
    pairs = {
        "causal": (lambda b, h, q, k: q >= k, mask_mod("q_idx >= kv_idx")),
        "sliding": (lambda b, h, q, k: (q - k >= 0) & (q - k < 8),
                    mask_mod("let d = q_idx - kv_idx\n0 <= d < window", window=8)),
        "document": (lambda b, h, q, k: doc[q] == doc[k], mask_mod("doc[q_idx] == doc[kv_idx]", doc=doc)),
        "prefix_lm": (lambda b, h, q, k: (k < 5) | (q >= k), mask_mod("kv_idx < prefix or q_idx >= kv_idx", prefix=5)),
    }
    scores = {
        "alibi": (lambda s, b, h, q, k: s - slope[h] * (q - k).abs(),
                  score_mod("score - slope[h] * abs(q_idx - kv_idx)", slope=slope)),
        "softcap": (lambda s, b, h, q, k: 5.0 * torch.tanh(s / 5.0), score_mod("cap * tanh(score / cap)", cap=5.0)),
        "identity": (lambda s, b, h, q, k: s, score_mod("score")),
    }
    return pairs, scores


def test_torch_create_mask_and_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    masks, _ = _python_and_dsl_mods()
    B, H, L = 2, 3, 37
    for name, (py, dsl) in masks.items():
        expected = create_mask(py, B, H, L, L, device="cpu")
        got = create_mask(dsl, B, H, L, L, device="cpu")
        assert expected.any() and not expected.all()
        assert torch.equal(got, expected), name
        bm_py = create_block_mask(py, B, H, L, L, device="cpu", BLOCK_SIZE=16)
        bm_dsl = create_block_mask(dsl, B, H, L, L, device="cpu", BLOCK_SIZE=16)
        for a, b in zip(bm_dsl.as_tuple()[2:10], bm_py.as_tuple()[2:10]):
            assert torch.equal(a, b), name


def test_torch_flex_attention():
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    masks, scores = _python_and_dsl_mods()
    torch.manual_seed(0)
    B, H, L, E = 1, 3, 37, 16
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex_attention is slow
        for sname, (py_s, dsl_s) in scores.items():
            for mname in ("causal", "document"):
                py_m, dsl_m = masks[mname]
                expected = flex_attention(q, k, v, score_mod=py_s,
                                          block_mask=create_block_mask(py_m, B, H, L, L, device="cpu"))
                got = flex_attention(q, k, v, score_mod=dsl_s,
                                     block_mask=create_block_mask(dsl_m, B, H, L, L, device="cpu"))
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=f"{sname} {mname}")


def test_vmap_like_torch():
    masks, scores = _python_and_dsl_mods()
    qi, ki = torch.arange(37), torch.arange(37)
    score = torch.randn(37, 37)
    for name, (py, dsl) in masks.items():
        f = lambda fn: torch.vmap(torch.vmap(fn, in_dims=(None, None, None, 0)),  # noqa: E731
                                  in_dims=(None, None, 0, None))
        assert torch.equal(f(dsl)(torch.tensor(0), torch.tensor(1), qi, ki),
                           f(py)(torch.tensor(0), torch.tensor(1), qi, ki)), name
    for name, (py, dsl) in scores.items():
        args = (score, torch.tensor(0), torch.tensor(2), qi[:, None], ki[None, :])
        torch.testing.assert_close(dsl(*args), py(*args), rtol=1e-6, atol=1e-6, msg=name)


def test_generated_kernel_matches_eager():
    from helpers.grid_kernel import evaluate_grid

    doc = torch.tensor([0] * 5 + [1] * 8 + [2] * 6, dtype=torch.int32)
    slope = torch.rand(2) + 0.1
    m = mask_mod("let d = q_idx - kv_idx\ndoc[q_idx] == doc[kv_idx] and 0 <= d < 6", doc=doc)
    s = score_mod("where(q_idx >= kv_idx, score - slope[h] * abs(q_idx - kv_idx), -inf)", slope=slope)
    B, H, L = 1, 2, 19
    qi = torch.arange(L).view(1, 1, L, 1)
    ki = torch.arange(L).view(1, 1, 1, L)
    hh = torch.arange(H).view(1, H, 1, 1)
    got = evaluate_grid(m, B, H, L, L, BLOCK_M=16, BLOCK_N=16)
    assert torch.equal(got, m(0, hh, qi, ki).expand(B, H, L, L))
    score = torch.randn(B, H, L, L)
    got = evaluate_grid(s, B, H, L, L, score=score, BLOCK_M=16, BLOCK_N=16)
    ref = score.double() - slope.double().view(1, H, 1, 1) * (qi - ki).abs()
    ref = torch.where(qi >= ki, ref, -math.inf)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


def test_function_table_is_complete():
    assert set(ir.UNARY_OPS) - {"not"} <= set(FUNCTIONS)
    assert set(ir.DTYPES) <= set(FUNCTIONS)
    assert {"minimum", "maximum", "min", "max", "clamp", "where", "abs"} <= set(FUNCTIONS)
