"""`flex_attention` on sequence shards: ring or all-gather, with autograd."""

from __future__ import annotations

import ast
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from flexattn import capture
from flexattn.auxiliary import AuxOutput, AuxRequest, check_request
from flexattn.call import identity_score_mod, resolve_score_mod
from flexattn.kernels import options as opts, plans
from flexattn.kernels.tables import block_size_pair
from flexattn.lru import LRU
from flexattn.mods import template
from flexattn.distributed import checks, copies
from flexattn.distributed.allgather import AllGather
from flexattn.distributed.masks import SCORE, DistributedBlockMask, _Mask, by_handle, verify
from flexattn.distributed.ring import Ring
from flexattn.distributed.steps import Pair

METHODS = ("ring", "allgather")


def _ring(bm: _Mask) -> Ring:
    ring = getattr(bm, "_ring", None)
    if ring is None:
        ring = bm._ring = Ring(checks.ring_groups(bm.group), bm.needs, bm.windows,
                               bm.kvpos[bm.rank].numel(), bm.rows, bm.qpos.numel(), _copies_of(bm))
    return ring


def _copies_of(bm: _Mask):
    """How the ring's K/V and dK/dV parts travel by the copy engines (`copies`): where every rank
    is a GPU of this host that can use them (agreed when the mask was made); None (NCCL's sends)
    elsewhere."""
    if not bm.copy_engines:
        return None
    return lambda capacity, device, slots: copies.Copies(copies.workspace(bm.group, capacity, device, slots))


def _rows(t: torch.Tensor | None, rows: tuple[int, int]) -> torch.Tensor | None:
    """Rows ``[lo, hi)`` of a [B, H, L(, D)] tensor (a view; None stays None)."""
    return None if t is None else t[:, :, rows[0]:rows[1]]


@torch.compiler.assume_constant_result
def spec(score_key: str, method: str, enable_gqa: bool, options: tuple, want_max: bool = False) -> str:
    """The constant part of a call, as the ops' string argument."""
    return repr((score_key, method, enable_gqa, options, want_max))


_SPECS = LRU(1024)  # spec string -> its fields (parsed once: literal_eval compiles the string)


def _setup(spec_: str, mask: torch.Tensor, score_bufs, scale: float, stat_dtype):
    score_key, method, enable_gqa, options, want_max = _SPECS.get_or_make(spec_, lambda: ast.literal_eval(spec_))
    bm = by_handle(mask)
    score = template(score_key).rebind(score_bufs)
    return bm, method, Pair(score, scale, enable_gqa, _pair_options(options, method), stat_dtype, want_max)


def _pair_options(options: tuple, method: str) -> dict:
    """The call's kernel options as each pair runs them, less the promises about the whole mask
    that a pair's tables need not keep: its KV blocks lie in the shards' order (the all-gather's
    lists of a causal mask jump between shards), and in the ring a row may see no key of a shard.
    (The forward's own check of each pair's lists still sets BLOCKS_ARE_CONTIGUOUS where it holds.)"""
    o = dict(options)
    if o.get("BLOCKS_ARE_CONTIGUOUS"):
        del o["BLOCKS_ARE_CONTIGUOUS"]
    if method == "ring" and o.get("ROWS_GUARANTEED_SAFE"):
        del o["ROWS_GUARANTEED_SAFE"]
    return o


def _stat_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# (not for CUDA graphs: a call checks the ranks' agreement and plans its transfers on the host, and a
# replay would run the captured mask's)
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


