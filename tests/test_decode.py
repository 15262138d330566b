"""Split-KV decoding kernel (Triton interpreter) against the float64 eager reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import flexattn
from flexattn.kernels import decode as dec, launch, options, plans, scratch
from flexattn.decode import causal_at, causal_at_with_length, decode_attention, valid_length
from flexattn.reference import attention_reference
from helpers.launches import recorded_launches
from helpers.testing import record_calls


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


def qkv(B, Hq, Hkv, Q_LEN, KV_LEN, E, Ev=None, dtype=torch.float32, kv_batch=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Q_LEN, E, generator=g).to(dtype)
    k = torch.randn(kv_batch or B, Hkv, KV_LEN, E, generator=g).to(dtype)
    v = torch.randn(kv_batch or B, Hkv, KV_LEN, Ev or E, generator=g).to(dtype)
    return q, k, v


def check(q, k, v, score_mod=None, mask_mod=None, block_mask=None, kv_lengths=None, ref_mask=None,
          opts=None, factor=8.0):
    """Kernel vs float64 reference; its error must stay within `factor` x eager float32's."""
    gqa = q.shape[1] != k.shape[1]
    out, lse = decode_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                enable_gqa=gqa, return_lse=True, kernel_options=opts, kv_lengths=kv_lengths)
    ref_mask = ref_mask if ref_mask is not None else mask_mod
    kw = dict(score_mod=score_mod, block_mask=block_mask, mask_mod=ref_mask, enable_gqa=gqa, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, **kw)
    eager_out, eager_lse = attention_reference(q, k, v, dtype=None, **kw)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    # Fully masked rows: output exactly 0 and LSE -inf, exactly where the reference says so.
    dead = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, dead)
    assert (out[dead] == 0).all()
    live = ~dead
    err = (out.double() - ref_out).abs().max().item()
    eager_err = (eager_out.double() - ref_out).abs().max().item()
    floor = 1e-6 if q.dtype == torch.float32 else 1e-3
    assert err <= factor * eager_err + floor, (err, eager_err)
    lerr = (lse.double() - ref_lse)[live].abs().max().item() if live.any() else 0.0
    assert lerr <= 1e-5 * (1 + ref_lse[live].abs().max().item() if live.any() else 1), lerr
    return out, lse


# (Q_LEN, Hq, Hkv, KV_LEN, E, Ev, SPLIT_KV): GQA ratios 1, 4, 8 and 3; lengths not multiples of 16.
SHAPES = [
    (1, 4, 4, 77, 32, 32, 1),
    (3, 8, 2, 150, 16, 24, 3),
    (8, 8, 1, 100, 32, 32, 2),
    (2, 6, 2, 45, 20, 20, 4),
    (3, 3, 1, 200, 64, 16, 5),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}_h{}-{}_kv{}_e{}-{}_s{}".format(*s))
def test_dense_shapes(shape):
    Q_LEN, Hq, Hkv, KV_LEN, E, Ev, split = shape
    q, k, v = qkv(2, Hq, Hkv, Q_LEN, KV_LEN, E, Ev)
    check(q, k, v, opts={"SPLIT_KV": split})


def test_default_split_and_kv_batch_broadcast():
    q, k, v = qkv(3, 4, 2, 2, 90, 32, kv_batch=1)
    check(q, k, v)


def test_score_mod_with_captured_tensors():
    bias = torch.randn(8)
    softcap = flexattn.score_mod("12 * tanh((score + bias[h] * (q_idx - kv_idx) / 64) / 12)", bias=bias)
    q, k, v = qkv(2, 8, 2, 3, 130, 32)
    check(q, k, v, score_mod=softcap, opts={"SPLIT_KV": 3})


