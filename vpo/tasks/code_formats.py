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
statement, in a judge sandbox (see :func:`assert_tests`).
"""

from __future__ import annotations

import ast
import base64
import builtins
import copy
import gzip
import hashlib
import io
import json
import logging
import pickle
import sys
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vpo.sandbox import TestCase, encode_value

__all__ = [
    "FORMATS",
    "JUDGE_DEFAULTS",
    "ImportStats",
    "assert_tests",
    "check_program",
    "decode_lcb_tests",
    "detect_format",
    "from_apps",
    "from_deepcoder",
    "from_humaneval",
    "from_livecodebench",
    "from_mbpp",
    "from_vpo",
    "judge_settings",
    "load_problems",
    "normalize_problem",
    "prompt_helpers",
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


# ------------------------------------------------------------------------------------ asserts

# How assert-based datasets (HumanEval, MBPP) are judged by their own harnesses: the program is
# the prompt (or setup code) + the solution + the test code, run with no extra imports, every
# assert evaluated by Python itself, one time limit for the whole problem.
JUDGE_DEFAULTS: dict[str, dict[str, Any]] = {
    "humaneval": {"equality": "exact", "prelude": "none", "problem_timeout": 3.0},
    "mbpp": {"equality": "exact", "prelude": "none", "problem_timeout": 3.0},
    "vpo": {"equality": "tolerant", "prelude": "competitive", "problem_timeout": None},
    "livecodebench": {"equality": "tolerant", "prelude": "competitive", "problem_timeout": None},
    "apps": {"equality": "tolerant", "prelude": "competitive", "problem_timeout": None},
    "deepcoder": {"equality": "tolerant", "prelude": "competitive", "problem_timeout": None},
}
CANDIDATE = "candidate"  # the name the judge's test code calls the solution by
_FOLD_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
             ast.Pow: lambda a, b: a ** b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
             ast.Div: lambda a, b: a / b}


def judge_settings(value: Any, fmt: str = "vpo") -> dict[str, Any]:
    """A problem's judge settings (``equality``, ``prelude``, ``problem_timeout``): the
    format's defaults updated with ``value`` (a mapping or its JSON), validated."""
    out = dict(JUDGE_DEFAULTS.get(fmt, JUDGE_DEFAULTS["vpo"]))
    if isinstance(value, str) and value.strip():
        value = json.loads(value)
    if isinstance(value, Mapping):
        unknown = set(value) - set(out)
        if unknown:
            raise ValueError(f"unknown judge settings {sorted(unknown)}; expected {sorted(out)}")
        out.update(value)
    if out["equality"] not in ("exact", "tolerant"):
        raise ValueError(f"judge equality must be exact or tolerant, got {out['equality']!r}")
    if out["prelude"] not in ("none", "competitive"):
        raise ValueError(f"judge prelude must be none or competitive, got {out['prelude']!r}")
    pt = out["problem_timeout"]
    if pt is not None and (isinstance(pt, bool) or not isinstance(pt, (int, float)) or not pt > 0):
        raise ValueError(f"judge problem_timeout must be a positive number or null, got {pt!r}")
    return out


def _small(v: Any) -> bool:
    if type(v) is int:
        return v.bit_length() <= 4096
    if isinstance(v, (str, bytes, list, tuple, set, frozenset, dict)):
        return len(v) <= 10_000
    return True


