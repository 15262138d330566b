"""Float64 references and the tolerances kernels are held to (forward, backward, float8)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from flexattn import ir
from flexattn.reference import attention_reference
from flexattn.ir import Node
from helpers.grids import eval_grid


def to_float64(node: Node) -> Node:
    """``node`` with every float value computed in float64 (the reference for float trees).

    Float constants, float casts, the score input and float buffer reads become float64; integer
    and bool parts are unchanged (so indices, comparisons and gathers mean the same).
    >>> to_float64(ir.unary("exp", ir.input_("q_idx"))).dtype
    torch.float64
    """
    f64 = torch.float64

    def up(x: Node) -> Node:
        return ir.cast(x, f64) if not x.dtype.is_floating_point else x

    def mapping_fn(n: Node, src: tuple[Node, ...]) -> Node:
        op = n.op
        if op == "const":
            return ir.const(n.arg, f64) if n.dtype.is_floating_point else n
        if op == "input":
            return ir.input_("score", f64) if n.arg == "score" else n
        if op == "load":
            buf = n.arg
            if buf.dtype.is_floating_point:
                buf = ir.Buffer(buf.index, buf.name, f64, buf.ndim)
            return ir.load(buf, src)
        if op == "cast":
            return ir.cast(src[0], f64 if n.dtype.is_floating_point else n.dtype)
        if n.dtype.is_floating_point:
            # Ops that turn ints into the default float ("float" rule, truediv): go via float64.
            if op in ir.UNARY_OPS:
                return ir.unary(op, up(src[0]))
            if op == "truediv":
                return ir.binary(op, up(src[0]), up(src[1]))
        return ir.rebuild(n, src)

    memo: dict[int, Node] = {}
    for n in ir.toposort(node):
        memo[id(n)] = mapping_fn(n, tuple(memo[id(s)] for s in n.src))
    return memo[id(node)]


def buffers_float64(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The buffers as `to_float64` reads them (float tensors upcast to float64)."""
    return [t.double() if t.dtype.is_floating_point else t for t in buffers]


def reference_fp64(node: Node, buffers: Sequence[torch.Tensor], B: int, H: int, Q_LEN: int, KV_LEN: int,
                   score: torch.Tensor | None = None) -> torch.Tensor:
    """``node`` evaluated in float64 on the grid (see `to_float64`), broadcast to [B, H, Q, KV]."""
    s64 = score.double() if score is not None else None
    return eval_grid(to_float64(node), buffers_float64(buffers), B, H, Q_LEN, KV_LEN, s64)


def eager_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_options: dict | None = None,
                    scale: float | None = None, **kw):
    """``attention_reference`` in the inputs' dtype: what eager computation in that dtype costs, the
    budget a kernel's error is a multiple of. With ``PRESCALE_QK`` the kernel works on Q * scale
    rounded to Q's dtype (its documented cost), so the eager twin does too."""
    if not (kernel_options or {}).get("PRESCALE_QK"):
        return attention_reference(q, k, v, scale=scale, dtype=q.dtype, **kw)
    qs = q.float() * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":  # Triton's interpreter truncates
        qs = (qs.view(torch.int32) & -65536).view(torch.float32)  # float32 -> bfloat16 casts
    return attention_reference(qs.to(q.dtype), k, v, scale=1.0, dtype=q.dtype, **kw)


def quantise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor float8_e4m3fn quantisation: ``(x / s as float8, s)``, s mapping max|x| to 448."""
    s = (x.abs().max() / 448).reshape(1).float()
    return (x / s).to(torch.float8_e4m3fn), s


def dequantised(x8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The float64 values a float8 tensor and its descale factor stand for."""
    return x8.double() * s.double()


