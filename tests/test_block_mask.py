"""BlockMask / create_block_mask: identical to torch's, without the dense mask.

What we compare with torch's ``create_block_mask``: all eight tables (kv_*, full_kv_*, q_*,
full_q_*) element for element, including the entries past each row's count (torch's layout there
is deterministic: the unselected tiles in ascending order, from a stable argsort), their shapes and
dtypes, seq_lengths, BLOCK_SIZE, to_dense(), sparsity() and the text picture.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexattn
from flexattn import ir
from flexattn.block_mask import create as create_module
from flexattn.block_mask import (BlockMask, and_masks, create_block_mask, create_mask, noop_mask,
                                 or_masks)
from flexattn.mods import Mod
from helpers.testing import tile_states_of_dense
from test_interval import mask_irs

FIELDS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]


def assert_same(ours: BlockMask, theirs) -> None:
    for f in FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        if b is None:
            assert a is None, f
            continue
        assert a.dtype == b.dtype == torch.int32, f
        assert a.shape == b.shape, (f, a.shape, b.shape)
        assert torch.equal(a, b), f"{f} differs:\nours   {a}\ntorch  {b}"
    assert ours.seq_lengths == tuple(theirs.seq_lengths)
    assert ours.BLOCK_SIZE == tuple(theirs.BLOCK_SIZE)
    assert ours.shape == theirs.shape
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.sparsity() == pytest.approx(theirs.sparsity())


def both(mask, B, H, Q, KV, bs, backend="torch", **kw):
    ours = create_block_mask(mask, B, H, Q, KV, device="cpu", BLOCK_SIZE=bs, backend=backend, **kw)
    theirs = torch_create_block_mask(mask, B, H, Q, KV, device="cpu", BLOCK_SIZE=bs)
    return ours, theirs


# ---------------------------------------------------------------------------------------------
# Mask families, written as Python mods (traced) exactly as for torch


def _doc_ids(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


DOC = _doc_ids([3, 50, 17, 1, 90, 33, 64, 40, 2])  # 300 tokens, uneven documents
RANDOM = torch.rand(300, 300, generator=torch.Generator().manual_seed(0)) < 0.3


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 37)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < 50) | (q_idx >= kv_idx)


def per_head(b, h, q_idx, kv_idx):
    return q_idx + 16 * h + 5 * b >= kv_idx


def _families(doc, table):
    """The mask families; the ones that capture tensors capture ``doc`` / ``table``."""

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def random_mask(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    return [causal, sliding_window, prefix_lm, document, document_causal, random_mask, per_head]


FAMILIES = _families(DOC, RANDOM)
document, document_causal, random_mask = FAMILIES[3:6]
SHAPES = [(1, 1), (5, 123), (123, 5), (200, 200), (257, 129), (300, 300)]
BLOCKS = [16, 32, 64, 128, 256, (16, 64), (128, 32)]


@pytest.mark.parametrize("mask", FAMILIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bs", BLOCKS, ids=str)
def test_families_match_torch(mask, bs):
    for Q, KV in SHAPES:
        assert_same(*both(mask, 2, 3, Q, KV, bs))


@pytest.mark.parametrize("mask", FAMILIES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bs,Q,KV", [(16, 100, 77), ((32, 16), 257, 129), (64, 300, 300)], ids=str)
def test_generated_kernels_match_torch(mask, bs, Q, KV):
    # The Triton path (the GPU default) through the CPU interpreter.
    assert_same(*both(mask, 2, 2, Q, KV, bs, backend="triton"))


@pytest.mark.parametrize("cap", [1 << 16, 9, 0], ids=lambda c: f"cap {c}")
def test_undecided_tiles_listed_for_the_exact_kernel_match_torch(cap, monkeypatch):
    """A chunk's undecided tiles from DEFER_MIN on go to exact_kernel (on the GPU from 16; here
    from 1, so that every mask lists some): a random table, documents and a mask of two distant
    runs of positions per query tile (what a head-tail shard of an odd length gives) come out as
    torch's. Past the list's capacity (9: some chunks listed, then the rest evaluated in place; 0:
    none listed) a chunk evaluates its own."""
    from flexattn.kernels import mask_tiles

    monkeypatch.setitem(mask_tiles.DEFER_MIN, "interpret", 1)
    monkeypatch.setattr(mask_tiles, "DEFER_CAP", cap)
    runs = torch.cat([torch.arange(0, 150), torch.arange(1000, 1150)]).int()  # (tile 4 of 32 spans both)

    def two_runs(b, h, q_idx, kv_idx):
        return runs[q_idx] >= runs[kv_idx] + h

    for mask, Q, KV in ((random_mask, 257, 129), (document_causal, 300, 300), (two_runs, 300, 299)):
        assert_same(*both(mask, 1, 2, Q, KV, 32, backend="triton"))


def test_classify_without_deferral_evaluates_undecided_tiles_in_place(monkeypatch):
    """``defer=False`` (a distributed build whose tiles each hold consecutive positions): even from
    DEFER_MIN 1, no tile is listed and exact_kernel never runs; the tables are the same as with
    the list, whose kernel does run."""
    from flexattn.block_mask.create import _resolve_mask, classify
    from flexattn.kernels import mask_tiles

    monkeypatch.setitem(mask_tiles.DEFER_MIN, "interpret", 1)
    launched, launch = [], mask_tiles._launch
    monkeypatch.setattr(mask_tiles, "_launch",
                        lambda kernel, *a, **k: (launched.append(kernel), launch(kernel, *a, **k)))
    mod = _resolve_mask(document_causal, torch.device("cpu"))
    tables = {}
    for defer in (True, False):
        launched.clear()
        tiles = classify(mod, 1, 2, 300, 299, 32, 32, torch.device("cpu"), "triton", defer=defer)
        tables[defer] = tiles.tables()
        exact = [k for k in launched if k is tiles.tiles.module.exact_kernel]
        assert bool(exact) == defer, (defer, launched)
    for i, (listed, in_place) in enumerate(zip(tables[True], tables[False])):
        assert torch.equal(listed, in_place), FIELDS[i]


@pytest.mark.parametrize("levels", [8, 2], ids=lambda n: f"{n} levels a program")
def test_summary_pyramids_from_the_kernels_are_torchs(levels, monkeypatch):
    """The min/max pyramid of a 1-D integer or bool tensor that the summary kernels make
    (pyramid_kernel; top_kernel above a program's levels) is the one torch's reductions make,
    entry for entry, at lengths on and off the granule; an entry left unwritten keeps the poison."""
    from flexattn import interval
    from flexattn.kernels import mask_tiles

    monkeypatch.setattr(mask_tiles, "PYRAMID_LEVELS", levels)
    torch_summary, empty = interval.Summary._of, torch.empty
    g = torch.Generator().manual_seed(5)
    for n, dtype in ((1, torch.int64), (16, torch.bool), (17, torch.int32), (1000, torch.int16),
                     (4097, torch.uint8), (70001, torch.int32), (70001, torch.bool)):
        high = 2 if dtype == torch.bool else 200
        t = torch.randint(0 if dtype in (torch.bool, torch.uint8) else -high, high, (n,), generator=g).to(dtype)
        with monkeypatch.context() as m:  # (the kernels' path only, on a poisoned buffer)
            m.setattr(interval.Summary, "_of", staticmethod(lambda t: pytest.fail("torch's reductions ran")))
            m.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-(1 << 40)))
            made = mask_tiles.summary(t)
        want = torch_summary(t)
        assert made.ndim == 1 and torch.equal(made.offsets, want.offsets), (n, dtype)
        assert torch.equal(made.mins, want.mins) and torch.equal(made.maxs, want.maxs), (n, dtype)


@pytest.mark.parametrize("B,H,Q,KV", [(None, None, 300, 300), (1, 3, 300, 170), (2, 1, 100, 77)], ids=str)
def test_tables_are_16_byte_aligned(B, H, Q, KV):
    """The Triton path lists every table of a mask as a view of one buffer of each kind: each
    starts 16-byte aligned, as a kernel's direct launch (not through Triton) asks of its tensors
    (3 query tiles of one head: the full tables used to start 12 bytes in)."""
    bm = create_block_mask(causal, B, H, Q, KV, device="cpu", BLOCK_SIZE=128, backend="triton")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert getattr(bm, name).data_ptr() % 16 == 0, name


def test_dsl_mods_and_mod_objects():
    mod = flexattn.mask_mod("(doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)", doc=DOC)
    for backend in ("torch", "triton"):
        ours = create_block_mask(mod, 1, 2, 300, 280, device="cpu", BLOCK_SIZE=64, backend=backend)
        assert_same(ours, torch_create_block_mask(document_causal, 1, 2, 300, 280, device="cpu", BLOCK_SIZE=64))
        assert ours.mask_mod is mod and ours.mod is mod
    q, kv = ir.input_("q_idx"), ir.input_("kv_idx")
    built = Mod("mask", ir.binary("ge", q, kv), name="causal_ir")
    assert_same(create_block_mask(built, 1, 1, 100, 100, "cpu", 32),
                torch_create_block_mask(causal, 1, 1, 100, 100, "cpu", 32))


def test_none_batch_and_heads_broadcast():
    ours, theirs = both(causal, None, None, 200, 200, 64)
    assert ours.kv_num_blocks.shape == (1, 1, 4)
    assert_same(ours, theirs)
    # A mask that ignores b and h is classified once and repeated.
    ours = create_block_mask(causal, 3, 4, 200, 200, device="cpu", BLOCK_SIZE=64)
    assert ours.kv_indices.shape == (3, 4, 4, 4) and ours.kv_indices.is_contiguous()


def test_separate_full_blocks_off():
    for backend in ("torch", "triton"):
        ours = create_block_mask(sliding_window, 1, 1, 200, 200, "cpu", 32, separate_full_blocks=False,
                                 backend=backend)
        theirs = torch_create_block_mask(sliding_window, 1, 1, 200, 200, "cpu", 32, separate_full_blocks=False)
        assert_same(ours, theirs)


# ---------------------------------------------------------------------------------------------
# Random mask IR and shapes (hypothesis)

shapes = st.tuples(st.sampled_from([None, 1, 2]), st.sampled_from([None, 1, 3]),
                   st.integers(1, 250), st.integers(1, 250),
                   st.sampled_from([16, 32, 64, 128, (16, 32), (64, 16)]))


def _ir_mod(root):
    from test_interval import BUFFERS

    return Mod("mask", root, BUFFERS, name="random_ir")


@settings(max_examples=40, deadline=None)
@given(mask_irs, shapes)
def test_random_ir_matches_torch(root, shape):
    B, H, Q, KV, bs = shape
    assert_same(*both(_ir_mod(root), B, H, Q, KV, bs))


@settings(max_examples=12, deadline=None)
@given(mask_irs, st.tuples(st.integers(1, 120), st.integers(1, 120), st.sampled_from([16, (16, 32), 32])))
def test_interval_fast_path_equals_exact_evaluation(root, shape):
    # The staged (Triton) interval analysis and the eager one decide tiles; the oracle evaluates
    # every element. Both must agree with it, and with torch.
    Q, KV, bs = shape
    mod = _ir_mod(root)
    exact = tile_states_of_dense(create_mask(mod, 2, 2, Q, KV, "cpu"), *((bs, bs) if isinstance(bs, int) else bs))
    theirs = torch_create_block_mask(mod, 2, 2, Q, KV, "cpu", bs)
    for backend in ("triton", "torch"):
        ours = create_block_mask(mod, 2, 2, Q, KV, "cpu", bs, backend=backend)
        assert torch.equal(ours.tile_states(), exact), backend
        assert_same(ours, theirs)


@settings(max_examples=8, deadline=None)
@given(mask_irs, st.tuples(st.integers(1, 120), st.integers(1, 120), st.sampled_from([16, (16, 32), 32])),
       st.sampled_from([1, 7, 64, 300]))
def test_undecided_tiles_evaluated_in_slabs_equal_whole_tiles(root, shape, step):
    # With a step smaller than a tile, the torch path evaluates each undecided tile in slabs of
    # rows and columns (a step of 1: element by element); the states must not change.
    Q, KV, bs = shape
    mod = _ir_mod(root)
    exact = tile_states_of_dense(create_mask(mod, 2, 2, Q, KV, "cpu"), *((bs, bs) if isinstance(bs, int) else bs))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(create_module, "_CPU_ELEMENTS_PER_STEP", step)
        ours = create_block_mask(mod, 2, 2, Q, KV, "cpu", bs, backend="torch")
    assert torch.equal(ours.tile_states(), exact)


def _check_blocks_larger_than_the_sequence(device, backends):
    # One tile of 2**20 x 2**20 (about 10**12 elements) over a 300 x 200 sequence that the interval
    # analysis cannot decide: evaluated over its 60,000 real elements (it ran out of memory on the
    # CPU; on the GPU its unrolled sub-tiles never compiled). Never full: the tile is cut by the
    # sequence end.
    table = (torch.rand(300, 200) < 0.5).to(device)

    def mask(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    def nothing(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx] & False

    # Every element kept, which the interval analysis cannot tell (1 x 1, 1 x 2 or 2 x 2, never
    # 3): a tile cut by the sequence end stays partial where its real elements end on a sub-tile's
    # edge (256 rows), and the same sequence in a tile of its own size is full.
    ones_twos = torch.randint(1, 3, (256, 256)).to(device)

    def never_three(b, h, q_idx, kv_idx):
        return ones_twos[q_idx, kv_idx] * ones_twos[kv_idx, q_idx] != 3

    for backend in backends:
        for mod, Q, KV, block, state in ((mask, 300, 200, 1 << 20, 1), (nothing, 300, 200, 1 << 20, 0),
                                         (never_three, 256, 256, 2048, 1), (never_three, 256, 256, 256, 2)):
            bm = create_block_mask(mod, 1, 1, Q, KV, device, BLOCK_SIZE=block, backend=backend)
            assert bm.tile_states().tolist() == [[[[state]]]], (backend, mod.__name__, block)


def test_a_block_larger_than_the_sequence_is_evaluated_over_the_sequence_only():
    _check_blocks_larger_than_the_sequence("cpu", ("torch", "triton"))


@pytest.mark.gpu
def test_gpu_a_block_larger_than_the_sequence_is_evaluated_over_the_sequence_only():
    _check_blocks_larger_than_the_sequence("cuda", ("triton",))


@pytest.mark.parametrize("bs", [(32, 64), (64, 32), (16, 128), (128, 16)])
def test_many_sub_tiles_loops_stay_within_their_tile(bs, monkeypatch):
    # With sub-tiles of 8 x 8 in the interpreter, every tile here holds more than 16 of them: the
    # generated kernels evaluate it in loops that stop at the sequence end (UNROLL_SUBS). Over many
    # tiles (lengths no multiple of the blocks) each must read its own elements only, and a tile
    # cut by the sequence end must not be full, also where its real elements end on a sub-tile's
    # edge: the states are the dense mask's.
    from flexattn.kernels import mask_tiles
    monkeypatch.setattr(mask_tiles, "INTERPRET_SUB", 8)
    table = torch.rand(240, 240) < 0.5

    def gathered(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx] | (q_idx >= kv_idx + 40)

    # (gathered from tables, so that the interval analysis decides no tile and each is evaluated
    # element by element: full and empty tiles next to partial ones, either way)
    q, kv = torch.arange(240).view(-1, 1), torch.arange(240).view(1, -1)
    lower, blocks = q >= kv, q // 37 == kv // 53

    def causal(b, h, q_idx, kv_idx):
        return lower[q_idx, kv_idx]

    def documents(b, h, q_idx, kv_idx):
        return blocks[q_idx, kv_idx]

    for mod in (gathered, causal, documents):
        # (152 and 232: each a multiple of the sub-tile, no multiple of the blocks)
        for Q, KV in ((152, 232), (232, 152), (149, 7), (3, 229), (1, 1)):
            want = tile_states_of_dense(create_mask(mod, 1, 1, Q, KV, "cpu"), *bs)
            got = create_block_mask(mod, 1, 1, Q, KV, "cpu", bs, backend="triton").tile_states()
            assert torch.equal(got, want), (mod.__name__, Q, KV, bs)


# ---------------------------------------------------------------------------------------------
# BlockMask methods against torch's


def test_getitem_matches_torch():
    ours, theirs = both(per_head, 2, 3, 257, 200, 32)
    for index in [0, -1, (1, 2), (slice(0, 2), slice(1, 3)), (0, 1, torch.tensor([1, 3])),
                  (slice(None), -2, slice(2, 5))]:
        assert_same(ours[index], theirs[index])
    with pytest.raises(RuntimeError, match="sliced"):
        ours[0].mask_mod(None, None, None, None)


def test_adjust_refuses_lengths_it_was_not_built_for():
    """Tiles past the lengths a mask was built for were never classified: growing it would skip
    their keys silently."""
    bm = create_block_mask(causal, 1, 1, 100, 100, "cpu", 32)
    for q, kv in [(100, 200), (101, 100), (100, 101)]:
        with pytest.raises(ValueError, match=r"adjust crops a block mask: \(%d, %d\) is larger" % (q, kv)):
            bm._adjust(q, kv)


def test_adjust_matches_torch_on_causal_and_crops_exactly():
    ours, theirs = both(causal, 1, 2, 512, 512, 64)
    for q, kv in [(512, 512), (300, 300), (64, 500), (1, 129)]:
        assert_same(ours._adjust(q, kv), theirs._adjust(q, kv))
    # A mask whose rows do not start at tile 0: cropping keeps exactly the tiles inside.
    band = lambda b, h, q_idx, kv_idx: (kv_idx >= 128) & (kv_idx < 256)  # noqa: E731
    bm = create_block_mask(band, 1, 1, 512, 512, "cpu", 64)
    small = bm._adjust(256, 192)
    fresh = create_block_mask(band, 1, 1, 256, 192, "cpu", 64)
    assert torch.equal(small.to_dense(), fresh.to_dense())
    assert small.kv_num_blocks.tolist() == [[[0] * 4]] and small.full_kv_num_blocks.tolist() == [[[1] * 4]]


def test_from_kv_blocks_and_as_tuple_match_torch():
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    ours, theirs = both(document_causal, 2, 1, 300, 300, 32)
    args = (ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks, ours.full_kv_indices)
    rebuilt = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=32, seq_lengths=(300, 300))
    assert_same(rebuilt, TorchBlockMask.from_kv_blocks(*args, BLOCK_SIZE=32, seq_lengths=(300, 300)))
    t = ours.as_tuple()
    assert len(t) == len(theirs.as_tuple()) == 17
    assert t[:2] == (300, 300) and t[-3:-1] == (32, 32) and t[-1] is document_causal
    assert all(torch.equal(a, getattr(ours, f)) for a, f in zip(t[2:10], FIELDS))
    assert t[10:14] == theirs.as_tuple()[10:14] == (None, None, None, None)  # torch's dQ write-order fields
    assert ours.as_tuple(flatten=False)[0] == (300, 300) and len(ours.as_tuple(flatten=False)) == 15
    # Default seq_lengths from the table shapes, default mask_mod.
    bare = BlockMask.from_kv_blocks(ours.kv_num_blocks, ours.kv_indices, BLOCK_SIZE=(32, 64))
    assert bare.seq_lengths == (10 * 32, 10 * 64) and bare.mask_mod is noop_mask and bare.full_q_indices is None
    # torch's keyword-only write-order metadata: kept as given, a bool dq_kv_order makes nothing
    order = torch.zeros(1, dtype=torch.int32)
    kept = BlockMask.from_kv_blocks(*args, BLOCK_SIZE=32, seq_lengths=(300, 300), dq_write_order=order,
                                    dq_kv_order=True)
    assert kept.as_tuple()[10] is order and kept.as_tuple()[12] is None


def test_text_picture_and_repr_match_torch():
    ours, theirs = both(sliding_window, 2, 1, 300, 300, 16)
    assert str(ours) == str(theirs)
    assert ours.to_string(grid_size=-1) == theirs.to_string(grid_size=-1)
    assert ours.to_string(limit=1) == theirs.to_string(limit=1)
    assert repr(ours).splitlines()[1:] == repr(theirs).splitlines()[1:]


def test_to_moves_mod_buffers():
    ours = create_block_mask(document, 1, 1, 300, 300, "cpu", 64)
    moved = ours.to("cpu")
    assert_same(moved, ours)
    assert moved.mod.buffers[0].device.type == "cpu" and moved.mask_mod is document


def test_check_shape_errors():
    bm = create_block_mask(per_head, 2, 3, 256, 256, "cpu", 64)
    bm.check_shape(2, 3, 256, 256)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(256, 256\), but query has Q_LEN=128 "
                                         r"and key KV_LEN=256; crop it with block_mask._adjust\(Q_LEN, KV_LEN\)"):
        bm.check_shape(2, 3, 128, 256)
    with pytest.raises(ValueError, match="KV_LEN=256; build the block mask for these lengths"):
        bm.check_shape(2, 3, 512, 256)
    with pytest.raises(ValueError, match="block_mask has B=2, H=3; it must have B of 1 or query's 4"):
        bm.check_shape(4, 3, 256, 256)
    with pytest.raises(ValueError, match="block_mask has B=2, H=3; .* and H of 1 or query's 6"):
        bm.check_shape(2, 6, 256, 256)
    create_block_mask(causal, None, None, 256, 256, "cpu", 64).check_shape(8, 16, 256, 256)


# ---------------------------------------------------------------------------------------------
# Helpers: and/or/noop masks, create_mask


def test_and_or_noop_masks_match_torch():
    window = lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 40  # noqa: E731
    prefix = lambda b, h, q_idx, kv_idx: kv_idx < 20  # noqa: E731
    for mask in (and_masks(causal, window), or_masks(prefix, causal), noop_mask, and_masks(),
                 or_masks(and_masks(causal, window), prefix)):
        assert_same(*both(mask, 1, 1, 150, 170, 16))
    # Mods combine into one Mod (buffers renumbered).
    d = flexattn.mask_mod("doc[q_idx] == doc[kv_idx]", doc=DOC)
    c = flexattn.mask_mod("q_idx >= kv_idx")
    w = flexattn.mask_mod("tbl[q_idx, kv_idx]", tbl=RANDOM)
    combined = or_masks(and_masks(d, c), w)
    assert isinstance(combined, Mod) and len(combined.buffers) == 2
    ref = lambda b, h, q_idx, kv_idx: document_causal(b, h, q_idx, kv_idx) | random_mask(b, h, q_idx, kv_idx)  # noqa: E731
    for backend in ("torch", "triton"):
        assert_same(create_block_mask(combined, 1, 1, 300, 300, "cpu", 64, backend=backend),
                    torch_create_block_mask(ref, 1, 1, 300, 300, "cpu", 64))
    with pytest.raises(TypeError, match="argument 1 is int"):
        and_masks(causal, 3)


def test_create_mask_matches_torch():
    from torch.nn.attention.flex_attention import create_mask as torch_create_mask

    for mask in (document_causal, per_head, noop_mask):
        assert torch.equal(create_mask(mask, 2, 3, 45, 37, "cpu"), torch_create_mask(mask, 2, 3, 45, 37, "cpu"))

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, -float("inf"))

    assert torch.equal(create_mask(score_mod, 1, 2, 20, 30, "cpu"), torch_create_mask(score_mod, 1, 2, 20, 30, "cpu"))


def test_docstring_examples():
    import doctest

    import flexattn.block_mask
    import flexattn.interval
    import flexattn.kernels.tables
    from flexattn.block_mask import blockmask, create, mask_mods

    # The examples use the package's public names, wherever in the package they are written.
    public = {name: getattr(flexattn.block_mask, name) for name in flexattn.block_mask.__all__}
    for module in (blockmask, create, mask_mods, flexattn.kernels.tables, flexattn.interval):
        result = doctest.testmod(module, raise_on_error=False, extraglobs=public)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("bs,msg", [(48, "power of two >= 16, got 48"), (8, "got 8"), (0, "got 0"),
                                    ((64, 24), "KV block size must be a power of two >= 16, got 24"),
                                    (True, "int or a"), ((16, 16, 16), "pair"), ("128", "int or a")])
def test_bad_block_sizes(bs, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        create_block_mask(causal, 1, 1, 64, 64, "cpu", bs)


@pytest.mark.parametrize("kw,msg", [(dict(Q_LEN=0), "Q_LEN must be a positive int, got 0"),
                                    (dict(KV_LEN=-3), "KV_LEN must be a positive int, got -3"),
                                    (dict(B=0), "B must be a positive int or None, got 0"),
                                    (dict(H=2.0), "H must be a positive int or None, got 2.0"),
                                    (dict(Q_LEN=10.5), "Q_LEN must be a positive int")])
def test_bad_lengths(kw, msg):
    args = dict(B=1, H=1, Q_LEN=64, KV_LEN=64)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        create_block_mask(causal, device="cpu", **args)


def test_non_bool_mask_mod_is_rejected():
    with pytest.raises(TypeError, match="must return a bool.*int32"):
        create_block_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx, 1, 1, 64, 64, "cpu")
    with pytest.raises(TypeError, match="mask_mod must be a callable"):
        create_block_mask("q_idx >= kv_idx", 1, 1, 64, 64, "cpu")
    with pytest.raises(TypeError, match="must be a mask_mod, got a score_mod"):
        create_block_mask(flexattn.score_mod("score * 2"), 1, 1, 64, 64, "cpu")


# ---------------------------------------------------------------------------------------------
# Scale: the CPU path's memory is O(tiles)

_SCALE_SCRIPT = textwrap.dedent("""
    import json, resource, time, torch
    from flexattn.block_mask import create_block_mask
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    create_block_mask(causal, 1, 1, 512, 512, device="cpu")  # imports, tracing, warm caches
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    bm = create_block_mask(causal, 1, 1, 16384, 16384, device="cpu")
    seconds = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth_mb": (after - before) / 1024, "seconds": seconds,
                      "kv": bm.kv_num_blocks.flatten().tolist(), "full": bm.full_kv_num_blocks.flatten().tolist()}))
