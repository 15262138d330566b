"""flexattn's kernels as torch custom ops, for ``torch.compile`` (and anything else that traces).

Arguments are tensors and constants only: the mods are named by their structural keys inside
``spec`` (a string made at compile time by `spec`; `flexattn.mods.template` finds their IR at run
time) and their captured tensors are tensor-list arguments. Each op has a fake implementation
(shapes, dtypes and strides only), so a compiled graph holds them without a graph break, and the
forward op has its autograd formula registered (the backward op). The real implementations use the
same plans and launches as eager calls (`flexattn.kernels`). Eager calls do not go through these
ops: the dispatcher would add host time to every call.
"""

from __future__ import annotations

import ast
from typing import Optional

import torch
from torch import Tensor

from flexattn.kernels import backward as bwd, decode as dec, forward as fwd, launch, layout, plans
from flexattn.kernels.tables import Direction, Tables
from flexattn.lru import LRU
from flexattn.mods import template


@torch.compiler.assume_constant_result
def spec(score_key: str, mask_key: str, block: tuple, enable_gqa: bool, options: tuple, want_max: bool) -> str:
    """The constant part of one call, as the string argument of the ops. ``block`` is
    (q_block, kv_block, has_seq_lengths, has_full, has_q) or () without a block mask (the mask's
    seq_lengths are the ops' ``seq_q`` and ``seq_kv`` arguments, -1 without: symbols under dynamic
    shapes)."""
    return repr((score_key, mask_key, block, enable_gqa, options, want_max))


_SPECS = LRU(4096)  # spec string -> its parsed templates and options


def _parse(s: str):
    parsed = _SPECS.get(s)
    if parsed is None:
        score_key, mask_key, block, enable_gqa, options, want_max = ast.literal_eval(s)
        parsed = (template(score_key), template(mask_key), block, enable_gqa, dict(options), want_max)
        _SPECS[s] = parsed
    return parsed


def _tables(block: tuple, tensors: list[Tensor], seq_q: int, seq_kv: int) -> Tables | None:
    if not block:
        return None
    q_block, kv_block, _, has_full, has_q = block
    seq = (int(seq_q), int(seq_kv)) if seq_q >= 0 else None
    per = 4 if has_full else 2

    def direction(ts):
        return Direction(ts[0], ts[1], ts[2], ts[3]) if has_full else Direction(ts[0], ts[1], None, None)

    kv = direction(tensors[:per])
    q = direction(tensors[per:2 * per]) if has_q else None
    return Tables.of(kv, q, q_block, kv_block, seq)


def block_of(t: Tables) -> tuple:
    """The ``block`` part of a spec (as `spec` documents it) that `_tables` reads back as ``t``."""
    return t.q_block, t.kv_block, t.seq_lengths is not None, t.kv.has_full, t.q is not None


