"""The call path: a mod is traced once per fingerprint, a repeated call is a lookup and a launch,
flexattn compiles under torch.compile(fullgraph=True), and block masks of new lengths reuse kernels.

Each trace-cache edge is checked against torch's own eager flex_attention (the oracle) and by
counting traces: a cache that missed a change would give the old mod's answer.
"""

import cProfile
import functools
import os
import pstats

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import flexattn
from flexattn import call, modcache
from flexattn.kernels import mask_tiles
from flexattn.reference import attention_reference
from helpers.testing import record_calls

FLEXATTN_DIR = os.path.dirname(flexattn.__file__)
FORCE = {"FORCE_USE_FLEX_ATTENTION": True}


def qkv(B=1, H=2, L=37, E=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, E, generator=g, dtype=dtype) for _ in range(3))


@pytest.fixture
def traces(monkeypatch):
    """The tracer's runs (flexattn.call traces score mods through its `trace`), one entry each."""
    runs = record_calls(monkeypatch, call, "trace")
    modcache.clear()
    call.forget()
    return runs


def check(q, k, v, score_mod, oracle=torch_flex, **kw):
    """flexattn against torch's eager flex_attention with the same Python mod."""
    out = flexattn.flex_attention(q, k, v, score_mod=score_mod, kernel_options=FORCE, **kw)
    ref = oracle(q.double(), k.double(), v.double(), score_mod=score_mod, **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    return out


# ---------------------------------------------------------------------------------------------
# What a repeated call costs on the host


def _flexattn_calls(fn) -> dict:
    profile = cProfile.Profile()
    profile.enable()
    fn()
    profile.disable()
    return {k: v for k, v in pstats.Stats(profile).stats.items() if k[0].startswith(FLEXATTN_DIR)}


@pytest.mark.parametrize("case, limit", [("forward", 40), ("decoding", 40), ("forward+backward", 80)])
def test_repeated_call_is_a_lookup_and_a_launch(case, limit):
    """Model code builds its score_mod anew every call: no tracing after the first, and at most
    ``limit`` calls of flexattn's Python functions per call (cProfile)."""
    q, k, v = qkv(L=40 if case != "decoding" else 1)
    k, v = qkv(L=64)[1:]
    bias = torch.randn(2, 64)
    grad = case == "forward+backward"
    for t in (q, k, v, bias):
        t.requires_grad_(grad)

    def step():
        scale = 0.5
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * scale + bias[h, ki],
                                      kernel_options=FORCE if case == "forward" else None)
        if grad:
            out.sum().backward()

    step()
    step()
    calls = _flexattn_calls(step)
    assert not [f for f in calls if f[0].endswith("tracer.py")], "a repeated call ran the tracer"
    n_calls = sum(v[1] for v in calls.values())
    assert n_calls <= limit, sorted((v[1], f[2]) for f, v in calls.items())


# ---------------------------------------------------------------------------------------------
# The trace cache's key: everything that changes the result, and nothing else

SCALE = 1.5  # a module-level global read by a mod


def scaled(score, b, h, q_idx, kv_idx):
    return score * SCALE


def test_fresh_lambda_of_the_same_code_is_traced_once(traces):
    q, k, v = qkv()
    bias = torch.randn(37)
    for i in range(3):
        bias.add_(1.0)  # values are arguments, not constants: the same kernel serves them all
        check(q, k, v, lambda s, b, h, qi, ki: s + bias[ki])
    assert len(traces) == 1


def test_closure_float_that_changed_value(traces):
    q, k, v = qkv()
    for cap in (5.0, 0.5, 5.0):
        check(q, k, v, lambda s, b, h, qi, ki: cap * torch.tanh(s / cap))
    assert len(traces) == 2  # 5.0 and 0.5; 5.0 again is a hit


def test_captured_tensor_of_another_shape_dtype_or_device(traces):
    q, k, v = qkv()
    for table in (torch.randn(37), torch.randn(2, 37), torch.randn(37, dtype=torch.float64)):
        if table.dim() == 1:
            check(q, k, v, lambda s, b, h, qi, ki: s + table[ki])
        else:
            check(q, k, v, lambda s, b, h, qi, ki: s + table[h, ki])
    assert len(traces) == 3
    on_cpu = torch.randn(4)
    on_meta = torch.empty(4, device="meta")
    key_cpu = modcache.fingerprint(lambda s, b, h, qi, ki: s + on_cpu[h])[0]
    key_meta = modcache.fingerprint(lambda s, b, h, qi, ki: s + on_meta[h])[0]
    assert key_cpu != key_meta  # a captured tensor's device is part of the key


def test_module_global_the_mod_reads(traces):
    global SCALE
    q, k, v = qkv()
    try:
        for value in (1.5, 3.0):
            SCALE = value
            check(q, k, v, scaled)
    finally:
        SCALE = 1.5
    assert len(traces) == 2


