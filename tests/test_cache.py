"""The on-disk module cache: location, content addressing, atomic publication across processes."""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from flexattn.codegen import cache

SOURCE = "import triton\nimport triton.language as tl\n\n\n@triton.jit\ndef twice(X, Y):\n    tl.store(Y, tl.load(X) * 2)\n"


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path / "kernels"))
    path = cache.write_source(SOURCE, "probe", interpret=True)
    assert path.parent == tmp_path / "kernels" and path.read_text() == cache.entry_text(SOURCE)


def test_key_depends_on_text_and_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    a = cache.write_source(SOURCE, "probe", interpret=True)
    assert cache.write_source(SOURCE, "probe", interpret=True) == a  # same text: same file
    assert cache.write_source(SOURCE, "probe", interpret=False) != a  # CPU and GPU builds differ
    assert cache.write_source(SOURCE + "\n# other\n", "probe", interpret=True) != a


@pytest.mark.parametrize("version", ["flexattn", "triton", "torch"])
def test_key_depends_on_the_versions_that_build_the_module(tmp_path, monkeypatch, version):
    """A module generated under another flexattn, Triton or torch is another entry: the same text
    is not reused across an upgrade (the templates' meaning and the compilers change with them)."""
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    before = cache.source_key(SOURCE, True)
    a = cache.write_source(SOURCE, "probe", interpret=True)
    if version == "flexattn":
        monkeypatch.setattr(cache, "__version__", cache.__version__ + ".other")
    else:
        module = {"triton": cache.triton, "torch": cache.torch}[version]
        monkeypatch.setattr(module, "__version__", module.__version__ + ".other")
    assert cache.source_key(SOURCE, True) != before
    assert cache.write_source(SOURCE, "probe", interpret=True) != a


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


# ---------------------------------------------------------------------------------------------
# Integrity: the cache never trusts the disk


def _fresh(tmp_path, monkeypatch, sub="kernels"):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path / sub))
    monkeypatch.setattr(cache, "_LOADED", {})
    monkeypatch.setattr(cache, "_WARNED", set())
    monkeypatch.setattr(cache, "_FALLBACK", {})


def _twice(module):
    x, y = torch.tensor([3.5]), torch.full((1,), float("nan"))
    module.twice[(1,)](x, y)
    return y.item()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other_kernel", "empty", "binary"])
