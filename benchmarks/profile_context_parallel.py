"""Where a context-parallel step's time goes, per rank.

Forward and forward + backward times, the GPU time per kernel name, and rank 0's kernel timeline
(every kernel with its stream), for finding transfers that wait for compute or compute that waits
for transfers.

    torchrun --nproc-per-node 4 benchmarks/profile_context_parallel.py --masks documents,causal
    torchrun --nproc-per-node 4 benchmarks/profile_context_parallel.py --masks documents:allgather

Same shapes and masks as `bench_context_parallel` (B=1, H=16, D=128, bfloat16); ``mask:method``
picks the method (ring by default). Prints one block per rank; writes rank 0's timeline to
``<out>/timeline-<mask>-<method>.txt`` (``t=`` start and ``dur=`` in ms from the first kernel,
the stream, the kernel's name). Times are CUDA-event medians; the profiled step runs once more
under torch.profiler.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

if __package__ in (None, ""):  # run as `torchrun benchmarks/profile_context_parallel.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexattn.distributed as fd
from benchmarks.bench_context_parallel import fwd_bwd, inputs, mask_of, timed


def profile_case(S: int, mask_name: str, method: str, out: Path) -> str:
    """This rank's block of lines; rank 0 also writes its timeline."""
    mask, lb, _ = mask_of(mask_name, S)
    bm = fd.create_block_mask(mask, None, None, S, S, load_balance=lb, device="cuda")
    q, k, v = inputs(bm.qpos.numel(), bm.kvpos[bm.rank].numel())

    def attn(q, k, v):
        return fd.flex_attention(q, k, v, block_mask=bm, method=method)

    step = fwd_bwd(attn, q, k, v)
    (forward_ms, _), (step_ms, _) = timed(lambda: attn(q, k, v), 5, base=0), timed(step, 5, base=0)  # (peaks unused)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_name: collections.Counter = collections.Counter()
    kernels = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name[:70]] += e.device_time / 1e3
            kernels.append((e.time_range.start, e.time_range.end, getattr(e, "device_resource_id", -1), e.name[:70]))
    rank = dist.get_rank()
    lines = [f"== rank {rank} {mask_name} {method}: forward {forward_ms:.2f} ms, forward + backward {step_ms:.2f} ms, "
             f"kernels {sum(per_name.values()):.2f} ms (transfer kernels count their waits)"]
    lines += [f"   {ms:8.3f} ms  {name}" for name, ms in per_name.most_common(12)]
    if rank == 0 and kernels:
        kernels.sort()
        t0 = kernels[0][0]
        path = out / f"timeline-{mask_name}-{method}.txt"
        path.write_text("".join(f"t={(a - t0) / 1e3:8.3f} dur={(b - a) / 1e3:7.3f} s{stream} {name}\n"
                                for a, b, stream, name in kernels))
        lines.append(f"   timeline: {path}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--masks", default="documents,causal", help="mask[:method],... (method: ring, allgather)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder of rank 0's timelines")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank = dist.get_rank()
    args.out.mkdir(parents=True, exist_ok=True)
    for case in args.masks.split(","):
        mask_name, method = (case.split(":") + ["ring"])[:2]
        block = profile_case(args.seq, mask_name, method, args.out)
        blocks = [None] * dist.get_world_size()
        dist.all_gather_object(blocks, block)
        if rank == 0:
            print("\n".join(blocks), flush=True)
        torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
