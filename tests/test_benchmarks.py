"""The benchmark tooling on the CPU: results files, the suite runner, and the generated page."""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest
import torch

from benchmarks import __main__ as cli
from benchmarks import bench_attention, report, results


def env(gpu: str, date: str = "2030-01-02") -> dict:
    return {"date": date, "device": "cuda", "gpu": gpu, "torch": "2.13.0", "triton": "3.9.0", "cuda": "13.0",
            "flexattn": "0.1.0", "commit": "abc123"}


def training_row(case: str, impl: str, fwd_ms: float, bwd_ms: float | None, tiles: float = 1.0) -> dict:
    flops = 4 * 4 * 16 * 8192 * 8192 * 128 * tiles
    return {"shape": "4x16x8192x128", "B": 4, "H": 16, "S": 8192, "D": 128, "case": case, "impl": impl,
            "tiles": tiles, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "max_diff": 0.0, "grad_diff": 0.0,
            "fwd_tflops": flops / fwd_ms / 1e9, "bwd_tflops": None if bwd_ms is None else 2.5 * flops / bwd_ms / 1e9}


def write_h100(folder):
    """An H100 with every suite; the causal case has no cuDNN row and torch failed on it."""
    rows = [training_row("no mask", "flexattn", 2.0, 5.0), training_row("no mask", "torch", 3.0, 6.0),
            training_row("no mask", "sdpa", 2.2, 4.5), training_row("no mask", "flexattn deterministic", 2.0, 5.6),
            training_row("causal", "flexattn", 1.0, 2.5, tiles=0.5),
            {"shape": "4x16x8192x128", "case": "causal", "impl": "torch", "tiles": 0.5,
             "error": "RuntimeError: no"}]
    results.save("attention", env("NVIDIA H100 80GB HBM3"), {"dtype": "bfloat16"}, rows, folder)
    decode = [{"shape": "gqa B8 32k", "B": 8, "Hq": 32, "Hkv": 8, "KV_LEN": 32768, "D": 128, "impl": impl,
               "time_us": t, "kv_tb_s": 1.0, "pct_copy": pct, "max_diff": 0.0}
              for impl, t, pct in (("flexattn", 100.0, 99.5), ("sdpa", 101.0, 98.0))]
    results.save("decode", env("NVIDIA H100 80GB HBM3", "2030-01-03"), {"dtype": "bfloat16", "q_len": 1,
                                                                       "copy_tb_s": 3.0}, decode, folder)
    fp8 = [{"shape": "4x16x8192x128", "case": "no mask", "impl": "flexattn float8", "fwd_ms": 1.0,
            "fwd_tflops": 790.0, "max_err_f64": 0.01},
           {"shape": "4x16x8192x128", "case": "no mask", "impl": "flexattn float8 Gluon", "error": "x"}]
    results.save("fp8", env("NVIDIA H100 80GB HBM3"), {"shape": "4x16x8192x128"}, fp8, folder)
    host = [{"call": "decoding step", "unit": "us", "flexattn": 35.0, "torch": 190.0, "sdpa": 36.0, "bare_launch": 9.0},
            {"call": "first call", "unit": "s", "flexattn": 1.5, "torch": None, "sdpa": None, "bare_launch": None}]
    results.save("host", env("NVIDIA H100 80GB HBM3"), {"calls": 300}, host, folder)
    masks = [{"mask": "causal", "tokens": 32768, "impl": "flexattn", "ms": 0.5, "extra_mb": 1.0, "match": "yes"},
             {"mask": "causal", "tokens": 32768, "impl": "torch eager", "error": "OOM"}]
    results.save("block_mask", env("NVIDIA H100 80GB HBM3"), {"BLOCK_SIZE": 128}, masks, folder)


def generate(tmp_path, *extra) -> str:
    out = tmp_path / "docs" / "performance.md"
    out.parent.mkdir(exist_ok=True)
    assert report.main(["--results", str(tmp_path / "results"), "--out", str(out), *extra]) == 0
    return out.read_text()


