"""Hand-made BlockMask tables: checked once where the mask is made, never followed out of bounds.

Each bad table is tried as a user would (BlockMask(...), BlockMask.from_kv_blocks(...)) and must
raise a ValueError that names the table and the offending entry. The crash cases (a count past the
number of KV blocks used to segfault) run in a subprocess, so a regression fails the test instead
of killing the run.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flexattn
from flexattn.block_mask import BlockMask, create_block_mask, validate_block_tables
from flexattn.kernels.tables import Direction, Tables, ordered_q_lists, q_direction, regrouped, tables_of
from flexattn.reference import attention_reference

I32 = torch.int32


def tables(rows, cols, counts, indices):
    """[1, 1, rows] counts and [1, 1, rows, cols] indices as int32."""
    num = torch.tensor(counts, dtype=I32).view(1, 1, rows)
    idx = torch.tensor(indices, dtype=I32).view(1, 1, rows, cols)
    return num, idx


# 40 x 40 tokens in blocks of 16: 3 query blocks and 3 KV blocks.
SEQ, BS = (40, 40), 16


def good():
    return tables(3, 3, [1, 2, 3], [[0, 1, 2], [0, 1, 2], [0, 1, 2]])


@pytest.mark.parametrize("counts, indices, message", [
    ([1, 4, 1], [[0, 1, 2, 0], [0, 1, 2, 0], [0, 1, 2, 0]],
     r"kv_num_blocks\[0, 0, 1\] = 4 is out of range: expected 0 <= count <= 3 \(KV_LEN 40 has 3 KV blocks"),
    ([1, -1, 1], [[0, 1, 2, 0], [0, 1, 2, 0], [0, 1, 2, 0]],
     r"kv_num_blocks\[0, 0, 1\] = -1 is out of range: expected 0 <= count <= 3"),
    ([1, 2, 1], [[0, 1, 2, 0], [0, 3, 2, 0], [0, 1, 2, 0]],
     r"kv_indices\[0, 0, 1, 1\] = 3 is out of range: expected a block index in \[0, 3\)"),
    ([1, 2, 1], [[0, 1, 2, 0], [0, 1, 2, 0], [-1, 1, 2, 0]],
     r"kv_indices\[0, 0, 2, 0\] = -1 is out of range"),
])
def test_bad_counts_and_indices_name_the_entry(counts, indices, message):
    num, idx = tables(3, 4, counts, indices)
    with pytest.raises(ValueError, match=message):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=BS, seq_lengths=SEQ)
    with pytest.raises(ValueError, match=message):
        BlockMask(SEQ, num, idx, None, None, None, None, None, None, BLOCK_SIZE=BS)
    # the full twins are checked the same way
    ok_num, ok_idx = tables(3, 4, [0, 0, 0], [[0, 1, 2, 0]] * 3)
    with pytest.raises(ValueError, match=message.replace("kv_", "full_kv_", 1)):
        BlockMask.from_kv_blocks(ok_num, ok_idx, num, idx, BLOCK_SIZE=BS, seq_lengths=SEQ)


def test_entries_past_the_count_are_never_read_so_anything_goes_there():
    num, idx = tables(3, 3, [1, 1, 0], [[0, 99, -7], [2, -1, 1000], [-5, -5, -5]])
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=BS, seq_lengths=SEQ)
    assert bm.q_num_blocks.tolist() == [[[1, 0, 1]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int16, torch.uint8])
def test_tables_must_be_int32_or_int64(dtype):
    num, idx = good()
    with pytest.raises(ValueError, match=rf"kv_num_blocks must be an int32 \(or int64\) tensor, got {dtype}"):
        BlockMask.from_kv_blocks(num.to(dtype), idx, BLOCK_SIZE=BS, seq_lengths=SEQ)
    with pytest.raises(ValueError, match=rf"kv_indices must be an int32 \(or int64\) tensor, got {dtype}"):
        BlockMask.from_kv_blocks(num, idx.to(dtype), BLOCK_SIZE=BS, seq_lengths=SEQ)
    # int64 is accepted (as by torch) and means the same, in the kernels too
    bm = BlockMask.from_kv_blocks(num.long(), idx.long(), BLOCK_SIZE=BS, seq_lengths=SEQ)
    assert bm.q_num_blocks.tolist() == [[[3, 2, 1]]]
    if dtype == torch.float32:
        q, k, v = (torch.randn(1, 1, 40, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                   for i in range(3))
        int32 = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=BS, seq_lengths=SEQ)
        assert torch.equal(flexattn.flex_attention(q, k, v, block_mask=bm),
                           flexattn.flex_attention(q, k, v, block_mask=int32))


def test_shapes_rows_and_devices():
    num, idx = good()
    with pytest.raises(ValueError, match=r"kv_num_blocks must have shape \(1, 1, 3\) \(kv_indices without its "
                                         r"last dimension\), got \(1, 1, 2\)"):
        BlockMask.from_kv_blocks(num[..., :2], idx, BLOCK_SIZE=BS, seq_lengths=SEQ)
    sliced = BlockMask.from_kv_blocks(num[..., :2], idx[..., :2, :], BLOCK_SIZE=BS, seq_lengths=SEQ)
    with pytest.raises(ValueError, match=r"block_mask has 2 query blocks of 16, Q_LEN=40 needs 3 \(a sliced block "
                                         r"mask cannot be used for attention\)"):
        sliced.check_shape(1, 1, 40, 40)
    with pytest.raises(ValueError, match=r"kv_indices must have at least 2 dimensions"):
        BlockMask.from_kv_blocks(num[0, 0, 0], idx[0, 0, 0], BLOCK_SIZE=BS, seq_lengths=SEQ)
    with pytest.raises(ValueError, match=r"kv_indices must have at least 2 dimensions"):
        BlockMask.from_kv_blocks(num[0, 0, 0], idx[0, 0, 0], BLOCK_SIZE=BS)  # no lengths to default to
    with pytest.raises(ValueError, match=r"kv_indices must be a torch.Tensor, got list"):
        BlockMask.from_kv_blocks(num, idx.tolist(), BLOCK_SIZE=BS)
    with pytest.raises(ValueError, match=r"full_kv_num_blocks and full_kv_indices must both be given"):
        BlockMask.from_kv_blocks(num, idx, num, None, BLOCK_SIZE=BS, seq_lengths=SEQ)
    with pytest.raises(ValueError, match=r"kv_num_blocks is on the meta device"):
        BlockMask.from_kv_blocks(num.to("meta"), idx.to("meta"), BLOCK_SIZE=BS, seq_lengths=SEQ)
    with pytest.raises(ValueError, match=r"kv_indices is on the meta device, which holds no values"):
        validate_block_tables(num, idx.to("meta"), seq_lengths=SEQ, BLOCK_SIZE=BS)
    with pytest.raises(ValueError, match=r"kv_indices must be a torch.Tensor, got list"):
        validate_block_tables(num, idx.tolist(), seq_lengths=SEQ, BLOCK_SIZE=BS)
    with pytest.raises(ValueError, match=r"seq_lengths must be a \(Q_LEN, KV_LEN\) pair of positive ints, got "
                                         r"\(40, 0\)"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=BS, seq_lengths=(40, 0))


def test_transposed_tables_handed_in_are_checked_too():
    num, idx = good()
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=BS, seq_lengths=SEQ)
    q_idx = bm.q_indices.clone()
    q_idx[0, 0, 2, 0] = 5
    with pytest.raises(ValueError, match=r"q_indices\[0, 0, 2, 0\] = 5 is out of range: expected a block index "
                                         r"in \[0, 3\) \(Q_LEN 40 has 3 query blocks of 16"):
        BlockMask(SEQ, num, idx, None, None, bm.q_num_blocks, q_idx, None, None, BLOCK_SIZE=BS)


def test_fewer_columns_than_blocks_transposes_against_the_true_block_count():
    # Two KV blocks, tables with one column: the transpose must still see block 1.
    num = torch.tensor([[[1, 1, 1]]], dtype=I32)
    idx = torch.tensor([[[[1], [0], [1]]]], dtype=I32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(48, 32))
    assert bm.q_num_blocks.tolist() == [[[1, 2]]]
    assert bm.q_indices[..., :2].tolist() == [[[[1, 0], [0, 2]]]]


def test_create_block_mask_on_meta_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device='meta' cannot hold a block mask"):
        create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 64, 64, device="meta")


def test_hand_made_sparse_tables_give_the_right_answer():
    # Rows list blocks out of order and skip some; entries past the count hold garbage.
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 37, 16, dtype=torch.float64) for _ in range(3))
    num = torch.tensor([[[2, 1, 3]]], dtype=I32)
    idx = torch.tensor([[[[2, 0, 77], [1, -4, 9], [1, 2, 0]]]], dtype=I32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(37, 37))
    out = flexattn.flex_attention(q, k, v, block_mask=bm)
    tiles = torch.zeros(3, 3, dtype=torch.bool)
    for r, cols in enumerate([[2, 0], [1], [1, 2, 0]]):
        tiles[r, cols] = True
    dense = tiles.repeat_interleave(16, 0).repeat_interleave(16, 1)[:37, :37]
    ref = attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: dense[qi, ki])
    torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-10, rtol=1e-10)


_CRASH_SCRIPT = textwrap.dedent("""
    import torch, flexattn
    from flexattn.block_mask import BlockMask
    q = k = v = torch.randn(1, 1, 40, 16)
    num = torch.tensor([[[{count}, 1, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1, 2], [0, 1, 2], [0, 1, 2]]]], dtype=torch.int32)
    try:
        bm = BlockMask(({seq}, {seq}), num, idx, None, None, None, None, None, None, BLOCK_SIZE=16)
        flexattn.flex_attention(q, k, v, block_mask=bm)
    except ValueError as e:
        print("ValueError:", e)
    else:
        print("no error")
