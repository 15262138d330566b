"""``python -m benchmarks report``: docs/performance.md and one plot per GPU from benchmarks/results/*.json.

The page says what flexattn achieves on each GPU that has results, how the figures are counted and
the command that reproduces them. Results measured on the CPU (Triton's interpreter) are left
out: they check that a suite runs, they are not performance. The plots need matplotlib
(``pip install 'flexattn[plot]'``); without it the page is written and the plots are not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/report.py`: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import results

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m benchmarks && python -m benchmarks report"
TRAINING_IMPLS = {"flexattn": "flexattn", "torch": "torch.compile(flex_attention)", "sdpa": "cuDNN SDPA"}
VARLEN_IMPLS = {"flexattn": "flexattn varlen_attention", "torch": "torch varlen_attn",
                "documents": "flexattn document mask over the packed sequence",
                "sinks": "flexattn varlen_attention with sinks"}
NONE = "—"

METHOD = """\
## Method

- Every suite runs flexattn and its competitors in one process on the same seeded random inputs
  (`benchmarks/bench_*.py`). The training, packed-sequence and decoding suites record each
  competitor's largest difference from flexattn's output (and gradients) in the results JSON; the
  float8 suite records each run's largest error against a float64 attention of the same inputs;
  the context-parallel suite compares no outputs.
- Kernel times are medians of CUDA-event timings after warm-up (`benchmarks/timing.py`); the
  training and packed-sequence suites time the competitors in turns over several rounds, each
  round starting with the next competitor, and keep each one's median. A call's span starts when the host queues it, so
  for short calls it holds the host's time up to each launch; the training suite also times the
  GPU's work alone (the calls queued behind a sleep kernel: GPU only, vs torch).
- FLOPs: the forward counts 4·B·H·S²·D times the fraction of tiles the block mask visits (a causal
  mask is credited about half the work of no mask), packed sequences the causal work of each
  sequence, 4·H·D·L(L+1)/2; the backward counts 2.5 times the forward.
