"""`varlen_attention`: packed variable-length sequences, with score and mask mods.

torch 2.13's ``torch.nn.attention.varlen.varlen_attn`` arguments and meaning (FlashAttention's
varlen semantics), plus ``score_mod`` / ``mask_mod`` in which ``b`` is the sequence's index and
``q_idx`` / ``kv_idx`` are positions inside that sequence::

    out = varlen_attention(q, k, v, cu_seq, cu_seq, max_len, max_len, window_size=(-1, 0))
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=AuxRequest(lse=True),
                                score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[b, h])

How a call runs: the packed ``(T, H, D)`` tensors are the kernels' batch-1 sequence ``(1, H, T,
D)`` (a permuted view), and the block tables are built on the device from the offsets
(`flexattn.block_mask.packed`): each query block visits only the KV blocks its rows' sequences
reach. Short queries (``max_q`` below the decoding threshold, no gradient) and paged K/V take
the *batched* layout instead: each sequence's queries gathered into ``max_q`` rows of a batch,
against the keys (or pages) of its own sequence, through the split-KV decoding kernel (the forward kernel for
float64, and for paged K/V with long queries). Mods are
rewritten over either layout by wrappers that read the per-row tables. Tables are made once per
offsets tensor (and its in-place version); a call whose offsets were seen costs a lookup.
"""

from __future__ import annotations

from typing import Callable

import torch

from flexattn import call, modcache
from flexattn.block_mask import BlockMask, as_mod
from flexattn.block_mask import packed
from flexattn.block_mask.sizes import _DEFAULT_SPARSE_BLOCK_SIZE
from flexattn.kernels import decode as dec, plans
from flexattn.lru import LRU
from flexattn.mods import MASK

#: Sparse block size (query rows, KV rows) of the packed layout's tables.
BLOCK_SIZE = (_DEFAULT_SPARSE_BLOCK_SIZE, _DEFAULT_SPARSE_BLOCK_SIZE)


# ---------------------------------------------------------------------------------------------
# Host checks: types, shapes, dtypes, devices


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"


def _check_offsets(name: str, t, device: torch.device, length: int | None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.device != device \
            or t.shape[0] < 1 or (length is not None and t.shape[0] != length):
        size = "N + 1" if length is None else f"{length} (N + 1, as cu_seq_q)"
        raise ValueError(f"{name} must be a 1-d int32 tensor of {size} cumulative offsets on {device}, "
                         f"got {_describe(t)}")


def _check_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {_describe(v)}")


def _check_window(window_size) -> tuple[int, int]:
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a (left, right) pair of ints >= -1 (-1: unbounded), "
                         f"got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table, enable_gqa):
    """Types, shapes, dtypes and devices (nothing that needs the tensors' values)."""
    if not isinstance(query, torch.Tensor) or query.dim() != 3:
        raise ValueError(f"query must be a (T_q, H_q, D) tensor, got {_describe(query)}")
    paged = block_table is not None
    kv_dims = "(total_pages, page_size, H_kv, D) tensor (block_table is given)" if paged else "(T_k, H_kv, D) tensor"
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != (4 if paged else 3):
            raise ValueError(f"{name} must be a {kv_dims}, got {_describe(t)}")
        if t.device != query.device or t.dtype != query.dtype:
            raise ValueError(f"{name} must be a {query.dtype} tensor on {query.device} like query, got "
                             f"{_describe(t)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in all but the "
                         "last dimension")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"key's head dim {key.shape[-1]} must equal query's {query.shape[-1]}")
    hq, hkv = query.shape[1], key.shape[-2]
    if (not enable_gqa and hq != hkv) or (enable_gqa and (hkv == 0 or hq % hkv)):
        want = "a divisor of H_q (enable_gqa=True)" if enable_gqa else "H_q (or pass enable_gqa=True)"
        raise ValueError(f"key/value must have {want} heads; query has H_q={hq}, key H_kv={hkv}")
    _check_offsets("cu_seq_q", cu_seq_q, query.device, None)
    n = cu_seq_q.shape[0]
    if cu_seq_k is not None or not paged:
        _check_offsets("cu_seq_k", cu_seq_k, query.device, n)
    _check_int("max_q", max_q)
    _check_int("max_k", max_k)
    if seqused_k is not None and not (isinstance(seqused_k, torch.Tensor) and seqused_k.shape == (n - 1,)
                                      and seqused_k.dtype == torch.int32 and seqused_k.device == query.device):
        raise ValueError(f"seqused_k must be a 1-d int32 tensor of N = {n - 1} lengths on {query.device}, got "
                         f"{_describe(seqused_k)}")
    if paged:
        if seqused_k is None:
            raise ValueError("block_table needs seqused_k (the number of valid KV tokens of each sequence)")
        if not (isinstance(block_table, torch.Tensor) and block_table.dim() == 2 and block_table.shape[0] == n - 1
                and block_table.dtype == torch.int32 and block_table.device == query.device):
            raise ValueError(f"block_table must be a (N = {n - 1}, max_pages) int32 tensor on {query.device}, "
                             f"got {_describe(block_table)}")
        page_size = key.shape[1]
        if page_size % 16 or key.stride(0) != page_size * key.stride(1) \
                or value.stride(0) != page_size * value.stride(1):
            raise ValueError(f"paged key/value need a page size that is a multiple of 16 and pages whose "
                             f"rows are evenly spaced (stride(0) == page_size * stride(1)); got page_size "
                             f"{page_size}, key strides {key.stride()}, value strides {value.stride()}")