def _meta(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _aligned(*ts: Tensor) -> bool:
    """All on 16-byte boundaries (a plan key part: the Hopper kernels read through TMA descriptors)."""
    return not any(t.data_ptr() & 15 for t in ts)


def _metas(ts) -> tuple:
    return tuple(_meta(t) for t in ts)


def _sink_meta(sinks: Tensor | None) -> tuple | None:
    return None if sinks is None else _meta(sinks)


# ---------------------------------------------------------------------------------------------
# forward (+ autograd)


@torch.library.custom_op("flexattn::forward", mutates_args=())
def forward(query: Tensor, key: Tensor, value: Tensor, sinks: Optional[Tensor], score_bufs: list[Tensor],
            mask_bufs: list[Tensor], tables: list[Tensor], seq_q: int, seq_kv: int, spec: str,
            scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Block-sparse forward: ``(out, lse, max_scores)`` (max_scores is empty unless asked for);
    ``seq_q``, ``seq_kv``: the block mask's (Q_LEN, KV_LEN), -1 without."""
    score, mask, block, enable_gqa, options, want_max = _parse(spec)
    t = _tables(block, tables, seq_q, seq_kv)
    # (the dot precision too: float32 on the GPU is tf32 while torch.backends.cuda.matmul.allow_tf32
    # says so, read when a plan is made)
    key_ = ("op", spec, _meta(query), _meta(key), _meta(value), _aligned(query, key, value),
            _metas(score_bufs) + _metas(mask_bufs), None if t is None else t.sig, _sink_meta(sinks),
            launch.dot_precision(query.device, query.dtype))
    plan = plans.forward_plan(key_, query, key, value, score, score_bufs, mask, mask_bufs, t, enable_gqa,
                              options, want_max, sinks)
    out, lse, mx = fwd.run(plan, query, key, value, score, score_bufs, mask, mask_bufs, t, scale, sinks=sinks)
    return out, lse, mx if mx is not None else lse.new_empty(0)


def _stat_dtype(query: Tensor) -> torch.dtype:
    return launch.acc_dtype(query.dtype)


@forward.register_fake
def _(query, key, value, sinks, score_bufs, mask_bufs, tables, seq_q, seq_kv, spec, scale):
    B, Hq, Q_LEN, _ = query.shape
    want_max = ast.literal_eval(spec)[5]
    out = torch.empty_permuted((B, Hq, Q_LEN, value.shape[-1]), layout.stride_order(query),
                               dtype=query.dtype, device=query.device)
    lse = query.new_empty((B, Hq, Q_LEN), dtype=_stat_dtype(query))
    mx = query.new_empty((B, Hq, Q_LEN) if want_max else (0,), dtype=_stat_dtype(query))
    return out, lse, mx


def _setup_context(ctx, inputs, output):
    query, key, value, sinks, score_bufs, mask_bufs, tables, seq_q, seq_kv, spec_, scale = inputs
    out, lse, mx = output
    ctx.mark_non_differentiable(mx)  # (as eagerly and in torch: max_scores has no gradient)
    ctx.save_for_backward(query, key, value, out, lse, sinks, *score_bufs, *mask_bufs, *tables)
    ctx.sizes = (len(score_bufs), len(mask_bufs))
    ctx.seq = (seq_q, seq_kv)
    ctx.spec, ctx.scale = spec_, scale
    ctx.need = [t.requires_grad and t.dtype.is_floating_point for t in score_bufs]


def _backward(ctx, grad_out, grad_lse, grad_max):
    query, key, value, out, lse, sinks, *rest = ctx.saved_tensors
    n_score, n_mask = ctx.sizes
    score_bufs, mask_bufs, tables = rest[:n_score], rest[n_score:n_score + n_mask], rest[n_score + n_mask:]
    dq, dk, dv, dsinks, grads = torch.ops.flexattn.backward(query, key, value, out, lse, grad_out, grad_lse, sinks,
                                                            score_bufs, mask_bufs, tables, *ctx.seq, ctx.spec,
                                                            ctx.scale, ctx.need)
    buffer_grads = [g if need else None for g, need in zip(grads, ctx.need)]
    # One entry per input, lists for the list inputs (the mask's tensors and the block tables get none).
    return dq, dk, dv, None if sinks is None else dsinks, buffer_grads, [None] * n_mask, [None] * len(tables), \
        None, None, None, None


torch.library.register_autograd("flexattn::forward", _backward, setup_context=_setup_context)


@torch.library.custom_op("flexattn::backward", mutates_args=())
def backward(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
             grad_lse: Optional[Tensor], sinks: Optional[Tensor], score_bufs: list[Tensor], mask_bufs: list[Tensor],
             tables: list[Tensor], seq_q: int, seq_kv: int, spec: str, scale: float,
             need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """Gradients of `forward`: ``(dq, dk, dv, d sinks, [grad of each score-mod tensor])`` (d sinks
    empty without sinks, a buffer's gradient empty where ``need`` is False)."""
    block = _parse(spec)[2]
    t = _tables(block, tables, seq_q, seq_kv)  # without q_* tables, the dK/dV lists are made from kv_* (bwd.run)
    return run_backward(query, key, value, out, lse, grad_out, grad_lse, sinks, score_bufs, mask_bufs, t, spec,
                        scale, need)


def run_backward(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                 grad_lse: Optional[Tensor], sinks: Optional[Tensor], score_bufs, mask_bufs, t: Tables | None,
                 spec: str, scale: float, need) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """`backward` on launch tables already made (``t``, the op's ``tables`` as `Tables`): the op's
    work, and what an eager caller that holds a mask's `Tables` (`flexattn.kernels.tables.tables_of`)
    calls without the dispatcher (the distributed ring's steps)."""
    score, mask, _, _, options, _ = _parse(spec)
    need_t = tuple(need)
    key_ = ("op", spec, _meta(query), _meta(key), _meta(value), _meta(grad_out), _aligned(query, key, value, grad_out),
            None if grad_lse is None else grad_lse.stride(), out.stride(), lse.stride(), need_t,
            _metas(score_bufs) + _metas(mask_bufs), None if t is None else t.sig, _sink_meta(sinks),
            launch.dot_precision(query.device, query.dtype))

    def launch_once(plan):
        return bwd.run(plan, query, key, value, out, lse, grad_out, grad_lse, score, score_bufs, mask, mask_bufs,
                       t, scale, sinks)

    plan = plans.backward_plan(key_, query, key, value, out, grad_out, score, mask, t, options, need_t, score_bufs,
                               grad_lse is not None, launch_once)
    dq, dk, dv, grads, dsinks = launch_once(plan)
    # A custom op returns a tensor for each entry: an empty one where no gradient is wanted; the
    # others contiguous, as the fake kernel says (zeros_like keeps a transposed tensor's strides).
    buffer_grads = [b.new_empty(0) if g is None else g.contiguous()
                    for b, g in zip(score_bufs, bwd.buffer_grads(grads, score_bufs, need))]
    return dq, dk, dv, lse.new_empty(0) if dsinks is None else dsinks, buffer_grads


@backward.register_fake
def _(query, key, value, out, lse, grad_out, grad_lse, sinks, score_bufs, mask_bufs, tables, seq_q, seq_kv, spec, scale,
      need):
    dq = torch.empty_permuted(query.shape, layout.stride_order(query), dtype=query.dtype, device=query.device)
    dk = key.new_empty(key.shape)
    dv = value.new_empty(value.shape)
    dsinks = lse.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return dq, dk, dv, dsinks, [b.new_empty(b.shape if n else (0,)) for b, n in zip(score_bufs, need)]


# ---------------------------------------------------------------------------------------------
# decoding


@torch.library.custom_op("flexattn::decode", mutates_args=())
def decode(query: Tensor, key: Tensor, value: Tensor, sinks: Optional[Tensor], score_bufs: list[Tensor],
           mask_bufs: list[Tensor], tables: list[Tensor], seq_q: int, seq_kv: int, kv_lengths: Optional[Tensor],
           spec: str, scale: float) -> tuple[Tensor, Tensor]:
    """Split-KV decoding: ``(out, lse)``."""
    score, mask, block, enable_gqa, options, _ = _parse(spec)
    t = _tables(block, tables, seq_q, seq_kv)
    key_ = ("op", spec, _meta(query), _meta(key), _meta(value), _metas(score_bufs) + _metas(mask_bufs),
            None if t is None else t.sig, None if kv_lengths is None else _meta(kv_lengths), _sink_meta(sinks),
            launch.dot_precision(query.device, query.dtype))
    plan = plans.decode_plan(key_, query, key, value, score, score_bufs, mask, mask_bufs, t, enable_gqa, options,
                             kv_lengths, sinks)
    return dec.run(plan, query, key, value, score_bufs, mask_bufs, t, scale, kv_lengths, sinks=sinks)


@decode.register_fake
def _(query, key, value, sinks, score_bufs, mask_bufs, tables, seq_q, seq_kv, kv_lengths, spec, scale):
    B, Hq, Q_LEN, _ = query.shape
    out = torch.empty_permuted((B, Hq, Q_LEN, value.shape[-1]), layout.stride_order(query),
                               dtype=query.dtype, device=query.device)
    return out, query.new_empty((B, Hq, Q_LEN), dtype=torch.float32)