""")


def test_causal_16k_on_cpu_stays_small():
    # torch's eager create_block_mask needs ~2.6 GB here (a dense 16k x 16k mask plus temporaries).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _SCALE_SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    print(f"16k x 16k causal on CPU: {res['seconds']:.2f} s, peak RSS growth {res['growth_mb']:.1f} MB")
    assert res["growth_mb"] < 256
    assert res["kv"] == [1] * 128 and res["full"] == list(range(128))


# ---------------------------------------------------------------------------------------------
# Pictures


# (PNG pictures: tests/test_viz.py)


# ---------------------------------------------------------------------------------------------
# GPU: the generated kernels against torch on CUDA (run on the device machine with -m gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(len(FAMILIES)), ids=lambda i: FAMILIES[i].__name__)
def test_gpu_kernels_match_torch(i):
    mask = FAMILIES[i]
    on_gpu = _families(DOC.cuda(), RANDOM.cuda())[i]
    for Q, KV, bs in [(300, 300, 16), (257, 129, (32, 64)), (300, 300, 128)]:
        ours = create_block_mask(on_gpu, 2, 3, Q, KV, device="cuda", BLOCK_SIZE=bs)
        theirs = torch_create_block_mask(mask, 2, 3, Q, KV, device="cpu", BLOCK_SIZE=bs)
        assert_same(ours.to("cpu"), theirs)


@pytest.mark.gpu
def test_gpu_rows_of_undecided_tiles_go_to_the_exact_kernel_and_match_torch(monkeypatch):
    """A query tile across two distant runs of positions (a head-tail shard of an odd length)
    leaves interval analysis ~60 undecided tiles in one chunk of its row: listed for exact_kernel
    (DEFER_MIN), the tables are torch's and those of evaluating them in place."""
    from flexattn.kernels import mask_tiles

    runs = torch.cat([torch.arange(0, 4120), torch.arange(100_000, 104_121)]).int().cuda()
    n = runs.numel()

    def spread(b, h, q_idx, kv_idx):
        return runs[q_idx] >= kv_idx * 12 + h

    ours = create_block_mask(spread, 1, 2, n, n, device="cuda", BLOCK_SIZE=128)
    assert_same(ours, torch_create_block_mask(spread, 1, 2, n, n, device="cuda", BLOCK_SIZE=128))
    monkeypatch.setitem(mask_tiles.DEFER_MIN, "cuda", 0)
    assert_same(ours, create_block_mask(spread, 1, 2, n, n, device="cuda", BLOCK_SIZE=128))


