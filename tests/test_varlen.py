"""`varlen_attention` on the CPU: packed sequences against a float64 reference computed one
sequence at a time, the block tables built from offsets, paged K/V, bad offsets, the call path."""

from __future__ import annotations

import pytest
import torch

from flexattn import AuxRequest, call, modcache, varlen
from flexattn.block_mask import packed
from flexattn.kernels.tables import flags
from flexattn.varlen import varlen_attention
from helpers.calls import record_calls

F64 = torch.float64
LSE = AuxRequest(lse=True)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 16 rows: the short sequences here span several, as real ones span many of 128."""
    monkeypatch.setattr(varlen, "BLOCK_SIZE", (16, 16))


def offsets(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed_inputs(lq, lk, Hq=2, Hkv=2, D=16, Dv=16, dtype=F64, seed=0, extra_q=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq) + extra_q, Hq, D, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), Hkv, Dv, generator=g, dtype=dtype)
    return q, k, v


def reference(q, k, v, cu_q, cu_k, window=(-1, -1), score_mod=None, mask_mod=None, seqused_k=None):
    """(out [T_q, Hq, Dv], lse [T_q, Hq]) in float64, one sequence at a time (dense softmax);
    differentiable. Rows that see no key (and tokens past the last offset) give 0 and -inf."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    Hq, Hkv = q.shape[1], k.shape[1]
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        a, z, c = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
        d = int(cu_k[b + 1]) if seqused_k is None else c + int(seqused_k[b])
        qs = q[a:z].transpose(0, 1)
        ks, vs = (t[c:d].transpose(0, 1).repeat_interleave(Hq // Hkv, 0) for t in (k, v))
        s = qs @ ks.transpose(-1, -2) / q.shape[-1] ** 0.5
        i = torch.arange(z - a)[None, :, None]
        j = torch.arange(d - c)[None, None, :]
        h = torch.arange(Hq)[:, None, None]
        if score_mod is not None:
            s = score_mod(s, torch.tensor(b), h, i, j)
        keep = torch.ones(Hq, z - a, d - c, dtype=torch.bool)
        diag = i + (d - c) - (z - a)
        if window[0] >= 0:
            keep = keep & (j >= diag - window[0])
        if window[1] >= 0:
            keep = keep & (j <= diag + window[1])
        if mask_mod is not None:
            keep = keep & mask_mod(torch.tensor(b), h, i, j)
        seen = keep.any(-1, keepdim=True)
        lse = torch.logsumexp(torch.where(keep, s, torch.where(seen, -torch.inf, 0.0)), -1, keepdim=True)
        p = torch.where(keep, torch.exp(s - lse), 0.0)
        outs.append((p @ vs).transpose(0, 1))
        lses.append(torch.where(seen, lse, -torch.inf)[..., 0].t())
    rest = q.shape[0] - int(cu_q[-1])
    outs.append(torch.zeros(rest, Hq, v.shape[-1], dtype=F64))
    lses.append(torch.full((rest, Hq), -torch.inf, dtype=F64))
    return torch.cat(outs), torch.cat(lses)


def with_sinks(out, lse, sinks):
    """The reference with attention sinks: exp(sinks[h]) joins each row's denominator."""
    lse_s = torch.logaddexp(lse, sinks.to(F64))
    return out * torch.exp(lse - lse_s)[..., None], lse_s


def assert_lse(lse, ref):
    assert torch.equal(lse.isinf(), ref.isinf())
    torch.testing.assert_close(lse.to(F64).nan_to_num(neginf=0), ref.detach().nan_to_num(neginf=0),
                               atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# Forward and backward against float64

BIAS = torch.randn(7, 4, dtype=F64, generator=torch.Generator().manual_seed(3))

CASES = {
    # name: (q lengths, k lengths or None (the same offsets tensor), Hq, Hkv, window, mods)
    "one causal": ([13], None, 2, 2, (-1, 0), None),
    "two q!=k window gqa": ([5, 17], [9, 11], 4, 2, (3, 2), None),
    "seven causal mods": ([1, 0, 19, 3, 33, 2, 7], None, 4, 4, (-1, 0), "both"),
    "seven q!=k full mods": ([1, 0, 19, 3, 33, 2, 7], [4, 5, 0, 17, 30, 1, 9], 4, 2, (-1, -1), "both"),
    "seven left window score": ([1, 0, 19, 3, 33, 2, 7], None, 2, 1, (5, -1), "score"),
    "two more q than k causal": ([20, 3], [6, 3], 2, 2, (-1, 0), "mask"),
}


def mods(which, bias):
    score = (lambda s, b, h, q_idx, kv_idx: s + 0.5 * bias[b, h] + 0.01 * (q_idx - kv_idx)) \
        if which in ("both", "score") else None
    mask = (lambda b, h, q_idx, kv_idx: (q_idx + 2 * kv_idx + b) % 3 != 0) if which in ("both", "mask") else None
    return score, mask


@pytest.mark.parametrize("case", ["two q!=k window gqa", "seven causal mods"])
def test_sinks_forward_and_backward_match_float64(case):
    lq, lk, Hq, Hkv, window, which = CASES[case]
    cu_q = offsets(lq)
    cu_k = cu_q if lk is None else offsets(lk)
    q, k, v = (t.requires_grad_() for t in packed_inputs(lq, lk or lq, Hq, Hkv, Dv=8, seed=5))
    bias = BIAS[:, :Hq].clone().requires_grad_()
    sinks = torch.linspace(-1.0, 2.0, Hq, dtype=F64).requires_grad_()
    score_mod, mask_mod = mods(which, bias)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk or lq), window_size=window, return_aux=LSE,
                                enable_gqa=Hq != Hkv, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    ref, ref_lse = with_sinks(*reference(q, k, v, cu_q, cu_k, window, score_mod, mask_mod), sinks)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    assert_lse(lse, ref_lse)
    g = torch.randn_like(out)
    inputs = (q, k, v, sinks) + ((bias,) if score_mod is not None else ())
    for name, got, want in zip("q k v sinks bias".split(), torch.autograd.grad(out, inputs, g),
                               torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


def test_sinks_in_the_decoding_path():
    lq, lk = [1, 3, 0, 2, 1], [40, 1, 5, 0, 19]
    cu_q, cu_k = offsets(lq), offsets(lk)
    q, k, v = packed_inputs(lq, lk, Hq=4, Hkv=2, dtype=torch.float32)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, 3, 40, window_size=(-1, 0), return_aux=LSE, enable_gqa=True,
                                sinks=sinks)
    ref, ref_lse = with_sinks(*reference(q, k, v, cu_q, cu_k, (-1, 0)), sinks)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_match_float64(case):
    lq, lk, Hq, Hkv, window, which = CASES[case]
    cu_q = offsets(lq)
    cu_k = cu_q if lk is None else offsets(lk)
    q, k, v = (t.requires_grad_() for t in packed_inputs(lq, lk or lq, Hq, Hkv, Dv=8))
    bias = BIAS[:, :Hq].clone().requires_grad_()
    score_mod, mask_mod = mods(which, bias)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk or lq), window_size=window, return_aux=LSE,
                                enable_gqa=Hq != Hkv, score_mod=score_mod, mask_mod=mask_mod)
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, window, score_mod, mask_mod)
    assert out.shape == (sum(lq), Hq, 8) and lse.shape == (sum(lq), Hq)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    assert_lse(lse, ref_lse)
    g = torch.randn_like(out)
    inputs = (q, k, v, bias) if score_mod is not None else (q, k, v)
    grads = torch.autograd.grad(out, inputs, g)
    ref_grads = torch.autograd.grad(ref, inputs, g)
    for name, got, want in zip("q k v bias".split(), grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


def test_tokens_past_the_last_offset_give_zeros():
    cu = offsets([4, 7])
    q, k, v = packed_inputs([4, 7], [4, 7], extra_q=3)
    k, v = k[:11], v[:11]
    out, lse = varlen_attention(q, k, v, cu, cu, 7, 7, return_aux=LSE)
    ref, ref_lse = reference(q, k, v, cu, cu)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    assert_lse(lse, ref_lse)
    assert not out[11:].any()


def test_seqused_k_uses_a_prefix_of_each_sequence_keys():
    lq, lk = [3, 20, 5], [10, 25, 5]
    cu_q, cu_k = offsets(lq), offsets(lk)
    used = torch.tensor([4, 25, 0], dtype=torch.int32)
    q, k, v = (t.requires_grad_() for t in packed_inputs(lq, lk))
    out = varlen_attention(q, k, v, cu_q, cu_k, 20, 25, window_size=(-1, 0), seqused_k=used)
    ref, _ = reference(q, k, v, cu_q, cu_k, (-1, 0), seqused_k=used)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    g = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------------------------------
# Short queries: the decoding kernel over the batched layout


@pytest.mark.parametrize("window, which", [((-1, -1), None), ((-1, 0), "both"), ((4, 0), "score")])
def test_decoding_path_matches_float64(window, which, monkeypatch):
    launches = record_calls(monkeypatch, varlen.call, "attend")
    lq, lk = [1, 3, 0, 2, 1], [40, 1, 5, 0, 19]
    cu_q, cu_k = offsets(lq), offsets(lk)
    q, k, v = packed_inputs(lq, lk, Hq=4, Hkv=2, dtype=torch.float32)
    score_mod, mask_mod = mods(which, BIAS[:5, :4].float())
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, 3, 40, window_size=window, return_aux=LSE, enable_gqa=True,
                                score_mod=score_mod, mask_mod=mask_mod)
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, window, score_mod, mask_mod)
    assert launches[-1][9] is True  # (attend's `decoding`)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    torch.testing.assert_close(lse.double().nan_to_num(neginf=0), ref_lse.nan_to_num(neginf=0), atol=2e-6, rtol=0)


