"""Merging partial results (templates/merge.py), what the ring does after each step
(flexattn/distributed/ring.py): two partial attentions of the same rows by their log-sum-exp
(`merge_into`), and a gradient part of some rows added to a total (`add_rows`).

Each runs a one-pass kernel where the tensors allow it (float32 LSE, 16-bit or float32 tensors, the
last dimension contiguous) and torch ops otherwise (float64, other layouts)."""

from __future__ import annotations

import math

import torch
import triton

from flexattn.kernels import launch
from flexattn.lru import LRU

BLOCK_ELEMENTS = 4096  # elements of O per program (BLOCK_L rows of BLOCK_D)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SITES = LRU(256)  # (device, dtypes, shapes, strides) -> its Launch (every integer argument fixed)


def merge_torch(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor):
    """The merge in torch ops, in ``lse``'s dtype: ``(merged out, merged lse)``."""
    top = torch.maximum(lse, part_lse)
    top = torch.where(top == -math.inf, 0.0, top)
    a, c = torch.exp(lse - top), torch.exp(part_lse - top)
    total = a + c
    safe = torch.where(total == 0, 1.0, total)
    merged = out.to(lse.dtype) * (a / safe).unsqueeze(-1) + part_out.to(lse.dtype) * (c / safe).unsqueeze(-1)
    return merged, torch.where(total == 0, -math.inf, top + torch.log(safe))


def merge_into(result: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
               part_lse: torch.Tensor) -> None:
    """``result`` = the merge of (``out``, ``lse``) and (``part_out``, ``part_lse``), all [B, H, L(, D)]
    (views are fine; ``result`` may be ``out``); ``lse`` becomes the merged LSE. A row neither
    part sees comes out 0 with LSE -inf."""
    B, H, L, D = out.shape
    if result.shape != out.shape or part_out.shape != out.shape or part_lse.shape != lse.shape:
        raise ValueError(f"merge_into: shapes differ: result {tuple(result.shape)}, out {tuple(out.shape)}, "
                         f"part_out {tuple(part_out.shape)}, lse {tuple(lse.shape)}, part_lse {tuple(part_lse.shape)}")
    if B * H * L == 0:
        return
    tensors = (result, out, part_out)
    if not (lse.dtype == part_lse.dtype == torch.float32 and all(t.dtype in _KERNEL_DTYPES for t in tensors)
            and all(t.stride(3) == 1 or D == 1 for t in tensors)):
        merged, new_lse = merge_torch(out, lse, part_out, part_lse)
        result.copy_(merged)
        lse.copy_(new_lse)
        return
    run, n_row_blocks = _site("merge_kernel", out, {}, (result.dtype, out.dtype, part_out.dtype,
                                                        *(t.stride() for t in (out, lse, part_out, part_lse, result))))
    run(out, lse, part_out, part_lse, result, H, L, D, n_row_blocks, *out.stride()[:3], *lse.stride(),
        *part_out.stride()[:3], *part_lse.stride(), *result.stride()[:3])


def add_rows(result: torch.Tensor, total: torch.Tensor | None, part: torch.Tensor, lo: int) -> None:
    """``result`` = ``total`` with ``part`` added to its rows ``[lo, lo + part rows)``, all
    [B, H, L(, D)] (``total`` None: zeros; ``result`` may be ``total``): float32 arithmetic (float64
    for float64) rounded once into ``result``'s dtype, in one pass over ``result``."""
    B, H, L, D = result.shape
    PL = part.shape[2]
    if (total is not None and total.shape != result.shape) or part.shape != (B, H, PL, D) or not 0 <= lo <= L - PL:
        raise ValueError(f"add_rows: shapes differ: result {tuple(result.shape)}, total "
                         f"{None if total is None else tuple(total.shape)}, part {tuple(part.shape)} at row {lo}")
    if B * H * L * D == 0:
        return
    tensors = (result, part) if total is None else (result, total, part)
    if not all(t.dtype in _KERNEL_DTYPES and (t.stride(3) == 1 or D == 1) for t in tensors):
        acc = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
        whole = torch.zeros(result.shape, dtype=acc, device=result.device) if total is None else total.to(acc, copy=True)
        whole[:, :, lo:lo + PL] += part.to(acc)
        result.copy_(whole)
        return
    a = part if total is None else total  # (HAS_A False: a stand-in the kernel does not read)
    run, n_row_blocks = _site("add_rows_kernel", result, {"HAS_A": total is not None},
                              (result.dtype, a.dtype, part.dtype, lo, PL, *(t.stride() for t in (a, part, result))))
    run(a, part, result, H, L, D, lo, PL, n_row_blocks, *a.stride()[:3], *part.stride()[:3], *result.stride()[:3])


def _site(kernel: str, like: torch.Tensor, constexprs: dict, key: tuple) -> tuple:
    """``(launch, row blocks)`` of one of the template's kernels over the rows of ``like``
    [B, H, L, D] (programs of BLOCK_L rows of one (batch, head), in a flat grid), made once per
    ``key`` (dtypes, strides and every other integer argument: a launch fixes them all)."""
    B, H, L, D = like.shape
    full_key = (kernel, like.device, like.shape, tuple(constexprs.items()), *key)
    site = _SITES.get(full_key)
    if site is None:
        block_d = launch.pow2_at_least(D)
        block_l = max(1, min(BLOCK_ELEMENTS // block_d, launch.pow2_at_least(L)))
        n_row_blocks = triton.cdiv(L, block_l)
        module = launch.kernel_module("merge", (), launch.target_for(like.device), dict, dict)
        constexprs = dict(constexprs, BLOCK_L=block_l, BLOCK_D=block_d)
        if like.device.type == "cuda":
            constexprs["num_warps"] = 4
        site = _SITES[full_key] = (launch.Launch(getattr(module, kernel), (n_row_blocks * B * H,), constexprs,
                                                 like.device), n_row_blocks)
    return site