@pytest.mark.gpu
def test_gpu_long_document_mask_matches_torch():
    lengths = torch.randint(100, 3000, (40,), generator=torch.Generator().manual_seed(1))
    doc = _doc_ids(lengths.tolist()).cuda()
    n = doc.numel()

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    ours = create_block_mask(doc_causal, 1, 1, n, n, device="cuda", BLOCK_SIZE=128)
    theirs = torch_create_block_mask(doc_causal, 1, 1, n, n, device="cuda", BLOCK_SIZE=128)
    assert_same(ours, theirs)


@pytest.mark.gpu
def test_gpu_causal_1m_tokens_exact_and_small():
    n, bs = 1 << 20, 128
    create_block_mask(causal, 1, 1, 4096, 4096, device="cuda")  # compile outside the measurement
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    bm = create_block_mask(causal, 1, 1, n, n, device="cuda", BLOCK_SIZE=bs)
    torch.cuda.synchronize()
    tables = sum(getattr(bm, f).numel() * 4 for f in FIELDS)
    extra_mb = (torch.cuda.max_memory_allocated() - base - tables) / 2**20
    assert extra_mb < 64, f"{extra_mb:.1f} MB of scratch"
    t = n // bs
    rows = torch.arange(t, device="cuda", dtype=torch.int32)
    assert (bm.kv_num_blocks[0, 0] == 1).all() and torch.equal(bm.kv_indices[0, 0, :, 0], rows)
    assert torch.equal(bm.full_kv_num_blocks[0, 0], rows)
    assert torch.equal(bm.q_num_blocks[0, 0], torch.ones_like(rows)) and torch.equal(bm.q_indices[0, 0, :, 0], rows)
    assert torch.equal(bm.full_q_num_blocks[0, 0], t - 1 - rows)
    # Row i of full_kv_indices: 0..i-1, then i..t-1 (every row is the identity permutation).
    assert torch.equal(bm.full_kv_indices[0, 0, 77], rows) and torch.equal(bm.full_kv_indices[0, 0, -1], rows)
