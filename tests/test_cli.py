"""The ``flexattn`` command line: show (IR + Triton) and mask (BlockMask picture)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flexattn.cli import main, node_listing
from flexattn.dsl import parse


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_score(capsys):
    rc, out, err = run(capsys, "show", "score + bias[h] * tanh(score / 5.0)", "--tensor", "bias=float32[8]",
                       "--target", "interpret")
    assert rc == 0 and err == ""
    assert "kind:   score" in out
    assert "IR:     (score + (bias[h] * tanh((score / 5.0))))" in out
    assert "%2 = load bias(B0), %1 : float32" in out
    assert "B0: bias  float32, 1-d" in out
    assert "Triton (interpret):" in out
    assert "def score_mod(score, b, h, q_idx, kv_idx, B0, B0_s0, B0_n0):" in out
    assert "_fa_tanh_f32(" in out  # float32 tanh: the helper the CUDA fast-math prelude replaces


def test_show_infers_mask_and_binds_numbers(capsys):
    rc, out, _ = run(capsys, "show", "let d = q_idx - kv_idx\n0 <= d < w", "--set", "w=256")
    assert rc == 0
    assert "kind:   mask" in out and "Triton (cuda):" in out
    assert "def mask_mod(b, h, q_idx, kv_idx):" in out
    assert "IR:     ((0 <= (q_idx - kv_idx)) & ((q_idx - kv_idx) < 256))" in out


def test_node_listing():
    n = parse("where(q_idx >= kv_idx, score, -inf)")
    assert node_listing(n) == [
        "%0 = input q_idx : int32",
        "%1 = input kv_idx : int32",
        "%2 = ge %0, %1 : bool",
        "%3 = input score : float32",
        "%4 = const -inf : float32",
        "%5 = where %2, %3, %4 : float32",
    ]


def test_show_errors(capsys):
    rc, out, err = run(capsys, "show", "q_id >= kv_idx", "--kind", "mask")
    assert rc == 2 and out == ""
    assert "flexattn show: unknown name 'q_id' at line 1, column 1" in err and "    ^^^^" in err
    rc, _, err = run(capsys, "show", "q_idx - kv_idx", "--kind", "mask")
    assert rc == 2 and "mask text must produce bool, but it produces int32" in err
    rc, _, err = run(capsys, "show", "x > q_idx", "--set", "x")
    assert rc == 2 and "--set expects NAME=NUMBER" in err
    rc, _, err = run(capsys, "show", "t[q_idx] > 0", "--tensor", "t=complex[3]")
    assert rc == 2 and "--tensor expects NAME=DTYPE[SIZES]" in err
    with pytest.raises(SystemExit):
        main(["show", "q_idx > 0", "--target", "rocm"])
    assert "invalid choice: 'rocm'" in capsys.readouterr().err


def test_mask_picture(capsys, tmp_path):
    pytest.importorskip("flexattn.block_mask")
    from flexattn.block_mask import create_block_mask

    png = tmp_path / "mask.png"
    rc, out, err = run(capsys, "mask", "q_idx >= kv_idx and q_idx - kv_idx < w", "--seq", "300",
                       "--kv-seq", "200", "--block-size", "64", "--set", "w=100", "--png", str(png))
    assert rc == 0 and err == ""

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 100)

    expected = create_block_mask(window, 1, 1, 300, 200, device="cpu", BLOCK_SIZE=64)
    assert out.startswith(str(expected) + "\n")  # same tiles, same text picture
    assert "██" in out and "sparsity=" in out
    assert f"wrote {png} (token level)" in out  # 300 x 200 pairs: drawn token by token
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(SystemExit):
        main(["mask", "q_idx >= kv_idx", "--seq", "0"])
    assert "argument --seq: must be a positive integer, got 0" in capsys.readouterr().err
    rc, _, err = run(capsys, "mask", "score > 0", "--seq", "10")
    assert rc == 2 and "a mask mod has no 'score'" in err


@pytest.mark.parametrize("module", ["flexattn.cli", "flexattn"])
def test_console_script_runs(module):
    # `python -m flexattn.cli` is what the `flexattn` console script calls (flexattn.cli:main);
    # `python -m flexattn` is the same command.
    proc = subprocess.run([sys.executable, "-m", module, "show", "q_idx >= kv_idx", "--kind", "mask"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "def mask_mod(b, h, q_idx, kv_idx):" in proc.stdout
    if module == "flexattn":
        return
    proc = subprocess.run([sys.executable, "-m", "flexattn.cli", "show", "q_idx >=", "--kind", "mask"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unexpected end of text at line 1, column 9" in proc.stderr


# ---------------------------------------------------------------------------------------------
# --version, bench, help, file.py:function, hardening (huge --seq, missing --png folder, leading '-')


def test_version(capsys):
    import flexattn

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"flexattn {flexattn.__version__}\n"


@pytest.mark.parametrize("sub", ["show", "mask", "bench"])
def test_subcommand_help_names_the_program(capsys, sub):
    with pytest.raises(SystemExit):
        main([sub, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: flexattn {sub} ")


def test_demo_help_names_the_program(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert capsys.readouterr().out.startswith("usage: flexattn demo ")


def test_demo_reports_a_mismatch_with_the_platform(capsys, monkeypatch):
    import flexattn.demo as demo

    exact = demo.attention_reference

    def off_by_1e_3(*args, **kwargs):
        out, lse = exact(*args, **kwargs)
        return out + 1e-3, lse

    monkeypatch.setattr(demo, "attention_reference", off_by_1e_3)
    assert main(["demo", "--seq", "40"]) == 1
    out = capsys.readouterr().out
    assert "max |out - float64 reference| = 1.00e-03" in out and "MISMATCH" in out
    report = out.split("(for a bug report: ", 1)[1]
    assert report.startswith("torch ") and "triton " in report and "numpy " in report


def test_bench_without_a_gpu_says_what_it_needs(capsys, monkeypatch):
    import flexattn.cli as cli

    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    rc, out, err = run(capsys, "bench", "attention")
    assert rc == 2 and out == ""
    assert "flexattn bench: needs a CUDA GPU, and torch.cuda.is_available() is False here" in err
    rc, _, err = run(capsys, "bench", "nope")
    assert rc == 2 and "unknown benchmark 'nope'; choose from attention, decode, fp8, host, block_mask" in err


def test_bench_finds_the_scripts_of_the_checkout():
    import flexattn.cli as cli

    folder = cli._benchmark_dir()
    assert folder is not None and (folder / "bench_attention.py").is_file()


def test_bench_runs_the_benchmarks_package_with_the_suites_and_their_arguments(capsys, monkeypatch):
    import flexattn.cli as cli

    calls = []
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.subprocess, "call", lambda command, cwd: calls.append((command, cwd)) or 0)
    rc, _, _ = run(capsys, "bench", "attention", "host", "--", "--rounds", "5")
    assert rc == 0
    (command, cwd), = calls
    assert command[1:] == ["-m", "benchmarks", "attention", "host", "--", "--rounds", "5"]
    assert cwd == cli._benchmark_dir().parent


def test_mask_refuses_huge_lengths_before_allocating(capsys):
    rc, out, err = run(capsys, "mask", "q_idx >= kv_idx", "--seq", "1000000000")
    assert rc == 2 and out == ""
    assert ("flexattn mask: --seq 1000000000 with --block-size 128 makes 7812500 x 7812500 tiles; flexattn mask "
            "builds at most 16777216 tiles") in err


def test_mask_png_into_a_missing_directory(capsys, tmp_path):
    target = tmp_path / "no" / "such" / "m.png"
    rc, out, err = run(capsys, "mask", "q_idx >= kv_idx", "--seq", "64", "--png", str(target))
    assert rc == 2 and out == "" and "Traceback" not in err
    assert f"flexattn mask: --png {target}: the directory {target.parent} does not exist" in err


@pytest.mark.parametrize("argv", [["show", "-score"], ["show", "--", "-score"], ["show", "--kind", "score", "-score"],
                                  ["show", "-score", "--target", "interpret"]])
def test_text_may_start_with_a_minus(capsys, argv):
    rc, out, err = run(capsys, *argv)
    assert rc == 0 and err == ""
    assert "source: -score" in out and "IR:     (-score)" in out


def test_mask_picture_levels(capsys, tmp_path):
    from PIL import Image

    png = tmp_path / "big.png"
    rc, out, _ = run(capsys, "mask", "q_idx >= kv_idx", "--seq", "4096", "--png", str(png))
    assert rc == 0 and f"wrote {png} (tile level)" in out
    img = Image.open(png)
    assert img.size[0] % 32 == 0  # 32 x 32 tiles, scaled up
    rc, out, _ = run(capsys, "mask", "q_idx >= kv_idx", "--seq", "4096", "--png", str(png), "--level", "token")
    assert rc == 0 and "(token level)" in out and Image.open(png).size == (4096, 4096)


def test_show_python_mod_from_a_file(capsys, tmp_path):
    f = tmp_path / "mymods.py"
    f.write_text("def window(b, h, q_idx, kv_idx):\n    return (q_idx >= kv_idx) & (q_idx - kv_idx < 64)\n")
    rc, out, err = run(capsys, "show", f"{f}:window")
    assert rc == 0 and err == ""
    assert "kind:   mask" in out and "IR:     ((q_idx >= kv_idx) & ((q_idx - kv_idx) < 64))" in out
    rc, out, _ = run(capsys, "mask", f"{f}:window", "--seq", "256", "--block-size", "64")
    assert rc == 0 and "sparsity=" in out
    rc, _, err = run(capsys, "show", f"{f}:nope")
    assert rc == 2 and f"{f} defines no 'nope'; callables there: window" in err
    rc, _, err = run(capsys, "show", f"{tmp_path}/missing.py:window")
    assert rc == 2 and "no such file" in err


def test_show_prints_the_source_of_the_target_asked_for(capsys):
    """--target picks the emitted source: a mask over one axis differs between the GPU and the
    interpreter (which broadcasts it to the tile), and each is what emit_mod gives for that target."""
    from flexattn.codegen.emit import emit_mod

    sources = {}
    for target in ("cuda", "interpret"):
        rc, out, _ = run(capsys, "show", "q_idx >= 3", "--target", target)
        assert rc == 0
        sources[target] = emit_mod(parse("q_idx >= 3"), "mask", target=target).source
        assert out.endswith(f"Triton ({target}):\n\n{sources[target]}\n")
    assert sources["cuda"] != sources["interpret"]


def test_show_binds_tensors_of_the_dtype_and_rank_given(capsys):
    rc, out, _ = run(capsys, "show", "t[q_idx, kv_idx] > 0", "--tensor", "t=int64[4,3]", "--kind", "mask")
    assert rc == 0 and "B0: t  int64, 2-d" in out and "IR:     (t[q_idx][kv_idx] > 0)" in out
    rc, out, _ = run(capsys, "show", "score * t[h]", "--tensor", "t=float16[2]")
    assert rc == 0 and "B0: t  float16, 1-d" in out


@pytest.mark.parametrize("sizes", ["1000000,1000000", "0,99999999999999999999", "4611686018427387904,4"])
def test_tensor_sizes_that_would_take_terabytes_are_refused(capsys, sizes):
    """--tensor allocates zeros: a few characters must not ask for terabytes (or an int64 overflow)."""
    rc, _, err = run(capsys, "show", "score + t[q_idx, kv_idx]", "--tensor", f"t=float32[{sizes}]")
    assert rc == 2 and "is too large; flexattn binds tensors of at most" in err
    rc, out, _ = run(capsys, "show", "score + t", "--tensor", "t=float32[]")
    assert rc == 0 and "B0: t  float32, 0-d" in out
