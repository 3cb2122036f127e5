"""Builds ``problems.jsonl``, the embedded code task, from ``problems.yaml``: 48 problems written for
this project.

Each problem has a short ASCII statement, one or more reference solutions (several problems
have two or three solutions with genuinely different strategies, used for demonstrations and
to cross-check each other), and deterministic tests whose inputs its ``tests`` expression draws
and whose expected outputs are computed here by running the first reference; every other
reference must agree on every test.

    python -m vpo.data.code.build            # rewrite problems.jsonl next to this file
    python -m vpo.data.code.build --check    # exit 1 if problems.jsonl is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vpo.data.code.source import SOURCE, ProblemSourceError, ProblemSpec, load_problems

OUT = Path(__file__).with_name("problems.jsonl")


# -- helpers a problem's ``tests`` expression may call ------------------------------------------------
def ints(r: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [r.randint(lo, hi) for _ in range(n)]


def line(xs: list[Any]) -> str:
    return " ".join(map(str, xs))


def matrix_text(r: random.Random, rows: int, cols: int) -> str:
    return f"{rows} {cols}\n" + "".join(line(ints(r, cols, -9, 99)) + "\n" for _ in range(rows))


def word_lines(words: list[str]) -> str:
    return f"{len(words)}\n" + "".join(w + "\n" for w in words)


def bit_grid(r: random.Random, h: int, w: int) -> str:
    return f"{h} {w}\n" + "".join("".join(r.choice("0001") for _ in range(w)) + "\n" for _ in range(h))


def knapsack_text(r: random.Random, n: int) -> str:
    return f"{n} {r.randint(1, 60)}\n" + "".join(f"{r.randint(1, 20)} {r.randint(1, 50)}\n" for _ in range(n))


def intervals_text(r: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        a = r.randint(0, 40)
        out.append(f"{a} {a + r.randint(0, 6)}\n")
    return f"{n}\n" + "".join(out)


def matmul_args(r: random.Random, p: int, q: int, k: int) -> list[Any]:
    return [[ints(r, q, -5, 5) for _ in range(p)], [ints(r, k, -5, 5) for _ in range(q)]]


def search_args(r: random.Random, xs: list[int]) -> list[Any]:
    return [xs, r.choice([*xs, 1000])]


def grid(r: random.Random, h: int, w: int) -> str:
    g = [["#" if r.random() < 0.25 else "." for _ in range(w)] for _ in range(h)]
    cells = [(i, j) for i in range(h) for j in range(w)]
    (si, sj), (ei, ej) = r.sample(cells, 2)
    g[si][sj], g[ei][ej] = "S", "E"
    return f"{h} {w}\n" + "".join("".join(row) + "\n" for row in g)


def two_sum(r: random.Random, n: int) -> str:
    while True:
        a = r.sample(range(1, 1000), n)
        i, j = sorted(r.sample(range(n), 2))
        t = a[i] + a[j]
        pairs = [(p, q) for p in range(n) for q in range(p + 1, n) if a[p] + a[q] == t]
        if len(pairs) == 1:
            return f"{n} {t}\n{line(a)}\n"


TEST_HELPERS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (ints, line, matrix_text, word_lines, bit_grid, knapsack_text, intervals_text, matmul_args,
                            search_args, grid, two_sum)}


def draw_inputs(spec: ProblemSpec) -> list[Any]:
    """The inputs ``spec.tests`` draws with ``r`` seeded by the problem's id (stdio: input texts; call:
    argument lists)."""
    namespace = {**TEST_HELPERS, "r": random.Random(f"vpo-code-{spec.id}")}
    try:
        inputs = eval(compile(f"({spec.tests})", spec.where("tests"), "eval"), namespace)
    except Exception as exc:
        raise ProblemSourceError(f"{spec.where('tests')}: problem {spec.id!r}: tests: {type(exc).__name__}: {exc}") from exc
    if not isinstance(inputs, list) or not inputs:
        raise ProblemSourceError(f"{spec.where('tests')}: problem {spec.id!r}: tests must give a non-empty list of "
                                 f"inputs, got {inputs!r:.80}")
    return inputs


# -- building ---------------------------------------------------------------------------------------
def run_stdio(code: str, data: str) -> str:
    out = io.StringIO()
    old_in, old_out = sys.stdin, sys.stdout
    sys.stdin, sys.stdout = io.StringIO(data), out
    try:
        with contextlib.suppress(SystemExit):
            exec(compile(code, "<reference>", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own references
    finally:
        sys.stdin, sys.stdout = old_in, old_out
    return out.getvalue()


PRELUDE = "from typing import *\n"


def run_call(code: str, entry: str, args: list[Any]) -> Any:
    ns: dict[str, Any] = {"__name__": "__solution__"}
    exec(compile(PRELUDE + code, "<reference>", "exec"), ns)  # noqa: S102 - our own references
    fn = ns.get(entry)
    if fn is None:
        fn = getattr(ns["Solution"](), entry)
    return fn(*copy.deepcopy(args))


def build(path: Path = SOURCE) -> list[dict[str, Any]]:
    """All problems in the vpo schema, expected outputs computed from the references."""
    from vpo.sandbox import TestCase, stdout_matches, values_match

    records = []
    for prob in load_problems(path):
        strategies = list(prob.solutions.items())
        tests = []
        for inp in draw_inputs(prob):
            if prob.entry_point is None:
                expected = run_stdio(strategies[0][1], inp)
                for name, code in strategies[1:]:
                    got = run_stdio(code, inp)
                    if not stdout_matches(expected, got):
                        raise AssertionError(f"{prob.id}: strategy {name} disagrees on {inp!r}: {got!r} vs {expected!r}")
                tests.append(TestCase.stdio(inp, expected).to_dict())
            else:
                expected = run_call(strategies[0][1], prob.entry_point, inp)
                for name, code in strategies[1:]:
                    got = run_call(code, prob.entry_point, inp)
                    if not values_match(expected, got):
                        raise AssertionError(f"{prob.id}: strategy {name} disagrees on {inp!r}: {got!r} vs {expected!r}")
                tests.append(TestCase.call(inp, expected).to_dict())
        records.append({
            "id": prob.id,
            "title": prob.title,
            "prompt": prob.statement,
            "entry_point": prob.entry_point,
            "starter_code": prob.starter if prob.entry_point else "",
            "tests": tests,
            "solutions": [{"strategy": k, "code": v} for k, v in prob.solutions.items()],
            "difficulty": prob.difficulty,
            "tags": prob.tags,
        })
    return records


def dumps(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that problems.jsonl is up to date")
    args = ap.parse_args(argv)
    records = build()
    text = dumps(records)
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date; run python -m vpo.data.code.build", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {len(records)} problems to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
