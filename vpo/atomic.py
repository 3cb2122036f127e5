"""Atomic file and folder writes: every artifact is written to a temporary sibling and renamed into
place, so a crash leaves either the old or the new version, never a torn one; published files and
folders get the umask's usual modes. Plain Python, used by the library and the pipeline alike."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_dir",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "current_umask",
    "remove_stale_temps",
    "remove_temps_in",
]


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform/filesystem
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def current_umask() -> int:
    """The process umask (read without changing it where /proc allows, so threads never see 0)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` via a temp sibling + ``os.replace``: readers see old or new bytes.
    The file gets the umask's usual mode (``mkstemp`` alone would make it 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(path.parent)
    return path


def atomic_write_text(
    path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8", fsync: bool = True
) -> Path:
    """Atomically write ``text`` (see :func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode(encoding), fsync=fsync)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2, sort_keys: bool = True,
                      allow_nan: bool = True, fsync: bool = True) -> Path:
    """Atomically write ``obj`` as JSON, by default with sorted keys (stable bytes, so DVC hashes are
    stable); ``allow_nan=False`` refuses NaN and infinities (strict JSON) instead of writing them."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, allow_nan=allow_nan, default=_json_default) + "\n"
    return atomic_write_text(path, text, fsync=fsync)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy scalars and arrays
        return obj.tolist()
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], *, overwrite: bool = True, fsync: bool = True) -> Iterator[Path]:
    """Build a directory atomically: yields a temp sibling to fill; on normal exit it replaces ``path``
    (on Linux by an atomic exchange, so a crash leaves the old or the new folder), on error it is
    deleted and ``path`` is untouched. ``overwrite=False`` refuses to replace an existing ``path``.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700; publish with mkdir's usual mode
    try:
        yield tmp
        if fsync:
            _fsync_tree(tmp)
        if path.exists() or path.is_symlink():
            if not overwrite:
                raise FileExistsError(f"{path} already exists (atomic_dir called with overwrite=False)")
            if _exchange(tmp, path):
                shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old version
            else:  # portable fallback: two renames (a crash in between leaves the old copy at .old-*)
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
                os.rmdir(old)
                os.rename(path, old)
                try:
                    os.rename(tmp, path)
                except BaseException:
                    os.rename(old, path)
                    raise
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        if fsync:
            _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_temps_in(folder: str | os.PathLike[str]) -> list[Path]:
    """Delete every temp left by a killed writer directly inside ``folder`` (``.NAME.tmp-*`` /
    ``.NAME.old-*``); call it only while holding the lock of the stage that writes there."""
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
                removed.append(p)
    return removed


def remove_stale_temps(path: str | os.PathLike[str], *, older_than_s: float = 3600.0) -> list[Path]:
    """Delete temp siblings of ``path`` left by killed writers (``.NAME.tmp-*`` / ``.NAME.old-*``)
    older than ``older_than_s``; young ones may belong to a writer that is still running."""
    path = Path(path).absolute()
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    cutoff = time.time() - older_than_s
    for pattern in (f".{path.name}.tmp-*", f".{path.name}.old-*"):
        for p in path.parent.glob(pattern):
            try:
                if p.lstat().st_mtime > cutoff:
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
            except FileNotFoundError:
                continue
    return removed
