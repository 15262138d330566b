"""PagedKVCache: paged and contiguous caches give identical decode results."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import flexattn
from flexattn import decode
from flexattn.decode import decode_attention
from flexattn.paged import PagedKVCache
from flexattn.reference import attention_reference

PAGE = 16


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


def fill(cache, lengths, k, v):
    """Reserve pages for each sequence (interleaved, so pages are not in order) and write K/V."""
    B = len(lengths)
    for step in range(max(lengths) // PAGE + 1):
        for b in range(B):
            cache.reserve(b, min(lengths[b], (step + 1) * PAGE))
    pos = torch.arange(k.shape[2])[None, :].expand(B, -1)
    cache.assign(torch.arange(B, dtype=torch.int32), pos, k, v)


def test_assign_and_tables():
    cache = PagedKVCache(n_pages=10, page_size=PAGE, max_batch_size=3, num_heads=2, head_dim=8)
    k, v = torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    fill(cache, [40, 33], k, v)
    assert cache.capacity[:2] == [3, 3] and len(cache.empty_pages) == 4
    for b in range(2):
        phys = cache.physical_positions(torch.tensor([b]), torch.arange(33)[None])[0]
        torch.testing.assert_close(cache.k_cache[0][:, phys], k[b, :, :33], rtol=0, atol=0)
        pages = cache.page_table[b, :3].long()
        assert (cache.physical_to_logical[b, pages] == torch.arange(3, dtype=torch.int32)).all()
    cache.erase(0)
    assert cache.capacity[0] == 0 and (cache.page_table[0] == -1).all() and len(cache.empty_pages) == 7
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve(2, 20 * PAGE)
    with pytest.raises(ValueError, match="batch_idx"):
        cache.reserve(3, 5)


@pytest.mark.parametrize("Q_LEN,ratio", [(1, 4), (3, 3)])
def test_paged_matches_contiguous(Q_LEN, ratio):
    B, Hkv, E, MAXLEN = 2, 2, 16, 90
    lengths = [83, 47]
    torch.manual_seed(Q_LEN)
    k, v = torch.randn(B, Hkv, MAXLEN, E), torch.randn(B, Hkv, MAXLEN, E)
    q = torch.randn(B, Hkv * ratio, Q_LEN, E)
    cache = PagedKVCache(n_pages=14, page_size=PAGE, max_batch_size=B, num_heads=Hkv, head_dim=E)
    fill(cache, lengths, k, v)

    # Logical semantics: new tokens at pos_b = lengths[b] - Q_LEN, causal, per-batch fill.
    lens = torch.tensor(lengths, dtype=torch.int32)
    mask = flexattn.mask_mod("(q_idx + lens[b] - qlen >= kv_idx) & (kv_idx < lens[b])", lens=lens, qlen=Q_LEN)
    bias = torch.randn(Hkv * ratio)
    score = flexattn.score_mod("score + bias[h] * ((kv_idx % 5) - 2)", bias=bias)
    logical = create_block_mask(mask, B, None, Q_LEN, MAXLEN, device="cpu", BLOCK_SIZE=(max(Q_LEN, 1), PAGE))
    opts = {"SPLIT_KV": 2, "BLOCK_N": PAGE}

    contiguous = decode_attention(q, k, v, score_mod=score, mask_mod=mask, block_mask=logical, enable_gqa=True,
                                  return_lse=True, kernel_options=opts)
    physical = cache.convert_logical_block_mask(logical)
    paged = decode_attention(q, cache.k_cache, cache.v_cache, score_mod=cache.get_score_mod(score),
                             mask_mod=cache.get_mask_mod(mask), block_mask=physical, enable_gqa=True,
                             return_lse=True, kernel_options=opts)
    # Same tiles in the same order: bitwise equal.
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
    ref, ref_lse = attention_reference(q, k, v, score_mod=score, mask_mod=mask, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(paged[0].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged[1].double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_paged_dense_walk_masks_unowned_pages():
    """Without a BlockMask the kernel walks every physical page; the converted mask keeps only
    the sequence's own pages (another sequence's tokens must not leak in)."""
    B, H, E = 2, 2, 16
    k, v = torch.randn(B, H, 50, E), torch.randn(B, H, 50, E)
    q = torch.randn(B, H, 1, E)
    cache = PagedKVCache(n_pages=8, page_size=PAGE, max_batch_size=B, num_heads=H, head_dim=E)
    fill(cache, [50, 21], k, v)
    lens = torch.tensor([50, 21], dtype=torch.int32)
    mask = decode.valid_length(lens)
    out = decode_attention(q, cache.k_cache, cache.v_cache, mask_mod=cache.get_mask_mod(mask),
                           kernel_options={"SPLIT_KV": 3})
    ref = attention_reference(q, k, v, mask_mod=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert not math.isnan(out.sum().item())


@pytest.mark.parametrize("full", [True, False], ids=["full blocks", "partial blocks"])
def test_converted_mask_drops_blocks_the_slot_has_not_reserved(full):
    """A logical mask over more positions than a slot has pages for (48 against 32 and 16): the
    blocks without a page are dropped, not read from page 0 (slot 0 owns it: its tokens would count
    twice) or, in a full block, unmasked from another sequence's page."""
    H, E, MAXLEN = 2, 16, 48
    g = torch.Generator().manual_seed(2)
    cache = PagedKVCache(n_pages=6, page_size=PAGE, max_batch_size=2, num_heads=H, head_dim=E)
    k, v = torch.randn(2, H, 32, E, generator=g), torch.randn(2, H, 32, E, generator=g)
    fill(cache, [32, 16], k, v)
    q = torch.randn(2, H, 1, E, generator=g)
    every_other = None if full else (lambda b, h, q_idx, kv_idx: kv_idx % 2 == 0)
    logical = flexattn.create_block_mask(every_other or flexattn.noop_mask, 2, 1, 1, MAXLEN, device="cpu",
                                         BLOCK_SIZE=(16, PAGE))
    out = decode_attention(q, cache.k_cache, cache.v_cache, block_mask=cache.convert_logical_block_mask(logical))
    for b, n in enumerate([32, 16]):  # (each slot's own tokens only)
        ref = attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], mask_mod=every_other)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)


