"""Interval analysis (flexattn/interval.py): sound on random mask IR, exact on affine masks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexattn import interval, ir
from flexattn.codegen.interval import emit_interval
from flexattn.interval import EMPTY, FULL, UNKNOWN

Q, KV, B_, H_ = (ir.input_(n) for n in ("q_idx", "kv_idx", "b", "h"))

# Captured tensors the random mods gather from: document ids (sorted, uneven), a signed table,
# a bool table and a float table with an inf (so float bounds meet non-finite values).
DOC = torch.repeat_interleave(torch.arange(6), torch.tensor([5, 40, 1, 77, 20, 60]))  # 203 tokens
TABLE = torch.randint(-50, 50, (97,), generator=torch.Generator().manual_seed(0))
FLAGS = torch.rand(150, generator=torch.Generator().manual_seed(1)) < 0.7
FLOATS = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 10
FLOATS[5] = float("inf")
BUFFERS = [DOC, TABLE, FLAGS, FLOATS]
BUF = [ir.Buffer(i, n, t.dtype, 1) for i, (n, t) in enumerate(zip(("doc", "table", "flags", "floats"), BUFFERS))]


# ---------------------------------------------------------------------------------------------
# Random mask IR (also used by tests/test_block_mask.py)


def _int_exprs(depth):
    leaves = st.sampled_from([Q, KV, B_, H_]) | st.integers(-40, 300).map(lambda v: ir.const(v, torch.int32))
    if depth == 0:
        return leaves
    sub = _int_exprs(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["add", "sub", "minimum", "maximum"]), sub, sub).map(lambda t: ir.binary(*t)),
        st.tuples(sub, st.integers(-9, 9)).map(lambda t: ir.binary("mul", t[0], t[1])),
        st.tuples(st.sampled_from(["floordiv", "mod"]), sub, st.sampled_from([-7, -1, 1, 3, 16, 64, 100]))
        .map(lambda t: ir.binary(t[0], t[1], t[2])),
        st.tuples(st.sampled_from(["neg", "abs", "invert", "sign", "relu"]), sub).map(lambda t: ir.unary(*t)),
        st.tuples(sub, st.integers(0, 4)).map(lambda t: ir.binary("rshift", t[0], t[1])),
        st.tuples(sub, st.integers(0, 63)).map(lambda t: ir.binary("and_", t[0], t[1])),
        st.tuples(st.sampled_from([0, 1]), sub).map(lambda t: ir.load(BUF[t[0]], [t[1]])),
        st.tuples(_bool_exprs(depth - 1), sub, sub).map(lambda t: ir.where(*t)),
        st.tuples(sub, st.sampled_from([torch.int64, torch.int16])).map(lambda t: ir.cast(*t)),
    )


def _float_exprs(depth):
    sub = _int_exprs(depth)
    return st.one_of(
        sub.map(lambda e: ir.cast(e, torch.float32)),
        sub.map(lambda e: ir.load(BUF[3], [e])),
        st.tuples(sub, st.floats(-3, 3, width=32)).map(lambda t: ir.binary("mul", ir.cast(t[0], torch.float32), t[1])),
        sub.map(lambda e: ir.unary("floor", ir.binary("truediv", e, 7))),
    )


def _bool_exprs(depth):
    cmp = st.sampled_from(list(ir.COMPARISONS))
    leaves = st.one_of(
        st.tuples(cmp, _int_exprs(depth), _int_exprs(depth)).map(lambda t: ir.binary(*t)),
        st.tuples(cmp, _float_exprs(depth), st.floats(-100, 100, width=32)).map(lambda t: ir.binary(*t)),
        _int_exprs(depth).map(lambda e: ir.load(BUF[2], [e])),
    )
    if depth == 0:
        return leaves
    sub = _bool_exprs(depth - 1)
    return st.one_of(
        leaves,
        st.tuples(st.sampled_from(["and_", "or_", "xor"]), sub, sub).map(lambda t: ir.binary(*t)),
        sub.map(lambda e: ir.unary("not", e)),
        _int_exprs(depth).map(lambda e: ir.cast(e, torch.bool)),
    )


mask_irs = st.deferred(lambda: _bool_exprs(2))


def exact_tile(root, b, h, q0, q1, k0, k1):
    """Every element of the mask on b, h, q in [q0, q1], kv in [k0, k1] (inclusive)."""
    qi = torch.arange(q0, q1 + 1, dtype=torch.int32).view(-1, 1)
    ki = torch.arange(k0, k1 + 1, dtype=torch.int32).view(1, -1)
    out = ir.evaluate(root, {"b": torch.tensor(b, dtype=torch.int32), "h": torch.tensor(h, dtype=torch.int32),
                             "q_idx": qi, "kv_idx": ki}, BUFFERS)
    return out.expand(qi.shape[0], ki.shape[1])


def states_of(root, tiles):
    """tile_states for a list of (b, h, q0, q1, k0, k1) tiles."""
    t = torch.tensor(tiles, dtype=torch.int64)
    inputs = {"b": (t[:, 0], t[:, 0]), "h": (t[:, 1], t[:, 1]), "q_idx": (t[:, 2], t[:, 3]), "kv_idx": (t[:, 4], t[:, 5])}
    return interval.tile_states(root, inputs, BUFFERS)


tile_boxes = st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(0, 250), st.integers(0, 60),
                       st.integers(0, 250), st.integers(0, 60)).map(
    lambda t: (t[0], t[1], t[2], t[2] + t[3], t[4], t[4] + t[5]))


# ---------------------------------------------------------------------------------------------
# Soundness: a decided tile is never wrong


@settings(max_examples=150, deadline=None)
@given(mask_irs, st.lists(tile_boxes, min_size=1, max_size=6))
def test_random_masks_are_never_misclassified(root, tiles):
    states = states_of(root, tiles)
    for tile, s in zip(tiles, states.tolist()):
        vals = exact_tile(root, *tile)
        if s == FULL:
            assert bool(vals.all()), f"{root} claimed full on {tile}"
        elif s == EMPTY:
            assert not bool(vals.any()), f"{root} claimed empty on {tile}"
        else:
            assert s == UNKNOWN


# ---------------------------------------------------------------------------------------------
# Precision: affine masks are decided everywhere except where the boundary crosses a tile


def _grid_tiles(n_q, n_kv, size):
    return [(0, 0, i * size, i * size + size - 1, j * size, j * size + size - 1)
            for i in range(n_q) for j in range(n_kv)]


def _truth(root, tile):
    v = exact_tile(root, *tile)
    return FULL if bool(v.all()) else EMPTY if not bool(v.any()) else UNKNOWN


DOC_IR = ir.load(BUF[0], [Q])
MASKS = {
    "causal": ir.binary("ge", Q, KV),
    "sliding_window": ir.binary("and_", ir.binary("ge", Q, KV), ir.binary("lt", ir.binary("sub", Q, KV), 40)),
    "prefix_lm": ir.binary("or_", ir.binary("lt", KV, 50), ir.binary("ge", Q, KV)),
    "document": ir.binary("eq", DOC_IR, ir.load(BUF[0], [KV])),
    "document_causal": ir.binary("and_", ir.binary("eq", DOC_IR, ir.load(BUF[0], [KV])), ir.binary("ge", Q, KV)),
    "dilated": ir.binary("eq", ir.binary("mod", ir.binary("sub", Q, KV), 4), 0),
    "chunked": ir.binary("eq", ir.binary("floordiv", Q, 32), ir.binary("floordiv", KV, 32)),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_affine_and_document_masks_are_decided_exactly(name):
    root = MASKS[name]
    tiles = _grid_tiles(12, 12, 16)  # 192 x 192, DOC covers it
    states = states_of(root, tiles).tolist()
    truth = [_truth(root, t) for t in tiles]
    for s, t in zip(states, truth):
        assert s == t or s == UNKNOWN
    if name == "dilated":
        assert all(s == UNKNOWN for s in states)  # periodic: honestly undecided
    else:
        # Only tiles that really are partial stay undecided.
        assert [s == UNKNOWN for s in states] == [t == UNKNOWN for t in truth]


def test_decides_in_one_pass_over_tiles():
    # 1M x 1M causal in 128-tiles: 67M tiles would be 2**40 elements; bounds cost O(tiles).
    n = 1 << 13
    i = torch.arange(n, dtype=torch.int64) * 128
    states = interval.tile_states(MASKS["causal"], {
        "b": (torch.tensor(0), torch.tensor(0)), "h": (torch.tensor(0), torch.tensor(0)),
        "q_idx": (i[:64, None], i[:64, None] + 127), "kv_idx": (i[None, :], i[None, :] + 127)}, [])
    assert states.shape == (64, n)
    diag = torch.arange(64)
    assert (states[diag, diag] == UNKNOWN).all()
    assert int((states == UNKNOWN).sum()) == 64
    assert int((states == FULL).sum()) == 64 * 63 // 2


# ---------------------------------------------------------------------------------------------
# Edge cases of the transfer functions


def _one(root, tile, buffers=BUFFERS):
    t = torch.tensor([tile], dtype=torch.int64)
    return interval.tile_states(root, {"b": (t[:, 0], t[:, 0]), "h": (t[:, 1], t[:, 1]),
                                       "q_idx": (t[:, 2], t[:, 3]), "kv_idx": (t[:, 4], t[:, 5])}, buffers).item()


def test_int32_overflow_is_not_trusted():
    # q * 2**30 wraps in int32: for q = 2 it is -2**31 < 0. Bounds must not claim "always >= 0".
    root = ir.binary("ge", ir.binary("mul", Q, 1 << 30), 0)
    assert _one(root, (0, 0, 0, 3, 0, 0)) == UNKNOWN
    assert not bool(exact_tile(root, 0, 0, 0, 3, 0, 0).all())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bitwise_not_of_unsigned_is_max_minus_x(backend):
    # ~x on uint8 is 255 - x (not -1 - x): ~u8[kv] > 100 keeps every key where u8 is 0. Bounds
    # of [-1, -1] called every tile empty, and attention then skipped every key.
    from flexattn.block_mask import create_block_mask
    u8 = torch.zeros(64, dtype=torch.uint8)
    u8[32:48] = 200  # ~200 == 55: masked
    t = torch.tensor
    root = ir.binary("gt", ir.unary("invert", ir.load(ir.Buffer(0, "u8", torch.uint8, 1), [KV])), 100)
    assert _one(root, (0, 0, 0, 15, 0, 15), [u8]) == FULL
    assert _one(root, (0, 0, 0, 15, 32, 47), [u8]) == EMPTY
    bm = create_block_mask(lambda b, h, q, kv: (~u8[kv]) > 100, 1, 1, 32, 64, device="cpu", BLOCK_SIZE=16,
                           backend=backend)
    assert bm.full_kv_num_blocks.tolist() == [[[3, 3]]] and bm.kv_num_blocks.tolist() == [[[0, 0]]]
    st = interval.tile_states(root, {"b": (t(0), t(0)), "h": (t(0), t(0)), "q_idx": (t(0), t(0)),
                                     "kv_idx": (t(0), t(63))}, [u8])
    assert st.item() == UNKNOWN


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bfloat16_bounds_match_the_kernels_values(backend):
    # The staged analysis (backend="triton", here in Triton's interpreter, which stores bfloat16
    # as its bit pattern) took the min of bit patterns and added them as integers: tiles with
    # masked elements came out full and tiles with visible ones empty.
    from flexattn.block_mask import create_block_mask, create_mask
    table = (torch.randn(64, generator=torch.Generator().manual_seed(3)) * 300).bfloat16()
    mods = [lambda b, h, q, kv: table[kv] > -100.0,
            lambda b, h, q, kv: (table[kv] - table[q]) < 50.0,
            lambda b, h, q, kv: (kv + 240).to(torch.bfloat16) >= 260.0]  # 259 rounds to 260
    for mod in mods:
        bm = create_block_mask(mod, 1, 1, 32, 64, device="cpu", BLOCK_SIZE=16, backend=backend)
        dense = create_mask(mod, 1, 1, 32, 64, device="cpu").view(2, 16, 4, 16)
        want = torch.where(dense.all(3).all(1), FULL, torch.where(dense.any(3).any(1), 1, EMPTY))
        assert torch.equal(bm.tile_states()[0, 0].long(), want.long())


def test_negative_and_out_of_range_gathers():
    # Negative indices wrap; out-of-range reads give 0 (as the kernels do).
    t = torch.arange(10, 20)
    buf = ir.Buffer(0, "t", t.dtype, 1)
    wrapped = ir.binary("ge", ir.load(buf, [ir.binary("sub", Q, 10)]), 10)   # t[-10..-1] in [10, 19]
    assert _one(wrapped, (0, 0, 0, 9, 0, 0), [t]) == FULL
    oob = ir.binary("ge", ir.load(buf, [ir.binary("add", Q, 5)]), 10)       # t[5..14]: some read 0
    assert _one(oob, (0, 0, 0, 9, 0, 0), [t]) == UNKNOWN
    t = torch.arange(10, 74)
    assert _one(ir.binary("ge", ir.load(buf, [Q]), 42), (0, 0, 32, 63, 0, 0), [t]) == FULL
    assert _one(ir.binary("ge", ir.load(buf, [Q]), 42), (0, 0, 0, 31, 0, 0), [t]) == EMPTY


def test_nan_and_inf_floats_stay_undecided():
    f = torch.arange(32.0)
    f[1], f[3] = float("nan"), float("inf")
    buf = ir.Buffer(0, "f", f.dtype, 1)
    lt = ir.binary("lt", ir.load(buf, [Q]), 5.0)
    assert _one(lt, (0, 0, 0, 1, 0, 0), [f]) == UNKNOWN       # NaN < 5 is False
    ne = ir.binary("ne", ir.load(buf, [Q]), 7.0)
    assert _one(ne, (0, 0, 0, 1, 0, 0), [f]) == UNKNOWN       # NaN != 7 is True, but NaN bounds
    assert _one(ne, (0, 0, 16, 31, 0, 0), [f]) == FULL
    inf_diff = ir.binary("gt", ir.binary("sub", ir.load(buf, [Q]), ir.load(buf, [KV])), -1.0)
    assert _one(inf_diff, (0, 0, 3, 3, 3, 3), [f]) == UNKNOWN  # inf - inf is NaN


def test_float_division_and_transcendentals_are_not_modelled():
    e = ir.binary("lt", ir.unary("exp", ir.cast(Q, torch.float32)), 1e30)
    assert _one(e, (0, 0, 0, 5, 0, 0)) == UNKNOWN
    d = ir.binary("lt", ir.binary("truediv", Q, 4), 100.0)
    assert _one(d, (0, 0, 0, 5, 0, 0)) == UNKNOWN


def test_summary_pyramid_is_exact_on_tile_aligned_ranges():
    # Tiles are powers of two (>= GRANULE) at multiples of their size: those ranges are exact.
    x = torch.randint(-1000, 1000, (1000,), generator=torch.Generator().manual_seed(3))
    s = interval.Summary.of(x)
    assert s.mins[s.top] == x.min() and s.maxs[s.top] == x.max()
    buf = ir.Buffer(0, "x", x.dtype, 1)
    g = torch.Generator().manual_seed(4)
    G = interval.GRANULE
    for _ in range(200):
        n = G << int(torch.randint(0, 5, (1,), generator=g))
        lo = int(torch.randint(0, -(-1000 // n), (1,), generator=g)) * n
        hi = min(lo + n, 1000) - 1
        mn, mx = int(x[lo:hi + 1].min()), int(x[lo:hi + 1].max())
        tile = (0, 0, lo, hi, 0, 0)
        assert _one(ir.binary("ge", ir.load(buf, [Q]), mn), tile, [x]) == FULL
        assert _one(ir.binary("gt", ir.load(buf, [Q]), mx), tile, [x]) == EMPTY
        assert _one(ir.binary("gt", ir.load(buf, [Q]), mn), tile, [x]) == UNKNOWN


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float32])
def test_summary_entries_bound_exactly_the_elements_they_cover(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 100
    if dtype == torch.float32:
        x[n // 3] = float("inf")  # (infinities stay exact; the extremes sit in several entries)
        x[n // 2] = -float("inf")
    x = x.to(dtype)
    s = interval.Summary.of(x)
    ref = x.to(torch.int64) if not dtype.is_floating_point else x
    G, offsets = interval.GRANULE, s.offsets.tolist()
    assert s.mins[s.top] == ref.min() and s.maxs[s.top] == ref.max()
    for k, off in enumerate(offsets):
        width = G << k
        for i in range(-(-n // width)):  # (every entry that covers an element)
            part = ref[i * width:(i + 1) * width]
            assert s.mins[off + i] == part.min() and s.maxs[off + i] == part.max(), (k, i)


def test_kept_summaries_last_until_the_tensor_changes():
    x = torch.arange(100)
    interval.Summary.keep(x)
    a = interval.Summary.of(x)
    assert interval.Summary.of(x) is a and interval.Summary.of(x.clone()) is not a
    x[5] = -7
    b = interval.Summary.of(x)
    assert b is not a and int(b.mins[b.top]) == -7


def test_constant_mask_broadcasts_to_tiles():
    t = torch.arange(4)
    states = interval.tile_states(ir.const(True), {"b": (t[:1], t[:1]), "h": (t[:1], t[:1]),
                                                   "q_idx": (t, t), "kv_idx": (t, t)}, [])
    assert states.tolist() == [FULL] * 4


def test_non_bool_root_is_rejected():
    with pytest.raises(TypeError, match="bool"):
        _one(ir.binary("add", Q, 1), (0, 0, 0, 1, 0, 1))


def test_staged_source_is_deterministic():
    a, _ = emit_interval(MASKS["document_causal"])
    b, params = emit_interval(MASKS["document_causal"])
    assert a == b and "S0_min" in params and "@triton.jit" in a