def test_offset_causal_and_lengths_mask():
    # New tokens sit at pos..pos+Q_LEN-1 of a cache filled to lengths[b] (<= allocated 160).
    pos = torch.tensor(97, dtype=torch.int32)
    lengths = torch.tensor([100, 61], dtype=torch.int32)
    q, k, v = qkv(2, 4, 1, 3, 160, 16)
    mask = causal_at_with_length(pos, lengths)
    check(q, k, v, mask_mod=mask, opts={"SPLIT_KV": 4})
    # The same through the kv_lengths argument (the tail is never read) plus the offset mask.
    check(q, k, v, mask_mod=causal_at(pos), kv_lengths=lengths, ref_mask=mask, opts={"SPLIT_KV": 4})
    # Lengths alone, including a batch with no valid keys: its rows are 0 / -inf.
    empty = torch.tensor([0, 33], dtype=torch.int32)
    out, lse = check(q, k, v, mask_mod=valid_length(empty), opts={"SPLIT_KV": 2})
    assert (lse[0] == -math.inf).all() and (out[0] == 0).all()
    out2, lse2 = decode_attention(q, k, v, enable_gqa=True, return_lse=True, kv_lengths=empty,
                                  kernel_options={"SPLIT_KV": 2})
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-6)
    assert torch.equal(lse2 == -math.inf, lse == -math.inf)
    # a strided kv_lengths (a column of a [B, 2] tensor) reads its own elements
    columns = torch.stack([empty, torch.tensor([160, 1], dtype=torch.int32)], dim=1)
    out3, lse3 = decode_attention(q, k, v, enable_gqa=True, return_lse=True, kv_lengths=columns[:, 0],
                                  kernel_options={"SPLIT_KV": 2})
    torch.testing.assert_close(out3, out, atol=1e-6, rtol=1e-6)
    assert torch.equal(lse3 == -math.inf, lse == -math.inf)


def test_captured_position_is_read_in_kernel():
    """Updating the 0-d position in place changes the result without a new launch plan."""
    pos = torch.tensor(10, dtype=torch.int32)
    mask = causal_at(pos)
    q, k, v = qkv(1, 2, 2, 1, 70, 16)
    a = decode_attention(q, k, v, mask_mod=mask, kernel_options={"SPLIT_KV": 2})
    n_plans = len(plans.DECODE)
    pos.fill_(60)
    b = decode_attention(q, k, v, mask_mod=mask, kernel_options={"SPLIT_KV": 2})
    assert len(plans.DECODE) == n_plans
    torch.testing.assert_close(b.double(), attention_reference(q, k, v, mask_mod=mask), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a, b)


def _block_mask(fn, B, H, Q_LEN, KV_LEN, bs):
    return create_block_mask(fn, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=bs)


def test_block_mask_partial_and_full_tiles():
    pos = torch.tensor(130, dtype=torch.int32)
    window = flexattn.mask_mod("(q_idx + pos >= kv_idx) & (q_idx + pos - kv_idx < 90)", pos=pos)
    # torch's eager create_block_mask never marks a padded query block full: Q_LEN = its block.
    q, k, v = qkv(2, 8, 2, 4, 170, 32)
    bm = _block_mask(window, None, None, 4, 170, (4, 16))
    assert bm.full_kv_num_blocks.sum() > 0 and bm.kv_num_blocks.sum() > 0
    check(q, k, v, mask_mod=window, block_mask=bm, opts={"SPLIT_KV": 3})


def test_block_mask_per_head_and_batch():
    # Per-head (H = Hq) masks: heads are not packed; per-batch rows; Q_LEN spans two query blocks.
    doc = torch.tensor([40, 75], dtype=torch.int32)
    mask = flexattn.mask_mod("(kv_idx < doc[b]) & ((kv_idx + h) % 3 != 0) | (q_idx == kv_idx)", doc=doc)
    q, k, v = qkv(2, 4, 2, 20, 93, 16)
    bm = _block_mask(mask, 2, 4, 20, 93, 16)
    check(q, k, v, mask_mod=mask, block_mask=bm, opts={"SPLIT_KV": 2})


