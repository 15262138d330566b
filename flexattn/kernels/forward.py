"""The block-sparse forward kernel (templates/forward.py): plan once, launch per call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from flexattn.kernels import hopper, launch, layout, options as opts
from flexattn.kernels.arguments import UNUSED
from flexattn.kernels.launch import LARGE_BLOCK, fit_tile, pow2_at_least
from flexattn.kernels.tables import Direction, Tables, check_block_size, dense, regrouped
from flexattn.mods import Mod


@dataclass(frozen=True)
class Plan:
    """Everything about one forward launch that does not change between calls."""

    kernel: launch.Launch
    any_scale: launch.Launch  # kernel, or its twin without SCORES_IN_BASE2 for a scale <= 0 (or NaN)
    out_shape: tuple[int, ...]
    stat_shape: tuple[int, int, int]
    out_order: tuple[int, ...] | None  # None: contiguous
    out_like_query: bool               # torch.empty_like(query) makes the output (a cheaper call)
    stat_dtype: torch.dtype
    out_dtype: torch.dtype  # the inputs' dtype; bfloat16 for float8 inputs
    strides: tuple  # Q, K (batch-broadcast), V, Out, LSE [b, h] strides
    dense_rows: Direction | None  # the block lists to read without a block mask
    sizes: tuple  # HQ, Q_LEN, KV_LEN (and the Hopper kernel's HEAD_GROUP)
    want_max: bool  # the kernel writes the row max too
    is_empty: bool  # no output elements: nothing to launch
    descriptors: hopper.Descriptors | None = None  # the Hopper kernel's Q/K/V (and output) TMA descriptors
    rows: int = 0  # the query block size of the block lists read (`hopper.forward_rows`; 0: the mask's)


def module(score: Mod, mask: Mod, target: str, fast_math: bool = False, template: str = "forward"):
    """The generated module of a forward template (templates/forward.py; "forward_hopper" with
    the "gluon" target) with the two mods inlined."""
    def hooks():
        score_def, score_params = launch.mod_hooks(score, target, "score_mod", "score_")
        mask_def, mask_params = launch.mod_hooks(mask, target, "mask_mod", "mask_")
        return {"score_mod_def": score_def, "mask_mod_def": mask_def,
                "score_mod_params": score_params, "mask_mod_params": mask_params}

    return launch.kernel_module(
        template, (score.key(), mask.key()), target, hooks,
        lambda: {f"score_mod {score.name}": score.source, f"mask_mod {mask.name}": mask.source}, fast_math)


def hopper_module(score: Mod, mask: Mod, fast_math: bool):
    return module(score, mask, "gluon", fast_math, template="forward_hopper")


def _tile(option: str, options: dict, explicit: dict, sparse: int | None, length: int) -> int:
    """A tile size: the user's (checked against the sparse block), or the default shrunk to fit."""
    if option in explicit:
        t = explicit[option]
        if sparse is not None and sparse % t != 0:
            raise ValueError(f"kernel_options[{option!r}]={t} must divide the block mask's block size {sparse}")
        return t
    return fit_tile(options[option], length, sparse)


FP8_MIN_K = 32  # the smallest K of a float8 tl.dot


def _fp8_kv_tile(block_n: int, explicit: dict, sparse_kv: int | None) -> int:
    """A float8 forward's KV tile: at least FP8_MIN_K columns (short KV lengths shrink the default
    below that), dividing the block mask's KV blocks."""
    if block_n >= FP8_MIN_K:
        return block_n
    if "BLOCK_N" in explicit:
        raise ValueError(f"kernel_options['BLOCK_N']={block_n}: float8 inputs take KV tiles of at least "
                         f"{FP8_MIN_K} (the tensor cores' float8 products)")
    if sparse_kv is not None and sparse_kv % FP8_MIN_K:
        raise ValueError(f"float8 inputs take a block mask whose KV blocks are a multiple of {FP8_MIN_K} "
                         f"positions (the tensor cores' float8 products); its BLOCK_SIZE gives {sparse_kv}")
    return FP8_MIN_K