# ---------------------------------------------------------------------------------------------
# Value checks: on the CPU at once, on a GPU without waiting (torch._assert_async)


def _value_checks(cu_q, cu_k, seqused_k, block_table, max_q, max_k, T_q, T_k, page_size) -> list[tuple]:
    """``(bad, where)`` pairs: ``bad`` a bool tensor flagging offending entries, ``where(i)``
    the error message for entry ``i`` (None: the message needs no index)."""
    out = []
    for name, cu, total, most, size in (("cu_seq_q", cu_q, T_q, max_q, "query"), ("cu_seq_k", cu_k, T_k, max_k, "key")):
        if cu is None or (name == "cu_seq_k" and block_table is not None):
            continue
        lengths = cu[1:] - cu[:-1]
        out += [
            (cu[:1] != 0, lambda i, n=name, c=cu: f"{n} must start at 0, got {n}[0] = {int(c[0])}"),
            (lengths < 0, lambda i, n=name, c=cu: f"{n} must be non-decreasing (cumulative lengths), got "
                                                 f"{n}[{i}] = {int(c[i])} > {n}[{i + 1}] = {int(c[i + 1])}"),
            (cu[-1:] > total, lambda i, n=name, c=cu, t=total, s=size:
                f"{n}[-1] = {int(c[-1])} is past {s}'s {t} tokens; expected a last offset <= {t}"),
            (lengths > most, lambda i, n=name, c=cu, m=most, a=f"max_{size[0]}":
                f"sequence {i} has {int(c[i + 1] - c[i])} {n[-1]} tokens, more than {a}={m}; expected {a} >= "
                "every sequence's length"),
        ]
    if seqused_k is not None:
        cap = (cu_k[1:] - cu_k[:-1]) if block_table is None else \
            torch.full_like(seqused_k, min(max_k, block_table.shape[1] * page_size))
        what = "its cu_seq_k length" if block_table is None else \
            f"min(max_k, max_pages * page_size) = {min(max_k, block_table.shape[1] * page_size)}"
        out.append(((seqused_k < 0) | (seqused_k > cap), lambda i, c=cap, w=what:
                    f"seqused_k[{i}] = {int(seqused_k[i])} is out of range: expected 0 <= seqused_k <= {w} "
                    f"({int(c[i])})"))
    return out


def _run_checks(checks: list[tuple], device: torch.device) -> None:
    """CPU values are checked here (an error names the first offending entry); on a GPU and
    under torch.compile each check is a device-side assert, ``torch._assert_async``: it costs no
    host synchronisation, and a failure stops the CUDA context with the message (debugging)."""
    if device.type == "cpu" and not torch.compiler.is_compiling():
        for bad, where in checks:
            found = bad.nonzero()
            if found.numel():
                raise ValueError(where(int(found[0, 0])))
        return
    for bad, where in checks:
        torch._assert_async(~bad.any(), "varlen_attention: bad offsets (run on the CPU for the exact entry)")


