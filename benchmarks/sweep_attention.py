"""Tile/launch sweep for the forward and backward kernels (tuning aid; results go to docs/).

    python benchmarks/sweep_attention.py [--seq 8192] [--head-dims 64,128] [--cases causal,none]

Prints, for each case and head dim, forward and backward time and TFLOP/s of each candidate
configuration (passed through ``kernel_options``), best first.
"""

from __future__ import annotations

import argparse
import json

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
# D = 256: registers and shared memory bound the tiles
FWD_256 = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 1), (128, 128, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2)]
BWD_256 = [
    (64, 64, 64, 64, 8, 2), (64, 64, 64, 64, 8, 3), (64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 8, 2),
    (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 1),
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
    p.add_argument("--variants", default="{}",
                   help="';'-separated JSON kernel_options merged into every config, e.g. "
                        "'{};{\"LONGEST_FIRST\": true}'")
    p.add_argument("--default-only", action="store_true", help="only the default tiles (with each variant)")
    a = p.parse_args()
    variants = [json.loads(v) for v in a.variants.split(";")]
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
            fwd_cfgs = [None] if a.default_only else (FWD_256 if D > 128 else FWD)
            for cfg, extra in ((c, v) for c in fwd_cfgs for v in variants):
                opts = {**dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), cfg or ())), **extra}
                cfg = f"{cfg or 'default'} {json.dumps(extra) if extra else ''}"
                try:
                    with torch.no_grad():
                        ms = triton.testing.do_bench(lambda: flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options=opts),
                                                     warmup=50, rep=200)
                    rows.append((flops / ms / 1e9, ms, cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                    rows.append((0.0, float("nan"), f"{cfg} {type(e).__name__}"))
            for tf, ms, cfg in sorted(rows, key=lambda r: -r[0]):
                print(f"fwd D={D:<4} {case:<7} {str(cfg):<60} {ms:8.3f} ms {tf:7.1f} TF/s")
            if a.no_backward:
                continue
            rows = []
            for cfg in [None] if a.default_only else (BWD_256 if D > 128 else BWD):
                opts = dict(zip(("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages"),
                                cfg or ()))
                cfg = cfg or "default"
                try:
                    out = flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options=opts)
                    ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                                 warmup=50, rep=200)
                    rows.append((2.5 * flops / ms / 1e9, ms, cfg))
                except Exception as e:  # noqa: BLE001
                    rows.append((0.0, float("nan"), f"{cfg} {type(e).__name__}: {str(e)[:60]}"))
            for tf, ms, cfg in sorted(rows, key=lambda r: -r[0]):
                print(f"bwd D={D:<4} {case:<7} {str(cfg):<60} {ms:8.3f} ms {tf:7.1f} TF/s")


if __name__ == "__main__":
    main()