def test_damaged_entry_is_regenerated_with_one_warning(tmp_path, monkeypatch, damage):
    _fresh(tmp_path, monkeypatch)
    source = SOURCE + f"# {damage}\n"
    path = cache.write_source(source, "probe", interpret=True)
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_text("this is ) not python (\n")
    elif damage == "other_kernel":  # a valid kernel that computes something else: must not run
        path.write_text(text.replace("* 2", "* 3"))
    elif damage == "empty":
        path.write_text("")
    else:
        path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(cache.CacheWarning, match="was truncated, corrupted or modified; it has been regenerated"):
        module = cache.load_source(source, "probe", interpret=True)
    assert _twice(module) == 7.0
    assert path.read_text() == text
    # reported once: a second damage to the same entry regenerates silently
    path.write_text("junk")
    monkeypatch.setattr(cache, "_LOADED", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _twice(cache.load_source(source, "probe", interpret=True)) == 7.0


def test_entry_carries_the_hash_of_its_content(tmp_path, monkeypatch):
    _fresh(tmp_path, monkeypatch)
    text = cache.write_source(SOURCE, "probe", interpret=True).read_text()
    first, rest = text.split("\n", 1)
    assert rest == SOURCE
    assert first.endswith(hashlib.sha256(SOURCE.encode()).hexdigest())


@pytest.mark.parametrize("problem", ["regular_file", "under_a_file"])
def test_unusable_cache_dir_falls_back_to_a_private_one(tmp_path, monkeypatch, problem):
    _fresh(tmp_path, monkeypatch, "kernels" if problem == "regular_file" else "kernels/sub")
    (tmp_path / "kernels").write_text("not a directory")
    with pytest.warns(cache.CacheWarning, match=r"cannot use the kernel cache directory .*kernels"):
        first = cache.cache_dir()
    assert first.is_dir() and not str(first).startswith(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process
        assert cache.cache_dir() == first
        assert _twice(cache.load_source(SOURCE + "# fallback\n", "probe", interpret=True)) == 7.0
    assert (tmp_path / "kernels").read_text() == "not a directory"


def test_cache_location_follows_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEXATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.configured_dir() == tmp_path / "xdg" / "flexattn"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: relative paths are invalid
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.configured_dir() == tmp_path / "home" / ".cache" / "flexattn"
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache.configured_dir() == tmp_path / "mine"


def test_source_python_cannot_compile_is_never_written(tmp_path, monkeypatch):
    _fresh(tmp_path, monkeypatch)
    bad = "x = " + "(" * 300 + "1" + ")" * 300 + "\n"
    with pytest.raises(RuntimeError, match="source that Python cannot compile"):
        cache.load_source(bad, "probe", interpret=True)
    assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").glob("probe_*"))


def test_entry_whose_import_fails_is_removed(tmp_path, monkeypatch):
    _fresh(tmp_path, monkeypatch)
    with pytest.raises(ZeroDivisionError):
        cache.load_source("x = 1 // 0\n", "probe", interpret=True)
    assert not list((tmp_path / "kernels").glob("probe_*"))


def test_bytecode_in_pycache_is_never_run_nor_written(tmp_path, monkeypatch):
    """The entry's hash covers the .py file only: Python's loader would run a __pycache__ file in
    its place (an unchecked hash-based .pyc is used whatever the source says), and write .pyc files
    that no size cap counts."""
    import importlib.util
    import marshal
    import os
    from pathlib import Path

    _fresh(tmp_path, monkeypatch)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    source = SOURCE + "# pyc\n"
    assert _twice(cache.load_source(source, "probe", interpret=True)) == 7.0
    assert not (tmp_path / "kernels" / "__pycache__").exists()
    path = cache.write_source(source, "probe", interpret=True)
    pyc = Path(importlib.util.cache_from_source(str(path)))
    pyc.parent.mkdir(exist_ok=True)
    planted = compile("import os\nos.environ['FLEXATTN_TEST_PLANTED'] = '1'\n", str(path), "exec")
    pyc.write_bytes(importlib.util.MAGIC_NUMBER + (0b01).to_bytes(4, "little") + bytes(8) + marshal.dumps(planted))
    monkeypatch.delenv("FLEXATTN_TEST_PLANTED", raising=False)
    monkeypatch.setattr(cache, "_LOADED", {})
    module = cache.load_source(source, "probe", interpret=True)
    assert "FLEXATTN_TEST_PLANTED" not in os.environ
    assert _twice(module) == 7.0


def test_triton_reads_the_checked_text_not_the_file_again(tmp_path, monkeypatch):
    """The entry is checked, then imported: `triton.jit` reads each function's source with
    `inspect` as the module runs, and must see the checked text even if the file changed between."""
    _fresh(tmp_path, monkeypatch)
    source = SOURCE + "# reread\n"
    path = cache.write_source(source, "probe", interpret=False)
    real = cache._interpret_mode

    @contextlib.contextmanager
    def swap_then_import(enabled):
        path.write_text(path.read_text().replace("* 2", "* 3"))  # after the check, before the import
        with real(enabled):
            yield

    monkeypatch.setattr(cache, "_interpret_mode", swap_then_import)
    module = cache.load_source(source, "probe", interpret=False)
    assert "* 2" in module.twice.src and "* 3" not in module.twice.src


def test_eviction_removes_entries_only(tmp_path, monkeypatch):
    """FLEXATTN_CACHE_DIR may name a directory that holds other files (a project's own folder):
    the size cap removes cache entries, never a .py file it did not write, however old or large."""
    import os

    _fresh(tmp_path, monkeypatch)
    folder = tmp_path / "kernels"
    folder.mkdir()
    own = {"train.py": "x = 1\n" * 100_000, "model_0123456789abcdef01234567.py": "y = 2\n" * 100_000}
    for name, text in own.items():
        (folder / name).write_text(text)
        os.utime(folder / name, (1, 1))  # the least recently used of all
    old = cache.write_source(SOURCE + "# old\n", "probe", interpret=True)
    os.utime(old, (2, 2))
    monkeypatch.setenv("FLEXATTN_CACHE_MAX_MB", "0.5")
    new = cache.write_source(SOURCE + "# new\n", "probe", interpret=True)
    assert all((folder / name).read_text() == text for name, text in own.items())
    assert new.exists() and not old.exists()


@pytest.mark.parametrize("thing", ["fifo", "device"])
def test_an_entry_that_is_no_regular_file_of_its_size_is_never_read(tmp_path, thing):
    """A pipe (a read would wait for a writer forever) or /dev/zero (endless) at an entry's path is
    replaced without being read."""
    script = textwrap.dedent(f"""
        import os, warnings
        os.environ["FLEXATTN_CACHE_DIR"] = {str(tmp_path)!r}
        from flexattn.codegen import cache
        source = {SOURCE!r}
        path = cache.write_source(source, "probe", interpret=True)
        path.unlink()
        if {thing!r} == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            cache.load_source(source, "probe", interpret=True)
        assert path.read_text() == cache.entry_text(source) and "regenerated" in str(w[0].message)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