def _causal_fill(b, h, q_idx, kv_idx):
    """Python mask_mod (module-level constants, no DSL): new tokens at lengths[b] - 2."""
    lens = torch.tensor([83, 47], dtype=torch.int32)
    return (q_idx + lens[b] - 2 >= kv_idx) & (kv_idx < lens[b])


@pytest.mark.parametrize("maker", ["torch", "flexattn"])
def test_convert_keeps_python_mask_mod(maker):
    """A Python mask_mod on the logical BlockMask survives conversion: the converted BlockMask
    alone (no explicit mask_mod) gives the contiguous result."""
    create = create_block_mask if maker == "torch" else flexattn.create_block_mask
    B, H, E, MAXLEN = 2, 2, 16, 90
    torch.manual_seed(5)
    k, v, q = torch.randn(B, H, MAXLEN, E), torch.randn(B, H, MAXLEN, E), torch.randn(B, H, 2, E)
    cache = PagedKVCache(n_pages=14, page_size=PAGE, max_batch_size=B, num_heads=H, head_dim=E)
    fill(cache, [83, 47], k, v)
    logical = create(_causal_fill, B, None, 2, MAXLEN, device="cpu", BLOCK_SIZE=(16, PAGE))
    physical = cache.convert_logical_block_mask(logical)
    opts = {"SPLIT_KV": 2, "BLOCK_N": PAGE}
    paged = decode_attention(q, cache.k_cache, cache.v_cache, block_mask=physical, return_lse=True,
                             kernel_options=opts)
    contiguous = decode_attention(q, k, v, block_mask=logical, return_lse=True, kernel_options=opts)
    assert torch.equal(paged[0], contiguous[0]) and torch.equal(paged[1], contiguous[1])
    ref = attention_reference(q, k, v, mask_mod=_causal_fill)
    torch.testing.assert_close(paged[0].double(), ref, atol=1e-5, rtol=1e-5)


