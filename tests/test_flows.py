"""The Prefect ``retrain`` flow end to end, against a Prefect test server and the loopback S3 server.

* ``quick_flow`` (session fixture, conftest.py) runs the whole flow once on the quick preset in a
  temporary git + DVC repository whose DVC remote is ``s3://<bucket>/dvc`` and registry
  ``s3://<bucket>/registry``, with the ``VPO_FAULT_ONCE=train@vpo-s0`` hook armed: that task fails
  its first attempt and must be retried. Several tests inspect that one run (stages, artifacts,
  registry lineage, retries, secrets); test_dvc_pipeline.py reproduces a copy of its repository.
* A failing great_expectations check (a code dataset whose test split repeats a train prompt) stops
  the flow at ``data`` without retrying, with a report naming the expectation and the rows.
* Object-store outage: the S3 server is stopped in the middle of ``dvc push`` (after the N-th
  object PUT); the push task retries with backoff and completes once the server is back, and only
  then are checkpoints registered, every entry's objects present. If the outage outlasts the
  retries, the flow fails and nothing is registered.

Pure helpers (run resolution, failure parsing, tables) have fast tests without any server.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from uuid import UUID

import pytest
import yaml

from flows import flow_run as fr
from flows import report, tasks
from flows import retrain as rt
from tests.support.repos import DVC, REPO, FlowResult, copy_repo, make_repo, run
from vpo.pipeline.engine.checkpoints import content_hash
from vpo.pipeline.engine.storage import scan_for_secrets, secret_values
from vpo.pipeline.registry import Registry

QUICK_LABELS = {"data", "rewards", "base", "train@grpo-s0", "train@vpo-s0", "train@grpo_x3-s0", "train@max_at_k-s0",
                "evaluate", "search"}


# --------------------------------------------------------------------------- fast: no servers


def test_plan_uses_dvc_stages_for_the_repo_config_and_cli_otherwise(tmp_path: Path) -> None:
    """The repo's pipelines.yaml + dvc.yaml -> DVC mode; another config file -> direct `vpo stage`."""
    run = fr.flow_run("route", True, REPO / "pipelines.yaml")
    assert run.use_dvc and run.variant == "route-quick"
    assert [s.label for s in run.steps][:3] == ["data", "rewards", "base"]
    assert {s.label for s in run.steps} == QUICK_LABELS
    assert run.steps[-1].dvc_stage == "route-quick-search"
    other = tmp_path / "other.yaml"
    shutil.copy(REPO / "pipelines.yaml", other)
    assert not fr.flow_run("route", True, other).use_dvc


