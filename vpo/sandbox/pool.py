"""The fork-server pool and the public :class:`Sandbox`.

A :class:`Sandbox` owns a pool of fork-server ("zygote") processes, one per slot. Each slot has
its own user id (from a block of ids this instance leases machine-wide, see
:mod:`vpo.sandbox.leases`) and its own cgroup leaf (see :mod:`vpo.sandbox.cgroups`): a sandbox
started by that fork server runs as that uid and joins that leaf before anything of the candidate
runs, so two sandboxes alive at once never share an id or a group, and two Sandbox instances (two
stages, two copies of the test suite) never share anything.

A batch (:meth:`Sandbox.run`) spreads its jobs over ``workers`` threads; when it returns, every
sandbox it started has ended: after a short grace its whole process tree (its cgroup) is killed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

from vpo.sandbox import _harness, cgroups
from vpo.sandbox.channel import ZygoteDied
from vpo.sandbox.config import (
    CandidateResult,
    Job,
    SandboxConfig,
    SandboxError,
    Status,
    TestCase,
    _usable_cpus,
    benchmark_payloads,
    default_hide_paths,
    weaker_allowed,
)
from vpo.sandbox.judging import JobRun
from vpo.sandbox.leases import BLOCK, UidLease

__all__ = ["Sandbox", "private_view_available"]

log = logging.getLogger("vpo.sandbox")

HARNESS = Path(_harness.__file__).resolve()
_EVENT_SLACK = 1 << 16
_PROBE = Job("print(input())", (TestCase.stdio("ok", "ok"),))


_SITE_DIRS: dict[str, list[str]] = {}
_SITE_QUERY = ("import json, site, sysconfig\nd = set(site.getsitepackages())\n"
               "d.update(sysconfig.get_paths()[k] for k in ('purelib', 'platlib'))\nprint(json.dumps(sorted(d)))")


def _site_dirs(python: str) -> list[str]:
    """The site-packages directories of interpreter ``python``, as it reports them itself (once
    per process and interpreter)."""
    if python not in _SITE_DIRS:
        try:
            out = subprocess.run([python, "-I", "-c", _SITE_QUERY], capture_output=True, text=True, check=True,
                                 timeout=60, cwd="/").stdout
            _SITE_DIRS[python] = [str(d) for d in json.loads(out)]
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise SandboxError(f"cannot ask {python} for its site-packages directories: {exc}") from None
    return _SITE_DIRS[python]


def _view_paths(python: str) -> list[str]:
    """Where the files a sandbox reads live: the system directories and the interpreter's."""
    import sysconfig

    here = [sys.prefix, sys.base_prefix, os.path.dirname(os.__file__), sysconfig.get_paths().get("purelib", "")]
    return [*_harness.SYSTEM_VIEW, os.path.dirname(os.path.realpath(python)), *(p for p in here if p)]


