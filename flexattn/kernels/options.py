"""Every kernel knob in one table: names, meaning, validation and defaults.

``kernel_options`` (flex_attention's argument) is checked here once per distinct dict content
(`check`); the kernel families read their defaults from `forward_defaults`, `backward_defaults`
and `decode_defaults`, which are the tuning surface (change defaults here and nowhere else).

torch 2.13's keys are accepted with the same meaning where flexattn has the knob (``fwd_BLOCK_M``
is ``BLOCK_M``, ``bwd_BLOCK_M1`` is ``BLOCK_M1``, ``BACKEND="TRITON"`` forces the block-sparse
kernel, ...); the ones flexattn has no use for are refused with an error that says what to use.

>>> check({"BLOCK_M": 64, "fwd_num_warps": 4})
{'BLOCK_M': 64, 'num_warps': 4}
"""

from __future__ import annotations

from typing import Any

import torch

from flexattn.lru import LRU

POW2_TILES = (16, 32, 64, 128, 256)

# name -> (family, kind, meaning). kind: "tile" (power of two 16..256), "warps", "stages", "bool",
# "int" (>= 1, with an upper bound in _BOUNDS), "number" (> 0, bounded) or "str" (one of _CHOICES).
OPTIONS: dict[str, tuple[str, str, str]] = {
    # forward (block-sparse) kernel
    "BLOCK_M": ("forward", "tile", "query rows per program (divides the block mask's Q block size)"),
    "BLOCK_N": ("forward", "tile", "KV columns per inner step (divides the block mask's KV block size); "
                                   "also the decoding kernel's KV step"),
    "num_warps": ("forward", "warps", "warps per program (forward and decoding)"),
    "num_stages": ("forward", "stages", "software-pipelining stages of the KV loop (forward and decoding)"),
    "PRESCALE_QK": ("forward", "bool", "scale q once per tile instead of every score tile (slightly less accurate)"),
    "ROWS_GUARANTEED_SAFE": ("forward", "bool", "promise that no query row is fully masked (skips the -inf guard)"),
    "BLOCKS_ARE_CONTIGUOUS": ("forward", "bool", "promise that each query block's KV blocks are consecutive "
                                                 "(set by itself, unless given, for a block mask whose lists all "
                                                 "are, such as a causal one's, once the device has checked it)"),
    "LONGEST_FIRST": ("forward", "bool", "launch query tiles last to first (causal masks: the longest first; "
                                         "default True)"),
    "HEAD_GROUP": ("forward", "int", "Gluon Hopper forward and backward: how many heads' tiles the programs take "
                                     "together, tile by tile (1: a head at a time; default: 1, or with a block mask "
                                     "and a grid of few waves as many heads as fit in half the L2)"),
    "FORCE_USE_FLEX_ATTENTION": ("forward", "bool", "always use the block-sparse kernel, never the decoding kernel"),
    "AUTOTUNE": ("forward", "bool", "time a few forward and backward tile configs once per GPU / dtype / head "
                                    "dims / length bucket / mod features and keep the fastest on disk (default: "
                                    "on for CUDA, off on the CPU; also FLEXATTN_AUTOTUNE=0)"),
    "FAST_TANH": ("forward", "bool", "float16/bfloat16/float8 inputs on CUDA: tanh in mods is the hardware's "
                                     "tanh.approx.f32 (default True; False: libdevice's tanh)"),
    # backward
    "BLOCK_M1": ("backward", "tile", "dK/dV pass: query rows per step"),
    "BLOCK_N1": ("backward", "tile", "dK/dV pass: KV rows per program"),
    "BLOCK_M2": ("backward", "tile", "dQ pass: query rows per program"),
    "BLOCK_N2": ("backward", "tile", "dQ pass: KV columns per step"),
    "bwd_num_warps": ("backward", "warps", "backward: warps per program"),
    "bwd_num_stages": ("backward", "stages", "backward: software-pipelining stages"),
    "DETERMINISTIC": ("backward", "bool", "bitwise-reproducible gradients: dQ, dK and dV summed in a fixed order "
                                          "(the Triton backward, or on Hopper the Gluon kernel with its dQ adds "
                                          "ordered, or its dK/dV with a dQ pass), "
                                          "captured-tensor gradients summed exactly, and "
                                          "no timed tile choice (default: torch.are_deterministic_algorithms_"
                                          "enabled() when the forward is called; an explicit value wins)"),
    "DQ_PASS": ("backward", "bool", "Gluon Hopper backward: dQ by a dQ pass over the forward's block lists "
                                    "(Gluon; Triton where captured tensors need gradients): 16-bit dQ written "
                                    "once, no float32 accumulator to zero and convert, "
                                    "while the Gluon kernel computes dK and dV only (always where captured "
                                    "tensors need gradients; in deterministic mode True or False picks the dQ "
                                    "pass or the one pass's ordered dQ adds over the mode's rule; under a "
                                    "block mask the tuner times both)"),
    # decoding (split-KV) kernel, used for short queries without gradients
    "SPLIT_KV": ("decode", "int", "programs per row tile along KV (default: from the SM count)"),
    "PROGRAMS_PER_SM": ("decode", "number", "SPLIT_KV target: about this many programs per SM (SPLIT_KV is "
                                             "the power of two at or below what reaches it)"),
    "MIN_TILES_PER_SPLIT": ("decode", "int", "never split so finely that a program walks fewer KV tiles"),
    "INPUT_PRECISION": ("decode", "str", "tl.dot precision for float32 inputs: 'ieee' or 'tf32'"),
    "BACKEND": ("forward", "str", "torch's kernel choice: 'AUTO', 'TRITON' (the block-sparse Triton kernels, "
                                  "forward and backward), 'TRITON_DECODE' (decoding kernel), 'FLASH' (the "
                                  "Gluon Hopper forward: an error where it cannot run; AUTO takes the Gluon "
                                  "forward and backward wherever they can run, the forward timed against the "
                                  "Triton kernel at head dim 64 and for float8 at 128)"),
}
_BOUNDS = {"HEAD_GROUP": 1 << 20, "SPLIT_KV": 1024, "PROGRAMS_PER_SM": 64, "MIN_TILES_PER_SPLIT": 1 << 20}
_CHOICES = {"INPUT_PRECISION": ("ieee", "tf32"), "BACKEND": ("AUTO", "TRITON", "TRITON_DECODE", "FLASH")}

