"""Eager attention that materialises every score: the oracle for tests, and the semantics in code.

``attention_reference`` computes exactly what `flexattn.flex_attention` computes, without tiles:

    scores[b, h, i, j] = score_mod(scale * q[b, h, i] . k[b, h // G, j], b, h, i, j)
    keep[b, h, i, j]   = the block mask's verdict (full block: True; partial block: mask_mod;
                         block not listed: False), or mask_mod alone, or True
    out[b, h, i]       = softmax_j(where(keep, scores, -inf)) @ v      (0 for a row with no key)
    lse[b, h, i]       = logsumexp_j(where(keep, scores, -inf))         (-inf for a row with no key)

With attention sinks (``sinks`` [Hq]) each row's denominator has one more term, exp(sinks[h]):

    out[b, h, i]       = sum_j exp(s_ij - lse[b, h, i]) v_j,   lse[b, h, i] = log(exp(sinks[h]) + sum_j exp(s_ij))

Run it in float64 (the default) for an oracle, or in the inputs' dtype to measure what eager
computation in that dtype costs (as torch's eager flex_attention: Q K^T and the softmax in float32
for float16/bfloat16 inputs, the probabilities rounded to the inputs' dtype for P V). It reads
block masks with its own few lines of torch rather than `flexattn.block_mask`'s helpers, so that
an oracle bug and a library bug cannot coincide.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from flexattn.mods import Mod


def index_grid(B: int, H: int, Q_LEN: int, KV_LEN: int, device) -> tuple[torch.Tensor, ...]:
    """int32 b, h, q_idx, kv_idx shaped to broadcast to [B, H, Q_LEN, KV_LEN]."""
    out = []
    for d, n in enumerate((B, H, Q_LEN, KV_LEN)):
        shape = [1, 1, 1, 1]
        shape[d] = n
        out.append(torch.arange(n, dtype=torch.int32, device=device).view(shape))
    return tuple(out)


def _vmap_bhqkv(fn: Callable, with_score: bool) -> Callable:
    """``fn`` vmapped over (b, h, q_idx, kv_idx) as torch's eager flex_attention does.

    Python mods are written per element (``bias[b][q_idx]``), so they run under vmap; the score,
    when there is one, is mapped along with every index.
    """
    prefix = (0,) if with_score else ()
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=prefix + dims, out_dims=0)
    return fn


def apply_score_mod(score_mod: Callable | Mod, scores: torch.Tensor) -> torch.Tensor:
    """``score_mod`` at every element of ``scores`` [B, H, Q, KV]; result in scores' dtype."""
    B, H, Q_LEN, KV_LEN = scores.shape
    if scores.numel() == 0:  # nothing to modify (vmap cannot map an empty dimension)
        return scores
    b, h, q_idx, kv_idx = index_grid(B, H, Q_LEN, KV_LEN, scores.device)
    if isinstance(score_mod, Mod):
        out = score_mod(scores, b, h, q_idx, kv_idx)
    else:
        out = _vmap_bhqkv(score_mod, True)(scores, b.flatten(), h.flatten(), q_idx.flatten(), kv_idx.flatten())
    return out.to(scores.dtype).expand(B, H, Q_LEN, KV_LEN)


def evaluate_mask(mask_mod: Callable | Mod, B: int, H: int, Q_LEN: int, KV_LEN: int, device) -> torch.Tensor:
    """``mask_mod`` at every (b, h, q_idx, kv_idx): a bool [B, H, Q_LEN, KV_LEN] tensor."""
    if 0 in (B, H, Q_LEN, KV_LEN):  # no element to evaluate (vmap cannot map an empty dimension)
        return torch.zeros(B, H, Q_LEN, KV_LEN, dtype=torch.bool, device=device)
    b, h, q_idx, kv_idx = index_grid(B, H, Q_LEN, KV_LEN, device)
    if isinstance(mask_mod, Mod):
        out = mask_mod(b, h, q_idx, kv_idx)
    else:
        out = _vmap_bhqkv(mask_mod, False)(b.flatten(), h.flatten(), q_idx.flatten(), kv_idx.flatten())
    return out.to(torch.bool).expand(B, H, Q_LEN, KV_LEN)


