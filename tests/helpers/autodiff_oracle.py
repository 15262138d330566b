"""Eager oracles for `flexattn.autodiff`: what the backward kernels must compute from a derivative,
and which ops still lack a derivative rule."""

from __future__ import annotations

import torch

from flexattn import ir
from flexattn.autodiff import BINARY_RULES, UNARY_RULES, ScoreModGrad


def missing_rules() -> list[str]:
    """IR ops that can produce a float but have no derivative rule (the tests keep this empty)."""
    no_float = {"not", "invert", *ir.COMPARISONS, *ir.BITWISE}
    return [op for op in [*ir.UNARY_OPS, *ir.BINARY_OPS]
            if op not in UNARY_RULES and op not in BINARY_RULES and op not in no_float]


def evaluate_grads(d: ScoreModGrad, inputs: dict, buffers, grad_out: torch.Tensor, device=None):
    """Eager reference for what the backward kernels compute from ``d``.

    With ``loss = sum(grad_out * mod(inputs))`` this returns ``(d loss / d score, grads)`` where
    ``grads[i]`` is d loss / d buffers[i] for every floating buffer the mod gathers from: each
    gathered derivative is scattered (with the forward's negative-index wrapping; out-of-range
    reads got 0 and send nothing back) into a zero tensor of the buffer's shape.

    Example::

        >>> from flexattn.autodiff import differentiate
        >>> s, h = ir.input_("score"), ir.input_("h")
        >>> d = differentiate(ir.binary("mul", s, ir.load(ir.Buffer(0, "g", torch.float32, 1), [h])))
        >>> ds, gr = evaluate_grads(d, {"score": torch.ones(2, 1), "h": torch.arange(2)[:, None]},
        ...                         [torch.tensor([2.0, 3.0])], torch.ones(2, 1))
        >>> ds.flatten().tolist(), gr[0].tolist()
        ([2.0, 3.0], [1.0, 1.0])
    """
    ev = ir.Evaluator(inputs, list(buffers), device)
    d_score = grad_out * ev.value(d.score)
    grads: dict[int, torch.Tensor] = {}
    for lg in d.loads:
        buf = buffers[lg.buffer.index]
        acc = grads.setdefault(lg.buffer.index, torch.zeros_like(buf))
        val = (grad_out * ev.value(lg.grad)).to(buf.dtype)
        idx = [ev.value(i) for i in lg.indices]
        shape = torch.broadcast_shapes(val.shape, *(i.shape for i in idx))
        val = val.expand(shape).reshape(-1)
        if buf.dim() == 0:
            acc += val.sum()
            continue
        ok = torch.ones_like(val, dtype=torch.bool)
        flat = []
        for dim, i in enumerate(idx):
            i = i.expand(shape).reshape(-1).long()
            i = torch.where(i < 0, i + buf.shape[dim], i)
            ok &= (i >= 0) & (i < buf.shape[dim])
            flat.append(i)
        acc.index_put_(tuple(i[ok] for i in flat), val[ok], accumulate=True)
    return d_score, grads
