"""The pipeline's error type and exit codes: what ``vpo`` prints as one ``error:`` line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_LOCKED", "StageError", "disk_full", "disk_of", "full_disk_text"]

EXIT_BAD_INPUT = 2
"""Bad input (config, data, reward, checkpoint, disk full): retrying cannot help; the message says what to do."""

EXIT_LOCKED = 3
"""The run folder is locked by another run."""


class StageError(RuntimeError):
    """A stage cannot run (missing or corrupt upstream output, bad input, full disk); the message names
    the file or setting and what to do."""

EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT, as a shell reports it)."""


def disk_full(exc: BaseException | None) -> tuple[bool, Path | None]:
    """Whether ``exc`` or an error it came from is a full disk (OSError ENOSPC/EDQUOT, a writer in
    another language saying "No space left on device", torch's writer failing mid-file, an error with
    a ``disk_path``), and the file it failed to write when one is known (None: the caller knows best
    where it was writing)."""
    full, path = False, None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            full = True
            path = path or next((Path(f) for f in (exc.filename, exc.filename2) if f), None)
        if getattr(exc, "disk_path", None) is not None:  # a writer that knows where it was writing
            full, path = True, path or Path(exc.disk_path)
        text = str(exc)
        if "No space left on device" in text or "Disk quota exceeded" in text or ("enforce fail" in text and (
                "unexpected pos" in text or "file write failed" in text)):
            full = True
        exc = exc.__cause__ or exc.__context__
    return full, path


def full_disk_text(path: Path) -> str:
    """``the disk holding PATH is full (mounted at M, N MiB free)``: which disk is full, found from the
    path that could not be written (the nearest existing folder above it)."""
    return f"the disk holding {path} is full ({disk_of(path)})"


def disk_of(path: Path) -> str:
    """``mounted at M, N MiB free``: the file system ``path`` (or the nearest folder above it) is on."""
    here = Path(os.path.abspath(path))
    while not here.exists() and here != here.parent:
        here = here.parent
    mount = here
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        stat = os.statvfs(here)
        free = f"{stat.f_bavail * stat.f_frsize / 2**20:,.0f} MiB free"
    except OSError:
        free = "free space unknown"
    return f"mounted at {mount}, {free}"
