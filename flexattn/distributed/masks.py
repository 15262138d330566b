"""Mods at global positions, and `DistributedBlockMask`: block tables per (query shard, KV shard).

A rank's shard holds some global positions (`flexattn.distributed.layout`); the user's mods are
written for global ``q_idx`` / ``kv_idx``. `at_global_positions` rewrites a mod into
``mod(b, h, qpos[q_idx], kvpos[kv_idx])`` with ``qpos`` / ``kvpos`` captured int32 tensors, traced
once per mod; a step binds the positions of its own query and KV shards. Each rank classifies, with
flexattn's own block-mask kernels (no torch.compile), every tile of its query shard against all
KV shards at once (the KV shards side by side, each padded to whole blocks), lists from that one
classification the tables of each pair of shards, and the ranks share which pairs are empty so
that the ring skips them.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, NamedTuple

import torch

import flexattn
from flexattn import scalars
from flexattn.block_mask import ranks
from flexattn.block_mask.create import _resolve_mask as resolve_mask, classify
from flexattn.block_mask.sizes import _check_block_sizes, _check_positive
from flexattn.distributed import checks, copies
from flexattn.distributed.layout import Layout, as_layout
from flexattn.kernels import mask_tiles
from flexattn.kernels.tables import block_size_pair
from flexattn.lru import LRU

SCORE, MASK = "score", "mask"

# (mod key, captured tensors' metas, kind, score dtype) -> (wrapped template, slots)
_WRAPPED = LRU(1024)


def _template(mod, kind: str, score_dtype: torch.dtype, kept: bool = False):
    """``mod`` read at global positions: (template Mod, slots); buffer i of the template is entry
    ``slots[i]`` of ``(*mod.buffers, qpos, kvpos)``, or of ``(*mod.buffers, qpos, kvpos, kept)``
    with ``kept`` (a mask that also keeps only the keys where the bool table ``kept`` is True)."""
    metas = tuple((t.dtype, t.dim()) for t in mod.buffers)
    key = (mod.key(), metas, kind, score_dtype, kept)
    hit = _WRAPPED.get(key)
    if hit is not None:
        return hit
    stand_ins = [torch.empty((0,) * t.dim(), dtype=t.dtype, device="meta") for t in mod.buffers]
    qpos = torch.empty(0, dtype=torch.int32, device="meta")
    kvpos = torch.empty(0, dtype=torch.int32, device="meta")
    keep = torch.empty(0, dtype=torch.bool, device="meta")
    inner = mod.rebind(stand_ins)
    if kind == SCORE:
        def at_positions(score, b, h, q_idx, kv_idx):
            return inner(score, b, h, qpos[q_idx], kvpos[kv_idx])
    elif kept:
        def at_positions(b, h, q_idx, kv_idx):
            return inner(b, h, qpos[q_idx], kvpos[kv_idx]) & keep[kv_idx]
    else:
        def at_positions(b, h, q_idx, kv_idx):
            return inner(b, h, qpos[q_idx], kvpos[kv_idx])
    wrapped = flexattn.trace(at_positions, kind, score_dtype=score_dtype, name=f"{mod.name}_at_global_positions")
    by_id = {id(t): i for i, t in enumerate([*stand_ins, qpos, kvpos, keep])}
    hit = (wrapped, tuple(by_id[id(t)] for t in wrapped.buffers))
    _WRAPPED[key] = hit
    return hit


def at_global_positions(mod, kind: str, score_dtype: torch.dtype, qpos: torch.Tensor, kvpos: torch.Tensor,
                        kept: torch.Tensor | None = None):
    """``mod`` (a `flexattn.Mod` with its captured tensors) as seen from local indices whose
    global positions are ``qpos`` / ``kvpos`` (a mask: and only at the keys where ``kept`` is True,
    if given); also returns, for each buffer of the result, the index of the ``mod`` buffer it is
    (None for the position tables)."""
    wrapped, slots = _template(mod, kind, score_dtype, kept is not None)
    n = len(mod.buffers)
    return _bound(wrapped, slots, mod.buffers, qpos, kvpos, kept), tuple(i if i < n else None for i in slots)


def _bound(wrapped: "flexattn.Mod", slots: tuple, buffers: tuple, qpos: torch.Tensor, kvpos: torch.Tensor,
           kept: torch.Tensor | None = None) -> "flexattn.Mod":
    """The template of `_template` over a mod's ``buffers`` and the position tables."""
    pool = (*buffers, qpos, kvpos, kept)
    return wrapped.rebind([pool[i] for i in slots])


