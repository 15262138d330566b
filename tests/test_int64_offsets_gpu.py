"""K/V of more than 2**31 elements: the kernels must address them with 64-bit offsets.

64 heads of 2**19 + 3 keys of dimension 64 is 2**31 + 12288 elements per tensor (4.3 GB in
float16 each): the last heads live past the int32 range. Forward (block-sparse kernel) and
decoding (split-KV kernel) are checked on the first and last heads against float64, through the
helper that bounds the kernel's error by a small multiple of eager float16's. Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import testing

import flexattn
from flexattn.reference import attention_reference

pytestmark = pytest.mark.gpu

H, S, E = 64, 2**19 + 3, 64
HEADS = [0, H // 2, H - 1]  # the last one starts past element 2**31


def _check_heads(q, k, v, out, lse):
    for h in HEADS:
        sl = slice(h, h + 1)
        ref, ref_lse = attention_reference(q[:, sl], k[:, sl], v[:, sl], return_lse=True)
        eager, eager_lse = attention_reference(q[:, sl], k[:, sl], v[:, sl], return_lse=True, dtype=q.dtype)
        testing.assert_close_to_reference(out[:, sl], eager, ref, name=f"out head {h}")
        testing.assert_close_to_reference(lse[:, sl], eager_lse.float(), ref_lse, name=f"lse head {h}")


@pytest.mark.parametrize("q_len", [77, 1], ids=["forward", "decoding"])
def test_kv_beyond_int32_offsets(q_len):
    assert H * S * E > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, H, S, E, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(1, H, S, E, device="cuda", dtype=torch.float16, generator=g)
    q = torch.randn(1, H, q_len, E, device="cuda", dtype=torch.float16, generator=g)
    # a few distinctive keys at the very end, so that reading the wrong place shows
    k[:, :, -3:] = 4.0
    v[:, :, -3:] = torch.arange(3, device="cuda", dtype=torch.float16)[:, None] + 1
    with torch.no_grad():
        out, lse = flexattn.flex_attention(q, k, v, return_lse=True)
    _check_heads(q, k, v, out, lse)
