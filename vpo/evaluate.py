"""Evaluation of policies at test-time search: best@k, pass@k, E_w[best@k], diversity.

Fair pools (VPO_SPEC section 2): a policy answering m times per rollout is sampled
``ceil(n_samples / m)`` times per problem, a single-answer policy ``n_samples`` times, so both
spend the same number of candidates; best@k over a multi-answer pool uses ceil(k/m) rollouts
(``pool="rollouts"``, default) or, as the authors' evaluation code, k answer slots of the flattened
pool (``pool="slots"``); :func:`vpo.metrics.pool_best_at_k`. All estimators are exact expectations over the drawn
samples, so the only noise is the sampling of the policy itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from vpo.metrics import POOLS, dirichlet_weights, pool_best_at_k, reward_diversity
from vpo.rewards import VectorReward, validate_reward_matrix
from vpo.tasks import Task

__all__ = ["evaluate_policy", "evaluate_pools", "is_pass", "scalarise", "score_completions"]


def is_pass(task: Task, vector: np.ndarray) -> bool:
    """A candidate "passes" per the task's ``is_pass`` if it has one, else if every present
    dimension is 1 (all tests pass)."""
    fn = getattr(task, "is_pass", None)
    if fn is not None:
        return bool(fn(vector))
    v = np.asarray(vector, dtype=np.float64)
    present = ~np.isnan(v)
    return bool(present.any() and np.all(v[present] >= 1.0 - 1e-9))


def scalarise(vectors: np.ndarray, w: np.ndarray) -> np.ndarray:
    """w.r over the last axis with NaN (absent or missing) entries: absent dims of a present
    answer are dropped and w renormalised; a missing answer (all NaN) stays NaN."""
    v = np.asarray(vectors, dtype=np.float64)
    present = ~np.isnan(v)
    wp = np.where(present, w, 0.0)
    total = wp.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (np.nan_to_num(v) * wp).sum(-1) / total
    return np.where(present.any(-1), out, np.nan)


def score_completions(task: Task, rows: Sequence[Mapping[str, Any]], completions: Sequence[Sequence[str]],
                      m: int) -> np.ndarray:
    """(P, n_chains, m, d) reward vectors of every answer slot; NaN rows = no answer in that slot.

    Answers are parsed per slot without de-duplication (a repeated answer cannot raise a max),
    so slot order is preserved for the fair-pool estimator.
    """
    reward: VectorReward = task.reward
    n_chains = len(completions[0]) if completions else 0
    if hasattr(reward, "prefetch"):  # batch-parallel scoring (code_tests runs all programs at once)
        reward.prefetch([t for chains in completions for t in chains],
                        [row for row, chains in zip(rows, completions) for _ in chains], m)
    out = np.full((len(rows), n_chains, m, reward.dim), np.nan)
    for p, (row, chains) in enumerate(zip(rows, completions)):
        present = np.asarray(reward.present(row), dtype=bool)
        for c, text in enumerate(chains):
            answers = reward.parse(text, m)
            if answers:
                vals = validate_reward_matrix(reward.score(answers, row), len(answers), present,
                                              f"evaluation of problem {row.get('id', p)}")
                out[p, c, : len(answers)] = vals
    return out


def evaluate_pools(task: Task, rows: Sequence[Mapping[str, Any]], vectors: np.ndarray, ks: Sequence[int], *,
                   num_weights: int = 100, seed: int = 0, pool: str = "rollouts") -> dict[str, Any]:
    """All metrics from slot vectors (P, n_chains, m, d): best@k of the w* scalar, pass@k,
    E_w[best@k] under Dir(1), first-answer quality, reward diversity, parse rate.

    ``pool`` is how k candidates are drawn from a problem's n_chains x m answers (recorded in the
    result as ``pool``): ``"rollouts"`` (ours, default) takes ceil(k/m) whole rollouts, the paper's
    stated protocol; ``"slots"`` takes k answer slots from the flattened pool, as the authors'
    evaluation code (exactly, not by one random permutation). See :func:`vpo.metrics.pool_best_at_k`.
    """
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    reward = task.reward
    n_problems, n_chains, m, d = vectors.shape
    w_star = np.asarray(reward.w_star(), dtype=np.float64)
    scal = scalarise(vectors, w_star)  # (P, n, m)
    ks_ok = [k for k in ks if math.ceil(k / m) <= n_chains]  # k <= n_chains * m, for either pool
    res: dict[str, Any] = {"m": m, "n_chains": n_chains, "n_problems": n_problems, "k": ks_ok, "pool": pool}
    res["best_at_k"] = {str(k): float(np.mean(pool_best_at_k(scal, k, pool=pool))) for k in ks_ok}
    passed = np.zeros(scal.shape)
    for idx in np.ndindex(*scal.shape):
        if not np.isnan(scal[idx]):
            passed[idx] = float(is_pass(task, vectors[idx]))
    passed = np.where(np.isnan(scal), np.nan, passed)
    res["pass_at_k"] = {str(k): float(np.mean(pool_best_at_k(passed, k, pool=pool))) for k in ks_ok}
    weights = dirichlet_weights(d, num_weights, 1.0, seed)
    per_w = np.stack([scalarise(vectors, w) for w in weights])  # (K, P, n, m)
    res["expected_weighted_best_at_k"] = {str(k): float(np.mean(pool_best_at_k(per_w, k, pool=pool)))
                                          for k in ks_ok}
    first = np.nan_to_num(scal[:, :, 0], nan=0.0)
    res["first_answer_mean"] = float(first.mean())
    res["parse_rate"] = float((~np.isnan(scal)).mean())
    divs, n_distinct = [], []
    for p in range(n_problems):
        pool = vectors[p].reshape(-1, d)
        pool = pool[~np.isnan(pool).all(-1)]
        divs.append(reward_diversity(pool) if len(pool) > 1 else 0.0)
        n_distinct.append(len({tuple(np.nan_to_num(r, nan=-1).round(6)) for r in pool}))
    res["reward_diversity"] = float(np.mean(divs))
    res["distinct_vectors_per_problem"] = float(np.mean(n_distinct))
    return res


def evaluate_policy(task: Task, model_dir: str, rows: Sequence[Mapping[str, Any]], *, m: int, n_samples: int,
                    ks: Sequence[int], temperature: float = 1.0, max_new_tokens: int = 64, seed: int = 0,
                    num_weights: int = 100, backend: str = "transformers", progress: bool = False,
                    pool: str = "rollouts", prompt_fn: Callable[[Mapping[str, Any], int], Any] | None = None,
                    load: Mapping[str, Any] | None = None, engine: Mapping[str, Any] | None = None,
                    ) -> tuple[dict[str, Any], np.ndarray]:
    """Sample a fair pool from ``model_dir`` for every row and compute :func:`evaluate_pools`
    (``pool``: "rollouts" or "slots"). ``prompt_fn(row, m)`` replaces ``task.format_prompt``
    (e.g. to show a goal-conditioned policy its weighting); ``load`` / ``engine``: how the policy is
    loaded (device, dtype) or its vLLM engine built (:func:`vpo.generation.sample`). Returns the metrics
    and the slot vectors (kept as an artifact for later analysis)."""
    from vpo.generation import sample

    if pool not in POOLS:  # before any sampling
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    n_chains = math.ceil(n_samples / m)
    prompts = [(prompt_fn or task.format_prompt)(r, m) for r in rows]
    completions = sample(model_dir, None, prompts, n=n_chains, max_new_tokens=max_new_tokens,
                         temperature=temperature, seed=seed, backend=backend, progress=progress, load=load,
                         engine=engine)
    vectors = score_completions(task, rows, completions, m)
    return evaluate_pools(task, rows, vectors, ks, num_weights=num_weights, seed=seed, pool=pool), vectors
