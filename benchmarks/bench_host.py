"""Per-call cost of the calls model code makes, flexattn vs torch.compile(flex_attention) vs SDPA.

    python -m benchmarks host                        # GPU: the three calls, host overhead, first calls
    python benchmarks/bench_host.py --device cpu --calls 20   # CPU: host work only (interpreter)

Every call builds its score_mod anew, as a model's ``forward`` does. "per call" is wall-clock
time per call over a loop (synchronised at the end), the median of five rounds in which the
contenders take turns: for these small shapes that is host work plus launch, the figure a
32-layer model pays per layer. Also measured: flexattn's host work over
a bare launch of the same Triton kernel with the same arguments, a new length in
``create_block_mask`` after the first, and the first call of a never-seen mod (trace + codegen
+ Triton compile). Prints one table.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

if __package__ in (None, ""):  # run as `python benchmarks/bench_host.py`: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexattn
from benchmarks import results
from flexattn.reference import attention_reference
from tests.helpers.launches import recorded_launches

SUITE = "host"


def per_call(fn, calls: int, device: str) -> float:
    """Microseconds per call of ``fn`` in a loop (after warm-up)."""
    for _ in range(5):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def per_call_side_by_side(fns: dict, calls: int, device: str, rounds: int = 5) -> dict:
    """`per_call` of each of ``fns`` (name -> function; None entries skipped), measured in
    ``rounds`` interleaved rounds: the median of each. A shared host drifts by tens of percent
    within a minute; interleaving lets every contender see the same drift."""
    fns = {k: f for k, f in fns.items() if f is not None}
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(per_call(f, calls, device))
    return {k: statistics.median(v) for k, v in times.items()}


def bare_launch(run_call):
    """A function doing Triton's own ``kernel[grid](*args, **constexprs)`` for the first kernel
    ``run_call`` launches, with the same arguments: the floor flexattn's host work is measured
    against (flexattn itself launches the compiled kernel directly after the first calls)."""
    site, args = recorded_launches(run_call)[0]
    # all arguments (UNUSED -> the placeholder tensor), and a Hopper kernel's TMA descriptors made
    # of the tensors in their places, as a launch through Triton gets them
    args = site._described(site._fill(site._full(args)))
    return lambda: site.kernel[site.grid](*args, **site.constexprs)


def check_output(what: str, ours: torch.Tensor, theirs: torch.Tensor, reference: torch.Tensor) -> None:
    """flexattn's output is as close to the float64 ``reference`` as torch's: its largest error at
    most twice torch's, plus a rounding of the dtype at the output's largest value."""
    err = (ours.double() - reference).abs().max().item()
    budget = 2 * (theirs.double() - reference).abs().max().item() + \
        torch.finfo(ours.dtype).eps * reference.abs().max().item()
    if not err <= budget:
        raise AssertionError(f"{what}: flexattn's largest error against float64 is {err:.3g}, more than "
                             f"{budget:.3g} (twice torch.compile(flex_attention)'s and a rounding)")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def row(call: str, r: dict, unit: str = "us") -> dict:
    return {"call": call, "unit": unit, **{k: r.get(k) for k in ("flexattn", "torch", "sdpa", "bare_launch")}}


def decoding_step(device, dtype, calls, compiled_flex) -> dict:
    """B=1, Hq=32, Hkv=8, KV=4096, D=128, a score_mod masking past a 0-d position."""
    gpu = compiled_flex is not None
    B, Hq, Hkv, KV, D = (1, 32, 8, 4096, 128) if gpu else (1, 4, 2, 256, 32)
    q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, KV, D, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, KV, D, device=device, dtype=dtype)
    pos = torch.tensor(KV - 100, device=device, dtype=torch.int32)

    def fa_decode():
        return flexattn.flex_attention(q, k, v, enable_gqa=True,
                                       score_mod=lambda s, b, h, qi, ki: torch.where(ki <= pos, s, -math.inf))

    def torch_decode():
        return compiled_flex(q, k, v, enable_gqa=True,
                             score_mod=lambda s, b, h, qi, ki: torch.where(ki <= pos, s, -math.inf))

    r = per_call_side_by_side({
        "flexattn": fa_decode, "bare_launch": bare_launch(fa_decode),
        "torch": torch_decode if gpu else None,
        "sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) if gpu else None,
    }, calls, device)
    if gpu:
        check_output("decoding step", fa_decode(), torch_decode(), attention_reference(
            q, k, v, enable_gqa=True, score_mod=lambda s, b, h, qi, ki: torch.where(ki <= pos, s, -math.inf)))
    return row(f"decoding step B={B} Hq={Hq} Hkv={Hkv} KV={KV} D={D}", r)


def python_int_decoding_loop(device, dtype, calls) -> list[dict]:
    """The decoding step with its position a plain Python int that grows every step (the
    score_mod captures it; flexattn passes it as a kernel argument once it has changed), beside
    the same step repeated at one position; torch.compile(flex_attention) with its default
    automatic dynamic shapes, which makes such an int symbolic after one recompile."""
    gpu = device != "cpu"
    B, Hq, Hkv, KV, D = (1, 32, 8, 4096, 128) if gpu else (1, 4, 2, 256, 32)
    q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
    k = torch.randn(B, Hkv, KV, D, device=device, dtype=dtype)
    v = torch.randn(B, Hkv, KV, D, device=device, dtype=dtype)
    positions = itertools.count(KV // 2)
    dynamic_flex = torch.compile(torch_flex) if gpu else None

    def step(attend, pos):
        return attend(q, k, v, enable_gqa=True, score_mod=lambda s, b, h, qi, ki: torch.where(ki <= pos, s, -math.inf))

    def growing(attend):
        return None if attend is None else lambda: step(attend, next(positions) % KV)

    def repeated(attend):
        return None if attend is None else lambda: step(attend, KV - 100)

    rows = []
    for name, make in (("a Python int position growing every step", growing),
                       ("the same step repeated at one Python int position", repeated)):
        r = per_call_side_by_side({"flexattn": make(flexattn.flex_attention), "torch": make(dynamic_flex)},
                                  calls, device)
        rows.append(row(f"decoding loop, {name}, B={B} Hq={Hq} Hkv={Hkv} KV={KV} D={D}", r))
    return rows


def tiny_forwards(device, dtype, calls, compiled_flex) -> list[dict]:
    """B=1, H=4, S=256, a score_mod with a closure constant; on the GPU at D=64 (the Triton
    template) and D=128 (on an H100/H200, the Hopper kernel: TMA descriptor arguments)."""
    gpu = compiled_flex is not None
    rows = []
    for S, H, D in [(256, 4, 64), (256, 4, 128)] if gpu else [(64, 2, 32)]:
        q, k, v = (torch.randn(1, H, S, D, device=device, dtype=dtype) for _ in range(3))

        def fa_tiny():
            cap = 30.0
            return flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: cap * torch.tanh(s / cap))

        def torch_tiny():
            cap = 30.0
            return compiled_flex(q, k, v, score_mod=lambda s, b, h, qi, ki: cap * torch.tanh(s / cap))

        r = per_call_side_by_side({"flexattn": fa_tiny, "bare_launch": bare_launch(fa_tiny),
                                   "torch": torch_tiny if gpu else None}, calls, device)
        if gpu:
            check_output(f"tiny forward D={D}", fa_tiny(), torch_tiny(), attention_reference(
                q, k, v, score_mod=lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0)))
        rows.append(row(f"tiny forward B=1 H={H} S={S} D={D}", r))
    return rows


def causal(b, h, qi, ki):
    return qi >= ki


def training_step(device, dtype, calls, compiled_flex) -> dict:
    """B=8, H=16, S=1024, D=64, causal, forward + backward."""
    gpu = compiled_flex is not None
    B, H, S, D = (8, 16, 1024, 64) if gpu else (1, 2, 64, 16)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, S, D, device=device, dtype=dtype)
    mask = flexattn.create_block_mask(causal, None, None, S, S, device=device)
    tmask = torch_create_block_mask(causal, None, None, S, S, device=device) if gpu else None
    r = per_call_side_by_side({
        "flexattn": lambda: flexattn.flex_attention(q, k, v, block_mask=mask).backward(g),
        "torch": (lambda: compiled_flex(q, k, v, block_mask=tmask).backward(g)) if gpu else None,
        "sdpa": (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)) if gpu else None,
    }, max(calls // 3, 5), device)
    return row(f"training step B={B} H={H} S={S} D={D} causal fwd+bwd", r)


def new_mask_lengths(device) -> dict:
    """create_block_mask for a new length after the first (the median of five lengths)."""
    base = 8192 if device == "cuda" else 256
    flexattn.create_block_mask(causal, None, None, base, base, device=device)
    times = []
    for i in range(1, 6):
        n = base + 128 * i + 7
        sync(device)
        t = time.perf_counter()
        flexattn.create_block_mask(causal, None, None, n, n, device=device)
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    return row(f"create_block_mask, a new length after {base}", {"flexattn": statistics.median(times)}, "ms")


def first_call(device, dtype) -> dict:
    """The first call of a never-seen mod (trace, codegen, Triton compile)."""
    q, k, v = (torch.randn(1, 4, 256, 64, device=device, dtype=dtype) for _ in range(3))
    c = random.Random().random() + 1.0  # a constant no earlier run compiled
    sync(device)
    t = time.perf_counter()
    flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * c - (qi - ki).abs() * 0.01)
    sync(device)
    return row("first call of a never-seen score_mod (trace + codegen + compile)",
               {"flexattn": time.perf_counter() - t}, "s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="python -m benchmarks host")
    results.add_common_arguments(p)
    p.add_argument("--calls", type=int, default=None, help="calls per timing (GPU default 300, CPU 20)")
    return p


def run(args) -> tuple[dict, list[dict]]:
    device = args.device
    gpu = device != "cpu"
    calls = args.calls or (300 if gpu else 20)
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    compiled_flex = torch.compile(torch_flex, dynamic=False) if gpu else None
    rows = [decoding_step(device, dtype, calls, compiled_flex),
            *python_int_decoding_loop(device, dtype, calls),
            *tiny_forwards(device, dtype, calls, compiled_flex),
            training_step(device, dtype, calls, compiled_flex),
            new_mask_lengths(device), first_call(device, dtype)]
    config = {"dtype": str(dtype).removeprefix("torch."), "calls": calls, "training_calls": max(calls // 3, 5),
              "rounds": 5}
    return config, rows


def print_table(rows: list[dict]) -> None:
    def fmt(x):
        return "—" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.2f}"

    print("| call | unit | flexattn | torch.compile(flex) | SDPA | bare Triton launch | flexattn host work over it |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        over = "—" if r["bare_launch"] is None else f"{r['flexattn'] - r['bare_launch']:.1f}"
        print(f"| {r['call']} | {r['unit']} | {fmt(r['flexattn'])} | {fmt(r['torch'])} | {fmt(r['sdpa'])} | "
              f"{fmt(r['bare_launch'])} | {over} |")


def main(argv=None) -> int:
    results.run_suite(SUITE, run, print_table, parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
