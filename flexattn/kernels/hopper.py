"""When the forward and backward run the Gluon Hopper kernels (templates/forward_hopper.py,
templates/backward_hopper.py), and their TMA descriptors.

The forward kernel runs on H100/H200-class GPUs (compute capability 9.0) for 16-bit and float8
inputs: a TMA loader warp and two consumer warp groups (three at head dim 64) that take turns on
the tensor cores.
`reason` says why a call cannot take it (None: it can); the block-sparse Triton template
(templates/forward.py) runs everything else and is the fallback. ``kernel_options``: BACKEND="TRITON" keeps the Triton
template, BACKEND="FLASH" demands this kernel (an error says why it cannot run). The backward kernel
(16-bit, head dim 64 or 128) is chosen the same way by `backward_reason`; BACKEND="TRITON" keeps
the Triton backward (templates/backward.py) too.
"""

from __future__ import annotations

import functools

import torch

from flexattn.codegen import signatures
from flexattn.kernels import launch

# Query rows per program, by head dim: 64 per consumer warp group. Head dim 64 takes three
# consumers (192-row tiles, FlashAttention-3's shape there): its matrix multiplies are half head
# dim 128's per score, so the softmax needs two warp groups' multiplies to hide behind. A block
# mask's query blocks that are not multiples of the tile are read regrouped to the tile's rows at
# TIMED_HEAD_DIMS (`forward_rows`); its KV blocks must be multiples of BLOCK_N (`_tiles_reason`).
BLOCK_M = {64: 192, 128: 128, 256: 128}
# KV columns per tile, by head dim (at 256, two buffers of 128-row K and V tiles would not fit in
# shared memory).
BLOCK_N = {64: 128, 128: 128, 256: 64}
HEAD_DIMS = tuple(BLOCK_N)
# float8 takes this kernel untimed at these head dims only: at D=256 it is well ahead (H100, B=2
# H=8 S=4k: 808-816 / 584-614 TF/s no mask / causal against the Triton template's 600 / 483-488).
# At D=128 the two are close and trade places with the mask and the GPU (H100, B=4 H=16 S=8k:
# 793-810 / 693 on the Triton template against 675-716 / 630-640 here): the tuner times this
# kernel beside the template's float8 configs (`timed_against_triton`) and keeps the faster; with
# tuning off the template runs. BACKEND='FLASH' runs this kernel at every head dim in HEAD_DIMS.
FP8_HEAD_DIMS = (256,)
# Head dims where float8 can take this kernel at all (at 64, three consumers' float8 tiles are not
# built: the Triton template runs it).
FP8_GLUON_HEAD_DIMS = (128, 256)
# Head dims where every call is timed against the Triton template's configs (`timed_against_triton`):
# at 64 the 192-row tiles win without a mask (H100 B=4 H=32 S=8k: 527 against 449 TF/s; the tuner
# kept them for a soft-cap too), and timing keeps the choice measured where a score_mod works (the
# two-consumer kernel ran 9-27% slower than the template there) and under a block mask, whose
# 128-row lists it reads regrouped to its 192-row tiles (`forward_rows`).
TIMED_HEAD_DIMS = (64,)
NUM_BUFFERS = 2  # K and V tiles in flight
NUM_WARPS = 4      # the kernel's own warps: consumer 0 (the other consumers and the loader are workers)
# Registers per thread by consumers: the kernel's (over 12 or 16 warps: a warp group is the unit, so
# that they fill the register file) and the worker consumers' (consumer 0 gets what the loader's 24
# leave, the same)
MAX_REGISTERS = {2: 168, 3: 128}
CONSUMER_REGISTERS = {2: 240, 3: 160}
# The tile knobs the Triton template takes: a call that sets one means that template.
_TRITON_KNOBS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "PRESCALE_QK")
_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv"}


@functools.lru_cache(maxsize=None)
def _gluon_api() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return hasattr(tma, "async_load") or hasattr(tma, "async_copy_global_to_shared")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


