"""Run a mod over a full [B, H, Q, KV] index grid with a generated Triton kernel.

This is the codegen's test bench (and the CPU/GPU dense mask path of ``create_mask``): the same
emitted mod function the attention kernels inline, evaluated element by element.
"""

from __future__ import annotations

import torch
import triton

from flexattn.codegen import emit
from flexattn.kernels.launch import target_for
from flexattn.codegen.render import load_kernel_module
from flexattn.mods import SCORE, Mod


def kernel_module(mod: Mod, target: str):
    src = mod.emit(target)
    call_args = "score, " if mod.kind == SCORE else ""
    call = f"{src.name}({call_args}b, h, q_idx, kv_idx, {src.param_list('')})"
    hooks = {
        "prelude": emit.prelude(target),
        "mod_def": src.source,
        "mod_params": src.param_list(""),
        "mod_call": call,
    }
    return load_kernel_module("elementwise", hooks, {f"{mod.kind}_mod {mod.name}": mod.source},
                              interpret=target == "interpret")


def evaluate_grid(mod: Mod, B: int, H: int, Q_LEN: int, KV_LEN: int, score: torch.Tensor | None = None,
                  device: torch.device | str = "cpu", BLOCK_M: int = 16, BLOCK_N: int = 16,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``mod`` at every (b, h, q_idx, kv_idx); ``score`` is [B, H, Q, KV] for score mods.

    Float results start as NaN so unwritten elements show; pass a prefilled ``out`` (of the mod's
    dtype, [B, H, Q, KV]) to check a bool result the same way.
    """
    device = torch.device(device)
    module = kernel_module(mod, target_for(device))
    if mod.kind == SCORE:
        if score is None:
            raise ValueError("score mods need a score tensor of shape [B, H, Q_LEN, KV_LEN]")
        if out is None:
            out = torch.full((B, H, Q_LEN, KV_LEN), float("nan"), dtype=mod.ir.dtype, device=device)
    else:
        score = torch.empty(1, 1, 1, 1, device=device)
        if out is None:
            out = torch.zeros(B, H, Q_LEN, KV_LEN, dtype=torch.bool, device=device)
    if out.shape != (B, H, Q_LEN, KV_LEN) or out.dtype != mod.ir.dtype:
        raise ValueError(f"out must be a {mod.ir.dtype} tensor of shape {(B, H, Q_LEN, KV_LEN)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    grid = (triton.cdiv(Q_LEN, BLOCK_M), triton.cdiv(KV_LEN, BLOCK_N), B * H)
    module.elementwise_kernel[grid](
        out, score, *mod.launch_args(), *score.stride(), *out.stride(), H, Q_LEN, KV_LEN,
        IS_SCORE=mod.kind == SCORE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    return out
