"""Running stage steps: skip what is up to date, say why the rest runs, record what was produced.

:func:`run_step` is what ``vpo stage`` does (and what ``dvc repro`` calls through it): it computes the
step's fingerprint (settings, code, inputs), compares it with the record in its output, runs the
stage only when they differ ("vpo-s0: trainer.learning_rate changed 0.0001 -> 0.0005; running"),
then records the new output. :func:`run_all` is ``vpo run``: every step of the pipeline under the run
folder's lock, in order, except that independent steps (the arm x seed training runs) run side by
side, each as its own ``vpo stage train`` process with its own threads and GPUs
(:mod:`vpo.pipeline.engine.execution`, ``execution.max_parallel``). When DVC manages the variant, the
steps are then recorded in ``dvc.lock`` (:mod:`vpo.pipeline.dvc.record`), so ``dvc repro`` after
``vpo run`` re-runs nothing.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from typing import Any

from vpo.atomic import remove_stale_temps, remove_temps_in
from vpo.pipeline.config import RUN_INDEPENDENT_ARM_KEYS, PipelineConfig
from vpo.pipeline.config.layout import RunLayout, arm_runs
from vpo.pipeline.engine.console import log, shown_path, stage_done, stage_started
from vpo.pipeline.engine.context import StageContext
from vpo.pipeline.engine.errors import StageError, disk_full, full_disk_text
from vpo.pipeline.engine.execution import Concurrency, concurrency, stage_threads, torch_threads
from vpo.pipeline.engine.fanout import StageProcessFailed, run_processes
from vpo.pipeline.engine.preflight import GPU_STAGES, check_hardware, check_preflight
from vpo.pipeline.engine.state import (
    Fingerprint,
    code_hashes,
    content_digest,
    read_state,
    why_stale,
    write_state,
)
from vpo.pipeline.steps import Step, stage, steps_of

__all__ = ["StageProcessFailed", "fingerprint", "independent_groups", "run_all", "run_side_by_side", "run_step",
           "staleness"]


def _dotted(data: Any, key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _input_digest(layout: RunLayout, name: str, rid: str | None = None) -> str:
    state = read_state(layout.state_file(name, rid))
    return state["out_digest"] if state else "missing"


def fingerprint(cfg: PipelineConfig, step: Step, layout: RunLayout | None = None) -> Fingerprint:
    """The request a step answers: the values of the settings its stage reads, the hashes of its
    code files (and the task's) and the content digests of its inputs' outputs."""
    from vpo.tasks import task_source_file

    layout = layout or RunLayout.of(cfg)
    settings = cfg.settings()
    params: dict[str, Any] = {}
    for key in step.stage.params:
        if key == "arm":  # the run's own seed, not the arm's list: adding a seed leaves other runs valid
            arm = settings["arms"][step.run.arm.name] if step.run else None
            params["arm"] = {k: v for k, v in arm.items() if k not in RUN_INDEPENDENT_ARM_KEYS} if arm else None
            params["seed"] = step.run.seed if step.run else None
        elif key.startswith("trainer.") and key.split(".")[1] not in settings["trainer"]:
            continue  # a TRL setting left at its default: absent from the request (settings() omits it too)
        else:
            params[key] = _dotted(settings, key)
    task_file = task_source_file(cfg.task.name)
    code = code_hashes([*step.stage.code_files, *([task_file] if task_file else [])])
    inputs: dict[str, str] = {}
    for up in step.stage.inputs:
        if stage(up).per_run:
            for r in arm_runs(cfg):
                inputs[f"{up}@{r.rid}"] = _input_digest(layout, up, r.rid)
        else:
            inputs[up] = _input_digest(layout, up)
    return Fingerprint(params, code, inputs)


def staleness(cfg: PipelineConfig, step: Step, layout: RunLayout | None = None) -> str | None:
    """Why ``step`` has to run (None: its output is up to date and intact)."""
    layout = layout or RunLayout.of(cfg)
    if not step.stage.cached:
        return "runs every time"
    fp = fingerprint(cfg, step, layout)
    out = layout.outputs(step.stage.name, step.rid)[0]
    return why_stale(read_state(layout.state_file(step.stage.name, step.rid)), fp, out,
                     output_exists=out.exists())


def _record(step: Step, layout: RunLayout, fp: Fingerprint, summary: dict[str, Any]) -> None:
    """Write the step's record (content digest without volatile files, sizes of every kept file),
    then delete its scratch (resume state)."""
    out = layout.outputs(step.stage.name, step.rid)[0]
    for name in step.stage.scratch:
        shutil.rmtree(out / name, ignore_errors=True)
    digest, _ = content_digest([out], out, exclude=step.stage.volatile)
    _, files = content_digest([out], out)
    write_state(layout.state_file(step.stage.name, step.rid), fp, digest, files, summary)


def run_step(cfg: PipelineConfig, step: Step, *, layout: RunLayout | None = None, force: bool = False,
             progress: bool = True) -> dict[str, Any]:
    """Run one step unless its output is up to date (``force`` runs it anyway); returns its summary."""
    layout = layout or RunLayout.of(cfg)
    fp = fingerprint(cfg, step, layout)
    state_path = None
    if step.stage.cached:
        state_path = layout.state_file(step.stage.name, step.rid)
        out = layout.outputs(step.stage.name, step.rid)[0]
        state = read_state(state_path)
        reason = why_stale(state, fp, out, output_exists=out.exists())
        if reason is None and not force:
            log(f"{step.label}: up to date")
            return dict(state["summary"]) if state else {}
        verb = "retraining" if step.stage.per_run and out.exists() else "running"
        stage_started(step.label, "forced" if reason is None else reason, verb)
    else:
        stage_started(step.label, "runs every time")
    for path in layout.outputs(step.stage.name, step.rid):  # temps a killed run of this step left
        remove_stale_temps(path, older_than_s=0.0)
        if path.is_dir():
            remove_temps_in(path)
    if step.stage.name in GPU_STAGES:
        check_hardware(cfg)  # a GPU setting the machine cannot honour: one clear error before any work
    if step.stage.per_run:
        from vpo.pipeline.engine.nodes import node_role

        role = node_role(cfg)
        if role is not None and not role.is_main:  # node 0 records the run; this node only trains its share
            raise StageError(f"{step.label}: this is {role.describe().split(';')[0]}: node 0 runs the pipeline and "
                             f"records the run; here run only `vpo stage train --arm {step.run.arm.name} --seed "
                             f"{step.run.seed}` (the same command as node 0's)")
    t0 = time.time()
    ctx = StageContext(cfg, layout, step.stage.name, step.run, fp, progress=progress)
    try:
        if step.stage.per_run:  # a run's thread count is the same alone or beside others: same weights
            with torch_threads(stage_threads(cfg)):
                summary = step.stage.call(ctx)
        else:
            summary = step.stage.call(ctx)
        if state_path is not None:
            _record(step, layout, fp, summary)
    except Exception as exc:  # any writer may hit a full disk: torch, safetensors' Rust, fsspec
        full, path = disk_full(exc)
        if not full:
            raise
        where = full_disk_text(path or layout.outputs(step.stage.name, step.rid)[0])
        first = (str(exc).strip().splitlines() or [""])[0]
        raise StageError(f"{step.label}: {where}; {exc.__class__.__name__}: {first}; free space there and "
                         "run the stage again"
                         + (" (it resumes from the last intact checkpoint)" if step.stage.per_run else "")) from None
    stage_done(step.label, time.time() - t0, ctx.notes.get("outcome"))
    return summary


def independent_groups(steps: Sequence[Step]) -> list[list[Step]]:
    """The steps cut into groups run one after another: consecutive per-run steps (the training runs,
    which read the same inputs and write separate folders) form one group; every other step is a
    group of its own."""
    groups: list[list[Step]] = []
    for step in steps:
        if step.stage.per_run and groups and groups[-1][-1].stage.per_run:
            groups[-1].append(step)
        else:
            groups.append([step])
    return groups


def run_side_by_side(cfg: PipelineConfig, steps: Sequence[Step], ex: Concurrency, *, layout: RunLayout,
                     force: bool = False) -> dict[str, Any]:
    """Run independent per-run steps as ``vpo stage`` processes (:func:`run_processes`); returns
    each step's summary."""
    log(f"{len(steps)} training runs, {ex.max_parallel} at once ({ex.reason}); per-run logs in "
        f"{shown_path(layout.logs)}/*-stage-train-*.log")
    by_label = {s.label: s for s in steps}
    jobs = []
    for step in steps:
        assert step.run is not None
        jobs.append((step.label, ["stage", step.stage.name, *cfg.cli_args(), "--arm", step.run.arm.name,
                                  "--seed", str(step.run.seed), *(["--force"] if force else [])]))
    results: dict[str, Any] = {}

    def done(label: str) -> None:
        step = by_label[label]
        state = read_state(layout.state_file(step.stage.name, step.rid))
        results[label] = dict(state["summary"]) if state else {}

    run_processes(jobs, ex, layout=layout, on_done=done)
    return results


def run_all(cfg: PipelineConfig, stages: Sequence[str] | None = None, *, search: bool = True,
            force: bool = False, progress: bool = True, record: bool = True) -> dict[str, Any]:
    """Run the pipeline's steps (the main job) holding the run folder's lock
    (:class:`vpo.pipeline.engine.locking.LockBusyError` at once if another run holds it): in order, the
    training runs side by side when ``execution.max_parallel`` allows (those already up to date are
    said so here, without a process each); then, with ``record``, record them in ``dvc.lock`` when
    DVC manages this variant."""
    from vpo.pipeline.engine.locking import pipeline_lock

    layout = RunLayout.of(cfg)
    steps = steps_of(cfg, stages, search=search)
    check_preflight(cfg, [s.stage.name for s in steps])  # packages and devices, before the data stage
    results: dict[str, Any] = {}
    with pipeline_lock(layout.root, cfg.variant):
        for group in independent_groups(steps):
            if len(group) > 1 and not force:  # up to date: said here, no process started for it
                current = [s for s in group if staleness(cfg, s, layout) is None]
                for step in current:
                    results[step.label] = run_step(cfg, step, layout=layout, progress=progress)
                group = [s for s in group if s not in current]
            ex = concurrency(cfg, len(group)) if len(group) > 1 else None
            if ex is not None and ex.max_parallel > 1:
                results.update(run_side_by_side(cfg, group, ex, layout=layout, force=force))
                continue
            for step in group:
                results[step.label] = run_step(cfg, step, layout=layout, force=force, progress=progress)
        if record:
            from vpo.pipeline.dvc.record import record_steps

            record_steps(cfg, [s for s in steps if s.stage.in_dvc])
    return results
