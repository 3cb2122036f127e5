"""Data validation with great_expectations (GX 1.x, in-process ephemeral context).

Two gates of the pipeline use it:

* :func:`validate_dataset` on the problem rows written by the ``data`` stage: required columns,
  non-null values, types, prompt lengths, known splits, unique ids, per-split row counts, test
  counts per problem and no prompt shared by two splits;
* :func:`validate_reward_vectors` on the long-format reward table written by the ``rewards`` stage
  (one row per problem x sample x dimension, see :func:`reward_vectors_frame`): dimension count
  per vector, values in [0, 1], NaN exactly where a dimension is absent.

Both return a summary dict on success and raise :class:`ValidationError` on failure; its message
names every failing expectation, its column and example rows/values, and ``.report`` holds the
structured per-expectation results (JSON-able dicts) for artifacts. great_expectations is imported
lazily (5-7 s) and its progress bars are switched off.
"""

from __future__ import annotations

import math
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "REWARD_COLUMNS",
    "ValidationError",
    "reward_vectors_frame",
    "validate_dataset",
    "validate_reward_vectors",
]

REWARD_COLUMNS = ("problem_id", "sample", "dim", "value", "present")
_EXAMPLES = 5


class ValidationError(ValueError):
    """Data failed its great_expectations suite; ``report`` lists every expectation's outcome."""

    def __init__(self, message: str, report: list[dict[str, Any]]):
        super().__init__(message)
        self.report = report

    @property
    def failures(self) -> list[dict[str, Any]]:
        """Only the failed expectations of :attr:`report`."""
        return [r for r in self.report if not r["success"]]


# --------------------------------------------------------------------------- GX plumbing


@dataclass
class _Check:
    """One expectation on one table, with the columns identifying a row in its failure examples."""

    table: str
    expectation: Any
    id_columns: list[str] = field(default_factory=list)


def _gx() -> tuple[Any, Any]:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import great_expectations as gx
    import great_expectations.expectations as gxe

    return gx, gxe


def _run(name: str, tables: Mapping[str, pd.DataFrame], checks: Sequence[_Check]) -> list[dict[str, Any]]:
    """Run ``checks`` against ``tables`` in one ephemeral GX context; one report dict per check."""
    gx, _ = _gx()
    from great_expectations.data_context.types.base import ProgressBarsConfig

    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    source = ctx.data_sources.add_pandas(name=f"{name}_src")
    report: list[dict[str, Any]] = []
    for table, df in tables.items():
        mine = [c for c in checks if c.table == table]
        if not mine:
            continue
        batch = source.add_dataframe_asset(name=table).add_batch_definition_whole_dataframe(f"{table}_all")
        # one suite per distinct id-column set keeps the examples' row identifiers meaningful
        groups: dict[tuple[str, ...], list[_Check]] = {}
        for c in mine:
            groups.setdefault(tuple(col for col in c.id_columns if col in df.columns), []).append(c)
        for gi, (id_cols, group) in enumerate(groups.items()):
            suite = ctx.suites.add(gx.ExpectationSuite(name=f"{name}_{table}_{gi}"))
            for c in group:
                suite.add_expectation(c.expectation)
            vd = ctx.validation_definitions.add(
                gx.ValidationDefinition(name=f"{name}_{table}_{gi}_vd", data=batch, suite=suite)
            )
            fmt: dict[str, Any] = {"result_format": "COMPLETE", "partial_unexpected_count": _EXAMPLES}
            if id_cols:
                fmt["unexpected_index_column_names"] = list(id_cols)
            res = vd.run(batch_parameters={"dataframe": df}, result_format=fmt)
            report += [_result_dict(table, r, list(id_cols)) for r in res.results]
    return report


