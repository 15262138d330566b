"""Block-mask tables as the kernels read them, prepared once per BlockMask object.

A BlockMask (flexattn's or torch's: the fields are the same) is checked and its tables converted
to int32 with a contiguous last dimension the first time a launch sees it; the result, `Tables`,
is kept on the mask object (keyed by the identity of the tensors it was made from, so reassigning
a field is noticed) and every later call with that mask costs an attribute lookup.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import triton

from flexattn import interval
from flexattn.kernels.layout import table_strides
from flexattn.lru import LRU

_CACHE_ATTR = "_flexattn_tables"
#: A BlockMask's tables (flexattn's and torch's), in torch's order.
TABLE_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
_VERSION = operator.attrgetter("_version")  # a tensor's in-place modification counter


def version(t: torch.Tensor) -> int | None:
    """``t``'s in-place modification counter; None for an inference tensor, which keeps none (a
    cache keyed by it must not trust a copy made from such a tensor)."""
    return None if t.is_inference() else t._version


@dataclass(frozen=True)
class Direction:
    """One direction of a block mask: partial and full counts and indices, int32.

    ``num[b, h, row]`` blocks are listed in ``idx[b, h, row, :num]``; ``full_*`` are None when
    the mask has no separate full blocks (then the partial tensors stand in for them at launch,
    HAS_FULL_BLOCKS is False and they are not read)."""

    num: torch.Tensor
    idx: torch.Tensor
    full_num: torch.Tensor | None
    full_idx: torch.Tensor | None

    def args(self) -> list[torch.Tensor]:
        fn = self.full_num if self.full_num is not None else self.num
        fi = self.full_idx if self.full_idx is not None else self.idx
        return [self.num, self.idx, fn, fi]

    def strides(self) -> list[int]:
        out = self.__dict__.get("_strides")
        if out is None:
            out = self.__dict__["_strides"] = [s for t in self.args() for s in table_strides(t)]
        return out

    @property
    def has_full(self) -> bool:
        return self.full_num is not None


@dataclass(frozen=True)
class Tables:
    """What the kernels read of a BlockMask: ``kv`` rows per query block (forward, dQ, decoding),
    ``q`` rows per KV block (dK/dV; made by transposing ``kv`` when the mask carries none, on
    first use), the sparse block sizes and the lengths it was built for."""

    kv: Direction
    q: Direction | None
    q_block: int
    kv_block: int
    seq_lengths: tuple[int, int] | None
    sig: tuple  # everything a launch plan depends on: shapes, strides, block sizes, full blocks

    def consecutive(self) -> bool:
        """Whether every row of the KV lists (partial and full) lists consecutive blocks, as a
        causal mask's do: the kernels may then step through them without reading the lists
        (kernel option BLOCKS_ARE_CONTIGUOUS). False until the device's answer has arrived
        (`start_consecutive_check`; nothing waits for it), and from the moment a list tensor is
        modified in place."""
        check = self.__dict__.get("_consecutive")
        if check is None or check[0] is False:
            return False
        if check[0] is not True:
            event, host = check[0]
            if torch.cuda.is_current_stream_capturing() or not event.query():
                return False
            check[0] = bool(host)
            if not check[0]:
                return False
        return list(map(_VERSION, check[1])) == check[2]

    @classmethod
    def of(cls, kv: Direction, q: Direction | None, q_block: int, kv_block: int,
           seq_lengths: tuple[int, int] | None) -> "Tables":
        """The tables with their ``sig``: block sizes, lengths, full blocks, device, and the shapes
        and strides of both directions' tables (the backward's kernels take the q_* tables'
        strides, which a compiled kernel may have specialised on)."""
        sig = (q_block, kv_block, seq_lengths, kv.has_full, kv.num.device,
               tuple((t.shape, t.stride()) for t in kv.args()),
               None if q is None else tuple((t.shape, t.stride()) for t in q.args()))
        return cls(kv, q, q_block, kv_block, seq_lengths, sig)


def _index(t: Any, name: str, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"block_mask.{name} must be a {ndim}-d integer tensor, got {got}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"block_mask.{name} must be an integer tensor (int32), got {t.dtype}")
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _block_sizes(block_mask) -> tuple[int, int]:
    size = block_mask.BLOCK_SIZE
    q, kv = (size, size) if isinstance(size, int) else tuple(size)
    for name, s in (("Q", q), ("KV", kv)):
        if not isinstance(s, int) or s <= 0:
            raise ValueError(f"block_mask's {name} block size must be a positive int, got BLOCK_SIZE={size}")
    check_block_size("KV", kv, size)  # every kernel walks KV tiles of >= 16 columns
    return int(q), int(kv)


def check_block_size(name: str, s: int, size) -> None:
    if s % 16 != 0:
        raise ValueError(f"block_mask's {name} block size must be a positive multiple of 16 (kernel tiles "
                         f"are powers of two >= 16), got BLOCK_SIZE={size}")


def _direction(block_mask, prefix: str) -> Direction | None:
    num = getattr(block_mask, f"{prefix}_num_blocks", None)
    if num is None:
        return None
    num = _index(num, f"{prefix}_num_blocks", 3)
    idx = _index(getattr(block_mask, f"{prefix}_indices"), f"{prefix}_indices", 4)
    full_num = getattr(block_mask, f"full_{prefix}_num_blocks", None)
    full_idx = None
    if full_num is not None:
        full_num = _index(full_num, f"full_{prefix}_num_blocks", 3)
        full_idx = _index(getattr(block_mask, f"full_{prefix}_indices"), f"full_{prefix}_indices", 4)
        if full_num.shape != num.shape or full_idx.shape[:3] != num.shape:
            raise ValueError(f"block_mask.full_{prefix}_num_blocks {tuple(full_num.shape)} / full_{prefix}_indices "
                             f"{tuple(full_idx.shape)} must match {prefix}_num_blocks {tuple(num.shape)}")
    if idx.shape[:3] != num.shape:
        raise ValueError(f"block_mask.{prefix}_indices {tuple(idx.shape)} must start with {prefix}_num_blocks' "
                         f"shape {tuple(num.shape)}")
    devices = {t.device for t in (num, idx, full_num, full_idx) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"block_mask's {prefix} tables are on different devices: {sorted(map(str, devices))}")
    return Direction(num, idx, full_num, full_idx)


def _sources(block_mask) -> tuple:
    return tuple(getattr(block_mask, n, None) for n in (*TABLE_FIELDS, "BLOCK_SIZE", "seq_lengths"))


def _rows_consecutive(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: every row's ``num`` listed blocks are idx[0], idx[0] + 1, ..."""
    steps = torch.arange(idx.shape[-1], dtype=torch.int32, device=idx.device)
    listed = steps < num[..., None]
    return ((idx - idx[..., :1] == steps) | ~listed).all()


