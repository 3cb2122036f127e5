"""Run-folder locks: one writer per pipeline run folder at a time, failing fast with a clear message.

Local locks are ``filelock.FileLock`` (an ``flock`` on Unix) on files in the run folder; Prefect global
concurrency limits add the same exclusion across machines (:mod:`flows.locks`).

* whole-pipeline work (``vpo run`` / :func:`vpo.pipeline.runner.run_all`, ``vpo stage NAME``) holds
  ``runs/<variant>/.lock`` and refuses while any arm run trains;
* ``vpo stage train --arm A --seed S`` holds ``.locks/A-sS.lock`` and refuses while whole-pipeline
  work holds ``.lock`` -- except the training runs a parallel ``vpo run`` starts itself (its children
  are told through :data:`PARENT_ENV`), so different arms train side by side and the same arm never
  trains twice at once.

A lock that is busy is waited for at most :data:`PATIENCE_S` (long enough for another process's
momentary check, far shorter than any real holder), then :class:`LockBusyError` names the holder
(pid, host, start time, command) from the record the holder wrote into the lock file. The kernel
drops the lock when its holder dies, so a SIGKILLed run never leaves a stale lock: the next run takes
it over and overwrites the dead holder's record. filelock closes a held lock's descriptor in forked
children, so a child outliving a killed parent does not keep the lock either. Nested acquisitions of
the same lock in one process are counted, not re-locked.
"""

from __future__ import annotations

import contextlib
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

from filelock import FileLock, Timeout

__all__ = ["LOCK_NAME", "PARENT_ENV", "LockBusyError", "LockHolder", "arm_lock_path", "child_env", "pipeline_lock",
           "read_holder", "shared_cache_lock"]

LOCK_NAME = ".lock"
ARM_LOCK_DIR = ".locks"
PARENT_ENV = "VPO_RUN_LOCK"
"""``<lock path>:<pid>``: set by a whole-pipeline run for the arm trainings it starts itself."""
PATIENCE_S = 0.5
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
    lock: FileLock
    count: int


_HELD: dict[str, _Held] = {}
_GUARD = threading.RLock()


def _forget_in_child() -> None:
    """A forked child holds none of its parent's locks (filelock closed their descriptors)."""
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def read_holder(path: str | os.PathLike[str]) -> LockHolder | None:
    """The holder record in lock file ``path`` (None if absent, empty or unreadable)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return LockHolder(pid=int(data["pid"]), host=str(data["host"]), since=str(data["since"]),
                          command=str(data["command"]), pipeline=str(data["pipeline"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _command() -> str:
    """This process's command line, secrets masked, at most 200 characters."""
    from vpo.pipeline.engine.storage import redact

    argv = [Path(sys.argv[0]).name if sys.argv else "python", *sys.argv[1:]]
    text = redact(" ".join(argv))
    return text if len(text) <= 200 else text[:197] + "..."


def _record(pipeline: str, command: str | None) -> bytes:
    now = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    holder = LockHolder(pid=os.getpid(), host=socket.gethostname(), since=now, command=command or _command(),
                        pipeline=pipeline)
    return (json.dumps(asdict(holder), sort_keys=True) + "\n").encode()


def _writer(data: bytes) -> object:
    def write(fd: int) -> None:  # filelock calls it with the locked descriptor, before acquire returns
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    return write


def _acquire(path: Path, record: bytes | None, patience_s: float = PATIENCE_S) -> bool:
    """Take (or count) the lock at ``path``, writing ``record`` into it; False when another process
    holds it for longer than ``patience_s``."""
    key = str(path)
    with _GUARD:
        held = _HELD.get(key)
        if held is not None:
            held.count += 1
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path, timeout=patience_s, thread_local=False, poll_interval=0.02,
                        on_acquired=_writer(record) if record is not None else None)  # type: ignore[arg-type]
        try:
            lock.acquire()
        except Timeout:
            return False
        _HELD[key] = _Held(lock, 1)
        return True


def _release(path: Path, clear: bool = True) -> None:
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
            if clear:  # a released lock keeps no holder record (we still hold it: the file is ours)
                with contextlib.suppress(OSError):
                    os.truncate(path, 0)
        finally:
            held.lock.release()


