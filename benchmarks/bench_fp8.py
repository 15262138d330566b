"""float8 forward benchmark: flexattn float8_e4m3fn vs flexattn bfloat16 vs torch.compile(flex_attention)
and SDPA in bfloat16, in one process on the same (dequantised) values.

    python benchmarks/bench_fp8.py                    # B=4, H=16, S=8192, D=128 (GPU)
    python benchmarks/bench_fp8.py --seq 2048
    python benchmarks/bench_fp8.py --batch 2 --heads 8 --seq 4096 --head-dim 256

flexattn's float8 runs are the default choice, then each of its two kernels by name (on an H100:
the Gluon Hopper kernel, BACKEND='FLASH'; the block-sparse Triton template, BACKEND='TRITON').

Each input is quantised per tensor (max |x| -> 448) and every competitor gets the same values:
float8 with its descale factors for flexattn's float8 run, the dequantised values in bfloat16 for
the others. The error column is the max |out - float64 attention of the dequantised inputs| over
batch 0, heads 0-1 (a float64 reference of the whole batch would not fit in memory).
"""

from __future__ import annotations

import argparse

import torch
import triton

import flexattn
from timing import timer  # benchmarks/timing.py


def quantise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.abs().max() / 448).reshape(1).float()
    return (x / s).to(torch.float8_e4m3fn), s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rep", type=int, default=20)
    args = p.parse_args(argv)
    B, H, S, D = args.batch, args.heads, args.seq, args.head_dim
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    compiled_flex = torch.compile(torch_flex, dynamic=False)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"flexattn {flexattn.__version__} | B={B} H={H} S={S} D={D}")
    torch.manual_seed(0)
    (q8, dq), (k8, dk), (v8, dv) = (quantise(torch.randn(B, H, S, D, device="cuda")) for _ in range(3))
    q, k, v = ((x.float() * s).bfloat16() for x, s in ((q8, dq), (k8, dk), (v8, dv)))
    # float8 P V reads V K-major: flexattn copies a row-major V into that layout each call; a V
    # stored that way (this one) skips the copy.
    v8_k_major = v8.transpose(2, 3).contiguous().transpose(2, 3)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    print(f"{'case':<9} {'impl':<26} {'fwd ms':>8} {'TF/s':>7} {'max err (f64)':>14}")
    for case in ("no mask", "causal"):
        bm = flexattn.create_block_mask(causal, 1, 1, S, S, device="cuda") if case == "causal" else None
        tbm = torch_block_mask(causal, 1, 1, S, S, device="cuda") if case == "causal" else None
        impls = {
            "flexattn float8": lambda: flexattn.flex_attention(q8, k8, v8, block_mask=bm, descale_q=dq,
                                                               descale_k=dk, descale_v=dv),
            "flexattn float8 V K-major": lambda: flexattn.flex_attention(q8, k8, v8_k_major, block_mask=bm,
                                                                         descale_q=dq, descale_k=dk, descale_v=dv),
            # both float8 kernels (the default picks by head dim, see flexattn/kernels/hopper.py)
            "flexattn float8 Gluon": lambda: flexattn.flex_attention(
                q8, k8, v8_k_major, block_mask=bm, descale_q=dq, descale_k=dk, descale_v=dv,
                kernel_options={"BACKEND": "FLASH"}),
            "flexattn float8 Triton": lambda: flexattn.flex_attention(
                q8, k8, v8_k_major, block_mask=bm, descale_q=dq, descale_k=dk, descale_v=dv,
                kernel_options={"BACKEND": "TRITON"}),
            "flexattn bfloat16": lambda: flexattn.flex_attention(q, k, v, block_mask=bm),
            "torch flex bfloat16": lambda: compiled_flex(q, k, v, block_mask=tbm),
        }

        def sdpa():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

        impls["SDPA bfloat16 (cuDNN)"] = sdpa
        sl = (slice(0, 1), slice(0, 2))
        ref = torch.softmax((q[sl].double() @ k[sl].double().transpose(-1, -2)) / D ** 0.5 + (
            torch.full((S, S), float("-inf"), device="cuda", dtype=torch.float64).triu(1) if case == "causal"
            else 0), dim=-1) @ v[sl].double()
        flops = 4 * B * H * S * S * D * (0.5 if case == "causal" else 1.0)
        for name, fn in impls.items():
            with torch.no_grad():
                out = fn()
                err = (out[sl].double() - ref).abs().max().item()
                t = timer(fn, "cuda", 5, args.rep)
            print(f"{case:<9} {name:<26} {t * 1e3:>8.3f} {flops / t / 1e12:>7.1f} {err:>14.4f}")
        del ref
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
