"""Trace once: Python mods -> cached `Mod` templates plus the tensors this call captured.

Model code builds its ``score_mod`` lambda anew in every ``forward``. Tracing it again each call
would cost more than the kernel launch, so a mod is traced once per *fingerprint* and later calls
only collect the tensors it captured. `resolve` returns ``(template, buffers)``: ``template`` is a
`Mod` whose IR (and so whose generated kernel) is shared by every call with the same fingerprint,
``buffers`` are this call's captured tensors in the template's buffer order.

What the fingerprint covers (`fingerprint` walks all of it, iteratively, in one pass):

* the function's code object, the layout of its closure, its defaults and keyword defaults;
* every value reachable from the closure cells, the defaults and the module globals the code
  (and the code of functions nested in it) names:
  - Python numbers, strings, None, dtypes, devices: by value (a closure float that changes
    value is a new fingerprint: it is a constant of the kernel), except the numbers of a
    function's *dynamic slots* (`flexattn.scalars`: a closure cell, default or global whose value
    was seen to change), which are walked as the 0-d tensors a call passes them as;
  - tensors: by dtype, device, shape, strides and layout (their values are kernel arguments; the
    compiled kernel is specialised on their strides), and by
    which earlier tensor of the walk they are (aliasing decides how many buffers the IR has);
  - functions (nested mods and helpers): recursively, the same way;
  - ``functools.partial``: its function, arguments and keywords; bound methods, and a callable
    object used as the mod: the function (``__call__``; an ``nn.Module``'s ``forward``), the
    object, and what the function reads through its first parameter (``self.cap``: a class
    attribute, or a method of the class with what it reads in turn); `Mod` objects: their
    structural key and their captured tensors;
  - tuples, lists, dicts, sets and objects with a ``__dict__`` (``nn.Module`` included): their
    contents, recursively;
  - modules, classes and builtins: by identity; what the code (and the functions nested in it)
    reads through attributes of a global, a closure cell or a parameter's default
    (``cfg.POS``, ``Config.POS``, ``mod.factor``, ``obj.cfg.scale`` where ``scale`` lives on
    the class, ``obj.table[0]`` of a class's list, a property's getter) is walked as a value of
    its own (`_attribute_of`; not for the modules of `_FIXED_PACKAGES`: ``torch.where``,
    ``math.inf``);
  - dict keys that are not numbers, strings or the like (``(0, 1)``): walked, never by ``id``.
* code that reads attributes through ``getattr``, ``type`` or ``vars`` (no attribute chain
  says what it reads), anything else (an object without ``__dict__`` of an unknown type), a
  walk longer than `WALK_LIMIT` values, or a captured tensor that the walk cannot reach (one the
  mod computes while it runs) makes the mod *uncacheable*: it is traced on every call, which is always right,
  only slower.

A DSL mod or any other `Mod` needs no tracing: it is its own template.
"""

from __future__ import annotations

import dis
import functools
import itertools
import operator
import types
import warnings
from typing import Any

import torch

from flexattn import scalars
from flexattn.lru import LRU
from flexattn.mods import Mod

WALK_LIMIT = 4096  # values visited per fingerprint before a mod is treated as uncacheable

_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
          slice, range, type(Ellipsis), torch.layout, torch.memory_format)
_BY_IDENTITY = (types.ModuleType, type, types.BuiltinFunctionType, types.MethodDescriptorType,
                types.WrapperDescriptorType, types.MethodWrapperType, types.GetSetDescriptorType,
                types.ClassMethodDescriptorType)
_OPAQUE = object()  # marks a fingerprint that cannot be trusted

_READS_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_READS_ATTR = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# (a superinstruction that loads two locals, Python 3.13 and later, names both: the attribute read
# after it is the second's)
_READS_LOCAL = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW",
                          "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
# Packages whose attributes mods read but nobody assigns (``torch.where``, ``math.inf``): chains
# from their modules are not followed, which keeps them off every call's path.
_FIXED_PACKAGES = frozenset({"torch", "math", "operator"})


