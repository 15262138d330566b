"""Captured int64 tables that a mask only compares, read by the kernels as int32 ranks.

Document masks written as torch's examples write them capture int64 ids (``torch.arange`` and
``torch.repeat_interleave`` make int64): ``doc[q_idx] == doc[kv_idx]``. A 64-bit value takes two
registers where a 32-bit one takes one, in every tile the kernels evaluate the mask on, and the
Hopper backward then spills. Where every value read from such a tensor is only compared with
another value read from the same tensor (==, !=, <, <=, >, >=), each element can be replaced by its
rank among the tensor's elements and 0, counted from 0's (a read past the tensor's end is 0, which
must stay 0 and keep its place among the values): no comparison changes, and ranks fit in int32.
`ranked` finds those tensors in a traced mask and computes the ranks on their device (a sort and
two searches, no host sync). flexattn's `create_block_mask` builds its tables from the ranked mask
and keeps it on the mask with the tensors' in-place modification counters (`remember`,
`Ranked.current`); a call ranks the tensors of any other block mask (torch's) once per mask object
(`for_call`), and again after they are modified in place, so that the mask compares their values as
they are now; under torch.compile the graph ranks them at each call (`in_graph`). A change that
bypasses a tensor's version counter (a write through ``.data``, a torch.distributed collective
that writes into it, another library's view of its memory) is not seen; while a CUDA graph is
captured the kernels read the tensors themselves.
"""

from __future__ import annotations

import torch

from flexattn import ir
from flexattn.lru import LRU
from flexattn.mods import Mod, template

_MAX_RANKED = 2**31 - 2  # elements: a rank's size is below the element count plus one (0)

# mask key -> (indices of the ranked buffers, the ranked mask over meta stand-ins) or None
_TEMPLATES = LRU(1024)


def compared_only(root: ir.Node) -> tuple[int, ...]:
    """The indices of the int64 buffers that ``root`` reads only to compare a value read from the
    buffer with another value read from it."""
    loads: dict[int, int] = {}  # id(load node) -> buffer index
    for n in ir.toposort(root):
        if n.op == "load" and n.arg.dtype == torch.int64:
            loads[id(n)] = n.arg.index
    if not loads:
        return ()
    ok = set(loads.values())
    if id(root) in loads:
        ok.discard(loads[id(root)])
    for n in ir.toposort(root):
        for s in n.src:
            i = loads.get(id(s))
            if i is None:
                continue
            if n.op not in ir.COMPARISONS or any(loads.get(id(o)) != i for o in n.src):
                ok.discard(i)
    return tuple(sorted(ok))


def _template(mod: Mod):
    """(indices, ranked mask over meta stand-ins) for ``mod``'s structure, or None: made once per key."""
    return _TEMPLATES.get_or_make(mod.key(), lambda: _make_template(mod))


def _make_template(mod: Mod):
    which = compared_only(mod.ir)
    if not which:
        return None
    wanted = set(which)

    def narrow(n: ir.Node):
        if n.op == "load" and n.arg.index in wanted:
            b = n.arg
            return ir.load(ir.Buffer(b.index, b.name, torch.int32, b.ndim), n.src)
        return None

    stand_ins = [torch.empty((0,) * t.dim(), dtype=torch.int32 if i in wanted else t.dtype, device="meta")
                 for i, t in enumerate(mod.buffers)]
    return which, Mod(mod.kind, ir.substitute(mod.ir, narrow), stand_ins, mod.name, mod.source)


class Ranked:
    """A mask with some captured int64 tensors replaced by their int32 ranks (`ranked`), valid
    while those tensors are not modified in place."""

    __slots__ = ("mod", "sources", "versions")

    def __init__(self, mod: Mod, sources: tuple[torch.Tensor, ...], versions: tuple[int, ...]):
        self.mod, self.sources, self.versions = mod, sources, versions

    def current(self) -> Mod | None:
        """The ranked mask, or None where a ranked tensor was modified in place since."""
        for t, v in zip(self.sources, self.versions):
            if t._version != v:
                return None
        return self.mod


