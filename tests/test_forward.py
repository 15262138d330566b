"""The block-sparse forward kernel (Triton's CPU interpreter) against the float64 reference.

Every comparison has three parties: the kernel, eager attention in the inputs' dtype (what the
dtype costs) and float64 eager attention (the truth); the kernel's error must stay within a small
multiple of eager's (`helpers.testing.assert_close_to_reference`).
"""

from __future__ import annotations

import math

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from flexattn import ir
from helpers import testing
from flexattn.attention import flex_attention
from flexattn.call import FlexAttentionFunction
from flexattn.block_mask import BlockMask, create_block_mask
from flexattn.mods import Mod
from flexattn.reference import attention_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FORCE = {"FORCE_USE_FLEX_ATTENTION": True}  # short queries would otherwise take the decoding kernel


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


def make_qkv(B, Hq, Hkv, Q_LEN, KV_LEN, E, Ev, dtype, kv_batch=None, layout="bhle", seed=0):
    """Random q, k, v; ``layout`` "blhe" stores them [B, L, H, E] (permuted views)."""
    g = torch.Generator().manual_seed(seed)
    kv_batch = B if kv_batch is None else kv_batch

    def rand(b, h, n, e):
        if layout == "blhe":
            return torch.randn(b, n, h, e, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, e, generator=g).to(dtype)

    return rand(B, Hq, Q_LEN, E), rand(kv_batch, Hkv, KV_LEN, E), rand(kv_batch, Hkv, KV_LEN, Ev)


def score_bound(q, k, score_mod=None, scale=None) -> float:
    """max |score| after the score mod (sets the absolute error scale of exp2-based softmax)."""
    B, Hq, _, E = q.shape
    Hkv = k.shape[1]
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1).expand(B, Hq, -1, -1)
    scores = q.double() @ kk.transpose(-2, -1) * (scale or 1 / math.sqrt(E))
    if score_mod is not None:
        from flexattn.reference import apply_score_mod

        scores = apply_score_mod(score_mod, scores)
    finite = scores[torch.isfinite(scores)]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def check(q, k, v, score_mod=None, block_mask=None, ref_score_mod=None, ref_mask_mod=None, factor=2.0,
          kernel_options=None, **kwargs):
    """Run flex_attention's block-sparse kernel; compare out and LSE with eager (same dtype) and
    float64 references.

    ``ref_score_mod`` / ``ref_mask_mod`` replace the mods in the float64 reference (e.g. their
    float64 IR). Short queries would go to the decoding kernel: FORCE_USE_FLEX_ATTENTION keeps
    them here. Returns (out, lse).
    """
    kernel_options = {"FORCE_USE_FLEX_ATTENTION": True, **(kernel_options or {})}
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True,
                              kernel_options=kernel_options, **kwargs)
    enable_gqa = kwargs.get("enable_gqa", False)
    scale = kwargs.get("scale")
    common = dict(block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True,
                  sinks=kwargs.get("sinks"))
    ref, ref_lse = attention_reference(q, k, v, score_mod=ref_score_mod or score_mod, mask_mod=ref_mask_mod,
                                       **common)
    eager, eager_lse = testing.eager_reference(q, k, v, kernel_options, score_mod=score_mod, **common)
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3]) and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    # exp2-based softmax has an absolute error of a few ulp of the largest score (times |v|); in
    # float16/bfloat16 the kernel rounds P (unnormalised) and O once more than eager can share:
    # half an ulp at |v|'s largest. Eager's own error covers the rest (4 ulp here let a kernel 9x
    # worse than eager pass, e.g. one that skips rescaling the accumulator when the max grows a little).
    smax = score_bound(q, k, ref_score_mod or score_mod, scale)
    eps32 = torch.finfo(torch.float32).eps
    vmax = v.abs().max().item()
    testing.assert_close_to_reference(out, eager, ref, factor=factor, name="out",
                                      atol=max(torch.finfo(q.dtype).eps / 2, 16 * eps32 * smax) * vmax)
    testing.assert_close_to_reference(lse, eager_lse.float(), ref_lse, factor=factor, name="lse",
                                      atol=16 * eps32 * smax)
    return out, lse


def from_ir(kind, node, buffers, name="mod"):
    return Mod(kind, node, buffers, name=name)