class _Code:
    """What a fingerprint needs of a code object: the names it reads as globals, the attribute
    chains it reads from globals and closure cells (``cfg.POS``: ``(("global", "cfg"),
    ("POS",))``, ``(("cell", 0), ("POS",))``), and its dynamic slots (a copy of
    `flexattn.scalars`' record, refreshed when that changes)."""

    __slots__ = ("names", "chains", "self_chains", "dynamic", "reflective")

    def __init__(self, fn: types.FunctionType):
        """``fn``: a function of the code (chains from a module of `_FIXED_PACKAGES` in its
        globals or cells are left out). ``self_chains``: the attribute chains read from the
        first parameter (``self.cap`` of a method or ``__call__``), resolved where the walk knows
        the object; chains read from a parameter that has a default (``C.scale`` of
        ``C=Config``) are among ``chains``."""
        code = fn.__code__
        found: dict[str, None] = {}
        chains: dict[tuple, None] = {}
        n_args = code.co_argcount + code.co_kwonlyargcount
        params = code.co_varnames[:n_args]
        with_default = set(params[code.co_argcount - len(fn.__defaults__ or ()):code.co_argcount])
        with_default.update(fn.__kwdefaults__ or ())
        first = params[0] if code.co_argcount else None
        stack = [code]
        while stack:
            c = stack.pop()
            root, attrs = None, []
            for i in dis.get_instructions(c):
                if root is not None and i.opname in _READS_ATTR:
                    attrs.append(i.argval)
                    continue
                if attrs:
                    chains[(root, tuple(attrs))] = None
                root, attrs = None, []
                if i.opname in _READS_GLOBAL:
                    found[i.argval] = None
                    root = ("global", i.argval)
                elif i.opname == "LOAD_DEREF":
                    # (the function's closure cells, also as nested functions read them, and its
                    # parameters that nested functions capture, which it then reads as cells too)
                    if i.argval in code.co_freevars:
                        root = ("cell", code.co_freevars.index(i.argval))
                    elif i.argval in with_default or i.argval == first:
                        root = ("arg", i.argval)
                elif i.opname in _READS_LOCAL and c is code:
                    name = i.argval[-1] if isinstance(i.argval, tuple) else i.argval
                    if name in with_default or name == first:
                        root = ("arg", name)
            if attrs:
                chains[(root, tuple(attrs))] = None
            stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
        self.self_chains = tuple(a for (r, a) in chains if r == ("arg", first) and first not in with_default)
        self.names = tuple(found)
        # (``getattr(cfg, name)``, ``type(self).scale``: attributes read through a call, which no
        # chain records: such a mod is traced at every call)
        self.reflective = any(n in found for n in _REFLECTIVE)
        self.chains = tuple(c for c in chains if (c[0][0] != "arg" or c[0][1] in with_default)
                            and not _fixed_module(_root(fn, c[0])))
        self.dynamic = scalars.dynamic_slots(code)


# Builtins that read attributes by a name or an object computed at run time.
_REFLECTIVE = ("getattr", "type", "vars")

# Code object -> _Code (one lookup per fingerprint). Bound: a tuple of names each.
_CODES = LRU(4096)


def _fixed_module(v) -> bool:
    return type(v) is types.ModuleType and v.__name__.partition(".")[0] in _FIXED_PACKAGES


def _code(fn: types.FunctionType) -> _Code:
    info = _CODES.get(fn.__code__)
    if info is None:
        info = _CODES[fn.__code__] = _Code(fn)
    return info


def _root(fn: types.FunctionType, root: tuple) -> Any:
    where, at = root
    if where == "global":
        return fn.__globals__.get(at, _MISSING)
    if where == "arg":  # (a parameter's default)
        if at in (fn.__kwdefaults__ or ()):
            return fn.__kwdefaults__[at]
        code, defaults = fn.__code__, fn.__defaults__ or ()
        i = code.co_varnames.index(at) - (code.co_argcount - len(defaults))
        return defaults[i] if 0 <= i < len(defaults) else _MISSING
    try:
        return fn.__closure__[at].cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def _attribute(fn: types.FunctionType, chain: tuple) -> Any:
    """What an attribute chain reads through modules and classes (which the walk keys by
    identity): ``cfg.POS`` is ``POS`` while ``cfg`` is a module or class, ``cfg`` itself when it
    is an object the walk sees into (its own attributes), and its class's ``POS`` where that is
    a number, a string or a tensor that the object does not hold itself (a class attribute read
    through an instance, which the walk of the object would not see)."""
    root, attrs = chain
    return _attribute_of(_root(fn, root), attrs)


