"""create_block_mask: flexattn vs torch (eager and torch.compile'd), time and peak extra memory.

    python -m benchmarks block_mask                            # GPU: 32k, 128k, 1M tokens
    python benchmarks/bench_block_mask.py --sizes 2k --device cpu --no-compile

Masks: causal, and a 64-document mask (uneven document lengths, ``doc[q] == doc[kv]``), B = H = 1,
BLOCK_SIZE 128. Every implementation gets the user's Python mask_mod, as in real use (flexattn
traces it on each call, torch vmaps it).

Columns: median time per call (triton.testing.do_bench on CUDA, wall clock on CPU) and, on CUDA,
"extra MB": peak memory allocated during the call minus what was allocated before it, minus the
returned BlockMask's own tensors (the eight index tables are O(tiles) by format: 1 GB at 1M
tokens). So "extra" is the scratch an implementation needed on top of its answer. "OOM" means the
call ran out of memory; "match" says whether flexattn's tables equal the torch result it is
compared with.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):  # run as `python benchmarks/bench_block_mask.py`: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import results
from flexattn import create_block_mask

SUITE = "block_mask"
IMPLS = ("flexattn", "torch eager", "torch.compile")

FIELDS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"]


def parse_size(text: str) -> int:
    text = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "km" else text) * mult)


def masks(n: int, docs: int, device: str):
    gen = torch.Generator().manual_seed(0)
    # Uneven documents: lengths drawn from a wide range, scaled to sum to n.
    w = torch.rand(docs, generator=gen) * 4 + 0.25
    lengths = (w / w.sum() * n).floor().long()
    lengths[-1] += n - int(lengths.sum())
    doc = torch.repeat_interleave(torch.arange(docs), lengths).to(device)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return {"causal": causal, f"{docs}-document": document}


def output_bytes(bm) -> int:
    return sum(getattr(bm, f).numel() * getattr(bm, f).element_size()
               for f in FIELDS if getattr(bm, f) is not None)


def measure(fn, device: str, reps: int):
    """(ms, extra MB, result) or ("OOM", ...) / ("error: ...", ...)."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    try:
        result = fn()  # warm-up: compilation, tracing caches
        if device == "cuda":
            # Peak of a steady-state call (after compilation), timed with events; fast calls are
            # then re-timed with do_bench (slow ones, e.g. torch eager at 128k, only once more).
            torch.cuda.synchronize()
            del result
            gc.collect()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            extra = (torch.cuda.max_memory_allocated() - base - output_bytes(result)) / 2**20
            if ms < 100:
                ms = triton.testing.do_bench(fn, warmup=5, rep=max(50, reps * 10), return_mode="median")
        else:
            extra = float("nan")
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            ms = sorted(times)[len(times) // 2]
        return ms, extra, result
    except torch.OutOfMemoryError:
        return "OOM", None, None
    except Exception as e:  # noqa: BLE001 - a benchmark reports, it does not stop
        return f"error: {results.error_text(e)}", None, None
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def same(a, b) -> str:
    if a is None or b is None:
        return "-"
    b = b.to(a.kv_num_blocks.device) if hasattr(b, "to") else b
    ok = all((getattr(a, f) is None and getattr(b, f) is None) or torch.equal(getattr(a, f), getattr(b, f))
             for f in FIELDS)
    return "yes" if ok else "NO"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], prog="python -m benchmarks block_mask")
    results.add_common_arguments(p)
    p.add_argument("--sizes", default=None,
                   help="comma-separated token counts (k = 1024, M = 2**20; GPU default 32k,128k,1M, CPU 2k)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="timed calls on CPU (CUDA uses do_bench)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(create_block_mask)")
    p.add_argument("--no-torch", action="store_true", help="skip torch entirely (flexattn only)")
    return p


def run(args) -> tuple[dict, list[dict]]:
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm

    device = "cuda" if args.device != "cpu" else "cpu"
    sizes = args.sizes or ("32k,128k,1M" if device == "cuda" else "2k")
    torch_impls = {} if args.no_torch else {"torch eager": torch_cbm}
    if not (args.no_torch or args.no_compile or device == "cpu"):
        torch_impls["torch.compile"] = torch.compile(torch_cbm)
    rows = []
    for size in [parse_size(s) for s in sizes.split(",")]:
        for mname, mask in masks(size, args.docs, device).items():
            def call(fn, mask=mask, size=size):
                return lambda: fn(mask, 1, 1, size, size, device=device, BLOCK_SIZE=args.block_size)

            ref = None
            measured = {}
            for impl, fn in {"flexattn": create_block_mask, **torch_impls}.items():
                measured[impl] = measure(call(fn), device, args.reps)
                if impl != "flexattn" and measured[impl][2] is not None:
                    ref = measured[impl][2]
            match = same(measured["flexattn"][2], ref)
            for impl, (ms, extra, _) in measured.items():
                row = {"mask": mname, "tokens": size, "impl": impl}
                if isinstance(ms, str):
                    row["error"] = ms
                else:
                    row.update(ms=ms, extra_mb=None if extra is None or math.isnan(extra) else extra)
                rows.append({**row, "match": match} if impl == "flexattn" else row)
            del measured, ref
            print(f"# {mname} {size}: measured", flush=True)
    return {"B": 1, "H": 1, "BLOCK_SIZE": args.block_size, "docs": args.docs, "sizes": sizes}, rows


def cell(r: dict | None) -> str:
    if r is None:
        return f"{'skipped':>22}"
    if "error" in r:
        return f"{r['error'][:22]:>22}"
    mem = "" if r["extra_mb"] is None else f" {r['extra_mb']:8.1f} MB"
    text = f"{r['ms']:.3f} ms{mem}"
    return f"{text:>22}"


def print_table(rows: list[dict]) -> None:
    header = f"{'mask':>12} {'tokens':>8} | {'flexattn':>22} | {'torch eager':>22} | {'torch.compile':>22} | match"
    print(header)
    print("-" * len(header))
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r["mask"], r["tokens"]), {})[r["impl"]] = r
    for (mname, size), impls in by_case.items():
        print(f"{mname:>12} {size:>8} | " + " | ".join(cell(impls.get(i)) for i in IMPLS)
              + f" | {impls['flexattn'].get('match', '-')}")


def main(argv=None) -> int:
    results.run_suite(SUITE, run, print_table, parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
