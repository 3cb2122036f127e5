"""Which processes a command started, and whether any outlives it (tests only).

:class:`Descendants` polls the descendants of one process this test started (psutil's
``children(recursive=True)``) in a thread, so it also sees processes that left their parent's session
or process group (stage groups, Prefect servers); each is remembered by pid *and* start time, so a
reused pid never counts. Nothing here looks at processes outside that tree.
"""

from __future__ import annotations

import threading
import time
from typing import Self

import psutil

__all__ = ["Descendants"]


class Descendants:
    """Records every descendant of ``pid`` while the block runs (poll every ``interval_s``)."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.seen: dict[tuple[int, float], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"watch-{pid}", daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.snapshot()
            self._stop.wait(self.interval_s)

    def snapshot(self) -> None:
        """Record the descendants alive now."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            try:
                key = (child.pid, child.create_time())
                if key not in self.seen:
                    self.seen[key] = " ".join(child.cmdline())[:200]
            except psutil.Error:
                continue

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def alive(self, wait_s: float = 10.0) -> list[str]:
        """The recorded descendants still running (zombies count as gone), after waiting up to
        ``wait_s`` for them to go."""
        deadline = time.monotonic() + wait_s
        while True:
            left = []
            for (pid, started), cmd in self.seen.items():
                try:
                    proc = psutil.Process(pid)
                    if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                        left.append(f"{pid}: {cmd}")
                except psutil.Error:
                    continue
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def matching(self, text: str) -> list[str]:
        """Command lines of recorded descendants that contain ``text``."""
        return [cmd for cmd in self.seen.values() if text in cmd]
