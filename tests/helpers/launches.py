"""What a call launches: the launch sites and arguments of the kernels one call runs."""

from __future__ import annotations

from typing import Any, Callable

from flexattn.kernels.launch import Launch


def recorded_launches(run: Callable[[], Any]) -> list[tuple[Launch, tuple]]:
    """``[(launch site, its arguments)]`` for every launch one call of ``run`` makes, in order."""
    seen, real = [], Launch.__call__

    def spy(self, *args, **kwargs):
        seen.append((self, args))
        return real(self, *args, **kwargs)

    Launch.__call__ = spy
    try:
        run()
    finally:
        Launch.__call__ = real
    return seen
