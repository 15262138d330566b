"""flexattn.masks: each family against its dense definition, in flexattn and in torch's flex_attention."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import masks
from flexattn.call import resolve_mask_mod
from flexattn.reference import attention_reference

S = 45  # not a multiple of the block size: tiles cut by the sequence end


def grid(Q=S, KV=S):
    return torch.arange(Q).view(Q, 1), torch.arange(KV).view(1, KV)


# Each case: (mask_mod, B, dense [B or 1, Q, KV] definition written directly from the docstring).
def _cases():
    q, kv = grid()
    doc_lengths = [10, 1, 20, 14]
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(doc_lengths))
    doc_b = torch.stack([doc, torch.repeat_interleave(torch.tensor([7, 3]), torch.tensor([30, 15]))])
    r, c = q // 9, q % 9  # natten: a 5 x 9 image (45 pixels), 3 x 5 kernel
    rk, ck = kv // 9, kv % 9
    cr, cc = r.clamp(1, 5 - 2), c.clamp(2, 9 - 3)
    prefix = torch.tensor([4, 11])
    return {
        "causal": (masks.causal, 1, q >= kv),
        "sliding_window": (masks.sliding_window(7), 1, (kv <= q) & (kv > q - 7)),
        "chunked": (masks.chunked(16), 1, (q // 16 == kv // 16) & (kv <= q)),
        "chunked_bidirectional": (masks.chunked(12, causal=False), 1, q // 12 == kv // 12),
        "prefix_lm": (masks.prefix_lm(5), 1, (kv < 5) | (kv <= q)),
        "prefix_lm_per_batch": (masks.prefix_lm(prefix), 2,
                                (kv < prefix.view(2, 1, 1)) | (kv <= q)),
        "document_ids": (masks.document(doc), 1, doc[q] == doc[kv]),
        "document_lengths_causal": (masks.document(lengths=doc_lengths, causal=True), 1,
                                    (doc[q] == doc[kv]) & (kv <= q)),
        "document_offsets": (masks.document(offsets=torch.tensor([0, 10, 11, 31, 45])), 1, doc[q] == doc[kv]),
        "document_per_batch": (masks.document(doc_b, causal=True), 2,
                               (doc_b[:, :, None] == doc_b[:, None, :]) & (kv <= q)),
        "dilated_sliding_window": (masks.dilated_sliding_window(12, 3), 1,
                                   (q - kv >= 0) & (q - kv < 12) & ((q - kv) % 3 == 0)),
        "global_tokens": (masks.global_tokens(3), 1, (q < 3) | (kv < 3)),
        "natten": (masks.natten(9, 3, 5, image_height=5), 1,
                   ((cr - rk).abs() <= 1) & ((cc - ck).abs() <= 2)),
    }


CASES = _cases()


@pytest.mark.parametrize("name", CASES)
def test_dense_definition(name):
    mod, B, want = CASES[name]
    want = want.expand(B, S, S).unsqueeze(1)
    got = flexattn.create_mask(mod, B, 1, S, S, device="cpu")
    assert torch.equal(got, want), name
    # the same function in torch's own create_mask (vmap over b, h, q_idx, kv_idx)
    assert torch.equal(torch_flex.create_mask(mod, B, 1, S, S, device="cpu"), want), name


@pytest.mark.parametrize("name", CASES)
def test_block_tables_match_torch(name):
    mod, B, _ = CASES[name]
    ours = flexattn.create_block_mask(mod, B, 2, S, S, device="cpu", BLOCK_SIZE=16)
    theirs = torch_flex.create_block_mask(mod, B, 2, S, S, device="cpu", BLOCK_SIZE=16)
    for field in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), (name, field)


@pytest.mark.parametrize("name", ["sliding_window", "document_per_batch", "natten", "prefix_lm_per_batch"])
def test_in_flex_attention_and_torch_flex_attention(name):
    mod, B, want = CASES[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, S, 16, generator=g) for _ in range(3))
    ref = attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: want.expand(B, S, S)[b, qi, ki])
    bm = flexattn.create_block_mask(mod, B, None, S, S, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(flexattn.flex_attention(q, k, v, block_mask=bm).double(), ref, atol=1e-5, rtol=1e-5)
    tbm = torch_flex.create_block_mask(mod, B, None, S, S, device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "called without torch.compile" notice
        out = torch_flex.flex_attention(q, k, v, block_mask=tbm)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_names_and_docstrings():
    made = [masks.causal, masks.sliding_window(8), masks.chunked(4), masks.prefix_lm(2),
            masks.document(lengths=[2, 3]), masks.dilated_sliding_window(8, 2), masks.global_tokens(1),
            masks.natten(8, 3)]
    names = [m.__name__ for m in made]
    assert names == ["causal", "sliding_window_8", "chunked_causal_4", "prefix_lm_2", "document",
                     "dilated_sliding_window_8_2", "global_tokens_1", "natten_8x8_3x3"]
    for fn in (getattr(masks, n) for n in masks.__all__):
        assert "Example::" in fn.__doc__, fn.__name__


@pytest.mark.parametrize("given", [{"lengths": [2, 3]}, {"offsets": torch.tensor([0, 2, 5])},
                                   {"document_ids": torch.tensor([[0, 0, 1, 1, 1]])}])
def test_document_ids_live_on_the_given_device(given):
    """The ids the mask reads are made on ``device`` (the block mask's), else where the given
    tensor is (the CPU for a list): a mask for a GPU needs no tensor moved by hand."""
    assert flexattn.trace(masks.document(**given), "mask").buffers[0].device.type == "cpu"
    on_meta = flexattn.trace(masks.document(**given, device="meta"), "mask")
    # (lengths and offsets make int32 ids; int64 ids stay, the block mask reads their int32 ranks)
    want = torch.int64 if "document_ids" in given else torch.int32
    assert [(t.device.type, t.dtype) for t in on_meta.buffers] == [("meta", want)]
    with pytest.raises(ValueError, match="captured a tensor on meta, but the block mask's device is on cpu"):
        flexattn.create_block_mask(masks.document(**given, device="meta"), None, None, 5, 5, device="cpu")


@pytest.mark.parametrize("call, match", [
    (lambda: masks.sliding_window(0), r"window must be a positive int, got 0"),
    (lambda: masks.chunked(2.5), r"chunk must be a positive int, got 2.5"),
    (lambda: masks.prefix_lm(-1), r"prefix_length must be a non-negative int"),
    (lambda: masks.prefix_lm(torch.ones(2, 2, dtype=torch.long)), r"1-D \[B\] integer tensor, got a 2-d"),
    (lambda: masks.document(), r"exactly one of document_ids, lengths, offsets; got none"),
    (lambda: masks.document(torch.zeros(4, dtype=torch.long), lengths=[4]), r"got document_ids, lengths"),
    (lambda: masks.document(torch.zeros(4)), r"document_ids must hold integers, got dtype torch.float32"),
    (lambda: masks.document(offsets=[1, 3]), r"offsets must start at 0"),
    (lambda: masks.document(lengths=[2, -1]), r"lengths must not decrease / be negative"),
    (lambda: masks.natten(8, 4), r"kernel_height must be odd and at most the image's size 8, got 4"),
    (lambda: masks.global_tokens(True), r"num_global must be a positive int, got True"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_document_labels_beyond_int32_stay_apart():
    """Any integer labels: int64 labels that a cast to int32 would merge (equal low 32 bits) stay
    different documents (the mask keeps them; the block mask and the kernels read their int32
    ranks), uint32 and uint64 ones too, on every block, against the labels' own dense mask."""
    labels = torch.tensor([7, 7, 2**32 + 7, 2**32 + 7, 2**32 + 7, -2**40, 7, 7], dtype=torch.int64)
    doc = masks.document(labels, causal=True)
    S = len(labels)
    want = (labels[:, None] == labels[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    assert torch.equal(flexattn.create_mask(doc, 1, 1, S, S, device="cpu")[0, 0], want)
    # unsigned labels: uint32 above 2**31 and uint64 above 2**63
    for dtype, big in ((torch.uint32, 2**31 + 5), (torch.uint64, 2**63 + 5)):
        unsigned = torch.tensor([5, 5, 5, 5, 5, 6, 5, 5], dtype=torch.int64)
        unsigned[2:5] = big - 2**64 if dtype == torch.uint64 else big
        same = masks.document(unsigned.to(dtype) if dtype != torch.uint64 else unsigned.view(dtype), causal=True)
        assert torch.equal(flexattn.create_mask(same, 1, 1, S, S, device="cpu")[0, 0], want), dtype
    q, k, v = (torch.randn(1, 2, S, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    bm = flexattn.create_block_mask(doc, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    assert [t.dtype for t in resolve_mask_mod(bm, torch.device("cpu"))[1]] == [torch.int32]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=want)
    torch.testing.assert_close(flexattn.flex_attention(q, k, v, block_mask=bm).double(), ref, atol=1e-5, rtol=0)