def _plain(value: Any) -> Any:
    """JSON-able version of a GX/numpy/pandas value (NaN -> None)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def _result_dict(table: str, r: Any, id_cols: list[str]) -> dict[str, Any]:
    cfg = r.expectation_config
    kwargs = {k: v for k, v in cfg.kwargs.items() if k not in ("batch_id", "column", "result_format")}
    result = r.result or {}
    exc = r.exception_info or {}
    raised = exc.get("raised_exception") if isinstance(exc, dict) else False
    examples = result.get("partial_unexpected_index_list") or [
        {"value": v} for v in (result.get("partial_unexpected_list") or [])
    ]
    return _plain(
        {
            "table": table,
            "expectation": cfg.type,
            "column": cfg.kwargs.get("column") or cfg.kwargs.get("column_A") or cfg.kwargs.get("column_list"),
            "kwargs": kwargs,
            "success": bool(r.success),
            "element_count": result.get("element_count"),
            "unexpected_count": result.get("unexpected_count"),
            "unexpected_percent": result.get("unexpected_percent"),
            "observed_value": result.get("observed_value"),
            "details": result.get("details"),
            "examples": list(examples)[:_EXAMPLES],
            "id_columns": id_cols,
            "exception": (exc.get("exception_message") if raised else None),
        }
    )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    if isinstance(value, str) and len(value) > limit:
        text = repr(value[:limit]) + f"…({len(value)} chars)"
    elif len(text) > limit + 20:
        text = text[: limit + 20] + "…"
    return text


def _describe_failure(r: Mapping[str, Any]) -> str:
    kwargs = dict(r["kwargs"])
    cond = kwargs.pop("row_condition", None)
    kwargs.pop("condition_parser", None)
    pair = (kwargs.pop("column_A", None), kwargs.pop("column_B", None))
    args = ", ".join(f"{k}={_short(v)}" for k, v in kwargs.items())
    head = f"{r['expectation']}({args})" if args else r["expectation"]
    col = r["column"]
    if pair[0] and pair[1]:
        where = f" on columns {pair[0]!r} and {pair[1]!r}"
    else:
        where = f" on column {col!r}" if col else ""
    if cond:
        where += f" where {cond.get('pass_through_filter', cond) if isinstance(cond, Mapping) else cond}"
    if r["table"] != "rows":
        where += f" [{r['table']}]"
    if r.get("exception"):
        return f"{head}{where}: could not be evaluated: {r['exception']}"
    parts = []
    if r.get("unexpected_count") is not None:
        total = r.get("element_count")
        parts.append(
            f"{r['unexpected_count']} of {total} rows unexpected"
            if total
            else f"{r['unexpected_count']} unexpected"
        )
    examples = []
    for ex in r.get("examples") or []:
        if not isinstance(ex, Mapping):
            examples.append(_short(ex))
            continue
        ids = ", ".join(f"{k}={_short(ex[k])}" for k in r["id_columns"] if k in ex)
        vals = ", ".join(f"{k}={_short(v)}" for k, v in ex.items() if k not in r["id_columns"])
        examples.append(f"[{ids}] {vals}" if ids else vals)
    if examples:
        parts.append("e.g. " + "; ".join(examples))
    if r.get("details") and isinstance(r["details"], Mapping) and "mismatched" in r["details"]:
        parts.append(f"mismatch: {r['details']['mismatched']}")
    elif r.get("observed_value") is not None and not examples:
        parts.append(f"observed {_short(r['observed_value'])}")
    return f"{head}{where}: " + (", ".join(parts) or "failed")


def _finish(kind: str, name: str, report: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    failed = [r for r in report if not r["success"]]
    if failed:
        lines = [f"{kind} {name!r} failed {len(failed)} of {len(report)} expectations:"]
        lines += [f"  - {_describe_failure(r)}" for r in failed]
        raise ValidationError("\n".join(lines), report)
    return {**summary, "name": name, "success": True, "expectations": len(report), "report": report}


def _as_object(df: pd.DataFrame, columns: Iterable[str]) -> pd.DataFrame:
    """Object dtype for per-value type checks (GX 1.24 mis-handles pandas 3's ``str`` dtype)."""
    out = df.copy()
    for c in columns:
        if c in out.columns:
            out[c] = out[c].astype(object)
    return out


def _required(
    gxe: Any, table: str, df: pd.DataFrame, columns: Sequence[str]
) -> tuple[list[_Check], list[str]]:
    checks = [_Check(table, gxe.ExpectTableColumnsToMatchSet(column_set=list(columns), exact_match=False))]
    return checks, [c for c in columns if c in df.columns]


# --------------------------------------------------------------------------- datasets


def validate_dataset(
    df: pd.DataFrame,
    *,
    name: str,
    max_prompt_chars: int,
    splits: Sequence[str] = ("train", "test"),
    min_rows_per_split: int = 1,
    id_column: str = "id",
    prompt_column: str = "prompt",
    split_column: str = "split",
    required_columns: Sequence[str] = (),
    tests_column: str | None = None,
    min_tests: int = 1,
    max_tests: int | None = None,
) -> dict[str, Any]:
    """Validate problem rows (all splits in one frame with a ``split`` column) before they are written.

    Checks: required columns exist and are non-null; ids are str/int and unique; prompts are
    non-empty strings of at most ``max_prompt_chars``; split values are in ``splits`` and each split
    has at least ``min_rows_per_split`` rows; with ``tests_column``, every problem has between
    ``min_tests`` and ``max_tests`` tests; no prompt (whitespace-normalised) occurs in two splits.
    Returns a summary (rows, rows per split, expectation count, report); raises ValidationError.
    """
    _, gxe = _gx()
    cols = [id_column, prompt_column, split_column, *required_columns]
    if tests_column:
        cols.append(tests_column)
    cols = list(dict.fromkeys(cols))
    checks, present = _required(gxe, "rows", df, cols)
    ids = [id_column] if id_column in df.columns else []
    rows = _as_object(df, [id_column, prompt_column])
    for c in present:
        checks.append(_Check("rows", gxe.ExpectColumnValuesToNotBeNull(column=c), ids))
    if id_column in present:
        checks.append(
            _Check(
                "rows", gxe.ExpectColumnValuesToBeInTypeList(column=id_column, type_list=["str", "int"]), ids
            )
        )
        checks.append(_Check("rows", gxe.ExpectColumnValuesToBeUnique(column=id_column), ids))
    if prompt_column in present:
        checks.append(
            _Check("rows", gxe.ExpectColumnValuesToBeInTypeList(column=prompt_column, type_list=["str"]), ids)
        )
        checks.append(
            _Check(
                "rows",
                gxe.ExpectColumnValueLengthsToBeBetween(
                    column=prompt_column, min_value=1, max_value=max_prompt_chars
                ),
                ids,
            )
        )
    if split_column in present:
        checks.append(
            _Check("rows", gxe.ExpectColumnValuesToBeInSet(column=split_column, value_set=list(splits)), ids)
        )
    tables: dict[str, pd.DataFrame] = {}
    if tests_column and tests_column in present:
        count_col = f"n_{tests_column}"

        def _count(v: Any) -> float:
            return float(len(v)) if isinstance(v, (list, tuple, np.ndarray)) else math.nan

        rows[count_col] = rows[tests_column].map(_count)
        checks.append(
            _Check(
                "rows",
                gxe.ExpectColumnValuesToNotBeNull(column=count_col),  # None or a non-list value
                ids,
            )
        )
        checks.append(
            _Check(
                "rows",
                gxe.ExpectColumnValuesToBeBetween(column=count_col, min_value=min_tests, max_value=max_tests),
                ids,
            )
        )
    tables["rows"] = rows
    split_counts: dict[str, int] = {}
    if split_column in present:
        counts = df[split_column].value_counts(dropna=True)
        split_counts = {s: int(counts.get(s, 0)) for s in splits}
        tables["split_counts"] = pd.DataFrame(
            {"split": list(split_counts), "rows": list(split_counts.values())}
        )
        checks.append(
            _Check(
                "split_counts",
                gxe.ExpectColumnValuesToBeBetween(column="rows", min_value=min_rows_per_split),
                ["split"],
            )
        )
        if prompt_column in present:
            pairs = df[[prompt_column, split_column]].dropna()
            pairs = pairs[pairs[prompt_column].map(lambda p: isinstance(p, str))]
            norm = pairs[prompt_column].map(lambda p: " ".join(p.split()))
            uniq = pd.DataFrame({"prompt": norm.astype(object), "split": pairs[split_column].astype(object)})
            tables["prompts_by_split"] = uniq.drop_duplicates().reset_index(drop=True)
            checks.append(
                _Check("prompts_by_split", gxe.ExpectColumnValuesToBeUnique(column="prompt"), ["split"])
            )
    report = _run(f"dataset_{_safe(name)}", tables, checks)
    return _finish("dataset", name, report, {"rows": len(df), "splits": split_counts})


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)[:40] or "data"


