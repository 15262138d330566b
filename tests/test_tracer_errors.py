"""Tracer errors: what a mod that cannot be traced is told, and where it points.

Each error names the mod, the file and line of the mod's code, and what to do instead.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn.tracer import TraceError, trace
from helpers.tracing import BIAS1, BIAS3, causal

U8_0 = torch.tensor(1, dtype=torch.uint8)  # a captured 0-d uint8 tensor


def location(fn, offset: int) -> str:
    """'file:line' of the line ``offset`` lines below ``fn``'s def line."""
    return f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno + offset}"


# ---------------------------------------------------------------------------------------------
# Errors


def test_control_flow_error_names_mod_file_line_and_suggests_where():
    def branchy(b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return True
        return False

    with pytest.raises(TraceError) as e:
        trace(branchy)
    msg = str(e.value)
    assert "mask_mod 'branchy'" in msg and location(branchy, 1) in msg
    assert "if q_idx >= kv_idx:" in msg and "torch.where" in msg and "`(q_idx >= kv_idx)`" in msg
    assert isinstance(e.value, TypeError)


@pytest.mark.parametrize("body, what", [
    (lambda b, h, q, kv: q > 1 and kv > 1, "bool()"),
    (lambda b, h, q, kv: max(q, kv) > 2, "bool()"),
    (lambda b, h, q, kv: torch.tensor(math.exp(q)) > 1, "float()"),
    (lambda b, h, q, kv: int(q) > 1, "int()"),
    (lambda b, h, q, kv: [True, False][kv], "integer index"),
    (lambda b, h, q, kv: q.item() > 1, ".item()"),
    (lambda b, h, q, kv: len(q) > 1, "len()"),
    (lambda b, h, q, kv: [x for x in q], "iterated over"),
    (lambda b, h, q, kv: range(q), "integer index"),
])
def test_control_flow_errors(body, what):
    with pytest.raises(TraceError) as e:
        trace(body, "mask")
    msg = str(e.value)
    assert what in msg and "torch.where" in msg and "mask_mod '<lambda>'" in msg
    assert f"{__file__}:" in msg  # the line of this test file that holds the lambda


def test_error_location_is_the_inner_mod_line():
    def inner(b, h, q_idx, kv_idx):
        return bool(q_idx > 3)

    def outer(b, h, q_idx, kv_idx):
        return torch_flex.and_masks(causal, inner)(b, h, q_idx, kv_idx)

    with pytest.raises(TraceError) as e:
        trace(outer)
    assert "mask_mod 'outer'" in str(e.value) and location(inner, 1) in str(e.value)


def test_unsupported_torch_function_names_itself_and_lists_supported():
    def cum(score, b, h, q_idx, kv_idx):
        return torch.cumsum(score, 0)

    with pytest.raises(TraceError) as e:
        trace(cum)
    msg = str(e.value)
    assert "calls torch.cumsum on a traced value" in msg and location(cum, 1) in msg
    assert "torch.where" in msg and "torch.exp" in msg and "torch.nn.functional.gelu" in msg
    with pytest.raises(TraceError, match=r"calls torch.Tensor.cumsum"):
        trace(lambda s, b, h, q, kv: s.cumsum(0))
    with pytest.raises(TraceError, match=r"torch.max\(x\) / torch.max\(x, dim\).*torch.maximum"):
        trace(lambda s, b, h, q, kv: torch.max(s))
    with pytest.raises(TraceError, match=r"attribute .T of a traced value"):
        trace(lambda s, b, h, q, kv: s.T)
    with pytest.raises(AttributeError, match="has no attribute 'nonsense'"):
        trace(lambda s, b, h, q, kv: s.nonsense)


@pytest.mark.parametrize("body, expected", [
    (lambda s, b, h, q, kv: s + BIAS1[q * 0.5], r"indexes captured tensor 'BIAS1' with the float32 value `\(float32\(q_idx\) \* 0.5\)`; indices must be integers"),
    (lambda s, b, h, q, kv: s + BIAS1[q > kv], r"indexes captured tensor 'BIAS1' with a bool traced value.*torch.where"),
    (lambda s, b, h, q, kv: s + BIAS1[True], r"with a Python bool"),
    # torch indexes with a uint8 tensor as with a bool mask, not as a gather
    (lambda s, b, h, q, kv: s + BIAS1[(q - kv).to(torch.uint8)], r"'BIAS1' with a uint8 traced value.*uint8 tensor index as a bool mask.*\.long\(\)"),
    (lambda s, b, h, q, kv: s + BIAS3[b, h, U8_0], r"'BIAS3' with a tensor of dtype torch.uint8.*as a bool mask"),
    (lambda s, b, h, q, kv: s + BIAS1[1:q], r"'BIAS1' with a slice"),
    (lambda s, b, h, q, kv: s + BIAS3[b, :, q], r"'BIAS3' with a slice"),
    (lambda s, b, h, q, kv: s + BIAS3[b, ..., q], r"'BIAS3' with `...`"),
    (lambda s, b, h, q, kv: s + BIAS3[b, None], r"'BIAS3' with None"),
    (lambda s, b, h, q, kv: s + BIAS3[b, 2.0], r"'BIAS3' with a float \(2.0\)"),
    (lambda s, b, h, q, kv: s + BIAS1[q, kv], r"'BIAS1' \(1 dims\) with 2 indices"),
    (lambda s, b, h, q, kv: s + BIAS3[b][h], r"captured tensor 'BIAS3' \(3 dims\) indexed with only 2 index\(es\).*BIAS3\[h, q_idx, kv_idx\]"),
    (lambda s, b, h, q, kv: torch.exp(BIAS3[b]), r"'BIAS3' \(3 dims\) indexed with only 1"),
    (lambda s, b, h, q, kv: BIAS3[b].float(), r"'BIAS3' \(3 dims\) indexed with only 1"),
    (lambda s, b, h, q, kv: s + BIAS3, r"combines captured tensor 'BIAS3' of shape \(2, 3, 11\) with a traced value"),
    (lambda s, b, h, q, kv: s[0], r"indexes a traced value"),
    (lambda s, b, h, q, kv: q * 2**40, r"constant 1099511627776 does not fit in int32"),
    (lambda s, b, h, q, kv: s + b.new_ones((2,)), r"new_ones with size \(2,\)"),
    (lambda s, b, h, q, kv: torch.round(s, decimals=2), r"torch.round\(decimals=2\)"),
    (lambda s, b, h, q, kv: torch.where(s > 0), r"torch.where\(cond, a, b\)"),
    (lambda s, b, h, q, kv: F.gelu(s, approximate="fast"), r"expected 'none' or 'tanh'"),
    (lambda s, b, h, q, kv: s + "x", r"uses a str \('x'\) as a value"),
    (lambda s, b, h, q, kv: ~s, r"needs an integer or bool operand, got float32"),
])
def test_error_messages(body, expected):
    with pytest.raises(TraceError, match=expected) as e:
        trace(body, "score")
    assert "score_mod '<lambda>'" in str(e.value) and f"{__file__}:" in str(e.value)


def test_result_errors():
    with pytest.raises(TraceError, match=r"mask_mod 'diff' must return a bool, but it returned a int32 value: `\(q_idx - kv_idx\)`"):
        def diff(b, h, q_idx, kv_idx):
            return q_idx - kv_idx
        trace(diff)
    with pytest.raises(TraceError, match=r"score_mod 'nothing' returned None; expected a float score value \(missing `return`\?\)"):
        def nothing(score, b, h, q_idx, kv_idx):
            score + 1
        trace(nothing)
    with pytest.raises(TraceError, match=r"returned tuple"):
        trace(lambda b, h, q, kv: (q, kv))


def test_captured_tensor_with_unsupported_dtype():
    c = torch.zeros(4, dtype=torch.complex64)
    with pytest.raises(TraceError, match=r"captured tensor of dtype torch.complex64"):
        trace(lambda s, b, h, q, kv: s + c[q])


def test_error_class_is_exported():
    assert flexattn.TraceError is TraceError and issubclass(TraceError, TypeError)
    assert flexattn.trace is trace
