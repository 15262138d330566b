"""Context parallelism: flexattn.distributed (ring, all-gather) against one GPU and torch's context parallel.

    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py
    torchrun --nproc-per-node 4 benchmarks/bench_context_parallel.py --seq 131072,524288
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --seq 131072 --iters 3   (short)
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --seq 524288 --masks documents --methods ring

B=1, H=16, D=128, bfloat16, forward + backward; masks: causal (head-tail layout), 16 documents (per-
document head-tail, torch's layout, and whole documents per rank), sliding window 4096. Prints per-
GPU TFLOP/s, scaling efficiency (time of the whole sequence on one GPU / (P x time on P GPUs)), peak
memory per GPU (what the case allocates, its inputs included, over what earlier cases left), and
torch's context parallel (all-gathered K/V, ``torch.compile(flex_attention)``)
at the same shapes; records the time to build each one's block mask (a repeated call:
`flexattn.distributed.create_block_mask` on every rank and flexattn's one-GPU `create_block_mask`
of the whole sequence, each given the documents' ids in a new tensor at every build, as a training
loop's batches; torch's compiled CP mask, of one mask); also a length torch refuses (not a multiple of P x
128). The one-GPU baseline (flexattn's single-GPU flex_attention on the whole sequence) runs up to
``--one-gpu-max-seq``. Rank 0 writes ``benchmarks/results/context_parallel-<P>gpu-<gpu>.json`` (the
record format of `benchmarks.results`; `benchmarks.report` makes its table) after each case, so that
a run cut short keeps the cases it finished, and before torch's part of a case, which may not
finish in a run's time (16 documents at S=512k), so that flexattn's rows of that case stay too.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as `torchrun benchmarks/bench_context_parallel.py`: import the packages
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexattn
import flexattn.distributed as fd
from flexattn.distributed import copies
from benchmarks import report, results
from flexattn import masks

B, H, D = 1, 16, 128
DTYPE = torch.bfloat16


def mask_of(name: str, S: int):
    """(mask_mod, load balance, fraction of (q, kv) pairs kept)."""
    if name == "causal":
        return masks.causal, "head_tail", (S + 1) / (2 * S)
    if name in ("documents", "whole_documents"):
        lengths, ids = _documents(S)
        kept = sum(n * (n + 1) / 2 for n in lengths) / (S * S)
        layout = fd.PerDocument(lengths) if name == "documents" else fd.WholeDocuments(lengths)
        return masks.document(ids, causal=True), layout, kept
    if name == "sliding_window":
        w = 4096
        kept = (w * (w + 1) / 2 + (S - w) * w) / (S * S) if S > w else (S + 1) / (2 * S)
        return masks.sliding_window(w), None, kept
    raise ValueError(f"unknown mask {name!r}")


def _documents(S: int) -> tuple[list[int], torch.Tensor]:
    """16 documents' lengths and their int64 ids (as torch's examples make them), on the GPU."""
    lengths = [S // 16 + (i < S % 16) for i in range(16)]
    return lengths, torch.repeat_interleave(torch.arange(16), torch.tensor(lengths)).to("cuda")


def batches(name: str, S: int):
    """A function that makes the mask of a case anew, as a training loop does for each batch: the
    documents' ids in a new tensor at each call (the same values); other masks as they are."""
    mask = mask_of(name, S)[0]
    if name not in ("documents", "whole_documents"):
        return lambda: mask
    ids = _documents(S)[1]
    return lambda: masks.document(ids.clone(), causal=True)


