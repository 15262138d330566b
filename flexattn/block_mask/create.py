"""`create_block_mask` and `create_mask`: tile classification (interval analysis, then exact
evaluation of the undecided tiles), the tables built from it, and their custom op for torch.compile."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from flexattn import capture, interval, ir, modcache
from flexattn.block_mask.blockmask import BlockMask
from flexattn.block_mask import ranks
from flexattn.block_mask.mask_mods import as_mod
from flexattn.block_mask.sizes import _DEFAULT_SPARSE_BLOCK_SIZE, _check_block_sizes, _check_positive
from flexattn.kernels import mask_tiles
from flexattn.kernels.tables import block_size_pair, ordered
from flexattn.mods import MASK, SCORE, Mod, template

# Elements evaluated at once on the CPU path (the evaluator keeps every intermediate alive).
_CPU_ELEMENTS_PER_STEP = 1 << 18
# Tiles handled at once by the chunked CPU interval analysis / ordering.
_CPU_TILES_PER_STEP = 1 << 16


def _positional_arity(fn) -> int:
    if isinstance(fn, Mod):
        return 5 if fn.kind == SCORE else 4
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code.co_argcount - len(getattr(fn, "__defaults__", None) or ())
    return sum(1 for p in inspect.signature(fn).parameters.values()
               if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _tables_from_states(states: torch.Tensor, separate_full: bool):
    partial = states == interval.PARTIAL
    full = states == interval.FULL
    if not separate_full:
        partial = partial | full
    kv = ordered(partial)
    q = ordered(partial.transpose(-2, -1))
    if not separate_full:
        return (*kv, None, None, *q, None, None)
    fkv = ordered(full)
    fq = ordered(full.transpose(-2, -1))
    return (*kv, *fkv, *q, *fq)


# ---------------------------------------------------------------------------------------------
# Tile classification on the CPU (chunked torch ops)


def _classify_torch(mod: Mod, BD: int, HD: int, Q_LEN: int, KV_LEN: int, QB: int, KVB: int,
                    device: torch.device) -> torch.Tensor:
    """int8 tile states [BD, HD, nQ, nKV]: interval analysis, then exact evaluation of the rest."""
    n_q, n_kv = -(-Q_LEN // QB), -(-KV_LEN // KVB)
    i64 = torch.int64
    states = torch.empty(BD, HD, n_q, n_kv, dtype=torch.int8, device=device)
    b = torch.arange(BD, dtype=i64, device=device).view(BD, 1, 1, 1)
    h = torch.arange(HD, dtype=i64, device=device).view(1, HD, 1, 1)
    kv_lo = torch.arange(n_kv, dtype=i64, device=device) * KVB
    kv_hi = torch.clamp(kv_lo + KVB, max=KV_LEN) - 1
    kv_whole = (kv_lo + KVB <= KV_LEN).view(1, 1, 1, n_kv)
    summaries = {buf.index: interval.Summary.of(mod.buffers[buf.index]) for buf in mod.buffer_specs}
    rows_per_step = max(1, _CPU_TILES_PER_STEP // (n_kv * BD * HD))
    for r0 in range(0, n_q, rows_per_step):
        r1 = min(n_q, r0 + rows_per_step)
        q_lo = torch.arange(r0, r1, dtype=i64, device=device) * QB
        q_hi = torch.clamp(q_lo + QB, max=Q_LEN) - 1
        shape = (BD, HD, r1 - r0, n_kv)
        st = interval.tile_states(mod.ir, {
            "b": (b, b), "h": (h, h),
            "q_idx": (q_lo.view(1, 1, -1, 1), q_hi.view(1, 1, -1, 1)),
            "kv_idx": (kv_lo.view(1, 1, 1, -1), kv_hi.view(1, 1, 1, -1)),
        }, mod.buffers, summaries).expand(shape).clone()
        # Tiles cut by the sequence end hold padding (false): never full.
        whole = (q_lo + QB <= Q_LEN).view(1, 1, -1, 1) & kv_whole
        st[(st == interval.FULL) & ~whole] = interval.PARTIAL
        _evaluate_unknown(mod, st, r0, Q_LEN, KV_LEN, QB, KVB)
        states[:, :, r0:r1] = st
    return states


def _evaluate_unknown(mod: Mod, st: torch.Tensor, r0: int, Q_LEN: int, KV_LEN: int, QB: int, KVB: int):
    """Evaluate the UNKNOWN tiles of ``st`` element by element (in place), about
    `_CPU_ELEMENTS_PER_STEP` elements at a time: several tiles per step, or a tile in slabs of rows
    (and of columns) where one holds more. A tile's elements past the lengths are not evaluated (a
    block larger than its sequence spans only the sequence); they count as masked out."""
    unknown = (st == interval.UNKNOWN).nonzero()
    if unknown.numel() == 0:
        return
    device = st.device
    rows, cols = min(QB, Q_LEN), min(KVB, KV_LEN)  # (a tile's extent within the lengths, at most)
    slab_cols = min(cols, _CPU_ELEMENTS_PER_STEP)
    slab_rows = min(rows, max(1, _CPU_ELEMENTS_PER_STEP // slab_cols))
    per_step = max(1, _CPU_ELEMENTS_PER_STEP // (slab_rows * slab_cols))
    for u0 in range(0, unknown.shape[0], per_step):
        bb, hh, rr, cc = unknown[u0:u0 + per_step].unbind(1)
        count = torch.zeros(len(bb), dtype=torch.int64, device=device)
        for q0 in range(0, rows, slab_rows):
            oq = torch.arange(q0, min(q0 + slab_rows, rows), device=device).view(1, -1, 1)
            q = (rr + r0).view(-1, 1, 1) * QB + oq
            for k0 in range(0, cols, slab_cols):
                okv = torch.arange(k0, min(k0 + slab_cols, cols), device=device).view(1, 1, -1)
                kv = cc.view(-1, 1, 1) * KVB + okv
                keep = ir.evaluate(mod.ir, {
                    "b": bb.view(-1, 1, 1).int(), "h": hh.view(-1, 1, 1).int(),
                    "q_idx": q.clamp(max=Q_LEN - 1).int(), "kv_idx": kv.clamp(max=KV_LEN - 1).int(),
                }, mod.buffers, device=device)
                if Q_LEN % QB or KV_LEN % KVB:
                    keep = keep & (q < Q_LEN) & (kv < KV_LEN)  # padding counts as masked out
                count += keep.expand(len(bb), q.shape[1], kv.shape[2]).reshape(len(bb), -1).sum(1)
        # (a tile cut by the lengths never reaches QB x KVB: never full)
        new = torch.where(count == QB * KVB, interval.FULL, torch.where(count > 0, interval.PARTIAL, interval.EMPTY))
        st[bb, hh, rr, cc] = new.to(torch.int8)

# ---------------------------------------------------------------------------------------------
# Public constructors


def _default_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def create_block_mask(mask_mod: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                      device: Any = None, BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_SPARSE_BLOCK_SIZE,
                      _compile: bool = False, separate_full_blocks: bool = True,
                      compute_dq_write_order: bool = False, dq_kv_order: bool = True,
                      *, backend: str | None = None) -> BlockMask:
    """The BlockMask of ``mask_mod`` (torch 2.13's signature; ``device=None``: CUDA when available).

    ``B`` / ``H`` of None mean 1 (broadcast over batch / heads). A mask that ignores ``b`` or ``h``
    is classified once and repeated. ``backend``: "triton" (generated kernels; the GPU default,
    on CPU tensors it runs in Triton's interpreter) or "torch" (chunked torch ops, the CPU
    default).
    ``_compile`` is accepted for torch compatibility and ignored: this path is already compiled.
    ``compute_dq_write_order`` / ``dq_kv_order`` are torch's metadata for its deterministic FLASH
    backward; flexattn's dQ pass is deterministic without them, so ``compute_dq_write_order=True``
    is refused (build the mask with torch's ``create_block_mask`` if torch's kernel needs them).

    Example::

        >>> def sliding_window(b, h, q_idx, kv_idx):
        ...     return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)
        >>> bm = create_block_mask(sliding_window, None, None, 1000, 1000, device="cpu")  # doctest: +SKIP
    """
    if compute_dq_write_order:
        raise NotImplementedError(
            "create_block_mask(compute_dq_write_order=True): flexattn does not build torch's dQ write-order "
            "tables; its own dQ pass (one program per query tile, no atomics) is already deterministic. "
            "Leave it False, or use torch.nn.attention.flex_attention.create_block_mask for torch's FLASH backward")
    if not isinstance(dq_kv_order, bool):
        raise TypeError(f"dq_kv_order must be a bool (torch's create_block_mask takes no tensor), got {dq_kv_order!r}")
    Q_BLOCK, KV_BLOCK = block_size_pair(BLOCK_SIZE)
    _check_block_sizes((Q_BLOCK, KV_BLOCK))
    B = _check_positive("B", B, allow_none=True)
    H = _check_positive("H", H, allow_none=True)
    Q_LEN = _check_positive("Q_LEN", Q_LEN)
    KV_LEN = _check_positive("KV_LEN", KV_LEN)
    device = _default_device(device)
    if device.type == "meta":
        raise ValueError("device='meta' cannot hold a block mask: its tables are computed from the mask's "
                         "values; pass the device of the attention inputs ('cpu' or 'cuda')")
    if backend is None:
        backend = "triton" if device.type == "cuda" else "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton' or 'torch', got {backend!r}")
    if torch.compiler.is_compiling():
        # In a compiled graph the tables come from a custom op; the mask_mod is captured for it.
        key, bufs = capture.capture(mask_mod, MASK, torch.float32)
        tables = _tables_op(bufs, key, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, separate_full_blocks,
                            device, backend)
        if not separate_full_blocks:
            tables = [tables[0], tables[1], None, None, tables[2], tables[3], None, None]
        bm = BlockMask((Q_LEN, KV_LEN), *tables, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, validate=False)
        bm._flexattn_compiled_mask = (key, bufs)
        return bm
    mod = _resolve_mask(mask_mod, device)
    mod.check_device(device, arg="the block mask's device")
    # (int64 tables the mask only compares, as int32 ranks: the tables and the kernels read those)
    ranked = ranks.ranked(mod)
    tables = _build_tables(mod if ranked is None else ranked.mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device,
                           separate_full_blocks, backend)
    bm = BlockMask((Q_LEN, KV_LEN), *tables, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, validate=False)
    bm._mod = mod
    ranks.remember(bm, mod, ranked)
    return bm


def _resolve_mask(mask_mod, device: torch.device) -> Mod:
    """The traced mask, through the trace cache (a lambda made anew each call is traced once)."""
    if isinstance(mask_mod, Mod) or not callable(mask_mod):
        return as_mod(mask_mod)  # checks the kind / raises the error that names the argument
    template, buffers = modcache.resolve(mask_mod, MASK, torch.float32, device, lambda f, kind, **kw: as_mod(f))
    return template if buffers is template.buffers else template.rebind(buffers)


def _build_tables(mod: Mod, B, H, Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int, device: torch.device,
                  separate_full: bool, backend: str) -> tuple:
    """The eight tables of ``mod``'s BlockMask (the full_* ones None unless ``separate_full``)."""
    return classify(mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, backend).tables(separate_full=separate_full)


