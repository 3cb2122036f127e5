"""Hostile candidates against the batch they run in: each tries to change a neighbour's verdict,
take the host's view, carry information to another sandbox, fool the judge, or outlive its batch.

One class per attack, each with its own containment check; the honest candidates run in the same
batch and must keep their verdicts. ``tests/test_sandbox_isolation.py`` runs every class once;
``benchmarks/sandbox_attacks.py`` runs every class N times beside a load and prints a table.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from vpo.sandbox import CandidateResult, Job, SandboxConfig, Status, TestCase

__all__ = ["CONFIG", "HONEST", "HOSTILE", "LEFTOVER", "Hostile", "check_batch", "forge"]

# the limits of the batch: small memory, so the memory attacks are cheap to run
CONFIG = SandboxConfig(test_timeout=1.0, load_timeout=2.0, grace=0.3, memory_mb=256, max_processes=4, workers=2)
MEMORY = CONFIG.memory_mb << 20
TOKEN = "EXPECTED-only-the-parent-knows"


def _job(code: str, *tests: TestCase, **kw: object) -> Job:
    return Job(textwrap.dedent(code), tests, "f", **kw)


def _t(*args: object, expected: object = TOKEN, **kw: object) -> TestCase:
    return TestCase.call(list(args), expected, **kw)


def forge(data: str) -> str:
    """A candidate that writes the bytes of Python expression ``data`` on every descriptor that
    might be the result channel, then returns its argument."""
    return textwrap.dedent(f"""
        import os
        def f(x):
            data = {data}
            for fd in range(3, 12):
                try:
                    os.write(fd, data)
                except OSError:
                    pass
            return x
    """)


def _out(r: CandidateResult, i: int = 0) -> object:
    try:
        return json.loads(r.tests[i].output.replace("'", '"'))
    except ValueError:
        return r.tests[i].output


@dataclass(frozen=True)
class Hostile:
    """An attack: its job, and a check that says None when it was contained, else what escaped."""

    name: str
    job: Job
    check: Callable[[CandidateResult], str | None]


def _status(*allowed: Status, detail: str = "", or_timeout: bool = False) -> Callable[[CandidateResult], str | None]:
    """The first test ended with one of ``allowed`` and ``detail`` in its message (or, with
    ``or_timeout``, ran out of its own time first: building a huge value is charged to it)."""
    def check(r: CandidateResult) -> str | None:
        t = r.tests[0]
        if or_timeout and t.status is Status.TIMEOUT:
            return None
        if t.status not in allowed or detail not in t.detail:
            return f"{t.status.value}: {t.detail[:120]}"
        return None

    return check


def _all_refused(r: CandidateResult) -> str | None:
    """The candidate returned a list of outcomes; each must be EPERM (1) or EACCES (13)."""
    out = _out(r)
    if r.tests[0].status is Status.PASS or not isinstance(out, list) or not out or any(x not in (1, 13) for x in out):
        return f"{r.tests[0].status.value}: {r.tests[0].output[:200]}"
    return None


def _held_at_most(limit: int) -> Callable[[CandidateResult], str | None]:
    """Killed at the memory limit, or reported holding at most ``limit`` bytes."""
    def check(r: CandidateResult) -> str | None:
        t = r.tests[0]
        if t.status is Status.PASS:
            return "passed"
        if t.status is Status.ERROR:
            return None if ("memory" in t.detail or "MemoryError" in t.detail) else f"error: {t.detail[:120]}"
        held = _out(r)
        return None if isinstance(held, int) and held <= limit else f"held {held} bytes (limit {limit})"

    return check


def _budget_spent(r: CandidateResult) -> str | None:
    if r.all_passed or not any("budget" in t.detail for t in r.tests):
        return f"{[t.status.value for t in r.tests]} charged {r.cpu:.2f}s"
    return None


def _not_passed(r: CandidateResult) -> str | None:
    return None if not r.tests[0].passed else "passed"


_LOCKS = """
import errno, fcntl, os, struct
def f(x):
    out = []
    fd = os.open('/etc/os-release' if os.path.exists('/etc/os-release') else '/etc/passwd', os.O_RDONLY)
    for op in OPS:
        try:
            op(fd)
            out.append('done')
        except OSError as e:
            out.append(e.errno)
    return out