def _attribute_of(v: Any, attrs: tuple) -> Any:
    """What reading the attributes ``attrs`` from ``v`` reads (see `_attribute`): followed through
    modules and classes (an object's or a class's module of `_FIXED_PACKAGES` is keyed by
    identity, not followed), a function's own attributes
    (``fn.factor``), an object's own attributes and an ``nn.Module``'s parameters, buffers and
    submodules (``self.cfg.scale``), and what an object reads from its class where it does not
    hold the attribute itself: a value (``self.table``, a number, a tuple, a list, a class), a
    method read through the instance (``self.helper``: that method bound to the instance,
    `_Bound`) or a property (its getter bound to the instance). Where it cannot follow further it
    stops at the object (which the walk then sees into)."""
    for a in attrs:
        if isinstance(v, (types.ModuleType, type)):
            v = getattr(v, a, _MISSING)
            continue
        own = getattr(v, "__dict__", None)
        if not isinstance(own, dict):
            break
        if a in own:
            if _fixed_module(own[a]):  # (``self.F.relu``: torch's, keyed by identity)
                break
            v = own[a]
            continue
        if isinstance(v, torch.nn.Module):
            held = _module_member(own, a)
            if held is not _MISSING:
                v = held
                continue
        if type(v) is types.FunctionType:
            break
        if a == "__class__":  # (``self.__class__.scale``)
            v = type(v)
            continue
        shared = _on_class(type(v), a)
        if shared is _MISSING:
            break
        t = type(shared)
        if t is types.FunctionType:
            v = _Bound(v, shared)
        elif t is property:
            if type(shared.fget) is types.FunctionType:
                v = _Bound(v, shared.fget)
            break
        elif t is staticmethod:
            v = shared.__func__
        elif t is classmethod:
            v = _Bound(type(v), shared.__func__)
        elif isinstance(shared, (types.ModuleType, type)):
            if _fixed_module(shared):
                break
            v = shared
            continue
        elif t in _ATOMS or isinstance(shared, torch.Tensor) or t in (tuple, list, dict, set, frozenset) \
                or isinstance(getattr(shared, "__dict__", None), dict):
            v = shared  # (the class's value itself: the walk sees into it)
            continue
        break
    return v


def _module_member(own: dict, a: str) -> Any:
    """An ``nn.Module``'s parameter, buffer or submodule ``a`` (what its ``__getattr__`` reads), or
    _MISSING."""
    for where in ("_parameters", "_buffers", "_modules"):
        d = own.get(where)
        if d is not None and a in d:
            return d[a]
    return _MISSING


def _on_class(tp: type, name: str) -> Any:
    """What the classes of ``tp``'s method resolution order hold under ``name`` (descriptors as
    they are, nothing called), or _MISSING: a class attribute that an instance without its own
    reads (`inspect.getattr_static` of the class, without its checks of the metaclass)."""
    for klass in tp.__mro__:
        found = klass.__dict__.get(name, _MISSING)
        if found is not _MISSING:
            return found
    return _MISSING


class _Bound:
    """A function of a class with the instance it is read through (a bound method, ``__call__``
    of a callable object, ``self.helper``): the walk covers the function and what it reads
    through its first parameter (class attributes included)."""

    __slots__ = ("obj", "func")

    def __init__(self, obj: Any, func: types.FunctionType):
        self.obj, self.func = obj, func


_FLAT = object()  # marks a key made by `_flat_fingerprint`
_ATOM, _TENSOR, _IDENTITY = range(3)
# What `_flat_fingerprint` does with a value, by its exact type (one dict lookup per value).
_FLAT_KINDS = {**dict.fromkeys(_ATOMS, _ATOM), torch.Tensor: _TENSOR, torch.nn.Parameter: _TENSOR,
               **dict.fromkeys(_BY_IDENTITY, _IDENTITY)}


def _atom_key(t: type, v) -> tuple:
    """A plain value's part of a key: floats by their text where equality would mislead (0.0 and
    -0.0 apart, NaN equal to NaN)."""
    return (t, v) if t is not float or v and v == v else (t, str(v))