def start_consecutive_check(tables: Tables) -> None:
    """Check the KV lists for `Tables.consecutive` on their device, without waiting: on a GPU the
    answer is copied back behind an event (on the CPU it is there at once). Not while a CUDA graph
    is captured or torch.compile traces (never consecutive then)."""
    kv = tables.kv
    device = kv.num.device
    if device.type not in ("cuda", "cpu") or torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return
    tensors = (kv.num, kv.idx) + ((kv.full_num, kv.full_idx) if kv.has_full else ())
    if any(t.is_inference() for t in tensors):  # (no modification counter to trust the answer by)
        return
    versions = list(map(_VERSION, tensors))
    # (on the lists' GPU: its current stream runs the check and the copy, and the event follows them)
    with torch.no_grad(), (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
        ok = _rows_consecutive(kv.num, kv.idx)
        if kv.has_full:
            ok = ok & _rows_consecutive(kv.full_num, kv.full_idx)
        if device.type == "cpu":
            answer = bool(ok)
        else:
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(ok, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            answer = (event, host)
    tables.__dict__["_consecutive"] = [answer, tensors, versions]


def tables_of(block_mask, check=None) -> Tables:
    """The launch tables of ``block_mask``, made and checked once per mask object; ``check(mask)``
    runs then too (the caller's check of the tables' values)."""
    cached = getattr(block_mask, _CACHE_ATTR, None)
    if cached is not None:
        sources, copied, tables = cached
        if all(a is b for a, b in zip(sources, _sources(block_mask))) and \
                (not copied or all(v is not None and version(t) == v for t, v in copied)):
            return tables
    sources = _sources(block_mask)
    if sources[0] is None:
        raise TypeError(f"block_mask must be a BlockMask (flexattn's or torch's), got {type(block_mask).__name__}")
    if check is not None:
        check(block_mask)
    q_block, kv_block = _block_sizes(block_mask)
    kv = _direction(block_mask, "kv")
    q = _direction(block_mask, "q")
    if q is not None and q.has_full != kv.has_full:
        raise ValueError("block_mask has full blocks in one direction only (full_kv_* vs full_q_*)")
    seq = getattr(block_mask, "seq_lengths", None)
    seq = None if seq is None else (int(seq[0]), int(seq[1]))
    tables = Tables.of(kv, q, q_block, kv_block, seq)
    start_consecutive_check(tables)
    # the mask's tables that the launch tables copy (int64, or strided rows): an in-place change of
    # one makes them again
    used = {id(t) for t in (*kv.args(), *(q.args() if q is not None else ())) if t is not None}
    copied = tuple((t, version(t)) for t in sources[:len(TABLE_FIELDS)]
                   if isinstance(t, torch.Tensor) and id(t) not in used)
    try:
        setattr(block_mask, _CACHE_ATTR, (sources, copied, tables))
    except AttributeError:  # a mask type that refuses attributes: prepared again each call
        pass
    return tables


def check_against(tables: Tables, B: int, Hq: int, Q_LEN: int, KV_LEN: int, device: torch.device) -> None:
    """Raise a ValueError unless a BlockMask fits inputs of these sizes on ``device`` (once per
    launch plan, and `BlockMask.check_shape`)."""
    seq = tables.seq_lengths
    if seq is not None and seq != (Q_LEN, KV_LEN):
        hint = ("crop it with block_mask._adjust(Q_LEN, KV_LEN) or build the block mask for these lengths"
                if Q_LEN <= seq[0] and KV_LEN <= seq[1] else "build the block mask for these lengths")
        raise ValueError(f"block_mask was built for (Q_LEN, KV_LEN) = {seq}, but query has "
                         f"Q_LEN={Q_LEN} and key KV_LEN={KV_LEN}; {hint}")
    num, idx = tables.kv.num, tables.kv.idx
    if num.device != device:
        raise ValueError(f"block_mask is on {num.device} but query is on {device}; use "
                         f"block_mask.to({str(device)!r})")
    Bm, Hm, nQ = num.shape
    if Bm not in (1, B) or Hm not in (1, Hq):
        raise ValueError(f"block_mask has B={Bm}, H={Hm}; it must have B of 1 or query's {B} and H of 1 or "
                         f"query's {Hq}")
    need_q, need_kv = triton.cdiv(Q_LEN, tables.q_block), triton.cdiv(KV_LEN, tables.kv_block)
    if nQ < need_q:
        raise ValueError(f"block_mask has {nQ} query blocks of {tables.q_block}, Q_LEN={Q_LEN} needs {need_q} "
                         "(a sliced block mask cannot be used for attention)")
    if idx.shape[3] < need_kv and tables.seq_lengths is None:
        raise ValueError(f"block_mask.kv_indices has {idx.shape[3]} KV blocks of {tables.kv_block}, "
                         f"KV_LEN={KV_LEN} needs {need_kv}")
    if tables.q is not None and tables.q.num.shape[2] < need_kv:
        raise ValueError(f"block_mask.q_num_blocks has {tables.q.num.shape[2]} KV blocks, KV_LEN={KV_LEN} "
                         f"needs {need_kv}")


def _made_from(tables: Tables, slot: str, n: int, source: Direction, make):
    """``make()``, kept on ``tables`` under (slot, n) and made again when ``source`` is another
    Direction than the one it was made from or one of its tensors has changed in place (never
    trusted for inference tensors, which keep no change counter)."""
    cache = tables.__dict__.setdefault(slot, {})
    versions = tuple(version(t) for t in source.args())
    made, made_from, made_versions = cache.get(n, (None, None, None))
    if made is None or made_from is not source or made_versions != versions or None in versions:
        made = make()
        cache[n] = (made, source, versions)
    return made


def q_direction(tables: Tables, KV_LEN: int) -> Direction:
    """The dK/dV pass's lists: the mask's own ``q_*`` tables, or ``kv`` transposed (made once)."""
    if tables.q is not None:
        return tables.q
    n_kv = triton.cdiv(KV_LEN, tables.kv_block)

    def make():
        kv = tables.kv
        q_num, q_idx = transpose(kv.num, kv.idx, n_kv)
        fq_num = fq_idx = None
        if kv.has_full:
            fq_num, fq_idx = transpose(kv.full_num, kv.full_idx, n_kv)
        return Direction(q_num, q_idx, fq_num, fq_idx)

    # (made again after an in-place change of the KV lists)
    return _made_from(tables, "_transposed", n_kv, tables.kv, make)


def regrouped(tables: Tables, rows: int) -> Tables:
    """``tables`` for query blocks of ``rows`` rows (the Hopper forward's 192-row tiles on a mask's
    128-row blocks; `hopper.forward_rows` says when): a KV block is listed for a new block where
    it is listed for any of the mask's query blocks the new one overlaps, and is full where it is
    full in all of them, so a tile's mask work is never skipped where an element could be masked.
    KV lists only; made once per mask (again after an in-place change of its KV lists).

    >>> kv = Direction(torch.tensor([[[1, 1, 1]]]), torch.tensor([[[[0, 1], [1, 0], [1, 0]]]]),
    ...                torch.tensor([[[0, 1, 1]]]), torch.tensor([[[[1, 0], [0, 1], [0, 1]]]]))
    >>> two = regrouped(Tables.of(kv, None, 64, 128, None), 128)  # (query blocks 0-1, then 2)
    >>> two.kv.num.tolist(), two.kv.idx[..., 0].tolist(), two.kv.full_num.tolist(), two.q_block
    ([[[2, 1]]], [[[0, 1]]], [[[0, 1]]], 128)
    """
    kv = tables.kv
    n_src, n_kv = kv.num.shape[-1], kv.idx.shape[-1]
    n = -(-n_src * tables.q_block // rows)

    def make():
        partial = flags(kv.num, kv.idx, n_kv)  # [..., mask's query block, KV block]
        full = flags(kv.full_num, kv.full_idx, n_kv) if kv.has_full else torch.zeros_like(partial)
        visits = partial | full
        starts = torch.arange(n, device=visits.device) * rows
        first, last = starts // tables.q_block, ((starts + rows - 1) // tables.q_block).clamp_max(n_src - 1)
        listed = torch.zeros(*visits.shape[:-2], n, n_kv, dtype=torch.bool, device=visits.device)
        whole = torch.ones_like(listed)
        for step in range(-(-rows // tables.q_block) + 1):  # (the most mask blocks a new one overlaps)
            src, inside = (first + step).clamp_max(n_src - 1), (first + step <= last)[:, None]
            listed |= visits.index_select(-2, src) & inside
            whole &= full.index_select(-2, src) | ~inside
        num, idx = ordered(listed & ~whole)
        fnum, fidx = ordered(whole) if kv.has_full else (None, None)
        return Tables.of(Direction(num, idx, fnum, fidx), None, rows, tables.kv_block, tables.seq_lengths)

    return _made_from(tables, "_regrouped", rows, kv, make)


def listed_blocks(tables: Tables) -> tuple[int, int, int]:
    """(partial, full, all) (query block, KV block) pairs of the KV lists: what they visit, and
    how many there are (one host sync: for plans, not calls)."""
    kv = tables.kv
    partial, full = torch.stack([kv.num.sum(), kv.full_num.sum() if kv.has_full else kv.num.new_zeros(())]).tolist()
    return partial, full, kv.num.numel() * kv.idx.shape[-1]


def visited_share(tables: Tables) -> float:
    """The share of all (query block, KV block) pairs the KV lists visit, partial or full."""
    partial, full, blocks = listed_blocks(tables)
    return (partial + full) / max(blocks, 1)


def ordered_q_lists(tables: Tables, KV_LEN: int) -> Direction | None:
    """The deterministic Hopper backward's dK/dV lists (templates/backward_hopper.py: DQ_ORDERED):
    per KV block, one list of every query block it visits, partial and full merged in ascending
    order (the kernel walks it from the last), each entry the query block in bits 0-14, 1 in bit
    15 where the block is partial, and in bits 16 and up its *rank*: how many KV blocks of a lower
    index visit that query block, the order in which their dQ parts are added. No full lists.
    None where a query block or a rank would not fit (32,768 of either) or the [KV blocks, query
    blocks] tables would pass 2^25 entries; made once per mask.

    >>> kv = Direction(torch.tensor([[[1, 1]]]), torch.tensor([[[[1, 0], [1, 0]]]]),
    ...                torch.tensor([[[1, 0]]]), torch.tensor([[[[0, 1], [0, 1]]]]))
    >>> q = ordered_q_lists(Tables(kv, None, 64, 64, None, ()), 128)  # (query block 0: KV 0 full, 1 partial)
    >>> q.num.tolist(), (q.idx & 0x7FFF).tolist(), (q.idx >> 15 & 1).tolist(), (q.idx >> 16).tolist()
    ([[[1, 2]]], [[[[0, 1], [0, 1]]]], [[[[0, 0], [1, 1]]]], [[[[0, 0], [1, 0]]]])
    """
    q = q_direction(tables, KV_LEN)
    n_q, n_kv = tables.kv.num.shape[-1], q.num.shape[-1]
    if n_q > 1 << 15 or n_kv > 1 << 15 or q.num[..., :1].numel() * n_q * n_kv > 1 << 25:
        return None

    def make():
        partial = flags(q.num, q.idx, n_q)  # [..., KV block, query block]
        visits = partial | flags(q.full_num, q.full_idx, n_q) if q.has_full else partial
        counts = visits.to(torch.int32)
        before = counts.cumsum(-2, dtype=torch.int32) - counts  # visits of each query block by lower KV blocks
        num, idx = ordered(visits)
        blocks = torch.arange(n_q, dtype=torch.int32, device=visits.device)
        entry = blocks | (partial.to(torch.int32) << 15) | (before << 16)  # (of every query block)
        return Direction(num, entry.gather(-1, idx.long()), None, None)

    # (made again when the q lists are: the transposed ones are new tensors after a change of the KV lists)
    return _made_from(tables, "_ordered", n_kv, q, make)


_DENSE = LRU(1024)  # (device, blocks) -> the tables of "no block mask" (a few int32 each)


def dense(device: torch.device, n: int) -> Direction:
    """No block mask: one row of ``n`` consecutive full blocks, starting at block 0."""
    key = (device, n)
    d = _DENSE.get(key)
    if d is None:
        zeros = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
        full = torch.full((1, 1, 1), n, dtype=torch.int32, device=device)
        idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=device)
        d = Direction(zeros, idx, full, idx)
        _DENSE[key] = d
    return d


# ---------------------------------------------------------------------------------------------
# Layout: index tables from tile flags and back (torch ops; any device)

# Tiles handled at once by `ordered`.
_TILES_PER_STEP = 1 << 16


def ordered(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and torch's index layout for 0/1 tile rows ``sel[..., R, C]``.

    Each row of the index table lists the selected columns ascending, then the others ascending:
    the same permutation as torch's ``argsort(descending=True, stable=True)``, computed with a
    cumulative sum and a scatter, a chunk of rows at a time.
    """
    *lead, R, C = sel.shape
    flat = sel.reshape(-1, C)
    num = torch.empty(flat.shape[0], dtype=torch.int32, device=sel.device)
    idx = torch.empty(flat.shape[0], C, dtype=torch.int32, device=sel.device)
    cols = torch.arange(C, dtype=torch.int32, device=sel.device)
    step = max(1, _TILES_PER_STEP // max(C, 1))
    for r0 in range(0, flat.shape[0], step):
        s = flat[r0:r0 + step].to(torch.int32)
        before = torch.cumsum(s, -1, dtype=torch.int32) - s
        n = s.sum(-1, dtype=torch.int32)
        pos = torch.where(s.bool(), before, n[:, None] + cols - before)
        idx[r0:r0 + step].scatter_(-1, pos.long(), cols.expand_as(pos).contiguous())
        num[r0:r0 + step] = n
    return num.view(*lead, R), idx.view(*lead, R, C)


def flags(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The 0/1 tile rows listed by (num, idx): [..., R, n_cols] bool (tile level, not elements)."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    cols = torch.where(valid, idx.long(), n_cols)
    flags = torch.zeros(*idx.shape[:-1], n_cols + 1, dtype=torch.bool, device=idx.device)
    flags.scatter_(-1, cols, True)
    return flags[..., :n_cols]


def transpose(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The column-major twin of a (num, idx) block list, in the same layout: for each of the
    ``n_cols`` column blocks, the rows listing it ascending, then the other rows ascending (the
    ``q_*`` tables of a BlockMask from its ``kv_*`` tables, as torch makes them).

    >>> n, i = transpose(torch.tensor([[[1, 2]]]), torch.tensor([[[[1, 0], [0, 1]]]]), 2)
    >>> n.tolist(), i.tolist()
    ([[[1, 2]]], [[[[1, 0], [0, 1]]]])
    """
    return ordered(flags(num, idx, n_cols).transpose(-2, -1))


def tile_states(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, full_kv_num_blocks: torch.Tensor | None,
                full_kv_indices: torch.Tensor | None) -> torch.Tensor:
    """[..., nQ, nKV] int8 tile states of the KV lists: 0 empty, 1 partial, 2 full (`flexattn.interval`'s)."""
    n_cols = kv_indices.shape[-1]
    st = flags(kv_num_blocks, kv_indices, n_cols).to(torch.int8)
    if full_kv_num_blocks is not None:
        full = flags(full_kv_num_blocks, full_kv_indices, n_cols)
        st = torch.where(full, interval.FULL, st).to(torch.int8)
    return st


# ---------------------------------------------------------------------------------------------
# Table validation


def block_size_pair(BLOCK_SIZE, arg: str = "BLOCK_SIZE") -> tuple[int, int]:
    if isinstance(BLOCK_SIZE, int) and not isinstance(BLOCK_SIZE, bool):
        pair = (BLOCK_SIZE, BLOCK_SIZE)
    elif (isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in BLOCK_SIZE)):
        pair = (int(BLOCK_SIZE[0]), int(BLOCK_SIZE[1]))
    else:
        raise TypeError(f"{arg} must be an int or a (Q_BLOCK, KV_BLOCK) pair of ints, got {BLOCK_SIZE!r}")
    return pair


_TABLE_DTYPES = (torch.int32, torch.int64)


def _entry(index) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def validate_block_tables(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                          full_kv_num_blocks: torch.Tensor | None = None,
                          full_kv_indices: torch.Tensor | None = None,
                          q_num_blocks: torch.Tensor | None = None, q_indices: torch.Tensor | None = None,
                          full_q_num_blocks: torch.Tensor | None = None,
                          full_q_indices: torch.Tensor | None = None, *,
                          seq_lengths: tuple[int, int], BLOCK_SIZE: int | tuple[int, int]) -> None:
    """Raise a ValueError unless the tables are safe for the kernels to follow.

    Checks what a kernel reads: every table is an int32/int64 tensor on one (non-meta) device;
    ``*_num_blocks`` has the shape of ``*_indices`` without its last dimension, the full twins
    the shape of the partial ones; every count is in ``[0, min(columns, tiles)]`` and the first
    ``count`` indices of each row are in ``[0, tiles)`` (entries past the count are never read and
    may hold anything). The error names the table and the first offending entry. A row per query
    tile is checked by `check_against` when the mask meets its inputs (a sliced mask may have fewer
    rows). It does not check that a tile is listed once (a repeat is counted twice, as
    in torch). One host sync: call it once per mask, not per call.

    >>> nb = torch.tensor([[[4]]], dtype=torch.int32); idx = torch.tensor([[[[0, 1, 2, 3]]]], dtype=torch.int32)
    >>> validate_block_tables(nb, idx, seq_lengths=(16, 40), BLOCK_SIZE=16)
    Traceback (most recent call last):
    ...
    ValueError: kv_num_blocks[0, 0, 0] = 4 is out of range: expected 0 <= count <= 3 (KV_LEN 40 has 3 KV blocks of 16; kv_indices has 4 columns)
    """
    q_block, kv_block = block_size_pair(BLOCK_SIZE)
    q_len, kv_len = (int(x) for x in seq_lengths)
    n_q, n_kv = -(-q_len // q_block), -(-kv_len // kv_block)
    tables = dict(zip(TABLE_FIELDS, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                     q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)))
    _check_kinds(tables)
    kv_what = f"KV_LEN {kv_len} has {n_kv} KV blocks of {kv_block}"
    q_what = f"Q_LEN {q_len} has {n_q} query blocks of {q_block}"
    checks = []
    for i, (tiles, what) in enumerate(((n_kv, kv_what), (n_kv, kv_what), (n_q, q_what), (n_q, q_what))):
        num_name, idx_name = TABLE_FIELDS[2 * i], TABLE_FIELDS[2 * i + 1]
        check = _range_check(num_name, tables[num_name], idx_name, tables[idx_name], kv_num_blocks, tiles, what)
        if check is not None:
            checks.append(check)
    if not checks:
        return
    # One host sync for every table.
    found = torch.stack([torch.stack([c[4].any(), c[5].any()]) for c in checks]).tolist()
    for (num_name, idx_name, num, idx, bad_num, bad_idx, limit, tiles, what), (nb, ib) in zip(checks, found):
        if nb:
            at = bad_num.nonzero()[0].tolist()
            raise ValueError(f"{num_name}{_entry(at)} = {int(num[tuple(at)])} is out of range: expected 0 <= count "
                             f"<= {limit} ({what}; {idx_name} has {idx.shape[-1]} columns)")
        if ib:
            at = bad_idx.nonzero()[0].tolist()
            raise ValueError(f"{idx_name}{_entry(at)} = {int(idx[tuple(at)])} is out of range: expected a block "
                             f"index in [0, {tiles}) ({what}; the entry is among the first "
                             f"{num_name}{_entry(at[:-1])} = {int(num[tuple(at[:-1])])} of its row)")


def _check_kinds(tables: dict[str, Any]) -> None:
    """Every given table is an int32/int64 tensor, all on one device that holds values."""
    device = None
    for name, t in tables.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _TABLE_DTYPES:
            raise ValueError(f"{name} must be an int32 (or int64) tensor, got {t.dtype}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device, which holds no values; block tables must be "
                             "on the device of the attention inputs (cpu or cuda)")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but kv_num_blocks is on {device}; all block tables "
                             "must be on one device")


def _range_check(num_name: str, num: torch.Tensor | None, idx_name: str, idx: torch.Tensor | None,
                 kv_num_blocks: torch.Tensor, tiles: int, what: str) -> tuple | None:
    """Shape checks of one (counts, indices) pair, and its out-of-range flags (tensors: not synced
    here); None when the pair is absent. A row may list ``tiles`` tiles; ``what`` says why."""
    if (num is None) != (idx is None):
        raise ValueError(f"{num_name} and {idx_name} must both be given or both be None")
    if num is None:
        return None
    if idx.dim() < 2:
        raise ValueError(f"{idx_name} must have at least 2 dimensions ([..., rows, columns]), got shape "
                         f"{tuple(idx.shape)}")
    if num.shape != idx.shape[:-1]:
        raise ValueError(f"{num_name} must have shape {tuple(idx.shape[:-1])} ({idx_name} without its last "
                         f"dimension), got {tuple(num.shape)}")
    if num.shape[:-1] != kv_num_blocks.shape[:-1]:
        raise ValueError(f"{num_name} has batch dimensions {tuple(num.shape[:-1])} but kv_num_blocks has "
                         f"{tuple(kv_num_blocks.shape[:-1])}")
    limit = min(idx.shape[-1], tiles)
    bad_num = (num < 0) | (num > limit)
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    bad_idx = listed & ((idx < 0) | (idx >= tiles))
    return num_name, idx_name, num, idx, bad_num, bad_idx, limit, tiles, what


def validate_mask(block_mask) -> None:
    """`validate_block_tables` of a BlockMask object (flexattn's or torch's)."""
    validate_block_tables(*(getattr(block_mask, n, None) for n in TABLE_FIELDS),
                          seq_lengths=tuple(block_mask.seq_lengths), BLOCK_SIZE=block_mask.BLOCK_SIZE)
