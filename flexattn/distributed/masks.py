"""Mods at global positions, and `DistributedBlockMask`: block tables per (query shard, KV shard).

A rank's shard holds some global positions (`flexattn.distributed.layout`); the user's mods are
written for global ``q_idx`` / ``kv_idx``. `at_global_positions` rewrites a mod into
``mod(b, h, qpos[q_idx], kvpos[kv_idx])`` with ``qpos`` / ``kvpos`` captured int32 tensors, traced
once per mod; a step binds the positions of its own query and KV shards. Each rank builds, with
flexattn's own `create_block_mask` (no torch.compile), one BlockMask of its query shard against
every KV shard, and the ranks share which pairs are empty so that the ring skips them.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable

import torch
import torch.distributed as dist

import flexattn
from flexattn.distributed import checks
from flexattn.distributed.layout import Layout, as_layout

SCORE, MASK = "score", "mask"

# (mod key, captured tensors' metas, kind, score dtype) -> (wrapped template, slots)
_WRAPPED: dict[tuple, tuple] = {}
_WRAPPED_LIMIT = 1024


def _template(mod, kind: str, score_dtype: torch.dtype):
    """``mod`` read at global positions: (template Mod, slots); buffer i of the template is entry
    ``slots[i]`` of ``(*mod.buffers, qpos, kvpos)``."""
    metas = tuple((t.dtype, t.dim()) for t in mod.buffers)
    key = (mod.key(), metas, kind, score_dtype)
    hit = _WRAPPED.get(key)
    if hit is not None:
        return hit
    stand_ins = [torch.empty((0,) * t.dim(), dtype=t.dtype, device="meta") for t in mod.buffers]
    qpos = torch.empty(0, dtype=torch.int32, device="meta")
    kvpos = torch.empty(0, dtype=torch.int32, device="meta")
    inner = mod.rebind(stand_ins)
    if kind == SCORE:
        def at_positions(score, b, h, q_idx, kv_idx):
            return inner(score, b, h, qpos[q_idx], kvpos[kv_idx])
    else:
        def at_positions(b, h, q_idx, kv_idx):
            return inner(b, h, qpos[q_idx], kvpos[kv_idx])
    wrapped = flexattn.trace(at_positions, kind, score_dtype=score_dtype, name=f"{mod.name}_at_global_positions")
    by_id = {id(t): i for i, t in enumerate([*stand_ins, qpos, kvpos])}
    hit = (wrapped, tuple(by_id[id(t)] for t in wrapped.buffers))
    if len(_WRAPPED) >= _WRAPPED_LIMIT:
        _WRAPPED.clear()
    _WRAPPED[key] = hit
    return hit


def at_global_positions(mod, kind: str, score_dtype: torch.dtype, qpos: torch.Tensor, kvpos: torch.Tensor):
    """``mod`` (a `flexattn.Mod` with its captured tensors) as seen from local indices whose
    global positions are ``qpos`` / ``kvpos``; also returns, for each buffer of the result, the
    index of the ``mod`` buffer it is (None for the position tables)."""
    wrapped, slots = _template(mod, kind, score_dtype)
    pool = (*mod.buffers, qpos, kvpos)
    n = len(mod.buffers)
    return wrapped.rebind([pool[i] for i in slots]), tuple(i if i < n else None for i in slots)


def as_mask_mod(mask_mod) -> "flexattn.Mod":
    if isinstance(mask_mod, flexattn.Mod):
        return mask_mod
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function or a flexattn Mod, got {type(mask_mod).__name__}")
    return flexattn.trace(mask_mod, MASK)


def q_block_range(block_mask) -> tuple[int, int] | None:
    """``(first, last + 1)`` of the query blocks whose rows list a KV block in any batch and head,
    or None when none does (a host sync: mask-building time only)."""
    listed = block_mask.kv_num_blocks > 0
    if block_mask.full_kv_num_blocks is not None:
        listed = listed | (block_mask.full_kv_num_blocks > 0)
    rows = listed.flatten(0, -2).any(0).nonzero()
    return None if rows.numel() == 0 else (int(rows[0]), int(rows[-1]) + 1)


def kv_block_range(block_mask) -> tuple[int, int] | None:
    """``(first, last + 1)`` of the KV blocks ``block_mask`` lists in any row, or None when it
    lists none (a host sync: mask-building time only)."""
    first, end = None, 0
    for num, idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                     (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is None or idx.shape[-1] == 0:
            continue
        listed = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1)
        if not bool(listed.any()):
            continue
        big = torch.iinfo(idx.dtype).max
        lo, hi = int(torch.where(listed, idx, big).min()), int(torch.where(listed, idx, -1).max()) + 1
        first, end = (lo if first is None else min(first, lo)), max(end, hi)
    return None if first is None else (first, end)


class DistributedBlockMask:
    """One rank's block tables: its query shard against each KV shard, in global positions.

    ``needs[i][j]``: whether query shard i reads KV shard j (the same on every rank);
    ``qpos`` / ``kvpos[j]``: the global positions of this rank's queries and of KV shard j.
    ``windows[j] = (lo, hi)``: the local KV positions of shard j that ranks other than its owner
    read (whole KV blocks, or the whole shard where they read most of it; the same on every
    rank): only that part travels in the ring.
    ``rows[j] = (lo, hi)``: the local query rows of this rank that read KV shard j (whole query
    blocks; None where none does): a step computes, merges and sums only those rows (a sliding
    window's band of its neighbour's shard is read by the first rows alone).
    ``masks[j]``: the `flexattn.BlockMask` of those rows against KV shard j as this rank holds it
    (its own shard whole, another's window; None where empty), whose positions are
    ``qpos_rows[j]`` and ``kvpos_held[j]``. Made by `create_block_mask`.
    """

    def __init__(self, group, layout: Layout, B: int, H: int, seq_lengths: tuple[int, int], block_size,
                 mask: "flexattn.Mod", qpos, kvpos: list, masks: list, needs: tuple, windows: tuple,
                 rows: tuple, token: tuple):
        self.group, self.layout, self.B, self.H = group, layout, B, H
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.seq_lengths, self.BLOCK_SIZE, self.mask_mod = seq_lengths, block_size, mask
        self.qpos, self.kvpos, self.masks, self.needs, self.token = qpos, kvpos, masks, needs, token
        self.windows, self.rows = windows, rows
        self.kvpos_held = [p if j == self.rank else p[slice(*windows[j])] for j, p in enumerate(kvpos)]
        self.qpos_rows = [None if r is None else qpos[slice(*r)] for r in rows]
        self._gathered = None
        # (the name the custom ops know it by; equal on every rank, new for every mask)
        self.name = repr(token)
        _BY_NAME[self.name] = self

    def gathered(self):
        """The BlockMask of this rank's queries against all KV shards in rank order (the
        all-gather method's; None if empty), and those KV positions; built on first use."""
        if self._gathered is None:
            kvpos = torch.cat(self.kvpos)
            if self.qpos.numel() == 0 or kvpos.numel() == 0:  # (a rank without queries: nothing to do)
                self._gathered = (None, kvpos)
                return self._gathered
            mod, _ = at_global_positions(self.mask_mod, MASK, torch.float32, self.qpos, kvpos)
            bm = flexattn.create_block_mask(mod, self.B, self.H, self.qpos.numel(), kvpos.numel(),
                                            device=self.qpos.device, BLOCK_SIZE=self.BLOCK_SIZE)
            self._gathered = (None if kv_block_range(bm) is None else bm, kvpos)
        return self._gathered

    def sparsity(self) -> float:
        """Percentage of (query shard, KV shard) pairs that no rank computes."""
        P = self.world_size
        return 100.0 * (1 - sum(map(sum, self.needs)) / (P * P))

    def __repr__(self) -> str:
        return (f"DistributedBlockMask(rank {self.rank} of {self.world_size}, {self.layout!r}, "
                f"seq_lengths={self.seq_lengths}, BLOCK_SIZE={self.BLOCK_SIZE}, needs={self.needs})")


# group name -> counter of the masks made on it (a collective: equal on every rank of the group)
_TOKENS: dict[str, itertools.count] = {}
_BY_NAME: "weakref.WeakValueDictionary[str, DistributedBlockMask]" = weakref.WeakValueDictionary()


def by_name(name: str) -> DistributedBlockMask:
    """The live DistributedBlockMask called ``name`` (see `DistributedBlockMask.name`)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no flexattn.distributed block mask named {name[:80]!r} is alive in this process") from None


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      group_or_mesh=None, load_balance=None, device=None,
                      BLOCK_SIZE: int | tuple[int, int] = 128) -> DistributedBlockMask:
    """This rank's block tables of ``mask_mod`` (written for global ``q_idx`` / ``kv_idx``) for
    sequences of Q_LEN queries and KV_LEN keys sharded over ``group_or_mesh`` by ``load_balance``
    (None, "head_tail" or a layout of `flexattn.distributed`). Any lengths work; each rank's
    tables are built with flexattn's `create_block_mask` (no torch.compile). A collective: every
    rank calls it with the same arguments (checked: a mismatch raises on every rank).

    Example (under torchrun)::

        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> bm = create_block_mask(causal, None, None, 100_000, 100_000, load_balance="head_tail")  # doctest: +SKIP
    """
    group = checks.resolve_group(group_or_mesh)
    layout = as_layout(load_balance)
    P, r = dist.get_world_size(group), dist.get_rank(group)
    mod = as_mask_mod(mask_mod)
    B, H = B or 1, H or 1
    device = torch.device(device) if device is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    error = ""
    try:
        qpos = layout.positions(Q_LEN, P, r, device)
        kvpos = [layout.positions(KV_LEN, P, j, device) for j in range(P)]
    except ValueError as e:
        error, qpos, kvpos = str(e), None, None
    fields = {"mask_mod": mod.key(), "B": B, "H": H, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "layout": layout.key(),
              "BLOCK_SIZE": BLOCK_SIZE, "device type": device.type}
    checks.agree(group, "flexattn.distributed.create_block_mask", fields, error, cache=False)
    q_block, kv_block = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else (BLOCK_SIZE, BLOCK_SIZE)
    L = qpos.numel()
    masks, spans, rows = [], [], []
    for j in range(P):
        bm = _pair_mask(mod, B, H, qpos, kvpos[j], device, BLOCK_SIZE)
        span = None if bm is None else kv_block_range(bm)
        masks.append(None if span is None else bm)
        spans.append(None if span is None else (span[0] * kv_block, min(span[1] * kv_block, kvpos[j].numel())))
        q_span = None if span is None else q_block_range(bm)
        rows.append(None if q_span is None else (q_span[0] * q_block, min(q_span[1] * q_block, L)))
    every: list = [None] * P
    dist.all_gather_object(every, spans, group=group)
    needs = tuple(tuple(span is not None for span in r) for r in every)
    windows = tuple(_window(every, j, kvpos[j].numel()) for j in range(P))
    for j in range(P):  # the tables of the rows that read shard j, against what travels of it
        if masks[j] is None:
            continue
        held = (0, kvpos[j].numel()) if j == r else windows[j]
        if rows[j] != (0, L) or held != (0, kvpos[j].numel()):
            masks[j] = _pair_mask(mod, B, H, qpos[slice(*rows[j])], kvpos[j][slice(*held)], device, BLOCK_SIZE)
    checks.ring_groups(group)  # (made here, where every rank of the group is)
    counter = _TOKENS.setdefault(group.group_name, itertools.count())
    token = (mod.key(), layout.key(), Q_LEN, KV_LEN, B, H, BLOCK_SIZE, group.group_name, next(counter))
    return DistributedBlockMask(group, layout, B, H, (Q_LEN, KV_LEN), BLOCK_SIZE, mod, qpos, kvpos, masks,
                                needs, windows, tuple(rows), token)


def _pair_mask(mod, B: int, H: int, qpos, kvpos, device, BLOCK_SIZE):
    """The BlockMask of queries at ``qpos`` against keys at ``kvpos`` (None if either is empty)."""
    if qpos.numel() == 0 or kvpos.numel() == 0:
        return None
    local, _ = at_global_positions(mod, MASK, torch.float32, qpos, kvpos)
    return flexattn.create_block_mask(local, B, H, qpos.numel(), kvpos.numel(), device=device, BLOCK_SIZE=BLOCK_SIZE)


def _window(every: list, j: int, length: int) -> tuple[int, int]:
    """The part of KV shard j that ranks other than its owner read: the union of their spans
    (``every[i][j]``: the local positions rank i's tables list in shard j, or None), or the whole
    shard where that union covers three quarters of it or more: a window is copied before it is
    sent (its heads are not contiguous), on the compute stream ahead of the step's kernels, while
    the rest of a whole shard travels beside them."""
    spans = [r[j] for i, r in enumerate(every) if i != j and r[j] is not None]
    if not spans:
        return (0, 0)
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if 4 * (hi - lo) >= 3 * length:  # (most of the shard: it travels whole, with no copy of the window)
        return (0, length)
    return (lo, hi)