def test_block_mask_with_score_mod_and_kv_lengths():
    lengths = torch.tensor([50, 111], dtype=torch.int32)
    mask = flexattn.mask_mod("kv_idx % 5 != 1")
    score = flexattn.score_mod("score * 0.5 + (kv_idx % 7) * 0.1")
    q, k, v = qkv(2, 2, 2, 1, 128, 32)
    bm = _block_mask(mask, None, None, 1, 128, 32)
    check(q, k, v, score_mod=score, mask_mod=mask, block_mask=bm, kv_lengths=lengths,
          ref_mask=flexattn.mask_mod("(kv_idx % 5 != 1) & (kv_idx < lengths[b])", lengths=lengths),
          opts={"SPLIT_KV": 2})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, k, v = qkv(1, 8, 2, 2, 100, 32, dtype=dtype)
    check(q, k, v, opts={"SPLIT_KV": 2}, factor=4.0)


@settings(max_examples=10, deadline=None)
@given(
    Q_LEN=st.integers(1, 9), Hkv=st.integers(1, 3), ratio=st.sampled_from([1, 2, 3, 5]),
    KV_LEN=st.integers(1, 140), E=st.sampled_from([16, 24, 32]), split=st.integers(1, 6),
    window=st.integers(1, 150),
)
def test_hypothesis(Q_LEN, Hkv, ratio, KV_LEN, E, split, window):
    pos = torch.tensor(max(KV_LEN - Q_LEN, 0), dtype=torch.int32)
    mask = flexattn.mask_mod("(q_idx + pos >= kv_idx) & (q_idx + pos - kv_idx < w)", pos=pos, w=window)
    q, k, v = qkv(1, Hkv * ratio, Hkv, Q_LEN, KV_LEN, E, seed=KV_LEN)
    check(q, k, v, mask_mod=mask, opts={"SPLIT_KV": split})


