"""Training attention, forward and backward: flexattn vs torch.compile(flex_attention) vs SDPA.

    python -m benchmarks attention                                # B=4, H=16, S=8192, D=128, bf16
    python -m benchmarks attention --shape 1x16x2048x128 --shape 4x32x8192x64
    python benchmarks/bench_attention.py --device cpu             # tiny shape, flexattn only (interpreter)

Cases: no mask, causal, sliding window 1024 (causal), alibi + causal, tanh softcap, 16 documents
(packed sequences of uneven lengths, causal inside each document); on request (``--cases``) "tanh
softcap (cap read at run time)": the soft-cap's Python float seen changing first, so flexattn passes
it as a kernel argument instead of folding it (what folding a constant is worth); "documents
(int64 ids)": the documents' ids captured as int64, as torch.arange and torch.repeat_interleave make them
(flexattn's kernels read their int32 ranks, flexattn/block_mask/ranks.py). All competitors run in one
process on the same tensors, with each one's output and gradients compared to flexattn's
(max|diff|, grad diff: the largest of dQ, dK, dV). TFLOP/s counts 4·B·H·S·S·D for the forward and
2.5x that for the backward, times the fraction of tiles the block mask visits (so a causal run is
credited about half the work of a dense one). SDPA (cuDNN, else flash) runs where it can express
the case (no mask, causal).

``--rounds N`` times every competitor N times, taking turns (flexattn, torch, SDPA, flexattn, ...),
and keeps each one's median: a shared host drifts by tens of percent within a minute, and a short
call (S=2k) can be bound by the host, so one timing per competitor reads whichever drift it met.
On a GPU each call is also timed with the GPU's work alone (GPU fwd / bwd, `timing.gpu_timer`):
where the host takes longer to reach a call's launches than the GPU takes to run them, the two
differ, and the GPU-only time is the kernels' own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):  # run as `python benchmarks/bench_attention.py`: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flexattn
from flexattn import scalars
from benchmarks import results
from benchmarks.timing import gpu_timer, timer

SUITE = "attention"
IMPLS = {"flexattn": "flexattn", "flexattn deterministic": "flexattn determ.", "flexattn dq pass": "flexattn dQ pass",
         "torch": "torch.compile(flex)",
         "sdpa": "SDPA (cuDNN/flash)"}


def document_ids(S: int, docs: int, device: str) -> torch.Tensor:
    """[S] int32 document id of each position: `docs` documents of uneven, seeded lengths."""
    g = torch.Generator().manual_seed(docs)
    weights = torch.rand(docs, generator=g) + 0.25
    bounds = (weights.cumsum(0) / weights.sum() * S).round().long()
    return torch.bucketize(torch.arange(S), bounds, right=True).clamp_max(docs - 1).to(torch.int32).to(device)


def softcap_of(cap: float):
    def softcap_at_run_time(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_at_run_time


def cap_read_at_run_time(device: str):
    """The soft-cap whose ``cap`` flexattn reads at run time: its code has been called with two
    values, which makes the closure's number a kernel argument (flexattn/scalars.py)."""
    x = torch.randn(1, 1, 16, 16, device=device)
    for cap in (29.0, 30.0):
        flexattn.flex_attention(x, x, x, score_mod=softcap_of(cap))
    made = softcap_of(30.0)
    if not scalars.dynamic_slots(made.__code__):
        raise RuntimeError("the soft-cap's cap is still folded: flexattn/scalars.py's rule changed")
    return made


# cases run only when --cases names them
ON_REQUEST = ("tanh softcap (cap read at run time)", "documents (int64 ids)")