def make_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, block_size):
    return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=block_size)


# ---------------------------------------------------------------------------------------------
# Shapes, layouts, dtypes (no mods)


@settings(max_examples=20, deadline=None)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 3]),
    Q_LEN=st.integers(1, 200), KV_LEN=st.integers(1, 200),
    E=st.sampled_from([8, 16, 24, 40, 64]), Ev=st.sampled_from([8, 16, 20, 64]),
    dtype=st.sampled_from(DTYPES), kv_broadcast=st.booleans(), layout=st.sampled_from(["bhle", "blhe"]),
    tiles=st.sampled_from([None, (16, 32), (32, 16)]), seed=st.integers(0, 2**16),
)
def test_shapes_dtypes_layouts(B, Hkv, G, Q_LEN, KV_LEN, E, Ev, dtype, kv_broadcast, layout, tiles, seed):
    q, k, v = make_qkv(B, Hkv * G, Hkv, Q_LEN, KV_LEN, E, Ev, dtype, kv_batch=1 if kv_broadcast else B,
                       layout=layout, seed=seed)
    options = None if tiles is None else {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}
    out, _ = check(q, k, v, enable_gqa=G > 1, kernel_options=options)
    if E == Ev:  # output takes the query's stride order
        assert out.stride() == torch.empty_like(q).stride()


def test_output_follows_query_stride_order():
    q, k, v = make_qkv(2, 2, 2, 33, 47, 16, 24, torch.float32, layout="blhe")
    out = flex_attention(q, k, v, kernel_options=FORCE)
    assert out.shape == (2, 2, 33, 24)
    assert out.stride() == (33 * 2 * 24, 24, 2 * 24, 1)


def test_strided_non_contiguous_inputs():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 3, 90, 80, generator=g)
    q = base[:, :, ::2, 8:40]  # strided rows, sliced head dim
    k = base.flip(2)[:, :, :60, 40:72]  # negative-free view of a flipped copy
    v = base.transpose(2, 3)[:, :, :50, :60].transpose(2, 3)  # column-major last two dims
    check(q, k, v)


def test_float64_is_exact_to_rounding():
    q, k, v = make_qkv(1, 2, 1, 45, 70, 24, 40, torch.float64)
    causal = from_ir("mask", ir.binary("ge", ir.input_("q_idx"), ir.input_("kv_idx")), [])
    bm = make_block_mask(causal, None, None, 45, 70, 32)
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    assert lse.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_empty_inputs():
    q, k, v = make_qkv(1, 1, 1, 0, 20, 16, 16, torch.float32)
    out, lse = flex_attention(q, k, v, return_lse=True, kernel_options=FORCE)
    assert out.shape == (1, 1, 0, 16) and lse.shape == (1, 1, 0)
    q, k, v = make_qkv(1, 1, 1, 5, 0, 16, 16, torch.float32)
    out, lse = flex_attention(q, k, v, return_lse=True, kernel_options=FORCE)
    assert (out == 0).all() and (lse == -math.inf).all()


