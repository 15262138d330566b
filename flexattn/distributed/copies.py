"""The ring's K/V and dK/dV parts travel by the GPUs' copy engines, through symmetric memory (one host).

NCCL moves data with kernels: a transfer needs SMs, and it shares them with the attention kernel
it is meant to overlap (on 4 H100s a K/V shard pair of 268 MB took 0.94 ms through two NCCL
communicators alone and 2-3 ms beside the backward's kernels). Where every rank of the group is a
GPU of this host, each rank instead owns two *slots* in a symmetric-memory workspace
(`torch.distributed._symmetric_memory`), which the other ranks can address, and the previous rank
*pushes* the next shard into one of them with a device-to-device copy: a copy engine moves it
(0.75 ms alone for the same pair), and no SM is taken from the compute.

Protocol, per slot x of rank r (two binary signals, on the signal pads of the workspace):
``FREE[x]`` from r to r - 1 says that r is done with slot x; ``FILLED[x]`` from r - 1 to r says
that the shard has landed in it. At step s the shard a rank holds is pushed into slot s % 2 of the
next rank: its copy stream waits for that rank's FREE, copies, then posts FILLED; the receiving
rank's compute stream waits for FILLED before the step that reads it. A rank posts FREE for a slot
once the compute that read it and its own push of it onward are done (ordered on its copy
stream). Between calls, FREE of both slots is pending at the previous rank: posted once when the
workspace is made, then re-posted by every call for each slot it received into. Each signal is
posted once and consumed once per use of a slot, so none is ever posted twice unconsumed
(``put_signal`` would then wait) and none waits for a signal that a later step posts.
``tests/test_distributed.py`` runs the protocol on simulated streams and signal pads (random
schedules, several calls in a row), where a missing wait or re-post shows as a deadlock or a step
reading the wrong shard.

The copy stream has high priority, so that the signal kernels (one block each) get an SM while an
attention kernel runs. A step's ``wait()`` also makes the compute stream wait for this rank's push,
so a buffer it sent (the own shard, or a slot) may be freed or reused after it, as with NCCL.

The backward's dK/dV parts go home the same way (`Home`), through two more slots per rank (home
slots 2 and 3) and a second high-priority stream of their own, so that a part's push never holds
up the next shard's. Rank r's window comes home from a different rank at each step (from r + s at
step s, at the steps ``coming`` the ring derives from the agreed tables, the same on every rank):
the i-th part into home slot i % 2. ``HOME_FREE[x]`` from r to the sender of a part says that home
slot x of r may take it; ``HOME_FILLED[x]`` from that sender to r says that it has landed. A call
posts HOME_FREE of the first two parts' slots to their senders at its start, and r posts that of
the (i + 2)-th to its sender once the add that read the i-th is done; so between calls no home
signal is pending. A part sent is recorded on the home stream (``record_stream``), so the compute
stream never waits for another rank to free a slot before its next step.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from flexattn.lru import LRU

FREE, FILLED = (0, 1), (2, 3)
HOME_FREE, HOME_FILLED = (4, 5), (6, 7)
_ALIGN = 256  # bytes: each tensor in a slot starts at a multiple of this
_GRANULE = 2 << 20  # bytes: a slot's capacity is a multiple of this


def usable(device: torch.device) -> bool:
    """Whether this process can push K/V and dK/dV parts on ``device`` by the copy engines: a CUDA
    device, torch's symmetric memory, and no ``FLEXATTN_RING_COPY=0`` (which keeps the ring on
    NCCL: for comparisons, and where the processes may not share GPU memory handles). Read when a
    block mask is made; the ring uses them only where every rank of the group can, on one host."""
    if device.type != "cuda" or os.environ.get("FLEXATTN_RING_COPY", "1") == "0":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def _nbytes(shape, dtype) -> int:
    """Bytes a tensor takes in a slot (rounded up to `_ALIGN`)."""
    return -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN


class Workspace:
    """One group's slots on this GPU: ``capacity`` bytes each, ``slots`` of them (2: K/V; 4: and
    the backward's home slots), symmetric."""

    def __init__(self, group: dist.ProcessGroup, capacity: int, device: torch.device, slots: int = 2):
        import torch.distributed._symmetric_memory as symm
        self.group, self.capacity, self.device, self.slots = group, capacity, device, slots
        self.buffer = symm.empty(slots * capacity, dtype=torch.uint8, device=device)
        self.handle = symm.rendezvous(self.buffer, group)
        self.rank, self.P = self.handle.rank, self.handle.world_size
        self.next, self.prev = (self.rank + 1) % self.P, (self.rank - 1) % self.P
        self.stream = torch.cuda.Stream(device=device, priority=-1)
        self.home_stream = torch.cuda.Stream(device=device, priority=-1)
        with torch.cuda.stream(self.stream):
            for x in range(2):  # (the invariant between calls: both slots free at the previous rank)
                self.handle.put_signal(self.prev, FREE[x])
        self._views = LRU(256)  # (rank, slot, metas) -> tensors laid out there

    def views(self, rank: int, x: int, metas: tuple) -> list[torch.Tensor]:
        """Tensors of ``metas`` ((shape, dtype) each) laid out in slot x of ``rank``."""
        key = (rank, x, metas)
        hit = self._views.get(key)
        if hit is None:
            hit, at = [], x * self.capacity
            for shape, dtype in metas:
                n = _nbytes(shape, dtype)
                if rank == self.rank:
                    raw = self.buffer[at:at + n]
                else:
                    raw = self.handle.get_buffer(rank, (n,), torch.uint8, at)
                hit.append(raw[:math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
                at += n
            self._views[key] = hit
        return hit


# (group name, device) -> Workspace: one per process group and GPU, not a cache (the ranks make and
# drop them together; see `workspace`)
_WORKSPACES: dict = {}


def workspace(group: dist.ProcessGroup, capacity: int, device: torch.device, slots: int = 2) -> Workspace:
    """The group's workspace on ``device`` with at least ``slots`` slots of at least ``capacity``
    bytes (a collective when it is made or grown: every rank asks for the same, which the ring's
    agreed windows fix, and the forward and backward of a call run on every rank)."""
    key = (group.group_name, device)
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.group is group:
        capacity, slots = max(capacity, ws.capacity), max(slots, ws.slots)
    # (made again too for a default group made again)
    if ws is None or ws.capacity < capacity or ws.slots < slots or ws.group is not group:
        if ws is not None:
            # (a signal or a push of this rank's may still be on its way into another's old slots:
            # every rank's old work is done before any rank frees them)
            torch.cuda.synchronize(device)
            dist.barrier(group=group)
        size = -(-capacity // _GRANULE) * _GRANULE
        _WORKSPACES.pop(key, None)  # (the old slots go before the new ones are made)
        ws = _WORKSPACES[key] = Workspace(group, size, device, slots)
    return ws


def workspace_bytes(device: torch.device | None = None) -> int:
    """Bytes of the ring's slots on ``device`` (all devices: None). They are symmetric memory,
    which `torch.cuda.max_memory_allocated` does not count: add them to it."""
    return sum(ws.slots * ws.capacity for (_, d), ws in _WORKSPACES.items() if device is None or d == device)


def capacity_of(metas: tuple) -> int:
    """Bytes of a slot that holds tensors of ``metas`` ((shape, dtype) each)."""
    return sum(_nbytes(shape, dtype) for shape, dtype in metas)


class _Step:
    """What a step's caller waits for: the shard arriving (FILLED) and this rank's push."""

    def __init__(self, copies: "Copies", receive: int | None):
        self.copies, self.receive = copies, receive

    def wait(self) -> None:
        ws = self.copies.ws
        current = torch.cuda.current_stream(ws.device)
        if self.receive is not None:
            ws.handle.wait_signal(ws.prev, FILLED[self.receive])
        current.wait_stream(ws.stream)


class Copies:
    """One ring call's K/V travel through the workspace (`exchange` per step, then `end`)."""

    def __init__(self, ws: Workspace):
        self.ws = ws
        self.consumed: set = set()  # slots received into whose FREE is not yet re-posted

    def exchange(self, s: int, sends: list[torch.Tensor] | None, receive: tuple | None):
        """Step s: push ``sends`` (contiguous) into slot s % 2 of the next rank, and receive the
        tensors of ``receive`` (metas) into this rank's slot s % 2. ``(work, received or None)``;
        ``work.wait()`` after the step's compute is enqueued (on the compute stream)."""
        ws, x = self.ws, s % 2
        current = torch.cuda.current_stream(ws.device)
        ws.stream.wait_stream(current)  # (the data sent is complete; the compute on slot x is done)
        with torch.cuda.stream(ws.stream):
            if x in self.consumed:  # (slot x was read at step s - 1 and pushed on: the previous rank may refill it)
                ws.handle.put_signal(ws.prev, FREE[x])
                self.consumed.discard(x)
            if sends:
                metas = tuple((tuple(t.shape), t.dtype) for t in sends)
                ws.handle.wait_signal(ws.next, FREE[x])
                for dst, src in zip(ws.views(ws.next, x, metas), sends):
                    dst.copy_(src)
                ws.handle.put_signal(ws.next, FILLED[x])
        received = None
        if receive is not None:
            received = ws.views(ws.rank, x, receive)
            self.consumed.add(x)
        return [_Step(self, x if receive is not None else None)], received

    def end(self) -> None:
        """After the last step: re-post FREE for the slots still held, and order the compute
        stream after every push."""
        ws = self.ws
        current = torch.cuda.current_stream(ws.device)
        ws.stream.wait_stream(current)
        with torch.cuda.stream(ws.stream):
            for x in sorted(self.consumed):
                ws.handle.put_signal(ws.prev, FREE[x])
        self.consumed.clear()
        current.wait_stream(ws.stream)


class Home:
    """One backward call's dK/dV parts travelling home through the home slots (2 and 3): this
    rank's own window's parts arrive at the steps ``coming`` (the i-th from rank + coming[i], into
    home slot i % 2), and `send` pushes this rank's parts of the windows it holds to their owners.
    The protocol is in the module docstring."""

    def __init__(self, ws: Workspace, coming: list[int]):
        self.ws, self.coming = ws, coming
        ws.home_stream.wait_stream(torch.cuda.current_stream(ws.device))  # (the last call's reads are done)
        with torch.cuda.stream(ws.home_stream):
            for i in range(min(2, len(coming))):
                ws.handle.put_signal(self._sender(i), HOME_FREE[i % 2])

    def _sender(self, i: int) -> int:
        return (self.ws.rank + self.coming[i]) % self.ws.P

    def send(self, parts: list[torch.Tensor], owner: int, i: int) -> None:
        """Push ``parts`` (contiguous) into home slot i % 2 of ``owner``, whose i-th part they are
        (after the work enqueued on the compute stream so far)."""
        ws, x = self.ws, i % 2
        ws.home_stream.wait_stream(torch.cuda.current_stream(ws.device))
        metas = tuple((tuple(t.shape), t.dtype) for t in parts)
        with torch.cuda.stream(ws.home_stream):
            ws.handle.wait_signal(owner, HOME_FREE[x])
            for dst, src in zip(ws.views(owner, 2 + x, metas), parts):
                dst.copy_(src)
            ws.handle.put_signal(owner, HOME_FILLED[x])
        for t in parts:
            t.record_stream(ws.home_stream)

    def receive(self, i: int, metas: tuple) -> tuple[list, list[torch.Tensor]]:
        """The i-th part of this rank's window: ``([work], tensors in its home slot)``;
        ``work.wait()`` makes the compute stream wait until it has landed."""
        return [_Landed(self, i)], self.ws.views(self.ws.rank, 2 + i % 2, metas)

    def consumed(self, i: int) -> None:
        """The compute stream has enqueued its last read of the i-th part: once it has run, the
        home slot may take the (i + 2)-th."""
        ws = self.ws
        if i + 2 < len(self.coming):
            ws.home_stream.wait_stream(torch.cuda.current_stream(ws.device))
            with torch.cuda.stream(ws.home_stream):
                ws.handle.put_signal(self._sender(i + 2), HOME_FREE[i % 2])

    def end(self) -> None:
        """After the last step: the compute stream after every push of this call."""
        torch.cuda.current_stream(self.ws.device).wait_stream(self.ws.home_stream)


class _Landed:
    def __init__(self, home: Home, i: int):
        self.home, self.i = home, i

    def wait(self) -> None:
        home = self.home
        home.ws.handle.wait_signal(home._sender(self.i), HOME_FILLED[self.i % 2])
