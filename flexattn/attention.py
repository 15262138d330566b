"""`flex_attention`: block-sparse attention with compiled score/mask mods.

Same arguments and meaning as ``torch.nn.attention.flex_attention.flex_attention``::

    out = flex_attention(q, k, v, score_mod=softcap, block_mask=mask)
    out, lse = flex_attention(q, k, v, return_lse=True)          # lse: natural log, fp32, [B, Hq, L]

The work is split in three steps, each cached where it is pure:

1. validate the inputs and resolve the mods (Python mods are traced to `Mod`\\ s);
2. plan the launch (`_plan`): tile sizes, constexpr flags and grid, from shapes, dtypes, block
   sizes and ``kernel_options`` (defaults for all of these live in `default_kernel_options`);
3. fetch the generated kernel module for the pair of mods (`_kernel_module`) and launch it.

`FlexAttentionFunction` is the autograd entry; its backward lives in `flexattn.backward`. Short
queries (inference) go to the split-KV decoding kernel in `flexattn.decode` instead.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton

from flexattn import decode, ir
from flexattn.block_mask import as_mod as as_mask_mod
from flexattn.codegen import emit
from flexattn.codegen.launch import ACC_TL_DTYPE, LARGE_BLOCK, needs_int64_offsets, pow2_at_least, target_for
from flexattn.codegen.render import load_kernel_module, template_text
from flexattn.mods import ARITY, MASK, SCORE, Mod
from flexattn.tracer import trace

# ---------------------------------------------------------------------------------------------
# Kernel options: the one place that lists them and picks their defaults.

KERNEL_OPTIONS: dict[str, str] = {
    "BLOCK_M": "query rows per program (power of two, 16..256; divides the block mask's Q block size)",
    "BLOCK_N": "KV columns per inner step (power of two, 16..256; divides the block mask's KV block size)",
    "num_warps": "warps per program (1, 2, 4, 8 or 16)",
    "num_stages": "software-pipelining stages of the KV loop (>= 1)",
    "PRESCALE_QK": "scale q once per tile instead of every score tile (slightly less accurate)",
    "ROWS_GUARANTEED_SAFE": "promise that no query row is fully masked (skips the -inf guard)",
    "BLOCKS_ARE_CONTIGUOUS": "promise that each query block's KV blocks are consecutive",
    "FORCE_USE_FLEX_ATTENTION": "always use the block-sparse kernel, never the decoding kernel",
    # Backward (see flexattn.backward.default_backward_options for their defaults)
    "BLOCK_M1": "backward dK/dV pass: query rows per step (power of two, 16..256)",
    "BLOCK_N1": "backward dK/dV pass: KV rows per program (power of two, 16..256)",
    "BLOCK_M2": "backward dQ pass: query rows per program (power of two, 16..256)",
    "BLOCK_N2": "backward dQ pass: KV columns per step (power of two, 16..256)",
    "bwd_num_warps": "backward: warps per program (1, 2, 4, 8 or 16)",
    "bwd_num_stages": "backward: software-pipelining stages (>= 1)",
}
_BOOL_OPTIONS = ("PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "FORCE_USE_FLEX_ATTENTION")

MAX_HEAD_DIM = 256  # larger tiles do not fit in registers / shared memory


def default_kernel_options(device: torch.device, dtype: torch.dtype, qk_head_dim: int,
                           v_head_dim: int) -> dict[str, Any]:
    """Forward-kernel defaults for one device / dtype / head-dim combination.

    This table is the tuning surface: change defaults here and nowhere else. Tiles are later
    shrunk to fit short sequences and the block mask's block sizes (see `_tile`).
    >>> default_kernel_options(torch.device("cpu"), torch.float32, 64, 64)["BLOCK_M"]
    64
    """
    d = max(qk_head_dim, v_head_dim)
    if device.type != "cuda":
        # Triton's interpreter: cost is per tile operation (numpy underneath), so 64 x 64 tiles
        # are fastest (about 3x faster than 32 x 32, and than 128 x 128, at E = 64).
        block_m, block_n, warps, stages = 64, 64, 4, 1
    elif dtype == torch.float64:
        block_m, block_n, warps, stages = 32, 16, 4, 1
    elif dtype == torch.float32:
        block_m, block_n, warps, stages = (64, 32, 4, 3) if d <= 64 else (32, 32, 4, 2)
    # bf16/fp16 on Hopper, from benchmarks/sweep_attention.py (docs/raw/*_sweep_attention.log):
    # 8 warps beat 4 at D=64 by 2-3%; 128x128 tiles beat 128x64 at D=128 causal by 4%.
    elif d <= 64:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    elif d <= 128:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    return {
        "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
        "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False,
        "FORCE_USE_FLEX_ATTENTION": False,
    }


def _check_kernel_options(kernel_options: dict | None) -> dict[str, Any]:
    if kernel_options is None:
        return {}
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    unknown = sorted(set(kernel_options) - set(KERNEL_OPTIONS) - decode.DECODE_OPTIONS)
    if unknown:
        valid = "\n".join(f"  {k}: {v}" for k, v in KERNEL_OPTIONS.items())
        extra = ", ".join(sorted(decode.DECODE_OPTIONS - set(KERNEL_OPTIONS)))
        raise ValueError(f"kernel_options has unknown key(s) {unknown}; valid keys are:\n{valid}\n"
                         f"  and, for the decoding kernel (short queries; see flexattn.decode): {extra}")
    for key, value in kernel_options.items():
        if key not in KERNEL_OPTIONS:
            continue  # decoding-only knobs: flexattn.decode checks them
        if key in _BOOL_OPTIONS:
            if not isinstance(value, bool):
                raise TypeError(f"kernel_options[{key!r}] must be a bool, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"kernel_options[{key!r}] must be an int, got {value!r}")
        elif key.startswith("BLOCK_") and (value not in (16, 32, 64, 128, 256)):
            raise ValueError(f"kernel_options[{key!r}] must be a power of two in 16..256, got {value}")
        elif key.endswith("num_warps") and value not in (1, 2, 4, 8, 16):
            raise ValueError(f"kernel_options[{key!r}] must be 1, 2, 4, 8 or 16, got {value}")
        elif key.endswith("num_stages") and value < 1:
            raise ValueError(f"kernel_options[{key!r}] must be >= 1, got {value}")
    return dict(kernel_options)


# ---------------------------------------------------------------------------------------------
# Input validation

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, L, E], got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {t.device}")
    B, Hq, _, E = query.shape
    Bkv, Hkv, S, _ = key.shape
    if key.shape[-1] != E:
        raise ValueError(f"key's head dim (last dimension) must equal query's E={E}, got {key.shape[-1]} "
                         f"(query {tuple(query.shape)}, key {tuple(key.shape)})")
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value must match key in [B, H, KV_LEN] = {list(key.shape[:3])}, "
                         f"got {list(value.shape[:3])}")
    if Bkv not in (1, B):
        raise ValueError(f"key/value batch must be 1 (broadcast) or query's batch {B}, got {Bkv}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"query has {Hq} heads but key/value have {Hkv}: pass enable_gqa=True for "
                         f"grouped-query attention")
    for name, d in (("query/key head dim E", E), ("value head dim Ev", value.shape[-1])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {d}")


# ---------------------------------------------------------------------------------------------
# Mods


def _check_score_mod_arity(fn: Callable) -> None:
    """A Python score_mod must take the 5 arguments torch passes (score, b, h, q_idx, kv_idx).

    The tracer would fail too, but with Python's message, which does not name the argument."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # builtins / C functions: let the tracer report
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if not len(required) <= ARITY[SCORE] <= len(positional):
        raise TypeError(f"score_mod must take {ARITY[SCORE]} arguments ({', '.join(ir.SCORE_INPUTS)}), but "
                        f"{getattr(fn, '__name__', fn)!r} takes {len(positional)}")