# --------------------------------------------------------------------------- reward vectors


def reward_vectors_frame(
    items: Iterable[tuple[Hashable, np.ndarray, np.ndarray]], *, dim_names: Sequence[str] | None = None
) -> pd.DataFrame:
    """Long-format reward table from ``(problem_id, values (n, d), present (d,))`` items: one row per
    problem x sample x dimension with columns problem_id, sample, dim, value, present (+ dim_name)."""
    frames = []
    for problem_id, values, present in items:
        arr = np.asarray(values, dtype=np.float64)
        if arr.ndim == 1:
            arr = arr[None, :]
        mask = np.asarray(present, dtype=bool)
        n, d = arr.shape
        if mask.shape != (d,):
            raise ValueError(
                f"problem {problem_id!r}: present mask has shape {mask.shape}, values have {d} dimensions"
            )
        frame = pd.DataFrame(
            {
                "problem_id": [problem_id] * (n * d),
                "sample": np.repeat(np.arange(n), d),
                "dim": np.tile(np.arange(d), n),
                "value": arr.reshape(-1),
                "present": np.tile(mask, n),
            }
        )
        if dim_names is not None:
            if len(dim_names) != d:
                raise ValueError(f"problem {problem_id!r}: {len(dim_names)} dim_names for {d} dimensions")
            frame["dim_name"] = np.tile(np.asarray(dim_names, dtype=object), n)
        frames.append(frame)
    if not frames:
        return pd.DataFrame(
            {c: pd.Series(dtype=t) for c, t in zip(REWARD_COLUMNS, (object, int, int, float, bool))}
        )
    return pd.concat(frames, ignore_index=True)


