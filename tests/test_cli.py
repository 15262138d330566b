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
    assert "_fa_tanh(" in out


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
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(SystemExit):
        main(["mask", "q_idx >= kv_idx", "--seq", "0"])
    assert "argument --seq: must be a positive integer, got 0" in capsys.readouterr().err
    rc, _, err = run(capsys, "mask", "score > 0", "--seq", "10")
    assert rc == 2 and "a mask mod has no 'score'" in err


def test_console_script_runs():
    # `python -m flexattn.cli` is what the `flexattn` console script calls (flexattn.cli:main).
    proc = subprocess.run([sys.executable, "-m", "flexattn.cli", "show", "q_idx >= kv_idx", "--kind", "mask"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "def mask_mod(b, h, q_idx, kv_idx):" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "flexattn.cli", "show", "q_idx >=", "--kind", "mask"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unexpected end of text at line 1, column 9" in proc.stderr