def paged_inputs(lk, page_size=16, n_pages=9, Hkv=2, D=16, seed=1):
    """A page pool, a page table (pages in scrambled order; sequences 0 and 2 share their first
    page, as a common prefix does) and the same keys packed."""
    g = torch.Generator().manual_seed(seed)
    kp = torch.randn(n_pages, page_size, Hkv, D, generator=g)
    vp = torch.randn(n_pages, page_size, Hkv, D, generator=g)
    table = torch.tensor([[4, 1], [7, 0], [4, 8], [2, 3]], dtype=torch.int32)[:len(lk)]
    k = torch.cat([kp[table[b]].flatten(0, 1)[:n] for b, n in enumerate(lk)])
    v = torch.cat([vp[table[b]].flatten(0, 1)[:n] for b, n in enumerate(lk)])
    return kp, vp, table, k, v


@pytest.mark.parametrize("window, which", [((-1, 0), None), ((-1, -1), "both")])
def test_paged_decoding_through_block_table(window, which):
    lq, lk = [2, 1, 3, 1], [20, 0, 31, 9]
    cu_q, cu_k = offsets(lq), offsets(lk)
    q, _, _ = packed_inputs(lq, lk, Hq=2, dtype=torch.float32)
    kp, vp, table, k, v = paged_inputs(lk)
    # (sequence 2's first 16 keys are sequence 0's: the shared page)
    torch.testing.assert_close(k[20:36], k[:16])
    used = torch.tensor(lk, dtype=torch.int32)
    score_mod, mask_mod = mods(which, BIAS[:4, :2].float())
    out, lse = varlen_attention(q, kp, vp, cu_q, None, 3, 31, window_size=window, return_aux=LSE,
                                seqused_k=used, block_table=table, score_mod=score_mod, mask_mod=mask_mod)
    ref, ref_lse = reference(q, k, v, cu_q, cu_k, window, score_mod, mask_mod)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(lse.isinf(), ref_lse.isinf())