def _const(node: ast.AST) -> tuple[bool, Any]:
    """The value of a constant expression: a literal, or arithmetic on literals such as
    ``3 * 19`` or ``'ab' + 'c'`` (folded here exactly as Python computes it, size-bounded)."""
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.BinOp) and type(node.op) in _FOLD_OPS:
        ok_a, a = _const(node.left)
        ok_b, b = _const(node.right)
        if not (ok_a and ok_b and _small(a) and _small(b)):
            return False, None
        if isinstance(node.op, ast.Pow) and not (type(b) is int and 0 <= b <= 256 and type(a) in (int, float)):
            return False, None
        if isinstance(node.op, ast.Mult) and any(isinstance(x, (str, bytes, list, tuple)) for x in (a, b)) \
                and any(type(x) is int and x > 10_000 for x in (a, b)):
            return False, None
        try:
            v = _FOLD_OPS[type(node.op)](a, b)
        except Exception:  # noqa: BLE001 - ZeroDivisionError, TypeError...: not a constant test
            return False, None
        return (True, v) if _small(v) else (False, None)
    if isinstance(node, (ast.Tuple, ast.List)):
        vals = []
        for elt in node.elts:
            ok, v = _const(elt)
            if not ok:
                return False, None
            vals.append(v)
        return True, (tuple(vals) if isinstance(node, ast.Tuple) else vals)
    return False, None


def _direct_call(node: ast.AST) -> list[Any] | None:
    """Constant positional args if ``node`` is ``candidate(<constants>)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == CANDIDATE) or node.keywords:
        return None
    args = []
    for a in node.args:
        if isinstance(a, ast.Starred):
            return None
        ok, v = _const(a)
        if not ok:
            return None
        args.append(v)
    return args


def _call_test(args: list[Any], cmp: str, expected: Any = None, tol: float | None = None) -> dict[str, Any] | None:
    t: dict[str, Any] = {"type": "call", "args": encode_value(args), "expected": encode_value(expected)}
    if cmp != "eq":
        t["cmp"] = cmp
    if tol is not None:
        t["tol"] = tol
    try:
        TestCase.from_dict(t)
    except (ValueError, TypeError):
        return None
    return t


def _translate(cond: ast.AST, bound: set[str]) -> dict[str, Any] | None:
    """A parent-judged test with exactly the semantics of ``assert cond``, for the shapes
    ``candidate(c) == c`` / ``!=`` / ``is True|False|None`` / ``is not``, ``candidate(c)``,
    ``not candidate(c)`` and ``abs(candidate(c) - c) < c`` / ``<=`` (c: constants); None for
    anything else (run as the dataset's own code in the judge sandbox instead)."""
    if isinstance(cond, ast.Compare) and len(cond.ops) == 1:
        op, left, right = cond.ops[0], cond.left, cond.comparators[0]
        if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)):
            for call, other in ((left, right), (right, left)):
                args = _direct_call(call)
                ok, val = _const(other)
                if args is None or not ok:
                    continue
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    return _call_test(args, "eq" if isinstance(op, ast.Eq) else "ne", val)
                if val is True or val is False or val is None:
                    return _call_test(args, "is" if isinstance(op, ast.Is) else "is_not", val)
            return None
        if isinstance(op, (ast.Lt, ast.LtE)) and "abs" not in bound and isinstance(left, ast.Call) \
                and isinstance(left.func, ast.Name) and left.func.id == "abs" and len(left.args) == 1 \
                and not left.keywords and isinstance(left.args[0], ast.BinOp) and isinstance(left.args[0].op, ast.Sub):
            args = _direct_call(left.args[0].left)
            ok_v, val = _const(left.args[0].right)
            ok_t, tol = _const(right)
            if args is not None and ok_v and ok_t and type(val) in (int, float) and type(tol) in (int, float):
                return _call_test(args, "abs_lt" if isinstance(op, ast.Lt) else "abs_le", val, float(tol))
        return None
    args = _direct_call(cond)
    if args is not None:
        return _call_test(args, "truthy")
    if isinstance(cond, ast.UnaryOp) and isinstance(cond.op, ast.Not):
        args = _direct_call(cond.operand)
        if args is not None:
            return _call_test(args, "falsy")
    return None


class _Rename(ast.NodeTransformer):
    def __init__(self, names: set[str], new: str) -> None:
        self.names, self.new = names, new

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.names:
            return ast.copy_location(ast.Name(id=self.new, ctx=node.ctx), node)
        return node