"""
_LOCK = "struct.pack('hhqqi', fcntl.F_RDLCK, 0, 7, 1, 0)"
_SWALLOW = ("def __vpo_steps__(candidate):\n    try:\n        assert all(map(lambda x: candidate(x) == 2 * x, range(10)))\n"
            "    except BaseException as e:\n        yield e\n    else:\n        yield None\n")
_BIG = [[i] for i in range(300_000)]
_PYCACHE = "os.path.join(os.path.dirname(os.__file__), '__pycache__')"

HOSTILE: list[Hostile] = [
    # --- the parent must not be stalled, and its time on a candidate is that candidate's
    Hostile("parent_stall_forged_31mb",  # a result under the size cap that takes seconds to parse
            _job(forge("""b'{"ev": "end", "i": 0, "st": "ok", "t": 0.0, "val": [' + b'1,' * (15 << 20) + b'1]}\\n'"""),
                 _t(0)), _status(Status.ERROR, detail="protocol violation", or_timeout=True)),
    Hostile("oversized_value", _job("def f(x):\n    return list(range(2_000_000))\n", _t(0)),
            _status(Status.ERROR, detail="too large", or_timeout=True)),
    Hostile("slow_to_decode_budget", _job("def f(x):\n    return [[i] for i in range(300_000)]\n",
                                          *[_t(i, expected=_BIG) for i in range(8)], problem_timeout=0.5,
                                          equality="exact"), _budget_spent),
    # --- CPU: threads and children are charged to the candidate, and capped at its quota
    Hostile("cpu_gil_free_threads", _job("""
        import hashlib, threading
        threading.stack_size(1 << 20)
        BUF = b'x' * (8 << 20)
        def spin():
            while True:
                hashlib.sha256(BUF).digest()
        def f(x):
            for _ in range(3):
                threading.Thread(target=spin, daemon=True).start()
            spin()
        """, _t(0)), _status(Status.TIMEOUT)),
    Hostile("cpu_in_child_processes", _job("""
        import os
        def f(x):
            kids = []
            for _ in range(3):
                pid = os.fork()
                if pid == 0:
                    while True:
                        pass
                kids.append(pid)
            for k in kids:
                os.waitpid(k, 0)
        """, _t(0)), _status(Status.TIMEOUT)),
    Hostile("sleeps_past_the_ceiling", _job("import time\ndef f(x):\n    time.sleep(60)\n", _t(0)), _status(Status.TIMEOUT)),
    # --- memory: one limit for the whole sandbox, tmpfs, shared memory and memfds included
    Hostile("memory_tmpfs_shm_memfd", _job("""
        import ctypes, os
        def f(x):
            held, keep = 0, []
            for d in ('/tmp', '/dev/shm'):  # files of 3 MiB (each file is under the file-size limit)
                for k in range(20):
                    try:
                        with open(f'{d}/fill{k}', 'wb') as fh:
                            fh.write(b'z' * (3 << 20))
                        held += 3 << 20
                    except OSError:
                        break
            for _ in range(40):  # memfds: no file system, no address space
                try:
                    fd = os.memfd_create('fill')
                    os.write(fd, b'm' * (3 << 20))
                    keep.append(fd)
                    held += 3 << 20
                except OSError:
                    break
            libc = ctypes.CDLL(None, use_errno=True)  # System V shared memory: kept after it is detached
            libc.shmat.restype = ctypes.c_void_p
            for _ in range(4):
                sid = libc.shmget(0, 50 << 20, 0o1600)
                if sid < 0:
                    break
                addr = libc.shmat(sid, None, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    break
                ctypes.memset(addr, 1, 50 << 20)
                libc.shmdt(ctypes.c_void_p(addr))
                held += 50 << 20
            return held
        """, _t(0)), _held_at_most(MEMORY)),
    Hostile("memory_across_processes", _job("""
        import os, select, time
        def f(x):
            kids, r, w = [], *os.pipe()
            for _ in range(3):  # each under the per-process limit, together over the sandbox's
                pid = os.fork()
                if pid == 0:
                    block = bytearray(100 << 20)
                    for i in range(0, len(block), 4096):
                        block[i] = 1
                    os.write(w, str(os.getpid()).encode() + b' ')
                    time.sleep(30)
                    os._exit(0)
                kids.append(pid)
            def dead(k):
                if k not in gone:
                    try:
                        if os.waitpid(k, os.WNOHANG) != (0, 0):
                            gone.add(k)
                    except ChildProcessError:
                        gone.add(k)
                return k in gone
            done, gone, end = set(), set(), time.monotonic() + 2.0
            while time.monotonic() < end and len(done | gone) < 3:
                if select.select([r], [], [], 0.05)[0]:
                    done |= {int(p) for p in os.read(r, 100).split()}
                for k in kids:
                    dead(k)
            time.sleep(0.2)
            return sum(1 for k in done if not dead(k)) * (100 << 20)  # memory proven touched and still held
        """, _t(0)), _held_at_most(MEMORY)),
    # --- nothing outlives its batch (checked for the whole batch: Sandbox.processes() is empty)
    Hostile("lingers_with_patched_exit", _job("""
        import os, signal, sys, time
        def _stay(*a, **k):
            time.sleep(600)
        os._exit = _stay
        sys.modules['__main__']._os_exit = _stay
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        def f(x):
            return x
        """, _t(3, expected=3)), lambda r: None),
    Hostile("lingers_as_a_daemon", _job("""
        import ctypes, os, signal, time
        def f(x):
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    signal.signal(signal.SIGHUP, signal.SIG_IGN)
                    time.sleep(600)
                os._exit(0)
            return x
        """, _t(4, expected=4)), lambda r: None),
    # --- the judge computes on plain data and a candidate exception fails its step
    Hostile("expr_eq_always_true", _job("""
        class Yes(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def f(a, b):
            return Yes(0)
        """, TestCase.expression("f(2, 3) == 5", True, cmp="is"), equality="exact"), _status(Status.FAIL)),
    Hostile("stopiteration_swallowed_by_map", Job("def f(x):\n    raise StopIteration\n", (TestCase.check(0, "all(map)"),), "f",
                                                  check_code=_SWALLOW),
            _status(Status.ERROR, detail="the candidate raised StopIteration")),
    # --- no lock or watch on a file every sandbox sees can carry information between them
    Hostile("lock_channel_ofd", _job(_LOCKS.replace("OPS", f"[lambda fd: fcntl.fcntl(fd, 37, {_LOCK}), "
                                                           f"lambda fd: fcntl.fcntl(fd, 36, {_LOCK})]"), _t(0)), _all_refused),
    Hostile("lock_channel_posix", _job(_LOCKS.replace("OPS", "[lambda fd: fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB), "
                                                             f"lambda fd: fcntl.fcntl(fd, fcntl.F_GETLK, {_LOCK})]"), _t(0)),
            _all_refused),
    Hostile("lock_channel_flock", _job(_LOCKS.replace("OPS", "[lambda fd: fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)]"),
                                       _t(0)), _all_refused),
    Hostile("lease_channel", _job(_LOCKS.replace("OPS", "[lambda fd: fcntl.fcntl(fd, 1024, fcntl.F_RDLCK), "
                                                        "lambda fd: fcntl.fcntl(fd, 1025)]"), _t(0)), _all_refused),
    Hostile("watch_channel_inotify", _job(f"""
        import ctypes, os
        def f(x):
            libc = ctypes.CDLL(None, use_errno=True)
            out = []
            for name, args in (('inotify_init1', (0,)), ('inotify_init', ())):
                if not hasattr(libc, name):
                    continue
                fd = getattr(libc, name)(*args)
                out.append(ctypes.get_errno() if fd < 0 else 'watching')
                if fd >= 0:
                    out.append(libc.inotify_add_watch(fd, {_PYCACHE}.encode(), 0xFFF))
            return out
        """, _t(0)), _all_refused),
    Hostile("watch_channel_dnotify", _job(f"""
        import fcntl, os
        def f(x):
            fd = os.open({_PYCACHE} if os.path.isdir({_PYCACHE}) else os.path.dirname(os.__file__), os.O_RDONLY)
            try:
                fcntl.fcntl(fd, 1026, -0x7FFFFFFD)  # F_NOTIFY, DN_MULTISHOT | DN_ACCESS | DN_MODIFY
                return ['watching']
            except OSError as e:
                return [e.errno]
        """, _t(0)), _all_refused),
    # --- the cgroup and the OOM killer are the host's to configure
    Hostile("cgroup_escape", _job("""
        import os
        def f(x):
            out = []
            for p in ('/sys/fs/cgroup/cgroup.procs', '/sys/fs/cgroup/memory/cgroup.procs', '/sys/fs/cgroup/pids/tasks',
                      '/proc/self/oom_score_adj'):
                try:
                    with open(p, 'w') as fh:
                        fh.write('-1000' if 'oom' in p else '0')
                    out.append('wrote ' + p)
                except OSError as e:
                    out.append(e.errno)
            return out
        """, _t(0)), lambda r: None if "wrote" not in r.tests[0].output and not r.tests[0].passed
            else r.tests[0].output[:200]),
]

# honest candidates in every batch: their verdicts must not change, whatever their neighbours do
HONEST: dict[str, Job] = {
    "honest_cpu_bound": _job("def f(n):\n    s = 0\n    for i in range(n):\n        s += i * i\n    return s\n",
                             *[_t(n, expected=(n - 1) * n * (2 * n - 1) // 6) for n in range(600_000, 600_004)]),
    "honest_problem_budget": _job("def f(x):\n    return -x\n", *[_t(i, expected=-i) for i in range(8)], problem_timeout=1.0),
    "honest_stdout_with_commas": Job("print(','.join(map(str, range(150_000))))\n",
                                     (TestCase.stdio("", ",".join(map(str, range(150_000)))),)),
    "honest_big_value": _job("def f(n):\n    return list(range(n))\n", _t(100_000, expected=list(range(100_000)))),
    "honest_expr": _job("def f(a, b):\n    return a + b\n", TestCase.expression("f(2, 3) == 5", True, cmp="is"),
                        TestCase.expression("[f(i, i) for i in range(3)]", [0, 2, 4]), equality="exact"),
    "honest_judge": Job("def f(x):\n    return 2 * x\n", (TestCase.check(0, "all(map)"),), "f", check_code=_SWALLOW),
}


LEFTOVER = "(nothing of the batch left after run())"


def check_batch(names: list[str], results: list[CandidateResult], leftover: list[int]) -> dict[str, str | None]:
    """name -> None (contained / verdict unchanged) or what went wrong, for one batch; the
    ``LEFTOVER`` entry: processes of the batch still alive after ``run()`` returned."""
    out: dict[str, str | None] = {}
    by_name = {h.name: h for h in HOSTILE}
    for name, r in zip(names, results):
        if name in HONEST:
            out[name] = None if r.all_passed else "; ".join(f"{t.status.value} {t.detail[:80]}" for t in r.tests
                                                              if not t.passed)
        else:
            out[name] = by_name[name].check(r)
    out[LEFTOVER] = f"processes left: {leftover}" if leftover else None
    return out