def test_nested_mods_and_helpers(traces):
    q, k, v = qkv()
    table = torch.randn(2)

    def make_inner(offset):
        def inner(score, b, h, q_idx, kv_idx):
            return score + table[h] + offset
        return inner

    for offset in (1.0, 2.0):
        inner = make_inner(offset)
        check(q, k, v, lambda s, b, h, qi, ki: inner(s, b, h, qi, ki) * 2)
    dsl_inner = flexattn.score_mod("score * 3")
    check(q, k, v, lambda s, b, h, qi, ki: dsl_inner(s, b, h, qi, ki) - 1)
    assert len(traces) == 3


def test_functools_partial(traces):
    q, k, v = qkv()

    def biased(score, b, h, q_idx, kv_idx, amount):
        return score + amount * (q_idx - kv_idx)

    # torch's eager flex_attention cannot run a partial with a float keyword (its fake-tensor pass
    # rejects the SymFloat): flexattn's float64 reference is the oracle here.
    for amount in (0.1, -0.2, 0.1):
        check(q, k, v, functools.partial(biased, amount=amount), oracle=attention_reference)
    assert len(traces) == 2


def test_bound_methods_see_their_object(traces):
    q, k, v = qkv()

    class Layer(torch.nn.Module):
        def __init__(self, slope):
            super().__init__()
            self.slope = slope
            self.table = torch.nn.Parameter(torch.randn(2))

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score - self.slope * (q_idx - kv_idx).abs() + self.table[h]

    a, b_ = Layer(0.1), Layer(0.1)
    ref = attention_reference  # torch's eager flex_attention fails on a float read from an object
    check(q, k, v, a.score_mod, oracle=ref)
    check(q, k, v, b_.score_mod, oracle=ref)  # same code and constants, another Parameter: rebound only
    a.slope = 0.3
    check(q, k, v, a.score_mod, oracle=ref)
    assert len(traces) == 2


def test_mod_objects_and_dsl_text(traces):
    q, k, v = qkv()
    for text in ("score * 2", "score - q_idx * 0.1"):
        check(q, k, v, flexattn.score_mod(text))
    bias = torch.randn(37)
    check(q, k, v, flexattn.score_mod("score + bias[kv_idx]", bias=bias))
    assert len(traces) == 0  # Mods are their own templates


def test_aliasing_decides_the_buffers(traces):
    q, k, v = qkv()
    t, u = torch.randn(37), torch.randn(37)
    for x, y in ((t, t), (t, u)):
        check(q, k, v, lambda s, b, h, qi, ki: s + x[ki] * y[qi])
    assert len(traces) == 2


def test_captured_tensor_of_other_strides(traces):
    """Same shape and dtype, other strides: kernels are specialised on a captured tensor's
    strides, so each layout is a key of its own (and both are right)."""
    q, k, v = qkv()
    base = torch.randn(37, 2)
    for table in (base.t().contiguous(), base.t(), base.t().contiguous()):
        check(q, k, v, lambda s, b, h, qi, ki: s + table[h, ki])
    assert len(traces) == 2


def test_alignment_is_part_of_the_key(monkeypatch):
    """The same shapes and strides 4 bytes off a 16-byte boundary make a plan of their own (the
    Hopper kernels' TMA descriptors need aligned bases; Triton specialises on alignment too)."""
    plans_made = record_calls(monkeypatch, call.plans, "forward_plan")
    call.forget()
    q, k, v = qkv()
    shifted = [torch.cat([torch.zeros(1), t.flatten()])[1:].view(q.shape) for t in (q, k, v)]
    assert all(t.data_ptr() % 16 == 4 for t in shifted) and shifted[0].stride() == q.stride()
    for inputs in ((q, k, v), shifted, (q, k, v), shifted):
        check(*inputs, None)
    assert len(plans_made) == 2


def test_a_known_call_that_comes_to_need_gradients(traces):
    """One call key met first without gradients (a short query: the decoding kernel), then with a
    captured tensor that requires grad: the second call records the backward, and its gradients
    match torch's."""
    q = qkv(L=5)[0]
    k, v = qkv(L=37, seed=1)[1:]
    bias = torch.randn(2, 37)

    def call_it(q, k, v, bias):
        return flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h, ki])

    with torch.no_grad():
        first = call_it(q, k, v, bias)
    bias.requires_grad_(True)
    out = call_it(q, k, v, bias)
    assert out.requires_grad and not first.requires_grad
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weights).sum().backward()
    bias64 = bias.detach().double().requires_grad_(True)
    ref = torch_flex(q.double(), k.double(), v.double(), score_mod=lambda s, b, h, qi, ki: s + bias64[h, ki])
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(first.double(), ref.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(bias.grad.double(), bias64.grad, atol=2e-5, rtol=2e-5)
    assert len(traces) == 1  # one fingerprint; the gradient need picks the plan


@pytest.mark.parametrize("which", ["key", "value"])
def test_a_known_call_is_checked_again_when_an_input_changes_dtype(which):
    """The call key holds every input's dtype: after a valid call, the same shapes with K or V
    of another dtype miss it and are refused (a hit skips validation and runs the known plan)."""
    q, k, v = qkv()
    mod = lambda s, b, h, qi, ki: s * 0.5  # noqa: E731
    check(q, k, v, mod)
    inputs = {"key": k, "value": v}
    inputs[which] = inputs[which].to(torch.bfloat16)
    with pytest.raises(TypeError, match=f"{which} must have query's dtype torch.float32, got torch.bfloat16"):
        flexattn.flex_attention(q, inputs["key"], inputs["value"], score_mod=mod, kernel_options=FORCE)


def test_a_backward_that_comes_to_need_a_captured_tensors_gradient():
    """The same call twice with gradients, the captured table requiring grad only the second time:
    the backward plan is keyed by which gradients it computes, so the second one gives the
    table's gradient (a reused plan of the first left it None)."""
    q, k, v = (t.requires_grad_() for t in qkv(seed=3))
    bias = torch.randn(2, 37)
    weights = torch.linspace(-1, 1, 37 * 16).view(1, 1, 37, 16)
    for bias_grad in (False, True):
        bias.requires_grad_(bias_grad)
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h, ki], kernel_options=FORCE)
        (out * weights).sum().backward()
    bias64 = bias.detach().double().requires_grad_()
    ref = attention_reference(q.detach().double(), k.detach().double(), v.detach().double(),
                              score_mod=lambda s, b, h, qi, ki: s + bias64[h, ki])
    (ref * weights.double()).sum().backward()
    assert bias.grad is not None
    torch.testing.assert_close(bias.grad.double(), bias64.grad, atol=2e-5, rtol=2e-5)


