"""The backward kernels (templates/backward.py): dQ, dK, dV and gradients of captured tensors.
On Hopper the Gluon kernel (`HopperPlan`, templates/backward_hopper.py) computes dK and dV, and
either adds dQ into a float32 accumulator in the same pass or leaves dQ to a dQ pass
(`dq_by_pass`): the Gluon one (`HopperDqPlan`, templates/backward_dq_hopper.py), or, where
captured tensors need gradients, the Triton dQ pass below, which sums them.

Three launches per call: a preprocess (Delta = rowsum(dO * O) - dLSE), a dK/dV pass over the
transposed block lists (one program per KV tile; GQA heads of a group summed in-program), and a
dQ pass over the forward's lists that also scatters captured-tensor gradients (atomic adds into
float32/float64 buffers). d(score_mod)/d(score) comes from the IR (`flexattn.autodiff`). K/V with
batch 1 broadcast over the query's batch get per-batch gradients summed on the host; fully
masked rows (LSE = -inf) contribute exactly zero. Attention sinks change nothing in the kernels
(the LSE includes them); their gradient comes from Delta and the LSE (`sink_grad`).

Deterministic mode (kernel option ``DETERMINISTIC``) takes these kernels, or on Hopper the Gluon
kernel, either with its dQ adds into each dQ tile in a fixed order (`ordered_dq`) or computing dK
and dV only beside a dQ pass: each dK and dV element is written by one program, each dQ element
summed in a fixed order, and the captured-tensor gradients are exact fixed-point sums
(`exact_sum_value`), so the gradients are bitwise the same from run to run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import triton

from flexattn import autodiff
from flexattn.codegen import emit
from flexattn.kernels import hopper, launch, layout, options as opts
from flexattn.kernels.launch import LARGE_BLOCK, fit_tile, pow2_at_least
from flexattn.kernels.tables import (Direction, Tables, check_block_size, dense, ordered_q_lists, q_direction,
                                     visited_share)
from flexattn.mods import Mod


@functools.lru_cache(maxsize=1024)  # (per score mod template: its derivative's IR)
def score_mod_grad(score_mod: Mod) -> autodiff.ScoreModGrad:
    """The symbolic derivative of ``score_mod`` (raises `autodiff.NotDifferentiableError` early)."""
    autodiff.check_differentiable(score_mod.ir, f"score_mod '{score_mod.name}'")
    return autodiff.differentiate(score_mod.ir)


def module(score: Mod, mask: Mod, grad_buffers: tuple[int, ...], target: str, fast_math: bool = False,
           exact: bool = False):
    """The backward's kernels with the mods inlined; ``exact``: the captured tensors' gradients go
    into exact sums (``grad_buffers`` not empty: deterministic mode)."""
    def hooks():
        d = score_mod_grad(score)
        scatters = [(g.load, g.grad) for g in d.loads if g.buffer.index in grad_buffers]
        score_src = emit.emit_mod(score.ir, score.kind, "score_mod", target)
        mask_src = emit.emit_mod(mask.ir, mask.kind, "mask_mod", target)
        grad_src = emit.emit_score_grad(d.score, scatters, "score_mod_grad", target, q_axis=0, exact=exact)
        dscore_src = emit.emit_score_grad(d.score, (), "score_mod_dscore", target, q_axis=1)
        grads = {g.buffer.index: g.buffer for g in d.loads if g.buffer.index in grad_buffers}
        grad_params = "".join(f"score_G{i}, " + "".join(f"score_G{i}_s{k}, " for k in range(grads[i].ndim))
                              for i in sorted(grads))
        return {
            "prelude": emit.prelude(target, fast_math, exact_sums=exact),
            "score_mod_def": score_src.source, "mask_mod_def": mask_src.source,
            "score_grad_def": grad_src.source, "score_dscore_def": dscore_src.source,
            "score_mod_params": score_src.param_list("score_"), "mask_mod_params": mask_src.param_list("mask_"),
            "grad_params": grad_params, "score_grad_args": grad_src.param_list("score_"),
            "score_dscore_args": dscore_src.param_list("score_"),
        }

    return launch.kernel_module(
        "backward", (score.key(), mask.key(), grad_buffers, exact), target, hooks,
        lambda: {f"score_mod {score.name}": score.source, f"mask_mod {mask.name}": mask.source}, fast_math)


def grad_buffers_of(score: Mod, buffers_need_grad: tuple[bool, ...], score_bufs) -> tuple[int, ...]:
    """The captured tensors (by index) whose gradients the backward computes: floating ones that
    need a gradient and that score_mod's derivative reads."""
    want = {i for i, w in enumerate(buffers_need_grad) if w and score_bufs[i].dtype.is_floating_point}
    return tuple(sorted(want & {g.buffer.index for g in score_mod_grad(score).loads}))


def hopper_module(score: Mod, mask: Mod, fast_math: bool):
    """The Gluon Hopper backward (templates/backward_hopper.py) with the mods inlined."""
    def hooks():
        score_def, score_params = launch.mod_hooks(score, "gluon", "score_mod", "score_")
        mask_src = emit.emit_mod(mask.ir, mask.kind, "mask_mod", "gluon", hoist_kv=True)
        dscore = emit.emit_score_grad(score_mod_grad(score).score, (), "score_mod_dscore", "gluon", q_axis=1)
        return {"score_mod_def": score_def, "mask_mod_def": mask_src.source, "score_dscore_def": dscore.source,
                "score_mod_params": score_params, "mask_mod_params": mask_src.param_list("mask_"),
                "mask_kv_args": mask_src.pre_arg_list(), "mask_kv_call": mask_src.pre_call("mask_"),
                "score_dscore_args": dscore.param_list("score_")}

    return launch.kernel_module(
        "backward_hopper", (score.key(), mask.key()), "gluon", hooks,
        lambda: {f"score_mod {score.name}": score.source, f"mask_mod {mask.name}": mask.source}, fast_math)


