"""Content-addressed on-disk cache of generated kernel modules.

`triton.jit` needs real source files (it reads them with `inspect`), so every rendered kernel
module is written to the cache directory under a name derived from a hash of its text and the
flexattn/triton/torch versions, then imported with importlib.

Where: ``$FLEXATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/flexattn``, else ``~/.cache/flexattn``. A
directory that cannot be used (a regular file in the way, no permission) is replaced by a private
temporary directory for the rest of the process, with one warning.

Integrity: an entry starts with a line holding the SHA-256 of the rest of the file, and every read
compares the whole entry with the text flexattn would write. A truncated, corrupted or edited entry
is discarded and written again, with one warning per entry. Writes go to a temporary file first and
are published with ``os.replace`` (atomic on POSIX), so concurrent processes either see no file or a
complete one. Source is compiled before it is written, and an entry whose import fails is removed:
nothing un-importable stays in the cache. A module is compiled from the text just checked, never
from bytecode in ``__pycache__`` (which the hash does not cover, and which no size cap would see).

Size: the entries' total size is kept under ``$FLEXATTN_CACHE_MAX_MB`` (default `DEFAULT_MAX_MB`).
Using an entry marks it (its modification time); a write that takes the directory past the cap
removes the least recently used entries down to 90% of it. Other processes may be reading an
entry as it goes: a reader that finds it gone writes it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import linecache
import math
import os
import re
import stat
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch
import triton

from flexattn.version import __version__
from flexattn.lru import LRU

DEFAULT_MAX_MB = 512  # about 10,000 generated modules
_LOCK = threading.RLock()
# Held by every launch through Triton's interpreter (CPU tensors), which keeps global state while a
# kernel runs: threads take turns.
INTERPRETER_LOCK = threading.RLock()
# Bound: an imported module holds its Triton kernels; a dropped one leaves sys.modules too.
_LOADED = LRU(1024, on_evict=lambda key, module: (sys.modules.pop(module.__name__, None),
                                                   linecache.cache.pop(module.__file__, None)))
_FALLBACK: dict[str, Path] = {}  # configured directory -> the private one used instead
_WARNED: set[str] = set()
_HEADER = "# flexattn cache entry, sha256 of the rest: "
_FORMAT = "entry-v2"  # in the key: entries of an older layout are never looked at


class CacheWarning(UserWarning):
    """The kernel cache had to work around a problem on disk (reported once per problem)."""


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, CacheWarning, stacklevel=3)


def configured_dir() -> Path:
    """The cache directory the environment asks for (it may not exist or be usable)."""
    root = os.environ.get("FLEXATTN_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "flexattn")
    return Path(root)


def cache_dir() -> Path:
    """The directory holding generated modules (see the module docstring); created if needed."""
    path = configured_dir()
    key = str(path)
    if key in _FALLBACK:
        return _FALLBACK[key]
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not path.is_dir():
            raise NotADirectoryError(f"{path} is not a directory")
        # Can we publish files here? (mkdir succeeds on an existing read-only directory.)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe_")
        os.close(fd)
        os.unlink(probe)
        return path
    except OSError as e:
        with _LOCK:
            if key not in _FALLBACK:
                _FALLBACK[key] = Path(tempfile.mkdtemp(prefix="flexattn-cache-"))
                _warn_once(f"dir:{key}", f"flexattn: cannot use the kernel cache directory {path} "
                           f"({type(e).__name__}: {e}); using {_FALLBACK[key]} for this process. Set "
                           "FLEXATTN_CACHE_DIR to a writable directory to keep compiled kernels.")
        return _FALLBACK[key]


def source_key(source: str, interpret: bool) -> str:
    """Hash of everything that decides what a generated module does."""
    h = hashlib.sha256()
    for part in (_FORMAT, __version__, triton.__version__, torch.__version__, str(interpret), source):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()[:24]


def entry_text(source: str) -> str:
    """The exact text of the cache entry for ``source``: a hash line, then the source."""
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    return f"{_HEADER}{digest}\n{source}"


def _check_importable(source: str, stem: str) -> None:
    try:
        compile(source, f"<flexattn generated {stem}>", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise RuntimeError(f"flexattn generated {stem} source that Python cannot compile ({e}); this is a "
                           "bug in flexattn, please report it with the mod that caused it") from e


def _publish(path: Path, text: str, stem: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{stem}_", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read(path: Path, size: int) -> str | None:
    """The entry at ``path`` if it is a regular file of ``size`` bytes, None if there is none, ""
    for anything else (unreadable, not text, another size): never read, so a pipe, a device or a
    link to a large file costs nothing."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return ""
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return ""  # unreadable or not text: treated as corrupted


