"""`flex_attention` on sequence shards: ring or all-gather, with autograd."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from flexattn.call import resolve_score_mod
from flexattn.distributed import checks
from flexattn.distributed.allgather import AllGather
from flexattn.distributed.masks import DistributedBlockMask
from flexattn.distributed.ring import Ring
from flexattn.distributed.steps import Pair

METHODS = ("ring", "allgather")


class _Setup:
    """One call's non-tensor inputs (kept by autograd for the backward)."""

    __slots__ = ("pair", "block_mask", "method", "n_score", "acc_dtype")

    def __init__(self, pair: Pair, block_mask: DistributedBlockMask, method: str, n_score: int, acc_dtype):
        self.pair, self.block_mask, self.method, self.n_score, self.acc_dtype = \
            pair, block_mask, method, n_score, acc_dtype


def _ring(bm: DistributedBlockMask) -> Ring:
    ring = getattr(bm, "_ring", None)
    if ring is None:
        ring = bm._ring = Ring(bm.group, bm.needs, [p.numel() for p in bm.kvpos])
    return ring


class DistributedAttention(torch.autograd.Function):
    """Forward and backward of one distributed call; trailing inputs: the score mod's captured
    tensors (their gradients are summed over the ranks)."""

    @staticmethod
    def forward(ctx, q, k, v, setup: _Setup, *score_bufs):
        bm, pair = setup.block_mask, setup.pair
        if setup.method == "ring":
            out, lse = _ring(bm).forward(
                k, v, lambda j, kj, vj: pair.forward(q, kj, vj, bm.masks[j], bm.kvpos[j]))
        else:
            out, lse = AllGather(bm).forward(q, k, v, pair)
        B, Hq, L, _ = q.shape
        if out is None:  # this rank's queries see no key at all
            out = q.new_zeros((B, Hq, L, v.shape[-1]), dtype=setup.acc_dtype)
            lse = q.new_full((B, Hq, L), -math.inf, dtype=setup.acc_dtype)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *score_bufs)
        ctx.setup = setup
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *score_bufs = ctx.saved_tensors
        setup = ctx.setup
        bm, pair = setup.block_mask, setup.pair
        if dout is None:
            dout = torch.zeros_like(out)
        need = tuple(ctx.needs_input_grad[4:4 + setup.n_score])
        if setup.method == "ring":
            def step(j, kj, vj):
                return pair.backward(q, kj, vj, out, lse, dout, dlse, bm.masks[j], bm.kvpos[j], need)
            dq, dk, dv, per_step = _ring(bm).backward(k, v, step, setup.acc_dtype)
        else:
            dq, dk, dv, per_step = AllGather(bm).backward(q, k, v, out, lse, dout, dlse, pair, need,
                                                        setup.acc_dtype)
        dq = torch.zeros_like(q) if dq is None else dq.to(q.dtype)
        grads = []
        for i, t in enumerate(score_bufs):
            if not need[i]:
                grads.append(None)
                continue
            g = torch.zeros(t.shape, dtype=setup.acc_dtype, device=t.device)
            for step_grads in per_step:
                if step_grads[i] is not None:
                    g += step_grads[i]
            dist.all_reduce(g, group=bm.group)
            grads.append(g.to(t.dtype))
        return (dq, dk.to(k.dtype), dv.to(v.dtype), None, *grads)


def _local_error(q, k, v, bm: DistributedBlockMask, method: str) -> str:
    """What is wrong with this rank's inputs by itself ("" if nothing)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor [B, H, L, E], got {getattr(t, 'shape', type(t).__name__)}"
    want_q, want_kv = bm.qpos.numel(), bm.kvpos[bm.rank].numel()
    if q.shape[2] != want_q or k.shape[2] != want_kv or v.shape[2] != want_kv:
        return (f"the block mask's layout {bm.layout!r} gives this rank {want_q} queries and {want_kv} keys, "
                f"but query has {q.shape[2]} and key/value {k.shape[2]}/{v.shape[2]} "
                f"(shard the inputs with flexattn.distributed.shard and the same load_balance)")
    if q.device.type != bm.qpos.device.type:
        return f"the block mask was built on {bm.qpos.device}, query is on {q.device}"
    return checks.backend_error(bm.group, q.device, method)


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable | None = None, block_mask: DistributedBlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, *, group=None, method: str = "ring"):
    """Attention over a sequence sharded across ranks; query/key/value are this rank's shards
    (`shard`), ``block_mask`` this rank's tables from `flexattn.distributed.create_block_mask`,
    which also fixes the group and the layout. Mods see global ``q_idx`` / ``kv_idx``; tensors a
    score_mod captures get gradients summed over the ranks. ``method``: "ring" (K/V shards travel
    by point-to-point sends overlapped with compute; K/V memory O(S / P)) or "allgather" (one
    all-gather of K/V). Returns this rank's output shard (and its LSE with ``return_lse``).

    Example (under torchrun, ``q``, ``k``, ``v`` the whole sequence on every rank)::

        >>> bm = create_block_mask(causal, None, None, S, S, load_balance="head_tail")  # doctest: +SKIP
        >>> q_, k_, v_ = (shard(t, load_balance="head_tail") for t in (q, k, v))  # doctest: +SKIP
        >>> out_ = flex_attention(q_, k_, v_, block_mask=bm)  # doctest: +SKIP
    """
    if not isinstance(block_mask, DistributedBlockMask):
        raise TypeError("block_mask must be a flexattn.distributed.DistributedBlockMask (from "
                        f"flexattn.distributed.create_block_mask), got {type(block_mask).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    bm = block_mask
    if group is not None and checks.resolve_group(group) is not bm.group:
        raise ValueError("group: the block mask was made for another process group; pass the same group_or_mesh "
                         "to create_block_mask, or leave group=None")
    error = _local_error(query, key, value, bm, method)
    stat_dtype = torch.float64 if getattr(query, "dtype", None) == torch.float64 else torch.float32
    score, score_bufs = (None, ()) if error else resolve_score_mod(score_mod, stat_dtype, query.device)
    if score is not None:
        score = score.rebind(score_bufs)  # (a cached template holds other tensors)
    options = dict(kernel_options or {})
    fields = {
        "mask": bm.token, "method": method, "dtype": str(getattr(query, "dtype", None)),
        "B, Hq, E": tuple(query.shape[:2]) + (query.shape[-1],) if not error else None,
        "Hkv, Ev": (key.shape[1], value.shape[-1]) if not error else None,
        "score_mod": None if score is None else score.key(),
        "score_mod grads": tuple(bool(t.requires_grad) for t in score_bufs),
        "scale": scale, "enable_gqa": bool(enable_gqa), "kernel_options": tuple(sorted(options.items())),
        "grad": torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *score_bufs)),
    }
    checks.agree(bm.group, "flexattn.distributed.flex_attention", fields, error, cache=not error)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    pair = Pair(score, bm.qpos, float(scale), bool(enable_gqa), options, stat_dtype)
    setup = _Setup(pair, bm, method, len(score_bufs), stat_dtype)
    out, lse = DistributedAttention.apply(query, key, value, setup, *score_bufs)
    return (out, lse) if return_lse else out