def score_mod_as_mod(fn: Callable | Mod, score_dtype: torch.dtype, device: torch.device) -> Mod:
    """``score_mod`` as a `Mod` whose score input is ``score_dtype`` (Python functions are traced)."""
    if isinstance(fn, Mod):
        if fn.kind != SCORE:
            raise TypeError(f"score_mod must be a score mod, got the {fn.kind} mod {fn.name!r}")
    elif callable(fn):
        _check_score_mod_arity(fn)
    else:
        raise TypeError(f"score_mod must be a function or a flexattn Mod, got {type(fn).__name__}")
    return trace(fn, SCORE, score_dtype=score_dtype, device=device)


def block_mask_mod(block_mask) -> Mod:
    """The block mask's mask_mod as a `Mod`: flexattn's BlockMask keeps it traced (``.mod``);
    torch's holds the Python function, traced here."""
    mod = getattr(block_mask, "mod", None)
    if isinstance(mod, Mod):
        return mod
    mask_mod = getattr(block_mask, "mask_mod", None)
    return noop_mask_mod() if mask_mod is None else as_mask_mod(mask_mod, MASK, "block_mask.mask_mod")


@functools.lru_cache(maxsize=None)
def identity_score_mod(score_dtype: torch.dtype) -> Mod:
    return Mod(SCORE, ir.input_("score", score_dtype), name="identity")


