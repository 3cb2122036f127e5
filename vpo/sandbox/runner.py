"""Parent side of the sandbox: test cases, results, the zygote pool and the judging loop.

A :class:`Sandbox` owns one fork-server ("zygote") process per worker. Each candidate is sent
to a free zygote, which forks a fresh sandbox for it (see :mod:`vpo.sandbox._harness` for the
isolation steps); the worker thread reads the candidate's event stream, enforces per-test and
per-candidate wall-clock deadlines, and judges each output here, in the parent. A test that
hangs or crashes the sandbox process costs only that test: the remaining tests are re-run in a
new sandbox while the candidate's time budget lasts.
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
from typing import Any, Self

from vpo.sandbox import _harness
from vpo.sandbox._harness import CodecError, decode_value, encode_value
from vpo.sandbox.compare import DEFAULT_ABS_TOL, DEFAULT_REL_TOL, stdout_matches, values_match

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

# Directories never hidden (hiding them would break the interpreter or is meaningless).
_SYSTEM_DIRS = {"/", "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/var", "/boot", "/tmp", "/dev/shm"}
_DEFAULT_HIDE = ("/root", "/home", "/var/tmp", "/run", "/mnt", "/media", "/srv", "/opt")


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, or required isolation is unavailable)."""


class Status(str, enum.Enum):
    """Outcome of one test: only PASS earns reward."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class TestCase:
    """One test. ``kind`` is ``stdio`` (feed ``input`` on stdin, compare stdout with
    ``expected``), ``call`` (call the entry point with ``args``, compare the return value with
    ``expected``) or ``expr`` (evaluate ``expr`` in the solution's namespace, compare the value).
    ``alternatives`` are further accepted expected values (APPS-style wrapped outputs); ``tol``
    overrides the float tolerance of a call/expr test (from ``abs(f(x) - y) < tol`` asserts)."""

    __test__ = False  # not a pytest class

    kind: str
    input: str = ""
    args: tuple[Any, ...] = ()
    expr: str = ""
    expected: Any = None
    alternatives: tuple[Any, ...] = ()
    tol: float | None = None  # absolute tolerance for numbers in this test's value (call/expr)

    def __post_init__(self) -> None:
        if self.kind not in ("stdio", "call", "expr"):
            raise ValueError(f"unknown test kind {self.kind!r}; expected stdio, call or expr")
        if self.kind == "stdio" and not isinstance(self.expected, str):
            raise ValueError("a stdio test needs the expected stdout as a string")
        if self.kind == "expr" and not self.expr.strip():
            raise ValueError("an expr test needs an expression")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "alternatives", tuple(self.alternatives))

    @classmethod
    def stdio(cls, input: str, output: str) -> TestCase:
        return cls(kind="stdio", input=input, expected=output)

    @classmethod
    def call(cls, args: Sequence[Any], expected: Any, alternatives: Sequence[Any] = ()) -> TestCase:
        return cls(kind="call", args=tuple(args), expected=expected, alternatives=tuple(alternatives))

    @classmethod
    def expression(cls, expr: str, expected: Any) -> TestCase:
        return cls(kind="expr", expr=expr, expected=expected)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TestCase:
        """Build from the dataset schema (docs/code_task.md): ``{"type": "stdio", "input",
        "output"}``, ``{"type": "call", "args", "expected"}`` or ``{"type": "expr", "expr",
        "expected"}``; values may use the codec's tags (``{"$t": [...]}`` for a tuple...)."""
        kind = d.get("type", d.get("kind"))
        if kind == "stdio":
            return cls.stdio(str(d.get("input", "")), str(d["output"] if "output" in d else d["expected"]))
        alts = tuple(decode_value(a) for a in d.get("alternatives", ()))
        tol = d.get("tol")
        if tol is not None and (not isinstance(tol, (int, float)) or isinstance(tol, bool) or tol < 0):
            raise ValueError(f"tol must be a non-negative number, got {tol!r}")
        tol = None if tol is None else float(tol)
        if kind == "call":
            args = decode_value(d.get("args", []))
            if not isinstance(args, (list, tuple)):
                raise ValueError("a call test's args must be a list")
            return cls(kind="call", args=tuple(args), expected=decode_value(d.get("expected")), alternatives=alts, tol=tol)
        if kind == "expr":
            return cls(kind="expr", expr=str(d["expr"]), expected=decode_value(d.get("expected")), alternatives=alts,
                       tol=tol)
        raise ValueError(f"unknown test type {kind!r}")

    def to_dict(self) -> dict[str, Any]:
        """The dataset-schema form (JSON-serialisable)."""
        if self.kind == "stdio":
            return {"type": "stdio", "input": self.input, "output": self.expected}
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
    """One candidate program and the tests to run it against."""

    code: str
    tests: tuple[TestCase, ...]
    entry_point: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tests", tuple(self.tests))
        if any(t.kind == "call" for t in self.tests) and not self.entry_point:
            raise ValueError("call tests need an entry_point")


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation settings. Times are wall-clock seconds per test / per candidate."""

    test_timeout: float = 3.0
    load_timeout: float = 5.0  # compiling the program and running its module body (call tests)
    grace: float = 0.5  # parent-side slack after a deadline before the sandbox is killed
    total_timeout: float | None = None  # per candidate; default load + n * (test + grace)
    memory_mb: int = 1024  # RLIMIT_AS
    stack_mb: int = 64
    max_processes: int = 4  # RLIMIT_NPROC: processes + threads, the main one included
    max_open_files: int = 64
    max_output_bytes: int = 4 << 20  # per test, stdout; also caps file writes (RLIMIT_FSIZE)
    tmp_mb: int = 64  # private /tmp (work dir) and /dev/shm, each
    workers: int | None = None  # parallel sandboxes; default: usable cores
    python: str | None = None  # interpreter; default: the running one
    site_packages: bool = False  # let candidates import from site-packages (slower start)
    namespaces: str = "auto"  # auto | require | off
    hide_paths: tuple[str, ...] = ()  # further directories to hide (datasets with answers)
    hide_defaults: bool = True  # hide /root, /home, /run, /opt..., the cwd and the project dir
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


def default_hide_paths(extra: Iterable[str] = (), defaults: bool = True) -> list[str]:
    """Directories replaced by an empty read-only tmpfs inside the sandbox: home directories,
    /root, /run, /opt..., the current directory and this project's checkout (datasets with
    expected outputs live there), plus ``extra``. System directories are never hidden; the
    interpreter's own directories are re-exposed by the harness."""
    paths: list[str] = []
    if defaults:
        paths.extend(_DEFAULT_HIDE)
        paths.append(os.getcwd())
        root = Path(__file__).resolve().parents[2]
        if (root / "pyproject.toml").exists():
            paths.append(str(root))
    paths.extend(extra)
    real: set[str] = set()
    for p in paths:
        if not p:
            continue
        rp = os.path.realpath(p)
        if rp in _SYSTEM_DIRS or not os.path.lexists(rp):
            continue
        if any(s == rp or s.startswith(rp.rstrip("/") + "/") for s in _SYSTEM_DIRS if s != "/"):
            continue  # an ancestor of a system dir
        real.add(rp)
    keep = sorted(real)
    return [p for p in keep if not any(p != q and p.startswith(q + "/") for q in keep)]


