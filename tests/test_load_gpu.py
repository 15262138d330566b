"""Under load on the GPU (``pytest -m gpu``): threads making the same first call at once, each on
its own stream; a Python-int decoding loop; tensors on a second GPU after the first."""

import math
import random

import pytest
import torch

import flexattn
from flexattn.kernels import launch, plans
from flexattn.reference import attention_reference
from helpers.calls import record_calls, run_in_threads

pytestmark = pytest.mark.gpu


def _inputs(device, S=512, D=64, Q=None, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(1, 4, n, D, device=device, dtype=torch.bfloat16, generator=g)
                 for n in (Q or S, S, S))


def _assert_right(out, q, k, v, **kw):
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, **kw), atol=2e-2, rtol=2e-2)


def test_threads_making_the_same_first_call_compile_once():
    """8 threads, each on its own CUDA stream, make the same never-seen call at once: one plan,
    one Triton compile, every answer right."""
    c = random.random() + 1.0  # a mod no earlier run compiled
    q, k, v = _inputs("cuda")
    torch.cuda.synchronize()
    with pytest.MonkeyPatch.context() as mp:
        made = record_calls(mp, plans, "_make_forward_plan")
        compiled = record_calls(mp, launch.Launch, "_first")
        outs = [None] * 8

        def worker(i):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(stream):
                outs[i] = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * c)
            stream.synchronize()

        errors = run_in_threads(worker, 8)
    assert errors == []
    assert len(compiled) == 1
    assert len(made) == 1  # threads that missed the plan together waited for one make
    for out in outs:
        _assert_right(out, q, k, v, score_mod=lambda s, b, h, qi, ki: s * c)


def test_python_int_decoding_loop_compiles_two_kernels():
    q, k, v = _inputs("cuda", S=4096, D=128, Q=1)
    with pytest.MonkeyPatch.context() as mp:
        compiled = record_calls(mp, launch, "load_kernel_module")
        for pos in range(0, 4096, 41):
            out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki:
                                          torch.where(ki <= pos, s, -math.inf))
            _assert_right(out, q, k, v, mask_mod=lambda b, h, qi, ki: ki <= pos)
    assert len(compiled) <= 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_second_gpu_after_the_first():
    """cuda:0 first, then the same calls on cuda:1 (and back): each runs on its tensors' device,
    forward, decoding and create_block_mask, with the current device left at cuda:0."""
    torch.cuda.set_device(0)
    bias = {d: torch.randn(4, device=d) for d in ("cuda:0", "cuda:1")}
    for device in ("cuda:0", "cuda:1", "cuda:0"):
        q, k, v = _inputs(device, S=1000)
        mask = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 1000, 1000, device=device)
        score = lambda s, b, h, qi, ki: s + bias[device][h]  # noqa: E731
        out = flexattn.flex_attention(q, k, v, score_mod=score, block_mask=mask)
        assert out.device == torch.device(device)
        _assert_right(out, q, k, v, score_mod=score, mask_mod=lambda b, h, qi, ki: qi >= ki)
        step = flexattn.flex_attention(q[:, :, :1], k, v, score_mod=score)
        _assert_right(step, q[:, :, :1], k, v, score_mod=score)
        assert torch.cuda.current_device() == 0