@functools.lru_cache(maxsize=None)
def noop_mask_mod() -> Mod:
    return Mod(MASK, ir.const(True), name="noop_mask")


# ---------------------------------------------------------------------------------------------
# Block masks (duck-typed: flexattn's BlockMask and torch's have the same fields)


@dataclass(frozen=True)
class SparseBlocks:
    """The block-mask tensors one launch reads, int32 with last dimension contiguous.

    ``q_block``/``kv_block`` are the sparse block sizes. Without a block mask there is one "full"
    block row listing ``cdiv(KV_LEN, BLOCK_N)`` contiguous blocks of ``BLOCK_N`` columns.
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor | None
    full_kv_indices: torch.Tensor | None
    q_block: int
    kv_block: int

    def launch_args(self) -> list:
        """The four tensors (the partial ones stand in for absent full ones: HAS_FULL_BLOCKS is
        then False and they are not read), then each one's [b, h, q_block] strides, 0 where the
        mask broadcasts over B or H."""
        tensors = [self.kv_num_blocks, self.kv_indices]
        if self.full_kv_num_blocks is not None:
            tensors += [self.full_kv_num_blocks, self.full_kv_indices]
        else:
            tensors += tensors
        strides = []
        for t in tensors:
            strides += [t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0, t.stride(2)]
        return tensors + strides


_DENSE_CACHE: dict[tuple, SparseBlocks] = {}


def _dense_blocks(device: torch.device, KV_LEN: int, block_n: int) -> SparseBlocks:
    key = (device, KV_LEN, block_n)
    blocks = _DENSE_CACHE.get(key)
    if blocks is None:
        zeros = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
        full = torch.full((1, 1, 1), triton.cdiv(KV_LEN, block_n), dtype=torch.int32, device=device)
        idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device=device)
        blocks = SparseBlocks(zeros, idx, full, idx, LARGE_BLOCK, block_n)
        if len(_DENSE_CACHE) > 256:
            _DENSE_CACHE.clear()
        _DENSE_CACHE[key] = blocks
    return blocks


def _block_sizes(block_mask) -> tuple[int, int]:
    size = block_mask.BLOCK_SIZE
    q, kv = (size, size) if isinstance(size, int) else tuple(size)
    for name, s in (("Q", q), ("KV", kv)):
        if s % 16 != 0 or s <= 0:
            raise ValueError(f"block_mask's {name} block size must be a positive multiple of 16 (kernel tiles "
                             f"are powers of two >= 16), got BLOCK_SIZE={size}")
    return int(q), int(kv)


def _index_tensor(t: torch.Tensor, name: str, ndim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        raise ValueError(f"block_mask.{name} must be a {ndim}-d tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device != device:
        raise ValueError(f"block_mask.{name} is on {t.device} but query is on {device}; use block_mask.to({str(device)!r})")
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t if t.stride(-1) == 1 else t.contiguous()


def _sparse_blocks(block_mask, B: int, Hq: int, Q_LEN: int, KV_LEN: int, device: torch.device) -> SparseBlocks:
    """Validate a BlockMask against the inputs and collect its tensors."""
    q_block, kv_block = _block_sizes(block_mask)
    seq = getattr(block_mask, "seq_lengths", None)
    if seq is not None and tuple(seq) != (Q_LEN, KV_LEN):
        raise ValueError(f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(seq)}, but query has Q_LEN={Q_LEN} "
                         f"and key KV_LEN={KV_LEN}; build the block mask for these lengths")
    num = _index_tensor(block_mask.kv_num_blocks, "kv_num_blocks", 3, device)
    idx = _index_tensor(block_mask.kv_indices, "kv_indices", 4, device)
    Bm, Hm, nQ = num.shape
    if Bm not in (1, B) or Hm not in (1, Hq):
        raise ValueError(f"block_mask has B={Bm}, H={Hm}; it must have B of 1 or query's {B} and H of 1 or "
                         f"query's {Hq}")
    if nQ < triton.cdiv(Q_LEN, q_block) or idx.shape[:3] != num.shape:
        raise ValueError(f"block_mask has {nQ} query blocks of {q_block} (kv_indices {tuple(idx.shape)}), "
                         f"Q_LEN={Q_LEN} needs {triton.cdiv(Q_LEN, q_block)}")
    full_num = getattr(block_mask, "full_kv_num_blocks", None)
    full_idx = None
    if full_num is not None:
        full_num = _index_tensor(full_num, "full_kv_num_blocks", 3, device)
        full_idx = _index_tensor(block_mask.full_kv_indices, "full_kv_indices", 4, device)
        if full_num.shape != num.shape or full_idx.shape[:3] != num.shape:
            raise ValueError(f"block_mask.full_kv_num_blocks {tuple(full_num.shape)} / full_kv_indices "
                             f"{tuple(full_idx.shape)} must match kv_num_blocks {tuple(num.shape)}")
    return SparseBlocks(num, idx, full_num, full_idx, q_block, kv_block)


# ---------------------------------------------------------------------------------------------
# Launch plan


@dataclass(frozen=True)
class Plan:
    """Everything about one launch that depends only on shapes, dtypes and options."""

    grid: tuple[int, int]
    num_warps: int
    num_stages: int
    constexprs: dict



def _tile(option: str, options: dict, explicit: dict, sparse: int | None, length: int) -> int:
    """A tile size: the user's (checked against the sparse block), or the default shrunk to fit."""
    if option in explicit:
        t = explicit[option]
        if sparse is not None and sparse % t != 0:
            raise ValueError(f"kernel_options[{option!r}]={t} must divide the block mask's block size {sparse}")
        return t
    t = min(options[option], pow2_at_least(length))
    if sparse is not None:
        t = min(t, sparse & -sparse)  # largest power of two dividing the sparse block
    return t




