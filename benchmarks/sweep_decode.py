"""Tile / split sweep for the decoding kernel (tuning aid; results go to docs/performance.md).

    python benchmarks/sweep_decode.py [--shapes "gqa B8 32k,mha B16 8k"] [--splits 0,8,16,32]

For each of bench_decode.py's shapes, times every (SPLIT_KV, BLOCK_N, num_warps, num_stages)
combination (SPLIT_KV 0: the default choice) and SDPA in the same process, and prints the K+V
bandwidth as a share of the device-to-device copy bandwidth, best first.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

import bench_decode  # benchmarks/bench_decode.py: the same shapes and copy bandwidth
from timing import timer
from flexattn.decode import decode_attention


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    p.add_argument("--splits", default="0", help="SPLIT_KV values; 0 = the default choice")
    p.add_argument("--block-n", default="64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--top", type=int, default=8, help="rows printed per shape")
    args = p.parse_args(argv)

    device = "cuda"
    copy_bw = bench_decode.copy_bandwidth(device)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} "
          f"| copy bandwidth {copy_bw / 1e12:.3f} TB/s")
    shapes = bench_decode.GPU_SHAPES
    if args.shapes:
        wanted = {s.strip() for s in args.shapes.split(",")}
        shapes = [s for s in shapes if s[0] in wanted]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for label, B, Hq, Hkv, L, D in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(*shape, device=device, generator=g).to(torch.bfloat16)
                   for shape in ((B, Hq, 1, D), (B, Hkv, L, D), (B, Hkv, L, D)))
        kv_bytes = (k.numel() + v.numel()) * k.element_size()
        gqa = Hq != Hkv
        ref = decode_attention(q, k, v, enable_gqa=gqa).float()

        def sdpa():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

        rows = [("SDPA (cuDNN/flash)", timer(sdpa, device, 5, args.rep), (sdpa().float() - ref).abs().max().item())]
        for split, bn, w, st in itertools.product(ints(args.splits), ints(args.block_n), ints(args.warps),
                                                  ints(args.stages)):
            opts = {"BLOCK_N": bn, "num_warps": w, "num_stages": st, **({"SPLIT_KV": split} if split else {})}
            fn = lambda: decode_attention(q, k, v, enable_gqa=gqa, kernel_options=opts)  # noqa: E731
            try:
                err = (fn().float() - ref).abs().max().item()
                rows.append((str(opts), timer(fn, device, 3, args.rep), err))
            except Exception as e:  # e.g. out of shared memory: reported, not fatal
                print(f"  {label} {opts}: {type(e).__name__}: {str(e)[:80]}")
        print(f"\n{label} (B={B} Hq={Hq} Hkv={Hkv} KV={L} D={D})")
        for name, t, err in sorted(rows, key=lambda r: r[1])[:args.top]:
            print(f"  {t * 1e6:9.1f} us  {100 * kv_bytes / t / copy_bw:6.1f}% copy  err {err:.1e}  {name}")
        sdpa_row = rows[0]
        print(f"  SDPA: {100 * kv_bytes / sdpa_row[1] / copy_bw:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
