"""Buffers a launch borrows per CUDA stream instead of allocating per call: counters the
kernels leave at zero (`Counters`) and float32 scratch (`Scratch`)."""

from __future__ import annotations

import functools

import torch

from flexattn.kernels import launch


class _PerStream:
    """Buffers of one device kept per CUDA stream (raw handle; 0 on the CPU, where the interpreter
    runs one launch at a time): launches on one stream run one after another and share its buffer,
    launches on two streams never do. A buffer too small is replaced by a larger one and the old
    one kept (a captured CUDA graph may still use it). Subclasses make buffers (`_grow`)."""

    __slots__ = ("device", "index", "buffers", "retired")

    def __init__(self, device: torch.device):
        self.device = device
        self.index = device.index if device.type == "cuda" else None  # None: no streams (CPU)
        self.buffers: dict[int, tuple[torch.Tensor, int]] = {}  # raw stream -> (buffer, its size)
        self.retired: list[torch.Tensor] = []  # outgrown buffers: captured graphs may still use them

    def __call__(self, n: int, stream: int | None = None) -> tuple[int, torch.Tensor]:
        """``(stream, buffer)``: the raw current stream (``stream`` where the caller has it
        already), for the launch, and a buffer of at least ``n`` elements for it."""
        if stream is None:
            stream = 0 if self.index is None else torch._C._cuda_getCurrentRawStream(self.index)
        entry = self.buffers.get(stream)
        if entry is None or entry[1] < n:
            return stream, self._grow(stream, n)
        return stream, entry[0]

    def _grow(self, stream: int, n: int) -> torch.Tensor:
        raise NotImplementedError

    def _keep(self, stream: int, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` becomes the stream's buffer; the one it replaces is retired, not freed."""
        old = self.buffers.get(stream)
        if old is not None:
            self.retired.append(old[0])
        self.buffers[stream] = (buf, buf.numel())
        return buf

    def _capturing(self) -> bool:
        # Asked only where a buffer is made: too slow for every call.
        return self.index is not None and torch.cuda.is_current_stream_capturing()


COUNTERS_MIN = 4096  # int32 counters a buffer holds at least (16 KiB): one buffer serves most plans


class Counters(_PerStream):
    """int32 counters of one device that are zero between launches, so a kernel can count on them
    (the decoding kernel's splits count themselves in per row tile) with no memset per call; the
    kernel must leave them at zero when it ends. `counters_of` gives a device's.

    One buffer per stream (`_PerStream`). A CUDA graph keeps the buffer of the stream it was
    captured on, and every replay uses it, wherever it is launched. If that stream had none yet
    (the usual recipe warms up on another stream), the capture adopts the spare that `reserve`
    zeroed when the plan was made; with no spare large enough, the call takes a buffer of its own
    that the graph zeroes on every replay (one memset more, still right). So two things must not
    overlap in time: a replay launched on another stream and decode calls issued on the capture
    stream, or replays of two graphs captured on one stream (say torch's default capture stream)
    on two streams. Their splits would count on the same counters and could merge early: wrong
    rows (the counters still end at zero, so later calls are right). Graphs meant to run
    concurrently are captured on streams of their own, ``torch.cuda.graph(g, stream=s)``.
    """

    __slots__ = ("spare",)

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.spare: torch.Tensor | None = None  # zeroed, for a capture to adopt

    def reserve(self, n: int) -> None:
        """At plan time: a zeroed spare of ``n`` counters or more, ready for a capture to adopt;
        zeroed outside any capture and synchronised, so no graph sees it unzeroed."""
        if (self.spare is None or self.spare.numel() < n) and not self._capturing():
            self.spare = torch.zeros(max(n, COUNTERS_MIN), dtype=torch.int32, device=self.device)
            if self.index is not None:
                torch.cuda.current_stream(self.device).synchronize()

    def _grow(self, stream: int, n: int) -> torch.Tensor:
        """The stream's first buffer, or a larger one."""
        if self._capturing():
            # Nothing runs during a capture: a buffer made now is not zero before the first replay.
            if self.spare is None or self.spare.numel() < n:
                return torch.zeros(n, dtype=torch.int32, device=self.device)  # zeroed by each replay
            buf, self.spare = self.spare, None
            return self._keep(stream, buf)
        old = self.buffers.get(stream)
        size = max(n, COUNTERS_MIN, 2 * old[1] if old else 0)
        return self._keep(stream, torch.zeros(size, dtype=torch.int32, device=self.device))


@functools.lru_cache(maxsize=None)
def counters_of(device: torch.device) -> Counters:
    return Counters(device)


class Scratch(_PerStream):
    """float32 scratch of one device for what a launch writes and reads back before it ends (the
    decoding kernel's split partials, and its LSE where the caller does not want it), so that a
    call allocates only what it returns. One buffer per stream (`_PerStream`), grown as needed.
    The rules for CUDA graphs are the counters' (`Counters`): a graph keeps the buffer of the
    stream it was captured on, so a replay must not overlap calls issued on that stream, nor a
    replay of another graph captured on it. A call captured on a stream that has no buffer yet
    allocates its own (the graph's pool keeps it)."""

    __slots__ = ()

    def _grow(self, stream: int, n: int) -> torch.Tensor:
        if self._capturing():
            return launch.empty((n,), torch.float32, self.device)
        old = self.buffers.get(stream)
        return self._keep(stream, launch.empty((max(n, 2 * old[1] if old else 0),), torch.float32, self.device))


@functools.lru_cache(maxsize=None)
def scratch_of(device: torch.device) -> Scratch:
    return Scratch(device)
