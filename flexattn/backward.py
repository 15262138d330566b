"""The backward pass of `flex_attention`: dQ, dK, dV and gradients of captured tensors.

`flex_attention_backward` is what ``FlexAttentionFunction.backward`` calls. It launches the three
kernels of ``codegen/templates/backward.py`` (preprocess, dK/dV, dQ) generated for the pair of mods
plus the score mod's symbolic derivative (`flexattn.autodiff`):

* the score mod's derivative w.r.t. the score is inlined into both passes;
* every gather from a captured floating tensor that requires grad gets its derivative scattered
  (atomic adds, float32/float64 accumulation) into that tensor's gradient in the dQ pass;
* GQA: each dK/dV program loops over the query heads of its group (deterministic sum);
* K/V with batch 1 broadcast over the query's batch: dK/dV are computed per query batch in
  float32 and summed on the host;
* a gradient flowing into the returned LSE enters through Delta (d LSE / d score = P);
* fully masked rows (LSE = -inf) contribute exactly zero, never NaN.

Example::

    >>> import torch, flexattn
    >>> q, k, v = (torch.randn(1, 2, 19, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> flexattn.flex_attention(q, k, v).sum().backward()
    >>> q.grad.shape
    torch.Size([1, 2, 19, 16])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import triton

from flexattn import autodiff
from flexattn.codegen import emit
from flexattn.codegen.launch import ACC_TL_DTYPE, LARGE_BLOCK, needs_int64_offsets, pow2_at_least, target_for
from flexattn.codegen.render import load_kernel_module, template_text
from flexattn.mods import Mod



# ---------------------------------------------------------------------------------------------
# Options


def default_backward_options(device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                             v_head_dim: int) -> dict[str, Any]:
    """Backward tile sizes and launch settings for one device / dtype / head-dim combination.

    BLOCK_M1 x BLOCK_N1 is the dK/dV pass's tile (query rows per step x KV rows per program),
    BLOCK_M2 x BLOCK_N2 the dQ pass's. This table is the backward's tuning surface; tiles are
    shrunk later to fit short sequences and the block mask's block sizes.
    >>> default_backward_options(torch.device("cpu"), torch.float32, 64, 64)["BLOCK_N1"]
    32
    """
    d = max(qk_head_dim, v_head_dim)
    if device.type != "cuda":
        m1, n1, m2, n2, warps, stages = 32, 32, 32, 32, 4, 1
    elif dtype == torch.float64:
        m1, n1, m2, n2, warps, stages = 16, 32, 32, 16, 4, 1
    elif dtype == torch.float32:
        m1, n1, m2, n2, warps, stages = 32, 64, 64, 32, 4, 1
    # bf16/fp16 on Hopper, from benchmarks/sweep_attention.py (docs/raw/*_sweep_attention.log):
    # at D=64, 64x128 tiles with 4 warps spill (107 TF/s) where 64x64 runs at 326-353; at D=128,
    # 3 stages beat 2 by 5-8%.
    elif d <= 64:
        m1, n1, m2, n2, warps, stages = 64, 64, 64, 64, 4, 3
    elif d <= 128:
        m1, n1, m2, n2, warps, stages = 64, 128, 128, 64, 8, 3
    else:
        m1, n1, m2, n2, warps, stages = 32, 64, 64, 32, 4, 1
    return {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2,
            "num_warps": warps, "num_stages": stages, "BLOCKS_ARE_CONTIGUOUS": False}



def _fit(tile: int, length: int, sparse: int | None) -> int:
    """``tile`` shrunk to the sequence (rounded up to a power of two) and to divide ``sparse``."""
    t = min(tile, pow2_at_least(length))
    if sparse is not None:
        t = min(t, sparse & -sparse)
    return t


# ---------------------------------------------------------------------------------------------
# Block lists


@dataclass(frozen=True)
class BlockLists:
    """One direction of a block mask: counts and indices (partial and full), int32."""

    num: torch.Tensor
    idx: torch.Tensor
    full_num: torch.Tensor | None
    full_idx: torch.Tensor | None

    def args(self) -> list[torch.Tensor]:
        fn = self.full_num if self.full_num is not None else self.num
        fi = self.full_idx if self.full_idx is not None else self.idx
        return [self.num, self.idx, fn, fi]

    def strides(self) -> list[int]:
        """Strides [b, h, row] of each tensor; 0 where the mask broadcasts over B or H."""
        out = []
        for t in self.args():
            out += [t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0, t.stride(2)]
        return out


def _int32(t: torch.Tensor | None, name: str, ndim: int, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"block_mask.{name} must be a {ndim}-d tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device != device:
        raise ValueError(f"block_mask.{name} is on {t.device} but query is on {device}")
    t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def transpose_blocks(num: torch.Tensor, idx: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The column-major twin of a (num, idx) block list: for each column block, the rows listing it.

    Used when a block mask carries no ``q_*`` lists. Rows come out in increasing order.
    >>> n, i = transpose_blocks(torch.tensor([[[1, 2]]]), torch.tensor([[[[1, 0], [0, 1]]]]), 2)
    >>> n.tolist(), i[..., :1].tolist(), i[0, 0, 1].tolist()
    ([[[1, 2]]], [[[[1], [0]]]], [0, 1])
    """
    listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()
    grid = torch.zeros(*idx.shape[:3], n_cols, dtype=torch.int32, device=idx.device)
    grid.scatter_add_(-1, torch.where(listed, idx.long(), 0), listed.to(torch.int32))
    seen = (grid > 0).transpose(-1, -2)  # [B, H, n_cols, n_rows]
    count = seen.sum(-1).to(torch.int32)
    rows = torch.arange(seen.shape[-1], device=idx.device)
    # Listed rows first, in increasing order: sort keys put unlisted rows at the end.
    order = torch.where(seen, rows, rows + seen.shape[-1]).argsort(-1).to(torch.int32)
    return count.contiguous(), order.contiguous()


