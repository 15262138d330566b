"""Triton's launcher of a compiled kernel, from the inside: everything in flexattn that relies
on how Triton (3.x) and torch lay out their launchers, in one place.

A launch site's first calls go through ``kernel[grid](...)``; `capture` then records, from one
more such launch, how Triton calls the compiled kernel's launcher, and plans a direct launch:
torch's static C++ launcher (`static_plan`), or for a kernel with TMA descriptor arguments
`TensorMapLaunch`, which calls the C function behind Triton's launcher. What this relies on
(checked without a GPU by tests/test_triton_launcher.py, so that a Triton that changes it
fails there, not silently here): the launcher's argument layout ``(grid x3, stream, function,
packed metadata, launch metadata, enter hook, exit hook, *args)``; the compiled kernel's
``_init_handles``, ``run`` or ``_run``, ``function``, ``packed_metadata``, ``launch_metadata``,
``metadata`` and ``src`` (``fn.arg_names``, ``signature``, ``constants``); the descriptor
expanding wrapper ``launcher.launch`` with its ``launcher`` closure cell, its
``tensordesc_meta`` cell and its module's ``make_tensordesc_arg``; `triton.knobs`' launch
hooks; torch's ``_StaticCudaLauncher._launch_kernel``. Where the recorded call does not have
the layout expected, no direct launch is planned and every launch keeps Triton's path.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable

import torch

try:  # triton >= 3.4: the launch hooks the direct launch passes on, as Triton does
    from triton import knobs as _knobs
except ImportError:  # older triton: every launch goes through kernel[grid](...)
    _knobs = None

from flexattn.kernels.arguments import UNUSED

AVAILABLE = _knobs is not None  # a direct launch can pass Triton's launch hooks on


def capture(kernel, grid: tuple, constexprs: dict, args: tuple, slots, placeholder: torch.Tensor,
            stream: int, tensors: tuple | None = None, describe: Callable | None = None) -> tuple | None:
    """Launch ``kernel[grid](*args, **constexprs)`` once more on ``stream``, recording how Triton
    calls the compiled kernel's launcher: ``(compiled, launcher, tail, pointers, static,
    tensormaps)`` for the direct launch (``tail``: the launcher's arguments after the kernel's;
    ``pointers``: the positions of tensors; ``static``: `static_plan`; ``tensormaps``: a
    `TensorMapLaunch`), or None where the recorded call does not have the layout expected.
    ``slots``: the positions of the arguments a call supplies (None: all of them). ``tensors``:
    the call's arguments with tensors where ``args`` has TMA descriptors, made by ``describe``
    (`launch.Launch`)."""
    compiled = kernel.warmup(*args, grid=grid, **constexprs)
    compiled._init_handles()
    attr = "_run" if "_run" in vars(compiled) else "run"
    launcher = getattr(compiled, attr)
    seen, seen_raw = [], []

    def spy(*a):
        seen.append(a)
        return launcher(*a)

    # (a kernel with TMA descriptors: also how the launcher calls its C function once it has
    # expanded them)
    cell = (raw_launch_cell(launcher) if getattr(compiled.metadata, "tensordesc_meta", None)
            and descriptor_launch_supported() else None)
    raw = None if cell is None else cell.cell_contents

    def raw_spy(*a):
        seen_raw.append(a)
        return raw(*a)

    setattr(compiled, attr, spy)
    if cell is not None:
        cell.cell_contents = raw_spy
    try:
        kernel[grid](*args, **constexprs)
    finally:
        setattr(compiled, attr, launcher)
        if cell is not None:
            cell.cell_contents = raw
    if len(seen) != 1:
        return None
    # (grid x3, stream, function, packed metadata, launch metadata, enter hook, exit hook, *args,
    # *constexprs)
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    a, n = seen[0], len(args)
    ok = (len(a) >= 9 + n and tuple(a[:3]) == grid3 and a[3] == stream
          and a[4] is compiled.function and a[5] is compiled.packed_metadata
          and all(x is y for x, y in zip(a[9:9 + n], args))
          and all(t.data_ptr() % 16 == 0 for t in args if isinstance(t, torch.Tensor)))
    if not ok:
        return None
    tail = a[9 + n:]
    pointers = tuple(i for i, t in enumerate(args) if isinstance(t, torch.Tensor))
    static = static_plan(compiled, args, grid3, slots, placeholder)
    tensormaps = None
    if static is None and len(seen_raw) == 1 and no_launch_hooks():
        tensormaps = TensorMapLaunch.plan(compiled, launcher.launch, raw, seen_raw[0], (*args, *tail), n, slots,
                                          grid3, stream, tensors, describe)
    return compiled, launcher, tail, pointers, static, tensormaps


def call(launcher, compiled, grid: tuple, grid3: tuple, stream: int, args: tuple) -> None:
    """Call the compiled kernel's own launcher the way Triton calls it (``args``: the kernel's
    arguments and the recorded tail)."""
    launcher(*grid3, stream, compiled.function, compiled.packed_metadata,
             compiled.launch_metadata(grid, stream, *args),
             _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *args)


# Triton argument types -> the type codes of torch's static CUDA launcher (the launcher
# torch.compile uses for Triton kernels: one C++ call, no Python per argument).
_STATIC_TYPES = {"i1": "i", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "I", "u8": "B", "u16": "H",
                 "u32": "I", "u64": "K", "fp16": "f", "bf16": "f", "fp32": "f", "f32": "f", "fp64": "d"}


def _static_launcher():
    """torch's C++ launcher of compiled Triton kernels, or None (no CUDA build, older torch)."""
    launcher = getattr(torch._C, "_StaticCudaLauncher", None)
    return None if torch.version.hip else getattr(launcher, "_launch_kernel", None)


