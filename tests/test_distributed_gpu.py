"""flexattn.distributed on NCCL: every visible GPU (at least 2), against single-GPU flexattn, and
torch's context parallel with flexattn's flex_attention inside against torch's own; on one GPU, a
new mask at every step under torch.compile."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexattn
import flexattn.distributed as fd
from flexattn import AuxRequest, masks
from tests.test_distributed import context_parallel_module

pytestmark = pytest.mark.gpu


def _world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip("needs 2 or more GPUs")
    return n


def _worker(rank, world_size, store_path, body, copy_engines="1"):
    os.environ["FLEXATTN_RING_COPY"] = copy_engines
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, device_id=torch.device("cuda", rank))
    try:
        body(rank, world_size)
    finally:
        dist.destroy_process_group()


def _against_one_gpu(rank, P):
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([1500, 1100, 777])).cuda()
    for S, mask, lb, Hkv, method in [(4099, masks.causal, "head_tail", 4, "ring"),
                                     (3000, masks.sliding_window(512), None, 8, "ring"),
                                     (3377, masks.document(docs, causal=True), fd.PerDocument([1500, 1100, 777]), 8,
                                      "ring"),
                                     (4099, masks.causal, "head_tail", 4, "ring"),  # (again: the slots are reused)
                                     (2500, masks.causal, "head_tail", 2, "allgather")]:
        g = torch.Generator(device="cuda").manual_seed(S)
        q = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, Hkv, S, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        d_out = torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        request = AuxRequest(lse=True, max_scores=True)
        bm1 = flexattn.create_block_mask(mask, None, None, S, S, device="cuda")
        out1, aux1 = flexattn.flex_attention(*ins, block_mask=bm1, enable_gqa=Hkv != 8, return_aux=request)
        grads1 = torch.autograd.grad(out1, ins, d_out)
        local = [fd.shard(t, load_balance=lb).requires_grad_() for t in (q, k, v)]
        bm = fd.create_block_mask(mask, None, None, S, S, load_balance=lb, device="cuda")
        # (the case runs on the transport it names: this machine's GPUs are of one host)
        assert bm.copy_engines == (os.environ["FLEXATTN_RING_COPY"] != "0")
        out, aux = fd.flex_attention(*local, block_mask=bm, enable_gqa=Hkv != 8, method=method, return_aux=request)
        grads = torch.autograd.grad(out, local, fd.shard(d_out, load_balance=lb))
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (out1, *grads1)):
            whole = fd.unshard(a, load_balance=lb)
            torch.testing.assert_close(whole.float(), b.float(), atol=2e-2, rtol=2e-2, msg=f"{name} S={S}")
        for name, a, b in zip(("lse", "max_scores"), aux, aux1):
            torch.testing.assert_close(fd.unshard(a, load_balance=lb), b, atol=1e-3, rtol=1e-3, msg=f"{name} S={S}")


def _torch_cp_parity(rank, P):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    mesh = init_device_mesh("cuda", (P,))
    S = 256 * P
    bm = _create_cp_block_mask(masks.causal, 1, 4, S, S, mesh, _HeadTailLoadBalancer(S, P, "cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    whole = [torch.randn(1, 4, S, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
    q, k, v = (fd.shard(t, load_balance="head_tail") for t in whole)

    results = []
    for fn in (torch.compile(torch_flex), flexattn.flex_attention):
        module = context_parallel_module(fn, bm, mesh)
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*ins)
        results.append([out, *torch.autograd.grad(out.float().square().sum(), ins)])
    for name, theirs, ours in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=2e-2, rtol=2e-2, msg=name)


def _body(rank, P):
    _against_one_gpu(rank, P)
    _torch_cp_parity(rank, P)


@pytest.mark.parametrize("copy_engines", ["1", "0"], ids=["copy engines", "nccl"])
def test_distributed_nccl(tmp_path, copy_engines):
    """The ring's K/V by the copy engines (the default on one host) and by NCCL's sends."""
    P = _world()
    mp.spawn(_worker, args=(P, str(tmp_path / "store"), _body, copy_engines), nprocs=P, join=True)



def _compiled_new_masks(rank, P):
    """A new mask at every step, causal and documents in turn, through torch.compile(fullgraph=True)
    with Inductor: one graph, each step's output and gradients those of the eager call and of one
    GPU's flexattn on the whole sequence."""
    import torch._dynamo.utils as dynamo_utils

    S = 4096 + 77
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, S, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

    def step(q, k, v, bm):
        return fd.flex_attention(q, k, v, block_mask=bm)

    compiled = torch.compile(step, fullgraph=True)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    for i in range(10):  # (more than torch.compile's 8 recompilations)
        lengths = [S // 3 + 11 * i, S // 3 - 11 * i]
        ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths + [S - sum(lengths)])).cuda()
        mask = masks.document(ids, causal=True) if i % 2 else masks.causal
        bm = fd.create_block_mask(mask, None, None, S, S)
        one = flexattn.create_block_mask(mask, None, None, S, S, device="cuda")
        runs = []
        for fn in (step, compiled, lambda q, k, v, _: flexattn.flex_attention(q, k, v, block_mask=one)):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*x, bm)
            runs.append([out, *torch.autograd.grad(out.float().square().sum(), x)])
        for eager, ours, single in zip(*runs):
            torch.testing.assert_close(ours, eager, rtol=0, atol=2e-2)
            torch.testing.assert_close(ours, single, rtol=0, atol=2e-2)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs + 1


def test_compiled_new_masks_on_one_gpu(tmp_path):
    """One rank of NCCL: runs on any GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    mp.spawn(_worker, args=(1, str(tmp_path / "store"), _compiled_new_masks), nprocs=1, join=True)
