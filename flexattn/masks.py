"""Ready-made mask mods: one family per function (``flexattn.masks.sliding_window(256)``).

Every function returns (or is) a plain Python ``mask_mod(b, h, q_idx, kv_idx) -> bool`` with a
telling ``__name__``. They work in ``flexattn.create_block_mask`` / ``flex_attention`` and, written
with torch operations only, unchanged in torch's own ``torch.nn.attention.flex_attention``.
Combine them with ``flexattn.and_masks`` / ``or_masks``:

    >>> import flexattn
    >>> from flexattn import masks
    >>> longformer = flexattn.or_masks(masks.sliding_window(256), masks.global_tokens(4))
    >>> bm = flexattn.create_block_mask(longformer, None, None, 1024, 1024, device="cpu")

Pictures of each family: ``docs/gallery.md``.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["causal", "sliding_window", "chunked", "prefix_lm", "document", "dilated_sliding_window",
           "global_tokens", "natten"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return fn


def causal(b, h, q_idx, kv_idx):
    """Causal: query ``i`` sees keys ``0..i``.

    Example::

        >>> bm = flexattn.create_block_mask(masks.causal, None, None, 512, 512, device="cpu")
    """
    return q_idx >= kv_idx


def sliding_window(window: int) -> Callable:
    """Causal sliding window: query ``i`` sees the ``window`` keys ``i - window + 1 .. i``.

    Example::

        >>> local = masks.sliding_window(128)      # Mistral-style local attention
        >>> local.__name__
        'sliding_window_128'
    """
    _positive_int("window", window)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return _named(mask, f"sliding_window_{window}")


def chunked(chunk: int, causal: bool = True) -> Callable:
    """Chunked attention (Llama 4): tokens see only their own ``chunk``-token chunk (causally).

    ``causal=False`` makes each chunk bidirectional (block-diagonal attention).

    Example::

        >>> masks.chunked(8192).__name__
        'chunked_causal_8192'
    """
    _positive_int("chunk", chunk)
    if causal:
        def mask(b, h, q_idx, kv_idx):
            return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)
    else:
        def mask(b, h, q_idx, kv_idx):
            return q_idx // chunk == kv_idx // chunk
    return _named(mask, f"chunked{'_causal' if causal else ''}_{chunk}")


def prefix_lm(prefix_length: int | torch.Tensor) -> Callable:
    """Prefix LM: the first ``prefix_length`` tokens are seen by everyone, the rest causally.

    ``prefix_length`` is an int, or a [B] integer tensor giving each sequence its own prefix.

    Example::

        >>> m = masks.prefix_lm(torch.tensor([3, 10]))    # per-sequence prefixes
    """
    if isinstance(prefix_length, torch.Tensor):
        if prefix_length.dim() != 1 or prefix_length.dtype.is_floating_point or prefix_length.dtype == torch.bool:
            raise ValueError(f"prefix_length must be an int or a 1-D [B] integer tensor, got a "
                             f"{prefix_length.dim()}-d {prefix_length.dtype} tensor")
        prefix = prefix_length

        def mask(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | (q_idx >= kv_idx)

        return _named(mask, "prefix_lm")
    if isinstance(prefix_length, bool) or not isinstance(prefix_length, int) or prefix_length < 0:
        raise ValueError(f"prefix_length must be a non-negative int or a [B] tensor, got {prefix_length!r}")

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)

    return _named(mask, f"prefix_lm_{prefix_length}")


# id dtypes that int32 holds one to one (the mask only compares ids for equality); int64 ids stay
# (the block mask reads them as int32 ranks, flexattn/block_mask/ranks.py), uint64 ones seen as int64
_NARROW_IDS = (torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32)


def _document_ids(document_ids, lengths, offsets) -> torch.Tensor:
    given = [n for n, v in (("document_ids", document_ids), ("lengths", lengths), ("offsets", offsets))
             if v is not None]
    if len(given) != 1:
        raise ValueError(f"document() needs exactly one of document_ids, lengths, offsets; got "
                         f"{', '.join(given) if given else 'none'}")
    name = given[0]
    value = {"document_ids": document_ids, "lengths": lengths, "offsets": offsets}[name]
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    if value.dtype.is_floating_point or value.dtype == torch.bool or value.dtype.is_complex:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    if name == "document_ids":
        if value.dim() not in (1, 2):
            raise ValueError(f"document_ids must be [S] or [B, S], got shape {tuple(value.shape)}")
        return value
    if value.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if name == "offsets":  # [0, end_0, end_1, ...] as in torch's nested jagged tensors
        if value.numel() < 2 or int(value[0]) != 0:
            raise ValueError(f"offsets must start at 0 and have at least 2 entries, got {value.tolist()}")
        value = value.diff()
    if (value < 0).any():
        raise ValueError(f"{name} must not decrease / be negative, got {value.tolist()}")
    return torch.repeat_interleave(torch.arange(len(value), dtype=torch.int32, device=value.device), value.long())


def document(document_ids=None, *, lengths=None, offsets=None, causal: bool = False, device=None) -> Callable:
    """Packed documents: a token sees only tokens of its own document (causally on request).

    Give exactly one of ``document_ids`` ([S], or [B, S] per sequence; any integer labels),
    ``lengths`` ([n_docs], packed in order) or ``offsets`` ([n_docs + 1], starting at 0: the
    layout of a nested jagged tensor's ``offsets()``). The documents must cover the whole
    sequence: build the block mask for exactly ``sum(lengths)`` tokens. The mask reads a tensor of
    document ids on ``device`` (default: the given tensor's, the CPU for a list), which must be
    the block mask's and the queries' device.

    Example::

        >>> docs = masks.document(lengths=[300, 200, 524], causal=True)
        >>> bm = flexattn.create_block_mask(docs, None, None, 1024, 1024, device="cpu")
        >>> on_gpu = masks.document(lengths=[300, 200, 524], device="cuda")  # doctest: +SKIP
    """
    ids = _document_ids(document_ids, lengths, offsets).to(device=device)
    if ids.dtype == torch.uint64:
        ids = ids.view(torch.int64)
    elif ids.dtype in _NARROW_IDS:
        ids = ids.to(torch.int32)
    if ids.dim() == 2:
        if causal:
            def mask(b, h, q_idx, kv_idx):
                return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
        else:
            def mask(b, h, q_idx, kv_idx):
                return ids[b, q_idx] == ids[b, kv_idx]
    else:
        if causal:
            def mask(b, h, q_idx, kv_idx):
                return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
        else:
            def mask(b, h, q_idx, kv_idx):
                return ids[q_idx] == ids[kv_idx]
    return _named(mask, "document_causal" if causal else "document")


def dilated_sliding_window(window: int, dilation: int) -> Callable:
    """Causal dilated window: query ``i`` sees keys ``i, i - dilation, i - 2*dilation, ...`` within ``window`` tokens.

    Example::

        >>> m = masks.dilated_sliding_window(64, 4)    # 16 keys per query
    """
    _positive_int("window", window)
    _positive_int("dilation", dilation)

    def mask(b, h, q_idx, kv_idx):
        dist = q_idx - kv_idx
        return (dist >= 0) & (dist < window) & (dist % dilation == 0)

    return _named(mask, f"dilated_sliding_window_{window}_{dilation}")


def global_tokens(num_global: int) -> Callable:
    """The first ``num_global`` tokens see and are seen by every token (Longformer's global tokens).

    Alone this keeps only the global rows and columns; combine it with a local mask:

    Example::

        >>> sinks = flexattn.or_masks(masks.sliding_window(1024), masks.global_tokens(4))
    """
    _positive_int("num_global", num_global)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx < num_global) | (kv_idx < num_global)

    return _named(mask, f"global_tokens_{num_global}")


def natten(image_width: int, kernel_height: int, kernel_width: int | None = None,
           image_height: int | None = None) -> Callable:
    """2-D neighbourhood attention (NATTEN) over an image flattened row by row.

    Token ``i`` is pixel ``(i // image_width, i % image_width)``. It sees the ``kernel_height x
    kernel_width`` pixels around it; near the border the window is shifted inward so that it
    keeps its full size (NATTEN's rule), which needs ``image_height``
    (default: a square image, ``image_width``). Kernel sizes must be odd and fit the image.

    Example::

        >>> m = masks.natten(image_width=32, kernel_height=7)   # 7x7 windows over a 32x32 image
        >>> bm = flexattn.create_block_mask(m, None, None, 32 * 32, 32 * 32, device="cpu")
    """
    W = _positive_int("image_width", image_width)
    H = _positive_int("image_height", image_height) if image_height is not None else W
    KH = _positive_int("kernel_height", kernel_height)
    KW = _positive_int("kernel_width", kernel_width) if kernel_width is not None else KH
    for name, k, n in (("kernel_height", KH, H), ("kernel_width", KW, W)):
        if k % 2 == 0 or k > n:
            raise ValueError(f"{name} must be odd and at most the image's size {n}, got {k}")
    rh, rw = KH // 2, KW // 2

    def mask(b, h, q_idx, kv_idx):
        q_row, q_col = q_idx // W, q_idx % W
        kv_row, kv_col = kv_idx // W, kv_idx % W
        # the window's centre, moved inward near the border
        c_row = torch.clamp(q_row, rh, H - 1 - rh)
        c_col = torch.clamp(q_col, rw, W - 1 - rw)
        return ((c_row - kv_row).abs() <= rh) & ((c_col - kv_col).abs() <= rw)

    return _named(mask, f"natten_{H}x{W}_{KH}x{KW}")