class _Zygote:
    """One fork-server process, its control socket, its slot (uid and cgroup leaf)."""

    def __init__(self, argv: list[str], namespaces: str, slot: int, slot_cfg: dict[str, Any],
                 leaf: cgroups.Leaf | None) -> None:
        self.slot = slot
        self.leaf = leaf
        self.lock = threading.Lock()  # held while settling its last sandbox
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        try:
            self.proc = subprocess.Popen(
                [*argv, "zygote", str(child.fileno()), "off" if namespaces == "off" else "auto", json.dumps(slot_cfg)],
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
        except ZygoteDied as exc:
            self.close(kill=True)
            raise SandboxError(f"sandbox fork server did not start ({' '.join(argv)}): {exc}") from exc
        self.alive = True

    def read_msg(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0:
                raise ZygoteDied("no reply from the fork server")
            r, _, _ = select.select([self.sock], [], [], left)
            if r:
                self.feed()
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        try:
            msg = json.loads(line)
        except ValueError as exc:
            raise ZygoteDied(f"garbled fork server message: {exc}") from exc
        if not isinstance(msg, dict):
            raise ZygoteDied("garbled fork server message")
        return msg

    def has_msg(self) -> bool:
        return b"\n" in self.buf

    def settle(self, block: bool) -> bool:
        """Consume the exit report of the sandbox that was ending (``pending``); at the deadline
        kill it (and everything in its cgroup). True when this fork server is idle and clean,
        False when it is still busy (``block`` False) or must be replaced."""
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
                        return False  # still there 15 s after SIGKILL
                    self.kill_current()
                    self.pending, self.pending_killed = time.monotonic() + 15.0, True
                    continue
                r, _, _ = select.select([self.sock], [], [], left if block else 0)
                if r:
                    self.feed()
                elif not block:
                    return False
        except ZygoteDied:
            return False
        if self.leaf is not None and self.leaf.pids(exclude=(self.proc.pid,)) and \
                not self.leaf.kill(exclude=(self.proc.pid,)):
            return False  # something of the last sandbox outlived it and cannot be killed
        return self.alive and not self.has_msg()

    def feed(self) -> None:
        """Read what is available on the socket (after poll said readable)."""
        try:
            data = self.sock.recv(65536)
        except OSError as exc:
            raise ZygoteDied(str(exc)) from exc
        if not data:
            raise ZygoteDied("fork server closed its socket")
        self.buf += data

    def start(self, fds: list[int]) -> None:
        try:
            socket.send_fds(self.sock, [_harness.HEADER.pack(_harness.OP_RUN, 0)], fds)
        except OSError as exc:
            raise ZygoteDied(str(exc)) from exc

    def kill_current(self) -> None:
        """Kill the running sandbox: its session (through the fork server) and its cgroup."""
        try:
            self.sock.sendall(struct.pack("<4sQ", _harness.OP_KILL, 0))
        except OSError:
            pass
        if self.leaf is not None:
            self.leaf.kill(timeout=0.5, exclude=(self.proc.pid,))

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


class _Resources:
    """What one Sandbox instance holds on the machine: its cgroup group and its uid block.
    Released by :meth:`release` (close, garbage collection or interpreter exit)."""

    def __init__(self, config: SandboxConfig, workers: int) -> None:
        self.cgroup: cgroups.Instance | None = None
        self.cgroup_why = "disabled by config (cgroups='off')"
        self.lease: UidLease | None = None
        self.zygotes: list[_Zygote] = []
        if config.cgroups != "off":
            found = cgroups.detect()
            if isinstance(found, str):
                self.cgroup_why = found
            else:
                try:
                    self.cgroup = cgroups.Instance(found, workers)
                except cgroups.CgroupError as exc:
                    self.cgroup_why = str(exc)
            if self.cgroup is None and config.cgroups == "require":
                raise SandboxError(
                    f"vpo.sandbox: no cgroup can be made here ({self.cgroup_why}); refusing to run candidates "
                    "without per-sandbox memory, process and CPU limits. To run with the documented fallback "
                    "(per-process rlimits), set cgroups='auto' in the sandbox settings.")
        if os.geteuid() == 0:
            try:
                self.lease = UidLease(config.uid_base)
            except (OSError, RuntimeError, ValueError) as exc:
                self.release()
                raise SandboxError(f"vpo.sandbox: cannot lease sandbox user ids: {exc}") from None

    def release(self) -> None:
        for z in list(self.zygotes):
            z.close(kill=True)
        self.zygotes.clear()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class Sandbox:
    """Runs candidate programs against tests in isolated, resource-limited processes.

    Thread-safe; :meth:`run` spreads a batch over ``config.workers`` threads in parallel. The
    first :meth:`run` (or :meth:`start`) checks that every promised protection can be set up and
    raises one :class:`SandboxError` naming what cannot. Call :meth:`close` (or use it as a
    context manager) to stop the fork servers and remove its cgroups; they also go when this
    process exits.
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
        if cfg.site_packages:  # packages are part of the view; the benchmark data some of them carry is not
            self._hide_required = _harness._top_level({*self._hide_required, *benchmark_payloads(_site_dirs(python))})
        self._hide_defaults = [p for p in default_hide_paths((), cfg.hide_defaults)
                               if not any(_harness._under(p, q) for q in self._hide_required)]
        self._allow = weaker_allowed(cfg)
        self._io_devices = tuple(cgroups.block_devices(_view_paths(python)))
        self._event_cap = 8 * cfg.max_output_bytes + _EVENT_SLACK
        self.workers = cfg.workers or _usable_cpus()
        self._max_zygotes = 2 * self.workers + 2
        if self._max_zygotes > BLOCK:
            raise SandboxError(f"workers={self.workers} needs {self._max_zygotes} fork servers; at most {BLOCK} can run")
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._setup()

    def _setup(self) -> None:
        self._owner = os.getpid()
        self._res = _Resources(self.config, self.workers)
        self._idle: queue.SimpleQueue[_Zygote] = queue.SimpleQueue()
        self._zygotes = self._res.zygotes
        self._n_slots = self._max_zygotes
        self._free_slots = list(range(self._n_slots))
        self._dirty: list[int] = []
        self._dirty_tried = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._started = False
        self.protections: dict[str, Any] = {}
        self.last_protections: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, self._res.release)

    # -- what this instance holds
    @property
    def uids(self) -> range | None:
        """The user ids this instance's sandboxes run as (as root), leased for it alone."""
        return self._res.lease.ids if self._res.lease is not None else None

    @property
    def cgroup(self) -> cgroups.Instance | None:
        """This instance's cgroup group (None: the fallback is in force)."""
        return self._res.cgroup

    def processes(self) -> list[int]:
        """The processes of this instance's sandboxes now (host pids; fork servers excluded): the
        members of its cgroups, else the descendants of its fork servers."""
        servers = {z.proc.pid for z in list(self._zygotes)}
        if self._res.cgroup is not None:
            return [p for p in self._res.cgroup.processes() if p not in servers]
        out: list[int] = []
        for z in list(self._zygotes):
            todo = [z.proc.pid]
            while todo:
                pid = todo.pop()
                try:
                    with open(f"/proc/{pid}/task/{pid}/children") as fh:
                        kids = [int(x) for x in fh.read().split()]
                except OSError:
                    continue
                out += kids
                todo += kids
        return sorted(out)

    # -- pool
    def _check_fork(self) -> None:
        if os.getpid() != self._owner:  # forked: the fork servers, cgroup and ids belong to the parent
            self._finalizer.detach()
            self._lock = threading.Lock()
            self._start_lock = threading.Lock()
            self._setup()

    def _take_slot(self) -> int | None:
        """A free slot, taken under the lock so that no other thread can take it too; slots whose
        processes could not be killed before are tried again (at most once a second while other
        slots may come back). None: as many slots as fork servers may run are held by one or still
        being freed, so the caller waits for one. Raises only when no slot's processes can be killed."""
        with self._lock:
            held = self._n_slots - len(self._free_slots) - len(self._dirty)  # by fork servers, or being freed
            if held >= self._max_zygotes:
                return None
            if self._free_slots:
                return self._free_slots.pop(0)
            now, every = time.monotonic(), len(self._dirty) >= self._n_slots
            dirty = list(self._dirty) if every or now - self._dirty_tried >= 1.0 else []
            if dirty:
                self._dirty_tried = now
        for slot in dirty:
            if self._res.cgroup is None or self._res.cgroup.drop(slot):
                with self._lock:
                    if slot in self._dirty:  # another thread may have taken it meanwhile
                        self._dirty.remove(slot)
                        return slot
        with self._lock:
            if len(self._dirty) >= self._n_slots:
                raise SandboxError(f"no free fork-server slot: processes of slots {sorted(self._dirty)} cannot be killed")
        return None

    def _new_zygote(self, slot: int) -> _Zygote:
        """Start a fork server in ``slot`` (taken with :meth:`_take_slot`; given back on failure)."""
        cfg = self.config
        leaf = None
        slot_cfg: dict[str, Any] = {"uid": self._res.lease.first + slot if self._res.lease is not None else None,
                                    "cgroup_required": cfg.cgroups == "require", "cgroup_why": self._res.cgroup_why}
        try:
            if self._res.cgroup is not None:
                nproc = cfg.max_processes + (1 if os.geteuid() == 0 else 2)  # + the fork server (+ the intermediate)
                limits = cgroups.Limits(cfg.memory_mb << 20, nproc, cfg.cpus,
                                        None if cfg.io_mbps is None else cfg.io_mbps << 20, cfg.io_iops, self._io_devices)
                leaf = self._res.cgroup.leaf(slot, limits)
                slot_cfg["cgroup"] = {"version": self._res.cgroup.hier.version, "procs": leaf.procs,
                                      "leaf": f"{self._res.cgroup.name}/s{slot}", "memory_bytes": limits.memory_bytes,
                                      "pids_max": limits.pids, "cpus": limits.cpus, "io": leaf.io}
            z = _Zygote(self._argv, cfg.namespaces, slot, slot_cfg, leaf)
        except BaseException:
            self._free_slot(slot)
            raise
        with self._lock:
            self._zygotes.append(z)
        return z

    def _free_slot(self, slot: int) -> None:
        clean = True
        if self._res.cgroup is not None:
            clean = self._res.cgroup.drop(slot)
        with self._lock:
            if clean:
                self._free_slots.append(slot)
                self._free_slots.sort()
            else:  # a slot whose processes could not be killed keeps its uid out of use
                self._dirty.append(slot)

    def _acquire(self) -> _Zygote:
        """An idle fork server: one whose last sandbox has ended; while all are still ending
        one, a new one (up to ``2 * workers + 2``, one per slot), else the oldest once it has
        ended; while every one is in use (another thread may be looking at them), wait."""
        while True:
            busy: list[_Zygote] = []
            try:
                while True:
                    try:
                        z = self._idle.get_nowait()
                    except queue.Empty:
                        break
                    if not z.alive or z.proc.poll() is not None:
                        self._discard(z)
                        continue
                    with z.lock:
                        settled = z.pending is None or z.settle(block=False)
                    if settled and z.alive:
                        return z
                    if z.pending is not None and z.alive:
                        busy.append(z)
                    else:
                        self._discard(z)
                slot = self._take_slot()
                if slot is not None:
                    break
                if busy:
                    z = busy.pop(0)
                    with z.lock:
                        ok = z.settle(block=True)
                    if ok:
                        return z
                    self._discard(z)
                    continue
            finally:
                for other in busy:
                    self._idle.put(other)
            try:
                self._idle.put(self._idle.get(timeout=0.05))  # one came back: look again
            except queue.Empty:
                pass
        return self._new_zygote(slot)

    def _release(self, z: _Zygote) -> None:
        if z.alive and not self._closed and (z.pending is not None or not z.has_msg()):
            self._idle.put(z)
        else:
            self._discard(z)

    def _discard(self, z: _Zygote) -> None:
        z.close(kill=True)
        with self._lock:
            if z not in self._zygotes:
                return
            self._zygotes.remove(z)
        self._free_slot(z.slot)

    def _settle_batch(self, zygotes: list[_Zygote]) -> None:
        """Before a batch returns: every sandbox it started has ended (after the grace, killed
        with its whole cgroup); a fork server that cannot be brought to that state is replaced."""
        for z in zygotes:
            with z.lock:
                ok = z.pending is None or z.settle(block=True)
            if not ok:
                self._discard(z)

    def close(self) -> None:
        """Stop all fork servers, kill what is left in this instance's cgroups, remove them and
        give its user ids back (idempotent)."""
        self._closed = True
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        if os.getpid() == self._owner:
            self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API
    def start(self) -> dict[str, Any]:
        """Check once that this sandbox can run candidates with every protection it promises
        (raises one SandboxError naming what is missing otherwise); returns the protections."""
        self._check_fork()
        with self._start_lock:
            if not self._started:
                run = JobRun(self, _PROBE, probing=True)
                res = run.run()
                self._settle_batch(run.pending)
                if not res.all_passed:
                    raise SandboxError(f"sandbox start-up check failed: {res.tests[0].detail}")
                self.protections = dict(res.protections)
                self._started = True
        return self.protections

    def run(self, jobs: Sequence[Job], progress: Callable[[int], None] | None = None) -> list[CandidateResult]:
        """Run every job (candidate + its tests), ``workers`` at a time; results in job order.
        Every job gets a result whatever its candidate does; when this returns, no process of
        this batch is left."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        self.start()
        jobs = list(jobs)
        if not jobs:
            return []
        pending: list[_Zygote] = []
        try:
            if len(jobs) == 1 or self.workers == 1:
                out = []
                for job in jobs:
                    res, zs = self._run_job(job)
                    out.append(res)
                    pending += zs
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
                res, zs = f.result()
                results.append(res)
                pending += zs
                if progress:
                    progress(1)
            return results
        finally:
            self._settle_batch(pending)

    def run_one(self, code: str, tests: Sequence[TestCase], entry_point: str | None = None) -> CandidateResult:
        """Run one candidate (convenience wrapper around :meth:`run`)."""
        return self.run([Job(code, tuple(tests), entry_point)])[0]

    def probe(self) -> dict[str, Any]:
        """The protections this sandbox obtains (checked at start-up from inside a sandbox)."""
        return dict(self.start())

    # -- one candidate
    def _budget(self, job: Job) -> float:
        """Wall-clock ceiling of one candidate, all restarts included."""
        c = self.config
        if c.total_timeout is not None:
            return c.total_timeout
        n = len(job.tests)
        per_test = c.test_timeout if job.problem_timeout is None else min(c.test_timeout, job.problem_timeout)
        return 2 * (c.load_timeout * c.wall_factor + c.grace) + 5.0 + n * (per_test * c.wall_factor + c.grace)

    def _run_job(self, job: Job) -> tuple[CandidateResult, list[_Zygote]]:
        run = JobRun(self, job)
        try:
            return run.run(), run.pending
        except SandboxError:
            raise
        except Exception as exc:
            log.exception("vpo.sandbox: internal error while running a candidate; its remaining tests are errors")
            run.close(kill=True, discard=True)
            run.fill(Status.ERROR, f"internal sandbox error: {type(exc).__name__}: {exc}"[:500])
            return run.result(), run.pending


_VIEW_PROBED: dict[str, bool] = {}


def private_view_available(python: str | None = None) -> bool:
    """Whether a sandbox here gets a private filesystem view (so dataset files can be hidden);
    probed once per interpreter. Where not (no usable namespaces), a job with paths that must
    be hidden is refused: pass ``hide_source=False`` to the code task to accept that."""
    key = python or sys.executable
    if key not in _VIEW_PROBED:
        try:
            with Sandbox(SandboxConfig(workers=1, python=python, namespaces="auto", cgroups="auto")) as box:
                _VIEW_PROBED[key] = box.probe().get("view") == "minimal"
        except SandboxError:
            _VIEW_PROBED[key] = False
    return _VIEW_PROBED[key]

