"""Importers for code datasets: small hand-written files in each supported format, converted,
loaded through the code task and judged in the sandbox with a right and a wrong solution."""

from __future__ import annotations

import base64
import json
import os
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from vpo.sandbox import private_view_available
from vpo.tasks.code import CodeTask
from vpo.tasks.code_asserts import assert_tests
from vpo.tasks.code_formats import (
    ImportStats,
    decode_lcb_tests,
    detect_format,
    load_problems,
    select_tests,
)


def linux_only(test: Callable[..., None]) -> Callable[..., None]:
    """A test that starts real sandboxes (Linux only)."""
    return pytest.mark.sandbox(pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux")(test))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def lcb_compress(cases: list[dict]) -> str:
    """The LiveCodeBench release's encoding of private tests: base64(zlib(pickle(json string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


LCB = [
    {
        "question_title": "Add two", "question_id": "lcb-stdin-1", "platform": "atcoder", "contest_date": "2024-09-01T00:00:00",
        "question_content": "Read a and b, print a+b.", "starter_code": "", "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": lcb_compress([{"input": "5 7\n", "output": "12\n", "testtype": "stdin"},
                                            {"input": "-1 1\n", "output": "0\n", "testtype": "stdin"}]),
        "metadata": "{}",
    },
    {
        "question_title": "Max pair", "question_id": "lcb-func-1", "platform": "leetcode", "contest_date": "2023-05-01T00:00:00",
        "question_content": "Return the largest sum of two different elements.",
        "starter_code": "class Solution:\n    def maxPair(self, nums: List[int], k: int) -> int:\n        ",
        "difficulty": "medium",
        "public_test_cases": json.dumps([{"input": "[1, 5, 3]\n0", "output": "8", "testtype": "functional"}]),
        "private_test_cases": json.dumps([{"input": "[2, 2]\n1", "output": "4", "testtype": "functional"},
                                          {"input": "[-1, -2, -3]\n2", "output": "-3", "testtype": "functional"}]),
        "metadata": json.dumps({"func_name": "maxPair"}),
    },
]

HUMANEVAL = [{
    "task_id": "HumanEval/0", "entry_point": "scale",
    "prompt": 'def scale(xs: list, f: float) -> list:\n    """Multiply every element by f."""\n',
    "canonical_solution": "    return [x * f for x in xs]\n",
    "test": (
        "METADATA = {}\n\n\ndef check(candidate):\n"
        "    assert candidate([1, 2], 2) == [2, 4]\n"
        "    assert candidate([], 3) == []\n"
        "    assert abs(candidate([0.1], 3)[0] - 0.3) < 1e-9\n"
        "    assert candidate([1], 0)\n"
        "    for i in range(3):\n        assert candidate([i], 1) == [i]\n"
    ),
}]

MBPP = [{
    "task_id": 11, "text": "Write a function to remove the first and last occurrence of a given character from the string.",
    "code": "def remove_Occ(s, ch):\n    s = s.replace(ch, '', 1)\n    i = s.rfind(ch)\n    return s if i < 0 else s[:i] + s[i + 1:]\n",
    "test_list": ['assert remove_Occ("hello","l") == "heo"', 'assert remove_Occ("abcda","a") == "bcd"',
                  'assert remove_Occ("PHP","P") == "H"'],
    "test_setup_code": "", "challenge_test_list": [],
}]

APPS = [
    {"problem_id": 4001, "question": "Print the square of n.", "difficulty": "introductory", "starter_code": "",
     "solutions": json.dumps(["print(int(input()) ** 2)"]),
     "input_output": json.dumps({"inputs": ["3\n", "-4\n"], "outputs": ["9\n", "16\n"]})},
    {"problem_id": 4002, "question": "Return the reversed string.", "difficulty": "interview", "starter_code": "def rev(s):\n\t",
     "solutions": json.dumps(["def rev(s):\n    return s[::-1]"]),
     "input_output": json.dumps({"fn_name": "rev", "inputs": [["abc"], ["x"]], "outputs": [["cba"], "x"]})},
]

DEEPCODER = [
    {"problem": "Return twice x.", "tests": json.dumps([
        {"type": "function_call", "fn_name": "double", "input": [3], "output": [6]},
        {"type": "function_call", "fn_name": "double", "input": [0], "output": [0]}]),
     "metadata": json.dumps({})},
    {"problem": "Print the number of words.", "tests": json.dumps([
        {"type": "stdin_stdout", "input": "a b c\n", "output": "3\n"},
        {"type": "stdin_stdout", "input": "one\n", "output": "1\n"}])},
    {"problem": "TACO: print the max.", "tests": json.dumps({"inputs": ["1 9 3\n", "4\n"], "outputs": ["9\n", "4\n"]})},
    {"problem": "LCB subset: return the product.", "tests": json.dumps([
        {"input": "2\n3", "output": "6", "testtype": "functional"},
        {"input": "-1\n5", "output": "-5", "testtype": "functional"}]),
     "metadata": {"func_name": "mul"}},
]


def test_detect_format() -> None:
    assert detect_format(LCB[0]) == "livecodebench"
    assert detect_format(HUMANEVAL[0]) == "humaneval"
    assert detect_format(MBPP[0]) == "mbpp"
    assert detect_format(APPS[0]) == "apps"
    assert detect_format(DEEPCODER[0]) == "deepcoder"
    assert detect_format({"id": "x", "prompt": "p", "tests": [{"type": "stdio", "input": "", "output": ""}]}) == "vpo"
    with pytest.raises(ValueError):
        detect_format({"foo": 1})


def test_lcb_private_tests_decoding_and_pickle_safety(tmp_path: Path) -> None:
    cases = [{"input": "1", "output": "2", "testtype": "stdin"}]
    assert decode_lcb_tests(lcb_compress(cases)) == cases
    assert decode_lcb_tests(json.dumps(cases)) == cases
    assert decode_lcb_tests(base64.b64encode(zlib.compress(json.dumps(cases).encode())).decode()) == cases

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(pickle.UnpicklingError):
        decode_lcb_tests(payload)
    assert not marker.exists()


def test_livecodebench_import(tmp_path: Path) -> None:
    stats = ImportStats()
    probs = load_problems(write_jsonl(tmp_path / "lcb.jsonl", LCB), stats=stats)
    stdin, func = probs
    assert [t["type"] for t in stdin["tests"]] == ["stdio"] * 3
    assert stdin["tests"][1] == {"type": "stdio", "input": "5 7\n", "output": "12\n"}
    assert func["entry_point"] == "maxPair" and func["tests"][0] == {"type": "call", "args": [[1, 5, 3], 0], "expected": 8}
    assert func["date"].startswith("2023-05-01") and "class Solution" in func["starter_code"]


def test_humaneval_import_keeps_every_assert(tmp_path: Path) -> None:
    stats = ImportStats()
    (prob,) = load_problems(write_jsonl(tmp_path / "he.jsonl", HUMANEVAL), stats=stats)
    kinds = [t["type"] for t in prob["tests"]]
    assert kinds == ["call", "call", "check", "call", "check"]  # the loop is kept, as a judge step
    assert prob["tests"][0] == {"type": "call", "args": [[1, 2], 2], "expected": [2, 4]}
    assert prob["tests"][3] == {"type": "call", "args": [[1], 0], "expected": None, "cmp": "truthy"}
    assert prob["tests"][2]["step"] == 0 and prob["tests"][4]["step"] == 1
    assert "for i in range(3)" in prob["check_code"] and "def __vpo_steps__(candidate)" in prob["check_code"]
    assert prob["judge"] == {"equality": "exact", "prelude": "none", "problem_timeout": 3.0}
    assert stats["tests_from_asserts"] == 3 and stats["tests_as_check_steps"] == 2
    assert prob["solutions"][0]["code"].startswith("def scale")


def test_assert_shapes_and_locals() -> None:
    src = ("def check(candidate):\n    x = [1]\n    assert candidate(x) == 1\n    assert candidate([2]) == 2\n"
           "    assert candidate(3 * 19) is True\n    assert not candidate('a' + 'b')\n"
           "    assert abs(candidate(1.5) - 0.5) < 1e-6\n    assert candidate(4) == (4, 4)\n")
    tests, code = assert_tests(src, "f")
    assert tests == [
        {"type": "check", "step": 0, "text": "assert candidate(x) == 1"},
        {"type": "call", "args": [[2]], "expected": 2},
        {"type": "call", "args": [57], "expected": True, "cmp": "is"},
        {"type": "call", "args": ["ab"], "expected": None, "cmp": "falsy"},
        {"type": "call", "args": [1.5], "expected": 0.5, "cmp": "abs_lt", "tol": 1e-06},
        {"type": "call", "args": [4], "expected": {"$t": [4, 4]}},  # a tuple stays a tuple
    ]
    assert "x = [1]" in code  # the local the judge step needs runs with it
    everything, code2 = assert_tests(src, "f", translate=False)
    assert [t["type"] for t in everything] == ["check"] * 6 and code2.count("yield None") == 6


def test_mbpp_import(tmp_path: Path) -> None:
    (prob,) = load_problems(write_jsonl(tmp_path / "mbpp.jsonl", MBPP))
    assert prob["entry_point"] == "remove_Occ"
    assert len(prob["tests"]) == 3 and prob["tests"][0] == {"type": "call", "args": ["hello", "l"], "expected": "heo"}
    assert 'remove_Occ("hello","l")' in prob["prompt"]


def test_apps_import(tmp_path: Path) -> None:
    path = tmp_path / "apps.json"
    path.write_text(json.dumps(APPS))
    stdio_p, call_p = load_problems(path)
    assert stdio_p["tests"] == [{"type": "stdio", "input": "3\n", "output": "9\n"}, {"type": "stdio", "input": "-4\n", "output": "16\n"}]
    assert call_p["entry_point"] == "rev"
    assert call_p["tests"][0]["expected"] == "cba" and call_p["tests"][0]["alternatives"] == [["cba"]]


def test_deepcoder_import(tmp_path: Path) -> None:
    probs = load_problems(write_jsonl(tmp_path / "dc.jsonl", DEEPCODER))
    assert [p["entry_point"] for p in probs] == ["double", None, None, "mul"]
    assert probs[0]["tests"][0]["expected"] == 6
    assert probs[2]["tests"][0] == {"type": "stdio", "input": "1 9 3\n", "output": "9\n"}
    assert probs[3]["tests"][1] == {"type": "call", "args": [-1, 5], "expected": -5}
    assert len({p["id"] for p in probs}) == 4


def test_vpo_schema_parquet_roundtrip(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "p1", "prompt": "Return x + 1.", "entry_point": "inc", "split": "test",
             "tests": json.dumps([{"type": "call", "args": [1], "expected": 2},
                                  {"type": "call", "args": [{"$t": [1]}], "expected": {"$t": [1, 1]}, "tol": 0.5}])},
            {"id": "p2", "prompt": "Echo.", "entry_point": None, "split": "train",
             "tests": json.dumps([{"type": "stdio", "input": "a", "output": "a"}])}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "probs.parquet")
    probs = load_problems(tmp_path / "probs.parquet")
    assert probs[0]["tests"][1] == {"type": "call", "args": [{"$t": [1]}], "expected": {"$t": [1, 1]}, "tol": 0.5}
    task = CodeTask(source=tmp_path / "probs.parquet")
    assert [r["id"] for r in task.load("test")] == ["p1"] and [r["id"] for r in task.load("train")] == ["p2"]


def test_folder_source_and_invalid_tests_dropped(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "a", "prompt": "x", "tests": [
        {"type": "stdio", "input": "", "output": "1"}, {"type": "stdio", "input": ""}]}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "b", "prompt": "y", "tests": [{"type": "call", "args": [], "expected": 1}]}) + "\n")
    stats = ImportStats()
    probs = load_problems(tmp_path, stats=stats)
    assert [p["id"] for p in probs] == ["a"] and len(probs[0]["tests"]) == 1
    assert stats["tests_invalid"] == 2 and stats["dropped_no_tests"] == 1


def test_select_tests_keeps_smallest_in_order() -> None:
    tests = [{"type": "stdio", "input": "x" * n, "output": ""} for n in (5, 1, 9, 2, 7)]
    kept = select_tests(tests, 3)
    assert [len(t["input"]) for t in kept] == [5, 1, 2]


@linux_only
@pytest.mark.parametrize(
    "name,records,right,wrong",
    [
        ("lcb", LCB, {"lcb-stdin-1": "a, b = map(int, input().split())\nprint(a + b)",
                      "lcb-func-1": "class Solution:\n    def maxPair(self, nums, k):\n        s = sorted(nums)\n        return s[-1] + s[-2]"},
         "print(0)\nclass Solution:\n    def maxPair(self, nums, k):\n        return 0"),
        ("humaneval", HUMANEVAL, {"HumanEval/0": "def scale(xs, f):\n    return [x * f for x in xs]"},
         "def scale(xs, f):\n    return xs"),
        ("mbpp", MBPP, {"11": MBPP[0]["code"]}, "def remove_Occ(s, ch):\n    return s"),
        ("apps", APPS, {"4001": "print(int(input()) ** 2)", "4002": "def rev(s):\n    return s[::-1]"},
         "print(1)\ndef rev(s):\n    return s"),
        ("deepcoder", DEEPCODER, None, "print(-1)\ndef double(x):\n    return x\ndef mul(a, b):\n    return a + b"),
    ],
)
def test_imported_problems_judged_in_sandbox(tmp_path: Path, name: str, records: list, right: dict | None, wrong: str) -> None:
    hide = private_view_available()  # without namespaces nothing can be hidden: accept it explicitly
    task = CodeTask(source=write_jsonl(tmp_path / f"{name}.jsonl", records), test_fraction=0.0, hide_source=hide)
    rows = task.load("train")
    assert len(rows) == len(records)
    dc_right = ["def double(x):\n    return 2 * x", "print(len(input().split()))", "print(max(map(int, input().split())))",
                "def mul(a, b):\n    return a * b"]
    for i, row in enumerate(rows):
        code = right[row["id"]] if right else dc_right[i]
        good = task.reward.score([code], row)[0]
        bad = task.reward.score([wrong], row)[0]
        n = row["n_tests"]
        assert (good[:n] == 1).all(), (row["id"], good)
        assert (bad[:n] < 1).any(), (row["id"], bad)
        assert row["id"] and "```" not in row["prompt"] or row["starter_code"]
