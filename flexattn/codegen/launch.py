"""Host-side helpers shared by the kernel launchers (forward, backward, decoding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LARGE_BLOCK = 1 << 30  # a sparse block size meaning "one block covers the whole sequence" (no block mask)
INT32_OFFSET_LIMIT = 2**31  # tensors reaching this element offset get 64-bit tile offsets
ACC_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}  # accumulator dtypes


def target_for(device: torch.device) -> str:
    """Codegen target for tensors on ``device``: CPU tensors run through Triton's interpreter."""
    return "interpret" if device.type == "cpu" else "cuda"


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The next power of two >= ``n`` and >= ``floor`` (tl.arange / tl.dot shapes)."""
    return max(floor, triton.next_power_of_2(n))


def max_offset(t: torch.Tensor) -> int:
    """The largest element offset ``t`` reaches from its data pointer (decides 64-bit offsets)."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)


def needs_int64_offsets(*tensors: torch.Tensor) -> bool:
    return max(max_offset(t) for t in tensors) >= INT32_OFFSET_LIMIT
