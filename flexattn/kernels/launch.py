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
import operator
from typing import Any, Callable, Hashable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError, OutOfResources

try:  # triton >= 3.4: the launch hooks the direct launch passes on, as Triton does
    from triton import knobs as _knobs
except ImportError:  # older triton: every launch goes through kernel[grid](...)
    _knobs = None

from flexattn.codegen import emit
from flexattn.codegen.render import load_kernel_module, template_text

LARGE_BLOCK = 1 << 30  # a sparse block size meaning "one block covers the whole sequence" (no block mask)
ACC_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}  # accumulator dtypes


def target_for(device: torch.device) -> str:
    """Codegen target for tensors on ``device``: CPU tensors run through Triton's interpreter."""
    return "interpret" if device.type == "cpu" else "cuda"


def pow2_at_least(n: int, floor: int = 16) -> int:
    """The next power of two >= ``n`` and >= ``floor`` (tl.arange / tl.dot shapes)."""
    return max(floor, triton.next_power_of_2(n))


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
    form = score.affine
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


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter runs programs one by one; a couple of splits keeps tests honest


# ---------------------------------------------------------------------------------------------
# Generated modules and plans


_MODULES: dict[Hashable, Any] = {}


def mod_hooks(mod, target: str, name: str, prefix: str) -> tuple[str, str]:
    """(definition, parameter list) of a mod inlined into a template."""
    src = mod.emit(target, name)
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
        module = load_kernel_module(template, h, provenance(), interpret=target == "interpret")
        _MODULES[full_key] = module
    return module


class PlanCache:
    """A bounded dict of plans: a miss calls ``make`` (validation, tiles, constexprs, module)."""

    def __init__(self, limit: int = 4096):
        self.plans: dict[Hashable, Any] = {}
        self.limit = limit

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        plan = self.plans.get(key)
        if plan is None:
            plan = make()
            if len(self.plans) >= self.limit:
                self.plans.clear()
            self.plans[key] = plan
        return plan

    def __len__(self) -> int:
        return len(self.plans)


# Triton argument types -> the type codes of torch's static CUDA launcher (the launcher
# torch.compile uses for Triton kernels: one C++ call, no Python per argument).
_STATIC_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
                 "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}


def _static_launcher():
    """torch's C++ launcher of compiled Triton kernels, or None (no CUDA build, older torch)."""
    launcher = getattr(torch._C, "_StaticCudaLauncher", None)
    return None if torch.version.hip else getattr(launcher, "_launch_kernel", None)


def _no_launch_hooks() -> bool:
    """No Triton launch hook is set (a hook is None, or an empty ``HookChain`` in newer Triton)."""
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class _Unused:
    """A pointer argument the kernel does not read in this plan (its constexprs switch the read
    off): `UNUSED`. Cheaper than a tensor on the hot path (no ``data_ptr`` call)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNUSED"


UNUSED = _Unused()


class _PerCall:
    """In a launch's fixed arguments: a slot each call fills (`PER_CALL`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PER_CALL"


