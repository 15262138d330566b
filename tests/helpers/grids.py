"""Index grids and score tensors for evaluating mods on every (b, h, q_idx, kv_idx)."""

from __future__ import annotations

from typing import Sequence

import torch

from flexattn import ir
from flexattn.ir import Node

MAX_BH = 4  # index grids used with the strategies have B, H <= MAX_BH
MAX_LEN = 128  # ... and Q_LEN, KV_LEN <= MAX_LEN
SCORE_BOUND = 8.0  # |score| <= SCORE_BOUND (see random_score)


def index_grid(B: int, H: int, Q_LEN: int, KV_LEN: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """int32 (b, h, q_idx, kv_idx) shaped [B,1,1,1], [1,H,1,1], [1,1,Q,1], [1,1,1,KV] (broadcast).

    >>> b, h, q_idx, kv_idx = index_grid(2, 3, 5, 7); (q_idx >= kv_idx).shape
    torch.Size([1, 1, 5, 7])
    """
    sizes = (B, H, Q_LEN, KV_LEN)
    out = []
    for d, n in enumerate(sizes):
        shape = [1, 1, 1, 1]
        shape[d] = n
        out.append(torch.arange(n, dtype=torch.int32, device=device).view(shape))
    return tuple(out)


def random_score(B: int, H: int, Q_LEN: int, KV_LEN: int, dtype=torch.float32, seed: int = 0,
                 device="cpu") -> torch.Tensor:
    """A [B, H, Q, KV] score tensor, standard normal times 2, clamped to +-SCORE_BOUND, no zeros."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(B, H, Q_LEN, KV_LEN, generator=g, dtype=torch.float64) * 2).clamp(-SCORE_BOUND, SCORE_BOUND)
    s = torch.where(s == 0, 0.5, s)
    return s.to(dtype).to(device)


def grid_inputs(B: int, H: int, Q_LEN: int, KV_LEN: int, score: torch.Tensor | None = None) -> dict:
    """The ``inputs`` dict `ir.evaluate` takes for a full index grid (plus ``score`` if given)."""
    device = score.device if score is not None else "cpu"
    inputs = dict(zip(ir.INDEX_INPUTS, index_grid(B, H, Q_LEN, KV_LEN, device)))
    if score is not None:
        inputs["score"] = score
    return inputs


def eval_grid(node: Node, buffers: Sequence[torch.Tensor], B: int, H: int, Q_LEN: int, KV_LEN: int,
              score: torch.Tensor | None = None) -> torch.Tensor:
    """``node`` evaluated eagerly (same dtype) at every grid point, broadcast to [B, H, Q, KV]."""
    out = ir.evaluate(node, grid_inputs(B, H, Q_LEN, KV_LEN, score), buffers)
    return out.expand(B, H, Q_LEN, KV_LEN)