def test_paged_form_refuses_gradients():
    lq, lk = [2, 1], [20, 3]
    kp, vp, table, _, _ = paged_inputs(lk)
    q = torch.randn(3, 2, 16, requires_grad=True)
    with pytest.raises(ValueError, match="block_table .* inference-only"):
        varlen_attention(q, kp, vp, offsets(lq), None, 2, 20, seqused_k=torch.tensor(lk, dtype=torch.int32),
                         block_table=table)


# ---------------------------------------------------------------------------------------------
# Tables built from offsets


@pytest.mark.parametrize("lq, lk, window, full_blocks", [
    ([1, 0, 19, 3, 33, 2, 7, 70], None, (-1, 0), True),
    ([1, 0, 19, 3, 33, 2, 7, 70], None, (6, 2), True),
    ([5, 30, 1], [31, 2, 40], (-1, -1), False),
    ([5, 30, 1], [31, 2, 40], (2, 0), True),
])
def test_packed_tables_cover_every_pair_and_only_full_tiles_are_full(lq, lk, window, full_blocks):
    """Tile by tile against the dense mask of the rows' intervals: every tile with a visible
    pair is listed, a full tile is entirely visible, and q_* is the transpose of kv_*."""
    cu_q = offsets(lq)
    cu_k = cu_q if lk is None else offsets(lk)
    T_q, T_k, B = sum(lq), sum(lk or lq), 16
    max_q, max_k = max(lq), max(lk or lq)
    rows = packed.packed_rows(cu_q, cu_k, None, T_q, window)
    nQ, nKV = -(-T_q // B), -(-T_k // B)
    kv_width = min(nKV, -(-(B + 2 * max_q) // B) + 1) if lk is None else nKV
    q_width = min(nQ, -(-(B + 2 * max_k) // B) + 1) if lk is None else nQ
    t = packed.packed_tables(rows, T_q, T_k, B, B, kv_width, q_width, full_blocks)
    kv = torch.arange(T_k)
    dense = (kv >= rows[packed.LO][:, None]) & (kv < rows[packed.HI][:, None])          # [T_q, T_k]
    pad = torch.zeros(nQ * B, nKV * B, dtype=torch.bool)
    pad[:T_q, :T_k] = dense
    tiles = pad.view(nQ, B, nKV, B)
    any_pair, all_pairs = tiles.any((1, 3)), tiles.all((1, 3))
    listed = flags(t["kv_num_blocks"][0, 0], t["kv_indices"][0, 0], nKV)
    full = flags(t["full_kv_num_blocks"][0, 0], t["full_kv_indices"][0, 0], nKV) if full_blocks else \
        torch.zeros_like(listed)
    assert not (listed & full).any()
    assert torch.equal(any_pair & ~(listed | full), torch.zeros_like(listed))
    assert torch.equal(full & ~all_pairs, torch.zeros_like(full))
    if full_blocks and lk is None and window == (-1, 0):
        assert full.sum() >= 3  # (the long sequences' tiles below the diagonal)
    assert torch.equal(flags(t["q_num_blocks"][0, 0], t["q_indices"][0, 0], nQ), listed.t())
    if full_blocks:
        assert torch.equal(flags(t["full_q_num_blocks"][0, 0], t["full_q_indices"][0, 0], nQ), full.t())
    assert (listed | full).sum(1).max() <= kv_width


# ---------------------------------------------------------------------------------------------
# Bad input


def good():
    lq = [3, 5]
    q, k, v = packed_inputs(lq, lq, dtype=torch.float32)
    return dict(query=q, key=k, value=v, cu_seq_q=offsets(lq), cu_seq_k=offsets(lq), max_q=5, max_k=5)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("change, match", [
    (dict(cu_seq_q=i32(1, 3, 8)), r"cu_seq_q must start at 0, got cu_seq_q\[0\] = 1"),
    (dict(cu_seq_k=i32(0, 6, 5, 8)), r"cu_seq_k must be a 1-d int32 tensor of 3 \(N \+ 1, as cu_seq_q\)"),
    (dict(cu_seq_q=i32(0, 6, 5), max_q=8), r"cu_seq_q must be non-decreasing .* cu_seq_q\[1\] = 6 > cu_seq_q\[2\] = 5"),
    (dict(cu_seq_q=i32(0, 3, 9), max_q=8), r"cu_seq_q\[-1\] = 9 is past query's 8 tokens"),
    (dict(cu_seq_k=i32(0, 3, 9), max_k=8), r"cu_seq_k\[-1\] = 9 is past key's 8 tokens"),
    (dict(cu_seq_q=torch.tensor([0, 3, 8])), r"cu_seq_q must be a 1-d int32 tensor .* got a torch.int64 tensor"),
    (dict(cu_seq_k=i32(0, 3, 8).to("meta")), r"cu_seq_k must be a 1-d int32 tensor .* on cpu, got .* on meta"),
    (dict(max_q=4), r"sequence 1 has 5 q tokens, more than max_q=4"),
    (dict(max_k=2), r"sequence 0 has 3 k tokens, more than max_k=2"),
    (dict(max_k=-1), r"max_k must be a non-negative int, got int -1"),
    (dict(seqused_k=i32(4, 1)), r"seqused_k\[0\] = 4 is out of range: expected 0 <= seqused_k <= its cu_seq_k "
                                r"length \(3\)"),
    (dict(window_size=(-2, 0)), r"window_size must be a \(left, right\) pair of ints >= -1"),
    (dict(key=torch.randn(8, 3, 16), value=torch.randn(8, 3, 16)), r"key/value must have H_q \(or pass enable_gqa"),
    (dict(block_table=i32(0, 1).view(2, 1)), r"key must be a \(total_pages, page_size, H_kv, D\) tensor"),
    (dict(return_aux=AuxRequest(lse=True, max_scores=True)), r"return_aux computes lse only"),
])
def test_bad_input_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        varlen_attention(**{**good(), **change})


def test_bad_page_tables_are_named():
    lk = [20, 3]
    kp, vp, table, _, _ = paged_inputs(lk)
    q = torch.randn(3, 2, 16)
    used = i32(*lk)
    with pytest.raises(ValueError, match="block_table needs seqused_k"):
        varlen_attention(q, kp, vp, offsets([2, 1]), None, 2, 20, block_table=table)
    with pytest.raises(ValueError, match=r"block_table\[1\] lists a page outside \[0, 9\)"):
        varlen_attention(q, kp, vp, offsets([2, 1]), None, 2, 20, seqused_k=used, block_table=i32(4, 1, 9, 0).view(2, 2))
    with pytest.raises(ValueError, match=r"block_table\[[01]\] lists a page that another sequence lists at another"):
        varlen_attention(q, kp, vp, offsets([2, 1]), None, 2, 20, seqused_k=i32(20, 20),
                         block_table=i32(4, 1, 1, 0).view(2, 2))


# ---------------------------------------------------------------------------------------------
# The call path


def test_a_repeated_call_is_a_lookup_and_changed_offsets_are_seen(monkeypatch):
    traces = record_calls(monkeypatch, call, "trace")
    layouts = record_calls(monkeypatch, varlen, "_packed_layout")
    modcache.clear()
    call.forget()
    lq = [5, 17]
    cu = offsets(lq)
    q, k, v = (t.requires_grad_() for t in packed_inputs(lq, lq))
    bias = BIAS[:2, :2].clone().requires_grad_()

    def step():
        # (model code makes its mods anew every call)
        return varlen_attention(q, k, v, cu, cu, 17, 17, window_size=(-1, 0),
                                score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[b, h])

    step().sum().backward()
    first = (len(traces), len(layouts))
    step().sum().backward()
    assert (len(traces), len(layouts)) == first == (1, 1)
    cu[1] = 12  # the same tensor, other contents: the tables are made again
    out = step()
    ref, _ = reference(q, k, v, cu, cu, (-1, 0), lambda s, b, h, q_idx, kv_idx: s + bias[b, h])
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-9)
    assert (len(traces), len(layouts)) == (1, 2)


def test_compiled_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    lq = [5, 1, 17]
    cu = offsets(lq)
    bias = BIAS[:3, :2].clone().requires_grad_()

    def attend(q, k, v):
        return varlen_attention(q, k, v, cu, cu, 17, 17, window_size=(-1, 0),
                                score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[b, h],
                                mask_mod=lambda b, h, q_idx, kv_idx: kv_idx != 1)

    compiled = torch.compile(attend, fullgraph=True)
    results = []
    for fn in (attend, compiled):
        q, k, v = (t.requires_grad_() for t in packed_inputs(lq, lq))
        out = fn(q, k, v)
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v, bias))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_under_inference_mode():
    """Offsets and block masks made under torch.inference_mode (no in-place version to key a
    cache by): varlen, flex_attention with a block mask and decoding run, and offsets changed in
    place inside inference mode are read again."""
    import flexattn
    q, k, v = packed_inputs([3, 5], [3, 5], dtype=torch.float32)
    with torch.inference_mode():
        cu = offsets([3, 5])
        got = varlen_attention(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))
        torch.testing.assert_close(got.double(), reference(q, k, v, cu, cu, window=(-1, 0))[0], atol=1e-5, rtol=1e-5)
        cu[1] = 6  # (lengths 6 and 2 now)
        got = varlen_attention(q, k, v, cu, cu, 6, 6, window_size=(-1, 0))
        torch.testing.assert_close(got.double(), reference(q, k, v, cu, cu, window=(-1, 0))[0], atol=1e-5, rtol=1e-5)
        bm = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 40, 40, device="cpu",
                                        BLOCK_SIZE=16)
        x = torch.randn(1, 2, 40, 16)
        for _ in range(2):
            torch.testing.assert_close(flexattn.flex_attention(x, x, x, block_mask=bm).double(),
                                       flexattn.reference.attention_reference(x.double(), x.double(), x.double(),
                                                                              block_mask=bm), atol=1e-5, rtol=1e-5)


