"""Judging one candidate: its tests in order, each verdict computed here from plain data.

Candidate tests (``stdio``, ``call``) run in the candidate's sandbox and are judged in this
process. Tests that are a dataset's own code (``check`` steps) and ``expr`` tests run in a second
sandbox, the judge, which reaches the candidate only through this process, with plain values:
an expression such as ``add(2, 3) == 5`` is computed on the value ``add`` returned, never in the
candidate's namespace. A test that hangs or crashes the sandbox costs only that test: the
remaining tests run in a new sandbox while the candidate's budget lasts.

Each test is charged what it cost: the CPU time of the sandboxes' process trees during the test
plus the time this thread spent reading, decoding and judging its output. A problem's budget
(``problem_timeout``) is spent in the same currency, so neither a neighbour's load nor another
candidate's oversized output can use it up.

**Judged after the candidate is gone.** A candidate test's output is only read while its process
lives; the comparison with the expected value happens once that process has ended (at the end of
the job, after a crash or timeout, or when the outputs it holds reach ``_HELD_BYTES``, when the
process is ended early and a fresh one runs the remaining tests). So the time between two calls
says nothing of how the previous one was judged, and this thread never compares while one of its
sandboxes' clocks runs. The comparison is metered: it may spend what is left of the test's own
limit, and then that test is a timeout; its cost is added to the test's charge in order, so a
problem's budget ends exactly where it would have if each test had been judged at once.
"""

from __future__ import annotations

import ast
import builtins
import functools
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from vpo.sandbox._harness import CodecError, decode_value, encode_value
from vpo.sandbox.channel import DEAD, LATE, OVER, Clock, ForkServer, Pool, Proc, Violation, ZygoteDied
from vpo.sandbox.compare import Meter, OverBudget, judge_value, render_value, stdout_verdict
from vpo.sandbox.config import (
    CandidateResult,
    Job,
    SandboxError,
    Status,
    TestCase,
    TestResult,
    refusal,
    report_protections,
)

__all__ = ["JobRun", "expr_names"]

log = logging.getLogger("vpo.sandbox")
_DECODE_ERRORS = (CodecError, ValueError, TypeError, KeyError, IndexError, RecursionError, OverflowError)


def expr_names(expr: str, judge_names: frozenset[str] = frozenset(), entry_point: str | None = None,
               ) -> tuple[list[str], list[str], list[str]]:
    """How an ``expr`` test's free names resolve: (the solution's functions, called in the
    candidate's sandbox; the solution's plain values, fetched as data; standard-library modules
    the judge imports itself). The judge's own: builtins, names the expression binds
    (comprehension variables, lambda arguments, ``:=`` targets), ``judge_names`` (what the job's
    prelude defines: ``isclose``, ``pi``, ``Counter``...) and standard-library modules used as
    ``module.attribute`` (``math.isclose``). The entry point is always the solution's; so is
    every other name. A candidate cannot supply the judge's names: a solution that defines
    ``isclose`` or ``math`` changes nothing an expression computes with them."""
    tree = ast.parse(expr, mode="eval")
    bound: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            bound.add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    bases = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    free = {n.id for n in loads if n.id not in bound and not hasattr(builtins, n.id)}
    judge = {name for name in free if name in judge_names} - {entry_point}
    mods = {name for name in free - judge if name in sys.stdlib_module_names and name != entry_point
            and all(id(n) in bases for n in loads if n.id == name)}
    free -= judge | mods
    fns = sorted(name for name in free if all(id(n) in called for n in loads if n.id == name))
    return fns, sorted(free - set(fns)), sorted(mods)


class Host(Pool, Protocol):
    """What judging needs of the sandbox (``pool.Sandbox``) beyond the pool: the paths to hide,
    the weaker modes accepted, a candidate's wall-clock ceiling, where to report protections."""

    _allow: list[str]
    _hide_defaults: list[str]
    _hide_required: list[str]
    last_protections: dict[str, Any]

    def _budget(self, job: Job) -> float: ...


def _text(value: Any, limit: int = 500) -> str:
    """A message field from a sandbox event: a string (truncated), else nothing."""
    return value[:limit] if type(value) is str else ""


