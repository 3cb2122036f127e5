"""Vector rewards: one dimension per test case / objective, NaN where a dimension is absent.

A :class:`VectorReward` scores a list of answers for one problem row and returns an
``(n_answers, d)`` matrix with entries in [0, 1] (higher is better) and NaN for dimensions the
problem does not have. :func:`score_set` turns one rollout's text into the (m, d) matrix VPO
uses: parse, de-duplicate (text / AST), score, drop identical reward vectors, pad with zero rows.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vpo.answers import dedup, pad_rows, parse_answers, text_key, vector_key

__all__ = ["RewardError", "ScoredSet", "VectorReward", "score_set", "validate_reward_matrix"]


class RewardError(ValueError):
    """A reward function broke its contract (wrong shape, values out of range, NaN where present)."""


class VectorReward:
    """Base class for vector rewards. Subclasses set ``names`` and implement :meth:`score`.

    ``w_star`` is the fixed scalarisation used by GRPO and by evaluation (default: the mean
    over present dimensions). ``answer_tag`` is the tag used to parse multi-answer rollouts.
    """

    names: tuple[str, ...] = ()
    answer_tag: str = "answer"

    @property
    def dim(self) -> int:
        return len(self.names)

    def w_star(self) -> np.ndarray:
        """The deployment scalarisation w* (uniform mean by default)."""
        return np.full(self.dim, 1.0 / self.dim)

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        """Score each answer for problem ``row``; returns (len(answers), dim) in [0, 1], NaN = absent."""
        raise NotImplementedError

    def present(self, row: Mapping[str, Any]) -> np.ndarray:
        """Which dimensions exist for this problem (all by default)."""
        return np.ones(self.dim, dtype=bool)

    def parse(self, completion: str, m: int) -> list[str]:
        """Extract up to m answers from a completion. With m == 1 a completion without tags is
        taken whole (a plain single answer)."""
        answers = parse_answers(completion, m, self.answer_tag)
        if not answers and m == 1 and "<" + self.answer_tag not in completion and completion.strip():
            return [completion.strip()]
        return answers

    def dedup_key(self, answer: str) -> Hashable:
        """Key under which two answers count as the same answer (identical text by default)."""
        return text_key(answer)


@dataclass(frozen=True)
class ScoredSet:
    """One rollout's scored answer set: ``matrix`` is (m, d) after padding, ``n_valid`` the number
    of distinct, scored answers (the first ``n_valid`` rows), ``answers`` their texts."""

    matrix: np.ndarray
    n_valid: int
    answers: tuple[str, ...]


def validate_reward_matrix(values: np.ndarray, n: int, present: np.ndarray, where: str) -> np.ndarray:
    """Check a reward function's output: shape (n, d), finite and in [0, 1] where present, NaN
    where absent. Raises :class:`RewardError` naming ``where`` and the first bad entry."""
    arr = np.asarray(values, dtype=np.float64)
    d = present.shape[0]
    if arr.shape != (n, d):
        raise RewardError(f"{where}: reward returned shape {arr.shape}, expected ({n}, {d})")
    sub = arr[:, present]
    bad = ~np.isfinite(sub) | (sub < 0.0) | (sub > 1.0)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        dim = int(np.flatnonzero(present)[j])
        raise RewardError(
            f"{where}: reward value {sub[i, j]!r} at answer {i}, dimension {dim} is not a finite number in [0, 1]"
        )
    arr[:, ~present] = np.nan
    return arr


def score_set(
    reward: VectorReward,
    completion: str,
    row: Mapping[str, Any],
    m: int,
    *,
    dedup_vectors: bool = True,
    pad: bool = True,
    where: str = "reward",
) -> ScoredSet:
    """Parse ``completion`` into at most m answers, de-duplicate them by ``reward.dedup_key``,
    score them, drop answers whose reward vector repeats an earlier one, and pad to (m, d).

    An unparseable rollout yields an all-zero matrix (NaN on absent dimensions); there is no
    format bonus (VPO_SPEC 1.2).
    """
    present = np.asarray(reward.present(row), dtype=bool)
    answers = reward.parse(completion, m)
    answers = [answers[i] for i in dedup(answers, key=reward.dedup_key)]
    if answers:
        values = validate_reward_matrix(reward.score(answers, row), len(answers), present, where)
        if dedup_vectors:
            keep = dedup(list(values), key=vector_key)
            values = values[keep]
            answers = [answers[i] for i in keep]
    else:
        values = np.zeros((0, reward.dim))
    matrix = pad_rows(values, m, present) if pad else values
    return ScoredSet(matrix=matrix, n_valid=len(answers), answers=tuple(answers))

