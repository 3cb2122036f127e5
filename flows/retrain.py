"""The Prefect ``retrain`` flow: the pipeline's stages as tasks, then push, register and publish.

One flow run is one retrain::

    dvc pull (only outputs missing from the workspace; if storage.dvc_remote is set)
    -> data -> rewards -> base -> train@<arm>-s<seed> ... (side by side) -> evaluate [-> search]
    -> dvc push (if a remote is set; retried with exponential backoff)
    -> register (checkpoints into storage.registry; only after the push)
    -> publish (markdown report with the best@k PNG, metrics and registry tables)

The steps come from the stage table (:mod:`flows.flow_run`). **DVC is the cache authority** when it
manages the pipeline: a lone stage task runs ``dvc repro --single-item <variant>-<stage>`` and DVC's
lock decides whether it re-runs; the training runs are submitted side by side (at most
``execution.max_parallel`` at once, each with its own torch threads and GPUs), run as the commands
``dvc.yaml`` gives them (each skips work its output already answers) and are recorded with one
``dvc commit``. ``overrides`` (``vpo flow --set``, or a deployment run's parameters in the UI) run the
``vpo stage`` CLI with those settings instead. **Registration comes after the push**, so a registry
entry never refers to DVC outputs the remote does not hold. Each training run holds a Prefect global
concurrency limit while it trains (:mod:`flows.locks`), so the same run never trains in two places.

**Work-pool mode** (``arms_on="train-arm/<deployment>"``, ``vpo flow --arms-on``): each training
run is a flow run of the ``train-arm`` deployment (:mod:`flows.arm`) on a work pool, so arms land on
different workers (machines). The inputs go to the DVC remote first; each worker pulls them, trains,
pushes its outputs and returns its ``dvc.lock`` record; this flow writes the records into its
``dvc.lock`` and pulls the outputs, then evaluates as usual. Logs and artifacts pass through
:func:`vpo.pipeline.engine.storage.redact`; S3 credentials only ever come from the ``AWS_*`` variables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run as runtime_flow_run
from prefect.tasks import exponential_backoff

from flows.dvclock import merge_entries, read_entries
from flows.flow_run import FlowRun, StageStep, flow_run
from flows.locks import train_limit
from flows.report import publish, publish_failure
from flows.tasks import (
    PermanentStageFailure,
    ProgressSpec,
    dvc_cmd,
    dvc_commit,
    dvc_pull,
    dvc_push,
    open_progress,
    register,
    run_stage,
    train_on_pool,
    vpo_cmd,
)
from vpo.pipeline.config.layout import RunLayout
from vpo.pipeline.config.names import variant_name
from vpo.pipeline.engine.processes import children_stop_first
from vpo.pipeline.engine.storage import redact

__all__ = ["retrain", "serve"]


def _flow_run_name() -> str:
    params = runtime_flow_run.parameters or {}
    variant = variant_name(str(params.get("pipeline", "route")), bool(params.get("quick", False)))
    return f"retrain-{variant}-{datetime.now(UTC):%Y%m%d-%H%M%S}"


def _progress(run: FlowRun, layout: RunLayout, step: StageStep) -> ProgressSpec | None:
    """A training run's progress artifact (none for a stage that is not a training run)."""
    return open_progress(run.variant, step.run_id, layout.arm_progress(step.run_id)) if step.run_id else None


def _side_by_side(steps: list[StageStep], slots: int, submit: Callable[[StageStep, int], PrefectFuture[Any]],
                  results: list[dict[str, Any]]) -> None:
    """Submit ``steps`` with at most ``slots`` running at once (``submit(step, slot)``); when one
    fails, start no new one, let the running ones finish, then raise the first failure."""
    pending, free = list(steps), list(range(slots))
    running: dict[PrefectFuture[Any], int] = {}
    failure: BaseException | None = None
    while pending or running:
        while pending and free and failure is None:
            slot = free.pop(0)
            running[submit(pending.pop(0), slot)] = slot
        future = next(iter(as_completed(list(running))))  # the first one to finish
        free.append(running.pop(future))
        try:
            results.append(future.result())
        except BaseException as exc:  # noqa: BLE001 (re-raised once the others have finished)
            failure = failure or exc
    if failure is not None:
        raise failure


def _train_locally(run: FlowRun, layout: RunLayout, group: list[StageStep], backoff: Any,
                   results: list[dict[str, Any]]) -> None:
    """The training runs of ``group`` as stage tasks, side by side, each in its own slot."""
    logger = get_run_logger()
    logger.info("%s", run.parallel_note)
    stage_task = run_stage.with_options(retry_delay_seconds=backoff)

    def submit(step: StageStep, slot: int) -> PrefectFuture[Any]:
        spec = _progress(run, layout, step)
        cmd = vpo_cmd(*(step.variant_argv if run.use_dvc else step.argv))
        env = run.slots[slot].env() if run.slots else None
        return stage_task.with_options(task_run_name=step.label).submit(
            step.label, cmd, str(run.repo), False, run.variant, spec, env, train_limit(run.variant, step.run_id or ""))

    _side_by_side(group, max(1, run.max_parallel), submit, results)
    if run.use_dvc:  # recorded as `dvc repro` would have: a later repro re-runs none of them
        dvc_commit.with_options(retry_delay_seconds=backoff)(str(run.repo), [s.dvc_stage for s in group])


