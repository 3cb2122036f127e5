"""Parent side of the sandbox: test cases, results, the zygote pool and the judging loop.

A :class:`Sandbox` owns a pool of fork-server ("zygote") processes. Each sandbox process is
started by a free zygote (see :mod:`vpo.sandbox._harness` for the isolation steps) and then
served request by request: the worker thread sends one test, waits for its one result event
under the test's wall-clock deadline, and judges the output here, in the parent. A test that
hangs or crashes the sandbox costs only that test: the remaining tests run in a new sandbox
while the candidate's time budget lasts. Tests that are a dataset's own code (``check`` steps,
e.g. HumanEval loops) run in a second sandbox, the judge, which calls the candidate through this
process with plain values only.

Whatever a candidate prints, returns or writes becomes that candidate's ERROR/FAIL: the parent
reads a bounded amount per event, decodes with bounded depth and hash-collision checks, and
judges with total functions; a zygote whose state is not known to be clean is killed, never
reused. Only a configuration problem (isolation required but unavailable, a path that must be
hidden but cannot be) raises :class:`SandboxError` out of :meth:`Sandbox.run`.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import queue
import secrets
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Self

from vpo.sandbox import _harness
from vpo.sandbox._harness import CodecError, decode_value, encode_value
from vpo.sandbox.compare import (
    CMP_KINDS,
    DEFAULT_ABS_TOL,
    DEFAULT_REL_TOL,
    judge_value,
    render_value,
    stdout_matches,
)

__all__ = [
    "DEFAULT_PRELUDE",
    "CandidateResult",
    "Job",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "Status",
    "TestCase",
    "TestResult",
    "default_hide_paths",
    "private_view_available",
]

log = logging.getLogger("vpo.sandbox")

HARNESS = Path(_harness.__file__).resolve()

# Names competitive-programming solutions use without importing them (as LiveCodeBench's harness
# provides); the last line undoes the shadowing of builtins such as ``pow`` by ``from math import *``.
DEFAULT_PRELUDE = """\
from typing import *
import sys, os, math, re, string, random, heapq, bisect, itertools, functools, operator, collections
from collections import *
from heapq import *
from bisect import *
from itertools import *
from functools import *
from math import *
from builtins import *
"""

# Directories that cannot be hidden (hiding them would break the interpreter or is meaningless).
_SYSTEM_DIRS = {"/", "/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc", "/proc", "/sys",
                "/dev", "/var", "/boot", "/tmp", "/dev/shm"}
_DEFAULT_HIDE = ("/root", "/home", "/var/tmp", "/run", "/mnt", "/media", "/srv", "/opt")
_EVENT_SLACK = 1 << 16


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, required isolation is unavailable, or a path
    that must be hidden cannot be)."""