def _lists(block_mask, blocks, Q_LEN: int, KV_LEN: int, device) -> tuple[BlockLists, BlockLists, int, int]:
    """(kv lists for dQ, q lists for dK/dV, sparse q block, sparse kv block) of a user block mask."""
    kv = BlockLists(blocks.kv_num_blocks, blocks.kv_indices, blocks.full_kv_num_blocks, blocks.full_kv_indices)
    q_num = _int32(getattr(block_mask, "q_num_blocks", None), "q_num_blocks", 3, device)
    n_kv = triton.cdiv(KV_LEN, blocks.kv_block)
    if q_num is not None:
        q_idx = _int32(block_mask.q_indices, "q_indices", 4, device)
        fq_num = _int32(getattr(block_mask, "full_q_num_blocks", None), "full_q_num_blocks", 3, device)
        fq_idx = _int32(getattr(block_mask, "full_q_indices", None), "full_q_indices", 4, device)
        if q_num.shape[2] < n_kv:
            raise ValueError(f"block_mask.q_num_blocks has {q_num.shape[2]} KV blocks, KV_LEN={KV_LEN} needs {n_kv}")
    else:
        q_num, q_idx = transpose_blocks(blocks.kv_num_blocks, blocks.kv_indices, n_kv)
        fq_num = fq_idx = None
        if blocks.full_kv_num_blocks is not None:
            fq_num, fq_idx = transpose_blocks(blocks.full_kv_num_blocks, blocks.full_kv_indices, n_kv)
    if (fq_num is None) != (kv.full_num is None):
        raise ValueError("block_mask has full blocks in one direction only (full_kv_* vs full_q_*)")
    return kv, BlockLists(q_num, q_idx, fq_num, fq_idx), blocks.q_block, blocks.kv_block


@functools.lru_cache(maxsize=256)
def _dense_lists(device: torch.device, n: int) -> BlockLists:
    """No block mask: one row of ``n`` consecutive full blocks, starting at block 0."""
    zeros = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    full = torch.full((1, 1, 1), n, dtype=torch.int32, device=device)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=device)
    return BlockLists(zeros, idx, full, idx)


# ---------------------------------------------------------------------------------------------
# Generated kernels


