"""Host side of the block-mask kernels (templates/block_mask.py): render, launch, return tables.

`classify` classifies every (query tile, KV tile) of a mask mod with the generated
``classify_kernel`` (interval analysis first, element evaluation only for undecided tiles);
`Tiles.tables` writes the eight index tensors of a BlockMask, of all tiles or of a rectangle of
them, with ``kv_order_kernel`` / ``q_order_kernel``; `build_tables` does both.
Scratch memory is 2 bits per tile; nothing of size Q_LEN x KV_LEN is ever allocated.

``mod`` is a mask `flexattn.mods.Mod`; only what the IR layer defines is read from it (its IR,
captured tensors and the buffers it reads, key, name and source).
"""

from __future__ import annotations

import math

import torch

from flexattn import interval
from flexattn.codegen import emit
from flexattn.codegen.interval import emit_interval, summary_args, summary_params
from flexattn.codegen.render import load_kernel_module
from flexattn.kernels import launch
from flexattn.lru import LRU


# Bound: a module holds its three Triton kernels; a dropped one is imported again from disk.
_MODULES = LRU(256)
# (shards, tiles per shard, query tiles, device) -> the start of `Tiles.shard_ranges`' atomics
_RANGES_START = LRU(64)
# (rectangles, B and H of the tiles, separate full, interpreter, device) -> what `Tiles.tables_of`
# makes of them before its launches (`_layout`; its table of rectangles read only: a distributed
# build lists the same rectangles every step)
_LAYOUTS = LRU(64)
# (kernel, grid, device, arguments' values or dtypes, constexprs) -> its `launch.Launch`
_LAUNCHES = LRU(256)


def kernel_module(mod, target: str):
    """The rendered kernel module for ``mod`` (memoised on the mod's structural key)."""
    key = (mod.key(), target)
    return _MODULES.get_or_make(key, lambda: _render(mod, target))


def _render(mod, target: str):
    src = emit.emit_mod(mod.ir, "mask", "mask_mod", target)
    interval_src, interval_params = emit_interval(mod.ir, "mask_interval")
    params = src.param_list("")
    hooks = {
        "prelude": emit.prelude(target),
        "mod_def": src.source,
        "interval_def": interval_src,
        "mod_params": params,
        "interval_params": "".join(f"{p}, " for p in summary_params(list(src.buffers))),
        "mod_call": f"mask_mod(b, h, q_idx, kv_idx, {params})",
        # the captured tensors' strides and sizes (a document-id table grows with the lengths)
        "classify_nospec": "".join(f'"{p}", ' for p in src.params if "_s" in p or "_n" in p),
        "interval_call": f"mask_interval(b, h, q_lo, q_hi, lo_kv, hi_kv, {', '.join(interval_params)})",
    }
    return load_kernel_module("block_mask", hooks, {f"mask_mod {mod.name}": mod.source},
                              interpret=target == "interpret")


