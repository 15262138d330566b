"""Captured int64 tables that a mask only compares, run as int32 ranks (flexattn/block_mask/ranks.py):
which tables qualify, that ranks keep every comparison, and that the kernels, fed the ranks,
match a float64 reference and torch's block tables, also where the ids do not fit in int32."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexattn
from flexattn import call, ops
from flexattn.block_mask import create_block_mask, create_mask, ranks
from flexattn.reference import attention_reference
from test_block_mask import assert_same

COMPARE = {"==": torch.eq, "!=": torch.ne, "<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge}


def _mask(fn):
    return flexattn.trace(fn, "mask")


def test_compared_only_finds_the_tables_a_mask_only_compares():
    ids = torch.arange(8)
    other = torch.arange(8)
    small = torch.arange(8, dtype=torch.int32)
    offsets = torch.tensor([0, 4])
    cases = [
        (lambda b, h, q, k: (ids[q] == ids[k]) & (q >= k), [ids]),
        (lambda b, h, q, k: (ids[q] <= ids[k]) | (other[q] != other[k]), [ids, other]),
        # compared with a constant, another tensor or an index: the values matter, not only their order
        (lambda b, h, q, k: ids[q] >= 3, []),
        (lambda b, h, q, k: ids[q] == other[k], []),
        (lambda b, h, q, k: ids[k] <= q, []),
        # read as an index, or in arithmetic
        (lambda b, h, q, k: q - offsets[ids[q].clamp(0, 1)] >= 0, []),
        (lambda b, h, q, k: ids[q] + 1 == ids[k], []),
        # one table qualifies, the other is used as a number
        (lambda b, h, q, k: (ids[q] == ids[k]) & (other[q] < 5), [ids]),
        # already 32 bits
        (lambda b, h, q, k: small[q] == small[k], []),
    ]
    for fn, want in cases:
        mod = _mask(fn)
        got = [mod.buffers[i] for i in ranks.compared_only(mod.ir)]
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), mod.source
        assert (ranks.ranked(mod) is None) == (not want)


@settings(max_examples=40)
@given(st.lists(st.integers(-2**62, 2**62) | st.sampled_from([0, 1, 2**32, 2**32 + 1, -2**32]), min_size=1,
                max_size=40),
       st.sampled_from(sorted(COMPARE)))
def test_ranks_keep_every_comparison(values, op):
    ids = torch.tensor(values, dtype=torch.int64)
    compare = COMPARE[op]
    mod = _mask(lambda b, h, q, k: compare(ids[q], ids[k]))
    made = ranks.ranked(mod)
    assert made is not None and made.mod.buffers[0].dtype == torch.int32
    n = len(values) + 3  # (reads past the end: 0, which the ranks keep in its place)
    ours = create_mask(made.mod, 1, 1, n, n, device="cpu")
    read = torch.cat([ids, ids.new_zeros(3)])
    want = compare(read[:, None], read[None, :])[None, None]
    assert torch.equal(ours, want) and torch.equal(create_mask(mod, 1, 1, n, n, device="cpu"), want)


def _documents(n: int, dtype=torch.int64) -> torch.Tensor:
    """Uneven documents whose ids have equal low 32 bits: cast to int32 they would all be one."""
    lengths = [37, 1, 90, 20, n - 148]
    return (torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)) * 2**32 + 5).to(dtype)


@pytest.mark.parametrize("S", [200, 301])
def test_document_ids_beyond_int32_through_the_kernels(S, monkeypatch):
    ids = _documents(S)
    bias = torch.randn(4, S, dtype=torch.float32, requires_grad=True)

    def docs(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    bm = create_block_mask(docs, None, None, S, S, device="cpu")
    assert_same(bm, torch_create_block_mask(docs, None, None, S, S, device="cpu"))
    seen = []
    real = call.resolve_mask_mod
    monkeypatch.setattr(call, "resolve_mask_mod", lambda *a: seen.append(real(*a)) or seen[-1])
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, 4, S, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 16, generator=g, requires_grad=True) for _ in range(2))
    out = flexattn.flex_attention(q, k, v, score_mod=biased, block_mask=bm, enable_gqa=True)
    assert [t.dtype for t in seen[-1][1]] == [torch.int32]
    ref = attention_reference(q, k, v, score_mod=biased, mask_mod=docs, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    do = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v, bias), do)
    want = torch.autograd.grad(ref, (q, k, v, bias), do.double())
    for got, w in zip(grads, want):
        torch.testing.assert_close(got.double(), w.double(), atol=1e-4, rtol=0)


def test_reads_past_the_end_stay_apart_from_every_document():
    """Ids without a 0 and a mask longer than them: the keys past the end read 0, which is no
    document's id, so no query sees them (a rank of 0 for the smallest id would join them)."""
    S = 200
    ids = torch.repeat_interleave(torch.tensor([3, 9]), torch.tensor([90, 80]))  # 170 ids, none 0

    def docs(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    bm = create_block_mask(docs, None, None, S, S, device="cpu")
    x = torch.randn(1, 1, S, 16, generator=torch.Generator().manual_seed(2))
    traced = _mask(docs)  # (the reference evaluates the IR, whose reads past the end are 0)
    torch.testing.assert_close(flexattn.flex_attention(x, x, x, block_mask=bm).double(),
                               attention_reference(x, x, x, mask_mod=traced), atol=2e-5, rtol=0)
    assert call.resolve_mask_mod(bm, torch.device("cpu"))[1][0].dtype == torch.int32


def test_no_ranks_while_a_cuda_graph_is_captured(monkeypatch):
    """A CUDA graph's replays read the tensors its capture recorded: the ids themselves, whose
    changes in place between replays the ranks would miss."""
    ids, docs, bm = _document_mask(200)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert call.resolve_mask_mod(bm, torch.device("cuda"))[1] == (ids,)
    assert call.resolve_mask_mod(bm, torch.device("cpu"))[1][0].dtype == torch.int32


def _document_mask(S: int):
    """(int64 ids, their mask, its BlockMask on the CPU)."""
    ids = _documents(S)

    def docs(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    return ids, docs, create_block_mask(docs, None, None, S, S, device="cpu")


def test_a_table_modified_in_place_is_read_as_it_is_now():
    S = 200
    ids, docs, bm = _document_mask(S)
    _, before = call.resolve_mask_mod(bm, torch.device("cpu"))
    assert before[0].dtype == torch.int32 and before[0] is not ids
    ids[150:] += 2**40  # in place: the call ranks the values as they are now
    _, now = call.resolve_mask_mod(bm, torch.device("cpu"))
    assert now[0].dtype == torch.int32 and torch.equal(now[0][:, None] == now[0], ids[:, None] == ids)
    assert not torch.equal(now[0], before[0])
    x = torch.randn(1, 1, S, 16)
    torch.testing.assert_close(flexattn.flex_attention(x, x, x, block_mask=bm).double(),
                               attention_reference(x, x, x, block_mask=bm, mask_mod=docs), atol=2e-5, rtol=0)


def test_torch_block_masks_run_ranks_too():
    """torch's BlockMask of an int64 documents mask: the call ranks the ids once per mask object
    and tensor version, and matches the reference."""
    S = 301
    ids = _documents(S)

    def docs(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    tbm = torch_create_block_mask(docs, None, None, S, S, device="cpu")
    _, first = call.resolve_mask_mod(tbm, torch.device("cpu"))
    _, again = call.resolve_mask_mod(tbm, torch.device("cpu"))
    assert first[0].dtype == torch.int32 and again[0] is first[0]
    x = torch.randn(1, 2, S, 16, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(flexattn.flex_attention(x, x, x, block_mask=tbm).double(),
                               attention_reference(x, x, x, mask_mod=docs), atol=2e-5, rtol=0)
    ids.add_(1)
    assert call.resolve_mask_mod(tbm, torch.device("cpu"))[1][0] is not first[0]


def test_copies_keep_the_ranks_and_inference_tensors_keep_their_ids():
    S = 200
    ids, docs, bm = _document_mask(S)
    for copy in (bm.to("cpu"), bm._adjust(150, 150)):
        _, bufs = call.resolve_mask_mod(copy, torch.device("cpu"))
        assert bufs[0].dtype == torch.int32
    bm.mask_mod = lambda b, h, q_idx, kv_idx: ids[q_idx] + 1 == ids[kv_idx]  # (read as numbers: no ranks)
    assert call.resolve_mask_mod(bm, torch.device("cpu"))[1] == (ids,)
    with torch.inference_mode():
        frozen = _documents(S)
    assert ranks.ranked(_mask(lambda b, h, q, k: frozen[q] == frozen[k])) is None


def test_compiled_calls_rank_in_the_graph(monkeypatch):
    """Under torch.compile(fullgraph=True), block mask built in the graph or outside it: the
    kernels' op gets the ids' int32 ranks (computed in the graph), and the result matches the
    reference for ids that a cast to int32 would merge; new ids of the same shape do not recompile."""
    torch._dynamo.reset()
    S = 200
    seen = []
    real = ops.fwd.run

    def spy(*args, **kw):  # (what the op's kernels read)
        seen.append([t.dtype for t in args[7]])
        return real(*args, **kw)

    monkeypatch.setattr(ops.fwd, "run", spy)

    def attend(q, k, v, doc, outside=None):
        mask = outside or create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None,
                                            q.shape[2], k.shape[2], device="cpu")
        return flexattn.flex_attention(q, k, v, block_mask=mask)

    compiled = torch.compile(attend, fullgraph=True)
    q, k, v = (torch.randn(1, 2, S, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for built_outside in (False, True):
        for i, shift in enumerate((0, 3)):
            ids = _documents(S) + shift * 2**33
            docs = (lambda ids: lambda b, h, qi, ki: (ids[qi] == ids[ki]) & (qi >= ki))(ids)
            ref = attention_reference(q, k, v, mask_mod=docs)
            outside = create_block_mask(docs, None, None, S, S, device="cpu") if built_outside else None
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = compiled(q, k, v, ids, outside)
            torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    assert len(seen) == 4 and all(d == [torch.int32] for d in seen)
