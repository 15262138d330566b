"""The call path on a GPU (``pytest -m gpu``): CUDA-graph capture of forward and decoding calls
made the way model code makes them (a fresh lambda per call), and a compiled model."""

import itertools
import math

import pytest
import torch
import triton

import flexattn
from flexattn.reference import attention_reference
from helpers.testing import capture_after_warmup

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("D", [64, 128])  # (128 on an H100/H200: the Hopper kernel, its TMA descriptors)
def test_cuda_graph_forward_with_fresh_lambda_per_call(D):
    B, H, S = 2, 8, 1000
    q, k, v = (torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(H, device=DEV)
    mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=DEV)

    def step():
        return flexattn.flex_attention(q, k, v, block_mask=mask,
                                       score_mod=lambda s, b, h, qi, ki: s + bias[h] * (qi - ki) * 1e-3)

    graph, static_out = capture_after_warmup(step)
    for seed in range(3):
        torch.manual_seed(seed)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        bias.copy_(torch.randn_like(bias))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out.float(), step().float(), atol=0, rtol=0)
        ref = attention_reference(q, k, v, block_mask=mask,
                                  score_mod=lambda s, b, h, qi, ki: s + bias[h] * (qi - ki) * 1e-3)
        torch.testing.assert_close(static_out.double(), ref, atol=2e-2, rtol=2e-2)


def test_cuda_graph_decoding_through_flex_attention():
    B, Hq, Hkv, L, D = 4, 32, 8, 4096, 128
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    pos = torch.tensor(1000, device=DEV, dtype=torch.int32)

    def step():
        return flexattn.flex_attention(q, k, v, enable_gqa=True,
                                       score_mod=lambda s, b, h, qi, ki: torch.where(ki <= pos, s, -math.inf))

    graph, static_out = capture_after_warmup(step)
    for new_pos in (1500, 4000, 17):
        q.copy_(torch.randn_like(q))
        pos.fill_(new_pos)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out.float(), step().float(), atol=0, rtol=0)
        ref = attention_reference(q, k, v, enable_gqa=True,
                                  score_mod=lambda s, b, h, qi, ki: torch.where(ki <= pos, s, -math.inf))
        torch.testing.assert_close(static_out.double(), ref, atol=2e-2, rtol=2e-2)


def test_cuda_graph_of_a_python_number_seen_before():
    """A Python number the mod reads, once it changes, is passed as a 0-d tensor. A replay reads
    the number its capture passed, whatever number tensors the process made and freed since (a
    number tensor kept across calls and evicted would not be: 71% of this output was wrong)."""
    from flexattn import scalars

    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(3))

    def run(limit):
        return flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(ki <= limit, s, -math.inf))

    for limit in (100, 211):  # (the second value makes the number dynamic; 211's tensor is kept)
        run(limit)
    graph, static_out = capture_after_warmup(lambda: run(211))
    for n in range(2 * 256):  # (every kept tensor evicted, and their memory taken by other numbers)
        scalars.value_tensor(10**6 + n, torch.device(DEV), torch.float32)
    taken = [torch.full((), 7, dtype=torch.int32, device=DEV) for _ in range(1024)]
    static_out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    ref = attention_reference(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(ki <= 211, s, -math.inf))
    torch.testing.assert_close(static_out.double(), ref, atol=2e-2, rtol=2e-2)
    del taken


def test_compiled_model_on_the_gpu():
    torch._dynamo.reset()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.slopes = torch.nn.Parameter(torch.rand(8, device=DEV) * 0.1)

        def forward(self, q, k, v, mask):
            slopes = self.slopes
            return flexattn.flex_attention(q, k, v, block_mask=mask,
                                           score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki))

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True)
    S = 2048
    mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=DEV)
    grads = []
    for model in (layer, compiled):
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 8, S, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        layer.slopes.grad = None
        out = model(q, k, v, mask)
        out.float().sum().backward()
        grads.append((out, q.grad, k.grad, v.grad, layer.slopes.grad))
    eager, comp = grads
    for a, b in zip(eager[:4], comp[:4]):  # output, dQ, dK, dV: the same kernels, bit for bit
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # The slopes' gradient is a float32 atomic sum of ~S*S/2 = 2M terms per head, in an order that
    # varies run to run: measured differences reach ~1e-5 relative.
    torch.testing.assert_close(eager[4], comp[4], atol=0, rtol=1e-4)
    with torch.no_grad():
        layer.slopes.mul_(0.5)  # new parameter values and new activations: the same graph
    q, k, v = (torch.randn(2, 8, S, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = compiled(q, k, v, mask)
    torch.testing.assert_close(out, layer(q, k, v, mask), atol=0, rtol=0)


def test_compiled_block_mask_built_in_the_graph_on_the_gpu():
    """create_block_mask inside the compiled graph on the GPU (its triton backend) and int64
    document ids beyond int32, which the graph ranks: forward and backward against float64."""
    torch._dynamo.reset()
    S = 2049
    lengths = torch.tensor([S // 2, S // 3, S - S // 2 - S // 3])
    doc = (torch.repeat_interleave(torch.arange(3), lengths) * 2**32 + 5).to(DEV)

    def attend(q, k, v, doc):
        bm = flexattn.create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None,
                                        q.shape[2], k.shape[2], device=DEV)
        return flexattn.flex_attention(q, k, v, block_mask=bm)

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, S, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = torch.compile(attend, fullgraph=True)(q, k, v, doc)
    ref = attention_reference(q, k, v, mask_mod=lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki))
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    do = torch.randn_like(out)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do.double())):
        torch.testing.assert_close(g.double(), r.double(), atol=5e-2, rtol=5e-2)