def test_assign_drops_writes_to_unreserved_positions():
    """Positions the slot does not own (unreserved page, past the table, negative) are not
    written anywhere; the owned ones in the same call are."""
    cache = PagedKVCache(n_pages=6, page_size=PAGE, max_batch_size=2, num_heads=2, head_dim=8)
    cache.reserve(0, 40)                         # 3 pages: positions 0..47
    cache.reserve(1, 16)
    k0, v0 = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    cache.assign(torch.tensor([0]), torch.arange(40)[None], k0, v0)
    before_k, before_v = cache.k_cache.clone(), cache.v_cache.clone()
    pos = torch.tensor([[45, 84, 200, -3]])      # owned, unreserved page 5, past all pages, negative
    k1, v1 = torch.randn(1, 2, 4, 8) + 10, torch.randn(1, 2, 4, 8) + 10
    cache.assign(torch.tensor([0]), pos, k1, v1)
    addr = cache.physical_positions(torch.tensor([0]), torch.tensor([[45]]))[0, 0]
    torch.testing.assert_close(cache.k_cache[0, :, addr], k1[0, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(cache.v_cache[0, :, addr], v1[0, :, 0], rtol=0, atol=0)
    before_k[0, :, addr], before_v[0, :, addr] = k1[0, :, 0], v1[0, :, 0]
    assert torch.equal(cache.k_cache, before_k) and torch.equal(cache.v_cache, before_v)
    assert (cache.physical_positions(torch.tensor([0]), pos)[0, 1:] == -1).all()
    with pytest.raises(RuntimeError, match="reserve"):
        cache.assign(torch.tensor([0]), pos, k1, v1, check=True)


@pytest.mark.parametrize("maker", ["flexattn", "torch"])
def test_converted_mask_ends_at_the_logical_kv_length(maker):
    """A logical mask over 20 positions with pages of 16: the last page's positions 20..31 (stale
    data of an earlier sequence) are not attended through the converted mask, also where the
    logical mask calls the block that crosses the length full (torch's create_block_mask)."""
    H, E, L = 2, 16, 20
    g = torch.Generator().manual_seed(7)
    cache = PagedKVCache(n_pages=4, page_size=PAGE, max_batch_size=1, num_heads=H, head_dim=E)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=g) * 3)
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=g) * 3)
    cache.reserve(0, L)
    k, v = torch.randn(1, H, L, E, generator=g), torch.randn(1, H, L, E, generator=g)
    q = torch.randn(1, H, 1, E, generator=g)
    cache.assign(torch.tensor([0]), torch.arange(L)[None], k, v)
    if maker == "torch":  # (both KV blocks full, the one of positions 16..31 too)
        from torch.nn.attention.flex_attention import BlockMask
        none, both = torch.zeros(1, 1, 1, dtype=torch.int32), torch.tensor([[[2]]], dtype=torch.int32)
        blocks = torch.tensor([[[[0, 1]]]], dtype=torch.int32)
        logical = BlockMask.from_kv_blocks(none, blocks, both, blocks, BLOCK_SIZE=(16, PAGE),
                                           mask_mod=flexattn.noop_mask, seq_lengths=(1, L))
    else:
        logical = flexattn.create_block_mask(flexattn.noop_mask, 1, 1, 1, L, device="cpu", BLOCK_SIZE=(16, PAGE))
    physical = cache.convert_logical_block_mask(logical)
    ref = attention_reference(q, k, v)
    for attend in (flexattn.flex_attention, decode_attention):
        out = attend(q, cache.k_cache, cache.v_cache, block_mask=physical)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_converted_batch_one_mask_reads_each_slot_pages():
    """A logical mask of batch 1 (one mask for every sequence) converted with batch_idx: query
    batch b reads slot batch_idx[b]'s pages (without it, as torch's, every batch reads slot 0's)."""
    B, H, E, L = 2, 2, 16, 32
    g = torch.Generator().manual_seed(8)
    cache = PagedKVCache(n_pages=6, page_size=PAGE, max_batch_size=B, num_heads=H, head_dim=E)
    k, v = torch.randn(B, H, L, E, generator=g), torch.randn(B, H, L, E, generator=g)
    q = torch.randn(B, H, 1, E, generator=g)
    fill(cache, [L, L], k, v)
    logical = flexattn.create_block_mask(flexattn.noop_mask, 1, 1, 1, L, device="cpu", BLOCK_SIZE=(16, PAGE))
    physical = cache.convert_logical_block_mask(logical, batch_idx=torch.arange(B))
    ref = attention_reference(q, k, v)
    for attend in (flexattn.flex_attention, decode_attention):
        out = attend(q, cache.k_cache, cache.v_cache, block_mask=physical)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("full", [True, False], ids=["full blocks", "partial blocks"])
