"""Stage ``rewards``: score every problem's reference answers into reward vectors and validate them.

This is the second great_expectations gate: each problem has its expected number of present
dimensions, values lie in [0, 1] and NaN appears only where a dimension is absent. Training depends
on its output, so a reward that breaks on real rows stops the pipeline before any RL step.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from vpo.atomic import atomic_dir, atomic_write_json
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.inputs import load_rows

__all__ = ["reference_answers", "run"]


def reference_answers(task: Any, row: Mapping[str, Any], rng: random.Random) -> list[str]:
    """Reference solutions: the task's own, else parsed from its supervised demonstration."""
    if hasattr(task, "reference_answers"):
        return list(task.reference_answers(row))
    if hasattr(task, "demonstration"):
        return task.reward.parse(task.demonstration(row, 3, rng), 3)
    return []


def run(ctx: StageContext) -> dict[str, Any]:
    """Score, validate and write ``rewards/reference.parquet``."""
    from vpo.pipeline.validation import reward_vectors_frame, validate_reward_vectors
    from vpo.rewards import validate_reward_matrix

    cfg, task = ctx.cfg, ctx.task
    rng = random.Random(cfg.seed)
    items, expected = [], {}
    for split in cfg.dataset.splits:
        for row in load_rows(cfg, split, ctx.layout):
            answers = reference_answers(task, row, rng)
            present = np.asarray(task.reward.present(row), dtype=bool)
            expected[str(row["id"])] = int(present.sum())
            if answers:
                values = validate_reward_matrix(task.reward.score(answers, row), len(answers), present,
                                                f"reference answers of {split} row id {row['id']!r}")
            else:
                values = np.zeros((0, task.reward.dim))
            items.append((str(row["id"]), np.asarray(values, dtype=np.float64), present))
    df = reward_vectors_frame(items, dim_names=list(task.reward.names))
    summary = validate_reward_vectors(df, name=f"{cfg.variant}/rewards", num_dims=task.reward.dim,
                                      expected_present=expected)
    out = ctx.layout.rewards
    vals = df[df["present"]]["value"].to_numpy(dtype=float) if len(df) else np.zeros(0)
    info = {"problems": len(items), "answers": int(sum(len(v) for _, v, _ in items)),
            "mean_value": float(vals.mean()) if vals.size else None, "validation": summary}
    with atomic_dir(out) as tmp:
        df.to_parquet(tmp / ctx.layout.rewards_file.name, index=False)
        atomic_write_json(tmp / "validation.json", info)
    ctx.outcome(f"{info['answers']} reference answers over {info['problems']} problems validated")
    return info