def write_source(source: str, stem: str, interpret: bool) -> Path:
    """Write ``source``'s entry to the cache (once, or again if the file there is not it) and
    return its path."""
    _check_importable(source, stem)
    text = entry_text(source)
    path = cache_dir() / f"{stem}_{source_key(source, interpret)}.py"
    found = _read(path, len(text.encode("utf-8")))
    if found == text:
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the last to be evicted
        return path
    if found is not None:
        _warn_once(f"entry:{path}", f"flexattn: the cached kernel {path} was truncated, corrupted or "
                   "modified; it has been regenerated")
    _publish(path, text, stem)
    evict(path.parent, max_bytes(), keep=path)
    return path


def max_bytes() -> int:
    """The cap on the entries' total size: ``$FLEXATTN_CACHE_MAX_MB`` megabytes (default
    `DEFAULT_MAX_MB`)."""
    raw = os.environ.get("FLEXATTN_CACHE_MAX_MB")
    if raw is None or raw == "":
        return DEFAULT_MAX_MB << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not 0 < mb < math.inf:  # (nan and inf too: int() of inf overflows at the first write)
        raise ValueError(f"FLEXATTN_CACHE_MAX_MB must be a positive number of megabytes, got {raw!r}")
    return int(min(mb * (1 << 20), 2.0**63))  # (1e308 MB is finite, its bytes are not)


_ENTRY_NAME = re.compile(r"[a-z_]+_[0-9a-f]{24}\.py")


def _is_entry(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_HEADER)) == _HEADER.encode()
    except OSError:
        return False


def evict(directory: Path, limit: int, keep: Path | None = None) -> None:
    """Remove the least recently used entries of ``directory`` (by modification time) until
    their total size is at most 90% of ``limit``, if it is over ``limit``; never ``keep``.
    Entries another process removes meanwhile are skipped."""
    entries = []
    total = 0
    with os.scandir(directory) as it:
        for e in it:
            # Entries only: the directory may be one that holds other files (FLEXATTN_CACHE_DIR=.).
            if not _ENTRY_NAME.fullmatch(e.name):
                continue
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, e.path))
            total += st.st_size
    if total <= limit:
        return
    entries.sort()
    for _, size, name in entries:
        if total <= limit * 0.9:
            break
        if (keep is not None and name == str(keep)) or not _is_entry(name):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        total -= size


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
        for attempt in range(3):
            path = write_source(source, stem, interpret)
            try:
                mod = _import(path, interpret, entry_text(source))
                break
            except FileNotFoundError:  # evicted by another process between the write and the read
                if attempt == 2:
                    raise
        _LOADED[key] = mod
        return mod


class _CheckedLoader(importlib.machinery.SourceFileLoader):
    """Imports ``path`` from ``text`` (its checked entry): Python's own loader would run a
    ``__pycache__`` file instead when one is there, which could hold anything, and write one."""

    def __init__(self, fullname: str, path: str, text: str):
        super().__init__(fullname, path)
        self.text = text

    def get_source(self, fullname: str) -> str:
        return self.text

    def get_code(self, fullname: str):
        # `triton.jit` reads its functions' source with `inspect`, through linecache: it finds
        # this text there (an entry without mtime is never checked against the disk), not the
        # file, which could have changed since it was checked.
        linecache.cache[self.path] = (len(self.text), None, self.text.splitlines(True), self.path)
        return compile(self.text, self.path, "exec", dont_inherit=True)


def _import(path: Path, interpret: bool, text: str) -> ModuleType:
    name = f"flexattn_generated.{path.stem}"
    loader = _CheckedLoader(name, str(path), text)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        with _interpret_mode(interpret):
            loader.exec_module(mod)
    except BaseException as e:
        sys.modules.pop(name, None)
        linecache.cache.pop(str(path), None)
        if isinstance(e, Exception) and not isinstance(e, FileNotFoundError):
            with contextlib.suppress(OSError):  # not for Ctrl-C: the entry itself may be fine
                path.unlink()
        raise
    return mod
