"""The on-disk module cache: location, content addressing, atomic publication across processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from flexattn.codegen import cache

SOURCE = "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef twice(X, Y):\n    tl.store(Y, tl.load(X) * 2)\n"


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path / "kernels"))
    path = cache.write_source(SOURCE, "probe", interpret=True)
    assert path.parent == tmp_path / "kernels" and path.read_text() == SOURCE


def test_key_depends_on_text_and_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    a = cache.write_source(SOURCE, "probe", interpret=True)
    assert cache.write_source(SOURCE, "probe", interpret=True) == a  # same text: same file
    assert cache.write_source(SOURCE, "probe", interpret=False) != a  # CPU and GPU builds differ
    assert cache.write_source(SOURCE + "\n# other\n", "probe", interpret=True) != a


def test_loaded_module_runs_in_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    module = cache.load_source(SOURCE + "# run\n", "probe", interpret=True)
    x, y = torch.tensor([3.5]), torch.full((1,), float("nan"))
    module.twice[(1,)](x, y)
    assert y.item() == 7.0


def test_concurrent_processes_publish_one_complete_file(tmp_path):
    """Eight processes write and import the same module at once: all succeed, one file, no temps."""
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["FLEXATTN_CACHE_DIR"] = {str(tmp_path)!r}
        from flexattn.codegen import cache
        mod = cache.load_source({SOURCE!r} + "# concurrent\\n", "probe", interpret=True)
        assert hasattr(mod, "twice")
        print(os.path.basename(mod.__file__))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(8)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    names = {out.strip() for out, _ in results}
    assert len(names) == 1
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(names)  # no temporary files left
