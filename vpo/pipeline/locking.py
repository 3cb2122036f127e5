"""Run-folder locks: one writer per pipeline run folder at a time, failing fast with a clear message.

``runs/<pipeline>[-quick]/.lock`` is locked with ``fcntl.flock``:

* whole-pipeline work (``vpo run`` / :func:`vpo.pipeline.runner.run_all`, ``vpo stage NAME``) holds it
  exclusively;
* ``vpo stage train --arm A --seed S`` holds it shared plus ``.locks/A-sS.lock`` exclusively, so
  different arms may train in parallel (separate processes) while no other stage runs, and the
  same arm never trains twice at once.

A second process asking for a held lock gets :class:`LockBusyError` at once (no waiting) whose
message names the holder (pid, host, start time, command) read from the lock file. The kernel drops
a flock when its holder dies, so a SIGKILLed run never leaves a stale lock: the next run takes it
over and only the leftover holder record (dead pid) is overwritten. Forked children close their
copy of the lock descriptor, so a child outliving a killed parent does not keep the lock either.
Nested acquisitions of the same lock in one process are counted, not re-locked.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["LOCK_NAME", "LockBusyError", "LockHolder", "pipeline_lock", "read_holder"]

LOCK_NAME = ".lock"
ARM_LOCK_DIR = ".locks"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class LockBusyError(RuntimeError):
    """Another process holds the lock; ``holder`` is its record when one could be read."""

    def __init__(self, message: str, path: Path, holder: LockHolder | None) -> None:
        super().__init__(message)
        self.path = path
        self.holder = holder


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock: written into the lock file by the holder, for messages only."""

    pid: int
    host: str
    since: str
    command: str
    pipeline: str

    def alive(self) -> bool | None:
        """Whether the process still exists (None when it runs on another host)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def describe(self) -> str:
        """``pid N on HOST since T: COMMAND``."""
        return f"pid {self.pid} on {self.host} since {self.since}: {self.command}"


@dataclass
class _Held:
    fd: int
    exclusive: bool
    count: int


_HELD: dict[str, _Held] = {}
_GUARD = threading.RLock()


def _close_inherited() -> None:
    """In a forked child: drop the copies of held lock descriptors (without unlocking the parent's)."""
    for held in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)


def read_holder(path: str | os.PathLike[str]) -> LockHolder | None:
    """The holder record in lock file ``path`` (None if absent, empty or unreadable)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text)
        return LockHolder(pid=int(data["pid"]), host=str(data["host"]), since=str(data["since"]),
                          command=str(data["command"]), pipeline=str(data["pipeline"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _command() -> str:
    """This process's command line, secrets masked, at most 200 characters."""
    from vpo.pipeline.storage import redact

    argv = [Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]]
    text = redact(" ".join(argv))
    return text if len(text) <= 200 else text[:197] + "..."


def _record(pipeline: str, command: str | None) -> bytes:
    now = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    holder = LockHolder(pid=os.getpid(), host=socket.gethostname(), since=now, command=command or _command(),
                        pipeline=pipeline)
    return (json.dumps(asdict(holder), sort_keys=True) + "\n").encode()


def _try_lock(path: Path, exclusive: bool) -> int | None:
    """Open ``path`` and flock it without waiting; the fd, or None when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _write_record(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _busy_holders(run_dir: Path) -> list[LockHolder]:
    """Records of the arm trainings currently holding their arm locks."""
    out = []
    for arm_lock in sorted((run_dir / ARM_LOCK_DIR).glob("*.lock")):
        fd = _try_lock(arm_lock, exclusive=True)
        if fd is None:
            holder = read_holder(arm_lock)
            if holder is not None:
                out.append(holder)
        else:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    return out


def _settled_holder(path: Path, tries: int = 5, pause_s: float = 0.05) -> LockHolder | None:
    """The holder record, re-read briefly while it is missing or names a dead process: a holder that
    has just taken the lock writes its record a moment later."""
    holder = read_holder(path)
    for _ in range(tries):
        if holder is not None and holder.alive() is not False:
            break
        time.sleep(pause_s)
        holder = read_holder(path)
    return holder


def _busy_message(what: str, path: Path, holder: LockHolder | None, others: list[LockHolder]) -> str:
    if holder is not None and holder.alive() is not False:
        return (f"{what} is already running ({holder.describe()}); wait for it to finish or stop pid "
                f"{holder.pid}. A lock whose holder died is released automatically (lock file: {path})")
    if others:
        running = "; ".join(h.describe() for h in others)
        return (f"{what} is busy: arm training is running ({running}); wait for it to finish or stop it "
                f"(lock file: {path})")
    gone = f" (its recorded holder pid {holder.pid} has exited)" if holder is not None else ""
    return (f"{what} is locked by another process{gone}; a process it started may still hold {path}: "
            f"find it with `fuser -v {path}` and stop it, then retry")


def _acquire(path: Path, exclusive: bool, record: bytes | None) -> bool:
    """Take (or count) the lock at ``path``; False when another process holds it."""
    key = str(path)
    with _GUARD:
        held = _HELD.get(key)
        if held is not None:
            if exclusive and not held.exclusive:
                raise RuntimeError(f"{path} is held shared by this process; cannot upgrade it to exclusive")
            held.count += 1
            return True
        fd = _try_lock(path, exclusive)
        if fd is None:
            return False
        if record is not None:
            _write_record(fd, record)
        _HELD[key] = _Held(fd, exclusive, 1)
        return True


def _release(path: Path, clear: bool) -> None:
    key = str(path)
    with _GUARD:
        held = _HELD.get(key)
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[key]
        try:
            if clear:
                os.ftruncate(held.fd, 0)
            fcntl.flock(held.fd, fcntl.LOCK_UN)
        finally:
            os.close(held.fd)


def arm_lock_path(run_dir: str | os.PathLike[str], arm: str) -> Path:
    """Lock file of one arm run (``<run_dir>/.locks/<arm>.lock``)."""
    return Path(run_dir) / ARM_LOCK_DIR / f"{_SAFE.sub('_', arm)}.lock"


@contextlib.contextmanager
def pipeline_lock(run_dir: str | os.PathLike[str], pipeline: str, *, arm: str | None = None,
                  command: str | None = None) -> Iterator[Path]:
    """Hold the run folder's lock for the block: exclusive, or (``arm`` given) shared plus the arm's
    own exclusive lock. Raises :class:`LockBusyError` at once when another process is in the way."""
    run_dir = Path(run_dir)
    main = run_dir / LOCK_NAME
    record = _record(pipeline, command)
    what = f"pipeline {pipeline} (run folder {run_dir})"
    exclusive = arm is None
    if not _acquire(main, exclusive, record if exclusive else None):
        holder = _settled_holder(main)
        raise LockBusyError(_busy_message(what, main, holder, _busy_holders(run_dir)), main, holder)
    arm_path = arm_lock_path(run_dir, arm) if arm is not None else None
    try:
        if arm_path is not None and not _acquire(arm_path, True, record):
            holder = _settled_holder(arm_path)
            raise LockBusyError(_busy_message(f"arm {arm} of {what}", arm_path, holder, []), arm_path, holder)
    except BaseException:
        _release(main, clear=False)
        raise
    try:
        yield main
    finally:
        if arm_path is not None:
            _release(arm_path, clear=True)
        _release(main, clear=exclusive)
