"""The Prefect ``retrain`` flow: the pipeline's stages as tasks, then push, register and publish.

One flow run is one retrain::

    dvc pull (only outputs missing from the workspace; if storage.dvc_remote is set)
    -> data -> rewards -> base -> train@<arm>-s<seed> ... -> evaluate [-> search]   (one task each)
    -> dvc push (if a remote is set; retried with exponential backoff)
    -> register (checkpoints into storage.registry; only after the push)
    -> publish (markdown report with the best@k PNG, metrics and registry tables)

The steps come from the stage table (:mod:`flows.plan`). **DVC is the cache authority** when it
manages the pipeline: each stage task runs ``dvc repro --single-item <variant>-<stage>`` and DVC's
lock decides whether the stage re-runs (the stage itself also skips work its output already
answers). ``overrides`` (``vpo flow --set``, or a deployment run's parameters in the UI) run the
``vpo stage`` CLI with those settings instead. **Registration comes after the push**, so a registry
entry never refers to DVC outputs the remote does not hold. Logs and artifacts pass through
:func:`vpo.pipeline.storage.redact`; S3 credentials only ever come from the ``AWS_*`` variables.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact
from prefect.runtime import flow_run as runtime_flow_run
from prefect.tasks import exponential_backoff

from flows.plan import artifact_slug, make_plan
from flows.report import publish, publish_failure
from flows.tasks import (
    ProgressSpec,
    dvc_cmd,
    dvc_pull,
    dvc_push,
    progress_markdown,
    register,
    run_stage,
    vpo_cmd,
)
from vpo.pipeline.layout import RunLayout
from vpo.pipeline.names import variant_name
from vpo.pipeline.storage import redact

__all__ = ["retrain", "serve"]


def _flow_run_name() -> str:
    params = runtime_flow_run.parameters or {}
    variant = variant_name(str(params.get("pipeline", "route")), bool(params.get("quick", False)))
    return f"retrain-{variant}-{datetime.now(UTC):%Y%m%d-%H%M%S}"


@flow(name="retrain", flow_run_name=_flow_run_name, log_prints=True)
def retrain(
    pipeline: str = "route",
    quick: bool = False,
    config: str = "pipelines.yaml",
    overrides: dict[str, Any] | None = None,
    retry_delay_s: float = 10.0,
) -> dict[str, Any]:
    """Retrain a pipeline: pull, stages (retried with backoff), push, register, publish artifacts.

    ``overrides`` maps dotted settings to values (``{"trainer.max_steps": 10}``), as ``vpo --set``;
    ``retry_delay_s`` is the first retry delay of every task; later retries double it.
    """
    logger = get_run_logger()
    plan = make_plan(pipeline, quick, config, overrides)
    logger.info("retrain %s: %d stages in %s; %s; DVC remote %s; registry %s", plan.variant, len(plan.steps),
                plan.repo, plan.mode_note, redact(plan.remote_url or "none"), redact(plan.registry_url))
    backoff = exponential_backoff(max(0.0, float(retry_delay_s)))
    sync = plan.use_dvc and plan.remote_url is not None
    layout = RunLayout(plan.run_dir, plan.variant)
    stage_task = run_stage.with_options(retry_delay_seconds=backoff)
    results: list[dict[str, Any]] = []
    current = "dvc-pull"
    try:
        pulled = None
        if sync:
            pulled = dvc_pull.with_options(retry_delay_seconds=backoff)(
                str(plan.repo), plan.remote_url, plan.remote_name, plan.missing_targets()
            )
        for step in plan.steps:
            current = step.label
            progress = None
            if step.run_id:
                artifact = create_progress_artifact(
                    progress=0.0, key=f"{artifact_slug(plan.variant)}-train-{artifact_slug(step.run_id)}",
                    description=progress_markdown(f"{plan.variant}: train@{step.run_id}", []))
                progress = ProgressSpec(artifact_id=str(artifact),
                                        progress_file=str(layout.arm_progress(step.run_id)))
            cmd = dvc_cmd("repro", "--single-item", step.dvc_stage) if plan.use_dvc else vpo_cmd(*step.argv)
            results.append(stage_task.with_options(task_run_name=step.label)(
                step.label, cmd, str(plan.repo), plan.use_dvc, plan.variant, progress))
        pushed = None
        if sync:
            current = "dvc-push"
            pushed = dvc_push.with_options(retry_delay_seconds=backoff)(
                str(plan.repo), plan.remote_url, plan.remote_name, plan.dvc_targets
            )
        current = "register"
        entries = register.with_options(retry_delay_seconds=backoff)(plan)
        current = "publish"
        return publish(plan, results, pulled, pushed, entries)
    except BaseException as exc:  # the report says what failed and what completed, then the flow fails
        try:
            publish_failure(plan, results, current, exc)
        except Exception as report_exc:  # noqa: BLE001 (never hide the real failure behind a reporting one)
            logger.warning("could not publish the failure report: %s", report_exc)
        raise


def serve(
    pipeline: str = "route",
    quick: bool = False,
    config: str = "pipelines.yaml",
    cron: str = "0 3 * * *",
    name: str = "nightly",
    overrides: dict[str, Any] | None = None,
) -> None:
    """Serve ``retrain`` as a cron deployment from this process (``flow.serve``: no work pool needed).
    ``overrides`` become the deployment's default parameter; a run from the UI may change them."""
    make_plan(pipeline, quick, config, overrides)  # fail now on a bad config, not at 03:00
    params = {"pipeline": pipeline, "quick": quick, "config": str(Path(config).resolve()),
              "overrides": dict(overrides or {})}
    retrain.serve(
        name=name,
        cron=cron,
        parameters=params,
        tags=["vpo", "retrain"],
        description=f"Scheduled retrain of {variant_name(pipeline, quick)} ({cron}, UTC)",
    )
