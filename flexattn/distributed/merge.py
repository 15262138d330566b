"""The ring's merge of two partial attentions by their log-sum-exp, in one pass (Triton).

Row by row, with a = exp(lse - top), c = exp(part_lse - top), top the larger LSE:
    out = (out a + part_out c) / (a + c),   lse = top + log(a + c)
A row that neither part sees (both LSE -inf) stays out = 0, lse = -inf, never NaN. Float32 math
on 16-bit or float32 inputs; the merged output is written in the dtype asked for (the query's at
a rank's last merge: no float32 copy of the output and no conversion pass after it). Float64 runs
`reference`, in float64. On CPU tensors the kernel runs in Triton's interpreter, as the
attention kernels do.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flexattn.codegen import cache


def _merge_kernel(O, LSE, PO, PLSE, R, H, L, D,
                  so_b, so_h, so_l, sl_b, sl_h, sl_l, sp_b, sp_h, sp_l, spl_b, spl_h, spl_l,
                  sr_b, sr_h, sr_l, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per BLOCK_L rows of one (batch, head); LSE is read and then overwritten in place
    b = (tl.program_id(1) // H).to(tl.int64)
    h = (tl.program_id(1) % H).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    keep = rows < L
    keep2 = keep[:, None] & (cols[None, :] < D)
    lse_ptrs = LSE + b * sl_b + h * sl_h + rows * sl_l
    a = tl.load(lse_ptrs, mask=keep, other=-float("inf")).to(tl.float32)
    c = tl.load(PLSE + b * spl_b + h * spl_h + rows * spl_l, mask=keep, other=-float("inf")).to(tl.float32)
    top = tl.maximum(a, c)
    top = tl.where(top == -float("inf"), 0.0, top)
    wa = tl.exp(a - top)
    wc = tl.exp(c - top)
    total = wa + wc
    safe = tl.where(total == 0.0, 1.0, total)
    inv = 1.0 / safe
    o = tl.load(O + b * so_b + h * so_h + rows[:, None] * so_l + cols[None, :], mask=keep2, other=0.0)
    p = tl.load(PO + b * sp_b + h * sp_h + rows[:, None] * sp_l + cols[None, :], mask=keep2, other=0.0)
    merged = o.to(tl.float32) * (wa * inv)[:, None] + p.to(tl.float32) * (wc * inv)[:, None]
    tl.store(R + b * sr_b + h * sr_h + rows[:, None] * sr_l + cols[None, :], merged.to(R.dtype.element_ty),
             mask=keep2)
    tl.store(lse_ptrs, tl.where(total == 0.0, -float("inf"), top + tl.log(safe)), mask=keep)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """`_merge_kernel` jitted for the GPU, or for Triton's interpreter (CPU tensors)."""
    with cache.interpret_mode(interpret):
        return triton.jit(_merge_kernel)


def merge_into(result: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
               part_lse: torch.Tensor) -> None:
    """``result`` ([B, H, L, D], any float dtype; may be ``out`` itself) = the merge of (``out``,
    ``lse``) and (``part_out``, ``part_lse``); ``lse`` (float32) becomes the merged LSE. Each
    tensor's last dimension is contiguous (views of rows are fine)."""
    B, H, L, D = out.shape
    if L == 0 or B * H == 0:
        return
    for name, t in (("result", result), ("out", out), ("part_out", part_out)):
        if t.shape != out.shape or t.stride(3) != 1:
            raise ValueError(f"{name}: expected shape {tuple(out.shape)} with a contiguous last dimension, "
                             f"got {tuple(t.shape)} strides {t.stride()}")
    block_d = triton.next_power_of_2(D)
    block_l = max(1, min(64, 4096 // block_d, triton.next_power_of_2(L)))
    interpret = out.device.type == "cpu"
    args = (out, lse, part_out, part_lse, result, H, L, D, *out.stride()[:3], *lse.stride(), *part_out.stride()[:3],
            *part_lse.stride(), *result.stride()[:3])
    grid = (triton.cdiv(L, block_l), B * H)
    if interpret:  # (the interpreter keeps global state while a kernel runs: one launch at a time)
        with cache.INTERPRETER_LOCK:
            _kernel(True)[grid](*args, BLOCK_L=block_l, BLOCK_D=block_d)
    else:
        _kernel(False)[grid](*args, BLOCK_L=block_l, BLOCK_D=block_d)


def reference(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor):
    """The same merge in torch ops, in ``lse``'s dtype: ``(out, lse)``."""
    top = torch.maximum(lse, part_lse)
    top = torch.where(top == -math.inf, 0.0, top)
    a, b = torch.exp(lse - top), torch.exp(part_lse - top)
    total = a + b
    inv = 1.0 / torch.where(total == 0, 1.0, total)
    merged = out.to(lse.dtype) * (a * inv).unsqueeze(-1) + part_out.to(lse.dtype) * (b * inv).unsqueeze(-1)
    return merged, top + torch.log(total)
