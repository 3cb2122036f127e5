"""Stage ``data``: the task's problem rows for every split, validated, written as parquet.

Each row is stored as its JSON ``payload`` next to ``id``, ``split`` and ``prompt`` columns (rows may
carry any nested fields a reward needs). great_expectations checks ids, prompts, split sizes, the
per-problem test count (``dataset.tests_column`` / ``min_tests``) and leakage of a prompt into two
splits before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vpo.atomic import atomic_dir, atomic_write_json
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.errors import StageError

__all__ = ["check_row", "rows_frame", "run"]


def check_row(row: Any, split: str, index: int) -> None:
    """A problem row is a mapping with a str/int ``id`` and a non-empty string ``prompt``."""
    where = f"dataset split {split!r}, row {index}"
    if not isinstance(row, Mapping):
        raise StageError(f"{where}: expected a mapping with 'id' and 'prompt' fields, got {type(row).__name__}")
    missing = [k for k in ("id", "prompt") if k not in row]
    if missing:
        raise StageError(f"{where}: missing field(s) {missing}; a problem row needs 'id' and 'prompt', "
                         f"got fields {sorted(map(str, row))}")
    where += f" (id {row['id']!r})"
    if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)) or str(row["id"]) == "":
        raise StageError(f"{where}: field 'id' must be a non-empty string or an integer, "
                         f"got {type(row['id']).__name__}")
    if not isinstance(row["prompt"], str) or not row["prompt"].strip():
        raise StageError(f"{where}: field 'prompt' must be a non-empty string, got "
                         f"{type(row['prompt']).__name__} {str(row['prompt'])[:40]!r}")


def rows_frame(rows_by_split: Mapping[str, Sequence[Mapping[str, Any]]], tests_column: str | None = None) -> Any:
    """One frame of all splits: ``id``, ``split``, ``prompt``, ``payload`` (the row as JSON) and, with
    ``tests_column``, that field (for the test-count expectation)."""
    import pandas as pd

    records = []
    for split, rows in rows_by_split.items():
        for i, r in enumerate(rows):
            check_row(r, split, i)
            rec = {"id": str(r["id"]), "split": split, "prompt": r["prompt"],
                   "payload": json.dumps(r, sort_keys=True, default=str)}
            if tests_column:
                rec[tests_column] = r.get(tests_column)
            records.append(rec)
    return pd.DataFrame.from_records(records)


def run(ctx: StageContext) -> dict[str, Any]:
    """Build, validate and write ``data/<split>.parquet``; returns rows per split and the validation summary."""
    from vpo.pipeline.validation import validate_dataset

    cfg, task = ctx.cfg, ctx.task
    ds = cfg.dataset
    rows = {split: task.load(split) for split in ds.splits}
    df = rows_frame(rows, ds.tests_column)
    if task.reward is not None:
        df["n_dims"] = [int(np.asarray(task.reward.present(json.loads(p))).sum()) for p in df["payload"]]
    summary = validate_dataset(df, name=f"{cfg.variant}/data", max_prompt_chars=ds.max_prompt_chars,
                               splits=ds.splits, min_rows_per_split=ds.min_rows_per_split,
                               tests_column=ds.tests_column, min_tests=ds.min_tests)
    out = ctx.layout.data
    info = {"rows": {s: len(r) for s, r in rows.items()}, "validation": summary}
    with atomic_dir(out) as tmp:
        for split in ds.splits:
            part = df[df["split"] == split].drop(columns=[ds.tests_column] if ds.tests_column else [])
            part.reset_index(drop=True).to_parquet(tmp / ctx.layout.data_file(split).name, index=False)
        atomic_write_json(tmp / "validation.json", info)
    ctx.outcome(", ".join(f"{n} {s}" for s, n in info["rows"].items()) + " rows validated")
    return info
