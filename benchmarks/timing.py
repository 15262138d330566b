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
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3
