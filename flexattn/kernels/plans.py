"""Launch plans of every kernel family, validated and memoised in one place.

A plan key holds everything a plan depends on (shapes, strides, dtypes, devices, the mods'
structural keys, the block-mask layout, options); on a miss the inputs are validated (the errors
name the argument, what was expected and what came) and the family makes its plan. Callers: the
eager call path (`flexattn.call`) and the custom ops that torch.compile sees (`flexattn.ops`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from flexattn.kernels import backward as bwd, decode as dec, forward as fwd, hopper, launch, tuning
from flexattn.kernels.launch import PlanCache
from flexattn.kernels.tables import Tables, check_against, listed_blocks, visited_share
from flexattn.mods import Mod

FORWARD = PlanCache()
DECODE = PlanCache()
BACKWARD = PlanCache()

MAX_HEAD_DIM = 256  # larger tiles do not fit in registers / shared memory (every kernel family)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# Validation (once per plan: everything checked here is part of the plan key)


def check_inputs(query: Any, key: Any, value: Any, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(f"{name} is a nested (jagged) tensor; flexattn takes dense [B, H, L, E] tensors. "
                             f"Pack the sequences into one and use a document mask instead "
                             f"(flexattn.masks.document, or a mask_mod comparing document ids)")
        if t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}; "
                             f"convert it with .to_dense()")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, L, E], got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32, float64 or float8_e4m3fn (forward "
                            f"only), got {t.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have query's dtype {query.dtype}, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {t.device}")
    if query.device.type == "meta":
        raise ValueError("query, key and value are meta tensors; flex_attention runs kernels and needs real "
                         "data (CUDA or CPU tensors)")
    B, Hq, _, E = query.shape
    Bkv, Hkv, _, _ = key.shape
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


_SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_sinks(sinks: Any, query: torch.Tensor) -> None:
    """``sinks``, where given: a float16/bfloat16/float32/float64 tensor [Hq] on query's device
    (one logit per query head); not with float8 inputs."""
    if sinks is None:
        return
    Hq = query.shape[1]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor of shape [{Hq}] (one logit per query head) or None, "
                        f"got {type(sinks).__name__}")
    if query.dtype == torch.float8_e4m3fn:
        raise TypeError("sinks are not supported with float8_e4m3fn inputs (the float8 forward has no sink); "
                        "pass sinks=None or bfloat16/float16 inputs")
    if tuple(sinks.shape) != (Hq,):
        raise ValueError(f"sinks must have shape [{Hq}] (one logit per query head), got {list(sinks.shape)}")
    if sinks.dtype not in _SINK_DTYPES:
        raise TypeError(f"sinks must be a float16, bfloat16, float32 or float64 tensor, got {sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(f"sinks must be on query's device {query.device}, got {sinks.device}")


def _check_mod_devices(device: torch.device, mods) -> None:
    for mod, bufs in mods:
        mod.check_device(device, buffers=bufs)


def forward_plan(key, query, key_t, value, score: Mod, score_bufs, mask: Mod, mask_bufs, tables: Tables | None,
                 enable_gqa: bool, options: dict, want_max: bool, sinks: torch.Tensor | None = None) -> fwd.Plan:
    """``sinks``: the call's sink logits or None (the key holds their metas: a plan has sinks or not)."""
    return FORWARD.get(key, lambda: _make_forward_plan(query, key_t, value, score, score_bufs, mask, mask_bufs,
                                                       tables, enable_gqa, options, want_max, sinks))


def decode_plan(key, query, key_t, value, score: Mod, score_bufs, mask: Mod, mask_bufs, tables: Tables | None,
                enable_gqa: bool, options: dict, kv_lengths, sinks: torch.Tensor | None = None) -> dec.Plan:
    return DECODE.get(key, lambda: _make_decode_plan(query, key_t, value, score, score_bufs, mask, mask_bufs,
                                                     tables, enable_gqa, options, kv_lengths, sinks))


def backward_plan(key, query, key_t, value, out, grad_out, score: Mod, mask: Mod, tables: Tables | None,
                  options: dict, need: tuple[bool, ...], score_bufs, has_grad_lse: bool,
                  launch_once: Callable[[bwd.Plan], Any]) -> bwd.Plan:
    """``launch_once(plan)`` runs a candidate plan on this call's inputs (autotuning times it)."""
    return BACKWARD.get(key, lambda: _make_backward_plan(query, key_t, value, out, grad_out, score, mask, tables,
                                                         options, need, score_bufs, has_grad_lse, launch_once))


def decode_mods(score: Mod, mask: Mod) -> tuple[Mod | None, Mod | None]:
    """The decoding kernel skips an identity score mod and a constant-True mask entirely."""
    return (None if score.ir.op == "input" else score,
            None if (mask.ir.op == "const" and mask.ir.arg) else mask)


TUNE_MIN_WORK = 1 << 27  # B*H*Q_LEN*KV_LEN from which plans are autotuned (S=4k at 8 heads)


