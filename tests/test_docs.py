"""Every ```python block of README.md and docs/*.md runs as written, on the CPU.

Blocks of one file run in order in one namespace (like a notebook), in a temporary directory.
A block holding ``>>>`` prompts is run as a doctest (its printed output is checked). A block that
must not run is marked with ``<!-- no-run: reason -->`` on the line before its fence; there are few.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NO_RUN = "<!-- no-run"


def blocks(path: Path) -> list[tuple[int, str]]:
    """(line, code) of the python blocks of ``path`` that are meant to run."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not before.startswith(NO_RUN):
            out.append((text[:m.start()].count("\n") + 2, m.group(1)))
    return out


def test_every_file_has_runnable_blocks_or_none_marked():
    skipped = [(p.name, m.start()) for p in FILES for m in re.finditer(re.escape(NO_RUN), p.read_text())]
    assert len(skipped) <= 3, f"too many no-run blocks: {skipped}"


@pytest.mark.parametrize("path", [p for p in FILES if blocks(p)], ids=lambda p: p.name)
def test_code_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for line, code in blocks(path):
        where = f"{path.name}:{line}"
        if ">>>" in code:
            test = parser.get_doctest(code, namespace, where, str(path), line)
            result = runner.run(test, clear_globs=False)
            assert result.failed == 0, f"doctest block at {where} failed (output above)"
        else:
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - our own documentation


def _modules_with_examples() -> list[str]:
    """Every module of the package whose source shows a ``>>>`` example (templates are not modules)."""
    package = ROOT / "flexattn"
    names = []
    for path in sorted(package.rglob("*.py")):
        if ">>> " in path.read_text():
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name):
    """The ``>>>`` examples of every docstring run and print what they show, with the package's
    public names in scope (as a reader has them after ``import flexattn``)."""
    import importlib

    import torch

    import flexattn
    import flexattn.block_mask
    from flexattn import masks, scores

    module = importlib.import_module(name)
    names = {"torch": torch, "flexattn": flexattn, "masks": masks, "scores": scores,
             **{n: getattr(flexattn.block_mask, n) for n in flexattn.block_mask.__all__}}
    result = doctest.testmod(module, extraglobs=names, optionflags=doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"
