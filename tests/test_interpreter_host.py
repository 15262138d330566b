"""The CPU path against the host's numpy: its results do not depend on the BLAS, and a numpy the
interpreter cannot work with is named in the error.

Triton's interpreter runs tl.dot as numpy's matmul, so on whatever BLAS numpy was built with, and a
BLAS may keep fewer bits than IEEE float32 in a float32 product (a CI machine once gave the demo's
float32 output an error of 1.2e-4 against float64, where ours give 9e-7). The kernels feed the
interpreter's dot float64 copies (`tiles.mma`, DOT_IN_FP64), so a coarse float32 matmul must not
move flexattn's forward, backward or decoding results.
"""

import numpy as np
import pytest
import torch
from triton.runtime import interpreter
from triton.runtime.errors import InterpreterError

import flexattn
from flexattn.codegen.cache import load_source
from flexattn.decode import decode_attention
from flexattn.reference import attention_reference

KEPT_BITS = 10  # a float32 product with TF32's 10 mantissa bits


def _round_mantissa(x):
    bits = x.view(np.uint32).astype(np.uint64)
    drop = 23 - KEPT_BITS
    bits = ((bits + (1 << (drop - 1))) >> drop) << drop
    return bits.astype(np.uint32).view(np.float32)


@pytest.fixture
def coarse_float32_blas(monkeypatch):
    """numpy's matmul rounds float32 operands to KEPT_BITS mantissa bits first (float64 untouched)."""
    exact = np.matmul

    def matmul(a, b, *args, **kwargs):
        if a.dtype == np.float32:
            a = _round_mantissa(np.ascontiguousarray(a))
        if b.dtype == np.float32:
            b = _round_mantissa(np.ascontiguousarray(b))
        return exact(a, b, *args, **kwargs)

    monkeypatch.setattr(np, "matmul", matmul)
    # The stand-in reaches the interpreter: a bare float32 tl.dot now comes out coarse.
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    out = torch.full_like(x, float("nan"))
    load_source(_DOT_KERNEL, "test_dot", interpret=True).dot_kernel[(1,)](x, x, out, N=32)
    assert (out.double() - x.double() @ x.double()).abs().max().item() > 1e-3


_DOT_KERNEL = """\
import triton
import triton.language as tl


@triton.jit
def dot_kernel(A, B, C, N: tl.constexpr):
    r = tl.arange(0, N)
    tile = r[:, None] * N + r[None, :]
    tl.store(C + tile, tl.dot(tl.load(A + tile), tl.load(B + tile), input_precision="ieee"))
"""


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


def _qkv(B, H, Q_LEN, KV_LEN, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g) for n in (Q_LEN, KV_LEN, KV_LEN)]


def _alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.125 * (q_idx - kv_idx)


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 50)


def test_forward_and_backward_in_float32(coarse_float32_blas):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 77, 77, 32))
    bm = flexattn.create_block_mask(_window, 1, 2, 77, 77, device="cpu", BLOCK_SIZE=16)
    out, lse = flexattn.flex_attention(q, k, v, score_mod=_alibi, block_mask=bm, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, score_mod=_alibi, block_mask=bm, return_lse=True)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5

    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, g, r in zip("qkv", grads, ref_grads):
        err = (g.double() - r).abs().max().item()
        assert err < 1e-4 * (1 + r.abs().max().item()), (name, err)


def test_decoding_in_float32(coarse_float32_blas):
    q, k, v = _qkv(2, 4, 3, 150, 32)
    out, lse = decode_attention(q, k, v, score_mod=_alibi, return_lse=True, kernel_options={"SPLIT_KV": 3})
    ref, ref_lse = attention_reference(q, k, v, score_mod=_alibi, return_lse=True)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def test_the_demo(coarse_float32_blas, capsys):
    from flexattn.demo import main

    assert main([]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_a_numpy_the_interpreter_cannot_use_is_named(monkeypatch):
    # triton 3.6's interpreter calls int() on one-element arrays, which numpy 2.4 refuses; the
    # error it raises deep in the kernel becomes one that says what to install.
    def run(self, *args, **kwargs):
        raise InterpreterError(repr(TypeError("only 0-dimensional arrays can be converted to Python scalars")))

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    q, k, v = _qkv(1, 1, 23, 23, 16)  # a shape no other test runs: a first launch
    with pytest.raises(RuntimeError, match=r"numpy .* refuses .*install 'numpy<2.4' or a newer triton"):
        flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.75)

    def run_other(self, *args, **kwargs):
        raise InterpreterError("something else")

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run_other)
    q, k, v = _qkv(1, 1, 29, 29, 16)
    with pytest.raises(InterpreterError, match="something else"):  # other errors pass through
        flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.625)
