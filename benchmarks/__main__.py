"""``python -m benchmarks``: run benchmark suites, write their JSON results, print their tables.

    python -m benchmarks                          # every suite at the shapes docs/performance.md shows
    python -m benchmarks attention decode         # some suites
    python -m benchmarks --preset quick           # smaller shapes, a quicker look
    python -m benchmarks attention -- --cases causal --rounds 5   # arguments for the suites after --
    python -m benchmarks report                   # docs/performance.md and its plots from the results

Each suite writes ``benchmarks/results/<suite>-<gpu>.json`` (``--results`` for another folder);
``python -m benchmarks <suite> --help`` (after ``--``) lists a suite's own options. On a machine
without CUDA every suite but fp8 runs through Triton's interpreter at tiny shapes: a check that it
runs, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python benchmarks/__main__.py`: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_attention, bench_block_mask, bench_decode, bench_fp8, bench_host, bench_varlen, report, results

SUITES = {"attention": bench_attention, "decode": bench_decode, "fp8": bench_fp8, "host": bench_host,
          "block_mask": bench_block_mask, "varlen": bench_varlen}
# Suite arguments of each preset on a GPU (on the CPU every suite takes its tiny defaults).
PRESETS = {
    "quick": {"attention": ["--shape", "1x16x2048x128"], "decode": ["--shapes", "gqa B8 32k,mha B16 8k"],
              "fp8": ["--shape", "1x16x2048x128"], "host": ["--calls", "100"],
              "block_mask": ["--sizes", "32k", "--no-compile"], "varlen": ["--max-len", "2048"]},
    "issue": {"attention": ["--shape", "4x16x8192x128", "--rounds", "3"], "decode": [], "fp8": [], "host": [],
              "block_mask": ["--sizes", "32k,128k,1M"], "varlen": ["--rounds", "3"]},
    "full": {"attention": ["--shape", "4x16x8192x128", "--shape", "4x32x8192x64", "--shape", "2x8x4096x256",
                           "--shape", "4x16x2048x128", "--rounds", "3"],
             "decode": [], "fp8": [], "host": [], "block_mask": ["--sizes", "32k,128k,1M"], "varlen": ["--rounds", "3"]},
    "none": {},
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suites", nargs="*", metavar="SUITE",
                   help=f"all (the default), or some of: {', '.join(SUITES)}; or 'report' (see report --help)")
    p.add_argument("--preset", default="issue", choices=list(PRESETS),
                   help="the shapes every suite runs (GPU only; default issue: the shapes docs/performance.md shows)")
    results.add_common_arguments(p)
    return p


def suite_argv(name: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    argv = ["--device", args.device, "--results", str(args.results)] + (["--no-save"] if args.no_save else [])
    argv += ["--tag", args.tag] if args.tag else []  # (else a tagged run overwrites the suite's untagged file)
    if args.device != "cpu":
        argv += PRESETS[args.preset].get(name, [])
    return argv + extra


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        return report.main(argv[1:])
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser().parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    unknown = [s for s in args.suites if s not in SUITES and s != "all"]
    if unknown:
        parser().error(f"unknown suite {unknown[0]!r}; choose from all, report, {', '.join(SUITES)}")
    names = list(SUITES) if not args.suites or "all" in args.suites else args.suites
    if args.device == "cpu" and "fp8" in names:
        print("# fp8: skipped (float8 attention needs a CUDA GPU)", flush=True)
        names = [n for n in names if n != "fp8"]
    failed = []
    for name in names:
        print(f"\n== {name}", flush=True)
        try:
            SUITES[name].main(suite_argv(name, args, extra))
        except Exception:  # one suite's failure is reported; the others still run
            traceback.print_exc()
            failed.append(name)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