def _make_forward_plan(query, key, value, score, score_bufs, mask, mask_bufs, tables, enable_gqa, options,
                       want_max, sinks):
    check_inputs(query, key, value, enable_gqa)
    check_sinks(sinks, query)
    has_sinks = sinks is not None
    B, Hq, Q_LEN, _ = query.shape
    if tables is not None:
        check_against(tables, B, Hq, Q_LEN, key.shape[2], query.device)
    _check_mod_devices(query.device, ((score, score_bufs), (mask, mask_bufs)))

    def make(config: dict):
        if config.get("BACKEND") == "FLASH":
            return fwd.hopper_plan(query, key, value, score, mask, tables, options, want_max, has_sinks)
        return fwd.make_plan(query, key, value, score, mask, tables, {**options, **config}, want_max, has_sinks)

    device = query.device
    flash = hopper.runnable(query, key, value, tables, options)
    if flash and not hopper.timed_against_triton(query, options):  # one schedule, nothing to tune
        return make({"BACKEND": "FLASH"})

    def candidates_for(device, dtype, head_dim):  # (the Hopper kernel too where it can run)
        return [*tuning.forward_candidates(device, dtype, head_dim), *([{"BACKEND": "FLASH"}] if flash else [])]

    scale = 1.0 / math.sqrt(query.shape[3])
    # float8 kernels read their descale factors: timing runs get real ones (the direct launch
    # passes a missing pointer as null)
    descale = (torch.ones(1, dtype=torch.float32, device=device),) * 3 \
        if query.dtype == torch.float8_e4m3fn else None
    rows = hopper.forward_rows(tables, query.shape[3])  # (its own key: the kernel reads other lists)
    hopper_on = f"or Hopper on {rows}-row lists" if rows else "or Hopper"
    extra = ("max" if want_max else "",) + ((hopper_on,) if flash else ())
    plan = _tuned("forward", tuning.FORWARD_KNOBS, candidates_for, extra,
                  query, key, value, score, tables, options, make,
                  lambda p: fwd.run(p, query, key, value, score, score_bufs, mask, mask_bufs, tables, scale, descale,
                                    sinks))
    return plan if plan is not None else make(_untuned_forward(query, key, tables, options, flash))


def _untuned_forward(query, key, tables: Tables | None, options: dict, flash: bool) -> dict:
    """The forward's config for a call long enough to tune where nothing is timed (deterministic
    mode, AUTOTUNE off, a CUDA graph being captured) and the caller chose no tile or backend: on
    Hopper GPUs at the head dims whose calls are timed against the Hopper kernel
    (`hopper.timed_against_triton`), 16-bit, the tuner's winners on the H100 (B=4 H=32 S=8k D=64,
    bfloat16) instead of the template's defaults. Without a block mask the Hopper kernel (4.11 ms
    against 4.92 with the defaults; a soft-cap too); under a mask that visits about an eighth of the
    blocks or fewer (as the tuning keys round) 4 warps (sliding window 1024: 0.86 against 1.14 ms;
    16 documents 0.48 against 0.70; not during a capture, which forbids reading the mask's share on
    the host); under denser masks the defaults (8 warps, the tuner's causal winner)."""
    B, Hq, Q_LEN, E = query.shape
    if (E not in hopper.TIMED_HEAD_DIMS or query.dtype not in (torch.float16, torch.bfloat16)
            or B * Hq * Q_LEN * key.shape[2] < TUNE_MIN_WORK or not hopper.on_hopper(query, options)
            or "BACKEND" in options or any(k in options for k in tuning.FORWARD_KNOBS)):
        return {}
    if tables is None:
        return {"BACKEND": "FLASH"} if flash else {}
    if query.is_cuda and torch.cuda.is_current_stream_capturing():  # (the share is read on the host)
        return {}
    return {"num_warps": 4} if visited_share(tables) < 2 ** -2.5 else {}


def _make_backward_plan(query, key, value, out, grad_out, score, mask, tables, options, need, score_bufs,
                        has_grad_lse, launch_once):
    def make(config: dict):
        return bwd.make_plan(query, key, value, out, grad_out, score, mask, tables, {**options, **config}, need,
                             score_bufs, has_grad_lse)

    buffer_grads = bool(bwd.grad_buffers_of(score, need, score_bufs))
    extra = ("buffer grads" if any(need) else "", "lse grad" if has_grad_lse else "")
    if hopper.backward_reason(query, key, value, grad_out, tables, options) is None:
        def make_hopper(config: dict):  # (DQ_PASS, and the dQ pass's tiles where it is on)
            tiles = {k: v for k, v in config.items() if k != "DQ_PASS"}
            split = None
            ordered = bwd.ordered_dq({**options, **config}, buffer_grads, mask, tables, key.shape[2], query.shape[3],
                                     launch.raw_scores(score, torch.float32))
            if bwd.dq_by_pass({**options, **config}, buffer_grads, ordered):
                gluon = bwd.GLUON_DQ and not buffer_grads and not tiles and bwd.gluon_dq_reason(tables) is None
                split = (bwd.hopper_dq_plan(query, key, value, score, mask, tables, options, has_grad_lse) if gluon
                         else make(tiles))
            return bwd.hopper_plan(query, key, value, score, mask, tables, options, has_grad_lse, split, ordered)

        plan = None
        if tables is not None and not buffer_grads:  # (the one pass is ahead without a block mask)
            plan = _tuned("backward hopper", tuning.HOPPER_BACKWARD_KNOBS, tuning.hopper_backward_candidates,
                          extra, query, key, value, score, tables, options, make_hopper, launch_once,
                          prefer=tuning.HOPPER_BACKWARD_PREFER)
        return plan if plan is not None else make_hopper({})
    plan = _tuned("backward", tuning.BACKWARD_KNOBS, tuning.backward_candidates, extra,
                  query, key, value, score, tables, options, make, launch_once)
    return plan if plan is not None else make({})


