"""flexattn: attention score/mask modifications compiled into fused Triton kernels.

Public API (same names, shapes and meaning as ``torch.nn.attention.flex_attention``):
``flex_attention``, ``create_block_mask``, ``BlockMask``, ``and_masks``, ``or_masks``,
``noop_mask``, ``create_mask``; ``varlen_attention`` (packed variable-length sequences: torch's
``varlen_attn`` with mods); plus ``trace`` (Python mod -> `Mod`), and ``score_mod`` /
``mask_mod`` (DSL text -> `Mod`); ``AuxRequest`` / ``AuxOutput`` (``return_aux``).

Submodules, imported on first use: ``flexattn.masks`` and ``flexattn.scores`` (ready-made mods),
``flexattn.decode`` (decoding helpers), ``flexattn.paged`` (paged KV cache), ``flexattn.viz``
(pictures), ``flexattn.integrations`` (transformers).
"""

from __future__ import annotations

import importlib

from flexattn.version import __version__

# name -> module that defines it; imported on first use so that `import flexattn` stays cheap.
_EXPORTS = {
    "Mod": "flexattn.mods",
    "trace": "flexattn.tracer",
    "TraceError": "flexattn.tracer",
    "score_mod": "flexattn.dsl",
    "mask_mod": "flexattn.dsl",
    "DSLError": "flexattn.dsl",
    "flex_attention": "flexattn.attention",
    "varlen_attention": "flexattn.varlen",
    "BlockMask": "flexattn.block_mask",
    "create_block_mask": "flexattn.block_mask",
    "create_mask": "flexattn.block_mask",
    "and_masks": "flexattn.block_mask",
    "or_masks": "flexattn.block_mask",
    "noop_mask": "flexattn.block_mask",
    "AuxRequest": "flexattn.auxiliary",
    "AuxOutput": "flexattn.auxiliary",
}
# Submodules reachable as attributes (``flexattn.masks.causal``) without importing them by hand.
_SUBMODULES = ("masks", "scores", "decode", "paged", "viz", "integrations")

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"flexattn.{name}")
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flexattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__ + list(_SUBMODULES)