# torch's spellings of flexattn's knobs.
_ALIASES = {
    "fwd_BLOCK_M": "BLOCK_M", "fwd_BLOCK_N": "BLOCK_N", "fwd_num_warps": "num_warps",
    "fwd_num_stages": "num_stages", "bwd_BLOCK_M1": "BLOCK_M1", "bwd_BLOCK_N1": "BLOCK_N1",
    "bwd_BLOCK_M2": "BLOCK_M2", "bwd_BLOCK_N2": "BLOCK_N2",
}
# torch keys flexattn refuses, with what to do instead.
_REFUSED = {
    "WRITE_DQ": "flexattn always accumulates captured-tensor gradients in the dQ pass; remove the key",
    "USE_TMA": "flexattn chooses its memory path itself; remove the key",
    "kpack": "a ROCm knob; flexattn's kernels target NVIDIA GPUs (and the CPU interpreter)",
    "matrix_instr_nonkdim": "a ROCm knob; flexattn's kernels target NVIDIA GPUs (and the CPU interpreter)",
    "waves_per_eu": "a ROCm knob; flexattn's kernels target NVIDIA GPUs (and the CPU interpreter)",
    "OUTPUT_LOGSUMEXP": "an internal torch key; ask for the LSE with return_aux=AuxRequest(lse=True)",
    "OUTPUT_MAX": "an internal torch key; ask for it with return_aux=AuxRequest(max_scores=True)",
}

_CHECKED = LRU(1024)  # options items -> validated options (a small dict each)