def test_a_backward_that_comes_to_read_the_lse_gradient():
    """The same call twice, its LSE in the loss only the second time: the backward plan is keyed
    by whether an LSE gradient comes, so the second backward adds its part (a reused plan of the
    first dropped it), then the first kind again."""
    q, k, v = qkv(seed=4)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    mod = lambda s, b, h, qi, ki: s * 0.7  # noqa: E731
    for use_lse in (False, True, False):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flexattn.flex_attention(*inputs, score_mod=mod, return_lse=True, kernel_options=FORCE)
        want, want_lse = attention_reference(*ref_in, score_mod=mod, return_lse=True)
        loss, want_loss = out.sum(), want.sum()
        if use_lse:
            loss, want_loss = loss + (lse * lse).sum(), want_loss + (want_lse * want_lse).sum()
        loss.backward()
        want_grads = torch.autograd.grad(want_loss, ref_in)
        for t, w in zip(inputs, want_grads):
            torch.testing.assert_close(t.grad.double(), w, atol=2e-5, rtol=2e-5, msg=f"use_lse={use_lse}")


def test_block_masks_of_one_mask_mod_with_other_tables_are_keys_of_their_own():
    """One mask mod, block masks of other block sizes or without separate full blocks: each call
    runs a plan for its own tables (the call key holds their layout), and each is right."""
    q, k, v = qkv(L=70, seed=5)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)

    made = [(block, full) for block in (16, 32, 16) for full in (True, False)]
    for block, full in made:
        bm = flexattn.create_block_mask(window, None, None, 70, 70, device="cpu", BLOCK_SIZE=block,
                                        separate_full_blocks=full)
        out = flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options=FORCE)
        ref = attention_reference(q.double(), k.double(), v.double(), mask_mod=window)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5, msg=f"BLOCK_SIZE={block}, full={full}")


def test_a_mod_that_makes_its_own_tensors_is_traced_every_call(traces):
    q, k, v = qkv()
    for _ in range(2):
        check(q, k, v, lambda s, b, h, qi, ki: s + torch.arange(37, dtype=torch.float32)[ki] * 0.01)
    assert len(traces) == 2  # correct, only slower


# ---------------------------------------------------------------------------------------------
# torch.compile


class RelativeBias(torch.nn.Module):
    """What model code does: a score_mod lambda over an nn.Parameter, built in every forward."""

    def __init__(self, heads=2, span=64):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(heads, span) * 0.1)
        self.span = span

    def forward(self, q, k, v, block_mask=None):
        table = self.table
        return flexattn.flex_attention(
            q, k, v, block_mask=block_mask,
            score_mod=lambda s, b, h, qi, ki: s + table[h, (qi - ki).abs().clamp(max=self.span - 1)])


def _grads(model, q, k, v, **kw):
    for t in (q, k, v, model.table):
        t.grad = None
    out = model(q, k, v, **kw)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out, [t.grad.clone() for t in (q, k, v, model.table)]


