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
from flexattn import interval
from flexattn.block_mask.create import _resolve_mask as resolve_mask
from flexattn.distributed import checks, copies
from flexattn.distributed.layout import Layout, as_layout
from flexattn.lru import LRU

SCORE, MASK = "score", "mask"

# (mod key, captured tensors' metas, kind, score dtype) -> (wrapped template, slots)
_WRAPPED = LRU(1024)


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


def as_mask_mod(mask_mod, device=None) -> "flexattn.Mod":
    """``mask_mod`` as a `flexattn.Mod`; a Python mod through the one-GPU trace cache (a mod made
    anew for every batch, such as one over new document ids, is traced once)."""
    if isinstance(mask_mod, flexattn.Mod):
        return mask_mod
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function or a flexattn Mod, got {type(mask_mod).__name__}")
    return resolve_mask(mask_mod, torch.device(device) if device is not None else torch.device("cpu"))


def block_range_table(block_masks: list, device) -> torch.Tensor:
    """int64 [len(block_masks), 4] on ``device``, no host sync: for each BlockMask (made by
    `flexattn.create_block_mask`, which makes its query lists too), the first and last + 1 of the
    KV blocks it lists in any row, then of the query blocks whose rows list any; (0, 0, 0, 0) where
    it lists none (or is None)."""
    vectors = []  # (per mask: KV blocks listed, query blocks listing; from its query and KV lists' counts)
    for bm in block_masks:
        if bm is None:
            vectors += [torch.zeros(1, dtype=torch.bool, device=device)] * 2
            continue
        for counts in ((bm.q_num_blocks, bm.full_q_num_blocks), (bm.kv_num_blocks, bm.full_kv_num_blocks)):
            listed = None
            for num in counts:
                if num is not None:
                    any_ = (num > 0).flatten(0, -2).any(0)
                    listed = any_ if listed is None else listed | any_
            vectors.append(listed)
    flags = torch.nn.utils.rnn.pad_sequence(vectors, batch_first=True)  # [2n, longest]
    at = torch.arange(1, flags.shape[1] + 1, device=device)
    last = torch.where(flags, at, 0).amax(1)                      # (last + 1; 0 where none)
    first = torch.where(flags, at, flags.shape[1] + 1).amin(1) - 1
    first = torch.where(last > 0, first, 0)
    return torch.stack([first, last], 1).view(-1, 4)


def block_ranges(block_masks: list) -> list[tuple | None]:
    """For each BlockMask (or None): ``((first, last + 1) of the KV blocks it lists in any row,
    (first, last + 1) of the query blocks whose rows list any)``, or None where it lists none
    (one host sync: mask-building time only)."""
    found = [bm for bm in block_masks if bm is not None]
    if not found:
        return [None] * len(block_masks)
    return [_ranges(row) for row in block_range_table(block_masks, found[0].kv_num_blocks.device).tolist()]