@dataclass(frozen=True)
class Plan:
    preprocess: launch.Launch
    dkdv: launch.Launch
    dq: launch.Launch
    grad_buffers: tuple[int, ...]   # captured tensors (by index) that get gradients
    exact_grads: bool               # their gradients are exact sums (deterministic mode)
    acc: torch.dtype
    dq_order: tuple[int, ...] | None  # dQ's layout: the query's (`layout.contiguous_or_order`)
    dk_dtype: torch.dtype
    kv_batched: bool
    dense: tuple[Direction, Direction] | None  # (q lists, kv lists) without a block mask
    strides: tuple                  # Q, K, V strides (K/V batch-broadcast)
    sizes: tuple                    # Hq, Hkv, Q_LEN, KV_LEN


def make_plan(query, key, value, out, grad_out, score: Mod, mask: Mod, tables: Tables | None,
              explicit: dict, buffers_need_grad: tuple[bool, ...], score_bufs, has_grad_lse: bool) -> Plan:
    B, Hq, Q_LEN, E = query.shape
    Bkv, Hkv, KV_LEN, Ev = value.shape
    device, dtype = query.device, query.dtype
    target = launch.target_for(device)
    acc = launch.acc_dtype(dtype)
    o = {**opts.backward_defaults(device, dtype, E, Ev), **explicit}
    grad_buffers = grad_buffers_of(score, buffers_need_grad, score_bufs)

    if tables is None:
        m1, n1 = fit_tile(o["BLOCK_M1"], Q_LEN, None), fit_tile(o["BLOCK_N1"], KV_LEN, None)
        m2, n2 = fit_tile(o["BLOCK_M2"], Q_LEN, None), fit_tile(o["BLOCK_N2"], KV_LEN, None)
        # dK/dV walks query tiles of BLOCK_M1 in one long KV block; dQ walks KV tiles of BLOCK_N2.
        dense_lists = (dense(device, triton.cdiv(Q_LEN, m1)), dense(device, triton.cdiv(KV_LEN, n2)))
        sq1, skv1, sq2, skv2 = m1, LARGE_BLOCK, LARGE_BLOCK, n2
        contiguous_q = contiguous_kv = True  # the dense lists are 0, 1, 2, ...
        divisible1 = Q_LEN % m1 == 0 and KV_LEN % n1 == 0
        divisible2 = Q_LEN % m2 == 0 and KV_LEN % n2 == 0
        has_full_q = has_full_kv = True
    else:
        sq, skv = tables.q_block, tables.kv_block
        check_block_size("Q", sq, (sq, skv))
        m1, n1 = fit_tile(o["BLOCK_M1"], Q_LEN, sq), fit_tile(o["BLOCK_N1"], KV_LEN, skv)
        m2, n2 = fit_tile(o["BLOCK_M2"], Q_LEN, sq), fit_tile(o["BLOCK_N2"], KV_LEN, skv)
        dense_lists = None
        sq1 = sq2 = sq
        skv1 = skv2 = skv
        # The user's promise is about each query block's KV blocks (the dQ pass's lists). It says
        # nothing about the transposed lists the dK/dV pass walks: those are never assumed.
        contiguous_kv, contiguous_q = bool(o.get("BLOCKS_ARE_CONTIGUOUS", False)), False
        divisible1 = divisible2 = Q_LEN % sq == 0 and KV_LEN % skv == 0
        has_full_q = has_full_kv = tables.kv.has_full
    e_round, ev_round = pow2_at_least(E), pow2_at_least(Ev)
    kv_batched = Bkv == B
    common = dict(
        QK_HEAD_DIM=E, QK_HEAD_DIM_ROUNDED=e_round, V_HEAD_DIM=Ev, V_HEAD_DIM_ROUNDED=ev_round,
        SAFE_HEAD_DIM=E == e_round and Ev == ev_round, GQA_SHARED_HEADS=Hq // Hkv,
        OFFS_INT64=layout.needs_int64_offsets(query, key, value, out, grad_out)
        or B * Hkv * KV_LEN * max(E, Ev) >= layout.INT32_OFFSET_LIMIT,
        ACC_DTYPE=launch.ACC_TL_DTYPE[acc], SCORE_DTYPE=launch.ACC_TL_DTYPE.get(score.score_dtype,
                                                                                launch.ACC_TL_DTYPE[acc]),
        SCORES_IN_BASE2=launch.raw_scores(score, acc),
        DOT_PRECISION=launch.dot_precision(device, dtype),
        DOT_IN_FP64=launch.target_for(device) == "interpret",
    )
    if device.type == "cuda":
        common.update(num_warps=o["bwd_num_warps"], num_stages=o["bwd_num_stages"])
    dkdv = ((triton.cdiv(KV_LEN, n1), B * Hkv),
            dict(common, BLOCK_M1=m1, BLOCK_N1=n1, SPARSE_Q_BLOCK_SIZE=sq1, SPARSE_KV_BLOCK_SIZE=skv1,
                 HAS_FULL_BLOCKS=has_full_q, IS_DIVISIBLE=divisible1, BLOCKS_ARE_CONTIGUOUS=contiguous_q))
    dq = ((triton.cdiv(Q_LEN, m2), B * Hq),
          dict(common, BLOCK_M2=m2, BLOCK_N2=n2, SPARSE_Q_BLOCK_SIZE=sq2, SPARSE_KV_BLOCK_SIZE=skv2,
               HAS_FULL_BLOCKS=has_full_kv, IS_DIVISIBLE=divisible2, BLOCKS_ARE_CONTIGUOUS=contiguous_kv))
    strides = (*query.stride(), *layout.broadcast_strides(key, not kv_batched),
               *layout.broadcast_strides(value, not kv_batched))
    exact = bool(grad_buffers) and o.get("DETERMINISTIC", False)
    mod = module(score, mask, grad_buffers, target, opts.fast_math(explicit, device, dtype), exact)
    return Plan(_preprocess(mod, query, value, has_grad_lse), launch.Launch(mod.backward_dkdv, *dkdv, device),
                launch.Launch(mod.backward_dq, *dq, device), grad_buffers, exact, acc,
                layout.contiguous_or_order(query),
                key.dtype if kv_batched else acc, kv_batched, dense_lists, strides, (Hq, Hkv, Q_LEN, KV_LEN))