@functools.lru_cache(maxsize=1024)
def _plan(device_type: str, dtype: torch.dtype, B: int, Hq: int, Hkv: int, Q_LEN: int, KV_LEN: int,
          E: int, Ev: int, sparse_q: int | None, sparse_kv: int | None, has_full: bool,
          score_dtype: torch.dtype | None, offs_int64: bool, explicit_items: tuple, allow_tf32: bool) -> Plan:
    explicit = dict(explicit_items)  # the user's kernel_options (forward keys only)
    options = {**default_kernel_options(torch.device(device_type), dtype, E, Ev), **explicit}
    block_m = _tile("BLOCK_M", options, explicit, sparse_q, Q_LEN)
    block_n = _tile("BLOCK_N", options, explicit, sparse_kv, KV_LEN)
    if sparse_q is None:
        sparse_q, sparse_kv = LARGE_BLOCK, block_n
    e_round, ev_round = pow2_at_least(E), pow2_at_least(Ev)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n,
        SPARSE_Q_BLOCK_SIZE=sparse_q, SPARSE_KV_BLOCK_SIZE=sparse_kv,
        QK_HEAD_DIM=E, QK_HEAD_DIM_ROUNDED=e_round, V_HEAD_DIM=Ev, V_HEAD_DIM_ROUNDED=ev_round,
        SAFE_HEAD_DIM=E == e_round and Ev == ev_round,
        # KV tiles run to the end of their sparse block, so KV_LEN must fill whole sparse blocks.
        IS_DIVISIBLE=Q_LEN % block_m == 0 and KV_LEN % sparse_kv == 0,
        GQA_SHARED_HEADS=Hq // Hkv,
        HAS_FULL_BLOCKS=has_full,
        PRESCALE_QK=options["PRESCALE_QK"],
        ROWS_GUARANTEED_SAFE=options["ROWS_GUARANTEED_SAFE"],
        # Without a block mask the full blocks are consecutive by construction.
        BLOCKS_ARE_CONTIGUOUS=options["BLOCKS_ARE_CONTIGUOUS"] or sparse_q == LARGE_BLOCK,
        OFFS_INT64=offs_int64,
        ACC_DTYPE=ACC_TL_DTYPE[acc],
        SCORE_DTYPE=ACC_TL_DTYPE.get(score_dtype, ACC_TL_DTYPE[acc]),
        DOT_PRECISION="tf32" if dtype == torch.float32 and allow_tf32 else "ieee",
        DOT_IN_FP32=device_type == "cpu" and dtype == torch.bfloat16,
    )
    return Plan((triton.cdiv(Q_LEN, block_m), B * Hq), options["num_warps"], options["num_stages"], constexprs)



# ---------------------------------------------------------------------------------------------
# Generated kernels

_MODULES: dict[tuple[str, str, str], Any] = {}


