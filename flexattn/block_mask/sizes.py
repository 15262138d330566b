"""Block sizes and lengths of a block mask: defaults and argument checks."""

from __future__ import annotations

_DEFAULT_SPARSE_BLOCK_SIZE = 128
_MIN_BLOCK_SIZE = 16


def _check_block_sizes(pair: tuple[int, int]) -> None:
    for name, v in zip(("query", "KV"), pair):
        if v < _MIN_BLOCK_SIZE or v & (v - 1):
            raise ValueError(
                f"BLOCK_SIZE: the {name} block size must be a power of two >= {_MIN_BLOCK_SIZE}, got {v}"
            )


def _seq_pair(seq_lengths) -> tuple[int, int]:
    if (not isinstance(seq_lengths, (tuple, list)) or len(seq_lengths) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in seq_lengths)):
        raise ValueError(f"seq_lengths must be a (Q_LEN, KV_LEN) pair of positive ints, got {seq_lengths!r}")
    return int(seq_lengths[0]), int(seq_lengths[1])


def _check_positive(name: str, value, allow_none: bool = False) -> int:
    if value is None and allow_none:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        expected = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value
