"""The one launch layer: what every kernel family (forward, backward, decoding, block masks)
needs on the host, written once.

A kernel family splits its host work in two. Once per *plan key* (mods' structural keys, shapes,
dtypes, stride pattern, block-mask layout, options) it validates, picks tiles and constexprs,
renders/loads the generated module and precomputes every launch argument that does not change
between calls; that is the family's ``Plan``, memoised in a `PlanCache`. Once per *call* it
allocates outputs with `empty`, binds the tensors of the call, and launches. Nothing on the
per-call half reads tensor values on the host (no ``.item()``, ``.cpu()``, ``.tolist()``), so calls
can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Hashable

import numpy
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError, OutOfResources

from flexattn.codegen import affine, emit
from flexattn.codegen.cache import INTERPRETER_LOCK
from flexattn.codegen.render import load_kernel_module, template_text
from flexattn.kernels import triton_launcher
from flexattn.kernels.arguments import PER_CALL, UNUSED
from flexattn.kernels.triton_launcher import no_launch_hooks
from flexattn.lru import LRU

LARGE_BLOCK = 1 << 30  # a sparse block size meaning "one block covers the whole sequence" (no block mask)
ACC_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}  # accumulator dtypes


def target_for(device: torch.device) -> str:
    """Codegen target for tensors on ``device``: CPU tensors run through Triton's interpreter."""
    return "interpret" if device.type == "cpu" else "cuda"


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The next power of two >= ``n`` and >= ``floor`` (tl.arange / tl.dot shapes), in plain
    integers: ``triton.next_power_of_2`` is a constexpr function in newer Triton, microseconds a
    call, and a block-mask build asks on every call."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def fit_tile(tile: int, length: int, sparse: int | None) -> int:
    """``tile`` shrunk to the sequence (rounded up to a power of two) and to divide ``sparse``."""
    t = min(tile, pow2_at_least(length))
    if sparse is not None:
        t = min(t, sparse & -sparse)  # the largest power of two dividing the sparse block
    return t


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator / statistics dtype: float64 for float64 inputs (gradcheck), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def raw_scores(score, acc: torch.dtype) -> bool:
    """Whether the kernels may fold the scale into the softmax's exp2 (their SCORES_IN_BASE2): no
    score_mod, and float32 accumulators (float64 keeps the exact path: the kernels' scalar
    arithmetic is float32)."""
    return score.ir.op == "input" and acc == torch.float32 and score.score_dtype in (None, acc)


def affine_scores(score, dtype: torch.dtype, length: int) -> bool:
    """Whether the kernels take score_mod's affine form (their SCORE_AFFINE, codegen/affine.py): a
    score_mod other than the identity that has one, for 16-bit and float8 inputs, and no integer
    value of the mod can wrap at positions below ``length`` (max of Q_LEN and KV_LEN). The form's
    rounding (a few float32 ulp of |Q| times a tile's rows) is far below those inputs'; float32
    and float64 inputs keep the mod's own arithmetic."""
    form = affine.split(score.ir) if score.kind == "score" else None
    return (form is not None and score.ir.op != "input" and dtype in _AFFINE_DTYPES
            and form.exact_below(length))


