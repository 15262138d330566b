"""flexattn inside Hugging Face transformers: attn_implementation="flexattn" on a tiny Llama and a
tiny gpt-oss (attention sinks, a sliding-window layer, mixture of experts).

The models are built from configs with random weights (no downloads): 2 layers, 4 query heads and
2 KV heads (GQA), hidden size 64, vocabulary 128.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'flexattn[transformers]')")
from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

from flexattn.integrations import transformers as fa_hf  # noqa: E402
from flexattn.reference import attention_reference, dense_block_mask  # noqa: E402

NAME = fa_hf.register()


def tiny_llama(dtype=torch.float32, seed=0):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attention_dropout=0.0)
    return _eager_and_ours(LlamaForCausalLM, cfg, dtype, seed)


def tiny_gpt_oss(dtype=torch.float32, seed=0):
    """gpt-oss's layout at toy size: a sliding-window layer (window 6) and a full one, 4 experts,
    and attention sinks drawn from N(0, 1) (so that they weigh as much as the scores)."""
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=256, attention_dropout=0.0)
    eager, ours = _eager_and_ours(GptOssForCausalLM, cfg, dtype, seed)
    for model in (eager, ours):  # (the grouped-matmul experts take no float64)
        model.set_experts_implementation("eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (name, p), (_, q) in zip(eager.named_parameters(), ours.named_parameters()):
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
                q.copy_(p)
    return eager, ours


def _eager_and_ours(model_cls, cfg, dtype, seed):
    torch.manual_seed(seed)
    eager = model_cls(copy.deepcopy(cfg)).to(dtype)
    ours = model_cls(copy.deepcopy(cfg)).to(dtype)
    ours.load_state_dict(eager.state_dict())
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation(NAME)
    assert ours.config._attn_implementation == NAME
    return eager, ours


def left_padded_batch(lengths=(9, 14, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.randint(1, 128, (len(lengths), S), generator=g)
    attention_mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention_mask[i, S - n:] = 1
    return ids, attention_mask


# ---------------------------------------------------------------------------------------------
# The mask interface: transformers' mask functions as BlockMasks


def _dense(bm, B, Q, KV):
    return dense_block_mask(bm, B, 1, Q, KV)


@pytest.mark.parametrize("kind", ["causal", "sliding", "chunked", "bidirectional"])
@pytest.mark.parametrize("offset", [0, 21])
def test_block_mask_matches_transformers_dense_mask(kind, offset):
    B, Q = 3, 37
    KV = Q + offset
    _, attention_mask = left_padded_batch((50, 44, 30))
    attention_mask = attention_mask[:, -KV:]  # [B, KV]: what the model passes with a cache
    left = (attention_mask == 0).sum(-1)
    fn = {"causal": mu.causal_mask_function,
          "sliding": mu.sliding_window_causal_mask_function(9),
          "chunked": mu.chunked_causal_mask_function(16, left),
          "bidirectional": mu.bidirectional_mask_function}[kind]
    want = mu.sdpa_mask(B, Q, KV, q_offset=offset, kv_offset=0, mask_function=fn, attention_mask=attention_mask.bool(),
                        allow_is_causal_skip=False, use_vmap=True)
    bm = fa_hf.block_mask(B, Q, KV, q_offset=offset, kv_offset=0, mask_function=fn, attention_mask=attention_mask)
    assert bm.shape == (B, 1, Q, KV)
    assert torch.equal(_dense(bm, B, Q, KV), want)


def test_block_mask_kv_offset_and_short_padding_mask():
    """A padding mask shorter than kv_offset + kv_length: the missing columns are padding."""
    B, Q, KV, off = 2, 16, 24, 8
    am = torch.ones(B, off + KV - 5, dtype=torch.bool)
    am[1, :10] = False
    want = mu.sdpa_mask(B, Q, KV, q_offset=off + 8, kv_offset=off, attention_mask=am, allow_is_causal_skip=False,
                        use_vmap=True)
    bm = fa_hf.block_mask(B, Q, KV, q_offset=off + 8, kv_offset=off, attention_mask=am)
    assert torch.equal(_dense(bm, B, Q, KV), want)


@pytest.mark.parametrize("padding", ["none", "all ones"])
def test_block_mask_kv_offset_without_padding(padding):
    """A KV offset with no padding to gather (no padding mask, or one of all ones): the mask
    function still sees absolute KV positions (a sliding window reads them)."""
    B, Q, KV, off = 2, 16, 24, 8
    am = None if padding == "none" else torch.ones(B, off + KV, dtype=torch.bool)
    fn = mu.sliding_window_causal_mask_function(5)
    want = mu.sdpa_mask(B, Q, KV, q_offset=off + 8, kv_offset=off, mask_function=fn, attention_mask=am,
                        allow_is_causal_skip=False, use_vmap=True)
    bm = fa_hf.block_mask(B, Q, KV, q_offset=off + 8, kv_offset=off, mask_function=fn, attention_mask=am)
    assert torch.equal(_dense(bm, B, Q, KV), want.expand(B, 1, Q, KV))


def test_decoding_steps_share_one_traced_mask():
    """Offsets and lengths are captured tensors: every decoding step has the same mod key (one kernel)."""
    _, am = left_padded_batch((9, 14, 5))
    keys = set()
    for step in range(3):
        mask = torch.cat([am, torch.ones(3, step + 1, dtype=am.dtype)], 1)
        bm = fa_hf.block_mask(3, 1, mask.shape[1], q_offset=mask.shape[1] - 1, attention_mask=mask)
        keys.add(bm.mod.key())
        want = mu.sdpa_mask(3, 1, mask.shape[1], q_offset=mask.shape[1] - 1, attention_mask=mask.bool(),
                            allow_is_causal_skip=False, use_vmap=True)
        assert torch.equal(_dense(bm, 3, 1, mask.shape[1]), want)
    assert len(keys) == 1


def test_32k_prefill_mask_allocates_no_dense_mask():
    """A 32k-token padded causal mask: the process grows by far less than the 1 GiB a dense mask needs."""
    code = textwrap.dedent("""
        import resource, torch
        from transformers.masking_utils import causal_mask_function
        from flexattn.integrations import transformers as fa_hf
        S = 32768
        am = torch.ones(2, S, dtype=torch.long); am[0, :1000] = 0
        fa_hf.block_mask(2, 256, 256, attention_mask=am[:, :256])  # warm up imports and caches
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        bm = fa_hf.block_mask(2, S, S, mask_function=causal_mask_function, attention_mask=am)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(grown // 1024, bm.kv_num_blocks.shape[-1], int(bm.full_kv_num_blocks[0, 0, -1]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown_mib, n_tiles, full_last_row = map(int, out.stdout.split())
    assert n_tiles == 256
    # the last row: tiles 0-6 are padding (empty), 7 is half padding and 255 the diagonal (partial)
    assert full_last_row == 256 - 8 - 1
    assert grown_mib < 200, f"mask creation grew the process by {grown_mib} MiB"


# ---------------------------------------------------------------------------------------------
# The model


# gpt-oss: its sinks go to the kernels as ``sinks=`` (forward, decoding kernel, backward)
MODELS = {"llama": tiny_llama, "gpt_oss": tiny_gpt_oss}


@pytest.mark.parametrize("family", list(MODELS))
def test_prefill_left_padded_batch_matches_eager(family):
    # float32: transformers' eager attention computes its softmax in float32 whatever the model's
    # dtype, and in float64 it turns the fully masked rows of left padding into NaN (min + min
    # overflows to -inf) that leak into the real tokens.
    eager, ours = MODELS[family](torch.float32)
    ids, am = left_padded_batch()
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=am).logits
        got = ours(input_ids=ids, attention_mask=am).logits
    keep = am.bool()  # padded positions attend to nothing under flexattn (eager: to everything)
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", list(MODELS))
def test_generate_with_kv_cache_matches_eager(family):
    eager, ours = MODELS[family](torch.float32)
    ids, am = left_padded_batch((9, 14), seed=2)
    # prefill, then 2 decoding steps (Q_LEN=1 against a growing cache: flexattn's split-KV kernel)
    kwargs = dict(attention_mask=am, max_new_tokens=3, do_sample=False, use_cache=True, pad_token_id=0)
    want = eager.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert got.shape == (2, 14 + 3)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", list(MODELS))