""")


@pytest.mark.parametrize("count", [3000, 4])
def test_count_past_the_blocks_is_an_error_not_a_segfault(count):
    script = _CRASH_SCRIPT.format(count=count, seq=40)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert res.returncode == 0, f"exit code {res.returncode} (a negative code is a signal)\n{res.stderr[-2000:]}"
    assert f"ValueError: kv_num_blocks[0, 0, 0] = {count} is out of range" in res.stdout, res.stdout + res.stderr


def test_a_torch_block_mask_with_bad_tables_is_refused_by_flex_attention():
    """torch's BlockMask does not check its tables; flexattn checks a foreign mask once, before
    any kernel reads it."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    import flexattn

    q = torch.randn(1, 1, 48, 16)
    num = torch.tensor([[[1, 1, 5]]], dtype=torch.int32)  # 5 blocks listed, the mask has 3 columns
    idx = torch.zeros(1, 1, 3, 3, dtype=torch.int32)
    bad = TorchBlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(48, 48))
    with pytest.raises(ValueError, match="kv_num_blocks"):
        flexattn.flex_attention(q, q, q, block_mask=bad, kernel_options={"FORCE_USE_FLEX_ATTENTION": True})


@pytest.mark.parametrize("seed", range(4))
def test_ordered_q_lists_rank_each_visit(seed):
    """The deterministic backward's dK/dV lists: per KV block every query block it visits, partial
    and full merged ascending, each with its partial flag and its rank, the number of KV blocks of
    a lower index that visit the same query block (the order its dQ parts are added in). Against
    the dense tile states of random masks with full blocks, per-head rows and more KV blocks than
    query blocks."""
    g = torch.Generator().manual_seed(seed)
    # [B, H, query blocks, KV blocks]: 0 empty, 1 partial, 2 full
    states = torch.randint(0, 3, (2, 3, 5, 7), generator=g)
    tables = Tables(Direction(*_lists(states == 1), *_lists(states == 2)), None, 64, 64, None, ())
    got = ordered_q_lists(tables, 7 * 64)
    assert got.full_num is None and got.full_idx is None
    for b, h, n in itertools.product(range(2), range(3), range(7)):
        column = states[b, h, :, n]
        listed = [int(e) for e in got.idx[b, h, n, :int(got.num[b, h, n])]]
        assert [e & 0x7FFF for e in listed] == column.nonzero().flatten().tolist()
        for e in listed:
            m = e & 0x7FFF
            assert e >> 15 & 1 == int(column[m] == 1)
            assert e >> 16 == int((states[b, h, m, :n] > 0).sum()), (b, h, n, m)
    assert ordered_q_lists(tables, 7 * 64) is got  # (made once)