def test_slug_names_a_gpu_by_its_model():
    assert results.slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert results.slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    with pytest.raises(ValueError, match="GPU name"):
        results.slug("NVIDIA ()")


def test_results_round_trip_and_bad_files_are_named(tmp_path):
    path = results.save("decode", env("NVIDIA A100-SXM4-80GB"), {"q_len": 1}, [{"impl": "flexattn"}], tmp_path)
    assert path.name == "decode-a100-sxm4-80gb.json"
    (record,) = results.load(tmp_path)
    assert record["suite"] == "decode" and record["gpu"] == "NVIDIA A100-SXM4-80GB" and record["config"] == {"q_len": 1}
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="other.json: not a benchmark results file"):
        results.load(tmp_path)


def test_the_commit_is_dirty_for_code_changes_not_for_results_the_suites_wrote(tmp_path):
    """`python -m benchmarks` runs the suites one after another, each writing its (tracked) results
    file: the next suite's commit is not ``-dirty`` for that, only for a change to the code."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "attention-h200.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    clean = results.git_commit(tmp_path)
    assert clean and not clean.endswith("-dirty")
    (tmp_path / "benchmarks" / "results" / "attention-h200.json").write_text('{"rows": []}')
    assert results.git_commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2")
    assert results.git_commit(tmp_path) == clean + "-dirty"


def test_without_results_the_page_says_how_to_make_them(tmp_path):
    page = generate(tmp_path)
    assert "No benchmark results are recorded yet" in page and report.COMMAND in page
    assert "## Method" in page


def test_page_has_a_table_per_suite_with_ratios_and_missing_competitors(tmp_path):
    write_h100(tmp_path / "results")
    page = generate(tmp_path, "--no-plot")
    assert len(page.splitlines()) < 200
    assert "## NVIDIA H100 80GB HBM3" in page
    assert "2030-01-02 · NVIDIA H100 80GB HBM3 · torch 2.13.0 · triton 3.9.0 · CUDA 13.0 · flexattn abc123" in page
    assert "### Training attention: B=4 H=16 S=8192 D=128, bfloat16" in page
    # no mask: torch 3.0 / 2.0 ms forward, cuDNN 2.2 / 2.0; backward 6.0 / 5.0 and 4.5 / 5.0
    fwd_tflops = 4 * 4 * 16 * 8192 * 8192 * 128 / 2.0e-3 / 1e12
    assert f"| no mask | 1.00 | {fwd_tflops:.0f} | 1.50x | 1.10x |" in page
    assert "| 1.20x | 0.90x | +12% |" in page  # (the deterministic backward: 5.6 against 5.0 ms)
    # causal: torch failed and cuDNN did not run
    causal = page.split("| causal | 0.50 |")[1].splitlines()[0]
    assert causal == " 1100 | — | — | 1100 | — | — | — | — / — |"  # (torch failed, no cuDNN nor determ. row)
    assert "2030-01-03" in page  # the decoding run's own date, under its table
    assert "| gqa B8 32k (8, 32, 8, 32768, 128) | 100.0 | 99.5% | — | 98.0% |" in page
    assert "| no mask | flexattn float8 | 790 | 0.0100 |" in page
    assert "| decoding step | µs | 35 | 190 | 36 |" in page and "| first call | s | 1.50 | — | — |" in page
    assert "| causal | 32768 | 0.50 ms, 1 MB | out of memory | — |" in page
    assert "1.10–1.50x the speed of torch.compile" not in page  # one ratio: no range
    assert "1.50x the speed of torch.compile(flex_attention) and 1.10x that of cuDNN SDPA" in page
    assert "decoding reads K and V at 100% of the copy bandwidth (SDPA: 98%)" in page
    assert "the float8 forward reaches 790 TF/s" in page
    assert "the deterministic backward takes at most 12% more time than the default's" in page


def test_several_gpus_each_get_a_section_and_cpu_results_are_left_out(tmp_path):
    folder = tmp_path / "results"
    write_h100(folder)
    rows = [training_row("no mask", "flexattn", 4.0, 10.0)]
    # (a run of some cases, --cases: the summary names them)
    results.save("attention", env("NVIDIA H200"), {"dtype": "bfloat16", "cases": ["no mask"]}, rows, folder)
    results.save("attention", {**env(results.CPU_NAME), "device": "cpu"}, {}, rows, folder)
    page = generate(tmp_path, "--no-plot")
    assert page.count("\n## NVIDIA ") == 2 and "## NVIDIA H200" in page
    assert "- **NVIDIA H200**: the training forward (no mask only) runs at" in page
    assert "- **NVIDIA H100 80GB HBM3**: the training forward runs at" in page
    assert results.CPU_NAME not in page
    assert len(page.splitlines()) < 200


def context_parallel_rows(P: int, ring_ms: float) -> list[dict]:
    case = {"P": P, "S": 131072, "mask": "causal"}
    rows = [{**case, "impl": "ring", "ms": ring_ms, "peak_gib": 3.0, "tflops_per_gpu": 400.0, "kv_gib": 0.4,
             "mask_ms": 2.0, "mask_step_ms": 0.25},
            {**case, "impl": "allgather", "ms": ring_ms * 1.1, "peak_gib": 5.0, "tflops_per_gpu": 360.0,
             "kv_gib": 1.0},
            {**case, "impl": "one_gpu", "ms": 1.8 * P * ring_ms / 2, "peak_gib": 9.0, "tflops_per_gpu": 420.0,
             "mask_ms": 3.0, "mask_step_ms": 0.2},
            {**case, "impl": "torch_cp", "ms": ring_ms * 1.5, "peak_gib": 6.0, "tflops_per_gpu": 270.0,
             "mask_ms": 40.0}]
    refused = {"P": P, "S": 131265, "mask": "causal"}
    return rows + [{**refused, "impl": "ring", "ms": ring_ms, "peak_gib": 3.0, "tflops_per_gpu": 400.0, "kv_gib": 0.4},
                   {**refused, "impl": "one_gpu", "skipped": "S > --one-gpu-max-seq 65536"},
                   {**refused, "impl": "torch_cp", "error": "NotImplementedError: Q_LEN 131265 is not divisible"}]


def test_context_parallel_runs_on_2_and_4_gpus_make_one_table(tmp_path):
    folder = tmp_path / "results"
    config = {"B": 1, "H": 16, "D": 128, "dtype": "bfloat16"}
    for P, ring_ms, commit, peak in ((4, 50.0, "4444444", {}), (2, 100.0, "2222222", {"peak": "per case"})):
        path = results.save("context_parallel", {**env("NVIDIA H100 80GB HBM3"), "commit": commit},
                            {**config, "P": P, **peak}, context_parallel_rows(P, ring_ms), folder, tag=f"{P}gpu")
        assert path.name == f"context_parallel-{P}gpu-h100-80gb-hbm3.json"
    page = generate(tmp_path, "--no-plot")
    assert "### Context parallelism: B=1 H=16 D=128, bfloat16, forward + backward" in page
    table = page.split("### Context parallelism")[1]
    # by P; efficiency = one GPU / (P x ring) = 0.90; torch CP 1.5x the ring's time
    assert table.index("| 2 | 131072 |") < table.index("| 4 | 131072 |")
    assert "| 2 | 131072 | causal | 100.0 | 110.0 | 150.0 | 180.0 | 400 | 0.90 | 1.50x | 3.0 / 5.0 / 6.0 | " \
        "2.0 / 3.0 / 40.0 | 0.25 / 0.20 | 2222222 |" in table
    # (a row without a mask time, as older results files have: a dash; peaks of a run that counted
    # everything live in the process: marked)
    assert "| 4 | 131265 | causal | 50.0 | — | refused | — | 400 | — | — | 3.0* / — / — | — / — / — | — / — | " \
        "4444444 |" in table
    assert "flexattn 2222222 / 4444444" in page  # (the heading names both runs)
    assert "mask ms ring / one GPU / torch CP" in table and "mask ms added to a busy step, ring / one GPU" in table
    assert "context parallelism (ring) scales with efficiency 0.90, 1.50x the speed of torch's context parallel" in page


def test_context_parallel_case_of_two_runs_keeps_one_runs_rows(tmp_path):
    """Two results files that measured the same case: its row is the first file's, the ring against
    that run's torch CP, not one file's ring against the other's."""
    folder = tmp_path / "results"
    config = {"B": 1, "H": 16, "D": 128, "dtype": "bfloat16", "P": 2}
    first = [r for r in context_parallel_rows(2, 100.0) if r["S"] == 131072]
    later = [r for r in context_parallel_rows(2, 200.0) if r["S"] == 131072 and r["impl"] != "torch_cp"]
    for rows, commit, tag in ((first, "aaaaaaa", "2gpu-a"), (later, "bbbbbbb", "2gpu-b")):
        results.save("context_parallel", {**env("NVIDIA H100 80GB HBM3"), "commit": commit}, config, rows, folder,
                     tag=tag)
    table = generate(tmp_path, "--no-plot").split("### Context parallelism")[1]
    rows = [line for line in table.splitlines() if line.startswith("| 2 | 131072 |")]
    assert len(rows) == 1 and "| 100.0 | 110.0 | 150.0 | 180.0 |" in rows[0] and "| 1.50x |" in rows[0], rows
    assert rows[0].endswith("| aaaaaaa |")


