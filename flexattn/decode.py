"""Split-KV decoding: attention for a few query rows against a long KV cache.

`decode_attention` has flex_attention's semantics (score_mod, mask_mod + BlockMask, GQA, LSE,
K/V batch broadcast, E != Ev) and is what `flex_attention` dispatches to when the query is short.
The kernel packs every query head that shares a KV head into one row tile, splits the KV range
over SPLIT_KV programs so the GPU is full, and merges their partial results with a log-sum-exp
reduction (see flexattn/codegen/templates/decode.py).

Everything that depends on shapes, strides, dtypes, mods and options is decided once and cached
as a `_Plan`; a call then only allocates outputs and launches. Nothing here reads tensor values on
the host, so a decode step can be captured in a CUDA graph. Serving patterns:

    pos = torch.tensor(1000, device="cuda", dtype=torch.int32)     # 0-d: updated in place
    lengths = torch.tensor([1001, 517], device="cuda", dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, mask_mod=causal_at(pos), kv_lengths=lengths)

Example:
    >>> q = torch.randn(2, 8, 1, 64); k = torch.randn(2, 2, 300, 64); v = torch.randn(2, 2, 300, 64)
    >>> out, lse = decode_attention(q, k, v, enable_gqa=True, return_lse=True)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton

from flexattn import ir
from flexattn.block_mask import as_mod
from flexattn.codegen import emit
from flexattn.codegen.launch import pow2_at_least, target_for
from flexattn.codegen.render import load_kernel_module
from flexattn.mods import MASK, SCORE, Mod

# flex_attention uses this kernel when Q_LEN < DECODE_Q_THRESHOLD (unless FORCE_USE_FLEX_ATTENTION).
DECODE_Q_THRESHOLD = 128

# Decode knobs a caller may set through kernel_options; all defaults are chosen in `_defaults`.
DECODE_OPTIONS = {
    "SPLIT_KV",             # programs per row tile along KV (default: from the SM count)
    "BLOCK_N",              # KV positions per inner step
    "BLOCK_M",              # cap on packed rows per tile (tiles are >= 16 rows)
    "num_warps", "num_stages",
    "PROGRAMS_PER_SM",      # SPLIT_KV target: B * Hkv * row tiles * SPLIT_KV >= this * SMs
    "MIN_TILES_PER_SPLIT",  # never split so finely that a program walks fewer tiles
    "INPUT_PRECISION",      # tl.dot precision for float32 inputs: "ieee" (default) or "tf32"
}
# The other flex_attention options (flexattn.attention.KERNEL_OPTIONS: forward-kernel and
# backward knobs) are accepted and ignored here; anything else is an error (see `_ignored_options`).
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# Serving helpers: mods that capture 0-d / per-batch tensors (read in-kernel, graph friendly).


def causal_at(pos: torch.Tensor) -> Mod:
    """Causal mask for query rows that sit at positions ``pos + q_idx`` of the cache.

    ``pos`` is a 0-d integer tensor; update it in place (``pos.fill_(n)`` or ``pos += 1``) between
    decode steps — the kernel reads it, so a captured CUDA graph stays valid.

        >>> pos = torch.tensor(99, dtype=torch.int32)
        >>> mask = causal_at(pos)          # q_idx + pos >= kv_idx
    """
    if not isinstance(pos, torch.Tensor) or pos.dim() != 0 or pos.dtype.is_floating_point or pos.dtype == torch.bool:
        raise TypeError(f"pos must be a 0-d integer tensor, got {_describe(pos)}")
    buf = ir.Buffer(0, "pos", pos.dtype, 0)
    q, kv = ir.input_("q_idx"), ir.input_("kv_idx")
    root = ir.binary("ge", ir.binary("add", q, ir.load(buf, [])), kv)
    return Mod(MASK, root, [pos], name="causal_at_pos")


def valid_length(lengths: torch.Tensor) -> Mod:
    """Mask that keeps ``kv_idx < lengths[b]`` (a KV cache allocated longer than it is filled).

    ``decode_attention(..., kv_lengths=lengths)`` does the same and also skips the unused tail;
    this mask form composes with other masks (``and_masks``) and works in every kernel.

        >>> lengths = torch.tensor([5, 300], dtype=torch.int32)
        >>> mask = valid_length(lengths)
    """
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.dtype.is_floating_point:
        raise TypeError(f"lengths must be a 1-d integer tensor [B], got {_describe(lengths)}")
    buf = ir.Buffer(0, "lengths", lengths.dtype, 1)
    root = ir.binary("lt", ir.input_("kv_idx"), ir.load(buf, [ir.input_("b")]))
    return Mod(MASK, root, [lengths], name="valid_length")


def causal_at_with_length(pos: torch.Tensor, lengths: torch.Tensor) -> Mod:
    """``causal_at(pos) & valid_length(lengths)`` as one mask (per-batch cache fill + offset)."""
    a = causal_at(pos)
    bufb = ir.Buffer(1, "lengths", lengths.dtype, 1)
    rhs = ir.binary("lt", ir.input_("kv_idx"), ir.load(bufb, [ir.input_("b")]))
    return Mod(MASK, ir.binary("and_", a.ir, rhs), [pos, lengths], name="causal_at_with_length")


# ---------------------------------------------------------------------------------------------
# Kernel modules and launch plans


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}"


_MODULES: dict[tuple, Any] = {}


def _module(score_mod: Mod | None, mask_mod: Mod | None, target: str):
    """The rendered decode module for this pair of mods (keyed by the mods' structure)."""
    key = (score_mod.key() if score_mod else None, mask_mod.key() if mask_mod else None, target)
    if key not in _MODULES:
        _MODULES[key] = _render(score_mod, mask_mod, target)
    return _MODULES[key]


def _render(score_mod: Mod | None, mask_mod: Mod | None, target: str):
    hooks = {"prelude": emit.prelude(target)}
    provenance = {}
    for kind, mod, default_call in ((SCORE, score_mod, "score"), (MASK, mask_mod, "tl.full([], 1, tl.int1)")):
        prefix = "SM_" if kind == SCORE else "MM_"
        if mod is None:
            hooks[f"{kind}_mod_def"] = ""
            hooks[f"{kind}_params"] = ""
            hooks[f"{kind}_call"] = default_call
            continue
        src = mod.emit(target, name=f"{kind}_mod")
        first = "score, " if kind == SCORE else ""
        hooks[f"{kind}_mod_def"] = src.source
        hooks[f"{kind}_params"] = src.param_list(prefix)
        hooks[f"{kind}_call"] = f"{src.name}({first}b, h, q_idx, kv_idx, {src.param_list(prefix)})"
        provenance[f"{kind}_mod {mod.name}"] = mod.source
    return load_kernel_module("decode", hooks, provenance, interpret=target == "interpret")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter runs programs one by one; a couple of splits keeps tests honest


@dataclass
class _Plan:
    module: Any
    split_kv: int
    grid: tuple
    combine_grid: tuple
    qkv_strides: tuple       # Q, K, V strides (then Out's, taken from the allocated output)
    static_args: tuple       # BlockMask strides and sizes after Out's strides
    constexprs: dict
    combine_constexprs: dict
    launch: dict             # num_warps / num_stages
    out_shape: tuple
    has_block_mask: bool
    has_full: bool


_PLANS: dict[tuple, _Plan] = {}
# LSE/partials allocator; tests swap in a NaN-filling one so that unwritten elements show (the
# output comes from attention._new_output, which they patch the same way).
_empty = torch.empty


def _tensor_key(t: torch.Tensor | None):
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _mask_fields(block_mask):
    if block_mask is None:
        return None
    try:
        return (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                block_mask.full_kv_indices, block_mask.BLOCK_SIZE)
    except AttributeError:
        raise TypeError(f"block_mask must be a BlockMask, got {type(block_mask).__name__}") from None


def _ignored_options() -> set[str]:
    """flex_attention's options that mean nothing to the decoding kernel (accepted, ignored)."""
    from flexattn.attention import KERNEL_OPTIONS  # attention imports this module

    return set(KERNEL_OPTIONS) - DECODE_OPTIONS


def _new_output(shape, query: torch.Tensor) -> torch.Tensor:
    """The output, in the query's stride order (flex_attention's contract; shared with the forward)."""
    from flexattn import attention

    return attention._new_output(shape, query, query.dtype, query.device)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     score_mod: Mod | None = None, mask_mod: Mod | None = None, block_mask=None,
                     scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                     kernel_options: dict | None = None, *, kv_lengths: torch.Tensor | None = None):
    """flex_attention for short queries: ``softmax(score_mod(q k^T * scale) masked) v``.

    Args:
        query: [B, Hq, Q_LEN, E]; key: [B or 1, Hkv, KV_LEN, E]; value: [B or 1, Hkv, KV_LEN, Ev].
        score_mod, mask_mod: `Mod`s or Python mods (traced here).
            mask_mod runs on the BlockMask's partial tiles; without a BlockMask, on every tile.
            If it is None, the BlockMask's own mask_mod (Python or `Mod`) is used.
        block_mask: a BlockMask (torch's or flexattn's fields) or None (every tile visited).
        scale: softmax scale, default 1/sqrt(E). enable_gqa: allow Hq a multiple of Hkv.
        return_lse: also return the natural-log LSE, float32 [B, Hq, Q_LEN] (-inf for rows that
            see nothing; their output is 0).
        kernel_options: decode knobs (see DECODE_OPTIONS); flex_attention's other options
            (``flexattn.attention.KERNEL_OPTIONS``) are ignored, anything else is an error.
        kv_lengths: optional int tensor [B]: only kv positions < kv_lengths[b] exist for batch b
            (read in-kernel; positions past it are neither read nor attended).

    Example:
        >>> q, k, v = torch.randn(1, 4, 3, 32), torch.randn(1, 4, 100, 32), torch.randn(1, 4, 100, 32)
        >>> decode_attention(q, k, v).shape
        torch.Size([1, 4, 3, 32])
    """
    if score_mod is not None:
        score_mod = as_mod(score_mod, SCORE, "score_mod")
    if mask_mod is None and block_mask is not None:
        # The BlockMask's mask_mod as a Mod (flexattn's caches it as `.mod`; torch's holds a
        # Python function, traced here), as flex_attention resolves it.
        from flexattn.attention import block_mask_mod

        mask_mod = block_mask_mod(block_mask)
    elif mask_mod is not None:
        mask_mod = as_mod(mask_mod, MASK, "mask_mod")
    # flex_attention passes an identity score mod and a constant-True mask for "none": skip them.
    if score_mod is not None and score_mod.ir.op == "input":
        score_mod = None
    if mask_mod is not None and mask_mod.ir.op == "const" and mask_mod.ir.arg:
        mask_mod = None
    fields = _mask_fields(block_mask)
    opts = tuple(sorted((kernel_options or {}).items()))  # unknown keys: checked by _make_plan
    key_ = (
        _tensor_key(query), _tensor_key(key), _tensor_key(value),
        score_mod.key() if score_mod is not None else None,
        mask_mod.key() if mask_mod is not None else None,
        None if fields is None else tuple(_tensor_key(t) if isinstance(t, torch.Tensor) else t for t in fields),
        _tensor_key(kv_lengths), scale, bool(enable_gqa), opts,
    )
    plan = _PLANS.get(key_)
    if plan is None:
        plan = _make_plan(query, key, value, score_mod, mask_mod, fields, scale, enable_gqa,
                          dict(kernel_options or {}), kv_lengths)
        _PLANS[key_] = plan
    for mod in (score_mod, mask_mod):
        if mod is not None:
            mod.check_device(query.device)

    out = _new_output(plan.out_shape, query)
    lse = _empty(plan.out_shape[:3], dtype=torch.float32, device=query.device)
    if out.numel() == 0 or lse.numel() == 0:
        return (out, lse.fill_(float("-inf"))) if return_lse else out
    if plan.split_kv > 1:
        rows = lse.numel()
        acc_part = _empty((rows, plan.split_kv, plan.out_shape[3]), dtype=torch.float32, device=query.device)
        m_part = _empty((rows, plan.split_kv), dtype=torch.float32, device=query.device)
        l_part = _empty((rows, plan.split_kv), dtype=torch.float32, device=query.device)
    else:
        acc_part = m_part = l_part = lse  # unused: the split kernel writes Out and LSE itself
    if fields is not None:
        num, idx, full_num, full_idx = fields[0], fields[1], fields[2], fields[3]
        if not plan.has_full:
            full_num, full_idx = lse, lse
    else:
        num = idx = full_num = full_idx = lse
    mod_args = (score_mod.launch_args() if score_mod is not None else []) + (
        mask_mod.launch_args() if mask_mod is not None else [])
    plan.module.decode_split_kernel[plan.grid](
        query, key, value, out, lse, acc_part, m_part, l_part,
        num, idx, full_num, full_idx, kv_lengths if kv_lengths is not None else lse,
        *mod_args, *plan.qkv_strides, *out.stride(), *plan.static_args,
        **plan.constexprs, **plan.launch,
    )
    if plan.split_kv > 1:
        plan.module.decode_combine_kernel[plan.combine_grid](
            out, lse, acc_part, m_part, l_part, *out.stride(), plan.out_shape[1], plan.out_shape[2],
            plan.out_shape[3], **plan.combine_constexprs,
        )
    return (out, lse) if return_lse else out


