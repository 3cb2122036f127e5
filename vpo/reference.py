"""Straightforward per-group, per-rollout loop implementations of the estimators' formulas.

They read like the paper's equations and are the ground truth that the vectorised estimators in
:mod:`vpo.advantages` are checked against (tests) and timed against (``benchmarks/advantage.py``).
Not used in training.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np


def _groups(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    groups: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def _zscore(values: list[float], eps: float, ddof: int = 0) -> list[float]:
    """(v - mean) / (std + eps), 0 if std < eps; population std (ddof 0) or sample std (ddof 1)."""
    arr = np.asarray(values, dtype=np.float64)
    if len(arr) <= ddof:
        return [0.0] * len(values)
    mean = arr.mean()
    std = arr.std(ddof=ddof)
    if std < eps:
        return [0.0] * len(values)
    return list((arr - mean) / (std + eps))


def _w_star(present: np.ndarray, w_star: np.ndarray | None) -> np.ndarray:
    d = present.shape[0]
    w = np.full(d, 1.0 / d) if w_star is None else np.asarray(w_star, dtype=np.float64)
    w = np.where(present, w, 0.0)
    return w / w.sum()


def _first(s: np.ndarray, w: np.ndarray) -> float:
    return float(np.dot(np.nan_to_num(s[0]), w)) if s.shape[0] else 0.0


def _first_answer_groups(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None,
) -> list[tuple[list[int], list[float]]]:
    """Per group: its rollout indices and each rollout's first-answer w*.r (0 if empty), w*
    renormalised over the group's present dims."""
    out = []
    for idx in _groups(group_ids).values():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        w = _w_star(_present(sets), w_star)
        out.append((idx, [_first(s, w) for s in sets]))
    return out


def _present(sets: list[np.ndarray]) -> np.ndarray:
    rows = [s for s in sets if s.shape[0] > 0]
    if not rows:
        d = sets[0].shape[1] if sets[0].ndim == 2 else 1
        return np.ones(d, dtype=bool)
    return ~np.isnan(np.concatenate(rows, 0)).all(axis=0)


def vpo_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], weights_per_group: dict[Hashable, np.ndarray],
    eps: float = 1e-6,
) -> np.ndarray:
    """VPO with explicit (K, d) weights per group: score = mean_k max_s w_k . r_s, then z-score."""
    out = np.zeros(len(reward_sets))
    for g, idx in _groups(group_ids).items():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        present = _present(sets)
        scores = []
        for s in sets:
            total = 0.0
            for w in weights_per_group[g]:
                w = np.where(present, w, 0.0)
                w = w / w.sum()
                best = None
                for row in s:
                    val = float(np.dot(np.nan_to_num(row), w))
                    best = val if best is None else max(best, val)
                total += 0.0 if best is None else best
            scores.append(total / len(weights_per_group[g]))
        for i, a in zip(idx, _zscore(scores, eps)):
            out[i] = a
    return out