PER_CALL = _PerCall()


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
    """

    __slots__ = ("kernel", "grid", "constexprs", "device", "calls", "compiled", "launcher", "tail", "pointers",
                 "grid3", "static", "tensormaps", "fixed", "slots")

    def __init__(self, kernel, grid: tuple, constexprs: dict, device: torch.device, fixed: tuple | None = None):
        # FMA contraction, with which every kernel was tested and measured: Triton's default up to
        # 3.9, which warns that 3.10 turns the default off
        self.kernel, self.grid, self.device = kernel, tuple(grid), device
        self.constexprs = {"enable_fp_fusion": True, **constexprs}
        self.grid3 = self.grid + (1,) * (3 - len(self.grid))
        self.calls = 0
        self.compiled = self.launcher = self.static = self.tensormaps = None
        self.tail = self.pointers = ()
        self.fixed = None if fixed is None else tuple(fixed)
        # positions of the per-call arguments; None: all of them
        self.slots = None if fixed is None else tuple(i for i, a in enumerate(self.fixed) if a is PER_CALL)

    def __call__(self, *args, stream: int | None = None) -> None:
        """Launch on the current stream with ``args`` (the per-call arguments where the launch has
        fixed ones, else all); ``stream``: its raw handle, where the caller already has it
        (`Counters` returns it), so that it is not asked for twice."""
        launcher = self.launcher
        if launcher is not None:
            static, tensormaps = self.static, self.tensormaps
            if static is not None and _no_launch_hooks():
                run, function, (g0, g1, g2), warps, shared, types, fill = static
                flat = fill(args)
                if flat is not None:
                    if stream is None:
                        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
                    run(function, g0, g1, g2, warps, shared, types, flat, stream)
                    return
            elif tensormaps is not None and _no_launch_hooks():
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(self.device.index)
                if tensormaps(args, stream):
                    return
            args = self._fill(self._full(args))
            for i in self.pointers:
                if args[i].data_ptr() & 15:
                    break
            else:
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(self.device.index)
                compiled, (g0, g1, g2) = self.compiled, self.grid3
                args = (*args, *self.tail)
                launcher(g0, g1, g2, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(self.grid, stream, *args),
                         _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *args)
                return
        else:
            args = self._fill(self._full(args))
        self.calls += 1
        if self.calls == 2 and self.device.type == "cuda" and _knobs is not None:
            self._capture(args)
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
                import numpy

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

    def _fill(self, args) -> tuple:
        """``args`` with `UNUSED` replaced by a placeholder tensor (Triton types pointers by tensor)."""
        for a in args:
            if a is UNUSED:
                dummy = _placeholder(self.device)
                return tuple([dummy if a is UNUSED else a for a in args])
        return args

    def _capture(self, args) -> None:
        """Launch through Triton once more, recording how it calls the compiled kernel's launcher."""
        compiled = self.kernel.warmup(*args, grid=self.grid, **self.constexprs)
        compiled._init_handles()
        attr = "_run" if "_run" in vars(compiled) else "run"
        launcher = getattr(compiled, attr)
        seen, seen_raw = [], []

        def spy(*a):
            seen.append(a)
            return launcher(*a)

        # (a kernel with TMA descriptors: also how the launcher calls its C function once it has
        # expanded them)
        cell = _raw_launch_cell(launcher) if getattr(compiled.metadata, "tensordesc_meta", None) else None
        raw = None if cell is None else cell.cell_contents

        def raw_spy(*a):
            seen_raw.append(a)
            return raw(*a)

        setattr(compiled, attr, spy)
        if cell is not None:
            cell.cell_contents = raw_spy
        try:
            self.kernel[self.grid](*args, **self.constexprs)
        finally:
            setattr(compiled, attr, launcher)
            if cell is not None:
                cell.cell_contents = raw
        if len(seen) != 1:
            return
        # triton 3.x: (grid x3, stream, function, packed metadata, launch metadata, enter hook,
        # exit hook, *args, *constexprs)
        a, n = seen[0], len(args)
        ok = (len(a) >= 9 + n and tuple(a[:3]) == self.grid3
              and a[3] == torch._C._cuda_getCurrentRawStream(self.device.index)
              and a[4] is compiled.function and a[5] is compiled.packed_metadata
              and all(x is y for x, y in zip(a[9:9 + n], args))
              and all(t.data_ptr() % 16 == 0 for t in args if isinstance(t, torch.Tensor)))
        if ok:
            self.compiled, self.tail = compiled, a[9 + n:]
            self.pointers = tuple(i for i, t in enumerate(args) if isinstance(t, torch.Tensor))
            self.launcher = launcher
            self.static = _static_plan(compiled, args, self.grid3, self.slots, _placeholder(self.device))
            if self.static is None and len(seen_raw) == 1 and _no_launch_hooks():
                self.tensormaps = TensorMapLaunch.plan(compiled, launcher.launch, raw, seen_raw[0],
                                                       (*args, *self.tail), len(args), self.slots, self.grid3,
                                                       a[3])


def _raw_launch_cell(launcher):
    """The closure cell of the C function that Triton's launcher of a kernel with TMA descriptor
    arguments calls once its Python wrapper (``launcher.launch``, triton 3.x) has expanded them,
    or None."""
    inner = getattr(launcher, "launch", None)
    code, cells = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
    if code is None or not cells:
        return None
    cell = dict(zip(code.co_freevars, cells)).get("launcher")
    return cell if cell is not None and callable(cell.cell_contents) else None


