"""flexattn.scores: each family against its dense definition, in flexattn and in torch's flex_attention."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import masks, scores
from flexattn.reference import apply_score_mod, attention_reference

B, H, S = 2, 4, 37


def rel():  # kv_idx - q_idx, [S, S]
    return torch.arange(S).view(1, S) - torch.arange(S).view(S, 1)


def t5_bucket_reference(relative_position, bidirectional, num_buckets, max_distance):
    """T5's _relative_position_bucket, written out from the paper's code (no clamping shortcut)."""
    ret = torch.zeros_like(relative_position)
    n = num_buckets
    if bidirectional:
        n //= 2
        ret += (relative_position > 0).long() * n
        pos = relative_position.abs()
    else:
        pos = -torch.minimum(relative_position, torch.zeros_like(relative_position))
    max_exact = n // 2
    large = max_exact + (torch.log(pos.float() / max_exact) / math.log(max_distance / max_exact)
                         * (n - max_exact)).long()
    large = torch.minimum(large, torch.full_like(large, n - 1))
    return ret + torch.where(pos < max_exact, pos, large)


def _cases():
    g = torch.Generator().manual_seed(1)
    slopes = torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])  # alibi_slopes(4): 2^(-8i/4)
    table = torch.randn(H, 2 * 6 + 1, generator=g, dtype=torch.float64)
    shared = torch.randn(2 * 6 + 1, generator=g, dtype=torch.float64)
    t5 = torch.randn(16, H, generator=g, dtype=torch.float64)
    r = rel()
    idx = r.clamp(-6, 6) + 6
    return {  # name: (score_mod, f(score [B, H, S, S]) -> modified scores)
        "alibi": (scores.alibi(4), lambda s: s + slopes.view(1, H, 1, 1) * r),
        "alibi_custom_slopes": (scores.alibi(4, slopes=torch.tensor([1.0, 0.5, 0.0, -0.5])),
                                lambda s: s + torch.tensor([1.0, 0.5, 0.0, -0.5]).view(1, H, 1, 1) * r),
        "softcap": (scores.softcap(2.0), lambda s: 2.0 * torch.tanh(s / 2.0)),
        "relative_bias": (scores.relative_bias(table), lambda s: s + table[:, idx].unsqueeze(0)),
        "relative_bias_shared": (scores.relative_bias(shared), lambda s: s + shared[idx]),
        "t5_bidirectional": (scores.t5_bucketed_bias(t5, max_distance=10),
                             lambda s: s + t5[t5_bucket_reference(r, True, 16, 10)].permute(2, 0, 1)),
        "t5_causal": (scores.t5_bucketed_bias(t5, max_distance=10, bidirectional=False),
                      lambda s: s + t5[t5_bucket_reference(r, False, 16, 10)].permute(2, 0, 1)),
    }


CASES = _cases()


def _scores():
    return torch.randn(B, H, S, S, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3


@pytest.mark.parametrize("name", CASES)
def test_dense_definition(name):
    mod, dense = CASES[name]
    s = _scores()
    want = dense(s)
    # torch semantics (vmap over b, h, q_idx, kv_idx, as torch's eager flex_attention runs it)
    torch.testing.assert_close(apply_score_mod(mod, s), want, atol=1e-12, rtol=1e-12)
    # flexattn's traced IR, evaluated
    traced = flexattn.trace(mod, kind="score", score_dtype=torch.float64)
    b, h, q, kv = (torch.arange(n, dtype=torch.int32).view(*[n if i == d else 1 for i in range(4)])
                   for d, n in enumerate((B, H, S, S)))
    torch.testing.assert_close(traced(s, b, h, q, kv).double().expand(B, H, S, S), want, atol=1e-12, rtol=1e-12)


def test_t5_buckets_match_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5", reason="transformers is not installed")
    r = torch.arange(-300, 301).view(1, -1)
    for bidirectional in (True, False):
        want = t5.T5Attention._relative_position_bucket(r, bidirectional, 32, 128)
        got = scores.t5_buckets(32, 128, bidirectional)[r.clamp(-128, 128) + 128]
        assert torch.equal(got.long(), want)


@pytest.mark.parametrize("name", ["alibi", "softcap", "relative_bias", "t5_bidirectional"])
def test_in_flex_attention_and_torch_flex_attention(name):
    mod, dense = CASES[name]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, S, 16, generator=g) for _ in range(3))
    bias = dense(torch.zeros(B, H, S, S, dtype=torch.float64)) if name != "softcap" else None
    ref_mod = (lambda s, b, h, qi, ki: 2.0 * torch.tanh(s / 2.0)) if bias is None else \
        (lambda s, b, h, qi, ki: s + bias[b, h, qi, ki])
    ref = attention_reference(q, k, v, score_mod=ref_mod, mask_mod=masks.causal)
    bm = flexattn.create_block_mask(masks.causal, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(flexattn.flex_attention(q, k, v, score_mod=mod, block_mask=bm).double(), ref,
                               atol=2e-5, rtol=2e-5)
    tbm = torch_flex.create_block_mask(masks.causal, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch_flex.flex_attention(q, k, v, score_mod=mod, block_mask=tbm)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("make", [scores.relative_bias, lambda t: scores.t5_bucketed_bias(t.T.contiguous(), 8)])
def test_tables_are_learnable(make):
    """The captured table gets flexattn's gradient, equal to float64 autograd through the dense definition."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, H, S, 8, generator=g, dtype=torch.float64) for _ in range(3))
    table = torch.randn(H, 13, generator=g, dtype=torch.float64, requires_grad=True)
    mod = make(table)
    out = flexattn.flex_attention(q, k, v, score_mod=mod)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * grad_out).sum().backward()
    got = table.grad.clone()
    table.grad = None
    ref = attention_reference(q, k, v, score_mod=mod)  # the same mod, run by torch (vmap) in float64
    (ref * grad_out).sum().backward()
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, table.grad, atol=1e-9, rtol=1e-7)