def make_plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score: Mod, mask: Mod,
              tables: Tables | None, explicit: dict, want_max: bool, has_sinks: bool = False) -> Plan:
    B, Hq, Q_LEN, E = query.shape
    Bkv, Hkv, KV_LEN, Ev = value.shape
    device, dtype = query.device, query.dtype
    options = {**opts.forward_defaults(device, dtype, E, Ev), **explicit}
    fp8 = dtype == torch.float8_e4m3fn
    if tables is not None:  # the forward's query tiles are >= 16 rows too (decoding packs rows instead)
        check_block_size("Q", tables.q_block, (tables.q_block, tables.kv_block))
    sparse_q = tables.q_block if tables is not None else None
    sparse_kv = tables.kv_block if tables is not None else None
    block_m = _tile("BLOCK_M", options, explicit, sparse_q, Q_LEN)
    block_n = _tile("BLOCK_N", options, explicit, sparse_kv, KV_LEN)
    e_round, ev_round = pow2_at_least(E), pow2_at_least(Ev)
    if fp8:  # float8 tensor-core products take K >= 32: q.k^T's is the (padded) head dim, P.V's the KV tile
        e_round = max(e_round, FP8_MIN_K)
        block_n = _fp8_kv_tile(block_n, explicit, sparse_kv)
    dense_rows = None
    if tables is None:
        sparse_q, sparse_kv = LARGE_BLOCK, block_n
        dense_rows = dense(device, triton.cdiv(KV_LEN, block_n))
    acc = launch.acc_dtype(dtype)
    out_shape = (B, Hq, Q_LEN, Ev)
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n,
        SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
        QK_HEAD_DIM=E, QK_HEAD_DIM_ROUNDED=e_round, V_HEAD_DIM=Ev, V_HEAD_DIM_ROUNDED=ev_round,
        SAFE_HEAD_DIM=E == e_round and Ev == ev_round,
        # KV tiles run to the end of their sparse block, so KV_LEN must fill whole sparse blocks.
        IS_DIVISIBLE=Q_LEN % block_m == 0 and KV_LEN % sparse_kv == 0,
        GQA_SHARED_HEADS=Hq // Hkv,
        HAS_FULL_BLOCKS=tables is None or tables.kv.has_full,
        PRESCALE_QK=options["PRESCALE_QK"] and not fp8,  # Q * scale would round to float8
        IS_FP8=fp8,
        ROWS_GUARANTEED_SAFE=options["ROWS_GUARANTEED_SAFE"],
        # Without a block mask the full blocks are consecutive by construction.
        BLOCKS_ARE_CONTIGUOUS=options["BLOCKS_ARE_CONTIGUOUS"] or tables is None,
        OFFS_INT64=layout.needs_int64_offsets(query, key, value) or
        (B * Hq * Q_LEN * Ev >= layout.INT32_OFFSET_LIMIT),
        OUTPUT_MAX=want_max,
        # Without a score_mod the scale takes the softmax's 1 / ln 2 with it (not with PRESCALE_QK,
        # whose rounding of Q * scale would change). The softmax then folds it into exp2's
        # argument, which needs a positive scale: `run` takes `any_scale` for the others.
        SCORES_IN_BASE2=launch.raw_scores(score, acc) and not options["PRESCALE_QK"],
        SCORE_AFFINE=launch.affine_scores(score, dtype, max(Q_LEN, KV_LEN)),
        LONGEST_FIRST=options["LONGEST_FIRST"],
        HAS_SINKS=has_sinks,
        ACC_DTYPE=launch.ACC_TL_DTYPE[acc],
        SCORE_DTYPE=launch.ACC_TL_DTYPE.get(score.score_dtype, launch.ACC_TL_DTYPE[acc]),
        DOT_PRECISION=launch.dot_precision(device, dtype),
        DOT_IN_FP64=launch.target_for(device) == "interpret",
    )
    if device.type == "cuda":
        constexprs.update(num_warps=options["num_warps"], num_stages=options["num_stages"])
    kv_b = Bkv == 1 and B > 1
    strides = (*query.stride(), *layout.broadcast_strides(key, kv_b), *layout.broadcast_strides(value, kv_b))
    kernel = module(score, mask, launch.target_for(device),
                    opts.fast_math(explicit, device, dtype)).flex_attention_forward
    out_order = layout.contiguous_or_order(query)
    out_dtype = torch.bfloat16 if fp8 else dtype
    strides += (*layout.output_strides(out_shape, out_order), *layout.output_strides((B, Hq, Q_LEN), None)[:2])
    grid = (triton.cdiv(Q_LEN, block_m), B * Hq)
    main, any_scale = _launches(kernel, grid, constexprs, device)
    return Plan(
        kernel=main, any_scale=any_scale,
        out_shape=out_shape, stat_shape=(B, Hq, Q_LEN),
        out_order=out_order, stat_dtype=acc, out_dtype=out_dtype,
        out_like_query=layout.empty_like_gives(query, out_shape, out_dtype, out_order),
        strides=strides, dense_rows=dense_rows,
        sizes=(Hq, Q_LEN, KV_LEN), want_max=want_max, is_empty=B * Hq * Q_LEN * Ev == 0,
    )


