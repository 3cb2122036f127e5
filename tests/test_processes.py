"""vpo.pipeline.engine.processes: a signal stops the stage processes a command started before whatever handler
was installed before it runs (Prefect's flow engine replaces the command's own handler while a flow
runs, then waits for its task threads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from vpo.pipeline.engine import processes


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child in a session of its own (as stages are), registered as one the command started."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    processes.track(proc)
    yield proc
    processes.untrack(proc)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_a_signal_stops_the_children_before_the_handler_installed_before(sleeper: subprocess.Popen[bytes]) -> None:
    assert threading.current_thread() is threading.main_thread()
    seen: list[tuple[int, bool]] = []

    class Raised(Exception):
        pass

    def framework_handler(signum: int, frame: object) -> None:  # what Prefect's engine does: raise, then wait
        seen.append((signum, sleeper.poll() is not None))
        raise Raised

    before = signal.signal(signal.SIGTERM, framework_handler)
    try:
        with processes.children_stop_first(), pytest.raises(Raised):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here
        assert signal.getsignal(signal.SIGTERM) is framework_handler  # put back as it was
    finally:
        signal.signal(signal.SIGTERM, before)
        processes._STOPPING.clear()
    assert seen == [(signal.SIGTERM, True)]  # the child had been stopped when the framework's handler ran


def test_an_ignored_signal_stays_ignored(sleeper: subprocess.Popen[bytes]) -> None:
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with processes.children_stop_first():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.5)
        assert sleeper.poll() is None and not processes.stopping()
    finally:
        signal.signal(signal.SIGHUP, before)
