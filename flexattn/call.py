"""The call path of `flex_attention` and `decode_attention` (docs/design.md).

    mod --(modcache: fingerprint -> template)--> key --> plan (kernels.plans) --> launch

Per call: the score mod is resolved to a cached `Mod` template plus this call's captured tensors
(Python mods are traced once per fingerprint), the block mask to its launch tables (prepared once
per mask object), and the rest to a plan key (shapes, strides, dtypes, the mods' structural keys,
block-mask layout, options); the plan (validation, tiles, constexprs, generated module; made once
per key) is launched. Calls that need no gradient launch directly; the others go through
`FlexAttentionFunction`. Under ``torch.compile`` the same call becomes a custom op
(`flexattn.ops`), with the mods captured by `flexattn.capture`.
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Callable

import numpy
import torch

from flexattn import capture, ir, modcache, ops
from flexattn.block_mask import BlockMask, as_mod, is_noop_mask, ranks
from flexattn.kernels import backward as bwd, decode as dec, forward as fwd, layout, options as opts, plans
from flexattn.kernels.tables import tables_of, validate_mask
from flexattn.lru import LRU
from flexattn.mods import ARITY, MASK, SCORE, Mod
from flexattn.tracer import trace


def _check_score_mod_arity(fn: Callable) -> None:
    """A Python score_mod must take the 5 arguments torch passes (score, b, h, q_idx, kv_idx)."""
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


# ---------------------------------------------------------------------------------------------
# Mods: (template, this call's captured tensors)


# The "no mod" mods, made once (plain module constants: Dynamo reads them without a lock).
_IDENTITY = {dt: Mod(SCORE, ir.input_("score", dt), name="identity") for dt in (torch.float32, torch.float64)}
_NOOP_MASK = Mod(MASK, ir.const(True), name="noop_mask")


def identity_score_mod(score_dtype: torch.dtype) -> Mod:
    return _IDENTITY[score_dtype]


def noop_mask_mod() -> Mod:
    return _NOOP_MASK


def resolve_score_mod(fn, score_dtype: torch.dtype, device: torch.device, walked=None) -> tuple[Mod, tuple]:
    if fn is None:
        return identity_score_mod(score_dtype), ()
    if isinstance(fn, Mod):
        if fn.kind != SCORE:
            raise TypeError(f"score_mod must be a score mod, got the {fn.kind} mod {fn.name!r}")
        if fn.score_dtype not in (None, score_dtype) or fn.ir.dtype != score_dtype:
            fn = trace(fn, SCORE, score_dtype=score_dtype)  # re-typed copy
        return fn, fn.buffers
    if not callable(fn):
        raise TypeError(f"score_mod must be a function or a flexattn Mod, got {type(fn).__name__}")
    return modcache.resolve(fn, SCORE, score_dtype, device, _trace_score, walked)


def _trace_score(fn, kind, **kw) -> Mod:
    _check_score_mod_arity(fn)
    return trace(fn, kind, **kw)


def _check_foreign_mask(block_mask) -> None:
    """The kernels follow a BlockMask's tables without bounds checks. flexattn's BlockMask checked
    them where it was made; another one (torch's) is checked here, once per mask object."""
    if not isinstance(block_mask, BlockMask):
        validate_mask(block_mask)


def resolve_mask_mod(block_mask, device: torch.device) -> tuple[Mod, tuple]:
    """The block mask's mask_mod, with the int64 tensors it only compares as int32 ranks
    (`flexattn.block_mask.ranks`): flexattn's BlockMask keeps it traced (``.mod``), and the ranks
    `create_block_mask` made while they are current; torch's holds the Python function, resolved
    through the trace cache."""
    mod = getattr(block_mask, "mod", None)
    if isinstance(mod, Mod):
        return ranks.for_call(block_mask, mod, mod.buffers, device)
    fn = getattr(block_mask, "mask_mod", None)
    if fn is None:
        return noop_mask_mod(), ()
    if isinstance(fn, Mod):
        return ranks.for_call(block_mask, fn, fn.buffers, device)
    mod, bufs = modcache.resolve(fn, MASK, torch.float32, device,
                                 lambda f, kind, **kw: as_mod(f, MASK, "block_mask.mask_mod"))
    return ranks.for_call(block_mask, mod, bufs, device)


# ---------------------------------------------------------------------------------------------
# Autograd


class FlexAttentionFunction(torch.autograd.Function):
    """Forward via the generated kernel; ``call`` holds what the backward needs besides the saved
    tensors (mods, block tables, scale, options). ``sinks`` is the [Hq] sink logits or None.
    Trailing inputs are the captured tensors: the score mod's, then the mask mod's (gradients flow
    to the score mod's floating ones)."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, call, *buffers):
        out, lse, mx = fwd.run(call.plan, query, key, value, call.score, buffers[:call.n_score], call.mask,
                               buffers[call.n_score:], call.tables, call.scale, sinks=sinks)
        ctx.save_for_backward(query, key, value, out, lse, sinks, *buffers)
        ctx.call = call
        # An unused LSE comes to the backward as None, not as zeros to launch a fill for and read
        ctx.set_materialize_grads(False)
        if mx is not None:
            ctx.mark_non_differentiable(mx)
            return out, lse, mx
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_max=None):
        query, key, value, out, lse, sinks, *buffers = ctx.saved_tensors
        call = ctx.call
        if grad_out is None:  # (only the LSE was used)
            grad_out = torch.zeros_like(out)
        score_bufs, mask_bufs = tuple(buffers[:call.n_score]), tuple(buffers[call.n_score:])
        need = tuple(ctx.needs_input_grad[5:5 + call.n_score])
        # (grad_out's alignment too: the Hopper backward reads it through a TMA descriptor; the LSE's
        # gradient's strides, which a compiled kernel may have specialised on: `lse.sum()` gives an
        # expanded one)
        plan_key = (call.key, need, grad_out.shape, grad_out.stride(), grad_out.data_ptr() % 16 == 0,
                    None if grad_lse is None else grad_lse.stride())

        def launch_once(plan):
            return bwd.run(plan, query, key, value, out, lse, grad_out, grad_lse, call.score, score_bufs,
                           call.mask, mask_bufs, call.tables, call.scale, sinks)

        plan = plans.backward_plan(plan_key, query, key, value, out, grad_out, call.score, call.mask, call.tables,
                                   call.options, need, score_bufs, grad_lse is not None, launch_once)
        dq, dk, dv, grads, dsinks = launch_once(plan)
        # No gradients for the plan; mask_mod's captures are not differentiable.
        return (dq, dk, dv, dsinks if ctx.needs_input_grad[3] else None, None,
                *bwd.buffer_grads(grads, score_bufs, need)) + (None,) * len(mask_bufs)


class _Call:
    """One forward launch's non-tensor inputs (kept by autograd for the backward)."""

    __slots__ = ("plan", "key", "score", "mask", "n_score", "tables", "scale", "options")

    def __init__(self, plan, key, score, mask, n_score, tables, scale, options):
        self.plan, self.key, self.score, self.mask = plan, key, score, mask
        self.n_score, self.tables, self.scale, self.options = n_score, tables, scale, options


# ---------------------------------------------------------------------------------------------
# The call path


def _meta(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _needs_grad(query, key, value, score_bufs, sinks) -> bool:
    """Whether the call must record the backward: grad mode on and an input, the sinks or a
    tensor the score mod captured, requires grad."""
    if not torch.is_grad_enabled():
        return False
    if query.requires_grad or key.requires_grad or value.requires_grad or (sinks is not None and sinks.requires_grad):
        return True
    for t in score_bufs:
        if t.requires_grad:
            return True
    return False


def _kernel_choice(query, key, value, score_bufs, sinks, options: dict, want_max: bool,
                   decoding: bool | None) -> tuple[bool, bool]:
    """(need_grad, decoding): short queries without gradients take the split-KV decoding kernel
    (``decoding`` None: choose; True: `decode_attention` asked for it)."""
    need_grad = _needs_grad(query, key, value, score_bufs, sinks)
    backend = options.get("BACKEND", "AUTO")
    asked = decoding  # (True: the caller is decode_attention, which takes no BACKEND)
    if decoding is None:
        decoding = backend == "TRITON_DECODE" or (
            backend == "AUTO" and not options.get("FORCE_USE_FLEX_ATTENTION", False) and not need_grad
            and not want_max and query.shape[2] < dec.Q_THRESHOLD and query.dtype in dec.SUPPORTED_DTYPES)
    if decoding and (need_grad or want_max):
        if asked:
            raise ValueError("decode_attention computes no gradients: an input, the sinks or a tensor the "
                             "score_mod captures requires grad; call it under torch.no_grad() (or detach "
                             "them), or use flex_attention, which has a backward")
        raise ValueError("the decoding kernel (kernel_options BACKEND='TRITON_DECODE') computes no gradients "
                         "and no max_scores; use BACKEND='AUTO'")
    return need_grad, decoding


def _check_descale(query, descale) -> tuple[torch.Tensor, ...]:
    """float8 inputs' descale factors (q, k, v): one-element float32 tensors on query's device;
    a missing one is 1."""
    if query.dtype != torch.float8_e4m3fn:
        raise TypeError(f"descale_q, descale_k and descale_v apply to float8_e4m3fn inputs; query is {query.dtype}")
    out = []
    for name, t in zip(("descale_q", "descale_k", "descale_v"), descale or (None,) * 3):
        if t is None:
            t = _ones(query.device)
        elif not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32 \
                or t.device != query.device:
            got = f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
                else type(t).__name__
            raise TypeError(f"{name} must be a float32 tensor with one element on {query.device}, got {got}")
        out.append(t)
    return tuple(out)


_ONES: dict[torch.device, torch.Tensor] = {}


def _ones(device: torch.device) -> torch.Tensor:
    t = _ONES.get(device)
    if t is None:
        t = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def _check_scale(scale) -> float:
    # (int and float first: the common case answers before the abstract class is asked; NumPy's
    # numbers are Real)
    if isinstance(scale, (int, float, numbers.Real)) and not isinstance(scale, (bool, numpy.bool_)):
        return float(scale)
    hint = " (a tensor: pass scale.item())" if isinstance(scale, torch.Tensor) else ""
    raise TypeError(f"scale must be a float or None, got {scale!r}{hint}")


# ---------------------------------------------------------------------------------------------
# Known calls: a repeated call is one lookup


class _Known:
    """What a call key decides, learnt from the first call that brings it (`_plan_call`): the
    score mod's template, where its captured tensors sit among the fingerprint walk's
    (``pick``), and for each gradient need (False, True) ``(decoding, plan, plan key, default
    scale)``, or None until a call with that need comes."""

    __slots__ = ("score", "pick", "by_grad")

    def __init__(self, score: Mod, pick: Callable):
        self.score, self.pick = score, pick
        self.by_grad: list[tuple | None] = [None, None]


# Call key -> _Known. The call key holds every input of the plan key, with the score mod's
# fingerprint (which covers its structural key and its captured tensors' metas) in place of its
# template's key, so that a hit needs no mod resolution.
# Bound: a _Known holds a template and up to two plans' references (no tensors).
_KNOWN = LRU(4096)
_NO_SCORE_MOD = ((), ())  # (fingerprint, tensors) of score_mod=None


def forget() -> None:
    """Forget every known call (tests; with `flexattn.modcache.clear` a call resolves its mods anew)."""
    _KNOWN.clear()


def attend(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options, want_max,
           decoding: bool | None, kv_lengths=None, mask_override=None, descale=None, want_lse: bool = True,
           sinks=None):
    """The call path shared by `flex_attention` and `flexattn.decode.decode_attention`:
    ``(out, lse, max_scores or None)``. ``decoding``: None picks by the query length.
    ``descale``: (q, k, v) descale factors of float8 inputs, or None. ``want_lse=False``: the
    caller drops the LSE, so the decoding kernel may leave it in scratch (lse is then None).
    ``sinks``: [Hq] sink logits or None (their metas are part of the call key, their values not).

    A call is keyed by its *call key* (the score mod's fingerprint, the tensors' metas, the
    mask's key and tables' layout, the options); a known key gives the plan at once (`_Known`),
    an unknown one is resolved, validated and planned by `_plan_call`."""
    options = opts.with_deterministic(opts.check(kernel_options))
    if torch.compiler.is_compiling():
        if descale is not None or getattr(query, "dtype", None) == torch.float8_e4m3fn:
            raise NotImplementedError("float8 flex_attention runs eagerly only; call it outside torch.compile "
                                      "(torch.compiler.disable) or pass bfloat16/float16 inputs")
        return _attend_compiled(query, key, value, score_mod, block_mask, scale, enable_gqa, options, want_max,
                                decoding, kv_lengths, mask_override, sinks)
    try:
        device, dtype = query.device, query.dtype
        if dtype == torch.float8_e4m3fn:
            value = layout.k_major(value)  # float8 P V takes V K-major
        metas = (query.shape, query.stride(), dtype, device, key.shape, key.stride(), key.dtype, key.device,
                 value.shape, value.stride(), value.dtype, value.device)
        # (16-byte alignment: the Hopper kernels read Q, K, V through TMA descriptors, which need it)
        aligned = (query.data_ptr() | key.data_ptr() | value.data_ptr()) & 15 == 0
        sink_meta = None
        if sinks is not None:
            sinks = sinks.contiguous()  # (the kernels read sinks[h] at h)
            sink_meta = _meta(sinks)
    except (AttributeError, RuntimeError):  # (not tensors; sparse tensors have no data pointer)
        plans.check_inputs(query, key, value, enable_gqa)
        plans.check_sinks(sinks, query)
        raise
    tables = None if block_mask is None else tables_of(block_mask, _check_foreign_mask)
    if tables is not None and "BLOCKS_ARE_CONTIGUOUS" not in options and tables.consecutive():
        # (a causal mask's lists: the Triton kernels skip reading them, 2-6% of a causal forward;
        # an explicit value in kernel_options, False included, is the caller's choice)
        options = {**options, "BLOCKS_ARE_CONTIGUOUS": True}
    if mask_override is not None:
        mask, mask_bufs = mask_override
    elif block_mask is not None:
        mask, mask_bufs = resolve_mask_mod(block_mask, device)
    else:
        mask, mask_bufs = _NOOP_MASK, ()
    # The plan key and the call key hold the captured tensors' metas: the compiled kernel is
    # specialised on their shapes and strides.
    mask_metas = tuple([_meta(t) for t in mask_bufs]) if mask_bufs else ()
    rest = (aligned, mask.key(), mask_metas, None if tables is None else tables.sig, enable_gqa,
            tuple(options.items()) if options else (), want_max,
            None if kv_lengths is None else _meta(kv_lengths),
            dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32, sink_meta)
    fp, tensors = _NO_SCORE_MOD if score_mod is None else modcache.fingerprint(
        score_mod, device, torch.float64 if dtype == torch.float64 else torch.float32)
    call_key = None if fp is None or descale is not None or dtype == torch.float8_e4m3fn else \
        (decoding, metas, fp, rest)
    known = None if call_key is None else _KNOWN.get(call_key)
    bound = None
    if known is not None:
        score, score_bufs = known.score, known.pick(tensors)
        need_grad = _needs_grad(query, key, value, score_bufs, sinks)
        bound = known.by_grad[need_grad]
    if bound is None:
        score, score_bufs, need_grad, bound, descale = _plan_call(
            query, key, value, score_mod, mask, mask_bufs, tables, enable_gqa, options, want_max, decoding,
            kv_lengths, descale, rest, call_key, (fp, tensors), sinks)
    decoding, plan, plan_key, default_scale = bound
    scale = default_scale if scale is None else _check_scale(scale)
    if decoding:
        out, lse = dec.run(plan, query, key, value, score_bufs, mask_bufs, tables, scale, kv_lengths, want_lse, sinks)
        return out, lse, None
    if not need_grad:
        return fwd.run(plan, query, key, value, score, score_bufs, mask, mask_bufs, tables, scale, descale, sinks)
    call = _Call(plan, plan_key, score, mask, len(score_bufs), tables, scale, options)
    res = FlexAttentionFunction.apply(query, key, value, sinks, call, *score_bufs, *mask_bufs)
    return (res[0], res[1], res[2] if want_max else None)


def _plan_call(query, key, value, score_mod, mask, mask_bufs, tables, enable_gqa, options, want_max, decoding,
               kv_lengths, descale, rest, call_key, walked, sinks):
    """A call whose key is not known yet (or not cacheable: ``call_key`` None): resolve the
    score mod, choose the kernel, validate, plan; ``(score, score_bufs, need_grad, (decoding,
    plan, plan key, default scale), descale)``. Remembers the outcome under ``call_key``."""
    device, dtype = query.device, query.dtype
    # (before `_kernel_choice` reads the shapes: a nested tensor's jagged length compares with nothing)
    plans.check_inputs(query, key, value, enable_gqa)
    stat_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    score, score_bufs = resolve_score_mod(score_mod, stat_dtype, device, None if walked[0] is None else walked)
    need_grad, decoding = _kernel_choice(query, key, value, score_bufs, sinks, options, want_max, decoding)
    if descale is not None or dtype == torch.float8_e4m3fn:
        if need_grad:
            raise ValueError("float8 flex_attention is forward-only: no gradients (run it under torch.no_grad(), "
                             "or use bfloat16 inputs for training)")
        descale = _check_descale(query, descale)
    score_metas = tuple([_meta(t) for t in score_bufs]) if score_bufs else ()
    plan_key = (decoding, _meta(query), _meta(key), _meta(value), score.key(), score_metas, *rest)
    if decoding:
        plan = plans.decode_plan(plan_key, query, key, value, score, score_bufs, mask, mask_bufs, tables,
                                 enable_gqa, options, kv_lengths, sinks)
    else:
        plan = plans.forward_plan(plan_key, query, key, value, score, score_bufs, mask, mask_bufs, tables,
                                  enable_gqa, options, want_max, sinks)
    if need_grad:
        # A score mod the backward cannot differentiate fails here, before any work, not later.
        bwd.score_mod_grad(score)
    E = query.shape[-1]
    bound = (decoding, plan, plan_key, 1.0 / math.sqrt(E) if E > 0 else 1.0)
    # (a mod that read a tensor's value in Python is traced again at each call: `Mod.host_values`)
    slots = None if call_key is None or score.host_values else modcache.slots_of(score_bufs, walked[1])
    if slots is not None:
        known = _KNOWN.get(call_key)
        if known is None:
            known = _KNOWN.get_or_make(call_key, lambda: _Known(score, modcache.picker(slots)))
        known.by_grad[need_grad] = bound
    return score, score_bufs, need_grad, bound, descale


# ---------------------------------------------------------------------------------------------
# Under torch.compile: the same call as custom ops (flexattn.ops), mods captured for Dynamo


def _compiled_mask(block_mask, mask_override) -> tuple[str, list[torch.Tensor]]:
    if mask_override is not None:
        return mask_override[0].key(), list(mask_override[1])
    if block_mask is None:
        return noop_mask_mod().key(), []
    compiled = getattr(block_mask, "_flexattn_compiled_mask", None)  # made by create_block_mask in-graph
    if compiled is not None:
        return compiled
    mod = getattr(block_mask, "_mod", None)
    if isinstance(mod, Mod):
        return mod.key(), list(mod.buffers)
    fn = getattr(block_mask, "mask_mod", None)
    if fn is None:
        return noop_mask_mod().key(), []
    if is_noop_mask(fn):
        return noop_mask_mod().key(), []
    return capture.capture(fn, MASK, torch.float32)


def _compiled_tables(block_mask) -> tuple[tuple, list[torch.Tensor], tuple]:
    """(the block part of the ops' spec, the tables, the mask's (Q_LEN, KV_LEN) or (-1, -1)): the
    lengths are op arguments, not part of the constant spec, since under dynamic shapes they are
    symbols."""
    if block_mask is None:
        return (), [], (-1, -1)
    size = block_mask.BLOCK_SIZE
    q_block, kv_block = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    seq = getattr(block_mask, "seq_lengths", None)
    has_seq = seq is not None
    seq = (seq[0], seq[1]) if has_seq else (-1, -1)
    has_full = block_mask.full_kv_num_blocks is not None
    has_q = getattr(block_mask, "q_num_blocks", None) is not None
    names = ["kv_num_blocks", "kv_indices"] + (["full_kv_num_blocks", "full_kv_indices"] if has_full else [])
    if has_q:
        names += ["q_num_blocks", "q_indices"] + (["full_q_num_blocks", "full_q_indices"] if has_full else [])
    tensors = []
    for n in names:
        t = getattr(block_mask, n).to(torch.int32)
        tensors.append(t if t.stride(-1) == 1 else t.contiguous())
    return (q_block, kv_block, has_seq, has_full, has_q), tensors, seq


def _attend_compiled(query, key, value, score_mod, block_mask, scale, enable_gqa, options, want_max, decoding,
                     kv_lengths, mask_override, sinks):
    stat_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    if score_mod is None:
        score_key, score_bufs = identity_score_mod(stat_dtype).key(), []
    else:
        score_key, score_bufs = capture.capture(score_mod, SCORE, stat_dtype)
    mask_key, mask_bufs = _compiled_mask(block_mask, mask_override)
    if mask_override is None:  # (a block mask's mask, as eagerly: decoding's and varlen's masks are not ranked)
        mask_key, mask_bufs = ranks.in_graph(mask_key, mask_bufs)
    block, tables, seq = _compiled_tables(block_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else _check_scale(scale)
    plans.check_sinks(sinks, query)
    if sinks is not None:
        sinks = sinks.contiguous()
    _, decoding = _kernel_choice(query, key, value, score_bufs, sinks, options, want_max, decoding)
    spec = ops.spec(score_key, mask_key, block, bool(enable_gqa), tuple(sorted(options.items())), bool(want_max))
    if decoding:
        out, lse = torch.ops.flexattn.decode(query, key, value, sinks, score_bufs, mask_bufs, tables, *seq,
                                             kv_lengths, spec, float(scale))
        return out, lse, None
    out, lse, mx = torch.ops.flexattn.forward(query, key, value, sinks, score_bufs, mask_bufs, tables, *seq, spec,
                                              float(scale))
    return out, lse, (mx if want_max else None)