@pytest.mark.parametrize("mods", ["none", "score_mod", "mask_mod", "both"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_empty_key_sequence(mods, with_sinks):
    """The oracle handles KV_LEN = 0 as the kernels do: output 0, LSE -inf (sinks[h] with sinks)."""
    from flexattn import masks, scores

    q, k, v = make_qkv(1, 2, 2, 5, 0, 16, 8, torch.float32)
    kw = {"score_mod": scores.alibi(2) if mods in ("score_mod", "both") else None,
          "mask_mod": masks.causal if mods in ("mask_mod", "both") else None,
          "sinks": torch.tensor([0.5, -1.0]) if with_sinks else None}
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **kw)
    # (create_block_mask refuses KV_LEN = 0; without keys there is nothing for a mask to drop)
    out, lse = flex_attention(q, k, v, score_mod=kw["score_mod"], return_lse=True,
                              sinks=kw["sinks"], kernel_options=FORCE)
    assert ref.shape == out.shape == (1, 2, 5, 8) and (ref == 0).all() and (out == 0).all()
    torch.testing.assert_close(lse.double(), ref_lse)
    expected = kw["sinks"].double().view(1, 2, 1).expand(1, 2, 5) if with_sinks else torch.full((1, 2, 5), -math.inf)
    torch.testing.assert_close(ref_lse, expected.double())


def test_matches_torch_eager_flex_attention():
    """A second, independent oracle: torch's own eager flex_attention."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    q, k, v = make_qkv(2, 4, 2, 77, 100, 32, 32, torch.float32, seed=3)
    alibi = from_ir("score", ir.binary("sub", ir.input_("score"), ir.binary(
        "mul", ir.cast(ir.binary("sub", ir.input_("q_idx"), ir.input_("kv_idx")), torch.float32), 0.1)), [])
    causal = from_ir("mask", ir.binary("ge", ir.input_("q_idx"), ir.input_("kv_idx")), [])
    bm = make_block_mask(causal, None, None, 77, 100, 32)
    out, lse = flex_attention(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True, return_lse=True,
                              kernel_options=FORCE)
    ref, ref_lse = torch_flex(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# Random mods (the IR generator) with random block masks


@settings(max_examples=22, deadline=None)
@given(
    score=testing.score_irs(max_depth=3, max_buffers=2),
    mask=testing.mask_irs(max_depth=3, max_buffers=2),
    B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2]),
    Q_LEN=st.integers(1, 128), KV_LEN=st.integers(1, 128),
    E=st.sampled_from([16, 24, 32]), Ev=st.sampled_from([16, 24]),
    dtype=st.sampled_from(DTYPES),
    q_block=st.sampled_from([16, 32, 48, 64]), kv_block=st.sampled_from([16, 32, 48, 64]),
    mask_heads=st.booleans(), tiles=st.sampled_from([None, (16, 16)]), seed=st.integers(0, 2**16),
)
def test_random_mods_and_block_masks(score, mask, B, Hkv, G, Q_LEN, KV_LEN, E, Ev, dtype, q_block, kv_block,
                                     mask_heads, tiles, seed):
    (score_node, score_bufs), (mask_node, mask_bufs) = score, mask
    score_mod = from_ir("score", score_node, score_bufs, "random_score")
    mask_mod = from_ir("mask", mask_node, mask_bufs, "random_mask")
    ref_score = from_ir("score", testing.to_float64(score_node), testing.buffers_float64(score_bufs))
    Hq = Hkv * G
    # flexattn's create_block_mask takes powers of two; torch's object (duck-typed) takes 48 too.
    create = torch_create_block_mask if 48 in (q_block, kv_block) else create_block_mask
    bm = create(mask_mod, B, Hq if mask_heads else None, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=(q_block, kv_block))
    q, k, v = make_qkv(B, Hq, Hkv, Q_LEN, KV_LEN, E, Ev, dtype, seed=seed)
    options = None if tiles is None else {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}
    check(q, k, v, score_mod=score_mod, block_mask=bm, ref_score_mod=ref_score, enable_gqa=G > 1,
          kernel_options=options)


# ---------------------------------------------------------------------------------------------
# The mod families users write (Python functions, traced; the reference runs them under vmap)

B_, H_, Q_, KV_ = 2, 4, 100, 130
_g = torch.Generator().manual_seed(7)
DOC = torch.repeat_interleave(torch.arange(4), torch.tensor([40, 25, 50, 15])).to(torch.int32)  # KV_ tokens
DOC_START = torch.tensor([0, 40, 65, 115])
PREFIX = torch.tensor([17, 60])
LENGTHS = torch.tensor([130, 0])  # batch 1 is all padding: every row fully masked
SLOPES = torch.exp2(-8.0 * torch.arange(1, H_ + 1) / H_)
REL = (torch.randn(H_, 2 * 16 + 1, generator=_g) * 0.5).half()
BIAS = torch.randn(B_, H_, Q_, KV_, generator=_g, requires_grad=True)
BIAS_T = torch.randn(KV_, Q_, generator=_g).t()  # non-contiguous, read as [q, kv]
ALLOWED = torch.rand(H_, 8, generator=_g) < 0.7  # bool table: may head h see key block j (of 17 keys)?
IMG_W, IMG_H, NAT_K = 10, 13, 5  # NATTEN: a 13 x 10 image, 5 x 5 neighbourhoods (KV_ = 130 pixels)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 24)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX[b]) | (q_idx >= kv_idx)


def document_causal(b, h, q_idx, kv_idx):
    # Nested gathers: each token's position inside its own document.
    q_pos = q_idx - DOC_START[DOC[q_idx]]
    kv_pos = kv_idx - DOC_START[DOC[kv_idx]]
    return (DOC[q_idx] == DOC[kv_idx]) & (q_pos >= kv_pos)


def natten(b, h, q_idx, kv_idx):
    q_x, q_y = q_idx % IMG_W, q_idx // IMG_W
    kv_x, kv_y = kv_idx % IMG_W, kv_idx // IMG_W
    # The window is clamped inside the image, so border pixels see a full K x K window too.
    c_x = q_x.clamp(NAT_K // 2, IMG_W - 1 - NAT_K // 2)
    c_y = q_y.clamp(NAT_K // 2, IMG_H - 1 - NAT_K // 2)
    return ((c_x - kv_x).abs() <= NAT_K // 2) & ((c_y - kv_y).abs() <= NAT_K // 2)


def padding(b, h, q_idx, kv_idx):
    return kv_idx < LENGTHS[b]


def head_blocks(b, h, q_idx, kv_idx):
    return ALLOWED[h, kv_idx // 17] | (q_idx == kv_idx)


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 20 * torch.tanh(score / 20)


def relative_position(score, b, h, q_idx, kv_idx):
    return score + REL[h, (q_idx - kv_idx).clamp(-16, 16) + 16]


def learnable_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[b, h, q_idx, kv_idx]


def transposed_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS_T[q_idx, kv_idx]


def per_head_and_batch(score, b, h, q_idx, kv_idx):
    return torch.where(h % 2 == 0, score, score * 0.5) + b.to(torch.float32)


@pytest.mark.parametrize("score_mod, mask_mod", [
    (None, causal),
    (softcap, sliding_window),
    (alibi, prefix_lm),
    (relative_position, document_causal),
    (None, natten),
    (learnable_bias, causal),
    (transposed_bias, padding),
    (per_head_and_batch, head_blocks),
], ids=lambda f: getattr(f, "__name__", "none"))
def test_mod_families(score_mod, mask_mod):
    q, k, v = make_qkv(B_, H_, H_ // 2, Q_, KV_, 32, 32, torch.bfloat16, seed=11)
    bm = make_block_mask(mask_mod, B_, H_, Q_, KV_, 32)
    with torch.no_grad():
        out, lse = check(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    assert not out.isnan().any() and not lse.isnan().any()


# ---------------------------------------------------------------------------------------------
# Fully masked rows


def padding_mask(lengths):
    """Keys at or beyond lengths[b] are padding: a batch with length 0 has only masked rows."""
    return from_ir("mask", ir.binary("lt", ir.input_("kv_idx"), ir.load(
        ir.Buffer(0, "lengths", torch.int64, 1), [ir.input_("b")])), [lengths])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_give_zero_and_minus_inf(dtype):
    lengths = torch.tensor([0, 37, 5])
    mask = padding_mask(lengths)
    # Rows q_idx % 3 == 0 also see nothing: the score mod sends them to -inf.
    drop = from_ir("score", ir.where(ir.binary("eq", ir.binary("mod", ir.input_("q_idx"), 3), 0), -math.inf,
                                     ir.input_("score")), [])
    bm = make_block_mask(mask, 3, None, 50, 70, 16)
    q, k, v = make_qkv(3, 2, 2, 50, 70, 16, 16, dtype)
    out, lse = check(q, k, v, score_mod=drop, block_mask=bm)
    dead = torch.zeros(3, 2, 50, dtype=torch.bool)
    dead[0] = True
    dead[:, :, ::3] = True
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[dead] == 0).all() and (lse[dead] == -math.inf).all()
    assert (lse[~dead] > -math.inf).all()


def test_a_nan_row_does_not_hide_the_others():
    """A score_mod that is NaN on one row makes eager's output NaN there too; every other row must
    still be compared, so a row the kernel leaves unwritten (poisoned NaN) fails."""
    nan_row = from_ir("score", ir.where(ir.binary("eq", ir.input_("q_idx"), 5), math.nan, ir.input_("score")), [])
    q, k, v = make_qkv(1, 2, 2, 45, 37, 16, 16, torch.float32)
    out, lse = check(q, k, v, score_mod=nan_row)
    assert out[:, :, 5].isnan().all() and lse[:, :, 5].isnan().all()


def test_rows_guaranteed_safe_matches_default_on_safe_masks():
    causal = from_ir("mask", ir.binary("ge", ir.input_("q_idx"), ir.input_("kv_idx")), [])
    bm = make_block_mask(causal, None, None, 64, 64, 32)
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    safe = flex_attention(q, k, v, block_mask=bm, kernel_options={"ROWS_GUARANTEED_SAFE": True, **FORCE})
    torch.testing.assert_close(safe, flex_attention(q, k, v, block_mask=bm, kernel_options=FORCE), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Block-mask layouts and kernel options


def causal_mod():
    return from_ir("mask", ir.binary("ge", ir.input_("q_idx"), ir.input_("kv_idx")), [])


def test_block_mask_without_full_blocks_and_shuffled_indices():
    """Partial blocks only, listed in a random order per row: the kernel must follow kv_indices."""
    causal = causal_mod()
    bm = make_block_mask(causal, 2, 2, 70, 90, (32, 16))
    g = torch.Generator().manual_seed(0)
    # Merge full blocks into the partial list (mask_mod is true on them anyway) and shuffle.
    dense = bm.to_dense().bool()
    num = dense.sum(-1).to(torch.int32)
    keys = torch.where(dense, torch.rand(dense.shape, generator=g), 2.0)
    idx = keys.argsort(-1).to(torch.int32)
    shuffled = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(32, 16), mask_mod=causal, seq_lengths=(70, 90))
    q, k, v = make_qkv(2, 2, 2, 70, 90, 16, 16, torch.float32)
    out = flex_attention(q, k, v, block_mask=shuffled, kernel_options=FORCE)
    torch.testing.assert_close(out, flex_attention(q, k, v, block_mask=bm, kernel_options=FORCE), atol=2e-6, rtol=2e-6)
    check(q, k, v, block_mask=shuffled)


@pytest.mark.parametrize("options", [
    {"PRESCALE_QK": True},
    {"BLOCKS_ARE_CONTIGUOUS": True},
    {"BLOCK_M": 16, "BLOCK_N": 16},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
    {"FORCE_USE_FLEX_ATTENTION": True},
    {"LONGEST_FIRST": False},
])
def test_kernel_options(options):
    # Causal block masks list each row's blocks contiguously, so BLOCKS_ARE_CONTIGUOUS holds.
    bm = make_block_mask(causal_mod(), None, None, 100, 100, 64)
    q, k, v = make_qkv(1, 2, 2, 100, 100, 32, 32, torch.bfloat16)
    check(q, k, v, block_mask=bm, kernel_options=options)


def test_sparse_block_walked_in_sub_tiles():
    """A 64-wide sparse KV block walked as four 16-wide tiles, next to a dense window mask."""
    window = from_ir("mask", ir.binary("le", ir.unary("abs", ir.binary("sub", ir.input_("q_idx"),
                                                                            ir.input_("kv_idx"))), 20), [])
    bm = make_block_mask(window, None, None, 130, 150, (32, 64))
    q, k, v = make_qkv(1, 1, 1, 130, 150, 16, 16, torch.float32)
    check(q, k, v, block_mask=bm, kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})


@pytest.mark.parametrize("tiles", [{"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 32, "BLOCK_N": 32}])
def test_rows_of_consecutive_and_other_blocks(tiles):
    """The block walk follows each row's lists as they are: consecutive blocks (from block 0 or
    further on), the same blocks out of order, with gaps, one block, none, in partial and full
    lists, in tiles of half a block and of a whole one."""
    partial = [[0, 1, 2], [2, 3, 4], [3, 2, 4], [0, 2, 4], [5], [], [1, 3]]
    full = [[3, 4], [0], [], [1, 5], [0, 1, 2, 3], [0, 1], [4, 5]]

    def table(rows):
        num = torch.tensor([[[len(r) for r in rows]]], dtype=torch.int32)
        idx = torch.tensor([[[r + [c for c in range(6) if c not in r] for r in rows]]], dtype=torch.int32)
        return num, idx

    bm = BlockMask.from_kv_blocks(*table(partial), *table(full), BLOCK_SIZE=32, seq_lengths=(210, 180),
                                  mask_mod=lambda b, h, q_idx, kv_idx: (q_idx + kv_idx) % 3 != 0)
    q, k, v = make_qkv(1, 2, 2, 210, 180, 16, 16, torch.float32)
    check(q, k, v, block_mask=bm, kernel_options=tiles)


def _contiguous_flags_of_plans():
    from flexattn.kernels import plans
    return [p.kernel.constexprs["BLOCKS_ARE_CONTIGUOUS"] for p in plans.FORWARD.plans.values()]


def test_masks_of_consecutive_blocks_skip_reading_their_lists():
    """A mask whose KV lists all list consecutive blocks (causal) runs the kernel that steps
    through them without reading the lists, as if BLOCKS_ARE_CONTIGUOUS were passed; one with a
    gap in a row (a sliding window's partial list: its first and last block) does not."""
    from flexattn import call
    from flexattn.kernels import plans, tables

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 80)

    q, k, v = make_qkv(1, 2, 2, 150, 150, 16, 16, torch.float32)
    for mod, consecutive in ((causal_mod(), True), (window, False)):
        bm = make_block_mask(mod, None, None, 150, 150, 32)
        assert tables.tables_of(bm).consecutive() is consecutive
        call.forget()
        plans.FORWARD.plans.clear()
        check(q, k, v, block_mask=bm)
        assert _contiguous_flags_of_plans() == [consecutive]
    # an explicit False is the caller's choice: the lists are read
    call.forget()
    plans.FORWARD.plans.clear()
    check(q, k, v, block_mask=make_block_mask(causal_mod(), None, None, 150, 150, 32),
          kernel_options={"BLOCKS_ARE_CONTIGUOUS": False})
    assert _contiguous_flags_of_plans() == [False]