@torch.library.custom_op("flexattn_distributed::attention", mutates_args=(), tags=_TAGS)
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_bufs: list[torch.Tensor],
              spec: str, mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``(out, lse, max_scores)`` (max_scores empty unless the spec asks for them); the
    block mask is the one whose handle ``mask`` is (`masks.by_handle`)."""
    acc = _stat_dtype(query)
    bm, method, pair = _setup(spec, mask, score_bufs, scale, acc)
    _check_call(query, key, value, bm, method, pair)
    if method == "ring":
        out, lse, mx = _ring(bm).forward(key, value, lambda j, kj, vj: pair.forward(
            _rows(query, bm.rows[j]), kj, vj, bm.masks[j], bm.qpos_rows[j], bm.kvpos_held[j]), query.dtype)
    else:
        out, lse, mx = AllGather(bm).forward(query, key, value, pair)
    B, Hq, L, _ = query.shape
    if out is None:  # this rank's queries see no key at all
        out = query.new_zeros((B, Hq, L, value.shape[-1]), dtype=acc)
        lse = query.new_full((B, Hq, L), -math.inf, dtype=acc)
    if not pair.want_max:
        mx = lse.new_empty(0)
    elif mx is None:
        mx = lse.new_full((B, Hq, L), -math.inf)
    return _strided_like(out, query, (B, Hq, L, value.shape[-1]), query.dtype), lse.contiguous(), mx.contiguous()


def _strided_like(t: torch.Tensor, ref: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """``t`` in ``dtype`` with the strides the fake kernels give it: ``ref``'s empty_like (with
    ``shape``: contiguous), which Inductor checks (a size-1 dimension's stride does not count);
    copied only where they differ (a first pair's output is in query's stride order, a sum of
    parts is contiguous)."""
    dtype = dtype or ref.dtype
    want = (torch.empty(shape, device="meta") if shape is not None else torch.empty_like(ref, device="meta")).stride()
    if t.dtype == dtype and all(a == b or n == 1 for a, b, n in zip(t.stride(), want, t.shape)):
        return t
    return torch.empty_strided(t.shape, want, dtype=dtype, device=t.device).copy_(t)


@attention.register_fake
def _(query, key, value, score_bufs, spec, mask, scale):
    B, Hq, L, _ = query.shape
    want_max = ast.literal_eval(spec)[4]
    return (query.new_empty((B, Hq, L, value.shape[-1])),
            query.new_empty((B, Hq, L), dtype=_stat_dtype(query)),
            query.new_empty((B, Hq, L) if want_max else (0,), dtype=_stat_dtype(query)))


@torch.library.custom_op("flexattn_distributed::attention_backward", mutates_args=(), tags=_TAGS)
def attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor],
                       score_bufs: list[torch.Tensor], spec: str, mask: torch.Tensor, scale: float,
                       need: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of `attention`: ``(dq, dk, dv, [grad of each score-mod tensor])`` (empty where
    ``need`` is False); the captured tensors' gradients are summed over the ranks."""
    acc = _stat_dtype(query)
    bm, method, pair = _setup(spec, mask, score_bufs, scale, acc)
    need = tuple(need)
    if method == "ring":
        def step(j, kj, vj):
            rows = bm.rows[j]
            return pair.backward(_rows(query, rows), kj, vj, _rows(out, rows), _rows(lse, rows),
                                 _rows(grad_out, rows), _rows(grad_lse, rows), bm.masks[j], bm.qpos_rows[j],
                                 bm.kvpos_held[j], need)
        dq, dk, dv, per_step = _ring(bm).backward(key, value, step, acc)
    else:
        dq, dk, dv, per_step = AllGather(bm).backward(query, key, value, out, lse, grad_out, grad_lse, pair,
                                                      need, acc)
    dq = torch.zeros_like(query) if dq is None else _strided_like(dq, query)
    grads = []
    for i, t in enumerate(score_bufs):
        if not need[i]:
            grads.append(t.new_empty(0))
            continue
        g = torch.zeros(t.shape, dtype=acc, device=t.device)
        for step_grads in per_step:
            if step_grads[i] is not None:
                g += step_grads[i]
        dist.all_reduce(g, group=bm.group)
        grads.append(_strided_like(g, t))
    return dq, _strided_like(dk, key), _strided_like(dv, value), grads


@attention_backward.register_fake
def _(query, key, value, out, lse, grad_out, grad_lse, score_bufs, spec, mask, scale, need):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            [torch.empty_like(b) if n else b.new_empty(0) for b, n in zip(score_bufs, need)])


def _setup_context(ctx, inputs, output):
    query, key, value, score_bufs, spec_, mask, scale = inputs
    out, lse, _ = output
    ctx.save_for_backward(query, key, value, out, lse, mask, *score_bufs)
    ctx.spec, ctx.scale = spec_, scale  # (the saved handle keeps the mask for the backward)
    if not torch.compiler.is_compiling():  # (and an eager call's context, where a saved-tensor hook copies the handle)
        ctx.block_mask = mask.__dict__.get("_flexattn_mask")
    ctx.need = [t.requires_grad and t.dtype.is_floating_point for t in score_bufs]


def _backward(ctx, grad_out, grad_lse, grad_max):  # (max_scores carry no gradient, as on one GPU)
    query, key, value, out, lse, mask, *score_bufs = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, grads = torch.ops.flexattn_distributed.attention_backward(
        query, key, value, out, lse, grad_out, grad_lse, score_bufs, ctx.spec, mask, ctx.scale, ctx.need)
    return dq, dk, dv, [g if n else None for g, n in zip(grads, ctx.need)], None, None, None


torch.library.register_autograd("flexattn_distributed::attention", _backward, setup_context=_setup_context)


