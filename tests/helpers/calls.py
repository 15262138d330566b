"""Watching and capturing calls: a recording wrapper, CUDA-graph capture after warm-up, calls
from several threads at once."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch


def record_calls(monkeypatch, owner: Any, name: str) -> list[tuple]:
    """Wrap ``owner.name`` (for the test's duration) so that each call's positional arguments
    are appended to the returned list; the real function still runs."""
    real = getattr(owner, name)
    calls: list[tuple] = []

    def recording(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def capture_after_warmup(step: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, static outputs)``: ``step`` warmed up on a side stream (trace, plan, compile), as
    torch's recipe does, then one call captured (on torch's default capture stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


def run_in_threads(worker: Callable[[int], Any], n: int) -> list[tuple[int, BaseException]]:
    """Call ``worker(i)`` for each i < ``n``, each in its own thread, all released together by a
    barrier; the ``(i, error)`` of each call that raised."""
    barrier = threading.Barrier(n)
    errors: list[tuple[int, BaseException]] = []

    def run(i):
        barrier.wait()
        try:
            worker(i)
        except BaseException as e:  # reported to the caller
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