def no_launch_hooks() -> bool:
    """No Triton launch hook is set (a hook is None, or an empty ``HookChain`` in newer Triton)."""
    runtime = _knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def raw_launch_cell(launcher):
    """The closure cell of the C function that Triton's launcher of a kernel with TMA descriptor
    arguments calls once its Python wrapper (``launcher.launch``, triton 3.x) has expanded them,
    or None."""
    inner = getattr(launcher, "launch", None)
    code, cells = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
    if code is None or not cells:
        return None
    cell = dict(zip(code.co_freevars, cells)).get("launcher")
    return cell if cell is not None and callable(cell.cell_contents) else None


@functools.lru_cache(maxsize=None)
def descriptor_launch_supported() -> bool:
    """Whether the installed Triton's descriptor-expanding wrapper has the layout `TensorMapLaunch`
    reads (Triton 3.6's: the C function in a ``launcher`` cell, the metadata in a
    ``tensordesc_meta`` cell, the encoder ``make_tensordesc_arg`` a global of its module). Where it
    has not (Triton 3.7 and newer keep the encoder in a cell and pass the kernel's arguments as
    one tuple), kernels with TMA descriptors launch through Triton's launcher (`call`)."""
    try:
        from triton.backends.nvidia.driver import wrap_handle_tensordesc
    except ImportError:  # (a Triton without its CUDA backend: no Hopper kernels to launch)
        return False

    def raw(*args):
        return args

    wrapper = wrap_handle_tensordesc(raw, {"desc": "tensordesc<bf16[64,16]>", "n": "i32"}, [{"swizzle": 3}])
    cell = raw_launch_cell(type("Launcher", (), {"launch": staticmethod(wrapper)}))
    return (cell is not None and cell.cell_contents is raw
            and "tensordesc_meta" in wrapper.__code__.co_freevars
            and callable(wrapper.__globals__.get("make_tensordesc_arg")))