def _flat_fingerprint(fn: types.FunctionType, names: tuple[str, ...], chains: tuple,
                      dynamic: dict) -> tuple[tuple | None, list[torch.Tensor]]:
    """The walk of `fingerprint` for the common model-code mod, a function without defaults whose
    closure cells and named globals are numbers, strings, plain tensors, modules, classes or
    builtins: one flat loop. ``(None, [])`` when ``fn`` is not of that shape (the full walk
    decides). Same coverage as the full walk; its keys are marked apart from the full walk's.
    ``names``, ``chains``: the globals and attribute chains its code reads; ``dynamic``: the
    tensors passed for its dynamic slots."""
    if fn.__defaults__ is not None or fn.__kwdefaults__ is not None:
        return None, []
    code = fn.__code__
    try:
        values = [c.cell_contents for c in fn.__closure__ or ()]
    except ValueError:  # an empty cell
        return None, []
    n_cells = len(values)
    values += map(fn.__globals__.get, names, _MISSING_EACH)
    if chains:
        values += [_attribute(fn, c) for c in chains]
    if dynamic:
        for (where, at), t in dynamic.items():
            values[at if where == "cell" else n_cells + names.index(at)] = t
    key: list = [_FLAT, code, n_cells]
    tensors: list[torch.Tensor] = []
    for v in values:
        t = type(v)
        kind = _FLAT_KINDS.get(t)
        if kind is _ATOM:
            key.append(_atom_key(t, v))
        elif kind is _TENSOR:
            for i, x in enumerate(tensors):
                if x is v:
                    key.append(i)
                    break
            else:
                key.append((v.dtype, v.device, v.shape, v.stride(), v.layout))
                tensors.append(v)
        elif kind is _IDENTITY or v is _MISSING or isinstance(v, _BY_IDENTITY):
            key.append(v)
        else:
            return None, []
    return tuple(key), tensors


def _dynamic_values(fn: types.FunctionType, slots: tuple, device: torch.device,
                    float_dtype: torch.dtype) -> dict:
    """``{slot: 0-d tensor on device}`` for the numbers now in ``fn``'s dynamic ``slots``."""
    out = {}
    for slot in slots:
        v = scalars.slot_value(fn, slot, _MISSING)
        if type(v) in (bool, int, float) and scalars.passable(v):
            out[slot] = scalars.value_tensor(v, device, float_dtype)
    return out


_NONE: dict = {}


def fingerprint(fn: Any, device: torch.device | None = None,
                float_dtype: torch.dtype = torch.float32) -> tuple[tuple | None, list[torch.Tensor]]:
    """``(key, tensors)``: a hashable key of everything that decides ``fn``'s IR (None if it
    cannot be trusted) and the tensors reachable from it, in walk order. With ``device``, the
    numbers in dynamic slots (`flexattn.scalars`) are walked as the 0-d tensors on ``device`` (of
    ``float_dtype`` for floats) that a call passes for them; without, every number is keyed by
    value."""
    if type(fn) is not types.FunctionType:
        return _walk(fn)
    info = _code(fn)
    dynamic = _NONE if not info.dynamic or device is None else \
        _dynamic_values(fn, info.dynamic, device, float_dtype)
    return _walk_function(fn, info, dynamic)


def _walk_function(fn: types.FunctionType, info: _Code, dynamic: dict) -> tuple[tuple | None, list[torch.Tensor]]:
    try:
        key, tensors = _flat_fingerprint(fn, info.names, info.chains, dynamic)
    except RuntimeError:  # a tensor without strides (sparse): the full walk keys it apart
        key = None
    if key is not None:
        return (None if info.reflective else key), tensors
    return _walk(scalars.substitute(fn, dynamic) if dynamic else fn)


def _walk(fn: Any) -> tuple[tuple | None, list[torch.Tensor]]:
    """The full walk of `fingerprint`."""
    key: list = []
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}  # id(container or tensor) -> its position (cycles and aliasing)
    stack = [fn]
    # (a callable object: the function it runs too; a module's forward, whose own hooks are in its
    # __dict__)
    call = _on_class(type(fn), "forward" if isinstance(fn, torch.nn.Module) else "__call__")
    if type(call) is types.FunctionType and not isinstance(fn, Mod):
        stack[:0] = _bound(fn, call)
    steps = 0
    while stack:
        v = stack.pop()
        steps += 1
        if steps > WALK_LIMIT:
            return None, tensors
        t = type(v)
        if t in _ATOMS:
            key.append(_atom_key(t, v))
            continue
        if isinstance(v, torch.Tensor):
            prev = seen.get(id(v))
            if prev is not None:
                key.append(("alias", prev))
            else:
                seen[id(v)] = len(tensors)
                key.append(("T", v.dtype, v.device, v.shape, v.stride() if v.layout == torch.strided else None,
                            v.layout))
                tensors.append(v)
            continue
        if isinstance(v, _BY_IDENTITY) or t in (types.BuiltinMethodType,):
            key.append(v)
            continue
        vid = (id(v.obj), id(v.func)) if t is _Bound else id(v)
        if vid in seen:
            key.append(("ref", seen[vid]))
            continue
        seen[vid] = len(key)
        if not _expand(v, t, key, stack):
            return None, tensors
    return tuple(key), tensors