def test_context_parallel_mask_timing_keeps_to_its_budget(monkeypatch):
    """A block mask's build time is the median of 21 builds, or of three once they pass the
    budget (torch's compiled CP mask takes seconds at S=512k); the printed line of a run without
    the all-gather method says so with a dash."""
    from benchmarks import bench_context_parallel as cp

    monkeypatch.setattr(cp.torch.cuda, "synchronize", lambda: None)
    for seconds_per_build, builds in ((0.001, 21), (2.0, 3)):
        now, made = [0.0], []

        def build():
            made.append(1)
            now[0] += seconds_per_build

        monkeypatch.setattr(cp.time, "perf_counter", lambda: now[0])
        assert cp.mask_ms(build, barrier=False) == pytest.approx(seconds_per_build * 1e3)
        assert len(made) == builds
    rows = [r for r in context_parallel_rows(2, 100.0) if r["impl"] != "allgather"][:3]
    printed = cp.line(rows)
    assert "| allgather - |" in printed and "ring    100.0 ms" in printed


def test_context_parallel_keeps_flexattn_rows_when_torch_never_returns(monkeypatch, capsys):
    """torch's context parallel runs last in a case and may not finish within a run's time (16
    documents at S=512k): flexattn's rows are printed and saved before it starts."""
    import argparse

    import torch.distributed.device_mesh as device_mesh

    from benchmarks import bench_context_parallel as cp

    monkeypatch.setattr(cp.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(cp.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **k: "mesh")
    monkeypatch.setattr(cp, "allocated", lambda: 0)
    ring, one = context_parallel_rows(2, 100.0)[0], context_parallel_rows(2, 100.0)[2]
    monkeypatch.setattr(cp, "bench_flexattn", lambda S, mask, method, iters: {
        k: v for k, v in ring.items() if k not in ("P", "S", "mask")})
    monkeypatch.setattr(cp, "bench_one_gpu", lambda S, mask, iters: {
        k: v for k, v in one.items() if k not in ("P", "S", "mask")})

    def torch_cp(mesh, S, mask, iters):
        raise KeyboardInterrupt  # (the run's time is up)

    monkeypatch.setattr(cp, "bench_torch_cp", torch_cp)
    saved = []
    args = argparse.Namespace(seq="131072", masks="documents", methods="ring", iters=1, one_gpu_max_seq=262144,
                              no_torch=False)
    with pytest.raises(KeyboardInterrupt):
        cp.run(args, saved.append)
    assert [[(r["mask"], r["impl"], r["ms"]) for r in rows] for rows in saved] == [
        [("documents", "ring", 100.0), ("documents", "one_gpu", 180.0)]]
    assert "ring    100.0 ms" in capsys.readouterr().out
    # torch's part returning: the case is saved again with its row
    monkeypatch.setattr(cp, "bench_torch_cp", lambda mesh, S, mask, iters: {"impl": "torch_cp", "ms": 150.0,
                                                                          "peak_gib": 6.0})
    saved.clear()
    rows = cp.run(args, saved.append)
    assert [r["impl"] for r in rows] == ["ring", "one_gpu", "torch_cp"] and saved[-1] == rows
    assert "ring x1.50" in capsys.readouterr().out.splitlines()[-1]


def test_context_parallel_table_without_mask_times_has_no_such_column(tmp_path):
    rows = [{k: v for k, v in row.items() if k not in ("mask_ms", "mask_step_ms")}
            for row in context_parallel_rows(2, 100.0)]
    results.save("context_parallel", {**env("NVIDIA H100 80GB HBM3"), "commit": "2222222"},
                 {"B": 1, "H": 16, "D": 128, "dtype": "bfloat16", "P": 2}, rows, tmp_path / "results", tag="2gpu")
    table = generate(tmp_path, "--no-plot").split("### Context parallelism")[1]
    assert "mask ms" not in table
    # (nor the scope of its peaks: everything live in the process, marked)
    assert "| 2 | 131072 | causal | 100.0 | 110.0 | 150.0 | 180.0 | 400 | 0.90 | 1.50x | 3.0* / 5.0* / 6.0* | 2222222 |" \
        in table


def test_plot_per_gpu_is_drawn_and_shown_on_the_page(tmp_path):
    pytest.importorskip("matplotlib")
    write_h100(tmp_path / "results")
    page = generate(tmp_path)
    image = tmp_path / "docs" / "img" / "performance-h100-80gb-hbm3.png"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![TFLOP/s per case on NVIDIA H100 80GB HBM3](img/performance-h100-80gb-hbm3.png)" in page


def test_without_matplotlib_the_page_is_written_and_says_why_no_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    write_h100(tmp_path / "results")
    page = generate(tmp_path)
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert "![" not in page and "### Training attention" in page


def test_runner_rejects_an_unknown_suite(capsys):
    with pytest.raises(SystemExit):
        cli.main(["atention"])
    assert "unknown suite 'atention'" in capsys.readouterr().err


def test_presets_apply_on_the_gpu_only():
    args = cli.parser().parse_args(["attention", "--device", "cuda", "--preset", "quick"])
    assert cli.suite_argv("attention", args, ["--rounds", "2"])[-4:] == ["--shape", "1x16x2048x128", "--rounds", "2"]
    args = cli.parser().parse_args(["attention", "--device", "cpu"])
    assert "--shape" not in cli.suite_argv("attention", args, [])


def test_the_runner_passes_a_tag_on_to_the_suites():
    """``python -m benchmarks attention --tag 2k`` saves attention-2k-<gpu>.json, beside the
    suite's untagged run, instead of overwriting it."""
    args = cli.parser().parse_args(["attention", "--device", "cuda", "--tag", "2k"])
    argv = cli.suite_argv("attention", args, [])
    assert argv[argv.index("--tag") + 1] == "2k"
    assert "--tag" not in cli.suite_argv("attention", cli.parser().parse_args(["attention", "--device", "cuda"]), [])


def test_attention_suite_on_the_cpu_writes_its_results(tmp_path, capsys):
    assert cli.main(["attention", "--device", "cpu", "--results", str(tmp_path), "--",
                     "--shape", "1x1x40x16", "--cases", "causal"]) == 0
    (record,) = results.load(tmp_path)
    assert record["suite"] == "attention" and record["device"] == "cpu" and record["torch"]
    row, det = record["rows"]  # (the deterministic mode's row beside the default's)
    assert row["case"] == "causal" and row["impl"] == "flexattn" and row["fwd_ms"] > 0 and row["bwd_ms"] > 0
    assert det["impl"] == "flexattn deterministic" and det["bwd_ms"] > 0 and det["grad_diff"] < 1e-5
    out = capsys.readouterr().out
    assert "causal" in out and "flexattn determ." in out


def test_an_unknown_case_name_is_an_error_that_lists_the_cases():
    """``--cases "sliding window"`` (the case is "sliding window 1024") used to run nothing of it
    and save the other cases as if it had."""
    with pytest.raises(ValueError, match=r"--cases: no case named 'sliding window'.*'sliding window 8'"):
        bench_attention.cases(2, 40, 8, 3, "cpu", {"causal", "sliding window"})
    assert list(bench_attention.cases(2, 40, 8, 3, "cpu", {"causal", "sliding window 8"})) == [
        "causal", "sliding window 8"]


def test_varlen_suite_on_the_cpu_writes_its_results(tmp_path, capsys):
    assert cli.main(["varlen", "--device", "cpu", "--results", str(tmp_path)]) == 0
    (record,) = results.load(tmp_path)
    assert record["suite"] == "varlen" and record["config"]["seqs"] == 3
    rows = {row["impl"]: row for row in record["rows"]}
    assert set(rows) == {"flexattn", "documents", "sinks"}
    assert rows["flexattn"]["fwd_ms"] > 0 and rows["flexattn"]["bwd_ms"] > 0
    # (the document-mask emulation computes the same attention)
    assert rows["documents"]["max_diff"] < 1e-5 and rows["documents"]["grad_diff"] < 1e-5
    assert rows["sinks"]["max_diff"] < 1e-5 and rows["sinks"]["bwd_ms"] > 0  # (sinks of -20 weigh e^-20)
    assert "flexattn document mask" in capsys.readouterr().out


def test_training_rounds_rotate_which_impl_is_timed_first(monkeypatch):
    """Each round of `bench_attention.measure_case` starts one impl later, so that no impl is
    always timed first (the first timing of a round can read slower on a GPU in another state)."""
    from benchmarks import bench_attention

    timed = []
    monkeypatch.setattr(bench_attention, "timer", lambda fn, device, warmup, rep: timed.append(fn()) or 1e-3)
    x = torch.ones(1, 1, 4, 8)
    impls = {name: (lambda i=i: x * (i + 1)) for i, name in enumerate("abc")}
    args = argparse.Namespace(no_backward=True, rounds=4, device="cpu")
    out = bench_attention.measure_case(impls, x, x, x, x, args, 0, 1)
    firsts = [int(t[0, 0, 0, 0]) for t in timed]
    assert firsts == [1, 2, 3, 2, 3, 1, 3, 1, 2, 1, 2, 3]
    assert set(out) == {"a", "b", "c"} and all(r["fwd_ms"] == 1.0 for r in out.values())



def test_gpu_only_times_get_a_column_where_a_run_has_them(tmp_path):
    """Runs that timed the GPU's work alone (`timing.gpu_timer`) get a column of its ratios to
    torch, forward and backward; a missing time reads as a dash, and older runs get no column."""
    rows = [{**training_row("no mask", "flexattn", 2.0, 5.0), "fwd_gpu_ms": 1.5, "bwd_gpu_ms": 4.0},
            {**training_row("no mask", "torch", 3.0, 6.0), "fwd_gpu_ms": 3.0, "bwd_gpu_ms": 6.0},
            {**training_row("causal", "flexattn", 1.0, 2.5, tiles=0.5), "fwd_gpu_ms": 1.0, "bwd_gpu_ms": None},
            {**training_row("causal", "torch", 1.5, 3.0, tiles=0.5), "fwd_gpu_ms": 1.2, "bwd_gpu_ms": 3.0}]
    results.save("attention", env("NVIDIA H200"), {"dtype": "bfloat16"}, rows, tmp_path / "results")
    page = generate(tmp_path, "--no-plot")
    assert "| GPU only, vs torch fwd / bwd |" in page
    assert page.split("| no mask | 1.00 |")[1].splitlines()[0].endswith("| 2.00x / 1.50x |")
    assert page.split("| causal | 0.50 |")[1].splitlines()[0].endswith("| 1.20x / — |")
    write_h100(tmp_path / "older")
    assert "| GPU only, vs torch" not in generate(tmp_path, "--no-plot", "--results", str(tmp_path / "older"))


def test_deterministic_extra_reads_gpu_only_times_where_both_rows_have_them():
    """The deterministic backward's extra time compares the GPU's work alone where both rows
    timed it, else the spans (and nothing where a row is missing)."""
    default = {"bwd_ms": 0.40, "bwd_gpu_ms": 0.20}
    assert report.determ_extra({"flexattn": default,
                                "flexattn deterministic": {"bwd_ms": 0.50, "bwd_gpu_ms": 0.21}}) == pytest.approx(5)
    assert report.determ_extra({"flexattn": default,
                                "flexattn deterministic": {"bwd_ms": 0.50, "bwd_gpu_ms": None}}) == pytest.approx(25)
    assert report.determ_extra({"flexattn": {"bwd_ms": 0.40},
                                "flexattn deterministic": {"bwd_ms": 0.44}}) == pytest.approx(10)
    assert report.determ_extra({"flexattn": default}) is None


class _FakeEvent:
    """A CUDA event on a fake clock: ``record`` reads it, ``query`` says whether the GPU got past it."""

    def __init__(self, clock, enable_timing=False):
        self.clock, self.at = clock, None

    def record(self):
        self.at = self.clock["gpu"]

    def query(self):
        return self.clock["done"]

    def elapsed_time(self, end):
        return end.at - self.at


@pytest.mark.parametrize("host_late", [False, True])
def test_gpu_timer_is_none_where_the_host_could_not_queue_ahead(monkeypatch, host_late):
    """`gpu_timer` queues the calls behind a sleep; where the sleep has ended before the last call
    was queued, the spans would hold host time again, and it gives None instead of a time."""
    from benchmarks import timing

    clock = {"gpu": 0.0, "done": host_late}
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _FakeEvent(clock, enable_timing))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: clock.update(gpu=clock["gpu"] + 100.0))
    spans = iter([2.0, 4.0, 3.0])

    def call():  # the GPU's work of one call: 2, 4 and 3 ms
        clock["gpu"] += next(spans)

    got = timing.gpu_timer(call, 0, 3)
    assert got is None if host_late else got == pytest.approx(3e-3)