# Triton up to 3.6 (torch 2.11's) lays its launcher out the way `TensorMapLaunch` knows.
_FLAT_LAUNCHER = tuple(int(x) for x in triton.__version__.split(".")[:2]) <= (3, 6)


def _takes_descriptors(site) -> bool:
    return any(isinstance(t, str) and t.startswith("tensordesc") for t in site.compiled.src.signature.values())


@pytest.mark.parametrize("case", ["forward", "backward", "decode_split", "decode_one_split"])
def test_direct_launches_match_the_reference(case, nan_outputs):
    """After its first calls a launch site calls the compiled kernel directly (torch's static
    launcher where it can): every call, through each path, must still give the right result."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    bias = torch.randn(8, device=DEV)
    mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 300, 300, device=DEV)
    if case.startswith("decode"):
        q = torch.randn(2, 8, 3, 64, device=DEV, dtype=dt)
        k, v = (torch.randn(2, 2, 700, 64, device=DEV, dtype=dt) for _ in range(2))
        opts = {"SPLIT_KV": 1} if case == "decode_one_split" else None

        def run():
            out, lse = flexattn.flex_attention(q, k, v, enable_gqa=True, return_lse=True, kernel_options=opts,
                                               score_mod=lambda s, b, h, qi, ki: s + bias[h])
            return (out, lse)

        def ref():
            out, lse = attention_reference(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h], enable_gqa=True,
                                           return_lse=True)
            return (out, lse)
    else:
        q, k, v = (torch.randn(2, 8, 300, 64, device=DEV, dtype=dt, requires_grad=case == "backward")
                   for _ in range(3))
        g = torch.randn(2, 8, 300, 64, device=DEV, dtype=dt)

        def run():
            out = flexattn.flex_attention(q, k, v, block_mask=mask, score_mod=lambda s, b, h, qi, ki: s + bias[h])
            if case == "forward":
                return (out,)
            return torch.autograd.grad(out, (q, k, v), g)

        def ref():
            qq, kk, vv = (t.detach().double().requires_grad_(case == "backward") for t in (q, k, v))
            out = attention_reference(qq, kk, vv, block_mask=mask, score_mod=lambda s, b, h, qi, ki: s + bias[h])
            if case == "forward":
                return (out,)
            return torch.autograd.grad(out, (qq, kk, vv), g.double())

    expected = ref()
    for call in range(4):
        if call == 3:
            from helpers.launches import recorded_launches

            sites = [site for site, _ in recorded_launches(run)]
            assert sites and all(s.launcher is not None for s in sites), "the direct launch was not taken"
            assert len(sites) == 1 or not case.startswith("decode"), "a decoding call is one launch"
            if getattr(torch._C, "_StaticCudaLauncher", None) is not None:
                # (it has no code for TMA descriptor arguments: the Hopper forward's Q, K, V)
                assert all(s.static is not None or _takes_descriptors(s) for s in sites), \
                    "torch's static launcher was not used"
            if _FLAT_LAUNCHER:
                assert all(s.tensormaps is not None for s in sites if _takes_descriptors(s)), \
                    "the descriptors' direct launch was not used"
        for got, want in zip(run(), expected):
            assert not got.isnan().any()
            torch.testing.assert_close(got.double(), want.double(), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernels need an sm_90 GPU")
def test_hopper_launches_across_addresses(monkeypatch, nan_outputs):
    """The Hopper kernels' direct launch keeps each descriptor's map by its tensor's address, a
    few per descriptor: calls that cycle through more input and output addresses than it keeps
    must each read and write their own tensors."""
    from flexattn.kernels import triton_launcher

    monkeypatch.setattr(triton_launcher.TensorMapLaunch, "MAPS_PER_DESCRIPTOR", 2)
    taken = []
    real = triton_launcher.TensorMapLaunch.__call__
    monkeypatch.setattr(triton_launcher.TensorMapLaunch, "__call__", lambda self, *a: taken.append(real(self, *a)) or taken[-1])
    B, H, S, D = 1, 4, 700, 128
    mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=DEV)
    torch.manual_seed(0)
    sets = [tuple(torch.randn(B, H, S, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(4))
            for _ in range(3)]
    for step in range(8):
        *qkv, g = sets[step % 3]
        out = flexattn.flex_attention(*qkv, block_mask=mask)
        grads = torch.autograd.grad(out, qkv, g)
        ref_qkv = [t.detach().double().requires_grad_() for t in qkv]
        ref = attention_reference(*ref_qkv, block_mask=mask)
        ref_grads = torch.autograd.grad(ref, ref_qkv, g.double())
        for got, want in zip((out, *grads), (ref, *ref_grads)):
            torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
    if _FLAT_LAUNCHER:
        assert taken.count(True) >= 2 * 5, taken  # (the forward's and the backward's, from their third calls)


@pytest.mark.parametrize("options", [None, {"DQ_PASS": True}], ids=["default", "dq_pass"])
def test_lse_gradients_of_other_layouts_on_repeated_calls(options):
    """Repeated backward calls whose LSE gradient changes layout (contiguous, then the expanded one
    of ``lse.sum()``, then contiguous again), each past the calls that set up the direct launch:
    the kernels read Delta's dLSE term with each call's strides (the preprocess, or the Gluon dQ
    pass that writes Delta)."""
    B, H, S, D = 1, 4, 700, 128
    mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = (torch.randn(B, H, S, D, device=DEV, generator=g).bfloat16().requires_grad_() for _ in range(3))
    d_out = torch.randn(B, H, S, D, device=DEV, generator=g)
    w = torch.randn(B, H, S, device=DEV, generator=g)
    ref_qkv = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref_qkv, block_mask=mask, return_lse=True)
    for layout in ("contiguous", "expanded", "contiguous"):
        def loss(out, lse):
            term = lse.sum() if layout == "expanded" else (lse * w.to(lse.dtype)).sum()
            return (out * d_out.to(out.dtype)).sum() + term

        want = torch.autograd.grad(loss(ref_out, ref_lse), ref_qkv, retain_graph=True)
        for _ in range(3):
            got = torch.autograd.grad(loss(*flexattn.flex_attention(q, k, v, block_mask=mask, return_lse=True,
                                                                    kernel_options=options)), (q, k, v))
            for name, a, e in zip(("dq", "dk", "dv"), got, want):
                torch.testing.assert_close(a.double(), e, atol=5e-2, rtol=5e-2, msg=f"{layout}: {name}")


def replays_match_eager(step, inputs):
    """Capture ``step`` (which returns a tuple of outputs), then three times: draw new ``inputs``
    in place, replay, and compare every static output with an eager call's; yields after each."""
    graph, static = capture_after_warmup(step)
    for seed in range(3):
        torch.manual_seed(seed)
        for t in inputs:
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        for replayed, eager in zip(static, step()):
            torch.testing.assert_close(replayed.float(), eager.float(), atol=0, rtol=0)
        yield static


