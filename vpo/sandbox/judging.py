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
"""

from __future__ import annotations

import ast
import builtins
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from vpo.sandbox._harness import CodecError, decode_value, encode_value
from vpo.sandbox.channel import DEAD, LATE, OVER, Clock, ForkServer, Pool, Proc, Violation, ZygoteDied
from vpo.sandbox.compare import judge_value, render_value, stdout_matches
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


def expr_names(expr: str) -> tuple[list[str], list[str]]:
    """The names an ``expr`` test takes from the solution: (called as functions, read as values).
    Builtins and names the expression binds itself (comprehension variables, lambda arguments,
    ``:=`` targets) are the judge's own."""
    tree = ast.parse(expr, mode="eval")
    bound: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            bound.add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    free = {n.id for n in loads if n.id not in bound and not hasattr(builtins, n.id)}
    fns = sorted(name for name in free if all(id(n) in called for n in loads if n.id == name))
    return fns, sorted(free - set(fns))


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
        self.c_judged: list[int] = []
        self.j: Proc | None = None
        self.j_loaded = False
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
        ok = False
        try:
            if any(t.kind in ("check", "expr") for t in self.job.tests):
                self._start_judge()
            for i, test in enumerate(self.job.tests):
                if time.monotonic() >= self.hard_deadline:
                    raise _Stop(Status.TIMEOUT, "not run: candidate time budget exhausted")
                if self.budget_left is not None and self.budget_left <= 0:
                    raise _Stop(Status.TIMEOUT, "not run: the problem's time budget is exhausted")
                result = self._judge_step(i, test) if test.kind in ("check", "expr") else self._test(i, test)
                self.results[i] = self._charge(result)
            ok = True
        except _Stop as stop:
            self.fill(stop.status, stop.detail)
            ok = True
        finally:  # after an unexpected failure the fork servers' state is unknown: never reused
            self.close(kill=not ok, discard=not ok)
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

    def _charge(self, result: TestResult) -> TestResult:
        """Charge the test that just ended: its sandboxes' CPU time and this thread's."""
        _, cpu0, par0 = self.mark
        charged = max(0.0, self._cpu_now() - cpu0) + max(0.0, time.thread_time() - par0)
        if result.status is Status.TIMEOUT and result.detail in _AT_LIMIT:  # ran to its limit: all of it is spent
            charged = max(charged, self.test_limit)
        self.charged += charged
        if self.budget_left is not None:
            self.budget_left -= charged
        if result.status is Status.PASS and charged > self.test_limit + self.cfg.grace:
            result = TestResult(Status.TIMEOUT, result.runtime,
                                f"time limit exceeded: {charged:.2f} s charged (judging its output included)",
                                result.output)
        return replace(result, cpu=round(charged, 6))

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
        prelude = "" if role == "judge" else (c.prelude if job.prelude is None else job.prelude)
        return {
            "role": role,
            "code": code,
            "prelude": prelude,
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
        return None

    # -- the candidate's sandbox
    def _candidate(self) -> Proc:
        if self.c is not None:
            return self.c
        if self.rounds >= self.max_rounds:
            raise _Stop(Status.TIMEOUT, "not run: too many sandbox restarts")
        self.rounds += 1
        proc = self._spawn("candidate")
        self.c, self.c_judged = proc, []
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
        self.c_judged = []
        if proc is None:
            return ""
        self._finish(proc, kill=kill, wait=wait)
        return proc.how()

    def _void(self, reason: str) -> None:
        """The candidate's stream broke the protocol: nothing from that process counts."""
        detail = f"protocol violation: {reason}"
        for i in self.c_judged:
            self.results[i] = TestResult(Status.ERROR, 0.0, detail)
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

    def _test(self, i: int, test: TestCase) -> TestResult:
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
        self.c_judged.append(i)
        return self._judge(test, ev, time.monotonic() - self.mark[0])

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
        return self._judge_value(test, ev.get("val"), runtime)

    def _judge_value(self, test: TestCase, wire: Any, runtime: float) -> TestResult:
        try:
            value = decode_value(wire)
        except _DECODE_ERRORS as exc:
            return TestResult(Status.ERROR, runtime, f"undecodable return value: {exc}"[:500])
        c = self.cfg
        ok = judge_value(test.cmp, test.expected, value, alternatives=test.alternatives, equality=self.job.equality,
                         tol=test.tol, rel_tol=c.rel_tol, abs_tol=c.abs_tol)
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

    def _judge_step(self, i: int, test: TestCase) -> TestResult:
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
            fns, vals = expr_names(test.expr)
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
            judge.send({"expr": test.expr, "k": i, "fns": fns, "vals": values})
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
                    return self._judge_value(test, ev.get("val"), wall)
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
                return {"val": encode_value(decode_value(cev.get("val")))}, None
            except _DECODE_ERRORS as exc:
                detail = f"undecodable return value: {exc}"[:500]
                self._drop_candidate(kill=True)
                return {"died": detail}, (Status.ERROR, detail)
        if st == "timeout":
            return {"timeout": 1}, (Status.TIMEOUT, "time limit exceeded")
        etype = cev.get("etype")
        return {"exc": etype[:100] if type(etype) is str else "Exception", "msg": _text(cev.get("err"))}, None
