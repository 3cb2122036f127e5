"""Assert-based tests (HumanEval, MBPP) judged as their authors meant them.

Simple asserts (``assert f(1, 2) == 3``, ``is True``, truthiness, ``abs(f(x) - v) < tol``) become
parent-judged call tests with Python's exact comparison; every other statement (loops over generated
inputs, asserts using helpers or local variables) is run as the dataset's own code, one test per
statement, in a judge sandbox (:func:`assert_tests`, :func:`check_program`). :func:`judge_settings`
says how each source judges (equality, prelude, time limit).
"""

from __future__ import annotations

import ast
import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from vpo.sandbox import TestCase, encode_value


class Counts(Protocol):
    """Where an import counts what it did (:class:`vpo.tasks.code_formats.ImportStats`)."""

    def add(self, key: str, n: int = 1) -> None: ...

__all__ = ["CANDIDATE", "JUDGE_DEFAULTS", "Counts", "assert_tests", "check_program", "judge_settings", "prompt_helpers"]

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


def _uses_candidate(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == CANDIDATE for n in ast.walk(node))


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


def assert_tests(
    source: str, entry_point: str, *, helpers: str = "", translate: bool = True, stats: Counts | None = None
) -> tuple[list[dict[str, Any]], str]:
    """Tests from assert-based test code: a HumanEval-style ``check(candidate)`` function or
    MBPP-style module-level asserts. One test per statement that calls the solution (the
    statements before it that do not, such as imports or assignments, run with it), in source
    order. With ``translate``, asserts of the shapes :func:`_translate` knows become parent-judged
    call tests with Python's exact semantics; every other statement (loops, helper-based or
    non-constant asserts) becomes a ``check`` step of the returned judge program, the dataset's
    own code, run in a judge sandbox that reaches the solution through the parent only.
    Returns (tests, judge program or "")."""
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
    renamer = _Rename(names - {CANDIDATE}, CANDIDATE)
    body = [ast.fix_missing_locations(renamer.visit(copy.deepcopy(s))) for s in body]
    bound = _bound_names(tree) | _bound_names(ast.parse(helpers) if helpers.strip() else ast.Module([], []))
    groups: list[tuple[list[ast.stmt], ast.stmt]] = []  # (statements before it, statement calling the solution)
    pending: list[ast.stmt] = []
    for stmt in body:
        if _uses_candidate(stmt):
            groups.append((pending, stmt))
            pending = []
        else:
            pending.append(stmt)  # statements after the last call cannot affect a verdict: not run
    tests: list[dict[str, Any]] = []
    steps: list[list[ast.stmt]] = []
    carry: list[ast.stmt] = []
    for prefix, stmt in groups:
        t = _translate(stmt.test, bound) if translate and isinstance(stmt, ast.Assert) else None
        if t is not None:
            carry.extend(prefix)  # still run, before the next judge step
            tests.append(t)
            if stats is not None:
                stats.add("tests_from_asserts")
            continue
        text = ast.unparse(stmt)
        tests.append({"type": "check", "step": len(steps), "text": text if len(text) <= 300 else text[:297] + "..."})
        steps.append(carry + prefix + [stmt])
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


