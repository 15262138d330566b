"""flexattn.distributed on CPU: gloo over 2 and 3 spawned processes, against single-process
flexattn and a float64 reference (forward, LSE, and the gradients of q, k, v and a captured bias).

Each spawned run goes through many cases (spawning and the interpreter are slow): odd lengths,
GQA, every load balance, causal / sliding window / documents / a score_mod with a captured bias
that requires grad, both methods, and the errors raised on every rank before a collective.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexattn
import flexattn.distributed as fd
from flexattn import masks
from flexattn.reference import attention_reference
from tests.helpers.testing import assert_close_to_reference, backward_atol, weighted_grads

BLOCK = 16


def _spawn(world_size: int, tmp_path, body) -> None:
    mp.spawn(_worker, args=(world_size, str(tmp_path / "store"), body), nprocs=world_size, join=True)


def _worker(rank: int, world_size: int, store_path: str, body) -> None:
    torch.set_num_threads(1)
    from flexattn.kernels import launch

    empty = launch.empty

    def poisoned(*args, **kwargs):  # every kernel output starts as NaN: an unwritten element shows
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.dtype.is_floating_point else t

    launch.empty = poisoned
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        body(rank, world_size)
    finally:
        dist.destroy_process_group()


def _bias_score(bias):
    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]
    return biased


# name, S, Hq, Hkv, mask_mod (given S), layout (given S), score bias?, method, use the LSE in the loss
def _cases(P: int):
    docs = [19, 13, 17 + P]  # odd lengths, not multiples of P x BLOCK

    def doc_mask(S):
        return masks.document(lengths=docs, causal=True)
    return [
        ("causal head_tail GQA", 45, 4, 2, lambda S: masks.causal, lambda S: "head_tail", False, "ring", True),
        ("sliding window none", 53, 2, 2, lambda S: masks.sliding_window(9), lambda S: None, False, "ring", False),
        ("documents per_document", sum(docs), 2, 1, doc_mask, lambda S: fd.PerDocument(docs), False, "ring", False),
        ("bias causal", 41, 2, 2, lambda S: masks.causal, lambda S: "head_tail", True, "ring", True),
        ("bias sliding allgather", 47, 2, 1, lambda S: masks.sliding_window(11), lambda S: None, True,
         "allgather", True),
    ]


def _check_case(rank, P, case) -> None:
    name, S, Hq, Hkv, make_mask, make_layout, with_bias, method, use_lse = case
    mask, layout = make_mask(S), make_layout(S)
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, Hq, S, BLOCK, generator=g)
    k = torch.randn(1, Hkv, S, BLOCK, generator=g)
    v = torch.randn(1, Hkv, S, BLOCK, generator=g)
    d_out = torch.randn(1, Hq, S, BLOCK, generator=g)
    d_lse = torch.randn(1, Hq, S, generator=g) if use_lse else torch.zeros(1, Hq, S)
    bias = torch.randn(Hq, S, generator=g) if with_bias else None
    gqa = Hq != Hkv

    def leaves(ts, dtype):
        return [t.to(dtype).requires_grad_() for t in ts]

    # float64 reference
    ins64 = leaves([q, k, v] + ([bias] if with_bias else []), torch.float64)
    score64 = _bias_score(ins64[3]) if with_bias else None
    out64, lse64 = attention_reference(*ins64[:3], score_mod=score64, mask_mod=mask, enable_gqa=gqa,
                                       return_lse=True)
    grads64 = weighted_grads(out64, lse64, ins64, d_out.double(), d_lse.double())
    # single-process flexattn
    ins = leaves([q, k, v] + ([bias] if with_bias else []), torch.float32)
    bm1 = flexattn.create_block_mask(mask, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    out1, lse1 = flexattn.flex_attention(*ins[:3], score_mod=_bias_score(ins[3]) if with_bias else None,
                                         block_mask=bm1, enable_gqa=gqa, return_lse=True)
    grads1 = weighted_grads(out1, lse1, ins, d_out, d_lse)
    # distributed
    local = [fd.shard(t, seq_dim=2, load_balance=layout).detach().requires_grad_() for t in (q, k, v)]
    dbias = bias.clone().requires_grad_() if with_bias else None
    bm = fd.create_block_mask(mask, None, None, S, S, load_balance=layout, device="cpu", BLOCK_SIZE=BLOCK)
    out, lse = fd.flex_attention(*local, score_mod=_bias_score(dbias) if with_bias else None, block_mask=bm,
                                 enable_gqa=gqa, return_lse=True, method=method)
    grads = weighted_grads(out, lse, local + ([dbias] if with_bias else []),
                           fd.shard(d_out, seq_dim=2, load_balance=layout),
                           fd.shard(d_lse, seq_dim=2, load_balance=layout))
    whole = [fd.unshard(t, seq_dim=2, load_balance=layout) for t in (out, lse, *grads[:3])]
    if with_bias:
        whole.append(grads[3])  # summed over the ranks already
    where = f"{name} (P={P}, rank {rank})"
    assert_close_to_reference(whole[0], out1, out64, name=f"{where} out")
    assert_close_to_reference(whole[1], lse1, lse64, name=f"{where} lse")
    for i, label in enumerate(["dq", "dk", "dv", "dbias"][:len(grads64)]):
        atol = backward_atol(grads64[i], (torch.float32,), d_out, v, lse64)
        assert_close_to_reference(whole[2 + i], grads1[i], grads64[i], atol=atol, name=f"{where} {label}")


def _layouts_and_masks(rank, P) -> None:
    x = torch.arange(2 * 47).view(1, 2, 47).float()
    for layout in (None, "head_tail", fd.PerDocument([20, 27])):
        part = fd.shard(x, seq_dim=2, load_balance=layout)
        assert torch.equal(fd.unshard(part, seq_dim=-1, load_balance=layout), x), layout
    # ranks hold disjoint positions covering the sequence
    for layout in (fd.Contiguous(), fd.HeadTail(), fd.PerDocument([5, 30, 12])):
        allpos = torch.cat([layout.positions(47, P, r) for r in range(P)])
        assert torch.equal(allpos.sort().values, torch.arange(47, dtype=torch.int32)), layout
    # sliding window 9 over contiguous shards of 53 / P: far shards are never read, and skipped
    bm = fd.create_block_mask(masks.sliding_window(9), None, None, 53, 53, device="cpu", BLOCK_SIZE=BLOCK)
    expect = tuple(tuple(j in (i - 1, i) for j in range(P)) for i in range(P))
    assert bm.needs == expect, (bm.needs, expect)


def _errors(rank, P) -> None:
    # lengths that differ between ranks: the same clear error on every rank, no hang
    with pytest.raises(fd.DistributedMismatchError, match="Q_LEN: rank 0 has 40"):
        fd.create_block_mask(masks.causal, None, None, 40 + rank, 40 + rank, device="cpu", BLOCK_SIZE=BLOCK)
    bm = fd.create_block_mask(masks.causal, None, None, 40, 40, device="cpu", BLOCK_SIZE=BLOCK)
    n = bm.qpos.numel()
    q = torch.randn(1, 2, n, BLOCK)
    # one rank's shard does not match the mask's layout: every rank raises
    bad = torch.randn(1, 2, n + (rank == P - 1), BLOCK)
    with pytest.raises(fd.DistributedMismatchError, match=f"rank {P - 1}: the block mask's layout"):
        fd.flex_attention(bad, q, q, block_mask=bm)
    # head dims that differ between ranks
    e = BLOCK + 16 * (rank == 0)
    x = torch.randn(1, 2, n, e)
    with pytest.raises(fd.DistributedMismatchError, match="B, Hq, E"):
        fd.flex_attention(x, x, x, block_mask=bm)
    with pytest.raises(ValueError, match="method must be one of"):
        fd.flex_attention(q, q, q, block_mask=bm, method="tree")


def _compiled(rank, P) -> None:
    """Under torch.compile(fullgraph=True): the same output and gradients as the eager call."""
    S = 37
    g = torch.Generator().manual_seed(3)
    q, k, v = (fd.shard(torch.randn(1, 2, S, BLOCK, generator=g), load_balance="head_tail") for _ in range(3))
    bias = torch.randn(2, S, generator=g)
    bm = fd.create_block_mask(masks.causal, None, None, S, S, load_balance="head_tail", device="cpu",
                              BLOCK_SIZE=BLOCK)

    def attn(q, k, v, bias):
        return fd.flex_attention(q, k, v, score_mod=_bias_score(bias), block_mask=bm)

    results = []
    for fn in (attn, torch.compile(attn, fullgraph=True, backend="aot_eager")):
        ins = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out = fn(*ins)
        results.append([out, *torch.autograd.grad(out.square().sum(), ins)])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def _body(rank, P) -> None:
    _layouts_and_masks(rank, P)
    _errors(rank, P)
    if P == 2:
        _compiled(rank, P)
    for case in _cases(P):
        _check_case(rank, P, case)


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_gloo(world_size, tmp_path):
    os.environ.setdefault("FLEXATTN_CACHE_DIR", str(tmp_path / "cache"))
    _spawn(world_size, tmp_path, _body)