def hopper_dq_module(score: Mod, mask: Mod, fast_math: bool):
    """The Gluon dQ pass (templates/backward_dq_hopper.py) with the mods inlined."""
    def hooks():
        score_def, score_params = launch.mod_hooks(score, "gluon", "score_mod", "score_")
        mask_def, mask_params = launch.mod_hooks(mask, "gluon", "mask_mod", "mask_")
        dscore = emit.emit_score_grad(score_mod_grad(score).score, (), "score_mod_dscore", "gluon", q_axis=1)
        return {"score_mod_def": score_def, "mask_mod_def": mask_def, "score_dscore_def": dscore.source,
                "score_mod_params": score_params, "mask_mod_params": mask_params,
                "score_dscore_args": dscore.param_list("score_")}

    return launch.kernel_module(
        "backward_dq_hopper", (score.key(), mask.key()), "gluon", hooks,
        lambda: {f"score_mod {score.name}": score.source, f"mask_mod {mask.name}": mask.source}, fast_math)


@dataclass(frozen=True)
class HopperDqPlan:
    """The Gluon dQ pass (templates/backward_dq_hopper.py): one program per query tile over the
    forward's KV lists, 16-bit dQ written once, no captured-tensor gradients."""
    main: launch.Launch
    descriptors: hopper.Descriptors  # Q, K, V, dO and dQ
    dense: Direction | None          # the KV lists without a block mask
    sizes: tuple                     # Hq, Q_LEN, KV_LEN, B, HEAD_GROUP


# Whether a dQ pass without captured-tensor gradients is the Gluon one (where it can run).
GLUON_DQ = True


def gluon_dq_reason(tables: Tables | None) -> str | None:
    """Why the Gluon dQ pass cannot take these tables (the Hopper backward runs otherwise), or None."""
    if tables is not None and tables.q_block % hopper.DQ_BLOCK_M:
        return f"its query tiles of {hopper.DQ_BLOCK_M} rows need Q blocks that are multiples of them"
    return None


def hopper_dq_plan(query, key, value, score: Mod, mask: Mod, tables: Tables | None, explicit: dict,
                   has_grad_lse: bool) -> HopperDqPlan:
    B, Hq, Q_LEN, E = query.shape
    Bkv, Hkv, KV_LEN, _ = value.shape
    device, dtype = query.device, query.dtype
    block_m, block_n = hopper.DQ_BLOCK_M, hopper.DQ_BLOCK_N
    if tables is None:  # (one row of every KV tile, read by every query tile)
        sparse_q, sparse_kv, lists = LARGE_BLOCK, block_n, dense(device, triton.cdiv(KV_LEN, block_n))
    else:
        sparse_q, sparse_kv, lists = tables.q_block, tables.kv_block, None
    o = {**opts.forward_defaults(device, dtype, E, E), **explicit}
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
        GQA_SHARED_HEADS=Hq // Hkv, KV_BATCH_BROADCAST=Bkv != B,
        HAS_FULL_BLOCKS=tables is None or tables.kv.has_full,
        BLOCKS_ARE_CONTIGUOUS=o["BLOCKS_ARE_CONTIGUOUS"] or tables is None,
        # (whole blocks: a block mask's blocks may hold several tiles, those past KV_LEN included)
        IS_DIVISIBLE=KV_LEN % sparse_kv == 0,
        SCORES_IN_BASE2=launch.raw_scores(score, torch.float32), HAS_GRAD_LSE=has_grad_lse,
        NUM_BUFFERS=hopper.DQ_NUM_BUFFERS[E], CONSUMER_REGS=hopper.CONSUMER_REGISTERS[2],
        SCORE_DTYPE=launch.ACC_TL_DTYPE.get(score.score_dtype, launch.ACC_TL_DTYPE[torch.float32]),
        PERSISTENT=persistent_programs(mask),
        num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAX_REGISTERS[2],
    )
    kernel = hopper_dq_module(score, mask, opts.fast_math(explicit, device, dtype)).flex_attention_backward_dq
    grid = (triton.cdiv(Q_LEN, block_m), B * Hq)
    # (a query head's K and V, shared by the heads of a GQA group)
    group = hopper.head_group(device, KV_LEN * 2 * E * key.element_size() // (Hq // Hkv), B * Hq,
                              grid[0] * grid[1], tables is not None, explicit.get("HEAD_GROUP"))
    descriptors = hopper.Descriptors(dtype, E, dq_pass=True)
    main = launch.Launch(kernel, _programs(grid, constexprs["PERSISTENT"], device), constexprs, device,
                         describe=descriptors.describe)
    return HopperDqPlan(main, descriptors, lists, (Hq, Q_LEN, KV_LEN, B, group))