def _launches(kernel, grid: tuple, constexprs: dict, device: torch.device,
              describe=None) -> tuple[launch.Launch, launch.Launch]:
    """(the plan's launch, its twin for scales <= 0: see Plan.any_scale)."""
    main = launch.Launch(kernel, grid, constexprs, device, describe=describe)
    if not constexprs["SCORES_IN_BASE2"]:
        return main, main
    return main, launch.Launch(kernel, grid, dict(constexprs, SCORES_IN_BASE2=False), device, describe=describe)


def hopper_plan(query, key, value, score: Mod, mask: Mod, tables: Tables | None, explicit: dict,
                 want_max: bool, has_sinks: bool = False) -> Plan:
    """The plan of the Gluon Hopper kernel (`hopper.reason` said it can run these inputs)."""
    B, Hq, Q_LEN, E = query.shape
    Bkv, Hkv, KV_LEN, Ev = value.shape
    device, dtype = query.device, query.dtype
    fp8 = dtype == torch.float8_e4m3fn
    block_m, block_n = hopper.BLOCK_M[E], hopper.BLOCK_N[E]
    consumers = block_m // 64
    dense_rows = None
    rows = hopper.forward_rows(tables, E)
    if tables is None:  # (one block of rows: a multiple of block_m past any length)
        sparse_q, sparse_kv = LARGE_BLOCK // 128 * block_m, block_n
        dense_rows = dense(device, triton.cdiv(KV_LEN, block_n))
    else:
        sparse_q, sparse_kv = rows or tables.q_block, tables.kv_block
    options = {**opts.forward_defaults(device, dtype, E, Ev), **explicit}
    if rows:  # (a regrouped list of consecutive blocks need not be consecutive)
        options["BLOCKS_ARE_CONTIGUOUS"] = False
    descriptors = hopper.Descriptors(dtype, E)
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
        GQA_SHARED_HEADS=Hq // Hkv, KV_BATCH_BROADCAST=Bkv == 1 and B > 1,
        HAS_FULL_BLOCKS=tables is None or tables.kv.has_full,
        BLOCKS_ARE_CONTIGUOUS=options["BLOCKS_ARE_CONTIGUOUS"] or tables is None,
        # (whole blocks: a block mask's blocks may hold several tiles, those past KV_LEN included)
        IS_DIVISIBLE=KV_LEN % sparse_kv == 0, OUTPUT_MAX=want_max,
        SCORES_IN_BASE2=launch.raw_scores(score, torch.float32),
        SCORE_AFFINE=launch.affine_scores(score, dtype, max(Q_LEN, KV_LEN)),
        LONGEST_FIRST=options["LONGEST_FIRST"], HAS_SINKS=has_sinks, NUM_BUFFERS=hopper.NUM_BUFFERS,
        CONSUMER_REGS=hopper.CONSUMER_REGISTERS[consumers],
        SCORE_DTYPE=launch.ACC_TL_DTYPE.get(score.score_dtype, launch.ACC_TL_DTYPE[torch.float32]),
        IS_FP8=fp8,
        O_TMA=descriptors.with_out,
        num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAX_REGISTERS[consumers],
    )
    out_shape = (B, Hq, Q_LEN, Ev)
    out_dtype = torch.bfloat16 if fp8 else dtype
    out_order = layout.contiguous_or_order(query)
    if layout.output_strides(out_shape, out_order)[3] != 1:  # (the kernel writes rows of Ev elements)
        out_order = None
    oz, oh, om, _ = layout.output_strides(out_shape, out_order)
    strides = (oz, oh, om, *layout.output_strides((B, Hq, Q_LEN), None)[:2])
    kernel = hopper_module(score, mask, opts.fast_math(explicit, device, dtype)).flex_attention_forward
    grid = (triton.cdiv(Q_LEN, block_m), B * Hq)
    main, any_scale = _launches(kernel, grid, constexprs, device, descriptors.describe)
    # a query head's K and V (shared by the heads of a GQA group, which are neighbours)
    group = hopper.head_group(device, KV_LEN * (E + Ev) * key.element_size() // (Hq // Hkv), B * Hq,
                              grid[0] * grid[1], tables is not None,
                              options.get("HEAD_GROUP"))
    return Plan(
        kernel=main, any_scale=any_scale,
        out_shape=out_shape, stat_shape=(B, Hq, Q_LEN), out_order=out_order, stat_dtype=torch.float32,
        out_dtype=out_dtype, out_like_query=layout.empty_like_gives(query, out_shape, out_dtype, out_order),
        strides=strides, dense_rows=dense_rows, sizes=(Hq, Q_LEN, KV_LEN, group), want_max=want_max,
        is_empty=B * Hq * Q_LEN * Ev == 0, descriptors=descriptors, rows=rows,
    )


