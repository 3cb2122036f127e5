"""The code task: programs scored per test case, one reward dimension per test.

Rows carry ``tests`` (the vpo test schema, at most ``max_tests`` per problem: the smallest
ones, as the paper keeps the <= 16 smallest LiveCodeBench tests), ``entry_point`` and
``starter_code``. :class:`CodeTestsReward` runs every answer in the sandbox
(:mod:`vpo.sandbox`) and scores ``test_i`` = 1 if test i passes, else 0; dimensions beyond a
problem's test count are NaN, so problems with different test counts batch together. The
deployment scalar w* is the mean over present tests, i.e. the pass fraction.

Sources (``source=``): the embedded problems (default, written for this project, with several
reference strategies for most problems), or a file/folder in the vpo schema or one of the
importer formats of :mod:`vpo.tasks.code_formats` (LiveCodeBench, HumanEval, MBPP, APPS/TACO,
DeepCoder), or one source per split (``{"train": ..., "test": ...}``, e.g. train on DeepCoder,
evaluate on LiveCodeBench). Splits of a single source: an explicit ``split`` field (train/test;
validation/valid/dev count as test), else ``test_after`` (ISO date, LiveCodeBench-style temporal
cut), else a deterministic hash of the problem id. With per-split sources, ``test_after`` keeps
only test problems dated on or after the cut.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import random
import string
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
from typing_extensions import TypedDict  # pydantic (which validates task parameters) needs it before 3.12

from vpo.answers import append_to_prompt, numbered_tags, parse_code_answers, python_ast_key
from vpo.rewards import VectorReward
from vpo.sandbox import Job, Sandbox, SandboxConfig, TestCase, default_hide_paths
from vpo.tasks import Task, register_task
from vpo.tasks.code_asserts import judge_settings
from vpo.tasks.code_formats import FORMATS, ImportStats, load_problems, select_tests

__all__ = [
    "EMBEDDED_PROBLEMS",
    "CodeTask",
    "CodeTestsReward",
    "SandboxParams",
    "code_instruction",
    "make_code_task",
    "row_judge",
    "row_tests",
]

log = logging.getLogger("vpo.tasks.code")

EMBEDDED_PROBLEMS = Path(__file__).resolve().parents[1] / "data" / "code" / "problems.jsonl"
DEFAULT_MAX_TESTS = 16
_TEST_SPLITS = {"test", "validation", "valid", "dev", "eval"}


Format = Literal["auto", "vpo", "livecodebench", "humaneval", "mbpp", "apps", "deepcoder"]
Equality = Literal["dataset", "exact", "tolerant"]
Prelude = Literal["dataset", "none", "competitive"]
Asserts = Literal["translate", "check"]
ProblemTimeout = float | Literal["dataset", "off"]
SourceSpec = str | dict[Literal["train", "test"], str | list[str]]


class SandboxParams(TypedDict, total=False):
    """The ``sandbox`` task parameter: any :class:`vpo.sandbox.SandboxConfig` fields."""

    test_timeout: float
    load_timeout: float
    grace: float
    total_timeout: float | None
    wall_factor: float
    memory_mb: int
    stack_mb: int
    max_processes: int
    cpus: float
    io_mbps: int | None
    io_iops: int | None
    max_open_files: int
    max_output_bytes: int
    max_value_items: int
    tmp_mb: int
    workers: int | None
    python: str | None
    site_packages: bool
    namespaces: Literal["auto", "require", "off"]
    cgroups: Literal["auto", "require", "off"]
    hide_paths: list[str]
    hide_defaults: bool
    seccomp: bool
    uid_base: int
    max_rounds: int | None
    rel_tol: float
    abs_tol: float
    prelude: str


SandboxParams.__pydantic_config__ = {"extra": "forbid"}  # type: ignore[attr-defined]  # unknown keys: an error


def row_judge(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row's judge settings (``equality``, ``prelude``, ``problem_timeout``): its ``judge``
    column (a dict or its JSON), else the defaults of the vpo schema."""
    return judge_settings(row.get("judge"), "vpo")


