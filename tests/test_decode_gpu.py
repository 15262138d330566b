"""Decoding kernel on a GPU: realistic sizes, block masks, paged cache, CUDA-graph capture/replay."""

import math

import pytest
import torch

import flexattn
from flexattn.decode import causal_at, decode_attention, valid_length
from flexattn.kernels import scratch
from flexattn.paged import PagedKVCache
from flexattn.reference import attention_reference
from helpers.testing import capture_after_warmup

pytestmark = pytest.mark.gpu
DEV = "cuda"


def qkv(B, Hq, Hkv, Q_LEN, KV_LEN, E, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device=DEV, generator=g).to(dtype)  # noqa: E731
    return mk(B, Hq, Q_LEN, E), mk(B, Hkv, KV_LEN, E), mk(B, Hkv, KV_LEN, E)


def assert_close_to_reference(out, lse, q, k, v, factor=4.0, **kw):
    gqa = q.shape[1] != k.shape[1]
    ref, ref_lse = attention_reference(q, k, v, enable_gqa=gqa, return_lse=True, **kw)
    eager = attention_reference(q, k, v, enable_gqa=gqa, dtype=None, **kw)
    assert not out.isnan().any() and not lse.isnan().any()
    err = (out.double() - ref).abs().max().item()
    eager_err = (eager.double() - ref).abs().max().item()
    assert err <= factor * eager_err + 1e-3, (err, eager_err)
    live = ref_lse > -math.inf
    assert torch.equal(lse > -math.inf, live)
    torch.testing.assert_close(lse.double()[live], ref_lse[live], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("Q_LEN", [1, 4])
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (12, 12), (28, 4)])
def test_realistic_sizes(Q_LEN, Hq, Hkv):
    q, k, v = qkv(4, Hq, Hkv, Q_LEN, 8191, 128)
    out, lse = decode_attention(q, k, v, enable_gqa=Hq != Hkv, return_lse=True)
    assert_close_to_reference(out, lse, q, k, v)


def test_mods_lengths_and_offsets():
    pos = torch.tensor(5000, device=DEV, dtype=torch.int32)
    lengths = torch.tensor([5003, 4000, 1, 0], device=DEV, dtype=torch.int32)
    softcap = flexattn.score_mod("30 * tanh(score / 30)")
    q, k, v = qkv(4, 32, 8, 3, 6000, 128)
    out, lse = decode_attention(q, k, v, score_mod=softcap, mask_mod=causal_at(pos), enable_gqa=True,
                                return_lse=True, kv_lengths=lengths)
    mask = flexattn.mask_mod("(q_idx + pos >= kv_idx) & (kv_idx < lengths[b])", pos=pos, lengths=lengths)
    assert_close_to_reference(out, lse, q, k, v, score_mod=softcap, mask_mod=mask)
    assert (out[3] == 0).all() and (lse[3] == -math.inf).all()


def test_block_mask_sliding_window():
    from torch.nn.attention.flex_attention import create_block_mask

    pos = torch.tensor(9000, device=DEV, dtype=torch.int32)
    window = flexattn.mask_mod("(q_idx + pos >= kv_idx) & (q_idx + pos - kv_idx < 2000)", pos=pos)
    q, k, v = qkv(2, 16, 4, 1, 10000, 64, dtype=torch.float16)
    bm = create_block_mask(window, None, None, 1, 10000, device=DEV)
    out, lse = decode_attention(q, k, v, mask_mod=window, block_mask=bm, enable_gqa=True, return_lse=True)
    assert_close_to_reference(out, lse, q, k, v, block_mask=bm, mask_mod=window)