def _ranges(row: list[int]) -> tuple | None:
    kv_lo, kv_hi, q_lo, q_hi = row
    return None if kv_hi == 0 else ((kv_lo, kv_hi), (q_lo, q_hi))


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
        # (every rank a GPU of this host that can and may use the copy engines, `copies.usable`)
        self.copy_engines = False
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
            self._gathered = (None if block_ranges([bm])[0] is None else bm, kvpos)
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
    B, H = B or 1, H or 1
    device = torch.device(device) if device is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mod = as_mask_mod(mask_mod, device)
    q_block, kv_block = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else (BLOCK_SIZE, BLOCK_SIZE)
    fields = {"mask_mod": mod.key(), "B": B, "H": H, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "layout": layout.key(),
              "BLOCK_SIZE": BLOCK_SIZE, "device type": device.type}
    # (each rank builds its tables, then one gather both checks that the ranks agree and shares
    # which KV blocks each rank's tables list; an error while building is reported by that gather)
    with interval.shared_summaries():  # (the position tables and captured tensors: one summary each)
        error, failure, table = "", None, None
        try:
            qpos = layout.positions(Q_LEN, P, r, device)
            kvpos = [layout.positions(KV_LEN, P, j, device) for j in range(P)]
            masks = [_pair_mask(mod, B, H, qpos, kvpos_j, device, BLOCK_SIZE) for kvpos_j in kvpos]
            table = block_range_table(masks, device)
        except (ValueError, TypeError, RuntimeError) as e:
            error, failure = str(e), e
        try:
            # (the copy engines only where every rank can use them: one rank's FLEXATTN_RING_COPY=0
            # keeps every rank's K/V on NCCL, so that sends and receives still pair up)
            tables, copy_engines = checks.agree_table(group, "flexattn.distributed.create_block_mask", fields,
                                                      error, table, 4 * P, can=copies.usable(device))
        except checks.DistributedMismatchError as e:
            raise e from failure
        L = qpos.numel()
        ranges = [[_ranges(flat[4 * j:4 * j + 4]) for j in range(P)] for flat in tables]  # (rank i's, pair j's)
        # (every[i][j]: the local KV positions rank i's tables list in shard j, or None)
        every = [[None if g is None else (g[0][0] * kv_block, min(g[0][1] * kv_block, kvpos[j].numel()))
                  for j, g in enumerate(mine)] for mine in ranges]
        rows = [None if g is None else (g[1][0] * q_block, min(g[1][1] * q_block, L)) for g in ranges[r]]
        masks = [None if g is None else m for m, g in zip(masks, ranges[r])]
        needs = tuple(tuple(span is not None for span in r) for r in every)
        windows = tuple(_window(every, j, kvpos[j].numel()) for j in range(P))
        for j in range(P):  # the tables of the rows that read shard j, against what travels of it
            if masks[j] is None:
                continue
            held = (0, kvpos[j].numel()) if j == r else windows[j]
            if held != (0, kvpos[j].numel()):
                masks[j] = _pair_mask(mod, B, H, qpos[slice(*rows[j])], kvpos[j][slice(*held)], device, BLOCK_SIZE)
            elif rows[j] != (0, L):  # (the whole shard travels: the tables of those rows are a slice)
                masks[j] = rows_of(masks[j], mod, qpos, kvpos[j], rows[j])
    checks.ring_groups(group)  # (made here, where every rank of the group is)
    counter = _TOKENS.setdefault(group.group_name, itertools.count())
    token = (mod.key(), layout.key(), Q_LEN, KV_LEN, B, H, BLOCK_SIZE, group.group_name, next(counter))
    bm = DistributedBlockMask(group, layout, B, H, (Q_LEN, KV_LEN), BLOCK_SIZE, mod, qpos, kvpos, masks,
                              needs, windows, tuple(rows), token)
    bm.copy_engines = copy_engines
    return bm


def rows_of(bm, mod, qpos, kvpos, rows: tuple[int, int]):
    """The BlockMask of the query rows ``[lo, hi)`` of ``bm`` (the mask of ``mod`` at ``qpos``
    against ``kvpos``), without building it again: ``lo`` is a multiple of the query block and
    ``hi`` one or the end of the rows, and no row outside lists a KV block, so its tables are
    ``bm``'s rows and its query lists ``bm``'s, shifted."""
    lo, hi = rows
    q_block = bm.BLOCK_SIZE[0]
    first, n = lo // q_block, -(-(hi - lo) // q_block)

    def kv_rows(t):
        return None if t is None else t[:, :, first:first + n].contiguous()

    def q_lists(t):
        return None if t is None else (t[..., :n] - first).contiguous()

    local, _ = at_global_positions(mod, MASK, torch.float32, qpos[lo:hi], kvpos)
    return flexattn.BlockMask((hi - lo, bm.seq_lengths[1]), kv_rows(bm.kv_num_blocks), kv_rows(bm.kv_indices),
                              kv_rows(bm.full_kv_num_blocks), kv_rows(bm.full_kv_indices),
                              bm.q_num_blocks, q_lists(bm.q_indices), bm.full_q_num_blocks,
                              q_lists(bm.full_q_indices), BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=local, validate=False)


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