def cases(H: int, S: int, window: int, docs: int, device: str, names=None):
    """name -> (score_mod or None, mask_mod or None, SDPA is_causal or None when SDPA cannot), for
    ``names`` (default: all but the ON_REQUEST ones)."""
    slopes = torch.exp2(-8.0 * (torch.arange(H, dtype=torch.float32, device=device) + 1) / H)
    doc = document_ids(S, docs, device)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    doc64 = doc.long()  # (the ids as torch.arange and torch.repeat_interleave make them)

    def documents_int64(b, h, q_idx, kv_idx):
        return (doc64[q_idx] == doc64[kv_idx]) & (q_idx >= kv_idx)

    made = {
        "no mask": (None, None, False),
        "causal": (None, causal, True),
        f"sliding window {window}": (None, sliding_window, None),
        "alibi + causal": (alibi, causal, None),
        "tanh softcap": (softcap, None, None),
        f"{docs} documents": (None, documents, None),
    }
    if names is None:
        return made
    if ON_REQUEST[0] in names:
        made[ON_REQUEST[0]] = (cap_read_at_run_time(device), None, None)
    if ON_REQUEST[1] in names:
        made[ON_REQUEST[1]] = (None, documents_int64, None)
    unknown = sorted(set(names) - made.keys())
    if unknown:
        raise ValueError(f"--cases: no case named {', '.join(map(repr, unknown))}; the cases at these "
                         f"arguments: {', '.join(map(repr, [*made, *ON_REQUEST]))}")
    return {name: case for name, case in made.items() if name in names}


def visited_fraction(block_mask) -> float:
    """Fraction of (query tile, KV tile) pairs a block mask visits (1.0 without one)."""
    if block_mask is None:
        return 1.0
    n = block_mask.kv_num_blocks.sum().item()
    if block_mask.full_kv_num_blocks is not None:
        n += block_mask.full_kv_num_blocks.sum().item()
    b, h, n_q = block_mask.kv_num_blocks.shape
    q_len, kv_len = block_mask.seq_lengths
    q_blk, kv_blk = (block_mask.BLOCK_SIZE if isinstance(block_mask.BLOCK_SIZE, tuple)
                     else (block_mask.BLOCK_SIZE,) * 2)
    return n / (b * h * triton.cdiv(q_len, q_blk) * triton.cdiv(kv_len, kv_blk))