def allocated() -> int:
    """Bytes of live tensors on this GPU now, after a collection of unreachable ones: what earlier
    cases of the process still hold (caches, compiled modules) counts here, not in a case's peak."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def timed(fn, iters: int, base: int, warmup: int = 2, barrier: bool = True) -> tuple[float, float]:
    """(median ms of fwd+bwd, peak GiB over ``base`` bytes: what the case allocated itself, its
    inputs included, as in a process of its own), with a barrier before each iteration unless
    ``barrier`` is False (one rank alone)."""
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
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def mask_ms(build, barrier: bool = True, repeats: int = 21, budget_s: float = 3.0) -> float:
    """Median wall ms of ``build()`` (a block mask) called again: the caller's own first call warmed
    its caches (and compiled torch's); with a barrier before each call unless ``barrier`` is False.
    ``repeats`` builds, or three once their total passes ``budget_s`` (torch's compiled CP mask
    takes seconds at S=512k). Every rank stops after the same build: rank 0's clock decides."""
    times = []
    while len(times) < repeats:
        if barrier:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        build()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        if len(times) >= 3 and _agreed(sum(times) > budget_s * 1e3, barrier):
            break
    return statistics.median(times)


def mask_step_ms(build, barrier: bool = True, repeats: int = 21) -> float:
    """What ``build()`` (a block mask) adds to a step whose GPU is busy, as in a training loop: the
    median wall ms of three 8192 x 8192 bf16 matmuls, the build and three more, less that of the
    matmuls alone (steps with and without the build alternate). A build that waits for the GPU
    (a host sync) adds the time the GPU then idles while the host finishes it; one that does not
    adds its kernels' time, where its host time hides behind the matmuls."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step(with_build: bool) -> float:
        if barrier:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            a @ a
        if with_build:
            build()
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    step(True), step(False)
    times = [[step(with_build) for with_build in (True, False)] for _ in range(repeats)]
    return statistics.median(t for t, _ in times) - statistics.median(t for _, t in times)


def _agreed(flag: bool, collective: bool) -> bool:
    """Rank 0's ``flag`` on every rank (``collective``: else this rank's own)."""
    if not collective:
        return flag
    box = [flag]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def flops(S: int, kept: float) -> float:
    """Forward + backward FLOPs of the whole sequence (the backward counted as 2.5 forwards)."""
    return 4 * B * H * S * S * D * kept * 3.5


def bench_flexattn(S: int, mask_name: str, method: str, iters: int) -> dict:
    base = allocated()
    _, lb, kept = mask_of(mask_name, S)
    batch = batches(mask_name, S)

    def build():
        return fd.create_block_mask(batch(), None, None, S, S, load_balance=lb, device="cuda")

    bm = build()
    q, k, v = inputs(bm.qpos.numel(), bm.kvpos[bm.rank].numel())
    ms, gib = timed(fwd_bwd(lambda q, k, v: fd.flex_attention(q, k, v, block_mask=bm, method=method), q, k, v),
                    iters, base)
    if method == "ring":  # (the slots of the ring's copy engines: symmetric memory, outside the allocator's count)
        gib += copies.workspace_bytes(torch.device("cuda", torch.cuda.current_device())) / 2**30
    row = {"impl": method, "ms": ms, "peak_gib": gib, "tflops_per_gpu": flops(S, kept) / dist.get_world_size() / ms / 1e9,
           "kv_gib": _kv_gib(k, v, method)}
    if method == "ring":  # (the same mask serves both methods)
        row["mask_ms"], row["mask_step_ms"] = mask_ms(build), mask_step_ms(build)
    return row


def _kv_gib(k, v, method) -> float:
    """K/V bytes a rank holds at once: its own shard and two travelling (double buffers) for the
    ring, all shards for the all-gather."""
    per = (k.numel() + v.numel()) * k.element_size() / 2**30
    return per * (3 if method == "ring" else dist.get_world_size())


def bench_one_gpu(S: int, mask_name: str, iters: int) -> dict | None:
    """The whole sequence on rank 0's GPU alone with flexattn's flex_attention (other ranks wait)."""
    result = None
    if dist.get_rank() == 0:
        base = allocated()
        kept = mask_of(mask_name, S)[2]
        batch = batches(mask_name, S)

        def build():
            return flexattn.create_block_mask(batch(), None, None, S, S, device="cuda")

        bm = build()
        q, k, v = inputs(S, S)
        run = fwd_bwd(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm), q, k, v)
        ms, gib = timed(run, iters, base, barrier=False)
        result = {"impl": "one_gpu", "ms": ms, "peak_gib": gib, "tflops_per_gpu": flops(S, kept) / ms / 1e9,
                  "mask_ms": mask_ms(build, barrier=False), "mask_step_ms": mask_step_ms(build, barrier=False)}
        del q, k, v, run
        torch.cuda.empty_cache()
    dist.barrier()
    return result


def bench_torch_cp(mesh, S: int, mask_name: str, iters: int) -> dict:
    """torch's context parallel for FlexAttention: all-gathered K/V, compiled flex_attention (its
    compilation is in the warm-up calls)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _ContextParallel, _create_cp_block_mask)
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    P = dist.get_world_size()
    base = allocated()
    mask, lb, kept = mask_of(mask_name, S)
    balancer = _HeadTailLoadBalancer(S, P, "cuda") if lb == "head_tail" else None

    def build():
        return _create_cp_block_mask(mask, B, H, S, S, mesh, balancer)

    try:
        bm = build()
    except (NotImplementedError, AssertionError) as e:
        return {"impl": "torch_cp", "error": results.error_text(e)}
    build_ms = mask_ms(build)
    compiled = torch.compile(flex_attention)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return compiled(q, k, v, block_mask=bm)

    module = parallelize_module(Attention(), mesh, _ContextParallel(
        seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    q, k, v = inputs(S // P, S // P)
    ms, gib = timed(fwd_bwd(module, q, k, v), iters, base)
    return {"impl": "torch_cp", "ms": ms, "peak_gib": gib, "tflops_per_gpu": flops(S, kept) / P / ms / 1e9,
            "mask_ms": build_ms}


def run(args, save=lambda rows: None) -> list[dict]:
    """Every (S, mask): one row per competitor, with P, S and the mask; ``save(rows so far)`` after
    each (a run cut short keeps what it measured)."""
    from torch.distributed.device_mesh import init_device_mesh

    P = dist.get_world_size()
    mesh = None if args.no_torch else init_device_mesh("cuda", (P,))
    seqs = [int(s) for s in args.seq.split(",")]
    refused = seqs[0] + 3 * 64 + 1  # not a multiple of P x 128: torch refuses it
    rows = []
    for S in seqs + [refused]:
        for mask_name in args.masks.split(","):
            if S == refused and mask_name != "causal":
                continue
            case = {"P": P, "S": S, "mask": mask_name}
            if dist.get_rank() == 0:
                print(f"# P={P} S={S} {mask_name}: {allocated() / 2**30:.2f} GiB live before the case", flush=True)
            found = [bench_flexattn(S, mask_name, method, args.iters) for method in args.methods.split(",")]
            if S > args.one_gpu_max_seq:
                found.append({"impl": "one_gpu", "skipped": f"S > --one-gpu-max-seq {args.one_gpu_max_seq}"})
            elif S != refused:
                one = bench_one_gpu(S, mask_name, args.iters)
                found += [one] if one is not None else []
            here = [{**case, **r} for r in found]
            if mesh is not None:
                if dist.get_rank() == 0:  # (flexattn's rows are kept where torch's part never returns)
                    print(line(here) + " (torch CP next)", flush=True)
                    save(rows + here)
                here.append({**case, **bench_torch_cp(mesh, S, mask_name, args.iters)})
            rows += here
            if dist.get_rank() == 0:
                print(line(here), flush=True)
                save(rows)
    return rows


def line(rows: list[dict]) -> str:
    """One printed line for the rows of one (P, S, mask)."""
    by = {r["impl"]: r for r in rows}
    ring, ag, one, theirs = by["ring"], by.get("allgather", {}), by.get("one_gpu", {}), by.get("torch_cp", {})
    eff = f"{one['ms'] / (ring['P'] * ring['ms']):.2f}" if "ms" in one else one.get("skipped", "-")
    torch_txt = f"{theirs['ms']:8.1f} ms (ring x{theirs['ms'] / ring['ms']:.2f}) peak {theirs['peak_gib']:5.1f} GiB" \
        if "ms" in theirs else theirs.get("error", "-")
    masks_txt = " / ".join(f"{r['mask_ms']:.1f}" if "mask_ms" in r else "-" for r in (ring, one, theirs))
    steps_txt = " / ".join(f"{r['mask_step_ms']:.2f}" if "mask_step_ms" in r else "-" for r in (ring, one))
    ag_txt = f"{ag['ms']:8.1f} ms peak {ag['peak_gib']:5.1f} GiB KV {ag['kv_gib']:.2f} GiB" if "ms" in ag else "-"
    return (f"P={ring['P']} S={ring['S']:>7} {ring['mask']:<15} ring {ring['ms']:8.1f} ms "
            f"{ring['tflops_per_gpu']:6.1f} TF/s/GPU peak {ring['peak_gib']:5.1f} GiB KV {ring['kv_gib']:.2f} GiB | "
            f"allgather {ag_txt} | "
            f"one GPU {one['ms'] if 'ms' in one else '-'} ms, efficiency {eff} | torch CP {torch_txt} | "
            f"mask ms ring / one GPU / torch CP {masks_txt} | in a busy step, ring / one GPU {steps_txt}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="131072,524288")
    parser.add_argument("--masks", default="causal,documents,whole_documents,sliding_window")
    parser.add_argument("--methods", default="ring,allgather",
                        help="flexattn's methods to run: ring (always first) and allgather (skip it at S=512k to "
                             "fit a run in less time)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--one-gpu-max-seq", type=int, default=262144,
                        help="longest sequence for the one-GPU baseline (longer: skipped, no efficiency)")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's context parallel")
    parser.add_argument("--results", type=Path, default=results.RESULTS_DIR, help="folder of the results JSON")
    parser.add_argument("--no-save", action="store_true", help="print the lines only")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if methods[0] != "ring" or not set(methods) <= {"ring", "allgather"} or len(set(methods)) != len(methods):
        parser.error(f"--methods is ring, then optionally allgather; got {args.methods!r}")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    P = dist.get_world_size()
    env = results.environment("cuda")
    config = {"P": P, "B": B, "H": H, "D": D, "dtype": str(DTYPE).removeprefix("torch."), "iters": args.iters,
              "peak": report.PEAK_PER_CASE}

    def save(rows: list[dict]) -> None:
        if not args.no_save:
            path = results.save("context_parallel", env, config, rows, args.results, tag=f"{P}gpu")
            print(f"# results: {path}", flush=True)

    run(args, save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
