"""Kernel arguments on the host: the markers a plan puts among a launch's arguments."""

from __future__ import annotations


class _Unused:
    """A pointer argument the kernel does not read in this plan (its constexprs switch the read
    off): `UNUSED`. Cheaper than a tensor on the hot path (no ``data_ptr`` call)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNUSED"


UNUSED = _Unused()


class _PerCall:
    """In a launch's fixed arguments: a slot each call fills (`PER_CALL`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PER_CALL"


PER_CALL = _PerCall()