def _local_error(q, k, v, bm: _Mask, method: str, enable_gqa: bool, options: dict | None = None) -> str:
    """What is wrong with this rank's inputs by itself ("" if nothing)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return f"{name} must be a 4-D tensor [B, H, L, E], got {getattr(t, 'shape', type(t).__name__)}"
    try:  # (dtypes, batch and head counts, head dims: what one GPU's call checks)
        plans.check_inputs(q, k, v, enable_gqa)
    except (TypeError, ValueError) as err:
        return str(err)
    # (the pairs' tables have the mask's B and H: one GPU's check of them would raise on the ranks
    # that compute a pair only, mid-ring, while the others go on or wait)
    if bm.B not in (None, 1, q.shape[0]) or bm.H not in (None, 1, q.shape[1]):
        return (f"block_mask has B={bm.B}, H={bm.H}; it must have B of None, 1 or query's {q.shape[0]} and "
                f"H of None, 1 or query's {q.shape[1]}")
    # (the forward's tiles must divide the pairs' blocks: checked by a pair's kernel only where the
    # rank computes one, and by the block-sparse kernel only, which a pair of few rows does not take)
    for option, block in zip(("BLOCK_M", "BLOCK_N"), block_size_pair(bm.BLOCK_SIZE)):
        tile = (options or {}).get(option)
        if tile is not None and block % tile:
            return f"kernel_options[{option!r}]={tile} must divide the block mask's block size {block}"
    want_q, want_kv = bm.qpos.numel(), bm.kvpos[bm.rank].numel()
    if q.shape[2] != want_q or k.shape[2] != want_kv or v.shape[2] != want_kv:
        return (f"the block mask's layout {bm.layout!r} gives this rank {want_q} queries and {want_kv} keys, "
                f"but query has {q.shape[2]} and key/value {k.shape[2]}/{v.shape[2]} "
                f"(shard the inputs with flexattn.distributed.shard and the same load_balance)")
    if q.device.type != bm.qpos.device.type:
        return f"the block mask was built on {bm.qpos.device}, query is on {q.device}"
    return checks.backend_error(bm.group, q.device, method)


def _check_call(q, k, v, bm: _Mask, method: str, pair: Pair) -> None:
    """Every rank agrees on the call before the first transfer (once per configuration)."""
    verify(bm.group)  # (the group's gathers not read yet: before this call's own collectives)
    # (a mask whose build failed, or whose listing failed on this rank alone: the check tells every rank)
    error = bm._failed or _local_error(q, k, v, bm, method, pair.enable_gqa, pair.options)
    fields = {
        "mask": bm.name, "method": method, "dtype": str(q.dtype),
        "B, Hq, E": None if error else (*q.shape[:2], q.shape[-1]),
        "Hkv, Ev": None if error else (k.shape[1], v.shape[-1]),
        # (a K/V batch of 1 broadcasts over B: on one rank only, the ring would receive its shard into
        # buffers shaped from another rank's K)
        "key/value B": None if error else (k.shape[0], v.shape[0]),
        # (the score_mod's tensors: their gradients are summed over the ranks)
        "score_mod tensors": tuple((tuple(t.shape), str(t.dtype), t.requires_grad) for t in pair.score.buffers),
        "score_mod": pair.score.key(), "scale": pair.scale, "enable_gqa": pair.enable_gqa,
        "kernel_options": tuple(sorted(pair.options.items())),
    }
    checks.agree(bm.group, "flexattn.distributed.flex_attention", fields, error, cache=not error)


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable | None = None, block_mask: DistributedBlockMask | None = None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, *, return_aux: AuxRequest | None = None, group=None,
                   method: str = "ring"):
    """Attention over a sequence sharded across ranks; query/key/value are this rank's shards
    (`shard`), ``block_mask`` this rank's tables from `flexattn.distributed.create_block_mask`,
    which also fixes the group and the layout. Mods see global ``q_idx`` / ``kv_idx``; tensors a
    score_mod captures get gradients summed over the ranks. ``method``: "ring" (K/V shards travel
    by point-to-point sends overlapped with compute; K/V memory O(S / P)) or "allgather" (one
    all-gather of K/V). Returns this rank's output shard (and its LSE with ``return_lse``; with
    ``return_aux=AuxRequest(lse=..., max_scores=...)``, ``(out, AuxOutput(...))`` of its rows, the
    max scores over every KV shard, as on one GPU).
    Inside ``torch.compile(fullgraph=True)`` the call is one custom op with its backward.

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
    if group is not None and checks.resolve_group(group) is not block_mask.group:
        raise ValueError("group: the block mask was made for another process group; pass the same group_or_mesh "
                         "to create_block_mask, or leave group=None")
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a tensor, got {type(query).__name__}")
    check_request(return_aux, return_lse)
    want_max = return_aux is not None and bool(return_aux.max_scores)
    stat_dtype = _stat_dtype(query)
    if torch.compiler.is_compiling():
        score_key, score_bufs = capture.capture(score_mod, SCORE, stat_dtype) if score_mod is not None else \
            (identity_score_mod(stat_dtype).key(), [])
    else:
        score, score_bufs = resolve_score_mod(score_mod, stat_dtype, query.device)
        score_key = score.key()
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    # (torch's deterministic flag, read here: every step's backward follows this call's options)
    options = opts.with_deterministic(opts.check(kernel_options))
    spec_ = spec(score_key, method, bool(enable_gqa), tuple(sorted(options.items())), want_max)
    out, lse, mx = torch.ops.flexattn_distributed.attention(query, key, value, list(score_bufs), spec_,
                                                            block_mask.handle, float(scale))
    if return_aux is not None:
        # (max scores carry no gradient: detached, as on one GPU and in torch)
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=mx.detach() if want_max else None)
    return (out, lse) if return_lse else out