def test_paged_equals_contiguous():
    from torch.nn.attention.flex_attention import create_block_mask

    B, Hkv, E, L, PAGE = 3, 8, 128, 3000, 128
    lengths = [3000, 1234, 2049]
    q, k, v = qkv(B, 32, Hkv, 1, L, E)
    cache = PagedKVCache(64, PAGE, B, Hkv, E, dtype=torch.bfloat16, device=DEV)
    for step in range(L // PAGE + 1):
        for b in range(B):
            cache.reserve(b, min(lengths[b], (step + 1) * PAGE))
    cache.assign(torch.arange(B, device=DEV), torch.arange(L, device=DEV)[None].expand(B, -1), k, v)
    mask = valid_length(torch.tensor(lengths, device=DEV, dtype=torch.int32))
    bm = create_block_mask(mask, B, None, 1, L, device=DEV, BLOCK_SIZE=(1, PAGE))
    opts = {"SPLIT_KV": 4}
    a, a_lse = decode_attention(q, k, v, mask_mod=mask, block_mask=bm, enable_gqa=True,
                                kernel_options=opts, return_lse=True)
    b, b_lse = decode_attention(q, cache.k_cache, cache.v_cache, mask_mod=cache.get_mask_mod(mask),
                                block_mask=cache.convert_logical_block_mask(bm), enable_gqa=True,
                                kernel_options=opts, return_lse=True)
    # On the GPU the two layouts may sum tiles in another order (bitwise equality holds on the CPU,
    # see tests/test_paged.py): both must match the float64 reference of the logical problem.
    assert_close_to_reference(a, a_lse, q, k, v, block_mask=bm, mask_mod=mask)
    assert_close_to_reference(b, b_lse, q, k, v, block_mask=bm, mask_mod=mask)


def test_cuda_graph_capture_and_replay():
    """A decode step (new q, position advanced in place) captured once and replayed."""
    B, Hq, Hkv, L, E = 4, 32, 8, 4096, 128
    q, k, v = qkv(B, Hq, Hkv, 1, L, E)
    pos = torch.tensor(1000, device=DEV, dtype=torch.int32)
    lengths = torch.tensor([4096, 3000, 2000, 1001], device=DEV, dtype=torch.int32)
    mask = causal_at(pos)

    def step():
        return decode_attention(q, k, v, mask_mod=mask, enable_gqa=True, return_lse=True, kv_lengths=lengths)

    graph, (static_out, static_lse) = capture_after_warmup(step)  # plan and compile outside the capture

    for new_pos in (1500, 3999, 17):
        q.copy_(torch.randn_like(q))
        pos.fill_(new_pos)
        graph.replay()
        torch.cuda.synchronize()
        out, lse = step()
        torch.testing.assert_close(static_out, out, atol=0, rtol=0)
        torch.testing.assert_close(static_lse, lse, atol=0, rtol=0)
        ref_mask = flexattn.mask_mod("(q_idx + pos >= kv_idx) & (kv_idx < lengths[b])", pos=pos, lengths=lengths)
        assert_close_to_reference(static_out, static_lse, q, k, v, mask_mod=ref_mask)


# -- one launch: the last split of a row tile merges. A race in the counting would show up as
# wrong (or unwritten: NaN) rows in some of many back-to-back calls.


def _all_counters_zero():
    return all((buf == 0).all() for buf, _ in scratch.counters_of(torch.device(DEV, 0)).buffers.values())


def _lengths_for(call, B, L):
    # Per-batch lengths that change from call to call, so splits finish in varying orders.
    g = torch.Generator().manual_seed(call)
    return torch.randint(1, L + 1, (B,), generator=g, dtype=torch.int32).to(DEV)


@pytest.mark.parametrize("split", [2, 7, 32])
@pytest.mark.parametrize("Hq,Hkv,Q_LEN", [(32, 8, 1), (12, 12, 1), (28, 4, 3)])
def test_fused_merge_back_to_back(split, Hq, Hkv, Q_LEN, nan_outputs):
    B, L, E, CALLS = 4, 4099, 128, 48
    q0, k, v = qkv(B, Hq, Hkv, Q_LEN, L, E)
    opts = {"SPLIT_KV": split}
    qs = [torch.randn_like(q0) for _ in range(CALLS)]
    lengths = [_lengths_for(i, B, L) for i in range(CALLS)]
    results = [decode_attention(q, k, v, enable_gqa=Hq != Hkv, return_lse=True, kernel_options=opts,
                                kv_lengths=n) for q, n in zip(qs, lengths)]  # no sync in between
    torch.cuda.synchronize()
    assert _all_counters_zero()
    for q, n, (out, lse) in zip(qs, lengths, results):
        mask = flexattn.mask_mod("kv_idx < n[b]", n=n)
        assert_close_to_reference(out, lse, q, k, v, mask_mod=mask)


def test_fused_merge_on_two_streams(nan_outputs):
    """Calls on two streams at once count on two buffers."""
    B, Hq, Hkv, L, E, CALLS = 2, 16, 4, 3000, 64, 24
    q0, k, v = qkv(B, Hq, Hkv, 1, L, E)
    qs = [torch.randn_like(q0) for _ in range(CALLS)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for i, q in enumerate(qs):
        with torch.cuda.stream(streams[i % 2]):
            results.append(decode_attention(q, k, v, enable_gqa=True, return_lse=True, kernel_options={"SPLIT_KV": 5}))
    torch.cuda.synchronize()
    counters = scratch.counters_of(torch.device(DEV, 0))
    assert all(s.cuda_stream in counters.buffers for s in streams) and _all_counters_zero()
    for q, (out, lse) in zip(qs, results):
        assert_close_to_reference(out, lse, q, k, v)


def test_fused_merge_graph_replays_between_eager_calls(nan_outputs):
    """A captured call replayed on the current stream, interleaved with eager calls of the same
    plan on that stream (serialised: the graph counts on the capture stream's buffer)."""
    B, Hq, Hkv, L, E = 4, 32, 8, 4096, 128
    q, k, v = qkv(B, Hq, Hkv, 1, L, E)
    opts = {"SPLIT_KV": 6}

    def step():
        return decode_attention(q, k, v, enable_gqa=True, return_lse=True, kernel_options=opts)

    graph, (static_out, static_lse) = capture_after_warmup(step)
    eager = []
    for i in range(20):
        q.copy_(torch.randn_like(q))
        graph.replay()
        eager.append((q.clone(), *step()))
        if i % 5 == 4:
            torch.cuda.synchronize()
            assert_close_to_reference(static_out, static_lse, q, k, v)
    torch.cuda.synchronize()
    assert _all_counters_zero()
    for qi, out, lse in eager:
        assert_close_to_reference(out, lse, qi, k, v)