def _logical_pages(block_table: torch.Tensor, seqused_k: torch.Tensor, page_size: int, n_pages: int,
                   device: torch.device) -> tuple[torch.Tensor, tuple]:
    """[n_pages] int32: the logical page index of each physical page (-1: unused), and the
    checks that the page table's used entries name pages and give each page one logical index
    (pages shared between sequences, as prefix caching shares them, sit at the same index)."""
    N, width = block_table.shape
    j = torch.arange(width, dtype=torch.int32, device=device)[None, :].expand(N, width)
    used = j < packed._cdiv(seqused_k, page_size)[:, None]
    in_range = (block_table >= 0) & (block_table < n_pages)
    target = torch.where(used & in_range, block_table, n_pages).long()
    logical = torch.full((n_pages + 1,), -1, dtype=torch.int32, device=device)
    logical.scatter_(0, target.reshape(-1), j.reshape(-1))
    consistent = logical[target] == j
    bad_range = (used & ~in_range).any(1)
    bad_share = (used & in_range & ~consistent).any(1)
    checks = [
        (bad_range, lambda i: f"block_table[{i}] lists a page outside [0, {n_pages}) among its used pages"),
        (bad_share, lambda i: f"block_table[{i}] lists a page that another sequence lists at another logical "
                              "page index; pages may be shared only at the same logical position"),
    ]
    return logical[:n_pages], checks


# ---------------------------------------------------------------------------------------------
# Layouts: the per-row tables, the BlockMask, made once per offsets tensor version


class _Layout:
    """What a call of given offsets needs besides the mods: the kernels' block mask (with
    the no-op mask_mod: a call brings its own), and the per-row tables the mod wrappers read."""

    __slots__ = ("sources", "block_mask", "rows", "extra")

    def __init__(self, sources, block_mask, rows, extra):
        self.sources, self.block_mask, self.rows, self.extra = sources, block_mask, rows, extra


# (layout key) -> _Layout. Bound: a layout holds int32 tables of O(tokens) entries.
_LAYOUTS = LRU(64)


def _version(t) -> tuple:
    """A layout key's part for an offsets tensor: its identity and in-place version (`_layout`
    does not cache an inference tensor's, which keeps no version)."""
    if t is None or torch.compiler.is_compiling():  # (no cache under torch.compile)
        return None, None
    return (id(t), None) if t.is_inference() else (id(t), t._version)