def _check(cond: bool, msg: str, exc=ValueError):
    if not cond:
        raise exc(msg)


def _make_plan(query, key, value, score_mod, mask_mod, fields, scale, enable_gqa, options, kv_lengths) -> _Plan:
    # -- validate (once per plan: everything checked here is part of the plan key)
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {_describe(t)}", TypeError)
        _check(t.dim() == 4, f"{name} must be 4-d [B, H, L, E], got shape {tuple(t.shape)}")
        _check(t.dtype in SUPPORTED_DTYPES,
               f"{name} must be float16, bfloat16 or float32, got {t.dtype}", TypeError)
        _check(t.device == query.device, f"{name} is on {t.device} but query is on {query.device}")
    _check(key.dtype == query.dtype and value.dtype == query.dtype,
           f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}", TypeError)
    B, HQ, Q_LEN, E = query.shape
    BK, HKV, KV_LEN, EK = key.shape
    _check(EK == E, f"key's head dim must equal query's ({E}), got key shape {tuple(key.shape)}")
    _check(value.shape[:3] == key.shape[:3],
           f"value must be [{BK}, {HKV}, {KV_LEN}, Ev] like key, got {tuple(value.shape)}")
    EV = value.shape[3]
    _check(BK in (1, B), f"key/value batch must be 1 or {B} (query's), got {BK}")
    if enable_gqa:
        _check(HKV > 0 and HQ % HKV == 0,
               f"with enable_gqa, query heads ({HQ}) must be a multiple of key/value heads ({HKV})")
    else:
        _check(HQ == HKV, f"query has {HQ} heads but key/value have {HKV}; pass enable_gqa=True for GQA")
    _check(max(E, EV) <= 512, f"head dims up to 512 are supported, got E={E}, Ev={EV}")
    if kv_lengths is not None:
        _check(isinstance(kv_lengths, torch.Tensor) and kv_lengths.shape == (B,)
               and not kv_lengths.dtype.is_floating_point and kv_lengths.dtype != torch.bool,
               f"kv_lengths must be an integer tensor of shape ({B},), got {_describe(kv_lengths)}", TypeError)
        _check(kv_lengths.device == query.device,
               f"kv_lengths is on {kv_lengths.device} but query is on {query.device}")
    unknown = set(options) - DECODE_OPTIONS - _ignored_options()
    _check(not unknown, f"kernel_options has unknown keys {sorted(unknown)}; decode knobs are "
           f"{sorted(DECODE_OPTIONS)} (flex_attention's other options are accepted and ignored)")
    device = query.device
    G = HQ // max(HKV, 1)
    D, DV = pow2_at_least(E), pow2_at_least(EV)
    on_gpu = device.type == "cuda"

    # -- tiles
    BLOCK_N = int(options.get("BLOCK_N", (64 if max(D, DV) <= 128 else 32) if on_gpu else 16))
    has_block_mask = fields is not None
    if has_block_mask:
        num, idx, full_num, full_idx, bs = fields
        q_bs, kv_bs = (bs, bs) if isinstance(bs, int) else tuple(bs)
        _check(num.dim() == 3 and idx.dim() == 4,
               f"block_mask.kv_num_blocks must be [B, H, nQ] and kv_indices [B, H, nQ, nKV], got "
               f"{tuple(num.shape)} and {tuple(idx.shape)}")
        MB, MH, NQ = num.shape
        NKV = idx.shape[3]
        _check(MB in (1, B), f"block_mask batch must be 1 or {B}, got {MB}")
        _check(MH in (1, HQ), f"block_mask heads must be 1 or {HQ} (query heads), got {MH}")
        _check(NQ * q_bs >= Q_LEN, f"block_mask covers {NQ * q_bs} query rows but Q_LEN is {Q_LEN}")
        _check(NKV * kv_bs >= KV_LEN, f"block_mask covers {NKV * kv_bs} kv positions but KV_LEN is {KV_LEN}")
        _check(num.device == device and idx.device == device,
               f"block_mask is on {num.device} but query is on {device}")
        BLOCK_N = min(BLOCK_N, kv_bs & -kv_bs)  # a power of two that divides the block size
        _check(kv_bs % BLOCK_N == 0 and BLOCK_N >= 16,
               f"block_mask KV block size {kv_bs} must be a multiple of BLOCK_N={BLOCK_N} (>= 16)")
        _check(idx.stride(3) == 1, "block_mask.kv_indices must be contiguous in its last dimension")
        has_full = full_num is not None
        if has_full:
            _check(full_idx.stride(3) == 1, "block_mask.full_kv_indices must be contiguous in its last dimension")
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
    BLOCK_M = min(pow2_at_least(rows), max(16, int(options.get("BLOCK_M", 64))))
    M_TILES = triton.cdiv(rows, BLOCK_M)
    programs = B * HKV * (G // G_PACK) * NUM_Q_BLOCKS * M_TILES

    # -- SPLIT_KV: enough programs to fill the GPU, each still walking a few tiles
    if "SPLIT_KV" in options:
        split = int(options["SPLIT_KV"])
        _check(split >= 1, f"kernel_options['SPLIT_KV'] must be >= 1, got {split}")
    else:
        # Several programs per SM: the last, partly filled wave then costs little, and partials
        # stay small (rows x SPLIT_KV x Ev floats against megabytes of K/V).
        per_sm = float(options.get("PROGRAMS_PER_SM", 8.0))
        min_tiles = int(options.get("MIN_TILES_PER_SPLIT", 8 if on_gpu else 1))
        want = math.ceil(per_sm * _num_sms(device) / max(programs, 1))
        sub = kv_bs // BLOCK_N if has_block_mask else 1
        cap = max(1, (walk_tiles * sub) // max(min_tiles, 1) // sub)
        split = max(1, min(want, cap, 256))

    safe_m = rows % BLOCK_M == 0 and Q_LEN == NUM_Q_BLOCKS * Q_ROWS
    safe_head = D == E and DV == EV
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    precision = options.get("INPUT_PRECISION", "ieee") if query.dtype == torch.float32 else "tf32"
    _check(precision in ("ieee", "tf32"), f"kernel_options['INPUT_PRECISION'] must be 'ieee' or 'tf32', got {precision!r}")

    def strides(t, n, zero_batch=False):
        s = list(t.stride()[:n]) if t is not None else [0] * n
        if zero_batch:
            s[0] = 0
        return s

    kz = BK == 1 and B > 1
    qkv_strides = list(query.stride()) + strides(key, 4, kz) + strides(value, 4, kz)
    # Out's strides come next, at launch: Out follows the query's layout (see `_new_output`).
    static = []
    if has_block_mask:
        def mstr(t, n):
            s = list(t.stride()[:n])
            s[0] = 0 if t.shape[0] == 1 else s[0]
            s[1] = 0 if t.shape[1] == 1 else s[1]
            return s
        static += mstr(num, 3) + mstr(idx, 3)
        static += (mstr(full_num, 3) + mstr(full_idx, 3)) if has_full else [0] * 6
    else:
        static += [0] * 12
    out_shape = (B, HQ, Q_LEN, EV)
    static += [Q_LEN, KV_LEN, E, EV]

    constexprs = dict(
        HKV=HKV, G=G, GQA_SHARED_HEADS=G_PACK, Q_ROWS=max(Q_ROWS, 1), NUM_Q_BLOCKS=NUM_Q_BLOCKS,
        M_TILES=M_TILES, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=D, DV=DV, SPLIT_KV=split,
        TILE_KV=BLOCK_N, SPARSE_Q_BLOCK_SIZE=q_bs, SPARSE_KV_BLOCK_SIZE=kv_bs,
        HAS_BLOCK_MASK=has_block_mask, HAS_FULL_BLOCKS=has_full,
        APPLY_MASK_DENSE=mask_mod is not None and not has_block_mask,
        HAS_KV_LENGTHS=kv_lengths is not None, SAFE_M_BOUNDARY=safe_m, SAFE_N_BOUNDARY=safe_n,
        SAFE_HEAD_DIM=safe_head, SM_SCALE=float(scale), INPUT_PRECISION=precision,
        DOT_F32=not on_gpu and query.dtype == torch.bfloat16,
    )
    launch = {}
    if on_gpu:
        launch = dict(num_warps=int(options.get("num_warps", 4)), num_stages=int(options.get("num_stages", 3)))
    return _Plan(
        module=_module(score_mod, mask_mod, target_for(device)),
        split_kv=split,
        grid=(split, B * HKV, (G // G_PACK) * NUM_Q_BLOCKS * M_TILES),
        combine_grid=(B * HQ * Q_LEN,),
        qkv_strides=tuple(qkv_strides),
        static_args=tuple(static),
        constexprs=constexprs,
        combine_constexprs=dict(SPLIT_KV=split, SPLIT_PAD=max(2, triton.next_power_of_2(split)), DV=DV),
        launch=launch,
        out_shape=out_shape,
        has_block_mask=has_block_mask,
        has_full=has_full,
    )