def test_plan_refuses_a_stale_dvc_yaml(tmp_path: Path) -> None:
    """A dvc.yaml that lacks some of the pipeline's train stages is an error, not a silent fallback."""
    make_repo(tmp_path / "repo")
    raw = yaml.safe_load((tmp_path / "repo" / "pipelines.yaml").read_text())
    raw["pipelines"]["route"]["quick"].setdefault("arms", {}).setdefault("vpo", {})["seeds"] = [0, 7]
    (tmp_path / "repo" / "pipelines.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(RuntimeError, match=r"stale.*train@vpo-s7.*vpo dvc"):
        fr.flow_run("route", True, tmp_path / "repo" / "pipelines.yaml")


def test_validation_failure_parsing_and_retry_policy() -> None:
    """The GX message is cut from stage output; permanent failures skip the retry policy."""
    lines = [
        "Running stage 'x':",
        "error: dataset 'p/data' failed 1 of 11 expectations:",
        "  - expect_column_values_to_be_unique on column 'prompt': 2 of 4 rows unexpected",
        "ERROR: failed to reproduce 'x': failed to run: vpo stage data, exited with 2",
    ]
    msg = tasks.validation_failure(lines)
    assert msg is not None and msg.splitlines()[0] == "dataset 'p/data' failed 1 of 11 expectations:"
    assert msg.splitlines()[1].startswith("  - expect_column_values_to_be_unique")
    assert tasks.validation_failure(["all good"]) is None
    assert tasks._inner_rc(tasks._Result(rc=255, tail=lines, seconds=1.0), use_dvc=True) == 2
    state = mock.Mock(data=tasks.DataValidationFailed("x"))
    assert tasks._retryable(mock.Mock(), mock.Mock(), state) is False
    state.data = tasks.StageFailed("transient")
    assert tasks._retryable(mock.Mock(), mock.Mock(), state) is True
    state.data = tasks.InjectedFault("once")
    assert tasks._retryable(mock.Mock(), mock.Mock(), state) is True


def test_artifact_keys_and_tables() -> None:
    """Keys are lowercase/digits/dashes; metrics and registry rows flatten what the stages wrote."""
    assert fr.artifact_slug("Code_Qwen-quick") == "code-qwen-quick"
    metrics = {
        "arms": {
            "vpo": {
                "runs": ["vpo-s0"],
                "best_at_k": {"1": {"mean": 0.25}, "5": {"mean": 0.5}},
                "pass_at_k": {"5": {"mean": 0.75}},
                "reward_diversity": {"mean": 0.1},
                "collapsed_runs": 0,
            }
        }
    }
    assert report.metrics_rows(metrics) == [
        {"arm": "vpo", "runs": 1, "best@1": 0.25, "best@5": 0.5, "pass@5": 0.75, "diversity": 0.1, "collapsed": "0/1"}
    ]
    reg = {
        "registry": "s3://b/registry",
        "entries": [
            {
                "arm": "vpo-s0",
                "artifact": "route-quick-vpo-s0",
                "version": "v0.0.2",
                "hash": "ab" * 32,
                "git_rev": "c" * 40,
                "dvc_lock_sha256": "d" * 64,
                "files": [{}, {}],
                "size_bytes": 10,
                "lineage": {"estimator": "vpo", "num_answers": 3, "seed": 0},
                "metrics": {"eval": {"best_at_k": {"1": 0.5}}},
            }
        ]
    }
    row = report.registry_rows(reg)[0]
    assert row == {"run": "vpo-s0", "model": "route-quick-vpo-s0 v0.0.2", "hash": "ab" * 8,
                   "git rev": "c" * 12, "dvc.lock": "d" * 12, "best@1": 0.5}
    assert list(row)[-1] == "model"  # the long name last: the UI's table shows the metrics without scrolling


# --------------------------------------------------------------------------- helpers over the API


def _client() -> Any:
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _task_runs(flow_run_id: UUID) -> dict[str, Any]:
    """Task runs of a flow run by name (run_stage tasks are named after their stage label)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with _client() as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r for r in runs}


def _state_names(task_run_id: UUID) -> list[str]:
    with _client() as client:
        return [s.name for s in client.read_task_run_states(task_run_id)]


def _artifacts(flow_run_id: UUID) -> dict[str, Any]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with _client() as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in arts if a.key}


def _logs(flow_run_id: UUID) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    out: list[str] = []
    with _client() as client:
        while True:
            page = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                limit=200,
                offset=len(out),
            )
            out += [log.message for log in page]
            if len(page) < 200:
                return out


def _table(artifact: Any) -> list[dict[str, Any]]:
    data = artifact.data
    return json.loads(data) if isinstance(data, str) else data


def _set_storage(repo: Path, bucket: str) -> None:
    """Point the repo's route pipeline at another bucket and regenerate params.yaml (storage is no DVC
    stage's param: no stage re-runs)."""
    path = repo / "pipelines.yaml"
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    raw["pipelines"]["route"]["storage"].update(
        dvc_remote=f"s3://{bucket}/dvc", registry=f"s3://{bucket}/registry"
    )
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    run([sys.executable, "-m", "vpo.pipeline.cli", "dvc"], repo)


# --------------------------------------------------------------------------- progress polling

_FAKE_TRAINER = """
import json, os, sys, time
path = sys.argv[1]
for step in (1, 2, 3):
    time.sleep(1.5)
    numbers = {"reward": 0.1 * step, "E max": 0.2 * step, "diversity": 1.0, "parse": 0.9, "loss": 0.01}
    with open(path + ".tmp", "w") as fh:
        json.dump({"step": step, "max_steps": 3, "numbers": numbers}, fh)
    os.replace(path + ".tmp", path)
time.sleep(1.0)
"""


@pytest.mark.integration
def test_train_progress_file_is_polled_into_the_progress_artifact(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a (fake) train subprocess writes progress.json, the task pushes each step to the artifact:
    its progress and, as its description, a table of the steps with reward, E max, diversity, parse
    rate and loss (newest first)."""
    from prefect import flow
    from prefect.artifacts import create_progress_artifact

    seen: list[float] = []
    tables: list[str] = []
    real = tasks.update_progress_artifact

    def spy(artifact_id: UUID, progress: float, description: str | None = None) -> Any:
        seen.append(progress)
        if description is not None:
            tables.append(description)
        return real(artifact_id=artifact_id, progress=progress, description=description)

    monkeypatch.setattr(tasks, "update_progress_artifact", spy)
    progress_file = tmp_path / "progress.json"
    (tmp_path / "progress.json").write_text(
        json.dumps({"step": 9, "max_steps": 9})
    )  # stale: older than start
    time.sleep(0.05)

    @flow(name="progress-probe")
    def probe() -> tasks.ProgressSpec:
        # a second copy under the same key, as a create that the API client sent twice leaves: never updated
        create_progress_artifact(progress=0.0, key="probe-train-probe-s0")
        spec = tasks.open_progress("probe", "probe-s0", progress_file)
        cmd = [sys.executable, "-c", _FAKE_TRAINER, str(progress_file)]
        tasks.run_stage("train@probe-s0", cmd, str(tmp_path), False, "probe", spec)
        return spec

    state = probe(return_state=True)
    assert state.is_completed()
    spec = state.result()
    assert spec.key == "probe-train-probe-s0"
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with _client() as client:  # the copy is gone: one artifact under the key, the one the task updated
        under_key = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[spec.key])))
    assert [str(a.id) for a in under_key] == [spec.artifact_id]
    assert any("removed a second progress artifact" in line for line in _logs(state.state_details.flow_run_id))
    assert seen == [33.3, 66.7, 100.0, 100.0]
    assert len(tables) == 3 and "| step | reward | E max | diversity | parse rate | loss |" in tables[-1]
    rows = [ln for ln in tables[-1].splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert rows == ["| 3 | 0.300 | 0.600 | 1.000 | 90% | 0.010 |", "| 2 | 0.200 | 0.400 | 1.000 | 90% | 0.010 |",
                    "| 1 | 0.100 | 0.200 | 1.000 | 90% | 0.010 |"]
    arts = _artifacts(state.state_details.flow_run_id)
    assert float(arts["probe-train-probe-s0"].data) == 100.0
    assert "| 3 | 0.300 |" in arts["probe-train-probe-s0"].description
    assert any(
        "train@probe-s0: step 2/3" in line
        for line in _logs(state.state_details.flow_run_id)
    )


def test_training_runs_are_one_group_run_as_dvc_yaml_commands(tmp_path: Path) -> None:
    """The flow run's groups: the arm x seed runs together (side by side), every other stage alone; in
    DVC mode a training run's command is the one dvc.yaml gives it (recorded with `dvc commit`)."""
    run = fr.flow_run("route", True, REPO / "pipelines.yaml")
    groups = [[s.label for s in g] for g in run.groups()]
    assert groups == [["data"], ["rewards"], ["base"],
                      ["train@grpo-s0", "train@vpo-s0", "train@grpo_x3-s0", "train@max_at_k-s0"],
                      ["evaluate"], ["search"]]
    vpo = next(s for s in run.steps if s.label == "train@vpo-s0")
    assert vpo.variant_argv[:4] == ("stage", "train", "--variant", "route-quick")
    assert vpo.variant_argv[-4:] == ("--arm", "vpo", "--seed", "0")
    dvc_yaml = yaml.safe_load((REPO / "dvc.yaml").read_text())
    assert dvc_yaml["stages"]["route-quick-train"]["do"]["cmd"].startswith("bin/vpo stage train --variant route-quick")
    assert run.max_parallel >= 1 and len(run.slots) == run.max_parallel and "training runs" in run.parallel_note


@pytest.mark.parametrize(("tail", "use_dvc", "outcome"), [
    (["Stage 'route-quick-data' didn't change, skipping"], True, "up to date"),
    (["[vpo] train@vpo-s0: up to date", '{"stage": "train"}'], False, "up to date"),
    (["[vpo] train@grpo-s0: up to date"], False, "ran"),  # another stage's line says nothing about this one
    (["[vpo] train@vpo-s0: not built yet; running", "[vpo] train@vpo-s0: done in 3 s"], False, "ran"),
])
def test_a_stage_that_did_not_need_to_run_says_up_to_date(tail: list[str], use_dvc: bool, outcome: str) -> None:
    assert tasks.stage_outcome("train@vpo-s0" if not use_dvc else "data", tail, use_dvc) == outcome


def test_progress_of_an_up_to_date_run_shows_its_last_training() -> None:
    """An artifact at 100 % never says "waiting for the first step": an up-to-date run shows the steps
    its last training logged."""
    rows = [(2, 4, {"reward": 0.25}), (4, 4, {"reward": 0.5, "parse": 0.9})]
    text = tasks.progress_markdown("route-quick: train@vpo-s0", rows, "up to date")
    assert text.splitlines()[0] == "**route-quick: train@vpo-s0** up to date, step 4/4"
    assert "| 4 | 0.500 |" in text and "waiting" not in text
    assert tasks.progress_markdown("x", [], "up to date").splitlines()[0] == "**x** up to date"


def test_work_pool_mode_needs_the_dvc_remote(tmp_path: Path) -> None:
    """`arms_on` exchanges inputs and outputs through the DVC remote: without DVC stages and a remote
    it is one clear permanent failure, before anything trains."""
    other = tmp_path / "other.yaml"
    shutil.copy(REPO / "pipelines.yaml", other)
    run = fr.flow_run("route", True, other)
    with pytest.raises(tasks.PermanentStageFailure, match="storage.dvc_remote"):
        rt._train_on_pool(run, run.groups()[3], [], "train-arm/x", None, [])


def test_dvc_lock_records_travel_between_checkouts(tmp_path: Path) -> None:
    """A record written into another checkout's dvc.lock replaces that stage's record and keeps the
    rest; a stage DVC never recorded is named."""
    from flows.dvclock import merge_entries, read_entries

    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {
        "a": {"cmd": "x", "outs": [{"path": "o", "md5": "1"}]}, "b": {"cmd": "y"}}}))
    merge_entries(tmp_path, {"a": {"cmd": "x", "outs": [{"path": "o", "md5": "2"}]}, "c": {"cmd": "z"}})
    got = read_entries(tmp_path, ["a", "b", "c"])
    assert got["a"]["outs"][0]["md5"] == "2" and got["b"] == {"cmd": "y"} and got["c"] == {"cmd": "z"}
    with pytest.raises(KeyError, match="records no stage d"):
        read_entries(tmp_path, ["d"])