def classify(mod: Mod, B: int, H: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int,
             device: torch.device, backend: str, defer: bool = True) -> "Classified":
    """Every (query tile, KV tile) of ``mod`` classified (empty, partial, full), on ``backend``:
    the tables of its block mask, or of any rectangle of its tiles, come from it. ``defer``: see
    `mask_tiles.classify`."""
    used = mod.inputs
    BD = B if "b" in used else 1
    HD = H if "h" in used else 1
    if backend == "triton":
        tiles = mask_tiles.classify(mod, BD, HD, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, defer=defer)
    else:
        tiles = _TorchTiles(_classify_torch(mod, BD, HD, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device))
    return Classified(tiles, B, H)


class Classified:
    """A mask's classified tiles (`classify`) for [B, H] (a mask that ignores b or h is classified
    once and its tables repeated)."""

    def __init__(self, tiles, B: int, H: int):
        self.tiles, self.B, self.H = tiles, B, H
        self.n_q, self.n_kv = tiles.n_q, tiles.n_kv

    def shard_ranges(self, shards: int, n: int) -> torch.Tensor:
        """int32 [shards, 4], no host sync, where the KV tiles are ``shards`` shards of ``n`` tiles
        side by side: for each, the first and last + 1 of its tiles (from its first) that any row
        keeps, then of the query tiles that keep any of them; (n, 0, n_q, 0) where none is kept."""
        if shards * n != self.n_kv:
            raise ValueError(f"{shards} shards of {n} tiles do not make the {self.n_kv} KV tiles")
        return self.tiles.shard_ranges(shards, n)

    def tables(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
               separate_full: bool = True) -> tuple:
        """The eight tables of the block mask of the query tiles ``rows = (first, last + 1)``
        against the KV tiles ``cols`` (default: all), each [B, H, ...]."""
        rows = rows if rows is not None else (0, self.n_q)
        cols = cols if cols is not None else (0, self.n_kv)
        return self.tables_of([(rows, cols)], separate_full)[0]

    def tables_of(self, rects: list, separate_full: bool = True) -> list[tuple]:
        """`tables` of each ``(rows, cols)`` of ``rects`` (one launch of each order kernel for all)."""
        for rows, cols in rects:
            if not (0 <= rows[0] < rows[1] <= self.n_q and 0 <= cols[0] < cols[1] <= self.n_kv):
                raise ValueError(f"tile rectangle rows={rows}, cols={cols} is not a non-empty part of "
                                 f"{self.n_q} x {self.n_kv} tiles")
        every = self.tiles.tables_of(list(rects), separate_full)
        if (self.tiles.BD, self.tiles.HD) != (self.B, self.H):
            every = [tuple(None if t is None else t.expand(self.B, self.H, *t.shape[2:]).contiguous() for t in tables)
                     for tables in every]
        return every


