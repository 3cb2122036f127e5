"""great_expectations gates for datasets and reward vectors: good data passes with a summary, each
kind of bad data fails with a message naming the expectation, the column and example rows."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from vpo.pipeline.validation import (
    REWARD_COLUMNS,
    ValidationError,
    reward_vectors_frame,
    validate_dataset,
    validate_reward_vectors,
)


def dataset(n_train: int = 4, n_test: int = 3, tests: bool = True) -> pd.DataFrame:
    rows = [
        {"id": f"{split}-{i}", "prompt": f"Route {split} problem number {i}", "split": split}
        for split, n in (("train", n_train), ("test", n_test))
        for i in range(n)
    ]
    df = pd.DataFrame(rows)
    if tests:
        df["tests"] = [[{"in": j, "out": j}] * (1 + j % 3) for j in range(len(df))]
    return df


def failing(exc: ValidationError) -> dict[tuple[str, object], dict]:
    return {(r["expectation"], r["column"]): r for r in exc.failures}


def test_good_dataset_passes_with_summary() -> None:
    summary = validate_dataset(
        dataset(), name="route", max_prompt_chars=64, tests_column="tests", min_rows_per_split=3
    )
    assert summary["success"] is True and summary["rows"] == 7
    assert summary["splits"] == {"train": 4, "test": 3}
    assert summary["expectations"] == len(summary["report"]) >= 10
    assert all(r["success"] for r in summary["report"])
    json.dumps(summary)  # artifact-ready


def test_gx_is_imported_lazily() -> None:
    code = "import sys, vpo.pipeline.validation; print('great_expectations' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_progress_bars_on_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    validate_dataset(dataset(tests=False), name="quiet", max_prompt_chars=64)
    err = capfd.readouterr().err
    assert "Calculating Metrics" not in err and "it/s" not in err


def test_bad_rows_are_named_with_expectation_column_and_row_ids() -> None:
    df = dataset()
    df["prompt"] = df["prompt"].astype(object)  # as read back from mixed-type JSONL
    df.loc[1, "prompt"] = None
    df.loc[2, "prompt"] = 12345
    df.loc[3, "prompt"] = "x" * 200
    df.loc[5, "split"] = "validation"
    df.at[6, "tests"] = []
    with pytest.raises(ValidationError) as err:
        validate_dataset(df, name="route", max_prompt_chars=64, tests_column="tests")
    exc = err.value
    fails = failing(exc)
    msg = str(exc)
    assert msg.startswith("dataset 'route' failed ")
    assert fails[("expect_column_values_to_not_be_null", "prompt")]["examples"] == [
        {"prompt": None, "id": "train-1"}
    ]
    assert fails[("expect_column_values_to_be_in_type_list", "prompt")]["examples"] == [
        {"prompt": 12345, "id": "train-2"}
    ]
    assert fails[("expect_column_value_lengths_to_be_between", "prompt")]["examples"][0]["id"] == "train-3"
    assert fails[("expect_column_values_to_be_in_set", "split")]["examples"] == [
        {"split": "validation", "id": "test-1"}
    ]
    assert fails[("expect_column_values_to_be_between", "n_tests")]["examples"] == [
        {"n_tests": 0.0, "id": "test-2"}
    ]
    assert (
        "expect_column_values_to_not_be_null on column 'prompt'" in msg
        and "[id='train-1'] prompt=None" in msg
    )
    assert "max_value=64" in msg and "(200 chars)" in msg
    assert "[id='test-1'] split='validation'" in msg
    json.dumps(exc.report)


def test_missing_column_is_reported_once_without_crashing() -> None:
    df = dataset().drop(columns=["prompt"])
    with pytest.raises(ValidationError) as err:
        validate_dataset(df, name="d", max_prompt_chars=64)
    [fail] = err.value.failures
    assert fail["expectation"] == "expect_table_columns_to_match_set"
    assert fail["details"]["mismatched"]["missing"] == ["prompt"]
    assert "'missing': ['prompt']" in str(err.value)


def test_duplicate_prompts_across_splits_but_not_within_a_split() -> None:
    df = dataset(tests=False)
    df.loc[0, "prompt"] = df.loc[1, "prompt"]  # within train: allowed (e.g. two seeds of one problem)
    assert validate_dataset(df, name="d", max_prompt_chars=64)["success"]
    df.loc[5, "prompt"] = "  " + df.loc[2, "prompt"].replace(" ", "   ") + "\n"  # test copy of a train prompt
    with pytest.raises(ValidationError) as err:
        validate_dataset(df, name="d", max_prompt_chars=64)
    [fail] = err.value.failures
    assert (fail["table"], fail["expectation"], fail["column"]) == (
        "prompts_by_split",
        "expect_column_values_to_be_unique",
        "prompt",
    )
    assert {ex["split"] for ex in fail["examples"]} == {"train", "test"}
    assert "Route train problem number 2" in str(err.value)


def test_split_row_counts_and_duplicate_ids() -> None:
    df = dataset(n_train=5, n_test=1, tests=False)
    df.loc[1, "id"] = df.loc[0, "id"]
    with pytest.raises(ValidationError) as err:
        validate_dataset(
            df, name="d", max_prompt_chars=64, splits=("train", "test", "dev"), min_rows_per_split=2
        )
    fails = failing(err.value)
    counts = fails[("expect_column_values_to_be_between", "rows")]
    assert counts["table"] == "split_counts"
    assert sorted(ex["split"] for ex in counts["examples"]) == ["dev", "test"]
    assert [ex["id"] for ex in fails[("expect_column_values_to_be_unique", "id")]["examples"]] == [
        "train-0",
        "train-0",
    ]


def test_test_counts_bounds_and_non_list_values() -> None:
    df = dataset()
    df.at[0, "tests"] = "not a list"
    with pytest.raises(ValidationError) as err:
        validate_dataset(df, name="d", max_prompt_chars=64, tests_column="tests", min_tests=1, max_tests=2)
    fails = failing(err.value)
    assert fails[("expect_column_values_to_not_be_null", "n_tests")]["examples"][0]["id"] == "train-0"
    too_many = fails[("expect_column_values_to_be_between", "n_tests")]
    assert {ex["n_tests"] for ex in too_many["examples"]} == {3.0}


# --------------------------------------------------------------------------- reward vectors


def good_rewards() -> pd.DataFrame:
    return reward_vectors_frame(
        [
            ("p0", np.array([[0.0, 1.0, np.nan], [0.5, 0.25, np.nan]]), np.array([True, True, False])),
            ("p1", np.array([[1.0, 0.0, 0.75]]), np.array([True, True, True])),
        ],
        dim_names=["t0", "t1", "t2"],
    )


def test_reward_frame_layout() -> None:
    df = good_rewards()
    assert list(df.columns) == [*REWARD_COLUMNS, "dim_name"]
    assert len(df) == 9 and df["present"].dtype == bool
    p0 = df[(df.problem_id == "p0") & (df["sample"] == 1)]
    assert p0["value"].tolist()[:2] == [0.5, 0.25] and np.isnan(p0["value"].tolist()[2])
    with pytest.raises(ValueError, match="present mask has shape"):
        reward_vectors_frame([("p", np.zeros((1, 3)), np.ones(2, dtype=bool))])


def test_good_reward_vectors_pass() -> None:
    summary = validate_reward_vectors(
        good_rewards(), name="route", num_dims=3, expected_present={"p0": 2, "p1": 3}
    )
    assert (summary["success"], summary["vectors"], summary["problems"]) == (True, 3, 2)
    json.dumps(summary)


def test_reward_values_out_of_range_nan_where_present_and_value_where_absent() -> None:
    df = good_rewards()
    df.loc[0, "value"] = 1.5
    df.loc[1, "value"] = np.inf
    df.loc[6, "value"] = np.nan  # p1 dim 0 is present
    df.loc[2, "value"] = 0.3  # p0 sample 0 dim 2 is absent
    with pytest.raises(ValidationError) as err:
        validate_reward_vectors(df, name="rv")
    fails = failing(err.value)
    rng = fails[("expect_column_values_to_be_between", "value")]
    assert {(ex["problem_id"], ex["sample"], ex["dim"]) for ex in rng["examples"]} == {
        ("p0", 0, 0),
        ("p0", 0, 1),
    }
    assert fails[("expect_column_values_to_not_be_null", "value")]["examples"][0]["problem_id"] == "p1"
    absent = fails[("expect_column_values_to_be_null", "value")]
    assert absent["examples"] == [{"value": 0.3, "problem_id": "p0", "sample": 0, "dim": 2}]
    msg = str(err.value)
    assert "on column 'value' where present == True" in msg and "value=inf" in msg
    assert "on column 'value' where present == False" in msg


def test_reward_dimension_count_per_problem() -> None:
    df = good_rewards()
    short = df.drop(index=[8])  # p1's vector lost its last dimension
    with pytest.raises(ValidationError) as err:
        validate_reward_vectors(short, name="rv", num_dims=3)
    fail = failing(err.value)[("expect_column_values_to_be_in_set", "dims_in_vector")]
    assert {ex["problem_id"] for ex in fail["examples"]} == {"p1"} and fail["unexpected_count"] == 2
    with pytest.raises(ValidationError) as err:
        validate_reward_vectors(df, name="rv", expected_present={"p0": 3, "p1": 3})
    fail = failing(err.value)[("expect_column_pair_values_to_be_equal", "present_dims")]
    assert {ex["problem_id"] for ex in fail["examples"]} == {"p0"}
    assert "on columns 'present_dims' and 'expected_present_dims'" in str(err.value)


def test_reward_duplicates_non_bool_present_and_all_absent() -> None:
    df = pd.concat([good_rewards(), good_rewards().iloc[[0]]], ignore_index=True)
    with pytest.raises(ValidationError) as err:
        validate_reward_vectors(df, name="rv")
    count, dup = sorted(err.value.failures, key=lambda r: r["expectation"])
    assert (dup["expectation"], dup["column"]) == (
        "expect_compound_columns_to_be_unique",
        ["problem_id", "sample", "dim"],
    )
    assert dup["unexpected_count"] == 2 and "[problem_id='p0', sample=0, dim=0]" in str(err.value)
    assert count["column"] == "dims_in_vector" and {ex["dims_in_vector"] for ex in count["examples"]} == {4}
    df = good_rewards()
    df["present"] = df["present"].astype(object)
    df.loc[6, "present"] = 1
    df.loc[[3, 4, 5], "present"] = False
    df.loc[[3, 4], "value"] = np.nan
    with pytest.raises(ValidationError) as err:
        validate_reward_vectors(df, name="rv")
    fails = failing(err.value)
    assert fails[("expect_column_values_to_be_in_type_list", "present")]["examples"][0]["problem_id"] == "p1"
    assert fails[("expect_column_values_to_be_between", "present_dims")]["examples"][0]["problem_id"] == "p0"


def test_reward_missing_columns() -> None:
    with pytest.raises(ValidationError) as err:
        validate_reward_vectors(good_rewards().drop(columns=["present"]), name="rv")
    assert err.value.failures[0]["details"]["mismatched"]["missing"] == ["present"]
