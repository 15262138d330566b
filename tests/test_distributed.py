"""flexattn.distributed on CPU: gloo over 2 and 3 processes, against single-process flexattn and a
float64 reference (forward, LSE, and the gradients of q, k, v and a captured bias).

One spawn of 3 processes serves both world sizes (spawning and the Triton interpreter are slow):
the cases run on the group of ranks 1 and 2 (P = 2, group ranks differ from global ranks), then
on all three (P = 3). Between them they cover odd lengths, GQA, every load balance, causal /
sliding window / documents / a score_mod with a captured bias that requires grad, both methods,
return_aux (lse and max scores), torch.compile, deterministic mode, the errors raised on every rank
before a collective, torch's own context parallel with flexattn's flex_attention inside, and a ring
call after the default group is made again. Each case's single-process and reference results are
computed on one rank of the group only, a different one per case.
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import os
import random
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton

import flexattn
import flexattn.distributed as fd
from flexattn import AuxRequest, masks, scalars
from flexattn.distributed import checks
from flexattn.reference import apply_score_mod, attention_reference
from tests.helpers.testing import assert_close_to_reference, backward_atol, weighted_grads

BLOCK = 16
DOCS = [19, 13, 20]  # odd lengths, not multiples of P x BLOCK


def _worker(rank: int, world_size: int, store_path: str) -> None:
    torch.set_num_threads(1)
    from flexattn.kernels import launch

    empty = launch.empty

    def poisoned(*args, **kwargs):  # every kernel output starts as NaN: an unwritten element shows
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.dtype.is_floating_point else t

    launch.empty = poisoned
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size)
    try:
        pair = dist.new_group([1, 2])  # (a collective: every rank creates it)
        if rank in (1, 2):
            _body(pair)
        _body(dist.group.WORLD)
        # a repeated build whose gather is not read when the group is destroyed (below) keeps
        # nothing of the group alive
        from flexattn.distributed import masks as dmasks
        for _ in range(2):
            fd.create_block_mask(masks.causal, None, None, 40, 40, device="cpu", BLOCK_SIZE=BLOCK)
        assert dmasks._UNREAD[dist.group.WORLD]
        # the default group made again: the ring makes its groups again (those of the first are gone)
        made = list(checks._RING.values())
        assert made and all(ref() is not None for refs in made for ref in refs)
        dist.destroy_process_group()
        # destroy_process_group frees the ring's groups (flexattn holds them weakly), and the
        # agreements made in the default group go with it (the pair's stay while it lives)
        assert all(ref() is None for refs in made for ref in refs), made
        assert list(checks._AGREED.keys()) == ([pair] if rank in (1, 2) else [])
        assert all(g is pair for g in (*dmasks._UNREAD.keys(), *dmasks._AGREED.keys()))
        dist.init_process_group("gloo", store=dist.FileStore(store_path + ".again", world_size), rank=rank,
                                world_size=world_size)
        _check_case(dist.group.WORLD, 2, CASES[3][2])
    except BaseException:  # the other ranks then fail on a closed connection: say which rank failed first
        print(f"rank {rank} of {world_size}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def _bias_score(bias):
    def biased(score, b, h, q_idx, kv_idx):  # (reads the global q_idx too: a step with the wrong positions shows)
        return score + bias[h, kv_idx] + 0.02 * (q_idx - kv_idx)
    return biased


def _doc_layout():
    return fd.PerDocument(DOCS)


def _whole_docs():
    return fd.WholeDocuments(DOCS)


def prefix_or_self(b, h, q_idx, kv_idx):
    """Every query reads the first 20 keys (and itself): another rank's shard 0 is read only in
    its first KV blocks, so a window smaller than the shard travels two hops at P=3."""
    return (kv_idx < 20) | (q_idx == kv_idx)


def last_rows_read_the_start(b, h, q_idx, kv_idx):
    """Only the queries from 34 on read the first 10 keys (and each query itself): with 50 tokens
    on 3 ranks, shard 0 passes through rank 1, which reads none of it, on its way to rank 2, whose
    dK/dV part goes home from two hops away along the ring."""
    return ((kv_idx < 10) & (q_idx >= 34)) | (q_idx == kv_idx)


# int64 document ids, as torch.arange and repeat_interleave make them, whose low 32 bits are all
# equal: the ranks flexattn runs them as must keep the documents apart
DOC_IDS = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS)) * 2**32 + 5


def documents_int64(b, h, q_idx, kv_idx):
    return (DOC_IDS[q_idx] == DOC_IDS[kv_idx]) & (q_idx >= kv_idx)


# name, S, Hq, Hkv, mask_mod, layout, score bias?, method, use the LSE in the loss; per world size
# every layout and both methods, GQA with each method, a captured bias with each method.
CASES = {
    2: [("causal head_tail GQA bias", 77, 4, 2, masks.causal, "head_tail", True, "ring", True),
        ("documents per_document GQA", sum(DOCS), 2, 1, masks.document(lengths=DOCS, causal=True), _doc_layout,
         False, "allgather", False),
        ("sliding window none bias", 53, 2, 2, masks.sliding_window(9), None, True, "ring", True),
        ("documents whole_documents bias int64", sum(DOCS), 2, 2, documents_int64, _whole_docs, True, "ring", True),
        # bfloat16: the neighbour's window sums travel home in bfloat16, the last merge writes it
        ("sliding window none bf16", 53, 2, 2, masks.sliding_window(9), None, False, "ring", True, torch.bfloat16)],
    3: [("documents per_document GQA", sum(DOCS), 2, 1, masks.document(lengths=DOCS, causal=True), _doc_layout,
         False, "ring", True),
        ("sliding window none bias", 47, 2, 1, masks.sliding_window(11), None, True, "allgather", True),
        ("causal head_tail", 41, 2, 2, masks.causal, "head_tail", False, "ring", False),
        # bfloat16, chunks longer than a block: rank 0's second and third merges cover its second
        # chunk only, the last one from float32 sums into bfloat16
        ("causal head_tail bf16", 115, 2, 2, masks.causal, "head_tail", False, "ring", False, torch.bfloat16),
        ("prefix none GQA bias", 101, 2, 1, prefix_or_self, None, True, "ring", True),
        ("passing through none bias", 50, 2, 2, last_rows_read_the_start, None, True, "ring", True)],
}


def _check_case(group, index, case) -> None:
    name, S, Hq, Hkv, mask, layout, with_bias, method, use_lse, *dtype = case
    dtype = dtype[0] if dtype else torch.float32
    layout = layout() if callable(layout) else layout
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, Hq, S, BLOCK, generator=g).to(dtype)
    k = torch.randn(1, Hkv, S, BLOCK, generator=g).to(dtype)
    v = torch.randn(1, Hkv, S, BLOCK, generator=g).to(dtype)
    d_out = torch.randn(1, Hq, S, BLOCK, generator=g).to(dtype)
    d_lse = torch.randn(1, Hq, S, generator=g) if use_lse else torch.zeros(1, Hq, S)
    bias = torch.randn(Hq, S, generator=g) if with_bias else None
    gqa = Hq != Hkv
    # distributed, on every rank
    local = [fd.shard(t, group, seq_dim=2, load_balance=layout).requires_grad_() for t in (q, k, v)]
    dbias = bias.clone().requires_grad_() if with_bias else None
    bm = fd.create_block_mask(mask, None, None, S, S, group, load_balance=layout, device="cpu", BLOCK_SIZE=BLOCK)
    if name.endswith("int64"):  # (the shards' masks read the ids' int32 ranks)
        assert [t.dtype for t in bm.mask_mod.buffers] == [torch.int32], name
    out, lse = fd.flex_attention(*local, score_mod=_bias_score(dbias) if with_bias else None, block_mask=bm,
                                 enable_gqa=gqa, return_lse=True, method=method)
    grads = weighted_grads(out, lse, local + ([dbias] if with_bias else []),
                           fd.shard(d_out, group, seq_dim=2, load_balance=layout),
                           fd.shard(d_lse, group, seq_dim=2, load_balance=layout))
    whole = [fd.unshard(t, group, seq_dim=2, load_balance=layout) for t in (out, lse, *grads[:3])]
    if with_bias:  # summed over the ranks already: each rank checks its own
        where = f"{name} (P={P}, rank {rank})"
        torch.testing.assert_close(*_all_equal(group, grads[3]), rtol=0, atol=0, msg=f"{where} dbias per rank")
    if rank != index % P:
        return
    # the float64 reference and single-process flexattn, on one rank
    ins64 = [t.double().requires_grad_() for t in [q, k, v] + ([bias] if with_bias else [])]
    out64, lse64 = attention_reference(*ins64[:3], score_mod=_bias_score(ins64[3]) if with_bias else None,
                                       mask_mod=mask, enable_gqa=gqa, return_lse=True)
    grads64 = weighted_grads(out64, lse64, ins64, d_out.double(), d_lse.double())
    ins = [t.clone().requires_grad_() for t in [q, k, v] + ([bias] if with_bias else [])]
    bm1 = flexattn.create_block_mask(mask, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    out1, lse1 = flexattn.flex_attention(*ins[:3], score_mod=_bias_score(ins[3]) if with_bias else None,
                                         block_mask=bm1, enable_gqa=gqa, return_lse=True)
    grads1 = weighted_grads(out1, lse1, ins, d_out, d_lse)
    if with_bias:
        whole.append(grads[3])
    where = f"{name} (P={P})"
    assert_close_to_reference(whole[0], out1, out64, name=f"{where} out")
    assert_close_to_reference(whole[1], lse1, lse64, name=f"{where} lse")
    for i, label in enumerate(["dq", "dk", "dv", "dbias"][:len(grads64)]):
        atol = backward_atol(grads64[i], (dtype,), d_out, v, lse64)
        assert_close_to_reference(whole[2 + i], grads1[i], grads64[i], atol=atol, name=f"{where} {label}")


def _all_equal(group, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's ``t``, group rank 0's)."""
    first = t.detach().clone()
    dist.broadcast(first, dist.get_global_rank(group, 0), group=group)
    return t.detach(), first