def _free(path: Path, patience_s: float = PATIENCE_S) -> bool:
    """Whether nobody else holds ``path`` (checked by taking and dropping it at once); a lock this
    process holds counts as free."""
    if str(path) in _HELD:
        return True
    if not path.exists():
        return True
    if not _acquire(path, None, patience_s):
        return False
    _release(path, clear=False)
    return True


def _busy_holders(run_dir: Path) -> list[LockHolder]:
    """Records of the arm trainings currently holding their arm locks."""
    out = []
    for arm_lock in sorted((run_dir / ARM_LOCK_DIR).glob("*.lock")):
        if not _free(arm_lock, 0.0):
            holder = read_holder(arm_lock)
            if holder is not None:
                out.append(holder)
    return out


def _busy_arm_lock(run_dir: Path) -> Path | None:
    """The first arm lock another process holds (after :data:`PATIENCE_S` each)."""
    for arm_lock in sorted((run_dir / ARM_LOCK_DIR).glob("*.lock")):
        if not _free(arm_lock):
            return arm_lock
    return None


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


def arm_lock_path(run_dir: str | os.PathLike[str], arm: str) -> Path:
    """Lock file of one arm run (``<run_dir>/.locks/<arm>.lock``)."""
    return Path(run_dir) / ARM_LOCK_DIR / f"{_SAFE.sub('_', arm)}.lock"


def child_env(run_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The environment entry that lets an arm training this process starts run beside it while it
    holds the run folder's lock."""
    return {PARENT_ENV: f"{Path(run_dir).absolute() / LOCK_NAME}:{os.getpid()}"}


def _parent_holds(main: Path) -> bool:
    """Whether the process that started us holds ``main`` and said so (:func:`child_env`)."""
    value = os.environ.get(PARENT_ENV, "")
    path, _, pid = value.rpartition(":")
    if not path or Path(path) != main.absolute() or not pid.isdigit():
        return False
    holder = read_holder(main)
    return holder is not None and holder.pid == int(pid) == os.getppid() and holder.alive() is True


@contextlib.contextmanager
def pipeline_lock(run_dir: str | os.PathLike[str], pipeline: str, *, arm: str | None = None,
                  command: str | None = None) -> Iterator[Path]:
    """Hold the run folder's lock for the block (``arm`` given: that arm run's lock, while no
    whole-pipeline work runs). Raises :class:`LockBusyError` at once when another process is in the way."""
    run_dir = Path(run_dir)
    main = run_dir / LOCK_NAME
    record = _record(pipeline, command)
    what = f"pipeline {pipeline} (run folder {run_dir})"
    if arm is None:
        if not _acquire(main, record):
            holder = _settled_holder(main)
            raise LockBusyError(_busy_message(what, main, holder, _busy_holders(run_dir)), main, holder)
        try:
            busy = _busy_arm_lock(run_dir)
            if busy is not None:
                holder = _settled_holder(busy)
                raise LockBusyError(_busy_message(what, busy, None, [holder] if holder else []), busy, holder)
        except BaseException:
            _release(main)
            raise
        try:
            yield main
        finally:
            _release(main)
        return
    beside_parent = _parent_holds(main)

    def check_main() -> None:
        if not beside_parent and not _free(main):
            holder = _settled_holder(main)
            raise LockBusyError(_busy_message(what, main, holder, []), main, holder)

    check_main()  # before creating anything in the run folder
    arm_path = arm_lock_path(run_dir, arm)
    if not _acquire(arm_path, record):
        holder = _settled_holder(arm_path)
        raise LockBusyError(_busy_message(f"arm {arm} of {what}", arm_path, holder, []), arm_path, holder)
    try:
        check_main()  # whole-pipeline work that started in between saw no arm lock yet: we see it
    except BaseException:
        _release(arm_path)
        raise
    try:
        yield main
    finally:
        _release(arm_path)


@contextlib.contextmanager
def shared_cache_lock(folder: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Hold the lock of a cache folder several stages share (the runs folder's model cache): one
    process fills or reads it at a time; another one waits, saying so once (filling takes minutes,
    reading a moment)."""
    from vpo.pipeline.engine.console import log

    folder = Path(folder)
    path = folder.parent / f".{folder.name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"waiting for another stage that is preparing {what} ({folder})")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
