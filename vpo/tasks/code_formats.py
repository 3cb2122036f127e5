"""Code-problem datasets: the vpo JSONL/parquet schema and importers for common formats.

Every loader returns problems in one canonical form (documented in docs/code_task.md)::

    {"id": str, "prompt": str, "tests": [test, ...], "entry_point": str | None,
     "starter_code": str, "setup_code": str, "check_code": str, "judge": {...},
     "solutions": [{"strategy": str, "code": str}], "split": str | None, "date": str | None,
     "difficulty": str | None, "title": str | None, "source_format": str}

with each test one of ``{"type": "stdio", "input", "output"}``, ``{"type": "call", "args",
"expected"[, "cmp", "alternatives", "tol"]}``, ``{"type": "expr", "expr", "expected", ...}`` or
``{"type": "check", "step", "text"}`` (a statement of the dataset's own test code, run from
``check_code`` in a judge sandbox). ``judge`` holds how the source judges: ``equality`` (exact
Python ``==`` or tolerant), ``prelude`` (none, or the competitive-programming imports) and
``problem_timeout`` (one time limit per problem, or none); see :data:`JUDGE_DEFAULTS`.

Importers (auto-detected per record, or forced with ``fmt=``):

* ``vpo``: the schema above.
* ``livecodebench``: ``question_content``, ``starter_code``, ``public_test_cases`` /
  ``private_test_cases`` (JSON strings, or base64+zlib-compressed as in the LCB release; a
  pickled payload is read with an unpickler that refuses every global, so it cannot run code),
  ``metadata`` with ``func_name`` for functional problems (inputs: one JSON value per line).
* ``humaneval``: ``prompt``, ``test`` (a ``check(candidate)`` function), ``entry_point``.
* ``mbpp``: ``text``/``prompt``, ``test_list`` (assert strings), ``test_setup_code``, ``code``.
* ``apps``: ``question``, ``input_output`` (JSON string ``{"inputs", "outputs", "fn_name"?}``),
  ``solutions``, ``starter_code`` (also TACO).
* ``deepcoder``: ``problem`` with ``tests`` in any of the DeepCoder subsets' shapes (APPS-like
  dict, LCB-like list with ``testtype``, PrimeIntellect ``stdin_stdout`` / ``function_call``).

Assert-based tests (HumanEval, MBPP) keep their authors' semantics: simple asserts
(``assert f(1, 2) == 3``, ``is True``, truthiness, ``abs(f(x) - v) < tol``) become parent-judged
call tests with Python's exact comparison; every other statement (loops over generated inputs,
asserts using helpers or local variables) is run as the dataset's own code, one test per
statement, in a judge sandbox (:mod:`vpo.tasks.code_asserts`).
"""

from __future__ import annotations

import ast
import base64
import builtins
import gzip
import hashlib
import io
import json
import logging
import pickle
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vpo.sandbox import TestCase, encode_value
from vpo.tasks.code_asserts import assert_tests, judge_settings, prompt_helpers

__all__ = [
    "FORMATS",
    "ImportStats",
    "decode_lcb_tests",
    "detect_format",
    "from_apps",
    "from_deepcoder",
    "from_humaneval",
    "from_livecodebench",
    "from_mbpp",
    "from_vpo",
    "load_problems",
    "normalize_problem",
    "read_records",
]

log = logging.getLogger("vpo.tasks.code")

FORMATS = ("vpo", "livecodebench", "humaneval", "mbpp", "apps", "deepcoder")


class ImportStats(dict):
    """Counters collected while importing (problems read/kept, tests converted/skipped)."""

    def add(self, key: str, n: int = 1) -> None:
        self[key] = self.get(key, 0) + n