def ranked(mod: Mod) -> Ranked | None:
    """``mod`` with every captured int64 tensor it only compares (`compared_only`) replaced by
    its elements' ranks (int32, on the tensor's device), or None where there is none to replace:
    no such tensor, a mod traced again at each call (it reads a tensor's value on the host), a
    tensor of 2**31 elements or more, or an inference tensor (it has no modification counter)."""
    if mod.kind != "mask" or mod.host_values or not _any_int64(mod.buffers):
        return None
    made = _template(mod)
    if made is None:
        return None
    which, narrowed = made
    sources = tuple(mod.buffers[i] for i in which)
    if any(t.numel() > _MAX_RANKED or t.is_inference() for t in sources):
        return None
    buffers = list(mod.buffers)
    with torch.no_grad():
        for i, t in zip(which, sources):
            buffers[i] = _ranks(t)
    return Ranked(narrowed.rebind(buffers), sources, tuple(t._version for t in sources))


def _any_int64(buffers) -> bool:
    for t in buffers:  # (a loop, not any(): every call of a mask asks)
        if t.dtype == torch.int64:
            return True
    return False


def _ranks(t: torch.Tensor) -> torch.Tensor:
    """Each element of the integer tensor ``t`` as its rank among the elements of ``t`` and 0,
    counted from 0's, int32, on ``t``'s device: equal where ``t`` is equal, in the same order, 0
    where ``t`` is 0 (negative below it)."""
    flat = t.reshape(-1)
    values = torch.cat([flat, flat.new_zeros(1)]).sort().values
    zero = torch.searchsorted(values, flat.new_zeros(1), out_int32=True)
    return torch.searchsorted(values, t, out_int32=True) - zero.reshape((1,) * t.dim())


_ATTR = "_flexattn_ranked"  # on a block mask: (mask key, tensors, Ranked or None), its last ranks


def remember(block_mask, mod: Mod, made: Ranked | None) -> None:
    """Keep ``made`` (`ranked` of ``mod``, over ``mod``'s tensors) on ``block_mask`` for its calls
    (`for_call`); an object that takes no attributes is ranked again at each call."""
    try:
        setattr(block_mask, _ATTR, (mod.key(), tuple(mod.buffers), made))
    except AttributeError:
        pass


def for_call(block_mask, mod: Mod, buffers: tuple, device: torch.device) -> tuple[Mod, tuple]:
    """The mask a call on ``device`` runs for ``block_mask``, whose mask is ``mod`` over ``buffers``
    (this call's tensors): with the int64 tensors it only compares as int32 ranks, those kept on
    the mask (`remember`: by `create_block_mask`, or by an earlier call) while they are for this
    mask and tensors and current, else made here and kept, so that the call compares the tensors'
    values as they are now (a mask_mod assigned later, tensors modified in place, torch's block
    masks). Not while a CUDA graph is captured: a replay reads the tensors the capture recorded,
    and only the mask's own tensors show it what changed in place between replays."""
    if not _any_int64(buffers) or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return mod, buffers
    key = mod.key()
    cached = getattr(block_mask, _ATTR, None)
    # (a flexattn mask's call passes its mod's own tuple of tensors: the same object each call)
    if cached is not None and cached[0] == key and (cached[1] is buffers or len(cached[1]) == len(buffers) and
                                                    all(a is b for a, b in zip(cached[1], buffers))):
        if cached[2] is None:
            return mod, buffers
        current = cached[2].current()
        if current is not None:
            return current, current.buffers
    mod = mod if buffers is mod.buffers else mod.rebind(buffers)
    made = ranked(mod)
    remember(block_mask, mod, made)
    return (mod, buffers) if made is None else (made.mod, made.mod.buffers)


def in_graph(key: str, buffers: list) -> tuple[str, list]:
    """While torch.compile traces a call: the mask of structural key ``key`` over ``buffers``, with
    the int64 tensors it only compares replaced by their int32 ranks, computed in the graph (a
    sort and two searches per call: a compiled graph keeps nothing between calls)."""
    if not _any_int64(buffers):
        return key, buffers
    made = _ranked_key(key)
    if not made:
        return key, buffers
    ranked_key, which = made
    buffers = list(buffers)
    for i in which:  # (no size check, as `ranked` makes: it would guard a symbolic size)
        buffers[i] = _ranks(buffers[i])
    return ranked_key, buffers


@torch.compiler.assume_constant_result
def _ranked_key(key: str) -> tuple:
    """(structural key of the ranked mask, indices of the ranked tensors) of the mask known by
    ``key``, or () where it has none to rank: a constant to torch.compile, found at compile time."""
    made = _template(template(key))
    return () if made is None else (made[1].key(), made[0])
