"""Context parallelism: flexattn.distributed (ring, all-gather) against one GPU and torch's context parallel.

    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py
    torchrun --nproc-per-node 4 benchmarks/bench_context_parallel.py --seq 131072,524288

B=1, H=16, D=128, bfloat16, forward + backward; masks: causal, 16 documents, sliding window 4096.
Prints per-GPU TFLOP/s, scaling efficiency (time of the whole sequence on one GPU / (P x time on P
GPUs)), peak memory per GPU, and torch's context parallel (all-gathered K/V,
``torch.compile(flex_attention)``) at the same shapes; also a length torch refuses (not a multiple
of P x 128). Rank 0 writes ``benchmarks/results/context_parallel-<gpu>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist

import flexattn
import flexattn.distributed as fd
from flexattn import masks

B, H, D = 1, 16, 128
DTYPE = torch.bfloat16


def mask_of(name: str, S: int):
    """(mask_mod, load balance, fraction of (q, kv) pairs kept)."""
    if name == "causal":
        return masks.causal, "head_tail", (S + 1) / (2 * S)
    if name == "documents":
        lengths = [S // 16 + (i < S % 16) for i in range(16)]
        kept = sum(n * (n + 1) / 2 for n in lengths) / (S * S)
        return masks.document(lengths=lengths, causal=True), fd.PerDocument(lengths), kept
    if name == "sliding_window":
        w = 4096
        kept = (w * (w + 1) / 2 + (S - w) * w) / (S * S) if S > w else (S + 1) / (2 * S)
        return masks.sliding_window(w), None, kept
    raise ValueError(f"unknown mask {name!r}")


def timed(fn, iters: int, warmup: int = 2, barrier: bool = True) -> tuple[float, float]:
    """(median ms of fwd+bwd, peak GiB), with a barrier before each iteration unless ``barrier``
    is False (one rank alone)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def fwd_bwd(attn, q, k, v):
    def run():
        out = attn(q, k, v)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None
    return run


def inputs(L: int, Lkv: int):
    g = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    q = torch.randn(B, H, L, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    k = torch.randn(B, H, Lkv, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    v = torch.randn(B, H, Lkv, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    return q, k, v


def bench_flexattn(S: int, mask_name: str, method: str, iters: int) -> dict:
    mask, lb, kept = mask_of(mask_name, S)
    bm = fd.create_block_mask(mask, None, None, S, S, load_balance=lb, device="cuda")
    q, k, v = inputs(bm.qpos.numel(), bm.kvpos[bm.rank].numel())
    ms, gib = timed(fwd_bwd(lambda q, k, v: fd.flex_attention(q, k, v, block_mask=bm, method=method), q, k, v),
                    iters)
    flops = 4 * B * H * S * S * D * kept * 3.5 / dist.get_world_size()
    return {"ms": ms, "peak_gib": gib, "tflops_per_gpu": flops / ms / 1e9, "kv_shard_gib": _kv_gib(k, v, method)}


def _kv_gib(k, v, method) -> float:
    """K/V bytes a rank holds at once: two shards (double buffers) for the ring, all for the all-gather."""
    per = (k.numel() + v.numel()) * k.element_size() / 2**30
    return per * (2 if method == "ring" else dist.get_world_size())


def bench_one_gpu(S: int, mask_name: str, iters: int) -> dict | None:
    """The whole sequence on rank 0's GPU alone (other ranks wait)."""
    result = None
    if dist.get_rank() == 0:
        mask, _, kept = mask_of(mask_name, S)
        bm = flexattn.create_block_mask(mask, None, None, S, S, device="cuda")
        q, k, v = inputs(S, S)
        run = fwd_bwd(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm), q, k, v)
        ms, _ = timed(run, iters, barrier=False)
        result = {"ms": ms, "tflops": 4 * B * H * S * S * D * kept * 3.5 / ms / 1e9}
        del q, k, v
        torch.cuda.empty_cache()
    dist.barrier()
    return result


def bench_torch_cp(S: int, mask_name: str, iters: int) -> dict:
    """torch's context parallel for FlexAttention: all-gathered K/V, compiled flex_attention."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _ContextParallel, _create_cp_block_mask
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    P = dist.get_world_size()
    mesh = init_device_mesh("cuda", (P,))
    mask, lb, kept = mask_of(mask_name, S)
    balancer = _HeadTailLoadBalancer(S, P, "cuda") if lb == "head_tail" else None
    try:
        bm = _create_cp_block_mask(mask, B, H, S, S, mesh, balancer)
    except (NotImplementedError, AssertionError) as e:
        return {"error": str(e).splitlines()[0]}
    compiled = torch.compile(flex_attention)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return compiled(q, k, v, block_mask=bm)

    module = parallelize_module(Attention(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    q, k, v = inputs(S // P, S // P)
    ms, gib = timed(fwd_bwd(module, q, k, v), iters)
    return {"ms": ms, "peak_gib": gib, "tflops_per_gpu": 4 * B * H * S * S * D * kept * 3.5 / P / ms / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="131072,524288")
    parser.add_argument("--masks", default="causal,documents,sliding_window")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip torch's context parallel")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    P, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    seqs = [int(s) for s in args.seq.split(",")]
    refused = seqs[0] + 3 * 64 + 1  # not a multiple of P x 128: torch refuses it
    for S in seqs + [refused]:
        for mask_name in args.masks.split(","):
            if S == refused and mask_name != "causal":
                continue
            row = {"S": S, "mask": mask_name, "P": P}
            for method in ("ring", "allgather"):
                row[method] = bench_flexattn(S, mask_name, method, args.iters)
            one = bench_one_gpu(S, mask_name, args.iters) if S != refused else None
            if one is not None:
                row["one_gpu"] = one
                row["efficiency"] = one["ms"] / (P * row["ring"]["ms"])
            if not args.no_torch:
                row["torch_cp"] = bench_torch_cp(S, mask_name, args.iters)
                if "ms" in row["torch_cp"]:
                    row["speedup_vs_torch_cp"] = row["torch_cp"]["ms"] / row["ring"]["ms"]
            rows.append(row)
            if rank == 0:
                print(_line(row), flush=True)
    if rank == 0:
        name = torch.cuda.get_device_name().replace(" ", "_")
        os.makedirs("benchmarks/results", exist_ok=True)
        path = f"benchmarks/results/context_parallel-{name}.json"
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "P": P, "torch": torch.__version__,
                       "flexattn": flexattn.__version__, "B": B, "H": H, "D": D, "dtype": str(DTYPE),
                       "rows": rows}, f, indent=1)
        print(f"wrote {path}")
    dist.destroy_process_group()


def _line(row: dict) -> str:
    ring, ag = row["ring"], row["allgather"]
    torch_cp = row.get("torch_cp", {})
    torch_txt = f"{torch_cp['ms']:8.1f} ms x{row['speedup_vs_torch_cp']:.2f}" if "ms" in torch_cp else \
        f"torch: {torch_cp.get('error', '-')[:40]}"
    eff = f"{row['efficiency']:.2f}" if "efficiency" in row else "-"
    return (f"P={row['P']} S={row['S']:>7} {row['mask']:<15} ring {ring['ms']:8.1f} ms {ring['tflops_per_gpu']:6.1f} "
            f"TF/s/GPU peak {ring['peak_gib']:5.1f} GiB KV {ring['kv_shard_gib']:.2f} GiB | allgather "
            f"{ag['ms']:8.1f} ms peak {ag['peak_gib']:5.1f} GiB KV {ag['kv_shard_gib']:.2f} GiB | eff {eff} | "
            f"{torch_txt}")


if __name__ == "__main__":
    main()