def shape(text: str) -> tuple[int, int, int, int]:
    """``BxHxSxD`` (e.g. ``4x16x8192x128``) -> (B, H, S, D)."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is BxHxSxD with four positive integers, got {text!r}")
    return tuple(int(p) for p in parts)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="python -m benchmarks attention")
    results.add_common_arguments(p)
    p.add_argument("--shape", type=shape, action="append", metavar="BxHxSxD",
                   help="batch x heads x sequence x head dim, repeatable (GPU default 4x16x8192x128, CPU 1x2x96x32)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--window", type=int, default=None, help="sliding window (GPU default 1024, CPU 32)")
    p.add_argument("--docs", type=int, default=None, help="documents of the document case (GPU 16, CPU 3)")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--rep", type=int, default=None)
    p.add_argument("--rounds", type=int, default=1,
                   help="timings per competitor, interleaved between competitors; the median is kept")
    p.add_argument("--no-torch", action="store_true", help="flexattn only")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--kernel-options", type=json.loads, default=None, metavar="JSON",
                   help='kernel_options for flexattn\'s calls, e.g. \'{"BACKEND": "TRITON"}\'')
    return p


def competitors(q, k, v, score_mod, mask_mod, sdpa_causal, S, block, torch_impls,
                kernel_options=None, deterministic: bool = False) -> tuple[dict, float]:
    """(impl -> forward function, fraction of tiles visited) for one case; ``torch_impls`` is None
    (flexattn only) or (compiled flex_attention, torch's create_block_mask); ``kernel_options``
    go to flexattn's calls; ``deterministic``: also flexattn in deterministic mode (what its
    backward costs) and, on the GPU, with dQ by the dQ pass (`DQ_PASS`)."""
    bm = (flexattn.create_block_mask(mask_mod, 1, 1, S, S, device=q.device, BLOCK_SIZE=block)
          if mask_mod is not None else None)
    impls = {"flexattn": lambda: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                         kernel_options=kernel_options)}
    if deterministic:
        impls["flexattn deterministic"] = lambda: flexattn.flex_attention(
            q, k, v, score_mod=score_mod, block_mask=bm,
            kernel_options={**(kernel_options or {}), "DETERMINISTIC": True})
    if deterministic and q.is_cuda:  # (the Hopper backward's dQ by a dQ pass: the Gluon one where it runs)
        impls["flexattn dq pass"] = lambda: flexattn.flex_attention(
            q, k, v, score_mod=score_mod, block_mask=bm, kernel_options={**(kernel_options or {}), "DQ_PASS": True})
    if torch_impls is None:
        return impls, visited_fraction(bm)
    compiled_flex, torch_block_mask = torch_impls
    tbm = (torch_block_mask(mask_mod, 1, 1, S, S, device=q.device, BLOCK_SIZE=block)
           if mask_mod is not None else None)
    impls["torch"] = lambda: compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm)
    if sdpa_causal is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=sdpa_causal)
        impls["sdpa"] = sdpa
    return impls, visited_fraction(bm)


def measure_case(impls: dict, q, k, v, d_out, args, warmup: int, rep: int) -> dict:
    """impl -> {fwd_ms, bwd_ms, fwd_gpu_ms, bwd_gpu_ms, max_diff, grad_diff} or {error}: outputs
    checked against flexattn's, then timed in interleaved rounds (the GPU-only times: None on the
    CPU, or where the GPU's work could not be isolated)."""
    base = base_grads = None
    out_of = {}
    checked = {}  # impl -> (result fields, backward closure or None)
    for impl, fn in impls.items():
        try:
            with torch.no_grad():
                out = fn()
                base = out if base is None else base
                fields = {"max_diff": (out.float() - base.float()).abs().max().item(), "grad_diff": None}
            backward = None
            if not args.no_backward:
                out = fn()
                grads = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
                base_grads = grads if base_grads is None else base_grads
                fields["grad_diff"] = max((a.float() - b.float()).abs().max().item()
                                          for a, b in zip(grads, base_grads))
                del grads
                backward = (lambda out=out: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True))
            checked[impl] = (fields, backward)
        except Exception as e:  # a competitor that cannot run a case is reported, not fatal
            out_of[impl] = {"error": results.error_text(e)}
    t_fwd, t_bwd = {impl: [] for impl in checked}, {impl: [] for impl in checked}
    # (the GPU's time alone, where the device has one: `gpu_timer`)
    g_fwd, g_bwd = {impl: [] for impl in checked}, {impl: [] for impl in checked}
    for r in range(max(1, args.rounds)):
        # (each round starts one impl later, so that none is always timed first: in two processes
        # on an H100 the first impl's forward read 14-16% slower than the same kernel timed second)
        order = list(checked)
        first = r % len(order) if order else 0
        order = order[first:] + order[:first]
        for impl in order:
            if impl not in checked:
                continue
            backward = checked[impl][1]
            try:
                with torch.no_grad():
                    t_fwd[impl].append(timer(impls[impl], args.device, warmup, rep))
                    if args.device != "cpu":
                        g_fwd[impl].append(gpu_timer(impls[impl], 0, rep))
                if backward is not None:
                    t_bwd[impl].append(timer(backward, args.device, warmup, rep))
                    if args.device != "cpu":
                        g_bwd[impl].append(gpu_timer(backward, 0, rep))
            except Exception as e:
                del checked[impl]
                out_of[impl] = {"error": results.error_text(e)}
    for impl, (fields, _) in checked.items():
        fields["fwd_ms"] = statistics.median(t_fwd[impl]) * 1e3
        fields["bwd_ms"] = statistics.median(t_bwd[impl]) * 1e3 if t_bwd[impl] else None
        for key, times in (("fwd_gpu_ms", g_fwd[impl]), ("bwd_gpu_ms", g_bwd[impl])):
            fields[key] = statistics.median(times) * 1e3 if times and None not in times else None
        out_of[impl] = fields
    checked.clear()  # (the saved graphs hold their activations)
    return out_of