# ------------------------------------------------------------------------------------ reading


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield raw records from a ``.jsonl`` / ``.json`` / ``.parquet`` file (``.gz`` allowed for
    the text formats) or from every such file in a directory (sorted by name)."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if _kind(f) is not None)
        if not files:
            raise FileNotFoundError(f"no .jsonl/.json/.parquet files in {p}")
        for f in files:
            yield from read_records(f)
        return
    kind = _kind(p)
    if kind is None:
        raise ValueError(f"unsupported dataset file {p} (expected .jsonl, .json or .parquet)")
    if kind == "parquet":
        import pyarrow.parquet as pq

        yield from pq.read_table(p).to_pylist()
        return
    opener = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt", encoding="utf-8") as fh:
        if kind == "jsonl":
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{p}:{n}: invalid JSON: {exc}") from exc
            return
        data = json.load(fh)
    if isinstance(data, Mapping):
        for key in ("problems", "data", "rows"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            data = [data]
    if not isinstance(data, list):
        raise TypeError(f"{p}: expected a list of problems")
    yield from data


def _kind(p: Path) -> str | None:
    name = p.name.lower().removesuffix(".gz")
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    if p.name.lower().endswith(".parquet"):
        return "parquet"
    return None


def detect_format(rec: Mapping[str, Any]) -> str:
    """Guess a record's format from its fields."""
    tests = rec.get("tests")
    if isinstance(tests, str) and tests.lstrip().startswith("["):
        try:
            tests = [json.loads(t) if isinstance(t, str) else t for t in json.loads(tests)]
        except json.JSONDecodeError:
            pass
    if "prompt" in rec and isinstance(tests, list) and all(isinstance(t, Mapping) and "type" in t for t in tests) \
            and all(t.get("type") in ("stdio", "call", "expr") for t in tests):
        return "vpo"
    if "question_content" in rec or "public_test_cases" in rec:
        return "livecodebench"
    if "test_list" in rec:
        return "mbpp"
    if isinstance(rec.get("test"), str) and "entry_point" in rec and "prompt" in rec:
        return "humaneval"
    if "input_output" in rec:
        return "apps"
    if "problem" in rec and "tests" in rec:
        return "deepcoder"
    raise ValueError(f"cannot tell the format of a record with fields {sorted(rec)[:12]}")


def load_problems(
    path: str | Path, fmt: str = "auto", stats: ImportStats | None = None, translate: bool = True
) -> list[dict[str, Any]]:
    """Read a dataset file/folder and convert every record to the canonical problem form.
    Problems without any usable test are dropped (and counted in ``stats``). ``translate``:
    simple asserts become parent-judged tests (else every assert is a judge-sandbox step)."""
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected auto or one of {', '.join(FORMATS)}")
    stats = stats if stats is not None else ImportStats()
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, rec in enumerate(read_records(path)):
        stats.add("records")
        kind = detect_format(rec) if fmt == "auto" else fmt
        prob = IMPORTERS[kind](rec, stats, translate) if kind in ("humaneval", "mbpp") else IMPORTERS[kind](rec, stats)
        if not prob["id"]:
            prob["id"] = f"{kind}-{i}"
        if prob["id"] in seen:
            raise ValueError(f"duplicate problem id {prob['id']!r} in {path}")
        seen.add(prob["id"])
        if not prob["tests"]:
            stats.add("dropped_no_tests")
            continue
        out.append(prob)
    if stats.get("dropped_no_tests") or stats.get("tests_skipped"):
        log.warning("importing %s: %s", path, dict(stats))
    return out


# ------------------------------------------------------------------------------------ canonical


def normalize_problem(
    *,
    id: Any,
    prompt: str,
    tests: Iterable[Mapping[str, Any] | TestCase],
    entry_point: str | None = None,
    starter_code: str | None = "",
    setup_code: str | None = "",
    solutions: Iterable[Any] = (),
    split: str | None = None,
    date: str | None = None,
    difficulty: Any = None,
    title: str | None = None,
    source_format: str = "vpo",
    stats: ImportStats | None = None,
    check_code: str | None = "",
    judge: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Validate and build one canonical problem; invalid tests are dropped and counted."""
    good: list[dict[str, Any]] = []
    for t in tests:
        try:
            case = t if isinstance(t, TestCase) else TestCase.from_dict(t)
        except (ValueError, KeyError, TypeError) as exc:
            if stats is not None:
                stats.add("tests_invalid")
            log.debug("dropping an invalid test of %s: %s", id, exc)
            continue
        if (case.kind == "call" and not entry_point) or (case.kind == "check" and not (check_code and entry_point)):
            if stats is not None:
                stats.add("tests_invalid")
            continue
        good.append(case.to_dict())
    sols = []
    for s in solutions or ():
        if isinstance(s, str) and s.strip():
            sols.append({"strategy": f"solution-{len(sols) + 1}", "code": s})
        elif isinstance(s, Mapping) and str(s.get("code", "")).strip():
            sols.append({"strategy": str(s.get("strategy") or f"solution-{len(sols) + 1}"), "code": str(s["code"])})
    return {
        "id": "" if id is None else str(id),
        "prompt": str(prompt or "").strip(),
        "tests": good,
        "entry_point": entry_point or None,
        "starter_code": starter_code or "",
        "setup_code": setup_code or "",
        "check_code": check_code or "",
        "judge": judge_settings(judge, source_format),
        "solutions": sols,
        "split": split,
        "date": None if date is None else str(date),
        "difficulty": None if difficulty is None else str(difficulty),
        "title": title,
        "source_format": source_format,
    }


def from_vpo(rec: Mapping[str, Any], stats: ImportStats | None = None) -> dict[str, Any]:
    """The vpo schema itself (``tests`` may also be a JSON string)."""
    tests = rec.get("tests") or []
    if isinstance(tests, str):
        tests = json.loads(tests)
    tests = [json.loads(t) if isinstance(t, str) else t for t in tests]
    return normalize_problem(
        id=rec.get("id"), prompt=rec.get("prompt", ""), tests=tests, entry_point=rec.get("entry_point"),
        starter_code=rec.get("starter_code"), setup_code=rec.get("setup_code"), solutions=rec.get("solutions") or (),
        split=rec.get("split"), date=rec.get("date"), difficulty=rec.get("difficulty"), title=rec.get("title"),
        source_format="vpo", stats=stats, check_code=rec.get("check_code"), judge=judge_settings(rec.get("judge"), "vpo"),
    )


# ------------------------------------------------------------------------------------ LiveCodeBench


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles plain containers and strings only: any global (class, function) is refused, so
    a crafted payload cannot execute code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name} from a dataset")


def decode_lcb_tests(value: Any) -> list[dict[str, Any]]:
    """LiveCodeBench test cases: a JSON string/list, or the release's base64(zlib(pickle(JSON)))."""
    if value is None or value == "":
        return []
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise TypeError(f"unexpected test-case field type {type(value).__name__}")
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    raw = zlib.decompress(base64.b64decode(value.encode("ascii")))
    if raw[:1] == b"\x80":
        obj = _NoGlobalsUnpickler(io.BytesIO(raw)).load()
    else:
        obj = raw.decode("utf-8")
    return json.loads(obj) if isinstance(obj, (str, bytes)) else obj


def _lcb_case(case: Mapping[str, Any], fn: str | None, stats: ImportStats | None) -> dict[str, Any] | None:
    testtype = case.get("testtype", "stdin")
    inp, out = case.get("input", ""), case.get("output", "")
    if testtype == "functional":
        if not fn:
            if stats is not None:
                stats.add("tests_skipped")
            return None
        try:
            args = [json.loads(line) for line in str(inp).split("\n") if line.strip()]
            expected = json.loads(out)
        except json.JSONDecodeError:
            if stats is not None:
                stats.add("tests_skipped")
            return None
        return {"type": "call", "args": encode_value(args), "expected": encode_value(expected)}
    return {"type": "stdio", "input": str(inp), "output": str(out)}


def _metadata(rec: Mapping[str, Any]) -> dict[str, Any]:
    meta = rec.get("metadata") or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta) if meta.strip() else {}
        except json.JSONDecodeError:
            meta = {}
    return dict(meta) if isinstance(meta, Mapping) else {}


def from_livecodebench(rec: Mapping[str, Any], stats: ImportStats | None = None) -> dict[str, Any]:
    """A LiveCodeBench ``code_generation`` record (public tests first, then private)."""
    fn = _metadata(rec).get("func_name") or None
    tests = []
    for field in ("public_test_cases", "private_test_cases"):
        for case in decode_lcb_tests(rec.get(field)):
            t = _lcb_case(case, fn, stats)
            if t is not None:
                tests.append(t)
    title = rec.get("question_title")
    return normalize_problem(
        id=rec.get("question_id") or rec.get("id"), prompt=rec.get("question_content", ""), tests=tests,
        entry_point=fn, starter_code=rec.get("starter_code", ""), date=rec.get("contest_date"),
        difficulty=rec.get("difficulty"), title=title, split=rec.get("split"), source_format="livecodebench",
        stats=stats,
    )


def from_humaneval(rec: Mapping[str, Any], stats: ImportStats | None = None, translate: bool = True) -> dict[str, Any]:
    """A HumanEval(+)-style record: the prompt is the signature + docstring to complete; its
    other code (imports, helpers) runs before the solution; ``check(candidate)``'s statements
    are the tests (see :func:`assert_tests`)."""
    entry = str(rec["entry_point"])
    starter = str(rec.get("prompt", ""))
    helpers = prompt_helpers(starter, entry)
    tests, check_code = assert_tests(str(rec.get("test", "")), entry, helpers=helpers, translate=translate, stats=stats)
    prompt = f"Complete the following Python function `{entry}`:\n\n```python\n{starter.rstrip()}\n```"
    sols = []
    if rec.get("canonical_solution"):
        sols.append({"strategy": "canonical", "code": starter + str(rec["canonical_solution"])})
    return normalize_problem(
        id=rec.get("task_id"), prompt=prompt, tests=tests, entry_point=entry, starter_code=starter,
        setup_code=helpers, solutions=sols, split=rec.get("split"), source_format="humaneval", stats=stats,
        check_code=check_code, judge=judge_settings(rec.get("judge"), "humaneval"),
    )


def from_mbpp(rec: Mapping[str, Any], stats: ImportStats | None = None, translate: bool = True) -> dict[str, Any]:
    """An MBPP-style record (original or sanitized): tests are assert strings, run after the
    test imports and setup code (which also run before the solution, as in MBPP's harness);
    the first assert is shown in the prompt (it fixes the function name and signature)."""
    asserts = list(rec.get("test_list") or []) + list(rec.get("challenge_test_list") or [])
    entry = None
    for a in asserts:
        try:
            node = ast.parse(a).body[0]
        except (SyntaxError, IndexError):
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id not in dir(builtins) \
                    and n.func.id != "isclose":
                entry = n.func.id
                break
        if entry:
            break
    if entry is None:
        for n in ast.walk(ast.parse(str(rec.get("code", "")) or "pass")):
            if isinstance(n, ast.FunctionDef):
                entry = n.name
                break
    imports = "\n".join(rec.get("test_imports") or [])
    setup = "\n".join(s for s in (imports, str(rec.get("test_setup_code") or "")) if s.strip())
    tests, check_code = (assert_tests("\n".join(asserts), entry, helpers=setup, translate=translate, stats=stats)
                         if entry else ([], ""))
    text = str(rec.get("text") or rec.get("prompt") or "").strip()
    shown = asserts[0] if asserts else ""
    prompt = f"{text}\nYour code should pass this test:\n{shown}" if shown else text
    return normalize_problem(
        id=rec.get("task_id"), prompt=prompt, tests=tests, entry_point=entry, setup_code=setup,
        solutions=[{"strategy": "reference", "code": rec["code"]}] if rec.get("code") else (),
        split=rec.get("split"), source_format="mbpp", stats=stats, check_code=check_code,
        judge=judge_settings(rec.get("judge"), "mbpp"),
    )


# ------------------------------------------------------------------------------------ APPS / DeepCoder


def _lines(v: Any) -> str:
    if isinstance(v, list):
        return "\n".join(str(x) for x in v)
    return "" if v is None else str(v)


def _wrapped(expected: Any) -> tuple[Any, list[Any]]:
    """APPS/TACO/PrimeIntellect often wrap a call's expected value in a one-element list:
    accept the value itself and the wrapped form."""
    if isinstance(expected, list) and len(expected) == 1:
        return expected[0], [expected]
    return expected, []


def _io_tests(io_spec: Mapping[str, Any], fn: str | None, stats: ImportStats | None) -> list[dict[str, Any]]:
    inputs = io_spec.get("inputs") or []
    outputs = io_spec.get("outputs") or []
    tests = []
    for inp, out in zip(inputs, outputs):
        if fn:
            args = inp if isinstance(inp, list) else [inp]
            exp, alts = _wrapped(out)
            tests.append({"type": "call", "args": encode_value(args), "expected": encode_value(exp),
                          "alternatives": [encode_value(a) for a in alts]})
        else:
            tests.append({"type": "stdio", "input": _lines(inp), "output": _lines(out)})
    if len(inputs) != len(outputs) and stats is not None:
        stats.add("tests_skipped", abs(len(inputs) - len(outputs)))
    return tests


def _json_field(v: Any) -> Any:
    if isinstance(v, str):
        v = v.strip()
        if not v:
            return None
        return json.loads(v)
    return v


def from_apps(rec: Mapping[str, Any], stats: ImportStats | None = None) -> dict[str, Any]:
    """An APPS / TACO record."""
    spec = _json_field(rec.get("input_output")) or {}
    fn = spec.get("fn_name") or None
    sols = _json_field(rec.get("solutions")) or []
    return normalize_problem(
        id=rec.get("problem_id", rec.get("id")), prompt=rec.get("question", ""), tests=_io_tests(spec, fn, stats),
        entry_point=fn, starter_code=rec.get("starter_code", ""), solutions=sols[:5],
        difficulty=rec.get("difficulty"), split=rec.get("split"), source_format="apps", stats=stats,
    )


def from_deepcoder(rec: Mapping[str, Any], stats: ImportStats | None = None) -> dict[str, Any]:
    """A DeepCoder-Preview record (subsets primeintellect, taco, lcbv5, codeforces)."""
    raw = _json_field(rec.get("tests")) or []
    meta = _metadata(rec)
    fn = meta.get("func_name") or meta.get("fn_name")
    tests: list[dict[str, Any]] = []
    if isinstance(raw, Mapping):
        fn = fn or raw.get("fn_name")
        tests = _io_tests(raw, fn, stats)
    else:
        for case in raw:
            kind = case.get("type") or case.get("testtype") or "stdin"
            if kind == "function_call":
                name = case.get("fn_name") or fn
                fn = fn or name
                args = case.get("input")
                args = args if isinstance(args, list) else [args]
                exp, alts = _wrapped(case.get("output"))
                tests.append({"type": "call", "args": encode_value(args), "expected": encode_value(exp),
                              "alternatives": [encode_value(a) for a in alts]})
            elif kind == "functional":
                t = _lcb_case(case, fn, stats)
                if t is not None:
                    tests.append(t)
            else:
                tests.append({"type": "stdio", "input": _lines(case.get("input")), "output": _lines(case.get("output"))})
    key = rec.get("id") or rec.get("problem_id") or hashlib.sha256(str(rec.get("problem", "")).encode()).hexdigest()[:16]
    return normalize_problem(
        id=key, prompt=rec.get("problem", ""), tests=tests, entry_point=fn,
        starter_code=rec.get("starter_code", ""), solutions=_json_field(rec.get("solutions")) or (),
        split=rec.get("split"), difficulty=rec.get("difficulty"), source_format="deepcoder", stats=stats,
    )


IMPORTERS = {
    "vpo": from_vpo,
    "livecodebench": from_livecodebench,
    "humaneval": from_humaneval,
    "mbpp": from_mbpp,
    "apps": from_apps,
    "deepcoder": from_deepcoder,
}


def select_tests(tests: Sequence[Mapping[str, Any]], max_tests: int | None) -> list[dict[str, Any]]:
    """Keep at most ``max_tests`` tests: the smallest by serialised size (the paper keeps the
    <= 16 smallest), in their original order."""
    tests = [dict(t) for t in tests]
    if max_tests is None or len(tests) <= max_tests:
        return tests
    order = sorted(range(len(tests)), key=lambda i: (len(json.dumps(tests[i], sort_keys=True)), i))
    keep = sorted(order[:max_tests])
    return [tests[i] for i in keep]