_UP_TO_DATE_STAGE = """
import sys
print("[vpo] train@probe-s0: up to date", flush=True)
"""


@pytest.mark.integration
def test_an_up_to_date_run_reports_up_to_date_with_its_numbers(prefect_api: str, tmp_path: Path) -> None:
    """A training task whose stage is up to date: the task's outcome says so with the run's last
    numbers, and its progress artifact shows the steps its last training logged, at 100 %."""
    from prefect import flow
    from prefect.artifacts import create_progress_artifact

    progress_file = tmp_path / "progress.json"
    progress_file.write_text(json.dumps({"step": 4, "max_steps": 4, "numbers": {"reward": 0.5, "parse": 0.75},
                                         "rows": [[2, {"reward": 0.25}], [4, {"reward": 0.5, "parse": 0.75}]]}))
    time.sleep(0.05)

    @flow(name="up-to-date-probe")
    def probe() -> dict[str, Any]:
        artifact_id = create_progress_artifact(progress=0.0, key="probe-up-to-date-progress")
        spec = tasks.ProgressSpec(str(artifact_id), progress_file=str(progress_file))
        return tasks.run_stage("train@probe-s0", [sys.executable, "-c", _UP_TO_DATE_STAGE], str(tmp_path), False,
                               "probe", spec)

    state = probe(return_state=True)
    assert state.is_completed()
    result = state.result()
    assert result["outcome"] == "up to date" and result["last numbers"] == "reward 0.500  parse 75%"
    art = _artifacts(state.state_details.flow_run_id)["probe-up-to-date-progress"]
    assert float(art.data) == 100.0
    assert art.description.startswith("**train@probe-s0** up to date, step 4/4") and "| 2 | 0.250 |" in art.description