class _TorchTiles:
    """`mask_tiles.Tiles` of the torch backend: int8 tile states [BD, HD, n_q, n_kv]."""

    def __init__(self, states: torch.Tensor):
        self.states = states
        self.BD, self.HD, self.n_q, self.n_kv = states.shape

    def shard_ranges(self, shards: int, n: int) -> torch.Tensor:
        kept = (self.states != interval.EMPTY).flatten(0, 1).any(0).view(self.n_q, shards, n)

        def spans(flags):  # [shards, m] -> first, last + 1 of each row's True columns; (m, 0) where none
            at = torch.arange(flags.shape[1], device=flags.device)
            return torch.stack([torch.where(flags, at, flags.shape[1]).amin(1), torch.where(flags, at + 1, 0).amax(1)], 1)

        return torch.cat([spans(kept.any(0)), spans(kept.any(2).t())], 1).int()

    def tables_of(self, rects: list, separate_full: bool) -> list[tuple]:
        return [_tables_from_states(self.states[:, :, slice(*rows), slice(*cols)], separate_full) for rows, cols in rects]


@torch.library.custom_op("flexattn::block_mask_tables", mutates_args=())
def _tables_op(buffers: list[torch.Tensor], mask_key: str, B: int, H: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int,
               KV_BLOCK: int, separate_full: bool, device: torch.device, backend: str) -> list[torch.Tensor]:
    """`create_block_mask`'s tables as a custom op (torch.compile): the 8 tables, or the 4
    partial ones without ``separate_full``."""
    mod = template(mask_key).rebind(buffers)
    tables, storages = [], set()
    for t in _build_tables(mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, separate_full, backend):
        if t is None:
            continue
        # (a custom op's outputs may not alias each other: the kernels write counts and indices
        # into one buffer, whose later views are copied out)
        storage = t.untyped_storage().data_ptr()
        tables.append(t.clone() if storage in storages else t)
        storages.add(storage)
    return tables