def test_compiled_model_fullgraph_forward_backward_no_recompile():
    torch._dynamo.reset()
    model = RelativeBias()
    compiled = torch.compile(model, fullgraph=True)
    q, k, v = (t.requires_grad_() for t in qkv(L=45))
    ref, ref_grads = _grads(model, q, k, v)
    out, grads = _grads(compiled, q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)
    with torch._dynamo.config.patch(error_on_recompile=True):
        with torch.no_grad():
            model.table.mul_(-2.0)  # new parameter values
        q2, k2, v2 = (t.requires_grad_() for t in qkv(L=45, seed=1))  # new activations
        out2, grads2 = _grads(compiled, q2, k2, v2)
    ref2, ref_grads2 = _grads(model, q2, k2, v2)
    torch.testing.assert_close(out2, ref2, atol=1e-6, rtol=1e-6)
    for g, r in zip(grads2, ref_grads2):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_create_block_mask_then_attention(backend):
    """create_block_mask and flex_attention in one fullgraph graph; new document ids (a block
    mask of the same lengths) do not recompile. The triton backend (the GPU's) writes a table's
    counts and indices into one buffer, which the op's outputs may not share."""
    torch._dynamo.reset()

    def attend(q, k, v, doc):
        mask = flexattn.create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None,
                                          q.shape[2], k.shape[2], device="cpu", BLOCK_SIZE=16, backend=backend)
        return flexattn.flex_attention(q, k, v, block_mask=mask)

    compiled = torch.compile(attend, fullgraph=True)
    q, k, v = qkv(L=50)
    for i, div in enumerate((17, 9)):
        doc = (torch.arange(50) // div).int()
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(q, k, v, doc)
        ref = torch_flex(q.double(), k.double(), v.double(),
                         score_mod=lambda s, b, h, qi, ki: torch.where((doc[qi] == doc[ki]) & (qi >= ki), s, -torch.inf))
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_compiled_attention_over_lengths_that_change(dynamic):
    """A block mask built inside the graph for the inputs' lengths, which change from call to call
    (at the second length torch.compile makes them symbols by default): forward and backward
    against the float64 reference at each length (the mask's lengths are arguments of the ops,
    not part of their constant spec)."""
    torch._dynamo.reset()

    def attend(q, k, v):
        mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[2], k.shape[2],
                                          device="cpu", BLOCK_SIZE=16)
        return flexattn.flex_attention(q, k, v, block_mask=mask, score_mod=lambda s, b, h, qi, ki: s + 0.01 * (qi - ki))

    compiled = torch.compile(attend, fullgraph=True, dynamic=dynamic)
    for L in (32, 45, 75):
        q, k, v = (t.requires_grad_() for t in qkv(L=L, seed=L))
        out = compiled(q, k, v)
        out.sum().backward()
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*ref_in, block_mask=flexattn.create_block_mask(
            lambda b, h, qi, ki: qi >= ki, None, None, L, L, device="cpu", BLOCK_SIZE=16),
            score_mod=lambda s, b, h, qi, ki: s + 0.01 * (qi - ki))
        ref.sum().backward()
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        for t, r in zip((q, k, v), ref_in):
            torch.testing.assert_close(t.grad.double(), r.grad, atol=1e-5, rtol=1e-5)


def test_compiled_model_with_a_block_mask_made_outside():
    torch._dynamo.reset()
    model = RelativeBias()
    compiled = torch.compile(model, fullgraph=True)
    q, k, v = qkv(L=45)
    for i, div in enumerate((8, 20)):  # same lengths and mod, other document ids: the same graph
        doc = (torch.arange(45) // div).int()
        mask = flexattn.create_block_mask(lambda b, h, qi, ki: doc[qi] == doc[ki], None, None, 45, 45,
                                          device="cpu", BLOCK_SIZE=16)
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(q, k, v, block_mask=mask)
        torch.testing.assert_close(out, model(q, k, v, block_mask=mask), atol=1e-6, rtol=1e-6)


def test_compiled_mod_over_a_python_float_that_changes():
    """A float the mod reads that changes between compiled calls is made a symbol by Dynamo at the
    second value; the recording turns it back into a constant (guarded on), so each value runs
    fullgraph and gives its own result (it was an Unsupported error at the second value)."""
    torch._dynamo.reset()
    q, k, v = qkv()

    def make(t):
        return lambda s, b, h, qi, ki: s * t + 0.01 * (qi - ki)

    compiled = torch.compile(lambda q, k, v, mod: flexattn.flex_attention(q, k, v, score_mod=mod), fullgraph=True)
    for t in (2.0, 3.0, 0.5):
        mod = make(t)
        torch.testing.assert_close(compiled(q, k, v, mod).double(), attention_reference(q, k, v, score_mod=mod),
                                   atol=1e-5, rtol=1e-5)


def test_compiled_float64_mod_reads_the_score_dtype():
    """The score a compiled Python mod is recorded with has the score's dtype (float64 for float64
    inputs), as eagerly: ``score.dtype`` in the mod is not float32 (which rounded its constants)."""
    torch._dynamo.reset()
    q, k, v = qkv(dtype=torch.float64)

    def mod(s, b, h, qi, ki):
        return s * torch.full((), 1 / 3, dtype=s.dtype) + (qi - ki).to(s.dtype) * 0.1

    compiled = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=mod), fullgraph=True)
    want = attention_reference(q, k, v, score_mod=mod)
    torch.testing.assert_close(flexattn.flex_attention(q, k, v, score_mod=mod), want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(compiled(q, k, v), want, atol=1e-12, rtol=1e-12)


def test_compiled_dsl_mod_with_float64_inputs_is_retyped():
    """A DSL score mod (float32 score) with float64 inputs runs as its float64 copy under
    torch.compile, as eagerly (it ran in float32: errors of 1e-7), captured tensors included."""
    torch._dynamo.reset()
    q, k, v = qkv(dtype=torch.float64)
    slope = torch.tensor([0.3, -0.2], dtype=torch.float64)
    mod = flexattn.score_mod("score / 3.0 - slope[h] * abs(q_idx - kv_idx)", slope=slope)
    compiled = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=mod), fullgraph=True)
    want = attention_reference(q, k, v, score_mod=lambda s, b, h, qi, ki: s / 3.0 - slope[h] * (qi - ki).abs())
    torch.testing.assert_close(flexattn.flex_attention(q, k, v, score_mod=mod), want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(compiled(q, k, v), want, atol=1e-12, rtol=1e-12)


def test_compiled_call_checks_the_scale():
    """scale=True is refused under torch.compile as eagerly (it ran as scale 1.0)."""
    torch._dynamo.reset()
    q, k, v = qkv()
    compiled = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, scale=True), fullgraph=True)
    with pytest.raises(Exception, match="scale must be a float or None, got True"):
        compiled(q, k, v)