def run(args) -> tuple[dict, list[dict]]:
    on_gpu = args.device != "cpu"
    dtype = getattr(torch, args.dtype) if on_gpu else torch.float32
    shapes = args.shape or [(4, 16, 8192, 128) if on_gpu else (1, 2, 96, 32)]
    window = args.window or (1024 if on_gpu else 32)
    docs = args.docs or (16 if on_gpu else 3)
    warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 0)
    rep = args.rep if args.rep is not None else (20 if on_gpu else 1)
    block = 128 if on_gpu else 32
    torch_impls = None
    if on_gpu and not args.no_torch:
        from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
        from torch.nn.attention.flex_attention import flex_attention as torch_flex

        # Six cases x (grad on/off) recompile flex_attention more than dynamo's default limit of 8;
        # past it dynamo silently falls back to the eager, dense implementation.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch_impls = (torch.compile(torch_flex, dynamic=False), torch_block_mask)
    config = {"dtype": str(dtype).removeprefix("torch."), "shapes": [f"{B}x{H}x{S}x{D}" for B, H, S, D in shapes],
              "window": window, "docs": docs, "BLOCK_SIZE": block, "rounds": max(1, args.rounds), "rep": rep,
              "backward": not args.no_backward, "kernel_options": args.kernel_options}
    if args.cases:  # (a subset: the report names it)
        config["cases"] = [c.strip() for c in args.cases.split(",")]
    rows = []
    for B, H, S, D in shapes:
        g = torch.Generator(device=args.device).manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device=args.device, generator=g).to(dtype).requires_grad_()
                   for _ in range(3))
        d_out = torch.randn(B, H, S, D, device=args.device, generator=g).to(dtype)
        selected = cases(H, S, window, docs, args.device,
                         None if not args.cases else {c.strip() for c in args.cases.split(",")})
        fwd_flops = 4 * B * H * S * S * D
        for case, (score_mod, mask_mod, sdpa_causal) in selected.items():
            impls, tiles = competitors(q, k, v, score_mod, mask_mod, sdpa_causal, S, block, torch_impls,
                                        args.kernel_options, deterministic=not args.no_backward)
            for impl, fields in measure_case(impls, q, k, v, d_out, args, warmup, rep).items():
                row = {"shape": f"{B}x{H}x{S}x{D}", "B": B, "H": H, "S": S, "D": D, "case": case,
                       "impl": impl, "tiles": tiles, **fields}
                rows.append(with_tflops(row, fwd_flops * tiles))
        del q, k, v, d_out
    return config, rows


#: The columns `measured` fills.
def with_tflops(row: dict, fwd_flops: float) -> dict:
    """``row`` with the forward's and backward's TFLOP/s (the backward counted as 2.5 forwards),
    where it was timed."""
    if "fwd_ms" in row:
        row["fwd_tflops"] = fwd_flops / (row["fwd_ms"] * 1e-3) / 1e12
        row["bwd_tflops"] = None if row["bwd_ms"] is None else 2.5 * fwd_flops / (row["bwd_ms"] * 1e-3) / 1e12
    return row


MEASURED = (f"{'fwd ms':>9} {'fwd TF/s':>9} {'bwd ms':>9} {'bwd TF/s':>9} {'GPU fwd':>8} {'GPU bwd':>8} "
            f"{'max|diff|':>10} {'grad diff':>10}")


def measured(r: dict) -> str:
    """A result row's timings and differences (or its error), under `MEASURED`."""
    if "error" in r:
        return f" n/a  {r['error']}"
    bwd = (f"{r['bwd_ms']:>9.3f} {r['bwd_tflops']:>9.1f}" if r["bwd_ms"] is not None else f"{'-':>9} {'-':>9}")
    gerr = f"{r['grad_diff']:>10.2e}" if r["grad_diff"] is not None else f"{'-':>10}"
    gpu = " ".join(f"{r[k]:>8.3f}" if r.get(k) is not None else f"{'-':>8}" for k in ("fwd_gpu_ms", "bwd_gpu_ms"))
    return f"{r['fwd_ms']:>9.3f} {r['fwd_tflops']:>9.1f} {bwd} {gpu} {r['max_diff']:>10.2e} {gerr}"


def print_table(rows: list[dict]) -> None:
    head = f"{'shape':<16} {'case':<22} {'impl':<20} {'tiles':>6} {MEASURED}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['shape']:<16} {r['case']:<22} {IMPLS[r['impl']]:<20} {r['tiles']:>6.3f} {measured(r)}")


def main(argv=None) -> int:
    results.run_suite(SUITE, run, print_table, parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
