"""evaluate_pools on hand-made slot vectors: both pool protocols, recorded in the result."""

from __future__ import annotations

import numpy as np
import pytest

from vpo import generation
from vpo.evaluate import evaluate_policy, evaluate_pools, scalarise
from vpo.metrics import pool_best_at_k
from vpo.rewards import VectorReward
from vpo.tasks import Task


class _Reward(VectorReward):
    names = ("x", "y")

    def score(self, answers, row):  # type: ignore[no-untyped-def]
        return np.array([[float("x" in a), float("y" in a)] for a in answers])


class _Task(Task):
    name = "two-dims"
    reward = _Reward()


def _vectors() -> np.ndarray:
    """(P=2, n=4, m=3, d=2): the first answer of every rollout is the best one; one slot unparsed."""
    rng = np.random.default_rng(3)
    v = rng.uniform(0.0, 0.4, (2, 4, 3, 2))
    v[:, :, 0] = rng.uniform(0.6, 1.0, (2, 4, 2))
    v[0, 1, 2] = np.nan
    v[1, 2, 1] = 1.0  # one full pass in a later slot
    return v


@pytest.mark.parametrize("pool", ["rollouts", "slots"])
def test_evaluate_pools_uses_and_reports_the_pool(pool: str) -> None:
    v = _vectors()
    res = evaluate_pools(_Task(), [{"id": 0}, {"id": 1}], v, [1, 3, 5, 12, 13], num_weights=20, pool=pool)
    assert res["pool"] == pool and res["k"] == [1, 3, 5, 12]
    scal = scalarise(v, np.array([0.5, 0.5]))
    for k in res["k"]:
        assert res["best_at_k"][str(k)] == pytest.approx(float(np.mean(pool_best_at_k(scal, k, pool=pool))))
    passed = np.where(np.isnan(scal), np.nan, (np.nan_to_num(v) >= 1.0 - 1e-9).all(-1).astype(float))
    assert res["pass_at_k"]["5"] == pytest.approx(float(np.mean(pool_best_at_k(passed, 5, pool=pool))))
    assert res["best_at_k"]["12"] == pytest.approx(float(np.mean(np.nanmax(scal.reshape(2, -1), axis=1))))


def test_pools_differ_when_answer_order_matters() -> None:
    v = _vectors()
    ours = evaluate_pools(_Task(), [{}, {}], v, [1, 3])
    theirs = evaluate_pools(_Task(), [{}, {}], v, [1, 3], pool="slots")
    assert ours["pool"] == "rollouts"
    assert ours["best_at_k"]["1"] > theirs["best_at_k"]["1"]  # our k=1 is a first answer, the strong one
    with pytest.raises(ValueError, match="pool must be one of"):
        evaluate_pools(_Task(), [{}, {}], v, [1], pool="answers")


def test_evaluate_policy_passes_pool_and_prompt_fn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling is stubbed: the prompts reaching it come from prompt_fn, and the pool is reported."""
    seen: list[list[str]] = []

    def fake_sample(model_dir, tokenizer, prompts, *, n, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(list(prompts))
        return [["<answer_1>xy</answer_1><answer_2>x</answer_2>"] * n for _ in prompts]

    monkeypatch.setattr(generation, "sample", fake_sample)
    rows = [{"id": "a", "prompt": "Q1"}, {"id": "b", "prompt": "Q2"}]
    res, vectors = evaluate_policy(_Task(), "unused", rows, m=2, n_samples=4, ks=[1, 2], pool="slots",
                                   prompt_fn=lambda row, m: f"{row['prompt']} (show weights, m={m})")
    assert seen == [["Q1 (show weights, m=2)", "Q2 (show weights, m=2)"]]
    assert vectors.shape == (2, 2, 2, 2) and res["pool"] == "slots"
    assert res["best_at_k"]["1"] == pytest.approx(0.75)  # a random slot: "xy" (1.0 under w*) or "x" (0.5)
    with pytest.raises(ValueError, match="pool must be one of"):
        evaluate_policy(_Task(), "unused", rows, m=2, n_samples=4, ks=[1], pool="chains")
    assert len(seen) == 1  # refused before sampling