def test_training_step_gradients_match_eager(family):
    # float64 weights; eager's softmax is float32 (see above), which sets the tolerance
    eager, ours = MODELS[family](torch.float64, seed=3)
    eager.train()
    ours.train()
    ids, am = left_padded_batch((12, 7), seed=4)
    am = am.flip(-1)  # right padding, as in training (and no fully masked rows: float64 eager stays finite)
    labels = ids.masked_fill(am == 0, -100)
    for model in (eager, ours):
        model(input_ids=ids, attention_mask=am, labels=labels).loss.backward()
    grads = {n: p.grad for n, p in eager.named_parameters()}
    assert any(n.endswith("sinks") for n in grads) == (family == "gpt_oss")
    for n, p in ours.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, grads[n], atol=1e-7, rtol=1e-5, msg=n)


# ---------------------------------------------------------------------------------------------
# attention_forward's other inputs


def _qkv(B=2, Hq=4, Hkv=2, Q=13, KV=13, E=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Q, E, generator=g, dtype=torch.float64),
            torch.randn(B, Hkv, KV, E, generator=g, dtype=torch.float64),
            torch.randn(B, Hkv, KV, E, generator=g, dtype=torch.float64))


def test_dense_mask_softcap_and_sinks():
    q, k, v = _qkv()
    additive = torch.randn(2, 1, 13, 13, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    got, weights = fa_hf.attention_forward(None, q, k, v, additive, scaling=0.3, softcap=5.0, s_aux=sinks)
    assert weights is None and got.shape == (2, 13, 4, 16)
    # reference: softmax over [capped scores + mask, sink] with the sink column dropped afterwards
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = 5.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.3 / 5.0) + additive
    s = torch.cat([s, sinks.view(1, 4, 1, 1).expand(2, 4, 13, 1)], -1)
    want = (torch.softmax(s, -1)[..., :-1] @ vv).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_bool_dense_mask_and_none():
    q, k, v = _qkv(seed=6)
    keep = torch.rand(1, 1, 13, 13, generator=torch.Generator().manual_seed(0)) > 0.3
    got, _ = fa_hf.attention_forward(None, q, k, v, keep)
    want = attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: keep[0, 0, qi, ki], enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-10, rtol=1e-10)
    got, _ = fa_hf.attention_forward(None, q, k, v, None)
    torch.testing.assert_close(got, attention_reference(q, k, v, enable_gqa=True).transpose(1, 2),
                               atol=1e-10, rtol=1e-10)