def as_mask_mod(mask_mod, device=None) -> "flexattn.Mod":
    """``mask_mod`` as a `flexattn.Mod`; a Python mod through the one-GPU trace cache (a mod made
    anew for every batch, such as one over new document ids, is traced once)."""
    if isinstance(mask_mod, flexattn.Mod):
        return mask_mod
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function or a flexattn Mod, got {type(mask_mod).__name__}")
    return resolve_mask(mask_mod, torch.device(device) if device is not None else torch.device("cpu"))


def _ranges(row: list[int]) -> tuple | None:
    """``((first, last + 1) of the KV blocks kept, (first, last + 1) of the query blocks keeping
    them)`` from a row of `Classified.shard_ranges`, or None where it keeps none."""
    kv_lo, kv_hi, q_lo, q_hi = row
    return None if kv_hi == 0 else ((kv_lo, kv_hi), (q_lo, q_hi))


class _Mask:
    """A build's state (`DistributedBlockMask` holds it through its handle)."""

    def __init__(self, group, layout: Layout, B: int, H: int, seq_lengths: tuple[int, int], block_size,
                 mask: "flexattn.Mod | None", shards: "_Shards | None", name: str):
        self.group, self.layout, self.B, self.H = group, layout, B, H
        self.world_size, self.rank = group.size(), group.rank()
        self.seq_lengths, self.BLOCK_SIZE, self.mask_mod = seq_lengths, block_size, mask
        self.qpos, self.kvpos = (shards.qpos, shards.kvpos) if shards is not None else (None, None)
        # ((pairs, masks, copy engines): `_listed`, and whether every rank of this host's GPUs can
        # and may use the copy engines, `copies.usable`)
        self._plan = (None, None, False)
        self._ring = self._gathered = None
        # (whether the gather of its build is not read yet: `verify`; why its build failed)
        self._unread, self._failed = False, None
        # (its name, equal on every rank, new for every mask: the group's and the mask's number on
        # it; the ranks' check of a call compares it)
        self.name = name
        # (the value of its handle: `DistributedBlockMask`)
        self.serial = next(_SERIALS)
        _BY_HANDLE[self.serial] = self

    def _planned(self, pairs: "_Pairs", masks: list, copy_engines: bool) -> None:
        self._plan = (pairs, masks, copy_engines)
        self._ring = self._gathered = None

    def _current(self) -> tuple:
        if self._unread or self._failed is not None:
            self.verify()
        return self._plan

    needs = property(lambda self: self._current()[0].needs)
    windows = property(lambda self: self._current()[0].windows)
    rows = property(lambda self: self._current()[0].rows)
    kvpos_held = property(lambda self: self._current()[0].kvpos_held)
    qpos_rows = property(lambda self: self._current()[0].qpos_rows)
    masks = property(lambda self: self._current()[1])
    copy_engines = property(lambda self: self._current()[2])

    def verify(self) -> None:
        """Reads the gathers of this mask's group not read yet (`verify` of the module) and raises
        where the ranks disagreed, or where this mask's build or listing failed: at every read of
        its pairs. A read that is not a collective call leaves a disagreement it finds to be raised
        again at the rank's next call in the group, where the other ranks raise it."""
        verify(self.group, at_call=False)
        if self._failed is not None:
            raise checks.DistributedMismatchError(self._failed)

    def gathered(self):
        """The BlockMask of this rank's queries against all KV shards in rank order (the
        all-gather method's; None if empty), and those KV positions; built on first use."""
        self.verify()
        if self._gathered is None:
            kvpos = torch.cat(self.kvpos)
            if self.qpos.numel() == 0 or kvpos.numel() == 0:  # (a rank without queries: nothing to do)
                self._gathered = (None, kvpos)
                return self._gathered
            mod, _ = at_global_positions(self.mask_mod, MASK, torch.float32, self.qpos, kvpos)
            bm = flexattn.create_block_mask(mod, self.B, self.H, self.qpos.numel(), kvpos.numel(),
                                            device=self.qpos.device, BLOCK_SIZE=self.BLOCK_SIZE)
            listed = any(t is not None and bool(t.any()) for t in (bm.kv_num_blocks, bm.full_kv_num_blocks))
            self._gathered = (bm if listed else None, kvpos)
        return self._gathered

    def sparsity(self) -> float:
        """Percentage of (query shard, KV shard) pairs that no rank computes."""
        self.verify()
        P = self.world_size
        return 100.0 * (1 - sum(map(sum, self.needs)) / (P * P))

    def __repr__(self) -> str:  # (no check: the pairs as they stand, "?" where not read yet)
        pairs = self._plan[0]
        needs = "failed" if self._failed is not None else "?" if self._unread or pairs is None else pairs.needs
        return (f"DistributedBlockMask(rank {self.rank} of {self.world_size}, {self.layout!r}, "
                f"seq_lengths={self.seq_lengths}, BLOCK_SIZE={self.BLOCK_SIZE}, needs={needs})")


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
    ``qpos_rows[j]`` and ``kvpos_held[j]``. ``handle``: a 0-d CPU int64 tensor that the custom
    ops find the mask by (`by_handle`; under torch.compile an input of the graph, which a new mask
    reuses); it holds the build's state, so that an autograd graph that saved it (a compiled
    call's too) keeps the mask for its backward. Made by `create_block_mask`; a build that took the
    pairs of an earlier one is checked (and, where its pairs differ, listed again) when any of
    these is first read, as at its first use.
    """

    __slots__ = ("handle", "group", "__weakref__")

    def __init__(self, mask: _Mask):
        handle = torch.tensor(mask.serial, dtype=torch.int64, device="cpu")
        handle._flexattn_mask = mask  # (the state's only holder besides autograd's saved handles)
        object.__setattr__(self, "handle", handle)
        object.__setattr__(self, "group", mask.group)

    def __getattr__(self, name: str):  # (everything else is the build's; a bare instance has nothing)
        if name.startswith("__") or name in DistributedBlockMask.__slots__:
            raise AttributeError(name)
        return getattr(self.handle._flexattn_mask, name)

    def __setattr__(self, name: str, value) -> None:
        if name in DistributedBlockMask.__slots__:
            raise AttributeError(f"DistributedBlockMask.{name} is fixed when the mask is made")
        setattr(self.handle._flexattn_mask, name, value)

    def __copy__(self) -> "DistributedBlockMask":  # (a copy is the same mask: its build is shared)
        return self

    def __deepcopy__(self, memo) -> "DistributedBlockMask":
        return self

    def __repr__(self) -> str:
        return repr(self.handle._flexattn_mask)


# group name -> counter of the masks made on it (a collective: equal on every rank of the group)
_COUNTERS: dict[str, itertools.count] = {}
_SERIALS = itertools.count()
_BY_HANDLE: "weakref.WeakValueDictionary[int, _Mask]" = weakref.WeakValueDictionary()


def by_handle(handle: torch.Tensor) -> _Mask:
    """The live build whose `DistributedBlockMask.handle` holds ``handle``'s value."""
    serial = int(handle)
    try:
        return _BY_HANDLE[serial]
    except KeyError:
        raise KeyError(f"no flexattn.distributed block mask {serial} is alive in this process (a saved-tensor hook "
                       f"that copies what autograd saves, such as save_on_cpu, drops the mask a compiled call's "
                       f"backward needs: keep the mask until the backward)") from None


