"""Layout changes of inputs that a kernel reads faster in another layout.

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