class TensorMapLaunch:
    """The direct launch of a kernel with TMA descriptor arguments (the Hopper kernels), which
    torch's static launcher cannot launch.

    Triton's launcher (triton 3.6, torch 2.11's) expands each descriptor in Python on every call:
    it encodes the descriptor's CUtensorMap and spreads its shape and strides, then its C function
    parses ~100 arguments: a Hopper forward's launch took 24-35 µs of the H100's host, this one
    11 µs (python -m benchmarks host). A plan fixes every descriptor's shape, strides, block and
    swizzle, so a descriptor's map depends on its tensor's address only: this keeps each
    descriptor's maps by address (a loop's tensors come back to the same few addresses from the
    caching allocator), encodes one for a new address with Triton's own function, and writes a
    call's values into a copy of the C function's arguments recorded from Triton's launch
    (pointers as integers, which it takes without a driver query). A call passes tensors in the
    descriptors' places (`launch.Launch`'s ``describe``): no descriptor object is built unless a
    new address needs its map.

    `plan` builds one where the recorded arguments have the layout it knows (the launch's fixed
    arguments, then the kernel's arguments with each descriptor expanded in place to its map, shape
    and strides) and re-encoding the recorded descriptors gives their recorded shapes and strides;
    else None, and the launch keeps Triton's launcher."""

    __slots__ = ("raw", "template", "pointers", "values", "descriptors", "make", "describe")

    MAPS_PER_DESCRIPTOR = 64  # addresses kept per descriptor before its maps are dropped

    def __init__(self, raw, template, pointers, values, descriptors, make, describe):
        self.raw, self.template, self.make, self.describe = raw, template, make, describe
        self.pointers = pointers        # ((call argument, template position), ...): tensors
        self.values = values            # the same for numbers
        # (call argument, template position of its map, the tensor's shape and strides, Triton's
        # metadata, {address: map})
        self.descriptors = descriptors

    @classmethod
    def plan(cls, compiled, wrapper, raw, recorded: tuple, args: tuple, n: int, slots, grid3: tuple,
             stream: int, tensors: tuple | None, describe: Callable | None) -> "TensorMapLaunch | None":
        """From the C function's arguments ``recorded`` in Triton's launch of ``compiled`` on
        ``grid3`` and ``stream`` with ``args`` (with its constexprs; the first ``n`` are the
        kernel's arguments): the direct launch, or None. ``wrapper``: the launcher's
        descriptor-expanding wrapper, whose metadata and encoder this reuses; ``slots``: the
        positions of the arguments a call supplies (None: all ``n``); ``tensors``: ``args`` with
        the tensors that ``describe`` turned into its descriptors (None where a call passes the
        descriptors themselves: then no direct launch)."""
        if tensors is None or describe is None or slots is not None:
            return None
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
                d, t, m = args[i], tensors[i], metas[descriptor_of[i]]
                if not isinstance(t, torch.Tensor) or t.data_ptr() != d.base.data_ptr():
                    return None
                try:
                    tensor_map, *rest = make(d, m)
                except TypeError:  # (another encoder signature)
                    return None
                if type(tensor_map) is not type(recorded[k]) or rest != [*d.shape, *d.strides]:
                    return None
                descriptors.append((j, k, tuple(t.shape), t.stride(), m, {t.data_ptr(): tensor_map}))
            elif isinstance(args[i], torch.Tensor):
                pointers.append((j, k))
                template[k] = 0  # (a call writes its own; the recorded tensor must not be kept alive)
            elif type(args[i]) in (int, float, bool):
                values.append((j, k))
            else:
                return None
        return cls(raw, template, tuple(pointers), tuple(values), tuple(descriptors), make, describe)

    def __call__(self, args, stream: int) -> bool:
        """Launch with a call's ``args`` (tensors in the descriptors' places) on ``stream``; False
        (nothing launched) where a tensor is not 16-byte aligned or a descriptor's tensor has
        other shape or strides than the plan's."""
        flat = self.template.copy()
        flat[3] = stream
        if not _put_addresses(flat, args, self.pointers):
            return False
        for j, k in self.values:
            flat[k] = args[j]
        described = None
        for j, k, shape, strides, meta, maps in self.descriptors:
            t = args[j]
            if t.shape != shape or t.stride() != strides:
                return False
            ptr = t.data_ptr()
            tensor_map = maps.get(ptr)
            if tensor_map is None:
                if ptr & 15:
                    return False
                if len(maps) >= self.MAPS_PER_DESCRIPTOR:
                    maps.clear()
                if described is None:
                    described = self.describe(args)
                tensor_map = maps[ptr] = self.make(described[j], meta)[0]
            flat[k] = tensor_map
        self.raw(*flat)
        return True


def static_plan(compiled, args, grid3, slots, placeholder) -> tuple | None:
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
        fill = fill_all(keep, pointer, tuple(extra))
    else:
        where = {i: k for k, i in enumerate(keep)}
        if any(i not in where for i in slots):
            return None  # a per-call argument Triton specialised away: only the general paths
        template = [0 if args[i] is placeholder else args[i].data_ptr() if i in pointer else args[i]
                    for i in keep] + extra
        fill = fill_slots(template, tuple((where[i], i in pointer) for i in slots))
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


def fill_all(keep: list[int], pointer: set[int], extra: tuple) -> Callable:
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


def fill_slots(template: list, slots: tuple[tuple[int, bool], ...]) -> Callable:
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