@torch.compiler.disable  # (collectives and host reads: inside a compiled function, a graph break)
def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      group_or_mesh=None, load_balance=None, device=None,
                      BLOCK_SIZE: int | tuple[int, int] = 128) -> DistributedBlockMask:
    """This rank's block tables of ``mask_mod`` (written for global ``q_idx`` / ``kv_idx``) for
    sequences of Q_LEN queries and KV_LEN keys sharded over ``group_or_mesh`` by ``load_balance``
    (None, "head_tail" or a layout of `flexattn.distributed`). Any lengths work; each rank's
    tables come from flexattn's block-mask kernels (no torch.compile). A collective: every
    rank calls it with the same arguments (checked: a mismatch raises on every rank). A build
    that repeats the arguments of one the ranks agreed on takes that build's pairs and reads its
    check at the rank's next call in the group: no host sync of its own (`_repeat_key`).

    Example (under torchrun)::

        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> bm = create_block_mask(causal, None, None, 100_000, 100_000, load_balance="head_tail")  # doctest: +SKIP
    """
    group = checks.resolve_group(group_or_mesh)
    # (numbered first: every rank's call counts, also one that raises on some ranks only)
    name = f"{group.group_name}/{next(_COUNTERS.setdefault(group.group_name, itertools.count()))}"
    verify(group)  # (the repeated builds whose gathers this rank has not read: before this one's)
    layout = as_layout(load_balance)
    P, r = group.size(), group.rank()
    device = torch.device(device) if device is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    mod = as_mask_mod(mask_mod, device)
    numbers = tuple(map(scalars.number_of, mod.buffers))
    key = _repeat_key(mod, numbers, layout, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, P, r, device)
    made = ranks.ranked(mod)  # (int64 ids the mask only compares: int32 ranks, as on one GPU)
    if made is not None:
        mod = made.mod
    # (the numbers a traced mask reads as 0-d tensors are not in its key: their values are)
    fields = {"mask_mod": mod.key(), "numbers": numbers, "B": B, "H": H,
              "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "layout": layout.key(), "BLOCK_SIZE": BLOCK_SIZE,
              "device type": device.type}
    # (the copy engines only where every rank can use them: one rank's FLEXATTN_RING_COPY=0
    # keeps every rank's K/V on NCCL, so that sends and receives still pair up)
    can = copies.usable(device)
    key = None if key is None else (key, can)
    agreed = _agreed(group).get(key) if key is not None else None
    # (each rank classifies the tiles of its queries against every KV shard at once, then one
    # gather both checks that the ranks agree and shares which tiles each rank keeps; an error
    # while classifying is reported by that gather)
    error, failure, table, shards, classified = "", None, None, None, None
    try:  # (arguments checked here: an error on one rank is raised on every rank by the gather)
        shards, classified = _classified(mod, numbers, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, layout, P, r, device)
        table = classified.ranges
    except Exception as e:  # noqa: BLE001 - (any error of one rank, Triton's too, goes to the gather)
        error, failure = str(e) or type(e).__name__, e
    if agreed is not None:  # (a repeat: the mask made first, then the gather launched and read at the next call)
        tables, copy_engines = agreed
        bm = None
        if failure is None:
            try:
                bm = _assembled(group, layout, B, H, (Q_LEN, KV_LEN), BLOCK_SIZE, mod, shards, classified, tables,
                                copy_engines, name)
            except Exception as e:  # noqa: BLE001 - (as above: the gather carries it)
                error, failure = str(e) or type(e).__name__, e
        pending = checks.launch_table(group, WHAT, fields, error, None if failure else table, can,
                                      fixed=failure is None and classified.kept)
        if failure is not None:  # (the others read it at their next call: every rank raises there)
            return DistributedBlockMask(_failed(group, layout, B, H, (Q_LEN, KV_LEN), BLOCK_SIZE, name, key,
                           f"{WHAT}: this rank failed while building the mask: {type(failure).__name__}: {error}",
                           shards))
        bm._unread = True
        listing = (mod, shards, classified)
        _UNREAD.setdefault(group, []).append(_Unread(pending, weakref.ref(bm), key, None, agreed, listing))
        return DistributedBlockMask(bm)
    try:
        tables, copy_engines = checks.agree_table(group, WHAT, fields, error, table, can=can)
    except checks.Deferred as e:  # (a rank repeated this build: every rank raises at its next call)
        return DistributedBlockMask(_failed(group, layout, B, H, (Q_LEN, KV_LEN), BLOCK_SIZE, name, key, str(e),
                                            shards))
    except checks.DistributedMismatchError as e:
        raise e from failure
    if key is not None:
        _agreed(group)[key] = (tables, copy_engines)
    return DistributedBlockMask(_assembled(group, layout, B, H, (Q_LEN, KV_LEN), BLOCK_SIZE, mod, shards, classified,
                                           tables, copy_engines, name))


