"""Checkpoints a cluster can resume from: every trainer checkpoint copied to ``storage.checkpoints``.

With ``storage.checkpoints`` set (any fsspec URL: ``s3://bucket/prefix``, a shared folder), the process
that saves checkpoints copies each ``checkpoint-N`` folder, once it is written, to
``<url>/<variant>/<run>/<request>/checkpoint-N/`` in a background thread; ``<request>`` is the start of
the run request's fingerprint digest, so a changed setting, code file or input never resumes from
another request's weights. A copy is complete once its marker (:data:`MARKER`, the file list with sizes)
is written, last. Before the next save the trainer waits for the previous copy (a step never waits
longer than one checkpoint's copy), then the oldest complete copies beyond ``storage.checkpoints_keep``
are deleted (marker first, so a half-deleted copy is never taken for a complete one).

Before training, a run whose local ``trainer/`` folder holds no intact checkpoint restores the newest
complete copy (:func:`restore`); copies without a marker (cut mid-upload) or whose files do not match it
are skipped, with a line saying so. A copy that fails (network, quota) is a warning: training goes on
with its local checkpoints and the next save tries again.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpo.pipeline.engine.checkpoints import checkpoint_step, latest_checkpoint
from vpo.pipeline.engine.console import detail, log
from vpo.pipeline.engine.errors import StageError
from vpo.pipeline.engine.storage import get_filesystem, redact

if TYPE_CHECKING:
    from vpo.pipeline.engine.context import StageContext

__all__ = ["MARKER", "MIRROR_ENV", "CheckpointMirror", "Copy", "filesystem", "mirror_url", "newest_complete",
           "restore", "restore_for"]

MARKER = "_COMPLETE.json"
"""Written last into a mirrored checkpoint: ``{"step", "files": {relative path: size}}``."""

MIRROR_ENV = "VPO_CHECKPOINT_MIRROR"
"""Set by the train stage for the processes ``accelerate launch`` starts: this run's mirror URL."""

_REQUEST_CHARS = 16


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec filesystem, root path)`` of any fsspec URL; S3 through the project's ``AWS_*`` settings."""
    if url.startswith(("s3://", "file://")) or "://" not in url:
        return get_filesystem(url)
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, str(path).rstrip("/")


def mirror_url(ctx: StageContext) -> str | None:
    """Where this run's checkpoints are mirrored (None: ``storage.checkpoints`` unset). The launched
    training processes read it from :data:`MIRROR_ENV` (they have no request fingerprint)."""
    base = ctx.cfg.storage.checkpoints
    if base is None:
        return None
    if ctx.fingerprint is None:
        return os.environ.get(MIRROR_ENV) or None
    base = base if "://" in base else str(ctx.cfg.resolve_path(base))
    return f"{base.rstrip('/')}/{ctx.cfg.variant}/{ctx.arm_run.rid}/{ctx.fingerprint.digest[:_REQUEST_CHARS]}"


@dataclass(frozen=True)
class Copy:
    """One mirrored checkpoint: its step, path in the filesystem and whether its marker matches its files."""

    step: int
    path: str
    complete: bool
    why: str = ""


