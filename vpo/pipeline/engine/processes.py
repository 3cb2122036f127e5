"""Processes a long-running command starts, and how it stops them.

Every long-running ``vpo`` command (``run``, ``stage``, ``flow``, ``ui``, ``serve``) treats SIGTERM and
SIGHUP as it treats Ctrl-C: :func:`stop_on_signals` turns them into :class:`Terminated` (a
``KeyboardInterrupt``) in the main thread, so ``finally`` blocks run, and first stops every child
process group registered with :func:`track` (stages run in their own sessions, so a terminal's Ctrl-C
does not reach them by itself). The command then prints one line and exits 130 (SIGINT) or 128 + the
signal number (143 for SIGTERM).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["CHILD_ENV", "STOP_SIGNALS", "Terminated", "children_stop_first", "exit_code", "kill_group", "stop_all", "stop_on_signals",
           "stopping", "track", "tracked", "untrack"]

CHILD_ENV = "VPO_TRAIN_LAUNCHED"
"""Set in the processes ``accelerate launch`` starts for the train stage: they train, nothing else."""

_CHILDREN: set[subprocess.Popen[Any]] = set()
_GUARD = threading.Lock()
_STOPPING = threading.Event()


def stopping() -> bool:
    """Whether this command is stopping on a signal (a stage that ended now was killed: do not retry)."""
    return _STOPPING.is_set()


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into an exception, so ``finally`` blocks (stopping servers and stage
    process groups) run as they do on Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(exc: BaseException) -> int:
    """The exit status for an interruption: 128 + the signal (143 for SIGTERM), 130 for Ctrl-C."""
    return 128 + exc.signum if isinstance(exc, Terminated) else 128 + signal.SIGINT


def describe(exc: BaseException) -> str:
    """``stopped by SIGTERM`` or ``interrupted``."""
    return str(exc) if isinstance(exc, Terminated) else "interrupted"


def kill_group(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM then SIGKILL the process group ``proc`` leads (it was started with
    ``start_new_session=True``), waiting up to ``grace_s`` after each."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            proc.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # what the leader left behind in its group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def track(proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    """Register a child that leads its own process group: :func:`stop_all` stops it."""
    with _GUARD:
        _CHILDREN.add(proc)
    return proc


def untrack(proc: subprocess.Popen[Any]) -> None:
    """Forget a child (it has ended or was stopped)."""
    with _GUARD:
        _CHILDREN.discard(proc)


def tracked() -> list[subprocess.Popen[Any]]:
    """The children registered now."""
    with _GUARD:
        return list(_CHILDREN)


def stop_all(grace_s: float = 5.0) -> int:
    """Stop every registered child's process group (SIGTERM to all, then SIGKILL to what is left);
    returns how many were running."""
    children = tracked()
    running = [p for p in children if p.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in running:
        kill_group(proc, grace_s)
    for proc in children:
        untrack(proc)
    return len(running)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def children_stop_first() -> Iterator[None]:
    """Within the block SIGTERM, SIGHUP and SIGINT first stop every registered child (and mark the
    command as stopping), then go on to the handler that was installed before the block -- whoever
    installed it. A framework that runs this block may replace the command's own handler with one
    that only raises (Prefect's flow engine turns SIGTERM into a crash or a cancellation, then waits
    for its task threads); the stage processes those threads wait for must not outlive the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: old for sig in STOP_SIGNALS if (old := signal.getsignal(sig)) != signal.SIG_IGN}

    def handler(signum: int, frame: Any) -> None:
        _STOPPING.set()
        stop_all()
        before = previous[signum]
        if callable(before):
            before(signum, frame)
        elif before in (signal.SIG_DFL, None):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(signum)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            if signal.getsignal(sig) is handler:  # leave a handler someone installed meanwhile alone
                signal.signal(sig, old)


@contextlib.contextmanager
def stop_on_signals(on_stop: Callable[[], None] | None = None) -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise :class:`Terminated` and SIGINT ``KeyboardInterrupt``
    in the main thread, after the registered children (and ``on_stop``) were stopped. Outside the main
    thread nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        _STOPPING.set()
        stop_all()
        if on_stop is not None:
            with contextlib.suppress(Exception):
                on_stop()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
