"""The ring's K/V travel by the GPUs' copy engines, through symmetric memory (one host).

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
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from flexattn.lru import LRU

FREE, FILLED = (0, 1), (2, 3)
_ALIGN = 256  # bytes: each tensor in a slot starts at a multiple of this
_GRANULE = 2 << 20  # bytes: a slot's capacity is a multiple of this


def usable(device: torch.device) -> bool:
    """Whether this process can push K/V on ``device`` by the copy engines: a CUDA device, torch's
    symmetric memory, and no ``FLEXATTN_RING_COPY=0`` (which keeps the ring on NCCL: for
    comparisons, and where the processes may not share GPU memory handles). Read when a block mask
    is made; the ring uses them only where every rank of the group can, on one host."""
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
    """One group's slots on this GPU: ``capacity`` bytes each, two of them, symmetric."""

    def __init__(self, group: dist.ProcessGroup, capacity: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm
        self.group, self.capacity, self.device = group, capacity, device
        self.buffer = symm.empty(2 * capacity, dtype=torch.uint8, device=device)
        self.handle = symm.rendezvous(self.buffer, group)
        self.rank, self.P = self.handle.rank, self.handle.world_size
        self.next, self.prev = (self.rank + 1) % self.P, (self.rank - 1) % self.P
        self.stream = torch.cuda.Stream(device=device, priority=-1)
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


def workspace(group: dist.ProcessGroup, capacity: int, device: torch.device) -> Workspace:
    """The group's workspace on ``device`` with slots of at least ``capacity`` bytes (a collective
    when it is made or grown: every rank asks for the same capacity, which the ring's agreed
    windows fix)."""
    key = (group.group_name, device)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.capacity < capacity or ws.group is not group:  # (or a default group made again)
        if ws is not None:
            # (a signal or a push of this rank's may still be on its way into another's old slots:
            # every rank's old work is done before any rank frees them)
            torch.cuda.synchronize(device)
            dist.barrier(group=group)
        size = -(-capacity // _GRANULE) * _GRANULE
        _WORKSPACES.pop(key, None)  # (the old slots go before the new ones are made)
        ws = _WORKSPACES[key] = Workspace(group, size, device)
    return ws


def workspace_bytes(device: torch.device | None = None) -> int:
    """Bytes of the ring's slots on ``device`` (all devices: None). They are symmetric memory,
    which `torch.cuda.max_memory_allocated` does not count: add them to it."""
    return sum(2 * ws.capacity for (_, d), ws in _WORKSPACES.items() if device is None or d == device)


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