def hopper_dq_args(plan: HopperDqPlan, query, key, value, out, grad_out, dq, lse, delta, dlse, lists: Direction,
                   score: Mod, score_bufs, mask: Mod, mask_bufs, scale: float) -> tuple:
    """The Gluon dQ pass's arguments, group by group in the order `signatures.BACKWARD_DQ_HOPPER`
    declares (``delta``: written by the pass, from ``out``, ``grad_out`` and ``dlse``; the launch
    makes the descriptors of Q, K, V, dO and dQ: `hopper.Descriptors.describe`)."""
    return (query, key, value, grad_out, dq, lse, delta, out, dlse, *lists.args(),
            *launch.buffer_args(score, score_bufs), *launch.buffer_args(mask, mask_bufs),
            *lse.stride(), *out.stride(), *dlse.stride(), *lists.strides(), *plan.sizes, scale)


@dataclass(frozen=True)
class HopperPlan:
    """The Gluon Hopper backward (`hopper.backward_reason` said it can run these inputs): the
    preprocess, then one pass that writes dK, dV and adds dQ into a float32 buffer; or, with
    ``dq_pass``, that pass without dQ beside a dQ pass (`hopper_plan`)."""
    preprocess: launch.Launch | None  # None: the Gluon dQ pass writes Delta
    main: launch.Launch
    descriptors: hopper.Descriptors  # Q, K, V, dO, the float32 dQ buffer (and 16-bit dK, dV)
    dq_order: tuple[int, ...] | None  # the dQ buffer's layout: the query's (`layout.contiguous_or_order`)
    dk_dtype: torch.dtype
    kv_batched: bool
    dense: Direction | None  # the query lists without a block mask
    sizes: tuple             # Hq, Hkv, Q_LEN, KV_LEN, B, HEAD_GROUP
    dq_pass: Plan | HopperDqPlan | None = None  # dQ (and captured-tensor gradients) by this plan's
    # dQ pass; the main kernel then writes dK and dV only, and nothing is zeroed or converted
    ordered: bool = False  # dQ added in a fixed order (`ordered_dq`)
    dq_tiles: int = 0      # then the dQ tiles of a query head, each with a count (`dq_counts`)


def _preprocess(mod, query, value, has_grad_lse: bool, zero_dq: bool = False) -> launch.Launch:
    """Delta = rowsum(dO * O) - dLSE (backward.py's module ``mod``), one program per 64 query rows;
    ``zero_dq``: it also zeroes the Hopper backward's dQ accumulator. Arguments: `preprocess_args`."""
    B, Hq, Q_LEN, E = query.shape
    Ev = value.shape[3]
    pre_m = min(64, pow2_at_least(Q_LEN))
    return launch.Launch(
        mod.backward_preprocess, (triton.cdiv(Q_LEN, pre_m), B * Hq),
        dict(BLOCK_M=pre_m, V_HEAD_DIM=Ev, V_HEAD_DIM_ROUNDED=pow2_at_least(Ev), QK_HEAD_DIM=E,
             QK_HEAD_DIM_ROUNDED=pow2_at_least(E), ACC_DTYPE=launch.ACC_TL_DTYPE[launch.acc_dtype(query.dtype)],
             HAS_GRAD_LSE=has_grad_lse, ZERO_DQ=zero_dq), query.device)


def preprocess_args(out, grad_out, dlse, delta, dq_acc, Hq: int, Q_LEN: int) -> tuple:
    """`_preprocess`'s launch arguments in the order `signatures.BACKWARD_PREPROCESS` declares
    (``dq_acc`` None: nothing to zero)."""
    dq = (delta, 0, 0, 0) if dq_acc is None else (dq_acc, *dq_acc.stride()[:3])
    return (out, grad_out, dlse, delta, dq[0], *out.stride(), *grad_out.stride(), *dlse.stride(), *dq[1:], Hq, Q_LEN)


def defer_dq(head_dim: int, affine: bool, mask: Mod, ordered: bool = False) -> bool:
    """Whether the Hopper backward issues each step's dQ in the next step (DEFER_DQ) instead of
    having its consumers meet every step: where that measured faster (`python -m benchmarks
    attention`). Head dim 128 unless the mask reads captured tensors (causal, sliding window
    +2-5%, no mask +0-4%, score_mods level; 16 documents 4-6% slower: their programs are short,
    and the first and last steps' dQ cost more there); head dim 64 with an affine score_mod
    (ALiBi +5%) or a mask that reads captured tensors (16 documents +5%), not without them (no
    mask, causal, soft-cap 4-5% slower), nor where dQ is ``ordered`` (`ordered_dq`; H100 B=4 H=32
    S=8k bfloat16, ALiBi + causal 7.75-7.79 against 8.02-8.03 ms in two runs, causal level)."""
    reads_memory = bool(mask.buffer_specs)
    if head_dim == 64:
        return (affine or reads_memory) and not ordered
    return not reads_memory