- Ratios are the competitor's time over flexattn's: above 1, flexattn is faster. cuDNN SDPA runs
  only where it can express the case (no mask, causal). determ. bwd: how much longer flexattn's
  backward takes in deterministic mode (`kernel_options={"DETERMINISTIC": True}`) than by default
  (the GPU's work alone where the run timed it).
- Decoding is memory bound: K+V bytes read per second, as a share of the device-to-device copy
  bandwidth measured in the same run.
- Context parallelism runs under `torchrun --nproc-per-node P benchmarks/bench_context_parallel.py`
  (one results file per P): times are per training step on every GPU, FLOPs count the (q, kv)
  pairs the mask keeps; efficiency is the one-GPU time of the whole sequence (flexattn) over P times
  the ring's; torch CP is torch's context parallel with `torch.compile(flex_attention)`. Mask ms:
  the wall time of a repeated block-mask build (`flexattn.distributed.create_block_mask` on every
  rank, flexattn's `create_block_mask` of the whole sequence on one GPU, torch's compiled CP mask;
  in runs at 70adb4a and later, the documents' ids in a new tensor at each build of the first two,
  as a training loop's batches). Mask ms added to a busy step (runs at 5e86b2f and later): what
  the same build adds to a step of six 8192 x 8192 bf16 matmuls around it, as in a training loop
  whose host runs ahead of the GPU (a build that waits for the GPU adds the time it then idles).
  Peak GiB: what the case allocates on a GPU, its inputs included (the ring's copy-engine slots
  added); one marked * counts everything live in the process, earlier cases' leftovers included.
- Per-call times are wall clock over a loop of calls (model code that builds its score_mod anew
  each call), the median of five interleaved rounds: host work plus launch for these small shapes.
"""


def fmt(x, spec: str = ".0f", suffix: str = "") -> str:
    return NONE if x is None else f"{x:{spec}}{suffix}"


def ratio(other: dict | None, ours: dict | None, key: str) -> float | None:
    """``other``'s time over ``ours`` (None where either did not run)."""
    if not other or not ours or other.get(key) is None or ours.get(key) is None:
        return None
    return other[key] / ours[key]


def determ_extra(impls: dict) -> float | None:
    """How much longer (%) flexattn's deterministic backward took than its default's in one case
    (``impls``: impl -> row; None where either did not run): the GPU's work alone where the run
    timed it for both (at S=2k a span holds the host's latency up to each launch, which varied
    more between the two rows than their kernels did), else the spans."""
    det, default = impls.get("flexattn deterministic"), impls.get("flexattn")
    r = ratio(det, default, "bwd_gpu_ms") or ratio(det, default, "bwd_ms")
    return None if r is None else 100 * r - 100


def span(values, spec: str, suffix: str = "") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return NONE
    lo, hi = min(values), max(values)
    return f"{lo:{spec}}{suffix}" if f"{lo:{spec}}" == f"{hi:{spec}}" else f"{lo:{spec}}–{hi:{spec}}{suffix}"


def env_line(record: dict) -> str:
    return (f"{record['date']} · {record['gpu']} · torch {record.get('torch', '?')} · "
            f"triton {record.get('triton', '?')} · CUDA {record.get('cuda') or '?'} · "
            f"flexattn {record.get('commit') or record.get('flexattn', '?')}")


def section(title: str, columns: list[str]) -> list[str]:
    """A table's heading and header rows."""
    return ["", f"### {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def training_cases(record: dict) -> dict:
    """(shape, case) -> impl -> row, in the order the suite ran them; a case that two merged runs
    measured (RUNS_MERGED) keeps the first run's rows."""
    cases: dict = {}
    owner: dict = {}  # (shape, case) -> the run its rows come from (None: the GPU's first)
    for row in record["rows"]:
        key = (row["shape"], row["case"])
        if owner.setdefault(key, row.get("run")) == row.get("run"):
            cases.setdefault(key, {})[row["impl"]] = row
    return cases


def training_table(record: dict) -> list[str]:
    dtype = record.get("config", {}).get("dtype", "")
    gpu_only = any(row.get("bwd_gpu_ms") is not None for row in record["rows"])  # (newer runs time it)
    lines = []
    by_case = training_cases(record)
    for shape in dict.fromkeys(row["shape"] for row in record["rows"]):
        B, H, S, D = shape.split("x")
        lines += section(f"Training attention: B={B} H={H} S={S} D={D}, {dtype}",
                         ["case", "tiles", "fwd TF/s", "vs torch", "vs cuDNN", "bwd TF/s", "vs torch", "vs cuDNN",
                          "determ. bwd", "torch fwd / bwd TF/s"]
                         + (["GPU only, vs torch fwd / bwd"] if gpu_only else []))
        # (RUNS_MERGED: a shape of another run than the GPU's first names that run above its table;
        # cases another run added to a shape of the first, below it)
        runs = {case: next(iter(impls.values())).get("run") for (s, case), impls in by_case.items() if s == shape}
        if None not in runs.values():
            lines[-2:-2] = [next(iter(runs.values())), ""]
        notes = [f"{case}: {run}" for case, run in runs.items() if run is not None and None in runs.values()]
        for (row_shape, case), impls in by_case.items():
            if row_shape != shape:
                continue
            ours, theirs, cudnn = impls.get("flexattn"), impls.get("torch"), impls.get("sdpa")
            ok = ours is not None and "error" not in ours
            tiles = next(iter(impls.values()))["tiles"]
            lines.append(
                f"| {case} | {tiles:.2f} | {fmt(ours.get('fwd_tflops') if ok else None)} | "
                f"{fmt(ratio(theirs, ours, 'fwd_ms'), '.2f', 'x')} | {fmt(ratio(cudnn, ours, 'fwd_ms'), '.2f', 'x')} | "
                f"{fmt(ours.get('bwd_tflops') if ok else None)} | {fmt(ratio(theirs, ours, 'bwd_ms'), '.2f', 'x')} | "
                f"{fmt(ratio(cudnn, ours, 'bwd_ms'), '.2f', 'x')} | "
                f"{fmt(determ_extra(impls), '+.0f', '%')} | "
                f"{fmt((theirs or {}).get('fwd_tflops'))} / {fmt((theirs or {}).get('bwd_tflops'))} |"
                + (f" {fmt(ratio(theirs, ours, 'fwd_gpu_ms'), '.2f', 'x')} / "
                   f"{fmt(ratio(theirs, ours, 'bwd_gpu_ms'), '.2f', 'x')} |" if gpu_only else ""))
        if notes:
            lines += ["", *(f"{note}  " for note in notes[:-1]), notes[-1]]
    return lines


def decode_table(record: dict) -> list[str]:
    config = record.get("config", {})
    lines = section(f"Decoding: Q_LEN={config.get('q_len', 1)}, {config.get('dtype', '')}, "
                    f"copy bandwidth {fmt(config.get('copy_tb_s'), '.2f')} TB/s",
                    ["shape (B, Hq, Hkv, KV, D)", "flexattn µs", "% of copy", "torch.compile(flex) %", "SDPA %"])
    shapes: dict = {}
    for row in record["rows"]:
        shapes.setdefault(row["shape"], {})[row["impl"]] = row
    for name, impls in shapes.items():
        ours = impls.get("flexattn", {})
        r = next(iter(impls.values()))
        lines.append(f"| {name} ({r['B']}, {r['Hq']}, {r['Hkv']}, {r['KV_LEN']}, {r['D']}) | "
                     f"{fmt(ours.get('time_us'), '.1f')} | {fmt(ours.get('pct_copy'), '.1f', '%')} | "
                     f"{fmt(impls.get('torch', {}).get('pct_copy'), '.1f', '%')} | "
                     f"{fmt(impls.get('sdpa', {}).get('pct_copy'), '.1f', '%')} |")
    return lines


def fp8_table(record: dict) -> list[str]:
    B, H, S, D = record.get("config", {}).get("shape", "?x?x?x?").split("x")
    lines = section(f"float8 forward: B={B} H={H} S={S} D={D}", ["case", "run", "TF/s", "max error vs float64"])
    for row in record["rows"]:
        lines.append(f"| {row['case']} | {row['impl']} | {fmt(row.get('fwd_tflops'))} | "
                     f"{fmt(row.get('max_err_f64'), '.4f')} |")
    return lines


def host_table(record: dict) -> list[str]:
    lines = section("Per call (host work and launch)", ["call", "unit", "flexattn", "torch.compile(flex)", "SDPA"])
    for row in record["rows"]:
        spec = ".2f" if row["unit"] == "s" else ".0f" if row["unit"] == "us" else ".1f"
        unit = "µs" if row["unit"] == "us" else row["unit"]
        lines.append(f"| {row['call']} | {unit} | {fmt(row['flexattn'], spec)} | {fmt(row.get('torch'), spec)} | "
                     f"{fmt(row.get('sdpa'), spec)} |")
    return lines


def block_mask_table(record: dict) -> list[str]:
    lines = section("create_block_mask (B = H = 1): time, extra memory",
                    ["mask", "tokens", "flexattn", "torch eager", "torch.compile"])
    cases: dict = {}
    for row in record["rows"]:
        cases.setdefault((row["mask"], row["tokens"]), {})[row["impl"]] = row

    def cell(row):
        if row is None:
            return NONE
        if "error" in row:
            return "out of memory" if row["error"] == "OOM" else "error"
        mem = "" if row.get("extra_mb") is None else f", {row['extra_mb']:.0f} MB"
        return f"{row['ms']:.2f} ms{mem}"

    for (mask, tokens), impls in cases.items():
        lines.append(f"| {mask} | {tokens} | " + " | ".join(cell(impls.get(i)) for i in
                                                          ("flexattn", "torch eager", "torch.compile")) + " |")
    return lines


def context_parallel_cases(record: dict) -> dict:
    """(P, S, mask) -> impl -> row, by P and S, then in the order the runs made them; a case that
    two results files measured keeps the first file's rows (a row's times are compared with
    the other impls' of the same run only)."""
    cases: dict = {}
    owner: dict = {}  # (P, S, mask) -> the file its rows come from
    for row in sorted(record["rows"], key=lambda r: (r["P"], r["S"])):
        key = (row["P"], row["S"], row["mask"])
        if owner.setdefault(key, row.get("file")) == row.get("file"):
            cases.setdefault(key, {})[row["impl"]] = row
    return cases


# bench_context_parallel's config["peak"] where a case's peak counts its own allocations only
PEAK_PER_CASE = "per case"


def efficiency(impls: dict) -> float | None:
    """Scaling efficiency of the ring: one GPU's time / (P x the ring's time)."""
    one, ring = impls.get("one_gpu") or {}, impls.get("ring") or {}
    if one.get("ms") is None or ring.get("ms") is None:
        return None
    return one["ms"] / (ring["P"] * ring["ms"])


def context_parallel_table(record: dict) -> list[str]:
    config = record.get("config", {})
    cases = context_parallel_cases(record)
    # (the mask build times: a column where any row has them; older runs did not record them)
    with_masks = any("mask_ms" in row for impls in cases.values() for row in impls.values())
    with_steps = any("mask_step_ms" in row for impls in cases.values() for row in impls.values())
    lines = section(f"Context parallelism: B={config.get('B', '?')} H={config.get('H', '?')} D={config.get('D', '?')}, "
                    f"{config.get('dtype', '')}, forward + backward, times per step",
                    ["P", "S", "mask", "ring ms", "all-gather ms", "torch CP ms", "one GPU ms", "ring TF/s per GPU",
                     "efficiency", "vs torch CP", "peak GiB ring / all-gather / torch CP"]
                    + ["mask ms ring / one GPU / torch CP"] * with_masks
                    + ["mask ms added to a busy step, ring / one GPU"] * with_steps + ["flexattn"])
    for (P, S, mask), impls in cases.items():
        ring, ag, one, theirs = (impls.get(i) or {} for i in ("ring", "allgather", "one_gpu", "torch_cp"))
        torch_ms = fmt(theirs.get("ms"), ".1f") if "error" not in theirs else "refused"
        # (peaks of a run that counted everything live in the process, not the case's own: marked)
        whole = "" if ring.get("peak") == PEAK_PER_CASE else "*"
        peaks = " / ".join(fmt(r.get("peak_gib"), ".1f", whole) for r in (ring, ag, theirs))
        mask_times = " / ".join(fmt(r.get("mask_ms"), ".1f") for r in (ring, one, theirs)) + " | " if with_masks else ""
        mask_times += " / ".join(fmt(r.get("mask_step_ms"), ".2f") for r in (ring, one)) + " | " if with_steps else ""
        lines.append(f"| {P} | {S} | {mask} | {fmt(ring.get('ms'), '.1f')} | {fmt(ag.get('ms'), '.1f')} | {torch_ms} | "
                     f"{fmt(one.get('ms'), '.1f')} | {fmt(ring.get('tflops_per_gpu'))} | "
                     f"{fmt(efficiency(impls), '.2f')} | {fmt(ratio(theirs, ring, 'ms'), '.2f', 'x')} | {peaks} | "
                     f"{mask_times}{ring.get('commit', '?')} |")
    return lines


def varlen_table(record: dict) -> list[str]:
    c = record.get("config", {})
    lines = section(f"Packed sequences: {c.get('seqs')} of {c.get('lengths')} tokens, H={c.get('H')} D={c.get('D')}, "
                    f"{c.get('dtype', '')}, causal", ["impl", "fwd TF/s", "bwd TF/s", "flexattn varlen fwd / bwd vs it"])
    rows = {row["impl"]: row for row in record["rows"]}
    ours = rows.get("flexattn")
    for impl, row in rows.items():
        ok = "error" not in row
        lines.append(f"| {VARLEN_IMPLS.get(impl, impl)} | {fmt(row.get('fwd_tflops') if ok else None)} | "
                     f"{fmt(row.get('bwd_tflops') if ok else None)} | {fmt(ratio(row, ours, 'fwd_ms'), '.2f', 'x')} / "
                     f"{fmt(ratio(row, ours, 'bwd_ms'), '.2f', 'x')} |")
    return lines


TABLES = {"attention": training_table, "decode": decode_table, "fp8": fp8_table, "host": host_table,
          "block_mask": block_mask_table, "context_parallel": context_parallel_table, "varlen": varlen_table}
# suites with one results file per number of GPUs: their records on one GPU model make one table
BY_GPU_COUNT = ("context_parallel",)
# Suites whose runs on one GPU (results files told apart by a tag) make one table: the untagged
# run's first, and each shape of another run says which run it is from.
RUNS_MERGED = ("attention",)


def summary(suites: dict) -> str:
    """One sentence per suite of what flexattn achieves on one GPU."""
    parts = []
    if "attention" in suites:
        cases = training_cases(suites["attention"]).values()
        subset = suites["attention"]["config"].get("cases")  # (a run of some cases: named)
        only = f" ({', '.join(subset)} only)" if subset else ""
        ours = [c["flexattn"] for c in cases if "error" not in c.get("flexattn", {"error": 1})]
        for key, what in (("fwd", "forward"), ("bwd", "backward")):
            tf = span([r.get(f"{key}_tflops") for r in ours], ".0f", " TF/s")
            if tf == NONE:
                continue
            torch_x = span([ratio(c.get("torch"), c.get("flexattn"), f"{key}_ms") for c in cases], ".2f", "x")
            cudnn_x = span([ratio(c.get("sdpa"), c.get("flexattn"), f"{key}_ms") for c in cases], ".2f", "x")
            parts.append(f"the training {what}{only} runs at {tf}, {torch_x} the speed of torch.compile(flex_attention)"
                         + ("" if cudnn_x == NONE else f" and {cudnn_x} that of cuDNN SDPA where it runs"))
        extra = [e for c in cases if (e := determ_extra(c)) is not None]
        if extra:
            parts.append(f"the deterministic backward takes at most {max(extra):.0f}% more time than the default's")
    if "decode" in suites:
        rows = suites["decode"]["rows"]
        ours = span([r.get("pct_copy") for r in rows if r["impl"] == "flexattn"], ".0f", "%")
        sdpa = span([r.get("pct_copy") for r in rows if r["impl"] == "sdpa"], ".0f", "%")
        parts.append(f"decoding reads K and V at {ours} of the copy bandwidth"
                     + ("" if sdpa == NONE else f" (SDPA: {sdpa})"))
    if "fp8" in suites:
        best = max((r["fwd_tflops"] for r in suites["fp8"]["rows"]
                    if r["impl"].startswith("flexattn float8") and r.get("fwd_tflops") is not None), default=None)
        if best is not None:
            parts.append(f"the float8 forward reaches {best:.0f} TF/s")
    if "context_parallel" in suites:
        cases = context_parallel_cases(suites["context_parallel"]).values()
        eff = span([efficiency(c) for c in cases], ".2f")
        torch_x = span([ratio(c.get("torch_cp"), c.get("ring"), "ms") for c in cases], ".2f", "x")
        parts.append(f"context parallelism (ring) scales with efficiency {eff}, {torch_x} the speed of torch's "
                     "context parallel")
    return "; ".join(parts) + "." if parts else "No suite with a table ran on this GPU."


def plot(record: dict, path: Path) -> None:
    """TF/s per training case, forward and backward, for flexattn, torch.compile(flex) and cuDNN:
    a row of two panels per shape."""
    import matplotlib  # optional (the plot extra): imported only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_shape: dict = {}
    for (shape, case), impls in training_cases(record).items():
        by_shape.setdefault(shape, {})[case] = impls
    widest = max(len(cases) for cases in by_shape.values())
    height = 3.4 * len(by_shape) + 0.6
    fig, axes = plt.subplots(len(by_shape), 2, figsize=(max(8.0, 2.2 * widest), height), sharey="row", squeeze=False)
    width = 0.8 / len(TRAINING_IMPLS)
    for row_axes, (shape, cases) in zip(axes, by_shape.items()):
        B, H, S, D = shape.split("x")
        for ax, key, title in zip(row_axes, ("fwd_tflops", "bwd_tflops"), ("forward", "backward")):
            for i, (impl, name) in enumerate(TRAINING_IMPLS.items()):
                values = [(impls.get(impl) or {}).get(key) or 0.0 for impls in cases.values()]
                ax.bar([x + (i - 1) * width for x in range(len(cases))], values, width, label=name)
            ax.set_xticks(range(len(cases)), list(cases), rotation=20, ha="right", fontsize=8)
            ax.set_title(f"{title}, TFLOP/s: B={B} H={H} S={S} D={D}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{record['gpu']}, {record.get('config', {}).get('dtype', '')} "
                 f"(torch {record.get('torch', '?')}, triton {record.get('triton', '?')}, {record['date']})")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / height))  # (the title's room above the first row)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(by_gpu: dict, image_of: dict) -> str:
    """The page: ``by_gpu`` maps a GPU name to its records by suite; ``image_of`` a GPU name to
    its plot's path relative to the page (absent: no plot)."""
    lines = ["<!-- Generated by `python -m benchmarks report` from benchmarks/results/*.json: "
             "edit benchmarks/report.py, not this page. -->", "", "# Performance", ""]
    if not by_gpu:
        lines += ["No benchmark results are recorded yet. On a machine with a CUDA GPU, from a source checkout:",
                  "", "```bash", COMMAND, "```", "",
                  "runs every suite, writes `benchmarks/results/<suite>-<gpu>.json` and writes this page with",
                  "one table and one plot per GPU.", "", METHOD.rstrip()]
        return "\n".join(lines) + "\n"
    for gpu, suites in by_gpu.items():
        lines.append(f"- **{gpu}**: {summary(suites)}")
    lines += ["", "Reproduce on a CUDA machine, from a source checkout (`--preset quick` for a shorter run):",
              "", "```bash", COMMAND, "```", "", METHOD.rstrip()]
    for gpu, suites in by_gpu.items():
        first = next(iter(suites.values()))
        lines += ["", f"## {gpu}", "", env_line(first)]
        if gpu in image_of:
            lines += ["", f"![TFLOP/s per case on {gpu}]({image_of[gpu]})"]
        for suite, record in suites.items():
            table = TABLES[suite](record)
            if env_line(record) != env_line(first):
                table[3:3] = [env_line(record), ""]
            lines += table
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=results.RESULTS_DIR, help="folder of the results JSON")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "performance.md", help="the page to write")
    p.add_argument("--no-plot", action="store_true", help="write the page without plots")
    args = p.parse_args(argv)
    by_gpu: dict = {}
    loaded = results.load(args.results) if args.results.is_dir() else []
    for file, record in enumerate(sorted(loaded, key=lambda r: bool(r.get("tag")))):  # (stable: as loaded)
        if record.get("device") == "cpu":
            print(f"report: {record['suite']} results from the CPU left out (the interpreter is no measurement)")
            continue
        if record["suite"] not in TABLES:
            raise ValueError(f"{args.results}: unknown suite {record['suite']!r} (known: {', '.join(TABLES)})")
        suites = by_gpu.setdefault(record["gpu"], {})
        earlier = suites.get(record["suite"])
        if record["suite"] in BY_GPU_COUNT:  # (one table of several runs: each row names its run's commit)
            rows = [{**r, "commit": r.get("commit") or record.get("commit") or "?",  # (a row may name its own)
                     "peak": r.get("peak") or record.get("config", {}).get("peak"), "file": file}
                    for r in record["rows"]]
            record = {**record, "rows": rows, "commit": " / ".join(dict.fromkeys(r["commit"] for r in rows))}
            if earlier is not None:
                record = {**earlier, "rows": earlier["rows"] + record["rows"],
                          **{key: " / ".join(dict.fromkeys(part for r in (earlier, record)
                                                           for part in f"{r.get(key) or '?'}".split(" / ")))
                             for key in ("date", "commit")}}
        elif record["suite"] in RUNS_MERGED and earlier is not None:
            record = {**earlier, "rows": earlier["rows"] + [{**r, "run": env_line(record)} for r in record["rows"]]}
        suites[record["suite"]] = record
    for suites in by_gpu.values():  # the suites in the order of TABLES
        ordered = {s: suites[s] for s in TABLES if s in suites}
        suites.clear()
        suites.update(ordered)
    image_of = {}
    if not args.no_plot and any("attention" in s for s in by_gpu.values()):
        try:
            import matplotlib  # noqa: F401 - optional dependency, checked before drawing
        except ImportError:
            print("report: matplotlib is not installed, so no plots (pip install 'flexattn[plot]')", file=sys.stderr)
        else:
            for gpu, suites in by_gpu.items():
                if "attention" in suites:
                    path = args.out.parent / "img" / f"performance-{results.slug(gpu)}.png"
                    plot(suites["attention"], path)
                    image_of[gpu] = path.relative_to(args.out.parent).as_posix()
                    print(f"report: wrote {path}")
    args.out.write_text(render(by_gpu, image_of))
    print(f"report: wrote {args.out} ({len(by_gpu)} GPU(s))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
