"""Tensor layouts on the host: the strides a kernel takes, the layout of the outputs a plan
allocates, when offsets need 64 bits, and layout changes of inputs that a kernel reads faster in
another layout.

`k_major`: Hopper's float8 tensor-core instruction takes P V's V operand K-major only (the KV
dimension innermost); a V tile of another layout is rearranged in shared memory every step,
which made the float8 forward 2.7x slower on the H100. A row-major V is copied into that layout
once per call. torch's copy of a transposed float8 tensor moves single bytes with strided
accesses (about 0.6 TB/s on the H100); the Triton kernel here reads rows and writes columns in
tiles, each access contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flexattn.kernels import launch
from flexattn.kernels.launch import Launch, PlanCache

INT32_OFFSET_LIMIT = 2**31  # tensors reaching this element offset get 64-bit tile offsets


def max_offset(t: torch.Tensor) -> int:
    """The largest element offset ``t`` reaches from its data pointer (decides 64-bit offsets)."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)


def needs_int64_offsets(*tensors: torch.Tensor) -> bool:
    return max(max_offset(t) for t in tensors) >= INT32_OFFSET_LIMIT


def broadcast_strides(t: torch.Tensor, batch_broadcast: bool) -> list[int]:
    """``t``'s strides, with the batch stride 0 when it broadcasts over the query's batch."""
    s = list(t.stride())
    if batch_broadcast:
        s[0] = 0
    return s


def table_strides(t: torch.Tensor) -> list[int]:
    """[b, h, row] strides of a block-mask table; 0 where the mask broadcasts over B or H."""
    return [t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0, t.stride(2)]


def stride_order(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s dimensions from outermost to innermost (outputs follow the query's layout). Equal
    strides only happen next to a size-1 dimension, whose stride means nothing: it goes inside, so
    that an output of the query's shape gets the query's strides (as ``torch.empty_like``)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), t.shape[d] == 1, d)))


def contiguous_or_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """`stride_order` of ``t``, or None when that is the contiguous order (`launch.empty` then takes the
    cheaper ``torch.empty``)."""
    order = stride_order(t)
    return None if order == tuple(range(t.dim())) else order


def empty_like_gives(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                     order: tuple[int, ...] | None) -> bool:
    """Whether ``torch.empty_like(t)`` is what `launch.empty` makes of ``shape``, ``dtype``, ``order``."""
    probe = torch.empty_like(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
    return t.dtype == dtype and tuple(probe.shape) == tuple(shape) and probe.stride() == output_strides(shape, order)


def output_strides(shape: tuple[int, ...], order: tuple[int, ...] | None) -> tuple[int, ...]:
    """The strides `launch.empty` gives a tensor of ``shape`` and ``order`` (plans precompute them)."""
    t = torch.empty(shape, device="meta") if order is None else torch.empty_permuted(shape, order, device="meta")
    return t.stride()


_TRANSPOSES = PlanCache()
BLOCK_S = 64  # rows per tile (the tile is BLOCK_S x the head dim rounded up to a power of two)


@triton.jit
def _transpose_kernel(X, Y, H, S, D, stride_xb, stride_xh, stride_xs, stride_xd,
                      stride_yb, stride_yh, stride_ys, stride_yd,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Y[b, h, s, d] = X[b, h, s, d] for one BLOCK_S x BLOCK_D tile; X and Y differ in layout."""
    z = tl.program_id(1)
    b, h = (z // H).to(tl.int64), (z % H).to(tl.int64)
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    inside = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    rows = offs_s[:, None].to(tl.int64)
    x = tl.load(X + b * stride_xb + h * stride_xh + rows * stride_xs + offs_d[None, :] * stride_xd, mask=inside)
    tl.store(Y + b * stride_yb + h * stride_yh + rows * stride_ys + offs_d[None, :] * stride_yd, x, mask=inside)


def k_major(value):
    """``value`` [B, H, S, D] with ``stride(2) == 1`` (the KV dimension innermost): ``value``
    itself when it has that layout already (or is not a 4-d float8 tensor: validation comes
    later), else a copy in that layout, its D rows of S values 16-byte aligned."""
    if not (isinstance(value, torch.Tensor) and value.dim() == 4 and value.dtype == torch.float8_e4m3fn
            and value.shape[2] > 1 and value.stride(2) != 1):
        return value
    B, H, S, D = value.shape
    # rows of D values padded to 16 bytes: TMA (the Hopper kernel's copies) needs aligned strides
    rows = torch.empty((B, H, D, -(-S // 16) * 16), dtype=value.dtype, device=value.device)
    out = rows[..., :S].transpose(2, 3)
    if value.device.type != "cuda" or value.numel() == 0:
        return out.copy_(value)  # the interpreter's copy is torch's either way
    site = _TRANSPOSES.get((value.shape, value.stride(), value.device), lambda: Launch(
        _transpose_kernel, (triton.cdiv(S, BLOCK_S), B * H),
        dict(BLOCK_S=BLOCK_S, BLOCK_D=launch.pow2_at_least(D), num_warps=4), value.device))
    site(value, out, H, S, D, *value.stride(), *out.stride())
    return out
