"""Sandbox throughput: test executions per second, ours vs a naive one-process-per-test runner.

The batch is ``--candidates`` programs x ``--tests`` trivial function-call tests (default the
issue's 200 x 10). Both runners use the same interpreter, the same number of parallel workers
(default: all usable cores) and compare outputs in the parent. The naive runner starts one
``python -I -S`` per test (which sets its own rlimits) with a timeout, and nothing else: no
namespaces, no read-only root, i.e. it is the *cheapest* per-test runner, not a sandboxed one;
``--naive-sandboxed`` adds a second baseline, our own sandbox used one test per process.

    .venv/bin/python benchmarks/sandbox.py            # full run
    .venv/bin/python benchmarks/sandbox.py --quick    # 40 x 10, for CI smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vpo.sandbox import Job, Sandbox, SandboxConfig, TestCase

NAIVE_DRIVER = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
resource.setrlimit(resource.RLIMIT_CPU, (5, 6))
spec = json.loads(sys.stdin.read())
ns = {"__name__": "__solution__"}
exec(spec["code"], ns)
print(json.dumps(ns[spec["fn"]](*spec["args"])))
"""


def make_batch(n_candidates: int, n_tests: int) -> list[Job]:
    """Distinct trivial candidates (a few strategies, some wrong) with call tests."""
    bodies = [
        "def f(a, b):\n    return a + b\n",
        "def f(a, b):\n    return sum([a, b])\n",
        "def f(a, b):\n    s = a\n    s += b\n    return s\n",
        "def f(a, b):\n    return a - b\n",  # wrong
    ]
    jobs = []
    for c in range(n_candidates):
        code = f"# candidate {c}\n" + bodies[c % len(bodies)]
        tests = tuple(TestCase.call([c, t], c + t) for t in range(n_tests))
        jobs.append(Job(code, tests, "f"))
    return jobs


def naive_run(jobs: list[Job], workers: int, python: str) -> list[list[bool]]:
    """One fresh interpreter per test."""

    def one(job: Job, test: TestCase) -> bool:
        spec = json.dumps({"code": job.code, "fn": job.entry_point, "args": list(test.args)})
        try:
            proc = subprocess.run(
                [python, "-I", "-S", "-c", NAIVE_DRIVER],
                input=spec,
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
                env={"PATH": "/usr/bin:/bin"},
            )
        except subprocess.TimeoutExpired:
            return False
        if proc.returncode != 0:
            return False
        try:
            return json.loads(proc.stdout) == test.expected
        except ValueError:
            return False

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [[pool.submit(one, job, t) for t in job.tests] for job in jobs]
        return [[f.result() for f in row] for row in futures]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", type=int, default=200)
    ap.add_argument("--tests", type=int, default=10)
    ap.add_argument("--workers", type=int, default=None, help="parallel workers (default: usable cores)")
    ap.add_argument("--quick", action="store_true", help="40 candidates, for smoke tests")
    ap.add_argument("--naive-sandboxed", action="store_true", help="also time our sandbox with one test per process")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    if args.quick:
        args.candidates = 40
    workers = args.workers or len(os.sched_getaffinity(0))
    jobs = make_batch(args.candidates, args.tests)
    n_exec = args.candidates * args.tests
    expected = [[c % 4 != 3 or t == 0 for t in range(args.tests)] for c in range(args.candidates)]  # a - b == a + b iff b == 0

    with Sandbox(SandboxConfig(workers=workers)) as sb:
        prot = sb.probe()  # start-up (fork servers) is not part of the timed batch
        sb.run(jobs[: 2 * workers])  # warm every worker
        t0 = time.perf_counter()
        results = sb.run(jobs)
        t_ours = time.perf_counter() - t0
        ours_ok = [r.passed for r in results] == expected
        t_naive_sb = None
        if args.naive_sandboxed:
            single = [Job(j.code, (t,), j.entry_point) for j in jobs for t in j.tests]
            t0 = time.perf_counter()
            sb.run(single)
            t_naive_sb = time.perf_counter() - t0

    python = os.path.realpath(sys.executable)
    t0 = time.perf_counter()
    naive = naive_run(jobs, workers, python)
    t_naive = time.perf_counter() - t0
    naive_ok = naive == expected

    out = {
        "candidates": args.candidates,
        "tests_per_candidate": args.tests,
        "workers": workers,
        "isolation": prot.get("mode"),
        "ours_seconds": round(t_ours, 3),
        "ours_execs_per_s": round(n_exec / t_ours, 1),
        "naive_seconds": round(t_naive, 3),
        "naive_execs_per_s": round(n_exec / t_naive, 1),
        "speedup": round(t_naive / t_ours, 2),
        "verdicts_correct": ours_ok and naive_ok,
    }
    if t_naive_sb is not None:
        out["naive_sandboxed_execs_per_s"] = round(n_exec / t_naive_sb, 1)
        out["speedup_vs_naive_sandboxed"] = round(t_naive_sb / t_ours, 2)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"batch: {args.candidates} candidates x {args.tests} tests = {n_exec} test executions, "
              f"{workers} workers, isolation={out['isolation']}, load avg {os.getloadavg()[0]:.2f}")
        print(f"  ours : {out['ours_seconds']:8.3f} s  {out['ours_execs_per_s']:9.1f} execs/s")
        print(f"  naive: {out['naive_seconds']:8.3f} s  {out['naive_execs_per_s']:9.1f} execs/s  (one interpreter per test)")
        if t_naive_sb is not None:
            print(f"  naive sandboxed: {out['naive_sandboxed_execs_per_s']:9.1f} execs/s  (our sandbox, one test per process)")
        print(f"  speedup: {out['speedup']}x   verdicts correct: {out['verdicts_correct']}")
    return out


if __name__ == "__main__":
    main()
