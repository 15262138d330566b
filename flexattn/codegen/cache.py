"""Content-addressed on-disk cache of generated kernel modules.

`triton.jit` needs real source files (it reads them with `inspect`), so every rendered kernel
module is written to ``$FLEXATTN_CACHE_DIR`` (default ``~/.cache/flexattn``) under a name derived
from a hash of its text and the flexattn/triton/torch versions, then imported with importlib.
Writes go to a temporary file first and are published with ``os.replace`` (atomic on POSIX),
so concurrent processes either see no file or a complete one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import torch
import triton

from flexattn import __version__

_LOCK = threading.RLock()
_LOADED: dict[tuple[str, bool], ModuleType] = {}


def cache_dir() -> Path:
    """The directory holding generated modules (``FLEXATTN_CACHE_DIR`` or ``~/.cache/flexattn``)."""
    root = os.environ.get("FLEXATTN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "flexattn"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def source_key(source: str, interpret: bool) -> str:
    """Hash of everything that decides what a generated module does."""
    h = hashlib.sha256()
    for part in (__version__, triton.__version__, torch.__version__, str(interpret), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def write_source(source: str, stem: str, interpret: bool) -> Path:
    """Write ``source`` to the cache (once) and return its path."""
    key = source_key(source, interpret)
    path = cache_dir() / f"{stem}_{key}.py"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{stem}_", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path


@contextlib.contextmanager
def _interpret_mode(enabled: bool):
    """`triton.jit` decides at decoration time whether to build an interpreted function."""
    old = os.environ.get("TRITON_INTERPRET")
    if enabled:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def load_source(source: str, stem: str, interpret: bool) -> ModuleType:
    """Return the module for ``source``, writing and importing it on first use.

    ``interpret=True`` builds the module for Triton's CPU interpreter (CPU tensors); the same
    text imported with ``interpret=False`` compiles for the GPU. The two are separate modules.
    """
    key = (source_key(source, interpret), interpret)
    with _LOCK:
        mod = _LOADED.get(key)
        if mod is not None:
            return mod
        path = write_source(source, stem, interpret)
        name = f"flexattn_generated.{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        with _interpret_mode(interpret):
            spec.loader.exec_module(mod)
        _LOADED[key] = mod
        return mod
