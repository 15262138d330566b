"""The ring: K/V shards travel rank to rank by point-to-point sends, overlapped with the compute.

At step s rank r holds KV shard j = (r - s) mod P. Shard j is last needed at step ``last[j]``
(the largest s whose holder (j + s) mod P reads it, from the agreed ``needs`` table), so it
travels only up to there: a step whose pair is empty computes nothing, and a transfer that no
later rank needs is not made. Only shard j's *window* travels, the KV blocks that ranks other
than its owner read (``windows[j]``; a sliding window reads a band of its neighbour's shard),
and a step computes, merges and sums only the query rows that read the shard it holds
(``rows[j]``; there, the first rows of the next shard).
Every rank derives the same schedule from ``needs`` and ``windows``, so sends and receives
always pair up.

Forward: each step posts the next shard's transfer (double buffers), computes the current one,
and merges the partial (out, lse) by log-sum-exp. Backward: the K/V travel again, with the dK/dV
partial sums of each shard's window following them (from the first rank after its owner); a
window's sums go home (to the rank that owns the shard) from the last rank that reads it and are
added there to the owner's own.

[Note] Overlap and buffer lifetimes. On CUDA, ``batch_isend_irecv`` runs the transfers on NCCL's
own stream (the second stream), which first waits for the work already on the current stream, so
the shard being sent is complete. Each step posts its transfers, then enqueues its compute on the
current stream, and only then calls ``Work.wait()``: for NCCL that makes the current stream (not
the host) wait for the transfer, so the kernels of step s run while shard s + 1 travels, and step
s + 1's kernels are ordered after its shard arrived. Two K/V buffers are alive at a time (the
held shard and the one arriving; double buffers) besides the rank's own shard, plus in the
backward the dK/dV sums of both and of the own shard:
O(S / P) per rank. A buffer being sent stays referenced by the loop until after its ``wait()``
(and by NCCL's work object), and once the current stream waits for the transfer, freeing it
there is ordered after the send: no ``record_stream`` is needed. In the backward, the sums of
step s are sent after step s's compute (they include it), and waited on after step s + 1's
compute is enqueued. On gloo (CPU) the transfers run on gloo's threads while the host computes.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from flexattn.kernels import merge


def last_steps(needs: tuple, P: int) -> list[int]:
    """``last[j]``: the last step at which a rank reads KV shard j (-1: none does)."""
    last = []
    for j in range(P):
        steps = [s for s in range(P) if needs[(j + s) % P][j]]
        last.append(max(steps) if steps else -1)
    return last


def merge_rows(out, lse, part_out, part_lse, rows: tuple[int, int], n: int, dtype: torch.dtype | None = None):
    """Merge a partial attention of rows ``[lo, hi)`` of ``n`` into ``(out, lse)`` by log-sum-exp
    (`flexattn.kernels.merge`); the rows outside it keep what they had (out = 0, lse = -inf where
    nothing yet). The first part of all rows is kept as the kernel gave it (a rank that reads one
    pair converts nothing); a merged output comes in ``dtype`` (default: float32, float64 for
    float64), read from the unrounded sums and rounded once; the LSE in float32 (float64)."""
    lo, hi = rows
    whole = (lo, hi) == (0, n)
    stat = torch.float64 if part_lse.dtype == torch.float64 else torch.float32
    dtype = dtype or stat
    part_lse = part_lse.to(stat)
    if out is None:
        if whole:
            return part_out, part_lse
        out = part_out.new_zeros((*part_out.shape[:2], n, part_out.shape[3]), dtype=dtype)
        lse = part_lse.new_full((*part_lse.shape[:2], n), -math.inf)
        out[:, :, lo:hi], lse[:, :, lo:hi] = part_out, part_lse
        return out, lse
    if out.dtype == dtype:
        result = out  # (in place)
    elif whole:
        result = torch.empty_like(out, dtype=dtype)
    else:  # (the other rows as they are; the merged rows from out's own values)
        result = out.to(dtype)
    merge.merge_into(result[:, :, lo:hi], out[:, :, lo:hi], lse[:, :, lo:hi], part_out, part_lse)
    return result, lse


class Ring:
    """The ring schedule of one group, one ``needs`` table, the travelling ``windows`` (local
    (lo, hi) of each KV shard) and the query ``rows`` (of ``n_rows``) that read each shard."""

    def __init__(self, group, needs: tuple, windows: tuple, own_length: int, rows: tuple, n_rows: int):
        self.group = group
        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.needs, self.windows = needs, windows
        self.rows, self.n_rows = rows, n_rows
        self.lengths = [hi - lo for lo, hi in windows]
        self.own_length = own_length
        self.last = last_steps(needs, self.P)
        self.peers = [dist.get_global_rank(group, (self.rank + d) % self.P) for d in (1, -1)]

    def shard_at(self, s: int) -> int:
        return (self.rank - s) % self.P

    def _transfer(self, s: int, held: list[torch.Tensor], make_recv: Callable, tag: int):
        """After step s: send what we hold on to the next rank (at step 0, a copy of the own
        shard's window), receive the next step's shard; ``(works, received tensors or None)``
        (the works list ends with the tensors sent: the caller keeps them alive until it waits)."""
        ops, received, sends = [], None, []
        j = self.shard_at(s)
        if s + 1 <= self.last[j]:
            window = slice(*self.windows[j])
            sends = [t[:, :, window].contiguous() for t in held] if s == 0 else held
            ops += [dist.P2POp(dist.isend, t, self.peers[0], self.group, tag + i) for i, t in enumerate(sends)]
        nxt = self.shard_at(s + 1)
        if s + 1 <= self.last[nxt]:
            received = make_recv(nxt)
            ops += [dist.P2POp(dist.irecv, t, self.peers[1], self.group, tag + i) for i, t in enumerate(received)]
        return (dist.batch_isend_irecv(ops) + [sends] if ops else []), received

    def forward(self, k: torch.Tensor, v: torch.Tensor, compute: Callable, out_dtype: torch.dtype):
        """``compute(j, k_j, v_j) -> (out, lse)`` of the rows ``rows[j]`` for every pair this rank
        reads, merged: ``(out, lse)`` of all rows, out as the kernel gave it for one pair of all
        rows and in ``out_dtype`` otherwise (the last merge writes it); (None, None) if it reads
        nothing."""
        out = lse = None
        k, v = k.contiguous(), v.contiguous()
        last = max((s for s in range(self.P) if self.needs[self.rank][self.shard_at(s)]), default=-1)
        for s in range(self.P):
            j = self.shard_at(s)
            works, nxt = self._transfer(s, [k, v], lambda i: self._kv_like(k, v, i), 0)
            if self.needs[self.rank][j]:
                out, lse = merge_rows(out, lse, *compute(j, k, v), self.rows[j], self.n_rows,
                                      out_dtype if s == last else None)
            _wait(works)
            if nxt is not None:
                k, v = nxt
        return out, lse

    def _kv_like(self, k, v, j, dtype=None):
        n = self.lengths[j]
        return (k.new_empty((*k.shape[:2], n, k.shape[3]), dtype=dtype or k.dtype),
                v.new_empty((*v.shape[:2], n, v.shape[3]), dtype=dtype or v.dtype))

    def backward(self, k: torch.Tensor, v: torch.Tensor, compute: Callable, acc_dtype: torch.dtype):
        """``compute(j, k_j, v_j) -> (dq, dk_j, dv_j, extra)`` for every pair this rank reads (dq of
        the rows ``rows[j]``): ``(dq sum or None, dK, dV of this rank's own shard, [extra of each
        step])``; each sum as the kernel gave it where it has one part of all rows, in
        ``acc_dtype`` otherwise."""
        k, v = k.contiguous(), v.contiguous()
        own = None                        # this rank's own shard's dK/dV sums
        dq, extras = None, []
        sums_works, sums_next = [], None  # the window sums of the shard held at the next step, in flight
        arrived = None                    # the own window's sums, in flight
        last_dq = max((s for s in range(self.P) if s <= self.last[self.shard_at(s)]
                       and self.needs[self.rank][self.shard_at(s)]), default=-1)
        for s in range(self.P):
            j = self.shard_at(s)
            held = s <= self.last[j]     # (the shard is here and someone reads it now or later)
            works, nxt = self._transfer(s, [k, v], lambda i: self._kv_like(k, v, i), 0)
            part = compute(j, k, v) if held and self.needs[self.rank][j] else None
            _wait(sums_works)
            own = self._add_home(own, arrived, acc_dtype)
            arrived = None
            # the window's sums: started by the first rank after the owner, carried on by the others
            sums = sums_next if s > 1 and held else None
            single = s == 1 and self.last[j] == 1  # (one rank reads the window: its sums are its part)
            if part is not None:
                dq_s, dk_s, dv_s, extra = part
                if s == 0:  # (the own pair's are the first own sums: kept as they come)
                    own = (dk_s, dv_s)
                elif single:  # (they go home in K/V's dtype: half the bytes of float32 for 16-bit K/V)
                    sums = (dk_s.to(k.dtype), dv_s.to(v.dtype))
                elif s == 1:
                    sums = (dk_s.to(acc_dtype), dv_s.to(acc_dtype))
                else:
                    sums[0].add_(dk_s)
                    sums[1].add_(dv_s)
                extras.append(extra)
            elif s == 1 and held:  # (this rank reads nothing of it, later ones do)
                sums = self._zeros_like(k, v, j, acc_dtype)
            sums_works, sums_next, home = self._send_sums(s, None if s == 0 else sums, k, v, acc_dtype)
            arrived = home if home is not None else arrived
            if part is not None:  # (after the sums left: the last step's travel home overlaps it)
                dq = _accumulate_rows(dq, part[0], acc_dtype, self.rows[j], self.n_rows, s == last_dq)
            _wait(works)
            if nxt is not None:
                k, v = nxt
        _wait(sums_works)
        own = self._add_home(own, arrived, acc_dtype)
        if own is None:  # no rank reads this shard
            own = self._zeros_like(k, v, self.rank, acc_dtype, whole=True)
        return dq, own[0], own[1], extras

    def _add_home(self, own, arrived, acc_dtype):
        """The own shard's sums with the own window's (complete: their transfer was waited on)
        added, in place. It is the one addition to the own pair's part (the window comes home once
        per call), so it is made in that part's dtype: float32 arithmetic rounded once, as a float32
        sum rounded at the end would be."""
        if arrived is None:
            return own
        if own is None:
            own = self._zeros_like(arrived[0], arrived[1], self.rank, acc_dtype, whole=True)
        window = slice(*self.windows[self.rank])
        own[0][:, :, window].add_(arrived[0])
        own[1][:, :, window].add_(arrived[1])
        return own

    def _zeros_like(self, k, v, j, dtype, whole: bool = False):
        """Zeros for KV shard j's window (``whole``: for the whole own shard)."""
        if whole:
            n = self.own_length
            return (k.new_zeros((*k.shape[:2], n, k.shape[3]), dtype=dtype),
                    v.new_zeros((*v.shape[:2], n, v.shape[3]), dtype=dtype))
        acc = self._kv_like(k, v, j, dtype)
        acc[0].zero_()
        acc[1].zero_()
        return acc

    def _send_sums(self, s: int, acc, k, v, acc_dtype):
        """After step s >= 1's compute: the held window's dK/dV sums go on to the next rank (while
        a later rank reads the shard) or home (from the last one); receive the next step's sums
        (from step 2 on: the first reader after the owner starts them) and, at the step it ends,
        this rank's own window's sums. ``(works, next sums, own window sums)``. Sums travel in
        ``acc_dtype``, but those of a window that one rank alone reads (the one after its owner):
        that rank's part in K/V's dtype."""
        ops, nxt, home = [], None, None
        j = self.shard_at(s)
        if acc is not None:
            if s + 1 <= self.last[j]:
                ops += [dist.P2POp(dist.isend, t, self.peers[0], self.group, 2 + i) for i, t in enumerate(acc)]
            else:
                dst = dist.get_global_rank(self.group, j)
                ops += [dist.P2POp(dist.isend, t, dst, self.group, 4 + i) for i, t in enumerate(acc)]
        n = self.shard_at(s + 1)
        if 1 <= s and s + 1 <= self.last[n]:
            nxt = self._kv_like(k, v, n, acc_dtype)
            ops += [dist.P2POp(dist.irecv, t, self.peers[1], self.group, 2 + i) for i, t in enumerate(nxt)]
        if s >= 1 and s == self.last[self.rank]:
            src = dist.get_global_rank(self.group, (self.rank + s) % self.P)
            home = self._kv_like(k, v, self.rank, k.dtype if s == 1 else acc_dtype)
            ops += [dist.P2POp(dist.irecv, t, src, self.group, 4 + i) for i, t in enumerate(home)]
        return (dist.batch_isend_irecv(ops) if ops else []), nxt, home


def _accumulate(total, part, acc_dtype, last: bool = False):
    """``total + part``: the first part as it comes, the sum of more in ``acc_dtype``; but a
    ``last`` part added to the first alone is added in place in the first's dtype (float32
    arithmetic rounded once, as the float32 sum rounded at the end would be: no conversions)."""
    if total is None:
        return part
    if total.dtype != acc_dtype and not last:
        return total.to(acc_dtype).add_(part)
    return total.add_(part)


def _accumulate_rows(total, part, acc_dtype, rows: tuple[int, int], n: int, last: bool = False):
    """`_accumulate` of a part that covers rows ``[lo, hi)`` of ``n`` (the others add 0)."""
    lo, hi = rows
    if (lo, hi) == (0, n):
        return _accumulate(total, part, acc_dtype, last)
    if total is None:
        total = part.new_zeros((*part.shape[:2], n, part.shape[3]), dtype=acc_dtype)
    elif total.dtype != acc_dtype and not last:
        total = total.to(acc_dtype)
    total[:, :, lo:hi] += part
    return total


def _wait(works: list) -> None:
    """Wait for the transfers among ``works`` (the tensors kept alive with them are skipped)."""
    for w in works:
        if not isinstance(w, list):
            w.wait()
