"""Block tables of packed variable-length sequences, built on the device from cumulative offsets.

Sequence ``b`` owns query rows ``cu_q[b] <= t < cu_q[b + 1]`` and KV rows from ``k_start[b]``
on (``kv_len[b]`` of them). Row ``t`` of sequence ``b`` (position ``p = t - cu_q[b]`` in it) sees
the KV rows of an interval ``[lo[t], hi[t])``: its own sequence, cut by the window ``(left,
right)`` around the bottom-right aligned diagonal ``kv_len[b] - q_len[b] + p`` (FlashAttention's
convention; -1 is unbounded; ``(-1, 0)`` is causal). Both bounds are non-decreasing in ``t``
(a sequence's rows come after the previous one's KV), so a query block sees one run of KV blocks,
from the block of its first row's ``lo`` to that of its last row's ``hi``, and a KV block is seen
by one run of query blocks. The tables list those runs' blocks, explicitly (torch's BlockMask
layout), in tables whose width the caller bounds: nothing here is ``batch x max length`` and
nothing reads a value on the host.

A block is *full* (no mask work) when every row of the query block sees all of it: it lies in
``[lo[last row], hi[first row])``, the query block is not cut by the end of the queries and the
KV block not by the end of the keys.

Two layouts: *packed* (the kernels see one sequence of all tokens, rows ``t``) and *batched*
(the kernels see a batch of sequences, each with ``max_q`` padded query rows; for the decoding
kernel and paged K/V).
"""

from __future__ import annotations

import torch

from flexattn.kernels.tables import ordered

#: Rows of `packed_rows`' result.
SEQ, POS, K_START, LO, HI = range(5)