def persistent_programs(mask: Mod) -> bool:
    """Whether the kernel without dQ and the Gluon dQ pass beside it run as persistent programs
    that load a tile while the previous one finishes (templates/backward_hopper.py and
    backward_dq_hopper.py: persistent): where the mask reads captured tensors, the documents'
    case, whose programs are short (a KV tile sees 4 to 16 query tiles). H100, B=4 S=8k, backward
    in the dQ-pass form, three alternating rounds. The kernel without dQ against one program per
    tile: 16 documents +2% at head dim 128 (H=16), +6% at 64 (H=32); sliding window 1024 -2% at
    128, +2% at 64; causal -6% and -1%; no mask -4% at 64 (long programs gain nothing to overlap
    and lose the hardware's balancing of programs across the SMs). The dQ pass too, on 16
    documents: 1.354 against 1.404 ms at head dim 64 (+4%), 1.123 against 1.124 at 128."""
    return bool(mask.buffer_specs)


def _programs(grid: tuple[int, int], persistent: bool, device: torch.device) -> tuple[int, int]:
    """A kernel's grid: ``grid`` (tiles, batch x heads), or with ``persistent`` one program per
    SM (at most one per tile), each walking the tiles."""
    return (min(grid[0] * grid[1], launch.num_sms(device)), 1) if persistent else grid


def ordered_dq(options: dict, buffer_grads: bool, mask: Mod, tables: Tables | None, KV_LEN: int,
               head_dim: int, raw: bool = False) -> bool:
    """Whether the deterministic Hopper backward adds dQ in its one pass, into each dQ tile in a
    fixed order (templates/backward_hopper.py: DQ_ORDERED; the ranks from
    `tables.ordered_q_lists`) instead of leaving it to a dQ pass that recomputes the scores. In
    deterministic mode, unless captured tensors need gradients (the Triton dQ pass sums them
    exactly) or the rank tables would be too large: without a block mask (but not for ``raw``
    scores, no score_mod, at KV_LEN up to `SHORT_DQ_PASS`), and at head dim 64
    under a mask that visits a quarter of the blocks or more and reads no captured tensors; the
    kernel option DQ_PASS, where given, chooses. No timed choice (it could differ between
    processes). H100, B=4 S=8k bfloat16, backward against the default's (one pass, unordered):
    ordered without a mask -4% (faster) at head dim 128 and level at 64, soft-cap -9% and +11%
    (the dQ pass +8%, +6%, +11%, +26%); at head dim 64 causal +4% (the dQ pass +4%), ALiBi +
    causal +15% (+19%), sliding window 1024 +79% (level: its programs, short and many at once,
    wait for each other's adds); at head dim 128 causal +7% (+2%), ALiBi + causal +8% (level)."""
    if not options.get("DETERMINISTIC", False) or buffer_grads:
        return False
    if "DQ_PASS" in options:
        wanted = not options["DQ_PASS"]
    elif tables is None:
        wanted = not (raw and KV_LEN <= SHORT_DQ_PASS)
    elif tables.kv.num.is_cuda and torch.cuda.is_current_stream_capturing():
        wanted = False  # (the share below is read on the host: a plan first made in a graph's capture)
    else:
        wanted = head_dim <= 64 and not persistent_programs(mask) and visited_share(tables) >= 0.25
    return wanted and (tables is None or ordered_q_lists(tables, KV_LEN) is not None)


# Without a block mask and a score_mod, deterministic mode leaves dQ to the dQ pass up to this
# KV_LEN: the ordered adds' programs wait for each other longer there than a pass takes to
# recompute unmodified scores. H200, bfloat16, backward against the default's (one pass,
# unordered), ordered / dQ pass: head dim 128 (H=16) S=2k +20% / +4% (B=4), +24% / +5% (B=2),
# +17% / +4% (B=8); S=4k +13% / +6%; S=8k +1% / +7%. Head dim 64 (H=32, B=4): S=2k +13% / +3%,
# 4k +12% / +2%, 8k +0% / +6%. With a score_mod the pass evaluates it twice: tanh soft-cap at
# head dim 64 ordered +13-15% / pass +23% (S=2k, 4k), so the ordered adds stay there.
SHORT_DQ_PASS = 4096


def dq_by_pass(options: dict, buffer_grads: bool, ordered: bool = False) -> bool:
    """Whether the Hopper backward leaves dQ to a dQ pass (`HopperPlan.dq_pass`): where captured
    tensors need gradients (the Triton pass adds them); in deterministic mode unless dQ is
    ``ordered`` (`ordered_dq`; the pass writes each dQ element once, summing in a fixed order, and
    the Triton one also sums captured-tensor gradients exactly); elsewhere where the kernel option
    DQ_PASS asks (under a block mask the tuner times the forms: `tuning.hopper_backward_candidates`)."""
    if buffer_grads:
        return True
    if options.get("DETERMINISTIC", False):
        return not ordered
    return options.get("DQ_PASS", False)


