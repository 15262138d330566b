"""`BlockMask` and `create_block_mask`: which KV tiles each query tile must visit.

Same fields, layout and meaning as ``torch.nn.attention.flex_attention.BlockMask``:

    kv_num_blocks [B, H, nQ]        number of *partial* KV tiles of each query tile (mask needed)
    kv_indices    [B, H, nQ, nKV]   those tiles in ascending order, then all other tiles ascending
    full_kv_*                       the same for *full* tiles (mask all true: no mask work)
    q_*, full_q_*                   the transpose, [B, H, nKV] / [B, H, nKV, nQ], for the backward

with ``BLOCK_SIZE = (Q_BLOCK, KV_BLOCK)``, ``seq_lengths = (Q_LEN, KV_LEN)`` and ``mask_mod``
(the user's callable, kept as given). Elements past Q_LEN / KV_LEN count as masked out, so a tile
cut by the sequence end is partial at most, as in torch. All tensors are int32.

Unlike torch's eager version, `create_block_mask` never builds the dense B x H x Q_LEN x KV_LEN
mask. It classifies tiles: interval analysis of the mask's IR (`flexattn.interval`) decides most
tiles outright (causal, sliding window, prefix-LM, documents), and only the undecided ones are
evaluated element by element. On the GPU one generated Triton kernel does both and two more write
the index tables (`flexattn.codegen.block_mask_kernel`); on the CPU the same steps run as chunked
torch ops. Memory is O(B * H * nQ * nKV) either way.
"""

from __future__ import annotations

import inspect
import itertools
import math
from typing import Any, Callable

import torch

from flexattn import interval, ir
from flexattn.mods import MASK, SCORE, Mod

_DEFAULT_SPARSE_BLOCK_SIZE = 128
_MIN_BLOCK_SIZE = 16
# Elements evaluated at once on the CPU path (the evaluator keeps every intermediate alive).
_CPU_ELEMENTS_PER_STEP = 1 << 18
# Tiles handled at once by the chunked CPU interval analysis / ordering.
_CPU_TILES_PER_STEP = 1 << 16


# ---------------------------------------------------------------------------------------------
# Mask mods


def noop_mask(batch, head, token_q, token_kv):
    """A mask_mod that keeps everything."""
    return batch.new_ones(size=(), dtype=torch.bool, device=batch.device)


def _sliced_mask_mod_error(batch, head, token_q, token_kv):
    raise RuntimeError(
        "Cannot use mask_mod from a sliced BlockMask: slicing resets mask_mod. Take the mask_mod "
        "from the original (unsliced) BlockMask instead."
    )


def is_noop_mask(fn) -> bool:
    if fn is noop_mask:
        return True
    try:
        from torch.nn.attention import flex_attention as torch_flex
    except ImportError:  # pragma: no cover - old torch
        return False
    return fn is getattr(torch_flex, "noop_mask", None)


def _shift_buffers(root: ir.Node, offset: int) -> ir.Node:
    """``root`` with every captured-buffer index moved up by ``offset`` (to merge two mods)."""
    if offset == 0:
        return root
    memo: dict[int, ir.Node] = {}
    for n in ir.toposort(root):
        src = tuple(memo[id(s)] for s in n.src)
        if n.op == "load":
            b = n.arg
            memo[id(n)] = ir.load(ir.Buffer(b.index + offset, b.name, b.dtype, b.ndim), src)
        elif any(a is not s for a, s in zip(src, n.src)):
            memo[id(n)] = ir.rebuild(n, src)
        else:
            memo[id(n)] = n
    return memo[id(root)]


def _combine(op: str, mods: list[Mod], name: str) -> Mod:
    root, buffers = None, []
    for m in mods:
        r = _shift_buffers(m.ir, len(buffers))
        buffers += list(m.buffers)
        root = r if root is None else ir.binary(op, root, r)
    return Mod(MASK, root, buffers, name=name, source=f"{name}({', '.join(m.name for m in mods)})")


def _check_callables(fn_name: str, mask_mods) -> None:
    for i, m in enumerate(mask_mods):
        if not callable(m):
            raise TypeError(f"{fn_name}() expects mask_mod callables; argument {i} is {type(m).__name__}")