def grpo_population_std_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Scalar GRPO on the first answer with fixed w* (mean over present dims by default),
    population-std z-score."""
    out = np.zeros(len(reward_sets))
    for idx, r in _first_answer_groups(reward_sets, group_ids, w_star):
        for i, a in zip(idx, _zscore(r, eps)):
            out[i] = a
    return out


def _nan_mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std of the non-NaN values (NaN if there are none / fewer than 2)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def trl_grpo_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    scale_rewards: str = "group", aggregation: str = "sum_then_normalize",
) -> np.ndarray:
    """TRL's stock GRPO formula in float64, one rollout at a time: columns = the first answer's
    dimensions (NaN absent; 0 on the group's present dims for an empty rollout), reward weights
    w* (default ones, not renormalised), NaN-aware group mean and sample std, 1e-4 added to the
    std; a rollout whose columns are all NaN gets 0."""
    n = len(reward_sets)
    groups = _groups(group_ids)
    sets = [np.asarray(s, dtype=np.float64) for s in reward_sets]
    d = next(s.shape[1] for s in sets if s.ndim == 2)
    w = np.ones(d) if w_star is None else np.asarray(w_star, dtype=np.float64)
    cols = np.full((n, d), np.nan)
    for idx in groups.values():
        present = _present([sets[i] for i in idx])
        for i in idx:
            cols[i] = sets[i][0] if sets[i].shape[0] else np.where(present, 0.0, np.nan)
    scorable = [not np.isnan(cols[i]).all() for i in range(n)]
    out = np.zeros(n)
    if aggregation == "sum_then_normalize":
        reward = [float(np.nansum(cols[i] * w)) if scorable[i] else math.nan for i in range(n)]
        batch_std = _nan_mean_std(reward)[1]
        for idx in groups.values():
            mean, std = _nan_mean_std([reward[i] for i in idx])
            scale = batch_std if scale_rewards == "batch" else std
            for i in idx:
                a = reward[i] - mean if scale_rewards == "none" else (reward[i] - mean) / (scale + 1e-4)
                out[i] = 0.0 if math.isnan(a) else a
        return out
    normalised = np.full((n, d), np.nan)
    for idx in groups.values():
        for j in range(d):
            mean, std = _nan_mean_std([cols[i, j] for i in idx])
            for i in idx:
                normalised[i, j] = (cols[i, j] - mean) / (std + 1e-4)
    reward = [float(np.nansum(normalised[i] * w)) if scorable[i] else math.nan for i in range(n)]
    mean, std = _nan_mean_std(reward)
    for i in range(n):
        a = (reward[i] - mean) / (std + 1e-4)
        out[i] = 0.0 if math.isnan(a) else a
    return out


def weighted_grpo_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], weights: np.ndarray, eps: float = 1e-6,
    ddof: int = 1,
) -> np.ndarray:
    """GRPO with one weighting per rollout (``weights`` (N, d): random-weight and goal-conditioned
    GRPO): first answer's w_i . r, w_i renormalised over the group's present dims, z-score."""
    out = np.zeros(len(reward_sets))
    for idx in _groups(group_ids).values():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        present = _present(sets)
        scores = []
        for s, i in zip(sets, idx):
            w = np.where(present, np.asarray(weights[i], dtype=np.float64), 0.0)
            w = w / w.sum() if w.sum() > 0 else w
            scores.append(_first(s, w))
        for i, a in zip(idx, _zscore(scores, eps, ddof)):
            out[i] = a
    return out


def max_at_k_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], k: int | None = None,
    w_star: np.ndarray | None = None, eps: float = 1e-6,
) -> np.ndarray:
    """Max@k (Bagirov et al. 2025) as written in the paper: sort the group's n rewards ascending;
    rank i gets [C(i-1, k-1) r_(i) + sum_{j>i} C(j-2, k-2) r_(j)] / C(n, k); sample-std z-score.
    k defaults to max(2, n // 2)."""
    out = np.zeros(len(reward_sets))
    for idx, r in _first_answer_groups(reward_sets, group_ids, w_star):
        n = len(r)
        if n < 2:
            continue
        kk = max(2, n // 2) if k is None else k
        order = sorted(range(n), key=lambda t: r[t])
        raw = [0.0] * n
        for a, pos in enumerate(order):
            rank = a + 1
            acc = math.comb(rank - 1, kk - 1) * r[pos]
            for b in range(a + 1, n):
                acc += math.comb(b + 1 - 2, kk - 2) * r[order[b]] if kk >= 2 else 0.0
            raw[pos] = acc / math.comb(n, kk)
        for i, a in zip(idx, _zscore(raw, eps, ddof=1)):
            out[i] = a
    return out


def grpo_passk_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """verl's grpo_passk: only the group's best rollout gets (r_max - r_second) / (sample std + eps)."""
    out = np.zeros(len(reward_sets))
    for idx, r in _first_answer_groups(reward_sets, group_ids, w_star):
        best = max(range(len(r)), key=lambda t: r[t])
        second = max(r[t] for t in range(len(r)) if t != best)
        out[idx[best]] = (r[best] - second) / (float(np.std(r, ddof=1)) + eps)
    return out


def maxrl_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """MaxRL: (r - mean) / (mean + eps) of the first answer's w*.r; 0 for a group without spread."""
    out = np.zeros(len(reward_sets))
    for idx, scores in _first_answer_groups(reward_sets, group_ids, w_star):
        r = np.array(scores)
        if r.std() < eps:
            continue
        for i, v in zip(idx, r):
            out[i] = (v - r.mean()) / (r.mean() + eps)
    return out


def multi_rlvr_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Multi-RLVR: sum over the set of w*.r, then z-score."""
    out = np.zeros(len(reward_sets))
    for idx in _groups(group_ids).values():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        w = _w_star(_present(sets), w_star)
        scores = [sum(float(np.dot(np.nan_to_num(r), w)) for r in s) for s in sets]
        for i, a in zip(idx, _zscore(scores, eps)):
            out[i] = a
    return out


def gdpo_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """GDPO: per-dimension group z-score of the first answer, w*-weighted sum, batch z-score."""
    n = len(reward_sets)
    combined = np.zeros(n)
    for idx in _groups(group_ids).values():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        w = _w_star(_present(sets), w_star)
        d = w.shape[0]
        firsts = np.array([np.nan_to_num(s[0]) if s.shape[0] else np.zeros(d) for s in sets])
        for j in range(d):
            for i, a in zip(idx, _zscore(list(firsts[:, j]), eps)):
                combined[i] += w[j] * a
    return np.asarray(_zscore(list(combined), eps))
