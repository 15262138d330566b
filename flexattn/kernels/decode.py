"""The split-KV decoding kernel (templates/decode.py): plan once, launch per call.

Every query head that shares a KV head is packed into one row tile, and the KV range is split
over SPLIT_KV programs so the GPU is full. One launch does it all: each program stores its partial
result, and the last of a row tile's programs to finish (it counts itself in on the row tile's
counter, `scratch.Counters`) merges the partials with a log-sum-exp reduction and writes the rows;
with SPLIT_KV == 1 each program writes its rows directly. A call allocates the output (and the
LSE, where the caller wants it) and launches once; the partials, and an LSE nobody reads, go to
the stream's scratch buffer (`scratch.Scratch`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from flexattn.codegen import emit
from flexattn.kernels import launch, layout, options as opts
from flexattn.kernels.arguments import PER_CALL, UNUSED
from flexattn.kernels.launch import pow2_at_least
from flexattn.kernels.scratch import Counters, Scratch, counters_of, scratch_of
from flexattn.kernels.tables import Tables, table_strides
from flexattn.mods import Mod

# flex_attention uses this kernel when Q_LEN < Q_THRESHOLD (unless told otherwise) and no
# gradient is needed.
Q_THRESHOLD = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# The merge reads partials in [MERGE_M, MERGE_CHUNK, V_HEAD_DIM_ROUNDED] tiles of at most this
# many floats per warp (128 registers a thread; the main loop's registers are free by then). On
# the H100, 4x the first choice of 32 took gqa B1 128k from 89.4% to 93.0% of copy bandwidth
# (fewer dependent L2 round trips in the merge), the other shapes level.
MERGE_ELEMENTS_PER_WARP = 128 * 32


def module(score: Mod | None, mask: Mod | None, target: str, fast_math: bool = False):
    def hooks():
        h = {}
        for kind, mod, default_call in (("score", score, "score"), ("mask", mask, "tl.full([], 1, tl.int1)")):
            prefix = "SM_" if kind == "score" else "MM_"
            if mod is None:
                h.update({f"{kind}_mod_def": "", f"{kind}_params": "", f"{kind}_call": default_call})
                continue
            src = emit.emit_mod(mod.ir, mod.kind, f"{kind}_mod", target)
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
    split: launch.Launch      # decode_split_kernel: the one launch of a call (fixed arguments in place)
    split_kv: int
    row_tiles: int            # counters the launch counts on (when split_kv > 1)
    counters: Counters
    scratch_of: Scratch
    out_shape: tuple
    out_order: tuple | None   # None: contiguous
    out_like_query: bool      # torch.empty_like(query) makes the output (a cheaper call)
    scratch: int              # float32 elements of the LSE + partials buffer
    is_empty: bool            # no output rows or columns: nothing to launch
    lse_strides: tuple        # LSE [B, HQ, Q_LEN] at the start of the scratch buffer
    score_slots: tuple | None  # the score mod's captured tensors the kernel reads, in argument order
    mask_slots: tuple | None   # (None: all of them, in order)


def _buffer_template(mod: Mod | None, buffers) -> tuple[list, tuple[int, ...] | None]:
    """(fixed arguments, which captured tensors a call passes) of a mod's captured tensors, laid
    out as `launch.buffer_args` lays them out: each one's pointer comes with the call, its strides
    and sizes are part of the plan key. None: all of them, in order."""
    if mod is None:
        return [], ()
    fixed = [PER_CALL if isinstance(a, torch.Tensor) else a for a in launch.buffer_args(mod, buffers)]
    slots = tuple(spec.index for spec in mod.buffer_specs)
    return fixed, None if slots == tuple(range(len(buffers))) else slots


def _geometry(tables: Tables | None, explicit: dict, BLOCK_N: int, G: int, Q_LEN: int, KV_LEN: int,
              kv_lengths) -> tuple:
    """(q block, KV block, BLOCK_N, query heads packed per tile, query rows per head and tile,
    query blocks, no KV bounds checks, KV tiles or blocks a row walks) with or without a block mask."""
    if tables is None:
        safe_n = kv_lengths is None and KV_LEN % BLOCK_N == 0
        return max(Q_LEN, 1), BLOCK_N, BLOCK_N, G, Q_LEN, 1, safe_n, triton.cdiv(KV_LEN, BLOCK_N)
    num, idx = tables.kv.num, tables.kv.idx
    q_bs, kv_bs = tables.q_block, tables.kv_block
    NKV = idx.shape[3]
    # (a mask built for these lengths may list fewer columns: its rows see no further)
    if NKV * kv_bs < KV_LEN and tables.seq_lengths is None:
        raise ValueError(f"block_mask covers {NKV * kv_bs} kv positions but KV_LEN is {KV_LEN}")
    if "BLOCK_N" in explicit and kv_bs % BLOCK_N:
        raise ValueError(f"kernel_options['BLOCK_N']={BLOCK_N} must divide the block mask's KV block size {kv_bs}")
    BLOCK_N = min(BLOCK_N, kv_bs & -kv_bs)  # a power of two that divides the block size
    G_PACK = G if num.shape[1] == 1 else 1
    safe_n = kv_lengths is None and NKV * kv_bs == KV_LEN
    return q_bs, kv_bs, BLOCK_N, G_PACK, min(Q_LEN, q_bs), triton.cdiv(Q_LEN, q_bs), safe_n, NKV


def _split_kv(explicit: dict, o: dict, device: torch.device, programs: int, walk_tiles: int, sub: int) -> int:
    """SPLIT_KV: enough programs to fill the GPU, each still walking a few tiles (``sub`` tiles per
    walked block)."""
    if "SPLIT_KV" in explicit:
        split = explicit["SPLIT_KV"]
    else:
        want = math.ceil(o["PROGRAMS_PER_SM"] * launch.num_sms(device) / max(programs, 1))
        cap = max(1, (walk_tiles * sub) // max(o["MIN_TILES_PER_SPLIT"], 1) // sub)
        # A power of two: a KV cache that grows a token per step then meets a handful of SPLIT_KV
        # values (each a kernel to compile), not a new one every MIN_TILES_PER_SPLIT tiles.
        split = max(1, min(want, cap, 256))
        split = 1 << (split.bit_length() - 1)
    # More splits than KV tiles only adds programs with nothing to do.
    return min(split, max(1, walk_tiles * sub))


def make_plan(query, key, value, score: Mod | None, score_bufs, mask: Mod | None, mask_bufs,
              tables: Tables | None, explicit: dict, kv_lengths: torch.Tensor | None, has_sinks: bool = False) -> Plan:
    """Inputs were validated by the caller (shapes, dtypes, devices, GQA, sinks)."""
    B, HQ, Q_LEN, E = query.shape
    BK, HKV, KV_LEN, _ = key.shape
    EV = value.shape[3]
    device = query.device
    G = HQ // max(HKV, 1)
    D, DV = pow2_at_least(E), pow2_at_least(EV)
    o = {**opts.decode_defaults(device, D, DV), **explicit}
    BLOCK_N = o["BLOCK_N"]
    has_block_mask = tables is not None
    q_bs, kv_bs, BLOCK_N, G_PACK, Q_ROWS, NUM_Q_BLOCKS, safe_n, walk_tiles = _geometry(
        tables, explicit, BLOCK_N, G, Q_LEN, KV_LEN, kv_lengths)
    has_full = has_block_mask and tables.kv.has_full
    rows = G_PACK * Q_ROWS
    BLOCK_M = min(pow2_at_least(rows), max(16, o["BLOCK_M"]))
    M_TILES = triton.cdiv(rows, BLOCK_M)
    programs = B * HKV * (G // G_PACK) * NUM_Q_BLOCKS * M_TILES
    # (a block mask's KV blocks are walked as kv_bs // BLOCK_N tiles each)
    split = _split_kv(explicit, o, device, programs, walk_tiles, kv_bs // BLOCK_N if has_block_mask else 1)

    kz = BK == 1 and B > 1
    strides = (*query.stride(), *layout.broadcast_strides(key, kz), *layout.broadcast_strides(value, kz))
    if has_block_mask:
        num, idx = tables.kv.num, tables.kv.idx
        tables_strides = [*table_strides(num), *table_strides(idx)]
        tables_strides += ([*table_strides(tables.kv.full_num), *table_strides(tables.kv.full_idx)] if has_full
                           else [0] * 6)
    else:
        tables_strides = [0] * 12
    # LSE + partials in one float32 buffer: LSE [n], M and L [split, n], Acc [split, n, EV]
    n = B * HQ * Q_LEN
    scratch = n + 2 * n * split + n * split * EV if split > 1 else n
    # The merge: every real row of a row tile at once, as many partials a step as registers allow.
    merge_m = min(BLOCK_M, triton.next_power_of_2(max(rows, 1)))
    per_step = MERGE_ELEMENTS_PER_WARP * o["num_warps"] // (merge_m * DV)
    merge_chunk = min(triton.next_power_of_2(split), 1 << (max(per_step, 1).bit_length() - 1))
    precision = o["INPUT_PRECISION"] if query.dtype == torch.float32 else "tf32"
    constexprs = dict(
        HKV=HKV, GQA_SHARED_HEADS=G, PACKED_HEADS=G_PACK, Q_ROWS=max(Q_ROWS, 1), NUM_Q_BLOCKS=NUM_Q_BLOCKS,
        M_TILES=M_TILES, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, QK_HEAD_DIM_ROUNDED=D, V_HEAD_DIM_ROUNDED=DV,
        SPLIT_KV=split, TILE_KV=BLOCK_N, SPARSE_Q_BLOCK_SIZE=q_bs, SPARSE_KV_BLOCK_SIZE=kv_bs,
        HAS_BLOCK_MASK=has_block_mask, HAS_FULL_BLOCKS=has_full,
        APPLY_MASK_DENSE=mask is not None and not has_block_mask,
        HAS_KV_LENGTHS=kv_lengths is not None, HAS_SINKS=has_sinks,
        IS_DIVISIBLE_M=rows % BLOCK_M == 0 and Q_LEN == NUM_Q_BLOCKS * Q_ROWS,
        IS_DIVISIBLE_N=safe_n, SAFE_HEAD_DIM=D == E and DV == EV, DOT_PRECISION=precision,
        DOT_IN_FP64=launch.target_for(device) == "interpret",
        MERGE_M=merge_m, MERGE_CHUNK=merge_chunk,
    )
    if device.type == "cuda":
        constexprs.update(num_warps=o["num_warps"], num_stages=o["num_stages"])
    mod = module(score, mask, launch.target_for(device), opts.fast_math(explicit, device, query.dtype))
    counters = counters_of(device)
    if split > 1:
        counters.reserve(programs)
    # The kernel's arguments as `run` passes them: its tensors and the scale come with each call.
    out_order = layout.contiguous_or_order(query)
    out_shape = (B, HQ, Q_LEN, EV)
    call, unused = PER_CALL, UNUSED
    score_fixed, score_slots = _buffer_template(score, score_bufs)
    mask_fixed, mask_slots = _buffer_template(mask, mask_bufs)
    # (group by group in the order `signatures.DECODE_SPLIT` declares)
    fixed = (call, call, call, call, call, call if split > 1 else unused,   # Q, K, V, Out, scratch, counters
             call if has_sinks else unused,
             *(call if has_block_mask else unused for _ in range(4)),       # block-mask tables
             call if kv_lengths is not None else unused,
             *score_fixed, *mask_fixed, *strides, *layout.output_strides(out_shape, out_order), *tables_strides,
             Q_LEN, KV_LEN, E, EV, n, call)
    return Plan(
        split=launch.Launch(mod.decode_split_kernel, (split, B * HKV, (G // G_PACK) * NUM_Q_BLOCKS * M_TILES),
                            constexprs, device, fixed),
        split_kv=split, row_tiles=programs, counters=counters, scratch_of=scratch_of(device),
        out_shape=out_shape, out_order=out_order, scratch=scratch,
        out_like_query=layout.empty_like_gives(query, out_shape, query.dtype, out_order),
        is_empty=B * HQ * Q_LEN * EV == 0, lse_strides=layout.output_strides((B, HQ, Q_LEN), None),
        score_slots=score_slots, mask_slots=mask_slots,
    )


def run(plan: Plan, query, key, value, score_bufs, mask_bufs, tables: Tables | None, scale: float,
        kv_lengths: torch.Tensor | None, want_lse: bool = True, sinks: torch.Tensor | None = None):
    """Launch: ``(out, lse)``, lse in natural log, float32 (None unless ``want_lse``); ``sinks``:
    the [Hq] sink logits of a HAS_SINKS plan. One
    allocation (the output) and one launch; with ``want_lse`` one float32 buffer more, holding
    the LSE and the split partials (LSE a view of its start); with SPLIT_KV > 1 the launch also
    counts on the current stream's counters."""
    out = launch.empty(plan.out_shape, query.dtype, query.device, plan.out_order,
                       query if plan.out_like_query else None)
    if plan.split_kv > 1:
        stream, done = plan.counters(plan.row_tiles)
    else:
        stream, done = None, None
    if want_lse:
        scratch = launch.empty((plan.scratch,), torch.float32, query.device)
        lse = scratch.as_strided(plan.out_shape[:3], plan.lse_strides)
    else:
        stream, scratch = plan.scratch_of(plan.scratch, stream)
        lse = None
    if plan.is_empty:
        return out, None if lse is None else lse.fill_(float("-inf"))
    args = [query, key, value, out, scratch]
    if done is not None:
        args.append(done)
    if sinks is not None:
        args.append(sinks)
    if tables is not None:
        args += tables.kv.args()
    if kv_lengths is not None:  # (the kernel reads it as one element per batch, contiguous)
        args.append(kv_lengths.contiguous())
    slots = plan.score_slots
    args += score_bufs if slots is None else [score_bufs[i] for i in slots]
    slots = plan.mask_slots
    args += mask_bufs if slots is None else [mask_bufs[i] for i in slots]
    args.append(scale)
    try:
        plan.split(*args, stream=stream)
    except BaseException:
        # A launch that stopped part-way (an error in Triton's interpreter) leaves counts behind.
        if done is not None:
            done.zero_()
        raise
    return out, lse
