"""The flexattn demo: one attention variant written two ways, run, and checked.

    python -m flexattn.demo            # GPU if there is one, else the CPU (Triton's interpreter)

It builds a packed-documents + causal + sliding-window mask (Python) and an ALiBi + tanh
soft-capping score mod (DSL text), makes the BlockMask, runs flexattn's fused kernel, and checks
the result against a float64 eager reference.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy
import torch
import triton

import flexattn
from flexattn.reference import attention_reference


def main(argv=None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 4096 GPU, 200 CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    S = args.seq or (4096 if on_gpu else 200)
    B, H, D = (2, 8, 64) if on_gpu else (1, 2, 32)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    torch.manual_seed(0)

    # Three documents of uneven length packed into one sequence.
    lengths = torch.tensor([S // 2, S // 3, S - S // 2 - S // 3])
    doc_id = torch.repeat_interleave(torch.arange(3), lengths).to(device=device, dtype=torch.int32)
    window = S // 4

    def doc_causal_window(b, h, q_idx, kv_idx):
        same_doc = doc_id[q_idx] == doc_id[kv_idx]
        return same_doc & (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)
    alibi_softcap = flexattn.score_mod(
        "let biased = score - slope[h] * (q_idx - kv_idx)\n"
        "cap * tanh(biased / cap)",
        slope=slopes, cap=30.0,
    )

    block = 128 if on_gpu else 32
    block_mask = flexattn.create_block_mask(doc_causal_window, B, H, S, S, device=device, BLOCK_SIZE=block)
    print(f"flexattn {flexattn.__version__} on {device} ({'GPU' if on_gpu else 'Triton CPU interpreter'})")
    print(f"B={B} H={H} S={S} D={D} {dtype}; block mask (one head), sparsity {block_mask.sparsity():.1f}%:")
    print(block_mask[0, 0].to_string() if S // block <= 40 else "(too large to draw)")

    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
    t0 = time.perf_counter()
    out, lse = flexattn.flex_attention(q, k, v, score_mod=alibi_softcap, block_mask=block_mask, return_lse=True)
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    ref, ref_lse = attention_reference(q, k, v, score_mod=alibi_softcap, block_mask=block_mask,
                                       return_lse=True, dtype=torch.float64)
    err = (out.double() - ref).abs().max().item()
    lse_err = (lse.double() - ref_lse).abs().max().item()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"first call (compile + run): {elapsed:.2f}s")
    print(f"max |out - float64 reference| = {err:.2e}, max |lse - reference| = {lse_err:.2e} (tolerance {tol:g})")
    if not err < tol or not lse_err < tol * 10:
        print("MISMATCH")
        print(f"(for a bug report: {_platform()})")
        return 1
    print("OK")
    return 0


def _platform() -> str:
    """The versions and the processor a numerical result depends on: on the CPU the kernels run
    through Triton's interpreter, i.e. numpy's SIMD math functions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    umath = getattr(getattr(numpy, "_core", None), "_multiarray_umath", None)
    simd = getattr(umath, "__cpu_features__", {})
    found = ",".join(k for k in ("AVX2", "AVX512F", "AVX512_SKX", "AVX512_ICL", "AVX512_SPR") if simd.get(k))
    return (f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__} "
            f"[{found or 'no AVX2'}], {cpu}")


if __name__ == "__main__":
    raise SystemExit(main())
