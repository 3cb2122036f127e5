"""Assert-based tests (HumanEval, MBPP) judged as their authors meant them.

Simple asserts (``assert f(1, 2) == 3``, ``is True``, truthiness, ``abs(f(x) - v) < tol``) become
parent-judged call tests with Python's exact comparison; every other statement of the test code
(loops over generated inputs, asserts using helpers or local variables) is run as the dataset's own
code, one test per statement, in a judge sandbox (:func:`assert_tests`, :func:`check_program`).
:func:`judge_settings` says how each source judges (equality, prelude, time limit).
"""

from __future__ import annotations

import ast
import builtins
import copy
import json
import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from vpo.sandbox import TestCase, encode_value

__all__ = ["CANDIDATE", "JUDGE_DEFAULTS", "Counts", "assert_tests", "check_program", "judge_settings", "prompt_helpers"]

log = logging.getLogger("vpo.tasks.code")


class Counts(Protocol):
    """Where an import counts what it did (:class:`vpo.tasks.code_formats.ImportStats`)."""

    def add(self, key: str, n: int = 1) -> None: ...


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
    source: str, entry_point: str, *, helpers: str = "", translate: bool = True, stats: Counts | None = None
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


