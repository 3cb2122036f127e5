"""The embedded code problems' source file: it loads and validates, and a bad entry is one error that
names the file, the line and the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from vpo.data.code import build
from vpo.data.code.source import SOURCE, ProblemSourceError, load_problems

GOOD = '''\
- id: add-two
  title: Add two numbers
  difficulty: easy
  statement: Read a and b on one line; print a + b.
  solutions:
    plain: |
      a, b = map(int, input().split())
      print(a + b)
  tests: |
    ["1 2\\n"] + [f"{a} {b}\\n" for a, b in zip(ints(r, 3, 0, 9), ints(r, 3, 0, 9))]

- id: double
  title: Double
  difficulty: medium
  tags: [math]
  entry_point: double
  starter: |
    def double(x: int) -> int:
  statement: Return twice x.
  solutions:
    times: "def double(x):\\n    return 2 * x"
    plus: |
      def double(x):
          return x + x
  tests: |
    [[0], [r.randint(1, 9)]]
'''


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "problems.yaml"
    path.write_text(text)
    return path


def test_the_embedded_file_loads_with_unique_ids_and_every_test_expression_draws() -> None:
    problems = load_problems()
    assert len(problems) == 48 and len({p.id for p in problems}) == 48
    assert sum(p.entry_point is None for p in problems) == 25
    for p in problems:
        inputs = build.draw_inputs(p)
        assert inputs and all(isinstance(i, str if p.entry_point is None else list) for i in inputs), p.id
        assert p.where("tests").startswith(f"{SOURCE}:")


def test_a_small_file_builds_into_checked_records(tmp_path: Path) -> None:
    records = build.build(_write(tmp_path, GOOD))
    assert [r["id"] for r in records] == ["add-two", "double"]
    add, double = records
    assert add["entry_point"] is None and add["tests"][0]["output"] == "3\n" and len(add["tests"]) == 4
    assert double["starter_code"] == "def double(x: int) -> int:\n" and double["tags"] == ["math"]
    assert [s["code"] for s in double["solutions"]] == ["def double(x):\n    return 2 * x\n",
                                                        "def double(x):\n    return x + x\n"]
    # the same file draws the same tests: r is seeded by the problem's id
    assert build.build(_write(tmp_path, GOOD)) == records


def _error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ProblemSourceError) as info:
        build.build(_write(tmp_path, text))
    return str(info.value)


@pytest.mark.parametrize(("old", "new", "where", "fragment"), [
    ("  difficulty: medium\n", "  difficulty: tricky\n", 14, "problem 'double': difficulty: Input should be 'easy'"),
    ("  tags: [math]\n", "  tags: [math]\n  author: me\n", 16, "problem 'double': author: Extra inputs are not permitted"),
    ("  starter: |\n    def double(x: int) -> int:\n", "", 12, "problem 'double': Value error, a call problem has both"),
    ("- id: double\n", "- id: add-two\n", 12, "problem 'add-two': id already used at line 1"),
    ("- id: double\n", "- id: Double Trouble\n", 12, "problem 'Double Trouble': id: String should match pattern"),
    ("    [[0], [r.randint(1, 9)]]\n", "    [[0], [r.randint(1, 9)]\n", 25, "tests: Value error, not a Python expression"),
    ("    [[0], [r.randint(1, 9)]]\n", "    [[0], [rand(1, 9)]]\n", 25, "problem 'double': tests: NameError: name 'rand'"),
    ("    [[0], [r.randint(1, 9)]]\n", "    []\n", 25, "tests must give a non-empty list of inputs"),
    ("  statement: Return twice x.\n", "  statement: Return twice x \u2014 exactly.\n", 12, "non-ASCII text: '\u2014'"),
    ("  solutions:\n    times:", "  solutions:\n   times:", 22, "not valid YAML"),
])
def test_a_bad_entry_names_file_line_and_problem(tmp_path: Path, old: str, new: str, where: int,
                                                 fragment: str) -> None:
    assert old in GOOD
    message = _error(tmp_path, GOOD.replace(old, new, 1))
    assert message.startswith(f"{tmp_path / 'problems.yaml'}:{where}: "), message
    assert fragment in message, message


def test_a_file_that_is_not_a_list_is_refused(tmp_path: Path) -> None:
    assert "expected a list of problems, got dict" in _error(tmp_path, "id: x\n")