def _bound_names(tree: ast.AST) -> set[str]:
    """Names the test source binds itself (assignments, loop variables, helper functions)."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    return out


_STEP_TEMPLATE = ast.parse(
    "try:\n    pass\nexcept BaseException as __vpo_exc:\n    yield __vpo_exc\nelse:\n    yield None\n"
).body[0]


# -- which statements a verdict depends on: names that carry the candidate or its results

_DYNAMIC = {"eval", "exec", "locals", "globals", "vars", "__import__", "compile", "breakpoint"}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def _loads(node: ast.AST | None) -> set[str]:
    """Names ``node`` reads, but those a comprehension or lambda inside it binds for itself."""
    if node is None:
        return set()
    if isinstance(node, ast.Name):
        return {node.id} if isinstance(node.ctx, ast.Load) else set()
    if isinstance(node, _COMPREHENSIONS + (ast.Lambda,)):
        inner = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if isinstance(node, ast.Lambda):
            own = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
            return (inner - own) | set().union(*(_loads(d) for d in node.args.defaults + node.args.kw_defaults))
        own = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        return (inner - own) | _loads(node.generators[0].iter)
    out: set[str] = set()
    for child in ast.iter_child_nodes(node):
        out |= _loads(child)
    return out


def _targets(node: ast.AST | None) -> set[str]:
    """The names an assignment target binds or changes: ``x``, ``x, y`` and the object under a
    subscript or attribute (``d`` of ``d[k] = v``, ``o`` of ``o.a.b = v``)."""
    if node is None:
        return set()
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, (ast.Tuple, ast.List)):
        return set().union(*(_targets(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    if isinstance(node, (ast.Subscript, ast.Attribute)):
        return _targets(node.value)
    return set()


def _exposed(stmts: Sequence[ast.stmt], defined: frozenset[str] = frozenset()) -> set[str]:
    """Names these statements may read before assigning them themselves (what they take from
    the statements before them). Function and class bodies count whole: they run when called."""
    out: set[str] = set()
    d = set(defined)
    for s in stmts:
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            out |= _loads(s.value) - d
            for t in targets:
                out |= (_loads(t) | (_targets(t) if isinstance(s, ast.AugAssign) else set())) - d
                if isinstance(t, (ast.Name, ast.Tuple, ast.List)) and not isinstance(s, ast.AugAssign):
                    d |= _targets(t)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            out |= (_loads(s.iter) | _loads(s.target)) - d
            out |= _exposed(s.body, frozenset(d | _targets(s.target))) | _exposed(s.orelse, frozenset(d))
        elif isinstance(s, (ast.While, ast.If)):
            out |= _loads(s.test) - d
            out |= _exposed(s.body, frozenset(d)) | _exposed(s.orelse, frozenset(d))
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            inner = set(d)
            for item in s.items:
                out |= _loads(item.context_expr) - d
                inner |= _targets(item.optional_vars)
            out |= _exposed(s.body, frozenset(inner))
        elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            out |= _exposed(s.body, frozenset(d)) | _exposed(s.orelse, frozenset(d)) | _exposed(s.finalbody, frozenset(d))
            for h in s.handlers:
                out |= _loads(h.type) - d
                out |= _exposed(h.body, frozenset(d | ({h.name} if h.name else set())))
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            d |= {(a.asname or a.name).split(".")[0] for a in s.names}
        elif isinstance(s, _SCOPES):
            out |= {n.id for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - d
            d.add(s.name)
        else:
            out |= _loads(s) - d
    return out


def _flows(stmt: ast.stmt, tainted: set[str]) -> set[str]:
    """The names ``stmt`` leaves holding something derived from ``tainted`` names (the candidate
    or its results): assigned from them, passed to them (a call may change its arguments in
    place: ``candidate(a)``), given their values (``out.append(r)``), or functions and classes
    that use them. Computed to a fixed point over the statement (loops feed themselves)."""
    t, hit = set(tainted), set()
    while True:
        before = (len(t), len(hit))
        for n in ast.walk(stmt):
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and n.value is not None:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if _loads(n.value) & t:
                    for tg in targets:
                        hit |= _targets(tg)
            elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                if _loads(n.iter) & t:
                    hit |= _targets(n.target)
            elif isinstance(n, (ast.With, ast.AsyncWith)):
                for item in n.items:
                    if _loads(item.context_expr) & t:
                        hit |= _targets(item.optional_vars)
            elif isinstance(n, ast.Call):
                args = [*n.args, *(k.value for k in n.keywords)]
                if _loads(n.func) & t:
                    for a in args:
                        hit |= _targets(a.value if isinstance(a, ast.Starred) else a)
                elif isinstance(n.func, ast.Attribute) and any(_loads(a) & t for a in args):
                    hit |= _targets(n.func.value)
            elif isinstance(n, _SCOPES[:3]) and _exposed([n]) & t:
                hit.add(n.name)
        t |= hit
        if (len(t), len(hit)) == before:
            return hit - {CANDIDATE}


def _inert(stmt: ast.stmt) -> bool:
    """A statement that can neither fail nor change anything a later statement sees: ``pass``,
    a constant expression, ``assert <true constant>``, a builtin's bare name, ``import`` of a
    standard-library module, or a constant assigned to a name."""
    if isinstance(stmt, ast.Pass):
        return True
    if isinstance(stmt, ast.Expr):
        v = stmt.value
        return isinstance(v, ast.Constant) or (isinstance(v, ast.Name) and hasattr(builtins, v.id))
    if isinstance(stmt, ast.Assert):
        ok, value = _const(stmt.test)
        try:
            return ok and bool(value)
        except Exception:  # noqa: BLE001 - a constant whose truth value raises is not inert
            return False
    if isinstance(stmt, ast.Import):
        return all(a.name.split(".")[0] in sys.stdlib_module_names for a in stmt.names)
    if isinstance(stmt, ast.Assign):
        return all(isinstance(t, ast.Name) for t in stmt.targets) and _const(stmt.value)[0]
    return False


def _splittable(body: Sequence[ast.stmt]) -> str | None:
    """Why a check body cannot be cut into steps faithfully (None: it can): names reached other
    than by name (``eval``, ``locals()``...), ``global``/``nonlocal``, or the candidate's own
    name rebound."""
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, (ast.Global, ast.Nonlocal)):
                return "global or nonlocal names"
            if isinstance(n, ast.Name) and n.id in _DYNAMIC:
                return f"names reached through {n.id}"
            if isinstance(n, ast.Name) and n.id == CANDIDATE and not isinstance(n.ctx, ast.Load):
                return "the candidate's name is rebound"
            if isinstance(n, ast.arg) and n.arg == CANDIDATE:
                return "the candidate's name is rebound"
    return None


def _generator(body: Sequence[ast.stmt]) -> bool:
    """Whether the statements themselves (not a function inside them) yield or await."""
    todo = list(body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await)):
            return True
        if not isinstance(n, _SCOPES):
            todo.extend(ast.iter_child_nodes(n))
    return False


class _Unit:
    """Consecutive statements of the test code judged together: a parent-judged call test
    (``test``) or a judge-sandbox step; ``prefix``: the statements before them that do not
    touch the candidate (they run first)."""

    def __init__(self, prefix: list[ast.stmt], stmts: list[ast.stmt], test: dict[str, Any] | None) -> None:
        self.prefix, self.stmts, self.test = prefix, stmts, test


def _units(body: Sequence[ast.stmt], translate: bool, bound: set[str]) -> tuple[list[_Unit], list[ast.stmt]]:
    """Cut the test statements into units, in order; returns them and the statements after the
    last one. A statement is judged when it reads the candidate or a name holding something of
    it; one that reads a name an earlier unit left holding it joins that unit (merged with every
    unit since, so the statements still run in their order): ``r = candidate(x)`` / ``assert r
    == y``, ``candidate(a)`` / ``assert a == [1, 2]`` and ``f = candidate`` / ``assert f(1) == 2``
    are one step each, never a step with nothing to fail."""
    units: list[_Unit] = []
    taint: dict[str, int] = {}  # name -> the unit that left it holding something of the candidate
    pending: list[ast.stmt] = []
    for stmt in body:
        reads = _exposed([stmt])
        if CANDIDATE not in reads and not reads & taint.keys():
            pending.append(stmt)
            if isinstance(stmt, ast.Assign) and not _loads(stmt.value) & taint.keys():  # rebound: no longer tainted
                for tg in stmt.targets:
                    if isinstance(tg, (ast.Name, ast.Tuple, ast.List)):
                        for name in _targets(tg):
                            taint.pop(name, None)
            continue
        producers = [taint[n] for n in reads if n in taint]
        if producers:
            k = min(producers)
            merged = [s for u in units[k:] for s in u.prefix + u.stmts]
            units[k:] = [_Unit([], merged + pending + [stmt], None)]
            taint = {n: min(u, k) for n, u in taint.items()}
        else:
            test = _translate(stmt.test, bound) if translate and isinstance(stmt, ast.Assert) else None
            units.append(_Unit(pending, [stmt], test))
            k = len(units) - 1
        pending = []
        for name in _flows(stmt, set(taint) | {CANDIDATE}):
            taint[name] = k
    return _no_blind_steps(units), pending


def _checks(stmts: Sequence[ast.stmt]) -> bool:
    return any(isinstance(n, (ast.Assert, ast.Raise)) for s in stmts for n in ast.walk(s))


def _no_blind_steps(units: list[_Unit]) -> list[_Unit]:
    """A step that asserts nothing (``candidate(x)`` whose result nobody reads) runs with the
    unit after it (else the one before): alone it would be a test every answer passes."""
    k = 0
    while len(units) > 1 and k < len(units):
        u = units[k]
        if u.test is not None or _checks(u.stmts):
            k += 1
            continue
        if k + 1 < len(units):
            nxt = units[k + 1]
            units[k:k + 2] = [_Unit(u.prefix, u.stmts + nxt.prefix + nxt.stmts, None)]
        else:
            prev = units[k - 1]
            units[k - 1:] = [_Unit(prev.prefix, prev.stmts + u.prefix + u.stmts, None)]
            k -= 1
    return units


def check_program(helpers: str, module_stmts: Sequence[ast.stmt], steps: Sequence[Sequence[ast.stmt]]) -> str:
    """The judge program: ``helpers`` (the prompt's or setup code), the test module's own
    statements, and ``__vpo_steps__(candidate)``, a generator running the test statements in
    their order, one ``try`` block per step, yielding None or the exception that ended it."""
    body: list[ast.stmt] = []
    for stmts in steps:
        block = copy.deepcopy(_STEP_TEMPLATE)
        block.body = list(stmts) or [ast.Pass()]
        body.append(block)
    if not body:
        body = [ast.Return(value=None), ast.Expr(ast.Yield(value=None))]
    fn = ast.parse(f"def __vpo_steps__({CANDIDATE}):\n    pass\n").body[0]
    fn.body = body
    module = ast.Module(body=[*module_stmts, fn], type_ignores=[])
    ast.fix_missing_locations(module)
    return (helpers.rstrip() + "\n\n\n" if helpers.strip() else "") + ast.unparse(module) + "\n"


def _step_text(stmts: Sequence[ast.stmt]) -> str:
    text = "\n".join(ast.unparse(s) for s in stmts)
    return text if len(text) <= 300 else text[:297] + "..."


def assert_tests(
    source: str, entry_point: str, *, helpers: str = "", translate: bool = True, stats: ImportStats | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Tests from assert-based test code: a HumanEval-style ``check(candidate)`` function or
    MBPP-style module-level asserts, judged as the dataset's own checker judges them. Every
    statement is kept, in order. One test per statement that reads the solution or a name
    holding something of it (by name flow, see :func:`_units`); the statements before it that do
    not (imports, ``rng = random.Random(42)``) run with it, and those after the last one run with
    the last step. With ``translate``, asserts of the shapes :func:`_translate` knows become
    parent-judged call tests with Python's exact semantics; every other statement (loops,
    helper-based or non-constant asserts) becomes a ``check`` step of the returned judge program,
    the dataset's own code, run in a judge sandbox that reaches the solution through the parent
    only. A check that cannot be cut faithfully (``eval``, ``locals()``, ``global``, the
    candidate's name rebound) is one step, run whole. Returns (tests, judge program or "")."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        if stats is not None:
            stats.add("tests_skipped")
        return [], ""
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    names = {entry_point}
    if check is not None:
        body = list(check.body)
        module_stmts = [n for n in tree.body if n is not check]
        if check.args.args:
            names.add(check.args.args[0].arg)
    else:
        body, module_stmts = list(tree.body), []
    if _generator(body):  # check() would return a generator without running a statement: nothing is tested
        if stats is not None:
            stats.add("tests_skipped")
        return [], ""
    renamer = _Rename(names - {CANDIDATE}, CANDIDATE)
    body = [ast.fix_missing_locations(renamer.visit(copy.deepcopy(s))) for s in body]
    why = _splittable(body)
    if why is not None:
        log.debug("a check run whole (%s)", why)
        if stats is not None:
            stats.add("tests_as_check_steps")
            stats.add("checks_run_whole")
        return ([{"type": "check", "step": 0, "text": _step_text(body)}],
                check_program(helpers, module_stmts, [body]))
    bound = _bound_names(tree) | _bound_names(ast.parse(helpers) if helpers.strip() else ast.Module([], []))
    units, trailing = _units(body, translate, bound)
    if not units:  # the test code never reaches the solution: no test of it
        if stats is not None:
            stats.add("tests_skipped")
        return [], ""
    steps_at = [k for k, u in enumerate(units) if u.test is None]
    rest = [s for u in units[steps_at[-1] + 1:] for s in u.prefix] + trailing if steps_at else \
        [s for u in units for s in u.prefix] + trailing
    if not steps_at and not all(_inert(s) for s in rest):  # something of the test code must still run
        last = units[-1]
        last.test = None
        steps_at = [len(units) - 1]
        rest = [s for u in units for s in u.prefix] + trailing
    tests: list[dict[str, Any]] = []
    steps: list[list[ast.stmt]] = []
    carry: list[ast.stmt] = []
    for k, u in enumerate(units):
        if u.test is not None:
            carry.extend(u.prefix)  # still run, before the next judge step
            tests.append(u.test)
            if stats is not None:
                stats.add("tests_from_asserts")
            continue
        stmts = carry + u.prefix + u.stmts
        if k == steps_at[-1]:
            stmts += rest
        tests.append({"type": "check", "step": len(steps), "text": _step_text(u.stmts)})
        steps.append(stmts)
        carry = []
        if stats is not None:
            stats.add("tests_as_check_steps")
    return tests, (check_program(helpers, module_stmts, steps) if steps else "")


def prompt_helpers(prompt: str, entry_point: str) -> str:
    """The prompt's code without the function to implement: its imports and helper functions
    (HumanEval/10's ``is_palindrome``, HumanEval/38's ``encode_cyclic``), which the dataset's
    harness runs before the solution."""
    for src in (prompt, prompt.rstrip() + "\n    pass\n"):
        try:
            tree = ast.parse(src)
            break
        except SyntaxError:
            continue
    else:
        return ""
    lines = src.splitlines(keepends=True)
    drop: set[int] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            drop.update(range(first - 1, node.end_lineno or node.lineno))
    kept = "".join(line for i, line in enumerate(lines) if i not in drop)
    return kept if kept.strip() else ""


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
