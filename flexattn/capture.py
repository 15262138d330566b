"""Python mods under ``torch.compile``: record under Dynamo, replay through the tracer.

Dynamo cannot run flexattn's tracer (its proxies are not tensors), and it cannot hand a lambda it
is tracing to ordinary Python either. What it can do is call the lambda on tensors. So, while
compiling, a mod is called once on probes (0-d stand-ins for score, b, h, q_idx, kv_idx) under
`_Recorder`, a TorchFunctionMode that records each call involving a probe instead of computing it;
Dynamo inlines the mode too. The recording is a tuple of constants (functions, Python numbers, probe and tensor
references), and the tensors the mod captured (an ``nn.Parameter``, a document-id table...) come
out as graph values. `_template` then replays the recording through the real tracer
(`flexattn.trace`, at compile time, through ``torch.compiler.assume_constant_result``), so compiled
and eager mods get the same semantics; the compiled graph only holds the mod's structural key and
its captured tensors (inputs of the custom ops in `flexattn.ops`).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from flexattn import ir, tracer
from flexattn.mods import MASK, SCORE, Mod, template


class _Recorder(TorchFunctionMode):
    """Active while a mod is called on probes: a torch call that involves a probe (or an earlier
    recorded result) is recorded and answered with a fresh placeholder; any other call runs."""

    def __init__(self, probes: list[torch.Tensor]):
        super().__init__()
        self.values = list(probes)   # probes, then one placeholder per recorded call
        self.ops: list[tuple] = []
        self.tensors: list[torch.Tensor] = []  # captured tensors, in first-use order

    def _ref(self, a) -> int | None:
        for i, v in enumerate(self.values):
            if v is a:
                return i
        return None

    def _involves(self, a) -> bool:
        if isinstance(a, torch.Tensor):
            return self._ref(a) is not None
        if isinstance(a, (tuple, list)):
            return any(self._involves(x) for x in a)
        return False

    def encode(self, a):
        """("p", i): a probe or a recorded result; ("t", i): a captured tensor; ("c", v): a
        constant; ("seq", (...)): a tuple or list."""
        if type(a) is float:
            # A float that changed between compiled calls is a symbol (SymFloat) by then, which
            # `_template`'s constant arguments cannot hold: the round trip through its hex text
            # makes it a constant again, guarded on (as ints are), so a new value recompiles.
            a = float.fromhex(a.hex())
        if isinstance(a, torch.Tensor):
            i = self._ref(a)
            if i is not None:
                return ("p", i)
            for j, t in enumerate(self.tensors):
                if t is a:
                    return ("t", j)
            self.tensors.append(a)
            return ("t", len(self.tensors) - 1)
        if isinstance(a, (tuple, list)):
            return ("seq", tuple(self.encode(x) for x in a))
        return ("c", a)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or not (
                any(self._involves(a) for a in args) or any(self._involves(v) for v in kwargs.values())):
            return func(*args, **kwargs)
        self.ops.append((func, tuple(self.encode(a) for a in args),
                         tuple((k, self.encode(v)) for k, v in kwargs.items())))
        out = torch.empty((), dtype=torch.float32)
        self.values.append(out)
        return out


def record(fn, kind: str, score_dtype: torch.dtype = torch.float32) -> tuple[tuple, list[torch.Tensor], tuple]:
    """Call ``fn`` on probes: ``(ops, captured tensors, result reference)``. The score probe has
    the score dtype the tracer gives the score (float64 for float64 inputs), so that what the mod
    reads of it (``score.dtype``) is what it reads eagerly."""
    names = ir.SCORE_INPUTS if kind == SCORE else ir.INDEX_INPUTS
    probes = [torch.empty((), dtype=score_dtype if n == "score" else torch.int32) for n in names]
    rec = _Recorder(probes)
    with rec:
        result = fn(*probes)
    return tuple(rec.ops), rec.tensors, rec.encode(result)


@torch.compiler.assume_constant_result
def _template(kind: str, score_dtype: torch.dtype, ops: tuple, result: tuple, metas: tuple) -> tuple:
    """Replay a recording through the tracer (at compile time): ``(mod key, buffer slots)``, where
    slot i is the position, among the recorded tensors, of the mod's buffer i."""
    stand_ins = [torch.empty(shape, dtype=dtype, device="meta") for dtype, shape in metas]

    def decode(ref, vals):
        tag, v = ref
        if tag == "p":
            return vals[v]
        if tag == "t":
            return stand_ins[v]
        if tag == "seq":
            return tuple(decode(r, vals) for r in v)
        return v

    def replay(*inputs):
        vals = list(inputs)  # probes first, then one value per recorded call (as `_Recorder.values`)
        for func, args, kwargs in ops:
            vals.append(tracer.call(func, tuple(decode(a, vals) for a in args),
                                    {k: decode(v, vals) for k, v in kwargs}))
        return decode(result, vals)

    if kind == MASK:
        def mod_fn(b, h, q_idx, kv_idx):
            return replay(b, h, q_idx, kv_idx)
    else:
        def mod_fn(score, b, h, q_idx, kv_idx):
            return replay(score, b, h, q_idx, kv_idx)
    mod = tracer.trace(mod_fn, kind, score_dtype=score_dtype, name="compiled_" + kind + "_mod")
    by_id = {id(t): i for i, t in enumerate(stand_ins)}
    return mod.key(), tuple(by_id[id(b)] for b in mod.buffers)


@torch.compiler.assume_constant_result
def _retyped(key: str, score_dtype: torch.dtype) -> tuple:
    """``(key, buffer slots)`` of the score mod ``key`` traced again with ``score_dtype`` (at
    compile time); slot i is the position, among the mod's buffers, of the copy's buffer i."""
    mod = template(key)
    typed = tracer.trace(mod, SCORE, score_dtype=score_dtype)
    by_id = {id(t): i for i, t in enumerate(mod.buffers)}
    return typed.key(), tuple(by_id[id(b)] for b in typed.buffers)


def capture(fn, kind: str, score_dtype: torch.dtype) -> tuple[str, list[torch.Tensor]]:
    """``(structural key, captured tensors)`` of a mod while Dynamo compiles (see module doc)."""
    if isinstance(fn, Mod):
        if kind == SCORE and (fn.score_dtype not in (None, score_dtype) or fn.ir.dtype != score_dtype):
            # as eagerly (`flexattn.call.resolve_score_mod`): a score mod of another score dtype (a
            # DSL mod's float32 one with float64 inputs) runs as its re-typed copy
            key, slots = _retyped(fn.key(), score_dtype)
            return key, [fn.buffers[i] for i in slots]
        return fn.key(), list(fn.buffers)
    ops, tensors, result = record(fn, kind, score_dtype)
    metas = tuple((t.dtype, tuple(t.shape)) for t in tensors)
    key, slots = _template(kind, score_dtype, ops, result, metas)
    return key, [tensors[i] for i in slots]