def chunks(n_q: int, n_kv: int, interpret: bool) -> tuple[int, int, int]:
    """(CHUNK_WORDS, CHUNK for the q lists, CHUNK for the kv lists). On the GPU they do not depend
    on the lengths, so a new length compiles nothing; the interpreter compiles nothing anyway and
    runs fastest with vectors no longer than needed."""
    if not interpret:
        return 8, 1024, 1024
    n_words = -(-n_kv // 16)
    return tuple(min(cap, launch.pow2_at_least(n, 1)) for cap, n in ((8, n_words), (1024, n_q), (1024, n_kv)))


def build_tables(mod, BD: int, HD: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int,
                 device: torch.device, separate_full: bool = True, use_interval: bool = True):
    """(kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx), each
    shaped [BD, HD, ...] (int32); the full_* ones are None unless ``separate_full``."""
    tiles = classify(mod, BD, HD, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, use_interval)
    return tiles.tables((0, tiles.n_q), (0, tiles.n_kv), separate_full)


class Tiles:
    """The classification of every (query tile, KV tile) of a mask (`classify`): 2 bits per
    tile, ``state[BD * HD, n_q, n_words]`` (see templates/block_mask.py)."""

    def __init__(self, module, state: torch.Tensor, BD: int, HD: int, n_q: int, n_kv: int, interpret: bool):
        self.module, self.state, self.BD, self.HD = module, state, BD, HD
        self.n_q, self.n_kv, self.interpret = n_q, n_kv, interpret

    def shard_ranges(self, shards: int, n: int) -> torch.Tensor:
        """int32 [shards, 4], no host sync, for KV tiles that are ``shards`` shards of ``n`` tiles
        side by side: for each shard the first and last + 1 of its tiles (from its first) that any
        row keeps, then of the query-tile rows that keep any; (n, 0, n_q, 0) where none is kept
        (templates/tile_ranges.py)."""
        device, interpret = self.state.device, self.interpret
        out = _RANGES_START.get_or_make((shards, n, self.n_q, device), lambda: launch.to_device(
            [[n, 0, self.n_q, 0]] * shards, torch.int32, device)).clone()
        module = _plain_module("tile_ranges", interpret)
        chunk = min(1024, launch.pow2_at_least(n, 1)) if interpret else 256
        _launch(module.tile_ranges_kernel, (self.n_q, shards), self.state, out, self.BD * self.HD, n,
                self.state.stride(0), self.state.stride(1), CHUNK=chunk)
        return out

    def tables(self, rows: tuple[int, int], cols: tuple[int, int], separate_full: bool = True) -> tuple:
        """The eight tables (as `build_tables`) of the query tiles ``rows = (first, last + 1)``
        against the KV tiles ``cols`` (a non-empty rectangle of the state, which the caller
        checks), numbered from the rectangle's corner: the tables of the block mask of those rows
        and columns alone."""
        return self.tables_of([(rows, cols)], separate_full)[0]

    def tables_of(self, rects: list, separate_full: bool = True) -> list[tuple]:
        """`tables` of each ``(rows, cols)`` of ``rects``, from one launch of each order kernel
        (the tables of several rectangles lie in one buffer of each kind, each a view of it)."""
        BH, device, state = self.BD * self.HD, self.state.device, self.state
        key = (tuple(rects), self.BD, self.HD, separate_full, self.interpret, device)
        n_q, n_kv, chunk_q, chunk_kv, sizes, table, views = _LAYOUTS.get_or_make(
            key, lambda: _layout(rects, self.BD, self.HD, separate_full, self.interpret, device))
        kinds = 2 if separate_full else 1  # (partial and full, or every non-empty tile)
        bufs = [torch.empty(kinds, n, dtype=torch.int32, device=device) for n in sizes]
        kv_num, q_num, kv_idx, q_idx = bufs
        many = table is not None
        # (one rectangle: its corner in the scalars, the table of rectangles unread)
        corner, table = ((0, 0), table) if many else ((rects[0][0][0], rects[0][1][0]), state)
        # (integer kernels: fp fusion is moot, set so that Triton 3.9 has no default to warn about)
        common = dict(SEPARATE_FULL=separate_full, SEL=1 if separate_full else 0, RECTS=many, enable_fp_fusion=False)
        full = 1 if separate_full else 0  # (unread without separate full tiles)
        # (the arguments in the order `signatures.KV_ORDER` / `Q_ORDER` declare)
        _launch(self.module.kv_order_kernel, (n_q, BH, len(rects)),
                state, kv_num[0], kv_idx[0], kv_num[full], kv_idx[full], table, state.stride(0), state.stride(1),
                n_q, n_kv, *corner, CHUNK=chunk_kv, **common)
        _launch(self.module.q_order_kernel, (n_kv, BH, len(rects)),
                state, q_num[0], q_idx[0], q_num[full], q_idx[full], table, state.stride(0), state.stride(1),
                n_q, n_kv, *corner, CHUNK=chunk_q, **common)
        # (one as_strided per table: a distributed build takes 8 per pair)
        return [tuple(None if v is None else bufs[v[0]].as_strided(*v[1:]) for v in tables) for tables in views]


def _layout(rects: list, BD: int, HD: int, separate_full: bool, interpret: bool, device: torch.device) -> tuple:
    """What `Tiles.tables_of` makes of ``rects`` before its launches: ``(n_q, n_kv, CHUNK of the
    q lists, CHUNK of the kv lists, the four buffers' lengths, the table of rectangles (None for
    one), and for each rectangle its eight tables as (buffer, size, stride, offset) or None)``."""
    BH = BD * HD
    shapes = [(q1 - q0, kv1 - kv0) for (q0, q1), (kv0, kv1) in rects]
    n_q, n_kv = max(r for r, _ in shapes), max(c for _, c in shapes)
    _, chunk_q, chunk_kv = chunks(n_q, n_kv, interpret)
    # (offsets of each rectangle's KV-order counts, Q-order counts and indices in the buffers,
    # each table 16-byte aligned, as the kernels' direct launch takes its tensors)
    at = [(0, 0, 0)]
    for r, c in shapes:
        at.append((at[-1][0] + _aligned(BH * r), at[-1][1] + _aligned(BH * c), at[-1][2] + _aligned(BH * r * c)))
    total = at[-1]
    sizes = (total[0], total[1], total[2], total[2])  # (kv counts, q counts, kv indices, q indices)
    table = None
    if len(rects) > 1:
        rows = tuple((q0, q1 - q0, kv0, kv1 - kv0, *at[i], 0) for i, ((q0, q1), (kv0, kv1)) in enumerate(rects))
        table = launch.to_device(rows, torch.int64, device)

    def part(b, k, lo, *shape):  # (a rectangle's table: BH * shape entries of buffer b's row k from lo)
        n = math.prod(shape)
        inner = (shape[1], 1) if len(shape) == 2 else (1,)
        return b, (BD, HD, *shape), (HD * n, n, *inner), k * sizes[b] + lo

    views = []
    for (r, c), (kv_at, q_at, idx_at) in zip(shapes, at):
        lists = [(part(0, k, kv_at, r), part(2, k, idx_at, r, c), part(1, k, q_at, c), part(3, k, idx_at, c, r))
                 for k in range(2 if separate_full else 1)]
        full_lists = lists[1] if separate_full else (None,) * 4
        views.append((*lists[0][:2], *full_lists[:2], *lists[0][2:], *full_lists[2:]))
    return n_q, n_kv, chunk_q, chunk_kv, sizes, table, views


def _plain_module(template: str, interpret: bool):
    """The module of a template with no mod in it (tile_ranges, summary), for the GPU or the
    interpreter."""
    target = "interpret" if interpret else "cuda"
    return _MODULES.get_or_make((template, target), lambda: load_kernel_module(
        template, {"prelude": emit.prelude(target)}, {}, interpret=interpret))


def _aligned(n: int) -> int:
    """``n`` int32 entries rounded up to whole 16 bytes: a table that starts there in a shared
    buffer starts 16-byte aligned (the next one too), as a kernel launch that takes no Triton
    path asks of every tensor (kernels/triton_launcher.py)."""
    return -(-n // 4) * 4


def _launch(kernel, grid: tuple, *args, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs)`` on the current stream of the first argument's device,
    through the launch layer (`launch.Launch`): after the first calls with these numbers, argument
    dtypes and constexprs, a direct launch of the compiled kernel (Triton's launch path costs tens
    of µs of host time per kernel, and a build launches three to five)."""
    device = args[0].device  # (a tensor's device names its index, which the launch switches to)
    key = (kernel, grid, device, tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args),
           tuple(constexprs.items()))
    _LAUNCHES.get_or_make(key, lambda: launch.Launch(kernel, grid, constexprs, device))(*args)


def classify(mod, BD: int, HD: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int,
             device: torch.device, use_interval: bool = True, defer: bool = True) -> Tiles:
    """Every (query tile, KV tile) of ``mod`` classified as empty, partial or full, for [BD, HD].
    ``defer=False``: undecided tiles are evaluated where they are found, never listed for
    exact_kernel (for a caller that knows they lie along the mask's edges only)."""
    interpret = device.type == "cpu"
    module = kernel_module(mod, "interpret" if interpret else "cuda")
    used = mod.buffer_specs
    summaries = {buf.index: summary(mod.buffers[buf.index]) for buf in used}
    n_q, n_kv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)
    n_words = -(-n_kv // 16)
    BH = BD * HD
    state = torch.empty(BH, n_q, n_words, dtype=torch.int32, device=device)
    # The interpreter runs one program at a time: bigger vectors, fewer steps (up to
    # `INTERPRET_SUB` square, the memory of a tile's evaluation bounded). On the GPU, sub-tiles of
    # 64 x 64 keep registers in check.
    sub = INTERPRET_SUB if interpret else 64
    sub_q, sub_kv = min(Q_BLOCK, sub), min(KV_BLOCK, sub)
    chunk_words, _, _ = chunks(n_q, n_kv, interpret)
    # (a chunk's undecided tiles from DEFER_MIN on go to exact_kernel, whose programs share them:
    # where the mask gathers from captured tensors, whose rows can be undecided wholesale (a query
    # tile across two distant runs of positions); arithmetic on the indices alone leaves its
    # undecided tiles along the mask's edges, spread over the rows, and pays no second launch. The
    # list packs a tile's row and column in 20 bits each)
    defer_min = DEFER_MIN["interpret" if interpret else "cuda"] if defer and used and max(n_q, n_kv) < 1 << 20 else 0
    deferred = torch.zeros(1 + DEFER_CAP, dtype=torch.int64, device=device) if defer_min else _unused_list(device)
    mod_args = emit.launch_args(used, mod.buffers)
    fixed = dict(BLOCK_Q=Q_BLOCK, BLOCK_KV=KV_BLOCK, SUB_Q=sub_q, SUB_KV=sub_kv,
                 # No FMA contraction: interval bounds rely on every float op rounding like torch's.
                 enable_fp_fusion=False)
    # (the arguments in the order `signatures.CLASSIFY` / `EXACT` declare)
    _launch(module.classify_kernel, (n_q, BH),
            state, deferred, *mod_args, *summary_args(used, summaries), state.stride(0), state.stride(1),
            HD, Q_LEN, KV_LEN, n_kv, n_words, DEFER_CAP,
            CHUNK_WORDS=chunk_words, USE_INTERVAL=use_interval, DEFER_MIN=defer_min, **fixed)
    if defer_min:  # (4 programs per SM; one in the interpreter, which runs one at a time)
        programs = 1 if interpret else 4 * launch.num_sms(device)
        _launch(module.exact_kernel, (programs,),
                state, deferred, *mod_args, state.stride(0), state.stride(1), HD, Q_LEN, KV_LEN, DEFER_CAP,
                NPROG=programs, **fixed)
    return Tiles(module, state, BD, HD, n_q, n_kv, interpret)


def summary(t: torch.Tensor) -> interval.Summary:
    """`interval.Summary.of(t)`; where ``t`` is a 1-D integer or bool tensor, its pyramid made by
    two launches (templates/summary.py) instead of a torch reduction per level (a document-id table
    of 131,072 entries has 14 levels)."""
    kept = interval.Summary.kept(t)
    if kept is not None:
        return kept
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype.is_complex:
        return interval.Summary.of(t)
    K = interval.Summary.levels(t.numel())
    L = min(K, PYRAMID_LEVELS)
    if K - L > PYRAMID_TOP:
        return interval.Summary.of(t)
    device = t.device
    module = _plain_module("summary", device.type == "cpu")
    # (2**(K + 1) - 1 entries each, in rows of 2**(K + 1): both start 16-byte aligned, as a direct
    # launch takes them)
    both = torch.empty(2, 2 << K, dtype=torch.int64, device=device)
    mins, maxs = both[0, :-1], both[1, :-1]
    x = t.detach().contiguous()
    _launch(module.pyramid_kernel, (1 << (K - L),), x, mins, maxs, x.numel(), K=K, L=L, GRANULE=interval.GRANULE)
    if K > L:
        _launch(module.top_kernel, (1,), mins, maxs, K=K, L=L)
    return interval.Summary.pyramid(mins, maxs, K)


def keep_summary(t: torch.Tensor) -> None:
    """`interval.Summary.keep` of ``t`` with its summary made as `summary` makes it (two launches
    for a 1-D integer or bool table): for the tables a distributed build makes once and reads in
    many block masks."""
    interval.Summary.keep(t, summary(t))


# The interpreter's largest sub-tile side (a tile of more than 16 sub-tiles is evaluated in loops
# that stop at the sequence end: templates/block_mask.py, UNROLL_SUBS); a test makes it small.
INTERPRET_SUB = 256


# Levels of a summary pyramid that one program of pyramid_kernel writes (2**8 granules: 4,096
# elements), and at most top_kernel's (its one program holds 2**12 entries of each): past 2**24
# elements, torch's reductions summarise.
PYRAMID_LEVELS = 8
PYRAMID_TOP = 12


# Undecided tiles of one chunk of a row (CHUNK_WORDS x 16 tiles) from which classify_kernel lists
# them for exact_kernel instead of evaluating them itself, on the GPU and in the interpreter (0:
# never; the interpreter runs one program at a time, where sharing them gains nothing). Over 4
# GPUs head-tail at a length that is no multiple of the blocks, a query tile across its shard's
# two chunks holds positions of both, so interval analysis decides almost none of its row: one
# program evaluated them all. H100, one rank's causal build: 1.4-1.9 ms against 7.6-7.9 at
# S=131,265, 1.9-2.3 against 28-30 at S=524,481; one GPU's 16 documents at S=524,481: 2.6 ms
# against 4.0-4.4.
DEFER_MIN = {"cuda": 16, "interpret": 0}
DEFER_CAP = 1 << 16  # tiles listed at most (512 KB); a chunk past it evaluates its own
_UNUSED = LRU(16)


def _unused_list(device: torch.device) -> torch.Tensor:
    """An int64 tensor for classify_kernel's Deferred where it lists nothing (never read)."""
    return _UNUSED.get_or_make(device, lambda: torch.zeros(1, dtype=torch.int64, device=device))