def test_validation_errors():
    q, k, v = qkv(2, 4, 2, 1, 40, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        decode_attention(q, k, v)
    with pytest.raises(ValueError, match=r"batch must be 1 \(broadcast\) or query.s batch 2, got 3"):
        decode_attention(q, k.repeat(2, 1, 1, 1)[:3], v.repeat(2, 1, 1, 1)[:3], enable_gqa=True)
    with pytest.raises(TypeError, match="kv_lengths"):
        decode_attention(q, k, v, enable_gqa=True, kv_lengths=torch.tensor([3.0, 4.0]))
    with pytest.raises(TypeError, match=r"kv_lengths must be an integer tensor \[B\] or None, got list"):
        decode_attention(q, k, v, enable_gqa=True, kv_lengths=[3, 4])
    with pytest.raises(ValueError, match="unknown key"):
        decode_attention(q, k, v, enable_gqa=True, kernel_options={"SPLITKV": 2})
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        decode_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    with pytest.raises(TypeError, match="0-d integer"):
        causal_at(torch.tensor([1]))


def _window_py(b, h, q_idx, kv_idx):
    """A Python mask_mod (not a DSL Mod): the block mask must carry it into the kernel."""
    return (q_idx + 60 >= kv_idx) & (q_idx + 60 - kv_idx < 45)


@pytest.mark.parametrize("maker", ["torch", "flexattn"])
def test_block_mask_python_mask_mod_is_applied(maker):
    """A Python mask_mod on the BlockMask masks the partial tiles (it used to be dropped)."""
    create = create_block_mask if maker == "torch" else flexattn.create_block_mask
    q, k, v = qkv(2, 4, 2, 3, 83, 16)
    bm = create(_window_py, None, None, 3, 83, device="cpu", BLOCK_SIZE=16)
    assert bm.kv_num_blocks.sum() > 0  # there are partial tiles for the mask to act on
    out, lse = decode_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True,
                                kernel_options={"SPLIT_KV": 2})
    ref, ref_lse = attention_reference(q, k, v, mask_mod=_window_py, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # flex_attention's dispatch to the decoding kernel gives the same.
    torch.testing.assert_close(flexattn.flex_attention(q, k, v, block_mask=bm, enable_gqa=True), out,
                               atol=1e-6, rtol=1e-6)


def test_kernel_options_accepted_set():
    """decode accepts its own knobs and every flex_attention option (backward knobs included,
    ignored here); keys flexattn has no use for are rejected with what to do instead."""
    q, k, v = qkv(1, 2, 2, 2, 40, 16)
    ref = attention_reference(q, k, v)
    every = {"BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32, "bwd_num_warps": 4,
             "bwd_num_stages": 1, "PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False,
             "BLOCKS_ARE_CONTIGUOUS": False, "AUTOTUNE": False, "FAST_TANH": True, "LONGEST_FIRST": False,
             "HEAD_GROUP": 2, "DETERMINISTIC": True, "DQ_PASS": True}
    decode_only = {k for k, (family, _, _) in options.OPTIONS.items() if family == "decode"}
    assert set(every) | decode_only | {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "BACKEND"} >= \
        set(options.OPTIONS) - {"FORCE_USE_FLEX_ATTENTION"}
    for key_, value in every.items():
        out = flexattn.flex_attention(q, k, v, kernel_options={key_: value})
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        decode_attention(q, k, v, kernel_options={key_: value, "SPLIT_KV": 2})
    for torch_only in ("IS_DIVISIBLE", "OUTPUT_LOGSUMEXP", "WRITE_DQ", "USE_TMA"):
        with pytest.raises(ValueError, match=torch_only):
            decode_attention(q, k, v, kernel_options={torch_only: True})


@pytest.mark.parametrize("Q_LEN", [1, 3])
def test_output_follows_query_stride_order(Q_LEN):
    """Like the forward kernel, decode returns the output in the query's stride order."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, Q_LEN, 2, 16, generator=g).transpose(1, 2)    # [B, H, L, E] view of [B, L, H, E]
    k = torch.randn(2, 2, 70, 16, generator=g)
    v = torch.randn(2, 70, 2, 16, generator=g).transpose(1, 2)
    for split in (1, 3):  # one split writes Out itself / the row tile's last split merges and writes it
        out = decode_attention(q, k, v, kernel_options={"SPLIT_KV": split})
        fwd = flexattn.flex_attention(q, k, v, kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
        assert out.stride() == fwd.stride() == q.stride(), (out.stride(), fwd.stride(), q.stride())
        torch.testing.assert_close(out, fwd, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), attention_reference(q, k, v), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# One launch: the row tile's last split merges the partials, on counters that return to zero


def _cpu_counters():
    return scratch.counters_of(torch.device("cpu"))


@pytest.mark.parametrize("split", [2, 3, 7])
@pytest.mark.parametrize("Hq,Hkv,Q_LEN,KV_LEN,Ev", [(8, 2, 2, 141, 24), (3, 3, 1, 125, 16), (10, 2, 3, 203, 40),
                                                   (16, 2, 9, 130, 16)])
def test_forced_split_merges_in_one_launch(split, Hq, Hkv, Q_LEN, KV_LEN, Ev):
    """GQA and MHA, KV lengths and V head dims that are no multiple of the tiles, one row per tile
    (MHA, Q_LEN 1) to two row tiles per KV head (72 rows): one launch."""
    q, k, v = qkv(2, Hq, Hkv, Q_LEN, KV_LEN, 32, Ev, seed=split)
    sites = [site for site, _ in recorded_launches(lambda: check(q, k, v, opts={"SPLIT_KV": split}))]
    assert len(sites) == 1 and sites[0].constexprs["SPLIT_KV"] == split


def test_a_growing_cache_meets_few_split_counts():
    """SPLIT_KV is a constexpr (a compiled kernel each): as a KV cache grows a token per step, the
    chosen split is a power of two, so a long generation meets a handful."""
    q = torch.randn(1, 8, 1, 32)
    want = math.ceil(12 * launch.num_sms(q.device) / 2)  # 2 row tiles: one per KV head
    full = 1 << (want.bit_length() - 1)  # the power of two at or below the target
    seen = set()
    for n in range(40, 3000, 7):
        k = torch.randn(1, 2, n, 32)
        plan = dec.make_plan(q, k, k, None, (), None, (), None, {"PROGRAMS_PER_SM": 12, "MIN_TILES_PER_SPLIT": 2},
                             None)
        seen.add(plan.split_kv)
        assert plan.split_kv <= full and plan.split_kv & (plan.split_kv - 1) == 0, (n, plan.split_kv)
    assert full in seen and len(seen) <= 1 + full.bit_length(), sorted(seen)


@pytest.mark.parametrize("split", [2, 3, 7])
def test_forced_split_fully_masked_rows(split):
    """Rows that see nothing come out 0 / -inf from the merge: a dead row inside live tiles, a
    query block with no KV block at all (every split empty), and a batch with no valid keys."""
    pos = torch.tensor(90, dtype=torch.int32)
    mask = flexattn.mask_mod("(q_idx < 16) & (q_idx % 5 != 2) & (kv_idx <= q_idx + pos)", pos=pos)
    q, k, v = qkv(2, 6, 2, 20, 131, 16, seed=split)
    bm = _block_mask(mask, None, None, 20, 131, 16)
    assert (bm.kv_num_blocks[0, 0, 1] == 0).all() and (bm.full_kv_num_blocks[0, 0, 1] == 0).all()
    out, lse = check(q, k, v, mask_mod=mask, block_mask=bm, opts={"SPLIT_KV": split})
    assert (lse[:, :, 16:] == -math.inf).all() and (lse[:, :, 2] == -math.inf).all()
    lengths = torch.tensor([0, 57], dtype=torch.int32)
    out, lse = check(q, k, v, mask_mod=flexattn.mask_mod("kv_idx < n[b]", n=lengths), kv_lengths=lengths,
                     ref_mask=flexattn.mask_mod("kv_idx < n[b]", n=lengths), opts={"SPLIT_KV": split})
    assert (lse[0] == -math.inf).all() and (out[0] == 0).all() and (lse[1] > -math.inf).all()


def test_counters_return_to_zero_after_every_call(monkeypatch):
    """The same plan twice: both calls count on one buffer (no new one, no memset), it is all
    zeros after each call, and the second call's results are right."""
    seen = []
    call = scratch.Counters.__call__

    def spy(self, n):
        stream, buf = call(self, n)
        seen.append(buf)
        return stream, buf

    monkeypatch.setattr(scratch.Counters, "__call__", spy)
    q, k, v = qkv(3, 8, 2, 3, 150, 32, seed=1)
    n_plans = len(plans.DECODE)
    for seed in (2, 3):
        q = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed))  # new query each call
        check(q, k, v, opts={"SPLIT_KV": 5})
        assert (seen[-1] == 0).all()
    assert len(plans.DECODE) <= n_plans + 1 and len(seen) == 2 and seen[0] is seen[1]
    assert seen[0].numel() >= 3 * 2 and seen[0] is _cpu_counters().buffers[0][0]


