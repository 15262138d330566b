"""Hugging Face transformers: ``attn_implementation="flexattn"``.

    >>> import flexattn.integrations.transformers as fa_hf
    >>> fa_hf.register()                                   # once per process
    'flexattn'
    >>> # model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flexattn")

`register` adds flexattn to transformers' two registries under one name:

- ``AttentionInterface``: `attention_forward` runs ``flexattn.flex_attention`` for every attention
  layer (GQA, softcapping, attention sinks, a dense 4-D mask if a caller passes one);
- ``AttentionMaskInterface``: `block_mask` turns transformers' mask function (causal, sliding
  window, chunked, packed sequences, ... composed as ``mask_function(batch_idx, head_idx, q_idx,
  kv_idx)``) plus the 2-D padding mask into a flexattn `BlockMask`. The mask function is traced,
  not evaluated densely: no [B, Q, KV] tensor is built, so a long prefill costs what its
  attention costs. The query/KV offsets of a KV cache are captured as 0-d tensors, so the traced
  mask -- and with it the compiled kernel -- is the same at every decoding step.

transformers is an optional dependency: ``pip install 'flexattn[transformers]'``.
"""

from __future__ import annotations

from typing import Callable

import torch

import flexattn

NAME = "flexattn"


def _transformers():
    try:
        import transformers
        from transformers import masking_utils
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("flexattn.integrations.transformers needs Hugging Face transformers: "
                          "pip install 'flexattn[transformers]'") from e
    return transformers, masking_utils


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` (default ``"flexattn"``) available in transformers.

    Registers `attention_forward` in ``transformers.AttentionInterface`` and `block_mask` in
    ``transformers.masking_utils.AttentionMaskInterface``; calling it again is harmless. Returns
    ``name``.

    Example::

        >>> from flexattn.integrations import transformers as fa_hf
        >>> fa_hf.register()
        'flexattn'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    transformers, masking_utils = _transformers()
    transformers.AttentionInterface.register(name, attention_forward)
    masking_utils.AttentionMaskInterface.register(name, block_mask)
    return name


def _offset(value, name: str, device) -> torch.Tensor:
    """A 0-d int32 tensor (captured by the mask, so its value is not part of the kernel's key)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be an int or a one-element tensor, got shape {tuple(value.shape)}")
        return value.reshape(()).to(device=device, dtype=torch.int32)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or a one-element tensor, got {value!r}")
    return torch.tensor(value, dtype=torch.int32, device=device)


def block_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
               mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
               device="cpu", **kwargs) -> flexattn.BlockMask:
    """transformers' mask description as a flexattn `BlockMask` (its ``AttentionMaskInterface`` signature).

    ``mask_function(batch_idx, head_idx, q_idx, kv_idx)`` sees absolute positions: ``q_idx +
    q_offset`` and ``kv_idx + kv_offset``. ``attention_mask`` is the 2-D [batch_size, >=
    kv_offset + kv_length] padding mask (True / 1 = a real token); columns past its end count as
    padding. Other keyword arguments transformers passes (``dtype``, ``config``, ``use_vmap``,
    ``allow_is_causal_skip``) do not apply and are ignored.

    Example::

        >>> from transformers.masking_utils import causal_mask_function
        >>> pad = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        >>> bm = block_mask(2, 6, 6, mask_function=causal_mask_function, attention_mask=pad)
        >>> bm.shape
        (2, 1, 6, 6)
    """
    if mask_function is None:
        mask_function = _transformers()[1].causal_mask_function
    device = torch.device(device)
    q_off = _offset(q_offset, "q_offset", device)
    kv_off = _offset(kv_offset, "kv_offset", device)
    padding = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
                or attention_mask.shape[0] not in (1, batch_size):
            raise ValueError(f"attention_mask must be a 2-D [batch_size={batch_size}, kv_length] padding mask, got "
                             f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask!r}")
        padding = attention_mask.to(device=device, dtype=torch.bool)
        start = int(kv_off)
        needed = start + kv_length
        if padding.shape[1] < needed:  # positions past the mask's end are padding
            padding = torch.nn.functional.pad(padding, (0, needed - padding.shape[1]), value=False)
        if bool(padding[:, start:needed].all()):
            padding = None  # no padding: keep the mask free of the gather (and its tiles decidable)
        else:
            padding = padding.expand(batch_size, -1)

    if padding is None:
        def hf_mask(b, h, q_idx, kv_idx):
            return mask_function(b, h, q_idx + q_off, kv_idx + kv_off)
    else:
        # Flattened to 1-D (row length as a 0-d tensor): gathers from 1-D tensors have exact
        # per-tile bounds in the interval analysis, so padded and unpadded tiles are decided
        # without evaluating them, and the traced mask does not change as the cache grows.
        row = torch.tensor(padding.shape[1], dtype=torch.int32, device=device)
        flat = padding.reshape(-1)

        def hf_mask(b, h, q_idx, kv_idx):
            kv = kv_idx + kv_off
            return mask_function(b, h, q_idx + q_off, kv) & flat[b * row + kv]

    return flexattn.create_block_mask(hf_mask, batch_size, None, q_length, kv_length, device=device)


def _is_block_mask(mask) -> bool:
    return hasattr(mask, "kv_num_blocks") and hasattr(mask, "kv_indices")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, scaling: float | None = None, dropout: float = 0.0,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      position_bias: torch.Tensor | None = None, **kwargs):
    """transformers' attention-function signature, computed by ``flexattn.flex_attention``.

    ``query`` is [B, Hq, Q, E], ``key``/``value`` [B, Hkv, KV, E] (GQA when Hkv < Hq).
    ``attention_mask`` is a `BlockMask` (from `block_mask`; flexattn's or torch's), a 4-D dense mask
    [B, 1, Q, >=KV] (bool: True keeps; float: added to the scores), or None (no mask).
    ``softcap`` caps the scores with ``softcap * tanh(score / softcap)``; ``s_aux`` ([Hq]) are
    attention-sink logits, passed to the kernels as ``sinks`` (each row's normaliser gets
    exp(s_aux[h]), no extra pass); ``position_bias`` [B or 1, Hq or 1, Q,
    KV] is added to the scores. ``kernel_options`` in ``kwargs`` go to flex_attention. Returns
    ``(out [B, Q, Hq, Ev], None)``: attention weights are never materialised.
    """
    if dropout and module is not None and getattr(module, "training", False):
        raise ValueError(f"flexattn attention has no dropout; got dropout={dropout} in training mode. Set the "
                         "model's attention dropout to 0 (e.g. config.attention_dropout = 0.0)")
    block = None
    dense = None
    if attention_mask is None:
        pass
    elif _is_block_mask(attention_mask):
        block = attention_mask
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        dense = attention_mask[..., : key.shape[-2]]
    else:
        raise TypeError("attention_mask must be a BlockMask, a 4-D tensor or None, got "
                        f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__}")

    B, Hq, Q_LEN, _ = query.shape
    Hkv, KV_LEN = key.shape[1], key.shape[2]
    if dense is not None:  # gathers read [b, 0, q, kv]: give size-1 dims their real extent (a view)
        dense = dense.expand(B, 1, Q_LEN, KV_LEN)
    if position_bias is not None:
        position_bias = position_bias.expand(B, Hq, Q_LEN, KV_LEN)
    score_mod = _score_mod(softcap, dense, position_bias)
    out = flexattn.flex_attention(query, key, value, score_mod=score_mod, block_mask=block, scale=scaling,
                                  enable_gqa=Hq != Hkv, kernel_options=kwargs.get("kernel_options"), sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def _score_mod(softcap, dense, position_bias):
    """One score_mod for the optional pieces (None when there are none: the kernel's plain path)."""
    if softcap is None and dense is None and position_bias is None:
        return None
    if dense is not None and dense.dtype == torch.bool:
        keep = dense
        dense = None
    else:
        keep = None

    def hf_score(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if dense is not None:
            score = score + dense[b, 0, q_idx, kv_idx]
        if position_bias is not None:
            score = score + position_bias[b, h, q_idx, kv_idx]
        if keep is not None:
            score = torch.where(keep[b, 0, q_idx, kv_idx], score, -float("inf"))
        return score

    return hf_score