_NO_DESCALE = (UNUSED,) * 3


def run(plan: Plan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score: Mod, score_bufs,
        mask: Mod, mask_bufs, tables: Tables | None, scale: float, descale: tuple | None = None,
        sinks: torch.Tensor | None = None):
    """Launch: returns (out, lse, max_scores) with lse and max_scores in natural-log units
    (max_scores is None unless the plan writes it). ``descale``: float8 inputs' (q, k, v) descale
    factors, one-element float32 tensors; ``sinks``: the [Hq] sink logits of a HAS_SINKS plan."""
    device = query.device
    out = launch.empty(plan.out_shape, plan.out_dtype, device, plan.out_order, query if plan.out_like_query else None)
    lse = launch.empty(plan.stat_shape, plan.stat_dtype, device)
    mx = launch.empty(plan.stat_shape, plan.stat_dtype, device) if plan.want_max else None
    if plan.is_empty:
        return out, lse, mx
    (plan.kernel if scale > 0 else plan.any_scale)(*launch_args(
        plan, query, key, value, out, lse, mx, score, score_bufs, mask, mask_bufs, tables, scale, descale, sinks))
    return out, lse, mx


def launch_args(plan: Plan, query, key, value, out, lse, mx, score: Mod, score_bufs, mask: Mod, mask_bufs,
                tables: Tables | None, scale: float, descale: tuple | None = None, sinks=None) -> tuple:
    """The kernel's arguments, group by group in the order `signatures.FORWARD` (or
    `FORWARD_HOPPER`) declares: tensors, descale, sinks, tables, mods, strides, table strides,
    sizes, scalars (the Hopper kernel reads Q, K, V and writes the output through descriptors,
    which its launch makes of the tensors in their places: `hopper.Descriptors.describe`)."""
    if tables is None:
        rows = plan.dense_rows
    else:
        rows = regrouped(tables, plan.rows).kv if plan.rows else tables.kv
    mods = (*launch.buffer_args(score, score_bufs), *launch.buffer_args(mask, mask_bufs))
    tail = (*plan.strides, *rows.strides(), *plan.sizes, scale)
    mx = UNUSED if mx is None else mx
    return (query, key, value, out, lse, mx, *(descale or _NO_DESCALE), UNUSED if sinks is None else sinks,
            *rows.args(), *mods, *tail)