def test_tagged_runs_of_the_training_suite_join_its_table_and_name_their_run(tmp_path):
    """A run saved with a tag (``--tag 2k``: attention-2k-<gpu>.json) keeps the suite's untagged
    run: the page shows both runs' shapes, the untagged run first, and under each shape of the
    other run that run's date, versions and commit."""
    folder = tmp_path / "results"
    results.save("attention", env("NVIDIA H200", "2030-01-02"), {"dtype": "bfloat16"},
                 [training_row("no mask", "flexattn", 2.0, 5.0), training_row("no mask", "torch", 3.0, 6.0)], folder)
    short = [{**training_row("no mask", impl, ms, 2 * ms), "shape": "4x16x2048x128", "S": 2048}
             for impl, ms in (("flexattn", 0.2), ("torch", 0.3))]
    path = results.save("attention", {**env("NVIDIA H200", "2030-01-05"), "commit": "def456"},
                        {"dtype": "bfloat16"}, short, folder, tag="2k")
    assert path.name == "attention-2k-h200.json" and json.loads(path.read_text())["tag"] == "2k"
    page = generate(tmp_path, "--no-plot")
    first, second = page.index("S=8192 D=128"), page.index("S=2048 D=128")
    assert first < second and page.count("### Training attention") == 2
    assert "## NVIDIA H200\n\n2030-01-02 · NVIDIA H200" in page
    assert "flexattn def456" in page[second:] and "flexattn def456" not in page[:second]
    assert "| no mask | 1.00 |" in page[second:] and "1.50x" in page[second:]