def _assembled(group, layout: Layout, B, H, seq_lengths: tuple, BLOCK_SIZE, mod, shards: "_Shards", classified, tables,
               copy_engines: bool, name: str) -> _Mask:
    """The mask of a build whose ranges are ``tables`` (every rank's): `_listed`."""
    listed = _listed(mod, shards, classified, tables)
    checks.ring_groups(group)  # (made here, where every rank of the group is)
    bm = _Mask(group, layout, B, H, seq_lengths, BLOCK_SIZE, mod, shards, name)
    bm._planned(*listed, copy_engines)
    return bm


def _listed(mod, shards: "_Shards", classified: "_Classification", tables) -> tuple["_Pairs", list]:
    """``(pairs, masks)`` of ranges ``tables`` (every rank's): each pair's tables, of the rows that
    read the shard against what travels of it, listed from the one classification."""
    pairs = _PAIRS.get_or_make((shards.key, tuple(map(tuple, tables))), lambda: _Pairs(shards, tables))
    return pairs, classified.listed(mod, pairs)


def _failed(group, layout: Layout, B, H, seq_lengths: tuple, BLOCK_SIZE, name: str, key, message: str,
            shards: "_Shards | None") -> _Mask:
    """A stand-in for a mask whose build failed where some rank reads its gather later: it raises
    ``message`` at this rank's next call in the group, where the other ranks raise too, and at
    every use. It has the positions where the build got that far, and no pairs."""
    bm = _Mask(group, layout, B, H, seq_lengths, BLOCK_SIZE, None, shards, name)
    bm._failed = message
    _UNREAD.setdefault(group, []).append(_Unread(None, weakref.ref(bm), key, message, None, None))
    return bm


