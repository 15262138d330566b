"""`BlockMask` and `create_block_mask`: which KV tiles each query tile must visit.

Same fields, layout and meaning as ``torch.nn.attention.flex_attention.BlockMask``:

    kv_num_blocks [B, H, nQ]        number of *partial* KV tiles of each query tile (mask needed)
    kv_indices    [B, H, nQ, nKV]   those tiles in ascending order, then all other tiles ascending
    full_kv_*                       the same for *full* tiles (mask all true: no mask work)
    q_*, full_q_*                   the transpose, [B, H, nKV] / [B, H, nKV, nQ], for the backward

with ``BLOCK_SIZE = (Q_BLOCK, KV_BLOCK)``, ``seq_lengths = (Q_LEN, KV_LEN)`` and ``mask_mod``
(the user's callable, kept as given). Elements past Q_LEN / KV_LEN count as masked out, so a tile
cut by the sequence end is partial at most, as in torch. All tensors are int32.

Unlike torch's eager version, `create_block_mask` never builds the dense B x H x Q_LEN x KV_LEN
mask. It classifies tiles: interval analysis of the mask's IR (`flexattn.interval`) decides most
tiles outright (causal, sliding window, prefix-LM, documents), and only the undecided ones are
evaluated element by element. On the GPU one generated Triton kernel does both and two more write
the index tables (`flexattn.kernels.mask_tiles`); on the CPU the same steps run as chunked
torch ops. Memory is O(B * H * nQ * nKV) either way.

The package: `mask_mods` (noop_mask, and_masks / or_masks, as_mod), `sizes` (block sizes and
lengths: defaults and argument checks), `blockmask` (the `BlockMask` type), `create`
(`create_block_mask`, `create_mask`: tile classification, table building, the custom op). The
tables' layout, checks and transpose, shared with the kernels, are in `flexattn.kernels.tables`.
"""

from flexattn.block_mask.blockmask import BlockMask
from flexattn.block_mask.create import create_block_mask, create_mask
from flexattn.block_mask.mask_mods import and_masks, as_mod, is_noop_mask, noop_mask, or_masks
from flexattn.kernels.tables import validate_block_tables

__all__ = ["BlockMask", "and_masks", "as_mod", "create_block_mask", "create_mask", "is_noop_mask", "noop_mask",
           "or_masks", "validate_block_tables"]
