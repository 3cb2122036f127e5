"""Baselines in the search harness: repeated independent sampling (best-of-k).

Every call uses the plain task prompt ``task.format_prompt(row, m)`` (no parents), and the
same parsing, de-duplication, scoring, budget accounting, checkpointing and history as
:mod:`vpo.search.loop`, so its curves are directly comparable with a search run at the same
candidate budget. With ``m=1`` it is classic best-of-k over single answers; with ``m>1`` it is
best-of-k over multi-answer sets (each call proposes up to m candidates).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from vpo.search.loop import SearchResult, _run
from vpo.search.proposer import Proposer

__all__ = ["run_best_of_k", "run_best_of_k_batch"]


def run_best_of_k_batch(
    rows: Sequence[Mapping[str, Any]],
    task: Any,
    proposer: Proposer,
    *,
    budget: int,
    m: int,
    seed: int,
    checkpoint_path: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 10,
    arm: str = "best_of_k",
    stop_when_solved: bool = True,
    max_calls: int | None = None,
) -> list[SearchResult]:
    """Independent samples until each problem has ``budget`` candidates (or ``max_calls``
    proposer calls, default ``ceil(budget / m)``; a call yielding fewer than m distinct
    answers still counts as a call, exactly as an iteration of the search does)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    calls = math.ceil(budget / m) if max_calls is None else int(max_calls)
    return _run(
        rows,
        task,
        proposer,
        iterations=calls,
        m=m,
        seed=seed,
        budget=budget,
        checkpoint_path=checkpoint_path,
        checkpoint_every=checkpoint_every,
        arm=arm,
        prompt_mode="plain",
        stop_when_solved=stop_when_solved,
        db_options=None,
        initial_programs=None,
        use_parents=False,
        kind="best_of_k",
    )


def run_best_of_k(problem_row: Mapping[str, Any], task: Any, proposer: Proposer, **options: Any) -> SearchResult:
    """Best-of-k on one problem: :func:`run_best_of_k_batch` with a single row (same keywords)."""
    return run_best_of_k_batch([problem_row], task, proposer, **options)[0]
