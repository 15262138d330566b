"""`Mod`: a score or mask modification as IR plus the tensors it captured.

Both front ends (the Python tracer and the DSL) produce a `Mod`. A Mod is callable exactly like
the function it came from, so it runs anywhere a Python mod runs: eagerly on tensors (including
inside ``torch.nn.attention.flex_attention``, under vmap), inside another mod being traced (its
IR is inlined), and in flexattn's kernels (its IR is emitted as Triton).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Sequence

import torch

from flexattn import ir
from flexattn.lru import LRU

SCORE, MASK = "score", "mask"
ARITY = {SCORE: 5, MASK: 4}


def _canonical(device: torch.device) -> torch.device:
    """'cuda' and 'cuda:<current>' name the same device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# Structural key -> a Mod with that key, with meta stand-ins for its tensors. Compiled graphs
# (torch.compile) name mods by key only; the custom ops find the IR here at run time (every call
# passes its own captured tensors). Bound: a template is an IR and meta tensors (a few KB); one
# dropped is found again while any Mod of that key is alive (`_LIVE`), else a compiled graph
# that calls it fails with the KeyError of `template`.
_TEMPLATES = LRU(8192)
_LIVE: "weakref.WeakValueDictionary[str, Mod]" = weakref.WeakValueDictionary()


def template(key: str) -> "Mod":
    """The IR of a mod known by its structural key (see `Mod.key`)."""
    mod = _TEMPLATES.get(key)
    if mod is None:
        live = _LIVE.get(key)
        if live is None:
            raise KeyError(f"no mod with key {key[:80]!r}... is alive or among the last {_TEMPLATES.limit} "
                           "new mods of this process")
        mod = _TEMPLATES[key] = live.stand_in()
    return mod


class Mod:
    """A traced mod. ``kind`` is "score" or "mask"; ``buffers`` are the captured tensors."""

    # True where the traced function read a captured tensor's value on the host (``t.item()``,
    # ``float(t)``, ``if t:``): the IR holds that value as a constant, so the mod is traced again
    # at each call (`flexattn.modcache`) to see the tensor's current value.
    host_values = False

    def __init__(self, kind: str, root: ir.Node, buffers: Sequence[torch.Tensor] = (),
                 name: str = "mod", source: str = "", fn: Any = None):
        if kind not in ARITY:
            raise ValueError(f"kind must be 'score' or 'mask', got {kind!r}")
        if kind == MASK and root.dtype != torch.bool:
            raise TypeError(
                f"mask_mod '{name}' must return a bool, but it returns {ir.dtype_name(root.dtype)}"
            )
        if kind == SCORE and not root.dtype.is_floating_point:
            raise TypeError(
                f"score_mod '{name}' must return a floating-point score, but it returns "
                f"{ir.dtype_name(root.dtype)}"
            )
        self.kind = kind
        self.ir = root
        self.buffers = tuple(buffers)
        self.name = name
        self.source = source or str(root)
        self.fn = fn
        # torch's flex_attention counts a mod's positional parameters: show it the real ones.
        names = ir.SCORE_INPUTS if kind == SCORE else ir.INDEX_INPUTS
        self.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
        )
        # What launches need on every call, computed once: the structural key, the buffers read.
        self._key = f"{kind}:{root.key()}"
        self.buffer_specs = tuple(ir.buffers_of(root))
        self.inputs = frozenset(n.arg for n in ir.toposort(root) if n.op == "input")  # (score, b, h, q_idx, kv_idx)
        for buf in self.buffer_specs:
            t = self.buffers[buf.index]
            if t.dtype != buf.dtype or t.dim() != buf.ndim:
                raise ValueError(f"buffer {buf} does not match captured tensor {t.dtype} {tuple(t.shape)}")
        _TEMPLATES.get_or_make(self._key, self.stand_in)  # (a key made again is recent again)
        if _LIVE.get(self._key) is None:  # (never replace a live mod by one that may die sooner)
            _LIVE[self._key] = self

    @property
    def __name__(self) -> str:  # torch and users print mods by __name__
        return self.name

    @property
    def score_dtype(self) -> torch.dtype | None:
        for n in ir.toposort(self.ir):
            if n.op == "input" and n.arg == "score":
                return n.dtype
        return None

    def key(self) -> str:
        """Structural cache key: equal for mods that generate the same kernel code."""
        return self._key

    def stand_in(self) -> "Mod":
        """The same mod over meta tensors of its tensors' shapes and strides: no memory held."""
        return self.rebind([torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                            for t in self.buffers])

    def rebind(self, buffers: Sequence[torch.Tensor]) -> "Mod":
        """The same mod over other captured tensors (same dtypes and ranks; not re-checked)."""
        mod = object.__new__(Mod)
        mod.__dict__.update(self.__dict__)
        mod.buffers, mod.fn = tuple(buffers), None
        return mod

    def check_device(self, device: torch.device, arg: str = "query", buffers=None) -> None:
        """Every captured tensor (``buffers``: a call's own, else the Mod's) is on ``device``."""
        device = _canonical(torch.device(device))
        for t in self.buffers if buffers is None else buffers:
            if _canonical(t.device) != device:
                raise ValueError(
                    f"{self.kind}_mod '{self.name}' captured a tensor on {t.device}, but {arg} is on "
                    f"{device}; move the captured tensor to {device}"
                )

    def __call__(self, *args):
        if len(args) != ARITY[self.kind]:
            raise TypeError(
                f"{self.kind}_mod '{self.name}' takes {ARITY[self.kind]} arguments "
                f"({', '.join(ir.SCORE_INPUTS[5 - ARITY[self.kind]:])}), got {len(args)}"
            )
        # Called on traced values (inside another mod being traced): the tracer's values know how
        # to inline a Mod, so this module need not import the tracer.
        for a in args:
            inline = getattr(type(a), "__flexattn_inline__", None)
            if inline is not None:
                return inline(self, args)
        names = ir.SCORE_INPUTS if self.kind == SCORE else ir.INDEX_INPUTS
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        # The score passes through at the caller's precision (e.g. float64 in reference checks).
        # No IR is built here: torch's flex_attention runs this under dynamo.
        out = ir.Evaluator(dict(zip(names, args)), self.buffers, device, keep_score_dtype=True).value(self.ir)
        if self.kind == SCORE and isinstance(args[0], torch.Tensor) and args[0].dtype.is_floating_point:
            out = out.to(args[0].dtype)
        return out

    def __repr__(self) -> str:
        return f"<{self.kind}_mod {self.name}: {ir.to_text(self.ir)}>"