def _lists(flags: torch.Tensor):
    """(num, idx) int32 lists of the True columns of each row of ``flags``, ascending."""
    num = flags.sum(-1).to(torch.int32)
    idx = torch.sort(torch.where(flags, torch.arange(flags.shape[-1]), flags.shape[-1]), dim=-1).values
    return num, idx.clamp_max(flags.shape[-1] - 1).to(torch.int32)


@pytest.mark.parametrize("src_rows,rows,has_full", [(128, 192, True), (64, 192, True), (128, 192, False)])
def test_regrouped_lists_visit_every_block_of_the_tiles_they_span(src_rows, rows, has_full):
    """The Hopper forward's lists for its 192-row tiles from a mask's smaller blocks: a KV block is
    listed where any of the mask's blocks the tile overlaps lists it, and full only where all of
    them hold it full (the tile's mask work is skipped only where no element can be masked).
    Against the dense tile states of random masks, per-head rows, a last tile past the mask's rows."""
    g = torch.Generator().manual_seed(src_rows + has_full)
    states = torch.randint(0, 3 if has_full else 2, (2, 3, 7, 5), generator=g)  # 0 empty, 1 partial, 2 full
    full = _lists(states == 2) if has_full else (None, None)
    source = Tables.of(Direction(*_lists(states == 1), *full), None, src_rows, 128, None)
    got = regrouped(source, rows)
    n = -(-7 * src_rows // rows)
    assert got.q_block == rows and got.kv.num.shape == (2, 3, n) and got.kv.has_full == has_full
    for b, h, t in itertools.product(range(2), range(3), range(n)):
        spanned = states[b, h, t * rows // src_rows:(t * rows + rows - 1) // src_rows + 1]
        whole = (spanned == 2).all(0)
        partial = (spanned > 0).any(0) & ~whole
        assert got.kv.idx[b, h, t, :got.kv.num[b, h, t]].tolist() == partial.nonzero().flatten().tolist()
        if has_full:
            assert got.kv.full_idx[b, h, t, :got.kv.full_num[b, h, t]].tolist() == whole.nonzero().flatten().tolist()
    assert regrouped(source, rows) is got  # (made once per mask)
    source.kv.num[0, 0, 0] = 0  # an in-place change of the mask's lists: made again
    assert regrouped(source, rows) is not got


def test_regrouped_lists_give_the_right_answer():
    """A document mask's 128-row lists regrouped to 192 rows, run as a (192, 128) block mask
    through the Triton template at lengths off both block sizes, against the float64 reference."""
    torch.manual_seed(0)
    S_Q, S_KV = 437, 401
    doc = torch.randint(0, 3, (max(S_Q, S_KV),)).sort().values

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    bm = create_block_mask(documents, None, 2, S_Q, S_KV, device="cpu")
    lists = regrouped(tables_of(bm), 192).kv
    wide = BlockMask((S_Q, S_KV), lists.num, lists.idx, lists.full_num, lists.full_idx, None, None, None, None,
                     BLOCK_SIZE=(192, 128), mask_mod=documents)
    q, k, v = (torch.randn(1, 2, s, 16, dtype=torch.float64) for s in (S_Q, S_KV, S_KV))
    out = flexattn.flex_attention(q, k, v, block_mask=wide)
    ref = attention_reference(q, k, v, mask_mod=documents)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