def _train_on_pool(run: FlowRun, group: list[StageStep], done_before: list[StageStep], deployment: str,
                   backoff: Any, results: list[dict[str, Any]]) -> None:
    """The training runs of ``group`` as flow runs of ``deployment`` on its work pool: inputs pushed,
    each run started at once, their dvc.lock records merged here and their outputs pulled."""
    if not (run.use_dvc and run.remote_url):
        raise PermanentStageFailure(
            "arms_on (work-pool mode) exchanges inputs and outputs through the DVC remote: it needs the "
            "repository's DVC stages (no --set overrides) and storage.dvc_remote")
    logger = get_run_logger()
    inputs = [s.dvc_stage for s in done_before]
    dvc_push.with_options(retry_delay_seconds=backoff)(str(run.repo), run.remote_url, run.remote_name, inputs)
    records = read_entries(run.repo, inputs)
    config = str(run.config.relative_to(run.repo)) if run.config.is_relative_to(run.repo) else run.config.name
    logger.info("%d training runs on work pool deployment %s (inputs %s pushed to %s)", len(group), deployment,
                ", ".join(inputs), redact(run.remote_url))
    futures = [train_on_pool.with_options(task_run_name=f"{step.label} on {deployment}").submit(
        deployment, step.label, {"pipeline": run.pipeline, "quick": run.quick, "config": config, "arm": step.arm,
                                 "seed": step.seed, "inputs": records, "settings_digest": run.settings_digest},
        f"{runtime_flow_run.id}-{step.label}")
        for step in group]
    outcomes: list[dict[str, Any]] = []
    failure: BaseException | None = None
    for future in futures:
        try:
            outcomes.append(future.result())
        except BaseException as exc:  # noqa: BLE001 (re-raised after the others)
            failure = failure or exc
    if failure is not None:
        raise failure
    for out in outcomes:
        where = out.get("worker") or {}
        logger.info("%s trained on %s (pid %s, checkout %s) from %s to %s: %s", out["stage"], where.get("host"),
                    where.get("pid"), where.get("checkout"), out.get("started"), out.get("ended"), out.get("outcome"))
    merge_entries(run.repo, {o["dvc_stage"]: o["lock"] for o in outcomes})
    dvc_pull.with_options(retry_delay_seconds=backoff)(str(run.repo), run.remote_url, run.remote_name,
                                                       [s.dvc_stage for s in group], force=True)
    results.extend({k: v for k, v in o.items() if k in ("stage", "outcome", "seconds", "last numbers", "where")}
                   for o in outcomes)


@flow(name="retrain", flow_run_name=_flow_run_name, log_prints=True)
def retrain(
    pipeline: str = "route",
    quick: bool = False,
    config: str = "pipelines.yaml",
    overrides: dict[str, Any] | None = None,
    retry_delay_s: float = 10.0,
    arms_on: str | None = None,
) -> dict[str, Any]:
    """Retrain a pipeline: pull, stages (retried with backoff; training runs side by side), push,
    register, publish artifacts.

    ``overrides`` maps dotted settings to values (``{"trainer.max_steps": 10}``), as ``vpo --set``;
    ``retry_delay_s`` is the first retry delay of every task; later retries double it. ``arms_on``
    names a ``train-arm`` deployment (``"train-arm/train-arm-process"``): each training run becomes a
    flow run of it on its work pool.
    """
    with children_stop_first():  # a signal stops the stage processes before Prefect's engine sees it
        return _retrain(pipeline, quick, config, overrides, retry_delay_s, arms_on)