class TensorMapLaunch:
    """The direct launch of a kernel with TMA descriptor arguments (the Hopper kernels), which
    torch's static launcher cannot launch.

    Triton's launcher (triton 3.6, torch 2.11's) expands each descriptor in Python on every call:
    it encodes the descriptor's CUtensorMap and spreads its shape and strides, then its C function
    parses ~100 arguments: a Hopper forward's launch took 24-35 µs of the H100's host, this one
    11 µs (docs/performance.md). A plan fixes every descriptor's shape, strides, block and
    swizzle, so a descriptor's map depends on its tensor's address only: this keeps each
    descriptor's maps by address (a loop's tensors come back to the same few addresses from the
    caching allocator), encodes one for a new address with Triton's own function, and writes a
    call's values into a copy of the C function's arguments recorded from Triton's launch
    (pointers as integers, which it takes without a driver query).

    `plan` builds one where the recorded arguments have the layout it knows (the launch's fixed
    arguments, then the kernel's arguments with each descriptor expanded in place to its map, shape
    and strides) and re-encoding the recorded descriptors gives their recorded shapes and strides;
    else None, and the launch keeps Triton's launcher."""

    __slots__ = ("raw", "template", "pointers", "values", "descriptors", "make")

    MAPS_PER_DESCRIPTOR = 64  # addresses kept per descriptor before its maps are dropped

    def __init__(self, raw, template, pointers, values, descriptors, make):
        self.raw, self.template, self.make = raw, template, make
        self.pointers = pointers        # ((call argument, template position), ...): tensors
        self.values = values            # the same for numbers
        # (call argument, template position of its map, shape, strides, Triton's metadata, {address: map})
        self.descriptors = descriptors

    @classmethod
    def plan(cls, compiled, wrapper, raw, recorded: tuple, args: tuple, n: int, slots, grid3: tuple,
             stream: int) -> "TensorMapLaunch | None":
        """From the C function's arguments ``recorded`` in Triton's launch of ``compiled`` on
        ``grid3`` and ``stream`` with ``args`` (with its constexprs; the first ``n`` are the
        kernel's arguments): the direct launch, or None. ``wrapper``: the launcher's
        descriptor-expanding wrapper, whose metadata and encoder this reuses; ``slots``: the
        positions of the arguments a call supplies (None: all ``n``)."""
        meta = compiled.metadata
        if any(getattr(meta, size, 0) for size in ("global_scratch_size", "profile_scratch_size")):
            return None  # (scratch Triton's launcher allocates per call)
        kinds = list(compiled.src.signature.values())
        cells = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__)))
        metas = cells.get("tensordesc_meta")
        make = wrapper.__globals__.get("make_tensordesc_arg")
        if len(kinds) != len(args) or make is None or not isinstance(metas, (list, tuple)) or None in metas:
            return None
        expanded, where = [], {}  # the kernel's arguments as the C function takes them; where each starts
        descriptor_of = {}
        for i, (a, kind) in enumerate(zip(args, kinds)):
            where[i] = len(expanded)
            if isinstance(kind, str) and kind.startswith("tensordesc"):
                descriptor_of[i] = len(descriptor_of)
                expanded += [None, *a.shape, *a.strides]
            else:
                expanded.append(a)
        base = len(recorded) - len(expanded)
        if base < 4 or len(descriptor_of) != len(metas):
            return None
        for e, r in zip(expanded, recorded[base:]):
            if e is None:
                if type(r).__name__ != "PyCUtensorMap":
                    return None
            elif not (r is e or (type(r) is int and type(e) is int and r == e)):
                return None
        if tuple(recorded[:3]) != grid3 or recorded[3] != stream:
            return None
        template = list(recorded)
        per_call = range(n) if slots is None else slots
        for i in set(range(n)) - set(per_call):  # fixed tensors (the plan keeps them) as addresses
            if isinstance(args[i], torch.Tensor):
                template[base + where[i]] = args[i].data_ptr()
        pointers, values, descriptors = [], [], []
        for j, i in enumerate(per_call):
            k = base + where[i]
            if i in descriptor_of:
                d, m = args[i], metas[descriptor_of[i]]
                try:
                    tensor_map, *rest = make(d, m)
                except TypeError:  # (another encoder signature)
                    return None
                if type(tensor_map) is not type(recorded[k]) or rest != [*d.shape, *d.strides]:
                    return None
                descriptors.append((j, k, list(d.shape), list(d.strides), m, {d.base.data_ptr(): tensor_map}))
            elif isinstance(args[i], torch.Tensor):
                pointers.append((j, k))
            elif type(args[i]) in (int, float, bool):
                values.append((j, k))
            else:
                return None
        return cls(raw, template, tuple(pointers), tuple(values), tuple(descriptors), make)

    def __call__(self, args, stream: int) -> bool:
        """Launch with a call's ``args`` on ``stream``; False (nothing launched) where a tensor is
        not 16-byte aligned or a descriptor's shape or strides are not the plan's."""
        flat = self.template.copy()
        flat[3] = stream
        if not _put_addresses(flat, args, self.pointers):
            return False
        for j, k in self.values:
            flat[k] = args[j]
        for j, k, shape, strides, meta, maps in self.descriptors:
            d = args[j]
            if d.shape != shape or d.strides != strides:
                return False
            ptr = d.base.data_ptr()
            tensor_map = maps.get(ptr)
            if tensor_map is None:
                if ptr & 15:
                    return False
                if len(maps) >= self.MAPS_PER_DESCRIPTOR:
                    maps.clear()
                tensor_map = maps[ptr] = self.make(d, meta)[0]
            flat[k] = tensor_map
        self.raw(*flat)
        return True