@_tables_op.register_fake
def _(buffers, mask_key, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, separate_full, device, backend):
    n_q, n_kv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)

    def table(*shape):
        return torch.empty(B, H, *shape, dtype=torch.int32, device=device)

    def pair(rows, cols):  # counts and indices
        return [table(rows), table(rows, cols)]

    if separate_full:
        return pair(n_q, n_kv) + pair(n_q, n_kv) + pair(n_kv, n_q) + pair(n_kv, n_q)
    return pair(n_q, n_kv) + pair(n_kv, n_q)


def create_mask(mod_fn: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                device: Any = None) -> torch.Tensor:
    """The dense [B, H, Q_LEN, KV_LEN] bool mask of a mask_mod or score_mod (tests, debugging).

    For a score_mod, True where the modified score of a zero score is not -inf (as torch).

    Example::

        >>> create_mask(flexattn_mod, 1, 1, 4, 4, device="cpu")  # doctest: +SKIP
    """
    B = _check_positive("B", B, allow_none=True)
    H = _check_positive("H", H, allow_none=True)
    Q_LEN = _check_positive("Q_LEN", Q_LEN)
    KV_LEN = _check_positive("KV_LEN", KV_LEN)
    device = _default_device(device)
    arity = _positional_arity(mod_fn)
    if arity not in (4, 5):
        raise TypeError(f"mod_fn must take 4 (mask_mod) or 5 (score_mod) positional arguments, got {arity}")
    kind = SCORE if arity == 5 else MASK
    mod = as_mod(mod_fn, kind, arg="mod_fn")
    idx = torch.int32
    inputs = {
        "b": torch.arange(B, dtype=idx, device=device).view(B, 1, 1, 1),
        "h": torch.arange(H, dtype=idx, device=device).view(1, H, 1, 1),
        "q_idx": torch.arange(Q_LEN, dtype=idx, device=device).view(1, 1, Q_LEN, 1),
        "kv_idx": torch.arange(KV_LEN, dtype=idx, device=device).view(1, 1, 1, KV_LEN),
    }
    if kind == SCORE:
        inputs["score"] = torch.zeros(B, H, Q_LEN, KV_LEN, dtype=mod.score_dtype or torch.float32, device=device)
        out = ir.evaluate(mod.ir, inputs, mod.buffers, device=device)
        return ~torch.isneginf(out.expand(B, H, Q_LEN, KV_LEN))
    out = ir.evaluate(mod.ir, inputs, mod.buffers, device=device)
    return out.expand(B, H, Q_LEN, KV_LEN).clone()