def _files(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _copies(fs: Any, root: str) -> list[Copy]:
    """Every ``checkpoint-N`` under ``root``, newest first, each checked against its marker."""
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        step = checkpoint_step(Path(name))
        if step is None:
            continue
        path = f"{root}/{name}"
        out.append(Copy(step, path, *_check(fs, path)))
    return sorted(out, key=lambda c: c.step, reverse=True)


def _check(fs: Any, path: str) -> tuple[bool, str]:
    try:
        marker = json.loads(fs.cat_file(f"{path}/{MARKER}"))
    except FileNotFoundError:
        return False, "no completion marker (cut mid-upload)"
    except (OSError, ValueError) as exc:
        return False, f"unreadable completion marker ({exc.__class__.__name__})"
    try:
        found = {str(p)[len(path) + 1:]: int(info["size"]) for p, info in fs.find(path, detail=True).items()}
    except OSError as exc:
        return False, f"cannot list it ({exc.__class__.__name__})"
    for rel, size in dict(marker.get("files") or {}).items():
        if found.get(rel) != size:
            return False, f"{rel} is {'missing' if rel not in found else f'{found[rel]} bytes, not {size}'}"
    return True, ""


def newest_complete(url: str) -> Copy | None:
    """The newest complete mirrored checkpoint under ``url`` (incomplete newer ones reported and skipped)."""
    fs, root = filesystem(url)
    for copy in _copies(fs, root):
        if copy.complete:
            return copy
        log(f"skipping mirrored checkpoint-{copy.step} at {redact(url)}: {copy.why}; using the one before it")
    return None


def restore(trainer_dir: Path, url: str) -> Path | None:
    """Download the newest complete mirrored checkpoint into ``trainer_dir`` when that folder holds no
    intact checkpoint of its own; returns the restored folder (None: nothing restored)."""
    if latest_checkpoint(trainer_dir) is not None:
        return None
    copy = newest_complete(url)
    if copy is None:
        return None
    fs, _ = filesystem(url)
    name = f"checkpoint-{copy.step}"
    trainer_dir.mkdir(parents=True, exist_ok=True)
    # its own temporary folder: nodes sharing a run folder may restore at the same time
    partial = trainer_dir / f".{name}.restoring-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    t0 = time.monotonic()
    try:
        fs.get(f"{copy.path}/", f"{partial}/", recursive=True)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise StageError(f"could not restore {name} from {redact(url)} into {trainer_dir} "
                         f"({exc.__class__.__name__}: {exc}); check storage.checkpoints and the AWS_* variables, "
                         "then run the stage again") from None
    (partial / MARKER).unlink(missing_ok=True)
    target = trainer_dir / name
    if latest_checkpoint(trainer_dir) == target:  # another node sharing this folder restored it meanwhile
        shutil.rmtree(partial, ignore_errors=True)
        return target
    shutil.rmtree(target, ignore_errors=True)  # a damaged local copy latest_checkpoint skipped
    os.replace(partial, target)
    log(f"restored {name} from {redact(url)} ({sum(_files(target).values()) / 2**20:.1f} MiB in "
        f"{time.monotonic() - t0:.1f} s): no intact checkpoint on this machine")
    return target


def restore_for(ctx: StageContext) -> Path | None:
    """:func:`restore` for a train stage step, when ``storage.checkpoints`` is set."""
    url = mirror_url(ctx)
    return None if url is None else restore(ctx.layout.arm_trainer(ctx.arm_run.rid), url)


class CheckpointMirror:
    """Copies checkpoint folders to ``url`` one at a time in a background thread, keeping the newest
    ``keep`` complete copies. :meth:`submit` after a checkpoint is written, :meth:`wait` before the next
    save (and at the end); a failed copy is reported through ``warn`` and leaves no marker."""

    def __init__(self, url: str, keep: int, *, warn: Callable[[str], None] = log) -> None:
        self.url, self.keep, self.warn = url, keep, warn
        self.fs, self.root = filesystem(url)
        self._thread: threading.Thread | None = None
        self.copied: list[int] = []
        self.seconds: list[float] = []

    def submit(self, checkpoint: Path) -> None:
        """Start copying ``checkpoint`` (after the previous copy finished)."""
        self.wait()
        self._thread = threading.Thread(target=self._copy, args=(checkpoint,), name=f"mirror-{checkpoint.name}",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the copy in flight (if any) is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _copy(self, checkpoint: Path) -> None:
        step, t0 = checkpoint_step(checkpoint), time.monotonic()
        dest = f"{self.root}/{checkpoint.name}"
        try:
            files = _files(checkpoint)
            if self.fs.exists(dest):
                self.fs.rm(dest, recursive=True)  # an earlier, cut copy of the same step
            for rel in files:
                self.fs.put_file(str(checkpoint / rel), f"{dest}/{rel}")
            self.fs.pipe_file(f"{dest}/{MARKER}", json.dumps({"step": step, "files": files}).encode())
            self._prune()
        except Exception as exc:  # noqa: BLE001 - a failed copy must not stop training; the next save tries again
            self.warn(f"warning: could not mirror {checkpoint.name} to {redact(self.url)} ({exc.__class__.__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}); training goes on with local checkpoints")
            return
        self.copied.append(int(step or 0))
        self.seconds.append(time.monotonic() - t0)
        detail(f"mirrored {checkpoint.name} to {redact(self.url)} in {self.seconds[-1]:.1f} s")

    def _prune(self) -> None:
        complete = [c for c in _copies(self.fs, self.root) if c.complete]
        for old in complete[self.keep:]:
            self.fs.rm_file(f"{old.path}/{MARKER}")  # incomplete from here on: never restored
            self.fs.rm(old.path, recursive=True)


def mirror_callback(url: str, keep: int) -> Any:
    """A ``TrainerCallback`` that mirrors every checkpoint the world's main process saves (see the module
    docstring: it waits for the previous copy before the next save and at the end of training)."""
    from transformers import TrainerCallback

    class MirrorCallback(TrainerCallback):
        def __init__(self) -> None:
            self.mirror: CheckpointMirror | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.is_world_process_zero:
                self.mirror = CheckpointMirror(url, keep)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.mirror is not None and control.should_save:  # the save (and its rotation) comes next
                self.mirror.wait()

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.mirror is not None:
                self.mirror.submit(Path(args.output_dir) / f"checkpoint-{state.global_step}")

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.mirror is not None:
                self.mirror.wait()

    return MirrorCallback()

