"""Packed variable-length sequences, forward and backward: flexattn's varlen_attention vs torch's
varlen_attn vs flexattn's document-mask emulation.

    python -m benchmarks varlen                       # 32 sequences of 128..8k tokens, H=16, D=128, bf16
    python -m benchmarks varlen -- --seqs 64 --min-len 64 --max-len 2048
    python benchmarks/bench_varlen.py --device cpu    # tiny sizes, flexattn only (interpreter)

One causal attention over sequences of seeded random lengths packed into (T, H, D) tensors, three
ways: ``flexattn.varlen_attention`` (block tables from the offsets), torch 2.13's
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's varlen kernels; CUDA only), and
``flexattn.flex_attention`` over the packed sequence as one batch-1 sequence with a document-id
causal mask from ``create_block_mask`` (made once, outside the timing, like varlen's tables);
and flexattn's varlen with attention sinks (``sinks=``, one logit per head that requires grad,
set to -20 so that outputs still compare with the others': what the sinks cost, the same for
any value).
Outputs and gradients are compared to the first competitor's. TFLOP/s counts the causal work
of each sequence, 4·H·D·L(L+1)/2 for the forward and 2.5x that for the backward.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/bench_varlen.py`: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexattn
from benchmarks import results
from benchmarks.bench_attention import MEASURED, measure_case, measured, with_tflops

SUITE = "varlen"
IMPLS = {"flexattn": "flexattn varlen", "torch": "torch varlen_attn", "documents": "flexattn document mask",
         "sinks": "flexattn varlen + sinks"}


def lengths(n: int, low: int, high: int) -> list[int]:
    """``n`` seeded sequence lengths, uniform in [low, high]."""
    g = torch.Generator().manual_seed(n)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="python -m benchmarks varlen")
    results.add_common_arguments(p)
    p.add_argument("--seqs", type=int, default=None, help="sequences (GPU default 32, CPU 3)")
    p.add_argument("--min-len", type=int, default=None, help="shortest length (GPU default 128, CPU 5)")
    p.add_argument("--max-len", type=int, default=None, help="longest length (GPU default 8192, CPU 40)")
    p.add_argument("--heads", type=int, default=None, help="heads (GPU default 16, CPU 2)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (GPU default 128, CPU 16)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rep", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1,
                   help="timings per competitor, interleaved between competitors; the median is kept")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    return p


def competitors(q, k, v, cu, max_len: int, on_gpu: bool) -> dict:
    """impl -> forward function over the packed (T, H, D) tensors."""
    T = q.shape[0]
    impls = {"flexattn": lambda: flexattn.varlen_attention(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))}
    if on_gpu:
        from torch.nn.attention.varlen import varlen_attn

        impls["torch"] = lambda: varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))
    doc = torch.searchsorted(cu, torch.arange(T, dtype=torch.int32, device=q.device), right=True) - 1

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    bm = flexattn.create_block_mask(documents, 1, 1, T, T, device=q.device, BLOCK_SIZE=128 if on_gpu else 16)

    def emulation():
        q4, k4, v4 = (t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v))
        return flexattn.flex_attention(q4, k4, v4, block_mask=bm)[0].permute(1, 0, 2)

    impls["documents"] = emulation
    sinks = torch.full((q.shape[1],), -20.0, device=q.device, requires_grad=True)
    impls["sinks"] = lambda: flexattn.varlen_attention(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0),
                                                       sinks=sinks)
    return impls


def run(args) -> tuple[dict, list[dict]]:
    on_gpu = args.device != "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    n = args.seqs or (32 if on_gpu else 3)
    low, high = args.min_len or (128 if on_gpu else 5), args.max_len or (8192 if on_gpu else 40)
    H, D = args.heads or (16 if on_gpu else 2), args.head_dim or (128 if on_gpu else 16)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 0)
    rep = args.rep if args.rep is not None else (20 if on_gpu else 1)
    lens = lengths(n, low, high)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=args.device)
    T = int(cu[-1])
    g = torch.Generator(device=args.device).manual_seed(0)
    q, k, v = (torch.randn(T, H, D, device=args.device, generator=g).to(dtype).requires_grad_() for _ in range(3))
    d_out = torch.randn(T, H, D, device=args.device, generator=g).to(dtype)
    fwd_flops = sum(4 * H * D * L * (L + 1) // 2 for L in lens)
    config = {"dtype": str(dtype).removeprefix("torch."), "seqs": n, "lengths": f"{low}..{high}", "tokens": T,
              "H": H, "D": D, "rounds": max(1, args.rounds), "rep": rep, "backward": not args.no_backward}
    rows = []
    impls = competitors(q, k, v, cu, max(lens), on_gpu)
    for impl, fields in measure_case(impls, q, k, v, d_out, args, warmup, rep).items():
        rows.append(with_tflops({"case": f"causal {n} seqs", "impl": impl, "tokens": T, **fields}, fwd_flops))
    return config, rows


def print_table(rows: list[dict]) -> None:
    head = f"{'case':<18} {'impl':<24} {MEASURED}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['case']:<18} {IMPLS[r['impl']]:<24} {measured(r)}")


def main(argv=None) -> int:
    results.run_suite(SUITE, run, print_table, parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