# ----------------------------------------------------------------------------------------------
# zygote


class _ZygoteDied(Exception):
    pass


class _Zygote:
    """One fork-server process and its control socket."""

    def __init__(self, argv: list[str]) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        try:
            self.proc = subprocess.Popen(
                [*argv, "zygote", str(child.fileno())],
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
        try:
            self.hello = self.read_msg(30.0)
        except _ZygoteDied as exc:
            self.close()
            raise SandboxError(f"sandbox fork server did not start ({' '.join(argv)}): {exc}") from exc
        self.alive = True

    def read_msg(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                raise _ZygoteDied("no reply from the fork server")
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                continue
            try:
                data = self.sock.recv(65536)
            except OSError as exc:
                raise _ZygoteDied(str(exc)) from exc
            if not data:
                raise _ZygoteDied("fork server closed its socket")
            self.buf += data
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        return json.loads(line)

    def has_msg(self) -> bool:
        return b"\n" in self.buf

    def feed(self) -> None:
        """Read what is available on the socket (after poll said readable)."""
        try:
            data = self.sock.recv(65536)
        except OSError as exc:
            raise _ZygoteDied(str(exc)) from exc
        if not data:
            raise _ZygoteDied("fork server closed its socket")
        self.buf += data

    def start(self, payload: bytes, wfd: int) -> None:
        try:
            socket.send_fds(self.sock, [struct.pack("<4sQ", b"RUN ", len(payload))], [wfd])
            self.sock.sendall(payload)
        except OSError as exc:
            raise _ZygoteDied(str(exc)) from exc

    def kill_current(self) -> None:
        try:
            self.sock.sendall(struct.pack("<4sQ", b"KILL", 0))
        except OSError:
            pass

    def close(self) -> None:
        self.alive = False
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
# judging


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
            "pid namespace or private filesystem view (rlimits, session kill and the subreaper "
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
            f"vpo.sandbox: isolation mode {mode}: pid+net+mount+ipc+uts namespaces, uid {('random unprivileged' if mode == 'root' else prot.get('uid'))}, "
            f"read-only root={prot.get('readonly_root')}, hidden={len(prot.get('hidden', []))} dirs",
            logging.INFO,
        )


def _render(value: Any, limit: int = 2000) -> str:
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # noqa: BLE001 - plain data only, but stay safe
        text = "<unprintable>"
    return text if len(text) <= limit else text[:limit] + "..."


def _close_all(zygotes: list[_Zygote]) -> None:
    for z in list(zygotes):
        z.close()
    zygotes.clear()


class _Round:
    """State of one sandbox process running tests ``start..`` of a job."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.next = start  # next test index expected to begin
        self.current: int | None = None
        self.begin_time = 0.0
        self.ready_time = 0.0
        self.end_time = 0.0
        self.ends: dict[int, dict[str, Any]] = {}
        self.prot: dict[str, Any] = {}
        self.ready = False
        self.loaded = False
        self.done = False
        self.load_error: str | None = None
        self.fatal: str | None = None
        self.violation: str | None = None
        self.killed_for: str | None = None
        self.exit_code: int | None = None


class Sandbox:
    """Runs candidate programs against tests in isolated, resource-limited processes.

    Thread-safe; :meth:`run` spreads a batch over ``config.workers`` sandboxes in parallel.
    Call :meth:`close` (or use it as a context manager) to stop the fork servers; they also
    exit on their own when this process dies.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        cfg = self.config
        python = cfg.python or sys.executable
        if not cfg.site_packages:
            python = os.path.realpath(python)
        flags = ["-I", "-B"] + ([] if cfg.site_packages else ["-S"])
        self._argv = [python, *flags, str(HARNESS)]
        self._hide = default_hide_paths(cfg.hide_paths, cfg.hide_defaults)
        self.workers = cfg.workers or _usable_cpus()
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
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        z = _Zygote(self._argv)
        with self._lock:
            self._zygotes.append(z)
        return z

    def _release(self, z: _Zygote) -> None:
        if z.alive and not self._closed:
            self._idle.put(z)
        else:
            self._discard(z)

    def _discard(self, z: _Zygote) -> None:
        z.close()
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
        """Run every job (candidate + its tests), ``workers`` at a time; results in job order."""
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
    def _budget(self, n: int) -> float:
        c = self.config
        if c.total_timeout is not None:
            return c.total_timeout
        return c.load_timeout + c.grace + 1.0 + n * (c.test_timeout + c.grace)

    def _run_job(self, job: Job) -> CandidateResult:
        t0 = time.monotonic()
        n = len(job.tests)
        results: list[TestResult | None] = [None] * n
        deadline = t0 + self._budget(n)
        max_rounds = self.config.max_rounds or n + 1
        rounds = 0
        prot: dict[str, Any] = {}
        start = 0
        while start < n:
            if rounds >= max_rounds or time.monotonic() >= deadline:
                for i in range(start, n):
                    results[i] = TestResult(Status.TIMEOUT, 0.0, "not run: candidate time budget exhausted")
                break
            rounds += 1
            rnd = self._run_round(job, start, deadline)
            if rnd.prot:
                prot = rnd.prot
            start = self._judge_round(job, rnd, results)
        final = tuple(r if r is not None else TestResult(Status.ERROR, 0.0, "not run") for r in results)
        return CandidateResult(tests=final, protections=prot, rounds=rounds, wall=time.monotonic() - t0)

    def _payload(self, job: Job, start: int) -> bytes:
        c = self.config
        tests = []
        max_input = 0
        for t in job.tests[start:]:
            if t.kind == "stdio":
                tests.append({"kind": "stdio", "input": t.input})
                max_input = max(max_input, len(t.input.encode("utf-8", "surrogateescape")))
            elif t.kind == "call":
                tests.append({"kind": "call", "fn": job.entry_point, "args": encode_value(list(t.args))})
            else:
                tests.append({"kind": "expr", "expr": t.expr})
        n = len(tests)
        cfg = {
            "code": job.code,
            "tests": tests,
            "start": start,
            "namespaces": "off" if c.namespaces == "off" else "auto",
            "require": c.namespaces == "require",
            "hide": self._hide,
            "tmp_mb": c.tmp_mb,
            "uid": c.uid_base + secrets.randbelow(1 << 20),
            "memory_mb": c.memory_mb,
            "stack_mb": c.stack_mb,
            "cpu_seconds": math.ceil(c.load_timeout + n * c.test_timeout) + 1,
            "fsize": max(c.max_output_bytes, max_input, 1 << 20) + 1,
            "max_open_files": c.max_open_files,
            "max_processes": c.max_processes,
            "test_timeout": c.test_timeout,
            "load_timeout": c.load_timeout,
            "max_output_bytes": c.max_output_bytes,
            "prelude": c.prelude,
        }
        return json.dumps(cfg).encode()

    def _run_round(self, job: Job, start: int, job_deadline: float) -> _Round:
        for attempt in range(2):
            rnd = _Round(start)
            z = self._acquire()
            try:
                self._drive(z, job, rnd, job_deadline)
                break
            except _ZygoteDied as exc:
                z.alive = False
                log.warning("vpo.sandbox: fork server failed (%s); starting a new one", exc)
                if attempt == 1 or rnd.ready:
                    rnd.fatal = rnd.fatal or f"sandbox fork server failed: {exc}"
                    break
            finally:
                self._release(z)
        if rnd.prot:
            self.last_protections = rnd.prot
            _report_protections(rnd.prot)
        return rnd

    def _drive(self, z: _Zygote, job: Job, rnd: _Round, job_deadline: float) -> None:
        payload = self._payload(job, rnd.start)
        rfd, wfd = os.pipe()
        try:
            try:
                z.start(payload, wfd)
            finally:
                os.close(wfd)
            msg = z.read_msg(30.0)
            if "pid" not in msg:
                rnd.fatal = str(msg.get("error", msg))
                return
            self._pump(z, job, rnd, rfd, job_deadline)
        finally:
            os.close(rfd)

    def _pump(self, z: _Zygote, job: Job, rnd: _Round, rfd: int, job_deadline: float) -> None:
        """Read events until the sandbox is gone, killing it when a deadline passes."""
        c = self.config
        cap = 8 * c.max_output_bytes + (1 << 16)
        buf = bytearray()
        eof = False
        exit_msg: dict[str, Any] | None = None
        now = time.monotonic()
        phase_deadline = now + c.load_timeout + c.grace + 2.0  # start-up + load
        kill_sent_at: float | None = None
        poller = select.poll()
        poller.register(rfd, select.POLLIN)
        poller.register(z.sock.fileno(), select.POLLIN)
        exit_at: float | None = None
        while not (eof and exit_msg is not None):
            now = time.monotonic()
            if exit_msg is not None:
                if exit_at is None:
                    exit_at = now
                elif now - exit_at > 2.0:
                    break  # the sandbox is gone; something it spawned still holds the pipe
                wait = 0.1
            elif kill_sent_at is None:
                deadline = min(phase_deadline, job_deadline)
                if now >= deadline:
                    rnd.killed_for = rnd.killed_for or ("test" if rnd.current is not None else "load")
                    z.kill_current()
                    kill_sent_at = now
                    continue
                wait = deadline - now
            else:
                if now - kill_sent_at > 15.0:
                    raise _ZygoteDied("sandbox did not terminate after SIGKILL")
                wait = 0.5
            if exit_msg is None and z.has_msg():
                exit_msg = z.read_msg(0.1)
                continue
            events = poller.poll(max(1, int(wait * 1000) + 1))
            for fd, _ev in events:
                if fd == rfd:
                    data = os.read(rfd, 1 << 16)
                    if not data:
                        eof = True
                        poller.unregister(rfd)
                        continue
                    if rnd.violation or kill_sent_at is not None:
                        continue  # draining only
                    buf += data
                    while True:
                        nl = buf.find(b"\n")
                        if nl < 0:
                            break
                        line = bytes(buf[:nl])
                        del buf[: nl + 1]
                        self._event(rnd, line)
                        if rnd.violation:
                            break
                    if not rnd.violation and len(buf) > cap:
                        rnd.violation = "oversized message on the result channel"
                    if rnd.violation:
                        z.kill_current()
                        kill_sent_at = time.monotonic()
                        continue
                    phase_deadline = self._phase_deadline(rnd, phase_deadline)
                elif exit_msg is None:
                    z.feed()
                    if z.has_msg():
                        exit_msg = z.read_msg(0.1)
                else:
                    poller.unregister(fd)
        rnd.exit_code = exit_msg.get("exit") if exit_msg else None

    def _phase_deadline(self, rnd: _Round, current: float) -> float:
        """When the sandbox must have made progress by, given the last event."""
        c = self.config
        if rnd.done or rnd.fatal is not None:
            return time.monotonic() + 5.0
        if rnd.current is not None:
            return rnd.begin_time + c.test_timeout + c.grace
        if rnd.ends:
            return rnd.end_time + c.test_timeout + c.grace
        if rnd.ready:
            return rnd.ready_time + c.load_timeout + c.grace
        return current

    def _event(self, rnd: _Round, line: bytes) -> None:
        try:
            ev = json.loads(line)
            kind = ev["ev"]
        except (ValueError, TypeError, KeyError):
            rnd.violation = "malformed message on the result channel"
            return
        if not isinstance(ev, dict):
            rnd.violation = "malformed message on the result channel"
            return
        now = time.monotonic()
        if kind == "ready" and not rnd.ready:
            rnd.ready = True
            rnd.ready_time = now
            rnd.prot = ev.get("prot", {}) if isinstance(ev.get("prot"), dict) else {}
        elif kind == "fatal" and not rnd.ready:
            rnd.fatal = str(ev.get("msg", "sandbox setup failed"))
            if isinstance(ev.get("prot"), dict):
                rnd.prot = ev["prot"]
        elif not rnd.ready or rnd.done:
            rnd.violation = f"unexpected {kind!r} event"
        elif kind == "load_error" and rnd.current is None and not rnd.ends and not rnd.loaded:
            rnd.load_error = str(ev.get("msg", ""))[:500]
            rnd.done = True
        elif kind == "loaded" and not rnd.loaded and not rnd.ends and rnd.current is None:
            rnd.loaded = True
        elif kind == "begin" and rnd.current is None and ev.get("i") == rnd.next:
            rnd.current = rnd.next
            rnd.begin_time = now
        elif kind == "end" and rnd.current is not None and ev.get("i") == rnd.current:
            ev["_wall"] = now - rnd.begin_time
            rnd.ends[rnd.current] = ev
            rnd.end_time = now
            rnd.current = None
            rnd.next += 1
        elif kind == "done" and rnd.current is None:
            rnd.done = True
        else:
            rnd.violation = f"unexpected {kind!r} event"

    def _judge_round(self, job: Job, rnd: _Round, results: list[TestResult | None]) -> int:
        """Fill ``results`` from one round; return the index to restart from (len = finished)."""
        n = len(job.tests)
        if rnd.violation is not None:  # the stream was tampered with: nothing from it counts
            for i in range(rnd.start, n):
                results[i] = TestResult(Status.ERROR, 0.0, f"protocol violation: {rnd.violation}")
            return n
        for i, ev in rnd.ends.items():
            results[i] = self._judge(job.tests[i], ev)
        if rnd.fatal is not None:
            detail = f"sandbox failure: {rnd.fatal}"
            if "required isolation" in rnd.fatal or "drop root" in rnd.fatal:
                raise SandboxError(rnd.fatal)
            for i in range(rnd.next, n):
                results[i] = TestResult(Status.ERROR, 0.0, detail)
            return n
        if rnd.load_error is not None:
            for i in range(rnd.next, n):
                results[i] = TestResult(Status.ERROR, 0.0, f"load error: {rnd.load_error}")
            return n
        if rnd.done and rnd.next == n:
            return n
        # the process ended early: blame the running test, restart after it
        code = rnd.exit_code
        how = f"signal {-code}" if isinstance(code, int) and code < 0 else f"exit status {code}"
        if isinstance(code, int) and code > 128:
            how = f"signal {code - 128}"
        if rnd.current is not None:
            i = rnd.current
            wall = time.monotonic() - rnd.begin_time
            if rnd.killed_for == "test":
                results[i] = TestResult(Status.TIMEOUT, wall, "killed at the wall-clock limit")
            else:
                results[i] = TestResult(Status.ERROR, wall, f"sandbox process died during the test ({how})")
            return i + 1
        if not rnd.ready and not rnd.killed_for:
            log.warning("vpo.sandbox: a sandbox process ended before it was ready (%s)", how)
        if not rnd.ready or (not rnd.loaded and not rnd.ends and any(t.kind != "stdio" for t in job.tests)):
            status = Status.TIMEOUT if rnd.killed_for else Status.ERROR
            why = "timed out while loading" if rnd.killed_for else f"sandbox process died while loading ({how})"
            for i in range(rnd.next, n):
                results[i] = TestResult(status, 0.0, why)
            return n
        return rnd.next  # died between tests: continue with the next one

    def _judge(self, test: TestCase, ev: Mapping[str, Any]) -> TestResult:
        c = self.config
        st = ev.get("st")
        try:
            runtime = float(ev.get("t", ev.get("_wall", 0.0)))
        except (TypeError, ValueError):
            runtime = 0.0
        detail = str(ev.get("err", ""))[:500]
        if st == "timeout":
            return TestResult(Status.TIMEOUT, runtime, "time limit exceeded")
        if st != "ok":
            return TestResult(Status.ERROR, runtime, detail or "error", _render(ev.get("out", "")))
        if test.kind == "stdio":
            out = ev.get("out")
            if not isinstance(out, str):
                return TestResult(Status.ERROR, runtime, "no output received")
            ok = stdout_matches(test.expected, out, c.rel_tol, c.abs_tol)
            return TestResult(Status.PASS if ok else Status.FAIL, runtime, "" if ok else "wrong output", _render(out))
        try:
            value = decode_value(ev.get("val"))
        except (CodecError, ValueError, TypeError, KeyError, IndexError) as exc:
            return TestResult(Status.ERROR, runtime, f"undecodable return value: {exc}")
        rel, abs_ = (0.0, test.tol) if test.tol is not None else (c.rel_tol, c.abs_tol)
        ok = any(values_match(exp, value, rel, abs_) for exp in (test.expected, *test.alternatives))
        return TestResult(Status.PASS if ok else Status.FAIL, runtime, "" if ok else "wrong value", _render(value))


def with_overrides(config: SandboxConfig, **changes: Any) -> SandboxConfig:
    """A copy of ``config`` with some fields changed."""
    return replace(config, **changes)
