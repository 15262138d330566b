"""Split-KV decoding: attention for a few query rows against a long KV cache.

`decode_attention` has flex_attention's semantics (score_mod, mask_mod + BlockMask, GQA, LSE,
K/V batch broadcast, E != Ev) and is what `flex_attention` dispatches to when the query is short.
The kernel packs every query head that shares a KV head into one row tile, splits the KV range
over SPLIT_KV programs so the GPU is full, and merges their partial results with a log-sum-exp
reduction (see flexattn/codegen/templates/decode.py).

It shares flex_attention's call path (`flexattn.call.attend`): mods resolved once, one plan
per shape class (`flexattn.kernels.decode`), then allocation and launch. Nothing reads tensor
values on the host, so a decode step can be captured in a CUDA graph. Serving patterns:

    pos = torch.tensor(1000, device="cuda", dtype=torch.int32)     # 0-d: updated in place
    lengths = torch.tensor([1001, 517], device="cuda", dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, mask_mod=causal_at(pos), kv_lengths=lengths)

Example:
    >>> q = torch.randn(2, 8, 1, 64); k = torch.randn(2, 2, 300, 64); v = torch.randn(2, 2, 300, 64)
    >>> out, lse = decode_attention(q, k, v, enable_gqa=True, return_lse=True)
"""

from __future__ import annotations

from typing import Any

import torch

from flexattn import call, ir, modcache
from flexattn.block_mask import as_mod
from flexattn.mods import MASK, Mod


# ---------------------------------------------------------------------------------------------
# Serving helpers: mods that capture 0-d / per-batch tensors (read in-kernel, graph friendly).


def causal_at(pos: torch.Tensor) -> Mod:
    """Causal mask for query rows that sit at positions ``pos + q_idx`` of the cache.

    ``pos`` is a 0-d integer tensor; update it in place (``pos.fill_(n)`` or ``pos += 1``) between
    decode steps — the kernel reads it, so a captured CUDA graph stays valid.

        >>> pos = torch.tensor(99, dtype=torch.int32)
        >>> mask = causal_at(pos)          # q_idx + pos >= kv_idx
    """
    if not isinstance(pos, torch.Tensor) or pos.dim() != 0 or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise TypeError(f"pos must be a 0-d integer tensor, got {_describe(pos)}")
    buf = ir.Buffer(0, "pos", pos.dtype, 0)
    q, kv = ir.input_("q_idx"), ir.input_("kv_idx")
    root = ir.binary("ge", ir.binary("add", q, ir.load(buf, [])), kv)
    return Mod(MASK, root, [pos], name="causal_at_pos")


def valid_length(lengths: torch.Tensor) -> Mod:
    """Mask that keeps ``kv_idx < lengths[b]`` (a KV cache allocated longer than it is filled).

    ``decode_attention(..., kv_lengths=lengths)`` does the same and also skips the unused tail;
    this mask form composes with other masks (``and_masks``) and works in every kernel.

        >>> lengths = torch.tensor([5, 300], dtype=torch.int32)
        >>> mask = valid_length(lengths)
    """
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.dtype.is_floating_point:
        raise TypeError(f"lengths must be a 1-d integer tensor [B], got {_describe(lengths)}")
    buf = ir.Buffer(0, "lengths", lengths.dtype, 1)
    root = ir.binary("lt", ir.input_("kv_idx"), ir.load(buf, [ir.input_("b")]))
    return Mod(MASK, root, [lengths], name="valid_length")


def causal_at_with_length(pos: torch.Tensor, lengths: torch.Tensor) -> Mod:
    """``causal_at(pos) & valid_length(lengths)`` as one mask (per-batch cache fill + offset)."""
    a = causal_at(pos)
    bufb = ir.Buffer(1, "lengths", lengths.dtype, 1)
    rhs = ir.binary("lt", ir.input_("kv_idx"), ir.load(bufb, [ir.input_("b")]))
    return Mod(MASK, ir.binary("and_", a.ir, rhs), [pos, lengths], name="causal_at_with_length")


# ---------------------------------------------------------------------------------------------
# Entry point


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     score_mod=None, mask_mod=None, block_mask=None,
                     scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                     kernel_options: dict | None = None, *, kv_lengths: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None):
    """flex_attention for short queries: ``softmax(score_mod(q k^T * scale) masked) v``.

    Args:
        query: [B, Hq, Q_LEN, E]; key: [B or 1, Hkv, KV_LEN, E]; value: [B or 1, Hkv, KV_LEN, Ev].
        score_mod, mask_mod: `Mod`s or Python mods (traced once per fingerprint).
            mask_mod runs on the BlockMask's partial tiles; without a BlockMask, on every tile.
            If it is None, the BlockMask's own mask_mod (Python or `Mod`) is used.
        block_mask: a BlockMask (torch's or flexattn's fields) or None (every tile visited).
        scale: softmax scale, default 1/sqrt(E). enable_gqa: allow Hq a multiple of Hkv.
        return_lse: also return the natural-log LSE, float32 [B, Hq, Q_LEN] (-inf for rows that
            see nothing; their output is 0).
        kernel_options: see `flexattn.kernels.options.OPTIONS` (the decoding knobs: SPLIT_KV,
            BLOCK_N, BLOCK_M, num_warps, num_stages, PROGRAMS_PER_SM, MIN_TILES_PER_SPLIT,
            INPUT_PRECISION; the others are accepted and ignored here).
        kv_lengths: optional int tensor [B]: only kv positions < kv_lengths[b] exist for batch b
            (read in-kernel; positions past it are neither read nor attended).
        sinks: optional [Hq] attention-sink logits, as in `flex_attention` (added once, when the
            splits' partial results are merged; a row that sees nothing gets LSE sinks[h]).

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 32), torch.randn(1, 4, 100, 32), torch.randn(1, 4, 100, 32)
        >>> decode_attention(q, k, v).shape
        torch.Size([1, 4, 3, 32])
    """
    if kv_lengths is not None and not isinstance(kv_lengths, torch.Tensor):
        raise TypeError(f"kv_lengths must be an integer tensor [B] or None, got {_describe(kv_lengths)}")
    override = None
    if mask_mod is not None:
        if isinstance(mask_mod, Mod):
            as_mod(mask_mod, MASK, "mask_mod")  # kind check
            override = (mask_mod, mask_mod.buffers)
        else:
            if not callable(mask_mod):
                raise TypeError(f"mask_mod must be a callable mask_mod or a flexattn Mod, got {_describe(mask_mod)}")
            override = modcache.resolve(mask_mod, MASK, torch.float32, getattr(query, "device", None),
                                        lambda f, kind, **kw: as_mod(f, MASK, "mask_mod"))
    out, lse, _ = call.attend(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                                   False, True, kv_lengths=kv_lengths, mask_override=override, want_lse=return_lse,
                                   sinks=sinks)
    return (out, lse) if return_lse else out
