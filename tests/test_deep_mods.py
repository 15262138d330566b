"""Deep and hostile mods: big expressions compile and run, names never become code.

A 1,000-term sum and a 300-level torch.where chain go through tracing, printing, emitting, the
forward and backward kernels and the eager evaluator, each in time linear in the number of distinct
nodes, and agree with a float64 reference. A mod whose __name__ holds Python code gets a kernel
whose source holds that name only as an escaped comment.
"""

from __future__ import annotations

import ast
import time

import pytest
import torch

import flexattn
from flexattn import autodiff, ir
from flexattn.codegen import emit
from flexattn.codegen.render import comment_block
from flexattn.dsl import parse
from flexattn.reference import attention_reference

B, H, L, E = 1, 2, 37, 16


def inputs(seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, E, generator=g, dtype=torch.float32).requires_grad_(requires_grad)
            for _ in range(3)]


def long_sum(score, b, h, q_idx, kv_idx):
    # 1,000 distinct terms, summed in a loop: a chain 1,000 nodes deep.
    for i in range(1000):
        score = score + (q_idx - kv_idx + i % 11) * (1e-5 * (i + 1))
    return score


def where_chain(score, b, h, q_idx, kv_idx):
    # Each level uses the previous one twice: as a tree this is 2**300 nodes.
    for i in range(300):
        score = torch.where(q_idx >= kv_idx + (i % 5), score * 0.995, score + 0.002)
    return score


def check_linear_walks(mod):
    start = time.perf_counter()
    n_nodes = len(ir.toposort(mod.ir))
    text = str(mod.ir)
    assert len(text) < 200 * n_nodes  # shared nodes written once (let), not repeated
    assert parse(text, "score") is mod.ir  # and the text still means the same IR
    src = emit.emit_mod(mod.ir, mod.kind, target="interpret").source
    ast.parse(src)  # bounded nesting: Python can parse it
    assert max(len(line) for line in src.splitlines()) < 2000
    autodiff.differentiate(mod.ir)
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("fn", [long_sum, where_chain])
def test_deep_mod_compiles_and_matches_float64_forward_and_backward(fn):
    mod = flexattn.trace(fn)
    check_linear_walks(mod)
    q, k, v = inputs(requires_grad=True)
    out = flexattn.flex_attention(q, k, v, score_mod=mod)
    out.backward(torch.ones_like(out))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, score_mod=mod)
    ref.backward(torch.ones_like(ref))
    # (the kernel sums 1,000 float32 terms into scores of up to about 200, the reference in float64:
    # a float32 rounding per term, 5e-5 measured at the largest)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    for got, want, name in [(q.grad, q64.grad, "dq"), (k.grad, k64.grad, "dk"), (v.grad, v64.grad, "dv")]:
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, msg=name)
    # the eager evaluator (what calling the Mod does) gives the same values as the traced function
    s = torch.randn(5, 7, dtype=torch.float32)
    qi, ki = torch.arange(5, dtype=torch.int32)[:, None], torch.arange(7, dtype=torch.int32)[None, :]
    torch.testing.assert_close(mod(s, 0, 0, qi, ki), fn(s, 0, 0, qi, ki), atol=1e-6, rtol=1e-6)


def test_mod_name_with_code_in_it_stays_a_comment():
    marker = "INJECTED_MARKER_13"

    def sneaky(score, b, h, q_idx, kv_idx):
        return score * 0.5

    sneaky.__name__ = f"x\nraise SystemExit('{marker}')\n\x0c\u2028# "
    mod = flexattn.trace(sneaky)
    q, k, v = inputs(seed=1)
    out = flexattn.flex_attention(q, k, v, score_mod=mod)  # would raise SystemExit if the name ran
    ref = attention_reference(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    block = comment_block(f"score_mod {mod.name}", "line one\rraise SystemExit\nline three")
    for line in block.splitlines():
        assert line.startswith("#"), line
    assert len(block.splitlines()) == 4 and marker in block


@pytest.mark.parametrize("name", ["bad name", "x\nimport os", "def", "ümlaut", "a.b"])
def test_generated_function_names_must_be_identifiers(name):
    node = ir.binary("ge", ir.input_("q_idx"), ir.input_("kv_idx"))
    with pytest.raises(ValueError, match="a generated function name must be an ASCII Python identifier"):
        emit.emit_mod(node, "mask", name=name, target="interpret")


def test_mod_without_source_text_is_described_in_linear_size():
    # Defined in exec'd code: inspect cannot find its source, so the Mod describes its IR.
    namespace = {"torch": torch}
    exec("def chain(score, b, h, q_idx, kv_idx):\n"
         "    for i in range(300):\n"
         "        score = torch.where(q_idx >= kv_idx + i % 5, score * 0.995, score + 0.002)\n"
         "    return score\n", namespace)
    start = time.perf_counter()
    mod = flexattn.trace(namespace["chain"])
    assert "let _v0 = " in mod.source and len(mod.source) < 100_000
    assert parse(mod.source, "score") is mod.ir
    assert time.perf_counter() - start < 10
