"""Decoding: flexattn's split-KV kernel vs torch.compile(flex_attention) vs SDPA.

    python -m benchmarks decode                                # the four standard shapes, bf16
    python -m benchmarks decode --shapes "gqa B8 32k" --split-kv 16 --block-n 64
    python benchmarks/bench_decode.py --device cpu             # tiny shape, flexattn only (interpreter)

Decoding is memory bound: the figure of merit is K+V bytes read per second, reported against the
GPU's own device-to-device copy bandwidth measured in the same run (a large tensor copy: read +
write bytes over time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/bench_decode.py`: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import results
from benchmarks.timing import timer
from flexattn.decode import decode_attention

SUITE = "decode"
IMPLS = {"flexattn": "flexattn", "torch": "torch.compile(flex)", "sdpa": "SDPA (cuDNN/flash)"}
# (name, B, Hq, Hkv, KV_LEN, D)
GPU_SHAPES = [
    ("gqa B8 32k", 8, 32, 8, 32768, 128),
    ("gqa B1 128k", 1, 32, 8, 131072, 128),
    ("gqa B64 4k", 64, 32, 8, 4096, 128),
    ("mha B16 8k", 16, 32, 32, 8192, 128),
]
CPU_SHAPES = [("tiny", 1, 4, 2, 300, 32)]


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Bytes/s of a large device-to-device copy (counting the bytes read and written)."""
    n = int(gib * (1 << 30)) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), device, 3, 10 if device != "cpu" else 3)
    return 2 * src.numel() * src.element_size() / t


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="python -m benchmarks decode")
    results.add_common_arguments(p)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated shape names (default: all of {', '.join(s[0] for s in GPU_SHAPES)})")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rep", type=int, default=None)
    p.add_argument("--no-torch", action="store_true", help="flexattn only")
    p.add_argument("--split-kv", type=int, default=None)
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--programs-per-sm", type=float, default=None)
    return p


def competitors(q, k, v, opts: dict, compiled_flex) -> dict:
    """impl -> function for one shape (flexattn only when ``compiled_flex`` is None)."""
    gqa = q.shape[1] != k.shape[1]
    impls = {"flexattn": lambda: decode_attention(q, k, v, enable_gqa=gqa, kernel_options=opts)}
    if compiled_flex is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        impls["torch"] = lambda: compiled_flex(q, k, v, enable_gqa=gqa)

        def sdpa():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                              SDPBackend.EFFICIENT_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        impls["sdpa"] = sdpa
    return impls


def run(args) -> tuple[dict, list[dict]]:
    on_gpu = args.device != "cpu"
    dtype = getattr(torch, args.dtype) if on_gpu else torch.float32
    shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    if args.shapes:
        wanted = {s.strip() for s in args.shapes.split(",")}
        shapes = [s for s in shapes if s[0] in wanted]
    warmup = args.warmup if args.warmup is not None else (10 if on_gpu else 1)
    rep = args.rep if args.rep is not None else (50 if on_gpu else 2)
    opts = {k: v for k, v in (("SPLIT_KV", args.split_kv), ("BLOCK_N", args.block_n),
                              ("num_warps", args.num_warps), ("num_stages", args.num_stages),
                              ("PROGRAMS_PER_SM", args.programs_per_sm)) if v is not None}
    compiled_flex = None
    if on_gpu and not args.no_torch:
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        compiled_flex = torch.compile(torch_flex, dynamic=False)
    copy_bw = copy_bandwidth(args.device, 2.0 if on_gpu else 0.05)
    config = {"dtype": str(dtype).removeprefix("torch."), "q_len": args.q_len, "copy_tb_s": copy_bw / 1e12,
              "kernel_options": opts, "rep": rep}
    rows = []
    for label, B, Hq, Hkv, L, D in shapes:
        g = torch.Generator(device=args.device).manual_seed(0)
        q = torch.randn(B, Hq, args.q_len, D, device=args.device, generator=g).to(dtype)
        k = torch.randn(B, Hkv, L, D, device=args.device, generator=g).to(dtype)
        v = torch.randn(B, Hkv, L, D, device=args.device, generator=g).to(dtype)
        kv_bytes = (k.numel() + v.numel()) * k.element_size()
        impls = competitors(q, k, v, opts, compiled_flex)
        base = impls["flexattn"]()
        for impl, fn in impls.items():
            row = {"shape": label, "B": B, "Hq": Hq, "Hkv": Hkv, "KV_LEN": L, "D": D, "impl": impl}
            try:
                row["max_diff"] = (fn().float() - base.float()).abs().max().item()
                t = timer(fn, args.device, warmup, rep)
            except Exception as e:  # a competitor that cannot run this shape is reported, not fatal
                rows.append({**row, "error": results.error_text(e)})
                continue
            row.update(time_us=t * 1e6, kv_tb_s=kv_bytes / t / 1e12, pct_copy=100 * kv_bytes / t / copy_bw)
            rows.append(row)
    return config, rows


def print_table(rows: list[dict]) -> None:
    head = f"{'shape':<13} {'impl':<20} {'time (us)':>10} {'KV TB/s':>8} {'% copy':>7} {'max|diff|':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<13} {IMPLS[r['impl']]:<20} {'n/a':>10}  {r['error']}")
        else:
            print(f"{r['shape']:<13} {IMPLS[r['impl']]:<20} {r['time_us']:>10.1f} {r['kv_tb_s']:>8.3f} "
                  f"{r['pct_copy']:>6.1f}% {r['max_diff']:>10.2e}")


def main(argv=None) -> int:
    results.run_suite(SUITE, run, print_table, parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
