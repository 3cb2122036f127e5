"""The ``train-arm`` flow: one training run (arm x seed) as its own flow run, for a work pool.

The ``retrain`` flow in work-pool mode (``arms_on``) starts one run of this flow per training run
through ``run_deployment``; the pool's workers pick them up, so arms land on different machines. In
the worker's checkout of the repository (the deployment's ``pull`` step sets the working directory,
``prefect.yaml``) it::

    checks its settings are the caller's (same pipelines.yaml: a settings digest)
    -> writes the caller's dvc.lock records of the inputs (data, rewards, base), dvc pull them
    -> trains (the stage command dvc.yaml gives it; a global concurrency limit keeps the same run
       from training in two places)
    -> dvc commit, dvc push its output
    -> publishes its dvc.lock record, worker and times as a markdown artifact (JSON block),
       which the caller reads back

Nothing but the DVC remote and the Prefect API connects the machines.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run as runtime_flow_run

from flows.dvclock import merge_entries, read_entries
from flows.flow_run import flow_run
from flows.locks import train_limit
from flows.tasks import (
    PermanentStageFailure,
    arm_result_key,
    dvc_commit,
    dvc_pull,
    dvc_push,
    open_progress,
    run_stage,
    vpo_cmd,
)
from vpo.pipeline.config.layout import RunLayout
from vpo.pipeline.config.names import run_id, variant_name
from vpo.pipeline.engine.processes import children_stop_first
from vpo.pipeline.engine.storage import redact

__all__ = ["train_arm"]


def _flow_run_name() -> str:
    p = runtime_flow_run.parameters or {}
    variant = variant_name(str(p.get("pipeline", "route")), bool(p.get("quick", False)))
    return f"train-{variant}-{run_id(str(p.get('arm')), int(p.get('seed', 0)))}-{datetime.now(UTC):%H%M%S}"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@flow(name="train-arm", flow_run_name=_flow_run_name, log_prints=True)
def train_arm(
    pipeline: str,
    quick: bool,
    arm: str,
    seed: int,
    inputs: dict[str, Any],
    config: str = "pipelines.yaml",
    settings_digest: str = "",
) -> dict[str, Any]:
    """Train run ``<arm>-s<seed>`` of a pipeline in this checkout from the inputs the caller recorded
    (``inputs``: their dvc.lock records), push its output and report its dvc.lock record."""
    with children_stop_first():  # a signal stops the stage process before Prefect's engine sees it
        return _train_arm(pipeline, quick, arm, seed, inputs, config, settings_digest)


def _train_arm(pipeline: str, quick: bool, arm: str, seed: int, inputs: dict[str, Any], config: str,
               settings_digest: str) -> dict[str, Any]:
    logger = get_run_logger()
    started = _now()
    run = flow_run(pipeline, quick, config)
    rid = run_id(arm, seed)
    step = next((s for s in run.steps if s.run_id == rid), None)
    if step is None:
        raise PermanentStageFailure(f"pipeline {run.variant} in {run.repo} has no enabled run {rid}")
    if not (run.use_dvc and run.remote_url):
        raise PermanentStageFailure(f"{run.repo}: a work-pool training run needs the repository's DVC stages and "
                                    "storage.dvc_remote (outputs travel through the DVC remote)")
    if settings_digest and run.settings_digest != settings_digest:
        raise PermanentStageFailure(f"the settings of {run.variant} in this worker's checkout ({run.repo}) are "
                                    "not the caller's: deploy the same revision of pipelines.yaml to every worker")
    logger.info("train %s of %s in %s (inputs from %s)", rid, run.variant, run.repo, redact(run.remote_url))
    merge_entries(run.repo, inputs)
    dvc_pull(str(run.repo), run.remote_url, run.remote_name, sorted(inputs), force=True)
    layout = RunLayout(run.run_dir, run.variant)
    spec = open_progress(run.variant, rid, layout.arm_progress(rid))
    result = run_stage.with_options(task_run_name=step.label)(
        step.label, vpo_cmd(*step.variant_argv), str(run.repo), False, run.variant, spec, None,
        train_limit(run.variant, rid))
    dvc_commit(str(run.repo), [step.dvc_stage])
    dvc_push(str(run.repo), run.remote_url, run.remote_name, [step.dvc_stage])
    report = {
        **result,
        "dvc_stage": step.dvc_stage,
        "lock": read_entries(run.repo, [step.dvc_stage])[step.dvc_stage],
        "worker": {"host": socket.gethostname(), "pid": os.getpid(), "worker_pid": os.getppid(),
                   "checkout": str(run.repo)},
        "started": started,
        "ended": _now(),
    }
    create_markdown_artifact(
        key=arm_result_key(run.variant, rid),
        markdown=redact(f"# {step.label} trained on {report['worker']['host']}\n\n"
                        f"{result['outcome']} in {result['seconds']} s, output pushed to the DVC remote.\n\n"
                        f"```json\n{json.dumps(report, indent=1, default=str)}\n```\n"),
        description=f"{run.variant}: {step.label}: dvc.lock record and worker",
    )
    return report