def test_calls_where_no_query_sees_a_key_check_their_arguments_and_give_zero_gradients():
    q, k, v = packed_inputs([3, 5], [3, 5], dtype=torch.float32)
    cu = offsets([3, 5])
    with pytest.raises(ValueError, match="more than max_q=0"):
        varlen_attention(q, k, v, cu, cu, 0, 5)
    with pytest.raises(ValueError, match="sinks"):
        varlen_attention(q[:0], k, v, torch.zeros(3, dtype=torch.int32), cu, 0, 5, sinks=torch.zeros(3))
    qg = q.clone().requires_grad_()
    kg, vg = (t[:0].clone().requires_grad_() for t in (k, v))
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    out, lse = varlen_attention(qg, kg, vg, cu, torch.zeros(3, dtype=torch.int32), 5, 0, sinks=sinks, return_aux=LSE)
    assert (out == 0).all() and torch.equal(lse, sinks.detach().expand(8, 2))
    (out.sum() + lse.sum()).backward()
    assert (qg.grad == 0).all() and kg.grad.shape == kg.shape and torch.equal(sinks.grad, torch.full((2,), 8.0))


def test_rows_outside_every_sequence_get_the_sink_as_lse():
    """Tokens past the last offset see no key: LSE sinks[h], with and without gradients."""
    q, k, v = packed_inputs([3], [3], dtype=torch.float32, extra_q=2)
    cu = offsets([3])
    sinks = torch.tensor([0.5, -1.0])
    for grad in (False, True):
        qq = q.clone().requires_grad_(grad)
        _, lse = varlen_attention(qq, k, v, cu, cu, 3, 3, sinks=sinks, return_aux=LSE)
        torch.testing.assert_close(lse[3:], sinks.expand(2, 2))