_AFFINE_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def dot_precision(device: torch.device, dtype: torch.dtype) -> str:
    return "tf32" if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32 \
        else "ieee"


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          order: tuple[int, ...] | None = None, like: torch.Tensor | None = None) -> torch.Tensor:
    """Every output and scratch buffer the kernels write in full comes from here (tests fill it
    with NaN to prove that nothing is left unwritten). ``order``: dims outermost first. ``like``:
    a tensor that ``torch.empty_like`` turns into exactly this (the plan checked it): the
    cheaper call."""
    if like is not None:
        return torch.empty_like(like)
    if order is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_permuted(shape, order, dtype=dtype, device=device)


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device`` with no host sync: on CUDA through pinned
    memory and a non-blocking copy (``torch.tensor(..., device="cuda")`` copies from pageable
    memory, which waits for the stream's queued work)."""
    device = torch.device(device)
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Programs ``device`` runs at once, per wave: its streaming multiprocessors; 1 on the CPU,
    where Triton's interpreter runs one program at a time."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


# ---------------------------------------------------------------------------------------------
# Generated modules and plans


# Bound: a generated module holds its Triton kernels (and their compiled binaries once launched);
# a dropped one is imported again from the disk cache by the next plan that needs it.
_MODULES = LRU(1024)


def mod_hooks(mod, target: str, name: str, prefix: str) -> tuple[str, str]:
    """(definition, parameter list) of a mod inlined into a template."""
    src = emit.emit_mod(mod.ir, mod.kind, name, target)
    return src.source, src.param_list(prefix)


def kernel_module(template: str, key: Hashable, target: str, hooks: Callable[[], dict[str, str]],
                  provenance: Callable[[], dict[str, str]], fast_math: bool = False) -> Any:
    """The generated module of ``template`` for ``key`` (mod keys plus anything else that changes
    the source), rendered once per process and target and cached on disk. ``fast_math``: see
    `flexattn.codegen.emit.prelude`."""
    full_key = (template, key, target, fast_math)
    module = _MODULES.get(full_key)
    if module is None:
        h = hooks()
        if "prelude" not in h:
            h["prelude"] = emit.prelude(target, fast_math)
        if "tile_helpers" not in h and "$tile_helpers" in template_text(template):
            h["tile_helpers"] = template_text("tiles")
        if "gluon_tiles" not in h and "$gluon_tiles" in template_text(template):
            h["gluon_tiles"] = template_text("gluon_tiles")
        module = _MODULES.get_or_make(
            full_key, lambda: load_kernel_module(template, h, provenance(), interpret=target == "interpret"))
    return module


class PlanCache:
    """The plans of a family, least recently used dropped past ``limit``: a miss calls ``make``
    (validation, tiles, constexprs, module, tuning). Threads that miss the same key together
    wait for one ``make``: one compile and one tuning run per key."""

    def __init__(self, limit: int = 4096):
        self.plans = LRU(limit)
        self._making: dict[Hashable, threading.Lock] = {}  # key -> the lock of its ``make``
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        plan = self.plans.get(key)
        if plan is None:
            with self._lock:
                making = self._making.setdefault(key, threading.Lock())
            try:
                with making:
                    plan = self.plans.get(key)
                    if plan is None:
                        plan = make()
                        self.plans[key] = plan
            finally:
                with self._lock:
                    self._making.pop(key, None)
        return plan

    def __len__(self) -> int:
        return len(self.plans)


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, dtype=torch.int32, device=device)