def _static_plan(compiled, args, grid3, slots, placeholder) -> tuple | None:
    """How torch's static launcher launches ``compiled`` with call arguments like ``args`` (all
    of them; ``slots``: the positions a call supplies, None for all): ``(launch, function, grid,
    num_warps, shared, type codes, fill)``, where ``fill(call args)`` is the launcher's argument
    tuple, or None where a tensor is not 16-byte aligned. None where the static launcher cannot
    launch the kernel (TMA descriptors, clusters, cooperative or PDL launches, global scratch, an
    argument type it has no code for)."""
    run = _static_launcher()
    meta = compiled.metadata
    if run is None or getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False) \
            or getattr(meta, "launch_pdl", False) or getattr(meta, "tensordesc_meta", None):
        return None
    src = compiled.src
    names = src.fn.arg_names
    constants = {names.index(k) if isinstance(k, str) else k[0] for k in getattr(src, "constants", {})}
    signature = {names.index(k) if isinstance(k, str) else (k[0] if isinstance(k, tuple) else k): v
                 for k, v in src.signature.items()}
    keep, types = [], []
    for i in range(len(args)):
        ty = signature.get(i)
        if ty is None or ty == "constexpr" or i in constants:
            continue
        if not isinstance(ty, str):
            return None
        code = "O" if ty.startswith("*") else _STATIC_TYPES.get(ty)
        if code is None:
            return None
        keep.append(i)
        types.append(code)
    # Parameters past the call's arguments must all be declared constexprs.
    if any(v != "constexpr" and i not in constants for i, v in signature.items() if i >= len(args)):
        return None
    extra = []
    for size in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(meta, size):
            if getattr(meta, size):
                return None
            extra.append(None)
            types.append("O")
    # Pointers go as integers: torch's launcher then skips its per-pointer driver query; where the
    # kernel reads nothing (the placeholder of an UNUSED pointer), 0.
    pointer = {i for i in keep if isinstance(args[i], torch.Tensor)}
    if slots is None:
        fill = _fill_all(keep, pointer, tuple(extra))
    else:
        where = {i: k for k, i in enumerate(keep)}
        if any(i not in where for i in slots):
            return None  # a per-call argument Triton specialised away: only the general paths
        template = [0 if args[i] is placeholder else args[i].data_ptr() if i in pointer else args[i]
                    for i in keep] + extra
        fill = _fill_slots(template, tuple((where[i], i in pointer) for i in slots))
    return (run, compiled.function, grid3, meta.num_warps, meta.shared, "".join(types), fill)


def _put_addresses(flat: list, args, pairs) -> bool:
    """``flat[k]`` = the address of ``args[j]`` for each ``(j, k)`` of ``pairs`` (`UNUSED`: 0);
    False where one is not 16-byte aligned (Triton specialises on that)."""
    for j, k in pairs:
        a = args[j]
        if a is UNUSED:
            flat[k] = 0
            continue
        ptr = flat[k] = a.data_ptr()
        if ptr & 15:
            return False
    return True


def _fill_all(keep: list[int], pointer: set[int], extra: tuple) -> Callable:
    """The static launcher's arguments from all of a call's: the kept ones, pointers as integers."""
    pointers = tuple((i, i) for i in sorted(pointer))
    if len(keep) < 2:
        pick = lambda flat: tuple(flat[i] for i in keep)  # noqa: E731
    else:
        pick = operator.itemgetter(*keep)  # a tuple of the kept ones

    def fill(args):
        flat = list(args)
        if not _put_addresses(flat, args, pointers):
            return None
        return pick(flat) + extra

    return fill


def _fill_slots(template: list, slots: tuple[tuple[int, bool], ...]) -> Callable:
    """The static launcher's arguments: ``template`` with a call's own values in ``slots``
    ((position, is a pointer) of each per-call argument)."""

    pointers = tuple((j, k) for j, (k, is_pointer) in enumerate(slots) if is_pointer)
    values = tuple((j, k) for j, (k, is_pointer) in enumerate(slots) if not is_pointer)

    def fill(args):
        out = template.copy()
        if not _put_addresses(out, args, pointers):
            return None
        for j, k in values:
            out[k] = args[j]
        return tuple(out)

    return fill


def recorded_launches(run: Callable[[], Any]) -> list[tuple[Launch, tuple]]:
    """``[(launch site, its arguments)]`` for every launch one call of ``run`` makes, in order
    (benchmarks and tests look at what a call launches)."""
    seen, real = [], Launch.__call__

    def spy(self, *args, **kwargs):
        seen.append((self, args))
        return real(self, *args, **kwargs)

    Launch.__call__ = spy
    try:
        run()
    finally:
        Launch.__call__ = real
    return seen


def buffer_args(mod, buffers) -> list:
    """Kernel arguments (pointer, strides, sizes) for the tensors ``mod`` captured in this call."""
    return emit.launch_args(mod.buffer_specs, buffers) if buffers else []