class _Unread(NamedTuple):
    """A build of this rank whose gather it has not read: `verify`."""
    pending: "checks.Pending | None"
    mask: "weakref.ref"
    key: tuple | None  # (its agreement's)
    message: str | None  # (why it failed, where it did)
    took: tuple | None  # (the agreed (tables, copy engines) it took)
    listing: tuple | None  # (its mod, shards and classification: to list its pairs again)


WHAT = "flexattn.distributed.create_block_mask"

# group -> this rank's builds whose gathers it has not read, in order (`_Unread`)
_UNREAD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def verify(group, at_call: bool = True) -> None:
    """Reads the gathers of this rank's builds in ``group`` that took the pairs of a build the ranks
    agreed on (`_repeat_key`) and that it has not read yet, in order: at its next call of
    `create_block_mask` or `flex_attention` in the group (``at_call``), before that call's
    collectives, or at a read of a mask's pairs. Where the gathered ranges or copy engines are not
    those the build took (a mask's tensors changed), lists its pairs again from them and agrees on
    those: every rank has the pairs a build that read its gather at once has; where that listing
    fails, the mask raises at every use, and its next use in `flex_attention` raises on every rank
    (its check carries the failure). Where the ranks disagreed, or a rank failed while building,
    raises: at a call, on every rank at the same call, forgetting those builds' agreements, the
    masks of those builds raising at every use; at a read, on this rank, leaving them unread."""
    unread = _UNREAD.get(group)
    while unread:
        entry = unread[0]
        try:
            if entry.message is not None:
                raise checks.DistributedMismatchError(entry.message)
            gathered = entry.pending.check(group)
        except checks.DistributedMismatchError as e:
            if not at_call:  # (the other ranks raise at their next call: this rank raises there too)
                raise
            agreed = _agreed(group)
            for later in unread:  # (every mask not verified: none of them is used)
                bm = later.mask()
                if bm is not None:
                    bm._failed, bm._unread = str(e), False
                if later.key is not None:
                    agreed.pop(later.key)
            unread.clear()
            raise
        unread.pop(0)
        bm = entry.mask()
        if gathered != entry.took:  # (the pairs of what every rank has now)
            _agreed(group)[entry.key] = gathered
            if bm is not None:
                try:
                    bm._planned(*_listed(*entry.listing, gathered[0]), gathered[1])
                except Exception as e:  # noqa: BLE001 - (this rank alone: its check at the mask's use tells the others)
                    bm._failed = (f"{WHAT}: this rank failed while listing the pairs of the mask's gathered ranges: "
                                  f"{type(e).__name__}: {e}")
        if bm is not None:
            bm._unread = False