def fast_math(options: dict, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether kernels for these inputs use the hardware's approximate tanh (`FAST_TANH`)."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn) \
        and options.get("FAST_TANH", True)


def _value_error(key: str, value: Any, kind: str) -> str | None:
    if kind == "bool":
        return None if isinstance(value, bool) else "a bool"
    if kind == "str":
        return None if value in _CHOICES[key] else f"one of {list(_CHOICES[key])}"
    if kind == "number":
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= _BOUNDS[key]
        return None if ok else f"a number in (0, {_BOUNDS[key]}]"
    if isinstance(value, bool) or not isinstance(value, int):
        return "an int"
    if kind == "tile":
        return None if value in POW2_TILES else "a power of two in 16..256"
    if kind == "warps":
        return None if value in (1, 2, 4, 8, 16) else "1, 2, 4, 8 or 16"
    if kind == "stages":
        return None if 1 <= value <= 8 else "an int in 1..8"
    bound = _BOUNDS[key]
    return None if 1 <= value <= bound else f"an int in 1..{bound}"


def check(kernel_options: dict | None) -> dict[str, Any]:
    """Validated options with torch's aliases resolved; memoised by content (a repeated call with
    the same options costs a tuple and a dict lookup)."""
    if not kernel_options:
        if kernel_options is None or isinstance(kernel_options, dict):
            return {}
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    try:
        # (with the values' types: 1 == True and 64 == 64.0 hash alike, and the checks tell them apart)
        memo_key = tuple([(k, v, type(v)) for k, v in kernel_options.items()])
        hit = _CHECKED.get(memo_key)
    except TypeError:  # an unhashable value: validate (and fail) below
        memo_key, hit = None, None
    if hit is not None:
        return hit
    out: dict[str, Any] = {}
    for key, value in kernel_options.items():
        name = _ALIASES.get(key, key)
        if key in _REFUSED:
            raise ValueError(f"kernel_options[{key!r}] is not supported by flexattn: {_REFUSED[key]}")
        if name not in OPTIONS:
            valid = "\n".join(f"  {k} ({fam}): {doc}" for k, (fam, _, doc) in OPTIONS.items())
            raise ValueError(f"kernel_options has an unknown key {key!r}; valid keys are:\n{valid}\n"
                             f"  and torch's aliases {sorted(_ALIASES)}")
        wanted = _value_error(name, value, OPTIONS[name][1])
        if wanted is not None:
            raise (TypeError if wanted in ("a bool", "an int") else ValueError)(
                f"kernel_options[{key!r}] must be {wanted}, got {value!r}")
        if name in out and out[name] != value:
            raise ValueError(f"kernel_options sets {name!r} twice with different values (through {key!r})")
        out[name] = value
    # (torch's rule: BACKEND, AUTO included, supersedes FORCE_USE_FLEX_ATTENTION=True; False is no request)
    if "BACKEND" in out and out.get("FORCE_USE_FLEX_ATTENTION", False):
        raise ValueError("kernel_options: BACKEND cannot be combined with FORCE_USE_FLEX_ATTENTION=True; "
                         "drop FORCE_USE_FLEX_ATTENTION (BACKEND='TRITON' keeps the block-sparse kernel)")
    if memo_key is not None:
        _CHECKED[memo_key] = out
    return out


def with_deterministic(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with DETERMINISTIC set where torch asks for deterministic algorithms
    (`torch.use_deterministic_algorithms`) and the caller did not choose: read per call, so that
    switching torch's flag between calls picks the other plan. An explicit value, False
    included, is the caller's choice, as for every kernel option.

    >>> with_deterministic({"DETERMINISTIC": False})
    {'DETERMINISTIC': False}
    """
    if "DETERMINISTIC" in options or not torch.are_deterministic_algorithms_enabled():
        return options
    return {**options, "DETERMINISTIC": True}


# ---------------------------------------------------------------------------------------------
# Defaults (the tuning surface)


def forward_defaults(device: torch.device, dtype: torch.dtype, qk_head_dim: int, v_head_dim: int) -> dict[str, Any]:
    """Forward-kernel defaults for one device / dtype / head-dim combination. Tiles are later
    shrunk to fit short sequences and the block mask's block sizes.

    >>> forward_defaults(torch.device("cpu"), torch.float32, 64, 64)["BLOCK_M"]
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
    elif dtype == torch.float8_e4m3fn and 64 < d <= 128:
        # float8 (V K-major) on the H100: 4 warps beat 8 by 10% or more (python -m benchmarks fp8)
        block_m, block_n, warps, stages = 128, 128, 4, 3
    # bf16/fp16 on Hopper (python -m benchmarks attention):
    # 8 warps beat 4 at D=64 by 2-3%; 128x128 tiles beat 128x64 at D=128 causal by 4%; at D=256
    # 128x64 with 8 warps beats 64x32 with 4 by 22-25%.
    elif d <= 64:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    elif d <= 128:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    else:
        block_m, block_n, warps, stages = 128, 64, 8, 2
    return {
        "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps, "num_stages": stages,
        "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False,
        # LONGEST_FIRST: causal forward 2.3% faster at S=8k, level without a mask (H100)
        "LONGEST_FIRST": True,
    }


def backward_defaults(device: torch.device, dtype: torch.dtype, qk_head_dim: int, v_head_dim: int) -> dict[str, Any]:
    """Backward tiles: BLOCK_M1 x BLOCK_N1 for the dK/dV pass (query rows per step x KV rows per
    program), BLOCK_M2 x BLOCK_N2 for the dQ pass.

    >>> backward_defaults(torch.device("cpu"), torch.float32, 64, 64)["BLOCK_N1"]
    32
    """
    d = max(qk_head_dim, v_head_dim)
    if device.type != "cuda":
        m1, n1, m2, n2, warps, stages = 32, 32, 32, 32, 4, 1
    elif dtype == torch.float64:
        m1, n1, m2, n2, warps, stages = 16, 32, 32, 16, 4, 1
    elif dtype == torch.float32:
        m1, n1, m2, n2, warps, stages = 32, 64, 64, 32, 4, 1
    # bf16/fp16 on Hopper (python -m benchmarks attention):
    # at D=64, 64x128 tiles with 4 warps spill (107 TF/s) where 64x64 runs at 326-353; at D=128,
    # 3 stages beat 2 by 5-8%; at D=256, 64x64 tiles with 8 warps and 2 stages run at 181-195
    # TF/s where 32x64 with 4 warps and 1 stage ran at 58-70.
    elif d <= 64:
        m1, n1, m2, n2, warps, stages = 64, 64, 64, 64, 4, 3
    elif d <= 128:
        m1, n1, m2, n2, warps, stages = 64, 128, 128, 64, 8, 3
    else:
        m1, n1, m2, n2, warps, stages = 64, 64, 64, 64, 8, 2
    return {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2,
            "bwd_num_warps": warps, "bwd_num_stages": stages}


def decode_defaults(device: torch.device, qk_head_dim_rounded: int, v_head_dim_rounded: int) -> dict[str, Any]:
    """Decoding-kernel defaults (SPLIT_KV itself is derived from the SM count at plan time)."""
    on_gpu = device.type == "cuda"
    d = max(qk_head_dim_rounded, v_head_dim_rounded)
    # 128-wide KV steps with 3 stages keep 192 KB of K/V tiles in flight (D = 128): one program
    # then streams at the SM's share of the bandwidth, and one program per SM (SPLIT_KV the power
    # of two at or below that target) beats 4 with 64-wide steps by 1-3 points of copy bandwidth
    # on the H100 (python -m benchmarks decode).
    # GPUs with less shared memory per block keep 64-wide steps.
    wide = on_gpu and d <= 128 and _shared_memory_per_block(device) >= 200 * 1024
    return {
        "BLOCK_N": (128 if wide else 64 if d <= 128 else 32) if on_gpu else 16,
        "BLOCK_M": 64, "num_warps": 4, "num_stages": 3,
        "PROGRAMS_PER_SM": 1 if wide else 4, "MIN_TILES_PER_SPLIT": 8 if on_gpu else 1, "INPUT_PRECISION": "ieee",
    }


def _shared_memory_per_block(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