@functools.lru_cache(maxsize=None)
def score_mod_grad(score_mod: Mod) -> autodiff.ScoreModGrad:
    """The symbolic derivative of ``score_mod`` (raises `autodiff.NotDifferentiableError` early)."""
    autodiff.check_differentiable(score_mod.ir, f"score_mod '{score_mod.name}'")
    return autodiff.differentiate(score_mod.ir)


_MODULES: dict[tuple, Any] = {}


def _kernel_module(score_mod: Mod, mask_mod: Mod, grad_buffers: tuple[int, ...], target: str):
    """The generated backward module for the pair of mods and the captured tensors needing grads."""
    key = (score_mod.key(), mask_mod.key(), grad_buffers, target)
    module = _MODULES.get(key)
    if module is not None:
        return module
    d = score_mod_grad(score_mod)
    scatters = [(g.load, g.grad) for g in d.loads if g.buffer.index in grad_buffers]
    score_src = score_mod.emit(target, "score_mod")
    mask_src = mask_mod.emit(target, "mask_mod")
    grad_src = emit.emit_score_grad(d.score, scatters, "score_mod_grad", target, q_axis=0)
    dscore_src = emit.emit_score_grad(d.score, (), "score_mod_dscore", target, q_axis=1)
    grads = {g.buffer.index: g.buffer for g in d.loads if g.buffer.index in grad_buffers}
    grad_params = "".join(f"score_G{i}, " + "".join(f"score_G{i}_s{k}, " for k in range(grads[i].ndim))
                          for i in sorted(grads))
    hooks = {
        "prelude": emit.prelude(target),
        "tile_helpers": template_text("tiles"),
        "score_mod_def": score_src.source,
        "mask_mod_def": mask_src.source,
        "score_grad_def": grad_src.source,
        "score_dscore_def": dscore_src.source,
        "score_mod_params": score_src.param_list("score_"),
        "mask_mod_params": mask_src.param_list("mask_"),
        "grad_params": grad_params,
        "score_grad_args": grad_src.param_list("score_"),
        "score_dscore_args": dscore_src.param_list("score_"),
    }
    provenance = {f"score_mod {score_mod.name}": score_mod.source, f"mask_mod {mask_mod.name}": mask_mod.source}
    module = load_kernel_module("backward", hooks, provenance, interpret=target == "interpret")
    _MODULES[key] = module
    return module


