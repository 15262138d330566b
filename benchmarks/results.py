"""Structured benchmark results: the environment a run measured and one JSON file per suite and GPU."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
from pathlib import Path

import torch
import triton

import flexattn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CPU_NAME = "CPU (Triton interpreter)"


def gpu_name(device: str) -> str:
    """The device's marketing name, as torch reports it (the CPU: a fixed name)."""
    return CPU_NAME if device == "cpu" else torch.cuda.get_device_name(device)


def slug(name: str) -> str:
    """A file-name part for a GPU name: ``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    words = [w for w in words if w not in ("nvidia", "geforce", "triton", "interpreter")]
    if not words:
        raise ValueError(f"GPU name {name!r} has no letters or digits to name a results file by")
    return "-".join(words)


# What the benchmark tooling writes itself: a change there is no change to the code measured
WRITTEN = ("benchmarks/results", "docs/performance.md", "docs/img")


def git_commit(root: Path = RESULTS_DIR.parent.parent) -> str | None:
    """The checkout's commit (with ``-dirty`` when files other than `WRITTEN` differ from it: an
    earlier suite's results file is no change to the code), None outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                *(f":(exclude){path}" for path in WRITTEN)], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def environment(device: str) -> dict:
    """What a result depends on besides the code: date, GPU, library versions, commit."""
    return {
        "date": datetime.date.today().isoformat(),
        "device": "cpu" if device == "cpu" else "cuda",
        "gpu": gpu_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "flexattn": flexattn.__version__,
        "commit": git_commit(),
    }


def save(suite: str, env: dict, config: dict, rows: list[dict], folder: Path | None = None, tag: str = "") -> Path:
    """Write one suite's results to ``<folder>/<suite>[-<tag>]-<gpu slug>.json`` and return the path
    (``tag`` tells apart runs of one suite on one GPU model, e.g. the number of GPUs)."""
    folder = RESULTS_DIR if folder is None else Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{suite}{'-' + tag if tag else ''}-{slug(env['gpu'])}.json"
    record = {"suite": suite, **({"tag": tag} if tag else {}), **env, "config": config, "rows": rows}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load(folder: Path | None = None) -> list[dict]:
    """Every results record in ``folder``, sorted by GPU and suite."""
    folder = RESULTS_DIR if folder is None else Path(folder)
    records = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        missing = {"suite", "gpu", "date", "rows"} - record.keys()
        if missing:
            raise ValueError(f"{path}: not a benchmark results file (no {', '.join(sorted(missing))})")
        records.append(record)
    return records


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every suite takes: where it runs and where its results go."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda (default where there is one) or cpu (Triton's interpreter: tiny shapes, "
                             "flexattn only, for checking that the suite runs)")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR,
                        help=f"folder of the JSON results (default {RESULTS_DIR})")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    parser.add_argument("--tag", default="", help="save as <suite>-<tag>-<gpu>.json, beside the suite's other runs "
                                                  "on the GPU (the page shows the training suite's runs together)")


def run_suite(suite: str, run, print_table, args: argparse.Namespace) -> Path | None:
    """Run one suite (``run(args) -> (config, rows)``), print its table, save its results."""
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch.cuda.is_available() is False here (use --device cpu)")
    env = environment(args.device)
    config, rows = run(args)
    print(f"# {suite}: {env['gpu']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']} | "
          f"flexattn {env['flexattn']} ({env['commit'] or 'no git commit'}) | {env['date']}")
    print("# " + ", ".join(f"{k}={v}" for k, v in config.items()))
    print_table(rows)
    if args.no_save:
        return None
    path = save(suite, env, config, rows, args.results, tag=getattr(args, "tag", ""))
    print(f"# results: {path}")
    return path


def error_text(exc: BaseException) -> str:
    """One short line for a competitor that could not run a case."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