def test_cuda_graph_with_sinks_forward_and_decoding():
    """Sinks are a tensor argument: a replay reads the sink values of that moment."""
    H, S, D = 8, 1000, 128
    q, k, v = (torch.randn(2, H, S, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    q1 = torch.randn(2, H, 1, D, device=DEV, dtype=torch.bfloat16)
    sinks = torch.randn(H, device=DEV)
    mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=DEV)

    def step():
        return (flexattn.flex_attention(q, k, v, block_mask=mask, sinks=sinks),
                flexattn.flex_attention(q1, k, v, sinks=sinks))

    for out, _ in replays_match_eager(step, (q, k, v, q1, sinks)):
        ref = attention_reference(q, k, v, block_mask=mask, sinks=sinks)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_cuda_graph_varlen_packed_and_decoding():
    """varlen_attention's tables are made before the capture (offsets by identity and version):
    replays read the inputs and sinks of that moment, for the packed and the decoding layout."""
    lengths = [1, 517, 0, 130, 1000]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)
    one_each = torch.arange(len(lengths) + 1, dtype=torch.int32, device=DEV)
    T, H, D, longest = sum(lengths), 8, 128, max(lengths)
    q, k, v = (torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    q1 = torch.randn(len(lengths), H, D, device=DEV, dtype=torch.bfloat16)
    sinks = torch.randn(H, device=DEV)

    def step():
        return (flexattn.varlen_attention(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), sinks=sinks),
                flexattn.varlen_attention(q1, k, v, one_each, cu, 1, longest, sinks=sinks))

    replays = list(replays_match_eager(step, (q, k, v, q1, sinks)))
    assert len(replays) == 3


def test_tf32_flag_is_read_at_each_compiled_call():
    """float32 under torch.compile: the custom ops' plans follow torch.backends.cuda.matmul.allow_tf32
    as eager calls do (a plan made while it was on is not taken once it is off), forward and backward."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 64, device=DEV, generator=g).requires_grad_() for _ in range(3))
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True)
    want = attention_reference(q.double(), k.double(), v.double())
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    errors = {}
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf32 in (True, False):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            out = compiled(q, k, v)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            errors[tf32] = max((a.double() - b).abs().max().item() for a, b in zip((out, *grads), (want, *want_grads)))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert errors[False] < 1e-4 and errors[True] > 10 * errors[False], errors