def _classified(mod, numbers: tuple, B, H, Q_LEN: int, KV_LEN: int, BLOCK_SIZE, layout: Layout, P: int, r: int,
                device: torch.device) -> tuple["_Shards", "_Classification"]:
    """``(shards, classification)``: the arguments checked, and every tile of this rank's queries
    against all KV shards side by side classified, with the ranges of each shard it keeps. A mask
    mod that captures no tensor but the Python numbers it reads (`flexattn.scalars`) classifies the
    same at every build of the same arguments and numbers' values: its classification is made once
    per mod, numbers, B and H (`_Shards.classified`), so that a repeated causal or sliding-window
    build launches no block-mask kernel. ``numbers``: `scalars.number_of` of each of the mod's
    buffers, None for a tensor (a mod whose int64 ids `ranks.ranked` replaced has one)."""
    B, H = _check_positive("B", B, allow_none=True), _check_positive("H", H, allow_none=True)
    Q_LEN, KV_LEN = _check_positive("Q_LEN", Q_LEN), _check_positive("KV_LEN", KV_LEN)
    q_block, kv_block = block_size_pair(BLOCK_SIZE)
    _check_block_sizes((q_block, kv_block))
    shards = _shards(layout, Q_LEN, KV_LEN, P, r, q_block, kv_block, device)
    if not shards.qpos.numel():  # (a rank without queries keeps nothing)
        return shards, _Classification(None, torch.zeros(P, 4, dtype=torch.int64, device=device), False)
    if None in numbers:  # (a tensor whose values the host does not know: read at every build)
        return shards, _classify_shards(mod, B, H, shards, device, False)
    return shards, shards.classified.get_or_make((mod.key(), numbers, B, H),
                                                 lambda: _classify_shards(mod, B, H, shards, device, True))


def _classify_shards(mod, B, H, shards: "_Shards", device: torch.device, kept: bool) -> "_Classification":
    # (undecided tiles listed for a kernel of their own only where a tile can span two runs of
    # positions, or the mask reads tensors of its own: else they lie along its edges)
    tiles = classify(shards.positioned(mod)[0], B, H, shards.qpos.numel(), shards.tiled.numel(), shards.q_block,
                     shards.kv_block, device, "triton" if device.type == "cuda" else "torch",
                     defer=bool(mod.buffer_specs) or not shards.tiles_in_runs)
    return _Classification(tiles, tiles.shard_ranges(shards.P, shards.n), kept)


class _Classification:
    """A rank's classified tiles (`classify`; None for a rank without queries) and the ranges of
    each KV shard they keep (`Classified.shard_ranges`). ``kept``: it is a mask's that captures no
    tensor but Python numbers, kept for the builds of the same arguments (`_Shards.classified`), and
    so are the pair masks it lists last, which those builds share: read them, do not change them."""

    def __init__(self, tiles, ranges: torch.Tensor, kept: bool):
        self.tiles, self.ranges, self.kept = tiles, ranges, kept
        self._last = (None, ())  # (pairs, their masks): where kept

    def listed(self, mod, pairs: "_Pairs") -> list:
        """``pairs.masks(mod, tiles)``, where kept made once for the pairs listed last."""
        if not self.kept:
            return pairs.masks(mod, self.tiles)
        if self._last[0] is not pairs:
            self._last = (pairs, tuple(pairs.masks(mod, self.tiles)))
        return list(self._last[1])


