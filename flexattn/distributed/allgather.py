"""The all-gather method: one all-gather of K/V, one attention call, a reduce-scatter of dK/dV.

For short sequences and GQA with few KV heads, where a ring's P steps cost more than moving the
whole K/V once. Shards of unequal length travel padded to the longest. gloo has no
reduce-scatter: there dK/dV are all-reduced and each rank keeps its own slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexattn.distributed import checks


class AllGather:
    def __init__(self, block_mask):
        self.bm = block_mask
        self.group = block_mask.group
        self.lengths = [p.numel() for p in block_mask.kvpos]
        self.P, self.rank = block_mask.world_size, block_mask.rank

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        longest = max(self.lengths)
        padded = t.contiguous() if t.shape[2] == longest else \
            torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[2]))
        parts = [torch.empty_like(padded) for _ in range(self.P)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:, :, :n] for p, n in zip(parts, self.lengths)], dim=2)

    def _scatter_sum(self, t: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
        """Sum over ranks of ``t`` (all KV shards in rank order) in ``acc_dtype``, this rank's
        slice. The shards are laid out rank-major (padded to the longest) and converted in one
        copy each."""
        longest = max(self.lengths)
        B, H, _, D = t.shape
        stacked = t.new_empty((self.P * B, H, longest, D), dtype=acc_dtype)
        start = 0
        for i, n in enumerate(self.lengths):
            stacked[i * B:(i + 1) * B, :, :n].copy_(t[:, :, start:start + n])
            stacked[i * B:(i + 1) * B, :, n:].zero_()
            start += n
        if "nccl" in checks.backend_of(self.group):
            out = stacked.new_empty(stacked.shape[0] // self.P, *stacked.shape[1:])
            dist.reduce_scatter_tensor(out, stacked, group=self.group)
        else:
            dist.all_reduce(stacked, group=self.group)
            out = stacked.chunk(self.P)[self.rank]
        return out[:, :, :self.lengths[self.rank]]

    def forward(self, q, k, v, pair):
        k_all, v_all = self._gather(k), self._gather(v)
        mask, kvpos = self.bm.gathered()
        if mask is None:
            return None, None, None
        return pair.forward(q, k_all, v_all, mask, self.bm.qpos, kvpos)

    def backward(self, q, k, v, out, lse, dout, dlse, pair, need, acc_dtype):
        k_all, v_all = self._gather(k), self._gather(v)
        mask, kvpos = self.bm.gathered()
        if mask is None:
            dq, grads = None, []
            dk_all = k_all.new_zeros(k_all.shape, dtype=acc_dtype)
            dv_all = v_all.new_zeros(v_all.shape, dtype=acc_dtype)
        else:
            dq, dk_all, dv_all, g = pair.backward(q, k_all, v_all, out, lse, dout, dlse, mask, self.bm.qpos, kvpos, need)
            grads = [g]
        return dq, self._scatter_sum(dk_all, acc_dtype), self._scatter_sum(dv_all, acc_dtype), grads