def _expand(v: Any, t: type, key: list, stack: list) -> bool:
    """One container-like value of the `walk`: its part of the key, its contents pushed on
    ``stack``. False when its contents cannot be seen (the fingerprint cannot be trusted)."""
    if isinstance(v, Mod):
        key.append(("Mod", v.key()))
        stack.extend(reversed(v.buffers))
    elif t is types.FunctionType:
        code = v.__code__
        cells = v.__closure__ or ()
        key.append(("fn", code, len(cells)))
        g = v.__globals__
        info = _code(v)
        if info.reflective:
            return False
        stack.extend(_attribute(v, c) for c in reversed(info.chains))
        stack.extend(g.get(n, _MISSING) for n in reversed(info.names))
        stack.append(v.__kwdefaults__)
        stack.append(v.__defaults__)
        for c in reversed(cells):
            try:
                stack.append(c.cell_contents)
            except ValueError:  # an empty cell (a name assigned later in the enclosing scope)
                stack.append(_MISSING)
    elif t is functools.partial:
        key.append("partial")
        stack.extend((v.keywords, v.args, v.func))
    elif t is types.MethodType:
        key.append("method")
        stack.append(v.__self__)
        stack.extend(_bound(v.__self__, v.__func__))
    elif t is _Bound:
        key.append("bound")
        stack.append(v.obj)
        stack.extend(_bound(v.obj, v.func))
    elif t in (tuple, list):
        key.append((t, len(v)))
        stack.extend(reversed(v))
    elif isinstance(v, dict):
        keys = tuple(v)
        odd = [k for k in keys if type(k) not in _ATOMS]
        if odd:  # (keys that are not plain values, a tuple ``(0, 1)``, an object: walked, not keyed by id,
            # which a later key takes over once this one is freed)
            keys = tuple(k if type(k) in _ATOMS else _WALKED_KEY for k in keys)
        key.append((dict, keys))
        stack.extend(reversed(list(v.values())))
        stack.extend(reversed(odd))
    elif t in (set, frozenset):
        try:
            key.append((t, frozenset(v)))
        except TypeError:
            return False
    elif v is _MISSING:
        key.append("missing")
    else:
        attrs = getattr(v, "__dict__", None)
        if not isinstance(attrs, dict):
            return False  # unknown object without a __dict__: cannot see what it holds
        key.append(("obj", t))
        stack.append(attrs)
    return True


def _bound(obj: Any, func: Any) -> list:
    """``func`` (a bound method's function) and what it reads through its first parameter on
    ``obj``, for the walk's stack (values, not a new container: the walk keys containers by
    id, which a freed temporary would pass on)."""
    if type(func) is not types.FunctionType:
        return [func]
    return [*[_attribute_of(obj, attrs) for attrs in reversed(_code(func).self_chains)], func]


_MISSING = type("_Missing", (), {"__repr__": lambda self: "<missing>"})()
_WALKED_KEY = ("walked key",)  # a dict key's place in its dict's part of a key, the key itself walked
_MISSING_EACH = itertools.repeat(_MISSING)  # dict.get's default for every name


def picker(slots: tuple[int, ...]):
    """``pick(tensors)``: the tuple of ``tensors[i] for i in slots`` (a call's captured tensors,
    in a template's buffer order, from the tensors of its fingerprint walk)."""
    if not slots:
        return lambda tensors: ()
    if len(slots) == 1:
        return lambda tensors, i=slots[0]: (tensors[i],)
    return operator.itemgetter(*slots)


def slots_of(buffers, tensors) -> tuple[int, ...] | None:
    """Where each of ``buffers`` sits among a walk's ``tensors`` (by identity); None if one of
    them is not there (a tensor the mod computes, or one the walk cannot reach)."""
    by_id = {id(t): i for i, t in enumerate(tensors)}
    slots = tuple(by_id.get(id(b), -1) for b in buffers)
    return None if -1 in slots else slots


class _Entry:
    __slots__ = ("template", "pick")

    def __init__(self, template: Mod, slots: tuple[int, ...] | None):
        """``slots``: the walk position of each template buffer; None: trace every call."""
        self.template = template
        self.pick = None if slots is None else picker(slots)  # this call's buffers from the walk's tensors


# (kind, score dtype, device, fingerprint) -> _Entry. Bound: an entry holds one IR and its
# meta-tensor stand-ins (a few KB); a dropped one is traced again by its next call.
_CACHE = LRU(4096)