def hopper_plan(query, key, value, score: Mod, mask: Mod, tables: Tables | None, explicit: dict,
                has_grad_lse: bool, dq_pass: Plan | HopperDqPlan | None = None, ordered: bool = False) -> HopperPlan:
    """``dq_pass``: a Triton plan (`make_plan`) whose preprocess and dQ pass the call runs around a
    main kernel that computes no dQ, or a Gluon dQ pass (`hopper_dq_plan`, which writes Delta:
    no preprocess) run before it (`dq_by_pass` says when). ``ordered`` (without ``dq_pass``): dQ
    is added in a fixed order (`ordered_dq`)."""
    B, Hq, Q_LEN, E = query.shape
    ordered = ordered and dq_pass is None
    Bkv, Hkv, KV_LEN, _ = value.shape
    device, dtype = query.device, query.dtype
    block_m, block_n = hopper.BWD_BLOCK_M, hopper.BWD_BLOCK_N
    if tables is None:
        # one row of consecutive full query blocks, read by every program (KV block 0)
        sparse_q, sparse_kv, lists = block_m, LARGE_BLOCK, dense(device, triton.cdiv(Q_LEN, block_m))
    else:
        sparse_q, sparse_kv, lists = tables.q_block, tables.kv_block, None
    kv_batched = Bkv == B
    raw = launch.raw_scores(score, torch.float32)
    affine = launch.affine_scores(score, dtype, max(Q_LEN, KV_LEN))
    # (16-bit dK and dV through descriptors; K/V broadcast over the batch: float32, summed by the host)
    descriptors = hopper.Descriptors(dtype, E, backward=True, outputs=kv_batched)
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
        GQA_SHARED_HEADS=Hq // Hkv, KV_BATCH_BROADCAST=not kv_batched,
        # (the ordered lists merge the full blocks into the list of partial ones, each entry flagged)
        HAS_FULL_BLOCKS=tables is None or (tables.kv.has_full and not ordered),
        # (without a block mask the lists are 0, 1, 2, ...; the transposed lists promise nothing)
        BLOCKS_ARE_CONTIGUOUS=tables is None,
        # no query tile crosses Q_LEN and no program's KV tile crosses KV_LEN
        IS_DIVISIBLE=Q_LEN % sparse_q == 0 and KV_LEN % block_n == 0,
        SCORES_IN_BASE2=raw,
        SCORE_AFFINE=affine,
        # a score_mod whose derivative in the score is a constant: P's exp2 under dP (ALiBi + causal
        # +7-8% at head dim 128, +4% at 64; without a score_mod level or slower: python -m benchmarks attention)
        LATE_DP_WAIT=not raw and score_mod_grad(score).score.op == "const",
        NUM_BUFFERS=hopper.BWD_NUM_BUFFERS[E], CONSUMER_REGS=hopper.CONSUMER_REGISTERS[2],
        SCORE_DTYPE=launch.ACC_TL_DTYPE.get(score.score_dtype, launch.ACC_TL_DTYPE[torch.float32]),
        DEFER_DQ=dq_pass is None and defer_dq(E, affine, mask, ordered),
        DKV_TMA=descriptors.with_out,
        COMPUTE_DQ=dq_pass is None,
        PERSISTENT=dq_pass is not None and persistent_programs(mask),
        DQ_ORDERED=ordered,
        num_warps=hopper.NUM_WARPS, maxnreg=hopper.MAX_REGISTERS[2],
    )
    fast_math = opts.fast_math(explicit, device, dtype)
    kernel = hopper_module(score, mask, fast_math).flex_attention_backward
    grid = (triton.cdiv(KV_LEN, block_n), B * Hkv)
    main = launch.Launch(kernel, _programs(grid, constexprs["PERSISTENT"], device), constexprs, device,
                         describe=descriptors.describe)
    if isinstance(dq_pass, HopperDqPlan):
        pre = None
    else:
        pre = dq_pass.preprocess if dq_pass is not None else _preprocess(
            module(score, mask, (), launch.target_for(device), fast_math), query, value, has_grad_lse, zero_dq=True)
    # a KV head's query heads' Q and dO, and their float32 dQ accumulator
    # (ordered dQ adds under a block mask: heads interleaved also on grids of many waves, so that
    # fewer of the programs that start together add into the same dQ tiles, each waiting for the
    # one before: H100 S=8k, causal at head dim 64 +4% against the default one pass, +21% in the
    # grid's order. Without a mask the grid's order: -4% against the default at head dim 128,
    # -2% with heads interleaved; +0% and +3% at head dim 64)
    group = hopper.head_group(device, Q_LEN * E * (2 * query.element_size() + 4) * (Hq // Hkv), B * Hkv,
                              0 if ordered else grid[0] * grid[1], tables is not None, explicit.get("HEAD_GROUP"))
    return HopperPlan(pre, main, descriptors, layout.contiguous_or_order(query),
                      key.dtype if kv_batched else torch.float32, kv_batched, lists,
                      (Hq, Hkv, Q_LEN, KV_LEN, B, group), dq_pass, ordered,
                      # (whole sparse blocks: a block's last tile may start past Q_LEN)
                      triton.cdiv(Q_LEN, sparse_q) * (sparse_q // block_m) if ordered else 0)


def run(plan: Plan | HopperPlan, query, key, value, out, lse, grad_out, grad_lse, score: Mod, score_bufs,
        mask: Mod, mask_bufs, tables: Tables | None, scale: float, sinks: torch.Tensor | None = None):
    """``(dq, dk, dv, {buffer index: grad}, d sinks)`` for the captured tensors in
    ``plan.grad_buffers`` (a `HopperPlan` computes none); d sinks is None without ``sinks``."""
    if isinstance(plan, HopperPlan):
        return _run_hopper(plan, query, key, value, out, lse, grad_out, grad_lse, score, score_bufs, mask,
                           mask_bufs, tables, scale, sinks)
    B, Hq, Q_LEN, E = query.shape
    _, Hkv, KV_LEN, Ev = value.shape
    device = query.device
    grad_bufs = _grad_buffers(plan, score_bufs, device)
    dq = launch.empty(query.shape, query.dtype, device, plan.dq_order)
    dk = launch.empty((B, Hkv, KV_LEN, E), plan.dk_dtype, device)
    dv = launch.empty((B, Hkv, KV_LEN, Ev), plan.dk_dtype, device)
    if query.numel() == 0 or key.numel() == 0:
        d_sinks = None
        if sinks is not None:  # (rows that see no key: LSE = sinks[h], Delta = rowsum(dO * O) - dLSE)
            delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
            if grad_lse is not None:
                delta = delta - grad_lse.to(lse.dtype)
            d_sinks = sink_grad(sinks, lse, delta)
        return dq.zero_(), dk.zero_(), dv.zero_(), _grad_values(plan, grad_bufs), d_sinks
    if plan.dense is not None:
        q_lists, kv_lists = plan.dense
    else:
        q_lists, kv_lists = q_direction(tables, KV_LEN), tables.kv

    delta = launch.empty((B, Hq, Q_LEN), plan.acc, device)
    dlse = grad_lse if grad_lse is not None else lse
    plan.preprocess(*preprocess_args(out, grad_out, dlse, delta, None, Hq, Q_LEN))

    mod_args = (*launch.buffer_args(score, score_bufs), *launch.buffer_args(mask, mask_bufs))
    plan.dkdv(*dkdv_args(plan, query, key, value, grad_out, lse, delta, dk, dv, q_lists, mod_args, scale))
    plan.dq(*dq_args(plan, query, key, value, grad_out, lse, delta, dq, kv_lists, mod_args, grad_bufs, scale))
    if not plan.kv_batched:  # K/V broadcast over the batch: their gradient sums over it (torch's
        # sums are deterministic)
        dk = dk.sum(0, keepdim=True).to(key.dtype)
        dv = dv.sum(0, keepdim=True).to(value.dtype)
    return dq, dk, dv, _grad_values(plan, grad_bufs), sink_grad(sinks, lse, delta)


def _grad_buffers(plan: Plan, score_bufs, device) -> dict:
    """Zeroed sums for the captured tensors' gradients (the exact sums: three 64-bit words per
    element, see `exact_sum_value`)."""
    return {i: torch.zeros((*score_bufs[i].shape, 3) if plan.exact_grads else score_bufs[i].shape,
                           dtype=torch.int64 if plan.exact_grads else plan.acc, device=device)
            for i in plan.grad_buffers}


def sink_grad(sinks: torch.Tensor | None, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor | None:
    """d loss / d sinks[h] = -sum over the batch and the rows of exp(sinks[h] - LSE) Delta: each
    row's sink probability times its Delta = rowsum(dO * O) - dLSE (dS of the sink's logit, as for
    any score). Plain sums over [B, Hq, Q_LEN]: deterministic. A sink of -inf is no sink: its
    probability is 0, also on rows that see nothing (LSE -inf)."""
    if sinks is None:
        return None
    sink = sinks.to(lse.dtype)[None, :, None]
    p = torch.where(sink == -torch.inf, 0.0, torch.exp(sink - lse))
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


def _grad_values(plan: Plan, grad_bufs: dict) -> dict:
    if not plan.exact_grads:
        return grad_bufs
    return {i: exact_sum_value(words, plan.acc) for i, words in grad_bufs.items()}


def exact_sum_value(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The value of the exact sums that the prelude's ``_fa_atomic_add_exact`` adds into (int64
    ``words`` [..., 3]: hi, lo, special; see its note) in ``dtype``: hi + lo * 2^-64 + special,
    computed in float64. The sums are exact; what this rounds is the same every time.

    >>> w = torch.tensor([[-1, -2**63, 0]])  # -1 + 0.5
    >>> exact_sum_value(w, torch.float32)
    tensor([-0.5000])
    """
    hi, lo = words[..., 0].to(torch.float64), words[..., 1].to(torch.float64)
    lo = torch.where(lo < 0, lo + 2.0 ** 64, lo)  # (lo is unsigned)
    special = words[..., 2].view(torch.float64)
    return (hi + lo * 2.0 ** -64 + special).to(dtype)


def dkdv_args(plan: Plan, query, key, value, grad_out, lse, delta, dk, dv, q_lists: Direction, mod_args: tuple,
              scale: float) -> tuple:
    """The dK/dV pass's arguments, group by group in the order `signatures.BACKWARD_DKDV`
    declares (``mod_args``: the mods' captured tensors, `launch.buffer_args` of each)."""
    return (query, key, value, grad_out, lse, delta, dk, dv, *q_lists.args(), *mod_args, *plan.strides,
            *grad_out.stride(), *lse.stride(), *dk.stride(), *dv.stride(), *q_lists.strides(), *plan.sizes, scale)


def dq_args(plan: Plan, query, key, value, grad_out, lse, delta, dq, kv_lists: Direction, mod_args: tuple,
            grad_bufs: dict, scale: float) -> tuple:
    """The dQ pass's arguments, group by group in the order `signatures.BACKWARD_DQ` declares
    (the mods' captured tensors, then the gradient buffers ``grad_bufs`` it adds into)."""
    hq, _, q_len, kv_len = plan.sizes
    return (query, key, value, grad_out, lse, delta, dq, *kv_lists.args(), *mod_args,
            *emit.grad_launch_args(grad_bufs, plan.exact_grads), *plan.strides, *grad_out.stride(), *lse.stride(),
            *dq.stride(), *kv_lists.strides(), hq, q_len, kv_len, scale)


def buffer_grads(grads: dict, score_bufs, need) -> list:
    """The score mod's captured tensors' gradients as autograd wants them: None where not wanted,
    zeros where the mod does not read the tensor in a way that depends on it, else the kernels'
    sum (``grads``, float32/64) in the tensor's dtype."""
    out = []
    for i, t in enumerate(score_bufs):
        if not need[i]:
            out.append(None)
        elif i in grads:
            out.append(grads[i].to(t.dtype))
        else:
            out.append(torch.zeros_like(t))
    return out


def hopper_args(plan: HopperPlan, query, key, value, grad_out, lse, delta, dq_acc, dq_counts, dk, dv,
                lists: Direction, score: Mod, score_bufs, mask: Mod, mask_bufs, scale: float) -> tuple:
    """The Gluon backward's arguments, group by group in the order `signatures.BACKWARD_HOPPER`
    declares (Q, K, V, dO, the dQ accumulator and, where `hopper.Descriptors.with_out`, dK and dV
    through TMA descriptors, which the launch makes of them: `hopper.Descriptors.describe`;
    ``dq_counts``: `dq_counts`' tensor)."""
    return (query, key, value, grad_out, dq_acc, dq_counts, lse, delta, dk, dv, *lists.args(),
            *launch.buffer_args(score, score_bufs), *launch.buffer_args(mask, mask_bufs),
            *lse.stride(), *dk.stride()[:3], *dv.stride()[:3], *lists.strides(), *plan.sizes, scale)


# Tensors a kernel takes and never reads (one per device and kind), kept: allocated once, outside
# any CUDA graph capture (a graph's memory is freed with the graph).
_UNREAD: dict[tuple, torch.Tensor] = {}


def _unread(kind: tuple, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    t = _UNREAD.get((kind, device))
    if t is None:
        t = make()
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _UNREAD[(kind, device)] = t
    return t


def dq_counts(plan: HopperPlan, device: torch.device) -> torch.Tensor:
    """The ordered adds' counts (`HopperPlan.ordered`): one int32 per dQ tile (64 rows of a query
    head), zeroed; otherwise one int32 the kernel does not read."""
    if not plan.ordered:
        return _unread(("counts",), device, lambda: torch.zeros(1, dtype=torch.int32, device=device))
    Hq, _, _, _, B, _ = plan.sizes
    return torch.zeros(B * Hq * plan.dq_tiles, dtype=torch.int32, device=device)


def dq_stand_in(head_dim: int, device: torch.device) -> torch.Tensor:
    """The dQ accumulator of a Hopper backward that computes no dQ (a dQ pass does): one tile, for
    its descriptor; the kernel neither reads nor writes it."""
    return _unread(("dq", head_dim), device, lambda: torch.empty((1, 1, hopper.BWD_BLOCK_M, head_dim),
                                                                 dtype=torch.float32, device=device))


def _run_hopper(plan: HopperPlan, query, key, value, out, lse, grad_out, grad_lse, score: Mod, score_bufs,
                mask: Mod, mask_bufs, tables: Tables | None, scale: float, sinks: torch.Tensor | None):
    B, Hq, Q_LEN, E = query.shape
    Hkv, KV_LEN = value.shape[1], value.shape[2]
    device = query.device
    delta = launch.empty((B, Hq, Q_LEN), torch.float32, device)
    dlse = grad_lse if grad_lse is not None else lse
    split = plan.dq_pass
    if split is None:
        # (in the query's layout: the float conversion keeps it, and dQ has the query's layout; the
        # preprocess zeroes it)
        dq_acc = launch.empty(query.shape, torch.float32, device, plan.dq_order)
        plan.preprocess(*preprocess_args(out, grad_out, dlse, delta, dq_acc, Hq, Q_LEN))
    else:
        dq_acc = dq_stand_in(E, device)
        if isinstance(split, HopperDqPlan):  # (it writes Delta, which the main kernel reads)
            dq = launch.empty(query.shape, query.dtype, device, plan.dq_order)
            kv_lists = split.dense if split.dense is not None else tables.kv
            split.main(*hopper_dq_args(split, query, key, value, out, grad_out, dq, lse, delta, dlse, kv_lists,
                                       score, score_bufs, mask, mask_bufs, scale))
        else:
            plan.preprocess(*preprocess_args(out, grad_out, dlse, delta, None, Hq, Q_LEN))
    dk = launch.empty((B, Hkv, KV_LEN, E), plan.dk_dtype, device)
    dv = launch.empty((B, Hkv, KV_LEN, E), plan.dk_dtype, device)
    if plan.dense is not None:
        lists = plan.dense
    else:
        lists = ordered_q_lists(tables, KV_LEN) if plan.ordered else q_direction(tables, KV_LEN)
    plan.main(*hopper_args(plan, query, key, value, grad_out, lse, delta, dq_acc, dq_counts(plan, device), dk, dv,
                           lists, score, score_bufs, mask, mask_bufs, scale))
    grads = {}
    if split is None:
        dq = dq_acc.to(query.dtype)
    elif not isinstance(split, HopperDqPlan):
        grad_bufs = _grad_buffers(split, score_bufs, device)
        dq = launch.empty(query.shape, query.dtype, device, split.dq_order)
        mod_args = (*launch.buffer_args(score, score_bufs), *launch.buffer_args(mask, mask_bufs))
        kv_lists = split.dense[1] if split.dense is not None else tables.kv
        split.dq(*dq_args(split, query, key, value, grad_out, lse, delta, dq, kv_lists, mod_args, grad_bufs, scale))
        grads = _grad_values(split, grad_bufs)
    if not plan.kv_batched:  # K/V broadcast over the batch: their gradient sums over it
        dk = dk.sum(0, keepdim=True).to(key.dtype)
        dv = dv.sum(0, keepdim=True).to(value.dtype)
    return dq, dk, dv, grads, sink_grad(sinks, lse, delta)
