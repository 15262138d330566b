"""Pictures of masks: token level for small lengths, tile level for large ones, as PNG files.

    >>> import flexattn
    >>> from flexattn import masks, viz
    >>> bm = flexattn.create_block_mask(masks.sliding_window(32), None, None, 200, 200, device="cpu", BLOCK_SIZE=16)
    >>> viz.to_png(bm, "/tmp/sliding.png")                    # doctest: +SKIP
    '/tmp/sliding.png'

Token level (every (q_idx, kv_idx) pair; needs the mask_mod): black kept, white masked out.
Tile level (one pixel block per BLOCK_SIZE tile): black full, grey partial, white skipped.
PNG writing uses Pillow (``pip install 'flexattn[plot]'``); matplotlib is never imported, so a
user's matplotlib backend is left alone. ``BlockMask.to_string()`` gives a text picture without
any extra.
"""

from __future__ import annotations

import os
import types

import torch

from flexattn.kernels.tables import block_size_pair, tile_states, validate_mask
from flexattn.reference import dense_block_mask

#: Largest Q_LEN * KV_LEN drawn token by token with ``level="auto"``.
TOKEN_LEVEL_MAX_ELEMENTS = 1024 * 1024
#: Longest side of a written picture, in pixels (small masks are scaled up to about this).
TARGET_PIXELS = 512
# Grey levels: tile states 0 empty, 1 partial, 2 full; tokens False, True.
_TILE_GREY = torch.tensor([255, 150, 0], dtype=torch.uint8)
_TOKEN_GREY = torch.tensor([255, 0], dtype=torch.uint8)
# The mask_mod torch's and flexattn's sliced BlockMasks carry: it only raises.
_SLICED_MASK_MOD = "_sliced_mask_mod_error"


def _select(t: torch.Tensor, batch: int, head: int) -> torch.Tensor:
    """The [rows, cols] slice of (batch, head) from a [B, H, rows, cols] table (B, H of 1 broadcast)."""
    if t.dim() != 4:
        raise ValueError(f"expected a [B, H, rows, cols] table, got shape {tuple(t.shape)}")
    B, H = t.shape[:2]
    for name, i, n in (("batch", batch, B), ("head", head, H)):
        if not (0 <= i < n or n == 1):
            raise IndexError(f"{name} must be in [0, {n}), got {i}")
    return t[min(batch, B - 1), min(head, H - 1)]


def tile_grid(block_mask, batch: int = 0, head: int = 0) -> torch.Tensor:
    """uint8 [nQ, nKV] grey levels of the tiles of (batch, head): 0 full, 150 partial, 255 skipped."""
    validate_mask(block_mask)
    states = tile_states(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                         block_mask.full_kv_indices)
    # The tiles of seq_lengths only: kv_indices may have more columns than KV_LEN has tiles.
    q_block, kv_block = block_size_pair(block_mask.BLOCK_SIZE)
    Q_LEN, KV_LEN = block_mask.seq_lengths
    n_q, n_kv = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    return _TILE_GREY[_select(states, batch, head)[:n_q, :n_kv].long().cpu()]


def token_grid(block_mask, batch: int = 0, head: int = 0) -> torch.Tensor:
    """uint8 [Q_LEN, KV_LEN] grey levels of every pair of (batch, head): 0 kept, 255 masked out.

    Evaluates the mask_mod on the tiles the block mask visits (a dense Q_LEN x KV_LEN tensor of
    this one (batch, head): meant for small lengths).
    """
    Q_LEN, KV_LEN = block_mask.seq_lengths
    B, H = block_mask.kv_num_blocks.shape[:2]
    b, h = min(batch, B - 1), min(head, H - 1)
    _select(block_mask.kv_num_blocks.unsqueeze(-1), batch, head)  # range check
    mask_mod = block_mask.mask_mod

    def at_b_h(b_, h_, q_idx, kv_idx):  # (0, 0) of the one-head tables is (b, h) of the mask
        return mask_mod(b_ + b, h_ + h, q_idx, kv_idx)

    def one(t):
        return None if t is None else t[b:b + 1, h:h + 1]

    # The tables of (b, h) alone: the dense mask of every batch and head would cost B x H times more.
    head_mask = types.SimpleNamespace(
        BLOCK_SIZE=block_mask.BLOCK_SIZE, kv_num_blocks=one(block_mask.kv_num_blocks),
        kv_indices=one(block_mask.kv_indices), full_kv_num_blocks=one(getattr(block_mask, "full_kv_num_blocks", None)),
        full_kv_indices=one(getattr(block_mask, "full_kv_indices", None)))
    keep = dense_block_mask(head_mask, 1, 1, Q_LEN, KV_LEN, mask_mod=at_b_h)[0, 0]
    return _TOKEN_GREY[keep.long().cpu()]


def _has_mask_mod(block_mask) -> bool:
    mask_mod = getattr(block_mask, "mask_mod", None)
    return mask_mod is not None and getattr(mask_mod, "__name__", None) != _SLICED_MASK_MOD


def picture(block_mask, batch: int = 0, head: int = 0, level: str = "auto") -> tuple[torch.Tensor, str]:
    """(uint8 grey image, level) for ``block_mask``: ``level`` is "token", "tile" or "auto"
    (token level up to `TOKEN_LEVEL_MAX_ELEMENTS` pairs when the mask_mod is known)."""
    if level not in ("auto", "token", "tile"):
        raise ValueError(f"level must be 'auto', 'token' or 'tile', got {level!r}")
    Q_LEN, KV_LEN = block_mask.seq_lengths
    if level == "auto":
        small = Q_LEN * KV_LEN <= TOKEN_LEVEL_MAX_ELEMENTS
        level = "token" if small and _has_mask_mod(block_mask) else "tile"
    if level == "token":
        if not _has_mask_mod(block_mask):
            raise ValueError("level='token' needs the block mask's mask_mod, and this one has none (a sliced "
                             "BlockMask); use level='tile'")
        if Q_LEN * KV_LEN > 64 * TOKEN_LEVEL_MAX_ELEMENTS:
            raise ValueError(f"level='token' draws every pair: {Q_LEN} x {KV_LEN} is too many "
                             f"(at most {64 * TOKEN_LEVEL_MAX_ELEMENTS}); use level='tile'")
        return token_grid(block_mask, batch, head), "token"
    return tile_grid(block_mask, batch, head), "tile"


def to_png(block_mask, path: str | os.PathLike, batch: int = 0, head: int = 0, level: str = "auto") -> str:
    """Write the picture of (batch, head) of ``block_mask`` (flexattn's or torch's) to ``path``.

    Returns ``path`` as a str. Needs Pillow (``pip install 'flexattn[plot]'``). Example::

        >>> bm = flexattn.create_block_mask(masks.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
        >>> viz.to_png(bm, "causal.png")                  # doctest: +SKIP
        'causal.png'
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path!r}: the directory {folder!r} does not exist")
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("writing PNG pictures needs Pillow: pip install 'flexattn[plot]' (or pip install Pillow)") \
            from None
    grey, _ = picture(block_mask, batch, head, level)
    rows, cols = grey.shape
    scale = max(1, TARGET_PIXELS // max(rows, cols))
    img = Image.fromarray(grey.contiguous().numpy(), mode="L")
    if scale > 1:
        img = img.resize((cols * scale, rows * scale), Image.NEAREST)
    img.save(path, format="PNG")
    return path