def test_counts_are_modular():
    """A count that is already a multiple of SPLIT_KV (what concurrent misuse can leave for a
    moment) still merges once per call and comes back to where it was."""
    q, k, v = qkv(1, 4, 4, 1, 100, 16, seed=4)
    check(q, k, v, opts={"SPLIT_KV": 3})
    buf = _cpu_counters().buffers[0][0]
    buf[:4] = 6
    try:
        check(q, k, v, opts={"SPLIT_KV": 3})
        assert (buf[:4] == 6).all() and (buf[4:] == 0).all()
    finally:
        buf.zero_()


def test_merge_in_several_steps(monkeypatch):
    """Few registers for the merge: it reads the partials one or two at a time and rescales."""
    monkeypatch.setattr(dec, "MERGE_ELEMENTS_PER_WARP", 64)
    monkeypatch.setattr(plans, "DECODE", launch.PlanCache())
    q, k, v = qkv(2, 6, 2, 3, 111, 32, seed=5)
    sites = [s for s, _ in recorded_launches(lambda: check(q, k, v, opts={"SPLIT_KV": 7}))]
    assert sites[0].constexprs["MERGE_CHUNK"] == 1 and sites[0].constexprs["MERGE_M"] == 16


def test_a_failed_launch_leaves_the_counters_at_zero(monkeypatch):
    def half_run(self, *args, stream=None):
        args[5][:3] += 1  # some splits counted themselves in, then the launch stopped
        raise RuntimeError("stopped")

    q, k, v = qkv(1, 4, 2, 1, 60, 16)
    decode_attention(q, k, v, enable_gqa=True, kernel_options={"SPLIT_KV": 2})
    monkeypatch.setattr(launch.Launch, "__call__", half_run)
    with pytest.raises(RuntimeError, match="stopped"):
        decode_attention(q, k, v, enable_gqa=True, kernel_options={"SPLIT_KV": 2})
    assert (_cpu_counters().buffers[0][0] == 0).all()


