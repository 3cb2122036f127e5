"""Judging as a dataset's authors judge: per-job prelude, exact vs tolerant equality, one time
budget per problem, and ``check`` steps (the dataset's own test code run in a judge sandbox that
calls the candidate through the parent)."""

from __future__ import annotations

import os
import textwrap

import pytest

from vpo.sandbox import Job, Sandbox, SandboxConfig, Status, TestCase
from vpo.tasks.code_asserts import assert_tests

pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux"),
              pytest.mark.sandbox]

HELPERS = "def encode(s):\n    return s[::-1] + '!'\n"
CHECK = textwrap.dedent("""
    SECRET_EXPECTED = 'EXPECTED-' + 'judge-only'

    def check(candidate):
        assert candidate('ba' + '!') == 'ab'
        import random
        rng = random.Random(7)
        for _ in range(20):
            s = ''.join(rng.choice('xyz') for _ in range(rng.randint(1, 6)))
            assert candidate(encode(s)) == s
        assert candidate(encode('q')) == 'q', SECRET_EXPECTED
        try:
            candidate(None)
        except TypeError:
            pass
        else:
            assert False, 'expected a TypeError'
""")
RIGHT = "def decode(s):\n    return s[:-1][::-1]\n"


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    box = Sandbox(SandboxConfig(test_timeout=1.0, load_timeout=3.0, grace=0.3, workers=2))
    yield box
    box.close()


def _job(code: str, translate: bool = True, **kw: object) -> Job:
    tests, check_code = assert_tests(CHECK, "decode", helpers=HELPERS, translate=translate)
    return Job(HELPERS + code, tuple(TestCase.from_dict(t) for t in tests), "decode", check_code=check_code,
               equality="exact", **kw)


def statuses(res) -> list[str]:
    return [t.status.value for t in res.tests]


def test_check_steps_follow_the_test_code(sb: Sandbox) -> None:
    tests, check_code = assert_tests(CHECK, "decode", helpers=HELPERS)
    assert [t["type"] for t in tests] == ["call", "check", "check", "check"]  # the loop, helper, try: judge steps
    assert "def __vpo_steps__(candidate)" in check_code and "SECRET_EXPECTED" in check_code
    wrong_loop = "def decode(s):\n    if s == 'ba!':\n        return 'ab'\n    return s[:-1]\n"
    no_raise = "def decode(s):\n    return '' if s is None else s[:-1][::-1]\n"
    res = sb.run([_job(RIGHT), _job(wrong_loop), _job(no_raise), _job(RIGHT, translate=False)])
    # the last step catches the candidate's TypeError itself: a candidate exception during a step
    # fails it whatever the test code does with it (else swallowing one could fake a pass)
    assert statuses(res[0]) == ["pass", "pass", "pass", "error"], res[0].tests
    assert "the candidate raised TypeError" in res[0].tests[3].detail
    assert statuses(res[1]) == ["pass", "fail", "pass", "error"], res[1].tests  # only the loop has non-palindromes
    assert statuses(res[2]) == ["pass", "pass", "pass", "fail"], res[2].tests
    assert "expected a TypeError" in res[2].tests[3].detail
    assert statuses(res[3]) == ["pass", "pass", "pass", "error"]  # every assert run as the dataset's own code


def test_candidate_errors_timeouts_and_crashes_in_check_steps(sb: Sandbox) -> None:
    hang = textwrap.dedent("""
        import collections, itertools
        def decode(s):
            if s == 'ba!':  # a loop in C: only the parent's kill stops it
                collections.deque(itertools.repeat(0), maxlen=0)
            while s is None:  # a Python loop: the in-sandbox alarm stops it
                pass
            return s[:-1][::-1]
    """)
    crash = "import os\ndef decode(s):\n    if s == 'q!':\n        os._exit(3)\n    return s[:-1][::-1]\n"
    raising = "def decode(s):\n    raise ValueError('no')\n"
    res = sb.run([_job(hang), _job(crash), _job(raising)])
    h = res[0]
    assert statuses(h) == ["timeout", "pass", "pass", "timeout"], h.tests
    assert h.rounds == 2 and "CPU time limit" in h.tests[0].detail  # killed, then a fresh sandbox went on
    c = res[1]
    assert statuses(c) == ["pass", "pass", "error", "error"], c.tests
    assert "died" in c.tests[2].detail
    r = res[2]
    assert statuses(r) == ["error"] * 4 and all("ValueError" in t.detail for t in r.tests), r.tests