# --------------------------------------------------------------------------- the whole flow, once


@pytest.mark.slow
@pytest.mark.integration
def test_flow_runs_every_stage_then_pushes_registers_publishes(quick_flow: FlowResult) -> None:
    """Every stage task ran (DVC re-ran each, nothing was cached), then pull, push, register, publish."""
    assert quick_flow.state.is_completed(), quick_flow.state.message
    result = quick_flow.state.result()
    assert {s["stage"]: s["outcome"] for s in result["stages"]} == {label: "ran" for label in QUICK_LABELS}
    runs = _task_runs(quick_flow.run_id)
    assert QUICK_LABELS <= set(runs)
    prefixes = {name.rsplit("-", 1)[0] for name in runs if name not in QUICK_LABELS}
    assert prefixes == {"dvc-pull", "dvc-commit", "dvc-push", "register", "publish"}
    assert all(r.state_type.value == "COMPLETED" for r in runs.values())
    status = run(
        [
            DVC,
            "status",
            "-c",
            "-r",
            "storage",
            *fr.flow_run("route", True, quick_flow.repo / "pipelines.yaml").dvc_targets,
        ],
        quick_flow.repo,
    )
    assert "in sync" in status.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_stage_output_reaches_the_flow_run_logs(quick_flow: FlowResult) -> None:
    """Every line a stage subprocess prints is a log record of the flow run in the API (what the UI
    shows): the stage's start and done lines, its bar's last state, the evaluation table."""
    logs = _logs(quick_flow.run_id)
    for label in ("data", "base", "train@vpo-s0", "evaluate", "search"):
        assert any(line.startswith(f"{label} | [vpo] {label}: done in") for line in logs), label
    assert any(line.startswith("train@vpo-s0 | train@vpo-s0: 4/4 step") for line in logs)
    assert any(line.startswith("evaluate | | vpo | ") for line in logs)  # the evaluation table's rows
    assert len(logs) > 100


