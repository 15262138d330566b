"""Integer // and % by zero mean one thing on every path: x // 0 == 0 and x % 0 == x.

(torch raises on the CPU and a GPU kernel cannot raise, so flexattn defines the value; see
docs/dsl.md.) The paths: generated kernels (here through Triton's interpreter), the Mod called
eagerly, `ir.evaluate`, constant folding, interval analysis, block-mask building on both backends,
and flex_attention against a float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from helpers.grid_kernel import evaluate_grid
from helpers.testing import tile_states_of_dense

import flexattn
from flexattn import interval, ir
from flexattn.block_mask import create_block_mask
from flexattn.dsl import mask_mod, score_mod
from flexattn.reference import attention_reference

DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def expected(a: int, d: int, op: str, dtype: torch.dtype) -> int:
    """Python's floor division / modulo, with the zero divisor defined, wrapped to ``dtype``."""
    if d == 0:
        out = 0 if op == "floordiv" else a
    else:
        out = a // d if op == "floordiv" else a % d
    info = torch.iinfo(dtype)
    return (out - info.min) % (info.max - info.min + 1) + info.min


def operands(dtype):
    info = torch.iinfo(dtype)
    if dtype == torch.uint8:
        nums, dens = [0, 1, 7, 200, 255], [0, 1, 3, 250]
    else:
        nums, dens = [info.min, -7, -1, 0, 5, info.max], [0, -1, 3, -3, info.min, 0]
    return torch.tensor(nums, dtype=dtype), torch.tensor(dens, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["floordiv", "mod"])
def test_kernel_eager_and_evaluator_agree_on_zero_divisors(dtype, op):
    nums, dens = operands(dtype)
    text = f"float64(n[q_idx] {'//' if op == 'floordiv' else '%'} d[kv_idx]) + score * 0.0"
    mod = score_mod(text, n=nums, d=dens)
    Q, KV = len(nums), len(dens)
    want = torch.tensor([[expected(int(a), int(d), op, dtype) for d in dens] for a in nums], dtype=torch.float64)
    q_idx = torch.arange(Q, dtype=torch.int32)[:, None]
    kv_idx = torch.arange(KV, dtype=torch.int32)[None, :]
    score = torch.full((1, 1, Q, KV), 0.5, dtype=torch.float32)
    kernel = evaluate_grid(mod, 1, 1, Q, KV, score=score)[0, 0]
    eager = mod(score[0, 0].double(), 0, 0, q_idx, kv_idx)  # a Mod answers in the score's dtype
    evaluated = ir.evaluate(mod.ir, {"score": score[0, 0], "b": 0, "h": 0, "q_idx": q_idx, "kv_idx": kv_idx},
                            mod.buffers)
    assert torch.equal(kernel.double(), want), (kernel, want)
    assert torch.equal(eager.double(), want)
    assert torch.equal(evaluated.double(), want)


def test_constant_folding_uses_the_same_meaning():
    x = ir.const(7, torch.int32)
    assert ir.binary("floordiv", x, ir.const(0, torch.int32)).arg == 0
    assert ir.binary("mod", x, ir.const(0, torch.int32)).arg == 7
    assert ir.binary("mod", ir.const(-7, torch.int64), 0).arg == -7


def test_interval_analysis_knows_zero_divisors():
    q = ir.input_("q_idx")
    ops = interval.EagerOps()
    inputs = {"b": (ops.i64(0), ops.i64(0)), "h": (ops.i64(0), ops.i64(0)), "q_idx": (ops.i64(5), ops.i64(9)),
              "kv_idx": (ops.i64(0), ops.i64(3))}
    lo, hi = interval.analyze(ir.binary("floordiv", q, ir.binary("mul", ir.input_("kv_idx"), 0)), ops, inputs, {})
    assert (int(lo), int(hi)) == (0, 0)
    lo, hi = interval.analyze(ir.binary("mod", q, ir.binary("mul", ir.input_("kv_idx"), 0)), ops, inputs, {})
    assert (int(lo), int(hi)) == (5, 9)
    # a divisor range that includes 0 (and other values) gives a sound, wider range
    lo, hi = interval.analyze(ir.binary("floordiv", q, ir.input_("kv_idx")), ops, inputs, {})
    assert int(lo) <= 0 and int(hi) >= 9


# A mask whose divisor is zero on a third of the rows: kv_idx // (q_idx % 3) and kv_idx % (q_idx % 3).
MASK_TEXT = "(kv_idx // (q_idx % 3)) + (kv_idx % (q_idx % 3)) <= q_idx"


def dense_mask(Q, KV):
    q = torch.arange(Q)[:, None]
    kv = torch.arange(KV)[None, :]
    d = q % 3
    safe = torch.where(d == 0, 1, d)
    div = torch.where(d == 0, 0, kv // safe)
    rem = torch.where(d == 0, kv, kv % safe)
    return (div + rem) <= q


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_masks_follow_the_same_meaning(backend):
    Q, KV = 70, 53
    bm = create_block_mask(mask_mod(MASK_TEXT), None, None, Q, KV, device="cpu", BLOCK_SIZE=16, backend=backend)
    assert torch.equal(bm.tile_states()[0, 0], tile_states_of_dense(dense_mask(Q, KV), 16, 16))


def test_flex_attention_with_zero_divisors_matches_float64():
    Q, KV, E = 45, 37, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, E, generator=g) for n in (Q, KV, KV))
    mask = mask_mod(MASK_TEXT)
    bm = create_block_mask(mask, None, None, Q, KV, device="cpu", BLOCK_SIZE=16)
    out = flexattn.flex_attention(q, k, v, block_mask=bm)
    dense = dense_mask(Q, KV)
    ref = attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: dense[qi, ki])
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("divisor", ["0", "int64(0)", "int8(0)"])
def test_constant_zero_divisor_in_kernels(divisor):
    mod = mask_mod(f"(kv_idx // {divisor} == 0) and (kv_idx % {divisor} == kv_idx) and q_idx >= 0")
    out = evaluate_grid(mod, 1, 1, 5, 19)
    assert out.all()
    assert mod(0, 0, torch.arange(5)[:, None], torch.arange(19)[None, :]).all()
