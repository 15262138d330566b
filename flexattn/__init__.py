"""flexattn: attention score/mask modifications compiled into fused Triton kernels.

Public API (same names, shapes and meaning as ``torch.nn.attention.flex_attention``):
``flex_attention``, ``create_block_mask``, ``BlockMask``, ``and_masks``, ``or_masks``,
``noop_mask``, ``create_mask``; plus ``trace`` (Python mod -> `Mod`), and ``score_mod`` /
``mask_mod`` (DSL text -> `Mod`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> module that defines it; imported on first use so that `import flexattn` stays cheap.
_EXPORTS = {
    "Mod": "flexattn.mods",
    "trace": "flexattn.tracer",
    "TraceError": "flexattn.tracer",
    "score_mod": "flexattn.dsl",
    "mask_mod": "flexattn.dsl",
    "DSLError": "flexattn.dsl",
    "flex_attention": "flexattn.attention",
    "BlockMask": "flexattn.block_mask",
    "create_block_mask": "flexattn.block_mask",
    "create_mask": "flexattn.block_mask",
    "and_masks": "flexattn.block_mask",
    "or_masks": "flexattn.block_mask",
    "noop_mask": "flexattn.block_mask",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flexattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