@pytest.mark.parametrize("split", [1, 3])
def test_without_the_lse_only_the_output_is_allocated(split, monkeypatch):
    """flex_attention without return_lse: the LSE and the partials go to the stream's scratch
    (NaN before every call, so a partial read before it is written shows), the call allocates
    only its output, and the rows are those of the call that returns the LSE."""
    q, k, v = qkv(2, 8, 2, 3, 141, 32, seed=7)
    opts = {"SPLIT_KV": split}
    ref, lse = flexattn.flex_attention(q, k, v, enable_gqa=True, kernel_options=opts, return_lse=True)
    check(q, k, v, opts=opts)  # the call with the LSE is right
    made = record_calls(monkeypatch, launch, "empty")
    buffers = scratch.scratch_of(torch.device("cpu"))
    for _ in range(2):
        made.clear()
        for buf, _ in buffers.buffers.values():
            buf.fill_(math.nan)
        out = flexattn.flex_attention(q, k, v, enable_gqa=True, kernel_options=opts)
        assert torch.equal(out, ref)
    assert [args[0] for args in made] == [(2, 8, 3, 32)]
    out, aux = flexattn.flex_attention(q, k, v, enable_gqa=True, kernel_options=opts,
                                       return_aux=flexattn.AuxRequest(lse=True))
    assert torch.equal(out, ref) and torch.equal(aux.lse, lse)


def test_scratch_per_stream_and_under_capture(monkeypatch):
    """One scratch buffer per stream, reused while large enough, grown (doubling) when not, the
    old one kept; a call under capture on a stream with none gets a buffer of its own."""
    s = scratch.Scratch(torch.device("cpu"))
    stream, a = s(10, 11)
    assert stream == 11 and a.numel() == 10 and a.dtype == torch.float32
    assert s(5, 11) == (11, a) and s(0)[0] == 0
    _, b = s(15, 11)
    assert b.numel() == 20 and s.retired == [a] and s(20, 11)[1] is b
    assert s(3, 22)[1] is not b
    monkeypatch.setattr(scratch.Scratch, "_capturing", lambda self: True)
    _, own = s(10, 33)
    assert own.numel() == 10 and 33 not in s.buffers
    assert s(20, 11)[1] is b  # a stream that has one keeps using it


# ---------------------------------------------------------------------------------------------
# scratch.Counters: zero between launches, one buffer per stream


def test_counters_per_stream_and_under_capture(monkeypatch):
    """One buffer per stream, grown when a plan needs more, the old one kept; a capture adopts
    the zeroed spare, or takes a buffer of its own (not kept) when there is none."""
    c = scratch.Counters(torch.device("cpu"))
    a = c._grow(11, 10)
    assert a.numel() == scratch.COUNTERS_MIN and (a == 0).all()
    assert c._grow(22, 10) is not a and c.buffers[11][0] is a
    big = c._grow(11, scratch.COUNTERS_MIN + 1)
    assert big.numel() == 2 * scratch.COUNTERS_MIN and c.retired == [a] and c.buffers[11][0] is big
    c.reserve(100)
    spare = c.spare
    assert spare is not None and (spare == 0).all()
    monkeypatch.setattr(scratch.Counters, "_capturing", lambda self: True)
    c.reserve(10**6)
    assert c.spare is spare  # nothing is zeroed during a capture
    assert c._grow(33, 100) is spare and c.spare is None and c.buffers[33][0] is spare
    own = c._grow(44, 100)
    assert (own == 0).all() and 44 not in c.buffers
