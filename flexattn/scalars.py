"""Python numbers that change: from compiled-in constants to kernel arguments.

A Python mod reads numbers from its closure cells, its defaults and the module globals it names
(a decoding position, a temperature). At first they are constants of the kernel (folded into its
code). When a mod's code is seen again (a fingerprint miss) with another value in one of those
*slots*, the slot becomes *dynamic* for that code, as torch.compile's automatic dynamic shapes do:
from then on each call passes the slot's current value as a 0-d tensor, which the mod's IR reads
as a captured tensor (a buffer load with no index). The kernel, its plan and its key then no
longer depend on the value, so a loop over positions compiles one more kernel and no other.

    value -> tensor: bool -> bool; int -> int32 (int64 beyond int32's range); float -> the
    score dtype (float32, or float64 for float64 inputs); an int beyond int64's range has no
    tensor: that call reads it as a constant, as the first one did (`passable`)

A slot whose value the mod uses as a Python number (``range(n)``, ``if flag:``, ``math.exp(t)``)
cannot be a tensor: tracing with it fails, and the slot stays a constant of that code (*pinned*).
Numbers deeper in what a mod reads (attributes, containers, helper functions) stay constants.

Block masks read a dynamic value per call like any captured tensor: the interval analysis
bounds it by its current value, so no tile is decided by a stale constant.
"""

from __future__ import annotations

import math
import threading
import types

import torch

from flexattn.lru import LRU

# A slot: ("cell", i), ("default", i), ("kwdefault", name) or ("global", name) of a function.
Slot = tuple

_NUMBERS = (bool, int, float)
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class _Record:
    """What is known of one code object's number slots."""

    __slots__ = ("first", "dynamic", "pinned")

    def __init__(self, first: dict):
        self.first = first  # slot -> the value the first miss saw
        self.dynamic: tuple[Slot, ...] = ()
        self.pinned: set[Slot] = set()  # slots that failed to trace as tensors


# Code object -> _Record. Bound: a record costs a few hundred bytes; a code object dropped from it
# starts again with its values as constants.
_RECORDS = LRU(4096)
_LOCK = threading.Lock()  # one update of a record at a time


def numbers_of(fn: types.FunctionType, global_names: tuple[str, ...]) -> dict[Slot, object]:
    """The Python numbers (bool, int, float) in ``fn``'s closure cells, defaults and the globals
    ``global_names`` its code names."""
    found: dict[Slot, object] = {}
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if type(v) in _NUMBERS:
            found[("cell", i)] = v
    for i, v in enumerate(fn.__defaults__ or ()):
        if type(v) in _NUMBERS:
            found[("default", i)] = v
    for k, v in (fn.__kwdefaults__ or {}).items():
        if type(v) in _NUMBERS:
            found[("kwdefault", k)] = v
    g = fn.__globals__
    for name in global_names:
        v = g.get(name)
        if type(v) in _NUMBERS:
            found[("global", name)] = v
    return found


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b) or (a != a and b != b)
    return a == b


def dynamic_slots(code: types.CodeType) -> tuple[Slot, ...]:
    """The slots of ``code`` whose numbers are passed at run time (empty: all are constants)."""
    record = _RECORDS.get(code)
    return () if record is None else record.dynamic


def observe(fn: types.FunctionType, global_names: tuple[str, ...]) -> bool:
    """Record the numbers ``fn`` reads (called on a fingerprint miss); True when a slot's value
    differs from the first one seen for this code, which makes that slot dynamic."""
    numbers = numbers_of(fn, global_names)
    with _LOCK:
        record = _RECORDS.get(fn.__code__)
        if record is None:
            _RECORDS[fn.__code__] = _Record(numbers)
            return False
        changed = [s for s, v in numbers.items()
                   if s in record.first and s not in record.pinned and s not in record.dynamic
                   and not _same(record.first[s], v)]
        if changed:
            record.dynamic = record.dynamic + tuple(changed)
        return bool(changed)


def pin(code: types.CodeType) -> None:
    """The dynamic slots of ``code`` could not be traced as tensors: they stay constants."""
    with _LOCK:
        record = _RECORDS.get(code)
        if record is not None:
            record.pinned.update(record.dynamic)
            record.dynamic = ()


def passable(v) -> bool:
    """Whether the number ``v`` has a 0-d tensor (`value_tensor`): every bool and float, an int
    within int64's range."""
    return type(v) is not int or _INT64[0] <= v <= _INT64[1]


def value_tensor(v, device: torch.device, float_dtype: torch.dtype) -> torch.Tensor:
    """The 0-d tensor a dynamic number is passed as (on ``device``: the kernel reads it there)."""
    t = type(v)
    if t is bool:
        dtype = torch.bool
    elif t is int:
        dtype = torch.int32 if _INT32[0] <= v <= _INT32[1] else torch.int64
    else:
        dtype = float_dtype
    # (on the GPU a fill kernel on the current stream: no host synchronisation, unlike a copy;
    # on the CPU 1.1 µs, torch.tensor's 2.8)
    made = torch.scalar_tensor(v, dtype=dtype, device=device)
    made._flexattn_number = (t, v.hex() if t is float else v)  # (`number_of`)
    return made


def number_of(t: torch.Tensor) -> tuple | None:
    """``(type, value)`` of the number ``t`` was made for by `value_tensor` (a float's value in
    hex), or None for any other tensor."""
    return getattr(t, "_flexattn_number", None)


def slot_value(fn: types.FunctionType, slot: Slot, missing):
    """The value in ``slot`` of ``fn`` now (``missing`` if the slot is empty)."""
    where, at = slot
    try:
        if where == "cell":
            return fn.__closure__[at].cell_contents
        if where == "default":
            return fn.__defaults__[at]
        if where == "kwdefault":
            return fn.__kwdefaults__[at]
        return fn.__globals__.get(at, missing)
    except (ValueError, IndexError, KeyError, TypeError):
        return missing


def substitute(fn: types.FunctionType, values: dict[Slot, object]) -> types.FunctionType:
    """A copy of ``fn`` that reads ``values`` in their slots (for tracing it once)."""
    cells = fn.__closure__
    if any(s[0] == "cell" for s in values):
        cells = tuple(types.CellType(values[("cell", i)]) if ("cell", i) in values else c
                      for i, c in enumerate(cells))
    defaults = fn.__defaults__
    if any(s[0] == "default" for s in values):
        defaults = tuple(values.get(("default", i), v) for i, v in enumerate(defaults))
    kwdefaults = fn.__kwdefaults__
    if any(s[0] == "kwdefault" for s in values):
        kwdefaults = {k: values.get(("kwdefault", k), v) for k, v in kwdefaults.items()}
    g = fn.__globals__
    if any(s[0] == "global" for s in values):
        g = {**g, **{s[1]: v for s, v in values.items() if s[0] == "global"}}
    copy = types.FunctionType(fn.__code__, g, fn.__name__, defaults, cells)
    copy.__kwdefaults__ = kwdefaults
    copy.__qualname__ = fn.__qualname__
    copy.__module__ = fn.__module__
    return copy