def _retrain(pipeline: str, quick: bool, config: str, overrides: dict[str, Any] | None, retry_delay_s: float,
             arms_on: str | None) -> dict[str, Any]:
    logger = get_run_logger()
    run = flow_run(pipeline, quick, config, overrides)
    logger.info("retrain %s: %d stages in %s; %s; DVC remote %s; registry %s", run.variant, len(run.steps),
                run.repo, run.mode_note, redact(run.remote_url or "none"), redact(run.registry_url))
    backoff = exponential_backoff(max(0.0, float(retry_delay_s)))
    sync = run.use_dvc and run.remote_url is not None
    layout = RunLayout(run.run_dir, run.variant)
    stage_task = run_stage.with_options(retry_delay_seconds=backoff)
    results: list[dict[str, Any]] = []
    current = "dvc-pull"
    done: list[StageStep] = []
    try:
        pulled = None
        if sync:
            pulled = dvc_pull.with_options(retry_delay_seconds=backoff)(
                str(run.repo), run.remote_url, run.remote_name, run.missing_targets()
            )
        for group in run.groups():
            current = ", ".join(s.label for s in group)
            if group[0].per_run and arms_on:
                _train_on_pool(run, group, done, arms_on, backoff, results)
            elif group[0].per_run:
                _train_locally(run, layout, group, backoff, results)
            else:
                step = group[0]
                cmd = dvc_cmd("repro", "--single-item", step.dvc_stage) if run.use_dvc else vpo_cmd(*step.argv)
                results.append(stage_task.with_options(task_run_name=step.label)(
                    step.label, cmd, str(run.repo), run.use_dvc, run.variant, None))
            done += group
        pushed = None
        if sync:
            current = "dvc-push"
            pushed = dvc_push.with_options(retry_delay_seconds=backoff)(
                str(run.repo), run.remote_url, run.remote_name, run.dvc_targets
            )
        current = "register"
        entries = register.with_options(retry_delay_seconds=backoff)(run)
        current = "publish"
        return publish(run, results, pulled, pushed, entries)
    except BaseException as exc:  # the report says what failed and what completed, then the flow fails
        try:
            publish_failure(run, results, current, exc)
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
    """Serve ``retrain`` as a cron deployment from this process (a Prefect ``Runner``: no work pool
    needed) with the concurrency limit ``prefect.yaml``'s deployments have (one run at a time, later
    ones queued); its schedule is paused when serving stops. ``overrides`` become the deployment's
    default parameter; a run from the UI may change them.

    SIGTERM, SIGHUP and SIGINT stop it as the runner's own shutdown does, awaited: every flow run it
    started is cancelled (each stops its stage processes first, :func:`retrain`), the schedule is
    paused; then :class:`vpo.pipeline.engine.processes.Terminated` (``KeyboardInterrupt`` for SIGINT) is
    raised, so the caller says one line and exits 128 + the signal."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.runner import Runner

    flow_run(pipeline, quick, config, overrides)  # fail now on a bad config, not at 03:00
    params = {"pipeline": pipeline, "quick": quick, "config": str(Path(config).resolve()),
              "overrides": dict(overrides or {})}
    runner = Runner(name=name, pause_on_shutdown=True, limit=1)
    runner.add_flow(
        retrain,
        name=name,
        cron=cron,
        parameters=params,
        tags=["vpo", "retrain"],
        description=f"Scheduled retrain of {variant_name(pipeline, quick)} ({cron}, UTC)",
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
    )
    with _said_once_per_change("prefect.runner", "scheduled runs skipped (at capacity)"):
        signum = _run_until_signalled(runner)
    if signum is not None:
        import signal

        from vpo.pipeline.engine.processes import Terminated

        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def _run_until_signalled(runner: Any) -> int | None:
    """Run ``runner`` until a stop signal; the signal (None: it stopped by itself). The first SIGTERM,
    SIGHUP or SIGINT awaits ``runner.astop()`` in the runner's own event loop (the flow runs it started
    are cancelled and waited for) instead of leaving the loop with runs still going; a second one while
    stopping is ignored (the runner kills what does not stop within its grace period)."""
    import asyncio
    import signal

    received: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        serving = asyncio.current_task()
        assert serving is not None

        async def stop() -> None:
            if runner.started:
                await runner.astop()
            else:  # still registering the deployment: nothing runs yet
                serving.cancel()

        def on_signal(signum: int) -> None:
            if not received:
                received.append(signum)
                loop.create_task(stop())

        for sig in (signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, on_signal, sig)
        # Runner.start() installs handle_sigterm with signal.signal: hand the signal to the loop
        runner.handle_sigterm = lambda *_: loop.call_soon_threadsafe(on_signal, signal.SIGTERM)
        try:
            await runner.start()
        except asyncio.CancelledError:
            if not received:
                raise

    asyncio.run(main())
    return received[0] if received else None


class _ChangedOnly:
    """A logging filter passing a record whose message contains ``text`` only when it differs from the
    last one it passed (the runner logs "N scheduled runs skipped (at capacity)" at every poll)."""

    def __init__(self, text: str) -> None:
        self.text, self.last = text, None

    def filter(self, record: Any) -> bool:
        message = record.getMessage()
        if self.text not in message:
            return True
        if message == self.last:
            return False
        self.last = message
        return True


@contextmanager
def _said_once_per_change(logger: str, text: str) -> Iterator[None]:
    import logging

    flt = _ChangedOnly(text)
    logging.getLogger(logger).addFilter(flt)
    try:
        yield
    finally:
        logging.getLogger(logger).removeFilter(flt)
