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
- `WholeDocuments`: documents kept whole, consecutive documents per rank, cut where the ranks'
  causal work is most even: no document spans two ranks, so every pair of different shards is
  empty and the ring sends nothing. Balanced where there are many documents, none much longer
  than the sequence / P.
"""

from __future__ import annotations

import torch

from flexattn.kernels import launch, mask_tiles
from flexattn.lru import LRU

# (layout key, length, world size, rank, device) -> positions, and (layout key, length, world
# size, "tiled", block, device) -> `Layout.tiled_positions`: a block mask's build reads every
# shard's, and a training loop builds a mask of the same layout for every batch
_POSITIONS = LRU(256)


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
    if len(runs) <= _FEW_RUNS:
        return torch.cat([torch.arange(a, b, dtype=torch.int32, device=device) for a, b in runs])
    # (many runs, as a per-document layout's two per document: a few ops, not an arange each. A
    # position is its local index plus its run's shift; the shifts and lengths copied to the
    # device from pinned memory, with no stream sync)
    shifts, lengths, at = [], [], 0
    for a, b in runs:
        shifts.append(a - at)
        lengths.append(b - a)
        at += b - a
    shifts_t, lengths_t = launch.to_device([shifts, lengths], torch.int32, device)
    return torch.arange(at, dtype=torch.int32, device=device) + torch.repeat_interleave(shifts_t, lengths_t,
                                                                                        output_size=at)


_FEW_RUNS = 2  # (head-tail's two per shard: one arange each is fewer ops)


class Layout:
    """Base of the load balancers: `runs` says which global positions a rank holds."""

    name = "layout"

    def runs(self, length: int, world_size: int, rank: int) -> list[tuple[int, int]]:
        """The rank's shard as consecutive runs of global positions [begin, end), in local order."""
        raise NotImplementedError

    def positions(self, length: int, world_size: int, rank: int, device=None) -> torch.Tensor:
        """int32 global position of each local index of ``rank``'s shard (made once per layout,
        length, rank and device, and shared: read it, do not change it).

        >>> HeadTail().positions(10, 2, 0).tolist()
        [0, 1, 2, 8, 9]
        """
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (self.key(), length, world_size, rank, device)
        hit = _POSITIONS.get(key)
        if hit is None:
            hit = _runs_to_positions(self.runs(length, world_size, rank), device)
            _POSITIONS[key] = hit
        return hit

    def tiled_positions(self, length: int, world_size: int, block: int, device=None) -> tuple:
        """Every shard's positions side by side, each padded to ``n`` blocks of ``block`` (``n``:
        the longest shard's block count): ``(positions, kept, n)``, int32 positions (0 in the
        padding) and bool, False in the padding, or None where no shard is padded (a mask then
        reads no table of kept keys). Blocks ``n * j .. n * j + n - 1`` are shard j's,
        so one block mask over them holds every shard's tiles (made once per layout, length and
        block, and shared).

        >>> pos, kept, n = HeadTail().tiled_positions(10, 2, 4)
        >>> n, pos.tolist(), kept.int().tolist()
        (2, [0, 1, 2, 8, 9, 0, 0, 0, 3, 4, 5, 6, 7, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0])
        """
        shards = [self.positions(length, world_size, j, device) for j in range(world_size)]
        key = (self.key(), length, world_size, "tiled", block, shards[0].device)
        hit = _POSITIONS.get(key)
        if hit is None:
            n = max(1, max(-(-s.numel() // block) for s in shards))
            positions = torch.zeros(world_size, n * block, dtype=torch.int32, device=shards[0].device)
            kept = torch.zeros(world_size, n * block, dtype=torch.bool, device=shards[0].device)
            for j, s in enumerate(shards):
                positions[j, :s.numel()] = s
                kept[j, :s.numel()] = True
            padded = any(s.numel() < n * block for s in shards)
            hit = (positions.flatten(), kept.flatten() if padded else None, n)
            for table in hit[:2] if padded else hit[:1]:
                mask_tiles.keep_summary(table)
            _POSITIONS[key] = hit
        return hit

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
        self.document_lengths = _documents(document_lengths, "PerDocument")

    def runs(self, length, world_size, rank):
        _check_total(self.document_lengths, length, "PerDocument")
        out, start = [], 0
        for n in self.document_lengths:
            out += _head_tail(start, n, world_size, rank)
            start += n
        return [(a, b) for a, b in out if b > a]

    def key(self):
        return (self.name, self.document_lengths)

    def __repr__(self) -> str:
        return f"PerDocument({list(self.document_lengths)})"


def _documents(document_lengths, layout: str) -> tuple[int, ...]:
    lengths = [int(n) for n in (document_lengths.tolist() if isinstance(document_lengths, torch.Tensor)
                                else document_lengths)]
    if not lengths or any(n <= 0 for n in lengths):
        raise ValueError(f"{layout} needs positive document lengths, got {lengths}")
    return tuple(lengths)


def _check_total(lengths: tuple[int, ...], length: int, layout: str) -> None:
    if sum(lengths) != length:
        raise ValueError(f"{layout}: the document lengths sum to {sum(lengths)}, but the sequence length is {length}")


class WholeDocuments(Layout):
    """Whole documents, consecutive ones per rank, cut at the document boundaries that make the
    largest rank's causal work (the sum of n (n + 1) / 2 over its documents) smallest.

    No document spans two shards, so a document mask keeps no pair of different shards: the ring
    skips every step but a rank's own, with its transfer. A document whose own work exceeds the
    sequence's / P leaves its rank with more than its share (`PerDocument` splits documents
    instead). Needs at least as many documents as ranks.

    >>> [WholeDocuments([6, 2, 2, 5]).runs(15, 2, r) for r in range(2)]
    [[(0, 6)], [(6, 15)]]
    """

    name = "whole_documents"

    def __init__(self, document_lengths):
        self.document_lengths = _documents(document_lengths, "WholeDocuments")
        self._cuts: dict[int, list[int]] = {}

    def runs(self, length, world_size, rank):
        _check_total(self.document_lengths, length, "WholeDocuments")
        if len(self.document_lengths) < world_size:
            raise ValueError(f"WholeDocuments: {len(self.document_lengths)} documents cannot fill {world_size} "
                             f"ranks (one document at least each); use PerDocument")
        cuts = self._cuts.get(world_size)
        if cuts is None:
            cuts = self._cuts[world_size] = _balanced_cuts(self.document_lengths, world_size)
        return [(cuts[rank], cuts[rank + 1])]

    def key(self):
        return (self.name, self.document_lengths)

    def __repr__(self) -> str:
        return f"WholeDocuments({list(self.document_lengths)})"


def _balanced_cuts(lengths: tuple[int, ...], parts: int) -> list[int]:
    """Positions ``0 = c_0 < c_1 < ... < c_parts = sum(lengths)`` at document boundaries that
    minimise the largest part's work (binary search on that bound; packing documents greedily in
    order decides whether a bound can be met, cutting early where the documents left are just
    enough to give every part one). ``len(lengths) >= parts``."""
    work = [n * (n + 1) // 2 for n in lengths]

    def pack(bound: int) -> list[int] | None:
        ends, load = [], 0
        for i, w in enumerate(work):
            if i and (load + w > bound or len(work) - i == parts - 1 - len(ends)):
                ends.append(i)
                load = 0
            load += w
        return ends if len(ends) < parts else None

    lo, hi = max(work), sum(work)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pack(mid) is not None else (mid + 1, hi)
    ends = pack(lo)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return [0] + [starts[i] for i in ends] + [starts[-1]]


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
                     f"layout (Contiguous, HeadTail, PerDocument, WholeDocuments), got {load_balance!r}")