def test_compiled_max_scores_are_not_differentiable():
    """max_scores has no gradient under torch.compile either (as eagerly and in torch): it does not
    require grad, rather than giving a loss built on it a silent zero gradient."""
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in qkv())

    def run(q, k, v):
        out, aux = flexattn.flex_attention(q, k, v, return_aux=flexattn.AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    for fn in (run, torch.compile(run, fullgraph=True)):
        out, lse, mx = fn(q, k, v)
        assert out.requires_grad and lse.requires_grad and not mx.requires_grad


def test_backward_op_fake_strides_of_a_transposed_captured_tensor():
    """The backward op's gradient of a captured tensor has the layout its fake kernel says
    (contiguous), also for a transposed tensor (Inductor asserts the fake strides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flexattn import capture, ops

    q, k, v = (t.requires_grad_() for t in qkv())
    bias = torch.randn(37, 2).t()  # [H, KV], strides (1, 2)
    key, bufs = capture.capture(lambda s, b, h, qi, ki: s + bias[h, ki], "score", torch.float32)
    spec = ops.spec(key, call.noop_mask_mod().key(), (), False, (), False)
    out, lse, _ = torch.ops.flexattn.forward(q, k, v, None, bufs, [], [], -1, -1, spec, 0.25)
    args = (q, k, v, out, lse, torch.randn_like(out))
    real = torch.ops.flexattn.backward(*args, None, None, bufs, [], [], -1, -1, spec, 0.25, [True])
    with FakeTensorMode() as mode:
        fake = torch.ops.flexattn.backward(*(mode.from_tensor(t) for t in args), None, None,
                                           [mode.from_tensor(b) for b in bufs], [], [], -1, -1, spec, 0.25, [True])
    for r, f in zip([*real[:4], *real[4]], [*fake[:4], *fake[4]]):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def _real_and_fake(op, *args):
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    return real, fake


def _same_layouts(real, fake, what):
    for i, (r, f) in enumerate(zip(real, fake, strict=True)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype), f"{what}: output {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "heads inside"])
def test_fake_kernels_give_the_real_outputs_layouts(dtype, layout):
    """Each op's fake kernel says the shapes, strides and dtypes its real outputs have (Inductor
    plans buffers and asserts strides from them): Q, K, V as model code passes them ([B, S, H, E]
    transposed), Ev != E, the float64 statistics, max_scores present or empty."""
    from flexattn import capture, ops

    g = torch.Generator().manual_seed(0)

    def make(L, E):
        if layout == "contiguous":
            return torch.randn(1, 2, L, E, generator=g, dtype=dtype)
        return torch.randn(1, L, 2, E, generator=g, dtype=dtype).transpose(1, 2)

    k, v = make(45, 16), make(45, 8)
    key, bufs = capture.capture(lambda s, b, h, qi, ki: s + 0.1 * h, "score", dtype)
    specs = {want_max: ops.spec(key, call.noop_mask_mod().key(), (), False, (), want_max) for want_max in (False, True)}
    q = make(37, 16)
    for want_max, spec in specs.items():
        real, fake = _real_and_fake(torch.ops.flexattn.forward, q, k, v, None, bufs, [], [], -1, -1, spec, 0.25)
        _same_layouts(real, fake, f"forward, want_max={want_max}")
    out, lse, _ = real
    grad_out = make(37, 8)
    real, fake = _real_and_fake(torch.ops.flexattn.backward, q, k, v, out, lse, grad_out, None, None, bufs, [], [],
                                -1, -1, specs[True], 0.25, [])
    _same_layouts(real[:4], fake[:4], "backward")
    if dtype != torch.float64:  # (the decoding kernel takes no float64)
        real, fake = _real_and_fake(torch.ops.flexattn.decode, make(3, 16), k, v, None, bufs, [], [], -1, -1, None,
                                    specs[False], 0.25)
        _same_layouts(real, fake, "decode")


# ---------------------------------------------------------------------------------------------
# Block masks of new lengths


def test_block_masks_of_new_lengths_reuse_kernels():
    """On the GPU the block-mask kernels' constexprs do not depend on the lengths (and the lengths
    are not specialised on), so a new length compiles nothing; one module serves every length."""
    assert len({mask_tiles.chunks(n, n, interpret=False) for n in (1, 7, 64, 1000, 8192)}) == 1
    mask = flexattn.mask_mod("(q_idx >= kv_idx) & (q_idx - kv_idx < 40)")
    flexattn.create_block_mask(mask, None, None, 100, 100, device="cpu", BLOCK_SIZE=16, backend="triton")
    modules = dict(mask_tiles._MODULES)
    for n in (37, 130, 257):
        bm = flexattn.create_block_mask(mask, None, None, n, n, device="cpu", BLOCK_SIZE=16, backend="triton")
        dense = flexattn.create_mask(mask, 1, 1, n, n, device="cpu")[0, 0]
        nb = -(-n // 16)
        padded = torch.zeros(nb * 16, nb * 16, dtype=torch.bool)
        padded[:n, :n] = dense
        visited = padded.view(nb, 16, nb, 16).any(3).any(1).sum(1)  # tiles each query block must see
        assert torch.equal((bm.kv_num_blocks + bm.full_kv_num_blocks)[0, 0], visited.int())
    assert dict(mask_tiles._MODULES) == modules
    source = next(iter(modules.values())).__file__
    with open(source) as f:
        text = f.read()
    assert 'do_not_specialize=[' in text and '"Q_LEN", "KV_LEN"' in text


def test_the_trace_cache_holds_no_captured_tensor():
    """A cached template keeps shape-only stand-ins, and a known call the template: a captured
    tensor dies with its last user."""
    import gc
    import weakref

    q, k, v = qkv()
    modcache.clear()
    call.forget()

    def call_once():
        table = torch.randn(37)
        flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[ki], kernel_options=FORCE)
        return weakref.ref(table)

    ref = call_once()
    gc.collect()
    assert ref() is None
    assert len(modcache._CACHE) == 1


# ---------------------------------------------------------------------------------------------
# The direct launch's argument lists (the static launcher is GPU-only; its lists are not)


def test_static_launch_arguments_from_fixed_and_per_call_ones():
    """With fixed arguments a call fills only its slots: pointers as integers, UNUSED as 0, a
    tensor off 16-byte alignment refuses (Triton's path then specialises on it)."""
    from flexattn.kernels import arguments, launch, triton_launcher

    t, other = torch.zeros(8), torch.zeros(8)
    off = torch.zeros(8)[1:]  # 4 bytes past an aligned start
    fill = triton_launcher.fill_slots([0, 5, 0, 7, None], ((0, True), (2, True), (3, False)))
    assert fill((t, arguments.UNUSED, 2.5)) == (t.data_ptr(), 5, 0, 2.5, None)
    assert fill((other, t, -1.0)) == (other.data_ptr(), 5, t.data_ptr(), -1.0, None)
    assert fill((off, t, 1.0)) is None and fill((t, off, 1.0)) is None
    site = launch.Launch(None, (1,), {}, t.device, fixed=(arguments.PER_CALL, 3, arguments.PER_CALL))
    assert site._full((t, 2.0)) == (t, 3, 2.0)
    with pytest.raises(TypeError, match="takes 2 per-call arguments, got 1"):
        site._full((t,))
    every = triton_launcher.fill_all([0, 2, 3], {0, 2}, (None,))  # argument 1 was specialised away
    assert every((t, 99, arguments.UNUSED, 4)) == (t.data_ptr(), 0, 4, None)
    assert every((off, 99, t, 4)) is None


def test_a_kernel_out_of_shared_memory_compiles_again_with_fewer_stages():
    """The first launch of a kernel whose shared memory passes the limit retries with one
    pipelining stage fewer, down to one (then the error stands); other resources are not retried.
    The launch keeps the stages that fit."""
    from triton.runtime.errors import OutOfResources

    from flexattn.kernels import launch

    class Kernel:
        def __init__(self, fits_at, resource="shared memory"):
            self.fits_at, self.resource, self.tried = fits_at, resource, []

        def __getitem__(self, grid):
            def run(*args, num_stages=None, **constexprs):
                self.tried.append(num_stages)
                if num_stages > self.fits_at:
                    raise OutOfResources(1000 * num_stages, 1000 * self.fits_at, self.resource)
            return run

    t = torch.zeros(4)
    kernel = Kernel(fits_at=2)
    site = launch.Launch(kernel, (1,), {"num_stages": 4, "BLOCK": 16}, t.device)
    site(t)
    site(t)
    assert kernel.tried == [4, 3, 2, 2] and site.constexprs == {"enable_fp_fusion": True, "num_stages": 2, "BLOCK": 16}
    for kernel in (Kernel(fits_at=0), Kernel(fits_at=1, resource="registers")):
        with pytest.raises(OutOfResources):
            launch.Launch(kernel, (1,), {"num_stages": 3}, t.device)(t)
    assert kernel.tried == [3]


class PyCUtensorMap:
    """Stands for Triton's encoded TMA descriptor (its launcher's type of that name)."""

    def __init__(self, ptr):
        self.ptr = ptr


def _fake_launcher_wrapper(raw, metas, encoded: list):
    """A launcher wrapper laid out as triton 3.6's (`wrap_handle_tensordesc`): it expands each
    descriptor argument into its map, shape and strides and calls the C function ``raw`` after
    the fixed launch arguments; its encoder records what it encoded in ``encoded``."""
    import types

    def make_tensordesc_arg(desc, meta):
        encoded.append(desc.base.data_ptr())
        return [PyCUtensorMap(desc.base.data_ptr()), *desc.shape, *desc.strides]

    def closure():
        launcher, tensordesc_meta = raw, metas

        def inner(*args):
            out, k = list(args[:13]), 0
            for a in args[13:]:
                if hasattr(a, "base"):
                    out += make_tensordesc_arg(a, tensordesc_meta[k])
                    k += 1
                else:
                    out.append(a)
            return launcher(*out)
        return inner

    inner = closure()
    return types.FunctionType(inner.__code__, {"make_tensordesc_arg": make_tensordesc_arg, "list": list,
                                               "hasattr": hasattr}, "inner", None, inner.__closure__)


def test_tensor_map_launch_keeps_a_map_per_address_and_refuses_what_it_cannot_launch():
    """The Hopper kernels' direct launch (`TensorMapLaunch`; the C launcher needs a GPU, its
    argument lists do not): a call's tensors land as addresses, its numbers in place, each
    descriptor's map is encoded once per address (a call passes the tensors, described only for a
    new address); a misaligned tensor, a descriptor's tensor of other strides, or a recorded layout
    it does not know launch nothing."""
    from types import SimpleNamespace

    from flexattn.kernels import triton_launcher

    def desc(t):
        return SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), padding="zero")

    kinds = {"Q": "tensordesc<bf16[1,1,64,16]>", "LSE": "*fp32", "N": "i32", "SCALE": "fp32",
             "O": "tensordesc<bf16[1,1,32,16]>", "BLOCK": "constexpr"}
    compiled = SimpleNamespace(metadata=SimpleNamespace(tensordesc_meta=[{"swizzle": 3}] * 2),
                               src=SimpleNamespace(signature=kinds))
    calls, encoded = [], []
    wrapper = _fake_launcher_wrapper(lambda *a: calls.append(a), [{"swizzle": 3}] * 2, encoded)
    q, o, lse = torch.zeros(2, 2, 64, 16), torch.zeros(2, 2, 64, 16), torch.zeros(2, 2, 64)
    args = (desc(q), lse, 64, 0.25, desc(o))
    fixed = (2, 1, 1, 7, "function", False, False, None, None, (4, 1, 0), None, None, None)
    wrapper(*fixed, *args, 128)  # Triton's launch, as recorded
    recorded = calls.pop()
    assert encoded == [q.data_ptr(), o.data_ptr()]
    described = []

    def describe(tensors):
        described.append(tensors)
        return tuple(desc(t) if i in (0, 4) else t for i, t in enumerate(tensors))

    tensors = (q, lse, 64, 0.25, o)
    site = triton_launcher.TensorMapLaunch.plan(compiled, wrapper, lambda *a: calls.append(a), recorded, (*args, 128), 5,
                                       None, (2, 1, 1), 7, tensors, describe)
    assert site is not None
    # (nothing of the recorded call's tensors is kept: a plan lives as long as its cache entry)
    assert not any(isinstance(a, torch.Tensor) for a in site.template)

    q2, lse2 = torch.zeros(2, 2, 64, 16), torch.zeros(2, 2, 64)
    for step, (qq, ll, scale) in enumerate([(q, lse2, 0.5), (q2, lse, 0.125), (q2, lse2, 1.0)]):
        assert site((qq, ll, 64, scale, o), stream=99)
        got = calls.pop()
        assert got[:13] == (2, 1, 1, 99, *fixed[4:])
        tensor_map, *dims = got[13:22]
        assert tensor_map.ptr == qq.data_ptr() and dims == [2, 2, 64, 16, 2048, 1024, 16, 1]
        assert got[22:25] == (ll.data_ptr(), 64, scale) and got[25].ptr == o.data_ptr() and got[-1] == 128
    # (the plan re-encoded the recorded two once; then only q2's address was new)
    assert encoded == [q.data_ptr(), o.data_ptr(), q.data_ptr(), o.data_ptr(), q2.data_ptr()]
    assert len(described) == 1 and described[0][0] is q2

    misaligned = torch.zeros(2 * 2 * 64 + 1)[1:].view(2, 2, 64)
    assert not site((q, misaligned, 64, 0.5, o), stream=99)
    assert not site((q.transpose(2, 3).contiguous().transpose(2, 3), lse, 64, 0.5, o), stream=99)
    assert not calls

    # a launcher passing the kernel's arguments in one trailing tuple (newer Triton): not taken
    nested = (*recorded[:13], tuple(recorded[13:]))
    assert triton_launcher.TensorMapLaunch.plan(compiled, wrapper, print, nested, (*args, 128), 5, None, (2, 1, 1), 7,
                                                tensors, describe) is None
    # calls that pass descriptors themselves (no ``describe``): not taken
    assert triton_launcher.TensorMapLaunch.plan(compiled, wrapper, print, recorded, (*args, 128), 5, None, (2, 1, 1), 7,
                                                None, None) is None