def row_tests(row: Mapping[str, Any]) -> list[TestCase]:
    """The tests of a row: ``row["tests"]`` as a list of schema dicts, a list of JSON strings,
    or one JSON string (how rows look after a round trip through a HF dataset)."""
    raw = row.get("tests")
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = json.loads(raw)
    out = []
    for t in raw:
        if isinstance(t, str):
            t = json.loads(t)
        out.append(t if isinstance(t, TestCase) else TestCase.from_dict(t))
    return out


def code_instruction(m: int, kind: str = "program") -> str:
    """The answer-format instruction for m programs (each a fenced python block in numbered tags)."""
    tags = numbered_tags(m, "answer")
    if m == 1:
        return f"Put your {kind} in a ```python code block inside <answer_1></answer_1>."
    return (
        f"Write {m} genuinely different solutions (different algorithms or approaches), each a complete "
        f"{kind} on its own in a ```python code block, inside numbered tags: {tags}."
    )


# --------------------------------------------------------------------------------------------
# reward


_SHARED: dict[tuple[Any, ...], Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def _shared_sandbox(config: SandboxConfig) -> Sandbox:
    """One sandbox pool per configuration and process (its fork servers are reused)."""
    key = (os.getpid(), *(getattr(config, f.name) for f in fields(config)))
    with _SHARED_LOCK:
        box = _SHARED.get(key)
        if box is None:
            box = Sandbox(config)
            _SHARED[key] = box
        return box


@atexit.register
def close_shared_sandboxes() -> None:
    """Close this process's shared sandbox pools (at exit, or when a caller is done with code rewards:
    a later reward opens a fresh pool)."""
    with _SHARED_LOCK:
        boxes = list(_SHARED.values())
        _SHARED.clear()
    for box in boxes:
        if box._owner == os.getpid():
            box.close()


class CodeTestsReward(VectorReward):
    """Per-test pass/fail vector reward for Python programs, computed in the sandbox.

    ``names`` are ``test_0 .. test_{max_tests-1}``. Answers are parsed as fenced python blocks
    (one per ``<answer_i>`` tag, or the LiveCodeBench ``---``-separated layout) and
    de-duplicated by AST. Scoring runs all answers of a call in parallel; :meth:`score_many`
    and :meth:`prefetch` batch many rollouts at once, and results are cached by (problem, exact
    program text), so identical programs across rollouts run once. The key is the text itself,
    not its syntax tree: two programs that differ only in layout can behave differently (a
    program can read its own line numbers), so neither inherits the other's verdict.
    """

    answer_tag = "answer"

    def __init__(
        self,
        max_tests: int = DEFAULT_MAX_TESTS,
        sandbox: SandboxConfig | Mapping[str, Any] | None = None,
        cache_size: int = 100_000,
        hide_paths: Sequence[str] = (),
    ) -> None:
        if max_tests < 1:
            raise ValueError(f"max_tests must be >= 1, got {max_tests}")
        self.max_tests = int(max_tests)
        self.names = tuple(f"test_{i}" for i in range(self.max_tests))
        if sandbox is None:
            cfg = SandboxConfig()
        elif isinstance(sandbox, SandboxConfig):
            cfg = sandbox
        else:
            cfg = SandboxConfig(**dict(sandbox))
        if hide_paths:
            cfg = SandboxConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)},
                                   "hide_paths": tuple(cfg.hide_paths) + tuple(hide_paths)})
        self.sandbox_config = cfg
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[tuple[str, str], tuple[bool, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"programs_run": 0, "cache_hits": 0}

    # pickling (dataloader workers, deepcopy): the pool and cache stay behind
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = OrderedDict()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def sandbox(self) -> Sandbox:
        return _shared_sandbox(self.sandbox_config)

    # -- VectorReward API
    def parse(self, completion: str, m: int) -> list[str]:
        return parse_code_answers(completion, m, self.answer_tag)

    def dedup_key(self, answer: str) -> Hashable:
        return python_ast_key(answer)

    def tests(self, row: Mapping[str, Any]) -> list[TestCase]:
        """The row's tests, at most ``max_tests`` (the smallest, in order)."""
        tests = row_tests(row)
        if len(tests) > self.max_tests:
            kept = select_tests([t.to_dict() for t in tests], self.max_tests)
            tests = [TestCase.from_dict(t) for t in kept]
        return tests

    def present(self, row: Mapping[str, Any]) -> np.ndarray:
        mask = np.zeros(self.dim, dtype=bool)
        mask[: len(self.tests(row))] = True
        return mask

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        return self.score_many([(list(answers), row)])[0]

    # -- batching
    def score_many(self, items: Sequence[tuple[Sequence[str], Mapping[str, Any]]]) -> list[np.ndarray]:
        """Score many (answers, row) pairs with one parallel sandbox batch; returns one
        (len(answers), dim) matrix per pair."""
        plans = []
        known: dict[tuple[str, str], tuple[bool, ...]] = {}
        todo: dict[tuple[str, str], Job] = {}
        for answers, row in items:
            tests = self.tests(row)
            pkey = _problem_key(row, tests)
            keys = []
            for a in answers:
                program = _program(a, row)
                key = (pkey, _program_key(program))
                keys.append(key)
                if key in known or key in todo:
                    continue
                hit = self._get(key)
                if hit is not None:
                    known[key] = hit
                else:
                    todo[key] = self._job(program, tests, row)
            plans.append((keys, len(tests)))
        if todo:
            jobs = list(todo.items())
            results = self.sandbox.run([j for _, j in jobs])
            with self._lock:
                self.stats["programs_run"] += len(jobs)
            for (key, _), res in zip(jobs, results):
                known[key] = tuple(res.passed)
                self._store(key, known[key])
        out = []
        for keys, n in plans:
            mat = np.full((len(keys), self.dim), np.nan)
            for i, key in enumerate(keys):
                mat[i, :n] = np.asarray(known[key], dtype=np.float64)
            out.append(mat)
        return out

    def _job(self, code: str, tests: Sequence[TestCase], row: Mapping[str, Any]) -> Job:
        """The sandbox job of one answer, judged by the row's settings."""
        judge = row_judge(row)
        return Job(code, tuple(tests), row.get("entry_point") or None,
                   prelude="" if judge["prelude"] == "none" else None, equality=judge["equality"],
                   problem_timeout=judge["problem_timeout"], check_code=row.get("check_code") or "")

    def prefetch(self, completions: Sequence[str], rows: Sequence[Mapping[str, Any]], m: int) -> None:
        """Run every answer of many rollouts in one parallel batch so that the per-rollout
        :func:`vpo.rewards.score_set` calls that follow are cache hits."""
        items = []
        for text, row in zip(completions, rows):
            answers = self.parse(text, m)
            if answers:
                items.append((answers, row))
        if items:
            self.score_many(items)

    # -- cache
    def _get(self, key: tuple[str, str]) -> tuple[bool, ...] | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
            return hit

    def _store(self, key: tuple[str, str], value: tuple[bool, ...]) -> None:
        with self._lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > max(self.cache_size, 1):
                self._cache.popitem(last=False)


def _problem_key(row: Mapping[str, Any], tests: Sequence[TestCase]) -> str:
    h = hashlib.sha256()
    h.update(str(row.get("id", "")).encode())
    h.update(str(row.get("entry_point") or "").encode())
    h.update(str(row.get("setup_code") or "").encode())
    h.update(str(row.get("check_code") or "").encode())
    h.update(json.dumps(row_judge(row), sort_keys=True).encode())
    h.update(json.dumps([t.to_dict() for t in tests], sort_keys=True).encode())
    return h.hexdigest()


def _program_key(program: str) -> str:
    """The cache key of a program: a digest of its exact text (every byte can change behaviour)."""
    return hashlib.sha256(program.encode("utf-8", "surrogatepass")).hexdigest()


def _program(answer: str, row: Mapping[str, Any]) -> str:
    setup = row.get("setup_code") or ""
    return f"{setup}\n{answer}" if setup.strip() else answer


# --------------------------------------------------------------------------------------------
# task


class CodeTask(Task):
    """Code problems with per-test vector rewards (see the module docstring)."""

    name = "code"

    def __init__(
        self,
        source: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        format: str = "auto",
        max_tests: int = DEFAULT_MAX_TESTS,
        min_tests: int = 1,
        test_fraction: float = 0.25,
        split_seed: int = 0,
        test_after: str | None = None,
        limit: int | None = None,
        sandbox: SandboxConfig | Mapping[str, Any] | None = None,
        hide_source: bool = True,
        equality: str = "dataset",
        prelude: str = "dataset",
        problem_timeout: float | str = "dataset",
        asserts: str = "translate",
    ) -> None:
        if not 0.0 <= test_fraction <= 1.0:
            raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
        if format != "auto" and format not in FORMATS:
            raise ValueError(f"format must be auto or one of {', '.join(FORMATS)}, got {format!r}")
        for name, value, allowed in (("equality", equality, get_args(Equality)), ("prelude", prelude, get_args(Prelude)),
                                     ("asserts", asserts, get_args(Asserts))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if not (problem_timeout in ("dataset", "off") or (isinstance(problem_timeout, (int, float))
                                                         and not isinstance(problem_timeout, bool) and problem_timeout > 0)):
            raise ValueError(f"problem_timeout must be 'dataset', 'off' or a positive number of seconds, got {problem_timeout!r}")
        # one source (split by field / date / hash) or one source per split ({train: ..., test: ...})
        self.sources: dict[str | None, list[Path]] = {}
        if isinstance(source, Mapping):
            unknown = set(source) - {"train", "test"}
            if unknown or not source:
                raise ValueError(f"a per-split source needs keys train and/or test, got {sorted(source)}")
            for split, paths in source.items():
                paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
                self.sources[split] = [Path(p).expanduser() for p in paths]
        else:
            self.sources[None] = [Path(source).expanduser() if source is not None else EMBEDDED_PROBLEMS]
        for path in (p for ps in self.sources.values() for p in ps):
            if not path.exists():
                raise FileNotFoundError(f"code task source {path} does not exist")
        self.source = next(iter(self.sources.values()))[0]
        self.format = format
        self.max_tests = int(max_tests)
        self.min_tests = int(min_tests)
        self.test_fraction = float(test_fraction)
        self.split_seed = int(split_seed)
        self.test_after = test_after
        self.limit = limit
        self.equality = equality
        self.prelude = prelude
        self.problem_timeout = problem_timeout
        self.asserts = asserts
        # the dataset files themselves, by their own paths (never a parent folder: hiding /data
        # to hide /data/x.jsonl is impossible when /data is a system folder, and too much anyway)
        hide = sorted({str(p.resolve()) for ps in self.sources.values() for p in ps}) if hide_source else []
        default_hide_paths(hide, defaults=False)  # a source that cannot be hidden: ValueError naming it
        self.reward = CodeTestsReward(max_tests=self.max_tests, sandbox=sandbox, hide_paths=hide)
        self.import_stats = ImportStats()
        self._rows: dict[str, list[dict[str, Any]]] | None = None

    def _judge(self, prob: Mapping[str, Any]) -> dict[str, Any]:
        """The problem's judge settings (its source's by default) with the task's overrides."""
        judge = dict(prob.get("judge") or judge_settings(None, prob.get("source_format") or "vpo"))
        if self.equality != "dataset":
            judge["equality"] = self.equality
        if self.prelude != "dataset":
            judge["prelude"] = self.prelude
        if self.problem_timeout == "off":
            judge["problem_timeout"] = None
        elif self.problem_timeout != "dataset":
            judge["problem_timeout"] = float(self.problem_timeout)
        return judge_settings(judge)

    # -- rows
    def _split_of(self, prob: Mapping[str, Any]) -> str:
        split = prob.get("split")
        if isinstance(split, str) and split.strip():
            s = split.strip().lower()
            if s == "train":
                return "train"
            if s in _TEST_SPLITS:
                return "test"
        if self.test_after and prob.get("date"):
            return "test" if str(prob["date"])[:10] >= self.test_after[:10] else "train"
        digest = hashlib.sha256(f"{self.split_seed}:{prob['id']}".encode()).digest()
        return "test" if int.from_bytes(digest[:8], "big") / 2**64 < self.test_fraction else "train"

    def _load_all(self) -> dict[str, list[dict[str, Any]]]:
        if self._rows is None:
            rows: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
            seen: set[str] = set()
            for fixed, paths in self.sources.items():
                for path in paths:
                    fmt = "vpo" if path == EMBEDDED_PROBLEMS else self.format
                    for prob in load_problems(path, fmt, self.import_stats, translate=self.asserts == "translate"):
                        if prob["id"] in seen:
                            raise ValueError(f"problem id {prob['id']!r} appears in two sources")
                        seen.add(prob["id"])
                        tests = select_tests(prob["tests"], self.max_tests)
                        if len(tests) < self.min_tests:
                            self.import_stats.add("dropped_few_tests")
                            continue
                        if fixed == "test" and self.test_after and prob.get("date") \
                                and str(prob["date"])[:10] < self.test_after[:10]:
                            self.import_stats.add("dropped_before_test_after")
                            continue
                        split = fixed or self._split_of(prob)
                        rows[split].append(self._row(prob, tests, split, self._judge(prob)))
            if self.limit is not None:
                rows = {k: v[: self.limit] for k, v in rows.items()}
            self._rows = rows
        return self._rows

    @staticmethod
    def _row(prob: Mapping[str, Any], tests: list[dict[str, Any]], split: str, judge: Mapping[str, Any]) -> dict[str, Any]:
        entry = prob.get("entry_point")
        starter = prob.get("starter_code") or ""
        kinds = {t["type"] for t in tests}
        parts = [prob["prompt"].strip()]
        if entry:
            where = "a method of class `Solution`" if "class Solution" in starter else "a function"
            parts.append(f"Implement `{entry}` as {where}; it is called directly and must return the result "
                         f"(do not read input or print).")
        elif kinds == {"stdio"}:
            parts.append("Read the input from standard input and print the answer to standard output.")
        if starter.strip() and "```" not in prob["prompt"]:
            parts.append(f"Starter code:\n```python\n{starter.rstrip()}\n```")
        return {
            "id": str(prob["id"]),
            "prompt": "\n\n".join(parts),
            "tests": tests,
            "n_tests": len(tests),
            "entry_point": entry or "",
            "starter_code": starter,
            "setup_code": prob.get("setup_code") or "",
            "check_code": prob.get("check_code") or "",
            "judge": json.dumps(dict(judge), sort_keys=True),
            "solutions": list(prob.get("solutions") or []),
            "title": prob.get("title") or "",
            "difficulty": prob.get("difficulty") or "",
            "split": split,
        }

    def load(self, split: str) -> list[dict[str, Any]]:
        """Rows of "train" or "test" (deterministic)."""
        if split not in ("train", "test"):
            raise ValueError(f"unknown split {split!r}; expected 'train' or 'test'")
        return [dict(r) for r in self._load_all()[split]]

    # -- prompts
    def format_prompt(self, row: Mapping[str, Any], m: int) -> Any:
        """The problem prompt followed by the m-program answer-format instruction (appended to
        the last user message, as an ADDITIONAL INSTRUCTION, for chat prompts)."""
        kind = "function" if row.get("entry_point") else "program"
        return append_to_prompt(row["prompt"], code_instruction(m, kind), chat_label="ADDITIONAL INSTRUCTION: ",
                                what="the answer-format instruction")

    # -- supervised warm-up (embedded tiny model) and tokenizer
    def demonstration(self, row: Mapping[str, Any], m: int, rng: random.Random) -> str:
        """A target completion: m reference solutions (distinct strategies first) in the format."""
        sols = [s["code"] for s in row.get("solutions") or [] if str(s.get("code", "")).strip()]
        if not sols:
            raise ValueError(f"problem {row.get('id')} has no reference solution to demonstrate")
        order = list(range(len(sols)))
        rng.shuffle(order)
        picked = [sols[order[i % len(order)]] for i in range(m)]
        return "".join(f"<answer_{i}>\n```python\n{code.rstrip()}\n```\n</answer_{i}>\n" for i, code in enumerate(picked, 1))

    def reference_answers(self, row: Mapping[str, Any]) -> list[str]:
        """Every reference solution of the problem (empty for datasets without solutions)."""
        return [s["code"] for s in row.get("solutions") or [] if str(s.get("code", "")).strip()]

    @property
    def charset(self) -> str:
        """Every character prompts and demonstrations can contain (for a char-level tokenizer)."""
        chars = set(string.printable) - {"\x0b", "\x0c", "\r"}
        for split in ("train", "test"):
            for row in self._load_all()[split]:
                chars.update(self.format_prompt(row, 3))
                chars.update(self.format_prompt(row, 1))
                for s in row.get("solutions") or []:
                    chars.update(s.get("code", ""))
        return "".join(sorted(chars))


@register_task("code")
def make_code_task(
    *,
    source: SourceSpec | None = None,
    format: Format = "auto",
    max_tests: int = DEFAULT_MAX_TESTS,
    min_tests: int = 1,
    test_fraction: float = 0.25,
    split_seed: int = 0,
    test_after: str | None = None,
    limit: int | None = None,
    sandbox: SandboxParams | None = None,
    hide_source: bool = True,
    equality: Equality = "dataset",
    prelude: Prelude = "dataset",
    problem_timeout: ProblemTimeout = "dataset",
    asserts: Asserts = "translate",
) -> CodeTask:
    """Factory for the registry: ``get_task("code", source=None, max_tests=16, ...)``.

    ``source``: a dataset file or folder, or ``{train: ..., test: ...}`` (one path or a list per
    split); None: the embedded problems. ``format``: the importer (``auto`` detects per record).
    ``max_tests`` / ``min_tests``: reward dimensions per problem / problems with fewer usable
    tests are dropped. ``test_fraction`` / ``split_seed`` / ``test_after``: the split (field,
    date cut, or hash). ``limit``: rows per split. ``sandbox``: SandboxConfig fields.
    ``hide_source``: hide the dataset files (by their own paths) from candidates; a path that
    cannot be hidden is an error naming it. Judge settings (``dataset`` = the source's own
    semantics, see docs/code_task.md): ``equality`` (``exact`` Python ``==`` or ``tolerant``:
    floats within tolerance, tuple == list), ``prelude`` (``none`` or ``competitive`` imports
    before the program), ``problem_timeout`` (seconds for all tests of a problem together, or
    ``off``: per-test limits only), ``asserts`` (``translate``: simple asserts judged in the
    parent, the rest as judge-sandbox steps; ``check``: every assert a judge-sandbox step)."""
    return CodeTask(
        source=source, format=format, max_tests=max_tests, min_tests=min_tests, test_fraction=test_fraction,
        split_seed=split_seed, test_after=test_after, limit=limit, sandbox=sandbox, hide_source=hide_source,
        equality=equality, prelude=prelude, problem_timeout=problem_timeout, asserts=asserts,
    )