def _cdiv(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.div(x + (n - 1), n, rounding_mode="floor")


def _bounds(pos, q_len, k_first, kv_len, window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[lo, hi)``: the KV rows a query row at position ``pos`` of its sequence sees, counted
    from ``k_first`` (the sequence's first KV row); empty intervals have ``lo == hi``."""
    left, right = window
    k_end = k_first + kv_len
    diag = k_end - q_len + pos
    lo = k_first if left < 0 else torch.maximum(k_first, diag - left)
    hi = k_end if right < 0 else torch.minimum(k_end, diag + right + 1)
    return lo, torch.maximum(hi, lo)


def kv_lengths(cu_k: torch.Tensor, seqused_k: torch.Tensor | None) -> torch.Tensor:
    """Each sequence's KV length: ``seqused_k`` where given, else the offsets' differences."""
    return seqused_k if seqused_k is not None else cu_k[1:] - cu_k[:-1]


def packed_rows(cu_q: torch.Tensor, cu_k: torch.Tensor, seqused_k: torch.Tensor | None, T_q: int,
                window: tuple[int, int]) -> torch.Tensor:
    """[5, T_q] int32: per query row its sequence, position in it, the sequence's first KV row,
    and its KV interval ``[lo, hi)`` (rows `SEQ`, `POS`, `K_START`, `LO`, `HI`). Rows past the
    last offset see nothing."""
    device = cu_q.device
    N = cu_q.shape[0] - 1
    t = torch.arange(T_q, dtype=torch.int32, device=device)
    seq = (torch.searchsorted(cu_q, t, right=True, out_int32=True) - 1).clamp_(0, N - 1)
    s = seq.long()
    q_first, q_end = cu_q[s], cu_q[s + 1]
    k_first = cu_k[s]
    lo, hi = _bounds(t - q_first, q_end - q_first, k_first, kv_lengths(cu_k, seqused_k)[s], window)
    inside = t < q_end
    last = cu_k[N]
    lo = torch.where(inside, lo, last)
    hi = torch.where(inside, hi, last)
    return torch.stack([seq, t - q_first, k_first, lo, hi]).to(torch.int32)


def _lists(starts: torch.Tensor, width: int, n_tiles: int, states) -> tuple:
    """(num, idx, full num, full idx) of rows whose candidate blocks are ``starts[r] + j``,
    ``j < width``; ``states(cand)`` gives (partial, full) bool [R, width] of the candidates."""
    cand = starts[:, None] + torch.arange(width, dtype=starts.dtype, device=starts.device)
    partial, full = states(cand)
    out = []
    for sel in (partial, full):
        num, idx = ordered(sel)
        out += [num, (idx + starts[:, None]).clamp_(0, max(n_tiles - 1, 0)).to(torch.int32)]
    return tuple(out)


def block_runs(lo: torch.Tensor, hi: torch.Tensor, Q_LEN: int, KV_LEN: int, BQ: int, BK: int,
               full_blocks: bool) -> tuple[torch.Tensor, ...]:
    """Per query block of the rows' intervals ``lo``/``hi`` [..., Q_LEN]: the KV blocks it sees,
    ``[s, e)``, and of those the full ones, ``[fs, fe)`` (empty without ``full_blocks``)."""
    nQ = -(-Q_LEN // BQ)
    first = torch.arange(nQ, device=lo.device) * BQ
    last = (first + BQ).clamp_(max=Q_LEN) - 1
    s = torch.div(lo[..., first], BK, rounding_mode="floor")
    e = torch.maximum(_cdiv(hi[..., last], BK), s)
    if not full_blocks:
        zero = torch.zeros_like(s)
        return s, e, zero, zero
    fs = _cdiv(lo[..., last], BK)
    fe = torch.div(hi[..., first], BK, rounding_mode="floor").clamp_(max=KV_LEN // BK)
    some = (fe > fs) & (first + BQ <= Q_LEN)
    return s, e, torch.where(some, fs, 0), torch.where(some, fe, 0)


def packed_tables(rows: torch.Tensor, T_q: int, T_k: int, BQ: int, BK: int, kv_width: int, q_width: int,
                  full_blocks: bool) -> dict:
    """The BlockMask fields (``kv_*``, ``q_*`` and their ``full_*`` twins, [1, 1, rows, width])
    of the packed layout: ``kv_width`` / ``q_width`` bound the KV blocks one query block sees
    and the query blocks that see one KV block."""
    nQ, nKV = -(-T_q // BQ), -(-T_k // BK)
    s, e, fs, fe = block_runs(rows[LO], rows[HI], T_q, T_k, BQ, BK, full_blocks)

    def kv_states(c):
        full = (c >= fs[:, None]) & (c < fe[:, None])
        return (c < e[:, None]) & ~full, full

    c = torch.arange(nKV, dtype=e.dtype, device=e.device)

    def q_states(r):
        at = r.clamp(max=nQ - 1)
        full = (r < nQ) & (fs[at] <= c[:, None]) & (c[:, None] < fe[at])
        seen = (r < nQ) & (s[at] <= c[:, None]) & (c[:, None] < e[at])
        return seen & ~full, full

    kv = _lists(s, kv_width, nKV, kv_states)
    q = _lists(torch.searchsorted(e, c, right=True), q_width, nQ, q_states)
    fields = {}
    for prefix, (num, idx, full_num, full_idx) in (("kv", kv), ("q", q)):
        fields[f"{prefix}_num_blocks"], fields[f"{prefix}_indices"] = num[None, None], idx[None, None]
        fields[f"full_{prefix}_num_blocks"] = full_num[None, None] if full_blocks else None
        fields[f"full_{prefix}_indices"] = full_idx[None, None] if full_blocks else None
    return fields


def batched_rows(cu_q: torch.Tensor, kv_len: torch.Tensor, max_q: int,
                 window: tuple[int, int]) -> torch.Tensor:
    """[2, N, max_q] int32: the KV interval ``[lo, hi)`` (positions in the sequence) of query row
    ``r`` of sequence ``b`` in the batched layout; padding rows (``r >= q_len[b]``) see nothing
    (the empty interval at the sequence's end, which keeps the bounds non-decreasing)."""
    q_len = (cu_q[1:] - cu_q[:-1])[:, None]
    pos = torch.arange(max_q, dtype=torch.int32, device=cu_q.device)[None, :]
    end = kv_len[:, None]
    lo, hi = _bounds(pos, q_len, torch.zeros_like(q_len), end, window)
    inside = pos < q_len
    return torch.stack([torch.where(inside, lo, end), torch.where(inside, hi, end)]).to(torch.int32)


def batched_tables(bounds: torch.Tensor, k_first: torch.Tensor | None, block_table: torch.Tensor | None,
                   max_q: int, KV_LEN: int, BQ: int, BK: int, width: int) -> dict:
    """The ``kv_*`` BlockMask fields [N, 1, nQ, width] of the batched layout: query block ``r``
    of sequence ``b`` visits the blocks of its rows' intervals, ``k_first[b]`` rows into the
    packed keys, or through the page table ``block_table`` (pages of ``BK`` rows). All partial."""
    N = bounds.shape[1]
    nQ, n_tiles = -(-max_q // BQ), -(-KV_LEN // BK)
    lo, hi = bounds[0], bounds[1]
    if k_first is not None:
        lo, hi = lo + k_first[:, None], hi + k_first[:, None]
    s, e, _, _ = block_runs(lo, hi, max_q, KV_LEN, BQ, BK, False)
    s, e = s.reshape(-1), e.reshape(-1)
    n_listed = n_tiles if block_table is None else block_table.shape[1]
    num, idx, _, _ = _lists(s, width, n_listed, lambda c: (c < e[:, None], torch.zeros_like(c, dtype=torch.bool)))
    if block_table is not None:
        seq = torch.arange(N, device=idx.device).repeat_interleave(nQ)[:, None]
        idx = block_table[seq, idx.long()].clamp_(0, max(n_tiles - 1, 0))
    return {"kv_num_blocks": num.view(N, 1, nQ), "kv_indices": idx.to(torch.int32).view(N, 1, nQ, width)}
