"""Ready-made score mods: one family per function (``flexattn.scores.alibi(16)``).

Every function returns a plain Python ``score_mod(score, b, h, q_idx, kv_idx) -> score`` with a
telling ``__name__``, usable in ``flexattn.flex_attention`` and unchanged in torch's own
``flex_attention``. Tables they capture are ordinary tensors: give them ``requires_grad=True``
and flexattn's backward computes their gradients (a learnable bias).

    >>> import torch, flexattn
    >>> from flexattn import scores
    >>> q, k, v = (torch.randn(1, 4, 64, 16) for _ in range(3))
    >>> out = flexattn.flex_attention(q, k, v, score_mod=scores.alibi(4))
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["alibi", "alibi_slopes", "softcap", "relative_bias", "t5_bucketed_bias", "t5_buckets"]


def _named(fn: Callable, name: str) -> Callable:
    fn.__name__ = fn.__qualname__ = name
    return fn


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.): ``2^(-8 i / n)`` for a power-of-two ``n`` heads,
    interleaved from the next power of two otherwise. float32 [num_heads].

    Example::

        >>> scores.alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    _positive_int("num_heads", num_heads)

    def power_of_two(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest != num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def alibi(num_heads: int, slopes: torch.Tensor | None = None, device=None) -> Callable:
    """ALiBi: adds ``slope[h] * (kv_idx - q_idx)`` (a penalty growing with distance into the past).

    ``slopes`` ([num_heads]) defaults to `alibi_slopes` on ``device`` (the queries' device; the
    CPU by default); pass your own (e.g. learnable) ones on the queries' device instead.
    Use it with a causal mask, as ALiBi models do.

    Example::

        >>> mod = scores.alibi(8)
        >>> mod.__name__
        'alibi_8'
        >>> on_gpu = scores.alibi(8, device="cuda")  # doctest: +SKIP
    """
    _positive_int("num_heads", num_heads)
    if slopes is None:
        slopes = alibi_slopes(num_heads, device)
    elif not isinstance(slopes, torch.Tensor) or tuple(slopes.shape) != (num_heads,):
        raise ValueError(f"slopes must be a [{num_heads}] tensor, got "
                         f"{tuple(slopes.shape) if isinstance(slopes, torch.Tensor) else type(slopes).__name__}")
    elif device is not None:
        raise ValueError(f"device is where alibi makes its default slopes: give slopes or device, not both "
                         f"(got slopes on {slopes.device} and device={device!r})")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return _named(score_mod, f"alibi_{num_heads}")


def softcap(cap: float) -> Callable:
    """Tanh soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)`` keeps scores in (-cap, cap).

    Example::

        >>> scores.softcap(30.0).__name__
        'softcap_30.0'
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or math.isinf(cap):
        raise ValueError(f"cap must be a positive finite number, got {cap!r}")
    cap = float(cap)

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return _named(score_mod, f"softcap_{cap}")


def relative_bias(table: torch.Tensor) -> Callable:
    """A (learnable) bias per relative position: adds ``table[h, kv_idx - q_idx + R]``.

    ``table`` is [H, 2R + 1] (one row per head) or [2R + 1] (shared by all heads), covering the
    distances ``-R .. R``; longer distances use the table's end values. Give the table
    ``requires_grad=True`` to learn it: flex_attention's backward fills ``table.grad``.

    Example::

        >>> table = torch.zeros(4, 2 * 128 + 1, requires_grad=True)
        >>> mod = scores.relative_bias(table)
    """
    if not isinstance(table, torch.Tensor) or table.dim() not in (1, 2) or table.shape[-1] % 2 == 0 \
            or not table.dtype.is_floating_point:
        raise ValueError("table must be a floating [H, 2R + 1] or [2R + 1] tensor (odd last dimension), got "
                         f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}"
                         f"{' ' + str(table.dtype) if isinstance(table, torch.Tensor) else ''}")
    R = table.shape[-1] // 2
    if table.dim() == 2:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, torch.clamp(kv_idx - q_idx, -R, R) + R]
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[torch.clamp(kv_idx - q_idx, -R, R) + R]
    return _named(score_mod, "relative_bias")


def t5_buckets(num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True,
               device=None) -> torch.Tensor:
    """T5's bucket of every relative position ``kv_idx - q_idx`` in ``-max_distance .. max_distance``.

    int32 [2 * max_distance + 1]; entry ``d + max_distance`` is the bucket of distance ``d`` (T5's
    ``_relative_position_bucket``: exact buckets for short distances, logarithmic ones up to
    ``max_distance``, the last bucket beyond). Distances past ``max_distance`` fall in the same
    bucket as ``max_distance`` itself.

    Example::

        >>> scores.t5_buckets(8, 16, bidirectional=False)[16 - 3:16 + 1].tolist()  # d = -3 .. 0
        [3, 2, 1, 0]
    """
    _positive_int("num_buckets", num_buckets)
    _positive_int("max_distance", max_distance)
    rel = torch.arange(-max_distance, max_distance + 1, dtype=torch.long, device=device)
    buckets = torch.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets += (rel > 0).long() * n
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    max_exact = max(n // 2, 1)
    is_small = rel < max_exact
    # float32 throughout, as T5 computes it, so the bucket edges are T5's
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (n - max_exact)).to(torch.long)
    large = torch.clamp(large, max=n - 1)
    return (buckets + torch.where(is_small, rel, large)).to(torch.int32)


def t5_bucketed_bias(table: torch.Tensor, max_distance: int = 128, bidirectional: bool = True) -> Callable:
    """T5's relative attention bias: adds ``table[bucket(kv_idx - q_idx), h]``.

    ``table`` is [num_buckets, H], the layout of T5's ``relative_attention_bias.weight``, so a
    trained model's table drops in; it may require grad. Buckets come from `t5_buckets`, looked up
    in a small captured table (no logarithm in the kernel).

    Example::

        >>> table = torch.randn(32, 8)                 # 32 buckets, 8 heads
        >>> mod = scores.t5_bucketed_bias(table, max_distance=128)
    """
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.dtype.is_floating_point:
        raise ValueError("table must be a floating [num_buckets, H] tensor, got "
                         f"{tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__}")
    buckets = t5_buckets(table.shape[0], max_distance, bidirectional, device=table.device)
    M = max_distance

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[buckets[torch.clamp(kv_idx - q_idx, -M, M) + M], h]

    return _named(score_mod, f"t5_bias_{table.shape[0]}_{max_distance}")