def _tuned(family: str, knobs, candidates_for, extra: tuple[str, ...], query, key, value, score: Mod,
           tables: Tables | None, options: dict, make, run, prefer: float = 0.0):
    """The plan of the tuning winner for one kernel family (``make(config)`` builds a plan,
    ``run(plan)`` launches it once), or None: tuning is off, the call is too short for tiles to
    matter, there is nothing to choose from, or no candidate ran. ``prefer``: see `tuning.choose`."""
    B, Hq, Q_LEN, E = query.shape
    device = query.device
    if B * Hq * Q_LEN * key.shape[2] < TUNE_MIN_WORK or not tuning.enabled(options, device, knobs):
        return None
    candidates = candidates_for(device, query.dtype, max(E, value.shape[3]))
    if len(candidates) < 2:
        return None
    features = (*_tuning_features(query, key, value, score, tables), *extra)
    if prefer:  # (a winner stored by a plain ranking, before the preference, is not reused)
        features += (f"prefer {prefer:g}",)
    plan, _ = tuning.choose(tuning.tuning_key(family, device, *features), candidates, make, run, device, prefer)
    return plan


def _tuning_features(query, key, value, score: Mod, tables: Tables | None) -> tuple[str, ...]:
    """What a tuning key holds besides the family and GPU (see tuning's docstring)."""
    B, Hq, Q_LEN, E = query.shape
    Ev = value.shape[3]
    return (str(query.dtype).removeprefix("torch."), f"E={E}", f"Ev={Ev}",
            f"Q<={tuning.length_bucket(Q_LEN)}", f"KV<={tuning.length_bucket(key.shape[2])}",
            f"BH<={tuning.length_bucket(B * Hq)}",
            f"G={Hq // key.shape[1]}", "score_mod" if score.ir.op != "input" else "no score_mod",
            *(("no block mask", "") if tables is None else (f"blocks {tables.q_block}x{tables.kv_block}",
                                                             *_mask_work(tables))))


def _mask_work(tables: Tables) -> tuple[str, str]:
    """Two tuning features of a block mask, read from its tables once per plan: the share of all
    blocks it visits, to the nearest power of two (each program's length: a causal mask's 1/2, a
    sliding window of 1024 at 8k 1/8, 16 documents 1/16), and the share of those that need mask
    work, in tenths (a causal mask's about 0, a sliding window's 0.2, documents' more). The
    partial share alone put 16 documents that start on block edges under causal's key; causal's
    tiles are a near tie (H100, B=4 H=32 S=8k D=64: 128x128 with 4 warps 2.54 ms, 128x64 2.49),
    and when the tie went to 128x128 the documents ran 0.70 ms against 0.40 with their own winner."""
    partial, full, blocks = listed_blocks(tables)
    visited = (partial + full) / max(blocks, 1)
    level = "0" if visited == 0 else f"1/{2 ** max(0, round(-math.log2(visited)))}"
    return f"visits {level}", f"partial {partial / max(partial + full, 1):.1f}"


def _make_decode_plan(query, key, value, score, score_bufs, mask, mask_bufs, tables, enable_gqa, options,
                      kv_lengths, sinks):
    check_inputs(query, key, value, enable_gqa)
    check_sinks(sinks, query)
    B, Hq, Q_LEN, _ = query.shape
    if query.dtype not in dec.SUPPORTED_DTYPES:
        raise TypeError(f"the decoding kernel takes float16, bfloat16 or float32 inputs, got {query.dtype}")
    if tables is not None:
        check_against(tables, B, Hq, Q_LEN, key.shape[2], query.device)
    _check_mod_devices(query.device, ((score, score_bufs), (mask, mask_bufs)))
    if kv_lengths is not None:
        if not (isinstance(kv_lengths, torch.Tensor) and kv_lengths.shape == (B,)
                and not kv_lengths.dtype.is_floating_point and kv_lengths.dtype != torch.bool):
            got = f"{kv_lengths.dtype} tensor of shape {tuple(kv_lengths.shape)}" \
                if isinstance(kv_lengths, torch.Tensor) else type(kv_lengths).__name__
            raise TypeError(f"kv_lengths must be an integer tensor of shape ({B},), got {got}")
        if kv_lengths.device != query.device:
            raise ValueError(f"kv_lengths is on {kv_lengths.device} but query is on {query.device}")
    score_k, mask_k = decode_mods(score, mask)
    return dec.make_plan(query, key, value, score_k, score_bufs, mask_k, mask_bufs, tables, options, kv_lengths,
                         sinks is not None)


