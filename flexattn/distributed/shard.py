"""`shard` / `unshard`: a whole sequence to this rank's shard and back (see `layout`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexattn.distributed import checks
from flexattn.distributed.layout import as_layout


def shard(x: torch.Tensor, group_or_mesh=None, seq_dim: int = 2, load_balance=None) -> torch.Tensor:
    """This rank's shard of ``x`` (the whole sequence along ``seq_dim``, the same on every rank).

    >>> q_local = shard(q, seq_dim=2, load_balance="head_tail")  # doctest: +SKIP
    """
    group = checks.resolve_group(group_or_mesh)
    layout = as_layout(load_balance)
    pos = layout.positions(x.shape[seq_dim], dist.get_world_size(group), dist.get_rank(group), x.device)
    return x.index_select(seq_dim, pos)


def unshard(x: torch.Tensor, group_or_mesh=None, seq_dim: int = 2, load_balance=None,
            seq_len: int | None = None) -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` (the inverse of `shard`; a collective).
    ``seq_len``: the whole length (default: the sum of the shards' lengths). Not differentiable.
    """
    group = checks.resolve_group(group_or_mesh)
    layout = as_layout(load_balance)
    P = dist.get_world_size(group)
    seq_dim = seq_dim % x.dim()
    sizes: list = [None] * P
    dist.all_gather_object(sizes, (tuple(x.shape), str(x.dtype)), group=group)
    total = sum(s[0][seq_dim] for s in sizes) if seq_len is None else seq_len
    lengths = [layout.shard_length(total, P, j) for j in range(P)]
    others = [s[:seq_dim] + s[seq_dim + 1:] for s, _ in sizes]
    if any(o != others[0] for o in others) or any(d != sizes[0][1] for _, d in sizes) or \
            [s[0][seq_dim] for s in sizes] != lengths:
        raise checks.DistributedMismatchError(
            f"unshard: the shards do not form one sequence of length {total} under {layout!r} "
            f"(expected shard lengths {lengths} along dim {seq_dim}; got shapes and dtypes {sizes})")
    longest = max(lengths)
    pad = [0, 0] * (x.dim() - 1 - seq_dim) + [0, longest - x.shape[seq_dim]]
    padded = torch.nn.functional.pad(x, pad).contiguous()
    parts = [torch.empty_like(padded) for _ in range(P)]
    dist.all_gather(parts, padded, group=group)
    pieces = torch.cat([p.narrow(seq_dim, 0, n) for p, n in zip(parts, lengths)], dim=seq_dim)
    pos = torch.cat([layout.positions(total, P, j, x.device) for j in range(P)]).long()
    out = torch.empty_like(pieces)
    return out.index_copy_(seq_dim, pos, pieces)
