"""Load balancers: which global sequence positions each rank's shard holds.

A layout maps (sequence length, world size, rank) to the int tensor of global positions that the
rank's shard holds, in local order. Lengths need not divide evenly: a sequence (or a document)
cut into n chunks gives the first ``length % n`` chunks one more position, as ``torch.tensor_split``.

- `Contiguous`: rank r holds the r-th of P consecutive chunks (no balancing).
- `HeadTail`: the sequence cut into 2P chunks, rank r holds chunks r and 2P-1-r (torch's
  ``_HeadTailLoadBalancer``; "zigzag"): with a causal mask every rank gets the same work.
- `PerDocument`: the same inside each document of a packed sequence (torch's
  ``_PerDocumentHeadTailLoadBalancer``): rank r holds, document after document, the document's
  chunks r and 2P-1-r.
"""

from __future__ import annotations

import torch


def _chunk_bounds(start: int, length: int, n: int) -> list[tuple[int, int]]:
    """``[start, start + length)`` cut into n chunks as ``torch.tensor_split``: (begin, end) each."""
    base, extra = divmod(length, n)
    bounds, at = [], start
    for i in range(n):
        size = base + (i < extra)
        bounds.append((at, at + size))
        at += size
    return bounds


def _runs_to_positions(runs: list[tuple[int, int]], device) -> torch.Tensor:
    if not runs:
        return torch.empty(0, dtype=torch.int32, device=device)
    return torch.cat([torch.arange(a, b, dtype=torch.int32, device=device) for a, b in runs])


class Layout:
    """Base of the load balancers: `runs` says which global positions a rank holds."""

    name = "layout"

    def runs(self, length: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        """The rank's shard as consecutive runs of global positions [begin, end), in local order."""
        raise NotImplementedError

    def positions(self, length: int, world_size: int, rank: int, device=None) -> torch.Tensor:
        """int32 global position of each local index of ``rank``'s shard.

        >>> HeadTail().positions(10, 2, 0).tolist()
        [0, 1, 2, 8, 9]
        """
        return _runs_to_positions(self.runs(length, world_size, rank), device)

    def shard_length(self, length: int, world_size: int, rank: int) -> int:
        return sum(b - a for a, b in self.runs(length, world_size, rank))

    def key(self) -> tuple:
        """What makes two layouts equal (compared between ranks before collectives)."""
        return (self.name,)

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Contiguous(Layout):
    """Rank r holds the r-th of P consecutive chunks.

    >>> Contiguous().positions(7, 2, 1).tolist()
    [4, 5, 6]
    """

    name = "none"

    def runs(self, length, world_size, rank):
        return [_chunk_bounds(0, length, world_size)[rank]]


class HeadTail(Layout):
    """The sequence cut into 2P chunks; rank r holds chunks r and 2P-1-r (torch's head-tail)."""

    name = "head_tail"

    def runs(self, length, world_size, rank):
        return _head_tail(0, length, world_size, rank)


def _head_tail(start: int, length: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    chunks = _chunk_bounds(start, length, 2 * world_size)
    return [chunks[rank], chunks[2 * world_size - 1 - rank]]


class PerDocument(Layout):
    """Head-tail inside each document of a packed sequence (torch's per-document head-tail).

    ``document_lengths``: the documents' lengths in order (they must sum to the sequence length).

    >>> PerDocument([4, 6]).positions(10, 2, 0).tolist()
    [0, 3, 4, 5, 9]
    """

    name = "per_document"

    def __init__(self, document_lengths):
        lengths = [int(n) for n in (document_lengths.tolist() if isinstance(document_lengths, torch.Tensor)
                                    else document_lengths)]
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError(f"PerDocument needs positive document lengths, got {lengths}")
        self.document_lengths = tuple(lengths)

    def runs(self, length, world_size, rank):
        total = sum(self.document_lengths)
        if total != length:
            raise ValueError(f"PerDocument: the document lengths sum to {total}, but the sequence length is {length}")
        out, start = [], 0
        for n in self.document_lengths:
            out += _head_tail(start, n, world_size, rank)
            start += n
        return [(a, b) for a, b in out if b > a]

    def key(self):
        return (self.name, self.document_lengths)

    def __repr__(self) -> str:
        return f"PerDocument({list(self.document_lengths)})"


_BY_NAME = {"none": Contiguous, "contiguous": Contiguous, "head_tail": HeadTail, "zigzag": HeadTail}


def as_layout(load_balance) -> Layout:
    """``load_balance`` as a `Layout`: None / "none", "head_tail" (or "zigzag"), or a Layout."""
    if load_balance is None:
        return Contiguous()
    if isinstance(load_balance, Layout):
        return load_balance
    if isinstance(load_balance, str) and load_balance in _BY_NAME:
        return _BY_NAME[load_balance]()
    raise ValueError(f"load_balance must be None, 'none', 'head_tail', 'zigzag' or a flexattn.distributed "
                     f"layout (Contiguous, HeadTail, PerDocument), got {load_balance!r}")
