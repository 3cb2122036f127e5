"""The code task: embedded problems, splits, prompts, and the per-test vector reward."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from vpo.rewards import score_set
from vpo.sandbox import Job, Sandbox, SandboxConfig, TestCase, private_view_available
from vpo.tasks import get_task
from vpo.tasks.code import EMBEDDED_PROBLEMS, CodeTask, CodeTestsReward, row_tests


def linux_only(test: Callable[..., None]) -> Callable[..., None]:
    """A test that starts real sandboxes (Linux only)."""
    return pytest.mark.sandbox(pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="the sandbox needs Linux")(test))


# where no sandbox can hide files (no namespaces), scoring a task whose source must be hidden is
# refused; these tests are about scoring, so there they accept an unhidden source explicitly
HIDE = not os.path.exists("/proc/self/fd") or private_view_available()


@pytest.fixture(scope="module")
def task() -> CodeTask:
    return get_task("code", hide_source=HIDE)


def test_embedded_problem_set_shape(task: CodeTask) -> None:
    rows = task.load("train") + task.load("test")
    assert len(rows) >= 40
    assert len({r["id"] for r in rows}) == len(rows)
    assert sum(len(r["solutions"]) >= 2 for r in rows) >= 10  # several valid strategies
    assert any(r["entry_point"] for r in rows) and any(not r["entry_point"] for r in rows)
    assert any("class Solution" in r["starter_code"] for r in rows)
    assert all(1 <= r["n_tests"] <= 16 and r["n_tests"] == len(r["tests"]) for r in rows)
    assert all(r["prompt"].isascii() for r in rows)


def test_embedded_jsonl_is_up_to_date() -> None:
    from vpo.data.code import build

    assert EMBEDDED_PROBLEMS.read_text() == build.dumps(build.build())


def test_splits_are_deterministic_and_disjoint(task: CodeTask) -> None:
    train, test = task.load("train"), task.load("test")
    assert train and test
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    again = CodeTask()
    assert [r["id"] for r in again.load("test")] == [r["id"] for r in test]
    other = CodeTask(split_seed=1)
    assert [r["id"] for r in other.load("test")] != [r["id"] for r in test]
    assert CodeTask(test_fraction=0.0).load("test") == []
    with pytest.raises(ValueError):
        task.load("validation")


def test_max_tests_and_min_tests(task: CodeTask) -> None:
    raw = {json.loads(line)["id"]: json.loads(line) for line in EMBEDDED_PROBLEMS.read_text().splitlines()}
    big = [pid for pid, p in raw.items() if len(p["tests"]) > 16]
    assert big, "the embedded set should exercise the 16-test cap"
    small = CodeTask(max_tests=4)
    rows = {r["id"]: r for r in small.load("train") + small.load("test")}
    assert all(r["n_tests"] <= 4 for r in rows.values())
    assert small.reward.dim == 4
    picky = CodeTask(min_tests=10)
    assert all(r["n_tests"] >= 10 for r in picky.load("train") + picky.load("test"))
    assert picky.import_stats.get("dropped_few_tests", 0) > 0


def test_split_column_and_date_cut(tmp_path: Path) -> None:
    recs = [
        {"id": "a", "prompt": "p", "split": "validation", "tests": [{"type": "stdio", "input": "", "output": "1"}]},
        {"id": "b", "prompt": "q", "split": "train", "tests": [{"type": "stdio", "input": "", "output": "1"}]},
        {"id": "c", "prompt": "r", "date": "2025-01-02", "tests": [{"type": "stdio", "input": "", "output": "1"}]},
        {"id": "d", "prompt": "s", "date": "2024-01-02", "tests": [{"type": "stdio", "input": "", "output": "1"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    t = CodeTask(source=path, test_after="2024-08-01")
    assert sorted(r["id"] for r in t.load("test")) == ["a", "c"]
    assert sorted(r["id"] for r in t.load("train")) == ["b", "d"]


def test_prompts_and_demonstrations(task: CodeTask) -> None:
    rows = task.load("train") + task.load("test")
    call_row = next(r for r in rows if r["entry_point"])
    stdio_row = next(r for r in rows if not r["entry_point"])
    p3 = task.format_prompt(call_row, 3)
    assert call_row["entry_point"] in p3 and "<answer_3>" in p3 and "genuinely different" in p3
    assert "standard input" in task.format_prompt(stdio_row, 1) and "<answer_1>" in task.format_prompt(stdio_row, 1)
    chat = task.format_prompt({**call_row, "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}, 2)
    assert chat[1]["content"].startswith("u") and "ADDITIONAL INSTRUCTION" in chat[1]["content"]
    demo = task.demonstration(call_row, 3, random.Random(0))
    answers = task.reward.parse(demo, 3)
    assert len(answers) == 3
    assert set(task.charset) >= set(p3) | set(demo)


def test_reward_shape_nan_and_present() -> None:
    r = CodeTestsReward(max_tests=5)
    assert r.names == tuple(f"test_{i}" for i in range(5)) and r.dim == 5
    row = {"id": "x", "entry_point": "", "tests": [TestCase.stdio("", "1").to_dict(), TestCase.stdio("", "2").to_dict()]}
    assert r.present(row).tolist() == [True, True, False, False, False]
    np.testing.assert_allclose(r.w_star(), np.full(5, 0.2))
    assert len(row_tests({"tests": json.dumps(row["tests"])})) == 2
    assert len(row_tests({"tests": [json.dumps(t) for t in row["tests"]]})) == 2


@linux_only
def test_reward_scores_tests_individually_and_batches_mixed_problems() -> None:
    r = CodeTestsReward(max_tests=4)
    a = {"id": "a", "entry_point": "", "tests": [TestCase.stdio("1", "2").to_dict(), TestCase.stdio("5", "6").to_dict(),
                                                  TestCase.stdio("0", "7").to_dict()]}
    b = {"id": "b", "entry_point": "f", "tests": [TestCase.call([1], 1).to_dict(), TestCase.call([2], 4).to_dict()]}
    mats = r.score_many([
        (["print(int(input()) + 1)", "print(7)"], a),
        (["def f(x):\n    return x * x", "def f(x):\n    return x"], b),
    ])
    np.testing.assert_array_equal(mats[0], [[1, 1, 0, np.nan], [0, 0, 1, np.nan]])
    np.testing.assert_array_equal(mats[1], [[1, 1, np.nan, np.nan], [1, 0, np.nan, np.nan]])


@linux_only
def test_closing_the_shared_pool_stops_it_and_a_later_reward_opens_a_fresh_one() -> None:
    """Rewards of one configuration share one sandbox pool per process; `close_shared_sandboxes` (the
    suite calls it after every test module, the process at exit) closes it, and scoring afterwards
    opens a new pool that still judges."""
    from vpo.tasks.code import close_shared_sandboxes

    r = CodeTestsReward(max_tests=2)
    row = {"id": "a", "entry_point": "", "tests": [TestCase.stdio("1", "2").to_dict()]}
    np.testing.assert_array_equal(r.score(["print(int(input()) + 1)"], row), [[1, np.nan]])
    first = r.sandbox
    assert first is CodeTestsReward(max_tests=2).sandbox  # shared by configuration
    close_shared_sandboxes()
    assert first._closed
    np.testing.assert_array_equal(r.score(["print(3)"], row), [[0, np.nan]])
    assert r.sandbox is not first and not r.sandbox._closed


@linux_only
def test_score_set_multi_answer_rollout_with_ast_dedup(task: CodeTask) -> None:
    row = next(r for r in task.load("train") if r["entry_point"] and len(r["solutions"]) >= 2)
    sol = row["solutions"][0]["code"]
    same_ast = "# a comment\n" + sol.replace("\n", "\n\n")
    completion = (
        f"plan...\n<answer_1>\n```python\n{sol}```\n</answer_1>\n<answer_2>\n```python\n{same_ast}```\n</answer_2>\n"
        f"<answer_3>\n```python\ndef {row['entry_point']}(*a):\n    return None\n```\n</answer_3>"
    )
    s = score_set(task.reward, completion, row, 3)
    n = row["n_tests"]
    assert s.n_valid == 2  # the comment-only variant is the same program
    assert (s.matrix[0, :n] == 1).all() and s.matrix[1, :n].sum() < n and (s.matrix[2, :n] == 0).all()
    assert np.isnan(s.matrix[:, n:]).all()
    empty = score_set(task.reward, "no code here", row, 3)
    assert empty.n_valid == 0 and (empty.matrix[:, :n] == 0).all()


@linux_only
def test_lcb_layout_and_cache(task: CodeTask) -> None:
    r = CodeTestsReward(max_tests=16)
    row = next(x for x in task.load("train") if not x["entry_point"])
    sols = [s["code"] for s in row["solutions"]]
    text = "\n---\n".join(f"```python\n{c}```" for c in sols[:2])
    before = dict(r.stats)
    r.prefetch([text, text], [row, row], 2)
    assert r.stats["programs_run"] - before["programs_run"] == len(sols[:2])
    s = score_set(r, text, row, 2, dedup_vectors=False)
    assert s.n_valid == len(sols[:2]) and (s.matrix[:, : row["n_tests"]] == 1).all()
    assert r.stats["programs_run"] - before["programs_run"] == len(sols[:2])  # all cache hits
    assert r.stats["cache_hits"] >= 2


@linux_only
def test_cache_never_gives_a_program_another_programs_verdict() -> None:
    """Two programs with the same syntax tree but not the same text can behave differently (this
    one reads its own line number): the cache is keyed on the exact text, so the shifted twin of
    a passing program is run, and fails."""
    from vpo.answers import python_ast_key

    r = CodeTestsReward(max_tests=2)
    row = {"id": "twin", "entry_point": "f", "tests": [TestCase.call([1], 2).to_dict(), TestCase.call([5], 6).to_dict()]}
    passing = "import sys\ndef f(x):\n    return x + 1 if sys._getframe().f_lineno == 3 else -1\n"
    twin = "\n" + passing
    assert python_ast_key(passing) == python_ast_key(twin)
    first, second, again = r.score_many([([passing], row), ([twin], row), ([passing], row)])
    np.testing.assert_array_equal(first, [[1, 1]])
    np.testing.assert_array_equal(second, [[0, 0]])
    np.testing.assert_array_equal(again, [[1, 1]])
    assert r.stats["programs_run"] == 2  # the exact repeat is a cache hit, the twin is not


def test_reward_is_picklable() -> None:
    import pickle

    r = CodeTestsReward(max_tests=3, sandbox={"test_timeout": 1.0})
    r2 = pickle.loads(pickle.dumps(r))
    assert r2.dim == 3 and r2.sandbox_config.test_timeout == 1.0


@linux_only
def test_every_embedded_reference_passes_and_a_wrong_program_fails() -> None:
    """Each strategy of each embedded problem passes all its tests in the sandbox, and a
    trivially wrong program fails at least one (no vacuous tests)."""
    task = CodeTask()
    rows = task.load("train") + task.load("test")
    jobs, owners = [], []
    for row in rows:
        tests = tuple(row_tests(row))
        entry = row["entry_point"] or None
        for s in row["solutions"]:
            jobs.append(Job(s["code"], tests, entry))
            owners.append((row["id"], s["strategy"], True))
        wrong = f"def {entry}(*args):\n    return None\n" if entry else "print(0)\n"
        if entry and "class Solution" in row["starter_code"]:
            wrong = f"class Solution:\n    def {entry}(self, *args):\n        return None\n"
        jobs.append(Job(wrong, tests, entry))
        owners.append((row["id"], "wrong", False))
    with Sandbox(SandboxConfig(test_timeout=5.0)) as box:
        results = box.run(jobs)
    for (pid, strategy, should_pass), res in zip(owners, results):
        if should_pass:
            assert res.all_passed, (pid, strategy, [(t.status.value, t.detail) for t in res.tests if not t.passed])
        else:
            assert not res.all_passed, (pid, "a wrong program passed every test")


def test_per_split_sources_and_date_filter(tmp_path: Path) -> None:
    train = tmp_path / "train" / "dc.jsonl"
    test = tmp_path / "test" / "lcb.jsonl"
    train.parent.mkdir()
    test.parent.mkdir()
    rec = {"prompt": "p", "tests": [{"type": "stdio", "input": "", "output": "1"}]}
    train.write_text("".join(json.dumps({**rec, "id": f"t{i}", "split": "test"}) + "\n" for i in range(3)))
    test.write_text(json.dumps({**rec, "id": "new", "date": "2024-09-01"}) + "\n"
                    + json.dumps({**rec, "id": "old", "date": "2024-01-01"}) + "\n")
    t = CodeTask(source={"train": str(train), "test": [str(test)]}, test_after="2024-08-01")
    assert [r["id"] for r in t.load("train")] == ["t0", "t1", "t2"]  # the source decides, not the field
    assert [r["id"] for r in t.load("test")] == ["new"]
    assert t.import_stats["dropped_before_test_after"] == 1
    hidden = t.reward.sandbox_config.hide_paths
    assert sorted(hidden) == sorted([str(train.resolve()), str(test.resolve())])  # the files, not their folders
    with pytest.raises(ValueError):
        CodeTask(source={"validation": str(test)})
    with pytest.raises(FileNotFoundError):
        CodeTask(source=str(tmp_path / "missing.jsonl"))


PIPELINES = Path(__file__).resolve().parents[1] / "pipelines.yaml"


def _code_pipelines() -> list[str]:
    import yaml

    if not PIPELINES.is_file():
        return []
    data = yaml.safe_load(PIPELINES.read_text()) or {}
    return [n for n, p in (data.get("pipelines") or {}).items() if (p or {}).get("task", {}).get("name") == "code"]


@pytest.mark.parametrize("name", _code_pipelines() or ["<none>"])
def test_code_pipeline_entries_build_the_task(name: str) -> None:
    """Every pipelines.yaml entry of the code task has valid task params; entries with the
    embedded problems build the task, and their rows fit the configured prompt/model sizes."""
    import inspect

    if name == "<none>":
        pytest.skip("no code pipeline in pipelines.yaml")
    import yaml

    from vpo.pipeline.config import load_pipeline

    entry = yaml.safe_load(PIPELINES.read_text())["pipelines"][name]
    for quick in (False, True) if entry.get("quick") is not None else (False,):
        cfg = load_pipeline(name, PIPELINES, quick=quick)
        params = dict(cfg.task.params)
        assert set(params) <= set(inspect.signature(CodeTask.__init__).parameters) - {"self"}
        SandboxConfig(**params.get("sandbox", {}))
        if "source" in params:
            continue  # external datasets are not part of the checkout
        if cfg.model.builder is None:
            pytest.xfail(f"{name}: a hub-model pipeline on the 48 embedded problems (no task.params.source); "
                         "see the code-qwen-coder pipeline in pipelines.yaml")
        task = get_task("code", **params)
        rows = task.load("train") + task.load("test")
        assert all(len(r["prompt"]) <= cfg.dataset.max_prompt_chars for r in rows)
        assert all(r["n_tests"] >= cfg.dataset.min_tests for r in rows)
        assert min(len(task.load(s)) for s in cfg.dataset.splits) >= cfg.dataset.min_rows_per_split
        assert max(len(task.format_prompt(r, 3)) for r in rows) <= cfg.trainer.max_prompt_length
        positions = cfg.model.builder_params.get("max_position_embeddings")
        if positions:
            assert cfg.trainer.max_prompt_length + cfg.trainer.max_completion_length + 2 <= positions


def test_factory_parameters_are_typed_keywords() -> None:
    """Every parameter of the registered factory is keyword-only with a default and a precise
    type (choices as Literal), so a parameter schema can be derived from the signature; the
    sandbox parameter's keys are exactly SandboxConfig's fields."""
    import dataclasses
    import inspect
    import typing

    from vpo.tasks.code import SandboxParams, make_code_task

    sig = inspect.signature(make_code_task)
    hints = typing.get_type_hints(make_code_task)
    for name, param in sig.parameters.items():
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is not inspect.Parameter.empty, name
        assert name in hints and hints[name] is not typing.Any, name
    assert set(sig.parameters) == set(inspect.signature(CodeTask.__init__).parameters) - {"self"}
    for name in ("format", "equality", "prelude", "asserts"):
        assert typing.get_origin(hints[name]) is typing.Literal, name
    assert set(typing.get_type_hints(SandboxParams)) == {f.name for f in dataclasses.fields(SandboxConfig)}
    from pydantic import TypeAdapter, ValidationError

    sandbox = TypeAdapter(SandboxParams)  # what a schema derived from the signature does with it
    assert sandbox.validate_python({"test_timeout": 2.0, "workers": None}) == {"test_timeout": 2.0, "workers": None}
    for bad in ({"tset_timeout": 2.0}, {"namespaces": "maybe"}):
        with pytest.raises(ValidationError):
            sandbox.validate_python(bad)
    with pytest.raises(ValueError, match="equality"):
        get_task("code", equality="loose")
    with pytest.raises(ValueError, match="problem_timeout"):
        get_task("code", problem_timeout=-1.0)


def test_judge_settings_reach_the_sandbox_jobs(tmp_path: Path) -> None:
    """The dataset's judge settings (or the task's overrides) decide how an answer is judged."""
    rec = {"id": "t", "prompt": "p", "entry_point": "f", "tests": [{"type": "call", "args": [0], "expected": [1, 2]}],
           "judge": {"equality": "exact", "prelude": "none", "problem_timeout": 2.0}}
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    exact = CodeTask(source=path, test_fraction=0.0, hide_source=HIDE)
    tolerant = CodeTask(source=path, test_fraction=0.0, equality="tolerant", prelude="competitive", problem_timeout="off",
                        hide_source=HIDE)
    (row,) = exact.load("train")
    (row2,) = tolerant.load("train")
    assert json.loads(row["judge"]) == {"equality": "exact", "prelude": "none", "problem_timeout": 2.0}
    assert json.loads(row2["judge"]) == {"equality": "tolerant", "prelude": "competitive", "problem_timeout": None}
    job = exact.reward._job("def f(x):\n    return (1, 2)\n", exact.reward.tests(row), row)
    assert (job.equality, job.prelude, job.problem_timeout) == ("exact", "", 2.0)
    if os.path.exists("/proc/self/fd"):
        assert exact.reward.score(["def f(x):\n    return (1, 2)\n"], row)[0][0] == 0  # a tuple is not a list
        assert tolerant.reward.score(["def f(x):\n    return (1, 2)\n"], row2)[0][0] == 1
    with pytest.raises(ValueError, match="cannot hide /etc"):
        CodeTask(source="/etc")
