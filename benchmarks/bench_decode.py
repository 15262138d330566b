"""Decoding benchmark: flexattn's split-KV kernel vs torch.compile(flex_attention) vs SDPA.

    python benchmarks/bench_decode.py                       # the four standard shapes, bf16, GPU
    python benchmarks/bench_decode.py --device cpu          # tiny shape, flexattn only (interpreter)
    python benchmarks/bench_decode.py --split-kv 16 --block-n 64 --num-warps 4 --num-stages 3

Decoding is memory bound: the figure of merit is K+V bytes read per second, reported against the
GPU's own device-to-device copy bandwidth measured here (a large tensor copy: read + write bytes
over time). Prints one table.
"""

from __future__ import annotations

import argparse

import torch
import triton

import flexattn
from timing import timer  # benchmarks/timing.py (scripts run from any directory)
from flexattn.decode import decode_attention

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rep", type=int, default=None)
    p.add_argument("--no-torch", action="store_true", help="flexattn only")
    p.add_argument("--split-kv", type=int, default=None)
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--programs-per-sm", type=float, default=None)
    args = p.parse_args(argv)

    device = args.device
    on_gpu = device != "cpu"
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
    run_torch = on_gpu and not args.no_torch

    copy_bw = copy_bandwidth(device, 2.0 if on_gpu else 0.05)
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU (Triton interpreter)"
    print(f"# {name} | torch {torch.__version__} | triton {triton.__version__} | flexattn {flexattn.__version__}")
    print(f"# {args.dtype if on_gpu else 'float32'}, Q_LEN={args.q_len}, copy bandwidth {copy_bw / 1e12:.3f} TB/s"
          f" (device-to-device copy, read + write), kernel_options={opts}")

    if run_torch:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        compiled_flex = torch.compile(torch_flex, dynamic=False)

    rows = []
    for label, B, Hq, Hkv, L, D in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, Hq, args.q_len, D, device=device, generator=g).to(dtype)
        k = torch.randn(B, Hkv, L, D, device=device, generator=g).to(dtype)
        v = torch.randn(B, Hkv, L, D, device=device, generator=g).to(dtype)
        kv_bytes = (k.numel() + v.numel()) * k.element_size()
        gqa = Hq != Hkv
        impls = {"flexattn": lambda: decode_attention(q, k, v, enable_gqa=gqa, kernel_options=opts)}
        if run_torch:
            impls["torch flex (compile)"] = lambda: compiled_flex(q, k, v, enable_gqa=gqa)

            def sdpa():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                  SDPBackend.EFFICIENT_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            impls["SDPA (cuDNN/flash)"] = sdpa
        base = impls["flexattn"]()
        for impl, fn in impls.items():
            try:
                err = (fn().float() - base.float()).abs().max().item()
                t = timer(fn, device, warmup, rep)
            except Exception as e:  # a competitor that cannot run this shape is reported, not fatal
                rows.append((label, impl, None, None, None, None, f"{type(e).__name__}: {str(e)[:50]}"))
                continue
            bw = kv_bytes / t
            rows.append((label, impl, t * 1e6, bw / 1e12, 100 * bw / copy_bw, err, ""))

    head = f"{'shape':<13} {'impl':<22} {'time (us)':>10} {'KV TB/s':>8} {'% copy':>7} {'max|diff|':>10}"
    print(head)
    print("-" * len(head))
    for label, impl, t, bw, pct, err, note in rows:
        if t is None:
            print(f"{label:<13} {impl:<22} {'n/a':>10}  {note}")
        else:
            print(f"{label:<13} {impl:<22} {t:>10.1f} {bw:>8.3f} {pct:>6.1f}% {err:>10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