class _Stop(Exception):
    """Ends a job: every test without a verdict gets ``status`` / ``detail``."""

    def __init__(self, status: Status, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _JudgeUnavailable(_Stop):
    pass


_STOPPED = {LATE: "killed at the wall-clock ceiling", OVER: "killed at the CPU time limit"}
_AT_LIMIT = {*_STOPPED.values(), "time limit exceeded"}
_HELD_BYTES = 16 << 20  # outputs of one candidate process held for judging; beyond, the process is ended early
_METER_EVERY = 4096  # units of judging work between two readings of this thread's CPU time


class _Entry:
    """One test as it ended: its verdict, or what computes it (``judge``, given a meter) once
    the candidate is gone; what it cost so far (``spent``: the sandboxes' CPU time and this
    thread's reading); the candidate process that produced it; its output's size."""

    __slots__ = ("judge", "proc", "result", "size", "spent")

    def __init__(self, result: TestResult | None = None, judge: Callable[[Meter], TestResult] | None = None,
                 proc: Proc | None = None, size: int = 0) -> None:
        self.result, self.judge, self.proc, self.size, self.spent = result, judge, proc, size, 0.0


def _meter(allowance: float) -> Meter:
    """A judging meter: raises OverBudget once this thread has spent ``allowance`` CPU seconds
    since it was made (read every ``_METER_EVERY`` units of work)."""
    end = time.thread_time() + allowance
    done = [0]

    def meter(n: int) -> None:
        done[0] += n
        if done[0] >= _METER_EVERY:
            done[0] = 0
            if time.thread_time() > end:
                raise OverBudget

    return meter


class JobRun:
    """Runs the tests of one job in order: candidate tests in the candidate sandbox, ``check``
    steps and ``expr`` tests in the judge sandbox (which calls the candidate through here).
    ``probing``: the sandbox's start-up check, where a refusal is an error, not a verdict."""

    def __init__(self, box: Host, job: Job, probing: bool = False) -> None:
        self.box = box
        self.job = job
        self.cfg = box.config
        self.probing = probing
        n = len(job.tests)
        self.results: list[TestResult | None] = [None] * n
        self.t0 = time.monotonic()
        self.hard_deadline = self.t0 + box._budget(job)
        self.budget_left = job.problem_timeout
        self.rounds = 0
        self.max_rounds = self.cfg.max_rounds or n + 1
        self.c: Proc | None = None
        self.retirements = 0  # candidate processes ended early because of the outputs they held
        self.entries: list[_Entry | None] = [None] * n
        self.settled = 0  # entries before this one have their final verdict and charge
        self.held = 0  # bytes of outputs awaiting judgement
        self.spent_total = 0.0  # final charges of the settled tests (the problem's budget, in order)
        self.j: Proc | None = None
        self.j_loaded = False
        self.j_names: frozenset[str] = frozenset()  # what the job's prelude defines, in the judge
        self.j_broken: tuple[Status, str] | None = None
        self.call_seq = 0
        self.prot: dict[str, Any] = {}
        self.needs_module = any(t.kind != "stdio" for t in job.tests)
        self.fsize = max([len(t.input.encode("utf-8", "surrogateescape")) for t in job.tests if t.kind == "stdio"] + [0])
        self.retired = 0.0  # CPU seconds of this job's sandbox processes that have ended
        self.retired_delay = 0.0  # and the time they waited for a CPU
        self.delay0 = 0.0
        self.charged = 0.0
        self.pending: list[ForkServer] = []  # fork servers whose sandbox is still ending (settled by the batch)
        self.test_limit = self.cfg.test_timeout
        self.metered_judge = False
        self.mark = (self.t0, 0.0, time.thread_time())

    # -- results
    def result(self) -> CandidateResult:
        final = tuple(r if r is not None else TestResult(Status.ERROR, 0.0, "not run") for r in self.results)
        return CandidateResult(tests=final, protections=self.prot, rounds=self.rounds, wall=time.monotonic() - self.t0,
                               cpu=round(self.charged, 6))

    def fill(self, status: Status, detail: str) -> None:
        for i, r in enumerate(self.results):
            if r is None:
                self.results[i] = TestResult(status, 0.0, detail)

    def _record(self, i: int, outcome: TestResult | _Entry) -> None:
        """Keep test ``i`` as it ended, with what it cost so far (a test that ran to its limit
        spent all of it); its verdict waits for :meth:`_settle`."""
        entry = outcome if isinstance(outcome, _Entry) else _Entry(outcome)
        _, cpu0, par0 = self.mark
        spent = max(0.0, self._cpu_now() - cpu0) + max(0.0, time.thread_time() - par0)
        r = entry.result
        if r is not None and r.status is Status.TIMEOUT and r.detail in _AT_LIMIT:
            spent = max(spent, self.test_limit)
        entry.spent = spent
        self.entries[i] = entry
        self.held += entry.size
        if self.budget_left is not None:
            self.budget_left -= spent

    def _settle(self) -> None:
        """Judge the recorded tests in order (only while no candidate process of this job runs),
        each with what is left of its own limit, and charge them: a test whose charge passes its
        limit + grace is a timeout, and once the problem's budget is spent the later tests did
        not run, exactly as if each had been judged as it ended."""
        cfg, budget = self.cfg, self.job.problem_timeout
        while self.settled < len(self.entries) and self.entries[self.settled] is not None:
            i, entry = self.settled, self.entries[self.settled]
            assert entry is not None
            self.settled += 1
            self.held -= entry.size
            limit = cfg.test_timeout if budget is None else min(cfg.test_timeout, max(budget - self.spent_total, 0.01))
            if budget is not None and self.spent_total >= budget:  # judged in turn, it would not have run
                self.results[i] = TestResult(Status.TIMEOUT, 0.0, "not run: the problem's time budget is exhausted")
                self.entries[i] = None
                continue
            result, judging = entry.result, 0.0
            if result is None:
                assert entry.judge is not None
                t0 = time.thread_time()
                try:
                    result = entry.judge(_meter(max(0.0, limit + cfg.grace - entry.spent)))
                except OverBudget:
                    result = TestResult(Status.TIMEOUT, 0.0, "time limit exceeded while judging its output")
                judging = time.thread_time() - t0
                if self.budget_left is not None:
                    self.budget_left -= judging
            charge = entry.spent + judging
            if result.status is Status.PASS and charge > limit + cfg.grace:
                result = TestResult(Status.TIMEOUT, result.runtime,
                                    f"time limit exceeded: {charge:.2f} s charged (judging its output included)",
                                    result.output)
            self.spent_total += charge
            self.charged += charge
            self.results[i] = replace(result, cpu=round(charge, 6))
            self.entries[i] = None

    def _finish(self, proc: Proc, kill: bool, discard: bool = False, wait: bool = False) -> None:
        self.retired += proc.cpu()
        self.retired_delay += proc.run_delay()
        z = proc.finish(kill=kill, discard=discard, wait=wait)
        if z is not None:
            self.pending.append(z)

    def close(self, kill: bool = False, discard: bool = False) -> None:
        for proc in (self.c, self.j):
            if proc is not None:
                self._finish(proc, kill=kill, discard=discard)
        self.c = self.j = None

    # -- driver
    def run(self) -> CandidateResult:
        ok, stop = False, None
        try:
            if any(t.kind in ("check", "expr") for t in self.job.tests):
                self._start_judge()
            for i, test in enumerate(self.job.tests):
                if time.monotonic() >= self.hard_deadline:
                    raise _Stop(Status.TIMEOUT, "not run: candidate time budget exhausted")
                if self.budget_left is not None and self.budget_left <= 0:
                    raise _Stop(Status.TIMEOUT, "not run: the problem's time budget is exhausted")
                self._record(i, self._judge_step(i, test) if test.kind in ("check", "expr") else self._test(i, test))
                if self.c is not None and self.held > _HELD_BYTES:  # end it before it holds more
                    self.retirements += 1
                    self._drop_candidate(kill=False)
                if self.c is None:  # the candidate process is gone: what it produced can be judged
                    self._settle()
            ok = True
        except _Stop as exc:
            ok, stop = True, exc
        finally:  # after an unexpected failure the fork servers' state is unknown: never reused
            self.close(kill=not ok, discard=not ok)
        self._settle()
        if stop is not None:
            self.fill(stop.status, stop.detail)
        return self.result()

    def _cpu_now(self) -> float:
        """CPU seconds of this job's sandboxes so far (the judge's only while it is measured:
        it is idle during candidate tests)."""
        live = (self.c, self.j) if self.metered_judge else (self.c,)
        return self.retired + sum(p.cpu() for p in live if p is not None)

    def _begin(self, judge: bool = False) -> tuple[float, float, float]:
        """Start charging a test: (wall start, CPU reading, this thread's CPU time)."""
        self.metered_judge = judge
        self.mark = (time.monotonic(), self._cpu_now(), time.thread_time())
        self.delay0 = self._delay_now()
        return self.mark

    def _limit(self) -> float:
        """This test's CPU time limit: the per-test limit, or what is left of the problem's budget."""
        limit = self.cfg.test_timeout
        if self.budget_left is not None:
            limit = min(limit, max(self.budget_left, 0.01))
        self.test_limit = limit
        return limit

    def _clock(self, limit: float, procs: tuple[Proc | None, ...]) -> Clock:
        """This test's limits: ``limit`` CPU seconds (+ grace), and a wall-clock ceiling of
        ``wall_factor`` times that, moved by any time the sandboxes waited for a CPU."""
        start, cpu0, _ = self.mark
        rate = sum(p.rate for p in procs if p is not None) or 1.0
        deadline = start + limit * self.cfg.wall_factor + self.cfg.grace
        delay0 = self.delay0
        return Clock(self._cpu_now, cpu0, limit + self.cfg.grace, deadline, rate, start,
                     lambda: self._delay_now() - delay0)

    def _delay_now(self) -> float:
        live = (self.c, self.j) if self.metered_judge else (self.c,)
        return self.retired_delay + sum(p.run_delay() for p in live if p is not None)

    def _payload(self, role: str) -> dict[str, Any]:
        c, job = self.cfg, self.job
        n = max(1, len(job.tests))
        code = job.check_code if role == "judge" else job.code
        prelude = c.prelude if job.prelude is None else job.prelude
        expr_prelude = prelude if role == "judge" and any(t.kind == "expr" for t in job.tests) else ""
        return {
            "role": role,
            "expr_prelude": expr_prelude,
            "code": code,
            "prelude": "" if role == "judge" else prelude,
            "needs_module": self.needs_module,
            "namespaces": c.namespaces,
            "allow": self.box._allow,
            "hide": self.box._hide_defaults,
            "hide_required": self.box._hide_required,
            "site_packages": c.site_packages,
            "seccomp": c.seccomp,
            "tmp_mb": c.tmp_mb,
            "memory_mb": c.memory_mb,
            "stack_mb": c.stack_mb,
            "cpu_seconds": math.ceil(c.load_timeout + n * c.test_timeout + 2 * c.grace) + 1,
            "fsize": max(c.max_output_bytes, self.fsize, 1 << 20) + 1,
            "max_open_files": c.max_open_files,
            "max_processes": c.max_processes,
            "max_value_items": c.max_value_items,
            "test_timeout": c.test_timeout,
            "load_timeout": c.load_timeout,
            "wall_factor": c.wall_factor,
            "max_output_bytes": c.max_output_bytes,
        }

    def _spawn(self, role: str) -> Proc:
        """Start a sandbox process; one retry with a fresh fork server when the fork server fails."""
        for attempt in range(2):
            try:
                return Proc(self.box, self._payload(role))
            except ZygoteDied as exc:
                log.warning("vpo.sandbox: fork server failed (%s); starting a new one", exc)
                if attempt == 1:
                    raise _Stop(Status.ERROR, f"sandbox fork server failed: {exc}") from None
        raise AssertionError("unreachable")

    def _await_start(self, proc: Proc, role: str) -> str | None:
        """Wait for ready + loaded. Returns None when loaded, else why not (load error...). A
        sandbox that refuses to run (a protection could not be set up) gives an ERROR naming the
        cause; configuration problems and any refusal while probing raise SandboxError."""
        start = time.monotonic()
        setup = Clock(lambda: 0.0, 0.0, math.inf, min(start + 30.0 + self.cfg.load_timeout, self.hard_deadline + 30.0), 1.0,
                      start)
        ev = proc.next_event(setup)
        if isinstance(ev, str):
            how = "timed out" if ev != DEAD else f"ended ({proc.how()})"
            log.warning("vpo.sandbox: a %s sandbox %s before it was ready", role, how)
            return f"sandbox process {how} before it was ready"
        if ev["ev"] == "fatal":
            missing = ev.get("missing")
            if isinstance(missing, list) and missing and all(isinstance(m, dict) for m in missing):
                msg = refusal([{"what": _text(m.get("what"), 40), "why": _text(m.get("why"))} for m in missing])
            else:
                msg = _text(ev.get("msg"), 2000) or "sandbox setup failed"
            if isinstance(ev.get("prot"), dict):
                self.prot = ev["prot"]
            if ev.get("config") is True or self.probing:
                raise SandboxError(msg)
            log.error("vpo.sandbox: refused to run a candidate: %s", msg)
            return f"sandbox refused to run the candidate: {msg}"
        if ev["ev"] != "ready":
            raise Violation(f"unexpected {ev['ev']!r} event")
        prot = ev.get("prot")
        if role == "candidate" and isinstance(prot, dict):
            self.prot = prot
            self.box.last_protections = prot
            report_protections(prot)
        ready_at = time.monotonic()
        cpu0, delay0 = proc.cpu(), proc.run_delay()
        load = Clock(proc.cpu, cpu0, self.cfg.load_timeout + self.cfg.grace,
                     ready_at + self.cfg.load_timeout * self.cfg.wall_factor + self.cfg.grace,
                     proc.rate, ready_at, lambda: proc.run_delay() - delay0)
        ev = proc.next_event(load)
        if ev in (LATE, OVER):
            proc.kill()
            return "timeout: timed out while loading"
        if ev == DEAD:
            return f"sandbox process died while loading ({proc.how()})"
        assert isinstance(ev, dict)
        if ev["ev"] == "load_error":
            return f"load error: {_text(ev.get('msg'))}"  # the candidate's module may have written it
        if ev["ev"] != "loaded":
            raise Violation(f"unexpected {ev['ev']!r} event")
        names = ev.get("names")
        if role == "judge" and isinstance(names, list):
            self.j_names = frozenset(n for n in names if type(n) is str)
        return None

    # -- the candidate's sandbox
    def _candidate(self) -> Proc:
        if self.c is not None:
            return self.c
        if self.rounds - self.retirements >= self.max_rounds:
            raise _Stop(Status.TIMEOUT, "not run: too many sandbox restarts")
        self.rounds += 1
        proc = self._spawn("candidate")
        self.c = proc
        try:
            why = self._await_start(proc, "candidate")
        except Violation as exc:
            self._void(str(exc))
        if why is not None:
            self._drop_candidate(kill=True)
            status = Status.TIMEOUT if why.startswith("timeout:") else Status.ERROR
            raise _Stop(status, why.removeprefix("timeout: "))
        return proc

    def _drop_candidate(self, kill: bool, wait: bool = False) -> str:
        proc, self.c = self.c, None
        if proc is None:
            return ""
        self._finish(proc, kill=kill, wait=wait)
        return proc.how()

    def _void(self, reason: str) -> None:
        """The candidate's stream broke the protocol: nothing from that process counts."""
        detail = f"protocol violation: {reason}"
        for entry in self.entries:
            if entry is not None and entry.proc is not None and entry.proc is self.c:
                entry.result, entry.judge = TestResult(Status.ERROR, 0.0, detail), None
        self._drop_candidate(kill=True)
        raise _Stop(Status.ERROR, detail)

    def _ask(self, req: dict[str, Any], clock: Clock) -> dict[str, Any] | TestResult:
        """Send one request to the candidate's sandbox; its ``end`` event, or the verdict when it
        timed out or died."""
        proc = self._candidate()
        proc.send(req)
        try:
            ev = proc.next_event(clock)
            if isinstance(ev, dict) and not (ev["ev"] == "end" and type(ev.get("i")) is int and ev["i"] == req["i"]):
                raise Violation(f"unexpected {ev['ev']!r} event")
        except Violation as exc:
            self._void(str(exc))
        wall = time.monotonic() - self.mark[0]
        if ev in (LATE, OVER):
            self._drop_candidate(kill=True)
            return TestResult(Status.TIMEOUT, wall, _STOPPED[ev])
        if ev == DEAD:
            how = self._drop_candidate(kill=True, wait=True)
            return TestResult(Status.ERROR, wall, f"sandbox process died during the test ({how})")
        assert isinstance(ev, dict)
        return ev

    def _test(self, i: int, test: TestCase) -> TestResult | _Entry:
        proc = self._candidate()
        self._begin()
        limit = self._limit()
        req: dict[str, Any] = {"i": i, "kind": test.kind, "timeout": limit, "wall": limit * self.cfg.wall_factor}
        if test.kind == "stdio":
            req["input"] = test.input
        else:
            req["fn"] = self.job.entry_point
            req["args"] = encode_value(list(test.args))
        ev = self._ask(req, self._clock(limit, (proc,)))
        if isinstance(ev, TestResult):
            return ev
        wall = time.monotonic() - self.mark[0]
        if ev.get("st") != "ok":  # an error or the candidate's own alarm: no comparison to make
            return _Entry(self._judge(test, ev, wall), proc=proc)
        return _Entry(judge=functools.partial(self._judge, test, ev, wall), proc=proc, size=proc.last_size)

    def _judge(self, test: TestCase, ev: Mapping[str, Any], wall: float, meter: Meter | None = None) -> TestResult:
        """The verdict of one result event; total: whatever the event holds, a TestResult (but
        the meter's OverBudget, which stops judging)."""
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
            why = stdout_verdict(test.expected, out, c.rel_tol, c.abs_tol, meter)
            return TestResult(Status.FAIL if why else Status.PASS, runtime, why or "", render_value(out))
        return self._judge_value(test, ev.get("val"), runtime, meter)

    def _judge_value(self, test: TestCase, wire: Any, runtime: float, meter: Meter | None = None) -> TestResult:
        try:
            value = decode_value(wire)
        except _DECODE_ERRORS as exc:
            return TestResult(Status.ERROR, runtime, f"undecodable return value: {exc}"[:500])
        c = self.cfg
        ok = judge_value(test.cmp, test.expected, value, alternatives=test.alternatives, equality=self.job.equality,
                         tol=test.tol, rel_tol=c.rel_tol, abs_tol=c.abs_tol, meter=meter)
        return TestResult(Status.PASS if ok else Status.FAIL, runtime, "" if ok else "wrong value", render_value(value))

    # -- the judge's sandbox
    def _start_judge(self) -> None:
        try:
            self.j = self._spawn("judge")
        except _Stop as stop:
            self.j_broken = (stop.status, stop.detail)

    def _judge_proc(self) -> Proc:
        if self.j_broken is not None:
            raise _JudgeUnavailable(*self.j_broken)
        if self.j is None:
            self._start_judge()
            return self._judge_proc()
        if not self.j_loaded:
            try:
                why = self._await_start(self.j, "judge")
            except Violation as exc:
                why = f"judge protocol violation: {exc}"
            if why is not None:
                self._break_judge(Status.ERROR, f"judge failed to start: {why}")
                return self._judge_proc()
            self.j_loaded = True
        return self.j

    def _break_judge(self, status: Status, detail: str) -> None:
        self.j_broken = (status, detail)
        if self.j is not None:
            self._finish(self.j, kill=True)
            self.j = None

    def _judge_step(self, i: int, test: TestCase) -> TestResult | _Entry:
        """A ``check`` step (the dataset's own test code) or an ``expr`` test, run by the judge."""
        try:
            judge = self._judge_proc()
        except _JudgeUnavailable as exc:
            self._begin()
            return TestResult(exc.status, 0.0, exc.detail)
        proc = self._candidate()
        start, _, _ = self._begin(judge=True)
        limit = self._limit()
        clock = self._clock(limit, (proc, judge))
        if test.kind == "check":
            fns, final = [self.job.entry_point], ("step", test.step)
            judge.send({"step": test.step})
        else:
            fns, vals, mods = expr_names(test.expr, self.j_names, self.job.entry_point)
            values: Any = {}
            if vals:  # the solution's plain values the expression reads, fetched as data
                self.call_seq -= 1
                ev = self._ask({"i": self.call_seq, "kind": "get", "names": vals, "timeout": limit,
                                "wall": limit * self.cfg.wall_factor}, clock)
                if isinstance(ev, TestResult):
                    return ev
                if ev.get("st") != "ok":
                    return self._judge(test, ev, time.monotonic() - start)
                try:
                    values = encode_value(decode_value(ev.get("val")))
                except _DECODE_ERRORS as exc:
                    return TestResult(Status.ERROR, time.monotonic() - start, f"undecodable value: {exc}"[:500])
            final = ("value", i)
            judge.send({"expr": test.expr, "k": i, "fns": fns, "vals": values, "mods": mods})
        override: tuple[Status, str] | None = None
        while True:
            try:
                ev = judge.next_event(clock)
            except Violation as exc:
                self._break_judge(Status.ERROR, f"judge protocol violation: {exc}")
                return TestResult(Status.ERROR, time.monotonic() - start, self.j_broken[1])
            wall = time.monotonic() - start
            if ev in (LATE, OVER):
                self._break_judge(Status.TIMEOUT, "judge stopped at the time limit of an earlier step")
                return TestResult(Status.TIMEOUT, wall, _STOPPED[ev])
            if ev == DEAD:
                self._break_judge(Status.ERROR, "judge process died in an earlier step")
                return TestResult(Status.ERROR, wall, f"judge process died ({judge.how()})")
            assert isinstance(ev, dict)
            if ev["ev"] == "call":
                fn = ev.get("fn", self.job.entry_point if test.kind == "check" else None)
                if fn not in fns:
                    self._break_judge(Status.ERROR, "judge protocol violation: a call of an unknown function")
                    return TestResult(Status.ERROR, wall, self.j_broken[1])
                if override is not None:  # the candidate already timed out or died in this step
                    reply = {"timeout": 1} if override[0] is Status.TIMEOUT else {"died": override[1]}
                else:
                    reply, override = self._forward(ev, fn, clock)
                if override is not None and override[0] is Status.TIMEOUT:  # let the judge report the step
                    clock.deadline = max(clock.deadline, time.monotonic() + 2.0)
                    clock.cpu = max(clock.cpu, clock.used() + 1.0)
                judge.send(reply)
                continue
            if ev["ev"] == final[0] and type(ev.get("k")) is int and ev["k"] == final[1]:
                if override is not None:
                    return TestResult(override[0], wall, override[1])
                st = ev.get("st")
                if test.kind == "expr" and st == "ok":
                    wire = ev.get("val")
                    return _Entry(judge=functools.partial(self._judge_value, test, wire, wall), size=judge.last_size)
                status = {"ok": Status.PASS, "fail": Status.FAIL, "timeout": Status.TIMEOUT}.get(st, Status.ERROR)
                return TestResult(status, wall, _text(ev.get("err")))
            self._break_judge(Status.ERROR, f"judge protocol violation: unexpected {ev['ev']!r} event")
            return TestResult(Status.ERROR, wall, self.j_broken[1])

    def _forward(self, ev: Mapping[str, Any], fn: str, clock: Clock) -> tuple[dict[str, Any], tuple[Status, str] | None]:
        """Run one call the judge made in the candidate's sandbox; returns the reply for the judge
        and, when the candidate timed out or died, the step's verdict."""
        self.call_seq -= 1  # judge calls are numbered -1, -2...: a stale or forged answer cannot match
        left = max(0.01, clock.cpu - self.cfg.grace - clock.used())
        req: dict[str, Any] = {"i": self.call_seq, "kind": "call", "fn": fn, "args": ev.get("args", []),
                               "timeout": left, "wall": max(0.01, clock.deadline - time.monotonic() - self.cfg.grace)}
        if ev.get("kw"):
            req["kw"] = ev["kw"]
        if ev.get("sync"):
            req["sync"] = 1
        try:
            self._candidate()
        except _Stop as stop:
            return {"died": stop.detail}, (stop.status, stop.detail)
        cev = self._ask(req, clock)  # a protocol violation ends the job (nothing of that process counts)
        if isinstance(cev, TestResult):
            return ({"timeout": 1} if cev.status is Status.TIMEOUT else {"died": cev.detail}), (cev.status, cev.detail)
        st = cev.get("st")
        if st == "ok":
            try:  # the judge gets plain data re-encoded here: bounded, whatever the event held
                reply = {"val": encode_value(decode_value(cev.get("val")))}
                if req.get("sync") and "args" in cev:  # the arguments as the call left them (in-place tasks)
                    reply["args"] = encode_value(decode_value(cev["args"]))
                return reply, None
            except _DECODE_ERRORS as exc:
                detail = f"undecodable return value: {exc}"[:500]
                self._drop_candidate(kill=True)
                return {"died": detail}, (Status.ERROR, detail)
        if st == "timeout":
            return {"timeout": 1}, (Status.TIMEOUT, "time limit exceeded")
        etype = cev.get("etype")
        return {"exc": etype[:100] if type(etype) is str else "Exception", "msg": _text(cev.get("err"))}, None
