"""One sandbox process seen from the parent: its command pipe, its result events and the time it
is charged.

Results are decoded incrementally and in bounded slices: the event pipe is read in chunks, a
line is only looked for in the bytes that arrived since the last look, a line longer than the
cap is a protocol violation before anything is parsed, and a line is parsed only when a cheap
count of its brackets and commas shows at most ``max_value_items`` values (so one ``json.loads``
holds the interpreter lock for milliseconds, not seconds). What the parent then spends on the
event (decoding, judging) is measured in the worker thread's own CPU time and charged to that
candidate, never to a neighbour.

Time: a test's limit is charged in CPU seconds of the sandbox's process tree (its cgroup's
accounting, else its processes' ``/proc`` counters), so a busy machine cannot turn an honest
candidate's pass into a timeout; a wall-clock ceiling bounds sleeping or blocked candidates.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from vpo.sandbox._harness import structure_count
from vpo.sandbox.cgroups import Leaf
from vpo.sandbox.config import SandboxConfig

__all__ = ["DEAD", "LATE", "OVER", "Clock", "ForkServer", "Pool", "Proc", "Violation", "ZygoteDied"]

log = logging.getLogger("vpo.sandbox")

DEAD = "dead"  # the process ended: no more events will come
LATE = "late"  # the wall-clock ceiling passed
OVER = "over"  # the CPU time limit passed
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_DRAIN = 1.0  # most wall-clock seconds spent reading an event that is still arriving at its deadline


class ForkServer(Protocol):
    """What a sandbox process needs of the fork server that started it (``pool._Zygote``)."""

    leaf: Leaf | None
    hello: dict[str, Any]
    sock: socket.socket
    alive: bool
    pending: float | None
    pending_killed: bool

    def read_msg(self, timeout: float) -> dict[str, Any]: ...
    def feed(self) -> None: ...
    def has_msg(self) -> bool: ...
    def start(self, fds: list[int]) -> None: ...
    def kill_current(self) -> None: ...


class Pool(Protocol):
    """What a sandbox process needs of the pool (``pool.Sandbox``): its settings, the event
    size cap, and fork servers to take and give back."""

    config: SandboxConfig
    _event_cap: int

    def _acquire(self) -> ForkServer: ...
    def _release(self, z: ForkServer) -> None: ...
    def _discard(self, z: ForkServer) -> None: ...


class Violation(Exception):
    """The process broke the event protocol (forged, malformed or oversized messages)."""


class ZygoteDied(Exception):
    """A fork server is gone or confused."""


@dataclass
class Clock:
    """The limits of one wait: ``cpu`` seconds of what ``meter`` counts (cumulative, read at
    ``cpu0`` when the test started at wall-clock ``start``) and an absolute wall-clock
    ``deadline``; ``rate`` is the most CPU seconds the measured trees can use per second (their
    CPU quota): the meter is first read when the limit could have been reached, then as often as
    what is left allows, so a test that ends in time costs no reading at all."""

    meter: Callable[[], float]
    cpu0: float
    cpu: float
    deadline: float
    rate: float
    start: float = 0.0
    waited: Callable[[], float] | None = None  # seconds the measured processes waited for a CPU so far
    extended: float = 0.0

    def used(self) -> float:
        return self.meter() - self.cpu0

    def extend(self) -> bool:
        """Move the wall-clock deadline by the time spent waiting for a CPU since the start (a
        busy machine's doing, not the candidate's); True when it moved."""
        if self.waited is None:
            return False
        extra = self.waited()
        if extra <= self.extended + 1e-3:
            return False
        self.deadline += extra - self.extended
        self.extended = extra
        return True


def _tree_cpu(pid: int) -> float | None:
    """CPU seconds of ``pid`` and its descendants (their own and reaped children's) from /proc:
    the fallback where no cgroup accounts for the sandbox."""
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / _CLK_TCK  # utime stime cutime cstime
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
    return total


class Proc:
    """One sandbox process started by a fork server: its event pipe (read), command pipe (write,
    non-blocking), exit status and CPU meter. The payload goes through a sealed memfd the fork
    server passes on without reading."""

    def __init__(self, box: Pool, cfg: dict[str, Any]) -> None:
        self.box = box
        self.cap = box._event_cap
        self.max_items = box.config.max_value_items + 64  # the event's own fields
        self.inbuf = bytearray()
        self.scanned = 0  # bytes of inbuf already searched for a newline
        self.last_size = 0  # bytes of the last event taken
        self.out = bytearray()
        self.eof = False
        self.exit_code: int | None = None
        self.exited = False
        self.ev_fd = self.cmd_fd = -1
        self.done = False
        payload = json.dumps(cfg).encode()
        self.z: ForkServer = box._acquire()
        fds: list[int] = []
        try:
            mfd = os.memfd_create("vpo-payload", os.MFD_CLOEXEC)
            fds.append(mfd)
            view = memoryview(payload)
            while view:
                view = view[os.write(mfd, view):]
            ev_r, ev_w = os.pipe()
            self.ev_fd = ev_r
            fds.append(ev_w)
            cmd_r, cmd_w = os.pipe()
            self.cmd_fd = cmd_w
            fds.append(cmd_r)
            os.set_blocking(cmd_w, False)
            self.cpu_base = self._leaf_cpu() or 0.0
            self.z.start([ev_w, mfd, cmd_r])
            msg = self.z.read_msg(30.0)
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._close_fds()
            box._discard(self.z)
            raise
        for fd in fds:
            os.close(fd)
        if "pid" not in msg:
            self._close_fds()
            box._release(self.z)
            raise ZygoteDied(str(msg.get("error", msg)))
        self.pid: int = msg["pid"]
        self.last_cpu = 0.0
        self.last_delay = 0.0
        self._sched_fd = -1  # /proc/<main pid>/schedstat, kept open while the sandbox runs
        self._oom: bool | None = None

    # -- CPU time
    def _leaf_cpu(self) -> float | None:
        return self.z.leaf.cpu_seconds() if self.z.leaf is not None else None

    def cpu(self) -> float:
        """CPU seconds this sandbox's process tree used so far (the last value once it is gone or
        given up: its fork server's leaf may then serve another sandbox)."""
        if not (self.exited or self.done):
            now = self._leaf_cpu()
            if now is not None:
                self.last_cpu = max(self.last_cpu, now - self.cpu_base)
            else:
                tree = _tree_cpu(self.pid)
                if tree is not None:
                    self.last_cpu = max(self.last_cpu, tree)
        return self.last_cpu

    def main_pid(self) -> int | None:
        """The host pid of the sandbox's main process (the intermediate process's child where
        one sits between the fork server and the sandbox)."""
        if self.z.hello.get("direct"):
            return self.pid
        if getattr(self, "_main", None) is None:
            try:
                with open(f"/proc/{self.pid}/task/{self.pid}/children") as fh:
                    kids = fh.read().split()
                self._main = int(kids[0]) if kids else None
            except (OSError, ValueError):
                self._main = None
        return self._main

    def run_delay(self) -> float:
        """Seconds the sandbox's main process spent waiting for a CPU so far (its last value once
        it is gone)."""
        if not (self.exited or self.done):
            try:
                if self._sched_fd < 0:
                    pid = self.main_pid()
                    if pid is None:
                        return self.last_delay
                    self._sched_fd = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
                self.last_delay = max(self.last_delay, int(os.pread(self._sched_fd, 128, 0).split()[1]) / 1e9)
            except (OSError, ValueError, IndexError):
                pass
        return self.last_delay

    @property
    def rate(self) -> float:
        """Most CPU seconds per second this tree can use: its cgroup quota, else one per task."""
        return self.box.config.cpus if self.z.leaf is not None else float(self.box.config.max_processes + 1)

    def oom_killed(self) -> bool:
        """Whether the memory limit killed something of this sandbox (asked once it died: the
        leaf's OOM kills since the last sandbox that ran there)."""
        if self._oom is None:
            leaf = self.z.leaf
            self._oom = False
            if leaf is not None:
                kills = leaf.oom_kills()
                self._oom, leaf.oom_seen = kills > leaf.oom_seen, max(kills, leaf.oom_seen)
        return self._oom

    # -- pipes
    def _close_fds(self) -> None:
        for fd in (self.ev_fd, self.cmd_fd, getattr(self, "_sched_fd", -1)):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.ev_fd = self.cmd_fd = self._sched_fd = -1

    def send(self, obj: Mapping[str, Any]) -> None:
        if self.cmd_fd < 0:
            return
        self.out += json.dumps(obj).encode() + b"\n"
        self._flush()

    def _flush(self) -> None:
        while self.out and self.cmd_fd >= 0:
            try:
                n = os.write(self.cmd_fd, self.out)
            except BlockingIOError:
                return
            except OSError:  # the process is gone (EPIPE)
                self.out.clear()
                return
            del self.out[:n]

    def _pop(self) -> dict[str, Any] | None:
        nl = self.inbuf.find(b"\n", self.scanned)
        if nl < 0:
            self.scanned = len(self.inbuf)
            if len(self.inbuf) > self.cap:
                raise Violation("oversized message on the result channel")
            return None
        self.scanned = 0
        if nl > self.cap:
            raise Violation("oversized message on the result channel")
        line = bytes(self.inbuf[:nl])
        del self.inbuf[: nl + 1]
        self.last_size = nl
        if structure_count(line) > self.max_items:
            raise Violation(f"result too large to judge (more than {self.max_items - 64} values)")
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError, MemoryError) as exc:
            raise Violation(f"malformed message on the result channel ({type(exc).__name__})") from None
        if type(ev) is not dict or type(ev.get("ev")) is not str:
            raise Violation("malformed message on the result channel")
        return ev

    def _read_available(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the event pipe, the command pipe or the fork server,
        and take what is there."""
        poller = select.poll()
        poller.register(self.ev_fd, select.POLLIN)
        if self.out:
            poller.register(self.cmd_fd, select.POLLOUT)
        if not self.exited:
            poller.register(self.z.sock.fileno(), select.POLLIN)
        for fd, _ev in poller.poll(max(0, int(timeout * 1000) + (1 if timeout > 0 else 0))):
            if fd == self.ev_fd:
                data = os.read(self.ev_fd, 1 << 20)
                if data:
                    self.inbuf += data
                else:
                    self.eof = True
            elif fd == self.cmd_fd:
                self._flush()
            else:
                self._read_zygote()

    def next_event(self, clock: Clock) -> dict[str, Any] | str:
        """The next event, or ``DEAD`` (no more events will come), ``LATE`` (past the wall-clock
        deadline) or ``OVER`` (past the CPU limit). What already arrived is always taken before
        a limit is declared passed."""
        exit_seen_at: float | None = None
        next_cpu_check = clock.start + clock.cpu / max(clock.rate, 1e-3)
        while True:
            ev = self._pop()
            if ev is not None:
                return ev
            if self.eof:
                return DEAD
            now = time.monotonic()
            if self.exited:
                exit_seen_at = exit_seen_at or now
                if now - exit_seen_at > 2.0:  # gone; something it spawned still holds the pipe
                    return DEAD
            over = None
            if now >= clock.deadline and not clock.extend():
                over = LATE
            elif now >= next_cpu_check:
                left = clock.cpu - clock.used()
                if left <= 0:
                    over = OVER
                else:  # the trees cannot use more than `rate` CPU seconds per second
                    next_cpu_check = now + max(0.005, left / max(clock.rate, 1e-3))
            if over is not None:
                self._read_available(0)  # a result that arrived while this thread waited counts
                ev = self._pop()
                if ev is None and over == LATE and self.inbuf:
                    ev = self._drain()
                return ev if ev is not None else over
            wait = min(clock.deadline, next_cpu_check) - now
            self._read_available(min(max(wait, 0.001), 0.25 if self.exited else 3600.0))

    def _drain(self) -> dict[str, Any] | None:
        """At the wall-clock ceiling, with part of an event already here: the sandbox finished and
        is writing (its alarms are off by then), and what kept it waiting was this reader. Read on
        while bytes keep coming, for at most ``_DRAIN`` seconds; the event, or None."""
        end = time.monotonic() + _DRAIN
        while time.monotonic() < end and not self.eof:
            size = len(self.inbuf)
            self._read_available(min(0.05, max(end - time.monotonic(), 0.0)))
            ev = self._pop()
            if ev is not None:
                return ev
            if len(self.inbuf) == size:  # nothing more came: not a result being written
                return None
        return None

    def _read_zygote(self) -> None:
        try:
            self.z.feed()
            if not self.z.has_msg():
                return
            msg = self.z.read_msg(0.1)
            if "exit" not in msg:
                raise ZygoteDied(f"unexpected fork server message {msg!r}")
            code = msg.get("exit")
            self.exit_code = code if type(code) is int else None
        except ZygoteDied as exc:  # the fork server itself is gone or confused: never reused
            log.warning("vpo.sandbox: fork server failed (%s); replacing it", exc)
            self.z.alive = False
            self.exit_code = None
        self.cpu()  # the last readings, before the leaf serves another sandbox
        self.run_delay()
        self.exited = True

    def kill(self) -> None:
        if not self.exited:
            self.z.kill_current()

    def finish(self, kill: bool, discard: bool = False, wait: bool = False) -> ForkServer | None:
        """End the process (EOF on its command pipe, or SIGKILL). Without ``wait`` the fork server
        goes back to the pool while the sandbox is still ending, marked ``pending`` with a short
        grace: it serves again only after its exit status arrived (:meth:`_Zygote.settle`), and
        the caller's batch settles it before returning; the fork server is returned for that.
        With ``wait`` (or ``discard``), the exit status is awaited here; the fork server is reused
        only when its state is known (and the caller did not ask to ``discard`` it, after an
        unexpected failure)."""
        if self.done:
            return None
        self.cpu()
        self.run_delay()
        self.done = True
        if self.cmd_fd >= 0:
            os.close(self.cmd_fd)
            self.cmd_fd = -1
        if kill:
            self.kill()
        if not (wait or discard or self.exited):
            self._close_fds()
            self.z.pending = time.monotonic() + (15.0 if kill else self.box.config.grace)
            self.z.pending_killed = kill
            self.box._release(self.z)
            return self.z
        clean = False
        try:
            end = time.monotonic() + (15.0 if kill else self.box.config.grace)
            while not self.exited:
                left = end - time.monotonic()
                if left <= 0:
                    if not kill:
                        kill = True
                        self.kill()
                        end = time.monotonic() + 15.0
                        continue
                    raise ZygoteDied("sandbox did not terminate after SIGKILL")
                r, _, _ = select.select([self.z.sock], [], [], left)
                if r:
                    self._read_zygote()
            clean = self.z.alive and not self.z.has_msg() and not discard
        except Exception as exc:  # noqa: BLE001 - whatever happened, this fork server is not reused
            log.warning("vpo.sandbox: fork server in an unknown state (%s); replacing it", exc)
        finally:
            self._close_fds()
            if clean:
                self.box._release(self.z)
            else:
                self.box._discard(self.z)
        return None

    def how(self) -> str:
        code = self.exit_code
        if self.oom_killed():
            return "killed at the memory limit"
        if isinstance(code, int) and code < 0:
            return f"signal {-code}"
        if isinstance(code, int) and code > 128:
            return f"signal {code - 128}"
        return f"exit status {code}" if code is not None else "no exit status"
