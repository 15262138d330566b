"""The split-KV decoding kernel (templates/decode.py): plan once, launch per call.

Every query head that shares a KV head is packed into one row tile, the KV range is split over
SPLIT_KV programs so the GPU is full, and the partial results are merged with a log-sum-exp
reduction (`decode_combine_kernel`, skipped when SPLIT_KV == 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from flexattn.kernels import launch, options as opts
from flexattn.kernels.launch import pow2_at_least
from flexattn.kernels.tables import Tables, table_strides
from flexattn.mods import Mod

# flex_attention uses this kernel when Q_LEN < Q_THRESHOLD (unless told otherwise) and no
# gradient is needed.
Q_THRESHOLD = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def module(score: Mod | None, mask: Mod | None, target: str, fast_math: bool = False):
    def hooks():
        h = {}
        for kind, mod, default_call in (("score", score, "score"), ("mask", mask, "tl.full([], 1, tl.int1)")):
            prefix = "SM_" if kind == "score" else "MM_"
            if mod is None:
                h.update({f"{kind}_mod_def": "", f"{kind}_params": "", f"{kind}_call": default_call})
                continue
            src = mod.emit(target, name=f"{kind}_mod")
            first = "score, " if kind == "score" else ""
            h[f"{kind}_mod_def"] = src.source
            h[f"{kind}_params"] = src.param_list(prefix)
            h[f"{kind}_call"] = f"{src.name}({first}b, h, q_idx, kv_idx, {src.param_list(prefix)})"
        return h

    def provenance():
        return {f"{m.kind}_mod {m.name}": m.source for m in (score, mask) if m is not None}

    return launch.kernel_module("decode", (score.key() if score else None, mask.key() if mask else None),
                                target, hooks, provenance, fast_math)


@dataclass(frozen=True)
class Plan:
    split: launch.Launch      # decode_split_kernel
    combine: launch.Launch    # decode_combine_kernel (used when split_kv > 1)
    split_kv: int
    strides: tuple            # Q, K, V strides
    static_args: tuple        # block-mask strides, sizes and scratch offsets after Out's strides
    combine_args: tuple       # the combine kernel's arguments after Out's strides
    out_shape: tuple
    out_order: tuple | None   # None: contiguous
    scratch: int              # float32 elements of the LSE + partials buffer
    is_empty: bool            # no output rows or columns: nothing to launch
    lse_strides: tuple        # LSE [B, HQ, Q_LEN] at the start of the scratch buffer


def make_plan(query, key, value, score: Mod | None, mask: Mod | None, tables: Tables | None,
              explicit: dict, kv_lengths: torch.Tensor | None) -> Plan:
    """Inputs were validated by the caller (shapes, dtypes, devices, GQA)."""
    B, HQ, Q_LEN, E = query.shape
    BK, HKV, KV_LEN, _ = key.shape
    EV = value.shape[3]
    device = query.device
    G = HQ // max(HKV, 1)
    D, DV = pow2_at_least(E), pow2_at_least(EV)
    o = {**opts.decode_defaults(device, D, DV), **explicit}
    BLOCK_N = o["BLOCK_N"]
    has_block_mask = tables is not None
    if has_block_mask:
        num, idx = tables.kv.num, tables.kv.idx
        q_bs, kv_bs = tables.q_block, tables.kv_block
        MH = num.shape[1]
        NKV = idx.shape[3]
        if NKV * kv_bs < KV_LEN:
            raise ValueError(f"block_mask covers {NKV * kv_bs} kv positions but KV_LEN is {KV_LEN}")
        if "BLOCK_N" in explicit and kv_bs % BLOCK_N:
            raise ValueError(f"kernel_options['BLOCK_N']={BLOCK_N} must divide the block mask's KV block size {kv_bs}")
        BLOCK_N = min(BLOCK_N, kv_bs & -kv_bs)  # a power of two that divides the block size
        has_full = tables.kv.has_full
        G_PACK = G if MH == 1 else 1
        Q_ROWS = min(Q_LEN, q_bs)
        NUM_Q_BLOCKS = triton.cdiv(Q_LEN, q_bs)
        safe_n = kv_lengths is None and NKV * kv_bs == KV_LEN
        walk_tiles = NKV
    else:
        has_full = False
        q_bs, kv_bs = max(Q_LEN, 1), BLOCK_N
        G_PACK, Q_ROWS, NUM_Q_BLOCKS = G, Q_LEN, 1
        safe_n = kv_lengths is None and KV_LEN % BLOCK_N == 0
        walk_tiles = triton.cdiv(KV_LEN, BLOCK_N)
    rows = G_PACK * Q_ROWS
    BLOCK_M = min(pow2_at_least(rows), max(16, o["BLOCK_M"]))
    M_TILES = triton.cdiv(rows, BLOCK_M)
    programs = B * HKV * (G // G_PACK) * NUM_Q_BLOCKS * M_TILES

    # -- SPLIT_KV: enough programs to fill the GPU, each still walking a few tiles
    if "SPLIT_KV" in explicit:
        split = explicit["SPLIT_KV"]
    else:
        want = math.ceil(o["PROGRAMS_PER_SM"] * launch.num_sms(device) / max(programs, 1))
        sub = kv_bs // BLOCK_N if has_block_mask else 1
        cap = max(1, (walk_tiles * sub) // max(o["MIN_TILES_PER_SPLIT"], 1) // sub)
        split = max(1, min(want, cap, 256))
    # More splits than KV tiles only adds programs with nothing to do.
    split = min(split, max(1, walk_tiles * (kv_bs // BLOCK_N if has_block_mask else 1)))

    kz = BK == 1 and B > 1
    strides = (*query.stride(), *launch.broadcast_strides(key, kz), *launch.broadcast_strides(value, kz))
    if has_block_mask:
        static = [*table_strides(num), *table_strides(idx)]
        static += ([*table_strides(tables.kv.full_num), *table_strides(tables.kv.full_idx)] if has_full else [0] * 6)
    else:
        static = [0] * 12
    # LSE + partials in one float32 buffer: LSE [rows], M and L [rows, split], Acc [rows, split, EV]
    n = B * HQ * Q_LEN
    offsets = (n, n + n * split, n + 2 * n * split) if split > 1 else (0, 0, 0)
    scratch = n + 2 * n * split + n * split * EV if split > 1 else n
    static += [Q_LEN, KV_LEN, E, EV, *offsets]
    precision = o["INPUT_PRECISION"] if query.dtype == torch.float32 else "tf32"
    constexprs = dict(
        HKV=HKV, GQA_SHARED_HEADS=G, PACKED_HEADS=G_PACK, Q_ROWS=max(Q_ROWS, 1), NUM_Q_BLOCKS=NUM_Q_BLOCKS,
        M_TILES=M_TILES, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, QK_HEAD_DIM_ROUNDED=D, V_HEAD_DIM_ROUNDED=DV,
        SPLIT_KV=split, TILE_KV=BLOCK_N, SPARSE_Q_BLOCK_SIZE=q_bs, SPARSE_KV_BLOCK_SIZE=kv_bs,
        HAS_BLOCK_MASK=has_block_mask, HAS_FULL_BLOCKS=has_full,
        APPLY_MASK_DENSE=mask is not None and not has_block_mask,
        HAS_KV_LENGTHS=kv_lengths is not None,
        IS_DIVISIBLE_M=rows % BLOCK_M == 0 and Q_LEN == NUM_Q_BLOCKS * Q_ROWS,
        IS_DIVISIBLE_N=safe_n, SAFE_HEAD_DIM=D == E and DV == EV, DOT_PRECISION=precision,
        DOT_IN_FP32=device.type != "cuda" and query.dtype == torch.bfloat16,
    )
    if device.type == "cuda":
        constexprs.update(num_warps=o["num_warps"], num_stages=o["num_stages"])
    mod = module(score, mask, launch.target_for(device), opts.fast_math(explicit, device, query.dtype))
    return Plan(
        split=launch.Launch(mod.decode_split_kernel, (split, B * HKV, (G // G_PACK) * NUM_Q_BLOCKS * M_TILES),
                            constexprs, device),
        combine=launch.Launch(mod.decode_combine_kernel, (n,),
                              dict(SPLIT_KV=split, SPLIT_PAD=max(2, triton.next_power_of_2(split)),
                                   V_HEAD_DIM_ROUNDED=DV), device),
        split_kv=split,
        strides=strides, static_args=tuple(static), combine_args=(HQ, Q_LEN, EV, *offsets),
        out_shape=(B, HQ, Q_LEN, EV), out_order=launch.contiguous_or_order(query), scratch=scratch,
        is_empty=B * HQ * Q_LEN * EV == 0, lse_strides=launch.output_strides((B, HQ, Q_LEN), None),
    )


def run(plan: Plan, query, key, value, score: Mod | None, score_bufs, mask: Mod | None, mask_bufs,
        tables: Tables | None, scale: float, kv_lengths: torch.Tensor | None):
    """Launch: ``(out, lse)`` with lse in natural log, float32. Two allocations: the output and
    one float32 buffer holding LSE and the split partials (LSE is a view of its start)."""
    device = query.device
    out = launch.empty(plan.out_shape, query.dtype, device, plan.out_order)
    scratch = launch.empty((plan.scratch,), torch.float32, device)
    lse_shape = plan.out_shape[:3]
    lse = scratch.as_strided(lse_shape, plan.lse_strides)
    if plan.is_empty:
        return out, lse.fill_(float("-inf"))
    if tables is not None:
        num, idx, full_num, full_idx = tables.kv.args()
    else:
        num = idx = full_num = full_idx = launch.UNUSED
    plan.split(
        query, key, value, out, scratch,
        num, idx, full_num, full_idx, kv_lengths if kv_lengths is not None else launch.UNUSED,
        *(launch.buffer_args(score, score_bufs) if score is not None else ()),
        *(launch.buffer_args(mask, mask_bufs) if mask is not None else ()),
        *plan.strides, *out.stride(), *plan.static_args, scale,
    )
    if plan.split_kv > 1:
        plan.combine(out, scratch, *out.stride(), *plan.combine_args)
    return out, lse
