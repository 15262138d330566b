"""Mask mods: ``noop_mask``, ``and_masks`` / ``or_masks`` (torch's), and `as_mod` (any mask_mod as a `Mod`)."""

from __future__ import annotations

from typing import Callable

import torch

from flexattn import ir
from flexattn.mods import MASK, Mod
from flexattn.tracer import trace

try:
    from torch.nn.attention.flex_attention import noop_mask as _torch_noop_mask
except ImportError:  # pragma: no cover - a torch without flex_attention
    _torch_noop_mask = None


def noop_mask(batch, head, token_q, token_kv):
    """A mask_mod that keeps everything."""
    return batch.new_ones(size=(), dtype=torch.bool, device=batch.device)


def _sliced_mask_mod_error(batch, head, token_q, token_kv):
    """The mask_mod of a sliced BlockMask: it only raises. Named as torch's, whose sliced masks
    carry one of this name too (`flexattn.viz` tells both apart from real mask_mods by it)."""
    raise RuntimeError(
        "Cannot use mask_mod from a sliced BlockMask: slicing resets mask_mod. Take the mask_mod "
        "from the original (unsliced) BlockMask instead."
    )


def is_noop_mask(fn) -> bool:
    """Whether ``fn`` is flexattn's or torch's ``noop_mask``."""
    return fn is noop_mask or (_torch_noop_mask is not None and fn is _torch_noop_mask)


def _shift_buffers(root: ir.Node, offset: int) -> ir.Node:
    """``root`` with every captured-buffer index moved up by ``offset`` (to merge two mods)."""
    if offset == 0:
        return root
    memo: dict[int, ir.Node] = {}
    for n in ir.toposort(root):
        src = tuple(memo[id(s)] for s in n.src)
        if n.op == "load":
            b = n.arg
            memo[id(n)] = ir.load(ir.Buffer(b.index + offset, b.name, b.dtype, b.ndim), src)
        elif any(a is not s for a, s in zip(src, n.src)):
            memo[id(n)] = ir.rebuild(n, src)
        else:
            memo[id(n)] = n
    return memo[id(root)]


def _combine(op: str, mods: list[Mod], name: str) -> Mod:
    root, buffers = None, []
    for m in mods:
        r = _shift_buffers(m.ir, len(buffers))
        buffers += list(m.buffers)
        root = r if root is None else ir.binary(op, root, r)
    return Mod(MASK, root, buffers, name=name, source=f"{name}({', '.join(m.name for m in mods)})")


def _check_callables(fn_name: str, mask_mods) -> None:
    for i, m in enumerate(mask_mods):
        if not callable(m):
            raise TypeError(f"{fn_name}() expects mask_mod callables; argument {i} is {type(m).__name__}")


def and_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that keeps what every one of ``mask_mods`` keeps (torch's ``and_masks``).

    Mods that are already `Mod` objects combine into one `Mod`; Python functions combine into a
    Python function, traced when used.

    Example::

        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> window = lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 256
        >>> sliding_causal = and_masks(causal, window)
    """
    _check_callables("and_masks", mask_mods)
    if mask_mods and all(isinstance(m, Mod) and m.kind == MASK for m in mask_mods):
        return _combine("and_", list(mask_mods), "and_mask")

    def and_mask(b, h, q_idx, kv_idx):
        result = b.new_ones((), dtype=torch.bool)
        for mask in mask_mods:
            result = result & mask(b, h, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod that keeps what any of ``mask_mods`` keeps (torch's ``or_masks``).

    Example::

        >>> prefix = lambda b, h, q_idx, kv_idx: kv_idx < 64
        >>> causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
        >>> prefix_lm = or_masks(prefix, causal)
    """
    _check_callables("or_masks", mask_mods)
    if mask_mods and all(isinstance(m, Mod) and m.kind == MASK for m in mask_mods):
        return _combine("or_", list(mask_mods), "or_mask")

    def or_mask(b, h, q_idx, kv_idx):
        result = b.new_zeros((), dtype=torch.bool)
        for mask in mask_mods:
            result = result | mask(b, h, q_idx, kv_idx)
        return result

    return or_mask


def as_mod(fn, kind: str = MASK, arg: str = "mask_mod") -> Mod:
    """``fn`` (a `Mod`, a Python mod, or ``noop_mask``) as a traced `Mod` of ``kind``."""
    if isinstance(fn, Mod):
        if fn.kind != kind:
            raise TypeError(f"{arg} must be a {kind}_mod, got a {fn.kind}_mod '{fn.name}'")
        return fn
    if not callable(fn):
        raise TypeError(f"{arg} must be a callable {kind}_mod or a flexattn Mod, got {type(fn).__name__}")
    if kind == MASK and is_noop_mask(fn):
        return Mod(MASK, ir.const(True), (), name="noop_mask", fn=fn)
    if fn is _sliced_mask_mod_error:
        _sliced_mask_mod_error(None, None, None, None)
    return trace(fn, kind=kind)