@pytest.mark.slow
@pytest.mark.integration
def test_injected_failure_is_retried_and_the_flow_completes(quick_flow: FlowResult) -> None:
    """VPO_FAULT_ONCE=train@vpo-s0: first attempt failed, the retry ran the stage, the flow completed."""
    runs = _task_runs(quick_flow.run_id)
    vpo_run = runs["train@vpo-s0"]
    assert vpo_run.run_count == 2 and vpo_run.state_type.value == "COMPLETED"
    assert "AwaitingRetry" in _state_names(vpo_run.id)
    assert all(runs[label].run_count == 1 for label in QUICK_LABELS - {"train@vpo-s0"})
    assert any("injected failure of task 'train@vpo-s0'" in line for line in _logs(quick_flow.run_id))


@pytest.mark.slow
@pytest.mark.integration
def test_artifacts_report_metrics_registry_and_progress(quick_flow: FlowResult) -> None:
    """Markdown report with the inline best@k PNG and eval table, two tables, progress at 100 %."""
    arts = _artifacts(quick_flow.run_id)
    assert {
        "route-quick-report",
        "route-quick-metrics",
        "route-quick-registry",
        "route-quick-train-grpo-s0",
        "route-quick-train-vpo-s0",
        "route-quick-train-grpo-x3-s0",
        "route-quick-train-max-at-k-s0",
    } <= set(arts)
    report = arts["route-quick-report"]
    assert report.type == "markdown"
    md = report.data
    png_b64 = md.split("data:image/png;base64,", 1)[1].split(")", 1)[0]
    png = (quick_flow.repo / "runs" / "route-quick" / "eval" / "best_at_k.png").read_bytes()
    assert base64.b64decode(png_b64) == png and png.startswith(b"\x89PNG")
    assert "| arm | k=1 | k=3 | k=5 |" in md and all(f"| {arm} |" in md for arm in ("grpo", "vpo", "grpo_x3", "max_at_k"))
    metrics = _table(arts["route-quick-metrics"])
    assert {row["arm"] for row in metrics} == {"base-m1", "base-m3", "grpo", "vpo", "grpo_x3", "max_at_k"}
    assert all("best@5" in row and "parse rate" in row for row in metrics)
    registry = _table(arts["route-quick-registry"])
    assert sorted(row["run"] for row in registry) == ["grpo-s0", "grpo_x3-s0", "max_at_k-s0", "vpo-s0"]
    for row in registry:  # where the checkpoint is, what it is, where it came from, how it scores
        assert row["model"] == f"route-quick-{row['run']} (unversioned)"  # the flow commits no dvc.lock
        assert len(row["git rev"]) >= 12 and row["dvc.lock"] != "none" and 0 <= row["best@5"] <= 1
    for key in ("route-quick-train-grpo-s0", "route-quick-train-vpo-s0", "route-quick-train-grpo-x3-s0"):
        assert arts[key].type == "progress" and float(arts[key].data) == 100.0, key
        table = arts[key].description  # the steps' numbers, updated with the progress
        assert "| step | reward | E max | diversity | parse rate | loss |" in table, table
        assert "step 4/4" in table and all(f"\n| {step} | " in table for step in (1, 2, 3, 4)), table  # every step
    for table in md.split("\n\n"):  # every table of the report is narrow enough to read in the UI
        if table.startswith("| "):
            assert table.splitlines()[0].count("|") <= 10, table.splitlines()[0]


@pytest.mark.slow
@pytest.mark.integration
def test_registry_holds_every_checkpoint_with_lineage(quick_flow: FlowResult) -> None:
    """S3 registry: one verified entry per arm run, with git rev, dvc.lock hash, params and metrics."""
    repo = quick_flow.repo
    reg = Registry(f"s3://{quick_flow.bucket}/registry", repo)
    entries = reg.scan()[0]
    assert sorted(e.arm for e in entries) == ["grpo-s0", "grpo_x3-s0", "max_at_k-s0", "vpo-s0"]
    head = run(["git", "rev-parse", "HEAD"], repo).stdout.strip()
    lock_sha = hashlib.sha256((repo / "dvc.lock").read_bytes()).hexdigest()
    for e in entries:
        assert reg.verify(e) == []  # fetched back through DVC (the cache, or the S3 remote) and re-hashed
        assert e.git_rev == head and e.dvc_lock_sha256 == lock_sha
        assert e.lineage["pipeline"] == "route" and e.lineage["quick"] is True
        assert e.lineage["estimator"] == {"grpo-s0": "grpo", "vpo-s0": "vpo", "grpo_x3-s0": "grpo", "max_at_k-s0": "max_at_k"}[e.arm]
        assert e.params["trainer"]["max_steps"] == 4 and "best_at_k" in e.metrics["eval"]
        model = repo / "runs" / "route-quick" / "arms" / str(e.arm) / "model"
        model_files = {p.relative_to(model).as_posix() for p in model.rglob("*") if p.is_file()}
        assert sorted(f.path for f in e.files) == sorted(model_files - set(e.left_out) - {"README.md"})
        assert e.lineage["base_hash"] == content_hash(repo / "runs" / "route-quick" / "base")


