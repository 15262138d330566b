"""One (query shard, KV shard) pair: flexattn's single-GPU forward and backward at global positions.

The forward is `flexattn.flex_attention` with ``return_lse=True``; the backward is flexattn's
backward op's work (`flexattn.ops.run_backward`) given the *merged* output and LSE, which makes
each pair's gradient exactly its share of the whole (P recomputed from the global LSE, delta from
the global output).
"""

from __future__ import annotations

import flexattn
from flexattn import ops
from flexattn.auxiliary import AuxRequest
from flexattn.distributed.masks import SCORE, at_global_positions
from flexattn.kernels.tables import tables_of


class Pair:
    """What every step of one call shares: the score mod (a `flexattn.Mod` with its captured
    tensors), scale, GQA, kernel options, the score dtype and whether the forward also gives the
    rows' max scores (``want_max``). A step passes the global positions of its query rows
    (``qpos``) and of the KV it holds (``kvpos``)."""

    def __init__(self, score, scale: float, enable_gqa: bool, options: dict, stat_dtype, want_max: bool = False):
        self.score, self.scale = score, scale
        self.enable_gqa, self.options, self.stat_dtype = enable_gqa, options, stat_dtype
        self.want_max = want_max

    def score_at(self, qpos, kvpos):
        return at_global_positions(self.score, SCORE, self.stat_dtype, qpos, kvpos)

    def forward(self, q, k, v, block_mask, qpos, kvpos):
        """``(out, lse, max_scores or None)`` of the pair (max_scores where the call asked for them)."""
        score, _ = self.score_at(qpos, kvpos)
        out, aux = flexattn.flex_attention(q, k, v, score_mod=score, block_mask=block_mask, scale=self.scale,
                                           enable_gqa=self.enable_gqa, kernel_options=self.options or None,
                                           return_aux=AuxRequest(lse=True, max_scores=self.want_max))
        return out, aux.lse, aux.max_scores

    def backward(self, q, k, v, out, lse, dout, dlse, block_mask, qpos, kvpos, need: tuple):
        """``(dq, dk, dv, grads)``: ``grads[i]`` is the gradient of the score mod's captured
        tensor i (None where ``need[i]`` is False). The backward op's work, called without the
        dispatcher (this runs inside the distributed op, eagerly), on the mask's launch tables."""
        score, origin = self.score_at(qpos, kvpos)
        step_need = [o is not None and need[o] for o in origin]
        t = tables_of(block_mask)
        mask = block_mask.mod
        spec = ops.spec(score.key(), mask.key(), ops.block_of(t), self.enable_gqa, tuple(sorted(self.options.items())),
                        False)
        dq, dk, dv, _, step_grads = ops.run_backward(
            q, k, v, out, lse, dout, dlse, None, list(score.buffers), list(mask.buffers), t, spec, self.scale,
            step_need)
        grads = [None] * len(self.score.buffers)
        for o, g, n in zip(origin, step_grads, step_need):
            if n:
                grads[o] = g
        return dq, dk, dv, grads
