"""flexattn.integrations.transformers.block_mask's padding, with an explicit mask function (runs
without transformers installed)."""

from __future__ import annotations

import torch

from flexattn.integrations import transformers as fa_hf
from flexattn.reference import dense_block_mask


def test_columns_past_a_short_all_ones_padding_mask_are_padding():
    """Columns past the padding mask's end are padding, also when the columns it has are all real
    tokens (that mask used to be dropped before it was extended)."""
    def everything(b, h, q, kv):
        return q >= 0

    for am in (torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 1, 1, 1]])):
        bm = fa_hf.block_mask(1, 3, 6, mask_function=everything, attention_mask=am)
        want = torch.cat([am.bool(), torch.zeros(1, 2, dtype=torch.bool)], 1).expand(3, 6)
        assert torch.equal(dense_block_mask(bm, 1, 1, 3, 6)[0, 0], want)
    # only the columns the mask reads count: padding before kv_offset or past the end is not read
    bm = fa_hf.block_mask(1, 3, 4, kv_offset=1, mask_function=everything, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 0]]))
    assert torch.equal(dense_block_mask(bm, 1, 1, 3, 4), torch.ones(1, 1, 3, 4, dtype=torch.bool))