# Programs take their tiles a head group at a time (templates/gluon_tiles.py: program_tile) when a
# block mask makes their lengths differ and the grid is at most this many waves of one program
# per SM; a group's heads' tensors take at most L2_SHARE of the L2. Measured on an H200
# (python -m benchmarks attention), against the grid's order: B=4 H=16 D=128 S=2k causal
# forward and backward 6% faster, ALiBi 9% / 8%, S=4k 3% / 3% and 5% / 3%; D=256 B=2 H=8 S=4k
# causal and ALiBi forward 19-20%; sliding window and documents within 2%. Without a block mask
# the programs' lengths are equal (nothing to gain), and at S=8k (31 waves) groups of 7 heads
# ran 5% slower without a mask and on sliding window (a head's programs together, as in the
# grid's order, read each K/V tile from L2 more often).
HEAD_GROUP_WAVES = 16
L2_SHARE = 0.5


def head_group(device: torch.device, bytes_per_head: int, heads: int, programs: int, masked: bool,
               explicit: int | None = None) -> int:
    """HEAD_GROUP of program_tile: ``explicit`` (kernel_options) if given, else 1 (the grid's
    order) unless a block mask's programs are at most HEAD_GROUP_WAVES waves; then as many heads
    as have their tensors (``bytes_per_head``: what a head's programs read and add into) in
    L2_SHARE of the L2."""
    if explicit is not None:
        return min(explicit, heads)
    if not masked or device.type != "cuda":  # (the CPU tests that build this plan: no L2)
        return 1
    if programs > HEAD_GROUP_WAVES * launch.num_sms(device):
        return 1
    return max(1, min(heads, int(_l2_bytes(device) * L2_SHARE) // max(1, bytes_per_head)))


def _on_sm90(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) == (9, 0)


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA reads a tensor whose last dimension is contiguous, with 16-byte aligned base and strides."""
    size = t.element_size()
    return t.stride(3) == 1 and t.data_ptr() % 16 == 0 and all(t.stride(d) * size % 16 == 0 for d in range(3))


def _machine_reason(query: torch.Tensor, options: dict) -> str | None:
    """What keeps any call off the Gluon kernels: the option, the device, this Triton."""
    if options.get("BACKEND") == "TRITON":
        return "kernel_options BACKEND='TRITON'"
    if not _on_sm90(query.device):
        return f"it needs a compute capability 9.0 GPU (H100/H200), the inputs are on {query.device}"
    if not _gluon_api():
        return "this Triton has no Gluon Hopper API (TMA, mbarrier, wgmma)"
    return None


def on_hopper(query: torch.Tensor, options: dict) -> bool:
    """Whether nothing keeps this call off the Gluon kernels but its shapes and mods (`_machine_reason`)."""
    return _machine_reason(query, options) is None


def _tma_reason(**tensors: torch.Tensor) -> str | None:
    for name, t in tensors.items():
        if not _tma_ok(t):
            return f"{name} is not TMA-readable (last dimension contiguous, 16-byte aligned base and strides)"
    return None


def _tiles_reason(tables, block_m: int | None, block_n: int) -> str | None:
    """``block_m`` None: the query blocks are read regrouped (`forward_rows`), only the KV blocks count."""
    if tables is not None and block_m is None:
        return (f"the block mask's KV blocks of {tables.kv_block} are not multiples of the kernel's "
                f"{block_n}-column tiles") if tables.kv_block % block_n else None
    if tables is not None and (tables.q_block % block_m or tables.kv_block % block_n):
        return (f"the block mask's blocks ({tables.q_block}x{tables.kv_block}) are not multiples of the "
                f"kernel's {block_m}x{block_n} tiles")
    return None


def _knobs_reason(options: dict, knobs: tuple[str, ...], owner: str) -> str | None:
    named = [k for k in knobs if k in options]
    return f"kernel_options set the {owner}'s knobs {named}" if named else None


def reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tables, options: dict) -> str | None:
    """Why this forward cannot run the Hopper kernel, or None when it can."""
    why = _machine_reason(query, options)
    if why is not None:
        return why
    if query.dtype not in _GL_DTYPES:
        return f"it takes float16, bfloat16 or float8_e4m3fn inputs, got {query.dtype}"
    E, Ev = query.shape[3], value.shape[3]
    if E != Ev or E not in HEAD_DIMS:
        return f"it takes equal query and value head dims in {HEAD_DIMS}, got E={E}, Ev={Ev}"
    if query.shape[2] < BLOCK_M[E]:
        return f"query length {query.shape[2]} is below one {BLOCK_M[E]}-row tile"
    if query.dtype == torch.float8_e4m3fn:
        if E not in FP8_GLUON_HEAD_DIMS:
            return f"it takes float8 inputs at head dims {FP8_GLUON_HEAD_DIMS}, got {E}"
        if value.stride(2) != 1:  # (call.py lays float8 V out KV-innermost: P V reads it K-major)
            return "float8 value is not KV-innermost (stride(2) == 1)"
        value = value.transpose(2, 3)
    block_m = None if forward_rows(tables, E) else BLOCK_M[E]
    return (_tma_reason(query=query, key=key, value=value) or _tiles_reason(tables, block_m, BLOCK_N[E])
            or _knobs_reason(options, _TRITON_KNOBS, "Triton template"))


def forward_rows(tables, head_dim: int) -> int:
    """The query block size of the lists the Hopper forward reads for ``tables``: 0 for the
    mask's own, else BLOCK_M, the lists regrouped to the kernel's query tiles (`tables.regrouped`).
    At TIMED_HEAD_DIMS only, where the tuner times the kernel on them against the Triton template
    on the mask's own blocks: the 192-row tiles at head dim 64 span one and a half of a mask's
    128-row blocks, so a regrouped list visits the blocks of both. H200, B=4 H=32 S=8k bfloat16
    (python -m benchmarks attention): the tuner takes this kernel for causal (1.20-1.27x
    torch.compile(flex_attention) in three runs, against 1.11-1.14x with the template) and keeps the template for
    sliding window 1024, ALiBi + causal and 16 documents, whose regrouped lists visit more columns,
    mostly partial (exact 192-row tables measured 0.92x, 0.92x and 0.68x torch there)."""
    if tables is None or head_dim not in TIMED_HEAD_DIMS or tables.q_block % BLOCK_M[head_dim] == 0:
        return 0
    return BLOCK_M[head_dim]


def runnable(query, key, value, tables, options: dict) -> bool:
    """Whether the forward can run the Hopper kernel (BACKEND='FLASH' raises where it cannot)."""
    why = reason(query, key, value, tables, options)
    if why is not None and options.get("BACKEND") == "FLASH":
        raise ValueError(f"kernel_options BACKEND='FLASH' asks for the Hopper forward kernel, which cannot run "
                         f"here: {why}")
    return why is None


def timed_against_triton(query, options: dict) -> bool:
    """Whether a forward that can run the Hopper kernel (`runnable`) leaves the choice to the tuner,
    which times this kernel beside the Triton template's configs: float8 outside FP8_HEAD_DIMS and
    every call at TIMED_HEAD_DIMS, unless BACKEND='FLASH' demands this kernel. Untimed (tuning off,
    a short call), such a call runs the Triton template, except where `plans._untuned_forward`
    picks this kernel (long 16-bit calls without a block mask); every other runnable call runs
    this kernel."""
    E = query.shape[3]
    return ((E in TIMED_HEAD_DIMS or query.dtype == torch.float8_e4m3fn and E not in FP8_HEAD_DIMS)
            and options.get("BACKEND") != "FLASH")


# The backward (templates/backward_hopper.py): KV tiles of BWD_BLOCK_N rows per program, query
# tiles of BWD_BLOCK_M rows per step, at these head dims (E == Ev).
BWD_BLOCK_M = 64
BWD_BLOCK_N = 128
# Q and dO tiles in flight (the ring's slots), by head dim. Head dim 64 has the shared memory for a
# third, and its shorter steps use it: no mask 378 -> 397 TF/s at B=4 H=32 S=8k on the H100, level
# elsewhere (python -m benchmarks attention); head dim 128 has room for two.
BWD_NUM_BUFFERS = {64: 3, 128: 2}
BWD_HEAD_DIMS = tuple(BWD_NUM_BUFFERS)
# The backward's Gluon dQ pass (templates/backward_dq_hopper.py): query tiles of DQ_BLOCK_M rows per
# program (a consumer's 64 each), KV tiles of DQ_BLOCK_N rows per step in a ring of DQ_NUM_BUFFERS.
DQ_BLOCK_M = 128
DQ_BLOCK_N = 64
DQ_NUM_BUFFERS = {64: 4, 128: 3}
# The backward's own knobs: a call that sets one means the Triton backward.
_TRITON_BWD_KNOBS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages")


def backward_reason(query, key, value, grad_out, tables, options: dict) -> str | None:
    """Why a backward cannot run the Hopper kernel, or None when it can."""
    why = _machine_reason(query, options)
    if why is not None:
        return why
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes float16 or bfloat16 inputs, got {query.dtype}"
    E, Ev = query.shape[3], value.shape[3]
    if E != Ev or E not in BWD_HEAD_DIMS:
        return f"it takes equal query and value head dims in {BWD_HEAD_DIMS}, got E={E}, Ev={Ev}"
    if query.numel() == 0 or key.numel() == 0:
        return "there is nothing to compute"
    if query.shape[2] < BWD_BLOCK_M or key.shape[2] < BWD_BLOCK_N:
        return f"the lengths are below one {BWD_BLOCK_M}x{BWD_BLOCK_N} tile"
    return (_tma_reason(query=query, key=key, value=value, grad_out=grad_out)
            or _tiles_reason(tables, BWD_BLOCK_M, BWD_BLOCK_N)
            or _knobs_reason(options, _TRITON_BWD_KNOBS, "Triton backward"))


class Descriptors:
    """The TMA descriptors of one call's Q, K, V (block shapes and layouts fixed per plan), the
    backward's dO and dQ accumulator, and where `with_out` the kernel's 16-bit outputs (the
    forward's output, the backward's dK and dV; ``outputs`` False: they are not 16-bit), which each
    consumer stages in its own shared memory (forward: its rows of the Q tile; backward: dV in its
    rows of the V tile, dK in its dQ buffer) for the TMA unit to store. float8 V is read through its
    [B, H, Ev, L] view (stored KV-innermost) in [Ev, BLOCK_N] tiles.

    A call's argument tuple holds the tensors themselves at `positions` (their places in the
    kernel's parameter list, `signatures`); the plan's `launch.Launch` turns them into descriptors
    with `describe` only where a launch goes through Triton. Its direct launch
    (`triton_launcher.TensorMapLaunch`) reads the tensors' addresses alone, so a repeated call
    builds no descriptor object (2-3 µs each on an H200's host).

    The first `describe` builds each through Triton's constructor, which validates it (alignment,
    strides, block shape against the layout). A later one of the same plan has the same dtypes,
    shapes, strides and 16-byte alignment (the plan key holds them), so its descriptors are copies
    of the first ones with this call's tensors in place. A descriptor class without an instance dict
    keeps the constructor."""

    __slots__ = ("make", "blocks", "layouts", "v_k_major", "with_out", "first", "positions")

    def __init__(self, dtype: torch.dtype, head_dim: int, backward: bool = False, outputs: bool = True,
                 dq_pass: bool = False):
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        gdt = getattr(gl, _GL_DTYPES[dtype])
        self.make = TensorDescriptor
        self.first = None  # the fields of the first call's validated descriptors, but the tensors
        self.v_k_major = dtype == torch.float8_e4m3fn
        # (float8 inputs: a Q tile has half the room of its bfloat16 output, stored from the registers)
        self.with_out = outputs and dtype != torch.float8_e4m3fn
        if dq_pass:  # Q, K, V, dO and dQ (a consumer's rows, staged in its rows of the Q tile)
            q, kv = [1, 1, DQ_BLOCK_M, head_dim], [1, 1, DQ_BLOCK_N, head_dim]
            blocks = ((q, gdt), (kv, gdt), (kv, gdt), (q, gdt), ([1, 1, DQ_BLOCK_M // 2, head_dim], gdt))
            sig, names = signatures.BACKWARD_DQ_HOPPER, ("Q", "K", "V", "DO", "DQ")
        elif backward:  # Q, K, V, dO, the float32 dQ accumulator (a consumer's half of the head dim), dK
            # and dV (a consumer's rows)
            q, kv = [1, 1, BWD_BLOCK_M, head_dim], [1, 1, BWD_BLOCK_N, head_dim]
            blocks = ((q, gdt), (kv, gdt), (kv, gdt), (q, gdt), ([1, 1, BWD_BLOCK_M, head_dim // 2], gl.float32))
            sig, names = signatures.BACKWARD_HOPPER, ("Q", "K", "V", "DO", "DQ_DESC")
            if self.with_out:
                blocks += (([1, 1, BWD_BLOCK_N // 2, head_dim], gdt), ) * 2
                names += ("DK", "DV")
        else:
            block_n = BLOCK_N[head_dim]
            # (a TMA box's sides are powers of two: the 192-row Q tile loads as 64-row boxes)
            q_rows = BLOCK_M[head_dim] if BLOCK_M[head_dim] & (BLOCK_M[head_dim] - 1) == 0 else 64
            blocks = (([1, 1, q_rows, head_dim], gdt), ([1, 1, block_n, head_dim], gdt),
                      ([1, 1, head_dim, block_n] if self.v_k_major else [1, 1, block_n, head_dim], gdt))
            sig, names = signatures.FORWARD_HOPPER, ("Q", "K", "V")
            if self.with_out:  # (a consumer's rows)
                blocks += (([1, 1, 64, head_dim], gdt), )
                names += ("Out", )
        # (the tensors group leads each kernel's parameters)
        self.positions = tuple(sig.group("tensors").index(n) for n in names)
        self.blocks = tuple(b for b, _ in blocks)
        layouts = [gl.NVMMASharedLayout.get_default_for(b, t) for b, t in blocks]
        if backward:  # K's column halves (dQ = dS K per consumer) must each be whole swizzle rows:
            # 64-byte swizzle at head dim 64 (16-bit elements: a half row is head_dim bytes)
            layouts[1] = gl.NVMMASharedLayout(swizzle_byte_width=min(128, head_dim), element_bitwidth=16, rank=4)
        if dq_pass:
            layouts[4] = layouts[0]
        elif self.with_out:  # the output staged in the Q tile's rows, dV in the V tile's: their layouts
            # (dK, staged in a dQ buffer viewed with any layout, takes K's)
            if backward:
                layouts[5:7] = layouts[1:3]
            else:
                layouts[3] = layouts[0]
        self.layouts = tuple(layouts)

    def describe(self, args: tuple) -> tuple:
        """``args`` (a launch's whole argument tuple) with the tensors at `positions` replaced by
        their descriptors."""
        tensors = [args[i] for i in self.positions]
        if self.v_k_major:
            tensors[2] = tensors[2].transpose(2, 3)
        out = list(args)
        for i, d in zip(self.positions, self._made(tensors)):
            out[i] = d
        return tuple(out)

    def _made(self, tensors: list) -> tuple:
        first = self.first
        if not first:  # the plan's first call (None), or descriptors that cannot be copied (())
            made = tuple(self.make(t, list(t.shape), list(t.stride()), b, lay)
                         for t, b, lay in zip(tensors, self.blocks, self.layouts))
            if first is None:  # (their fields but the tensor: the plan must not keep a call's tensors alive)
                self.first = tuple({k: v for k, v in vars(d).items() if k != "base"} for d in made) \
                    if all(hasattr(d, "__dict__") for d in made) else ()
            return made
        new, cls = object.__new__, self.make
        out = []
        for t, fields in zip(tensors, first):
            c = new(cls)
            c.__dict__ = {**fields, "base": t, "shape": list(t.shape), "strides": list(t.stride())}
            out.append(c)
        return tuple(out)