def _repeat_key(mod: "flexattn.Mod", numbers: tuple, layout: Layout, B, H, Q_LEN, KV_LEN, BLOCK_SIZE, P: int,
                r: int, device: torch.device) -> tuple | None:
    """The key of a build that can take the pairs of an earlier one and read its gather later, or
    None: its mod's trace, the values of the Python numbers it reads (`flexattn.scalars.number_of`;
    None for other tensors), and its arguments. Built again with the same key (a training loop's
    mask with a new batch's document ids, or a causal mask), a build classifies its tiles, takes
    the ranges the ranks agreed on for that key, lists its pairs' tables and launches its gather
    (the check, and its own ranges) with no host sync. The rank's next `create_block_mask` or
    `flex_attention` in the group reads it (`verify`): it raises where the ranks disagreed, and
    lists the pairs again where the ranges are not those taken, as where a tensor's values
    changed (a collective that writes into a tensor leaves its version counter as it was, so no
    state on the host can tell)."""
    key = (mod.key(), numbers, layout.key(), B, H, Q_LEN, KV_LEN, BLOCK_SIZE, P, r, device)
    try:
        hash(key)
    except TypeError:  # (a value that cannot be hashed, such as a list passed for B: no entry)
        return None
    return key


# group -> the builds its ranks agreed on: `_repeat_key` -> (every rank's ranges, whether every
# rank can use the copy engines); an entry goes with its group
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _agreed(group) -> LRU:
    found = _AGREED.get(group)
    if found is None:
        found = _AGREED[group] = LRU(16)
    return found


class _Positioned:
    """A mask mod at the global positions of a build's ``places`` ((query positions, KV positions,
    kept or None) each, all with ``kept`` or all without): rebound to the mod's captured tensors
    at every build (new ones, or ones changed in place, are read), from one lookup of the template
    for all places; kept per mod where it captures none, so that a repeated build rebinds nothing."""

    def __init__(self, places: list):
        self.places = places
        self._mods = LRU(16)

    def positioned(self, mod) -> list:
        if not mod.buffers:
            return self._mods.get_or_make(mod.key(), lambda: [
                at_global_positions(mod, MASK, torch.float32, *place)[0] for place in self.places])
        if not self.places:
            return []
        wrapped, slots = _template(mod, MASK, torch.float32, self.places[0][2] is not None)
        return [_bound(wrapped, slots, mod.buffers, *place) for place in self.places]


class _Shards(_Positioned):
    """What every build of one layout, pair of lengths, group size, rank, block size and device
    reads: this rank's query positions, every KV shard's, and the KV shards side by side
    (`Layout.tiled_positions`)."""

    def __init__(self, key: tuple, layout: Layout, Q_LEN: int, KV_LEN: int, P: int, r: int, q_block: int,
                 kv_block: int, device: torch.device):
        self.key, self.P, self.rank, self.q_block, self.kv_block = key, P, r, q_block, kv_block
        self.qpos = layout.positions(Q_LEN, P, r, device)
        mask_tiles.keep_summary(self.qpos)  # (what a classification reads: not every shard's positions)
        self.kvpos = [layout.positions(KV_LEN, P, j, device) for j in range(P)]
        self.tiled, self.kept, self.n = layout.tiled_positions(KV_LEN, P, kv_block, device)
        # (whether every query tile and every KV tile holds consecutive positions: each run of the
        # layout starts on a tile's edge of its shard)
        self.tiles_in_runs = _runs_on_edges(layout.runs(Q_LEN, P, r), q_block) and all(
            _runs_on_edges(layout.runs(KV_LEN, P, j), kv_block) for j in range(P))
        # ((mod key, numbers, B, H) -> `_Classification` of a mask mod that captures no tensor but
        # Python numbers: `_classified`)
        self.classified = LRU(4)
        # (this rank's queries against every KV shard side by side, kept where not padding; where
        # no shard is padded, as where the lengths are multiples of P blocks, there is no table of
        # kept keys to read)
        super().__init__([(self.qpos, self.tiled, self.kept)])


