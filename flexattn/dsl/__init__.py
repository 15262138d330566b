"""The flexattn mod DSL: attention score/mask mods as text, parsed with Lark straight into IR.

>>> import flexattn
>>> causal = flexattn.mask_mod("q_idx >= kv_idx")
>>> softcap = flexattn.score_mod("cap * tanh(score / cap)", cap=30.0)

See docs/dsl.md for the grammar.
"""

from flexattn.dsl.parser import (CONSTANTS, FUNCTIONS, DSLError, make_mod, mask_mod, parse, parse_with_buffers,
                                 score_mod)

__all__ = ["CONSTANTS", "DSLError", "FUNCTIONS", "make_mod", "mask_mod", "parse", "parse_with_buffers",
           "score_mod"]