def and_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that keeps what every one of ``mask_mods`` keeps (torch's ``and_masks``).

    Mods that are already `Mod` objects combine into one `Mod`; Python functions combine into a
    Python function, traced when used.

    Example::

        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> window = lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 256
        >>> sliding_causal = and_masks(causal, window)
    """
    _check_callables("and_masks", mask_mods)
    if mask_mods and all(isinstance(m, Mod) and m.kind == MASK for m in mask_mods):
        return _combine("and_", list(mask_mods), "and_mask")

    def and_mask(b, h, q_idx, kv_idx):
        result = b.new_ones((), dtype=torch.bool)
        for mask in mask_mods:
            result = result & mask(b, h, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that keeps what any of ``mask_mods`` keeps (torch's ``or_masks``).

    Example::

        >>> prefix = lambda b, h, q_idx, kv_idx: kv_idx < 64
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> prefix_lm = or_masks(prefix, causal)
    """
    _check_callables("or_masks", mask_mods)
    if mask_mods and all(isinstance(m, Mod) and m.kind == MASK for m in mask_mods):
        return _combine("or_", list(mask_mods), "or_mask")

    def or_mask(b, h, q_idx, kv_idx):
        result = b.new_zeros((), dtype=torch.bool)
        for mask in mask_mods:
            result = result | mask(b, h, q_idx, kv_idx)
        return result

    return or_mask


def _positional_arity(fn) -> int:
    if isinstance(fn, Mod):
        return 5 if fn.kind == SCORE else 4
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code.co_argcount - len(getattr(fn, "__defaults__", None) or ())
    return sum(1 for p in inspect.signature(fn).parameters.values()
               if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def as_mod(fn, kind: str = MASK, arg: str = "mask_mod") -> Mod:
    """``fn`` (a `Mod`, a Python mod, or ``noop_mask``) as a traced `Mod` of ``kind``."""
    if isinstance(fn, Mod):
        if fn.kind != kind:
            raise TypeError(f"{arg} must be a {kind}_mod, got a {fn.kind}_mod '{fn.name}'")
        return fn
    if not callable(fn):
        raise TypeError(f"{arg} must be a callable {kind}_mod or a flexattn Mod, got {type(fn).__name__}")
    if kind == MASK and is_noop_mask(fn):
        return Mod(MASK, ir.const(True), (), name="noop_mask", fn=fn)
    if fn is _sliced_mask_mod_error:
        _sliced_mask_mod_error(None, None, None, None)
    from flexattn import tracer

    trace = getattr(tracer, "trace", None)
    if trace is None:
        raise NotImplementedError(
            f"{arg}: tracing Python mods needs flexattn.trace, which is not available in this "
            "build; pass a flexattn Mod (e.g. from flexattn.mask_mod(text)) instead"
        )
    return trace(fn, kind=kind)


# ---------------------------------------------------------------------------------------------
# Index tables from tile flags (torch ops; any device)


def _ordered(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    step = max(1, _CPU_TILES_PER_STEP // max(C, 1))
    for r0 in range(0, flat.shape[0], step):
        s = flat[r0:r0 + step].to(torch.int32)
        before = torch.cumsum(s, -1, dtype=torch.int32) - s
        n = s.sum(-1, dtype=torch.int32)
        pos = torch.where(s.bool(), before, n[:, None] + cols - before)
        idx[r0:r0 + step].scatter_(-1, pos.long(), cols.expand_as(pos).contiguous())
        num[r0:r0 + step] = n
    return num.view(*lead, R), idx.view(*lead, R, C)


def _flags(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The 0/1 tile rows listed by (num, idx): [..., R, n_cols] bool (tile level, not elements)."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    cols = torch.where(valid, idx.long(), n_cols)
    flags = torch.zeros(*idx.shape[:-1], n_cols + 1, dtype=torch.bool, device=idx.device)
    flags.scatter_(-1, cols, True)
    return flags[..., :n_cols]


def _transpose_ordered(num: torch.Tensor, idx: torch.Tensor, n_cols: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed tables; ``n_cols`` is the number of KV tiles (default: idx's columns)."""
    return _ordered(_flags(num, idx, idx.shape[-1] if n_cols is None else n_cols).transpose(-2, -1))


def _tables_from_states(states: torch.Tensor, separate_full: bool):
    partial = states == interval.PARTIAL
    full = states == interval.FULL
    if not separate_full:
        partial = partial | full
    kv = _ordered(partial)
    q = _ordered(partial.transpose(-2, -1))
    if not separate_full:
        return (*kv, None, None, *q, None, None)
    fkv = _ordered(full)
    fq = _ordered(full.transpose(-2, -1))
    return (*kv, *fkv, *q, *fq)


# ---------------------------------------------------------------------------------------------
# Tile classification on the CPU (chunked torch ops)


def _classify_torch(mod: Mod, BD: int, HD: int, Q_LEN: int, KV_LEN: int, QB: int, KVB: int,
                    device: torch.device, use_interval: bool = True) -> torch.Tensor:
    """int8 tile states [BD, HD, nQ, nKV]: interval analysis, then exact evaluation of the rest."""
    n_q, n_kv = -(-Q_LEN // QB), -(-KV_LEN // KVB)
    i64 = torch.int64
    states = torch.empty(BD, HD, n_q, n_kv, dtype=torch.int8, device=device)
    b = torch.arange(BD, dtype=i64, device=device).view(BD, 1, 1, 1)
    h = torch.arange(HD, dtype=i64, device=device).view(1, HD, 1, 1)
    kv_lo = torch.arange(n_kv, dtype=i64, device=device) * KVB
    kv_hi = torch.clamp(kv_lo + KVB, max=KV_LEN) - 1
    kv_whole = (kv_lo + KVB <= KV_LEN).view(1, 1, 1, n_kv)
    summaries = {buf.index: interval.Summary.of(mod.buffers[buf.index]) for buf in ir.buffers_of(mod.ir)}
    rows_per_step = max(1, _CPU_TILES_PER_STEP // (n_kv * BD * HD))
    for r0 in range(0, n_q, rows_per_step):
        r1 = min(n_q, r0 + rows_per_step)
        q_lo = torch.arange(r0, r1, dtype=i64, device=device) * QB
        q_hi = torch.clamp(q_lo + QB, max=Q_LEN) - 1
        shape = (BD, HD, r1 - r0, n_kv)
        if use_interval:
            st = interval.tile_states(mod.ir, {
                "b": (b, b), "h": (h, h),
                "q_idx": (q_lo.view(1, 1, -1, 1), q_hi.view(1, 1, -1, 1)),
                "kv_idx": (kv_lo.view(1, 1, 1, -1), kv_hi.view(1, 1, 1, -1)),
            }, mod.buffers, summaries).expand(shape).clone()
            # Tiles cut by the sequence end hold padding (false): never full.
            whole = (q_lo + QB <= Q_LEN).view(1, 1, -1, 1) & kv_whole
            st[(st == interval.FULL) & ~whole] = interval.PARTIAL
        else:
            st = torch.full(shape, interval.UNKNOWN, dtype=torch.int8, device=device)
        _evaluate_unknown(mod, st, r0, Q_LEN, KV_LEN, QB, KVB)
        states[:, :, r0:r1] = st
    return states


def _evaluate_unknown(mod: Mod, st: torch.Tensor, r0: int, Q_LEN: int, KV_LEN: int, QB: int, KVB: int):
    """Evaluate the UNKNOWN tiles of ``st`` element by element (in place), a batch at a time."""
    unknown = (st == interval.UNKNOWN).nonzero()
    if unknown.numel() == 0:
        return
    device = st.device
    oq = torch.arange(QB, device=device).view(1, QB, 1)
    okv = torch.arange(KVB, device=device).view(1, 1, KVB)
    per_step = max(1, _CPU_ELEMENTS_PER_STEP // (QB * KVB))
    for u0 in range(0, unknown.shape[0], per_step):
        bb, hh, rr, cc = unknown[u0:u0 + per_step].unbind(1)
        q = (rr + r0).view(-1, 1, 1) * QB + oq
        kv = cc.view(-1, 1, 1) * KVB + okv
        keep = ir.evaluate(mod.ir, {
            "b": bb.view(-1, 1, 1).int(), "h": hh.view(-1, 1, 1).int(),
            "q_idx": q.clamp(max=Q_LEN - 1).int(), "kv_idx": kv.clamp(max=KV_LEN - 1).int(),
        }, mod.buffers, device=device)
        if Q_LEN % QB or KV_LEN % KVB:
            keep = keep & (q < Q_LEN) & (kv < KV_LEN)  # padding counts as masked out
        count = keep.expand(len(bb), QB, KVB).reshape(len(bb), -1).sum(1, dtype=torch.int32)
        new = torch.where(count == QB * KVB, interval.FULL, torch.where(count > 0, interval.PARTIAL, interval.EMPTY))
        st[bb, hh, rr, cc] = new.to(torch.int8)


# ---------------------------------------------------------------------------------------------
# Table validation


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
    tile is checked by `BlockMask.check_shape` when the mask meets its inputs (a sliced mask may
    have fewer rows). It does not check that a tile is listed once (a repeat is counted twice, as
    in torch). One host sync: call it once per mask, not per call.

    >>> nb = torch.tensor([[[4]]], dtype=torch.int32); idx = torch.tensor([[[[0, 1, 2, 3]]]], dtype=torch.int32)
    >>> validate_block_tables(nb, idx, seq_lengths=(16, 40), BLOCK_SIZE=16)
    Traceback (most recent call last):
    ...
    ValueError: kv_num_blocks[0, 0, 0] = 4 is out of range: expected 0 <= count <= 3 (KV_LEN 40 has 3 KV blocks of 16; kv_indices has 4 columns)
    """
    q_block, kv_block = _pair(BLOCK_SIZE)
    q_len, kv_len = (int(x) for x in seq_lengths)
    n_q, n_kv = -(-q_len // q_block), -(-kv_len // kv_block)
    tables = {"kv_num_blocks": kv_num_blocks, "kv_indices": kv_indices,
              "full_kv_num_blocks": full_kv_num_blocks, "full_kv_indices": full_kv_indices,
              "q_num_blocks": q_num_blocks, "q_indices": q_indices,
              "full_q_num_blocks": full_q_num_blocks, "full_q_indices": full_q_indices}
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

    # (counts, indices, tiles a row may list, what the tiles are)
    kv_what = f"KV_LEN {kv_len} has {n_kv} KV blocks of {kv_block}"
    q_what = f"Q_LEN {q_len} has {n_q} query blocks of {q_block}"
    groups = [("kv_num_blocks", "kv_indices", n_kv, kv_what), ("full_kv_num_blocks", "full_kv_indices", n_kv, kv_what),
              ("q_num_blocks", "q_indices", n_q, q_what), ("full_q_num_blocks", "full_q_indices", n_q, q_what)]
    checks = []
    for num_name, idx_name, tiles, what in groups:
        num, idx = tables[num_name], tables[idx_name]
        if (num is None) != (idx is None):
            raise ValueError(f"{num_name} and {idx_name} must both be given or both be None")
        if num is None:
            continue
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
        checks.append((num_name, idx_name, num, idx, bad_num, bad_idx, limit, tiles, what))
    if not checks:
        return
    # One host sync for every table.
    flags = torch.stack([torch.stack([c[4].any(), c[5].any()]) for c in checks]).tolist()
    for (num_name, idx_name, num, idx, bad_num, bad_idx, limit, tiles, what), (nb, ib) in zip(checks, flags):
        if nb:
            at = bad_num.nonzero()[0].tolist()
            raise ValueError(f"{num_name}{_entry(at)} = {int(num[tuple(at)])} is out of range: expected 0 <= count "
                             f"<= {limit} ({what}; {idx_name} has {idx.shape[-1]} columns)")
        if ib:
            at = bad_idx.nonzero()[0].tolist()
            raise ValueError(f"{idx_name}{_entry(at)} = {int(idx[tuple(at)])} is out of range: expected a block "
                             f"index in [0, {tiles}) ({what}; the entry is among the first "
                             f"{num_name}{_entry(at[:-1])} = {int(num[tuple(at[:-1])])} of its row)")


# ---------------------------------------------------------------------------------------------
# BlockMask


def _pair(BLOCK_SIZE, arg: str = "BLOCK_SIZE") -> tuple[int, int]:
    if isinstance(BLOCK_SIZE, int) and not isinstance(BLOCK_SIZE, bool):
        pair = (BLOCK_SIZE, BLOCK_SIZE)
    elif (isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in BLOCK_SIZE)):
        pair = (int(BLOCK_SIZE[0]), int(BLOCK_SIZE[1]))
    else:
        raise TypeError(f"{arg} must be an int or a (Q_BLOCK, KV_BLOCK) pair of ints, got {BLOCK_SIZE!r}")
    return pair


def _check_block_sizes(pair: tuple[int, int]) -> None:
    for name, v in zip(("query", "KV"), pair):
        if v < _MIN_BLOCK_SIZE or v & (v - 1):
            raise ValueError(
                f"BLOCK_SIZE: the {name} block size must be a power of two >= {_MIN_BLOCK_SIZE}, got {v}"
            )


def _seq_pair(seq_lengths) -> tuple[int, int]:
    if (not isinstance(seq_lengths, (tuple, list)) or len(seq_lengths) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in seq_lengths)):
        raise ValueError(f"seq_lengths must be a (Q_LEN, KV_LEN) pair of positive ints, got {seq_lengths!r}")
    return int(seq_lengths[0]), int(seq_lengths[1])


def _check_positive(name: str, value, allow_none: bool = False) -> int:
    if value is None and allow_none:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


class BlockMask:
    """Block-sparse attention mask in torch's format (see the module docstring).

    Example::

        >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 300, 300, "cpu", 128)
        >>> bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()  # the last row is cut at 300
        ([[[1, 1, 3]]], [[[0, 1, 0]]])
    """

    def __init__(self, seq_lengths: tuple[int, int], kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                 full_kv_num_blocks: torch.Tensor | None, full_kv_indices: torch.Tensor | None,
                 q_num_blocks: torch.Tensor | None, q_indices: torch.Tensor | None,
                 full_q_num_blocks: torch.Tensor | None, full_q_indices: torch.Tensor | None,
                 BLOCK_SIZE: int | tuple[int, int] = (_DEFAULT_SPARSE_BLOCK_SIZE, _DEFAULT_SPARSE_BLOCK_SIZE),
                 mask_mod: Callable = noop_mask, *, dq_write_order: torch.Tensor | None = None,
                 dq_write_order_full: torch.Tensor | None = None, dq_kv_order: torch.Tensor | None = None,
                 dq_kv_order_spt: bool | None = None, validate: bool = True):
        # The kernels follow these tables without bounds checks: check them once, here
        # (``validate=False`` only for tables this module built itself).
        if validate:
            validate_block_tables(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                  q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
                                  seq_lengths=_seq_pair(seq_lengths), BLOCK_SIZE=BLOCK_SIZE)
        self.seq_lengths = tuple(seq_lengths)
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        # torch 2.13's deterministic-dQ metadata for its FLASH backward: carried so that as_tuple()
        # and torch's flex_attention see torch's fields; flexattn's dQ pass (one program per query
        # tile, no atomics) is deterministic without it.
        if dq_write_order_full is not None and dq_write_order is None:
            raise ValueError("dq_write_order_full requires dq_write_order")
        self.dq_write_order = dq_write_order
        self.dq_write_order_full = dq_write_order_full
        self.dq_kv_order = dq_kv_order
        self.dq_kv_order_spt = dq_kv_order_spt
        self.BLOCK_SIZE = _pair(BLOCK_SIZE)
        self.mask_mod = mask_mod
        self._mod: Mod | None = mask_mod if isinstance(mask_mod, Mod) else None

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_kv_blocks(cls, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor,
                       full_kv_num_blocks: torch.Tensor | None = None,
                       full_kv_indices: torch.Tensor | None = None,
                       BLOCK_SIZE: int | tuple[int, int] = _DEFAULT_SPARSE_BLOCK_SIZE,
                       mask_mod: Callable | None = None, seq_lengths: tuple[int, int] | None = None,
                       compute_q_blocks: bool = True) -> "BlockMask":
        """A BlockMask from the forward tables; the transposed q_* tables are derived on device.

        Example::

            >>> nb = torch.tensor([[[1, 2]]], dtype=torch.int32)
            >>> idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
            >>> BlockMask.from_kv_blocks(nb, idx, BLOCK_SIZE=16).q_num_blocks.tolist()
            [[[2, 1]]]
        """
        block = _pair(BLOCK_SIZE)
        if seq_lengths is None:
            if not isinstance(kv_indices, torch.Tensor) or kv_indices.dim() < 2:
                # no lengths to default to: let the table checks say what is wrong with kv_indices
                validate_block_tables(kv_num_blocks, kv_indices, seq_lengths=(1, 1), BLOCK_SIZE=block)
            seq_lengths = (kv_indices.shape[-2] * block[0], kv_indices.shape[-1] * block[1])
        seq_lengths = _seq_pair(seq_lengths)
        # Before the transpose, which would follow bad indices too.
        validate_block_tables(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                              seq_lengths=seq_lengths, BLOCK_SIZE=block)
        n_kv = -(-seq_lengths[1] // block[1])  # the q_* tables have a row per KV block
        q_num = q_idx = fq_num = fq_idx = None
        if compute_q_blocks:
            q_num, q_idx = _transpose_ordered(kv_num_blocks, kv_indices, n_kv)
            if full_kv_num_blocks is not None:
                fq_num, fq_idx = _transpose_ordered(full_kv_num_blocks, full_kv_indices, n_kv)
        return cls(seq_lengths, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                   q_num, q_idx, fq_num, fq_idx, BLOCK_SIZE=block,
                   mask_mod=mask_mod if mask_mod is not None else noop_mask, validate=False)

    # -- views ----------------------------------------------------------------------------------

    def as_tuple(self, flatten: bool = True) -> tuple:
        """torch 2.13's 17 fields, in torch's order (what torch's flex_attention unpacks)::

            Q_LEN, KV_LEN, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
            q_num_blocks, q_indices, full_q_num_blocks, full_q_indices, dq_write_order,
            dq_write_order_full, dq_kv_order, dq_kv_order_spt, Q_BLOCK, KV_BLOCK, mask_mod

        With ``flatten=False`` the lengths and block sizes stay pairs (15 fields).

        Example::

            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, "cpu")
            >>> len(bm.as_tuple()), bm.as_tuple()[:2], bm.as_tuple()[-3:-1]
            (17, (256, 256), (128, 128))
        """
        seq = self.seq_lengths if flatten else (self.seq_lengths,)
        block = self.BLOCK_SIZE if flatten else (self.BLOCK_SIZE,)
        return (*seq, self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices,
                self.dq_write_order, self.dq_write_order_full, self.dq_kv_order, self.dq_kv_order_spt,
                *block, self.mask_mod)

    @classmethod
    def from_torch(cls, block_mask) -> "BlockMask":
        """A flexattn BlockMask with the tables of torch's ``BlockMask`` ``block_mask`` (shared, not copied).

        ``flexattn.flex_attention`` takes torch's BlockMask as it is; this is for flexattn's extras
        (``to_png``, ``adjust`` on any mask, tile states). Example::

            >>> from torch.nn.attention import flex_attention as tf
            >>> tbm = tf.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu")
            >>> BlockMask.from_torch(tbm).sparsity() == tbm.sparsity()
            True
        """
        if isinstance(block_mask, cls):
            return block_mask
        if not (hasattr(block_mask, "kv_num_blocks") and hasattr(block_mask, "as_tuple")):
            raise TypeError(f"block_mask must be a torch or flexattn BlockMask, got {type(block_mask).__name__}")
        extra = {name: getattr(block_mask, name, None)
                 for name in ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt")}
        return cls(tuple(block_mask.seq_lengths), block_mask.kv_num_blocks, block_mask.kv_indices,
                   block_mask.full_kv_num_blocks, block_mask.full_kv_indices, block_mask.q_num_blocks,
                   block_mask.q_indices, block_mask.full_q_num_blocks, block_mask.full_q_indices,
                   BLOCK_SIZE=tuple(block_mask.BLOCK_SIZE), mask_mod=block_mask.mask_mod, **extra)

    @property
    def shape(self) -> tuple[int, ...]:
        """(*batch dims, Q_LEN, KV_LEN)."""
        return tuple(self.kv_indices.shape[:-2]) + self.seq_lengths

    @property
    def mod(self) -> Mod:
        """``mask_mod`` as a traced `Mod` (what the kernels run)."""
        if self._mod is None:
            self._mod = as_mod(self.mask_mod)
        return self._mod

    def numel(self) -> int:
        return math.prod(self.shape)

    def sparsity(self) -> float:
        """Percentage of tiles that are skipped (torch's definition, padding included)."""
        computed = int(self.kv_num_blocks.sum())
        if self.full_kv_num_blocks is not None:
            computed += int(self.full_kv_num_blocks.sum())
        return 100 * (1 - computed * self.BLOCK_SIZE[0] * self.BLOCK_SIZE[1] / self.numel())

    def to_dense(self) -> torch.Tensor:
        """Tile-level dense mask [..., nQ, nKV] (int32 0/1): 1 where a tile is visited."""
        n_cols = self.kv_indices.shape[-1]
        dense = _flags(self.kv_num_blocks, self.kv_indices, n_cols)
        if self.full_kv_num_blocks is not None:
            dense = dense | _flags(self.full_kv_num_blocks, self.full_kv_indices, self.full_kv_indices.shape[-1])
        return dense.to(torch.int32)

    def tile_states(self) -> torch.Tensor:
        """[..., nQ, nKV] int8: 0 empty, 1 partial, 2 full."""
        n_cols = self.kv_indices.shape[-1]
        st = _flags(self.kv_num_blocks, self.kv_indices, n_cols).to(torch.int8)
        if self.full_kv_num_blocks is not None:
            full = _flags(self.full_kv_num_blocks, self.full_kv_indices, n_cols)
            st = torch.where(full, interval.FULL, st).to(torch.int8)
        return st

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """A text picture of the visited tiles, one per (batch, head) (torch's format).

        ``█`` visited, ``░`` partly visited (when several tiles share a character), blank skipped.
        ``grid_size=-1`` draws every tile.
        """
        dense = self.to_dense()
        *batch_dims, n_rows, n_cols = dense.shape
        if isinstance(grid_size, int) and grid_size == -1:
            max_rows, max_cols = n_rows, n_cols
        elif isinstance(grid_size, int):
            max_rows = max_cols = grid_size
        else:
            max_rows, max_cols = grid_size
        row_step = max(1, -(-n_rows // max_rows))
        col_step = max(1, -(-n_cols // max_cols))
        pictures = []
        for i, batch_idx in enumerate(itertools.product(*[range(d) for d in batch_dims])):
            if i == limit:
                pictures += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                             "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            m = dense[batch_idx].float()
            lines = [f"{batch_idx}"]
            for r in range(0, n_rows, row_step):
                line = ""
                for c in range(0, n_cols, col_step):
                    frac = m[r:r + row_step, c:c + col_step].mean().item()
                    line += ("█" if frac == 1 else " " if frac == 0 else "░") * 2
                lines.append(line)
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __str__(self) -> str:
        return (f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
                f"{self.to_string().strip()}\n)")

    def __repr__(self) -> str:
        def shape(t):
            return None if t is None else t.shape

        name = getattr(self.mask_mod, "__name__", self.mask_mod)
        fields = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                  "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]
        body = "".join(f"    {f}={shape(getattr(self, f))},\n" for f in fields)
        return (f"BlockMask(\n{body}    BLOCK_SIZE={self.BLOCK_SIZE},\n    shape={self.shape},\n"
                f"    sparsity={self.sparsity():.2f}%,\n    mask_mod={name}\n)")

    def __getitem__(self, index) -> "BlockMask":
        """Select batches / heads / query tiles (torch semantics: ints keep their dimension).

        Example::

            >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, 2, 4, 256, 256, "cpu", 64)
            >>> bm[1, 2:4].kv_num_blocks.shape
            torch.Size([1, 2, 4])
        """
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > 3:
            raise IndexError(f"BlockMask indexes at most (batch, head, query tile), got {len(index)} indices")
        padded = (*index, slice(None), slice(None), slice(None))[:3]
        sizes = self.kv_num_blocks.shape[:3]
        index = tuple(
            (slice(i + n, i + n + 1) if -n <= i < 0 else slice(i, i + 1)) if isinstance(i, int) else i
            for i, n in zip(padded, sizes)
        )
        full = (None, None)
        if self.full_kv_num_blocks is not None:
            full = (self.full_kv_num_blocks[index], self.full_kv_indices[index])
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks[index], self.kv_indices[index], *full, BLOCK_SIZE=self.BLOCK_SIZE,
            mask_mod=_sliced_mask_mod_error, seq_lengths=self.seq_lengths,
            compute_q_blocks=self.q_indices is not None,
        )

    def adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """Crop to the upper-left ``new_q_len x new_kv_len`` corner (reuse for shorter lengths).

        Keeps, in each remaining query-tile row, the listed tiles whose index is below the new
        KV-tile count; decode steps that attend a prefix of a longer cache use this. Like torch's
        ``_adjust`` (which flex_attention suggests), it re-evaluates nothing; unlike it, the counts
        are right for every mask, not only for masks whose rows start at tile 0.
        """
        _check_positive("new_q_len", new_q_len)
        _check_positive("new_kv_len", new_kv_len)
        rows = -(-new_q_len // self.BLOCK_SIZE[0])
        cols = -(-new_kv_len // self.BLOCK_SIZE[1])

        def crop(num, idx):
            flags = _flags(num[..., :rows], idx[..., :rows, :], max(idx.shape[-1], cols))[..., :cols]
            return _ordered(flags)

        kv = crop(self.kv_num_blocks, self.kv_indices)
        full = (None, None)
        if self.full_kv_num_blocks is not None:
            full = crop(self.full_kv_num_blocks, self.full_kv_indices)
        out = BlockMask.from_kv_blocks(*kv, *full, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                                       seq_lengths=(new_q_len, new_kv_len),
                                       compute_q_blocks=self.q_indices is not None)
        out._mod = self._mod
        return out

    _adjust = adjust  # torch's name (flex_attention's error message points users to it)

    def to(self, device: torch.device | str) -> "BlockMask":
        """A copy on ``device`` (the traced mod's captured tensors move too)."""
        def move(t):
            return None if t is None else t.to(device)

        out = BlockMask(self.seq_lengths, *(move(t) for t in self.as_tuple()[2:10]),
                        BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod, validate=False,
                        dq_write_order=move(self.dq_write_order), dq_write_order_full=move(self.dq_write_order_full),
                        dq_kv_order=move(self.dq_kv_order), dq_kv_order_spt=self.dq_kv_order_spt)
        if self._mod is not None:
            m = self._mod
            out._mod = Mod(m.kind, m.ir, [t.to(device) for t in m.buffers], m.name, m.source, m.fn)
        return out

    def check_shape(self, B: int, H: int, Q_LEN: int, KV_LEN: int) -> None:
        """Raise a ValueError unless this mask fits attention over [B, H, Q_LEN] x [.., KV_LEN]."""
        if self.kv_num_blocks.dim() != 3:
            raise ValueError(f"block_mask must have [B, H, n_q_tiles] tables, got kv_num_blocks of shape "
                             f"{tuple(self.kv_num_blocks.shape)}")
        if (Q_LEN, KV_LEN) != self.seq_lengths:
            hint = ("call block_mask._adjust(Q_LEN, KV_LEN) to crop it, or create a new one"
                    if Q_LEN <= self.seq_lengths[0] and KV_LEN <= self.seq_lengths[1]
                    else "create a new block mask for these lengths")
            raise ValueError(f"block_mask was created for (Q_LEN, KV_LEN) = {self.seq_lengths} but the "
                             f"inputs have ({Q_LEN}, {KV_LEN}); {hint}")
        n_q = -(-Q_LEN // self.BLOCK_SIZE[0])
        if self.kv_indices.shape[-2] < n_q:
            raise ValueError(f"block_mask has {self.kv_indices.shape[-2]} query-block rows but Q_LEN {Q_LEN} with "
                             f"query blocks of {self.BLOCK_SIZE[0]} needs {n_q} (a sliced mask cannot be used "
                             "for attention)")
        bm_b, bm_h = self.kv_num_blocks.shape[:2]
        if bm_b not in (1, B):
            raise ValueError(f"block_mask has batch size {bm_b}, expected 1 or the inputs' batch size {B}")
        if bm_h not in (1, H):
            raise ValueError(f"block_mask has {bm_h} heads, expected 1 or the query's {H} heads")

    # -- pictures ---------------------------------------------------------------------------------

    def to_png(self, path: str, batch: int = 0, head: int = 0, level: str = "auto") -> str:
        """Write a picture of (batch, head) to ``path``; see `flexattn.viz.to_png` (needs Pillow)."""
        from flexattn import viz

        return viz.to_png(self, path, batch=batch, head=head, level=level)


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
                      *, backend: str | None = None, use_interval: bool = True) -> BlockMask:
    """The BlockMask of ``mask_mod`` (torch 2.13's signature; ``device=None``: CUDA when available).

    ``B`` / ``H`` of None mean 1 (broadcast over batch / heads). A mask that ignores ``b`` or ``h``
    is classified once and repeated. ``backend``: "triton" (generated kernels; the GPU default,
    on CPU tensors it runs in Triton's interpreter) or "torch" (chunked torch ops, the CPU
    default). ``use_interval=False`` evaluates every tile element by element (for testing).
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
    Q_BLOCK, KV_BLOCK = _pair(BLOCK_SIZE)
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
        from flexattn import capture

        key, bufs = capture.capture(mask_mod, MASK, torch.float32)
        tables = _tables_op(bufs, key, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, separate_full_blocks,
                            device, backend, use_interval)
        if not separate_full_blocks:
            tables = [tables[0], tables[1], None, None, tables[2], tables[3], None, None]
        bm = BlockMask((Q_LEN, KV_LEN), *tables, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, validate=False)
        bm._flexattn_compiled_mask = (key, bufs)
        return bm
    mod = _resolve_mask(mask_mod, device)
    mod.check_device(device, arg="the block mask's device")
    tables = _build_tables(mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, separate_full_blocks, backend,
                           use_interval)
    bm = BlockMask((Q_LEN, KV_LEN), *tables, BLOCK_SIZE=(Q_BLOCK, KV_BLOCK), mask_mod=mask_mod, validate=False)
    bm._mod = mod
    return bm


def _resolve_mask(mask_mod, device: torch.device) -> Mod:
    """The traced mask, through the trace cache (a lambda made anew each call is traced once)."""
    from flexattn import modcache

    if isinstance(mask_mod, Mod) or not callable(mask_mod):
        return as_mod(mask_mod)  # checks the kind / raises the error that names the argument
    template, buffers = modcache.resolve(mask_mod, MASK, torch.float32, device, lambda f, kind, **kw: as_mod(f))
    return template if buffers is template.buffers else template.rebind(buffers)


def _build_tables(mod: Mod, B, H, Q_LEN: int, KV_LEN: int, Q_BLOCK: int, KV_BLOCK: int, device: torch.device,
                  separate_full: bool, backend: str, use_interval: bool) -> tuple:
    """The eight tables of ``mod``'s BlockMask (the full_* ones None unless ``separate_full``)."""
    used = {n.arg for n in ir.toposort(mod.ir) if n.op == "input"}
    BD = B if "b" in used else 1
    HD = H if "h" in used else 1
    if backend == "triton":
        from flexattn.codegen.block_mask_kernel import build_tables

        tables = build_tables(mod, BD, HD, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device,
                              separate_full=separate_full, use_interval=use_interval)
    else:
        states = _classify_torch(mod, BD, HD, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, use_interval)
        tables = _tables_from_states(states, separate_full)
    if (BD, HD) != (B, H):
        tables = tuple(None if t is None else t.expand(B, H, *t.shape[2:]).contiguous() for t in tables)
    return tables


@torch.library.custom_op("flexattn::block_mask_tables", mutates_args=())
def _tables_op(buffers: list[torch.Tensor], mask_key: str, B: int, H: int, Q_LEN: int, KV_LEN: int, Q_BLOCK: int,
               KV_BLOCK: int, separate_full: bool, device: torch.device, backend: str,
               use_interval: bool) -> list[torch.Tensor]:
    """`create_block_mask`'s tables as a custom op (torch.compile): the 8 tables, or the 4
    partial ones without ``separate_full``."""
    from flexattn.mods import template

    mod = template(mask_key).rebind(buffers)
    return [t for t in _build_tables(mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device, separate_full, backend,
                                     use_interval) if t is not None]


@_tables_op.register_fake
def _(buffers, mask_key, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, separate_full, device, backend, use_interval):
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