def _kernel_module(score_mod: Mod, mask_mod: Mod, target: str):
    """The generated forward module for this pair of mods (rendered once per process and target)."""
    key = (score_mod.key(), mask_mod.key(), target)
    module = _MODULES.get(key)
    if module is None:
        score_src = score_mod.emit(target, "score_mod")
        mask_src = mask_mod.emit(target, "mask_mod")
        hooks = {
            "prelude": emit.prelude(target),
            "tile_helpers": template_text("tiles"),
            "score_mod_def": score_src.source,
            "mask_mod_def": mask_src.source,
            "score_mod_params": score_src.param_list("score_"),
            "mask_mod_params": mask_src.param_list("mask_"),
        }
        provenance = {f"score_mod {score_mod.name}": score_mod.source, f"mask_mod {mask_mod.name}": mask_mod.source}
        module = load_kernel_module("forward", hooks, provenance, interpret=target == "interpret")
        _MODULES[key] = module
    return module


def _new_output(shape: tuple[int, ...], like: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """An uninitialised output; with ``like``, laid out in ``like``'s stride order."""
    if like is None:
        return torch.empty(shape, dtype=dtype, device=device)
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))  # outermost first
    return torch.empty_permuted(shape, order, dtype=dtype, device=device)


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod: Mod, mask_mod: Mod,
            blocks: SparseBlocks | None, scale: float, kernel_options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated inputs; returns (out, lse) with lse in natural log.

    ``blocks=None`` means no block mask. ``kernel_options`` are the user's (already checked).
    """
    B, Hq, Q_LEN, E = query.shape
    Bkv, Hkv, KV_LEN, Ev = value.shape
    device = query.device
    out = _new_output((B, Hq, Q_LEN, Ev), query, query.dtype, device)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32  # float64: gradcheck
    lse = _new_output((B, Hq, Q_LEN), None, lse_dtype, device)
    if out.numel() == 0:
        return out, lse
    offs_int64 = needs_int64_offsets(query, key, value, out)
    plan = _plan(device.type, query.dtype, B, Hq, Hkv, Q_LEN, KV_LEN, E, Ev,
                 blocks.q_block if blocks else None, blocks.kv_block if blocks else None,
                 blocks is None or blocks.full_kv_num_blocks is not None, score_mod.score_dtype, offs_int64,
                 tuple(sorted((k, v) for k, v in kernel_options.items() if k in KERNEL_OPTIONS)),
                 device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    if blocks is None:
        blocks = _dense_blocks(device, KV_LEN, plan.constexprs["BLOCK_N"])
    module = _kernel_module(score_mod, mask_mod, target_for(device))

    # K/V with batch 1 broadcast over query's batch: stride 0 reads the same slice for every b.
    kv_strides = []
    for t in (key, value):
        s = list(t.stride())
        if Bkv == 1:
            s[0] = 0
        kv_strides += s
    block_args = blocks.launch_args()
    module.flex_attention_forward[plan.grid](
        query, key, value, out, lse, *block_args[:4],
        *score_mod.launch_args(), *mask_mod.launch_args(),
        *query.stride(), *kv_strides, *out.stride(), lse.stride(0), lse.stride(1), *block_args[4:],
        Hq, Q_LEN, KV_LEN, scale,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **plan.constexprs,
    )
    return out, lse


# ---------------------------------------------------------------------------------------------
# Autograd


class FlexAttentionFunction(torch.autograd.Function):
    """Forward via the generated kernel. What the backward finds in ``ctx``:

    - ``ctx.saved_tensors``: (query, key, value, out, lse) with ``lse`` in *natural* log,
      [B, Hq, Q_LEN], float32 (float64 for float64 inputs), -inf for fully masked rows;
    - ``ctx.score_mod``, ``ctx.mask_mod``: the `Mod`\\ s (their captured tensors are also the
      trailing inputs of ``apply``, so a backward returns their gradients in that order:
      score_mod's buffers, then mask_mod's);
    - ``ctx.block_mask``: the user's block mask (or None; it holds the q_* twins for dK/dV) and
      ``ctx.blocks``: the `SparseBlocks` the forward read (None without a block mask);
    - ``ctx.scale`` (float), ``ctx.enable_gqa``, ``ctx.kernel_options`` (the user's dict).
    """

    @staticmethod
    def forward(ctx, query, key, value, score_mod, mask_mod, block_mask, blocks, scale, enable_gqa,
                kernel_options, *buffers):
        out, lse = forward(query, key, value, score_mod, mask_mod, blocks, scale, kernel_options)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.score_mod, ctx.mask_mod = score_mod, mask_mod
        ctx.block_mask, ctx.blocks = block_mask, blocks
        ctx.scale, ctx.enable_gqa, ctx.kernel_options = scale, enable_gqa, kernel_options
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        from flexattn.backward import flex_attention_backward

        query, key, value, out, lse = ctx.saved_tensors
        n_score, n_mask = len(ctx.score_mod.buffers), len(ctx.mask_mod.buffers)
        dq, dk, dv, buffer_grads = flex_attention_backward(
            query, key, value, out, lse, grad_out, grad_lse, ctx.score_mod, ctx.mask_mod, ctx.block_mask,
            ctx.blocks, ctx.scale, ctx.kernel_options, ctx.needs_input_grad[10:10 + n_score],
        )
        # No gradients for the mods, block mask, scale and options; mask_mod's captures are not differentiable.
        return (dq, dk, dv) + (None,) * 7 + tuple(buffer_grads) + (None,) * n_mask


# ---------------------------------------------------------------------------------------------
# Public entry point


def _use_decoding(query: torch.Tensor, options: dict, tensors) -> bool:
    """Short queries go to the split-KV decoding kernel (inference only: it has no backward)."""
    return (query.shape[2] < decode.DECODE_Q_THRESHOLD
            and not options.get("FORCE_USE_FLEX_ATTENTION", False)
            and query.dtype in decode.SUPPORTED_DTYPES
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   score_mod: Callable | Mod | None = None, block_mask=None, scale: float | None = None,
                   enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None):
    """Attention with a score modification and a block-sparse mask, fused into one kernel.

    ``query`` is [B, Hq, Q_LEN, E], ``key`` [B or 1, Hkv, KV_LEN, E], ``value`` [B or 1, Hkv,
    KV_LEN, Ev]; float16, bfloat16, float32 or float64, any strides. ``score_mod(score, b, h,
    q_idx, kv_idx)`` (Python or a DSL `Mod`) rewrites each score, ``block_mask`` (from
    ``create_block_mask``; flexattn's or torch's) says which KV blocks each query block sees and
    carries the mask_mod. ``scale`` defaults to 1/sqrt(E). With GQA (``enable_gqa=True``) query
    head h uses KV head h // (Hq // Hkv).

    Returns ``out`` [B, Hq, Q_LEN, Ev] in query's dtype and stride order, and with
    ``return_lse=True`` also the row log-sum-exp (natural log, [B, Hq, Q_LEN], float32; float64
    for float64 inputs, so that gradients can be checked numerically). A query
    row that sees no key gets output 0 and LSE -inf. CPU tensors run the same kernel through
    Triton's interpreter (slow; for tests and small demos).

    >>> q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    >>> soft = lambda score, b, h, q_idx, kv_idx: 20 * torch.tanh(score / 20)
    >>> flex_attention(q, k, v, score_mod=soft).shape
    torch.Size([1, 2, 40, 16])
    """
    _check_inputs(query, key, value, enable_gqa)
    options = _check_kernel_options(kernel_options)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {scale!r}")
    score_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    score = identity_score_mod(score_dtype) if score_mod is None else \
        score_mod_as_mod(score_mod, score_dtype, query.device)
    B, Hq, Q_LEN, _ = query.shape
    KV_LEN = key.shape[2]
    if block_mask is None:
        blocks, mask = None, noop_mask_mod()
    else:
        blocks = _sparse_blocks(block_mask, B, Hq, Q_LEN, KV_LEN, query.device)
        mask = block_mask_mod(block_mask)
    score.check_device(query.device)
    mask.check_device(query.device)
    if _use_decoding(query, options, (query, key, value, *score.buffers, *mask.buffers)):
        return decode.decode_attention(query, key, value, score_mod=score, mask_mod=mask, block_mask=block_mask,
                                       scale=float(scale), enable_gqa=enable_gqa, return_lse=return_lse,
                                       kernel_options=options)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *score.buffers)):
        # A score mod the backward cannot differentiate fails here, before any work, not later.
        from flexattn.autodiff import check_differentiable

        check_differentiable(score.ir, f"score_mod '{score.name}'")
    out, lse = FlexAttentionFunction.apply(query, key, value, score, mask, block_mask, blocks, float(scale),
                                           enable_gqa, options, *score.buffers, *mask.buffers)
    return (out, lse) if return_lse else out
