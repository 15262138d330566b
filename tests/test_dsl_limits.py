"""DSL limits: constant folding within int64, bounded literals and nesting, every failure a DSLError.

Each hostile text must come back quickly as a `DSLError` with a line, a column and a message that
says what is wrong; never a hang, a RecursionError or a lark VisitError.
"""

from __future__ import annotations

import time

import pytest
import torch

from flexattn.dsl import DSLError, parse, score_mod
from flexattn.dsl.parser import MAX_NESTING


def error_of(text: str, kind: str = "score") -> DSLError:
    start = time.perf_counter()
    with pytest.raises(DSLError) as info:
        parse(text, kind)
    assert time.perf_counter() - start < 5, f"{text[:40]!r} took {time.perf_counter() - start:.1f} s"
    return info.value


@pytest.mark.parametrize("text, message, column", [
    ("score + 9**9**9", "integer constant 9 ** 387420489 overflows int64", 9),
    ("score + pow(9, pow(9, 9))", "integer constant 9 ** 387420489 overflows int64", 9),
    ("score + 2**70", "integer constant 2 ** 70 overflows int64", 9),
    ("score + 2**63 * 2", "integer constant 9223372036854775808 * 2 = 18446744073709551616 overflows int64", 9),
    ("score + 3037000500 * 3037000500", "overflows int64", 9),
    ("score + (1 << 200)", "integer constant 1 << 200 overflows int64", 10),
    ("q_idx >= (1 >> -1)", "negative shift count in the constant 1 >> -1", 11),
    ("score + 7 // 0", "division by zero in the constant expression 7 // 0", 9),
    ("score + 7 % 0", "division by zero in the constant expression 7 % 0", 9),
    ("score + 10.0 ** 400", "the constant expression 10.0 ** 400 overflows a float", 9),
    ("score + 99999999999999999999", "integer literal 99999999999999999999 does not fit in int64", 9),
    ("score + 0x1" + "0" * 16, "does not fit in int64", 9),
    ("score + 1" + "0" * 10**6, "does not fit in int64", 9),
    ("score + 1." + "5" * 200, "is longer than 100 characters", 9),
    ("int64(9223372036854775808)", "constant 9223372036854775808 does not fit in int64", 1),
])
def test_constant_folding_is_bounded(text, message, column):
    e = error_of(text)
    assert message in e.message
    assert (e.line, e.column) == (1, column)
    assert "^" in e.context


def test_int64_edges_still_fold_like_python():
    # -2**63 is a literal 2**63 negated: allowed, as in Python; 2**63 - 1 is int64's maximum.
    assert parse("q_idx + 0 * (-9223372036854775808)").dtype == torch.int32
    node = parse("int64(q_idx) + (2**63 - 1)")
    assert node.src[1].arg == 2**63 - 1
    assert parse("int64(q_idx) + -(2**63)").src[1].arg == -(2**63)
    assert parse("score * 2 ** -1", "score").src[1].arg == 0.5


@pytest.mark.parametrize("text", [
    "-" * 10_000 + "score",
    "score" + " + abs(score" * 3_000 + ")" * 3_000,
])
def test_nesting_is_limited_with_a_clear_error(text):
    e = error_of(text)
    assert f"nested more than {MAX_NESTING} levels deep" in e.message
    assert e.line == 1 and e.column >= 1
    assert "let" in e.hint
    assert len(e.context) < 400  # a window around the column, not the whole text


def test_deep_but_allowed_texts_parse_without_recursion():
    # A 1,000-term sum (a left-leaning tree 1,000 deep) and 1,500 nested negations.
    terms = " + ".join(f"score * {i + 1}.0" for i in range(1000))
    node = parse(terms, "score")
    assert node.op == "add"
    mod = score_mod(terms)
    s = torch.tensor([0.5, -2.0])
    assert torch.allclose(mod(s, 0, 0, 0, 0), s * sum(range(1, 1001)))
    neg = score_mod("-" * 1501 + "score")
    assert torch.equal(neg(s, 0, 0, 0, 0), -s)
    # brackets add no nesting: they are grouping, not operators
    assert parse("(" * 5_000 + "score" + ")" * 5_000, "score") is parse("score", "score")


def test_every_failure_is_a_dsl_error_with_a_position():
    bad = ["score +", "score + @", "let = 3\nscore", "score[0]", "q_idx(1)", "score + (", "\x00",
           "score + 1e999999999999", "score " * 1000, "where(score > 0, score)"]
    for text in bad:
        try:
            parse(text, "score")
        except DSLError as e:
            assert e.line is not None and e.column is not None, text
        else:  # 1e999999999999 is inf, as in Python
            assert text == "score + 1e999999999999"