@pytest.mark.parametrize("layout", ["contiguous", "heads inside", "Ev differs", "other dtype"])
def test_outputs_from_empty_like_only_where_it_gives_the_same_tensor(layout):
    from flexattn.kernels import launch, layout as layouts

    q = torch.randn(2, 3, 5, 8)
    shape, dtype = (2, 3, 5, 8), q.dtype
    if layout == "heads inside":
        q = torch.randn(2, 5, 3, 8).transpose(1, 2)
    elif layout == "Ev differs":
        shape = (2, 3, 5, 16)
    elif layout == "other dtype":
        dtype = torch.bfloat16
    order = layouts.contiguous_or_order(q)
    expected = launch.empty(shape, dtype, q.device, order)
    same = layouts.empty_like_gives(q, shape, dtype, order)
    assert same == (layout in ("contiguous", "heads inside"))
    if same:
        made = launch.empty(shape, dtype, q.device, order, like=q)
        assert made.shape == expected.shape and made.stride() == expected.stride() and made.dtype == dtype


@pytest.mark.parametrize("separate_full", [True, False])
def test_a_masks_launch_tables_and_the_ops_spec_agree(separate_full):
    """The ops' spec names a block mask by its ``block`` part and its tables (`call._compiled_tables`);
    `ops.block_of` gives that part from a mask's launch tables (the ring's steps call the backward's
    work with them), and reading it back gives the same launch tables."""
    from flexattn import ops
    from flexattn.kernels.tables import tables_of

    bm = flexattn.create_block_mask(lambda b, h, q, k: q >= k, 1, 2, 200, 170, device="cpu", BLOCK_SIZE=32,
                                    separate_full_blocks=separate_full)
    t = tables_of(bm)
    block, tensors, seq = call._compiled_tables(bm)
    assert ops.block_of(t) == block
    assert ops._tables(block, tensors, *seq).sig == t.sig