def assert_close_to_reference(out: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor,
                              factor: float = 2.0, atol: float | None = None,
                              elementwise: bool = False, name: str = "kernel") -> None:
    """Assert ``out``'s error against the float64 ``ref`` is within ``factor`` x ``eager``'s + ``atol``.

    ``eager`` is the same computation in ``out``'s dtype by a trusted implementation (torch), so
    its error is what that dtype costs; the kernel may be a small multiple worse. ``atol`` (default
    4 ulp of ``out``'s dtype at the largest reference magnitude) covers elements where eager happens
    to be exact. NaN/inf must match ``eager`` or ``ref`` exactly where either has one, and may appear
    nowhere else (a NaN row in eager does not excuse NaN in other rows). ``elementwise`` compares
    every element; otherwise the max errors are compared (the usual attention-test criterion).
    >>> r = torch.tensor([1.0], dtype=torch.float64)
    >>> assert_close_to_reference(torch.tensor([1.0]), torch.tensor([1.0]), r)
    """
    if out.shape != ref.shape or eager.shape != ref.shape:
        raise AssertionError(f"shapes differ: {name} {tuple(out.shape)}, eager {tuple(eager.shape)}, "
                             f"reference {tuple(ref.shape)}")
    if torch.isnan(out.float()).any() and not torch.isnan(eager.float()).any():
        bad = torch.isnan(out.float()).nonzero()[0].tolist()
        raise AssertionError(f"{name} has NaN (unwritten or invalid) at {bad}, eager has none")
    ref = ref.double()
    o, e = out.double(), eager.double()
    special = ~torch.isfinite(ref) | ~torch.isfinite(e)
    # Where eager is non-finite (or the reference is), the kernel must give the same special value
    # as eager or as the float64 reference: a discrete choice (``score == 0.5``) can flip under
    # eager's rounding, and then the kernel agreeing with float64 is the right answer.
    same = ((o == e) | (torch.isnan(o) & torch.isnan(e))
            | (o == ref) | (torch.isnan(o) & torch.isnan(ref)))
    if (special & ~same).any():
        i = (special & ~same).nonzero()[0].tolist()
        raise AssertionError(f"{name} {o[tuple(i)].item()} != eager {e[tuple(i)].item()} "
                             f"(reference {ref[tuple(i)].item()}) at {i}")
    fin = ~special
    # Where both are finite the kernel must be too: a NaN there (an unwritten, poisoned element)
    # would otherwise drop out of the comparisons below, as NaN > x is False.
    if (fin & ~torch.isfinite(o)).any():
        i = (fin & ~torch.isfinite(o)).nonzero()[0].tolist()
        raise AssertionError(f"{name} {o[tuple(i)].item()} where eager {e[tuple(i)].item()} and the reference "
                             f"{ref[tuple(i)].item()} are finite, at {i}")
    if not fin.any():
        return
    if atol is None:
        eps = torch.finfo(out.dtype).eps if out.dtype.is_floating_point else 0.0
        atol = 4 * eps * max(1.0, ref[fin].abs().max().item())
    err_o = torch.where(fin, (o - ref).abs(), 0.0)
    err_e = torch.where(fin, (e - ref).abs(), 0.0)
    if elementwise:
        bad = err_o > factor * err_e + atol
        if bad.any():
            i = bad.nonzero()[0].tolist()
            t = tuple(i)
            raise AssertionError(
                f"{name} error {err_o[t].item():.3g} > {factor} x eager error {err_e[t].item():.3g} + "
                f"{atol:.3g} at {i} ({bad.sum().item()} elements): {name} {o[t].item()!r}, eager "
                f"{e[t].item()!r}, reference {ref[t].item()!r}")
    else:
        eo, ee = err_o.max().item(), err_e.max().item()
        if eo > factor * ee + atol:
            raise AssertionError(f"{name} max error {eo:.3g} > {factor} x eager max error {ee:.3g} + {atol:.3g}")


def weighted_grads(out: torch.Tensor, lse: torch.Tensor, inputs: Sequence[torch.Tensor], d_out: torch.Tensor,
                   d_lse: torch.Tensor) -> tuple:
    """Gradients w.r.t. ``inputs`` of sum(out * d_out) + sum(lse * d_lse) over the rows of finite LSE,
    computed in ``d_out``'s dtype (None for an input the loss does not reach)."""
    finite_lse = torch.where(torch.isfinite(lse), lse.to(d_lse.dtype) * d_lse, 0.0)
    loss = (out.to(d_out.dtype) * d_out).sum() + finite_lse.sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def backward_atol(grad_ref: torch.Tensor, dtypes: Sequence[torch.dtype], d_out: torch.Tensor,
                  value: torch.Tensor, lse: torch.Tensor) -> float:
    """The absolute slack of a flash-style backward's gradient in low precision, against the float64
    gradient ``grad_ref`` (``dtypes``: the inputs' and the gradient's; the largest epsilon counts).

    Flash-style backwards compute dS = P * (dP - Delta) with Delta = rowsum(dO * O) from the stored
    O: a cancellation eager autograd (softmax's backward on the exact P) does not have, worth a few
    ulp of |dP| (one visible key: dS is 0 in eager, ~eps * |dP| here). So the slack scales with
    max |dP| = max |dO V^T| (``d_out`` [B, Hq, L, Ev], ``value`` [B or 1, Hkv, S, Ev]), not only
    with the gradient. P is recomputed from the stored float32 LSE, whose rounding (eps |lse|) is
    P's relative error there: scores of large magnitude (|lse| ~ 1e3) scale it by max |lse|.
    """
    vv = value.detach().double().repeat_interleave(d_out.shape[1] // value.shape[1], dim=1)
    dp_max = (d_out.double() @ vv.transpose(-2, -1)).abs().max().item() if d_out.numel() and vv.numel() else 0.0
    finite = lse[lse.isfinite()]
    lse_max = finite.abs().max().item() if finite.numel() else 0.0
    mag = max(1.0, grad_ref.abs().max().item() if grad_ref.numel() else 0.0)
    eps = max(torch.finfo(d).eps for d in dtypes)
    return 8 * eps * mag * max(1.0, dp_max, lse_max)


def tile_states_of_dense(keep: torch.Tensor, Q_BLOCK: int, KV_BLOCK: int) -> torch.Tensor:
    """int8 [..., nQ, nKV] tile states of a dense [..., Q_LEN, KV_LEN] bool mask, element by
    element: 0 nothing kept, 2 every element kept, 1 otherwise; a tile cut by the sequence end
    holds padding (masked out), so it is never full.

    >>> keep = torch.tensor([[True, True, True], [False, True, True]])
    >>> tile_states_of_dense(keep, 1, 2).tolist()
    [[2, 1], [1, 1]]
    """
    *lead, Q_LEN, KV_LEN = keep.shape
    n_q, n_kv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)
    padded = torch.zeros(*lead, n_q * Q_BLOCK, n_kv * KV_BLOCK, dtype=torch.bool)
    padded[..., :Q_LEN, :KV_LEN] = keep
    tiles = padded.view(*lead, n_q, Q_BLOCK, n_kv, KV_BLOCK)
    kept = tiles.sum(dim=(-3, -1))
    return torch.where(kept == Q_BLOCK * KV_BLOCK, 2, (kept > 0).to(torch.int64)).to(torch.int8)