class Launch:
    """One kernel launch of a plan: the Triton kernel, its grid and constexprs, and optionally
    its *fixed* arguments.

    ``fixed``, where given, is the kernel's whole argument list as the plan knows it: what every
    call of the plan passes alike (strides, sizes, `UNUSED` pointers) in place, and `PER_CALL`
    where a call supplies its own value (its tensors, a scale); a call then passes just those,
    in order. A tensor among the fixed arguments must be one the plan keeps alive (its address is
    taken once). Without ``fixed`` a call passes every argument.

    The first calls go through Triton's ``kernel[grid](...)``, which specialises every argument
    (about 0.5 µs each) and looks the compiled kernel up. After that, on the GPU, the compiled
    kernel is launched directly: the plan key fixes every integer argument, so only the tensors'
    16-byte alignment, which Triton also specialises on, can differ, and it is checked (a
    misaligned tensor takes Triton's path). The direct launch is torch's static C++ launcher
    (what torch.compile's kernels use) when it can launch the kernel and no Triton launch hook is
    set; for a kernel with TMA descriptor arguments, which it cannot launch, `TensorMapLaunch`;
    else the compiled kernel's own launcher called the way Triton calls it. With fixed
    arguments the static launcher's argument list is built once, with the fixed pointers and
    numbers in place, and a call writes its own values into a copy. If the launcher's calling
    convention is not the one expected (another Triton version), every launch takes Triton's path.

    ``describe`` (a kernel with TMA descriptor parameters, `hopper.Descriptors.describe`): a call
    passes the tensors in the descriptors' places, and a launch through Triton gets ``describe(args)``;
    `triton_launcher.TensorMapLaunch` takes the tensors as they come.
    """

    __slots__ = ("kernel", "grid", "constexprs", "device", "calls", "compiled", "launcher", "tail", "pointers",
                 "grid3", "static", "tensormaps", "fixed", "slots", "lock", "describe")

    def __init__(self, kernel, grid: tuple, constexprs: dict, device: torch.device, fixed: tuple | None = None,
                 describe: Callable[[tuple], tuple] | None = None):
        if describe is not None and fixed is not None:
            raise ValueError("a launch whose calls pass tensors for TMA descriptors takes no fixed arguments")
        self.kernel, self.grid, self.device, self.describe = kernel, tuple(grid), device, describe
        # FMA contraction, with which every kernel was tested and measured: Triton's default up to
        # 3.9, which warns that 3.10 turns the default off
        self.constexprs = {"enable_fp_fusion": True, **constexprs}
        self.grid3 = self.grid + (1,) * (3 - len(self.grid))
        self.calls = 0
        self.compiled = self.launcher = self.static = self.tensormaps = None
        self.tail = self.pointers = ()
        self.fixed = None if fixed is None else tuple(fixed)
        # positions of the per-call arguments; None: all of them
        self.slots = None if fixed is None else tuple(i for i, a in enumerate(self.fixed) if a is PER_CALL)
        self.lock = threading.Lock()

    def __call__(self, *args, stream: int | None = None) -> None:
        """Launch on the current stream with ``args`` (the per-call arguments where the launch has
        fixed ones, else all); ``stream``: its raw handle, where the caller already has it
        (`Counters` returns it), so that it is not asked for twice."""
        device = self.device
        if device.type == "cuda" and torch._C._cuda_getDevice() != device.index:
            # Triton and the direct launchers launch on the current device: make it the tensors'
            with torch.cuda.device(device):
                return self(*args, stream=stream)
        launcher = self.launcher
        if launcher is not None:
            static, tensormaps = self.static, self.tensormaps
            if static is not None and no_launch_hooks():
                run, function, (g0, g1, g2), warps, shared, types, fill = static
                flat = fill(args)
                if flat is not None:
                    if stream is None:
                        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
                    run(function, g0, g1, g2, warps, shared, types, flat, stream)
                    return
            elif tensormaps is not None and no_launch_hooks():
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(self.device.index)
                if tensormaps(args, stream):
                    return
            tensors = self._fill(self._full(args))
            args = self._described(tensors)
            for i in self.pointers:
                if args[i].data_ptr() & 15:
                    break
            else:
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(self.device.index)
                triton_launcher.call(self.launcher, self.compiled, self.grid, self.grid3, stream,
                                     (*args, *self.tail))
                return
        else:
            tensors = self._fill(self._full(args))
            args = self._described(tensors)
        # Triton's interpreter is not thread-safe: one interpreted launch at a time. On the GPU
        # the first calls compile and record the launcher once, also when threads make them at once.
        with INTERPRETER_LOCK if self.device.type == "cpu" else self.lock:
            self.calls += 1
            if self.calls == 2 and self.device.type == "cuda" and triton_launcher.AVAILABLE:
                self._capture(args, tensors)
            elif self.calls == 1:
                self._first(args)
            else:
                self.kernel[self.grid](*args, **self.constexprs)

    def _first(self, args) -> None:
        """The first launch, which compiles the kernel. A Triton kernel whose shared memory passes
        the GPU's limit (what a mod's gathers and layout changes need adds to the tiles' pipeline
        buffers, so a config can fit one mod and not another) is compiled again with one
        pipelining stage fewer, down to one: stages change the speed, never the result."""
        while True:
            try:
                self.kernel[self.grid](*args, **self.constexprs)
                return
            except OutOfResources as err:
                stages = self.constexprs.get("num_stages", 1)
                if err.name != "shared memory" or stages <= 1:
                    raise
                self.constexprs = {**self.constexprs, "num_stages": stages - 1}
            except InterpreterError as err:
                if "only 0-dimensional arrays can be converted" not in str(err):
                    raise
                raise RuntimeError(
                    f"flexattn runs CPU tensors through Triton's interpreter, and triton "
                    f"{triton.__version__}'s interpreter turns one-element arrays into Python ints, which "
                    f"numpy {numpy.__version__} refuses (numpy 2.4 and newer): install 'numpy<2.4' or a "
                    f"newer triton (3.9 works), or run on a CUDA device") from err

    def _full(self, args) -> tuple:
        """Every argument of the kernel: the per-call ``args`` in the fixed ones' `PER_CALL` slots."""
        if self.slots is None:
            return args
        if len(args) != len(self.slots):
            raise TypeError(f"this launch takes {len(self.slots)} per-call arguments, got {len(args)}")
        full = list(self.fixed)
        for i, a in zip(self.slots, args):
            full[i] = a
        return tuple(full)

    def _capture(self, args, tensors) -> None:
        """Plan the direct launch from one more launch through Triton (`triton_launcher.capture`);
        ``tensors``: ``args`` before `describe`."""
        direct = triton_launcher.capture(self.kernel, self.grid, self.constexprs, args, self.slots,
                                         _placeholder(self.device),
                                         torch._C._cuda_getCurrentRawStream(self.device.index),
                                         tensors, self.describe)
        if direct is not None:
            self.compiled, self.launcher, self.tail, self.pointers, self.static, self.tensormaps = direct

    def _described(self, args) -> tuple:
        return args if self.describe is None else self.describe(args)

    def _fill(self, args) -> tuple:
        """``args`` with `UNUSED` replaced by a placeholder tensor (Triton types pointers by tensor)."""
        for a in args:
            if a is UNUSED:
                dummy = _placeholder(self.device)
                return tuple([dummy if a is UNUSED else a for a in args])
        return args


def buffer_args(mod, buffers) -> list:
    """Kernel arguments (pointer, strides, sizes) for the tensors ``mod`` captured in this call."""
    return emit.launch_args(mod.buffer_specs, buffers) if buffers else []