def test_a_tagged_run_that_adds_cases_to_a_shape_names_its_run_below_the_table(tmp_path):
    """A tagged run of a shape the untagged run has (``--cases`` with an extra case): a case both
    measured keeps the untagged run's rows, the added case joins the table, and the line below the
    table names the run it comes from; the table's shape keeps no other run's line above it."""
    folder = tmp_path / "results"
    results.save("attention", env("NVIDIA H200", "2030-01-02"), {"dtype": "bfloat16"},
                 [training_row("no mask", "flexattn", 2.0, 5.0), training_row("no mask", "torch", 3.0, 6.0)], folder)
    extra = [training_row("no mask", "flexattn", 1.0, 5.0), training_row("no mask", "torch", 3.0, 6.0),
             training_row("documents (int64 ids)", "flexattn", 1.0, 2.0),
             training_row("documents (int64 ids)", "torch", 4.0, 4.0)]
    results.save("attention", {**env("NVIDIA H200", "2030-01-05"), "commit": "def456"}, {"dtype": "bfloat16"},
                 extra, folder, tag="int64")
    page = generate(tmp_path, "--no-plot")
    table = page[page.index("### Training attention"):]
    assert page.count("### Training attention") == 1
    assert "| no mask | 1.00 |" in table and "| 1.50x |" in table and "| 3.00x |" not in table  # (the first run's)
    assert "| documents (int64 ids) | 1.00 |" in table and "| 4.00x |" in table
    assert table.index("documents (int64 ids): 2030-01-05 · NVIDIA H200") > table.index("| documents (int64 ids) |")
    assert "flexattn def456" not in table[:table.index("| no mask |")]