def _empty(shape, dtype: torch.dtype, device, like: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised tensor the kernels write in full (tests fill it with NaN to prove that)."""
    if like is not None:
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(shape, dtype=dtype, device=device)



def _kv_strides(t: torch.Tensor, broadcast: bool) -> list[int]:
    s = list(t.stride())
    if broadcast:
        s[0] = 0
    return s


# ---------------------------------------------------------------------------------------------
# Entry point


def flex_attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                            grad_lse: torch.Tensor | None, score_mod: Mod, mask_mod: Mod,
                            block_mask, blocks, scale: float, kernel_options: dict | None = None,
                            buffers_need_grad: Sequence[bool] = ()):
    """Gradients of `flex_attention`: ``(dq, dk, dv, buffer_grads)``.

    ``buffers_need_grad[i]`` says whether ``score_mod.buffers[i]`` wants a gradient; the result's
    ``buffer_grads[i]`` is then its gradient (zeros if the mod never reads it in a way that depends
    on it) and None otherwise. ``blocks`` is the forward's `SparseBlocks` (None: no block mask).
    ``kernel_options`` may hold BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, bwd_num_warps,
    bwd_num_stages and BLOCKS_ARE_CONTIGUOUS (the rest is ignored here).
    """
    B, Hq, Q_LEN, E = query.shape
    Bkv, Hkv, KV_LEN, Ev = value.shape
    device = query.device
    target = target_for(device)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    kernel_options = dict(kernel_options or {})
    opts = default_backward_options(device, query.dtype, E, Ev)
    # The forward's num_warps / num_stages do not carry over: the backward has its own knobs.
    renamed = {"bwd_num_warps": "num_warps", "bwd_num_stages": "num_stages"}
    opts.update({renamed.get(k, k): v for k, v in kernel_options.items()
                 if renamed.get(k, k) in opts and k not in ("num_warps", "num_stages")})

    # -- captured tensors that want gradients: float32/64 buffers the dQ pass adds into
    d = score_mod_grad(score_mod)
    want = {i for i, w in enumerate(buffers_need_grad) if w and score_mod.buffers[i].dtype.is_floating_point}
    read = {g.buffer.index for g in d.loads}
    grad_bufs = {i: torch.zeros(score_mod.buffers[i].shape, dtype=torch.float64 if acc == torch.float64
                                else torch.float32, device=device) for i in sorted(want & read)}

    dq = _empty(query.shape, query.dtype, device, like=query)
    kv_batched = Bkv == B
    dk_dtype = key.dtype if kv_batched else acc
    dk = _empty((B, Hkv, KV_LEN, E), dk_dtype, device)
    dv = _empty((B, Hkv, KV_LEN, Ev), dk_dtype, device)
    if query.numel() == 0 or key.numel() == 0 or grad_out is None:
        dq.zero_(), dk.zero_(), dv.zero_()
        return _finish(dq, dk, dv, key, value, kv_batched, grad_bufs, score_mod, want)

    # -- tiles and block lists
    if blocks is None:
        m1 = _fit(opts["BLOCK_M1"], Q_LEN, None)
        n1 = _fit(opts["BLOCK_N1"], KV_LEN, None)
        m2 = _fit(opts["BLOCK_M2"], Q_LEN, None)
        n2 = _fit(opts["BLOCK_N2"], KV_LEN, None)
        # dK/dV walks query tiles of BLOCK_M1 in one long KV block; dQ walks KV tiles of BLOCK_N2.
        q_lists = _dense_lists(device, triton.cdiv(Q_LEN, m1))
        kv_lists = _dense_lists(device, triton.cdiv(KV_LEN, n2))
        sq1, skv1, sq2, skv2 = m1, LARGE_BLOCK, LARGE_BLOCK, n2
        contiguous_q = contiguous_kv = True  # the dense lists are 0, 1, 2, ...
        divisible1 = Q_LEN % m1 == 0 and KV_LEN % n1 == 0
        divisible2 = Q_LEN % m2 == 0 and KV_LEN % n2 == 0
    else:
        kv_lists, q_lists, sq, skv = _lists(block_mask, blocks, Q_LEN, KV_LEN, device)
        m1, n1 = _fit(opts["BLOCK_M1"], Q_LEN, sq), _fit(opts["BLOCK_N1"], KV_LEN, skv)
        m2, n2 = _fit(opts["BLOCK_M2"], Q_LEN, sq), _fit(opts["BLOCK_N2"], KV_LEN, skv)
        sq1 = sq2 = sq
        skv1 = skv2 = skv
        # The user's promise is about each query block's KV blocks (the dQ pass's lists). It says
        # nothing about the transposed lists the dK/dV pass walks: those are never assumed.
        contiguous_kv, contiguous_q = bool(opts["BLOCKS_ARE_CONTIGUOUS"]), False
        divisible1 = divisible2 = Q_LEN % sq == 0 and KV_LEN % skv == 0
    e_round, ev_round = pow2_at_least(E), pow2_at_least(Ev)
    offs_int64 = needs_int64_offsets(query, key, value, out, grad_out, dk, dv)
    common = dict(
        QK_HEAD_DIM=E, QK_HEAD_DIM_ROUNDED=e_round, V_HEAD_DIM=Ev, V_HEAD_DIM_ROUNDED=ev_round,
        SAFE_HEAD_DIM=E == e_round and Ev == ev_round, GQA_SHARED_HEADS=Hq // Hkv,
        HAS_FULL_BLOCKS=True, OFFS_INT64=offs_int64,
        ACC_DTYPE=ACC_TL_DTYPE[acc], SCORE_DTYPE=ACC_TL_DTYPE.get(score_mod.score_dtype, ACC_TL_DTYPE[acc]),
        DOT_PRECISION="tf32" if query.dtype == torch.float32 and device.type == "cuda"
        and torch.backends.cuda.matmul.allow_tf32 else "ieee",
        DOT_IN_FP32=device.type == "cpu" and query.dtype == torch.bfloat16,
    )
    has_full_q, has_full_kv = q_lists.full_num is not None, kv_lists.full_num is not None
    module = _kernel_module(score_mod, mask_mod, tuple(sorted(grad_bufs)), target)
    launch = dict(num_warps=opts["num_warps"], num_stages=opts["num_stages"])

    # -- Delta = rowsum(dO * O) - dLSE
    delta = _empty((B, Hq, Q_LEN), acc, device)
    has_grad_lse = grad_lse is not None
    dlse = grad_lse if has_grad_lse else lse
    pre_m = min(64, pow2_at_least(Q_LEN))
    module.backward_preprocess[(triton.cdiv(Q_LEN, pre_m), B * Hq)](
        out, grad_out, dlse, delta, *out.stride(), *grad_out.stride(), *dlse.stride(),
        Hq, Q_LEN, BLOCK_M=pre_m, V_HEAD_DIM=Ev, V_HEAD_DIM_ROUNDED=ev_round,
        HAS_GRAD_LSE=has_grad_lse, ACC_DTYPE=ACC_TL_DTYPE[acc],
    )

    kv_strides = _kv_strides(key, not kv_batched) + _kv_strides(value, not kv_batched)
    mod_args = [*score_mod.launch_args(), *mask_mod.launch_args()]

    # -- dK, dV: one program per (KV tile, batch x KV head)
    c1 = dict(common, HAS_FULL_BLOCKS=has_full_q, IS_DIVISIBLE=divisible1, BLOCKS_ARE_CONTIGUOUS=contiguous_q)
    module.backward_dkdv[(triton.cdiv(KV_LEN, n1), B * Hkv)](
        query, key, value, grad_out, lse, delta, dk, dv, *q_lists.args(), *mod_args,
        *query.stride(), *kv_strides, *grad_out.stride(), *lse.stride(), *dk.stride(), *dv.stride(),
        *q_lists.strides(), Hq, Hkv, Q_LEN, KV_LEN, scale,
        BLOCK_M1=m1, BLOCK_N1=n1, SPARSE_Q_BLOCK_SIZE=sq1, SPARSE_KV_BLOCK_SIZE=skv1, **c1, **launch,
    )

    # -- dQ (and captured-tensor gradients): one program per (query tile, batch x query head)
    c2 = dict(common, HAS_FULL_BLOCKS=has_full_kv, IS_DIVISIBLE=divisible2, BLOCKS_ARE_CONTIGUOUS=contiguous_kv)
    module.backward_dq[(triton.cdiv(Q_LEN, m2), B * Hq)](
        query, key, value, grad_out, lse, delta, dq, *kv_lists.args(), *mod_args,
        *emit.grad_launch_args(None, grad_bufs),
        *query.stride(), *kv_strides, *grad_out.stride(), *lse.stride(), *dq.stride(),
        *kv_lists.strides(), Hq, Q_LEN, KV_LEN, scale,
        BLOCK_M2=m2, BLOCK_N2=n2, SPARSE_Q_BLOCK_SIZE=sq2, SPARSE_KV_BLOCK_SIZE=skv2, **c2, **launch,
    )
    return _finish(dq, dk, dv, key, value, kv_batched, grad_bufs, score_mod, want)


def _finish(dq, dk, dv, key, value, kv_batched, grad_bufs, score_mod, want):
    if not kv_batched:  # K/V broadcast over the batch: their gradient sums over it
        dk = dk.sum(0, keepdim=True).to(key.dtype)
        dv = dv.sum(0, keepdim=True).to(value.dtype)
    buffer_grads = []
    for i, t in enumerate(score_mod.buffers):
        if i not in want:
            buffer_grads.append(None)
        elif i in grad_bufs:
            buffer_grads.append(grad_bufs[i].to(t.dtype))
        else:
            buffer_grads.append(torch.zeros_like(t))
    return dq, dk, dv, buffer_grads