@pytest.mark.slow
@pytest.mark.integration
def test_no_secret_in_logs_artifacts_registry_or_repo_files(quick_flow: FlowResult, s3_server: Any) -> None:
    """The S3 keys of the session appear in no flow log, artifact, registry entry or repository file."""
    secrets = secret_values()
    assert s3_server.secret_key in secrets and s3_server.access_key in secrets
    logs = "\n".join(_logs(quick_flow.run_id))
    assert len(logs) > 1000 and not any(s in logs for s in secrets)
    for art in _artifacts(quick_flow.run_id).values():
        assert not any(s in str(art.data) for s in secrets), art.key
    client = s3_server.client()
    for obj in client.list_objects_v2(Bucket=quick_flow.bucket, Prefix="registry/entries/")["Contents"]:
        body = client.get_object(Bucket=quick_flow.bucket, Key=obj["Key"])["Body"].read().decode()
        assert not any(s in body for s in secrets)
    repo = quick_flow.repo
    assert (
        scan_for_secrets([repo / p for p in ("pipelines.yaml", "dvc.yaml", "dvc.lock", ".dvc", "runs")]) == []
    )


# --------------------------------------------------------------------------- great_expectations gate


_BAD_PIPELINES = """\
version: 1
default: corrupt
pipelines:
  corrupt:
    description: a code dataset whose test split repeats a train prompt (whitespace differs)
    task: {name: code, params: {source: corrupt.jsonl}}
    model: {builder: tiny}
    dataset: {splits: [train, test], max_prompt_chars: 4000, min_rows_per_split: 1, tests_column: tests}
    arms: [{name: grpo, estimator: grpo, seeds: [0]}]
    storage: {registry: runs/registry, runs_dir: runs}
"""


