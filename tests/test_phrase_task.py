"""The phrase task: rewards by hand, conflict on every problem, exact oracles, seeded splits."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest

from vpo.rewards import score_set
from vpo.tasks import available_tasks, get_task
from vpo.tasks.phrase import (
    NAMES,
    PhraseTask,
    class_answers,
    generate_problem,
    hedge_curve,
    hedge_values,
    make_phrase_task,
    phrase_vector,
)

ROW = {
    "id": "x",
    "keywords": ["river", "maple", "drum"],
    "banned": "e",
    "favourites": ["moon", "owl", "frog"],
    "max_words": 3,
    "mark": "!",
    "favourite": "owl",
}


def test_reward_dimensions_by_hand() -> None:
    assert NAMES == ("keywords", "brevity", "lipogram", "ending", "favourite")
    v = phrase_vector
    assert v("Drum owl!", ROW).tolist() == [1 / 3, 1.0, 1.0, 1.0, 1.0]
    # river and maple contain the banned "e": each costs half the lipogram dimension
    assert v("river maple drum!", ROW).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    # five words against a limit of three: two over, each costs 1/2 of brevity
    assert v("river maple drum owl moon!", ROW).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert v("drum owl moon frog.", ROW).tolist() == [1 / 3, 0.5, 1.0, 0.0, 1.0]
    assert v("DRUM, Owl!  ", ROW).tolist() == [1 / 3, 1.0, 1.0, 1.0, 1.0]  # case and punctuation
    assert v("drums!", ROW).tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]  # whole words only
    assert v("!!!", ROW).tolist() == [0.0] * 5 and v("", ROW).tolist() == [0.0] * 5
    wider = {**ROW, "max_words": 4}  # one word over a slack of 4; one banned word at tolerance 1
    assert PhraseTask(length_slack=4, lipogram_tolerance=1).reward.score(["river drum owl moon frog!"],
                                                                         wider).tolist() == [[2 / 3, 0.75, 0, 1, 1]]


def test_parse_dedup_and_scalar() -> None:
    task = PhraseTask(n_train=2, n_test=2)
    s = score_set(task.reward, "<answer_1>Drum owl!</answer_1><answer_2>drum  OWL!</answer_2>"
                  "<answer_3>drum owl.</answer_3>", ROW, 3)
    assert s.n_valid == 2  # "drum  OWL!" repeats answer 1; "drum owl." ends differently
    assert float(s.matrix[0] @ task.reward.w_star()) == pytest.approx(13 / 15)


def test_every_problem_conflicts_and_oracles_agree() -> None:
    task = PhraseTask(n_train=40, n_test=20, seed=3)
    for row in task.load("test") + task.load("train"):
        vecs = task.reward.score(class_answers(row), row)
        assert (vecs.max(axis=0) == 1).all(), "each rule alone can be met"
        assert not (vecs == 1).all(axis=1).any(), "no answer meets every rule"
        best = task.best_scalar(row)
        assert best == pytest.approx(14 / 15)  # all clean keywords and the favourite, within the limit
        exact = task.hedge_values(row, 3)
        greedy = task.hedge_curve(row, 6)
        assert exact == pytest.approx([0.8, 0.8 + 4 / 45, 14 / 15])
        assert greedy[0] == pytest.approx(exact[0]) and all(g <= e + 1e-12 for g, e in zip(greedy, exact))
        assert max(greedy) == pytest.approx(best) and greedy == sorted(greedy)
        # the reference answers (one per candidate) reach the full-information best for their candidate
        refs = task.reference_answers(row)
        for fav in row["favourites"]:
            scal = task.reward.score(refs, {**row, "favourite": fav}) @ task.reward.w_star()
            assert scal.max() == pytest.approx(best)


def test_oracle_is_a_real_search_not_a_constant() -> None:
    """More candidates and a looser word limit change the hedge values as computed by hand."""
    rng = random.Random(0)
    row = {**generate_problem(rng, n_keywords=3, n_conflicting=1, n_favourites=2, extra_words=1), "id": "y"}
    # limit 4: two clean keywords + both candidates fit; one answer covers both candidates
    assert hedge_values(row, 2) == pytest.approx([14 / 15, 14 / 15])
    # four candidates, limit 3 (in 60ths of the mean scalar): {k1,k2,f} scores 56 when f is the
    # favourite, 44 otherwise; {k1,f,g} 52 or 40. Exact k=2 is {k1,f1,f2} + {k1,f3,f4} (52 always);
    # greedy starts from {k1,k2,f1} (47 expected) and reaches only 51 at k=2; k=4 covers all (56).
    row4 = {**generate_problem(rng, n_keywords=3, n_conflicting=1, n_favourites=4), "id": "z"}
    assert [60 * x for x in hedge_values(row4, 3)] == pytest.approx([47, 52, 54])
    assert [60 * x for x in hedge_curve(row4, 5)] == pytest.approx([47, 51, 54, 55, 56])


def test_splits_are_seeded_disjoint_and_deterministic() -> None:
    a, b = PhraseTask(n_train=30, n_test=10, seed=1), PhraseTask(n_train=30, n_test=10, seed=1)
    assert a.load("train") == b.load("train") and a.load("test") == b.load("test")
    c = PhraseTask(n_train=30, n_test=10, seed=2)
    assert c.load("test") != a.load("test")
    train, test = a.load("train"), a.load("test")
    assert len(train) == 30 and len(test) == 10 and len({r["id"] for r in train + test}) == 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for row in test:
        assert row["favourite"] in row["favourites"] and row["favourite"] not in row["prompt"].split("among")[0]
        assert sum(row["banned"] in k for k in row["keywords"]) == 1
        assert not any(row["banned"] in f for f in row["favourites"])
    with pytest.raises(ValueError, match="split"):
        a.load("valid")


def test_demonstrations_parse_into_distinct_answers() -> None:
    task = PhraseTask(n_train=10, n_test=5)
    rng = random.Random(0)
    for row in task.load("train"):
        for m in (1, 3):
            demo = task.demonstration(row, m, rng)
            s = score_set(task.reward, demo, row, m)
            answers = task.reward.parse(demo, m)
            assert len(answers) == m and len({task.reward.dedup_key(x) for x in answers}) == m
            assert s.matrix.shape == (m, 5) and (s.matrix[:, 3] >= 0).all()
            assert set(demo) <= set(task.charset)
    keys = {task.reward.dedup_key(a) for row in task.load("train") for _ in range(5)
            for a in task.reward.parse(task.demonstration(row, 3, rng), 3)}
    assert len(keys) > 100  # varied, not one answer per problem


def test_registry_and_factory_signature() -> None:
    assert "phrase" in available_tasks()
    task = get_task("phrase", n_train=4, n_test=2, seed=5)
    assert isinstance(task, PhraseTask) and task.params["seed"] == 5 and len(task.load("train")) == 4
    sig = inspect.signature(make_phrase_task)
    for p in sig.parameters.values():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
        assert p.annotation == "int", (p.name, p.annotation)
    assert set(sig.parameters) == set(task.params)
    with pytest.raises(ValueError, match="n_conflicting"):
        get_task("phrase", n_keywords=2, n_conflicting=3)
    with pytest.raises(TypeError):
        get_task("phrase", colour="red")


def test_is_pass_means_hard_rules_and_favourite() -> None:
    task = PhraseTask(n_train=2, n_test=2)
    assert task.is_pass(np.array([1 / 3, 1, 1, 1, 1]))
    assert not task.is_pass(np.array([1, 1, 0.5, 1, 1]))
    assert not task.is_pass(np.array([1, 1, 1, 1, 0]))