def resolve(fn: Any, kind: str, score_dtype: torch.dtype, device: torch.device, trace,
            walked: tuple | None = None) -> tuple[Mod, tuple[torch.Tensor, ...]]:
    """``(template, buffers)`` for a mod: a `Mod` is its own template; a Python mod is traced by
    ``trace(fn, kind, score_dtype=..., device=...)`` on its first fingerprint only. ``walked``:
    ``fingerprint(fn, device, score_dtype)`` when the caller has it already."""
    if isinstance(fn, Mod):
        return fn, fn.buffers
    fp, tensors = walked or fingerprint(fn, device, score_dtype)
    if fp is None:
        mod = trace(fn, kind, score_dtype=score_dtype, device=device)
        return mod, mod.buffers
    entry = _CACHE.get((kind, score_dtype, device, fp))
    if entry is None:
        return _first(fn, kind, score_dtype, device, trace)
    if entry.pick is None:  # captures a tensor the walk cannot reach: trace again
        mod = trace(fn, kind, score_dtype=score_dtype, device=device)
        return mod, mod.buffers
    return entry.template, entry.pick(tensors)


def _first(fn: Any, kind: str, score_dtype: torch.dtype, device: torch.device,
           trace) -> tuple[Mod, tuple[torch.Tensor, ...]]:
    """A fingerprint seen for the first time: note the numbers the mod reads (one that changed
    makes its slot dynamic, `flexattn.scalars`), trace, cache the template."""
    if type(fn) is not types.FunctionType:
        return _trace_and_keep(fn, kind, score_dtype, device, trace, {}, *_walk(fn))
    info = _code(fn)
    scalars.observe(fn, info.names)
    info.dynamic = scalars.dynamic_slots(fn.__code__)
    dynamic = _NONE if not info.dynamic or device is None else \
        _dynamic_values(fn, info.dynamic, device, score_dtype)
    return _trace_and_keep(fn, kind, score_dtype, device, trace, dynamic, *_walk_function(fn, info, dynamic))


def _trace_and_keep(fn: Any, kind: str, score_dtype: torch.dtype, device: torch.device, trace, dynamic: dict,
                    fp: tuple | None, tensors: list) -> tuple[Mod, tuple[torch.Tensor, ...]]:
    """Trace ``fn`` (with meta stand-ins in its ``dynamic`` slots) and keep its template under
    ``fp``, unless another thread did meanwhile."""
    key = (kind, score_dtype, device, fp)
    entry = None if fp is None else _CACHE.get(key)
    if entry is not None and entry.pick is not None:
        return entry.template, entry.pick(tensors)
    if dynamic:
        # Traced with meta stand-ins: a mod that needs the number itself (``if flag:``,
        # ``range(n)``, ``float(t)``) fails on them, and then its slots stay constants.
        stand_ins = {slot: torch.empty((), dtype=t.dtype, device="meta") for slot, t in dynamic.items()}
        for t in stand_ins.values():
            t._flexattn_weak = True  # (promotes as the Python number it stands for)
        try:
            mod = trace(scalars.substitute(fn, stand_ins), kind, score_dtype=score_dtype, device=device)
        except Exception:
            scalars.pin(fn.__code__)
            return _first(fn, kind, score_dtype, device, trace)
        real = {id(stand_ins[slot]): t for slot, t in dynamic.items()}
        buffers = tuple(real.get(id(b), b) for b in mod.buffers)
    else:
        mod = trace(fn, kind, score_dtype=score_dtype, device=device)
        buffers = mod.buffers
    if fp is None:
        return mod, buffers
    # The cache keeps the IR, not this call's tensors (nor the function and its closure).
    template = mod.stand_in()
    if mod.host_values:  # (its constants are tensors' values of this call: trace again each call)
        _warn_host_values(mod)
        _CACHE[key] = _Entry(template, None)
        return mod, buffers
    _CACHE[key] = _Entry(template, slots_of(buffers, tensors))
    return template, buffers


def _warn_host_values(mod: Mod) -> None:
    warnings.warn(f"{mod.kind}_mod '{mod.name}' reads a captured tensor's value in Python (.item(), float(), "
                  "int(), bool(), .tolist()): flexattn traces it again at every call to see the tensor's "
                  "current value. Use the tensor in the expression itself (score * t, not score * "
                  "t.item()) to have the kernel read it and the call cost a lookup.", stacklevel=4)


def clear() -> None:
    """Forget every cached template (tests; a long-running process never needs it)."""
    _CACHE.clear()