def test_candidate_cannot_see_the_judge(sb: Sandbox) -> None:
    snoop = textwrap.dedent("""
        import gc, os, sys
        def decode(s):
            needle = 'expected a ' + 'Type' + 'Error'  # a string only the judge's code holds
            found = []
            f = sys._getframe().f_back
            while f is not None:
                found += [repr(v) for v in f.f_locals.values()] + [repr(f.f_code.co_consts)]
                f = f.f_back
            for o in gc.get_objects():
                if isinstance(o, dict):
                    found += [v for v in o.values() if isinstance(v, str) and v is not needle]
            for pid in os.listdir('/proc'):
                try:
                    found.append(open('/proc/' + pid + '/cmdline').read())
                except OSError:
                    pass
            if any(needle in x for x in found):
                return 'LEAKED'
            return s[:-1][::-1]
    """)
    res = sb.run([_job(snoop)])[0]
    assert statuses(res) == ["pass", "pass", "pass", "error"], res.tests  # nothing leaked: it behaved like RIGHT


def test_prelude_is_per_job(sb: Sandbox) -> None:
    code = "def f(xs):\n    return Counter(xs).most_common(1)[0][0]\n"
    tests = (TestCase.call([[1, 2, 2]], 2),)
    default, none = sb.run([Job(code, tests, "f"), Job(code, tests, "f", prelude="")])
    assert default.all_passed
    assert none.tests[0].status is Status.ERROR and "NameError" in none.tests[0].detail


def test_equality_modes(sb: Sandbox) -> None:
    code = "def f(x):\n    return (1, 2) if x == 0 else 1\n"
    tests = (TestCase.call([0], [1, 2]), TestCase.call([1], True, cmp="is"), TestCase.call([1], True))
    tolerant, exact = sb.run([Job(code, tests, "f"), Job(code, tests, "f", equality="exact")])
    assert statuses(tolerant) == ["pass", "fail", "pass"]
    assert statuses(exact) == ["fail", "fail", "pass"]  # tuple != list; 1 is not True; 1 == True


def test_problem_timeout_is_one_budget_for_all_tests(sb: Sandbox) -> None:
    """The budget is spent in CPU seconds charged to the candidate: a busy machine stretches
    the wall clock, never the charge."""
    code = "def f(x):\n    while True:\n        pass\n"
    tests = tuple(TestCase.call([i], i) for i in range(6))
    per_test, per_problem = sb.run([Job(code, tests[:3], "f"), Job(code, tests, "f", problem_timeout=0.6)])
    assert statuses(per_test) == ["timeout"] * 3 and statuses(per_problem) == ["timeout"] * 6
    assert 0.6 <= per_problem.cpu < 0.6 + 2 * 0.3 + 0.2, per_problem.cpu  # the budget, overrun by at most the grace
    assert "budget" in per_problem.tests[-1].detail
    assert sum(t.cpu > 0 for t in per_problem.tests) == 1  # then the rest are not run at all
    assert per_test.cpu >= 3 * 1.0  # a limit per test: every test ran to its own limit


def test_a_swallowed_candidate_exception_fails_the_step(sb: Sandbox) -> None:
    """``all(map(...))`` stops at a StopIteration from the candidate and calls the rest true; so
    does an ``except Exception`` in the test code. Both fail here; the honest answer passes."""
    check = textwrap.dedent("""
        def __vpo_steps__(candidate):
            for body in (lambda: all(map(lambda x: candidate(x) == 2 * x, range(10))),
                         lambda: [candidate(x) for x in range(3)]):
                try:
                    try:
                        assert body()
                    except Exception:
                        pass
                except BaseException as e:
                    yield e
                else:
                    yield None
    """)
    tests = (TestCase.check(0, "all(map)"), TestCase.check(1, "except Exception"))
    stop = "def f(x):\n    raise StopIteration\n"
    honest = "def f(x):\n    return 2 * x\n"
    bad, good = sb.run([Job(stop, tests, "f", check_code=check), Job(honest, tests, "f", check_code=check)])
    assert statuses(bad) == ["error", "error"], bad.tests
    assert all("the candidate raised StopIteration" in t.detail for t in bad.tests)
    assert statuses(good) == ["pass", "pass"], good.tests


def test_expr_tests_compute_on_plain_values_in_the_judge(sb: Sandbox) -> None:
    """``add(2, 3) == 5`` is evaluated by the judge on the plain value add returned: an int
    subclass whose ``__eq__`` is always true (or an object) cannot pass it; module-level values
    the expression reads arrive as data."""
    liar = textwrap.dedent("""
        class Yes(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        SCALE = Yes(10)
        def add(a, b):
            return Yes(a - b)
    """)
    honest = "SCALE = 10\ndef add(a, b):\n    return a + b\n"
    tests = (TestCase.expression("add(2, 3) == 5", True, cmp="is"), TestCase.expression("add(2, 3) * SCALE", 50),
             TestCase.expression("[add(i, i) for i in range(3)]", [0, 2, 4]), TestCase.expression("SCALE == 10", True))
    bad, good = sb.run([Job(liar, tests, "add", equality="exact"), Job(honest, tests, "add", equality="exact")])
    assert statuses(good) == ["pass"] * 4, good.tests
    assert statuses(bad) == ["fail", "fail", "fail", "pass"], bad.tests  # its SCALE is the plain 10
    assert bad.tests[0].output == "False"