def _block_grid(num: torch.Tensor, idx: torch.Tensor, n_kv_blocks: int) -> torch.Tensor:
    """[Bm, Hm, nQ, n_kv_blocks] bool: which KV blocks the first ``num`` entries of ``idx`` list."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()
    hits = torch.zeros(*idx.shape[:3], n_kv_blocks, dtype=torch.int32, device=idx.device)
    hits.scatter_add_(-1, torch.where(listed, idx.long(), 0), listed.to(torch.int32))
    return hits > 0


def dense_block_mask(block_mask, B: int, H: int, Q_LEN: int, KV_LEN: int,
                     mask_mod: Callable | Mod | None = None) -> torch.Tensor:
    """The [B, H, Q_LEN, KV_LEN] bool mask that ``block_mask`` stands for.

    Full blocks keep every element, partial blocks keep what ``mask_mod`` (default: the block
    mask's own) keeps, unlisted blocks keep nothing.
    """
    size = block_mask.BLOCK_SIZE
    q_block, kv_block = (size, size) if isinstance(size, int) else size
    n_q, n_kv = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    device = block_mask.kv_num_blocks.device

    def expand(blocks: torch.Tensor) -> torch.Tensor:
        blocks = blocks[:, :, :n_q, :n_kv]
        e = blocks.repeat_interleave(q_block, dim=2).repeat_interleave(kv_block, dim=3)
        return e[:, :, :Q_LEN, :KV_LEN].expand(B, H, Q_LEN, KV_LEN)

    partial = expand(_block_grid(block_mask.kv_num_blocks, block_mask.kv_indices, n_kv))
    mask_mod = mask_mod if mask_mod is not None else getattr(block_mask, "mask_mod", None)
    keep = partial if mask_mod is None else partial & evaluate_mask(mask_mod, B, H, Q_LEN, KV_LEN, device)
    if getattr(block_mask, "full_kv_num_blocks", None) is not None:
        keep = keep | expand(_block_grid(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_kv))
    return keep


def attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        score_mod: Callable | Mod | None = None, block_mask=None,
                        mask_mod: Callable | Mod | None = None, scale: float | None = None,
                        enable_gqa: bool = False, return_lse: bool = False,
                        dtype: torch.dtype | None = torch.float64, sinks: torch.Tensor | None = None):
    """Eager flex attention (see the module docstring); ``dtype=None`` computes in the inputs' dtype.
    ``sinks``: [Hq] attention-sink logits or None.

    ``mask_mod`` without ``block_mask`` masks element-wise; with it, it replaces the block mask's
    own mask_mod on partial blocks. The output and LSE come back in ``dtype`` (float32 LSE for
    float16/bfloat16).

    >>> q, k, v = (torch.randn(1, 1, 5, 16) for _ in range(3))
    >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    >>> attention_reference(q, k, v, mask_mod=causal)[0, 0, 0].allclose(v[0, 0, 0].double())
    True
    """
    dtype = dtype or query.dtype
    low = dtype in (torch.float16, torch.bfloat16)
    work = torch.float32 if low else dtype  # softmax precision
    B, Hq, Q_LEN, E = query.shape
    _, Hkv, KV_LEN, Ev = value.shape
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"query has {Hq} heads, key/value {Hkv}: pass enable_gqa=True")
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    if Hq != Hkv:
        k, v = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
    k, v = k.expand(B, Hq, KV_LEN, E), v.expand(B, Hq, KV_LEN, Ev)
    scale = 1.0 / math.sqrt(E) if scale is None else scale

    # Q K^T in the softmax precision, as torch's eager flex_attention (float32 for float16/bfloat16
    # inputs): rounding the scores to the inputs' dtype would cost far more than that dtype does
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale
    if score_mod is not None:
        scores = apply_score_mod(score_mod, scores)
    if block_mask is not None:
        keep = dense_block_mask(block_mask, B, Hq, Q_LEN, KV_LEN, mask_mod)
    elif mask_mod is not None:
        keep = evaluate_mask(mask_mod, B, Hq, Q_LEN, KV_LEN, query.device)
    else:
        keep = None
    if keep is not None:
        scores = scores.masked_fill(~keep, -math.inf)

    # Softmax measured from the row max (the sink's included); a row of -inf measures from 0 so
    # that it gives 0, not NaN.
    # (KV_LEN = 0: every row sees no key, and amax refuses an empty dimension)
    row_max = scores.amax(dim=-1, keepdim=True) if KV_LEN else scores.new_full((*scores.shape[:-1], 1), -math.inf)
    if sinks is not None:
        sink = sinks.to(work).view(1, Hq, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(row_max == -math.inf, 0.0, row_max)
    p = torch.exp(scores - row_max)
    total = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sink - row_max)
    probs = p / torch.where(total == 0, 1.0, total)
    out = probs.to(dtype) @ v
    if not return_lse:
        return out
    lse = (row_max + torch.log(total)).squeeze(-1)
    return out, lse