def test_decode_attention_with_gradients_says_what_to_do():
    # decode_attention takes no BACKEND: the error used to tell the caller to pass BACKEND='AUTO'
    q = torch.randn(1, 2, 3, 16, requires_grad=True)
    k = torch.randn(1, 2, 30, 16)
    with pytest.raises(ValueError, match="decode_attention computes no gradients.*torch.no_grad"):
        flexattn.decode.decode_attention(q, k, k)
    with pytest.raises(ValueError, match="BACKEND='TRITON_DECODE'"):
        flexattn.flex_attention(q, k, k, kernel_options={"BACKEND": "TRITON_DECODE"})


def test_nested_and_sparse_inputs_are_named():
    # (a jagged tensor's length reached the kernel choice before validation: "ge: relation is
    # indeterminate"; a sparse tensor's data pointer: "Cannot access data pointer")
    nested = torch.nested.nested_tensor([torch.randn(2, 5, 16), torch.randn(2, 7, 16)], layout=torch.jagged)
    with pytest.raises(ValueError, match="query is a nested"):
        flexattn.flex_attention(nested, nested, nested)
    sparse = torch.randn(1, 2, 5, 16).to_sparse()
    with pytest.raises(ValueError, match="query must be a dense"):
        flexattn.flex_attention(sparse, sparse, sparse)
    dense = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="value must be a dense"):
        flexattn.flex_attention(dense, dense, sparse)


