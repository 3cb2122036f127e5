"""Straightforward per-group, per-rollout loop implementations of the estimators' formulas.

They read like the paper's equations and are the ground truth that the vectorised estimators in
:mod:`vpo.advantages` are checked against (tests) and timed against (``benchmarks/advantage.py``).
Not used in training.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def _groups(group_ids: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    groups: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def _zscore(values: list[float], eps: float) -> list[float]:
    arr = np.asarray(values, dtype=np.float64)
    mean = arr.mean()
    std = arr.std()  # population std
    if std < eps:
        return [0.0] * len(values)
    return list((arr - mean) / (std + eps))


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


def grpo_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Scalar GRPO on the first answer with fixed w* (mean over present dims by default)."""
    out = np.zeros(len(reward_sets))
    for _, idx in _groups(group_ids).items():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        present = _present(sets)
        d = present.shape[0]
        w = np.full(d, 1.0 / d) if w_star is None else np.asarray(w_star, dtype=np.float64)
        w = np.where(present, w, 0.0)
        w = w / w.sum()
        scores = [float(np.dot(np.nan_to_num(s[0]), w)) if s.shape[0] else 0.0 for s in sets]
        for i, a in zip(idx, _zscore(scores, eps)):
            out[i] = a
    return out


def multi_rlvr_advantage_loop(
    reward_sets: Sequence[np.ndarray], group_ids: Sequence[Hashable], w_star: np.ndarray | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Multi-RLVR: sum over the set of w*.r, then z-score."""
    out = np.zeros(len(reward_sets))
    for _, idx in _groups(group_ids).items():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        present = _present(sets)
        d = present.shape[0]
        w = np.full(d, 1.0 / d) if w_star is None else np.asarray(w_star, dtype=np.float64)
        w = np.where(present, w, 0.0)
        w = w / w.sum()
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
    for _, idx in _groups(group_ids).items():
        sets = [np.asarray(reward_sets[i], dtype=np.float64) for i in idx]
        present = _present(sets)
        d = present.shape[0]
        w = np.full(d, 1.0 / d) if w_star is None else np.asarray(w_star, dtype=np.float64)
        w = np.where(present, w, 0.0)
        w = w / w.sum()
        firsts = np.array([np.nan_to_num(s[0]) if s.shape[0] else np.zeros(d) for s in sets])
        for j in range(d):
            for i, a in zip(idx, _zscore(list(firsts[:, j]), eps)):
                combined[i] += w[j] * a
    return np.asarray(_zscore(list(combined), eps))
