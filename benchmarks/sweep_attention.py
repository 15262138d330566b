"""Tile/launch sweep for the forward and backward kernels (tuning aid; results go to docs/).

    python benchmarks/sweep_attention.py [--seq 8192] [--head-dims 64,128] [--cases causal,none]

Prints, for each case and head dim, forward and backward time and TFLOP/s of each candidate
configuration (passed through ``kernel_options``), best first; for the backward also the time of
its dK/dV pass and of its dQ pass on their own (the two launches can take different tiles).

Compiling dozens of configs takes minutes; ``--compile-only --shard i/n`` runs each config of
shard i once without timing, so n processes can fill Triton's cache side by side before the
timing run.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import bench_attention  # benchmarks/bench_attention.py: the same cases
import flexattn
from flexattn.kernels import launch

FWD = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 32, 4, 4),
    (64, 64, 4, 3), (128, 64, 8, 4),
]
BWD = [  # BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, bwd_num_warps, bwd_num_stages
    (64, 128, 128, 64, 8, 2), (64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 4, 3), (64, 128, 128, 64, 8, 4),
    (32, 128, 128, 32, 4, 3), (32, 128, 128, 32, 8, 3), (64, 64, 64, 64, 4, 3), (64, 64, 64, 64, 8, 3),
    (32, 64, 64, 32, 4, 3), (128, 128, 128, 128, 8, 2), (128, 64, 64, 128, 8, 3), (64, 64, 128, 64, 8, 3),
    (64, 128, 64, 128, 8, 3), (32, 64, 64, 32, 4, 4),
]
# D = 256: registers and shared memory bound the tiles
FWD_256 = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 1), (128, 128, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2)]
BWD_256 = [
    (64, 64, 64, 64, 8, 2), (64, 64, 64, 64, 8, 3), (64, 64, 64, 64, 4, 2), (32, 64, 64, 32, 8, 2),
    (64, 128, 128, 64, 8, 2), (32, 64, 64, 32, 4, 1),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--cases", default="causal,none",
                   help="none, or names of bench_attention.py's cases: causal, sliding, alibi, softcap, documents")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--no-forward", action="store_true")
    p.add_argument("--variants", default="{}",
                   help="';'-separated JSON kernel_options merged into every config, e.g. "
                        "'{};{\"LONGEST_FIRST\": true}'")
    p.add_argument("--default-only", action="store_true", help="only the default tiles (with each variant)")
    p.add_argument("--compile-only", action="store_true", help="run each config once, no timing")
    p.add_argument("--shard", default="0/1", help="i/n: only every n-th config, from the i-th")
    a = p.parse_args()
    shard, shards = map(int, a.shard.split("/"))

    def mine(configs):
        return configs[shard::shards]

    def time_ms(fn):
        if a.compile_only:
            fn()
            return float("nan")
        return triton.testing.do_bench(fn, warmup=50, rep=200)

    variants = [json.loads(v) for v in a.variants.split(";")]
    B, H, S = a.batch, a.heads, a.seq
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} "
          f"| B={B} H={H} S={S} bf16")
    for D in map(int, a.head_dims.split(",")):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        named = bench_attention.cases(H, S, 1024, 16, "cuda")
        for case in a.cases.split(","):
            score_mod, mask_mod = (None, None) if case == "none" else \
                next(spec[:2] for name, spec in named.items() if case in name)
            bm = None if mask_mod is None else flexattn.create_block_mask(mask_mod, None, None, S, S, device="cuda")
            flops = 4 * B * H * S * S * D * bench_attention.visited_fraction(bm)
            rows = []
            fwd_cfgs = [] if a.no_forward else [None] if a.default_only else mine(FWD_256 if D > 128 else FWD)
            for cfg, extra in ((c, v) for c in fwd_cfgs for v in variants):
                opts = {**dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), cfg or ())), **extra}
                cfg = f"{cfg or 'default'} {json.dumps(extra) if extra else ''}"
                try:
                    with torch.no_grad():
                        ms = time_ms(lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                                     kernel_options=opts))
                    rows.append((flops / ms / 1e9, ms, cfg))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                    rows.append((0.0, float("nan"), f"{cfg} {type(e).__name__}"))
            for tf, ms, cfg in sorted(rows, key=lambda r: -r[0]):
                print(f"fwd D={D:<4} {case:<7} {str(cfg):<60} {ms:8.3f} ms {tf:7.1f} TF/s")
            if a.no_backward:
                continue
            rows = []
            bwd_cfgs = [None] if a.default_only else mine(BWD_256 if D > 128 else BWD)
            for cfg, extra in ((c, v) for c in bwd_cfgs for v in variants):
                opts = {**dict(zip(("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps",
                                    "bwd_num_stages"), cfg or ())), **extra}
                cfg = f"{cfg or 'default'} {json.dumps(extra) if extra else ''}"
                try:
                    out = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, kernel_options=opts)

                    def step():
                        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

                    # The backward's launches: preprocess, dK/dV pass, dQ pass, each timed alone too.
                    sites = launch.recorded_launches(step)
                    ms = time_ms(step)
                    dkdv, dq = (time_ms(lambda s=s, x=x: s(*x)) for s, x in sites[1:3])
                    rows.append((2.5 * flops / ms / 1e9, ms, cfg, dkdv, dq))
                except Exception as e:  # noqa: BLE001
                    rows.append((0.0, float("nan"), f"{cfg} {type(e).__name__}: {str(e)[:60]}", 0.0, 0.0))
            for tf, ms, cfg, dkdv, dq in sorted(rows, key=lambda r: -r[0]):
                print(f"bwd D={D:<4} {case:<7} {str(cfg):<60} {ms:8.3f} ms {tf:7.1f} TF/s "
                      f"(dK/dV {dkdv:.3f} ms, dQ {dq:.3f} ms)")


if __name__ == "__main__":
    main()