def test_the_tables_signature_holds_both_directions_layouts():
    """The tables' signature (part of every plan key) tells apart masks whose KV lists are alike
    and whose transposed q_* lists differ in layout only, or are absent: the backward's kernels
    take those lists' strides, which a compiled kernel may have specialised on."""
    from flexattn.kernels import tables

    bm = make_block_mask(causal_mod(), None, None, 150, 150, 32)
    q_idx = bm.q_indices
    wide = torch.zeros(*q_idx.shape[:-1], q_idx.shape[-1] + 3, dtype=q_idx.dtype)
    wide[..., :q_idx.shape[-1]] = q_idx
    full_q_idx = bm.full_q_indices
    wide_full = torch.zeros(*full_q_idx.shape[:-1], full_q_idx.shape[-1] + 3, dtype=full_q_idx.dtype)
    wide_full[..., :full_q_idx.shape[-1]] = full_q_idx

    def with_q(num, idx, full_num, full_idx):
        return BlockMask(bm.seq_lengths, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                         num, idx, full_num, full_idx, BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod)

    same = with_q(bm.q_num_blocks, q_idx, bm.full_q_num_blocks, full_q_idx)
    strided = with_q(bm.q_num_blocks, wide[..., :q_idx.shape[-1]], bm.full_q_num_blocks,
                     wide_full[..., :full_q_idx.shape[-1]])
    without = with_q(None, None, None, None)
    sigs = [tables.tables_of(m).sig for m in (bm, same, strided, without)]
    assert sigs[0] == sigs[1] and len({sigs[0], sigs[2], sigs[3]}) == 3


