"""Traced mods against torch's own semantics: the mod vmapped over (b, h, q_idx, kv_idx).

The oracle evaluates a Python mod exactly as torch.nn.attention.flex_attention does (int32
indices, 0-d values per element) and compares it, value and pre-cast dtype, with its traced IR.
"""

from __future__ import annotations

import torch
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

from flexattn import ir
from flexattn.mods import Mod
from flexattn.tracer import trace
from helpers import testing

B, H, Q, KV = 2, 3, 11, 13  # not multiples of anything on purpose
SCORE = testing.random_score(B, H, Q, KV, seed=1)


def vmap_eval(fn, kind: str, score: torch.Tensor | None = None) -> torch.Tensor:
    """``fn`` over the full grid, vmapped like torch's flex_attention (innermost dim kv_idx)."""
    idx = [torch.arange(n, dtype=torch.int32) for n in (B, H, Q, KV)]
    f = fn
    prefix = (0,) if kind == "score" else ()
    for dims in [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]:
        f = torch.vmap(f, in_dims=prefix + dims)
    with TransformGetItemToIndex():
        return f(score, *idx) if kind == "score" else f(*idx)


def traced_eval(mod: Mod, score: torch.Tensor | None = None) -> torch.Tensor:
    return testing.eval_grid(mod.ir, mod.buffers, B, H, Q, KV, score if mod.kind == "score" else None)


def uncast(mod: Mod, natural: torch.dtype | None = None) -> ir.Node:
    """The score mod's value before trace() cast it to score_dtype (a no-op cast leaves no node)."""
    root = mod.ir
    if mod.kind == "score" and root.op == "cast" and root.dtype != natural:
        return root.src[0]
    return root


def check(fn, kind: str | None = None, **kw) -> Mod:
    """Trace ``fn``; its IR must match the eager vmapped ``fn`` in value and (pre-cast) dtype."""
    mod = trace(fn, kind, **kw)
    want = vmap_eval(fn, mod.kind, SCORE)
    got = traced_eval(mod, SCORE)
    if mod.ir.op != "const":  # casts of constants fold away, and with them the natural dtype
        assert uncast(mod, want.dtype).dtype == want.dtype, (mod, want.dtype)
    if mod.kind == "mask":
        assert got.dtype == torch.bool
        assert torch.equal(got, want.expand_as(got)), mod
    else:
        assert got.dtype == mod.score_dtype or mod.score_dtype is None
        torch.testing.assert_close(got, want.to(got.dtype).expand_as(got), rtol=1e-5, atol=1e-5, equal_nan=True)
    return mod


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# Captured tensors the tracer tests share (one generator: the property tests draw after these).
g = torch.Generator().manual_seed(0)
BIAS1 = torch.randn(Q, generator=g)
BIAS4 = torch.randn(B, H, Q, KV, generator=g)
BIAS3 = torch.randn(B, H, Q, generator=g)
