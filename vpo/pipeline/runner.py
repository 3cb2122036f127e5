"""Running stage steps: skip what is up to date, say why the rest runs, record what was produced.

:func:`run_step` is what ``vpo stage`` does (and what ``dvc repro`` calls through it): it computes the
step's fingerprint (settings, code, inputs), compares it with the record in its output, runs the
stage only when they differ ("vpo-s0: trainer.learning_rate changed 0.0001 -> 0.0005; running"),
then records the new output. :func:`run_all` is ``vpo run``: every step of the plan in order under
the run folder's lock.
"""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Sequence
from typing import Any

from vpo.atomic import remove_stale_temps, remove_temps_in
from vpo.pipeline.config import RUN_INDEPENDENT_ARM_KEYS, PipelineConfig
from vpo.pipeline.console import log, stage_done, stage_started
from vpo.pipeline.context import StageContext
from vpo.pipeline.errors import StageError
from vpo.pipeline.graph import Step, plan, stage
from vpo.pipeline.layout import RunLayout, arm_runs
from vpo.pipeline.settings import check_hardware
from vpo.pipeline.state import Fingerprint, code_hashes, content_digest, read_state, why_stale, write_state

__all__ = ["fingerprint", "run_all", "run_step", "staleness"]


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


def _disk_full(exc: BaseException) -> bool:
    """Whether an error is a full disk (OSError ENOSPC/EDQUOT, or torch's writer failing mid-file)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or ("enforce fail" in text and (
                "unexpected pos" in text or "file write failed" in text)):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


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
    if step.stage.name in ("train", "evaluate", "search"):
        check_hardware(cfg)  # a GPU setting the machine cannot honour: one clear error before any work
    t0 = time.time()
    ctx = StageContext(cfg, layout, step.stage.name, step.run, fp, progress=progress)
    try:
        summary = step.stage.run(ctx)
        if state_path is not None:
            _record(step, layout, fp, summary)
    except (OSError, RuntimeError) as exc:
        if not _disk_full(exc):
            raise
        out = layout.outputs(step.stage.name, step.rid)[0]
        raise StageError(f"{step.label}: the disk holding {out} is full ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0][:160]}); free space and run the stage again"
                         + (" (it resumes from the last intact checkpoint)" if step.stage.per_run else "")) from None
    stage_done(step.label, time.time() - t0, ctx.notes.get("outcome"))
    return summary


def run_all(cfg: PipelineConfig, stages: Sequence[str] | None = None, *, search: bool = True,
            force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the plan's steps in order in this process (the main job), holding the run folder's lock
    (:class:`vpo.pipeline.locking.LockBusyError` at once if another run holds it)."""
    from vpo.pipeline.locking import pipeline_lock

    layout = RunLayout.of(cfg)
    results = {}
    with pipeline_lock(layout.root, cfg.variant):
        for step in plan(cfg, stages, search=search):
            results[step.label] = run_step(cfg, step, layout=layout, force=force, progress=progress)
    return results
