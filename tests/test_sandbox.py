"""Sandbox behaviour: codec, judging rules, and running real programs (stdio, call, expr)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo.sandbox import (
    Job,
    Sandbox,
    SandboxConfig,
    SandboxError,
    Status,
    TestCase,
    decode_value,
    default_hide_paths,
    encode_value,
    stdout_matches,
    values_match,
)
from vpo.sandbox._harness import CodecError
from vpo.sandbox.compare import judge_value, render_value


def linux_only(test: Callable[..., None]) -> Callable[..., None]:
    """A test that starts real sandboxes (Linux only)."""
    return pytest.mark.sandbox(pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux")(test))


# ---------------------------------------------------------------------------------------------
# codec


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=10)
)
hashables = st.recursive(scalars, lambda inner: st.tuples(inner, inner), max_leaves=5)
values = st.recursive(
    st.one_of(scalars, hashables),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(hashables, inner, max_size=3),
        st.frozensets(hashables, max_size=3),
        st.sets(hashables, max_size=3),
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(values)
def test_codec_roundtrip_preserves_types(v: object) -> None:
    import json

    wire = json.loads(json.dumps(encode_value(v)))
    back = decode_value(wire)
    assert back == v
    assert type(back) is type(v)


def test_codec_non_finite_floats_and_subclasses() -> None:
    import collections

    back = decode_value(encode_value([math.inf, -math.inf, math.nan]))
    assert back[0] == math.inf and back[1] == -math.inf and math.isnan(back[2])
    assert decode_value(encode_value(collections.Counter("aab"))) == {"a": 2, "b": 1}
    Point = collections.namedtuple("Point", "x y")
    assert decode_value(encode_value(Point(1, 2))) == (1, 2)


def test_codec_rejects_objects_and_reduces_eq_overrides() -> None:
    class Liar:
        def __eq__(self, other: object) -> bool:
            return True

    class LyingInt(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    with pytest.raises(CodecError):
        encode_value(Liar())
    wire = encode_value(LyingInt(3))
    assert type(wire) is int and wire == 3
    nested: list = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(CodecError):
        encode_value(nested)


# ---------------------------------------------------------------------------------------------
# judging rules


def test_stdout_whitespace_and_float_rules() -> None:
    assert stdout_matches("1 2\n3\n", "1 2 \n3")
    assert stdout_matches("1 2\n3", "1\n2 3\n\n")  # token judge: line breaks are not significant
    assert stdout_matches("0.3333333", "0.33333334")
    assert stdout_matches("2", "2.0000000")
    assert not stdout_matches("0.5", "0.51")
    assert not stdout_matches("YES", "yes")
    assert not stdout_matches("1 2", "1 2 3")
    assert not stdout_matches("nan", "inf")
    assert not stdout_matches("3", "")


def test_values_match_rules() -> None:
    assert values_match([1, (2, 3)], [1, [2, 3]])
    assert values_match({"a": 0.1 + 0.2}, {"a": 0.3})
    assert values_match(math.nan, math.nan)
    assert values_match(2, 2.0)
    assert values_match(True, 1)  # Python equality
    assert values_match({1, 2}, {2, 1})
    assert not values_match({1, 2}, [1, 2])
    assert not values_match("1", 1)
    assert not values_match([1, 2], [1, 2, 3])
    assert not values_match({"a": 1}, {"a": 1, "b": 2})
    assert not values_match(1.0, 1.1)
    assert not values_match(None, 0)
    assert not values_match(math.inf, 1e308)


def test_testcase_schema_roundtrip_and_validation() -> None:
    cases = [
        TestCase.stdio("1 2\n", "3\n"),
        TestCase.call([[1, 2], (3, 4), {5: "x"}], {"k": (1, 2)}),
        TestCase.expression("f(2) + 1", 5),
        TestCase.call([1], [1], alternatives=[[[1]]]),
    ]
    for case in cases:
        assert TestCase.from_dict(case.to_dict()) == case
    with pytest.raises(ValueError):
        TestCase(kind="shell")
    with pytest.raises(ValueError):
        TestCase(kind="stdio", input="1", expected=3)
    with pytest.raises(ValueError):
        Job("def f(): pass", (TestCase.call([], None),), entry_point=None)


def test_hide_paths_refuse_system_dirs_and_name_them(tmp_path: object) -> None:
    hidden = default_hide_paths(defaults=True)
    for d in ("/", "/usr", "/etc", "/tmp", "/proc", "/dev", "/var"):
        assert d not in hidden
    assert all(not any(p != q and p.startswith(q + "/") for q in hidden) for p in hidden)
    data = tmp_path / "data.jsonl"
    data.write_text("{}")
    assert default_hide_paths([str(data)], defaults=False) == [str(data.resolve())]
    for bad in ("/", "/usr", "/var", "/lib"):
        with pytest.raises(ValueError, match=f"cannot hide {bad}"):
            default_hide_paths([bad], defaults=False)
    with pytest.raises(SandboxError, match="cannot hide /etc"):
        Sandbox(SandboxConfig(hide_paths=("/etc",)))


def test_codec_big_ints_collisions_and_bad_tags() -> None:
    import json
    import time

    big = 7 ** 20000
    wire = json.loads(json.dumps(encode_value([big, -big, 10 ** 400])))
    assert "$x" in json.dumps(wire) and decode_value(wire) == [big, -big, 10 ** 400]
    # a set / dict of keys that all hash alike would take quadratic time to build (~10^8 comparisons,
    # tens of CPU seconds): refused after linear work. CPU time of this process, not wall time, so a busy
    # machine does not fail it
    p = (1 << 61) - 1
    colliding = {"$s": [k * p for k in range(20_000)]}
    t0 = time.process_time()
    with pytest.raises(CodecError, match="hash"):
        decode_value(colliding)
    with pytest.raises(CodecError, match="hash"):
        decode_value({"$d": [[k * p, 0] for k in range(20_000)]})
    assert time.process_time() - t0 < 1.0
    assert len(decode_value({"$s": list(range(5000))})) == 5000  # ordinary sets are fine
    deep: object = 0
    for _ in range(150):
        deep = [deep]
    with pytest.raises(CodecError):
        decode_value(deep)
    for bad in ({"$s": 5}, {"$d": [[1]]}, {"$f": "x"}, {"$c": [1]}, {"$x": "zz"}, {"$b": 3}, {"$d": [[{"a": 1}, 1]]}):
        with pytest.raises((CodecError, ValueError)):
            decode_value(bad)


def test_exact_and_tolerant_judges() -> None:
    # tolerant: integers are exact, floats within tolerance, tuple == list
    assert not values_match(1_000_000_007, 1_000_000_000)
    assert not values_match(1_000_000_007, 1_000_000_000.0)
    assert values_match(0.5, 0.5000000001) and values_match([1, 2], (1, 2))
    assert not values_match(0.5, 10 ** 400) and not values_match(10 ** 400, 1e300)
    assert not stdout_matches("1000000007", "1000000000")
    assert not stdout_matches("1000000007", "1000000000.0")
    assert not stdout_matches("1000", "1_000")
    assert stdout_matches("2", "2.000") and stdout_matches("1.5", "1.5000001")
    # exact: Python's own ==
    assert judge_value("eq", [1, 2], [1, 2], equality="exact")
    assert not judge_value("eq", [1, 2], (1, 2), equality="exact")
    assert not judge_value("eq", 0.5, 0.5000000001, equality="exact")
    assert judge_value("eq", True, 1, equality="exact")  # True == 1 in Python, as the dataset's assert
    assert not judge_value("is", True, 1) and judge_value("is", True, True) and judge_value("is_not", None, 0)
    assert judge_value("truthy", None, [0]) and not judge_value("truthy", None, 0) and judge_value("falsy", None, "")
    assert judge_value("abs_lt", 0.33, 0.3300001, tol=1e-6) and not judge_value("abs_lt", 0.33, 0.34, tol=1e-6)
    assert not judge_value("abs_lt", 0.5, 10 ** 400, tol=1e-6)  # OverflowError in Python: a failed assert
    assert not judge_value("abs_lt", 0.5, [1], tol=1e-6)  # TypeError in Python: a failed assert
    assert judge_value("ne", 3, 4, equality="exact") and not judge_value("ne", 3, 3, equality="tolerant")
    assert render_value(10 ** 5000).startswith("<int of") and len(render_value(list(range(10 ** 5)))) <= 2003


def test_testcase_cmp_and_check_schema() -> None:
    cases = [TestCase.call([1], True, cmp="is"), TestCase.call([2], 0.5, cmp="abs_lt", tol=1e-6),
             TestCase.call([3], None, cmp="falsy"), TestCase.check(4, "for x in range(3): ...")]
    for case in cases:
        assert TestCase.from_dict(case.to_dict()) == case
    with pytest.raises(ValueError):
        TestCase.call([1], 5, cmp="is")
    with pytest.raises(ValueError):
        TestCase.call([1], 5, cmp="abs_lt")
    with pytest.raises(ValueError):
        TestCase.call([1], 5, cmp="approximately")
    with pytest.raises(ValueError):
        Job("def f(): pass", (TestCase.check(0),), "f")  # no check_code
    with pytest.raises(ValueError):
        Job("def f(): pass", (TestCase.call([], 1),), "f", equality="loose")


# ---------------------------------------------------------------------------------------------
# running programs


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    box = Sandbox(SandboxConfig(test_timeout=1.5, load_timeout=3.0, grace=0.3, workers=2))
    yield box
    box.close()


def _statuses(res) -> list[str]:
    return [t.status.value for t in res.tests]


@linux_only
def test_stdio_program_pass_and_fail(sb: Sandbox) -> None:
    code = "a, b = map(int, input().split())\nprint(a + b)\n"
    res = sb.run_one(code, [TestCase.stdio("1 2\n", "3\n"), TestCase.stdio("10 20", "30"), TestCase.stdio("2 2", "5")])
    assert _statuses(res) == ["pass", "pass", "fail"]
    assert res.tests[2].output.strip() == "4"
    assert res.rounds == 1


@linux_only
def test_stdio_reading_styles_and_exit(sb: Sandbox) -> None:
    progs = [
        "import sys\ndata = sys.stdin.read().split()\nsys.stdout.write(str(sum(map(int, data))) + '\\n')",
        "import sys\nn = sum(int(x) for x in sys.stdin.buffer.read().split())\nprint(n)\nexit(0)",
        "import os\nn = sum(map(int, open(0).read().split()))\nos.write(1, (str(n) + '\\n').encode())",
        "import sys\ninput = sys.stdin.readline\nprint(sum(map(int, input().split())))\nsys.exit()",
        ("import io, os, sys\nout = io.StringIO()\nout.write(str(sum(map(int, sys.stdin.read().split()))))\n"
         "sys.stdout.write(out.getvalue())"),
        "def main():\n    print(sum(map(int, input().split())))\nif __name__ == '__main__':\n    main()",
    ]
    tests = [TestCase.stdio("1 2 3", "6"), TestCase.stdio("4 5", "9")]
    results = sb.run([Job(p, tests) for p in progs])
    for prog, res in zip(progs, results):
        assert _statuses(res) == ["pass", "pass"], (prog, res.tests)


@linux_only
def test_stdio_float_tolerance(sb: Sandbox) -> None:
    res = sb.run_one("print(1/3)", [TestCase.stdio("", "0.333333"), TestCase.stdio("", "0.34")])
    assert _statuses(res) == ["pass", "fail"]


@linux_only
def test_call_tests_function_and_solution_class(sb: Sandbox) -> None:
    fn = "def add(a, b):\n    return a + b\n"
    cls = "class Solution:\n    def add(self, a: int, b: int) -> int:\n        return a + b\n"
    tests = [TestCase.call([1, 2], 3), TestCase.call([0.1, 0.2], 0.3), TestCase.call([[1], [2]], [1, 2]), TestCase.call([1, 1], 3)]
    for code in (fn, cls):
        res = sb.run_one(code, tests, "add")
        assert _statuses(res) == ["pass", "pass", "pass", "fail"]


@linux_only
def test_call_uses_prelude_and_alternatives(sb: Sandbox) -> None:
    code = "class Solution:\n    def top(self, nums: List[int]) -> List[int]:\n        return [Counter(nums).most_common(1)[0][0]]\n"
    res = sb.run_one(code, [TestCase.call([[1, 2, 2]], 2, alternatives=[[2]]), TestCase.call([[3]], [3])], "top")
    assert _statuses(res) == ["pass", "pass"]


@linux_only
def test_expr_tests(sb: Sandbox) -> None:
    code = "def sq(x):\n    return x * x\n"
    res = sb.run_one(code, [TestCase.expression("sq(3) + sq(4)", 25), TestCase.expression("[sq(i) for i in range(3)]", (0, 1, 4)),
                            TestCase.expression("sq(2)", 5)])
    assert _statuses(res) == ["pass", "pass", "fail"]


@linux_only
def test_all_tests_of_a_candidate_share_one_process(sb: Sandbox) -> None:
    code = "import os\ncalls = []\ndef f(x):\n    calls.append(x)\n    return [len(calls), os.getpid()]\n"
    res = sb.run_one(code, [TestCase.call([i], None) for i in range(5)], "f")
    outs = [eval(t.output) for t in res.tests]  # plain data rendered by the parent
    assert [o[0] for o in outs] == [1, 2, 3, 4, 5]
    assert len({o[1] for o in outs}) == 1
    assert res.rounds == 1


@linux_only
def test_python_timeout_keeps_later_tests_in_the_same_process(sb: Sandbox) -> None:
    code = "def f(x):\n    while x:\n        pass\n    return 7\n"
    res = sb.run_one(code, [TestCase.call([1], 7), TestCase.call([0], 7)], "f")
    assert _statuses(res) == ["timeout", "pass"]
    assert res.rounds == 1


@linux_only
def test_crash_restarts_remaining_tests(sb: Sandbox) -> None:
    code = "import os\ndef f(x):\n    if x == 1:\n        os._exit(0)\n    return x\n"
    res = sb.run_one(code, [TestCase.call([0], 0), TestCase.call([1], 1), TestCase.call([2], 2)], "f")
    assert _statuses(res) == ["pass", "error", "pass"]
    assert res.rounds == 2
    assert "died" in res.tests[1].detail


@linux_only
def test_load_errors(sb: Sandbox) -> None:
    bad = sb.run([
        Job("def f(:\n", (TestCase.call([1], 1), TestCase.call([2], 2)), "f"),
        Job("raise ValueError('boom')\n", (TestCase.call([1], 1),), "f"),
        Job("def g(x):\n    return x\n", (TestCase.call([1], 1),), "f"),
        Job("print(", (TestCase.stdio("", ""),)),
    ])
    assert _statuses(bad[0]) == ["error", "error"] and "SyntaxError" in bad[0].tests[0].detail
    assert "boom" in bad[1].tests[0].detail
    assert "entry point 'f'" in bad[2].tests[0].detail
    assert _statuses(bad[3]) == ["error"]


@linux_only
def test_runtime_errors_and_unsupported_return(sb: Sandbox) -> None:
    code = "def f(x):\n    if x == 0:\n        return 1 // x\n    return object()\n"
    res = sb.run_one(code, [TestCase.call([0], 1), TestCase.call([1], 1)], "f")
    assert _statuses(res) == ["error", "error"]
    assert "ZeroDivisionError" in res.tests[0].detail
    assert "unsupported value type" in res.tests[1].detail


@linux_only
def test_batch_order_and_parallel_results(sb: Sandbox) -> None:
    jobs = [Job(f"def f():\n    return {i}\n", (TestCase.call([], i), TestCase.call([], i + 1)), "f") for i in range(12)]
    results = sb.run(jobs)
    assert [r.passed for r in results] == [[True, False]] * 12


@linux_only
def test_work_dir_is_private_writable_and_fresh(sb: Sandbox) -> None:
    writer = (
        "import os\ndef f(x):\n    if x == 0:\n        open('note.txt', 'w').write('hi')\n"
        "    return [os.getcwd(), sorted(os.listdir('.')), open('note.txt').read() if os.path.exists('note.txt') else None]\n"
    )
    res = sb.run([Job(writer, (TestCase.call([0], None), TestCase.call([1], None)), "f"),
                  Job(writer, (TestCase.call([1], None),), "f")])
    first, second = (eval(t.output) for t in res[0].tests)
    assert first[2] == "hi" and second[2] == "hi"
    other = eval(res[1].tests[0].output)
    assert other[1] == [] and other[2] is None  # another candidate never sees it


@linux_only
def test_environment_is_scrubbed(sb: Sandbox) -> None:
    os.environ["VPO_SANDBOX_PARENT_ONLY"] = "parent-secret"
    try:
        res = sb.run_one("import os\ndef f():\n    return sorted(os.environ)\n", [TestCase.call([], None)], "f")
    finally:
        del os.environ["VPO_SANDBOX_PARENT_ONLY"]
    assert set(eval(res.tests[0].output)) <= {"PATH", "HOME", "LANG", "TMPDIR"}


@linux_only
def test_protections_reported(sb: Sandbox) -> None:
    prot = sb.probe()
    assert prot["mode"] in ("root", "userns", "none")
    if prot["mode"] != "none":
        assert prot["netns"] and prot["pidns"] and prot["readonly_root"] and prot["private_tmp"]
        assert prot["caps"] == "0000000000000000"
    assert prot["uid"] != 0
    assert prot["rlimits"]["RLIMIT_NPROC"] >= 1 and prot["rlimits"]["RLIMIT_AS"] > 0


@linux_only
def test_namespaces_off_warns_and_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    from vpo.sandbox import config as sandbox_config

    sandbox_config._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vpo.sandbox"), Sandbox(SandboxConfig(namespaces="off", workers=1)) as box:
        res = box.run_one("print(int(input()) * 2)", [TestCase.stdio("21", "42")])
    assert res.all_passed
    assert res.protections["mode"] == "none" and not res.protections["netns"]
    assert any("WITHOUT Linux namespaces" in r.getMessage() for r in caplog.records)


@linux_only
def test_require_mode_runs_when_isolation_is_available(sb: Sandbox) -> None:
    if sb.probe()["mode"] == "none":
        pytest.skip("no namespaces here")
    with Sandbox(SandboxConfig(namespaces="require", workers=1)) as box:
        assert box.run_one("print(1)", [TestCase.stdio("", "1")]).all_passed


def test_status_strings() -> None:
    assert {s.value for s in Status} == {"pass", "fail", "error", "timeout"}
