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
and merges the partial (out, lse) by log-sum-exp. Backward: the K/V travel again, and each step's
dK/dV part of the window it holds goes straight home to the shard's owner, as the kernel gave it
(K/V's dtype): the owner adds the parts to its own in step order, in float32 where more than one
comes. That sends each part once in 16 bits, where passing float32 sums along the ring would send
twice the bytes at every hop; where the GPUs reach each other through NVLink switches (one H100 or
H200 host), an owner several hops away along the ring is as near as the next rank.

[Note] Overlap and buffer lifetimes. On CUDA, ``batch_isend_irecv`` runs the transfers on NCCL's
own stream (the second stream; of high priority for the ring's own groups, `checks.ring_groups`, so
that a transfer gets SMs while a step's kernel runs), which first waits for the work already on the
current stream, so the shard being sent is complete. Each step posts its transfers, then enqueues
its compute on the current stream, and only then calls ``Work.wait()``: for NCCL that makes the
current stream (not the host) wait for the transfer, so the kernels of step s run while shard s + 1
travels, and step s + 1's kernels are ordered after its shard arrived. Two K/V buffers are alive at
a time (the held shard and the one arriving; double buffers) besides the rank's own shard, plus in
the backward the dK/dV of the own shard, the part being sent and the part arriving: O(S / P) per
rank. A buffer being sent stays referenced by the loop until after its ``wait()`` (and by NCCL's
work object), and once the current stream waits for the transfer, freeing it there is ordered after
the send: no ``record_stream`` is needed. In the backward, the part of step s is sent after step
s's compute, and waited on after step s + 1's compute is enqueued. On gloo (CPU) the transfers run
on gloo's threads while the host computes. Where the ring has copy engines (`copies`: every rank a
GPU of one host), K/V go by device-to-device copies into the next rank's slots instead, on a
stream of the ring's own with the same ordering, and the dK/dV parts into their owners' home slots
on another (its module docstring gives the protocol): a part sent is recorded on that stream, and
the owner's compute stream waits for the part's arrival where it would wait for NCCL's receive.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from flexattn.distributed.copies import Home, capacity_of as copies_capacity
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
    else:  # (the other rows converted as they are; the merged rows written by the merge, from out's)
        result = torch.empty_like(out, dtype=dtype)
        for rest in (slice(0, lo), slice(hi, n)):
            if rest.start < rest.stop:
                result[:, :, rest] = out[:, :, rest]
    merge.merge_into(result[:, :, lo:hi], out[:, :, lo:hi], lse[:, :, lo:hi], part_out, part_lse)
    return result, lse


def max_rows(mx, part: torch.Tensor, rows: tuple[int, int], n: int) -> torch.Tensor:
    """``mx`` [B, H, n] with the rows ``[lo, hi)`` raised to ``part``'s where it is larger (``mx``
    None: -inf outside the rows)."""
    lo, hi = rows
    if mx is None:
        if (lo, hi) == (0, n):
            return part
        mx = part.new_full((*part.shape[:2], n), -math.inf)
    mx[:, :, lo:hi] = torch.maximum(mx[:, :, lo:hi], part)
    return mx


class Ring:
    """The ring schedule of one group, one ``needs`` table, the travelling ``windows`` (local
    (lo, hi) of each KV shard) and the query ``rows`` (of ``n_rows``) that read each shard.
    ``groups``: the two process groups K/dK and V/dV travel through (`checks.ring_groups`)."""

    def __init__(self, groups: tuple, needs: tuple, windows: tuple, own_length: int, rows: tuple, n_rows: int,
                 copies: Callable | None = None):
        self.groups = groups
        # (``copies(capacity, device, slots)``: a `copies.Copies` with ``slots`` slots of at least
        # ``capacity`` bytes, or None: NCCL)
        self.make_copies = copies
        self.copies = None
        self.group = group = groups[0]
        self.P, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.needs, self.windows = needs, windows
        self.rows, self.n_rows = rows, n_rows
        self.lengths = [hi - lo for lo, hi in windows]
        self.own_length = own_length
        self.last = last_steps(needs, self.P)
        # (``coming[o]``: the steps at which the rank holding shard o reads it, each sending its
        # part home to o: the same lists on every rank)
        self.coming = [[s for s in range(1, self.P) if s <= self.last[o] and needs[(o + s) % self.P][o]]
                       for o in range(self.P)]
        self.home = None
        self.peers = [dist.get_global_rank(group, (self.rank + d) % self.P) for d in (1, -1)]

    def shard_at(self, s: int) -> int:
        return (self.rank - s) % self.P

    def _transfer(self, s: int, held: list[torch.Tensor], make_recv: Callable, tag: int):
        """After step s: send what we hold on to the next rank (at step 0, a copy of the own
        shard's window), receive the next step's shard; ``(works, received tensors or None)``
        (the works list ends with the tensors sent: the caller keeps them alive until it waits).
        Through the copy engines where the ring has them (`copies`), else NCCL's (gloo's) sends."""
        ops, received, sends = [[], []], None, []
        j = self.shard_at(s)
        if s + 1 <= self.last[j]:
            window = slice(*self.windows[j])
            sends = [t[:, :, window].contiguous() for t in held] if s == 0 else held
        nxt = self.shard_at(s + 1)
        receiving = s + 1 <= self.last[nxt]
        if self.copies is not None:
            works, received = self.copies.exchange(s, sends, self._metas(held, nxt) if receiving else None)
            return works + [sends], received
        for i, t in enumerate(sends):
            ops[i].append(dist.P2POp(dist.isend, t, self.peers[0], self.groups[i], tag + i))
        if receiving:
            received = make_recv(nxt)
            for i, t in enumerate(received):
                ops[i].append(dist.P2POp(dist.irecv, t, self.peers[1], self.groups[i], tag + i))
        return _post(ops, sends), received

    def _metas(self, held: list[torch.Tensor], j: int) -> tuple:
        """(shape, dtype) of K and V of shard j's travelling window."""
        return tuple(((*t.shape[:2], self.lengths[j], t.shape[3]), t.dtype) for t in held)

    def _begin(self, k: torch.Tensor, v: torch.Tensor, backward: bool = False) -> None:
        travels = [j for j in range(self.P) if self.last[j] > 0]
        # (not while a CUDA graph is captured: the slots are made by a collective at first use)
        if self.make_copies is not None and travels and not torch.cuda.is_current_stream_capturing():
            capacity = max(copies_capacity(self._metas([k, v], j)) for j in travels)
            self.copies = self.make_copies(capacity, k.device, 4 if backward else 2)
            if backward:  # (dK/dV parts in K/V's dtype: a window's parts fit a slot)
                self.home = Home(self.copies.ws, self.coming[self.rank])

    def _end(self) -> None:
        if self.copies is not None:
            self.copies.end()
            self.copies = None
        if self.home is not None:
            self.home.end()
            self.home = None

    def forward(self, k: torch.Tensor, v: torch.Tensor, compute: Callable, out_dtype: torch.dtype):
        """``compute(j, k_j, v_j) -> (out, lse, max_scores or None)`` of the rows ``rows[j]`` for
        every pair this rank reads, merged: ``(out, lse, max_scores)`` of all rows, out as the
        kernel gave it for one pair of all rows and in ``out_dtype`` otherwise (the last merge
        writes it), max_scores the rows' maximum over the pairs (None where compute gives none);
        (None, None, None) if it reads nothing."""
        out = lse = mx = None
        k, v = k.contiguous(), v.contiguous()
        last = max((s for s in range(self.P) if self.needs[self.rank][self.shard_at(s)]), default=-1)
        self._begin(k, v)
        for s in range(self.P):
            j = self.shard_at(s)
            works, nxt = self._transfer(s, [k, v], lambda i: self._kv_like(k, v, i), 0)
            if self.needs[self.rank][j]:
                part_out, part_lse, part_max = compute(j, k, v)
                out, lse = merge_rows(out, lse, part_out, part_lse, self.rows[j], self.n_rows,
                                      out_dtype if s == last else None)
                if part_max is not None:
                    mx = max_rows(mx, part_max, self.rows[j], self.n_rows)
            _wait(works)
            if nxt is not None:
                k, v = nxt
        self._end()
        return out, lse, mx

    def _kv_like(self, k, v, j, dtype=None):
        return tuple(t.new_empty(shape, dtype=dtype or kind)
                     for t, (shape, kind) in zip((k, v), self._metas([k, v], j)))

    def backward(self, k: torch.Tensor, v: torch.Tensor, compute: Callable, acc_dtype: torch.dtype):
        """``compute(j, k_j, v_j) -> (dq, dk_j, dv_j, extra)`` for every pair this rank reads (dq of
        the rows ``rows[j]``): ``(dq sum or None, dK, dV of this rank's own shard, [extra of each
        step])``; each sum as the kernel gave it where it has one part of all rows, else in the
        parts' dtype: float32 (``acc_dtype``) sums rounded once (`_sum_rows`)."""
        k, v = k.contiguous(), v.contiguous()
        P, r = self.P, self.rank
        own = None                # this rank's own shard's dK/dV: its own pair's part, then the others' added
        dq, extras = None, []
        home_works, arrived = [], None  # a part of the own window on its way home, in flight
        last_dq = max((s for s in range(P) if s <= self.last[self.shard_at(s)]
                       and self.needs[r][self.shard_at(s)]), default=-1)
        coming = self.coming[r]
        self._begin(k, v, backward=True)
        for s in range(P):
            j = self.shard_at(s)
            held = s <= self.last[j]     # (the shard is here and someone reads it now or later)
            works, nxt = self._transfer(s, [k, v], lambda i: self._kv_like(k, v, i), 0)
            part = compute(j, k, v) if held and self.needs[r][j] else None
            _wait(home_works)
            own = self._add_home(own, arrived, acc_dtype, s - 1 == max(coming, default=-1), s - 1)
            if part is not None:
                extras.append(part[3])
                if s == 0:  # (the own pair's are the first own sums: kept as they come)
                    own = (part[1], part[2])
            home_works, arrived = self._send_home(s, part if s > 0 else None, k, v, s in coming)
            if part is not None:  # (after the part left: the last step's travel home overlaps it)
                dq = _sum_rows(dq, part[0], acc_dtype, self.rows[j], self.n_rows, s == last_dq)
            _wait(works)
            if nxt is not None:
                k, v = nxt
        _wait(home_works)
        own = self._add_home(own, arrived, acc_dtype, True, P - 1)
        self._end()
        if own is None:  # no rank reads this shard
            own = self._own_zeros(k, v, acc_dtype)
        return dq, own[0], own[1], extras

    def _add_home(self, own, arrived, acc_dtype, last: bool, s: int):
        """The own shard's dK/dV with the part of its window from step ``s``'s holder (complete: its
        transfer was waited on) added (`_sum_rows`: the sums in ``acc_dtype``, the ``last`` part's
        in the parts' dtype, in place where it is the only one)."""
        if arrived is None:
            return own
        if own is None and self.home is not None:  # (the part would be kept as the sum: not in a slot)
            arrived = [t.clone() for t in arrived]
        rows = self.windows[self.rank]
        own = tuple(_sum_rows(None if own is None else own[i], arrived[i], acc_dtype, rows, self.own_length, last)
                    for i in range(2))
        if self.home is not None:
            self.home.consumed(self.coming[self.rank].index(s))
        return own

    def _own_zeros(self, k, v, dtype):
        """Zeros for the whole own shard's dK/dV."""
        n = self.own_length
        return (k.new_zeros((*k.shape[:2], n, k.shape[3]), dtype=dtype),
                v.new_zeros((*v.shape[:2], n, v.shape[3]), dtype=dtype))

    def _send_home(self, s: int, part, k, v, receive: bool):
        """After step s >= 1's compute: this step's dK/dV part of the held window goes straight to
        the shard's owner, as the kernel gave it (K/V's dtype for 16-bit K/V); and, where
        ``receive``, the part of this rank's own window from the rank holding it at this step
        comes in. ``(works, arriving part or None)``."""
        ops, home, sent = [[], []], None, []
        if self.home is not None:
            works = []
            if part is not None:
                owner = self.shard_at(s)
                self.home.send([part[1].to(k.dtype).contiguous(), part[2].to(v.dtype).contiguous()], owner,
                               self.coming[owner].index(s))
            if receive:
                works, home = self.home.receive(self.coming[self.rank].index(s), self._metas([k, v], self.rank))
            return works, home
        if part is not None:
            dst = dist.get_global_rank(self.group, self.shard_at(s))
            sent = [part[1].to(k.dtype), part[2].to(v.dtype)]
            for i, t in enumerate(sent):
                ops[i].append(dist.P2POp(dist.isend, t, dst, self.groups[i], 2 + i))
        if receive:
            src = dist.get_global_rank(self.group, (self.rank + s) % self.P)
            home = self._kv_like(k, v, self.rank)
            for i, t in enumerate(home):
                ops[i].append(dist.P2POp(dist.irecv, t, src, self.groups[i], 2 + i))
        return _post(ops, sent), home


def _sum_rows(total, part, acc_dtype, rows: tuple[int, int], n: int, last: bool = False):
    """``total + part``, a part of the rows ``[lo, hi)`` of ``n`` (the others add 0), in one pass
    (`merge.add_rows`): the first part of all rows as it comes; a sum of more in ``acc_dtype``,
    but the ``last`` sum in the part's dtype, float32 arithmetic rounded once (bitwise what a float32
    sum converted at the end gives, without the conversion's pass); in place where the total
    already has the sum's dtype."""
    lo, hi = rows
    if total is None and (lo, hi) == (0, n):
        return part
    dtype = part.dtype if last else acc_dtype
    result = total if total is not None and total.dtype == dtype else \
        part.new_empty((*part.shape[:2], n, part.shape[3]), dtype=dtype)
    merge.add_rows(result, total, part, lo)
    return result


def _post(ops: list, keep: list) -> list:
    """Post each group's transfers (``ops[i]`` through ``groups[i]``), as one batch per group:
    ``[works..., keep]`` (the tensors sent, kept alive until the wait), or [] if there are none."""
    works = [w for batch in ops if batch for w in dist.batch_isend_irecv(batch)]
    return works + [keep] if works else []


def _wait(works: list) -> None:
    """Wait for the transfers among ``works`` (the tensors kept alive with them are skipped)."""
    for w in works:
        if not isinstance(w, list):
            w.wait()