def test_a_list_changed_in_place_is_read_again():
    """The consecutive-blocks answer belongs to the lists it was computed from: after an in-place
    change of kv_indices the kernel reads the lists again (a stale answer would walk the old blocks)."""
    from flexattn.kernels import tables

    num = torch.tensor([[[2, 2, 3]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1, 2, 3], [1, 2, 0, 3], [1, 2, 3, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=32, seq_lengths=(96, 128))
    q, k, v = make_qkv(1, 1, 1, 96, 128, 16, 16, torch.float32)
    check(q, k, v, block_mask=bm)
    assert tables.tables_of(bm).consecutive()
    bm.kv_indices[0, 0, 1, 1] = 3  # row 1 now lists blocks 1 and 3
    check(q, k, v, block_mask=bm)
    assert not tables.tables_of(bm).consecutive()


def test_int64_offsets_path(monkeypatch):
    """The 64-bit offset specialisation computes the same thing (forced on a small tensor)."""
    from flexattn.kernels import layout, plans
    from flexattn.kernels.launch import PlanCache

    monkeypatch.setattr(layout, "INT32_OFFSET_LIMIT", 0)
    monkeypatch.setattr(plans, "FORWARD", PlanCache())  # plans made before would not see the limit
    assert layout.needs_int64_offsets(torch.empty(2, 2))
    q, k, v = make_qkv(2, 2, 1, 40, 50, 16, 16, torch.float16, layout="blhe")
    check(q, k, v, enable_gqa=True)


def test_short_queries_take_the_decoding_kernel(monkeypatch):
    from flexattn.kernels import decode as decode_kernel

    calls = testing.record_calls(monkeypatch, decode_kernel, "run")
    q, k, v = make_qkv(2, 4, 2, 5, 90, 32, 32, torch.float16)
    bm = make_block_mask(causal_mod(), None, None, 5, 90, 16)
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    assert len(calls) == 1
    forced = check(q, k, v, block_mask=bm, enable_gqa=True)
    assert len(calls) == 1
    torch.testing.assert_close(out, forced[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, forced[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scale", [0.37, -0.8, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_scale_argument(scale, dtype, masked):
    # Without a score_mod the kernel folds the scale into exp2's argument, which needs a positive
    # factor: a negative or zero scale takes the plan's unfolded twin (zero: uniform weights).
    q, k, v = make_qkv(1, 2, 2, 70, 90, 16, 16, dtype)
    bm = make_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 70, 90, 32) if masked else None
    out, _ = check(q, k, v, block_mask=bm, scale=scale)
    if scale == 0.0 and not masked:  # every row is the plain mean of V
        torch.testing.assert_close(out.float(), v.float().mean(2, keepdim=True).expand_as(out),
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_inputs_that_need_grad_take_the_autograd_function():
    bias = torch.randn(20, requires_grad=True)
    score_mod = from_ir("score", ir.binary("add", ir.input_("score"), ir.load(
        ir.Buffer(0, "bias", torch.float32, 1), [ir.input_("kv_idx")])), [bias])
    q, k, v = make_qkv(1, 1, 1, 20, 20, 16, 16, torch.float32)
    # A short query, but training: the block-sparse kernel (the decoding kernel has no backward).
    out = flex_attention(q, k, v, score_mod=score_mod)
    assert isinstance(out.grad_fn, FlexAttentionFunction._backward_cls)
    with torch.no_grad():
        assert flex_attention(q, k, v, score_mod=score_mod).grad_fn is None


# ---------------------------------------------------------------------------------------------
# Errors


def _qkv(**over):
    shapes = dict(q=(1, 2, 10, 16), k=(1, 2, 12, 16), v=(1, 2, 12, 16))
    shapes.update(over)
    return [torch.randn(*shapes[n]) for n in ("q", "k", "v")]


@pytest.mark.parametrize("args, kwargs, error, match", [
    (_qkv(q=(2, 10, 16)), {}, ValueError, r"query must have 4 dimensions \[B, H, L, E\], got shape \(2, 10, 16\)"),
    (_qkv(k=(1, 2, 12, 32), v=(1, 2, 12, 32)), {}, ValueError, r"key's head dim .* must equal query's E=16, got 32"),
    (_qkv(k=(1, 3, 12, 16), v=(1, 3, 12, 16)), {"enable_gqa": True}, ValueError,
     r"query heads \(2\) must be a multiple of key/value heads \(3\)"),
    (_qkv(q=(1, 4, 10, 16)), {}, ValueError, r"query has 4 heads but key/value have 2: pass enable_gqa=True"),
    (_qkv(v=(1, 2, 11, 16)), {}, ValueError, r"value must match key in \[B, H, KV_LEN\] = \[1, 2, 12\], got \[1, 2, 11\]"),
    (_qkv(q=(3, 2, 10, 16), k=(2, 2, 12, 16), v=(2, 2, 12, 16)), {}, ValueError,
     r"key/value batch must be 1 \(broadcast\) or query's batch 3, got 2"),
    (_qkv(q=(1, 2, 10, 300), k=(1, 2, 12, 300)), {}, ValueError, r"query/key head dim E must be between 1 and 256, got 300"),
    (_qkv(), {"kernel_options": {"BLOCK_K": 32}}, ValueError, r"unknown key 'BLOCK_K'; valid keys are:\n  BLOCK_M"),
    (_qkv(), {"kernel_options": {"BLOCK_M": 48}}, ValueError, r"kernel_options\['BLOCK_M'\] must be a power of two in 16..256, got 48"),
    (_qkv(), {"kernel_options": {"PRESCALE_QK": 1}}, TypeError, r"kernel_options\['PRESCALE_QK'\] must be a bool, got 1"),
    (_qkv(), {"score_mod": lambda score, b, h, q_idx: score}, TypeError,
     r"score_mod must take 5 arguments \(score, b, h, q_idx, kv_idx\), but '<lambda>' takes 4"),
    (_qkv(), {"score_mod": causal_mod()}, TypeError, r"score_mod must be a score mod, got the mask mod"),
    (_qkv(), {"score_mod": 3}, TypeError, r"score_mod must be a function or a flexattn Mod, got int"),
    (_qkv(), {"scale": "big"}, TypeError, r"scale must be a float or None, got 'big'"),
    (_qkv(), {"scale": torch.tensor(0.5)}, TypeError, r"scale must be a float or None, got tensor\(0.5000\) \(a tensor: "
     r"pass scale.item\(\)\)"),
])
def test_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        flex_attention(*args, **kwargs)


def test_numpy_numbers_as_scale():
    q, k, v = _qkv()
    want = flex_attention(q, k, v, scale=0.25)
    for scale in (numpy.float32(0.25), numpy.float64(0.25)):
        torch.testing.assert_close(flex_attention(q, k, v, scale=scale), want, atol=0, rtol=0)


def test_dtype_and_device_mismatch():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"key must have query's dtype torch.float32, got torch.float16"):
        flex_attention(q, k.half(), v)
    with pytest.raises(ValueError, match=r"value must be on query's device cpu, got meta"):
        flex_attention(q, k, v.to("meta"))
    with pytest.raises(TypeError, match=r"query must be float16, bfloat16, float32, float64 or float8_e4m3fn "
                                        r"\(forward only\), got torch.int64"):
        flex_attention(q.long(), k.long(), v.long())


def test_block_mask_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"block_mask was built for \(Q_LEN, KV_LEN\) = \(10, 20\), but query has "
                                         r"Q_LEN=10 and key KV_LEN=12"):
        flex_attention(q, k, v, block_mask=make_block_mask(causal_mod(), None, None, 10, 20, 16))
    with pytest.raises(ValueError, match=r"block_mask has B=3, H=1; it must have B of 1 or query's 1 and H of 1 "
                                         r"or query's 2"):
        flex_attention(q, k, v, block_mask=make_block_mask(causal_mod(), 3, None, 10, 12, 16))
    with pytest.raises(ValueError, match=r"block_mask has B=1, H=3"):
        flex_attention(q, k, v, block_mask=make_block_mask(causal_mod(), None, 3, 10, 12, 16))
    with pytest.raises(ValueError, match=r"block_mask's KV block size must be a positive multiple of 16 .* "
                                         r"got BLOCK_SIZE=\(16, 8\)"):
        flex_attention(q, k, v, block_mask=torch_create_block_mask(causal_mod(), None, None, 10, 12, "cpu", (16, 8)))
    with pytest.raises(ValueError, match=r"kernel_options\['BLOCK_N'\]=64 must divide the block mask's block size 32"):
        flex_attention(q, k, v, block_mask=make_block_mask(causal_mod(), None, None, 10, 12, 32),
                       kernel_options={"BLOCK_N": 64, **FORCE})
    bm = make_block_mask(causal_mod(), None, None, 10, 12, 16)
    with pytest.raises(ValueError, match=r"block_mask is on meta but query is on cpu"):
        flex_attention(q, k, v, block_mask=bm.to("meta"))
    with pytest.raises(ValueError, match=r"query, key and value are meta tensors; flex_attention runs kernels"):
        flex_attention(q.to("meta"), k.to("meta"), v.to("meta"), block_mask=bm)


def test_captured_tensor_on_another_device_is_an_error():
    q = torch.randn(1, 1, 20, 16)
    bias = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match=r"captured a tensor on meta, but query is on cpu"):
        flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[h])
