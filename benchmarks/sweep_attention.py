"""Tile/launch sweep for the forward and backward kernels (tuning aid; results go to docs/).

    python benchmarks/sweep_attention.py [--seq 8192] [--head-dims 64,128] [--cases causal,none]

Prints, for each case and head dim, forward and backward time and TFLOP/s of each candidate
configuration (passed through ``kernel_options``), best first.
"""

from __future__ import annotations

import argparse

import torch
import triton

import flexattn

FWD = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 4),
    (64, 64, 4, 3), (128, 64, 8, 4),
]
BWD = [  # BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, bwd_num_warps, bwd_num_stages
    (64, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 4, 3),
    (32, 128, 128, 32, 4, 3), (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 8, 1),
    (128, 128, 128, 128, 8, 2),
]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--cases", default="causal,none")
    p.add_argument("--no-backward", action="store_true")
    a = p.parse_args()
    B, H, S = a.batch, a.heads, a.seq
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | B={B} H={H} S={S} bf16")
    for D in map(int, a.head_dims.split(",")):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        for case in a.cases.split(","):
            bm = flexattn.create_block_mask(causal, None, None, S, S, device="cuda") if case == "causal" else None
            frac = 0.5 + 0.5 * 128 / S if case == "causal" else 1.0
            flops = 4 * B * H * S * S * D * frac
            rows = []
            for cfg in FWD:
                opts = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), cfg))
                try:
                    with torch.no_grad():
                        ms = triton.testing.do_bench(lambda: flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options=opts),
                                                     warmup=50, rep=200)
                    rows.append((flops / ms / 1e9, ms, cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                    rows.append((0.0, float("nan"), f"{cfg} {type(e).__name__}"))
            for tf, ms, cfg in sorted(rows, key=lambda r: -r[0]):
                print(f"fwd D={D:<4} {case:<7} {str(cfg):<34} {ms:8.3f} ms {tf:7.1f} TF/s")
            if a.no_backward:
                continue
            rows = []
            for cfg in BWD:
                opts = dict(zip(("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages"), cfg))
                try:
                    out = flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options=opts)
                    ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                                 warmup=50, rep=200)
                    rows.append((2.5 * flops / ms / 1e9, ms, cfg))
                except Exception as e:  # noqa: BLE001
                    rows.append((0.0, float("nan"), f"{cfg} {type(e).__name__}: {str(e)[:60]}"))
            for tf, ms, cfg in sorted(rows, key=lambda r: -r[0]):
                print(f"bwd D={D:<4} {case:<7} {str(cfg):<34} {ms:8.3f} ms {tf:7.1f} TF/s")


if __name__ == "__main__":
    main()