class Status(str, enum.Enum):
    """Outcome of one test: only PASS earns reward."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    TIMEOUT = "timeout"


_KINDS = ("stdio", "call", "expr", "check")


@dataclass(frozen=True)
class TestCase:
    """One test. ``kind`` is ``stdio`` (feed ``input`` on stdin, compare stdout with
    ``expected``), ``call`` (call the entry point with ``args``, compare the return value),
    ``expr`` (evaluate ``expr`` in the solution's namespace, compare the value) or ``check``
    (step ``step`` of the job's ``check_code``: a dataset's own test statement, run in the judge
    sandbox; ``text`` is its source, for display).

    ``cmp`` says how a call/expr value is judged (see :func:`vpo.sandbox.compare.judge_value`):
    ``eq`` (default; the job's equality, exact or tolerant), ``ne``, ``is`` / ``is_not`` (True,
    False or None), ``truthy`` / ``falsy``, ``abs_lt`` / ``abs_le`` (``abs(value - expected) <
    tol``). ``alternatives`` are further accepted expected values (APPS-style wrapped outputs);
    ``tol`` overrides the float tolerance of a tolerant ``eq``."""

    __test__ = False  # not a pytest class

    kind: str
    input: str = ""
    args: tuple[Any, ...] = ()
    expr: str = ""
    expected: Any = None
    alternatives: tuple[Any, ...] = ()
    tol: float | None = None
    cmp: str = "eq"
    step: int = 0
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown test kind {self.kind!r}; expected one of {', '.join(_KINDS)}")
        if self.kind == "stdio" and not isinstance(self.expected, str):
            raise ValueError("a stdio test needs the expected stdout as a string")
        if self.kind == "expr" and not self.expr.strip():
            raise ValueError("an expr test needs an expression")
        if self.cmp not in CMP_KINDS:
            raise ValueError(f"unknown cmp {self.cmp!r}; expected one of {', '.join(CMP_KINDS)}")
        if self.cmp in ("is", "is_not") and self.expected not in (True, False, None):
            raise ValueError("an 'is' test compares with True, False or None only")
        if self.cmp in ("abs_lt", "abs_le") and self.tol is None:
            raise ValueError(f"a {self.cmp} test needs tol")
        if self.kind == "check" and (type(self.step) is not int or self.step < 0):
            raise ValueError("a check test needs a step index >= 0")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "alternatives", tuple(self.alternatives))

    @classmethod
    def stdio(cls, input: str, output: str) -> TestCase:
        return cls(kind="stdio", input=input, expected=output)

    @classmethod
    def call(cls, args: Sequence[Any], expected: Any, alternatives: Sequence[Any] = (), cmp: str = "eq",
             tol: float | None = None) -> TestCase:
        return cls(kind="call", args=tuple(args), expected=expected, alternatives=tuple(alternatives), cmp=cmp, tol=tol)

    @classmethod
    def expression(cls, expr: str, expected: Any, cmp: str = "eq") -> TestCase:
        return cls(kind="expr", expr=expr, expected=expected, cmp=cmp)

    @classmethod
    def check(cls, step: int, text: str = "") -> TestCase:
        return cls(kind="check", step=step, text=text)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TestCase:
        """Build from the dataset schema (docs/code_task.md): ``{"type": "stdio", "input",
        "output"}``, ``{"type": "call", "args", "expected"[, "cmp", "tol", "alternatives"]}``,
        ``{"type": "expr", "expr", "expected", ...}`` or ``{"type": "check", "step", "text"}``;
        values may use the codec's tags (``{"$t": [...]}`` for a tuple...)."""
        kind = d.get("type", d.get("kind"))
        if kind == "stdio":
            return cls.stdio(str(d.get("input", "")), str(d["output"] if "output" in d else d["expected"]))
        if kind == "check":
            step = d.get("step")
            if type(step) is not int:
                raise ValueError(f"a check test needs an integer step, got {step!r}")
            return cls.check(step, str(d.get("text", "")))
        alts = tuple(decode_value(a) for a in d.get("alternatives", ()))
        tol = d.get("tol")
        if tol is not None and (not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol >= 0):
            raise ValueError(f"tol must be a non-negative number, got {tol!r}")
        tol = None if tol is None else float(tol)
        cmp = str(d.get("cmp", "eq"))
        if kind == "call":
            args = decode_value(d.get("args", []))
            if not isinstance(args, (list, tuple)):
                raise ValueError("a call test's args must be a list")
            return cls(kind="call", args=tuple(args), expected=decode_value(d.get("expected")), alternatives=alts,
                       tol=tol, cmp=cmp)
        if kind == "expr":
            return cls(kind="expr", expr=str(d["expr"]), expected=decode_value(d.get("expected")), alternatives=alts,
                       tol=tol, cmp=cmp)
        raise ValueError(f"unknown test type {kind!r}")

    def to_dict(self) -> dict[str, Any]:
        """The dataset-schema form (JSON-serialisable)."""
        if self.kind == "stdio":
            return {"type": "stdio", "input": self.input, "output": self.expected}
        if self.kind == "check":
            return {"type": "check", "step": self.step, "text": self.text}
        out: dict[str, Any] = {"type": self.kind}
        if self.kind == "call":
            out["args"] = encode_value(list(self.args))
        else:
            out["expr"] = self.expr
        out["expected"] = encode_value(self.expected)
        if self.alternatives:
            out["alternatives"] = [encode_value(a) for a in self.alternatives]
        if self.tol is not None:
            out["tol"] = self.tol
        if self.cmp != "eq":
            out["cmp"] = self.cmp
        return out

    def size(self) -> int:
        """Serialised size, used to keep the smallest tests of a problem."""
        return len(json.dumps(self.to_dict()))


@dataclass(frozen=True)
class TestResult:
    """Verdict of one test; ``output`` is a truncated rendering of what the candidate produced."""

    __test__ = False

    status: Status
    runtime: float = 0.0
    detail: str = ""
    output: str = ""

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS


@dataclass(frozen=True)
class CandidateResult:
    """All test verdicts of one candidate, in test order."""

    tests: tuple[TestResult, ...]
    protections: Mapping[str, Any] = field(default_factory=dict)
    rounds: int = 0
    wall: float = 0.0

    @property
    def passed(self) -> list[bool]:
        return [t.passed for t in self.tests]

    @property
    def n_passed(self) -> int:
        return sum(self.passed)

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and all(self.passed)


@dataclass(frozen=True)
class Job:
    """One candidate program, the tests to run it against and how to judge them.

    ``prelude`` (None: the sandbox config's) runs before the program in its namespace;
    ``equality`` is how ``eq`` tests compare (``exact``: Python ``==``; ``tolerant``: floats
    within tolerance, tuple == list); ``problem_timeout`` is a wall-clock budget shared by all
    tests of the candidate (as a dataset with one time limit per problem judges), on top of the
    per-test limit; ``check_code`` is the judge program of ``check`` tests."""

    code: str
    tests: tuple[TestCase, ...]
    entry_point: str | None = None
    prelude: str | None = None
    equality: Literal["tolerant", "exact"] = "tolerant"
    problem_timeout: float | None = None
    check_code: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tests", tuple(self.tests))
        kinds = {t.kind for t in self.tests}
        if kinds & {"call", "check"} and not self.entry_point:
            raise ValueError("call and check tests need an entry_point")
        if "check" in kinds and not self.check_code.strip():
            raise ValueError("check tests need the job's check_code")
        if self.equality not in ("tolerant", "exact"):
            raise ValueError(f"equality must be tolerant or exact, got {self.equality!r}")
        if self.problem_timeout is not None and not self.problem_timeout > 0:
            raise ValueError(f"problem_timeout must be positive, got {self.problem_timeout!r}")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation settings. Times are wall-clock seconds per test / per candidate."""

    test_timeout: float = 3.0
    load_timeout: float = 5.0  # compiling the program and running its module body (call tests)
    grace: float = 0.5  # parent-side slack after a deadline before the sandbox is killed
    total_timeout: float | None = None  # per candidate, all restarts included; default from the tests
    memory_mb: int = 1024  # RLIMIT_AS
    stack_mb: int = 64
    max_processes: int = 4  # RLIMIT_NPROC: processes + threads, the main one included
    max_open_files: int = 64
    max_output_bytes: int = 4 << 20  # per test, stdout; also caps file writes and one result message
    tmp_mb: int = 64  # private /tmp (work dir) and /dev/shm, each
    workers: int | None = None  # parallel sandboxes; default: usable cores
    python: str | None = None  # interpreter; default: the running one
    site_packages: bool = False  # let candidates import from site-packages (slower start)
    namespaces: str = "auto"  # auto | require | off
    hide_paths: tuple[str, ...] = ()  # must be hidden (dataset files): an error names any that cannot be
    hide_defaults: bool = True  # also hide the cwd and this checkout where they are inside the view
    seccomp: bool = True  # system-call filter (see vpo.sandbox._harness.SECCOMP_DENY)
    uid_base: int = 1_900_000_000  # sandboxes run as uid_base + random (when started as root)
    max_rounds: int | None = None  # sandbox processes per candidate (restarts after a crash)
    rel_tol: float = DEFAULT_REL_TOL
    abs_tol: float = DEFAULT_ABS_TOL
    prelude: str = DEFAULT_PRELUDE

    def __post_init__(self) -> None:
        if self.namespaces not in ("auto", "require", "off"):
            raise ValueError(f"namespaces must be auto, require or off, got {self.namespaces!r}")
        if self.test_timeout <= 0 or self.load_timeout <= 0:
            raise ValueError("timeouts must be positive")
        object.__setattr__(self, "hide_paths", tuple(self.hide_paths))


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _unhideable(path: str) -> str | None:
    """Why ``path`` (resolved) cannot be hidden, or None."""
    system = _SYSTEM_DIRS | {os.path.realpath(d) for d in _SYSTEM_DIRS}
    if path in system:
        return "it is a system directory"
    if any(_harness._under(s, path) for s in system if s != "/"):
        return "it contains a system directory"
    return None


def default_hide_paths(extra: Iterable[str] = (), defaults: bool = True) -> list[str]:
    """Paths hidden inside the sandbox where they are part of its filesystem view: with
    ``defaults``, home directories, /root, /run, /opt..., the current directory and this
    project's checkout (skipped silently where they are system directories), plus ``extra``,
    which must be hideable: a system directory or an ancestor of one raises ValueError naming
    it. Nested paths are reduced to the outermost."""
    paths: set[str] = set()
    if defaults:
        cands = [*_DEFAULT_HIDE, os.getcwd()]
        root = Path(__file__).resolve().parents[2]
        if (root / "pyproject.toml").exists():
            cands.append(str(root))
        for p in cands:
            rp = os.path.realpath(p)
            if os.path.lexists(rp) and _unhideable(rp) is None:
                paths.add(rp)
    for p in extra:
        if not p:
            continue
        rp = os.path.realpath(p)
        why = _unhideable(rp)
        if why is not None:
            raise ValueError(f"cannot hide {p}: {why}")
        if os.path.lexists(rp):
            paths.add(rp)
    return _harness._top_level(paths)


# ----------------------------------------------------------------------------------------------
# zygote


class _ZygoteDied(Exception):
    pass


class _Zygote:
    """One fork-server process and its control socket."""

    def __init__(self, argv: list[str], namespaces: str = "auto") -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        try:
            self.proc = subprocess.Popen(
                [*argv, "zygote", str(child.fileno()), "off" if namespaces == "off" else "auto"],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                cwd="/",
                start_new_session=True,
            )
        finally:
            child.close()
        self.sock = parent
        self.buf = bytearray()
        self.alive = False
        self.pending: float | None = None  # while its last sandbox is ending: when it must have ended by
        self.pending_killed = False
        try:
            self.hello = self.read_msg(30.0)
        except _ZygoteDied as exc:
            self.close(kill=True)
            raise SandboxError(f"sandbox fork server did not start ({' '.join(argv)}): {exc}") from exc
        self.alive = True

    def read_msg(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                raise _ZygoteDied("no reply from the fork server")
            r, _, _ = select.select([self.sock], [], [], left)
            if r:
                self.feed()
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        try:
            msg = json.loads(line)
        except ValueError as exc:
            raise _ZygoteDied(f"garbled fork server message: {exc}") from exc
        if not isinstance(msg, dict):
            raise _ZygoteDied("garbled fork server message")
        return msg

    def has_msg(self) -> bool:
        return b"\n" in self.buf

    def settle(self, block: bool) -> bool:
        """Consume the exit report of the sandbox that was ending (``pending``); SIGKILL it at
        the deadline. True when this fork server is idle and clean, False when it is still busy
        (``block`` False) or must be replaced."""
        try:
            while self.pending is not None:
                if self.has_msg():
                    msg = self.read_msg(0.1)
                    if "exit" not in msg:
                        return False
                    self.pending = None
                    break
                left = self.pending - time.monotonic()
                if left <= 0:
                    if self.pending_killed:
                        return False
                    self.kill_current()
                    self.pending, self.pending_killed = time.monotonic() + 15.0, True
                    continue
                r, _, _ = select.select([self.sock], [], [], left if block else 0)
                if r:
                    self.feed()
                elif not block:
                    return False
        except _ZygoteDied:
            return False
        return self.alive and not self.has_msg()

    def feed(self) -> None:
        """Read what is available on the socket (after poll said readable)."""
        try:
            data = self.sock.recv(65536)
        except OSError as exc:
            raise _ZygoteDied(str(exc)) from exc
        if not data:
            raise _ZygoteDied("fork server closed its socket")
        self.buf += data

    def start(self, fds: list[int]) -> None:
        try:
            socket.send_fds(self.sock, [_harness.HEADER.pack(_harness.OP_RUN, 0)], fds)
        except OSError as exc:
            raise _ZygoteDied(str(exc)) from exc

    def kill_current(self) -> None:
        try:
            self.sock.sendall(struct.pack("<4sQ", _harness.OP_KILL, 0))
        except OSError:
            pass

    def close(self, kill: bool = False) -> None:
        self.alive = False
        if kill:
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ----------------------------------------------------------------------------------------------
# protections


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(msg: str, level: int = logging.WARNING) -> None:
    with _warn_lock:
        if msg in _warned:
            return
        _warned.add(msg)
    log.log(level, msg)


def _report_protections(prot: Mapping[str, Any]) -> None:
    """Say clearly, once per process, which protections are missing."""
    mode = prot.get("mode")
    if mode == "none":
        _warn_once(
            "vpo.sandbox: Linux namespaces unavailable; candidates run WITHOUT network isolation, "
            "pid namespace or private filesystem view (rlimits, seccomp, session kill and the subreaper "
            f"still apply). Reasons: {'; '.join(prot.get('warnings', [])) or 'disabled by config'}"
        )
    if not prot.get("nproc_enforced"):
        _warn_once("vpo.sandbox: process-count limit not enforceable (same uid, no user namespace); "
                   "fork bombs are only bounded by the zygote's cleanup")
    for w in prot.get("warnings", []):
        if mode != "none":
            _warn_once(f"vpo.sandbox: {w}")
    if mode in ("root", "userns"):
        _warn_once(
            f"vpo.sandbox: isolation mode {mode}: pid+net+mount+ipc+uts namespaces, uid "
            f"{'random unprivileged' if mode == 'root' else prot.get('uid')}, minimal read-only nodev view of "
            f"{len(prot.get('exposed', []))} dirs, seccomp={prot.get('seccomp')}, keyring={prot.get('keyring')}",
            logging.INFO,
        )


def _close_all(zygotes: list[_Zygote]) -> None:
    for z in list(zygotes):
        z.close(kill=True)
    zygotes.clear()


# ----------------------------------------------------------------------------------------------
# one sandbox process


class _Violation(Exception):
    """The process broke the event protocol (forged, malformed or oversized messages)."""


_DEAD = "dead"
_LATE = "late"


class _Proc:
    """One sandbox process started by a zygote: its event pipe (read), command pipe (write,
    non-blocking) and exit status. The payload goes through a sealed memfd the zygote passes on
    without reading."""

    def __init__(self, box: Sandbox, cfg: dict[str, Any]) -> None:
        self.box = box
        self.cap = box._event_cap
        self.inbuf = bytearray()
        self.out = bytearray()
        self.eof = False
        self.exit_code: int | None = None
        self.exited = False
        self.ev_fd = self.cmd_fd = -1
        payload = json.dumps(cfg).encode()
        self.z = box._acquire()
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
            raise _ZygoteDied(str(msg.get("error", msg)))
        self.pid = msg["pid"]
        self.done = False

    def _close_fds(self) -> None:
        for fd in (self.ev_fd, self.cmd_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.ev_fd = self.cmd_fd = -1

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
        nl = self.inbuf.find(b"\n")
        if nl < 0:
            if len(self.inbuf) > self.cap:
                raise _Violation("oversized message on the result channel")
            return None
        if nl > self.cap:
            raise _Violation("oversized message on the result channel")
        line = bytes(self.inbuf[:nl])
        del self.inbuf[: nl + 1]
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError, MemoryError) as exc:
            raise _Violation(f"malformed message on the result channel ({type(exc).__name__})") from None
        if type(ev) is not dict or type(ev.get("ev")) is not str:
            raise _Violation("malformed message on the result channel")
        return ev

    def next_event(self, deadline: float) -> dict[str, Any] | str:
        """The next event, or ``_DEAD`` (no more events will come), or ``_LATE`` (deadline)."""
        exit_seen_at: float | None = None
        while True:
            ev = self._pop()
            if ev is not None:
                return ev
            if self.eof:
                return _DEAD
            now = time.monotonic()
            if self.exited:
                exit_seen_at = exit_seen_at or now
                if now - exit_seen_at > 2.0:  # gone; something it spawned still holds the pipe
                    return _DEAD
            if now >= deadline:
                return _LATE
            poller = select.poll()
            poller.register(self.ev_fd, select.POLLIN)
            if self.out:
                poller.register(self.cmd_fd, select.POLLOUT)
            if not self.exited:
                poller.register(self.z.sock.fileno(), select.POLLIN)
            wait = min(deadline - now, 0.25 if self.exited else 3600.0)
            for fd, _ev in poller.poll(max(1, int(wait * 1000) + 1)):
                if fd == self.ev_fd:
                    data = os.read(self.ev_fd, 1 << 16)
                    if data:
                        self.inbuf += data
                    else:
                        self.eof = True
                elif fd == self.cmd_fd:
                    self._flush()
                else:
                    self._read_zygote()

    def _read_zygote(self) -> None:
        try:
            self.z.feed()
            if not self.z.has_msg():
                return
            msg = self.z.read_msg(0.1)
            if "exit" not in msg:
                raise _ZygoteDied(f"unexpected fork server message {msg!r}")
            code = msg.get("exit")
            self.exit_code = code if type(code) is int else None
        except _ZygoteDied as exc:  # the fork server itself is gone or confused: never reused
            log.warning("vpo.sandbox: fork server failed (%s); replacing it", exc)
            self.z.alive = False
            self.exit_code = None
        self.exited = True

    def kill(self) -> None:
        if not self.exited:
            self.z.kill_current()

    def finish(self, kill: bool, discard: bool = False, wait: bool = False) -> None:
        """End the process (EOF on its command pipe, or SIGKILL). Without ``wait`` the zygote goes
        back to the pool while the sandbox is still ending, marked ``pending``: it serves again
        only after its exit status arrived (:meth:`_Zygote.settle`), so the teardown overlaps
        other work. With ``wait`` (or ``discard``), the exit status is awaited here; the zygote
        is reused only when its state is known (and the caller did not ask to ``discard`` it,
        after an unexpected failure)."""
        if self.done:
            return
        self.done = True
        if self.cmd_fd >= 0:
            os.close(self.cmd_fd)
            self.cmd_fd = -1
        if kill:
            self.kill()
        if not (wait or discard or self.exited):
            self._close_fds()
            self.z.pending = time.monotonic() + (15.0 if kill else 5.0)
            self.z.pending_killed = kill
            self.box._release(self.z)
            return
        clean = False
        try:
            end = time.monotonic() + (15.0 if kill else 5.0)
            while not self.exited:
                left = end - time.monotonic()
                if left <= 0:
                    if not kill:
                        kill = True
                        self.kill()
                        end = time.monotonic() + 15.0
                        continue
                    raise _ZygoteDied("sandbox did not terminate after SIGKILL")
                r, _, _ = select.select([self.z.sock], [], [], left)
                if r:
                    self._read_zygote()
            clean = self.z.alive and not self.z.has_msg() and not discard
        except Exception as exc:  # noqa: BLE001 - whatever happened, this zygote is not reused
            log.warning("vpo.sandbox: fork server in an unknown state (%s); replacing it", exc)
        finally:
            self._close_fds()
            if clean:
                self.box._release(self.z)
            else:
                self.box._discard(self.z)

    def how(self) -> str:
        code = self.exit_code
        if isinstance(code, int) and code < 0:
            return f"signal {-code}"
        if isinstance(code, int) and code > 128:
            return f"signal {code - 128}"
        return f"exit status {code}" if code is not None else "no exit status"


# ----------------------------------------------------------------------------------------------
# one candidate


class _Stop(Exception):
    """Ends a job: every test without a verdict gets ``status`` / ``detail``."""

    def __init__(self, status: Status, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _JobRun:
    """Runs the tests of one job in order: candidate tests in the candidate sandbox, ``check``
    steps in the judge sandbox (which calls the candidate through here)."""

    def __init__(self, box: Sandbox, job: Job) -> None:
        self.box = box
        self.job = job
        self.cfg = box.config
        n = len(job.tests)
        self.results: list[TestResult | None] = [None] * n
        self.t0 = time.monotonic()
        self.hard_deadline = self.t0 + box._budget(job)
        self.budget_left = job.problem_timeout
        self.rounds = 0
        self.max_rounds = self.cfg.max_rounds or n + 1
        self.c: _Proc | None = None
        self.c_judged: list[int] = []
        self.j: _Proc | None = None
        self.j_loaded = False
        self.j_broken: tuple[Status, str] | None = None
        self.call_seq = 0
        self.prot: dict[str, Any] = {}
        self.needs_module = any(t.kind != "stdio" for t in job.tests)
        self.fsize = max([len(t.input.encode("utf-8", "surrogateescape")) for t in job.tests if t.kind == "stdio"] + [0])

    # -- results
    def result(self) -> CandidateResult:
        final = tuple(r if r is not None else TestResult(Status.ERROR, 0.0, "not run") for r in self.results)
        return CandidateResult(tests=final, protections=self.prot, rounds=self.rounds, wall=time.monotonic() - self.t0)

    def fill(self, status: Status, detail: str) -> None:
        for i, r in enumerate(self.results):
            if r is None:
                self.results[i] = TestResult(status, 0.0, detail)

    def close(self, kill: bool = False, discard: bool = False) -> None:
        for proc in (self.c, self.j):
            if proc is not None:
                proc.finish(kill=kill, discard=discard)
        self.c = self.j = None

    # -- driver
    def run(self) -> CandidateResult:
        ok = False
        try:
            if any(t.kind == "check" for t in self.job.tests):
                self._start_judge()
            for i, test in enumerate(self.job.tests):
                if time.monotonic() >= self.hard_deadline:
                    raise _Stop(Status.TIMEOUT, "not run: candidate time budget exhausted")
                if self.budget_left is not None and self.budget_left <= 0:
                    raise _Stop(Status.TIMEOUT, "not run: the problem's time budget is exhausted")
                t_start = time.monotonic()
                if test.kind == "check":
                    self.results[i] = self._check_step(i, test)
                else:
                    self.results[i] = self._test(i, test)
                if self.budget_left is not None:
                    self.budget_left -= time.monotonic() - t_start
            ok = True
        except _Stop as stop:
            self.fill(stop.status, stop.detail)
            ok = True
        finally:  # after an unexpected failure the fork servers' state is unknown: never reused
            self.close(kill=not ok, discard=not ok)
        return self.result()

    def _limit(self) -> float:
        limit = self.cfg.test_timeout
        if self.budget_left is not None:
            limit = min(limit, max(self.budget_left, 0.01))
        return limit

    def _deadline(self, start: float, limit: float) -> float:
        return min(start + limit + self.cfg.grace, self.hard_deadline)

    def _payload(self, role: str) -> dict[str, Any]:
        c, job = self.cfg, self.job
        n = max(1, len(job.tests))
        code = job.check_code if role == "judge" else job.code
        prelude = "" if role == "judge" else (c.prelude if job.prelude is None else job.prelude)
        return {
            "role": role,
            "code": code,
            "prelude": prelude,
            "needs_module": self.needs_module,
            "namespaces": "off" if c.namespaces == "off" else "auto",
            "require": c.namespaces == "require",
            "hide": self.box._hide_defaults,
            "hide_required": self.box._hide_required,
            "site_packages": c.site_packages,
            "seccomp": c.seccomp,
            "tmp_mb": c.tmp_mb,
            "uid": c.uid_base + secrets.randbelow(1 << 20),
            "memory_mb": c.memory_mb,
            "stack_mb": c.stack_mb,
            "cpu_seconds": math.ceil(c.load_timeout + n * c.test_timeout) + 1,
            "fsize": max(c.max_output_bytes, self.fsize, 1 << 20) + 1,
            "max_open_files": c.max_open_files,
            "max_processes": c.max_processes,
            "test_timeout": c.test_timeout,
            "load_timeout": c.load_timeout,
            "max_output_bytes": c.max_output_bytes,
        }

    def _spawn(self, role: str) -> _Proc:
        """Start a sandbox process; one retry with a fresh zygote when the fork server fails."""
        for attempt in range(2):
            try:
                return _Proc(self.box, self._payload(role))
            except _ZygoteDied as exc:
                log.warning("vpo.sandbox: fork server failed (%s); starting a new one", exc)
                if attempt == 1:
                    raise _Stop(Status.ERROR, f"sandbox fork server failed: {exc}") from None
        raise AssertionError("unreachable")

    def _await_start(self, proc: _Proc, role: str) -> str | None:
        """Wait for ready + loaded. Returns None when loaded, else why not (load error...);
        raises SandboxError for configuration problems."""
        ev = proc.next_event(min(time.monotonic() + 30.0 + self.cfg.load_timeout, self.hard_deadline + 30.0))
        if isinstance(ev, str):
            how = "timed out" if ev == _LATE else f"ended ({proc.how()})"
            log.warning("vpo.sandbox: a %s sandbox %s before it was ready", role, how)
            return f"sandbox process {how} before it was ready"
        if ev["ev"] == "fatal":
            msg = _text(ev.get("msg"), 2000) or "sandbox setup failed"
            if isinstance(ev.get("prot"), dict):
                self.prot = ev["prot"]
            if ev.get("config") is True or "required isolation" in msg or "drop root" in msg:
                raise SandboxError(msg)
            return f"sandbox failure: {msg}"
        if ev["ev"] != "ready":
            raise _Violation(f"unexpected {ev['ev']!r} event")
        prot = ev.get("prot")
        if role == "candidate" and isinstance(prot, dict):
            self.prot = prot
            self.box.last_protections = prot
            _report_protections(prot)
        ready_at = time.monotonic()
        ev = proc.next_event(min(ready_at + self.cfg.load_timeout + self.cfg.grace, self.hard_deadline))
        if ev == _LATE:
            proc.kill()
            return "timeout: timed out while loading"
        if ev == _DEAD:
            return f"sandbox process died while loading ({proc.how()})"
        assert isinstance(ev, dict)
        if ev["ev"] == "load_error":
            return f"load error: {_text(ev.get('msg'))}"  # the candidate's module may have written it
        if ev["ev"] != "loaded":
            raise _Violation(f"unexpected {ev['ev']!r} event")
        return None

    # -- the candidate's sandbox
    def _candidate(self) -> _Proc:
        if self.c is not None:
            return self.c
        if self.rounds >= self.max_rounds:
            raise _Stop(Status.TIMEOUT, "not run: too many sandbox restarts")
        self.rounds += 1
        proc = self._spawn("candidate")
        self.c, self.c_judged = proc, []
        try:
            why = self._await_start(proc, "candidate")
        except _Violation as exc:
            self._void(str(exc))
        if why is not None:
            self._drop_candidate(kill=True)
            status = Status.TIMEOUT if why.startswith("timeout:") else Status.ERROR
            raise _Stop(status, why.removeprefix("timeout: "))
        return proc

    def _drop_candidate(self, kill: bool, wait: bool = False) -> str:
        proc, self.c = self.c, None
        self.c_judged = []
        if proc is None:
            return ""
        proc.finish(kill=kill, wait=wait)
        return proc.how()

    def _void(self, reason: str) -> None:
        """The candidate's stream broke the protocol: nothing from that process counts."""
        detail = f"protocol violation: {reason}"
        for i in self.c_judged:
            self.results[i] = TestResult(Status.ERROR, 0.0, detail)
        self._drop_candidate(kill=True)
        raise _Stop(Status.ERROR, detail)

    def _request(self, i: int, test: TestCase, limit: float) -> dict[str, Any]:
        req: dict[str, Any] = {"i": i, "kind": test.kind, "timeout": limit}
        if test.kind == "stdio":
            req["input"] = test.input
        elif test.kind == "call":
            req["fn"] = self.job.entry_point
            req["args"] = encode_value(list(test.args))
        else:
            req["expr"] = test.expr
        return req

    def _test(self, i: int, test: TestCase) -> TestResult:
        proc = self._candidate()
        limit = self._limit()
        start = time.monotonic()
        proc.send(self._request(i, test, limit))
        try:
            ev = proc.next_event(self._deadline(start, limit))
            if isinstance(ev, dict) and not (ev["ev"] == "end" and type(ev.get("i")) is int and ev["i"] == i):
                raise _Violation(f"unexpected {ev['ev']!r} event")
        except _Violation as exc:
            self._void(str(exc))
        wall = time.monotonic() - start
        if ev == _LATE:
            self._drop_candidate(kill=True)
            return TestResult(Status.TIMEOUT, wall, "killed at the wall-clock limit")
        if ev == _DEAD:
            how = self._drop_candidate(kill=True, wait=True)
            return TestResult(Status.ERROR, wall, f"sandbox process died during the test ({how})")
        assert isinstance(ev, dict)
        self.c_judged.append(i)
        return self._judge(test, ev, wall)

    def _judge(self, test: TestCase, ev: Mapping[str, Any], wall: float) -> TestResult:
        """The verdict of one result event; total: whatever the event holds, a TestResult."""
        c = self.cfg
        runtime = ev.get("t")
        runtime = float(runtime) if type(runtime) is float and 0 <= runtime < 1e6 else wall
        detail = _text(ev.get("err"))
        st = ev.get("st")
        if st == "timeout":
            return TestResult(Status.TIMEOUT, runtime, "time limit exceeded")
        if st != "ok":
            out = ev.get("out")
            return TestResult(Status.ERROR, runtime, detail or "error", render_value(out) if type(out) is str else "")
        if test.kind == "stdio":
            out = ev.get("out")
            if type(out) is not str:
                return TestResult(Status.ERROR, runtime, "no output received")
            ok = stdout_matches(test.expected, out, c.rel_tol, c.abs_tol)
            return TestResult(Status.PASS if ok else Status.FAIL, runtime, "" if ok else "wrong output", render_value(out))
        try:
            value = decode_value(ev.get("val"))
        except (CodecError, ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError) as exc:
            return TestResult(Status.ERROR, runtime, f"undecodable return value: {exc}"[:500])
        ok = judge_value(test.cmp, test.expected, value, alternatives=test.alternatives, equality=self.job.equality,
                         tol=test.tol, rel_tol=c.rel_tol, abs_tol=c.abs_tol)
        return TestResult(Status.PASS if ok else Status.FAIL, runtime, "" if ok else "wrong value", render_value(value))

    # -- the judge's sandbox
    def _start_judge(self) -> None:
        try:
            self.j = self._spawn("judge")
        except _Stop as stop:
            self.j_broken = (stop.status, stop.detail)

    def _judge_proc(self) -> _Proc:
        if self.j_broken is not None:
            raise _JudgeUnavailable(*self.j_broken)
        if self.j is None:
            self._start_judge()
            return self._judge_proc()
        if not self.j_loaded:
            try:
                why = self._await_start(self.j, "judge")
            except _Violation as exc:
                why = f"judge protocol violation: {exc}"
            if why is not None:
                self._break_judge(Status.ERROR, f"judge failed to start: {why}")
                return self._judge_proc()
            self.j_loaded = True
        return self.j

    def _break_judge(self, status: Status, detail: str) -> None:
        self.j_broken = (status, detail)
        if self.j is not None:
            self.j.finish(kill=True)
            self.j = None

    def _check_step(self, i: int, test: TestCase) -> TestResult:
        try:
            judge = self._judge_proc()
        except _JudgeUnavailable as exc:
            return TestResult(exc.status, 0.0, exc.detail)
        self._candidate()
        limit = self._limit()
        start = time.monotonic()
        deadline = self._deadline(start, limit)
        judge.send({"step": test.step})
        override: tuple[Status, str] | None = None
        while True:
            try:
                ev = judge.next_event(deadline)
            except _Violation as exc:
                self._break_judge(Status.ERROR, f"judge protocol violation: {exc}")
                return TestResult(Status.ERROR, time.monotonic() - start, self.j_broken[1])
            wall = time.monotonic() - start
            if ev == _LATE:
                self._break_judge(Status.TIMEOUT, "judge stopped at the time limit of an earlier step")
                return TestResult(Status.TIMEOUT, wall, "killed at the wall-clock limit")
            if ev == _DEAD:
                self._break_judge(Status.ERROR, "judge process died in an earlier step")
                return TestResult(Status.ERROR, wall, f"judge process died ({judge.how()})")
            assert isinstance(ev, dict)
            if ev["ev"] == "call":
                if override is not None:  # the candidate already timed out or died in this step
                    reply = {"timeout": 1} if override[0] is Status.TIMEOUT else {"died": override[1]}
                else:
                    reply, override = self._forward(ev, deadline)
                if override is not None and override[0] is Status.TIMEOUT:
                    deadline = max(deadline, time.monotonic() + 2.0)  # let the judge report the step
                judge.send(reply)
                continue
            if ev["ev"] == "step" and type(ev.get("k")) is int and ev["k"] == test.step:
                if override is not None:
                    return TestResult(override[0], wall, override[1])
                st = ev.get("st")
                err = ev.get("err")
                detail = _text(err)
                status = {"ok": Status.PASS, "fail": Status.FAIL, "timeout": Status.TIMEOUT}.get(st, Status.ERROR)
                return TestResult(status, wall, detail)
            self._break_judge(Status.ERROR, f"judge protocol violation: unexpected {ev['ev']!r} event")
            return TestResult(Status.ERROR, wall, self.j_broken[1])

    def _forward(self, ev: Mapping[str, Any], deadline: float) -> tuple[dict[str, Any], tuple[Status, str] | None]:
        """Run one call of the judge's ``candidate`` in the candidate's sandbox; returns the
        reply for the judge and, when the candidate timed out or died, the step's verdict."""
        try:
            proc = self._candidate()
        except _Stop as stop:
            return {"died": stop.detail}, (stop.status, stop.detail)
        self.call_seq -= 1  # judge calls are numbered -1, -2...: a stale or forged answer cannot match
        req: dict[str, Any] = {"i": self.call_seq, "kind": "call", "fn": self.job.entry_point,
                               "args": ev.get("args", []), "timeout": max(0.01, deadline - time.monotonic() - self.cfg.grace)}
        if ev.get("kw"):
            req["kw"] = ev["kw"]
        proc.send(req)
        try:
            cev = proc.next_event(deadline)
            if isinstance(cev, dict) and not (cev["ev"] == "end" and type(cev.get("i")) is int and cev["i"] == self.call_seq):
                raise _Violation(f"unexpected {cev['ev']!r} event")
        except _Violation as exc:
            self._void(str(exc))
        if cev == _LATE:
            self._drop_candidate(kill=True)
            return {"timeout": 1}, (Status.TIMEOUT, "killed at the wall-clock limit")
        if cev == _DEAD:
            how = self._drop_candidate(kill=True, wait=True)
            detail = f"sandbox process died during the test ({how})"
            return {"died": detail}, (Status.ERROR, detail)
        assert isinstance(cev, dict)
        st = cev.get("st")
        if st == "ok":
            try:  # the judge gets plain data re-encoded here: bounded, whatever the event held
                return {"val": encode_value(decode_value(cev.get("val")))}, None
            except (CodecError, ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError) as exc:
                detail = f"undecodable return value: {exc}"[:500]
                self._drop_candidate(kill=True)
                return {"died": detail}, (Status.ERROR, detail)
        if st == "timeout":
            return {"timeout": 1}, (Status.TIMEOUT, "time limit exceeded")
        etype = cev.get("etype")
        return {"exc": etype[:100] if type(etype) is str else "Exception", "msg": _text(cev.get("err"))}, None


def _text(value: Any, limit: int = 500) -> str:
    """A message field from a sandbox event: a string (truncated), else nothing."""
    return value[:limit] if type(value) is str else ""


class _JudgeUnavailable(Exception):
    def __init__(self, status: Status, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# ----------------------------------------------------------------------------------------------
# the pool


class Sandbox:
    """Runs candidate programs against tests in isolated, resource-limited processes.

    Thread-safe; :meth:`run` spreads a batch over ``config.workers`` threads in parallel. Call
    :meth:`close` (or use it as a context manager) to stop the fork servers; they also exit on
    their own when this process dies.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        cfg = self.config
        python = cfg.python or sys.executable
        if not cfg.site_packages:
            python = os.path.realpath(python)
        flags = ["-I", "-B"] + ([] if cfg.site_packages else ["-S"])
        self._argv = [python, *flags, str(HARNESS)]
        try:
            self._hide_required = default_hide_paths(cfg.hide_paths, defaults=False)
        except ValueError as exc:
            raise SandboxError(str(exc)) from None
        self._hide_defaults = [p for p in default_hide_paths((), cfg.hide_defaults)
                               if not any(_harness._under(p, q) for q in self._hide_required)]
        self._event_cap = 8 * cfg.max_output_bytes + _EVENT_SLACK
        self.workers = cfg.workers or _usable_cpus()
        self._max_zygotes = 2 * self.workers + 2
        self._idle: queue.SimpleQueue[_Zygote] = queue.SimpleQueue()
        self._zygotes: list[_Zygote] = []
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._owner = os.getpid()
        self._closed = False
        self.last_protections: dict[str, Any] = {}
        # stop the fork servers when the sandbox is garbage-collected without close()
        self._finalizer = weakref.finalize(self, _close_all, self._zygotes)

    # -- pool
    def _check_fork(self) -> None:
        if os.getpid() != self._owner:  # forked: the zygotes belong to the parent process
            self._owner = os.getpid()
            self._idle = queue.SimpleQueue()
            self._zygotes = []
            self._executor = None
            self._lock = threading.Lock()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _close_all, self._zygotes)

    def _acquire(self) -> _Zygote:
        """An idle fork server: one whose last sandbox has ended; while all are still ending
        one, a new one (up to ``2 * workers + 2``), else wait for the oldest."""
        busy: list[_Zygote] = []
        try:
            while True:
                try:
                    z = self._idle.get_nowait()
                except queue.Empty:
                    break
                if not z.alive or z.proc.poll() is not None:
                    self._discard(z)
                elif z.pending is None or z.settle(block=False):
                    return z
                elif z.pending is not None and z.alive:
                    busy.append(z)
                else:
                    self._discard(z)
            with self._lock:
                room = len(self._zygotes) < self._max_zygotes
            while busy and not room:
                z = busy.pop(0)
                if z.settle(block=True):
                    return z
                self._discard(z)
                with self._lock:
                    room = len(self._zygotes) < self._max_zygotes
        finally:
            for other in busy:
                self._idle.put(other)
        z = _Zygote(self._argv, self.config.namespaces)
        with self._lock:
            self._zygotes.append(z)
        return z

    def _release(self, z: _Zygote) -> None:
        if z.alive and not self._closed and (z.pending is not None or not z.has_msg()):
            self._idle.put(z)
        else:
            self._discard(z)

    def _discard(self, z: _Zygote) -> None:
        z.close(kill=True)
        with self._lock:
            if z in self._zygotes:
                self._zygotes.remove(z)

    def close(self) -> None:
        """Stop all fork servers (idempotent)."""
        self._closed = True
        with self._lock:
            zygotes = list(self._zygotes)
            self._zygotes.clear()
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        for z in zygotes:
            z.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API
    def run(self, jobs: Sequence[Job], progress: Callable[[int], None] | None = None) -> list[CandidateResult]:
        """Run every job (candidate + its tests), ``workers`` at a time; results in job order.
        Every job gets a result whatever its candidate does."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        self._check_fork()
        jobs = list(jobs)
        if not jobs:
            return []
        if len(jobs) == 1 or self.workers == 1:
            out = []
            for job in jobs:
                out.append(self._run_job(job))
                if progress:
                    progress(1)
            return out
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="vpo-sandbox")
            executor = self._executor
        futures = [executor.submit(self._run_job, job) for job in jobs]
        results = []
        for f in futures:
            results.append(f.result())
            if progress:
                progress(1)
        return results

    def run_one(self, code: str, tests: Sequence[TestCase], entry_point: str | None = None) -> CandidateResult:
        """Run one candidate (convenience wrapper around :meth:`run`)."""
        return self.run([Job(code, tuple(tests), entry_point)])[0]

    def probe(self) -> dict[str, Any]:
        """Run a trivial program and return the protections the sandbox actually obtained."""
        res = self.run_one("print(input())", [TestCase.stdio("ok", "ok")])
        if not res.all_passed:
            raise SandboxError(f"sandbox probe failed: {res.tests[0]}")
        return dict(res.protections)

    # -- one candidate
    def _budget(self, job: Job) -> float:
        c = self.config
        if c.total_timeout is not None:
            return c.total_timeout
        n = len(job.tests)
        per_test = c.test_timeout if job.problem_timeout is None else min(c.test_timeout, job.problem_timeout)
        return 2 * (c.load_timeout + c.grace) + 5.0 + n * (per_test + c.grace)

    def _run_job(self, job: Job) -> CandidateResult:
        run = _JobRun(self, job)
        try:
            return run.run()
        except SandboxError:
            raise
        except Exception as exc:
            log.exception("vpo.sandbox: internal error while running a candidate; its remaining tests are errors")
            run.close(kill=True, discard=True)
            run.fill(Status.ERROR, f"internal sandbox error: {type(exc).__name__}: {exc}"[:500])
            return run.result()


_VIEW_PROBED: dict[str, bool] = {}


def private_view_available(python: str | None = None) -> bool:
    """Whether a sandbox here gets a private filesystem view (so dataset files can be hidden);
    probed once per interpreter. Where not (no usable namespaces), a job with paths that must
    be hidden is refused: pass ``hide_source=False`` to the code task to accept that."""
    key = python or sys.executable
    if key not in _VIEW_PROBED:
        with Sandbox(SandboxConfig(workers=1, python=python)) as box:
            _VIEW_PROBED[key] = box.probe().get("view") == "minimal"
    return _VIEW_PROBED[key]


def with_overrides(config: SandboxConfig, **changes: Any) -> SandboxConfig:
    """A copy of ``config`` with some fields changed."""
    return replace(config, **changes)