def _runs_on_edges(runs: list[tuple[int, int]], block: int) -> bool:
    """Whether each of the runs of a shard (``Layout.runs``) after its first starts at a local
    index that is a multiple of ``block``."""
    at = 0
    for begin, end in runs[:-1]:
        at += end - begin
        if at % block:
            return False
    return True


# (layout key, lengths, group size, rank, block sizes, device) -> `_Shards`
_SHARDS = LRU(16)


def _shards(layout: Layout, Q_LEN: int, KV_LEN: int, P: int, r: int, q_block: int, kv_block: int,
            device: torch.device) -> _Shards:
    key = (layout.key(), Q_LEN, KV_LEN, P, r, q_block, kv_block, device)
    return _SHARDS.get_or_make(key, lambda: _Shards(key, layout, Q_LEN, KV_LEN, P, r, q_block, kv_block, device))


class _Pairs(_Positioned):
    """The pairs of shards a build's gathered ranges (``tables[i]``: rank i's `shard_ranges`) make
    this rank compute: which pairs any rank reads (``needs``), what travels of each KV shard
    (``windows``), this rank's rows of each (``rows``), the tile rectangles of its tables
    (``rects``) and the positions of those rows and of what it holds of each shard. Made once per
    distinct gather: a training loop over one mask, or masks of the same shape, repeats it."""

    def __init__(self, shards: _Shards, tables: list):
        P, r, q_block, kv_block, n = shards.P, shards.rank, shards.q_block, shards.kv_block, shards.n
        qpos, kvpos = shards.qpos, shards.kvpos
        L = qpos.numel()
        ranges = [[_ranges(flat[4 * j:4 * j + 4]) for j in range(P)] for flat in tables]  # (rank i's, pair j's)
        # (every[i][j]: the local KV positions rank i's tables list in shard j, or None)
        every = [[None if g is None else (g[0][0] * kv_block, min(g[0][1] * kv_block, kvpos[j].numel()))
                  for j, g in enumerate(mine)] for mine in ranges]
        self.rows = tuple(None if g is None else (g[1][0] * q_block, min(g[1][1] * q_block, L)) for g in ranges[r])
        self.needs = tuple(tuple(span is not None for span in row) for row in every)
        self.windows = tuple(_window(every, j, kvpos[j].numel()) for j in range(P))
        # (the tables of the rows that read shard j, against what travels of it: every pair's from
        # one launch of each order kernel)
        self.read = [j for j, g in enumerate(ranges[r]) if g is not None]
        self.held = [(0, kvpos[j].numel()) if j == r else self.windows[j] for j in range(P)]
        self.rects = [(ranges[r][j][1], (n * j + self.held[j][0] // kv_block, n * j + -(-self.held[j][1] // kv_block)))
                      for j in self.read]  # (shard j's tiles: n j ..)
        self.kvpos_held = [p if j == r else p[slice(*self.windows[j])] for j, p in enumerate(kvpos)]
        self.qpos_rows = [None if g is None else qpos[slice(*g)] for g in self.rows]
        self.block = (q_block, kv_block)
        # (each pair this rank reads, in that order: its rows against what it holds of the shard)
        super().__init__([(self.qpos_rows[j], self.kvpos_held[j], None) for j in self.read])

    def masks(self, mod, tiles) -> list:
        """The BlockMask of each pair this rank reads (None for the others), listed from the
        classification ``tiles`` of ``mod``."""
        masks = [None] * len(self.held)
        for j, lists, local in zip(self.read, tiles.tables_of(self.rects) if self.read else [], self.positioned(mod)):
            rows, held = self.rows[j], self.held[j]
            masks[j] = flexattn.BlockMask((rows[1] - rows[0], held[1] - held[0]), *lists, BLOCK_SIZE=self.block,
                                          mask_mod=local, validate=False)
        return masks


# (`_Shards.key`, every rank's ranges) -> `_Pairs`
_PAIRS = LRU(256)


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