def test_convert_takes_torch_kv_len(full):
    """torch's ``kv_len`` [B] argument: logical positions at or past kv_len[b] are masked, in
    full blocks too; batch_idx picks the slots."""
    B, H, E, MAX = 3, 2, 16, 48
    lengths, slots = [40, 21, 7], [2, 0, 3]
    g = torch.Generator().manual_seed(9)
    cache = PagedKVCache(n_pages=10, page_size=PAGE, max_batch_size=4, num_heads=H, head_dim=E)
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=g) * 3)
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=g) * 3)
    for b in range(B):
        cache.reserve(slots[b], lengths[b])
    k, v = torch.randn(B, H, MAX, E, generator=g), torch.randn(B, H, MAX, E, generator=g)
    q = torch.randn(B, H, 2, E, generator=g)
    cache.assign(torch.tensor(slots), torch.arange(MAX)[None].expand(B, -1), k, v)
    lens = torch.tensor(lengths)
    mask = flexattn.noop_mask if full else (lambda b, h, q_idx, kv_idx: kv_idx % 3 != 1)
    logical = flexattn.create_block_mask(mask, B, 1, 2, MAX, device="cpu", BLOCK_SIZE=(16, PAGE))
    physical = cache.convert_logical_block_mask(logical, torch.tensor(slots), kv_len=lens)
    ref = attention_reference(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: mask(b, h, q_idx, kv_idx)
                              & (kv_idx < lens[b]))
    for attend in (flexattn.flex_attention, decode_attention):
        out = attend(q, cache.k_cache, cache.v_cache, block_mask=physical)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_converted_score_mod_alone_masks_unowned_pages():
    """As torch's get_score_mod: without a mask (a dense walk over the whole cache) the converted
    score_mod gives -inf on pages the slot does not own (another sequence's, free ones); a slot
    that owns nothing gets zeros."""
    B, H, E = 3, 2, 16
    lengths = [32, 16, 0]
    g = torch.Generator().manual_seed(10)
    cache = PagedKVCache(n_pages=6, page_size=PAGE, max_batch_size=B, num_heads=H, head_dim=E)
    k, v = torch.randn(B, H, 32, E, generator=g), torch.randn(B, H, 32, E, generator=g)
    q = torch.randn(B, H, 1, E, generator=g)
    fill(cache, lengths, k, v)
    score = lambda s, b, h, q_idx, kv_idx: s - 0.1 * kv_idx  # noqa: E731
    for attend in (flexattn.flex_attention, decode_attention):
        out = attend(q, cache.k_cache, cache.v_cache, score_mod=cache.get_score_mod(score))
        for b, n in enumerate(lengths):
            ref = attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], score_mod=score) if n \
                else torch.zeros(1, H, 1, E, dtype=torch.float64)
            torch.testing.assert_close(out[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)
