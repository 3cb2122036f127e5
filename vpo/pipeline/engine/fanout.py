"""Commands run side by side: independent ``vpo stage`` processes (the arm x seed training runs, each
arm's search), at most ``max_parallel`` at once, each in a slot of its own (threads, GPUs), allowed to
work beside the caller that holds the run folder's lock. Their output is relayed line by line (stage
events to the console, everything to the log file); their failures become one error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vpo.pipeline.config.layout import RunLayout
from vpo.pipeline.engine.console import relay
from vpo.pipeline.engine.errors import EXIT_BAD_INPUT, EXIT_LOCKED, StageError
from vpo.pipeline.engine.execution import Concurrency, Slot

__all__ = ["StageProcessFailed", "run_processes"]


class StageProcessFailed(RuntimeError):
    """A stage process run beside others crashed (not a bad-input or lock refusal); the message
    holds its last output lines."""


@dataclass
class _Child:
    label: str
    slot: Slot
    proc: subprocess.Popen[bytes]
    started: float
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    errors: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None


def _shown(line: str, label: str) -> bool:
    """Whether a stage process's output line is a console line (stage events, its bar, its error);
    none once this command is stopping (its own line says how to resume, not each stage's)."""
    from vpo.pipeline.engine.processes import stopping

    if line.startswith("[vpo] full log: ") or stopping():
        return False
    return line.startswith(("[vpo] ", f"{label}: ", "error:", "warning:"))


def _pump(child: _Child) -> None:
    """Relay a stage process's output line by line: stage events to the console, everything to the
    log file (``label | ...``)."""
    assert child.proc.stdout is not None
    label = child.label
    for raw in iter(child.proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n").split("\r")[-1].rstrip()
        if not line:
            continue
        child.tail.append(line)
        if line.startswith("error:"):
            child.errors.append(line)
            relay(f"[vpo] {label}: {line}", console=_shown(line, label))
        elif _shown(line, label):
            relay(line, console=True)
        else:
            relay(f"{label} | {line}", console=False)


def _start_child(label: str, argv: Sequence[str], slot: Slot, layout: RunLayout) -> _Child:
    from vpo.pipeline.engine.locking import child_env
    from vpo.pipeline.engine.processes import track

    env = {**os.environ, **slot.env(), **child_env(layout.root), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vpo.pipeline.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    track(proc)
    child = _Child(label, slot, proc, time.time())
    child.reader = threading.Thread(target=_pump, args=(child,), name=f"relay-{label}", daemon=True)
    child.reader.start()
    return child


def _failure(children: list[_Child], layout: RunLayout) -> BaseException:
    """One exception for the failed stage processes: a lock refusal, bad input, or a crash."""
    from vpo.pipeline.engine.locking import LOCK_NAME, LockBusyError

    first = children[0]
    rc = first.proc.returncode
    others = (f" (and {len(children) - 1} more: {', '.join(c.label for c in children[1:])})"
              if len(children) > 1 else "")
    line = first.errors[-1].removeprefix("error:").strip() if first.errors else ""
    if rc == EXIT_LOCKED and line:
        return LockBusyError(f"{first.label}: {line}{others}", layout.root / LOCK_NAME, None)
    if rc == EXIT_BAD_INPUT and line:
        return StageError(f"{first.label}: {line}{others}")
    tail = "\n".join(f"  {t}" for t in list(first.tail)[-15:])
    return StageProcessFailed(f"{first.label} exited with {rc}{others}; its last output:\n{tail}")


def run_processes(jobs: Sequence[tuple[str, Sequence[str]]], ex: Concurrency, *, layout: RunLayout,
                  on_done: Callable[[str], None] | None = None, poll_s: float = 0.2) -> None:
    """Run ``vpo`` commands (``(label, argv)``, e.g. ``("train@vpo-s0", ["stage", "train", ...])``),
    at most ``ex.max_parallel`` at once, each in a slot of its own (threads, GPUs) and allowed to work
    beside the caller, which holds the run folder's lock. ``on_done(label)`` follows each success. A
    failure lets the running ones finish, starts no new one, then raises one error for all."""
    from vpo.pipeline.engine.processes import kill_group, untrack

    pending, free = list(jobs), ex.slots()
    running: list[_Child] = []
    failed: list[_Child] = []
    try:
        while running or (pending and not failed):
            while pending and free and not failed:
                label, argv = pending.pop(0)
                running.append(_start_child(label, argv, free.pop(0), layout))
            for child in [c for c in running if c.proc.poll() is not None]:
                running.remove(child)
                if child.reader is not None:
                    child.reader.join(timeout=30)
                untrack(child.proc)
                free.append(child.slot)
                if child.proc.returncode != 0:
                    failed.append(child)
                elif on_done is not None:
                    on_done(child.label)
            time.sleep(poll_s)
    finally:
        for child in running:  # interrupted (the signal handler stopped them already) or crashed here
            kill_group(child.proc)
            untrack(child.proc)
    if failed:
        raise _failure(failed, layout)