def test_errors():
    q, k, v = _qkv()
    module = torch.nn.Module()  # .training is True
    with pytest.raises(ValueError, match=r"no dropout; got dropout=0.1 in training mode"):
        fa_hf.attention_forward(module, q, k, v, None, dropout=0.1)
    with pytest.raises(TypeError, match=r"attention_mask must be a BlockMask, a 4-D tensor or None, got \(2, 13\)"):
        fa_hf.attention_forward(None, q, k, v, torch.ones(2, 13))
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D \[batch_size=2, kv_length\] padding mask, got \(3, 5\)"):
        fa_hf.block_mask(2, 5, 5, attention_mask=torch.ones(3, 5))
    with pytest.raises(TypeError, match=r"q_offset must be an int or a one-element tensor, got 1.5"):
        fa_hf.block_mask(2, 5, 5, q_offset=1.5)
    with pytest.raises(TypeError, match=r"name must be a non-empty str, got ''"):
        fa_hf.register("")


@pytest.mark.parametrize("bias_shape", [(1, 4, 13, 13), (2, 1, 13, 13)], ids=["per head", "per batch"])
def test_per_batch_bool_mask_and_position_bias(bias_shape):
    """A bool 4-D mask that differs between batch rows and is longer than KV (its extra columns are
    not read), and a position bias over heads or over batch rows: each row and head reads its own."""
    q, k, v = _qkv(seed=7)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 1, 13, 17, generator=g) > 0.4
    keep[..., 0] = True  # every row keeps a key
    bias = torch.randn(bias_shape, generator=g, dtype=torch.float64)
    got, _ = fa_hf.attention_forward(None, q, k, v, keep, scaling=0.4, position_bias=bias)
    full = bias.expand(2, 4, 13, 13)
    want = attention_reference(q, k, v, score_mod=lambda s, b, h, qi, ki: s + full[b, h, qi, ki],
                               mask_mod=lambda b, h, qi, ki: keep[b, 0, qi, ki], scale=0.4, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-10, rtol=1e-10)
