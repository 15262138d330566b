"""Timing shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import statistics
import time

import torch


def timer(fn, device: str, warmup: int, rep: int) -> float:
    """Median seconds per call (CUDA events on the GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if device == "cpu":
        times = []
        for _ in range(rep):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    return _spans(fn, rep)


# GPU clock cycles of the sleep that `gpu_timer` queues its calls behind: about 0.1 s at 2 GHz,
# longer than the host takes to queue 20 calls of any suite here
HOST_AHEAD_CYCLES = 2 * 10 ** 8


def gpu_timer(fn, warmup: int, rep: int) -> float | None:
    """Median seconds per call of the GPU's work alone, or None where it could not be isolated.

    `timer`'s span of a call starts when the host queues it: where the GPU is faster than the host
    (short calls), it includes the host's time up to each launch. Here the calls are queued behind
    a sleep kernel, so that the GPU has all of them waiting when it gets to the first; None where
    the sleep ended before the last call was queued."""
    for _ in range(warmup):
        fn()
    return _spans(fn, rep, behind_sleep=True)


def _spans(fn, rep: int, behind_sleep: bool = False) -> float | None:
    """The median CUDA-event span of ``rep`` calls, in seconds; ``behind_sleep``: queued behind
    a sleep kernel (`gpu_timer`), None where it ended before the last call was queued."""
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    slept = None
    if behind_sleep:
        torch.cuda._sleep(HOST_AHEAD_CYCLES)
        slept = torch.cuda.Event()
        slept.record()
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    queued_in_time = slept is None or not slept.query()
    torch.cuda.synchronize()
    if not queued_in_time:
        return None
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3