def test_backend_with_force_use_flex_attention_as_torch():
    # torch 2.13 refuses BACKEND with FORCE_USE_FLEX_ATTENTION=True (AUTO included) and takes it
    # with False; flexattn refused BACKEND='TRITON' with False and took AUTO with True
    from flexattn.kernels import options
    assert options.check({"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": False}) == \
        {"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": False}
    for backend in ("AUTO", "TRITON", "TRITON_DECODE", "FLASH"):
        with pytest.raises(ValueError, match="BACKEND cannot be combined"):
            options.check({"BACKEND": backend, "FORCE_USE_FLEX_ATTENTION": True})
    q = torch.randn(1, 2, 3, 16)
    out = flexattn.flex_attention(q, q, q, kernel_options={"BACKEND": "TRITON_DECODE",
                                                           "FORCE_USE_FLEX_ATTENTION": False})
    torch.testing.assert_close(out, attention_reference(q, q, q).to(out.dtype), atol=1e-5, rtol=1e-5)


def test_kernel_options_memo_does_not_accept_equal_values_of_other_types():
    # the memo was keyed by the items alone: after {"PRESCALE_QK": True} was checked, {"PRESCALE_QK": 1}
    # (refused on its own) hit its entry and passed; likewise 64.0 after 64
    from flexattn.kernels import options
    for good, bad in (({"PRESCALE_QK": True}, {"PRESCALE_QK": 1}), ({"BLOCK_M": 64}, {"BLOCK_M": 64.0}),
                      ({"SPLIT_KV": 1}, {"SPLIT_KV": True})):
        assert options.check(good) == good
        with pytest.raises(TypeError, match="must be"):
            options.check(bad)