def _packed_layout(query, key, cu_q, cu_k, seqused_k, max_q, max_k, window, full_blocks) -> _Layout:
    T_q, T_k = query.shape[0], key.shape[0]
    BQ, BK = BLOCK_SIZE
    nQ, nKV = -(-T_q // BQ), -(-T_k // BK)
    same = cu_q is cu_k
    # With the same offsets for queries and keys a query block's rows and the keys they see lie
    # within max_q of its ends (and likewise for a KV block): the tables' widths follow.
    kv_width = min(nKV, -(-(BQ + 2 * max_q) // BK) + 1) if same else nKV
    q_width = min(nQ, -(-(BK + 2 * max_k) // BQ) + 1) if same else nQ
    _run_checks(_value_checks(cu_q, cu_k, seqused_k, None, max_q, max_k, T_q, T_k, 0), query.device)
    with torch.no_grad():
        rows = packed.packed_rows(cu_q, cu_k, seqused_k, T_q, window)
        fields = packed.packed_tables(rows, T_q, T_k, BQ, BK, max(kv_width, 1), max(q_width, 1), full_blocks)
    block_mask = BlockMask((T_q, T_k), **fields, BLOCK_SIZE=(BQ, BK), validate=False)
    return _Layout((cu_q, cu_k, seqused_k), block_mask, tuple(rows), ())


def _batched_layout(query, key, cu_q, cu_k, seqused_k, block_table, max_q, max_k, window) -> _Layout:
    device = query.device
    paged = block_table is not None
    T_q = query.shape[0]
    page_size = key.shape[1] if paged else 0
    KV_LEN = key.shape[0] * page_size if paged else key.shape[0]
    BQ, BK = (BLOCK_SIZE[0], page_size) if paged else BLOCK_SIZE
    checks = _value_checks(cu_q, cu_k, seqused_k, block_table, max_q, max_k, T_q, KV_LEN, page_size)
    with torch.no_grad():
        kv_len = packed.kv_lengths(cu_k, seqused_k)
        bounds = packed.batched_rows(cu_q, kv_len, max_q, window)
        if paged:
            logical, page_checks = _logical_pages(block_table, seqused_k, page_size, key.shape[0], device)
            checks += page_checks
            width = max(1, min(-(-max_k // page_size), block_table.shape[1]))
            fields = packed.batched_tables(bounds, None, block_table, max_q, KV_LEN, BQ, BK, width)
            extra = (logical,)
        else:
            k_first = cu_k[:-1]
            fields = packed.batched_tables(bounds, k_first, None, max_q, KV_LEN, BQ, BK, -(-max_k // BK) + 1)
            extra = (k_first,)
        # Per packed query row: its sequence and position, to gather and scatter.
        t = torch.arange(T_q, dtype=torch.int32, device=device)
        seq = (torch.searchsorted(cu_q, t, right=True, out_int32=True) - 1).clamp_(0, cu_q.shape[0] - 2)
        inside = t < cu_q[-1]
        where = (seq, torch.where(inside, t - cu_q[seq.long()], 0), inside)
    _run_checks(checks, device)
    block_mask = BlockMask((max_q, KV_LEN), fields["kv_num_blocks"], fields["kv_indices"], None, None, None, None,
                           None, None, BLOCK_SIZE=(BQ, BK), validate=False)
    return _Layout((cu_q, cu_k, seqused_k, block_table), block_mask, (bounds[0], bounds[1]), extra + where)


def _layout(make, key: tuple, sources: tuple) -> _Layout:
    """The cached layout of ``key`` (offsets by identity and in-place version), or a new one.
    Under torch.compile, and for offsets made under torch.inference_mode, there is no cache: the
    tables are made each call."""
    if torch.compiler.is_compiling() or any(s is not None and s.is_inference() for s in sources):
        return make()  # (an inference tensor keeps no version to key a cached layout by)
    layout = _LAYOUTS.get(key)
    if layout is not None and all(a is b for a, b in zip(layout.sources, sources)):
        return layout
    layout = _LAYOUTS[key] = make()
    return layout


# ---------------------------------------------------------------------------------------------
# Mods over the layouts (traced once per fingerprint like any Python mod)


def _packed_mods(score_mod, mask_mod, rows) -> tuple[Callable | None, Callable]:
    """The user's mods over the packed layout: ``b``, ``q_idx`` and ``kv_idx`` from the row
    tables, and the rows' KV intervals as the mask."""
    seq, pos, k_first, lo, hi = rows

    def varlen_mask(b, h, q_idx, kv_idx):
        keep = (kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])
        if mask_mod is None:
            return keep
        return keep & mask_mod(seq[q_idx], h, pos[q_idx], kv_idx - k_first[q_idx])

    def varlen_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, seq[q_idx], h, pos[q_idx], kv_idx - k_first[q_idx])

    return (None if score_mod is None else varlen_score), varlen_mask


def _batched_mods(score_mod, mask_mod, rows, extra, page_size: int) -> tuple[Callable | None, Callable]:
    """The user's mods over the batched layout (``b`` is the sequence): ``kv_idx`` made a
    position in the sequence, from its first packed key or through the pages' logical index."""
    lo, hi = rows
    table = extra[0]

    if page_size:
        def position(b, kv_idx):
            return table[kv_idx // page_size] * page_size + kv_idx % page_size
    else:
        def position(b, kv_idx):
            return kv_idx - table[b]

    def varlen_mask(b, h, q_idx, kv_idx):
        kv = position(b, kv_idx)
        keep = (kv >= lo[b, q_idx]) & (kv < hi[b, q_idx])
        if mask_mod is None:
            return keep
        return keep & mask_mod(b, h, q_idx, kv)

    def varlen_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, position(b, kv_idx))

    return (None if score_mod is None else varlen_score), varlen_mask


def _mask_override(mask, device: torch.device):
    """Eagerly the mask as (template, tensors) through the trace cache; under torch.compile None:
    the block mask carries it to `flexattn.capture`."""
    if torch.compiler.is_compiling():
        return None
    return modcache.resolve(mask, MASK, torch.float32, device, lambda f, kind, **kw: as_mod(f, MASK, "mask_mod"))


def _with_mask(block_mask: BlockMask, mask) -> BlockMask:
    """Under torch.compile, the layout's block mask carrying ``mask`` (eagerly it is passed apart)."""
    if not torch.compiler.is_compiling():
        return block_mask
    return BlockMask(block_mask.seq_lengths, *block_mask.as_tuple()[2:10], BLOCK_SIZE=block_mask.BLOCK_SIZE,
                     mask_mod=mask, validate=False)


# ---------------------------------------------------------------------------------------------
# Entry point


def _needs_grad(query, key, value, score_mod) -> bool:
    if not torch.is_grad_enabled():
        return False
    if query.requires_grad or key.requires_grad or value.requires_grad:
        return True
    if score_mod is None:
        return False
    if torch.compiler.is_compiling():
        return True  # (the captured tensors are not known before capture: the path that has a backward)
    return any(t.requires_grad for t in modcache.fingerprint(score_mod)[1])


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor | None, max_q: int, max_k: int, *, return_aux=None,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                     seqused_k: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     score_mod: Callable | None = None, mask_mod: Callable | None = None,
                     sinks: torch.Tensor | None = None):
    """Attention over packed variable-length sequences (torch 2.13's ``varlen_attn``), with mods.

    ``query`` is (T_q, H_q, D), ``key`` / ``value`` (T_k, H_kv, D) / (T_k, H_kv, Dv): sequence
    ``b`` is rows ``cu_seq_q[b]:cu_seq_q[b + 1]`` of query and ``cu_seq_k[b]:cu_seq_k[b + 1]`` of
    key and value (``cu_seq_*``: int32 [N + 1], from 0, non-decreasing; empty sequences allowed).
    ``max_q`` / ``max_k`` bound the sequences' lengths. ``window_size=(left, right)``: query row
    ``i`` of a sequence sees key ``j`` when ``i + (L_k - L_q) - left <= j <= i + (L_k - L_q) +
    right`` (-1: unbounded), aligned to the bottom right as FlashAttention; ``(-1, 0)`` is causal.
    ``seqused_k`` [N]: only the first ``seqused_k[b]`` keys of each sequence are used.
    ``block_table`` [N, max_pages] (with ``seqused_k``): key / value are a pool of pages
    (total_pages, page_size, H_kv, D) and sequence ``b``'s logical page ``j`` is page
    ``block_table[b, j]``; no gradients through this form (as torch).

    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` see ``b`` as
    the sequence's index and ``q_idx`` / ``kv_idx`` as positions inside it; captured tensors and
    their gradients as in `flexattn.flex_attention`. ``sinks`` [H_q]: attention sinks, as in
    `flexattn.flex_attention`. Returns ``out`` (T_q, H_q, Dv); with ``return_aux`` asking for
    ``lse`` (torch's or flexattn's ``AuxRequest``) ``(out, lse)``, lse (T_q, H_q) float32 natural
    log. A row that sees no key gives output 0 and LSE -inf (``sinks[h]`` with sinks).

    >>> cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    >>> q, k, v = (torch.randn(10, 2, 16) for _ in range(3))
    >>> varlen_attention(q, k, v, cu, cu, 7, 7, window_size=(-1, 0)).shape
    torch.Size([10, 2, 16])
    """
    _check_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table, enable_gqa)
    window = _check_window(window_size)
    if return_aux is not None and not hasattr(return_aux, "lse"):
        raise TypeError(f"return_aux must be an AuxRequest (torch's or flexattn's) or None, got "
                        f"{type(return_aux).__name__}")
    if return_aux is not None and getattr(return_aux, "max_scores", False):
        raise ValueError("varlen_attention's return_aux computes lse only (as torch's varlen_attn); "
                         "AuxRequest(max_scores=True) is not supported here")
    want_lse = return_aux is not None and bool(return_aux.lse)
    paged = block_table is not None
    need_grad = _needs_grad(query, key, value, score_mod) or (
        sinks is not None and sinks.requires_grad and torch.is_grad_enabled())
    if paged and need_grad:
        raise ValueError("block_table (paged key/value) is inference-only: no gradients (call it under "
                         "torch.no_grad(), or pass packed key/value with cu_seq_k for training)")
    T_q, Hq, Dv = query.shape[0], query.shape[1], value.shape[-1]
    if T_q == 0 or cu_seq_q.shape[0] == 1 or max_q == 0 or (not paged and key.shape[0] == 0):
        # no query sees a key: the same checks as every call, zeros that autograd can follow
        page_size = key.shape[1] if paged else 0
        _run_checks(_value_checks(cu_seq_q, cu_seq_k, seqused_k, block_table, max_q, max_k, T_q,
                                  key.shape[0] * page_size if paged else key.shape[0], page_size), query.device)
        plans.check_sinks(sinks, query.permute(1, 0, 2).unsqueeze(0))
        out = _NoKeys.apply(T_q, Hq, Dv, query, key, value, sinks) if need_grad else query.new_zeros(T_q, Hq, Dv)
        lse = torch.full((T_q, Hq), float("-inf"), dtype=torch.float32, device=query.device)
        if sinks is not None:  # (a row that sees no key: its LSE is the sink's)
            lse = torch.maximum(lse, sinks.to(lse.dtype))
        return (out, lse) if want_lse else out
    if paged or (not need_grad and max_q < dec.Q_THRESHOLD):
        return _batched(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, enable_gqa,
                        seqused_k, block_table, score_mod, mask_mod, want_lse, sinks)
    full_blocks = mask_mod is None
    layout = _layout(lambda: _packed_layout(query, key, cu_seq_q, cu_seq_k, seqused_k, max_q, max_k, window,
                                            full_blocks),
                     ("packed", *_version(cu_seq_q), *_version(cu_seq_k), *_version(seqused_k), T_q,
                      key.shape[0], max_q, max_k, window, BLOCK_SIZE, full_blocks, query.device),
                     (cu_seq_q, cu_seq_k, seqused_k))
    score, mask = _packed_mods(score_mod, mask_mod, layout.rows)
    q4, k4, v4 = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
    out, lse, _ = call.attend(q4, k4, v4, score, _with_mask(layout.block_mask, mask), scale, enable_gqa, None,
                              False, False, mask_override=_mask_override(mask, query.device), sinks=sinks)
    out = out[0].permute(1, 0, 2)
    return (out, lse[0].t()) if want_lse else out


class _NoKeys(torch.autograd.Function):
    """The output of a call in which no query sees a key: zeros, and zero gradients for query,
    key, value and sinks."""

    @staticmethod
    def forward(ctx, T_q, Hq, Dv, query, key, value, sinks):
        ctx.metas = [None if t is None else (t.shape, t.dtype, t.device) for t in (query, key, value, sinks)]
        return query.new_zeros(T_q, Hq, Dv)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *(None if m is None else torch.zeros(m[0], dtype=m[1], device=m[2])
                                    for m in ctx.metas))


def _batched(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, enable_gqa, seqused_k,
             block_table, score_mod, mask_mod, want_lse, sinks):
    """The batched layout: each sequence's queries gathered into ``max_q`` rows; the decoding
    kernel for short queries, the forward kernel for long ones over paged K/V."""
    paged = block_table is not None
    page_size = key.shape[1] if paged else 0
    layout = _layout(lambda: _batched_layout(query, key, cu_seq_q, cu_seq_k, seqused_k, block_table, max_q, max_k,
                                             window),
                     ("batched", *_version(cu_seq_q), *_version(cu_seq_k), *_version(seqused_k),
                      *_version(block_table), query.shape[0], key.shape[0], page_size, max_q, max_k, window,
                      BLOCK_SIZE, query.device),
                     (cu_seq_q, cu_seq_k, seqused_k, block_table))
    seq, pos, inside = layout.extra[-3:]
    score, mask = _batched_mods(score_mod, mask_mod, layout.rows, layout.extra, page_size)
    rows = (cu_seq_q[:-1, None].long() + torch.arange(max_q, device=query.device)).clamp_(max=query.shape[0] - 1)
    q4 = query[rows].permute(0, 2, 1, 3)                             # (N, H_q, max_q, D)
    if paged:
        k4, v4 = (t.permute(2, 0, 1, 3).flatten(1, 2).unsqueeze(0) for t in (key, value))
    else:
        k4, v4 = (t.permute(1, 0, 2).unsqueeze(0) for t in (key, value))
    out, lse, _ = call.attend(q4, k4, v4, score, _with_mask(layout.block_mask, mask), scale, enable_gqa, None,
                              False, max_q < dec.Q_THRESHOLD and query.dtype in dec.SUPPORTED_DTYPES,
                              mask_override=_mask_override(mask, query.device),
                              want_lse=want_lse, sinks=sinks)
    s, p = seq.long(), pos.long()
    out = torch.where(inside[:, None, None], out.permute(0, 2, 1, 3)[s, p], 0).to(query.dtype)
    if not want_lse:
        return out
    # (rows outside every sequence see no key: LSE -inf, or the sink's)
    outside = float("-inf") if sinks is None else sinks.to(lse.dtype)
    return out, torch.where(inside[:, None], lse.permute(0, 2, 1)[s, p], outside)