def test_alibi_slopes():
    assert scores.alibi_slopes(8).tolist() == [2.0 ** (-i) for i in range(1, 9)]
    # not a power of two: the 4 slopes of 4 heads, then every other slope of 8 heads
    assert scores.alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]


def test_alibi_makes_its_slopes_on_the_given_device():
    assert flexattn.trace(scores.alibi(4)).buffers[0].device.type == "cpu"
    on_meta = flexattn.trace(scores.alibi(4, device="meta"))
    assert [(t.device.type, tuple(t.shape)) for t in on_meta.buffers] == [("meta", (4,))]


def test_names_and_docstrings():
    assert [f.__name__ for f in (scores.alibi(4), scores.softcap(30), scores.relative_bias(torch.zeros(3)),
                                 scores.t5_bucketed_bias(torch.zeros(32, 2)))] == \
        ["alibi_4", "softcap_30.0", "relative_bias", "t5_bias_32_128"]
    for fn in (getattr(scores, n) for n in scores.__all__):
        assert "Example::" in fn.__doc__, fn.__name__


@pytest.mark.parametrize("call, match", [
    (lambda: scores.alibi(0), r"num_heads must be a positive int, got 0"),
    (lambda: scores.alibi(4, slopes=torch.ones(3)), r"slopes must be a \[4\] tensor, got \(3,\)"),
    (lambda: scores.alibi(4, slopes=torch.ones(4), device="cpu"), r"give slopes or device, not both \(got slopes on cpu"),
    (lambda: scores.softcap(-1.0), r"cap must be a positive finite number, got -1.0"),
    (lambda: scores.relative_bias(torch.zeros(4, 8)), r"odd last dimension\), got \(4, 8\)"),
    (lambda: scores.relative_bias(torch.zeros(5, dtype=torch.long)), r"floating .* got \(5,\) torch.int64"),
    (lambda: scores.t5_bucketed_bias(torch.zeros(32)), r"table must be a floating \[num_buckets, H\] tensor, got \(32,\)"),
])
def test_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