def _layouts_and_masks(group) -> None:
    P = dist.get_world_size(group)
    x = torch.arange(2 * 47).view(1, 2, 47).float()
    for layout in (None, "head_tail", fd.PerDocument([20, 27]), fd.WholeDocuments([10, 10, 27])):
        part = fd.shard(x, group, seq_dim=2, load_balance=layout)
        assert torch.equal(fd.unshard(part, group, seq_dim=-1, load_balance=layout), x), layout
    # whole documents: no document spans two shards, so only a rank's own pair is kept
    docs = [9, 14, 7, 17]
    bm = fd.create_block_mask(masks.document(lengths=docs, causal=True), None, None, 47, 47, group,
                              load_balance=fd.WholeDocuments(docs), device="cpu", BLOCK_SIZE=BLOCK)
    assert bm.needs == tuple(tuple(i == j for j in range(P)) for i in range(P)), bm.needs
    # causal, head-tail: a rank's first chunk reads no later shard, so those steps start at its second chunk
    S = 2 * P * (BLOCK + 3) + 1  # (chunks longer than a block)
    bm = fd.create_block_mask(masks.causal, None, None, S, S, group, load_balance="head_tail", device="cpu",
                              BLOCK_SIZE=BLOCK)
    r, L = dist.get_rank(group), bm.qpos.numel()
    jumps = (bm.qpos[1:] - bm.qpos[:-1] != 1).nonzero()  # (none on the last rank: its chunks meet)
    for j in range(r + 1, P):
        first_chunk = int(jumps[0]) + 1  # (local rows of the first chunk)
        assert bm.rows[j] == (first_chunk // BLOCK * BLOCK, L), (j, bm.rows, first_chunk)
        assert bm.rows[j][0] > 0
    # sliding window 9 over contiguous shards of 53 / P: far shards are never read, and skipped
    bm = fd.create_block_mask(masks.sliding_window(9), None, None, 53, 53, group, device="cpu", BLOCK_SIZE=BLOCK)
    expect = tuple(tuple(j in (i - 1, i) for j in range(P)) for i in range(P))
    assert bm.needs == expect, (bm.needs, expect)
    # and only the KV blocks the next rank reads travel: its queries reach 8 keys back
    n = [p.numel() for p in bm.kvpos]
    assert bm.windows == tuple((max(0, n[j] - 8) // BLOCK * BLOCK, n[j]) for j in range(P - 1)) + ((0, 0),), bm.windows
    # and only this rank's first query block reads its neighbour's window: the other rows skip that step
    r, L = dist.get_rank(group), bm.qpos.numel()
    expect = tuple((0, L) if j == r else (0, min(BLOCK, L)) if j == r - 1 else None for j in range(P))
    assert bm.rows == expect, (bm.rows, expect)
    if r > 0:  # (its tables: those rows against the window)
        assert bm.masks[r - 1].seq_lengths == (min(BLOCK, L), n[r - 1] - bm.windows[r - 1][0])


PAIR_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _assert_pairs(bm, mask, label) -> tuple:
    """Each pair's tables and mod of ``bm`` are those of ``mask`` read at the pair's positions
    (flexattn's one-process build, and the dense mask); returns ``bm``'s plan."""
    for j, pair in enumerate(bm.masks):
        assert (pair is None) == (bm.rows[j] is None), (label, j)
        if pair is None:
            continue
        at_pair = _assert_pair_tables(pair, bm.qpos_rows[j], bm.kvpos_held[j], mask, (label, j))
        qpos, kvpos = bm.qpos_rows[j], bm.kvpos_held[j]
        dense = flexattn.create_mask(at_pair, None, None, qpos.numel(), kvpos.numel(), device="cpu")
        assert torch.equal(flexattn.create_mask(pair.mask_mod, None, None, qpos.numel(), kvpos.numel(),
                                                device="cpu"), dense), (label, j)
    return bm.needs, bm.windows, bm.rows


def _assert_pair_tables(pair, qpos, kvpos, mask, label):
    """``pair``'s tables are those of flexattn's one-process build of ``mask`` read at positions
    ``qpos`` / ``kvpos``; returns that mask."""
    def at_pair(b, h, q_idx, kv_idx):
        return mask(b, h, qpos[q_idx], kvpos[kv_idx])

    want = flexattn.create_block_mask(at_pair, None, None, qpos.numel(), kvpos.numel(), device="cpu",
                                      BLOCK_SIZE=BLOCK)
    for name in PAIR_TABLES:
        assert torch.equal(getattr(pair, name), getattr(want, name)), (label, name)
    return at_pair


_REACH = torch.tensor([9])


class _Reach:
    def within(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < _REACH[0])


def _within(width: int):
    """Causal within ``width`` keys, reading the Python number ``width`` (a 0-d tensor once it
    changes, `flexattn.scalars`)."""
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < width)
    return mask


def _repeated_builds(group) -> None:
    """Masks of one mod whose captured tensor changes from build to build, then comes back (as a
    training loop's batches), each value in a new tensor and in one tensor changed in place: each
    rank's pairs, windows, rows, pair tables and pair mods are those of the mask it was just given,
    read at the pair's positions. The first build of a mod and arguments reads its gather at once;
    the next ones take the pairs the ranks agreed on last, launch their gathers, and list their
    pairs again when the gather, read at the next use, shows other ranges."""
    # (shards of 3 or 4 blocks: a window of 9 keys reads a block of the shard before, one of 30 most
    # of it, one of 100 every shard before)
    S = 101
    seen = {}
    same = torch.tensor([0])
    gathers = _Gathers()
    previous = None
    for width, in_place in itertools.product((9, 30, 9, 100), (False, True)):
        reach = same.fill_(width) if in_place else torch.tensor([width])

        def window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < reach[0])

        bm = fd.create_block_mask(window, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
        assert gathers.classified == 1, (width, in_place)  # (a captured tensor: every build classifies)
        assert gathers.listed == 1 and gathers.taken() == (previous is None), (width, in_place)
        plan = _assert_pairs(bm, window, width)  # (its first use reads the gather, and lists it again)
        assert gathers.listed == (previous not in (None, width)), (width, in_place)
        gathers.listed = 0
        assert seen.setdefault(width, plan) == plan, width
        previous = width
    assert len({seen[w] for w in seen}) == 3  # (each width its own pairs)
    # the tensor written by a collective, which need not move its version counter (gloo's does
    # not): the build's pairs are those of the value the collective wrote
    same.fill_(15)
    before = _assert_pairs(fd.create_block_mask(window, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK),
                           window, 15)
    dist.all_reduce(same, group=group)  # (15 P: a window that reads most of the shard before)
    after = _assert_pairs(fd.create_block_mask(window, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK),
                          window, "all_reduce")
    assert gathers.listed == 4 and gathers.taken() == 0 and after != before
    # a build whose first use is an attention call, with a window wider than the last build's: the
    # call lists the pairs again before its transfers, and its output is that of the new window
    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(1, 2, S, BLOCK, generator=g) for _ in range(3))
    for width in (9, 100):
        same.fill_(width)
        bm = fd.create_block_mask(window, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
        out = fd.flex_attention(*(fd.shard(t, group, seq_dim=2) for t in (q, k, v)), block_mask=bm)
        want = flexattn.flex_attention(q, k, v, block_mask=flexattn.create_block_mask(
            window, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK))
        torch.testing.assert_close(fd.unshard(out, group, seq_dim=2), want, rtol=1e-4, atol=1e-5)
        assert gathers.listed == 2 and gathers.taken() == 0, width
    # a mask that reads no tensor: the first build of its arguments gathers, the next do not, and
    # they take its classification and pair masks as they are, and send what the first repeat sent
    sent = []
    for expect in (1, 0, 0):
        bm = fd.create_block_mask(masks.causal, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
        assert gathers.classified == 0 or expect, expect
        sent.append(gathers.sent)
        assert gathers.taken() == expect, expect
        _assert_pairs(bm, masks.causal, "causal")
    assert sent[1] is sent[2] and sent[0] is not sent[1]
    # an error while a repeated build classifies: every rank raises at its next call in the group
    # (here the next build), before that call's collectives, and the mask raises at every use
    from flexattn.distributed import copies, masks as dmasks
    last = dist.get_rank(group) == dist.get_world_size(group) - 1
    failed = rf"rank\(s\) \[{dist.get_world_size(group) - 1}\] failed|this rank failed.*simulated"

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    def built_failing_on_the_last_rank(step: str, mask=masks.causal):
        """A build of ``mask`` in which ``step`` of `flexattn.distributed.masks` fails on the last rank."""
        inner = getattr(dmasks, step)
        if last:
            setattr(dmasks, step, failing)
        try:
            return fd.create_block_mask(mask, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
        finally:
            setattr(dmasks, step, inner)

    # (the window, which reads a tensor, classifies at every build; a repeated causal build does not)
    bm = built_failing_on_the_last_rank("classify", window)
    with pytest.raises(fd.DistributedMismatchError, match=failed):
        fd.create_block_mask(masks.causal, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
    for _ in range(2):
        with pytest.raises(fd.DistributedMismatchError, match=failed):
            fd.flex_attention(*[torch.randn(1, 1, 7, BLOCK)] * 3, block_mask=bm)
    assert gathers.taken() == 0
    # the agreement was forgotten: the next build reads its gather at once, and the one after repeats
    for expect in (1, 0):
        _assert_pairs(fd.create_block_mask(window, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK),
                      window, "again")
        assert gathers.taken() == expect
    # an error after the classification (listing the pairs' tables) in a repeat: the same, and the
    # stand-in mask has its positions
    bm = built_failing_on_the_last_rank("_assembled")
    assert bm.qpos.numel() == fd.shard(torch.empty(1, 1, S, 1), group).shape[2]
    with pytest.raises(fd.DistributedMismatchError, match=failed):
        bm.sparsity()
    with pytest.raises(fd.DistributedMismatchError, match=failed):  # (and at the next call, with the others)
        fd.create_block_mask(masks.causal, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
    # listing a repeat's pairs again (its window widened) fails on the last rank alone: every rank
    # raises at the mask's use in flex_attention, whose check carries the failure, at every use
    for width in (9, 100):
        same.fill_(width)
        bm = fd.create_block_mask(window, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
    x = fd.shard(q, group, seq_dim=2)
    listed = dmasks._listed
    if last:
        dmasks._listed = failing
    try:
        for _ in range(2):
            with pytest.raises(fd.DistributedMismatchError,
                               match=rf"rank {dist.get_world_size(group) - 1}: .*failed while listing.*simulated"):
                fd.flex_attention(x, x, x, block_mask=bm)
    finally:
        dmasks._listed = listed
    # the copy engines one rank may no longer use (its FLEXATTN_RING_COPY changed) while the others
    # repeat a build agreed with them: that rank reads its gather at once, the others at the mask's
    # first use, and every rank's mask sends by NCCL
    usable = copies.usable
    copies.usable = lambda device: True
    try:
        for expect in (True, True, False, False):
            if not expect and last:
                copies.usable = lambda device: False
            bm = fd.create_block_mask(masks.causal, None, None, S + 1, S + 1, group, device="cpu", BLOCK_SIZE=BLOCK)
            assert bm.copy_engines is expect
    finally:
        copies.usable = usable
    assert gathers.taken() == 1 + last
    # a mask that reads a tensor the trace cache cannot reach (through a method): its builds have
    # the pairs of the tensor's values
    global _REACH
    for width in (9, 100, 9):
        _REACH = torch.tensor([width])
        bm = fd.create_block_mask(_Reach().within, None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
        assert _assert_pairs(bm, _Reach().within, width) == seen[width], width
    # a Python number the mask reads counts by its value: each width's first build gathers, and it
    # again does not (only on the pair: the number's history decides its trace, and rank 0 has not
    # seen these calls)
    if group is not dist.group.WORLD:
        gathers.classified = 0
        for width, expect in ((9, 1), (30, 1), (9, 1), (30, 0), (9, 0)):
            bm = fd.create_block_mask(_within(width), None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
            assert gathers.classified == expect, (width, expect)  # (classified once per number's value)
            assert gathers.taken() == expect, (width, expect)
            assert _assert_pairs(bm, _within(width), width) == seen[width], width
        # numbers that differ between the ranks: every rank raises (the numbers are in the check)
        rank = dist.get_rank(group)
        with pytest.raises(fd.DistributedMismatchError, match="numbers"):
            fd.create_block_mask(_within(11 + 2 * rank), None, None, S, S, group, device="cpu", BLOCK_SIZE=BLOCK)
    gathers.close()


class _Gathers:
    """Counts this rank's pre-collective gathers (`checks._gather_single`; ``sent``: what the last
    one sent), the builds' gathers read at once (`checks.agree_table`, a host sync), the listings of
    a mask's pairs (``listed``) and the classifications of its tiles (``classified``) until `close`."""

    def __init__(self):
        from flexattn.distributed import masks as dmasks
        self.launched, self.read, self.listed, self.classified = 0, 0, 0, 0
        self.gather, self.agree, self.list = checks._gather_single, checks.agree_table, dmasks._listed
        self.classify = dmasks.classify

        def classify(*args, **kwargs):
            self.classified += 1
            return self.classify(*args, **kwargs)

        def gather(output, sent, **kwargs):
            self.launched, self.sent = self.launched + 1, sent
            return self.gather(output, sent, **kwargs)

        def agree(*args, **kwargs):
            self.read += 1
            return self.agree(*args, **kwargs)

        def listed(*args, **kwargs):
            self.listed += 1
            return self.list(*args, **kwargs)

        checks._gather_single, checks.agree_table, dmasks._listed = gather, agree, listed
        dmasks.classify = classify

    def taken(self) -> int:
        """The builds' gathers read at once since the last call (every build launches one); the
        counts of listings and classifications start again."""
        assert self.launched >= 1, "a build without a gather"
        n, self.launched, self.read, self.listed, self.classified = self.read, 0, 0, 0, 0
        return n

    def close(self) -> None:
        from flexattn.distributed import masks as dmasks
        checks._gather_single, checks.agree_table, dmasks._listed = self.gather, self.agree, self.list
        dmasks.classify = self.classify


def _errors(group) -> None:
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    # lengths that differ between ranks: the same clear error on every rank, no hang
    with pytest.raises(fd.DistributedMismatchError, match="Q_LEN: rank 0 has 40"):
        fd.create_block_mask(masks.causal, None, None, 40 + rank, 40 + rank, group, device="cpu", BLOCK_SIZE=BLOCK)
    # a block size one rank has wrong: checked before the gather, raised on every rank
    with pytest.raises(fd.DistributedMismatchError, match=f"rank {P - 1}: BLOCK_SIZE: the query block size"):
        fd.create_block_mask(masks.causal, None, None, 40, 40, group, device="cpu",
                             BLOCK_SIZE=24 if rank == P - 1 else BLOCK)
    bm = fd.create_block_mask(masks.causal, None, None, 40, 40, group, device="cpu", BLOCK_SIZE=BLOCK)
    # one rank's arguments differ from a build the others repeat: every rank raises at its next
    # call in the group (the mask's use), and the mask at every use
    x = torch.randn(1, 2, fd.shard(torch.empty(1, 1, 40, 1), group).shape[2], BLOCK)
    differ = rf"the arguments of rank\(s\) \[{P - 1}\] differ from rank 0's.*repeated the arguments of a build"
    again = fd.create_block_mask(masks.causal, None, None, 41 if rank == P - 1 else 40, 41 if rank == P - 1 else 40,
                                 group, device="cpu", BLOCK_SIZE=BLOCK)
    if rank == 0:  # (a read of its pairs on one rank raises there, and again at the next call with the others)
        with pytest.raises(fd.DistributedMismatchError, match=differ):
            again.needs
    for _ in range(2):
        with pytest.raises(fd.DistributedMismatchError, match=differ):
            fd.flex_attention(x, x, x, block_mask=again)
    assert "needs=failed" in repr(again)
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
    # K/V of batch 1, broadcast over the batch, on one rank only (each rank alone would be right;
    # the ring would receive a shard into a buffer shaped from the other rank's K)
    x2 = torch.randn(2, 2, n, BLOCK)
    kv = x2[:1] if rank == 0 else x2
    with pytest.raises(fd.DistributedMismatchError, match="key/value B: rank 0 has"):
        fd.flex_attention(x2, kv, kv, block_mask=bm)
    # a dtype only one rank has wrong, a head dim every rank has wrong: refused on every rank before
    # the first transfer (not in the kernel of the ring's first step, with transfers in flight)
    v64 = q.double() if rank == P - 1 else q
    with pytest.raises(fd.DistributedMismatchError, match=f"rank {P - 1}: value must have query's dtype"):
        fd.flex_attention(q, q, v64, block_mask=bm)
    with pytest.raises(fd.DistributedMismatchError, match="key"):
        fd.flex_attention(q, q[..., :8].contiguous(), q, block_mask=bm)
    with pytest.raises(ValueError, match="method must be one of"):
        fd.flex_attention(q, q, q, block_mask=bm, method="tree")
    # what one GPU's call checks of the pairs' tables, which only the ranks that compute a pair
    # would check, mid-ring: a mask whose B does not fit the query's, kernel tiles that do not divide
    # its blocks (only the last rank's queries read anything, and no pair has 128 rows for the
    # block-sparse kernel that checks BLOCK_M); every rank raises before the first transfer
    last_only = fd.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx >= 30) & (kv_idx < 10), 2, None, 40, 40,
                                     group, device="cpu", BLOCK_SIZE=BLOCK)
    x3 = torch.randn(3, 2, n, BLOCK)
    for method in ("ring", "allgather"):
        with pytest.raises(fd.DistributedMismatchError, match=f"rank {P - 1}: block_mask has B=2"):
            fd.flex_attention(x3, x3, x3, block_mask=last_only, method=method)
        for option in ("BLOCK_M", "BLOCK_N"):
            with pytest.raises(fd.DistributedMismatchError, match=f"rank 0: kernel_options\\['{option}'\\]=32"):
                fd.flex_attention(x2, x2, x2, block_mask=last_only, method=method, kernel_options={option: 32})
    # the copy engines only where every rank can use them (one rank's FLEXATTN_RING_COPY=0 keeps
    # every rank on NCCL: a rank pushing into slots while another sends through NCCL would hang)
    from flexattn.distributed import checks
    for cans, expect in (([True] * P, True), ([r != P - 1 for r in range(P)], False)):
        table = torch.arange(4, dtype=torch.int64) + 10 * rank
        every, both = checks.agree_table(group, "test", {"x": 1}, "", table, can=cans[rank])
        assert both is expect and every == [list(range(10 * i, 10 * i + 4)) for i in range(P)], (every, both)
    # a block mask made inside the call, referenced by nothing else: the backward still finds it
    qg = q.clone().requires_grad_()
    out = fd.flex_attention(qg, qg, qg, block_mask=fd.create_block_mask(masks.causal, None, None, 40, 40, group,
                                                                       device="cpu", BLOCK_SIZE=BLOCK))
    gc.collect()
    out.sum().backward()
    assert torch.isfinite(qg.grad).all()
    # the all-gather method where some ranks hold no query (a sequence of one token)
    one = torch.randn(1, 2, 1, BLOCK, generator=torch.Generator().manual_seed(5))  # (the same on every rank)
    tiny = fd.create_block_mask(masks.causal, None, None, 1, 1, group, device="cpu", BLOCK_SIZE=BLOCK)
    mine = fd.shard(one, group)
    got = fd.unshard(fd.flex_attention(mine, mine, mine, block_mask=tiny, method="allgather"), group, seq_len=1)
    torch.testing.assert_close(got, flexattn.flex_attention(one, one, one), atol=1e-6, rtol=1e-6)
    if group is not dist.group.WORLD:
        with pytest.raises(ValueError, match="the block mask was made for another process group"):
            fd.flex_attention(q, q, q, block_mask=bm, group=dist.group.WORLD)


def _compiled(group) -> None:
    """Under torch.compile(fullgraph=True): the same output and gradients as the eager call."""
    S = 37
    g = torch.Generator().manual_seed(3)
    q, k, v = (fd.shard(torch.randn(1, 2, S, BLOCK, generator=g), group, load_balance="head_tail")
               for _ in range(3))
    bias = torch.randn(2, S, generator=g)
    bm = fd.create_block_mask(masks.causal, None, None, S, S, group, load_balance="head_tail", device="cpu",
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
    # a new mask at every step, two masks in turn (a training loop's batches), each dropped before
    # its backward (the autograd graph keeps it): one graph for all of them, each step the output
    # and gradients of its own mask
    import torch._dynamo.utils as dynamo_utils

    from flexattn.distributed import masks as dmasks

    def step(q, k, v, bm):
        return fd.flex_attention(q, k, v, block_mask=bm)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    live = set(dmasks._BY_HANDLE)
    for i in range(10):  # (more than torch.compile's 8 recompilations)
        mask = masks.causal if i % 2 else _within(9)
        results = []
        for fn in (step, compiled):
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*ins, fd.create_block_mask(mask, None, None, S, S, group, load_balance="head_tail",
                                                device="cpu", BLOCK_SIZE=BLOCK))
            gc.collect()
            results.append([out, *torch.autograd.grad(out.square().sum(), ins)])
        for eager, ours in zip(*results):
            torch.testing.assert_close(ours, eager, rtol=0, atol=0)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs + 1
    del out, results, ins  # (and freed with the autograd graphs that saved them)
    gc.collect()
    assert set(dmasks._BY_HANDLE) <= live
    # saved-tensor hooks that copy what autograd saves (offloading), the handle too: an eager call's
    # context keeps the mask
    x = q.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda t: t):
        out = step(x, x, x, fd.create_block_mask(masks.causal, None, None, S, S, group, load_balance="head_tail",
                                                 device="cpu", BLOCK_SIZE=BLOCK))
    gc.collect()
    out.sum().backward()
    assert x.grad is not None
    # a mask is its build: a copy is the mask itself, and its handle and group stay; its methods
    # inside a compiled function
    assert copy.copy(bm) is bm and copy.deepcopy(bm) is bm
    with pytest.raises(AttributeError, match="fixed when the mask is made"):
        bm.group = None
    scaled = torch.compile(lambda q: fd.flex_attention(q, q, q, block_mask=bm) * bm.sparsity(), backend="aot_eager")
    torch.testing.assert_close(scaled(q), fd.flex_attention(q, q, q, block_mask=bm) * bm.sparsity(), rtol=0, atol=0)
    # a mask built inside a compiled function (a graph break: the build runs eagerly), from a number
    # the function is given
    def built_inside(q, width):
        return fd.flex_attention(q, q, q, block_mask=fd.create_block_mask(
            _within(width), None, None, S, S, group, load_balance="head_tail", device="cpu", BLOCK_SIZE=BLOCK))

    inside = torch.compile(built_inside, backend="aot_eager")
    for width in (3, 9, 30):
        torch.testing.assert_close(inside(q, width), built_inside(q, width), rtol=0, atol=0)


def _soft_per_head(score, b, h, q_idx, kv_idx):
    return 8 * torch.tanh(score / 8) + 0.1 * h


def _late_causal(b, h, q_idx, kv_idx):  # rows 0..4 see no key: their lse and max scores are -inf
    return (q_idx >= 5) & (kv_idx <= q_idx)


def _aux(group) -> None:
    """``return_aux``: every rank's lse and max scores (the maximum over all KV shards) are the rows
    single-process flexattn gives, and the float64 reference's; both methods; under
    torch.compile(fullgraph=True) the same; AuxRequest() gives neither; with return_lse an error."""
    S, scale = 45, 0.4
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, S, BLOCK, generator=g) for _ in range(3))
    q64, k64 = q.double(), k.double()
    keep = _late_causal(0, 0, torch.arange(S)[:, None], torch.arange(S)[None, :])
    max64 = apply_score_mod(_soft_per_head, q64 @ k64.transpose(-2, -1) * scale).masked_fill(~keep, -math.inf).amax(-1)
    bm1 = flexattn.create_block_mask(_late_causal, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    _, want = flexattn.flex_attention(q, k, v, score_mod=_soft_per_head, block_mask=bm1, scale=scale,
                                      return_aux=AuxRequest(lse=True, max_scores=True))
    assert torch.isneginf(max64[..., :5]).all() and torch.isneginf(want.max_scores[..., :5]).all()
    bm = fd.create_block_mask(_late_causal, None, None, S, S, group, load_balance="head_tail", device="cpu",
                              BLOCK_SIZE=BLOCK)
    local = [fd.shard(t, group, seq_dim=2, load_balance="head_tail") for t in (q, k, v)]

    def attn(q, k, v, method="ring", request=AuxRequest(lse=True, max_scores=True)):
        return fd.flex_attention(q, k, v, score_mod=_soft_per_head, block_mask=bm, scale=scale, method=method,
                                 return_aux=request)

    eager = {}
    for method in ("ring", "allgather"):
        out, aux = eager[method] = attn(*(t.clone().requires_grad_() for t in local), method=method)
        assert aux.lse.requires_grad and not aux.max_scores.requires_grad
        lse, mx = (fd.unshard(t, group, seq_dim=2, load_balance="head_tail") for t in aux)
        torch.testing.assert_close(mx, want.max_scores, rtol=1e-6, atol=1e-6, msg=f"{method}: max_scores")
        torch.testing.assert_close(mx.double(), max64, rtol=2e-5, atol=2e-5, msg=f"{method}: max_scores, float64")
        torch.testing.assert_close(lse, want.lse, rtol=1e-5, atol=1e-5, msg=f"{method}: lse")
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")(*local)[1]
    torch.testing.assert_close(compiled.max_scores, eager["ring"][1].max_scores, rtol=0, atol=0)
    assert attn(*local, request=AuxRequest())[1] == (None, None)
    with pytest.raises(ValueError, match="return_lse=True or return_aux"):
        fd.flex_attention(*local, block_mask=bm, return_lse=True, return_aux=AuxRequest(lse=True))


class _Attention(torch.nn.Module):
    def __init__(self, fn, block_mask):
        super().__init__()
        self.fn, self.block_mask = fn, block_mask

    def forward(self, q, k, v):
        return self.fn(q, k, v, block_mask=self.block_mask)


def context_parallel_module(fn, block_mask, mesh) -> torch.nn.Module:
    """A module calling ``fn(q, k, v, block_mask=block_mask)`` under torch's context parallel
    (`_ContextParallel`, FLEX attention type) over ``mesh``: it all-gathers K/V on the way in."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(_Attention(fn, block_mask), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))


def _torch_context_parallel(group) -> None:
    """A module under torch's own context parallel (`_ContextParallel`, FLEX attention type, a
    DeviceMesh on gloo) with `flexattn.flex_attention` inside gives the output of the same module
    with torch's FlexAttention inside, and the gradients of the float64 reference. torch 2.13
    runs its context parallel on CPU (its block mask through ``torch.compile(create_block_mask)``
    with Inductor's C++ back end), but not torch's FlexAttention backward: "FlexAttention does not
    support backward on CPU", so the gradient parity with torch is the GPU test's
    (tests/test_distributed_gpu.py)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    P = dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    S = 128 * P  # torch's smallest: a multiple of P x its block size 128
    bm = _create_cp_block_mask(masks.causal, 1, 2, S, S, mesh, _HeadTailLoadBalancer(S, P, "cpu"))
    g = torch.Generator().manual_seed(5)
    q, k, v, d_out = (torch.randn(1, 2, S, BLOCK, generator=g) for _ in range(4))
    local = [fd.shard(t, group, load_balance="head_tail") for t in (q, k, v, d_out)]

    theirs = context_parallel_module(torch_flex, bm, mesh)(*local[:3])
    ins = [t.clone().requires_grad_() for t in local[:3]]
    ours = context_parallel_module(flexattn.flex_attention, bm, mesh)(*ins)
    grads = torch.autograd.grad(ours, ins, local[3])
    assert_close_to_reference(ours, theirs, theirs.double(), name="flexattn in torch's context parallel out")
    ins64 = [t.double().requires_grad_() for t in (q, k, v)]
    out64 = attention_reference(*ins64, mask_mod=masks.causal)
    grads64 = torch.autograd.grad(out64, ins64, d_out.double())
    whole_out = fd.unshard(ours.detach(), group, load_balance="head_tail")
    torch.testing.assert_close(whole_out, out64.float(), rtol=0, atol=1e-5)
    for label, mine, ref in zip(("dq", "dk", "dv"), grads, grads64):
        whole = fd.unshard(mine, group, load_balance="head_tail")
        atol = backward_atol(ref, (torch.float32,), d_out, v, torch.zeros(1))
        torch.testing.assert_close(whole, ref.float(), rtol=0, atol=atol, msg=f"{label} in torch's context parallel")


def _promises_and_strides(group) -> None:
    """Kernel options that promise something of the whole mask hold for the one-process call but
    not for each pair (a row of a pair may see no key; the all-gather's KV blocks lie in the shards'
    order): both methods give the one-process output and gradients with them. Activations held as
    [B, L, H, D]: the output and the gradients have the strides the custom ops' fake kernels give
    them (a contiguous output, gradients like their inputs), which a compiled graph relies on."""
    S = 121
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, S, BLOCK, generator=g).requires_grad_() for _ in range(3))
    want = flexattn.flex_attention(q, k, v, block_mask=flexattn.create_block_mask(
        masks.causal, None, None, S, S, device="cpu", BLOCK_SIZE=BLOCK))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    bm = fd.create_block_mask(masks.causal, None, None, S, S, group, load_balance="head_tail", device="cpu",
                              BLOCK_SIZE=BLOCK)

    def sharded(t):
        return fd.shard(t.detach(), group, seq_dim=2, load_balance="head_tail")

    def whole(t):
        return fd.unshard(t, group, seq_dim=2, load_balance="head_tail")

    for method, option in (("ring", "ROWS_GUARANTEED_SAFE"), ("allgather", "BLOCKS_ARE_CONTIGUOUS")):
        local = [sharded(t).requires_grad_() for t in (q, k, v)]
        # (with the max scores asked for, a pair's few rows take the forward kernel, not the decoding one)
        out, _ = fd.flex_attention(*local, block_mask=bm, method=method, kernel_options={option: True},
                                   return_aux=AuxRequest(max_scores=True))
        torch.testing.assert_close(whole(out), want, atol=1e-5, rtol=1e-5, msg=f"{method} with {option}")
        for name, got, ref in zip("qkv", torch.autograd.grad(out.square().sum(), local), want_grads):
            torch.testing.assert_close(whole(got), ref, atol=1e-4, rtol=1e-4, msg=f"{method} with {option}: d{name}")
        held = [sharded(t).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for t in (q, k, v)]
        out = fd.flex_attention(*held, block_mask=bm, method=method)
        assert out.is_contiguous(), (method, out.stride())
        for x, grad in zip(held, torch.autograd.grad(out.square().sum(), held)):
            assert grad.stride() == torch.empty_like(x).stride(), (method, grad.stride(), x.stride())


def _deterministic(group) -> None:
    """Deterministic mode reaches every pair's backward: torch's flag at the call, or
    DETERMINISTIC=True, makes each step's plan sum the captured bias's gradient exactly
    (`exact_grads`), and an explicit False or neither does not (the all-gather: the flag, or not);
    the gradients are the same either way."""
    from flexattn.kernels import backward as bwd

    S = 37
    g = torch.Generator().manual_seed(7)
    q, k, v = (fd.shard(torch.randn(1, 2, S, BLOCK, generator=g), group, load_balance="head_tail") for _ in range(3))
    bias = torch.randn(2, S, generator=g)
    bm = fd.create_block_mask(masks.causal, None, None, S, S, group, load_balance="head_tail", device="cpu",
                              BLOCK_SIZE=BLOCK)
    run, exact, det = bwd.run, [], {"DETERMINISTIC": True}

    def recording(plan, *args, **kwargs):
        exact.append(plan.exact_grads)
        return run(plan, *args, **kwargs)

    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    bwd.run = recording
    first = {}
    try:
        for method, flag, options, want in (("ring", False, None, False), ("ring", True, None, True),
                                            ("ring", False, det, True), ("ring", True, {"DETERMINISTIC": False}, False),
                                            ("allgather", False, None, False), ("allgather", True, None, True)):
            torch.use_deterministic_algorithms(flag)
            ins = [t.clone().requires_grad_() for t in (q, k, v, bias)]
            out = fd.flex_attention(*ins[:3], score_mod=_bias_score(ins[3]), block_mask=bm, kernel_options=options,
                                    method=method)
            exact.clear()
            grads = torch.autograd.grad(out.square().sum(), ins)
            assert exact and all(e is want for e in exact), (method, flag, options, exact)
            for a, b in zip(grads, first.setdefault(method, grads)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{method}: deterministic gradients")
    finally:
        bwd.run = run
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _body(group) -> None:
    P = dist.get_world_size(group)
    _layouts_and_masks(group)
    _repeated_builds(group)
    _errors(group)
    _aux(group)
    _promises_and_strides(group)
    if P == 2:
        _deterministic(group)
        _compiled(group)
        _torch_context_parallel(group)
    for index, case in enumerate(CASES[P]):
        _check_case(group, index, case)


def test_distributed_gloo(tmp_path):
    os.environ.setdefault("FLEXATTN_CACHE_DIR", str(tmp_path / "cache"))
    mp.spawn(_worker, args=(3, str(tmp_path / "store")), nprocs=3, join=True)


def test_whole_documents_is_the_most_even_cut():
    """Cuts at document boundaries, every rank a document at least, and the largest rank's causal
    work as small as any cut's (all cuts tried)."""
    rng = random.Random(0)
    for _ in range(100):
        docs = [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        P = rng.randint(1, min(4, len(docs)))
        layout, S = fd.WholeDocuments(docs), sum(docs)
        starts = list(itertools.accumulate(docs, initial=0))
        work = [n * (n + 1) // 2 for n in docs]

        def largest(cuts):
            at = [starts.index(c) for c in cuts]
            return max(sum(work[a:b]) for a, b in zip(at, at[1:]))

        runs = [layout.runs(S, P, r) for r in range(P)]
        cuts = [r[0][0] for r in runs] + [S]
        assert [r[0][1] for r in runs] == cuts[1:] and all(b > a for a, b in zip(cuts, cuts[1:])), (docs, runs)
        assert largest(cuts) == min(largest([0, *c, S]) for c in itertools.combinations(starts[1:-1], P - 1))
    with pytest.raises(ValueError, match="2 documents cannot fill 3 ranks"):
        fd.WholeDocuments([4, 5]).runs(9, 3, 0)
    with pytest.raises(ValueError, match="sum to 9, but the sequence length is 10"):
        fd.WholeDocuments([4, 5]).runs(10, 2, 0)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton listed", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layout", ["head_tail", "documents", "window"])
def test_pair_tables_are_the_masks_built_for_those_positions(layout, backend, monkeypatch):
    """One classification of a rank's queries against every KV shard side by side (each padded to
    whole blocks, the padding masked out) lists, for any rectangle of query blocks and KV blocks
    of one shard, the tables of a block mask built for those queries and keys alone; its block
    ranges are those of each pair's own mask. (A shard has 13 KV blocks: shards start inside the
    state's 16-tile words; the window grows with b and h: its tiles differ between them. S=1201
    over 3 ranks: head-tail chunks end inside query tiles, whose rows interval analysis leaves
    undecided; "triton listed" lists every undecided tile for exact_kernel, against masks built
    by the torch path.)"""
    from flexattn.block_mask.create import classify
    from flexattn.kernels import mask_tiles
    from flexattn.distributed.masks import MASK, _ranges, at_global_positions
    reference = backend
    if backend == "triton listed":
        monkeypatch.setitem(mask_tiles.DEFER_MIN, "interpret", 1)
        backend, reference = "triton", "torch"
    S, P, QB, KVB, B, H = 1201, 3, 64, 32, 2, 2
    docs = [500, 400, 301]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(docs))

    def window(b, h, q_idx, kv_idx):  # (pairs that keep nothing)
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 100 + 150 * h + 60 * b)

    mod, lb = {"head_tail": (masks.causal, fd.HeadTail()),
               "documents": (masks.document(ids, causal=True), fd.PerDocument(docs)),
               "window": (window, fd.Contiguous())}[layout]
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    if backend == "cuda":  # (the generated kernels on the GPU; "triton": interpreted)
        backend = reference = "triton"
    mod = flexattn.trace(mod, "mask")
    mod = mod.rebind([t.to(device) for t in mod.buffers])
    tiled, kept, n = lb.tiled_positions(S, P, KVB, device)
    assert n % 16
    partial_rows = partial_cols = empty = 0
    rects = []
    for r in range(P):
        qpos = lb.positions(S, P, r, device)
        local, _ = at_global_positions(mod, MASK, torch.float32, qpos, tiled, kept)
        tiles = classify(local, B, H, qpos.numel(), tiled.numel(), QB, KVB, device, backend)
        assert (tiles.tiles.BD, tiles.tiles.HD) == ((B, H) if layout == "window" else (1, 1))
        table = tiles.shard_ranges(P, n).tolist()
        for j in range(P):
            kvpos = lb.positions(S, P, j, device)
            whole, _ = at_global_positions(mod, MASK, torch.float32, qpos, kvpos)
            dense = flexattn.create_mask(whole, B, H, qpos.numel(), kvpos.numel(), device=device).flatten(0, 1).any(0)
            ranges = _ranges(table[j])
            if not dense.any():
                assert ranges is None
                empty += 1
                continue
            listed_kv = torch.nn.functional.pad(dense.any(0), (0, -dense.shape[1] % KVB)).view(-1, KVB).any(1)
            listed_q = torch.nn.functional.pad(dense.any(1), (0, -dense.shape[0] % QB)).view(-1, QB).any(1)
            assert ranges == ((int(listed_kv.nonzero()[0]), int(listed_kv.nonzero()[-1]) + 1),
                              (int(listed_q.nonzero()[0]), int(listed_q.nonzero()[-1]) + 1)), (r, j)
            (kv_lo, kv_hi), (q_lo, q_hi) = ranges
            # (the pair whole, the rows that read the shard against all of it, and those rows against
            # the blocks they read: the rectangles create_block_mask lists)
            for tq, tk in {((0, tiles.n_q), (0, -(-kvpos.numel() // KVB))), ((q_lo, q_hi), (0, -(-kvpos.numel() // KVB))),
                           ((q_lo, q_hi), (kv_lo, kv_hi))}:
                rows = (tq[0] * QB, min(tq[1] * QB, qpos.numel()))
                held = (tk[0] * KVB, min(tk[1] * KVB, kvpos.numel()))
                partial_rows += rows != (0, qpos.numel())
                partial_cols += held != (0, kvpos.numel())
                pair, _ = at_global_positions(mod, MASK, torch.float32, qpos[slice(*rows)], kvpos[slice(*held)])
                rects.append(((tq, (n * j + tk[0], n * j + tk[1])), (pair, rows, held, (r, j, tq, tk))))
        # (all of a rank's rectangles, of different sizes, from one launch of each order kernel; and
        # the first alone)
        names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
        alone = tiles.tables(*rects[0][0])
        for i, (got, (pair, rows, held, where)) in enumerate(zip(tiles.tables_of([rect for rect, _ in rects]),
                                                                  [case for _, case in rects])):
            built = flexattn.create_block_mask(pair, B, H, rows[1] - rows[0], held[1] - held[0], device=device,
                                               BLOCK_SIZE=(QB, KVB), backend=reference)
            for name, t, first in zip(names, got, alone):
                assert torch.equal(t, getattr(built, name)), (*where, name)
                assert i or torch.equal(first, t), (*where, name)
                # (views of one buffer, each aligned as the kernels' direct launch asks)
                assert t.data_ptr() % 16 == 0 and first.data_ptr() % 16 == 0, (*where, name)
        rects.clear()
    assert partial_rows and partial_cols and (empty > 0) == (layout == "window")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["head_tail", "documents"])
def test_unpadded_shards_read_no_kept_table(layout, backend, monkeypatch):
    """Where every KV shard fills whole blocks (S = 192: shards of 96 positions, 6 blocks of 16),
    a rank's classification reads its query positions and the KV shards side by side, and no
    table of kept keys (a captured tensor, its summary and a gather per element fewer); each
    pair's tables are still those of the mask read at the pair's positions. The ranks' ranges
    are classified here rank by rank, as the gather would share them."""
    from flexattn.block_mask import create
    from flexattn.distributed import masks as dmasks
    from flexattn.lru import LRU
    if backend == "triton":  # (the generated kernels, interpreted: the GPU's path)
        monkeypatch.setattr(dmasks, "classify", lambda *a, defer=True: create.classify(*a[:8], "triton", defer=defer))
    monkeypatch.setattr(dmasks, "_SHARDS", LRU(16))  # (a causal classification made by the other backend is kept there)
    S, P = 192, 2
    mask, lb = {"head_tail": (masks.causal, fd.HeadTail()),
                "documents": (masks.document(lengths=[64, 96, 32], causal=True), fd.PerDocument([64, 96, 32]))}[layout]
    mod = dmasks.as_mask_mod(mask)
    numbers = tuple(map(scalars.number_of, mod.buffers))
    built = [dmasks._classified(mod, numbers, None, None, S, S, BLOCK, lb, P, r, torch.device("cpu"))
             for r in range(P)]
    tables = [classified.ranges.flatten().tolist() for _, classified in built]
    for r, (shards, classified) in enumerate(built):
        assert len(shards.positioned(mod)[0].buffers) == len(mod.buffers) + 2, r
        pairs, pair_masks = dmasks._listed(mod, shards, classified, tables)
        assert pairs.read == list(range(P)), pairs.read  # (head-tail: every rank reads every shard)
        for j in pairs.read:
            _assert_pair_tables(pair_masks[j], pairs.qpos_rows[j], pairs.kvpos_held[j], mask, (r, j))


def test_per_document_positions_take_a_few_ops():
    """A per-document layout's positions (two runs per document on each rank) are made in a few
    torch ops whatever the number of documents, not in an arange per run: on a GPU each op is a
    kernel launch, and a packed batch of 200 documents made 401 of them per rank at a new layout."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counted(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counted.ops += 1
            return func(*args, **(kwargs or {}))

    lengths = [7 + i % 5 for i in range(200)]
    layout, S = fd.PerDocument(lengths), sum(lengths)
    with Counted():
        pos = layout.positions(S, 2, 1)
    assert Counted.ops <= 12, Counted.ops
    assert torch.equal(pos, torch.cat([torch.arange(a, b, dtype=torch.int32) for a, b in layout.runs(S, 2, 1)]))


def test_kept_position_summaries_are_the_tables_summaries():
    """The summaries a layout keeps of its tiled positions and kept-key table (made by the
    block-mask kernels' pyramid, a launch or two instead of a reduction per level) are those
    `interval.Summary` makes of the tables, level by level."""
    from flexattn import interval

    # (S=1344: 7 blocks per shard, none padded)
    for layout, S in ((fd.HeadTail(), 1000), (fd.PerDocument([300, 333, 367]), 1000), (fd.HeadTail(), 1344)):
        positions, kept, _ = layout.tiled_positions(S, 3, 64, "cpu")
        padded = kept is not None  # (None: no shard is padded)
        for table in (positions, kept) if padded else (positions,):
            got, want = interval.Summary.kept(table), interval.Summary._of(table)
            assert got is not None
            for name in ("mins", "maxs", "offsets"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (layout, S, name)
        assert padded == (S == 1000)


@pytest.mark.parametrize("P", [2, 3])
def test_layouts_match_torch(P):
    """Every rank's positions together cover the sequence once; head-tail in the order of torch's
    `_HeadTailLoadBalancer`, per-document head-tail as torch's `_PerDocumentHeadTailLoadBalancer`
    documents it (its drawing of documents 4, 8, 4 on 2 ranks). (torch 2.13's per-document index
    list is document-major, so its contiguous shards of it hold whole documents, unlike its
    drawing: flexattn follows the drawing, which balances every document.)"""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    S = 8 * P * 3
    order = torch.cat([fd.HeadTail().positions(S, P, r) for r in range(P)]).long()
    assert torch.equal(order, _HeadTailLoadBalancer(S, P, "cpu")._generate_indices()[0])
    drawn = [[0, 3, 4, 5, 10, 11, 12, 15], [1, 2, 6, 7, 8, 9, 13, 14]]
    assert [fd.PerDocument([4, 8, 4]).positions(16, 2, r).tolist() for r in range(2)] == drawn
    for layout in (fd.Contiguous(), fd.HeadTail(), fd.PerDocument([5, 30, 12])):  # uneven lengths
        allpos = torch.cat([layout.positions(47, P, r) for r in range(P)])
        assert torch.equal(allpos.sort().values, torch.arange(47, dtype=torch.int32)), layout


def _merged64(parts, n: int):
    """Float64 (out, lse) of all ``n`` rows from ``parts`` [(out, lse, (lo, hi))] by the definition:
    lse = log sum exp of the parts' lse, out = sum of exp(lse_i - lse) out_i (0 where no part sees
    a row)."""
    B, H, _, D = parts[0][0].shape
    outs = torch.zeros(len(parts), B, H, n, D, dtype=torch.float64)
    lses = torch.full((len(parts), B, H, n), -math.inf, dtype=torch.float64)
    for i, (o, lse, (lo, hi)) in enumerate(parts):
        outs[i, :, :, lo:hi], lses[i, :, :, lo:hi] = o.double(), lse.double()
    total = torch.logsumexp(lses, 0)
    w = torch.where(total.isfinite(), torch.exp(lses - total), 0.0)
    return (w.unsqueeze(-1) * outs).sum(0), total


def _assert_rounded_once(got: torch.Tensor, want64: torch.Tensor, what: str) -> None:
    """``got`` (16-bit) is ``want64`` rounded to nearest once: equal but for float32 ties (under 1%
    of the elements), and never more than one ulp off (truncation, or rounding twice, is not)."""
    want = want64.float().to(got.dtype)
    assert (got != want).double().mean() < 0.01, (what, (got != want).double().mean().item())
    ulp = torch.finfo(got.dtype).eps * want64.abs().clamp_min(1e-30)
    assert ((got.double() - want64).abs() <= ulp).all(), what


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel(dtype, device):
    """The one-pass merge (templates/merge.py, through Triton's interpreter on the CPU, its CUDA
    kernel with -m gpu) against the merge by its definition in float64: rows of row views, rows
    one part or neither sees (LSE -inf: out 0, never NaN), a head dim that is not a power of two,
    output in float32 and in the inputs' dtype (rounded to nearest once), in place; a last
    dimension that is not contiguous takes the torch ops."""
    from flexattn.kernels import merge

    g = torch.Generator().manual_seed(0)
    B, H, L, D, lo, hi = 2, 3, 75, 24, 9, 70
    out, part = (torch.randn(B, H, L, D, generator=g).to(dtype) for _ in range(2))
    lse, part_lse = (torch.randn(B, H, L, generator=g) * 3 for _ in range(2))
    lse[0, 1, 10:14] = -math.inf
    part_lse[0, 1, 12:16] = -math.inf  # rows 12, 13: neither part
    want_out, want_lse = _merged64([(out[:, :, lo:hi], lse[:, :, lo:hi], (0, hi - lo)),
                                    (part[:, :, lo:hi], part_lse[:, :, lo:hi], (0, hi - lo))], hi - lo)
    # (the inputs on the device; the expected values and the checks on the CPU)
    d_out, d_lse, d_part, d_part_lse = (t.to(device) for t in (out, lse, part, part_lse))
    for result_dtype in (torch.float32, dtype):
        got_lse = d_lse.clone()
        got = torch.full((B, H, L, D), math.nan, dtype=result_dtype, device=device)
        merge.merge_into(got[:, :, lo:hi], d_out[:, :, lo:hi], got_lse[:, :, lo:hi], d_part[:, :, lo:hi],
                         d_part_lse[:, :, lo:hi])
        got, got_lse = got.cpu(), got_lse.cpu()
        if result_dtype == torch.float32:
            torch.testing.assert_close(got[:, :, lo:hi].double(), want_out, rtol=1e-6, atol=1e-6)
        else:
            _assert_rounded_once(got[:, :, lo:hi], want_out, "merged rows")
        torch.testing.assert_close(got_lse[:, :, lo:hi].double(), want_lse, rtol=1e-6, atol=1e-6)
        assert got[:, :, :lo].isnan().all() and got[:, :, hi:].isnan().all()  # (nothing outside the rows)
        assert torch.equal(got_lse[:, :, :lo], lse[:, :, :lo]) and torch.equal(got_lse[:, :, hi:], lse[:, :, hi:])
        assert (got[0, 1, 12:14] == 0).all() and (got_lse[0, 1, 12:14] == -math.inf).all()
    full_out, full_lse = _merged64([(out, lse, (0, L)), (part, part_lse, (0, L))], L)
    inplace, inplace_lse = d_out.clone(), d_lse.clone()  # (the result may be the output it reads)
    merge.merge_into(inplace, inplace, inplace_lse, d_part, d_part_lse)
    strided = d_out.transpose(2, 3).contiguous().transpose(2, 3)  # (D not innermost: torch ops)
    strided_lse = d_lse.clone()
    merge.merge_into(strided, strided, strided_lse, d_part, d_part_lse)
    for got, got_lse in ((inplace.cpu(), inplace_lse.cpu()), (strided.cpu(), strided_lse.cpu())):
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), full_out, rtol=1e-6, atol=1e-6)
        else:
            _assert_rounded_once(got, full_out, "in place")
        torch.testing.assert_close(got_lse.double(), full_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_ring_merge_rows(dtype):
    """The ring's merges of three parts, one of all rows and two of some rows, in several orders, give
    the merge of all of them by its definition in float64: the rows a part does not cover keep
    what they had, the first part of all rows comes back as it was, the last merge writes the
    dtype asked for, rounded once."""
    from flexattn.distributed.ring import merge_rows

    g = torch.Generator().manual_seed(1)
    B, H, n, D = 1, 2, 40, 8
    spans = [(0, n), (8, 32), (16, 40)]  # (the last two overlap: a last merge of rows merged before)
    stat = torch.float64 if dtype == torch.float64 else torch.float32  # (the kernels' LSE dtype)
    parts = [(torch.randn(B, H, hi - lo, D, generator=g).to(dtype),
              torch.randn(B, H, hi - lo, generator=g).to(stat)) for lo, hi in spans]
    want_out, want_lse = _merged64([(o, lse, span) for (o, lse), span in zip(parts, spans)], n)
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1], [1, 0, 2]):
        out = lse = None
        for step, i in enumerate(order):
            last = step == len(order) - 1
            part = [t.clone() for t in parts[i]]  # (merges write into the tensors they are given)
            got = merge_rows(out, lse, *part, spans[i], n, dtype if last else None)
            if step == 0 and spans[i] == (0, n):
                assert got[0] is part[0]  # (kept as the kernel gave it)
            out, lse = got
        assert out.dtype == dtype and lse.dtype == stat, order
        if dtype == torch.bfloat16:
            _assert_rounded_once(out, want_out, f"order {order}")
        else:
            torch.testing.assert_close(out.double(), want_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_sums_rounded_once(dtype):
    """The ring's dQ and own dK/dV sums (`_sum_rows`): a second and last part is added in place in
    the first part's 16-bit dtype, three parts are summed in float32 and the last sum is written
    in the parts' dtype: bitwise what converting to float32, adding and rounding at the end gives.
    Parts of some rows add into those rows only; a first part of some rows starts from zeros."""
    from flexattn.distributed.ring import _sum_rows

    g = torch.Generator().manual_seed(2)
    # (magnitudes far apart too: the sum rounds)
    a, b, c = (torch.randn(2, 3, 40, 8, generator=g) * torch.logspace(-3, 3, 8) for _ in range(3))
    a16, b16, c16 = (t.to(dtype) for t in (a, b, c))
    whole = (0, 40)
    assert _sum_rows(None, a16, torch.float32, whole, 40) is a16  # (the first part of all rows, as it came)
    first = a16.clone()
    got = _sum_rows(first, b16, torch.float32, whole, 40, last=True)
    assert got is first and torch.equal(got, (a16.float() + b16.float()).to(dtype))
    rows = _sum_rows(a16.clone(), b16[:, :, 8:30], torch.float32, (8, 30), 40, last=True)
    assert rows.dtype == dtype and torch.equal(rows[:, :, 8:30], (a16.float() + b16.float()).to(dtype)[:, :, 8:30])
    assert torch.equal(rows[:, :, :8], a16[:, :, :8]) and torch.equal(rows[:, :, 30:], a16[:, :, 30:])
    two = _sum_rows(a16.clone(), b16, torch.float32, whole, 40)
    assert two.dtype == torch.float32 and torch.equal(two, a16.float() + b16.float())
    three = _sum_rows(two, c16[:, :, 5:33], torch.float32, (5, 33), 40, last=True)
    want = a16.float() + b16.float()
    want[:, :, 5:33] += c16[:, :, 5:33].float()
    assert three.dtype == dtype and torch.equal(three, want.to(dtype))
    lone = _sum_rows(None, b16[:, :, 8:30], torch.float32, (8, 30), 40)  # (a first part of some rows)
    assert lone.dtype == torch.float32 and (lone[:, :, :8] == 0).all() and (lone[:, :, 30:] == 0).all()
    assert torch.equal(lone[:, :, 8:30], b16[:, :, 8:30].float())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16, torch.float32),
                                    (torch.float32, torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.float16, torch.float32),
                                    (None, torch.bfloat16, torch.float32)])
def test_add_rows_kernel(dtypes, device):
    """`merge.add_rows` (templates/merge.py, through Triton's interpreter on the CPU, its CUDA
    kernel with -m gpu): a part of some rows added to a total (or to zeros) in float32, rounded
    once into the result's dtype, every row of the result written, in place too; a head dim that
    is not a power of two; a last dimension that is not contiguous takes the torch ops."""
    from flexattn.kernels import merge

    total_dtype, part_dtype, result_dtype = dtypes
    g = torch.Generator().manual_seed(3)
    B, H, L, D, lo, hi = 2, 3, 75, 24, 9, 70
    total = None if total_dtype is None else (torch.randn(B, H, L, D, generator=g) * 30).to(total_dtype)
    part = torch.randn(B, H, hi - lo, D, generator=g).to(part_dtype)
    want = torch.zeros(B, H, L, D) if total is None else total.float().clone()
    want[:, :, lo:hi] += part.float()
    want = want.to(result_dtype)
    d_total = None if total is None else total.to(device)
    got = torch.full((B, H, L, D), math.nan, dtype=result_dtype, device=device)
    merge.add_rows(got, d_total, part.to(device), lo)
    assert torch.equal(got.cpu(), want)
    if total is not None:
        assert torch.equal(d_total.cpu(), total)  # (read, not written)
        if total_dtype == result_dtype:
            inplace = d_total.clone()
            merge.add_rows(inplace, inplace, part.to(device), lo)
            assert torch.equal(inplace.cpu(), want)
        strided = d_total.transpose(2, 3).contiguous().transpose(2, 3)
        got = torch.full((B, H, L, D), math.nan, dtype=result_dtype, device=device)
        merge.add_rows(got, strided, part.to(device), lo)
        assert torch.equal(got.cpu(), want)
    # (the same shapes at other rows, again and again: a launch that kept a row offset would show)
    short = part[:, :, :16]
    for at in (1, 1, 1, 5, 16, 5):
        want = (torch.zeros(B, H, L, D) if total is None else total.float().clone())
        want[:, :, at:at + 16] += short.float()
        got = torch.full((B, H, L, D), math.nan, dtype=result_dtype, device=device)
        merge.add_rows(got, d_total, short.to(device), at)
        assert torch.equal(got.cpu(), want.to(result_dtype)), at
    with pytest.raises(ValueError, match="add_rows: shapes differ"):
        merge.add_rows(got, d_total, part.to(device), L - 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_kernel_compiles_for_the_gpu(dtype):
    """The merge's and the row sum's CUDA kernels compile for sm_90 without a GPU (ptxas
    included), a bfloat16 result rounded to nearest by the hardware's conversion."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from flexattn.kernels import launch

    module = launch.kernel_module("merge", (), "cuda", dict, dict)
    sixteen, f32 = torch.empty(1, dtype=dtype), torch.empty(1)
    for kernel, pointers, constexprs in [
            (module.merge_kernel, [sixteen, f32, sixteen, f32, sixteen], dict(BLOCK_L=32, BLOCK_D=128)),
            (module.add_rows_kernel, [f32, sixteen, sixteen], dict(HAS_A=True, BLOCK_L=32, BLOCK_D=128))]:
        integers = kernel.arg_names[len(pointers):len(kernel.arg_names) - len(constexprs)]
        signature = {n: mangle_type(a) for n, a in zip(kernel.arg_names, pointers + [7] * len(integers))}
        signature.update({n: "constexpr" for n in constexprs})
        ptx = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 4, "enable_fp_fusion": True}).asm["ptx"]
        assert ("cvt.rn.bf16" in ptx) == (dtype == torch.bfloat16), kernel


# ---------------------------------------------------------------------------------------------
# The ring's copy-engine protocol (flexattn.distributed.copies), simulated on the CPU: every
# rank's compute and copy streams as queues of operations, the signal pads as flags, the slots as
# cells holding a shard's name. A step's compute must read the shard it expects, and the ranks
# must never wait for each other for ever.


class _Queue:
    def __init__(self, name):
        self.name, self.ops, self.done = name, [], 0

    def wait_stream(self, other):  # (everything enqueued on ``other`` so far comes first)
        self.ops.append(("after", other, len(other.ops)))


class _Cell:
    """A slot's tensor (``rank``, slot, index) or a rank's own K or V (slot None)."""

    shape, dtype = (), None

    def __init__(self, sim, rank, slot, index):
        self.sim, self.key = sim, (rank, slot, index)

    def copy_(self, src):
        self.sim.queue().ops.append(("copy", src.key, self.key))

    def record_stream(self, stream):
        pass


class _Handle:
    def __init__(self, sim, rank):
        self.sim, self.rank = sim, rank

    def put_signal(self, dst, channel):
        self.sim.queue().ops.append(("put", (dst, channel, self.rank)))

    def wait_signal(self, src, channel):
        self.sim.queue().ops.append(("wait", (self.rank, channel, src)))


class _Sim:
    def __init__(self, P):
        self.P, self.rank, self.inside = P, 0, None
        self.compute = [_Queue(f"compute {r}") for r in range(P)]
        self.copy = [_Queue(f"copy {r}") for r in range(P)]
        self.home = [_Queue(f"home {r}") for r in range(P)]
        self.pads, self.cells = set(), {}

    def queue(self):
        return self.inside if self.inside is not None else self.compute[self.rank]

    def workspace(self, r):
        from types import SimpleNamespace
        from flexattn.distributed import copies
        ws = SimpleNamespace(rank=r, P=self.P, next=(r + 1) % self.P, prev=(r - 1) % self.P,
                             stream=self.copy[r], home_stream=self.home[r], device=None, handle=_Handle(self, r),
                             views=lambda rank, x, metas: [_Cell(self, rank, x, i) for i in range(len(metas))])
        self.inside = self.copy[r]
        for x in range(2):  # (as the workspace is made: both slots free at the previous rank)
            ws.handle.put_signal(ws.prev, copies.FREE[x])
        self.inside = None
        return ws

    def value(self, key):
        rank, slot, index = key
        return (rank, index) if slot is None else self.cells.get(key)

    def run(self):
        """Run the queues until all are done; the queues left blocked if they deadlock."""
        queues = self.compute + self.copy + self.home
        progress = True
        while progress:
            progress = False
            for q in queues:
                while q.done < len(q.ops):
                    op = q.ops[q.done]
                    if op[0] == "after" and op[1].done < op[2]:
                        break
                    if op[0] == "put":
                        if op[1] in self.pads:  # (put_signal waits until the last one was consumed)
                            break
                        self.pads.add(op[1])
                    elif op[0] == "wait":
                        if op[1] not in self.pads:
                            break
                        self.pads.remove(op[1])
                    elif op[0] == "copy":
                        self.cells[op[2]] = self.value(op[1])
                    elif op[0] == "read":
                        got = self.value(op[1])
                        assert got == op[2], f"{q.name} read {got} from {op[1]}, expected {op[2]}"
                    q.done += 1
                    progress = True
        return [q.name for q in queues if q.done < len(q.ops)]


def _ring_call(sim, workspaces, needs):
    """One ring call (the forward's or the backward's K/V travel) on every rank, as `Ring` makes it."""
    from flexattn.distributed import copies
    from flexattn.distributed.ring import last_steps
    P = sim.P
    last = last_steps(needs, P)
    for r in range(P):
        sim.rank = r
        c = copies.Copies(workspaces[r])
        held = [_Cell(sim, r, None, i) for i in range(2)]
        for s in range(P):
            j, nxt = (r - s) % P, (r - s - 1) % P
            sends = held if s + 1 <= last[j] else []
            works, received = c.exchange(s, sends, ((None, None),) * 2 if s + 1 <= last[nxt] else None)
            if needs[r][j]:
                for i, cell in enumerate(held):
                    sim.compute[r].ops.append(("read", cell.key, (j, i)))
            for w in works:
                w.wait()
            if received is not None:
                held = received
        c.end()


def _ring_backward_call(sim, workspaces, needs, consume=True):
    """One ring backward on every rank, in `Ring.backward`'s order: K/V travel as in the forward,
    and each step's dK/dV part of the window held goes home through the owner's home slots
    (`copies.Home`); the owner reads each part it is sent. ``consume=False`` leaves out the
    owner's "consumed" (the mutation the test must catch)."""
    from flexattn.distributed import copies
    from flexattn.distributed.ring import last_steps
    P = sim.P
    last = last_steps(needs, P)
    coming = [[s for s in range(1, P) if s <= last[o] and needs[(o + s) % P][o]] for o in range(P)]
    for r in range(P):
        sim.rank = r
        c, home = copies.Copies(workspaces[r]), copies.Home(workspaces[r], coming[r])
        held = [_Cell(sim, r, None, i) for i in range(2)]
        home_works, arrived = [], None

        def add_home(s):  # (the owner reads the part sent home at step s, then frees its slot)
            for i, cell in enumerate(arrived):
                sim.compute[r].ops.append(("read", cell.key, ("part", (r + s) % P, s, i)))
            if consume:
                home.consumed(coming[r].index(s))
        for s in range(P):
            j, nxt = (r - s) % P, (r - s - 1) % P
            works, received = c.exchange(s, held if s + 1 <= last[j] else [],
                                         ((None, None),) * 2 if s + 1 <= last[nxt] else None)
            computes = s <= last[j] and needs[r][j]
            if computes:
                for i, cell in enumerate(held):
                    sim.compute[r].ops.append(("read", cell.key, (j, i)))
            for w in home_works:
                w.wait()
            if arrived is not None:
                add_home(s - 1)
            home_works, arrived = [], None
            if computes and s > 0:
                parts = [_Cell(sim, r, ("part", s), i) for i in range(2)]
                for i, cell in enumerate(parts):
                    sim.cells[cell.key] = ("part", r, s, i)
                home.send(parts, j, coming[j].index(s))
            if s in coming[r]:
                home_works, arrived = home.receive(coming[r].index(s), ((None, None),) * 2)
            for w in works:
                w.wait()
            if received is not None:
                held = received
        for w in home_works:
            w.wait()
        if arrived is not None:
            add_home(P - 1)
        c.end()
        home.end()


@pytest.mark.parametrize("P", [2, 3, 4, 5])
def test_copy_protocol_delivers_every_shard_and_never_deadlocks(P, monkeypatch):
    """Random `needs` tables (each rank reads its own shard), several forward and backward calls in
    a row on the same slots: every compute reads the shard it expects and every owner the dK/dV
    part it is sent, no rank waits for ever, and between calls exactly the FREE signals of both K/V
    slots are pending (the invariant a call starts from; no home signal)."""
    from flexattn.distributed import copies
    sim = _Sim(P)

    class _Stream:  # (torch.cuda.stream(ws.stream): the copy queue is current inside)
        def __init__(self, q):
            self.q = q

        def __enter__(self):
            sim.inside = self.q

        def __exit__(self, *exc):
            sim.inside = None
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.compute[sim.rank])
    monkeypatch.setattr(torch.cuda, "stream", _Stream)
    workspaces = [sim.workspace(r) for r in range(P)]
    rng = random.Random(P)
    invariant = {((r - 1) % P, copies.FREE[x], r) for r in range(P) for x in range(2)}
    for call in range(24):
        needs = tuple(tuple(i == j or rng.random() < 0.5 for j in range(P)) for i in range(P))
        (_ring_backward_call if call % 2 else _ring_call)(sim, workspaces, needs)
        assert sim.run() == [], needs
        assert sim.pads == invariant, needs
    # (a schedule the protocol does not follow deadlocks in the simulation: the test can fail)
    sim.rank = 0
    workspaces[0].handle.wait_signal(1, copies.FILLED[0])
    assert sim.run() == ["compute 0"]
    # (and so does an owner that never frees a home slot, from the part after next on: with every
    # pair read, each rank has P - 1 parts coming, more than its two home slots from P = 4 on)
    sim = _Sim(P)
    workspaces = [sim.workspace(r) for r in range(P)]
    _ring_backward_call(sim, workspaces, ((True,) * P,) * P, consume=False)
    assert (sim.run() != []) == (P >= 4)


def test_layout_docstring_examples():
    import doctest

    from flexattn.distributed import layout
    result = doctest.testmod(layout, raise_on_error=False)
    assert result.failed == 0 and result.attempted > 0