def _write_corrupt_dataset(folder: Path) -> None:
    tests = [
        {"input": "1 2\n", "output": "3\n", "type": "stdio"},
        {"input": "5 5\n", "output": "10\n", "type": "stdio"},
    ]
    rows = [
        {
            "id": "add-train",
            "prompt": "Read two integers and print their sum.",
            "split": "train",
            "tests": tests,
        },
        {
            "id": "mul-train",
            "prompt": "Read two integers and print their product.",
            "split": "train",
            "tests": [{"input": "2 3\n", "output": "6\n", "type": "stdio"}],
        },
        {
            "id": "add-test",
            "prompt": "Read two integers  and print their sum.",
            "split": "test",
            "tests": tests,
        },
        {
            "id": "sub-test",
            "prompt": "Read two integers and print their difference.",
            "split": "test",
            "tests": [{"input": "5 3\n", "output": "2\n", "type": "stdio"}],
        },
    ]
    (folder / "corrupt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "pipelines.yaml").write_text(_BAD_PIPELINES, encoding="utf-8")


@pytest.mark.slow
@pytest.mark.integration
def test_failed_expectation_stops_the_flow_with_a_report(prefect_api: str, tmp_path: Path) -> None:
    """A duplicated prompt across splits fails GX in `data`: no retry, nothing downstream, a report."""
    _write_corrupt_dataset(tmp_path)
    state = rt.retrain(
        pipeline="corrupt",
        quick=False,
        config=str(tmp_path / "pipelines.yaml"),
        retry_delay_s=0.1,
        return_state=True,
    )
    assert state.is_failed()
    assert "expect_column_values_to_be_unique" in state.message and "prompt" in state.message
    flow_run_id = state.state_details.flow_run_id
    runs = _task_runs(flow_run_id)
    assert set(runs) == {"data"} and runs["data"].run_count == 1 and runs["data"].state_type.value == "FAILED"
    report = _artifacts(flow_run_id)["corrupt-validation-failure"]
    assert "expect_column_values_to_be_unique" in report.data and "on column 'prompt'" in report.data
    assert "split='train'" in report.data and "split='test'" in report.data
    assert "Read two integers and print their sum." in report.data
    assert not (tmp_path / "runs" / "corrupt" / "data").exists()
    assert not (tmp_path / "runs" / "registry").exists()
    failed = _artifacts(flow_run_id)["corrupt-report"].data  # the run report, for a failed run too
    assert failed.startswith("# Retrain FAILED: `corrupt` at `data`")
    assert "**Error** (DataValidationFailed): stage data stopped the flow" in failed
    assert "## Completed\n\n_nothing_" in failed and "`train@grpo-s0`" in failed and "`register`" in failed
    assert "\n- expect_column_values_to_be_unique" in failed and "```" not in failed  # wraps, never cut off


# --------------------------------------------------------------------------- S3 outage during push


@contextlib.contextmanager
def _outage_after_puts(
    server: Any, bucket: str, prefix: str, after: int, seconds: float | None, before_stop: Callable[[], None]
) -> Iterator[threading.Event]:
    """Stop the moto server right after the ``after``-th object PUT under ``bucket/prefix`` (moto runs
    in this process, so its backend can be wrapped); restart it ``seconds`` later (None: at exit)."""
    from moto.s3.models import S3Backend

    original = S3Backend.put_object
    fired, back = threading.Event(), threading.Event()
    count, lock = [0], threading.Lock()

    def cycle() -> None:
        before_stop()
        server.stop()
        if seconds is not None:
            time.sleep(seconds)
            server.start()
            back.set()

    def put_object(self: Any, bucket_name: str, key_name: str, *args: Any, **kwargs: Any) -> Any:
        result = original(self, bucket_name, key_name, *args, **kwargs)
        if bucket_name == bucket and key_name.startswith(prefix):
            with lock:
                count[0] += 1
                trigger = count[0] == after
            if trigger:
                fired.set()
                threading.Thread(target=cycle, name="s3-outage", daemon=True).start()
        return result

    with mock.patch.object(S3Backend, "put_object", put_object):
        try:
            yield fired
        finally:
            if seconds is not None:
                back.wait(timeout=seconds + 30)
            if not server.running:
                server.start()


@pytest.mark.slow
@pytest.mark.integration
def test_s3_outage_during_push_is_retried_and_registry_stays_consistent(
    quick_flow: FlowResult, s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Server down for 5 s after the 5th pushed object: push fails, retries with backoff, completes;
    registration happens only after it, and every entry's objects exist."""
    repo, bucket = copy_repo(quick_flow.repo, tmp_path / "repo"), s3_server.make_bucket()
    _set_storage(repo, bucket)
    monkeypatch.setenv(
        "AWS_MAX_ATTEMPTS", "1"
    )  # fail fast inside one attempt: the task retries, not botocore
    registry = f"s3://{bucket}/registry"
    seen_at_outage: list[int] = []
    with _outage_after_puts(
        s3_server,
        bucket,
        "dvc/",
        after=5,
        seconds=5.0,
        before_stop=lambda: seen_at_outage.append(len(Registry(registry, repo).store.entries()[0])),
    ) as fired:
        state = rt.retrain(
            pipeline="route",
            quick=True,
            config=str(repo / "pipelines.yaml"),
            retry_delay_s=2.0,
            return_state=True,
        )
    assert fired.is_set() and seen_at_outage == [0]
    assert state.is_completed(), state.message
    runs = _task_runs(state.state_details.flow_run_id)
    push = next(r for name, r in runs.items() if name.startswith("dvc-push"))
    assert push.run_count >= 2 and "AwaitingRetry" in _state_names(push.id)
    assert all(runs[label].run_count == 1 for label in QUICK_LABELS)
    reg = Registry(registry, repo)
    entries = reg.store.entries()[0]
    assert sorted(e.arm for e in entries) == ["grpo-s0", "grpo_x3-s0", "max_at_k-s0", "vpo-s0"]
    for e in entries:
        assert reg.verify(e) == []
    targets = fr.flow_run("route", True, repo / "pipelines.yaml").dvc_targets
    assert "in sync" in run([DVC, "status", "-c", "-r", "storage", *targets], repo).stdout


@pytest.mark.slow
@pytest.mark.integration
def test_s3_outage_outlasting_retries_fails_before_registering(
    quick_flow: FlowResult, s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Server down from the first pushed object on: every push attempt fails, the flow fails, and the
    registry holds nothing (no entry can point at objects the outage kept out)."""
    repo, bucket = copy_repo(quick_flow.repo, tmp_path / "repo"), s3_server.make_bucket()
    _set_storage(repo, bucket)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with _outage_after_puts(
        s3_server, bucket, "dvc/", after=1, seconds=None, before_stop=lambda: None
    ) as fired:
        state = rt.retrain(
            pipeline="route",
            quick=True,
            config=str(repo / "pipelines.yaml"),
            retry_delay_s=0.5,
            return_state=True,
        )
        assert fired.is_set()
    assert state.is_failed() and "dvc push" in state.message
    runs = _task_runs(state.state_details.flow_run_id)
    push = next(r for name, r in runs.items() if name.startswith("dvc-push"))
    assert push.run_count == 4 and push.state_type.value == "FAILED"
    assert not any(name.startswith(("register", "publish")) for name in runs)
    assert Registry(f"s3://{bucket}/registry", repo).store.entries()[0] == []


def test_overrides_reach_every_stage_and_leave_dvc_mode(tmp_path: Path) -> None:
    """`--set` (the flow's `overrides` parameter) becomes `--set` on every stage command; since DVC's
    stages read params.yaml, the flow run uses the CLI instead and says so."""
    run = fr.flow_run("route", True, REPO / "pipelines.yaml", {"trainer.max_steps": 7})
    assert not run.use_dvc and "overrides trainer.max_steps=7" in run.mode_note
    for step in run.steps:
        argv = list(step.argv)
        assert argv[argv.index("--set") + 1] == "trainer.max_steps=7" and "--quick" in argv, argv
    assert "trainer.max_steps=7" in run.register_argv
    from vpo.pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.max_step \(from --set\): unknown key; did you mean max_steps"):
        fr.flow_run("route", True, REPO / "pipelines.yaml", {"trainer.max_step": 7})


@pytest.mark.slow
def test_vpo_flow_passes_set_to_the_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI hands its --set values to the flow as a parameter (they are not validated and dropped)."""
    from vpo.pipeline import cli

    seen: dict[str, Any] = {}

    def fake_retrain(**kwargs: Any) -> Any:
        seen.update(kwargs)
        return mock.Mock(is_failed=lambda: False)

    monkeypatch.setattr(rt, "retrain", fake_retrain)
    assert cli.main(["flow", "--quick", "--config", str(REPO / "pipelines.yaml"), "--set", "trainer.max_steps=6",
                     "--set", "arms.vpo.seeds=[0, 1]"]) == 0
    assert seen["overrides"] == {"trainer.max_steps": 6, "arms.vpo.seeds": [0, 1]} and seen["quick"] is True


@pytest.mark.parametrize(("lines", "transient", "shown"), [
    (["Collecting", "ERROR: failed to pull data from the cloud - Checkout failed for following targets:",
      "runs/route-quick/arms/vpo-s0", "Is your cache up to date?", "runs/route-quick/live/plots/a.tsv"], False,
     "Checkout failed"),
    ([("ERROR: failed to pull data from the cloud - Can't remove the following unsaved files without "
      "confirmation. Use `-f` to force.")], False, "unsaved files"),
    (["ERROR: failed to transfer 'md5: 1a2b' - Could not connect to the endpoint URL", "ERROR: failed to push"],
     True, "Could not connect"),
    (["ERROR: failed to push data to the cloud - 3 files failed to upload"], True, "3 files failed to upload"),
])
def test_dvc_errors_show_dvcs_line_and_only_network_ones_retry(lines: list[str], transient: bool,
                                                               shown: str) -> None:
    text, is_transient = tasks.dvc_error(lines)
    assert is_transient is transient and shown in text and text.startswith("ERROR")


def test_console_prints_a_stage_failure_without_prefects_traceback() -> None:
    """`vpo flow` / `vpo ui`: a failed stage is its own error line on the console (no traceback of the flow
    code that re-raised it); any other exception keeps its traceback, and the formatter is restored."""
    import logging
    import sys

    from prefect.logging.handlers import PrefectConsoleHandler

    from flows.tasks import DataValidationFailed, console_without_stage_tracebacks

    handler = PrefectConsoleHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("prefect").addHandler(handler)

    def record(exc: Exception) -> logging.LogRecord:
        try:
            raise exc
        except (DataValidationFailed, ValueError):
            info = sys.exc_info()
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "flow failed", None, info)

    try:
        with console_without_stage_tracebacks():
            stage = handler.format(record(DataValidationFailed("stage data stopped the flow: 2 rows")))
            other = handler.format(record(ValueError("a bug")))
        after = handler.format(record(DataValidationFailed("x")))
    finally:
        logging.getLogger("prefect").removeHandler(handler)
    assert stage == "ERROR flow failed"
    assert "Traceback" in other and "ValueError: a bug" in other
    assert "Traceback" in after  # the console's own formatter is back


def test_the_runners_at_capacity_line_is_said_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    """`vpo serve` polls every few seconds; "N scheduled runs skipped (at capacity)" is said when N
    changes, not at every poll."""
    import logging

    from flows.retrain import _said_once_per_change

    logger = logging.getLogger("prefect.runner")
    with caplog.at_level(logging.INFO, logger="prefect.runner"), _said_once_per_change(
            "prefect.runner", "scheduled runs skipped (at capacity)"):
        for n in (1, 1, 1, 2, 2, 1):
            logger.info("%d scheduled runs skipped (at capacity)", n)
        logger.info("another line")
        logger.info("another line")
    said = [r.getMessage() for r in caplog.records if r.name == "prefect.runner"]
    assert said == ["1 scheduled runs skipped (at capacity)", "2 scheduled runs skipped (at capacity)",
                    "1 scheduled runs skipped (at capacity)", "another line", "another line"]