def validate_reward_vectors(
    df: pd.DataFrame,
    *,
    name: str,
    num_dims: int | None = None,
    expected_present: Mapping[Hashable, int] | None = None,
) -> dict[str, Any]:
    """Validate a long-format reward table (see :func:`reward_vectors_frame`).

    Checks: the columns exist; ids, sample, dim, present are non-null; each (problem, sample, dim)
    occurs once; every vector has ``num_dims`` dimensions (default: the most common count, so all
    vectors must agree); present is boolean; values of present dimensions are non-null and in
    [0, 1] (inf fails); absent dimensions are NaN; every vector has >= 1 present dimension and,
    with ``expected_present`` (problem_id -> count, e.g. the number of tests), exactly that many.
    """
    _, gxe = _gx()
    checks, present_cols = _required(gxe, "rows", df, list(REWARD_COLUMNS))
    ids = [c for c in ("problem_id", "sample", "dim") if c in df.columns]
    rows = df.copy()
    for c in ("problem_id", "sample", "dim", "present"):
        if c in present_cols:
            checks.append(_Check("rows", gxe.ExpectColumnValuesToNotBeNull(column=c), ids))
    if len(present_cols) == len(REWARD_COLUMNS):
        rows["present"] = rows["present"].astype(object)
        checks.append(
            _Check("rows", gxe.ExpectColumnValuesToBeInTypeList(column="present", type_list=["bool"]), ids)
        )
        checks.append(
            _Check(
                "rows", gxe.ExpectCompoundColumnsToBeUnique(column_list=["problem_id", "sample", "dim"]), ids
            )
        )
        is_present = rows["present"].map(lambda v: v is True or v is np.True_)
        where_present = {"row_condition": "present == True", "condition_parser": "pandas"}
        where_absent = {"row_condition": "present == False", "condition_parser": "pandas"}
        checks += [
            _Check("rows", gxe.ExpectColumnValuesToNotBeNull(column="value", **where_present), ids),
            _Check(
                "rows",
                gxe.ExpectColumnValuesToBeBetween(
                    column="value", min_value=0.0, max_value=1.0, **where_present
                ),
                ids,
            ),
            _Check("rows", gxe.ExpectColumnValuesToBeNull(column="value", **where_absent), ids),
        ]
        keys = ["problem_id", "sample"]
        grouped = rows.groupby(keys, dropna=False, sort=False)
        rows["dims_in_vector"] = grouped["dim"].transform("count").astype("int64")
        rows["present_dims"] = (
            is_present.groupby([rows[k] for k in keys], dropna=False, sort=False)
            .transform("sum")
            .astype("int64")
        )
        if num_dims is not None:
            expected_d = num_dims
        else:  # the most common dimension count over vectors: the odd ones out are reported
            per_vector = grouped["dim"].count()
            expected_d = (
                int(per_vector.value_counts().sort_index(ascending=False).idxmax()) if len(per_vector) else 0
            )
        checks.append(
            _Check(
                "rows", gxe.ExpectColumnValuesToBeInSet(column="dims_in_vector", value_set=[expected_d]), ids
            )
        )
        checks.append(
            _Check("rows", gxe.ExpectColumnValuesToBeBetween(column="present_dims", min_value=1), ids)
        )
        if expected_present is not None:
            rows["expected_present_dims"] = (
                rows["problem_id"].map(lambda p: expected_present.get(p, -1)).astype("int64")
            )
            checks.append(
                _Check(
                    "rows",
                    gxe.ExpectColumnPairValuesToBeEqual(
                        column_A="present_dims", column_B="expected_present_dims"
                    ),
                    ids,
                )
            )
    report = _run(f"rewards_{_safe(name)}", {"rows": rows}, checks)
    n_vectors = (
        int(df.groupby(["problem_id", "sample"]).ngroups)
        if {"problem_id", "sample"} <= set(df.columns)
        else 0
    )
    n_problems = int(df["problem_id"].nunique()) if "problem_id" in df.columns else 0
    return _finish(
        "reward vectors", name, report, {"rows": len(df), "vectors": n_vectors, "problems": n_problems}
    )