def test_the_context_parallel_profile_times_its_step(monkeypatch, tmp_path):
    """`profile_context_parallel.profile_case` times the forward and the step with
    `bench_context_parallel.timed` (whose peak is over a base of live bytes) before profiling it."""
    import types

    from benchmarks import bench_context_parallel as cp
    from benchmarks import profile_context_parallel as prof

    clock = {"gpu": 0.0, "done": True}
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _FakeEvent(clock, enable_timing))
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    monkeypatch.setattr(cp.dist, "barrier", lambda: None)
    monkeypatch.setattr(prof.dist, "get_rank", lambda: 0)
    x = torch.ones(1, 1, 4, 8)
    bm = types.SimpleNamespace(qpos=torch.arange(4), kvpos=[torch.arange(4)], rank=0)

    def attention(q, k, v, block_mask, method):
        clock["gpu"] += 2.0  # (2 ms a call)
        return q * k * v

    monkeypatch.setattr(prof, "fd", types.SimpleNamespace(create_block_mask=lambda *a, **k: bm,
                                                         flex_attention=attention))
    monkeypatch.setattr(prof, "inputs", lambda L, Lkv: tuple(x.clone().requires_grad_() for _ in range(3)))

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def events(self):
            return []

    monkeypatch.setattr(prof, "profile", Profile)
    block = prof.profile_case(4, "causal", "ring", tmp_path)
    assert block.startswith("== rank 0 causal ring: forward 2.00 ms, forward + backward 2.00 ms")


def test_the_host_suite_checks_outputs_against_float64():
    """The per-call suite's check fails an output that drops the mask, which its old tolerance
    (2e-2 between flexattn and torch in bfloat16) let through at the decoding step's shape."""
    from benchmarks.bench_host import check_output
    from flexattn.reference import attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 64, generator=g).bfloat16() for n in (1, 4096, 4096))
    up_to = lambda s, b, h, qi, ki: torch.where(ki <= 3995, s, -math.inf)  # noqa: E731
    reference = attention_reference(q, k, v, score_mod=up_to)
    rounded = reference.bfloat16()  # (an output that is the reference rounded to bfloat16)
    check_output("decoding", rounded, rounded, reference)
    unmasked = attention_reference(q, k, v).bfloat16()
    assert (unmasked.float() - rounded.float()).abs().max() < 2e-2  # (the old check's tolerance)
    with pytest.raises(AssertionError, match="decoding: flexattn's largest error against float64"):
        check_output("decoding", unmasked, rounded, reference)
