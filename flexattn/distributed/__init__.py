"""Context parallelism: attention over sequences sharded across torch.distributed ranks.

    shard(x, group_or_mesh, seq_dim, load_balance)     this rank's shard of a whole sequence
    unshard(x, group_or_mesh, seq_dim, load_balance)   the whole sequence from every rank's shard
    create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, group_or_mesh, load_balance)
                                                       this rank's tables against every KV shard
    flex_attention(q, k, v, score_mod, block_mask, ..., method="ring" | "allgather")

Layouts (``load_balance``): None (`Contiguous`), "head_tail" (`HeadTail`, torch's zigzag) and
`PerDocument(lengths)`, `WholeDocuments(lengths)`. NCCL on CUDA tensors, gloo on CPU tensors. See docs/distributed.md.
"""

from flexattn.distributed.attention import flex_attention
from flexattn.distributed.checks import DistributedMismatchError
from flexattn.distributed.layout import Contiguous, HeadTail, Layout, PerDocument, WholeDocuments
from flexattn.distributed.masks import DistributedBlockMask, create_block_mask
from flexattn.distributed.shard import shard, unshard

__all__ = ["flex_attention", "create_block_mask", "DistributedBlockMask", "shard", "unshard", "Layout",
           "Contiguous", "HeadTail", "PerDocument", "WholeDocuments",
           "DistributedMismatchError"]
